package approvals_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/approvals"
	"github.com/toolcall-ledger/ledger/processors/boltstore"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// testPolicies route refunds to approval and let tickets through.
const testPolicies = `
@id("refunds") @obligation("require_approval")
permit (principal, action == Action::"tool::refund_order", resource);
@id("tickets")
permit (principal, action == Action::"tool::create_ticket", resource);
`

// clock is a settable clock, safe for concurrent use.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// recorder is a Publisher that keeps what it was given, or fails.
type recorder struct {
	mu   sync.Mutex
	recs []*kgo.Record
	fail atomic.Bool
}

func (r *recorder) Publish(ctx context.Context, recs ...*kgo.Record) error {
	if r.fail.Load() {
		return errors.New("broker unavailable")
	}
	if err := ctx.Err(); err != nil {
		// As a producer does.
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, recs...)
	return nil
}

func (r *recorder) events(t *testing.T) []ledger.Event {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	var evs []ledger.Event
	for _, rec := range r.recs {
		e, err := ledger.DecodeEvent(rec.Value)
		if err != nil {
			t.Fatal(err)
		}
		if string(rec.Key) != e.Key().String() || rec.Topic != "toolcalls.events" {
			t.Errorf("event %s/%d published under key %q on %q; want its call key on toolcalls.events", e.Key(), e.Seq, rec.Key, rec.Topic)
		}
		evs = append(evs, e)
	}
	return evs
}

func (r *recorder) ofType(t *testing.T, typ statemachine.EventType) []ledger.Event {
	t.Helper()
	var out []ledger.Event
	for _, e := range r.events(t) {
		if e.Type == typ {
			out = append(out, e)
		}
	}
	return out
}

