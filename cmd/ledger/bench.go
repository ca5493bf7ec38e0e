package main

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/loadtest"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/projector"
)

// benchIssuer names the benchmark's own agent identity provider.
const benchIssuer = "https://bench.ledger.invalid"

// nodePassedOn are the bench's flags that the ledger processes it starts
// get, under the same names, when set on the command line.
var nodePassedOn = []string{"batch-linger", "batch-linger-from", "policy-timeout"}

// benchFlags configure `ledger bench`.
type benchFlags struct {
	crdbDSN        string
	mix            string
	tenants        int
	calls          int64
	duration       time.Duration
	concurrency    int
	rate           float64
	sweep          string
	sizes          string
	scaling        string
	executors      int
	warmup         int64
	backendLatency time.Duration
	backendVerify  bool
	direct         bool
	limits         bool
	jsonOut        string
	svgOut         string
	workDir        string
	keep           bool
	profile        string
	baseline       string
	pairs          int
	nodeLogLevel   string
	batchLinger    time.Duration
	lingerFrom     int
	policyTimeout  time.Duration
	// nodeFlags are the flags passed on to the ledger processes (their
	// batching and policy budget): those set on the command line, so
	// that a --baseline binary that knows none runs with its defaults.
	nodeFlags     []string
	intakeProcess bool
	kafkaProcess  bool
	slo           time.Duration
	timeline      bool
	limitCalls    int
	clickhouse    clickhouseFlags
	attachFlags
}

