package credentials

import (
	"bytes"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// t0 is the start of every test clock.
var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

// clock is a test clock that moves only when told.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func newClock() *clock { return &clock{now: t0} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Set moves the clock to t0 + d.
func (c *clock) Set(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t0.Add(d)
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func newBroker(t testing.TB, c *clock, cfg Config) *Broker {
	t.Helper()
	cfg.Now = c.Now
	b, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return b
}

func newVerifier(t *testing.T, c *clock, b *Broker, cfg VerifierConfig) *Verifier {
	t.Helper()
	cfg.Now = c.Now
	if cfg.Keys == nil && len(cfg.JWKSURLs) == 0 {
		cfg.Keys = b.Keys
	}
	if cfg.Audience == "" {
		cfg.Audience = "demo-backend"
	}
	v, err := NewVerifier(cfg)
	if err != nil {
		t.Fatalf("NewVerifier: %v", err)
	}
	return v
}

// grant is a complete grant for refund_order.
func grant() Grant {
	return Grant{
		Tenant:         "t_acme",
		User:           "u_88",
		Agent:          "agent_support",
		Executor:       "executor-1",
		Tool:           "refund_order",
		ToolVersion:    3,
		Audience:       "demo-backend",
		CallID:         "call_7f3a",
		IdempotencyKey: "run_42:step_7:refund_order",
	}
}

// expect is what a request for grant() presents.
func expect() Expect {
	return Expect{Scope: "tool::refund_order", Tenant: "t_acme", IdempotencyKey: "run_42:step_7:refund_order"}
}

func mint(t *testing.T, b *Broker, g Grant) Credential {
	t.Helper()
	c, err := b.Mint(g)
	if err != nil {
		t.Fatalf("Mint: %v", err)
	}
	return c
}

// segments decodes a token's header and claims without verifying it, the
// way any JWT reader would.
func segments(t *testing.T, token string) (header, claims map[string]any) {
	t.Helper()
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		t.Fatalf("token has %d segments; want 3", len(parts))
	}
	for i, dst := range []*map[string]any{&header, &claims} {
		b, err := b64.DecodeString(parts[i])
		if err != nil {
			t.Fatalf("segment %d: %v", i, err)
		}
		if err := json.Unmarshal(b, dst); err != nil {
			t.Fatalf("segment %d: %v", i, err)
		}
	}
	return header, claims
}

func kids(t *testing.T, jwks []byte) []string {
	t.Helper()
	var set jwkSet
	if err := json.Unmarshal(jwks, &set); err != nil {
		t.Fatalf("JWKS %s: %v", jwks, err)
	}
	var out []string
	for _, k := range set.Keys {
		out = append(out, k.Kid)
	}
	return out
}

func TestMintVerifyRoundTrip(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{})
	v := newVerifier(t, c, b, VerifierConfig{})
	cred := mint(t, b, grant())

	if n := len(cred.JTI); n != 22 {
		t.Errorf("len(JTI) = %d; want 22 (128 bits, base64url)", n)
	}
	if raw, err := b64.DecodeString(cred.JTI); err != nil || len(raw) != 16 {
		t.Errorf("JTI %q decodes to %d bytes (%v); want 16", cred.JTI, len(raw), err)
	}
	wantCred := Credential{
		Token: cred.Token,
		JTI:   cred.JTI,
		// The key's epoch: the second it started signing, t0.
		Family:    "refund_order:t_acme:1767323045",
		IssuedAt:  t0,
		ExpiresAt: t0.Add(DefaultTTL),
		Scope:     "tool::refund_order",
	}
	if diff := cmp.Diff(wantCred, cred); diff != "" {
		t.Errorf("Mint (-want +got):\n%s", diff)
	}

	header, _ := segments(t, cred.Token)
	wantHeader := map[string]any{"alg": "EdDSA", "typ": "ledger-credential+jwt", "kid": b.current.kid}
	if diff := cmp.Diff(wantHeader, header); diff != "" {
		t.Errorf("JWS header (-want +got):\n%s", diff)
	}

	got, err := v.Verify(t.Context(), cred.Token, expect())
	if err != nil {
		t.Fatalf("Verify: %v", err)
	}
	want := Claims{
		Issuer:         "toolcall-ledger",
		Audience:       "demo-backend",
		Subject:        "u_88",
		Actor:          Actor{Subject: "agent_support", Actor: &Actor{Subject: "executor-1"}},
		Tenant:         "t_acme",
		Scope:          "tool::refund_order",
		JTI:            cred.JTI,
		IssuedAt:       t0,
		NotBefore:      t0,
		ExpiresAt:      t0.Add(DefaultTTL),
		CallID:         "call_7f3a",
		IdempotencyKey: "run_42:step_7:refund_order",
		Family:         "refund_order:t_acme:1767323045",
		ToolVersion:    3,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Verify claims (-want +got):\n%s", diff)
	}
	if got.Agent() != "agent_support" || got.Executor() != "executor-1" {
		t.Errorf("Agent(), Executor() = %q, %q; want agent_support, executor-1", got.Agent(), got.Executor())
	}

	// The wire form, as any JWT library would read it: the RFC 8693 nested
	// actor and NumericDate seconds.
	_, claims := segments(t, cred.Token)
	wantWire := map[string]any{
		"iss": "toolcall-ledger", "aud": "demo-backend", "sub": "u_88",
		"act":    map[string]any{"sub": "agent_support", "act": map[string]any{"sub": "executor-1"}},
		"tenant": "t_acme", "scope": "tool::refund_order", "jti": cred.JTI,
		"iat": float64(t0.Unix()), "nbf": float64(t0.Unix()), "exp": float64(t0.Add(DefaultTTL).Unix()),
		"call_id": "call_7f3a", "idempotency_key": "run_42:step_7:refund_order",
		"family": "refund_order:t_acme:1767323045", "tool_version": float64(3),
	}
	if diff := cmp.Diff(wantWire, claims); diff != "" {
		t.Errorf("JWT claims (-want +got):\n%s", diff)
	}

	// Each credential is its own: a second mint for the same grant has
	// another jti.
	if again := mint(t, b, grant()); again.JTI == cred.JTI || again.Token == cred.Token {
		t.Errorf("two mints share jti %q", cred.JTI)
	}
}

