package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/toolcall-ledger/ledger/schemas"
)

// Default decoding limits (DESIGN §3: oversized envelopes are denied).
const (
	DefaultMaxBytes = 256 << 10
	DefaultMaxDepth = 32
)

// maxNumberLen bounds the text of one number. No serializer writes a double
// in more than a few dozen characters; longer literals only cost CPU here and
// in the schema validator, which parses numbers with big.Rat.
const maxNumberLen = 256

// Limits bounds what Decode accepts.
type Limits struct {
	// MaxBytes is the largest input accepted; 0 (or negative) means
	// DefaultMaxBytes (256 KiB).
	MaxBytes int
	// MaxDepth is the deepest nesting accepted, the top-level object or
	// array counting as depth 1; 0 (or negative) means DefaultMaxDepth (32).
	MaxDepth int
	// AnyNumber accepts every number of valid syntax, as its text: for
	// input that is never hashed (a token's claims), where the range the
	// canonical hash needs (CodeNumberOutOfRange) is no one's concern.
	AnyNumber bool
}

// WithDefaults returns l with every unset limit set to its default.
func (l Limits) WithDefaults() Limits {
	if l.MaxBytes <= 0 {
		l.MaxBytes = DefaultMaxBytes
	}
	if l.MaxDepth <= 0 {
		l.MaxDepth = DefaultMaxDepth
	}
	return l
}

// ErrorCode is the machine-readable reason of a DecodeError. The codes are
// the reasons of denied events, so they are stable API.
type ErrorCode = string

// The codes a DecodeError carries.
const (
	// CodeInvalidJSON: not JSON (syntax, invalid UTF-8, lone surrogate
	// escape, trailing data).
	CodeInvalidJSON ErrorCode = "invalid_json"
	// CodeDuplicateKey: a key appears twice in one object.
	CodeDuplicateKey ErrorCode = "duplicate_key"
	// CodeCaseVariantKey: two keys of one object differ only in case
	// (Unicode simple case folding, as strings.EqualFold), which
	// case-insensitive decoders downstream would merge.
	CodeCaseVariantKey ErrorCode = "case_variant_key"
	// CodeUnknownField: a field the envelope does not define.
	CodeUnknownField ErrorCode = "unknown_field"
	// CodeTooDeep: nesting deeper than Limits.MaxDepth.
	CodeTooDeep ErrorCode = "too_deep"
	// CodeTooLarge: input longer than Limits.MaxBytes.
	CodeTooLarge ErrorCode = "too_large"
	// CodeNumberOutOfRange: a number the canonical hash cannot represent
	// exactly (magnitude above 2^53, nonzero but underflowing to zero,
	// overflowing float64, or a literal over 256 characters).
	CodeNumberOutOfRange ErrorCode = "number_out_of_range"
	// CodeMissingField: a required field is absent.
	CodeMissingField ErrorCode = "missing_field"
	// CodeInvalidType: a value of the wrong JSON type.
	CodeInvalidType ErrorCode = "invalid_type"
	// CodeInvalidValue: a value of the right type that is not acceptable.
	CodeInvalidValue ErrorCode = "invalid_value"
	// CodeInvalidEnvelope: any other failure of the envelope schema.
	CodeInvalidEnvelope ErrorCode = "invalid_envelope"
)

// DecodeError is why a document was refused. It never quotes a value from
// the document (values may be secrets or redacted fields), only key names.
type DecodeError struct {
	// Code is one of the Code constants.
	Code ErrorCode
	// Pointer is the RFC 6901 JSON pointer of the offending member ("" for
	// the whole document); for a duplicate key, the duplicated member.
	Pointer string
	// Detail is for humans.
	Detail string
}

// Error returns the code, the pointer and the detail.
func (e *DecodeError) Error() string {
	if e.Pointer == "" {
		return "ledger: " + e.Code + ": " + e.Detail
	}
	return fmt.Sprintf("ledger: %s at %s: %s", e.Code, e.Pointer, e.Detail)
}