func newBenchCmd(g *globals) *cobra.Command {
	var f benchFlags
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure the ledger end to end against calling the tools directly and against the raw limits of its engines, in one run",
		Long: `bench starts a ledger (intake and executors in processes of their own, on an
in-process Kafka and the embedded execution store unless --kafka-brokers and
--crdb-dsn name real ones; or, with --attach, drives one already running),
offers it calls of the demo tools from several tenants, and reports, from
one run on one machine:

  - calls/s and end-to-end latency percentiles (publish to the terminal event,
    read committed), and added latency (minus the tool's own time);
  - the ledger processes' CPU seconds per call and peak RSS, and the whole
    machine's CPU per call (every process, the store's and Kafka's too
    when they run here), and the share of the machine's CPU time its
    hypervisor gave to other guests meanwhile (steal: on a shared host,
    why one build's runs differ);
  - the same calls made directly to the tool backend (the floor);
  - the raw limits of the parts: transactional consume-produce records/s on
    the same Kafka, batched claims/s on the same store;
  - duplicate effects and lost calls, counted at the tool backend.

A closed loop (--concurrency calls in flight) is the main run; --sweep adds
open-loop runs at the given arrival rates (the latency against load plot,
--svg); --scaling runs with 1, 2, 4... executor processes over the topic's
partitions; --sizes repeats the main run at several call counts to show how
cost grows. Each run gets fresh topics, tables and ledger processes, and drops
its topics and tables once measured (--keep keeps them). The in-process Kafka
runs inside the bench, beside the load generator and the tool backend, unless
--kafka-process gives it a process of its own, whose CPU is then reported.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := f.checkAttachFlags(cmd.Flags()); err != nil {
				return err
			}
			embedded := !f.attach && !cmd.Flags().Changed("kafka-brokers") && os.Getenv("LEDGER_KAFKA_BROKERS") == ""
			if f.kafkaProcess && !embedded {
				return errors.New("bench: --kafka-process runs the bench's own broker; --kafka-brokers (or LEDGER_KAFKA_BROKERS) names another")
			}
			// --gc-percent is for the ledger processes the bench starts.
			harnessGC(loadtest.ThisMachine().MemoryGB)
			for _, name := range nodePassedOn {
				if fl := cmd.Flags().Lookup(name); fl.Changed {
					f.nodeFlags = append(f.nodeFlags, "--"+name, fl.Value.String())
				}
			}
			return runBench(cmd.Context(), g, &f, embedded, cmd.ErrOrStderr(), cmd.OutOrStdout())
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.crdbDSN, "crdb-dsn", "", "CockroachDB (or PostgreSQL) DSN for the execution store; empty: the embedded store (one ledger process). With --attach, the store of the raw limit's claims, and whose server's CPU the runs report when it is a PostgreSQL on this machine")
	fs.StringVar(&f.mix, "mix", "create_ticket", "tools and weights, e.g. get_weather=3,create_ticket=1 (get_weather, create_ticket, refund_order, and send_email, which the demo policy allows a tenant 60 times a minute: more are refused for now and sent again)")
	fs.IntVar(&f.tenants, "tenants", 8, "tenants the calls come from, round robin")
	fs.Int64Var(&f.calls, "calls", 20000, "calls per run (0: run for --duration)")
	fs.DurationVar(&f.duration, "duration", 0, "how long each run submits, when --calls is 0")
	fs.IntVar(&f.concurrency, "concurrency", 512, "calls in flight in the closed-loop runs and the direct floor")
	fs.Float64Var(&f.rate, "rate", 0, "make the main run open loop at this many calls/s")
	fs.StringVar(&f.sweep, "sweep", "", "open-loop arrival rates, calls/s, comma separated (e.g. 500,1000,2000): one run each, for the latency against load plot")
	fs.StringVar(&f.sizes, "sizes", "", "call counts, comma separated (e.g. 10000,100000,1000000): one closed-loop run each, to show how CPU and memory grow")
	fs.StringVar(&f.scaling, "scaling", "", "executor counts, comma separated (e.g. 1,2,4): one closed-loop run each")
	fs.IntVar(&f.executors, "executors", 1, "executor instances in the main run: a process each with --crdb-dsn; on the embedded store, which one process owns, instances in the one ledger process")
	fs.Int64Var(&f.warmup, "warmup", 2000, "calls each run makes before it measures (joins groups, warms connections)")
	fs.DurationVar(&f.backendLatency, "backend-latency", 0, "latency the demo backend adds to every tool request")
	fs.BoolVar(&f.backendVerify, "backend-verify", false, "make the demo backend verify each call's credential, as a deployed tool would (costs CPU on the same machine)")
	fs.BoolVar(&f.direct, "direct", true, "also make the same calls directly to the backend (the floor)")
	fs.BoolVar(&f.limits, "limits", true, "also measure the raw limits: transactional Kafka consume-produce and batched store claims")
	fs.IntVar(&f.limitCalls, "limit-calls", 20000, "calls' worth of work for the raw limits: this many claims, four times as many Kafka records")
	fs.StringVar(&f.jsonOut, "json", "", "write the report as JSON to this file")
	fs.DurationVar(&f.slo, "slo", 50*time.Millisecond, "the added p99 the open-loop runs (--rate, --sweep) are held to: the report names the highest offered rate at which it held, with every rate below it (0: not reported)")
	fs.StringVar(&f.svgOut, "svg", "", "write the latency against offered load plot (from --sweep) to this SVG file")
	fs.StringVar(&f.workDir, "work-dir", "", "directory for the run's files (embedded stores, keys, process logs); default a temporary one")
	fs.BoolVar(&f.keep, "keep", false, "keep the work directory afterwards, and each run's topics and (with --crdb-dsn) its schema, which a run otherwise drops once measured")
	fs.StringVar(&f.clickhouse.dsn, "clickhouse-dsn", "", "also project every run's events into this ClickHouse (native protocol) and report the projection's lag under the load")
	fs.StringVar(&f.clickhouse.database, "clickhouse-database", "ledger_bench", "ClickHouse database of the benchmark's projection: never a production one")
	fs.StringVar(&f.nodeLogLevel, "node-log-level", "warn", "log level of the ledger processes (their logs are in the work directory)")
	fs.DurationVar(&f.batchLinger, "batch-linger", defaultLinger, "the ledger processes' --batch-linger, passed on when set here (a --baseline binary must then know the flag too)")
	fs.IntVar(&f.lingerFrom, "batch-linger-from", defaultLingerFrom, "the ledger processes' --batch-linger-from, passed on when set here (a --baseline binary must then know the flag too)")
	fs.DurationVar(&f.policyTimeout, "policy-timeout", policy.DefaultTimeout, "the ledger processes' --policy-timeout, passed on when set here (a --baseline binary must then know the flag too): on a starved host a decision descheduled past it refuses its call for now, which the load generator sends again (the report counts those), so raising it tells a slow host from slow policies")
	fs.BoolVar(&f.kafkaProcess, "kafka-process", false, "run the in-process Kafka in a process of its own, apart from the load generator and the tool backend, as a deployed broker is; the runs then report its CPU apart from the harness's (not with --kafka-brokers)")
	fs.BoolVar(&f.intakeProcess, "intake-process", false, "run the intake in a process of its own, apart from the executors, as a deployment of separate intake and executor processes does (needs --crdb-dsn: the embedded store belongs to one process)")
	fs.StringVar(&f.baseline, "baseline", "", "another ledger binary (say, built from the main branch) to compare this build with: the main run is repeated --pairs times for each build, alternating, on the same harness, and the report adds a side-by-side table of medians")
	fs.IntVar(&f.pairs, "pairs", 3, "with --baseline, how many runs of each build")
	fs.BoolVar(&f.timeline, "timeline", false, "also print each run second by second: the calls submitted and finished, the latencies and stage p99s of those finished, the CPU of the ledger, the store, the harness (and its garbage collector) and the machine, the CPU the hypervisor took (steal), and the share of each second the intake's and executors' loops spent in steps and transactions, with their busy time per step (the JSON report always has it)")
	fs.StringVar(&f.profile, "profile", "", "write each ledger process's CPU and allocation profiles (run<N>-node<M>.*.pprof), and the harness's (harness.*.pprof) and with --kafka-process the Kafka process's (kafka.*.pprof), both over the whole bench, into this directory (go tool pprof); with --attach, those of each process --ledger-ops names over each run's submitting (run<N>-ledger<M>.*.pprof, from its /debug/pprof/: start it with --pprof; needs --calls 0 and --duration)")
	f.attachFlags.register(fs)
	cmd.AddCommand(newBenchNodeCmd(g), newBenchKafkaCmd())
	return cmd
}

// benchEnv is what every run of one `ledger bench` shares.
type benchEnv struct {
	g      *globals
	f      *benchFlags
	logger *slog.Logger
	// embedded: the Kafka is the bench's own (in process, or a process of
	// its own), not a cluster of the operator's.
	embedded bool
	// pages asks the ledger processes for their pages (/loops, /metrics,
	// keys, /debug/pprof/): with the client flags (--http-client-*), as
	// every client of the ledger's own servers, for an attached
	// deployment's may require a client certificate or a private CA.
	pages    *http.Client
	progress io.Writer
	dir      string
	cc       ledger.ClientConfig
	brokers  []string
	issuer   *identity.Issuer
	jwksFile string
	// nodeKeys are, with --backend-verify, the URLs where the current
	// run's ledger processes serve their credential keys (--jwks-addr,
	// picked as the run starts): the backend's verifier reads them all
	// (runKeys), as a deployed tool lists every executor's. Under
	// nodeKeysMu: the verifier reads them from the backend's handlers.
	nodeKeysMu sync.Mutex
	nodeKeys   []string
	backend    *demobackend.Server
	toolsURL   string
	tools      []loadtest.Tool
	runs       int
	ch         *chstore.Store // nil: no projection
	// id makes this invocation's idempotency keys and store schemas
	// unique in a store that outlives it.
	id string
	// pg is the store's PostgreSQL server when it runs on this machine:
	// the runs then report its CPU. Nil otherwise.
	pg *pgServer
	// kafka is the broker's process with --kafka-process: the runs then
	// report its CPU apart from the harness's. Nil otherwise.
	kafka *benchNode
	// srv serves backend at toolsURL; nil with --attach, where the
	// running ledger's backend is at toolsURL.
	srv *http.Server
	// attached are the running ledger's processes given with
	// --ledger-pid (--attach), measured but not the bench's to stop;
	// attachedLoops where its processes serve their loops' time
	// (--ledger-ops).
	attached      []*benchNode
	attachedLoops []string
}

// harnessGC sets the bench process's own collector, unless GOGC is set.
// That process is the harness: the load, the demo tools with their record
// of every effect and, unless --kafka-process or --kafka-brokers moves it
// out, the in-process Kafka's log, a live heap that grows with the run.
// At Go's default target its collector took a fifth of the harness's CPU
// in a profile, CPU that the two cores share with the ledger
// (BENCHMARKS.md). It collects at the ledger's target instead, under a
// soft limit (GOMEMLIMIT, else a quarter of the machine's memory, memGB)
// so that a long run's log makes it collect more often rather than take
// five times its size; at Go's default when neither bound is known.
func harnessGC(memGB int) {
	if _, ok := os.LookupEnv("GOGC"); ok {
		return
	}
	_, limited := os.LookupEnv("GOMEMLIMIT")
	switch {
	case limited:
	case memGB > 0:
		debug.SetMemoryLimit(int64(memGB) << 30 / 4)
	default:
		debug.SetGCPercent(100)
		return
	}
	debug.SetGCPercent(defaultGCPercent)
}

// startBackend creates the bench's agent identity provider, trusted by
// the intake through a JWKS file, picks where each ledger process will
// serve its credential keys, and starts the demo tool backend on a
// loopback port, trusting those keys with --backend-verify. closeBackend
// stops it.
func (e *benchEnv) startBackend() error {
	var err error
	if e.issuer, err = identity.LoadOrCreateIssuer(filepath.Join(e.dir, "issuer.key"), benchIssuer); err != nil {
		return err
	}
	e.jwksFile = filepath.Join(e.dir, "issuer.jwks.json")
	if err := os.WriteFile(e.jwksFile, e.issuer.Keys().JWKS(), 0o600); err != nil {
		return err
	}
	bc := demobackend.Config{Latency: e.f.backendLatency, Logger: e.logger.With("component", "demobackend")}
	if e.f.backendVerify {
		// Each process has a broker of its own, with its own keys, as
		// each deployed executor has: two brokers rotating in one
		// directory would race. The verifier fetches every process's
		// keys, as a tool does, from the addresses of the run.
		if bc.Credentials, err = credentials.NewVerifier(credentials.VerifierConfig{Audience: demobackend.DefaultAudience, Keys: e.runKeys, Logger: e.logger}); err != nil {
			return err
		}
	}
	e.backend = demobackend.New(bc)
	e.srv, e.toolsURL, err = serveBackend(e.backend)
	return err
}

// serveBackend serves b on a loopback port and returns the server and
// its URL.
func serveBackend(b *demobackend.Server) (*http.Server, string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	srv := newServer("", b.Handler())
	go func() { _ = srv.Serve(ln) }()
	return srv, "http://" + ln.Addr().String(), nil
}

// closeBackend stops what startBackend started.
func (e *benchEnv) closeBackend() {
	if e.srv != nil {
		e.srv.Close()
	}
	if e.backend != nil {
		e.backend.Close()
	}
}

// coreSpeedFor is how long each reading of the host's speed takes.
const coreSpeedFor = 300 * time.Millisecond

// benchClient is the bench's own Kafka client configuration: on its
// in-process Kafka (embedded), a plain one; on a cluster of the
// operator's, that cluster's TLS and SASL settings, for the load, the
// attached run's reads and the raw limits. (The node processes a
// non-attached run starts get them from nodeKafkaEnv.)
func benchClient(g *globals, embedded bool, brokers []string, logger *slog.Logger) ledger.ClientConfig {
	if embedded {
		return ledger.ClientConfig{Brokers: brokers, Logger: logger}
	}
	cc := g.kafka.client(logger)
	cc.Brokers = brokers
	return cc
}

// nodeKafkaFlags are the root's Kafka flags a bench node takes from the
// bench beyond the brokers and topics its arguments name: the group
// prefix and the security settings. Passed in the environment, never as
// arguments, where a password would show, and which a --baseline binary
// of an older build would refuse when it does not know one.
var nodeKafkaFlags = []string{
	"kafka-group-prefix", "kafka-tls", "kafka-tls-ca", "kafka-tls-cert", "kafka-tls-key",
	"kafka-tls-server-name", "kafka-tls-insecure-skip-verify", "kafka-sasl-mechanism",
	"kafka-sasl-user", "kafka-sasl-password", "kafka-sasl-token-file", "kafka-sasl-allow-plaintext",
}

// nodeKafkaEnv is the environment a bench node gets for nodeKafkaFlags:
// on a cluster of the operator's, the bench's own settings (those of its
// flags or its environment); on its in-process Kafka, the defaults,
// which override any inherited LEDGER_KAFKA_* meant for a real cluster.
func nodeKafkaEnv(g *globals, embedded bool) []string {
	k := g.kafka
	if embedded {
		k = kafkaFlags{}
	}
	tc, sc := k.security.TLS, k.security.SASL
	prefix := k.groupPrefix
	if prefix == "" {
		prefix = defaultGroupPrefix
	}
	values := map[string]string{
		"kafka-group-prefix": prefix, "kafka-tls": strconv.FormatBool(tc.Enabled), "kafka-tls-ca": tc.CAFile,
		"kafka-tls-cert": tc.CertFile, "kafka-tls-key": tc.KeyFile, "kafka-tls-server-name": tc.ServerName,
		"kafka-tls-insecure-skip-verify": strconv.FormatBool(tc.InsecureSkipVerify), "kafka-sasl-mechanism": sc.Mechanism,
		"kafka-sasl-user": sc.User, "kafka-sasl-password": sc.Password, "kafka-sasl-token-file": sc.TokenFile,
		"kafka-sasl-allow-plaintext": strconv.FormatBool(sc.AllowPlaintext),
	}
	env := make([]string, 0, len(nodeKafkaFlags))
	for _, name := range nodeKafkaFlags {
		env = append(env, envName(name)+"="+values[name])
	}
	return env
}

func runBench(ctx context.Context, g *globals, f *benchFlags, embedded bool, progress, out io.Writer) error {
	if err := f.validate(); err != nil {
		return err
	}
	tools, err := loadtest.ParseMix(f.mix)
	if err != nil {
		return fmt.Errorf("bench: --mix: %w", err)
	}
	if f.baseline != "" {
		nodeArgs := f.nodeFlags
		if f.backendVerify {
			nodeArgs = append(slices.Clone(nodeArgs), "--jwks-addr")
		}
		if err := checkBaseline(ctx, f.baseline, nodeArgs); err != nil {
			return err
		}
	}
	logger := g.logger()
	dir, cleanup, err := makeWorkDir(f.workDir, "ledger-bench-", f.keep)
	if err != nil {
		return err
	}
	defer cleanup()
	// The host's speed, before anything of the bench's runs or its
	// profile (and after, below): figures of two reports compare
	// through it.
	speedStart := loadtest.CoreSpeed(ctx, coreSpeedFor)
	stopHarnessProfile := func() {}
	if f.profile != "" {
		if err := os.MkdirAll(f.profile, 0o755); err != nil {
			return err
		}
		// The harness (load, tool backend, and Kafka unless
		// --kafka-process) shares the machine with the ledger; its
		// profile shows what it takes.
		stop, err := startProfiles(filepath.Join(f.profile, "harness"))
		if err != nil {
			return fmt.Errorf("profile the harness: %w", err)
		}
		stopHarnessProfile = sync.OnceFunc(stop)
		defer stopHarnessProfile()
	}
	pages, err := g.httpClient.client(logger, 0)
	if err != nil {
		return err
	}
	env := &benchEnv{g: g, f: f, logger: logger, embedded: embedded, progress: progress, dir: dir, tools: tools, pages: pages,
		id: strconv.FormatInt(time.Now().UnixNano(), 36)}

	report := loadtest.Report{Machine: loadtest.ThisMachine(), At: time.Now().UTC(), Mix: f.mix, Tenants: f.tenants, Concurrency: f.concurrency, BackendLatency: f.backendLatency}
	report.Machine.SignsPerSecStart = speedStart
	switch {
	case embedded && f.kafkaProcess:
		kafka, addr, err := startKafkaProcess(ctx, dir, f.profile)
		if err != nil {
			return err
		}
		defer func() {
			if _, err := kafka.stop(); err != nil {
				logger.Warn("stop the kafka process", "err", err)
			}
		}()
		env.kafka, env.brokers = kafka, []string{addr}
		report.Kafka = "kfake (a process of its own, 1 broker)"
	case embedded:
		cluster, err := benchKafkaCluster()
		if err != nil {
			return err
		}
		defer cluster.Close()
		env.brokers = cluster.ListenAddrs()
		report.Kafka, report.KafkaInHarness = "kfake (in process, 1 broker)", true
	default:
		env.brokers = g.kafka.brokers
		report.Kafka = strings.Join(env.brokers, ",")
	}
	env.cc = benchClient(g, embedded, env.brokers, logger)
	report.Store = "embedded (bbolt)"
	if f.crdbDSN != "" {
		report.Store = redactDSN(f.crdbDSN) + " (a schema per run)"
	}

	defer env.closeBackend()
	if f.attach {
		if err := env.attach(ctx, &report); err != nil {
			return err
		}
	} else if err := env.startBackend(); err != nil {
		return err
	}
	if f.clickhouse.dsn != "" {
		if env.ch, err = f.clickhouse.open(ctx, logger.With("component", "chstore")); err != nil {
			return err
		}
		defer env.ch.Close()
		if err := env.ch.Migrate(ctx); err != nil {
			return err
		}
		report.ClickHouse = redactDSN(f.clickhouse.dsn) + " database " + env.ch.Database()
	}
	fmt.Fprintf(progress, "bench: kafka %s, store %s, tools %s, mix %s, work dir %s\n", report.Kafka, report.Store, env.toolsURL, f.mix, dir)

	if f.crdbDSN != "" {
		if pg, ok := findLocalPostgres(ctx, f.crdbDSN); ok {
			env.pg = pg
		} else {
			fmt.Fprintln(progress, "bench: the store's server is not a PostgreSQL on this machine: its CPU is not reported")
		}
	}
	executors := f.executors
	if f.attach {
		executors = 0 // the running ledger's own, unknown here
	}
	main := benchRun{name: "ledger", executors: executors, calls: f.calls, rate: f.rate}
	for _, r := range mainRuns(main, f.baseline, f.pairs) {
		rep, err := env.run(ctx, r)
		if err != nil {
			return err
		}
		report.Runs = append(report.Runs, rep)
	}
	report.Baseline = f.baseline
	for _, rate := range parseFloats(f.sweep) {
		r, err := env.run(ctx, benchRun{name: fmt.Sprintf("open %g/s", rate), executors: executors, calls: f.calls, rate: rate})
		if err != nil {
			return err
		}
		report.Runs = append(report.Runs, r)
	}
	for _, n := range parseFloats(f.scaling) {
		r, err := env.run(ctx, benchRun{name: fmt.Sprintf("%d executors", int(n)), executors: int(n), calls: f.calls})
		if err != nil {
			return err
		}
		report.Runs = append(report.Runs, r)
	}
	for _, n := range parseFloats(f.sizes) {
		r, err := env.run(ctx, benchRun{name: fmt.Sprintf("%d calls", int64(n)), executors: executors, calls: int64(n)})
		if err != nil {
			return err
		}
		report.Runs = append(report.Runs, r)
	}
	if f.direct {
		d, err := env.directFloor(ctx)
		if err != nil {
			return err
		}
		report.Direct = &d
	}
	if f.limits {
		lims, err := env.rawLimits(ctx)
		if err != nil {
			return err
		}
		report.Limits = lims
	}
	// Outside the harness's profile, and without the runs' garbage for
	// the collector to work through meanwhile.
	stopHarnessProfile()
	runtime.GC()
	report.Machine.SignsPerSecEnd = loadtest.CoreSpeed(ctx, coreSpeedFor)
	report.CheckSLO(f.slo)
	if err := report.WriteTable(out); err != nil {
		return err
	}
	if f.timeline {
		if err := report.WriteTimeline(out); err != nil {
			return err
		}
	}
	if f.jsonOut != "" {
		if err := writeFileWith(f.jsonOut, report.WriteJSON); err != nil {
			return err
		}
	}
	if f.svgOut != "" {
		var pts []loadtest.LoadPoint
		for _, r := range report.Runs {
			if r.Result.Mode == "open" {
				pts = append(pts, r.Result.Point())
			}
		}
		store := "embedded store"
		if f.crdbDSN != "" {
			store = "CockroachDB/PostgreSQL"
		}
		title := fmt.Sprintf("ledger bench: %s, %s, %d cores", f.mix, store, report.Machine.Cores)
		if err := writeFileWith(f.svgOut, func(w io.Writer) error { return loadtest.PlotSVG(w, title, pts) }); err != nil {
			return err
		}
	}
	if bad := report.Failures(); len(bad) > 0 {
		return fmt.Errorf("bench: %s", strings.Join(bad, "; "))
	}
	return nil
}

// mainRuns is the main run, or with a baseline binary pairs runs of
// each build, alternating in the order ABBA so that a machine that drifts
// during the benchmark favours neither.
func mainRuns(main benchRun, baseline string, pairs int) []benchRun {
	if baseline == "" {
		return []benchRun{main}
	}
	var runs []benchRun
	for i := range pairs {
		this, base := main, main
		this.name = fmt.Sprintf("ledger #%d", i+1)
		base.name, base.binary = fmt.Sprintf("baseline #%d", i+1), baseline
		if i%2 == 0 {
			runs = append(runs, base, this)
		} else {
			runs = append(runs, this, base)
		}
	}
	return runs
}

// checkBaseline fails unless binary can run the benchmark's ledger
// processes, so that a wrong path or a build older than "bench node" is
// told at once rather than after the first run.
func checkBaseline(ctx context.Context, binary string, nodeArgs []string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, binary, "bench", "node", "--help").CombinedOutput()
	if err != nil {
		tail := strings.TrimSpace(string(out))
		if len(tail) > 300 {
			tail = "..." + tail[len(tail)-300:]
		}
		return fmt.Errorf("bench: --baseline %s cannot run the ledger processes (bench node --help: %v): %s", binary, err, tail)
	}
	// The flags passed on to the ledger processes must mean the same to
	// both builds: refused now rather than as a process that exits.
	for _, a := range nodeArgs {
		if strings.HasPrefix(a, "--") && !strings.Contains(string(out), a+" ") {
			return fmt.Errorf("bench: --baseline %s does not know %s, which its ledger processes would be given", binary, a)
		}
	}
	return nil
}

// storeCPU is the CPU time so far of the store's server, when it runs on
// this machine; an error when it cannot be read.
func (e *benchEnv) storeCPU() (time.Duration, error) {
	if e.pg == nil {
		return 0, errors.New("no local store server")
	}
	return e.pg.cpu()
}

// makeWorkDir returns dir, created if missing, or when dir is empty a new
// temporary directory named by prefix, which cleanup removes unless keep.
func makeWorkDir(dir, prefix string, keep bool) (string, func(), error) {
	if dir != "" {
		return dir, func() {}, os.MkdirAll(dir, 0o700)
	}
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return "", nil, err
	}
	if keep {
		return dir, func() {}, nil
	}
	return dir, func() { os.RemoveAll(dir) }, nil
}

func (f *benchFlags) validate() error {
	switch {
	case f.calls < 0, f.calls == 0 && f.duration <= 0:
		return errors.New("bench: set --calls, or --calls 0 and a --duration")
	case f.concurrency <= 0:
		return errors.New("bench: --concurrency must be positive")
	case f.tenants < 1:
		return errors.New("bench: --tenants must be at least 1")
	case f.executors <= 0:
		return errors.New("bench: --executors must be positive")
	case f.limits && f.limitCalls <= 0:
		return errors.New("bench: --limit-calls must be positive")
	case f.warmup < 0:
		return errors.New("bench: --warmup must not be negative")
	case f.baseline != "" && f.pairs <= 0:
		return errors.New("bench: --pairs must be positive")
	case f.slo < 0:
		return errors.New("bench: --slo must not be negative")
	case f.batchLinger < 0:
		return errors.New("bench: --batch-linger must not be negative")
	case f.lingerFrom < 0:
		return errors.New("bench: --batch-linger-from must not be negative")
	case f.policyTimeout < 0:
		return errors.New("bench: --policy-timeout must not be negative")
	case f.intakeProcess && f.crdbDSN == "":
		return errors.New("bench: --intake-process needs --crdb-dsn: the embedded store belongs to one process")
	}
	for _, list := range []struct{ name, v string }{{"--sweep", f.sweep}, {"--sizes", f.sizes}, {"--scaling", f.scaling}} {
		for s := range strings.SplitSeq(list.v, ",") {
			if s = strings.TrimSpace(s); s == "" {
				continue
			}
			if v, err := strconv.ParseFloat(s, 64); err != nil || v <= 0 {
				return fmt.Errorf("bench: %s: %q is not a positive number", list.name, s)
			}
		}
	}
	return nil
}

func parseFloats(s string) []float64 {
	var out []float64
	for p := range strings.SplitSeq(s, ",") {
		if v, err := strconv.ParseFloat(strings.TrimSpace(p), 64); err == nil && v > 0 {
			out = append(out, v)
		}
	}
	return out
}

func writeFileWith(path string, write func(io.Writer) error) error {
	fh, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(fh); err != nil {
		fh.Close()
		return err
	}
	return fh.Close()
}

// benchRun is one run: fresh topics, fresh ledger processes.
type benchRun struct {
	name string
	// binary runs the ledger processes: "" is this build, else the
	// --baseline binary.
	binary    string
	executors int
	calls     int64
	rate      float64
}

// run starts the ledger processes of r on fresh topics, warms them up,
// offers r's load, stops them, and measures.
func (e *benchEnv) run(ctx context.Context, r benchRun) (loadtest.RunReport, error) {
	e.runs++
	if e.f.attach {
		return e.measure(ctx, r, e.g.kafka.topics(), e.attached, "")
	}
	dsn, dropStore, err := e.storeSchema(ctx, fmt.Sprintf("run%d", e.runs))
	if err != nil {
		return loadtest.RunReport{}, err
	}
	dataDir := filepath.Join(e.dir, fmt.Sprintf("run%d", e.runs)) // the embedded store's
	if dsn == "" && !e.f.keep {
		dropStore = func() error { return os.RemoveAll(dataDir) }
	}
	prefix := fmt.Sprintf("bench%d.", e.runs)
	topics := ledger.Topics{Requests: prefix + "requests", Events: prefix + "events", Control: prefix + "control", DLQ: prefix + "dlq"}
	admin, err := ledger.NewClient(e.cc)
	if err != nil {
		_ = dropStore()
		return loadtest.RunReport{}, err
	}
	defer admin.Close()
	// Once the run is measured (this runs after its processes are
	// stopped), its tables and topics go, as the backend forgets its
	// requests (below): left in place, the store vacuums a run's tables
	// and the in-process Kafka holds its log in the harness's heap while
	// the next runs are measured, and each run of a sweep pays for the
	// ones before it.
	defer func() {
		if e.f.keep {
			return
		}
		// Even when the run was interrupted: topics on a real Kafka
		// outlive the benchmark.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := errors.Join(dropStore(), deleteTopics(dctx, admin, topics)); err != nil {
			fmt.Fprintf(e.progress, "bench: %s: its topics and tables not all dropped: %v\n", r.name, err)
			return
		}
		fmt.Fprintf(e.progress, "bench: %s: its topics and tables dropped\n", r.name)
	}()
	err = ledger.EnsureTopics(ctx, admin, ledger.TopicConfig{Topics: topics, Partitions: e.g.kafka.partitions, ReplicationFactor: e.g.kafka.replicas})
	if err != nil {
		return loadtest.RunReport{}, err
	}

	procs, firstExecutor := e.nodeCount(r.executors), 0
	if e.f.intakeProcess {
		firstExecutor = 1
	}
	var nodes []*benchNode
	defer func() {
		for _, n := range nodes {
			n.kill()
		}
	}()
	var keys []string
	defer e.setNodeKeys(nil)
	// Every address the run's processes listen on, picked at once: one
	// picked after another was given back could be the same port, and
	// so could one picked after a process was started and before it
	// bound its own.
	need := procs
	if e.f.backendVerify {
		need += procs - firstExecutor
	}
	addrs, err := freeLoopbackAddrs(need)
	if err != nil {
		return loadtest.RunReport{}, err
	}
	for i := range procs {
		args := []string{
			"--kafka-brokers", strings.Join(e.brokers, ","),
			"--topic-requests", topics.Requests, "--topic-events", topics.Events,
			"--topic-control", topics.Control, "--topic-dlq", topics.DLQ,
			"--log-level", e.f.nodeLogLevel,
			"--gc-percent", strconv.Itoa(e.g.gcPercent),
			"bench", "node",
			"--instance-id", fmt.Sprintf("bench%d-%d", e.runs, i),
			"--tools-base-url", e.toolsURL,
		}
		if i >= firstExecutor {
			// A directory of its own for the process of this index, the
			// same in every run (one process at a time uses it), and
			// with --backend-verify an address to serve its keys on.
			args = append(args, "--credential-key-dir", filepath.Join(e.dir, "credentials", fmt.Sprintf("node%d", i)))
			if e.f.backendVerify {
				// Picked for the run, as --metrics-addr is: a port
				// picked for the whole bench could be taken meanwhile.
				addr := addrs[0]
				addrs = addrs[1:]
				args = append(args, "--jwks-addr", addr)
				keys = append(keys, "http://"+addr+credentials.JWKSPath)
			}
		}
		if e.f.profile != "" {
			args = append(args, "--profile", filepath.Join(e.f.profile, fmt.Sprintf("run%d-node%d", e.runs, i)))
		}
		args = append(args, e.f.nodeFlags...)
		if i == 0 {
			args = append(args, "--intake", "--issuer", benchIssuer, "--jwks-file", e.jwksFile)
		}
		switch {
		case i < firstExecutor:
			args = append(args, "--executors", "0")
		case dsn != "":
			args = append(args, "--executors", "1")
		default:
			args = append(args, "--data-dir", dataDir, "--executors", strconv.Itoa(r.executors))
		}
		addr := addrs[0]
		addrs = addrs[1:]
		args = append(args, "--metrics-addr", addr)
		// The DSN in the environment (an empty one overrides any the
		// bench inherited), as the Kafka settings.
		n, err := startNode(r.binary, args, append(nodeKafkaEnv(e.g, e.embedded), storeEnv(dsn)), filepath.Join(e.dir, fmt.Sprintf("run%d-node%d.log", e.runs, i)))
		if err != nil {
			return loadtest.RunReport{}, err
		}
		n.metricsURL, n.loopsURL = "http://"+addr+"/metrics", "http://"+addr+loopsPath
		nodes = append(nodes, n)
	}
	e.setNodeKeys(keys)
	return e.measure(ctx, r, topics, nodes, dsn)
}

// setNodeKeys says where the run's ledger processes serve their keys.
func (e *benchEnv) setNodeKeys(urls []string) {
	e.nodeKeysMu.Lock()
	defer e.nodeKeysMu.Unlock()
	e.nodeKeys = urls
}

// runKeys is the backend's verifier's key set (VerifierConfig.Keys): the
// keys every process of the run serves, in one set. A process that does
// not answer (not started yet, gone, or stopped mid-answer) adds none,
// and a key of it is then unknown until a later fetch (the verifier
// fetches again on meeting one, at most once a second); none answering is
// an error.
func (e *benchEnv) runKeys(ctx context.Context) ([]byte, error) {
	e.nodeKeysMu.Lock()
	urls := slices.Clone(e.nodeKeys)
	e.nodeKeysMu.Unlock()
	return keySets(ctx, e.pages, urls, 2*time.Second)
}

// keySets fetches the JWKS at urls, each within timeout and all at once,
// so that one that hangs holds back none of the others, and returns
// their keys in one set; none answering is an error.
func keySets(ctx context.Context, hc *http.Client, urls []string, timeout time.Duration) ([]byte, error) {
	sets := make([][]json.RawMessage, len(urls))
	errs := make([]error, len(urls))
	var wg sync.WaitGroup
	for i, url := range urls {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			var set struct {
				Keys []json.RawMessage `json:"keys"`
			}
			errs[i] = getJSON(ctx, hc, url, 1<<20, &set)
			sets[i] = set.Keys
		})
	}
	wg.Wait()
	var all struct {
		Keys []json.RawMessage `json:"keys"`
	}
	all.Keys = []json.RawMessage{}
	failed := 0
	for i := range urls {
		if errs[i] != nil {
			failed++
			continue
		}
		all.Keys = append(all.Keys, sets[i]...)
	}
	if len(urls) > 0 && failed == len(urls) {
		return nil, errors.Join(errs...)
	}
	return json.Marshal(all)
}

// nodeCount is how many ledger processes a run with executors executor
// instances starts: one runs the intake (and, on the embedded store,
// every executor); with a shared store each further executor is a
// process of its own, and with --intake-process the first one too.
func (e *benchEnv) nodeCount(executors int) int {
	n := 1
	if e.f.crdbDSN != "" {
		n = executors
	}
	if e.f.intakeProcess {
		n++
	}
	return n
}

// measure offers r's load to the ledger processes nodes (the bench's,
// stopped once measured, or with --attach those it was told of) on
// topics, and measures the run. dsn is the run's store schema, "" on the
// embedded store or a ledger the bench did not start.
func (e *benchEnv) measure(ctx context.Context, r benchRun, topics ledger.Topics, nodes []*benchNode, dsn string) (loadtest.RunReport, error) {
	var lag *lagSampler
	if e.ch != nil {
		var err error
		if lag, err = e.project(ctx, topics, fmt.Sprintf("bench%s-projector-%d", e.id, e.runs)); err != nil {
			return loadtest.RunReport{}, err
		}
		defer lag.stop()
	}

	cfg := loadtest.Config{
		Client: e.cc, Topics: topics, Minter: e.issuer, Tenants: e.f.tenants, Tools: e.tools,
		Concurrency: e.f.concurrency, Drain: 2 * time.Minute,
	}
	runCtx, unwatch := watchNodes(ctx, e.watched(nodes))
	defer unwatch()
	fmt.Fprintf(e.progress, "bench: %s: warming up (%d calls)\n", r.name, e.f.warmup)
	warm := cfg
	warm.Calls, warm.RunID = max(e.f.warmup, 1), fmt.Sprintf("w%s%d", e.id, e.runs)
	if e.f.attach {
		// A ledger that is not there, or not on these topics, finishes
		// nothing: said after this long rather than the run's drain.
		warm.Drain = attachWarmupDrain
	}
	wres, err := loadtest.Run(runCtx, warm)
	if err != nil {
		return loadtest.RunReport{}, fmt.Errorf("%s: warm-up: %w", r.name, cmp.Or(context.Cause(runCtx), err))
	}
	if e.f.attach {
		if err := e.checkAttachedWarmup(topics, wres); err != nil {
			return loadtest.RunReport{}, fmt.Errorf("%s: warm-up: %w", r.name, err)
		}
	}

	cfg.Calls, cfg.Duration, cfg.Rate = r.calls, e.f.duration, r.rate
	cfg.RunID = fmt.Sprintf("r%s%d", e.id, e.runs)
	// On a terminal the progress line rewrites itself every second;
	// into a file or a pipe it is a line every five.
	lineEnd := "\n"
	cfg.ProgressEvery = 5 * time.Second
	if isTerminal(e.progress) {
		lineEnd, cfg.ProgressEvery = "", time.Second
	}
	cfg.Progress = func(p loadtest.Progress) {
		if lineEnd == "" {
			fmt.Fprint(e.progress, "\r")
		}
		fmt.Fprintf(e.progress, "bench: %-14s %6.1fs  submitted %9d  done %9d  in flight %6d  %8.0f calls/s  p99 %8.1f ms %s",
			r.name, p.Elapsed.Seconds(), p.Submitted, p.Done, p.InFlight, p.Rate, ms(p.P99), lineEnd)
	}
	before := make([]time.Duration, len(nodes))
	for i, n := range nodes {
		before[i] = n.cpu()
	}
	cfg.Usage = e.usage(nodes)
	var (
		retriesBefore map[string]int64
		retriesErr    error
	)
	if dsn != "" {
		retriesBefore, retriesErr = storeRetries(ctx, e.pages, nodes)
	}
	var profiled func()
	selfBefore := selfCPU()
	machineBefore, machineOK := machineCPU()
	storeBefore, storeErr := e.storeCPU()
	kafkaBefore := e.kafkaCPU()
	if e.f.attach && e.f.profile != "" {
		if r.calls != 0 {
			fmt.Fprintf(e.progress, "bench: %s: the running ledger not profiled: a run of %d calls has no length known when it starts\n", r.name, r.calls)
		} else {
			pctx, cancel := context.WithCancel(runCtx)
			wait := e.profileAttached(pctx, filepath.Join(e.f.profile, fmt.Sprintf("run%d", e.runs)), cfg.Duration)
			// On success the profiles, as long as the submitting, are
			// waited for below; a run that fails stops them.
			defer func() { cancel(); wait() }()
			profiled = func() {
				for _, line := range wait() {
					fmt.Fprintf(e.progress, "bench: %s: %s\n", r.name, line)
				}
			}
		}
	}
	lag.start()
	res, err := loadtest.Run(runCtx, cfg)
	if profiled != nil && err == nil {
		profiled()
	}
	if lineEnd == "" {
		fmt.Fprintln(e.progress)
	}
	if err != nil {
		return loadtest.RunReport{}, fmt.Errorf("%s: %w", r.name, cmp.Or(context.Cause(runCtx), err))
	}
	rep := loadtest.RunReport{Name: r.name, Executors: r.executors, Processes: len(nodes), Result: res}
	rep.HarnessCPU = selfCPU() - selfBefore
	if after, ok := machineCPU(); ok && machineOK {
		rep.MachineCPU = after.busy - machineBefore.busy
		rep.Stolen = machineBefore.stolenShare(after)
	}
	if after, err := e.storeCPU(); err == nil && storeErr == nil {
		rep.StoreCPU = after - storeBefore
	}
	if after := e.kafkaCPU(); after > kafkaBefore {
		// Not after the process has gone (/proc then reads 0): its
		// exit ended the run with an error already.
		rep.KafkaCPU = after - kafkaBefore
	}
	if r.binary != "" {
		rep.Build = "baseline"
	}
	for i, n := range nodes {
		rep.LedgerCPU += n.cpu() - before[i]
	}
	if dsn != "" {
		retriesAfter, err := storeRetries(ctx, e.pages, nodes)
		if err = errors.Join(retriesErr, err); err != nil {
			// A figure missing, not a run lost.
			fmt.Fprintf(e.progress, "bench: %s: store retries not counted: %v\n", r.name, err)
		} else {
			rep.StoreRetries = make(map[string]int64)
			for op, n := range retriesAfter {
				if d := n - retriesBefore[op]; d > 0 {
					rep.StoreRetries[op] = d
				}
			}
		}
	}
	unwatch() // the processes are stopped on purpose from here
	for _, n := range nodes {
		if n.cmd == nil {
			// Not the bench's to stop: its peak since it started.
			rep.PeakRSS += procPeakRSS(n.pid)
			continue
		}
		peak, err := n.stop()
		if err != nil {
			return loadtest.RunReport{}, fmt.Errorf("%s: %w", r.name, err)
		}
		rep.PeakRSS += peak
	}
	if dsn != "" {
		if f, err := storeFootprint(ctx, dsn); err == nil {
			rep.StoreRecords, rep.StoreBytes = f.Records, f.Bytes
		} else if !errors.Is(err, pgstore.ErrNoFootprint) {
			// A figure missing, not a run lost.
			fmt.Fprintf(e.progress, "bench: %s: the store's footprint not measured: %v\n", r.name, err)
		}
	}
	effects, err := e.effects(ctx, res.RunID)
	if err != nil {
		return loadtest.RunReport{}, fmt.Errorf("%s: %w", r.name, err)
	}
	rep.Witness = loadtest.Check(res, effects)
	// The warm-up is checked as the run is (not timed): it is where the
	// fresh processes join their groups, and so where a rebalance would
	// lose or repeat a call.
	weffects, err := e.effects(ctx, wres.RunID)
	if err != nil {
		return loadtest.RunReport{}, fmt.Errorf("%s: warm-up: %w", r.name, err)
	}
	rep.Warmup = &loadtest.Warmup{Result: wres, Witness: loadtest.Check(wres, weffects)}
	if e.backend != nil {
		// Checked: the backend need not hold the run's requests any
		// longer (the next run's keys are its own). It held about seven
		// objects a call for the harness's collector to mark again in
		// every later run: at 2,500/s, three runs after a closed loop
		// measured an added p99 of 52, 51 and 207 ms with the harness's
		// heap at 0.7 to 1.5 million objects, and of 67, 48 and 74 ms
		// with it at 10,000.
		e.backend.Forget()
	}
	if lag != nil {
		p, err := lag.finish(ctx)
		if err != nil {
			return loadtest.RunReport{}, fmt.Errorf("%s: %w", r.name, err)
		}
		rep.ProjectionLag = &p
	}
	rep.Derive()
	fmt.Fprintf(e.progress, "bench: %s: %.0f calls/s, e2e p99 %.1f ms, duplicates %d, lost %d\n", r.name, res.PerSec, ms(res.E2E.P99), rep.Witness.Duplicates, res.Lost)
	return rep, nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// directFloor makes the main run's calls straight to the backend, with
// the same concurrency: what the tools cost without the ledger.
func (e *benchEnv) directFloor(ctx context.Context) (loadtest.DirectReport, error) {
	// A run by duration has no call count: the floor makes 20,000.
	calls := e.f.calls
	if calls <= 0 {
		calls = 20000
	}
	cl := httptool.New(httptool.Config{})
	call := floorCall(func(ctx context.Context, url string, tool loadtest.Tool, tenant, key string, args []byte) error {
		_, err := cl.Call(ctx, httptool.Request{
			URL: url + "/tools/" + tool.Name, IdempotencyKey: key, TenantID: tenant,
			CallID: "call_" + key, Attempt: 1, Arguments: args,
		})
		return err
	})
	url, note := e.toolsURL, ""
	if e.f.attach {
		var stop func()
		var err error
		if url, note, stop, err = e.floorBackend(ctx, call); err != nil {
			return loadtest.DirectReport{}, err
		}
		defer stop()
	}
	fmt.Fprintf(e.progress, "bench: direct calls to the backend (%d)\n", calls)
	d, err := loadtest.Direct(ctx, loadtest.DirectConfig{
		Tools: e.tools, Calls: calls, Concurrency: e.f.concurrency, Tenants: e.f.tenants, RunID: "d" + e.id,
		Call: func(ctx context.Context, tool loadtest.Tool, tenant, key string, args []byte) error {
			return call(ctx, url, tool, tenant, key, args)
		},
	})
	d.Note = note
	return d, err
}

// storeSchema returns, with --crdb-dsn, the DSN of a new schema of this
// invocation's, named by name and migrated, and a function that drops
// it (which does nothing with --keep); "" and a no-op on the embedded
// store. A run on the tables earlier runs filled (and left bloated) is
// slower, so each run gets empty ones, and drops them when it is
// measured: figures then do not depend on the store's history.
func (e *benchEnv) storeSchema(ctx context.Context, name string) (string, func() error, error) {
	if e.f.crdbDSN == "" {
		return "", func() error { return nil }, nil
	}
	schema := "bench_" + e.id + "_" + name
	dsn, drop, err := createSchemaDSN(ctx, e.f.crdbDSN, schema)
	if err != nil {
		return "", nil, err
	}
	if e.f.keep {
		drop = func() error { return nil }
	}
	// Once, before the processes start: several migrating one new
	// schema at once could race on its CREATE TABLE.
	st, err := pgstore.Open(ctx, pgstore.Config{DSN: dsn, Logger: e.logger})
	if err != nil {
		_ = drop()
		return "", nil, err
	}
	st.Close()
	return dsn, drop, nil
}

// deleteTopics deletes a run's topics.
func deleteTopics(ctx context.Context, admin *kgo.Client, t ledger.Topics) error {
	resps, err := kadm.NewClient(admin).DeleteTopics(ctx, t.Requests, t.Events, t.Control, t.DLQ)
	if err != nil {
		return err
	}
	return resps.Error()
}

// rawLimits measures the parts on the same engines: transactional
// consume-produce on the same Kafka, batched claims on the same store.
func (e *benchEnv) rawLimits(ctx context.Context) ([]loadtest.Limit, error) {
	n := e.f.limitCalls
	fmt.Fprintf(e.progress, "bench: raw limits (%d records, %d claims)\n", n*4, n)
	k, err := loadtest.KafkaTxnLimit(ctx, e.cc, n*4, 500, int(e.g.kafka.partitions), nil)
	if err != nil {
		return nil, fmt.Errorf("kafka raw limit: %w", err)
	}
	dsn, drop, err := e.storeSchema(ctx, "limits")
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := drop(); err != nil {
			fmt.Fprintf(e.progress, "bench: raw limits: %v\n", err)
		}
	}()
	var rs storeFlags
	rs.crdbDSN, rs.dataDir = dsn, filepath.Join(e.dir, "limits")
	if err := os.MkdirAll(rs.dataDir, 0o700); err != nil {
		return nil, err
	}
	st, _, err := rs.openStore(ctx, e.logger)
	if err != nil {
		return nil, err
	}
	defer st.Close()
	claims, err := loadtest.ClaimLimit(ctx, st, n, 500, nil)
	if err != nil {
		return nil, fmt.Errorf("store raw limit: %w", err)
	}
	return append([]loadtest.Limit{k}, claims...), nil
}

// benchNode is one ledger process of a run, or the bench's Kafka process.
type benchNode struct {
	what string // what it is, in messages: "ledger process", "kafka process"
	pid  int
	// cmd is nil for a ledger process the bench did not start
	// (--ledger-pid): it is watched through /proc and never stopped,
	// and start is when it started (ticks after boot, from /proc), to
	// tell it from a later process given its pid.
	cmd   *exec.Cmd
	start int64
	log   *os.File
	done  chan error
	// exited is closed when the process has exited.
	exited chan struct{}
	// metricsURL is where the process serves its metrics; "" if not.
	// Its loops' time is served beside them, at loopsURL.
	metricsURL, loopsURL string
}

// watchNodes returns ctx, cancelled with a cause naming the process and
// its log if one of nodes exits before unwatch (idempotent) is called: a
// run whose ledger died fails at once instead of waiting out its drain.
func watchNodes(ctx context.Context, nodes []*benchNode) (_ context.Context, unwatch func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, n := range nodes {
		if n.cmd == nil {
			// Not the bench's child: no exit to wait for, so /proc is
			// asked. Gone, its CPU would read 0 and the run's figures
			// would be another process's or negative.
			wg.Go(func() {
				tick := time.NewTicker(attachedPoll)
				defer tick.Stop()
				for {
					select {
					case <-tick.C:
						if st, err := readProcStat("/proc", n.pid); err != nil || st.exited || st.start != n.start {
							cancel(fmt.Errorf("%s %d exited during the run", n.what, n.pid))
							return
						}
					case <-stop:
						return
					}
				}
			})
			continue
		}
		wg.Go(func() {
			select {
			case <-n.exited:
				// Wait has returned: ProcessState is set.
				cancel(fmt.Errorf("%s %d exited during the run (%v; log %s)%s", n.what, n.pid, n.cmd.ProcessState, n.log.Name(), logTail(n.log.Name())))
			case <-stop:
			}
		})
	}
	var once sync.Once
	return ctx, func() {
		once.Do(func() {
			close(stop)
			wg.Wait()
			cancel(nil)
		})
	}
}

// logTail is the last lines of the log at path, for an error about the
// process that wrote it: what it said as it exited, where a run's report
// (CI's, say) may be all that is kept of its work directory. A Go panic's
// or fatal error's first line is quoted too, when the tail (the end of
// its goroutines' stacks) does not hold it. "" when the log is empty or
// unreadable.
func logTail(path string) string {
	const most, lines = 2 << 10, 8
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	var (
		ls    []string // the last lines read, at most lines of them
		size  int      // their bytes
		crash string   // the first panic or fatal error line
	)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if crash == "" && (strings.HasPrefix(line, "panic: ") || strings.HasPrefix(line, "fatal error: ")) {
			crash = line
		}
		ls = append(ls, line)
		size += len(line) + 1
		for len(ls) > lines || (size > most && len(ls) > 1) {
			size -= len(ls[0]) + 1
			ls = ls[1:]
		}
	}
	if sc.Err() != nil {
		// A line too long to scan: the lines after it are not read.
		ls = append(ls, fmt.Sprintf("(not read past here: %v)", sc.Err()))
	}
	for len(ls) > 0 && strings.TrimSpace(ls[len(ls)-1]) == "" {
		ls = ls[:len(ls)-1]
	}
	if len(ls) == 0 {
		return ""
	}
	if len(ls) == 1 && len(ls[0]) > most {
		ls[0] = "..." + ls[0][len(ls[0])-most:]
	}
	out := "; its last lines:\n\t" + strings.Join(ls, "\n\t")
	if crash != "" && !slices.Contains(ls, crash) {
		out = "; it said " + strconv.Quote(crash) + out
	}
	return out
}

// freeLoopbackAddr returns a loopback address with a port free a moment
// ago, for a process to listen on.
func freeLoopbackAddr() (string, error) {
	addrs, err := freeLoopbackAddrs(1)
	if err != nil {
		return "", err
	}
	return addrs[0], nil
}

// freeLoopbackAddrs returns n loopback addresses with ports free a moment
// ago, all different: each is held until all are picked. They are picked
// below the kernel's ephemeral range where it leaves room (Linux's
// ip_local_port_range, 32768-60999 by default): a port from that range,
// which ":0" listeners and the source ports of outgoing connections are
// given, could be taken again, by any connection the machine opens,
// before the process it is for listens on it.
func freeLoopbackAddrs(n int) (addrs []string, err error) {
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, ln := range lns {
			err = errors.Join(err, ln.Close())
		}
		if err != nil {
			addrs = nil
		}
	}()
	lo, hi := belowEphemeral("/proc/sys/net/ipv4/ip_local_port_range")
	for range n {
		ln, err := listenBelow(lo, hi)
		if err != nil {
			return nil, err
		}
		lns = append(lns, ln)
		addrs = append(addrs, ln.Addr().String())
	}
	return addrs, nil
}

// belowEphemeral returns the ports [lo, hi) to pick listeners' ports
// from: from 10000 up to the ephemeral range that the file at path (the
// format of Linux's ip_local_port_range) starts, or 32768 if it cannot
// be read; 0, 0 if that leaves fewer than 1000 ports.
func belowEphemeral(path string) (lo, hi int) {
	lo, hi = 10000, 32768
	if b, err := os.ReadFile(path); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if start, err := strconv.Atoi(f[0]); err == nil {
				hi = start
			}
		}
	}
	if hi-lo < 1000 {
		return 0, 0
	}
	return lo, hi
}

// listenBelow listens on a loopback port in [lo, hi), tried at random,
// or on one the kernel picks when none is free there (or lo, hi are 0).
func listenBelow(lo, hi int) (net.Listener, error) {
	for range 200 {
		if hi <= lo {
			break
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(lo+rand.IntN(hi-lo))))
		if err == nil {
			return ln, nil
		}
	}
	return net.Listen("tcp", "127.0.0.1:0")
}

// storeRetries sums the nodes' ledger_store_retries_total by operation,
// read from their metrics.
func storeRetries(ctx context.Context, hc *http.Client, nodes []*benchNode) (map[string]int64, error) {
	sum := make(map[string]int64)
	for _, n := range nodes {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := scrapeRetries(ctx, hc, n.metricsURL, sum)
		cancel()
		if err != nil {
			return nil, err
		}
	}
	return sum, nil
}

// scrapeRetries adds the ledger_store_retries_total samples at url (the
// Prometheus text format) into sum, by their op label. The process may
// still be starting: it is asked again for up to ctx's deadline.
func scrapeRetries(ctx context.Context, hc *http.Client, url string, sum map[string]int64) error {
	var body []byte
	for {
		err := httpGet(ctx, hc, url, func(r io.Reader) error {
			var err error
			body, err = io.ReadAll(io.LimitReader(r, 8<<20))
			return err
		})
		if err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("read %s: %w", url, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	return parseRetries(body, sum)
}

// parseRetries adds the ledger_store_retries_total samples of a metrics
// page into sum, by op.
func parseRetries(page []byte, sum map[string]int64) error {
	const metric = "ledger_store_retries_total{"
	for line := range strings.SplitSeq(string(page), "\n") {
		sample, ok := strings.CutPrefix(line, metric)
		if !ok {
			continue
		}
		labels, rest, _ := strings.Cut(sample, "} ")
		op := ""
		for l := range strings.SplitSeq(labels, ",") {
			if v, ok := strings.CutPrefix(l, `op="`); ok {
				op = strings.TrimSuffix(v, `"`)
			}
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
		if err != nil || op == "" {
			return fmt.Errorf("unreadable sample %q", line)
		}
		sum[op] += int64(v)
	}
	return nil
}

