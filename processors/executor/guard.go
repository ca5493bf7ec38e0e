package executor

import (
	"container/list"
	"context"
	"crypto/rand"
	"errors"
	"sync"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/schemas"
)

// This file holds what keeps one tenant's trouble with a tool from
// reaching the other tenants: bulkheads and breakers per tool and tenant,
// and the calls in flight that steps carry over instead of waiting for.

// toolGuard is one tool's bulkhead, shared by its tenants, and the
// tenants' guards. It is under Executor.mu.
type toolGuard struct {
	size    int // MaxConcurrency: attempts in flight for all tenants
	inUse   int // slots held
	share   int // the slots one tenant may hold while others use the tool
	tenants map[string]*guard
	// waiting are the tenants with calls queued for a slot: a slot is
	// handed on among them alone, not among every tenant of the tool.
	waiting map[*guard]struct{}
	// queued numbers the calls queued for a slot, in the order they
	// came: of the tenants otherwise equal, the one whose first call
	// came first goes first.
	queued uint64
	// served numbers the slots taken, in the order they were taken:
	// of the tenants holding as few, the one served least recently
	// goes first (guard.served).
	served uint64
	// recent are the last two distinct tenants to use the tool, the
	// latest first: enough to tell whether another tenant than a given
	// one used it lately.
	recent [2]use
}

type use struct {
	tenant string
	at     time.Time
}

// used notes that tenant used the tool at now.
func (tg *toolGuard) used(tenant string, now time.Time) {
	if tg.recent[0].tenant != tenant {
		tg.recent[1] = tg.recent[0]
	}
	tg.recent[0] = use{tenant, now}
}

// alone reports whether no tenant but tenant used the tool within w.
func (tg *toolGuard) alone(tenant string, now time.Time, w time.Duration) bool {
	for _, u := range tg.recent {
		if u.tenant != "" && u.tenant != tenant && now.Sub(u.at) < w {
			return false
		}
	}
	return true
}

// guard is one tenant's part of a tool: its circuit breaker for the tool
// and its share of the tool's bulkhead. Apart from breaker, it is under
// Executor.mu.
type guard struct {
	tool, tenant string
	tg           *toolGuard
	breaker      *gobreaker.CircuitBreaker[httptool.Response]

	held     int       // slots of the tool's bulkhead the tenant holds
	waiting  list.List // the tenant's calls queued for a slot (waiter), in the order they came
	users    int       // calls and lookups holding the guard: it is not pruned meanwhile
	slow     int       // the tenant's calls to the tool running past a step's budget
	lastUsed time.Time
	// served is the number (toolGuard.served) of the last slot the
	// tenant took; 0: none yet.
	served uint64
}

// refusal is the error g's breaker would refuse a call with now
// (gobreaker.ErrOpenState, ErrTooManyRequests), or nil if it would let
// one through. Execute decides the race with a call admitted meanwhile.
func (g *guard) refusal() error {
	switch g.breaker.State() {
	case gobreaker.StateOpen:
		return gobreaker.ErrOpenState
	case gobreaker.StateHalfOpen:
		// Its probes are out; one excluded (held back) does not count,
		// as Execute does not count it.
		if c := g.breaker.Counts(); c.Requests-min(c.TotalExclusions, c.Requests) >= probes {
			return gobreaker.ErrTooManyRequests
		}
	}
	return nil
}

// waiter is a call queued for a slot: ready is closed when it is handed
// one.
type waiter struct {
	ready chan struct{}
	n     uint64 // its place in the tool's queue (toolGuard.queued)
}

