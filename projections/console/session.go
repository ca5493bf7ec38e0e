package console

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/httpjson"
)

// idBytes is the length of session ids and CSRF tokens before encoding.
const idBytes = 32

// maxFormBytes bounds a POSTed form: a pasted assertion is the largest.
const maxFormBytes = 64 << 10

// csrfField is the hidden field that carries the CSRF token.
const csrfField = "csrf"

// session is one signed-in person. Its fields but flash never change after
// creation.
type session struct {
	key       [sha256.Size]byte
	id        Identity
	assertion string
	csrf      string
	created   time.Time

	// flash is the outcome of the last action, shown once; guarded by
	// sessions.mu.
	flash *flash
}

// flash is a one-time message after a POST.
type flash struct {
	OK   bool
	Text string
}

// sessions is the server-side session map, bounded. Its map is keyed by
// the id's SHA-256, so that a lookup's timing says nothing about the ids
// held.
type sessions struct {
	mu      sync.Mutex
	max     int
	perUser int
	byID    map[[sha256.Size]byte]*session
	// ended holds, by the session's key, the message of a session that
	// ended before its message was shown, for the sign-in page to show
	// once: a compensate-all can outlast the assertion, and its report
	// was lost with the session.
	ended map[[sha256.Size]byte]endedFlash
}

// endedFlash is an ended session's last message, when it ended, and
// whose it was: only they are shown it.
type endedFlash struct {
	f            flash
	at           time.Time
	tenant, user string
}

// Bounds of the messages kept of ended sessions.
const (
	maxEndedFlashes = 256
	endedFlashFor   = time.Hour
)

func newSessions(limit, perUser int) *sessions {
	return &sessions{max: limit, perUser: perUser, byID: make(map[[sha256.Size]byte]*session), ended: make(map[[sha256.Size]byte]endedFlash)}
}

// randomToken returns idBytes random bytes, base64url without padding.
func randomToken() (string, error) {
	b := make([]byte, idBytes)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(b), nil
}

// create starts a session for id and returns the cookie value naming it.
// A user (tenant and subject) who holds perUser sessions already loses
// their oldest: the sessions of one user, signing in again and again
// without a cookie, cannot fill the map and push everyone else out. A
// full map is then swept of expired sessions; if it is still full the
// oldest session ends.
func (ss *sessions) create(now time.Time, id Identity, assertion string) (string, *session, error) {
	raw, err := randomToken()
	if err != nil {
		return "", nil, err
	}
	csrf, err := randomToken()
	if err != nil {
		return "", nil, err
	}
	s := &session{key: sha256.Sum256([]byte(raw)), id: id, assertion: assertion, csrf: csrf, created: now}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	sameUser := func(o *session) bool { return o.id.Tenant == id.Tenant && o.id.User == id.User }
	for ss.count(sameUser) >= ss.perUser {
		ss.deleteOldestLocked(sameUser)
	}
	if len(ss.byID) >= ss.max {
		ss.sweepLocked(now)
	}
	for len(ss.byID) >= ss.max {
		ss.deleteOldestLocked(func(*session) bool { return true })
	}
	ss.byID[s.key] = s
	return raw, s, nil
}

// count is how many sessions match; ss.mu is held.
func (ss *sessions) count(match func(*session) bool) int {
	n := 0
	for _, o := range ss.byID {
		if match(o) {
			n++
		}
	}
	return n
}

// deleteOldestLocked ends the oldest session that matches; ss.mu is held.
func (ss *sessions) deleteOldestLocked(match func(*session) bool) {
	var oldest *session
	for _, o := range ss.byID {
		if match(o) && (oldest == nil || o.created.Before(oldest.created)) {
			oldest = o
		}
	}
	if oldest != nil {
		delete(ss.byID, oldest.key)
	}
}

// get returns the live session named by the cookie value; an expired one
// is deleted.
func (ss *sessions) get(now time.Time, raw string) (*session, bool) {
	if b, err := base64.RawURLEncoding.DecodeString(raw); err != nil || len(b) != idBytes {
		return nil, false
	}
	key := sha256.Sum256([]byte(raw))
	ss.mu.Lock()
	defer ss.mu.Unlock()
	s, ok := ss.byID[key]
	if !ok {
		return nil, false
	}
	if !now.Before(s.id.Expires) {
		ss.endLocked(now, s)
		return nil, false
	}
	return s, true
}