// fixture is a real intake and a real embedded store, with the approval
// queue on top.
type fixture struct {
	t     *testing.T
	store *boltstore.Store
	reg   *schemas.Registry
	ident *processorstest.Identity
	in    *intake.Processor
	pub   *recorder
	clock *clock
	svc   *approvals.Service
	// roles are the requesters' roles in the envelopes' assertions.
	roles []string
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	st, err := boltstore.Open(boltstore.Config{Path: filepath.Join(t.TempDir(), "x.db")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	reg, err := schemas.Load(os.DirFS("../testdata/registry"))
	if err != nil {
		t.Fatal(err)
	}
	ident := processorstest.NewIdentity(t)
	in, err := intake.New(intake.Config{Registry: reg, Store: st, Identity: ident.Verifier, Policy: processorstest.Policy(t, processorstest.PolicyDir(t, testPolicies))})
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{t: t, store: st, reg: reg, ident: ident, in: in, pub: &recorder{}, clock: &clock{now: time.Now().UTC()}}
	f.svc = f.service()
	return f
}

// service returns another approval queue instance on the fixture's store,
// publisher and clock, its configuration edited by each of edits.
func (f *fixture) service(edits ...func(*approvals.Config)) *approvals.Service {
	f.t.Helper()
	cfg := approvals.Config{Store: f.store, Registry: f.reg, Identity: f.ident.Verifier, Publisher: f.pub, Now: f.clock.Now}
	for _, edit := range edits {
		edit(&cfg)
	}
	svc, err := approvals.New(cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	return svc
}

// envelope is a signed request of user in tenant.
func (f *fixture) envelope(tenant, user, key, tool string, args map[string]any) *kgo.Record {
	t := f.t
	t.Helper()
	raw, _ := json.Marshal(args)
	tree, err := ledger.Decode(raw, ledger.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	hash, err := ledger.ArgumentsHash(tenant, tool, 1, tree)
	if err != nil {
		t.Fatal(err)
	}
	v, _ := json.Marshal(map[string]any{
		"tool": tool, "tool_version": 1, "call_id": "c_" + key, "arguments": args,
		"scope": map[string]any{"tenant_id": tenant}, "idempotency_key": key, "arguments_hash": hash,
		"assertion": f.ident.AssertionWithRoles(t, tenant, user, f.roles...), "trace_id": "trace-" + key,
	})
	return &kgo.Record{Topic: "toolcalls.requests", Value: v}
}

// submitTo runs envelopes through the intake; with commit the log is
// taken to have the intake's events.
func (f *fixture) submitTo(commit bool, recs ...*kgo.Record) []ledger.Event {
	t := f.t
	t.Helper()
	out, err := f.in.Step(t.Context(), recs)
	if err != nil {
		t.Fatal(err)
	}
	if commit && out.Committed != nil {
		if err := out.Committed(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	var evs []ledger.Event
	for _, r := range out.Records {
		e, err := ledger.DecodeEvent(r.Value)
		if err != nil {
			t.Fatal(err)
		}
		evs = append(evs, e)
	}
	return evs
}

// refund submits a refund of user u_1 in t_a under key, which waits for
// approval, and returns the intake's events.
func (f *fixture) refund(key string) (ledger.CallKey, []ledger.Event) {
	f.t.Helper()
	evs := f.submitTo(true, f.envelope("t_a", "u_1", key, "refund_order",
		map[string]any{"order_id": "ord_" + strings.ReplaceAll(key, "-", ""), "amount_cents": 4500, "currency": "AUD", "reason": "customer is upset"}))
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: key}
	if len(evs) != 2 || evs[1].Type != statemachine.EventApprovalPending {
		f.t.Fatalf("intake appended %v; want requested + approval_pending", types(evs))
	}
	return k, evs
}

// refunds submits n refunds as refund does, under keys prefix-0,
// prefix-1..., and returns their approval ids in that order.
func (f *fixture) refunds(prefix string, n int) []string {
	f.t.Helper()
	var ids []string
	for i := range n {
		k, _ := f.refund(fmt.Sprintf("%s-%d", prefix, i))
		ids = append(ids, approvals.ID(k))
	}
	return ids
}

// listedIDs is the ids of the approvals svc lists to boss in state.
func listedIDs(t *testing.T, svc *approvals.Service, state string) []string {
	t.Helper()
	list, _, err := svc.List(t.Context(), boss, state)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, a := range list {
		out = append(out, a.ID)
	}
	return out
}

func (f *fixture) record(k ledger.CallKey) processors.Record {
	f.t.Helper()
	rec, err := f.store.Get(f.t.Context(), k)
	if err != nil {
		f.t.Fatal(err)
	}
	return rec
}

func types(evs []ledger.Event) []string {
	var s []string
	for _, e := range evs {
		s = append(s, fmt.Sprintf("%s@%d", e.Type, e.Seq))
	}
	return s
}

// fold folds events through the state machine.
func fold(t *testing.T, evs []ledger.Event) statemachine.Call {
	t.Helper()
	ts := make([]statemachine.Event, len(evs))
	for i := range evs {
		ts[i] = evs[i].Transition()
	}
	c, err := statemachine.Fold(ts)
	if err != nil {
		t.Fatalf("the state machine refuses %v: %v", types(evs), err)
	}
	return c
}

var (
	boss      = identity.Identity{User: "u_boss", Agent: "console", Tenant: "t_a", Roles: []string{"approver"}}
	bossOfB   = identity.Identity{User: "u_boss", Agent: "console", Tenant: "t_b", Roles: []string{"approver"}}
	requester = identity.Identity{User: "u_1", Agent: "console", Tenant: "t_a", Roles: []string{"approver"}}
	plainUser = identity.Identity{User: "u_2", Agent: "console", Tenant: "t_a", Roles: []string{"operator"}}
)

// The happy path: the pending approval shows a readable preview; approving
// it with the hash the approver saw moves the record to authorized, emits
// an approved event bound to the hash and expiry, publishes it and marks
// it logged; the state machine accepts the whole sequence. The approved
// event carries the roles the requester's call was decided with, which the
// executor decides it again with.
func TestApprove(t *testing.T) {
	f := newFixture(t)
	f.withRoles("support", "finance")
	k, intakeEvs := f.refund("r-1")
	pendingEv := intakeEvs[1]

	list, _, err := f.svc.List(t.Context(), boss, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 {
		t.Fatalf("List returned %d approvals; want 1", len(list))
	}
	a := list[0]
	want := approvals.Approval{
		ID: approvals.ID(k), TenantID: "t_a", IdempotencyKey: "r-1", CallID: "c_r-1",
		Tool: "refund_order", ToolVersion: 1,
		Requester:     approvals.Requester{User: "u_1", Agent: "agent_test", Roles: []string{"finance", "support"}, RolesGiven: true},
		ArgumentsHash: intakeEvs[0].ArgumentsHash,
		PolicyVersion: pendingEv.PolicyVersion, PolicyIDs: []string{"refunds"},
		RequestedAt: intakeEvs[0].At, ExpiresAt: *pendingEv.ExpiresAt,
		State: approvals.StatePending,
		Preview: approvals.Preview{
			Tool: "refund_order", Description: "Refund part or all of an order to the customer's original payment method.",
			Effect: "external_side_effect", Risk: "high", Resource: "ord_r1", Amount: "45.00 AUD",
			Compensation: "cancel_refund.v1",
		},
	}
	// The list leaves the arguments out (an agent's, up to an
	// envelope's size each, a thousand to a list); Get has them.
	if diff := cmp.Diff(want, a); diff != "" {
		t.Errorf("pending approval listed (-want +got):\n%s", diff)
	}
	got, err := f.svc.Get(t.Context(), boss, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	want.Preview.Arguments = intakeEvs[0].Arguments
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("pending approval got (-want +got):\n%s", diff)
	}
	if !strings.Contains(string(got.Preview.Arguments), ledger.Redacted) || strings.Contains(string(got.Preview.Arguments), "customer is upset") {
		t.Errorf("preview arguments %s; want the registry's redaction of /reason applied", got.Preview.Arguments)
	}

	approved, err := f.svc.Approve(t.Context(), boss, a.ID, a.ArgumentsHash)
	if err != nil {
		t.Fatal(err)
	}
	if approved.State != approvals.StateApproved || approved.DecidedBy != "u_boss" || approved.DecidedAt == nil || !approved.DecidedAt.Equal(f.clock.Now()) {
		t.Errorf("approved: state %s by %q at %v; want approved by u_boss at %v", approved.State, approved.DecidedBy, approved.DecidedAt, f.clock.Now())
	}
	if diff := cmp.Diff(got.Preview, approved.Preview); diff != "" {
		t.Errorf("preview after approval (-before +after):\n%s", diff)
	}

	rec := f.record(k)
	if rec.Status != processors.StatusAuthorized || rec.Seq != 3 || rec.LoggedSeq != 3 {
		t.Errorf("record %s at seq %d, logged %d; want authorized at 3, logged 3", rec.Status, rec.Seq, rec.LoggedSeq)
	}
	pub := f.pub.events(t)
	if len(pub) != 1 {
		t.Fatalf("published %v; want the approved event alone", types(pub))
	}
	ev := pub[0]
	if rec.ToolDigest == "" || pendingEv.ToolDigest != rec.ToolDigest {
		t.Errorf("the record binds tool digest %q, the pending event names %q; want one digest, named", rec.ToolDigest, pendingEv.ToolDigest)
	}
	exp := *pendingEv.ExpiresAt
	wantEv := ledger.Event{
		V: 2, EventID: ev.EventID, Type: statemachine.EventApproved, Seq: 3,
		At: f.clock.Now(), Actor: "approvals",
		TenantID: "t_a", IdempotencyKey: "r-1", CallID: "c_r-1", UserID: "u_1", AgentID: "agent_test", Channel: "kafka",
		Roles: []string{"finance", "support"}, RolesGiven: true,
		Tool: "refund_order", ToolVersion: 1, ToolDigest: rec.ToolDigest, Resource: "ord_r1", ArgumentsHash: a.ArgumentsHash, TraceID: "trace-r-1",
		PolicyID: pendingEv.PolicyID, PolicyVersion: pendingEv.PolicyVersion, Obligations: pendingEv.Obligations,
		Decision: "approve", ApprovalID: a.ID, Approver: "u_boss", ExpiresAt: &exp,
	}
	if diff := cmp.Diff(wantEv, ev); diff != "" {
		t.Errorf("approved event (-want +got):\n%s", diff)
	}
	if ev.EventID == "" {
		t.Error("approved event without event id")
	}

	c := fold(t, append(intakeEvs, ev))
	if c.State != statemachine.StateAuthorized || c.ApprovalID != a.ID || !c.ApprovalExpiresAt.Equal(exp) {
		t.Errorf("folded call %s, approval %q until %v; want authorized, %q until %v", c.State, c.ApprovalID, c.ApprovalExpiresAt, a.ID, exp)
	}
	if list, _, _ := f.svc.List(t.Context(), boss, "pending"); len(list) != 0 {
		t.Errorf("a decided approval is still listed as pending: %v", list)
	}
}

// Reject records the approver's words; the call is rejected for good.
func TestReject(t *testing.T) {
	f := newFixture(t)
	k, intakeEvs := f.refund("r-1")
	id := approvals.ID(k)

	a, err := f.svc.Reject(t.Context(), boss, id, "  amount looks wrong  ")
	if err != nil {
		t.Fatal(err)
	}
	if a.State != approvals.StateRejected || a.DecidedBy != "u_boss" || a.Reason != "amount looks wrong" {
		t.Errorf("rejected: %s by %q (%q); want rejected by u_boss (amount looks wrong)", a.State, a.DecidedBy, a.Reason)
	}
	if rec := f.record(k); rec.Status != processors.StatusRejected || rec.LoggedSeq != 3 {
		t.Errorf("record %s, logged %d; want rejected, logged 3", rec.Status, rec.LoggedSeq)
	}
	pub := f.pub.ofType(t, statemachine.EventRejected)
	if len(pub) != 1 {
		t.Fatalf("published %d rejected events; want 1", len(pub))
	}
	ev := pub[0]
	if ev.Seq != 3 || ev.Reason != approvals.ReasonRejected || ev.Detail != "amount looks wrong" || ev.Approver != "u_boss" || ev.ApprovalID != id || ev.UserID != "u_1" {
		t.Errorf("rejected event: seq %d, reason %q, detail %q, approver %q, approval %q, user %q", ev.Seq, ev.Reason, ev.Detail, ev.Approver, ev.ApprovalID, ev.UserID)
	}
	if c := fold(t, append(intakeEvs, ev)); c.State != statemachine.StateRejected {
		t.Errorf("folded call %s; want rejected", c.State)
	}
	if _, err := f.svc.Approve(t.Context(), boss, id, a.ArgumentsHash); !errors.Is(err, approvals.ErrNotPending) {
		t.Errorf("approve after reject: %v; want ErrNotPending", err)
	}
	list, _, err := f.svc.List(t.Context(), boss, "rejected")
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].ID != id || list[0].Reason != "amount looks wrong" {
		t.Errorf("rejected list %+v; want the one rejection with its reason", list)
	}
}

// Once its call has run, an approval still names its approver, whom the
// executor's events that replaced the approved one in the record carry on,
// and leaves out the times the record no longer holds. Before, it showed no
// approver and expires_at 0001-01-01T00:00:00Z.
func TestApprovalAfterItsCallRan(t *testing.T) {
	f := newFixture(t)
	k, _ := f.refund("r-1")
	id := approvals.ID(k)
	if _, err := f.svc.Approve(t.Context(), boss, id, f.record(k).ArgumentsHash); err != nil {
		t.Fatal(err)
	}
	approved := f.pub.ofType(t, statemachine.EventApproved)
	if len(approved) != 1 {
		t.Fatalf("published %d approved events; want 1", len(approved))
	}
	f.run(k, approved[0])

	got, err := f.svc.Get(t.Context(), boss, id)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != approvals.StateApproved || got.DecidedBy != "u_boss" {
		t.Errorf("approval after its call ran: %s by %q; want approved by u_boss", got.State, got.DecidedBy)
	}
	b, err := json.Marshal(got)
	if err != nil {
		t.Fatal(err)
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(b, &fields); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"expires_at", "decided_at"} {
		if v, ok := fields[name]; ok {
			t.Errorf("%s: %s after the call ran; want it left out, the record no longer holds it", name, v)
		}
	}
}

// An approved call's approval says where the call stands, and why it
// ended when it ended without running: one approved with too little left
// lapses before its request can leave, and the approval alone read
// "approved" for good. Before, nothing said the call was denied.
func TestApprovalSaysWhatBecameOfItsCall(t *testing.T) {
	f := newFixture(t)
	ran, _ := f.refund("r-1")
	lapsed, _ := f.refund("r-2")
	for _, k := range []ledger.CallKey{ran, lapsed} {
		a, err := f.svc.Approve(t.Context(), boss, approvals.ID(k), f.record(k).ArgumentsHash)
		if err != nil {
			t.Fatal(err)
		}
		if a.CallStatus != string(processors.StatusAuthorized) || a.CallReason != "" {
			t.Errorf("%s approved: call %q (%q); want authorized", k, a.CallStatus, a.CallReason)
		}
	}
	approved := f.pub.ofType(t, statemachine.EventApproved)
	f.run(ran, approved[0])
	f.deny(lapsed, approved[1], "approval_expired")
	for k, want := range map[ledger.CallKey][2]string{ran: {"succeeded", ""}, lapsed: {"denied", "approval_expired"}} {
		got, err := f.svc.Get(t.Context(), boss, approvals.ID(k))
		if err != nil {
			t.Fatal(err)
		}
		if got.State != approvals.StateApproved || got.CallStatus != want[0] || got.CallReason != want[1] {
			t.Errorf("%s: %s, call %q (%q); want approved, call %q (%q)", k, got.State, got.CallStatus, got.CallReason, want[0], want[1])
		}
	}
}

// deny claims the authorized call under k and ends it denied for reason,
// as the executor does a call it finds may not run (its approval lapsed,
// its tool frozen): its denied event keeps approved's approval id.
func (f *fixture) deny(k ledger.CallKey, approved ledger.Event, reason string) {
	f.t.Helper()
	f.end(k, approved, processors.StatusDenied, reason, statemachine.EventDenied)
}

// run claims the authorized call under k and completes it succeeded as the
// executor does: the record's outbox replaced by executing and succeeded
// events that keep approved's identity, approval id and approver, but not
// its expiry.
func (f *fixture) run(k ledger.CallKey, approved ledger.Event) {
	f.t.Helper()
	f.end(k, approved, processors.StatusSucceeded, "", statemachine.EventExecuting, statemachine.EventSucceeded)
}

// end claims the authorized call under k and completes it in status, its
// outbox events of types, made of approved (the last with reason).
func (f *fixture) end(k ledger.CallKey, approved ledger.Event, status processors.Status, reason string, types ...statemachine.EventType) {
	t := f.t
	t.Helper()
	rec := f.record(k)
	res, err := f.store.Claim(t.Context(), []processors.Claim{{Key: k, ArgumentsHash: rec.ArgumentsHash, Owner: "executor-1", Lease: time.Minute}})
	if err != nil || res[0].Outcome != processors.Claimed {
		t.Fatalf("claim: %v, %v; want claimed", res, err)
	}
	var evs []ledger.Event
	for i, typ := range types {
		e := approved
		e.EventID = fmt.Sprintf("ev-%s-%d", k.IdempotencyKey, i)
		e.Type, e.Seq, e.At, e.Actor = typ, rec.Seq+int64(i)+1, f.clock.Now(), "executor-1"
		e.Decision, e.ExpiresAt, e.Attempt = "", nil, 1
		evs = append(evs, e)
	}
	evs[len(evs)-1].Reason = reason
	outbox, err := ledger.EncodeEvents(evs)
	if err != nil {
		t.Fatal(err)
	}
	applied, err := f.store.Complete(t.Context(), []processors.Completion{{Key: k, Epoch: res[0].Record.Epoch, Status: status,
		Attempt: 1, Seq: rec.Seq + int64(len(evs)), Outbox: outbox, From: rec.Seq}})
	if err != nil || !applied[0] {
		t.Fatalf("complete: %v, %v; want applied", applied, err)
	}
}

// A pending approval the reconciler rejects (an automatic compensation,
// cancelled by an operator who resolved the call it would undo succeeded)
// names that operator, the rejected event's actor: it has no approver.
// Before, it named no one, and the console took the timer for the decider.
func TestRejectedByAnOperator(t *testing.T) {
	f := newFixture(t)
	k, _ := f.refund("r-1")
	id := approvals.ID(k)
	rec := f.record(k)
	evs, err := ledger.DecodeEvents(rec.Outbox)
	if err != nil {
		t.Fatal(err)
	}
	// As the reconciler's cancelUndo writes it: the pending decision's
	// fields, with the operator as the actor.
	ev := evs[len(evs)-1]
	ev.EventID = "ev-cancel"
	ev.Type, ev.Seq, ev.At, ev.Actor = statemachine.EventRejected, rec.Seq+1, f.clock.Now(), "operator:u_ops"
	ev.Reason, ev.Detail, ev.ExpiresAt = "compensation_cancelled", "the operator kept the success", nil
	outbox, err := ledger.EncodeEvents(append(evs, ev))
	if err != nil {
		t.Fatal(err)
	}
	if applied, err := f.store.Move(t.Context(), []processors.Move{{Key: k, From: processors.StatusPending, FromSeq: rec.Seq,
		To: processors.StatusRejected, Seq: ev.Seq, Outbox: outbox}}); err != nil || !applied[0] {
		t.Fatalf("move: %v, %v; want applied", applied, err)
	}

	got, err := f.svc.Get(t.Context(), boss, id)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != approvals.StateRejected || got.DecidedBy != "operator:u_ops" || got.Reason != "the operator kept the success" {
		t.Errorf("rejected: %s by %q (%q); want rejected by operator:u_ops (the operator kept the success)", got.State, got.DecidedBy, got.Reason)
	}
	list, _, err := f.svc.List(t.Context(), boss, string(approvals.StateRejected))
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].DecidedBy != "operator:u_ops" {
		var by []string
		for _, a := range list {
			by = append(by, a.ID+" by "+a.DecidedBy)
		}
		t.Errorf("rejected list %q; want %s by operator:u_ops alone", by, id)
	}
}

// Every refusal leaves the approval pending and publishes nothing.
func TestDecisionRefused(t *testing.T) {
	cases := []struct {
		name string
		act  func(f *fixture, k ledger.CallKey) error
		want error
	}{
		{"not an approver", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Approve(t.Context(), plainUser, approvals.ID(k), f.record(k).ArgumentsHash)
			return err
		}, approvals.ErrNotApprover},
		{"not an approver lists", func(f *fixture, k ledger.CallKey) error {
			_, _, err := f.svc.List(t.Context(), plainUser, "")
			return err
		}, approvals.ErrNotApprover},
		{"other tenant's approver", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Approve(t.Context(), bossOfB, approvals.ID(k), f.record(k).ArgumentsHash)
			return err
		}, approvals.ErrNotFound},
		{"other tenant's approver reads", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Get(t.Context(), bossOfB, approvals.ID(k))
			return err
		}, approvals.ErrNotFound},
		{"other tenant's approver rejects", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Reject(t.Context(), bossOfB, approvals.ID(k), "no")
			return err
		}, approvals.ErrNotFound},
		{"self approval", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Approve(t.Context(), requester, approvals.ID(k), f.record(k).ArgumentsHash)
			return err
		}, approvals.ErrSelfApproval},
		{"self rejection", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Reject(t.Context(), requester, approvals.ID(k), "changed my mind")
			return err
		}, approvals.ErrSelfApproval},
		{"hash mismatch", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Approve(t.Context(), boss, approvals.ID(k), "sha256:"+strings.Repeat("0", 64))
			return err
		}, approvals.ErrHashMismatch},
		{"empty hash", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Approve(t.Context(), boss, approvals.ID(k), "")
			return err
		}, approvals.ErrHashMismatch},
		{"expired", func(f *fixture, k ledger.CallKey) error {
			f.clock.Advance(16 * time.Minute)
			_, err := f.svc.Approve(t.Context(), boss, approvals.ID(k), f.record(k).ArgumentsHash)
			return err
		}, approvals.ErrExpired},
		{"expired reject", func(f *fixture, k ledger.CallKey) error {
			f.clock.Advance(16 * time.Minute)
			_, err := f.svc.Reject(t.Context(), boss, approvals.ID(k), "too late")
			return err
		}, approvals.ErrExpired},
		{"reject without reason", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Reject(t.Context(), boss, approvals.ID(k), "   ")
			return err
		}, approvals.ErrInvalidRequest},
		{"reject with a novel", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Reject(t.Context(), boss, approvals.ID(k), strings.Repeat("x", approvals.MaxReasonBytes+1))
			return err
		}, approvals.ErrInvalidRequest},
		{"malformed id", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Approve(t.Context(), boss, "apr_!!!", f.record(k).ArgumentsHash)
			return err
		}, approvals.ErrNotFound},
		{"unknown id", func(f *fixture, k ledger.CallKey) error {
			_, err := f.svc.Approve(t.Context(), boss, approvals.ID(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "nope"}), f.record(k).ArgumentsHash)
			return err
		}, approvals.ErrNotFound},
		{"a call that needed no approval", func(f *fixture, k ledger.CallKey) error {
			f.submitTo(true, f.envelope("t_a", "u_1", "ticket", "create_ticket", map[string]any{"title": "x"}))
			tk := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "ticket"}
			if st := f.record(tk).Status; st != processors.StatusAuthorized {
				t.Fatalf("ticket is %s; want authorized", st)
			}
			_, err := f.svc.Approve(t.Context(), boss, approvals.ID(tk), f.record(tk).ArgumentsHash)
			return err
		}, approvals.ErrNotFound},
		// A service whose registry defines the call's tool version
		// otherwise (here refund_order.v1's description edited in
		// place) shows no definition, says why, and approves nothing:
		// the approval would bind what its definition says to read.
		{"tool defined otherwise", func(f *fixture, k ledger.CallKey) error {
			svc := f.service(func(c *approvals.Config) {
				c.Registry = processorstest.RegistryWith(t, "../testdata/registry", "refund_order", func(entry map[string]any) {
					entry["description"] = "edited in place"
				})
			})
			a, err := svc.Get(t.Context(), boss, approvals.ID(k))
			if err != nil {
				t.Fatal(err)
			}
			if p := a.Preview; p.Risk != "" || p.Effect != "" || !strings.Contains(p.Description, "otherwise") {
				t.Errorf("preview %+v; want no definition, and a description that says why", p)
			}
			_, err = svc.Approve(t.Context(), boss, approvals.ID(k), f.record(k).ArgumentsHash)
			return err
		}, schemas.ErrOtherDefinition},
		// Nor does one whose registry lacks the version (an older one,
		// in a rolling deploy): before, it approved blind, binding no
		// resource version.
		{"tool version unknown here", func(f *fixture, k ledger.CallKey) error {
			dir := t.TempDir()
			if err := os.MkdirAll(filepath.Join(dir, "tools"), 0o755); err != nil {
				t.Fatal(err)
			}
			raw, err := os.ReadFile("../testdata/registry/tools/create_ticket.v1.json")
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "tools", "create_ticket.v1.json"), raw, 0o644); err != nil {
				t.Fatal(err)
			}
			reg, err := schemas.Load(os.DirFS(dir))
			if err != nil {
				t.Fatal(err)
			}
			svc := f.service(func(c *approvals.Config) { c.Registry = reg })
			a, err := svc.Get(t.Context(), boss, approvals.ID(k))
			if err != nil {
				t.Fatal(err)
			}
			if p := a.Preview; p.Risk != "" || !strings.Contains(p.Description, "lacks") {
				t.Errorf("preview %+v; want no definition, and a description that says why", p)
			}
			_, err = svc.Approve(t.Context(), boss, approvals.ID(k), f.record(k).ArgumentsHash)
			return err
		}, schemas.ErrUnknownTool},
		{"list approved", func(f *fixture, k ledger.CallKey) error {
			_, _, err := f.svc.List(t.Context(), boss, "approved")
			return err
		}, approvals.ErrUnsupported},
		{"list nonsense", func(f *fixture, k ledger.CallKey) error {
			_, _, err := f.svc.List(t.Context(), boss, "maybe")
			return err
		}, approvals.ErrInvalidRequest},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			k, _ := f.refund("r-1")
			before := f.record(k)
			if err := tc.act(f, k); !errors.Is(err, tc.want) {
				t.Errorf("got %v; want %v", err, tc.want)
			}
			if after := f.record(k); after.Status != processors.StatusPending || after.Seq != before.Seq {
				t.Errorf("record %s at seq %d after a refusal; want pending at %d", after.Status, after.Seq, before.Seq)
			}
			for _, e := range f.pub.events(t) {
				if e.Key() == k {
					t.Errorf("a refusal published %s@%d", e.Type, e.Seq)
				}
			}
		})
	}
}

