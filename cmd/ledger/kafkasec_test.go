package main

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/spf13/cobra"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/identity"
)

// TestKafkaSecurityFlags checks that the Kafka TLS and SASL flags are on
// the root for every subcommand, and that they and their LEDGER_*
// variables reach the ClientConfig every Kafka client is built from, flag
// beating environment.
func TestKafkaSecurityFlags(t *testing.T) {
	pf := newRoot().PersistentFlags()
	for _, name := range []string{
		"kafka-tls", "kafka-tls-ca", "kafka-tls-cert", "kafka-tls-key",
		"kafka-tls-server-name", "kafka-tls-insecure-skip-verify",
		"kafka-sasl-mechanism", "kafka-sasl-user", "kafka-sasl-password", "kafka-sasl-token-file",
		"kafka-sasl-allow-plaintext",
	} {
		f := pf.Lookup(name)
		if f == nil {
			t.Errorf("root has no persistent --%s", name)
			continue
		}
		if f.DefValue != "" && f.DefValue != "false" {
			t.Errorf("--%s defaults to %q; want off", name, f.DefValue)
		}
	}
	if f := pf.Lookup("kafka-sasl-password"); f != nil && !strings.Contains(f.Usage, "LEDGER_KAFKA_SASL_PASSWORD") {
		t.Errorf("--kafka-sasl-password usage %q does not point to LEDGER_KAFKA_SASL_PASSWORD", f.Usage)
	}

	// run parses args under a root wired as newRoot wires the Kafka flags
	// and returns the client configuration a role would build.
	run := func(t *testing.T, args ...string) ledger.ClientConfig {
		t.Helper()
		g := &globals{}
		root := &cobra.Command{Use: "ledger", SilenceUsage: true, SilenceErrors: true}
		g.kafka.register(root.PersistentFlags())
		var got ledger.ClientConfig
		root.AddCommand(&cobra.Command{Use: "role", RunE: func(cmd *cobra.Command, _ []string) error {
			if _, err := bindEnv(cmd); err != nil {
				return err
			}
			got = g.kafka.client(nil)
			return nil
		}})
		root.SetArgs(append([]string{"role"}, args...))
		if err := root.Execute(); err != nil {
			t.Fatalf("ledger role %v: %v", args, err)
		}
		return got
	}

	t.Run("defaults", func(t *testing.T) {
		if got := run(t).Security; got != (ledger.Security{}) {
			t.Errorf("Security = %v; want the zero value (plaintext, no SASL)", got)
		}
	})

	t.Run("environment", func(t *testing.T) {
		for k, v := range map[string]string{
			"LEDGER_KAFKA_TLS":                      "true",
			"LEDGER_KAFKA_TLS_CA":                   "/etc/kafka/ca.pem",
			"LEDGER_KAFKA_TLS_CERT":                 "/etc/kafka/client.pem",
			"LEDGER_KAFKA_TLS_KEY":                  "/etc/kafka/client-key.pem",
			"LEDGER_KAFKA_TLS_SERVER_NAME":          "kafka.internal",
			"LEDGER_KAFKA_TLS_INSECURE_SKIP_VERIFY": "true",
			"LEDGER_KAFKA_SASL_MECHANISM":           "SCRAM-SHA-512",
			"LEDGER_KAFKA_SASL_USER":                "ledger",
			"LEDGER_KAFKA_SASL_PASSWORD":            "from-env",
			"LEDGER_KAFKA_SASL_TOKEN_FILE":          "/var/run/token",
			"LEDGER_KAFKA_SASL_ALLOW_PLAINTEXT":     "true",
		} {
			t.Setenv(k, v)
		}
		want := ledger.Security{
			TLS: ledger.TLS{
				Enabled: true, CAFile: "/etc/kafka/ca.pem",
				CertFile: "/etc/kafka/client.pem", KeyFile: "/etc/kafka/client-key.pem",
				ServerName: "kafka.internal", InsecureSkipVerify: true,
			},
			SASL: ledger.SASL{Mechanism: "SCRAM-SHA-512", User: "ledger", Password: "from-env", TokenFile: "/var/run/token", AllowPlaintext: true},
		}
		if diff := cmp.Diff(want, run(t).Security); diff != "" {
			t.Errorf("Security from LEDGER_* (-want +got):\n%s", diff)
		}
	})

	t.Run("flags beat environment", func(t *testing.T) {
		t.Setenv("LEDGER_KAFKA_SASL_MECHANISM", "PLAIN")
		t.Setenv("LEDGER_KAFKA_SASL_USER", "env-user")
		t.Setenv("LEDGER_KAFKA_SASL_PASSWORD", "from-env")
		t.Setenv("LEDGER_KAFKA_TLS_CA", "/env/ca.pem")
		got := run(t, "--kafka-sasl-mechanism", "oauthbearer", "--kafka-sasl-user", "flag-user",
			"--kafka-tls-ca", "/flag/ca.pem", "--kafka-tls-server-name", "flag.internal")
		want := ledger.Security{
			TLS:  ledger.TLS{CAFile: "/flag/ca.pem", ServerName: "flag.internal"},
			SASL: ledger.SASL{Mechanism: "oauthbearer", User: "flag-user", Password: "from-env"},
		}
		if diff := cmp.Diff(want, got.Security); diff != "" {
			t.Errorf("Security from flags and LEDGER_* (-want +got):\n%s", diff)
		}
	})

	t.Run("bad boolean", func(t *testing.T) {
		t.Setenv("LEDGER_KAFKA_TLS", "maybe")
		g := &globals{}
		root := &cobra.Command{Use: "ledger"}
		g.kafka.register(root.PersistentFlags())
		sub := &cobra.Command{Use: "role"}
		root.AddCommand(sub)
		if _, err := bindEnv(sub); err == nil || !strings.Contains(err.Error(), "LEDGER_KAFKA_TLS") {
			t.Errorf("bindEnv with LEDGER_KAFKA_TLS=maybe = %v; want an error naming the variable", err)
		}
	})
}

