package main

import (
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/toolcall-ledger/ledger/processors/loadtest"
	"github.com/toolcall-ledger/ledger/processors/storetest"
	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
)

// runMainEnv makes a child of the test binary run the command line it was
// given as the ledger binary would: `ledger bench` starts its ledger
// processes from os.Executable(), which under `go test` is this binary.
const runMainEnv = "LEDGER_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestBenchOnPostgres runs `ledger bench` as an operator would, on the
// shared-store path (two executor processes, PostgreSQL), projecting into
// ClickHouse, with an open-loop sweep, the direct floor and the raw
// limits, and checks the report: every call accounted for at the tool,
// nothing duplicated or lost, every figure present.
func TestBenchOnPostgres(t *testing.T) {
	dsn := freshSchemaDSN(t)
	t.Setenv(runMainEnv, "1")
	// The ledger processes get the DSN, which may hold a password, in
	// their environment: never on a command line, which every user of
	// the host reads.
	defer noChildArgument(t, dsnHost(t, dsn))()
	dir := t.TempDir()
	jsonOut, svgOut := filepath.Join(dir, "bench.json"), filepath.Join(dir, "bench.svg")
	chDSN, chDB := chtest.DSN(t), chtest.FreshDatabase(t)
	statBefore, statOK := machineCPU()
	out, progress := runBenchCmdProgress(t,
		"--crdb-dsn", dsn,
		"--clickhouse-dsn", chDSN, "--clickhouse-database", chDB,
		"--mix", "create_ticket=1,get_weather=1", "--tenants", "3",
		"--calls", "400", "--warmup", "100", "--concurrency", "64", "--executors", "2",
		"--sweep", "300", "--limit-calls", "2000",
		// The intake in a process of its own, apart from the executors.
		"--intake-process",
		// Passed on to the ledger processes, which must take it.
		"--batch-linger", "1ms", "--batch-linger-from", "3",
		"--timeline",
		"--json", jsonOut, "--svg", svgOut, "--work-dir", filepath.Join(dir, "work"),
	)
	for _, want := range []string{"where the time goes", "the store's tables at the end of each run", "timeline of ledger", "timeline of open 300/s", "projection lag into ClickHouse", "ledger / direct:", "ledger / slowest raw limit", "kafka_txn_consume_produce", "store_claims", "direct to backend", "open 300/s", "Ed25519/s at the start"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	// A run drops its topics and tables once measured, before the next
	// run starts: the next is not measured beside the store vacuuming
	// them and the in-process Kafka holding their log.
	dropped, next := strings.Index(progress, "bench: ledger: its topics and tables dropped"), strings.Index(progress, "bench: open 300/s: warming up")
	if dropped < 0 || next < 0 || dropped > next {
		t.Errorf("the closed loop's topics and tables dropped at %d of the progress, the next run's warm-up at %d; want the drop first:\n%s", dropped, next, progress)
	}
	// Each executor process keeps its credential keys in a directory of
	// its own, no other process writing there (brokers sharing one would
	// race at a rotation); the intake's process mints nothing.
	for i, want := range []bool{false, true, true} {
		keys, _ := filepath.Glob(filepath.Join(dir, "work", "credentials", fmt.Sprintf("node%d", i), "*"))
		if got := len(keys) > 0; got != want {
			t.Errorf("process %d's credential keys: %v; want some: %v", i, keys, want)
		}
	}
	if shared, _ := filepath.Glob(filepath.Join(dir, "work", "credentials", "*.json")); len(shared) > 0 {
		t.Errorf("credential keys %v in a directory the processes share", shared)
	}
	statAfter, ok := machineCPU()
	if !statOK || !ok {
		t.Fatal("/proc/stat not read; the bench's machine figures need it")
	}
	// The main run's row ends with its stolen share (read from
	// /proc/stat) and its Kafka CPU (not measured: the broker is in the
	// bench's process).
	if row := benchRow(out, "ledger"); len(row) < 2 || row[len(row)-1] != "-" {
		t.Errorf("main row %q; want the kafka CPU last, not measured", row)
	} else if _, err := strconv.ParseFloat(row[len(row)-2], 64); err != nil {
		t.Errorf("main row %q; want the stolen share before the kafka CPU", row)
	}
	rep := readReport(t, jsonOut)
	if len(rep.Runs) != 2 {
		t.Fatalf("%d runs; want the closed loop and one open-loop rate", len(rep.Runs))
	}
	// What the hypervisor took while the whole command ran bounds what
	// each run says it took, over a window inside it (a tick a CPU of
	// slack for the readings' rounding).
	stolenMax := statAfter.stolen - statBefore.stolen + time.Duration(runtime.NumCPU())*time.Second/clockTicks
	// The sweep's one rate against the default bound of 50 ms, whichever
	// way this machine's run went.
	if open := rep.Runs[1]; rep.SLO == nil || rep.SLO.AddedP99 != 50*time.Millisecond {
		t.Errorf("SLO %+v; want the open loop held to 50ms", rep.SLO)
	} else if held := open.Result.Added.P99 < 50*time.Millisecond && open.Result.Lost == 0 && !open.Result.Saturated; held && (rep.SLO.Held != 300 || rep.SLO.BrokenAt != 0) || !held && (rep.SLO.Held != 0 || rep.SLO.BrokenAt != 300) {
		t.Errorf("SLO %+v for an added p99 of %v at 300/s", rep.SLO, open.Result.Added.P99)
	} else if !strings.Contains(out, "added p99 under 50ms: ") {
		t.Errorf("report lacks the SLO line:\n%s", out)
	}
	if m := rep.Machine; m.SignsPerSecStart <= 0 || m.SignsPerSecEnd <= 0 {
		t.Errorf("machine %+v; want the host's speed read before the runs and after", m)
	}
	_, local := findLocalPostgres(t.Context(), dsn)
	for _, r := range rep.Runs {
		res, w := r.Result, r.Witness
		if res.Submitted != 400 || res.Finished != 400 || res.Lost != 0 || res.ByState["succeeded"] != 400 {
			t.Errorf("%s: submitted %d, finished %d, lost %d, states %v; want 400 succeeded", r.Name, res.Submitted, res.Finished, res.Lost, res.ByState)
		}
		if w.Effects != 200 || w.Reads != 200 || w.Duplicates != 0 || w.Missing != 0 || w.Orphans != 0 {
			t.Errorf("%s: witness %+v; want 200 effects, 200 reads, nothing else", r.Name, w)
		}
		if res.PerSec <= 0 || res.E2E.P50 <= 0 || res.E2E.P99 < res.E2E.P50 || r.LedgerCPU <= 0 || r.PeakRSS <= 0 || r.CPUPerCall <= 0 || r.MachineCPUPerCall <= 0 {
			t.Errorf("%s: missing figures: %+v", r.Name, r)
		}
		// The machine's CPU includes the ledger's (read over a window a
		// little wider, in 10 ms ticks: half is a safe floor).
		if r.MachineCPU < r.LedgerCPU/2 {
			t.Errorf("%s: machine CPU %v, ledger CPU %v; want the machine's to include the ledger's", r.Name, r.MachineCPU, r.LedgerCPU)
		}
		if r.ProjectionLag == nil || r.ProjectionLag.Max <= 0 {
			t.Errorf("%s: projection lag %v; want it sampled", r.Name, r.ProjectionLag)
		}
		if stolen := time.Duration(r.Stolen * float64(res.Elapsed) * float64(runtime.NumCPU())); r.Stolen < 0 || stolen > stolenMax {
			t.Errorf("%s: stolen share %.3f of %v on %d CPUs (%v); want it within the %v stolen while the command ran", r.Name, r.Stolen, res.Elapsed, runtime.NumCPU(), stolen, stolenMax)
		}
		if r.Processes != 3 {
			t.Errorf("%s: %d ledger processes; want 3 (the intake's, and one an executor)", r.Name, r.Processes)
		}
		if st := res.Stages; st.Calls != 400 || st.Intake.P50 <= 0 || st.Record.P50 <= 0 {
			t.Errorf("%s: stages %+v; want all 400 calls, intake and record measured", r.Name, st)
		}
		if r.StoreRetries == nil {
			t.Errorf("%s: store retries not counted; want them read from the processes' metrics", r.Name)
		}
		// The run's tables hold its calls and the warm-up's.
		if r.StoreRecords != 500 || r.StoreBytesPerCall < 500 {
			t.Errorf("%s: the store's footprint %d records, %.0f bytes a call; want 500 records (400 and 100 warming up) of at least 500 bytes", r.Name, r.StoreRecords, r.StoreBytesPerCall)
		}
		// The timeline's CPU readings telescope: their sum is the
		// growth over a window inside the run's own measurement.
		var tl loadtest.Usage
		var finished int64
		for _, iv := range res.Timeline {
			if iv.Usage == nil {
				t.Fatalf("%s: an interval without usage: %+v", r.Name, iv)
			}
			tl.Ledger += iv.Usage.Ledger
			tl.Store += iv.Usage.Store
			tl.Stolen += iv.Usage.Stolen
			tl.IntakeLoop += iv.Usage.IntakeLoop
			tl.ExecutorLoops += iv.Usage.ExecutorLoops
			tl.IntakeSteps += iv.Usage.IntakeSteps
			tl.ExecutorSteps += iv.Usage.ExecutorSteps
			finished += iv.Finished
		}
		if tl.Stolen < 0 || tl.Stolen > stolenMax {
			t.Errorf("%s: the timeline's stolen time %v; want it within the %v stolen while the command ran", r.Name, tl.Stolen, stolenMax)
		}
		if finished != res.Finished || tl.Ledger <= 0 || tl.Ledger > r.LedgerCPU || local && tl.Store <= 0 {
			t.Errorf("%s: timeline of %d intervals: %d finished, ledger CPU %v, store CPU %v; want %d finished and the ledger's CPU in (0, %v]", r.Name, len(res.Timeline), finished, tl.Ledger, tl.Store, res.Finished, r.LedgerCPU)
		}
		// The loops' busy time, read from the processes: some, and
		// never more than the run lasted (one intake, one loop an
		// executor process; the last reading follows the last
		// interval's end by a moment).
		if span := res.Timeline[len(res.Timeline)-1].End + 100*time.Millisecond; tl.IntakeLoop <= 0 || tl.IntakeLoop > span || tl.ExecutorLoops <= 0 || tl.ExecutorLoops > time.Duration(r.Processes)*span {
			t.Errorf("%s: loops busy %v (intake) and %v (executors) in a timeline of %v; want both positive and within it", r.Name, tl.IntakeLoop, tl.ExecutorLoops, span)
		}
		// A sanity bound, not an exact count (TestLoopTime counts):
		// every call crossed a step of each loop, and no loop steps
		// more often than it is given records (the run's 400 calls: a
		// request each for the intake, and one for each sent again,
		// four events each for the executors to read).
		if tl.IntakeSteps <= 0 || tl.IntakeSteps > 400+res.RetriedLater || tl.ExecutorSteps <= 0 || tl.ExecutorSteps > 4*400 {
			t.Errorf("%s: %d intake steps, %d executor steps for 400 calls; want some of each, no more than their records", r.Name, tl.IntakeSteps, tl.ExecutorSteps)
		}
		// The store's CPU is reported exactly when its server is a
		// PostgreSQL on this machine, as make test's is.
		if local && (r.StoreCPU <= 0 || r.StoreCPUPerCall <= 0) || !local && r.StoreCPU != 0 {
			t.Errorf("%s: store CPU %v (%v a call) with the server local: %v", r.Name, r.StoreCPU, r.StoreCPUPerCall, local)
		}
	}
	// The runs had schemas of their own, dropped since: the DSN's own
	// schema has no table.
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	var table *string
	if err := conn.QueryRow(t.Context(), "SELECT to_regclass('execution_records')::text").Scan(&table); err != nil {
		t.Fatal(err)
	}
	if table != nil {
		t.Errorf("the bench wrote %s in the DSN's schema; want its runs in schemas of their own", *table)
	}
	if rep.At.IsZero() {
		t.Error("the report does not say when it was measured")
	}
	if rep.Runs[1].Result.Mode != "open" || rep.Runs[1].Result.Offered != 300 {
		t.Errorf("second run is %q at %v/s; want open at 300/s", rep.Runs[1].Result.Mode, rep.Runs[1].Result.Offered)
	}
	if d := rep.Direct; d == nil || d.Calls != 400 || d.Errors != 0 || d.PerSec <= 0 {
		t.Errorf("direct floor = %+v; want 400 calls without errors", d)
	}
	names := map[string]bool{}
	for _, l := range rep.Limits {
		if l.PerSec <= 0 {
			t.Errorf("raw limit %s: %v/s", l.Name, l.PerSec)
		}
		names[l.Name] = true
	}
	for _, n := range []string{"kafka_txn_consume_produce", "store_claims", "store_complete"} {
		if !names[n] {
			t.Errorf("no raw limit %s in %v", n, names)
		}
	}
	svg, err := os.ReadFile(svgOut)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(svg), "<polyline"); n < 4 {
		t.Errorf("plot has %d polylines; want one per percentile", n)
	}
	dec := xml.NewDecoder(strings.NewReader(string(svg)))
	for {
		if _, err := dec.Token(); err != nil {
			if !errors.Is(err, io.EOF) {
				t.Errorf("plot is not well-formed XML: %v", err)
			}
			break
		}
	}
}