// acquire takes a slot of the tool's bulkhead for g's tenant, waiting
// until ctx is done. The tenant takes at most its share of the bulkhead
// while other tenants use the tool (within a breaker window), so its
// hanging calls leave the rest to them; alone, it may take every slot.
//
// A call that cannot take a slot at once queues for one, and a slot
// given back goes to one queued call (handOffLocked): of the tenants
// that may take it, the one holding the fewest slots, then the one
// served least recently (the giver, one slot fewer once it gave it back,
// may tie with a newcomer: with a share of one, at none), then the one
// whose first queued call came first. So a tenant that filled the
// bulkhead and queued a burst while alone does not keep a tenant that
// comes then waiting behind its burst: that tenant's call takes the next
// slot given back, and the first tenant's calls wait until it holds less
// than its share. One wake-up per slot, however many wait: waking them
// all to race for it cost time quadratic in the queue, which under
// overload (thousands of claimed calls waiting for a bulkhead of 16)
// took half the executor's CPU.
func (x *Executor) acquire(ctx context.Context, g *guard) (release func(), err error) {
	now := x.cfg.Now()
	tg := g.tg
	x.mu.Lock()
	// A share may have become free without a slot given back (the
	// other tenants went quiet): let those queued go first.
	x.handOffLocked(tg, now)
	if g.waiting.Len() == 0 && tg.inUse < tg.size && x.mayHoldLocked(g, now) {
		x.holdLocked(g, now)
		x.mu.Unlock()
	} else {
		tg.queued++
		w := waiter{ready: make(chan struct{}), n: tg.queued}
		el := g.waiting.PushBack(w)
		tg.waiting[g] = struct{}{}
		// A call that waits for a slot uses the tool: its tenant is one
		// of those the others leave slots for. One only claimed is not
		// (given back for its tenant's open breaker, say): it does not
		// hold the tenants that do call the tool to their shares.
		tg.used(g.tenant, now)
		x.mu.Unlock()
		select {
		case <-w.ready:
		case <-ctx.Done():
			x.mu.Lock()
			select {
			case <-w.ready:
				// Handed a slot just now: pass it on.
				x.mu.Unlock()
				x.giveBack(g)
			default:
				g.waiting.Remove(el)
				if g.waiting.Len() == 0 {
					delete(tg.waiting, g)
				}
				x.mu.Unlock()
			}
			return nil, ctx.Err()
		}
	}
	return func() { x.giveBack(g) }, nil
}

// mayHoldLocked reports whether g's tenant may hold one more slot of the
// tool: it holds less than its share, or no other tenant uses the tool.
func (x *Executor) mayHoldLocked(g *guard, now time.Time) bool {
	return g.held < g.tg.share || g.tg.alone(g.tenant, now, x.cfg.Breaker.Window)
}

func (x *Executor) holdLocked(g *guard, now time.Time) {
	g.held++
	g.tg.inUse++
	g.tg.used(g.tenant, now)
	g.tg.served++
	g.served = g.tg.served
}

// handOffLocked hands the tool's free slots to the calls queued for one,
// as far as their tenants' shares allow: each to the first queued call of
// the tenant that holds the fewest slots, of those equal the one served
// least recently, then the one queued first.
func (x *Executor) handOffLocked(tg *toolGuard, now time.Time) {
	for tg.inUse < tg.size && len(tg.waiting) > 0 {
		var next *guard
		for g := range tg.waiting {
			if !x.mayHoldLocked(g, now) {
				continue
			}
			if next == nil || g.held < next.held || g.held == next.held && (g.served < next.served || g.served == next.served && first(g) < first(next)) {
				next = g
			}
		}
		if next == nil {
			return
		}
		x.holdLocked(next, now)
		close(next.waiting.Remove(next.waiting.Front()).(waiter).ready)
		if next.waiting.Len() == 0 {
			delete(tg.waiting, next)
		}
	}
}

// first is the place in the tool's queue of g's first queued call.
func first(g *guard) uint64 { return g.waiting.Front().Value.(waiter).n }

// giveBack ends the tenant's hold on a slot and hands the tool's free
// slots on.
func (x *Executor) giveBack(g *guard) {
	now := x.cfg.Now()
	x.mu.Lock()
	defer x.mu.Unlock()
	g.held--
	g.tg.inUse--
	x.handOffLocked(g.tg, now)
}

