package callindex_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	bolt "go.etcd.io/bbolt"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/projectionstest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// t0 is the fixture's noon; the window questions ask about [t0, t0+1h).
var t0 = time.Date(2026, 3, 2, 12, 0, 0, 0, time.UTC)

func sec(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }

// fx builds one fixture event; edit sets what the step carries.
func fx(tenant, key string, seq int64, typ statemachine.EventType, at time.Time, tool string, edit func(e *ledger.Event)) ledger.Event {
	e := ledger.Event{
		V: 1, EventID: fmt.Sprintf("%s/%s/%d", tenant, key, seq), Type: typ, Seq: seq, At: at, Actor: "test",
		TenantID: tenant, IdempotencyKey: key, Tool: tool, ToolVersion: 1,
		Resource: "ord_" + key, ArgumentsHash: "sha256:" + key, Attempt: 1,
	}
	if edit != nil {
		edit(&e)
	}
	return e
}

func decided(decision, version string) func(e *ledger.Event) {
	return func(e *ledger.Event) {
		e.Decision, e.PolicyVersion = decision, version
		if decision != "allow" {
			e.Reason = "policy_" + decision
		}
	}
}

func credential(jti, family string) func(e *ledger.Event) {
	return func(e *ledger.Event) { e.JTI, e.CredentialFamily = jti, family }
}

func refused(tenant, key, id string, at time.Time) ledger.Event {
	e := fx(tenant, key, 0, statemachine.EventDenied, at, "refund", func(e *ledger.Event) {
		e.Reason, e.Decision = "idempotency_key_reused", "deny"
	})
	e.EventID = id
	return e
}

