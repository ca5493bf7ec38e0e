package credentials

import (
	"context"
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// env is one broker, its clock and a verifier for "demo-backend".
type env struct {
	c *clock
	b *Broker
	v *Verifier
}

func newEnv(t *testing.T) env {
	t.Helper()
	c := newClock()
	b := newBroker(t, c, Config{})
	return env{c: c, b: b, v: newVerifier(t, c, b, VerifierConfig{})}
}

// signer signs a JWS signing input.
type signer func(input []byte) []byte

func (e env) realKey() signer {
	return func(in []byte) []byte { return ed25519.Sign(e.b.current.priv, in) }
}

func attackerKey(t *testing.T) (ed25519.PublicKey, signer) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	return pub, func(in []byte) []byte { return ed25519.Sign(priv, in) }
}

// forge builds a compact JWS from any header and claims, encoded
// independently of jws.go.
func forge(t *testing.T, header, claims any, sign signer) string {
	t.Helper()
	enc := func(v any) string {
		if s, ok := v.(string); ok {
			return base64.RawURLEncoding.EncodeToString([]byte(s))
		}
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return base64.RawURLEncoding.EncodeToString(b)
	}
	input := enc(header) + "." + enc(claims)
	var sig []byte
	if sign != nil {
		sig = sign([]byte(input))
	}
	return input + "." + base64.RawURLEncoding.EncodeToString(sig)
}

func (e env) header() map[string]any {
	return map[string]any{"alg": "EdDSA", "typ": TokenType, "kid": e.b.current.kid}
}

// validClaims are the claims of a good credential for expect() at t0.
func validClaims() map[string]any {
	return map[string]any{
		"iss": "toolcall-ledger", "aud": "demo-backend", "sub": "u_88",
		"act":    map[string]any{"sub": "agent_support", "act": map[string]any{"sub": "executor-1"}},
		"tenant": "t_acme", "scope": "tool::refund_order", "jti": "forged-jti",
		"iat": t0.Unix(), "nbf": t0.Unix(), "exp": t0.Add(5 * time.Minute).Unix(),
		"idempotency_key": "run_42:step_7:refund_order", "family": "refund_order:t_acme:4",
	}
}

func with(m map[string]any, kv ...any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	for i := 0; i < len(kv); i += 2 {
		if kv[i+1] == nil {
			delete(out, kv[i].(string))
			continue
		}
		out[kv[i].(string)] = kv[i+1]
	}
	return out
}

