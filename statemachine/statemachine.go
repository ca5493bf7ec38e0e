// Package statemachine is the single place that knows which event may follow
// which in the life of a tool call. It is pure: no I/O, no clock, no logger.
// Time comes from the events themselves, so folding the same events always
// gives the same call.
package statemachine

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// State is where a call stands after the events applied so far.
type State string

// The states of DESIGN §4. StateNone is the state of a call no event has
// touched yet.
const (
	StateNone            State = ""
	StateRequested       State = "requested"
	StateApprovalPending State = "approval_pending"
	StateAuthorized      State = "authorized"
	StateExecuting       State = "executing"
	StateSucceeded       State = "succeeded"
	StateFailed          State = "failed"
	StateOutcomeUnknown  State = "outcome_unknown"
	StateCompensated     State = "compensated"
	StateDenied          State = "denied"
	StateRejected        State = "rejected"
	StateExpired         State = "expired"
)

// States lists every state, StateNone first.
var States = []State{
	StateNone, StateRequested, StateApprovalPending, StateAuthorized,
	StateExecuting, StateSucceeded, StateFailed, StateOutcomeUnknown,
	StateCompensated, StateDenied, StateRejected, StateExpired,
}

// Terminal reports whether no event may follow s, except that an operator
// may still compensate a succeeded call (see Transitions).
func (s State) Terminal() bool {
	switch s {
	case StateSucceeded, StateFailed, StateCompensated, StateDenied, StateRejected, StateExpired:
		return true
	}
	return false
}

// Settled reports whether the call is where a caller stops waiting for it:
// it is terminal, or it waits visibly, for a human's approval, or with its
// outcome unknown, which the reconciler may yet resolve by itself (a
// status lookup, an undo a policy asks for) or a human settles.
func (s State) Settled() bool {
	return s.Terminal() || s == StateApprovalPending || s == StateOutcomeUnknown
}

// EventType names a fact about a call.
type EventType string

// The event types of DESIGN §4.
const (
	EventRequested       EventType = "requested"
	EventAuthorized      EventType = "authorized"
	EventApprovalPending EventType = "approval_pending"
	EventApproved        EventType = "approved"
	EventRejected        EventType = "rejected"
	EventExpired         EventType = "expired"
	EventDenied          EventType = "denied"
	EventExecuting       EventType = "executing"
	EventSucceeded       EventType = "succeeded"
	EventFailed          EventType = "failed"
	EventOutcomeUnknown  EventType = "outcome_unknown"
	EventCompensated     EventType = "compensated"
	// EventParked records that the reconciler could not resolve an
	// unknown outcome and a human must: the call stays outcome_unknown,
	// with the reason.
	EventParked EventType = "parked"
)

// EventTypes lists every event type.
var EventTypes = []EventType{
	EventRequested, EventAuthorized, EventApprovalPending, EventApproved,
	EventRejected, EventExpired, EventDenied, EventExecuting, EventSucceeded,
	EventFailed, EventOutcomeUnknown, EventCompensated, EventParked,
}

// Errors that callers branch on.
var (
	// ErrInvalidTransition: the event may not follow the call's state, or a
	// guard on the edge refused it.
	ErrInvalidTransition = errors.New("invalid transition")
	// ErrDuplicateEvent: the event's seq was already applied. Events are
	// appended at least once, so consumers drop these.
	ErrDuplicateEvent = errors.New("duplicate event")
	// ErrSeqGap: the event's seq skips ahead of the call; an event is
	// missing.
	ErrSeqGap = errors.New("seq gap")
)

// Event is the part of a ledger event that the state machine reads.
type Event struct {
	Type          EventType
	Seq           int64
	At            time.Time
	ArgumentsHash string
	ApprovalID    string
	ExpiresAt     time.Time
	Attempt       int
	Reason        string
}

// Call is the folded state of one call.
type Call struct {
	State         State
	Seq           int64
	ArgumentsHash string
	RequestedAt   time.Time
	UpdatedAt     time.Time
	// ApprovalID and ApprovalExpiresAt are set while an approval binds the
	// call (from approved on).
	ApprovalID        string
	ApprovalExpiresAt time.Time
	// PendingExpiresAt is when a pending approval lapses.
	PendingExpiresAt time.Time
	Attempt          int
	Reason           string
}

// Effect is work a processor must carry out because a call reached a state.
// Effects are data so that their keys exist before any I/O happens.
type Effect string