// The fixture's calls, by tenant/key:
//
//	t_a/a1  refund      allow pv1, ran with j1 (family f1), succeeded at +3s; two refusals
//	t_a/a2  refund      requested at +10.7s, denied under pv1
//	t_a/a3  send_email  pending under pv1, approved by alice (apr_x), ran with j2, unknown, parked at +100s
//	t_a/a4  refund      pending under pv2 since +41s
//	t_a/a5  refund      an hour before the window: allow pv1, j1, succeeded
//	t_a/a6  refund      allow pv2, j3 (family f1), succeeded at +53s
//	t_a/a7  send_email  pending under pv2 (written first), then rejected by bob at +62s
//	t_a/z   —           only a refusal
//	t_b/a1  refund      the same key in another tenant: allow pv1, j1, failed at +8s
//	t_b/b2  refund      pending under pv1 since +46s
var (
	expires = sec(900)
	pending = func(version, approval string) func(e *ledger.Event) {
		return func(e *ledger.Event) {
			decided("require_approval", version)(e)
			e.ApprovalID, e.ExpiresAt = approval, &expires
		}
	}
	a1 = []ledger.Event{
		fx("t_a", "a1", 1, statemachine.EventRequested, sec(0), "refund", nil),
		fx("t_a", "a1", 2, statemachine.EventAuthorized, sec(1), "refund", decided("allow", "pv1")),
		fx("t_a", "a1", 3, statemachine.EventExecuting, sec(2), "refund", credential("j1", "f1")),
		// A policy version on an event that decides nothing is not a
		// decision under it.
		fx("t_a", "a1", 4, statemachine.EventSucceeded, sec(3), "refund", func(e *ledger.Event) {
			credential("j1", "f1")(e)
			e.PolicyVersion = "pv3"
		}),
	}
	a1r1 = refused("t_a", "a1", "a1-refusal-1", sec(4))
	a1r2 = refused("t_a", "a1", "a1-refusal-2", sec(9))
	a2   = []ledger.Event{
		fx("t_a", "a2", 1, statemachine.EventRequested, sec(10.7), "refund", nil),
		fx("t_a", "a2", 2, statemachine.EventDenied, sec(11), "refund", decided("deny", "pv1")),
	}
	a3 = []ledger.Event{
		fx("t_a", "a3", 1, statemachine.EventRequested, sec(20), "send_email", nil),
		fx("t_a", "a3", 2, statemachine.EventApprovalPending, sec(21), "send_email", pending("pv1", "apr_x")),
		fx("t_a", "a3", 3, statemachine.EventApproved, sec(30), "send_email", func(e *ledger.Event) {
			e.Approver, e.ApprovalID, e.ExpiresAt = "alice", "apr_x", &expires
		}),
		fx("t_a", "a3", 4, statemachine.EventExecuting, sec(31), "send_email", func(e *ledger.Event) {
			credential("j2", "f2")(e)
			e.Approver, e.ApprovalID = "alice", "apr_x"
		}),
		fx("t_a", "a3", 5, statemachine.EventOutcomeUnknown, sec(32), "send_email", func(e *ledger.Event) {
			credential("j2", "f2")(e)
			e.Reason = "timeout"
		}),
		fx("t_a", "a3", 6, statemachine.EventParked, sec(100), "send_email", func(e *ledger.Event) { e.Reason = "unresolved" }),
	}
	a4 = []ledger.Event{
		fx("t_a", "a4", 1, statemachine.EventRequested, sec(40), "refund", nil),
		fx("t_a", "a4", 2, statemachine.EventApprovalPending, sec(41), "refund", pending("pv2", "apr_y")),
	}
	a5 = []ledger.Event{
		fx("t_a", "a5", 1, statemachine.EventRequested, sec(-3600), "refund", nil),
		fx("t_a", "a5", 2, statemachine.EventAuthorized, sec(-3599), "refund", decided("allow", "pv1")),
		fx("t_a", "a5", 3, statemachine.EventExecuting, sec(-3598), "refund", credential("j1", "f1")),
		fx("t_a", "a5", 4, statemachine.EventSucceeded, sec(-3597), "refund", credential("j1", "f1")),
	}
	a6 = []ledger.Event{
		fx("t_a", "a6", 1, statemachine.EventRequested, sec(50), "refund", nil),
		fx("t_a", "a6", 2, statemachine.EventAuthorized, sec(51), "refund", decided("allow", "pv2")),
		fx("t_a", "a6", 3, statemachine.EventExecuting, sec(52), "refund", credential("j3", "f1")),
		fx("t_a", "a6", 4, statemachine.EventSucceeded, sec(53), "refund", credential("j3", "f1")),
	}
	a7 = []ledger.Event{
		fx("t_a", "a7", 1, statemachine.EventRequested, sec(60), "send_email", nil),
		fx("t_a", "a7", 2, statemachine.EventApprovalPending, sec(61), "send_email", pending("pv2", "apr_w")),
		fx("t_a", "a7", 3, statemachine.EventRejected, sec(62), "send_email", func(e *ledger.Event) {
			e.Approver, e.ApprovalID, e.Reason = "bob", "apr_w", "not_today"
		}),
	}
	z  = refused("t_a", "z", "z-refusal", sec(60))
	b1 = []ledger.Event{
		fx("t_b", "a1", 1, statemachine.EventRequested, sec(5), "refund", nil),
		fx("t_b", "a1", 2, statemachine.EventAuthorized, sec(6), "refund", decided("allow", "pv1")),
		fx("t_b", "a1", 3, statemachine.EventExecuting, sec(7), "refund", credential("j1", "f1")),
		fx("t_b", "a1", 4, statemachine.EventFailed, sec(8), "refund", func(e *ledger.Event) {
			credential("j1", "f1")(e)
			e.Reason, e.ErrorCode = "tool_failed", "http_500"
		}),
	}
	b2 = []ledger.Event{
		fx("t_b", "b2", 1, statemachine.EventRequested, sec(45), "refund", nil),
		fx("t_b", "b2", 2, statemachine.EventApprovalPending, sec(46), "refund", pending("pv1", "apr_z")),
	}
	freeze = projections.Action{Action: control.Action{
		V: 1, Kind: control.KindFreeze, Subject: "tool:refund", Tool: "refund", By: "op", ByTenant: "*", Reason: "incident", At: sec(70),
	}, Partition: 0, Offset: 3}
)

