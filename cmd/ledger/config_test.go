package main

import (
	"io"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// A DSN shown in a log or a banner shows none of its secrets, wherever
// the DSN puts them, and still says where it points.
func TestRedactDSN(t *testing.T) {
	for _, tc := range []struct{ dsn, want string }{
		{"postgresql://ledger:s3cret@crdb:26257/ledger?sslmode=verify-full", "crdb:26257"},
		{"postgresql://ledger@crdb:26257/ledger?sslmode=verify-full&sslkey=/k.pem&sslpassword=s3cret", "sslmode=verify-full"},
		{"postgres://ledger@db/ledger?password=s3cret", "db/ledger"},
		{"clickhouse://ch:9000/ledger?username=ledger&password=s3cret", "username=ledger"},
		{"clickhouse://ch:9000/ledger?Password=s3cret&access_token=s3cret", "ch:9000"},
		{"host=crdb user=ledger password=s3cret", "(dsn)"},
		{"crdb:26257?password=s3cret", "(dsn)"},
	} {
		got := redactDSN(tc.dsn)
		if strings.Contains(got, "s3cret") {
			t.Errorf("redactDSN(%q) = %q: shows the secret", tc.dsn, got)
		}
		if !strings.Contains(got, tc.want) {
			t.Errorf("redactDSN(%q) = %q; want it to show %q", tc.dsn, got, tc.want)
		}
	}
}

// ledger dev takes no store, projection, tools, secrets or keys from the
// environment, which a shell set up for a deployment holds: its flags keep
// their defaults, and the variables are named as ignored. Another command
// takes them.
func TestDevTakesNoDeploymentFromTheEnvironment(t *testing.T) {
	for _, flag := range devExplicitOnly {
		t.Setenv(envName(flag), "/from/the/environment")
	}
	t.Setenv("LEDGER_LOG_LEVEL", "debug")
	root := newRoot()
	dev, _, err := root.Find([]string{"dev"})
	if err != nil {
		t.Fatal(err)
	}
	ignored, err := bindEnv(dev)
	if err != nil {
		t.Fatal(err)
	}
	for _, flag := range devExplicitOnly {
		f := dev.Flags().Lookup(flag)
		if f == nil {
			t.Errorf("dev has no --%s", flag)
			continue
		}
		if f.Value.String() != f.DefValue {
			t.Errorf("dev --%s = %q from the environment; want its default %q", flag, f.Value, f.DefValue)
		}
		if !slices.Contains(ignored, envName(flag)) {
			t.Errorf("ignored %v; want it to name %s", ignored, envName(flag))
		}
	}
	if lvl := dev.Flags().Lookup("log-level"); lvl == nil || lvl.Value.String() != "debug" {
		t.Errorf("dev --log-level not taken from LEDGER_LOG_LEVEL: the other variables still apply")
	}
	// The commands that find dev's issuer in its data directory agree
	// with dev on it: from the command line alone, whatever
	// LEDGER_DATA_DIR (a deployment's, as the image sets it) says.
	for _, path := range [][]string{{"dev"}, {"approvals", "list"}, {"control", "show"}, {"token"}, {"submit"}, {"blast-radius"}} {
		cmd, _, err := newRoot().Find(path)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := bindEnv(cmd); err != nil {
			t.Fatal(err)
		}
		if f := cmd.Flags().Lookup("data-dir"); f == nil || f.Value.String() != "./.ledger" {
			t.Errorf("%v --data-dir = %v; want ./.ledger, as dev's, whatever LEDGER_DATA_DIR says", path, f)
		}
	}
	exec, _, err := root.Find([]string{"executor"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bindEnv(exec); err != nil {
		t.Fatal(err)
	}
	if got := exec.Flags().Lookup("crdb-dsn").Value.String(); got != "/from/the/environment" {
		t.Errorf("executor --crdb-dsn = %q; want LEDGER_CRDB_DSN's value", got)
	}
}

// A list flag a parent command holds takes its variable's value once: set
// through a command's own flags and again through its inherited ones, a
// run's LEDGER_KAFKA_BROKERS=a:1,b:2 was [a:1 b:2 a:1 b:2].
func TestEnvListFlagOnce(t *testing.T) {
	t.Setenv("LEDGER_KAFKA_BROKERS", "a:1,b:2")
	root := newRoot()
	var got string
	cmd, _, err := root.Find([]string{"topics", "create"})
	if err != nil {
		t.Fatal(err)
	}
	// Run as a parsed command is: the parents' persistent flags merged
	// into its own.
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		got = cmd.Flags().Lookup("kafka-brokers").Value.String()
		return nil
	}
	root.SetArgs([]string{"topics", "create"})
	root.SetOut(io.Discard)
	if err := root.ExecuteContext(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got != "[a:1,b:2]" {
		t.Errorf("--kafka-brokers from LEDGER_KAFKA_BROKERS=a:1,b:2: %s; want [a:1,b:2]", got)
	}
}

// A role left without --registry-dir says, at Warn, that the built-in demo
// registry's tools are in force, naming them: its calls are checked or run
// by the demo's definitions, whatever the other processes load. Before, it
// loaded them without a word. A registry directory given is said at Info.
// Either names each tool version with the start of its digest, so that
// two processes' logs show whether they hold the same definitions.
func TestRegistryFallbackIsSaid(t *testing.T) {
	var logs strings.Builder
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	if _, err := (&registryFlags{}).load(logger); err != nil {
		t.Fatal(err)
	}
	if got := logs.String(); !strings.Contains(got, "level=WARN") || !strings.Contains(got, "built-in demo registry") || !strings.Contains(got, "refund_order.v1") {
		t.Errorf("log of a registry left to the demo's:\n%s\nwant a warning naming its tools", got)
	}
	logs.Reset()
	reg, err := (&registryFlags{dir: filepath.Join("..", "..", "schemas")}).load(logger)
	if err != nil {
		t.Fatal(err)
	}
	tool, err := reg.Lookup("refund_order", 1)
	if err != nil {
		t.Fatal(err)
	}
	want := "refund_order.v1=" + tool.Digest()[:len("sha256:")+12]
	if got := logs.String(); !strings.Contains(got, "level=INFO") || strings.Contains(got, "level=WARN") || !strings.Contains(got, want) {
		t.Errorf("log of a registry directory given:\n%s\nwant it at Info, naming %s", got, want)
	}
}
