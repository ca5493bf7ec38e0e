package processors

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"time"
	"unicode/utf8"
)

// RateLimiter admits or refuses uses of a limited budget, shared by every
// process that uses the same store: the state lives in the execution store
// (pgstore, boltstore), not in the process, so a limit holds across all
// intake instances. A store that is a RateLimiter also charges its buckets
// in Admit (Admission.Rates), with the admission and all or nothing
// (ChargeAll); the intake charges calls that way, so that a call is charged
// once, when it is first recorded, to every deciding policy's budget.
//
// Take answers a batch in one serializable transaction of the store, with
// results in the order of the requests. Requests are applied in order, so
// that several requests of one batch on the same bucket each count, and a
// later one sees what an earlier one took. A batch with an invalid request
// (see CheckRateRequests) is refused whole with an error wrapping
// ErrInvalidRateRequest, and changes nothing. Implementations are safe for
// concurrent use; a cancelled ctx abandons the transaction.
//
// # Semantics
//
// Each bucket is a GCRA (generic cell rate algorithm) limiter, which
// behaves exactly like a token bucket that holds at most Limit tokens,
// starts full, and refills continuously at one token per interval, where
// interval = Window/Limit rounded up to a whole microsecond (the stores'
// precision). A request takes Cost tokens, all or none. So:
//
//   - bursts: up to Limit uses at once from a bucket that has been idle for
//     a Window;
//   - sustained rate: never more than Limit uses per Window in the long
//     run; uses admitted at times t1 <= ... <= tn number at most
//     Limit + (tn - t1)/interval;
//   - not a sliding-window count: a window of length Window that starts
//     with a full burst can admit up to 2*Limit-1 uses, the burst plus the
//     refill. A strict "at most Limit in any window" needs the time of every
//     use (O(Limit) state per bucket); this needs one timestamp.
//
// The state of a bucket is one timestamp, the theoretical arrival time
// (tat): when the bucket will be full again. Its clock is the store's
// (the database's now() for pgstore, Config.Now for boltstore), never the
// caller's. A request is admitted iff max(tat, now) + Cost*interval - now
// <= Limit*interval; an admitted request moves tat to max(tat, now) +
// Cost*interval, a refused one leaves it alone. GCRA does the arithmetic,
// so that every implementation answers to the microsecond alike.
//
// Limit*interval is the effective window: it equals Window when Window is a
// whole multiple of Limit microseconds, and exceeds it by less than Limit
// microseconds otherwise.
type RateLimiter interface {
	Take(ctx context.Context, rs []RateRequest) ([]RateResult, error)
}

// RatePruner deletes the rate limiter's buckets that are full again (their
// tat past on the store's clock), which mean the same as no bucket: so
// that the buckets of users and agents seen once (limits "by user", "by
// agent") do not pile up. PruneRates deletes at most limit of them, and
// returns how many it deleted; a bucket charged meanwhile is kept. Every
// store that is a RateLimiter is one.
type RatePruner interface {
	PruneRates(ctx context.Context, limit int) (int, error)
}

// RateRequest asks to use Cost units of a bucket's budget.
type RateRequest struct {
	// Bucket names the budget, such as the intake's
	// "<tenant>/<tool>/<limit>/<policy id>". Required: valid UTF-8
	// without NUL bytes (what every store can hold), at most
	// MaxRateBucketLen bytes.
	Bucket string
	// Limit is the number of uses per Window, and the largest burst; > 0
	// and at most one use per microsecond of Window.
	Limit int
	// Window is the period Limit applies to; > 0 and at most
	// MaxRateWindow.
	Window time.Duration
	// Cost is the number of uses this request takes. Default (0) 1; at
	// most Limit, since more could never be admitted.
	Cost int
}

// RateResult is Take's answer for one request.
type RateResult struct {
	// Allowed: the request was admitted and its cost taken.
	Allowed bool
	// Remaining is how many uses of cost 1 the bucket would admit right
	// after this request.
	Remaining int
	// RetryAfter, for a refused request, is how long until the same
	// request would be admitted if nothing else used the bucket; in
	// (0, Limit*interval] unless the store's clock went backwards. Zero
	// when Allowed.
	RetryAfter time.Duration
}

// Bounds of a valid RateRequest.
const (
	// MaxRateBucketLen bounds a bucket name, in bytes.
	MaxRateBucketLen = 1024
	// MaxRateWindow bounds a window: a year (366 days). It keeps every
	// computed duration far from overflowing.
	MaxRateWindow = 366 * 24 * time.Hour
)

// ErrInvalidRateRequest: a request no store may apply (see
// CheckRateRequests). It is the caller's error, not the store's: retrying
// cannot help.
var ErrInvalidRateRequest = errors.New("invalid rate request")

// CheckRateRequests refuses a batch that no store may apply, before any
// work: every RateLimiter calls it, so they refuse the same batches. The
// error wraps ErrInvalidRateRequest.
func CheckRateRequests(rs []RateRequest) error {
	for i, r := range rs {
		if err := r.check(); err != nil {
			return fmt.Errorf("rate request %d (bucket %q): %w: %s", i, r.Bucket, ErrInvalidRateRequest, err)
		}
	}
	return nil
}

