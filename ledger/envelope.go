package ledger

import (
	"crypto/sha256"
	"encoding/hex"
	"time"
)

// Envelope is what an agent publishes to the request topic: a proposal for
// one tool call. Everything in it is untrusted until the intake checked it.
type Envelope struct {
	Tool           string `json:"tool"`
	ToolVersion    int    `json:"tool_version"`
	CallID         string `json:"call_id"`
	Scope          Scope  `json:"scope"`
	TraceID        string `json:"trace_id,omitempty"`
	DeadlineMS     int64  `json:"deadline_ms,omitempty"`
	IdempotencyKey string `json:"idempotency_key"`
	ArgumentsHash  string `json:"arguments_hash"`
	Assertion      string `json:"assertion,omitempty"`

	// Arguments is the decoded arguments tree: map[string]any, []any,
	// string, json.Number, bool or nil, as Decode produces it. It is what
	// was validated and hashed, and what runs.
	Arguments any `json:"arguments"`

	// Published, when its reader keeps them, are the bytes the envelope
	// was decoded from, as its sender published them: a refusal names
	// their RequestDigest.
	Published []byte `json:"-"`
}

// RequestDigest is the digest a refusal names the envelope it refuses by
// (Event.RequestDigest): "sha256:" and the lowercase hex SHA-256 of the
// envelope's bytes as published.
func RequestDigest(published []byte) string {
	sum := sha256.Sum256(published)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// Scope is the caller's claim about who asks. The verified assertion is the
// truth; a scope that disagrees with it is a denial.
type Scope struct {
	TenantID   string `json:"tenant_id"`
	UserID     string `json:"user_id,omitempty"`
	OnBehalfOf string `json:"on_behalf_of,omitempty"`
	Purpose    string `json:"purpose,omitempty"`
}

// Key returns the call's identity.
func (e *Envelope) Key() CallKey {
	return CallKey{TenantID: e.Scope.TenantID, IdempotencyKey: e.IdempotencyKey}
}

// Deadline returns the call's deadline counted from received, or the zero
// time when the envelope sets none.
func (e *Envelope) Deadline(received time.Time) time.Time {
	if e.DeadlineMS <= 0 {
		return time.Time{}
	}
	return received.Add(time.Duration(e.DeadlineMS) * time.Millisecond)
}
