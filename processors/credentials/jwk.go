package credentials

// This file holds the JWK forms of the Ed25519 keys (RFC 8037): the
// published set (RFC 7517) and the key id, the key's RFC 7638 thumbprint.
// Like jws.go it is kept apart so that ledger/token can replace it.

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
)

// maxJWKSBytes bounds a fetched key set.
const maxJWKSBytes = 1 << 20

// jwk is one public key in a published set.
type jwk struct {
	Kty string `json:"kty"`
	Crv string `json:"crv"`
	X   string `json:"x"`
	Kid string `json:"kid,omitempty"`
	Use string `json:"use,omitempty"`
	Alg string `json:"alg,omitempty"`
}

// jwkSet is the JSON of GET /.well-known/jwks.json.
type jwkSet struct {
	Keys []jwk `json:"keys"`
}

// thumbprint returns the RFC 7638 thumbprint of pub: base64url of the
// sha256 of its required members in lexical order. It is the kid, so a key
// id says which key it is and cannot be chosen.
func thumbprint(pub ed25519.PublicKey) string {
	// The members are fixed strings and base64url, so no JSON escaping is
	// needed to make this the canonical form.
	sum := sha256.Sum256([]byte(`{"crv":"Ed25519","kty":"OKP","x":"` + b64.EncodeToString(pub) + `"}`))
	return b64.EncodeToString(sum[:])
}

// publicJWK returns pub as a JWK.
func publicJWK(kid string, pub ed25519.PublicKey) jwk {
	return jwk{Kty: "OKP", Crv: "Ed25519", X: b64.EncodeToString(pub), Kid: kid, Use: "sig", Alg: AlgEdDSA}
}

// parseJWKS returns the Ed25519 signing keys of a published set by kid.
// Keys of other types or uses are skipped (a set may serve other
// purposes); a set with no usable key, a malformed Ed25519 key or two
// keys under one kid is an error, since there is then no safe reading.
func parseJWKS(b []byte) (map[string]ed25519.PublicKey, error) {
	if len(b) > maxJWKSBytes {
		return nil, fmt.Errorf("key set larger than %d bytes", maxJWKSBytes)
	}
	var set jwkSet
	if err := json.Unmarshal(b, &set); err != nil {
		return nil, errors.New("key set is not a JSON JWK set")
	}
	keys := make(map[string]ed25519.PublicKey, len(set.Keys))
	for i, k := range set.Keys {
		if k.Kty != "OKP" || k.Crv != "Ed25519" || (k.Use != "" && k.Use != "sig") || (k.Alg != "" && k.Alg != AlgEdDSA) {
			continue
		}
		x, err := b64.DecodeString(k.X)
		if err != nil || len(x) != ed25519.PublicKeySize {
			return nil, fmt.Errorf("key %d (kid %q): x is not an Ed25519 public key", i, k.Kid)
		}
		if k.Kid == "" {
			return nil, fmt.Errorf("key %d has no kid", i)
		}
		if _, dup := keys[k.Kid]; dup {
			return nil, fmt.Errorf("kid %q appears twice", k.Kid)
		}
		keys[k.Kid] = ed25519.PublicKey(x)
	}
	if len(keys) == 0 {
		return nil, errors.New("key set has no Ed25519 signing key")
	}
	return keys, nil
}
