package executor_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/compensation"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// unreadableKey is the store, except that MarkUndo of key fails.
type unreadableKey struct {
	executor.Store
	key ledger.CallKey
}

func (s unreadableKey) MarkUndo(ctx context.Context, k ledger.CallKey, undoable []processors.Status) (processors.Status, bool, error) {
	if k == s.key {
		return "", false, errors.New("connection reset")
	}
	return s.Store.MarkUndo(ctx, k, undoable)
}

// A compensation whose original call cannot be read sends nothing: it is
// not known whether there is anything to undo (a success the reconciler's
// undo must leave). The claim goes back, to be tried again. Before, the
// check was skipped on a read error, and the undo ran.
func TestCompensationOfAnUnreadableCallSendsNothing(t *testing.T) {
	r := newRig(t)
	orig, approved := r.admitApproved("kr", time.Now().Add(time.Hour), "")
	if _, err := r.executor(nil).Step(t.Context(), []*kgo.Record{approved}); err != nil {
		t.Fatal(err)
	}
	auth := r.admitCompensation(orig.Key(), executor.ReconcilerUser)
	x := r.executor(func(c *executor.Config) { c.Store = unreadableKey{Store: c.Store, key: orig.Key()} })
	out, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if evs := decodeAll(t, out.Records); len(evs) != 0 {
		t.Errorf("the compensation's events %v; want none (given back)", summary(evs))
	}
	if n := r.backend.AppliedIn("cancel_refund", "t_a", "t_a/kr:compensate"); n != 0 {
		t.Errorf("cancel_refund applied %d times; want 0", n)
	}
	r.givenBack(auth)
}

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

// countingSubmitter counts the compensations a compensation.Service
// submits, and submits none.
type countingSubmitter struct{ n int }

func (c *countingSubmitter) Submit(context.Context, *ledger.Envelope, identity.Identity, *schemas.Tool, string) ([]ledger.Event, error) {
	c.n++
	return nil, nil
}

// An operator's request to undo a call settled succeeded while the
// reconciler's automatic compensation of it is pending is refused, saying
// why: it would be that compensation's retry, which does not undo a
// success (it ends nothing_to_undo, its key spent). Before, it was
// answered as if the undo were under way. Another operator's pending
// compensation is one the request can join. One an executor holds may be
// sending, and may yet undo the call: the refusal says to ask again once
// it has ended, not that it will end without running.
func TestOperatorUndoBehindAPendingAutomaticOne(t *testing.T) {
	for _, tc := range []struct {
		asker   string
		claimed bool
		refused bool
		says    string
	}{
		{executor.ReconcilerUser, false, true, "will end without running"},
		{executor.ReconcilerUser, true, true, "is running, and may undo the call"},
		{"u_op1", false, false, ""},
	} {
		r := newRig(t)
		orig, approved := r.admitApproved("kr", time.Now().Add(time.Hour), "")
		if _, err := r.executor(nil).Step(t.Context(), []*kgo.Record{approved}); err != nil {
			t.Fatal(err)
		}
		auth := r.admitCompensation(orig.Key(), tc.asker)
		if tc.claimed {
			ev := authorizedEvent(t, auth)
			r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
		}
		sub := &countingSubmitter{}
		svc, err := compensation.New(compensation.Config{Store: r.store, Registry: r.reg, Intake: sub, Publisher: &recordingPublisher{}})
		if err != nil {
			t.Fatal(err)
		}
		op := identity.Identity{Tenant: "t_a", User: "u_op2", Roles: []string{"operator"}}
		_, _, err = svc.Compensate(t.Context(), op, orig.Key(), "the provider confirmed the refund; undo it")
		if got := errors.Is(err, compensation.ErrAutomaticCompensationPending); got != tc.refused || (sub.n == 0) != tc.refused || tc.refused && !strings.Contains(err.Error(), tc.says) {
			t.Errorf("asked by %s (claimed %v): Compensate = %v, %d submitted; want refused %v, saying %q", tc.asker, tc.claimed, err, sub.n, tc.refused, tc.says)
		}
	}
}

// admitCompensation stores orig's compensation (cancel_refund with its
// arguments) as authorized for user, and returns its authorized event.
func (r *rig) admitCompensation(orig ledger.CallKey, user string) *kgo.Record {
	r.t.Helper()
	return r.admitCompensationIn(orig, user, processors.StatusAuthorized)
}

// admitCompensationIn is admitCompensation in status: authorized, or
// pending (waiting for an approval).
func (r *rig) admitCompensationIn(orig ledger.CallKey, user string, status processors.Status) *kgo.Record {
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
	if status == processors.StatusPending {
		expires := time.Now().Add(time.Hour).UTC()
		ev.Type, ev.ApprovalID, ev.ExpiresAt = statemachine.EventApprovalPending, "ap_comp", &expires
	}
	outbox, err := ledger.EncodeEvents([]ledger.Event{ev})
	if err != nil {
		r.t.Fatal(err)
	}
	if _, err := r.store.Admit(r.t.Context(), []processors.Admission{{Key: ck, CallID: ev.CallID, ArgumentsHash: hash, Tool: "cancel_refund", ToolVersion: 1,
		Arguments: o.Arguments, Status: status, Seq: 2, Outbox: outbox}}); err != nil {
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
	orig, succeeded := r.compensationSucceeded("kr")
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

// compensationSucceeded runs an approved refund under key, then an
// operator's compensation of it, and returns the refund's approved event
// and the record of the compensation's success, not yet reconciled.
func (r *rig) compensationSucceeded(key string) (ledger.Event, *kgo.Record) {
	r.t.Helper()
	orig, approved := r.admitApproved(key, time.Now().Add(time.Hour), "")
	x := r.executor(nil)
	if _, err := x.Step(r.t.Context(), []*kgo.Record{approved}); err != nil {
		r.t.Fatal(err)
	}
	out, err := x.Step(r.t.Context(), []*kgo.Record{r.admitCompensation(orig.Key(), "u_operator")})
	if err != nil {
		r.t.Fatal(err)
	}
	for _, rec := range out.Records {
		if string(ledger.Header(rec, ledger.HeaderEventType)) == string(statemachine.EventSucceeded) {
			return orig, rec
		}
	}
	r.t.Fatalf("the compensation did not succeed: %v", summary(decodeAll(r.t, out.Records)))
	return orig, nil
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
	orig, unknown := r.unknownRefundToUndo()
	comp := &recordingCompensator{}
	store := &failingMoves{Store: r.store, n: 1}
	rc := r.undoingReconciler(store, comp)
	failingLong(rc, orig.Key())
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
	failingLong(rc2, orig.Key())
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
		UnansweredFor: time.Nanosecond, // with failingLong
	})
	if err != nil {
		r.t.Fatal(err)
	}
	return rc
}

// failingLong has rc take the lookups of the calls under keys as failing
// long since, for them to be parked at the first pass whose lookups fail:
// these tests are of what comes after the park.
func failingLong(rc *executor.Reconciler, keys ...ledger.CallKey) {
	for _, k := range keys {
		executor.NoteLookupsFailing(rc, k, time.Unix(0, 0))
	}
}

// sweepingReconciler is a reconciler that asks comp for compensations
// and sweeps every minute of the clock *now, which the test moves; mod,
// if set, edits its config.
func (r *rig) sweepingReconciler(comp executor.Compensator, now *time.Time, mod func(*executor.ReconcilerConfig)) *executor.Reconciler {
	r.t.Helper()
	cfg := executor.ReconcilerConfig{
		Registry: r.reg, Store: r.store, Looker: httptool.New(httptool.Config{}), BaseURL: r.url,
		Backoff: time.Millisecond, SweepEvery: time.Minute, Compensator: comp,
		UnansweredFor: time.Nanosecond, // with failingLong
		Now:           func() time.Time { return *now },
	}
	if mod != nil {
		mod(&cfg)
	}
	rc, err := executor.NewReconciler(cfg)
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

// compensations is a compensation service on r's store, registry and
// intake, and what it publishes.
func (r *rig) compensations() (*compensation.Service, *recordingPublisher) {
	r.t.Helper()
	pub := &recordingPublisher{}
	svc, err := compensation.New(compensation.Config{Store: r.store, Registry: r.reg, Intake: r.in, Publisher: pub})
	if err != nil {
		r.t.Fatal(err)
	}
	return svc, pub
}

// undoRequested takes a refund under undo_unknown to outcome_unknown, its
// status lookups failing, and has a reconciler on the clock now park it
// and ask for its compensation. It returns the call, the compensation
// service and what it published, the reconciler, and the events of that
// step. now is set to the time the call went outcome_unknown.
func (r *rig) undoRequested(now *time.Time) (ledger.Event, *compensation.Service, *recordingPublisher, *executor.Reconciler, []ledger.Event) {
	r.t.Helper()
	orig, unknown := r.unknownRefundToUndo()
	svc, pub := r.compensations()
	*now = time.Now() // after the call went outcome_unknown
	rc := r.sweepingReconciler(svc, now, nil)
	failingLong(rc, orig.Key())
	return orig, svc, pub, rc, r.reconcileAll(rc, unknown)
}

// A compensation a policy asks for whose request fails for a reason that
// may pass (a store or Kafka error, a timeout) is asked for again by the
// reconciler's sweeps, with its gaps doubling, until it exists: exactly
// one compensation call, which undoes the call. A request that failed
// after the intake admitted it is not asked again (the sweep finds the
// call under its key); one refused for good, or failing past
// UndoAttempts, is not asked again and the call is parked again,
// compensation_abandoned, for a human. Before, the first failure was
// the last word: the call stayed parked compensation_requested with no
// compensation, waiting for a human.
func TestUndoRetriedAfterATransientFailure(t *testing.T) {
	refusal := ledger.Event{Type: statemachine.EventDenied, Reason: "invalid_arguments", Detail: "the arguments fail the schema"}
	for _, tc := range []struct {
		name   string
		comp   flakyCompensator
		asks   []int // the sweeps that asked (0: the park's step)
		exists bool  // the compensation call exists in the end
		// restart: another reconciler, which knows nothing of the
		// failure, sweeps after the park (a restart, a second instance).
		restart bool
		sweeps  int // after the park; 10 if 0
	}{
		{"failing before the intake", flakyCompensator{fail: 1}, []int{0, 1}, true, false, 0},
		{"failing before the intake, then a restart", flakyCompensator{fail: 1}, []int{0, 1}, true, true, 0},
		{"failing thrice", flakyCompensator{fail: 3}, []int{0, 1, 2, 4}, true, false, 0},
		{"failing after the intake admitted it", flakyCompensator{fail: 1, after: true}, []int{0}, true, false, 0},
		{"refused for good", flakyCompensator{refuse: &refusal}, []int{0}, false, false, 0},
		{"failing past its attempts", flakyCompensator{fail: 100}, []int{0, 1, 2, 4, 8}, false, false, 0},
		// The last request's answer lost after the intake admitted it:
		// the compensation exists, and the call is not handed to a
		// human as one none was requested for.
		{"failing past its attempts, the last after the intake admitted it", flakyCompensator{fail: 5, lastAfter: true}, []int{0, 1, 2, 4, 8}, true, false, 0},
		// Refused while cancel_refund is frozen, past UndoAttempts: asked
		// again, the gaps doubling up to five sweeps (maxHoldGap), not
		// counted, and admitted once the freeze lifts. Before, the call
		// went to a human after five.
		{"refused while its tool is frozen", flakyCompensator{frozen: 6}, []int{0, 1, 2, 4, 8, 13, 18}, true, false, 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			orig, unknown := r.unknownRefundToUndo()
			svc, pub := r.compensations()
			comp := tc.comp
			comp.Compensator = svc
			sweep := 0
			comp.sweep = &sweep
			now := time.Now()
			const every = time.Minute // sweepingReconciler's
			newReconciler := func() *executor.Reconciler {
				return r.sweepingReconciler(&comp, &now, func(c *executor.ReconcilerConfig) { c.UndoAttempts = 5 })
			}
			rc := newReconciler()
			failingLong(rc, orig.Key())
			var parks []string
			for _, e := range r.reconcileAll(rc, unknown) {
				if e.Key() == orig.Key() && e.Type == statemachine.EventParked {
					parks = append(parks, e.Reason)
				}
			}
			if tc.restart {
				rc = newReconciler()
			}
			// Sweeps a minute apart: the retries come at the first,
			// second, fourth, eighth; the call is parked again at most
			// once.
			sweeps := max(tc.sweeps, 10)
			for sweep < sweeps {
				sweep++
				now = now.Add(every)
				for _, e := range r.reconcileAll(rc) {
					if e.Key() == orig.Key() && e.Type == statemachine.EventParked && e.Seq > orig.Seq+3 {
						parks = append(parks, e.Reason)
					}
				}
			}
			if diff := cmp.Diff(tc.asks, comp.asked); diff != "" {
				t.Errorf("the sweeps that asked for the compensation (-want +got):\n%s", diff)
			}
			ck := orig.Key().CompensationKey()
			_, err := r.store.Get(t.Context(), ck)
			if exists := err == nil; exists != tc.exists {
				t.Fatalf("compensation call exists: %v (%v); want %v", exists, err, tc.exists)
			}
			want := []string{executor.ReasonCompensating}
			if !tc.exists {
				want = append(want, executor.ReasonUndoAbandoned)
			}
			if diff := cmp.Diff(want, parks); diff != "" {
				t.Errorf("the call's parks (-want +got):\n%s", diff)
			}
			if !tc.exists {
				// Handed to a human: a request of another reconciler,
				// which listed the call before, is refused, and starts
				// nothing. Before, any parked call was taken.
				reconciler := identity.Identity{User: executor.ReconcilerUser, Tenant: "t_a", Roles: []string{"operator"}}
				if _, _, err := svc.Compensate(t.Context(), reconciler, orig.Key(), "undo_unknown"); !errors.Is(err, compensation.ErrSettled) {
					t.Errorf("another reconciler's request once the call was handed to a human = %v; want ErrSettled", err)
				}
				if _, err := r.store.Get(t.Context(), ck); err == nil {
					t.Errorf("a compensation call exists; want none")
				}
				return
			}
			// The one compensation call runs once and undoes the call.
			out, err := r.executor(nil).Step(t.Context(), pub.authorized(t, ck))
			if err != nil {
				t.Fatal(err)
			}
			r.reconcileAll(rc, out.Records...)
			if n := r.backend.AppliedIn("cancel_refund", "t_a", ck.String()); n != 1 {
				t.Errorf("cancel_refund applied %d times; want 1", n)
			}
			if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusCompensated {
				t.Errorf("the call is %s (%v); want compensated", rec.Status, err)
			}
		})
	}
}

