package storetest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// rateLimitTests are the contract subtests of processors.RateLimiter, run
// by Run against every store: the rate limit's state lives in the
// execution store, so every store must implement it.
func rateLimitTests() []contractTest {
	return []contractTest{
		{"RateLimit/Burst", limiter(testRateBurst)},
		{"RateLimit/Refill", limiter(testRateRefill)},
		{"RateLimit/Independent", limiter(testRateIndependent)},
		{"RateLimit/IntraBatch", limiter(testRateIntraBatch)},
		{"RateLimit/Invalid", limiter(testRateInvalid)},
		{"RateLimit/EmptyBatch", limiter(testRateEmptyBatch)},
		{"RateLimit/CancelledContext", limiter(testRateCancelledContext)},
		{"RateLimit/Concurrent", limiter(testRateConcurrent)},
		{"RateLimit/ConcurrentBatches", limiter(testRateConcurrentBatches)},
		{"RateLimit/Prune", testRatePrune},
		{"RateLimit/AdmitCharged", testAdmitCharged},
		{"RateLimit/AdmitChargedOnce", testAdmitChargedOnce},
		{"RateLimit/AdmitChargedAll", testAdmitChargedAll},
		{"RateLimit/AdmitChargedInvalid", testAdmitChargedInvalid},
		{"RateLimit/AdmitChargedConcurrent", testAdmitChargedConcurrent},
	}
}

// limiter adapts a RateLimiter test to the suite's store tests, failing a
// store that is not a RateLimiter.
func limiter(fn func(t *testing.T, rl processors.RateLimiter)) func(t *testing.T, s processors.Store) {
	return func(t *testing.T, s processors.Store) {
		t.Helper()
		rl, ok := s.(processors.RateLimiter)
		if !ok {
			t.Fatalf("store %T does not implement processors.RateLimiter; every execution store must (the limits' state lives there)", s)
		}
		fn(t, rl)
	}
}

// hour is a window long enough that nothing refills during a test.
const hour = time.Hour

func rate(bucket string, limit int, window time.Duration) processors.RateRequest {
	return processors.RateRequest{Bucket: bucket, Limit: limit, Window: window}
}

func mustTake(t *testing.T, rl processors.RateLimiter, rs ...processors.RateRequest) []processors.RateResult {
	t.Helper()
	got, err := rl.Take(t.Context(), rs)
	if err != nil {
		t.Fatalf("Take(%v) = %v; want no error", rs, err)
	}
	if len(got) != len(rs) {
		t.Fatalf("Take(%d requests) = %d results; want %d", len(rs), len(got), len(rs))
	}
	return got
}

// checkRefused fails unless res is a refusal with a RetryAfter in
// (lo, hi].
func checkRefused(t *testing.T, what string, res processors.RateResult, remaining int, lo, hi time.Duration) {
	t.Helper()
	if res.Allowed || res.Remaining != remaining {
		t.Errorf("%s = %+v; want refused with Remaining %d", what, res, remaining)
	}
	if res.RetryAfter <= lo || res.RetryAfter > hi {
		t.Errorf("%s: RetryAfter = %v; want in (%v, %v]", what, res.RetryAfter, lo, hi)
	}
}

