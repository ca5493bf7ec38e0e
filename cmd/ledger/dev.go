package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/approvals"
	"github.com/toolcall-ledger/ledger/processors/compensation"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/console"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/projections/projector"
)

// devProjectorGroup is the consumer group of dev's ClickHouse projector.
const devProjectorGroup = "ledger-dev-projector"

type devFlags struct {
	roles       roleFlags
	policy      policyFlags
	creds       credentialFlags
	kafkaAddr   string
	httpAddr    string
	backendAddr string
	clickhouse  clickhouseFlags
	// pprof serves the runtime's profiles on the API.
	pprof bool
}

func newDevCmd(g *globals) *cobra.Command {
	var f devFlags
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run the whole ledger in one process on embedded engines (Kafka, execution store, call index, demo tools, HTTP API)",
		Long: `dev runs every role in one process: an in-process Kafka (kfake) listening on
--kafka-addr and persisted under --data-dir, the embedded execution store (or
CockroachDB/PostgreSQL with --crdb-dsn), the intake, the executor, the call
index, a demo tool backend that records every effect it applies, and the HTTP
API. A restart with the same --data-dir keeps every call. Ctrl-C stops it.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runDev(cmd.Context(), g, &f)
		},
	}
	f.roles.register(cmd, true)
	f.roles.registerLoop(cmd)
	fs := cmd.Flags()
	f.policy.register(fs, true)
	f.policy.registerRefusals(fs)
	f.creds.register(fs)
	fs.StringVar(&f.kafkaAddr, "kafka-addr", devKafkaAddr, "where the in-process Kafka listens (loopback only)")
	fs.StringVar(&f.httpAddr, "http-addr", devHTTPAddr, "where the HTTP API listens (loopback only)")
	fs.StringVar(&f.backendAddr, "backend-addr", "127.0.0.1:8081", "where the demo tool backend listens (loopback only)")
	fs.StringVar(&f.clickhouse.dsn, "clickhouse-dsn", "", "project into this ClickHouse too (native protocol), and answer the incident queries from it; empty: from the embedded index")
	fs.StringVar(&f.clickhouse.database, "clickhouse-database", "ledger_dev", "ClickHouse database of dev's projection: never a production one")
	f.clickhouse.registerLimits(fs)
	// A shell set up for a deployment holds its LEDGER_* variables: dev
	// started there must not open that deployment's store, projection,
	// tools' secrets or signing keys (its executor would take over the
	// deployment's calls and append their events to dev's own Kafka).
	markExplicitOnly(fs, devExplicitOnly...)
	fs.BoolVar(&f.pprof, "pprof", false, "also serve Go's runtime profiles under /debug/pprof/ on the HTTP API (go tool pprof http://<http-addr>/debug/pprof/profile), to see where dev's one process spends its CPU and memory; unauthenticated, like the rest of dev's API, so only where --http-addr is loopback")
	return cmd
}

// devExplicitOnly are the flags of dev that name a deployment's state,
// tools or secrets: dev takes them from its command line only.
// --data-dir among them: a deployment's (the image sets LEDGER_DATA_DIR)
// holds its signing keys and tools' secrets, which dev would load and
// rotate; the commands that find dev's issuer there take it from their
// command line too.
var devExplicitOnly = []string{"crdb-dsn", "data-dir", "clickhouse-dsn", "clickhouse-database", "registry-dir", "secrets-dir", "credential-key-dir", "policy-dir", "policy-versions-dir"}

func runDev(ctx context.Context, g *globals, f *devFlags) error {
	if g.httpTLS.enabled() || g.httpTLS.clientCAFile != "" {
		// dev is the local trial on loopback; its banner and its demo
		// tools speak plain HTTP. Saying so beats ignoring the flags.
		return errors.New("ledger dev serves plain HTTP on loopback only: --http-tls-* (LEDGER_HTTP_TLS_*) apply to the production roles, not to dev")
	}
	if g.kafka.security.Enabled() {
		// Its own Kafka is plaintext on loopback: its clients, told to
		// speak TLS or SASL to it, failed after their 30 s of retries.
		return errors.New("ledger dev runs its own Kafka, plaintext on loopback: --kafka-tls-* and --kafka-sasl-* (LEDGER_KAFKA_TLS_*, LEDGER_KAFKA_SASL_*) apply to a deployment's brokers, not to dev")
	}
	// Dev's API answers every tenant's calls, results included, without
	// credentials, and its Kafka and demo tools take anything: they must
	// not be reachable from another machine.
	for _, a := range []struct{ flag, addr string }{{"--http-addr", f.httpAddr}, {"--backend-addr", f.backendAddr}, {"--kafka-addr", f.kafkaAddr}} {
		if err := loopbackOnly(a.addr); err != nil {
			return fmt.Errorf("%s %s: %w", a.flag, a.addr, err)
		}
	}
	logger := g.logger()
	dataDir := f.roles.store.dataDir
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return fmt.Errorf("data dir: %w", err)
	}
	_, portStr, err := net.SplitHostPort(f.kafkaAddr)
	if err != nil {
		return fmt.Errorf("--kafka-addr: %w", err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return fmt.Errorf("--kafka-addr port: %w", err)
	}
	cluster, err := kfake.NewCluster(
		kfake.Ports(port),
		kfake.DataDir(filepath.Join(dataDir, "kafka")),
		kfake.GroupMinSessionTimeout(time.Second),
	)
	if err != nil {
		return fmt.Errorf("start in-process kafka on %s: %w", f.kafkaAddr, err)
	}
	defer cluster.Close()
	g.kafka.brokers = cluster.ListenAddrs()
	cc := g.kafka.client(logger)
	topics := g.kafka.topics()

	// admin also serves the consumer groups' lag and /readyz's Kafka
	// check.
	admin, err := ledger.NewClient(cc)
	if err != nil {
		return err
	}
	defer admin.Close()
	setupCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = ledger.EnsureTopics(setupCtx, admin, g.kafka.topicConfig())
	cancel()
	if err != nil {
		return err
	}

	reg, err := f.roles.registry.load(nil) // dev's demo tools are the point
	if err != nil {
		return err
	}
	st, storeDesc, err := f.roles.store.openStore(ctx, logger)
	if err != nil {
		return err
	}
	defer st.Close()
	indexPath := filepath.Join(dataDir, "index.db")
	_, statErr := os.Stat(indexPath)
	index, err := callindex.Open(indexPath, logger.With("component", "callindex"))
	if err != nil {
		return err
	}
	defer index.Close()
	if errors.Is(statErr, fs.ErrNotExist) {
		// A new index (a first start, or index.db deleted): it is
		// rebuilt from the whole events topic, not from where the
		// group that filled the old one stopped.
		if err := readFromStart(ctx, cc, topics, devIndexGroup); err != nil {
			return fmt.Errorf("call index: %w", err)
		}
	}

	issuer, ident, staff, err := devIdentity(ctx, dataDir, logger.With("component", "identity"))
	if err != nil {
		return err
	}
	engine, watchPolicies, err := f.policy.engine(logger.With("component", "policy"))
	if err != nil {
		return err
	}
	broker, err := f.creds.broker(dataDir, logger.With("component", "credentials"))
	if err != nil {
		return err
	}
	toolCreds, err := credentials.NewVerifier(credentials.VerifierConfig{Audience: demobackend.DefaultAudience, Keys: broker.Keys})
	if err != nil {
		return err
	}
	backendLn, err := net.Listen("tcp", f.backendAddr)
	if err != nil {
		return fmt.Errorf("demo backend: %w", err)
	}
	apiLn, err := net.Listen("tcp", f.httpAddr)
	if err != nil {
		backendLn.Close()
		return fmt.Errorf("http api: %w", err)
	}
	// The demo tools remember what they did across restarts, as real
	// ones would: the journal is their state.
	backend, err := demobackend.Open(demobackend.Config{
		Logger:        logger.With("component", "demobackend"),
		JournalPath:   filepath.Join(dataDir, "effects.jsonl"),
		Credentials:   toolCreds,
		IntrospectURL: "http://" + apiLn.Addr().String() + control.IntrospectPath,
	})
	if err != nil {
		backendLn.Close()
		apiLn.Close()
		return err
	}

	// The kill switch: the current freezes and revocations, rebuilt from
	// the control topic before anything runs, and followed until the
	// executor's calls still running at shutdown have drained (below),
	// not only until Ctrl-C.
	ctlCtx, stopControls := context.WithCancel(context.WithoutCancel(ctx))
	defer stopControls()
	controls, err := followControlsUntil(ctx, ctlCtx, cc, topics.Control, logger)
	if err != nil {
		return err
	}
	inspector, err := credentials.NewVerifier(credentials.VerifierConfig{Keys: broker.Keys})
	if err != nil {
		return err
	}

	instance := f.roles.instance
	// The version activated on the control topic decides from the first
	// call on.
	f.policy.activate(engine, controls)
	intakeIDs, err := g.kafka.loopIDs("intake", instance)
	if err != nil {
		return err
	}
	execIDs, err := g.kafka.loopIDs("executor", instance)
	if err != nil {
		return err
	}
	// Each role's metrics, as a process of its own would serve them
	// (its role label and all), together on the API's /metrics.
	intakeMetrics, execMetrics, reconcileMetrics := metrics.New("intake", reg.Has), metrics.New("executor", reg.Has), metrics.New("reconciler", reg.Has)
	intakeRole, _, err := intakeLoop(cc, topics, intake.Config{Registry: reg, Store: st, Identity: ident, Policy: engine, PolicyRetryAfter: f.policy.retryAfter, Freezes: controls,
		SyncPolicies: f.policy.syncing(engine, controls), Versions: httptool.New(httptool.Config{}), BaseURL: "http://" + backendLn.Addr().String()}, instance, intakeIDs, f.roles.batching, observers{metrics: intakeMetrics}, logger)
	if err != nil {
		return err
	}
	exec, execProc, err := executorLoop(cc, topics, reg, st, broker, f.creds.keystore(dataDir), syncedDecider{engine, f.policy.syncing(engine, controls)}, controls, 0, toolsFlags{base: "http://" + backendLn.Addr().String()}, instance, execIDs, f.roles.batching, observers{metrics: execMetrics}, logger)
	if err != nil {
		return err
	}
	pub, err := newPublisher(cc, topics.Requests)
	if err != nil {
		return err
	}
	defer pub.Close()
	api, err := httpapi.New(httpapi.Config{
		Publisher: pub,
		Calls:     index,
		Results:   storeResults{st},
		Logger:    logger.With("component", "httpapi"),
		Checks: []httpapi.Check{{Name: "kafka", Check: func(ctx context.Context) error {
			return pub.cl.Ping(ctx)
		}}},
	})
	if err != nil {
		return err
	}

	events, err := newEventPublisher(cc)
	if err != nil {
		return err
	}
	defer events.Close()
	approvalMetrics := metrics.New("approvals", reg.Has)
	queue, err := approvals.New(approvals.Config{
		Store: st, Registry: reg, Identity: staff, Publisher: events, Topics: topics,
		Versions: httptool.New(httptool.Config{}), BaseURL: "http://" + backendLn.Addr().String(), Freezes: controls,
		Actor: "approvals/" + instance, Metrics: approvalMetrics, Logger: logger.With("component", "approvals"),
	})
	if err != nil {
		return err
	}
	approvalMetrics.ApprovalQueue(queue.Pending)

	mux := http.NewServeMux()
	mux.Handle(credentials.JWKSPath, broker.Handler())
	// Compensations are decided on a channel of their own, as the
	// reconciler role's are: the policies let the undo tools run there
	// alone, not on an agent's request.
	submitter, err := intake.New(intake.Config{Registry: reg, Store: st, Policy: engine, PolicyRetryAfter: f.policy.retryAfter, Freezes: controls,
		SyncPolicies: f.policy.syncing(engine, controls), Topics: topics, Channel: "compensation", Actor: "compensation/" + instance, Logger: logger.With("component", "compensation")})
	if err != nil {
		return err
	}
	undo, err := compensation.New(compensation.Config{
		Store: st, Registry: reg, Intake: submitter, Publisher: events, Identity: staff, Topics: topics,
		Logger: logger.With("component", "compensation"), Landing: undoLanding,
	})
	if err != nil {
		return err
	}
	reconciler, err := executor.NewReconciler(executor.ReconcilerConfig{
		Registry: reg, Store: st, Looker: httptool.New(httptool.Config{}), Credentials: broker, Secrets: f.creds.keystore(dataDir),
		BaseURL: "http://" + backendLn.Addr().String(), Topics: topics, Owner: "reconciler/" + instance,
		Logger: logger.With("processor", "reconciler"), Compensator: undo, Metrics: reconcileMetrics, Freezes: controls,
	})
	if err != nil {
		return err
	}
	mux.Handle("/v1/compensations", undo.Handler())
	reconcileIDs, err := g.kafka.loopIDs("reconciler", instance)
	if err != nil {
		return err
	}
	reconcileRole, err := reconciler.Loop(f.roles.batching.loop(ledger.LoopConfig{Client: cc, Group: reconcileIDs.group, TransactionalID: reconcileIDs.txn, Metrics: reconcileMetrics}))
	if err != nil {
		return err
	}
	reconcileMetrics.Unknown(reconciler.Unknown)
	reconcileMetrics.Parked(reconciler.Parked)
	roleNames := []string{"intake", "executor", "reconciler"}
	roleLoops := []*ledger.Loop{intakeRole, exec, reconcileRole}
	for i, m := range []*metrics.Registry{intakeMetrics, execMetrics, reconcileMetrics} {
		m.ConsumerLag(kadm.NewClient(admin), roleLoops[i].Group(), logger)
		m.ControlStaleness(controls.Staleness)
		if roleNames[i] != "reconciler" { // the roles that decide
			m.Policy(func() string { return engine.Active().Version() })
		}
	}
	mux.Handle("/v1/resolutions", reconciler.ResolveHandler(staff, events))
	// For ledger bench --attach --ledger-ops: how the loops spend their
	// time.
	mux.Handle("GET "+loopsPath, loopsHandler(roleNames, roleLoops))
	if f.pprof {
		servePprof(mux)
	}

	kill, err := control.New(control.Config{
		State: controls, Publisher: events, Identity: staff, Topics: topics, Credentials: inspector, KnownTool: reg.Has,
		Logger: logger.With("component", "control"),
	})
	if err != nil {
		return err
	}
	mux.Handle("/v1/control", kill.Handler())
	mux.Handle("/v1/control/", kill.Handler())
	mux.Handle(control.IntrospectPath, kill.Handler())
	mux.Handle("/v1/approvals", queue.Handler())
	mux.Handle("/v1/approvals/", queue.Handler())
	// The agents' API; the console has the rest of the paths.
	mux.Handle("/v1/calls", api)
	mux.Handle("/v1/calls/", api)
	mux.Handle("GET /healthz", api)

	// The responders' questions: from ClickHouse when --clickhouse-dsn is
	// given, else from the embedded index.
	var (
		queries   projections.Queries = index
		chStore   *chstore.Store
		queryDesc = "embedded (" + filepath.Join(dataDir, "index.db") + ")"
	)
	if f.clickhouse.dsn != "" {
		chStore, err = f.clickhouse.open(ctx, logger.With("component", "chstore"))
		if err != nil {
			return err
		}
		defer chStore.Close()
		if err := chStore.Migrate(ctx); err != nil {
			return err
		}
		// A fresh database behind a group that already projected
		// (another database, or one since dropped): start the group
		// from the log's start, so the projection holds everything.
		starts, gap, err := projectionGap(ctx, chStore, cc, topics, devProjectorGroup)
		if err != nil {
			return err
		}
		if gap {
			logger.Info("clickhouse database is empty: projecting the log from its start", "database", chStore.Database())
			if err := projector.CommitOffsets(ctx, cc, devProjectorGroup, starts); err != nil {
				return err
			}
		}
		queries = chStore
		queryDesc = "ClickHouse (" + redactDSN(f.clickhouse.dsn) + ", database " + chStore.Database() + ", projector group " + devProjectorGroup + ")"
	}
	if err := mountQueries(mux, queries, staff, logger); err != nil {
		return err
	}
	indexer, err := projector.New(projector.Config{
		Client: cc, Topics: topics, Group: devIndexGroup,
		// Agents wait on the index for their calls: do not hold events
		// back to fill a batch.
		MaxWait: 5 * time.Millisecond,
		Logger:  logger.With("component", "callindex"),
	}, index)
	if err != nil {
		return err
	}
	var chProjector *projector.Projector
	lagOf := indexer
	if chStore != nil {
		chProjector, err = projector.New(projector.Config{Client: cc, Topics: topics, Group: devProjectorGroup, Logger: logger.With("component", "projector")}, chStore)
		if err != nil {
			return err
		}
		lagOf = chProjector
	}
	var ownMetrics http.Handler // the projector's, when it runs
	if chProjector != nil {
		ownMetrics = chProjector
	}
	mux.Handle("GET /metrics", metrics.Serve(ownMetrics, intakeMetrics, execMetrics, reconcileMetrics, approvalMetrics))
	// As the roles' --metrics-addr: each loop, Kafka, the store, the
	// copy of the control topic (at the executor's default bound), the
	// policies, the agents' assertions' keys and the approval timer.
	f.roles.controls, f.roles.controlReadiness, f.roles.controlMaxStaleness = controls, true, control.DefaultMaxStaleness
	f.roles.policies, f.roles.assertions = engine, ident
	loopChecks := make([]string, len(roleNames))
	for i, n := range roleNames {
		loopChecks[i] = "loop_" + n
	}
	mux.Handle("GET /readyz", readiness{checks: processChecks(loopChecks, roleLoops, admin, st, append(f.roles.readyChecks(), timerCheck(queue))...), logger: logger.With("server", "api")})
	health := http.NewServeMux() // its own, for another method's 405
	mux.Handle("/v1/health", httpjson.Unmatched(health))
	health.Handle("GET /v1/health", operatorGuard(staff, logger)(func(w http.ResponseWriter, r *http.Request, _ httpapi.Operator) {
		lag := lagOf.Lag()
		h := console.Health{
			Policy: engine.Active().Version(), Breakers: execProc.BreakerStates(),
			ProjectionLagRecords: lag.Records, ProjectionLagSeconds: lag.Time.Seconds(),
		}
		if err := engine.Err(); err != nil {
			h.PolicyError = err.Error()
		}
		writeHealth(w, h)
	}))
	ui, err := console.New(console.Config{
		API:          mux,
		Authenticate: consoleAuthenticate(staff),
		DevLogin: func(context.Context) (string, error) {
			// As long as the staff verifier allows: the session ends
			// with it, and the dev login starts another.
			return issuer.Mint(identity.Identity{Tenant: "t_demo", User: "u_console", Agent: "console", Roles: []string{"approver", "operator"}}, identity.ApproverAudience, identity.DefaultMaxLifetime)
		},
		Logger: logger.With("component", "console"),
	})
	if err != nil {
		return err
	}
	mux.Handle("/v1/", httpjson.NotFound()) // an API path no route takes: JSON, not the console's page
	mux.Handle("/", ui)

	grp, ctx := errgroup.WithContext(ctx)
	// Both answer whoever reaches them without asking who (every
	// tenant's calls and results; every effect applied): requests to a
	// name that is not loopback's are refused, which a page of another
	// site, its name rebound to 127.0.0.1, would send from this machine.
	servers := []*http.Server{newServer("", httpjson.LoopbackOnly(backend.Handler())), newServer("", httpjson.LoopbackOnly(mux))}
	for i, ln := range []net.Listener{backendLn, apiLn} {
		srv := servers[i]
		grp.Go(func() error {
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		})
	}
	grp.Go(func() error { return watchPolicies(ctx) })
	grp.Go(func() error { return f.policy.followActivations(ctx, engine, controls) })
	// drained closes once the executor's calls still running at shutdown
	// have drained: the control copy they check before every attempt,
	// and the demo tools and the API they are sent to (whose credentials
	// the tools introspect there), serve until then; stopped first, the
	// calls' next attempts would fail for good.
	drained := make(chan struct{})
	grp.Go(func() error {
		// The control state already runs; it ends with the others.
		<-ctx.Done()
		<-drained
		stopControls()
		// Before the in-process Kafka closes (a deferred close):
		// its fetches would log errors after dev said it stopped.
		select {
		case <-controls.Stopped():
		case <-time.After(shutdownGrace):
		}
		return nil
	})
	grp.Go(func() error { return queue.RunTimer(ctx, time.Second) })
	grp.Go(func() error { return kill.Run(ctx) })
	grp.Go(func() error { return intakeRole.Run(ctx) })
	grp.Go(func() error {
		err := exec.Run(ctx)
		drainCalls(ctx, execProc.Drain, logger)
		close(drained)
		return err
	})
	grp.Go(func() error { return reconcileRole.Run(ctx) })
	grp.Go(func() error { return indexer.Run(ctx) })
	if chProjector != nil {
		grp.Go(func() error { return chProjector.Run(ctx) })
	}
	// Stopping, the agents' waits end at once, answered 202.
	servers[1].RegisterOnShutdown(api.EndWaits)
	grp.Go(func() error {
		<-ctx.Done()
		api.EndWaits()
		<-drained
		// The demo tools first, with the API still serving: they check
		// each credential at its introspection, and a call still at a
		// tool would otherwise be answered 503 (an outcome unknown).
		shutdown(shutdownGrace, logger, servers[0])
		shutdown(shutdownGrace, logger, servers[1])
		return nil
	})

	printBanner(os.Stdout, banner{
		issuer:  issuer.Issuer(),
		policy:  engine.Active().Version(),
		kafka:   cluster.ListenAddrs(),
		api:     apiLn.Addr().String(),
		backend: backendLn.Addr().String(),
		store:   storeDesc,
		queries: queryDesc,
		dataDir: dataDir,
		topics:  topics,
		pprof:   f.pprof,
	})
	err = grp.Wait()
	logger.Info("ledger dev stopped")
	return err
}

// writeHealth answers GET /v1/health.
func writeHealth(w http.ResponseWriter, h console.Health) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(h)
}

// storeResults serves finished calls' results from the execution store.
type storeResults struct {
	st interface {
		Get(ctx context.Context, key ledger.CallKey) (processors.Record, error)
	}
}

func (s storeResults) Result(ctx context.Context, key ledger.CallKey) (httpapi.Result, error) {
	rec, err := s.st.Get(ctx, key)
	if errors.Is(err, processors.ErrNotFound) {
		return httpapi.Result{}, nil
	}
	if err != nil {
		return httpapi.Result{}, err
	}
	res := httpapi.Result{CallID: rec.CallID, ArgumentsHash: rec.ArgumentsHash}
	if len(rec.Result) > 0 {
		res.Body = json.RawMessage(rec.Result)
	}
	return res, nil
}

// The data directory and addresses ledger dev uses, and every command
// that talks to it assumes, when not told otherwise.
const (
	devDataDir   = "./.ledger"
	devKafkaAddr = "127.0.0.1:9092"
	devHTTPAddr  = "127.0.0.1:8080"
)

type banner struct {
	issuer  string
	policy  string
	kafka   []string
	api     string
	backend string
	store   string
	queries string
	dataDir string
	topics  ledger.Topics
	pprof   bool // --pprof: the profiles are on the API
	// env looks up the environment the banner's commands run in (nil:
	// os.LookupEnv): a variable they would read, a deployment's shell's
	// say, is overridden on their command line.
	env func(string) (string, bool)
}

func printBanner(w io.Writer, b banner) {
	profiles := ""
	if b.pprof {
		profiles = fmt.Sprintf("  Profiles             http://%s%s   (go tool pprof http://%s%sprofile)\n", b.api, pprofPrefix, b.api, pprofPrefix)
	}
	fmt.Fprintf(w, `
Toolcall Ledger (dev) is running. Ctrl-C stops it.

  Kafka (in-process)   %v   topics: %s -> %s (dlq: %s)
  Console              http://%s/   (approvals, calls, incidents, health; one-click dev login)
  HTTP API             http://%s   (POST /v1/calls, GET /v1/calls/{key}?tenant_id=..., GET /healthz)
  Operations           http://%s/metrics   (each role's series, labelled role), /readyz, /loops
  Queries              %s   (GET /v1/blast-radius, /v1/outcomes, /v1/unresolved, /v1/trace/...)
  Demo tool backend    http://%s   (GET /effects lists every effect it applied since it started)
  Execution store      %s
  Data directory       %s
  Identity issuer      %s (dev key in the data directory; ledger token mints assertions)
  Policies             %s
  Credential keys      http://%s/.well-known/jwks.json
%s
Try:
  %sgo run ./cmd/ledger submit%s --tool get_weather --args '{"city":"Sydney"}' --tenant t_demo --wait
  curl -s 'http://%s/v1/calls/<idempotency_key>?tenant_id=t_demo'
  go run ./cmd/ledger blast-radius%s --tool get_weather --tenant t_demo --since 1h

`, b.kafka, b.topics.Requests, b.topics.Events, b.topics.DLQ, b.api, b.api, b.api, b.queries, b.backend, b.store, b.dataDir, b.issuer, b.policy, b.api, profiles,
		b.tryEnv(), b.tryFlags(true), b.api, b.tryFlags(false))
}

// tryFlags are the flags the banner's example commands need to reach this
// ledger dev: those whose defaults it does not run on (a --data-dir, a
// --kafka-addr, topics or an --http-addr of its own). kafka: the command
// talks to Kafka (submit), else to the HTTP API (blast-radius).
//
// And those whose variables the environment sets: the commands would read
// them, and a shell set up for a deployment would have the banner's
// trial call published to its request topic, or its question asked of
// its ClickHouse (which --clickhouse-dsn, preferred to --api, names).
func (b banner) tryFlags(kafka bool) string {
	set := func(flag string) bool {
		_, ok := b.lookupEnv(envName(flag))
		return ok
	}
	var flags []string
	if def := (ledger.Topics{}).WithDefaults(); kafka {
		if set("api") {
			// Else submit goes through that API, not dev's Kafka.
			flags = append(flags, "--api", "''")
		}
		if !slices.Equal(b.kafka, []string{devKafkaAddr}) || set("kafka-brokers") {
			flags = append(flags, "--kafka-brokers", shellWord(strings.Join(b.kafka, ",")))
		}
		if b.topics.Requests != def.Requests || set("topic-requests") {
			flags = append(flags, "--topic-requests", shellWord(b.topics.Requests))
		}
		if b.topics.Events != def.Events || set("topic-events") {
			flags = append(flags, "--topic-events", shellWord(b.topics.Events))
		}
	} else {
		if set("clickhouse-dsn") {
			flags = append(flags, "--clickhouse-dsn", "''")
		}
		if b.api != devHTTPAddr || set("api") {
			flags = append(flags, "--api", shellWord("http://"+b.api))
		}
		if set("assertion") {
			// A deployment's operator's: sent to dev's API, and
			// refused there. Empty, one is minted from --data-dir.
			flags = append(flags, "--assertion", "''")
		}
	}
	if filepath.Clean(b.dataDir) != filepath.Clean(devDataDir) {
		flags = append(flags, "--data-dir", shellWord(b.dataDir))
	}
	if len(flags) == 0 {
		return ""
	}
	return " " + strings.Join(flags, " ")
}

// lookupEnv is b.env, or os.LookupEnv.
func (b banner) lookupEnv(name string) (string, bool) {
	if b.env == nil {
		return os.LookupEnv(name)
	}
	return b.env(name)
}

// tryEnv is what the banner's submit runs with in its environment: with
// a deployment agent's assertion there (which submit takes before
// minting one from --data-dir, and no flag undoes), that variable
// emptied, so that the trial call does not carry the deployment's
// bearer into dev, to be refused.
func (b banner) tryEnv() string {
	if _, ok := b.lookupEnv(agentAssertionEnv); ok {
		return agentAssertionEnv + "= "
	}
	return ""
}

// shellWord quotes s for a POSIX shell, where it needs it.
func shellWord(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./:,=@%+") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// loopbackOnly refuses an address other machines could reach: ledger dev
// listens on loopback only.
func loopbackOnly(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return errors.New("ledger dev listens on loopback only (127.0.0.1, ::1 or localhost): its API and tools take requests without credentials")
}

// devIndexGroup is the consumer group that projects ledger dev's events
// into its call index.
const devIndexGroup = "ledger-callindex"

// readFromStart moves group, stopped, to the start of its topics' logs:
// its next reader reads them whole again. A group that never committed
// starts there anyway.
func readFromStart(ctx context.Context, cc ledger.ClientConfig, topics ledger.Topics, group string) error {
	s, err := projector.Status(ctx, projector.StatusConfig{Client: cc, Topics: topics, Group: group})
	if errors.Is(err, projector.ErrNeverCommitted) {
		return nil
	}
	if err != nil {
		return err
	}
	return projector.CommitOffsets(ctx, cc, group, logStarts(s.Partitions))
}
