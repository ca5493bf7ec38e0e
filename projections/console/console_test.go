package console

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/projections/projectionstest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

func TestNewRequiresAPIAndAuthenticate(t *testing.T) {
	if _, err := New(Config{}); err == nil {
		t.Errorf("New(Config{}) = nil error; want one (API and Authenticate are required)")
	}
}

func TestSignIn(t *testing.T) {
	fx := newFixture(t)
	b := fx.browser()
	login := b.get("/login")
	if !strings.Contains(login.Body.String(), `name="assertion"`) || !strings.Contains(login.Body.String(), `<label for="assertion">`) {
		t.Fatalf("login page has no labelled assertion field:\n%s", login.Body)
	}
	if strings.Contains(login.Body.String(), "Dev login") {
		t.Errorf("login page offers Dev login without Config.DevLogin")
	}
	w := b.do("POST", "/login", url.Values{"csrf": {csrfOf(t, login.Body.String())}, "assertion": {assertApprover}}, nil)
	if w.Code != http.StatusSeeOther {
		t.Fatalf("POST /login = %d; want 303", w.Code)
	}
	var ck *http.Cookie
	for _, c := range w.Result().Cookies() {
		if c.Name == CookieName {
			ck = c
		}
	}
	if ck == nil {
		t.Fatalf("POST /login set no %s cookie", CookieName)
	}
	raw, err := base64.RawURLEncoding.DecodeString(ck.Value)
	if err != nil || len(raw) != 32 {
		t.Errorf("session id %q decodes to %d bytes (%v); want 32 random bytes", ck.Value, len(raw), err)
	}
	if !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode || ck.Path != "/" || ck.Secure {
		t.Errorf("cookie HttpOnly=%v SameSite=%v Path=%q Secure=%v; want true, Strict, /, false over plain HTTP", ck.HttpOnly, ck.SameSite, ck.Path, ck.Secure)
	}
	// An hour past the assertion's expiry, when the server ends the
	// session: the browser still names it then, to be told it ended.
	if want := identities[assertApprover].Expires.Add(time.Hour).Truncate(time.Second); !ck.Expires.Equal(want) {
		t.Errorf("cookie expires %v; want an hour past the assertion's expiry, %v", ck.Expires, want)
	}
	page := b.get("/approvals")
	if page.Code != http.StatusOK {
		t.Fatalf("GET /approvals after sign-in = %d; want 200", page.Code)
	}
	body := page.Body.String()
	for _, want := range []string{"<strong>alice</strong>", "Signed in as alice", `action="/logout"`} {
		if !strings.Contains(body, want) {
			t.Errorf("approvals page after sign-in lacks %q", want)
		}
	}
	// Another session is another random id.
	b2 := fx.signedIn(assertApprover)
	if b2.cookies[CookieName].Value == b.cookies[CookieName].Value {
		t.Errorf("two sign-ins got the same session id")
	}
}

func TestSessionCookieSecureOverTLS(t *testing.T) {
	fx := newFixture(t)
	b := fx.browser()
	b.tls = true
	b.signIn(assertOperator)
	if !b.cookies[CookieName].Secure {
		t.Errorf("session cookie over TLS is not Secure")
	}
}

func TestSignInRefused(t *testing.T) {
	for _, tc := range []struct {
		name, assertion, want string
	}{
		{"unknown assertion", "forged", "m=refused"},
		{"no operator or approver role", assertViewer, "m=role"},
		{"no roles", assertNoRoles, "m=role"},
		{"no expiry", assertNoExpiry, "m=no_expiry"},
		// Not said to be bad: to be signed in with again shortly.
		{"not judged now", assertKeysBehind, "m=try_later"},
		{"empty", "  ", "m=empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t)
			b := fx.browser()
			login := b.get("/login")
			w := b.do("POST", "/login", url.Values{"csrf": {csrfOf(t, login.Body.String())}, "assertion": {tc.assertion}}, nil)
			if w.Code != http.StatusSeeOther || !strings.Contains(w.Header().Get("Location"), tc.want) {
				t.Errorf("POST /login = %d to %q; want 303 to /login?%s", w.Code, w.Header().Get("Location"), tc.want)
			}
			if _, ok := b.cookies[CookieName]; ok {
				t.Errorf("a refused sign-in set the session cookie")
			}
			if n := fx.c.sessions.len(); n != 0 {
				t.Errorf("sessions after a refused sign-in = %d; want 0", n)
			}
			if got := b.get("/approvals"); got.Code != http.StatusSeeOther || !strings.HasPrefix(got.Header().Get("Location"), "/login") {
				t.Errorf("GET /approvals = %d to %q; want 303 to /login", got.Code, got.Header().Get("Location"))
			}
			page := b.get(w.Header().Get("Location"))
			if !strings.Contains(page.Body.String(), `class="flash bad"`) {
				t.Errorf("login page after refusal shows no error notice")
			}
		})
	}
}

func TestSessionEndsAtAssertionExpiry(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	fx.advance(59 * time.Minute)
	if w := b.get("/health"); w.Code != http.StatusOK {
		t.Fatalf("GET /health a minute before expiry = %d; want 200", w.Code)
	}
	fx.advance(time.Minute)
	w := b.get("/health")
	if w.Code != http.StatusSeeOther || w.Header().Get("Location") != "/login?m=ended" {
		t.Errorf("GET /health at expiry = %d to %q; want 303 to /login?m=ended", w.Code, w.Header().Get("Location"))
	}
	if n := fx.c.sessions.len(); n != 0 {
		t.Errorf("sessions after expiry = %d; want 0 (the expired one deleted)", n)
	}
	fx.api.reset()
	if w := b.post("/incidents/act", url.Values{"action": {"freeze"}, "tool": {"refund_order"}, "reason": {"x"}}); w.Code != http.StatusForbidden {
		t.Errorf("POST with an expired session = %d; want 403", w.Code)
	}
	if reqs := fx.api.requests(); len(reqs) != 0 {
		t.Errorf("the API got %d requests from an expired session; want none", len(reqs))
	}
}

func TestSessionsBoundedAndSwept(t *testing.T) {
	fx := newFixture(t, func(*fixture) fixtureOpt { return func(c *Config) { c.MaxSessions = 2 } })
	first := fx.signedIn(assertOperator)
	fx.advance(time.Second)
	second := fx.signedIn(assertApprover)
	fx.advance(time.Second)
	third := fx.signedIn(assertPlatform)
	if n := fx.c.sessions.len(); n != 2 {
		t.Errorf("sessions = %d; want the bound 2", n)
	}
	if w := first.get("/health"); w.Code != http.StatusSeeOther {
		t.Errorf("the oldest session still works (%d) after the bound pushed it out", w.Code)
	}
	for _, b := range []*browser{second, third} {
		if w := b.get("/health"); w.Code != http.StatusOK {
			t.Errorf("a recent session = %d; want 200", w.Code)
		}
	}
	// Expired sessions are swept before anyone live is pushed out.
	fx.advance(2 * time.Hour)
	fx.c.sessions.mu.Lock()
	for k, s := range fx.c.sessions.byID {
		s.id.Expires = t0.Add(time.Hour) // both expired now
		fx.c.sessions.byID[k] = s
	}
	fx.c.sessions.mu.Unlock()
	identities["assert-late"] = Identity{User: "late", Tenant: "acme", Roles: []string{"operator"}, Expires: t0.Add(5 * time.Hour)}
	defer delete(identities, "assert-late")
	fx.signedIn("assert-late")
	if n := fx.c.sessions.len(); n != 1 {
		t.Errorf("sessions after a sign-in with two expired ones = %d; want 1 (expired swept)", n)
	}
}

// One user signing in again and again without a cookie (the login form's
// token replays) ends their own oldest sessions once they hold
// MaxSessionsPerUser, not everyone else's: before, an approver of one
// tenant could fill MaxSessions and sign the platform's responders out
// of the console during an incident.
func TestSessionsBoundedPerUser(t *testing.T) {
	fx := newFixture(t, func(*fixture) fixtureOpt {
		return func(c *Config) { c.MaxSessions, c.MaxSessionsPerUser = 3, 2 }
	})
	victim := fx.signedIn(assertPlatform)
	var flood []*browser
	for range 5 {
		fx.advance(time.Second)
		flood = append(flood, fx.signedIn(assertApprover))
	}
	if w := victim.get("/health"); w.Code != http.StatusOK {
		t.Errorf("the platform operator's session after another user signed in 5 times = %d; want 200", w.Code)
	}
	if n := fx.c.sessions.len(); n != 3 {
		t.Errorf("sessions = %d; want 3 (the victim's and the flooder's last 2)", n)
	}
	for i, b := range flood {
		want := http.StatusSeeOther
		if i >= len(flood)-2 {
			want = http.StatusOK
		}
		if w := b.get("/health"); w.Code != want {
			t.Errorf("the flooder's session %d = %d; want %d", i, w.Code, want)
		}
	}
}

func TestLogout(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	stolen := b.cookies[CookieName].Value

	// Without the CSRF token, logout is refused and the session lives.
	if w := b.do("POST", "/logout", url.Values{}, nil); w.Code != http.StatusForbidden {
		t.Errorf("POST /logout without CSRF = %d; want 403", w.Code)
	}
	if w := b.get("/health"); w.Code != http.StatusOK {
		t.Fatalf("session gone after a refused logout: %d", w.Code)
	}

	w := b.post("/logout", nil)
	if w.Code != http.StatusSeeOther || w.Header().Get("Location") != "/login?m=signed_out" {
		t.Errorf("POST /logout = %d to %q; want 303 to /login?m=signed_out", w.Code, w.Header().Get("Location"))
	}
	if n := fx.c.sessions.len(); n != 0 {
		t.Errorf("sessions after logout = %d; want 0", n)
	}
	// The old cookie names nothing any more.
	replay := fx.browser()
	replay.cookies[CookieName] = &http.Cookie{Name: CookieName, Value: stolen}
	if w := replay.get("/approvals"); w.Code != http.StatusSeeOther {
		t.Errorf("GET with the logged-out session id = %d; want 303 to /login", w.Code)
	}
}

func TestDevLogin(t *testing.T) {
	t.Run("offered", func(t *testing.T) {
		fx := newFixture(t, withDevLogin)
		b := fx.browser()
		b.local = true
		login := b.get("/login").Body.String()
		for _, want := range []string{`action="/login/dev"`, "Dev login", "operator and approver roles", "dev issuer", "only in <code>ledger dev</code>"} {
			if !strings.Contains(login, want) {
				t.Errorf("login page lacks %q", want)
			}
		}
		w := b.do("POST", "/login/dev", url.Values{"csrf": {csrfOf(t, login)}}, nil)
		if w.Code != http.StatusSeeOther || w.Header().Get("Location") != "/approvals" {
			t.Fatalf("POST /login/dev = %d to %q; want 303 to /approvals", w.Code, w.Header().Get("Location"))
		}
		if fx.devUsed != 1 {
			t.Errorf("DevLogin called %d times; want 1", fx.devUsed)
		}
		if !strings.Contains(b.get("/approvals").Body.String(), "<strong>dev</strong>") {
			t.Errorf("dev login did not sign in as the minted identity")
		}
	})
	t.Run("refused without the login token", func(t *testing.T) {
		fx := newFixture(t, withDevLogin)
		b := fx.browser()
		b.local = true
		if w := b.do("POST", "/login/dev", url.Values{}, nil); w.Code != http.StatusForbidden {
			t.Errorf("POST /login/dev without token = %d; want 403", w.Code)
		}
		if fx.devUsed != 0 {
			t.Errorf("DevLogin minted an assertion for a forged request")
		}
	})
	t.Run("only from this machine to a loopback name", func(t *testing.T) {
		fx := newFixture(t, withDevLogin)
		// Another machine, and a page of another site whose name was
		// rebound to 127.0.0.1: neither is offered the dev login, and
		// neither gets one.
		for name, edit := range map[string]func(b *browser){
			"remote peer":  func(b *browser) {},
			"rebound name": func(b *browser) { b.local, b.host = true, "evil.example:8080" },
		} {
			b := fx.browser()
			edit(b)
			login := b.get("/login").Body.String()
			if strings.Contains(login, `action="/login/dev"`) {
				t.Errorf("%s: the sign-in page offers the dev login", name)
			}
			w := b.do("POST", "/login/dev", url.Values{"csrf": {csrfOf(t, login)}}, nil)
			if w.Code != http.StatusNotFound {
				t.Errorf("%s: POST /login/dev = %d; want 404", name, w.Code)
			}
		}
		if fx.devUsed != 0 {
			t.Errorf("DevLogin minted %d assertions for requests not from this machine", fx.devUsed)
		}
	})
	t.Run("absent", func(t *testing.T) {
		fx := newFixture(t)
		b := fx.browser()
		login := b.get("/login").Body.String()
		if w := b.do("POST", "/login/dev", url.Values{"csrf": {csrfOf(t, login)}}, nil); w.Code != http.StatusNotFound {
			t.Errorf("POST /login/dev without DevLogin = %d; want 404", w.Code)
		}
	})
}

func TestLoginCSRF(t *testing.T) {
	for _, tc := range []struct {
		name   string
		token  func(login string) string
		header http.Header
	}{
		{"no token", func(string) string { return "" }, nil},
		{"wrong token", func(string) string { return base64.RawURLEncoding.EncodeToString(make([]byte, 32)) }, nil},
		{"foreign origin", func(l string) string { return l }, http.Header{"Origin": {"https://evil.example"}}},
		{"cross-site fetch", func(l string) string { return l }, http.Header{"Sec-Fetch-Site": {"cross-site"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t)
			b := fx.browser()
			login := csrfOf(t, b.get("/login").Body.String())
			w := b.do("POST", "/login", url.Values{"csrf": {tc.token(login)}, "assertion": {assertOperator}}, tc.header)
			if w.Code != http.StatusForbidden {
				t.Errorf("POST /login = %d; want 403", w.Code)
			}
			if fx.authN != 0 {
				t.Errorf("the assertion was verified %d times for a forged sign-in; want 0", fx.authN)
			}
		})
	}
}