// TestBenchEmbedded runs the default: in-process Kafka and the embedded
// store, two executor instances in the one ledger process.
func TestBenchEmbedded(t *testing.T) {
	t.Setenv(runMainEnv, "1")
	dir := t.TempDir()
	jsonOut := filepath.Join(dir, "bench.json")
	// The broker in a process of its own: TestBenchOnPostgres runs it
	// in the bench's.
	out := runBenchCmd(t, "--calls", "300", "--warmup", "50", "--concurrency", "32", "--executors", "2",
		"--kafka-process", "--timeline",
		// The backend checks every credential against the keys the
		// ledger process serves, as a deployed tool does.
		"--backend-verify",
		"--direct=false", "--limits=false", "--json", jsonOut, "--work-dir", filepath.Join(dir, "work"))
	rep := readReport(t, jsonOut)
	if len(rep.Runs) != 1 {
		t.Fatalf("%d runs; want 1", len(rep.Runs))
	}
	r := rep.Runs[0]
	if rep.Kafka != "kfake (a process of its own, 1 broker)" || r.KafkaCPU <= 0 || r.KafkaCPUPerCall <= 0 {
		t.Errorf("kafka %q, its CPU %v (%v a call); want the broker's own process measured", rep.Kafka, r.KafkaCPU, r.KafkaCPUPerCall)
	}
	var timelineKafka time.Duration
	for _, iv := range r.Result.Timeline {
		if iv.Usage != nil {
			timelineKafka += iv.Usage.Kafka
		}
	}
	if timelineKafka <= 0 || timelineKafka > r.KafkaCPU {
		t.Errorf("the timeline's kafka CPU %v; want it in (0, %v], inside the run's measurement", timelineKafka, r.KafkaCPU)
	}
	if row := benchRow(out, "ledger"); len(row) == 0 || row[len(row)-1] != fmt.Sprintf("%.0f", float64(r.KafkaCPUPerCall.Nanoseconds())/1e3) {
		t.Errorf("main row %q; want the broker's CPU a call (%v) last", row, r.KafkaCPUPerCall)
	}
	// The broker's process is gone with the bench: its port refuses.
	log, err := os.ReadFile(filepath.Join(dir, "work", "kafka.log"))
	if err != nil {
		t.Fatalf("the kafka process's log: %v", err)
	}
	addr, ok := strings.CutPrefix(strings.TrimSpace(string(log)), "kafka: serving on [")
	addr, _, _ = strings.Cut(addr, "]")
	if !ok || addr == "" {
		t.Fatalf("kafka.log %q does not say where the broker served", log)
	}
	if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		conn.Close()
		t.Errorf("the kafka process still serves on %s after the bench returned", addr)
	}
	if r.Result.Finished != 300 || r.Result.Lost != 0 || r.Witness.Effects != 300 || r.Witness.Duplicates != 0 || r.Witness.Missing != 0 || r.Processes != 1 {
		t.Errorf("run = %+v; want 300 calls, 300 effects, one process", r)
	}
	if rep.Direct != nil || len(rep.Limits) != 0 {
		t.Errorf("direct %v and limits %v measured though switched off", rep.Direct, rep.Limits)
	}
	// The run's embedded store went with it once measured.
	if _, err := os.Stat(filepath.Join(dir, "work", "run1")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the run's embedded store left in the work directory (stat: %v); want it removed once measured", err)
	}
}

