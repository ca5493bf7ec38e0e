package loadtest

import (
	"math"
	"math/bits"
	"time"
)

// The histogram is log-linear in nanoseconds, in the manner of HdrHistogram:
// values below histLinear each get their own bucket, and every power of two
// above that is split into histSub equal sub-buckets. A bucket at magnitude
// 2^k is 2^k/histSub wide and starts at a value of at least histSub times its
// width, so reporting its midpoint is off by at most 1/(2*histSub) ≈ 0.4%.
const (
	// histSubBits sets 128 sub-buckets per power of two.
	histSubBits = 7
	histSub     = 1 << histSubBits
	// histLinear values (0..255 ns) are recorded exactly.
	histLinear = 2 * histSub
	// histTopBits bounds the range: values below 2^41 ns (about 36.6
	// minutes) are bucketed; anything larger is counted in the top bucket.
	histTopBits = 41
	// histBuckets is the fixed number of counters: 256 exact ones plus 128
	// per power of two from 2^8 to 2^40.
	histBuckets = histLinear + (histTopBits-(histSubBits+1))*histSub
)

// Histogram records latencies in a fixed amount of memory (about 35 KiB),
// however many samples it sees, so a benchmark of millions of calls keeps a
// flat heap. Quantiles are within 1% of the exact sample quantile for
// durations up to about 36 minutes; longer samples are counted in the top
// bucket, though Max still reports the longest one exactly.
//
// A Histogram is not safe for concurrent use: callers that record from
// several goroutines hold a lock, or keep one histogram each and Merge them.
// The zero value is an empty histogram ready to use; NewHistogram returns one
// on the heap.
type Histogram struct {
	counts [histBuckets]int64
	count  int64
	// sumHi:sumLo is the exact 128-bit sum of the recorded nanoseconds, so
	// Mean neither overflows nor depends on the order of Merge calls.
	sumHi, sumLo uint64
	min, max     int64
}

// NewHistogram returns an empty histogram.
func NewHistogram() *Histogram {
	return &Histogram{}
}

// Record adds one sample. A negative duration counts as 0 (a clock step must
// not corrupt the data); a duration beyond the bucketed range is counted in
// the top bucket, but Max keeps its true value.
func (h *Histogram) Record(d time.Duration) {
	v := max(int64(d), 0)
	h.counts[histIndex(uint64(v))]++
	if h.count == 0 || v < h.min {
		h.min = v
	}
	if v > h.max {
		h.max = v
	}
	h.count++
	var carry uint64
	h.sumLo, carry = bits.Add64(h.sumLo, uint64(v), 0)
	h.sumHi += carry
}

// Count returns the number of samples recorded.
func (h *Histogram) Count() int64 {
	return h.count
}

// Quantile returns the q-quantile (q in [0, 1]) by the nearest-rank
// definition: the smallest recorded value v such that at least q*Count()
// samples are ≤ v, to within 1%. Quantile(0) is the minimum and Quantile(1)
// the maximum, both exact. A q outside [0, 1] is clamped and NaN is read as
// 0, so a bad argument yields a number rather than a panic. An empty
// histogram returns 0.
func (h *Histogram) Quantile(q float64) time.Duration {
	if h.count == 0 {
		return 0
	}
	rank := histRank(q, h.count)
	if rank <= 1 {
		return time.Duration(h.min)
	}
	if rank >= h.count {
		return time.Duration(h.max)
	}
	var seen int64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			low, width := histBounds(i)
			// The midpoint halves the worst-case error. The true sample lies
			// in this bucket and in [min, max], so clamping to that range
			// can only bring the estimate closer.
			mid := int64(low + width/2)
			return time.Duration(min(max(mid, h.min), h.max))
		}
	}
	// Unreachable while counts and count agree.
	return time.Duration(h.max)
}

// Max returns the longest sample recorded, exactly, or 0 if none.
func (h *Histogram) Max() time.Duration {
	return time.Duration(h.max)
}

// Mean returns the arithmetic mean of the samples (rounded down to the
// nanosecond), exactly, or 0 if none.
func (h *Histogram) Mean() time.Duration {
	if h.count == 0 {
		return 0
	}
	// Every sample is below 2^63, so the quotient is too and sumHi < count:
	// Div64 cannot panic.
	q, _ := bits.Div64(h.sumHi, h.sumLo, uint64(h.count))
	return time.Duration(q)
}

// Merge adds every sample of o to h, as if h had recorded them itself; o is
// unchanged. It lets each worker keep its own histogram without a shared
// lock. A nil o is a no-op.
func (h *Histogram) Merge(o *Histogram) {
	if o == nil || o.count == 0 {
		return
	}
	for i, c := range o.counts {
		h.counts[i] += c
	}
	if h.count == 0 || o.min < h.min {
		h.min = o.min
	}
	if o.max > h.max {
		h.max = o.max
	}
	h.count += o.count
	var carry uint64
	h.sumLo, carry = bits.Add64(h.sumLo, o.sumLo, 0)
	h.sumHi += o.sumHi + carry
}

// Reset empties h so it can be reused for the next load step without
// allocating.
func (h *Histogram) Reset() {
	*h = Histogram{}
}

// histIndex returns the bucket of a value in nanoseconds, clamping values
// beyond the range to the top bucket.
func histIndex(v uint64) int {
	if v < histLinear {
		return int(v)
	}
	k := bits.Len64(v) - 1 // v is in [2^k, 2^(k+1)), k >= 8
	if k >= histTopBits {
		return histBuckets - 1
	}
	sub := int(v >> (k - histSubBits)) // in [histSub, 2*histSub)
	return histLinear + (k-histSubBits-1)*histSub + sub - histSub
}

// histBounds returns the lowest value of bucket i and its width, both in
// nanoseconds: the bucket holds [low, low+width).
func histBounds(i int) (low, width uint64) {
	if i < histLinear {
		return uint64(i), 1
	}
	j := i - histLinear
	k := j/histSub + histSubBits + 1
	sub := uint64(j%histSub + histSub)
	shift := k - histSubBits
	return sub << shift, 1 << shift
}

// histRank turns a quantile into a 1-based nearest rank, ceil(q*n), forgiving
// the rounding of q*n in floating point (0.29*100 is 28.999999999999996) so
// that a rank that is an integer on paper stays that integer.
func histRank(q float64, n int64) int64 {
	if math.IsNaN(q) || q <= 0 {
		return 1
	}
	if q >= 1 {
		return n
	}
	x := q * float64(n)
	r := math.Round(x)
	if math.Abs(x-r) <= 1e-9*math.Max(1, x) {
		return max(int64(r), 1)
	}
	return max(int64(math.Ceil(x)), 1)
}
