package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/jsonappend"
)

// appendEvent appends e's wire form to b: byte for byte what encoding/json
// writes for Event with HTML escaping off, without its per-field
// reflection. Every event of every call is encoded once on the hot path,
// and reflection was most of that cost. TestAppendEventMatchesEncodingJSON
// and FuzzEventEncoding hold the two encodings equal; a field added to
// Event must be added here too (the tests fail until it is).
func appendEvent(b []byte, e *Event) ([]byte, error) {
	var err error
	b = append(b, `{"v":`...)
	b = strconv.AppendInt(b, int64(e.V), 10)
	b = jsonappend.StringField(b, "event_id", e.EventID)
	b = jsonappend.StringField(b, "type", string(e.Type))
	b = jsonappend.IntField(b, "seq", e.Seq)
	if b, err = appendTime(jsonappend.Key(b, "at"), e.At); err != nil {
		return nil, err
	}
	b = jsonappend.StringField(b, "actor", e.Actor)
	b = jsonappend.StringField(b, "tenant_id", e.TenantID)
	b = jsonappend.StringField(b, "idempotency_key", e.IdempotencyKey)
	b = jsonappend.OptString(b, "call_id", e.CallID)
	b = jsonappend.OptString(b, "user_id", e.UserID)
	b = jsonappend.OptString(b, "agent_id", e.AgentID)
	b = jsonappend.OptString(b, "purpose", e.Purpose)
	b = jsonappend.OptStrings(b, "roles", e.Roles)
	if e.RolesGiven {
		b = append(jsonappend.Key(b, "roles_given"), "true"...)
	}
	b = jsonappend.OptString(b, "channel", e.Channel)
	b = jsonappend.OptString(b, "tool", e.Tool)
	b = jsonappend.OptInt(b, "tool_version", int64(e.ToolVersion))
	b = jsonappend.OptString(b, "tool_digest", e.ToolDigest)
	b = jsonappend.OptString(b, "resource", e.Resource)
	b = jsonappend.OptString(b, "arguments_hash", e.ArgumentsHash)
	b = jsonappend.OptString(b, "trace_id", e.TraceID)
	if len(e.Arguments) > 0 {
		b = jsonappend.Key(b, "arguments")
		// As encoding/json does with a RawMessage: compacted, and
		// refused if it is not JSON.
		buf := bytes.NewBuffer(b)
		if err := json.Compact(buf, e.Arguments); err != nil {
			return nil, fmt.Errorf("encode event: arguments: %w", err)
		}
		b = buf.Bytes()
	}
	if b, err = appendOptTime(b, "deadline_at", e.DeadlineAt); err != nil {
		return nil, err
	}
	b = jsonappend.OptStrings(b, "policy_id", e.PolicyID)
	b = jsonappend.OptString(b, "policy_version", e.PolicyVersion)
	b = jsonappend.OptString(b, "decision", e.Decision)
	b = jsonappend.OptStrings(b, "obligations", e.Obligations)
	b = jsonappend.OptString(b, "approval_id", e.ApprovalID)
	b = jsonappend.OptString(b, "resource_version", e.ResourceVersion)
	b = jsonappend.OptString(b, "approver", e.Approver)
	if b, err = appendOptTime(b, "expires_at", e.ExpiresAt); err != nil {
		return nil, err
	}
	b = jsonappend.OptString(b, "jti", e.JTI)
	b = jsonappend.OptString(b, "credential_scope", e.CredentialScope)
	b = jsonappend.OptString(b, "credential_family", e.CredentialFamily)
	b = jsonappend.OptStrings(b, "earlier_credential_families", e.EarlierCredentialFamilies)
	b = jsonappend.OptInt(b, "attempt", int64(e.Attempt))
	b = jsonappend.OptInt(b, "retry_after_ms", e.RetryAfterMS)
	b = jsonappend.OptString(b, "request_digest", e.RequestDigest)
	b = jsonappend.OptString(b, "reason", e.Reason)
	b = jsonappend.OptString(b, "pointer", e.Pointer)
	b = jsonappend.OptString(b, "detail", e.Detail)
	b = jsonappend.OptString(b, "error_code", e.ErrorCode)
	b = jsonappend.OptString(b, "result_digest", e.ResultDigest)
	b = jsonappend.OptInt(b, "result_bytes", int64(e.ResultBytes))
	b = jsonappend.OptInt(b, "latency_ms", e.LatencyMS)
	b = jsonappend.OptInt(b, "tool_us", e.ToolUS)
	return append(b, '}'), nil
}

func appendOptTime(b []byte, name string, t *time.Time) ([]byte, error) {
	if t == nil {
		return b, nil
	}
	return appendTime(jsonappend.Key(b, name), *t)
}

// appendTime appends t as time.Time.MarshalJSON does (RFC 3339 with
// nanoseconds), and refuses what it refuses: years outside 0-9999 and
// offsets of a day or more.
func appendTime(b []byte, t time.Time) ([]byte, error) {
	_, off := t.Zone()
	if y := t.Year(); y < 0 || y > 9999 || off <= -24*3600 || off >= 24*3600 {
		if _, err := t.MarshalJSON(); err != nil {
			return nil, fmt.Errorf("encode event: %w", err)
		}
	}
	b = append(b, '"')
	b = t.AppendFormat(b, time.RFC3339Nano)
	return append(b, '"'), nil
}