// The effects edges ask for.
const (
	EffectExecute       Effect = "execute"        // run the tool exactly once
	EffectAwaitApproval Effect = "await_approval" // hold for a human; expire at PendingExpiresAt
	EffectReconcile     Effect = "reconcile"      // find out what the tool did
	EffectNotify        Effect = "notify"         // the call is settled; tell whoever waits
)

// Transition is one edge: from any of From, an event of type On leads to To
// when Guard (if any) accepts.
type Transition struct {
	From    []State
	On      EventType
	To      State
	Guard   func(c Call, ev Event) error
	Effects []Effect
}

// Transitions is the whole lifecycle, one entry per edge. Nothing else in the
// ledger encodes what may follow what.
var Transitions = []Transition{
	{From: []State{StateNone}, On: EventRequested, To: StateRequested, Guard: needHash},
	{From: []State{StateRequested}, On: EventAuthorized, To: StateAuthorized, Effects: []Effect{EffectExecute}},
	{From: []State{StateRequested}, On: EventApprovalPending, To: StateApprovalPending, Guard: needExpiry, Effects: []Effect{EffectAwaitApproval}},
	{From: []State{StateRequested, StateAuthorized}, On: EventDenied, To: StateDenied, Guard: needReason, Effects: []Effect{EffectNotify}},
	{From: []State{StateApprovalPending}, On: EventApproved, To: StateAuthorized, Guard: approvalBinds, Effects: []Effect{EffectExecute}},
	{From: []State{StateApprovalPending}, On: EventRejected, To: StateRejected, Guard: needReason, Effects: []Effect{EffectNotify}},
	{From: []State{StateApprovalPending}, On: EventExpired, To: StateExpired, Guard: pendingLapsed, Effects: []Effect{EffectNotify}},
	{From: []State{StateAuthorized}, On: EventExpired, To: StateExpired, Guard: needReason, Effects: []Effect{EffectNotify}},
	{From: []State{StateAuthorized}, On: EventExecuting, To: StateExecuting, Guard: needAttempt},
	{From: []State{StateExecuting, StateOutcomeUnknown}, On: EventSucceeded, To: StateSucceeded, Effects: []Effect{EffectNotify}},
	{From: []State{StateExecuting, StateOutcomeUnknown}, On: EventFailed, To: StateFailed, Guard: needReason, Effects: []Effect{EffectNotify}},
	{From: []State{StateExecuting}, On: EventOutcomeUnknown, To: StateOutcomeUnknown, Guard: needReason, Effects: []Effect{EffectReconcile}},
	{From: []State{StateOutcomeUnknown, StateSucceeded}, On: EventCompensated, To: StateCompensated, Effects: []Effect{EffectNotify}},
	{From: []State{StateOutcomeUnknown}, On: EventParked, To: StateOutcomeUnknown, Guard: needReason, Effects: []Effect{EffectNotify}},
}

// index maps (from, on) to its edge; built once from Transitions.
var index = func() map[State]map[EventType]*Transition {
	m := make(map[State]map[EventType]*Transition)
	for i := range Transitions {
		t := &Transitions[i]
		for _, from := range t.From {
			if m[from] == nil {
				m[from] = make(map[EventType]*Transition)
			}
			if m[from][t.On] != nil {
				panic(fmt.Sprintf("statemachine: two edges from %q on %q", from, t.On))
			}
			m[from][t.On] = t
		}
	}
	return m
}()

// Lookup returns the edge from s on t, or nil if there is none.
func Lookup(s State, t EventType) *Transition {
	return index[s][t]
}

// Apply returns the call after ev, and the effects the edge asks for. It
// never mutates c. An event whose seq was already applied wraps
// ErrDuplicateEvent; a seq that skips ahead wraps ErrSeqGap; an edge that is
// not in Transitions, or whose guard refuses, wraps ErrInvalidTransition.
//
// The effects are the caller's own copy: editing them does not edit
// Transitions.
func Apply(c Call, ev Event) (Call, []Effect, error) {
	next, t, err := apply(c, ev)
	if err != nil {
		return c, nil, err
	}
	return next, slices.Clone(t.Effects), nil
}