// testRatePrune: the buckets full again are deleted, at most the number
// asked for a call; one still spending is kept, its budget as it was; a
// pruned bucket admits as a new one.
func testRatePrune(t *testing.T, s processors.Store) {
	rl, ok := s.(processors.RateLimiter)
	p, ok2 := s.(processors.RatePruner)
	if !ok || !ok2 {
		t.Fatalf("store %T is not a processors.RateLimiter and a processors.RatePruner; every execution store must be both", s)
	}
	var short []processors.RateRequest
	for i := range 3 {
		short = append(short, rate(fmt.Sprintf("t_acme/get_weather/1/s by user/%d/p", i), 1, time.Millisecond))
	}
	long := rate("t_acme/refund_order/1/h/p", 1, hour)
	for _, r := range append(short, long) {
		if got := mustTake(t, rl, r)[0]; !got.Allowed {
			t.Fatalf("Take(%s) = %+v; want allowed", r.Bucket, got)
		}
	}
	// The short buckets are full again a millisecond later on the
	// store's clock; polled, as the clocks may differ.
	pruned := 0
	waitFor(t, pollTimeout, func() error {
		n, err := p.PruneRates(t.Context(), 2)
		if err != nil {
			t.Fatalf("PruneRates(2) = %v", err)
		}
		if n > 2 {
			t.Fatalf("PruneRates(2) deleted %d buckets; want at most 2", n)
		}
		if pruned += n; pruned < len(short) {
			return fmt.Errorf("%d of %d full buckets pruned", pruned, len(short))
		}
		return nil
	})
	if n, err := p.PruneRates(t.Context(), 100); err != nil || n != 0 {
		t.Errorf("PruneRates(100) after the full buckets went = %d, %v; want 0 (the spending one kept)", n, err)
	}
	checkRefused(t, "the kept bucket", mustTake(t, rl, long)[0], 0, hour-time.Minute, hour)
	if got := mustTake(t, rl, short[0])[0]; !got.Allowed {
		t.Errorf("a pruned bucket's Take = %+v; want allowed, as a new bucket", got)
	}
}

// testRateBurst: a full bucket admits Limit uses at once, counting down
// Remaining, then refuses until one interval (Window/Limit) after the
// burst.
func testRateBurst(t *testing.T, rl processors.RateLimiter) {
	const limit = 5
	r := rate("t_acme/refund_order", limit, hour)
	for i := range limit {
		got := mustTake(t, rl, r)[0]
		if want := (processors.RateResult{Allowed: true, Remaining: limit - 1 - i}); got != want {
			t.Errorf("use %d: Take = %+v; want %+v", i+1, got, want)
		}
	}
	// The burst put tat one Window after it; the next use fits one
	// interval after the burst, minus the time the test has taken since.
	interval := hour / limit
	for i := range 2 {
		checkRefused(t, fmt.Sprintf("use %d", limit+1+i), mustTake(t, rl, r)[0], 0, interval-time.Minute, interval)
	}
}

// testRateRefill: after RetryAfter has passed on the store's clock, the
// refused request is admitted, and not before. Short windows; polled.
func testRateRefill(t *testing.T, rl processors.RateLimiter) {
	const window = 200 * time.Millisecond
	r := rate("t_acme/send_email", 2, window)
	for i := range 2 {
		if got := mustTake(t, rl, r)[0]; !got.Allowed {
			t.Fatalf("use %d: Take = %+v; want allowed", i+1, got)
		}
	}
	refusedAt := time.Now()
	refused := mustTake(t, rl, r)[0]
	if refused.Allowed {
		// Only a machine stalled for a whole interval (100ms) between two
		// calls gets here.
		t.Fatalf("use 3: Take = %+v; want refused right after a burst of 2 per %v", refused, window)
	}
	checkRefused(t, "use 3", refused, 0, 0, window)

	var allowedBy time.Time
	waitFor(t, pollTimeout, func() error {
		got := mustTake(t, rl, r)[0]
		if !got.Allowed {
			if got.RetryAfter <= 0 || got.RetryAfter > window {
				t.Fatalf("refused while waiting: RetryAfter = %v; want in (0, %v]", got.RetryAfter, window)
			}
			return fmt.Errorf("still refused, RetryAfter %v", got.RetryAfter)
		}
		allowedBy = time.Now()
		return nil
	})
	// The store's clock advanced by at least RetryAfter between the
	// refusal and the admission, and both readings fall within the calls'
	// spans on this process's clock, so this process saw at least as much
	// time pass, whatever the offset between the clocks. The slack covers
	// the stores' microsecond truncation.
	if elapsed := allowedBy.Sub(refusedAt); elapsed < refused.RetryAfter-time.Millisecond {
		t.Errorf("admitted %v after the refusal; want no sooner than its RetryAfter %v", elapsed, refused.RetryAfter)
	}
}