// An approval is single use: the second approve is refused.
func TestDoubleApprove(t *testing.T) {
	f := newFixture(t)
	k, _ := f.refund("r-1")
	hash := f.record(k).ArgumentsHash
	if _, err := f.svc.Approve(t.Context(), boss, approvals.ID(k), hash); err != nil {
		t.Fatal(err)
	}
	other := boss
	other.User = "u_other_boss"
	for _, who := range []identity.Identity{boss, other} {
		if _, err := f.svc.Approve(t.Context(), who, approvals.ID(k), hash); !errors.Is(err, approvals.ErrNotPending) {
			t.Errorf("second approve by %s: %v; want ErrNotPending", who.User, err)
		}
		if _, err := f.svc.Reject(t.Context(), who, approvals.ID(k), "no"); !errors.Is(err, approvals.ErrNotPending) {
			t.Errorf("reject after approve by %s: %v; want ErrNotPending", who.User, err)
		}
	}
	if n := len(f.pub.events(t)); n != 1 {
		t.Errorf("published %d events; want 1", n)
	}
	if a, err := f.svc.Get(t.Context(), boss, approvals.ID(k)); err != nil || a.State != approvals.StateApproved {
		t.Errorf("Get after approval: %v, %v; want state approved", a.State, err)
	}
}

