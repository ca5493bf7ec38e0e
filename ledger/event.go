package ledger

import (
	"github.com/twmb/franz-go/pkg/kgo"

	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// EncodingVersion is the version of the event encoding this build writes,
// and the newest it reads. Readers accept every version up to theirs and
// refuse newer ones, so that an old consumer never misreads a newer event.
//
// A rolling upgrade runs old and new builds on one log, so a field added
// to Event is one of two kinds, and TestEventFieldsAreClassified makes
// whoever adds one say which (eventFieldVersions there):
//   - informational: read by people and projections, never by a decision
//     (a detail, a digest, a label). V stays; older readers ignore it.
//   - binding: a reader must act on it (a check, such as the resource
//     version an approval binds; a limit). It needs a new V, so that an
//     older build refuses the events that carry it rather than decide
//     without a check it does not know: its executor stops before it
//     (ErrStop: the process exits, and the partition waits for a build
//     that reads it), its intake leaves it out of a duplicate's
//     re-append, its projector stops before it. Raising EncodingVersion alone would put the new
//     V on every event, so Encode must then write it only on the events
//     that carry the field, and only once a setting says that every
//     build reads it: readers first, then writers, and the intake and
//     executor are both.
//
// Version 1 is every field Event had at first, the binding ones included.
// Version 2 adds Roles and RolesGiven, binding: Encode writes 2 on the
// events that carry them, and 1 on the others, which every build reads. The setting that
// puts roles on events is the policies' (policy.Config.Roles, `ledger
// intake --policy-roles`).
const EncodingVersion = 2

// versionOf is the encoding version e needs: the lowest that holds every
// field e carries, so that a build that reads only older versions refuses
// no event it could read.
func versionOf(e *Event) int {
	if e.RolesGiven || len(e.Roles) > 0 {
		return 2
	}
	return 1
}

// ErrUnsupportedEncoding: the event was written by a newer ledger.
var ErrUnsupportedEncoding = errors.New("unsupported event encoding")

// Event is one fact about one call, appended to the events topic under the
// call's key. Arguments are redacted; no credential, assertion or secret is
// ever put in an event.
type Event struct {
	V       int                    `json:"v"`
	EventID string                 `json:"event_id"`
	Type    statemachine.EventType `json:"type"`
	// Seq is 1, 2, 3... per call, gapless. Seq 0 marks a refused
	// submission: a fact about one envelope (malformed, or a reused key),
	// never applied to a call.
	Seq   int64     `json:"seq"`
	At    time.Time `json:"at"`
	Actor string    `json:"actor"`

	TenantID       string `json:"tenant_id"`
	IdempotencyKey string `json:"idempotency_key"`
	CallID         string `json:"call_id,omitempty"`
	UserID         string `json:"user_id,omitempty"`
	AgentID        string `json:"agent_id,omitempty"`
	// Purpose is the verified assertion's purpose, if any.
	Purpose string `json:"purpose,omitempty"`
	// Roles are the verified assertion's roles that the call's policies
	// were given (policy.Config.Roles), on the events of a call decided
	// with them, and RolesGiven says that they were, whether the caller
	// had roles or not: an approved call is decided again with the same
	// (the roles, or no roles attribute at all), never with an empty
	// set its policies did not see. Binding (version 2).
	Roles      []string `json:"roles,omitempty"`
	RolesGiven bool     `json:"roles_given,omitempty"`
	// Channel is how the call arrived, as its policies saw it.
	Channel     string `json:"channel,omitempty"`
	Tool        string `json:"tool,omitempty"`
	ToolVersion int    `json:"tool_version,omitempty"`
	// ToolDigest is the digest of the tool's definition the intake
	// admitted the call under (schemas.Tool.Digest), on every event of
	// the call from its requested event on: the definition it is bound
	// to, which the executor runs it by or not at all. Informational
	// (version 2): empty on the events of older builds, and on refusals.
	ToolDigest string `json:"tool_digest,omitempty"`
	// Resource is what the call touches: the value at the tool's resource
	// pointer in the redacted arguments ("ord_42"), for blast radius.
	Resource      string `json:"resource,omitempty"`
	ArgumentsHash string `json:"arguments_hash,omitempty"`
	TraceID       string `json:"trace_id,omitempty"`
	// Arguments, redacted per the tool's registry entry; only on requested.
	Arguments json.RawMessage `json:"arguments,omitempty"`
	// DeadlineAt is when the caller stops caring; only on requested.
	DeadlineAt *time.Time `json:"deadline_at,omitempty"`

	PolicyID      []string `json:"policy_id,omitempty"`
	PolicyVersion string   `json:"policy_version,omitempty"`
	Decision      string   `json:"decision,omitempty"`
	Obligations   []string `json:"obligations,omitempty"`
	ApprovalID    string   `json:"approval_id,omitempty"`
	// ResourceVersion is the version of the call's resource: on
	// approval_pending, as the call was requested (when the intake read
	// it); on approved, the one the approval binds.
	ResourceVersion string     `json:"resource_version,omitempty"`
	Approver        string     `json:"approver,omitempty"`
	ExpiresAt       *time.Time `json:"expires_at,omitempty"`
	// JTI and CredentialFamily name the per-call credential the event's
	// attempt sent (a call keeps one jti over all its claims; each
	// executor sends it under its own family). On the executing event of
	// a call taken over after its owner's lease ran out, they name that
	// owner's, which may have reached the tool (on every event of that
	// step when the new owner minted none, and on a denial or expiry).
	JTI             string `json:"jti,omitempty"`
	CredentialScope string `json:"credential_scope,omitempty"`
	// CredentialFamily groups the credentials of one tool, tenant and key
	// epoch: what an incident responder revokes.
	CredentialFamily string `json:"credential_family,omitempty"`
	// EarlierCredentialFamilies, on a claim's executing event (and on
	// every event of its step when it minted none, and on a denial or
	// expiry), are the families of the call's earlier claims other than
	// CredentialFamily whose credentials may have reached the tool:
	// those of expired claims, whose owners died (or stalled) before
	// they recorded anything, and those of claims given back after the
	// tool answered their requests without effect (a 429), or held a
	// request back once its headers were sent. Empty for most calls. A
	// family's blast radius counts them as CredentialFamily.
	EarlierCredentialFamilies []string `json:"earlier_credential_families,omitempty"`
	Attempt                   int      `json:"attempt,omitempty"`
	// RetryAfterMS, on a refusal that may pass (rate_limited, or a policy
	// that could not decide: policy_timeout, policy_error,
	// policy_unavailable), is when to try again under the same key.
	RetryAfterMS int64 `json:"retry_after_ms,omitempty"`
	// RequestDigest, on a refusal (seq 0), is the RequestDigest of the
	// envelope it refuses: the copy it answers. Two copies of one call
	// (its call id sent again with a fresh assertion, say) are each
	// refused or admitted on their own, and a sender waiting for its
	// copy's answer tells its refusal from another copy's by it. Empty on
	// the refusals of older builds.
	RequestDigest string `json:"request_digest,omitempty"`

	// Reason is machine-readable (snake_case); Pointer is the JSON pointer
	// of the offending field where there is one; Detail is for humans.
	Reason    string `json:"reason,omitempty"`
	Pointer   string `json:"pointer,omitempty"`
	Detail    string `json:"detail,omitempty"`
	ErrorCode string `json:"error_code,omitempty"`

	ResultDigest string `json:"result_digest,omitempty"`
	ResultBytes  int    `json:"result_bytes,omitempty"`
	// LatencyMS is how long the execution took, from its claim's start
	// to its outcome: the executor's own waits (the tool's bulkhead,
	// retries' backoffs, the checks before the call) included.
	LatencyMS int64 `json:"latency_ms,omitempty"`
	// ToolUS is the part of it the tool's requests took, summed over
	// the attempts, in microseconds: what the tool itself cost the call,
	// which latency added by the ledger is measured without. Zero when
	// no request left (or from an older build).
	ToolUS int64 `json:"tool_us,omitempty"`
}

// Key returns the call the event belongs to.
func (e *Event) Key() CallKey {
	return CallKey{TenantID: e.TenantID, IdempotencyKey: e.IdempotencyKey}
}

// NamesFamily reports whether e names the credential family f, as its
// CredentialFamily or among its EarlierCredentialFamilies.
func (e *Event) NamesFamily(f string) bool {
	return f != "" && (e.CredentialFamily == f || slices.Contains(e.EarlierCredentialFamilies, f))
}

// Refusal reports whether the event records a refused submission (seq 0)
// rather than a step of a call.
func (e *Event) Refusal() bool { return e.Seq == 0 }

// Refusing returns the event in evs, the events a submission was answered
// with (the intake's answer to a call the ledger makes for an operator: a
// compensation), that refuses the call: denied (a refused submission,
// seq 0: the key not used, so it may be asked again; or the call
// denied), or rejected. ok is false when the call goes on (authorized, held
// for an approval), and for an empty answer (a retry the log already has).
func Refusing(evs []Event) (e Event, ok bool) {
	if len(evs) == 0 {
		return Event{}, false
	}
	last := evs[len(evs)-1]
	if last.Type == statemachine.EventDenied || last.Type == statemachine.EventRejected {
		return last, true
	}
	return Event{}, false
}

// RefusalText says, for people, what e, a refusal (Refusing), refused
// with: its type, reason and detail, and whether asking again may pass.
func RefusalText(e Event) string {
	out := string(e.Type)
	if e.Reason != "" {
		out += " (" + e.Reason + ")"
	}
	if e.Detail != "" {
		out += ": " + e.Detail
	}
	switch {
	case e.RetryAfterMS > 0:
		out += fmt.Sprintf("; it may pass if asked again in %s", time.Duration(e.RetryAfterMS)*time.Millisecond)
	case e.Refusal():
		out += "; its key was not used, so it may be asked again once the cause is gone"
	}
	return out
}

// Transition returns what the state machine reads of the event.
func (e *Event) Transition() statemachine.Event {
	t := statemachine.Event{
		Type:          e.Type,
		Seq:           e.Seq,
		At:            e.At,
		ArgumentsHash: e.ArgumentsHash,
		ApprovalID:    e.ApprovalID,
		Attempt:       e.Attempt,
		Reason:        e.Reason,
	}
	if e.ExpiresAt != nil {
		t.ExpiresAt = *e.ExpiresAt
	}
	return t
}

// Encode returns the event's wire form. It sets V to the version the
// event needs (versionOf), at most EncodingVersion.
func (e *Event) Encode() ([]byte, error) {
	e.V = versionOf(e)
	// Most events are under 1 KiB; a requested event also carries its
	// arguments.
	return appendEvent(make([]byte, 0, 1024+len(e.Arguments)), e)
}

// DecodeEvent parses an event's wire form. It refuses encodings newer than
// this build knows with ErrUnsupportedEncoding.
func DecodeEvent(b []byte) (Event, error) {
	e, ok := decodeEventFast(b)
	if !ok {
		if err := json.Unmarshal(b, &e); err != nil {
			if v, newer := NewerEncoding(b, EncodingVersion); newer {
				return Event{}, fmt.Errorf("%w: v%d (this build reads up to v%d)", ErrUnsupportedEncoding, v, EncodingVersion)
			}
			return Event{}, fmt.Errorf("decode event: %w", err)
		}
	}
	switch {
	case e.V < 1:
		return Event{}, fmt.Errorf("decode event: missing encoding version")
	case e.V > EncodingVersion:
		return Event{}, fmt.Errorf("%w: v%d (this build reads up to v%d)", ErrUnsupportedEncoding, e.V, EncodingVersion)
	}
	return e, nil
}

// NewerEncoding reports whether b, a JSON object that does not decode as
// this build's records do, says it is of an encoding newer than known
// (its "v"): one that changed a field's type is such a record, to be
// refused as newer (its readers stop, or wait for an upgrade), not
// skipped as undecodable.
func NewerEncoding(b []byte, known int) (v int, newer bool) {
	var head struct {
		V int `json:"v"`
	}
	if json.Unmarshal(b, &head) != nil {
		return 0, false
	}
	return head.V, head.V > known
}

// EncodeEvents encodes a batch of events as one JSON array, the form the
// execution store keeps as its outbox.
func EncodeEvents(evs []Event) ([]byte, error) {
	b, _, err := EncodeOutbox(evs, "")
	return b, err
}

// EncodeOutbox encodes each event once, for both of its destinations: the
// outbox array that EncodeEvents returns, and the events' records on
// topic. A step that writes an outbox and then appends its events needs no
// second encoding (nor a decoding of what it just wrote).
func EncodeOutbox(evs []Event, topic string) ([]byte, []*kgo.Record, error) {
	recs := make([]*kgo.Record, len(evs))
	n := 2
	for i := range evs {
		r, err := evs[i].Record(topic)
		if err != nil {
			return nil, nil, err
		}
		recs[i] = r
		n += len(r.Value) + 1
	}
	// Each value is a complete JSON object from Encode: the array is
	// their concatenation.
	out := make([]byte, 0, n)
	out = append(out, '[')
	for i, r := range recs {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, r.Value...)
	}
	return append(out, ']'), recs, nil
}

// DecodeEvents is the inverse of EncodeEvents.
func DecodeEvents(b []byte) ([]Event, error) {
	if len(b) == 0 {
		return nil, nil
	}
	var raws []json.RawMessage
	if err := json.Unmarshal(b, &raws); err != nil {
		return nil, fmt.Errorf("decode events: %w", err)
	}
	evs := make([]Event, len(raws))
	for i, r := range raws {
		e, err := DecodeEvent(r)
		if err != nil {
			return nil, err
		}
		evs[i] = e
	}
	return evs, nil
}
