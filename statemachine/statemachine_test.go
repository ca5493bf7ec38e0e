package statemachine_test

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	sm "github.com/toolcall-ledger/ledger/statemachine"
)

const (
	testHash  = "sha256:aaaa"
	otherHash = "sha256:bbbb"
	// pendingFor is how long the approval_pending events of the fixtures
	// wait; DESIGN §5's default.
	pendingFor = 15 * time.Minute
)

// epoch is the fixtures' time zero. Apply reads no clock, so the tests do
// not either.
var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// edge is where an event leads from a state and what it asks for.
type edge struct {
	to      sm.State
	effects []sm.Effect
}

// wantEdges is DESIGN §4 written out by hand. It deliberately does not read
// sm.Transitions, so that any change to the table breaks TestExhaustive.
func wantEdges() map[sm.State]map[sm.EventType]edge {
	execute := []sm.Effect{sm.EffectExecute}
	notify := []sm.Effect{sm.EffectNotify}
	return map[sm.State]map[sm.EventType]edge{
		sm.StateNone: {
			sm.EventRequested: {to: sm.StateRequested},
		},
		sm.StateRequested: {
			sm.EventAuthorized:      {to: sm.StateAuthorized, effects: execute},
			sm.EventApprovalPending: {to: sm.StateApprovalPending, effects: []sm.Effect{sm.EffectAwaitApproval}},
			sm.EventDenied:          {to: sm.StateDenied, effects: notify},
		},
		sm.StateApprovalPending: {
			sm.EventApproved: {to: sm.StateAuthorized, effects: execute},
			sm.EventRejected: {to: sm.StateRejected, effects: notify},
			sm.EventExpired:  {to: sm.StateExpired, effects: notify},
		},
		sm.StateAuthorized: {
			sm.EventExecuting: {to: sm.StateExecuting},
			// Kill switch, or the re-check at execution.
			sm.EventDenied: {to: sm.StateDenied, effects: notify},
			// Deadline passed before execution.
			sm.EventExpired: {to: sm.StateExpired, effects: notify},
		},
		sm.StateExecuting: {
			sm.EventSucceeded:      {to: sm.StateSucceeded, effects: notify},
			sm.EventFailed:         {to: sm.StateFailed, effects: notify},
			sm.EventOutcomeUnknown: {to: sm.StateOutcomeUnknown, effects: []sm.Effect{sm.EffectReconcile}},
		},
		sm.StateOutcomeUnknown: {
			sm.EventSucceeded:   {to: sm.StateSucceeded, effects: notify},
			sm.EventFailed:      {to: sm.StateFailed, effects: notify},
			sm.EventCompensated: {to: sm.StateCompensated, effects: notify},
			// The reconciler hands the call to a human.
			sm.EventParked: {to: sm.StateOutcomeUnknown, effects: notify},
		},
		sm.StateSucceeded: {
			// An incident responder undoes a call.
			sm.EventCompensated: {to: sm.StateCompensated, effects: notify},
		},
	}
}

// path is a legal history that leaves a call in want.
type path struct {
	name   string
	events []sm.EventType
	want   sm.State
}