// testRateIndependent: buckets do not share budget, whether they differ by
// tool or by tenant.
func testRateIndependent(t *testing.T, rl processors.RateLimiter) {
	a := rate("t_acme/refund_order", 1, hour)
	if got := mustTake(t, rl, a)[0]; !got.Allowed {
		t.Fatalf("first use of %s: Take = %+v; want allowed", a.Bucket, got)
	}
	checkRefused(t, "second use of "+a.Bucket, mustTake(t, rl, a)[0], 0, 0, hour)
	for _, b := range []string{"t_acme/send_email", "t_other/refund_order", "t_acme/refund_order/x", "T_ACME/refund_order"} {
		if got, want := mustTake(t, rl, rate(b, 1, hour))[0], (processors.RateResult{Allowed: true}); got != want {
			t.Errorf("first use of %s after %s ran out: Take = %+v; want %+v", b, a.Bucket, got, want)
		}
	}
	checkRefused(t, "third use of "+a.Bucket, mustTake(t, rl, a)[0], 0, 0, hour)
}

// testRateIntraBatch: requests of one batch apply in order, each counts,
// and a later one sees what an earlier one took.
func testRateIntraBatch(t *testing.T, rl processors.RateLimiter) {
	t.Run("same bucket thrice", func(t *testing.T) {
		r := rate("t_acme/intra_1", 2, hour)
		got := mustTake(t, rl, r, r, r)
		want := []processors.RateResult{{Allowed: true, Remaining: 1}, {Allowed: true, Remaining: 0}}
		if diff := cmp.Diff(want, got[:2]); diff != "" {
			t.Errorf("Take(3 x limit 2) first two results (-want +got):\n%s", diff)
		}
		checkRefused(t, "third of the batch", got[2], 0, 0, hour/2)
		checkRefused(t, "next batch", mustTake(t, rl, r)[0], 0, 0, hour/2)
	})
	t.Run("interleaved buckets", func(t *testing.T) {
		a, b := rate("t_acme/intra_a", 2, hour), rate("t_acme/intra_b", 1, hour)
		got := mustTake(t, rl, a, b, a, b, a)
		want := []processors.RateResult{
			{Allowed: true, Remaining: 1}, {Allowed: true, Remaining: 0}, {Allowed: true, Remaining: 0},
		}
		if diff := cmp.Diff(want, []processors.RateResult{got[0], got[1], got[2]}); diff != "" {
			t.Errorf("Take(a, b, a, b, a) results 0-2 (-want +got):\n%s", diff)
		}
		checkRefused(t, "b again in the batch", got[3], 0, 0, hour)
		checkRefused(t, "a again in the batch", got[4], 0, 0, hour/2)
	})
	t.Run("costs", func(t *testing.T) {
		// Cost 0 means 1. A refused request of cost 2 takes nothing, so a
		// later one of cost 1 still fits.
		r := rate("t_acme/intra_cost", 4, hour)
		two := r
		two.Cost = 2
		got := mustTake(t, rl, two, r, two, r, r)
		want := []processors.RateResult{
			{Allowed: true, Remaining: 2}, {Allowed: true, Remaining: 1},
		}
		if diff := cmp.Diff(want, got[:2]); diff != "" {
			t.Errorf("Take(2, 0, 2, 0, 0 of 4) results 0-1 (-want +got):\n%s", diff)
		}
		checkRefused(t, "cost 2 with 1 left", got[2], 1, 0, hour/4)
		if want := (processors.RateResult{Allowed: true, Remaining: 0}); got[3] != want {
			t.Errorf("cost 1 with 1 left = %+v; want %+v", got[3], want)
		}
		checkRefused(t, "cost 1 with none left", got[4], 0, 0, hour/4)
	})
}

