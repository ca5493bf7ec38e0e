// Package httptool is the executor's adapter to tools served over HTTP: it
// POSTs a call's canonical arguments with the call's idempotency key and
// ledger headers, reads a capped answer, and sorts every failure by what it
// says about the side effect (see Kind).
//
// What the adapter guarantees, because the executor's exactly-once rests on
// it:
//
//   - It never sends a call twice. net/http's Transport silently re-sends a
//     request that carries an Idempotency-Key header when a reused
//     keep-alive connection fails after the request was written (it takes
//     the header to mean the request is idempotent). For a tool whose
//     idempotency is "none" that would be a duplicate side effect that
//     nothing above could see, so Call makes its body non-rewindable
//     (Request.GetBody = nil), which turns those replays off. Retrying is
//     the executor's decision, with the error's Kind in hand.
//   - It never follows redirects (a 307 would re-send the call elsewhere).
//   - NotSent is reported only when no connection was ever handed to the
//     request (httptrace GotConn), so the request's bytes never left the
//     process, or when the request's Gate held it back before its body's
//     first byte (its headers may have gone; the request is never whole at
//     the tool). Everything that fails later is Unknown, even when the
//     bytes probably did not arrive: guessing wrong in that direction is a
//     duplicate effect, in the other it is only a reconciliation.
//   - No error carries the credential or the body (invariant I6).
package httptool

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/failpoint"
	"github.com/toolcall-ledger/ledger/processors/tracing"
)

// DefaultMaxResultBytes caps an answer's body when Request.MaxResultBytes is
// 0.
const DefaultMaxResultBytes = 1 << 20

// Headers sent with every call. The tool reads them; the demo backend
// (processors/demobackend) records them.
const (
	HeaderIdempotencyKey = "Idempotency-Key"
	HeaderCallID         = "X-Ledger-Call-Id"
	HeaderTenant         = "X-Ledger-Tenant"
	HeaderAttempt        = "X-Ledger-Attempt"
	HeaderTraceID        = "X-Ledger-Trace-Id"
	// HeaderBackendSecret carries Request.BackendSecret.
	HeaderBackendSecret = "X-Backend-Secret"
	// HeaderNotApplied, "true" on a tool's 5xx or 408 answer, says that
	// the tool applied nothing and may be asked again (Throttled): a tool
	// that could not check the call's credential, its keys or the
	// revocations unavailable, answers so. A 5xx or 408 without it leaves
	// the effect of a tool that does not deduplicate unknown, since a
	// proxy's may come after the tool applied it.
	HeaderNotApplied = "X-Ledger-Not-Applied"
)

// ErrInvalidRequest: the Request itself is unusable (no URL, no idempotency
// key, a control character in a header value). Nothing was sent, and
// retrying the same Request cannot help.
var ErrInvalidRequest = errors.New("invalid tool request")

// Config configures a Client.
type Config struct {
	// Client sends the requests. Default: a client of its own (not
	// http.DefaultClient) with dial and TLS handshake timeouts, no proxy
	// (a proxy would answer 502 for a tool it could not reach, hiding a
	// NotSent behind a ServerError), keep-alive, and no overall timeout:
	// the ctx passed to Call bounds each call. A Client given here is
	// copied, and the copy's CheckRedirect is replaced so that redirects
	// are never followed; its Transport is shared.
	Client *http.Client
	// UserAgent is sent as User-Agent. Default: "toolcall-ledger-httptool".
	UserAgent string
	// Failpoint, if set, is hit when a tool call's answer arrives, before
	// its body is read (failpoint.ToolApplied): the reliability suite
	// crashes the executor there, the tool's effect applied and its
	// answer lost.
	Failpoint failpoint.Hook
	// AllowInsecureHTTP lets a request carrying a credential or a
	// backend secret go over plain http to a host other than loopback.
	// Without it such a request is refused (ErrInvalidRequest): on the
	// network, the per-call credential could be replayed and the backend
	// secret, which does not expire, read.
	AllowInsecureHTTP bool
}

