package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/processors/identity"
)

// TestIdentityFlagsMaxAssertionLifetime: --max-assertion-lifetime reaches
// the verifier of the roles that take identityFlags (default an hour), and
// a value that would not bound anything is refused.
func TestIdentityFlagsMaxAssertionLifetime(t *testing.T) {
	dir := t.TempDir()
	iss, err := identity.LoadOrCreateIssuer(filepath.Join(dir, "issuer.jwk"), DevIssuer)
	if err != nil {
		t.Fatal(err)
	}
	jwks := filepath.Join(dir, "jwks.json")
	if err := os.WriteFile(jwks, iss.Keys().JWKS(), 0o600); err != nil {
		t.Fatal(err)
	}
	id := identity.Identity{Tenant: "t_demo", User: "u_demo", Agent: "agent_cli"}
	tests := []struct {
		name    string
		args    []string
		ttl     time.Duration // of the minted assertion
		reason  string        // the verifier's refusal; "" to accept
		flagErr string        // in the error making the verifier
	}{
		{name: "default accepts an hour", ttl: time.Hour},
		{name: "default refuses two hours", ttl: 2 * time.Hour, reason: identity.ReasonLifetimeTooLong},
		{name: "10m refuses half an hour", args: []string{"--max-assertion-lifetime", "10m"}, ttl: 30 * time.Minute, reason: identity.ReasonLifetimeTooLong},
		{name: "8h accepts 8 hours", args: []string{"--max-assertion-lifetime", "8h"}, ttl: 8 * time.Hour},
		{name: "zero refused", args: []string{"--max-assertion-lifetime", "0s"}, flagErr: "--max-assertion-lifetime"},
		{name: "negative refused", args: []string{"--max-assertion-lifetime", "-1m"}, flagErr: "--max-assertion-lifetime"},
		{name: "over a day refused", args: []string{"--max-assertion-lifetime", "25h"}, flagErr: "--max-assertion-lifetime"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var f identityFlags
			fs := pflag.NewFlagSet("intake", pflag.ContinueOnError)
			f.register(fs)
			if err := fs.Parse(append([]string{"--issuer", DevIssuer, "--jwks-file", jwks}, tc.args...)); err != nil {
				t.Fatal(err)
			}
			v, err := f.verifier(t.Context(), nil)
			if tc.flagErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.flagErr) {
					t.Fatalf("verifier(%v) error = %v; want one naming %s", tc.args, err, tc.flagErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			a, err := iss.Mint(id, identity.DefaultAudience, tc.ttl)
			if err != nil {
				t.Fatal(err)
			}
			_, err = v.Verify(t.Context(), a)
			if got := token.ReasonOf(err); got != tc.reason || (tc.reason == "" && err != nil) {
				t.Errorf("Verify(assertion for %s) with %v = %v; want reason %q", tc.ttl, tc.args, err, tc.reason)
			}
		})
	}
}
