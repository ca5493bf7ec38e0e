package processors_test

// Issue 3 end to end: who asks comes from the verified assertion only,
// policies decide, obligations are carried out, and no secret leaks.

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
)

var b64 = base64.RawURLEncoding

// rawToken builds a compact JWS with any header, for attacks that the
// verifier must refuse before it looks at the signature.
func rawToken(t *testing.T, header map[string]any, claims any) string {
	t.Helper()
	h, _ := json.Marshal(header)
	c, _ := json.Marshal(claims)
	return b64.EncodeToString(h) + "." + b64.EncodeToString(c) + "." + b64.EncodeToString([]byte("not a signature"))
}

// Every RFC 8725 attack class is refused at the intake with a precise
// reason; none is accepted, none reaches a tool.
func TestAssertionAttacksRefused(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))
	key := h.ident.Key
	valid := processorstest.Claims("t_a", "u_1")
	sign := func(typ string, mutate func(*identity.Claims)) string {
		c := processorstest.Claims("t_a", "u_1")
		mutate(&c)
		tok, err := token.Sign(key, typ, c)
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	hdr := func(alg string, extra map[string]any) map[string]any {
		m := map[string]any{"alg": alg, "typ": identity.TypeAssertion, "kid": key.ID}
		for k, v := range extra {
			m[k] = v
		}
		return m
	}
	honest := sign(identity.TypeAssertion, func(*identity.Claims) {})
	parts := strings.Split(honest, ".")
	otherTenant := processorstest.Claims("t_b", "u_1")
	otherPayload, _ := json.Marshal(otherTenant)

	cases := []struct {
		name, assertion, reason string
	}{
		{"alg none", rawToken(t, hdr("none", nil), valid), token.ReasonAlgNotAllowed},
		{"alg None", rawToken(t, hdr("None", nil), valid), token.ReasonAlgNotAllowed},
		{"HS256 with the public key as secret", rawToken(t, hdr("HS256", nil), valid), token.ReasonAlgNotAllowed},
		{"foreign audience", sign(identity.TypeAssertion, func(c *identity.Claims) { c.Audience = token.Audience{"another-service"} }), token.ReasonAudienceMismatch},
		{"wrong issuer", sign(identity.TypeAssertion, func(c *identity.Claims) { c.Issuer = "https://evil.test" }), token.ReasonIssuerMismatch},
		{"expired", sign(identity.TypeAssertion, func(c *identity.Claims) {
			c.IssuedAt = token.NewNumericDate(time.Now().Add(-2 * time.Hour))
			c.NotBefore = c.IssuedAt
			c.ExpiresAt = token.NewNumericDate(time.Now().Add(-time.Hour))
		}), token.ReasonExpired},
		{"valid for ten years", sign(identity.TypeAssertion, func(c *identity.Claims) {
			c.ExpiresAt = token.NewNumericDate(time.Now().AddDate(10, 0, 0))
		}), identity.ReasonLifetimeTooLong},
		{"valid for ten years, no iat", sign(identity.TypeAssertion, func(c *identity.Claims) {
			c.IssuedAt = nil
			c.ExpiresAt = token.NewNumericDate(time.Now().AddDate(10, 0, 0))
		}), identity.ReasonLifetimeTooLong},
		{"not yet valid", sign(identity.TypeAssertion, func(c *identity.Claims) {
			c.NotBefore = token.NewNumericDate(time.Now().Add(time.Hour))
		}), token.ReasonNotYetValid},
		{"unknown kid", rawToken(t, map[string]any{"alg": "EdDSA", "typ": identity.TypeAssertion, "kid": "someone-elses"}, valid), token.ReasonUnknownKID},
		{"jku elsewhere", rawToken(t, hdr("EdDSA", map[string]any{"jku": "https://evil.test/jwks.json"}), valid), token.ReasonForbiddenHeader},
		{"x5u elsewhere", rawToken(t, hdr("EdDSA", map[string]any{"x5u": "https://evil.test/cert.pem"}), valid), token.ReasonForbiddenHeader},
		{"wrong typ", sign("JWT", func(*identity.Claims) {}), token.ReasonTypMismatch},
		// Refused by the envelope's schema, at the verifier's limit
		// (schemas.MaxAssertionBytes), before any verifier reads it.
		{"oversized", sign(identity.TypeAssertion, func(c *identity.Claims) { c.Purpose = strings.Repeat("p", 9000) }), string(ledger.CodeInvalidEnvelope)},
		{"payload swapped after signing", parts[0] + "." + b64.EncodeToString(otherPayload) + "." + parts[2], token.ReasonBadSignature},
		{"missing", "", identity.ReasonMissingAssertion},
	}
	for i, tc := range cases {
		e := h.newEnvelope("t_a", fmt.Sprintf("attack-%02d", i), "get_weather", map[string]any{"city": "Oslo"})
		e.Assertion = tc.assertion
		h.submit(e)
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			k := ledger.CallKey{TenantID: ledger.UnverifiedTenant, IdempotencyKey: fmt.Sprintf("attack-%02d", i)}
			ref := h.waitRefused(30*time.Second, k)
			if c, err := h.index.Get(ledger.CallKey{TenantID: "t_a", IdempotencyKey: k.IdempotencyKey}); err == nil {
				t.Errorf("an unverified envelope left a record under the tenant it claimed: %+v", c)
			}
			want := intake.ReasonAssertionPrefix + tc.reason
			if tc.reason == string(ledger.CodeInvalidEnvelope) {
				want = tc.reason
			}
			if ref.Reason != want || ref.Pointer != "/assertion" {
				t.Errorf("refusal %s at %q; want %s at /assertion", ref.Reason, ref.Pointer, want)
			}
			if c, _ := h.index.Get(k); len(c.Events) != 0 {
				t.Errorf("an attack started a call: %s", eventTypes(c.Events))
			}
		})
	}
	if n := h.backend.Requests(); n != 0 {
		t.Errorf("tools received %d requests; want 0", n)
	}
}

