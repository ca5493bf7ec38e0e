package loadtest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// repResult is a run's result with every exported field set.
func repResult(name string, perSec float64) Result {
	h := NewHistogram()
	h.Record(3 * time.Millisecond)
	return Result{
		Mode: "closed", Submitted: 1000, Finished: 1000, ByState: map[string]int64{"succeeded": 999, "failed": 1},
		Elapsed: 2 * time.Second, PerSec: perSec, RunID: "r" + name,
		E2E:   Percentiles{P50: 3 * time.Millisecond, P95: 5 * time.Millisecond, P99: 8 * time.Millisecond, P999: 13 * time.Millisecond, Max: 21 * time.Millisecond},
		Added: Percentiles{P50: 2 * time.Millisecond, P95: 4 * time.Millisecond, P99: 7 * time.Millisecond, P999: 12 * time.Millisecond, Max: 20 * time.Millisecond},
		Stages: Stages{
			Calls:  999,
			Intake: Percentiles{P50: 1100 * time.Microsecond, P95: 2 * time.Millisecond, P99: 2500 * time.Microsecond, P999: 3 * time.Millisecond, Max: 4 * time.Millisecond},
			Claim:  Percentiles{P50: 400 * time.Microsecond, P95: time.Millisecond, P99: 1200 * time.Microsecond, P999: 2 * time.Millisecond, Max: 3 * time.Millisecond},
			Call:   Percentiles{P50: time.Millisecond, P95: time.Millisecond, P99: 2 * time.Millisecond, P999: 3 * time.Millisecond, Max: 5 * time.Millisecond},
			Record: Percentiles{P50: 500 * time.Microsecond, P95: time.Millisecond, P99: 1500 * time.Microsecond, P999: 2 * time.Millisecond, Max: 6 * time.Millisecond},
		},
		e2e: h, added: h, succeeded: []uint64{1, 2, 3},
	}
}

// repReport is a report with every field set: two runs (the second an
// open loop that saturated), the direct floor and the three raw limits.
func repReport() Report {
	open := repResult("open", 480)
	open.Mode, open.Offered, open.Saturated, open.Lost = "open", 500, true, 3
	return Report{
		Machine: Machine{CPU: "Test CPU @ 3.00GHz", Cores: 8, MemoryGB: 16, Go: "go1.26", OS: "linux/amd64"},
		At:      time.Date(2026, 3, 4, 5, 6, 7, 891011, time.FixedZone("AEDT", 11*3600)),
		Kafka:   "kfake (1 broker)", Store: "embedded", Mix: "get_weather=3,create_ticket=1",
		Tenants: 8, Concurrency: 64, BackendLatency: 2 * time.Millisecond,
		Runs: []RunReport{
			{
				Name: "ledger", Executors: 2, Processes: 1, Result: repResult("main", 500),
				Witness:   Witness{Effects: 250, Reads: 750, Replays: 4, Orphans: 1},
				LedgerCPU: 3 * time.Second, HarnessCPU: time.Second, MachineCPU: 6 * time.Second, StoreCPU: 2 * time.Second, PeakRSS: 200 << 20,
				CPUPerCall: 3 * time.Millisecond, HarnessCPUPerCall: time.Millisecond, MachineCPUPerCall: 6 * time.Millisecond, StoreCPUPerCall: 2 * time.Millisecond, PeakRSSPerCall: 209715.2,
				PerSecPerExecutor: 250, PerSecPerLedgerCPU: 333.25, StoreRetries: map[string]int64{"claim": 5, "complete": 2},
				StoreRecords: 1500, StoreBytes: 4 << 20, StoreBytesPerCall: float64(4<<20) / 1500,
				Stolen: 0.125, KafkaCPU: 500 * time.Millisecond, KafkaCPUPerCall: 500 * time.Microsecond,
			},
			{Name: "open 500/s", Executors: 2, Processes: 1, Result: open, Witness: Witness{Effects: 250, Reads: 747, Duplicates: 2, Missing: 1}},
		},
		Direct: &DirectReport{Calls: 1000, Errors: 2, Elapsed: time.Second, PerSec: 2000,
			Latency: Percentiles{P50: time.Millisecond, P95: 2 * time.Millisecond, P99: 3 * time.Millisecond, P999: 4 * time.Millisecond, Max: 5 * time.Millisecond}},
		Limits: []Limit{
			{Name: "kafka_txn_consume_produce", Ops: 80000, Elapsed: 4 * time.Second, PerSec: 20000, Batch: 500, Note: "records copied"},
			{Name: "store_claims", Ops: 20000, Elapsed: 8 * time.Second, PerSec: 2500, Batch: 500, Note: "calls claimed"},
			{Name: "store_complete", Ops: 20000, Elapsed: 40 * time.Second, PerSec: 500, Batch: 500, Note: "calls completed"},
		},
	}
}

