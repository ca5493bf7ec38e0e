package ledger

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/toolcall-ledger/ledger/schemas"
)

// envelopeFields and scopeFields are the members an envelope may have
// (DESIGN §3); the envelope schema says the same with additionalProperties.
var (
	envelopeFields = []string{
		"arguments", "arguments_hash", "assertion", "call_id", "deadline_ms",
		"idempotency_key", "scope", "tool", "tool_version", "trace_id",
	}
	scopeFields = []string{"on_behalf_of", "purpose", "tenant_id", "user_id"}
)

// DecodeEnvelope parses and checks an envelope from the request topic:
// size, strict JSON (Decode), a top-level object, no unknown field at the
// top level or in scope (a case variant such as "Tool" is unknown too), and
// the envelope schema. Every failure is a *DecodeError whose Pointer names
// the offending member: a schema failure maps to missing_field, invalid_type
// or invalid_envelope. It does not check the arguments against the tool's
// schema, the assertion or the hash; those are the intake's next steps.
func DecodeEnvelope(data []byte, lim Limits) (*Envelope, error) {
	lim = lim.WithDefaults()
	if len(data) > lim.MaxBytes {
		return nil, &DecodeError{Code: CodeTooLarge, Detail: fmt.Sprintf("%d bytes, limit %d", len(data), lim.MaxBytes)}
	}
	tree, err := Decode(data, lim)
	if err != nil {
		return nil, err
	}
	top, ok := tree.(map[string]any)
	if !ok {
		return nil, &DecodeError{Code: CodeInvalidType, Detail: "envelope must be a JSON object"}
	}
	if err := unknownFields(top, envelopeFields, ""); err != nil {
		return nil, err
	}
	if scope, ok := top["scope"].(map[string]any); ok {
		if err := unknownFields(scope, scopeFields, "/scope"); err != nil {
			return nil, err
		}
	}
	if err := schemas.ValidateEnvelope(top); err != nil {
		return nil, envelopeSchemaError(err)
	}
	return fillEnvelope(top)
}