// testPaths has at least one path to every state (TestPathsCoverStates
// checks), plus the second ways into states that have two.
func testPaths() []path {
	req, auth, pend := sm.EventRequested, sm.EventAuthorized, sm.EventApprovalPending
	exec, unknown := sm.EventExecuting, sm.EventOutcomeUnknown
	return []path{
		{name: "none", want: sm.StateNone},
		{name: "requested", events: []sm.EventType{req}, want: sm.StateRequested},
		{name: "approval_pending", events: []sm.EventType{req, pend}, want: sm.StateApprovalPending},
		{name: "authorized", events: []sm.EventType{req, auth}, want: sm.StateAuthorized},
		{name: "executing", events: []sm.EventType{req, auth, exec}, want: sm.StateExecuting},
		{name: "succeeded", events: []sm.EventType{req, auth, exec, sm.EventSucceeded}, want: sm.StateSucceeded},
		{name: "failed", events: []sm.EventType{req, auth, exec, sm.EventFailed}, want: sm.StateFailed},
		{name: "outcome_unknown", events: []sm.EventType{req, auth, exec, unknown}, want: sm.StateOutcomeUnknown},
		{name: "compensated", events: []sm.EventType{req, auth, exec, sm.EventSucceeded, sm.EventCompensated}, want: sm.StateCompensated},
		{name: "denied", events: []sm.EventType{req, sm.EventDenied}, want: sm.StateDenied},
		{name: "rejected", events: []sm.EventType{req, pend, sm.EventRejected}, want: sm.StateRejected},
		{name: "expired", events: []sm.EventType{req, pend, sm.EventExpired}, want: sm.StateExpired},

		{name: "authorized_after_approval", events: []sm.EventType{req, pend, sm.EventApproved}, want: sm.StateAuthorized},
		{name: "executing_after_approval", events: []sm.EventType{req, pend, sm.EventApproved, exec}, want: sm.StateExecuting},
		{name: "denied_after_authorized", events: []sm.EventType{req, auth, sm.EventDenied}, want: sm.StateDenied},
		{name: "expired_after_authorized", events: []sm.EventType{req, auth, sm.EventExpired}, want: sm.StateExpired},
		{name: "succeeded_after_reconcile", events: []sm.EventType{req, auth, exec, unknown, sm.EventSucceeded}, want: sm.StateSucceeded},
		{name: "failed_after_reconcile", events: []sm.EventType{req, auth, exec, unknown, sm.EventFailed}, want: sm.StateFailed},
		{name: "compensated_after_unknown", events: []sm.EventType{req, auth, exec, unknown, sm.EventCompensated}, want: sm.StateCompensated},
	}
}

// pathTo returns the first path in testPaths that ends in s.
func pathTo(t testing.TB, s sm.State) path {
	t.Helper()
	for _, p := range testPaths() {
		if p.want == s {
			return p
		}
	}
	t.Fatalf("no path to %q", s)
	return path{}
}

// validEvent returns the next event of type typ for c with every guard
// field of every edge on typ satisfied: the next seq, the call's hash, a
// reason, an attempt, an approval id, an expiry, and a time before a
// pending approval lapses (or, for expired, not before).
func validEvent(c sm.Call, typ sm.EventType) sm.Event {
	seq := c.Seq + 1
	ev := sm.Event{
		Type:          typ,
		Seq:           seq,
		At:            epoch.Add(time.Duration(seq) * time.Second),
		ArgumentsHash: c.ArgumentsHash,
		ApprovalID:    "apr_1",
		ExpiresAt:     epoch.Add(pendingFor),
		Attempt:       1,
		Reason:        "reason_" + string(typ),
	}
	if ev.ArgumentsHash == "" {
		ev.ArgumentsHash = testHash
	}
	if typ == sm.EventExpired && ev.At.Before(c.PendingExpiresAt) {
		ev.At = c.PendingExpiresAt
	}
	return ev
}

// build folds p's events, one validEvent at a time, and returns the call
// and the events applied.
func build(t testing.TB, p path) (sm.Call, []sm.Event) {
	t.Helper()
	var c sm.Call
	var evs []sm.Event
	for _, typ := range p.events {
		ev := validEvent(c, typ)
		next, _, err := sm.Apply(c, ev)
		if err != nil {
			t.Fatalf("path %s: Apply(%+v, %+v) error: %v", p.name, c, ev, err)
		}
		c = next
		evs = append(evs, ev)
	}
	if c.State != p.want {
		t.Fatalf("path %s ends in %q; want %q", p.name, c.State, p.want)
	}
	return c, evs
}

// sortedTypes returns the event types that have an edge from s in want,
// sorted so that anything drawing from them is reproducible.
func sortedTypes(want map[sm.State]map[sm.EventType]edge, s sm.State) []sm.EventType {
	return slices.Sorted(maps.Keys(want[s]))
}

// sentinel names which of the package's errors err wraps, for messages and
// for comparing two results.
func sentinel(err error) string {
	for _, s := range []error{sm.ErrInvalidTransition, sm.ErrDuplicateEvent, sm.ErrSeqGap} {
		if errors.Is(err, s) {
			return s.Error()
		}
	}
	if err == nil {
		return "<nil>"
	}
	return fmt.Sprintf("unclassified error %q", err)
}

