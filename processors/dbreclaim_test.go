package processors_test

// A regression test for a bug the database-fault tests found: a
// reclaimed call that its new owner could not start was recorded failed
// although its first owner had applied it.

import (
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// A call whose first owner applied the effect and died before recording
// it is reclaimed by a second owner whose claim is so slow (a slow
// database) that the lease leaves no time to call the tool. The second
// owner must not record "failed, not_started": the effect happened.
func TestDBReclaimedCallThatCannotStartIsNotFailed(t *testing.T) {
	h := newDBHarness(t, 4)
	h.startIntake("intake-db")
	short := func(owner string) (cfg executor.Config) {
		cfg = h.executorConfig(owner)
		// Lease 2.1s: one 2s attempt, 1ms backoff, 100ms margin.
		cfg.MaxAttempts, cfg.RetryBackoff, cfg.LeaseMargin = 1, time.Millisecond, 100*time.Millisecond
		return cfg
	}
	a := short("executor-a")
	// The first owner's completions fail: it crashed after the effect.
	a.Store = &crashBeforeRecord{Store: h.store, crashes: 1 << 30}
	stopA := h.startExecutor(a)
	envs := h.dbCalls("repro", 1)
	h.submit(envs...)
	waitEffects(h.harness, 1)
	stopA()
	// Three round trips of 1.1s: the reclaim returns after its lease's
	// end minus the margin.
	h.proxy.SetDelay(1100 * time.Millisecond)
	h.startExecutor(short("executor-b"))
	k := envs[0].key()
	c := h.waitSettled(60*time.Second, k)[k]
	last := c.Events[len(c.Events)-1]
	applied := h.backend.AppliedIn(envs[0].Tool, "t_db", k.String())
	if applied != 1 {
		t.Fatalf("%d effects at the tool; want the first owner's one", applied)
	}
	if c.State == statemachine.StateFailed {
		t.Errorf("%s ended failed (%s, %s) with its effect at the tool; want succeeded or outcome_unknown", k, last.Reason, last.ErrorCode)
	}
}
