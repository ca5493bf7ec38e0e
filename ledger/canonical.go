package ledger

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// maxCanonicalDepth bounds the recursion of Canonical on trees that did not
// come from Decode (a cyclic map would otherwise never return).
const maxCanonicalDepth = 10000

// Canonical returns the RFC 8785 (JCS) serialization of a decoded tree:
// map[string]any with keys sorted by UTF-16 code units, []any, string
// (escaped as JCS says: only '"', '\\' and control characters, the common
// ones as \b \f \n \r \t and the rest as \u00xx), json.Number, float64 and
// Go integers written as ECMAScript's Number.prototype.toString writes the
// nearest double, bool and nil. Errors are *DecodeError: a non-finite or
// malformed number, a Go integer beyond ±2^53, a string that is not UTF-8,
// or a Go type that is not JSON.
func Canonical(v any) ([]byte, error) {
	c := canonicalizer{buf: make([]byte, 0, 256)}
	if err := c.value(v, 0); err != nil {
		return nil, err
	}
	return c.buf, nil
}

// ArgumentsHash returns the envelope's arguments_hash (DESIGN §3): "sha256:"
// and the lowercase hex SHA-256 of the canonical JSON of
// {"arguments": arguments, "tenant_id": tenantID, "tool": tool,
// "tool_version": toolVersion}. An error in the arguments points into
// them ("/arguments/...").
func ArgumentsHash(tenantID, tool string, toolVersion int, arguments any) (string, error) {
	canonical, err := CanonicalArguments(arguments)
	if err != nil {
		return "", fmt.Errorf("arguments hash: %w", err)
	}
	return HashCanonicalArguments(tenantID, tool, toolVersion, canonical)
}

// CanonicalArguments is Canonical of a call's arguments as ArgumentsHash
// sees them: one level down in the hashed document, so that an error
// points into them ("/arguments/...") and the depth bound counts from
// that document's top.
func CanonicalArguments(arguments any) ([]byte, error) {
	c := canonicalizer{buf: make([]byte, 0, 256), path: []string{"arguments"}}
	if err := c.value(arguments, 1); err != nil {
		return nil, err
	}
	return c.buf, nil
}

// HashCanonicalArguments is ArgumentsHash of arguments already in canonical
// form, exactly as CanonicalArguments returned them, which it takes as
// they are: a caller that holds them canonical (the intake stores them
// so) hashes without canonicalizing again.
//
// An equal hash also says that the bytes are the hashed arguments
// themselves, save for a SHA-256 collision: the document hashed is the
// bytes between a fixed prefix and a suffix that can be read only one
// way (the tenant and the tool JCS-escaped, so that neither holds an
// unescaped quote; the version a decimal integer), so other bytes, or
// bytes that run on into a member of their own, make another document.
// That is why the tenant and the tool must go through the same escaping
// as every other string here.
func HashCanonicalArguments(tenantID, tool string, toolVersion int, canonical []byte) (string, error) {
	// The keys in JCS order: "tool" sorts before "tool_version".
	c := canonicalizer{buf: make([]byte, 0, len(canonical)+len(tenantID)+len(tool)+64)}
	c.buf = append(c.buf, `{"arguments":`...)
	c.buf = append(c.buf, canonical...)
	for _, f := range [...]struct{ key, value string }{{"tenant_id", tenantID}, {"tool", tool}} {
		if !utf8.ValidString(f.value) {
			c.path = append(c.path, f.key)
			return "", fmt.Errorf("arguments hash: %w", c.fail(CodeInvalidValue, "string is not valid UTF-8"))
		}
		c.buf = appendJCSString(append(append(append(c.buf, ',', '"'), f.key...), '"', ':'), f.value)
	}
	c.buf = append(c.buf, `,"tool_version":`...)
	c.path = append(c.path, "tool_version")
	if err := c.integer(int64(toolVersion)); err != nil {
		return "", fmt.Errorf("arguments hash: %w", err)
	}
	c.buf = append(c.buf, '}')
	sum := sha256.Sum256(c.buf)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

type canonicalizer struct {
	buf  []byte
	path []string // escaped pointer tokens, for errors
}

func (c *canonicalizer) fail(code ErrorCode, format string, a ...any) error {
	ptr := ""
	if len(c.path) > 0 {
		ptr = "/" + strings.Join(c.path, "/")
	}
	return &DecodeError{Code: code, Pointer: ptr, Detail: fmt.Sprintf(format, a...)}
}

func (c *canonicalizer) value(v any, depth int) error {
	if depth > maxCanonicalDepth {
		return c.fail(CodeTooDeep, "nesting deeper than %d", maxCanonicalDepth)
	}
	switch v := v.(type) {
	case nil:
		c.buf = append(c.buf, "null"...)
	case bool:
		c.buf = strconv.AppendBool(c.buf, v)
	case string:
		if !utf8.ValidString(v) {
			return c.fail(CodeInvalidValue, "string is not valid UTF-8")
		}
		c.buf = appendJCSString(c.buf, v)
	case json.Number:
		if !isJSONNumber(string(v)) {
			return c.fail(CodeInvalidValue, "not a JSON number")
		}
		f, err := strconv.ParseFloat(string(v), 64)
		if err != nil {
			return c.fail(CodeNumberOutOfRange, "number out of float64 range")
		}
		c.buf = appendES6Number(c.buf, f)
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return c.fail(CodeNumberOutOfRange, "non-finite number")
		}
		c.buf = appendES6Number(c.buf, v)
	case int:
		return c.integer(int64(v))
	case int64:
		return c.integer(v)
	case int32:
		return c.integer(int64(v))
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			if !utf8.ValidString(k) {
				c.path = append(c.path, escapePointerToken(k))
				return c.fail(CodeInvalidValue, "key is not valid UTF-8")
			}
			keys = append(keys, k)
		}
		slices.SortFunc(keys, compareUTF16)
		c.buf = append(c.buf, '{')
		for i, k := range keys {
			if i > 0 {
				c.buf = append(c.buf, ',')
			}
			c.buf = appendJCSString(c.buf, k)
			c.buf = append(c.buf, ':')
			c.path = append(c.path, escapePointerToken(k))
			if err := c.value(v[k], depth+1); err != nil {
				return err
			}
			c.path = c.path[:len(c.path)-1]
		}
		c.buf = append(c.buf, '}')
	case []any:
		c.buf = append(c.buf, '[')
		for i, e := range v {
			if i > 0 {
				c.buf = append(c.buf, ',')
			}
			c.path = append(c.path, strconv.Itoa(i))
			if err := c.value(e, depth+1); err != nil {
				return err
			}
			c.path = c.path[:len(c.path)-1]
		}
		c.buf = append(c.buf, ']')
	default:
		return c.fail(CodeInvalidType, "%T is not a JSON value", v)
	}
	return nil
}

