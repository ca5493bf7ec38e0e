package identity

import (
	"crypto/sha256"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/token"
)

// TestVerifiedCacheStillChecksTime: an assertion whose signature is
// cached is refused once it expires, as an uncached one is.
func TestVerifiedCacheStillChecksTime(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k, set, v := cachingVerifier(t, clk)
	tok := sign(t, k, TypeAssertion, assertionClaims(clk.Now()))
	for i := range 2 {
		if _, err := v.Verify(t.Context(), tok); err != nil {
			t.Fatalf("verify %d: %v", i, err)
		}
	}
	if got, _ := v.cache.get(sumOf(tok), set); got.Subject != "u_88" {
		t.Fatalf("the verified assertion is not cached (got %+v)", got)
	}
	clk.Advance(time.Minute + DefaultSkew + time.Second)
	if _, err := v.Verify(t.Context(), tok); token.ReasonOf(err) != token.ReasonExpired {
		t.Fatalf("Verify(expired, cached) = %v; want reason %q", err, token.ReasonExpired)
	}
}

// TestVerifiedCacheFollowsKeySet: once the issuer's keys no longer hold
// the key an assertion was signed with, the cache does not vouch for it.
func TestVerifiedCacheFollowsKeySet(t *testing.T) {
	t.Parallel()
	clk := newClock()
	path := filepath.Join(t.TempDir(), "jwks.json")
	a, b := mustKey(t, "a"), mustKey(t, "b")
	writeJWKS(t, path, a)
	v, err := New(t.Context(), Config{Issuer: testIssuer, JWKSFile: path, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	tok := sign(t, a, TypeAssertion, assertionClaims(clk.Now()))
	if _, err := v.Verify(t.Context(), tok); err != nil {
		t.Fatal(err)
	}
	writeJWKS(t, path, b)
	clk.Advance(DefaultRefresh)
	if _, err := v.Verify(t.Context(), tok); token.ReasonOf(err) != token.ReasonUnknownKID {
		t.Fatalf("Verify(key a withdrawn) = %v; want reason %q", err, token.ReasonUnknownKID)
	}
}

// TestVerifiedCacheBounded: the cache never holds more than CacheSize
// assertions, and a negative size turns it off.
func TestVerifiedCacheBounded(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k := mustKey(t, "a")
	set, err := token.NewKeySet(k)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		size, want int
	}{{size: 3, want: 3}, {size: -1, want: 0}} {
		v, err := New(t.Context(), Config{Issuer: testIssuer, Keys: set, Now: clk.Now, CacheSize: tc.size})
		if err != nil {
			t.Fatal(err)
		}
		most := 0
		for i := range 10 {
			c := assertionClaims(clk.Now())
			c.ID = "jti-" + string(rune('a'+i))
			if _, err := v.Verify(t.Context(), sign(t, k, TypeAssertion, c)); err != nil {
				t.Fatal(err)
			}
			most = max(most, len(v.cache.m))
		}
		if most != tc.want {
			t.Errorf("CacheSize %d: cache held up to %d assertions; want %d", tc.size, most, tc.want)
		}
	}
}

// TestVerifiedCacheTampered: a cached assertion does not make a changed
// one valid: the cache is keyed by the whole token.
func TestVerifiedCacheTampered(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k, _, v := cachingVerifier(t, clk)
	tok := sign(t, k, TypeAssertion, assertionClaims(clk.Now()))
	if _, err := v.Verify(t.Context(), tok); err != nil {
		t.Fatal(err)
	}
	other := assertionClaims(clk.Now())
	other.Tenant = "t_other"
	// The other claims under the cached token's header and signature.
	h, _, sig := parts(t, tok)
	_, p, _ := parts(t, sign(t, k, TypeAssertion, other))
	forged := h + "." + p + "." + sig
	if _, err := v.Verify(t.Context(), forged); token.ReasonOf(err) != token.ReasonBadSignature {
		t.Fatalf("Verify(other claims, cached token's signature) = %v; want reason %q", err, token.ReasonBadSignature)
	}
}

// BenchmarkVerify compares an agent's repeated assertion (cached) with a
// fresh one each time (uncached), side by side.
func BenchmarkVerify(b *testing.B) {
	k, err := token.GenerateEd25519("a")
	if err != nil {
		b.Fatal(err)
	}
	set, err := token.NewKeySet(k)
	if err != nil {
		b.Fatal(err)
	}
	for _, size := range []int{DefaultCacheSize, -1} {
		name := "cached"
		if size < 0 {
			name = "uncached"
		}
		b.Run(name, func(b *testing.B) {
			v, err := New(b.Context(), Config{Issuer: testIssuer, Keys: set, CacheSize: size})
			if err != nil {
				b.Fatal(err)
			}
			tok, err := token.Sign(k, TypeAssertion, assertionClaims(time.Now()))
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := v.Verify(b.Context(), tok); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func sumOf(tok string) [sha256.Size]byte { return sha256.Sum256([]byte(tok)) }

func parts(t *testing.T, tok string) (header, payload, sig string) {
	t.Helper()
	p := strings.Split(tok, ".")
	if len(p) != 3 {
		t.Fatalf("token has %d parts", len(p))
	}
	return p[0], p[1], p[2]
}

// cachingVerifier is a verifier with the default cache over one key.
func cachingVerifier(t *testing.T, clk *clock) (token.Key, *token.KeySet, *Verifier) {
	t.Helper()
	k := mustKey(t, "a")
	set, err := token.NewKeySet(k)
	if err != nil {
		t.Fatal(err)
	}
	v, err := New(t.Context(), Config{Issuer: testIssuer, Keys: set, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	return k, set, v
}

// TestVerifiedCacheRolesNotShared: a caller that changes the roles it was
// given does not change what the next use of the assertion gets.
func TestVerifiedCacheRolesNotShared(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k, _, v := cachingVerifier(t, clk)
	c := assertionClaims(clk.Now())
	c.Roles = []string{"approver"}
	tok := sign(t, k, TypeAssertion, c)
	id, err := v.Verify(t.Context(), tok)
	if err != nil {
		t.Fatal(err)
	}
	id.Roles[0] = "operator"
	again, err := v.Verify(t.Context(), tok)
	if err != nil {
		t.Fatal(err)
	}
	if len(again.Roles) != 1 || again.Roles[0] != "approver" {
		t.Errorf("roles after a caller changed its copy = %v; want [approver]", again.Roles)
	}
}
