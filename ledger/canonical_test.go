package ledger

import (
	"encoding/json"
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
)

// TestCanonicalES6Numbers uses the number samples of RFC 8785 Appendix B
// (IEEE 754 bit patterns and their expected serializations, checked against
// a JavaScript engine's String(x)).
func TestCanonicalES6Numbers(t *testing.T) {
	t.Parallel()
	tests := []struct {
		bits string
		want string
	}{
		{"0000000000000000", "0"},
		{"8000000000000000", "0"}, // -0
		{"0000000000000001", "5e-324"},
		{"8000000000000001", "-5e-324"},
		{"7fefffffffffffff", "1.7976931348623157e+308"},
		{"ffefffffffffffff", "-1.7976931348623157e+308"},
		{"4340000000000000", "9007199254740992"},
		{"c340000000000000", "-9007199254740992"},
		{"4430000000000000", "295147905179352830000"},
		{"44b52d02c7e14af5", "9.999999999999997e+22"},
		{"44b52d02c7e14af6", "1e+23"},
		{"44b52d02c7e14af7", "1.0000000000000001e+23"},
		{"444b1ae4d6e2ef4e", "999999999999999700000"},
		{"444b1ae4d6e2ef4f", "999999999999999900000"},
		{"444b1ae4d6e2ef50", "1e+21"},
		{"3eb0c6f7a0b5ed8c", "9.999999999999997e-7"},
		{"3eb0c6f7a0b5ed8d", "0.000001"},
		{"41b3de4355555553", "333333333.3333332"},
		{"41b3de4355555554", "333333333.33333325"},
		{"41b3de4355555555", "333333333.3333333"},
		{"41b3de4355555556", "333333333.3333334"},
		{"41b3de4355555557", "333333333.33333343"},
		{"becbf647612f3696", "-0.0000033333333333333333"},
		{"43143ff3c1cb0959", "1424953923781206.2"},
	}
	for _, tc := range tests {
		t.Run(tc.bits, func(t *testing.T) {
			t.Parallel()
			u, err := strconv.ParseUint(tc.bits, 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			f := math.Float64frombits(u)
			got, err := Canonical(f)
			if err != nil || string(got) != tc.want {
				t.Errorf("Canonical(%v) = %s, %v; want %s", f, got, err, tc.want)
			}
		})
	}
}

func TestCanonicalNumberText(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in   string
		want string // "" means an error
	}{
		{"1e21", "1e+21"},
		{"1e20", "100000000000000000000"},
		{"0.000001", "0.000001"},
		{"1e-6", "0.000001"},
		{"1e-7", "1e-7"},
		{"-1e-7", "-1e-7"},
		{"-0", "0"},
		{"-0.0e5", "0"},
		{"4500", "4500"},
		{"4500.0", "4500"},
		{"4.5e3", "4500"},
		{"4.50", "4.5"},
		{"2e-3", "0.002"},
		{"1E30", "1e+30"},
		{"0.000000000000000000000000001", "1e-27"},
		{"333333333.33333329", "333333333.3333333"},
		{"123e-20", "1.23e-18"},
		{"0.30000000000000004", "0.30000000000000004"},
		{"9007199254740993", "9007199254740992"}, // Canonical rounds; Decode refuses it
		{"1e400", ""},
		{"-1e400", ""},
		{"abc", ""},
		{"+1", ""},
		{"0x10", ""},
		{"Inf", ""},
		{"1_000", ""},
		{"", ""},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			t.Parallel()
			got, err := Canonical(json.Number(tc.in))
			if tc.want == "" {
				var de *DecodeError
				if !errors.As(err, &de) {
					t.Errorf("Canonical(Number(%q)) = %s, %v; want a *DecodeError", tc.in, got, err)
				}
				return
			}
			if err != nil || string(got) != tc.want {
				t.Errorf("Canonical(Number(%q)) = %s, %v; want %s", tc.in, got, err, tc.want)
			}
		})
	}
}

// stdDecode decodes with encoding/json, which (unlike Decode) accepts the
// RFC's 1E30, so that the RFC's own example can be used as is.
func stdDecode(t *testing.T, s string) any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("decode %q: %v", s, err)
	}
	return v
}

func TestCanonicalRFC8785Examples(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		in   string
		want string
	}{
		{
			name: "3.2.4 serialization",
			in: `{
  "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}`,
			want: `{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}`,
		},
		{
			name: "3.2.3 sorting",
			in: `{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "1": "One",
  "\ud83d\ude00": "Emoji: Grinning Face",
  "\u0080": "Control",
  "\u00f6": "Latin Small Letter O With Diaeresis"
}`,
			want: "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u0080\":\"Control\",\"ö\":\"Latin Small Letter O With Diaeresis\"," +
				"\"€\":\"Euro Sign\",\"😀\":\"Emoji: Grinning Face\",\"\ufb33\":\"Hebrew Letter Dalet With Dagesh\"}",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := Canonical(stdDecode(t, tc.in))
			if err != nil || string(got) != tc.want {
				t.Errorf("Canonical() = %s, %v\nwant %s", got, err, tc.want)
			}
		})
	}
}

