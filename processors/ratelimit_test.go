package processors_test

import (
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/processors"
)

var t0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

// take applies rs in order to one bucket at now, as a store does within a
// batch, returning the bucket's tat after them.
func take(tat, now time.Time, rs ...processors.RateRequest) (time.Time, []processors.RateResult) {
	out := make([]processors.RateResult, 0, len(rs))
	for _, r := range rs {
		next, res := processors.GCRA(tat, now, r)
		if res.Allowed {
			tat = next
		}
		out = append(out, res)
	}
	return tat, out
}

func TestGCRA(t *testing.T) {
	perSec := func(limit int) processors.RateRequest {
		return processors.RateRequest{Bucket: "b", Limit: limit, Window: time.Second}
	}
	withCost := func(r processors.RateRequest, cost int) processors.RateRequest {
		r.Cost = cost
		return r
	}
	tests := []struct {
		name    string
		tat     time.Time
		now     time.Time
		rs      []processors.RateRequest
		want    []processors.RateResult
		wantTat time.Time
	}{
		{
			name: "burst of limit then refused for one interval",
			now:  t0,
			rs:   []processors.RateRequest{perSec(4), perSec(4), perSec(4), perSec(4), perSec(4)},
			want: []processors.RateResult{
				{Allowed: true, Remaining: 3}, {Allowed: true, Remaining: 2}, {Allowed: true, Remaining: 1},
				{Allowed: true, Remaining: 0}, {RetryAfter: 250 * time.Millisecond},
			},
			wantTat: t0.Add(time.Second),
		},
		{
			name:    "tat in the past is a full bucket",
			tat:     t0.Add(-time.Hour),
			now:     t0,
			rs:      []processors.RateRequest{perSec(4)},
			want:    []processors.RateResult{{Allowed: true, Remaining: 3}},
			wantTat: t0.Add(250 * time.Millisecond),
		},
		{
			name:    "partly refilled",
			tat:     t0.Add(600 * time.Millisecond), // 0.4s of 1s left at t0: 1.6 uses
			now:     t0,
			rs:      []processors.RateRequest{perSec(4), perSec(4), perSec(4)},
			want:    []processors.RateResult{{Allowed: true, Remaining: 0}, {RetryAfter: 100 * time.Millisecond}, {RetryAfter: 100 * time.Millisecond}},
			wantTat: t0.Add(850 * time.Millisecond),
		},
		{
			name:    "cost takes several uses, all or none",
			now:     t0,
			rs:      []processors.RateRequest{withCost(perSec(4), 3), withCost(perSec(4), 2), perSec(4)},
			want:    []processors.RateResult{{Allowed: true, Remaining: 1}, {Remaining: 1, RetryAfter: 250 * time.Millisecond}, {Allowed: true, Remaining: 0}},
			wantTat: t0.Add(time.Second),
		},
		{
			name:    "cost equal to limit from a full bucket",
			now:     t0,
			rs:      []processors.RateRequest{withCost(perSec(4), 4), withCost(perSec(4), 4)},
			want:    []processors.RateResult{{Allowed: true, Remaining: 0}, {RetryAfter: time.Second}},
			wantTat: t0.Add(time.Second),
		},
		{
			// 1s/3 rounds up to 333334µs; the effective window is
			// 1.000002s.
			name:    "interval rounded up to a microsecond",
			now:     t0,
			rs:      []processors.RateRequest{perSec(3), perSec(3), perSec(3), perSec(3)},
			want:    []processors.RateResult{{Allowed: true, Remaining: 2}, {Allowed: true, Remaining: 1}, {Allowed: true, Remaining: 0}, {RetryAfter: 333334 * time.Microsecond}},
			wantTat: t0.Add(1000002 * time.Microsecond),
		},
		{
			name:    "now truncated to microseconds",
			now:     t0.Add(999 * time.Nanosecond),
			rs:      []processors.RateRequest{perSec(1), perSec(1)},
			want:    []processors.RateResult{{Allowed: true, Remaining: 0}, {RetryAfter: time.Second}},
			wantTat: t0.Add(time.Second),
		},
		{
			// The store's clock went back an hour after the last write:
			// the bucket is taken for idle, not refused for the hour (a
			// refusal never rewrites the tat, and nothing would clear
			// it); at most a window's charges are given again.
			name:    "clock went backwards",
			tat:     t0.Add(time.Hour + time.Second),
			now:     t0,
			rs:      []processors.RateRequest{perSec(4)},
			want:    []processors.RateResult{{Allowed: true, Remaining: 3}},
			wantTat: t0.Add(250 * time.Millisecond),
		},
		{
			// A window ahead, no more: a full bucket, as written.
			name:    "a window ahead",
			tat:     t0.Add(time.Second),
			now:     t0,
			rs:      []processors.RateRequest{perSec(4)},
			want:    []processors.RateResult{{RetryAfter: 250 * time.Millisecond}},
			wantTat: t0.Add(time.Second),
		},
		{
			// A little more than a window ahead: a charge whose now()
			// was read before another's that filled the bucket (they
			// read it at their transactions' starts, not in commit
			// order). Still full: taken for idle, the bucket was
			// emptied of a window's charges.
			name:    "a window ahead and a little",
			tat:     t0.Add(time.Second + time.Millisecond),
			now:     t0,
			rs:      []processors.RateRequest{perSec(4)},
			want:    []processors.RateResult{{RetryAfter: 251 * time.Millisecond}},
			wantTat: t0.Add(time.Second + time.Millisecond),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			gotTat, got := take(tc.tat, tc.now, tc.rs...)
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("results (-want +got):\n%s", diff)
			}
			if !gotTat.Equal(tc.wantTat) {
				t.Errorf("tat = %v; want %v", gotTat, tc.wantTat)
			}
		})
	}
}

