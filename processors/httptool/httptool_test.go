package httptool

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/tracing"
)

// secret is the credential every test sends; no error may ever show it.
const secret = "tok_SECRET_eyJhbGciOiJFZERTQSJ9"

// bodyMarker is in every request and answer body; no error may show it.
const bodyMarker = "BODY_MARKER_4f1c"

func request(url string) Request {
	return Request{
		URL:            url,
		IdempotencyKey: "run_42:step_7:refund_order",
		CallID:         "call_7f3a",
		TenantID:       "t_acme",
		TraceID:        "tr_5c1e",
		Attempt:        2,
		Arguments:      []byte(`{"note":"` + bodyMarker + `","order_id":"ord_1029"}`),
		Credential:     secret,
	}
}

// checkErr fails the test if err is not an *Error of kind want, or if its
// message leaks the credential or a body.
func checkErr(t *testing.T, err error, want Kind) *Error {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("error = %v (%T); want *Error of kind %v", err, err, want)
	}
	if e.Kind != want {
		t.Errorf("Kind = %v (%v); want %v", e.Kind, err, want)
	}
	noLeak(t, err)
	return e
}

func noLeak(t *testing.T, err error) {
	t.Helper()
	for _, s := range []string{err.Error(), fmt.Sprintf("%v", err), fmt.Sprintf("%+v", err)} {
		if strings.Contains(s, secret) {
			t.Errorf("error %q contains the credential", s)
		}
		if strings.Contains(s, bodyMarker) {
			t.Errorf("error %q contains a body", s)
		}
	}
}

func TestCallStatusKinds(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name           string
		status         int
		header         map[string]string
		wantKind       Kind // 0: success
		wantRetryAfter time.Duration
	}{
		{name: "200", status: 200},
		{name: "201", status: 201},
		{name: "204", status: 204},
		{name: "400 refused", status: 400, wantKind: Refused},
		{name: "404 refused", status: 404, wantKind: Refused},
		{name: "409 refused", status: 409, wantKind: Refused},
		{name: "422 refused", status: 422, wantKind: Refused},
		// A proxy's 408 may come after the tool applied the call.
		{name: "408 maybe applied", status: 408, wantKind: ServerError},
		{name: "408 not applied", status: 408, header: map[string]string{HeaderNotApplied: "true"}, wantKind: Throttled},
		{name: "429 throttled", status: 429, wantKind: Throttled},
		{name: "429 with retry-after", status: 429, header: map[string]string{"Retry-After": "3"}, wantKind: Throttled, wantRetryAfter: 3 * time.Second},
		{name: "429 with retry-after past a duration", status: 429, header: map[string]string{"Retry-After": "9300000000"}, wantKind: Throttled, wantRetryAfter: math.MaxInt64},
		{name: "503 with retry-after past an int", status: 503, header: map[string]string{"Retry-After": "99999999999999999999"}, wantKind: ServerError, wantRetryAfter: math.MaxInt64},
		{name: "500 server error", status: 500, wantKind: ServerError},
		{name: "502 server error", status: 502, wantKind: ServerError},
		{name: "503 server error", status: 503, header: map[string]string{"Retry-After": "7"}, wantKind: ServerError, wantRetryAfter: 7 * time.Second},
		// A tool that says it applied nothing (its credential could not
		// be checked) is asked again, as a throttle.
		{name: "503 not applied", status: 503, header: map[string]string{HeaderNotApplied: "true", "Retry-After": "2"}, wantKind: Throttled, wantRetryAfter: 2 * time.Second},
		{name: "503 not applied false", status: 503, header: map[string]string{HeaderNotApplied: "false"}, wantKind: ServerError},
		{name: "302 not followed", status: 302, header: map[string]string{"Location": "/elsewhere"}, wantKind: Unknown},
		{name: "307 not followed", status: 307, header: map[string]string{"Location": "/elsewhere"}, wantKind: Unknown},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var elsewhere atomic.Int64
			mux := http.NewServeMux()
			mux.HandleFunc("/elsewhere", func(w http.ResponseWriter, r *http.Request) { elsewhere.Add(1) })
			answer := `{"error":"x","echo":"` + bodyMarker + `"}`
			mux.HandleFunc("/tool", func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				for k, v := range tc.header {
					w.Header().Set(k, v)
				}
				w.WriteHeader(tc.status)
				if tc.status != http.StatusNoContent {
					io.WriteString(w, answer)
				}
			})
			ts := httptest.NewServer(mux)
			defer ts.Close()

			c := New(Config{})
			resp, err := c.Call(t.Context(), request(ts.URL+"/tool"))
			if resp.Status != tc.status {
				t.Errorf("Response.Status = %d; want %d", resp.Status, tc.status)
			}
			if elsewhere.Load() != 0 {
				t.Errorf("the redirect was followed")
			}
			if tc.wantKind == 0 {
				if err != nil {
					t.Fatalf("Call: %v; want no error", err)
				}
				return
			}
			e := checkErr(t, err, tc.wantKind)
			if e.Status != tc.status {
				t.Errorf("Error.Status = %d; want %d", e.Status, tc.status)
			}
			if e.RetryAfter != tc.wantRetryAfter {
				t.Errorf("Error.RetryAfter = %v; want %v", e.RetryAfter, tc.wantRetryAfter)
			}
			// The tool's error document is handed back beside the error.
			if string(resp.Body) != answer {
				t.Errorf("Response.Body = %q; want %q", resp.Body, answer)
			}
		})
	}
}

