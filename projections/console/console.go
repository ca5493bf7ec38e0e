// Package console is the ledger's web console for approvers and incident
// responders: server-rendered HTML over the ledger's own JSON APIs, which
// it calls in process (Config.API) with the signed-in person's assertion
// as Authorization: Bearer. Every decision about who may do what stays in
// those APIs; the console shows their answers, and their refusals' codes
// and messages, and never decides by itself.
//
// Security, in one place:
//
//   - Sessions are server side: a random 32-byte id in the ledger_session
//     cookie (HttpOnly, SameSite=Strict, Path=/, Secure over TLS) names the
//     assertion the person signed in with, and ends at its expiry. Only an
//     operator or an approver may sign in.
//   - Every form carries the session's CSRF token; a POST without it, or
//     whose Origin is not this host, is refused with 403 before anything
//     reaches an API. (A reverse proxy in front must pass the Host header
//     through, and terminate TLS itself only if it can live with cookies
//     that are not marked Secure: the console sees r.TLS only.)
//   - Every response carries a strict Content-Security-Policy (no inline
//     script or style anywhere), nosniff, a same-origin referrer policy
//     (no-referrer would make browsers send "Origin: null" on the
//     console's own forms, which the origin check refuses) and DENY framing;
//     pages are never cached.
//   - Everything the APIs answer (arguments, results, reasons, keys,
//     tenants) is untrusted and reaches the page through html/template's
//     contextual escaping only, the SVG histogram included.
//
// File map: console.go (Config, Console, routing, headers), session.go
// (sessions, cookies, CSRF), api.go (in-process API calls and the JSON
// shapes read), pages.go (the GET pages), actions.go (the POSTs and their
// confirmations), incidents.go (the incident page, histogram, CSV),
// render.go (templates and their helpers), templates/ and assets/.
package console

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"time"
)

// Roles that may sign in.
const (
	// RoleOperator may answer incidents: query, freeze, revoke, resolve,
	// compensate (as the APIs allow).
	RoleOperator = "operator"
	// RoleApprover may decide approvals.
	RoleApprover = "approver"
)

// CookieName is the session cookie's name.
const CookieName = "ledger_session"

// loginCookieName holds the CSRF token of the sign-in form, before there
// is a session to hold it.
const loginCookieName = "ledger_login"

// ContentSecurityPolicy is the policy every response carries: only this
// origin's script and style files, no inline code, no framing.
const ContentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// DefaultMaxSessions is Config.MaxSessions' default.
const DefaultMaxSessions = 10_000

// DefaultMaxSessionsPerUser is Config.MaxSessionsPerUser's default: a
// browser or two per responder, and their tabs' sign-ins.
const DefaultMaxSessionsPerUser = 16

// ErrTryLater, wrapped in Config.Authenticate's error, says the assertion
// could not be judged now (the issuer's keys stale, or its key not
// fetched yet): the sign-in page asks to sign in again shortly rather
// than calling the assertion bad.
var ErrTryLater = errors.New("console: the assertion cannot be judged now")

// Identity is who signed in, as Config.Authenticate verified their
// assertion.
type Identity struct {
	// User is the person (the assertion's subject).
	User string
	// Tenant is their tenant; "*" is a platform operator.
	Tenant string
	// Roles are their roles; RoleOperator or RoleApprover is needed to
	// sign in.
	Roles []string
	// Expires is when the assertion, and so the session, ends. A zero
	// time is refused: a session must end.
	Expires time.Time
}

// Health is the answer of the ledger's GET /v1/health, which the health
// page shows. The ledger serves it in this shape; frozen tools come from
// GET /v1/control instead.
type Health struct {
	// Policy is the active policy version.
	Policy string `json:"policy"`
	// PolicyError, when set, is why every call is denied: the policy
	// version activated on the control topic does not load.
	PolicyError string `json:"policy_error,omitempty"`
	// Breakers is each downstream tool's circuit breaker state: closed,
	// open or half-open.
	Breakers map[string]string `json:"breakers"`
	// ProjectionLagRecords is how many committed records the projection
	// has not applied yet.
	ProjectionLagRecords int64 `json:"projection_lag_records"`
	// ProjectionLagSeconds is how far behind the log the projection is.
	ProjectionLagSeconds float64 `json:"projection_lag_seconds"`
	// ProjectionLagUnknown: the lag could not be read (Kafka unreachable,
	// a grant missing), and the two fields above say nothing.
	ProjectionLagUnknown bool `json:"projection_lag_unknown,omitempty"`
	// BreakersUnknown: the breakers are not this process's (they are the
	// executors', and ledger api is none), and Breakers says nothing.
	BreakersUnknown bool `json:"breakers_unknown,omitempty"`
}