// The bench's own clients (its load, an attached run's reads, the raw
// limits) on a cluster of the operator's carry that cluster's TLS and
// SASL settings; on its in-process Kafka, none. Before, they were
// plaintext and unauthenticated whatever the flags said, so ledger bench
// --attach could not reach a secured cluster.
func TestBenchClientCarriesKafkaSecurity(t *testing.T) {
	g := &globals{}
	g.kafka.security = ledger.Security{TLS: ledger.TLS{Enabled: true}, SASL: ledger.SASL{Mechanism: "SCRAM-SHA-512", User: "bench", Password: "p"}}
	brokers := []string{"kafka-0:9093"}
	if cc := benchClient(g, false, brokers, nil); !cc.Security.TLS.Enabled || cc.Security.SASL.User != "bench" || !slices.Equal(cc.Brokers, brokers) {
		t.Errorf("on a cluster of the operator's: %+v; want its brokers with the flags' TLS and SASL", cc)
	}
	if cc := benchClient(g, true, []string{"127.0.0.1:1"}, nil); cc.Security.TLS.Enabled || cc.Security.SASL.Mechanism != "" {
		t.Errorf("on the bench's in-process Kafka: %+v; want no TLS or SASL", cc)
	}
}

// --kafka-group-prefix names a role's consumer group and transactional
// id, so that two ledgers share a Kafka cluster without rebalancing each
// other; a prefix Kafka would refuse is refused at the start, naming the
// flag. Before, the groups were ledger-intake, ledger-executor and
// ledger-reconciler, whatever the deployment.
func TestKafkaGroupPrefix(t *testing.T) {
	cc, topics, admin := roleCluster(t)
	dsn := freshSchemaDSN(t)
	args := append(roleArgs(cc, topics), "executor", "--crdb-dsn", dsn, "--data-dir", t.TempDir(), "--instance-id", "px",
		"--tools-base-url", "http://127.0.0.1:1")
	if err := cliErr(t, append(args, "--kafka-group-prefix", "staging ledger")...); err == nil || !strings.Contains(err.Error(), "--kafka-group-prefix") {
		t.Errorf("--kafka-group-prefix with a space: %v; want refused, naming the flag", err)
	}
	// A negative timeout: Kafka would use its default, and the loop's
	// leave of the group would give up at once.
	if err := cliErr(t, append(args, "--session-timeout", "-1s")...); err == nil || !strings.Contains(err.Error(), "must not be negative") {
		t.Errorf("--session-timeout -1s: %v; want refused", err)
	}
	exited := runCommand(t, append(args, "--kafka-group-prefix", "staging")...)
	adm := kadm.NewClient(admin)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		exited()
		groups, err := adm.DescribeGroups(t.Context(), "staging-executor", "ledger-executor")
		if err != nil {
			return err
		}
		if g := groups["ledger-executor"]; len(g.Members) != 0 {
			return fmt.Errorf("a member in ledger-executor: %+v", g.Members)
		}
		g := groups["staging-executor"]
		if len(g.Members) != 1 || g.Members[0].ClientID != "staging-executor-px" {
			return fmt.Errorf("staging-executor members %+v; want the executor, client id staging-executor-px (its transactional id)", g.Members)
		}
		return nil
	})
}

