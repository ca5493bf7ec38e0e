package consistency

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// MaxExamples is how many examples Report.Examples gives per count.
const MaxExamples = 10

// Submitted is one call the load driver published to the request topic.
type Submitted struct {
	Key ledger.CallKey
	// At is when it was published (or, in an open loop, scheduled): the
	// start of its time to a terminal state.
	At time.Time
}

// Report is what Check found. The counts named in Failures must be 0; the
// others describe the run.
type Report struct {
	// Submitted counts the distinct keys submitted.
	Submitted int `json:"submitted"`
	// Terminal counts the submitted calls whose committed events fold to
	// a terminal state (succeeded, failed, compensated, denied, rejected,
	// expired).
	Terminal int `json:"terminal"`
	// Refused counts the submitted keys whose only events are refusals
	// (seq 0): the intake refused the envelope, visibly, and no call
	// exists.
	Refused int `json:"refused"`
	// Pending counts the submitted calls waiting, visibly, for an
	// approver (approval_pending at the end).
	Pending int `json:"approval_pending"`
	// Lost counts the submitted calls with no terminal state in the
	// committed log and none of the visible waits (refused, approval
	// pending, outcome unknown): no event at all, or stopped at requested,
	// authorized or executing (DESIGN I2).
	Lost int `json:"lost"`

	// Calls counts the call keys with at least one event of seq 1 and up
	// in the committed log, submitted or not (compensation calls, say).
	Calls int `json:"calls"`
	// Events counts the committed events read (Log.Events).
	Events int64 `json:"events"`
	// DuplicateEvents counts events dropped before folding because an
	// event with the same id was already at their (key, seq): the events
	// a processor re-appends after a crash left them out of the log.
	// Legal.
	DuplicateEvents int `json:"duplicate_events"`
	// ConflictingEvents counts the (key, seq) pairs that hold events with
	// different ids: two writers each appended their own step at one
	// seq, so the history depends on which one a reader keeps (the first
	// in log order is folded).
	ConflictingEvents int `json:"conflicting_events"`
	// IllegalTransitions counts the calls whose committed events, in seq
	// order with duplicates dropped, do not fold with statemachine.Apply:
	// an edge not in the table, a guard that refuses, or a seq gap (an
	// event missing from the committed log). A call is counted once, at
	// its first such event; the rest of its history is not folded.
	IllegalTransitions int `json:"illegal_transitions"`

	// AbortedRecords, AbortedVisible, HiddenRecords, UnstableRecords and
	// Undecodable are the Log's counts.
	AbortedRecords  int64 `json:"aborted_records"`
	AbortedVisible  int64 `json:"aborted_visible"`
	HiddenRecords   int64 `json:"hidden_records"`
	UnstableRecords int64 `json:"unstable_records"`
	Undecodable     int64 `json:"undecodable"`

	// Effects counts the new side effects in the witness: not replays,
	// not reads.
	Effects int `json:"effects"`
	// DuplicateEffects counts the (tenant, tool, key) with more than one
	// new side effect (DESIGN I1).
	DuplicateEffects int `json:"duplicate_effects"`
	// MissingEffects counts the calls that reached succeeded in the
	// committed log that the tool never saw: not one effect that is not
	// a replay (a read tool's call needs its read, a write tool's call its
	// new effect).
	MissingEffects int `json:"missing_effects"`
	// OrphanEffects counts the (tenant, tool, key) with a new side effect
	// whose call's final state is neither succeeded nor compensated (or
	// that has no call in the committed log), nor parked for a human: an
	// effect the ledger does not own up to.
	OrphanEffects int `json:"orphan_effects"`
	// ParkedWithEffect counts the (tenant, tool, key) with a new side
	// effect whose call the reconciler parked for a human (outcome
	// unknown, no status lookup could tell): the ledger says the effect
	// may have happened, and it did. Visible, not a failure.
	ParkedWithEffect int `json:"parked_with_effect"`
	// UnnamedCredentials counts the effects (reads and replays included)
	// whose request carried a credential (the jti the tool recorded) that
	// no committed event of its call names: a responder asking what that
	// jti touched would not find the call. Effects the tool recorded
	// without a jti (it verifies no credentials) are not counted.
	UnnamedCredentials int `json:"unnamed_credentials"`
	// CredentialEffects counts the effects (reads and replays included)
	// recorded with a jti: the ones UnnamedCredentials checks.
	CredentialEffects int `json:"credential_effects"`

	// StoreChecked counts the calls whose execution record CheckStore
	// compared with the log; StoreDisagreements those whose record says
	// another outcome than the log (or is missing). Only CheckStore sets
	// them.
	StoreChecked       int `json:"store_checked"`
	StoreDisagreements int `json:"store_disagreements"`

	// OutcomeUnknown counts the calls that passed through
	// outcome_unknown.
	OutcomeUnknown int `json:"outcome_unknown"`
	// Unresolved counts the calls still outcome_unknown at the end that
	// the reconciler has not parked for a human either.
	Unresolved int `json:"unresolved"`
	// Parked counts the calls still outcome_unknown at the end that the
	// reconciler parked for a human (their last event is parked): visible,
	// not a failure.
	Parked int `json:"parked"`

	// TimeToTerminalP50 and P99: from Submitted.At to the At of the
	// event that first put the call in a terminal state, over the
	// submitted calls that reached one (negative spans, from clock skew,
	// count as 0). Nearest rank.
	TimeToTerminalP50 time.Duration `json:"time_to_terminal_p50_ns"`
	TimeToTerminalP99 time.Duration `json:"time_to_terminal_p99_ns"`
	// TimeToResolveP50 and P99: from the outcome_unknown event's At to
	// the At of the event that took the call out of outcome_unknown
	// (succeeded, failed, compensated), over the calls resolved.
	TimeToResolveP50 time.Duration `json:"time_to_resolve_p50_ns"`
	TimeToResolveP99 time.Duration `json:"time_to_resolve_p99_ns"`

	// Examples name, per non-zero count of Failures (and parked), the
	// first MaxExamples of its calls in sorted order: "<tenant>/<key>"
	// with a detail, or "<partition>/<offset>" for the log's counts.
	Examples map[string][]string `json:"examples,omitempty"`
}