// testRateInvalid: a batch holding a request no store may apply is
// refused whole, and takes nothing, not even for its valid requests.
func testRateInvalid(t *testing.T, rl processors.RateLimiter) {
	tests := []struct {
		name string
		r    processors.RateRequest
	}{
		{"empty bucket", rate("", 1, hour)},
		{"zero limit", rate("b", 0, hour)},
		{"negative limit", rate("b", -1, hour)},
		{"zero window", rate("b", 1, 0)},
		{"negative window", rate("b", 1, -time.Second)},
		{"window over a year", rate("b", 1, processors.MaxRateWindow+time.Microsecond)},
		{"more than one use per microsecond", rate("b", 1001, time.Millisecond)},
		{"negative cost", processors.RateRequest{Bucket: "b", Limit: 2, Window: hour, Cost: -1}},
		{"cost over limit", processors.RateRequest{Bucket: "b", Limit: 2, Window: hour, Cost: 3}},
		{"bucket too long", rate(strings.Repeat("b", processors.MaxRateBucketLen+1), 1, hour)},
		{"bucket not UTF-8", rate("t_acme/\xff", 1, hour)},
		{"bucket with NUL", rate("t_acme/\x00", 1, hour)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			valid := rate("t_acme/invalid_"+strings.ReplaceAll(tc.name, " ", "_"), 1, hour)
			for _, batch := range [][]processors.RateRequest{{tc.r}, {valid, tc.r}} {
				got, err := rl.Take(t.Context(), batch)
				if !errors.Is(err, processors.ErrInvalidRateRequest) {
					t.Errorf("Take(%+v) = %v, %v; want an error wrapping ErrInvalidRateRequest", batch, got, err)
				}
				if got != nil {
					t.Errorf("Take(%+v) results = %v; want none with the error", batch, got)
				}
			}
			// The valid request of the refused batch took nothing: its
			// single use is still there.
			if got, want := mustTake(t, rl, valid)[0], (processors.RateResult{Allowed: true}); got != want {
				t.Errorf("Take(%s, limit 1) after the refused batch = %+v; want %+v", valid.Bucket, got, want)
			}
		})
	}
	// The largest valid request is valid.
	largest := processors.RateRequest{Bucket: strings.Repeat("b", processors.MaxRateBucketLen), Limit: 1000, Window: time.Millisecond, Cost: 1000}
	if got, want := mustTake(t, rl, largest)[0], (processors.RateResult{Allowed: true}); got != want {
		t.Errorf("Take(largest valid request) = %+v; want %+v", got, want)
	}
}

func testRateEmptyBatch(t *testing.T, rl processors.RateLimiter) {
	for _, rs := range [][]processors.RateRequest{nil, {}} {
		got, err := rl.Take(t.Context(), rs)
		if err != nil || got == nil || len(got) != 0 {
			t.Errorf("Take(%#v) = %#v, %v; want an empty non-nil slice and no error", rs, got, err)
		}
	}
}

func testRateCancelledContext(t *testing.T, rl processors.RateLimiter) {
	r := rate("t_acme/cancelled", 1, hour)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if got, err := rl.Take(ctx, []processors.RateRequest{r}); err == nil {
		t.Errorf("Take(cancelled ctx) = %v, nil error; want an error", got)
	}
	if got, want := mustTake(t, rl, r)[0], (processors.RateResult{Allowed: true}); got != want {
		t.Errorf("Take after a cancelled Take = %+v; want %+v (nothing taken)", got, want)
	}
}

// testRateConcurrent: the limit holds under concurrent callers of one
// bucket: exactly Limit of them are admitted, and the store retries its
// own serialization failures rather than surfacing them.
func testRateConcurrent(t *testing.T, rl processors.RateLimiter) {
	const (
		callers = 20
		limit   = 10
	)
	r := rate("t_acme/concurrent", limit, hour)
	allowed, errs := takeConcurrently(t, rl, callers, func(int) []processors.RateRequest { return []processors.RateRequest{r} })
	for _, err := range errs {
		t.Errorf("concurrent Take: %v", err)
	}
	if allowed[r.Bucket] != limit {
		t.Errorf("%d concurrent Takes of limit %d: %d allowed; want exactly %d", callers, limit, allowed[r.Bucket], limit)
	}
	checkRefused(t, "Take after the race", mustTake(t, rl, r)[0], 0, 0, hour/limit)
}

