package console

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

type flushRecorder struct {
	*httptest.ResponseRecorder
	flushes int
}

func (f *flushRecorder) Flush() { f.flushes++ }

func newTestRecorder() *httptest.ResponseRecorder { return httptest.NewRecorder() }

var _ http.Flusher = (*flushRecorder)(nil)

func TestBucketFor(t *testing.T) {
	for _, tc := range []struct {
		window, want time.Duration
	}{
		{30 * time.Minute, time.Minute},
		{time.Hour, time.Minute},
		{2 * time.Hour, 5 * time.Minute},
		{6 * time.Hour, 15 * time.Minute},
		{24 * time.Hour, 30 * time.Minute},
		{7 * 24 * time.Hour, 3 * time.Hour},
		{30 * 24 * time.Hour, 12 * time.Hour},
		{40 * 24 * time.Hour, 24 * time.Hour},
		{60 * 7 * 24 * time.Hour, 7 * 24 * time.Hour},
		// Past 60 weeks, as many weeks as 60 bars need.
		{61 * 7 * 24 * time.Hour, 2 * 7 * 24 * time.Hour},
		{5 * 365 * 24 * time.Hour, 5 * 7 * 24 * time.Hour},
	} {
		if got := bucketFor(tc.window); got != tc.want {
			t.Errorf("bucketFor(%v) = %v; want %v", tc.window, got, tc.want)
		}
	}
}

// A window of two years is drawn whole: its last week's outcomes are in
// a bar and in the total. Before, its bars were weeks, cut at 61, and the
// latest ten months were left out without a word.
func TestLongWindowDrawnWhole(t *testing.T) {
	until := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	since := until.Add(-2 * 365 * 24 * time.Hour)
	bucket := bucketFor(until.Sub(since))
	last := projections.BucketOf(until.Add(-time.Hour), bucket)
	h := drawHistogram([]projections.OutcomeCount{{Bucket: last, Tool: "a", State: statemachine.StateSucceeded, Calls: 3}}, since, until, bucket)
	if h.Total != 3 {
		t.Errorf("total = %d; want 3, the last week's", h.Total)
	}
	if n := len(h.Bars); n == 0 || n > maxBuckets+1 || len(h.Bars[n-1].Segs) != 1 {
		t.Errorf("%d bars, the last %+v; want at most %d, the last holding the last week's outcomes", n, h.Bars[max(n-1, 0)], maxBuckets+1)
	}
}

// The chart's window starts where its first bucket does, as the counts
// it draws do: asked from 12:37 by the hour, it says from 12:00. Before,
// it said 12:37 over counts that held 12:00 to 12:37 too.
func TestHistogramStartsAtItsFirstBucket(t *testing.T) {
	since := time.Date(2026, 11, 30, 12, 37, 12, 0, time.UTC)
	h := drawHistogram(nil, since, since.Add(2*time.Hour), time.Hour)
	if want := fmtTime(time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)); h.From != want {
		t.Errorf("chart from %q; want %q, its first bucket's start", h.From, want)
	}
}