// flakyCompensator asks comp for compensations, except that its first
// fail requests fail with an error that may pass, before asking or, with
// after, once asked (with lastAfter, the last of them only), and its
// first frozen ones are refused, the tool frozen; with refuse, every
// request is answered with that refusal instead. It
// records the sweep (*sweep) of each request.
type flakyCompensator struct {
	executor.Compensator
	fail      int
	after     bool
	lastAfter bool
	refuse    *ledger.Event
	frozen    int // requests refused first, the compensation's tool frozen
	sweep     *int
	asked     []int
}

func (c *flakyCompensator) Compensate(ctx context.Context, op identity.Identity, key ledger.CallKey, reason string) (ledger.CallKey, []ledger.Event, error) {
	c.asked = append(c.asked, *c.sweep)
	if c.refuse != nil {
		return key.CompensationKey(), []ledger.Event{*c.refuse}, nil
	}
	if c.frozen > 0 {
		c.frozen--
		return key.CompensationKey(), []ledger.Event{{Type: statemachine.EventDenied, Reason: executor.ReasonToolFrozen, Detail: "cancel_refund is frozen"}}, nil
	}
	if c.fail > 0 {
		c.fail--
		if c.after || c.lastAfter && c.fail == 0 {
			if _, _, err := c.Compensator.Compensate(ctx, op, key, reason); err != nil {
				return ledger.CallKey{}, nil, err
			}
		}
		return ledger.CallKey{}, nil, fmt.Errorf("publish compensation: %w", context.DeadlineExceeded)
	}
	return c.Compensator.Compensate(ctx, op, key, reason)
}

// recordingPublisher keeps what is published.
type recordingPublisher struct{ recs []*kgo.Record }

// authorized returns the one authorized event published for the call
// key, and fails t unless there is exactly one.
func (p *recordingPublisher) authorized(t *testing.T, key ledger.CallKey) []*kgo.Record {
	t.Helper()
	var auth []*kgo.Record
	for _, rec := range p.recs {
		if string(rec.Key) == key.String() && string(ledger.Header(rec, ledger.HeaderEventType)) == string(statemachine.EventAuthorized) {
			auth = append(auth, rec)
		}
	}
	if len(auth) != 1 {
		t.Fatalf("%d authorized calls published for %s; want 1", len(auth), key)
	}
	return auth
}

func (p *recordingPublisher) Publish(_ context.Context, recs ...*kgo.Record) error {
	p.recs = append(p.recs, recs...)
	return nil
}

// After a request for a compensation fails, the step asks for no more
// (each may wait out a timeout, for the same cause): the others are asked
// for at the next sweep.
func TestUndoRequestsHeldAfterAFailure(t *testing.T) {
	r := newRig(t)
	var keys []ledger.CallKey
	var unknowns []*kgo.Record
	for _, k := range []string{"kr1", "kr2"} {
		ev, approved := r.admitApproved(k, time.Now().Add(time.Hour), "", "undo_unknown")
		r.backend.SetFault(demobackend.ToolRefundOrder, demobackend.Fault{ApplyThenDrop: true})
		unknowns = append(unknowns, r.unknown(approved))
		keys = append(keys, ev.Key())
	}
	r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{FailStatus: http.StatusServiceUnavailable})
	svc, err := compensation.New(compensation.Config{Store: r.store, Registry: r.reg, Intake: r.in, Publisher: &recordingPublisher{}})
	if err != nil {
		t.Fatal(err)
	}
	sweep := 0
	comp := &flakyCompensator{Compensator: svc, fail: 1, sweep: &sweep}
	now := time.Now()
	rc, err := executor.NewReconciler(executor.ReconcilerConfig{
		Registry: r.reg, Store: r.store, Looker: httptool.New(httptool.Config{}), BaseURL: r.url,
		Backoff: time.Millisecond, SweepEvery: time.Minute, Compensator: comp, UndoAttempts: 2,
		UnansweredFor: time.Nanosecond, Now: func() time.Time { return now },
	})
	if err != nil {
		t.Fatal(err)
	}
	failingLong(rc, keys...)
	r.reconcileAll(rc, unknowns...)
	if diff := cmp.Diff([]int{0}, comp.asked); diff != "" {
		t.Errorf("the park's step asked (-want +got):\n%s", diff)
	}
	sweep++
	now = now.Add(time.Minute)
	r.reconcileAll(rc)
	if diff := cmp.Diff([]int{0, 1, 1}, comp.asked); diff != "" {
		t.Errorf("the sweeps that asked (-want +got):\n%s", diff)
	}
	for _, k := range keys {
		if _, err := r.store.Get(t.Context(), k.CompensationKey()); err != nil {
			t.Errorf("compensation of %s: %v", k, err)
		}
	}
}

// A compensation a policy asked for that ends without undoing anything
// (here cancel_refund refuses it) hands the call back to a human at the
// next sweep: parked again compensation_abandoned, saying how the
// compensation ended. Before, the call stayed parked
// compensation_requested, as if its undoing were still under way.
func TestUndoThatUndidNothingGoesToAHuman(t *testing.T) {
	r := newRig(t)
	var now time.Time
	orig, _, pub, rc, parked := r.undoRequested(&now)
	var parkSeq int64
	for _, e := range parked {
		if e.Key() == orig.Key() && e.Type == statemachine.EventParked {
			parkSeq = e.Seq
		}
	}
	if parkSeq == 0 {
		t.Fatal("the call was not parked")
	}
	ck := orig.Key().CompensationKey()
	auth := pub.authorized(t, ck)
	r.backend.SetFault("cancel_refund", demobackend.Fault{FailStatus: http.StatusUnprocessableEntity})
	out, err := r.executor(nil).Step(t.Context(), auth)
	if err != nil {
		t.Fatal(err)
	}
	r.reconcileAll(rc, out.Records...)
	if rec, err := r.store.Get(t.Context(), ck); err != nil || rec.Status != processors.StatusFailed {
		t.Fatalf("the compensation is %s (%v); want failed", rec.Status, err)
	}

	now = now.Add(time.Minute)
	var parks []ledger.Event
	for _, e := range r.reconcileAll(rc) {
		if e.Key() == orig.Key() && e.Type == statemachine.EventParked && e.Seq > parkSeq {
			parks = append(parks, e)
		}
	}
	if len(parks) != 1 || parks[0].Reason != executor.ReasonUndoAbandoned || !strings.Contains(parks[0].Detail, "ended failed") {
		t.Fatalf("the call's parks at the sweep after its compensation failed: %+v; want one, %s, saying it ended failed", parks, executor.ReasonUndoAbandoned)
	}
	// What it tells the human can be done: its one compensation key is
	// spent, and the ledger would refuse another (compensation_failed).
	if d := parks[0].Detail; strings.Contains(d, "ledger calls compensate") || !strings.Contains(d, "undo it by hand") {
		t.Errorf("the park says %q; want it to send the human to undo it by hand, not to ledger calls compensate", d)
	}
	svc, err := compensation.New(compensation.Config{Store: r.store, Registry: r.reg, Intake: &countingSubmitter{}, Publisher: &recordingPublisher{}})
	if err != nil {
		t.Fatal(err)
	}
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	if _, _, err := svc.Compensate(t.Context(), ops, orig.Key(), "by hand"); !errors.Is(err, compensation.ErrCompensationFailed) {
		t.Errorf("an operator's compensation after it = %v; want refused, %v", err, compensation.ErrCompensationFailed)
	}
	// Nor is it taken for under way when the compensation's record
	// cannot be read: before, the error was dropped, and the request
	// answered as a retry of it.
	sub := &countingSubmitter{}
	svc, err = compensation.New(compensation.Config{Store: unreadable{Store: r.store, key: ck}, Registry: r.reg, Intake: sub, Publisher: &recordingPublisher{}})
	if err != nil {
		t.Fatal(err)
	}
	if _, evs, err := svc.Compensate(t.Context(), ops, orig.Key(), "by hand"); err == nil || !errors.Is(err, errUnreadable) || sub.n != 0 {
		t.Errorf("an operator's compensation, its compensation's record unreadable = %v, %d events, %d submitted; want the read's error, nothing submitted", err, len(evs), sub.n)
	}
	// Handed over once: the next sweep leaves it to the human.
	now = now.Add(time.Minute)
	for _, e := range r.reconcileAll(rc) {
		if e.Key() == orig.Key() && e.Seq > parks[0].Seq {
			t.Errorf("a later sweep appended %s(%s) for the call; want nothing", e.Type, e.Reason)
		}
	}
}

