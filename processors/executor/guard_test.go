package executor

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/schemas"
)

// newBulkhead returns an executor with defaults and a tool whose
// bulkhead has slots slots.
func newBulkhead(slots int) (*Executor, *schemas.Tool) {
	cfg := Config{}
	cfg.setDefaults()
	return newExecutor(cfg), &schemas.Tool{Name: "tool", MaxConcurrency: slots}
}

// newGuarded returns an executor with defaults and tenant's guard of a
// tool whose bulkhead has slots slots. Another tenant has just used the
// tool, so tenant is held to its share: max(1, slots/4).
func newGuarded(t testing.TB, slots int, tenant string) (*Executor, *guard) {
	t.Helper()
	x, tool := newBulkhead(slots)
	g := x.guard(tool, tenant)
	release, err := x.acquire(t.Context(), x.guard(tool, "t_other"))
	if err != nil {
		t.Fatal(err)
	}
	release()
	return x, g
}

// A tenant whose calls were only claimed, none of them sent nor waiting
// for a slot (given back for its open breaker, say), does not hold the
// tenant that calls the tool to its share: that one, alone in using the
// tool, takes every slot. Before, a claim counted as a use, and a tenant
// whose breaker was open kept the others to a quarter of the bulkhead.
func TestClaimedOnlyTenantLeavesTheBulkheadWhole(t *testing.T) {
	x, tool := newBulkhead(4) // a share of 1
	a := x.guard(tool, "t_a")
	x.guard(tool, "t_b") // claimed, never attempted
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	for i := range 4 {
		release, err := x.acquire(ctx, a)
		if err != nil {
			t.Fatalf("t_a's slot %d: %v; want every slot, t_b having sent nothing", i+1, err)
		}
		defer release()
	}
}

// A tenant whose calls its own breaker refuses (open, or half-open with
// its probe out) does not hold the tenant that calls the tool to its
// share: its call takes no slot, so it does not count as using the tool,
// and the other tenant takes every slot. A half-open breaker whose probe
// was held back (excluded) lets the next call through, and is not taken
// for one with its probe out. Before, the call took a slot, marking its
// tenant as using the tool, and only then met its breaker: a tenant
// whose calls all met its open breaker kept the others to a quarter of
// the bulkhead while it sent nothing.
func TestOpenBreakerTenantLeavesTheBulkheadWhole(t *testing.T) {
	fail := func() (httptool.Response, error) { return httptool.Response{}, errors.New("down") }
	for _, tc := range []struct {
		name  string
		probe func() (httptool.Response, error) // nil: the breaker stays open
		out   bool                              // the probe has not returned
		want  error
	}{
		{"open", nil, false, gobreaker.ErrOpenState},
		{"half-open, its probe out", func() (httptool.Response, error) { return httptool.Response{}, nil }, true, gobreaker.ErrTooManyRequests},
		{"half-open, its probe held back", func() (httptool.Response, error) { return httptool.Response{}, frozenBy(control.Action{}) }, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x, tool := newBulkhead(4) // a share of 1
			x.cfg.Breaker.OpenFor = 20 * time.Millisecond
			a, b := x.guard(tool, "t_a"), x.guard(tool, "t_b")
			for range x.cfg.Breaker.MinRequests {
				a.breaker.Execute(fail)
			}
			if tc.probe != nil {
				ledgertest.WaitFor(t, 5*time.Second, func() error {
					if st := a.breaker.State(); st != gobreaker.StateHalfOpen {
						return fmt.Errorf("t_a's breaker %s; want half-open", st)
					}
					return nil
				})
				if tc.out {
					done := make(chan struct{})
					defer close(done)
					go a.breaker.Execute(func() (httptool.Response, error) { <-done; return tc.probe() })
					ledgertest.WaitFor(t, 5*time.Second, func() error {
						if n := a.breaker.Counts().Requests; n != 1 {
							return fmt.Errorf("t_a's breaker admitted %d probes; want 1", n)
						}
						return nil
					})
				} else {
					a.breaker.Execute(tc.probe)
				}
			}
			if got := a.refusal(); got != tc.want {
				t.Fatalf("t_a's breaker (%s) refuses with %v; want %v", a.breaker.State(), got, tc.want)
			}
			if tc.want == nil {
				return
			}
			if _, err := x.attempt(t.Context(), a, tool, "http://tool.invalid", &ledger.Event{}, &processors.Record{}, 1, false, &secrets{}, &completion{}); !errors.Is(err, tc.want) {
				t.Fatalf("t_a's attempt: %v; want %v", err, tc.want)
			}
			ctx, cancel := context.WithTimeout(t.Context(), time.Second)
			defer cancel()
			for i := range 4 {
				release, err := x.acquire(ctx, b)
				if err != nil {
					t.Fatalf("t_b's slot %d: %v; want every slot, t_a's breaker refusing its calls", i+1, err)
				}
				defer release()
			}
		})
	}
}