// A grant's recorded jti and family (the call's claim's) are the
// credential's; a family the signing key no longer names (it rotated
// between the claim and the mint) is refused, nothing minted.
func TestMintRecordedJTIAndFamily(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{RotateEvery: time.Hour})
	g := grant()
	g.JTI, g.Family = NewJTI(), FamilyOf(g.Tool, g.Tenant, b.KeyEpoch())
	cred := mint(t, b, g)
	if _, claims := segments(t, cred.Token); cred.JTI != g.JTI || claims["jti"] != g.JTI || cred.Family != g.Family || claims["family"] != g.Family {
		t.Errorf("minted jti %s (token's %v), family %s (token's %v); want the grant's %s, %s", cred.JTI, claims["jti"], cred.Family, claims["family"], g.JTI, g.Family)
	}
	if other := NewJTI(); other == g.JTI || len(other) != 22 {
		t.Errorf("NewJTI twice: %s, %s; want two 128-bit ids", g.JTI, other)
	}
	c.Set(59 * time.Minute) // the next key is made, published a minute ahead
	mint(t, b, g)
	c.Set(time.Hour)
	if got, err := b.Mint(g); !errors.Is(err, ErrFamilyChanged) || got.Token != "" {
		t.Errorf("Mint with the family of the key before the rotation: %v, %v; want ErrFamilyChanged, nothing minted", got, err)
	}
}

func TestMintAction(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{Issuer: "ledger-eu"})
	g := grant()
	g.Action = "tool::refund_order.partial"
	cred := mint(t, b, g)
	if cred.Scope != g.Action {
		t.Errorf("Scope = %q; want %q", cred.Scope, g.Action)
	}
	_, claims := segments(t, cred.Token)
	if claims["scope"] != g.Action || claims["iss"] != "ledger-eu" {
		t.Errorf("scope, iss = %v, %v; want %q, ledger-eu", claims["scope"], claims["iss"], g.Action)
	}
}

