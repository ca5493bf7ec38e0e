// Package projections holds the read side of the ledger: views built by
// folding the events and control topics, which can always be rebuilt from
// them. This package defines what every projection answers and how:
//
//   - Sink is what the projector (package projector) writes batches of
//     committed records to. Writing the same batch twice changes no answer:
//     every projection deduplicates on the event's id.
//   - Queries is what responders ask: a call's trace, the blast radius of a
//     credential, tool, policy version, caller's role, approver, call or
//     trace (narrowed by the calls' state if asked), outcome counts by
//     tool and time bucket, and the unresolved calls. Every question is
//     scoped to one tenant unless it says AllTenants.
//
// Two projections implement both: chstore on ClickHouse, for production,
// and callindex in a bbolt file, for `ledger dev`. The contract suite in
// projectionstest holds both to the same answers, computed independently
// from the events. httpapi serves the queries over HTTP.
//
// # What matches a filter
//
// A call matches a Filter when each reference the filter names is carried
// by at least one of the call's events whose time is in [Since, Until):
//
//   - JTI, CredentialFamily, Approver, ApprovalID: any event carrying it
//     (the executor's events carry the credential; the approval's decision
//     and what follows carry the approver);
//   - CallID, TraceID: any event carrying that call id or trace id. Every
//     event of a call carries both, so in practice a call matches when
//     its requested event or any later one is in the window; a trace id
//     may be shared by several calls;
//   - ToolDigest: the call's requested event, naming that tool definition:
//     the calls admitted under it in the window (their later events carry
//     it too, and are not matched on it);
//   - PolicyVersion: a policy's decision event (one whose Decision is
//     allow, deny or require_approval; not an approver's approve or
//     reject) made under that version; with Decision set, only decisions
//     of that kind. Events carry label@hash ("v41@3f2a9c1b0d7e"); a
//     label alone ("v41") matches every version of that label
//     (PolicyVersionMatches);
//   - Role: a policy's decision event (as for PolicyVersion: one that
//     names the version it was made under, so not a denial no policy
//     made, such as a frozen tool's) made with that role among the
//     caller's roles the policies were given (`--policy-roles`; events
//     decided without it carry none); with Decision set, only decisions
//     of that kind;
//   - with none of those: the call's requested event.
//
// Tenant and Tool narrow the match to the events of that tenant and tool.
// Times compare in whole seconds (an event at 12:00:00.7 is in a window
// from 12:00:00), as ClickHouse's DateTime keeps them. Refused submissions
// (seq 0) are not calls: only Trace shows them.
//
// State is not a reference: it narrows the calls matched as above (by
// their references, or with none by their requested event in the window)
// to those whose state now, after their highest-seq event, is State, even
// when that event is outside the window. Only BlastRadius takes a State;
// Outcomes and Unresolved refuse it, as they refuse every reference
// (ErrInvalidFilter).
//
// A call's state in an answer is its state now, after its highest-seq
// event, not its state within the window. An event of a type the state
// machine does not know moves no call (KnownType): the call is answered
// as its highest-seq event of a known type shows it.
package projections
