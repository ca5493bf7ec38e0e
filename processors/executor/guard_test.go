package executor

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

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
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	const burst = 6
	aGot := make(chan func(), burst)
	for i := range burst {
		go func() {
			if r, err := x.acquire(ctx, a); err == nil {
				aGot <- r
			}
		}()
		waitQueued(t, x, a, i+1)
	}
	b := x.guard(tool, "t_b")
	bGot := make(chan func(), 1)
	go func() {
		if r, err := x.acquire(ctx, b); err == nil {
			bGot <- r
		}
	}()
	waitQueued(t, x, b, 1)

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