func TestMintExpiry(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		deadline time.Time
		want     time.Time
		wantErr  error
	}{
		{name: "no deadline", want: t0.Add(DefaultTTL)},
		{name: "deadline sooner than the TTL", deadline: t0.Add(8 * time.Second), want: t0.Add(8 * time.Second)},
		{name: "deadline later than the TTL", deadline: t0.Add(time.Hour), want: t0.Add(DefaultTTL)},
		{name: "sub-second deadline truncated, never extended", deadline: t0.Add(8*time.Second + 900*time.Millisecond), want: t0.Add(8 * time.Second)},
		{name: "deadline now", deadline: t0, wantErr: ErrDeadlinePassed},
		{name: "deadline within the current second", deadline: t0.Add(500 * time.Millisecond), wantErr: ErrDeadlinePassed},
		{name: "deadline passed", deadline: t0.Add(-time.Minute), wantErr: ErrDeadlinePassed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newClock()
			b := newBroker(t, c, Config{})
			g := grant()
			g.Deadline = tc.deadline
			cred, err := b.Mint(g)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("Mint error = %v; want %v", err, tc.wantErr)
			}
			if err != nil {
				return
			}
			if !cred.ExpiresAt.Equal(tc.want) {
				t.Errorf("ExpiresAt = %v; want %v", cred.ExpiresAt, tc.want)
			}
			v := newVerifier(t, c, b, VerifierConfig{})
			claims, err := v.Verify(t.Context(), cred.Token, expect())
			if err != nil {
				t.Fatalf("Verify: %v", err)
			}
			if !claims.ExpiresAt.Equal(tc.want) {
				t.Errorf("exp claim = %v; want %v", claims.ExpiresAt, tc.want)
			}
		})
	}
}

func TestMintRejectsIncompleteGrant(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		edit  func(*Grant)
		field string
	}{
		{name: "tenant", edit: func(g *Grant) { g.Tenant = "" }, field: "Tenant"},
		{name: "user", edit: func(g *Grant) { g.User = "" }, field: "User"},
		{name: "agent", edit: func(g *Grant) { g.Agent = "" }, field: "Agent"},
		{name: "executor", edit: func(g *Grant) { g.Executor = "" }, field: "Executor"},
		{name: "tool", edit: func(g *Grant) { g.Tool = "" }, field: "Tool"},
		{name: "audience", edit: func(g *Grant) { g.Audience = "" }, field: "Audience"},
		{name: "idempotency key", edit: func(g *Grant) { g.IdempotencyKey = "" }, field: "IdempotencyKey"},
	}
	b := newBroker(t, newClock(), Config{})
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			g := grant()
			tc.edit(&g)
			_, err := b.Mint(g)
			if !errors.Is(err, ErrInvalidGrant) || !strings.Contains(err.Error(), tc.field) {
				t.Errorf("Mint error = %v; want ErrInvalidGrant naming %s", err, tc.field)
			}
		})
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]Config{
		"negative TTL":         {TTL: -time.Second},
		"TTL under a second":   {TTL: 999 * time.Millisecond},
		"negative RotateEvery": {RotateEvery: -time.Second},
		"negative Skew":        {Skew: -time.Second},
		"negative CacheFor":    {CacheFor: -time.Second},
		// A key rotated out before its tokens expire: they gave
		// unknown_kid with minutes left.
		"rotation within a token's life": {RotateEvery: time.Minute, TTL: 5 * time.Minute},
		"rotation as long as a token":    {RotateEvery: time.Hour, TTL: time.Hour},
		"just below the least rotation":  {RotateEvery: 7*time.Minute + 29*time.Second},
	} {
		if _, err := New(cfg); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("New(%s) error = %v; want ErrInvalidConfig", name, err)
		}
	}
	// CacheFor before, TTL + Skew + CacheFor after: 1m + 5m + 30s + 1m.
	least := Config{RotateEvery: 7*time.Minute + 30*time.Second}
	if got := least.MinRotateEvery(); got != least.RotateEvery {
		t.Errorf("MinRotateEvery() of the defaults = %v; want %v", got, least.RotateEvery)
	}
	if _, err := New(least); err != nil {
		t.Errorf("New with RotateEvery at its least: %v", err)
	}
}