func TestRunReportDerive(t *testing.T) {
	cases := []struct {
		name string
		in   RunReport
		want RunReport // only the derived fields are compared
	}{
		{
			name: "totals",
			in: RunReport{Executors: 4, LedgerCPU: 3 * time.Second, HarnessCPU: time.Second, MachineCPU: 5 * time.Second, StoreCPU: 2 * time.Second, KafkaCPU: 700 * time.Millisecond, PeakRSS: 300 << 20,
				StoreRecords: 1200, StoreBytes: 3_600_000, Result: Result{Finished: 1000, PerSec: 500}},
			// The store's bytes are per record: the warm-up's calls are
			// in its tables, not in Finished.
			want: RunReport{CPUPerCall: 3 * time.Millisecond, HarnessCPUPerCall: time.Millisecond, MachineCPUPerCall: 5 * time.Millisecond, StoreCPUPerCall: 2 * time.Millisecond, KafkaCPUPerCall: 700 * time.Microsecond,
				PeakRSSPerCall: float64(300<<20) / 1000, PerSecPerExecutor: 125, PerSecPerLedgerCPU: 1000.0 / 3, StoreBytesPerCall: 3000},
		},
		{
			name: "no calls finished",
			in:   RunReport{Executors: 2, LedgerCPU: time.Second, HarnessCPU: time.Second, PeakRSS: 1 << 20},
			want: RunReport{},
		},
		{
			name: "nothing measured",
			in:   RunReport{},
			want: RunReport{},
		},
		{
			name: "calls without ledger CPU or executors",
			in:   RunReport{Result: Result{Finished: 10, PerSec: 5}},
			want: RunReport{},
		},
	}
	derived := cmp.Transformer("derived", func(r RunReport) [9]float64 {
		return [9]float64{float64(r.CPUPerCall), float64(r.HarnessCPUPerCall), float64(r.MachineCPUPerCall), r.PeakRSSPerCall, r.PerSecPerExecutor, r.PerSecPerLedgerCPU, float64(r.StoreCPUPerCall), r.StoreBytesPerCall, float64(r.KafkaCPUPerCall)}
	})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.in
			got.Derive()
			if diff := cmp.Diff(tc.want, got, derived, cmpopts.EquateApprox(1e-12, 0)); diff != "" {
				t.Errorf("Derive (-want +got) as [cpu/call, harness cpu/call, machine cpu/call, rss/call, /s/executor, /ledger cpu s, store cpu/call, store bytes/call, kafka cpu/call]:\n%s", diff)
			}
			for _, v := range []float64{got.PeakRSSPerCall, got.PerSecPerExecutor, got.PerSecPerLedgerCPU} {
				if math.IsNaN(v) || math.IsInf(v, 0) {
					t.Errorf("Derive made %v: %+v", v, got)
				}
			}
		})
	}
}

