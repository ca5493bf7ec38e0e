package demobackend

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/httptool"
)

// testClock is a clock shared by the broker and the verifier, moved by hand.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// authEnv is a verifying backend and the broker that mints for it.
type authEnv struct {
	s      *Server
	base   string
	broker *credentials.Broker
	clock  *testClock
}

func newAuthEnv(t *testing.T, cfg Config) authEnv {
	t.Helper()
	clock := &testClock{now: fixedNow()}
	b, err := credentials.New(credentials.Config{Now: clock.Now})
	if err != nil {
		t.Fatalf("credentials.New: %v", err)
	}
	if cfg.Credentials == nil {
		// No audience on the verifier: the backend's Config.Audience
		// (default demo-backend) is the one checked.
		v, err := credentials.NewVerifier(credentials.VerifierConfig{Keys: b.Keys, Now: clock.Now})
		if err != nil {
			t.Fatalf("NewVerifier: %v", err)
		}
		cfg.Credentials = v
	}
	s, ts := newBackend(t, cfg)
	return authEnv{s: s, base: ts.URL, broker: b, clock: clock}
}

// mint returns "Bearer <token>" for a call of tool with tenant and key.
func (e authEnv) mint(t *testing.T, tool, tenant, key string, edit func(*credentials.Grant)) (auth string, jti string) {
	t.Helper()
	g := credentials.Grant{
		Tenant: tenant, User: "u_88", Agent: "agent_support", Executor: "executor-1",
		Tool: tool, ToolVersion: 1, Audience: DefaultAudience, CallID: "call_" + key,
		IdempotencyKey: key,
	}
	if edit != nil {
		edit(&g)
	}
	c, err := e.broker.Mint(g)
	if err != nil {
		t.Fatalf("Mint: %v", err)
	}
	return "Bearer " + c.Token, c.JTI
}

const refundBody = `{"order_id":"ord_1","amount_cents":4500,"currency":"AUD"}`

func TestCredentialRefused(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		// prepare returns the request to send; it may move the clock.
		prepare   func(t *testing.T, e authEnv) call
		wantError credentials.Reason
		wantAuth  string // WWW-Authenticate
	}{
		{
			name:      "no token",
			prepare:   func(t *testing.T, e authEnv) call { return refundCall("k1", "") },
			wantError: credentials.ReasonMissingToken,
			wantAuth:  `Bearer realm="demo-backend"`,
		},
		{
			name:      "not a bearer token",
			prepare:   func(t *testing.T, e authEnv) call { return refundCall("k1", "Basic dTpw") },
			wantError: credentials.ReasonMissingToken,
			wantAuth:  `Bearer realm="demo-backend"`,
		},
		{
			name:      "garbage",
			prepare:   func(t *testing.T, e authEnv) call { return refundCall("k1", "Bearer not-a-jwt") },
			wantError: credentials.ReasonMalformed,
			wantAuth:  `Bearer realm="demo-backend", error="invalid_token"`,
		},
		{
			name: "minted for another backend's audience",
			prepare: func(t *testing.T, e authEnv) call {
				auth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", func(g *credentials.Grant) { g.Audience = "other-backend" })
				return refundCall("k1", auth)
			},
			wantError: credentials.ReasonWrongAudience,
			wantAuth:  `Bearer realm="demo-backend", error="invalid_token"`,
		},
		{
			name: "expired",
			prepare: func(t *testing.T, e authEnv) call {
				auth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", nil)
				e.clock.Advance(credentials.DefaultTTL + credentials.DefaultSkew)
				return refundCall("k1", auth)
			},
			wantError: credentials.ReasonExpired,
		},
		{
			name: "expired at the call's deadline",
			prepare: func(t *testing.T, e authEnv) call {
				auth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", func(g *credentials.Grant) { g.Deadline = fixedNow().Add(8 * time.Second) })
				e.clock.Advance(8*time.Second + credentials.DefaultSkew)
				return refundCall("k1", auth)
			},
			wantError: credentials.ReasonExpired,
		},
		{
			name: "another tool's credential",
			prepare: func(t *testing.T, e authEnv) call {
				auth, _ := e.mint(t, ToolSendEmail, "t_acme", "k1", nil)
				return refundCall("k1", auth)
			},
			wantError: credentials.ReasonWrongScope,
		},
		{
			name: "another tenant's credential",
			prepare: func(t *testing.T, e authEnv) call {
				auth, _ := e.mint(t, ToolRefundOrder, "t_other", "k1", nil)
				return refundCall("k1", auth)
			},
			wantError: credentials.ReasonWrongTenant,
		},
		{
			name: "another call's credential",
			prepare: func(t *testing.T, e authEnv) call {
				auth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k0", nil)
				return refundCall("k1", auth)
			},
			wantError: credentials.ReasonWrongCall,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newAuthEnv(t, Config{})
			a := mustDo(t, e.base, tc.prepare(t, e))
			if a.status != http.StatusUnauthorized {
				t.Errorf("status = %d (%s); want 401", a.status, a.body)
			}
			if got := decode[apiError](t, a.body).Error; got != string(tc.wantError) {
				t.Errorf("error = %q; want %q", got, tc.wantError)
			}
			if tc.wantAuth != "" {
				if got := a.header.Get("WWW-Authenticate"); got != tc.wantAuth {
					t.Errorf("WWW-Authenticate = %q; want %q", got, tc.wantAuth)
				}
			}
			if n := len(e.s.Effects()); n != 0 {
				t.Errorf("len(Effects()) = %d; want 0: a refused request applies nothing", n)
			}
			want := []Refusal{{Tool: ToolRefundOrder, Reason: tc.wantError, TenantID: "t_acme", IdempotencyKey: "k1"}}
			if diff := cmp.Diff(want, e.s.Refusals()); diff != "" {
				t.Errorf("Refusals() (-want +got):\n%s", diff)
			}
		})
	}
}