// TestRotation follows a key from its publication to its removal: the
// next key is published CacheFor before it signs, the retired one stays
// until every token it signed has expired (plus the verifiers' skew and
// CacheFor), and no longer.
func TestRotation(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{RotateEvery: time.Hour}) // TTL 5m, Skew 30s, CacheFor 1m
	at := c.Set
	kidOf := func(cred Credential) string {
		h, _ := segments(t, cred.Token)
		return h["kid"].(string)
	}
	jwksAt := func(step string, want ...string) {
		t.Helper()
		if diff := cmp.Diff(want, kids(t, b.JWKS())); diff != "" {
			t.Errorf("JWKS %s (-want +got):\n%s", step, diff)
		}
	}

	kid0 := kidOf(mint(t, b, grant()))
	jwksAt("at start", kid0)
	at(58*time.Minute + 59*time.Second)
	jwksAt("a second before the next key is due", kid0)

	// Published a minute ahead; read from the JWKS alone, without a Mint.
	at(59 * time.Minute)
	jwks := kids(t, b.JWKS())
	if len(jwks) != 2 || jwks[0] != kid0 {
		t.Fatalf("JWKS a minute before the rotation = %v; want %s and the next key", jwks, kid0)
	}
	kid1 := jwks[1]
	at(59*time.Minute + 59*time.Second)
	last := mint(t, b, grant())
	if got := kidOf(last); got != kid0 {
		t.Errorf("token a second before the rotation signed by %s; want the current key %s", got, kid0)
	}

	if last.Family != FamilyOf("refund_order", "t_acme", t0.Unix()) || b.KeyEpoch() != t0.Unix() {
		t.Errorf("family a second before the rotation %s, key epoch %d; want the first key's, %d", last.Family, b.KeyEpoch(), t0.Unix())
	}

	at(time.Hour)
	first := mint(t, b, grant())
	if got := kidOf(first); got != kid1 {
		t.Errorf("token at the rotation signed by %s; want the published next key %s", got, kid1)
	}
	// The new key names a family of its own: a revocation of the old
	// key's leaves its credentials alone.
	if epoch := t0.Add(time.Hour).Unix(); first.Family != FamilyOf("refund_order", "t_acme", epoch) || b.KeyEpoch() != epoch {
		t.Errorf("family at the rotation %s, key epoch %d; want the new key's, %d", first.Family, b.KeyEpoch(), epoch)
	}
	jwksAt("after the rotation", kid1, kid0)

	// The retired key's last token verifies until it expires (59m59s +
	// 5m, plus the verifier's 30s), for a verifier fetching the set then.
	at(65*time.Minute + 28*time.Second)
	v := newVerifier(t, c, b, VerifierConfig{})
	if _, err := v.Inspect(t.Context(), last.Token); err != nil {
		t.Errorf("last token of the retired key, a second before it expires: %v; want accepted", err)
	}
	// Kept until the rotation + TTL + Skew + CacheFor, then dropped.
	at(66*time.Minute + 29*time.Second)
	jwksAt("a second before the retired key may go", kid1, kid0)
	at(66*time.Minute + 30*time.Second)
	jwksAt("once no token of the retired key can verify", kid1)

	// The next rotation: the next key is published once the retired one
	// has gone, so the set never holds more than two keys.
	at(2*time.Hour - time.Minute)
	jwks = kids(t, b.JWKS())
	if len(jwks) != 2 || jwks[0] != kid1 {
		t.Errorf("JWKS a minute before the second rotation = %v; want %s and the next key", jwks, kid1)
	}
	at(2*time.Hour + 30*time.Second)
	mint(t, b, grant())
	if got := kids(t, b.JWKS()); len(got) != 2 || got[1] != kid1 {
		t.Errorf("JWKS after the second rotation = %v; want the new key and %s", got, kid1)
	}
}