// 100 approvers (and instances) race for one approval: exactly one wins,
// and one approved event is published.
func TestConcurrentApprovesApplyOnce(t *testing.T) {
	f := newFixture(t)
	k, _ := f.refund("r-1")
	hash := f.record(k).ArgumentsHash
	svcs := []*approvals.Service{f.svc, f.service(), f.service()}
	var (
		wg       sync.WaitGroup
		won      atomic.Int32
		mu       sync.Mutex
		unwanted []error
	)
	for i := range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			who := boss
			who.User = fmt.Sprintf("u_boss_%d", i)
			_, err := svcs[i%len(svcs)].Approve(context.Background(), who, approvals.ID(k), hash)
			switch {
			case err == nil:
				won.Add(1)
			case !errors.Is(err, approvals.ErrNotPending):
				mu.Lock()
				unwanted = append(unwanted, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if n := won.Load(); n != 1 {
		t.Errorf("%d approves applied; want 1", n)
	}
	for _, err := range unwanted {
		t.Errorf("approve failed with %v; want success or ErrNotPending", err)
	}
	if pub := f.pub.ofType(t, statemachine.EventApproved); len(pub) != 1 {
		t.Errorf("published %d approved events; want 1", len(pub))
	}
	if rec := f.record(k); rec.Status != processors.StatusAuthorized || rec.Seq != 3 {
		t.Errorf("record %s at %d; want authorized at 3", rec.Status, rec.Seq)
	}
}

// Two timer instances racing expire each lapsed approval exactly once, and
// not before its time.
func TestExpireDueOnceWithTwoTimers(t *testing.T) {
	f := newFixture(t)
	const n = 20
	intakeEvs := make(map[ledger.CallKey][]ledger.Event)
	for i := range n {
		k, evs := f.refund(fmt.Sprintf("r-%02d", i))
		intakeEvs[k] = evs
	}
	// A call that needed no approval is never touched by the timer.
	f.submitTo(true, f.envelope("t_a", "u_1", "ticket", "create_ticket", map[string]any{"title": "x"}))

	second := f.service()
	if got, err := f.svc.ExpireDue(t.Context()); err != nil || got != 0 {
		t.Fatalf("ExpireDue before expiry: %d, %v; want 0", got, err)
	}
	// The intake's clock ran on from the service's start: a minute's
	// margin past the 15 minutes of the default TTL.
	f.clock.Advance(16 * time.Minute)

	var (
		wg    sync.WaitGroup
		total atomic.Int64
	)
	for i := range 6 {
		svc := f.svc
		if i%2 == 1 {
			svc = second
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			got, err := svc.ExpireDue(context.Background())
			if err != nil {
				t.Errorf("ExpireDue: %v", err)
			}
			total.Add(int64(got))
		}()
	}
	wg.Wait()
	if got := total.Load(); got != n {
		t.Errorf("timers expired %d approvals; want %d", got, n)
	}
	perKey := make(map[ledger.CallKey][]ledger.Event)
	for _, e := range f.pub.events(t) {
		if e.Type != statemachine.EventExpired {
			t.Errorf("timer published %s@%d for %s", e.Type, e.Seq, e.Key())
		}
		perKey[e.Key()] = append(perKey[e.Key()], e)
	}
	for k, evs := range intakeEvs {
		got := perKey[k]
		if len(got) != 1 {
			t.Errorf("%s: %d expired events; want 1", k, len(got))
			continue
		}
		ev := got[0]
		if ev.Reason != approvals.ReasonApprovalExpired || ev.Seq != 3 || ev.ApprovalID != approvals.ID(k) || ev.Actor != "approvals" {
			t.Errorf("%s: expired event reason %q seq %d approval %q actor %q", k, ev.Reason, ev.Seq, ev.ApprovalID, ev.Actor)
		}
		if c := fold(t, append(evs, ev)); c.State != statemachine.StateExpired {
			t.Errorf("%s: folded %s; want expired", k, c.State)
		}
		if rec := f.record(k); rec.Status != processors.StatusExpired || rec.LoggedSeq != 3 {
			t.Errorf("%s: record %s logged %d; want expired logged 3", k, rec.Status, rec.LoggedSeq)
		}
	}
	if rec := f.record(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "ticket"}); rec.Status != processors.StatusAuthorized {
		t.Errorf("the ticket is %s; want authorized, untouched", rec.Status)
	}
	if got, err := second.ExpireDue(t.Context()); err != nil || got != 0 {
		t.Errorf("ExpireDue again: %d, %v; want 0", got, err)
	}
	list, _, err := f.svc.List(t.Context(), boss, "expired")
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != n {
		t.Errorf("%d expired approvals listed; want %d", len(list), n)
	}
	for _, a := range list {
		if a.State != approvals.StateExpired || a.Reason != approvals.ReasonApprovalExpired || a.Preview.Amount != "45.00 AUD" {
			t.Errorf("expired approval %s: state %s, reason %q, amount %q", a.ID, a.State, a.Reason, a.Preview.Amount)
		}
	}
	var k0 ledger.CallKey
	for k := range intakeEvs {
		k0 = k
		break
	}
	if _, err := f.svc.Approve(t.Context(), boss, approvals.ID(k0), f.record(k0).ArgumentsHash); !errors.Is(err, approvals.ErrNotPending) {
		t.Errorf("approve after expiry: %v; want ErrNotPending", err)
	}
}

// RunTimer expires a lapsed approval on its own and stops with its ctx.
func TestRunTimer(t *testing.T) {
	f := newFixture(t)
	k, _ := f.refund("r-1")
	f.clock.Advance(time.Hour)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- f.svc.RunTimer(ctx, 10*time.Millisecond) }()
	poll := time.NewTicker(5 * time.Millisecond)
	defer poll.Stop()
	deadline := time.After(10 * time.Second)
	for f.record(k).Status != processors.StatusExpired {
		select {
		case <-deadline:
			t.Fatal("the timer did not expire the approval within 10s")
		case <-poll.C:
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("RunTimer returned %v; want nil once its ctx ended", err)
	}
	if n := len(f.pub.ofType(t, statemachine.EventExpired)); n != 1 {
		t.Errorf("published %d expired events; want 1", n)
	}
}

// A publish that fails after the move does not undo the decision: the API
// answers success and the event waits in the outbox, unlogged, for the
// executor's sweep.
func TestApproveWhenPublishFails(t *testing.T) {
	f := newFixture(t)
	k, _ := f.refund("r-1")
	f.pub.fail.Store(true)
	a, err := f.svc.Approve(t.Context(), boss, approvals.ID(k), f.record(k).ArgumentsHash)
	if err != nil {
		t.Fatalf("approve with the broker down: %v; want success (the decision is recorded)", err)
	}
	if a.State != approvals.StateApproved {
		t.Errorf("state %s; want approved", a.State)
	}
	rec := f.record(k)
	if rec.Status != processors.StatusAuthorized || rec.Seq != 3 || rec.LoggedSeq != 2 || !rec.Unlogged() {
		t.Errorf("record %s seq %d logged %d; want authorized at 3, logged 2", rec.Status, rec.Seq, rec.LoggedSeq)
	}
	evs, err := ledger.DecodeEvents(rec.Outbox)
	if err != nil {
		t.Fatal(err)
	}
	if last := evs[len(evs)-1]; last.Type != statemachine.EventApproved || last.Seq != 3 {
		t.Errorf("outbox ends with %s@%d; want approved@3", last.Type, last.Seq)
	}
	unlogged, err := f.store.Unlogged(t.Context(), 0, processors.Cursor{}, 100)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(unlogged, func(r processors.Record) bool { return r.Key == k }) {
		t.Errorf("the store's unlogged sweep does not find the approved call; its event would never reach the log")
	}
}

// cancellingMove is the store, whose Move ends the decision's request:
// before it writes when before (the approver's client gone, or the server
// stopping, while the commit is on its way), else right after the
// decision was taken.
type cancellingMove struct {
	approvals.Store
	cancel context.CancelFunc
	before bool
}

func (s cancellingMove) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	if s.before {
		s.cancel()
	}
	applied, err := s.Store.Move(ctx, ms)
	s.cancel()
	return applied, err
}