// startNode starts a ledger process: binary ("" for this one) with args,
// its output into logPath and env added to this process's environment.
func startNode(binary string, args, env []string, logPath string) (*benchNode, error) {
	return startProcess("ledger process", binary, args, env, logPath, false)
}

// startProcess starts what startNode does, named what in messages. With
// ownGroup the process is put in a process group of its own, so that a
// terminal's Ctrl-C reaches only the bench, which stops the process
// when it no longer needs it.
func startProcess(what, binary string, args, env []string, logPath string, ownGroup bool) (*benchNode, error) {
	self := binary
	if self == "" {
		var err error
		if self, err = os.Executable(); err != nil {
			return nil, err
		}
	}
	log, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: ownGroup}
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("start %s: %w", what, err)
	}
	n := &benchNode{what: what, pid: cmd.Process.Pid, cmd: cmd, log: log, done: make(chan error, 1), exited: make(chan struct{})}
	go func() {
		n.done <- cmd.Wait()
		close(n.exited)
	}()
	return n, nil
}

// cpu is the process's CPU time so far (user + system), from /proc.
func (n *benchNode) cpu() time.Duration {
	return procCPU(n.pid)
}

// stop ends the process gracefully and returns its peak RSS in bytes.
func (n *benchNode) stop() (int64, error) {
	defer n.log.Close()
	// VmHWM, read while the process lives, is its own peak since exec.
	// The wait4 rusage peak is not: Linux carries over the peak of the
	// address space the child was forked from, this process's, which
	// holds the in-process Kafka's log.
	peak := procPeakRSS(n.pid)
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	var err error
	select {
	case err = <-n.done:
	case <-time.After(30 * time.Second):
		_ = n.cmd.Process.Kill()
		<-n.done
		return 0, fmt.Errorf("%s %d did not stop within 30s of SIGTERM (log %s)", n.what, n.pid, n.log.Name())
	}
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		return 0, err
	}
	if !n.cmd.ProcessState.Success() {
		return 0, fmt.Errorf("%s exited %s (log %s)", n.what, n.cmd.ProcessState, n.log.Name())
	}
	return peak, nil
}