// closedPort returns the address of a port nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func TestNotSentClosedPort(t *testing.T) {
	t.Parallel()
	_, err := New(Config{}).Call(t.Context(), request("http://"+closedPort(t)+"/tools/refund_order"))
	e := checkErr(t, err, NotSent)
	if !e.Retryable() {
		t.Errorf("Retryable() = false for %v; want true", err)
	}
	if e.Status != 0 {
		t.Errorf("Status = %d; want 0", e.Status)
	}
}

// A tool URL may carry a key in its query or user part; a transport
// error (here a closed port), which the executor logs, does not repeat
// it. Nor does the resource version read's.
func TestTransportErrorsLeaveTheURLOut(t *testing.T) {
	t.Parallel()
	u := "http://user:" + "pw_SECRET@" + closedPort(t) + "/tools/refund_order?key=key_SECRET"
	_, err := New(Config{}).Call(t.Context(), request(u))
	checkErr(t, err, NotSent)
	_, verr := New(Config{}).ResourceVersion(t.Context(), u, "ord_1", "t_a")
	for _, err := range []error{err, verr} {
		if err == nil || strings.Contains(err.Error(), "SECRET") || !strings.Contains(err.Error(), "refused") {
			t.Errorf("error %v; want the cause (connection refused) without the URL's secrets", err)
		}
	}
}

func TestNotSentDNSFailure(t *testing.T) {
	t.Parallel()
	// .invalid never resolves (RFC 6761). Without a resolver the lookup may
	// time out instead of failing; either way no connection was made.
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err := New(Config{AllowInsecureHTTP: true}).Call(ctx, request("http://tool.invalid/tools/refund_order"))
	checkErr(t, err, NotSent)
}

// roundTripCounter counts the requests it passes to next.
type roundTripCounter struct {
	n    *atomic.Int32
	next http.RoundTripper
}

func (c roundTripCounter) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.next.RoundTrip(r)
}