// postRoutes are every POST the console serves once signed in, with a
// form that would act.
var postRoutes = []struct {
	path string
	form url.Values
}{
	{"/logout", url.Values{}},
	{"/approvals/" + keyPending.ApprovalID() + "/approve", url.Values{"arguments_hash": {hashPending}}},
	{"/approvals/" + keyPending.ApprovalID() + "/reject", url.Values{"reason": {"no"}}},
	{"/calls/resolve", url.Values{"tenant": {"acme"}, "key": {"refund-4"}, "as": {"failed"}, "evidence": {"ticket 9"}}},
	{"/calls/compensate", url.Values{"tenant": {"acme"}, "key": {"refund-1"}, "reason": {"fraud"}}},
	{"/incidents/act", url.Values{"action": {"freeze"}, "tool": {"refund_order"}, "reason": {"incident"}}},
	{"/incidents/act", url.Values{"action": {"revoke_jti"}, "jti": {"jti-1"}, "reason": {"leak"}}},
	{"/incidents/act", url.Values{"action": {"compensate"}, "tool": {"refund_order"}, "reason": {"undo"}, "digest": {"x"}}},
	{"/health/unfreeze", url.Values{"tool": {"refund_order"}, "reason": {"over"}}},
}

func TestCSRFRefusedAndNothingDone(t *testing.T) {
	for _, rt := range postRoutes {
		for _, tc := range []struct {
			name   string
			token  func(b *browser) string
			header http.Header
		}{
			{"no token", func(*browser) string { return "" }, nil},
			{"another session's token", func(*browser) string { return "" }, nil},
			{"wrong token", func(b *browser) string { return b.csrf[:len(b.csrf)-2] + "xx" }, nil},
			{"foreign origin", func(b *browser) string { return b.csrf }, http.Header{"Origin": {"http://evil.example"}}},
			{"null origin", func(b *browser) string { return b.csrf }, http.Header{"Origin": {"null"}}},
			{"cross-site", func(b *browser) string { return b.csrf }, http.Header{"Sec-Fetch-Site": {"cross-site"}}},
		} {
			t.Run(rt.path+"/"+tc.name, func(t *testing.T) {
				fx := newFixture(t)
				b := fx.signedIn(assertPlatform)
				tok := tc.token(b)
				if tc.name == "another session's token" {
					tok = fx.signedIn(assertOperator).csrf
				}
				sessions := fx.c.sessions.len()
				fx.api.reset()
				form := url.Values{}
				for k, v := range rt.form {
					form[k] = v
				}
				if tok != "" {
					form.Set("csrf", tok)
				}
				w := b.do("POST", rt.path, form, tc.header)
				if w.Code != http.StatusForbidden {
					t.Errorf("POST %s = %d; want 403", rt.path, w.Code)
				}
				if reqs := fx.api.requests(); len(reqs) != 0 {
					t.Errorf("the API got %v; want nothing for a refused POST", reqs)
				}
				if fx.c.sessions.len() != sessions {
					t.Errorf("a refused POST changed the sessions")
				}
			})
		}
		t.Run(rt.path+"/same origin", func(t *testing.T) {
			fx := newFixture(t)
			b := fx.signedIn(assertPlatform)
			form := url.Values{}
			for k, v := range rt.form {
				form[k] = v
			}
			form.Set("csrf", b.csrf)
			w := b.do("POST", rt.path, form, http.Header{"Origin": {"http://console.test"}, "Sec-Fetch-Site": {"same-origin"}})
			if w.Code != http.StatusSeeOther {
				t.Errorf("POST %s with token and same origin = %d; want 303", rt.path, w.Code)
			}
		})
	}
}

func TestSecurityHeadersOnEveryResponse(t *testing.T) {
	fx := newFixture(t, withDevLogin)
	b := fx.signedIn(assertPlatform)
	anon := fx.browser()
	type req struct {
		who            *browser
		method, target string
		form           url.Values
		page           bool
	}
	reqs := []req{
		{anon, "GET", "/", nil, false},
		{anon, "GET", "/login", nil, true},
		{anon, "GET", "/login?m=" + url.QueryEscape(xssScript), nil, true},
		{anon, "GET", "/approvals", nil, false},
		{anon, "POST", "/login", url.Values{}, true},
		{anon, "GET", "/nowhere", nil, true},
		{b, "GET", "/", nil, false},
		{b, "GET", "/assets/console.css", nil, false},
		{b, "GET", fx.c.assetURL("console.js"), nil, false},
		{b, "GET", "/assets/missing.css", nil, true},
		{b, "GET", "/approvals", nil, true},
		{b, "GET", approvalURL(keyPending.ApprovalID()), nil, true},
		{b, "GET", approvalURL("apr_missing"), nil, true},
		{b, "GET", "/calls", nil, true},
		{b, "GET", "/calls?tool=refund_order", nil, true},
		{b, "GET", callURL(keyHostile.TenantID, keyHostile.IdempotencyKey), nil, true},
		{b, "GET", "/incidents", nil, true},
		{b, "GET", "/incidents?tool=refund_order", nil, true},
		{b, "GET", "/incidents.csv?tool=refund_order", nil, false},
		{b, "GET", "/incidents/confirm?action=freeze&tool=refund_order", nil, true},
		{b, "GET", "/health", nil, true},
		{b, "GET", "/health/unfreeze?tool=refund_order", nil, true},
		{b, "POST", "/calls/resolve", url.Values{}, true},
		{b, "POST", "/calls/resolve", url.Values{"csrf": {b.csrf}, "tenant": {"acme"}, "key": {"refund-4"}, "as": {"failed"}}, false},
	}
	for _, rq := range reqs {
		w := rq.who.do(rq.method, rq.target, rq.form, nil)
		h := w.Header()
		name := rq.method + " " + rq.target
		want := map[string]string{
			"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
			"X-Content-Type-Options":  "nosniff",
			"Referrer-Policy":         "same-origin",
			"X-Frame-Options":         "DENY",
		}
		for k, v := range want {
			if got := h.Get(k); got != v {
				t.Errorf("%s (%d): %s = %q; want %q", name, w.Code, k, got, v)
			}
		}
		if rq.page {
			if got := h.Get("Cache-Control"); got != "no-store" {
				t.Errorf("%s: Cache-Control = %q; want no-store on a page", name, got)
			}
			if ct := h.Get("Content-Type"); ct != "text/html; charset=utf-8" {
				t.Errorf("%s: Content-Type = %q; want text/html; charset=utf-8", name, ct)
			}
		}
	}
}

var (
	tagRE    = regexp.MustCompile(`<[a-zA-Z][^>]*>`)
	quotedRE = regexp.MustCompile(`"[^"]*"`)
	handlerR = regexp.MustCompile(`(?i)\son[a-z]+\s*=`)
	scriptRE = regexp.MustCompile(`(?is)<script\b([^>]*)>(.*?)</script>`)
)

// checkNoInline fails if a page holds inline script or style: every
// script has a src on this origin and no body, no style element or
// attribute, no event handler attribute. Escaped data cannot open a tag,
// so every "<" followed by a letter is markup.
func checkNoInline(t *testing.T, name, body string) {
	t.Helper()
	if n, m := strings.Count(strings.ToLower(body), "<script"), len(scriptRE.FindAllString(body, -1)); n != m {
		t.Errorf("%s: %d <script openings but %d whole script elements", name, n, m)
	}
	for _, m := range scriptRE.FindAllStringSubmatch(body, -1) {
		if !strings.Contains(m[1], `src="/assets/`) || strings.TrimSpace(m[2]) != "" {
			t.Errorf("%s: inline or foreign script %q", name, m[0])
		}
	}
	if strings.Contains(strings.ToLower(body), "<style") {
		t.Errorf("%s: has a <style> element", name)
	}
	for _, tag := range tagRE.FindAllString(body, -1) {
		bare := quotedRE.ReplaceAllString(tag, `""`)
		if handlerR.MatchString(bare) {
			t.Errorf("%s: event handler attribute in %q", name, tag)
		}
		if strings.Contains(strings.ToLower(bare), " style=") {
			t.Errorf("%s: style attribute in %q", name, tag)
		}
		lower := strings.ToLower(tag)
		for _, attr := range []string{`href="javascript:`, `src="javascript:`, `action="javascript:`, `href="data:`} {
			if strings.Contains(lower, attr) {
				t.Errorf("%s: dangerous URL in %q", name, tag)
			}
		}
	}
}

// pages are every page, signed in as a platform operator and approver,
// fed with the fake API's hostile data.
func pages(fx *fixture) []string {
	return []string{
		"/approvals",
		approvalURL(keyPending.ApprovalID()),
		approvalURL(keyHostile.ApprovalID()),
		approvalURL(keyRejected.ApprovalID()),
		approvalURL(keyExpired.ApprovalID()),
		"/calls",
		"/calls?tenant=acme&tool=refund_order&state=succeeded&call_id=c1&trace_id=t1&since=2h",
		callURL(keyHostile.TenantID, keyHostile.IdempotencyKey),
		callURL(keyUnknown.TenantID, keyUnknown.IdempotencyKey),
		"/incidents",
		"/incidents?tool=refund_order&jti=jti-1&credential_family=refund_order:acme:1&all_tenants=true&since=6h",
		"/incidents?tool=" + url.QueryEscape(xssScript) + "&jti=" + url.QueryEscape(xssAttr),
		"/incidents/confirm?action=freeze&tool=refund_order&tenant=acme",
		"/incidents/confirm?action=revoke_family&credential_family=" + url.QueryEscape(xssAttr),
		"/incidents/confirm?action=compensate&tool=refund_order",
		"/incidents/confirm?action=" + url.QueryEscape(xssScript),
		"/health",
		"/health/unfreeze?tool=" + url.QueryEscape(xssScript) + "&tenant=" + url.QueryEscape(xssURL),
		"/nowhere/" + url.PathEscape(xssScript),
	}
}

func TestEveryPageEscapesUntrustedData(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertPlatform)
	for _, p := range pages(fx) {
		w := b.get(p)
		body := w.Body.String()
		if w.Code >= 500 {
			t.Errorf("GET %s = %d:\n%s", p, w.Code, body)
			continue
		}
		// A bidi override (the calls' ids hold one) is escaped too.
		for _, raw := range []string{xssScript, "<img", "onerror=alert(1)>", `"><img`, "\u202e"} {
			if strings.Contains(body, raw) {
				t.Errorf("GET %s: the page holds %q unescaped", p, raw)
			}
		}
		checkNoInline(t, p, body)
	}
	// And the escaped forms are there, so the data was shown, not
	// dropped.
	for _, tc := range []struct {
		page string
		want []string
	}{
		{"/approvals", []string{"&lt;script&gt;alert(1)&lt;/script&gt;", "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;"}},
		{approvalURL(keyHostile.ApprovalID()), []string{"Refund an order &lt;script&gt;alert(1)&lt;/script&gt;", "javascript:alert(1)", `/calls/%3Cscript%3Ealert%281%29%3C%2Fscript%3E/%22%3E%3Cimg%20src=x%20onerror=alert%281%29%3E`}},
		{callURL(keyHostile.TenantID, keyHostile.IdempotencyKey), []string{"&#34;html&#34;: &#34;&lt;script&gt;alert(1)&lt;/script&gt;&#34;", "pv-7 &lt;script&gt;alert(1)&lt;/script&gt;", "jti-&#34;&gt;&lt;img src=x onerror=alert(1)&gt;"}},
		{"/health", []string{"pv-7 &lt;script&gt;alert(1)&lt;/script&gt;", "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;"}},
		{"/incidents?tool=" + url.QueryEscape(xssScript), []string{`value="&lt;script&gt;alert(1)&lt;/script&gt;"`, "<title>", "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;"}},
	} {
		body := b.get(tc.page).Body.String()
		for _, want := range tc.want {
			if !strings.Contains(body, want) {
				t.Errorf("GET %s lacks the escaped %q", tc.page, want)
			}
		}
	}
}

var postFormRE = regexp.MustCompile(`(?s)<form[^>]*method="post"[^>]*>(.*?)</form>`)

func TestEveryPostFormCarriesTheSessionsToken(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertPlatform)
	want := `<input type="hidden" name="csrf" value="` + b.csrf + `">`
	forms := 0
	for _, p := range pages(fx) {
		for _, m := range postFormRE.FindAllStringSubmatch(b.get(p).Body.String(), -1) {
			forms++
			if !strings.Contains(m[1], want) {
				t.Errorf("GET %s: a POST form without the session's CSRF token: %s", p, m[0])
			}
		}
	}
	// The logout form on every page, plus approve, reject, resolve,
	// compensate and the confirmations.
	if forms < len(pages(fx))+8 {
		t.Errorf("found %d POST forms; the pages should hold more", forms)
	}
}

func TestLoginPageIsStatic(t *testing.T) {
	fx := newFixture(t, withDevLogin)
	body := fx.browser().get("/login?m=" + url.QueryEscape(xssScript)).Body.String()
	if strings.Contains(body, "alert(1)") {
		t.Errorf("the login page echoes its address")
	}
	checkNoInline(t, "/login", body)
}

func TestTemplatesHaveNoInlineCode(t *testing.T) {
	entries, err := templateFS.ReadDir("templates")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := templateFS.ReadFile("templates/" + e.Name())
		if err != nil {
			t.Fatal(err)
		}
		s := strings.ToLower(string(b))
		for _, bad := range []string{"<style", " style=", "template.html", "javascript:", " onclick", " onload", " onsubmit"} {
			if strings.Contains(s, bad) {
				t.Errorf("template %s contains %q", e.Name(), bad)
			}
		}
		if strings.Count(s, "<script") != strings.Count(s, `<script src="{{.js}}" defer></script>`) {
			t.Errorf("template %s has a script other than the console's own file", e.Name())
		}
	}
}

