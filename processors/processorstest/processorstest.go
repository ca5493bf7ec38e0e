// Package processorstest gives processor tests what the intake needs to
// trust anything: an identity issuer with a verifier that trusts it, and a
// policy engine; and registries with a tool changed.
package processorstest

import (
	"encoding/json"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/schemas"
)

// Issuer names the test issuer; Audience is the ledger's audience.
const (
	Issuer   = "https://issuer.test"
	Audience = "toolcall-ledger"
)

// Identity is an issuer and a verifier that trusts exactly it. Key is the
// issuer's signing key, for tests that sign hostile assertions themselves;
// KeyFile is where it is stored.
type Identity struct {
	Issuer   *identity.Issuer
	Verifier *identity.Verifier
	Key      token.Key
	KeyFile  string
}

// NewIdentity returns a fresh issuer (its key in a temporary directory)
// and a verifier of its assertions.
func NewIdentity(t testing.TB) *Identity {
	t.Helper()
	path := filepath.Join(t.TempDir(), "issuer.jwk")
	iss, err := identity.LoadOrCreateIssuer(path, Issuer)
	if err != nil {
		t.Fatal(err)
	}
	v, err := identity.New(t.Context(), identity.Config{Issuer: Issuer, Audience: Audience, Keys: iss.Keys()})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	key, err := token.ParsePrivateJWK(raw)
	if err != nil {
		t.Fatal(err)
	}
	return &Identity{Issuer: iss, Verifier: v, Key: key, KeyFile: path}
}

// Assertion mints an assertion for user u of tenant, acting through agent
// "agent_test", valid for ten minutes.
func (i *Identity) Assertion(t testing.TB, tenant, user string) string {
	t.Helper()
	return i.AssertionWithRoles(t, tenant, user)
}

// AssertionWithRoles is Assertion with the roles claim.
func (i *Identity) AssertionWithRoles(t testing.TB, tenant, user string, roles ...string) string {
	t.Helper()
	a, err := i.Issuer.Mint(identity.Identity{User: user, Agent: "agent_test", Tenant: tenant, Roles: roles}, Audience, 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// testPolicyTimeout bounds an evaluation in tests. The production default
// (policy.DefaultTimeout) is tight; on a test machine whose cores are
// taken by other tests, a scheduler stall alone can exceed it and turn an
// allow into a policy_timeout denial that the test is not about. The
// policy package's own tests cover the timeout.
const testPolicyTimeout = 5 * time.Second

// Policy returns an engine on the policy directory dir.
func Policy(t testing.TB, dir string) *policy.Engine {
	t.Helper()
	return newPolicy(t, dir, nil, false)
}

// PolicyWithRoles is Policy giving the policies the callers' roles
// (policy.Config.Roles).
func PolicyWithRoles(t testing.TB, dir string) *policy.Engine {
	t.Helper()
	return newPolicy(t, dir, nil, true)
}

// PolicyDir returns a new policy directory holding the policies src.
func PolicyDir(t testing.TB, src string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "policy.cedar"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// StallingPolicy returns an engine on the policy directory dir whose
// evaluations run out of time (policy_timeout) while stalled is set, as
// under a scheduler stall longer than the engine's budget, and decide as
// Policy's otherwise. The engine's clock jumps a minute at every reading
// while stalled: no test waits for the timeout.
func StallingPolicy(t testing.TB, dir string) (e *policy.Engine, stalled *atomic.Bool) {
	t.Helper()
	stalled = new(atomic.Bool)
	var jumps atomic.Int64
	now := func() time.Time {
		if !stalled.Load() {
			return time.Now()
		}
		return time.Now().Add(time.Duration(jumps.Add(1)) * time.Minute)
	}
	return newPolicy(t, dir, now, false), stalled
}

func newPolicy(t testing.TB, dir string, now func() time.Time, roles bool) *policy.Engine {
	t.Helper()
	set, err := policy.LoadDir(dir, "test")
	if err != nil {
		t.Fatal(err)
	}
	e, err := policy.NewEngine(policy.Config{Set: set, Timeout: testPolicyTimeout, Now: now, Roles: roles})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// Claims are valid assertion claims for user u of tenant, for tests to
// spoil one at a time.
func Claims(tenant, user string) identity.Claims {
	now := time.Now()
	return identity.Claims{
		Claims: token.Claims{
			Issuer: Issuer, Subject: user, Audience: token.Audience{Audience},
			IssuedAt: token.NewNumericDate(now), NotBefore: token.NewNumericDate(now),
			ExpiresAt: token.NewNumericDate(now.Add(10 * time.Minute)), ID: "jti-test",
		},
		Act:    identity.Actor{Subject: "agent_test"},
		Tenant: tenant,
	}
}

// RegistryWith is the registry in dir (its tools/*.json) with the entry of
// version 1 of tool changed by change.
func RegistryWith(t testing.TB, dir, tool string, change func(entry map[string]any)) *schemas.Registry {
	t.Helper()
	out := t.TempDir()
	if err := os.MkdirAll(filepath.Join(out, "tools"), 0o755); err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob(filepath.Join(dir, "tools", "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if filepath.Base(f) == tool+".v1.json" {
			var entry map[string]any
			if err := json.Unmarshal(raw, &entry); err != nil {
				t.Fatal(err)
			}
			change(entry)
			if raw, err = json.Marshal(entry); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(out, "tools", filepath.Base(f)), raw, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	reg, err := schemas.Load(os.DirFS(out))
	if err != nil {
		t.Fatal(err)
	}
	return reg
}