// A credential or a backend secret goes over plain http only to a
// loopback host, unless AllowInsecureHTTP: on the network the credential
// could be replayed, and the backend secret, which does not expire, read.
// The refusal sends nothing and names the host, not the URL.
func TestCredentialsOffLoopbackOnlyOverHTTPS(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	t.Cleanup(srv.Close)
	var sent atomic.Int32
	counted := &http.Client{Transport: roundTripCounter{n: &sent, next: http.DefaultTransport}}
	port := srv.URL[strings.LastIndex(srv.URL, ":")+1:]
	// 127.0.0.2 is loopback too; a name that resolves to loopback is not
	// known to be one before it resolves, so only "localhost" counts.
	for _, tc := range []struct {
		url     string
		allowed bool
	}{
		{"http://127.0.0.1:" + port + "/t", true},
		{"http://localhost:" + port + "/t", true},
		{"http://[::1]:" + port + "/t", true},
		{"http://tools.internal:" + port + "/t?key=k_SECRET", false},
		{"http://10.0.0.1:" + port + "/t", false},
	} {
		secretOnly := request(tc.url)
		secretOnly.Credential, secretOnly.BackendSecret = "", "backend-secret"
		for _, r := range []Request{request(tc.url), secretOnly} {
			before := sent.Load()
			_, err := New(Config{Client: counted}).Call(t.Context(), r)
			if refused := errors.Is(err, ErrInvalidRequest); refused == tc.allowed {
				t.Errorf("Call(%s) = %v; want refused %v", tc.url, err, !tc.allowed)
			}
			if err != nil && strings.Contains(err.Error(), "SECRET") {
				t.Errorf("refusal %v repeats the URL's query", err)
			}
			_, err = New(Config{Client: counted}).Lookup(t.Context(), tc.url, r)
			if refused := errors.Is(err, ErrInvalidRequest); refused == tc.allowed {
				t.Errorf("Lookup(%s) = %v; want refused %v", tc.url, err, !tc.allowed)
			}
			if n := sent.Load() - before; !tc.allowed && n != 0 {
				t.Errorf("%s: %d requests left; want none", tc.url, n)
			}
		}
		if !tc.allowed {
			// Sent (to nowhere: the attempt only has to start).
			ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
			_, err := New(Config{AllowInsecureHTTP: true}).Call(ctx, request(tc.url))
			cancel()
			if errors.Is(err, ErrInvalidRequest) {
				t.Errorf("Call(%s) with AllowInsecureHTTP = %v; want it sent", tc.url, err)
			}
		}
	}
	// Without a credential or a secret nothing is at stake.
	r := request("http://10.0.0.1:" + port + "/t")
	r.Credential = ""
	u, err := url.Parse(r.URL)
	if err != nil {
		t.Fatal(err)
	}
	if err := New(Config{}).secure(u, r); err != nil {
		t.Errorf("a request without credentials over http: %v; want it allowed", err)
	}
}

func TestNotSentContextDone(t *testing.T) {
	t.Parallel()
	var hits atomic.Int64
	ts := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { hits.Add(1) }))
	defer ts.Close()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := New(Config{}).Call(ctx, request(ts.URL))
	checkErr(t, err, NotSent)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("errors.Is(%v, context.Canceled) = false; want true", err)
	}
	if n := hits.Load(); n != 0 {
		t.Errorf("server saw %d requests; want 0", n)
	}
}

func newDemo(t *testing.T) (*demobackend.Server, *httptest.Server) {
	t.Helper()
	s := demobackend.New(demobackend.Config{})
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		s.Close()
		ts.Close()
	})
	return s, ts
}

func TestUnknownHangPastDeadline(t *testing.T) {
	t.Parallel()
	s, ts := newDemo(t)
	s.SetFault(demobackend.ToolSendEmail, demobackend.Fault{Hang: true})
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	r := request(ts.URL + "/tools/send_email")
	resp, err := New(Config{}).Call(ctx, r)
	e := checkErr(t, err, Unknown)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("errors.Is(%v, context.DeadlineExceeded) = false; want true", err)
	}
	if e.Retryable() || !e.MayHaveApplied() || !e.RetryableWithKey() {
		t.Errorf("Retryable, MayHaveApplied, RetryableWithKey = %v, %v, %v; want false, true, true",
			e.Retryable(), e.MayHaveApplied(), e.RetryableWithKey())
	}
	if resp.Latency <= 0 {
		t.Errorf("Latency = %v; want the time spent waiting", resp.Latency)
	}
	if n := s.Requests(); n != 1 {
		t.Errorf("backend saw %d requests; want 1: the request was sent", n)
	}
}

// hijackAfterRead is a tool that reads the whole request and then closes the
// connection without a word: the request arrived and may have been applied.
func hijackAfterRead(hits *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		hits.Add(1)
		conn, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			panic(err)
		}
		conn.Close()
	}
}