// The scope is a claim: one that disagrees with the assertion is refused,
// under the verified tenant, and no call ever runs for the claimed tenant.
func TestForgedScopeGivesNoCrossTenantExecution(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))

	// An agent of t_a claims t_b in the scope (and hashes for t_b).
	forged := h.newEnvelope("t_b", "forged-tenant", "create_ticket", map[string]any{"title": "x"})
	forged.Assertion = h.ident.Assertion(t, "t_a", "u_1")
	// An agent claims to act for another user.
	otherUser := h.newEnvelope("t_a", "forged-user", "create_ticket", map[string]any{"title": "x"})
	otherUser.Scope["user_id"] = "u_admin"
	h.submit(forged, otherUser)

	for _, tc := range []struct {
		key     ledger.CallKey
		pointer string
	}{
		{ledger.CallKey{TenantID: "t_a", IdempotencyKey: "forged-tenant"}, "/scope/tenant_id"},
		{ledger.CallKey{TenantID: "t_a", IdempotencyKey: "forged-user"}, "/scope/user_id"},
	} {
		ref := h.waitRefused(30*time.Second, tc.key)
		if ref.Reason != intake.ReasonScopeMismatch || ref.Pointer != tc.pointer {
			t.Errorf("%s: refusal %s at %q; want scope_mismatch at %s", tc.key, ref.Reason, ref.Pointer, tc.pointer)
		}
	}
	if _, err := h.index.Get(forged.key()); err == nil {
		t.Errorf("the claimed tenant t_b has a record of the forged call")
	}
	// An honest call of t_a still runs, as t_a.
	honest := h.newEnvelope("t_a", "honest", "create_ticket", map[string]any{"title": "x"})
	h.submit(honest)
	h.waitSettled(30*time.Second, honest.key())
	for _, e := range h.backend.Effects() {
		if e.TenantID != "t_a" {
			t.Errorf("an effect ran for tenant %q", e.TenantID)
		}
	}
	if n := h.backend.AppliedIn("create_ticket", "t_a", honest.key().String()); n != 1 {
		t.Errorf("honest call applied %d times; want 1", n)
	}
}

