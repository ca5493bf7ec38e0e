package executor

import (
	"sync/atomic"
	"time"
)

// workers runs calls on goroutines that outlive them. A call's goroutine
// grows its stack well past a new goroutine's (the tool's HTTP client, the
// credential's signature), and a new goroutine per call paid for that
// growth, stack copies included, on every call: a few percent of the
// executor's CPU. A worker that finished a call takes the next one; one
// left idle for idleFor ends, so that the workers follow the load and a
// quiet executor holds none.
type workers struct {
	jobs    chan func()
	idleFor time.Duration
	// started and live count the workers ever started and those
	// running or idle.
	started, live atomic.Int64
}

func newWorkers(idleFor time.Duration) *workers {
	// Unbuffered: a send succeeds only when a worker is waiting, so a
	// call never queues behind another one.
	return &workers{jobs: make(chan func()), idleFor: idleFor}
}

// workerIdle is how long a worker waits for another call before it ends:
// long enough to carry a steady load from one step to the next, short
// enough that a burst's workers are gone soon after it.
const workerIdle = 2 * time.Second

// run runs f on an idle worker, or on a new one when none is idle.
func (w *workers) run(f func()) {
	select {
	case w.jobs <- f:
	default:
		go w.work(f)
	}
}

func (w *workers) work(f func()) {
	w.started.Add(1)
	w.live.Add(1)
	defer w.live.Add(-1)
	idle := time.NewTimer(w.idleFor)
	defer idle.Stop()
	for {
		f()
		// Since Go 1.23 Reset leaves no stale tick in the channel.
		idle.Reset(w.idleFor)
		select {
		case f = <-w.jobs:
		case <-idle.C:
			return
		}
	}
}
