// Package httpapi is the ledger's HTTP API: agents submit envelopes and ask
// where their calls are. It reads from the call index and the execution
// store's results, and writes only to the request topic, like any agent.
package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/projections/callindex"
)

// Publisher puts a raw envelope on the request topic under key.
// Implementations are safe for concurrent use and return once the broker
// acknowledged the record.
type Publisher interface {
	Publish(ctx context.Context, key, value []byte) error
}

// Calls answers what is known of a call: callindex.ErrNotFound when
// nothing is.
type Calls interface {
	Call(ctx context.Context, key ledger.CallKey) (callindex.Call, error)
}

// Results returns a finished call's sanitized result, or nil if there is
// none (yet).
type Results interface {
	Result(ctx context.Context, key ledger.CallKey) (json.RawMessage, error)
}

// Check is a named readiness check for /healthz.
type Check struct {
	Name  string
	Check func(ctx context.Context) error
}

// Config configures the API.
type Config struct {
	Publisher Publisher // required
	// Calls, optional, answers GET /v1/calls/{key} and, without Caller,
	// ?wait= on POST. Without it neither is served.
	Calls Calls
	// Caller, when set, authenticates GET /v1/calls/{key}: it returns
	// the tenant of the request's verified caller (an agent's identity
	// assertion as a bearer token), whose calls alone it may read; a
	// tenant_id, if given, must be that one (another's call is not
	// found). An error refuses the request (401). ?wait= on POST is then
	// not served: the envelope's tenant is not verified here, so waiting
	// on it would read any tenant's call. Nil: the tenant is tenant_id's,
	// unchecked (ledger dev, on loopback).
	Caller func(r *http.Request) (tenant string, err error)
	// MaxLookupsPerTenant and MaxLookups bound the GET /v1/calls/{key}
	// lookups running at once with a Caller (each a query of the store
	// behind Calls), of one tenant and in all; one more is answered 429
	// too_many_lookups, Retry-After 1. Defaults:
	// DefaultMaxLookupsPerTenant, DefaultMaxLookups.
	MaxLookupsPerTenant, MaxLookups int
	Results                         Results // optional
	Checks                          []Check
	// Limits on envelopes; as the intake's.
	Limits ledger.Limits
	// MaxWait bounds ?wait= on POST /v1/calls; default 30s.
	MaxWait time.Duration
	Logger  *slog.Logger
}

// Defaults of Config's bounds on the agents' lookups.
const (
	DefaultMaxLookupsPerTenant = 8
	DefaultMaxLookups          = 64
)

// Server is the HTTP API.
type Server struct {
	cfg     Config
	mux     *http.ServeMux
	handler http.Handler // mux, its unmatched requests answered in JSON
	lookups *limiter     // with a Caller, the agents' lookups running
}

// New returns the API.
func New(cfg Config) (*Server, error) {
	if cfg.Publisher == nil {
		return nil, errors.New("httpapi: a publisher is required")
	}
	cfg.Limits = cfg.Limits.WithDefaults()
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxLookupsPerTenant <= 0 {
		cfg.MaxLookupsPerTenant = DefaultMaxLookupsPerTenant
	}
	if cfg.MaxLookups <= 0 {
		cfg.MaxLookups = DefaultMaxLookups
	}
	s := &Server{cfg: cfg, mux: http.NewServeMux(), lookups: newLimiter(cfg.MaxLookupsPerTenant, cfg.MaxLookups, "lookups", "too_many_lookups")}
	s.mux.HandleFunc("POST /v1/calls", s.submit)
	if cfg.Calls != nil {
		s.mux.HandleFunc("GET /v1/calls/{key}", s.get)
	}
	s.mux.HandleFunc("GET /healthz", s.health)
	s.handler = httpjson.Unmatched(s.mux)
	return s, nil
}