func TestStatesAndEventTypes(t *testing.T) {
	t.Parallel()
	// Written out so that a state or event type added without an edge and
	// a test path fails here, not silently in the exhaustive loop.
	wantStates := []sm.State{
		"", "requested", "approval_pending", "authorized", "executing", "succeeded",
		"failed", "outcome_unknown", "compensated", "denied", "rejected", "expired",
	}
	if diff := cmp.Diff(wantStates, sm.States); diff != "" {
		t.Errorf("States mismatch (-want +got):\n%s", diff)
	}
	wantTypes := []sm.EventType{
		"requested", "authorized", "approval_pending", "approved", "rejected", "expired",
		"denied", "executing", "succeeded", "failed", "outcome_unknown", "compensated", "parked",
	}
	if diff := cmp.Diff(wantTypes, sm.EventTypes); diff != "" {
		t.Errorf("EventTypes mismatch (-want +got):\n%s", diff)
	}
}

func TestTerminalAndSettled(t *testing.T) {
	t.Parallel()
	tests := []struct {
		state            sm.State
		terminal, settle bool
	}{
		{sm.StateNone, false, false},
		{sm.StateRequested, false, false},
		{sm.StateApprovalPending, false, true},
		{sm.StateAuthorized, false, false},
		{sm.StateExecuting, false, false},
		{sm.StateSucceeded, true, true},
		{sm.StateFailed, true, true},
		{sm.StateOutcomeUnknown, false, true},
		{sm.StateCompensated, true, true},
		{sm.StateDenied, true, true},
		{sm.StateRejected, true, true},
		{sm.StateExpired, true, true},
	}
	if len(tests) != len(sm.States) {
		t.Fatalf("table has %d states; States has %d", len(tests), len(sm.States))
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%q", tc.state), func(t *testing.T) {
			if got := tc.state.Terminal(); got != tc.terminal {
				t.Errorf("%q.Terminal() = %v; want %v", tc.state, got, tc.terminal)
			}
			if got := tc.state.Settled(); got != tc.settle {
				t.Errorf("%q.Settled() = %v; want %v", tc.state, got, tc.settle)
			}
		})
	}
}

func TestPathsCoverStates(t *testing.T) {
	t.Parallel()
	reached := map[sm.State]bool{}
	for _, p := range testPaths() {
		c, _ := build(t, p)
		reached[c.State] = true
	}
	for _, s := range sm.States {
		if !reached[s] {
			t.Errorf("no test path reaches %q", s)
		}
	}
}

// TestExhaustive applies every event type in every state (from every test
// path) and checks the result against wantEdges.
func TestExhaustive(t *testing.T) {
	t.Parallel()
	want := wantEdges()
	for _, p := range testPaths() {
		for _, typ := range sm.EventTypes {
			t.Run(p.name+"/"+string(typ), func(t *testing.T) {
				t.Parallel()
				c, _ := build(t, p)
				ev := validEvent(c, typ)
				got, effects, err := sm.Apply(c, ev)
				e, legal := want[c.State][typ]
				if !legal {
					if !errors.Is(err, sm.ErrInvalidTransition) {
						t.Fatalf("Apply(%q, %q) error = %v; want %v", c.State, typ, err, sm.ErrInvalidTransition)
					}
					if diff := cmp.Diff(c, got); diff != "" {
						t.Errorf("Apply(%q, %q) refused but changed the call (-before +after):\n%s", c.State, typ, diff)
					}
					if effects != nil {
						t.Errorf("Apply(%q, %q) refused but effects = %v; want nil", c.State, typ, effects)
					}
					return
				}
				if err != nil {
					t.Fatalf("Apply(%q, %q) error = %v; want edge to %q", c.State, typ, err, e.to)
				}
				if got.State != e.to {
					t.Errorf("Apply(%q, %q).State = %q; want %q", c.State, typ, got.State, e.to)
				}
				if diff := cmp.Diff(e.effects, effects, cmpopts.EquateEmpty()); diff != "" {
					t.Errorf("Apply(%q, %q) effects mismatch (-want +got):\n%s", c.State, typ, diff)
				}
				if got.Seq != ev.Seq {
					t.Errorf("Apply(%q, %q).Seq = %d; want %d", c.State, typ, got.Seq, ev.Seq)
				}
				if !got.UpdatedAt.Equal(ev.At) {
					t.Errorf("Apply(%q, %q).UpdatedAt = %v; want %v", c.State, typ, got.UpdatedAt, ev.At)
				}
				if got.ArgumentsHash != testHash {
					t.Errorf("Apply(%q, %q).ArgumentsHash = %q; want %q", c.State, typ, got.ArgumentsHash, testHash)
				}
			})
		}
	}
}

