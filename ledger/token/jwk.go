package token

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strings"

	"github.com/toolcall-ledger/ledger/ledger"
)

// MaxJWKSBytes is the largest JWKS document ParseJWKS accepts.
const MaxJWKSBytes = 1 << 20

// maxJWKBytes bounds one private JWK document (a 8192-bit RSA key with its
// CRT values is about 6 KiB).
const maxJWKBytes = 64 << 10

// jwk is the JSON form of one key. Field order is the output order.
type jwk struct {
	Kty string `json:"kty"`
	Kid string `json:"kid,omitempty"`
	Use string `json:"use,omitempty"`
	Alg string `json:"alg,omitempty"`
	Crv string `json:"crv,omitempty"`
	X   string `json:"x,omitempty"`
	Y   string `json:"y,omitempty"`
	N   string `json:"n,omitempty"`
	E   string `json:"e,omitempty"`
	D   string `json:"d,omitempty"`
	P   string `json:"p,omitempty"`
	Q   string `json:"q,omitempty"`
	DP  string `json:"dp,omitempty"`
	DQ  string `json:"dq,omitempty"`
	QI  string `json:"qi,omitempty"`
}

// publicJWK returns the public JWK of k, with kid, alg and use=sig.
func publicJWK(k Key) (jwk, error) {
	j := jwk{Kid: k.ID, Use: "sig", Alg: k.Alg}
	switch pub := k.PublicKey.(type) {
	case ed25519.PublicKey:
		j.Kty, j.Crv, j.X = "OKP", "Ed25519", b64(pub)
	case *ecdsa.PublicKey:
		raw, err := pub.Bytes()
		if err != nil || len(raw) != 65 {
			return jwk{}, fmt.Errorf("token: key %q: encode p-256 public key", k.ID)
		}
		j.Kty, j.Crv, j.X, j.Y = "EC", "P-256", b64(raw[1:33]), b64(raw[33:])
	case *rsa.PublicKey:
		j.Kty, j.N, j.E = "RSA", b64(pub.N.Bytes()), b64(big.NewInt(int64(pub.E)).Bytes())
	default:
		return jwk{}, fmt.Errorf("token: key %q: unsupported public key type", k.ID)
	}
	return j, nil
}

// MarshalPrivateJWK returns k as a private JWK (with "d"), for a key file.
// The result is a secret: store it with restrictive permissions and never
// log it.
func MarshalPrivateJWK(k Key) ([]byte, error) {
	if err := k.check(); err != nil {
		return nil, err
	}
	if !k.CanSign() {
		return nil, fmt.Errorf("token: key %q has no private key", k.ID)
	}
	j, err := publicJWK(k)
	if err != nil {
		return nil, err
	}
	switch priv := k.private.signer.(type) {
	case ed25519.PrivateKey:
		j.D = b64(priv.Seed())
	case *ecdsa.PrivateKey:
		d, err := priv.Bytes()
		if err != nil {
			return nil, fmt.Errorf("token: key %q: encode p-256 private key", k.ID)
		}
		j.D = b64(d)
	case *rsa.PrivateKey:
		if len(priv.Primes) != 2 {
			return nil, fmt.Errorf("token: key %q: multi-prime rsa keys are not supported", k.ID)
		}
		priv.Precompute()
		j.D = b64(priv.D.Bytes())
		j.P, j.Q = b64(priv.Primes[0].Bytes()), b64(priv.Primes[1].Bytes())
		j.DP, j.DQ, j.QI = b64(priv.Precomputed.Dp.Bytes()), b64(priv.Precomputed.Dq.Bytes()), b64(priv.Precomputed.Qinv.Bytes())
	}
	return json.Marshal(j)
}