// Client calls HTTP tools. It is safe for concurrent use.
type Client struct {
	hc           *http.Client
	userAgent    string
	failpoint    failpoint.Hook
	insecureHTTP bool
}

// New returns a Client.
func New(cfg Config) *Client {
	var hc http.Client
	if cfg.Client != nil {
		hc = *cfg.Client
	} else {
		hc = http.Client{Transport: newTransport()}
	}
	hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	ua := cfg.UserAgent
	if ua == "" {
		ua = "toolcall-ledger-httptool"
	}
	return &Client{hc: &hc, userAgent: ua, failpoint: cfg.Failpoint, insecureHTTP: cfg.AllowInsecureHTTP}
}

func newTransport() *http.Transport {
	return &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		ForceAttemptHTTP2:   true,
		MaxIdleConns:        256,
		MaxIdleConnsPerHost: 64,
		// Below the usual server keep-alive timeouts, so that a call rarely
		// lands on a connection the server has just closed: with the
		// Transport's replay turned off (see the package comment), such a
		// call would come back Unknown.
		IdleConnTimeout:       30 * time.Second,
		TLSHandshakeTimeout:   5 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
}

// Request is one call to a tool.
type Request struct {
	// URL is the tool's endpoint. Required; http or https.
	URL string
	// IdempotencyKey is sent as Idempotency-Key, the same on every attempt,
	// so that a tool with native idempotency applies the call once.
	// Required.
	IdempotencyKey string
	CallID         string
	TenantID       string
	TraceID        string // sent only when set
	// Traceparent is the W3C trace context of the request's span; when
	// empty, one in the call's trace is derived (tracing.Fallback).
	Traceparent string
	Attempt     int
	// Arguments is the body: the call's canonical JSON arguments. Required
	// by Call (at least "{}"); not used by Lookup.
	Arguments []byte
	// Credential is the per-call bearer token, sent as Authorization when
	// set. It never appears in an error or a log.
	Credential string
	// BackendSecret is a long-lived secret the backend demands, sent as
	// HeaderBackendSecret when set. Like Credential, it never appears in
	// an error or a log.
	BackendSecret string
	// MaxResultBytes caps the answer's body; a longer body is cut there and
	// Response.Truncated is set. 0 means DefaultMaxResultBytes.
	MaxResultBytes int
	// IfMatch, when set, is the version of the call's resource that an
	// approval bound, sent as If-Match (an entity tag: quoted, or as it
	// is if it is one): a tool that honours it refuses, 412, to act on
	// the resource at another version, closing the window between the
	// ledger's last read of the version and the effect. Sent only when
	// it can be a strong entity tag.
	IfMatch string
	// Gate, when set, is asked once the connection to the tool is ready,
	// right before the request's body is written: an error holds the
	// request back, and Call answers NotSent with it. A new connection's
	// dial and TLS handshake can take seconds; a check made before them
	// (the kill switch) may be out of date once they end. The tool sees
	// at most the request's headers, never a whole request. It must not
	// block.
	Gate func() error
}

// Response is a tool's answer.
type Response struct {
	Status int
	// Body is at most MaxResultBytes of the answer.
	Body []byte
	// Truncated: the answer was longer than MaxResultBytes.
	Truncated bool
	// Latency runs from just before the request was sent to the end of
	// reading the body, or to the failure.
	Latency time.Duration
}