// TestLookup checks Lookup against wantEdges for every pair, and that
// Transitions holds no edge wantEdges lacks (such as one from a state
// missing from States).
func TestLookup(t *testing.T) {
	t.Parallel()
	want := wantEdges()
	for _, s := range sm.States {
		for _, typ := range sm.EventTypes {
			got := sm.Lookup(s, typ)
			e, legal := want[s][typ]
			switch {
			case !legal && got != nil:
				t.Errorf("Lookup(%q, %q) = edge to %q; want nil", s, typ, got.To)
			case legal && got == nil:
				t.Errorf("Lookup(%q, %q) = nil; want edge to %q", s, typ, e.to)
			case legal:
				if got.To != e.to {
					t.Errorf("Lookup(%q, %q).To = %q; want %q", s, typ, got.To, e.to)
				}
				if got.On != typ || !slices.Contains(got.From, s) {
					t.Errorf("Lookup(%q, %q) = edge from %v on %q", s, typ, got.From, got.On)
				}
				if diff := cmp.Diff(e.effects, got.Effects, cmpopts.EquateEmpty()); diff != "" {
					t.Errorf("Lookup(%q, %q).Effects mismatch (-want +got):\n%s", s, typ, diff)
				}
			}
		}
	}
	n := 0
	for _, tr := range sm.Transitions {
		for _, from := range tr.From {
			n++
			e, ok := want[from][tr.On]
			if !ok || e.to != tr.To {
				t.Errorf("Transitions has %q --%s--> %q; not in DESIGN §4", from, tr.On, tr.To)
			}
		}
	}
	wantN := 0
	for _, m := range want {
		wantN += len(m)
	}
	if n != wantN {
		t.Errorf("Transitions has %d (from, on) pairs; want %d", n, wantN)
	}
}

