package control

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/identity"
)

// maxBodyBytes bounds a request body: an operator request, or an
// introspection form (a credential is at most credentials.MaxTokenBytes).
const maxBodyBytes = 16 << 10

// staleWait bounds how long an introspection (or an action checked
// against what is in force) waits for a stale State to
// catch up before it answers 503.
const staleWait = time.Second

// IntrospectPath is where Handler serves token introspection.
const IntrospectPath = "/v1/introspect"

// Error codes of the HTTP API, in {"error": {"code", "message"}}.
const (
	CodeUnauthenticated   = "unauthenticated"
	CodeForbidden         = "forbidden"
	CodeInvalidRequest    = "invalid_request"
	CodeNotFrozen         = "not_frozen"
	CodeNotActive         = "not_active"
	CodeUnknownTool       = "unknown_tool"
	CodeActivationChanged = "activation_changed"
	CodeFreezeChanged     = "freeze_changed"
	CodeTooManySubjects   = "too_many_subjects"
	CodeUnavailable       = "unavailable"
	CodeInternal          = "internal"
)

// ToolRequest names a tool's freeze: the tool, the tenant, and why.
type ToolRequest struct {
	Tool string `json:"tool"`
	// Tenant limits the freeze to one tenant; empty: every tenant (a
	// tenant operator's freeze is always for its own tenant).
	Tenant string `json:"tenant,omitempty"`
	Reason string `json:"reason"`
}

// FreezeRequest is the body of POST /v1/control/freeze.
type FreezeRequest struct {
	ToolRequest
	// AllowUnknownTool freezes a tool the control service's registry
	// does not hold (Service.FreezeUnknown); otherwise such a freeze is
	// refused 400 unknown_tool.
	AllowUnknownTool bool `json:"allow_unknown_tool,omitempty"`
}

// UnfreezeRequest is the body of POST /v1/control/unfreeze.
type UnfreezeRequest struct {
	ToolRequest
	// FreezeAt, when set, is the time (at) of the freeze to lift: the
	// unfreeze is refused (409 freeze_changed) if another is in force.
	FreezeAt *time.Time `json:"freeze_at,omitempty"`
}

// RevokeRequest is the body of POST /v1/control/revoke: exactly one of
// JTI and Family.
type RevokeRequest struct {
	JTI    string `json:"jti,omitempty"`
	Family string `json:"family,omitempty"`
	Reason string `json:"reason"`
}

// Introspection is the answer of POST /v1/introspect (RFC 7662 §2.2). An
// inactive credential carries nothing but Active false: the endpoint never
// says why, nor what an inactive token claims.
type Introspection struct {
	Active bool   `json:"active"`
	JTI    string `json:"jti,omitempty"`
	// Exp is the expiry, in seconds since the epoch.
	Exp    int64  `json:"exp,omitempty"`
	Scope  string `json:"scope,omitempty"`
	Aud    string `json:"aud,omitempty"`
	Family string `json:"family,omitempty"`
}