// testRateConcurrentBatches: concurrent batches over the same two buckets,
// in opposite orders, neither deadlock nor fail, and each bucket admits
// exactly its limit.
func testRateConcurrentBatches(t *testing.T, rl processors.RateLimiter) {
	const (
		callers = 20
		limit   = 10
	)
	x, y := rate("t_acme/batch_x", limit, hour), rate("t_acme/batch_y", limit, hour)
	allowed, errs := takeConcurrently(t, rl, callers, func(i int) []processors.RateRequest {
		if i%2 == 0 {
			return []processors.RateRequest{x, y}
		}
		return []processors.RateRequest{y, x}
	})
	for _, err := range errs {
		t.Errorf("concurrent Take: %v", err)
	}
	if diff := cmp.Diff(map[string]int{x.Bucket: limit, y.Bucket: limit}, allowed); diff != "" {
		t.Errorf("%d concurrent batches over two buckets of limit %d: allowed per bucket (-want +got):\n%s", callers, limit, diff)
	}
}

// takeConcurrently runs n Takes on rl at once, batch(i) for the i-th, and
// counts the admitted requests per bucket.
func takeConcurrently(t *testing.T, rl processors.RateLimiter, n int, batch func(i int) []processors.RateRequest) (map[string]int, []error) {
	t.Helper()
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		allowed = map[string]int{}
		errs    []error
	)
	start := make(chan struct{})
	for i := range n {
		rs := batch(i)
		wg.Go(func() {
			<-start
			got, err := rl.Take(t.Context(), rs)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("caller %d: %w", i, err))
				return
			}
			for j, res := range got {
				if res.Allowed {
					allowed[rs[j].Bucket]++
				}
			}
		})
	}
	close(start)
	wg.Wait()
	return allowed, errs
}

// charged is admission a charged to rs.
func charged(a processors.Admission, rs ...processors.RateRequest) processors.Admission {
	a.Rates = rs
	return a
}

// onlyRate is the answer to res's one rate request, failing unless there
// is exactly one.
func onlyRate(t *testing.T, what string, res processors.AdmitResult) processors.RateResult {
	t.Helper()
	if len(res.Rates) != 1 {
		t.Fatalf("%s: Rates = %+v; want one answer, to its one request", what, res.Rates)
	}
	return res.Rates[0]
}

// checkAbsent fails unless k has no record.
func checkAbsent(t *testing.T, s processors.Store, k ledger.CallKey) {
	t.Helper()
	if _, err := s.Get(t.Context(), k); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("Get(%v) = %v; want ErrNotFound: a refused admission creates nothing", k, err)
	}
}

