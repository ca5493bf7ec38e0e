package schemas

import (
	"encoding/json"
	"strconv"
	"unicode"
	"unicode/utf8"
)

// envelopeMeets reports whether v certainly meets the envelope schema
// (envelope.schema.json), checked by hand. It is ValidateEnvelope's fast
// path: every request passes through it, and the general validator takes
// about 20 µs an envelope (a closure and a path string per keyword, numbers
// through big.Rat), a tenth of the intake's work for a call. It may answer
// false for a valid envelope (a number written "8e3", say): the schema then
// decides, and words the error. It must never answer true for an envelope
// the schema refuses; FuzzEnvelopeFastPath holds it to that, and
// TestEnvelopeFastPathBoundaries walks each bound of the schema. An edit of
// the schema that this does not follow can only make it refuse less than
// the schema would: change both together.
func envelopeMeets(v any) bool {
	m, ok := v.(map[string]any)
	if !ok {
		return false
	}
	required := 0
	for k, val := range m {
		switch k {
		case "tool":
			ok = isToolName(val)
		case "tool_version":
			ok = isIntIn(val, 1, 2147483647)
		case "call_id":
			ok = isHeaderString(val, 1, 255)
		case "arguments":
			_, ok = val.(map[string]any)
		case "scope":
			ok = scopeMeets(val)
		case "idempotency_key":
			k, isString := val.(string)
			ok = isString && ValidIdempotencyKey(k)

		case "arguments_hash":
			ok = isArgumentsHash(val)
		case "trace_id":
			ok = isHeaderString(val, 0, 255)
		case "deadline_ms":
			ok = isIntIn(val, 1, 3600000)
		case "assertion":
			s, isString := val.(string)
			ok = isString && utf8.RuneCountInString(s) <= MaxAssertionBytes
		default:
			return false
		}
		if !ok {
			return false
		}
		switch k {
		case "tool", "tool_version", "call_id", "arguments", "scope", "idempotency_key", "arguments_hash":
			required++
		}
	}
	return required == 7
}

// scopeMeets is envelopeMeets for the scope object.
func scopeMeets(v any) bool {
	m, ok := v.(map[string]any)
	if !ok {
		return false
	}
	tenant := false
	for k, val := range m {
		switch k {
		case "tenant_id":
			ok, tenant = isTenantID(val), true
		case "user_id", "on_behalf_of":
			ok = isPlainString(val, 0, 255)
		case "purpose":
			ok = isPlainString(val, 0, 1024)
		default:
			return false
		}
		if !ok {
			return false
		}
	}
	return tenant
}

// isToolName: ^[a-z][a-z0-9_]{0,63}$.
func isToolName(v any) bool {
	s, ok := v.(string)
	if !ok || len(s) < 1 || len(s) > 64 || s[0] < 'a' || s[0] > 'z' {
		return false
	}
	for i := 1; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// ValidTenantID reports whether s is a tenant id as the envelope schema
// has it (^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$): a tenant an agent's call
// can be filed under. The ledger's own (ledger.UnverifiedTenant) is not.
func ValidTenantID(s string) bool { return isTenantID(s) }

// ValidIdempotencyKey reports whether s is an idempotency key as the
// envelope schema has it: 1 to 255 printable ASCII characters, neither
// first nor last a space, and neither "." nor "..", which would be path
// segments in every URL that names the call (GET /v1/calls/{key}, the
// trace, the console), resolved away by clients and servers.
func ValidIdempotencyKey(s string) bool {
	return isPrintableASCII(s, 1, 255) && s != "." && s != ".." && !edgeSpace(s)
}

// isTenantID: ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$.
func isTenantID(v any) bool {
	s, ok := v.(string)
	if !ok || len(s) < 1 || len(s) > 128 || !isAlnum(s[0]) {
		return false
	}
	for i := 1; i < len(s); i++ {
		if c := s[i]; !isAlnum(c) && c != '_' && c != '.' && c != ':' && c != '-' {
			return false
		}
	}
	return true
}

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// isPlainString: a string of min to max characters (code points, as the
// schema counts them) matching ^[^\x00-\x1f\x7f]*$.
func isPlainString(v any, min, max int) bool {
	s, ok := v.(string)
	if !ok || len(s) < min {
		return false
	}
	n := 0
	for _, r := range s {
		if r < 0x20 || r == 0x7f {
			return false
		}
		n++
	}
	return n >= min && n <= max
}

// isHeaderString is isPlainString for a value sent to the tool as a
// header: neither its first nor its last rune is white space
// (unicode.IsSpace), which a header's reader trims away, so that the
// executor's adapter would refuse to send it.
func isHeaderString(v any, min, max int) bool {
	s, ok := v.(string)
	return ok && isPlainString(s, min, max) && !edgeSpace(s)
}

// edgeSpace reports whether s starts or ends with white space.
func edgeSpace(s string) bool {
	first, _ := utf8.DecodeRuneInString(s)
	last, _ := utf8.DecodeLastRuneInString(s)
	return s != "" && (unicode.IsSpace(first) || unicode.IsSpace(last))
}

// isPrintableASCII: ^[\x20-\x7E]+$ and min to max characters.
func isPrintableASCII(v any, min, max int) bool {
	s, ok := v.(string)
	if !ok || len(s) < min || len(s) > max {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return len(s) > 0
}

// isArgumentsHash: ^sha256:[0-9a-f]{64}$.
func isArgumentsHash(v any) bool {
	s, ok := v.(string)
	const prefix = "sha256:"
	if !ok || len(s) != len(prefix)+64 || s[:len(prefix)] != prefix {
		return false
	}
	for i := len(prefix); i < len(s); i++ {
		if c := s[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// isIntIn: a json.Number written as plain decimal digits (no sign, no
// leading zero, no fraction or exponent) between min and max. Any other
// spelling of an integer is left to the schema.
func isIntIn(v any, min, max int64) bool {
	n, ok := v.(json.Number)
	if !ok || len(n) < 1 || len(n) > 18 || n[0] == '0' {
		return false
	}
	for i := 0; i < len(n); i++ {
		if n[i] < '0' || n[i] > '9' {
			return false
		}
	}
	x, err := strconv.ParseInt(string(n), 10, 64)
	return err == nil && x >= min && x <= max
}