func TestGuards(t *testing.T) {
	t.Parallel()
	type guardCase struct {
		name string
		from sm.State
		typ  sm.EventType
		// editCall, if set, changes the call before the event is built.
		editCall func(*sm.Call)
		edit     func(c sm.Call, ev *sm.Event)
		// wantErr nil means the edited event is accepted.
		wantErr error
	}
	noReason := func(_ sm.Call, ev *sm.Event) { ev.Reason = "" }
	tests := []guardCase{
		{name: "requested without hash", from: sm.StateNone, typ: sm.EventRequested,
			edit: func(_ sm.Call, ev *sm.Event) { ev.ArgumentsHash = "" }, wantErr: sm.ErrInvalidTransition},
		// Only a hand-made call can be untouched yet at seq 1: the seq
		// checks catch every other way to request at a seq other than 1
		// (TestSeq).
		{name: "requested at seq 2", from: sm.StateNone, typ: sm.EventRequested,
			editCall: func(c *sm.Call) { c.Seq = 1 }, wantErr: sm.ErrInvalidTransition},
		{name: "denied from requested without reason", from: sm.StateRequested, typ: sm.EventDenied, edit: noReason, wantErr: sm.ErrInvalidTransition},
		{name: "denied from authorized without reason", from: sm.StateAuthorized, typ: sm.EventDenied, edit: noReason, wantErr: sm.ErrInvalidTransition},
		{name: "rejected without reason", from: sm.StateApprovalPending, typ: sm.EventRejected, edit: noReason, wantErr: sm.ErrInvalidTransition},
		{name: "failed from executing without reason", from: sm.StateExecuting, typ: sm.EventFailed, edit: noReason, wantErr: sm.ErrInvalidTransition},
		{name: "failed from outcome_unknown without reason", from: sm.StateOutcomeUnknown, typ: sm.EventFailed, edit: noReason, wantErr: sm.ErrInvalidTransition},
		{name: "outcome_unknown without reason", from: sm.StateExecuting, typ: sm.EventOutcomeUnknown, edit: noReason, wantErr: sm.ErrInvalidTransition},
		{name: "expired from authorized without reason", from: sm.StateAuthorized, typ: sm.EventExpired, edit: noReason, wantErr: sm.ErrInvalidTransition},
		{name: "succeeded without reason", from: sm.StateExecuting, typ: sm.EventSucceeded, edit: noReason},
		{name: "approval_pending without expiry", from: sm.StateRequested, typ: sm.EventApprovalPending,
			edit: func(_ sm.Call, ev *sm.Event) { ev.ExpiresAt = time.Time{} }, wantErr: sm.ErrInvalidTransition},
		{name: "approved without approval id", from: sm.StateApprovalPending, typ: sm.EventApproved,
			edit: func(_ sm.Call, ev *sm.Event) { ev.ApprovalID = "" }, wantErr: sm.ErrInvalidTransition},
		{name: "approved without expiry", from: sm.StateApprovalPending, typ: sm.EventApproved,
			edit: func(_ sm.Call, ev *sm.Event) { ev.ExpiresAt = time.Time{} }, wantErr: sm.ErrInvalidTransition},
		{name: "approved with other hash", from: sm.StateApprovalPending, typ: sm.EventApproved,
			edit: func(_ sm.Call, ev *sm.Event) { ev.ArgumentsHash = otherHash }, wantErr: sm.ErrInvalidTransition},
		// Other events may leave the hash out; an approval must name it.
		{name: "approved without hash", from: sm.StateApprovalPending, typ: sm.EventApproved,
			edit: func(_ sm.Call, ev *sm.Event) { ev.ArgumentsHash = "" }, wantErr: sm.ErrInvalidTransition},
		{name: "approved at pending expiry", from: sm.StateApprovalPending, typ: sm.EventApproved,
			edit: func(c sm.Call, ev *sm.Event) { ev.At = c.PendingExpiresAt }, wantErr: sm.ErrInvalidTransition},
		{name: "approved after pending expiry", from: sm.StateApprovalPending, typ: sm.EventApproved,
			edit: func(c sm.Call, ev *sm.Event) { ev.At = c.PendingExpiresAt.Add(time.Hour) }, wantErr: sm.ErrInvalidTransition},
		{name: "approved just before pending expiry", from: sm.StateApprovalPending, typ: sm.EventApproved,
			edit: func(c sm.Call, ev *sm.Event) { ev.At = c.PendingExpiresAt.Add(-time.Nanosecond) }},
		{name: "expired before expires_at", from: sm.StateApprovalPending, typ: sm.EventExpired,
			edit: func(c sm.Call, ev *sm.Event) { ev.At = c.PendingExpiresAt.Add(-time.Nanosecond) }, wantErr: sm.ErrInvalidTransition},
		{name: "expired with zero time", from: sm.StateApprovalPending, typ: sm.EventExpired,
			edit: func(_ sm.Call, ev *sm.Event) { ev.At = time.Time{} }, wantErr: sm.ErrInvalidTransition},
		{name: "expired at expires_at", from: sm.StateApprovalPending, typ: sm.EventExpired,
			edit: func(c sm.Call, ev *sm.Event) { ev.At = c.PendingExpiresAt }},
		{name: "executing without attempt", from: sm.StateAuthorized, typ: sm.EventExecuting,
			edit: func(_ sm.Call, ev *sm.Event) { ev.Attempt = 0 }, wantErr: sm.ErrInvalidTransition},
		{name: "executing with negative attempt", from: sm.StateAuthorized, typ: sm.EventExecuting,
			edit: func(_ sm.Call, ev *sm.Event) { ev.Attempt = -1 }, wantErr: sm.ErrInvalidTransition},
	}
	// Every edge out of a requested call refuses a changed hash, and
	// accepts an event that leaves the hash out.
	want := wantEdges()
	for _, from := range sm.States {
		if from == sm.StateNone {
			continue
		}
		for _, typ := range sortedTypes(want, from) {
			tests = append(tests,
				guardCase{name: fmt.Sprintf("%s on %s with other hash", typ, from), from: from, typ: typ,
					edit: func(_ sm.Call, ev *sm.Event) { ev.ArgumentsHash = otherHash }, wantErr: sm.ErrInvalidTransition})
			if typ != sm.EventApproved {
				tests = append(tests,
					guardCase{name: fmt.Sprintf("%s on %s without hash", typ, from), from: from, typ: typ,
						edit: func(_ sm.Call, ev *sm.Event) { ev.ArgumentsHash = "" }})
			}
		}
	}

	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, _ := build(t, pathTo(t, tc.from))
			// Control: the unedited event is accepted, so a refusal below
			// comes from the edit.
			if _, _, err := sm.Apply(c, validEvent(c, tc.typ)); err != nil {
				t.Fatalf("control: Apply(%q, valid %q) error: %v", c.State, tc.typ, err)
			}
			if tc.editCall != nil {
				tc.editCall(&c)
			}
			ev := validEvent(c, tc.typ)
			if tc.edit != nil {
				tc.edit(c, &ev)
			}
			got, effects, err := sm.Apply(c, ev)
			if tc.wantErr == nil {
				if err != nil {
					t.Fatalf("Apply(%+v, %+v) error: %v; want accepted", c, ev, err)
				}
				if w := want[c.State][tc.typ].to; got.State != w {
					t.Errorf("Apply(%q, %q).State = %q; want %q", c.State, tc.typ, got.State, w)
				}
				if got.ArgumentsHash != testHash {
					t.Errorf("Apply(%q, %q).ArgumentsHash = %q; want %q", c.State, tc.typ, got.ArgumentsHash, testHash)
				}
				return
			}
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("Apply(%+v, %+v) error = %v; want %v", c, ev, err, tc.wantErr)
			}
			if diff := cmp.Diff(c, got); diff != "" {
				t.Errorf("refused Apply changed the call (-before +after):\n%s", diff)
			}
			if effects != nil {
				t.Errorf("refused Apply effects = %v; want nil", effects)
			}
		})
	}
}