// Call POSTs r.Arguments to r.URL. A 2xx answer returns a nil error (with
// Response.Truncated set if the body was cut at MaxResultBytes). Any other
// outcome returns an *Error whose Kind says what it means for the side
// effect; when the tool answered, Response also holds its status and
// (capped) body, so the caller may read the tool's error document. A Request
// that cannot be sent at all returns an error wrapping ErrInvalidRequest.
func (c *Client) Call(ctx context.Context, r Request) (Response, error) {
	if r.URL == "" {
		return Response{}, errNoURL
	}
	// The request is built first so that its URL is parsed once, here,
	// and checked as parsed.
	var (
		s     sent
		body  io.Reader = bytes.NewReader(r.Arguments)
		gated *gatedBody
	)
	if r.Gate != nil {
		gated = &gatedBody{r: body.(*bytes.Reader), gate: r.Gate}
		body = gated
	}
	req, err := http.NewRequestWithContext(s.trace(ctx), http.MethodPost, r.URL, body)
	if err != nil || !absoluteHTTP(req.URL) {
		return Response{}, errNotHTTP
	}
	// Known for a bytes.Reader; a gated body needs telling.
	req.ContentLength = int64(len(r.Arguments))
	if err := r.validate(); err != nil {
		return Response{}, err
	}
	if err := c.secure(req.URL, r); err != nil {
		return Response{}, err
	}
	if len(r.Arguments) == 0 {
		// An empty body would also make the request replayable by net/http
		// (http.NoBody), defeating the guard below.
		return Response{}, fmt.Errorf("no arguments: %w", ErrInvalidRequest)
	}
	// Not rewindable: net/http must never re-send a call on its own (see
	// the package comment).
	req.GetBody = nil
	req.Header = c.headers(r, "application/json")
	out, err := c.do(ctx, req, r, &s)
	if err != nil && gated != nil {
		if held := gated.held(); held != nil {
			return Response{Latency: out.Latency}, r.redact(&Error{Kind: NotSent, Detail: "held back once the connection was ready", Err: held})
		}
	}
	return out, err
}

// gatedBody is a request's body that asks its gate before the first byte
// is read: after the connection is ready and the headers are written
// (net/http flushes them before a body of a kind it does not know), before
// the request can be whole at the tool.
type gatedBody struct {
	r     *bytes.Reader
	gate  func() error
	asked bool
	// refusal is the gate's error; read by Call once the Transport is
	// done with the body.
	refusal atomic.Pointer[error]
}

func (g *gatedBody) Read(p []byte) (int, error) {
	if !g.asked {
		g.asked = true
		if err := g.gate(); err != nil {
			g.refusal.Store(&err)
			return 0, err
		}
	}
	return g.r.Read(p)
}

// Close makes gatedBody the request's Body itself, without a wrapper.
func (g *gatedBody) Close() error { return nil }

// held is the gate's refusal, or nil.
func (g *gatedBody) held() error {
	if p := g.refusal.Load(); p != nil {
		return *p
	}
	return nil
}

// secure refuses to send r's credential or backend secret to u over
// plain http off loopback, unless Config.AllowInsecureHTTP.
func (c *Client) secure(u *url.URL, r Request) error {
	if u.Scheme != "http" || c.insecureHTTP || (r.Credential == "" && r.BackendSecret == "") {
		return nil
	}
	host := u.Hostname()
	if ip := net.ParseIP(host); host == "localhost" || ip != nil && ip.IsLoopback() {
		return nil
	}
	// The host only: the URL may carry a key.
	return fmt.Errorf("%w: a credential goes to %s over plain http; use https, or allow http off loopback (AllowInsecureHTTP)", ErrInvalidRequest, u.Host)
}

// Lookup asks a tool's status endpoint about r's call: GET lookupURL with
// ?idempotency_key=<r.IdempotencyKey> added, and the same headers as Call
// (r.URL and r.Arguments are not used). Its answers and errors read as
// Call's; a 404 (Refused) usually means the tool has no record of the key.
// A lookup is a read, so unlike Call it may be re-sent by net/http.
func (c *Client) Lookup(ctx context.Context, lookupURL string, r Request) (Response, error) {
	if lookupURL == "" {
		return Response{}, errNoURL
	}
	u, err := url.Parse(lookupURL)
	if err != nil || !absoluteHTTP(u) {
		return Response{}, errNotHTTP
	}
	if err := r.validate(); err != nil {
		return Response{}, err
	}
	if err := c.secure(u, r); err != nil {
		return Response{}, err
	}
	q := u.Query()
	q.Set("idempotency_key", r.IdempotencyKey)
	u.RawQuery = q.Encode()
	var s sent
	req, err := http.NewRequestWithContext(s.trace(ctx), http.MethodGet, u.String(), nil)
	if err != nil {
		return Response{}, fmt.Errorf("lookup url: %w", ErrInvalidRequest)
	}
	req.Header = c.headers(r, "")
	return c.do(ctx, req, r, &s)
}