func TestReportFailures(t *testing.T) {
	clean := RunReport{Name: "clean", Witness: Witness{Effects: 10, Reads: 5, Replays: 3, Orphans: 2}}
	cases := []struct {
		name string
		runs []RunReport
		want []string // each failure holds all of these
	}{
		{name: "no runs"},
		{name: "clean, orphans and replays included", runs: []RunReport{clean}},
		{
			name: "duplicates",
			runs: []RunReport{clean, {Name: "dup run", Witness: Witness{Duplicates: 2}}},
			want: []string{"dup run: 2 duplicate effects"},
		},
		{
			name: "missing",
			runs: []RunReport{{Name: "miss run", Witness: Witness{Missing: 3}}},
			want: []string{"miss run: 3 calls succeeded without an effect"},
		},
		{
			name: "lost",
			runs: []RunReport{{Name: "lost run", Result: Result{Lost: 4}}},
			want: []string{"lost run: 4 calls lost"},
		},
		{
			name: "an attempt sent twice",
			runs: []RunReport{{Name: "sent run", Witness: Witness{Replays: 2, DuplicateSends: 1}}},
			want: []string{"sent run: 1 calls with an attempt sent to the tool twice"},
		},
		{
			// Counted in calls/s though they never ran.
			name: "calls that did not succeed",
			runs: []RunReport{{Name: "refused run", Result: Result{Finished: 10, ByState: map[string]int64{"succeeded": 7, "denied": 2, "expired": 1}}}},
			want: []string{"refused run: 3 calls did not succeed (denied 2, expired 1)"},
		},
		{
			name: "a clean run's warm-up",
			runs: []RunReport{{Name: "warm run", Result: Result{Finished: 5, ByState: map[string]int64{"succeeded": 5}},
				Warmup: &Warmup{Result: Result{Lost: 1}, Witness: Witness{Duplicates: 1}}}},
			want: []string{"warm run (warm-up): 1 duplicate effects", "warm run (warm-up): 1 calls lost"},
		},
		{
			name: "everything in one run, then another",
			runs: []RunReport{
				{Name: "bad", Witness: Witness{Duplicates: 1, Missing: 1}, Result: Result{Lost: 1}},
				clean,
				{Name: "bad too", Result: Result{Lost: 7}},
			},
			want: []string{"bad: 1 duplicate effects", "bad: 1 calls succeeded without an effect", "bad: 1 calls lost", "bad too: 7 calls lost"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := Report{Runs: tc.runs}.Failures()
			if len(got) != len(tc.want) {
				t.Fatalf("Failures = %q; want %d failures like %q", got, len(tc.want), tc.want)
			}
			for i := range got {
				if !strings.HasPrefix(got[i], tc.want[i]) {
					t.Errorf("failure %d = %q; want it to start %q", i, got[i], tc.want[i])
				}
			}
		})
	}
}

func TestReportWriteJSON(t *testing.T) {
	want := repReport()
	var buf bytes.Buffer
	if err := want.WriteJSON(&buf); err != nil {
		t.Fatalf("WriteJSON: %v", err)
	}
	var got Report
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatalf("decode %s: %v", buf.Bytes(), err)
	}
	if diff := cmp.Diff(want, got, cmpopts.IgnoreUnexported(Result{})); diff != "" {
		t.Errorf("round trip (-want +got):\n%s", diff)
	}
	// The names a reader of the file (or a script comparing runs) keys
	// on.
	var raw map[string]any
	if err := json.Unmarshal(buf.Bytes(), &raw); err != nil {
		t.Fatal(err)
	}
	run := raw["runs"].([]any)[0].(map[string]any)
	res := run["result"].(map[string]any)
	wit := run["witness"].(map[string]any)
	for _, c := range []struct {
		obj  map[string]any
		name string
	}{
		{raw, "machine"}, {raw, "direct"}, {raw, "limits"}, {raw, "backend_latency_ns"},
		{run, "ledger_cpu_per_call_ns"}, {run, "machine_cpu_per_call_ns"}, {run, "calls_per_sec_per_executor"}, {run, "store_retries"},
		{res, "calls_per_sec"}, {res, "lost"}, {res, "e2e"}, {res, "added"}, {res, "by_state"}, {res, "elapsed_ns"}, {res, "stages"},
		{wit, "duplicate_effects"}, {wit, "missing_effects"}, {wit, "orphan_effects"},
	} {
		if _, ok := c.obj[c.name]; !ok {
			t.Errorf("JSON lacks %q", c.name)
		}
	}
	if got := res["e2e"].(map[string]any)["p99_ns"]; got != float64(8*time.Millisecond) {
		t.Errorf("result.e2e.p99_ns = %v; want %d (nanoseconds)", got, 8*time.Millisecond)
	}
	if !strings.HasSuffix(buf.String(), "}\n") || !strings.Contains(buf.String(), "\n  \"machine\"") {
		t.Errorf("WriteJSON output is not indented JSON ending in a newline:\n%s", buf.String())
	}

	// Optional parts stay out when unset.
	buf.Reset()
	if err := (Report{}).WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{`"direct"`, `"limits"`} {
		if strings.Contains(buf.String(), name) {
			t.Errorf("empty report's JSON has %s:\n%s", name, buf.String())
		}
	}
}