// TestNewKeyPublishedBeforeItSigns: a verifier that fetched the set just
// before a rotation (within its MinRefresh, so it will not fetch again
// yet, as a cache honouring max-age would not) already knows the key that
// signs after it.
func TestNewKeyPublishedBeforeItSigns(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{RotateEvery: time.Hour})
	v := newVerifier(t, c, b, VerifierConfig{})
	present := func(step, key string) {
		t.Helper()
		g := grant()
		g.IdempotencyKey = key
		want := expect()
		want.IdempotencyKey = key
		if err := verifyErr(t, v, mint(t, b, g).Token, want); err != nil {
			t.Errorf("%s: %v; want accepted", step, err)
		}
	}
	present("at start", "k0")
	// The cached set has expired: this verification fetches it again,
	// half a second before the rotation.
	c.Advance(time.Hour - 500*time.Millisecond)
	present("half a second before the rotation", "k1")
	c.Advance(500 * time.Millisecond)
	present("the first token of the new key", "k2")
}

func TestRotationKeepsOldKeyWhenSaveFails(t *testing.T) {
	t.Parallel()
	c := newClock()
	dir := filepath.Join(t.TempDir(), "keys")
	var logs bytes.Buffer
	b := newBroker(t, c, Config{KeyDir: dir, RotateEvery: time.Hour, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	kid0 := b.current.kid
	// A file where the directory was: the new key cannot be saved.
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	c.Advance(time.Hour)
	cred := mint(t, b, grant())
	if h, _ := segments(t, cred.Token); h["kid"] != kid0 {
		t.Errorf("signed by %v after a failed rotation; want the old key %s", h["kid"], kid0)
	}
	if !strings.Contains(logs.String(), "signing key rotation failed") {
		t.Errorf("log %q; want the failed rotation reported", logs.String())
	}
}

func TestJWKSHandler(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{RotateEvery: time.Hour, CacheFor: 2 * time.Minute})
	c.Advance(time.Hour)
	mint(t, b, grant()) // the next key published: two keys
	srv := httptest.NewServer(b.Handler())
	t.Cleanup(srv.Close)

	resp, err := http.Get(srv.URL + JWKSPath)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d; want 200", resp.StatusCode)
	}
	for h, want := range map[string]string{"Content-Type": "application/jwk-set+json", "Cache-Control": "public, max-age=120"} {
		if got := resp.Header.Get(h); got != want {
			t.Errorf("%s = %q; want %q", h, got, want)
		}
	}
	var got struct {
		Keys []map[string]string `json:"keys"`
	}
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatalf("body %s: %v", body, err)
	}
	var want []map[string]string
	if b.next == nil {
		t.Fatal("no next key published")
	}
	for _, k := range append([]*signingKey{b.current, b.next}, b.retired...) {
		want = append(want, map[string]string{
			"kty": "OKP", "crv": "Ed25519", "x": b64.EncodeToString(k.public()),
			"kid": k.kid, "use": "sig", "alg": "EdDSA",
		})
	}
	// Exactly these members: in particular no "d", the private key.
	if diff := cmp.Diff(want, got.Keys); diff != "" {
		t.Errorf("JWKS (-want +got):\n%s", diff)
	}
	if !bytes.Equal(body, b.JWKS()) {
		t.Errorf("served %s; want JWKS() %s", body, b.JWKS())
	}

	for _, tc := range []struct {
		method, path string
		want         int
	}{
		{http.MethodHead, JWKSPath, http.StatusOK},
		{http.MethodPost, JWKSPath, http.StatusMethodNotAllowed},
		{http.MethodGet, "/jwks.json", http.StatusNotFound},
	} {
		req, _ := http.NewRequest(tc.method, srv.URL+tc.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("%s %s: status %d; want %d", tc.method, tc.path, resp.StatusCode, tc.want)
		}
	}
}

