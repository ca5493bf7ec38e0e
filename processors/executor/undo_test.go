package executor_test

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
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

// recordingCompensator records the compensations asked for, and asks for
// nothing itself.
type recordingCompensator struct{ asked []ledger.CallKey }

func (c *recordingCompensator) Compensate(_ context.Context, _ identity.Identity, key ledger.CallKey, _ string) (ledger.CallKey, []ledger.Event, error) {
	c.asked = append(c.asked, key)
	return key.CompensationKey(), nil, nil
}

// failingMoves is the store with its first n moves failing.
type failingMoves struct {
	processors.Store
	n int
}

func (f *failingMoves) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	if f.n > 0 {
		f.n--
		return nil, errors.New("store unavailable")
	}
	return f.Store.Move(ctx, ms)
}

// A call whose outcome no lookup can establish, under a policy that says
// to undo such calls, is parked first and its compensation asked for only
// once the park is recorded: when the park does not land and a later
// lookup finds the call applied, nothing asks to undo it. Before, the
// compensation was asked for while the park was only decided.
func TestUndoAskedOnlyOnceParked(t *testing.T) {
	r := newRig(t)
	_, unknown := r.unknownRefundToUndo()
	comp := &recordingCompensator{}
	store := &failingMoves{Store: r.store, n: 1}
	rc := r.undoingReconciler(store, comp)
	if _, err := rc.Step(t.Context(), []*kgo.Record{unknown}); err == nil {
		t.Fatal("the step whose park failed succeeded")
	}
	if len(comp.asked) != 0 {
		t.Errorf("compensations asked for although the park failed: %v", comp.asked)
	}
	// Redelivered, with the lookup answering: the refund stands.
	r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{})
	got := r.reconcile(rc, unknown)
	if diff := cmp.Diff([]string{"succeeded(" + executor.ReasonReconciled + ")"}, got); diff != "" {
		t.Errorf("the redelivery (-want +got):\n%s", diff)
	}
	if len(comp.asked) != 0 {
		t.Errorf("compensations asked for a call found applied: %v", comp.asked)
	}

	// Where the park lands, the compensation is asked for, once.
	r2 := newRig(t)
	orig, unknown2 := r2.unknownRefundToUndo()
	comp2 := &recordingCompensator{}
	rc2 := r2.undoingReconciler(r2.store, comp2)
	if diff := cmp.Diff([]string{"parked(" + executor.ReasonCompensating + ")"}, r2.reconcile(rc2, unknown2)); diff != "" {
		t.Errorf("the park (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]ledger.CallKey{orig.Key()}, comp2.asked); diff != "" {
		t.Errorf("compensations asked for (-want +got):\n%s", diff)
	}
}

// undoingReconciler is the rig's reconciler on store, asking comp for
// compensations.
func (r *rig) undoingReconciler(store executor.ReconcilerStore, comp executor.Compensator) *executor.Reconciler {
	r.t.Helper()
	rc, err := executor.NewReconciler(executor.ReconcilerConfig{
		Registry: r.reg, Store: store, Looker: httptool.New(httptool.Config{}), BaseURL: r.url,
		Backoff: time.Millisecond, SweepEvery: time.Hour, Compensator: comp,
	})
	if err != nil {
		r.t.Fatal(err)
	}
	return rc
}

// unknownRefundToUndo runs a refund under a policy that says to undo
// unknown outcomes into outcome_unknown (applied, its answer lost), with
// its status lookup failing; it returns the approved event and the
// outcome_unknown record.
func (r *rig) unknownRefundToUndo() (ledger.Event, *kgo.Record) {
	r.t.Helper()
	ev, approved := r.admitApproved("kr", time.Now().Add(time.Hour), "", "undo_unknown")
	r.backend.SetFault(demobackend.ToolRefundOrder, demobackend.Fault{ApplyThenDrop: true})
	unknown := r.unknown(approved)
	r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{FailStatus: http.StatusServiceUnavailable})
	return ev, unknown
}