// errUnreadable is unreadable's error.
var errUnreadable = errors.New("store read timed out")

// unreadable is a store whose reads of key fail.
type unreadable struct {
	processors.Store
	key ledger.CallKey
}

func (u unreadable) Get(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	if k == u.key {
		return processors.Record{}, errUnreadable
	}
	return u.Store.Get(ctx, k)
}

// A reconciler that does not know a call's tool version (one not yet
// upgraded, in a rolling deploy) does not park the call as declaring no
// status lookup: the call waits, as for a lookup that failed, and is
// parked lookup_failed, saying why, once that has lasted the bound (a
// version withdrawn from every registry). A compensation's success such
// a reconciler reads settles the call compensated all the same. Before,
// the call was parked no_status_lookup ("the tool declares none", which
// was false), and the compensation's success was dropped, the call left
// as it was for good.
func TestReconcilerWithoutTheToolLeavesItToOneThatKnowsIt(t *testing.T) {
	partial := registryWithout(t, "refund_order")
	t.Run("unknown outcome", func(t *testing.T) {
		r := newRig(t)
		orig, unknown := r.unknownRefundToUndo()
		now := time.Now()
		old := r.sweepingReconciler(nil, &now, func(c *executor.ReconcilerConfig) { c.Registry, c.UnansweredFor = partial, time.Hour })
		for _, e := range r.reconcileAll(old, unknown) {
			if e.Type == statemachine.EventParked {
				t.Errorf("a reconciler without the tool parked the call at once: %s (%s)", e.Reason, e.Detail)
			}
		}
		now = now.Add(2 * time.Hour)
		var parks []ledger.Event
		for _, e := range r.reconcileAll(old) {
			if e.Key() == orig.Key() && e.Type == statemachine.EventParked {
				parks = append(parks, e)
			}
		}
		if len(parks) != 1 || parks[0].Reason != executor.ReasonLookupFailed || !strings.Contains(parks[0].Detail, "not in the reconciler's registry") {
			t.Errorf("after the bound: parks %+v; want one, %s, saying the tool version is not in the registry", parks, executor.ReasonLookupFailed)
		}
	})
	t.Run("compensation succeeded", func(t *testing.T) {
		r := newRig(t)
		var now time.Time
		orig, _, pub, _, _ := r.undoRequested(&now)
		ck := orig.Key().CompensationKey()
		out, err := r.executor(nil).Step(t.Context(), pub.authorized(t, ck))
		if err != nil {
			t.Fatal(err)
		}
		old := r.sweepingReconciler(nil, &now, func(c *executor.ReconcilerConfig) { c.Registry = partial })
		r.reconcileAll(old, out.Records...)
		if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusCompensated {
			t.Errorf("after a reconciler without the tool read the compensation's success, the call is %s (%v); want compensated", rec.Status, err)
		}
	})
}

// registryWithout is the test registry without the tool named name.
func registryWithout(t *testing.T, name string) *schemas.Registry {
	t.Helper()
	return registryEdited(t, func(file string, def []byte) []byte {
		if strings.HasPrefix(file, name+".") {
			return nil
		}
		return def
	})
}

// registryEdited is the test registry with each tool's file (its name,
// and its bytes) as edit returns it; nil leaves the file out.
func registryEdited(t *testing.T, edit func(file string, def []byte) []byte) *schemas.Registry {
	t.Helper()
	fsys := fstest.MapFS{}
	entries, err := os.ReadDir("../testdata/registry/tools")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join("../testdata/registry/tools", e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if b = edit(e.Name(), b); b != nil {
			fsys["tools/"+e.Name()] = &fstest.MapFile{Data: b}
		}
	}
	reg, err := schemas.Load(fsys)
	if err != nil {
		t.Fatal(err)
	}
	return reg
}

// Asked again for a call whose compensation's own outcome is unknown, the
// compensation service says to settle the compensation first: it may have
// undone the call, and a human told to undo it by hand could undo it
// twice. Before, it said the compensation did not undo it.
func TestCompensationOfUnknownOutcomeIsSettledFirst(t *testing.T) {
	r := newRig(t)
	var now time.Time
	orig, svc, pub, _, _ := r.undoRequested(&now)
	ck := orig.Key().CompensationKey()
	r.backend.SetFault("cancel_refund", demobackend.Fault{FailStatus: http.StatusServiceUnavailable})
	if _, err := r.executor(nil).Step(t.Context(), pub.authorized(t, ck)); err != nil {
		t.Fatal(err)
	}
	if rec, err := r.store.Get(t.Context(), ck); err != nil || rec.Status != processors.StatusOutcomeUnknown {
		t.Fatalf("the compensation is %s (%v); want outcome_unknown", rec.Status, err)
	}
	op := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	_, _, err := svc.Compensate(t.Context(), op, orig.Key(), "again")
	if !errors.Is(err, compensation.ErrCompensationUnsettled) || errors.Is(err, compensation.ErrCompensationFailed) || !strings.Contains(err.Error(), "settle the compensation first") || strings.Contains(err.Error(), "a human must undo it") {
		t.Errorf("compensating again = %v; want it to say to settle the compensation first", err)
	}
	// With a code of its own: not_compensable and compensation_failed
	// are undone by hand.
	api, err := compensation.New(compensation.Config{Store: r.store, Registry: r.reg, Intake: r.in, Publisher: &recordingPublisher{}, Identity: verifierAs("u_ops")})
	if err != nil {
		t.Fatal(err)
	}
	if status, body := postCompensation(t, api, orig.IdempotencyKey); status != http.StatusConflict || !strings.Contains(body, `"compensation_outcome_unknown"`) {
		t.Errorf("compensating again through the API = %d %s; want 409 compensation_outcome_unknown", status, body)
	}
}

// The sweep of parked calls pages on: more calls parked for a human than
// a sweep reads (100), all older, do not hide a call parked for its
// compensation that was never requested (a restarted reconciler knows of
// none). Before, every sweep read the same oldest 100 and never reached
// it.
func TestParkedSweepReachesPastAPageOfHumanParks(t *testing.T) {
	r := newRig(t)
	park := func(key, reason string) ledger.CallKey {
		t.Helper()
		k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: key}
		r.pendingThen(k, processors.StatusParked, statemachine.EventParked, reason)
		return k
	}
	for i := range 101 {
		park(fmt.Sprintf("human-%03d", i), executor.ReasonLookupFailed)
	}
	undo := park("undo-me", executor.ReasonCompensating)

	comp := &recordingCompensator{}
	now := time.Now()
	rc := r.sweepingReconciler(comp, &now, nil)
	for sweep := 1; sweep <= 2 && len(comp.asked) == 0; sweep++ {
		now = now.Add(time.Minute)
		r.reconcileAll(rc)
	}
	if !slices.Equal(comp.asked, []ledger.CallKey{undo}) {
		t.Errorf("compensations asked for within two sweeps: %v; want %v, behind 101 calls parked for a human", comp.asked, undo)
	}
}

// pendingThen stores a refund_order call k as the store would hold one
// that waited for an approval (approval_pending, seq 2) and then moved to
// status (an event of type typ, seq 3, with reason), and returns that
// last event.
func (r *rig) pendingThen(k ledger.CallKey, status processors.Status, typ statemachine.EventType, reason string) ledger.Event {
	r.t.Helper()
	ev := ledger.Event{EventID: "e_" + k.IdempotencyKey, IdempotencyKey: k.IdempotencyKey, CallID: "c_" + k.IdempotencyKey, TenantID: k.TenantID, UserID: "u_1",
		Tool: "refund_order", ToolVersion: 1, ArgumentsHash: "sha256:00", At: time.Now().UTC()}
	pending, last := ev, ev
	pending.Type, pending.Seq = statemachine.EventApprovalPending, 2
	last.EventID, last.Type, last.Seq, last.Reason = "e_last_"+k.IdempotencyKey, typ, 3, reason
	outbox := func(evs ...ledger.Event) []byte {
		b, err := ledger.EncodeEvents(evs)
		if err != nil {
			r.t.Fatal(err)
		}
		return b
	}
	if _, err := r.store.Admit(r.t.Context(), []processors.Admission{{Key: k, CallID: "c_" + k.IdempotencyKey, ArgumentsHash: "sha256:00", Tool: "refund_order", ToolVersion: 1,
		Arguments: []byte(`{}`), Status: processors.StatusPending, Seq: 2, Outbox: outbox(pending)}}); err != nil {
		r.t.Fatal(err)
	}
	if ok, err := r.store.Move(r.t.Context(), []processors.Move{{Key: k, From: processors.StatusPending, FromSeq: 2, To: status, Seq: 3, Outbox: outbox(pending, last)}}); err != nil || !ok[0] {
		r.t.Fatalf("move %s to %s: %v, %v", k, status, ok, err)
	}
	return last
}

// A compensation that ends without undoing anything hands its call to a
// human at the next sweep, however many calls parked for a human come
// before it: the reconciler reads the compensation's end. Before, it
// waited for the sweeps' pages of parked calls to reach the call, a page
// of 100 a sweep, so behind 6,000 such calls about an hour at a minute a
// sweep, the call saying all along that its compensation was requested.
func TestEndedCompensationHandsItsCallOverAtTheNextSweep(t *testing.T) {
	r := newRig(t)
	for i := range 101 {
		r.pendingThen(ledger.CallKey{TenantID: "t_a", IdempotencyKey: fmt.Sprintf("human-%03d", i)}, processors.StatusParked, statemachine.EventParked, executor.ReasonLookupFailed)
	}
	undo := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "undo-me"}
	r.pendingThen(undo, processors.StatusParked, statemachine.EventParked, executor.ReasonCompensating)
	rejected := r.pendingThen(undo.CompensationKey(), processors.StatusRejected, statemachine.EventRejected, "")
	rejectedRec, err := rejected.Record("toolcalls.events")
	if err != nil {
		t.Fatal(err)
	}
	comp := &recordingCompensator{}
	now := time.Now()
	rc := r.sweepingReconciler(comp, &now, nil)
	now = now.Add(time.Minute)
	var parks []string
	for _, e := range r.reconcileAll(rc, rejectedRec) {
		if e.Key() == undo && e.Type == statemachine.EventParked && e.Seq > 3 { // not its outbox's again
			parks = append(parks, e.Reason+": "+e.Detail)
		}
	}
	if len(parks) != 1 || !strings.HasPrefix(parks[0], executor.ReasonUndoAbandoned+": ") || !strings.Contains(parks[0], "ended rejected without undoing anything") {
		t.Errorf("the call's parks at the sweep after its compensation's rejection: %q; want one, %s, saying the compensation ended rejected", parks, executor.ReasonUndoAbandoned)
	}
	if len(comp.asked) != 0 {
		t.Errorf("compensations asked for: %v; want none (the call's one was rejected)", comp.asked)
	}
}