// TestApplyFields checks what each event records on the call.
func TestApplyFields(t *testing.T) {
	t.Parallel()
	c, evs := build(t, pathTo(t, sm.StateApprovalPending))
	pending := c
	if !pending.PendingExpiresAt.Equal(evs[1].ExpiresAt) {
		t.Errorf("PendingExpiresAt = %v; want %v", pending.PendingExpiresAt, evs[1].ExpiresAt)
	}
	approve := validEvent(c, sm.EventApproved)
	approve.ApprovalID = "apr_7"
	approve.ExpiresAt = epoch.Add(time.Hour)
	c, _, err := sm.Apply(c, approve)
	if err != nil {
		t.Fatal(err)
	}
	exec := validEvent(c, sm.EventExecuting)
	exec.Attempt = 3
	exec.Reason = ""
	c, _, err = sm.Apply(c, exec)
	if err != nil {
		t.Fatal(err)
	}
	// A later event with a lower attempt, or none, keeps the highest.
	done := validEvent(c, sm.EventSucceeded)
	done.Attempt = 1
	c, _, err = sm.Apply(c, done)
	if err != nil {
		t.Fatal(err)
	}
	want := sm.Call{
		State:             sm.StateSucceeded,
		Seq:               5,
		ArgumentsHash:     testHash,
		RequestedAt:       evs[0].At,
		UpdatedAt:         done.At,
		ApprovalID:        "apr_7",
		ApprovalExpiresAt: epoch.Add(time.Hour),
		// Cleared by the approval: nothing is pending any more.
		PendingExpiresAt: time.Time{},
		Attempt:          3,
		Reason:           done.Reason,
	}
	if diff := cmp.Diff(want, c); diff != "" {
		t.Errorf("call after approved, executing, succeeded mismatch (-want +got):\n%s", diff)
	}
}

