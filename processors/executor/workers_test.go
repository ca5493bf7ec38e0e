package executor

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// TestWorkersReuse: calls that come one after another run on one worker,
// concurrent calls each get one at once, and idle workers end.
func TestWorkersReuse(t *testing.T) {
	w := newWorkers(time.Minute)
	for range 20 {
		done := make(chan struct{})
		w.run(func() { close(done) })
		<-done
		// Let the worker get back to waiting: a call sent before it
		// does gets a worker of its own, which is allowed, only rarer.
		time.Sleep(20 * time.Millisecond)
	}
	if n := w.started.Load(); n > 3 {
		t.Errorf("%d workers started for 20 calls one after another; want them to reuse one", n)
	}

	// Concurrent calls never wait for each other: 16 blocked calls, 16
	// workers.
	gate := make(chan struct{})
	var started sync.WaitGroup
	started.Add(16)
	var ended sync.WaitGroup
	ended.Add(16)
	for range 16 {
		w.run(func() {
			started.Done()
			<-gate
			ended.Done()
		})
	}
	started.Wait()
	close(gate)
	ended.Wait()
	if n := w.live.Load(); n < 16 {
		t.Errorf("%d workers live after 16 concurrent calls; want 16 or more", n)
	}
}

func TestWorkersEndWhenIdle(t *testing.T) {
	w := newWorkers(50 * time.Millisecond)
	var wg sync.WaitGroup
	wg.Add(8)
	for range 8 {
		w.run(func() { wg.Done() })
	}
	wg.Wait()
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if n := w.live.Load(); n != 0 {
			return fmt.Errorf("%d workers still live", n)
		}
		return nil
	})
}
