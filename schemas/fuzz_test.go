package schemas

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// FuzzValidate checks, for any JSON document and any demo tool, that
// validation never panics, is deterministic, survives a serialization round
// trip (accepted stays accepted, rejected stays rejected at the same place),
// and that every failure is a *ValidationError whose pointer resolves in the
// document (for a missing property: whose parent does, and it doesn't).
func FuzzValidate(f *testing.F) {
	r, err := Demo()
	if err != nil {
		f.Fatalf("Demo() = %v", err)
	}
	tools := r.Tools()
	index := func(name string) uint8 {
		for i, t := range tools {
			if t.Name == name {
				return uint8(i)
			}
		}
		f.Fatalf("no demo tool %q", name)
		return 0
	}
	for _, tc := range validateCases {
		f.Add(index(tc.tool), []byte(tc.args))
	}
	f.Add(uint8(0), []byte(validEnvelope))
	for i := range envelopeBounds {
		b, err := json.Marshal(withBound(f, i))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(uint8(0), b)
	}

	f.Fuzz(func(t *testing.T, which uint8, doc []byte) {
		tool := tools[int(which)%len(tools)]
		v, ok := fuzzDecode(doc)
		if !ok {
			return
		}
		err1 := tool.Validate(v)
		checkValidationError(t, v, err1)
		if again := tool.Validate(v); !cmp.Equal(err1, again) {
			t.Fatalf("Validate is not deterministic: %v then %v", err1, again)
		}
		// Round trip through the wire form.
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatalf("json.Marshal(decoded) = %v", err)
		}
		v2, ok := fuzzDecode(b)
		if !ok {
			t.Fatalf("re-decoding %q failed", b)
		}
		err2 := tool.Validate(v2)
		if !cmp.Equal(err1, err2) {
			t.Fatalf("Validate before and after round trip differ:\n%v\n%v", err1, err2)
		}
		// The envelope schema obeys the same rules, and its fast path
		// accepts nothing the schema refuses.
		checkValidationError(t, v, ValidateEnvelope(v))
		if envelopeMeets(v) {
			if err := validateEnvelopeSchema(v); err != nil {
				t.Fatalf("the envelope fast path accepts what the schema refuses: %v", err)
			}
		}
	})
}

// fuzzDecode decodes one JSON document with json.Number, as ledger.Decode
// does, and refuses what ledger.Decode refuses that matters here: number
// literals longer than it accepts.
func fuzzDecode(b []byte) (any, bool) {
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil || dec.More() {
		return nil, false
	}
	if tooLongNumber(v) {
		return nil, false
	}
	return v, true
}

func tooLongNumber(v any) bool {
	switch v := v.(type) {
	case json.Number:
		return len(v) > 64
	case []any:
		for _, e := range v {
			if tooLongNumber(e) {
				return true
			}
		}
	case map[string]any:
		for _, e := range v {
			if tooLongNumber(e) {
				return true
			}
		}
	}
	return false
}

func checkValidationError(t *testing.T, doc any, err error) {
	t.Helper()
	if err == nil {
		return
	}
	var ve *ValidationError
	if !errors.As(err, &ve) {
		t.Fatalf("error %v (%T); want a *ValidationError", err, err)
	}
	if ve.Pointer != "" && !validPointer(ve.Pointer) {
		t.Fatalf("pointer %q is not an RFC 6901 pointer", ve.Pointer)
	}
	if ve.Keyword == "required" {
		i := strings.LastIndex(ve.Pointer, "/")
		if i < 0 {
			t.Fatalf("required failure at %q; want the missing property's pointer", ve.Pointer)
		}
		if _, ok := ResolvePointer(doc, ve.Pointer[:i]); !ok {
			t.Fatalf("required failure at %q: parent does not resolve", ve.Pointer)
		}
		if _, ok := ResolvePointer(doc, ve.Pointer); ok {
			t.Fatalf("required failure at %q: the property exists", ve.Pointer)
		}
		return
	}
	if _, ok := ResolvePointer(doc, ve.Pointer); !ok {
		t.Fatalf("failure %+v: pointer does not resolve in the document", ve)
	}
}
