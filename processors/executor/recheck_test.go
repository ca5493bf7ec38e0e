package executor_test

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
)

// An approved call whose re-check the policies cannot answer in time is
// not denied: nothing is sent, and its claim is given back (executing, no
// owner). Once the policies answer, the sweep of expired leases claims it
// afresh (not as a takeover, which would make it outcome_unknown) and it
// runs, once. Before, the timeout was the approved call's final denial.
func TestApprovedCallSurvivesAPolicyTimeout(t *testing.T) {
	engine, stalled := processorstest.StallingPolicy(t, processorstest.PolicyDir(t, `@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`))
	r := newRig(t)
	ev, approved := r.admitApproved("kp", time.Now().Add(time.Hour), "")
	x := r.executor(func(c *executor.Config) { c.Policy, c.SweepEvery = engine, time.Nanosecond })

	stalled.Store(true)
	out, err := x.Step(t.Context(), []*kgo.Record{approved})
	if err != nil {
		t.Fatal(err)
	}
	if got := summary(decodeAll(t, out.Records)); len(got) != 0 {
		t.Fatalf("a re-check that timed out appended %v; want nothing (the call waits)", got)
	}
	rec, err := r.store.Get(t.Context(), ev.Key())
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status != processors.StatusExecuting || rec.LeaseOwner != "" || rec.Attempt != 0 {
		t.Errorf("after the timeout the record is %s owned by %q, attempt %d; want executing, given back, attempt 0", rec.Status, rec.LeaseOwner, rec.Attempt)
	}
	// While the policies still cannot answer, the sweep claims it again
	// (a new epoch) and gives it back again.
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		out, err := x.Step(t.Context(), nil)
		if err != nil {
			return err
		}
		if len(out.Records) != 0 {
			t.Fatalf("a second re-check that timed out appended %v; want nothing", summary(decodeAll(t, out.Records)))
		}
		again, err := r.store.Get(t.Context(), ev.Key())
		if err != nil {
			return err
		}
		if again.Epoch == rec.Epoch || again.LeaseOwner != "" {
			return errors.New("not claimed and given back again yet")
		}
		return nil
	})
	if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kp"); n != 0 {
		t.Fatalf("refund applied %d times while the policies could not decide; want 0", n)
	}

	stalled.Store(false)
	var got []string
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		out, err := x.Step(t.Context(), nil)
		if err != nil {
			return err
		}
		got = append(got, summary(decodeAll(t, out.Records))...)
		if len(got) == 0 {
			return errors.New("the call has not run yet")
		}
		return nil
	})
	if diff := cmp.Diff([]string{"executing", "succeeded"}, got); diff != "" {
		t.Errorf("once the policies answer (-want +got):\n%s", diff)
	}
	// A redelivery of the approved event finds it done.
	if out, err := x.Step(t.Context(), []*kgo.Record{approved}); err != nil || len(out.Records) != 0 {
		t.Errorf("redelivery after the run: %d records, %v; want none", len(out.Records), err)
	}
	if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kp"); n != 1 {
		t.Errorf("refund applied %d times; want 1", n)
	}
}

// An approved call runs under the obligations of both its approval-time
// decision and the executor's re-check of it: the policies in force at
// execution (another version, say) mask the currency and ask for a
// sandbox, not the refund's id, and the id the approval-time decision
// masked stays masked in the stored result, while the events record the
// re-check's policy and version with both decisions' obligations. Before,
// the re-check's obligations replaced the approval's: the refund's id was
// stored in the clear, and undo_unknown was lost.
func TestRecheckKeepsTheApprovalsObligations(t *testing.T) {
	engine := processorstest.Policy(t, processorstest.PolicyDir(t, `@id("refunds-v2") @mask("currency") @sandbox
permit (principal, action == Action::"tool::refund_order", resource);`))
	r := newRig(t)
	ev, approved := r.admitApproved("km", time.Now().Add(time.Hour), "", "require_approval", "mask:refund_id", "undo_unknown")
	out, err := r.executor(func(c *executor.Config) { c.Policy = engine }).Step(t.Context(), []*kgo.Record{approved})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	want := []string{"require_approval", "mask:currency", "mask:refund_id", "sandbox", "undo_unknown"}
	for _, e := range evs {
		if diff := cmp.Diff(want, e.Obligations); diff != "" {
			t.Errorf("%s event's obligations (-want +got):\n%s", e.Type, diff)
		}
		if diff := cmp.Diff([]string{"refunds-v2"}, e.PolicyID); diff != "" || e.PolicyVersion != engine.Active().Version() {
			t.Errorf("%s event decided by %v at %s; want [refunds-v2] at %s (the re-check's)", e.Type, e.PolicyID, e.PolicyVersion, engine.Active().Version())
		}
	}
	rec, err := r.store.Get(t.Context(), ev.Key())
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		Content map[string]any `json:"content"`
	}
	if err := json.Unmarshal(rec.Result, &res); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"refund_id", "currency"} {
		if v := res.Content[f]; v != ledger.Redacted {
			t.Errorf("stored result's %s is %v; want %q", f, v, ledger.Redacted)
		}
	}
	if v := res.Content["order_id"]; v != "ord_1" {
		t.Errorf("stored result's order_id is %v; want ord_1 (no policy masks it)", v)
	}
}
