package token

import (
	"cmp"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"reflect"
	"slices"
	"strings"
	"sync"

	"github.com/toolcall-ledger/ledger/ledger"
)

// DefaultMaxBytes is the default VerifyOptions.MaxBytes: an identity
// assertion is a few hundred bytes, so 8 KiB leaves room for claims while
// keeping a hostile token's parsing cost small.
const DefaultMaxBytes = 8192

// TypeJWT is the typ header of a plain JWT, what Sign writes for an empty
// typ and what Verify requires when VerifyOptions.Type is empty.
const TypeJWT = "JWT"

// The reasons an Error carries. They are stable, machine-readable and end
// up as the reason of denied events.
const (
	// ReasonTokenTooLarge: the token is longer than VerifyOptions.MaxBytes.
	ReasonTokenTooLarge = "token_too_large"
	// ReasonMalformedToken: not three unpadded base64url parts, or a header
	// that is not a strict JSON object with string members.
	ReasonMalformedToken = "malformed_token"
	// ReasonAlgNotAllowed: the header's alg is not in the allowlist ("none"
	// and HMAC never are) or is not the algorithm of the key its kid names.
	ReasonAlgNotAllowed = "alg_not_allowed"
	// ReasonTypMismatch: the header's typ is missing or not the one
	// required (explicit typing, RFC 8725 §3.11).
	ReasonTypMismatch = "typ_mismatch"
	// ReasonForbiddenHeader: the header names or carries a key (jku, x5u,
	// jwk, x5c) or declares critical extensions (crit).
	ReasonForbiddenHeader = "forbidden_header"
	// ReasonMissingKID: the header has no kid.
	ReasonMissingKID = "missing_kid"
	// ReasonUnknownKID: the kid is not in the configured key set.
	ReasonUnknownKID = "unknown_kid"
	// ReasonBadSignature: the signature does not verify.
	ReasonBadSignature = "bad_signature"
	// ReasonMalformedClaims: the signed payload is not a strict JSON object
	// of the expected shape.
	ReasonMalformedClaims = "malformed_claims"
	// ReasonExpired: exp has passed (beyond the allowed skew).
	ReasonExpired = "expired"
	// ReasonNotYetValid: nbf or iat lies in the future (beyond the skew).
	ReasonNotYetValid = "not_yet_valid"
	// ReasonIssuerMismatch: iss is not the expected issuer.
	ReasonIssuerMismatch = "issuer_mismatch"
	// ReasonAudienceMismatch: aud does not contain the expected audience.
	ReasonAudienceMismatch = "audience_mismatch"
	// ReasonMissingClaim: a required claim is absent.
	ReasonMissingClaim = "missing_claim"
)

// Error is why a token was refused. Detail is for humans and never contains
// token or key bytes, so an Error may be logged and put on a denied event.
type Error struct {
	// Reason is one of the Reason constants (or a caller's own reason,
	// such as an identity package's missing_assertion).
	Reason string
	// Detail says what exactly was wrong, without quoting the token.
	Detail string
}

// Error returns the reason and the detail.
func (e *Error) Error() string {
	if e.Detail == "" {
		return "token: " + e.Reason
	}
	return "token: " + e.Reason + ": " + e.Detail
}

// Is reports whether target is an *Error with the same Reason and either
// the same Detail or none, so that errors.Is(err, &Error{Reason: r})
// matches any error of reason r.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Reason == e.Reason && (t.Detail == "" || t.Detail == e.Detail)
}

// Terminal reports true: a refused token stays refused, so a caller should
// deny rather than retry.
func (e *Error) Terminal() bool { return true }

// ReasonOf returns the Reason of the first *Error in err's chain, or "".
func ReasonOf(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Reason
	}
	return ""
}

func fail(reason, format string, a ...any) *Error {
	return &Error{Reason: reason, Detail: fmt.Sprintf(format, a...)}
}

// Header is the verified JOSE header of a token.
type Header struct {
	Alg string
	Typ string
	Kid string
}

