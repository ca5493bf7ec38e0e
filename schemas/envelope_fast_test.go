package schemas

import (
	"strings"
	"testing"
)

// envelopeBounds set one member of validEnvelope (in scope when scope) to
// raw JSON, on each side of each bound of the envelope schema: schema is
// whether the schema accepts the result, fast whether the fast path does
// (it may leave a valid envelope to the schema, never accept an invalid
// one).
var envelopeBounds = []struct {
	scope        bool
	field, raw   string
	schema, fast bool
}{
	{field: "tool", raw: `"a"`, schema: true, fast: true},
	{field: "tool", raw: `"a_9"`, schema: true, fast: true},
	{field: "tool", raw: `"` + strings.Repeat("a", 64) + `"`, schema: true, fast: true},
	{field: "tool", raw: `"` + strings.Repeat("a", 65) + `"`},
	{field: "tool", raw: `""`},
	{field: "tool", raw: `"a-b"`},
	{field: "tool", raw: `"_a"`},
	{field: "tool", raw: `"9a"`},
	{field: "tool", raw: `"é"`},
	{field: "tool", raw: `"a\n"`},
	{field: "tool", raw: `7`},
	{field: "tool_version", raw: `1`, schema: true, fast: true},
	{field: "tool_version", raw: `2147483647`, schema: true, fast: true},
	{field: "tool_version", raw: `2147483648`},
	{field: "tool_version", raw: `0`},
	{field: "tool_version", raw: `-1`},
	{field: "tool_version", raw: `3.0`, schema: true},
	{field: "tool_version", raw: `1e2`, schema: true},
	{field: "tool_version", raw: `1e10`},
	{field: "tool_version", raw: `99999999999999999999`},
	{field: "tool_version", raw: `null`},
	{field: "call_id", raw: `"x"`, schema: true, fast: true},
	{field: "call_id", raw: `""`},
	{field: "call_id", raw: `"` + strings.Repeat("c", 255) + `"`, schema: true, fast: true},
	{field: "call_id", raw: `"` + strings.Repeat("c", 256) + `"`},
	{field: "call_id", raw: `"` + strings.Repeat("é", 255) + `"`, schema: true, fast: true},
	{field: "call_id", raw: `"` + strings.Repeat("é", 256) + `"`},
	{field: "call_id", raw: `"a\u007fb"`},
	{field: "call_id", raw: `"a\tb"`},
	{field: "call_id", raw: `"a\u0000b"`},
	{field: "call_id", raw: `"a\u0080b"`, schema: true, fast: true},
	{field: "arguments", raw: `{}`, schema: true, fast: true},
	{field: "arguments", raw: `null`},
	{field: "arguments", raw: `"{}"`},
	{scope: true, field: "tenant_id", raw: `"a"`, schema: true, fast: true},
	{scope: true, field: "tenant_id", raw: `"A9.b:c-d_e"`, schema: true, fast: true},
	{scope: true, field: "tenant_id", raw: `"` + strings.Repeat("t", 128) + `"`, schema: true, fast: true},
	{scope: true, field: "tenant_id", raw: `"` + strings.Repeat("t", 129) + `"`},
	{scope: true, field: "tenant_id", raw: `".a"`},
	{scope: true, field: "tenant_id", raw: `"a b"`},
	{scope: true, field: "tenant_id", raw: `"aé"`},
	{scope: true, field: "tenant_id", raw: `"a/b"`},
	{scope: true, field: "user_id", raw: `""`, schema: true, fast: true},
	{scope: true, field: "user_id", raw: `"` + strings.Repeat("u", 255) + `"`, schema: true, fast: true},
	{scope: true, field: "user_id", raw: `"` + strings.Repeat("u", 256) + `"`},
	{scope: true, field: "on_behalf_of", raw: `"a\rb"`},
	{scope: true, field: "on_behalf_of", raw: `"` + strings.Repeat("o", 256) + `"`},
	{scope: true, field: "purpose", raw: `"` + strings.Repeat("p", 1024) + `"`, schema: true, fast: true},
	{scope: true, field: "purpose", raw: `"` + strings.Repeat("p", 1025) + `"`},
	{scope: true, field: "purpose", raw: `5`},
	{scope: true, field: "role", raw: `"admin"`},
	{field: "scope", raw: `{}`},
	{field: "scope", raw: `{"tenant_id":"t"}`, schema: true, fast: true},
	{field: "scope", raw: `[]`},
	{field: "trace_id", raw: `""`, schema: true, fast: true},
	{field: "trace_id", raw: `"` + strings.Repeat("r", 256) + `"`},
	{field: "trace_id", raw: `null`},
	{field: "deadline_ms", raw: `1`, schema: true, fast: true},
	{field: "deadline_ms", raw: `3600000`, schema: true, fast: true},
	{field: "deadline_ms", raw: `3600001`},
	{field: "deadline_ms", raw: `0`},
	{field: "deadline_ms", raw: `"8000"`},
	// White space at either end of what goes out as a header (the key,
	// under its tenant; the call and trace ids) would be trimmed away by
	// the tool's reader: the executor's adapter refuses to send it, so
	// the intake refuses it first.
	{field: "idempotency_key", raw: `" "`},
	{field: "idempotency_key", raw: `"k "`},
	{field: "idempotency_key", raw: `" k"`},
	{field: "idempotency_key", raw: `"k k"`, schema: true, fast: true},
	{field: "call_id", raw: `"c "`},
	{field: "call_id", raw: `"\u00a0c"`},
	{field: "call_id", raw: `"c\u3000"`},
	{field: "call_id", raw: `"c\u0085"`},
	{field: "call_id", raw: `"c c"`, schema: true, fast: true},
	{field: "call_id", raw: `"c\u00a0c"`, schema: true, fast: true},
	{field: "trace_id", raw: `" t"`},
	{field: "trace_id", raw: `"t\u2028"`},
	{field: "trace_id", raw: `"t"`, schema: true, fast: true},
	{field: "idempotency_key", raw: `"~"`, schema: true, fast: true},
	{field: "idempotency_key", raw: `"` + strings.Repeat("k", 255) + `"`, schema: true, fast: true},
	{field: "idempotency_key", raw: `"` + strings.Repeat("k", 256) + `"`},
	{field: "idempotency_key", raw: `""`},
	{field: "idempotency_key", raw: `"."`},
	{field: "idempotency_key", raw: `".."`},
	{field: "idempotency_key", raw: `"..."`, schema: true, fast: true},
	{field: "idempotency_key", raw: `"a\u007f"`},
	{field: "idempotency_key", raw: `"é"`},
	{field: "arguments_hash", raw: `"sha256:` + strings.Repeat("0a", 32) + `"`, schema: true, fast: true},
	{field: "arguments_hash", raw: `"sha256:` + strings.Repeat("a", 63) + `"`},
	{field: "arguments_hash", raw: `"sha256:` + strings.Repeat("a", 65) + `"`},
	{field: "arguments_hash", raw: `"sha256:` + strings.Repeat("A", 64) + `"`},
	{field: "arguments_hash", raw: `"sha512:` + strings.Repeat("a", 64) + `"`},
	{field: "arguments_hash", raw: `"sha256:` + strings.Repeat("a", 64) + `\n"`},
	{field: "assertion", raw: `""`, schema: true, fast: true},
	{field: "assertion", raw: `"` + strings.Repeat("a", 8192) + `"`, schema: true, fast: true},
	{field: "assertion", raw: `"` + strings.Repeat("a", 8193) + `"`},
	{field: "tenant", raw: `"t"`},
	{field: "Tool", raw: `"refund_order"`},
}