// A decision whose request ends as its write is sent, or right after, is
// taken, answered and published all the same: it goes to the log now,
// not 10 s or more later through the unlogged sweep, which can outlast
// the approval's window. Before, the publish used the request's context
// and failed with it; and the write did too, answered as failed though it
// may have committed.
func TestDecisionTakenWhenItsRequestEnds(t *testing.T) {
	for _, before := range []bool{true, false} {
		t.Run(fmt.Sprintf("ended before the write %v", before), func(t *testing.T) {
			f := newFixture(t)
			k, _ := f.refund("r-1")
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			svc := f.service(func(c *approvals.Config) { c.Store = cancellingMove{Store: f.store, cancel: cancel, before: before} })
			if _, err := svc.Approve(ctx, boss, approvals.ID(k), f.record(k).ArgumentsHash); err != nil {
				t.Fatalf("approve: %v", err)
			}
			if ctx.Err() == nil {
				t.Fatal("the request's context was not ended by the move")
			}
			if evs := f.pub.events(t); len(evs) == 0 || evs[len(evs)-1].Type != statemachine.EventApproved {
				t.Errorf("published %v; want the approved event", types(evs))
			}
			if rec := f.record(k); rec.Status != processors.StatusAuthorized || rec.Unlogged() {
				t.Errorf("the call is %s, logged %d of %d; want authorized, its decision in the log", rec.Status, rec.LoggedSeq, rec.Seq)
			}
		})
	}
}

// failingMove is the store, whose Move fails: after it applied (a commit
// whose answer was lost, CockroachDB's ambiguous result) when applies,
// else without writing; when outOfTime, once the write's time ran out,
// with that error (a commit sent as the deadline came).
type failingMove struct {
	approvals.Store
	applies, outOfTime bool
}

func (s failingMove) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	err := errors.New("result is ambiguous")
	if s.outOfTime {
		<-ctx.Done()
		err = ctx.Err()
	}
	if s.applies {
		if _, err := s.Store.Move(context.WithoutCancel(ctx), ms); err != nil {
			return nil, err
		}
	}
	return nil, err
}