// batches are the fixture as the projector may hand it over: a call's
// later events before its earlier ones, a refusal before an older one.
func batches() []projections.Batch {
	batch := func(actions []projections.Action, groups ...[]ledger.Event) projections.Batch {
		b := projections.Batch{Actions: actions}
		for _, g := range groups {
			for _, e := range g {
				b.Events = append(b.Events, projections.Event{Event: e, Offset: int64(len(b.Events)), Produced: e.At})
			}
		}
		return b
	}
	return []projections.Batch{
		batch([]projections.Action{freeze}, a3[4:], a1[2:], []ledger.Event{a1r2}, b1, a7[:2]),
		batch([]projections.Action{freeze}, a1[:2], []ledger.Event{a1r1}, a2, a3[:4], a4, a5, a6, b2, []ledger.Event{z}),
		batch(nil, a7[2:]),
	}
}

func openIndex(t *testing.T, path string) *callindex.Index {
	t.Helper()
	ix, err := callindex.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ix
}

func write(t *testing.T, ix *callindex.Index, bs ...projections.Batch) {
	t.Helper()
	for i, b := range bs {
		if err := ix.Write(t.Context(), b); err != nil {
			t.Fatalf("Write(batch %d): %v", i, err)
		}
	}
}

// The questions the fixture is asked.
var (
	radiusQuestions = []projections.Filter{
		{Tenant: "t_a", JTI: "j1"},
		{Tenant: "t_a", JTI: "j1", Since: t0, Until: sec(3600)},
		{AllTenants: true, JTI: "j1"},
		{Tenant: "t_b", JTI: "j1"},
		{Tenant: "t_a", PolicyVersion: "pv1"},
		{Tenant: "t_a", PolicyVersion: "pv1", Decision: "deny"},
		{Tenant: "t_a", PolicyVersion: "pv1", Decision: "allow", Since: t0},
		{Tenant: "t_a", PolicyVersion: "pv3"},
		{Tenant: "t_a", Approver: "alice"},
		{Tenant: "t_a", ApprovalID: "apr_x"},
		{Tenant: "t_a", CredentialFamily: "f1"},
		{Tenant: "t_a", Tool: "send_email"},
		{Tenant: "t_a", Since: t0, Until: sec(3600)},
		{Tenant: "t_a", Since: sec(10), Until: sec(11)},
		{Tenant: "t_a", Tool: "refund", JTI: "j2"},
		{Tenant: "t_a", JTI: "j1", Approver: "alice"},
		{Tenant: "t_a", JTI: "j2", Approver: "alice"},
		{Tenant: "t_a", PolicyVersion: "pv1", Limit: 1},
		{Tenant: "t_b", Approver: "alice"},
		{AllTenants: true, PolicyVersion: "pv1", Decision: "require_approval"},
		{Tenant: "t_c"},
		// Read through j1's calls, which carry pv3 on no decision.
		{Tenant: "t_a", JTI: "j1", PolicyVersion: "pv3"},
		// t_a/a3 moved in the window, but was requested before it.
		{Tenant: "t_a", Since: sec(30), Until: sec(3600)},
	}
	outcomeQuestions = []struct {
		f      projections.Filter
		bucket time.Duration
	}{
		// Windows of a few hours around the log: a question spans at
		// most projections.MaxOutcomeBuckets buckets.
		{projections.Filter{Tenant: "t_a", Since: sec(-3 * 3600), Until: sec(3 * 3600)}, time.Minute},
		{projections.Filter{AllTenants: true, Since: t0, Until: sec(3 * 3600)}, time.Hour},
		{projections.Filter{Tenant: "t_a", Tool: "send_email", Since: sec(-3 * 3600), Until: sec(3 * 3600)}, 10 * time.Second},
		{projections.Filter{Tenant: "t_b", Since: sec(-3 * 3600), Until: sec(3 * 3600)}, time.Minute},
		{projections.Filter{Tenant: "t_c", Since: sec(-3 * 3600), Until: sec(3 * 3600)}, time.Minute},
	}
	unresolvedQuestions = []projections.Filter{
		{Tenant: "t_a"},
		{AllTenants: true},
		{AllTenants: true, Limit: 2},
		{Tenant: "t_a", Tool: "send_email"},
		{Tenant: "t_b"},
	}
	traceQuestions = []ledger.CallKey{
		{TenantID: "t_a", IdempotencyKey: "a1"},
		{TenantID: "t_b", IdempotencyKey: "a1"},
		{TenantID: "t_a", IdempotencyKey: "a3"},
		{TenantID: "t_a", IdempotencyKey: "z"},
		{TenantID: "t_c", IdempotencyKey: "a1"},
		{TenantID: "t_a", IdempotencyKey: "nothing"},
	}
)