// testAdmitCharged: admissions charged to a bucket are admitted while it
// admits them, in batch order, and refused (Limited, nothing created)
// after; the bucket is Take's, and a plain admission beside them is not
// charged.
func testAdmitCharged(t *testing.T, s processors.Store) {
	r := rate("t_acme/admit_charged", 2, hour)
	as := []processors.Admission{
		charged(admission(key("ch-1"), hashA, processors.StatusAuthorized), r),
		admission(key("ch-plain"), hashA, processors.StatusAuthorized),
		charged(admission(key("ch-2"), hashA, processors.StatusPending), r),
		charged(admission(key("ch-3"), hashA, processors.StatusAuthorized), r),
	}
	got := mustAdmit(t, s, as...)
	want := []processors.AdmitResult{
		{Outcome: processors.Admitted, Record: fromAdmission(as[0]), Rates: []processors.RateResult{{Allowed: true, Remaining: 1}}},
		{Outcome: processors.Admitted, Record: fromAdmission(as[1])},
		{Outcome: processors.Admitted, Record: fromAdmission(as[2]), Rates: []processors.RateResult{{Allowed: true, Remaining: 0}}},
	}
	if diff := cmp.Diff(want, got[:3], ignoreStoreSet, equateEmpty); diff != "" {
		t.Errorf("Admit(3 charged to a limit of 2, 1 plain) first three (-want +got):\n%s", diff)
	}
	if got[3].Outcome != processors.Limited {
		t.Errorf("third charged admission: outcome %v; want Limited", got[3].Outcome)
	}
	checkRefused(t, "third charged admission", onlyRate(t, "third charged admission", got[3]), 0, 0, hour/2)
	if got[3].RetryAfter() != got[3].Rates[0].RetryAfter {
		t.Errorf("third charged admission: RetryAfter() = %v; want its bucket's, %v", got[3].RetryAfter(), got[3].Rates[0].RetryAfter)
	}
	checkAbsent(t, s, key("ch-3"))
	checkRefused(t, "Take of the bucket after the admissions", mustTake(t, s.(processors.RateLimiter), r)[0], 0, 0, hour/2)
	// The refused key stays free.
	plain := as[3]
	plain.Rates = nil
	if got := mustAdmit(t, s, plain)[0]; got.Outcome != processors.Admitted {
		t.Errorf("Admit(the refused key, uncharged) = %v; want Admitted", got.Outcome)
	}
}

// testAdmitChargedOnce: only the first admission of a free key is
// charged: a Duplicate, a Conflict and later copies in a batch take
// nothing, and copies of a refused key are refused alike.
func testAdmitChargedOnce(t *testing.T, s processors.Store) {
	r := rate("t_acme/admit_once", 2, hour)
	k1 := charged(admission(key("once-1"), hashA, processors.StatusAuthorized), r)
	if got := mustAdmit(t, s, k1)[0]; got.Outcome != processors.Admitted {
		t.Fatalf("Admit(once-1) = %v; want Admitted", got.Outcome)
	}
	for i := range 3 {
		if got := mustAdmit(t, s, k1)[0]; got.Outcome != processors.Duplicate || got.Rates != nil {
			t.Errorf("retry %d of once-1 = %v, rates %+v; want Duplicate, uncharged", i+1, got.Outcome, got.Rates)
		}
	}
	reuse := charged(admission(key("once-1"), hashB, processors.StatusAuthorized), r)
	if got := mustAdmit(t, s, reuse)[0]; got.Outcome != processors.Conflict {
		t.Errorf("reuse of once-1 = %v; want Conflict", got.Outcome)
	}
	k2 := charged(admission(key("once-2"), hashA, processors.StatusAuthorized), r)
	got := mustAdmit(t, s, k2, k2, k2)
	if got[0].Outcome != processors.Admitted || got[1].Outcome != processors.Duplicate || got[2].Outcome != processors.Duplicate {
		t.Errorf("Admit(once-2 thrice in a batch) = %v, %v, %v; want Admitted, Duplicate, Duplicate", got[0].Outcome, got[1].Outcome, got[2].Outcome)
	}
	// Two calls charged: the bucket of 2 is empty now, whatever was
	// sent again.
	k3 := charged(admission(key("once-3"), hashA, processors.StatusAuthorized), r)
	got = mustAdmit(t, s, k3, k3)
	for i, res := range got {
		if res.Outcome != processors.Limited {
			t.Errorf("copy %d of once-3 on an empty bucket = %v; want Limited", i+1, res.Outcome)
		}
		what := fmt.Sprintf("copy %d of once-3", i+1)
		checkRefused(t, what, onlyRate(t, what, res), 0, 0, hour/2)
	}
	checkAbsent(t, s, key("once-3"))
	// A retry of an admitted call on the empty bucket is still its
	// Duplicate, never Limited.
	if got := mustAdmit(t, s, k1)[0]; got.Outcome != processors.Duplicate {
		t.Errorf("retry of once-1 on an empty bucket = %v; want Duplicate", got.Outcome)
	}
}