// The header names a call sends, as net/http's Header.Set would write
// them (canonical), so that headers can fill the map directly.
const (
	keyAccept        = "Accept"
	keyUserAgent     = "User-Agent"
	keyTraceparent   = "Traceparent"
	keyAuthorization = "Authorization"
	keyContentType   = "Content-Type"
	keyIfMatch       = "If-Match"
)

// headers returns a call's request headers; contentType is left out when
// empty. It is on every call's path: the map is sized for them and their
// values share one array, instead of an allocation a header.
func (c *Client) headers(r Request, contentType string) http.Header {
	tp := r.Traceparent
	if tp == "" {
		tp = tracing.Fallback(r.TraceID, r.IdempotencyKey, r.Attempt)
	}
	h := make(http.Header, 12)
	vals := make([]string, 0, 12)
	set := func(k, v string) {
		vals = append(vals, v)
		n := len(vals)
		h[k] = vals[n-1 : n : n]
	}
	set(keyAccept, "application/json")
	set(keyUserAgent, c.userAgent)
	set(HeaderIdempotencyKey, r.IdempotencyKey)
	set(HeaderCallID, r.CallID)
	set(HeaderTenant, r.TenantID)
	set(HeaderAttempt, strconv.Itoa(r.Attempt))
	if r.TraceID != "" {
		set(HeaderTraceID, r.TraceID)
	}
	set(keyTraceparent, tp)
	if r.Credential != "" {
		set(keyAuthorization, "Bearer "+r.Credential)
	}
	if r.BackendSecret != "" {
		set(HeaderBackendSecret, r.BackendSecret)
	}
	if contentType != "" {
		set(keyContentType, contentType)
	}
	if tag := EntityTag(r.IfMatch); tag != "" {
		set(keyIfMatch, tag)
	}
	return h
}

// EntityTag is version as a strong entity tag: as it is when it is one
// already (a tool whose version endpoint answers its ETag, "\"a1b2\""),
// else quoted; "" when it cannot be one (a weak tag, W/"...", never
// matches If-Match; a quote inside).
func EntityTag(version string) string {
	if inner, ok := strings.CutPrefix(version, `"`); ok {
		if inner, ok = strings.CutSuffix(inner, `"`); ok && entityTagChars(inner) {
			return version
		}
		return ""
	}
	if version == "" || !entityTagChars(version) {
		return ""
	}
	return `"` + version + `"`
}

// entityTagChars reports whether v can be an entity tag's opaque part
// (RFC 9110: visible characters but the double quote).
func entityTagChars(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c <= 0x20 || c == '"' || c == 0x7f {
			return false
		}
	}
	return true
}

// sent records, from the Transport's goroutines (hence the atomics), how
// far a request got. gotConn is set before a single byte of the request
// is written, and the Transport does not re-send a call (see Call), so a
// false gotConn after a failure proves the tool never saw the request.
type sent struct {
	gotConn, wrote atomic.Bool
}

// trace returns ctx with s's hooks, for the request to be built with (so
// that it need not be copied to add them).
func (s *sent) trace(ctx context.Context) context.Context {
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GotConn: func(httptrace.GotConnInfo) { s.gotConn.Store(true) },
		WroteRequest: func(info httptrace.WroteRequestInfo) {
			if info.Err == nil {
				s.wrote.Store(true)
			}
		},
	})
}

// withoutURL drops the URL net/http puts in a transport error: a tool's
// URL may carry a key in its query or user part, and these errors are
// logged. The error's cause (a timeout, a refused connection) stays.
func withoutURL(err error) error {
	if ue, ok := errors.AsType[*url.Error](err); ok {
		return fmt.Errorf("%s: %w", ue.Op, ue.Err)
	}
	return err
}

