package ledger

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// maxSeed leaves the table cases that test the size limit out of the fuzz
// corpus: the fuzzer spends its time minimizing 256 KiB inputs otherwise.
const maxSeed = 4096

var knownCodes = map[ErrorCode]bool{
	CodeInvalidJSON: true, CodeDuplicateKey: true, CodeCaseVariantKey: true,
	CodeUnknownField: true, CodeTooDeep: true, CodeTooLarge: true,
	CodeNumberOutOfRange: true, CodeMissingField: true, CodeInvalidType: true,
	CodeInvalidValue: true, CodeInvalidEnvelope: true,
}

// checkDecodeError fails unless err is a *DecodeError with a known code and
// a well-formed RFC 6901 pointer.
func checkDecodeError(t *testing.T, err error) {
	t.Helper()
	var de *DecodeError
	if !errors.As(err, &de) {
		t.Fatalf("error %v (%T); want a *DecodeError", err, err)
	}
	if !knownCodes[de.Code] {
		t.Fatalf("error code %q is not one of the declared codes", de.Code)
	}
	if de.Pointer != "" {
		if de.Pointer[0] != '/' {
			t.Fatalf("pointer %q does not start with /", de.Pointer)
		}
		for i := 0; i < len(de.Pointer); i++ {
			if de.Pointer[i] == '~' && (i+1 >= len(de.Pointer) || (de.Pointer[i+1] != '0' && de.Pointer[i+1] != '1')) {
				t.Fatalf("pointer %q has a bad ~ escape", de.Pointer)
			}
		}
	}
}

// sameTree compares decoded trees, numbers by value.
func sameTree(a, b any) bool {
	switch a := a.(type) {
	case json.Number:
		b, ok := b.(json.Number)
		if !ok {
			return false
		}
		fa, errA := strconv.ParseFloat(string(a), 64)
		fb, errB := strconv.ParseFloat(string(b), 64)
		return errA == nil && errB == nil && fa == fb
	case map[string]any:
		b, ok := b.(map[string]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for k, va := range a {
			vb, ok := b[k]
			if !ok || !sameTree(va, vb) {
				return false
			}
		}
		return true
	case []any:
		b, ok := b.([]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for i := range a {
			if !sameTree(a[i], b[i]) {
				return false
			}
		}
		return true
	default:
		return a == b
	}
}

// FuzzDecode checks that Decode never panics, fails only with well-formed
// *DecodeErrors, accepts only what encoding/json accepts and decodes it to
// the same tree, and that every accepted document canonicalizes, the
// canonical form decodes again to an equal tree, and Canonical is
// idempotent.
func FuzzDecode(f *testing.F) {
	for _, tc := range decodeCases {
		if len(tc.in) <= maxSeed {
			f.Add([]byte(tc.in), uint8(tc.lim.MaxDepth))
		}
	}
	for _, tc := range envelopeCases {
		if len(tc.in) <= maxSeed {
			f.Add([]byte(tc.in), uint8(tc.lim.MaxDepth))
		}
	}
	f.Fuzz(func(t *testing.T, data []byte, depth uint8) {
		lim := Limits{MaxDepth: int(depth)}
		tree, err := Decode(data, lim)
		if again, err2 := Decode(data, lim); !reflect.DeepEqual(err, err2) || !reflect.DeepEqual(tree, again) {
			t.Fatalf("Decode is not deterministic: %v then %v", err, err2)
		}
		if err != nil {
			checkDecodeError(t, err)
			return
		}

		// Differential: what we accept, encoding/json accepts as the same tree.
		if !json.Valid(data) {
			t.Fatalf("Decode accepted %q, which encoding/json rejects", data)
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.UseNumber()
		var std any
		if err := dec.Decode(&std); err != nil || !reflect.DeepEqual(std, tree) {
			t.Fatalf("encoding/json decodes %q to %#v (%v); Decode to %#v", data, std, err, tree)
		}

		c1, err := Canonical(tree)
		if err != nil {
			t.Fatalf("Canonical(Decode(%q)) = %v; want every accepted document to canonicalize", data, err)
		}
		tree2, err := Decode(c1, Limits{MaxBytes: 1 << 30, MaxDepth: lim.MaxDepth})
		if err != nil {
			t.Fatalf("Decode(Canonical) of %q = %v; want the canonical form accepted", c1, err)
		}
		if !sameTree(tree, tree2) {
			t.Fatalf("canonical round trip changed the tree:\n%#v\n%#v", tree, tree2)
		}
		c2, err := Canonical(tree2)
		if err != nil || !bytes.Equal(c1, c2) {
			t.Fatalf("Canonical is not idempotent:\n%s\n%s (%v)", c1, c2, err)
		}
	})
}

// FuzzDecodeEnvelope checks that DecodeEnvelope never panics and fails only
// with well-formed *DecodeErrors, and that an accepted envelope is hashable,
// survives re-encoding unchanged, and yields the same key via LenientKey.
func FuzzDecodeEnvelope(f *testing.F) {
	for _, tc := range envelopeCases {
		if len(tc.in) <= maxSeed {
			f.Add([]byte(tc.in))
		}
	}
	for _, tc := range decodeCases {
		if len(tc.in) <= maxSeed {
			f.Add([]byte(tc.in))
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		env, err := DecodeEnvelope(data, Limits{})
		if err != nil {
			checkDecodeError(t, err)
			if env != nil {
				t.Fatalf("DecodeEnvelope returned an envelope and an error")
			}
			return
		}
		if _, err := ArgumentsHash(env.Scope.TenantID, env.Tool, env.ToolVersion, env.Arguments); err != nil {
			t.Fatalf("ArgumentsHash of an accepted envelope = %v", err)
		}
		if _, err := ParseCallKey(env.Key().String()); err != nil {
			t.Fatalf("accepted envelope's key %q does not parse: %v", env.Key(), err)
		}
		key, callID, ok := LenientKey(data)
		if !ok || key != env.Key() || callID != env.CallID {
			t.Fatalf("LenientKey = %v, %q, %v; DecodeEnvelope says %v, %q", key, callID, ok, env.Key(), env.CallID)
		}
		b, err := json.Marshal(env)
		if err != nil {
			t.Fatalf("json.Marshal(envelope) = %v", err)
		}
		env2, err := DecodeEnvelope(b, Limits{MaxBytes: 1 << 30})
		if err != nil {
			t.Fatalf("re-decoding %s = %v", b, err)
		}
		if reflect.DeepEqual(env, env2) {
			return
		}
		if diff := cmp.Diff(env, env2); diff != "" {
			t.Fatalf("envelope changed through re-encoding (-first +second):\n%s", diff)
		}
	})
}