// Outcome is where one call's committed history ends.
type Outcome struct {
	// State is the state its events fold to ("" when the log has no
	// event of the call); Seq the last seq folded.
	State statemachine.State `json:"state"`
	Seq   int64              `json:"seq"`
	// Parked: outcome_unknown, handed to a human.
	Parked bool `json:"parked,omitempty"`
	// Refusals counts the intake's refusals of the key (seq 0 events).
	Refusals int `json:"refusals,omitempty"`
	// Illegal says why its events do not fold, if they do not.
	Illegal string `json:"illegal,omitempty"`
}

// Outcome folds key's committed events.
func (l *Log) Outcome(key ledger.CallKey) Outcome {
	c, ok := l.calls[key]
	if !ok {
		return Outcome{}
	}
	f := l.fold(c)
	return Outcome{State: f.state, Seq: f.seq, Parked: f.parked, Refusals: f.refusals, Illegal: f.illegal}
}

// row is one figure of a Report, as Failures and WriteTable show it.
type row struct {
	name  string
	value int64
	// zero: the figure must be 0.
	zero bool
}

// rows lists the counts in table order, under their JSON names.
func (r Report) rows() []row {
	return []row{
		{"submitted", int64(r.Submitted), false},
		{"terminal", int64(r.Terminal), false},
		{"refused", int64(r.Refused), false},
		{"approval_pending", int64(r.Pending), false},
		{"lost", int64(r.Lost), true},
		{"calls", int64(r.Calls), false},
		{"events", r.Events, false},
		{"duplicate_events", int64(r.DuplicateEvents), false},
		{"conflicting_events", int64(r.ConflictingEvents), true},
		{"illegal_transitions", int64(r.IllegalTransitions), true},
		{"aborted_records", r.AbortedRecords, false},
		{"aborted_visible", r.AbortedVisible, true},
		{"hidden_records", r.HiddenRecords, true},
		{"unstable_records", r.UnstableRecords, true},
		{"undecodable", r.Undecodable, true},
		{"effects", int64(r.Effects), false},
		{"duplicate_effects", int64(r.DuplicateEffects), true},
		{"missing_effects", int64(r.MissingEffects), true},
		{"orphan_effects", int64(r.OrphanEffects), true},
		{"outcome_unknown", int64(r.OutcomeUnknown), false},
		{"unresolved", int64(r.Unresolved), true},
		{"parked", int64(r.Parked), false},
		{"parked_with_effect", int64(r.ParkedWithEffect), false},
		{"credential_effects", int64(r.CredentialEffects), false},
		{"unnamed_credentials", int64(r.UnnamedCredentials), true},
		{"store_checked", int64(r.StoreChecked), false},
		{"store_disagreements", int64(r.StoreDisagreements), true},
	}
}