func refundCall(key, auth string) call {
	return call{path: "/tools/refund_order", key: key, tenant: "t_acme", callID: "call_" + key, body: refundBody, auth: auth}
}

func TestCredentialAccepted(t *testing.T) {
	t.Parallel()
	journal := filepath.Join(t.TempDir(), "effects.jsonl")
	e := newAuthEnv(t, Config{JournalPath: journal})
	auth, jti := e.mint(t, ToolRefundOrder, "t_acme", "k1", nil)
	a := mustDo(t, e.base, refundCall("k1", auth))
	if a.status != http.StatusOK {
		t.Fatalf("status = %d (%s); want 200", a.status, a.body)
	}
	// The scheme is case-insensitive (RFC 7235).
	auth2, jti2 := e.mint(t, ToolSendEmail, "t_acme", "e1", nil)
	a = mustDo(t, e.base, call{path: "/tools/send_email", key: "e1", tenant: "t_acme", body: `{}`, auth: "bearer " + strings.TrimPrefix(auth2, "Bearer ")})
	if a.status != http.StatusOK {
		t.Fatalf("lower-case scheme: status = %d (%s); want 200", a.status, a.body)
	}

	want := []Effect{
		{Seq: 1, Tool: ToolRefundOrder, IdempotencyKey: "k1", CallID: "call_k1", TenantID: "t_acme", Attempt: 1, At: fixedNow(), Received: fixedNow(), JTI: jti, CredentialIssued: fixedNow()},
		{Seq: 2, Tool: ToolSendEmail, IdempotencyKey: "e1", TenantID: "t_acme", Attempt: 1, At: fixedNow(), Received: fixedNow(), JTI: jti2, CredentialIssued: fixedNow()},
	}
	ignoreHash := cmpopts.IgnoreFields(Effect{}, "ArgsHash", "Result", "Resource")
	if diff := cmp.Diff(want, e.s.Effects(), ignoreHash); diff != "" {
		t.Errorf("Effects() (-want +got):\n%s", diff)
	}
	got, err := ReadJournal(journal)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got, ignoreHash); diff != "" {
		t.Errorf("journal (-want +got):\n%s", diff)
	}
	// What did jti X touch: exactly its call.
	var touched []string
	for _, ef := range got {
		if ef.JTI == jti {
			touched = append(touched, ef.Tool+":"+ef.TenantID+"/"+ef.IdempotencyKey)
		}
	}
	if diff := cmp.Diff([]string{"refund_order:t_acme/k1"}, touched); diff != "" {
		t.Errorf("effects of jti %s (-want +got):\n%s", jti, diff)
	}
	if r := e.s.Refusals(); len(r) != 0 {
		t.Errorf("Refusals() = %v; want none", r)
	}
}