func TestUnknownConnectionClosedAfterRead(t *testing.T) {
	t.Parallel()
	var hits atomic.Int64
	ts := httptest.NewServer(hijackAfterRead(&hits))
	defer ts.Close()
	_, err := New(Config{}).Call(t.Context(), request(ts.URL))
	e := checkErr(t, err, Unknown)
	if e.Status != 0 {
		t.Errorf("Status = %d; want 0", e.Status)
	}
	if n := hits.Load(); n != 1 {
		t.Errorf("server saw %d requests; want 1", n)
	}
}

// TestNoTransportReplay is the reason Call clears Request.GetBody: net/http
// re-sends a request with an Idempotency-Key header when a reused
// connection dies after the request was written. For a tool without
// idempotency that is a second effect nobody asked for.
func TestNoTransportReplay(t *testing.T) {
	t.Parallel()
	var (
		mu      sync.Mutex
		perConn = map[string]int{}
		hits    atomic.Int64
	)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		hits.Add(1)
		mu.Lock()
		perConn[r.RemoteAddr]++
		n := perConn[r.RemoteAddr]
		mu.Unlock()
		if n == 1 {
			io.WriteString(w, `{}`)
			return
		}
		// The second request on a kept-alive connection: take it, drop it.
		conn, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			panic(err)
		}
		conn.Close()
	}))
	defer ts.Close()

	c := New(Config{})
	if _, err := c.Call(t.Context(), request(ts.URL)); err != nil {
		t.Fatalf("first Call: %v", err)
	}
	_, err := c.Call(t.Context(), request(ts.URL))
	checkErr(t, err, Unknown)
	if n := hits.Load(); n != 2 {
		t.Errorf("server saw %d requests for 2 calls; want 2 (the transport re-sent one)", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(perConn) != 1 {
		t.Errorf("calls used %d connections; want 1 (the test needs a reused connection)", len(perConn))
	}
}

func TestUnknownAnswerCutShort(t *testing.T) {
	t.Parallel()
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			panic(err)
		}
		defer conn.Close()
		buf.WriteString("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"ok\":")
		buf.Flush()
	}))
	defer ts.Close()
	resp, err := New(Config{}).Call(t.Context(), request(ts.URL))
	e := checkErr(t, err, Unknown)
	if e.Status != 200 || resp.Status != 200 {
		t.Errorf("Error.Status, Response.Status = %d, %d; want 200, 200", e.Status, resp.Status)
	}
}

func TestTruncated(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name          string
		size          int
		max           int
		wantLen       int
		wantTruncated bool
	}{
		{name: "under the cap", size: 10, max: 100, wantLen: 10},
		{name: "exactly the cap", size: 100, max: 100, wantLen: 100},
		{name: "one over the cap", size: 101, max: 100, wantLen: 100, wantTruncated: true},
		{name: "far over the cap", size: 1 << 20, max: 100, wantLen: 100, wantTruncated: true},
		{name: "default cap", size: DefaultMaxResultBytes + 5, max: 0, wantLen: DefaultMaxResultBytes, wantTruncated: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				w.Write([]byte(strings.Repeat("a", tc.size)))
			}))
			defer ts.Close()
			r := request(ts.URL)
			r.MaxResultBytes = tc.max
			resp, err := New(Config{}).Call(t.Context(), r)
			if err != nil {
				t.Fatalf("Call: %v", err)
			}
			if len(resp.Body) != tc.wantLen || resp.Truncated != tc.wantTruncated {
				t.Errorf("len(Body), Truncated = %d, %v; want %d, %v", len(resp.Body), resp.Truncated, tc.wantLen, tc.wantTruncated)
			}
		})
	}
}

