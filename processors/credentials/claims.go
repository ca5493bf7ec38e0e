package credentials

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/jsonappend"
)

// Actor is an RFC 8693 actor claim: who acts, and (nested) who acts
// through them. A credential's act is the agent, with the executor
// instance that ran the call nested inside it.
type Actor struct {
	Subject string `json:"sub"`
	Actor   *Actor `json:"act,omitempty"`
}

// Claims are a verified credential's claims.
type Claims struct {
	Issuer   string
	Audience string
	// Subject is the user on whose behalf the call runs.
	Subject string
	// Actor is the agent; Actor.Actor the executor instance.
	Actor  Actor
	Tenant string
	// Scope is the one action the credential allows, "tool::<name>".
	Scope          string
	JTI            string
	IssuedAt       time.Time
	NotBefore      time.Time
	ExpiresAt      time.Time
	CallID         string
	IdempotencyKey string
	// Family is "<tool>:<tenant>:<epoch>", the unit of revocation.
	Family      string
	ToolVersion int
	// BodySHA256 binds the credential to the exact body of the call's
	// request (BodyDigest); empty for a credential bound to none (a
	// status lookup's). CheckBody checks it.
	BodySHA256 string
}

// BodyDigest is a request body's digest as a credential carries it: the
// base64url (unpadded) SHA-256 of its bytes.
func BodyDigest(body []byte) string {
	sum := sha256.Sum256(body)
	return base64.RawURLEncoding.EncodeToString(sum[:])
}

// CheckBody refuses (ReasonWrongBody) a body other than the one the
// credential was minted for: a credential leaked within its TTL cannot
// carry other arguments, under the same call's key, to the tool. A
// credential bound to no body allows any.
func (c Claims) CheckBody(body []byte) error {
	if c.BodySHA256 == "" || subtle.ConstantTimeCompare([]byte(c.BodySHA256), []byte(BodyDigest(body))) == 1 {
		return nil
	}
	return reject(ReasonWrongBody, "the request's body is not the one credential %s was minted for", quote(c.JTI))
}

// Agent returns the agent the credential acts for.
func (c Claims) Agent() string { return c.Actor.Subject }

// Executor returns the executor instance that presented the credential, or
// "" when the token names none.
func (c Claims) Executor() string {
	if c.Actor.Actor == nil {
		return ""
	}
	return c.Actor.Actor.Subject
}

// wireClaims is the JWT payload. Times are NumericDate seconds (RFC 7519);
// aud is a single string, never an array, so that one credential is never
// good at two backends.
type wireClaims struct {
	Iss            string `json:"iss"`
	Aud            string `json:"aud"`
	Sub            string `json:"sub"`
	Act            *Actor `json:"act,omitempty"`
	Tenant         string `json:"tenant"`
	Scope          string `json:"scope"`
	JTI            string `json:"jti"`
	Iat            int64  `json:"iat"`
	Nbf            int64  `json:"nbf"`
	Exp            int64  `json:"exp"`
	CallID         string `json:"call_id,omitempty"`
	IdempotencyKey string `json:"idempotency_key"`
	Family         string `json:"family"`
	ToolVersion    int    `json:"tool_version,omitempty"`
	BodySHA256     string `json:"body_sha256,omitempty"`
}

// appendJSON appends w as encoding/json encodes it with HTML escaping
// off, without its reflection: every call's credential is encoded once,
// on the hot path, and reflection was a fifth of minting it.
// FuzzClaimsEncoding holds the two encodings equal; a field added to
// wireClaims must be added here too.
func (w *wireClaims) appendJSON(b []byte) []byte {
	b = append(b, `{"iss":`...)
	b = jsonappend.String(b, w.Iss)
	b = jsonappend.StringField(b, "aud", w.Aud)
	b = jsonappend.StringField(b, "sub", w.Sub)
	if w.Act != nil {
		b = w.Act.appendJSON(jsonappend.Key(b, "act"))
	}
	b = jsonappend.StringField(b, "tenant", w.Tenant)
	b = jsonappend.StringField(b, "scope", w.Scope)
	b = jsonappend.StringField(b, "jti", w.JTI)
	b = jsonappend.IntField(b, "iat", w.Iat)
	b = jsonappend.IntField(b, "nbf", w.Nbf)
	b = jsonappend.IntField(b, "exp", w.Exp)
	b = jsonappend.OptString(b, "call_id", w.CallID)
	b = jsonappend.StringField(b, "idempotency_key", w.IdempotencyKey)
	b = jsonappend.StringField(b, "family", w.Family)
	b = jsonappend.OptInt(b, "tool_version", int64(w.ToolVersion))
	b = jsonappend.OptString(b, "body_sha256", w.BodySHA256)
	return append(b, '}')
}

// appendJSON appends a as encoding/json encodes it with HTML escaping off.
func (a *Actor) appendJSON(b []byte) []byte {
	b = append(b, `{"sub":`...)
	b = jsonappend.String(b, a.Subject)
	if a.Actor != nil {
		b = a.Actor.appendJSON(jsonappend.Key(b, "act"))
	}
	return append(b, '}')
}