func TestRootAndAssets(t *testing.T) {
	fx := newFixture(t)
	if w := fx.browser().get("/"); w.Header().Get("Location") != "/login" {
		t.Errorf("GET / signed out goes to %q; want /login", w.Header().Get("Location"))
	}
	b := fx.signedIn(assertApprover)
	if w := b.get("/"); w.Header().Get("Location") != "/approvals" {
		t.Errorf("GET / signed in goes to %q; want /approvals", w.Header().Get("Location"))
	}
	w := b.get(fx.c.assetURL("console.css"))
	if w.Code != http.StatusOK || w.Header().Get("Content-Type") != "text/css; charset=utf-8" || !strings.Contains(w.Body.String(), ".badge") {
		t.Errorf("GET console.css = %d %q", w.Code, w.Header().Get("Content-Type"))
	}
	if cc := w.Header().Get("Cache-Control"); !strings.Contains(cc, "immutable") {
		t.Errorf("versioned asset Cache-Control = %q; want immutable", cc)
	}
	js := b.get(fx.c.assetURL("console.js"))
	if js.Header().Get("Content-Type") != "text/javascript; charset=utf-8" {
		t.Errorf("console.js Content-Type = %q", js.Header().Get("Content-Type"))
	}
	page := b.get("/approvals").Body.String()
	if !strings.Contains(page, `href="`+fx.c.assetURL("console.css")+`"`) {
		t.Errorf("pages do not link the versioned stylesheet")
	}
}

// The unresolved calls' list, cut at its limit (the API's
// X-Limit-Reached: in the fake, across tenants), says so: its newest
// calls, an incident's, are those left out. Before, the page showed the
// oldest 1000 as if they were all.
func TestUnresolvedCutSaysSo(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertPlatform)
	const notice = "More calls wait than the ledger lists at once"
	if body := b.get("/calls").Body.String(); !strings.Contains(body, notice) || !strings.Contains(body, `<span class="count">3+</span>`) {
		t.Errorf("GET /calls, its list cut, lacks %q or its count's +:\n%s", notice, body)
	}
	if body := b.get("/calls?tenant=acme").Body.String(); strings.Contains(body, notice) {
		t.Errorf("GET /calls?tenant=acme, its list whole, says %q", notice)
	}
}

func TestPagesRender(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertPlatform)
	for _, tc := range []struct {
		page string
		want []string
		api  []string // paths the page asked, with their query
	}{
		{"/approvals", []string{
			"Waiting for a decision", "refund_order", "45.00 AUD", "5m 0s", `datetime="2026-11-30T14:10:00Z"`, "10m 0s", "bob",
			"Recently rejected or expired", `badge st-rejected`, `badge st-expired`, "approval_expired", `aria-current="page">Approvals`,
			`href="` + approvalURL(keyPending.ApprovalID()) + `"`,
		}, []string{"/v1/approvals?state=pending", "/v1/approvals?state=rejected", "/v1/approvals?state=expired"}},
		{approvalURL(keyPending.ApprovalID()), []string{
			hashPending, `name="arguments_hash" value="` + hashPending + `"`, `<span class="masked"`, "/card_number",
			"/nested/x", "cancel_refund v1", "45.00 AUD", `badge risk-high`, `action="` + approvalURL(keyPending.ApprovalID()) + `/reject"`,
			`name="reason"`, "required", `<label for="reason">`,
			`<dt>Roles</dt><dd><bdo dir="ltr">finance</bdo>, <bdo dir="ltr">&lt;script&gt;`, "(as the policies saw them)",
		}, []string{"/v1/approvals/" + keyPending.ApprovalID()}},
		{approvalURL(keyRejected.ApprovalID()), []string{"read-only", "&#34;&gt;&lt;img", "2026-11-30 13:00:00 UTC"}, nil},
		{approvalURL(keyExpired.ApprovalID()), []string{"the timer expired it", "read-only"}, nil},
		// Approved, and nothing came of it: the page says what became
		// of the call.
		{approvalURL(keyLapsed.ApprovalID()), []string{"read-only", "The call:", `badge st-denied">denied</span> <code>approval_expired</code>`}, nil},
		{"/calls?tenant=acme&tool=refund_order&state=succeeded&call_id=c1&trace_id=t1&since=2h", []string{
			"Results", "refund-1", "Unresolved", "parked", `action="/calls/resolve"`, `action="/calls/compensate"`,
			"Review approval", `<option value="succeeded" selected>`,
		}, []string{"/v1/blast-radius?call_id=c1&since=2h&state=succeeded&tenant=acme&tool=refund_order&trace_id=t1", "/v1/unresolved?tenant=acme&tool=refund_order"}},
		// The calls of one tool definition, as a call's page links them.
		{"/calls?tenant=acme&tool_digest=" + url.QueryEscape(testToolDigest), []string{
			"Results", `name="tool_digest" value="` + testToolDigest + `"`,
		}, []string{"/v1/blast-radius?tenant=acme&tool_digest=" + url.QueryEscape(testToolDigest), "/v1/unresolved?tenant=acme"}},
		{"/calls", []string{"Unresolved", "in all tenants"}, []string{"/v1/unresolved?all_tenants=true"}},
		{callURL(keyUnknown.TenantID, keyUnknown.IdempotencyKey), []string{
			"Timeline", "1.234s", "executor", "allow", "key_reused", "Refused submissions", "&#34;refund_id&#34;: &#34;rf_1&#34;",
			`action="/calls/resolve"`, `name="back" value="/calls/acme/refund-4"`, `badge st-outcome_unknown`, "/secret", `<span class="masked"`,
			`<dt>Definition</dt><dd class="mono"><a href="/calls?tenant=acme&amp;tool_digest=sha256%3Aee73feadf9785bb74043d9d7feab3b832debf6925884d394230384e60fdcdaf5"`,
		}, []string{"/v1/trace/acme/refund-4", "/v1/calls/refund-4?tenant_id=acme"}},
		{"/incidents?tool=refund_order&all_tenants=true&since=6h", []string{
			"matching call(s)", "By tenant", "By state", "<svg", `class="st-succeeded"`, "Outcomes per 15 minutes",
			`<span class="big">1500</span><span class="muted">tenant(s)</span>`, "The top 2 of 1500 tenants, by calls.",
			`href="/incidents.csv?all_tenants=true&amp;since=6h&amp;tool=refund_order"`, "Freeze refund_order…",
			"Compensate all succeeded calls…",
		}, []string{"/v1/blast-radius?all_tenants=true&since=6h&tool=refund_order", "/v1/outcomes?all_tenants=true&bucket=15m0s&since=2026-11-30T08%3A00%3A00Z&tool=refund_order&until=2026-11-30T14%3A00%3A00Z"}},
		{"/incidents", []string{"What did it touch?", `<label for="i-jti">`, `<label for="i-role">`}, []string{}},
		// A caller's role and its denials are a question the form asks.
		{"/incidents?role=contractor&decision=deny&tenant=acme", []string{"matching call(s)", `name="role" value="contractor"`},
			[]string{"/v1/blast-radius?decision=deny&role=contractor&tenant=acme", "/v1/outcomes?bucket=30m0s&since=2026-11-29T14%3A00%3A00Z&tenant=acme&until=2026-11-30T14%3A00%3A00Z"}},
		{"/health", []string{
			"Active policy", "42", "3s behind", `badge ok">closed`, `badge bad">open`, `badge warn">half-open`,
			"incident 12", `href="/health/unfreeze?tenant=acme&amp;tool=refund_order"`, "Unfreeze…",
			"the platform</span>", "not shown to tenants</span>",
		}, []string{"/v1/health", "/v1/control"}},
		{"/health/unfreeze?tool=export_data", []string{
			"Frozen for every tenant by the platform at 2026-11-30T13:50:00Z (its reason is not shown to tenants).",
		}, []string{"/v1/control"}},
	} {
		t.Run(tc.page, func(t *testing.T) {
			fx.api.reset()
			w := b.get(tc.page)
			if w.Code != http.StatusOK {
				t.Fatalf("GET %s = %d; want 200:\n%s", tc.page, w.Code, w.Body)
			}
			body := w.Body.String()
			for _, want := range tc.want {
				if !strings.Contains(body, want) {
					t.Errorf("GET %s lacks %q", tc.page, want)
				}
			}
			if strings.Contains(tc.page, keyRejected.ApprovalID()) && strings.Contains(body, "<dt>Roles</dt>") {
				t.Errorf("GET %s shows roles for a call decided without them", tc.page)
			}
			if tc.api != nil {
				var got []string
				for _, r := range fx.api.requests() {
					if r.Auth != "Bearer "+assertPlatform {
						t.Errorf("%s %s: Authorization %q; want the session's assertion", r.Method, r.Path, r.Auth)
					}
					got = append(got, queryString(r.Path, r.Query))
				}
				if d := cmp.Diff(tc.api, got, cmpEmptyNil); d != "" {
					t.Errorf("GET %s asked the API (-want +got):\n%s", tc.page, d)
				}
			}
		})
	}
}

var cmpEmptyNil = cmp.FilterValues(func(a, b []string) bool { return len(a) == 0 && len(b) == 0 }, cmp.Ignore())

func TestCallsKeyOpensTimeline(t *testing.T) {
	fx := newFixture(t)
	op := fx.signedIn(assertOperator)
	if w := op.get("/calls?key=" + url.QueryEscape("a/b c")); w.Code != http.StatusSeeOther || w.Header().Get("Location") != "/calls/acme/a%2Fb%20c" {
		t.Errorf("GET /calls?key= = %d to %q; want 303 to the call in the operator's tenant", w.Code, w.Header().Get("Location"))
	}
	platform := fx.signedIn(assertPlatform)
	if w := platform.get("/calls?key=k1&tenant=globex"); w.Header().Get("Location") != "/calls/globex/k1" {
		t.Errorf("GET /calls?key=k1&tenant=globex goes to %q", w.Header().Get("Location"))
	}
	if w := platform.get("/calls?key=k1"); w.Code != http.StatusOK || !strings.Contains(w.Body.String(), "Name the call") {
		t.Errorf("a platform operator's key without tenant = %d; want the page asking for a tenant", w.Code)
	}
}

func TestRefusalsShowTheAPIsCodeAndMessage(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	fx.api.refuse["GET /v1/approvals"] = refusalSpec{status: http.StatusForbidden, code: "not_approver", message: "the assertion does not carry the approver role"}
	body := b.get("/approvals").Body.String()
	if !strings.Contains(body, "not_approver: the assertion does not carry the approver role") {
		t.Errorf("approvals page does not show the API's refusal")
	}
	w := b.get(approvalURL("apr_nope"))
	if w.Code != http.StatusNotFound || !strings.Contains(w.Body.String(), "not_found: no approval under this id in your tenant") {
		t.Errorf("missing approval = %d; want 404 with the API's code and message", w.Code)
	}
	fx.api.refuse["GET /v1/trace/acme/refund-4"] = refusalSpec{status: http.StatusForbidden, code: "forbidden", message: "an operator of tenant acme may ask about that tenant only"}
	fx.api.reset()
	w = b.get(callURL("acme", "refund-4"))
	if w.Code != http.StatusForbidden || !strings.Contains(w.Body.String(), "forbidden: an operator of tenant acme") {
		t.Errorf("refused trace = %d; want 403 with the API's message", w.Code)
	}
	for _, r := range fx.api.requests() {
		if strings.HasPrefix(r.Path, "/v1/calls/") {
			t.Errorf("the console read the call view (%s) after the trace was refused", r.Path)
		}
	}
}

// followFlash follows a 303 and returns the flash on the page it lands on.
func followFlash(t *testing.T, b *browser, w *http.Response) string {
	t.Helper()
	if w.StatusCode != http.StatusSeeOther {
		t.Fatalf("POST = %d; want 303", w.StatusCode)
	}
	page := b.get(w.Header.Get("Location")).Body.String()
	m := regexp.MustCompile(`(?s)<div class="flash (ok|bad)"[^>]*>(.*?)</div>`).FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no flash after the redirect to %s", w.Header.Get("Location"))
	}
	return m[1] + ": " + m[2]
}