func TestReportWriteTable(t *testing.T) {
	rep := repReport()
	var buf bytes.Buffer
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatalf("WriteTable: %v", err)
	}
	out := buf.String()
	for _, want := range []string{
		"machine: Test CPU @ 3.00GHz, 8 cores, 16 GB, go1.26 linux/amd64",
		"kafka: kfake (1 broker); store: embedded; mix: get_weather=3,create_ticket=1; 8 tenants; concurrency 64; backend latency 2ms",
		"ledger", "open 500/s", "open 500/s (saturated)",
		"direct to backend",
		"raw limit", "kafka_txn_consume_produce", "store_claims", "store_complete", "records copied",
		// main run 500/s against direct 2000/s
		"ledger / direct: 25%",
		// slowest: Kafka 20000 records/s / 4 events a call = 5000 calls/s
		// is above claims 2500/s; store_complete (500/s) is not a bound.
		"ledger / slowest raw limit (store_claims): 20%",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	// The run rows, cell by cell: the main run and the direct floor.
	rows := repRows(out)
	if diff := cmp.Diff([]string{"ledger", "closed", "2", "1000", "500", "3.0", "5.0", "8.0", "13.0", "2.0", "7.0", "3000", "1000", "2000", "6000", "200", "0", "0", "12.5", "500"}, rows["ledger"]); diff != "" {
		t.Errorf("ledger row (-want +got):\n%s\n%s", diff, out)
	}
	if diff := cmp.Diff([]string{"direct", "to", "backend", "(lost:", "errors)", "closed", "-", "1000", "2000", "1.0", "2.0", "3.0", "4.0", "-", "-", "-", "-", "-", "-", "-", "-", "2", "-", "-"}, rows["direct"]); diff != "" {
		t.Errorf("direct row (-want +got):\n%s\n%s", diff, out)
	}
	if row := rows["open"]; len(row) < 7 || row[len(row)-4] != "2" || row[len(row)-3] != "3" || row[len(row)-2] != "-" || row[len(row)-1] != "-" || row[len(row)-6] != "-" || row[len(row)-7] != "-" {
		t.Errorf("open row %q; want store and machine CPU - (not measured), then dup 2 and lost 3, then stolen and kafka - (the machine not read, no kafka process)", row)
	}
	// The store's footprint: only the run that measured it.
	if i := strings.Index(out, "the store's tables at the end of each run"); i < 0 {
		t.Errorf("table lacks the store's footprint:\n%s", out)
	} else if sect, _, _ := strings.Cut(out[i:], "\n\n"); !strings.Contains(strings.Join(strings.Fields(sect), " "), "ledger 1500 4.0 2796") || strings.Contains(sect, "open 500/s") {
		t.Errorf("footprint section %q; want the main run's 1500 records, 4.0 MB, 2796 bytes a call, and no other run", sect)
	}
	// Where the time goes: a row per run, p50 / p99 of each stage.
	if !strings.Contains(out, "where the time goes") {
		t.Errorf("table lacks the stages:\n%s", out)
	}
	var staged [][]string
	for line := range strings.SplitSeq(out[strings.Index(out, "where the time goes"):], "\n") {
		c := strings.Fields(line)
		if len(c) == 0 {
			break // the table's end
		}
		if c[0] == "ledger" || c[0] == "open" {
			staged = append(staged, c)
		}
	}
	want := [][]string{
		{"ledger", "closed", "999", "1.1", "/", "2.5", "0.4", "/", "1.2", "1.0", "/", "2.0", "0.5", "/", "1.5", "7", "(claim", "5,", "complete", "2)"},
		{"open", "500/s", "open", "500/s", "(saturated)", "999", "1.1", "/", "2.5", "0.4", "/", "1.2", "1.0", "/", "2.0", "0.5", "/", "1.5", "-"},
	}
	if diff := cmp.Diff(want, staged); diff != "" {
		t.Errorf("stage rows (-want +got):\n%s\n%s", diff, out)
	}

	// Resends after refusals for now: a line for the run that had them.
	if strings.Contains(out, "refused for now") {
		t.Errorf("table of runs without resends speaks of them:\n%s", out)
	}
	rep.Runs[0].Result.RetriedLater = 3
	rep.Runs[0].Result.RetryReasons = map[string]int64{"rate_limited": 1, "policy_timeout": 2}
	buf.Reset()
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatalf("WriteTable: %v", err)
	}
	if want := "ledger: 3 envelopes refused for now and submitted again after the wait they named (policy_timeout 2, rate_limited 1)\n"; !strings.Contains(buf.String(), want) || strings.Count(buf.String(), "refused for now") != 1 {
		t.Errorf("table lacks, once, %q:\n%s", want, buf.String())
	}

	// Without the direct floor, the limits and the stages, neither their
	// rows nor their ratios.
	rep.Direct, rep.Limits = nil, nil
	for i := range rep.Runs {
		rep.Runs[i].Result.Stages = Stages{}
	}
	buf.Reset()
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatalf("WriteTable: %v", err)
	}
	for _, absent := range []string{"direct to backend", "raw limit", "ledger / direct", "slowest raw limit", "where the time goes"} {
		if strings.Contains(buf.String(), absent) {
			t.Errorf("table without direct and limits has %q:\n%s", absent, buf.String())
		}
	}

	// A report with no run writes its header and no ratio (no run to
	// divide).
	buf.Reset()
	if err := (Report{Direct: &DirectReport{PerSec: 10}}).WriteTable(&buf); err != nil {
		t.Fatalf("WriteTable of an empty report: %v", err)
	}
	if strings.Contains(buf.String(), "ledger / direct") {
		t.Errorf("table with no run has a ratio:\n%s", buf.String())
	}
}