// ServeHTTP serves the API.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// apiError is the one error shape the API answers with.
type apiError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	Pointer string `json:"pointer,omitempty"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, status int, e apiError) {
	writeJSON(w, status, map[string]apiError{"error": e})
}

// CallView is the answer of GET /v1/calls/{key}.
type CallView struct {
	TenantID       string          `json:"tenant_id"`
	IdempotencyKey string          `json:"idempotency_key"`
	State          string          `json:"state"`
	Settled        bool            `json:"settled"`
	Events         []ledger.Event  `json:"events"`
	Refusals       []ledger.Event  `json:"refusals,omitempty"`
	Result         json.RawMessage `json:"result,omitempty"`
}

// submit accepts an envelope. It checks the envelope as the intake will,
// so that a caller learns of a malformed one at once (400, nothing
// published), then publishes the bytes unchanged. With ?wait=DURATION it
// answers once the call settled, or with 202 when the wait ran out.
func (s *Server) submit(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, int64(s.cfg.Limits.MaxBytes)+1))
	if err != nil || len(body) > s.cfg.Limits.MaxBytes {
		writeError(w, http.StatusRequestEntityTooLarge, apiError{Code: ledger.CodeTooLarge, Message: fmt.Sprintf("envelope larger than %d bytes", s.cfg.Limits.MaxBytes)})
		return
	}
	env, err := ledger.DecodeEnvelope(body, s.cfg.Limits)
	if err != nil {
		var de *ledger.DecodeError
		if errors.As(err, &de) {
			writeError(w, http.StatusBadRequest, apiError{Code: de.Code, Message: de.Error(), Pointer: de.Pointer})
			return
		}
		writeError(w, http.StatusBadRequest, apiError{Code: ledger.CodeInvalidJSON, Message: err.Error()})
		return
	}
	key := env.Key()
	if err := s.cfg.Publisher.Publish(r.Context(), []byte(key.String()), body); err != nil {
		s.cfg.Logger.Warn("publish envelope", "call_key", key.String(), "err", err)
		writeError(w, http.StatusServiceUnavailable, apiError{Code: "publish_failed", Message: "the request topic did not accept the envelope; retry with the same idempotency key"})
		return
	}
	wait, _ := time.ParseDuration(r.URL.Query().Get("wait"))
	if wait > 0 && s.cfg.Calls != nil && s.cfg.Caller == nil {
		if v, ok := s.await(r.Context(), key, env.CallID, min(wait, s.cfg.MaxWait)); ok {
			writeJSON(w, http.StatusOK, v)
			return
		}
	}
	writeJSON(w, http.StatusAccepted, map[string]string{
		"tenant_id":       key.TenantID,
		"idempotency_key": key.IdempotencyKey,
		"status_url":      "/v1/calls/" + url.PathEscape(key.IdempotencyKey) + "?tenant_id=" + url.QueryEscape(key.TenantID),
	})
}

// await polls the index until the call settles or this submission was
// refused.
func (s *Server) await(ctx context.Context, key ledger.CallKey, callID string, d time.Duration) (CallView, bool) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if c, err := s.cfg.Calls.Call(ctx, key); err == nil {
			for _, ref := range c.Refusals {
				if ref.CallID == callID {
					return s.view(ctx, c), true
				}
			}
			if c.Settled() {
				return s.view(ctx, c), true
			}
		}
		select {
		case <-ctx.Done():
			return CallView{}, false
		case <-tick.C:
		}
	}
}

func (s *Server) view(ctx context.Context, c callindex.Call) CallView {
	v := CallView{
		TenantID:       c.Key.TenantID,
		IdempotencyKey: c.Key.IdempotencyKey,
		State:          string(c.State),
		Settled:        c.Settled(),
		Events:         c.Events,
		Refusals:       c.Refusals,
	}
	if v.Events == nil {
		v.Events = []ledger.Event{}
	}
	if s.cfg.Results != nil && c.State.Terminal() {
		res, err := s.cfg.Results.Result(ctx, c.Key)
		if err != nil {
			s.cfg.Logger.Warn("read result", "call_key", c.Key.String(), "err", err)
		}
		v.Result = res
	}
	return v
}

// get answers for the caller's tenant only: Config.Caller's, or without
// it ?tenant_id='s (ledger dev).
func (s *Server) get(w http.ResponseWriter, r *http.Request) {
	tenant := r.URL.Query().Get("tenant_id")
	if s.cfg.Caller != nil {
		caller, err := s.cfg.Caller(r)
		if err != nil {
			w.Header().Set("WWW-Authenticate", `Bearer realm="toolcall-ledger"`)
			writeError(w, http.StatusUnauthorized, apiError{Code: "unauthenticated", Message: "an agent's identity assertion is required as a bearer token: " + err.Error()})
			return
		}
		if tenant != "" && tenant != caller {
			// Not forbidden: the answer must not tell that it exists.
			writeError(w, http.StatusNotFound, apiError{Code: "not_found", Message: "no call under this key for this tenant"})
			return
		}
		tenant = caller
	}
	if tenant == "" {
		writeError(w, http.StatusBadRequest, apiError{Code: "missing_tenant", Message: "tenant_id query parameter is required"})
		return
	}
	if strings.Contains(tenant, "/") {
		// The key is "<tenant>/<key>": a "/" in the tenant would read
		// another tenant's call.
		writeError(w, http.StatusBadRequest, apiError{Code: "invalid_tenant", Message: "tenant_id may not contain '/'"})
		return
	}
	key := ledger.CallKey{TenantID: tenant, IdempotencyKey: r.PathValue("key")}
	if s.cfg.Caller != nil {
		// Agents of many tenants share the store behind Calls.
		end, ok := s.lookups.start(w, tenant)
		if !ok {
			return
		}
		defer end()
	}
	c, err := s.cfg.Calls.Call(r.Context(), key)
	if errors.Is(err, callindex.ErrNotFound) {
		writeError(w, http.StatusNotFound, apiError{Code: "not_found", Message: "no call under this key for this tenant"})
		return
	}
	if err != nil {
		s.cfg.Logger.Error("read call index", "call_key", key.String(), "err", err)
		writeError(w, http.StatusInternalServerError, apiError{Code: "internal", Message: "the call index could not be read"})
		return
	}
	writeJSON(w, http.StatusOK, s.view(r.Context(), c))
}

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	status, code := "ok", http.StatusOK
	checks := make(map[string]string, len(s.cfg.Checks))
	for _, c := range s.cfg.Checks {
		if err := c.Check(ctx); err != nil {
			// The error names addresses and databases: for the log, not
			// for whoever asks an unauthenticated health check.
			s.cfg.Logger.Warn("health check failed", "check", c.Name, "err", err)
			checks[c.Name] = "unavailable"
			status, code = "unavailable", http.StatusServiceUnavailable
			continue
		}
		checks[c.Name] = "ok"
	}
	writeJSON(w, code, map[string]any{"status": status, "checks": checks})
}
