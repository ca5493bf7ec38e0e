package schemas

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// decode parses JSON the way ledger.Decode represents it (json.Number).
func decode(t testing.TB, s string) any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("decode %q: %v", s, err)
	}
	return v
}

// validateCase is one arguments document for one demo tool. An empty
// wantPointer with an empty wantKeyword means the document is valid.
type validateCase struct {
	name        string
	tool        string
	args        string
	wantPointer string
	wantKeyword string
}

var validateCases = []validateCase{
	{name: "weather ok", tool: "get_weather", args: `{"city":"Hobart"}`},
	{name: "weather unit ok", tool: "get_weather", args: `{"city":"Hobart","unit":"c"}`},
	{name: "weather missing city", tool: "get_weather", args: `{"unit":"c"}`, wantPointer: "/city", wantKeyword: "required"},
	{name: "weather empty city", tool: "get_weather", args: `{"city":""}`, wantPointer: "/city", wantKeyword: "minLength"},
	{name: "weather bad unit enum", tool: "get_weather", args: `{"city":"Hobart","unit":"k"}`, wantPointer: "/unit", wantKeyword: "enum"},
	{name: "weather extra property", tool: "get_weather", args: `{"city":"Hobart","country":"AU"}`, wantPointer: "/country", wantKeyword: "additionalProperties"},
	{name: "weather extra property escaped", tool: "get_weather", args: `{"city":"Hobart","a/b~c":1}`, wantPointer: "/a~1b~0c", wantKeyword: "additionalProperties"},
	{name: "weather extra property with quotes", tool: "get_weather", args: `{"city":"Hobart","q'\"x":1}`, wantPointer: "/q'\"x", wantKeyword: "additionalProperties"},
	{name: "weather extra property first sorted", tool: "get_weather", args: `{"city":"Hobart","zz":1,"aa":1}`, wantPointer: "/aa", wantKeyword: "additionalProperties"},
	{name: "weather arguments not object", tool: "get_weather", args: `["Hobart"]`, wantPointer: "", wantKeyword: "type"},
	{name: "ticket ok", tool: "create_ticket", args: `{"title":"printer on fire","body":"send help","priority":"high"}`},
	{name: "ticket bad priority", tool: "create_ticket", args: `{"title":"t","priority":"urgent"}`, wantPointer: "/priority", wantKeyword: "enum"},
	{name: "ticket title wrong type", tool: "create_ticket", args: `{"title":42}`, wantPointer: "/title", wantKeyword: "type"},
	{name: "refund ok", tool: "refund_order", args: `{"order_id":"ord_1029","amount_cents":4500,"currency":"AUD"}`},
	{name: "refund integral decimal ok", tool: "refund_order", args: `{"order_id":"ord_1029","amount_cents":4500.0,"currency":"AUD"}`},
	{name: "refund fractional amount", tool: "refund_order", args: `{"order_id":"ord_1029","amount_cents":45.5,"currency":"AUD"}`, wantPointer: "/amount_cents", wantKeyword: "type"},
	{name: "refund amount as string", tool: "refund_order", args: `{"order_id":"ord_1029","amount_cents":"4500","currency":"AUD"}`, wantPointer: "/amount_cents", wantKeyword: "type"},
	{name: "refund amount zero", tool: "refund_order", args: `{"order_id":"ord_1029","amount_cents":0,"currency":"AUD"}`, wantPointer: "/amount_cents", wantKeyword: "minimum"},
	{name: "refund amount too big", tool: "refund_order", args: `{"order_id":"ord_1029","amount_cents":10000001,"currency":"AUD"}`, wantPointer: "/amount_cents", wantKeyword: "maximum"},
	{name: "refund bad order id", tool: "refund_order", args: `{"order_id":"1029","amount_cents":1,"currency":"AUD"}`, wantPointer: "/order_id", wantKeyword: "pattern"},
	{name: "refund lowercase currency", tool: "refund_order", args: `{"order_id":"ord_1","amount_cents":1,"currency":"aud"}`, wantPointer: "/currency", wantKeyword: "pattern"},
	{name: "refund missing currency", tool: "refund_order", args: `{"order_id":"ord_1","amount_cents":1}`, wantPointer: "/currency", wantKeyword: "required"},
	{name: "refund tenant in arguments", tool: "refund_order", args: `{"order_id":"ord_1","amount_cents":1,"currency":"AUD","tenant_id":"t_other"}`, wantPointer: "/tenant_id", wantKeyword: "additionalProperties"},
	{name: "email ok", tool: "send_email", args: `{"to":"ops@example.com","subject":"hi","body":"hello"}`},
	{name: "email format enforced", tool: "send_email", args: `{"to":"not-an-address","subject":"hi"}`, wantPointer: "/to", wantKeyword: "format"},
	{name: "email missing subject", tool: "send_email", args: `{"to":"ops@example.com"}`, wantPointer: "/subject", wantKeyword: "required"},
	{name: "email null subject", tool: "send_email", args: `{"to":"ops@example.com","subject":null}`, wantPointer: "/subject", wantKeyword: "type"},
}