func TestVerifyRefuses(t *testing.T) {
	t.Parallel()
	minted := func(edit func(*Grant)) func(*testing.T, env) string {
		return func(t *testing.T, e env) string {
			g := grant()
			if edit != nil {
				edit(&g)
			}
			return mint(t, e.b, g).Token
		}
	}
	real := func(header func(env) map[string]any, claims any) func(*testing.T, env) string {
		return func(t *testing.T, e env) string { return forge(t, header(e), claims, e.realKey()) }
	}
	hdr := func(kv ...any) func(env) map[string]any {
		return func(e env) map[string]any { return with(e.header(), kv...) }
	}
	tests := []struct {
		name   string
		token  func(*testing.T, env) string
		before func(*testing.T, env, string) // runs after the token is made
		want   *Expect                       // nil: expect()
		reason Reason
	}{
		{name: "no token", token: func(*testing.T, env) string { return "" }, reason: ReasonMissingToken},

		{name: "two segments", token: func(*testing.T, env) string { return "e30.e30" }, reason: ReasonMalformed},
		{name: "four segments", token: func(t *testing.T, e env) string { return minted(nil)(t, e) + ".e30" }, reason: ReasonMalformed},
		{name: "header not base64url", token: func(t *testing.T, e env) string { return "!!!" + minted(nil)(t, e)[3:] }, reason: ReasonMalformed},
		{name: "padded base64", token: func(t *testing.T, e env) string {
			p := strings.Split(minted(nil)(t, e), ".")
			return p[0] + "=." + p[1] + "." + p[2]
		}, reason: ReasonMalformed},
		{name: "header not JSON", token: real(func(env) map[string]any { return nil }, validClaims()), reason: ReasonMalformed},
		{name: "header not an object", token: func(t *testing.T, e env) string { return forge(t, "[1]", validClaims(), e.realKey()) }, reason: ReasonMalformed},
		{name: "oversized", token: func(*testing.T, env) string { return strings.Repeat("a", MaxTokenBytes+1) }, reason: ReasonMalformed},
		{name: "crit header", token: real(hdr("crit", []string{"exp"}), validClaims()), reason: ReasonMalformed},
		{name: "jku pointing elsewhere", token: func(t *testing.T, e env) string {
			pub, sign := attackerKey(t)
			return forge(t, map[string]any{"alg": "EdDSA", "typ": TokenType, "kid": thumbprint(pub), "jku": "https://evil.example/jwks.json"}, validClaims(), sign)
		}, reason: ReasonMalformed},
		{name: "embedded jwk", token: func(t *testing.T, e env) string {
			pub, sign := attackerKey(t)
			return forge(t, map[string]any{"alg": "EdDSA", "typ": TokenType, "kid": thumbprint(pub), "jwk": publicJWK(thumbprint(pub), pub)}, validClaims(), sign)
		}, reason: ReasonMalformed},
		{name: "x5u header", token: real(hdr("x5u", "https://evil.example/cert.pem"), validClaims()), reason: ReasonMalformed},
		{name: "no kid", token: real(hdr("kid", nil), validClaims()), reason: ReasonMalformed},
		{name: "claims not JSON", token: func(t *testing.T, e env) string { return forge(t, e.header(), "not json", e.realKey()) }, reason: ReasonMalformed},
		{name: "aud as an array", token: real(hdr(), with(validClaims(), "aud", []string{"demo-backend", "other-backend"})), reason: ReasonMalformed},
		{name: "exp as a string", token: real(hdr(), with(validClaims(), "exp", "tomorrow")), reason: ReasonMalformed},
		{name: "no exp", token: real(hdr(), with(validClaims(), "exp", nil)), reason: ReasonMalformed},
		{name: "no jti", token: real(hdr(), with(validClaims(), "jti", nil)), reason: ReasonMalformed},

		{name: "alg none", token: func(t *testing.T, e env) string { return forge(t, hdr("alg", "none")(e), validClaims(), nil) }, reason: ReasonAlgNotAllowed},
		{name: "HS256 keyed with the public key", token: func(t *testing.T, e env) string {
			// The classic confusion: an HMAC whose secret is the
			// published public key.
			return forge(t, hdr("alg", "HS256")(e), validClaims(), func(in []byte) []byte {
				m := hmac.New(sha256.New, e.b.current.public())
				m.Write(in)
				return m.Sum(nil)
			})
		}, reason: ReasonAlgNotAllowed},
		{name: "RS256", token: real(hdr("alg", "RS256"), validClaims()), reason: ReasonAlgNotAllowed},
		{name: "ES256", token: real(hdr("alg", "ES256"), validClaims()), reason: ReasonAlgNotAllowed},
		{name: "alg in another case", token: real(hdr("alg", "eddsa"), validClaims()), reason: ReasonAlgNotAllowed},
		{name: "no alg", token: real(hdr("alg", nil), validClaims()), reason: ReasonAlgNotAllowed},

		{name: "typ JWT", token: real(hdr("typ", "JWT"), validClaims()), reason: ReasonWrongType},
		{name: "typ of an access token", token: real(hdr("typ", "at+jwt"), validClaims()), reason: ReasonWrongType},
		{name: "no typ", token: real(hdr("typ", nil), validClaims()), reason: ReasonWrongType},

		{name: "unknown kid", token: func(t *testing.T, e env) string {
			pub, sign := attackerKey(t)
			return forge(t, hdr("kid", thumbprint(pub))(e), validClaims(), sign)
		}, reason: ReasonUnknownKid},

		{name: "tampered claims", token: func(t *testing.T, e env) string {
			p := strings.Split(minted(nil)(t, e), ".")
			forged := strings.Split(forge(t, "{}", with(validClaims(), "scope", "tool::delete_everything"), nil), ".")
			return p[0] + "." + forged[1] + "." + p[2]
		}, want: &Expect{Scope: "tool::delete_everything", Tenant: "t_acme", IdempotencyKey: "run_42:step_7:refund_order"}, reason: ReasonBadSignature},
		{name: "another key under the real kid", token: func(t *testing.T, e env) string {
			_, sign := attackerKey(t)
			return forge(t, e.header(), validClaims(), sign)
		}, reason: ReasonBadSignature},
		{name: "short signature", token: func(t *testing.T, e env) string {
			return forge(t, e.header(), validClaims(), func(in []byte) []byte { return e.realKey()(in)[:63] })
		}, reason: ReasonBadSignature},
		{name: "no signature", token: func(t *testing.T, e env) string { return forge(t, e.header(), validClaims(), nil) }, reason: ReasonBadSignature},

		{name: "another issuer", token: real(hdr(), with(validClaims(), "iss", "another-ledger")), reason: ReasonWrongIssuer},

		{name: "another backend's audience", token: minted(func(g *Grant) { g.Audience = "other-backend" }), reason: ReasonWrongAudience},
		{name: "audience override", token: minted(nil), want: &Expect{Audience: "billing-backend", Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: "run_42:step_7:refund_order"}, reason: ReasonWrongAudience},

		{name: "expired", token: minted(nil), before: func(t *testing.T, e env, _ string) { e.c.Advance(DefaultTTL + DefaultSkew) }, reason: ReasonExpired},
		{name: "expired at the call deadline", token: minted(func(g *Grant) { g.Deadline = t0.Add(10 * time.Second) }),
			before: func(t *testing.T, e env, _ string) { e.c.Advance(10*time.Second + DefaultSkew) }, reason: ReasonExpired},
		{name: "not yet valid", token: real(hdr(), with(validClaims(), "nbf", t0.Add(DefaultSkew+time.Second).Unix())), reason: ReasonNotYetValid},

		{name: "another tool's scope", token: minted(nil), want: &Expect{Scope: "tool::send_email", Tenant: "t_acme", IdempotencyKey: "run_42:step_7:refund_order"}, reason: ReasonWrongScope},
		{name: "empty expected scope", token: minted(nil), want: &Expect{Tenant: "t_acme", IdempotencyKey: "run_42:step_7:refund_order"}, reason: ReasonWrongScope},
		{name: "another tenant", token: minted(nil), want: &Expect{Scope: "tool::refund_order", Tenant: "t_other", IdempotencyKey: "run_42:step_7:refund_order"}, reason: ReasonWrongTenant},
		{name: "another call", token: minted(nil), want: &Expect{Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: "run_43:step_1:refund_order"}, reason: ReasonWrongCall},
		{name: "empty expected call", token: minted(nil), want: &Expect{Scope: "tool::refund_order", Tenant: "t_acme"}, reason: ReasonWrongCall},

		{name: "replayed for a second call", token: minted(nil), before: func(t *testing.T, e env, tok string) {
			if _, err := e.v.Verify(t.Context(), tok, expect()); err != nil {
				t.Fatalf("first presentation: %v", err)
			}
		}, want: &Expect{Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: "run_43:step_1:refund_order"}, reason: ReasonReplayed},
		{name: "replayed at another tool", token: minted(nil), before: func(t *testing.T, e env, tok string) {
			if _, err := e.v.Verify(t.Context(), tok, expect()); err != nil {
				t.Fatalf("first presentation: %v", err)
			}
		}, want: &Expect{Scope: "tool::send_email", Tenant: "t_acme", IdempotencyKey: "run_43:step_2:send_email"}, reason: ReasonReplayed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			tok := tc.token(t, e)
			if tc.before != nil {
				tc.before(t, e, tok)
			}
			want := expect()
			if tc.want != nil {
				want = *tc.want
			}
			claims, err := e.v.Verify(t.Context(), tok, want)
			if got := ReasonOf(err); got != tc.reason {
				t.Fatalf("Verify = %+v, %v; want reason %s", claims, err, tc.reason)
			}
			if _, ok := errors.AsType[*Error](err); !ok {
				t.Errorf("Verify error %T; want *Error", err)
			}
			if claims != (Claims{}) {
				t.Errorf("refused Verify returned claims %+v; want none", claims)
			}
			if tok != "" && strings.Contains(err.Error(), tok) {
				t.Errorf("error %q quotes the token", err)
			}
		})
	}
}

