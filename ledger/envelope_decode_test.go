package ledger

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// envelopeJSON is the DESIGN §3 example with a well-formed hash.
const envelopeJSON = `{
  "tool": "refund_order",
  "tool_version": 3,
  "call_id": "call_7f3a",
  "arguments": {"order_id": "ord_1029", "amount_cents": 4500, "currency": "AUD"},
  "scope": {"tenant_id": "t_acme", "user_id": "u_88", "on_behalf_of": "u_88", "purpose": "customer_refund_after_dispute"},
  "trace_id": "tr_5c1e",
  "deadline_ms": 8000,
  "idempotency_key": "run_42:step_7:refund_order",
  "arguments_hash": "sha256:cddef8618bf08e54b7ac36d10c2bd47e7c7e060f2c99b506f490b46aed3b0199",
  "assertion": "eyJhbGciOiJFZERTQSJ9.e30.sig"
}`

func TestDecodeEnvelope(t *testing.T) {
	t.Parallel()
	got, err := DecodeEnvelope([]byte(envelopeJSON), Limits{})
	if err != nil {
		t.Fatalf("DecodeEnvelope() = %v", err)
	}
	want := &Envelope{
		Tool:        "refund_order",
		ToolVersion: 3,
		CallID:      "call_7f3a",
		Scope: Scope{TenantID: "t_acme", UserID: "u_88", OnBehalfOf: "u_88",
			Purpose: "customer_refund_after_dispute"},
		TraceID:        "tr_5c1e",
		DeadlineMS:     8000,
		IdempotencyKey: "run_42:step_7:refund_order",
		ArgumentsHash:  "sha256:cddef8618bf08e54b7ac36d10c2bd47e7c7e060f2c99b506f490b46aed3b0199",
		Assertion:      "eyJhbGciOiJFZERTQSJ9.e30.sig",
		Arguments: map[string]any{"order_id": "ord_1029", "amount_cents": json.Number("4500"),
			"currency": "AUD"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("DecodeEnvelope() mismatch (-want +got):\n%s", diff)
	}
	hash, err := ArgumentsHash(got.Scope.TenantID, got.Tool, got.ToolVersion, got.Arguments)
	if err != nil || hash != got.ArgumentsHash {
		t.Errorf("ArgumentsHash(decoded) = %q, %v; want the envelope's %q", hash, err, got.ArgumentsHash)
	}
}

// edit returns envelopeJSON with old replaced by new (once), failing the
// test binary at init if old is absent so a fixture change can't silently
// turn a case into a duplicate of "valid".
func edit(old, new string) string {
	if !strings.Contains(envelopeJSON, old) {
		panic("envelopeJSON lacks " + old)
	}
	return strings.Replace(envelopeJSON, old, new, 1)
}

type envelopeCase struct {
	name    string
	in      string
	lim     Limits
	want    func(*Envelope) // for accepted cases: what must hold
	wantErr *DecodeError    // Code and Pointer compared
}

var envelopeCases = []envelopeCase{
	{name: "valid", in: envelopeJSON},
	{name: "minimal", in: `{"tool":"get_weather","tool_version":1,"call_id":"c","arguments":{},"scope":{"tenant_id":"t"},"idempotency_key":"k","arguments_hash":"sha256:` + strings.Repeat("0", 64) + `"}`,
		want: func(e *Envelope) {}},
	{name: "integral decimal version", in: edit(`"tool_version": 3`, `"tool_version": 3.0`),
		want: func(e *Envelope) {}},
	{name: "deadline in exponent form", in: edit(`"deadline_ms": 8000`, `"deadline_ms": 8e3`),
		want: func(e *Envelope) {}},

	{name: "too large", in: envelopeJSON, lim: Limits{MaxBytes: 100}, wantErr: &DecodeError{Code: CodeTooLarge}},
	{name: "not json", in: `{"tool": `, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/tool"}},
	{name: "top-level array", in: `[` + envelopeJSON + `]`, wantErr: &DecodeError{Code: CodeInvalidType}},
	{name: "top-level string", in: `"envelope"`, wantErr: &DecodeError{Code: CodeInvalidType}},
	{name: "trailing data", in: envelopeJSON + `{}`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "duplicate key", in: edit(`"idempotency_key": "run_42:step_7:refund_order",`, `"idempotency_key": "a", "idempotency_key": "b",`),
		wantErr: &DecodeError{Code: CodeDuplicateKey, Pointer: "/idempotency_key"}},
	{name: "case variant key", in: edit(`"tool": "refund_order",`, `"tool": "refund_order", "Tool": "send_email",`),
		wantErr: &DecodeError{Code: CodeCaseVariantKey, Pointer: "/Tool"}},
	{name: "case variant alone is unknown", in: edit(`"tool": "refund_order"`, `"Tool": "refund_order"`),
		wantErr: &DecodeError{Code: CodeUnknownField, Pointer: "/Tool"}},
	{name: "unknown top-level field", in: edit(`"trace_id"`, `"tenant": "t_other", "trace_id"`),
		wantErr: &DecodeError{Code: CodeUnknownField, Pointer: "/tenant"}},
	{name: "unknown field escaped", in: edit(`"trace_id"`, `"x/y": 1, "trace_id"`),
		wantErr: &DecodeError{Code: CodeUnknownField, Pointer: "/x~1y"}},
	{name: "unknown scope field", in: edit(`"tenant_id": "t_acme"`, `"tenant_id": "t_acme", "role": "admin"`),
		wantErr: &DecodeError{Code: CodeUnknownField, Pointer: "/scope/role"}},
	{name: "missing tool", in: edit(`"tool": "refund_order",`, ``),
		wantErr: &DecodeError{Code: CodeMissingField, Pointer: "/tool"}},
	{name: "missing tenant", in: edit(`"tenant_id": "t_acme", `, ``),
		wantErr: &DecodeError{Code: CodeMissingField, Pointer: "/scope/tenant_id"}},
	{name: "version as string", in: edit(`"tool_version": 3`, `"tool_version": "3"`),
		wantErr: &DecodeError{Code: CodeInvalidType, Pointer: "/tool_version"}},
	{name: "version fractional", in: edit(`"tool_version": 3`, `"tool_version": 3.5`),
		wantErr: &DecodeError{Code: CodeInvalidType, Pointer: "/tool_version"}},
	{name: "version zero", in: edit(`"tool_version": 3`, `"tool_version": 0`),
		wantErr: &DecodeError{Code: CodeInvalidEnvelope, Pointer: "/tool_version"}},
	{name: "tenant with slash", in: edit(`"tenant_id": "t_acme"`, `"tenant_id": "t/acme"`),
		wantErr: &DecodeError{Code: CodeInvalidEnvelope, Pointer: "/scope/tenant_id"}},
	{name: "scope not object", in: edit(`"scope": {"tenant_id": "t_acme", "user_id": "u_88", "on_behalf_of": "u_88", "purpose": "customer_refund_after_dispute"}`, `"scope": "t_acme"`),
		wantErr: &DecodeError{Code: CodeInvalidType, Pointer: "/scope"}},
	{name: "arguments array", in: edit(`"arguments": {"order_id": "ord_1029", "amount_cents": 4500, "currency": "AUD"}`, `"arguments": ["ord_1029"]`),
		wantErr: &DecodeError{Code: CodeInvalidType, Pointer: "/arguments"}},
	{name: "bad hash", in: edit(`"sha256:cdd`, `"sha256:CDD`),
		wantErr: &DecodeError{Code: CodeInvalidEnvelope, Pointer: "/arguments_hash"}},
	{name: "deadline too long", in: edit(`"deadline_ms": 8000`, `"deadline_ms": 3600001`),
		wantErr: &DecodeError{Code: CodeInvalidEnvelope, Pointer: "/deadline_ms"}},
	{name: "argument number out of range", in: edit(`"amount_cents": 4500`, `"amount_cents": 9007199254740993`),
		wantErr: &DecodeError{Code: CodeNumberOutOfRange, Pointer: "/arguments/amount_cents"}},
	{name: "arguments too deep", in: edit(`"currency": "AUD"`, `"currency": "AUD", "x": [[[]]]`), lim: Limits{MaxDepth: 4},
		wantErr: &DecodeError{Code: CodeTooDeep, Pointer: "/arguments/x/0/0"}},
	{name: "duplicate key in arguments", in: edit(`"currency": "AUD"`, `"currency": "AUD", "currency": "USD"`),
		wantErr: &DecodeError{Code: CodeDuplicateKey, Pointer: "/arguments/currency"}},
}

func TestDecodeEnvelopeCases(t *testing.T) {
	t.Parallel()
	for _, tc := range envelopeCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := DecodeEnvelope([]byte(tc.in), tc.lim)
			if tc.wantErr == nil {
				if err != nil || got == nil {
					t.Fatalf("DecodeEnvelope() = %v, %v; want an envelope", got, err)
				}
				return
			}
			var de *DecodeError
			if !errors.As(err, &de) || got != nil {
				t.Fatalf("DecodeEnvelope() = %v, %v; want nil and a *DecodeError", got, err)
			}
			if g := (DecodeError{Code: de.Code, Pointer: de.Pointer}); g != (DecodeError{Code: tc.wantErr.Code, Pointer: tc.wantErr.Pointer}) {
				t.Errorf("DecodeEnvelope() error = %v; want code %q pointer %q", err, tc.wantErr.Code, tc.wantErr.Pointer)
			}
		})
	}
}