// TestBenchPolicyTimeout: --policy-timeout reaches the ledger processes.
// With a budget no decision meets, every call is refused for now, sent
// again as often as the load generator does (three times), and then
// ends denied; nothing runs, and the run fails, saying so: calls that
// never ran would count in its calls/s and latencies.
func TestBenchPolicyTimeout(t *testing.T) {
	t.Setenv(runMainEnv, "1")
	dir := t.TempDir()
	jsonOut := filepath.Join(dir, "bench.json")
	root := newRoot()
	root.SetArgs([]string{"--log-level", "warn", "bench", "--calls", "20", "--warmup", "0", "--concurrency", "8", "--policy-timeout", "1ns",
		"--direct=false", "--limits=false", "--json", jsonOut, "--work-dir", filepath.Join(dir, "work")})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	if err := root.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), "calls did not succeed (denied 20)") {
		t.Errorf("ledger bench with every call denied = %v; want it failed, saying 20 calls were denied", err)
	}
	rep := readReport(t, jsonOut)
	if len(rep.Runs) != 1 {
		t.Fatalf("%d runs; want 1", len(rep.Runs))
	}
	r := rep.Runs[0]
	if r.Result.ByState["denied"] != 20 || r.Result.RetryReasons["policy_timeout"] != 60 || r.Witness.Effects != 0 {
		t.Errorf("by state %v, sent again %v, effects %d; want 20 denied, each sent again 3 times for policy_timeout, no effect",
			r.Result.ByState, r.Result.RetryReasons, r.Witness.Effects)
	}
}