func newExecutor(cfg Config) *Executor {
	noWait, cancel := context.WithCancel(context.Background())
	cancel()
	return &Executor{
		cfg: cfg, guards: make(map[string]*toolGuard), running: make(map[ledger.CallKey]struct{}), held: make(map[ledger.CallKey]processors.Release), unwaited: make(map[*flight]struct{}), done: make(chan *flight), draining: make(chan struct{}), wake: make(chan struct{}, 1),
		journalID: cfg.Owner + "/" + rand.Text()[:13] + "/",
		noWait:    noWait,
	}
}

// guard returns tenant's guard for tool, creating it on first use, and
// holds it until release.
func (x *Executor) guard(tool *schemas.Tool, tenant string) *guard {
	now := x.cfg.Now()
	x.mu.Lock()
	defer x.mu.Unlock()
	x.pruneLocked(now)
	tg, ok := x.guards[tool.Name]
	if !ok {
		n := max(tool.MaxConcurrency, 1)
		tg = &toolGuard{
			size:    n,
			share:   max(1, int(float64(n)*x.cfg.TenantShare)),
			tenants: make(map[string]*guard),
			waiting: make(map[*guard]struct{}),
		}
		x.guards[tool.Name] = tg
	}
	g, ok := tg.tenants[tenant]
	if !ok {
		g = &guard{
			tool: tool.Name, tenant: tenant, tg: tg,
			breaker: x.newBreaker(tool, tenant),
		}
		tg.tenants[tenant] = g
	}
	g.users++
	g.lastUsed = now
	return g
}

// release gives back a guard taken with Executor.guard.
func (x *Executor) release(g *guard) {
	now := x.cfg.Now()
	x.mu.Lock()
	defer x.mu.Unlock()
	g.users--
	g.lastUsed = now
}

// pruneLocked forgets the guards of tenants that have not used a tool for
// a breaker window plus its open time, so that memory follows the tenants
// that are active rather than all that ever were. A breaker idle that
// long is closed or half-open; forgetting it closes it.
func (x *Executor) pruneLocked(now time.Time) {
	idle := x.cfg.Breaker.Window + x.cfg.Breaker.OpenFor
	if now.Sub(x.lastPrune) < idle {
		return
	}
	x.lastPrune = now
	for _, tg := range x.guards {
		for tenant, g := range tg.tenants {
			if g.users == 0 && now.Sub(g.lastUsed) >= idle {
				delete(tg.tenants, tenant)
			}
		}
	}
}

// probes is how many calls a half-open breaker lets through to try the
// tool (gobreaker's MaxRequests).
const probes = 1

// breakerBuckets is how many buckets a breaker's window rolls in: a
// request is counted in the bucket it started in, however long it takes.
// In a fixed window (gobreaker's without BucketPeriod), a request that
// ended in the next window was dropped, a timeout most of all.
const breakerBuckets = 10

