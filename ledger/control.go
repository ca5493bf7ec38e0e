package ledger

import "time"

// ControlAction is the value of a record on the control topic
// (Topics.Control), keyed by its Subject: a freeze or unfreeze of a tool,
// a revocation of a credential or a credential family, or the activation
// of a policy version, with who did it and why. The control plane writes
// and validates them (processors/control); projections read them.
type ControlAction struct {
	// V is the record format version.
	V int `json:"v"`
	// Kind is freeze, unfreeze, revoke, activate_policy or
	// withdraw_policy.
	Kind string `json:"kind"`
	// Subject is the record key: tool:<name>[@<tenant>], jti:<jti>,
	// family:<family> or policy:active.
	Subject string `json:"subject"`
	// Tool is the frozen (or unfrozen) tool; freezes only.
	Tool string `json:"tool,omitempty"`
	// Tenant limits a freeze to one tenant; empty: every tenant. Freezes
	// only.
	Tenant string `json:"tenant,omitempty"`
	// JTI is the revoked credential; revocations only, exclusive with
	// Family.
	JTI string `json:"jti,omitempty"`
	// Family is the revoked credential family, "<tool>:<tenant>:<key
	// epoch>";
	// revocations only, exclusive with JTI.
	Family string `json:"family,omitempty"`
	// Policy is the activated policy version's label; activations only.
	Policy string `json:"policy,omitempty"`
	// PolicyHash, when set, pins the activated version's content
	// ("sha256:" and 64 hex digits, as the policy set's hash): an
	// instance whose files under the label hash otherwise denies every
	// call until they match. Activations only; older builds ignore it.
	PolicyHash string `json:"policy_hash,omitempty"`
	// By is the operator (the assertion's user) who did it.
	By string `json:"by"`
	// ByTenant is the operator's tenant, "*" for a platform operator.
	ByTenant string `json:"by_tenant"`
	// Reason is the operator's why. Required.
	Reason string `json:"reason"`
	// At is when the operator did it.
	At time.Time `json:"at"`
	// Replaced, on a platform operator's freeze of one tenant's tool,
	// is that tenant's own freeze it replaced (kept through later
	// platform freezes of the subject): the platform's unfreeze puts it
	// back. Older builds ignore it.
	Replaced *ControlAction `json:"replaced,omitempty"`
	// Lifts, on an unfreeze (a withdrawal), is the time (At) of the
	// freeze (the activation) it ends: readers apply it only while that
	// one is in force, so that one racing a newer freeze or activation
	// (published through another instance whose copy was ahead) does not
	// end it. Older builds ignore it, and so apply every unfreeze.
	Lifts *time.Time `json:"lifts,omitempty"`
	// Reasserts, on an action a control service wrote again after a
	// record of its subject that readers passed over (so that the
	// compacted topic keeps the action in force last), is the time (At)
	// of the action it copies: readers apply it only while that action,
	// or none, is the subject's last. Older builds ignore it.
	Reasserts *time.Time `json:"reasserts,omitempty"`
	// Follows, on such a copy, is the time (At) of the record passed
	// over that it was written after: a reader that applied that record
	// (the topic compacted between the copy's original and it) applies
	// the copy too.
	Follows *time.Time `json:"follows,omitempty"`
	// Restored, on a platform operator's unfreeze, is the tenant's own
	// freeze the unfreeze leaves in force: the record right after it on
	// the topic. Older builds ignore it (and apply that record).
	Restored *ControlAction `json:"restored,omitempty"`
}

// Made is when the action was made: At, or for a control service's copy
// of an action (Reasserts), the original's time.
func (a ControlAction) Made() time.Time {
	if a.Reasserts != nil {
		return *a.Reasserts
	}
	return a.At
}
