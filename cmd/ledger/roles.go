package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.opentelemetry.io/otel/trace"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/failpoint"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/compensation"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/processors/tracing"
	"github.com/toolcall-ledger/ledger/schemas"
)

func parseURL(s string) (*url.URL, error) { return url.Parse(s) }

// roleFlags are what the intake and the executor share.
type roleFlags struct {
	store    storeFlags
	registry registryFlags
	instance string
	// metricsAddr is where /metrics, /healthz and /readyz are served.
	metricsAddr string
	// pprof also serves the runtime's profiles on metricsAddr.
	pprof bool
	// otlpURL is where spans are exported; empty: nowhere.
	otlpURL string
	// batching is how the processing loop gathers its batches.
	batching batching
	// obs are the process's metrics and tracer, made by run before build.
	obs observers
	// drain, if set by the role's build, runs after its loop stopped and
	// before the store closes: an executor's calls still running then
	// record their outcomes.
	drain func(context.Context) error
	// controlMaxStaleness is how old the copy of the control topic may
	// be before the role stops acting on it (registerControls); 0: not
	// checked.
	controlMaxStaleness time.Duration
	// controlReadiness: /readyz fails past controlMaxStaleness (the
	// executor's, whose traffic is the calls; not the reconciler's,
	// whose is the operators' APIs, the kill switch's among them).
	controlReadiness bool
	// controlsCtx, set by run, ends after the role's calls have drained:
	// an executor's calls still running at shutdown go on checking the
	// kill switch against a copy that is still followed, and tools find
	// its credential keys still served.
	controlsCtx context.Context
	// controls, set by followControls, is the role's copy of the control
	// topic: its staleness is reported and, with controlReadiness,
	// checked by /readyz.
	controls *control.State
	// policies, set by startPolicies, is the role's policy engine: /readyz
	// fails while it denies every call (policy.Engine.Err).
	policies *policy.Engine
	// assertions, set by the intake, verifies the agents' assertions:
	// /readyz fails while it refuses every one (identity.Verifier.Err).
	assertions *identity.Verifier
}

// registerControls adds the flag of a role that acts on the kill switch
// (freezes, revocations) and must not act on a stale copy of it; with
// readiness, /readyz fails while the copy is stale.
func (r *roleFlags) registerControls(cmd *cobra.Command, acts string, readiness bool) {
	r.controlReadiness = readiness
	if readiness {
		acts += ", and /readyz fails"
	}
	cmd.Flags().DurationVar(&r.controlMaxStaleness, "control-max-staleness", control.DefaultMaxStaleness,
		"how old this process's copy of the control topic (freezes, revocations) may be: it asks the broker for the topic's end every 250ms, and once it has not confirmed reading up to it for this long, "+acts+"; at least "+minControlMaxStaleness.String()+", or 0: not checked (not recommended)")
}

// minControlMaxStaleness is the least --control-max-staleness: a probe
// every 250 ms and its round trip must fit in it, with room to spare.
const minControlMaxStaleness = time.Second

func (r *roleFlags) checkControls() error {
	if d := r.controlMaxStaleness; d < 0 || (d > 0 && d < minControlMaxStaleness) {
		return fmt.Errorf("--control-max-staleness %s: must be at least %s, or 0 to turn the check off", d, minControlMaxStaleness)
	}
	return nil
}

// maxStaleness is the role's bound as the processors' configs take it:
// negative when not checked.
func (r *roleFlags) maxStaleness() time.Duration {
	if r.controlMaxStaleness <= 0 {
		return -1
	}
	return r.controlMaxStaleness
}

// followControls is startControls for a role run by run, until its calls
// have drained: the copy's staleness is reported
// (ledger_control_staleness_seconds) and, with controlReadiness, checked
// by /readyz.
func (r *roleFlags) followControls(ctx context.Context, g *globals, logger *slog.Logger) (*control.State, error) {
	st, err := followControlsUntil(ctx, r.controlsCtx, g.kafka.client(logger), g.kafka.topics().Control, logger)
	if err != nil {
		return nil, err
	}
	r.controls = st
	return st, nil
}