// A bench node on a cluster of the operator's gets the bench's group
// prefix and Kafka security settings in its environment (never its
// arguments, where the password would show); on the bench's own Kafka,
// the defaults, overriding what it inherits. Every variable is one a
// root flag reads.
func TestBenchNodeKafkaEnv(t *testing.T) {
	pf := newRoot().PersistentFlags()
	for _, name := range nodeKafkaFlags {
		if pf.Lookup(name) == nil {
			t.Errorf("nodeKafkaFlags names --%s, which the root does not have", name)
		}
	}
	g := &globals{}
	g.kafka.groupPrefix = "staging"
	g.kafka.security = ledger.Security{TLS: ledger.TLS{CAFile: "/etc/kafka/ca.pem"}, SASL: ledger.SASL{Mechanism: "SCRAM-SHA-512", User: "bench", Password: "s3cret"}}
	env := nodeKafkaEnv(g, false)
	for _, want := range []string{"LEDGER_KAFKA_GROUP_PREFIX=staging", "LEDGER_KAFKA_TLS_CA=/etc/kafka/ca.pem", "LEDGER_KAFKA_SASL_USER=bench", "LEDGER_KAFKA_SASL_PASSWORD=s3cret", "LEDGER_KAFKA_SASL_MECHANISM=SCRAM-SHA-512"} {
		if !slices.Contains(env, want) {
			t.Errorf("node environment on the operator's cluster lacks %s: %v", want, env)
		}
	}
	env = nodeKafkaEnv(g, true)
	for _, want := range []string{"LEDGER_KAFKA_GROUP_PREFIX=ledger", "LEDGER_KAFKA_TLS=false", "LEDGER_KAFKA_TLS_CA=", "LEDGER_KAFKA_SASL_MECHANISM=", "LEDGER_KAFKA_SASL_PASSWORD="} {
		if !slices.Contains(env, want) {
			t.Errorf("node environment on the bench's own Kafka lacks %s: %v", want, env)
		}
	}
}

// The commands staff call (the api, the approval queue, the reconciler's
// operators' APIs, the projector's queries) take their callers' audience
// from --staff-audience (LEDGER_STAFF_AUDIENCE), the staff's by default,
// and have no --audience, which is the intake's, the agents': one
// LEDGER_AUDIENCE that every role's configuration shares gave both the
// same audience, and an agent's assertion for a user who approves could
// approve. A staff audience empty or the agents' default is refused.
// Each role also knows the other's audience, to refuse an assertion that
// names both: the staff's commands as --agents-audience, the intake as
// --staff-audience (the same variables every role's configuration
// shares), which never becomes the intake's own.
func TestStaffCommandsAudience(t *testing.T) {
	root := newRoot()
	for _, path := range [][]string{{"api"}, {"approvals", "serve"}, {"reconciler"}, {"projector"}, {"intake"}} {
		cmd, _, err := root.Find(path)
		if err != nil {
			t.Fatalf("%v: %v", path, err)
		}
		flag, want, other, otherWant := "staff-audience", identity.ApproverAudience, "agents-audience", identity.DefaultAudience
		if path[0] == "intake" {
			flag, want, other, otherWant = "audience", identity.DefaultAudience, "staff-audience", identity.ApproverAudience
		}
		if f := cmd.Flags().Lookup(flag); f == nil || f.DefValue != want {
			t.Errorf("ledger %s --%s: %+v; want the default %s", strings.Join(path, " "), flag, f, want)
		}
		if f := cmd.Flags().Lookup(other); f == nil || f.DefValue != otherWant || !strings.Contains(f.Usage, "refused") {
			t.Errorf("ledger %s --%s: %+v; want the other role's audience, default %s, refused besides its own", strings.Join(path, " "), other, f, otherWant)
		}
		if path[0] != "intake" && cmd.Flags().Lookup("audience") != nil {
			t.Errorf("ledger %s has --audience; want only --%s", strings.Join(path, " "), flag)
		}
	}
	jwks := filepath.Join(t.TempDir(), "jwks.json")
	if err := os.WriteFile(jwks, []byte(`{"keys":[]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, aud := range []string{"", identity.DefaultAudience} {
		f := identityFlags{issuer: DevIssuer, jwksFile: jwks, audience: aud, maxLifetime: time.Hour, staff: true}
		if _, err := f.verifier(t.Context(), slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "--staff-audience") {
			t.Errorf("staff verifier with audience %q = %v; want refused, naming --staff-audience", aud, err)
		}
	}
	if _, err := (&identityFlags{issuer: DevIssuer, jwksFile: jwks, maxLifetime: time.Hour}).verifier(t.Context(), slog.New(slog.DiscardHandler)); err == nil {
		t.Errorf("intake verifier with an empty --audience started; want refused")
	}
}
