package loadtest

import (
	"bytes"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/processors/demobackend"
)

// TestRunTimeline checks that the timeline accounts for the whole run:
// its intervals add up to the run's submissions and finishes, their
// longest call is the run's, the stages carry the tool's delay, and the
// usage is what Config.Usage's totals grew by in each interval.
func TestRunTimeline(t *testing.T) {
	l := drvNewLedger(t, true)
	const toolTime = 20 * time.Millisecond
	l.backend.SetFault("create_ticket", demobackend.Fault{Latency: toolTime})
	cfg := l.config("create_ticket", "rtimeline")
	cfg.Calls, cfg.Rate = 300, 200
	cfg.TimelineEvery = 250 * time.Millisecond
	// Each reading is 10 ms of ledger CPU more than the one before, so
	// that every interval's share is exactly 10 ms whatever its length.
	var readings atomic.Int64
	cfg.Usage = func() Usage {
		n := time.Duration(readings.Add(1))
		return Usage{Ledger: n * 10 * time.Millisecond, Harness: n * time.Millisecond, HarnessGC: n * time.Microsecond, IntakeLoop: n * 2 * time.Millisecond, ExecutorLoops: n * 3 * time.Millisecond,
			IntakeSteps: int64(n) * 4, ExecutorSteps: int64(n) * 5}
	}
	res, err := l.run(cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if res.Finished != 300 {
		t.Fatalf("Finished = %d; want 300", res.Finished)
	}
	tl := res.Timeline
	// 300 calls at 200/s arrive over 1.5 s: at least six intervals of
	// 250 ms, and one more for the drain's end.
	if len(tl) < 6 {
		t.Fatalf("Timeline has %d intervals; want at least 6 for a run of 1.5 s in intervals of 250 ms", len(tl))
	}
	if got := int64(len(tl)); got+1 != readings.Load() {
		t.Errorf("Usage read %d times for %d intervals; want once at the start and once an interval", readings.Load(), got)
	}
	var submitted, finished int64
	var longest time.Duration
	var prev time.Duration
	for i, iv := range tl {
		if iv.End <= prev {
			t.Errorf("interval %d ends at %v, not after the one before (%v)", i, iv.End, prev)
		}
		prev = iv.End
		submitted += iv.Submitted
		finished += iv.Finished
		longest = max(longest, iv.E2E.Max)
		want := Usage{Ledger: 10 * time.Millisecond, Harness: time.Millisecond, HarnessGC: time.Microsecond, IntakeLoop: 2 * time.Millisecond, ExecutorLoops: 3 * time.Millisecond, IntakeSteps: 4, ExecutorSteps: 5}
		if iv.Usage == nil || *iv.Usage != want {
			t.Errorf("interval %d Usage = %+v; want %+v, what the totals grew by", i, iv.Usage, want)
		}
		if iv.Finished == 0 {
			if iv.E2E != (Percentiles{}) || iv.CallP99 != 0 {
				t.Errorf("interval %d finished nothing but has latencies %+v, call p99 %v", i, iv.E2E, iv.CallP99)
			}
			continue
		}
		if iv.CallP99 < toolTime {
			t.Errorf("interval %d: call p99 %v; want at least the tool's %v", i, iv.CallP99, toolTime)
		}
		for name, p := range map[string]time.Duration{"intake": iv.IntakeP99, "claim": iv.ClaimP99, "call": iv.CallP99, "record": iv.RecordP99} {
			if p > iv.E2E.Max {
				t.Errorf("interval %d: %s p99 %v > e2e max %v; a part is never longer than the whole", i, name, p, iv.E2E.Max)
			}
		}
	}
	if submitted != res.Submitted || finished != res.Finished {
		t.Errorf("intervals add up to %d submitted, %d finished; the run has %d, %d", submitted, finished, res.Submitted, res.Finished)
	}
	if longest != res.E2E.Max {
		t.Errorf("longest call in the intervals %v; the run's is %v", longest, res.E2E.Max)
	}
	if last := tl[len(tl)-1]; last.End < res.Elapsed || last.InFlight != 0 {
		t.Errorf("last interval ends at %v with %d in flight; want at or after the last finish (%v) with none", last.End, last.InFlight, res.Elapsed)
	}
}

func TestReportWriteTimeline(t *testing.T) {
	rep := Report{Runs: []RunReport{
		{Name: "no timeline"},
		{Name: "ledger", Build: "baseline", Result: Result{Timeline: []Interval{
			{
				End: time.Second, Submitted: 2500, Finished: 2400, InFlight: 100,
				E2E:       Percentiles{P50: 20 * time.Millisecond, P99: 40 * time.Millisecond, Max: 45 * time.Millisecond},
				IntakeP99: 9 * time.Millisecond, ClaimP99: 11 * time.Millisecond, CallP99: 3 * time.Millisecond, RecordP99: 12 * time.Millisecond,
				Usage: &Usage{Ledger: 750 * time.Millisecond, Store: 500 * time.Millisecond, Harness: 400 * time.Millisecond, HarnessGC: 100 * time.Millisecond, Kafka: 300 * time.Millisecond, Machine: 1700 * time.Millisecond, Stolen: 200 * time.Millisecond,
					IntakeLoop: 980 * time.Millisecond, ExecutorLoops: 1600 * time.Millisecond, IntakeSteps: 98, ExecutorSteps: 40},
			},
			// Half a second: the CPU is divided by the interval's own length.
			{End: 1500 * time.Millisecond, Finished: 100, Usage: &Usage{Ledger: 250 * time.Millisecond}},
			{End: 2 * time.Second},
			// Too short for /proc's 10 ms ticks to say anything.
			{End: 2050 * time.Millisecond, Usage: &Usage{Ledger: 10 * time.Millisecond}},
		}}},
	}}
	var buf bytes.Buffer
	if err := rep.WriteTimeline(&buf); err != nil {
		t.Fatalf("WriteTimeline: %v", err)
	}
	out := buf.String()
	if strings.Contains(out, "no timeline") {
		t.Errorf("a run without a timeline got a table:\n%s", out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 6 {
		t.Fatalf("got %d lines; want a title, a header and four rows:\n%s", len(lines), out)
	}
	if !strings.Contains(lines[0], "timeline of ledger (") {
		t.Errorf("title %q does not name the run", lines[0])
	}
	for i, want := range [][]string{
		{"1.0", "2500", "2400", "100", "20.0", "40.0", "45.0", "9.0", "11.0", "3.0", "12.0", "0.75", "0.50", "0.40", "0.10", "0.30", "1.70", "0.20", "0.98", "1.60", "10.0", "40.0"},
		{"1.5", "0", "100", "0", "0.0", "0.0", "0.0", "0.0", "0.0", "0.0", "0.0", "0.50", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"},
		{"2.0", "0", "0", "0", "0.0", "0.0", "0.0", "0.0", "0.0", "0.0", "0.0", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"},
		{"2.0", "0", "0", "0", "0.0", "0.0", "0.0", "0.0", "0.0", "0.0", "0.0", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"},
	} {
		if got := strings.Fields(lines[2+i]); strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("row %d = %q; want %q", i, got, want)
		}
	}
}