// TestGCRAIsTokenBucket checks GCRA over random traffic against a token
// bucket simulated forward in time (capacity Limit, one token per
// interval), in integer microseconds, and the guarantees the
// processors.RateLimiter documentation states: bursts of at most Limit,
// at most Limit + span/interval uses over any span, and an exact
// RetryAfter.
func TestGCRAIsTokenBucket(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for run := range 200 {
		limit := 1 + rng.IntN(20)
		window := time.Duration(1+rng.IntN(5_000_000)) * time.Microsecond
		if int64(window/time.Microsecond) < int64(limit) {
			window = time.Duration(limit) * time.Microsecond
		}
		base := processors.RateRequest{Bucket: "b", Limit: limit, Window: window}
		if err := processors.CheckRateRequests([]processors.RateRequest{base}); err != nil {
			t.Fatalf("run %d: %v", run, err)
		}
		interval := (int64(window/time.Microsecond) + int64(limit) - 1) / int64(limit)
		if int64(window)%1000 != 0 {
			t.Fatalf("run %d: window %v is not whole microseconds", run, window)
		}
		capacity := interval * int64(limit) // in microseconds of refill

		var (
			tat    time.Time
			now    = t0
			level  = capacity // the token bucket, in microseconds of refill
			last   = now
			admits []int64 // the time, in µs since t0, of every admitted unit
		)
		for step := range 300 {
			// Mostly bursts at one instant, sometimes long gaps.
			switch rng.IntN(4) {
			case 0:
				now = now.Add(time.Duration(rng.Int64N(int64(window) * 2)))
			case 1:
				now = now.Add(time.Duration(rng.Int64N(int64(interval)*1000 + 1)))
			}
			r := base
			r.Cost = rng.IntN(limit + 1)
			cost := int64(max(r.Cost, 1))

			// On the stores' clock: whole microseconds.
			level = min(capacity, level+now.UnixMicro()-last.UnixMicro())
			last = now
			wantAllowed := level >= cost*interval

			next, res := processors.GCRA(tat, now, r)
			if res.Allowed != wantAllowed {
				t.Fatalf("run %d step %d (%+v at +%v): Allowed = %v; token bucket with %dµs of %dµs says %v",
					run, step, r, now.Sub(t0), res.Allowed, level, capacity, wantAllowed)
			}
			if res.Allowed {
				level -= cost * interval
				tat = next
				for range cost {
					admits = append(admits, int64(now.Sub(t0)/time.Microsecond))
				}
				if res.RetryAfter != 0 {
					t.Fatalf("run %d step %d: allowed with RetryAfter %v; want 0", run, step, res.RetryAfter)
				}
			} else {
				if res.RetryAfter <= 0 || res.RetryAfter > time.Duration(capacity)*time.Microsecond {
					t.Fatalf("run %d step %d: RetryAfter %v; want in (0, %dµs]", run, step, res.RetryAfter, capacity)
				}
				if _, early := processors.GCRA(tat, now.Add(res.RetryAfter-time.Microsecond), r); early.Allowed {
					t.Fatalf("run %d step %d: admitted 1µs before RetryAfter %v", run, step, res.RetryAfter)
				}
				if _, on := processors.GCRA(tat, now.Add(res.RetryAfter), r); !on.Allowed {
					t.Fatalf("run %d step %d: refused at RetryAfter %v", run, step, res.RetryAfter)
				}
			}
			if want := int(level / interval); res.Remaining != want {
				t.Fatalf("run %d step %d: Remaining = %d; token bucket holds %d", run, step, res.Remaining, want)
			}
		}
		// Uses i..j span admits[j]-admits[i] µs: at most Limit plus one
		// per interval of it, (j-i+1)*interval <= capacity + span, that
		// is (j*interval - admits[j]) - (i*interval - admits[i]) +
		// interval <= capacity: checked for every j against the i <= j
		// that minimises its term.
		lowest, lowestAt := int64(0), -1
		for j, at := range admits {
			if term := int64(j)*interval - at; lowestAt < 0 || term < lowest {
				lowest, lowestAt = term, j
			}
			if int64(j)*interval-at-lowest+interval > capacity {
				t.Fatalf("run %d: uses %d..%d span %dµs; want at most %d + span/%dµs of them",
					run, lowestAt, j, at-admits[lowestAt], limit, interval)
			}
		}
		if len(admits) < limit {
			t.Fatalf("run %d: only %d uses admitted; the traffic should exhaust the bucket", run, len(admits))
		}
	}
}

