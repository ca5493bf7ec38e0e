package ledger

import (
	"bytes"
	"strconv"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/jsonappend"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// decodeEventFast decodes the form appendEvent writes for most events
// (no arguments, strings of printable ASCII without escapes, integers,
// no whitespace) without encoding/json's reflection: an executor decodes
// every authorized event it reads. Anything else, or anything it is not
// sure of, and ok is false: the caller then decodes with encoding/json,
// which stays the definition. Where ok is true the event is what
// encoding/json would have decoded (FuzzDecodeEventFast holds that).
func decodeEventFast(b []byte) (e Event, ok bool) {
	d := fastDecoder{b: b}
	if !d.byte('{') {
		return Event{}, false
	}
	if d.byte('}') {
		return e, d.end()
	}
	for {
		key, ok := d.plainBytes()
		if !ok || !d.byte(':') {
			return Event{}, false
		}
		if !d.field(&e, key) {
			return Event{}, false
		}
		if d.byte(',') {
			continue
		}
		if d.byte('}') {
			return e, d.end()
		}
		return Event{}, false
	}
}

type fastDecoder struct {
	b []byte
	i int
}

// byte consumes c if it is next.
func (d *fastDecoder) byte(c byte) bool {
	if d.i < len(d.b) && d.b[d.i] == c {
		d.i++
		return true
	}
	return false
}

// end reports whether the input is all consumed: encoding/json refuses
// trailing data.
func (d *fastDecoder) end() bool { return d.i == len(d.b) }

// plainBytes reads a string of plain bytes (jsonappend.Plain's: no escape, no
// control character, nothing outside ASCII, whose decoding would need
// encoding/json's rules) and returns its contents, in the input.
func (d *fastDecoder) plainBytes() ([]byte, bool) {
	if !d.byte('"') {
		return nil, false
	}
	start := d.i
	for d.i < len(d.b) {
		c := d.b[d.i]
		if c == '"' {
			d.i++
			return d.b[start : d.i-1], true
		}
		if !jsonappend.Plain(c) {
			return nil, false
		}
		d.i++
	}
	return nil, false
}

func (d *fastDecoder) plainString() (string, bool) {
	b, ok := d.plainBytes()
	return string(b), ok
}

// integer reads a JSON integer: -?(0|[1-9][0-9]*), within int64.
func (d *fastDecoder) integer() (int64, bool) {
	start := d.i
	d.byte('-')
	digits := d.i
	for d.i < len(d.b) && '0' <= d.b[d.i] && d.b[d.i] <= '9' {
		d.i++
	}
	if n := d.i - digits; n == 0 || n > 1 && d.b[digits] == '0' {
		return 0, false
	}
	if d.i < len(d.b) && (d.b[d.i] == '.' || d.b[d.i] == 'e' || d.b[d.i] == 'E') {
		return 0, false
	}
	v, err := strconv.ParseInt(string(d.b[start:d.i]), 10, 64)
	return v, err == nil
}

// time reads a time as time.Time's UnmarshalJSON does, which is what
// encoding/json calls.
func (d *fastDecoder) time() (time.Time, bool) {
	start := d.i
	if _, ok := d.plainBytes(); !ok {
		return time.Time{}, false
	}
	var t time.Time
	if err := t.UnmarshalJSON(d.b[start:d.i]); err != nil {
		return time.Time{}, false
	}
	return t, true
}

// strings reads an array of plain strings.
func (d *fastDecoder) strings() ([]string, bool) {
	if !d.byte('[') {
		return nil, false
	}
	ss := []string{}
	if d.byte(']') {
		return ss, true
	}
	for {
		s, ok := d.plainString()
		if !ok {
			return nil, false
		}
		ss = append(ss, s)
		if d.byte(',') {
			continue
		}
		return ss, d.byte(']')
	}
}

// field reads the value of key into e. Keys must match exactly: encoding/
// json also matches them case-insensitively, which is left to it, as are
// unknown keys and arguments (a nested JSON value).
func (d *fastDecoder) field(e *Event, key []byte) bool {
	str := func(dst *string) bool {
		s, ok := d.plainString()
		*dst = s
		return ok
	}
	num := func(dst *int64) bool {
		v, ok := d.integer()
		*dst = v
		return ok
	}
	intNum := func(dst *int) bool {
		v, ok := d.integer()
		*dst = int(v)
		return ok && int64(int(v)) == v
	}
	tm := func(dst **time.Time) bool {
		t, ok := d.time()
		*dst = &t
		return ok
	}
	list := func(dst *[]string) bool {
		ss, ok := d.strings()
		*dst = ss
		return ok
	}
	// A switch on string(key) compares without allocating.
	switch string(key) {
	case "v":
		return intNum(&e.V)
	case "event_id":
		return str(&e.EventID)
	case "type":
		var s string
		ok := str(&s)
		e.Type = statemachine.EventType(s)
		return ok
	case "seq":
		return num(&e.Seq)
	case "at":
		t, ok := d.time()
		e.At = t
		return ok
	case "actor":
		return str(&e.Actor)
	case "tenant_id":
		return str(&e.TenantID)
	case "idempotency_key":
		return str(&e.IdempotencyKey)
	case "call_id":
		return str(&e.CallID)
	case "user_id":
		return str(&e.UserID)
	case "agent_id":
		return str(&e.AgentID)
	case "purpose":
		return str(&e.Purpose)
	case "roles":
		return list(&e.Roles)
	case "roles_given":
		// true alone: the encoder omits false, and a false spelt out is
		// left to encoding/json.
		if bytes.HasPrefix(d.b[d.i:], []byte("true")) {
			d.i += len("true")
			e.RolesGiven = true
			return true
		}
		return false
	case "channel":
		return str(&e.Channel)
	case "tool":
		return str(&e.Tool)
	case "tool_version":
		return intNum(&e.ToolVersion)
	case "tool_digest":
		return str(&e.ToolDigest)
	case "resource":
		return str(&e.Resource)
	case "arguments_hash":
		return str(&e.ArgumentsHash)
	case "trace_id":
		return str(&e.TraceID)
	case "deadline_at":
		return tm(&e.DeadlineAt)
	case "policy_id":
		return list(&e.PolicyID)
	case "policy_version":
		return str(&e.PolicyVersion)
	case "decision":
		return str(&e.Decision)
	case "obligations":
		return list(&e.Obligations)
	case "approval_id":
		return str(&e.ApprovalID)
	case "resource_version":
		return str(&e.ResourceVersion)
	case "approver":
		return str(&e.Approver)
	case "expires_at":
		return tm(&e.ExpiresAt)
	case "jti":
		return str(&e.JTI)
	case "credential_scope":
		return str(&e.CredentialScope)
	case "credential_family":
		return str(&e.CredentialFamily)
	case "earlier_credential_families":
		return list(&e.EarlierCredentialFamilies)
	case "attempt":
		return intNum(&e.Attempt)
	case "retry_after_ms":
		return num(&e.RetryAfterMS)
	case "request_digest":
		return str(&e.RequestDigest)
	case "reason":
		return str(&e.Reason)
	case "pointer":
		return str(&e.Pointer)
	case "detail":
		return str(&e.Detail)
	case "error_code":
		return str(&e.ErrorCode)
	case "result_digest":
		return str(&e.ResultDigest)
	case "result_bytes":
		return intNum(&e.ResultBytes)
	case "latency_ms":
		return num(&e.LatencyMS)
	case "tool_us":
		return num(&e.ToolUS)
	}
	return false
}