// check says what is wrong with r, or nil.
func (r RateRequest) check() error {
	switch {
	case r.Bucket == "":
		return errors.New("empty bucket")
	case len(r.Bucket) > MaxRateBucketLen:
		return fmt.Errorf("bucket is %d bytes, more than %d", len(r.Bucket), MaxRateBucketLen)
	case !utf8.ValidString(r.Bucket) || strings.ContainsRune(r.Bucket, 0):
		// PostgreSQL's TEXT refuses both; bbolt would take them. Refused
		// here so that every store answers alike.
		return errors.New("bucket is not valid UTF-8 or holds a NUL byte")
	case r.Limit <= 0:
		return fmt.Errorf("limit %d is not positive", r.Limit)
	case r.Window <= 0 || r.Window > MaxRateWindow:
		return fmt.Errorf("window %v is not in (0, %v]", r.Window, MaxRateWindow)
	case int64(r.Limit) > int64(r.Window/time.Microsecond):
		// The interval would round up to a microsecond and stretch the
		// effective window far beyond Window.
		return fmt.Errorf("limit %d per %v is more than one use per microsecond", r.Limit, r.Window)
	case r.Cost < 0 || r.Cost > r.Limit:
		return fmt.Errorf("cost %d is not in [0, limit %d]", r.Cost, r.Limit)
	}
	return nil
}

// rateClockSlack is how far past a window ahead of now GCRA still trusts
// a bucket's tat: more than the transactions' and the clocks' skew.
const rateClockSlack = time.Minute

// GCRA applies one checked request (see CheckRateRequests) to a bucket
// whose theoretical arrival time is tat (the zero time for a bucket never
// used), at the store's time now. It returns the bucket's new tat, which
// the store writes if and only if the result is Allowed (otherwise it is
// tat unchanged), and the result. Times are truncated to microseconds,
// the precision of every store.
func GCRA(tat, now time.Time, r RateRequest) (time.Time, RateResult) {
	cost := int64(max(r.Cost, 1))
	// interval = ceil(Window / Limit) in whole microseconds: rounded up
	// so that the rate never exceeds Limit per Window.
	interval := (int64(r.Window) + 1000*int64(r.Limit) - 1) / (1000 * int64(r.Limit))
	window := interval * int64(r.Limit) // the effective window, >= Window
	n := now.UnixMicro()
	start := n // max(tat, now): an idle bucket is simply full
	// A tat more than a window ahead was written by a clock since set
	// back: trusted, it would refuse for as long as the clock went back,
	// a day say, since a refusal never rewrites it. Taken for idle past
	// rateClockSlack beyond the window, at most a window's charges given
	// again; within it, trusted: the transactions of one bucket read
	// their now() at their starts, not in commit order (CockroachDB's on
	// their gateways' clocks), so a charge may see a tat written a little
	// ahead of its own now, which must not empty a full bucket.
	if !tat.IsZero() && tat.UnixMicro()-n <= window+rateClockSlack.Microseconds() {
		start = max(tat.UnixMicro(), n)
	}
	next := start + cost*interval
	if next-n <= window {
		return time.UnixMicro(next).UTC(), RateResult{
			Allowed:   true,
			Remaining: int((window - (next - n)) / interval),
		}
	}
	return tat, RateResult{
		Remaining:  int(max(0, (window-(start-n))/interval)),
		RetryAfter: time.Duration(next-window-n) * time.Microsecond,
	}
}

// ChargeAll applies rs, the checked requests of one admission
// (Admission.Rates), all or nothing to the buckets' tats at the store's
// time now: every store charges an admission so. tats holds the tat of
// each bucket of rs (absent, or the zero time: a bucket never used). The
// requests are applied in order, as Take applies a batch, a later one on
// a bucket seeing what an earlier one took. If every bucket admits its
// request, ChargeAll writes their new tats into tats, for the store to
// write, and reports true; the results are the charges. Otherwise tats is
// left alone and it reports false: a request that was refused has its
// refusal (RetryAfter > 0), and one that would have been admitted the
// zero RateResult, since nothing is charged to it either.
func ChargeAll(tats map[string]time.Time, now time.Time, rs []RateRequest) ([]RateResult, bool) {
	out := make([]RateResult, len(rs))
	next := make(map[string]time.Time, len(rs))
	ok := true
	for i, r := range rs {
		tat, seen := next[r.Bucket]
		if !seen {
			tat = tats[r.Bucket]
		}
		t, res := GCRA(tat, now, r)
		if res.Allowed {
			next[r.Bucket] = t
		} else {
			ok = false
		}
		out[i] = res
	}
	if !ok {
		for i := range out {
			if out[i].Allowed {
				out[i] = RateResult{}
			}
		}
		return out, false
	}
	maps.Copy(tats, next)
	return out, true
}