func TestToolValidate(t *testing.T) {
	t.Parallel()
	r, err := Demo()
	if err != nil {
		t.Fatalf("Demo() = %v", err)
	}
	for _, tc := range validateCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tool, err := r.Lookup(tc.tool, 1)
			if err != nil {
				t.Fatalf("Lookup(%q, 1) = %v", tc.tool, err)
			}
			err = tool.Validate(decode(t, tc.args))
			valid := tc.wantPointer == "" && tc.wantKeyword == ""
			if valid {
				if err != nil {
					t.Errorf("Validate(%s) = %v; want nil", tc.args, err)
				}
				return
			}
			var ve *ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("Validate(%s) = %v; want a *ValidationError", tc.args, err)
			}
			got := [3]string{ve.Schema, ve.Pointer, ve.Keyword}
			want := [3]string{tool.SchemaID(), tc.wantPointer, tc.wantKeyword}
			if got != want {
				t.Errorf("Validate(%s) = %+v; want schema, pointer, keyword %q", tc.args, ve, want)
			}
			if ve.Reason == "" {
				t.Errorf("Validate(%s).Reason is empty", tc.args)
			}
		})
	}
}

// TestValidateDeepPointer checks pointers below the top level and that the
// deepest failure wins over a shallower one.
func TestValidateDeepPointer(t *testing.T) {
	t.Parallel()
	file := strings.Replace(toolJSON, `"properties": {"x": {"type": "string"}}`, `"required": ["items"],
    "properties": {"items": {"type": "array", "items": {
      "type": "object", "additionalProperties": false, "required": ["sku"],
      "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}}}}`, 1)
	r, err := Load(mapFS(map[string]string{"tools/t.v1.json": file}))
	if err != nil {
		t.Fatalf("Load() = %v", err)
	}
	tool, _ := r.Lookup("t", 1)
	tests := []struct {
		name string
		args string
		want *ValidationError
	}{
		{name: "nested extra", args: `{"items":[{"sku":"a"},{"sku":"b","colour":"red"}]}`,
			want: &ValidationError{Pointer: "/items/1/colour", Keyword: "additionalProperties"}},
		{name: "nested missing", args: `{"items":[{"qty":1}]}`,
			want: &ValidationError{Pointer: "/items/0/sku", Keyword: "required"}},
		{name: "deepest wins", args: `{"extra":1,"items":[{"sku":"a","qty":0}]}`,
			want: &ValidationError{Pointer: "/items/0/qty", Keyword: "minimum"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := tool.Validate(decode(t, tc.args))
			var ve *ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("Validate(%s) = %v; want a *ValidationError", tc.args, err)
			}
			got := &ValidationError{Pointer: ve.Pointer, Keyword: ve.Keyword}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("Validate(%s) mismatch (-want +got):\n%s", tc.args, diff)
			}
		})
	}
}