func (w wireClaims) claims() Claims {
	c := Claims{
		Issuer:         w.Iss,
		Audience:       w.Aud,
		Subject:        w.Sub,
		Tenant:         w.Tenant,
		Scope:          w.Scope,
		JTI:            w.JTI,
		IssuedAt:       time.Unix(w.Iat, 0).UTC(),
		NotBefore:      time.Unix(w.Nbf, 0).UTC(),
		ExpiresAt:      time.Unix(w.Exp, 0).UTC(),
		CallID:         w.CallID,
		IdempotencyKey: w.IdempotencyKey,
		Family:         w.Family,
		ToolVersion:    w.ToolVersion,
		BodySHA256:     w.BodySHA256,
	}
	if w.Act != nil {
		c.Actor = *w.Act
	}
	return c
}

// Reason says why a credential was refused. It is machine-readable
// (snake_case) and is what a tool answers in its 401.
type Reason string

// The reasons Verify refuses a credential for.
const (
	// ReasonMissingToken: no token was presented.
	ReasonMissingToken Reason = "missing_token"
	// ReasonMalformed: not a compact JWS with a JSON header and claims, too
	// long, without kid, exp or jti, or with a header parameter that names
	// or embeds a key (jku, jwk, x5u, x5c) or crit.
	ReasonMalformed Reason = "malformed"
	// ReasonAlgNotAllowed: alg is anything but EdDSA, none included.
	ReasonAlgNotAllowed Reason = "alg_not_allowed"
	// ReasonWrongType: typ is not ledger-credential+jwt.
	ReasonWrongType Reason = "wrong_type"
	// ReasonUnknownKid: kid is not in the published key set, even after a
	// refresh; also a key that rotated out of it.
	ReasonUnknownKid Reason = "unknown_kid"
	// ReasonBadSignature: the signature is not the key's.
	ReasonBadSignature Reason = "bad_signature"
	// ReasonWrongIssuer: iss is not the ledger.
	ReasonWrongIssuer Reason = "wrong_issuer"
	// ReasonWrongAudience: aud is not this backend.
	ReasonWrongAudience Reason = "wrong_audience"
	// ReasonExpired: exp is past, beyond the allowed skew.
	ReasonExpired Reason = "expired"
	// ReasonNotYetValid: nbf is ahead, beyond the allowed skew.
	ReasonNotYetValid Reason = "not_yet_valid"
	// ReasonReplayed: the jti was already accepted for another call.
	ReasonReplayed Reason = "replayed"
	// ReasonWrongScope: scope is not the action asked for.
	ReasonWrongScope Reason = "wrong_scope"
	// ReasonWrongTenant: tenant is not the request's tenant.
	ReasonWrongTenant Reason = "wrong_tenant"
	// ReasonWrongCall: idempotency_key is not the request's call.
	ReasonWrongCall Reason = "wrong_call"
	// ReasonSpent: the credential already had its effect at this tool
	// (Verifier.Spend): a tool that does not deduplicate by key applies
	// one effect per credential, so its request sent again (a leaked
	// token, replayed with its call's key and body) is refused. A tool
	// answers 401, as for replayed; the ledger never sends a call again
	// after its tool may have applied it.
	ReasonSpent Reason = "spent"
	// ReasonWrongBody: the request's body is not the one the credential
	// was minted for (Claims.CheckBody).
	ReasonWrongBody Reason = "wrong_body"
	// ReasonKeysUnavailable: the key set could not be fetched, so nothing
	// can be verified. Not the presenter's fault: a tool answers 503,
	// with X-Ledger-Not-Applied: true (httptool.HeaderNotApplied), so
	// that the ledger asks again rather than take the effect of a tool
	// that does not deduplicate for unknown.
	ReasonKeysUnavailable Reason = "keys_unavailable"
)

// Error is a refused credential. Detail is for humans and never quotes the
// token; Err is the cause of keys_unavailable.
type Error struct {
	Reason Reason
	Detail string
	Err    error
}

// Error implements error.
func (e *Error) Error() string {
	msg := "credential refused: " + string(e.Reason)
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap returns the cause, if any.
func (e *Error) Unwrap() error { return e.Err }

// ReasonOf returns the Reason of an *Error in err's chain, or "" if there is
// none.
func ReasonOf(err error) Reason {
	if e, ok := errors.AsType[*Error](err); ok {
		return e.Reason
	}
	return ""
}

func reject(r Reason, format string, args ...any) *Error {
	return &Error{Reason: r, Detail: fmt.Sprintf(format, args...)}
}

// quote renders a claim value for an error detail: quoted and cut short, so
// that a hostile claim cannot flood a log.
func quote(s string) string {
	const limit = 64
	if len(s) > limit {
		s = s[:limit] + "..."
	}
	return fmt.Sprintf("%q", s)
}
