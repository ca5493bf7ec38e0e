package loadtest

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// histPerMille are the quantiles checked against the sorted samples, in
// thousandths so that the exact nearest rank is integer arithmetic and does
// not share the implementation's floating-point rounding.
var histPerMille = []int64{0, 1, 10, 100, 250, 290, 500, 570, 750, 900, 950, 990, 999, 1000}

// histExactQuantile is the nearest-rank quantile of sorted samples: the
// smallest v such that at least k/1000 of the samples are ≤ v.
func histExactQuantile(sorted []time.Duration, perMille int64) time.Duration {
	n := int64(len(sorted))
	rank := max((perMille*n+999)/1000, 1)
	return sorted[rank-1]
}

// histWithin1Pct reports whether got is within 1% of want.
func histWithin1Pct(got, want time.Duration) bool {
	diff := got - want
	if diff < 0 {
		diff = -diff
	}
	return diff*100 <= want
}

func histBoundaryValues() []time.Duration {
	var vs []time.Duration
	for _, v := range []int64{0, 1, 2, 127, 128, 129, 254, 255, 256, 257, 258, 999, 1000, 1001} {
		vs = append(vs, time.Duration(v))
	}
	// The edges of powers of two and of sub-buckets, from 2^8 ns to 2^40 ns
	// (about 18 minutes).
	for k := 8; k <= 40; k++ {
		for _, sub := range []int64{128, 129, 191, 255} {
			edge := sub << (k - 7)
			vs = append(vs, time.Duration(edge-1), time.Duration(edge), time.Duration(edge+1))
		}
	}
	for _, d := range []time.Duration{time.Microsecond, time.Millisecond, time.Second, time.Minute, 10 * time.Minute} {
		vs = append(vs, d-1, d, d+1)
	}
	return vs
}

func TestHistogramQuantiles(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	gen := func(n int, f func() time.Duration) []time.Duration {
		vs := make([]time.Duration, n)
		for i := range vs {
			vs[i] = f()
		}
		return vs
	}
	cases := []struct {
		name    string
		samples []time.Duration
	}{
		{"uniform 0 to 10s", gen(100_000, func() time.Duration { return time.Duration(rng.Int64N(int64(10 * time.Second))) })},
		{"uniform 1ms to 2ms", gen(50_000, func() time.Duration { return time.Millisecond + time.Duration(rng.Int64N(int64(time.Millisecond))) })},
		{"log-uniform 1us to 10min", gen(100_000, func() time.Duration {
			lo, hi := math.Log(float64(time.Microsecond)), math.Log(float64(10*time.Minute))
			return time.Duration(math.Exp(lo + rng.Float64()*(hi-lo)))
		})},
		{"exponential mean 5ms", gen(100_000, func() time.Duration { return time.Duration(rng.ExpFloat64() * float64(5*time.Millisecond)) })},
		{"bimodal 2ms and 200ms", gen(100_000, func() time.Duration {
			if rng.IntN(10) == 0 {
				return time.Duration(math.Max(0, 200e6+rng.NormFloat64()*20e6))
			}
			return time.Duration(math.Max(0, 2e6+rng.NormFloat64()*0.3e6))
		})},
		{"single value", gen(1000, func() time.Duration { return 1234567 * time.Nanosecond })},
		{"one sample", []time.Duration{42 * time.Millisecond}},
		{"two samples", []time.Duration{time.Millisecond, 9 * time.Second}},
		{"sub-microsecond exact", gen(10_000, func() time.Duration { return time.Duration(rng.IntN(256)) })},
		{"bucket boundaries", histBoundaryValues()},
		{"zeros", gen(100, func() time.Duration { return 0 })},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := NewHistogram()
			var sum int64
			for _, v := range tc.samples {
				h.Record(v)
				sum += int64(v)
			}
			sorted := slices.Clone(tc.samples)
			slices.Sort(sorted)

			if got, want := h.Count(), int64(len(sorted)); got != want {
				t.Errorf("Count() = %d, want %d", got, want)
			}
			if got, want := h.Max(), sorted[len(sorted)-1]; got != want {
				t.Errorf("Max() = %v, want %v", got, want)
			}
			if got, want := h.Mean(), time.Duration(sum/int64(len(sorted))); got != want {
				t.Errorf("Mean() = %v, want %v", got, want)
			}
			for _, pm := range histPerMille {
				q := float64(pm) / 1000
				got, want := h.Quantile(q), histExactQuantile(sorted, pm)
				if !histWithin1Pct(got, want) {
					t.Errorf("Quantile(%v) = %v (%d ns), want %v (%d ns) within 1%%", q, got, int64(got), want, int64(want))
				}
			}
		})
	}
}

