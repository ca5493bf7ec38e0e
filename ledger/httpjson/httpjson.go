// Package httpjson makes the ledger's HTTP APIs answer requests that no
// route takes as they answer every other error: {"error": {"code",
// "message"}} in JSON, so that a client reading a machine-readable error
// from every answer is not handed net/http's plain text for a mistyped
// path or method.
package httpjson

import (
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

// The codes of the errors Unmatched writes. no_route, not not_found: an
// API's not_found says the thing asked about does not exist, which a
// client may act on; no_route says the client asked the wrong endpoint.
const (
	CodeNoRoute          = "no_route"
	CodeMethodNotAllowed = "method_not_allowed"
)

// CodeUpstreamUnavailable is the error code of a proxy whose upstream did
// not answer: a request it forwarded may or may not have been handled.
const CodeUpstreamUnavailable = "upstream_unavailable"

// CodeActionOutcomeUnknown is the error code of an action (a decision, a
// resolution) whose write failed and could not be read back: it may have
// been taken. Read what it acted on before acting again.
const CodeActionOutcomeUnknown = "action_outcome_unknown"

// CodeRequestTimeout is the error code of a request whose body did not
// arrive within the server's read timeout (408): nothing was done, and
// sent again it may pass.
const CodeRequestTimeout = "request_timeout"

// Errors of a request's body that broke off, as BodyReadError names them.
var (
	ErrBodyTimeout = errors.New("the request's body did not arrive within the server's read timeout; nothing was done")
	ErrBodyBroken  = errors.New("the request's connection broke before the body's end; nothing was done")
)

// BodyReadError is ErrBodyTimeout or ErrBodyBroken when err, from reading
// a request's body, is the network's failure rather than the content's,
// and nil otherwise. An answer says these, not err: a network error's
// text names the server's own address and port. A body shorter than its
// Content-Length (io.ErrUnexpectedEOF) is left to the caller: a JSON
// decoder says the same of a document that ends mid-value.
func BodyReadError(err error) error {
	var ne net.Error
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return ErrBodyTimeout
	case errors.As(err, &ne):
		return ErrBodyBroken
	}
	return nil
}

// CodeNotLoopback is the error code of LoopbackOnly's refusals.
const CodeNotLoopback = "not_loopback"

// Loopback reports whether r came from this machine to a loopback name.
// Both the peer and the Host count, so that a page of another site whose
// name was rebound to 127.0.0.1 (DNS rebinding), which the browser sends
// from this machine, is refused too.
func Loopback(r *http.Request) bool {
	peer, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	if ip := net.ParseIP(peer); ip == nil || !ip.IsLoopback() {
		return false
	}
	host := r.Host
	if h, _, err := net.SplitHostPort(r.Host); err == nil {
		host = h
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// LoopbackOnly answers every request Loopback refuses 403 not_loopback:
// for servers that answer whoever reaches them on this machine without
// asking who (ledger dev's), which a page of another site would reach
// through its rebound name.
func LoopbackOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !Loopback(r) {
			Error(w, http.StatusForbidden, CodeNotLoopback, "this server answers requests from this machine to a loopback name (localhost, 127.0.0.1, [::1]) only")
			return
		}
		next.ServeHTTP(w, r)
	})
}

// SetRetryAfter sets w's Retry-After to d in whole seconds, rounded up
// (never sooner than d), and at least 1.
func SetRetryAfter(w http.ResponseWriter, d time.Duration) {
	w.Header().Set("Retry-After", strconv.Itoa(max(int((d+time.Second-1)/time.Second), 1)))
}

// Error writes {"error": {"code", "message"}} with status.
func Error(w http.ResponseWriter, status int, code, message string) {
	h := w.Header()
	h.Del("Content-Length")
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	type apiError struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	_ = json.NewEncoder(w).Encode(map[string]apiError{"error": {Code: code, Message: message}}) // a write error means the client left
}

// Unmatched serves mux, but answers a request that no route of mux matches
// (404, or 405 with the Allow header mux sets) with a JSON error. Answers
// of the routes themselves, errors included, and mux's redirects pass as
// they are.
func Unmatched(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, pattern := mux.Handler(r); pattern != "" {
			mux.ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(&unmatched{ResponseWriter: w, r: r}, r)
	})
}

// NotFound answers every request 404 in JSON: for a prefix of API paths
// (/v1/) in a mux whose other paths go to something else (a console).
func NotFound() http.Handler { return Unmatched(http.NewServeMux()) }

// unmatched turns mux's own 404 and 405 answers into JSON errors and lets
// anything else through.
type unmatched struct {
	http.ResponseWriter
	r        *http.Request
	replaced bool // the answer was written here; mux's body is dropped
}

func (u *unmatched) WriteHeader(status int) {
	code, msg := "", ""
	switch status {
	case http.StatusNotFound:
		code, msg = CodeNoRoute, "no endpoint at this path"
	case http.StatusMethodNotAllowed:
		code, msg = CodeMethodNotAllowed, u.r.Method+" is not served at this path; allowed: "+u.Header().Get("Allow")
	default:
		u.ResponseWriter.WriteHeader(status)
		return
	}
	u.replaced = true
	Error(u.ResponseWriter, status, code, msg)
}

func (u *unmatched) Write(b []byte) (int, error) {
	if u.replaced {
		return len(b), nil
	}
	return u.ResponseWriter.Write(b)
}