// startPolicies makes the role's policy engine from pf and keeps it
// current until ctx ends: the --policy-dir watcher, and the versions
// activated on the control topic (controls), which win over it. /readyz
// fails while the engine denies every call, such as while an activated
// version does not load.
func (r *roleFlags) startPolicies(ctx context.Context, pf *policyFlags, controls *control.State, logger *slog.Logger) (*policy.Engine, error) {
	engine, watch, err := pf.engine(logger)
	if err != nil {
		return nil, err
	}
	go func() {
		// Owned by the command: it ends with ctx.
		if err := watch(ctx); err != nil {
			logger.Error("policy watcher stopped", "err", err)
		}
	}()
	pf.activate(engine, controls)
	go func() {
		// Owned by the command: it ends with ctx.
		if err := pf.followActivations(ctx, engine, controls); err != nil {
			logger.Error("policy activations stopped", "err", err)
		}
	}()
	logger.Info("policy active", "policy_version", engine.Active().Version())
	if m := r.obs.metrics; m != nil {
		m.Policy(func() string { return engine.Active().Version() })
	}
	r.policies = engine
	return engine, nil
}

// readyChecks are the role's own /readyz checks: its copy of the control
// topic (controlCheck) and its policies.
func (r *roleFlags) readyChecks() []readyCheck {
	checks := r.controlCheck()
	if r.policies != nil {
		checks = append(checks, readyCheck{"policy", func(context.Context) error { return r.policies.Err() }})
	}
	if r.assertions != nil {
		checks = append(checks, readyCheck{"identity", r.assertions.Err})
	}
	return checks
}

// controlCheck is the /readyz check of a role's copy of the control
// topic, or nil when it has none or no bound.
func (r *roleFlags) controlCheck() []readyCheck {
	if r.controls == nil || !r.controlReadiness || r.controlMaxStaleness <= 0 {
		return nil
	}
	return []readyCheck{{"control", func(context.Context) error {
		switch st := r.controls.Staleness(); {
		case st < 0:
			return errors.New("not caught up with the control topic")
		case st > r.controlMaxStaleness:
			return fmt.Errorf("copy of the control topic last known current %s ago, more than --control-max-staleness %s", st.Round(time.Millisecond), r.controlMaxStaleness)
		}
		return nil
	}}}
}

func (r *roleFlags) register(cmd *cobra.Command, withDataDir bool) {
	fs := cmd.Flags()
	r.store.register(fs, withDataDir)
	r.registry.register(fs)
	fs.StringVar(&r.instance, "instance-id", instanceID(), "this instance's name; unique among running instances and stable across restarts (it names the Kafka transactional id of the roles that have one, and the actor of the events the instance writes)")
}

// loopReady is what a processing role's /readyz checks, and its /loops.
const loopReady = "Kafka, the store and the processing loop answer) and /loops (the loop's time in steps and transactions"

// registerOps adds the flags of a role's operational endpoint (startOps):
// those run starts, and the approval queue's. ledger dev, which serves
// its roles' on its API, leaves them out rather than accept flags it
// would ignore.
// ready says what the role's /readyz checks, with what else it serves.
func (r *roleFlags) registerOps(cmd *cobra.Command, ready string) {
	fs := cmd.Flags()
	fs.StringVar(&r.metricsAddr, "metrics-addr", "", "where to serve /metrics (Prometheus), /healthz (the process serves), /readyz ("+ready+"), e.g. :9464; empty: not served")
	fs.BoolVar(&r.pprof, "pprof", false, "also serve Go's runtime profiles under /debug/pprof/ on --metrics-addr (CPU, heap, allocations, goroutines: go tool pprof http://<addr>/debug/pprof/profile): off by default, because a profile shows the code's internals to whoever reaches the address and costs CPU while it is taken")
}

// checkOps refuses the flags of registerOps that do not go together.
func (r *roleFlags) checkOps() error {
	if r.pprof && r.metricsAddr == "" {
		return errors.New("--pprof serves the profiles on --metrics-addr: set it too")
	}
	return nil
}

// registerSpans adds --otlp-traces-url, of the role that makes spans: the
// executor's. The intake and the reconciler make none, and do not take
// it.
func (r *roleFlags) registerSpans(cmd *cobra.Command) {
	cmd.Flags().StringVar(&r.otlpURL, "otlp-traces-url", "", "OTLP/HTTP endpoint to export spans to (per call and per tool request, in the agents' traces), e.g. http://otel-collector:4318/v1/traces; empty: no spans (tools still get a traceparent)")
}