// answers is everything the index says to the questions.
type answers struct {
	Radius     []projections.BlastRadius
	Outcomes   [][]projections.OutcomeCount
	Unresolved [][]projections.Call
	Traces     [][]ledger.Event
	NotFound   []bool
}

func ask(t *testing.T, ix *callindex.Index) answers {
	t.Helper()
	ctx := t.Context()
	var a answers
	for _, f := range radiusQuestions {
		br, err := ix.BlastRadius(ctx, f)
		if err != nil {
			t.Fatalf("BlastRadius(%+v): %v", f, err)
		}
		a.Radius = append(a.Radius, br)
	}
	for _, q := range outcomeQuestions {
		oc, err := ix.Outcomes(ctx, q.f, q.bucket)
		if err != nil {
			t.Fatalf("Outcomes(%+v, %s): %v", q.f, q.bucket, err)
		}
		a.Outcomes = append(a.Outcomes, oc)
	}
	for _, f := range unresolvedQuestions {
		calls, err := ix.Unresolved(ctx, f)
		if err != nil {
			t.Fatalf("Unresolved(%+v): %v", f, err)
		}
		a.Unresolved = append(a.Unresolved, calls)
	}
	for _, k := range traceQuestions {
		evs, err := ix.Trace(ctx, k)
		if err != nil && !errors.Is(err, projections.ErrNotFound) {
			t.Fatalf("Trace(%s): %v", k, err)
		}
		a.Traces = append(a.Traces, evs)
		a.NotFound = append(a.NotFound, errors.Is(err, projections.ErrNotFound))
	}
	return a
}

func keys(calls []projections.Call) []string {
	out := []string{}
	for _, c := range calls {
		out = append(out, c.Key().String())
	}
	return out
}

func ids(evs []ledger.Event) []string {
	out := []string{}
	for _, e := range evs {
		out = append(out, e.EventID)
	}
	return out
}