func TestHeaders(t *testing.T) {
	t.Parallel()
	type seen struct {
		Method, Path, Body                        string
		ContentType, Accept, UserAgent            string
		Key, CallID, Tenant, Attempt, Trace, Auth string
		Traceparent, IfMatch                      string
		HasTrace, HasAuth                         bool
	}
	all := seen{
		Method: "POST", Path: "/tools/refund_order", Body: `{"note":"` + bodyMarker + `","order_id":"ord_1029"}`,
		ContentType: "application/json", Accept: "application/json", UserAgent: "toolcall-ledger-httptool",
		Key: "run_42:step_7:refund_order", CallID: "call_7f3a", Tenant: "t_acme", Attempt: "2",
		Trace: "tr_5c1e", Auth: "Bearer " + secret, HasTrace: true, HasAuth: true,
		// The envelope's trace, hashed (tr_5c1e is not a W3C id).
		Traceparent: tracing.Fallback("tr_5c1e", "run_42:step_7:refund_order", 2),
	}
	withIfMatch := all
	withIfMatch.IfMatch = `"v7"`
	withETag := all
	withETag.IfMatch = `"a1b2"`
	tests := []struct {
		name string
		cfg  Config
		edit func(*Request)
		want seen
	}{
		{name: "all set", want: all},
		{
			name: "no trace, no credential, custom user agent",
			cfg:  Config{UserAgent: "ledger-test/1"},
			edit: func(r *Request) { r.TraceID, r.Credential = "", "" },
			want: seen{
				Method: "POST", Path: "/tools/refund_order", Body: `{"note":"` + bodyMarker + `","order_id":"ord_1029"}`,
				ContentType: "application/json", Accept: "application/json", UserAgent: "ledger-test/1",
				Key: "run_42:step_7:refund_order", CallID: "call_7f3a", Tenant: "t_acme", Attempt: "2",
				// No trace_id: the call is a trace of its own.
				Traceparent: tracing.Fallback("", "run_42:step_7:refund_order", 2),
			},
		},
		{name: "an approved resource version", edit: func(r *Request) { r.IfMatch = "v7" }, want: withIfMatch},
		// A version endpoint that answers its ETag: sent as it is.
		{name: "a resource version that is an entity tag", edit: func(r *Request) { r.IfMatch = `"a1b2"` }, want: withETag},
		// Not a strong entity tag: sent without, rather than as a broken
		// header the tool might misread, or one that never matches.
		{name: "a resource version with a quote", edit: func(r *Request) { r.IfMatch = `v"7` }, want: all},
		{name: "a weak entity tag", edit: func(r *Request) { r.IfMatch = `W/"a1b2"` }, want: all},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got := make(chan seen, 1)
			ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				_, hasTrace := r.Header[HeaderTraceID]
				_, hasAuth := r.Header["Authorization"]
				got <- seen{
					Method: r.Method, Path: r.URL.Path, Body: string(b),
					ContentType: r.Header.Get("Content-Type"), Accept: r.Header.Get("Accept"), UserAgent: r.UserAgent(),
					Key: r.Header.Get(HeaderIdempotencyKey), CallID: r.Header.Get(HeaderCallID), Tenant: r.Header.Get(HeaderTenant),
					Attempt: r.Header.Get(HeaderAttempt), Trace: r.Header.Get(HeaderTraceID), Auth: r.Header.Get("Authorization"),
					Traceparent: r.Header.Get(tracing.HeaderTraceparent), HasTrace: hasTrace, HasAuth: hasAuth,
					IfMatch: r.Header.Get("If-Match"),
				}
			}))
			defer ts.Close()
			r := request(ts.URL + "/tools/refund_order")
			if tc.edit != nil {
				tc.edit(&r)
			}
			if _, err := New(tc.cfg).Call(t.Context(), r); err != nil {
				t.Fatalf("Call: %v", err)
			}
			if diff := cmp.Diff(tc.want, <-got); diff != "" {
				t.Errorf("request at the tool (-want +got):\n%s", diff)
			}
		})
	}
}

func TestLookup(t *testing.T) {
	t.Parallel()
	s, ts := newDemo(t)
	c := New(Config{})
	r := request(ts.URL + "/tools/refund_order")
	statusURL := ts.URL + "/tools/refund_order/status"

	_, err := c.Lookup(t.Context(), statusURL, r)
	if e := checkErr(t, err, Refused); e.Status != http.StatusNotFound {
		t.Errorf("lookup before the call: status %d; want 404", e.Status)
	}

	call, err := c.Call(t.Context(), r)
	if err != nil {
		t.Fatalf("Call: %v", err)
	}
	resp, err := c.Lookup(t.Context(), statusURL, r)
	if err != nil {
		t.Fatalf("Lookup: %v", err)
	}
	want := `{"state":"applied","result":` + string(call.Body) + `}`
	if string(resp.Body) != want {
		t.Errorf("lookup answer = %s; want %s", resp.Body, want)
	}

	// A query already on the URL is kept.
	if _, err := c.Lookup(t.Context(), statusURL+"?verbose=1", r); err != nil {
		t.Errorf("Lookup with a query: %v", err)
	}

	// Lookups are tenant-scoped like calls.
	other := r
	other.TenantID = "t_other"
	_, err = c.Lookup(t.Context(), statusURL, other)
	if e := checkErr(t, err, Refused); e.Status != http.StatusNotFound {
		t.Errorf("lookup by another tenant: status %d; want 404", e.Status)
	}
	if n := s.Applied(demobackend.ToolRefundOrder, r.IdempotencyKey); n != 1 {
		t.Errorf("Applied = %d; want 1: lookups apply nothing", n)
	}
}