// Failures names every count that must be 0 and is not, with its value and
// up to three examples: "lost: 2 (t1/k1, t1/k7)". A clean run returns none.
func (r Report) Failures() []string {
	var out []string
	for _, w := range r.rows() {
		if !w.zero || w.value == 0 {
			continue
		}
		s := fmt.Sprintf("%s: %d", w.name, w.value)
		if ex := r.Examples[w.name]; len(ex) > 0 {
			s += " (" + strings.Join(ex[:min(3, len(ex))], ", ") + ")"
		}
		out = append(out, s)
	}
	return out
}

// WriteTable writes the figures as a table, the ones that must be 0 and
// are not marked FAIL.
func (r Report) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\tvalue\t")
	for _, x := range r.rows() {
		mark := ""
		switch {
		case x.zero && x.value != 0:
			mark = "FAIL (must be 0)"
		case x.zero:
			mark = "ok"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\n", x.name, x.value, mark)
	}
	for _, d := range []struct {
		name string
		d    time.Duration
	}{
		{"time_to_terminal_p50", r.TimeToTerminalP50},
		{"time_to_terminal_p99", r.TimeToTerminalP99},
		{"time_to_resolve_p50", r.TimeToResolveP50},
		{"time_to_resolve_p99", r.TimeToResolveP99},
	} {
		fmt.Fprintf(tw, "%s\t%s\t\n", d.name, d.d.Round(time.Microsecond))
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("consistency: write table: %w", err)
	}
	return nil
}

// folded is one call's committed history, folded.
type folded struct {
	state    statemachine.State
	seq      int64
	refusals int
	// succeeded: the call reached succeeded (it may have been compensated
	// since). unknown: it reached outcome_unknown. parked: its last event
	// parked it.
	succeeded, unknown, parked bool
	// terminalAt is when it first reached a terminal state, unknownAt
	// when it reached outcome_unknown, resolvedAt when it left it.
	terminalAt, unknownAt, resolvedAt time.Time
	// illegal says why its first event that does not fold does not.
	illegal string
	// conflicts counts its seqs holding events with different ids, at
	// conflictSeq the first; duplicates its events dropped as re-appends.
	conflicts, duplicates int
	conflictSeq           int64
}

