package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/policy"
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

// TestCredentialFlagsRotation: a rotation faster than a credential's
// life plus the key's publication ahead and after is refused, naming the
// flags, rather than retire keys whose credentials still live.
func TestCredentialFlagsRotation(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		refused bool
	}{
		{args: nil},
		{args: []string{"--credential-rotate", "1m"}, refused: true},
		{args: []string{"--credential-rotate", "7m29s"}, refused: true},
		{args: []string{"--credential-rotate", "7m30s"}},
		{args: []string{"--credential-ttl", "1h", "--credential-rotate", "1h"}, refused: true},
		{args: []string{"--credential-ttl", "1h", "--credential-rotate", "2h"}},
	} {
		var f credentialFlags
		fs := pflag.NewFlagSet("executor", pflag.ContinueOnError)
		f.register(fs)
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		_, err := f.broker(t.TempDir(), slog.New(slog.DiscardHandler))
		switch {
		case tc.refused && (!errors.Is(err, credentials.ErrInvalidConfig) || !strings.Contains(err.Error(), "--credential-rotate")):
			t.Errorf("%v: %v; want ErrInvalidConfig naming --credential-rotate", tc.args, err)
		case !tc.refused && err != nil:
			t.Errorf("%v: %v; want accepted", tc.args, err)
		}
	}
}

// servedBrokers returns n credential brokers, each with keys of its own
// as every executor has, and the URLs of their published key sets.
func servedBrokers(t *testing.T, n int) ([]*credentials.Broker, []string) {
	t.Helper()
	var brokers []*credentials.Broker
	var urls []string
	for range n {
		b, err := credentials.New(credentials.Config{})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(b.Handler())
		t.Cleanup(srv.Close)
		brokers, urls = append(brokers, b), append(urls, srv.URL+credentials.JWKSPath)
	}
	return brokers, urls
}