// A decision whose write failed is read back: one that had applied is
// taken (answered and published now, not 10 s or more later by the
// unlogged sweep, with the approver told it failed); one that had not is
// the error it was, nothing published.
func TestDecisionWhoseWriteFailed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		store  failingMove
		errSay string
	}{
		{"applied", failingMove{applies: true}, ""},
		{"applied as its time ran out", failingMove{applies: true, outOfTime: true}, ""},
		{"not applied", failingMove{}, "result is ambiguous"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			k, _ := f.refund("r-1")
			tc.store.Store = f.store
			svc := f.service(func(c *approvals.Config) { c.Store, c.WriteTimeout = tc.store, 100*time.Millisecond })
			_, err := svc.Approve(t.Context(), boss, approvals.ID(k), f.record(k).ArgumentsHash)
			applies := tc.store.applies
			want, status := []string{"approved@3"}, processors.StatusAuthorized
			if !applies {
				want, status = nil, processors.StatusPending
			}
			if (err == nil) != applies || !applies && !strings.Contains(err.Error(), tc.errSay) {
				t.Errorf("approve = %v; want an error only if the write did not apply, saying why", err)
			}
			if rec := f.record(k); rec.Status != status {
				t.Errorf("the call is %s; want %s", rec.Status, status)
			}
			var got []string
			for _, e := range types(f.pub.events(t)) {
				if strings.HasPrefix(e, "approved@") {
					got = append(got, e)
				}
			}
			if !slices.Equal(got, want) {
				t.Errorf("published %v; want %v", got, want)
			}
		})
	}
}

// lostAfterMove is the store, whose Move applies and then fails (a
// connection lost on COMMIT), after which it cannot be read (its node
// down).
type lostAfterMove struct {
	approvals.Store
	moved atomic.Bool
}

func (s *lostAfterMove) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	if _, err := s.Store.Move(ctx, ms); err != nil {
		return nil, err
	}
	s.moved.Store(true)
	return nil, errors.New("connection lost on commit")
}

func (s *lostAfterMove) Get(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	if s.moved.Load() {
		return processors.Record{}, errors.New("connection refused")
	}
	return s.Store.Get(ctx, k)
}

func (s *lostAfterMove) ReadBack(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	if s.moved.Load() {
		return processors.Record{}, errors.New("connection refused")
	}
	return s.Store.ReadBack(ctx, k)
}

// A decision whose write failed and could not be read back is answered
// 503 action_outcome_unknown: it may have been taken, and the approver is
// to read the approval before deciding again. Before, it was 500
// internal, which the console said was refused, and the approver, trying
// again, was told the approval was no longer pending, someone else's
// decision as far as they could tell.
func TestDecisionWhoseWriteFailedUnread(t *testing.T) {
	f := newFixture(t)
	k, _ := f.refund("r-1")
	svc := f.service(func(c *approvals.Config) {
		c.Store, c.WriteTimeout = &lostAfterMove{Store: f.store}, 100*time.Millisecond
	})
	status, apiErr := f.approveOverHTTP(svc, k)
	if status != http.StatusServiceUnavailable || apiErr.Code != httpjson.CodeActionOutcomeUnknown || !strings.Contains(apiErr.Message, "read the approval") {
		t.Errorf("approve = %d %+v; want 503 %s, saying to read the approval", status, apiErr, httpjson.CodeActionOutcomeUnknown)
	}
	if rec := f.record(k); rec.Status != processors.StatusAuthorized {
		t.Errorf("the call is %s; want authorized (the write applied)", rec.Status)
	}
}

// apiError is an HTTP API's error answer.
type apiError struct{ Code, Message string }

// approveOverHTTP approves k's call as boss through svc's HTTP API, bound
// to its record's arguments hash, and returns the answer's status and
// error (zero on success).
func (f *fixture) approveOverHTTP(svc *approvals.Service, k ledger.CallKey) (int, apiError) {
	t := f.t
	t.Helper()
	srv := httptest.NewServer(svc.Handler())
	defer srv.Close()
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/approvals/"+approvals.ID(k)+"/approve", strings.NewReader(`{"arguments_hash":"`+f.record(k).ArgumentsHash+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+f.mint(boss))
	req.Header.Set("Content-Type", "application/json")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Error apiError `json:"error"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, body.Error
}

// A decision on a call whose intake events the log may still lack (the
// intake's transaction had not committed) carries them along: the move
// never drops an unlogged event, and they go out in seq order.
func TestDecisionCarriesUnloggedIntakeEvents(t *testing.T) {
	f := newFixture(t)
	f.submitTo(false, f.envelope("t_a", "u_1", "r-1", "refund_order", map[string]any{"order_id": "ord_1", "amount_cents": 100, "currency": "EUR"}))
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "r-1"}
	if _, err := f.svc.Approve(t.Context(), boss, approvals.ID(k), f.record(k).ArgumentsHash); err != nil {
		t.Fatal(err)
	}
	pub := f.pub.events(t)
	if diff := cmp.Diff([]string{"requested@1", "approval_pending@2", "approved@3"}, types(pub)); diff != "" {
		t.Errorf("published (-want +got):\n%s", diff)
	}
	fold(t, pub)
	if rec := f.record(k); rec.LoggedSeq != 3 {
		t.Errorf("logged seq %d; want 3", rec.LoggedSeq)
	}
}

func TestIDRoundTrip(t *testing.T) {
	cases := []struct {
		name string
		key  ledger.CallKey
	}{
		{"plain", ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}},
		{"slashes and unicode in the key", ledger.CallKey{TenantID: "t_a", IdempotencyKey: "a/b/ç?&=#"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			id := approvals.ID(tc.key)
			if !strings.HasPrefix(id, "apr_") || strings.ContainsAny(id, "/?#&=+") {
				t.Errorf("id %q; want apr_ and URL-safe characters only", id)
			}
			got, err := approvals.ParseID(id)
			if err != nil || got != tc.key {
				t.Errorf("ParseID(%q) = %v, %v; want %v", id, got, err, tc.key)
			}
		})
	}
	for _, bad := range []string{"", "apr_", "k1", "apr_!!", "apr_" + "dF9h"} {
		if _, err := approvals.ParseID(bad); err == nil {
			t.Errorf("ParseID(%q) accepted", bad)
		}
	}
}

// A tenant whose queue is longer than what one List reads does not hide
// another tenant's approvals: the store lists the approver's tenant's
// own. Before, List read the oldest ListLimit pending records of every
// tenant and kept the approver's, here none.
func TestListNotHiddenByAnotherTenant(t *testing.T) {
	f := newFixture(t)
	for i := range 3 {
		f.submitTo(true, f.envelope("t_b", "u_1", fmt.Sprintf("b-%d", i), "refund_order",
			map[string]any{"order_id": fmt.Sprintf("ord_b%d", i), "amount_cents": 4500, "currency": "AUD", "reason": "customer is upset"}))
	}
	k, _ := f.refund("a-1")
	svc := f.service(func(c *approvals.Config) { c.ListLimit = 3 })
	list, _, err := svc.List(t.Context(), boss, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].ID != approvals.ID(k) {
		t.Errorf("List for t_a behind 3 of t_b's with ListLimit 3 = %+v; want t_a's one approval", list)
	}
}

// A list that stops at its bound says so (more): a longer queue shows its
// oldest, and the approver must learn that others wait. One within it
// does not.
func TestListSaysWhenItStopsAtItsBound(t *testing.T) {
	f := newFixture(t)
	f.refunds("queue", 3)
	// At exactly the bound (3 of 3) the list is whole.
	for limit, want := range map[int]bool{2: true, 3: false, 5: false} {
		svc := f.service(func(c *approvals.Config) { c.ListLimit = limit })
		list, more, err := svc.List(t.Context(), boss, "")
		if err != nil {
			t.Fatal(err)
		}
		if len(list) != min(3, limit) || more != want {
			t.Errorf("ListLimit %d over 3 pending: %d listed, more %v; want %d, more %v", limit, len(list), more, min(3, limit), want)
		}
	}
}