func TestCheckRateRequests(t *testing.T) {
	valid := processors.RateRequest{Bucket: "t_acme/refund_order", Limit: 20, Window: time.Minute}
	with := func(f func(*processors.RateRequest)) processors.RateRequest {
		r := valid
		f(&r)
		return r
	}
	tests := []struct {
		name    string
		r       processors.RateRequest
		wantErr bool
	}{
		{"valid", valid, false},
		{"cost zero means one", with(func(r *processors.RateRequest) { r.Cost = 0 }), false},
		{"cost equal to limit", with(func(r *processors.RateRequest) { r.Cost = 20 }), false},
		{"one use per microsecond", with(func(r *processors.RateRequest) { r.Limit, r.Window = 1000, time.Millisecond }), false},
		{"longest window", with(func(r *processors.RateRequest) { r.Window = processors.MaxRateWindow }), false},
		{"longest bucket", with(func(r *processors.RateRequest) { r.Bucket = strings.Repeat("é", processors.MaxRateBucketLen/2) }), false},
		{"empty bucket", with(func(r *processors.RateRequest) { r.Bucket = "" }), true},
		{"bucket too long", with(func(r *processors.RateRequest) { r.Bucket = strings.Repeat("b", processors.MaxRateBucketLen+1) }), true},
		{"bucket not UTF-8", with(func(r *processors.RateRequest) { r.Bucket = "t_acme/\xc3" }), true},
		{"bucket with NUL", with(func(r *processors.RateRequest) { r.Bucket = "t_acme\x00/x" }), true},
		{"zero limit", with(func(r *processors.RateRequest) { r.Limit = 0 }), true},
		{"negative limit", with(func(r *processors.RateRequest) { r.Limit = -5 }), true},
		{"zero window", with(func(r *processors.RateRequest) { r.Window = 0 }), true},
		{"negative window", with(func(r *processors.RateRequest) { r.Window = -time.Minute }), true},
		{"window too long", with(func(r *processors.RateRequest) { r.Window = processors.MaxRateWindow + 1 }), true},
		{"sub-microsecond window", with(func(r *processors.RateRequest) { r.Limit, r.Window = 1, 999 }), true},
		{"more than one use per microsecond", with(func(r *processors.RateRequest) { r.Limit, r.Window = 1001, time.Millisecond }), true},
		{"negative cost", with(func(r *processors.RateRequest) { r.Cost = -1 }), true},
		{"cost above limit", with(func(r *processors.RateRequest) { r.Cost = 21 }), true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// Second in the batch: the error names the request's index.
			err := processors.CheckRateRequests([]processors.RateRequest{valid, tc.r})
			if !tc.wantErr {
				if err != nil {
					t.Errorf("CheckRateRequests(%+v) = %v; want nil", tc.r, err)
				}
				return
			}
			if !errors.Is(err, processors.ErrInvalidRateRequest) {
				t.Fatalf("CheckRateRequests(%+v) = %v; want an error wrapping ErrInvalidRateRequest", tc.r, err)
			}
			if !strings.Contains(err.Error(), "rate request 1 ") {
				t.Errorf("CheckRateRequests error %q; want it to name request 1", err)
			}
		})
	}
}