func TestCredentialReplay(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t, Config{})
	auth, jti := e.mint(t, ToolRefundOrder, "t_acme", "k1", nil)

	first := mustDo(t, e.base, refundCall("k1", auth))
	if first.status != http.StatusOK {
		t.Fatalf("first call: status %d (%s); want 200", first.status, first.body)
	}
	// A retry of the same call with the same credential, as after a lost
	// answer: accepted, and the native tool replays its answer.
	retry := mustDo(t, e.base, refundCall("k1", auth))
	if retry.status != http.StatusOK || retry.header.Get(HeaderReplayed) != "true" {
		t.Errorf("retry: status %d, replayed %q (%s); want 200, true", retry.status, retry.header.Get(HeaderReplayed), retry.body)
	}
	if !bytes.Equal(retry.body, first.body) {
		t.Errorf("retry answered %s; want %s", retry.body, first.body)
	}

	// The same credential for a second call: refused, nothing applied.
	second := mustDo(t, e.base, refundCall("k2", auth))
	if second.status != http.StatusUnauthorized {
		t.Errorf("second call: status %d (%s); want 401", second.status, second.body)
	}
	if got := decode[apiError](t, second.body).Error; got != string(credentials.ReasonReplayed) {
		t.Errorf("second call: error %q; want replayed", got)
	}
	if n := e.s.AppliedIn(ToolRefundOrder, "t_acme", "k2"); n != 0 {
		t.Errorf("AppliedIn(k2) = %d; want 0", n)
	}
	if n := e.s.AppliedIn(ToolRefundOrder, "t_acme", "k1"); n != 1 {
		t.Errorf("AppliedIn(k1) = %d; want 1", n)
	}
	for _, ef := range e.s.Effects() {
		if ef.JTI != jti || ef.IdempotencyKey != "k1" {
			t.Errorf("effect %+v; want only k1's, under jti %s", ef, jti)
		}
	}
	want := []Refusal{{Tool: ToolRefundOrder, Reason: credentials.ReasonReplayed, TenantID: "t_acme", IdempotencyKey: "k2"}}
	if diff := cmp.Diff(want, e.s.Refusals()); diff != "" {
		t.Errorf("Refusals() (-want +got):\n%s", diff)
	}
}

// A credential bound to its call's body (as the executor mints them)
// carries that body only: replayed within its TTL, with the same key,
// tenant and scope but other arguments, it is refused wrong_body and
// nothing is applied; a retry with the same body is accepted.
func TestCredentialBoundToTheBody(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t, Config{})
	auth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", func(g *credentials.Grant) { g.BodySHA256 = credentials.BodyDigest([]byte(refundBody)) })
	other := refundCall("k1", auth)
	other.body = `{"order_id":"ord_2","amount_cents":999999,"currency":"AUD"}`
	got := mustDo(t, e.base, other)
	if got.status != http.StatusUnauthorized || decode[apiError](t, got.body).Error != string(credentials.ReasonWrongBody) {
		t.Errorf("other arguments under the credential: status %d (%s); want 401 wrong_body", got.status, got.body)
	}
	if n := e.s.AppliedIn(ToolRefundOrder, "t_acme", "k1"); n != 0 {
		t.Errorf("AppliedIn(k1) = %d after the refusal; want 0", n)
	}
	for range 2 {
		if got := mustDo(t, e.base, refundCall("k1", auth)); got.status != http.StatusOK {
			t.Errorf("the call's own body: status %d (%s); want 200", got.status, got.body)
		}
	}
	if n := e.s.AppliedIn(ToolRefundOrder, "t_acme", "k1"); n != 1 {
		t.Errorf("AppliedIn(k1) = %d; want 1", n)
	}
}