// TestValidateDoesNotEchoValues: a reason may reach a denied event, and the
// value may sit in a redacted field.
func TestValidateDoesNotEchoValues(t *testing.T) {
	t.Parallel()
	r, err := Demo()
	if err != nil {
		t.Fatalf("Demo() = %v", err)
	}
	const secret = "s3cr3t-value"
	tests := []struct{ name, tool, args string }{
		{name: "pattern", tool: "refund_order", args: `{"order_id":"` + secret + `","amount_cents":1,"currency":"AUD"}`},
		{name: "format", tool: "send_email", args: `{"to":"` + secret + `","subject":"x"}`},
		{name: "maximum", tool: "refund_order", args: `{"order_id":"ord_1","amount_cents":987654321,"currency":"AUD"}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tool, _ := r.Lookup(tc.tool, 1)
			err := tool.Validate(decode(t, tc.args))
			if err == nil {
				t.Fatalf("Validate(%s) = nil; want an error", tc.args)
			}
			for _, s := range []string{secret, "987654321"} {
				if strings.Contains(err.Error(), s) {
					t.Errorf("Validate(%s) = %q; want no echo of %q", tc.args, err, s)
				}
			}
		})
	}
}

func TestValidateNotCompiled(t *testing.T) {
	t.Parallel()
	var tool Tool
	var ve *ValidationError
	if err := tool.Validate(map[string]any{}); !errors.As(err, &ve) {
		t.Errorf("zero Tool.Validate() = %v; want a *ValidationError", err)
	}
}

func TestValidateNonJSONValue(t *testing.T) {
	t.Parallel()
	r, _ := Demo()
	tool, _ := r.Lookup("get_weather", 1)
	var ve *ValidationError
	if err := tool.Validate(map[string]any{"city": struct{}{}}); !errors.As(err, &ve) {
		t.Errorf("Validate(struct) = %v; want a *ValidationError", err)
	}
}

const validEnvelope = `{
  "tool": "refund_order",
  "tool_version": 3,
  "call_id": "call_7f3a",
  "arguments": {"order_id": "ord_1029", "amount_cents": 4500, "currency": "AUD"},
  "scope": {"tenant_id": "t_acme", "user_id": "u_88", "on_behalf_of": "u_88", "purpose": "customer_refund_after_dispute"},
  "trace_id": "tr_5c1e",
  "deadline_ms": 8000,
  "idempotency_key": "run_42:step_7:refund_order",
  "arguments_hash": "sha256:0000000000000000000000000000000000000000000000000000000000000000",
  "assertion": "eyJ.x.y"
}`

// envelopeCases mutate validEnvelope's top level (or scope when scope is
// true): set a field to raw JSON, or delete it when raw is "".
var envelopeCases = []struct {
	name        string
	scope       bool
	field       string
	raw         string
	wantPointer string
	wantKeyword string
}{
	{name: "valid"},
	{name: "minimal", field: "assertion", raw: ""},
	{name: "unknown top-level", field: "tenant", raw: `"t"`, wantPointer: "/tenant", wantKeyword: "additionalProperties"},
	{name: "unknown scope field", scope: true, field: "role", raw: `"admin"`, wantPointer: "/scope/role", wantKeyword: "additionalProperties"},
	{name: "missing tool", field: "tool", raw: "", wantPointer: "/tool", wantKeyword: "required"},
	{name: "missing arguments_hash", field: "arguments_hash", raw: "", wantPointer: "/arguments_hash", wantKeyword: "required"},
	{name: "missing scope", field: "scope", raw: "", wantPointer: "/scope", wantKeyword: "required"},
	{name: "missing tenant", scope: true, field: "tenant_id", raw: "", wantPointer: "/scope/tenant_id", wantKeyword: "required"},
	{name: "tenant with slash", scope: true, field: "tenant_id", raw: `"t/acme"`, wantPointer: "/scope/tenant_id", wantKeyword: "pattern"},
	{name: "tenant empty", scope: true, field: "tenant_id", raw: `""`, wantPointer: "/scope/tenant_id", wantKeyword: "pattern"},
	{name: "tool uppercase", field: "tool", raw: `"Refund"`, wantPointer: "/tool", wantKeyword: "pattern"},
	{name: "tool_version zero", field: "tool_version", raw: `0`, wantPointer: "/tool_version", wantKeyword: "minimum"},
	{name: "tool_version string", field: "tool_version", raw: `"3"`, wantPointer: "/tool_version", wantKeyword: "type"},
	{name: "tool_version fraction", field: "tool_version", raw: `3.5`, wantPointer: "/tool_version", wantKeyword: "type"},
	{name: "deadline too long", field: "deadline_ms", raw: `3600001`, wantPointer: "/deadline_ms", wantKeyword: "maximum"},
	{name: "idempotency key empty", field: "idempotency_key", raw: `""`, wantPointer: "/idempotency_key", wantKeyword: "minLength"},
	{name: "idempotency key control char", field: "idempotency_key", raw: `"a\nb"`, wantPointer: "/idempotency_key", wantKeyword: "pattern"},
	{name: "idempotency key too long", field: "idempotency_key", raw: `"` + strings.Repeat("k", 256) + `"`, wantPointer: "/idempotency_key", wantKeyword: "maxLength"},
	{name: "hash uppercase", field: "arguments_hash", raw: `"sha256:` + strings.Repeat("A", 64) + `"`, wantPointer: "/arguments_hash", wantKeyword: "pattern"},
	{name: "arguments array", field: "arguments", raw: `[]`, wantPointer: "/arguments", wantKeyword: "type"},
	{name: "assertion too long", field: "assertion", raw: `"` + strings.Repeat("a", 16385) + `"`, wantPointer: "/assertion", wantKeyword: "maxLength"},
}

func TestValidateEnvelope(t *testing.T) {
	t.Parallel()
	for _, tc := range envelopeCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := decode(t, validEnvelope).(map[string]any)
			target := env
			if tc.scope {
				target = env["scope"].(map[string]any)
			}
			if tc.field != "" {
				if tc.raw == "" {
					delete(target, tc.field)
				} else {
					target[tc.field] = decode(t, tc.raw)
				}
			}
			err := ValidateEnvelope(env)
			if tc.wantKeyword == "" {
				if err != nil {
					t.Errorf("ValidateEnvelope() = %v; want nil", err)
				}
				return
			}
			var ve *ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("ValidateEnvelope() = %v; want a *ValidationError", err)
			}
			got := [3]string{ve.Schema, ve.Pointer, ve.Keyword}
			want := [3]string{EnvelopeSchemaID, tc.wantPointer, tc.wantKeyword}
			if got != want {
				t.Errorf("ValidateEnvelope() = %+v; want schema, pointer, keyword %q", ve, want)
			}
		})
	}
}

func TestEnvelopeSchemaEmbedded(t *testing.T) {
	t.Parallel()
	var doc struct {
		ID     string `json:"$id"`
		Schema string `json:"$schema"`
	}
	if err := json.Unmarshal(EnvelopeSchema(), &doc); err != nil {
		t.Fatalf("EnvelopeSchema() is not JSON: %v", err)
	}
	if doc.ID != EnvelopeSchemaID || doc.Schema != Draft202012 {
		t.Errorf("EnvelopeSchema() $id, $schema = %q, %q; want %q, %q", doc.ID, doc.Schema, EnvelopeSchemaID, Draft202012)
	}
}

// TestValidateAllocs guards compile-once: compiling even a small schema
// allocates thousands of objects (it is checked against the meta-schema),
// validating a small document a few dozen.
func TestValidateAllocs(t *testing.T) {
	r, err := Demo()
	if err != nil {
		t.Fatalf("Demo() = %v", err)
	}
	tool, _ := r.Lookup("refund_order", 1)
	args := decode(t, `{"order_id":"ord_1029","amount_cents":4500,"currency":"AUD"}`)
	allocs := testing.AllocsPerRun(100, func() {
		if err := tool.Validate(args); err != nil {
			t.Fatalf("Validate() = %v", err)
		}
	})
	if allocs > 200 {
		t.Errorf("Validate() allocates %v objects per call; want <= 200 (is it compiling?)", allocs)
	}
}

func BenchmarkValidate(b *testing.B) {
	r, err := Demo()
	if err != nil {
		b.Fatalf("Demo() = %v", err)
	}
	benches := []struct{ name, tool, args string }{
		{name: "refund_order/valid", tool: "refund_order", args: `{"order_id":"ord_1029","amount_cents":4500,"currency":"AUD","reason":"dispute"}`},
		{name: "refund_order/invalid", tool: "refund_order", args: `{"order_id":"ord_1029","amount_cents":0,"currency":"AUD","x":1}`},
		{name: "send_email/valid", tool: "send_email", args: `{"to":"ops@example.com","subject":"hi","body":"` + strings.Repeat("x", 10000) + `"}`},
	}
	for _, bc := range benches {
		b.Run(bc.name, func(b *testing.B) {
			tool, err := r.Lookup(bc.tool, 1)
			if err != nil {
				b.Fatal(err)
			}
			args := decode(b, bc.args)
			b.SetBytes(int64(len(bc.args)))
			b.ReportAllocs()
			for b.Loop() {
				_ = tool.Validate(args)
			}
		})
	}
}

// TestValidatePathologicalNumber: the library panics on a number big.Rat
// refuses (over 1e6 fraction digits); Validate reports a failure instead.
func TestValidatePathologicalNumber(t *testing.T) {
	t.Parallel()
	r, _ := Demo()
	tool, _ := r.Lookup("refund_order", 1)
	huge := json.Number("1." + strings.Repeat("0", 1_000_001))
	args := map[string]any{"order_id": "ord_1", "amount_cents": huge, "currency": "AUD"}
	var ve *ValidationError
	if err := tool.Validate(args); !errors.As(err, &ve) || ve.Pointer != "" {
		t.Errorf("Validate(1.000...) = %v; want a *ValidationError", err)
	}
}

// A value a "not" rules out (an idempotency key "." or "..") is said to
// be so: the library's own message, "not failed", was the refusal's
// whole detail.
func TestValidateNotSaysWhat(t *testing.T) {
	env := decode(t, validEnvelope).(map[string]any)
	env["idempotency_key"] = "."
	var ve *ValidationError
	if err := ValidateEnvelope(env); !errors.As(err, &ve) {
		t.Fatalf("ValidateEnvelope() = %v; want a *ValidationError", err)
	}
	if ve.Pointer != "/idempotency_key" || ve.Keyword != "not" || !strings.Contains(ve.Reason, "rules out") {
		t.Errorf("ValidateEnvelope() = %+v; want /idempotency_key's \"not\", saying the value is ruled out", ve)
	}
}