// registerLoop adds the flags of a role that runs a processing loop.
func (r *roleFlags) registerLoop(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.DurationVar(&r.batching.linger, "batch-linger", defaultLinger, "how long the processing loop waits for more records after a poll returned at least --batch-linger-from of them, before it processes them: fewer, larger batches (fewer Kafka transactions and store round trips per call, less CPU) for up to this much latency; 0 processes at once; shorter than the loop's tick (the executor's is 100ms, the others' 1s)")
	fs.IntVar(&r.batching.maxBytes, "max-batch-bytes", ledger.DefaultMaxBatchBytes, "the most a batch of records fetched from Kafka may decompress to: a batch past it is skipped unread, logged at Error and counted (ledger_batches_skipped_total), and the intake writes a DLQ record batch_too_large naming its offsets; without a bound, a few kilobytes of compressed records that anyone who may write the topic can produce would decompress past the process's memory, on every instance in turn. Raise it only for producers that batch more than this; at least 1048576 (1 MiB), over the batches the ledger's own producers write, which a loop must never skip")
	fs.IntVar(&r.batching.from, "batch-linger-from", defaultLingerFrom, "how many records a poll must return for the loop to linger (--batch-linger), counting those the loop acts on (the executor's: authorized and approved events): records found waiting mean a loop under load, where a larger batch saves more than the linger costs; 1 lingers after any poll that returned records")
}

// batching is how a processing loop gathers its batches: its
// ledger.LoopConfig's Linger and LingerFrom.
type batching struct {
	linger time.Duration
	from   int
	// maxBytes: ledger.LoopConfig.MaxBatchBytes.
	maxBytes int
}

// The default batching lingers a millisecond once a poll finds two
// records waiting that the step acts on. On the 2-core benchmark machine
// (BENCHMARKS.md), in alternating pairs against none at 2,500 calls/s,
// the machine's CPU a call fell in every pair and the added p99 in all
// but one: nine pairs with a first cut that counted every record, and
// three with this one (CPU -7 to -11%, added p99 53.3 against 70.5 ms,
// 44.4 against 48.6, 28.5 against 35.0); at 500/s, where a poll mostly
// finds one call, the latencies and the CPU moved within the runs' noise
// (added p50 +1.0 ms, the median of three pairs).
const (
	defaultLinger     = time.Millisecond
	defaultLingerFrom = 2
)

// loop sets cfg's batching.
func (b batching) loop(cfg ledger.LoopConfig) ledger.LoopConfig {
	cfg.Linger, cfg.LingerFrom, cfg.MaxBatchBytes = b.linger, b.from, b.maxBytes
	return cfg
}

// observers are what a role's processors report to; the zero value
// reports nothing.
type observers struct {
	metrics *metrics.Registry
	tracer  trace.Tracer
}

// loop is the metrics as a loop's, or nil (none).
func (o observers) loop() ledger.LoopMetrics {
	if o.metrics == nil {
		return nil
	}
	return o.metrics
}

// intakeLoop wires an intake onto its consume-process-produce loop. cfg
// carries the intake's trust: identity and policy (whose rate limits its
// store keeps).
func intakeLoop(cc ledger.ClientConfig, topics ledger.Topics, cfg intake.Config, instance string, ids loopIDs, b batching, obs observers, logger *slog.Logger) (*ledger.Loop, *intake.Processor, error) {
	cfg.Topics = topics
	cfg.Actor = "intake/" + instance
	cfg.Logger = logger.With("processor", "intake")
	in, err := intake.New(cfg)
	if err != nil {
		return nil, nil, err
	}
	fp, err := failpoint.FromEnv("intake")
	if err != nil {
		return nil, nil, err
	}
	loop, err := in.Loop(b.loop(ledger.LoopConfig{Client: cc, Group: ids.group, TransactionalID: ids.txn, Failpoint: fp, Metrics: obs.loop()}))
	return loop, in, err
}

// toolsFlags say where the tools are, for the roles that send them
// credentials (the executor's calls, the reconciler's lookups).
type toolsFlags struct {
	base string
	// insecureHTTP: httptool.Config.AllowInsecureHTTP.
	insecureHTTP bool
}

func (f *toolsFlags) register(fs *pflag.FlagSet, baseUsage string) {
	fs.StringVar(&f.base, "tools-base-url", "http://127.0.0.1:8081", baseUsage)
	fs.BoolVar(&f.insecureHTTP, "tools-allow-insecure-http", false,
		"send the per-call credential and the backends' secrets over plain http to hosts other than loopback (a network you trust end to end); without it such a request is refused, failed invalid_request, nothing sent")
}

// client is the HTTP client of the tools.
func (f *toolsFlags) client(fp failpoint.Hook) *httptool.Client {
	return httptool.New(httptool.Config{Failpoint: fp, AllowInsecureHTTP: f.insecureHTTP})
}