// A ledger the benchmark did not start (ledger bench --attach): the
// report says so, its executors and, with no process measured, its CPU
// and memory read "-", and a note on the direct floor goes under the
// table.
func TestReportWriteTableAttached(t *testing.T) {
	rep := repReport()
	rep.Attached = "requests r, events e, tools http://tools"
	rep.Direct.Note = "these went to a demo backend of the bench's own"
	rep.Runs = rep.Runs[:1]
	rep.Runs[0].Executors, rep.Runs[0].Processes, rep.Runs[0].LedgerCPU, rep.Runs[0].PeakRSS = 0, 0, 0, 0
	rep.Runs[0].Derive()
	var buf bytes.Buffer
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{
		"ledger: already running, not started by the benchmark (requests r, events e, tools http://tools)",
		"direct: these went to a demo backend of the bench's own",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	// exec, then after the latencies CPU µs/call, and peak RSS.
	row := repRows(out)["ledger"]
	if len(row) != 20 || row[2] != "-" || row[11] != "-" || row[15] != "-" || row[12] != "1000" || row[14] != "6000" {
		t.Errorf("ledger row %q; want exec, CPU and peak RSS -, the harness's and the machine's figures kept\n%s", row, out)
	}
	// With its processes named, their figures are shown.
	rep.Runs[0].Processes, rep.Runs[0].LedgerCPU, rep.Runs[0].PeakRSS = 1, 3*time.Second, 200<<20
	rep.Runs[0].Derive()
	buf.Reset()
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	if row := repRows(buf.String())["ledger"]; len(row) != 20 || row[2] != "-" || row[11] != "3000" || row[15] != "200" {
		t.Errorf("ledger row %q; want exec -, CPU 3000 and peak RSS 200", row)
	}
}

// repRows splits the table's lines into cells, by the first cell (the
// first word of a run's name).
func repRows(out string) map[string][]string {
	rows := make(map[string][]string)
	for line := range strings.SplitSeq(out, "\n") {
		cells := strings.Fields(line)
		if len(cells) > 0 {
			if _, ok := rows[cells[0]]; !ok {
				rows[cells[0]] = cells
			}
		}
	}
	return rows
}

// repFailWriter fails every write.
type repFailWriter struct{ err error }

func (w repFailWriter) Write([]byte) (int, error) { return 0, w.err }

func TestReportSideBySide(t *testing.T) {
	run := func(name, build string, perSec float64, p99 time.Duration, ledgerUS, storeUS int64) RunReport {
		r := RunReport{Name: name, Build: build, Executors: 1,
			Result:     Result{Mode: "closed", Finished: 1000, PerSec: perSec, E2E: Percentiles{P50: p99 / 2, P99: p99}},
			LedgerCPU:  time.Duration(ledgerUS*1000) * time.Microsecond,
			StoreCPU:   time.Duration(storeUS*1000) * time.Microsecond,
			MachineCPU: time.Duration((ledgerUS+storeUS)*1000) * time.Microsecond}
		// The harness, the same code for both builds, slowed with the
		// machine: 100 µs a call for the baseline's runs, 110 for this
		// build's.
		r.HarnessCPU = 100 * time.Millisecond
		if build == "" {
			r.HarnessCPU = 110 * time.Millisecond
		}
		// The broker's process: 50 µs a call for either build.
		r.KafkaCPU = 50 * time.Millisecond
		// The hypervisor took 2% of the machine from the baseline's
		// runs and 8% from this build's.
		r.Stolen = 0.02
		if build == "" {
			r.Stolen = 0.08
		}
		r.Derive()
		return r
	}
	rep := Report{Baseline: "bin/ledger-base", Runs: []RunReport{
		run("baseline #1", "baseline", 1000, 200*time.Millisecond, 300, 100),
		run("ledger #1", "", 1300, 150*time.Millisecond, 240, 90),
		run("ledger #2", "", 900, 300*time.Millisecond, 260, 70),
		run("baseline #2", "baseline", 1100, 100*time.Millisecond, 320, 100),
		// A sweep's run of this build is not a pair's.
		run("open 500/s", "", 500, time.Millisecond, 10, 10),
	}}
	rep.Runs[4].Result.Mode = "open"
	var buf bytes.Buffer
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	_, side, ok := strings.Cut(out, "side by side, medians of 2 runs each, builds alternating (baseline: bin/ledger-base):")
	if !ok {
		t.Fatalf("no side-by-side table:\n%s", out)
	}
	// Medians: calls/s 1050 against 1100; p99 150 against 225 ms; ledger
	// 310 against 250 µs; store 100 against 80; machine 410 against 330.
	// Pairs: #1 1000 against 1300 calls/s, #2 1100 against 900.
	for _, want := range [][]string{
		{"calls/s", "1050.0", "1100.0", "+4.8%", "1 of 2 pairs"},
		{"e2e p99 ms", "150.0", "225.0", "+50.0%", "1 of 2 pairs"},
		{"ledger CPU µs/call", "310.0", "250.0", "-19.4%", "2 of 2 pairs"},
		{"store µs/call", "100.0", "80.0", "-20.0%", "2 of 2 pairs"},
		{"machine µs/call", "410.0", "330.0", "-19.5%", "2 of 2 pairs"},
		{"harness µs/call", "100.0", "110.0", "+10.0%", "0 of 2 pairs"},
		{"kafka µs/call", "50.0", "50.0", "+0.0%", "0 of 2 pairs"},
		{"stolen %", "2.0", "8.0", "+6.0 pp", "-"},
	} {
		if !regexp.MustCompile(`(?m)^\s*` + regexp.QuoteMeta(want[0]) + `\s+` + regexp.QuoteMeta(want[1]) + `\s+` + regexp.QuoteMeta(want[2]) + `\s+` + regexp.QuoteMeta(want[3]) + `\s+` + regexp.QuoteMeta(want[4]) + `\s*$`).MatchString(side) {
			t.Errorf("side-by-side table lacks %v:\n%s", want, side)
		}
	}
	if !strings.Contains(side, "its change, +10.0%, is the machine's drift") {
		t.Errorf("side-by-side table does not read the harness as the control:\n%s", side)
	}
	if !strings.Contains(side, "the hypervisor took 2.0% and 8.0% of the machine's CPU time") {
		t.Errorf("side-by-side table does not say what the hypervisor took from each build's runs:\n%s", side)
	}
	// With the broker in the harness, whose work each build makes, the
	// harness is no clean control, and the note says so.
	inHarness := rep
	inHarness.KafkaInHarness = true
	buf.Reset()
	if err := inHarness.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	if out := buf.String(); strings.Contains(out, "a change no larger is noise") || !strings.Contains(out, "is the machine's drift only roughly; --kafka-process") {
		t.Errorf("with Kafka in the harness, the side-by-side table still reads the harness as a clean control:\n%s", out)
	}
	// The ratios to the floor come from this build's first run.
	rep.Direct = &DirectReport{Calls: 10, PerSec: 2600}
	buf.Reset()
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), "ledger / direct: 50%") {
		t.Errorf("ratio to the floor not from this build's first run:\n%s", buf.String())
	}
	// Pairs run open loop (--rate) compare alike, and have no ratio to
	// the floor: their rate is the one offered, not what the ledger
	// carries.
	for i := range 4 {
		rep.Runs[i].Result.Mode = "open"
	}
	buf.Reset()
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(buf.String(), "ledger / direct") {
		t.Errorf("open-loop runs have a ratio to the floor:\n%s", buf.String())
	}
	if !strings.Contains(buf.String(), "side by side, medians of 2 runs each") {
		t.Errorf("no side-by-side table for open-loop pairs:\n%s", buf.String())
	}
	// Without a baseline's runs, no such table; without the store's CPU,
	// no such row.
	rep = Report{Runs: []RunReport{run("ledger", "", 1000, time.Millisecond, 100, 0)}}
	buf.Reset()
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(buf.String(), "side by side") {
		t.Errorf("side-by-side table without a baseline:\n%s", buf.String())
	}
	rep.Runs = append(rep.Runs, run("baseline #1", "baseline", 1000, time.Millisecond, 100, 0))
	rep.Runs[0].Name = "ledger #1"
	buf.Reset()
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	_, side, ok = strings.Cut(buf.String(), "side by side")
	if !ok || !strings.Contains(side, "machine µs/call") || strings.Contains(side, "store µs/call") {
		t.Errorf("want the side-by-side table without a store row:\n%s", buf.String())
	}
}