// TestHistogramEveryBoundaryQuantile checks, for samples sitting on bucket
// edges, every possible rank rather than a few quantiles.
func TestHistogramEveryBoundaryQuantile(t *testing.T) {
	samples := histBoundaryValues()
	h := NewHistogram()
	for _, v := range samples {
		h.Record(v)
	}
	slices.Sort(samples)
	n := len(samples)
	for rank := 1; rank <= n; rank++ {
		q := float64(rank) / float64(n)
		got, want := h.Quantile(q), samples[rank-1]
		if !histWithin1Pct(got, want) {
			t.Errorf("Quantile(%d/%d) = %d ns, want %d ns within 1%%", rank, n, int64(got), int64(want))
		}
	}
}

// TestHistogramBuckets checks the bucket layout itself: buckets tile the
// range without gaps, each is narrow enough for 1% error, and the range
// reaches past 10 minutes.
func TestHistogramBuckets(t *testing.T) {
	var next uint64
	for i := range histBuckets {
		low, width := histBounds(i)
		if low != next {
			t.Fatalf("bucket %d starts at %d, want %d (gap or overlap)", i, low, next)
		}
		if got := histIndex(low); got != i {
			t.Fatalf("histIndex(%d) = %d, want %d", low, got, i)
		}
		if got := histIndex(low + width - 1); got != i {
			t.Fatalf("histIndex(%d) = %d, want %d", low+width-1, got, i)
		}
		if width > 1 && width*100 > low {
			t.Fatalf("bucket %d: width %d over low %d exceeds 1%%", i, width, low)
		}
		next = low + width
	}
	if top := time.Duration(next); top < 10*time.Minute {
		t.Errorf("range ends at %v, want at least 10m", top)
	}
	if got := histIndex(math.MaxInt64); got != histBuckets-1 {
		t.Errorf("histIndex(MaxInt64) = %d, want top bucket %d", got, histBuckets-1)
	}
}

func TestHistogramEmpty(t *testing.T) {
	h := NewHistogram()
	got := []time.Duration{h.Quantile(0), h.Quantile(0.5), h.Quantile(1), h.Max(), h.Mean(), time.Duration(h.Count())}
	if want := make([]time.Duration, len(got)); !cmp.Equal(got, want) {
		t.Errorf("empty histogram: Quantile(0), Quantile(.5), Quantile(1), Max, Mean, Count = %v, want all 0", got)
	}
	var zero Histogram
	zero.Record(time.Millisecond)
	if got := zero.Quantile(0.5); got != time.Millisecond {
		t.Errorf("zero-value histogram: Quantile(0.5) = %v, want 1ms", got)
	}
}

func TestHistogramNegativeAndOutOfRange(t *testing.T) {
	h := NewHistogram()
	h.Record(-5 * time.Second)
	if got := []time.Duration{h.Quantile(0), h.Quantile(1), h.Max(), h.Mean()}; !cmp.Equal(got, make([]time.Duration, 4)) {
		t.Errorf("after Record(-5s): Quantile(0), Quantile(1), Max, Mean = %v, want all 0", got)
	}

	h.Reset()
	h.Record(time.Millisecond)
	h.Record(2 * time.Hour)
	h.Record(100 * time.Hour)
	if got, want := h.Max(), 100*time.Hour; got != want {
		t.Errorf("Max() = %v, want %v (the true maximum beyond the range)", got, want)
	}
	if got, want := h.Quantile(1), 100*time.Hour; got != want {
		t.Errorf("Quantile(1) = %v, want %v", got, want)
	}
	if got, want := h.Quantile(0.3), time.Millisecond; !histWithin1Pct(got, want) {
		t.Errorf("Quantile(0.3) = %v, want %v", got, want)
	}
	// Beyond the range the value is clamped, but stays between the range's
	// top and the true maximum.
	if got := h.Quantile(0.5); got < 30*time.Minute || got > 100*time.Hour {
		t.Errorf("Quantile(0.5) = %v, want within [30m, 100h]", got)
	}
	if got, want := h.Mean(), (time.Millisecond+102*time.Hour)/3; got != want {
		t.Errorf("Mean() = %v, want %v", got, want)
	}

	// The sum goes past 64 bits without overflowing the mean.
	h.Reset()
	for range 4 {
		h.Record(math.MaxInt64)
	}
	if got, want := h.Mean(), time.Duration(math.MaxInt64); got != want {
		t.Errorf("Mean() of 4 x MaxInt64 = %d, want %d", got, want)
	}
}