func TestThumbprintRFC8037(t *testing.T) {
	t.Parallel()
	// RFC 8037 appendix A.2 and A.3.
	x, err := b64.DecodeString("11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := thumbprint(ed25519.PublicKey(x)), "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"; got != want {
		t.Errorf("thumbprint = %s; want %s", got, want)
	}
	// A.4: the JWS signature over the RFC's example, checked by the same
	// code that checks credentials.
	const vector = "eyJhbGciOiJFZERTQSJ9.RXhhbXBsZSBvZiBFZDI1NTE5IHNpZ25pbmc.hgyY0il_MGCjP0JzlnLWG1PPOt7-09PGcvMg3AIbQR6dWbhijcNR4ki4iylGjg5BhVsPt9g7sVvpAr_MuM0KAg"
	parts := strings.Split(vector, ".")
	sig, err := b64.DecodeString(parts[2])
	if err != nil {
		t.Fatal(err)
	}
	p := parsedJWS{input: []byte(parts[0] + "." + parts[1]), sig: sig}
	if !p.verify(ed25519.PublicKey(x)) {
		t.Errorf("RFC 8037 A.4 signature does not verify")
	}
	d, _ := b64.DecodeString("nWGxne_9WmC6hEr0kuwsxERJxWl7MmkZcDusAxyuf2A")
	if got := b64.EncodeToString(ed25519.Sign(ed25519.NewKeyFromSeed(d), p.input)); got != parts[2] {
		t.Errorf("signature of the A.4 example = %s; want %s", got, parts[2])
	}
}

func TestKeyDirPersistence(t *testing.T) {
	t.Parallel()
	c := newClock()
	dir := filepath.Join(t.TempDir(), "keys")
	cfg := Config{KeyDir: dir, RotateEvery: time.Hour}
	b1 := newBroker(t, c, cfg)
	tok := mint(t, b1, grant())

	if info, err := os.Stat(dir); err != nil || info.Mode().Perm() != 0o700 {
		t.Errorf("key dir mode = %v (%v); want 0700", info.Mode().Perm(), err)
	}
	assertKeyFiles := func(want ...string) {
		t.Helper()
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, e := range entries {
			info, err := e.Info()
			if err != nil {
				t.Fatal(err)
			}
			if perm := info.Mode().Perm(); perm != 0o600 {
				t.Errorf("%s mode %#o; want 0600", e.Name(), perm)
			}
			got = append(got, e.Name())
		}
		var wantNames []string
		for _, kid := range want {
			wantNames = append(wantNames, kid+".json")
		}
		if diff := cmp.Diff(wantNames, got, cmpopts.SortSlices(func(a, b string) bool { return a < b })); diff != "" {
			t.Errorf("key files (-want +got):\n%s", diff)
		}
	}
	assertKeyFiles(b1.current.kid)

	// A restart keeps the key: same JWKS, and the first broker's token
	// verifies against the second's keys.
	b2 := newBroker(t, c, cfg)
	if !bytes.Equal(b1.JWKS(), b2.JWKS()) {
		t.Errorf("JWKS after restart = %s; want %s", b2.JWKS(), b1.JWKS())
	}
	v := newVerifier(t, c, b2, VerifierConfig{})
	if _, err := v.Verify(t.Context(), tok.Token, expect()); err != nil {
		t.Errorf("token minted before the restart: %v; want accepted", err)
	}

	// Rotations are saved, the next key with the time it starts signing:
	// a restart before then publishes it and goes on signing with the
	// current key. A key that leaves the published set leaves the disk.
	kid0 := b2.current.kid
	c.Advance(59 * time.Minute)
	b2.JWKS()
	kid1 := b2.next.kid
	assertKeyFiles(kid0, kid1)
	b3 := newBroker(t, c, cfg)
	if diff := cmp.Diff([]string{kid0, kid1}, kids(t, b3.JWKS())); diff != "" {
		t.Errorf("JWKS after a restart before the next key signs (-want +got):\n%s", diff)
	}
	if h, _ := segments(t, mint(t, b3, grant()).Token); h["kid"] != kid0 {
		t.Errorf("after a restart before the next key signs, signed by %v; want %s", h["kid"], kid0)
	}
	c.Advance(time.Minute)
	if h, _ := segments(t, mint(t, b3, grant()).Token); h["kid"] != kid1 {
		t.Errorf("at the rotation, signed by %v; want %s", h["kid"], kid1)
	}
	assertKeyFiles(kid0, kid1)
	c.Advance(time.Hour)
	mint(t, b3, grant()) // the next key published, kid0 dropped
	c.Advance(time.Minute)
	mint(t, b3, grant())
	kid2 := b3.current.kid
	assertKeyFiles(kid1, kid2)

	b4 := newBroker(t, c, cfg)
	if diff := cmp.Diff([]string{kid2, kid1}, kids(t, b4.JWKS())); diff != "" {
		t.Errorf("JWKS after a restart following rotations (-want +got):\n%s", diff)
	}
}

