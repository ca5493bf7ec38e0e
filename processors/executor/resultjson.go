package executor

import (
	"encoding/json"
	"slices"
	"strconv"
)

// appendResult appends the stored form of a tool's result: the wrapper
// that marks it untrusted, with content (a tree from ledger.Decode, masked,
// or the raw body as a string) when not nil. The bytes are those
// json.Marshal writes for the same wrapper, written without reflection
// since every call's result goes through here.
func appendResult(b []byte, source string, truncated bool, content any) []byte {
	b = append(b, `{"untrusted":true,"source":`...)
	b = appendMarshalString(b, source)
	if truncated {
		b = append(b, `,"truncated":true`...)
	}
	if content != nil {
		b = append(b, `,"content":`...)
		b = appendTree(b, content)
	}
	return append(b, '}')
}

// appendTree appends v as json.Marshal writes it (map keys sorted, strings
// HTML-escaped), for the types ledger.Decode returns; anything else goes
// to json.Marshal itself.
func appendTree(b []byte, v any) []byte {
	switch v := v.(type) {
	case nil:
		return append(b, "null"...)
	case bool:
		return strconv.AppendBool(b, v)
	case string:
		return appendMarshalString(b, v)
	case json.Number:
		if v == "" {
			// json.Marshal writes an empty Number as 0.
			return append(b, '0')
		}
		return marshalAppend(b, v)
	case []any:
		b = append(b, '[')
		for i, e := range v {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendTree(b, e)
		}
		return append(b, ']')
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		b = append(b, '{')
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(appendMarshalString(b, k), ':')
			b = appendTree(b, v[k])
		}
		return append(b, '}')
	default:
		return marshalAppend(b, v)
	}
}

// appendMarshalString appends s as json.Marshal quotes it. Plain printable
// ASCII, the usual case, is copied as it is; anything json.Marshal would
// escape (quotes, backslashes, control characters, <, > and &, non-ASCII,
// which it checks for invalid UTF-8 and U+2028/U+2029) goes to it.
func appendMarshalString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if !plainMarshal[s[i]] {
			return marshalAppend(b, s)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// plainMarshal holds the bytes json.Marshal writes in a string as they are.
var plainMarshal = func() (t [256]bool) {
	for c := 0x20; c < 0x7f; c++ {
		t[c] = c != '"' && c != '\\' && c != '<' && c != '>' && c != '&'
	}
	return t
}()

// marshalAppend appends json.Marshal's encoding of v; a value it refuses
// (an invalid json.Number, which ledger.Decode never returns) is written
// as null, so that the result stays a JSON document.
func marshalAppend(b []byte, v any) []byte {
	j, err := json.Marshal(v)
	if err != nil {
		return append(b, "null"...)
	}
	return append(b, j...)
}