// unknownFields reports the first (in byte order) member of m not in known.
func unknownFields(m map[string]any, known []string, prefix string) error {
	var unknown []string
	for k := range m {
		if _, found := slices.BinarySearch(known, k); !found {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) == 0 {
		return nil
	}
	slices.Sort(unknown)
	detail := fmt.Sprintf("unknown field %q", unknown[0])
	for _, k := range known {
		if strings.EqualFold(k, unknown[0]) {
			detail += fmt.Sprintf(" (field names are case-sensitive: %q)", k)
		}
	}
	return &DecodeError{Code: CodeUnknownField, Pointer: prefix + "/" + escapePointerToken(unknown[0]), Detail: detail}
}

// envelopeSchemaError maps a schema failure to a DecodeError.
func envelopeSchemaError(err error) error {
	var ve *schemas.ValidationError
	if !errors.As(err, &ve) {
		return &DecodeError{Code: CodeInvalidEnvelope, Detail: err.Error()}
	}
	code := CodeInvalidEnvelope
	switch ve.Keyword {
	case "required":
		code = CodeMissingField
	case "type":
		code = CodeInvalidType
	case "additionalProperties":
		code = CodeUnknownField
	}
	return &DecodeError{Code: code, Pointer: ve.Pointer, Detail: ve.Reason}
}

// fillEnvelope copies a schema-valid tree into an Envelope. The type checks
// repeat the schema's so that a schema edit cannot make this panic.
func fillEnvelope(m map[string]any) (*Envelope, error) {
	var e Envelope
	var err error
	str := func(dst *string, ptr string, v any) {
		if err != nil || v == nil {
			return
		}
		s, ok := v.(string)
		if !ok {
			err = &DecodeError{Code: CodeInvalidType, Pointer: ptr, Detail: "expected a string"}
			return
		}
		*dst = s
	}
	integer := func(ptr string, v any) int64 {
		if err != nil || v == nil {
			return 0
		}
		n, ierr := integerValue(v)
		if ierr != "" {
			err = &DecodeError{Code: CodeInvalidType, Pointer: ptr, Detail: ierr}
		}
		return n
	}
	str(&e.Tool, "/tool", m["tool"])
	e.ToolVersion = int(integer("/tool_version", m["tool_version"]))
	str(&e.CallID, "/call_id", m["call_id"])
	str(&e.TraceID, "/trace_id", m["trace_id"])
	e.DeadlineMS = integer("/deadline_ms", m["deadline_ms"])
	str(&e.IdempotencyKey, "/idempotency_key", m["idempotency_key"])
	str(&e.ArgumentsHash, "/arguments_hash", m["arguments_hash"])
	str(&e.Assertion, "/assertion", m["assertion"])
	if scope, ok := m["scope"].(map[string]any); ok {
		str(&e.Scope.TenantID, "/scope/tenant_id", scope["tenant_id"])
		str(&e.Scope.UserID, "/scope/user_id", scope["user_id"])
		str(&e.Scope.OnBehalfOf, "/scope/on_behalf_of", scope["on_behalf_of"])
		str(&e.Scope.Purpose, "/scope/purpose", scope["purpose"])
	} else if err == nil {
		err = &DecodeError{Code: CodeInvalidType, Pointer: "/scope", Detail: "expected an object"}
	}
	if args, ok := m["arguments"].(map[string]any); ok {
		e.Arguments = args
	} else if err == nil {
		err = &DecodeError{Code: CodeInvalidType, Pointer: "/arguments", Detail: "expected an object"}
	}
	if err != nil {
		return nil, err
	}
	return &e, nil
}

// integerValue converts an integral json.Number ("8000", "8e3", "8000.0")
// within ±2^53 to int64; it returns a reason when v is not one.
func integerValue(v any) (int64, string) {
	n, ok := v.(json.Number)
	if !ok {
		return 0, "expected an integer"
	}
	f, err := strconv.ParseFloat(string(n), 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return 0, "expected an integer"
	}
	return int64(f), ""
}

// LenientKey extracts the call key and call id from a record that failed
// DecodeEnvelope, so that the refusal can be recorded under the call it was
// meant for. It is best effort (plain encoding/json, errors ignored, so a
// record that is not JSON at all yields nothing) and must never be used to
// decide anything but where a refusal is filed. ok is false when the tenant
// or the key is missing or empty, longer than the envelope schema allows
// (a refusal filed under it would be as large as the record, and outgrow
// what Kafka and the stores hold), or the tenant contains "/" (it could
// not be told apart from the key in the record key). A call id longer than
// the schema allows is returned empty.
func LenientKey(data []byte) (CallKey, string, bool) {
	var rec struct {
		Scope struct {
			TenantID string `json:"tenant_id"`
		} `json:"scope"`
		IdempotencyKey string `json:"idempotency_key"`
		CallID         string `json:"call_id"`
	}
	_ = json.Unmarshal(data, &rec) // best effort: keep whatever decoded
	callID := rec.CallID
	if utf8.RuneCountInString(callID) > maxCallIDLen {
		callID = ""
	}
	k := CallKey{TenantID: rec.Scope.TenantID, IdempotencyKey: rec.IdempotencyKey}
	if k.TenantID == "" || k.IdempotencyKey == "" || strings.Contains(k.TenantID, "/") ||
		len(k.TenantID) > maxTenantLen || utf8.RuneCountInString(k.IdempotencyKey) > maxKeyLen {
		return CallKey{}, callID, false
	}
	return k, callID, true
}

// The envelope schema's bounds (schemas/envelope.schema.json), for what
// LenientKey reads without the schema: a tenant id is at most 128 ASCII
// characters, an idempotency key and a call id at most 255 characters.
const (
	maxTenantLen = 128
	maxKeyLen    = 255
	maxCallIDLen = 255
)
