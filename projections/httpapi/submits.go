package httpapi

import (
	"fmt"
	"net/http"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/toolcall-ledger/ledger/ledger/httpjson"
)

// DefaultSubmitRate is Config.SubmitRate's default: calls a second of
// one tenant, a tenth of what the intake on two cores holds of all
// tenants together.
const DefaultSubmitRate = 500

// submitPruneFloor is how many tenants' buckets submitBudget holds
// before it first looks for full ones to forget.
const submitPruneFloor = 1024

// submitBudget bounds each tenant's submissions through this API: a token
// bucket per tenant, refilled at rate a second and holding at most burst.
// One tenant's flood is refused here (with agents' authentication, before
// its envelopes are read) instead of reaching the request topic, where
// the other tenants' calls would queue behind it at the intake (whose
// @rate_limit refuses a call only once it has read the envelope). The
// buckets are this process's: n API processes admit a tenant n times the
// rate.
type submitBudget struct {
	rate  rate.Limit
	burst int
	now   func() time.Time

	mu      sync.Mutex
	buckets map[string]*rate.Limiter
	// pruneAt is the number of buckets at which take forgets the full
	// ones: twice what the last pruning kept, so that pruning is paid
	// for by the buckets made since.
	pruneAt int
}

// newSubmitBudget returns the budget, or nil (no bound) for a rate of 0.
func newSubmitBudget(perSecond float64, burst int, now func() time.Time) *submitBudget {
	if perSecond <= 0 {
		return nil
	}
	return &submitBudget{rate: rate.Limit(perSecond), burst: max(burst, 1), now: now,
		buckets: make(map[string]*rate.Limiter), pruneAt: submitPruneFloor}
}

// take charges one submission to tenant, or says how long until the
// tenant's bucket admits one.
func (b *submitBudget) take(tenant string) (retryAfter time.Duration, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	// Read under the lock, so that the buckets see their times in
	// order: a take dated before the bucket's last moves its clock back,
	// and the next refills that span again.
	now := b.now()
	lim := b.buckets[tenant]
	if lim == nil {
		if len(b.buckets) >= b.pruneAt {
			b.prune(now)
		}
		lim = rate.NewLimiter(b.rate, b.burst) // full
		b.buckets[tenant] = lim
	}
	// Under b.mu: nothing takes between the look and the take.
	if tokens := lim.TokensAt(now); tokens < 1 {
		return time.Duration((1 - tokens) / float64(b.rate) * float64(time.Second)), false
	}
	lim.AllowN(now, 1)
	return 0, true
}

// prune forgets the buckets that are full again, which mean the same as
// none: tenant names from envelopes that nothing verified (no Caller)
// would otherwise pile up.
func (b *submitBudget) prune(now time.Time) {
	for t, lim := range b.buckets {
		if lim.TokensAt(now) >= float64(b.burst) {
			delete(b.buckets, t)
		}
	}
	b.pruneAt = max(submitPruneFloor, 2*len(b.buckets))
}

// admit charges a submission of tenant, or answers 429
// too_many_submissions with Retry-After (whole seconds, rounded up) and
// returns false. Nothing of the request is published either way.
func (s *Server) admit(w http.ResponseWriter, tenant string) bool {
	if s.submits == nil {
		return true
	}
	d, ok := s.submits.take(tenant)
	if ok {
		return true
	}
	httpjson.SetRetryAfter(w, d)
	writeError(w, http.StatusTooManyRequests, apiError{Code: "too_many_submissions",
		Message: fmt.Sprintf("your tenant submits more than %g calls a second (bursts of %d) through this API; nothing was published: send it again after Retry-After, with the same idempotency key it is the same call", float64(s.submits.rate), s.submits.burst)})
	return false
}
