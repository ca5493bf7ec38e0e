package executor_test

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// A compensation the reconciler asked for (an outcome nobody could
// establish, a policy saying to undo such calls) does not undo a call
// found to have succeeded before it runs: that happens when the park that
// should follow the request is never recorded and a later lookup
// answers. An operator's compensation of a succeeded call still runs.
func TestAutomaticCompensationLeavesASuccess(t *testing.T) {
	for _, tc := range []struct {
		name, user string
		takeover   bool
		want       []string
		code       string
		runs       int
	}{
		{"automatic", executor.ReconcilerUser, false, []string{"denied(" + executor.ReasonNothingToUndo + ")"}, "", 0},
		// Taken over from an owner that died: it cannot be denied, for
		// that owner may have sent it; it is not sent again.
		{"automatic, taken over", executor.ReconcilerUser, true, []string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"},
			"reclaimed_" + executor.ReasonNothingToUndo, 0},
		{"operator", "u_operator", false, []string{"executing", "succeeded"}, "", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			orig, approved := r.admitApproved("kr", time.Now().Add(time.Hour), "")
			x := r.executor(nil)
			out, err := x.Step(t.Context(), []*kgo.Record{approved})
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(decodeAll(t, out.Records))); diff != "" {
				t.Fatalf("the refund (-want +got):\n%s", diff)
			}
			auth := r.admitCompensation(orig.Key(), tc.user)
			if tc.takeover {
				ev := authorizedEvent(t, auth)
				r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
			}
			out, err = x.Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if diff := cmp.Diff(tc.want, summary(evs)); diff != "" {
				t.Errorf("the compensation (-want +got):\n%s", diff)
			} else if code := evs[len(evs)-1].ErrorCode; code != tc.code {
				t.Errorf("error code %q; want %q", code, tc.code)
			}
			if n := r.backend.AppliedIn("cancel_refund", "t_a", "t_a/kr:compensate"); n != tc.runs {
				t.Errorf("cancel_refund applied %d times; want %d", n, tc.runs)
			}
		})
	}
}

// admitCompensation stores orig's compensation (cancel_refund with its
// arguments) as authorized for user, and returns its authorized event.
func (r *rig) admitCompensation(orig ledger.CallKey, user string) *kgo.Record {
	r.t.Helper()
	o, err := r.store.Get(r.t.Context(), orig)
	if err != nil {
		r.t.Fatal(err)
	}
	tree, err := ledger.Decode(o.Arguments, ledger.Limits{})
	if err != nil {
		r.t.Fatal(err)
	}
	hash, err := ledger.ArgumentsHash(orig.TenantID, "cancel_refund", 1, tree)
	if err != nil {
		r.t.Fatal(err)
	}
	ck := orig.CompensationKey()
	ev := ledger.Event{EventID: "e_comp", IdempotencyKey: ck.IdempotencyKey, CallID: "comp_" + o.CallID, Seq: 2, Type: statemachine.EventAuthorized,
		At: time.Now().UTC(), TenantID: ck.TenantID, UserID: user, AgentID: "ledger-compensation", Tool: "cancel_refund", ToolVersion: 1, ArgumentsHash: hash}
	outbox, err := ledger.EncodeEvents([]ledger.Event{ev})
	if err != nil {
		r.t.Fatal(err)
	}
	if _, err := r.store.Admit(r.t.Context(), []processors.Admission{{Key: ck, CallID: ev.CallID, ArgumentsHash: hash, Tool: "cancel_refund", ToolVersion: 1,
		Arguments: o.Arguments, Status: processors.StatusAuthorized, Seq: 2, Outbox: outbox}}); err != nil {
		r.t.Fatal(err)
	}
	rec, err := ev.Record("toolcalls.events")
	if err != nil {
		r.t.Fatal(err)
	}
	return rec
}

// The success of a compensation read twice in one batch (its outbox
// appended again after a lost transaction) records the original call
// compensated once, in that step; it used to fail the step on the second
// copy, and the redelivery then appended nothing. The batch also holds
// an earlier outcome_unknown of the same compensation, which the
// reconciler has nothing to do with by now: it must not hide the success.
func TestCompensationSuccessTwiceInABatch(t *testing.T) {
	r := newRig(t)
	orig, approved := r.admitApproved("kr", time.Now().Add(time.Hour), "")
	x := r.executor(nil)
	if _, err := x.Step(t.Context(), []*kgo.Record{approved}); err != nil {
		t.Fatal(err)
	}
	out, err := x.Step(t.Context(), []*kgo.Record{r.admitCompensation(orig.Key(), "u_operator")})
	if err != nil {
		t.Fatal(err)
	}
	var succeeded *kgo.Record
	for _, rec := range out.Records {
		if string(ledger.Header(rec, ledger.HeaderEventType)) == string(statemachine.EventSucceeded) {
			succeeded = rec
		}
	}
	if succeeded == nil {
		t.Fatalf("the compensation did not succeed: %v", summary(decodeAll(t, out.Records)))
	}
	unknown := decodeAll(t, []*kgo.Record{succeeded})[0]
	unknown.Type, unknown.Seq, unknown.EventID = statemachine.EventOutcomeUnknown, unknown.Seq-1, "e_unknown"
	unknownRec, err := unknown.Record("toolcalls.events")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range r.reconcileAll(r.reconciler(), unknownRec, succeeded, succeeded) {
		if e.Key() == orig.Key() && e.Seq > orig.Seq+2 {
			got = append(got, string(e.Type))
		}
	}
	if diff := cmp.Diff([]string{"compensated"}, got); diff != "" {
		t.Errorf("the original's new events (-want +got):\n%s", diff)
	}
	if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusCompensated {
		t.Errorf("original: %v, %v; want compensated", rec.Status, err)
	}
}