func (x *Executor) newBreaker(t *schemas.Tool, tenant string) *gobreaker.CircuitBreaker[httptool.Response] {
	bc := x.cfg.Breaker
	log, m, tool := x.cfg.Logger, x.cfg.Metrics, t.Name
	// Long enough to hold ConsecutiveFailures of the tool's timeouts one
	// after another (a tenant holding one slot of a hung tool).
	window := max(bc.Window, time.Duration(bc.ConsecutiveFailures+1)*t.Timeout())
	return gobreaker.NewCircuitBreaker[httptool.Response](gobreaker.Settings{
		Name:         tool + "/" + tenant,
		MaxRequests:  probes,
		Interval:     window,
		BucketPeriod: max(window/breakerBuckets, time.Millisecond),
		Timeout:      bc.OpenFor,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if c.ConsecutiveFailures >= bc.ConsecutiveFailures {
				return true
			}
			n := c.Requests - min(c.TotalExclusions, c.Requests)
			return n >= bc.MinRequests && float64(c.TotalFailures)/float64(n) >= bc.FailureRatio
		},
		// A tool refusing a bad request is healthy.
		IsSuccessful: func(err error) bool {
			var he *httptool.Error
			return err == nil || errors.As(err, &he) && he.Kind == httptool.Refused
		},
		// A request the kill switch (or an approval's expiry) held back
		// at its gate says nothing of the tool either way: counted a
		// success, it closed a half-open breaker on a tool never heard
		// from. Nor does a request the adapter refused to send
		// (ErrInvalidRequest: a header it cannot carry, a credential
		// over plain http), which never reached the tool.
		IsExcluded: func(err error) bool {
			_, held := errors.AsType[*heldBack](err)
			return held || errors.Is(err, control.ErrStale) || errors.Is(err, httptool.ErrInvalidRequest)
		},
		OnStateChange: func(_ string, from, to gobreaker.State) {
			log.Warn("breaker state change", "tool", tool, "tenant", tenant, "from", from.String(), "to", to.String())
			m.BreakerChanged(tool, to.String())
		},
	})
}

// BreakerStates reports the circuit breakers' states (closed, open,
// half-open), for health pages, keyed "tool/tenant": each tenant has its
// own breaker for each tool. A tenant's breaker that has been idle for a
// breaker window plus its open time is forgotten, which closes it.
func (x *Executor) BreakerStates() map[string]string {
	x.mu.Lock()
	defer x.mu.Unlock()
	m := make(map[string]string)
	for name, tg := range x.guards {
		for tenant, g := range tg.tenants {
			m[name+"/"+tenant] = g.breaker.State().String()
		}
	}
	return m
}

// BulkheadState is one tool's bulkhead: slots held and slots in all.
type BulkheadState struct {
	InUse, Size int
}

// Bulkheads reports each tool's bulkhead, keyed by tool, for metrics and
// health pages: a tool at its size makes its calls wait.
func (x *Executor) Bulkheads() map[string]BulkheadState {
	x.mu.Lock()
	defer x.mu.Unlock()
	m := make(map[string]BulkheadState, len(x.guards))
	for name, tg := range x.guards {
		m[name] = BulkheadState{InUse: tg.inUse, Size: tg.size}
	}
	return m
}

// InFlight reports the calls in flight and their bound (MaxInFlight): at
// the bound, steps stop claiming.
func (x *Executor) InFlight() (n, max int) {
	return x.flights.count(), x.cfg.MaxInFlight
}

// flight is one claimed call running in the background. ended and slow
// are under Executor.mu; c is the call's completion once it ended.
type flight struct {
	key ledger.CallKey
	// started is when the call was launched, on the monotonic clock, as
	// the steps' budgets are counted.
	started time.Time
	g       *guard // nil when the registry does not know the tool
	c       processors.Completion
	ended   bool
	slow    bool // counted in g.slow
	// alone: the call recorded its outcome itself, no step took it
	// (under the executor's mu).
	alone bool
}

// flights counts the calls in flight: launched by a step, and neither
// handed to a step nor recorded on their own yet.
type flights struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n drops to 0
}

func (f *flights) add() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.n == 0 {
		f.idle = make(chan struct{})
	}
	f.n++
}

func (f *flights) done() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n--
	if f.n == 0 {
		close(f.idle)
	}
}

func (f *flights) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n
}

