// Package projectionstest holds what every projection is tested against:
// a generator of realistic event logs, an oracle that answers the
// projections' questions straight from a log, and the contract suite (Run)
// that holds a projection's answers to the oracle's.
//
// The oracle is written apart from the projections on purpose: it reads
// the rules in projections' package doc, not their code, so that a
// projection and its test cannot share a mistake.
package projectionstest

import (
	"cmp"
	"slices"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Oracle answers the projections' questions from a log by brute force.
type Oracle struct {
	// calls holds each call's events, deduplicated by event id, in seq
	// order; refusals holds the refused submissions under each key.
	calls    map[ledger.CallKey][]ledger.Event
	refusals map[ledger.CallKey][]ledger.Event
}

// NewOracle reads a log: every event, in any order, duplicates included.
func NewOracle(log []ledger.Event) *Oracle {
	o := &Oracle{calls: map[ledger.CallKey][]ledger.Event{}, refusals: map[ledger.CallKey][]ledger.Event{}}
	seen := map[string]bool{}
	for _, e := range log {
		if seen[e.EventID] {
			continue
		}
		seen[e.EventID] = true
		if e.Seq == 0 {
			o.refusals[e.Key()] = append(o.refusals[e.Key()], e)
			continue
		}
		o.calls[e.Key()] = append(o.calls[e.Key()], e)
	}
	for _, evs := range o.calls {
		slices.SortFunc(evs, func(a, b ledger.Event) int { return cmp.Compare(a.Seq, b.Seq) })
	}
	return o
}

// Keys returns every call key the log holds, refusals' keys included.
func (o *Oracle) Keys() []ledger.CallKey {
	var keys []ledger.CallKey
	for k := range o.calls {
		keys = append(keys, k)
	}
	for k := range o.refusals {
		if _, ok := o.calls[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, func(a, b ledger.CallKey) int { return cmp.Compare(a.String(), b.String()) })
	return keys
}

// Events returns the call's events in seq order.
func (o *Oracle) Events(key ledger.CallKey) []ledger.Event { return o.calls[key] }

// Trace is what Queries.Trace must return, or nil for ErrNotFound.
func (o *Oracle) Trace(key ledger.CallKey) []ledger.Event {
	refused := slices.Clone(o.refusals[key])
	slices.SortFunc(refused, projections.CompareRefusals)
	out := append(projections.KeepRefusals(refused), o.calls[key]...)
	if len(out) == 0 {
		return nil
	}
	return out
}

// latest is the call as its highest-seq event of a type the state machine
// knows shows it: an event of an unknown type does not move a call (the
// package doc of projections). False when no event is of a known type:
// such a call is in no answer but its trace.
func latest(evs []ledger.Event) (projections.Call, bool) {
	i := len(evs) - 1
	for i >= 0 {
		if _, ok := statemachine.Target(evs[i].Type); ok {
			break
		}
		i--
	}
	if i < 0 {
		return projections.Call{}, false
	}
	last := evs[i]
	state, _ := statemachine.Target(last.Type)
	return projections.Call{
		TenantID: last.TenantID, IdempotencyKey: last.IdempotencyKey, CallID: last.CallID,
		Tool: last.Tool, ToolVersion: last.ToolVersion, ToolDigest: last.ToolDigest, AgentID: last.AgentID, UserID: last.UserID,
		Resource: last.Resource, TraceID: last.TraceID,
		State: state, LastEvent: last.Type, Seq: last.Seq, UpdatedAt: last.At.UTC(),
		PolicyVersion: last.PolicyVersion, Approver: last.Approver, ApprovalID: last.ApprovalID,
		JTI: last.JTI, CredentialFamily: last.CredentialFamily, Reason: last.Reason, ErrorCode: last.ErrorCode,
	}, true
}

// stateNow is the state of the call with events evs now.
func stateNow(evs []ledger.Event) statemachine.State {
	c, _ := latest(evs)
	return c.State
}

// inWindow compares in whole seconds, as the package doc says.
func inWindow(f projections.Filter, t time.Time) bool {
	s := t.Unix()
	if !f.Since.IsZero() && s < f.Since.Unix() {
		return false
	}
	return f.Until.IsZero() || s < f.Until.Unix()
}

// narrows reports whether e is of f's tenant and tool, where f names them.
func narrows(f projections.Filter, e ledger.Event) bool {
	return (f.Tenant == "" || e.TenantID == f.Tenant) && (f.Tool == "" || e.Tool == f.Tool)
}

// matches reports whether the call with events evs is one f selects: by
// its references (or its requested event), then by its state now.
func matches(f projections.Filter, evs []ledger.Event) bool {
	c, ok := latest(evs)
	if !ok || f.State != "" && c.State != f.State {
		return false
	}
	return referenced(f, evs)
}

// referenced reports whether the call with events evs carries every
// reference f names in the window, or with none its requested event.
func referenced(f projections.Filter, evs []ledger.Event) bool {
	type ref struct {
		want  string
		carry func(e ledger.Event) bool
	}
	refs := []ref{
		{f.JTI, func(e ledger.Event) bool { return e.JTI == f.JTI }},
		{f.CredentialFamily, func(e ledger.Event) bool { return e.NamesFamily(f.CredentialFamily) }},
		{f.PolicyVersion, func(e ledger.Event) bool {
			policyDecision := e.Decision == "allow" || e.Decision == "deny" || e.Decision == "require_approval"
			// A version asked by its label alone matches label@hash.
			sameVersion := e.PolicyVersion == f.PolicyVersion ||
				(!strings.Contains(f.PolicyVersion, "@") && strings.HasPrefix(e.PolicyVersion, f.PolicyVersion+"@"))
			return policyDecision && sameVersion && (f.Decision == "" || e.Decision == f.Decision)
		}},
		{f.Role, func(e ledger.Event) bool {
			policyDecision := e.Decision == "allow" || e.Decision == "deny" || e.Decision == "require_approval"
			return policyDecision && e.PolicyVersion != "" && slices.Contains(e.Roles, f.Role) && (f.Decision == "" || e.Decision == f.Decision)
		}},
		{f.Approver, func(e ledger.Event) bool { return e.Approver == f.Approver }},
		{f.ApprovalID, func(e ledger.Event) bool { return e.ApprovalID == f.ApprovalID }},
		{f.CallID, func(e ledger.Event) bool { return e.CallID == f.CallID }},
		// The definition a call was admitted under: its requested event,
		// not the later ones that name it too.
		{f.ToolDigest, func(e ledger.Event) bool {
			return e.Type == statemachine.EventRequested && e.Seq == 1 && e.ToolDigest == f.ToolDigest
		}},
		{f.TraceID, func(e ledger.Event) bool { return e.TraceID == f.TraceID }},
	}
	named := 0
	for _, r := range refs {
		if r.want == "" {
			continue
		}
		named++
		if !slices.ContainsFunc(evs, func(e ledger.Event) bool { return r.carry(e) && narrows(f, e) && inWindow(f, e.At) }) {
			return false
		}
	}
	if named > 0 {
		return true
	}
	return slices.ContainsFunc(evs, func(e ledger.Event) bool {
		return e.Seq == 1 && e.Type == statemachine.EventRequested && narrows(f, e) && inWindow(f, e.At)
	})
}

// BlastRadius is what Queries.BlastRadius must return for f, which must
// already be normalised (Filter.Check).
func (o *Oracle) BlastRadius(f projections.Filter) projections.BlastRadius {
	var calls []projections.Call
	for _, evs := range o.calls {
		if matches(f, evs) {
			c, _ := latest(evs)
			calls = append(calls, c)
		}
	}
	slices.SortFunc(calls, func(a, b projections.Call) int {
		if c := b.UpdatedAt.Compare(a.UpdatedAt); c != 0 {
			return c
		}
		if c := cmp.Compare(a.TenantID, b.TenantID); c != 0 {
			return c
		}
		return cmp.Compare(a.IdempotencyKey, b.IdempotencyKey)
	})
	br := projections.BlastRadius{Filter: f, Total: len(calls)}
	counts := map[string]map[string]int{"tenant": {}, "state": {}, "tool": {}, "resource": {}}
	for _, c := range calls {
		counts["tenant"][c.TenantID]++
		counts["state"][string(c.State)]++
		counts["tool"][c.Tool]++
		counts["resource"][c.Resource]++
	}
	// Each count lists its MaxCounts largest values; Distinct says how
	// many it has.
	sorted := func(m map[string]int) []projections.Count {
		out := []projections.Count{}
		for v, n := range m {
			out = append(out, projections.Count{Value: v, Calls: n})
		}
		slices.SortFunc(out, func(a, b projections.Count) int {
			if a.Calls != b.Calls {
				return cmp.Compare(b.Calls, a.Calls)
			}
			return cmp.Compare(a.Value, b.Value)
		})
		if len(out) > projections.MaxCounts {
			out = out[:projections.MaxCounts]
		}
		return out
	}
	br.ByTenant, br.ByState = sorted(counts["tenant"]), sorted(counts["state"])
	br.ByTool, br.ByResource = sorted(counts["tool"]), sorted(counts["resource"])
	br.Distinct = projections.Distinct{
		Tenants: len(counts["tenant"]), States: len(counts["state"]),
		Tools: len(counts["tool"]), Resources: len(counts["resource"]),
	}
	if len(calls) > f.Limit {
		calls, br.Truncated = calls[:f.Limit], true
	}
	br.Calls = calls
	return br
}

// Outcomes is what Queries.Outcomes must return for a normalised f.
func (o *Oracle) Outcomes(f projections.Filter, bucket time.Duration) []projections.OutcomeCount {
	type cell struct {
		bucket int64
		tool   string
		state  statemachine.State
	}
	seen := map[cell]map[ledger.CallKey]bool{}
	n := int64(bucket / time.Second)
	for key, evs := range o.calls {
		for _, e := range evs {
			if !slices.Contains(projections.OutcomeEvents, e.Type) || !narrows(f, e) || !inWindow(f, e.At) {
				continue
			}
			state, _ := statemachine.Target(e.Type)
			s := e.At.Unix()
			c := cell{s - s%n, e.Tool, state}
			if seen[c] == nil {
				seen[c] = map[ledger.CallKey]bool{}
			}
			seen[c][key] = true
		}
	}
	out := []projections.OutcomeCount{}
	for c, keys := range seen {
		out = append(out, projections.OutcomeCount{Bucket: time.Unix(c.bucket, 0).UTC(), Tool: c.tool, State: c.state, Calls: len(keys)})
	}
	slices.SortFunc(out, func(a, b projections.OutcomeCount) int {
		if c := a.Bucket.Compare(b.Bucket); c != 0 {
			return c
		}
		if c := cmp.Compare(a.Tool, b.Tool); c != 0 {
			return c
		}
		return cmp.Compare(a.State, b.State)
	})
	return out
}

// Unresolved is what Queries.Unresolved must return for a normalised f.
func (o *Oracle) Unresolved(f projections.Filter) []projections.Call {
	out := []projections.Call{}
	for _, evs := range o.calls {
		c, ok := latest(evs)
		if !ok || c.State != statemachine.StateOutcomeUnknown && c.State != statemachine.StateApprovalPending {
			continue
		}
		if (f.Tenant != "" && c.TenantID != f.Tenant) || (f.Tool != "" && c.Tool != f.Tool) {
			continue
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b projections.Call) int {
		if c := a.UpdatedAt.Compare(b.UpdatedAt); c != 0 {
			return c
		}
		if c := cmp.Compare(a.TenantID, b.TenantID); c != 0 {
			return c
		}
		return cmp.Compare(a.IdempotencyKey, b.IdempotencyKey)
	})
	if len(out) > f.Limit {
		out = out[:f.Limit]
	}
	return out
}