func TestReportWriteErrors(t *testing.T) {
	boom := errors.New("disk full")
	if err := repReport().WriteTable(repFailWriter{boom}); !errors.Is(err, boom) {
		t.Errorf("WriteTable to a failing writer = %v; want %v", err, boom)
	}
	if err := repReport().WriteJSON(repFailWriter{boom}); !errors.Is(err, boom) {
		t.Errorf("WriteJSON to a failing writer = %v; want %v", err, boom)
	}
}

func TestReportSlowestLimit(t *testing.T) {
	cases := []struct {
		name    string
		limits  []Limit
		perCall float64
		limit   string
	}{
		{name: "none"},
		{
			name:    "kafka divided by the events a call appends",
			limits:  []Limit{{Name: "kafka_txn_consume_produce", PerSec: 4000}, {Name: "store_claims", PerSec: 1500}},
			perCall: 1000, limit: "kafka_txn_consume_produce",
		},
		{
			name:    "claims slower than kafka per call",
			limits:  []Limit{{Name: "kafka_txn_consume_produce", PerSec: 8000}, {Name: "store_claims", PerSec: 1500}},
			perCall: 1500, limit: "store_claims",
		},
		{
			name:    "store_complete never bounds",
			limits:  []Limit{{Name: "store_complete", PerSec: 1}, {Name: "store_claims", PerSec: 1500}},
			perCall: 1500, limit: "store_claims",
		},
		{
			name:   "store_complete alone",
			limits: []Limit{{Name: "store_complete", PerSec: 1}},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			perCall, name := Report{Limits: tc.limits}.slowestLimit()
			if perCall != tc.perCall || name != tc.limit {
				t.Errorf("slowestLimit = %v, %q; want %v, %q", perCall, name, tc.perCall, tc.limit)
			}
		})
	}
	// slowestLimit switches on literal names: they must be the names
	// the limits are measured under.
	if limitNameKafka != "kafka_txn_consume_produce" || limitNameComplete != "store_complete" {
		t.Errorf("limit names %q, %q differ from those slowestLimit expects", limitNameKafka, limitNameComplete)
	}
}