// Decode parses one JSON document strictly into map[string]any, []any,
// string, json.Number, bool and nil. Beyond RFC 8259 it refuses, as a
// *DecodeError: input over lim.MaxBytes, nesting over lim.MaxDepth,
// duplicate and case-variant keys, invalid UTF-8, lone surrogate escapes,
// numbers the canonical hash cannot represent exactly (see
// CodeNumberOutOfRange) and anything after the value but whitespace. It is
// the one decoder behind validation, hashing and execution, so what was
// validated and hashed is what runs. It never panics.
func Decode(data []byte, lim Limits) (any, error) {
	lim = lim.WithDefaults()
	if len(data) > lim.MaxBytes {
		return nil, &DecodeError{Code: CodeTooLarge, Detail: fmt.Sprintf("%d bytes, limit %d", len(data), lim.MaxBytes)}
	}
	p := parser{data: data, maxDepth: lim.MaxDepth, anyNumber: lim.AnyNumber}
	v, err := p.value(0)
	if err != nil {
		return nil, err
	}
	p.skipSpace()
	if p.pos < len(p.data) {
		return nil, &DecodeError{Code: CodeInvalidJSON, Detail: fmt.Sprintf("data after the value at offset %d", p.pos)}
	}
	return v, nil
}

// frame is one step of the path from the root to the value being parsed.
type frame struct {
	key   string
	index int
	array bool
}

// parser is a recursive-descent JSON parser that knows where it is, so that
// every error carries the pointer of the offending member. The pointer is
// built only when an error occurs.
type parser struct {
	data      []byte
	pos       int
	maxDepth  int
	anyNumber bool
	path      []frame
}

func (p *parser) pointer() string {
	var b strings.Builder
	for _, f := range p.path {
		b.WriteByte('/')
		if f.array {
			b.WriteString(strconv.Itoa(f.index))
		} else {
			b.WriteString(escapePointerToken(f.key))
		}
	}
	return b.String()
}

func (p *parser) fail(code ErrorCode, format string, a ...any) *DecodeError {
	return &DecodeError{Code: code, Pointer: p.pointer(), Detail: fmt.Sprintf(format, a...)}
}

func (p *parser) syntax(format string, a ...any) *DecodeError {
	return p.fail(CodeInvalidJSON, format+" at offset %d", append(a, p.pos)...)
}