func TestDecodeEnvelopeIntegers(t *testing.T) {
	t.Parallel()
	in := edit(`"tool_version": 3`, `"tool_version": 3.0`)
	in = strings.Replace(in, `"deadline_ms": 8000`, `"deadline_ms": 8e3`, 1)
	got, err := DecodeEnvelope([]byte(in), Limits{})
	if err != nil {
		t.Fatalf("DecodeEnvelope() = %v", err)
	}
	if got.ToolVersion != 3 || got.DeadlineMS != 8000 {
		t.Errorf("ToolVersion, DeadlineMS = %d, %d; want 3, 8000", got.ToolVersion, got.DeadlineMS)
	}
}

// TestDecodeEnvelopeErrorOmitsAssertion: the assertion is a credential
// (DESIGN I6); no error may quote it.
func TestDecodeEnvelopeErrorOmitsAssertion(t *testing.T) {
	t.Parallel()
	const jwt = "eyJhbGciOiJFZERTQSJ9.e30.sig"
	for _, in := range []string{
		edit(`"assertion": "`+jwt+`"`, `"assertion": "`+jwt+`", "assertion": "`+jwt+`"`),
		edit(`"assertion": "`+jwt+`"`, `"assertion": "`+jwt+strings.Repeat("x", 16384)+`"`),
		edit(`"assertion": "`+jwt+`"`, `"assertion": ["`+jwt+`"]`),
		edit(`"assertion": "`+jwt+`"`, `"assertion": "`+jwt+"\x01"+`"`),
	} {
		_, err := DecodeEnvelope([]byte(in), Limits{})
		if err == nil {
			t.Fatalf("DecodeEnvelope() = nil error; want one")
		}
		if strings.Contains(err.Error(), jwt) {
			t.Errorf("DecodeEnvelope() error %q quotes the assertion", err)
		}
	}
}

