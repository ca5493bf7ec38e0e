package ledger

import (
	"strconv"
	"strings"
)

// Redacted replaces a redacted value.
const Redacted = "[redacted]"

// Redact returns a deep copy of a decoded tree in which the value at each
// of pointers is replaced by the string "[redacted]". An entry starting with
// "/" is an RFC 6901 pointer ("/card/number", "/items/0/note"); any other
// entry is a bare field name meaning that key in every object at any depth;
// "" redacts the whole tree. Entries that match nothing are ignored. The
// input tree is not modified.
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
			if names[k] {
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

// descend returns the rests of the paths whose first token is tok.
func descend(paths [][]string, tok string) [][]string {
	var out [][]string
	for _, p := range paths {
		if p[0] == tok {
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

// Lookup resolves an RFC 6901 JSON pointer in a decoded tree (objects
// only: a pointer into an array finds nothing).
func Lookup(tree any, ptr string) (any, bool) {
	if ptr == "" {
		return tree, true
	}
	if !strings.HasPrefix(ptr, "/") {
		return nil, false
	}
	cur := tree
	for _, tok := range strings.Split(ptr[1:], "/") {
		tok = strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~")
		m, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = m[tok]; !ok {
			return nil, false
		}
	}
	return cur, true
}