func TestVerifyAccepts(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		token  func(*testing.T, env) string
		before func(*testing.T, env)
	}{
		{name: "forged with the real key (control)", token: func(t *testing.T, e env) string { return forge(t, e.header(), validClaims(), e.realKey()) }},
		{name: "typ with application/ prefix", token: func(t *testing.T, e env) string {
			return forge(t, with(e.header(), "typ", "application/"+TokenType), validClaims(), e.realKey())
		}},
		{name: "typ in another case", token: func(t *testing.T, e env) string {
			return forge(t, with(e.header(), "typ", "Ledger-Credential+JWT"), validClaims(), e.realKey())
		}},
		{name: "unknown header parameter", token: func(t *testing.T, e env) string {
			return forge(t, with(e.header(), "cty", "x"), validClaims(), e.realKey())
		}},
		{name: "expired within the skew", token: func(t *testing.T, e env) string { return mint(t, e.b, grant()).Token },
			before: func(t *testing.T, e env) { e.c.Advance(DefaultTTL + DefaultSkew - time.Second) }},
		{name: "nbf within the skew", token: func(t *testing.T, e env) string {
			return forge(t, e.header(), with(validClaims(), "nbf", t0.Add(DefaultSkew).Unix()), e.realKey())
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			tok := tc.token(t, e)
			if tc.before != nil {
				tc.before(t, e)
			}
			if _, err := e.v.Verify(t.Context(), tok, expect()); err != nil {
				t.Errorf("Verify: %v; want accepted", err)
			}
		})
	}
}

func TestVerifyReplay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tok := mint(t, e.b, grant()).Token
	other := Expect{Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: "run_43:step_1:refund_order"}

	for i := range 3 {
		if _, err := e.v.Verify(t.Context(), tok, expect()); err != nil {
			t.Fatalf("presentation %d for the same call: %v; want accepted (a retry)", i+1, err)
		}
	}
	if got := ReasonOf(verifyErr(t, e.v, tok, other)); got != ReasonReplayed {
		t.Errorf("for another call: reason %q; want replayed", got)
	}
	// A refused replay does not take the jti from its call.
	if _, err := e.v.Verify(t.Context(), tok, expect()); err != nil {
		t.Errorf("same call after a refused replay: %v; want accepted", err)
	}
}

func verifyErr(t *testing.T, v *Verifier, tok string, want Expect) error {
	t.Helper()
	_, err := v.Verify(t.Context(), tok, want)
	return err
}

func TestReplayMemoryIsBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var old []string
	for i := range 5 {
		g := grant()
		g.IdempotencyKey = "k" + string(rune('0'+i))
		tok := mint(t, e.b, g).Token
		want := expect()
		want.IdempotencyKey = g.IdempotencyKey
		if _, err := e.v.Verify(t.Context(), tok, want); err != nil {
			t.Fatal(err)
		}
		old = append(old, tok)
	}
	if got := e.v.remembered(); got != 5 {
		t.Fatalf("remembered %d; want 5", got)
	}
	// One second short of forgetting: a new acceptance purges nothing.
	e.c.Advance(DefaultTTL + DefaultSkew - time.Second)
	g := grant()
	if _, err := e.v.Verify(t.Context(), mint(t, e.b, g).Token, expect()); err != nil {
		t.Fatal(err)
	}
	if got := e.v.remembered(); got != 6 {
		t.Errorf("remembered %d before the old jtis expire; want 6", got)
	}
	e.c.Advance(time.Second)
	g.IdempotencyKey = "fresh"
	want := expect()
	want.IdempotencyKey = "fresh"
	if _, err := e.v.Verify(t.Context(), mint(t, e.b, g).Token, want); err != nil {
		t.Fatal(err)
	}
	if got := e.v.remembered(); got != 2 {
		t.Errorf("remembered %d after the first five expired; want 2", got)
	}
	// A forgotten jti is refused as expired, never accepted again.
	if got := ReasonOf(verifyErr(t, e.v, old[0], Expect{Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: "other"})); got != ReasonExpired {
		t.Errorf("forgotten jti: reason %q; want expired", got)
	}
}