func TestProjectionAnswers(t *testing.T) {
	ix := openIndex(t, filepath.Join(t.TempDir(), "index.db"))
	defer ix.Close()
	bs := batches()
	write(t, ix, bs[:2]...)
	// t_a/a7 waits for an approval until its last batch rejects it.
	waiting, err := ix.Unresolved(t.Context(), projections.Filter{Tenant: "t_a"})
	if err != nil {
		t.Fatal(err)
	}
	if g, w := keys(waiting), []string{"t_a/a4", "t_a/a7", "t_a/a3"}; !slices.Equal(g, w) {
		t.Errorf("Unresolved(t_a) before the rejection = %v; want %v", g, w)
	}
	write(t, ix, bs[2:]...)
	got := ask(t, ix)

	t.Run("blast radius", func(t *testing.T) {
		want := []struct {
			calls     []string
			total     int
			truncated bool
		}{
			{calls: []string{"t_a/a1", "t_a/a5"}},
			{calls: []string{"t_a/a1"}},
			{calls: []string{"t_b/a1", "t_a/a1", "t_a/a5"}},
			{calls: []string{"t_b/a1"}},
			{calls: []string{"t_a/a3", "t_a/a2", "t_a/a1", "t_a/a5"}},
			{calls: []string{"t_a/a2"}},
			{calls: []string{"t_a/a1"}},
			{calls: []string{}},
			{calls: []string{"t_a/a3"}},
			{calls: []string{"t_a/a3"}},
			{calls: []string{"t_a/a6", "t_a/a1", "t_a/a5"}},
			{calls: []string{"t_a/a3", "t_a/a7"}},
			{calls: []string{"t_a/a3", "t_a/a7", "t_a/a6", "t_a/a4", "t_a/a2", "t_a/a1"}},
			// Requested at 12:00:10.7, in a window from 12:00:10.
			{calls: []string{"t_a/a2"}},
			{calls: []string{}},
			{calls: []string{}},
			{calls: []string{"t_a/a3"}},
			{calls: []string{"t_a/a3"}, total: 4, truncated: true},
			{calls: []string{}},
			{calls: []string{"t_a/a3", "t_b/b2"}},
			{calls: []string{}},
			{calls: []string{}},
			{calls: []string{"t_a/a7", "t_a/a6", "t_a/a4"}},
		}
		for i, w := range want {
			br := got.Radius[i]
			if w.total == 0 {
				w.total = len(w.calls)
			}
			if g := keys(br.Calls); !slices.Equal(g, w.calls) || br.Total != w.total || br.Truncated != w.truncated {
				t.Errorf("BlastRadius(%+v) = %v (total %d, truncated %t); want %v (total %d, truncated %t)",
					radiusQuestions[i], g, br.Total, br.Truncated, w.calls, w.total, w.truncated)
			}
		}
		// One answer in full: the calls as their latest events show
		// them, and the counts.
		f, _ := projections.Filter{AllTenants: true, JTI: "j1"}.Check()
		want2 := projections.BlastRadius{
			Filter: f, Total: 3,
			Calls: []projections.Call{
				projections.CallOf(&b1[3]), projections.CallOf(&a1[3]), projections.CallOf(&a5[3]),
			},
			ByTenant:   []projections.Count{{Value: "t_a", Calls: 2}, {Value: "t_b", Calls: 1}},
			ByState:    []projections.Count{{Value: "succeeded", Calls: 2}, {Value: "failed", Calls: 1}},
			ByTool:     []projections.Count{{Value: "refund", Calls: 3}},
			ByResource: []projections.Count{{Value: "ord_a1", Calls: 2}, {Value: "ord_a5", Calls: 1}},
			Distinct:   projections.Distinct{Tenants: 2, States: 2, Tools: 1, Resources: 2},
		}
		if diff := cmp.Diff(want2, got.Radius[2]); diff != "" {
			t.Errorf("BlastRadius(all tenants, j1) (-want +got):\n%s", diff)
		}
		if c := got.Radius[1].Calls[0]; c.State != statemachine.StateSucceeded || c.PolicyVersion != "pv3" || c.Seq != 4 {
			t.Errorf("t_a/a1 = %s seq %d policy %q; want succeeded seq 4 under pv3 (its latest event's)", c.State, c.Seq, c.PolicyVersion)
		}
	})

	t.Run("outcomes", func(t *testing.T) {
		oc := func(at time.Time, tool string, s statemachine.State, n int) projections.OutcomeCount {
			return projections.OutcomeCount{Bucket: at, Tool: tool, State: s, Calls: n}
		}
		want := [][]projections.OutcomeCount{
			{
				oc(sec(-3600), "refund", statemachine.StateSucceeded, 1),
				oc(t0, "refund", statemachine.StateDenied, 1),
				oc(t0, "refund", statemachine.StateSucceeded, 2),
				oc(t0, "send_email", statemachine.StateOutcomeUnknown, 1),
				oc(sec(60), "send_email", statemachine.StateRejected, 1),
			},
			{
				oc(t0, "refund", statemachine.StateDenied, 1),
				oc(t0, "refund", statemachine.StateFailed, 1),
				oc(t0, "refund", statemachine.StateSucceeded, 2),
				oc(t0, "send_email", statemachine.StateOutcomeUnknown, 1),
				oc(t0, "send_email", statemachine.StateRejected, 1),
			},
			{
				oc(sec(30), "send_email", statemachine.StateOutcomeUnknown, 1),
				oc(sec(60), "send_email", statemachine.StateRejected, 1),
			},
			{oc(t0, "refund", statemachine.StateFailed, 1)},
			{},
		}
		for i, w := range want {
			if diff := cmp.Diff(w, got.Outcomes[i]); diff != "" {
				t.Errorf("Outcomes(%+v, %s) (-want +got):\n%s", outcomeQuestions[i].f, outcomeQuestions[i].bucket, diff)
			}
		}
	})

	t.Run("unresolved", func(t *testing.T) {
		want := [][]string{
			{"t_a/a4", "t_a/a3"},
			{"t_a/a4", "t_b/b2", "t_a/a3"},
			{"t_a/a4", "t_b/b2"},
			{"t_a/a3"},
			{"t_b/b2"},
		}
		for i, w := range want {
			if g := keys(got.Unresolved[i]); !slices.Equal(g, w) {
				t.Errorf("Unresolved(%+v) = %v; want %v", unresolvedQuestions[i], g, w)
			}
		}
		// The parked call is outcome_unknown, and says it is parked.
		if diff := cmp.Diff(projections.CallOf(&a3[5]), got.Unresolved[0][1]); diff != "" {
			t.Errorf("parked call (-want +got):\n%s", diff)
		}
		if c := got.Unresolved[0][1]; c.State != statemachine.StateOutcomeUnknown || c.LastEvent != statemachine.EventParked {
			t.Errorf("parked call = %s after %s; want outcome_unknown after parked", c.State, c.LastEvent)
		}
	})

	t.Run("trace", func(t *testing.T) {
		want := [][]string{
			append([]string{"a1-refusal-1", "a1-refusal-2"}, ids(a1)...),
			ids(b1),
			ids(a3),
			{"z-refusal"},
			{},
			{},
		}
		for i, w := range want {
			if g := ids(got.Traces[i]); !slices.Equal(g, w) {
				t.Errorf("Trace(%s) = %v; want %v", traceQuestions[i], g, w)
			}
			if nf := len(w) == 0; got.NotFound[i] != nf {
				t.Errorf("Trace(%s): not found %t; want %t", traceQuestions[i], got.NotFound[i], nf)
			}
		}
		// The events come back as they were written.
		if diff := cmp.Diff(a3, got.Traces[2]); diff != "" {
			t.Errorf("Trace(t_a/a3) (-want +got):\n%s", diff)
		}
	})

	t.Run("fold", func(t *testing.T) {
		// a3's last events came first: once the rest arrived, the gap
		// closed and the call folds whole.
		c, err := ix.Get(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "a3"})
		if err != nil {
			t.Fatal(err)
		}
		if c.State != statemachine.StateOutcomeUnknown || c.Seq != 6 || c.Anomalies != 0 || len(c.Events) != 6 {
			t.Errorf("t_a/a3 = %s seq %d, %d events, %d anomalies; want outcome_unknown seq 6, 6 events, none", c.State, c.Seq, len(c.Events), c.Anomalies)
		}
	})
}

