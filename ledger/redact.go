package ledger

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/big"
	"strconv"
	"strings"

	"github.com/toolcall-ledger/ledger/schemas"
)

// Redacted replaces a redacted value.
const Redacted = "[redacted]"

// Redact returns a deep copy of a decoded tree in which the value at each
// of pointers is replaced by the string "[redacted]". An entry starting with
// "/" is an RFC 6901 pointer ("/card/number", "/items/0/note"); any other
// entry is a bare field name meaning that key in every object at any depth;
// "" redacts the whole tree. Names and pointer tokens match keys whatever
// their case: readers of the result (Go's encoding/json among them) match
// "Card_Number" to a field card_number, so a mask must hide it too.
// Entries that match nothing are ignored. The input tree is not modified.
func Redact(tree any, pointers []string) any {
	var names map[string]bool
	var paths [][]string
	for _, p := range pointers {
		switch {
		case p == "":
			return Redacted
		case strings.HasPrefix(p, "/"):
			toks := strings.Split(p[1:], "/")
			ok := true
			for i, t := range toks {
				if toks[i], ok = unescapePointerToken(t); !ok {
					break
				}
			}
			if ok {
				paths = append(paths, toks)
			}
		default:
			if names == nil {
				names = make(map[string]bool)
			}
			names[p] = true
		}
	}
	return redactCopy(tree, names, paths)
}

// redactCopy copies v. paths are the pointers (as unescaped tokens)
// relative to v that are still live.
func redactCopy(v any, names map[string]bool, paths [][]string) any {
	for _, p := range paths {
		if len(p) == 0 {
			return Redacted
		}
	}
	switch v := v.(type) {
	case map[string]any:
		out := make(map[string]any, len(v))
		for k, e := range v {
			if named(names, k) {
				out[k] = Redacted
				continue
			}
			out[k] = redactCopy(e, names, descend(paths, k))
		}
		return out
	case []any:
		out := make([]any, len(v))
		for i, e := range v {
			out[i] = redactCopy(e, names, descend(paths, strconv.Itoa(i)))
		}
		return out
	default:
		return v
	}
}

// named reports whether names holds k, whatever its case.
func named(names map[string]bool, k string) bool {
	if names[k] {
		return true
	}
	for n := range names {
		if strings.EqualFold(n, k) {
			return true
		}
	}
	return false
}

// descend returns the rests of the paths whose first token is tok,
// whatever its case.
func descend(paths [][]string, tok string) [][]string {
	var out [][]string
	for _, p := range paths {
		if strings.EqualFold(p[0], tok) {
			out = append(out, p[1:])
		}
	}
	return out
}

// unescapePointerToken undoes RFC 6901 escaping; ok is false for a "~" not
// followed by "0" or "1".
func unescapePointerToken(t string) (string, bool) {
	if !strings.Contains(t, "~") {
		return t, true
	}
	var b strings.Builder
	for i := 0; i < len(t); i++ {
		if t[i] != '~' {
			b.WriteByte(t[i])
			continue
		}
		if i+1 >= len(t) {
			return "", false
		}
		switch t[i+1] {
		case '0':
			b.WriteByte('~')
		case '1':
			b.WriteByte('/')
		default:
			return "", false
		}
		i++
	}
	return b.String(), true
}

// Lookup resolves an RFC 6901 JSON pointer in a decoded tree, through
// objects and arrays (schemas.ResolvePointer). A registry's resource
// pointer may pass through an array (/lines/0/order_id): through objects
// alone, it found nothing, and the call's resource, its version's binding
// and its policy resource went without a word.
func Lookup(tree any, ptr string) (any, bool) { return schemas.ResolvePointer(tree, ptr) }