// header is the JSON form Sign writes, in this member order.
type header struct {
	Alg string `json:"alg"`
	Typ string `json:"typ"`
	Kid string `json:"kid"`
}

// Sign returns the compact JWS of claims (marshalled with encoding/json,
// which must give a JSON object) signed with k, with header
// {"alg","typ","kid"}. An empty typ means TypeJWT. ES256 signatures are
// r||s, 64 bytes (RFC 7518 §3.4), not ASN.1.
func Sign(k Key, typ string, claims any) (string, error) {
	if !k.CanSign() {
		return "", fmt.Errorf("token: key %q cannot sign", k.ID)
	}
	if err := k.check(); err != nil {
		return "", err
	}
	if typ == "" {
		typ = TypeJWT
	}
	hb, err := json.Marshal(header{Alg: k.Alg, Typ: typ, Kid: k.ID})
	if err != nil {
		return "", fmt.Errorf("token: marshal header: %v", err)
	}
	pb, err := json.Marshal(claims)
	if err != nil {
		return "", fmt.Errorf("token: marshal claims: %v", err)
	}
	if len(pb) == 0 || pb[0] != '{' {
		return "", fmt.Errorf("token: claims must marshal to a json object")
	}
	input := b64(hb) + "." + b64(pb)
	sig, err := signBytes(k, []byte(input))
	if err != nil {
		return "", fmt.Errorf("token: sign with key %q: %v", k.ID, err)
	}
	return input + "." + b64(sig), nil
}

func signBytes(k Key, input []byte) ([]byte, error) {
	switch priv := k.private.signer.(type) {
	case ed25519.PrivateKey:
		return ed25519.Sign(priv, input), nil
	case *ecdsa.PrivateKey:
		digest := sha256.Sum256(input)
		r, s, err := ecdsa.Sign(rand.Reader, priv, digest[:])
		if err != nil {
			return nil, err
		}
		sig := make([]byte, 64)
		r.FillBytes(sig[:32])
		s.FillBytes(sig[32:])
		return sig, nil
	case *rsa.PrivateKey:
		digest := sha256.Sum256(input)
		return rsa.SignPKCS1v15(nil, priv, crypto.SHA256, digest[:])
	}
	return nil, errors.New("unsupported private key type")
}

// VerifyOptions configures Verify.
type VerifyOptions struct {
	// Keys is the only place a verification key comes from; a nil set
	// refuses every token (unknown_kid).
	Keys *KeySet
	// Algorithms is the allowlist, default {EdDSA, ES256, RS256}. Only
	// those three can ever be allowed: "none", HS256 and anything else
	// listed here is ignored. A token's alg must also equal the Alg of the
	// key its kid names.
	Algorithms []string
	// Type is the required typ header, compared case-insensitively and
	// with or without an "application/" prefix. Empty means "JWT". A token
	// without typ is refused either way.
	Type string
	// MaxBytes bounds the token length, default DefaultMaxBytes.
	MaxBytes int
}

// Unverified decodes token's payload into claims without checking
// anything else: neither its signature nor a claim. It is for knowing
// where a token's holder would be answered (a tenant to route to, a user
// to refuse early), never for granting: only what Verify accepted may.
func Unverified(token string, claims any) error {
	if len(token) > DefaultMaxBytes {
		return fail(ReasonTokenTooLarge, "%d bytes, limit %d", len(token), DefaultMaxBytes)
	}
	_, rest, _ := strings.Cut(token, ".")
	p64, _, ok := strings.Cut(rest, ".")
	if !ok {
		return fail(ReasonMalformedToken, "not three parts")
	}
	payload, err := unb64(p64)
	if err != nil {
		return fail(ReasonMalformedToken, "payload: %v", err)
	}
	if err := json.Unmarshal(payload, claims); err != nil {
		return fail(ReasonMalformedToken, "payload: %v", err)
	}
	return nil
}

