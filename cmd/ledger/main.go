// Command ledger is Toolcall Ledger: one binary, one subcommand per role.
// `ledger dev` runs every role in one process on embedded engines.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cmd, err := newRoot().ExecuteContextC(ctx); err != nil {
		reportError(os.Stderr, cmd, err)
		os.Exit(1)
	}
}

// reportError writes why a command failed: with --json, as the API's
// errors are, {"error": {"code", "message"}} (and "status", "pointer"
// where the error has them), for the scripts that read --json's answers.
func reportError(w io.Writer, cmd *cobra.Command, err error) {
	if f := cmd.Flags().Lookup("json"); f == nil || f.Value.String() != "true" {
		fmt.Fprintln(w, "ledger:", err)
		return
	}
	e := struct {
		Code    string `json:"code"`
		Message string `json:"message"`
		Status  int    `json:"status,omitempty"`
		Pointer string `json:"pointer,omitempty"`
	}{Code: "failed", Message: err.Error()}
	var (
		api *httpapi.APIError
		de  *ledger.DecodeError
	)
	switch {
	case errors.As(err, &api):
		e.Code, e.Status, e.Pointer = api.Code, api.Status, api.Pointer
	case errors.As(err, &de):
		e.Code, e.Pointer = de.Code, de.Pointer
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"error": e})
}

// globals are the flags every subcommand shares.
type globals struct {
	logLevel  string
	logFormat string
	gcPercent int
	kafka     kafkaFlags
	httpTLS   httpTLSFlags
	// httpClient is what the ledger's HTTP clients present and trust.
	httpClient httpClientFlags
}

// defaultGCPercent is the ledger's garbage collector target. Its processes
// keep a small live heap (tens of MB: nothing per call outlives the call's
// terminal event) and allocate fast, so collecting at 5x the live heap
// rather than Go's 2x cuts about a fifth of the CPU per call for about
// 50 MB more memory (BENCHMARKS.md).
const defaultGCPercent = 400

// applyGC sets the collector's target from --gc-percent, unless GOGC is set
// in the environment: an operator's GOGC wins, as it does for any Go
// program. GOMEMLIMIT, if set, still caps the heap either way.
func (g *globals) applyGC() {
	if _, ok := os.LookupEnv("GOGC"); ok {
		return
	}
	debug.SetGCPercent(g.gcPercent)
}

func newRoot() *cobra.Command {
	g := &globals{}
	root := &cobra.Command{
		Use:           "ledger",
		Short:         "Toolcall Ledger: an exactly-once, audited execution ledger for AI-agent tool calls",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			ignored, err := bindEnv(cmd)
			if err != nil {
				return err
			}
			if len(ignored) > 0 {
				g.logger().Warn(cmd.Name()+" takes these settings from its flags only: the environment's are ignored", "variables", ignored)
			}
			g.applyGC()
			return nil
		},
	}
	pf := root.PersistentFlags()
	pf.StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	pf.StringVar(&g.logFormat, "log-format", "text", "log format: text or json")
	pf.IntVar(&g.gcPercent, "gc-percent", defaultGCPercent, "garbage collector target, as GOGC (which wins if set): higher spends memory to save CPU, -1 turns the collector off")
	g.kafka.register(pf)
	g.httpTLS.register(pf)
	g.httpClient.register(pf)
	root.AddCommand(
		newDevCmd(g),
		newIntakeCmd(g),
		newExecutorCmd(g),
		newTopicsCmd(g),
		newMigrateCmd(g),
		newSubmitCmd(g),
		newTraceCmd(g),
		newDLQCmd(g),
		newTokenCmd(g),
		newApprovalsCmd(g),
		newControlCmd(g),
		newReconcilerCmd(g),
		newCallsCmd(g),
		newProjectorCmd(g),
		newAPICmd(g),
		newBenchCmd(g),
		newChaosCmd(g),
		newConfigRefCmd(),
		newBlastRadiusCmd(g),
		newOutcomesCmd(g),
		newUnresolvedCmd(g),
		newDoctorCmd(g),
		newDemoBackendCmd(g),
	)
	return root
}

// bindEnv gives every flag that was not set on the command line the value
// of LEDGER_<FLAG_NAME> (upper case, dashes as underscores), if set: flag
// beats environment beats default. It returns the variables set for
// flags marked explicit only (see markExplicitOnly), which it ignored.
func bindEnv(cmd *cobra.Command) (ignored []string, err error) {
	// Once a flag: parsed, a command's flags hold its parents' persistent
	// ones too, and its inherited flags are those again; set twice, a
	// list (--kafka-brokers) would hold its variable's value twice.
	seen := map[string]bool{}
	visit := func(f *pflag.Flag) {
		if f.Changed || err != nil || seen[f.Name] {
			return
		}
		seen[f.Name] = true
		name := envName(f.Name)
		v, ok := os.LookupEnv(name)
		switch {
		case !ok:
		case f.Annotations[explicitOnly] != nil:
			if f.Annotations[explicitOnly][0] == "warn" {
				ignored = append(ignored, name)
			}
		default:
			if serr := f.Value.Set(v); serr != nil {
				err = fmt.Errorf("%s=%q: %w", name, v, serr)
			}
		}
	}
	cmd.Flags().VisitAll(visit)
	cmd.InheritedFlags().VisitAll(visit)
	return ignored, err
}

// explicitOnly is the annotation of a flag that bindEnv leaves to the
// command line.
const explicitOnly = "ledger_explicit_only"

// markExplicitOnly makes the named flags of fs take no value from the
// environment, and bindEnv name the variables it ignored for them. Names
// that fs lacks are skipped.
func markExplicitOnly(fs *pflag.FlagSet, names ...string) {
	for _, n := range names {
		_ = fs.SetAnnotation(n, explicitOnly, []string{"warn"})
	}
}

// flagGiven reports whether fs's flag name was given, on the command line
// or by its LEDGER_ variable, which sets its value without marking it
// changed (bindEnv).
func flagGiven(fs *pflag.FlagSet, name string) bool {
	fl := fs.Lookup(name)
	return fl != nil && (fl.Changed || fl.Value.String() != fl.DefValue)
}

// ignoreEnv is markExplicitOnly without naming the variables: for the
// flags whose variable a deployment's shell holds for other commands
// (LEDGER_DATA_DIR), where saying so on every run would be noise.
func ignoreEnv(fs *pflag.FlagSet, names ...string) {
	for _, n := range names {
		_ = fs.SetAnnotation(n, explicitOnly, []string{"quiet"})
	}
}

func (g *globals) logger() *slog.Logger {
	var level slog.Level
	if err := level.UnmarshalText([]byte(g.logLevel)); err != nil {
		level = slog.LevelInfo
	}
	opts := &slog.HandlerOptions{Level: level}
	if g.logFormat == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}
