package token

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestJWKSRoundTrip(t *testing.T) {
	t.Parallel()
	keys := newTestKeys(t)
	data := keys.set.JWKS()
	got, err := ParseJWKS(data)
	if err != nil {
		t.Fatalf("ParseJWKS(JWKS()) error = %v", err)
	}
	if diff := cmp.Diff(keys.set.IDs(), got.IDs()); diff != "" {
		t.Errorf("ParseJWKS(JWKS()) kids (-want +got):\n%s", diff)
	}
	for _, k := range []Key{keys.ed, keys.es, keys.rs} {
		g, ok := got.Lookup(k.ID)
		if !ok {
			t.Fatalf("Lookup(%q) missing after round trip", k.ID)
		}
		if g.Alg != k.Alg || g.CanSign() {
			t.Errorf("Lookup(%q) = alg %s, can sign %v; want %s, false", k.ID, g.Alg, g.CanSign(), k.Alg)
		}
		if !g.PublicKey.(interface{ Equal(crypto.PublicKey) bool }).Equal(k.PublicKey) {
			t.Errorf("Lookup(%q) public key differs after round trip", k.ID)
		}
		// A token signed by the original verifies against the parsed set.
		tok, err := Sign(k, "", validClaims())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Verify(tok, VerifyOptions{Keys: got}, nil); err != nil {
			t.Errorf("Verify(%s token, parsed JWKS) = %v; want nil", k.Alg, err)
		}
	}
	if !bytes.Equal(got.JWKS(), data) {
		t.Errorf("JWKS() not stable across a round trip:\n%s\n%s", got.JWKS(), data)
	}
	var doc struct {
		Keys []map[string]any `json:"keys"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	for _, k := range doc.Keys {
		if k["use"] != "sig" || k["alg"] == nil || k["kid"] == nil || k["d"] != nil {
			t.Errorf("JWKS() key %v: want use=sig, alg, kid and no d", k)
		}
	}
}

func TestNewKeySet(t *testing.T) {
	t.Parallel()
	a, b := mustKey(t), mustKey(t)
	if _, err := NewKeySet(a, b); err == nil {
		t.Error("NewKeySet(duplicate kid) error = nil; want an error")
	}
	s, err := NewKeySet(a)
	if err != nil {
		t.Fatal(err)
	}
	if k, _ := s.Lookup(a.ID); k.CanSign() {
		t.Error("KeySet kept a private key; want public halves only")
	}
	if s.Len() != 1 || (*KeySet)(nil).Len() != 0 {
		t.Errorf("Len() = %d, nil Len() = %d; want 1, 0", s.Len(), (*KeySet)(nil).Len())
	}
	weak, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewKeySet(Key{ID: "weak", Alg: AlgRS256, PublicKey: &weak.PublicKey}); err == nil {
		t.Error("NewKeySet(1024-bit RSA) error = nil; want an error")
	}
	if _, err := NewKeySet(Key{ID: "x", Alg: AlgES256, PublicKey: a.PublicKey}); err == nil {
		t.Error("NewKeySet(ES256 alg on an Ed25519 key) error = nil; want an error")
	}
	if _, err := NewKeySet(Key{ID: "x", Alg: "HS256", PublicKey: []byte("secret")}); err == nil {
		t.Error("NewKeySet(HS256) error = nil; want an error")
	}
}

// jwkWith returns the public JWK of k as a map, edited.
func jwkWith(t *testing.T, k Key, edit func(map[string]any)) map[string]any {
	t.Helper()
	j, err := publicJWK(k)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(j)
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	if edit != nil {
		edit(m)
	}
	return m
}

func jwksOf(t *testing.T, keys ...any) []byte {
	t.Helper()
	b, err := json.Marshal(map[string]any{"keys": keys})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestParseJWKS(t *testing.T) {
	t.Parallel()
	keys := newTestKeys(t)
	weak, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	weakKey := Key{ID: "weak", Alg: AlgRS256, PublicKey: &weak.PublicKey}
	weakJWK, err := publicJWK(weakKey)
	if err != nil {
		t.Fatal(err)
	}
	ed := func(edit func(map[string]any)) map[string]any { return jwkWith(t, keys.ed, edit) }
	rs := func(edit func(map[string]any)) map[string]any { return jwkWith(t, keys.rs, edit) }
	es := func(edit func(map[string]any)) map[string]any { return jwkWith(t, keys.es, edit) }

	tests := []struct {
		name    string
		data    []byte
		wantIDs []string // nil with wantErr
		wantErr bool
	}{
		{"all three", jwksOf(t, ed(nil), es(nil), rs(nil)), []string{"ed", "es", "rs"}, false},
		{"no alg member", jwksOf(t, ed(func(m map[string]any) { delete(m, "alg") }), rs(func(m map[string]any) { delete(m, "alg"); delete(m, "use") })), []string{"ed", "rs"}, false},
		{"Ed25519 alg name", jwksOf(t, ed(func(m map[string]any) { m["alg"] = "Ed25519" })), []string{"ed"}, false},
		{"key_ops verify", jwksOf(t, ed(func(m map[string]any) { delete(m, "use"); m["key_ops"] = []string{"verify"} })), []string{"ed"}, false},
		{"skip use enc", jwksOf(t, ed(nil), rs(func(m map[string]any) { m["use"] = "enc"; m["alg"] = "RSA-OAEP" })), []string{"ed"}, false},
		{"skip key_ops without verify", jwksOf(t, ed(func(m map[string]any) { delete(m, "use"); m["key_ops"] = []string{"encrypt"} })), []string{}, false},
		{"skip PS256", jwksOf(t, rs(func(m map[string]any) { m["alg"] = "PS256" })), []string{}, false},
		{"skip P-384", jwksOf(t, es(func(m map[string]any) { m["crv"] = "P-384"; m["alg"] = "ES384" })), []string{}, false},
		{"skip unknown kty", jwksOf(t, map[string]any{"kty": "PQ", "kid": "pq"}, ed(nil)), []string{"ed"}, false},
		{"empty set", []byte(`{"keys":[]}`), []string{}, false},
		{"oct key", jwksOf(t, map[string]any{"kty": "oct", "kid": "h", "k": "c2VjcmV0", "alg": "HS256"}), nil, true},
		{"oct key marked enc", jwksOf(t, map[string]any{"kty": "oct", "kid": "h", "k": "c2VjcmV0", "use": "enc"}), nil, true},
		{"RSA labelled ES256", jwksOf(t, rs(func(m map[string]any) { m["alg"] = "ES256" })), nil, true},
		{"RSA labelled HS256", jwksOf(t, rs(func(m map[string]any) { m["alg"] = "HS256" })), nil, true},
		{"OKP labelled RS256", jwksOf(t, ed(func(m map[string]any) { m["alg"] = "RS256" })), nil, true},
		{"EC labelled EdDSA", jwksOf(t, es(func(m map[string]any) { m["alg"] = "EdDSA" })), nil, true},
		{"alg none", jwksOf(t, ed(func(m map[string]any) { m["alg"] = "none" })), nil, true},
		{"missing kid", jwksOf(t, ed(func(m map[string]any) { delete(m, "kid") })), nil, true},
		{"duplicate kid", jwksOf(t, ed(nil), es(func(m map[string]any) { m["kid"] = "ed" })), nil, true},
		{"1024-bit RSA", jwksOf(t, weakJWK), nil, true},
		{"private member", jwksOf(t, ed(func(m map[string]any) { m["d"] = "AAAA" })), nil, true},
		{"short x", jwksOf(t, ed(func(m map[string]any) { m["x"] = "AAAA" })), nil, true},
		{"padded x", jwksOf(t, ed(func(m map[string]any) { m["x"] = m["x"].(string) + "=" })), nil, true},
		{"EC point off the curve", jwksOf(t, es(func(m map[string]any) { m["y"] = m["x"] })), nil, true},
		{"non-string member", jwksOf(t, ed(func(m map[string]any) { m["kid"] = 7 })), nil, true},
		{"case-variant member", []byte(`{"keys":[{"kty":"OKP","KTY":"oct","crv":"Ed25519","kid":"a","x":"` + ed(nil)["x"].(string) + `"}]}`), nil, true},
		{"duplicate member", []byte(`{"keys":[{"kty":"OKP","kty":"oct","crv":"Ed25519","kid":"a","x":"` + ed(nil)["x"].(string) + `"}]}`), nil, true},
		{"no keys array", []byte(`{"keys":{}}`), nil, true},
		{"not json", []byte(`keys`), nil, true},
		{"too large", append(append([]byte(`{"keys":[],"pad":"`), bytes.Repeat([]byte("x"), MaxJWKSBytes)...), `"}`...), nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParseJWKS(tc.data)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("ParseJWKS() = %v; want an error", got)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseJWKS() error = %v", err)
			}
			if diff := cmp.Diff(tc.wantIDs, got.IDs()); diff != "" {
				t.Errorf("ParseJWKS() kids (-want +got):\n%s", diff)
			}
		})
	}
}

func TestPrivateJWKRoundTrip(t *testing.T) {
	t.Parallel()
	keys := newTestKeys(t)
	for _, k := range []Key{keys.ed, keys.es, keys.rs} {
		t.Run(k.Alg, func(t *testing.T) {
			t.Parallel()
			data, err := MarshalPrivateJWK(k)
			if err != nil {
				t.Fatalf("MarshalPrivateJWK() error = %v", err)
			}
			got, err := ParsePrivateJWK(data)
			if err != nil {
				t.Fatalf("ParsePrivateJWK() error = %v", err)
			}
			if got.ID != k.ID || got.Alg != k.Alg || !got.CanSign() {
				t.Errorf("ParsePrivateJWK() = %v; want a signing %v", got, k)
			}
			tok, err := Sign(got, "", validClaims())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := verifyAndValidate(tok, VerifyOptions{Keys: keys.set}); err != nil {
				t.Errorf("token from the parsed key: Verify() = %v; want nil", err)
			}
			if _, err := MarshalPrivateJWK(k.Public()); err == nil {
				t.Error("MarshalPrivateJWK(public key) error = nil; want an error")
			}
			pub := keys.set.JWKS()
			if _, err := ParsePrivateJWK(pub); err == nil {
				t.Error("ParsePrivateJWK(a JWKS) error = nil; want an error")
			}
		})
	}
}

// privateValues returns every encoding of k's private material that a leak
// could take: base64url and hex of "d" (and of the RSA primes and CRT
// values), and the decimal form of the RSA private exponent.
func privateValues(t *testing.T, k Key) []string {
	t.Helper()
	data, err := MarshalPrivateJWK(k)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]string
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, name := range []string{"d", "p", "q", "dp", "dq", "qi"} {
		if v := m[name]; v != "" {
			raw, _ := unb64(v)
			out = append(out, v, hex.EncodeToString(raw)[:32], fmt.Sprintf("%v", raw[:8]))
		}
	}
	switch s := k.private.signer.(type) {
	case *rsa.PrivateKey:
		out = append(out, s.D.String()[:40])
	case *ecdsa.PrivateKey:
		out = append(out, s.D.String()[:40])
	case ed25519.PrivateKey:
		out = append(out, hex.EncodeToString(s[:16]))
	}
	return out
}

// TestKeyFormatNeverLeaks is the canary test: however a signing Key is
// printed, logged, marshalled or wrapped, its private material is absent.
func TestKeyFormatNeverLeaks(t *testing.T) {
	t.Parallel()
	keys := newTestKeys(t)
	for _, k := range []Key{keys.ed, keys.es, keys.rs} {
		t.Run(k.Alg, func(t *testing.T) {
			t.Parallel()
			secrets := privateValues(t, k)
			type holder struct {
				key   Key
				Key   Key
				ptr   *Key
				inner struct{ k Key }
			}
			h := holder{key: k, Key: k, ptr: &k}
			h.inner.k = k
			var outputs []string
			for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%X", "%d", "%T"} {
				outputs = append(outputs, fmt.Sprintf(verb, k), fmt.Sprintf(verb, &k), fmt.Sprintf(verb, h), fmt.Sprintf(verb, &h), fmt.Sprintf(verb, []Key{k}))
			}
			outputs = append(outputs, k.String(), k.GoString(), fmt.Sprint(k), fmt.Sprintln(k), fmt.Errorf("wrap %v: %w", k, &Error{Reason: "x", Detail: k.String()}).Error())
			var logs bytes.Buffer
			for _, lg := range []*slog.Logger{slog.New(slog.NewJSONHandler(&logs, nil)), slog.New(slog.NewTextHandler(&logs, nil))} {
				lg.Info("key", "key", k, "ptr", &k, "holder", h)
			}
			outputs = append(outputs, logs.String())
			if b, err := json.Marshal(k); err == nil {
				outputs = append(outputs, string(b))
			}
			if b, err := json.Marshal(h); err == nil {
				outputs = append(outputs, string(b))
			}
			if !strings.Contains(fmt.Sprintf("%+v", k), k.ID) {
				t.Errorf("%%+v of a key = %q; want its kid", fmt.Sprintf("%+v", k))
			}
			for _, out := range outputs {
				for _, s := range secrets {
					if strings.Contains(out, s) {
						t.Fatalf("private material %q leaked in %q", s, out)
					}
				}
			}
		})
	}
}

// TestParsePrivateJWKErrorsNeverQuote feeds broken key files that contain a
// real private value and checks the errors do not repeat it.
func TestParsePrivateJWKErrorsNeverQuote(t *testing.T) {
	t.Parallel()
	k := mustKey(t)
	data, err := MarshalPrivateJWK(k)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]string
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	d := m["d"]
	other := mustKey(t)
	otherData, _ := MarshalPrivateJWK(other)
	var om map[string]string
	_ = json.Unmarshal(otherData, &om)

	broken := map[string]string{
		"truncated":         string(data[:len(data)-2]),
		"bad char in d":     strings.Replace(string(data), d, d[:10]+"\x01"+d[10:], 1),
		"d not base64":      strings.Replace(string(data), d, d[:10]+"+"+d[11:], 1),
		"d too short":       strings.Replace(string(data), d, d[:20], 1),
		"d of another key":  strings.Replace(string(data), d, om["d"], 1),
		"d a number":        strings.Replace(string(data), `"`+d+`"`, "12345", 1),
		"duplicate d":       strings.Replace(string(data), `"d":`, `"d":"`+d+`","d":`, 1),
		"unknown kty":       strings.Replace(string(data), `"OKP"`, `"XYZ"`, 1),
		"trailing garbage":  string(data) + d,
		"no kid":            strings.Replace(string(data), `"kid":"scratch",`, ``, 1),
		"alg of other type": strings.Replace(string(data), `"EdDSA"`, `"RS256"`, 1),
	}
	for name, doc := range broken {
		t.Run(name, func(t *testing.T) {
			_, err := ParsePrivateJWK([]byte(doc))
			if err == nil {
				t.Fatal("ParsePrivateJWK() error = nil; want an error")
			}
			for _, s := range []string{d, d[:12], d[10:22], om["d"]} {
				if strings.Contains(err.Error(), s) {
					t.Errorf("ParsePrivateJWK() error %q contains private material", err)
				}
			}
		})
	}
}

func TestThumbprint(t *testing.T) {
	t.Parallel()
	// RFC 7638 §3.1's example key and thumbprint.
	const n = "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw"
	j := jwk{Kty: "RSA", Kid: "2011-04-29", N: n, E: "AQAB"}
	pub, err := j.publicKey(AlgRS256)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Key{ID: j.Kid, Alg: AlgRS256, PublicKey: pub}.Thumbprint()
	if err != nil {
		t.Fatal(err)
	}
	if want := "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs"; got != want {
		t.Errorf("Thumbprint() = %q; want %q", got, want)
	}
}