// do sends req, built with s.trace, and sorts the outcome.
func (c *Client) do(ctx context.Context, req *http.Request, r Request, s *sent) (Response, error) {
	if err := ctx.Err(); err != nil {
		return Response{}, r.redact(&Error{Kind: NotSent, Detail: "context done before sending", Err: context.Cause(ctx)})
	}

	start := time.Now()
	resp, err := c.hc.Do(req)
	if err != nil {
		out := Response{Latency: time.Since(start)}
		e := &Error{Kind: Unknown, Err: withoutURL(err)}
		switch {
		case !s.gotConn.Load():
			e.Kind, e.Detail = NotSent, "no connection to the tool"
		case s.wrote.Load():
			e.Detail = "request sent, no answer"
		default:
			e.Detail = "connection broke while sending the request"
		}
		return out, r.redact(e)
	}
	defer resp.Body.Close()
	c.failpoint.Hit(failpoint.ToolApplied)

	limit := r.MaxResultBytes
	if limit == 0 {
		limit = DefaultMaxResultBytes
	}
	body, readErr := io.ReadAll(io.LimitReader(resp.Body, int64(limit)+1))
	out := Response{Status: resp.StatusCode, Body: body, Latency: time.Since(start)}
	if len(body) > limit {
		out.Body, out.Truncated = body[:limit], true
	}

	e := classify(resp)
	if e == nil {
		if readErr != nil {
			// The tool said it succeeded, but the answer was lost on the
			// way: the effect happened and its result is unknown.
			return out, r.redact(&Error{Kind: Unknown, Status: resp.StatusCode, Detail: "answer body lost", Err: readErr})
		}
		return out, nil
	}
	// A non-2xx status line arrived whole, so it stands even if its body
	// was lost.
	return out, r.redact(e)
}

// classify sorts an answer by status; nil for 2xx.
func classify(resp *http.Response) *Error {
	st := resp.StatusCode
	e := &Error{Status: st}
	switch {
	case st >= 200 && st < 300:
		return nil
	case st == http.StatusTooManyRequests:
		e.Kind, e.Detail = Throttled, "tool asked to slow down"
		e.RetryAfter = retryAfter(resp.Header.Get("Retry-After"), time.Now())
	case (st >= 500 && st < 600 || st == http.StatusRequestTimeout) && strings.EqualFold(resp.Header.Get(HeaderNotApplied), "true"):
		e.Kind, e.Detail = Throttled, "tool applied nothing and asked to be tried again"
		e.RetryAfter = retryAfter(resp.Header.Get("Retry-After"), time.Now())
	case st == http.StatusRequestTimeout:
		// As a 5xx: a proxy answers 408 when the tool has not answered
		// in its time (Envoy's idle timeout does), which may be after
		// the tool got the whole request and applied it.
		e.Kind, e.Detail = ServerError, "request timed out, at the tool or a proxy before it, which may have applied it"
		e.RetryAfter = retryAfter(resp.Header.Get("Retry-After"), time.Now())
	case st >= 400 && st < 500:
		e.Kind, e.Detail = Refused, "tool refused the call"
	case st >= 500 && st < 600:
		e.Kind, e.Detail = ServerError, "tool failed"
		e.RetryAfter = retryAfter(resp.Header.Get("Retry-After"), time.Now())
	case st >= 300 && st < 400:
		// A redirect after a POST may well mean "done, see there" (303).
		e.Kind, e.Detail = Unknown, "tool answered with a redirect, not followed"
	default:
		e.Kind, e.Detail = Unknown, "tool answered with an unexpected status"
	}
	return e
}

// retryAfter parses a Retry-After header (seconds or an HTTP date); 0 when
// absent or unparsable.
func retryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.Atoi(v); err == nil || errors.Is(err, strconv.ErrRange) {
		switch {
		case s < 0:
			return 0
		case err != nil || s > int(math.MaxInt64/time.Second):
			// Longer than a Duration holds: the tool asks for as long
			// as can be said, not (wrapped) for no wait at all.
			return math.MaxInt64
		}
		return time.Duration(s) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now)
	}
	return 0
}