func TestThisMachine(t *testing.T) {
	m := ThisMachine()
	if m.Cores != runtime.NumCPU() || m.Go != runtime.Version() || m.OS != runtime.GOOS+"/"+runtime.GOARCH {
		t.Errorf("ThisMachine = %+v; want cores %d, %s, %s/%s", m, runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
	}
	if m.CPU == "" {
		t.Errorf("ThisMachine CPU is empty; want a model or \"unknown\"")
	}
	if runtime.GOOS == "linux" && m.MemoryGB <= 0 {
		t.Errorf("ThisMachine MemoryGB = %d on Linux; want it read from /proc/meminfo", m.MemoryGB)
	}
}

func TestReportCheckSLO(t *testing.T) {
	open := func(rate float64, p99 time.Duration) RunReport {
		return RunReport{Name: fmt.Sprintf("open %g/s", rate), Result: Result{Mode: "open", Offered: rate, Finished: 100, Added: Percentiles{P99: p99}}}
	}
	lost, saturated, baseline := open(1500, 10*time.Millisecond), open(1500, 10*time.Millisecond), open(500, time.Second)
	lost.Result.Lost = 1
	saturated.Result.Saturated = true
	baseline.Build = "baseline"
	closed := RunReport{Name: "ledger", Result: Result{Mode: "closed", Finished: 100, Added: Percentiles{P99: time.Second}}}
	ms := time.Millisecond
	for _, tc := range []struct {
		name string
		runs []RunReport
		slo  time.Duration
		want *SLO
		line string
	}{
		{
			// Rates in any order; 2,000/s under the bound again does not
			// count once 1,500/s broke it.
			name: "held up to a rate",
			runs: []RunReport{closed, open(1500, 70*ms), open(500, 20*ms), open(2000, 45*ms), open(1000, 40*ms)},
			slo:  50 * ms, want: &SLO{AddedP99: 50 * ms, Held: 1000, BrokenAt: 1500, BrokenP99: 70 * ms, BrokenBy: "added p99 70.0 ms"},
			line: "added p99 under 50ms: up to 1000/s offered (at 1500/s: added p99 70.0 ms)",
		},
		{
			name: "held everywhere",
			runs: []RunReport{open(500, 20*ms), open(1000, 49*ms), baseline},
			slo:  50 * ms, want: &SLO{AddedP99: 50 * ms, Held: 1000},
			line: "added p99 under 50ms: at every rate offered, up to 1000/s",
		},
		{
			// The bound is strict: a p99 at it does not hold.
			name: "held nowhere",
			runs: []RunReport{open(500, 50*ms), open(1000, 20*ms)},
			slo:  50 * ms, want: &SLO{AddedP99: 50 * ms, BrokenAt: 500, BrokenP99: 50 * ms, BrokenBy: "added p99 50.0 ms"},
			line: "added p99 under 50ms: at none of the rates offered (at 500/s: added p99 50.0 ms)",
		},
		{
			// Two runs at one rate (pairs of an open-loop main run): the
			// worst decides; a lost call or a saturated loop breaks it
			// whatever the latency.
			name: "the worst run at a rate",
			runs: []RunReport{open(500, 20*ms), open(1000, 10*ms), open(1000, 30*ms), lost, open(2000, 10*ms)},
			slo:  50 * ms, want: &SLO{AddedP99: 50 * ms, Held: 1000, BrokenAt: 1500, BrokenP99: 10 * ms, BrokenBy: "calls lost: 1"},
			line: "added p99 under 50ms: up to 1000/s offered (at 1500/s: calls lost: 1)",
		},
		{
			name: "saturated",
			runs: []RunReport{saturated},
			slo:  50 * ms, want: &SLO{AddedP99: 50 * ms, BrokenAt: 1500, BrokenP99: 10 * ms, BrokenBy: "could not keep up with the arrivals"},
			line: "added p99 under 50ms: at none of the rates offered (at 1500/s: could not keep up with the arrivals)",
		},
		{name: "no bound", runs: []RunReport{open(500, 20*ms)}, slo: 0},
		{name: "no open loop of this build", runs: []RunReport{closed, baseline}, slo: 50 * ms},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := Report{Runs: tc.runs}
			rep.CheckSLO(tc.slo)
			if diff := cmp.Diff(tc.want, rep.SLO); diff != "" {
				t.Errorf("SLO (-want +got):\n%s", diff)
			}
			var buf bytes.Buffer
			if err := rep.WriteTable(&buf); err != nil {
				t.Fatal(err)
			}
			if got := strings.Contains(buf.String(), "added p99 under"); got != (tc.want != nil) {
				t.Errorf("table has the SLO line: %v; want %v:\n%s", got, tc.want != nil, buf.String())
			}
			if tc.line != "" && !strings.Contains(buf.String(), tc.line+"\n") {
				t.Errorf("table lacks %q:\n%s", tc.line, buf.String())
			}
		})
	}
}