// Verify checks token and decodes its payload into claims (with
// encoding/json; nil claims skips decoding). In order: size; structure
// (exactly three unpadded base64url parts, header a strict JSON object
// without duplicate or case-variant members); forbidden headers; alg in
// the allowlist; typ; kid present and in o.Keys; alg equal to the key's;
// signature; and only then the payload, which must be a strict JSON object,
// though of numbers of any size: a number is checked by the claims field
// that reads it, if any. Every refusal is an *Error, with a zero Header
// but for ReasonUnknownKID's, which returns the (unverified) header.
//
// Verify checks no claim: see Claims.Validate.
func Verify(token string, o VerifyOptions, claims any) (Header, error) {
	maxBytes := o.MaxBytes
	if maxBytes <= 0 {
		maxBytes = DefaultMaxBytes
	}
	if len(token) > maxBytes {
		return Header{}, fail(ReasonTokenTooLarge, "%d bytes, limit %d", len(token), maxBytes)
	}
	h64, rest, ok1 := strings.Cut(token, ".")
	p64, s64, ok2 := strings.Cut(rest, ".")
	if !ok1 || !ok2 || strings.Contains(s64, ".") {
		return Header{}, fail(ReasonMalformedToken, "want three dot-separated parts")
	}
	if h64 == "" || p64 == "" {
		return Header{}, fail(ReasonMalformedToken, "empty header or payload")
	}
	hb, err := unb64(h64)
	if err != nil {
		return Header{}, fail(ReasonMalformedToken, "header is not unpadded base64url")
	}
	pb, err := unb64(p64)
	if err != nil {
		return Header{}, fail(ReasonMalformedToken, "payload is not unpadded base64url")
	}
	sig, err := unb64(s64)
	if err != nil {
		return Header{}, fail(ReasonMalformedToken, "signature is not unpadded base64url")
	}
	hm, err := decodeObject(hb, ledger.Limits{MaxBytes: maxBytes})
	if err != nil {
		return Header{}, fail(ReasonMalformedToken, "header is not a strict json object")
	}
	// These name or carry a verification key, or declare extensions that a
	// verifier must understand. Keys come only from the configured set
	// (RFC 8725 §3.10), and this verifier understands no extension.
	for _, name := range [...]string{"jku", "x5u", "jwk", "x5c", "crit"} {
		if _, ok := hm[name]; ok {
			return Header{}, fail(ReasonForbiddenHeader, "header parameter %s is refused", name)
		}
	}
	var h Header
	for _, m := range []struct {
		name string
		dst  *string
	}{{"alg", &h.Alg}, {"typ", &h.Typ}, {"kid", &h.Kid}} {
		v, ok := hm[m.name]
		if !ok {
			continue
		}
		s, ok := v.(string)
		if !ok {
			return Header{}, fail(ReasonMalformedToken, "header parameter %s is not a string", m.name)
		}
		*m.dst = s
	}
	if h.Alg == algEd25519 {
		// RFC 9864's fully specified name for EdDSA over Ed25519, the
		// one curve an EdDSA key here can have (the key sets load such
		// keys under it too): the same algorithm.
		h.Alg = AlgEdDSA
	}
	if !algAllowed(h.Alg, o.Algorithms) {
		return Header{}, fail(ReasonAlgNotAllowed, "alg is not in the allowlist")
	}
	want := o.Type
	if want == "" {
		want = TypeJWT
	}
	if h.Typ == "" || normalizeType(h.Typ) != normalizeType(want) {
		return Header{}, fail(ReasonTypMismatch, "want typ %s", want)
	}
	if h.Kid == "" {
		return Header{}, fail(ReasonMissingKID, "header has no kid")
	}
	key, ok := o.Keys.Lookup(h.Kid)
	if !ok {
		// The header, unverified, with the refusal: its kid is what a
		// caller would fetch keys for.
		return h, fail(ReasonUnknownKID, "kid is not in the key set")
	}
	if key.Alg != h.Alg {
		return Header{}, fail(ReasonAlgNotAllowed, "alg is not the algorithm of the key")
	}
	if !verifySignature(key, token[:len(h64)+1+len(p64)], sig) {
		return Header{}, fail(ReasonBadSignature, "signature does not verify")
	}
	if claims != nil {
		// The strict pass refuses duplicate and case-variant members, which
		// encoding/json would silently merge (last one wins, any case),
		// and a member named like one of claims' fields but in another
		// case, which encoding/json would take for it: claim names are
		// case-sensitive (RFC 7519), and an issuer that lets users add
		// claims of their own protects "tenant", not "Tenant". Numbers
		// of any size: claims are not hashed, and an identity
		// provider's unrelated 64-bit claim ("org_id") must not refuse
		// every token; those read as times are range-checked as they
		// are read (NumericDate).
		m, err := decodeObject(pb, ledger.Limits{MaxBytes: maxBytes, AnyNumber: true})
		if err != nil {
			return Header{}, fail(ReasonMalformedClaims, "payload is not a strict json object")
		}
		if name, ok := caseVariant(m, claims); ok {
			return Header{}, fail(ReasonMalformedClaims, "claim %q is a case variant of a claim name", name)
		}
		if err := json.Unmarshal(pb, claims); err != nil {
			return Header{}, fail(ReasonMalformedClaims, "payload does not match the claims type")
		}
	}
	return h, nil
}