// endLocked deletes expired session s, keeping its message, if it has
// one not yet shown, for popEnded; ss.mu is held.
func (ss *sessions) endLocked(now time.Time, s *session) {
	delete(ss.byID, s.key)
	if s.flash == nil {
		return
	}
	if len(ss.ended) >= maxEndedFlashes {
		var oldest [sha256.Size]byte
		var at time.Time
		for k, e := range ss.ended {
			if now.Sub(e.at) >= endedFlashFor {
				delete(ss.ended, k)
			} else if at.IsZero() || e.at.Before(at) {
				oldest, at = k, e.at
			}
		}
		if len(ss.ended) >= maxEndedFlashes {
			delete(ss.ended, oldest)
		}
	}
	ss.ended[s.key] = endedFlash{f: *s.flash, at: now, tenant: s.id.Tenant, user: s.id.User}
}

// hasEnded reports whether the ended session the cookie value raw named
// left a message, within endedFlashFor, without saying what it is.
func (ss *sessions) hasEnded(now time.Time, raw string) bool {
	key := sha256.Sum256([]byte(raw))
	ss.mu.Lock()
	defer ss.mu.Unlock()
	e, ok := ss.ended[key]
	return ok && now.Sub(e.at) < endedFlashFor
}

// popEnded returns, once, the message left by the ended session the
// cookie value raw named, if it ended within endedFlashFor and was id's
// (the same tenant and user); another's is dropped unread: a browser
// is not a person, and whoever signs in next on it may be someone else.
func (ss *sessions) popEnded(now time.Time, raw string, id Identity) *flash {
	key := sha256.Sum256([]byte(raw))
	ss.mu.Lock()
	defer ss.mu.Unlock()
	e, ok := ss.ended[key]
	delete(ss.ended, key)
	if !ok || now.Sub(e.at) >= endedFlashFor || e.tenant != id.Tenant || e.user != id.User {
		return nil
	}
	return &e.f
}

func (ss *sessions) delete(s *session) {
	ss.mu.Lock()
	delete(ss.byID, s.key)
	ss.mu.Unlock()
}

func (ss *sessions) sweepLocked(now time.Time) {
	for _, s := range ss.byID {
		if !now.Before(s.id.Expires) {
			ss.endLocked(now, s)
		}
	}
}

// len is the number of sessions held.
func (ss *sessions) len() int {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return len(ss.byID)
}

func (ss *sessions) setFlash(s *session, f flash) {
	ss.mu.Lock()
	s.flash = &f
	ss.mu.Unlock()
}

func (ss *sessions) popFlash(s *session) *flash {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	f := s.flash
	s.flash = nil
	return f
}

// session returns the request's live session.
func (c *Console) session(r *http.Request) (*session, bool) {
	ck, err := r.Cookie(CookieName)
	if err != nil {
		return nil, false
	}
	return c.sessions.get(c.cfg.Now(), ck.Value)
}

// authed runs next for a signed-in person only. A GET without a session
// goes to the sign-in page; a POST without one, or without the session's
// CSRF token, or from another origin, is refused with 403 and nothing
// else happens.
func (c *Console) authed(next func(http.ResponseWriter, *http.Request, *session)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s, ok := c.session(r)
		if r.Method == http.MethodPost {
			if !ok {
				c.forbidden(w, r, nil, "You are not signed in, or your session ended. Sign in again; nothing was done.")
				return
			}
			if !c.checkPost(w, r, s.csrf) {
				c.forbidden(w, r, s, "This form was not sent from this console's page (its security token or origin does not match). Nothing was done.")
				return
			}
			next(w, r, s)
			return
		}
		if !ok {
			target := "/login"
			if _, err := r.Cookie(CookieName); err == nil {
				target += "?m=ended"
			}
			http.Redirect(w, r, target, http.StatusSeeOther)
			return
		}
		next(w, r, s)
	}
}

// checkPost reports whether a POST comes from this console's own page:
// from this host (Origin, when the browser sends it, and Sec-Fetch-Site)
// and with want in its CSRF field. It parses the form.
func (c *Console) checkPost(w http.ResponseWriter, r *http.Request, want string) bool {
	if !sameOrigin(r) {
		return false
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		return false
	}
	got := r.PostForm.Get(csrfField)
	return want != "" && subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}

// sameOrigin reports whether r's Origin header, when present, names r's
// host, and the browser does not say the request is cross-site.
func sameOrigin(r *http.Request) bool {
	if r.Header.Get("Sec-Fetch-Site") == "cross-site" {
		return false
	}
	o := r.Header.Get("Origin")
	if o == "" {
		return true
	}
	u, err := url.Parse(o)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return false // "null" included
	}
	return strings.EqualFold(u.Host, r.Host)
}

