package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"time"
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
	b = appendStringField(b, "event_id", e.EventID)
	b = appendStringField(b, "type", string(e.Type))
	b = strconv.AppendInt(appendKey(b, "seq"), e.Seq, 10)
	if b, err = appendTime(appendKey(b, "at"), e.At); err != nil {
		return nil, err
	}
	b = appendStringField(b, "actor", e.Actor)
	b = appendStringField(b, "tenant_id", e.TenantID)
	b = appendStringField(b, "idempotency_key", e.IdempotencyKey)
	b = appendOptString(b, "call_id", e.CallID)
	b = appendOptString(b, "user_id", e.UserID)
	b = appendOptString(b, "agent_id", e.AgentID)
	b = appendOptString(b, "purpose", e.Purpose)
	b = appendOptStrings(b, "roles", e.Roles)
	if e.RolesGiven {
		b = append(appendKey(b, "roles_given"), "true"...)
	}
	b = appendOptString(b, "channel", e.Channel)
	b = appendOptString(b, "tool", e.Tool)
	b = appendOptInt(b, "tool_version", int64(e.ToolVersion))
	b = appendOptString(b, "resource", e.Resource)
	b = appendOptString(b, "arguments_hash", e.ArgumentsHash)
	b = appendOptString(b, "trace_id", e.TraceID)
	if len(e.Arguments) > 0 {
		b = appendKey(b, "arguments")
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
	b = appendOptStrings(b, "policy_id", e.PolicyID)
	b = appendOptString(b, "policy_version", e.PolicyVersion)
	b = appendOptString(b, "decision", e.Decision)
	b = appendOptStrings(b, "obligations", e.Obligations)
	b = appendOptString(b, "approval_id", e.ApprovalID)
	b = appendOptString(b, "resource_version", e.ResourceVersion)
	b = appendOptString(b, "approver", e.Approver)
	if b, err = appendOptTime(b, "expires_at", e.ExpiresAt); err != nil {
		return nil, err
	}
	b = appendOptString(b, "jti", e.JTI)
	b = appendOptString(b, "credential_scope", e.CredentialScope)
	b = appendOptString(b, "credential_family", e.CredentialFamily)
	b = appendOptStrings(b, "earlier_credential_families", e.EarlierCredentialFamilies)
	b = appendOptInt(b, "attempt", int64(e.Attempt))
	b = appendOptInt(b, "retry_after_ms", e.RetryAfterMS)
	b = appendOptString(b, "reason", e.Reason)
	b = appendOptString(b, "pointer", e.Pointer)
	b = appendOptString(b, "detail", e.Detail)
	b = appendOptString(b, "error_code", e.ErrorCode)
	b = appendOptString(b, "result_digest", e.ResultDigest)
	b = appendOptInt(b, "result_bytes", int64(e.ResultBytes))
	b = appendOptInt(b, "latency_ms", e.LatencyMS)
	b = appendOptInt(b, "tool_us", e.ToolUS)
	return append(b, '}'), nil
}

// appendKey appends ,"name": (names are plain ASCII).
func appendKey(b []byte, name string) []byte {
	b = append(b, ',', '"')
	b = append(b, name...)
	return append(b, '"', ':')
}

// appendStringField appends ,"name":"s".
func appendStringField(b []byte, name, s string) []byte {
	return appendJSONString(appendKey(b, name), s)
}

func appendOptString(b []byte, name, s string) []byte {
	if s == "" {
		return b
	}
	return appendStringField(b, name, s)
}

func appendOptInt(b []byte, name string, n int64) []byte {
	if n == 0 {
		return b
	}
	return strconv.AppendInt(appendKey(b, name), n, 10)
}

func appendOptStrings(b []byte, name string, ss []string) []byte {
	if len(ss) == 0 {
		return b
	}
	b = append(appendKey(b, name), '[')
	for i, s := range ss {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, s)
	}
	return append(b, ']')
}

func appendOptTime(b []byte, name string, t *time.Time) ([]byte, error) {
	if t == nil {
		return b, nil
	}
	return appendTime(appendKey(b, name), *t)
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

// appendJSONString appends s quoted. Strings of printable ASCII without
// quote or backslash, nearly all of an event's, are copied as they are;
// anything else goes through encoding/json so that its escaping rules
// (control characters, invalid UTF-8, U+2028) stay the only ones.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if !plainJSON[s[i]] {
			return appendJSONStringSlow(b, s)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// plainJSON holds the bytes a JSON string carries as they are: printable
// ASCII but the quote and the backslash.
var plainJSON = func() (t [256]bool) {
	for c := 0x20; c < 0x7f; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

func appendJSONStringSlow(b []byte, s string) []byte {
	buf := bytes.NewBuffer(b)
	enc := json.NewEncoder(buf)
	enc.SetEscapeHTML(false)
	// A string always encodes.
	_ = enc.Encode(s)
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}