// Config configures the console.
type Config struct {
	// API is the ledger's API mux (approvals, control, compensations,
	// resolutions, queries, calls, health). The console sends it one
	// in-memory request per page or action, with the session's
	// assertion as Authorization: Bearer. Required.
	API http.Handler
	// Authenticate verifies a pasted assertion (the ledger's verifier of
	// operators' and approvers' assertions) and says who it is. ctx is
	// the sign-in request's. Required. Its error wraps ErrTryLater when
	// the assertion could not be judged now, not for being bad.
	Authenticate func(ctx context.Context, assertion string) (Identity, error)
	// DevLogin, when set, mints an operator+approver assertion with the
	// dev issuer: the sign-in page then offers a one-click "Dev login".
	// Only `ledger dev` sets it; nil in any other deployment.
	DevLogin func(ctx context.Context) (assertion string, err error)
	// SecureCookies marks the console's cookies Secure (and sends HSTS)
	// even on plain HTTP requests: for a console behind a proxy that
	// terminates TLS. Requests that arrive over TLS always get them.
	SecureCookies bool
	// MaxSessions bounds the sessions held at once; default
	// DefaultMaxSessions. When full, expired sessions are swept first,
	// then the oldest session is ended to make room.
	MaxSessions int
	// MaxSessionsPerUser bounds the sessions one user (tenant and
	// subject) holds at once; default DefaultMaxSessionsPerUser. A new
	// one ends their oldest, so that no one user can fill MaxSessions and
	// sign everyone else out.
	MaxSessionsPerUser int
	// CompensateAllBound bounds a confirmed compensate-all's requests,
	// carried out whole whatever the browser does meanwhile; those not
	// sent by then are said to be not sent. Default
	// DefaultCompensateAllBound.
	CompensateAllBound time.Duration
	// Now is the clock; default time.Now.
	Now func() time.Time
	// Logger; nil discards. No assertion is ever logged.
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	if c.MaxSessions <= 0 {
		c.MaxSessions = DefaultMaxSessions
	}
	if c.MaxSessionsPerUser <= 0 {
		c.MaxSessionsPerUser = DefaultMaxSessionsPerUser
	}
	if c.CompensateAllBound <= 0 {
		c.CompensateAllBound = DefaultCompensateAllBound
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

func (c *Config) validate() error {
	if c.API == nil || c.Authenticate == nil {
		return errors.New("console: API and Authenticate are required")
	}
	return nil
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed assets
var assetFS embed.FS

// Console serves the web console. It is safe for concurrent use.
type Console struct {
	cfg      Config
	mux      *http.ServeMux
	sessions *sessions
	pages    map[string]*template.Template
	assets   map[string]asset
}

// asset is one embedded file and the version its URL carries, so that it
// can be cached for good and still change with a new build.
type asset struct {
	body        []byte
	contentType string
	version     string
}

// New validates cfg and returns the console.
func New(cfg Config) (*Console, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Console{
		cfg:      cfg,
		sessions: newSessions(cfg.MaxSessions, cfg.MaxSessionsPerUser),
		assets:   make(map[string]asset),
	}
	for name, ct := range map[string]string{"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"} {
		b, err := fs.ReadFile(assetFS, "assets/"+name)
		if err != nil {
			return nil, err
		}
		sum := sha256.Sum256(b)
		c.assets[name] = asset{body: b, contentType: ct, version: hex.EncodeToString(sum[:6])}
	}
	pages, err := c.parseTemplates()
	if err != nil {
		return nil, err
	}
	c.pages = pages
	c.routes()
	return c, nil
}

func (c *Console) routes() {
	m := http.NewServeMux()
	m.HandleFunc("GET /{$}", c.serveRoot)
	m.HandleFunc("GET /login", c.serveLogin)
	m.HandleFunc("POST /login", c.postLogin)
	m.HandleFunc("POST /login/dev", c.postDevLogin)
	m.HandleFunc("POST /logout", c.authed(c.postLogout))
	m.HandleFunc("GET /assets/{name}", c.serveAsset)

	m.HandleFunc("GET /approvals", c.authed(c.serveApprovals))
	m.HandleFunc("GET /approvals/{id}", c.authed(c.serveApproval))
	m.HandleFunc("POST /approvals/{id}/approve", c.authed(c.postApprove))
	m.HandleFunc("POST /approvals/{id}/reject", c.authed(c.postReject))

	m.HandleFunc("GET /calls", c.authed(c.serveCalls))
	m.HandleFunc("GET /calls/{tenant}/{key...}", c.authed(c.serveCall))
	m.HandleFunc("POST /calls/resolve", c.authed(c.postResolve))
	m.HandleFunc("POST /calls/compensate", c.authed(c.postCompensate))

	m.HandleFunc("GET /incidents", c.authed(c.serveIncidents))
	m.HandleFunc("GET /incidents.csv", c.authed(c.serveIncidentsCSV))
	m.HandleFunc("GET /incidents/confirm", c.authed(c.serveConfirm))
	m.HandleFunc("POST /incidents/act", c.authed(c.postIncidentAction))

	m.HandleFunc("GET /health", c.authed(c.serveHealth))
	m.HandleFunc("GET /health/unfreeze", c.authed(c.serveUnfreezeConfirm))
	m.HandleFunc("POST /health/unfreeze", c.authed(c.postUnfreeze))

	m.HandleFunc("/", c.serveNotFound)
	c.mux = m
}

// ServeHTTP serves the console. Every response carries the security
// headers, whatever route answers it.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", ContentSecurityPolicy)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	if c.secure(r) {
		h.Set("Strict-Transport-Security", "max-age=31536000")
	}
	c.mux.ServeHTTP(w, r)
}

func (c *Console) serveRoot(w http.ResponseWriter, r *http.Request) {
	if _, ok := c.session(r); ok {
		http.Redirect(w, r, "/approvals", http.StatusSeeOther)
		return
	}
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}

func (c *Console) serveAsset(w http.ResponseWriter, r *http.Request) {
	a, ok := c.assets[r.PathValue("name")]
	if !ok {
		c.serveNotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", a.contentType)
	if r.URL.Query().Get("v") == a.version {
		// The URL names this exact content.
		w.Header().Set("Cache-Control", "public, max-age=31536000, immutable")
	} else {
		w.Header().Set("Cache-Control", "no-cache")
	}
	_, _ = w.Write(a.body)
}

func (c *Console) serveNotFound(w http.ResponseWriter, r *http.Request) {
	s, _ := c.session(r)
	c.renderStatus(w, r, s, http.StatusNotFound, "message", "Not found", messagePage{
		Heading: "Not found",
		Text:    "There is no page at this address.",
	})
}