// procPeakRSS reads VmHWM of pid from /proc/<pid>/status, in bytes (Linux;
// 0 elsewhere).
func procPeakRSS(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err == nil {
				return kb * 1024
			}
		}
	}
	return 0
}

func (n *benchNode) kill() {
	select {
	case <-n.exited:
		// Exited on its own, or stopped: stop has closed the log, or
		// nobody has.
	default:
		_ = n.cmd.Process.Kill()
		<-n.exited
	}
	n.log.Close()
}

// procCPU reads utime + stime of pid from /proc/<pid>/stat (Linux; 0
// elsewhere).
func procCPU(pid int) time.Duration {
	st, err := readProcStat("/proc", pid)
	if err != nil {
		return 0
	}
	return st.cpu
}

// selfCPU is this process's CPU time so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// storeFootprint measures a run's tables (the schema dsn names).
func storeFootprint(ctx context.Context, dsn string) (pgstore.Footprint, error) {
	st, err := pgstore.Open(ctx, pgstore.Config{DSN: dsn, SkipMigrate: true})
	if err != nil {
		return pgstore.Footprint{}, err
	}
	defer st.Close()
	return st.Footprint(ctx)
}

// usage returns running totals of the CPU the run's parts spent and of
// the time the ledger's loops were busy, for its timeline. Each total
// only grows: a reading that fails (a process gone, /proc unreadable,
// the store's children between exit and reaping) keeps the total it
// had, rather than give one interval a negative share and the next
// everything since boot.
func (e *benchEnv) usage(nodes []*benchNode) func() loadtest.Usage {
	ledgerCPU := make([]func() time.Duration, len(nodes))
	for i, n := range nodes {
		ledgerCPU[i] = growing(func() (time.Duration, bool) {
			d := n.cpu()
			return d, d > 0
		})
	}
	store := growing(func() (time.Duration, bool) {
		d, err := e.storeCPU()
		return d, err == nil
	})
	// /proc/stat read once a reading, for the busy time and the stolen.
	var (
		stat   cpuTimes
		statOK bool
	)
	kafka := growing(func() (time.Duration, bool) {
		d := e.kafkaCPU()
		return d, d > 0
	})
	machine := growing(func() (time.Duration, bool) { return stat.busy, statOK })
	stolen := growing(func() (time.Duration, bool) { return stat.stolen, statOK })
	// Each process's loops, all read at once each reading: the intake's
	// and the executors' time in steps and transactions. The bench's
	// own processes serve them beside their metrics; an attached
	// ledger's, when --ledger-ops names where.
	var urls []string
	for _, n := range nodes {
		if n.loopsURL != "" {
			urls = append(urls, n.loopsURL)
		}
	}
	urls = append(urls, e.attachedLoops...)
	reads := make([]loopsRead, len(urls))
	intakeLoop, executorLoops := make([]func() time.Duration, len(urls)), make([]func() time.Duration, len(urls))
	intakeSteps, executorSteps := make([]func() int64, len(urls)), make([]func() int64, len(urls))
	for i := range urls {
		intakeLoop[i] = growing(func() (time.Duration, bool) { return reads[i].intake.busy(), reads[i].ok })
		executorLoops[i] = growing(func() (time.Duration, bool) { return reads[i].executors.busy(), reads[i].ok })
		intakeSteps[i] = growing(func() (int64, bool) { return reads[i].intake.Steps, reads[i].ok })
		executorSteps[i] = growing(func() (int64, bool) { return reads[i].executors.Steps, reads[i].ok })
	}
	return func() loadtest.Usage {
		readAllLoops(e.pages, urls, reads)
		stat, statOK = machineCPU()
		u := loadtest.Usage{Harness: selfCPU(), HarnessGC: gcCPU(), Store: store(), Kafka: kafka(), Machine: machine(), Stolen: stolen()}
		for _, read := range ledgerCPU {
			u.Ledger += read()
		}
		for i := range urls {
			u.IntakeLoop += intakeLoop[i]()
			u.ExecutorLoops += executorLoops[i]()
			u.IntakeSteps += intakeSteps[i]()
			u.ExecutorSteps += executorSteps[i]()
		}
		return u
	}
}