// A compensation's success for a call whose record this build cannot read
// (an outbox from a newer build) leaves that call as it is, logged, and
// does not fail the reconciler's step: before, every redelivery of the
// batch failed the same way, and the other calls in it (here one whose
// lookup finds it applied) were never reconciled.
func TestUnreadableCompensatedCallDoesNotStopTheReconciler(t *testing.T) {
	r := newRig(t)
	orig, approved := r.admitApproved("kx", time.Now().Add(time.Hour), "")
	r.backend.SetFault(demobackend.ToolRefundOrder, demobackend.Fault{ApplyThenDrop: true})
	r.unknown(approved)
	r.backend.ClearFaults()
	k := orig.Key()
	unsure, err := r.store.Get(t.Context(), k)
	if err != nil {
		t.Fatal(err)
	}
	// Parked by a newer build, in an encoding this one cannot read.
	if applied, err := r.store.Move(t.Context(), []processors.Move{{Key: k, From: processors.StatusOutcomeUnknown, FromSeq: unsure.Seq, To: processors.StatusParked,
		Seq: unsure.Seq + 1, Outbox: fmt.Appendf(nil, `[{"v":99,"type":"parked","seq":%d}]`, unsure.Seq+1)}}); err != nil || !applied[0] {
		t.Fatalf("parking it: %v, %v", applied, err)
	}
	ck := k.CompensationKey()
	comp := ledger.Event{EventID: "e_kx_comp", IdempotencyKey: ck.IdempotencyKey, CallID: "comp_c_kx", Seq: 4, Type: statemachine.EventSucceeded,
		At: time.Now().UTC(), TenantID: ck.TenantID, UserID: "u_operator", Tool: "cancel_refund", ToolVersion: 1, ArgumentsHash: "sha256:01"}
	compRec, err := comp.Record("toolcalls.events")
	if err != nil {
		t.Fatal(err)
	}
	r.backend.SetFault("create_ticket", demobackend.Fault{ApplyThenDrop: true})
	unknown := r.unknown(r.admit("create_ticket", "lost", map[string]any{"title": "t"}, 0))
	r.backend.ClearFaults()

	logs := &ledgertest.LogBuffer{}
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Logger = slog.New(slog.NewTextHandler(logs, nil)) })
	if diff := cmp.Diff([]string{"succeeded(" + executor.ReasonReconciled + ")"}, r.reconcile(rc, compRec, unknown)); diff != "" {
		t.Errorf("reconciled events (-want +got):\n%s", diff)
	}
	if rec, err := r.store.Get(t.Context(), k); err != nil || rec.Status != processors.StatusParked || rec.Seq != unsure.Seq+1 {
		t.Errorf("the unreadable call: %s at seq %d, %v; want left parked at %d", rec.Status, rec.Seq, err, unsure.Seq+1)
	}
	if !strings.Contains(logs.String(), "compensated call without context") {
		t.Errorf("nothing logged of the call left as it is; the log:\n%s", logs.String())
	}
}

// An operator cannot resolve a call whose compensation is under way or
// done: its outcome settles the call (compensated if it undid it). Before,
// a call resolved failed while its undo ran was left failed, the undo's
// success dropped without a word, an effect undone against a call
// recorded as having had none. Once the compensation ended without
// undoing anything, the operator resolves the call.
func TestResolveWaitsForTheCompensation(t *testing.T) {
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	for _, tc := range []struct {
		name   string
		fault  demobackend.Fault // the compensation's
		status processors.Status // the call's in the end
	}{
		{"undone", demobackend.Fault{}, processors.StatusCompensated},
		{"undo refused", demobackend.Fault{FailStatus: http.StatusBadRequest}, processors.StatusFailed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			orig, unknown := r.unknownRefundToUndo()
			k := orig.Key()
			comp := r.admitCompensation(k, "u_operator")
			rc := r.reconcilerAt(afterLanding)
			if _, err := rc.Resolve(t.Context(), ops, k, executor.Resolution{As: processors.StatusFailed, Evidence: "no refund in the ledger of the bank"}); !errors.Is(err, executor.ErrUndoUnderWay) {
				t.Fatalf("resolving while the compensation is authorized = %v; want ErrUndoUnderWay", err)
			}
			r.backend.SetFault("cancel_refund", tc.fault)
			out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{comp})
			if err != nil {
				t.Fatal(err)
			}
			_, err = rc.Resolve(t.Context(), ops, k, executor.Resolution{As: processors.StatusFailed, Evidence: "no refund in the ledger of the bank"})
			if tc.status == processors.StatusCompensated {
				if !errors.Is(err, executor.ErrUndoUnderWay) {
					t.Fatalf("resolving after the compensation succeeded = %v; want ErrUndoUnderWay", err)
				}
				r.reconcileAll(rc, append([]*kgo.Record{unknown}, out.Records...)...)
			} else if err != nil {
				t.Fatalf("resolving after the compensation was refused = %v; want it resolved", err)
			}
			if rec, err := r.store.Get(t.Context(), k); err != nil || rec.Status != tc.status {
				t.Errorf("the call is %s (%v); want %s", rec.Status, err, tc.status)
			}
		})
	}
}

// compensatedAfterRead is a reconciler's store on which an operator's
// compensation of orig is admitted and run, its undo sent, right after
// the first read of its key: as one racing the reader would, the reader
// having found none.
type compensatedAfterRead struct {
	executor.ReconcilerStore
	r    *rig
	orig ledger.CallKey
	ran  bool
	out  []*kgo.Record // the compensation's events
}

func (s *compensatedAfterRead) Get(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	rec, err := s.ReconcilerStore.Get(ctx, k)
	if k == s.orig.CompensationKey() && !s.ran {
		s.ran = true
		out, err := s.r.executor(nil).Step(ctx, []*kgo.Record{s.r.admitCompensation(s.orig, "u_operator")})
		if err != nil {
			s.r.t.Fatal(err)
		}
		s.out = out.Records
	}
	return rec, err
}

// racingReconciler is the rig's reconciler (on the clock now, if set) on
// a compensatedAfterRead store of orig.
func (r *rig) racingReconciler(orig ledger.CallKey, now func() time.Time) (*executor.Reconciler, *compensatedAfterRead) {
	racer := &compensatedAfterRead{r: r, orig: orig}
	return r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		racer.ReconcilerStore, c.Store = c.Store, racer
		if now != nil {
			c.Now = now
		}
	}), racer
}

// checkUndoneNotFailed fails unless the call k is still outcome_unknown,
// its compensation having applied once (racer's), and is settled
// compensated by that compensation's success, unknown's lookup failing.
func (r *rig) checkUndoneNotFailed(k ledger.CallKey, unknown *kgo.Record, racer *compensatedAfterRead) {
	r.t.Helper()
	if !racer.ran {
		r.t.Fatal("the compensation was never run: the race was not staged")
	}
	if n := r.backend.AppliedIn("cancel_refund", "t_a", k.CompensationKey().String()); n != 1 {
		r.t.Fatalf("cancel_refund applied %d times; want 1 (the racing compensation)", n)
	}
	if rec, err := r.store.Get(r.t.Context(), k); err != nil || rec.Status != processors.StatusOutcomeUnknown {
		r.t.Fatalf("the call is %s (%v); want outcome_unknown, its undo sent", rec.Status, err)
	}
	r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{FailStatus: http.StatusServiceUnavailable})
	r.reconcileAll(r.reconciler(), append([]*kgo.Record{unknown}, racer.out...)...)
	if rec, err := r.store.Get(r.t.Context(), k); err != nil || rec.Status != processors.StatusCompensated {
		r.t.Errorf("once the compensation succeeded the call is %s (%v); want compensated", rec.Status, err)
	}
}

// An operator's resolution as failed and the start of an operator's
// compensation of the call exclude each other: the compensation's
// executor found the call undoable between the resolution's check (no
// compensation) and its write, and sent the undo; the resolution is
// refused (ErrUndoUnderWay), the call left for the compensation to
// settle. Before, the executor's check was a read, the resolution was
// recorded, and the call said it had had no effect while it was undone.
func TestResolveFailedRacingTheCompensation(t *testing.T) {
	r := newRig(t)
	orig, unknown := r.unknownRefundToUndo()
	k := orig.Key()
	rc, racer := r.racingReconciler(k, afterLanding)
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	_, err := rc.Resolve(t.Context(), ops, k, executor.Resolution{As: processors.StatusFailed, Evidence: "no refund in the ledger of the bank"})
	if !errors.Is(err, executor.ErrUndoUnderWay) || !strings.Contains(err.Error(), "started while the call was being resolved") {
		t.Errorf("resolving failed as the compensation starts = %v; want ErrUndoUnderWay saying it started meanwhile", err)
	}
	r.checkUndoneNotFailed(k, unknown, racer)
}

// A status lookup's not_found and the start of an operator's compensation
// of the call exclude each other as a resolution does: the move that
// would record the call failed, decided before the compensation's
// executor found the call undoable, does not apply.
func TestReconcileNotFoundRacingTheCompensation(t *testing.T) {
	r := newRig(t)
	_, approved := r.admitApproved("kr", time.Now().Add(time.Hour), "")
	r.backend.SetFault(demobackend.ToolRefundOrder, demobackend.Fault{Hang: true})
	unknown := r.unknownWith(approved, func(c *executor.Config) { c.MaxAttempts = 1 })
	r.backend.ClearFaults()
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "kr"}
	rec, err := r.store.Get(t.Context(), k)
	if err != nil {
		t.Fatal(err)
	}
	const timeout = 2 * time.Second // refund_order's
	late, racer := r.racingReconciler(k, func() time.Time { return rec.UpdatedAt.Add(timeout + executor.NotFoundSkew + time.Second) })
	if got := r.reconcile(late, unknown); len(got) != 0 {
		t.Errorf("reconciled %v as the compensation started; want nothing", got)
	}
	r.checkUndoneNotFailed(k, unknown, racer)
}

