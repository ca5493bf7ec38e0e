package ledger

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestRedact(t *testing.T) {
	t.Parallel()
	const doc = `{"order_id":"ord_1","reason":"card 4242","card":{"number":"4242","exp":"12/30"},
		"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":3}`
	tests := []struct {
		name     string
		pointers []string
		want     string
	}{
		{name: "none", pointers: nil, want: doc},
		{name: "top-level pointer", pointers: []string{"/reason"},
			want: `{"order_id":"ord_1","reason":"[redacted]","card":{"number":"4242","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "nested pointer", pointers: []string{"/card/number"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"[redacted]","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "whole object", pointers: []string{"/card"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":"[redacted]",
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "array index", pointers: []string{"/items/1/note"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"4242","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"[redacted]","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "bare name at any depth", pointers: []string{"note", "number"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"[redacted]","exp":"12/30"},
				"items":[{"note":"[redacted]","sku":"x"},{"note":"[redacted]","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "escaped tokens", pointers: []string{"/a~1b", "/m~0n"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"4242","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":"[redacted]","m~n":"[redacted]","0":3}`},
		{name: "names and pointers in another case", pointers: []string{"/CARD/Number", "ORDER_ID"},
			want: `{"order_id":"[redacted]","reason":"card 4242","card":{"number":"[redacted]","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "numeric key in object", pointers: []string{"/0"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"4242","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":"[redacted]"}`},
		{name: "missing and malformed ignored", pointers: []string{"/nope", "/card/number/deeper", "/items/9/note", "/items/01/note", "/items/-", "/bad~2", "/reason/x"}, want: doc},
		{name: "root", pointers: []string{""}, want: `"[redacted]"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			in := mustDecode(t, doc)
			got := Redact(in, tc.pointers)
			if diff := cmp.Diff(mustDecode(t, tc.want), got); diff != "" {
				t.Errorf("Redact(%q) mismatch (-want +got):\n%s", tc.pointers, diff)
			}
			if diff := cmp.Diff(mustDecode(t, doc), in); diff != "" {
				t.Errorf("Redact(%q) modified its input (-want +got):\n%s", tc.pointers, diff)
			}
		})
	}
}

// TestRedactCopies: changing the copy must not change the original.
func TestRedactCopies(t *testing.T) {
	t.Parallel()
	in := mustDecode(t, `{"a":{"b":[1,{"c":2}]}}`)
	out := Redact(in, nil).(map[string]any)
	out["a"].(map[string]any)["b"].([]any)[1].(map[string]any)["c"] = "changed"
	if diff := cmp.Diff(mustDecode(t, `{"a":{"b":[1,{"c":2}]}}`), in); diff != "" {
		t.Errorf("modifying Redact's result changed its input (-want +got):\n%s", diff)
	}
}

func mustDecode(t *testing.T, s string) any {
	t.Helper()
	v, err := Decode([]byte(s), Limits{})
	if err != nil {
		t.Fatalf("Decode(%q) = %v", s, err)
	}
	return v
}

func TestLookup(t *testing.T) {
	tree, err := Decode([]byte(`{"a":{"b/c":{"d~e":1}},"order_id":"ord_1","list":[1],"lines":[{"sku":"s1"},{"sku":"s2"}]}`), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		ptr  string
		want string
		ok   bool
	}{
		{"/order_id", "ord_1", true},
		{"/a/b~1c/d~0e", "1", true},
		{"/missing", "", false},
		{"/list/0", "1", true},
		{"/lines/1/sku", "s2", true},
		{"/lines/2/sku", "", false},
		{"/lines/01/sku", "", false},
		{"/lines/-", "", false},
		{"/lines/+1/sku", "", false},
		{"/order_id/0", "", false},
		{"order_id", "", false},
	} {
		v, ok := Lookup(tree, tc.ptr)
		if ok != tc.ok || (ok && fmt.Sprint(v) != tc.want) {
			t.Errorf("Lookup(%q) = %v, %v; want %q, %v", tc.ptr, v, ok, tc.want, tc.ok)
		}
	}
}

// jws builds a compact JWS-shaped token from a header's exact text, a
// payload and a signature.
func jws(header, payload, sig string) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(header)) + "." + enc([]byte(payload)) + "." + enc([]byte(sig))
}

// escapeAll spells every byte of s as a JSON \uXXXX escape.
func escapeAll(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		fmt.Fprintf(&b, `\u%04X`, s[i])
	}
	return b.String()
}

// utf16LE and utf16BE spell ASCII text s in UTF-16.
func utf16LE(s string) string { return utf16Of(s, false) }
func utf16BE(s string) string { return utf16Of(s, true) }

func utf16Of(s string, bigEndian bool) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if bigEndian {
			b.WriteByte(0)
		}
		b.WriteByte(s[i])
		if !bigEndian {
			b.WriteByte(0)
		}
	}
	return b.String()
}

// redactTokenCases are TestRedactTokens' table and FuzzRedactTokens' seeds.
var redactTokenCases = []struct {
	name, in, want string
}{
	{name: "compact header", in: jws(`{"alg":"EdDSA","typ":"JWT"}`, `{"sub":"u"}`, "sig"), want: Redacted},
	{name: "other key order", in: jws(`{"typ":"agent-assertion+jwt","kid":"k1","alg":"EdDSA"}`, `{"sub":"u"}`, "sig"), want: Redacted},
	{name: "space after the brace", in: jws(`{ "alg": "EdDSA" }`, `{"sub":"u"}`, "sig"), want: Redacted},
	{name: "space first", in: jws(` {"alg":"EdDSA"}`, `{}`, "sig"), want: Redacted},
	{name: "newline first", in: jws("\n{\"alg\":\"RS256\"}\n", `{}`, "sig"), want: Redacted},
	{name: "crlf first", in: jws("\r\n{\"alg\":\"RS256\"}", `{}`, "sig"), want: Redacted},
	{name: "tab first", in: jws("\t{\"alg\":\"RS256\"}", `{}`, "sig"), want: Redacted},
	{name: "pretty printed", in: jws("{\n  \"alg\": \"ES256\",\n  \"typ\": \"JWT\"\n}\n", `{}`, "sig"), want: Redacted},
	{name: "unsecured, empty signature", in: jws(`{"alg":"none"}`, `{"sub":"u"}`, ""), want: Redacted},
	{name: "detached payload", in: jws(`{"alg":"EdDSA","b64":false}`, "", "sig"), want: Redacted},
	{name: "JWE, five segments", in: jws(`{"alg":"RSA-OAEP","enc":"A256GCM"}`, "key", "iv") + ".Y2lwaGVy.dGFn", want: Redacted},
	{name: "large header", in: jws(`{"alg":"RS256","x5c":["`+strings.Repeat("MIIC", 2000)+`"]}`, `{}`, "sig"), want: Redacted},
	{name: "in an envelope", in: `{"tool":"x","assertion":"` + jws(`{ "alg":"EdDSA"}`, `{}`, "s") + `","call_id":"c"}`,
		want: `{"tool":"x","assertion":"` + Redacted + `","call_id":"c"}`},
	{name: "bearer", in: "Authorization: Bearer " + jws(`{"alg":"HS256"}`, `{}`, "s") + "\n", want: "Authorization: Bearer " + Redacted + "\n"},
	{name: "glued to a JSON escape", in: `"note":"line\n` + jws(` {"alg":"EdDSA"}`, `{}`, "s") + `"`, want: `"note":"line\n` + Redacted + `"`},
	{name: "glued to a percent escape", in: "access_token%3D" + jws(`{"alg":"EdDSA"}`, `{}`, "s") + "&x=1", want: "access_token%3D" + Redacted + "&x=1"},
	{name: "after a dotted word", in: "see docs." + jws(`{"alg":"EdDSA"}`, `{}`, "s"), want: "see docs." + Redacted},
	{name: "two tokens", in: jws(`{"alg":"EdDSA"}`, "a", "b") + " and " + jws(`{ "alg":"EdDSA"}`, "c", "d"), want: Redacted + " and " + Redacted},
	{name: "sentence end", in: "token " + jws(`{"alg":"EdDSA"}`, "a", "b") + ". Next", want: "token " + Redacted + " Next"},
	// A JSON decoder hands these back as the token itself.
	{name: "dots as JSON escapes", in: `{"assertion":"` + strings.ReplaceAll(jws(`{"alg":"EdDSA"}`, `{"sub":"u"}`, "sig"), ".", `\u002e`) + `"}`,
		want: `{"assertion":"` + Redacted + `"}`},
	{name: "first character as a JSON escape", in: `{"assertion":"\u0065` + jws(`{"alg":"EdDSA"}`, `{"sub":"u"}`, "sig")[1:] + `","x":1}`,
		want: `{"assertion":"` + Redacted + `","x":1}`},
	{name: "every character as an escape, upper-case hex", in: `"` + escapeAll(jws(`{"alg":"EdDSA"}`, `{}`, "s")) + `"`, want: `"` + Redacted + `"`},
	{name: "an escaped backslash before u", in: `"a\\u002eb.c"`, want: `"a\\u002eb.c"`},
	// Text in UTF-16 (an envelope encoded so fails to parse, and goes to
	// the DLQ): every character beside a NUL, which hid the token.
	{name: "UTF-16LE", in: utf16LE(`{"assertion":"` + jws(`{"alg":"EdDSA"}`, `{"sub":"u"}`, "sig") + `"}`),
		want: utf16LE(`{"assertion":"`) + Redacted + utf16LE(`"}`)},
	{name: "UTF-16BE, with its BOM", in: "\xfe\xff" + utf16BE(`{"assertion":"`+jws(`{"alg":"EdDSA"}`, `{"sub":"u"}`, "sig")+`"}`),
		// The NUL before the token's first character stays, the one
		// before the quote after it goes with the token's span.
		want: "\xfe\xff" + utf16BE(`{"assertion":"`) + "\x00" + Redacted + `"` + utf16BE(`}`)},
	{name: "UTF-16 text without a token", in: utf16LE("go1.26.0 ledger.v1.json"), want: utf16LE("go1.26.0 ledger.v1.json")},

	// Ordinary text stays as it is.
	{name: "host name", in: "https://www.example.com.au/a.b.c?v=1.2.3", want: "https://www.example.com.au/a.b.c?v=1.2.3"},
	{name: "versions and files", in: "go1.26.0 ledger.v1.json archive.tar.gz e.g. i.e. 10.0.0.1", want: "go1.26.0 ledger.v1.json archive.tar.gz e.g. i.e. 10.0.0.1"},
	{name: "prose", in: "Refund the order. Customer says: eyes.every.day. Done.", want: "Refund the order. Customer says: eyes.every.day. Done."},
	{name: "encoded empty object", in: "e30.e30.e30", want: "e30.e30.e30"},
	{name: "encoded array", in: jws(`[{"alg":"EdDSA"}]`, "a", "b"), want: jws(`[{"alg":"EdDSA"}]`, "a", "b")},
	{name: "encoded string", in: jws(`"{\"alg\":1}"`, "a", "b"), want: jws(`"{\"alg\":1}"`, "a", "b")},
	{name: "unclosed header", in: jws(`{"alg":"EdDSA"`, "a", "b"), want: jws(`{"alg":"EdDSA"`, "a", "b")},
	{name: "two segments only", in: "eyJ0b2tlbiI6MX0.payload", want: "eyJ0b2tlbiI6MX0.payload"},
	{name: "dots only", in: "...", want: "..."},
	{name: "empty", in: "", want: ""},
}

// TestRedactTokens: any compact JWS or JWE, however its header is written,
// leaves the DLQ redacted, and ordinary text with dots does not.
func TestRedactTokens(t *testing.T) {
	t.Parallel()
	for _, tc := range redactTokenCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			in := []byte(tc.in)
			if got := string(RedactTokens(in)); got != tc.want {
				t.Errorf("RedactTokens(%q) = %q; want %q", tc.in, got, tc.want)
			}
			if string(in) != tc.in {
				t.Errorf("RedactTokens modified its input to %q", in)
			}
		})
	}
}

// hostileRedactInputs are floods of near-tokens: every offset a
// candidate, none a token.
func hostileRedactInputs() map[string][]byte {
	enc := base64.RawURLEncoding.EncodeToString
	return map[string][]byte{
		"one huge header":   []byte(enc(bytes.Repeat([]byte(`{"a":`), 200_000)) + ".a.b"),
		"candidates galore": []byte(strings.Repeat("eyJe", 250_000) + ".x.y"),
		"many segments":     bytes.Repeat([]byte("eyJ."), 250_000),
	}
}

// TestRedactTokensHostile: near-tokens are left as they are. How long
// they take is BenchmarkRedactTokens' to measure (linear: a quadratic scan
// of these would take minutes).
func TestRedactTokensHostile(t *testing.T) {
	t.Parallel()
	for name, in := range hostileRedactInputs() {
		if out := RedactTokens(in); !bytes.Equal(out, in) {
			t.Errorf("%s: redacted what is no token", name)
		}
	}
}

func BenchmarkRedactTokens(b *testing.B) {
	for name, in := range hostileRedactInputs() {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(in)))
			for b.Loop() {
				RedactTokens(in)
			}
		})
	}
}

// FuzzRedactTokens checks, for any text around a token built from the
// fuzzed header: a header that is a JSON object with members (up to 16
// bytes of whitespace before its key, and after it) is redacted wherever it
// stands; text apart from the token is redacted as it would be alone; and
// redaction is idempotent and never touches text without three dotted
// segments.
func FuzzRedactTokens(f *testing.F) {
	for _, tc := range redactTokenCases {
		f.Add("before", tc.in, "after", "payload", "sig")
	}
	f.Add("x", `{"alg":"EdDSA"}`, "y", `{"sub":"u"}`, "sig")
	f.Add("", "\n\t {\r\n\"k\":1}  ", "", "", "")
	f.Fuzz(func(t *testing.T, before, header, after, payload, sig string) {
		tok := jws(header, payload, sig)
		in := before + " " + tok + " " + after
		got := RedactTokens([]byte(in))
		if again := RedactTokens(got); !bytes.Equal(again, got) {
			t.Fatalf("RedactTokens not idempotent on %q: %q then %q", in, got, again)
		}
		if strings.Count(in, ".") < 2 && string(got) != in {
			t.Fatalf("RedactTokens(%q) = %q; changed text without three segments", in, got)
		}
		var v any
		trimmed := strings.Trim(header, " \t\r\n")
		lead := len(header) - len(strings.TrimLeft(header, " \t\r\n"))
		trail := len(header) - len(strings.TrimRight(header, " \t\r\n"))
		inner := strings.TrimLeft(strings.TrimPrefix(trimmed, "{"), " \t\r\n")
		if json.Unmarshal([]byte(header), &v) != nil || !strings.HasPrefix(trimmed, "{") || !strings.HasPrefix(inner, `"`) ||
			lead+len(trimmed)-len(inner)-1 > 16 || trail > 16 {
			return // not a header RedactTokens promises to catch
		}
		want := string(RedactTokens([]byte(before))) + " " + Redacted + " " + string(RedactTokens([]byte(after)))
		if string(got) != want {
			t.Fatalf("RedactTokens(%q) = %q; want %q", in, got, want)
		}
	})
}

// A resource is written one way by every part of the ledger: a string as
// it is, an integer however it is spelt, anything else as JSON. Before,
// the intake's events, the approval's preview and the version read said
// 1e3 where the policies, since, said 1000: a blast radius by resource
// counted two.
func TestResourceOf(t *testing.T) {
	args, err := Decode([]byte(`{"a":"ord_9","b":1e3,"c":1000.0,"d":1000,"e":1.5,"f":true,"lines":[{"id":2E1}]}`), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	for ptr, want := range map[string]string{"/a": "ord_9", "/b": "1000", "/c": "1000", "/d": "1000", "/e": "1.5", "/f": "true", "/lines/0/id": "20"} {
		if got, ok := ResourceOf(args, ptr); !ok || got != want {
			t.Errorf("ResourceOf(%s) = %q, %v; want %q", ptr, got, ok, want)
		}
	}
	if got, ok := ResourceOf(args, "/missing"); ok {
		t.Errorf("ResourceOf(/missing) = %q; want none", got)
	}
}