// TestBenchBaseline compares this build with a baseline binary (this one
// again): each build's runs alternate, and the report has both and their
// medians side by side.
func TestBenchBaseline(t *testing.T) {
	t.Setenv(runMainEnv, "1")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	jsonOut := filepath.Join(dir, "bench.json")
	out := runBenchCmd(t, "--calls", "200", "--warmup", "50", "--concurrency", "32", "--baseline", self, "--pairs", "2",
		"--direct=false", "--limits=false", "--json", jsonOut, "--work-dir", filepath.Join(dir, "work"))
	if !strings.Contains(out, "side by side, medians of 2 runs each") || !strings.Contains(out, "baseline: "+self) {
		t.Errorf("report lacks the side-by-side table:\n%s", out)
	}
	rep := readReport(t, jsonOut)
	var got []string
	for _, r := range rep.Runs {
		got = append(got, r.Name+"/"+r.Build)
		if r.Result.Finished != 200 || r.Result.Lost != 0 || r.Witness.Duplicates != 0 {
			t.Errorf("%s: %d finished, %d lost, %d duplicates; want 200, 0, 0", r.Name, r.Result.Finished, r.Result.Lost, r.Witness.Duplicates)
		}
	}
	// ABBA: a machine drifting during the benchmark favours neither.
	if want := []string{"baseline #1/baseline", "ledger #1/", "ledger #2/", "baseline #2/baseline"}; !slices.Equal(got, want) {
		t.Errorf("runs %v; want %v", got, want)
	}
	if rep.Baseline != self {
		t.Errorf("report baseline %q; want %q", rep.Baseline, self)
	}
	// The flags the ledger processes are given must be the baseline's
	// too: checked before anything starts.
	if err := checkBaseline(t.Context(), self, []string{"--batch-linger", "2ms", "--batch-linger-from", "3"}); err != nil {
		t.Errorf("checkBaseline with flags the baseline knows: %v", err)
	}
	if err := checkBaseline(t.Context(), self, []string{"--batch-linger-after", "3"}); err == nil || !strings.Contains(err.Error(), "--batch-linger-after") {
		t.Errorf("checkBaseline with a flag the baseline lacks: %v; want an error naming it", err)
	}
}