// integer writes a Go integer. Beyond ±2^53 a double cannot hold it, and
// silently hashing a neighbour is worse than refusing.
func (c *canonicalizer) integer(n int64) error {
	if n > 1<<53 || n < -(1<<53) {
		return c.fail(CodeNumberOutOfRange, "integer magnitude above 2^53")
	}
	c.buf = strconv.AppendInt(c.buf, n, 10)
	return nil
}

// appendES6Number appends f as ECMAScript's Number::toString does (ECMA-262
// §6.1.6.1.20), which RFC 8785 §3.2.2.3 adopts: the shortest digits that
// round-trip, in plain notation for 1e-6 <= |f| < 1e21 and as d.ddde±n
// otherwise; -0 is "0". f must be finite.
func appendES6Number(b []byte, f float64) []byte {
	if f == 0 {
		return append(b, '0')
	}
	if f < 0 {
		b = append(b, '-')
		f = -f
	}
	// Shortest round-trip digits, as "d.ddde±xx" or "de±xx".
	var tmp [32]byte
	e := strconv.AppendFloat(tmp[:0], f, 'e', -1, 64)
	mant, expPart, _ := strings.Cut(string(e), "e")
	digits := strings.Replace(mant, ".", "", 1)
	exp, _ := strconv.Atoi(expPart) // "+21", "-07": Atoi accepts the sign
	k := len(digits)
	n := exp + 1 // the decimal point sits after n digits
	switch {
	case k <= n && n <= 21:
		b = append(b, digits...)
		for range n - k {
			b = append(b, '0')
		}
	case 0 < n && n <= 21:
		b = append(b, digits[:n]...)
		b = append(b, '.')
		b = append(b, digits[n:]...)
	case -6 < n && n <= 0:
		b = append(b, "0."...)
		for range -n {
			b = append(b, '0')
		}
		b = append(b, digits...)
	default:
		b = append(b, digits[0])
		if k > 1 {
			b = append(b, '.')
			b = append(b, digits[1:]...)
		}
		b = append(b, 'e')
		if n-1 >= 0 {
			b = append(b, '+')
		}
		b = strconv.AppendInt(b, int64(n-1), 10)
	}
	return b
}

// appendJCSString appends s quoted per RFC 8785 §3.2.2.2. s is valid UTF-8.
func appendJCSString(b []byte, s string) []byte {
	const hexDigits = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		b = append(b, s[start:i]...)
		switch c {
		case '"':
			b = append(b, '\\', '"')
		case '\\':
			b = append(b, '\\', '\\')
		case '\b':
			b = append(b, '\\', 'b')
		case '\f':
			b = append(b, '\\', 'f')
		case '\n':
			b = append(b, '\\', 'n')
		case '\r':
			b = append(b, '\\', 'r')
		case '\t':
			b = append(b, '\\', 't')
		default:
			b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
		}
		start = i + 1
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// compareUTF16 orders strings by their UTF-16 code units, as RFC 8785
// §3.2.3 requires. UTF-8 byte order is code point order, which differs from
// UTF-16 order only between a supplementary character (a surrogate pair,
// D800-DFFF) and a BMP character in E000-FFFF, so runes are compared by
// their first UTF-16 unit and, when that is equal, by themselves.
func compareUTF16(a, b string) int {
	for a != "" && b != "" {
		ra, na := utf8.DecodeRuneInString(a)
		rb, nb := utf8.DecodeRuneInString(b)
		if ra != rb {
			ua, ub := firstUTF16Unit(ra), firstUTF16Unit(rb)
			if ua != ub {
				return int(ua) - int(ub)
			}
			return int(ra) - int(rb)
		}
		a, b = a[na:], b[nb:]
	}
	return len(a) - len(b)
}

func firstUTF16Unit(r rune) rune {
	if r < 0x10000 {
		return r
	}
	return 0xD800 + (r-0x10000)>>10
}
