package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/metrics"
)

// benchNodeFlags configure one ledger process of a benchmark.
type benchNodeFlags struct {
	roles     roleFlags
	ident     identityFlags
	creds     credentialFlags
	policy    policyFlags
	intake    bool
	executors int
	toolsBase string
	jwksAddr  string
	profile   string
}

// newBenchNodeCmd is the ledger process that `ledger bench` starts: the
// intake and/or executor instances, wired as their role commands wire
// them, in a process of their own so that its CPU and memory are the
// ledger's alone.
func newBenchNodeCmd(g *globals) *cobra.Command {
	var f benchNodeFlags
	cmd := &cobra.Command{
		Use:    "node",
		Short:  "Run intake and executor instances for `ledger bench` (started by it)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBenchNode(cmd.Context(), g, &f)
		},
	}
	f.roles.register(cmd, true)
	f.roles.registerLoop(cmd)
	fs := cmd.Flags()
	f.ident.register(fs)
	f.creds.register(fs)
	f.policy.registerTimeout(fs)
	fs.BoolVar(&f.intake, "intake", false, "run an intake")
	fs.IntVar(&f.executors, "executors", 1, "executor instances in this process (each its own transactional id and group member)")
	fs.StringVar(&f.toolsBase, "tools-base-url", "", "base URL of the tool backend")
	fs.StringVar(&f.jwksAddr, "jwks-addr", "", "where to serve this process's credential keys (GET /.well-known/jwks.json), for the backend to verify with; empty: not served")
	fs.StringVar(&f.roles.metricsAddr, "metrics-addr", "", "where ledger bench reads this node's /metrics and /loops; empty: not served")
	fs.StringVar(&f.profile, "profile", "", "write a CPU profile to <profile>.cpu.pprof and an allocation profile to <profile>.allocs.pprof")
	return cmd
}

func runBenchNode(ctx context.Context, g *globals, f *benchNodeFlags) error {
	// The parent stops a node with SIGTERM; main's context already ends
	// on it, this only makes it explicit for a node started by hand.
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, os.Interrupt)
	defer stop()
	logger := g.logger()
	if f.profile != "" {
		stopProfile, err := startProfiles(f.profile)
		if err != nil {
			return err
		}
		defer stopProfile()
	}
	reg, err := f.roles.registry.load(nil) // the bench's own demo tools
	if err != nil {
		return err
	}
	// Metrics are collected as the role commands collect them (their
	// cost is part of the ledger's); --metrics-addr serves them, for the
	// benchmark to read the store's retries.
	obs := observers{metrics: metrics.New("bench", reg.Has)}
	f.roles.store.retried = obs.metrics.StoreRetried
	st, desc, err := f.roles.store.openStore(ctx, logger)
	if err != nil {
		return err
	}
	defer st.Close()
	cc, topics := g.kafka.client(logger), g.kafka.topics()
	controls, err := startControls(ctx, cc, topics.Control, logger)
	if err != nil {
		return err
	}
	engine, _, err := f.policy.engine(logger)
	if err != nil {
		return err
	}
	var (
		loops  []*ledger.Loop
		names  []string // of loops: "intake", "executor-0", ...
		drains []func(context.Context) error
	)
	if f.intake {
		ident, err := f.ident.verifier(ctx, logger)
		if err != nil {
			return err
		}
		ids, err := g.kafka.loopIDs("intake", f.roles.instance)
		if err != nil {
			return err
		}
		loop, _, err := intakeLoop(cc, topics, intake.Config{Registry: reg, Store: st, Identity: ident, Policy: engine, Freezes: controls, Versions: httptool.New(httptool.Config{}), BaseURL: f.toolsBase}, f.roles.instance, ids, f.roles.batching, obs, logger)
		if err != nil {
			return err
		}
		loops, names = append(loops, loop), append(names, "intake")
	}
	if f.executors > 0 {
		broker, err := f.creds.broker("", logger)
		if err != nil {
			return err
		}
		if f.jwksAddr != "" {
			if _, err := g.serveBackground(ctx, "jwks", f.jwksAddr, broker.Handler(), logger); err != nil {
				return err
			}
		}
		for i := range f.executors {
			xobs := obs
			if i > 0 {
				// A registry takes one executor's breakers and
				// bulkheads; the others (on the embedded store, which
				// one process owns) pay for metrics of their own.
				xobs = observers{metrics: metrics.New("bench", reg.Has)}
			}
			instance := f.roles.instance + "-" + strconv.Itoa(i)
			ids, err := g.kafka.loopIDs("executor", instance)
			if err != nil {
				return err
			}
			loop, x, err := executorLoop(cc, topics, reg, st, broker, f.creds.keystore(""), engine, controls, 0, toolsFlags{base: f.toolsBase}, instance, ids, f.roles.batching, xobs, logger)
			if err != nil {
				return err
			}
			loops, names = append(loops, loop), append(names, "executor-"+strconv.Itoa(i))
			drains = append(drains, x.Drain)
		}
	}
	if len(loops) == 0 {
		return fmt.Errorf("bench node: nothing to run (no --intake, --executors 0)")
	}
	if f.roles.metricsAddr != "" {
		ln, err := net.Listen("tcp", f.roles.metricsAddr)
		if err != nil {
			return fmt.Errorf("metrics: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", obs.metrics.Handler())
		mux.Handle("GET "+loopsPath, loopsHandler(names, loops))
		srv := newServer("", mux)
		go func() { _ = srv.Serve(ln) }()
		defer srv.Close()
	}
	logger.Info("bench node running", "intake", f.intake, "executors", f.executors, "store", desc, slog.String("instance", f.roles.instance))
	grp, ctx := errgroup.WithContext(ctx)
	for _, l := range loops {
		grp.Go(func() error { return l.Run(ctx) })
	}
	err = grp.Wait()
	for _, d := range drains {
		drainCalls(ctx, d, logger)
	}
	return err
}

// startProfiles starts a CPU profile into <prefix>.cpu.pprof; the returned
// stop ends it and writes the allocations so far to <prefix>.allocs.pprof.
func startProfiles(prefix string) (stop func(), err error) {
	cpu, err := os.Create(prefix + ".cpu.pprof")
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(cpu); err != nil {
		cpu.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		cpu.Close()
		if fh, err := os.Create(prefix + ".allocs.pprof"); err == nil {
			_ = pprof.Lookup("allocs").WriteTo(fh, 0)
			fh.Close()
		}
	}, nil
}