// ParsePrivateJWK parses a private JWK (OKP Ed25519, EC P-256 or RSA, with
// "d" and a "kid") into a signing Key. Errors never quote the document.
func ParsePrivateJWK(data []byte) (Key, error) {
	m, err := decodeObject(data, ledger.Limits{MaxBytes: maxJWKBytes})
	if err != nil {
		// The decoder's detail may quote a character of the input, which
		// here is secret: keep only the code and the member name.
		var de *ledger.DecodeError
		if errors.As(err, &de) {
			return Key{}, fmt.Errorf("token: private jwk: %s at %q", de.Code, de.Pointer)
		}
		return Key{}, fmt.Errorf("token: private jwk: not a json object")
	}
	j, err := jwkFromMap(m)
	if err != nil {
		return Key{}, err
	}
	if j.D == "" {
		return Key{}, fmt.Errorf("token: private jwk %q: no \"d\" member", j.Kid)
	}
	alg, skip, err := j.algorithm()
	if err != nil {
		return Key{}, err
	}
	if skip != "" {
		return Key{}, fmt.Errorf("token: private jwk %q: %s", j.Kid, skip)
	}
	pub, err := j.publicKey(alg)
	if err != nil {
		return Key{}, err
	}
	d, err := unb64(j.D)
	if err != nil {
		return Key{}, fmt.Errorf("token: private jwk %q: member \"d\" is not base64url", j.Kid)
	}
	var signer crypto.Signer
	switch alg {
	case AlgEdDSA:
		if len(d) != ed25519.SeedSize {
			return Key{}, fmt.Errorf("token: private jwk %q: ed25519 \"d\" must be %d bytes", j.Kid, ed25519.SeedSize)
		}
		signer = ed25519.NewKeyFromSeed(d)
	case AlgES256:
		priv, err := ecdsa.ParseRawPrivateKey(elliptic.P256(), d)
		if err != nil {
			return Key{}, fmt.Errorf("token: private jwk %q: invalid p-256 private key", j.Kid)
		}
		signer = priv
	case AlgRS256:
		priv, err := j.rsaPrivateKey(pub.(*rsa.PublicKey), d)
		if err != nil {
			return Key{}, err
		}
		signer = priv
	}
	k := Key{ID: j.Kid, Alg: alg, PublicKey: pub, private: &privateKey{signer: signer}}
	if err := k.check(); err != nil {
		// check's message names the kid and what is wrong, never values.
		return Key{}, err
	}
	return k, nil
}

func (j jwk) rsaPrivateKey(pub *rsa.PublicKey, d []byte) (*rsa.PrivateKey, error) {
	if j.P == "" || j.Q == "" {
		return nil, fmt.Errorf("token: private jwk %q: rsa key needs \"p\" and \"q\"", j.Kid)
	}
	p, errP := unb64(j.P)
	q, errQ := unb64(j.Q)
	if errP != nil || errQ != nil {
		return nil, fmt.Errorf("token: private jwk %q: rsa primes are not base64url", j.Kid)
	}
	priv := &rsa.PrivateKey{
		PublicKey: *pub,
		D:         new(big.Int).SetBytes(d),
		Primes:    []*big.Int{new(big.Int).SetBytes(p), new(big.Int).SetBytes(q)},
	}
	// Validate checks p*q == n and the exponents; the CRT values are
	// recomputed rather than trusted from the file.
	if err := priv.Validate(); err != nil {
		return nil, fmt.Errorf("token: private jwk %q: inconsistent rsa private key", j.Kid)
	}
	priv.Precompute()
	return priv, nil
}

// KeySet is an immutable set of verification keys, looked up by key id. It
// holds public keys only: NewKeySet drops the private half of signing keys,
// so a KeySet can be served, logged and shared freely. A nil *KeySet is an
// empty set.
type KeySet struct {
	keys  map[string]Key
	order []string
}

// NewKeySet returns a set of the public halves of keys. Each key must be
// valid for its algorithm (see Key) and key ids must be unique.
func NewKeySet(keys ...Key) (*KeySet, error) {
	s := &KeySet{keys: make(map[string]Key, len(keys)), order: make([]string, 0, len(keys))}
	for _, k := range keys {
		if err := k.check(); err != nil {
			return nil, err
		}
		if _, dup := s.keys[k.ID]; dup {
			return nil, fmt.Errorf("token: duplicate kid %q", k.ID)
		}
		s.keys[k.ID] = k.Public()
		s.order = append(s.order, k.ID)
	}
	return s, nil
}