// An operator who asks to undo a call parked for the reconciler's
// compensation joins that compensation (one key a call). Resolving the
// call succeeded afterwards would have the compensation end
// nothing_to_undo, the operator's request lost without a word and its key
// spent: the resolution is refused, automatic_compensation_pending,
// saying what to do, unless the resolver confirms it
// (CancelCompensation). Left unresolved, the compensation undoes the
// call.
func TestResolveSucceededBehindTheReconcilersUndo(t *testing.T) {
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	for _, tc := range []struct {
		name    string
		cancel  bool
		want    processors.Status // the call's in the end
		applied int               // cancel_refund's effects
	}{
		{"left to the compensation", false, processors.StatusCompensated, 1},
		{"resolved, confirmed", true, processors.StatusSucceeded, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			var now time.Time
			orig, svc, pub, rc, _ := r.undoRequested(&now)
			k, ck := orig.Key(), orig.Key().CompensationKey()
			if got, _, err := svc.Compensate(t.Context(), ops, k, "the customer asked for it back"); err != nil || got != ck {
				t.Fatalf("the operator's undo = %s, %v; want it joined to %s", got, err, ck)
			}
			res := executor.Resolution{As: processors.StatusSucceeded, Evidence: "the bank shows the refund"}
			_, err := rc.Resolve(t.Context(), ops, k, res)
			if !errors.Is(err, executor.ErrAutomaticUndoPending) || !strings.Contains(err.Error(), "leave it unresolved") {
				t.Fatalf("resolving succeeded while the compensation is pending = %v; want ErrAutomaticUndoPending saying to leave it unresolved", err)
			}
			if rec, err := r.store.Get(t.Context(), k); err != nil || rec.Status != processors.StatusParked {
				t.Fatalf("after the refusal the call is %s (%v); want parked still", rec.Status, err)
			}
			if tc.cancel {
				res.CancelCompensation = true
				evs, err := rc.Resolve(t.Context(), ops, k, res)
				if err != nil {
					t.Fatalf("resolving succeeded, confirmed = %v", err)
				}
				// The compensation, not started, is denied at once: an
				// executor claiming it now finds nothing to run.
				if comp, err := r.store.Get(t.Context(), ck); err != nil || comp.Status != processors.StatusDenied {
					t.Errorf("the compensation is %s (%v); want denied", comp.Status, err)
				}
				var reasons []string
				for _, e := range evs {
					reasons = append(reasons, e.Key().String()+":"+string(e.Type)+"/"+e.Reason)
				}
				if !slices.Contains(reasons, ck.String()+":denied/"+executor.ReasonCompensationCancelled) || !slices.Contains(reasons, k.String()+":succeeded/"+executor.ReasonResolvedByOperator) {
					t.Errorf("the resolution's events %v; want the compensation denied %s and the call succeeded", reasons, executor.ReasonCompensationCancelled)
				}
			}
			out, err := r.executor(nil).Step(t.Context(), pub.authorized(t, ck))
			if err != nil {
				t.Fatal(err)
			}
			r.reconcileAll(rc, out.Records...)
			if rec, err := r.store.Get(t.Context(), k); err != nil || rec.Status != tc.want {
				t.Errorf("the call is %s (%v); want %s", rec.Status, err, tc.want)
			}
			if n := r.backend.AppliedIn("cancel_refund", "t_a", ck.String()); n != tc.applied {
				t.Errorf("cancel_refund applied %d times; want %d", n, tc.applied)
			}
		})
	}
}

// A confirmed resolution as succeeded and an executor's claim of the
// reconciler's compensation exclude each other: claimed between the
// resolution's check and its write, the compensation runs (the executor
// read the call still parked, and may undo it), and the resolution is
// refused as with one running, the call left parked. Before, the
// resolution was recorded, and the compensation undid the success the
// operator had chosen to keep.
func TestResolveSucceededRacingTheCompensationsClaim(t *testing.T) {
	r := newRig(t)
	k, ck, comp := r.automaticUndo()
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Store = &claimingFirst{Store: r.store, key: ck, hash: comp.ArgumentsHash}
	})
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	_, err := rc.Resolve(t.Context(), ops, k, executor.Resolution{As: processors.StatusSucceeded, Evidence: "the bank shows the refund", CancelCompensation: true})
	if !errors.Is(err, executor.ErrAutomaticUndoPending) {
		t.Errorf("resolving while the compensation was claimed = %v; want ErrAutomaticUndoPending", err)
	}
	if rec, err := r.store.Get(t.Context(), k); err != nil || rec.Status != processors.StatusParked {
		t.Errorf("the call is %s (%v); want parked still, its compensation running", rec.Status, err)
	}
}

// The reconciler's compensation waiting for an approval is cancelled by a
// confirmed resolution too (rejected, compensation_cancelled), so that an
// approval racing the resolution loses, and approvers are not left an
// undo that can only end nothing_to_undo. Before, it stayed pending, and
// approved and claimed in between it undid the success kept.
func TestResolveSucceededBehindACompensationAwaitingApproval(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	k, ck := orig.Key(), orig.Key().CompensationKey()
	r.admitCompensationIn(k, executor.ReconcilerUser, processors.StatusPending)
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	evs, err := r.reconciler().Resolve(t.Context(), ops, k, executor.Resolution{As: processors.StatusSucceeded, Evidence: "the bank shows the refund", CancelCompensation: true})
	if err != nil {
		t.Fatal(err)
	}
	if comp, err := r.store.Get(t.Context(), ck); err != nil || comp.Status != processors.StatusRejected {
		t.Errorf("the compensation is %s (%v); want rejected", comp.Status, err)
	}
	var got []string
	for _, e := range evs {
		got = append(got, e.Key().String()+":"+string(e.Type)+"/"+e.Reason)
	}
	if !slices.Contains(got, ck.String()+":rejected/"+executor.ReasonCompensationCancelled) {
		t.Errorf("the resolution's events %v; want the compensation rejected %s", got, executor.ReasonCompensationCancelled)
	}
}

// automaticUndo is a call parked for the reconciler's compensation, not
// started: the call's key, the compensation's, and its record.
func (r *rig) automaticUndo() (k, ck ledger.CallKey, comp processors.Record) {
	r.t.Helper()
	var now time.Time
	orig, _, _, _, _ := r.undoRequested(&now)
	k, ck = orig.Key(), orig.Key().CompensationKey()
	comp, err := r.store.Get(r.t.Context(), ck)
	if err != nil {
		r.t.Fatal(err)
	}
	return k, ck, comp
}

// claimingFirst is a store on which an executor claims key just before
// the first move of it, as one racing the mover would.
type claimingFirst struct {
	processors.Store
	key     ledger.CallKey
	hash    string
	claimed bool
}

func (c *claimingFirst) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	for _, m := range ms {
		if err := c.claimFirst(ctx, m.Key); err != nil {
			return nil, err
		}
	}
	return c.Store.Move(ctx, ms)
}

func (c *claimingFirst) Complete(ctx context.Context, cs []processors.Completion) ([]bool, error) {
	for _, m := range cs {
		if err := c.claimFirst(ctx, m.Key); err != nil {
			return nil, err
		}
	}
	return c.Store.Complete(ctx, cs)
}

// claimFirst claims key, once, as the racing executor.
func (c *claimingFirst) claimFirst(ctx context.Context, key ledger.CallKey) error {
	if key != c.key || c.claimed {
		return nil
	}
	c.claimed = true
	_, err := c.Store.Claim(ctx, []processors.Claim{{Key: c.key, ArgumentsHash: c.hash, Owner: "x-racer", Lease: time.Minute}})
	return err
}

// A compensation an executor gave back (its breaker open, its policies
// undecided: executing, no lease owner) is cancelled as one not yet
// claimed is, fenced by its claim's epoch: a confirmed resolution denies
// it, and one an executor claims again meanwhile refuses the resolution
// as with one running. Before, a given-back compensation was left to find
// the call settled once claimed again, and a claim between the
// resolution's check and its write undid the success kept. One given back
// after its undo's credential reached the tool (the tool answered 429)
// is denied naming that credential's jti and family, as an executor's
// events would: before, they were on no event.
func TestResolveSucceededBehindAGivenBackCompensation(t *testing.T) {
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	for _, tc := range []struct{ racing, sent bool }{{false, false}, {true, false}, {false, true}} {
		racing := tc.racing
		t.Run(fmt.Sprintf("claimed meanwhile %v, sent %v", racing, tc.sent), func(t *testing.T) {
			r := newRig(t)
			k, ck, comp := r.automaticUndo()
			// An executor claims it and gives it back, claimable again
			// at once.
			cred := processors.CallCredential{JTI: "jti-undo", Family: "cancel_refund:t_a:1"}
			cl, err := r.store.Claim(t.Context(), []processors.Claim{{Key: ck, ArgumentsHash: comp.ArgumentsHash, Owner: "x-first", Lease: time.Minute, Credential: cred}})
			if err != nil || cl[0].Outcome != processors.Claimed {
				t.Fatalf("claim = %+v, %v", cl, err)
			}
			rel := processors.Release{Key: ck, Epoch: cl[0].Record.Epoch}
			if tc.sent {
				rel.Sent, rel.Attempt = cred.Family, 1
			}
			if applied, err := r.store.Release(t.Context(), []processors.Release{rel}); err != nil || !applied[0] {
				t.Fatalf("release = %v, %v", applied, err)
			}
			rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
				if racing {
					c.Store = &claimingFirst{Store: r.store, key: ck, hash: comp.ArgumentsHash}
				}
			})
			_, err = rc.Resolve(t.Context(), ops, k, executor.Resolution{As: processors.StatusSucceeded, Evidence: "the bank shows the refund", CancelCompensation: true})
			call, _ := r.store.Get(t.Context(), k)
			comp, _ = r.store.Get(t.Context(), ck)
			switch {
			case racing && (!errors.Is(err, executor.ErrAutomaticUndoPending) || call.Status != processors.StatusParked):
				t.Errorf("claimed meanwhile: resolution %v, the call %s; want refused, the call parked still", err, call.Status)
			case !racing && (err != nil || call.Status != processors.StatusSucceeded || comp.Status != processors.StatusDenied):
				t.Errorf("given back: resolution %v, the call %s, its compensation %s; want succeeded, denied", err, call.Status, comp.Status)
			case !racing:
				evs, err := ledger.DecodeEvents(comp.Outbox)
				if err != nil || len(evs) == 0 {
					t.Fatalf("the compensation's outbox: %v, %v", evs, err)
				}
				last := evs[len(evs)-1]
				if named := last.JTI == cred.JTI && slices.Equal(last.EarlierCredentialFamilies, []string{cred.Family}); named != tc.sent {
					t.Errorf("its %s names jti %q, earlier families %q; want them named: %v", last.Type, last.JTI, last.EarlierCredentialFamilies, tc.sent)
				}
			}
		})
	}
}

// Only the reconciler's compensation still to run holds a resolution as
// succeeded back, until confirmed: an operator's runs on a call settled
// succeeded, and one that has ended is past undoing anything. One whose
// events this build cannot read may be the reconciler's. One an executor
// holds may be sending: confirmed or not, the resolution waits for it.
func TestResolveSucceededBehindWhichCompensation(t *testing.T) {
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	const unreadable = "(a newer build's events)"
	for _, tc := range []struct {
		asker                    string
		ended, claimed, confirms bool
		refused                  string // what the refusal says; "" for none
	}{
		{asker: executor.ReconcilerUser, refused: "leave it unresolved"},
		{asker: executor.ReconcilerUser, confirms: true},
		{asker: executor.ReconcilerUser, ended: true},
		{asker: executor.ReconcilerUser, claimed: true, refused: "is running"},
		{asker: executor.ReconcilerUser, claimed: true, confirms: true, refused: "is running"},
		{asker: "u_operator"},
		{asker: unreadable, refused: "cannot read"},
		{asker: unreadable, confirms: true},
	} {
		r := newRig(t)
		orig, _ := r.unknownRefundToUndo()
		var auth *kgo.Record
		if tc.asker == unreadable {
			ck := orig.Key().CompensationKey()
			if _, err := r.store.Admit(t.Context(), []processors.Admission{{Key: ck, CallID: "comp", ArgumentsHash: "sha256:x", Tool: "cancel_refund", ToolVersion: 1,
				Status: processors.StatusAuthorized, Seq: 2, Outbox: []byte(`[{"v":99,"type":"authorized","seq":2}]`)}}); err != nil {
				t.Fatal(err)
			}
		} else {
			auth = r.admitCompensation(orig.Key(), tc.asker)
		}
		if tc.ended {
			r.backend.SetFault("cancel_refund", demobackend.Fault{FailStatus: http.StatusUnprocessableEntity})
			if _, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth}); err != nil {
				t.Fatal(err)
			}
		}
		if tc.claimed {
			ev := authorizedEvent(t, auth)
			r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
		}
		_, err := r.reconciler().Resolve(t.Context(), ops, orig.Key(), executor.Resolution{As: processors.StatusSucceeded, Evidence: "the bank shows the refund", CancelCompensation: tc.confirms})
		if tc.refused == "" && err != nil || tc.refused != "" && (!errors.Is(err, executor.ErrAutomaticUndoPending) || !strings.Contains(err.Error(), tc.refused)) {
			t.Errorf("asked by %s (ended %v, claimed %v, confirmed %v): resolving succeeded = %v; want refused saying %q", tc.asker, tc.ended, tc.claimed, tc.confirms, err, tc.refused)
		}
	}
}