// executorLoop wires an executor onto its loop.
func executorLoop(cc ledger.ClientConfig, topics ledger.Topics, reg *schemas.Registry, st processors.Store, minter executor.Minter, secrets executor.Secrets, pol executor.Decider, freezes executor.Freezes, maxStaleness time.Duration, tf toolsFlags, instance string, ids loopIDs, b batching, obs observers, logger *slog.Logger) (*ledger.Loop, *executor.Executor, error) {
	// The reliability suite's crash points, in a binary built with the
	// failpoints tag; nil (and free) otherwise.
	fp, err := failpoint.FromEnv("executor")
	if err != nil {
		return nil, nil, err
	}
	tools := tf.client(fp)
	xcfg := executor.Config{
		Registry: reg, Store: st, Topics: topics,
		Caller:      tools,
		Versions:    tools,
		Credentials: minter,
		Secrets:     secrets,
		Policy:      pol,
		Freezes:     freezes,
		// Zero is the default bound; the flags give negative for none.
		ControlMaxStaleness: maxStaleness,
		BaseURL:             tf.base,
		Owner:               "executor/" + instance,
		Logger:              logger.With("processor", "executor"),
		Failpoint:           fp,
	}
	if m := obs.metrics; m != nil {
		xcfg.Metrics = m
	}
	xcfg.Tracer = obs.tracer
	x, err := executor.New(xcfg)
	if err != nil {
		return nil, nil, err
	}
	if m := obs.metrics; m != nil {
		m.Breakers(x.BreakerStates)
		m.Bulkheads(func() map[string]metrics.Bulkhead { return metrics.BulkheadsOf(x.Bulkheads()) }, x.InFlight)
	}
	loop, err := x.Loop(b.loop(ledger.LoopConfig{Client: cc, Group: ids.group, TransactionalID: ids.txn, Failpoint: fp, Metrics: obs.loop()}))
	return loop, x, err
}

// run opens what a role needs, builds its loop with build, and runs it
// until ctx ends.
func (rf *roleFlags) run(ctx context.Context, g *globals, role string, build func(*schemas.Registry, processors.Store, *slog.Logger) (*ledger.Loop, error)) error {
	if err := rf.checkOps(); err != nil {
		return err
	}
	if err := rf.checkControls(); err != nil {
		return err
	}
	// The copy of the control topic outlives the loop: drainCalls (run
	// before this returns) lets calls still running finish against it.
	var stopControls context.CancelFunc
	rf.controlsCtx, stopControls = context.WithCancel(context.WithoutCancel(ctx))
	defer stopControls()
	logger := g.logger()
	reg, err := rf.registry.load(logger)
	if err != nil {
		return err
	}
	if rf.store.failpoint, err = failpoint.FromEnv(role); err != nil {
		return err
	}
	if failpoint.Enabled && rf.store.failpoint != nil {
		logger.Warn("failpoints armed: this process will crash itself on purpose", "spec", os.Getenv(failpoint.EnvSpec))
	}
	rf.obs.metrics = metrics.New(role, reg.Has)
	rf.store.retried = rf.obs.metrics.StoreRetried
	st, desc, err := rf.store.openStore(ctx, logger)
	if err != nil {
		return err
	}
	defer st.Close()
	if rf.otlpURL != "" {
		tp, err := tracing.NewProvider(ctx, tracing.Config{URL: rf.otlpURL, Service: "toolcall-ledger-" + role, Instance: rf.instance})
		if err != nil {
			return err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if err := tp.Shutdown(sctx); err != nil {
				logger.Warn("spans not exported at shutdown", "err", err)
			}
		}()
		rf.obs.tracer = tp.Tracer()
	}
	loop, err := build(reg, st, logger)
	if err != nil {
		return err
	}
	if rf.controls != nil {
		rf.obs.metrics.ControlStaleness(rf.controls.Staleness)
	}
	if rf.metricsAddr != "" {
		ops, err := startOps(g, rf.metricsAddr, rf.pprof, role, rf.obs.metrics, loop, st, logger, rf.readyChecks()...)
		if err != nil {
			return err
		}
		defer ops.stop()
	}
	logger.Info(role+" starting", "brokers", g.kafka.brokers, "store", desc, "instance", rf.instance, "metrics", rf.metricsAddr)
	err = loop.Run(ctx)
	drainCalls(ctx, rf.drain, logger)
	return err
}

// drainCalls runs drain, if set, bounded by drainTimeout, once a loop has
// stopped and before the store closes.
func drainCalls(ctx context.Context, drain func(context.Context) error, logger *slog.Logger) {
	if drain == nil {
		return
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), drainTimeout)
	defer cancel()
	if err := drain(dctx); err != nil {
		logger.Warn("work still in progress at shutdown is left unfinished (an executor's calls to their leases)", "err", err)
	}
}

// undoLanding is compensation.Config.Landing: how long after a call went
// outcome_unknown its last attempt may still reach its tool, as the
// reconciler reckons it for its own compensations.
func undoLanding(t *schemas.Tool) time.Duration { return executor.Landing(t, credentials.DefaultSkew) }