func TestKeyDirRefusesBadFiles(t *testing.T) {
	t.Parallel()
	c := newClock()
	tests := []struct {
		name    string
		corrupt func(t *testing.T, path string)
		want    string
	}{
		{
			name:    "readable by others",
			corrupt: func(t *testing.T, path string) { must(t, os.Chmod(path, 0o644)) },
			want:    "must be 0600",
		},
		{
			name: "key does not match its kid",
			corrupt: func(t *testing.T, path string) {
				var f keyFile
				b, err := os.ReadFile(path)
				must(t, err)
				must(t, json.Unmarshal(b, &f))
				_, other, err := ed25519.GenerateKey(nil)
				must(t, err)
				f.Seed = b64.EncodeToString(other.Seed())
				b, err = json.Marshal(f)
				must(t, err)
				must(t, os.WriteFile(path, b, 0o600))
			},
			want: "does not match its kid",
		},
		{
			name:    "not JSON",
			corrupt: func(t *testing.T, path string) { must(t, os.WriteFile(path, []byte("seed=secret"), 0o600)) },
			want:    "not a key file",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			b := newBroker(t, c, Config{KeyDir: dir})
			path := filepath.Join(dir, b.current.kid+".json")
			seed := b64.EncodeToString(b.current.priv.Seed())
			tc.corrupt(t, path)
			_, err := New(Config{KeyDir: dir, Now: c.Now})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New over a bad key file: error %v; want one containing %q", err, tc.want)
			}
			if strings.Contains(err.Error(), seed) || strings.Contains(err.Error(), "secret") {
				t.Errorf("error %q quotes the key file's content", err)
			}
		})
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestConcurrentMintAndVerify(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{})
	v := newVerifier(t, c, b, VerifierConfig{})
	const n = 64
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			g := grant()
			g.IdempotencyKey = "k" + string(rune('a'+i%26)) + string(rune('a'+i/26))
			cred, err := b.Mint(g)
			if err == nil {
				want := expect()
				want.IdempotencyKey = g.IdempotencyKey
				// Presented twice: a retry of the same call.
				_, err = v.Verify(t.Context(), cred.Token, want)
				if err == nil {
					_, err = v.Verify(t.Context(), cred.Token, want)
				}
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("call %d: %v", i, err)
		}
	}
	if got := v.remembered(); got != n {
		t.Errorf("remembered %d jtis; want %d", got, n)
	}
}

// BenchmarkMint: one credential, as the executor mints one per call.
func BenchmarkMint(b *testing.B) {
	br := newBroker(b, newClock(), Config{KeyDir: b.TempDir()})
	g := grant()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := br.Mint(g); err != nil {
			b.Fatal(err)
		}
	}
}

// TestMintLogsAtDebug: a mint is logged, with its jti, when debug is on,
// and costs no log line otherwise.
func TestMintLogsAtDebug(t *testing.T) {
	for _, level := range []slog.Level{slog.LevelDebug, slog.LevelInfo} {
		var out bytes.Buffer
		logger := slog.New(slog.NewJSONHandler(&out, &slog.HandlerOptions{Level: level}))
		b := newBroker(t, newClock(), Config{Logger: logger})
		cred := mint(t, b, grant())
		logged := strings.Contains(out.String(), `"msg":"credential minted"`) && strings.Contains(out.String(), cred.JTI)
		if want := level == slog.LevelDebug; logged != want {
			t.Errorf("at %v: mint logged = %v; want %v\n%s", level, logged, want, out.String())
		}
	}
}