// Writing again, in other batches and in reverse, changes no answer;
// neither does reopening the file, nor rebuilding its indexes.
func TestProjectionWriteTwice(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index.db")
	ix := openIndex(t, path)
	bs := batches()
	write(t, ix, bs...)
	want := ask(t, ix)

	write(t, ix, bs[1], bs[0])
	var all projections.Batch
	for _, b := range bs {
		all.Events = append(all.Events, b.Events...)
		all.Actions = append(all.Actions, b.Actions...)
	}
	slices.Reverse(all.Events)
	write(t, ix, all)
	if diff := cmp.Diff(want, ask(t, ix)); diff != "" {
		t.Errorf("answers after writing again (-first +again):\n%s", diff)
	}
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}

	// The freeze, written four times, is kept once.
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		if n := tx.Bucket([]byte("actions")).Stats().KeyN; n != 1 {
			t.Errorf("actions kept: %d; want 1", n)
		}
		// Only the calls that wait are listed as unresolved: a7 left
		// the list when it was rejected.
		if n := tx.Bucket([]byte("unresolved")).Stats().KeyN; n != 3 {
			t.Errorf("unresolved lists %d calls; want 3", n)
		}
		// A file from before the indexes: no refs, no unresolved, no
		// layout.
		for _, name := range []string{"refs", "unresolved", "meta"} {
			if err := tx.DeleteBucket([]byte(name)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	ix = openIndex(t, path)
	defer ix.Close()
	if diff := cmp.Diff(want, ask(t, ix)); diff != "" {
		t.Errorf("answers after rebuilding the indexes (-before +after):\n%s", diff)
	}
}

// A file of an older layout lacks the refs a later one added: layout 2
// those by call id and trace id, layout 3 those by role. Opening it
// indexes its calls again, and questions by them find the calls.
func TestOlderLayoutsIndexedAgain(t *testing.T) {
	for _, tc := range []struct {
		layout string
		kinds  []string // the refs the layout lacks
		ask    func(k ledger.CallKey, evs []ledger.Event) []projections.Filter
	}{
		{"2", []string{"call_id", "trace_id"}, func(k ledger.CallKey, evs []ledger.Event) []projections.Filter {
			return []projections.Filter{{Tenant: k.TenantID, CallID: evs[0].CallID}, {AllTenants: true, TraceID: evs[0].TraceID}}
		}},
		{"3", []string{"role"}, func(k ledger.CallKey, evs []ledger.Event) []projections.Filter {
			var fs []projections.Filter
			for _, e := range evs {
				if len(e.Roles) > 0 && projections.RoleDecided(&e, e.Roles[0]) {
					fs = append(fs, projections.Filter{Tenant: k.TenantID, Role: e.Roles[0], Decision: e.Decision, Since: e.At, Until: e.At.Add(time.Second)})
				}
			}
			return fs
		}},
	} {
		t.Run("layout "+tc.layout, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "index.db")
			ix := openIndex(t, path)
			log := projectionstest.Log(projectionstest.LogConfig{Seed: 5, Calls: 60, Tenants: 2})
			projectionstest.Write(t, ix, log, 40)
			if err := ix.Close(); err != nil {
				t.Fatal(err)
			}
			if removed := downgrade(t, path, tc.layout, tc.kinds...); removed == 0 {
				t.Fatalf("the file held no refs of kinds %v to remove", tc.kinds)
			}
			ix = openIndex(t, path)
			defer ix.Close()
			o := projectionstest.NewOracle(log)
			asked := 0
			for _, k := range o.Keys() {
				evs := o.Events(k)
				if len(evs) == 0 {
					continue
				}
				for _, f := range tc.ask(k, evs) {
					nf, err := f.Check()
					if err != nil {
						t.Fatal(err)
					}
					got, err := ix.BlastRadius(t.Context(), f)
					if err != nil {
						t.Fatalf("BlastRadius(%+v): %v", f, err)
					}
					if diff := cmp.Diff(o.BlastRadius(nf), got, cmpopts.EquateEmpty()); diff != "" {
						t.Errorf("BlastRadius(%+v) after reopening (-oracle +index):\n%s", f, diff)
					}
					if got.Total == 0 {
						t.Errorf("BlastRadius(%+v) after reopening found no call", f)
					}
					asked++
				}
			}
			if asked == 0 {
				t.Fatal("asked nothing")
			}
		})
	}
}