// A call whose compensation has already undone it (succeeded) is not
// resolved, as succeeded or failed, whoever asked for the compensation:
// its success settles the call compensated, and the operator is told so.
// Before, a resolution as succeeded was accepted, and the call was
// recorded compensated right after, the operator none the wiser; as
// failed it was refused as if the compensation were still under way.
func TestResolveRefusedOnceTheCompensationUndidTheCall(t *testing.T) {
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	for _, asker := range []string{executor.ReconcilerUser, "u_operator"} {
		for _, as := range []processors.Status{processors.StatusSucceeded, processors.StatusFailed} {
			r := newRig(t)
			orig, _ := r.unknownRefundToUndo()
			auth := r.admitCompensation(orig.Key(), asker)
			out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			if evs := decodeAll(t, out.Records); len(evs) == 0 || evs[len(evs)-1].Type != statemachine.EventSucceeded {
				t.Fatalf("compensation by %s: %v; want it to succeed", asker, summary(evs))
			}
			_, err = r.reconciler().Resolve(t.Context(), ops, orig.Key(), executor.Resolution{As: as, Evidence: "the bank shows the refund", CancelCompensation: true})
			if !errors.Is(err, executor.ErrUndoUnderWay) || !strings.Contains(err.Error(), "undid the call") {
				t.Errorf("compensation by %s succeeded, resolving %s = %v; want refused, saying it undid the call", asker, as, err)
			}
			if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status == processors.StatusSucceeded || rec.Status == processors.StatusFailed {
				t.Errorf("the call is %s (%v); want it left for its compensation to settle", rec.Status, err)
			}
		}
	}
}

// A sweep that listed a call parked for its compensation asks for none
// once an operator resolved the call meanwhile: that compensation would
// undo nothing and spend the call's one compensation key, and an
// operator's undo of the call is then accepted. Nor is the call handed
// to a human.
func TestNoAutomaticUndoOfACallSettledMeanwhile(t *testing.T) {
	// Resolved failed too: the call is then not compensable at all,
	// which is no refusal of the reconciler's request either.
	for _, as := range []processors.Status{processors.StatusSucceeded, processors.StatusFailed} {
		t.Run(string(as), func(t *testing.T) {
			r := newRig(t)
			orig, unknown := r.unknownRefundToUndo()
			sub := &countingSubmitter{}
			svc, err := compensation.New(compensation.Config{Store: r.store, Registry: r.reg, Intake: sub, Publisher: &recordingPublisher{}})
			if err != nil {
				t.Fatal(err)
			}
			ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
			// The resolution lands between the park and the reconciler's
			// request for the compensation.
			resolving := resolvingFirst{svc: svc, resolve: func() error {
				_, err := r.reconcilerAt(afterLanding).Resolve(t.Context(), ops, orig.Key(), executor.Resolution{As: as, Evidence: "the bank says"})
				return err
			}}
			now := time.Now()
			rc := r.sweepingReconciler(&resolving, &now, nil)
			failingLong(rc, orig.Key())
			r.reconcileAll(rc, unknown)
			if resolving.err != nil || !errors.Is(resolving.answer, compensation.ErrSettled) {
				t.Fatalf("resolved (%v), then the reconciler's request = %v; want ErrSettled", resolving.err, resolving.answer)
			}
			if sub.n != 0 {
				t.Errorf("%d compensations submitted; want none", sub.n)
			}
			now = now.Add(time.Hour)
			r.reconcileAll(rc)
			if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != as {
				t.Errorf("the call is %s (%v); want %s, not parked again", rec.Status, err, as)
			}
			if as != processors.StatusSucceeded {
				return
			}
			if _, _, err := svc.Compensate(t.Context(), ops, orig.Key(), "the customer asked for it back"); err != nil || sub.n != 1 {
				t.Errorf("an operator's undo afterwards = %v, %d submitted; want it submitted", err, sub.n)
			}
		})
	}
}

// resolvingFirst runs resolve before it passes the first request for a
// compensation on to svc, and keeps svc's answer.
type resolvingFirst struct {
	svc     *compensation.Service
	resolve func() error
	done    bool
	err     error
	answer  error
}

func (c *resolvingFirst) Compensate(ctx context.Context, op identity.Identity, key ledger.CallKey, reason string) (ledger.CallKey, []ledger.Event, error) {
	if !c.done {
		c.done, c.err = true, c.resolve()
	}
	ck, evs, err := c.svc.Compensate(ctx, op, key, reason)
	c.answer = err
	return ck, evs, err
}

// A call to undo under undo_unknown whose tool declares a compensation and
// no status lookup is parked, and its compensation asked for, only once
// its last attempt can no longer land (the tool's timeout after the
// outcome was recorded, and the clocks' skew): a compensation that
// reaches the tool first cancels nothing, and the call would be recorded
// compensated with its effect standing. Before, it was undone at once.
func TestUndoWaitsForTheLastAttemptToLand(t *testing.T) {
	// refund_order as a tool declaring no status lookup.
	reg := registryEdited(t, func(file string, b []byte) []byte {
		if file != "refund_order.v1.json" {
			return b
		}
		var def map[string]any
		if err := json.Unmarshal(b, &def); err != nil {
			t.Fatal(err)
		}
		delete(def, "status_lookup")
		b, _ = json.Marshal(def)
		return b
	})
	r := newRigWith(t, reg, demobackend.Config{})
	orig, unknown := r.unknownRefundToUndo()
	tool, err := reg.Lookup("refund_order", 1)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := r.store.Get(t.Context(), orig.Key())
	if err != nil {
		t.Fatal(err)
	}
	comp := &recordingCompensator{}
	now := rec.UpdatedAt.Add(tool.Timeout() / 2)
	rc := r.sweepingReconciler(comp, &now, func(c *executor.ReconcilerConfig) { c.SweepEvery = time.Second })
	if got := r.reconcile(rc, unknown); len(got) != 0 || len(comp.asked) != 0 {
		t.Errorf("while the last attempt may land: events %v, compensations asked %v; want none yet", got, comp.asked)
	}
	now = rec.UpdatedAt.Add(tool.Timeout() + 6*time.Second)
	if got := summary(r.reconcileAll(rc)); !slices.Contains(got, "parked("+executor.ReasonCompensating+")") {
		t.Errorf("the sweep once it can no longer land: %v; want the call parked, its compensation asked for", got)
	}
	if diff := cmp.Diff([]ledger.CallKey{orig.Key()}, comp.asked); diff != "" {
		t.Errorf("compensations asked for (-want +got):\n%s", diff)
	}
}

// A call whose tool's status lookup answered, once, that it is in
// progress (409, as the lookup protocol lets a tool still at a request
// answer), and failed after (503), is parked for a human once its lookups
// have gone unanswered for the bound, status_lookup_pending, and never
// undone, whatever its policy says of unknown outcomes: its request may
// land after the undo, which would then cancel nothing, and the call
// would be recorded compensated with its effect standing. Before, the
// answer counted as a failed lookup: parked status_lookup_failed, and
// under undo_unknown its compensation asked for. Nor does an operator's
// compensation of it run, before or after the park: refused
// outcome_in_progress (it passes once the tool settles the call), where
// it ran once the last attempt's landing window was over.
func TestInProgressLookupIsNeverUndone(t *testing.T) {
	r := newRig(t)
	orig, unknown := r.unknownRefundToUndo()
	r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{FailStatus: http.StatusConflict})
	comp := &recordingCompensator{}
	now := time.Now().Add(time.Hour) // long past the last attempt's landing
	rc := r.sweepingReconciler(comp, &now, func(c *executor.ReconcilerConfig) { c.UnansweredFor = time.Minute })
	sub := &countingSubmitter{}
	svc, err := compensation.New(compensation.Config{Store: r.store, Registry: r.reg, Intake: sub, Publisher: &recordingPublisher{}})
	if err != nil {
		t.Fatal(err)
	}
	operatorUndoes := func(when string) {
		t.Helper()
		ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
		if _, _, err := svc.Compensate(t.Context(), ops, orig.Key(), "refunded by mistake"); !errors.Is(err, compensation.ErrOutcomeInProgress) || sub.n != 0 {
			t.Errorf("an operator's compensation %s = %v, %d submitted; want %v, nothing submitted", when, err, sub.n, compensation.ErrOutcomeInProgress)
		}
	}
	if got := summary(r.reconcileAll(rc, unknown)); slices.Contains(got, "parked("+executor.ReasonLookupPending+")") {
		t.Fatalf("the first sweep parked the call: %v; want it waiting (the bound not reached)", got)
	}
	operatorUndoes("once the tool said the call is in progress")
	r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{FailStatus: http.StatusServiceUnavailable})
	now = now.Add(2 * time.Minute)
	got := summary(r.reconcileAll(rc))
	if !slices.Contains(got, "parked("+executor.ReasonLookupPending+")") || slices.Contains(got, "parked("+executor.ReasonCompensating+")") {
		t.Errorf("the sweep past the bound, its lookups failing since: %v; want the call parked %s, not %s", got, executor.ReasonLookupPending, executor.ReasonCompensating)
	}
	if len(comp.asked) != 0 {
		t.Errorf("compensations asked for %v; want none", comp.asked)
	}
	operatorUndoes("once it was parked for it")
}

// Asked again once the tool answered that the call is in progress, a
// compensation that exists already (asked for before the answer) is the
// answer: a retry whose reply was lost gets its key, not a refusal
// saying that no undo may be sent yet, which would hide the one under
// way.
func TestUndoAskedAgainAfterAnInProgressAnswer(t *testing.T) {
	r := newRig(t)
	orig, unknown := r.unknownRefundToUndo()
	svc, _ := r.compensations()
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	ck, _, err := svc.Compensate(t.Context(), ops, orig.Key(), "refunded by mistake")
	if err != nil {
		t.Fatalf("the compensation, asked before any answer: %v", err)
	}
	r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{FailStatus: http.StatusConflict})
	now := time.Now().Add(time.Hour)
	rc := r.sweepingReconciler(&recordingCompensator{}, &now, func(c *executor.ReconcilerConfig) { c.UnansweredFor = time.Minute })
	r.reconcileAll(rc, unknown)
	if again, _, err := svc.Compensate(t.Context(), ops, orig.Key(), "refunded by mistake"); err != nil || again != ck {
		t.Errorf("asked again once the tool said the call is in progress = %v, %v; want its compensation %v, which exists", again, err, ck)
	}
}