func TestActionsCallTheAPI(t *testing.T) {
	for _, tc := range []struct {
		name       string
		as         string
		path       string
		form       url.Values
		wantPath   string
		wantBody   string
		wantBack   string
		wantFlash  string
		refusal    bool
		wantPrefix string
	}{
		{
			name: "approve", as: assertApprover,
			path: "/approvals/" + keyPending.ApprovalID() + "/approve", form: url.Values{"arguments_hash": {hashPending}},
			wantPath: "/v1/approvals/" + keyPending.ApprovalID() + "/approve", wantBody: `{"arguments_hash":"` + hashPending + `"}`,
			wantBack: approvalURL(keyPending.ApprovalID()), wantFlash: "ok: alice approved the refund_order call acme/order-1",
		},
		{
			name: "approve with another hash", as: assertApprover,
			path: "/approvals/" + keyPending.ApprovalID() + "/approve", form: url.Values{"arguments_hash": {"sha256:other"}},
			wantPath: "/v1/approvals/" + keyPending.ApprovalID() + "/approve", wantBody: `{"arguments_hash":"sha256:other"}`,
			wantBack: approvalURL(keyPending.ApprovalID()), wantFlash: "bad: alice: the approval was refused — hash_mismatch: arguments_hash is not the hash",
		},
		{
			name: "reject", as: assertApprover,
			path: "/approvals/" + keyPending.ApprovalID() + "/reject", form: url.Values{"reason": {"too much <b>"}},
			wantPath: "/v1/approvals/" + keyPending.ApprovalID() + "/reject", wantBody: `{"reason":"too much \u003cb\u003e"}`,
			wantBack: approvalURL(keyPending.ApprovalID()), wantFlash: "ok: alice rejected the refund_order call acme/order-1",
		},
		{
			name: "reject without reason", as: assertApprover,
			path: "/approvals/" + keyPending.ApprovalID() + "/reject", form: url.Values{"reason": {""}},
			wantPath: "/v1/approvals/" + keyPending.ApprovalID() + "/reject", wantBody: `{"reason":""}`,
			wantBack: approvalURL(keyPending.ApprovalID()), wantFlash: "bad: alice: the rejection was refused — invalid_request: approvals: invalid request: a rejection needs a reason",
		},
		{
			name: "resolve", as: assertOperator,
			path: "/calls/resolve", form: url.Values{"tenant": {"acme"}, "key": {"refund-4"}, "as": {"succeeded"}, "evidence": {"backend says ok"}, "back": {"/calls?tool=x"}},
			wantPath: "/v1/resolutions", wantBody: `{"tenant_id":"acme","idempotency_key":"refund-4","as":"succeeded","evidence":"backend says ok"}`,
			wantBack: "/calls?tool=x", wantFlash: "ok: olga resolved acme/refund-4 as succeeded (event succeeded, seq 6).",
		},
		{
			name: "resolve, cancelling the reconciler's compensation", as: assertOperator,
			path: "/calls/resolve", form: url.Values{"tenant": {"acme"}, "key": {"refund-4"}, "as": {"succeeded"}, "evidence": {"backend says ok"}, "cancel_compensation": {"on"}},
			wantPath: "/v1/resolutions", wantBody: `{"tenant_id":"acme","idempotency_key":"refund-4","as":"succeeded","evidence":"backend says ok","cancel_compensation":true}`,
			wantBack: "/calls", wantFlash: "ok: olga resolved acme/refund-4 as succeeded",
		},
		{
			name: "resolve elsewhere is not followed", as: assertOperator,
			path: "/calls/resolve", form: url.Values{"tenant": {"acme"}, "key": {"refund-4"}, "as": {"failed"}, "evidence": {"e"}, "back": {"//evil.example/x"}},
			wantPath: "/v1/resolutions", wantBody: `{"tenant_id":"acme","idempotency_key":"refund-4","as":"failed","evidence":"e"}`,
			wantBack: "/calls", wantFlash: "ok: olga resolved acme/refund-4 as failed",
		},
		{
			name: "compensate", as: assertOperator,
			path: "/calls/compensate", form: url.Values{"tenant": {"acme"}, "key": {"refund-1"}, "reason": {"fraud"}, "back": {"/calls/acme/refund-1"}},
			wantPath: "/v1/compensations", wantBody: `{"tenant_id":"acme","idempotency_key":"refund-1","reason":"fraud"}`,
			wantBack: "/calls/acme/refund-1", wantFlash: "ok: olga asked to compensate acme/refund-1: compensation call acme/refund-1",
		},
		{
			name: "compensate refused", as: assertOperator,
			path: "/calls/compensate", form: url.Values{"tenant": {"acme"}, "key": {"refund-2"}, "reason": {"fraud"}},
			wantPath: "/v1/compensations", wantBody: `{"tenant_id":"acme","idempotency_key":"refund-2","reason":"fraud"}`,
			wantBack: "/calls", wantFlash: "bad: olga: the compensation of acme/refund-2 was refused — not_compensable: compensation: the tool declares no compensation",
		},
		{
			// Answered 200, the compensation's call refused (its tool
			// frozen): not a success.
			name: "compensate denied", as: assertOperator,
			path: "/calls/compensate", form: url.Values{"tenant": {"acme"}, "key": {"refund-frozen"}, "reason": {"fraud"}},
			wantPath: "/v1/compensations", wantBody: `{"tenant_id":"acme","idempotency_key":"refund-frozen","reason":"fraud"}`,
			wantBack: "/calls", wantFlash: "bad: olga: the compensation of acme/refund-frozen was refused — compensation call acme/refund-frozen:compensate denied (tool_frozen): cancel_refund is frozen for tenant acme by olga: incident 12; its key was not used, so it may be asked again once the cause is gone",
		},
		{
			name: "freeze", as: assertOperator,
			path: "/incidents/act", form: url.Values{"action": {"freeze"}, "tool": {"refund_order"}, "tenant": {"acme"}, "reason": {"incident 12"}},
			wantPath: "/v1/control/freeze", wantBody: `{"tool":"refund_order","tenant":"acme","reason":"incident 12"}`,
			wantBack: "/incidents?tenant=acme&tool=refund_order", wantFlash: "ok: olga froze refund_order for tenant acme.",
		},
		{
			name: "freeze every tenant", as: assertPlatform,
			path: "/incidents/act", form: url.Values{"action": {"freeze"}, "tool": {"refund_order"}, "all_tenants": {"true"}, "reason": {"incident 12"}},
			wantPath: "/v1/control/freeze", wantBody: `{"tool":"refund_order","reason":"incident 12"}`,
			wantBack: "/incidents?all_tenants=true&tool=refund_order", wantFlash: "ok: pat froze refund_order for every tenant.",
		},
		{
			name: "freeze by a tenant operator", as: assertOperator,
			path: "/incidents/act", form: url.Values{"action": {"freeze"}, "tool": {"refund_order"}, "reason": {"incident 12"}},
			wantPath: "/v1/control/freeze", wantBody: `{"tool":"refund_order","reason":"incident 12"}`,
			wantBack: "/incidents?tool=refund_order", wantFlash: "ok: olga froze refund_order for tenant acme.",
		},
		{
			name: "freeze without reason", as: assertOperator,
			path: "/incidents/act", form: url.Values{"action": {"freeze"}, "tool": {"refund_order"}, "reason": {""}},
			wantPath: "/v1/control/freeze", wantBody: `{"tool":"refund_order","reason":""}`,
			wantBack: "/incidents?tool=refund_order", wantFlash: "bad: olga: the freeze of refund_order was refused — invalid_request: control: invalid request: a reason is required",
		},
		{
			name: "revoke jti", as: assertPlatform,
			path: "/incidents/act", form: url.Values{"action": {"revoke_jti"}, "jti": {"jti-1"}, "tool": {"refund_order"}, "reason": {"leaked"}},
			wantPath: "/v1/control/revoke", wantBody: `{"jti":"jti-1","reason":"leaked"}`,
			wantBack: "/incidents?jti=jti-1&tool=refund_order", wantFlash: "ok: pat revoked credential jti-1.",
		},
		{
			name: "revoke jti by a tenant operator", as: assertOperator,
			path: "/incidents/act", form: url.Values{"action": {"revoke_jti"}, "jti": {"jti-1"}, "reason": {"leaked"}},
			wantPath: "/v1/control/revoke", wantBody: `{"jti":"jti-1","reason":"leaked"}`,
			wantBack: "/incidents?jti=jti-1", wantFlash: "bad: olga: the revocation of credential jti-1 was refused — forbidden: control: forbidden: only a platform operator may revoke a single jti",
		},
		{
			name: "revoke family", as: assertOperator,
			path: "/incidents/act", form: url.Values{"action": {"revoke_family"}, "credential_family": {"refund_order:acme:1"}, "reason": {"key leaked"}},
			wantPath: "/v1/control/revoke", wantBody: `{"family":"refund_order:acme:1","reason":"key leaked"}`,
			wantBack: "/incidents?credential_family=refund_order%3Aacme%3A1", wantFlash: "ok: olga revoked credential family refund_order:acme:1.",
		},
		{
			name: "unfreeze", as: assertOperator,
			path: "/health/unfreeze", form: url.Values{"tool": {"refund_order"}, "tenant": {"acme"}, "reason": {"fixed"}},
			wantPath: "/v1/control/unfreeze", wantBody: `{"tool":"refund_order","tenant":"acme","reason":"fixed"}`,
			wantBack: "/health", wantFlash: "ok: olga unfroze refund_order for tenant acme.",
		},
		{
			name: "unfreeze of the freeze shown", as: assertOperator,
			path: "/health/unfreeze", form: url.Values{"tool": {"refund_order"}, "tenant": {"acme"}, "reason": {"fixed"}, "freeze_at": {"2026-11-30T13:30:00.5Z"}},
			wantPath: "/v1/control/unfreeze", wantBody: `{"tool":"refund_order","tenant":"acme","reason":"fixed","freeze_at":"2026-11-30T13:30:00.5Z"}`,
			wantBack: "/health", wantFlash: "ok: olga unfroze refund_order for tenant acme.",
		},
		{
			name: "unfreeze of a platform freeze over the tenant's own", as: assertPlatform,
			path: "/health/unfreeze", form: url.Values{"tool": {"lookup_order"}, "tenant": {"acme"}, "reason": {"13 over"}},
			wantPath: "/v1/control/unfreeze", wantBody: `{"tool":"lookup_order","tenant":"acme","reason":"13 over"}`,
			wantBack: "/health", wantFlash: "unfroze lookup_order for tenant acme. The tenant's own freeze, by olga, is in force again.",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t)
			b := fx.signedIn(tc.as)
			fx.api.reset()
			w := b.post(tc.path, tc.form)
			reqs := fx.api.requests()
			if len(reqs) != 1 {
				t.Fatalf("POST %s made %d API requests; want 1: %v", tc.path, len(reqs), reqs)
			}
			r := reqs[0]
			if r.Method != "POST" || r.Path != tc.wantPath {
				t.Errorf("API request %s %s; want POST %s", r.Method, r.Path, tc.wantPath)
			}
			if r.Auth != "Bearer "+tc.as {
				t.Errorf("API request Authorization %q; want the session's assertion", r.Auth)
			}
			if strings.TrimSpace(r.Body) != tc.wantBody {
				t.Errorf("API request body %s; want %s", r.Body, tc.wantBody)
			}
			if got := w.Header().Get("Location"); got != tc.wantBack {
				t.Errorf("redirect to %q; want %q", got, tc.wantBack)
			}
			if got := followFlash(t, b, w.Result()); !strings.Contains(got, htmlEscape(tc.wantFlash)) {
				t.Errorf("flash %q; want it to contain %q", got, tc.wantFlash)
			}
		})
	}
}

// TestIncidentFreezeOfToolControlDoesNotHold drives the incident page's
// freeze of a tool the control service's registry does not hold (its
// reconciler's registry behind the intake's): a tool whose calls the
// intake took is frozen all the same (allow_unknown_tool); one it never
// took, a typo as likely as not, stays refused unknown_tool.
func TestIncidentFreezeOfToolControlDoesNotHold(t *testing.T) {
	confirmRE := regexp.MustCompile(`href="(/incidents/confirm\?[^"]*)">Freeze `)
	hiddenRE := regexp.MustCompile(`<input type="hidden" name="([^"]+)" value="([^"]*)">`)
	const (
		freeze = "POST /v1/control/freeze "
		lookup = "GET /v1/blast-radius all_tenants= limit=1 tenant= tool="
	)
	// A platform operator's tool is one whatever tenant called it.
	const lookupAll = "GET /v1/blast-radius all_tenants=true limit=1 tenant= tool="
	for _, tc := range []struct {
		name string
		as   string // assertOperator when empty
		tool string
		// byState, when set, is the projection's calls of the tool by
		// state.
		byState []projections.Count
		// lookupRefused: the projection does not answer the freeze's
		// question.
		lookupRefused bool
		want          []string
		wantFlash     string
	}{
		{
			name: "calls taken", tool: "ship_label",
			want: []string{
				freeze + `{"tool":"ship_label","tenant":"acme","reason":"rollout loop"}`,
				lookup + "ship_label",
				freeze + `{"tool":"ship_label","tenant":"acme","reason":"rollout loop","allow_unknown_tool":true}`,
			},
			wantFlash: "ok: olga froze ship_label for tenant acme. The control service's tool registry does not hold ship_label, whose calls the intake took",
		},
		{
			name: "calls taken, a platform operator's freeze", as: assertPlatform, tool: "ship_label",
			want: []string{
				freeze + `{"tool":"ship_label","tenant":"acme","reason":"rollout loop"}`,
				lookupAll + "ship_label",
				freeze + `{"tool":"ship_label","tenant":"acme","reason":"rollout loop","allow_unknown_tool":true}`,
			},
			wantFlash: "ok: pat froze ship_label for tenant acme. The control service's tool registry does not hold ship_label",
		},
		{
			name: "only denied calls", tool: "ship_lable", byState: []projections.Count{{Value: "denied", Calls: 2}},
			want: []string{
				freeze + `{"tool":"ship_lable","tenant":"acme","reason":"rollout loop"}`,
				lookup + "ship_lable",
			},
			wantFlash: `bad: olga: the freeze of ship_lable was refused — unknown_tool: control: unknown tool: no tool "ship_lable" in this control service's tool registry`,
		},
		{
			name: "calls unreadable", tool: "ship_label", lookupRefused: true,
			want: []string{
				freeze + `{"tool":"ship_label","tenant":"acme","reason":"rollout loop"}`,
				lookup + "ship_label",
			},
			wantFlash: "allow_unknown_tool, --unknown-tool); whether the intake took calls to ship_label (which would freeze it anyway) could not be read: query_timeout: the question took too long",
		},
		{
			name: "tool held", tool: "refund_order",
			want: []string{
				freeze + `{"tool":"refund_order","tenant":"acme","reason":"rollout loop"}`,
			},
			wantFlash: "ok: olga froze refund_order for tenant acme.",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t)
			as := tc.as
			if as == "" {
				as = assertOperator
			}
			b := fx.signedIn(as)
			if tc.byState != nil {
				fx.api.blast.ByState = tc.byState
			}
			page := b.get("/incidents?tenant=acme&tool=" + url.QueryEscape(tc.tool)).Body.String()
			m := confirmRE.FindStringSubmatch(page)
			if m == nil {
				t.Fatalf("the incident page offers no freeze of %s:\n%s", tc.tool, page)
			}
			form := url.Values{"reason": {"rollout loop"}}
			for _, h := range hiddenRE.FindAllStringSubmatch(b.get(strings.ReplaceAll(m[1], "&amp;", "&")).Body.String(), -1) {
				if h[1] != "csrf" {
					form.Add(h[1], h[2])
				}
			}
			if got := form.Get("action"); got != "freeze" {
				t.Fatalf("the confirmation's action is %q; want freeze (form %v)", got, form)
			}
			if tc.lookupRefused {
				fx.api.refuse["GET /v1/blast-radius"] = refusalSpec{status: http.StatusGatewayTimeout, code: "query_timeout", message: "the question took too long"}
			}
			fx.api.reset()
			w := b.post("/incidents/act", form)
			var got []string
			for _, r := range fx.api.requests() {
				if r.Method == http.MethodGet {
					got = append(got, fmt.Sprintf("GET %s all_tenants=%s limit=%s tenant=%s tool=%s", r.Path, r.Query.Get("all_tenants"), r.Query.Get("limit"), r.Query.Get("tenant"), r.Query.Get("tool")))
					continue
				}
				got = append(got, r.Method+" "+r.Path+" "+strings.TrimSpace(r.Body))
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("API requests of the freeze (-want +got):\n%s", diff)
			}
			if flash := followFlash(t, b, w.Result()); !strings.Contains(flash, htmlEscape(tc.wantFlash)) {
				t.Errorf("flash %q; want it to contain %q", flash, tc.wantFlash)
			}
		})
	}
}

