// Package jsonappend writes JSON objects field by field onto a byte
// slice, byte for byte as encoding/json writes them with HTML escaping
// off, without its per-field reflection. It serves the encoders on the
// hot path (an event, a credential's claims), which are written once per
// call and whose reflection was most of their cost.
package jsonappend

import (
	"bytes"
	"encoding/json"
	"strconv"
)

// String appends s quoted. Strings of printable ASCII without quote or
// backslash, nearly all of the ledger's, are copied as they are; anything
// else goes through encoding/json so that its escaping rules (control
// characters, invalid UTF-8, U+2028) stay the only ones.
func String(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if !plain[s[i]] {
			return stringSlow(b, s)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// Plain reports whether a JSON string carries c as it is: printable ASCII
// but the quote and the backslash.
func Plain(c byte) bool { return plain[c] }

var plain = func() (t [256]bool) {
	for c := 0x20; c < 0x7f; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

func stringSlow(b []byte, s string) []byte {
	buf := bytes.NewBuffer(b)
	enc := json.NewEncoder(buf)
	enc.SetEscapeHTML(false)
	// A string always encodes.
	_ = enc.Encode(s)
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

// Key appends ,"name": for a field after the object's first (names are
// plain ASCII).
func Key(b []byte, name string) []byte {
	b = append(b, ',', '"')
	b = append(b, name...)
	return append(b, '"', ':')
}

// StringField appends ,"name":"s".
func StringField(b []byte, name, s string) []byte {
	return String(Key(b, name), s)
}

// OptString is StringField for a field tagged omitempty: nothing for "".
func OptString(b []byte, name, s string) []byte {
	if s == "" {
		return b
	}
	return StringField(b, name, s)
}

// IntField appends ,"name":n.
func IntField(b []byte, name string, n int64) []byte {
	return strconv.AppendInt(Key(b, name), n, 10)
}

// OptInt is IntField for a field tagged omitempty: nothing for 0.
func OptInt(b []byte, name string, n int64) []byte {
	if n == 0 {
		return b
	}
	return IntField(b, name, n)
}

// OptStrings appends ,"name":[...] for a []string field tagged
// omitempty: nothing for an empty slice.
func OptStrings(b []byte, name string, ss []string) []byte {
	if len(ss) == 0 {
		return b
	}
	b = append(Key(b, name), '[')
	for i, s := range ss {
		if i > 0 {
			b = append(b, ',')
		}
		b = String(b, s)
	}
	return append(b, ']')
}
