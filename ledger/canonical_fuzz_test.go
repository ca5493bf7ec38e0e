package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf16"
	"unicode/utf8"
)

// canonicalSeeds are documents whose canonical forms exercise what JCS
// specifies: key order by UTF-16 units (astral characters against the
// E000-FFFF block), escapes, numbers of every spelling, nesting.
var canonicalSeeds = []string{
	`{"b":1,"a":2,"":3}`,
	`{"\ud83d\ude00":1,"\ufb33":2,"\u20ac":3,"\r":4,"1":5,"\u0080":6,"\u00f6":7}`,
	`{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001,-0,0e5,5e-324,9007199254740992]}`,
	`{"string":"\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/","literals":[null,true,false]}`,
	`{"a":{"b":{"c":[1,[2,[3,{"d":"\u2028\u2029"}]]]}}}`,
	`{"arguments":{"order_id":"ord_1029","amount_cents":4500,"currency":"AUD"},"tenant_id":"t_acme","tool":"refund_order","tool_version":3}`,
	`[1.0,1,1e0,10e-1,0.1e1]`,
	`"\ud800\udc00\uffff\u0000"`,
}

// FuzzCanonical checks the canonical form (RFC 8785 JCS) and the arguments
// hash of every document Decode accepts:
//   - Canonical never panics and fails only with a *DecodeError;
//   - it is idempotent: the canonical form decodes to a tree whose
//     canonical form is the same bytes;
//   - it is compact, valid UTF-8 JSON, with every object's keys in
//     strictly increasing UTF-16 order (checked independently of
//     compareUTF16);
//   - any other spelling of the same document (members reordered,
//     whitespace, characters escaped or not, numbers respelled to the
//     same double, -0 for 0) has the same canonical form and the same
//     arguments hash;
//   - a string or key that is not UTF-8 is refused, never hashed.
func FuzzCanonical(f *testing.F) {
	for i, s := range canonicalSeeds {
		f.Add([]byte(s), uint64(i))
	}
	for i, tc := range decodeCases {
		if tc.wantErr == nil && len(tc.in) <= maxSeed {
			f.Add([]byte(tc.in), uint64(i))
		}
	}
	f.Fuzz(func(t *testing.T, data []byte, seed uint64) {
		checkRawStrings(t, data)
		tree, err := Decode(data, Limits{})
		if err != nil {
			return // FuzzDecode covers refusals
		}
		c1, err := Canonical(tree)
		if err != nil {
			t.Fatalf("Canonical(Decode(%q)) = %v; want every accepted document to canonicalize", data, err)
		}
		if !utf8.Valid(c1) || !json.Valid(c1) {
			t.Fatalf("canonical form %q is not valid UTF-8 JSON", c1)
		}
		var compact bytes.Buffer
		if err := json.Compact(&compact, c1); err != nil || !bytes.Equal(compact.Bytes(), c1) {
			t.Fatalf("canonical form %q is not compact", c1)
		}
		if err := checkKeyOrder(json.NewDecoder(bytes.NewReader(c1))); err != nil {
			t.Fatalf("canonical form %q: %v", c1, err)
		}
		tree2, err := Decode(c1, Limits{MaxBytes: 1 << 30})
		if err != nil {
			t.Fatalf("Decode(Canonical) of %q = %v", c1, err)
		}
		if c2, err := Canonical(tree2); err != nil || !bytes.Equal(c1, c2) {
			t.Fatalf("Canonical is not idempotent:\n%s\n%s (%v)", c1, c2, err)
		}

		// Another spelling of the same document.
		rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
		var b bytes.Buffer
		respell(&b, tree, rng)
		other := b.Bytes()
		tree3, err := Decode(other, Limits{MaxBytes: 1 << 30})
		if err != nil {
			t.Fatalf("the respelling %q of %q does not decode: %v", other, data, err)
		}
		c3, err := Canonical(tree3)
		if err != nil || !bytes.Equal(c1, c3) {
			t.Fatalf("two spellings of one document canonicalize apart:\n%q -> %s\n%q -> %s (%v)", data, c1, other, c3, err)
		}
		h1, err1 := ArgumentsHash("t_fuzz", "tool", 1, tree)
		h3, err3 := ArgumentsHash("t_fuzz", "tool", 1, tree3)
		if err1 != nil || err3 != nil || h1 != h3 {
			t.Fatalf("arguments hash %s (%v) and %s (%v) for two spellings of one document", h1, err1, h3, err3)
		}
		if hc, err := HashCanonicalArguments("t_fuzz", "tool", 1, c1); err != nil || hc != h1 {
			t.Fatalf("the hash of the canonical form %s is %s (%v); ArgumentsHash's is %s", c1, hc, err, h1)
		}
		// The hash as DESIGN §3 defines it, canonicalizing the whole
		// document, with the input's text as the tenant and the tool:
		// ArgumentsHash, which hashes around the canonical arguments,
		// must agree, errors included.
		tenant, tool := string(data[:len(data)/2]), string(data[len(data)/2:])
		version := int(seed%5) - 2
		if seed%7 == 0 {
			version = 1<<53 + int(seed%3) - 1
		}
		want, wantErr := definedArgumentsHash(tenant, tool, version, tree)
		got, gotErr := ArgumentsHash(tenant, tool, version, tree)
		if got != want || (gotErr == nil) != (wantErr == nil) || (gotErr != nil && errors.Unwrap(gotErr).Error() != wantErr.Error()) {
			t.Fatalf("ArgumentsHash(%q, %q, %d) = %s, %v; the definition gives %s, %v", tenant, tool, version, got, gotErr, want, wantErr)
		}
	})
}