// TestBenchFlags: flags that cannot make a run are refused before
// anything starts.
func TestBenchFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--calls", "0"},
		{"--concurrency", "0"},
		{"--tenants", "0"},
		{"--executors", "0"},
		{"--sweep", "100,x"},
		{"--scaling", "-1"},
		{"--mix", "drop_table"},
		{"--mix", "create_ticket=0"},
		{"--limit-calls", "0"},
		{"--baseline", "/bin/false"},
		{"--baseline", filepath.Join(t.TempDir(), "no-such-ledger")},
		{"--baseline", "/bin/true", "--pairs", "0"},
		{"--batch-linger", "-1ms"},
		{"--intake-process"}, // the embedded store belongs to one process
		{"--batch-linger-from", "-1"},
		{"--kafka-process", "--kafka-brokers", "127.0.0.1:1"}, // its own broker, or another
		{"--slo", "-1ms"},
		{"--policy-timeout", "-1ms"},
	} {
		root := newRoot()
		root.SetArgs(append([]string{"bench"}, args...))
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		// Refused for the flag, before anything runs: an error of the
		// run itself (this test binary cannot be a ledger node) would
		// pass a flag that is not checked.
		flag := args[0]
		for _, a := range args {
			if strings.HasPrefix(a, "--") {
				flag = a
			}
		}
		if err := root.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), flag) {
			t.Errorf("bench %v: %v; want an error naming %s", args, err, flag)
		}
	}
}

// Each run of `ledger bench` on a shared store gets empty tables in a
// schema of its own, which it drops once measured (kept with --keep),
// whatever search_path the DSN named.
func TestBenchStoreSchemas(t *testing.T) {
	for _, keep := range []bool{false, true} {
		base := freshSchemaDSN(t)
		e := &benchEnv{f: &benchFlags{crdbDSN: base, keep: keep}, logger: slog.New(slog.DiscardHandler), id: fmt.Sprintf("t%d", time.Now().UnixNano())}
		var (
			schemas []string
			drops   []func() error
		)
		for _, name := range []string{"run1", "limits"} {
			dsn, drop, err := e.storeSchema(t.Context(), name)
			if err != nil {
				t.Fatalf("storeSchema(%s): %v", name, err)
			}
			conn, err := pgx.Connect(t.Context(), dsn)
			if err != nil {
				t.Fatal(err)
			}
			var schema string
			var n int64
			if err := conn.QueryRow(t.Context(), "SELECT current_schema(), (SELECT count(*) FROM execution_records)").Scan(&schema, &n); err != nil {
				t.Fatalf("%s: the migrated table in the run's schema: %v", name, err)
			}
			conn.Close(t.Context())
			if want := "bench_" + e.id + "_" + name; schema != want || n != 0 {
				t.Errorf("storeSchema(%s): schema %q with %d records; want %q, empty", name, schema, n, want)
			}
			schemas = append(schemas, schema)
			drops = append(drops, drop)
		}
		for _, drop := range drops {
			if err := drop(); err != nil {
				t.Error(err)
			}
		}
		conn, err := pgx.Connect(t.Context(), base)
		if err != nil {
			t.Fatal(err)
		}
		var left int
		if err := conn.QueryRow(t.Context(), "SELECT count(*) FROM pg_namespace WHERE nspname = ANY($1)", schemas).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if !keep && left != 0 {
			t.Errorf("%d of the runs' schemas %v left after the benchmark; want them dropped", left, schemas)
		}
		if keep {
			if left != len(schemas) {
				t.Errorf("--keep: %d of the runs' schemas %v left; want all", left, schemas)
			}
			for _, sc := range schemas {
				if _, err := conn.Exec(t.Context(), "DROP SCHEMA "+pgx.Identifier{sc}.Sanitize()+" CASCADE"); err != nil {
					t.Error(err)
				}
			}
		}
		conn.Close(t.Context())
	}
}

// A ledger process that dies during a run ends the run at once, naming
// the process's log, instead of the run waiting out its drain.
func TestWatchNodesProcessExits(t *testing.T) {
	logPath := filepath.Join(t.TempDir(), "node.log")
	n, err := startNode("", []string{"--no-such-flag"}, []string{runMainEnv + "=1"}, logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer n.kill()
	ctx, unwatch := watchNodes(t.Context(), []*benchNode{n})
	defer unwatch()
	select {
	case <-ctx.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the run's context lives on after its ledger process exited")
	}
	// The cause quotes what the process said last (cobra's complaint).
	if cause := context.Cause(ctx); cause == nil || !strings.Contains(cause.Error(), "exited during the run") || !strings.Contains(cause.Error(), logPath) ||
		!strings.Contains(cause.Error(), "its last lines:") || !strings.Contains(cause.Error(), "unknown flag: --no-such-flag") {
		t.Errorf("cause = %v; want the process's exit, its log and the log's last lines", cause)
	}
	unwatch() // idempotent
}

// The bench's Kafka process serves in a process group of its own (a
// Ctrl-C on the terminal is the bench's to handle), and a run watches it
// as it watches its ledger processes: a broker that dies ends the run,
// naming it.
func TestKafkaProcessWatched(t *testing.T) {
	t.Setenv(runMainEnv, "1")
	dir := t.TempDir()
	k, addr, err := startKafkaProcess(t.Context(), dir, "")
	if err != nil {
		t.Fatal(err)
	}
	defer k.kill()
	if pgid, err := syscall.Getpgid(k.cmd.Process.Pid); err != nil || pgid != k.cmd.Process.Pid {
		t.Errorf("the kafka process's group %d (%v); want its own, %d", pgid, err, k.cmd.Process.Pid)
	}
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("the kafka process does not serve on %s: %v", addr, err)
	}
	conn.Close()
	ledgerNode := &benchNode{what: "ledger process", exited: make(chan struct{})}
	nodes := []*benchNode{ledgerNode}
	e := &benchEnv{kafka: k}
	watched := e.watched(nodes)
	if len(watched) != 2 || watched[0] != ledgerNode || watched[1] != k || len(nodes) != 1 {
		t.Fatalf("watched %v (nodes now %v); want the ledger process, then the kafka process, the run's nodes left as they were", watched, nodes)
	}
	if got := (&benchEnv{}).watched(nodes); len(got) != 1 {
		t.Errorf("watched without a kafka process: %v; want the nodes alone", got)
	}
	ctx, unwatch := watchNodes(t.Context(), []*benchNode{k})
	defer unwatch()
	if err := k.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ctx.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the run's context lives on after the kafka process died")
	}
	if cause := context.Cause(ctx); cause == nil || !strings.Contains(cause.Error(), "kafka process") || !strings.Contains(cause.Error(), filepath.Join(dir, "kafka.log")) {
		t.Errorf("cause = %v; want the kafka process named, with its log", cause)
	}
}