func TestCredentialRetryAfterInjectedFailure(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t, Config{})
	e.s.SetFault(ToolSendEmail, Fault{FailStatus: http.StatusServiceUnavailable, FailTimes: 1})
	auth, _ := e.mint(t, ToolSendEmail, "t_acme", "e1", nil)
	c := call{path: "/tools/send_email", key: "e1", tenant: "t_acme", body: `{}`, auth: auth}
	if a := mustDo(t, e.base, c); a.status != http.StatusServiceUnavailable {
		t.Fatalf("first attempt: status %d; want the injected 503", a.status)
	}
	if a := mustDo(t, e.base, c); a.status != http.StatusOK {
		t.Errorf("retry with the same credential: status %d (%s); want 200", a.status, a.body)
	}
	if n := e.s.Applied(ToolSendEmail, "e1"); n != 1 {
		t.Errorf("Applied = %d; want 1", n)
	}
}

const emailBody = `{"to":"a@example.com","subject":"hi"}`

// emailCall is a send_email request with its credential, bound to its body
// as the executor mints it.
func (e authEnv) emailCall(t *testing.T, key string) (call, string) {
	t.Helper()
	auth, jti := e.mint(t, ToolSendEmail, "t_acme", key, func(g *credentials.Grant) { g.BodySHA256 = credentials.BodyDigest([]byte(emailBody)) })
	return call{path: "/tools/send_email", key: key, tenant: "t_acme", callID: "call_" + key, body: emailBody, auth: auth}, jti
}

// A send_email request captured whole (its bearer token, key, tenant and
// body, from an access log, say) and sent again within the credential's
// life applies nothing: send_email does not deduplicate by key, so its
// effect spends the credential, and the copies are refused 401 spent.
// Before, each copy sent another email.
func TestCredentialSpentByEffect(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t, Config{})
	c, jti := e.emailCall(t, "e1")
	var statuses []int
	for range 3 {
		a := mustDo(t, e.base, c)
		statuses = append(statuses, a.status)
		if a.status == http.StatusUnauthorized {
			if got := decode[apiError](t, a.body).Error; got != string(credentials.ReasonSpent) {
				t.Errorf("error %q; want spent", got)
			}
			if got, want := a.header.Get("WWW-Authenticate"), `Bearer realm="demo-backend", error="invalid_token"`; got != want {
				t.Errorf("WWW-Authenticate = %q; want %q", got, want)
			}
		}
	}
	if diff := cmp.Diff([]int{http.StatusOK, http.StatusUnauthorized, http.StatusUnauthorized}, statuses); diff != "" {
		t.Errorf("statuses (-want +got):\n%s", diff)
	}
	if n := e.s.AppliedIn(ToolSendEmail, "t_acme", "e1"); n != 1 {
		t.Errorf("AppliedIn(send_email, e1) = %d; want 1", n)
	}
	if d := e.s.Duplicates(); len(d) != 0 {
		t.Errorf("Duplicates() = %v; want none", d)
	}
	if efs := e.s.Effects(); len(efs) != 1 || efs[0].JTI != jti {
		t.Errorf("Effects() = %+v; want one, under jti %s", efs, jti)
	}
	spent := Refusal{Tool: ToolSendEmail, Reason: credentials.ReasonSpent, TenantID: "t_acme", IdempotencyKey: "e1"}
	if diff := cmp.Diff([]Refusal{spent, spent}, e.s.Refusals()); diff != "" {
		t.Errorf("Refusals() (-want +got):\n%s", diff)
	}

	// Another call's credential is its own: spending one spends no other.
	c2, _ := e.emailCall(t, "e2")
	if a := mustDo(t, e.base, c2); a.status != http.StatusOK {
		t.Errorf("another call: status %d (%s); want 200", a.status, a.body)
	}
	// Spent until it expires, and then refused as expired: never applied
	// again.
	e.clock.Advance(credentials.DefaultTTL + credentials.DefaultSkew)
	if a := mustDo(t, e.base, c); a.status != http.StatusUnauthorized || decode[apiError](t, a.body).Error != string(credentials.ReasonExpired) {
		t.Errorf("after its expiry: status %d (%s); want 401 expired", a.status, a.body)
	}
	if n := e.s.AppliedIn(ToolSendEmail, "t_acme", "e1"); n != 1 {
		t.Errorf("AppliedIn(send_email, e1) = %d after its expiry; want 1", n)
	}
}