// queued returns how many calls wait for g's share.
func queued(x *Executor, g *guard) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return g.waiting.Len()
}

// waitQueued waits until n calls wait for g's share.
func waitQueued(t *testing.T, x *Executor, g *guard, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for queued(x, g) != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d calls queued for the share, want %d", queued(x, g), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// Calls queued for a tenant's share get it in the order they came, one
// per slot given back, and the others stay queued.
func TestBulkheadQueueFirstComeFirstServed(t *testing.T) {
	x, g := newGuarded(t, 1, "t_a")
	release, err := x.acquire(t.Context(), g)
	if err != nil {
		t.Fatal(err)
	}
	const n = 5
	got := make(chan int, n)
	releases := make(chan func(), n)
	for i := range n {
		go func() {
			r, err := x.acquire(t.Context(), g)
			if err != nil {
				t.Error(err)
				return
			}
			got <- i
			releases <- r
		}()
		waitQueued(t, x, g, i+1)
	}
	for i := range n {
		release()
		select {
		case w := <-got:
			if w != i {
				t.Fatalf("slot %d went to call %d, want %d (arrival order)", i, w, i)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("slot %d given back, no queued call got it", i)
		}
		if q := queued(x, g); q != n-1-i {
			t.Fatalf("after slot %d: %d calls queued, want %d", i, q, n-1-i)
		}
		release = <-releases
	}
	release()
	if g.held != 0 {
		t.Fatalf("held %d slots after every call gave its back", g.held)
	}
}

// A tenant that filled the bulkhead while alone on the tool, and queued
// more calls, does not keep a tenant that comes then waiting behind its
// queue: the newcomer takes the next slot given back, and the first
// tenant's queued calls wait until it holds less than its share. Before,
// a call past its share's check queued for the bulkhead's slots with
// every other such call, first come first served, and the newcomer's
// waited for the whole burst: with a tool that hangs, a timeout per slot
// of it.
func TestBulkheadNewTenantNotBehindAQueue(t *testing.T) {
	x, tool := newBulkhead(4) // a share of 1
	a := x.guard(tool, "t_a")
	var releases []func()
	for range 4 {
		r, err := x.acquire(t.Context(), a)
		if err != nil {
			t.Fatal(err)
		}
		releases = append(releases, r)
	}
	const burst = 6
	aGot, bGot := queueBurst(t, x, a, x.guard(tool, "t_b"), burst)

	releases[0]()
	select {
	case r := <-bGot:
		defer r()
	case <-aGot:
		t.Fatal("a slot given back went to t_a's queued call, t_b's waiting")
	case <-time.After(10 * time.Second):
		t.Fatal("a slot given back, t_b's queued call did not get it")
	}
	// t_a holds 3, then 1: no less than its share while t_b uses the
	// tool, so its queue waits.
	releases[1]()
	releases[2]()
	if q := queued(x, a); q != burst {
		t.Fatalf("t_a holding its share: %d of its calls queued; want all %d", q, burst)
	}
	releases[3]()
	select {
	case r := <-aGot:
		defer r()
	case <-time.After(10 * time.Second):
		t.Fatal("t_a holding none, its first queued call got no slot")
	}
	if q := queued(x, a); q != burst-1 {
		t.Errorf("t_a holding its share again: %d of its calls queued; want %d", q, burst-1)
	}
}

// queueBurst queues burst calls of a for a slot of its tool's bulkhead,
// then one of b, each once the one before is queued; a slot handed to
// one comes on aGot or bGot. The calls still queued give up when t ends.
func queueBurst(t *testing.T, x *Executor, a, b *guard, burst int) (aGot, bGot chan func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	t.Cleanup(cancel)
	aGot, bGot = make(chan func(), burst), make(chan func(), 1)
	for i := range burst {
		go func() {
			if r, err := x.acquire(ctx, a); err == nil {
				aGot <- r
			}
		}()
		waitQueued(t, x, a, i+1)
	}
	go func() {
		if r, err := x.acquire(ctx, b); err == nil {
			bGot <- r
		}
	}()
	waitQueued(t, x, b, 1)
	return aGot, bGot
}

// With a bulkhead of one slot (a share of one), a tenant that comes while
// another's burst is queued takes the next slot given back: of tenants
// holding as few slots, the one served least recently goes first. Before,
// the giver held none once it gave its slot back, both tied at none, and
// the tie went to the earliest queued call: the newcomer waited behind
// the whole burst.
func TestBulkheadOneSlotNewTenantNotBehindAQueue(t *testing.T) {
	x, tool := newBulkhead(1)
	a, b := x.guard(tool, "t_a"), x.guard(tool, "t_b")
	release, err := x.acquire(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}
	const burst = 5
	aGot, bGot := queueBurst(t, x, a, b, burst)

	release()
	select {
	case r := <-bGot:
		r()
	case r := <-aGot:
		q := queued(x, a)
		r()
		t.Fatalf("the slot given back went to t_a's queued call (%d of its %d still queued), t_b's waiting", q, burst)
	case <-time.After(10 * time.Second):
		t.Fatal("the slot given back went to no queued call")
	}
	select {
	case r := <-aGot:
		defer r()
	case <-time.After(10 * time.Second):
		t.Fatal("t_b gave its slot back, t_a's first queued call did not get it")
	}
}

// A queued call that gives up leaves the queue, and the slot goes to the
// next; a call handed the slot as it gives up passes the slot on. Either
// way no slot is lost: every call that does not give up gets one.
func TestBulkheadQueueCancelLosesNoSlot(t *testing.T) {
	for round := range 200 {
		x, g := newGuarded(t, 8, "t_a")
		const n = 40
		var wg sync.WaitGroup
		acquired := make(chan func(), n)
		for i := range n {
			ctx, cancel := context.WithCancel(t.Context())
			if i%2 == 0 {
				// Give up at about the time the slots are handed on.
				time.AfterFunc(time.Duration(i%7)*100*time.Microsecond, cancel)
			} else {
				defer cancel()
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				r, err := x.acquire(ctx, g)
				if err != nil {
					if ctx.Err() == nil {
						t.Errorf("round %d: acquire: %v", round, err)
					}
					return
				}
				acquired <- r
			}()
		}
		// Release each slot taken, until every call got one or gave up.
		finished := make(chan struct{})
		go func() { wg.Wait(); close(finished) }()
		got := 0
	loop:
		for {
			select {
			case r := <-acquired:
				got++
				r()
			case <-finished:
				for len(acquired) > 0 {
					got++
					(<-acquired)()
				}
				break loop
			case <-time.After(10 * time.Second):
				t.Fatalf("round %d: calls stuck with %d queued, %d held: a slot was lost", round, queued(x, g), g.held)
			}
		}
		if got < n/2 {
			t.Fatalf("round %d: %d calls got a slot, want every one of the %d that did not give up", round, got, n/2)
		}
		x.mu.Lock()
		held, q := g.held, g.waiting.Len()
		inUse, tenants := g.tg.inUse, len(g.tg.waiting)
		x.mu.Unlock()
		if held != 0 || q != 0 || inUse != 0 || tenants != 0 {
			t.Fatalf("round %d: after all: %d held, %d queued, %d slots taken, %d tenants waiting; want 0", round, held, q, inUse, tenants)
		}
	}
}

// BenchmarkBulkheadQueue measures the CPU a slot handed on costs while
// many calls wait for their tenant's share, as under overload. Slots are
// given back one at a time with a pause between, as calls end, so the
// waiters settle in between; cpu-ns/op is the process's CPU per slot
// handed on (wall time is mostly the pause).
func BenchmarkBulkheadQueue(b *testing.B) {
	for _, waiting := range []int{16, 512} {
		b.Run(fmt.Sprintf("waiting=%d", waiting), func(b *testing.B) {
			x, g := newGuarded(b, 1, "t_a")
			ctx, cancel := context.WithCancel(b.Context())
			release, err := x.acquire(ctx, g)
			if err != nil {
				b.Fatal(err)
			}
			// Each call that gets the slot hands its release over and
			// queues again.
			holders := make(chan func())
			var wg sync.WaitGroup
			for range waiting {
				wg.Go(func() {
					for {
						r, err := x.acquire(ctx, g)
						if err != nil {
							return
						}
						select {
						case holders <- r:
						case <-ctx.Done():
							r()
							return
						}
					}
				})
			}
			for queued(x, g) < waiting {
				time.Sleep(time.Millisecond)
			}
			cpu0 := cpuTime(b)
			b.ResetTimer()
			for range b.N {
				release()
				release = <-holders
				time.Sleep(50 * time.Microsecond)
			}
			b.StopTimer()
			b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
			cancel()
			release()
			wg.Wait()
		})
	}
}

// cpuTime is the CPU time the process has used.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