// What a reconciler learnt of a call whose lookups go unanswered is on
// the call's record, not only in its memory: one restarted (or taking
// the call's partition over) neither starts the wait for an answer again
// nor forgets that the tool said the call is in progress. It parks
// nothing in its own first sweep interval of failing lookups, which may
// be one burst of failures. Before, a reconciler restarted more often than the bound
// parked no call at all, and one restarted after an "in progress" answer
// parked the call status_lookup_failed and, under undo_unknown, asked for
// its undo while its request might still land.
func TestReconcilerRestartKeepsWhatTheLookupsSaid(t *testing.T) {
	for _, tc := range []struct {
		name      string
		first     int // the status lookups' answer to the first reconciler
		wantPark  string
		wantAsked int
	}{
		{"lookups failing", http.StatusServiceUnavailable, executor.ReasonCompensating, 1},
		{"the tool said in progress", http.StatusConflict, executor.ReasonLookupPending, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			_, unknown := r.unknownRefundToUndo()
			r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{FailStatus: tc.first})
			comp := &recordingCompensator{}
			now := time.Now().Add(time.Hour) // long past the last attempt's landing
			bound := func(c *executor.ReconcilerConfig) { c.UnansweredFor = 5 * time.Minute }
			before := r.sweepingReconciler(comp, &now, bound)
			if got := summary(r.reconcileAll(before, unknown)); slices.ContainsFunc(got, parkedEvent) {
				t.Fatalf("the first reconciler's round: %v; want the call waiting", got)
			}
			// It restarts; the lookups fail from then on.
			r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{FailStatus: http.StatusServiceUnavailable})
			now = now.Add(5 * time.Minute)
			after := r.sweepingReconciler(comp, &now, bound)
			if got := summary(r.reconcileAll(after)); slices.ContainsFunc(got, parkedEvent) {
				t.Fatalf("the restarted reconciler's first round, past the bound: %v; want the call waiting (its first round)", got)
			}
			// The call's event again (redelivered), in the same burst: a
			// second round, but not a sweep interval after the first.
			now = now.Add(time.Second)
			if got := summary(r.reconcileAll(after, unknown)); slices.ContainsFunc(got, parkedEvent) {
				t.Fatalf("its second round, a second after its first: %v; want the call waiting (one burst of failures)", got)
			}
			now = now.Add(time.Minute)
			if got := summary(r.reconcileAll(after)); !slices.Contains(got, "parked("+tc.wantPark+")") {
				t.Errorf("its round a sweep later, 6 minutes after the first reconciler's: %v; want the call parked %s", got, tc.wantPark)
			}
			if len(comp.asked) != tc.wantAsked {
				t.Errorf("compensations asked for %v; want %d", comp.asked, tc.wantAsked)
			}
		})
	}
}

// A reconciler's park for lookups that failed does not land once another
// reconciler has heard, after the first read the note, that the call is
// in progress: its next round parks the call status_lookup_pending, and
// nothing asks for its undo. Before the move was fenced on the note, the
// park landed and its compensation was asked for while the request
// might still land.
func TestParkFencedByAnInProgressHeardMeanwhile(t *testing.T) {
	r := newRig(t)
	_, unknown := r.unknownRefundToUndo()
	comp := &recordingCompensator{}
	now := time.Now().Add(time.Hour) // long past the last attempt's landing
	st := &hearsInProgress{ReconcilerStore: r.store, at: 2}
	rc := r.sweepingReconciler(comp, &now, func(c *executor.ReconcilerConfig) {
		c.UnansweredFor = time.Minute
		c.Store = st
	})
	if got := summary(r.reconcileAll(rc, unknown)); slices.ContainsFunc(got, parkedEvent) {
		t.Fatalf("the first round: %v; want the call waiting", got)
	}
	now = now.Add(2 * time.Minute)
	if got := summary(r.reconcileAll(rc)); slices.ContainsFunc(got, parkedEvent) || len(comp.asked) != 0 {
		t.Fatalf("the round whose park another reconciler's in-progress note overtook: %v, compensations asked %v; want no park landed, none asked", got, comp.asked)
	}
	if st.calls < 2 {
		t.Fatalf("%d notes written; want the one before the park (the test's premise)", st.calls)
	}
	now = now.Add(time.Minute)
	if got := summary(r.reconcileAll(rc)); !slices.Contains(got, "parked("+executor.ReasonLookupPending+")") {
		t.Errorf("the next round: %v; want the call parked %s", got, executor.ReasonLookupPending)
	}
	if len(comp.asked) != 0 {
		t.Errorf("compensations asked for %v; want none", comp.asked)
	}
}

// A lookup answered "in progress" ends its pass, and the answer is on
// the call's record at once: another reconciler's park for failing
// lookups is fenced by it from then on, not only once this pass's
// remaining attempts (each up to the tool's timeout) are over.
func TestInProgressAnswerEndsThePassNoted(t *testing.T) {
	r := newRig(t)
	_, unknown := r.unknownRefundToUndo()
	r.backend.SetFault(demobackend.ToolRefundOrder+"/status", demobackend.Fault{FailStatus: http.StatusConflict})
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.UnansweredFor = time.Hour })
	before := r.backend.Requests()
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Errorf("a pass answered in progress: %q; want nothing recorded", got)
	}
	if n := r.backend.Requests() - before; n != 1 {
		t.Errorf("%d status lookups; want 1, the pass ended at the answer", n)
	}
	rec, err := r.store.Get(t.Context(), decodeAll(t, []*kgo.Record{unknown})[0].Key())
	if err != nil {
		t.Fatal(err)
	}
	if note, ok := rec.UnansweredAt(); !ok || !note.InProgress {
		t.Errorf("the record's note = %+v, %v; want it in progress", note, ok)
	}
}

// hearsInProgress is a store on which, right after the at-th note of
// unanswered lookups, another reconciler notes that the tool said the
// call is in progress.
type hearsInProgress struct {
	executor.ReconcilerStore
	at, calls int
}

func (s *hearsInProgress) NoteUnanswered(ctx context.Context, k ledger.CallKey, n processors.Unanswered) (processors.Unanswered, bool, error) {
	note, ok, err := s.ReconcilerStore.NoteUnanswered(ctx, k, n)
	if s.calls++; s.calls == s.at && err == nil && ok {
		_, _, err = s.ReconcilerStore.NoteUnanswered(ctx, k, processors.Unanswered{Seq: n.Seq, Since: n.Since, InProgress: true})
	}
	return note, ok, err
}

// parkedEvent reports whether a summary's event is a park.
func parkedEvent(e string) bool { return strings.HasPrefix(e, "parked") }

// A parked call whose compensation succeeded is settled compensated by a
// sweep, its success read from the store, when the reconciler never read
// the success event (one it could not decode, say, its offset committed
// all the same). Before, the sweep took the compensation for running and
// left the call parked compensation_requested for good.
func TestSweepSettlesACompensationWhoseSuccessWasMissed(t *testing.T) {
	r := newRig(t)
	var now time.Time
	orig, _, pub, rc, _ := r.undoRequested(&now)
	ck := orig.Key().CompensationKey()
	if _, err := r.executor(nil).Step(t.Context(), pub.authorized(t, ck)); err != nil {
		t.Fatal(err)
	}
	if rec, err := r.store.Get(t.Context(), ck); err != nil || rec.Status != processors.StatusSucceeded {
		t.Fatalf("the compensation is %s (%v); want succeeded", rec.Status, err)
	}
	// Its success event is not given to the reconciler: only sweeps.
	now = now.Add(time.Minute)
	var got []string
	for _, e := range r.reconcileAll(rc) {
		if e.Key() == orig.Key() {
			got = append(got, string(e.Type))
		}
	}
	// Its earlier events come again ahead (the outbox's), then its own.
	if len(got) == 0 || got[len(got)-1] != "compensated" {
		t.Errorf("the sweep's events for the call: %v; want it compensated", got)
	}
	if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusCompensated {
		t.Errorf("the call is %s (%v); want compensated", rec.Status, err)
	}
}

// A reconciler meeting an event of a newer encoding among those it acts
// on stops, as an executor does, rather than pass over what may be a
// compensation's success: no sweep finds an operator's compensation's
// success again, and the undone call would stay succeeded. A damaged
// event is passed over, and counted.
func TestReconcilerStopsOnANewerEncoding(t *testing.T) {
	event := func(typ, value string) *kgo.Record {
		return &kgo.Record{Topic: "toolcalls.events", Key: []byte("t_a/kr:compensate"), Value: []byte(value),
			Headers: []kgo.RecordHeader{{Key: ledger.HeaderEventType, Value: []byte(typ)}}}
	}
	r := newRig(t)
	reg := metrics.New("reconciler", nil)
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Metrics = reg })
	newer := event("succeeded", `{"v":99,"type":"succeeded","seq":5,"tenant_id":"t_a","idempotency_key":"kr:compensate"}`)
	if _, err := rc.Step(t.Context(), []*kgo.Record{newer}); !errors.Is(err, ledger.ErrStop) || !errors.Is(err, ledger.ErrUnsupportedEncoding) {
		t.Errorf("a step meeting a compensation's success of a newer encoding: %v; want ErrStop and ErrUnsupportedEncoding", err)
	}
	if n := counter(t, reg, "ledger_events_undecodable_total"); n != 0 {
		t.Errorf("ledger_events_undecodable_total = %v after the newer event; want 0 (nothing was passed over)", n)
	}
	damaged := event("succeeded", `{"v":1,"type":"succeeded","seq":"five"}`)
	if _, err := rc.Step(t.Context(), []*kgo.Record{damaged}); err != nil {
		t.Errorf("a step meeting a damaged event: %v; want it passed over", err)
	}
	if n := counter(t, reg, "ledger_events_undecodable_total"); n != 1 {
		t.Errorf("ledger_events_undecodable_total = %v after the damaged event; want 1", n)
	}
}

// An operator's undo of a call whose outcome went unknown moments ago is
// refused until its last attempt can no longer reach the tool
// (compensation.ErrMayStillLand, naming when to ask again), as the
// reconciler waits for its own: sent first, the undo would cancel
// nothing, and the call would be recorded compensated with its effect
// standing. Then it is asked for as before.
func TestOperatorUndoWaitsForTheLastAttemptToLand(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	rec, err := r.store.Get(t.Context(), orig.Key())
	if err != nil {
		t.Fatal(err)
	}
	tool, err := r.reg.Lookup("refund_order", 1)
	if err != nil {
		t.Fatal(err)
	}
	landing := executor.Landing(tool, 0)
	now := rec.UpdatedAt.Add(time.Second)
	svc, err := compensation.New(compensation.Config{Store: r.store, Registry: r.reg, Intake: r.in, Publisher: &recordingPublisher{},
		Landing: func(t *schemas.Tool) time.Duration { return executor.Landing(t, 0) }, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	op := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	ck := orig.Key().CompensationKey()
	_, _, err = svc.Compensate(t.Context(), op, orig.Key(), "undo it")
	le, ok := errors.AsType[*compensation.LandingError](err)
	if !errors.Is(err, compensation.ErrMayStillLand) || !ok || !le.Until.Equal(rec.UpdatedAt.Add(landing)) {
		t.Fatalf("an undo a second after the outcome went unknown: %v; want ErrMayStillLand until %s", err, rec.UpdatedAt.Add(landing))
	}
	if _, err := r.store.Get(t.Context(), ck); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("the refused undo left a compensation: %v; want none", err)
	}
	now = rec.UpdatedAt.Add(landing)
	if got, _, err := svc.Compensate(t.Context(), op, orig.Key(), "undo it"); err != nil || got != ck {
		t.Errorf("the undo once the last attempt can no longer land: %v, %v; want %s asked for", got, err, ck)
	}
}

// A compensation's success is recorded on the call it undid though the
// registry has since declared another compensation for the call's tool
// (a release between the request and its success): the key is one only
// the compensation service runs a call under. Before, the success was
// dropped at every sweep, and the undone call stayed succeeded for good.
func TestCompensationRecordedAfterTheRegistryChanged(t *testing.T) {
	r := newRig(t)
	orig, succeeded := r.compensationSucceeded("kv")
	// The release after: refund_order's compensation is now another tool.
	reg := registryEdited(t, func(file string, b []byte) []byte {
		if file != "refund_order.v1.json" {
			return b
		}
		return []byte(strings.Replace(string(b), `"tool": "cancel_refund"`, `"tool": "notify"`, 1))
	})
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Registry = reg })
	r.reconcileAll(rc, succeeded)
	if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusCompensated {
		t.Errorf("the undone call: %v, %v; want compensated", rec.Status, err)
	}
}

