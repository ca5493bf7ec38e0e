package approvals

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/schemas"
)

// maxBodyBytes bounds a decision's request body.
const maxBodyBytes = 16 << 10

// Error codes of the HTTP API, in {"error": {"code", "message"}}.
const (
	CodeUnauthenticated    = "unauthenticated"
	CodeNotApprover        = "not_approver"
	CodeNotFound           = "not_found"
	CodeSelfApproval       = "self_approval"
	CodeNotPending         = "not_pending"
	CodeExpired            = "expired"
	CodeHashMismatch       = "hash_mismatch"
	CodeArgumentIntegrity  = "arguments_integrity"
	CodeResourceChanged    = "resource_changed"
	CodeVersionUnconfirmed = "version_unconfirmed"
	// CodeToolDefinedOtherwise: this service's registry defines the
	// call's tool version otherwise than the intake that admitted it.
	CodeToolDefinedOtherwise = "tool_defined_otherwise"
	// CodeUnknownTool: this service's registry lacks the call's tool
	// version.
	CodeUnknownTool = "unknown_tool"
	// CodeToolFrozen: the approval would read the resource's version at
	// a tool the kill switch froze (ErrToolFrozen).
	CodeToolFrozen = "tool_frozen"
	// CodeControlStateStale: the approval would read the resource's
	// version, and the copy of the control topic is not known current
	// (ErrControlStale): try again.
	CodeControlStateStale = "control_state_stale"
	CodeInvalidRequest    = "invalid_request"
	CodeInternal          = "internal"
)

// ApproveRequest is the body of POST /v1/approvals/{id}/approve.
type ApproveRequest struct {
	// ArgumentsHash is the hash of the arguments the approver saw
	// (Approval.ArgumentsHash).
	ArgumentsHash string `json:"arguments_hash"`
}

// RejectRequest is the body of POST /v1/approvals/{id}/reject.
type RejectRequest struct {
	Reason string `json:"reason"`
}

// ListResponse is the answer of GET /v1/approvals.
type ListResponse struct {
	Approvals []Approval `json:"approvals"`
	// More: the list stopped at the service's bound, and approvals may
	// be left out of it (Service.List).
	More bool `json:"more,omitempty"`
}

// Handler serves the approval API:
//
//	GET  /v1/approvals?state=pending   the tenant's approvals in a state
//	GET  /v1/approvals/{id}            one approval
//	POST /v1/approvals/{id}/approve    {"arguments_hash": "sha256:..."}
//	POST /v1/approvals/{id}/reject     {"reason": "..."}
//
// Every request carries the approver's assertion as Authorization: Bearer;
// the tenant and the approver come from it alone. Errors answer
// {"error": {"code", "message"}}; no answer or log line ever holds the
// assertion.
func (s *Service) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /v1/approvals", s.counted("list", s.serveList))
	mux.Handle("GET /v1/approvals/{id}", s.counted("get", s.serveGet))
	mux.Handle("POST /v1/approvals/{id}/approve", s.counted("approve", s.serveApprove))
	mux.Handle("POST /v1/approvals/{id}/reject", s.counted("reject", s.serveReject))
	return httpjson.Unmatched(mux)
}

// counted is next behind the assertion's check (authed), its answers
// counted under action (Metrics.ApprovalAnswered), refusals of the
// assertion included.
func (s *Service) counted(action string, next func(http.ResponseWriter, *http.Request, identity.Identity)) http.HandlerFunc {
	h := s.authed(next)
	return func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		h(sw, r)
		s.cfg.Metrics.ApprovalAnswered(action, sw.status)
	}
}

// statusWriter remembers the status an answer was written with.
type statusWriter struct {
	http.ResponseWriter
	status int
	wrote  bool
}

