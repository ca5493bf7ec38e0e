package identity

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/toolcall-ledger/ledger/ledger/token"
)

const testIssuer = "https://dev.toolcall-ledger.local"

// clock is a settable clock for Config.Now.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Now()} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func newIssuer(t *testing.T) (*Issuer, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "issuer.jwk")
	iss, err := LoadOrCreateIssuer(path, testIssuer)
	if err != nil {
		t.Fatalf("LoadOrCreateIssuer() error = %v", err)
	}
	return iss, path
}

func writeJWKS(t *testing.T, path string, keys ...token.Key) {
	t.Helper()
	set, err := token.NewKeySet(keys...)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, set.JWKS(), 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustKey(t *testing.T, kid string) token.Key {
	t.Helper()
	k, err := token.GenerateEd25519(kid)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

var testIdentity = Identity{User: "u_88", Agent: "agent-support-1", Tenant: "t_acme", Purpose: "customer_refund_after_dispute", Roles: []string{"approver"}}

// jwksServer serves a swappable JWKS and counts requests.
type jwksServer struct {
	*httptest.Server
	body   atomic.Pointer[[]byte]
	status atomic.Int64
	hits   atomic.Int64
}

func newJWKSServer(t *testing.T, set *token.KeySet) *jwksServer {
	t.Helper()
	s := &jwksServer{}
	s.set(set.JWKS())
	s.status.Store(http.StatusOK)
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.hits.Add(1)
		w.Header().Set("Content-Type", "application/jwk-set+json")
		w.WriteHeader(int(s.status.Load()))
		_, _ = w.Write(*s.body.Load())
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *jwksServer) set(b []byte) { s.body.Store(&b) }

func TestMintVerify(t *testing.T) {
	t.Parallel()
	iss, _ := newIssuer(t)
	dir := t.TempDir()
	jwksPath := filepath.Join(dir, "jwks.json")
	if err := os.WriteFile(jwksPath, iss.Keys().JWKS(), 0o644); err != nil {
		t.Fatal(err)
	}
	srv := newJWKSServer(t, iss.Keys())

	sources := map[string]Config{
		"file":   {JWKSFile: jwksPath},
		"url":    {JWKSURL: srv.URL + "/.well-known/jwks.json?tenant=x"},
		"static": {Keys: iss.Keys()},
	}
	for name, cfg := range sources {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cfg.Issuer = testIssuer
			v, err := New(t.Context(), cfg)
			if err != nil {
				t.Fatalf("New() error = %v", err)
			}
			tok, err := iss.Mint(testIdentity, "", time.Minute)
			if err != nil {
				t.Fatalf("Mint() error = %v", err)
			}
			got, err := v.Verify(t.Context(), tok)
			if err != nil {
				t.Fatalf("Verify(minted assertion) error = %v", err)
			}
			if diff := cmp.Diff(testIdentity, got); diff != "" {
				t.Errorf("Verify() identity (-want +got):\n%s", diff)
			}
		})
	}
}