// A spent credential (Spend, as a tool that does not deduplicate calls it
// with its effect) is refused spent in its scope, retries of its own call
// included, until it expires; before it is spent, the same call's retries
// (after an answer that applied nothing) are accepted, and the call's
// other credentials (a status lookup's) are never refused for it.
func TestVerifySpent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cred := mint(t, e.b, grant())
	// Refused before any effect (a 429, say), then sent again: accepted.
	for i := range 2 {
		if _, err := e.v.Verify(t.Context(), cred.Token, expect()); err != nil {
			t.Fatalf("presentation %d before the effect: %v; want accepted", i+1, err)
		}
	}
	c, err := e.v.Verify(t.Context(), cred.Token, expect())
	if err != nil {
		t.Fatal(err)
	}
	if err := e.v.Spend(c); err != nil {
		t.Fatalf("Spend: %v", err)
	}
	for i := range 2 {
		err := verifyErr(t, e.v, cred.Token, expect())
		if got := ReasonOf(err); got != ReasonSpent {
			t.Errorf("presentation %d after the effect: reason %q (%v); want spent", i+1, got, err)
		}
		if err != nil && strings.Contains(err.Error(), cred.Token) {
			t.Errorf("error %q quotes the token", err)
		}
	}
	// Verified at once by two requests, spent by the first: the second
	// applies nothing.
	if got := ReasonOf(e.v.Spend(c)); got != ReasonSpent {
		t.Errorf("Spend again: reason %q; want spent", got)
	}
	// For another call it is still a replay, whatever else.
	other := expect()
	other.IdempotencyKey = "run_43:step_1:refund_order"
	if got := ReasonOf(verifyErr(t, e.v, cred.Token, other)); got != ReasonReplayed {
		t.Errorf("for another call: reason %q; want replayed", got)
	}

	// The reconciler's status lookup: a credential of its own, with the
	// status scope.
	sg := grant()
	sg.Action = StatusScope(sg.Tool)
	lookup := expect()
	lookup.Scope = StatusScope(sg.Tool)
	status := mint(t, e.b, sg).Token
	for i := range 2 {
		if _, err := e.v.Verify(t.Context(), status, lookup); err != nil {
			t.Errorf("status lookup %d after the effect: %v; want accepted", i+1, err)
		}
	}
	// Spending is per scope: the same jti in the status scope is not
	// spent by the action's effect.
	sg.JTI = cred.JTI
	if _, err := e.v.Verify(t.Context(), mint(t, e.b, sg).Token, lookup); err != nil {
		t.Errorf("status lookup under the spent jti: %v; want accepted", err)
	}

	// A renewal (same jti, later exp) is spent too, and stays so until it
	// expires, past the first credential's time.
	e.c.Advance(DefaultTTL)
	g := grant()
	g.JTI = cred.JTI
	renewed := mint(t, e.b, g).Token
	if got := ReasonOf(verifyErr(t, e.v, renewed, expect())); got != ReasonSpent {
		t.Errorf("renewal: reason %q; want spent", got)
	}
	e.c.Advance(DefaultSkew)
	g.JTI = ""
	fresh := mint(t, e.b, g).Token // its acceptance purges what is past
	if _, err := e.v.Verify(t.Context(), fresh, Expect{Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: g.IdempotencyKey}); err != nil {
		t.Fatal(err)
	}
	if got := ReasonOf(verifyErr(t, e.v, renewed, expect())); got != ReasonSpent {
		t.Errorf("renewal past the first credential's exp: reason %q; want spent", got)
	}
}

// Presentations of one credential verified at once: Spend lets one of
// them have its effect.
func TestSpendOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tok := mint(t, e.b, grant()).Token
	const n = 16
	var spent atomic.Int32
	errs := make(chan error, n)
	for range n {
		go func() {
			c, err := e.v.Verify(context.Background(), tok, expect())
			if err == nil {
				if err = e.v.Spend(c); err == nil {
					spent.Add(1)
				}
			}
			if err != nil && ReasonOf(err) != ReasonSpent {
				errs <- err
				return
			}
			errs <- nil
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Errorf("presentation: %v; want accepted or spent", err)
		}
	}
	if got := spent.Load(); got != 1 {
		t.Errorf("%d presentations spent the credential; want 1", got)
	}
}

func TestSpendRefusesUnverifiedClaims(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	if got := ReasonOf(e.v.Spend(Claims{})); got != ReasonMalformed {
		t.Errorf("Spend(Claims{}): reason %q; want malformed", got)
	}
	if got := e.v.remembered(); got != 0 {
		t.Errorf("remembered %d; want 0", got)
	}
}

