package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/failpoint"
	"github.com/toolcall-ledger/ledger/processors/consistency"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/loadtest"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/schemas"
)

// chaosFlags configure `ledger chaos`.
type chaosFlags struct {
	crdbDSN        string
	duration       time.Duration
	maxDuration    time.Duration
	minCalls       int64
	rate           float64
	executors      int
	minCrashes     int
	mix            string
	tenants        int
	toolTimeout    time.Duration
	lookupDeadline time.Duration
	sessionTimeout time.Duration
	drain          time.Duration
	workDir        string
	keep           bool
	jsonOut        string
	history        string
	nodeLogLevel   string
	pause          bool
	restartEvery   time.Duration
	killAfter      time.Duration
}

// pausePoint names the fault that is not a crash: an executor stopped
// (SIGSTOP) past its group session and its claims' leases, then resumed.
const pausePoint = "executor.paused"

func newChaosCmd(g *globals) *cobra.Command {
	var f chaosFlags
	cmd := &cobra.Command{
		Use:   "chaos",
		Short: "Crash the ledger's processors at every failpoint under load, and count what happened at the tools and in the log",
		Long: `chaos runs an intake, several executors and a reconciler as processes of
their own (the real role commands) on an in-process Kafka and a
CockroachDB/PostgreSQL store, offers them calls at a steady rate, and
meanwhile kills them at the failpoints: each process starts with one point
armed, the one crashed least so far, and dies there by SIGKILL; it is
restarted at once. Executors are also stopped (SIGSTOP) past their group
session and their claims' leases, then resumed. When the load ends the
crashing stops, every call is waited for, and the whole history is checked:
duplicate and orphan effects at the tools, lost calls, illegal transitions
and aborted-transaction events visible in the log, and the time to a
terminal state and to resolve unknown outcomes.

With --kill-executor-after, one executor is killed (SIGKILL) that far into
the load and never started again: the others must take over its
partitions and, once their leases expire, its claims. The executor
group's assignment is reported just before the kill and once the group
settled on the survivors.

It needs a binary built with -tags failpoints (make chaos). It exits 1 when
any count that must be 0 is not, or a point was hit fewer than
--min-crashes times.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runChaos(cmd.Context(), g, &f, cmd.ErrOrStderr(), cmd.OutOrStdout())
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.crdbDSN, "crdb-dsn", "", "CockroachDB (or PostgreSQL) DSN for the execution store (required: several executor processes share it)")
	fs.DurationVar(&f.duration, "duration", 10*time.Minute, "how long to offer load and crash processes")
	fs.DurationVar(&f.maxDuration, "max-duration", 0, "past --duration, keep the load and the crashes going until every point was hit --min-crashes times, at most this long in all (default: 3 times --duration)")
	fs.Int64Var(&f.minCalls, "min-calls", 50_000, "fail unless at least this many calls were made")
	fs.Float64Var(&f.rate, "rate", 100, "calls offered per second (open loop)")
	fs.IntVar(&f.executors, "executors", 3, "executor processes")
	fs.IntVar(&f.minCrashes, "min-crashes", 50, "fail unless every failpoint (and the pause) was hit at least this many times")
	fs.StringVar(&f.mix, "mix", "create_ticket=6,refund_order=3,get_weather=3,send_email=1", "tools and weights: tools that the reconciler can resolve, and send_email, which has no idempotency downstream and no status lookup (a call whose request may have reached it before a crash is parked for a human, its effect counted at most once); the demo policy lets each tenant send 60 emails a minute, more are refused for now and sent again")
	fs.IntVar(&f.tenants, "tenants", 8, "tenants sharing the calls")
	fs.DurationVar(&f.toolTimeout, "tool-timeout", 2*time.Second, "the tools' timeout in the run's registry: it sets the claims' leases, and so how long a pause must last")
	fs.DurationVar(&f.lookupDeadline, "lookup-deadline", 8*time.Second, "deadline of the calls to tools with a status lookup (refund_order): shorter than a claim's lease, so that such a call whose executor died is past its deadline when reclaimed, and its outcome is unknown until the reconciler looks it up")
	fs.DurationVar(&f.sessionTimeout, "session-timeout", 1500*time.Millisecond, "the processors' consumer-group session timeout (their rebalance timeout is twice it): short, so that the group gives a dead process's partitions to the others soon")
	fs.DurationVar(&f.drain, "drain", 5*time.Minute, "after the load, how long to wait for the last calls before counting them lost")
	fs.StringVar(&f.workDir, "work-dir", "", "directory for the processes' logs, the crash log and the keys (default: a temporary one, removed unless --keep)")
	fs.BoolVar(&f.keep, "keep", false, "keep the work directory")
	fs.StringVar(&f.jsonOut, "json", "", "also write the report as JSON to this file")
	fs.StringVar(&f.history, "history", "", "write the history, every submitted envelope (tokens redacted) and every call's outcome, as JSON lines to this file (default: history.jsonl in the work directory)")
	fs.DurationVar(&f.restartEvery, "restart-every", 0, "also restart the executors gracefully (SIGTERM, then start again), one at a time, this often: a rolling restart under load; 0: never")
	fs.DurationVar(&f.killAfter, "kill-executor-after", 0, "kill one executor (SIGKILL) this far into the load and never restart it, and report the executor group's partitions just before the kill and once the group settled on the survivors; shorter than --duration; 0: never")
	fs.BoolVar(&f.pause, "pause", true, "also stop executors (SIGSTOP) past their group session and their claims' leases, then resume them")
	fs.StringVar(&f.nodeLogLevel, "node-log-level", "warn", "log level of the ledger processes (their logs are in the work directory)")
	return cmd
}

func (f *chaosFlags) validate() error {
	switch {
	case !failpoint.Enabled && f.minCrashes > 0:
		return errors.New("chaos: this binary was built without failpoints: build it with -tags failpoints (make chaos), or run without crashes (--min-crashes 0)")
	case f.crdbDSN == "":
		return errors.New("chaos: --crdb-dsn is required (several executor processes share the store)")
	case f.duration <= 0, f.rate <= 0, f.executors < 2, f.minCrashes < 0, f.toolTimeout <= 0, f.lookupDeadline <= 0, f.sessionTimeout <= 0, f.drain <= 0:
		return errors.New("chaos: --duration, --rate, --tool-timeout, --lookup-deadline, --session-timeout and --drain must be positive, --executors at least 2")
	case f.tenants < 1:
		return errors.New("chaos: --tenants must be at least 1")
	case f.killAfter < 0 || (f.killAfter > 0 && f.killAfter >= f.duration):
		return errors.New("chaos: --kill-executor-after must be 0 (never) or positive and shorter than --duration")
	case f.maxDuration != 0 && f.maxDuration < f.duration:
		return errors.New("chaos: --max-duration must not be shorter than --duration")
	case f.lookupDeadline >= f.lease():
		return fmt.Errorf("chaos: --lookup-deadline %s must be shorter than a claim's lease (%s with --tool-timeout %s)", f.lookupDeadline, f.lease(), f.toolTimeout)
	}
	return nil
}

// lease is an executor's claim lease for the run's tools: its MaxAttempts
// (3) timeouts and backoffs plus its margin (10s); see executor.Config.
func (f *chaosFlags) lease() time.Duration {
	return 3*f.toolTimeout + 600*time.Millisecond + 10*time.Second
}

// chaosReport is what `ledger chaos` found.
type chaosReport struct {
	At       time.Time        `json:"at"`
	Machine  loadtest.Machine `json:"machine"`
	Duration time.Duration    `json:"duration_ns"`
	Rate     float64          `json:"offered_per_sec"`
	Load     loadtest.Result  `json:"load"`
	Witness  loadtest.Witness `json:"witness"`
	// Crashes counts the crashes per failpoint (role.point) and the
	// pauses (executor.paused).
	Crashes map[string]int `json:"crashes"`
	// Restarts counts process starts after the first, per role.
	Restarts map[string]int `json:"restarts"`
	// GracefulRestarts counts the executors stopped with SIGTERM by the
	// rolling restart that exited cleanly and were started again.
	GracefulRestarts int `json:"graceful_restarts"`
	// UnexpectedExits are exits that were neither a failpoint's SIGKILL
	// nor a clean exit asked for by the rolling restart.
	UnexpectedExits int `json:"unexpected_exits"`
	// MinCrashes and MinCalls are what the run was asked to reach.
	MinCrashes int   `json:"min_crashes"`
	MinCalls   int64 `json:"min_calls"`
	// Check is the whole history, checked: the log read both ways, the
	// witness's effects, every submitted call.
	Check consistency.Report `json:"check"`
	// SpentCredentials counts the requests the tool backend refused for
	// a credential that had already had its effect: a call's jti is
	// spent by the first request of a tool without idempotency that
	// applies (send_email), and a second one sent under it is refused
	// there, not applied, so that duplicate_effects cannot see it. The
	// ledger never sends such a call again: must be 0.
	SpentCredentials int `json:"spent_credentials"`
	// Assignment is the executor group's assignment around the kill of
	// --kill-executor-after; nil without it.
	Assignment *chaosAssignment `json:"assignment,omitempty"`
}

// chaosAssignment is the executor group's assignment of the events
// topic's partitions around the kill of one executor. Members are named by
// their slot (executor-0, ...), from their client id (a loop's client id
// is its transactional id); a member not named so is "member <member
// id>".
type chaosAssignment struct {
	Group      string        `json:"group"`
	Topic      string        `json:"topic"`
	Partitions int32         `json:"partitions"`
	KillAfter  time.Duration `json:"kill_after_ns"`
	// Killed is the slot of the executor killed for good; empty if none
	// was.
	Killed string `json:"killed"`
	// Before is each member's partitions just before the kill, once every
	// executor was a member and the group was stable; After is each
	// member's once the group settled on the survivors.
	Before map[string][]int32 `json:"before"`
	After  map[string][]int32 `json:"after"`
	// MemberIDs are the group member ids of the slots, before and after.
	MemberIDs map[string]string `json:"member_ids"`
	// SettledIn is the time from the kill to After.
	SettledIn time.Duration `json:"settled_in_ns"`
	// Problem says what did not happen as it should (the group never
	// stable before the kill, or never settled after it); empty if all
	// did.
	Problem string `json:"problem,omitempty"`
}

// chaosEnv is one `ledger chaos` run's shared state.
type chaosEnv struct {
	f        *chaosFlags
	g        *globals
	logger   *slog.Logger
	progress io.Writer
	dir      string
	crashLog string
	common   []string // flags every process gets
	env      []string // the environment every process gets (storeEnv)
	armed    atomic.Bool
	paused   atomic.Int64
	graceful atomic.Int64
	unexpect atomic.Int64

	mu         sync.Mutex
	slots      []*chaosSlot
	restarts   map[string]int
	assignment *chaosAssignment // set by killExecutor
}

// chaosSlot is one process of the run, restarted each time it dies.
type chaosSlot struct {
	name   string
	role   string
	args   []string
	points []failpoint.Name

	mu       sync.Mutex
	node     *benchNode // nil between a death and the restart
	paused   bool       // stopped by the pauser
	stopping bool       // asked to stop by the rolling restart
	dead     bool       // killed for good by --kill-executor-after
}

func runChaos(ctx context.Context, g *globals, f *chaosFlags, progress, out io.Writer) error {
	if err := f.validate(); err != nil {
		return err
	}
	if f.maxDuration == 0 {
		f.maxDuration = 3 * f.duration
	}
	tools, err := loadtest.ParseMix(f.mix)
	if err != nil {
		return fmt.Errorf("chaos: --mix: %w", err)
	}
	logger := g.logger()
	dir, cleanup, err := makeWorkDir(f.workDir, "ledger-chaos-", f.keep)
	if err != nil {
		return err
	}
	defer cleanup()
	// The load's progress, the supervisors and the executor kill all
	// report to progress, each from a goroutine of its own.
	progress = &lockedWriter{w: progress}
	e := &chaosEnv{f: f, g: g, logger: logger, progress: progress, dir: dir, crashLog: filepath.Join(dir, "crashes.log"), restarts: map[string]int{}}

	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(500*time.Millisecond))
	if err != nil {
		return fmt.Errorf("start in-process kafka: %w", err)
	}
	defer cluster.Close()
	cc := ledger.ClientConfig{Brokers: cluster.ListenAddrs(), Logger: logger}
	id := strconv.FormatInt(time.Now().UnixNano(), 36)
	topics := ledger.Topics{Requests: "chaos" + id + ".requests", Events: "chaos" + id + ".events", Control: "chaos" + id + ".control", DLQ: "chaos" + id + ".dlq"}
	admin, err := ledger.NewClient(cc)
	if err != nil {
		return err
	}
	err = ledger.EnsureTopics(ctx, admin, ledger.TopicConfig{Topics: topics, Partitions: chaosPartitions, ReplicationFactor: 1})
	admin.Close()
	if err != nil {
		return err
	}
	// A schema of the run's own: the executors sweep the store for calls
	// left behind, and another run's would land in this run's log.
	dsn, dropSchema, err := createSchemaDSN(ctx, f.crdbDSN, "chaos_"+id)
	if err != nil {
		return err
	}
	if !f.keep {
		defer dropSchema()
	}
	st, err := pgstore.Open(ctx, pgstore.Config{DSN: dsn, Logger: logger})
	if err != nil {
		return err
	}
	st.Close()
	reg, err := schemas.Demo()
	if err != nil {
		return err
	}
	for i, t := range tools {
		if def, err := reg.Lookup(t.Name, t.Version); err == nil && def.StatusLookup != nil {
			tools[i].DeadlineMS = f.lookupDeadline.Milliseconds()
		}
	}

	issuer, err := identity.LoadOrCreateIssuer(filepath.Join(dir, "issuer.key"), benchIssuer)
	if err != nil {
		return err
	}
	jwksFile := filepath.Join(dir, "issuer.jwks.json")
	if err := os.WriteFile(jwksFile, issuer.Keys().JWKS(), 0o600); err != nil {
		return err
	}
	regDir := filepath.Join(dir, "registry")
	if err := writeRegistry(regDir, f.toolTimeout); err != nil {
		return err
	}
	// The backend verifies every credential, as a deployed tool does,
	// with the keys of every process that mints them (the executors and
	// the reconciler, each at an address of its own kept across its
	// restarts): each effect then records its request's jti, which the
	// check finds named by the call's events.
	keyAddrs, err := freeLoopbackAddrs(f.executors + 1)
	if err != nil {
		return err
	}
	var keyURLs []string
	for _, a := range keyAddrs {
		keyURLs = append(keyURLs, "http://"+a+credentials.JWKSPath)
	}
	pages, err := g.httpClient.client(logger, 0)
	if err != nil {
		return err
	}
	verifier, err := credentials.NewVerifier(credentials.VerifierConfig{Audience: demobackend.DefaultAudience, JWKSURLs: keyURLs, HTTPClient: pages, Logger: logger})
	if err != nil {
		return err
	}
	backend := demobackend.New(demobackend.Config{Credentials: verifier, Logger: logger.With("component", "demobackend")})
	defer backend.Close()
	srv, toolsURL, err := serveBackend(backend)
	if err != nil {
		return err
	}
	defer srv.Close()

	e.common = []string{
		"--kafka-brokers", strings.Join(cc.Brokers, ","),
		"--topic-requests", topics.Requests, "--topic-events", topics.Events,
		"--topic-control", topics.Control, "--topic-dlq", topics.DLQ,
		"--session-timeout", f.sessionTimeout.String(), "--rebalance-timeout", (2 * f.sessionTimeout).String(),
		"--log-level", f.nodeLogLevel,
		// The names executorGroup and the assignment record read, whatever
		// LEDGER_KAFKA_GROUP_PREFIX the environment holds.
		"--kafka-group-prefix", defaultGroupPrefix,
	}
	e.env = []string{storeEnv(dsn)}
	e.slots = chaosSlots(dir, f.executors, toolsURL, jwksFile, keyAddrs, []string{"--registry-dir", regDir})

	fmt.Fprintf(progress, "chaos: %d executors, intake, reconciler; %g calls/s for %s (up to %s until every point is hit %d times); store %s; work dir %s\n",
		f.executors, f.rate, f.duration, f.maxDuration, f.minCrashes, redactDSN(f.crdbDSN), dir)
	runCtx, stopRun := context.WithCancel(ctx)
	var procs sync.WaitGroup
	e.armed.Store(true)
	for _, s := range e.slots {
		procs.Go(func() { e.supervise(runCtx, s) })
	}
	if f.pause {
		procs.Go(func() { e.pauser(runCtx) })
	}
	if f.restartEvery > 0 {
		procs.Go(func() { e.restarter(runCtx) })
	}
	defer func() {
		stopRun()
		procs.Wait()
	}()

	if f.history == "" {
		f.history = filepath.Join(dir, "history.jsonl")
	}
	hist, err := newChaosHistory(f.history)
	if err != nil {
		return err
	}
	defer hist.close()

	start := time.Now()
	runID := "c" + id
	// When each call was first published, by its record's key: where its
	// time to a terminal state starts.
	var (
		firstMu sync.Mutex
		first   = make(map[string]time.Time)
	)
	cfg := loadtest.Config{
		Client: cc, Topics: topics, Minter: issuer, Tenants: f.tenants, Tools: tools,
		Rate: f.rate, Duration: f.duration, Drain: f.drain, RunID: runID,
		// Long enough that a call whose executor died is reclaimed and
		// retried (a native tool replays) rather than found past its
		// deadline; the tools with a status lookup get --lookup-deadline.
		DeadlineMS:    (5 * time.Minute).Milliseconds(),
		ProgressEvery: 5 * time.Second,
		OnSubmit: func(rec *kgo.Record, at time.Time) {
			hist.submitted(rec, at)
			firstMu.Lock()
			if _, ok := first[string(rec.Key)]; !ok {
				first[string(rec.Key)] = at
			}
			firstMu.Unlock()
		},
		// Past --duration the load (and the crashing) goes on until every
		// point was hit --min-crashes times, up to --max-duration.
		MaxDuration: f.maxDuration,
		Until: func() bool {
			if e.covered() {
				if e.armed.Swap(false) {
					fmt.Fprintf(progress, "chaos: every point hit; load done, crashes stop, waiting for the last calls\n")
				}
				return true
			}
			return false
		},
		Progress: func(p loadtest.Progress) {
			if p.Elapsed >= f.maxDuration && e.armed.Swap(false) {
				fmt.Fprintf(progress, "chaos: --max-duration reached; load done, crashes stop, waiting for the last calls\n")
			}
			fmt.Fprintf(progress, "chaos: %6.0fs  submitted %7d  done %7d  in flight %6d  p99 %8.0f ms  crashes %s\n",
				p.Elapsed.Seconds(), p.Submitted, p.Done, p.InFlight, ms(p.P99), e.crashSummary())
		},
	}
	if f.killAfter > 0 {
		procs.Go(func() { e.killExecutor(runCtx, cc, topics.Events) })
	}
	res, err := loadtest.Run(ctx, cfg)
	e.armed.Store(false)
	if err != nil {
		return fmt.Errorf("chaos: load: %w", err)
	}
	subs := make([]consistency.Submitted, res.Submitted)
	firstMu.Lock()
	for i := range subs {
		subs[i].Key = loadtest.CallKey(runID, f.tenants, int64(i))
		subs[i].At = first[subs[i].Key.String()]
	}
	firstMu.Unlock()
	// The driver counts a call done at outcome_unknown; the reconciler
	// resolves it later. Wait for that, with the processes still up.
	if err := e.waitResolved(ctx, cc, topics.Events, subs, backend); err != nil {
		return err
	}
	stopRun()
	procs.Wait()

	report := chaosReport{
		At: start.UTC(), Machine: loadtest.ThisMachine(), Duration: time.Since(start), Rate: f.rate,
		Load: res, Witness: loadtest.Check(res, backend.Effects()),
		Crashes: e.crashCounts(), Restarts: e.restartCounts(), UnexpectedExits: int(e.unexpect.Load()),
		GracefulRestarts: int(e.graceful.Load()),
		MinCrashes:       f.minCrashes, MinCalls: f.minCalls,
		Assignment: e.killedAssignment(),
	}
	for _, r := range backend.Refusals() {
		if r.Reason == credentials.ReasonSpent {
			report.SpentCredentials++
		}
	}
	fmt.Fprintf(progress, "chaos: checking the history (%d calls)\n", res.Submitted)
	log, err := consistency.ReadLog(ctx, cc, topics.Events)
	if err != nil {
		return fmt.Errorf("chaos: read the log: %w", err)
	}
	report.Check = consistency.Check(log, subs, backend.Effects())
	records, err := pgstore.Open(ctx, pgstore.Config{DSN: dsn, Logger: logger, SkipMigrate: true})
	if err != nil {
		return err
	}
	err = consistency.CheckStore(ctx, &report.Check, log, subs, records)
	records.Close()
	if err != nil {
		return err
	}
	for _, sub := range subs {
		hist.outcome(sub.Key, log.Outcome(sub.Key))
	}
	if err := hist.close(); err != nil {
		return fmt.Errorf("chaos: history: %w", err)
	}
	if err := report.writeTable(out, e.allPoints()); err != nil {
		return err
	}
	if f.jsonOut != "" {
		if err := writeFileWith(f.jsonOut, func(w io.Writer) error {
			enc := json.NewEncoder(w)
			enc.SetIndent("", "  ")
			return enc.Encode(report)
		}); err != nil {
			return err
		}
	}
	if bad := report.failures(e.allPoints()); len(bad) > 0 {
		return fmt.Errorf("chaos: %s", strings.Join(bad, "; "))
	}
	return nil
}

// waitResolved waits, up to --drain, until no submitted call is left in
// outcome_unknown without the reconciler having resolved or parked it.
func (e *chaosEnv) waitResolved(ctx context.Context, cc ledger.ClientConfig, topic string, subs []consistency.Submitted, backend *demobackend.Server) error {
	deadline := time.Now().Add(e.f.drain)
	for {
		log, err := consistency.ReadLog(ctx, cc, topic)
		if err != nil {
			return fmt.Errorf("chaos: read the log: %w", err)
		}
		rep := consistency.Check(log, subs, backend.Effects())
		if rep.Unresolved == 0 || time.Now().After(deadline) {
			return nil
		}
		fmt.Fprintf(e.progress, "chaos: %d calls still outcome_unknown; waiting for the reconciler\n", rep.Unresolved)
		if !sleepCtx(ctx, 5*time.Second) {
			return ctx.Err()
		}
	}
}

// chaosHistory records the run's history as JSON lines: each envelope as
// it was submitted (with anything that looks like a token redacted), then
// each call's outcome in the committed log.
type chaosHistory struct {
	mu  sync.Mutex // the load's resends record submissions concurrently
	fh  *os.File
	w   *bufio.Writer
	enc *json.Encoder
	err error
}

func newChaosHistory(path string) (*chaosHistory, error) {
	fh, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("chaos: history: %w", err)
	}
	w := bufio.NewWriterSize(fh, 1<<20)
	return &chaosHistory{fh: fh, w: w, enc: json.NewEncoder(w)}, nil
}

// submitted records one envelope, sent for the first time or again; it
// runs on the load's submitting goroutine and on its resends'.
func (h *chaosHistory) submitted(rec *kgo.Record, at time.Time) {
	h.write(struct {
		Event    string    `json:"event"`
		At       time.Time `json:"at"`
		Key      string    `json:"key"`
		Envelope string    `json:"envelope"`
	}{"submitted", at.UTC(), string(rec.Key), string(ledger.RedactTokens(rec.Value))})
}

// outcome records where a call's committed history ends.
func (h *chaosHistory) outcome(k ledger.CallKey, o consistency.Outcome) {
	h.write(struct {
		Event string `json:"event"`
		Key   string `json:"key"`
		consistency.Outcome
	}{"outcome", k.String(), o})
}

func (h *chaosHistory) write(v any) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.err == nil {
		h.err = h.enc.Encode(v)
	}
}

// close flushes and closes the file; it reports the first error, and is
// safe to call twice.
func (h *chaosHistory) close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.fh == nil {
		return h.err
	}
	if err := h.w.Flush(); err != nil && h.err == nil {
		h.err = err
	}
	if err := h.fh.Close(); err != nil && h.err == nil {
		h.err = err
	}
	h.fh = nil
	return h.err
}

// writeTable prints the run: the load, the crashes per point, and the
// checked history.
func (r *chaosReport) writeTable(w io.Writer, points []string) error {
	fmt.Fprintf(w, "machine: %s, %d cores, %s\n", r.Machine.CPU, r.Machine.Cores, r.Machine.Go)
	fmt.Fprintf(w, "load: %g calls/s offered for the run; %d submitted, %d finished, %d lost, %.0f calls/s; %s in all\n",
		r.Rate, r.Load.Submitted, r.Load.Finished, r.Load.Lost, r.Load.PerSec, r.Duration.Round(time.Second))
	fmt.Fprintf(w, "witness: %d effects, %d reads, %d native replays, %d duplicate, %d sent twice, %d missing, %d under a spent credential\n\n",
		r.Witness.Effects, r.Witness.Reads, r.Witness.Replays, r.Witness.Duplicates, r.Witness.DuplicateSends, r.Witness.Missing, r.SpentCredentials)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "failpoint\thits\t")
	for _, p := range points {
		mark := "ok"
		if r.Crashes[p] < r.MinCrashes {
			mark = fmt.Sprintf("FAIL (fewer than %d)", r.MinCrashes)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\n", p, r.Crashes[p], mark)
	}
	roles := slices.Sorted(maps.Keys(r.Restarts))
	for _, role := range roles {
		fmt.Fprintf(tw, "restarts: %s\t%d\t\n", role, r.Restarts[role])
	}
	fmt.Fprintf(tw, "graceful restarts\t%d\t\n", r.GracefulRestarts)
	fmt.Fprintf(tw, "unexpected exits\t%d\t\n", r.UnexpectedExits)
	if err := tw.Flush(); err != nil {
		return err
	}
	if a := r.Assignment; a != nil {
		fmt.Fprintf(w, "executor partitions before kill: %s\n", formatOwners(a.Before))
		fmt.Fprintf(w, "executor partitions after kill of %s (settled in %s): %s\n", a.Killed, a.SettledIn.Round(time.Millisecond), formatOwners(a.After))
		if a.Problem != "" {
			fmt.Fprintf(w, "executor kill: %s\n", a.Problem)
		}
	}
	fmt.Fprintln(w)
	return r.Check.WriteTable(w)
}

// failures names everything that makes the run fail.
func (r *chaosReport) failures(points []string) []string {
	// The same witness as the bench's: an attempt sent twice is seen
	// there alone, since the mix's tools with effects deduplicate by key.
	bad := append(r.Check.Failures(), r.Witness.Failures("witness")...)
	if r.SpentCredentials != 0 {
		bad = append(bad, fmt.Sprintf("%d requests sent again under a credential already spent by its effect (a call without idempotency sent twice)", r.SpentCredentials))
	}
	if r.UnexpectedExits != 0 {
		bad = append(bad, fmt.Sprintf("%d processes exited neither at a failpoint nor cleanly when asked (their logs are in the work directory)", r.UnexpectedExits))
	}
	if r.Load.Lost != 0 {
		bad = append(bad, fmt.Sprintf("load driver: %d calls never finished", r.Load.Lost))
	}
	if a := r.Assignment; a != nil {
		if a.Killed == "" {
			bad = append(bad, "--kill-executor-after: no executor was killed")
		}
		if a.Problem != "" {
			bad = append(bad, "--kill-executor-after: "+a.Problem)
		}
	}
	if r.Load.Submitted < r.MinCalls {
		bad = append(bad, fmt.Sprintf("%d calls, fewer than --min-calls %d: raise --rate or --duration", r.Load.Submitted, r.MinCalls))
	}
	for _, p := range points {
		if r.Crashes[p] < r.MinCrashes {
			bad = append(bad, fmt.Sprintf("%s hit %d times, fewer than --min-crashes %d: lengthen --duration", p, r.Crashes[p], r.MinCrashes))
		}
	}
	return bad
}

// createSchemaDSN creates schema in dsn's database and returns dsn with it as
// the search_path, and a function that drops it.
func createSchemaDSN(ctx context.Context, dsn, schema string) (string, func() error, error) {
	conn, err := pgstore.Connect(ctx, dsn)
	if err != nil {
		return "", nil, fmt.Errorf("connect to the store: %w", err)
	}
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		conn.Close(ctx)
		return "", nil, fmt.Errorf("create schema %s: %w", schema, err)
	}
	conn.Close(ctx)
	drop := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgstore.Connect(ctx, dsn)
		if err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		return nil
	}
	out, err := withSearchPath(dsn, schema)
	if err != nil {
		_ = drop()
		return "", nil, err
	}
	return out, drop, nil
}

// storeEnv is the environment entry that gives a child process the
// store's DSN (its --crdb-dsn): never an argument, which every user of
// the host reads (ps, /proc/<pid>/cmdline), and a DSN may hold a
// password.
func storeEnv(dsn string) string { return envName("crdb-dsn") + "=" + dsn }

// withSearchPath returns dsn with its search_path set to schema, in place
// of any it had: pgx reads the first of repeated URL parameters.
func withSearchPath(dsn, schema string) (string, error) {
	if !strings.Contains(dsn, "://") {
		// A key=value DSN: a later key overrides an earlier one.
		return dsn + " search_path=" + schema, nil
	}
	u, err := url.Parse(dsn)
	if err != nil {
		// Not wrapped: url's error quotes the DSN, password included.
		return "", errors.New("store DSN: cannot parse it as a URL")
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String(), nil
}

// writeRegistry writes the demo registry into dir with every tool's
// timeout set to timeout: a claim's lease follows from it.
func writeRegistry(dir string, timeout time.Duration) error {
	demo := schemas.DemoFiles()
	return fs.WalkDir(demo, "tools", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(demo, path)
		if err != nil {
			return err
		}
		var doc map[string]json.RawMessage
		if err := json.Unmarshal(b, &doc); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		doc["timeout_ms"] = json.RawMessage(strconv.FormatInt(timeout.Milliseconds(), 10))
		if b, err = json.MarshalIndent(doc, "", "  "); err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Join(dir, filepath.Dir(path)), 0o755); err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dir, path), b, 0o644)
	})
}

// supervise keeps slot's process running until ctx ends: each start arms
// the slot's least-crashed failpoint (while the run is armed), and a
// process that dies is started again.
func (e *chaosEnv) supervise(ctx context.Context, s *chaosSlot) {
	for n := 0; ctx.Err() == nil; n++ {
		env := append(slices.Clone(e.env), failpoint.EnvLog+"="+e.crashLog)
		point := ""
		if e.f.minCrashes > 0 && e.armed.Load() && len(s.points) > 0 {
			point = e.nextPoint(s)
			env = append(env, failpoint.EnvSpec+"="+point+"="+strconv.FormatFloat(crashProbability(point), 'g', -1, 64))
		}
		args := slices.Concat(e.common, s.args)
		node, err := startNode("", args, env, filepath.Join(e.dir, fmt.Sprintf("%s.%d.log", s.name, n)))
		if err != nil {
			e.logger.Error("chaos: start process", "slot", s.name, "err", err)
			e.unexpect.Add(1)
			if !sleepCtx(ctx, time.Second) {
				return
			}
			continue
		}
		if n > 0 {
			e.mu.Lock()
			e.restarts[s.role]++
			e.mu.Unlock()
		}
		s.mu.Lock()
		s.node = node
		s.mu.Unlock()
		var waitErr error
		select {
		case waitErr = <-node.done:
		case <-ctx.Done():
			// Unarmed processes stop cleanly; an armed one may still
			// crash on its way out, which is as good.
			_ = node.cmd.Process.Signal(syscall.SIGCONT)
			_ = node.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case waitErr = <-node.done:
			case <-time.After(30 * time.Second):
				_ = node.cmd.Process.Kill()
				waitErr = <-node.done
			}
		}
		s.mu.Lock()
		s.node = nil
		dead := s.dead
		s.mu.Unlock()
		node.log.Close()
		if dead {
			return // killed for good by --kill-executor-after
		}
		if ws, ok := node.cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL && point != "" {
			continue // a failpoint: counted from the crash log
		}
		s.mu.Lock()
		stopping := s.stopping
		s.stopping = false
		s.mu.Unlock()
		if stopping && node.cmd.ProcessState.Success() {
			e.graceful.Add(1)
			continue // a rolling restart: start it again at once
		}
		if ctx.Err() == nil {
			// The log's end said here too: a test's work directory
			// is gone by the time anyone reads its report.
			e.logger.Warn("chaos: process exited without a failpoint", "slot", s.name, "point", point, "err", waitErr, "log", node.log.Name(),
				"log_tail", logTail(node.log.Name()))
			e.unexpect.Add(1)
			if !sleepCtx(ctx, 500*time.Millisecond) {
				return
			}
		}
	}
}

// crashProbability is the chance of a crash each time point is passed:
// about one crash in the first few batches of a process. A tool's answer
// comes once per call, not per batch, hence its lower chance.
func crashProbability(point string) float64 {
	if strings.HasSuffix(point, "."+string(failpoint.ToolApplied)) {
		return 0.1
	}
	return 0.5
}

// nextPoint is the point of s's role crashed least so far, ties at random.
func (e *chaosEnv) nextPoint(s *chaosSlot) string {
	counts := e.crashCounts()
	best, bestN := "", -1
	for _, i := range rand.Perm(len(s.points)) {
		p := s.role + "." + string(s.points[i])
		if n := counts[p]; bestN < 0 || n < bestN {
			best, bestN = p, n
		}
	}
	return best
}

// pauser stops an executor (SIGSTOP) past its group session and its
// claims' leases, then resumes it, over and over while the run is armed:
// at most two executors at a time, so that the rest keep working, and
// staggered so that a new pause starts every third of a pause.
func (e *chaosEnv) pauser(ctx context.Context) {
	pause := e.f.lease() + e.f.sessionTimeout + 2*time.Second
	var wg sync.WaitGroup
	defer wg.Wait()
	busy := make(chan struct{}, 2)
	for {
		select {
		case busy <- struct{}{}:
		case <-ctx.Done():
			return
		}
		if !e.armed.Load() {
			return
		}
		s, node := e.pickRunning()
		if node == nil {
			<-busy
			if !sleepCtx(ctx, 500*time.Millisecond) {
				return
			}
			continue
		}
		wg.Go(func() {
			defer func() { <-busy }()
			defer s.setPaused(false)
			if node.cmd.Process.Signal(syscall.SIGSTOP) != nil {
				return
			}
			sleepCtx(ctx, pause)
			if node.cmd.Process.Signal(syscall.SIGCONT) == nil {
				e.paused.Add(1)
			}
		})
		if !sleepCtx(ctx, pause/3) {
			return
		}
	}
}

// restarter stops the executors one at a time, every --restart-every,
// with SIGTERM, as a rolling restart does; the supervisor starts each
// again once it exited cleanly. It stops when the load ends.
func (e *chaosEnv) restarter(ctx context.Context) {
	for i := 0; ; i++ {
		if !sleepCtx(ctx, e.f.restartEvery) {
			return
		}
		if !e.armed.Load() {
			return
		}
		s := e.slots[1+i%e.f.executors]
		s.mu.Lock()
		node := s.node
		if node != nil && !s.paused && !s.dead {
			s.stopping = true
			_ = node.cmd.Process.Signal(syscall.SIGTERM)
		}
		s.mu.Unlock()
	}
}

// pickRunning picks, at random, an executor slot whose process runs and is
// neither paused nor killed for good, and marks it paused; nil when there
// is none.
func (e *chaosEnv) pickRunning() (*chaosSlot, *benchNode) {
	for _, i := range rand.Perm(e.f.executors) {
		s := e.slots[1+i]
		s.mu.Lock()
		node := s.node
		if node != nil && !s.paused && !s.dead {
			s.paused = true
			s.mu.Unlock()
			return s, node
		}
		s.mu.Unlock()
	}
	return nil, nil
}

func (s *chaosSlot) setPaused(p bool) {
	s.mu.Lock()
	s.paused = p
	s.mu.Unlock()
}

// crashCounts counts the crash log's lines per role.point, with the pauses.
func (e *chaosEnv) crashCounts() map[string]int {
	counts := map[string]int{}
	if b, err := os.ReadFile(e.crashLog); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			if f := strings.Fields(line); len(f) == 4 {
				counts[f[0]+"."+f[1]]++
			}
		}
	}
	counts[pausePoint] = int(e.paused.Load())
	return counts
}

// crashSummary is the progress line's crash figure: the total and the
// least-hit point.
func (e *chaosEnv) crashSummary() string {
	counts := e.crashCounts()
	total, least, leastN := 0, "", -1
	for _, p := range e.allPoints() {
		n := counts[p]
		total += n
		if leastN < 0 || n < leastN {
			least, leastN = p, n
		}
	}
	return fmt.Sprintf("%d (least: %s %d)", total, least, leastN)
}

// covered reports whether every point was hit --min-crashes times.
func (e *chaosEnv) covered() bool {
	counts := e.crashCounts()
	for _, p := range e.allPoints() {
		if counts[p] < e.f.minCrashes {
			return false
		}
	}
	return true
}

// allPoints lists every point of the run as role.point, and the pause.
func (e *chaosEnv) allPoints() []string {
	var out []string
	seen := map[string]bool{}
	for _, s := range e.slots {
		for _, p := range s.points {
			if k := s.role + "." + string(p); !seen[k] {
				seen[k] = true
				out = append(out, k)
			}
		}
	}
	return append(out, pausePoint)
}

func (e *chaosEnv) restartCounts() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return maps.Clone(e.restarts)
}

// executorGroup is the executors' consumer group: executor.Loop's
// default, which the executor role keeps.
const executorGroup = "ledger-executor"

// killExecutor kills one executor (SIGKILL) --kill-executor-after into the
// load and leaves its slot dead, so that the others must take over its
// partitions and its claims. Around the kill it records the executor
// group's assignment of topic: just before, once every executor is a
// member and the group is stable, and after, once the group settled on
// the survivors. It ends with ctx or once the group settled (or did not
// in time).
func (e *chaosEnv) killExecutor(ctx context.Context, cc ledger.ClientConfig, topic string) {
	a := &chaosAssignment{Group: executorGroup, Topic: topic, Partitions: chaosPartitions, KillAfter: e.f.killAfter, MemberIDs: map[string]string{}}
	defer func() {
		e.mu.Lock()
		e.assignment = a
		e.mu.Unlock()
	}()
	cl, err := ledger.NewClient(cc)
	if err != nil {
		a.Problem = fmt.Sprintf("admin client: %v", err)
		return
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	if !sleepCtx(ctx, e.f.killAfter) {
		return
	}
	// A group that did not settle in this long will not: with the run's
	// session timeout a dead member is gone in a few seconds.
	settle := max(30*time.Second, 20*e.f.sessionTimeout)
	before, ok := e.waitGroup(ctx, adm, topic, settle, func(v groupView) bool {
		return len(v.owners) == e.f.executors
	})
	a.Before = before.owners
	maps.Copy(a.MemberIDs, before.memberIDs)
	if !ok {
		a.Problem = fmt.Sprintf("the executor group was not stable with all %d executors within %s before the kill (last: %s, %s)", e.f.executors, settle, before.state, formatOwners(before.owners))
	}
	fmt.Fprintf(e.progress, "chaos: executor partitions before the kill: %s\n", formatOwners(before.owners))

	s := e.killOne()
	if s == nil {
		if a.Problem == "" {
			a.Problem = "no executor was running to kill"
		}
		return
	}
	killed := time.Now()
	a.Killed = s.name
	fmt.Fprintf(e.progress, "chaos: %s killed (SIGKILL) for good; the others must take over its partitions and claims\n", s.name)

	after, ok := e.waitGroup(ctx, adm, topic, settle, func(v groupView) bool {
		_, has := v.owners[s.name]
		return len(v.owners) == e.f.executors-1 && !has
	})
	a.After, a.SettledIn = after.owners, time.Since(killed)
	maps.Copy(a.MemberIDs, after.memberIDs)
	if !ok && ctx.Err() == nil && a.Problem == "" {
		a.Problem = fmt.Sprintf("the executor group did not settle on the survivors within %s of the kill (last: %s, %s)", settle, after.state, formatOwners(after.owners))
	}
	fmt.Fprintf(e.progress, "chaos: executor partitions %s after the kill: %s\n", a.SettledIn.Round(time.Millisecond), formatOwners(after.owners))
}

// killOne kills, at random, an executor whose process runs, marks its slot
// dead so that nothing starts, pauses or restarts it again, and returns
// the slot; nil when none runs.
func (e *chaosEnv) killOne() *chaosSlot {
	for _, i := range rand.Perm(e.f.executors) {
		s := e.slots[1+i]
		s.mu.Lock()
		if s.node != nil && !s.dead {
			s.dead = true
			// A paused process dies of SIGKILL too.
			_ = s.node.cmd.Process.Kill()
			s.mu.Unlock()
			return s
		}
		s.mu.Unlock()
	}
	return nil
}

func (e *chaosEnv) killedAssignment() *chaosAssignment {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.assignment
}

// chaosPartitions is the partitions of each of the run's topics.
const chaosPartitions = 12

// groupView is one look at the executor group: each member's partitions
// of the topic, by slot name.
type groupView struct {
	state     string
	owners    map[string][]int32
	memberIDs map[string]string
	// settled: stable, every member's process found, and every
	// partition of the topic assigned to exactly one member.
	settled bool
}

// waitGroup describes the executor group until it is settled and want
// holds, or for at most timeout; it returns the last view and whether it
// was the one waited for.
func (e *chaosEnv) waitGroup(ctx context.Context, adm *kadm.Client, topic string, timeout time.Duration, want func(groupView) bool) (groupView, bool) {
	deadline := time.Now().Add(timeout)
	for {
		v := e.describeGroup(ctx, adm, topic)
		if v.settled && want(v) {
			return v, true
		}
		if time.Now().After(deadline) || !sleepCtx(ctx, 200*time.Millisecond) {
			return v, false
		}
	}
}

// describeGroup looks at the executor group once. An error leaves the
// view unsettled, to be looked at again.
func (e *chaosEnv) describeGroup(ctx context.Context, adm *kadm.Client, topic string) groupView {
	v := groupView{owners: map[string][]int32{}, memberIDs: map[string]string{}}
	groups, err := adm.DescribeGroups(ctx, executorGroup)
	if err != nil {
		v.state = err.Error()
		return v
	}
	g, err := groups.On(executorGroup, nil)
	if err == nil {
		err = g.Err
	}
	if err != nil {
		v.state = err.Error()
		return v
	}
	v.state = g.State
	resolved := true
	owner := map[int32]int{}
	for _, m := range g.Members {
		// A loop's client id is its transactional id, which the run
		// names after the slot (--instance-id chaos-<slot>).
		name, ok := strings.CutPrefix(m.ClientID, "ledger-executor-chaos-")
		if _, taken := v.owners[name]; !ok || taken {
			name, resolved = "member "+m.MemberID, false
		}
		parts := []int32{}
		if c, ok := m.Assigned.AsConsumer(); ok {
			for _, t := range c.Topics {
				if t.Topic == topic {
					parts = append(parts, t.Partitions...)
				}
			}
		}
		slices.Sort(parts)
		for _, p := range parts {
			owner[p]++
		}
		v.owners[name], v.memberIDs[name] = parts, m.MemberID
	}
	v.settled = g.State == "Stable" && resolved && len(owner) == chaosPartitions
	for p, n := range owner {
		if n != 1 || p < 0 || p >= chaosPartitions {
			v.settled = false
		}
	}
	return v
}

func formatOwners(owners map[string][]int32) string {
	if len(owners) == 0 {
		return "no members"
	}
	var b strings.Builder
	for i, name := range slices.Sorted(maps.Keys(owners)) {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%s %v", name, owners[name])
	}
	return b.String()
}

// lockedWriter serializes the writes of several goroutines to w.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// chaosSlots are the run's processes: an intake, executors executors and
// a reconciler, each with a data directory of its own under dir, which
// also holds its credential keys (<data-dir>/credentials): a restarted
// process signs with its predecessor's keys, and no two brokers rotate
// keys in one directory, as no two deployed ones do. keyAddrs, one per
// executor and then the reconciler's, are where each serves its keys
// (--jwks-addr; fewer: the rest serve none). store are the flags of the
// store and the registry every one of them takes.
func chaosSlots(dir string, executors int, toolsURL, jwksFile string, keyAddrs []string, store []string) []*chaosSlot {
	keys := func(i int) []string {
		if i < len(keyAddrs) {
			return []string{"--jwks-addr", keyAddrs[i]}
		}
		return nil
	}
	slots := []*chaosSlot{{
		name: "intake-0", role: "intake", points: []failpoint.Name{failpoint.Consumed, failpoint.Produced, failpoint.Committed},
		args: slices.Concat([]string{"intake", "--instance-id", "chaos-intake-0", "--data-dir", filepath.Join(dir, "intake-0"), "--issuer", benchIssuer, "--jwks-file", jwksFile}, store),
	}}
	for i := range executors {
		name := "executor-" + strconv.Itoa(i)
		slots = append(slots, &chaosSlot{
			name: name, role: "executor", points: failpoint.All,
			args: slices.Concat([]string{"executor", "--instance-id", "chaos-" + name, "--data-dir", filepath.Join(dir, name), "--tools-base-url", toolsURL}, keys(i), store),
		})
	}
	return append(slots, &chaosSlot{
		name: "reconciler-0", role: "reconciler",
		args: slices.Concat([]string{"reconciler", "--instance-id", "chaos-reconciler-0", "--data-dir", filepath.Join(dir, "reconciler-0"), "--tools-base-url", toolsURL}, keys(executors), store),
	})
}