func (p *parser) skipSpace() {
	for p.pos < len(p.data) {
		switch p.data[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

// value parses the value at p.pos; depth is the nesting of its container.
func (p *parser) value(depth int) (any, error) {
	p.skipSpace()
	if p.pos >= len(p.data) {
		return nil, p.syntax("unexpected end of input")
	}
	switch c := p.data[p.pos]; {
	case c == '{':
		if depth+1 > p.maxDepth {
			return nil, p.fail(CodeTooDeep, "nesting deeper than %d", p.maxDepth)
		}
		return p.object(depth + 1)
	case c == '[':
		if depth+1 > p.maxDepth {
			return nil, p.fail(CodeTooDeep, "nesting deeper than %d", p.maxDepth)
		}
		return p.array(depth + 1)
	case c == '"':
		return p.string()
	case c == '-' || ('0' <= c && c <= '9'):
		return p.number()
	case c == 't':
		return true, p.literal("true")
	case c == 'f':
		return false, p.literal("false")
	case c == 'n':
		return nil, p.literal("null")
	default:
		return nil, p.syntax("unexpected character %q", rune(c))
	}
}

func (p *parser) literal(word string) error {
	if !bytes.HasPrefix(p.data[p.pos:], []byte(word)) {
		return p.syntax("invalid literal")
	}
	p.pos += len(word)
	return nil
}

func (p *parser) object(depth int) (any, error) {
	p.pos++ // '{'
	m := make(map[string]any)
	// Case variants: small objects compare each new key with the earlier
	// ones (no allocation); from foldMapAt keys on, a map from the
	// case-folded key finds them in constant time.
	var small [foldMapAt]string
	keys := small[:0]
	var folded map[string]string // foldKey(key) -> key as written
	p.skipSpace()
	if p.pos < len(p.data) && p.data[p.pos] == '}' {
		p.pos++
		return m, nil
	}
	for {
		p.skipSpace()
		if p.pos >= len(p.data) || p.data[p.pos] != '"' {
			return nil, p.syntax("expected a string key")
		}
		key, err := p.string()
		if err != nil {
			return nil, err
		}
		p.path = append(p.path, frame{key: key})
		if _, dup := m[key]; dup {
			return nil, p.fail(CodeDuplicateKey, "duplicate key %q", key)
		}
		if other, ok := caseVariant(key, keys, folded); ok {
			return nil, p.fail(CodeCaseVariantKey, "key %q differs from key %q only in case", key, other)
		}
		switch {
		case folded != nil:
			folded[foldKey(key)] = key
		case len(keys) < foldMapAt:
			keys = append(keys, key)
		default:
			folded = make(map[string]string, 2*foldMapAt)
			for _, k := range keys {
				folded[foldKey(k)] = k
			}
			folded[foldKey(key)] = key
		}

		p.skipSpace()
		if p.pos >= len(p.data) || p.data[p.pos] != ':' {
			return nil, p.syntax("expected ':'")
		}
		p.pos++
		v, err := p.value(depth)
		if err != nil {
			return nil, err
		}
		m[key] = v
		p.path = p.path[:len(p.path)-1]

		p.skipSpace()
		if p.pos >= len(p.data) {
			return nil, p.syntax("unexpected end of input in object")
		}
		switch p.data[p.pos] {
		case ',':
			p.pos++
		case '}':
			p.pos++
			return m, nil
		default:
			return nil, p.syntax("expected ',' or '}'")
		}
	}
}

func (p *parser) array(depth int) (any, error) {
	p.pos++ // '['
	a := make([]any, 0)
	p.skipSpace()
	if p.pos < len(p.data) && p.data[p.pos] == ']' {
		p.pos++
		return a, nil
	}
	p.path = append(p.path, frame{array: true})
	for i := 0; ; i++ {
		p.path[len(p.path)-1].index = i
		v, err := p.value(depth)
		if err != nil {
			return nil, err
		}
		a = append(a, v)
		p.skipSpace()
		if p.pos >= len(p.data) {
			return nil, p.syntax("unexpected end of input in array")
		}
		switch p.data[p.pos] {
		case ',':
			p.pos++
		case ']':
			p.pos++
			p.path = p.path[:len(p.path)-1]
			return a, nil
		default:
			return nil, p.syntax("expected ',' or ']'")
		}
	}
}

// string parses a string starting at the opening quote.
func (p *parser) string() (string, error) {
	p.pos++ // '"'
	start := p.pos
	// Fast path: no escapes.
	for p.pos < len(p.data) {
		c := p.data[p.pos]
		switch {
		case c == '"':
			s := string(p.data[start:p.pos])
			p.pos++
			return s, nil
		case c == '\\':
			return p.escapedString(start)
		case c < 0x20:
			return "", p.syntax("control character in string")
		case c < utf8.RuneSelf:
			p.pos++
		default:
			r, size := utf8.DecodeRune(p.data[p.pos:])
			if r == utf8.RuneError && size <= 1 {
				return "", p.syntax("invalid UTF-8 in string")
			}
			p.pos += size
		}
	}
	return "", p.syntax("unterminated string")
}

// escapedString continues a string from its first backslash.
func (p *parser) escapedString(start int) (string, error) {
	buf := make([]byte, 0, p.pos-start+16)
	buf = append(buf, p.data[start:p.pos]...)
	for p.pos < len(p.data) {
		c := p.data[p.pos]
		switch {
		case c == '"':
			p.pos++
			return string(buf), nil
		case c == '\\':
			if p.pos+1 >= len(p.data) {
				return "", p.syntax("unterminated escape")
			}
			e := p.data[p.pos+1]
			p.pos += 2
			switch e {
			case '"', '\\', '/':
				buf = append(buf, e)
			case 'b':
				buf = append(buf, '\b')
			case 'f':
				buf = append(buf, '\f')
			case 'n':
				buf = append(buf, '\n')
			case 'r':
				buf = append(buf, '\r')
			case 't':
				buf = append(buf, '\t')
			case 'u':
				r, err := p.unicodeEscape()
				if err != nil {
					return "", err
				}
				buf = utf8.AppendRune(buf, r)
			default:
				p.pos -= 2
				return "", p.syntax("invalid escape")
			}
		case c < 0x20:
			return "", p.syntax("control character in string")
		case c < utf8.RuneSelf:
			buf = append(buf, c)
			p.pos++
		default:
			r, size := utf8.DecodeRune(p.data[p.pos:])
			if r == utf8.RuneError && size <= 1 {
				return "", p.syntax("invalid UTF-8 in string")
			}
			buf = append(buf, p.data[p.pos:p.pos+size]...)
			p.pos += size
		}
	}
	return "", p.syntax("unterminated string")
}

// unicodeEscape parses the XXXX of \uXXXX (p.pos just past the u), and a
// following low surrogate escape when XXXX is a high surrogate. A lone
// surrogate is an error: decoders disagree on it (U+FFFD or not), so it
// could hash as one string and run as another.
func (p *parser) unicodeEscape() (rune, error) {
	r1, ok := p.hex4()
	if !ok {
		return 0, p.syntax("invalid \\u escape")
	}
	if !utf16.IsSurrogate(r1) {
		return r1, nil
	}
	if r1 >= 0xDC00 || p.pos+1 >= len(p.data) || p.data[p.pos] != '\\' || p.data[p.pos+1] != 'u' {
		return 0, p.syntax("lone surrogate escape")
	}
	p.pos += 2
	r2, ok := p.hex4()
	if !ok {
		return 0, p.syntax("invalid \\u escape")
	}
	r := utf16.DecodeRune(r1, r2)
	if r == unicode.ReplacementChar {
		return 0, p.syntax("lone surrogate escape")
	}
	return r, nil
}

func (p *parser) hex4() (rune, bool) {
	if p.pos+4 > len(p.data) {
		return 0, false
	}
	var r rune
	for _, c := range p.data[p.pos : p.pos+4] {
		r <<= 4
		switch {
		case '0' <= c && c <= '9':
			r |= rune(c - '0')
		case 'a' <= c && c <= 'f':
			r |= rune(c - 'a' + 10)
		case 'A' <= c && c <= 'F':
			r |= rune(c - 'A' + 10)
		default:
			return 0, false
		}
	}
	p.pos += 4
	return r, true
}

// number parses a number per the RFC 8259 grammar and checks its range.
func (p *parser) number() (any, error) {
	start := p.pos
	n := scanNumber(p.data[p.pos:])
	if n == 0 {
		return nil, p.syntax("invalid number")
	}
	p.pos += n
	// A number must end at a delimiter; "01" or "1x" is not a number.
	if p.pos < len(p.data) {
		switch p.data[p.pos] {
		case ' ', '\t', '\n', '\r', ',', ']', '}':
		default:
			return nil, p.syntax("invalid number")
		}
	}
	text := string(p.data[start:p.pos])
	if !p.anyNumber {
		if reason := numberRange(text); reason != "" {
			return nil, p.fail(CodeNumberOutOfRange, "%s", reason)
		}
	}
	return json.Number(text), nil
}

// scanNumber returns the length of the longest prefix of b that is a JSON
// number, or 0 when no prefix is.
func scanNumber(b []byte) int {
	i := 0
	digits := func() int {
		j := i
		for i < len(b) && '0' <= b[i] && b[i] <= '9' {
			i++
		}
		return i - j
	}
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && '1' <= b[i] && b[i] <= '9':
		digits()
	default:
		return 0
	}
	if i < len(b) && b[i] == '.' {
		i++
		if digits() == 0 {
			return 0
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if digits() == 0 {
			return 0
		}
	}
	return i
}

// isJSONNumber reports whether s is exactly one JSON number.
func isJSONNumber(s string) bool {
	return s != "" && scanNumber([]byte(s)) == len(s)
}

// twoPow53 is 2^53, the largest magnitude below which every integer is a
// double; as a digit string for exact comparison with decimal text.
const twoPow53 = "9007199254740992"

// numberRange returns why a syntactically valid number cannot be hashed
// exactly, or "" when it can. Above 2^53 every double is an integer and not
// every integer is a double, so a large literal may hash as a neighbour of
// the value that runs; it is refused rather than rounded. The comparison is
// made on the decimal text, so 9007199254740993 (which parses to 2^53) is
// refused too.
func numberRange(text string) string {
	if len(text) > maxNumberLen {
		return fmt.Sprintf("number literal longer than %d characters", maxNumberLen)
	}
	digits, exp := decimalParts(text)
	if digits == "" {
		return "" // zero
	}
	// The value is 0.digits × 10^exp.
	if exp > int64(len(twoPow53)) || exp == int64(len(twoPow53)) && padCompare(digits, twoPow53) > 0 {
		return "number magnitude above 2^53"
	}
	f, err := strconv.ParseFloat(text, 64)
	if err != nil {
		return "number out of float64 range"
	}
	if f == 0 {
		return "nonzero number underflows to zero"
	}
	return ""
}

// decimalParts returns the significant digits of a JSON number (no leading
// or trailing zeros; "" for zero) and the exponent e with value =
// 0.digits × 10^e. The sign is ignored.
func decimalParts(text string) (string, int64) {
	s := strings.TrimPrefix(text, "-")
	mant, expText, _ := strings.Cut(strings.ToLower(s), "e")
	intPart, frac, _ := strings.Cut(mant, ".")
	exp := int64(len(intPart))
	all := intPart + frac
	trimmed := strings.TrimLeft(all, "0")
	exp -= int64(len(all) - len(trimmed))
	trimmed = strings.TrimRight(trimmed, "0")
	if trimmed == "" {
		return "", 0
	}
	if expText != "" {
		neg := expText[0] == '-'
		expText = strings.TrimLeft(expText, "+-")
		var e int64
		for _, c := range expText {
			e = e*10 + int64(c-'0')
			if e > 1e12 { // saturate: far beyond any double either way
				e = 1e12
			}
		}
		if neg {
			e = -e
		}
		exp += e
	}
	return trimmed, exp
}

// padCompare compares two digit strings as the fractions 0.a and 0.b.
func padCompare(a, b string) int {
	for i := 0; i < max(len(a), len(b)); i++ {
		ca, cb := byte('0'), byte('0')
		if i < len(a) {
			ca = a[i]
		}
		if i < len(b) {
			cb = b[i]
		}
		if ca != cb {
			if ca < cb {
				return -1
			}
			return 1
		}
	}
	return 0
}

// foldMapAt is the number of keys from which object() switches from
// pairwise strings.EqualFold to a map of folded keys.
const foldMapAt = 16

// caseVariant returns an earlier key that equals key under case folding
// (but is not key: duplicates are reported before this is asked).
func caseVariant(key string, keys []string, folded map[string]string) (string, bool) {
	if folded != nil {
		other, ok := folded[foldKey(key)]
		return other, ok
	}
	for _, k := range keys {
		if strings.EqualFold(k, key) {
			return k, true
		}
	}
	return "", false
}

// foldKey is schemas.FoldName: envelopes and registry files refuse the
// same case variants.
func foldKey(s string) string { return schemas.FoldName(s) }

// escapePointerToken escapes one reference token per RFC 6901.
func escapePointerToken(s string) string {
	if !strings.ContainsAny(s, "~/") {
		return s
	}
	return strings.ReplaceAll(strings.ReplaceAll(s, "~", "~0"), "/", "~1")
}