func TestParseRetries(t *testing.T) {
	page := `# HELP ledger_store_retries_total Execution store transactions run again.
# TYPE ledger_store_retries_total counter
ledger_store_retries_total{op="claim",role="bench"} 84
ledger_store_retries_total{op="mark logged",role="bench"} 2
ledger_store_retries_totally{op="claim"} 1000
ledger_stage_seconds_count{stage="claim"} 7
`
	sum := map[string]int64{"claim": 1}
	if err := parseRetries([]byte(page), sum); err != nil {
		t.Fatal(err)
	}
	if want := map[string]int64{"claim": 85, "mark logged": 2}; !maps.Equal(sum, want) {
		t.Errorf("parseRetries = %v; want %v (added to what was there)", sum, want)
	}
	for _, bad := range []string{
		`ledger_store_retries_total{op="claim"} many`,
		`ledger_store_retries_total{role="bench"} 3`,
	} {
		if err := parseRetries([]byte(bad), map[string]int64{}); err == nil {
			t.Errorf("parseRetries(%q): no error", bad)
		}
	}
}

func TestParseProcStat(t *testing.T) {
	// user nice system idle iowait irq softirq steal guest guest_nice
	stat := "cpu  107077 3 49388 134987 642 5 2395 1542 0 0\ncpu0 53000 1 24000 67000 300 2 1200 700 0 0\nintr 1 2 3\n"
	got, ok := parseProcStat([]byte(stat))
	tick := 10 * time.Millisecond
	want := cpuTimes{
		busy:   (107077 + 3 + 49388 + 5 + 2395) * tick,
		stolen: 1542 * tick,
		total:  (107077 + 3 + 49388 + 134987 + 642 + 5 + 2395 + 1542) * tick,
	}
	if !ok || got != want {
		t.Errorf("parseProcStat = %+v, %v; want %+v, true (idle, iowait and steal not busy; guest counted in user already)", got, ok, want)
	}
	// A kernel without steal (before 2.6.11): none stolen.
	if got, ok := parseProcStat([]byte("cpu  10 0 5 80 5 0 0\n")); !ok || got != (cpuTimes{busy: 15 * tick, total: 100 * tick}) {
		t.Errorf("parseProcStat without steal = %+v, %v; want busy 150ms, total 1s, nothing stolen", got, ok)
	}
	for _, bad := range []string{"", "cpu0 1 2 3 4 5 6 7\n", "cpu  1 2 3\n", "cpu  1 x 3 4 5 6 7 8\n", "cpu  1 -2 3 4 5 6 7 8\n", "cpu  1 2 3 4 5 6 7 -8\n"} {
		if got, ok := parseProcStat([]byte(bad)); ok {
			t.Errorf("parseProcStat(%q) = %+v, true; want false", bad, got)
		}
	}
	// Between two readings: 30 of 200 ticks stolen.
	a := cpuTimes{busy: 100 * tick, stolen: 10 * tick, total: 400 * tick}
	b := cpuTimes{busy: 250 * tick, stolen: 40 * tick, total: 600 * tick}
	if got := a.stolenShare(b); got != 0.15 {
		t.Errorf("stolenShare = %v; want 0.15", got)
	}
	if got := a.stolenShare(a); got != 0 {
		t.Errorf("stolenShare over no time = %v; want 0", got)
	}
}

func TestWithSearchPath(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"postgres://u:p%40ss@h:5432/db", "postgres://u:p%40ss@h:5432/db?search_path=s1"},
		{"postgres://u@h/db?sslmode=disable", "postgres://u@h/db?search_path=s1&sslmode=disable"},
		// Replaced, not repeated: pgx would read the first.
		{"postgres://u@h/db?search_path=old&sslmode=disable", "postgres://u@h/db?search_path=s1&sslmode=disable"},
		{"host=h dbname=db search_path=old", "host=h dbname=db search_path=old search_path=s1"},
	} {
		got, err := withSearchPath(c.in, "s1")
		if err != nil || got != c.want {
			t.Errorf("withSearchPath(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
	if _, err := withSearchPath("postgres://u@h:port/db", "s1"); err == nil {
		t.Error("withSearchPath of an unparseable URL: no error")
	}
}

// freshSchemaDSN is the test PostgreSQL's DSN with a fresh schema, created
// and dropped with the test, as its search_path: the processes a command
// starts share it, and it shares nothing with other tests.
func freshSchemaDSN(t *testing.T) string {
	t.Helper()
	dsn := storetest.PGDSN(t)
	out, drop, err := createSchemaDSN(t.Context(), dsn, storetest.FreshSchema(t, dsn))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = drop() })
	return out
}

