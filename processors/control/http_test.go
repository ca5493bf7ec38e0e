package control

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
)

// httpEnv is a Service behind an httptest server, with real operator
// assertions and a real credential broker; every response body and
// header, and every log line, is kept to look for secrets in.
type httpEnv struct {
	t      *testing.T
	ident  *processorstest.Identity
	broker *credentials.Broker
	// shift moves the broker's clock, to mint expired credentials.
	shift atomic.Int64
	srv   *httptest.Server
	svc   *Service
	logs  *ledgertest.LogBuffer

	mu  sync.Mutex
	out []string
}

func newHTTPEnv(t *testing.T, edit func(*Config)) *httpEnv {
	t.Helper()
	e := &httpEnv{t: t, ident: processorstest.NewIdentity(t), logs: &ledgertest.LogBuffer{}}
	logger := slog.New(slog.NewJSONHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	b, err := credentials.New(credentials.Config{
		Now:    func() time.Time { return time.Now().Add(time.Duration(e.shift.Load())) },
		Logger: logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	e.broker = b
	inspector, err := credentials.NewVerifier(credentials.VerifierConfig{Keys: b.Keys, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	st := NewState(logger)
	st.topic = ledger.Topics{}.WithDefaults().Control
	close(st.ready)
	markCurrent(st, time.Now().Add(time.Hour))
	cfg := Config{State: st, Identity: e.ident.Verifier, Credentials: inspector, Logger: logger}
	if edit != nil {
		edit(&cfg)
	}
	e.svc, _ = newLoopbackService(t, cfg)
	e.srv = httptest.NewServer(e.svc.Handler())
	t.Cleanup(e.srv.Close)
	return e
}

func (e *httpEnv) assertion(id identity.Identity) string {
	e.t.Helper()
	a, err := e.ident.Issuer.Mint(id, processorstest.Audience, 10*time.Minute)
	if err != nil {
		e.t.Fatal(err)
	}
	return a
}

// credential mints a credential for tool in tenant, in the family of the
// broker's key.
func (e *httpEnv) credential(tool, tenant string) credentials.Credential {
	e.t.Helper()
	c, err := e.broker.Mint(credentials.Grant{
		Tenant: tenant, User: "u_1", Agent: "agent_1", Executor: "executor-1", Tool: tool,
		Audience: "demo-backend", IdempotencyKey: "run_1:step_1:" + tool,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// do sends a request and returns the status and body, keeping both.
func (e *httpEnv) do(method, path, contentType, auth, body string) (int, []byte) {
	e.t.Helper()
	req, err := http.NewRequestWithContext(e.t.Context(), method, e.srv.URL+path, strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := e.srv.Client().Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	var hdr strings.Builder
	_ = resp.Header.Write(&hdr)
	e.mu.Lock()
	e.out = append(e.out, hdr.String(), string(b))
	e.mu.Unlock()
	return resp.StatusCode, b
}

func (e *httpEnv) introspect(token string) (int, map[string]any) {
	e.t.Helper()
	status, body := e.do("POST", IntrospectPath, "application/x-www-form-urlencoded", "", url.Values{"token": {token}}.Encode())
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil {
		e.t.Fatalf("introspection answer %s: %v", body, err)
	}
	return status, m
}

// assertNoSecrets fails if any response or log line holds one of the
// secrets, whole or any of its segments.
func (e *httpEnv) assertNoSecrets(secrets ...string) {
	e.t.Helper()
	e.mu.Lock()
	all := strings.Join(e.out, "\n") + "\n" + e.logs.String()
	e.mu.Unlock()
	for _, s := range secrets {
		forms := []string{s}
		if parts := strings.Split(s, "."); len(parts) == 3 {
			forms = append(forms, parts[1], parts[2])
		}
		for _, f := range forms {
			if strings.Contains(all, f) {
				e.t.Errorf("a response or log line holds a secret (%.12s...)", f)
			}
		}
	}
}

func errorCode(t *testing.T, body []byte) string {
	t.Helper()
	var m struct {
		Error apiError `json:"error"`
	}
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("error body %s: %v", body, err)
	}
	return m.Error.Code
}

// The operator API answers each outcome with its status and code. The
// steps run in order: later ones depend on earlier ones.
func TestHandler(t *testing.T) {
	e := newHTTPEnv(t, nil)
	var (
		rootTok  = "Bearer " + e.assertion(platformOp)
		acmeTok  = "Bearer " + e.assertion(acmeOp)
		bossTok  = "Bearer " + e.assertion(approver)
		agentTok = "Bearer " + e.ident.Assertion(t, "t_acme", "u_1") // valid, no role
	)
	const js = "application/json"
	cases := []struct {
		name       string
		method     string
		path       string
		auth       string
		body       string
		wantStatus int
		wantCode   string
		check      func(t *testing.T, body []byte)
	}{
		{name: "no credentials", method: "GET", path: "/v1/control", wantStatus: 401, wantCode: CodeUnauthenticated},
		{name: "garbage bearer", method: "GET", path: "/v1/control", auth: "Bearer not.a.jwt", wantStatus: 401, wantCode: CodeUnauthenticated},
		{name: "basic auth", method: "GET", path: "/v1/control", auth: "Basic " + strings.TrimPrefix(rootTok, "Bearer "), wantStatus: 401, wantCode: CodeUnauthenticated},
		{name: "approver is not an operator", method: "GET", path: "/v1/control", auth: bossTok, wantStatus: 403, wantCode: CodeForbidden},
		{name: "agent assertion", method: "POST", path: "/v1/control/freeze", auth: agentTok, body: `{"tool":"refund_order","reason":"r"}`, wantStatus: 403, wantCode: CodeForbidden},
		{name: "freeze", method: "POST", path: "/v1/control/freeze", auth: rootTok, body: `{"tool":"refund_order","reason":"incident 42"}`, wantStatus: 200,
			check: func(t *testing.T, body []byte) {
				var a Action
				if err := json.Unmarshal(body, &a); err != nil {
					t.Fatal(err)
				}
				if a.Subject != "tool:refund_order" || a.By != "op_root" || a.Reason != "incident 42" {
					t.Errorf("freeze answered %+v; want the freeze of refund_order by op_root", a)
				}
				if _, ok := e.svc.cfg.State.Frozen("refund_order", "t_acme"); !ok {
					t.Error("refund_order not frozen after a 200")
				}
			}},
		{name: "freeze body not JSON", method: "POST", path: "/v1/control/freeze", auth: rootTok, body: `tool=refund_order`, wantStatus: 400, wantCode: CodeInvalidRequest},
		{name: "freeze unknown field", method: "POST", path: "/v1/control/freeze", auth: rootTok, body: `{"tool":"refund_order","reason":"r","all":true}`, wantStatus: 400, wantCode: CodeInvalidRequest},
		{name: "freeze trailing data", method: "POST", path: "/v1/control/freeze", auth: rootTok, body: `{"tool":"refund_order","reason":"r"} {}`, wantStatus: 400, wantCode: CodeInvalidRequest},
		{name: "freeze body too large", method: "POST", path: "/v1/control/freeze", auth: rootTok, body: `{"tool":"refund_order","reason":"` + strings.Repeat("x", maxBodyBytes) + `"}`, wantStatus: 400, wantCode: CodeInvalidRequest},
		{name: "freeze without reason", method: "POST", path: "/v1/control/freeze", auth: rootTok, body: `{"tool":"refund_order"}`, wantStatus: 400, wantCode: CodeInvalidRequest},
		{name: "freeze of another tenant", method: "POST", path: "/v1/control/freeze", auth: acmeTok, body: `{"tool":"send_email","tenant":"t_other","reason":"r"}`, wantStatus: 403, wantCode: CodeForbidden},
		{name: "tenant freeze", method: "POST", path: "/v1/control/freeze", auth: acmeTok, body: `{"tool":"send_email","reason":"r"}`, wantStatus: 200},
		{name: "unfreeze of what is not frozen", method: "POST", path: "/v1/control/unfreeze", auth: rootTok, body: `{"tool":"send_email","reason":"r"}`, wantStatus: 409, wantCode: CodeNotFrozen},
		{name: "freeze naming a freeze", method: "POST", path: "/v1/control/freeze", auth: acmeTok, body: `{"tool":"send_email","reason":"r","freeze_at":"2026-01-01T00:00:00Z"}`, wantStatus: 400, wantCode: CodeInvalidRequest},
		{name: "unfreeze of another freeze than the one in force", method: "POST", path: "/v1/control/unfreeze", auth: acmeTok, body: `{"tool":"send_email","reason":"fixed","freeze_at":"2026-01-01T00:00:00Z"}`, wantStatus: 409, wantCode: CodeFreezeChanged},
		{name: "unfreeze", method: "POST", path: "/v1/control/unfreeze", auth: acmeTok, body: `{"tool":"send_email","reason":"fixed"}`, wantStatus: 200},
		{name: "revoke jti as a tenant operator", method: "POST", path: "/v1/control/revoke", auth: acmeTok, body: `{"jti":"jti-1","reason":"r"}`, wantStatus: 403, wantCode: CodeForbidden},
		{name: "revoke both", method: "POST", path: "/v1/control/revoke", auth: rootTok, body: `{"jti":"jti-1","family":"refund_order:t_acme:1","reason":"r"}`, wantStatus: 400, wantCode: CodeInvalidRequest},
		{name: "revoke family", method: "POST", path: "/v1/control/revoke", auth: acmeTok, body: `{"family":"refund_order:t_acme:1","reason":"r"}`, wantStatus: 200},
		{name: "snapshot", method: "GET", path: "/v1/control", auth: acmeTok, wantStatus: 200,
			check: func(t *testing.T, body []byte) {
				var snap Snapshot
				if err := json.Unmarshal(body, &snap); err != nil {
					t.Fatal(err)
				}
				if len(snap.Freezes) != 1 || snap.Freezes[0].Subject != "tool:refund_order" ||
					len(snap.Revocations) != 1 || snap.Revocations[0].Subject != "family:refund_order:t_acme:1" {
					t.Errorf("snapshot %+v; want the refund_order freeze and acme's family", snap)
				}
			}},
		{name: "wrong method", method: "DELETE", path: "/v1/control", auth: rootTok, wantStatus: 405},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			status, body := e.do(tc.method, tc.path, js, tc.auth, tc.body)
			if status != tc.wantStatus {
				t.Fatalf("%s %s = %d %s; want %d", tc.method, tc.path, status, body, tc.wantStatus)
			}
			if tc.wantCode != "" {
				if got := errorCode(t, body); got != tc.wantCode {
					t.Errorf("error code %q; want %q", got, tc.wantCode)
				}
			}
			if tc.check != nil {
				tc.check(t, body)
			}
		})
	}
	// Each refusal for want of the right is logged with who asked,
	// which a refused request's answer alone left no trace of.
	var refused []string
	for _, line := range strings.Split(e.logs.String(), "\n") {
		var l struct{ Level, Msg, Path, User, Tenant_ID string }
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "control request refused: not the caller's to make" && l.Level == "WARN" {
			refused = append(refused, l.Path+" "+l.User+"@"+l.Tenant_ID)
		}
	}
	want := []string{"/v1/control u_boss@t_acme", "/v1/control/freeze u_1@t_acme", "/v1/control/freeze op_acme@t_acme", "/v1/control/revoke op_acme@t_acme"}
	if diff := cmp.Diff(want, refused); diff != "" {
		t.Errorf("refusals logged (-want +got):\n%s", diff)
	}
	e.assertNoSecrets(rootTok[7:], acmeTok[7:], bossTok[7:], agentTok[7:])
}

func TestHandlerNotYetAppliedAndNotReady(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, func(c *Config) { c.ApplyWait = 10 * time.Millisecond })
	e.svc.cfg.Publisher.(*loopback).apply = false
	root := "Bearer " + e.assertion(platformOp)
	if status, body := e.do("POST", "/v1/control/freeze", "application/json", root, `{"tool":"refund_order","reason":"r"}`); status != 202 {
		t.Errorf("freeze not applied locally = %d %s; want 202", status, body)
	}

	nr := newHTTPEnv(t, func(c *Config) { c.State = NewState(nil) })
	root = "Bearer " + nr.assertion(platformOp)
	if status, body := nr.do("POST", "/v1/control/freeze", "application/json", root, `{"tool":"refund_order","reason":"r"}`); status != 503 || errorCode(t, body) != CodeUnavailable {
		t.Errorf("freeze before Ready = %d %s; want 503 unavailable", status, body)
	}
	cred := nr.credential("refund_order", "t_acme")
	if status, m := nr.introspect(cred.Token); status != 503 {
		t.Errorf("introspection before Ready = %d %v; want 503", status, m)
	}
	nr.assertNoSecrets(cred.Token)
}

// Introspection says active for a good credential until its jti or its
// family is revoked, never for an expired or forged one, and no answer or
// log line holds a token.
func TestIntrospection(t *testing.T) {
	t.Parallel()
	// Revocations are compared with the credentials' issue times: the
	// control plane's clock is the real one here.
	// A revocation skew short enough that credentials minted past it are
	// not yet refused by their nbf (the verifier's skew is 30 s).
	const skew = 5 * time.Second
	e := newHTTPEnv(t, func(c *Config) { c.Now, c.RevocationSkew = time.Now, skew })
	root := "Bearer " + e.assertion(platformOp)
	acme := "Bearer " + e.assertion(acmeOp)
	revoke := func(auth, body string) {
		t.Helper()
		if status, b := e.do("POST", "/v1/control/revoke", "application/json", auth, body); status != 200 {
			t.Fatalf("revoke %s = %d %s", body, status, b)
		}
	}
	inactive := map[string]any{"active": false}

	first := e.credential("refund_order", "t_acme")
	second := e.credential("refund_order", "t_acme") // same family
	other := e.credential("send_email", "t_acme")
	e.shift.Store(int64(-time.Hour))
	expired := e.credential("refund_order", "t_acme")
	e.shift.Store(0)
	stranger, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	forged, err := stranger.Mint(credentials.Grant{Tenant: "t_acme", User: "u_1", Agent: "a", Executor: "x", Tool: "refund_order", Audience: "demo-backend", IdempotencyKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	p := strings.Split(first.Token, ".")
	q := strings.Split(other.Token, ".")
	tampered := p[0] + "." + q[1] + "." + p[2]

	status, got := e.introspect(first.Token)
	want := map[string]any{
		"active": true, "jti": first.JTI, "exp": float64(first.ExpiresAt.Unix()),
		"scope": "tool::refund_order", "aud": "demo-backend", "family": first.Family,
	}
	if status != 200 {
		t.Fatalf("introspect active = %d %v; want 200", status, got)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("active credential (-want +got):\n%s", diff)
	}

	for name, tok := range map[string]string{"expired": expired.Token, "forged": forged.Token, "tampered": tampered, "garbage": "not-a-token"} {
		if status, got := e.introspect(tok); status != 200 || !cmp.Equal(got, inactive) {
			t.Errorf("introspect %s = %d %v; want 200 %v", name, status, got, inactive)
		}
	}

	revoke(root, `{"jti":"`+first.JTI+`","reason":"leaked"}`)
	if _, got := e.introspect(first.Token); !cmp.Equal(got, inactive) {
		t.Errorf("after revoking its jti: %v; want %v", got, inactive)
	}
	if _, got := e.introspect(second.Token); got["active"] != true {
		t.Errorf("a sibling after revoking one jti: %v; want active", got)
	}
	revoke(acme, `{"family":"`+first.Family+`","reason":"executor compromised"}`)
	if _, got := e.introspect(second.Token); !cmp.Equal(got, inactive) {
		t.Errorf("after revoking its family: %v; want %v", got, inactive)
	}
	// A credential of the family issued after the revocation was never
	// exposed: it is active, once past the clocks' skew (an executor
	// whose clock runs ahead stamps a credential minted before the
	// revocation with a later iat).
	e.shift.Store(int64(skew - 2*time.Second)) // iat has whole seconds
	skewed := e.credential("refund_order", "t_acme")
	e.shift.Store(int64(skew + 2*time.Second))
	later := e.credential("refund_order", "t_acme")
	e.shift.Store(0)
	if _, got := e.introspect(skewed.Token); !cmp.Equal(got, inactive) {
		t.Errorf("a credential of a revoked family stamped within the skew after the revocation: %v; want %v", got, inactive)
	}
	if _, got := e.introspect(later.Token); got["active"] != true {
		t.Errorf("a credential of a revoked family issued after the revocation and its skew: %v; want active", got)
	}
	if _, got := e.introspect(other.Token); got["active"] != true {
		t.Errorf("another family after a family revocation: %v; want active", got)
	}

	// The token is read from the form body only.
	if status, body := e.do("POST", IntrospectPath+"?token="+url.QueryEscape(other.Token), "application/x-www-form-urlencoded", "", ""); status != 400 {
		t.Errorf("token in the query string = %d %s; want 400", status, body)
	}
	if status, body := e.do("POST", IntrospectPath, "application/json", "", `{"token":"`+other.Token+`"}`); status != 415 {
		t.Errorf("JSON body = %d %s; want 415", status, body)
	}
	if status, body := e.do("POST", IntrospectPath, "application/x-www-form-urlencoded", "", "token_type_hint=access_token"); status != 400 {
		t.Errorf("no token = %d %s; want 400", status, body)
	}
	if status, body := e.do("GET", IntrospectPath, "", "", ""); status != 405 {
		t.Errorf("GET = %d %s; want 405", status, body)
	}
	e.assertNoSecrets(first.Token, second.Token, other.Token, expired.Token, forged.Token, tampered, root[7:], acme[7:])
}

// A credential whose signature its caller verified (a tool, through
// credentials.Introspector) under a key none of this service's key sets
// holds is answered 503, to be asked again, not inactive: the sets here
// lag the tool's (an executor missing from --credential-jwks-url), and the
// tool would report "inactive" as a revocation nobody made. Without the
// caller's word, such a credential (a forged one, say) is inactive.
func TestIntrospectionOfAKeyNotKnownHere(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, nil)
	unknown, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	cred, err := unknown.Mint(credentials.Grant{Tenant: "t_acme", User: "u_1", Agent: "a", Executor: "x-new", Tool: "refund_order", Audience: "demo-backend", IdempotencyKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	form := url.Values{"token": {cred.Token}, credentials.FormVerified: {"true"}}
	for range 3 {
		if status, body := e.do("POST", IntrospectPath, "application/x-www-form-urlencoded", "", form.Encode()); status != 503 || !strings.Contains(string(body), CodeUnavailable) {
			t.Errorf("introspect a verified credential of a key not known here = %d %s; want 503 %s", status, body, CodeUnavailable)
		}
	}
	// Warned of once: the caller's word is not checked, and anyone who
	// reaches the endpoint could otherwise fill the log.
	if n := strings.Count(e.logs.String(), `"level":"WARN","msg":"introspection: a credential its caller says it verified`); n != 1 {
		t.Errorf("%d warnings of a key not known here after three questions; want 1:\n%s", n, e.logs.String())
	}
	if status, got := e.introspect(cred.Token); status != 200 || got["active"] != false {
		t.Errorf("introspect it without the caller's word = %d %v; want 200 inactive", status, got)
	}
	e.assertNoSecrets(cred.Token)
}

func TestIntrospectionUnavailableKeys(t *testing.T) {
	t.Parallel()
	failing, err := credentials.NewVerifier(credentials.VerifierConfig{
		Keys: func(context.Context) ([]byte, error) { return nil, errors.New("key server down") },
	})
	if err != nil {
		t.Fatal(err)
	}
	e := newHTTPEnv(t, func(c *Config) { c.Credentials = failing })
	cred := e.credential("refund_order", "t_acme")
	if status, got := e.introspect(cred.Token); status != 503 {
		t.Errorf("introspect without keys = %d %v; want 503 (not a verdict on the token)", status, got)
	}
	e.assertNoSecrets(cred.Token)
}

// A copy of the control state not known to be current (last confirmed a
// minute ago, past the second allowed) may lack a revocation: introspection
// answers 503, after waiting up to a second for it to catch up, rather
// than call a credential active.
func TestIntrospectionStaleState(t *testing.T) {
	t.Parallel()
	stale := NewState(nil)
	stale.topic = ledger.Topics{}.WithDefaults().Control
	close(stale.ready)
	markCurrent(stale, time.Now().Add(-time.Minute))
	e := newHTTPEnv(t, func(c *Config) { c.State = stale })
	cred := e.credential("refund_order", "t_acme")
	if status, got := e.introspect(cred.Token); status != 503 || got["error"] == nil {
		t.Errorf("introspect on a stale state = %d %v; want 503 with an error", status, got)
	}
	markCurrent(stale, time.Now())
	if status, got := e.introspect(cred.Token); status != 200 || got["active"] != true {
		t.Errorf("introspect once current = %d %v; want 200, active", status, got)
	}
	e.assertNoSecrets(cred.Token)
}

// stalingInspector is an inspector whose inspection (a key fetch from a
// slow executor, say) outlasts the state's bound: the copy is stale once
// it answers.
type stalingInspector struct {
	Inspector
	state *State
}

func (s stalingInspector) Inspect(ctx context.Context, token string) (credentials.Claims, error) {
	s.state.asOf.Store(int64(-time.Minute)) // known current only a minute before the state began
	return s.Inspector.Inspect(ctx, token)
}

// The revocations an introspection reads are those of a copy current
// after the inspection, which may wait on a key fetch for seconds: a copy
// gone stale meanwhile is answered 503, as before it. Before, it was
// checked before the inspection only, and a credential revoked during a
// slow fetch answered active.
func TestIntrospectionStaleAfterTheInspection(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, func(c *Config) { c.Credentials = stalingInspector{Inspector: c.Credentials, state: c.State} })
	cred := e.credential("refund_order", "t_acme")
	if status, got := e.introspect(cred.Token); status != 503 || got["active"] != nil {
		t.Errorf("introspect on a copy gone stale during the inspection = %d %v; want 503, no verdict", status, got)
	}
}

func TestIntrospectionNotServedWithoutInspector(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, func(c *Config) { c.Credentials = nil })
	if status, _ := e.do("POST", IntrospectPath, "application/x-www-form-urlencoded", "", "token=x"); status != 404 {
		t.Errorf("introspection without Config.Credentials = %d; want 404", status)
	}
}
