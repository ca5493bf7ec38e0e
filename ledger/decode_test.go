package ledger

import (
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

type num = json.Number

// decodeCase is one Decode input: either want (accepted) or wantErr.
type decodeCase struct {
	name    string
	in      string
	lim     Limits
	want    any
	wantErr *DecodeError // Code and Pointer compared; Detail ignored
}

var decodeCases = []decodeCase{
	// Accepted.
	{name: "object", in: `{"a":1}`, want: map[string]any{"a": num("1")}},
	{name: "whitespace", in: " \t\r\n{ \"a\" : [ 1 , true , null ] }\n", want: map[string]any{"a": []any{num("1"), true, nil}}},
	{name: "empty containers", in: `{"o":{},"a":[]}`, want: map[string]any{"o": map[string]any{}, "a": []any{}}},
	{name: "top-level scalar", in: `"x"`, want: "x"},
	{name: "top-level null", in: `null`, want: nil},
	{name: "top-level false", in: `false`, want: false},
	{name: "escapes", in: `"\"\\\/\b\f\n\r\t\u00e9\u0000"`, want: "\"\\/\b\f\n\r\té\x00"},
	{name: "surrogate pair", in: `"\ud83d\ude00"`, want: "😀"},
	{name: "raw utf8", in: `"héllo 😀 \u2028"`, want: "héllo 😀 \u2028"},
	{name: "numbers kept as written", in: `[0,-0,4.50,1E2,1e-7,-12.5e+3]`, want: []any{num("0"), num("-0"), num("4.50"), num("1E2"), num("1e-7"), num("-12.5e+3")}},
	{name: "2^53", in: `[9007199254740992,-9007199254740992,9007199254740992.0,9.007199254740992e15]`,
		want: []any{num("9007199254740992"), num("-9007199254740992"), num("9007199254740992.0"), num("9.007199254740992e15")}},
	{name: "smallest double", in: `5e-324`, want: num("5e-324")},
	{name: "zero with huge exponent", in: `0e99999999999999999999`, want: num("0e99999999999999999999")},
	{name: "not a case variant (sharp s)", in: `{"straße":1,"STRASSE":2}`, want: map[string]any{"straße": num("1"), "STRASSE": num("2")}},
	{name: "depth at limit", in: `{"a":{"b":1}}`, lim: Limits{MaxDepth: 2}, want: map[string]any{"a": map[string]any{"b": num("1")}}},
	{name: "default depth at limit", in: strings.Repeat("[", 32) + strings.Repeat("]", 32), want: nest(31)},
	{name: "size at limit", in: `[1,2,3]`, lim: Limits{MaxBytes: 7}, want: []any{num("1"), num("2"), num("3")}},

	// Syntax.
	{name: "empty", in: ``, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "only space", in: `  `, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "unclosed object", in: `{`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "missing value", in: `{"a":}`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "bad array element", in: `{"a":[1,x]}`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a/1"}},
	{name: "trailing comma in array", in: `{"a":[1,]}`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a/1"}},
	{name: "trailing comma in object", in: `{"a":1,}`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "missing colon", in: `{"a" 1}`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "unquoted key", in: `{a:1}`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "trailing data", in: `{"a":1}x`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "two documents", in: `{"a":1} {"b":2}`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "leading zero", in: `[01]`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/0"}},
	{name: "bare fraction", in: `.5`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "dangling point", in: `1.`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "plus sign", in: `+1`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "NaN", in: `NaN`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "Infinity", in: `[-Infinity]`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/0"}},
	{name: "hex", in: `0x10`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "short literal", in: `tru`, wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "long literal", in: `[nulll]`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/0"}},
	{name: "unterminated string", in: `{"a":"abc`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "raw tab in string", in: "{\"a\":\"x\ty\"}", wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "bad escape", in: `{"a":"\x"}`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "short unicode escape", in: `{"a":"\u12"}`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "lone high surrogate", in: `{"a":"\ud800"}`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "lone low surrogate", in: `{"a":"\udc00x"}`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "high surrogate then letter", in: `{"a":"\ud800\u0041"}`, wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "invalid utf8", in: "{\"a\":\"\xff\"}", wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "invalid utf8 after escape", in: "{\"a\":\"\\n\xff\"}", wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/a"}},
	{name: "overlong utf8", in: "[\"\xc0\xaf\"]", wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/0"}},
	{name: "utf8 encoded surrogate", in: "[\"\xed\xa0\x80\"]", wantErr: &DecodeError{Code: CodeInvalidJSON, Pointer: "/0"}},
	{name: "invalid utf8 in key", in: "{\"\xff\":1}", wantErr: &DecodeError{Code: CodeInvalidJSON}},
	{name: "byte order mark", in: "\ufeff{}", wantErr: &DecodeError{Code: CodeInvalidJSON}},

	// Keys.
	{name: "duplicate key", in: `{"a":1,"a":2}`, wantErr: &DecodeError{Code: CodeDuplicateKey, Pointer: "/a"}},
	{name: "duplicate key via escape", in: `{"a":1,"\u0061":2}`, wantErr: &DecodeError{Code: CodeDuplicateKey, Pointer: "/a"}},
	{name: "duplicate key escaped pointer", in: `{"x":{"a/b":1,"a/b":2}}`, wantErr: &DecodeError{Code: CodeDuplicateKey, Pointer: "/x/a~1b"}},
	{name: "duplicate key in array", in: `{"m~n":[{"k":1,"k":1}]}`, wantErr: &DecodeError{Code: CodeDuplicateKey, Pointer: "/m~0n/0/k"}},
	{name: "case variant", in: `{"tool":"a","Tool":"b"}`, wantErr: &DecodeError{Code: CodeCaseVariantKey, Pointer: "/Tool"}},
	{name: "case variant kelvin sign", in: `{"k":1,"\u212a":2}`, wantErr: &DecodeError{Code: CodeCaseVariantKey, Pointer: "/\u212a"}},
	{name: "case variant long s", in: `{"ſ":1,"S":2}`, wantErr: &DecodeError{Code: CodeCaseVariantKey, Pointer: "/S"}},
	{name: "case variant greek", in: `{"x":{"Σίσυφος":1,"ΣΊΣΥΦΟΣ":2}}`, wantErr: &DecodeError{Code: CodeCaseVariantKey, Pointer: "/x/ΣΊΣΥΦΟΣ"}},

	// Limits.
	{name: "too deep", in: `{"a":{"b":{}}}`, lim: Limits{MaxDepth: 2}, wantErr: &DecodeError{Code: CodeTooDeep, Pointer: "/a/b"}},
	{name: "too deep arrays", in: `[[[]]]`, lim: Limits{MaxDepth: 2}, wantErr: &DecodeError{Code: CodeTooDeep, Pointer: "/0/0"}},
	{name: "too deep default", in: strings.Repeat("[", 33) + strings.Repeat("]", 33), wantErr: &DecodeError{Code: CodeTooDeep, Pointer: "/0" + strings.Repeat("/0", 31)}},
	{name: "too large", in: `[1,2,3] `, lim: Limits{MaxBytes: 7}, wantErr: &DecodeError{Code: CodeTooLarge}},
	{name: "too large default", in: `"` + strings.Repeat("x", DefaultMaxBytes) + `"`, wantErr: &DecodeError{Code: CodeTooLarge}},

	// Numbers.
	{name: "2^53+1", in: `9007199254740993`, wantErr: &DecodeError{Code: CodeNumberOutOfRange}},
	{name: "-2^53-1", in: `{"n":-9007199254740993}`, wantErr: &DecodeError{Code: CodeNumberOutOfRange, Pointer: "/n"}},
	{name: "2^53 and a half", in: `9007199254740992.5`, wantErr: &DecodeError{Code: CodeNumberOutOfRange}},
	{name: "2^53+1 in exponent form", in: `0.9007199254740993e16`, wantErr: &DecodeError{Code: CodeNumberOutOfRange}},
	{name: "1e16", in: `[1e16]`, wantErr: &DecodeError{Code: CodeNumberOutOfRange, Pointer: "/0"}},
	{name: "1E30 (RFC 8785 example)", in: `1E30`, wantErr: &DecodeError{Code: CodeNumberOutOfRange}},
	{name: "overflow", in: `{"n":1e400}`, wantErr: &DecodeError{Code: CodeNumberOutOfRange, Pointer: "/n"}},
	{name: "underflow", in: `1e-400`, wantErr: &DecodeError{Code: CodeNumberOutOfRange}},
	{name: "underflow huge exponent", in: `1e-99999999999999999999`, wantErr: &DecodeError{Code: CodeNumberOutOfRange}},
	{name: "overflow huge exponent", in: `1e99999999999999999999`, wantErr: &DecodeError{Code: CodeNumberOutOfRange}},
	{name: "long literal", in: `1.` + strings.Repeat("0", 300), wantErr: &DecodeError{Code: CodeNumberOutOfRange}},
}

// nest returns n arrays nested in an outer array: nest(0) is [].
func nest(n int) any {
	v := []any{}
	for range n {
		v = []any{v}
	}
	return v
}

func TestDecode(t *testing.T) {
	t.Parallel()
	for _, tc := range decodeCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := Decode([]byte(tc.in), tc.lim)
			if tc.wantErr == nil {
				if err != nil {
					t.Fatalf("Decode(%q) = %v; want no error", tc.in, err)
				}
				// reflect.DeepEqual first: cmp.Diff is exponential on
				// deeply nested single-element slices.
				if reflect.DeepEqual(tc.want, got) {
					return
				}
				if diff := cmp.Diff(tc.want, got); diff != "" {
					t.Errorf("Decode(%q) mismatch (-want +got):\n%s", tc.in, diff)
				}
				return
			}
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("Decode(%q) = %v, %v; want a *DecodeError", tc.in, got, err)
			}
			gotErr := DecodeError{Code: de.Code, Pointer: de.Pointer}
			wantErr := DecodeError{Code: tc.wantErr.Code, Pointer: tc.wantErr.Pointer}
			if gotErr != wantErr {
				t.Errorf("Decode(%q) error = %v; want code %q pointer %q", tc.in, err, wantErr.Code, wantErr.Pointer)
			}
			if de.Detail == "" {
				t.Errorf("Decode(%q) error has no detail", tc.in)
			}
		})
	}
}

// TestDecodeErrorOmitsValues: errors end up in denied events; a value may
// be a secret, key names may be shown.
func TestDecodeErrorOmitsValues(t *testing.T) {
	t.Parallel()
	const secret = "hunter2hunter2"
	for _, in := range []string{
		`{"password":"` + secret + `\x"}`,
		`{"password":"` + secret + "\xff" + `"}`,
		`{"password":"` + secret + `","password":"` + secret + `"}`,
		`{"password":"` + secret + `"} trailing`,
	} {
		_, err := Decode([]byte(in), Limits{})
		if err == nil {
			t.Fatalf("Decode(%q) = nil error; want one", in)
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("Decode(%q) error %q contains the value", in, err)
		}
	}
}

func TestLimitsWithDefaults(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		in   Limits
		want Limits
	}{
		{name: "zero", in: Limits{}, want: Limits{MaxBytes: 262144, MaxDepth: 32}},
		{name: "negative", in: Limits{MaxBytes: -1, MaxDepth: -1}, want: Limits{MaxBytes: 262144, MaxDepth: 32}},
		{name: "set", in: Limits{MaxBytes: 10, MaxDepth: 3}, want: Limits{MaxBytes: 10, MaxDepth: 3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := tc.in.WithDefaults(); got != tc.want {
				t.Errorf("%+v.WithDefaults() = %+v; want %+v", tc.in, got, tc.want)
			}
		})
	}
}

func TestDecodeErrorString(t *testing.T) {
	t.Parallel()
	tests := []struct {
		err  *DecodeError
		want string
	}{
		{err: &DecodeError{Code: CodeTooLarge, Detail: "300000 bytes, limit 262144"}, want: "ledger: too_large: 300000 bytes, limit 262144"},
		{err: &DecodeError{Code: CodeDuplicateKey, Pointer: "/a", Detail: `duplicate key "a"`}, want: `ledger: duplicate_key at /a: duplicate key "a"`},
	}
	for _, tc := range tests {
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("Error() = %q; want %q", got, tc.want)
		}
	}
}

func TestFoldKeyMatchesEqualFold(t *testing.T) {
	t.Parallel()
	words := []string{"k", "K", "\u212a", "s", "S", "ſ", "straße", "STRASSE", "Σίσυφος", "ΣΊΣΥΦΟΣ", "σίσυφος", "ǅ", "ǆ", "Ǆ", "θ", "ϑ", "Θ", "ϴ", "tool", "TOOL", "toolx", "ﬀ", "ff", "İ", "i", "ı", "I"}
	for _, a := range words {
		for _, b := range words {
			if got, want := foldKey(a) == foldKey(b), strings.EqualFold(a, b); got != want {
				t.Errorf("foldKey(%q) == foldKey(%q) is %v; strings.EqualFold says %v", a, b, got, want)
			}
		}
	}
}

func BenchmarkDecode(b *testing.B) {
	small := []byte(envelopeJSON)
	var big strings.Builder
	big.WriteString(`{"items":[`)
	for i := range 2000 {
		if i > 0 {
			big.WriteByte(',')
		}
		big.WriteString(`{"sku":"sku_12345","qty":3,"price_cents":1999,"note":"gift wrap \u00e9"}`)
	}
	big.WriteString(`]}`)
	for _, bc := range []struct {
		name string
		data []byte
	}{{"envelope", small}, {"150KB", []byte(big.String())}} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(bc.data)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Decode(bc.data, Limits{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestDecodeCaseVariantManyKeys covers objects large enough to switch from
// pairwise comparison to the folded-key map.
func TestDecodeCaseVariantManyKeys(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, foldMapAt - 1, foldMapAt, foldMapAt + 1, 3 * foldMapAt} {
		var b strings.Builder
		b.WriteString(`{"Key_0":0`)
		for i := 1; i < n; i++ {
			b.WriteString(`,"k` + strconv.Itoa(i) + `":0`)
		}
		b.WriteString(`}`)
		ok := b.String()
		if _, err := Decode([]byte(ok), Limits{}); err != nil {
			t.Errorf("Decode(%d distinct keys) = %v; want no error", n, err)
		}
		bad := strings.TrimSuffix(ok, "}") + `,"KEY_0":1}`
		_, err := Decode([]byte(bad), Limits{})
		var de *DecodeError
		if !errors.As(err, &de) || de.Code != CodeCaseVariantKey || de.Pointer != "/KEY_0" {
			t.Errorf("Decode(%d keys then a case variant of the first) = %v; want case_variant_key at /KEY_0", n, err)
		}
	}
}