// testAdmitChargedAll: an admission charged to several buckets (one per
// deciding policy) charges every one of them or none. One full bucket
// refuses it: Limited, the key stays free, and the buckets with room are
// charged nothing, not even for the rest of the batch; its RetryAfter is
// the longest wait of the buckets that refused. With room in all, each is
// charged. A bucket named twice counts twice.
func testAdmitChargedAll(t *testing.T, s processors.Store) {
	rl := s.(processors.RateLimiter)
	roomy := rate("t_acme/all_roomy", 3, hour)
	other := rate("t_acme/all_other", 2, hour)
	full := rate("t_acme/all_full", 1, hour)
	fullMinute := rate("t_acme/all_full_minute", 1, time.Minute)
	mustTake(t, rl, full, fullMinute)

	refused := charged(admission(key("all-refused"), hashA, processors.StatusAuthorized), roomy, full)
	both := charged(admission(key("all-both"), hashA, processors.StatusAuthorized), roomy, other)
	got := mustAdmit(t, s, refused, both)
	if got[0].Outcome != processors.Limited || len(got[0].Rates) != 2 {
		t.Fatalf("Admit(charged to a bucket with room and a full one) = %v, rates %+v; want Limited, two answers", got[0].Outcome, got[0].Rates)
	}
	if got[0].Rates[0] != (processors.RateResult{}) {
		t.Errorf("refused admission's answer for the bucket with room = %+v; want zero: nothing charged", got[0].Rates[0])
	}
	checkRefused(t, "refused admission's answer for the full bucket", got[0].Rates[1], 0, 0, hour)
	checkAbsent(t, s, refused.Key)
	want := processors.AdmitResult{Outcome: processors.Admitted, Record: fromAdmission(both),
		Rates: []processors.RateResult{{Allowed: true, Remaining: 2}, {Allowed: true, Remaining: 1}}}
	if diff := cmp.Diff(want, got[1], ignoreStoreSet, equateEmpty); diff != "" {
		t.Errorf("Admit(charged to two buckets with room, after the refused one) (-want +got):\n%s", diff)
	}
	// Committed so: the refused admission took nothing from roomy, the
	// admitted one a use of each.
	res := mustTake(t, rl, roomy, other)
	if want := []processors.RateResult{{Allowed: true, Remaining: 1}, {Allowed: true, Remaining: 0}}; !cmp.Equal(want, res) {
		t.Errorf("Take(roomy, other) after the admissions = %+v; want %+v", res, want)
	}
	// The refused key stays free.
	if got := mustAdmit(t, s, charged(refused, rate("t_acme/all_fresh", 1, hour)))[0]; got.Outcome != processors.Admitted {
		t.Errorf("Admit(the refused key, on a fresh bucket) = %v; want Admitted", got.Outcome)
	}

	// Two buckets refuse: the longer wait is the admission's.
	two := charged(admission(key("all-two"), hashA, processors.StatusAuthorized), fullMinute, full)
	res2 := mustAdmit(t, s, two)[0]
	if res2.Outcome != processors.Limited || len(res2.Rates) != 2 {
		t.Fatalf("Admit(charged to two full buckets) = %v, rates %+v; want Limited, two answers", res2.Outcome, res2.Rates)
	}
	checkRefused(t, "the per-minute bucket's refusal", res2.Rates[0], 0, 0, time.Minute)
	checkRefused(t, "the per-hour bucket's refusal", res2.Rates[1], 0, time.Minute, hour)
	if res2.RetryAfter() != res2.Rates[1].RetryAfter {
		t.Errorf("RetryAfter() = %v; want the longest wait, the per-hour bucket's %v", res2.RetryAfter(), res2.Rates[1].RetryAfter)
	}

	// A bucket of 1 named twice cannot admit both uses: refused, and
	// charged nothing.
	once := rate("t_acme/all_once", 1, hour)
	twice := charged(admission(key("all-twice"), hashA, processors.StatusAuthorized), once, once)
	if got := mustAdmit(t, s, twice)[0]; got.Outcome != processors.Limited {
		t.Errorf("Admit(charged twice to a bucket of 1) = %v; want Limited", got.Outcome)
	}
	checkAbsent(t, s, twice.Key)
	if res := mustTake(t, rl, once)[0]; !res.Allowed {
		t.Errorf("Take(the bucket named twice) = %+v; want allowed: the refused admission charged nothing", res)
	}
}