// htmlEscape is how html/template writes s in text.
func htmlEscape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&#34;", "'", "&#39;").Replace(s)
}

func TestConfirmationPagesCount(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	for _, tc := range []struct {
		page string
		want []string
	}{
		{"/incidents/confirm?action=freeze&tool=refund_order&tenant=acme", []string{
			`<span class="big">4</span> calls to refund_order so far in tenant acme, at any time and whatever else the question named`,
			"deny new calls to refund_order for tenant acme", `name="action" value="freeze"`, `name="tool" value="refund_order"`,
			`name="tenant" value="acme"`, `action="/incidents/act"`, "Freeze refund_order</button>", `href="/incidents?tenant=acme&amp;tool=refund_order">Cancel`,
		}},
		{"/incidents/confirm?action=freeze&tool=refund_order", []string{"for your tenant (acme)"}},
		// A tenant operator's freeze is of its own tenant, all tenants
		// asked or not: the page said every tenant's.
		{"/incidents/confirm?action=freeze&tool=refund_order&all_tenants=true", []string{"for your tenant (acme)"}},
		// A single jti is a platform operator's to revoke (the
		// control API refuses a tenant's).
		{"/incidents/confirm?action=revoke_jti&jti=jti-1", []string{"Only a platform operator revokes a single credential"}},
		{"/incidents/confirm?action=revoke_family&credential_family=refund_order:acme:1", []string{"credential family refund_order:acme:1", `name="credential_family" value="refund_order:acme:1"`}},
		{"/incidents/confirm?action=compensate&tool=refund_order", []string{
			`<span class="big">3</span> succeeded call(s) will each get a compensation request`, "refund-1", "refund-2",
			`name="digest" value="` + keysDigest([]ledger.CallKey{keyOK1, keyHostile, keyOK2}) + `"`,
		}},
		// The unfreeze shows the freeze it lifts and is bound to it.
		{"/health/unfreeze?tool=refund_order&tenant=acme", []string{
			"Frozen for tenant acme by olga at " + t0.Add(-30*time.Minute).UTC().Format(time.RFC3339) + ": incident 12",
			`name="freeze_at" value="` + t0.Add(-30*time.Minute).UTC().Format(time.RFC3339Nano) + `"`, `action="/health/unfreeze"`,
		}},
		// A platform freeze over the tenant's own says that one stays.
		{"/health/unfreeze?tool=lookup_order&tenant=acme", []string{
			htmlEscape("This freeze replaced the tenant's own, by olga at " + t0.Add(-2*time.Hour).UTC().Format(time.RFC3339) + ": our loop. That one stays in force: calls to lookup_order for tenant acme stay refused until the tenant lifts it."),
			`action="/health/unfreeze"`,
		}},
		// Lifting the tenant's own says that the freeze of every tenant
		// stays; lifting that one, that the tenants' own stay.
		{"/health/unfreeze?tool=export_data&tenant=acme", []string{
			"export_data is also frozen for every tenant, which stays in force: calls to export_data for tenant acme stay refused until a platform operator lifts that freeze.",
		}},
		{"/health/unfreeze?tool=export_data&platform=1", []string{
			"Calls to export_data will be accepted and run again for every tenant but these, whose own freezes stay in force: acme.",
		}},
	} {
		w := b.get(tc.page)
		body := w.Body.String()
		if strings.Contains(tc.page, "lookup_order") || strings.Contains(tc.page, "platform=1") {
			// Only a platform operator lifts that freeze.
			body = fx.signedIn(assertPlatform).get(tc.page).Body.String()
		}
		if strings.Contains(tc.page, "export_data") && strings.Contains(body, "will be accepted and run again.") {
			t.Errorf("GET %s promises the calls run again, though another freeze stays in force", tc.page)
		}
		if w.Code != http.StatusOK {
			t.Errorf("GET %s = %d", tc.page, w.Code)
		}
		for _, want := range tc.want {
			if !strings.Contains(body, want) {
				t.Errorf("GET %s lacks %q", tc.page, want)
			}
		}
	}
	// A freeze or a revocation is counted by what it acts on: the tool or
	// the credential in scope, not the rest of the question.
	for page, want := range map[string]url.Values{
		"/incidents/confirm?action=freeze&tool=refund_order&tenant=acme&approver=u_x&since=1h": {"tool": {"refund_order"}, "tenant": {"acme"}},
		"/incidents/confirm?action=revoke_jti&jti=jti-1&tool=refund_order&all_tenants=true":    {"jti": {"jti-1"}, "all_tenants": {"true"}},
	} {
		fx.api.reset()
		b.get(page)
		var asked url.Values
		for _, r := range fx.api.requests() {
			if strings.HasSuffix(r.Path, "/v1/blast-radius") {
				asked = r.Query
			}
		}
		if !reflect.DeepEqual(asked, want) {
			t.Errorf("GET %s counted with %v; want %v", page, asked, want)
		}
	}
	// The compensate-all confirmation lists only the succeeded calls.
	body := b.get("/incidents/confirm?action=compensate&tool=refund_order").Body.String()
	if strings.Contains(body, "refund-3") {
		t.Errorf("compensate-all confirmation lists the failed call refund-3")
	}
	// A tenant operator is shown a freeze of every tenant, and no form:
	// the API would take the unfreeze as of its own tenant's.
	if body := b.get("/health/unfreeze?tool=" + url.QueryEscape(xssScript)).Body.String(); !strings.Contains(body, "Only a platform operator lifts a freeze of every tenant.") || strings.Contains(body, `action="/health/unfreeze"`) {
		t.Errorf("a tenant operator's unfreeze confirmation of a platform freeze: want it said, and no form:\n%s", body)
	}
	// Not frozen: no form.
	if body := b.get("/health/unfreeze?tool=send_email").Body.String(); !strings.Contains(body, "send_email is not frozen for every tenant.") || strings.Contains(body, `action="/health/unfreeze"`) {
		t.Errorf("unfreeze confirmation of a tool not frozen: want it said, and no form:\n%s", body)
	}
	// Nothing to confirm: no form.
	fx.api.blast.Calls = fx.api.blast.Calls[2:3]
	body = b.get("/incidents/confirm?action=compensate&tool=refund_order").Body.String()
	if strings.Contains(body, `action="/incidents/act"`) {
		t.Errorf("compensate-all with no succeeded call offers a form")
	}
	if w := b.get("/incidents/confirm?action=explode"); w.Code != http.StatusBadRequest {
		t.Errorf("unknown action confirmation = %d; want 400", w.Code)
	}
}

// compensateAllDigest opens the compensate-all confirmation of
// refund_order's succeeded calls and returns the digest it binds them by.
func compensateAllDigest(t *testing.T, b *browser) string {
	t.Helper()
	confirm := b.get("/incidents/confirm?action=compensate&tool=refund_order").Body.String()
	digest := regexp.MustCompile(`name="digest" value="([0-9a-f]+)"`).FindStringSubmatch(confirm)
	if digest == nil {
		t.Fatalf("no digest on the confirmation page")
	}
	return digest[1]
}

func TestCompensateAll(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	digest := compensateAllDigest(t, b)
	fx.api.reset()
	w := b.post("/incidents/act", url.Values{"action": {"compensate"}, "tool": {"refund_order"}, "reason": {"mass refund fraud"}, "digest": {digest}})
	var bodies []string
	for _, r := range fx.api.requests() {
		if r.Auth != "Bearer "+assertOperator {
			t.Errorf("%s %s without the session's assertion", r.Method, r.Path)
		}
		if r.Method == "POST" {
			if r.Path != "/v1/compensations" {
				t.Errorf("POST %s; want /v1/compensations", r.Path)
			}
			bodies = append(bodies, strings.TrimSpace(r.Body))
		}
	}
	want := []string{
		mustJSON(t, compensateBody{TenantID: "acme", IdempotencyKey: "refund-1", Reason: "mass refund fraud"}),
		mustJSON(t, compensateBody{TenantID: keyHostile.TenantID, IdempotencyKey: keyHostile.IdempotencyKey, Reason: "mass refund fraud"}),
		mustJSON(t, compensateBody{TenantID: "acme", IdempotencyKey: "refund-2", Reason: "mass refund fraud"}),
	}
	if d := cmp.Diff(want, bodies); d != "" {
		t.Errorf("compensation requests (-want +got):\n%s", d)
	}
	flash := followFlash(t, b, w.Result())
	if !strings.Contains(flash, "olga asked to compensate 2 of 3 succeeded call(s). 1 refused: acme/refund-2: not_compensable") {
		t.Errorf("flash %q; want the count and the refusal", flash)
	}

	// A compensation answered 200 and refused (rate limited) is counted
	// as refused, not as asked.
	fx.api.mu.Lock()
	fx.api.deniedCompensations["refund-1"] = ledger.Event{V: 1, Type: statemachine.EventDenied, Reason: "rate_limited", RetryAfterMS: 2000}
	fx.api.mu.Unlock()
	w = b.post("/incidents/act", url.Values{"action": {"compensate"}, "tool": {"refund_order"}, "reason": {"mass refund fraud"}, "digest": {digest}})
	flash = followFlash(t, b, w.Result())
	if want := "olga asked to compensate 1 of 3 succeeded call(s). 2 refused: acme/refund-1: compensation call acme/refund-1:compensate denied (rate_limited); it may pass if asked again in 2s; acme/refund-2: not_compensable"; !strings.Contains(flash, want) || !strings.HasPrefix(flash, "bad:") {
		t.Errorf("flash %q; want a bad flash with %q", flash, want)
	}

	// The question now matches other calls: nothing is done.
	fx.api.blast.Calls = fx.api.blast.Calls[:1]
	fx.api.reset()
	w = b.post("/incidents/act", url.Values{"action": {"compensate"}, "tool": {"refund_order"}, "reason": {"again"}, "digest": {digest}})
	for _, r := range fx.api.requests() {
		if r.Method == "POST" {
			t.Errorf("a stale confirmation still posted %s", r.Path)
		}
	}
	if loc := w.Header().Get("Location"); !strings.HasPrefix(loc, "/incidents/confirm?action=compensate") {
		t.Errorf("stale confirmation redirects to %q; want back to the confirmation", loc)
	}
	if flash := followFlash(t, b, w.Result()); !strings.Contains(flash, "nothing was done") {
		t.Errorf("flash %q; want it to say nothing was done", flash)
	}
}

