package credentials

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// newInspector is a verifier with no audience, as an introspection
// endpoint holds one.
func newInspector(t *testing.T, c *clock, b *Broker) *Verifier {
	t.Helper()
	v, err := NewVerifier(VerifierConfig{Keys: b.Keys, Now: c.Now})
	if err != nil {
		t.Fatalf("NewVerifier: %v", err)
	}
	return v
}

func TestInspectAccepts(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		grant func(*Grant)
	}{
		{name: "a minted credential"},
		// Inspect answers for every backend: the audience is not its
		// business.
		{name: "any audience", grant: func(g *Grant) { g.Audience = "billing-backend" }},
		{name: "any scope", grant: func(g *Grant) { g.Action = "tool::send_email" }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newClock()
			b := newBroker(t, c, Config{})
			v := newInspector(t, c, b)
			g := grant()
			if tc.grant != nil {
				tc.grant(&g)
			}
			cred := mint(t, b, g)
			got, err := v.Inspect(t.Context(), cred.Token)
			if err != nil {
				t.Fatalf("Inspect = %v; want the claims", err)
			}
			want := Claims{
				JTI: cred.JTI, Family: cred.Family, Scope: cred.Scope, ExpiresAt: cred.ExpiresAt,
				Audience: g.Audience, Tenant: g.Tenant, Subject: g.User, IdempotencyKey: g.IdempotencyKey,
			}
			pick := func(c Claims) Claims {
				return Claims{
					JTI: c.JTI, Family: c.Family, Scope: c.Scope, ExpiresAt: c.ExpiresAt,
					Audience: c.Audience, Tenant: c.Tenant, Subject: c.Subject, IdempotencyKey: c.IdempotencyKey,
				}
			}
			if diff := cmp.Diff(want, pick(got)); diff != "" {
				t.Errorf("Inspect claims (-want +got):\n%s", diff)
			}
		})
	}
}

func TestInspectRemembersNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cred := mint(t, e.b, grant())
	for i := range 3 {
		if _, err := e.v.Inspect(t.Context(), cred.Token); err != nil {
			t.Fatalf("Inspect #%d = %v; want accepted", i+1, err)
		}
	}
	if n := e.v.remembered(); n != 0 {
		t.Errorf("after Inspect the verifier remembers %d jtis; want 0", n)
	}
	// The backend still accepts the credential for its call once it was
	// inspected: inspection is not a presentation.
	if _, err := e.v.Verify(t.Context(), cred.Token, expect()); err != nil {
		t.Errorf("Verify after Inspect = %v; want accepted", err)
	}
}

func TestInspectRefuses(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		token  func(*testing.T, env) string
		before func(env)
		reason Reason
	}{
		{name: "no token", token: func(*testing.T, env) string { return "" }, reason: ReasonMissingToken},
		{name: "not a JWS", token: func(*testing.T, env) string { return "e30.e30" }, reason: ReasonMalformed},
		{name: "expired", token: func(t *testing.T, e env) string { return mint(t, e.b, grant()).Token },
			before: func(e env) { e.c.Advance(DefaultTTL + DefaultSkew) }, reason: ReasonExpired},
		{name: "not yet valid", token: func(t *testing.T, e env) string {
			return forge(t, e.header(), with(validClaims(), "nbf", t0.Add(DefaultSkew+time.Second).Unix()), e.realKey())
		}, reason: ReasonNotYetValid},
		{name: "another issuer", token: func(t *testing.T, e env) string {
			return forge(t, e.header(), with(validClaims(), "iss", "another-ledger"), e.realKey())
		}, reason: ReasonWrongIssuer},
		{name: "another key under the real kid", token: func(t *testing.T, e env) string {
			_, sign := attackerKey(t)
			return forge(t, e.header(), validClaims(), sign)
		}, reason: ReasonBadSignature},
		{name: "tampered claims", token: func(t *testing.T, e env) string {
			p := strings.Split(mint(t, e.b, grant()).Token, ".")
			forged := strings.Split(forge(t, "{}", with(validClaims(), "scope", "tool::delete_everything"), nil), ".")
			return p[0] + "." + forged[1] + "." + p[2]
		}, reason: ReasonBadSignature},
		{name: "unknown kid", token: func(t *testing.T, e env) string {
			pub, sign := attackerKey(t)
			return forge(t, with(e.header(), "kid", thumbprint(pub)), validClaims(), sign)
		}, reason: ReasonUnknownKid},
		{name: "alg none", token: func(t *testing.T, e env) string {
			return forge(t, with(e.header(), "alg", "none"), validClaims(), nil)
		}, reason: ReasonAlgNotAllowed},
		{name: "no jti", token: func(t *testing.T, e env) string {
			return forge(t, e.header(), with(validClaims(), "jti", nil), e.realKey())
		}, reason: ReasonMalformed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newClock()
			b := newBroker(t, c, Config{})
			e := env{c: c, b: b, v: newInspector(t, c, b)}
			tok := tc.token(t, e)
			if tc.before != nil {
				tc.before(e)
			}
			claims, err := e.v.Inspect(t.Context(), tok)
			if got := ReasonOf(err); got != tc.reason {
				t.Fatalf("Inspect = %+v, %v; want reason %s", claims, err, tc.reason)
			}
			if _, ok := errors.AsType[*Error](err); !ok {
				t.Errorf("Inspect error %T; want *Error", err)
			}
			if claims != (Claims{}) {
				t.Errorf("refused Inspect returned claims %+v; want none", claims)
			}
			if tok != "" && strings.Contains(err.Error(), tok) {
				t.Errorf("error %q quotes the token", err)
			}
		})
	}
}

// TestVerifyStillChecksAudience guards the refactoring that Inspect shares
// with Verify: an empty audience still refuses every credential in Verify.
func TestVerifyStillChecksAudience(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{})
	v := newInspector(t, c, b)
	cred := mint(t, b, grant())
	if _, err := v.Verify(t.Context(), cred.Token, expect()); ReasonOf(err) != ReasonWrongAudience {
		t.Errorf("Verify with no audience = %v; want %s", err, ReasonWrongAudience)
	}
}