// Handler serves the control API:
//
//	GET  /v1/control              the control state (Service.Snapshot)
//	POST /v1/control/freeze       {"tool", "tenant"?, "reason", "allow_unknown_tool"?}
//	POST /v1/control/unfreeze     {"tool", "tenant"?, "reason"}
//	POST /v1/control/revoke       {"jti" | "family", "reason"}
//	POST /v1/control/activate-policy {"policy", "policy_hash"?, "reason"}
//	POST /v1/control/withdraw-policy {"reason"}
//	POST /v1/introspect           token=<credential> (RFC 7662)
//
// The control routes take the operator's assertion as Authorization:
// Bearer; who acts, and for which tenant, comes from it alone. They answer
// the Action (200), or 202 with it when it was published but not yet
// applied locally, or {"error": {"code", "message"}}: 401 unauthenticated,
// 403 forbidden, 400 invalid_request or unknown_tool, 409 not_frozen,
// freeze_changed, not_active or activation_changed, 503 unavailable.
//
// Introspection is served when Config.Credentials is set. It does not
// authenticate its caller in this version: it only says whether a
// credential is active now (valid signature, issuer and expiry, and
// neither its jti nor its family revoked), and returns nothing of an
// active one but jti, exp, scope, aud and family, which whoever holds the
// token can read from it anyway. It answers 503 while it cannot tell (keys
// unavailable, control state not caught up, or a key the caller says it
// verified the token under, credentials.FormVerified, not known here). No answer or log line ever
// holds an assertion or a token.
func (s *Service) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/control", s.authed(s.serveSnapshot))
	mux.HandleFunc("POST /v1/control/freeze", s.authed(s.serveFreeze))
	mux.HandleFunc("POST /v1/control/unfreeze", s.authed(s.serveUnfreeze))
	mux.HandleFunc("POST /v1/control/revoke", s.authed(s.serveRevoke))
	mux.HandleFunc("POST /v1/control/activate-policy", s.authed(s.serveActivate))
	mux.HandleFunc("POST /v1/control/withdraw-policy", s.authed(s.serveWithdraw))
	if s.cfg.Credentials != nil {
		mux.HandleFunc("POST "+IntrospectPath, s.serveIntrospect)
	}
	return httpjson.Unmatched(mux)
}

type apiError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v) // a write error means the client left
}

func writeError(w http.ResponseWriter, status int, code, message string) {
	writeJSON(w, status, map[string]apiError{"error": {Code: code, Message: message}})
}

// authed verifies the bearer assertion and hands the identity on.
func (s *Service) authed(next func(http.ResponseWriter, *http.Request, identity.Identity)) http.HandlerFunc {
	return identity.Require(s.cfg.Identity, "ledger-control", "an operator", s.cfg.Logger, next)
}

// fail answers err, to the operator id, with its status and code.
func (s *Service) fail(w http.ResponseWriter, r *http.Request, id identity.Identity, err error) {
	status, code, msg := http.StatusInternalServerError, CodeInternal, "the control action could not be processed"
	switch {
	case errors.Is(err, ErrForbidden):
		// Kept, as a refused sign-in is: the kill switch is what someone
		// with a stolen assertion, or an operator reaching past their
		// tenant, would try first.
		s.cfg.Logger.Warn("control request refused: not the caller's to make", "method", r.Method, "path", r.URL.Path,
			"user", id.User, "tenant_id", id.Tenant, "roles", id.Roles, "err", err)
		status, code, msg = http.StatusForbidden, CodeForbidden, err.Error()
	case errors.Is(err, ErrInvalidRequest):
		status, code, msg = http.StatusBadRequest, CodeInvalidRequest, err.Error()
	case errors.Is(err, ErrNotFrozen):
		status, code, msg = http.StatusConflict, CodeNotFrozen, err.Error()
	case errors.Is(err, ErrUnknownTool):
		status, code, msg = http.StatusBadRequest, CodeUnknownTool, err.Error()
	case errors.Is(err, ErrActivationChanged):
		status, code, msg = http.StatusConflict, CodeActivationChanged, err.Error()
	case errors.Is(err, ErrNotActive):
		status, code, msg = http.StatusConflict, CodeNotActive, err.Error()
	case errors.Is(err, ErrFreezeChanged):
		status, code, msg = http.StatusConflict, CodeFreezeChanged, err.Error()
	case errors.Is(err, ErrTooManySubjects):
		status, code, msg = http.StatusConflict, CodeTooManySubjects, err.Error()
	case errors.Is(err, ErrNotReady):
		status, code, msg = http.StatusServiceUnavailable, CodeUnavailable, "the control state is still loading; try again"
		w.Header().Set("Retry-After", "1")
	case errors.Is(err, ErrStale):
		s.cfg.Logger.Warn("control action refused: control state stale", "method", r.Method, "path", r.URL.Path, "err", err)
		status, code, msg = http.StatusServiceUnavailable, CodeUnavailable, "the freezes known here are not known to be current; try again"
		w.Header().Set("Retry-After", "1")
	default:
		s.cfg.Logger.Error("control request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeError(w, status, code, msg)
}

// answer writes an action, or fails.
func (s *Service) answer(w http.ResponseWriter, r *http.Request, id identity.Identity, a Action, err error) {
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, a)
	case errors.Is(err, ErrNotYetApplied):
		writeJSON(w, http.StatusAccepted, a)
	default:
		s.fail(w, r, id, err)
	}
}