// watched are the processes a run needs alive: its ledger processes,
// and the broker's with --kafka-process.
func (e *benchEnv) watched(nodes []*benchNode) []*benchNode {
	if e.kafka == nil {
		return nodes
	}
	return append(slices.Clip(nodes), e.kafka)
}

// kafkaCPU is the broker's process's CPU time so far with
// --kafka-process; 0 when the broker is not a process of the bench's.
func (e *benchEnv) kafkaCPU() time.Duration {
	if e.kafka == nil {
		return 0
	}
	return e.kafka.cpu()
}

// loopsRead is one node's loops' time at a reading: its intake's and its
// executors' (summed).
type loopsRead struct {
	intake, executors loopSum
	ok                bool
}

// loopSum adds up loops' times.
type loopSum ledger.LoopTime

func (s *loopSum) add(lt ledger.LoopTime) {
	s.Step += lt.Step
	s.Transaction += lt.Transaction
	s.Steps += lt.Steps
}

// busy is the time in steps and transactions.
func (s loopSum) busy() time.Duration { return s.Step + s.Transaction }

// readAllLoops reads the loops at every one of urls at once, within one
// deadline short enough for a reading a second, into reads.
func readAllLoops(hc *http.Client, urls []string, reads []loopsRead) {
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	var wg sync.WaitGroup
	for i, url := range urls {
		wg.Go(func() {
			times, err := readLoops(ctx, hc, url)
			r := loopsRead{ok: err == nil}
			for name, lt := range times {
				switch {
				case name == "intake":
					r.intake.add(lt)
				case name == "executor", strings.HasPrefix(name, "executor-"):
					r.executors.add(lt)
				}
			}
			reads[i] = r
		})
	}
	wg.Wait()
}

