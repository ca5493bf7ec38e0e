package credentials

// This file is the only place that knows the compact JWS encoding (RFC 7515)
// of a credential: EdDSA over Ed25519 (RFC 8037), nothing else. It is kept
// apart so that it can be replaced by ledger/token without touching the
// broker or the verifier.

import (
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"strings"
)

const (
	// AlgEdDSA is the only JWS algorithm minted and accepted.
	AlgEdDSA = "EdDSA"
	// TokenType is the typ header of every credential (RFC 8725 §3.11:
	// explicit typing, so that no other JWT, such as an identity
	// assertion, is ever taken for a credential).
	TokenType = "ledger-credential+jwt"
	// MaxTokenBytes bounds a presented token; longer ones are malformed
	// without being decoded.
	MaxTokenBytes = 8 << 10
)

// b64 is unpadded base64url, strict so that each value has one encoding.
var b64 = base64.RawURLEncoding.Strict()

// jwsHeader is the protected header the broker writes.
type jwsHeader struct {
	Alg string `json:"alg"`
	Typ string `json:"typ"`
	Kid string `json:"kid"`
}

// refusedHeaders are header parameters a credential never carries. A key
// named by URL or embedded in the token would let the presenter choose the
// key (RFC 8725 §3.10); crit names extensions nobody here understands.
var refusedHeaders = [...]string{"crit", "jku", "jwk", "x5u", "x5c", "x5t", "x5t#S256"}

// jwsHeaderSegment is the first segment of every token signed under kid:
// the same for all of them, so a key encodes it once.
func jwsHeaderSegment(kid string) string {
	// Three strings: Marshal cannot fail.
	h, _ := json.Marshal(jwsHeader{Alg: AlgEdDSA, Typ: TokenType, Kid: kid})
	return b64.EncodeToString(h)
}

// signJWS returns the compact JWS of payload under header (from
// jwsHeaderSegment), signed by priv. The token is built in one buffer:
// a credential is minted per call.
func signJWS(priv ed25519.PrivateKey, header string, payload []byte) string {
	input := len(header) + 1 + b64.EncodedLen(len(payload))
	buf := make([]byte, input, input+1+b64.EncodedLen(ed25519.SignatureSize))
	copy(buf, header)
	buf[len(header)] = '.'
	b64.Encode(buf[len(header)+1:], payload)
	sig := ed25519.Sign(priv, buf)
	buf = append(buf, '.')
	return string(b64.AppendEncode(buf, sig))
}

// parsedJWS is a token split and decoded, not yet verified.
type parsedJWS struct {
	kid     string
	input   []byte // what the signature covers: header "." payload, as sent
	payload []byte
	sig     []byte
}

// parseJWS decodes a compact JWS and checks its header. It returns an
// *Error (malformed, alg_not_allowed, wrong_type); no error text ever
// quotes the token.
func parseJWS(token string) (parsedJWS, error) {
	if len(token) > MaxTokenBytes {
		return parsedJWS{}, reject(ReasonMalformed, "token longer than %d bytes", MaxTokenBytes)
	}
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return parsedJWS{}, reject(ReasonMalformed, "not a compact JWS: %d segments", len(parts))
	}
	hb, err := b64.DecodeString(parts[0])
	if err != nil {
		return parsedJWS{}, reject(ReasonMalformed, "header is not base64url")
	}
	var header map[string]json.RawMessage
	if err := json.Unmarshal(hb, &header); err != nil || header == nil {
		return parsedJWS{}, reject(ReasonMalformed, "header is not a JSON object")
	}
	// alg first: a token with alg none or HS256 is refused as such,
	// whatever else is wrong with it.
	if alg, ok := headerString(header, "alg"); !ok || alg != AlgEdDSA {
		return parsedJWS{}, reject(ReasonAlgNotAllowed, "only %s is accepted", AlgEdDSA)
	}
	if typ, ok := headerString(header, "typ"); !ok || !isTokenType(typ) {
		return parsedJWS{}, reject(ReasonWrongType, "typ must be %s", TokenType)
	}
	for _, name := range refusedHeaders {
		if _, ok := header[name]; ok {
			return parsedJWS{}, reject(ReasonMalformed, "header parameter %s is not accepted", name)
		}
	}
	kid, ok := headerString(header, "kid")
	if !ok || kid == "" {
		return parsedJWS{}, reject(ReasonMalformed, "header has no kid")
	}
	payload, err := b64.DecodeString(parts[1])
	if err != nil {
		return parsedJWS{}, reject(ReasonMalformed, "payload is not base64url")
	}
	sig, err := b64.DecodeString(parts[2])
	if err != nil {
		return parsedJWS{}, reject(ReasonMalformed, "signature is not base64url")
	}
	return parsedJWS{
		kid:     kid,
		input:   []byte(token[:len(parts[0])+1+len(parts[1])]),
		payload: payload,
		sig:     sig,
	}, nil
}

// verify reports whether p's signature is pub's.
func (p parsedJWS) verify(pub ed25519.PublicKey) bool {
	return len(p.sig) == ed25519.SignatureSize && ed25519.Verify(pub, p.input, p.sig)
}

// headerString returns a header parameter that must be a JSON string.
func headerString(h map[string]json.RawMessage, name string) (string, bool) {
	raw, ok := h[name]
	if !ok {
		return "", false
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", false
	}
	return s, true
}

// isTokenType compares a typ value as RFC 7515 §4.1.9 says: a media type,
// case-insensitive, with the "application/" prefix optional.
func isTokenType(typ string) bool {
	typ = strings.ToLower(typ)
	return typ == TokenType || typ == "application/"+TokenType
}