func TestSeq(t *testing.T) {
	t.Parallel()
	t.Run("duplicate", func(t *testing.T) {
		t.Parallel()
		for _, p := range testPaths() {
			c, evs := build(t, p)
			// Every event already applied, delivered again, and any other
			// event at an applied seq, is a duplicate.
			dups := slices.Clone(evs)
			for _, typ := range sm.EventTypes {
				ev := validEvent(c, typ)
				ev.Seq = c.Seq
				dups = append(dups, ev)
			}
			for _, ev := range dups {
				got, effects, err := sm.Apply(c, ev)
				if !errors.Is(err, sm.ErrDuplicateEvent) {
					t.Errorf("path %s: Apply(seq %d, %q at seq %d) error = %v; want %v", p.name, c.Seq, ev.Type, ev.Seq, err, sm.ErrDuplicateEvent)
				}
				if diff := cmp.Diff(c, got); diff != "" {
					t.Errorf("path %s: duplicate changed the call (-before +after):\n%s", p.name, diff)
				}
				if effects != nil {
					t.Errorf("path %s: duplicate effects = %v; want nil", p.name, effects)
				}
			}
		}
	})
	t.Run("gap", func(t *testing.T) {
		t.Parallel()
		for _, p := range testPaths() {
			c, _ := build(t, p)
			for _, skip := range []int64{2, 3, 100} {
				for _, typ := range sm.EventTypes {
					ev := validEvent(c, typ)
					ev.Seq = c.Seq + skip
					got, effects, err := sm.Apply(c, ev)
					if !errors.Is(err, sm.ErrSeqGap) {
						t.Errorf("path %s: Apply(seq %d, %q at seq %d) error = %v; want %v", p.name, c.Seq, typ, ev.Seq, err, sm.ErrSeqGap)
					}
					if diff := cmp.Diff(c, got); diff != "" {
						t.Errorf("path %s: gap changed the call (-before +after):\n%s", p.name, diff)
					}
					if effects != nil {
						t.Errorf("path %s: gap effects = %v; want nil", p.name, effects)
					}
				}
			}
		}
	})
	t.Run("not positive", func(t *testing.T) {
		t.Parallel()
		// The ledger writes refused submissions at seq 0 under the call's
		// key (ledger.Event.Refusal); they are never part of a call, so a
		// fold drops them like duplicates.
		for _, seq := range []int64{0, -1} {
			ev := validEvent(sm.Call{}, sm.EventRequested)
			ev.Seq = seq
			got, _, err := sm.Apply(sm.Call{}, ev)
			if !errors.Is(err, sm.ErrDuplicateEvent) {
				t.Errorf("Apply(empty, requested at seq %d) error = %v; want %v", seq, err, sm.ErrDuplicateEvent)
			}
			if diff := cmp.Diff(sm.Call{}, got); diff != "" {
				t.Errorf("Apply(empty, requested at seq %d) changed the call:\n%s", seq, diff)
			}
		}
	})
}

func TestFold(t *testing.T) {
	t.Parallel()
	for _, p := range testPaths() {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			want, evs := build(t, p)
			got, err := sm.Fold(evs)
			if err != nil {
				t.Fatalf("Fold(%s) error: %v", p.name, err)
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Fatalf("Fold(%s) mismatch (-want +got):\n%s", p.name, diff)
			}

			// At-least-once delivery: events come twice, or a consumer
			// restarts and replays from an older offset.
			var twice, replayed, refusal []sm.Event
			for i, ev := range evs {
				twice = append(twice, ev, ev)
				replayed = append(replayed, evs[:i+1]...)
				refusal = append(refusal, ev)
			}
			refused := validEvent(sm.Call{}, sm.EventDenied)
			refused.Seq = 0
			refusal = append([]sm.Event{refused}, append(refusal, refused)...)
			redelivered := map[string][]sm.Event{
				"each twice":            twice,
				"prefix replayed":       replayed,
				"all twice in a row":    append(slices.Clone(evs), evs...),
				"seq 0 refusals around": refusal,
			}
			for name, in := range redelivered {
				got, err := sm.Fold(in)
				if err != nil {
					t.Errorf("Fold(%s, %s) error: %v", p.name, name, err)
					continue
				}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("Fold(%s, %s) mismatch (-want +got):\n%s", p.name, name, diff)
				}
			}
		})
	}

	t.Run("empty", func(t *testing.T) {
		t.Parallel()
		got, err := sm.Fold(nil)
		if err != nil || got != (sm.Call{}) {
			t.Errorf("Fold(nil) = %+v, %v; want zero call, nil", got, err)
		}
	})

	_, evs := build(t, pathTo(t, sm.StateSucceeded))
	before, _ := build(t, path{name: "prefix", events: []sm.EventType{sm.EventRequested, sm.EventAuthorized}, want: sm.StateAuthorized})
	tests := []struct {
		name    string
		evs     []sm.Event
		wantErr error
	}{
		{name: "gap", evs: []sm.Event{evs[0], evs[1], evs[3]}, wantErr: sm.ErrSeqGap},
		{name: "invalid", evs: []sm.Event{evs[0], evs[1], validEvent(before, sm.EventSucceeded)}, wantErr: sm.ErrInvalidTransition},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := sm.Fold(tc.evs)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("Fold(%s) error = %v; want %v", tc.name, err, tc.wantErr)
			}
			// The call as it stood before the bad event.
			if diff := cmp.Diff(before, got); diff != "" {
				t.Errorf("Fold(%s) call mismatch (-want +got):\n%s", tc.name, diff)
			}
		})
	}
}