// drainTimeout bounds how long a stopping executor waits for its calls
// still running to record their outcomes; what is left then is reclaimed
// when its lease expires, as after a crash.
const drainTimeout = 15 * time.Second

func newIntakeCmd(g *globals) *cobra.Command {
	var (
		rf        roleFlags
		idf       identityFlags
		pf        policyFlags
		toolsBase string
	)
	cmd := &cobra.Command{
		Use:   "intake",
		Short: "Run the intake: verify, validate and decide envelopes from the request topic, and append their first events",
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			return rf.run(ctx, g, "intake", func(reg *schemas.Registry, st processors.Store, logger *slog.Logger) (*ledger.Loop, error) {
				ident, err := idf.verifier(ctx, logger)
				if err != nil {
					return nil, err
				}
				rf.assertions = ident
				controls, err := rf.followControls(ctx, g, logger)
				if err != nil {
					return nil, err
				}
				engine, err := rf.startPolicies(ctx, &pf, controls, logger)
				if err != nil {
					return nil, err
				}
				ids, err := g.kafka.loopIDs("intake", rf.instance)
				if err != nil {
					return nil, err
				}
				loop, _, err := intakeLoop(g.kafka.client(logger), g.kafka.topics(), intake.Config{Registry: reg, Store: st, Identity: ident, Policy: engine, PolicyRetryAfter: pf.retryAfter, Freezes: controls, ControlMaxStaleness: rf.maxStaleness(),
					SyncPolicies: pf.syncing(engine, controls), Versions: httptool.New(httptool.Config{}), BaseURL: toolsBase}, rf.instance, ids, rf.batching, rf.obs, logger)
				return loop, err
			})
		},
	}
	rf.register(cmd, true)
	rf.registerControls(cmd, "calls are refused to retry later (control_state_stale), since a policy version activated or a freeze made since may not be read yet", true)
	rf.registerOps(cmd, loopReady)
	rf.registerLoop(cmd)
	idf.register(cmd.Flags())
	pf.register(cmd.Flags(), false)
	pf.registerRefusals(cmd.Flags())
	cmd.Flags().StringVar(&toolsBase, "tools-base-url", "http://127.0.0.1:8081", "base URL that relative resource version URLs resolve against: a call that must wait for an approval has its resource's version read when it is requested (at most a second), so that an approval is refused if the resource changed since")
	return cmd
}

func newExecutorCmd(g *globals) *cobra.Command {
	var (
		rf       roleFlags
		cf       credentialFlags
		pf       policyFlags
		tf       toolsFlags
		jwksAddr string
	)
	cmd := &cobra.Command{
		Use:   "executor",
		Short: "Run an executor: run authorized calls exactly once and append their outcome",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return rf.run(cmd.Context(), g, "executor", func(reg *schemas.Registry, st processors.Store, logger *slog.Logger) (*ledger.Loop, error) {
				broker, err := cf.broker(rf.store.dataDir, logger)
				if err != nil {
					return nil, err
				}
				if jwksAddr != "" {
					// Served until the calls still running at shutdown
					// have drained: a tool that fetches the keys then
					// must find them, or it refuses the call.
					if _, err := g.serveBackground(rf.controlsCtx, "jwks", jwksAddr, broker.Handler(), logger); err != nil {
						return nil, err
					}
				}
				controls, err := rf.followControls(cmd.Context(), g, logger)
				if err != nil {
					return nil, err
				}
				// Approved calls are decided again right before they run,
				// with the intake's policies: the same --policy-dir, or
				// without one the same built-in set the intake falls back
				// to, and the same activations. An executor with none
				// would run them unchecked: never fail open.
				engine, err := rf.startPolicies(cmd.Context(), &pf, controls, logger)
				if err != nil {
					return nil, err
				}
				ids, err := g.kafka.loopIDs("executor", rf.instance)
				if err != nil {
					return nil, err
				}
				loop, x, err := executorLoop(g.kafka.client(logger), g.kafka.topics(), reg, st, broker, cf.keystore(rf.store.dataDir), syncedDecider{engine, pf.syncing(engine, controls)}, controls, rf.maxStaleness(), tf, rf.instance, ids, rf.batching, rf.obs, logger)
				if err != nil {
					return nil, err
				}
				rf.drain = x.Drain
				return loop, nil
			})
		},
	}
	rf.register(cmd, true)
	rf.registerControls(cmd, "no request leaves for a tool (each waits, up to its call's deadline or its claim's lease, whichever ends first: a call whose deadline ends the wait fails with code control_state_stale, one whose lease ends it is given back, to be claimed again): every executor applies a freeze, or stops sending, within this long", true)
	rf.registerOps(cmd, loopReady)
	rf.registerSpans(cmd)
	rf.registerLoop(cmd)
	cf.register(cmd.Flags())
	pf.register(cmd.Flags(), false)
	cmd.Flags().StringVar(&jwksAddr, "jwks-addr", "", "where to serve this executor's credential keys (GET /.well-known/jwks.json) for tools to verify with; each executor has keys of its own, so a tool lists every executor's URL; empty: not served")
	tf.register(cmd.Flags(), "base URL that relative tool backend URLs resolve against")
	return cmd
}

func newTopicsCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "topics", Short: "Manage the ledger's Kafka topics"}
	cmd.AddCommand(&cobra.Command{
		Use:   "create",
		Short: "Create the ledger's topics where they do not exist (sized by --partitions and --replication-factor)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			logger := g.logger()
			cl, err := ledger.NewClient(g.kafka.client(logger))
			if err != nil {
				return err
			}
			defer cl.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			if err := ledger.EnsureTopics(ctx, cl, g.kafka.topicConfig()); err != nil {
				return err
			}
			t := g.kafka.topics()
			fmt.Fprintf(cmd.OutOrStdout(), "topics ready: %s %s %s %s\n", t.Requests, t.Events, t.Control, t.DLQ)
			return nil
		},
	})
	return cmd
}

func newMigrateCmd(g *globals) *cobra.Command {
	var (
		dsn     string
		rewrite bool
	)
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Create or update the execution store's tables in CockroachDB/PostgreSQL",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dsn == "" {
				return fmt.Errorf("--crdb-dsn (or LEDGER_CRDB_DSN) is required")
			}
			st, err := pgstore.Open(cmd.Context(), pgstore.Config{DSN: dsn, Logger: g.logger()})
			if err != nil {
				return err
			}
			defer st.Close()
			fmt.Fprintln(cmd.OutOrStdout(), "execution store schema is up to date")
			if !rewrite {
				return nil
			}
			last := time.Now()
			p, err := st.RewritePlainOutboxes(cmd.Context(), 1000, func(p pgstore.RewriteProgress) {
				if time.Since(last) >= 5*time.Second {
					last = time.Now()
					fmt.Fprintf(cmd.ErrOrStderr(), "migrate: %d records scanned, %d outboxes rewritten as plain, %d skipped (changed meanwhile)\n", p.Scanned, p.Rewritten, p.Skipped)
				}
			})
			if err != nil {
				return fmt.Errorf("after %d records scanned, %d outboxes rewritten and %d skipped: %w", p.Scanned, p.Rewritten, p.Skipped, err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%d records scanned, %d compressed outboxes rewritten as plain, %d skipped (changed meanwhile)\n", p.Scanned, p.Rewritten, p.Skipped)
			return nil
		},
	}
	cmd.Flags().StringVar(&dsn, "crdb-dsn", "", "CockroachDB (or PostgreSQL) DSN")
	cmd.Flags().BoolVar(&rewrite, "rewrite-plain-outboxes", false, "also rewrite every compressed outbox as plain JSON, before going back to a build that reads only plain ones; run it once every process runs with --plain-outboxes (it fails if compressed outboxes remain)")
	return cmd
}

// startControls follows the control topic (freezes, revocations) until ctx
// ends, and returns once it caught up with it: a new instance starts with
// the current freezes.
func startControls(ctx context.Context, cc ledger.ClientConfig, topic string, logger *slog.Logger) (*control.State, error) {
	return followControlsUntil(ctx, ctx, cc, topic, logger)
}

// followControlsUntil is startControls following the topic until run
// ends, and waiting to catch up until ctx ends.
func followControlsUntil(ctx, run context.Context, cc ledger.ClientConfig, topic string, logger *slog.Logger) (*control.State, error) {
	st := control.NewState(logger.With("component", "control"))
	done := make(chan error, 1)
	go func() {
		// Owned by the command: it ends with run.
		err := st.Run(run, cc, topic)
		if err != nil {
			logger.Error("control state stopped", "err", err)
		}
		done <- err
	}()
	select {
	case <-st.Ready():
		return st, nil
	case err := <-done:
		if err == nil {
			// Run returns nil when run ended before it caught up.
			err = cmp.Or(run.Err(), errors.New("stopped before catching up"))
		}
		return nil, fmt.Errorf("control state: %w", err)
	case <-ctx.Done():
		return nil, fmt.Errorf("control state: %w", ctx.Err())
	case <-time.After(30 * time.Second):
		return nil, errors.New("control state: not caught up with the control topic after 30s")
	}
}