// Decided approvals are listed newest first: a tenant with more rejected
// ones than one List reads sees its latest, not the oldest for good.
// Pending ones stay oldest first, the queue's head.
func TestListDecidedNewestFirst(t *testing.T) {
	f := newFixture(t)
	svc := f.service(func(c *approvals.Config) { c.ListLimit = 2 })
	ids := f.refunds("decided", 4)
	for _, i := range []int{2, 0, 1} { // in turn: each rejection updated after the last
		if _, err := svc.Reject(t.Context(), boss, ids[i], "no"); err != nil {
			t.Fatal(err)
		}
	}
	if diff := cmp.Diff([]string{ids[1], ids[0]}, listedIDs(t, svc, string(approvals.StateRejected))); diff != "" {
		t.Errorf("rejected, 3 of them, ListLimit 2 (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{ids[3]}, listedIDs(t, svc, "")); diff != "" {
		t.Errorf("pending (-want +got):\n%s", diff)
	}
}

// Expired approvals are listed past the newer calls expired by their
// deadline, which are no approvals: List reads on, a page at a time.
// Before, it read the latest ListLimit expired records and kept the
// approvals among them, here none.
func TestListExpiredPastDeadlineExpirations(t *testing.T) {
	f := newFixture(t)
	svc := f.service(func(c *approvals.Config) { c.ListLimit = 2 })
	ids := f.refunds("lapsed", 3)
	f.clock.Advance(16 * time.Minute)
	if got, err := svc.ExpireDue(t.Context()); err != nil || got != 3 {
		t.Fatalf("ExpireDue: %d, %v; want 3", got, err)
	}
	// Five calls that expired by their deadline, after the approvals.
	for i := range 5 {
		key := fmt.Sprintf("deadline-%d", i)
		evs := f.submitTo(true, f.envelope("t_a", "u_1", key, "create_ticket", map[string]any{"title": "printer on fire"}))
		if len(evs) != 2 || evs[1].Type != statemachine.EventAuthorized {
			t.Fatalf("intake appended %v; want requested + authorized", types(evs))
		}
		k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: key}
		if _, err := f.store.Move(t.Context(), []processors.Move{{Key: k, From: processors.StatusAuthorized, FromSeq: 2, To: processors.StatusExpired, Seq: 3}}); err != nil {
			t.Fatal(err)
		}
	}
	// ListLimit 2: the latest two, newest first (expired in their
	// order, or at once and then by key, the greater first).
	if got, want := listedIDs(t, svc, string(approvals.StateExpired)), []string{ids[2], ids[1]}; !slices.Equal(got, want) {
		t.Errorf("expired approvals behind 5 deadline expirations, ListLimit 2 = %v; want %v", got, want)
	}
}

// An approval whose call's deadline makes it lapse before older pending
// ones is expired all the same, though more approvals are pending than
// one round of the timer reads (ExpireBatch): the rounds page through
// them. Before, every round read the same oldest page, and the short one
// stayed pending until the older ones lapsed (15 minutes here).
func TestExpireDuePagesPastOlderApprovals(t *testing.T) {
	f := newFixture(t)
	svc := f.service(func(c *approvals.Config) { c.ExpireBatch = 2 })
	for _, key := range []string{"old-1", "old-2", "old-3"} {
		f.refund(key)
	}
	short := f.envelope("t_a", "u_1", "short", "refund_order",
		map[string]any{"order_id": "ord_short", "amount_cents": 4500, "currency": "AUD", "reason": "customer is upset"})
	var env map[string]any
	if err := json.Unmarshal(short.Value, &env); err != nil {
		t.Fatal(err)
	}
	env["deadline_ms"] = 60_000
	short.Value, _ = json.Marshal(env)
	if evs := f.submitTo(true, short); len(evs) != 2 || evs[1].Type != statemachine.EventApprovalPending {
		t.Fatalf("intake appended %v; want requested + approval_pending", types(evs))
	}
	f.clock.Advance(2 * time.Minute)

	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "short"}
	expired := 0
	for round := range 3 { // ceil(4/2) rounds, and one that starts over
		n, err := svc.ExpireDue(t.Context())
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		expired += n
	}
	if expired != 1 {
		t.Errorf("three rounds expired %d approvals; want 1, the short one", expired)
	}
	if rec := f.record(k); rec.Status != processors.StatusExpired {
		t.Errorf("the approval whose deadline passed is %s; want expired", rec.Status)
	}
	if rec := f.record(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "old-1"}); rec.Status != processors.StatusPending {
		t.Errorf("an approval not yet due is %s; want pending", rec.Status)
	}
}

// hangingVersions is a version endpoint that never answers.
type hangingVersions struct{}

func (hangingVersions) ResourceVersion(ctx context.Context, _, _, _ string) (string, error) {
	<-ctx.Done()
	return "", ctx.Err()
}