// setSessionCookie names the session in the browser until expires.
func (c *Console) setSessionCookie(w http.ResponseWriter, r *http.Request, value string, expires time.Time) {
	http.SetCookie(w, &http.Cookie{
		Name: CookieName, Value: value, Path: "/",
		Expires: expires, HttpOnly: true, Secure: c.secure(r), SameSite: http.SameSiteStrictMode,
	})
}

func (c *Console) clearCookie(w http.ResponseWriter, r *http.Request, name, path string) {
	http.SetCookie(w, &http.Cookie{
		Name: name, Value: "", Path: path, MaxAge: -1,
		HttpOnly: true, Secure: c.secure(r), SameSite: http.SameSiteStrictMode,
	})
}

// loginToken returns the sign-in form's CSRF token, from its cookie or
// freshly set: there is no session yet to hold it (a double-submitted
// cookie, SameSite=Strict, so that no other site can sign someone in).
func (c *Console) loginToken(w http.ResponseWriter, r *http.Request) (string, error) {
	if ck, err := r.Cookie(loginCookieName); err == nil {
		if b, err := base64.RawURLEncoding.DecodeString(ck.Value); err == nil && len(b) == idBytes {
			return ck.Value, nil
		}
	}
	tok, err := randomToken()
	if err != nil {
		return "", err
	}
	http.SetCookie(w, &http.Cookie{
		Name: loginCookieName, Value: tok, Path: "/login", MaxAge: 3600,
		HttpOnly: true, Secure: c.secure(r), SameSite: http.SameSiteStrictMode,
	})
	return tok, nil
}

// loginMessages are the sign-in page's notices, by the code in ?m=: the
// page never echoes text from the address.
var loginMessages = map[string]flash{
	"signed_out": {OK: true, Text: "You are signed out."},
	"ended":      {Text: "Your session ended (the assertion expired, or you signed out elsewhere). Sign in again."},
	"refused":    {Text: "The assertion was refused: it is malformed, expired, or not from a trusted issuer for operators and approvers."},
	"try_later":  {Text: "The assertion could not be checked just now: the identity provider's keys known here are not current. Sign in again in a minute."},
	"role":       {Text: "This assertion carries neither the operator nor the approver role; the console is for operators and approvers only."},
	"no_expiry":  {Text: "This assertion carries no expiry; the console signs in only with assertions that end."},
	"empty":      {Text: "Paste an assertion to sign in."},
	"dev_failed": {Text: "The dev issuer could not mint an assertion; see the ledger's log."},
	"busy":       {Text: "The console could not start a session; try again."},
}

type loginPage struct {
	Message *flash
	CSRF    string
	Dev     bool
}

func (c *Console) serveLogin(w http.ResponseWriter, r *http.Request) {
	if _, ok := c.session(r); ok {
		http.Redirect(w, r, "/approvals", http.StatusSeeOther)
		return
	}
	tok, err := c.loginToken(w, r)
	if err != nil {
		c.cfg.Logger.Error("console login token", "err", err)
		http.Error(w, "the console could not start a sign-in", http.StatusInternalServerError)
		return
	}
	p := loginPage{CSRF: tok, Dev: c.cfg.DevLogin != nil && httpjson.Loopback(r)}
	if m, ok := loginMessages[r.URL.Query().Get("m")]; ok {
		p.Message = &m
	}
	if ck, err := r.Cookie(CookieName); err == nil && c.sessions.hasEnded(c.cfg.Now(), ck.Value) {
		// What the session's last action came to, which its end kept
		// from the page it went back to, is for its user only: shown
		// once they have signed in again, not to whoever opens this
		// page on the browser.
		p.Message = &flash{Text: "Your session ended before the report of its last action was shown. Sign in again as the same user to read it."}
	}
	c.render(w, r, nil, "login", "Sign in", p)
}

// checkLoginPost checks a sign-in form's origin and CSRF token against
// the login cookie.
func (c *Console) checkLoginPost(w http.ResponseWriter, r *http.Request) bool {
	ck, err := r.Cookie(loginCookieName)
	want := ""
	if err == nil {
		want = ck.Value
	}
	if !c.checkPost(w, r, want) {
		c.forbidden(w, r, nil, "This sign-in form was not sent from this console's page. Reload the sign-in page and try again.")
		return false
	}
	return true
}