func loadSet(t *testing.T, label, src string) *policy.Set {
	t.Helper()
	set, err := policy.LoadDir(processorstest.PolicyDir(t, src), label)
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// Policies decide, versioned; a swap takes effect for the next call; an
// evaluation error denies; obligations route to approval, rate-limit and
// mask.
func TestPolicyDecisions(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))

	decide := func(key, tool string, args map[string]any) (callState string, decision ledger.Event) {
		t.Helper()
		e := h.newEnvelope("t_a", key, tool, args)
		h.submit(e)
		c := h.waitSettled(30*time.Second, e.key())[e.key()]
		return string(c.State), c.Events[1]
	}

	v1 := loadSet(t, "v1", `@id("weather") permit (principal, action == Action::"tool::get_weather", resource);`)
	h.policy.Swap(v1)
	state, d := decide("p-1", "get_weather", map[string]any{"city": "Oslo"})
	if state != "succeeded" || d.PolicyVersion != v1.Version() || d.Decision != "allow" || len(d.PolicyID) != 1 || d.PolicyID[0] != "weather" {
		t.Errorf("under v1: %s, decision %s by %v at %s; want succeeded, allow by [weather] at %s", state, d.Decision, d.PolicyID, d.PolicyVersion, v1.Version())
	}

	v2 := loadSet(t, "v2", `@id("weather") permit (principal, action == Action::"tool::get_weather", resource);
@id("no-oslo") forbid (principal, action, resource) when { context.arguments.city == "Oslo" };`)
	h.policy.Swap(v2)
	state, d = decide("p-2", "get_weather", map[string]any{"city": "Oslo"})
	if state != "denied" || d.PolicyVersion != v2.Version() || d.Reason != policy.ReasonDeniedByPolicy || len(d.PolicyID) != 1 || d.PolicyID[0] != "no-oslo" {
		t.Errorf("after the swap to v2: %s, %s by %v at %s; want denied by [no-oslo] at %s", state, d.Reason, d.PolicyID, d.PolicyVersion, v2.Version())
	}

	// A policy that cannot evaluate the call's request errs every time it
	// is asked: the call is denied, not refused for a retry that would
	// err again.
	broken := loadSet(t, "broken", `@id("weather") permit (principal, action, resource) when { context.no_such_attribute == 1 };`)
	h.policy.Swap(broken)
	state, d = decide("p-3", "get_weather", map[string]any{"city": "Bergen"})
	if state != "denied" || d.Reason != policy.ReasonPolicyError {
		t.Errorf("with an erroring policy: %s (%s); want denied, %s", state, d.Reason, policy.ReasonPolicyError)
	}

	obligations := loadSet(t, "v3", `
@id("refunds") @obligation("require_approval")
permit (principal, action == Action::"tool::refund_order", resource);
@id("weather") @rate_limit("2/m")
permit (principal, action == Action::"tool::get_weather", resource);
@id("tickets") @mask("/title")
permit (principal, action == Action::"tool::create_ticket", resource);`)
	h.policy.Swap(obligations)
	state, d = decide("p-4", "refund_order", map[string]any{"order_id": "ord_1", "amount_cents": 4500, "currency": "AUD"})
	if state != "approval_pending" || d.ExpiresAt == nil || d.Decision != "require_approval" {
		t.Errorf("refund under an approval obligation: %s, %s, expires %v; want approval_pending with an expiry", state, d.Decision, d.ExpiresAt)
	}
	if n := h.backend.Requests(); n != 1 {
		t.Errorf("tools received %d requests; want 1 (the one weather call allowed before)", n)
	}

	state, _ = decide("p-5", "create_ticket", map[string]any{"title": "secret title"})
	k5 := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "p-5"}
	c, _ := h.index.Get(k5)
	rec, err := h.store.Get(t.Context(), k5)
	if err != nil {
		t.Fatal(err)
	}
	if state != "succeeded" || strings.Contains(string(c.Events[0].Arguments), "secret title") || strings.Contains(string(rec.Result), "secret title") || !strings.Contains(string(rec.Result), ledger.Redacted) {
		t.Errorf("masked ticket: %s, audit arguments %s, result %s; want succeeded with the title masked in both", state, c.Events[0].Arguments, rec.Result)
	}

	// Two weather calls fit the limit; the third is refused with a
	// retry-after, and its key stays free.
	for i := range 3 {
		e := h.newEnvelope("t_a", fmt.Sprintf("rl-%d", i), "get_weather", map[string]any{"city": "Bergen"})
		h.submit(e)
		if i < 2 {
			h.waitSettled(30*time.Second, e.key())
			continue
		}
		ref := h.waitRefused(30*time.Second, e.key())
		if ref.Reason != intake.ReasonRateLimited || ref.RetryAfterMS <= 0 || ref.PolicyVersion != obligations.Version() {
			t.Errorf("third call: %s, retry after %dms, %s; want rate_limited with a retry-after under %s", ref.Reason, ref.RetryAfterMS, ref.PolicyVersion, obligations.Version())
		}
	}
}