// ParseJWKS parses an RFC 7517 JWK Set of public keys. It accepts OKP
// Ed25519 (EdDSA), EC P-256 (ES256) and RSA of 2048 to 8192 bits (RS256).
//
// It skips, without error, keys it could never use to verify: "use" other
// than "sig", "key_ops" without "verify", other curves or key types, and
// RSA keys declared for another RSA algorithm (PS256, RS512...). It refuses
// the whole set for: symmetric ("oct") keys, a JWK whose "alg" disagrees
// with its key type (an RSA key labelled ES256 or HS256), a missing or
// duplicate "kid", private members ("d" and the like: a JWKS is public, so
// a private key in it is a leak to stop, not to use), malformed members, a
// weak RSA key, or a document over MaxJWKSBytes. An empty result is not an
// error here; callers that need a key check Len.
func ParseJWKS(data []byte) (*KeySet, error) {
	m, err := decodeObject(data, ledger.Limits{MaxBytes: MaxJWKSBytes})
	if err != nil {
		// As in ParsePrivateJWK: a misconfigured path may point at a
		// private key file, so never quote the input.
		var de *ledger.DecodeError
		if errors.As(err, &de) {
			return nil, fmt.Errorf("token: jwks: %s at %q", de.Code, de.Pointer)
		}
		return nil, fmt.Errorf("token: jwks: not a json object")
	}
	raw, ok := m["keys"].([]any)
	if !ok {
		return nil, fmt.Errorf("token: jwks: want an object with a \"keys\" array")
	}
	var keys []Key
	for i, r := range raw {
		km, ok := r.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("token: jwks: keys[%d] is not an object", i)
		}
		j, err := jwkFromMap(km)
		if err != nil {
			return nil, fmt.Errorf("token: jwks: keys[%d]: %v", i, err)
		}
		if j.D != "" || j.P != "" || j.Q != "" || j.DP != "" || j.DQ != "" || j.QI != "" {
			return nil, fmt.Errorf("token: jwks: keys[%d]: private key members in a public key set", i)
		}
		if j.Kty == "oct" {
			return nil, fmt.Errorf("token: jwks: keys[%d]: symmetric (oct) keys are refused", i)
		}
		if !usableForVerify(km) {
			continue // an encryption key, say: not ours to judge
		}
		alg, skip, err := j.algorithm()
		if err != nil {
			return nil, fmt.Errorf("token: jwks: keys[%d]: %v", i, err)
		}
		if skip != "" {
			continue
		}
		pub, err := j.publicKey(alg)
		if err != nil {
			return nil, fmt.Errorf("token: jwks: keys[%d]: %v", i, err)
		}
		keys = append(keys, Key{ID: j.Kid, Alg: alg, PublicKey: pub})
	}
	s, err := NewKeySet(keys...)
	if err != nil {
		return nil, fmt.Errorf("token: jwks: %v", err)
	}
	return s, nil
}

// usableForVerify reports whether a JWK's "use" and "key_ops" allow
// signature verification (RFC 7517 §4.2, §4.3).
func usableForVerify(m map[string]any) bool {
	if use, ok := m["use"]; ok && use != "sig" {
		return false
	}
	if ops, ok := m["key_ops"]; ok {
		list, _ := ops.([]any)
		return slices.Contains(list, any("verify"))
	}
	return true
}

// JWKS returns the set as an RFC 7517 JWK Set: public keys only, each with
// kid, alg and use=sig, in the order they were given to NewKeySet.
func (s *KeySet) JWKS() []byte {
	out := struct {
		Keys []jwk `json:"keys"`
	}{Keys: []jwk{}}
	if s != nil {
		for _, kid := range s.order {
			// Every key passed check in NewKeySet, so it encodes.
			j, err := publicJWK(s.keys[kid])
			if err != nil {
				continue
			}
			out.Keys = append(out.Keys, j)
		}
	}
	b, _ := json.Marshal(out) // plain strings: cannot fail
	return b
}

// Lookup returns the verification key with key id kid.
func (s *KeySet) Lookup(kid string) (Key, bool) {
	if s == nil {
		return Key{}, false
	}
	k, ok := s.keys[kid]
	return k, ok
}

// Len returns the number of keys in the set.
func (s *KeySet) Len() int {
	if s == nil {
		return 0
	}
	return len(s.order)
}