// Copies of one request sent at once, all verified before any applies:
// one email, the others refused spent where the effect is recorded.
func TestCredentialSpentConcurrently(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t, Config{})
	c, _ := e.emailCall(t, "e1")
	const n = 12
	statuses := make(chan int, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			a, err := do(t, t.Context(), e.base, c)
			if err != nil {
				t.Errorf("send: %v", err)
				return
			}
			if a.status != http.StatusOK && decode[apiError](t, a.body).Error != string(credentials.ReasonSpent) {
				t.Errorf("status %d (%s); want 200 or 401 spent", a.status, a.body)
			}
			statuses <- a.status
		})
	}
	wg.Wait()
	close(statuses)
	ok := 0
	for st := range statuses {
		if st == http.StatusOK {
			ok++
		}
	}
	if ok != 1 {
		t.Errorf("%d of %d copies answered 200; want 1", ok, n)
	}
	if got := e.s.AppliedIn(ToolSendEmail, "t_acme", "e1"); got != 1 {
		t.Errorf("AppliedIn(send_email, e1) = %d; want 1", got)
	}
}

// An answer that applied nothing spends nothing: the executor sends the
// call again with the same credential after a 429, or a 503 saying not
// applied, and that retry has its effect (once).
func TestCredentialNotSpentWithoutEffect(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusTooManyRequests, http.StatusServiceUnavailable} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			t.Parallel()
			e := newAuthEnv(t, Config{})
			e.s.SetFault(ToolSendEmail, Fault{FailStatus: status, FailTimes: 1})
			c, _ := e.emailCall(t, "e1")
			if a := mustDo(t, e.base, c); a.status != status {
				t.Fatalf("first attempt: status %d (%s); want the injected %d", a.status, a.body, status)
			}
			if a := mustDo(t, e.base, c); a.status != http.StatusOK {
				t.Errorf("retry with the same credential: status %d (%s); want 200", a.status, a.body)
			}
			if a := mustDo(t, e.base, c); a.status != http.StatusUnauthorized || decode[apiError](t, a.body).Error != string(credentials.ReasonSpent) {
				t.Errorf("after the effect: status %d (%s); want 401 spent", a.status, a.body)
			}
			if n := e.s.AppliedIn(ToolSendEmail, "t_acme", "e1"); n != 1 {
				t.Errorf("AppliedIn(send_email, e1) = %d; want 1", n)
			}
		})
	}
}