func TestDrawHistogram(t *testing.T) {
	since := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	until := since.Add(time.Hour)
	bucket := 5 * time.Minute
	counts := []projections.OutcomeCount{
		{Bucket: since, Tool: "a", State: statemachine.StateSucceeded, Calls: 6},
		{Bucket: since, Tool: "b", State: statemachine.StateSucceeded, Calls: 2},
		{Bucket: since, Tool: "a", State: statemachine.StateFailed, Calls: 2},
		{Bucket: since.Add(30 * time.Minute), Tool: "a", State: "weird", Calls: 5},
		{Bucket: since.Add(-time.Hour), Tool: "a", State: statemachine.StateFailed, Calls: 99}, // outside
	}
	h := drawHistogram(counts, since, until, bucket)
	if len(h.Bars) != 12 {
		t.Fatalf("bars = %d; want 12 five-minute buckets in an hour", len(h.Bars))
	}
	if h.Total != 15 {
		t.Errorf("total = %d; want 15 (the count outside the window left out)", h.Total)
	}
	first := h.Bars[0]
	if len(first.Segs) != 2 || first.Segs[0].Class != "st-succeeded" || first.Segs[1].Class != "st-failed" {
		t.Fatalf("first bar segments %+v; want succeeded then failed", first.Segs)
	}
	// The axis tops at 10: succeeded 8 of 10, failed 2 of 10 of the plot.
	if h.YTicks[2].Label != "10" {
		t.Errorf("axis top %q; want 10", h.YTicks[2].Label)
	}
	if got, want := first.Segs[0].H, 8*h.PlotH/10; got != want {
		t.Errorf("succeeded height %d; want %d", got, want)
	}
	if first.Segs[0].Y+first.Segs[0].H != h.AxisY || first.Segs[1].Y+first.Segs[1].H != first.Segs[0].Y {
		t.Errorf("segments do not stack on the axis: %+v (axis %d)", first.Segs, h.AxisY)
	}
	if first.Title != "2026-11-30 12:00:00 UTC (5 minutes): 8 succeeded, 2 failed" {
		t.Errorf("first bar title %q", first.Title)
	}
	if got := h.Bars[6].Segs; len(got) != 1 || got[0].Class != "st-other" {
		t.Errorf("an unknown state's segment %+v; want class st-other", got)
	}
	if h.Bars[1].Title != "2026-11-30 12:05:00 UTC (5 minutes): no outcomes" || len(h.Bars[1].Segs) != 0 {
		t.Errorf("an empty bucket: %+v", h.Bars[1])
	}
	for _, b := range h.Bars {
		if b.X < h.PlotX || b.X+b.W > h.PlotX+h.PlotW {
			t.Errorf("bar at %d..%d outside the plot %d..%d", b.X, b.X+b.W, h.PlotX, h.PlotX+h.PlotW)
		}
	}
	if len(h.XTicks) > 8 || len(h.XTicks) == 0 {
		t.Errorf("x labels = %d; want 1..8", len(h.XTicks))
	}
	wantLegend := []legendItem{{"st-succeeded", "succeeded", 8}, {"st-failed", "failed", 2}, {"st-other", "other", 5}}
	if len(h.Legend) != len(wantLegend) {
		t.Fatalf("legend %+v; want %+v", h.Legend, wantLegend)
	}
	for i := range wantLegend {
		if h.Legend[i] != wantLegend[i] {
			t.Errorf("legend[%d] = %+v; want %+v", i, h.Legend[i], wantLegend[i])
		}
	}
}

func TestNiceCeil(t *testing.T) {
	for in, want := range map[int]int{0: 1, 1: 1, 2: 2, 3: 5, 7: 10, 10: 10, 11: 20, 260: 500, 999: 1000} {
		if got := niceCeil(in); got != want {
			t.Errorf("niceCeil(%d) = %d; want %d", in, got, want)
		}
	}
}

func TestBucketLabel(t *testing.T) {
	for d, want := range map[time.Duration]string{
		time.Minute: "1 minute", 15 * time.Minute: "15 minutes", time.Hour: "1 hour", 3 * time.Hour: "3 hours",
		24 * time.Hour: "1 day", 7 * 24 * time.Hour: "1 week", 90 * time.Second: "1m30s",
	} {
		if got := bucketLabel(d); got != want {
			t.Errorf("bucketLabel(%v) = %q; want %q", d, got, want)
		}
	}
}

func TestPrettyJSON(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"a":"\u003cb\u003e \u0026"}`, "{\n  \"a\": \"<b> &\"\n}"},
		{`{"a":"\\u003c"}`, "{\n  \"a\": \"\\\\u003c\"\n}"},
		{`{"k\u003e":1,"s":"\"\u003c"}`, "{\n  \"k>\": 1,\n  \"s\": \"\\\"<\"\n}"},
		{`not json <x>`, `not json <x>`},
	} {
		if got := prettyJSON([]byte(tc.in)); got != tc.want {
			t.Errorf("prettyJSON(%s) = %q; want %q", tc.in, got, tc.want)
		}
	}
}