// fold folds c's events (sorted by seq, log order within one seq).
func (l *Log) fold(c *callLog) folded {
	f := folded{refusals: c.refusals}
	var (
		sc    statemachine.Call
		first *event // the first event at the current seq
		clash bool   // the current seq holds a second id
	)
	for i := range c.events {
		e := &c.events[i]
		if first != nil && e.seq == first.seq {
			switch {
			case e.id == first.id:
				f.duplicates++
			case !clash:
				clash = true
				if f.conflicts == 0 {
					f.conflictSeq = e.seq
				}
				f.conflicts++
			}
			continue
		}
		first, clash = e, false
		if f.illegal != "" {
			continue // the history broke: count conflicts, fold no more
		}
		ev := l.transition(e)
		next, _, err := statemachine.Apply(sc, ev)
		if err != nil {
			f.illegal = fmt.Sprintf("seq %d %s: %v", ev.Seq, ev.Type, err)
			continue
		}
		if sc.State == statemachine.StateOutcomeUnknown && next.State != statemachine.StateOutcomeUnknown && f.resolvedAt.IsZero() {
			f.resolvedAt = ev.At
		}
		switch next.State {
		case statemachine.StateSucceeded:
			f.succeeded = true
		case statemachine.StateOutcomeUnknown:
			if !f.unknown {
				f.unknown, f.unknownAt = true, ev.At
			}
		}
		if next.State.Terminal() && f.terminalAt.IsZero() {
			f.terminalAt = ev.At
		}
		f.parked = ev.Type == statemachine.EventParked
		sc = next
	}
	f.state, f.seq = sc.State, sc.Seq
	return f
}

// effectGroup is what duplicates and orphans are counted by: one tool's
// effects for one call.
type effectGroup struct {
	call ledger.CallKey
	tool string
}

// effectCall is the call an effect belongs to. The executor sends the call
// key ("<tenant>/<key>") as the Idempotency-Key and the tenant in its own
// header; a bare key with a tenant is taken as the call's own key.
func effectCall(ef *demobackend.Effect) ledger.CallKey {
	if ef.TenantID != "" {
		key, _ := strings.CutPrefix(ef.IdempotencyKey, ef.TenantID+"/")
		return ledger.CallKey{TenantID: ef.TenantID, IdempotencyKey: key}
	}
	if k, err := ledger.ParseCallKey(ef.IdempotencyKey); err == nil {
		return k
	}
	return ledger.CallKey{IdempotencyKey: ef.IdempotencyKey}
}