// The same, through the ledger's HTTP adapter: the 503 the backend answers
// when its keys are unavailable says nothing was applied (Throttled, sent
// again), and the retry with the same credential has its effect.
func TestCredentialNotSpentWhenKeysUnavailable(t *testing.T) {
	t.Parallel()
	clock := &testClock{now: fixedNow()}
	b, err := credentials.New(credentials.Config{Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	var down atomic.Bool
	down.Store(true)
	v, err := credentials.NewVerifier(credentials.VerifierConfig{Now: clock.Now, MinRefresh: time.Nanosecond, Keys: func(ctx context.Context) ([]byte, error) {
		if down.Load() {
			return nil, errors.New("key server down")
		}
		return b.Keys(ctx)
	}})
	if err != nil {
		t.Fatal(err)
	}
	e := newAuthEnv(t, Config{Credentials: v})
	e.broker, e.clock = b, clock
	c, _ := e.emailCall(t, "e1")
	r := httptool.Request{URL: e.base + c.path, IdempotencyKey: c.key, TenantID: c.tenant, CallID: c.callID, Attempt: 1,
		Arguments: []byte(c.body), Credential: strings.TrimPrefix(c.auth, "Bearer ")}
	client := httptool.New(httptool.Config{})
	_, err = client.Call(t.Context(), r)
	if he, ok := errors.AsType[*httptool.Error](err); !ok || he.Kind != httptool.Throttled {
		t.Fatalf("with the keys unavailable: %v; want throttled (nothing applied)", err)
	}
	down.Store(false)
	clock.Advance(time.Millisecond) // past MinRefresh
	r.Attempt = 2
	if _, err := client.Call(t.Context(), r); err != nil {
		t.Errorf("retry with the same credential: %v; want success", err)
	}
	r.Attempt = 3
	_, err = client.Call(t.Context(), r)
	if he, ok := errors.AsType[*httptool.Error](err); !ok || he.Status != http.StatusUnauthorized {
		t.Errorf("after the effect: %v; want 401 (spent)", err)
	}
	if n := e.s.AppliedIn(ToolSendEmail, "t_acme", "e1"); n != 1 {
		t.Errorf("AppliedIn(send_email, e1) = %d; want 1", n)
	}
}

// A native tool deduplicates by key, and spends nothing: a retry of its
// call with the same credential replays its first answer, as before.
func TestNativeToolDoesNotSpend(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t, Config{})
	auth, _ := e.mint(t, ToolCreateTicket, "t_acme", "k1", nil)
	c := call{path: "/tools/create_ticket", key: "k1", tenant: "t_acme", body: `{"title":"t"}`, auth: auth}
	for i := range 3 {
		a := mustDo(t, e.base, c)
		if a.status != http.StatusOK {
			t.Fatalf("request %d: status %d (%s); want 200", i+1, a.status, a.body)
		}
		if i > 0 && a.header.Get(HeaderReplayed) != "true" {
			t.Errorf("request %d: not marked replayed", i+1)
		}
	}
	if n := e.s.AppliedIn(ToolCreateTicket, "t_acme", "k1"); n != 1 {
		t.Errorf("AppliedIn(create_ticket, k1) = %d; want 1", n)
	}
	if r := e.s.Refusals(); len(r) != 0 {
		t.Errorf("Refusals() = %v; want none", r)
	}
}

func TestCredentialStatusLookup(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t, Config{})
	auth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", nil)
	mustDo(t, e.base, refundCall("k1", auth))
	lookup := func(key, auth string) answer {
		t.Helper()
		return mustDo(t, e.base, call{method: http.MethodGet, path: "/tools/refund_order/status?idempotency_key=" + key, tenant: "t_acme", auth: auth})
	}
	otherAuth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k9", nil)
	freshAuth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", nil)
	statusAuth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", func(g *credentials.Grant) { g.Action = credentials.StatusScope(ToolRefundOrder) })
	tests := []struct {
		name       string
		auth       string
		wantStatus int
		wantError  string
	}{
		{name: "no token", wantStatus: http.StatusUnauthorized, wantError: "missing_token"},
		{name: "another call's credential", auth: otherAuth, wantStatus: http.StatusUnauthorized, wantError: "wrong_call"},
		{name: "the call's credential", auth: auth, wantStatus: http.StatusOK},
		{name: "a fresh credential for the call", auth: freshAuth, wantStatus: http.StatusOK},
		{name: "a status lookup's credential", auth: statusAuth, wantStatus: http.StatusOK},
	}
	for _, tc := range tests {
		a := lookup("k1", tc.auth)
		if a.status != tc.wantStatus {
			t.Errorf("%s: status %d (%s); want %d", tc.name, a.status, a.body, tc.wantStatus)
		}
		if tc.wantError != "" {
			if got := decode[apiError](t, a.body).Error; got != tc.wantError {
				t.Errorf("%s: error %q; want %q", tc.name, got, tc.wantError)
			}
		}
	}
	want := []Refusal{
		{Tool: ToolRefundOrder, Reason: credentials.ReasonMissingToken, TenantID: "t_acme", IdempotencyKey: "k1", Lookup: true},
		{Tool: ToolRefundOrder, Reason: credentials.ReasonWrongCall, TenantID: "t_acme", IdempotencyKey: "k1", Lookup: true},
	}
	if diff := cmp.Diff(want, e.s.Refusals()); diff != "" {
		t.Errorf("Refusals() (-want +got):\n%s", diff)
	}
}

