// Package token signs and verifies compact JWS tokens (JWTs) with the
// standard library's crypto only: EdDSA (Ed25519), ES256 (ECDSA P-256 with
// SHA-256) and RS256 (RSASSA-PKCS1-v1_5 with SHA-256).
//
// It is deliberately small and closed, following RFC 8725 (JWT best current
// practices): the verifier takes its keys only from a configured KeySet,
// never from the token; the algorithm is pinned by the key, not chosen by
// the token; "none" and HMAC algorithms cannot be enabled; headers that name
// a key by URL or carry one (jku, x5u, jwk, x5c) and critical extensions are
// refused; and the signature is checked before the payload is parsed.
//
// Private key material never leaves this package in printable form: Key
// formats, logs and marshals as its key id and algorithm only, and no error
// carries key or token bytes.
//
// Files: key.go (Key, generation, safe formatting), jwk.go (JWK and JWKS
// encoding, KeySet), jws.go (Sign, Verify, Error), claims.go (registered
// claims and their validation).
package token

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"fmt"
	"log/slog"
)

// The signature algorithms this package implements (RFC 7518 and RFC 8037
// names).
const (
	// AlgEdDSA is Ed25519 (RFC 8037).
	AlgEdDSA = "EdDSA"
	// AlgES256 is ECDSA on P-256 with SHA-256, signature r||s (RFC 7518 §3.4).
	AlgES256 = "ES256"
	// AlgRS256 is RSASSA-PKCS1-v1_5 with SHA-256 (RFC 7518 §3.3).
	AlgRS256 = "RS256"
	// algEd25519 is RFC 9864's name for EdDSA over Ed25519, read as
	// AlgEdDSA in key sets and token headers.
	algEd25519 = "Ed25519"
)

// RSA modulus bounds. Below 2048 bits is weak (RFC 7518 §3.3 requires it);
// above 8192 only makes verification expensive for whoever controls the
// key set.
const (
	minRSABits = 2048
	maxRSABits = 8192
)

// Key is a signing or verification key with its key id and algorithm.
//
// A Key made by a Generate function or ParsePrivateJWK can sign; Public
// returns a verify-only copy. Its private half is unexported and every
// formatting path (String, GoString, Format for all verbs, slog's LogValue)
// prints only the key id and the algorithm, so a Key can be logged or
// wrapped in an error without leaking it. Even when a Key sits in an
// unexported field of another struct, which fmt prints by reflection, the
// private half is behind a pointer and prints as an address.
type Key struct {
	// ID is the key id ("kid"), unique within a KeySet.
	ID string
	// Alg is the one algorithm this key is used with: AlgEdDSA, AlgES256 or
	// AlgRS256. A token whose header names another algorithm is refused
	// even when the key type could verify it.
	Alg string
	// PublicKey is ed25519.PublicKey, *ecdsa.PublicKey (P-256) or
	// *rsa.PublicKey, matching Alg.
	PublicKey crypto.PublicKey

	private *privateKey
}

// privateKey holds the private half behind a pointer: fmt prints a pointer
// nested in a struct as an address, never its contents.
type privateKey struct {
	signer crypto.Signer
}

// GenerateEd25519 returns a new EdDSA signing key with key id kid.
func GenerateEd25519(kid string) (Key, error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return Key{}, fmt.Errorf("token: generate ed25519 key: %v", err)
	}
	return newSigningKey(kid, AlgEdDSA, pub, priv)
}

// GenerateES256 returns a new ES256 (P-256) signing key with key id kid.
func GenerateES256(kid string) (Key, error) {
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Key{}, fmt.Errorf("token: generate p-256 key: %v", err)
	}
	return newSigningKey(kid, AlgES256, &priv.PublicKey, priv)
}

// GenerateRS256 returns a new 2048-bit RS256 signing key with key id kid.
func GenerateRS256(kid string) (Key, error) {
	priv, err := rsa.GenerateKey(rand.Reader, minRSABits)
	if err != nil {
		return Key{}, fmt.Errorf("token: generate rsa key: %v", err)
	}
	return newSigningKey(kid, AlgRS256, &priv.PublicKey, priv)
}