// readLoops reads a bench node's loops' time (its /loops page).
func readLoops(ctx context.Context, hc *http.Client, url string) (map[string]ledger.LoopTime, error) {
	if url == "" {
		return nil, errors.New("no loops page")
	}
	var times map[string]ledger.LoopTime
	return times, getJSON(ctx, hc, url, 1<<20, &times)
}

// getJSON decodes the JSON answer to GET url into v, reading at most
// limit bytes of it (see httpGet).
func getJSON(ctx context.Context, hc *http.Client, url string, limit int64, v any) error {
	return httpGet(ctx, hc, url, func(body io.Reader) error {
		if err := json.NewDecoder(io.LimitReader(body, limit)).Decode(v); err != nil {
			return fmt.Errorf("GET %s: %w", url, err)
		}
		return nil
	})
}

// httpGet calls read with the body of a 200 answer to GET url; any other
// answer is an error quoting the start of its body. The body is read to
// its end afterwards, so that the connection serves the next request.
func httpGet(ctx context.Context, hc *http.Client, url string, read func(body io.Reader) error) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer func() {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("GET %s: %s %s", url, resp.Status, strings.TrimSpace(string(b)))
	}
	return read(resp.Body)
}

// growing wraps a running total's reader: it returns the largest total
// read so far, which a failed or lower reading leaves as it is. Only the
// differences between its results mean anything: when the first
// readings fail, the first that succeeds is where it starts, so that
// the total since the process began does not land in one interval.
func growing[T time.Duration | int64](read func() (T, bool)) func() T {
	var (
		top, base    T
		seen, missed bool
	)
	return func() T {
		d, ok := read()
		switch {
		case ok && !seen && missed:
			base, top, seen = d, d, true
		case ok:
			top, seen = max(top, d), true
		case !seen:
			missed = true
		}
		return top - base
	}
}

