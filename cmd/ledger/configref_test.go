package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// TestConfigReferenceUpToDate fails when a flag changed and deploy/CONFIG.md
// was not generated again: the reference operators read must be the flags
// the binary has.
func TestConfigReferenceUpToDate(t *testing.T) {
	var b strings.Builder
	if err := writeConfigRef(&b, newRoot()); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join("..", "..", configRefPath)
	committed, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v: generate it with `make config-reference`", err)
	}
	if got := b.String(); got != string(committed) {
		gl, cl := strings.Split(got, "\n"), strings.Split(string(committed), "\n")
		for i := range max(len(gl), len(cl)) {
			var g, c string
			if i < len(gl) {
				g = gl[i]
			}
			if i < len(cl) {
				c = cl[i]
			}
			if g != c {
				t.Fatalf("%s is stale: run `make config-reference`. First difference, line %d:\n  flags say: %s\n  file says: %s", configRefPath, i+1, g, c)
			}
		}
	}
}

// TestConfigReferenceNamesEveryFlagsVariable checks the reference against
// bindEnv's rule for a flag of a command and a global one.
func TestConfigReferenceNamesEveryFlagsVariable(t *testing.T) {
	var b strings.Builder
	if err := writeConfigRef(&b, newRoot()); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"| `--kafka-brokers` | `LEDGER_KAFKA_BROKERS` | `127.0.0.1:9092` |",
		"| `--metrics-addr` | `LEDGER_METRICS_ADDR` |",
		"| `--instance-id` | `LEDGER_INSTANCE_ID` | (the host name) |",
		"## `ledger executor`",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("reference lacks %q", want)
		}
	}
}

// Every flag's help names its value by its type: pflag takes a usage's
// first `quoted` words for that name, so that `ledger dev`'s data
// directory read "--data-dir ledger dev" in every command's help.
func TestFlagValueNames(t *testing.T) {
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		for _, fs := range []*pflag.FlagSet{c.LocalFlags(), c.PersistentFlags()} {
			fs.VisitAll(func(f *pflag.Flag) {
				if name, _ := pflag.UnquoteUsage(f); strings.ContainsAny(name, " ") {
					t.Errorf("%s --%s shows its value as %q: a usage's `quoted` words name it", c.CommandPath(), f.Name, name)
				}
			})
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(newRoot())
}
