package token

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"strings"
	"testing"
)

// fuzzKeys returns keys that are the same in every fuzz worker process, so
// that a token signed in one verifies in another: Ed25519 and P-256 from
// fixed seeds, plus a per-process RSA key (its tokens verify only where
// they were made, which weakens no invariant below).
func fuzzKeys(t testing.TB) []Key {
	t.Helper()
	seed := bytes.Repeat([]byte{7}, ed25519.SeedSize)
	edPriv := ed25519.NewKeyFromSeed(seed)
	ed, err := newSigningKey("ed", AlgEdDSA, edPriv.Public(), edPriv)
	if err != nil {
		t.Fatal(err)
	}
	esPriv, err := ecdsa.ParseRawPrivateKey(elliptic.P256(), bytes.Repeat([]byte{9}, 32))
	if err != nil {
		t.Fatal(err)
	}
	es, err := newSigningKey("es", AlgES256, &esPriv.PublicKey, esPriv)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := GenerateRS256("rs")
	if err != nil {
		t.Fatal(err)
	}
	return []Key{ed, es, rs}
}

// knownReasons are the reasons Verify may return.
func knownReasons() []string {
	return []string{ReasonTokenTooLarge, ReasonMalformedToken, ReasonAlgNotAllowed, ReasonTypMismatch,
		ReasonForbiddenHeader, ReasonMissingKID, ReasonUnknownKID, ReasonBadSignature, ReasonMalformedClaims}
}

// FuzzVerify checks that Verify never panics, refuses with a known reason
// and an *Error that quotes nothing of the input, and never accepts a token
// whose signing input was not produced by Sign with a key of the set.
func FuzzVerify(f *testing.F) {
	keys := fuzzKeys(f)
	set, err := NewKeySet(keys...)
	if err != nil {
		f.Fatal(err)
	}
	// The signing inputs Sign produced here; the payloads are fixed, so
	// ES256's random signatures still sign the same inputs in every worker.
	signed := make(map[string]bool)
	claims := []any{
		Claims{Issuer: "https://idp.example", Subject: "u_88", Audience: Audience{"toolcall-ledger"}, ID: "j"},
		map[string]any{"sub": "s", "act": map[string]string{"sub": "agent"}, "tenant": "t_acme"},
	}
	for _, k := range keys {
		for _, c := range claims {
			for _, typ := range []string{"", "agent-assertion+jwt"} {
				tok, err := Sign(k, typ, c)
				if err != nil {
					f.Fatal(err)
				}
				signed[tok[:strings.LastIndexByte(tok, '.')]] = true
				f.Add(tok)
				h, p, s := splitToken(tok)
				f.Add(h + "." + p + "." + s[:len(s)/2])
				f.Add(b64([]byte(`{"alg":"none","typ":"JWT","kid":"`+k.ID+`"}`)) + "." + p + ".")
				f.Add(b64([]byte(`{"alg":"HS256","typ":"JWT","kid":"`+k.ID+`"}`)) + "." + p + "." + s)
				f.Add(b64([]byte(`{"alg":"`+k.Alg+`","typ":"JWT","kid":"`+k.ID+`","jku":"x"}`)) + "." + p + "." + s)
			}
		}
	}
	f.Add("")
	f.Add("..")
	f.Add("a.b.c")
	f.Fuzz(func(t *testing.T, tok string) {
		for _, typ := range []string{"", "agent-assertion+jwt"} {
			var got map[string]any
			h, err := Verify(tok, VerifyOptions{Keys: set, Type: typ}, &got)
			if err == nil {
				input := tok[:strings.LastIndexByte(tok, '.')]
				if !signed[input] {
					t.Fatalf("Verify accepted a token whose signing input Sign never produced: %q", tok)
				}
				if k, ok := set.Lookup(h.Kid); !ok || k.Alg != h.Alg {
					t.Fatalf("Verify accepted header %+v that does not match a key of the set", h)
				}
				continue
			}
			var reason string
			e, ok := err.(*Error)
			if ok {
				reason = e.Reason
			}
			known := false
			for _, r := range knownReasons() {
				known = known || r == reason
			}
			if !known {
				t.Fatalf("Verify() error %v (%T): not an *Error with a known reason", err, err)
			}
			if len(tok) >= 16 && strings.Contains(e.Detail, tok) {
				t.Fatalf("Verify() error detail %q quotes the token", e.Detail)
			}
		}
	})
}
