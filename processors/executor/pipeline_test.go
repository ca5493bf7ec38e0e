package executor_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
)

// stepOnce runs one step on recs, commits it, and returns its events by
// call.
func stepOnce(t *testing.T, x *executor.Executor, recs ...*kgo.Record) map[string][]string {
	t.Helper()
	out, err := x.Step(t.Context(), recs)
	if err != nil {
		t.Fatal(err)
	}
	if out.Committed != nil {
		if err := out.Committed(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	return byCall(t, out.Records)
}

// slowCalls is a rig whose create_ticket takes a second for tenant
// t_slow (slow enough that the step after the one that starts a call
// finds it running, however slowly the first returns), its executor with
// a budget far past that (a step that waits gets the call's events), and
// the count of fetched records that executor's steps read, to set.
func slowCalls(t *testing.T) (*rig, *executor.Executor, *atomic.Int64) {
	r := newRig(t)
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: time.Second})
	x := r.executor(func(c *executor.Config) { c.StepBudget = time.Minute })
	backlog := new(atomic.Int64)
	executor.SetBacklog(x, backlog.Load)
	return r, x, backlog
}

// A step waiting for a slow call stops waiting once events for the next
// step are fetched (the calls they authorize would wait behind it): the
// call is left to a later step, which records it, once. Before, the
// step held them for its whole budget (200 ms by default): with slow
// tools at low load, every new call's claim waited behind the calls
// before it.
func TestStepStopsWaitingWhenTheNextEventsArrive(t *testing.T) {
	r, x, backlog := slowCalls(t)
	// The next events arrive while the step waits for the call.
	time.AfterFunc(100*time.Millisecond, func() { backlog.Store(1) })
	out, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_slow", "create_ticket", "a", ticket, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 0 {
		t.Errorf("the step returned %d events; want none (the call carried over, still running)", len(out.Records))
	}
	// It was not waited for a whole budget, so it is not taken for a
	// hanging call, which would stop steps waiting for its tenant's new
	// calls to the tool: the next step, with nothing fetched, waits for
	// it and for the tenant's next call, and records both.
	backlog.Store(0)
	want := []string{"executing", "succeeded"}
	if diff := cmp.Diff(map[string][]string{"t_slow/a": want, "t_slow/b": want}, stepOnce(t, x, r.admitAs("t_slow", "create_ticket", "b", ticket, 0))); diff != "" {
		t.Errorf("the next step (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_slow", "t_slow/a"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// A call that steps under load left (events for the next step were
// fetched each time) and that has run a whole budget since its launch is
// taken for slow by the first step with nothing fetched, which does not
// wait for it: it records the calls it claimed as they end, and the slow
// one is recorded, once, by a later step. Before, that step waited for
// the call as if it were new, up to its whole budget (200 ms by default),
// holding up every outcome of its own: the last calls before a lull
// waited behind a neighbour's hanging call.
func TestLeftCallRunningABudgetIsNotWaitedFor(t *testing.T) {
	const budget = time.Second
	r := newRig(t)
	// Slower than the budget, and than the pause below.
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: 1500 * time.Millisecond})
	x := r.executor(func(c *executor.Config) { c.StepBudget = budget })
	backlog := new(atomic.Int64)
	executor.SetBacklog(x, backlog.Load)
	backlog.Store(1)
	if got := stepOnce(t, x, r.admitAs("t_slow", "create_ticket", "a", ticket, 0)); len(got) != 0 {
		t.Fatalf("the step under load returned %v; want nothing (the call left, running)", got)
	}
	time.Sleep(budget + 100*time.Millisecond)
	backlog.Store(0)
	want := []string{"executing", "succeeded"}
	if diff := cmp.Diff(map[string][]string{"t_fast/b": want}, stepOnce(t, x, r.admitAs("t_fast", "create_ticket", "b", ticket, 0))); diff != "" {
		t.Errorf("the step with nothing fetched, while the left call runs on (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(want, stepUntil(t, x, 10*time.Second, "t_slow/a")["t_slow/a"]); diff != "" {
		t.Errorf("the left call's events (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_slow", "t_slow/a"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// With events already fetched for the next step, a step does not wait for
// the calls it starts (the next step records them while it claims its own
// batch); a step with nothing fetched waits for them, so that their
// outcome never waits for a poll's tick. Either way each call runs once
// and its events come out once.
func TestStepWithBacklogLeavesItsCallsToTheNext(t *testing.T) {
	r, x, backlog := slowCalls(t)

	status := func(k string) processors.Status {
		t.Helper()
		key, _ := ledger.ParseCallKey(k)
		rec, err := r.store.Get(t.Context(), key)
		if err != nil {
			t.Fatal(err)
		}
		return rec.Status
	}
	want := []string{"executing", "succeeded"}

	// A backlog: the step claims the call and returns without it, with
	// an empty output, so that the loop spends no Kafka transaction on
	// it (its offsets go with the next one's).
	backlog.Store(1)
	emptyStep := func(what string, recs ...*kgo.Record) {
		t.Helper()
		out, err := x.Step(t.Context(), recs)
		if err != nil {
			t.Fatal(err)
		}
		if len(out.Records) != 0 || out.Committed != nil || out.Abandoned != nil {
			t.Errorf("%s returned %d records, Committed %t, Abandoned %t; want an empty output", what, len(out.Records), out.Committed != nil, out.Abandoned != nil)
		}
	}
	authorizedA := r.admitAs("t_slow", "create_ticket", "a", ticket, 0)
	emptyStep("step with a backlog", authorizedA)
	if s := status("t_slow/a"); s != processors.StatusExecuting {
		t.Errorf("after the step the call is %s; want executing (claimed before the step returned)", s)
	}
	epoch := func() int64 {
		t.Helper()
		rec, err := r.store.Get(t.Context(), ledger.CallKey{TenantID: "t_slow", IdempotencyKey: "a"})
		if err != nil {
			t.Fatal(err)
		}
		return rec.Epoch
	}
	claimed := epoch()
	// The same batch again (a redelivery before the next transaction):
	// the call in flight here is not claimed again, and nothing comes
	// out; nor from another executor, which finds the call leased.
	emptyStep("the batch delivered again", authorizedA)
	other := r.executor(func(c *executor.Config) { c.Owner = "x-other"; c.StepBudget = time.Minute })
	executor.SetBacklog(other, backlog.Load)
	out, err := other.Step(t.Context(), []*kgo.Record{authorizedA})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 0 || out.Committed != nil || out.Abandoned != nil {
		t.Errorf("another executor's step on the batch returned %d records, Committed %t, Abandoned %t; want an empty output", len(out.Records), out.Committed != nil, out.Abandoned != nil)
	}
	if e := epoch(); e != claimed {
		t.Errorf("after the batch came again the call's epoch is %d; want %d, claimed once", e, claimed)
	}
	// No backlog and no records: the step waits for the call left.
	backlog.Store(0)
	if diff := cmp.Diff(map[string][]string{"t_slow/a": want}, stepOnce(t, x)); diff != "" {
		t.Errorf("step without a backlog (-want +got):\n%s", diff)
	}

	// Steps that all have a backlog still record the calls earlier ones
	// started, once they end.
	backlog.Store(1)
	if got := stepOnce(t, x, r.admitAs("t_slow", "create_ticket", "b", ticket, 0)); len(got) != 0 {
		t.Errorf("step with a backlog returned %v; want no events", got)
	}
	later := stepUntil(t, x, 10*time.Second, "t_slow/b")
	if diff := cmp.Diff(map[string][]string{"t_slow/b": want}, later); diff != "" {
		t.Errorf("later steps with a backlog (-want +got):\n%s", diff)
	}

	for _, k := range []string{"t_slow/a", "t_slow/b"} {
		if s := status(k); s != processors.StatusSucceeded {
			t.Errorf("%s is %s; want succeeded", k, s)
		}
		if n := r.backend.AppliedIn("create_ticket", "t_slow", k); n != 1 {
			t.Errorf("%s applied %d times; want 1", k, n)
		}
	}
}

// A call a step under load did not wait for is waited for by the next
// step without a backlog, once, up to the budget: past it the call is
// carried over like any slow call, and later steps no longer wait for it
// (a hanging call costs the others one budget, not one per step).
func TestCallLeftUnderLoadWaitedForOnce(t *testing.T) {
	r := newRig(t)
	// Within create_ticket's 2s timeout, and longer than the budget by
	// much more than a step takes.
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: 1800 * time.Millisecond})
	x := r.executor(func(c *executor.Config) { c.StepBudget = time.Second })
	var backlog atomic.Int64
	executor.SetBacklog(x, backlog.Load)

	backlog.Store(1)
	if got := stepOnce(t, x, r.admitAs("t_slow", "create_ticket", "a", ticket, 0)); len(got) != 0 {
		t.Errorf("step with a backlog returned %v; want no events", got)
	}
	backlog.Store(0)
	// Waits the budget (1s of the call's 1.8s) and carries the call.
	if got := stepOnce(t, x); len(got) != 0 {
		t.Errorf("first step without a backlog returned %v; want none: the call outlasts the budget", got)
	}
	// Waiting again would return the call's events (it ends within
	// this step's budget); a carried call is not waited for.
	if got := stepOnce(t, x); len(got) != 0 {
		t.Errorf("second step without a backlog returned %v; want none: it must not wait again for a call carried over", got)
	}
	later := stepUntil(t, x, 10*time.Second, "t_slow/a")
	if diff := cmp.Diff(map[string][]string{"t_slow/a": {"executing", "succeeded"}}, later); diff != "" {
		t.Errorf("later steps (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_slow", "t_slow/a"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// shutdownAtClaim is the store, except that once armed its Claim waits
// until a completion was recorded (the step recording the calls that
// ended before it, which runs beside the claim), claims, and then
// cancels the step: shutdown arriving between a claim and the launch of
// the batch it claimed.
type shutdownAtClaim struct {
	executor.Store
	armed     atomic.Bool
	completed chan struct{} // closed by the first Complete while armed
	once      sync.Once
	cancel    context.CancelFunc
}

func (s *shutdownAtClaim) Complete(ctx context.Context, cs []processors.Completion) ([]bool, error) {
	applied, err := s.Store.Complete(ctx, cs)
	if err == nil && s.armed.Load() {
		s.once.Do(func() { close(s.completed) })
	}
	return applied, err
}

func (s *shutdownAtClaim) Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error) {
	if !s.armed.Load() {
		return s.Store.Claim(ctx, cs)
	}
	select {
	case <-s.completed:
	case <-time.After(10 * time.Second):
		return nil, errors.New("test setup: no earlier call was recorded beside the claim")
	}
	res, err := s.Store.Claim(ctx, cs)
	s.cancel()
	return res, err
}

// A step that records earlier calls and finds itself shut down once its
// claim returned still launches the batch it claimed: a claim left
// unlaunched would sit executing until its lease expired and come back
// as outcome_unknown, though the call never ran.
func TestBatchClaimedAtShutdownIsLaunched(t *testing.T) {
	r := newRig(t)
	st := &shutdownAtClaim{Store: r.store, completed: make(chan struct{})}
	x := r.executor(func(c *executor.Config) {
		c.Store = st
		c.StepBudget = time.Minute
	})
	var backlog atomic.Int64
	executor.SetBacklog(x, backlog.Load)

	// Under load: the step starts call a and returns without it.
	backlog.Store(1)
	if got := stepOnce(t, x, r.admitAs("t_a", "create_ticket", "a", ticket, 0)); len(got) != 0 {
		t.Fatalf("step with a backlog returned %v; want no events", got)
	}
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if n := executor.EndedUnwaited(x); n != 1 {
			return fmt.Errorf("%d calls ended; want a", n)
		}
		return nil
	})

	// The next step records a while it claims b, and shutdown comes
	// as the claim returns.
	b := r.admitAs("t_a", "create_ticket", "b", ticket, 0)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	st.cancel = cancel
	st.armed.Store(true)
	if _, err := x.Step(ctx, []*kgo.Record{b}); err == nil {
		t.Error("step shut down mid-way returned no error; want the context's")
	}

	for _, k := range []string{"t_a/a", "t_a/b"} {
		key, _ := ledger.ParseCallKey(k)
		ledgertest.WaitFor(t, 10*time.Second, func() error {
			rec, err := r.store.Get(t.Context(), key)
			if err != nil {
				return err
			}
			if rec.Status != processors.StatusSucceeded {
				return fmt.Errorf("%s is %s; want succeeded (claimed, then launched)", k, rec.Status)
			}
			return nil
		})
		if n := r.backend.AppliedIn("create_ticket", "t_a", k); n != 1 {
			t.Errorf("%s applied %d times; want 1", k, n)
		}
	}
}

// ambiguousEarly is a store whose first recording of a step's early
// outcomes commits and then reports an error, as a commit whose answer
// was lost does.
type ambiguousEarly struct {
	processors.Store
	failed atomic.Bool
}

func (s *ambiguousEarly) Complete(ctx context.Context, cs []processors.Completion) ([]bool, error) {
	applied, err := s.Store.Complete(ctx, cs)
	if err == nil && len(cs) > 0 && strings.HasSuffix(cs[0].Journal, "/early") && s.failed.CompareAndSwap(false, true) {
		return nil, errors.New("connection reset during COMMIT")
	}
	return applied, err
}

// Outcomes recorded while the next batch is claimed, by a write that
// committed but answered with an error: the step goes on without their
// events, and must not settle their journal entry as logged with its own
// commit, or nothing would ever append them. The sweep does.
func TestEarlyRecordFailedAfterCommitIsAppendedBySweep(t *testing.T) {
	r := newRig(t)
	st := &ambiguousEarly{Store: r.store}
	x := r.executor(func(c *executor.Config) { c.Store = st; c.StepBudget = time.Minute })
	var backlog atomic.Int64
	executor.SetBacklog(x, backlog.Load)

	backlog.Store(1)
	if got := stepOnce(t, x, r.admit("create_ticket", "early", ticket, 0)); len(got) != 0 {
		t.Fatalf("step with a backlog returned %v; want no events", got)
	}
	ledgertest.WaitFor(t, 5*time.Second, func() error {
		if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/early"); n != 1 {
			return fmt.Errorf("applied %d times", n)
		}
		return nil
	})
	// Time for the call's goroutine to hand its outcome over.
	time.Sleep(200 * time.Millisecond)
	backlog.Store(0)
	got := stepOnce(t, x, r.admit("create_ticket", "next", ticket, 0))
	if !st.failed.Load() {
		t.Fatal("the early outcome was not recorded as an early one; the test did not exercise the failure")
	}
	if _, ok := got["t_a/early"]; ok {
		t.Fatalf("the step appended the events of an outcome whose recording failed: %v", got)
	}
	// Its entry was settled as not logged at once, not left to the
	// sweep's grace.
	if rec, err := r.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "early"}); err != nil || !rec.Unlogged() {
		t.Errorf("after the step the call's record is %s, seq %d, logged %d (%v); want it unlogged", rec.Status, rec.Seq, rec.LoggedSeq, err)
	}
	evs := byCall(t, r.sweep().Records)
	if diff := cmp.Diff([]string{"executing", "succeeded"}, evs["t_a/early"]); diff != "" {
		t.Errorf("the sweep's events of the call (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/early"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}