func (s *Service) serveSnapshot(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	snap, err := s.Snapshot(r.Context(), id)
	if err != nil {
		s.fail(w, r, id, err)
		return
	}
	writeJSON(w, http.StatusOK, snap)
}

func (s *Service) serveFreeze(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	var req FreezeRequest
	if err := decodeBody(w, r, &req); err != nil {
		s.fail(w, r, id, err)
		return
	}
	freeze := s.Freeze
	if req.AllowUnknownTool {
		freeze = s.FreezeUnknown
	}
	a, err := freeze(r.Context(), id, req.Tool, req.Tenant, req.Reason)
	s.answer(w, r, id, a, err)
}

func (s *Service) serveUnfreeze(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	var req UnfreezeRequest
	if err := decodeBody(w, r, &req); err != nil {
		s.fail(w, r, id, err)
		return
	}
	var of time.Time
	if req.FreezeAt != nil {
		of = *req.FreezeAt
	}
	a, err := s.Unfreeze(r.Context(), id, req.Tool, req.Tenant, req.Reason, of)
	s.answer(w, r, id, a, err)
}

// ActivateRequest is the body of POST /v1/control/activate-policy.
type ActivateRequest struct {
	Policy string `json:"policy"`
	// PolicyHash, optional, pins the version's content.
	PolicyHash string `json:"policy_hash,omitempty"`
	Reason     string `json:"reason"`
}

func (s *Service) serveActivate(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	var req ActivateRequest
	if err := decodeBody(w, r, &req); err != nil {
		s.fail(w, r, id, err)
		return
	}
	a, err := s.ActivatePolicy(r.Context(), id, req.Policy, req.PolicyHash, req.Reason)
	s.answer(w, r, id, a, err)
}

// WithdrawRequest is the body of POST /v1/control/withdraw-policy.
type WithdrawRequest struct {
	Reason string `json:"reason"`
}

func (s *Service) serveWithdraw(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	var req WithdrawRequest
	if err := decodeBody(w, r, &req); err != nil {
		s.fail(w, r, id, err)
		return
	}
	a, err := s.WithdrawPolicy(r.Context(), id, req.Reason)
	s.answer(w, r, id, a, err)
}

func (s *Service) serveRevoke(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	var req RevokeRequest
	if err := decodeBody(w, r, &req); err != nil {
		s.fail(w, r, id, err)
		return
	}
	a, err := s.Revoke(r.Context(), id, req.JTI, req.Family, req.Reason)
	s.answer(w, r, id, a, err)
}