func TestLookupSendsKeyAndHeaders(t *testing.T) {
	t.Parallel()
	got := make(chan *http.Request, 1)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got <- r }))
	defer ts.Close()
	r := request("")
	if _, err := New(Config{}).Lookup(t.Context(), ts.URL+"/status?x=1", r); err != nil {
		t.Fatalf("Lookup: %v", err)
	}
	req := <-got
	if req.Method != http.MethodGet {
		t.Errorf("method = %s; want GET", req.Method)
	}
	if q := req.URL.Query(); q.Get("idempotency_key") != r.IdempotencyKey || q.Get("x") != "1" {
		t.Errorf("query = %q; want idempotency_key=%s and x=1", req.URL.RawQuery, r.IdempotencyKey)
	}
	for h, want := range map[string]string{
		HeaderIdempotencyKey: r.IdempotencyKey, HeaderTenant: r.TenantID, HeaderCallID: r.CallID,
		HeaderAttempt: "2", HeaderTraceID: r.TraceID, "Authorization": "Bearer " + secret,
	} {
		if v := req.Header.Get(h); v != want {
			t.Errorf("header %s = %q; want %q", h, v, want)
		}
	}
}

func TestInvalidRequest(t *testing.T) {
	t.Parallel()
	var hits atomic.Int64
	ts := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { hits.Add(1) }))
	defer ts.Close()
	tests := []struct {
		name string
		edit func(*Request)
	}{
		{name: "no url", edit: func(r *Request) { r.URL = "" }},
		{name: "relative url", edit: func(r *Request) { r.URL = "/tools/x" }},
		{name: "ftp url", edit: func(r *Request) { r.URL = "ftp://" + secret + "@host/x" }},
		{name: "no key", edit: func(r *Request) { r.IdempotencyKey = "" }},
		{name: "newline in credential", edit: func(r *Request) { r.Credential = secret + "\r\nX-Evil: 1" }},
		{name: "newline in key", edit: func(r *Request) { r.IdempotencyKey = "k\nX-Evil: 1" }},
		{name: "padded tenant", edit: func(r *Request) { r.TenantID = " t_acme" }},
		{name: "negative cap", edit: func(r *Request) { r.MaxResultBytes = -1 }},
		{name: "no arguments", edit: func(r *Request) { r.Arguments = nil }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := request(ts.URL)
			tc.edit(&r)
			_, err := New(Config{}).Call(t.Context(), r)
			if !errors.Is(err, ErrInvalidRequest) {
				t.Fatalf("Call error = %v; want ErrInvalidRequest", err)
			}
			noLeak(t, err)
		})
	}
	if n := hits.Load(); n != 0 {
		t.Errorf("server saw %d requests; want 0", n)
	}
}

// leakyTransport fails with an error that quotes the Authorization header, as
// a careless custom RoundTripper might.
type leakyTransport struct{}

func (leakyTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	return nil, fmt.Errorf("proxy rejected %s: %w", req.Header.Get("Authorization"), context.DeadlineExceeded)
}