// ResourceOf returns the resource a call's arguments name at a tool's
// resource pointer, as every part of the ledger writes it (its events,
// the policies' resource, the approval's preview, the version read): a
// string as it is, an integer however it is spelt in its one way
// (1e3 and 1000.0 are 1000), anything else as JSON.
func ResourceOf(tree any, ptr string) (string, bool) {
	v, ok := Lookup(tree, ptr)
	if !ok {
		return "", false
	}
	switch v := v.(type) {
	case string:
		return v, true
	case json.Number:
		if n, whole := Integer(v); whole {
			return strconv.FormatInt(n, 10), true
		}
		return v.String(), true
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v), true
	}
	return string(b), true
}

// Integer returns n as an integer if it is one, however it is spelt
// (5000, 5e3, 5000.0), within int64.
func Integer(n json.Number) (int64, bool) {
	if v, err := n.Int64(); err == nil {
		return v, true
	}
	r, ok := new(big.Rat).SetString(string(n))
	if !ok || !r.IsInt() || !r.Num().IsInt64() {
		return 0, false
	}
	return r.Num().Int64(), true
}

// RedactTokens returns a copy of b in which every compact JWS or JWE (a
// JWT is one or the other) is replaced by "[redacted]": a record that
// cannot be parsed may still carry a live assertion or credential, and the
// DLQ must not hand it to whoever reads it.
//
// A token is three or more base64url segments joined by dots whose first
// segment, the header, decodes to what opens and closes like a JSON object
// with members: "{" and the quote of a key at its start, "}" at its end,
// with up to 16 bytes of JSON whitespace around them. The decoded
// header is looked at, never its encoding, for one header has many
// encodings: `{"alg"` is "eyJ...", `{ "alg"` "eyAi...", a leading newline
// "Cn...". Dotted words (host names, versions, file names) do not decode
// to that shape. The header may be glued to base64url characters before
// it (the n of a \n escape, the 3D of %3D), so every offset of a segment
// is a candidate; from the header on, the whole dotted run is redacted.
//
// A JSON string may spell any character as a \uXXXX escape, and a
// decoder hands the token back whole: `\u002e` for its dots, `\u0065` for
// the e of "eyJ". So an escape of a base64url character or a dot counts as
// that character, and the whole raw span of a token, its escapes included,
// is redacted.
//
// It runs on bad input only, but bad input can be a flood, so the scan is
// linear in len(b) and parses no JSON: a candidate costs the decoding of
// at most tokenProbe+3 characters at each end of its segment.
func RedactTokens(b []byte) []byte {
	view, at := unescaped(b)
	var out []byte
	done := 0 // b[:done] has been copied to out
	for i := 0; i < len(view); {
		if !isBase64URL(view[i]) && view[i] != '.' {
			i++
			continue
		}
		j := i + 1
		for j < len(view) && (isBase64URL(view[j]) || view[j] == '.') {
			j++
		}
		if k := tokenStart(view[i:j]); k >= 0 {
			start, end := i+k, j
			if at != nil {
				start, end = at[start], at[end]
			}
			out = append(out, b[done:start]...)
			out = append(out, Redacted...)
			done = end
		}
		i = j
	}
	return append(out, b[done:]...)
}

// unescaped returns b with each JSON \uXXXX escape of a base64url
// character or a dot replaced by that character, and its NUL bytes left
// out, and where each of its bytes starts in b (one more entry: len(b));
// or b itself and nil when b holds no such escape and no NUL. An escaped
// backslash is not an escape's start. Text in UTF-16 or UTF-32 (an agent
// host that encodes its envelopes so: .NET's Encoding.Unicode) spells
// each ASCII character with NUL bytes beside it, which would hide every
// token in it from the scan; without them, its tokens are found, and
// their whole span, NULs included, is redacted.
func unescaped(b []byte) ([]byte, []int) {
	if !bytes.Contains(b, []byte(`\u`)) && bytes.IndexByte(b, 0) < 0 {
		return b, nil
	}
	view := make([]byte, 0, len(b))
	at := make([]int, 0, len(b)+1)
	for i := 0; i < len(b); {
		if b[i] == '\\' && i+1 < len(b) {
			if c, ok := escapedTokenByte(b[i:]); ok {
				view, at = append(view, c), append(at, i)
				i += 6
				continue
			}
			// The escape's second byte is not an escape's start (\\u
			// is a backslash, then u).
			view, at = append(view, b[i], b[i+1]), append(at, i, i+1)
			i += 2
			continue
		}
		if b[i] != 0 {
			view, at = append(view, b[i]), append(at, i)
		}
		i++
	}
	return view, append(at, len(b))
}