func TestMintedAssertionShape(t *testing.T) {
	t.Parallel()
	iss, _ := newIssuer(t)
	tok, err := iss.Mint(Identity{User: "u", Agent: "a", Tenant: "t"}, "aud-x", 2*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	var c map[string]any
	h, err := token.Verify(tok, token.VerifyOptions{Keys: iss.Keys(), Type: TypeAssertion}, &c)
	if err != nil {
		t.Fatalf("token.Verify(minted) error = %v", err)
	}
	if h.Typ != TypeAssertion || h.Alg != token.AlgEdDSA || h.Kid != iss.Keys().IDs()[0] {
		t.Errorf("header = %+v; want typ %s, EdDSA, the issuer's kid", h, TypeAssertion)
	}
	if c["iss"] != testIssuer || c["sub"] != "u" || c["aud"] != "aud-x" || c["tenant"] != "t" {
		t.Errorf("claims = %v; want iss, sub, aud, tenant set", c)
	}
	if act, _ := c["act"].(map[string]any); act["sub"] != "a" {
		t.Errorf("act = %v; want {\"sub\":\"a\"}", c["act"])
	}
	if exp, iat := c["exp"].(float64), c["iat"].(float64); exp-iat != 120 || c["nbf"] != c["iat"] {
		t.Errorf("exp %v, iat %v, nbf %v; want exp = iat + 120 and nbf = iat", exp, iat, c["nbf"])
	}
	other, err := iss.Mint(Identity{User: "u", Agent: "a", Tenant: "t"}, "aud-x", 2*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	var c2 map[string]any
	if _, err := token.Verify(other, token.VerifyOptions{Keys: iss.Keys(), Type: TypeAssertion}, &c2); err != nil {
		t.Fatal(err)
	}
	if c["jti"] == "" || c["jti"] == c2["jti"] {
		t.Errorf("jti %v then %v; want distinct random ids", c["jti"], c2["jti"])
	}
	if _, err := iss.Mint(Identity{User: "u", Agent: "a"}, "", 0); err == nil {
		t.Error("Mint(no tenant) error = nil; want an error")
	}
}

func TestLoadOrCreateIssuer(t *testing.T) {
	t.Parallel()
	iss, path := newIssuer(t)
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if perm := st.Mode().Perm(); perm != 0o600 {
		t.Errorf("key file mode = %#o; want 0600", perm)
	}
	again, err := LoadOrCreateIssuer(path, testIssuer)
	if err != nil {
		t.Fatalf("LoadOrCreateIssuer(existing) error = %v", err)
	}
	if diff := cmp.Diff(iss.Keys().JWKS(), again.Keys().JWKS()); diff != "" {
		t.Errorf("reloaded issuer has another key (-first +again):\n%s", diff)
	}
	// A token from the first verifies with the reloaded keys.
	tok, err := iss.Mint(testIdentity, "", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	v, err := New(t.Context(), Config{Issuer: testIssuer, Keys: again.Keys()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(t.Context(), tok); err != nil {
		t.Errorf("Verify(token of the first load, keys of the second) = %v; want nil", err)
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Errorf("key directory holds %d entries; want only the key file (no temporary left)", len(entries))
	}

	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateIssuer(path, testIssuer); err == nil {
		t.Error("LoadOrCreateIssuer(world-readable key) error = nil; want an error")
	}
	if _, err := LoadOrCreateIssuer(filepath.Join(t.TempDir(), "k"), ""); err == nil {
		t.Error("LoadOrCreateIssuer(empty issuer) error = nil; want an error")
	}
}

func TestLoadOrCreateIssuerConcurrent(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "sub", "issuer.jwk")
	const n = 8
	jwks := make([][]byte, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			iss, err := LoadOrCreateIssuer(path, testIssuer)
			if err != nil {
				t.Errorf("LoadOrCreateIssuer() error = %v", err)
				return
			}
			jwks[i] = iss.Keys().JWKS()
		})
	}
	wg.Wait()
	for i := 1; i < n; i++ {
		if !bytes.Equal(jwks[i], jwks[0]) {
			t.Fatalf("concurrent LoadOrCreateIssuer calls ended with different keys")
		}
	}
}

// assertionClaims returns valid claims for the issuer at now.
func assertionClaims(now time.Time) Claims {
	return Claims{
		Claims: token.Claims{
			Issuer:    testIssuer,
			Subject:   "u_88",
			Audience:  token.Audience{DefaultAudience},
			ExpiresAt: token.NewNumericDate(now.Add(time.Minute)),
			NotBefore: token.NewNumericDate(now),
			IssuedAt:  token.NewNumericDate(now),
			ID:        "jti-1",
		},
		Act:    Actor{Subject: "agent-1"},
		Tenant: "t_acme",
	}
}

func sign(t *testing.T, k token.Key, typ string, claims any) string {
	t.Helper()
	tok, err := token.Sign(k, typ, claims)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func b64(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }

func TestVerifyRejections(t *testing.T) {
	t.Parallel()
	clk := newClock()
	key := mustKey(t, "k1")
	set, err := token.NewKeySet(key)
	if err != nil {
		t.Fatal(err)
	}
	v, err := New(t.Context(), Config{Issuer: testIssuer, Keys: set, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	now := clk.Now()
	edit := func(f func(*Claims)) Claims {
		c := assertionClaims(now)
		f(&c)
		return c
	}
	valid := sign(t, key, TypeAssertion, assertionClaims(now))
	_, payload, _ := strings.Cut(valid, ".")
	payload, _, _ = strings.Cut(payload, ".")
	rsSameKid, err := token.GenerateRS256("k1")
	if err != nil {
		t.Fatal(err)
	}
	foreign := mustKey(t, "k1") // an attacker's key under our kid
	// renamed is a valid assertion's claims with one renamed.
	renamed := func(from, to string) map[string]any {
		b, err := json.Marshal(assertionClaims(now))
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		m[to] = m[from]
		delete(m, from)
		return m
	}

	tests := []struct {
		name  string
		token string
		want  string
	}{
		{"empty", "", ReasonMissingAssertion},
		{"garbage", "not-a-jwt", token.ReasonMalformedToken},
		{"too large", strings.Repeat("a", token.DefaultMaxBytes+1), token.ReasonTokenTooLarge},
		{"alg none", b64(`{"alg":"none","typ":"agent-assertion+jwt","kid":"k1"}`) + "." + payload + ".", token.ReasonAlgNotAllowed},
		{"RS256 under an EdDSA kid", sign(t, rsSameKid, TypeAssertion, assertionClaims(now)), token.ReasonAlgNotAllowed},
		{"plain JWT typ", sign(t, key, "JWT", assertionClaims(now)), token.ReasonTypMismatch},
		{"access token typ", sign(t, key, "at+jwt", assertionClaims(now)), token.ReasonTypMismatch},
		{"jku", b64(`{"alg":"EdDSA","typ":"agent-assertion+jwt","kid":"k1","jku":"https://evil.example/jwks"}`) + "." + payload + ".AAAA", token.ReasonForbiddenHeader},
		{"missing kid", b64(`{"alg":"EdDSA","typ":"agent-assertion+jwt"}`) + "." + payload + ".AAAA", token.ReasonMissingKID},
		{"unknown kid", sign(t, mustKey(t, "k2"), TypeAssertion, assertionClaims(now)), token.ReasonUnknownKID},
		{"foreign key under our kid", sign(t, foreign, TypeAssertion, assertionClaims(now)), token.ReasonBadSignature},
		{"act a number", sign(t, key, TypeAssertion, map[string]any{"iss": testIssuer, "act": 7}), token.ReasonMalformedClaims},
		{"act object without sub", sign(t, key, TypeAssertion, map[string]any{"iss": testIssuer, "act": map[string]any{"iss": "x"}}), token.ReasonMalformedClaims},
		{"expired", sign(t, key, TypeAssertion, edit(func(c *Claims) { c.ExpiresAt = token.NewNumericDate(now.Add(-time.Minute)) })), token.ReasonExpired},
		{"expired past the grace", sign(t, key, TypeAssertion, edit(func(c *Claims) {
			c.ExpiresAt = token.NewNumericDate(now.Add(-DefaultSkew - LapsedGrace - time.Second))
		})), token.ReasonExpired},
		{"expired, valid for too long", sign(t, key, TypeAssertion, edit(func(c *Claims) {
			c.IssuedAt, c.ExpiresAt = token.NewNumericDate(now.Add(-2*DefaultMaxLifetime)), token.NewNumericDate(now.Add(-time.Minute))
		})), token.ReasonExpired},
		{"expired, no iat, valid for too long", sign(t, key, TypeAssertion, edit(func(c *Claims) {
			c.IssuedAt, c.NotBefore, c.ExpiresAt = nil, token.NewNumericDate(now.Add(-2*DefaultMaxLifetime)), token.NewNumericDate(now.Add(-time.Minute))
		})), token.ReasonExpired},
		{"expired, no sub", sign(t, key, TypeAssertion, edit(func(c *Claims) {
			c.ExpiresAt, c.Subject = token.NewNumericDate(now.Add(-time.Minute)), ""
		})), token.ReasonExpired},
		{"future nbf", sign(t, key, TypeAssertion, edit(func(c *Claims) { c.NotBefore = token.NewNumericDate(now.Add(time.Minute)) })), token.ReasonNotYetValid},
		{"nbf past the grace", sign(t, key, TypeAssertion, edit(func(c *Claims) {
			c.NotBefore = token.NewNumericDate(now.Add(DefaultSkew + LapsedGrace + time.Second))
		})), token.ReasonNotYetValid},
		{"wrong iss", sign(t, key, TypeAssertion, edit(func(c *Claims) { c.Issuer = "https://evil.example" })), token.ReasonIssuerMismatch},
		{"foreign aud", sign(t, key, TypeAssertion, edit(func(c *Claims) { c.Audience = token.Audience{"billing"} })), token.ReasonAudienceMismatch},
		{"no exp", sign(t, key, TypeAssertion, edit(func(c *Claims) { c.ExpiresAt = nil })), token.ReasonMissingClaim},
		{"no sub", sign(t, key, TypeAssertion, edit(func(c *Claims) { c.Subject = "" })), token.ReasonMissingClaim},
		{"no tenant", sign(t, key, TypeAssertion, edit(func(c *Claims) { c.Tenant = "" })), token.ReasonMissingClaim},
		{"no act", sign(t, key, TypeAssertion, edit(func(c *Claims) { c.Act = Actor{} })), token.ReasonMissingClaim},
		// A custom claim an issuer lets users set is not the tenant.
		{"tenant spelt Tenant", sign(t, key, TypeAssertion, renamed("tenant", "Tenant")), token.ReasonMalformedClaims},
	}
	// Those only a time bound refuses say whom they prove (LapsedError):
	// their envelopes' refusals are filed under it; those whose lifetime
	// is unknown or too long, unproven, only answer copies of calls.
	lapsed := map[string]bool{"expired": true, "future nbf": true, "expired, valid for too long": true, "expired, no iat, valid for too long": true}
	unproven := map[string]bool{"expired, valid for too long": true, "expired, no iat, valid for too long": true}
	accepted := 0
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			id, err := v.Verify(t.Context(), tc.token)
			if err == nil {
				accepted++
				t.Fatalf("Verify() = %+v; want %s", id, tc.want)
			}
			var te *token.Error
			if !errors.As(err, &te) || te.Reason != tc.want {
				t.Errorf("Verify() error = %v; want a *token.Error with reason %q", err, tc.want)
			}
			le, ok := errors.AsType[*LapsedError](err)
			if ok != lapsed[tc.name] {
				t.Errorf("Verify() error = %#v: a *LapsedError %v; want %v", err, ok, lapsed[tc.name])
			}
			if want := assertionClaims(now); ok && (le.Identity.User != want.Subject || le.Identity.Tenant != want.Tenant || le.Unproven != unproven[tc.name]) {
				t.Errorf("the lapsed assertion's identity %+v, unproven %v; want %s of %s, unproven %v", le.Identity, le.Unproven, want.Subject, want.Tenant, unproven[tc.name])
			}
		})
	}
	if accepted != 0 {
		t.Errorf("%d bad assertions accepted; want 0", accepted)
	}
	if _, err := v.Verify(t.Context(), valid); err != nil {
		t.Errorf("Verify(valid) = %v; want nil", err)
	}
}

func TestVerifyActForms(t *testing.T) {
	t.Parallel()
	key := mustKey(t, "k1")
	set, _ := token.NewKeySet(key)
	v, err := New(t.Context(), Config{Issuer: testIssuer, Keys: set})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	base := map[string]any{
		"iss": testIssuer, "sub": "u_1", "aud": []string{"other", DefaultAudience}, "tenant": "t_1",
		"exp": now.Add(time.Minute).Unix(), "iat": now.Unix(), "roles": []string{"operator", "approver"},
	}
	for name, act := range map[string]any{
		"string":        "agent-7",
		"object":        map[string]any{"sub": "agent-7"},
		"nested object": map[string]any{"sub": "agent-7", "act": map[string]any{"sub": "orchestrator"}},
	} {
		t.Run(name, func(t *testing.T) {
			c := map[string]any{"act": act}
			for k, v := range base {
				c[k] = v
			}
			got, err := v.Verify(t.Context(), sign(t, key, TypeAssertion, c))
			if err != nil {
				t.Fatalf("Verify() error = %v", err)
			}
			want := Identity{User: "u_1", Agent: "agent-7", Tenant: "t_1", Roles: []string{"operator", "approver"}}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("Verify() (-want +got):\n%s", diff)
			}
		})
	}
}

// TestRotationFile follows keys through a JWKS file: a new kid is picked
// up at once (early refresh), a revoked key keeps verifying only until the
// next scheduled refresh, a key replaced under the same kid is picked up
// by the scheduled refresh, and a broken file keeps the old keys.
func TestRotationFile(t *testing.T) {
	t.Parallel()
	clk := newClock()
	path := filepath.Join(t.TempDir(), "jwks.json")
	a, b := mustKey(t, "a"), mustKey(t, "b")
	writeJWKS(t, path, a)
	var logs bytes.Buffer
	v, err := New(t.Context(), Config{Issuer: testIssuer, JWKSFile: path, Now: clk.Now, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	verify := func(k token.Key) error {
		_, err := v.Verify(t.Context(), sign(t, k, TypeAssertion, assertionClaims(clk.Now())))
		return err
	}
	wantReason := func(step string, err error, want string) {
		t.Helper()
		if got := token.ReasonOf(err); got != want || (want == "" && err != nil) {
			t.Fatalf("%s: Verify() = %v; want reason %q", step, err, want)
		}
	}
	wantReason("key a", verify(a), "")

	writeJWKS(t, path, a, b)
	wantReason("new kid b, early refresh", verify(b), "")

	writeJWKS(t, path, b)
	wantReason("revoked a, still cached", verify(a), "")
	clk.Advance(DefaultRefresh)
	wantReason("revoked a, after the refresh period", verify(a), token.ReasonUnknownKID)

	b2 := mustKey(t, "b") // new key material under the same kid
	writeJWKS(t, path, b2)
	clk.Advance(2 * EarlyRefreshInterval)
	wantReason("b replaced, cached", verify(b2), token.ReasonBadSignature)
	clk.Advance(DefaultRefresh)
	wantReason("b replaced, after the refresh period", verify(b2), "")

	for name, body := range map[string]string{"garbage": "{not json", "empty set": `{"keys":[]}`} {
		if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		clk.Advance(DefaultRefresh)
		wantReason("refresh to "+name+" keeps b2", verify(b2), "")
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	clk.Advance(DefaultRefresh)
	wantReason("file removed keeps b2", verify(b2), "")
	if got := strings.Count(logs.String(), "level=WARN msg=\"jwks refresh failed"); got != 3 {
		t.Errorf("logged %d refresh warnings; want 3:\n%s", got, logs.String())
	}
	if err := v.Err(t.Context()); err != nil {
		t.Errorf("Err() with the keys failing to load for less than MaxStale = %v; want nil", err)
	}
	// Not for ever: the issuer may have withdrawn b2 meanwhile.
	clk.Advance(DefaultMaxStale)
	stale := verify(b2)
	wantReason("keys not loaded for longer than MaxStale", stale, ReasonKeysStale)
	if after, ok := RetryAfter(stale); !ok || after != StaleRetryAfter {
		t.Errorf("keys stale: refused for now %v, after %v; want for now, after %v", ok, after, StaleRetryAfter)
	}
	// Which a readiness check reads: every call is refused meanwhile.
	if err := v.Err(t.Context()); token.ReasonOf(err) != ReasonKeysStale {
		t.Errorf("Err() with the keys stale = %v; want %s", err, ReasonKeysStale)
	}
	// Loadable again: Err refreshes them when due, as a verification
	// would, though no assertion came since.
	writeJWKS(t, path, b2)
	clk.Advance(DefaultRefresh)
	if err := v.Err(t.Context()); err != nil {
		t.Errorf("Err() once the keys load again, no assertion since = %v; want nil", err)
	}
	wantReason("keys loaded again", verify(b2), "")
}

// TestUnknownKIDRefreshRateLimit counts JWKS fetches while tokens with
// made-up kids arrive: at most one early fetch per EarlyRefreshInterval.
func TestUnknownKIDRefreshRateLimit(t *testing.T) {
	t.Parallel()
	clk := newClock()
	a := mustKey(t, "a")
	set, _ := token.NewKeySet(a)
	srv := newJWKSServer(t, set)
	v, err := New(t.Context(), Config{Issuer: testIssuer, JWKSURL: srv.URL, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	wantHits := func(step string, want int64) {
		t.Helper()
		if got := srv.hits.Load(); got != want {
			t.Fatalf("%s: %d JWKS fetches; want %d", step, got, want)
		}
	}
	wantHits("after New", 1)

	attack := func(n int) {
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				k := mustKey(t, fmt.Sprintf("made-up-%d", i))
				_, err := v.Verify(t.Context(), sign(t, k, TypeAssertion, assertionClaims(clk.Now())))
				if token.ReasonOf(err) != token.ReasonUnknownKID {
					t.Errorf("Verify(made-up kid) = %v; want unknown_kid", err)
				}
			})
		}
		wg.Wait()
	}
	attack(50)
	wantHits("50 unknown kids", 2)
	clk.Advance(EarlyRefreshInterval - time.Second)
	attack(20)
	wantHits("20 more within the interval", 2)
	clk.Advance(time.Second)
	attack(20)
	wantHits("20 more after the interval", 3)

	// A rotated-in key is found by the one early refresh allowed.
	clk.Advance(EarlyRefreshInterval)
	b := mustKey(t, "b")
	both, _ := token.NewKeySet(a, b)
	srv.set(both.JWKS())
	if _, err := v.Verify(t.Context(), sign(t, b, TypeAssertion, assertionClaims(clk.Now()))); err != nil {
		t.Fatalf("Verify(rotated-in key) = %v; want nil", err)
	}
	wantHits("rotation", 4)

	// Scheduled refreshes: none before Refresh, one after, failures keep keys.
	for range 10 {
		if _, err := v.Verify(t.Context(), sign(t, a, TypeAssertion, assertionClaims(clk.Now()))); err != nil {
			t.Fatal(err)
		}
	}
	wantHits("valid tokens within Refresh", 4)
	srv.status.Store(http.StatusInternalServerError)
	clk.Advance(DefaultRefresh)
	if _, err := v.Verify(t.Context(), sign(t, b, TypeAssertion, assertionClaims(clk.Now()))); err != nil {
		t.Fatalf("Verify() after a failed refresh = %v; want the old keys kept", err)
	}
	wantHits("scheduled refresh (failed)", 5)
	if _, err := v.Verify(t.Context(), sign(t, b, TypeAssertion, assertionClaims(clk.Now()))); err != nil {
		t.Fatal(err)
	}
	wantHits("no retry before Refresh", 5)
}

// An unknown kid is refused for good only once it was looked for in keys
// loaded after it first came. Within EarlyRefreshInterval of an early
// refresh spent on another kid (a made-up one), or while the key source
// fails, it is refused for now (ForNowError), to be sent again once the
// next early refresh may run: the issuer may just have rotated to it;
// unless its claims, read unverified, refuse it whatever key signed it.
// Before, an agent's first assertion under a rotated-in key was refused
// for good when another unknown kid had come first. Keys given in the
// configuration never change: for good.
func TestUnknownKIDForNowUntilLookedFor(t *testing.T) {
	t.Parallel()
	clk := newClock()
	a, b := mustKey(t, "a"), mustKey(t, "b")
	set, _ := token.NewKeySet(a)
	srv := newJWKSServer(t, set)
	v, err := New(t.Context(), Config{Issuer: testIssuer, JWKSURL: srv.URL, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	verify := func(k token.Key) error {
		_, err := v.Verify(t.Context(), sign(t, k, TypeAssertion, assertionClaims(clk.Now())))
		return err
	}
	check := func(step string, err error, forNow bool, after time.Duration) {
		t.Helper()
		got, ok := RetryAfter(err)
		if token.ReasonOf(err) != token.ReasonUnknownKID || ok != forNow || got != after {
			t.Errorf("%s: Verify() = %v, for now %v after %v; want unknown_kid, for now %v after %v", step, err, ok, got, forNow, after)
		}
	}
	madeUp := mustKey(t, "made-up")
	check("a made-up kid, looked for at once", verify(madeUp), false, 0)
	// Came again later, after the keys it was looked for in: for good
	// too, though no refresh ran since.
	clk.Advance(5 * time.Second)
	check("the made-up kid again", verify(madeUp), false, 0)

	clk.Advance(5 * time.Second)
	both, _ := token.NewKeySet(a, b)
	srv.set(both.JWKS())
	check("a rotated-in kid within the interval", verify(b), true, EarlyRefreshInterval-10*time.Second)
	// Within it too, but bad whatever key signed it: for good, saying
	// why.
	d := mustKey(t, "d")
	_, err = v.Verify(t.Context(), sign(t, d, TypeAssertion, assertionClaims(clk.Now().Add(-time.Hour))))
	check("an expired assertion under an unknown kid", err, false, 0)
	if err == nil || !strings.Contains(err.Error(), "("+token.ReasonExpired+")") {
		t.Errorf("its refusal %v does not say its claims refuse it (%s)", err, token.ReasonExpired)
	}
	// Expired within what a lapsed assertion may be: verified, it names
	// whom its refusal is filed under (LapsedError), so for now still.
	_, err = v.Verify(t.Context(), sign(t, d, TypeAssertion, assertionClaims(clk.Now().Add(-2*time.Minute))))
	check("an assertion just expired under an unknown kid", err, true, EarlyRefreshInterval-10*time.Second)
	other := assertionClaims(clk.Now())
	other.Audience = token.Audience{"another-service"}
	_, err = v.Verify(t.Context(), sign(t, d, TypeAssertion, other))
	check("another audience's assertion under an unknown kid", err, false, 0)
	clk.Advance(EarlyRefreshInterval - 10*time.Second)
	if err := verify(b); err != nil {
		t.Fatalf("Verify(rotated-in key) once sent again = %v; want nil", err)
	}

	clk.Advance(EarlyRefreshInterval)
	srv.status.Store(http.StatusInternalServerError)
	check("an unknown kid while the keys fail to load", verify(mustKey(t, "c")), true, EarlyRefreshInterval)

	static, err := New(t.Context(), Config{Issuer: testIssuer, Keys: set, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	_, err = static.Verify(t.Context(), sign(t, b, TypeAssertion, assertionClaims(clk.Now())))
	check("an unknown kid of keys given", err, false, 0)
}

// forNowVerifier refuses every assertion for now.
type forNowVerifier struct{}

func (forNowVerifier) Verify(context.Context, string) (Identity, error) {
	return Identity{}, &ForNowError{Err: &token.Error{Reason: token.ReasonUnknownKID}, RetryAfter: 41500 * time.Millisecond}
}

// A staff request whose assertion is refused for now only (ForNowError) is
// answered 503 keys_unavailable with the verifier's Retry-After, rounded
// up to whole seconds: refused 401 invalid_token, an approver's client
// would take a good assertion for bad.
func TestRequireAnswersTryLater(t *testing.T) {
	h := Require(forNowVerifier{}, "approvals", "an approver", nil, func(w http.ResponseWriter, _ *http.Request, _ Identity) {
		t.Error("the handler ran for an assertion refused")
	})
	req := httptest.NewRequest(http.MethodGet, "/v1/approvals", nil)
	req.Header.Set("Authorization", "Bearer x.y.z")
	w := httptest.NewRecorder()
	h(w, req)
	var body struct {
		Error struct{ Code string } `json:"error"`
	}
	_ = json.Unmarshal(w.Body.Bytes(), &body)
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "42" || body.Error.Code != "keys_unavailable" || w.Header().Get("WWW-Authenticate") != "" {
		t.Errorf("= %d %s, Retry-After %q, WWW-Authenticate %q; want 503 keys_unavailable, Retry-After 42, no challenge", w.Code, body.Error.Code, w.Header().Get("Retry-After"), w.Header().Get("WWW-Authenticate"))
	}
}

func TestNewErrors(t *testing.T) {
	t.Parallel()
	key := mustKey(t, "k")
	set, _ := token.NewKeySet(key)
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.json")
	if err := os.WriteFile(empty, []byte(`{"keys":[]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	failing := newJWKSServer(t, set)
	failing.status.Store(http.StatusNotFound)
	huge := newJWKSServer(t, set)
	huge.set(bytes.Repeat([]byte(" "), token.MaxJWKSBytes+1))

	tests := map[string]Config{
		"no issuer":             {Keys: set},
		"no source":             {Issuer: testIssuer},
		"two sources":           {Issuer: testIssuer, Keys: set, JWKSFile: empty},
		"http off loopback":     {Issuer: testIssuer, JWKSURL: "http://idp.example/jwks.json"},
		"ftp":                   {Issuer: testIssuer, JWKSURL: "ftp://127.0.0.1/jwks.json"},
		"negative refresh":      {Issuer: testIssuer, Keys: set, Refresh: -time.Second},
		"skew too large":        {Issuer: testIssuer, Keys: set, Skew: time.Hour},
		"max lifetime too long": {Issuer: testIssuer, Keys: set, MaxLifetime: MaxMaxLifetime + time.Second},
		"negative max lifetime": {Issuer: testIssuer, Keys: set, MaxLifetime: -time.Second},
		"empty static set":      {Issuer: testIssuer, Keys: &token.KeySet{}},
		"missing file":          {Issuer: testIssuer, JWKSFile: filepath.Join(dir, "nope.json")},
		"file without keys":     {Issuer: testIssuer, JWKSFile: empty},
		"url answering 404":     {Issuer: testIssuer, JWKSURL: failing.URL},
		"url body over the cap": {Issuer: testIssuer, JWKSURL: huge.URL},
	}
	for name, cfg := range tests {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if v, err := New(t.Context(), cfg); err == nil {
				t.Errorf("New() = %v; want an error", v)
			}
		})
	}
}

// TestAssertionLifetime: an assertion valid for longer than MaxLifetime is
// refused, whether its exp lies too far from now or too far from its iat,
// so that no issuer can mint a bearer credential that lasts; one at the
// bound (with the skew on exp) passes.
func TestAssertionLifetime(t *testing.T) {
	t.Parallel()
	clk := newClock()
	key := mustKey(t, "k1")
	set, err := token.NewKeySet(key)
	if err != nil {
		t.Fatal(err)
	}
	// Whole seconds, as NumericDate keeps them, so that the bounds are exact.
	now := clk.Now().Truncate(time.Second)
	at := func(d time.Duration) *token.NumericDate { return token.NewNumericDate(now.Add(d)) }
	const (
		day  = 24 * time.Hour
		year = 365 * day
	)
	tests := []struct {
		name     string
		max      time.Duration // Config.MaxLifetime; 0 for the default
		exp, iat *token.NumericDate
		want     string // reason; "" to accept
	}{
		{name: "exp ten years out, iat now", exp: at(10 * year), iat: at(0), want: ReasonLifetimeTooLong},
		{name: "exp ten years out, no iat", exp: at(10 * year), want: ReasonLifetimeTooLong},
		{name: "exp in year 9999", exp: &token.NumericDate{Time: time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)}, want: ReasonLifetimeTooLong},
		{name: "exp a second past the bound and the skew", exp: at(DefaultMaxLifetime + DefaultSkew + time.Second), want: ReasonLifetimeTooLong},
		{name: "exp at the bound plus the skew, no iat", exp: at(DefaultMaxLifetime + DefaultSkew)},
		{name: "exp - iat a second over the bound", exp: at(30 * time.Minute), iat: at(30*time.Minute - DefaultMaxLifetime - time.Second), want: ReasonLifetimeTooLong},
		{name: "exp - iat at the bound", exp: at(30 * time.Minute), iat: at(30*time.Minute - DefaultMaxLifetime)},
		{name: "dev mint", exp: at(DefaultMintTTL), iat: at(0)},
		{name: "an hour, the default", exp: at(time.Hour), iat: at(0)},
		{name: "an hour, bound configured to 10 minutes", max: 10 * time.Minute, exp: at(time.Hour), iat: at(0), want: ReasonLifetimeTooLong},
		{name: "8 hours, bound configured to 8 hours", max: 8 * time.Hour, exp: at(8 * time.Hour), iat: at(0)},
		{name: "a day and a second, bound at its most", max: MaxMaxLifetime, exp: at(day + time.Second), iat: at(0), want: ReasonLifetimeTooLong},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			v, err := New(t.Context(), Config{Issuer: testIssuer, Keys: set, Now: clk.Now, MaxLifetime: tc.max})
			if err != nil {
				t.Fatal(err)
			}
			c := assertionClaims(now)
			c.ExpiresAt, c.IssuedAt, c.NotBefore = tc.exp, tc.iat, nil
			tok := sign(t, key, TypeAssertion, c)
			// Twice: the second use comes from the signature cache and
			// must be refused all the same.
			for range 2 {
				_, err := v.Verify(t.Context(), tok)
				if got := token.ReasonOf(err); got != tc.want || (tc.want == "" && err != nil) {
					t.Fatalf("Verify(exp %v, iat %v) = %v; want reason %q", tc.exp, tc.iat, err, tc.want)
				}
			}
		})
	}
}

// VerifyUntil returns the identity Verify does and the assertion's expiry.
func TestVerifyUntil(t *testing.T) {
	iss, _ := newIssuer(t)
	v, err := New(t.Context(), Config{Issuer: testIssuer, Keys: iss.Keys()})
	if err != nil {
		t.Fatal(err)
	}
	a, err := iss.Mint(testIdentity, "", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	got, exp, err := v.VerifyUntil(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}
	if got.User != testIdentity.User || exp.Before(time.Now()) || exp.After(time.Now().Add(2*time.Minute)) {
		t.Errorf("VerifyUntil = %+v, %v; want %s and an expiry within a minute", got, exp, testIdentity.User)
	}
	if _, _, err := v.VerifyUntil(t.Context(), ""); err == nil {
		t.Error("VerifyUntil of no assertion succeeded")
	}
}

// A refresh runs to its end whoever asked for it hung up. Before, a
// caller's hanging up aborted the refresh it had taken and did not count
// it, so that requests closed at once, each taking the due refresh, kept
// a key the issuer had withdrawn in force for good.
func TestRefreshOutlivesItsCaller(t *testing.T) {
	t.Parallel()
	clk := newClock()
	a, b := mustKey(t, "a"), mustKey(t, "b")
	first, _ := token.NewKeySet(a)
	rotated, _ := token.NewKeySet(b)
	var served atomic.Int64
	arrived, release := make(chan struct{}, 1), make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body := first.JWKS()
		if served.Add(1) > 1 {
			// a withdrawn: the refresh's answer, held until the caller
			// who asked for it has hung up.
			arrived <- struct{}{}
			<-release
			body = rotated.JWKS()
		}
		w.Header().Set("Content-Type", "application/jwk-set+json")
		_, _ = w.Write(body)
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })
	v, err := New(t.Context(), Config{Issuer: testIssuer, JWKSURL: srv.URL, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}

	clk.Advance(DefaultRefresh)
	ctx, hangUp := context.WithCancel(t.Context())
	go func() {
		<-arrived
		hangUp()
	}()
	_, _ = v.Verify(ctx, sign(t, a, TypeAssertion, assertionClaims(clk.Now())))
	release <- struct{}{}
	deadline := time.Now().Add(10 * time.Second)
	for !slices.Equal(v.keys.Load().IDs(), []string{"b"}) {
		if time.Now().After(deadline) {
			t.Fatalf("keys %v after the refresh its caller hung up on; want the issuer's [b]", v.keys.Load().IDs())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