// A compensate-all question with a window given as durations is
// confirmed and acted on as the same times: the confirmation pins them
// (and ends an open window at its own now), so that the question asked
// again a minute later, when the reason has been typed, matches the calls
// confirmed. Before, "24h" was asked again as 24 hours before the POST,
// and the digest of a busy tool's calls never matched.
func TestCompensateAllPinsItsWindow(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	fx.api.reset()
	confirm := b.get("/incidents/confirm?action=compensate&tool=refund_order&since=24h").Body.String()
	hiddenValue := func(name string) string {
		m := regexp.MustCompile(`name="` + name + `" value="([^"]*)"`).FindStringSubmatch(confirm)
		if m == nil {
			t.Fatalf("the confirmation has no %s field", name)
		}
		return m[1]
	}
	since, until, digest := hiddenValue("since"), hiddenValue("until"), hiddenValue("digest")
	if want := t0.Add(-24 * time.Hour).UTC().Format(time.RFC3339Nano); since != want {
		t.Errorf("confirmed since %q; want %q", since, want)
	}
	if want := t0.UTC().Format(time.RFC3339Nano); until != want {
		t.Errorf("confirmed until %q; want %q", until, want)
	}
	counted := fx.api.requests()
	if len(counted) != 1 || counted[0].Query.Get("since") != since || counted[0].Query.Get("until") != until {
		t.Fatalf("the confirmation asked %v; want one question over since %s until %s", counted, since, until)
	}
	fx.mu.Lock()
	fx.now = fx.now.Add(time.Minute)
	fx.mu.Unlock()
	fx.api.reset()
	b.post("/incidents/act", url.Values{"action": {"compensate"}, "tool": {"refund_order"}, "since": {since}, "until": {until}, "reason": {"fraud"}, "digest": {digest}})
	asked, posted := 0, 0
	for _, r := range fx.api.requests() {
		switch {
		case strings.HasSuffix(r.Path, "/v1/blast-radius"):
			asked++
			if r.Query.Get("since") != since || r.Query.Get("until") != until {
				t.Errorf("the action asked since %q until %q; want the confirmed %q, %q", r.Query.Get("since"), r.Query.Get("until"), since, until)
			}
		case r.Method == "POST":
			posted++
		}
	}
	if asked == 0 || posted != 3 {
		t.Errorf("the action asked %d question(s) and posted %d compensation(s); want the question asked again and 3 posted", asked, posted)
	}
	// The question's own page keeps the durations the responder typed.
	if !strings.Contains(confirm, `href="/incidents?since=24h&amp;tool=refund_order"`) {
		t.Errorf("the confirmation's cancel link does not lead back to the question as typed")
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestCSVExport(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	fx.api.reset()
	w := b.get("/incidents.csv?tool=refund_order&jti=jti-1&since=2h&bogus=1")
	if w.Code != http.StatusOK {
		t.Fatalf("GET /incidents.csv = %d:\n%s", w.Code, w.Body)
	}
	if got := w.Body.String(); got != csvBody {
		t.Errorf("CSV body %q; want the API's %q", got, csvBody)
	}
	if ct := w.Header().Get("Content-Type"); ct != "text/csv; charset=utf-8" {
		t.Errorf("Content-Type %q", ct)
	}
	if cd := w.Header().Get("Content-Disposition"); cd != `attachment; filename="blast-radius-20261130T140000Z.csv"` {
		t.Errorf("Content-Disposition %q; want a dated download filename", cd)
	}
	reqs := fx.api.requests()
	if len(reqs) != 1 || reqs[0].Path != "/v1/blast-radius" || reqs[0].Auth != "Bearer "+assertOperator {
		t.Fatalf("API requests %v; want one GET /v1/blast-radius with the assertion", reqs)
	}
	wantQ := url.Values{"format": {"csv"}, "tool": {"refund_order"}, "jti": {"jti-1"}, "since": {"2h"}}
	if d := cmp.Diff(wantQ, reqs[0].Query); d != "" {
		t.Errorf("CSV query (-want +got):\n%s", d)
	}

	// An export cut at the API's limit says so in its name and headers:
	// the file alone would pass for the whole list.
	fx.api.mu.Lock()
	fx.api.blast.Truncated, fx.api.blast.Total = true, 3400
	fx.api.mu.Unlock()
	w = b.get("/incidents.csv?tool=refund_order")
	if cd := w.Header().Get("Content-Disposition"); w.Code != http.StatusOK || cd != `attachment; filename="blast-radius-20261130T140000Z-cut-of-3400.csv"` ||
		w.Header().Get(httpapi.HeaderTruncated) != "true" || w.Header().Get(httpapi.HeaderTotalCount) != "3400" {
		t.Errorf("a cut export = %d, Content-Disposition %q, %s %q, %s %q; want its name and headers to say it is cut, of 3400",
			w.Code, cd, httpapi.HeaderTruncated, w.Header().Get(httpapi.HeaderTruncated), httpapi.HeaderTotalCount, w.Header().Get(httpapi.HeaderTotalCount))
	}

	fx.api.refuse["GET /v1/blast-radius"] = refusalSpec{status: http.StatusBadRequest, code: "invalid_filter", message: "invalid filter: since: \"x\" is neither"}
	w = b.get("/incidents.csv?since=x")
	if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "invalid_filter") || w.Header().Get("Content-Disposition") != "" {
		t.Errorf("refused CSV = %d %q; want 400, the API's code and no download", w.Code, w.Header().Get("Content-Disposition"))
	}
}

func TestStreamerFlushes(t *testing.T) {
	// The CSV passes through as the API writes it, flushes included.
	w := &flushRecorder{ResponseRecorder: newTestRecorder()}
	s := &streamer{w: w, start: func(_, h http.Header) { h.Set("X-Started", "1") }, header: http.Header{}}
	_, _ = s.Write([]byte("a,b\n"))
	s.Flush()
	if w.flushes != 1 || w.Body.String() != "a,b\n" || w.Header().Get("X-Started") != "1" {
		t.Errorf("streamer: flushes %d body %q started %q", w.flushes, w.Body, w.Header().Get("X-Started"))
	}
}

// deadlineRecorder records the write deadlines set on it.
type deadlineRecorder struct {
	*httptest.ResponseRecorder
	deadlines []time.Time
}

func (d *deadlineRecorder) SetWriteDeadline(t time.Time) error {
	d.deadlines = append(d.deadlines, t)
	return nil
}

// The API's bound on writing an answer it streams through the console
// (httpapi's WriteTimeout) reaches the browser's connection: before, the
// streamer did not pass it on, and a client that did not read held the
// answer for as long as its connection lasted.
func TestStreamerPassesTheWriteDeadline(t *testing.T) {
	w := &deadlineRecorder{ResponseRecorder: httptest.NewRecorder()}
	s := &streamer{w: w, start: func(_, _ http.Header) {}, header: http.Header{}}
	at := time.Now().Add(time.Minute)
	if err := http.NewResponseController(s).SetWriteDeadline(at); err != nil || len(w.deadlines) != 1 || !w.deadlines[0].Equal(at) {
		t.Errorf("SetWriteDeadline through the streamer: %v, deadlines %v; want %v set on the browser's writer", err, w.deadlines, at)
	}
}

func TestLocalPath(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"/calls?tool=x", "/calls?tool=x"},
		{"/calls/acme/k", "/calls/acme/k"},
		{"//evil.example/", "/d"},
		{"https://evil.example/", "/d"},
		{"javascript:alert(1)", "/d"},
		{"/\\evil.example", "/d"},
		{"", "/d"},
		{"calls", "/d"},
	} {
		if got := localPath(tc.in, "/d"); got != tc.want {
			t.Errorf("localPath(%q) = %q; want %q", tc.in, got, tc.want)
		}
	}
}

func TestFlattenArgs(t *testing.T) {
	rows, cut, err := flattenArgs([]byte(`{"b":{"c~/d":[1,"[redacted]"]},"a":"x","e":{},"f":null}`))
	if err != nil || cut {
		t.Fatalf("flattenArgs: %v, cut %v", err, cut)
	}
	want := []argRow{
		{Pointer: "/a", Value: "x"},
		{Pointer: "/b/c~0~1d/0", Value: "1"},
		{Pointer: "/b/c~0~1d/1", Value: "[redacted]", Masked: true},
		{Pointer: "/e", Value: "{}"},
		{Pointer: "/f", Value: "null"},
	}
	if d := cmp.Diff(want, rows); d != "" {
		t.Errorf("flattenArgs (-want +got):\n%s", d)
	}
}

// A value whose spaces a page would not show as they are (at either
// end, or two in a row, which HTML collapses) shows them as \u0020, and
// counts as hidden, so that the approval page offers no approval of
// what it does not show: "ACME  Corp" read as the vendor "ACME Corp".
// One space between words is shown as it is.
func TestFlattenArgsSpaces(t *testing.T) {
	rows, _, err := flattenArgs([]byte(`{"a":"ACME  Corp","b":"ACME Corp ","c":" ACME","d":"ACME Corp","e":"  "}`))
	if err != nil {
		t.Fatal(err)
	}
	want := []argRow{
		{Pointer: "/a", Value: `ACME\u0020\u0020Corp`, Hidden: true},
		{Pointer: "/b", Value: `ACME Corp\u0020`, Hidden: true},
		{Pointer: "/c", Value: `\u0020ACME`, Hidden: true},
		{Pointer: "/d", Value: "ACME Corp"},
		{Pointer: "/e", Value: `\u0020\u0020`, Hidden: true},
	}
	if d := cmp.Diff(want, rows); d != "" {
		t.Errorf("flattenArgs (-want +got):\n%s", d)
	}
}

// Behind a proxy that terminates TLS, SecureCookies marks the cookies
// Secure and sends HSTS on plain HTTP requests too.
func TestSecureCookiesBehindAProxy(t *testing.T) {
	fx := newFixture(t, func(*fixture) fixtureOpt { return func(c *Config) { c.SecureCookies = true } })
	b := fx.browser()
	w := b.get("/login")
	if w.Header().Get("Strict-Transport-Security") == "" {
		t.Error("no HSTS header with SecureCookies")
	}
	for _, ck := range w.Result().Cookies() {
		if !ck.Secure {
			t.Errorf("cookie %s not Secure with SecureCookies", ck.Name)
		}
	}
	b.signIn(assertOperator)
	if ck := b.cookies[CookieName]; ck == nil || !ck.Secure {
		t.Errorf("session cookie %+v; want it Secure", ck)
	}
	// And without the option, plain HTTP gets neither.
	plain := newFixture(t).browser().get("/login")
	if plain.Header().Get("Strict-Transport-Security") != "" {
		t.Error("HSTS sent on plain HTTP without SecureCookies")
	}
}

// A sign-in ends the session the browser's cookie named: a cookie from
// before names nothing afterwards.
func TestSignInEndsThePreviousSession(t *testing.T) {
	fx := newFixture(t)
	old := fx.signedIn(assertOperator).cookies[CookieName].Value
	b := fx.browser()
	login := b.get("/login").Body.String()
	b.cookies[CookieName] = &http.Cookie{Name: CookieName, Value: old}
	w := b.do("POST", "/login", url.Values{"csrf": {csrfOf(t, login)}, "assertion": {assertOperator}}, nil)
	if w.Code != http.StatusSeeOther || b.cookies[CookieName].Value == old {
		t.Fatalf("POST /login = %d, session %q; want a new session", w.Code, b.cookies[CookieName].Value)
	}
	if n := fx.c.sessions.len(); n != 1 {
		t.Errorf("%d sessions after signing in over an old one; want 1", n)
	}
	replay := fx.browser()
	replay.cookies[CookieName] = &http.Cookie{Name: CookieName, Value: old}
	if w := replay.get("/approvals"); w.Code != http.StatusSeeOther {
		t.Errorf("GET with the previous session id = %d; want 303 to /login", w.Code)
	}
}

// A freeze or a revocation is offered though the calls it acts on could
// not be counted (the busiest tool's count is the likeliest to fail: its
// answer is the largest), saying so; compensate-all, which acts on the
// calls counted, is not.
func TestBrakesOfferedUncounted(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	fx.api.mu.Lock()
	fx.api.refuse = map[string]refusalSpec{"GET /v1/blast-radius": {status: http.StatusServiceUnavailable, code: "projection_unavailable", message: "the projection could not answer"}}
	fx.api.mu.Unlock()
	for page, offered := range map[string]bool{
		"/incidents/confirm?action=freeze&tool=refund_order&tenant=acme":                true,
		"/incidents/confirm?action=revoke_family&credential_family=refund_order:acme:1": true,
		"/incidents/confirm?action=compensate&tool=refund_order":                        false,
	} {
		body := b.get(page).Body.String()
		if got := strings.Contains(body, `action="/incidents/act"`); got != offered {
			t.Errorf("GET %s offers the form: %v; want %v", page, got, offered)
		}
		if !strings.Contains(body, "could not be counted") {
			t.Errorf("GET %s does not say the count failed", page)
		}
	}
}

// A single credential is revoked by a platform operator: the incidents
// page offers its revocation to them alone, its confirmation too even
// when the calls could not be counted. A tenant's operator, whom the
// control API refuses it, is offered the families its calls were sent
// under instead. Before, both were offered the jti's revocation, and the
// tenant's was refused only once confirmed.
func TestRevokingASingleCredentialIsThePlatformsOnly(t *testing.T) {
	fx := newFixture(t)
	platform, tenant := fx.signedIn(assertPlatform), fx.signedIn(assertOperator)
	if body := platform.get("/incidents?jti=jti-1").Body.String(); !strings.Contains(body, "Revoke credential jti-1") {
		t.Errorf("a platform operator's incidents page for jti-1 does not offer its revocation")
	}
	body := tenant.get("/incidents?jti=jti-1").Body.String()
	if strings.Contains(body, "Revoke credential jti-1") {
		t.Errorf("a tenant operator's incidents page offers the jti's revocation, which the control API refuses them")
	}
	if want := "action=revoke_family&amp;credential_family=refund_order%3Aacme%3A1"; !strings.Contains(body, want) || !strings.Contains(body, "Revoke family refund_order:acme:1") {
		t.Errorf("a tenant operator's incidents page for jti-1 does not offer its calls' family (%q)", want)
	}
	if strings.Contains(tenant.get("/incidents/confirm?action=revoke_jti&jti=jti-1").Body.String(), `action="/incidents/act"`) {
		t.Errorf("a tenant operator's jti confirmation offers the form")
	}
	fx.api.mu.Lock()
	fx.api.refuse = map[string]refusalSpec{"GET /v1/blast-radius": {status: http.StatusServiceUnavailable, code: "projection_unavailable", message: "the projection could not answer"}}
	fx.api.mu.Unlock()
	body = platform.get("/incidents/confirm?action=revoke_jti&jti=jti-1").Body.String()
	for _, want := range []string{`action="/incidents/act"`, `name="jti" value="jti-1"`, "There is no un-revoke", "could not be counted"} {
		if !strings.Contains(body, want) {
			t.Errorf("a platform operator's uncounted jti confirmation lacks %q", want)
		}
	}
}