// TestApplyPure checks that Apply leaves its inputs alone, gives the same
// output for the same input, and hands out effects that are the caller's
// to edit.
func TestApplyPure(t *testing.T) {
	t.Parallel()
	want := wantEdges()
	for _, p := range testPaths() {
		for _, typ := range sm.EventTypes {
			c, _ := build(t, p)
			evs := []sm.Event{validEvent(c, typ)}
			// And a refused variant of each, to cover the error paths.
			bad := validEvent(c, typ)
			bad.ArgumentsHash, bad.Reason, bad.Attempt = otherHash, "", 0
			gap := validEvent(c, typ)
			gap.Seq += 5
			evs = append(evs, bad, gap)
			for _, ev := range evs {
				cBefore, evBefore := c, ev
				got1, eff1, err1 := sm.Apply(c, ev)
				if diff := cmp.Diff(cBefore, c); diff != "" {
					t.Errorf("%s/%s: Apply mutated its call (-before +after):\n%s", p.name, typ, diff)
				}
				if diff := cmp.Diff(evBefore, ev); diff != "" {
					t.Errorf("%s/%s: Apply mutated its event (-before +after):\n%s", p.name, typ, diff)
				}
				got2, eff2, err2 := sm.Apply(c, ev)
				if diff := cmp.Diff(got1, got2); diff != "" {
					t.Errorf("%s/%s: Apply twice gave different calls (-first +second):\n%s", p.name, typ, diff)
				}
				if diff := cmp.Diff(eff1, eff2); diff != "" {
					t.Errorf("%s/%s: Apply twice gave different effects (-first +second):\n%s", p.name, typ, diff)
				}
				if s1, s2 := sentinel(err1), sentinel(err2); s1 != s2 {
					t.Errorf("%s/%s: Apply twice gave errors %s then %s", p.name, typ, s1, s2)
				}
				// A caller that edits its effects must not edit the table
				// that every other call reads.
				for i := range eff1 {
					eff1[i] = "tampered"
				}
				if err1 == nil {
					_, eff3, _ := sm.Apply(c, ev)
					if diff := cmp.Diff(want[c.State][typ].effects, eff3, cmpopts.EquateEmpty()); diff != "" {
						t.Errorf("%s/%s: effects after the caller edited a previous result (-want +got):\n%s", p.name, typ, diff)
					}
				}
			}
		}
	}
}

func BenchmarkFold(b *testing.B) {
	evs := []sm.Event{
		{Type: sm.EventRequested, Seq: 1, At: epoch, ArgumentsHash: testHash},
		{Type: sm.EventAuthorized, Seq: 2, At: epoch.Add(time.Millisecond), ArgumentsHash: testHash},
		{Type: sm.EventExecuting, Seq: 3, At: epoch.Add(2 * time.Millisecond), ArgumentsHash: testHash, Attempt: 1},
		{Type: sm.EventSucceeded, Seq: 4, At: epoch.Add(3 * time.Millisecond), ArgumentsHash: testHash},
	}
	var twice []sm.Event
	for _, ev := range evs {
		twice = append(twice, ev, ev)
	}
	for _, bc := range []struct {
		name string
		evs  []sm.Event
	}{
		{"4_events", evs},
		{"4_events_each_twice", twice},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				c, err := sm.Fold(bc.evs)
				if err != nil || c.State != sm.StateSucceeded {
					b.Fatalf("Fold = %q, %v; want succeeded", c.State, err)
				}
			}
		})
	}
}

func TestTargetIsEveryEdgesTo(t *testing.T) {
	for _, tr := range sm.Transitions {
		got, ok := sm.Target(tr.On)
		if !ok || got != tr.To {
			t.Errorf("Target(%q) = %q, %v; the edge from %v leads to %q", tr.On, got, ok, tr.From, tr.To)
		}
	}
	if s, ok := sm.Target("no_such_event"); ok {
		t.Errorf("Target of an unknown event = %q, want none", s)
	}
}