// Spent jtis are remembered as accepted ones are: until their exp plus
// the skew, then dropped; dropped, they are refused as expired.
func TestSpentMemoryIsBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var old []string
	for i := range 3 {
		g := grant()
		g.IdempotencyKey = "k" + string(rune('0'+i))
		tok := mint(t, e.b, g).Token
		want := expect()
		want.IdempotencyKey = g.IdempotencyKey
		c, err := e.v.Verify(t.Context(), tok, want)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.v.Spend(c); err != nil {
			t.Fatal(err)
		}
		old = append(old, tok)
	}
	if got := e.v.remembered(); got != 3 {
		t.Fatalf("remembered %d; want 3", got)
	}
	// One second short of their time: kept, and still spent.
	e.c.Advance(DefaultTTL + DefaultSkew - time.Second)
	g := grant()
	c, err := e.v.Verify(t.Context(), mint(t, e.b, g).Token, expect())
	if err != nil {
		t.Fatal(err)
	}
	if err := e.v.Spend(c); err != nil {
		t.Fatal(err)
	}
	if got := e.v.remembered(); got != 4 {
		t.Errorf("remembered %d before the spent jtis expire; want 4", got)
	}
	if got := ReasonOf(verifyErr(t, e.v, old[0], Expect{Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: "k0"})); got != ReasonSpent {
		t.Errorf("spent jti within its time: reason %q; want spent", got)
	}
	e.c.Advance(time.Second)
	g.IdempotencyKey = "fresh"
	c, err = e.v.Verify(t.Context(), mint(t, e.b, g).Token, Expect{Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: "fresh"})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.v.Spend(c); err != nil {
		t.Fatal(err)
	}
	if got := e.v.remembered(); got != 2 {
		t.Errorf("remembered %d after the first three expired; want 2", got)
	}
	if got := ReasonOf(verifyErr(t, e.v, old[0], Expect{Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: "k0"})); got != ReasonExpired {
		t.Errorf("forgotten spent jti: reason %q; want expired", got)
	}
}

func TestVerifierNoAudience(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{})
	v, err := NewVerifier(VerifierConfig{Keys: b.Keys, Now: c.Now})
	if err != nil {
		t.Fatal(err)
	}
	if got := ReasonOf(verifyErr(t, v, mint(t, b, grant()).Token, expect())); got != ReasonWrongAudience {
		t.Errorf("verifier without an audience: reason %q; want wrong_audience", got)
	}
	g := grant()
	g.Audience = ""
	if _, err := b.Mint(g); !errors.Is(err, ErrInvalidGrant) {
		t.Errorf("Mint without an audience: %v; want ErrInvalidGrant", err)
	}
}

func TestVerifierKeyRefresh(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{RotateEvery: time.Hour})
	var fetches atomic.Int32
	v := newVerifier(t, c, b, VerifierConfig{
		CacheFor: 24 * time.Hour, // only an unknown kid makes it fetch
		Keys: func(ctx context.Context) ([]byte, error) {
			fetches.Add(1)
			return b.JWKS(), nil
		},
	})
	check := func(step string, wantFetches int32) {
		t.Helper()
		if got := fetches.Load(); got != wantFetches {
			t.Errorf("%s: %d fetches; want %d", step, got, wantFetches)
		}
	}
	present := func(tok string) error {
		t.Helper()
		_, claims := segments(t, tok)
		want := expect()
		want.IdempotencyKey = claims["idempotency_key"].(string)
		return verifyErr(t, v, tok, want)
	}
	mintKey := func(key string) string {
		g := grant()
		g.IdempotencyKey = key
		return mint(t, b, g).Token
	}

	if err := present(mintKey("a")); err != nil {
		t.Fatal(err)
	}
	check("first verify", 1)
	if err := present(mintKey("b")); err != nil {
		t.Fatal(err)
	}
	check("cached", 1)

	c.Advance(time.Hour)
	b.JWKS() // publishes the next key, which signs a minute later
	c.Advance(time.Minute)
	if err := present(mintKey("c")); err != nil { // signed by a rotated key
		t.Errorf("token of a freshly rotated key: %v; want accepted after a refresh", err)
	}
	check("unknown kid after rotation", 2)

	pub, sign := attackerKey(t)
	bogus := forge(t, map[string]any{"alg": "EdDSA", "typ": TokenType, "kid": thumbprint(pub)}, validClaims(), sign)
	for range 5 {
		if got := ReasonOf(present(bogus)); got != ReasonUnknownKid {
			t.Errorf("made-up kid: reason %q; want unknown_kid", got)
		}
	}
	check("made-up kids within MinRefresh", 2)
	c.Advance(time.Second)
	if got := ReasonOf(present(bogus)); got != ReasonUnknownKid {
		t.Errorf("made-up kid: reason %q; want unknown_kid", got)
	}
	check("made-up kid after MinRefresh", 3)
}