// testAdmitChargedInvalid: a batch with a rate request no store may apply
// (here an admission's second) is refused whole, as Take refuses it, and
// creates and charges nothing.
func testAdmitChargedInvalid(t *testing.T, s processors.Store) {
	ok := admission(key("inv-ok"), hashA, processors.StatusAuthorized)
	valid := rate("t_acme/inv_valid", 1, hour)
	bad := charged(admission(key("inv-bad"), hashA, processors.StatusAuthorized), valid, rate("t_acme/\x00", 1, hour))
	got, err := s.Admit(t.Context(), []processors.Admission{ok, bad})
	if !errors.Is(err, processors.ErrInvalidRateRequest) || !errors.Is(err, processors.ErrRejected) {
		t.Errorf("Admit(with a NUL in a bucket) = %v, %v; want an error wrapping ErrInvalidRateRequest and ErrRejected", got, err)
	}
	checkAbsent(t, s, ok.Key)
	checkAbsent(t, s, bad.Key)
	if res := mustTake(t, s.(processors.RateLimiter), valid)[0]; !res.Allowed {
		t.Errorf("Take(the valid request's bucket) = %+v; want allowed: the refused batch charged nothing", res)
	}
}

// testAdmitChargedConcurrent: concurrent admissions charged to one bucket
// admit exactly its limit; concurrent copies of one key (several intake
// instances after a rebalance) admit it once and charge it once.
func testAdmitChargedConcurrent(t *testing.T, s processors.Store) {
	const (
		callers = 20
		limit   = 10
	)
	run := func(admission func(i int) processors.Admission) map[processors.AdmitOutcome]int {
		var (
			wg       sync.WaitGroup
			mu       sync.Mutex
			outcomes = map[processors.AdmitOutcome]int{}
		)
		start := make(chan struct{})
		for i := range callers {
			a := admission(i)
			wg.Go(func() {
				<-start
				got, err := s.Admit(t.Context(), []processors.Admission{a})
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					t.Errorf("concurrent Admit %d: %v", i, err)
					return
				}
				outcomes[got[0].Outcome]++
			})
		}
		close(start)
		wg.Wait()
		return outcomes
	}

	distinct := rate("t_acme/admit_concurrent", limit, hour)
	got := run(func(i int) processors.Admission {
		return charged(admission(key(fmt.Sprintf("conc-%02d", i)), hashA, processors.StatusAuthorized), distinct)
	})
	if diff := cmp.Diff(map[processors.AdmitOutcome]int{processors.Admitted: limit, processors.Limited: callers - limit}, got); diff != "" {
		t.Errorf("%d concurrent distinct keys on a limit of %d: outcomes (-want +got):\n%s", callers, limit, diff)
	}

	same := rate("t_acme/admit_concurrent_same", limit, hour)
	got = run(func(int) processors.Admission {
		return charged(admission(key("conc-same"), hashA, processors.StatusAuthorized), same)
	})
	if diff := cmp.Diff(map[processors.AdmitOutcome]int{processors.Admitted: 1, processors.Duplicate: callers - 1}, got); diff != "" {
		t.Errorf("%d concurrent copies of one key: outcomes (-want +got):\n%s", callers, diff)
	}
	// Charged once: limit-1 uses are left.
	rs := make([]processors.RateRequest, limit)
	for i := range rs {
		rs[i] = same
	}
	res := mustTake(t, s.(processors.RateLimiter), rs...)
	for i, r := range res[:limit-1] {
		if !r.Allowed {
			t.Errorf("use %d of the bucket after the copies: %+v; want allowed (the key charged once)", i+2, r)
		}
	}
	checkRefused(t, "use past the limit", res[limit-1], 0, 0, hour/limit)
}