func TestHistogramQuantileArgs(t *testing.T) {
	h := NewHistogram()
	for _, v := range []time.Duration{time.Millisecond, 2 * time.Millisecond, 3 * time.Millisecond} {
		h.Record(v)
	}
	cases := []struct {
		q    float64
		want time.Duration
	}{
		{-1, time.Millisecond},
		{math.Inf(-1), time.Millisecond},
		{math.NaN(), time.Millisecond},
		{2, 3 * time.Millisecond},
		{math.Inf(1), 3 * time.Millisecond},
		{1.0 / 3, time.Millisecond},
		{0.34, 2 * time.Millisecond},
		{2.0 / 3, 2 * time.Millisecond},
	}
	for _, tc := range cases {
		if got := h.Quantile(tc.q); !histWithin1Pct(got, tc.want) {
			t.Errorf("Quantile(%v) = %v, want %v within 1%%", tc.q, got, tc.want)
		}
	}
}

func TestHistogramMerge(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	all, a, b := NewHistogram(), NewHistogram(), NewHistogram()
	for range 50_000 {
		v := time.Duration(rng.ExpFloat64() * float64(20*time.Millisecond))
		if rng.IntN(50) == 0 {
			v = -v // negative samples must merge like recorded ones
		}
		all.Record(v)
		if rng.IntN(3) == 0 {
			a.Record(v)
		} else {
			b.Record(v)
		}
	}
	a.Merge(b)
	if diff := cmp.Diff(a, all, cmp.AllowUnexported(Histogram{})); diff != "" {
		t.Errorf("a.Merge(b) differs from recording all samples (-got +want):\n%s", diff)
	}

	// Into an empty histogram, from an empty or nil one.
	empty := NewHistogram()
	empty.Merge(all)
	empty.Merge(NewHistogram())
	empty.Merge(nil)
	if diff := cmp.Diff(empty, all, cmp.AllowUnexported(Histogram{})); diff != "" {
		t.Errorf("empty.Merge(all) differs from all (-got +want):\n%s", diff)
	}

	// Merging with itself doubles every count.
	self := NewHistogram()
	twice := NewHistogram()
	for _, v := range []time.Duration{time.Microsecond, time.Second, 7 * time.Millisecond} {
		self.Record(v)
		twice.Record(v)
		twice.Record(v)
	}
	self.Merge(self)
	if diff := cmp.Diff(self, twice, cmp.AllowUnexported(Histogram{})); diff != "" {
		t.Errorf("h.Merge(h) differs from recording twice (-got +want):\n%s", diff)
	}
}

func TestHistogramReset(t *testing.T) {
	h := NewHistogram()
	for i := range 1000 {
		h.Record(time.Duration(i) * time.Millisecond)
	}
	h.Reset()
	if diff := cmp.Diff(h, NewHistogram(), cmp.AllowUnexported(Histogram{})); diff != "" {
		t.Errorf("after Reset (-got +want):\n%s", diff)
	}
	h.Record(5 * time.Millisecond)
	if got, want := []time.Duration{h.Quantile(0), h.Max(), time.Duration(h.Count())}, []time.Duration{5 * time.Millisecond, 5 * time.Millisecond, 1}; !cmp.Equal(got, want) {
		t.Errorf("after Reset and one Record: Quantile(0), Max, Count = %v, want %v", got, want)
	}
}

// TestHistogramFixedMemory checks that recording never allocates, so memory
// stays flat however many calls a benchmark makes.
func TestHistogramFixedMemory(t *testing.T) {
	h := NewHistogram()
	rng := rand.New(rand.NewPCG(5, 6))
	vals := make([]time.Duration, 4096)
	for i := range vals {
		vals[i] = time.Duration(rng.Int64N(int64(20 * time.Minute)))
	}
	var i int
	allocs := testing.AllocsPerRun(1000, func() {
		for range 1000 {
			h.Record(vals[i%len(vals)])
			i++
		}
	})
	if allocs != 0 {
		t.Errorf("Record allocated %v times per 1000 calls, want 0", allocs)
	}
	if h.Count() < 1_000_000 {
		t.Fatalf("Count() = %d, want at least 10^6 samples recorded", h.Count())
	}
	allocs = testing.AllocsPerRun(100, func() {
		_ = h.Quantile(0.99)
		_ = h.Mean()
	})
	if allocs != 0 {
		t.Errorf("Quantile and Mean allocated %v times, want 0", allocs)
	}
}

func BenchmarkHistogramRecord(b *testing.B) {
	rng := rand.New(rand.NewPCG(7, 8))
	vals := make([]time.Duration, 1024)
	for i := range vals {
		vals[i] = time.Duration(rng.ExpFloat64() * float64(5*time.Millisecond))
	}
	h := NewHistogram()
	b.ReportAllocs()
	var i int
	for b.Loop() {
		h.Record(vals[i&(len(vals)-1)])
		i++
	}
}