// A tenant operator asking what a credential touched is offered the
// families that the events carrying it name. A call's summary names the
// credential of its last event: none once the call is compensated, the
// reconciler's own once it settled the call by a status lookup. Before,
// the page offered the families of the summaries: none for the first call,
// the reconciler's for the second, and never the leaked credential's.
func TestRevokeFamilyOfferedIsTheCredentialsOwn(t *testing.T) {
	const (
		leaked, leakedFamily = "jti-leaked", "refund_order:acme:7"
		lookup, lookupFamily = "jti-reconciler", "reconciler:acme:1"
	)
	keyCompensated := ledger.CallKey{TenantID: "acme", IdempotencyKey: "refund-compensated"}
	keyReconciled := ledger.CallKey{TenantID: "acme", IdempotencyKey: "refund-reconciled"}
	trace := func(k ledger.CallKey, last ...ledger.Event) []ledger.Event {
		evs := []ledger.Event{
			{Type: statemachine.EventRequested},
			{Type: statemachine.EventAuthorized},
			{Type: statemachine.EventExecuting, JTI: leaked, CredentialFamily: leakedFamily},
		}
		evs = append(evs, last...)
		for i := range evs {
			evs[i].V, evs[i].EventID, evs[i].Seq, evs[i].At = 1, fmt.Sprintf("%s-%d", k.IdempotencyKey, i+1), int64(i+1), t0.Add(time.Duration(i-10)*time.Minute)
			evs[i].TenantID, evs[i].IdempotencyKey, evs[i].Tool = k.TenantID, k.IdempotencyKey, "refund_order"
		}
		return evs
	}
	traces := map[ledger.CallKey][]ledger.Event{
		keyCompensated: trace(keyCompensated,
			ledger.Event{Type: statemachine.EventSucceeded, JTI: leaked, CredentialFamily: leakedFamily},
			ledger.Event{Type: statemachine.EventCompensated}),
		keyReconciled: trace(keyReconciled,
			ledger.Event{Type: statemachine.EventOutcomeUnknown, JTI: leaked, CredentialFamily: leakedFamily},
			ledger.Event{Type: statemachine.EventSucceeded, JTI: lookup, CredentialFamily: lookupFamily}),
	}
	for _, tc := range []struct {
		name  string
		calls []ledger.CallKey
		// unreadable: the reconciled call's trace is refused; the page
		// still offers what the other call's events say.
		unreadable bool
	}{
		{"compensated", []ledger.CallKey{keyCompensated}, false},
		{"reconciled", []ledger.CallKey{keyReconciled}, false},
		{"both", []ledger.CallKey{keyReconciled, keyCompensated}, false},
		{"trace unreadable", []ledger.CallKey{keyReconciled, keyCompensated}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t)
			br := projections.BlastRadius{Total: len(tc.calls)}
			for _, k := range tc.calls {
				evs := traces[k]
				br.Calls = append(br.Calls, projections.CallOf(&evs[len(evs)-1]))
			}
			fx.api.mu.Lock()
			fx.api.blast, fx.api.traces = br, traces
			if tc.unreadable {
				fx.api.refuse = map[string]refusalSpec{"GET /v1/trace/acme/" + keyReconciled.IdempotencyKey: {status: http.StatusServiceUnavailable, code: "projection_unavailable", message: "the projection could not answer"}}
			}
			fx.api.mu.Unlock()
			w := fx.signedIn(assertOperator).get("/incidents?jti=" + leaked)
			if w.Code != http.StatusOK {
				t.Fatalf("GET /incidents?jti=%s = %d; want 200", leaked, w.Code)
			}
			body := w.Body.String()
			if want := "Revoke family " + leakedFamily; !strings.Contains(body, want) {
				t.Errorf("the tenant operator's incidents page for %s does not offer %q", leaked, want)
			}
			if strings.Contains(body, lookupFamily) {
				t.Errorf("the tenant operator's incidents page for %s offers %s, the reconciler's family", leaked, lookupFamily)
			}
		})
	}
}

// A call taken over across a key rotation was sent under one family by
// its first owner and another by the next: a tenant operator is offered
// both, the one the last event names and the earlier. Before, a call
// whose summary named the credential offered that event's family alone,
// and the first owner's token stayed live.
func TestRevokeFamiliesOfATakenOverCall(t *testing.T) {
	const leaked, first, next = "jti-leaked", "refund_order:acme:7", "refund_order:acme:8"
	k := ledger.CallKey{TenantID: "acme", IdempotencyKey: "refund-taken-over"}
	evs := []ledger.Event{
		{Type: statemachine.EventRequested},
		{Type: statemachine.EventAuthorized},
		{Type: statemachine.EventExecuting, JTI: leaked, CredentialFamily: first},
		{Type: statemachine.EventSucceeded, JTI: leaked, CredentialFamily: next, EarlierCredentialFamilies: []string{first}},
	}
	for i := range evs {
		evs[i].V, evs[i].EventID, evs[i].Seq, evs[i].At = 1, fmt.Sprintf("to-%d", i+1), int64(i+1), t0.Add(time.Duration(i-10)*time.Minute)
		evs[i].TenantID, evs[i].IdempotencyKey, evs[i].Tool = k.TenantID, k.IdempotencyKey, "refund_order"
	}
	fx := newFixture(t)
	fx.api.mu.Lock()
	fx.api.blast = projections.BlastRadius{Total: 1, Calls: []projections.Call{projections.CallOf(&evs[len(evs)-1])}}
	fx.api.traces = map[ledger.CallKey][]ledger.Event{k: evs}
	fx.api.mu.Unlock()
	body := fx.signedIn(assertOperator).get("/incidents?jti=" + leaked).Body.String()
	for _, f := range []string{first, next} {
		if !strings.Contains(body, "Revoke family "+f) {
			t.Errorf("the tenant operator's incidents page for %s does not offer family %s", leaked, f)
		}
	}
	if strings.Contains(body, "more families than") {
		t.Errorf("the page says more families are involved than it offers; want none left out")
	}
	// Taken over again and again: more families than the page offers,
	// which it says.
	last := &evs[len(evs)-1]
	for i := range maxFamiliesOffered {
		last.EarlierCredentialFamilies = append(last.EarlierCredentialFamilies, fmt.Sprintf("refund_order:acme:%d", 20+i))
	}
	body = fx.signedIn(assertOperator).get("/incidents?jti=" + leaked).Body.String()
	if n := strings.Count(body, "Revoke family "); n != maxFamiliesOffered || !strings.Contains(body, "more families than") {
		t.Errorf("%d families offered of %d, the page saying more: %v; want %d, saying so", n, maxFamiliesOffered+2, strings.Contains(body, "more families than"), maxFamiliesOffered)
	}
}

// An approval binds every argument: the page offers none where it cannot
// show them all (more fields than it lists, none at all; arguments that
// do not parse, which the API's JSON cannot carry, alike), and says where
// to read them in full; rejecting stays.
func TestApprovalPageOffersNoApprovalOfArgumentsNotShown(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertApprover)
	for k, why := range map[ledger.CallKey]string{
		keyWideArgs: "it shows only the first 500 of its arguments",
		keyNoArgs:   "it has no arguments to show",
		keyBidiArgs: "characters that do not show on a page as they are",
	} {
		w := b.get(approvalURL(k.ApprovalID()))
		if w.Code != http.StatusOK {
			t.Fatalf("GET %s = %d; want 200:\n%s", approvalURL(k.ApprovalID()), w.Code, w.Body)
		}
		body := w.Body.String()
		if strings.Contains(body, `/approve"`) || strings.Contains(body, `name="arguments_hash"`) {
			t.Errorf("%s: the page offers an approval of arguments it cannot show whole", k.IdempotencyKey)
		}
		for _, want := range []string{why, "ledger approvals show " + k.ApprovalID(), `/reject"`} {
			if !strings.Contains(body, want) {
				t.Errorf("%s: the page lacks %q", k.IdempotencyKey, want)
			}
		}
	}
	if body := b.get(approvalURL(keyPending.ApprovalID())).Body.String(); !strings.Contains(body, `name="arguments_hash" value="`+hashPending+`"`) {
		t.Errorf("the approval whose arguments show whole offers no approval")
	}
	// The characters that would not show are written as escapes, on the
	// approval page and in the queue, never as themselves: a direction
	// override would show 4321-8765 as 5678-1234.
	for _, page := range []string{approvalURL(keyBidiArgs.ApprovalID()), "/approvals"} {
		body := b.get(page).Body.String()
		if strings.ContainsAny(body, "\u202e\u200b") {
			t.Errorf("%s holds a direction override or a zero-width space as itself", page)
		}
		if !strings.Contains(body, `\u202e4321`) {
			t.Errorf("%s does not show the direction override as an escape", page)
		}
		// Right-to-left letters show, and reorder nothing: what an agent
		// put there is shown in the order it is held.
		if want := "<bdo dir=\"ltr\">\u0639 45.00</bdo>"; !strings.Contains(body, want) {
			t.Errorf("%s does not hold the amount's right-to-left letter in an ltr override (%q)", page, want)
		}
	}
	if body := b.get(approvalURL(keyBidiArgs.ApprovalID())).Body.String(); !strings.Contains(body, "<bdo dir=\"ltr\">\u0639 4321-8765</bdo>") {
		t.Errorf("the approval page does not hold an argument's right-to-left letter in an ltr override")
	}
}

// An API answer that breaks off (a proxied service that stops mid-answer,
// an answer too large to pass on: the reverse proxy aborts) is a page that
// says so, not a connection reset with nothing logged: the approvals
// queue, the page every sign-in lands on, still shows.
func TestAPIAnswerBrokenOffIsAPage(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertApprover)
	fx.api.mu.Lock()
	fx.api.refuse["GET /v1/approvals"] = refusalSpec{abort: true}
	fx.api.mu.Unlock()
	w := b.get("/approvals")
	if w.Code != http.StatusOK || !strings.Contains(w.Body.String(), "answer_broken_off") {
		t.Errorf("GET /approvals with the API's answer broken off = %d; want the page, saying so:\n%s", w.Code, w.Body)
	}
}

// An action whose answer breaks off may have been taken: the console says
// so, and logs it as sent, not as refused. So may one that ledger api's
// proxy answers 502 upstream_unavailable: the service behind it may have
// taken the action before the connection broke (before, the console said
// it was refused). So may one whose service's write failed and could not
// be read back (503 action_outcome_unknown), which the console says in
// the service's words.
func TestActionAnswerBrokenOffMayHaveBeenTaken(t *testing.T) {
	for name, spec := range map[string]refusalSpec{
		"broken off":           {abort: true},
		"upstream unavailable": {status: http.StatusBadGateway, code: httpjson.CodeUpstreamUnavailable, message: "a service behind this API does not answer; see its log"},
		"write not read back":  {status: http.StatusServiceUnavailable, code: httpjson.CodeActionOutcomeUnknown, message: "read the approval before deciding again"},
	} {
		t.Run(name, func(t *testing.T) {
			fx := newFixture(t)
			b := fx.signedIn(assertApprover)
			fx.api.mu.Lock()
			fx.api.refuse["POST "+apiApprovalPath(keyPending.ApprovalID())+"/approve"] = spec
			fx.api.mu.Unlock()
			w := b.post(approvalURL(keyPending.ApprovalID())+"/approve", url.Values{"arguments_hash": {hashPending}})
			got := followFlash(t, b, w.Result())
			if !strings.Contains(got, "may or may not have been taken") || strings.Contains(got, "was refused") {
				t.Errorf("flash %q after an approval whose answer broke off; want it to say it may have been taken", got)
			}
			if spec.message != "" && spec.code != httpjson.CodeUpstreamUnavailable && !strings.Contains(got, spec.message) {
				t.Errorf("flash %q; want the service's words, %q", got, spec.message)
			}
		})
	}
}

// Compensate-all counts the compensations whose answers broke off apart:
// sent, and maybe asked, not refused.
func TestCompensateAllAnswersBrokenOff(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	digest := compensateAllDigest(t, b)
	fx.api.mu.Lock()
	fx.api.refuse["POST /v1/compensations"] = refusalSpec{abort: true}
	fx.api.mu.Unlock()
	w := b.post("/incidents/act", url.Values{"action": {"compensate"}, "tool": {"refund_order"}, "reason": {"fraud"}, "digest": {digest}})
	flash := followFlash(t, b, w.Result())
	if !strings.Contains(flash, "3 sent, their answers broken off, so maybe asked") || strings.Contains(flash, "refused") {
		t.Errorf("flash %q; want the three counted as maybe asked, none as refused", flash)
	}
}

// A confirmed compensate-all is carried out whole when the browser goes
// away meanwhile (a proxy's idle timeout, a tab closed): before, every
// request after the connection went failed at once, reported as sent and
// maybe asked.
func TestCompensateAllOutlivesTheBrowser(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	digest := compensateAllDigest(t, b)
	ctx, cancel := context.WithCancel(t.Context())
	b.ctx = ctx
	fx.api.mu.Lock()
	fx.api.afterCompensation = cancel // the browser goes after the first
	fx.api.mu.Unlock()
	w := b.post("/incidents/act", url.Values{"action": {"compensate"}, "tool": {"refund_order"}, "reason": {"fraud"}, "digest": {digest}})
	b.ctx = nil
	// refund-2's tool declares no compensation (the fake's refusal).
	if flash := followFlash(t, b, w.Result()); !strings.Contains(flash, "asked to compensate 2 of 3") || strings.Contains(flash, "broken off") {
		t.Errorf("flash %q; want every call asked, the browser gone after the first, none broken off", flash)
	}
}

// A compensate-all whose bound runs out says the calls it did not get to
// were not sent, and sends none of them. Before, the loop went on past
// the bound: each request failed before it left (at ledger api's proxy)
// and was reported as sent, its answer broken off, so maybe asked.
func TestCompensateAllSaysWhatItDidNotSend(t *testing.T) {
	fx := newFixture(t, func(*fixture) fixtureOpt {
		return func(c *Config) { c.CompensateAllBound = time.Second }
	})
	b := fx.signedIn(assertOperator)
	digest := compensateAllDigest(t, b)
	var asked atomic.Int64
	fx.api.mu.Lock()
	fx.api.afterCompensation = func() {
		asked.Add(1)
		time.Sleep(1200 * time.Millisecond) // the bound runs out
	}
	fx.api.mu.Unlock()
	w := b.post("/incidents/act", url.Values{"action": {"compensate"}, "tool": {"refund_order"}, "reason": {"fraud"}, "digest": {digest}})
	flash := followFlash(t, b, w.Result())
	if n := asked.Load(); n != 1 {
		t.Errorf("%d compensations asked; want 1, none past the bound", n)
	}
	if !strings.Contains(flash, "asked to compensate 1 of 3") || !strings.Contains(flash, "2 not sent") || strings.Contains(flash, "broken off") {
		t.Errorf("flash %q; want one asked, the other two said to be not sent", flash)
	}
}