func runBenchCmd(t *testing.T, args ...string) string {
	t.Helper()
	out, _ := runBenchCmdProgress(t, args...)
	return out
}

// runBenchCmdProgress runs `ledger bench` with args and returns its report
// and its progress lines.
func runBenchCmdProgress(t *testing.T, args ...string) (string, string) {
	t.Helper()
	var out, progress strings.Builder
	root := newRoot()
	root.SetArgs(append([]string{"--log-level", "warn", "bench"}, args...))
	root.SetOut(&out)
	root.SetErr(&progress)
	if err := root.ExecuteContext(t.Context()); err != nil {
		t.Fatalf("ledger bench: %v\nprogress:\n%s\nreport:\n%s", err, progress.String(), out.String())
	}
	t.Logf("ledger bench %s:\n%s", strings.Join(args, " "), out.String())
	return out.String(), progress.String()
}

func readReport(t *testing.T, path string) loadtest.Report {
	t.Helper()
	var rep loadtest.Report
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	return rep
}

func TestGrowing(t *testing.T) {
	type reading struct {
		d  time.Duration
		ok bool
	}
	for _, tc := range []struct {
		name     string
		readings []reading
		want     []time.Duration
	}{
		// A failed reading and one below the last keep the total; the
		// differences a timeline takes stay non-negative.
		{"first read works", []reading{{5, true}, {0, false}, {3, true}, {9, true}, {0, false}, {12, true}}, []time.Duration{5, 5, 5, 9, 9, 12}},
		// The first success after failures is the start: what came
		// before it does not land in one interval.
		{"first reads fail", []reading{{0, false}, {0, false}, {100, true}, {104, true}, {0, false}, {110, true}}, []time.Duration{0, 0, 0, 4, 4, 10}},
	} {
		i := 0
		total := growing(func() (time.Duration, bool) {
			r := tc.readings[i]
			i++
			return r.d, r.ok
		})
		var got []time.Duration
		for range tc.readings {
			got = append(got, total())
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: totals %v; want %v", tc.name, got, tc.want)
		}
	}
}

// benchRow is the cells of the report's run table row named name (its
// first cell), nil if there is none.
func benchRow(report, name string) []string {
	for line := range strings.SplitSeq(report, "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[0] == name && (f[1] == "closed" || f[1] == "open") {
			return f
		}
	}
	return nil
}

// logTail quotes a log's last lines whole, at most eight and 2 KiB, and
// nothing for an empty or missing log.
func TestLogTail(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	var long strings.Builder
	for i := range 200 {
		fmt.Fprintf(&long, "line %03d %s\n", i, strings.Repeat("x", 20))
	}
	for _, tc := range []struct {
		name, content, want string
	}{
		{"short", "a\nb\n", "; its last lines:\n\ta\n\tb"},
		{"long", long.String(), "; its last lines:\n\t" + strings.Join(strings.Split(strings.TrimSpace(long.String()), "\n")[192:], "\n\t")},
		{"empty", "", ""},
		{"blank", "\n\n", ""},
	} {
		if got := logTail(write(tc.name, tc.content)); got != tc.want {
			t.Errorf("%s: logTail = %q; want %q", tc.name, got, tc.want)
		}
	}
	if got := logTail(filepath.Join(dir, "missing")); got != "" {
		t.Errorf("missing log: logTail = %q; want \"\"", got)
	}
	// A line longer than the bytes quoted is left out, unless it is the
	// last one, which is quoted by its end.
	if got := logTail(write("one", strings.Repeat("y", 5000)+"\nlast\n")); got != "; its last lines:\n\tlast" {
		t.Errorf("a long line, then another: logTail = %q; want only the last line", got)
	}
	if got := logTail(write("only", strings.Repeat("z", 5000)+"\n")); got != "; its last lines:\n\t..."+strings.Repeat("z", 2048) {
		t.Errorf("one long line: logTail = %q; want its last 2 KiB", got)
	}
	// A panic's first line, out of the tail of its stacks, is quoted.
	stacks := "panic: runtime error: index out of range [3] with length 3\n\ngoroutine 1 [running]:\n" + long.String()
	if got := logTail(write("panic", stacks)); !strings.HasPrefix(got, `; it said "panic: runtime error: index out of range [3] with length 3"; its last lines:`) {
		t.Errorf("a panic: logTail = %q; want its panic line first", got)
	}
}