func TestCanonicalStrings(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		in   string
		want string
	}{
		{name: "plain", in: "abc", want: `"abc"`},
		{name: "quote and backslash", in: `a"b\c`, want: `"a\"b\\c"`},
		{name: "short escapes", in: "\b\f\n\r\t", want: `"\b\f\n\r\t"`},
		{name: "other controls", in: "\x00\x01\x1f", want: `"\u0000\u0001\u001f"`},
		{name: "DEL literal", in: "\x7f", want: "\"\x7f\""},
		{name: "slash literal", in: "a/b", want: `"a/b"`},
		{name: "html literal", in: "<a>&", want: `"<a>&"`},
		{name: "line separator literal", in: "\u2028\u2029", want: "\"\u2028\u2029\""},
		{name: "non-ascii literal", in: "é😀", want: "\"é😀\""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := Canonical(tc.in)
			if err != nil || string(got) != tc.want {
				t.Errorf("Canonical(%q) = %s, %v; want %s", tc.in, got, err, tc.want)
			}
		})
	}
}

func TestCanonicalGoValues(t *testing.T) {
	t.Parallel()
	got, err := Canonical(map[string]any{
		"i": 3, "i64": int64(-7), "i32": int32(5), "f": 4.5, "max": 1 << 53,
		"nested": []any{map[string]any{"b": nil, "a": false}},
	})
	want := `{"f":4.5,"i":3,"i32":5,"i64":-7,"max":9007199254740992,"nested":[{"a":false,"b":null}]}`
	if err != nil || string(got) != want {
		t.Errorf("Canonical() = %s, %v; want %s", got, err, want)
	}
}

func TestCanonicalErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		in   any
		want DecodeError // Code and Pointer
	}{
		{name: "NaN", in: []any{math.NaN()}, want: DecodeError{Code: CodeNumberOutOfRange, Pointer: "/0"}},
		{name: "Inf", in: map[string]any{"x": math.Inf(-1)}, want: DecodeError{Code: CodeNumberOutOfRange, Pointer: "/x"}},
		{name: "big int", in: map[string]any{"a": []any{1, 1<<53 + 1}}, want: DecodeError{Code: CodeNumberOutOfRange, Pointer: "/a/1"}},
		{name: "bad number", in: map[string]any{"a/b": json.Number("1.")}, want: DecodeError{Code: CodeInvalidValue, Pointer: "/a~1b"}},
		{name: "invalid utf8 string", in: map[string]any{"s": "\xff"}, want: DecodeError{Code: CodeInvalidValue, Pointer: "/s"}},
		{name: "invalid utf8 key", in: map[string]any{"\xff": 1}, want: DecodeError{Code: CodeInvalidValue, Pointer: "/\xff"}},
		{name: "unsupported type", in: map[string]any{"t": struct{}{}}, want: DecodeError{Code: CodeInvalidType, Pointer: "/t"}},
		{name: "typed map", in: map[string]string{"a": "b"}, want: DecodeError{Code: CodeInvalidType}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := Canonical(tc.in)
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("Canonical(%v) = %s, %v; want a *DecodeError", tc.in, got, err)
			}
			if g := (DecodeError{Code: de.Code, Pointer: de.Pointer}); g != tc.want {
				t.Errorf("Canonical(%v) error = %v; want code %q pointer %q", tc.in, err, tc.want.Code, tc.want.Pointer)
			}
		})
	}
}

func TestCanonicalCycle(t *testing.T) {
	t.Parallel()
	m := map[string]any{}
	m["self"] = m
	_, err := Canonical(m)
	var de *DecodeError
	if !errors.As(err, &de) || de.Code != CodeTooDeep {
		t.Errorf("Canonical(cycle) = %v; want a too_deep *DecodeError", err)
	}
}