func (c *Console) postLogin(w http.ResponseWriter, r *http.Request) {
	if !c.checkLoginPost(w, r) {
		return
	}
	assertion := strings.TrimSpace(r.PostForm.Get("assertion"))
	if assertion == "" {
		http.Redirect(w, r, "/login?m=empty", http.StatusSeeOther)
		return
	}
	c.signIn(w, r, assertion)
}

func (c *Console) postDevLogin(w http.ResponseWriter, r *http.Request) {
	if c.cfg.DevLogin == nil || !httpjson.Loopback(r) {
		c.serveNotFound(w, r)
		return
	}
	if !c.checkLoginPost(w, r) {
		return
	}
	assertion, err := c.cfg.DevLogin(r.Context())
	if err != nil {
		c.cfg.Logger.Error("console dev login", "err", err)
		http.Redirect(w, r, "/login?m=dev_failed", http.StatusSeeOther)
		return
	}
	c.signIn(w, r, assertion)
}

// signIn verifies the assertion, checks the role and starts a session.
func (c *Console) signIn(w http.ResponseWriter, r *http.Request, assertion string) {
	id, err := c.cfg.Authenticate(r.Context(), assertion)
	if err != nil {
		// The verifier's error may quote claims; it is logged, not shown.
		c.cfg.Logger.Info("console sign-in refused", "err", err)
		m := "refused"
		if errors.Is(err, ErrTryLater) {
			m = "try_later"
		}
		http.Redirect(w, r, "/login?m="+m, http.StatusSeeOther)
		return
	}
	if !slices.Contains(id.Roles, RoleOperator) && !slices.Contains(id.Roles, RoleApprover) {
		c.cfg.Logger.Info("console sign-in refused: role", "user", id.User, "tenant", id.Tenant)
		http.Redirect(w, r, "/login?m=role", http.StatusSeeOther)
		return
	}
	now := c.cfg.Now()
	switch {
	case id.Expires.IsZero():
		http.Redirect(w, r, "/login?m=no_expiry", http.StatusSeeOther)
		return
	case !now.Before(id.Expires):
		http.Redirect(w, r, "/login?m=refused", http.StatusSeeOther)
		return
	}
	// A sign-in ends whatever session the browser held before; the
	// report an ended one left is shown if it was this user's.
	if old, ok := c.session(r); ok {
		c.sessions.delete(old)
	}
	var ended *flash
	if ck, err := r.Cookie(CookieName); err == nil {
		ended = c.sessions.popEnded(now, ck.Value, id)
	}
	raw, s, err := c.sessions.create(now, id, assertion)
	if err != nil {
		c.cfg.Logger.Error("console session", "err", err)
		http.Redirect(w, r, "/login?m=busy", http.StatusSeeOther)
		return
	}
	c.cfg.Logger.Info("console sign-in", "user", id.User, "tenant", id.Tenant, "roles", strings.Join(id.Roles, ","), "expires", id.Expires)
	// The cookie outlives the session by endedFlashFor: the server ends
	// the session at the assertion's expiry, and a browser still naming
	// it then is told that it ended (and its user, signed in again, its
	// last report: popEnded), rather than sent to a blank sign-in.
	c.setSessionCookie(w, r, raw, id.Expires.Add(endedFlashFor))
	c.clearCookie(w, r, loginCookieName, "/login")
	signedIn := flash{OK: true, Text: "Signed in as " + id.User + " (tenant " + id.Tenant + ") until " + fmtTime(id.Expires) + "."}
	if ended != nil {
		signedIn = flash{OK: ended.OK, Text: signedIn.Text + " Your last session ended before this was shown: " + ended.Text}
	}
	c.sessions.setFlash(s, signedIn)
	http.Redirect(w, r, "/approvals", http.StatusSeeOther)
}

func (c *Console) postLogout(w http.ResponseWriter, r *http.Request, s *session) {
	c.sessions.delete(s)
	c.clearCookie(w, r, CookieName, "/")
	c.cfg.Logger.Info("console sign-out", "user", s.id.User, "tenant", s.id.Tenant)
	http.Redirect(w, r, "/login?m=signed_out", http.StatusSeeOther)
}

// secure reports whether the console's cookies must be marked Secure: the
// request came over TLS, or the console is told it is served over TLS (a
// proxy in front terminates it).
func (c *Console) secure(r *http.Request) bool { return r.TLS != nil || c.cfg.SecureCookies }