// checkRawStrings: Canonical of a tree that holds data as a string value
// and as a key fails with invalid_value exactly when data is not UTF-8,
// and otherwise round-trips it.
func checkRawStrings(t *testing.T, data []byte) {
	t.Helper()
	s := string(data)
	for _, tree := range []any{map[string]any{"k": s}, map[string]any{s: true}, []any{s}} {
		c, err := Canonical(tree)
		if !utf8.ValidString(s) {
			var de *DecodeError
			if !errors.As(err, &de) || de.Code != CodeInvalidValue {
				t.Fatalf("Canonical(%#v) = %q, %v; want an invalid_value DecodeError", tree, c, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("Canonical(%#v) = %v", tree, err)
		}
		back, err := Decode(c, Limits{MaxBytes: 1 << 30})
		if err != nil || !sameTree(back, tree) {
			t.Fatalf("Canonical(%#v) = %q, which decodes to %#v (%v)", tree, c, back, err)
		}
	}
}

// checkKeyOrder reads one JSON value from dec and reports an object whose
// keys are not in strictly increasing order of UTF-16 code units.
func checkKeyOrder(dec *json.Decoder) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch tok {
	case json.Delim('{'):
		var prev []uint16
		for first := true; dec.More(); first = false {
			k, err := dec.Token()
			if err != nil {
				return err
			}
			units := utf16.Encode([]rune(k.(string)))
			if !first && slices.Compare(prev, units) >= 0 {
				return fmt.Errorf("key %q after %q", k, string(utf16.Decode(prev)))
			}
			prev = units
			if err := checkKeyOrder(dec); err != nil {
				return err
			}
		}
		_, err = dec.Token() // '}'
		return err
	case json.Delim('['):
		for dec.More() {
			if err := checkKeyOrder(dec); err != nil {
				return err
			}
		}
		_, err = dec.Token() // ']'
		return err
	}
	return nil
}

// respell writes v, a tree from Decode, as another JSON text of the same
// document, choosing with rng: members in another order, whitespace,
// characters escaped or not, numbers in another notation of the same
// double.
func respell(w io.Writer, v any, rng *rand.Rand) {
	space := func() {
		if rng.IntN(4) == 0 {
			io.WriteString(w, [...]string{" ", "\n", "\t", "\r\n  "}[rng.IntN(4)])
		}
	}
	space()
	switch v := v.(type) {
	case nil:
		io.WriteString(w, "null")
	case bool:
		io.WriteString(w, strconv.FormatBool(v))
	case string:
		respellString(w, v, rng)
	case json.Number:
		io.WriteString(w, respellNumber(v, rng))
	case []any:
		io.WriteString(w, "[")
		for i, e := range v {
			if i > 0 {
				io.WriteString(w, ",")
			}
			respell(w, e, rng)
		}
		space()
		io.WriteString(w, "]")
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.Sort(keys) // map order is random: start from a fixed one
		rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
		io.WriteString(w, "{")
		for i, k := range keys {
			if i > 0 {
				io.WriteString(w, ",")
			}
			space()
			respellString(w, k, rng)
			space()
			io.WriteString(w, ":")
			respell(w, v[k], rng)
		}
		space()
		io.WriteString(w, "}")
	}
	space()
}

// respellString writes s quoted, each character as itself or escaped.
func respellString(w io.Writer, s string, rng *rand.Rand) {
	hex := "%04x"
	if rng.IntN(2) == 0 {
		hex = "%04X"
	}
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			if rng.IntN(2) == 0 {
				b.WriteByte('\\')
				b.WriteRune(r)
			} else {
				fmt.Fprintf(&b, `\u`+hex, r)
			}
		case r < 0x20 || rng.IntN(4) == 0:
			if r >= 0x10000 {
				hi, lo := utf16.EncodeRune(r)
				fmt.Fprintf(&b, `\u`+hex+`\u`+hex, hi, lo)
			} else {
				fmt.Fprintf(&b, `\u`+hex, r)
			}
		case r == '/' && rng.IntN(2) == 0:
			b.WriteString(`\/`)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	io.WriteString(w, b.String())
}

// respellNumber returns another notation of the double n stands for.
func respellNumber(n json.Number, rng *rand.Rand) string {
	f, err := strconv.ParseFloat(string(n), 64)
	if err != nil {
		return string(n)
	}
	var s string
	switch rng.IntN(5) {
	case 0:
		s = string(n)
	case 1:
		s = strconv.FormatFloat(f, 'e', -1, 64)
	case 2:
		s = strings.ToUpper(strconv.FormatFloat(f, 'g', -1, 64))
	case 3:
		s = strconv.FormatFloat(f, 'f', -1, 64)
		if len(s) > 64 {
			s = strconv.FormatFloat(f, 'e', -1, 64)
		}
	default:
		// The digits as an integer with a trailing zero, the point
		// moved into the exponent: d.dd e X = dd0 e for 3 digits.
		mant, exp, _ := strings.Cut(strconv.FormatFloat(f, 'e', -1, 64), "e")
		e, _ := strconv.Atoi(exp)
		sign, digits := "", mant
		if rest, ok := strings.CutPrefix(mant, "-"); ok {
			sign, digits = "-", rest
		}
		digits = strings.Replace(digits, ".", "", 1)
		s = sign + digits + "0e" + strconv.Itoa(e-len(digits))
		if f == 0 {
			s = "0.0e0" // "00e-1" would not be a number
		}
	}
	if f == 0 && rng.IntN(2) == 0 {
		s = "-0.0e+7" // JCS writes -0 as 0
	}
	return s
}

// definedArgumentsHash is DESIGN §3's arguments_hash spelled out: the
// SHA-256 of the canonical form of the whole document.
func definedArgumentsHash(tenantID, tool string, toolVersion int, arguments any) (string, error) {
	b, err := Canonical(map[string]any{
		"arguments":    arguments,
		"tenant_id":    tenantID,
		"tool":         tool,
		"tool_version": toolVersion,
	})
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}