// A caller does not wait for a key-set fetch past its own deadline: the
// fetch goes on without it, and callers after it share it.
func TestVerifierFetchLeftByItsCaller(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{})
	release := make(chan struct{})
	var fetches atomic.Int32
	v := newVerifier(t, c, b, VerifierConfig{Keys: func(context.Context) ([]byte, error) {
		fetches.Add(1)
		<-release
		return b.JWKS(), nil
	}})
	tok := mint(t, b, grant()).Token
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := v.Verify(ctx, tok, expect())
	if ReasonOf(err) != ReasonKeysUnavailable || !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 5*time.Second {
		t.Errorf("Verify during a hanging fetch = %v after %s; want keys_unavailable at its deadline", err, time.Since(start))
	}
	close(release)
	if err := verifyErr(t, v, tok, expect()); err != nil {
		t.Errorf("after the fetch: %v; want accepted", err)
	}
	if n := fetches.Load(); n != 1 {
		t.Errorf("%d fetches; want 1, shared", n)
	}
}

func TestVerifierKeysUnavailable(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{})
	var fail atomic.Bool
	fail.Store(true)
	var fetches atomic.Int32
	v := newVerifier(t, c, b, VerifierConfig{Keys: func(ctx context.Context) ([]byte, error) {
		fetches.Add(1)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if fail.Load() {
			return nil, errors.New("key server down")
		}
		return b.JWKS(), nil
	}})
	tok := mint(t, b, grant()).Token

	err := verifyErr(t, v, tok, expect())
	if got := ReasonOf(err); got != ReasonKeysUnavailable {
		t.Fatalf("reason %q (%v); want keys_unavailable", got, err)
	}
	fail.Store(false)
	if got := ReasonOf(verifyErr(t, v, tok, expect())); got != ReasonKeysUnavailable {
		t.Errorf("within MinRefresh of a failure: reason %q; want keys_unavailable (no new fetch)", got)
	}
	if n := fetches.Load(); n != 1 {
		t.Errorf("%d fetches; want 1", n)
	}
	c.Advance(DefaultMinRefresh)
	if err := verifyErr(t, v, tok, expect()); err != nil {
		t.Errorf("after the key server recovered: %v; want accepted", err)
	}

	// A fetch runs to its end and counts whoever asked for it gave up:
	// callers that hang up at once do not start a fetch each, past
	// MinRefresh, and the next caller has the set.
	c.Advance(DefaultCacheFor)
	before := fetches.Load()
	for range 5 {
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		_, _ = v.Verify(ctx, tok, expect())
	}
	// The fetch goes on without them.
	for deadline := time.Now().Add(5 * time.Second); fetches.Load()-before < 1 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if n := fetches.Load() - before; n != 1 {
		t.Errorf("%d fetches for 5 callers that gave up within MinRefresh; want 1", n)
	}
	if err := verifyErr(t, v, tok, expect()); err != nil {
		t.Errorf("next caller after fetches whose callers gave up: %v; want accepted", err)
	}
	if n := fetches.Load() - before; n != 1 {
		t.Errorf("%d fetches after the next caller; want still 1", n)
	}

	// A stale set is not used when its refresh fails.
	c.Advance(DefaultCacheFor)
	fail.Store(true)
	if got := ReasonOf(verifyErr(t, v, tok, expect())); got != ReasonKeysUnavailable {
		t.Errorf("stale set, refresh failing: reason %q; want keys_unavailable", got)
	}
}

func TestVerifierJWKSURL(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{})
	srv := httptest.NewServer(b.Handler())
	t.Cleanup(srv.Close)
	v := newVerifier(t, c, b, VerifierConfig{JWKSURLs: []string{srv.URL + JWKSPath}})
	if err := verifyErr(t, v, mint(t, b, grant()).Token, expect()); err != nil {
		t.Errorf("Verify with keys from the broker's handler: %v", err)
	}

	broken := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(broken.Close)
	v = newVerifier(t, c, b, VerifierConfig{JWKSURLs: []string{broken.URL + JWKSPath}})
	err := verifyErr(t, v, mint(t, b, grant()).Token, expect())
	if ReasonOf(err) != ReasonKeysUnavailable || !strings.Contains(err.Error(), "status 404") {
		t.Errorf("Verify with a key server answering 404: %v; want keys_unavailable naming the status", err)
	}

	// A redirect is not followed, even to the broker's own keys: its
	// target was never checked (plain http off loopback, say), and
	// whoever answers there could serve keys of their own.
	moved := httptest.NewServer(http.RedirectHandler(srv.URL+JWKSPath, http.StatusMovedPermanently))
	t.Cleanup(moved.Close)
	v = newVerifier(t, c, b, VerifierConfig{JWKSURLs: []string{moved.URL + JWKSPath}})
	err = verifyErr(t, v, mint(t, b, grant()).Token, expect())
	if ReasonOf(err) != ReasonKeysUnavailable || !strings.Contains(err.Error(), "status 301") {
		t.Errorf("Verify with a key URL that redirects: %v; want keys_unavailable naming the redirect", err)
	}
}