// downgrade leaves the index file at path as layout left it: without the
// refs of kinds. It returns how many it removed.
func downgrade(t *testing.T, path, layout string, kinds ...string) int {
	t.Helper()
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	removed := 0
	err = db.Update(func(tx *bolt.Tx) error {
		refs := tx.Bucket([]byte("refs"))
		var old [][]byte
		err := refs.ForEach(func(k, _ []byte) error {
			if slices.ContainsFunc(kinds, func(kind string) bool { return bytes.HasPrefix(k, []byte(kind+"\x00")) }) {
				old = append(old, slices.Clone(k))
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, k := range old {
			if err := refs.Delete(k); err != nil {
				return err
			}
		}
		removed = len(old)
		return tx.Bucket([]byte("meta")).Put([]byte("layout"), []byte(layout))
	})
	if err != nil {
		t.Fatal(err)
	}
	return removed
}

// Questions that cannot be asked are refused, before any read.
func TestProjectionRefuses(t *testing.T) {
	ix := openIndex(t, filepath.Join(t.TempDir(), "index.db"))
	defer ix.Close()
	write(t, ix, batches()...)
	ctx := t.Context()
	tests := []struct {
		name string
		ask  func() error
		want error
	}{
		{"blast radius without tenant", func() error { _, err := ix.BlastRadius(ctx, projections.Filter{JTI: "j1"}); return err }, projections.ErrTenantRequired},
		{"outcomes without tenant", func() error { _, err := ix.Outcomes(ctx, projections.Filter{}, time.Minute); return err }, projections.ErrTenantRequired},
		{"unresolved without tenant", func() error { _, err := ix.Unresolved(ctx, projections.Filter{Tool: "refund"}); return err }, projections.ErrTenantRequired},
		{"decision without version", func() error {
			_, err := ix.BlastRadius(ctx, projections.Filter{Tenant: "t_a", Decision: "allow"})
			return err
		}, projections.ErrInvalidFilter},
		{"outcomes by reference", func() error {
			_, err := ix.Outcomes(ctx, projections.Filter{Tenant: "t_a", JTI: "j1"}, time.Minute)
			return err
		}, projections.ErrInvalidFilter},
		{"outcomes in half seconds", func() error {
			_, err := ix.Outcomes(ctx, projections.Filter{Tenant: "t_a"}, 1500*time.Millisecond)
			return err
		}, projections.ErrInvalidFilter},
		{"unresolved in a window", func() error {
			_, err := ix.Unresolved(ctx, projections.Filter{Tenant: "t_a", Since: t0})
			return err
		}, projections.ErrInvalidFilter},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.ask(); !errors.Is(err, tc.want) {
				t.Errorf("err = %v; want %v", err, tc.want)
			}
		})
	}
	// A cancelled context stops a write before it starts.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := ix.Write(cctx, batches()[0]); !errors.Is(err, context.Canceled) {
		t.Errorf("Write(cancelled) = %v; want context.Canceled", err)
	}
}