// An approval whose resource's version cannot be read in the tool's
// timeout fails ErrUnavailable (503 over HTTP), and the call stays
// pending; before, the approver's request waited as long as the version
// endpoint did, without end.
func TestApproveDoesNotHangOnTheResourceVersion(t *testing.T) {
	f := newFixture(t)
	svc := f.service(func(c *approvals.Config) { c.Versions, c.BaseURL = hangingVersions{}, "http://tools.test" })
	k, evs := f.refund("hang")
	done := make(chan error, 1)
	go func() {
		_, err := svc.Approve(context.Background(), boss, k.ApprovalID(), evs[1].ArgumentsHash)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, approvals.ErrUnavailable) {
			t.Errorf("Approve with the version endpoint hanging = %v; want ErrUnavailable", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Approve still waits for the version endpoint after 10 s (the tool's timeout is 2 s)")
	}
	if rec := f.record(k); rec.Status != processors.StatusPending {
		t.Errorf("the call is %s; want still pending", rec.Status)
	}
}

// switchFreezes is the kill switch's state, frozen or not, its copy
// current or stale (Current fails).
type switchFreezes struct {
	frozen bool
	stale  error
}

func (f switchFreezes) Current(context.Context, time.Duration) error { return f.stale }

func (f switchFreezes) Frozen(tool, _ string) (control.Action, bool) {
	return control.Action{Kind: control.KindFreeze, Tool: tool, By: "ops", Reason: "incident 7"}, f.frozen
}

// countingVersions answers every version read with "v1", and counts them.
type countingVersions struct{ n atomic.Int32 }

func (v *countingVersions) ResourceVersion(context.Context, string, string, string) (string, error) {
	v.n.Add(1)
	return "v1", nil
}

// An approval that would read its resource's version at the tool reads
// nothing while the kill switch has the tool frozen (409 tool_frozen:
// approve once it is unfrozen, or reject), nor while the copy of the
// control topic is not known current (503, try again): no request reaches
// a frozen tool, as none of the executors' does. Before, the approval
// service knew nothing of the kill switch, and every approval of a frozen
// tool's call asked the tool.
func TestApproveReadsNothingAtAFrozenTool(t *testing.T) {
	for _, tc := range []struct {
		name    string
		freezes switchFreezes
		status  int
		code    string
		reads   int32
	}{
		{"frozen", switchFreezes{frozen: true}, http.StatusConflict, approvals.CodeToolFrozen, 0},
		{"copy stale", switchFreezes{frozen: true, stale: errors.New("control state stale")}, http.StatusServiceUnavailable, approvals.CodeControlStateStale, 0},
		{"not frozen", switchFreezes{}, http.StatusOK, "", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			versions := &countingVersions{}
			svc := f.service(func(c *approvals.Config) {
				c.Versions, c.BaseURL, c.Freezes = versions, "http://tools.test", tc.freezes
			})
			k, _ := f.refund("frozen-" + strings.ReplaceAll(tc.name, " ", "-"))
			status, apiErr := f.approveOverHTTP(svc, k)
			if status != tc.status || apiErr.Code != tc.code {
				t.Errorf("approve = %d %+v; want %d %s", status, apiErr, tc.status, tc.code)
			}
			if n := versions.n.Load(); n != tc.reads {
				t.Errorf("the resource's version was read %d times; want %d", n, tc.reads)
			}
			want := processors.StatusPending
			if tc.status == http.StatusOK {
				want = processors.StatusAuthorized
			}
			if rec := f.record(k); rec.Status != want {
				t.Errorf("the call is %s; want %s", rec.Status, want)
			}
		})
	}
}

// withRoles gives f's requesters roles, and f's intake's policies the
// callers' roles (policy.Config.Roles).
func (f *fixture) withRoles(roles ...string) {
	f.t.Helper()
	in, err := intake.New(intake.Config{Registry: f.reg, Store: f.store, Identity: f.ident.Verifier,
		Policy: processorstest.PolicyWithRoles(f.t, processorstest.PolicyDir(f.t, testPolicies))})
	if err != nil {
		f.t.Fatal(err)
	}
	f.in, f.roles = in, roles
}

// readVersionsAtIntake makes f's intake read every resource's version as
// v, onto the approval_pending event.
func (f *fixture) readVersionsAtIntake(t *testing.T, v string) {
	t.Helper()
	in, err := intake.New(intake.Config{Registry: f.reg, Store: f.store, Identity: f.ident.Verifier,
		Policy: processorstest.Policy(t, processorstest.PolicyDir(t, testPolicies)), Versions: fixedVersions(v), BaseURL: "http://tools.test"})
	if err != nil {
		t.Fatal(err)
	}
	f.in = in
}

// fixedVersions answers every version read with v.
type fixedVersions string

func (v fixedVersions) ResourceVersion(context.Context, string, string, string) (string, error) {
	return string(v), nil
}

// A call requested at a resource version is approved only by a service
// that reads the version to compare: one that cannot (no reader here)
// refuses for good (ErrVersionUnconfirmed, 409), not "try again" (503)
// as it would for a version endpoint that is down.
func TestApproveNeedsTheVersionConfirmed(t *testing.T) {
	f := newFixture(t)
	f.readVersionsAtIntake(t, "v1")
	k, evs := f.refund("confirm")
	if evs[1].ResourceVersion != "v1" {
		t.Fatalf("approval_pending holds resource version %q; want v1", evs[1].ResourceVersion)
	}
	if _, err := f.svc.Approve(t.Context(), boss, k.ApprovalID(), evs[1].ArgumentsHash); !errors.Is(err, approvals.ErrVersionUnconfirmed) {
		t.Errorf("Approve by a service that reads no versions = %v; want ErrVersionUnconfirmed", err)
	}
	reader := f.service(func(c *approvals.Config) { c.Versions, c.BaseURL = fixedVersions("v1"), "http://tools.test" })
	if a, err := reader.Approve(t.Context(), boss, k.ApprovalID(), evs[1].ArgumentsHash); err != nil || a.State != approvals.StateApproved {
		t.Errorf("Approve by a service that reads the same version = %+v, %v; want approved", a, err)
	}
}

// failingVersions answers every version read with err.
type failingVersions struct{ err error }

func (v failingVersions) ResourceVersion(context.Context, string, string, string) (string, error) {
	return "", v.err
}

// A version read that fails for good (404: the resource is gone) refuses
// the approval of a call requested at a version as the executor would,
// resource_changed, not "try again" (503) until it expires; one that may
// pass (a 503) is "try again". A call admitted without a version is
// approved binding none, as the intake admitted it.
func TestApproveVersionReadFailures(t *testing.T) {
	f := newFixture(t)
	unversioned, plain := f.refund("unversioned")
	f.readVersionsAtIntake(t, "v1")
	k, evs := f.refund("gone")
	gone := f.service(func(c *approvals.Config) {
		c.Versions, c.BaseURL = failingVersions{&httptool.Error{Kind: httptool.Refused, Status: 404}}, "http://tools.test"
	})
	failing := f.service(func(c *approvals.Config) {
		c.Versions, c.BaseURL = failingVersions{&httptool.Error{Kind: httptool.ServerError, Status: 503}}, "http://tools.test"
	})
	if _, err := failing.Approve(t.Context(), boss, k.ApprovalID(), evs[1].ArgumentsHash); !errors.Is(err, approvals.ErrUnavailable) {
		t.Errorf("Approve while the version endpoint answers 503 = %v; want ErrUnavailable (try again)", err)
	}
	if _, err := gone.Approve(t.Context(), boss, k.ApprovalID(), evs[1].ArgumentsHash); !errors.Is(err, approvals.ErrResourceChanged) {
		t.Errorf("Approve while the version endpoint answers 404 = %v; want ErrResourceChanged", err)
	}
	if rec := f.record(k); rec.Status != processors.StatusPending {
		t.Errorf("the refused call is %s; want still pending", rec.Status)
	}
	a, err := gone.Approve(t.Context(), boss, unversioned.ApprovalID(), plain[1].ArgumentsHash)
	if err != nil || a.State != approvals.StateApproved {
		t.Errorf("Approve of a call admitted without a version, its version unreadable for good = %+v, %v; want approved", a, err)
	}
}

// slowVersions answers every version read with v after the clock moved on
// by d: a version endpoint that took that long.
type slowVersions struct {
	v     string
	clock *clock
	d     time.Duration
}

func (s slowVersions) ResourceVersion(context.Context, string, string, string) (string, error) {
	s.clock.Advance(s.d)
	return s.v, nil
}

// An approval whose resource's version took until past the expiry to read
// is refused as expired, not recorded as approved at the time it started
// (the executor would deny the call anyway, against an answer of 200 and
// an audit record saying it was approved in time). One that finished in
// time is stamped when it finished.
func TestApproveChecksTheExpiryAfterReadingTheVersion(t *testing.T) {
	f := newFixture(t)
	f.readVersionsAtIntake(t, "v1")
	for _, tc := range []struct {
		key     string
		late    bool
		wantErr error
	}{
		// In this order: the intake's clock stays where it is, and
		// the late case moves the service's past the first call's
		// expiry.
		{"in-time", false, nil},
		{"late", true, approvals.ErrExpired},
	} {
		k, evs := f.refund(tc.key)
		left := evs[1].ExpiresAt.Sub(f.clock.Now())
		d := left / 2
		if tc.late {
			d = left + time.Second
		}
		svc := f.service(func(c *approvals.Config) { c.Versions, c.BaseURL = slowVersions{"v1", f.clock, d}, "http://tools.test" })
		started := f.clock.Now()
		a, err := svc.Approve(t.Context(), boss, k.ApprovalID(), evs[1].ArgumentsHash)
		if !errors.Is(err, tc.wantErr) {
			t.Fatalf("%s: Approve with the version read taking %v of %v left = %+v, %v; want %v", tc.key, d, left, a, err, tc.wantErr)
		}
		rec := f.record(k)
		if tc.late {
			if rec.Status != processors.StatusPending {
				t.Errorf("%s: the call is %s; want still pending, for the timer to expire", tc.key, rec.Status)
			}
			continue
		}
		if a.DecidedAt == nil || !a.DecidedAt.Equal(started.Add(d)) {
			t.Errorf("%s: decided at %v; want when the decision was made, %v", tc.key, a.DecidedAt, started.Add(d))
		}
	}
}

// rewrittenArguments is a store whose records' arguments and hash were
// both rewritten, consistently: the pair agrees, but not with the hash
// the call's events name.
type rewrittenArguments struct{ approvals.Store }

func (s rewrittenArguments) Get(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	rec, err := s.Store.Get(ctx, k)
	if err != nil {
		return rec, err
	}
	rec.Arguments = []byte(`{"amount_cents":999999,"currency":"AUD","order_id":"ord_other"}`)
	rec.ArgumentsHash, err = ledger.HashCanonicalArguments(rec.Key.TenantID, rec.Tool, rec.ToolVersion, rec.Arguments)
	return rec, err
}

// A call whose stored arguments were rewritten with a hash of their own
// (anyone who can write the store can compute one) is not approved,
// whatever hash the approver sends: the preview is the requested event's
// arguments, and the approval would bind and run others. Before, an
// approval of the record's hash was taken.
func TestApprovalRefusedForRewrittenArguments(t *testing.T) {
	f := newFixture(t)
	k, _ := f.refund("r-rewritten")
	svc := f.service(func(c *approvals.Config) { c.Store = rewrittenArguments{f.store} })
	rewritten, err := rewrittenArguments{f.store}.Get(t.Context(), k)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{rewritten.ArgumentsHash, f.record(k).ArgumentsHash} {
		if _, err := svc.Approve(t.Context(), boss, approvals.ID(k), h); !errors.Is(err, approvals.ErrArgumentIntegrity) && !errors.Is(err, approvals.ErrHashMismatch) {
			t.Errorf("Approve(%s) of rewritten arguments = %v; want refused", h, err)
		}
	}
	if _, err := svc.Approve(t.Context(), boss, approvals.ID(k), rewritten.ArgumentsHash); !errors.Is(err, approvals.ErrArgumentIntegrity) {
		t.Errorf("Approve(the record's own hash) = %v; want ErrArgumentIntegrity", err)
	}
	if got := f.pub.ofType(t, statemachine.EventApproved); len(got) != 0 {
		t.Errorf("approved events published: %d; want none", len(got))
	}
	if rec := f.record(k); rec.Status != processors.StatusPending {
		t.Errorf("the call is %s; want it still pending its approval", rec.Status)
	}
}