// A compensate-all that outlasts the session's assertion stops at the
// first refusal of it, says how many calls it did not send and why, and
// its report reaches its user once they sign in again on that browser;
// the sign-in page it is sent to says only that there is one. Before, the
// rest were counted nowhere, and the report was lost with the session;
// then it was shown on the sign-in page, to whoever opened it on that
// browser within the hour, another user or tenant included. Another user
// signing in there is not shown it, nor is its user after that.
func TestCompensateAllReportOutlivesTheSession(t *testing.T) {
	want := "Your last session ended before this was shown: olga asked to compensate 1 of 3 succeeded call(s). 1 refused: " + keyHostile.String()
	for _, tc := range []struct {
		name    string
		signIns []string // the browser's sign-ins after the session ended
		shown   int      // which of them is shown the report (-1: none)
	}{
		{"its user", []string{assertOperatorLater}, 0},
		{"another user first", []string{assertOtherLater, assertOperatorLater}, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t)
			b := fx.signedIn(assertOperator)
			digest := compensateAllDigest(t, b)
			fx.api.mu.Lock()
			fx.api.afterCompensation = func() {
				fx.advance(61 * time.Minute) // past the assertion's hour
				fx.api.mu.Lock()
				fx.api.refuse["POST /v1/compensations"] = refusalSpec{status: http.StatusUnauthorized, code: "unauthorized", message: "the assertion expired"}
				fx.api.mu.Unlock()
			}
			fx.api.mu.Unlock()
			w := b.post("/incidents/act", url.Values{"action": {"compensate"}, "tool": {"refund_order"}, "reason": {"fraud"}, "digest": {digest}})
			back := b.get(w.Result().Header.Get("Location"))
			if loc := back.Header().Get("Location"); loc != "/login?m=ended" {
				t.Fatalf("after the session ended, the report's page redirects to %q; want /login?m=ended", loc)
			}
			page := b.get("/login?m=ended").Body.String()
			if !strings.Contains(page, "Sign in again as the same user to read it") || strings.Contains(page, "asked to compensate") || strings.Contains(page, "olga") {
				t.Errorf("sign-in page after the session ended mid compensate-all; want it to say a report waits, and not what it says:\n%s", page)
			}
			for i, a := range tc.signIns {
				first := b.signIn(a)
				shown := strings.Contains(first, htmlEscape(want)) && strings.Contains(first, "1 not sent: your session&#39;s assertion ended")
				if shown != (i == tc.shown) || i != tc.shown && strings.Contains(first, "asked to compensate") {
					t.Errorf("sign-in %d (%s): the report shown %t; want %t:\n%s", i, a, shown, i == tc.shown, first)
				}
				if again := b.get("/approvals").Body.String(); strings.Contains(again, "asked to compensate") {
					t.Errorf("sign-in %d (%s): the report is shown again; want it once", i, a)
				}
				b.post("/logout", nil)
			}
		})
	}
}

// The outcomes histogram says which parts of the question it does not
// narrow: it counts every outcome of the tenants and tool asked, and read
// under a question by jti it was taken for what the credential touched.
func TestHistogramSaysWhatItIgnores(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	for page, want := range map[string]string{
		"/incidents?jti=jti-1&tool=refund_order":   "Not narrowed by jti:",
		"/incidents?role=contractor&decision=deny": "Not narrowed by decision, role:",
		"/incidents?tool=refund_order&since=2h":    "",
		"/incidents?tenant=acme&tool=refund_order": "",
	} {
		body := b.get(page).Body.String()
		if !strings.Contains(body, "Outcomes over the window") || !strings.Contains(body, "in all.") {
			t.Fatalf("GET %s shows no histogram", page)
		}
		if got := strings.Contains(body, "Not narrowed by"); got != (want != "") || want != "" && !strings.Contains(body, want) {
			t.Errorf("GET %s: says what the histogram ignores %v; want %q", page, got, want)
		}
	}
}

// A pending list the service cut at its bound says so: an approver who
// saw the oldest only took them for the whole queue, and the newest
// expired unseen.
func TestApprovalsSaysTheQueueIsLonger(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertApprover)
	const note = "More calls wait than the ledger lists at once"
	if body := b.get("/approvals").Body.String(); strings.Contains(body, note) {
		t.Errorf("approvals page says more wait; the list is whole")
	}
	fx.api.mu.Lock()
	fx.api.approvalsMore = true
	fx.api.mu.Unlock()
	if body := b.get("/approvals").Body.String(); !strings.Contains(body, note) {
		t.Errorf("approvals page with the list cut at the bound does not say more wait")
	}
}

// The health page counts no freezes and no revocations it could not read
// (the control API answers 503 on a stale copy): "0 frozen tools" during
// a stall would say that a freeze made elsewhere was not.
func TestHealthCountsNoFreezesItCouldNotRead(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	if body := b.get("/health").Body.String(); !strings.Contains(body, `Frozen tools</span><span class="big">4</span>`) {
		t.Fatalf("health page lacks the frozen tools' count:\n%s", body)
	}
	fx.api.mu.Lock()
	fx.api.refuse["GET /v1/control"] = refusalSpec{status: http.StatusServiceUnavailable, code: "unavailable", message: "the freezes known here are not known to be current; try again"}
	fx.api.mu.Unlock()
	body := b.get("/health").Body.String()
	if !strings.Contains(body, `Frozen tools</span><span class="big">?</span>`) || strings.Contains(body, `Frozen tools</span><span class="big">0</span>`) {
		t.Errorf("health page with the control state unread: want its counts unknown, not 0:\n%s", body)
	}
}

// A projection lag the API could not read (Kafka unreachable, a grant
// missing) is said to be unknown on the health page. Before, /v1/health
// left it at zero, and the page showed the projection caught up.
func TestHealthSaysAnUnknownLag(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	fx.api.mu.Lock()
	fx.api.lagUnknown = true
	fx.api.mu.Unlock()
	if body := b.get("/health").Body.String(); !strings.Contains(body, "could not be read") || strings.Contains(body, "behind") {
		t.Errorf("health with the projection lag unknown: want it said, not 0 behind:\n%s", body)
	}
}

// On `ledger api`, the call view is the agents' (their assertions'
// audience): it refuses the console's staff assertion, 401, and the call
// page shows the trace without an error, as when the view finds nothing.
func TestCallPageWithTheAgentsViewRefused(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	fx.api.refuse["GET /v1/calls/refund-4"] = refusalSpec{status: http.StatusUnauthorized, code: "unauthenticated", message: "an agent's identity assertion is required as a bearer token: audience_mismatch"}
	w := b.get(callURL("acme", "refund-4"))
	if w.Code != http.StatusOK || strings.Contains(w.Body.String(), "The result could not be read") {
		t.Errorf("call page with the agents' view refused = %d; want the trace, no error:\n%s", w.Code, w.Body)
	}
	// Nor does it say that no result is held: it is not served to staff.
	if body := w.Body.String(); strings.Contains(body, "No result is held") || !strings.Contains(body, "not to staff") {
		t.Errorf("call page with the agents' view refused: want it to say results are not served to staff, not that none is held")
	}
}

// ledger api holds no breakers (they are the executors'): the health page
// says where they are, not that none has been used.
func TestHealthSaysTheBreakersAreElsewhere(t *testing.T) {
	fx := newFixture(t)
	b := fx.signedIn(assertOperator)
	fx.api.mu.Lock()
	fx.api.breakersUnknown = true
	fx.api.mu.Unlock()
	if body := b.get("/health").Body.String(); strings.Contains(body, "No breaker has been used") || !strings.Contains(body, "ledger_breaker_state") {
		t.Errorf("health from ledger api: want it to say the breakers are the executors', not that none was used:\n%s", body)
	}
}

// An argument that holds a rune drawn as nothing shows it escaped, and
// counts as holding one that does not show (the Approve button is
// withheld for it): "acme-payroll\u034f" is not the acme-payroll an
// approver would read.
func TestVisibleEscapesWhatIsDrawnAsNothing(t *testing.T) {
	got, hidden := visible("acme-payroll\u034f")
	if !hidden || got != `acme-payroll\u034f` {
		t.Errorf("visible = %q, %v; want the joiner escaped, and reported", got, hidden)
	}
	if got, hidden := visible("Zürich 東京"); hidden || got != "Zürich 東京" {
		t.Errorf("visible = %q, %v; want it as it is", got, hidden)
	}
}

// A call page whose trace holds as many refused submissions as the
// projection keeps under a key (projections.MaxRefusals, the earliest and
// the latest) says which are shown and that the log holds them all, as
// the API's answer says (httpapi.HeaderRefusalsLimitReached): before, it
// printed "Refused submissions under this key 100" as if that were all
// of them. The trace comes from the ledger's own query API over the
// embedded index.
func TestCallPageSaysItsRefusalsWereCut(t *testing.T) {
	if headerRefusalsLimitReached != httpapi.HeaderRefusalsLimitReached {
		t.Fatalf("the console reads %s; the API answers %s", headerRefusalsLimitReached, httpapi.HeaderRefusalsLimitReached)
	}
	ix, err := callindex.Open(filepath.Join(t.TempDir(), "index.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ix.Close() })
	flooded := ledger.CallKey{TenantID: "acme", IdempotencyKey: "flooded"}
	few := ledger.CallKey{TenantID: "acme", IdempotencyKey: "few"}
	start := t0.Add(-time.Hour)
	if err := ix.Apply(append(projectionstest.Flood(flooded, projections.MaxRefusals+30, 1, start), projectionstest.Flood(few, 3, 2, start)...)); err != nil {
		t.Fatal(err)
	}
	queries, err := httpapi.QueryHandler(httpapi.QueryConfig{Queries: ix, Guard: func(next func(http.ResponseWriter, *http.Request, httpapi.Operator)) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			id, ok := identities[strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")]
			if !ok {
				apiErr(w, http.StatusUnauthorized, "unauthenticated", "an operator assertion is required as Authorization: Bearer")
				return
			}
			next(w, r, httpapi.Operator{User: id.User, Tenant: id.Tenant, Roles: id.Roles})
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	fx := newFixture(t, func(fx *fixture) fixtureOpt {
		return func(c *Config) {
			api := http.NewServeMux()
			api.Handle("GET "+pathTrace, queries)
			api.Handle("/", fx.api)
			c.API = api
		}
	})
	b := fx.signedIn(assertOperator)
	note := fmt.Sprintf("The earliest and the latest are shown, %d in all", projections.MaxRefusals)
	for _, c := range []struct {
		name string
		key  ledger.CallKey
		want []string
		cut  bool
	}{
		{"flooded", flooded, []string{
			fmt.Sprintf(`<span class="count">the earliest and the latest, %d</span>`, projections.MaxRefusals), note,
			"The log holds them all: <code>ledger trace --tenant acme flooded</code>, without <code>--clickhouse-dsn</code>",
		}, true},
		{"a few", few, []string{`<span class="count">3</span>`}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := b.get(callURL(c.key.TenantID, c.key.IdempotencyKey))
			body := w.Body.String()
			if w.Code != http.StatusOK || !strings.Contains(body, "Refused submissions under this key") {
				t.Fatalf("GET call page of %s = %d; want 200 with its refusals:\n%s", c.key, w.Code, body)
			}
			for _, want := range c.want {
				if !strings.Contains(body, want) {
					t.Errorf("call page of %s lacks %q", c.key, want)
				}
			}
			if got := strings.Contains(body, note) || strings.Contains(body, "the earliest"); got != c.cut {
				t.Errorf("call page of %s says its refusals were cut: %v; want %v", c.key, got, c.cut)
			}
		})
	}
}

// A call page says when it shows only the first fields of the arguments
// (before, it listed 500 rows as if they were all), and shows an agent's
// trace id with what does not show as it is escaped, as the call id
// beside it is.
func TestCallPageSaysWhatItCannotShow(t *testing.T) {
	wide := make([]string, maxArgRows+1)
	for i := range wide {
		wide[i] = `"x"`
	}
	for name, tc := range map[string]struct {
		args      string
		want, not []string
	}{
		"cut":   {`{"items":[` + strings.Join(wide, ",") + `]}`, []string{"Only the first 500 fields are shown."}, []string{"No arguments are held"}},
		"whole": {`{"items":["x"]}`, []string{"/items/0"}, []string{"Only the first 500 fields are shown."}},
	} {
		t.Run(name, func(t *testing.T) {
			fx := newFixture(t)
			k := ledger.CallKey{TenantID: "acme", IdempotencyKey: "wide-" + name}
			evs := traceEvents(k)
			for i := range evs {
				evs[i].TraceID = "tr\u202e_1"
				if evs[i].Type == statemachine.EventRequested {
					evs[i].Arguments = json.RawMessage(tc.args)
				}
			}
			fx.api.mu.Lock()
			fx.api.traces = map[ledger.CallKey][]ledger.Event{k: evs}
			fx.api.mu.Unlock()
			body := fx.signedIn(assertOperator).get(callURL(k.TenantID, k.IdempotencyKey)).Body.String()
			for _, want := range append(tc.want, `<bdo dir="ltr">tr\u202e_1</bdo>`) {
				if !strings.Contains(body, want) {
					t.Errorf("the call page lacks %q", want)
				}
			}
			for _, not := range append(tc.not, "tr\u202e_1") {
				if strings.Contains(body, not) {
					t.Errorf("the call page holds %q", not)
				}
			}
		})
	}
}