// Check compares the committed log with what was submitted and with the
// effects the tool backend applied (its witness, from every backend
// process). Every call in the log is checked, submitted or not: the log
// and the witness should be those of one run. It only reads log, so
// several Checks may share one.
func Check(log *Log, submitted []Submitted, effects []demobackend.Effect) Report {
	r := Report{
		Events:          log.Events,
		AbortedRecords:  log.AbortedRecords,
		AbortedVisible:  log.AbortedVisible,
		HiddenRecords:   log.HiddenRecords,
		UnstableRecords: log.UnstableRecords,
		Undecodable:     log.Undecodable,
	}
	ex := make(map[string]*samples)
	note := func(name, s string) {
		x := ex[name]
		if x == nil {
			x = &samples{}
			ex[name] = x
		}
		x.add(s)
	}
	for _, x := range []struct {
		name string
		s    *samples
	}{{"aborted_visible", &log.abortedEx}, {"hidden_records", &log.hiddenEx}, {"undecodable", &log.undecodableEx}} {
		if len(x.s.xs) > 0 {
			ex[x.name] = x.s
		}
	}

	calls := make(map[ledger.CallKey]folded, len(log.calls))
	var toResolve []time.Duration
	for k, c := range log.calls {
		f := log.fold(c)
		calls[k] = f
		if len(c.events) > 0 {
			r.Calls++
		}
		r.DuplicateEvents += f.duplicates
		if f.conflicts > 0 {
			r.ConflictingEvents += f.conflicts
			note("conflicting_events", fmt.Sprintf("%s seq %d", k, f.conflictSeq))
		}
		if f.illegal != "" {
			r.IllegalTransitions++
			note("illegal_transitions", k.String()+" "+f.illegal)
		}
		if f.unknown {
			r.OutcomeUnknown++
		}
		if f.state == statemachine.StateOutcomeUnknown {
			if f.parked {
				r.Parked++
				note("parked", k.String())
			} else {
				r.Unresolved++
				note("unresolved", k.String())
			}
		}
		if !f.resolvedAt.IsZero() {
			toResolve = append(toResolve, max(0, f.resolvedAt.Sub(f.unknownAt)))
		}
	}

	subs := make(map[ledger.CallKey]time.Time, len(submitted))
	for _, s := range submitted {
		if at, ok := subs[s.Key]; !ok || s.At.Before(at) {
			subs[s.Key] = s.At
		}
	}
	r.Submitted = len(subs)
	var toTerminal []time.Duration
	for k, at := range subs {
		f, ok := calls[k]
		switch {
		case ok && f.state.Terminal():
			r.Terminal++
			toTerminal = append(toTerminal, max(0, f.terminalAt.Sub(at)))
		case ok && f.state == statemachine.StateOutcomeUnknown:
			// Unresolved or parked, counted above.
		case ok && f.state == statemachine.StateApprovalPending:
			r.Pending++
		case ok && f.seq == 0 && f.refusals > 0:
			r.Refused++
		default:
			r.Lost++
			state := "no event"
			if ok && f.seq > 0 {
				state = string(f.state)
			}
			note("lost", k.String()+" "+state)
		}
	}

	applied := make(map[effectGroup]int)
	seen := make(map[ledger.CallKey]bool) // calls with an effect that is not a replay
	for i := range effects {
		ef := &effects[i]
		if ef.JTI != "" {
			r.CredentialEffects++
			if k := effectCall(ef); !log.names(k, ef.JTI) {
				r.UnnamedCredentials++
				note("unnamed_credentials", fmt.Sprintf("%s:%s jti %s", ef.Tool, k, ef.JTI))
			}
		}
		if ef.Replay {
			continue
		}
		k := effectCall(ef)
		seen[k] = true
		if ef.Read {
			continue
		}
		r.Effects++
		applied[effectGroup{call: k, tool: ef.Tool}]++
	}
	for g, n := range applied {
		if n > 1 {
			r.DuplicateEffects++
			note("duplicate_effects", fmt.Sprintf("%s:%s %d effects", g.tool, g.call, n))
		}
		f, ok := calls[g.call]
		if f.state == statemachine.StateOutcomeUnknown && f.parked {
			// The ledger owns up to it: the call waits, visibly, for a
			// human to say whether the effect happened.
			r.ParkedWithEffect++
			note("parked_with_effect", fmt.Sprintf("%s:%s", g.tool, g.call))
			continue
		}
		if f.state != statemachine.StateSucceeded && f.state != statemachine.StateCompensated {
			r.OrphanEffects++
			state := "not in the log"
			if ok && f.seq > 0 {
				state = string(f.state)
			}
			note("orphan_effects", fmt.Sprintf("%s:%s %s", g.tool, g.call, state))
		}
	}
	for k, f := range calls {
		if f.succeeded && !seen[k] {
			r.MissingEffects++
			note("missing_effects", k.String())
		}
	}

	slices.Sort(toTerminal)
	slices.Sort(toResolve)
	r.TimeToTerminalP50, r.TimeToTerminalP99 = quantile(toTerminal, 0.50), quantile(toTerminal, 0.99)
	r.TimeToResolveP50, r.TimeToResolveP99 = quantile(toResolve, 0.50), quantile(toResolve, 0.99)
	if len(ex) > 0 {
		r.Examples = make(map[string][]string, len(ex))
		for name, x := range ex {
			r.Examples[name] = slices.Clone(x.xs)
		}
	}
	return r
}

// quantile is the nearest-rank q-quantile of sorted ds; 0 for none.
func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(ds)))) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}

// samples keeps the MaxExamples smallest distinct strings added: examples
// that do not depend on map order, in bounded memory however many calls
// fail.
type samples struct{ xs []string }

func (s *samples) add(x string) {
	i, found := slices.BinarySearch(s.xs, x)
	if found || i >= MaxExamples {
		return
	}
	s.xs = slices.Insert(s.xs, i, x)
	if len(s.xs) > MaxExamples {
		s.xs = s.xs[:MaxExamples]
	}
}

// sortEvents puts every call's events in seq order, log order within one
// seq, as fold reads them.
func (l *Log) sortEvents() {
	for _, c := range l.calls {
		slices.SortStableFunc(c.events, func(a, b event) int { return cmp.Compare(a.seq, b.seq) })
	}
}