func TestCredentialRedactedFromTransportErrors(t *testing.T) {
	t.Parallel()
	c := New(Config{Client: &http.Client{Transport: leakyTransport{}}, AllowInsecureHTTP: true})
	_, err := c.Call(t.Context(), request("http://tool.example/x"))
	// The custom transport never called GotConn: nothing provably left.
	checkErr(t, err, NotSent)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("errors.Is(%v, context.DeadlineExceeded) = false; want true after redaction", err)
	}
	if !strings.Contains(err.Error(), "[redacted]") {
		t.Errorf("error %q; want the credential replaced by [redacted]", err)
	}
	for u := errors.Unwrap(err); u != nil; u = errors.Unwrap(u) {
		noLeak(t, u)
	}
}

func TestGivenClientNotModified(t *testing.T) {
	t.Parallel()
	hc := &http.Client{}
	New(Config{Client: hc})
	if hc.CheckRedirect != nil {
		t.Errorf("New changed the caller's CheckRedirect; want it untouched")
	}
}

func TestKindMethods(t *testing.T) {
	t.Parallel()
	tests := []struct {
		kind                                           Kind
		wantRetryable, wantWithKey, wantMayHaveApplied bool
	}{
		{NotSent, true, true, false},
		{Throttled, true, true, false},
		{Refused, false, false, false},
		{ServerError, false, true, true},
		{Unknown, false, true, true},
	}
	for _, tc := range tests {
		t.Run(tc.kind.String(), func(t *testing.T) {
			e := &Error{Kind: tc.kind}
			got := []bool{e.Retryable(), e.RetryableWithKey(), e.MayHaveApplied()}
			want := []bool{tc.wantRetryable, tc.wantWithKey, tc.wantMayHaveApplied}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("Retryable, RetryableWithKey, MayHaveApplied (-want +got):\n%s", diff)
			}
		})
	}
}

// TestAgainstDemoBackend drives the adapter into each outcome on the demo
// tools and checks the effect count at the witness.
func TestAgainstDemoBackend(t *testing.T) {
	t.Parallel()
	t.Run("native retry after a dropped answer applies once", func(t *testing.T) {
		t.Parallel()
		s, ts := newDemo(t)
		s.SetFault(demobackend.ToolCreateTicket, demobackend.Fault{ApplyThenDrop: true, FailTimes: 1})
		c := New(Config{})
		r := request(ts.URL + "/tools/create_ticket")
		_, err := c.Call(t.Context(), r)
		e := checkErr(t, err, Unknown)
		if !e.RetryableWithKey() {
			t.Fatalf("RetryableWithKey() = false for %v; want true", err)
		}
		r.Attempt++
		resp, err := c.Call(t.Context(), r)
		if err != nil {
			t.Fatalf("retry: %v", err)
		}
		if !strings.Contains(string(resp.Body), `"ticket_id":"tkt_1"`) {
			t.Errorf("retry answer %s; want the first attempt's ticket tkt_1", resp.Body)
		}
		if n := s.AppliedIn(demobackend.ToolCreateTicket, r.TenantID, r.IdempotencyKey); n != 1 {
			t.Errorf("AppliedIn = %d; want 1", n)
		}
	})
	t.Run("server error on a tool without idempotency", func(t *testing.T) {
		t.Parallel()
		s, ts := newDemo(t)
		s.SetFault(demobackend.ToolSendEmail, demobackend.Fault{FailStatus: http.StatusServiceUnavailable})
		_, err := New(Config{}).Call(t.Context(), request(ts.URL+"/tools/send_email"))
		e := checkErr(t, err, ServerError)
		if !e.MayHaveApplied() || e.Retryable() {
			t.Errorf("MayHaveApplied, Retryable = %v, %v; want true, false", e.MayHaveApplied(), e.Retryable())
		}
	})
	t.Run("throttled", func(t *testing.T) {
		t.Parallel()
		s, ts := newDemo(t)
		s.SetFault(demobackend.ToolSendEmail, demobackend.Fault{FailStatus: http.StatusTooManyRequests})
		_, err := New(Config{}).Call(t.Context(), request(ts.URL+"/tools/send_email"))
		checkErr(t, err, Throttled)
		if n := len(s.Effects()); n != 0 {
			t.Errorf("len(Effects()) = %d; want 0", n)
		}
	})
	t.Run("refused", func(t *testing.T) {
		t.Parallel()
		_, ts := newDemo(t)
		r := request(ts.URL + "/tools/refund_order")
		r.Arguments = []byte(`{"note":"` + bodyMarker + `"}`) // no order_id
		_, err := New(Config{}).Call(t.Context(), r)
		checkErr(t, err, Refused)
	})
	t.Run("headers reach the witness", func(t *testing.T) {
		t.Parallel()
		s, ts := newDemo(t)
		r := request(ts.URL + "/tools/send_email")
		if _, err := New(Config{}).Call(t.Context(), r); err != nil {
			t.Fatalf("Call: %v", err)
		}
		efs := s.Effects()
		if len(efs) != 1 {
			t.Fatalf("len(Effects()) = %d; want 1", len(efs))
		}
		got := []any{efs[0].IdempotencyKey, efs[0].CallID, efs[0].TenantID, efs[0].Attempt}
		want := []any{r.IdempotencyKey, r.CallID, r.TenantID, r.Attempt}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("effect key, call id, tenant, attempt (-want +got):\n%s", diff)
		}
	})
}