// gcCPU is the CPU time this process's garbage collector has spent, as
// the runtime estimates it.
func gcCPU() time.Duration {
	s := []metrics.Sample{{Name: "/cpu/classes/gc/total:cpu-seconds"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindFloat64 {
		return 0
	}
	return time.Duration(s[0].Value.Float64() * float64(time.Second))
}

// cpuTimes is the machine's CPU time since boot, all its CPUs summed.
type cpuTimes struct {
	// busy is user + nice + system + irq + softirq: idle and iowait are
	// not work, steal is another guest's.
	busy time.Duration
	// stolen is steal: time a CPU of this guest had work and the
	// hypervisor ran another guest instead. A run that lost much of it
	// ran on a slower machine than its neighbours did.
	stolen time.Duration
	// total is every state's time (busy, idle, iowait and steal): the
	// CPUs' wall time.
	total time.Duration
}

// stolenShare is the share of the CPUs' wall time from t to u that the
// hypervisor gave to other guests; 0 when nothing elapsed.
func (t cpuTimes) stolenShare(u cpuTimes) float64 {
	if u.total <= t.total || u.stolen <= t.stolen {
		// Some hypervisors' steal counter has gone backwards.
		return 0
	}
	return float64(u.stolen-t.stolen) / float64(u.total-t.total)
}

// machineCPU is the machine's CPU time since boot, from /proc/stat; ok is
// false where that cannot be read.
func machineCPU() (_ cpuTimes, ok bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}, false
	}
	return parseProcStat(b)
}