func (w *statusWriter) WriteHeader(status int) {
	if !w.wrote {
		w.status, w.wrote = status, true
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	w.wrote = true
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

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
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, status int, code, message string) {
	writeJSON(w, status, map[string]apiError{"error": {Code: code, Message: message}})
}

// authed verifies the bearer assertion and hands the identity on.
func (s *Service) authed(next func(http.ResponseWriter, *http.Request, identity.Identity)) http.HandlerFunc {
	return identity.Require(s.cfg.Identity, "ledger-approvals", "an approver", s.cfg.Logger, next)
}

// fail answers err with its status and code.
func (s *Service) fail(w http.ResponseWriter, r *http.Request, err error) {
	status, code := http.StatusInternalServerError, CodeInternal
	msg := "the approval could not be processed"
	switch {
	case errors.Is(err, ErrNotApprover):
		status, code, msg = http.StatusForbidden, CodeNotApprover, "the assertion does not carry the approver role"
	case errors.Is(err, ErrNotFound):
		status, code, msg = http.StatusNotFound, CodeNotFound, "no approval under this id in your tenant"
	case errors.Is(err, ErrSelfApproval):
		status, code, msg = http.StatusForbidden, CodeSelfApproval, "an approver may not decide their own call"
	case errors.Is(err, ErrNotPending):
		status, code, msg = http.StatusConflict, CodeNotPending, "the approval is no longer pending"
	case errors.Is(err, ErrExpired):
		status, code, msg = http.StatusConflict, CodeExpired, "the approval has expired"
	case errors.Is(err, ErrHashMismatch):
		status, code, msg = http.StatusConflict, CodeHashMismatch, "arguments_hash is not the hash of the call's arguments; read the approval again"
	case errors.Is(err, ErrArgumentIntegrity):
		s.cfg.Logger.Error("approval refused: the call's stored arguments are not the ones it was requested with", "path", r.URL.Path, "err", err)
		status, code, msg = http.StatusConflict, CodeArgumentIntegrity, "the call's stored arguments are not the ones it was requested with: it cannot be approved; reject it, and have the execution store's writes looked into"
	case errors.Is(err, ErrResourceChanged):
		status, code, msg = http.StatusConflict, CodeResourceChanged, err.Error()+": reject it, or let it expire"
	case errors.Is(err, ErrVersionUnconfirmed):
		s.cfg.Logger.Error("approval refused: the resource's version cannot be confirmed", "path", r.URL.Path, "err", err)
		status, code, msg = http.StatusConflict, CodeVersionUnconfirmed, err.Error()
	case errors.Is(err, schemas.ErrOtherDefinition):
		s.cfg.Logger.Error("approval refused: this service's registry defines the call's tool version otherwise than the intake that admitted it", "path", r.URL.Path, "err", err)
		status, code, msg = http.StatusConflict, CodeToolDefinedOtherwise, err.Error()+": approve it from an approvals service with the intake's registry, or reject it"
	case errors.Is(err, schemas.ErrUnknownTool), errors.Is(err, schemas.ErrUnknownVersion):
		s.cfg.Logger.Error("approval refused: this service's registry lacks the call's tool version", "path", r.URL.Path, "err", err)
		status, code, msg = http.StatusConflict, CodeUnknownTool, err.Error()+": approve it from an approvals service with the intake's registry, or reject it"
	case errors.Is(err, processors.ErrMoveUnknown):
		s.cfg.Logger.Error("a decision's write failed, and whether it applied could not be read", "path", r.URL.Path, "err", err)
		status, code, msg = http.StatusServiceUnavailable, httpjson.CodeActionOutcomeUnknown, "the execution store failed as the decision was written, and could not say whether it was: it may have been taken; read the approval before deciding again"
	case errors.Is(err, ErrControlStale):
		s.cfg.Logger.Warn("approval refused for now: the kill switch's state is not known current", "path", r.URL.Path, "err", err)
		httpjson.SetRetryAfter(w, time.Second)
		status, code, msg = http.StatusServiceUnavailable, CodeControlStateStale, "the kill switch's state is not known current here, and the approval would read the resource's version at the tool; try again"
	case errors.Is(err, ErrToolFrozen):
		status, code, msg = http.StatusConflict, CodeToolFrozen, err.Error()+": approve once it is unfrozen, or reject"
	case errors.Is(err, ErrUnavailable):
		status, code, msg = http.StatusServiceUnavailable, "unavailable", "the resource's version cannot be read now; try again"
	case errors.Is(err, ErrInvalidRequest), errors.Is(err, ErrUnsupported):
		status, code, msg = http.StatusBadRequest, CodeInvalidRequest, err.Error()
	default:
		s.cfg.Logger.Error("approval request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeError(w, status, code, msg)
}

func (s *Service) serveList(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	as, more, err := s.List(r.Context(), id, r.URL.Query().Get("state"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, ListResponse{Approvals: as, More: more})
}

func (s *Service) serveGet(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	a, err := s.Get(r.Context(), id, r.PathValue("id"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, a)
}

func (s *Service) serveApprove(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	var req ApproveRequest
	if err := decodeBody(w, r, &req); err != nil {
		s.fail(w, r, err)
		return
	}
	if req.ArgumentsHash == "" {
		s.fail(w, r, fmt.Errorf("%w: arguments_hash is required", ErrInvalidRequest))
		return
	}
	a, err := s.Approve(r.Context(), id, r.PathValue("id"), req.ArgumentsHash)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, a)
}

func (s *Service) serveReject(w http.ResponseWriter, r *http.Request, id identity.Identity) {
	var req RejectRequest
	if err := decodeBody(w, r, &req); err != nil {
		s.fail(w, r, err)
		return
	}
	a, err := s.Reject(r.Context(), id, r.PathValue("id"), req.Reason)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, a)
}

// decodeBody reads one JSON object with no unknown fields and nothing
// after it.
func decodeBody(w http.ResponseWriter, r *http.Request, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
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