func newReconcilerCmd(g *globals) *cobra.Command {
	var (
		rf        roleFlags
		cf        credentialFlags
		idf       identityFlags
		pf        policyFlags
		tf        toolsFlags
		httpAddr  string
		jwksAddr  string
		credsJWKS []string
		// unanswered: how long before a call whose lookups do not
		// answer is parked.
		unanswered time.Duration
	)
	cmd := &cobra.Command{
		Use:   "reconciler",
		Short: "Run the reconciler: resolve outcome_unknown calls through the tools' status lookups, compensate or park the rest; serve the operators' APIs (resolutions, compensations, the kill switch, introspection)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if unanswered < 0 {
				return fmt.Errorf("--unanswered-for %v: must not be negative", unanswered)
			}
			ctx := cmd.Context()
			return rf.run(ctx, g, "reconciler", func(reg *schemas.Registry, st processors.Store, logger *slog.Logger) (*ledger.Loop, error) {
				broker, err := cf.broker(rf.store.dataDir, logger)
				if err != nil {
					return nil, err
				}
				// The status lookups carry credentials of this broker:
				// tools that check them list this URL too.
				if jwksAddr != "" {
					if _, err := g.serveBackground(ctx, "jwks", jwksAddr, broker.Handler(), logger); err != nil {
						return nil, err
					}
				}
				controls, err := rf.followControls(ctx, g, logger)
				if err != nil {
					return nil, err
				}
				// Compensations are governed calls: the same checks and
				// policies as the intake's, on the same store.
				engine, err := rf.startPolicies(ctx, &pf, controls, logger)
				if err != nil {
					return nil, err
				}
				submitter, err := intake.New(intake.Config{Registry: reg, Store: st, Policy: engine, PolicyRetryAfter: pf.retryAfter, Freezes: controls, ControlMaxStaleness: rf.maxStaleness(), SyncPolicies: pf.syncing(engine, controls), Topics: g.kafka.topics(), Channel: "compensation", Actor: "compensation/" + rf.instance, Logger: logger})
				if err != nil {
					return nil, err
				}
				events, err := newEventPublisher(g.kafka.client(logger))
				if err != nil {
					return nil, err
				}
				// apiDrained closes once the operators' API (which
				// publishes with events) has finished its requests, or
				// at once without one.
				apiDrained := make(chan (<-chan struct{}), 1)
				published := make(chan struct{})
				go func() {
					// Owned by the command: closed when ctx ends, after
					// the API's requests in progress.
					<-ctx.Done()
					select {
					case drained := <-apiDrained:
						<-drained
					default:
					}
					events.Close()
					close(published)
				}()
				// The process waits for that before it closes the store
				// and exits: a freeze, a resolution or a compensation
				// asked for as it stops is written and published, or
				// answered as failed, not cut off by the exit.
				rf.drain = func(ctx context.Context) error {
					select {
					case <-published:
						return nil
					case <-ctx.Done():
						return fmt.Errorf("the operators' API's requests in progress: %w", ctx.Err())
					}
				}
				undo, err := compensation.New(compensation.Config{Store: st, Registry: reg, Intake: submitter, Publisher: events, Topics: g.kafka.topics(), Logger: logger, Landing: undoLanding})
				if err != nil {
					return nil, err
				}
				if floor := executor.LandingWindow(reg, credentials.DefaultSkew); unanswered > 0 && unanswered < floor {
					// An undo asked for under undo_unknown may reach the
					// tool before the call's last attempt lands, and
					// cancel nothing.
					logger.Warn("--unanswered-for is shorter than a call's request may still land (a tool's timeout, and how long past their expiry the tools accept credentials, and clock skew): a call parked for unanswered lookups and undone under undo_unknown may have its last attempt land after its compensation",
						"unanswered_for", unanswered, "longest_landing", floor)
				}
				rc, err := executor.NewReconciler(executor.ReconcilerConfig{
					Registry: reg, Store: st, Looker: tf.client(nil), Credentials: broker, Secrets: cf.keystore(rf.store.dataDir),
					BaseURL: tf.base, Topics: g.kafka.topics(), Owner: "reconciler/" + rf.instance,
					Logger: logger.With("processor", "reconciler"), Compensator: undo, Metrics: rf.obs.metrics,
					UnansweredFor: unanswered, Freezes: controls, ControlMaxStaleness: rf.maxStaleness(),
				})
				if err != nil {
					return nil, err
				}
				if httpAddr != "" {
					staff, err := idf.verifier(ctx, logger)
					if err != nil {
						return nil, err
					}
					undoAPI, err := compensation.New(compensation.Config{Store: st, Registry: reg, Intake: submitter, Publisher: events, Identity: staff, Topics: g.kafka.topics(), Logger: logger, Landing: undoLanding})
					if err != nil {
						return nil, err
					}
					mux := http.NewServeMux()
					mux.Handle("/v1/resolutions", rc.ResolveHandler(staff, events))
					mux.Handle("/v1/compensations", undoAPI.Handler())
					// The kill switch's API, and introspection for tools
					// when the executors' credential keys are known: theirs,
					// and this process's own (its status lookups').
					var inspector control.Inspector
					if len(credsJWKS) > 0 {
						hc, err := g.httpClient.client(logger, 10*time.Second)
						if err != nil {
							return nil, err
						}
						v, err := credentials.NewVerifier(credentials.VerifierConfig{Keys: broker.Keys, JWKSURLs: credsJWKS, HTTPClient: hc, Logger: logger})
						if err != nil {
							return nil, err
						}
						inspector = v
					}
					kill, err := control.New(control.Config{State: controls, Publisher: events, Identity: staff, Topics: g.kafka.topics(), Credentials: inspector, MaxStaleness: rf.maxStaleness(), KnownTool: reg.Has, Logger: logger})
					if err != nil {
						return nil, err
					}
					mux.Handle("/v1/control", kill.Handler())
					mux.Handle("/v1/control/", kill.Handler())
					// Owned by the command: ends with ctx. It writes an
					// action in force again after a record that raced it
					// and lost, as the compacted topic needs.
					go func() { _ = kill.Run(ctx) }()
					if inspector != nil {
						mux.Handle(control.IntrospectPath, kill.Handler())
					}
					drained, err := g.serveBackground(ctx, "operators", httpAddr, httpjson.Unmatched(mux), logger)
					if err != nil {
						return nil, err
					}
					apiDrained <- drained
				}
				rf.obs.metrics.Unknown(rc.Unknown)
				rf.obs.metrics.Parked(rc.Parked)
				ids, err := g.kafka.loopIDs("reconciler", rf.instance)
				if err != nil {
					return nil, err
				}
				return rc.Loop(rf.batching.loop(ledger.LoopConfig{Client: g.kafka.client(logger), Group: ids.group, TransactionalID: ids.txn, Metrics: rf.obs.metrics}))
			})
		},
	}
	rf.register(cmd, true)
	rf.registerControls(cmd, "the introspection at /v1/introspect answers 503 rather than call a credential active, and no status lookup is sent (the calls in outcome_unknown wait, and a Warn says so once a sweep interval)", false)
	rf.registerOps(cmd, loopReady)
	rf.registerLoop(cmd)
	cf.register(cmd.Flags())
	idf.registerStaff(cmd.Flags())
	tf.register(cmd.Flags(), "base URL that relative status lookup URLs resolve against")
	cmd.Flags().DurationVar(&unanswered, "unanswered-for", executor.DefaultUnansweredFor, "how long a call may stay outcome_unknown with no status lookup answering (each pass's lookups failed, timed out or held off by the breaker; asked again at every sweep meanwhile) before it is parked for a human (status_lookup_failed; status_lookup_pending, never undone, if the tool said meanwhile that the call is in progress): counted from the end of the first round of lookups of the call that failed, in any reconciler (noted on the call's record, so a restart or a rebalance does not start the wait again, nor forget an in-progress answer; the reconcilers' clocks must agree), never within a sweep interval of this reconciler's own first failing round, and at least as long since the call's last change; 0: the default. Keep it longer than the tools' timeouts and the 30 s past their expiry that tools accept credentials (or a tool's registry backend.credential_skew_ms), and 5 s (a warning says when it is not): a call parked so and undone under undo_unknown may have its last attempt land after its compensation")
	pf.register(cmd.Flags(), false)
	pf.registerRefusals(cmd.Flags())
	cmd.Flags().StringVar(&httpAddr, "http-addr", "", "where to serve the operators' APIs: /v1/resolutions, /v1/compensations, /v1/control (needs --issuer and --jwks-*); empty: not served")
	cmd.Flags().StringVar(&jwksAddr, "jwks-addr", "", "where to serve the reconciler's credential keys (GET /.well-known/jwks.json), which sign its status lookups, for tools to verify with; empty: not served")
	cmd.Flags().StringSliceVar(&credsJWKS, "credential-jwks-url", nil, "the executors' credential keys, comma separated: every executor's --jwks-addr URL (each has keys of its own); with it, --http-addr also serves RFC 7662 introspection at /v1/introspect, which also knows the reconciler's own keys")
	return cmd
}