// withBound is validEnvelope with the member of bound set.
func withBound(t testing.TB, bound int) map[string]any {
	tc := envelopeBounds[bound]
	env := decode(t, validEnvelope).(map[string]any)
	target := env
	if tc.scope {
		target = env["scope"].(map[string]any)
	}
	target[tc.field] = decode(t, tc.raw)
	return env
}

// The fast path agrees with the schema on each side of each of its bounds,
// and takes the common envelope itself.
func TestEnvelopeFastPathBoundaries(t *testing.T) {
	t.Parallel()
	for i, tc := range envelopeBounds {
		env := withBound(t, i)
		schemaOK := validateEnvelopeSchema(env) == nil
		fast := envelopeMeets(env)
		if schemaOK != tc.schema {
			t.Errorf("%s = %.40s: schema accepts %v; the case says %v", tc.field, tc.raw, schemaOK, tc.schema)
		}
		if fast != tc.fast {
			t.Errorf("%s = %.40s: fast path accepts %v; want %v", tc.field, tc.raw, fast, tc.fast)
		}
		if fast && !schemaOK {
			t.Errorf("%s = %.40s: the fast path accepts what the schema refuses", tc.field, tc.raw)
		}
	}
	// Every required member, missing.
	for _, field := range []string{"tool", "tool_version", "call_id", "arguments", "scope", "idempotency_key", "arguments_hash"} {
		env := decode(t, validEnvelope).(map[string]any)
		delete(env, field)
		if envelopeMeets(env) {
			t.Errorf("without %s: the fast path accepts it", field)
		}
	}
	env := decode(t, validEnvelope).(map[string]any)
	delete(env["scope"].(map[string]any), "tenant_id")
	if envelopeMeets(env) {
		t.Error("without scope.tenant_id: the fast path accepts it")
	}
	// What the fast path must take: the envelope agents send, and the
	// smallest one.
	for _, tc := range envelopeCases {
		if tc.wantKeyword != "" {
			continue
		}
		env := decode(t, validEnvelope).(map[string]any)
		if tc.raw == "" && tc.field != "" {
			delete(env, tc.field)
		}
		if !envelopeMeets(env) {
			t.Errorf("%s envelope: the fast path leaves it to the schema", tc.name)
		}
	}
	for _, v := range []any{nil, "x", []any{}, map[string]any{}} {
		if envelopeMeets(v) {
			t.Errorf("envelopeMeets(%#v) = true", v)
		}
	}
}

// BenchmarkValidateEnvelope: the envelope agents send, through the fast
// path and through the schema alone.
func BenchmarkValidateEnvelope(b *testing.B) {
	env := decode(b, validEnvelope)
	for _, bc := range []struct {
		name     string
		validate func(any) error
	}{{"fast", ValidateEnvelope}, {"schema", validateEnvelopeSchema}} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(validEnvelope)))
			b.ReportAllocs()
			for b.Loop() {
				if err := bc.validate(env); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