func TestLenientKey(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		in         string
		wantKey    CallKey
		wantCallID string
		wantOK     bool
	}{
		{name: "valid envelope", in: envelopeJSON,
			wantKey: CallKey{TenantID: "t_acme", IdempotencyKey: "run_42:step_7:refund_order"}, wantCallID: "call_7f3a", wantOK: true},
		{name: "schema failure still yields key", in: edit(`"tool_version": 3`, `"tool_version": "three"`),
			wantKey: CallKey{TenantID: "t_acme", IdempotencyKey: "run_42:step_7:refund_order"}, wantCallID: "call_7f3a", wantOK: true},
		{name: "unknown field still yields key", in: edit(`"trace_id"`, `"extra": 1, "trace_id"`),
			wantKey: CallKey{TenantID: "t_acme", IdempotencyKey: "run_42:step_7:refund_order"}, wantCallID: "call_7f3a", wantOK: true},
		{name: "not json", in: `{"scope":{"tenant_id":"t"},"idempotency_key":"k"`, wantOK: false},
		{name: "missing tenant", in: edit(`"tenant_id": "t_acme", `, ``), wantCallID: "call_7f3a", wantOK: false},
		{name: "empty key", in: edit(`"idempotency_key": "run_42:step_7:refund_order"`, `"idempotency_key": ""`), wantCallID: "call_7f3a", wantOK: false},
		{name: "tenant with slash", in: edit(`"tenant_id": "t_acme"`, `"tenant_id": "t/acme"`), wantCallID: "call_7f3a", wantOK: false},
		{name: "array", in: `[1,2]`, wantOK: false},
		// Keys past the schema's bounds would make a refusal as large as
		// the record: such a record goes to the DLQ instead.
		{name: "key of 255 characters", in: edit(`"idempotency_key": "run_42:step_7:refund_order"`, `"idempotency_key": "`+strings.Repeat("é", 255)+`"`),
			wantKey: CallKey{TenantID: "t_acme", IdempotencyKey: strings.Repeat("é", 255)}, wantCallID: "call_7f3a", wantOK: true},
		{name: "key of 256 characters", in: edit(`"idempotency_key": "run_42:step_7:refund_order"`, `"idempotency_key": "`+strings.Repeat("k", 256)+`"`),
			wantCallID: "call_7f3a", wantOK: false},
		{name: "key of 300 KB", in: edit(`"idempotency_key": "run_42:step_7:refund_order"`, `"idempotency_key": "`+strings.Repeat("k", 300<<10)+`"`),
			wantCallID: "call_7f3a", wantOK: false},
		{name: "tenant of 129 bytes", in: edit(`"tenant_id": "t_acme"`, `"tenant_id": "`+strings.Repeat("t", 129)+`"`),
			wantCallID: "call_7f3a", wantOK: false},
		{name: "call id of 256 characters is dropped", in: edit(`"call_id": "call_7f3a"`, `"call_id": "`+strings.Repeat("c", 256)+`"`),
			wantKey: CallKey{TenantID: "t_acme", IdempotencyKey: "run_42:step_7:refund_order"}, wantOK: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			key, callID, ok := LenientKey([]byte(tc.in))
			if key != tc.wantKey || callID != tc.wantCallID || ok != tc.wantOK {
				t.Errorf("LenientKey() = %v, %q, %v; want %v, %q, %v", key, callID, ok, tc.wantKey, tc.wantCallID, tc.wantOK)
			}
		})
	}
}

func BenchmarkDecodeEnvelope(b *testing.B) {
	data := []byte(envelopeJSON)
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeEnvelope(data, Limits{}); err != nil {
			b.Fatal(err)
		}
	}
}