// The addresses a run picks for its processes are all different, and
// below the ephemeral range that outgoing connections take ports from.
func TestFreeLoopbackAddrsDistinct(t *testing.T) {
	addrs, err := freeLoopbackAddrs(64)
	if err != nil {
		t.Fatal(err)
	}
	lo, hi := belowEphemeral("/proc/sys/net/ipv4/ip_local_port_range")
	seen := map[string]bool{}
	for _, a := range addrs {
		host, p, err := net.SplitHostPort(a)
		port, _ := strconv.Atoi(p)
		if err != nil || seen[a] || host != "127.0.0.1" || (hi > lo && (port < lo || port >= hi)) {
			t.Errorf("address %q picked twice, not loopback, or outside [%d, %d), in %v", a, lo, hi, addrs)
		}
		seen[a] = true
	}
	if len(seen) != 64 {
		t.Errorf("%d addresses; want 64", len(seen))
	}
}

// The ports below the ephemeral range: from 10000 to where the kernel's
// range starts, 32768 if it cannot be read, none if too few are left.
func TestBelowEphemeral(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		content string
		lo, hi  int
	}{
		{"32768\t60999\n", 10000, 32768},
		{"20000 60999\n", 10000, 20000},
		{"10500 60999\n", 0, 0},
		{"garbage", 10000, 32768},
	} {
		p := filepath.Join(dir, "range")
		if err := os.WriteFile(p, []byte(tc.content), 0o600); err != nil {
			t.Fatal(err)
		}
		if lo, hi := belowEphemeral(p); lo != tc.lo || hi != tc.hi {
			t.Errorf("range %q: belowEphemeral = %d, %d; want %d, %d", tc.content, lo, hi, tc.lo, tc.hi)
		}
	}
	if lo, hi := belowEphemeral(filepath.Join(dir, "missing")); lo != 10000 || hi != 32768 {
		t.Errorf("no range file: belowEphemeral = %d, %d; want 10000, 32768", lo, hi)
	}
}

// dsnHost is the host and port of a URL DSN (a key=value DSN's host=
// field), which every DSN derived from it names.
func dsnHost(t *testing.T, dsn string) string {
	t.Helper()
	if !strings.Contains(dsn, "://") {
		for f := range strings.FieldsSeq(dsn) {
			if strings.HasPrefix(f, "host=") {
				return f
			}
		}
	}
	u, err := url.Parse(dsn)
	if err != nil || u.Host == "" {
		t.Fatalf("test DSN %q: want a URL naming a host (%v)", dsn, err)
	}
	return u.Host
}

// noChildArgument watches the command lines of this process's children
// until the function it returns is called, and then fails t if one held
// needle.
func noChildArgument(t *testing.T, needle string) (stop func()) {
	t.Helper()
	var (
		seen = map[string]string{} // by pid
		done = make(chan struct{})
		over = make(chan struct{})
	)
	self := strconv.Itoa(os.Getpid())
	look := func() {
		stats, _ := filepath.Glob("/proc/[0-9]*/stat")
		for _, st := range stats {
			b, err := os.ReadFile(st)
			if err != nil {
				continue // ended meanwhile
			}
			// pid (comm) state ppid ...: comm may hold spaces.
			_, rest, _ := strings.Cut(string(b), ") ")
			if f := strings.Fields(rest); len(f) < 2 || f[1] != self {
				continue
			}
			cmdline, err := os.ReadFile(filepath.Join(filepath.Dir(st), "cmdline"))
			if err == nil && strings.Contains(string(cmdline), needle) {
				seen[filepath.Base(filepath.Dir(st))] = strings.ReplaceAll(string(cmdline), "\x00", " ")
			}
		}
	}
	go func() {
		defer close(over)
		for {
			look()
			select {
			case <-done:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return func() {
		close(done)
		<-over
		for pid, cmdline := range seen {
			t.Errorf("%d child processes' command lines held %q, such as %s's: %q", len(seen), needle, pid, cmdline)
			break
		}
	}
}

// The bench process collects at the ledger's target under a quarter of
// the machine's memory, at Go's default without a bound, and leaves an
// operator's GOGC or GOMEMLIMIT alone.
func TestHarnessGC(t *testing.T) {
	const unlimited = math.MaxInt64
	gc, limit := debug.SetGCPercent(100), debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetGCPercent(gc); debug.SetMemoryLimit(limit) })
	for _, tc := range []struct {
		name  string
		env   map[string]string
		memGB int
		gc    int
		limit int64
	}{
		{"24 GB", nil, 24, defaultGCPercent, 6 << 30},
		{"memory unknown", nil, 0, 100, unlimited},
		{"GOMEMLIMIT set", map[string]string{"GOMEMLIMIT": "1GiB"}, 24, defaultGCPercent, unlimited},
		{"GOGC set", map[string]string{"GOGC": "50"}, 24, 100, unlimited},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, k := range []string{"GOGC", "GOMEMLIMIT"} {
				t.Setenv(k, "")
				if v, ok := tc.env[k]; ok {
					t.Setenv(k, v)
				} else {
					os.Unsetenv(k)
				}
			}
			// Go's defaults, as the runtime starts without GOGC or GOMEMLIMIT.
			debug.SetGCPercent(100)
			debug.SetMemoryLimit(unlimited)
			harnessGC(tc.memGB)
			if got := debug.SetGCPercent(100); got != tc.gc {
				t.Errorf("GC percent %d, want %d", got, tc.gc)
			}
			if got := debug.SetMemoryLimit(-1); got != tc.limit {
				t.Errorf("memory limit %d, want %d", got, tc.limit)
			}
		})
	}
}