// claimNames caches, per claims type, the names encoding/json reads into.
var claimNames sync.Map // reflect.Type -> []string

// caseVariant returns a member name of m that encoding/json would read
// into a field of *claims although it is not that field's name exactly.
func caseVariant(m map[string]any, claims any) (string, bool) {
	t := reflect.TypeOf(claims)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil || t.Kind() != reflect.Struct {
		return "", false
	}
	names, ok := claimNames.Load(t)
	if !ok {
		names, _ = claimNames.LoadOrStore(t, jsonNames(t, nil))
	}
	for k := range m {
		for _, n := range names.([]string) {
			if k != n && strings.EqualFold(k, n) {
				return k, true
			}
		}
	}
	return "", false
}

// jsonNames appends the names encoding/json gives the fields of struct
// type t, its embedded structs' promoted.
func jsonNames(t reflect.Type, out []string) []string {
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case name == "-":
			continue
		case f.Anonymous && name == "":
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				out = jsonNames(ft, out)
				continue
			}
		case !f.IsExported():
			continue
		}
		out = append(out, cmp.Or(name, f.Name))
	}
	return out
}

// supportedAlgs is the most Verify will ever allow.
func supportedAlgs() []string { return []string{AlgEdDSA, AlgES256, AlgRS256} }

func algAllowed(alg string, allow []string) bool {
	if !slices.Contains(supportedAlgs(), alg) {
		return false
	}
	return len(allow) == 0 || slices.Contains(allow, alg)
}

// normalizeType maps "application/Agent-Assertion+JWT" and
// "agent-assertion+jwt" alike (RFC 7515 §4.1.9).
func normalizeType(t string) string {
	t = strings.ToLower(t)
	return strings.TrimPrefix(t, "application/")
}

func verifySignature(k Key, input string, sig []byte) bool {
	switch pub := k.PublicKey.(type) {
	case ed25519.PublicKey:
		return k.Alg == AlgEdDSA && len(sig) == ed25519.SignatureSize && ed25519.Verify(pub, []byte(input), sig)
	case *ecdsa.PublicKey:
		if k.Alg != AlgES256 || len(sig) != 64 {
			return false
		}
		digest := sha256.Sum256([]byte(input))
		r, s := new(big.Int).SetBytes(sig[:32]), new(big.Int).SetBytes(sig[32:])
		return ecdsa.Verify(pub, digest[:], r, s)
	case *rsa.PublicKey:
		if k.Alg != AlgRS256 || len(sig) != pub.Size() {
			return false
		}
		digest := sha256.Sum256([]byte(input))
		return rsa.VerifyPKCS1v15(pub, crypto.SHA256, digest[:], sig) == nil
	}
	return false
}