// IDs returns the key ids in the set, in order.
func (s *KeySet) IDs() []string {
	if s == nil {
		return nil
	}
	return slices.Clone(s.order)
}

// String returns the key ids in the set.
func (s *KeySet) String() string {
	return fmt.Sprintf("token.KeySet{kids:%q}", s.IDs())
}

// GoString is String.
func (s *KeySet) GoString() string { return s.String() }

// Thumbprint returns the RFC 7638 SHA-256 thumbprint of k's public key,
// base64url-encoded: a stable key id derived from the key itself.
func (k Key) Thumbprint() (string, error) {
	j, err := publicJWK(k)
	if err != nil {
		return "", err
	}
	// RFC 7638 §3.2: the required members only, in lexicographic order,
	// no whitespace.
	var b bytes.Buffer
	switch j.Kty {
	case "OKP":
		fmt.Fprintf(&b, `{"crv":%q,"kty":%q,"x":%q}`, j.Crv, j.Kty, j.X)
	case "EC":
		fmt.Fprintf(&b, `{"crv":%q,"kty":%q,"x":%q,"y":%q}`, j.Crv, j.Kty, j.X, j.Y)
	case "RSA":
		fmt.Fprintf(&b, `{"e":%q,"kty":%q,"n":%q}`, j.E, j.Kty, j.N)
	}
	sum := sha256.Sum256(b.Bytes())
	return b64(sum[:]), nil
}

// decodeObject parses data strictly (duplicate and case-variant member
// names refused, so that {"kty":"RSA","KTY":"oct"} cannot mean two things)
// and requires an object, at most 8 deep.
func decodeObject(data []byte, lim ledger.Limits) (map[string]any, error) {
	lim.MaxDepth = 8
	v, err := ledger.Decode(data, lim)
	if err != nil {
		return nil, err
	}
	m, ok := v.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("not a json object")
	}
	return m, nil
}

// jwkFromMap reads the members this package uses. Every one must be a
// string when present; the names are matched exactly.
func jwkFromMap(m map[string]any) (jwk, error) {
	var j jwk
	fields := []struct {
		name string
		dst  *string
	}{
		{"kty", &j.Kty}, {"kid", &j.Kid}, {"use", &j.Use}, {"alg", &j.Alg}, {"crv", &j.Crv},
		{"x", &j.X}, {"y", &j.Y}, {"n", &j.N}, {"e", &j.E},
		{"d", &j.D}, {"p", &j.P}, {"q", &j.Q}, {"dp", &j.DP}, {"dq", &j.DQ}, {"qi", &j.QI},
	}
	for _, f := range fields {
		v, ok := m[f.name]
		if !ok {
			continue
		}
		s, ok := v.(string)
		if !ok {
			return jwk{}, fmt.Errorf("member %q is not a string", f.name)
		}
		*f.dst = s
	}
	if j.Kty == "" {
		return jwk{}, fmt.Errorf("no \"kty\"")
	}
	if _, ok := m["oth"]; ok {
		return jwk{}, fmt.Errorf("multi-prime rsa keys are not supported")
	}
	return j, nil
}

// algFamily returns the key types an algorithm name belongs to (RFC 7518,
// RFC 8037, RFC 9864), "none" for the unsecured algorithm, or "" for a name
// this package does not know.
func algFamily(alg string) string {
	switch {
	case alg == "none":
		return "none"
	case alg == "EdDSA" || alg == "Ed25519" || alg == "Ed448":
		return "OKP"
	case strings.HasPrefix(alg, "ECDH-ES"):
		return "EC OKP"
	case strings.HasPrefix(alg, "ES"):
		return "EC"
	case strings.HasPrefix(alg, "RS") || strings.HasPrefix(alg, "PS") || strings.HasPrefix(alg, "RSA"):
		return "RSA"
	case strings.HasPrefix(alg, "HS") || len(alg) > 1 && alg[0] == 'A' && '0' <= alg[1] && alg[1] <= '9' || alg == "dir" || strings.HasPrefix(alg, "PBES2"):
		return "oct"
	}
	return ""
}