// A status lookup's credential (the reconciler's) reads what a call did
// but does not let its holder do it: the tool's action refuses it, and
// applies nothing. Before, lookups were minted with the action's scope.
func TestStatusCredentialCannotAct(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t, Config{})
	statusAuth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k2", func(g *credentials.Grant) { g.Action = credentials.StatusScope(ToolRefundOrder) })
	a := mustDo(t, e.base, refundCall("k2", statusAuth))
	if a.status != http.StatusUnauthorized || decode[apiError](t, a.body).Error != string(credentials.ReasonWrongScope) {
		t.Errorf("the action with a status lookup's credential: status %d (%s); want 401 %s", a.status, a.body, credentials.ReasonWrongScope)
	}
	if n := e.s.Applied(ToolRefundOrder, "k2"); n != 0 {
		t.Errorf("Applied = %d; want 0", n)
	}
}

func TestCredentialKeysUnavailable(t *testing.T) {
	t.Parallel()
	v, err := credentials.NewVerifier(credentials.VerifierConfig{
		Keys: func(context.Context) ([]byte, error) { return nil, errors.New("key server down") },
	})
	if err != nil {
		t.Fatal(err)
	}
	e := newAuthEnv(t, Config{Credentials: v})
	auth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", nil)
	a := mustDo(t, e.base, refundCall("k1", auth))
	if a.status != http.StatusServiceUnavailable {
		t.Errorf("status = %d (%s); want 503: the backend, not the token, is at fault", a.status, a.body)
	}
	if got := decode[apiError](t, a.body).Error; got != string(credentials.ReasonKeysUnavailable) {
		t.Errorf("error = %q; want keys_unavailable", got)
	}
	if got := a.header.Get(HeaderNotApplied); got != "true" {
		t.Errorf("%s: %q; want true: nothing was applied, and the ledger may ask again", HeaderNotApplied, got)
	}
	if n := len(e.s.Effects()); n != 0 {
		t.Errorf("len(Effects()) = %d; want 0", n)
	}
}

// A credential whose revocation cannot be checked (the introspection
// answers 503) applies nothing, and the answer says so
// (X-Ledger-Not-Applied), which the ledger's adapter takes for "ask
// again" (Throttled). Before, the bare 503 of send_email, a tool that
// does not deduplicate, left its outcome unknown and parked the call
// for a human, although nothing had been applied.
func TestIntrospectionUnavailableAppliesNothing(t *testing.T) {
	t.Parallel()
	introspect := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":"unavailable"}`, http.StatusServiceUnavailable)
	}))
	t.Cleanup(introspect.Close)
	e := newAuthEnv(t, Config{IntrospectURL: introspect.URL})
	auth, _ := e.mint(t, ToolSendEmail, "t_acme", "k1", nil)
	r := httptool.Request{URL: e.base + "/tools/" + ToolSendEmail, IdempotencyKey: "k1", TenantID: "t_acme", CallID: "call_k1", Attempt: 1,
		Arguments: []byte(`{"to":"a@example.com","subject":"hi"}`), Credential: strings.TrimPrefix(auth, "Bearer ")}
	_, err := httptool.New(httptool.Config{}).Call(t.Context(), r)
	var he *httptool.Error
	if !errors.As(err, &he) || he.Kind != httptool.Throttled || he.Status != http.StatusServiceUnavailable {
		t.Errorf("send_email with its credential's status unknown: %v; want a 503 taken for throttled (nothing applied)", err)
	}
	if n := len(e.s.Effects()); n != 0 {
		t.Errorf("len(Effects()) = %d; want 0", n)
	}
}

func TestCustomAudience(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t, Config{Audience: "billing-backend"})
	demo, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", nil)
	if a := mustDo(t, e.base, refundCall("k1", demo)); a.status != http.StatusUnauthorized {
		t.Errorf("demo-backend credential at billing-backend: status %d; want 401", a.status)
	}
	billing, _ := e.mint(t, ToolRefundOrder, "t_acme", "k2", func(g *credentials.Grant) { g.Audience = "billing-backend" })
	if a := mustDo(t, e.base, refundCall("k2", billing)); a.status != http.StatusOK {
		t.Errorf("billing-backend credential: status %d (%s); want 200", a.status, a.body)
	}
}

func TestNoVerifierIgnoresAuthorization(t *testing.T) {
	t.Parallel()
	s, ts := newBackend(t, Config{})
	if a := mustDo(t, ts.URL, refundCall("k1", "Bearer whatever")); a.status != http.StatusOK {
		t.Errorf("status %d; want 200 without a verifier", a.status)
	}
	if ef := s.Effects(); len(ef) != 1 || ef[0].JTI != "" {
		t.Errorf("Effects() = %+v; want one effect without a jti", ef)
	}
}

