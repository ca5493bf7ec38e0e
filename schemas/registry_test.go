package schemas

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/google/go-cmp/cmp"
)

// toolJSON is a valid registry file for tool "t" version 1, with the
// placeholders replaced by the test cases.
const toolJSON = `{
  "name": "t",
  "version": 1,
  "owner": "tests",
  "description": "a test tool",
  "input_schema": {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": false,
    "properties": {"x": {"type": "string"}}
  },
  "effect": "read",
  "risk": "low",
  "idempotency": "native",
  "backend": {"kind": "http", "url": "/tools/t", "audience": "aud"}
}`

func mapFS(files map[string]string) fstest.MapFS {
	m := fstest.MapFS{}
	for name, body := range files {
		m[name] = &fstest.MapFile{Data: []byte(body)}
	}
	return m
}

func TestDemo(t *testing.T) {
	t.Parallel()
	r, err := Demo()
	if err != nil {
		t.Fatalf("Demo() = %v", err)
	}
	type summary struct {
		Name           string
		Version        int
		Effect         Effect
		Risk           Risk
		Idempotency    Idempotency
		Redact         []string
		Resource       string
		StatusLookup   *StatusLookup
		Backend        Backend
		SchemaID       string
		HasMaxConc     bool
		HasResultBytes bool
	}
	var got []summary
	for _, tool := range r.Tools() {
		got = append(got, summary{
			Name: tool.Name, Version: tool.Version, Effect: tool.Effect, Risk: tool.Risk,
			Idempotency: tool.Idempotency, Redact: tool.Redact, Resource: tool.Resource,
			StatusLookup: tool.StatusLookup, Backend: tool.Backend, SchemaID: tool.SchemaID(),
			HasMaxConc: tool.MaxConcurrency > 0, HasResultBytes: tool.MaxResultBytes > 0,
		})
	}
	backend := func(name string) Backend {
		return Backend{Kind: "http", URL: "/tools/" + name, Audience: "demo-backend"}
	}
	id := func(name string) string { return "https://schemas.toolcall-ledger.dev/tools/" + name + ".v1.json" }
	want := []summary{
		{Name: "cancel_refund", Version: 1, Effect: EffectExternalSideEffect, Risk: RiskLow, Idempotency: IdempotencyNative,
			Redact: []string{"/reason"}, Resource: "/order_id",
			Backend: backend("cancel_refund"), SchemaID: id("cancel_refund"), HasMaxConc: true, HasResultBytes: true},
		{Name: "create_ticket", Version: 1, Effect: EffectWrite, Risk: RiskLow, Idempotency: IdempotencyNative,
			Backend: backend("create_ticket"), SchemaID: id("create_ticket"), HasMaxConc: true, HasResultBytes: true},
		{Name: "get_weather", Version: 1, Effect: EffectRead, Risk: RiskLow, Idempotency: IdempotencyNative,
			Backend: backend("get_weather"), SchemaID: id("get_weather"), HasMaxConc: true, HasResultBytes: true},
		{Name: "refund_order", Version: 1, Effect: EffectExternalSideEffect, Risk: RiskHigh, Idempotency: IdempotencyNative,
			Redact: []string{"/reason"}, Resource: "/order_id", StatusLookup: &StatusLookup{URL: "/tools/refund_order/status"},
			Backend: backend("refund_order"), SchemaID: id("refund_order"), HasMaxConc: true, HasResultBytes: true},
		{Name: "send_email", Version: 1, Effect: EffectExternalSideEffect, Risk: RiskHigh, Idempotency: IdempotencyNone,
			Redact: []string{"/body"}, Backend: backend("send_email"), SchemaID: id("send_email"), HasMaxConc: true, HasResultBytes: true},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Demo().Tools() mismatch (-want +got):\n%s", diff)
	}
}