// TestVerifierSeveralBrokers: every executor and the reconciler mint with
// keys of their own, published at their own URL, so a backend lists them
// all. A token of any of them verifies, across rotations, and one broker's
// key server being down refuses only that broker's tokens.
func TestVerifierSeveralBrokers(t *testing.T) {
	t.Parallel()
	c := newClock()
	brokers := []*Broker{newBroker(t, c, Config{RotateEvery: time.Hour}), newBroker(t, c, Config{RotateEvery: time.Hour})}
	var down atomic.Bool // the second broker's key server
	urls := keyServers(t, brokers, func(w http.ResponseWriter, _ *http.Request) bool {
		if !down.Load() {
			return false
		}
		http.Error(w, "down", http.StatusServiceUnavailable)
		return true
	})
	v := newVerifier(t, c, nil, VerifierConfig{JWKSURLs: urls})
	calls := 0
	// mint returns a token of broker i for a call of its own, and its kid.
	mint := func(i int) (Credential, Expect) {
		t.Helper()
		calls++
		g := grant()
		g.IdempotencyKey = fmt.Sprintf("call-%d", calls)
		want := expect()
		want.IdempotencyKey = g.IdempotencyKey
		cred, err := brokers[i].Mint(g)
		if err != nil {
			t.Fatalf("Mint: %v", err)
		}
		return cred, want
	}
	kidOf := func(cred Credential) string {
		h, _ := segments(t, cred.Token)
		return h["kid"].(string)
	}

	var before []Credential
	for i := range brokers {
		cred, want := mint(i)
		if err := verifyErr(t, v, cred.Token, want); err != nil {
			t.Errorf("token of broker %d: %v; want accepted", i, err)
		}
		before = append(before, cred)
	}

	// Both brokers rotate (each publishes its next key, then signs with
	// it a minute later); their new keys verify.
	c.Advance(2 * time.Hour)
	for _, b := range brokers {
		b.JWKS()
	}
	c.Advance(time.Minute)
	var after []Credential
	var wants []Expect
	for i := range brokers {
		cred, want := mint(i)
		if kidOf(cred) == kidOf(before[i]) {
			t.Fatalf("broker %d did not rotate", i)
		}
		after, wants = append(after, cred), append(wants, want)
	}
	for i, cred := range after {
		if err := verifyErr(t, v, cred.Token, wants[i]); err != nil {
			t.Errorf("token of broker %d after its rotation: %v; want accepted", i, err)
		}
	}

	// The second key server goes down and both cached sets age out: the
	// first broker's tokens still verify; the second's, and a kid no set
	// at hand holds, are keys_unavailable (503), not unknown_kid (401).
	down.Store(true)
	c.Advance(DefaultCacheFor)
	first, wantFirst := mint(0)
	if err := verifyErr(t, v, first.Token, wantFirst); err != nil {
		t.Errorf("token of the first broker, the second's key server down: %v; want accepted", err)
	}
	second, wantSecond := mint(1)
	if got := ReasonOf(verifyErr(t, v, second.Token, wantSecond)); got != ReasonKeysUnavailable {
		t.Errorf("token of the broker whose key server is down: reason %q; want keys_unavailable", got)
	}
	down.Store(false)
	c.Advance(DefaultMinRefresh)
	if err := verifyErr(t, v, second.Token, wantSecond); err != nil {
		t.Errorf("token of the second broker, its key server back: %v; want accepted", err)
	}

	// Given only the first broker's URL (all there was before), the
	// second broker's tokens are refused.
	one := newVerifier(t, c, nil, VerifierConfig{JWKSURLs: urls[:1]})
	cred, want := mint(1)
	if got := ReasonOf(verifyErr(t, one, cred.Token, want)); got != ReasonUnknownKid {
		t.Errorf("token of a broker not listed: reason %q; want unknown_kid", got)
	}
}

// TestVerifierHungBroker: a key server that hangs (a dead executor's, its
// packets dropped) delays only the tokens no other set verifies. A refetch
// returns once a set holding the kid is in, not at the hung fetch's
// timeout.
func TestVerifierHungBroker(t *testing.T) {
	t.Parallel()
	c := newClock()
	brokers := []*Broker{newBroker(t, c, Config{}), newBroker(t, c, Config{})}
	release := make(chan struct{})
	var hung atomic.Bool // the second broker's key server
	urls := keyServers(t, brokers, func(w http.ResponseWriter, r *http.Request) bool {
		if !hung.Load() {
			return false
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
		http.Error(w, "hung", http.StatusServiceUnavailable)
		return true
	})
	// Runs before the servers close, which wait for their handlers.
	t.Cleanup(func() { close(release) })
	v := newVerifier(t, c, nil, VerifierConfig{JWKSURLs: urls})
	present := func(i int, key string) (string, Expect) {
		t.Helper()
		g := grant()
		g.IdempotencyKey = key
		want := expect()
		want.IdempotencyKey = key
		return mint(t, brokers[i], g).Token, want
	}
	for i := range brokers { // both sets fetched
		tok, want := present(i, fmt.Sprintf("call-%d", i))
		if err := verifyErr(t, v, tok, want); err != nil {
			t.Fatalf("token of broker %d: %v; want accepted", i, err)
		}
	}

	hung.Store(true)
	c.Advance(DefaultCacheFor) // both sets too old: both are fetched again
	tok, want := present(0, "call-after")
	done := make(chan error, 1)
	go func() {
		_, err := v.Verify(t.Context(), tok, want)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("token of the first broker, the second's key server hung: %v; want accepted", err)
		}
	case <-time.After(3 * time.Second): // a hang check: the fetch timeout is 10 s
		t.Fatal("token of the first broker still waits on the second's hung key server after 3 s; want it verified once the first's set is in")
	}
}