// Errors of a request whose URL cannot be called. The URL is not quoted:
// it may carry userinfo.
var (
	errNoURL   = fmt.Errorf("no url: %w", ErrInvalidRequest)
	errNotHTTP = fmt.Errorf("url is not an absolute http(s) url: %w", ErrInvalidRequest)
)

// absoluteHTTP reports whether u is an absolute http or https URL.
func absoluteHTTP(u *url.URL) bool {
	return (u.Scheme == "http" || u.Scheme == "https") && u.Host != ""
}

// validate checks, but for the URL (checked as parsed by Call and Lookup),
// what would otherwise fail inside net/http after the request was built,
// or worse, be rejected there as if it were a transport error (NotSent,
// retryable forever).
func (r Request) validate() error {
	if r.IdempotencyKey == "" {
		return fmt.Errorf("no idempotency key: %w", ErrInvalidRequest)
	}
	if r.MaxResultBytes < 0 {
		return fmt.Errorf("negative max result bytes: %w", ErrInvalidRequest)
	}
	for _, f := range []struct{ name, v string }{
		{"idempotency key", r.IdempotencyKey},
		{"call id", r.CallID},
		{"tenant id", r.TenantID},
		{"trace id", r.TraceID},
		{"credential", r.Credential},
		{"backend secret", r.BackendSecret},
	} {
		if !validHeaderValue(f.v) {
			// The value is left out: it may be the credential.
			return fmt.Errorf("%s is not a valid header value: %w", f.name, ErrInvalidRequest)
		}
	}
	return nil
}

// validHeaderValue reports whether v can be sent as a header value as is
// (RFC 9110 field-value: no control characters, as net/http checks, and no
// leading or trailing whitespace, which the tool would trim away).
func validHeaderValue(v string) bool {
	if v != strings.TrimSpace(v) {
		return false
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// redact guarantees that e does not carry the credential: the transport's
// errors do not include headers, but an error from a custom RoundTripper
// might. It is a guard, not a parser.
func (r Request) redact(e *Error) *Error {
	if e.Err == nil {
		return e
	}
	msg := e.Err.Error()
	for _, secret := range []string{r.Credential, r.BackendSecret} {
		if secret != "" {
			msg = strings.ReplaceAll(msg, secret, "[redacted]")
		}
	}
	if msg != e.Err.Error() {
		e.Err = &redactedError{msg: msg, orig: e.Err}
	}
	return e
}

// redactedError hides its original's message. It does not unwrap to the
// original (whose message holds the secret) but answers errors.Is for it, so
// that errors.Is(err, context.DeadlineExceeded) still works.
type redactedError struct {
	msg  string
	orig error
}

func (e *redactedError) Error() string { return e.msg }

func (e *redactedError) Is(target error) bool { return errors.Is(e.orig, target) }

// ResourceVersion reads a resource's version: a GET of versionURL with
// ?resource=<resource>, for tenant, answering {"version": "..."}.
func (c *Client) ResourceVersion(ctx context.Context, versionURL, resource, tenant string) (string, error) {
	u, err := url.Parse(versionURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") {
		return "", fmt.Errorf("resource version url: %w", ErrInvalidRequest)
	}
	q := u.Query()
	q.Set("resource", resource)
	u.RawQuery = q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return "", fmt.Errorf("resource version: %w", ErrInvalidRequest)
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set(HeaderTenant, tenant)
	resp, err := c.hc.Do(req)
	if err != nil {
		return "", &Error{Kind: Unknown, Detail: "resource version", Err: withoutURL(err)}
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		// Sorted as a call's answer is: a 404 (the resource gone) or a
		// 403 is the tool's refusal, not its failure.
		e := classify(resp)
		if e == nil {
			e = &Error{Kind: Unknown, Status: resp.StatusCode, Detail: "another success than the version's 200"}
		}
		e.Detail = "resource version: " + e.Detail
		return "", e
	}
	var out struct {
		Version string `json:"version"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&out); err != nil || out.Version == "" {
		return "", &Error{Kind: Unknown, Detail: "resource version: no version in the answer"}
	}
	return out.Version, nil
}