func TestLookup(t *testing.T) {
	t.Parallel()
	r, err := Demo()
	if err != nil {
		t.Fatalf("Demo() = %v", err)
	}
	a, err := r.Lookup("refund_order", 1)
	if err != nil {
		t.Fatalf("Lookup(refund_order, 1) = %v", err)
	}
	b, _ := r.Lookup("refund_order", 1)
	if a != b {
		t.Errorf("Lookup returned %p then %p; want the same compiled *Tool", a, b)
	}
	if a.schema == nil {
		t.Errorf("Lookup(refund_order, 1).schema = nil; want compiled at load")
	}

	tests := []struct {
		name    string
		tool    string
		version int
		want    error
	}{
		{name: "unknown tool", tool: "drop_database", version: 1, want: ErrUnknownTool},
		{name: "unknown version", tool: "refund_order", version: 2, want: ErrUnknownVersion},
		{name: "case variant name", tool: "Refund_Order", version: 1, want: ErrUnknownTool},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := r.Lookup(tc.tool, tc.version)
			if !errors.Is(err, tc.want) || got != nil {
				t.Errorf("Lookup(%q, %d) = %v, %v; want nil, %v", tc.tool, tc.version, got, err, tc.want)
			}
		})
	}
}

func TestLoadDefaults(t *testing.T) {
	t.Parallel()
	r, err := Load(mapFS(map[string]string{"tools/t.v1.json": toolJSON}))
	if err != nil {
		t.Fatalf("Load() = %v", err)
	}
	tool, err := r.Lookup("t", 1)
	if err != nil {
		t.Fatalf("Lookup(t, 1) = %v", err)
	}
	if got, want := tool.Timeout(), DefaultTimeout; got != want {
		t.Errorf("Timeout() = %v; want %v", got, want)
	}
	if got, want := tool.MaxConcurrency, DefaultMaxConcurrency; got != want {
		t.Errorf("MaxConcurrency = %d; want %d", got, want)
	}
	if got, want := tool.MaxResultBytes, DefaultMaxResultBytes; got != want {
		t.Errorf("MaxResultBytes = %d; want %d", got, want)
	}
}

func TestLoadDirFS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "tools"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tools", "t.v1.json"), []byte(toolJSON), 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := Load(os.DirFS(dir))
	if err != nil {
		t.Fatalf("Load(os.DirFS) = %v", err)
	}
	if got := len(r.Tools()); got != 1 {
		t.Errorf("len(Tools()) = %d; want 1", got)
	}
}

