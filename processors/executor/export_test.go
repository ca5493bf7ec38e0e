package executor

import (
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
)

// SetBacklog stands in for the loop's count of fetched records, which
// the executor reads only when it runs on its Loop.
func SetBacklog(x *Executor, backlog func() int64) { x.backlog = backlog }

// EndedUnwaited counts the calls that steps under load did not wait for
// and that have ended, waiting for a step to take them.
func EndedUnwaited(x *Executor) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	n := 0
	for f := range x.unwaited {
		if f.ended {
			n++
		}
	}
	return n
}

// MayAuthorize is the executor loop's Acts: the events that count toward
// its LingerFrom.
var MayAuthorize = mayAuthorize

// LoopConfig is the configuration x.Loop gives its loop for lc.
func LoopConfig(x *Executor, lc ledger.LoopConfig) ledger.LoopConfig { return x.loopConfig(lc) }

// SetSweepLimit sets how many calls one of rc's sweeps lists in a status.
func SetSweepLimit(rc *Reconciler, n int) { rc.sweepLimit = n }

// NotFoundSkew is how long past a tool's timeout a status lookup's not
// found stays not final.
const NotFoundSkew = notFoundSkew

// AttemptCredentialSlack is how long past its attempt's end a call's
// credential may expire.
const AttemptCredentialSlack = attemptCredentialSlack

// NoteLookupsFailing has rc remember that k's lookups have failed since
// since, as if a round of them had failed then, unless it remembers an
// earlier failure.
func NoteLookupsFailing(rc *Reconciler, k ledger.CallKey, since time.Time) {
	rc.failed(k, since, false)
}

// FailingCalls counts the calls rc remembers the failing lookups of.
func FailingCalls(rc *Reconciler) int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return len(rc.failing)
}