// serveIntrospect answers RFC 7662 introspection. The token is read from
// the form body only, never from the query string, which ends up in
// access logs.
func (s *Service) serveIntrospect(w http.ResponseWriter, r *http.Request) {
	ct, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || ct != "application/x-www-form-urlencoded" {
		writeError(w, http.StatusUnsupportedMediaType, CodeInvalidRequest, "the body must be application/x-www-form-urlencoded")
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxBodyBytes)
	if err := r.ParseForm(); err != nil {
		writeError(w, http.StatusBadRequest, CodeInvalidRequest, "the body is not a form of at most 16 KiB")
		return
	}
	tok := r.PostForm.Get("token")
	if tok == "" {
		writeError(w, http.StatusBadRequest, CodeInvalidRequest, "the token parameter is required")
		return
	}
	if !s.cfg.State.isReady() {
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, CodeUnavailable, "the control state is still loading; try again")
		return
	}
	// A revocation this copy has not heard of would leave a revoked
	// credential active: answer nothing on a copy not known current.
	if err := s.current(r.Context()); err != nil {
		s.cfg.Logger.Warn("introspection refused: control state stale", "err", err)
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, CodeUnavailable, "the revocations known here are not known to be current; try again")
		return
	}
	c, err := s.cfg.Credentials.Inspect(r.Context(), tok)
	if err != nil {
		reason := credentials.ReasonOf(err)
		if reason == credentials.ReasonKeysUnavailable {
			// Not the token's fault, and not a verdict on it either.
			s.cfg.Logger.Warn("introspection without keys", "err", err)
			w.Header().Set("Retry-After", "1")
			writeError(w, http.StatusServiceUnavailable, CodeUnavailable, "the credential keys are unavailable; try again")
			return
		}
		if reason == credentials.ReasonUnknownKid && r.PostForm.Get(credentials.FormVerified) == "true" {
			// The caller says it verified its signature under a key
			// this service does not know: its key sets lag the
			// caller's (an executor missing from --credential-jwks-url,
			// say), which "inactive" would have the tool report as a
			// revocation. The caller's word is not checked (a forger
			// gains a 503): warned of once a minute at most.
			level := slog.LevelDebug
			if now, last := time.Now().UnixNano(), s.unknownKeyWarned.Load(); now-last >= int64(time.Minute) && s.unknownKeyWarned.CompareAndSwap(last, now) {
				level = slog.LevelWarn
			}
			s.cfg.Logger.Log(r.Context(), level, "introspection: a credential its caller says it verified is signed by a key none of the executors' key sets known here holds; is every executor's --jwks-addr in --credential-jwks-url?", "err", err)
			w.Header().Set("Retry-After", "1")
			writeError(w, http.StatusServiceUnavailable, CodeUnavailable, "the credential's key is none known here, though its signature was verified by the caller: the key sets here lag; try again")
			return
		}
		s.cfg.Logger.Debug("introspection: inactive", "reason", string(reason))
		writeJSON(w, http.StatusOK, Introspection{Active: false})
		return
	}
	// Once more after the inspection, which may have waited on a key
	// fetch for seconds: the revocations read below must be those of a
	// copy current now, not before that wait.
	if err := s.current(r.Context()); err != nil {
		s.cfg.Logger.Warn("introspection refused: control state stale after the inspection", "err", err)
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, CodeUnavailable, "the revocations known here are not known to be current; try again")
		return
	}
	// A family's revocation covers the credentials issued up to it (and
	// RevocationSkew after, for the clocks of two machines): the family
	// (tool, tenant, key epoch) goes on being minted afterwards, and
	// those later credentials were never exposed.
	if a, revoked := s.cfg.State.Revoked(c.JTI, c.Family); revoked && s.covers(a, c.IssuedAt) {
		s.cfg.Logger.Debug("introspection: revoked", "jti", c.JTI, "family", c.Family, attrSubject, a.Subject)
		writeJSON(w, http.StatusOK, Introspection{Active: false})
		return
	}
	writeJSON(w, http.StatusOK, Introspection{
		Active: true, JTI: c.JTI, Exp: c.ExpiresAt.Unix(), Scope: c.Scope, Aud: c.Audience, Family: c.Family,
	})
}

// decodeBody reads one JSON object with no unknown fields and nothing
// after it.
func decodeBody(w http.ResponseWriter, r *http.Request, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if _, tooBig := errors.AsType[*http.MaxBytesError](err); tooBig {
			return fmt.Errorf("%w: body larger than %d bytes", ErrInvalidRequest, maxBodyBytes)
		}
		if rerr := httpjson.BodyReadError(err); rerr != nil {
			return fmt.Errorf("%w: %v", ErrInvalidRequest, rerr)
		}
		return fmt.Errorf("%w: body: %v", ErrInvalidRequest, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return fmt.Errorf("%w: body: trailing data after the JSON object", ErrInvalidRequest)
	}
	return nil
}