// TestReconcilerTrustsEveryBroker: every executor and the reconciler mint
// credentials with keys of their own. The reconciler serves its keys at
// --jwks-addr (its status lookups carry its credentials), and its
// introspection, given every executor's URL in --credential-jwks-url,
// calls active the credentials of each executor and its own, and not a
// stranger's.
func TestReconcilerTrustsEveryBroker(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	executors, urls := servedBrokers(t, 2)
	// A third executor serves its keys over mutual TLS only: the
	// reconciler fetches them with --http-client-*.
	pki := ledgertest.NewPKI(t)
	jwksServer, reconcilerClient := pki.Server("executor-2"), pki.Client("reconciler", "reconciler")
	mtlsExecutor, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	urls = append(urls, "https://"+startHTTP(t, httpTLSFlags{certFile: jwksServer.CertFile, keyFile: jwksServer.KeyFile, clientCAFile: pki.CAFile}, nil, mtlsExecutor.Handler())+credentials.JWKSPath)
	dir := t.TempDir()
	iss, err := identity.LoadOrCreateIssuer(filepath.Join(dir, "issuer.jwk"), "trust-test")
	if err != nil {
		t.Fatal(err)
	}
	issuerJWKS := filepath.Join(dir, "issuer.jwks.json")
	if err := os.WriteFile(issuerJWKS, iss.Keys().JWKS(), 0o600); err != nil {
		t.Fatal(err)
	}
	dataDir := filepath.Join(dir, "reconciler")
	addrs := freeAddrs(t, 2)
	httpAddr, jwksAddr := addrs[0], addrs[1]
	exited := runCommand(t, append(roleArgs(cc, topics),
		"reconciler", "--crdb-dsn", freshSchemaDSN(t), "--data-dir", dataDir, "--instance-id", "trust-test",
		"--tools-base-url", "http://127.0.0.1:1", "--issuer", "trust-test", "--jwks-file", issuerJWKS,
		"--http-addr", httpAddr, "--jwks-addr", jwksAddr, "--credential-jwks-url", strings.Join(urls, ","),
		"--http-client-cert", reconcilerClient.CertFile, "--http-client-key", reconcilerClient.KeyFile, "--http-client-ca", pki.CAFile,
	)...)
	var served []byte
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		exited()
		resp, err := http.Get("http://" + jwksAddr + credentials.JWKSPath)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET jwks: status %d", resp.StatusCode)
		}
		served, err = io.ReadAll(resp.Body)
		return err
	})
	// The reconciler's own broker, read from its key directory: what it
	// signs its status lookups with.
	own, err := credentials.New(credentials.Config{KeyDir: filepath.Join(dataDir, "credentials")})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(served, own.JWKS()) {
		t.Errorf("--jwks-addr serves %s; want the reconciler's keys %s", served, own.JWKS())
	}
	stranger, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}

	// The operators' server starts after the keys' (once the control
	// topic and the policies are followed): a refused connection is
	// waited out like a 503.
	introspect := func(b *credentials.Broker) (int, bool, error) {
		t.Helper()
		cred, err := b.Mint(credentials.Grant{Tenant: "t_a", User: "u", Agent: "a", Executor: "e", Tool: "refund_order", ToolVersion: 1,
			Audience: "demo-backend", CallID: "c", IdempotencyKey: "k"})
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.PostForm("http://"+httpAddr+"/v1/introspect", url.Values{"token": {cred.Token}})
		if err != nil {
			return 0, false, err
		}
		defer resp.Body.Close()
		var got struct {
			Active bool `json:"active"`
		}
		if resp.StatusCode == http.StatusOK {
			if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
				t.Fatal(err)
			}
		}
		return resp.StatusCode, got.Active, nil
	}
	for name, tc := range map[string]struct {
		broker *credentials.Broker
		active bool
	}{
		"executor 0":                        {executors[0], true},
		"executor 1":                        {executors[1], true},
		"executor 2 (keys over mutual TLS)": {mtlsExecutor, true},
		"reconciler":                        {own, true},
		"stranger":                          {stranger, false},
	} {
		ledgertest.WaitFor(t, 30*time.Second, func() error {
			exited()
			status, active, err := introspect(tc.broker)
			if err != nil {
				return err
			}
			if status != http.StatusOK {
				return fmt.Errorf("%s: introspection status %d", name, status)
			}
			if active != tc.active {
				t.Errorf("credential of %s: active %v; want %v", name, active, tc.active)
			}
			return nil
		})
	}
}

// The executors' re-checks of approved calls decide with the version the
// control copy activates, brought first (syncedDecider), not with the one
// the engine held at its last tick of following the activations.
func TestSyncedDeciderDecidesWithTheActivation(t *testing.T) {
	base, root := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(base, "p.cedar"), []byte(`@id("all") permit (principal, action, resource);`), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "v2"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "v2", "p.cedar"), []byte(`@id("none") forbid (principal, action, resource);`), 0o644); err != nil {
		t.Fatal(err)
	}
	set, err := policy.LoadDir(base, "local")
	if err != nil {
		t.Fatal(err)
	}
	engine, err := policy.NewEngine(policy.Config{Set: set})
	if err != nil {
		t.Fatal(err)
	}
	var active *policy.Activation
	d := syncedDecider{engine, func() {
		if active != nil {
			engine.Activate(root, *active, true)
		}
	}}
	req := policy.Request{Tenant: "t_a", User: "u_1", Agent: "a", Tool: "create_ticket", ToolVersion: 1,
		Effect: "write", Risk: "low", ResourceTenant: "t_a", Channel: "api", Arguments: map[string]any{"title": "t"}}
	if dec := d.Decide(t.Context(), req); !dec.Allow {
		t.Fatalf("before the activation: %+v; want allowed", dec)
	}
	active = &policy.Activation{Label: "v2", ID: "act-1"}
	if dec := d.Decide(t.Context(), req); dec.Allow || dec.Version == "" || !strings.HasPrefix(dec.Version, "v2") {
		t.Errorf("the next decision after the activation: %+v; want denied by v2", dec)
	}
}