func TestCompareUTF16(t *testing.T) {
	t.Parallel()
	tests := []struct {
		a, b string
		want int // sign
	}{
		{"a", "b", -1},
		{"a", "ab", -1},
		{"", "a", -1},
		{"ab", "ab", 0},
		// U+1F600 is D83D DE00 in UTF-16, below U+FFFF; in UTF-8 (and
		// code point) order it is above.
		{"\U0001F600", "\uffff", -1},
		{"\U0001F600", "\ufb33", -1},
		{"\U0001F600", "\ud7ff", 1},
		{"\U0001F600", "\U0001F601", -1},
		{"\U0010FFFF", "\U00010000", 1},
	}
	sign := func(n int) int {
		switch {
		case n < 0:
			return -1
		case n > 0:
			return 1
		}
		return 0
	}
	for _, tc := range tests {
		if got := sign(compareUTF16(tc.a, tc.b)); got != tc.want {
			t.Errorf("compareUTF16(%q, %q) = %d; want %d", tc.a, tc.b, got, tc.want)
		}
		if got := sign(compareUTF16(tc.b, tc.a)); got != -tc.want {
			t.Errorf("compareUTF16(%q, %q) = %d; want %d", tc.b, tc.a, got, -tc.want)
		}
	}
}

// TestArgumentsHash pins the hash of the DESIGN §3 example. The expected
// value was computed independently:
//
//	python3 -c 'import json,hashlib; o={"arguments":{"order_id":"ord_1029","amount_cents":4500,"currency":"AUD"},"tenant_id":"t_acme","tool":"refund_order","tool_version":3}; print(hashlib.sha256(json.dumps(o,sort_keys=True,separators=(",",":"),ensure_ascii=False).encode()).hexdigest())'
func TestArgumentsHash(t *testing.T) {
	t.Parallel()
	const want = "sha256:cddef8618bf08e54b7ac36d10c2bd47e7c7e060f2c99b506f490b46aed3b0199"
	tests := []struct {
		name string
		args string
	}{
		{name: "design example", args: `{"order_id": "ord_1029", "amount_cents": 4500, "currency": "AUD"}`},
		{name: "reordered and reformatted", args: "{\n\"currency\":\"AUD\",\"amount_cents\":4.5e3,\"order_id\":\"ord_\\u0031029\"}"},
		{name: "trailing zeros", args: `{"currency":"AUD","amount_cents":4500.00,"order_id":"ord_1029"}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			args, err := Decode([]byte(tc.args), Limits{})
			if err != nil {
				t.Fatalf("Decode() = %v", err)
			}
			got, err := ArgumentsHash("t_acme", "refund_order", 3, args)
			if err != nil || got != want {
				t.Errorf("ArgumentsHash() = %q, %v; want %q", got, err, want)
			}
		})
	}

	args, _ := Decode([]byte(tests[0].args), Limits{})
	for _, c := range []struct {
		name          string
		tenant, tool  string
		version       int
		arguments     any
		wantDifferent bool
	}{
		{name: "other tenant", tenant: "t_other", tool: "refund_order", version: 3, arguments: args},
		{name: "other tool", tenant: "t_acme", tool: "refund_order2", version: 3, arguments: args},
		{name: "other version", tenant: "t_acme", tool: "refund_order", version: 4, arguments: args},
		{name: "other amount", tenant: "t_acme", tool: "refund_order", version: 3,
			arguments: map[string]any{"order_id": "ord_1029", "amount_cents": json.Number("4501"), "currency": "AUD"}},
	} {
		got, err := ArgumentsHash(c.tenant, c.tool, c.version, c.arguments)
		if err != nil || got == want {
			t.Errorf("%s: ArgumentsHash() = %q, %v; want a different valid hash", c.name, got, err)
		}
	}

	_, err := ArgumentsHash("t", "x", 1, map[string]any{"n": math.NaN()})
	var de *DecodeError
	if !errors.As(err, &de) || de.Pointer != "/arguments/n" {
		t.Errorf("ArgumentsHash(NaN) = %v; want a DecodeError at /arguments/n", err)
	}
}

// TestHashCanonicalArguments: the hash of arguments held canonical is
// ArgumentsHash's, and any other bytes (another spelling of the same
// arguments included) hash to something else.
func TestHashCanonicalArguments(t *testing.T) {
	t.Parallel()
	const want = "sha256:cddef8618bf08e54b7ac36d10c2bd47e7c7e060f2c99b506f490b46aed3b0199" // TestArgumentsHash's
	canonical := []byte(`{"amount_cents":4500,"currency":"AUD","order_id":"ord_1029"}`)
	if got, err := HashCanonicalArguments("t_acme", "refund_order", 3, canonical); err != nil || got != want {
		t.Errorf("HashCanonicalArguments(canonical) = %q, %v; want %q", got, err, want)
	}
	for _, other := range []string{
		`{"amount_cents":4500, "currency":"AUD","order_id":"ord_1029"}`,
		`{"currency":"AUD","amount_cents":4500,"order_id":"ord_1029"}`,
		`{"amount_cents":4.5e3,"currency":"AUD","order_id":"ord_1029"}`,
		`{"amount_cents":4500,"currency":"AUD","order_id":"ord_1029"},"x":{}`,
	} {
		if got, err := HashCanonicalArguments("t_acme", "refund_order", 3, []byte(other)); err != nil || got == want {
			t.Errorf("HashCanonicalArguments(%s) = %q, %v; want another valid hash", other, got, err)
		}
	}
	// A tenant and a tool with characters JCS escapes (a quote, a
	// backslash, a control character, a tab) and some it does not (é,
	// U+2028). The expected value was computed independently:
	//
	//	python3 -c 'import json,hashlib; o={"arguments":{"order_id":"ord_1029","amount_cents":4500,"currency":"AUD"},"tenant_id":"t_\"q\\\u0001\u00e9\u2028","tool":"refund\torder","tool_version":3}; print(hashlib.sha256(json.dumps(o,sort_keys=True,separators=(",",":"),ensure_ascii=False).encode()).hexdigest())'
	const escaped = "sha256:5f8020fa7a70503cf1b9ebf4c2dcc256dab3732a4e3ca93362aefc3419b36ccc"
	if got, err := HashCanonicalArguments("t_\"q\\\x01é\u2028", "refund\torder", 3, canonical); err != nil || got != escaped {
		t.Errorf("HashCanonicalArguments(escaped tenant and tool) = %q, %v; want %q", got, err, escaped)
	}
	// The tenant, the tool and the version are checked as ArgumentsHash
	// checks them.
	for _, c := range []struct {
		tenant, tool string
		version      int
		pointer      string
	}{
		{tenant: "t\xff", tool: "x", version: 1, pointer: "/tenant_id"},
		{tenant: "t", tool: "x\xfe", version: 1, pointer: "/tool"},
		{tenant: "t", tool: "x", version: 1<<53 + 1, pointer: "/tool_version"},
	} {
		_, err := HashCanonicalArguments(c.tenant, c.tool, c.version, canonical)
		var de *DecodeError
		if !errors.As(err, &de) || de.Pointer != c.pointer {
			t.Errorf("HashCanonicalArguments(%q, %q, %d) = %v; want a DecodeError at %s", c.tenant, c.tool, c.version, err, c.pointer)
		}
		_, err2 := ArgumentsHash(c.tenant, c.tool, c.version, map[string]any{})
		if !errors.As(err2, &de) || de.Pointer != c.pointer {
			t.Errorf("ArgumentsHash(%q, %q, %d) = %v; want a DecodeError at %s", c.tenant, c.tool, c.version, err2, c.pointer)
		}
	}
}

// TestArgumentsDepth: the arguments sit one level down in the hashed
// document, so they may nest one level less than a document of their own.
func TestArgumentsDepth(t *testing.T) {
	t.Parallel()
	nest := func(n int) any {
		var v any = []any{}
		for range n - 1 {
			v = []any{v}
		}
		return v
	}
	if _, err := CanonicalArguments(nest(maxCanonicalDepth)); err != nil {
		t.Errorf("CanonicalArguments(%d levels) = %v; want it canonical", maxCanonicalDepth, err)
	}
	if _, err := Canonical(nest(maxCanonicalDepth + 1)); err != nil {
		t.Errorf("Canonical(%d levels) = %v; want it canonical", maxCanonicalDepth+1, err)
	}
	for name, f := range map[string]func(any) error{
		"CanonicalArguments": func(v any) error { _, err := CanonicalArguments(v); return err },
		"ArgumentsHash":      func(v any) error { _, err := ArgumentsHash("t", "x", 1, v); return err },
	} {
		var de *DecodeError
		if err := f(nest(maxCanonicalDepth + 1)); !errors.As(err, &de) || de.Code != CodeTooDeep || !strings.HasPrefix(de.Pointer, "/arguments/0/") {
			t.Errorf("%s(%d levels) = %v; want too_deep inside /arguments", name, maxCanonicalDepth+1, err)
		}
	}
}

func BenchmarkArgumentsHash(b *testing.B) {
	tree, err := Decode([]byte(`{"order_id": "ord_1029", "amount_cents": 4500, "currency": "AUD"}`), Limits{})
	if err != nil {
		b.Fatal(err)
	}
	canonical, err := Canonical(tree)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("tree", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := ArgumentsHash("t_acme", "refund_order", 3, tree); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("canonical", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := HashCanonicalArguments("t_acme", "refund_order", 3, canonical); err != nil {
				b.Fatal(err)
			}
		}
	})
	// What the intake adds to a call to decide on the hashed arguments:
	// their canonical bytes decoded again.
	b.Run("decode-canonical", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := Decode(canonical, Limits{}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkCanonical(b *testing.B) {
	tree, err := Decode([]byte(envelopeJSON), Limits{})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Canonical(tree); err != nil {
			b.Fatal(err)
		}
	}
}