// wait waits until no call is in flight, or ctx is done.
func (f *flights) wait(ctx context.Context) error {
	f.mu.Lock()
	if f.n == 0 {
		f.mu.Unlock()
		return nil
	}
	idle := f.idle
	f.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// launch runs a claimed call in the background. It reports whether the
// step should wait for the call: not when the call's tenant already has
// calls to the tool running past a step's budget, since this one will
// most likely be as slow (or wait for the same share of the bulkhead).
//
// The goroutine is owned by the executor: it ends when the call's
// attempts end, bounded by the call's deadline and lease, and the
// outcome has been handed to a step, or recorded in the store when no
// step will take it: ctx is done (shutdown), Drain began (the loop
// stopped), or none took it within Config.HandoffWait. A claimed call
// runs to its end even when the executor is shutting down, so that its
// outcome is recorded rather than lost to a reclaim.
func (x *Executor) launch(ctx context.Context, tmpl ledger.Event, rec processors.Record, reclaimed bool, prior processors.CallCredential) (*flight, bool) {
	f := &flight{key: rec.Key, started: time.Now()}
	if tool, err := rec.ToolIn(x.cfg.Registry); err == nil {
		f.g = x.guard(tool, rec.Key.TenantID)
	}
	x.mu.Lock()
	x.running[rec.Key] = struct{}{}
	wait := f.g == nil || f.g.slow == 0
	if !wait {
		// While the tenant has calls running past a budget, its new
		// calls to the tool count as slow too: the episode lasts as
		// long as any of them runs, so a hanging tenant costs the
		// others one budget per episode, not one per call that ends.
		// A busy tenant may so stay "slow" after its tool recovered;
		// that costs its own outcomes a tick, nothing else.
		f.slow = true
		f.g.slow++
	}
	x.mu.Unlock()
	x.flights.add()
	go func() {
		c := x.execute(context.WithoutCancel(ctx), &tmpl, &rec, reclaimed, prior, f.g)
		now := x.cfg.Now()
		x.mu.Lock()
		f.c, f.ended = c, true
		if g := f.g; g != nil {
			if f.slow {
				g.slow--
			}
			g.users--
			g.lastUsed = now
		}
		x.mu.Unlock()
		handoff := time.NewTimer(x.cfg.HandoffWait)
		defer handoff.Stop()
		select {
		case x.done <- f:
			return
		case <-ctx.Done():
		case <-x.draining:
		case <-handoff.C:
			x.cfg.Logger.Warn("no step took a finished call's outcome; recorded outside a step", "call_key", f.key.String(), "waited", x.cfg.HandoffWait)
		}
		x.recordAlone(ctx, f)
		x.mu.Lock()
		f.alone = true
		x.mu.Unlock()
		x.landed(f)
		// A step waiting for this call (await), or for room under
		// MaxInFlight, is no longer to wait for it.
		select {
		case x.wake <- struct{}{}:
		default:
		}
	}()
	return f, wait
}

// landed ends f's flight: a step took it, or it recorded itself.
func (x *Executor) landed(f *flight) {
	x.mu.Lock()
	delete(x.running, f.key)
	delete(x.unwaited, f)
	x.mu.Unlock()
	x.flights.done()
}

// leave notes that the step that started f did not wait for it, so that
// the next step that waits at all waits for it too.
func (x *Executor) leave(f *flight) {
	x.mu.Lock()
	x.unwaited[f] = struct{}{}
	x.mu.Unlock()
}

// leaveAll is leave for every call of fs still running, or ended and
// not yet taken by a step: one that recorded itself (alone) is waited
// for by none.
func (x *Executor) leaveAll(fs map[*flight]struct{}) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for f := range fs {
		if !f.alone {
			x.unwaited[f] = struct{}{}
		}
	}
}

// completions are the outcomes of the ended calls fs that are to be
// recorded: those that held a claim (a non-zero epoch).
func completions(fs []*flight) []processors.Completion {
	var cs []processors.Completion
	for _, f := range fs {
		if f.c.Epoch != 0 {
			cs = append(cs, f.c)
		}
	}
	return cs
}

// takeEnded adds to got, without waiting, every call that has ended and
// not yet been handed to a step.
func (x *Executor) takeEnded(got []*flight) []*flight {
	for {
		select {
		case f := <-x.done:
			x.landed(f)
			got = append(got, f)
		default:
			return got
		}
	}
}