func TestLoadErrors(t *testing.T) {
	t.Parallel()
	sub := func(old, new string) string {
		if !strings.Contains(toolJSON, old) {
			panic("test fixture lacks " + old)
		}
		return strings.Replace(toolJSON, old, new, 1)
	}
	const okSchema = `"additionalProperties": false,`
	tests := []struct {
		name    string
		files   map[string]string
		wantIn  []string // substrings of the error, the file name first
		invalid bool     // error wraps ErrInvalidTool
	}{
		{name: "no files", files: map[string]string{"README": "x"}, wantIn: []string{"no tool files"}},
		{name: "bad json", files: map[string]string{"tools/t.v1.json": `{"name": "t",`},
			wantIn: []string{"tools/t.v1.json"}, invalid: true},
		{name: "trailing data", files: map[string]string{"tools/t.v1.json": toolJSON + `{}`},
			wantIn: []string{"tools/t.v1.json", "trailing"}, invalid: true},
		{name: "unknown field", files: map[string]string{"tools/t.v1.json": sub(`"owner"`, `"ownr": "x", "owner"`)},
			wantIn: []string{"tools/t.v1.json", "ownr"}, invalid: true},
		{name: "unknown nested field", files: map[string]string{"tools/t.v1.json": sub(`"audience": "aud"`, `"audience": "aud", "token": "x"`)},
			wantIn: []string{"tools/t.v1.json", "token"}, invalid: true},
		{name: "bad effect", files: map[string]string{"tools/t.v1.json": sub(`"effect": "read"`, `"effect": "delete"`)},
			wantIn: []string{"tools/t.v1.json", "effect", "delete"}, invalid: true},
		{name: "bad risk", files: map[string]string{"tools/t.v1.json": sub(`"risk": "low"`, `"risk": "LOW"`)},
			wantIn: []string{"tools/t.v1.json", "risk"}, invalid: true},
		{name: "bad idempotency", files: map[string]string{"tools/t.v1.json": sub(`"idempotency": "native"`, `"idempotency": "maybe"`)},
			wantIn: []string{"tools/t.v1.json", "idempotency"}, invalid: true},
		{name: "bad backend kind", files: map[string]string{"tools/t.v1.json": sub(`"kind": "http"`, `"kind": "grpc"`)},
			wantIn: []string{"tools/t.v1.json", "backend.kind"}, invalid: true},
		{name: "negative timeout", files: map[string]string{"tools/t.v1.json": sub(`"effect"`, `"timeout_ms": -1, "effect"`)},
			wantIn: []string{"tools/t.v1.json", "timeout_ms"}, invalid: true},
		{name: "negative credential skew", files: map[string]string{"tools/t.v1.json": sub(`"audience": "aud"`, `"audience": "aud", "credential_skew_ms": -1`)},
			wantIn: []string{"tools/t.v1.json", "backend.credential_skew_ms"}, invalid: true},
		{name: "credential skew past an hour", files: map[string]string{"tools/t.v1.json": sub(`"audience": "aud"`, `"audience": "aud", "credential_skew_ms": 3600001`)},
			wantIn: []string{"tools/t.v1.json", "backend.credential_skew_ms", "3600000"}, invalid: true},
		{name: "bad resource pointer", files: map[string]string{"tools/t.v1.json": sub(`"effect"`, `"resource": "order_id", "effect"`)},
			wantIn: []string{"tools/t.v1.json", "resource"}, invalid: true},
		{name: "resource version without its url", files: map[string]string{"tools/t.v1.json": sub(`"effect"`, `"resource": "/x", "resource_version": {"if_match": true}, "effect"`)},
			wantIn: []string{"tools/t.v1.json", "resource_version.url"}, invalid: true},
		{name: "resource version without a resource", files: map[string]string{"tools/t.v1.json": sub(`"effect"`, `"resource_version": {"url": "/v"}, "effect"`)},
			wantIn: []string{"tools/t.v1.json", "resource_version needs resource"}, invalid: true},
		{name: "name mismatch", files: map[string]string{"tools/u.v1.json": toolJSON},
			wantIn: []string{"tools/u.v1.json", "t.v1", "u.v1"}, invalid: true},
		{name: "version mismatch", files: map[string]string{"tools/t.v2.json": toolJSON},
			wantIn: []string{"tools/t.v2.json", "t.v1", "t.v2"}, invalid: true},
		{name: "bad file name", files: map[string]string{"tools/t.json": toolJSON},
			wantIn: []string{"tools/t.json", "<name>.v<version>.json"}, invalid: true},
		{name: "leading zero version", files: map[string]string{"tools/t.v01.json": toolJSON},
			wantIn: []string{"tools/t.v01.json"}, invalid: true},
		{name: "schema allows additional properties", files: map[string]string{"tools/t.v1.json": sub(okSchema, `"additionalProperties": true,`)},
			wantIn: []string{"tools/t.v1.json", "additionalProperties"}, invalid: true},
		{name: "schema lacks additionalProperties", files: map[string]string{"tools/t.v1.json": sub(okSchema, ``)},
			wantIn: []string{"tools/t.v1.json", "additionalProperties"}, invalid: true},
		{name: "nested object open", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "object", "properties": {"y": {"type": "string"}}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x", "additionalProperties"}, invalid: true},
		{name: "nested object allowing anything", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "object", "additionalProperties": {}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x"}, invalid: true},
		{name: "object in an array open", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "array", "items": {"type": "object"}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/items"}, invalid: true},
		{name: "nullable object open", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": ["object", "null"]}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x"}, invalid: true},
		{name: "nested object allowing annotated anything", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "object", "additionalProperties": {"description": "any"}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x"}, invalid: true},
		{name: "object in a $defs open", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"$ref": "#/$defs/a~1b"}}, "$defs": {"a/b": {"type": "object"}`)},
			wantIn: []string{"tools/t.v1.json", "/$defs/a~1b"}, invalid: true},
		{name: "member that admits anything", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x"}, invalid: true},
		{name: "member of annotations alone", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"description": "free-form"}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x"}, invalid: true},
		{name: "member true", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `true`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x"}, invalid: true},
		{name: "member only a not", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"not": {"type": "string"}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x"}, invalid: true},
		{name: "member anyOf with an open branch", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"anyOf": [{"type": "string"}, {}]}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x"}, invalid: true},
		{name: "pattern property that admits anything", files: map[string]string{"tools/t.v1.json": sub(okSchema, okSchema+` "patternProperties": {"^p_": {}},`)},
			wantIn: []string{"tools/t.v1.json", "/patternProperties/^p_"}, invalid: true},
		{name: "dependent schema's member open", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`,
			`{"type": "object", "unevaluatedProperties": false, "properties": {"method": {"enum": ["card"]}}, "dependentSchemas": {"method": {"properties": {"details": {"type": "object"}}}}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/dependentSchemas/method/properties/details"}, invalid: true},
		// draft 7's dependencies, which the validator still applies.
		{name: "dependencies' member open", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`,
			`{"type": "object", "unevaluatedProperties": false, "properties": {"method": {"enum": ["card"]}}, "dependencies": {"method": {"properties": {"details": {"type": "object"}}}}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/dependencies/method/properties/details"}, invalid: true},
		{name: "if's member open", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`,
			`{"type": "object", "unevaluatedProperties": false, "properties": {"k": {"type": "string"}}, "if": {"properties": {"extra": {"type": "object"}}}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/if/properties/extra"}, invalid: true},
		{name: "a branch's unevaluatedProperties admitting anything", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`,
			`{"type": "object", "unevaluatedProperties": false, "properties": {"env": {"enum": ["prod", "dev"]}}, "allOf": [{"unevaluatedProperties": {"maxLength": 64}}]}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/allOf/0/unevaluatedProperties"}, invalid: true},
		{name: "contains admitting items", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`,
			`{"type": "array", "unevaluatedItems": false, "contains": {"minLength": 1}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/contains"}, invalid: true},
		{name: "array without items", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "array"}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/items"}, invalid: true},
		{name: "array item that admits anything", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "array", "prefixItems": [{"type": "string"}, {"title": "t"}], "items": false}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/prefixItems/1"}, invalid: true},
		{name: "schema not an object type", files: map[string]string{"tools/t.v1.json": sub(`"type": "object"`, `"type": "array"`)},
			wantIn: []string{"tools/t.v1.json", "object"}, invalid: true},
		{name: "schema other draft", files: map[string]string{"tools/t.v1.json": sub(`2020-12/schema`, `2019-09/schema`)},
			wantIn: []string{"tools/t.v1.json", "$schema"}, invalid: true},
		{name: "schema foreign id", files: map[string]string{"tools/t.v1.json": sub(`"type": "object"`, `"$id": "https://evil.example/x.json", "type": "object"`)},
			wantIn: []string{"tools/t.v1.json", "$id"}, invalid: true},
		{name: "schema invalid keyword value", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "strng"}`)},
			wantIn: []string{"tools/t.v1.json", "input_schema"}, invalid: true},
		// A $ref names a place openObject does not walk: the schema
		// there is checked all the same.
		{name: "object open where a $ref names it", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`,
			`{"$ref": "#/components/address"}}, "components": {"address": {"type": "object", "properties": {"city": {"type": "string"}}}`)},
			wantIn: []string{"tools/t.v1.json", "/components/address", "lets objects through open"}, invalid: true},
		// A property named as a data keyword is a schema all the same,
		// its $ref checked.
		{name: "object open where a property named default refers", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`,
			`{"type": "string"}, "default": {"$ref": "#/components/settings"}}, "components": {"settings": {"type": "object"}`)},
			wantIn: []string{"tools/t.v1.json", "/components/settings", "lets objects through open"}, invalid: true},
		{name: "ref with percent-escapes", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`,
			`{"$ref": "#/components/a%2Fb"}}, "components": {"a": {"b": {"type": "string"}}, "a/b": {"type": "object"}`)},
			wantIn: []string{"tools/t.v1.json", "percent-escapes"}, invalid: true},
		{name: "open object under not, named by a $ref", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`,
			`{"$ref": "#/properties/y/not"}, "y": {"type": "string", "not": {"type": "object"}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/y/not", "lets objects through open"}, invalid: true},
		{name: "meta-schema ref", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"$ref": "https://json-schema.org/draft/2020-12/schema"}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x", "external $refs"}, invalid: true},
		{name: "anchor ref", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"$ref": "#addr"}}, "$defs": {"a": {"$anchor": "addr", "type": "string"}`)},
			wantIn: []string{"tools/t.v1.json", "anchors"}, invalid: true},
		{name: "dynamic ref", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"$dynamicRef": "#/$defs/a"}}, "$defs": {"a": {"type": "string"}`)},
			wantIn: []string{"tools/t.v1.json", "$dynamicRef"}, invalid: true},
		{name: "nested $id", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"$id": "https://example.com/sub", "type": "string"}`)},
			wantIn: []string{"tools/t.v1.json", "the $id at /properties/x is not allowed"}, invalid: true},
		{name: "ref naming nothing", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"$ref": "#/$defs/missing"}`)},
			wantIn: []string{"tools/t.v1.json", "names nothing"}, invalid: true},
		{name: "schema external ref", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"$ref": "file:///etc/passwd"}`)},
			wantIn: []string{"tools/t.v1.json", "external $ref"}, invalid: true},
		// Keywords that would check nothing: a format the validator does
		// not know, a misspelt keyword, the content vocabulary (not
		// asserted), deep inside the schema too. Before, each loaded and
		// let any value through.
		{name: "format not checked", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "string", "format": "idn-email"}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/format", `format the validator does not check ("idn-email")`}, invalid: true},
		{name: "format of another spec", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "integer", "format": "int32"}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/format", `"int32"`}, invalid: true},
		{name: "misspelt keyword", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "string", "maxlenght": 3}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/maxlenght", "no keyword"}, invalid: true},
		{name: "content keyword", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "string", "contentEncoding": "base64"}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/contentEncoding", "no keyword"}, invalid: true},
		{name: "misspelt keyword in a branch", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"anyOf": [{"type": "string", "minimun": 1}, {"type": "null"}]}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/anyOf/0/minimun"}, invalid: true},
		{name: "format of no string", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "integer", "format": "uuid"}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/format", "admits no string"}, invalid: true},
		{name: "then without if", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "string", "then": {"maxLength": 3}}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/then", `beside "if"`}, invalid: true},
		{name: "maxContains without contains", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "array", "items": {"type": "string"}, "maxContains": 1}`)},
			wantIn: []string{"tools/t.v1.json", "/properties/x/maxContains", `beside "contains"`}, invalid: true},
		// A member named twice, or in two cases: encoding/json took the
		// last, which a reviewer reading the first would not see.
		{name: "member named twice", files: map[string]string{"tools/t.v1.json": sub(`"effect"`, `"risk": "low", "effect"`)},
			wantIn: []string{"tools/t.v1.json", `the object at / names "risk" twice`}, invalid: true},
		{name: "member in another case", files: map[string]string{"tools/t.v1.json": sub(`"effect"`, `"Risk": "low", "effect"`)},
			wantIn: []string{"tools/t.v1.json", `the object at / names "Risk" and "risk", which differ only in case`}, invalid: true},
		{name: "member in a look-alike case", files: map[string]string{"tools/t.v1.json": sub(`"effect"`, `"riſk": "low", "effect"`)},
			wantIn: []string{"tools/t.v1.json", "which differ only in case"}, invalid: true},
		{name: "schema member named twice", files: map[string]string{"tools/t.v1.json": sub(`{"type": "string"}`, `{"type": "string", "maxLength": 3, "maxLength": 300}`)},
			wantIn: []string{"tools/t.v1.json", `the object at /input_schema/properties/x names "maxLength" twice`}, invalid: true},
		{name: "compensation unknown", files: map[string]string{"tools/t.v1.json": sub(`"effect"`, `"compensation": {"tool": "undo_t", "version": 1}, "effect"`)},
			wantIn: []string{"tools/t.v1.json", "compensation", "undo_t"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r, err := Load(mapFS(tc.files))
			if err == nil {
				t.Fatalf("Load() = %v, nil; want an error", r)
			}
			for _, s := range tc.wantIn {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("Load() error %q; want it to contain %q", err, s)
				}
			}
			if got := errors.Is(err, ErrInvalidTool); got != tc.invalid {
				t.Errorf("errors.Is(%v, ErrInvalidTool) = %v; want %v", err, got, tc.invalid)
			}
		})
	}
}

func TestLoadCompensation(t *testing.T) {
	t.Parallel()
	undo := strings.Replace(strings.Replace(toolJSON, `"name": "t"`, `"name": "undo_t"`, 1), `"effect": "read"`, `"effect": "write"`, 1)
	main := strings.Replace(toolJSON, `"effect"`, `"compensation": {"tool": "undo_t", "version": 1}, "effect"`, 1)
	r, err := Load(mapFS(map[string]string{"tools/t.v1.json": main, "tools/undo_t.v1.json": undo}))
	if err != nil {
		t.Fatalf("Load() = %v", err)
	}
	tool, _ := r.Lookup("t", 1)
	if diff := cmp.Diff(&ToolRef{Tool: "undo_t", Version: 1}, tool.Compensation); diff != "" {
		t.Errorf("Compensation mismatch (-want +got):\n%s", diff)
	}
}

// Objects inside the arguments load when they are closed, or say the
// schema of the members they allow, and validation holds them to it.
func TestLoadNestedObjectsClosed(t *testing.T) {
	t.Parallel()
	// A closed object, a map, a tagged union closed by its
	// unevaluatedProperties, a conditional on a closed object, and an
	// object that names a closed definition.
	src := strings.Replace(toolJSON, `"properties": {"x": {"type": "string"}}`,
		`"properties": {"x": {"type": "object", "additionalProperties": false, "properties": {"y": {"type": "string"}}},
		"m": {"type": "object", "additionalProperties": {"type": "string"}},
		"u": {"type": "object", "unevaluatedProperties": false, "oneOf": [
			{"properties": {"kind": {"const": "a"}, "a": {"type": "string"}}, "required": ["kind"]},
			{"properties": {"kind": {"const": "b"}, "b": {"type": "integer"}}, "required": ["kind"]}]},
		"c": {"type": "object", "additionalProperties": false, "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
			"if": {"properties": {"kind": {"const": "n"}}}, "then": {"required": ["n"]}},
		"r": {"type": "object", "$ref": "#/$defs/closed"},
		"s": {"description": "annotated", "type": "string"},
		"o": {"anyOf": [{"type": "string"}, {"type": "null"}]},
		"a": {"allOf": [{"type": "integer"}, {"description": "a branch of annotations"}]},
		"l": {"type": "array", "items": {"type": "string"}},
		"e": {"enum": ["x", "y"]},
		"d": {"type": "object", "unevaluatedProperties": false, "properties": {"method": {"enum": ["card"]}},
			"dependentSchemas": {"method": {"properties": {"last4": {"type": "string"}}}}},
		"k": {"type": "array", "items": {"type": "string"}, "contains": {"minLength": 1}},
		"g": {"type": "array", "items": {"type": "string"}, "allOf": [{"contains": {"pattern": "^env:"}}, {"contains": {"pattern": "^team:"}}]},
		"p": {"type": "object", "additionalProperties": false,
			"properties": {"payment": {"type": "object", "additionalProperties": false, "properties": {"method": {"enum": ["card", "cash"]}}}, "card_token": {"type": "string"}},
			"if": {"properties": {"payment": {"properties": {"method": {"const": "card"}}}}}, "then": {"required": ["card_token"]}}},
		"$defs": {"closed": {"type": "object", "additionalProperties": false, "properties": {"z": {"type": "string"}}}}`, 1)
	r, err := Load(mapFS(map[string]string{"tools/t.v1.json": src}))
	if err != nil {
		t.Fatalf("Load() = %v", err)
	}
	tool, err := r.Lookup("t", 1)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args string
		ok   bool
	}{
		{`{"x": {"y": "a"}, "m": {"k": "v"}}`, true},
		{`{"x": {"y": "a", "z": "smuggled"}}`, false},
		{`{"m": {"k": 1}}`, false},
		{`{"u": {"kind": "a", "a": "x"}}`, true},
		{`{"u": {"kind": "a", "a": "x", "smuggled": 1}}`, false},
		{`{"c": {"kind": "n", "n": 1}}`, true},
		{`{"r": {"z": "x", "smuggled": 1}}`, false},
		{`{"s": "x", "o": null, "a": 1, "l": ["x"], "e": "y"}`, true},
		{`{"l": [{"smuggled": 1}]}`, false},
		{`{"d": {"method": "card", "last4": "4242"}, "k": ["x"]}`, true},
		{`{"d": {"method": "card", "details": {"pan": "4242424242424242"}}}`, false},
		{`{"k": [{"smuggled": 1}]}`, false},
		{`{"g": ["env:prod", "team:a"], "p": {"payment": {"method": "card"}, "card_token": "t"}}`, true},
		{`{"g": ["env:prod"]}`, false},
		{`{"p": {"payment": {"method": "card"}}}`, false},
		{`{"p": {"payment": {"method": "cash", "smuggled": {}}}}`, false},
	} {
		var v any
		if err := json.Unmarshal([]byte(tc.args), &v); err != nil {
			t.Fatal(err)
		}
		if err := tool.Validate(v); (err == nil) != tc.ok {
			t.Errorf("Validate(%s) = %v; want ok %v", tc.args, err, tc.ok)
		}
	}
}

// TestDigest: the same definition written another way keeps its digest;
// any change of meaning gives another, and Bound takes the tool only
// under the digest it was admitted with.
func TestDigest(t *testing.T) {
	t.Parallel()
	digest := func(t *testing.T, body string) string {
		t.Helper()
		r, err := Load(mapFS(map[string]string{"tools/t.v1.json": body}))
		if err != nil {
			t.Fatalf("Load() = %v", err)
		}
		tool, err := r.Lookup("t", 1)
		if err != nil {
			t.Fatal(err)
		}
		return tool.Digest()
	}
	base := digest(t, toolJSON)
	seen := map[string]string{}
	if !strings.HasPrefix(base, "sha256:") || len(base) != len("sha256:")+64 {
		t.Fatalf("Digest() = %q; want sha256: and 64 hex digits", base)
	}
	same := map[string]string{
		"reformatted": strings.Join(strings.Fields(toolJSON), " "),
		"members reordered": `{"backend": {"audience": "aud", "url": "/tools/t", "kind": "http"},
  "idempotency": "native", "risk": "low", "effect": "read",
  "input_schema": {"properties": {"x": {"type": "string"}}, "additionalProperties": false,
    "type": "object", "$schema": "https://json-schema.org/draft/2020-12/schema"},
  "description": "a test tool", "owner": "tests", "version": 1, "name": "t"}`,
		"defaults written out": strings.Replace(toolJSON, `"effect"`, `"timeout_ms": 10000, "max_concurrency": 16, "max_result_bytes": 65536, "effect"`, 1),
	}
	for name, body := range same {
		if got := digest(t, body); got != base {
			t.Errorf("%s: Digest() = %s; want %s, the same definition's", name, got, base)
		}
	}
	other := map[string][2]string{
		"idempotency":       {`"idempotency": "native"`, `"idempotency": "none"`},
		"timeout":           {`"effect"`, `"timeout_ms": 9000, "effect"`},
		"backend url":       {`"/tools/t"`, `"/tools/t2"`},
		"input schema":      {`{"type": "string"}`, `{"type": "string", "maxLength": 5}`},
		"description":       {`"a test tool"`, `"another test tool"`},
		"mask":              {`"effect"`, `"mask": ["x"], "effect"`},
		"status lookup url": {`"effect"`, `"status_lookup": {"url": "/status/t"}, "effect"`},
	}
	// A number is the same definition however it is written, and
	// another value is another, however close as a float64.
	number := func(lit string) string {
		return digest(t, strings.Replace(toolJSON, `{"x": {"type": "string"}}`, `{"x": {"type": "number", "maximum": `+lit+`}}`, 1))
	}
	for _, lits := range [][]string{
		{"1000", "1e3", "1E+3", "1000.0", "10.00e2", "100000e-2"},
		{"0.5", "0.50", "5e-1", "5E-1"},
		{"9007199254740993"},
		{"9007199254740992", "9007199254740992.0"},
		{"-0.125", "-125e-3"},
	} {
		want := number(lits[0])
		for _, lit := range lits[1:] {
			if got := number(lit); got != want {
				t.Errorf("maximum %s: Digest() = %s; want %s, maximum %s's", lit, got, want, lits[0])
			}
		}
		if prev, ok := seen[want]; ok {
			t.Errorf("maximum %s: Digest() = %s, the same as maximum %s's", lits[0], want, prev)
		}
		seen[want] = "maximum " + lits[0]
	}
	seen[base] = "the base"
	for name, edit := range other {
		body := strings.Replace(toolJSON, edit[0], edit[1], 1)
		if body == toolJSON {
			t.Fatalf("%s: the edit changed nothing", name)
		}
		got := digest(t, body)
		if prev, ok := seen[got]; ok {
			t.Errorf("%s: Digest() = %s, the same as %s's", name, got, prev)
		}
		seen[got] = name
	}

	r, err := Load(mapFS(map[string]string{"tools/t.v1.json": toolJSON}))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{base, ""} {
		if tool, err := r.Bound("t", 1, d); err != nil || tool == nil || tool.Digest() != base {
			t.Errorf("Bound(t, 1, %q) = %v, %v; want the tool", d, tool, err)
		}
	}
	if tool, err := r.Bound("t", 1, "sha256:"+strings.Repeat("0", 64)); !errors.Is(err, ErrOtherDefinition) || tool != nil {
		t.Errorf("Bound(t, 1, another digest) = %v, %v; want nil, ErrOtherDefinition", tool, err)
	}
	if tool, err := r.Bound("t", 2, base); !errors.Is(err, ErrUnknownVersion) || tool != nil {
		t.Errorf("Bound(t, 2) = %v, %v; want nil, ErrUnknownVersion", tool, err)
	}
}