// TestHeaderKeysCanonical: headers fills the map without Header.Set's
// canonicalization, so every name must already be canonical, or it would
// go on the wire in another case than before and be missed by a Get.
func TestHeaderKeysCanonical(t *testing.T) {
	t.Parallel()
	for _, k := range []string{
		keyAccept, keyUserAgent, keyTraceparent, keyAuthorization, keyContentType,
		HeaderIdempotencyKey, HeaderCallID, HeaderTenant, HeaderAttempt, HeaderTraceID, HeaderBackendSecret,
	} {
		if c := http.CanonicalHeaderKey(k); c != k {
			t.Errorf("header %q is not canonical (%q)", k, c)
		}
	}
	if !strings.EqualFold(keyTraceparent, tracing.HeaderTraceparent) {
		t.Errorf("keyTraceparent %q is not tracing's %q", keyTraceparent, tracing.HeaderTraceparent)
	}
}

// A gate that refuses once the connection is ready holds the request
// back: the tool never gets it whole (its handler never runs), and Call
// answers NotSent with the gate's error. One that lets it through sends
// it as usual, asked once.
func TestGateHoldsTheRequestBack(t *testing.T) {
	t.Parallel()
	var handled atomic.Int32
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if b, err := io.ReadAll(r.Body); err == nil && len(b) > 0 {
			handled.Add(1)
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer ts.Close()
	frozen := errors.New("frozen since the check")
	r := request(ts.URL + "/tools/refund_order")
	r.Gate = func() error { return frozen }
	_, err := New(Config{}).Call(t.Context(), r)
	if e := checkErr(t, err, NotSent); !errors.Is(e, frozen) {
		t.Errorf("error %v; want NotSent wrapping the gate's", err)
	}
	var asked atomic.Int32
	r.Gate = func() error { asked.Add(1); return nil }
	if _, err := New(Config{}).Call(t.Context(), r); err != nil {
		t.Fatalf("Call through an open gate: %v", err)
	}
	if n, a := handled.Load(), asked.Load(); n != 1 || a != 1 {
		t.Errorf("the tool handled %d whole requests, the gate was asked %d times; want 1 and 1 (the one let through)", n, a)
	}
}

// A resource version read is answered as a call is: a 404 (the resource
// gone) or a 403 is the tool's refusal, a 5xx its failure, a 429 a
// throttle, a 2xx without the version's 200 an answer that cannot be
// placed. Before, every answer but 200 was a server error, which the
// approver's message then named.
func TestResourceVersionStatuses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		status int
		kind   Kind
	}{
		{http.StatusNotFound, Refused},
		{http.StatusForbidden, Refused},
		{http.StatusServiceUnavailable, ServerError},
		{http.StatusTooManyRequests, Throttled},
		{http.StatusNoContent, Unknown},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(tc.status) }))
		_, err := New(Config{}).ResourceVersion(t.Context(), srv.URL+"/versions", "ord_1", "t_a")
		srv.Close()
		var he *Error
		if !errors.As(err, &he) || he.Kind != tc.kind || he.Status != tc.status || !strings.Contains(err.Error(), "resource version") {
			t.Errorf("answered %d: %v; want a %v error with its status, saying it read the resource version", tc.status, err, tc.kind)
		}
	}
}