func TestCredentialNeverLeaks(t *testing.T) {
	t.Parallel()
	var logs bytes.Buffer
	journal := filepath.Join(t.TempDir(), "effects.jsonl")
	e := newAuthEnv(t, Config{JournalPath: journal, Logger: slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	auth, _ := e.mint(t, ToolRefundOrder, "t_acme", "k1", nil)
	token := strings.TrimPrefix(auth, "Bearer ")
	var bodies bytes.Buffer
	for _, c := range []call{
		refundCall("k1", auth),
		refundCall("k1", auth),
		refundCall("k2", auth),                 // replayed
		refundCall("k1", auth+"x"),             // bad signature
		refundCall("k1", "Bearer "+token[:20]), // malformed
		refundCall("k1", strings.Replace(auth, ".", ".x", 1)),
		{method: http.MethodGet, path: "/tools/refund_order/status?idempotency_key=k1", tenant: "t_acme", auth: auth},
		{method: http.MethodGet, path: "/effects"},
	} {
		a := mustDo(t, e.base, c)
		bodies.Write(a.body)
		for k, v := range a.header {
			bodies.WriteString(k + ": " + strings.Join(v, ",") + "\n")
		}
	}
	got, err := ReadJournal(journal)
	if err != nil {
		t.Fatal(err)
	}
	parts := strings.Split(token, ".")
	payload, sig := parts[1], parts[2]
	for name, out := range map[string]string{"log": logs.String(), "answers": bodies.String(), "effects": fmt.Sprint(got, e.s.Refusals())} {
		if out == "" {
			t.Errorf("%s: empty; the test checked nothing", name)
		}
		if strings.Contains(out, sig) || strings.Contains(out, payload) {
			t.Errorf("%s contains the token:\n%s", name, out)
		}
	}
}

// TestIntrospectionKeepsConnections: the backend asks the introspection
// endpoint about every tool request, so its client must keep a
// connection per request in flight. With http.DefaultTransport's two
// idle connections per host, most of these requests dialled (and then
// closed) one of their own.
func TestIntrospectionKeepsConnections(t *testing.T) {
	t.Parallel()
	var dials atomic.Int64
	introspect := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"active":true}`))
		// The JSON ends before the body does (chunked, the rest a
		// moment later): the client must read the body to its end for
		// the connection to serve again.
		w.(http.Flusher).Flush()
		time.Sleep(time.Millisecond)
		_, _ = w.Write([]byte("\n"))
	}))
	introspect.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			dials.Add(1)
		}
	}
	introspect.Start()
	t.Cleanup(introspect.Close)
	e := newAuthEnv(t, Config{IntrospectURL: introspect.URL})

	const workers, perWorker = 16, 25
	auths := make([][]string, workers)
	for w := range auths {
		for i := range perWorker {
			auth, _ := e.mint(t, ToolRefundOrder, "t_acme", fmt.Sprintf("k%d-%d", w, i), nil)
			auths[w] = append(auths[w], auth)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, workers*perWorker)
	for w := range workers {
		wg.Go(func() {
			for i, auth := range auths[w] {
				a, err := do(t, t.Context(), e.base, refundCall(fmt.Sprintf("k%d-%d", w, i), auth))
				if err == nil && a.status != http.StatusOK {
					err = fmt.Errorf("status %d: %s", a.status, a.body)
				}
				if err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := len(e.s.Effects()); n != workers*perWorker {
		t.Errorf("%d effects; want %d", n, workers*perWorker)
	}
	// About one connection per request in flight. A connection goes
	// back to the pool just after its answer was read, so a worker's
	// next request may now and then find it not yet there and dial
	// another: twice as many leaves room for that, and is still far
	// below a connection for most requests (198 and 326 before).
	if n, most := dials.Load(), int64(2*workers); n > most {
		t.Errorf("%d connections to the introspection endpoint for %d requests, %d at a time; want at most %d", n, workers*perWorker, workers, most)
	}
}