// Canaries: the issuer's key, the credential broker's signing key and the
// credentials themselves never appear in any Kafka record, log line, DLQ
// entry, stored result or refusal.
func TestNoSecretLeaks(t *testing.T) {
	keyDir := t.TempDir()
	broker, err := credentials.New(credentials.Config{KeyDir: keyDir})
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := credentials.NewVerifier(credentials.VerifierConfig{Audience: demobackend.DefaultAudience, Keys: broker.Keys})
	if err != nil {
		t.Fatal(err)
	}
	// A tool's long-lived backend secret, in the executor's keystore.
	const backendCanary = "canary-backend-secret-7f3a9c"
	keystore := t.TempDir()
	if err := os.WriteFile(filepath.Join(keystore, "weather_api_key"), []byte(backendCanary), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	h := newHarness(t, storeSQL, 4, func(c *demobackend.Config) {
		c.Credentials = verifier
		c.BackendSecrets = map[string]string{"get_weather": backendCanary}
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	h.reg = processorstest.RegistryWith(t, "testdata/registry", "get_weather", func(entry map[string]any) {
		entry["backend"].(map[string]any)["secret_ref"] = "weather_api_key"
	})
	h.logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	h.startIntake("intake-1")
	cfg := h.executorConfig("executor-1")
	cfg.Credentials = broker
	cfg.Secrets = credentials.NewKeystore(keystore)
	h.startExecutor(cfg)

	ok1 := h.newEnvelope("t_a", "c-1", "get_weather", map[string]any{"city": "Oslo"})
	ok2 := h.newEnvelope("t_a", "c-2", "create_ticket", map[string]any{"title": "t"})
	bad := h.newEnvelope("t_a", "c-3", "get_weather", map[string]any{"city": "Oslo"})
	bad.Assertion = rawToken(t, map[string]any{"alg": "none", "typ": identity.TypeAssertion}, processorstest.Claims("t_a", "u_1"))
	h.submit(ok1, ok2, bad)
	h.publish("junk", []byte(`not json at all`))
	h.waitSettled(30*time.Second, ok1.key(), ok2.key())
	h.waitRefused(30*time.Second, ledger.CallKey{TenantID: ledger.UnverifiedTenant, IdempotencyKey: bad.IdempotencyKey})

	secrets := map[string]string{}
	privateD := func(label string, raw []byte) {
		var m map[string]any
		if json.Unmarshal(raw, &m) == nil {
			// A private JWK's "d", or the broker's key file "seed".
			for _, field := range []string{"d", "seed"} {
				if v, ok := m[field].(string); ok && v != "" {
					secrets[label] = v
				}
			}
		}
	}
	raw, err := os.ReadFile(h.ident.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	privateD("issuer key", raw)
	files, _ := filepath.Glob(filepath.Join(keyDir, "*"))
	for _, f := range files {
		raw, _ := os.ReadFile(f)
		privateD("signing key "+filepath.Base(f), raw)
	}
	if len(secrets) < 2 {
		t.Fatalf("found %d canaries; want the issuer's and the broker's keys", len(secrets))
	}
	secrets["backend secret"] = backendCanary

	var haystacks []struct{ where, text string }
	add := func(where string, b []byte) {
		haystacks = append(haystacks, struct{ where, text string }{where, string(b)})
	}
	cl, err := ledger.NewClient(h.kafka.Client, kgo.ConsumeTopics(h.kafka.Topics.Requests, h.kafka.Topics.Events, h.kafka.Topics.DLQ, h.kafka.Topics.Control))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
			if r.Topic != h.kafka.Topics.Requests {
				// Assertions belong in requests, nowhere else.
				if strings.Contains(string(r.Value), "eyJ") {
					t.Errorf("a token in %s: %s", r.Topic, r.Value)
				}
			}
			add(r.Topic, r.Value)
			for _, hd := range r.Headers {
				add(r.Topic+" header", hd.Value)
			}
		})
	}
	for _, k := range []ledger.CallKey{ok1.key(), ok2.key()} {
		rec, err := h.store.Get(t.Context(), k)
		if err != nil {
			t.Fatal(err)
		}
		add("result of "+k.String(), rec.Result)
		add("outbox of "+k.String(), rec.Outbox)
	}
	add("logs", logs.Bytes())
	if logs.Len() == 0 {
		t.Fatal("no logs captured: the scan would prove nothing")
	}
	for name, secret := range secrets {
		for _, hs := range haystacks {
			if strings.Contains(hs.text, secret) {
				t.Errorf("%s found in %s", name, hs.where)
			}
		}
	}
	if strings.Contains(logs.String(), "eyJ") {
		t.Errorf("a token in the logs")
	}
	if n := len(h.backend.Effects()); n != 2 {
		t.Errorf("tools applied %d effects; want 2 (credentials and the backend secret verified)", n)
	}
}