// inFlight reports whether this executor runs the call, holds its
// outcome for a step, or holds its claim to give back: its claim is this
// executor's, however late, and neither a redelivery nor the sweep of
// expired leases should take it.
func (x *Executor) inFlight(k ledger.CallKey) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	_, running := x.running[k]
	_, held := x.held[k]
	return running || held
}

// carry marks the calls a step stops waiting for as running past its
// budget: until they end, steps do not wait for their tenants' new calls
// to the same tools.
func (x *Executor) carry(fs map[*flight]struct{}) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for f := range fs {
		x.carryLocked(f)
	}
}

// carryLocked is carry for one call, under x.mu.
func (x *Executor) carryLocked(f *flight) {
	// A call once waited for a whole budget is not waited for again,
	// whichever step started it.
	delete(x.unwaited, f)
	if !f.ended && !f.slow && f.g != nil {
		f.slow = true
		f.g.slow++
	}
}

// outlasted reports whether f has run for a whole step budget by now,
// over however many steps left it: a step need not wait for it to take
// it for slow (carry). Never with no budget.
func (x *Executor) outlasted(f *flight, now time.Time) bool {
	return x.cfg.StepBudget > 0 && now.Sub(f.started) >= x.cfg.StepBudget
}

// stopWaiting is what a step that stopped waiting before its budget was
// spent (the next step's events were fetched) does with the calls of fs
// still running: those that have run a whole budget since their launch
// are carried as slow, as if a step had waited that long for them (so
// that steps stop waiting for their tenants' new calls); the others are
// left to the next step that waits (leaveAll). Were those carried, a
// slow call would mark its tenant's tool as hanging; were all left, a
// hanging call left by step after step under load would be waited for a
// whole budget by the first step that finds nothing fetched (a lull, the
// end of a burst), holding up the outcomes of every call of that step.
func (x *Executor) stopWaiting(fs map[*flight]struct{}) {
	now := time.Now()
	x.mu.Lock()
	for f := range fs {
		if x.outlasted(f, now) {
			x.carryLocked(f)
			delete(fs, f)
		}
	}
	x.mu.Unlock()
	x.leaveAll(fs)
}

// recordAlone records finished calls in the store outside a step's
// output, when no step will append their events (shutdown, or a step
// that failed after taking them): the events follow from the outbox
// through the sweep of unlogged outcomes. A failure here leaves the calls
// to their leases, as a crash would.
func (x *Executor) recordAlone(ctx context.Context, fs ...*flight) {
	x.completeAlone(ctx, completions(fs))
}

// completeAlone records cs in the store outside any step: under no
// journal entry, so they stay unlogged and the sweep appends their events.
func (x *Executor) completeAlone(ctx context.Context, cs []processors.Completion) {
	if len(cs) == 0 {
		return
	}
	for i := range cs {
		cs[i].Journal = ""
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if _, err := x.cfg.Store.Complete(cctx, cs); err != nil {
		x.cfg.Logger.Error("record finished calls; their leases will expire", "calls", len(cs), "err", err)
	}
}

// Drain waits until every call this executor started has ended and been
// handed to a step or recorded in the store, or until ctx is done. Call
// it after the loop's Run returned and before closing the store, and run
// no step after it: calls still running then record their outcomes
// themselves, and Drain lets them finish doing so. It then asks the store one last time to take
// back the claims the executor holds since their release failed
// (releaseClaim). What Drain does not wait for, or give back, is left to
// the leases (see Config.DrainTimeout): a call still held is then taken
// over as one that may have been sent, and its keys are logged.
func (x *Executor) Drain(ctx context.Context) error {
	// Run may have returned with ctx live (the loop stopped, ErrStop):
	// the calls waiting for a step to take their outcomes record them.
	x.drainOnce.Do(func() { close(x.draining) })
	err := x.flights.wait(ctx)
	x.releaseHeld(ctx, true)
	if keys := x.heldKeys(); len(keys) > 0 {
		x.cfg.Logger.Error("claims not given back at shutdown: taken over once their leases lapse, as calls that may have been sent", "call_keys", keys)
	}
	return err
}