// changedArguments is the store, whose record of key holds other
// arguments than the ones hashed (changed in the store); with rehashed,
// its hash too, recomputed to match them (arguments and hash rewritten
// together).
type changedArguments struct {
	processors.Store
	key      ledger.CallKey
	rehashed bool
}

func (c changedArguments) Get(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	rec, err := c.Store.Get(ctx, k)
	if k == c.key && err == nil {
		rec.Arguments = []byte(`{"amount_cents":100,"currency":"AUD","order_id":"ord_someone_elses"}`)
		if c.rehashed {
			rec.ArgumentsHash, err = ledger.HashCanonicalArguments(rec.Key.TenantID, rec.Tool, rec.ToolVersion, rec.Arguments)
		}
	}
	return rec, err
}

// A call whose stored arguments no longer match their hash is not undone
// with them: the undo would act on what they say now (another order's
// refund cancelled), under a hash of its own that every later check
// passes. Refused, terminal, for a human; nothing submitted. Before, the
// compensation was made of the changed arguments. So too when their hash
// was rewritten with them: it is not the hash the call's events name.
func TestCompensationOfChangedArgumentsIsRefused(t *testing.T) {
	for _, rehashed := range []bool{false, true} {
		t.Run(fmt.Sprintf("hash rewritten too %v", rehashed), func(t *testing.T) {
			r := newRig(t)
			orig, approved := r.admitApproved("kr", time.Now().Add(time.Hour), "")
			stepEndsAs(t, r.executor(nil), approved, []string{"executing", "succeeded"}, "")
			sub := &countingSubmitter{}
			st := changedArguments{Store: r.store, key: orig.Key(), rehashed: rehashed}
			svc, err := compensation.New(compensation.Config{Store: st, Registry: r.reg, Intake: sub, Publisher: &recordingPublisher{}})
			if err != nil {
				t.Fatal(err)
			}
			ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
			_, _, err = svc.Compensate(t.Context(), ops, orig.Key(), "refunded by mistake")
			var terminal interface{ Terminal() bool }
			if !errors.Is(err, compensation.ErrArgumentsChanged) || !errors.As(err, &terminal) || !terminal.Terminal() || sub.n != 0 {
				t.Errorf("compensation of a call whose arguments changed = %v, %d submitted; want %v, terminal, nothing submitted", err, sub.n, compensation.ErrArgumentsChanged)
			}
		})
	}
}

// handingOver is the store, except that its first MarkUndo is preceded by
// another reconciler's hand-over of the call to a human (parked again,
// compensation_abandoned), as decided from a read of the call before the
// compensation was admitted (its undo marks then). err is the hand-over's
// (MarkUndo runs on the call's goroutine, not the test's).
type handingOver struct {
	executor.Store
	call ledger.CallKey
	done bool
	err  error
}

func (s *handingOver) MarkUndo(ctx context.Context, k ledger.CallKey, undoable []processors.Status) (processors.Status, bool, error) {
	if !s.done {
		s.done, s.err = true, handOver(ctx, s.Store, s.call)
	}
	return s.Store.MarkUndo(ctx, k, undoable)
}

// handOver moves the call key, parked compensation_requested, to parked
// compensation_abandoned, as a reconciler that found no compensation
// requested does; an error unless the move applies.
func handOver(ctx context.Context, st executor.Store, key ledger.CallKey) error {
	rec, err := st.Get(ctx, key)
	if err != nil {
		return err
	}
	evs, err := ledger.DecodeEvents(rec.Outbox)
	if err != nil {
		return err
	}
	park := evs[len(evs)-1]
	park.EventID, park.Seq, park.Reason = "e_handed_over", rec.Seq+1, executor.ReasonUndoAbandoned
	outbox, err := ledger.EncodeEvents(append(evs, park))
	if err != nil {
		return err
	}
	applied, err := st.Move(ctx, []processors.Move{{Key: key, From: rec.Status, FromSeq: rec.Seq, FromUndoMarks: rec.UndoMarks,
		To: processors.StatusParked, Seq: rec.Seq + 1, Outbox: outbox}})
	if err == nil && !applied[0] {
		err = errors.New("the hand-over did not apply")
	}
	return err
}

// The reconciler's compensation of a call that another reconciler handed
// to a human after it was admitted (finding none requested just before)
// undoes nothing: the human was told that no compensation was asked for,
// and may undo the call by hand. The hand-over may land before the
// compensation's executor checks the call, or while it does; one decided
// before the check and landing after it is fenced out by the check's
// mark, and the compensation runs. Before, a parked call was undone
// whatever its park said.
//
// The human is told so: their request to undo the call, which would
// join that compensation and be dropped with it, is refused saying it
// will not run; and resolving the call succeeded needs no confirmation
// that the undo is given up, for none will run.
func TestAutomaticUndoOfACallHandedToAHumanMeanwhile(t *testing.T) {
	t.Run("the human asks", func(t *testing.T) {
		r := newRig(t)
		var now time.Time
		orig, svc, pub, _, _ := r.undoRequested(&now)
		ck := orig.Key().CompensationKey()
		if err := handOver(t.Context(), r.store, orig.Key()); err != nil {
			t.Fatal(err)
		}
		ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
		if _, _, err := svc.Compensate(t.Context(), ops, orig.Key(), "the customer asked for it back"); !errors.Is(err, compensation.ErrAutomaticCompensationPending) ||
			!strings.Contains(err.Error(), "undone by hand") {
			t.Errorf("the human's request to undo the call = %v; want ErrAutomaticCompensationPending, saying to undo it by hand", err)
		}
		if _, err := r.reconcilerAt(afterLanding).Resolve(t.Context(), ops, orig.Key(), executor.Resolution{As: processors.StatusSucceeded, Evidence: "the bank says"}); err != nil {
			t.Fatalf("resolved succeeded without confirming the undo given up = %v; want resolved", err)
		}
		if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusSucceeded {
			t.Errorf("the call is %s (%v); want succeeded", rec.Status, err)
		}
		if _, err := r.executor(nil).Step(t.Context(), pub.authorized(t, ck)); err != nil {
			t.Fatal(err)
		}
		if n := r.backend.AppliedIn("cancel_refund", "t_a", ck.String()); n != 0 {
			t.Errorf("cancel_refund applied %d times; want 0", n)
		}
		comp, err := r.store.Get(t.Context(), ck)
		if err != nil {
			t.Fatal(err)
		}
		evs, err := ledger.DecodeEvents(comp.Outbox)
		if err != nil || len(evs) == 0 || evs[len(evs)-1].Reason != executor.ReasonCompensationCancelled || !strings.Contains(evs[len(evs)-1].Detail, "handed to a human") {
			t.Errorf("the compensation ended %+v (%v); want cancelled, saying the call was handed to a human", evs[len(evs)-1:], err)
		}
	})
	// Resolved failed: the compensation's end would settle nothing, so
	// the resolution is not held for it; it then finds nothing to undo.
	t.Run("the human resolves it failed", func(t *testing.T) {
		r := newRig(t)
		var now time.Time
		orig, _, pub, _, _ := r.undoRequested(&now)
		ck := orig.Key().CompensationKey()
		if err := handOver(t.Context(), r.store, orig.Key()); err != nil {
			t.Fatal(err)
		}
		ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
		if _, err := r.reconcilerAt(afterLanding).Resolve(t.Context(), ops, orig.Key(), executor.Resolution{As: processors.StatusFailed, Evidence: "the bank says it never landed"}); err != nil {
			t.Fatalf("resolved failed = %v; want resolved", err)
		}
		out, err := r.executor(nil).Step(t.Context(), pub.authorized(t, ck))
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff([]string{"denied(" + executor.ReasonNothingToUndo + ")"}, summary(decodeAll(t, out.Records))); diff != "" {
			t.Errorf("the compensation (-want +got):\n%s", diff)
		}
		if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusFailed {
			t.Errorf("the call is %s (%v); want failed", rec.Status, err)
		}
		if n := r.backend.AppliedIn("cancel_refund", "t_a", ck.String()); n != 0 {
			t.Errorf("cancel_refund applied %d times; want 0", n)
		}
	})
	for _, tc := range []struct {
		name string
		// when: "before" the executor's step, "at" its check (MarkUndo),
		// "after" it, from a read before it.
		when string
		runs int
	}{
		{"handed over before the check", "before", 0},
		{"handed over as it checks", "at", 0},
		{"hand-over read before the check, written after", "after", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			var now time.Time
			orig, _, pub, _, _ := r.undoRequested(&now)
			ck := orig.Key().CompensationKey()
			var st executor.Store = r.store
			switch tc.when {
			case "before":
				if err := handOver(t.Context(), r.store, orig.Key()); err != nil {
					t.Fatal(err)
				}
			case "at":
				st = &handingOver{Store: r.store, call: orig.Key()}
			}
			read, err := r.store.Get(t.Context(), orig.Key())
			if err != nil {
				t.Fatal(err)
			}
			out, err := r.executor(func(c *executor.Config) { c.Store = st }).Step(t.Context(), pub.authorized(t, ck))
			if err != nil {
				t.Fatal(err)
			}
			if h, ok := st.(*handingOver); ok && (!h.done || h.err != nil) {
				t.Fatalf("the hand-over as the executor checked: done %v, %v", h.done, h.err)
			}
			evs := decodeAll(t, out.Records)
			if n := r.backend.AppliedIn("cancel_refund", "t_a", ck.String()); n != tc.runs {
				t.Errorf("cancel_refund applied %d times; want %d", n, tc.runs)
			}
			if tc.runs == 1 {
				if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(evs)); diff != "" {
					t.Errorf("the compensation (-want +got):\n%s", diff)
				}
				// The hand-over, from the read before the check: fenced.
				applied, err := r.store.Move(t.Context(), []processors.Move{{Key: orig.Key(), From: read.Status, FromSeq: read.Seq,
					FromUndoMarks: read.UndoMarks, To: processors.StatusParked, Seq: read.Seq + 1, Outbox: read.Outbox}})
				if err != nil || applied[0] {
					t.Errorf("a hand-over read before the check applied %v (%v); want not applied", applied, err)
				}
				return
			}
			if diff := cmp.Diff([]string{"denied(" + executor.ReasonNothingToUndo + ")"}, summary(evs)); diff != "" {
				t.Fatalf("the compensation (-want +got):\n%s", diff)
			}
			if d := evs[0].Detail; !strings.Contains(d, "handed to a human") {
				t.Errorf("the refusal says %q; want it to say the call was handed to a human", d)
			}
			if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusParked {
				t.Errorf("the call is %s (%v); want parked, still the human's", rec.Status, err)
			}
		})
	}
}