// ledger token --approver mints for another agent than ledger submit's
// (agent_cli), unless --agent says otherwise: the approval queue refuses
// an approver acting through the agent that requested the call
// (self_approval), and the README's dev approver, minted so, could
// approve none of the calls submitted with ledger submit.
func TestTokenApproverAgent(t *testing.T) {
	dir := t.TempDir()
	devIssuerKeys(t, dir)
	agentOf := func(args ...string) string {
		t.Helper()
		tok := strings.TrimSpace(cli(t, append([]string{"token", "--data-dir", dir, "--user", "u_boss"}, args...)...))
		var c identity.Claims
		if err := token.Unverified(tok, &c); err != nil {
			t.Fatal(err)
		}
		return c.Act.Subject
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "agent_cli"},
		{[]string{"--approver"}, approverAgent},
		{[]string{"--approver", "--agent", "agent_x"}, "agent_x"},
	} {
		if got := agentOf(tc.args...); got != tc.want || (len(tc.args) > 0 && got == "agent_cli") {
			t.Errorf("ledger token %v: agent %q; want %q", tc.args, got, tc.want)
		}
	}
}

// ledger token --issuer-key mints with a key of one's own, for a
// deployment of separate processes that has no identity provider yet: a
// missing key is created with its public keys beside it, which a
// verifier trusting that file and issuer name accepts, and the next
// token is signed with the same key. --operator mints an operator's
// assertion for the staff's audience. Before, ledger token minted only
// from ledger dev's data directory, under the issuer name ledger-dev.
func TestTokenFromAKeyOfOnesOwn(t *testing.T) {
	key := filepath.Join(t.TempDir(), "agents.jwk")
	mint := func(args ...string) (tok, stderr string) {
		t.Helper()
		out, errs := cliSplit(t, append([]string{"token", "--issuer-key", key, "--issuer", "https://idp.test"}, args...)...)
		return strings.TrimSpace(out), errs
	}
	agent, created := mint("--tenant", "t_acme", "--user", "u_1")
	if !strings.Contains(created, "created "+key) || !strings.Contains(created, "--jwks-file "+key+".jwks.json") {
		t.Errorf("first token's notes %q; want the key's creation and the verifiers' flags", created)
	}
	op, again := mint("--tenant", "*", "--user", "u_ops", "--operator")
	if again != "" {
		t.Errorf("second token's notes %q; want none (the key exists)", again)
	}
	verify := func(audience, tok string) identity.Identity {
		t.Helper()
		v, err := identity.New(t.Context(), identity.Config{Issuer: "https://idp.test", Audience: audience, JWKSFile: key + ".jwks.json"})
		if err != nil {
			t.Fatal(err)
		}
		id, err := v.Verify(t.Context(), tok)
		if err != nil {
			t.Fatalf("verify: %v", err)
		}
		return id
	}
	if id := verify(identity.DefaultAudience, agent); id.Tenant != "t_acme" || id.User != "u_1" {
		t.Errorf("agent's assertion: %+v; want t_acme's u_1", id)
	}
	if id := verify(identity.ApproverAudience, op); id.Tenant != "*" || !slices.Contains(id.Roles, "operator") {
		t.Errorf("operator's assertion: %+v; want a platform operator", id)
	}
	refused := func(want string, args ...string) {
		t.Helper()
		var errs bytes.Buffer
		root := newRoot()
		root.SetArgs(append([]string{"token"}, args...))
		root.SetOut(&errs)
		root.SetErr(&errs)
		if err := root.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ledger token %v = %v; want refused, %q", args, err, want)
		}
	}
	// A deployment's shell's LEDGER_ISSUER names its identity provider,
	// not this key: ignored.
	t.Setenv("LEDGER_ISSUER", "https://idp.example.com")
	refused("--issuer-key needs --issuer", "--issuer-key", key)
	// A key set beside no key (copied to a verifier's host): a new key
	// would replace it.
	other := filepath.Join(t.TempDir(), "idp.jwk")
	if err := os.WriteFile(other+".jwks.json", []byte(`{"keys":[]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	refused("refusing to create a key", "--issuer-key", other, "--issuer", "https://idp.test")
	if _, err := os.Stat(other); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a key was created beside the key set it would replace: %v", err)
	}
}

// An assertion whose aud names both the agents' and the staff's audience
// (an identity provider's mapper that adds every audience) is refused by
// both roles' verifiers, as the commands build them: an agent holding one
// for a user who approves cannot approve, freeze or read the operators'
// questions with it, and a staff member's cannot submit calls. One that
// names an audience of no role besides its own is accepted.
func TestAssertionForBothRolesRefused(t *testing.T) {
	dir := t.TempDir()
	key, err := token.GenerateEd25519("k1")
	if err != nil {
		t.Fatal(err)
	}
	set, err := token.NewKeySet(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	jwks := filepath.Join(dir, "jwks.json")
	if err := os.WriteFile(jwks, set.JWKS(), 0o600); err != nil {
		t.Fatal(err)
	}
	mint := func(aud ...string) string {
		now := time.Now()
		c := identity.Claims{
			Claims: token.Claims{Issuer: DevIssuer, Subject: "u_ops", Audience: aud,
				ExpiresAt: token.NewNumericDate(now.Add(time.Minute)), IssuedAt: token.NewNumericDate(now)},
			Act: identity.Actor{Subject: "agent_1"}, Tenant: "t_demo", Roles: []string{"operator", "approver"},
		}
		a, err := token.Sign(key, identity.TypeAssertion, c)
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	// verifier is a role's, its audience audience and the other role's
	// other ("": its default).
	verifier := func(staff bool, audience, other string) *identity.Verifier {
		var f identityFlags
		fs := pflag.NewFlagSet("role", pflag.ContinueOnError)
		audFlag, otherFlag := "--audience", "--staff-audience"
		if staff {
			f.registerStaff(fs)
			audFlag, otherFlag = "--staff-audience", "--agents-audience"
		} else {
			f.register(fs)
		}
		args := []string{"--issuer", DevIssuer, "--jwks-file", jwks, audFlag, audience}
		if other != "" {
			args = append(args, otherFlag, other)
		}
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		v, err := f.verifier(t.Context(), nil)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, tc := range []struct {
		name string
		v    *identity.Verifier
		aud  []string
		ok   bool
	}{
		{"intake, both defaults", verifier(false, identity.DefaultAudience, ""), []string{identity.DefaultAudience, identity.ApproverAudience}, false},
		{"staff, both defaults", verifier(true, identity.ApproverAudience, ""), []string{identity.ApproverAudience, identity.DefaultAudience}, false},
		// Every role knows the other's audience as configured
		// (LEDGER_AGENTS_AUDIENCE, LEDGER_STAFF_AUDIENCE): approvals
		// serve, the reconciler and the projector too, not only ledger
		// api, which forwards approvals and control requests to them.
		{"staff, the agents' configured audience too", verifier(true, "ops", "bots"), []string{"ops", "bots"}, false},
		{"staff, the agents' default too, another configured", verifier(true, "ops", "bots"), []string{"ops", identity.DefaultAudience}, false},
		{"intake, the staff's configured audience too", verifier(false, "bots", "ops"), []string{"bots", "ops"}, false},
		{"intake, its own and a stranger's", verifier(false, identity.DefaultAudience, ""), []string{identity.DefaultAudience, "billing"}, true},
		{"staff, its own alone", verifier(true, identity.ApproverAudience, ""), []string{identity.ApproverAudience}, true},
		{"staff with custom audiences, its own alone", verifier(true, "ops", "bots"), []string{"ops"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.v.Verify(t.Context(), mint(tc.aud...))
			switch {
			case tc.ok && err != nil:
				t.Errorf("Verify(aud %q) = %v; want accepted", tc.aud, err)
			case !tc.ok && token.ReasonOf(err) != token.ReasonAudienceMismatch:
				t.Errorf("Verify(aud %q) = %v; want refused %s", tc.aud, err, token.ReasonAudienceMismatch)
			}
		})
	}
}