func TestVerifierConfigValidation(t *testing.T) {
	t.Parallel()
	keys := func(context.Context) ([]byte, error) { return nil, nil }
	tests := []struct {
		name    string
		cfg     VerifierConfig
		wantErr bool
	}{
		{name: "keys func", cfg: VerifierConfig{Keys: keys}},
		{name: "https", cfg: VerifierConfig{JWKSURLs: []string{"https://ledger.example/.well-known/jwks.json"}}},
		{name: "http on loopback", cfg: VerifierConfig{JWKSURLs: []string{"http://127.0.0.1:8080/.well-known/jwks.json"}}},
		{name: "http on localhost", cfg: VerifierConfig{JWKSURLs: []string{"http://localhost:8080/.well-known/jwks.json"}}},
		{name: "http elsewhere, allowed", cfg: VerifierConfig{JWKSURLs: []string{"http://ledger:8080/.well-known/jwks.json"}, AllowInsecureHTTP: true}},
		{name: "http elsewhere", cfg: VerifierConfig{JWKSURLs: []string{"http://ledger:8080/.well-known/jwks.json"}}, wantErr: true},
		{name: "neither", cfg: VerifierConfig{}, wantErr: true},
		{name: "keys and URLs", cfg: VerifierConfig{Keys: keys, JWKSURLs: []string{"https://ledger.example/jwks.json"}}},
		{name: "several URLs", cfg: VerifierConfig{JWKSURLs: []string{"https://executor-0.executor:8443/.well-known/jwks.json", "https://executor-1.executor:8443/.well-known/jwks.json"}}},
		{name: "one of several over http elsewhere", cfg: VerifierConfig{JWKSURLs: []string{"https://executor-0.executor:8443/.well-known/jwks.json", "http://executor-1.executor:8443/.well-known/jwks.json"}}, wantErr: true},
		{name: "an empty URL in the list", cfg: VerifierConfig{JWKSURLs: []string{"https://executor-0.executor:8443/.well-known/jwks.json", ""}}, wantErr: true},
		{name: "relative URL", cfg: VerifierConfig{JWKSURLs: []string{"/.well-known/jwks.json"}}, wantErr: true},
		{name: "file URL", cfg: VerifierConfig{JWKSURLs: []string{"file:///etc/jwks.json"}}, wantErr: true},
		{name: "negative skew", cfg: VerifierConfig{Keys: keys, Skew: -time.Second}, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := NewVerifier(tc.cfg)
			if got := errors.Is(err, ErrInvalidConfig); got != tc.wantErr {
				t.Errorf("NewVerifier error = %v; want ErrInvalidConfig: %v", err, tc.wantErr)
			}
		})
	}
}

func TestParseJWKS(t *testing.T) {
	t.Parallel()
	pub, _ := attackerKey(t)
	good := publicJWK(thumbprint(pub), pub)
	tests := []struct {
		name     string
		set      any
		wantKids []string
		wantErr  bool
	}{
		{name: "one key", set: jwkSet{Keys: []jwk{good}}, wantKids: []string{good.Kid}},
		{name: "other key types skipped", set: map[string]any{"keys": []any{
			map[string]any{"kty": "RSA", "kid": "rsa", "n": "xx", "e": "AQAB"},
			map[string]any{"kty": "OKP", "crv": "X25519", "kid": "ecdh", "x": good.X},
			map[string]any{"kty": "OKP", "crv": "Ed25519", "kid": "enc", "x": good.X, "use": "enc"},
			good,
		}}, wantKids: []string{good.Kid}},
		{name: "no usable key", set: map[string]any{"keys": []any{}}, wantErr: true},
		{name: "duplicate kid", set: jwkSet{Keys: []jwk{good, good}}, wantErr: true},
		{name: "short x", set: jwkSet{Keys: []jwk{{Kty: "OKP", Crv: "Ed25519", Kid: "k", X: "AAAA"}}}, wantErr: true},
		{name: "no kid", set: jwkSet{Keys: []jwk{{Kty: "OKP", Crv: "Ed25519", X: good.X}}}, wantErr: true},
		{name: "not JSON", set: "{", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, ok := tc.set.(string)
			if !ok {
				raw, err := json.Marshal(tc.set)
				if err != nil {
					t.Fatal(err)
				}
				b = string(raw)
			}
			keys, err := parseJWKS([]byte(b))
			if (err != nil) != tc.wantErr {
				t.Fatalf("parseJWKS error = %v; want error: %v", err, tc.wantErr)
			}
			var kids []string
			for kid := range keys {
				kids = append(kids, kid)
			}
			if len(kids) != len(tc.wantKids) || (len(kids) == 1 && kids[0] != tc.wantKids[0]) {
				t.Errorf("kids = %v; want %v", kids, tc.wantKids)
			}
		})
	}
}

// keyServers serves each broker's keys at a URL of its own and returns
// the URLs. The second broker's requests go to second first, which
// answers them itself when it reports true (a key server down, hung).
func keyServers(t *testing.T, brokers []*Broker, second func(w http.ResponseWriter, r *http.Request) bool) []string {
	t.Helper()
	var urls []string
	for i, b := range brokers {
		h := b.Handler()
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if i == 1 && second(w, r) {
				return
			}
			h.ServeHTTP(w, r)
		}))
		t.Cleanup(srv.Close)
		urls = append(urls, srv.URL+JWKSPath)
	}
	return urls
}