// parseProcStat reads the aggregate "cpu" line of /proc/stat: user, nice,
// system, idle, iowait, irq, softirq, steal..., in USER_HZ ticks (100 a
// second on every Linux that exports it). Guest time is counted in user
// already, so the fields after steal are left out.
func parseProcStat(b []byte) (cpuTimes, bool) {
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 8 || f[0] != "cpu" {
		return cpuTimes{}, false
	}
	var ticks [8]int64 // steal stays 0 on a kernel without it
	for i := range min(len(f)-1, len(ticks)) {
		n, err := strconv.ParseInt(f[i+1], 10, 64)
		if err != nil || n < 0 {
			return cpuTimes{}, false
		}
		ticks[i] = n
	}
	user, nice, system, idle, iowait, irq, softirq, steal := ticks[0], ticks[1], ticks[2], ticks[3], ticks[4], ticks[5], ticks[6], ticks[7]
	tick := time.Second / clockTicks
	busy := user + nice + system + irq + softirq
	return cpuTimes{
		busy:   time.Duration(busy) * tick,
		stolen: time.Duration(steal) * tick,
		total:  time.Duration(busy+idle+iowait+steal) * tick,
	}, true
}

// isTerminal reports whether w is a terminal (a character device).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// lagSampler runs a ClickHouse projector of one run and samples its lag.
type lagSampler struct {
	p        *projector.Projector
	cancel   context.CancelFunc
	done     chan error
	mu       sync.Mutex
	hist     *loadtest.Histogram
	sampling chan struct{} // closed to start sampling
	stopped  chan struct{}
	once     sync.Once
}

// project starts projecting topics into the benchmark's ClickHouse.
func (e *benchEnv) project(ctx context.Context, topics ledger.Topics, group string) (*lagSampler, error) {
	p, err := projector.New(projector.Config{Client: e.cc, Topics: topics, Group: group, Logger: e.logger.With("component", "projector")}, e.ch)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	l := &lagSampler{p: p, cancel: cancel, done: make(chan error, 1), hist: loadtest.NewHistogram(),
		sampling: make(chan struct{}), stopped: make(chan struct{})}
	go func() { l.done <- p.Run(ctx) }()
	go func() {
		// Owned by the sampler: it ends with ctx.
		defer close(l.stopped)
		select {
		case <-l.sampling:
		case <-ctx.Done():
			return
		}
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				d := p.Lag().Time
				l.mu.Lock()
				l.hist.Record(d)
				l.mu.Unlock()
			}
		}
	}()
	return l, nil
}

// start begins sampling (when the measured run starts); nil-safe.
func (l *lagSampler) start() {
	if l != nil {
		l.once.Do(func() { close(l.sampling) })
	}
}

// finish waits for the projection to catch up with the run (at most a
// minute) and returns the lag sampled while the load ran.
func (l *lagSampler) finish(ctx context.Context) (loadtest.Percentiles, error) {
	deadline := time.Now().Add(time.Minute)
	for l.p.Lag().Records > 0 {
		if time.Now().After(deadline) {
			return loadtest.Percentiles{}, fmt.Errorf("projection still %d records behind a minute after the run", l.p.Lag().Records)
		}
		select {
		case err := <-l.done:
			return loadtest.Percentiles{}, fmt.Errorf("projector stopped: %w", err)
		case <-ctx.Done():
			return loadtest.Percentiles{}, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return loadtest.PercentilesOf(l.hist), nil
}

func (l *lagSampler) stop() {
	l.cancel()
	<-l.done
	<-l.stopped
}