// algorithm returns the algorithm this package verifies the JWK with, or a
// reason to skip it (a key type, curve or algorithm this package does not
// implement), or an error for a key that must not be accepted at all: a
// symmetric key, or one whose "alg" names an algorithm of another key type.
func (j jwk) algorithm() (alg, skip string, err error) {
	var want string
	switch j.Kty {
	case "oct":
		return "", "", fmt.Errorf("kid %q: symmetric (oct) keys are refused", j.Kid)
	case "OKP":
		want = AlgEdDSA
	case "EC":
		want = AlgES256
	case "RSA":
		want = AlgRS256
	default:
		return "", "unsupported key type", nil
	}
	if j.Alg != "" {
		fam := algFamily(j.Alg)
		switch {
		case fam == "":
			return "", "unknown alg", nil
		case !slices.Contains(strings.Fields(fam), j.Kty):
			return "", "", fmt.Errorf("kid %q: alg disagrees with key type %s", j.Kid, j.Kty)
		case j.Alg != want && !(want == AlgEdDSA && j.Alg == algEd25519):
			return "", "unsupported alg", nil
		}
	}
	switch {
	case j.Kty == "OKP" && j.Crv != "Ed25519":
		return "", "unsupported okp curve", nil
	case j.Kty == "EC" && j.Crv != "P-256":
		return "", "unsupported ec curve", nil
	case j.Kid == "":
		return "", "", fmt.Errorf("key without kid")
	}
	return want, "", nil
}

// publicKey decodes the public members for alg.
func (j jwk) publicKey(alg string) (crypto.PublicKey, error) {
	switch alg {
	case AlgEdDSA:
		x, err := unb64(j.X)
		if err != nil || len(x) != ed25519.PublicKeySize {
			return nil, fmt.Errorf("kid %q: invalid ed25519 \"x\"", j.Kid)
		}
		return ed25519.PublicKey(x), nil
	case AlgES256:
		x, errX := unb64(j.X)
		y, errY := unb64(j.Y)
		if errX != nil || errY != nil || len(x) != 32 || len(y) != 32 {
			return nil, fmt.Errorf("kid %q: invalid p-256 coordinates", j.Kid)
		}
		pub, err := ecdsa.ParseUncompressedPublicKey(elliptic.P256(), append(append([]byte{4}, x...), y...))
		if err != nil {
			return nil, fmt.Errorf("kid %q: p-256 point not on the curve", j.Kid)
		}
		return pub, nil
	case AlgRS256:
		n, errN := unb64(j.N)
		e, errE := unb64(j.E)
		if errN != nil || errE != nil || len(n) == 0 || len(e) == 0 || len(e) > 4 {
			return nil, fmt.Errorf("kid %q: invalid rsa \"n\" or \"e\"", j.Kid)
		}
		pub := &rsa.PublicKey{N: new(big.Int).SetBytes(n), E: int(new(big.Int).SetBytes(e).Int64())}
		if bits := pub.N.BitLen(); bits < minRSABits || bits > maxRSABits {
			return nil, fmt.Errorf("kid %q: rsa modulus of %d bits, want %d to %d", j.Kid, bits, minRSABits, maxRSABits)
		}
		return pub, nil
	}
	return nil, fmt.Errorf("kid %q: unsupported alg", j.Kid)
}

// b64 is unpadded base64url, as JOSE uses everywhere.
func b64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }

// strictB64 rejects non-zero trailing bits, so that each byte string has
// exactly one encoding and a token cannot be altered without changing its
// decoded bytes.
var strictB64 = base64.RawURLEncoding.Strict()

// unb64 decodes unpadded base64url strictly: only the 64 alphabet
// characters (the standard decoder silently drops \r and \n), no padding,
// canonical trailing bits.
func unb64(s string) ([]byte, error) {
	if !isB64URL(s) {
		return nil, errNotBase64
	}
	return strictB64.DecodeString(s)
}

var errNotBase64 = errors.New("not base64url")

func isB64URL(s string) bool {
	return strings.IndexFunc(s, func(r rune) bool {
		return !('A' <= r && r <= 'Z' || 'a' <= r && r <= 'z' || '0' <= r && r <= '9' || r == '-' || r == '_')
	}) < 0
}