// escapedTokenByte reads a \uXXXX escape at the start of e, and returns
// the byte it stands for if that is a base64url character or a dot.
func escapedTokenByte(e []byte) (byte, bool) {
	if len(e) < 6 || e[1] != 'u' {
		return 0, false
	}
	var cp int
	for _, h := range e[2:6] {
		var d int
		switch {
		case h >= '0' && h <= '9':
			d = int(h - '0')
		case h >= 'a' && h <= 'f':
			d = int(h-'a') + 10
		case h >= 'A' && h <= 'F':
			d = int(h-'A') + 10
		default:
			return 0, false
		}
		cp = cp<<4 | d
	}
	if cp >= 0x80 || !(isBase64URL(byte(cp)) || cp == '.') {
		return 0, false
	}
	return byte(cp), true
}

// tokenProbe is how many characters of a candidate header RedactTokens
// decodes at each end, at least (a multiple of 4: whole base64 quanta).
// 24 decode to 18 bytes: room for "{" and the key's quote after up to 16
// bytes of whitespace, and for "}" before up to 16.
const tokenProbe = 24

// tokenStart returns where the first token in run (base64url characters
// and dots only) begins, or -1 if it holds none.
func tokenStart(run []byte) int {
	for seg := 0; ; {
		dot := bytes.IndexByte(run[seg:], '.')
		if dot < 0 {
			return -1
		}
		next := seg + dot + 1
		if bytes.IndexByte(run[next:], '.') < 0 {
			return -1 // fewer than three segments from here on
		}
		for k := seg; k < seg+dot; k++ {
			// The first decoded byte is '{' or JSON whitespace only if
			// the first character is one of these: a cheap filter.
			switch run[k] {
			case 'e', 'I', 'C', 'D':
				if objectHeader(run[k : seg+dot]) {
					return k
				}
			}
		}
		seg = next
	}
}

// objectHeader reports whether the base64url segment h decodes to what
// opens and closes like a JSON object with members. Only its ends are
// decoded.
func objectHeader(h []byte) bool {
	if len(h)%4 == 1 {
		return false // no base64 text has this length
	}
	var buf [tokenProbe/4*3 + 2]byte // the tail may be 3 characters longer
	head, ok := decodeProbe(buf[:], h[:min(len(h), tokenProbe)])
	if !ok {
		return false
	}
	i := skipJSONSpace(head, 0)
	if i >= len(head) || head[i] != '{' {
		return false
	}
	if i = skipJSONSpace(head, i+1); i >= len(head) || head[i] != '"' {
		return false
	}
	// The tail starts a whole number of quanta into h, so that it decodes
	// as part of h does, and holds at least tokenProbe characters.
	t := max(0, len(h)-tokenProbe)
	t -= t % 4
	tail, ok := decodeProbe(buf[:], h[t:])
	if !ok {
		return false
	}
	j := len(tail) - 1
	for j >= 0 && isJSONSpace(tail[j]) {
		j--
	}
	return j >= 0 && tail[j] == '}'
}

// decodeProbe decodes src, at most tokenProbe+3 characters, into dst.
func decodeProbe(dst, src []byte) ([]byte, bool) {
	n, err := base64.RawURLEncoding.Decode(dst, src)
	return dst[:n], err == nil
}

func skipJSONSpace(b []byte, i int) int {
	for i < len(b) && isJSONSpace(b[i]) {
		i++
	}
	return i
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func isBase64URL(c byte) bool {
	return 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_'
}