// References of any length and content are found, and only where they
// are: a value too long for a bbolt key, and values one of which starts
// the other. One holding the index's separator is written, and a
// question naming it is refused as no jti (Filter.Check) before the
// index is read.
func TestProjectionOddReferences(t *testing.T) {
	ix := openIndex(t, filepath.Join(t.TempDir(), "index.db"))
	defer ix.Close()
	long := strings.Repeat("j", 40<<10)
	jtis := map[string]string{"long": long, "long2": long + "x", "short": "j", "nul": "j\x00t_a\x00short"}
	var b projections.Batch
	for key, jti := range jtis {
		for _, e := range []ledger.Event{
			fx("t_a", key, 1, statemachine.EventRequested, sec(0), "refund", nil),
			fx("t_a", key, 2, statemachine.EventAuthorized, sec(1), "refund", decided("allow", "pv1")),
			fx("t_a", key, 3, statemachine.EventExecuting, sec(2), "refund", credential(jti, "f")),
		} {
			b.Events = append(b.Events, projections.Event{Event: e})
		}
	}
	write(t, ix, b)
	for key, jti := range jtis {
		for _, f := range []projections.Filter{{Tenant: "t_a", JTI: jti}, {AllTenants: true, JTI: jti}} {
			br, err := ix.BlastRadius(t.Context(), f)
			if key == "nul" {
				if !errors.Is(err, projections.ErrInvalidFilter) {
					t.Errorf("BlastRadius(%s's jti) = %v; want ErrInvalidFilter", key, err)
				}
				continue
			}
			if err != nil {
				t.Fatalf("BlastRadius(%s's jti): %v", key, err)
			}
			if g, w := keys(br.Calls), []string{"t_a/" + key}; !slices.Equal(g, w) {
				t.Errorf("BlastRadius(%s's jti, all tenants %t) = %v; want %v", key, f.AllTenants, g, w)
			}
		}
	}
}