// apply is Apply without copying the effects; it returns the edge taken.
// Fold, which discards effects, uses it so that replay does not allocate.
func apply(c Call, ev Event) (Call, *Transition, error) {
	switch {
	case ev.Seq <= c.Seq:
		return c, nil, fmt.Errorf("%w: seq %d already applied (at %d)", ErrDuplicateEvent, ev.Seq, c.Seq)
	case ev.Seq != c.Seq+1:
		return c, nil, fmt.Errorf("%w: seq %d after %d", ErrSeqGap, ev.Seq, c.Seq)
	}
	t := Lookup(c.State, ev.Type)
	if t == nil {
		return c, nil, fmt.Errorf("%w from %q on %q", ErrInvalidTransition, c.State, ev.Type)
	}
	if c.State != StateNone && ev.ArgumentsHash != "" && ev.ArgumentsHash != c.ArgumentsHash {
		return c, nil, fmt.Errorf("%w from %q on %q: arguments hash changed", ErrInvalidTransition, c.State, ev.Type)
	}
	if t.Guard != nil {
		if err := t.Guard(c, ev); err != nil {
			return c, nil, fmt.Errorf("%w from %q on %q: %v", ErrInvalidTransition, c.State, ev.Type, err)
		}
	}
	next := c
	next.State = t.To
	next.Seq = ev.Seq
	next.UpdatedAt = ev.At
	// The reason is the last transition's: a call that succeeded after an
	// unknown outcome no longer carries the unknown outcome's reason.
	next.Reason = ev.Reason
	if ev.Attempt > next.Attempt {
		next.Attempt = ev.Attempt
	}
	switch ev.Type {
	case EventRequested:
		next.ArgumentsHash = ev.ArgumentsHash
		next.RequestedAt = ev.At
	case EventApprovalPending:
		next.PendingExpiresAt = ev.ExpiresAt
	case EventApproved:
		next.ApprovalID = ev.ApprovalID
		next.ApprovalExpiresAt = ev.ExpiresAt
		next.PendingExpiresAt = time.Time{}
	}
	return next, t, nil
}

// Fold applies evs in order to an empty call, dropping duplicates.
func Fold(evs []Event) (Call, error) {
	var c Call
	for _, ev := range evs {
		next, _, err := apply(c, ev)
		if errors.Is(err, ErrDuplicateEvent) {
			continue
		}
		if err != nil {
			return c, err
		}
		c = next
	}
	return c, nil
}

func needHash(_ Call, ev Event) error {
	if ev.ArgumentsHash == "" {
		return errors.New("requested without arguments hash")
	}
	if ev.Seq != 1 {
		return fmt.Errorf("requested at seq %d", ev.Seq)
	}
	return nil
}

func needReason(_ Call, ev Event) error {
	if ev.Reason == "" {
		return errors.New("no reason given")
	}
	return nil
}

func needExpiry(_ Call, ev Event) error {
	if ev.ExpiresAt.IsZero() {
		return errors.New("approval without expiry")
	}
	return nil
}

func needAttempt(_ Call, ev Event) error {
	if ev.Attempt < 1 {
		return errors.New("executing without attempt number")
	}
	return nil
}

// approvalBinds enforces I4 at the log level: the approval names the exact
// arguments hash the call was requested with, and it came before the
// pending approval lapsed.
func approvalBinds(c Call, ev Event) error {
	switch {
	case ev.ApprovalID == "":
		return errors.New("approval without id")
	case ev.ExpiresAt.IsZero():
		// I4: an approval that never expires is not an approval.
		return errors.New("approval without expiry")
	case ev.ArgumentsHash != c.ArgumentsHash:
		return errors.New("approval bound to other arguments")
	case !c.PendingExpiresAt.IsZero() && !ev.At.Before(c.PendingExpiresAt):
		return errors.New("approval after expiry")
	}
	return nil
}

// pendingLapsed: a pending approval expires only once its time is up.
func pendingLapsed(c Call, ev Event) error {
	if ev.At.Before(c.PendingExpiresAt) {
		return errors.New("expired before expires_at")
	}
	return nil
}

// targets maps each event type to the state every edge on it leads to.
var targets = func() map[EventType]State {
	m := make(map[EventType]State)
	for _, t := range Transitions {
		if to, ok := m[t.On]; ok && to != t.To {
			panic(fmt.Sprintf("statemachine: %q leads to both %q and %q", t.On, to, t.To))
		}
		m[t.On] = t.To
	}
	return m
}()

// Target returns the state a call is in after an event of type t, whatever
// state it came from: every edge on one event type leads to one state. A
// projection uses it to know a call's state from its latest event alone.
func Target(t EventType) (State, bool) {
	s, ok := targets[t]
	return s, ok
}