func newSigningKey(kid, alg string, pub crypto.PublicKey, priv crypto.Signer) (Key, error) {
	k := Key{ID: kid, Alg: alg, PublicKey: pub, private: &privateKey{signer: priv}}
	if err := k.check(); err != nil {
		return Key{}, err
	}
	return k, nil
}

// Public returns a verify-only copy of k.
func (k Key) Public() Key {
	k.private = nil
	return k
}

// CanSign reports whether k holds a private key.
func (k Key) CanSign() bool { return k.private != nil && k.private.signer != nil }

// String returns the key id and algorithm, never key material.
func (k Key) String() string {
	kind := "public"
	if k.CanSign() {
		kind = "private"
	}
	return fmt.Sprintf("token.Key{ID:%q Alg:%q %s}", k.ID, k.Alg, kind)
}

// GoString is String, so that %#v is as safe as %v.
func (k Key) GoString() string { return k.String() }

// Format implements fmt.Formatter so that every verb (%v, %+v, %#v, %s, %x,
// %q...) prints String and nothing else.
func (k Key) Format(f fmt.State, verb rune) {
	s := k.String()
	if verb == 'q' {
		s = fmt.Sprintf("%q", s)
	}
	_, _ = f.Write([]byte(s))
}

// LogValue implements slog.LogValuer: a logged Key is its id and algorithm.
func (k Key) LogValue() slog.Value {
	return slog.GroupValue(slog.String("kid", k.ID), slog.String("alg", k.Alg), slog.Bool("private", k.CanSign()))
}

// check reports whether k is usable: a non-empty kid, a supported
// algorithm, a public key of the type the algorithm needs (P-256 for
// ES256, 2048 to 8192 bits for RS256), and a private key, if any, of the
// same type. It is what pins an algorithm to a key.
func (k Key) check() error {
	if k.ID == "" {
		return fmt.Errorf("token: key without kid")
	}
	switch k.Alg {
	case AlgEdDSA:
		pub, ok := k.PublicKey.(ed25519.PublicKey)
		if !ok || len(pub) != ed25519.PublicKeySize {
			return fmt.Errorf("token: key %q: alg %s needs an ed25519 public key", k.ID, k.Alg)
		}
	case AlgES256:
		pub, ok := k.PublicKey.(*ecdsa.PublicKey)
		if !ok || pub == nil || pub.Curve != elliptic.P256() {
			return fmt.Errorf("token: key %q: alg %s needs a p-256 public key", k.ID, k.Alg)
		}
	case AlgRS256:
		pub, ok := k.PublicKey.(*rsa.PublicKey)
		if !ok || pub == nil || pub.N == nil {
			return fmt.Errorf("token: key %q: alg %s needs an rsa public key", k.ID, k.Alg)
		}
		if bits := pub.N.BitLen(); bits < minRSABits || bits > maxRSABits {
			return fmt.Errorf("token: key %q: rsa modulus of %d bits, want %d to %d", k.ID, bits, minRSABits, maxRSABits)
		}
		if pub.E < 3 || pub.E%2 == 0 {
			return fmt.Errorf("token: key %q: invalid rsa public exponent", k.ID)
		}
	default:
		return fmt.Errorf("token: key %q: unsupported alg", k.ID)
	}
	if !k.CanSign() {
		return nil
	}
	var ok bool
	switch s := k.private.signer.(type) {
	case ed25519.PrivateKey:
		ok = k.Alg == AlgEdDSA && s.Public().(ed25519.PublicKey).Equal(k.PublicKey)
	case *ecdsa.PrivateKey:
		ok = k.Alg == AlgES256 && s.PublicKey.Equal(k.PublicKey)
	case *rsa.PrivateKey:
		ok = k.Alg == AlgRS256 && s.PublicKey.Equal(k.PublicKey)
	}
	if !ok {
		return fmt.Errorf("token: key %q: private key does not match alg and public key", k.ID)
	}
	return nil
}
