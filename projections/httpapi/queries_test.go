package httpapi_test

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/projections/projectionstest"
)

// queryServer serves the query API over a fresh embedded projection.
type queryServer struct {
	*callindex.Index
	srv *httptest.Server
	id  *processorstest.Identity
}

func newQueryServer(t *testing.T) *queryServer {
	t.Helper()
	ix, err := callindex.Open(filepath.Join(t.TempDir(), "index.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ix.Close() })
	id := processorstest.NewIdentity(t)
	guard := func(next func(http.ResponseWriter, *http.Request, httpapi.Operator)) http.HandlerFunc {
		return identity.Require(id.Verifier, "test", "an operator", nil, func(w http.ResponseWriter, r *http.Request, who identity.Identity) {
			next(w, r, httpapi.Operator{User: who.User, Tenant: who.Tenant, Roles: who.Roles})
		})
	}
	h, err := httpapi.QueryHandler(httpapi.QueryConfig{Queries: ix, Guard: guard})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &queryServer{Index: ix, srv: srv, id: id}
}

// operator mints an operator's assertion of tenant.
func (s *queryServer) operator(t testing.TB, tenant string, roles ...string) string {
	t.Helper()
	if roles == nil {
		roles = []string{"operator"}
	}
	a, err := s.id.Issuer.Mint(identity.Identity{User: "u_responder", Agent: "cli", Tenant: tenant, Roles: roles}, processorstest.Audience, 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// client asks as the operator the question's scope calls for.
func (s *queryServer) client(t testing.TB) *httpapi.QueryClient {
	return &httpapi.QueryClient{Base: s.srv.URL, Bearer: func(tenant string) (string, error) {
		return s.operator(t, tenant), nil
	}}
}

// The query API gives the oracle's answers: the contract suite, asked
// through HTTP and the client, over the embedded projection.
func TestQueryAPIContract(t *testing.T) {
	projectionstest.Run(t, func(t *testing.T) projectionstest.Projection {
		s := newQueryServer(t)
		return struct {
			projections.Sink
			projections.Queries
		}{s.Index, s.client(t)}
	})
}

func TestQueryAPIAuthorization(t *testing.T) {
	s := newQueryServer(t)
	log := projectionstest.Log(projectionstest.LogConfig{Seed: 1, Calls: 100, Tenants: 2})
	projectionstest.Write(t, s.Index, log, 50)

	get := func(path, bearer string) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, s.srv.URL+path, nil)
		if bearer != "" {
			req.Header.Set("Authorization", "Bearer "+bearer)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp, string(b)
	}
	tenantOp := s.operator(t, "t_00")
	for _, c := range []struct {
		name, path, bearer string
		status             int
		code               string
	}{
		{"no assertion", "/v1/blast-radius?all_tenants=true", "", 401, "unauthenticated"},
		{"not an operator", "/v1/blast-radius?tenant=t_00", s.operator(t, "t_00", "approver"), 403, "forbidden"},
		{"tenant operator across tenants", "/v1/blast-radius?all_tenants=true", tenantOp, 403, "forbidden"},
		{"tenant operator, other tenant", "/v1/blast-radius?tenant=t_01", tenantOp, 403, "forbidden"},
		{"tenant operator, other tenant's trace", "/v1/trace/t_01/k-1-0000001", tenantOp, 403, "forbidden"},
		{"platform operator without a tenant", "/v1/blast-radius?jti=x", s.operator(t, "*"), 400, "tenant_required"},
		{"misspelt parameter", "/v1/blast-radius?tenant=t_00&jit=x", tenantOp, 400, "invalid_filter"},
		{"bad time", "/v1/blast-radius?tenant=t_00&since=yesterday", tenantOp, 400, "invalid_filter"},
		{"bad format", "/v1/unresolved?tenant=t_00&format=xml", tenantOp, 400, "invalid_format"},
		{"bad bucket", "/v1/outcomes?tenant=t_00&bucket=soon", tenantOp, 400, "invalid_filter"},
		{"unknown call", "/v1/trace/t_00/no-such-key", tenantOp, 404, "not_found"},
	} {
		t.Run(c.name, func(t *testing.T) {
			resp, body := get(c.path, c.bearer)
			var e struct {
				Error struct{ Code, Message string } `json:"error"`
			}
			if err := json.Unmarshal([]byte(body), &e); err != nil {
				t.Fatalf("%d answer is not JSON: %q", resp.StatusCode, body)
			}
			if resp.StatusCode != c.status || e.Error.Code != c.code || e.Error.Message == "" {
				t.Errorf("GET %s = %d %q (%q), want %d %q", c.path, resp.StatusCode, e.Error.Code, e.Error.Message, c.status, c.code)
			}
		})
	}

	t.Run("tenant operator is scoped to its tenant", func(t *testing.T) {
		resp, body := get("/v1/blast-radius", tenantOp)
		if resp.StatusCode != 200 {
			t.Fatalf("GET = %d %s", resp.StatusCode, body)
		}
		var br projections.BlastRadius
		if err := json.Unmarshal([]byte(body), &br); err != nil {
			t.Fatal(err)
		}
		if br.Total == 0 || br.Filter.Tenant != "t_00" {
			t.Fatalf("answer: %d calls, filter tenant %q; want t_00's calls", br.Total, br.Filter.Tenant)
		}
		for _, c := range br.Calls {
			if c.TenantID != "t_00" {
				t.Errorf("call %s of another tenant in t_00's answer", c.Key())
			}
		}
	})

	t.Run("csv", func(t *testing.T) {
		resp, body := get("/v1/blast-radius?format=csv&tool=refund_order", tenantOp)
		if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/csv") {
			t.Fatalf("GET csv = %d %s %q", resp.StatusCode, resp.Header.Get("Content-Type"), body)
		}
		rows, err := csv.NewReader(strings.NewReader(body)).ReadAll()
		if err != nil {
			t.Fatalf("CSV does not parse: %v", err)
		}
		if len(rows) < 2 || rows[0][1] != "tenant_id" {
			t.Fatalf("CSV: %d rows, header %v", len(rows), rows[0])
		}
		for _, r := range rows[1:] {
			if r[1] != "t_00" || r[3] != "refund_order" {
				t.Errorf("CSV row of another tenant or tool: %v", r)
			}
		}
	})

	// A list cut at the limit says so in headers, which the CSV form
	// has no room for; one that is whole says nothing.
	t.Run("truncation headers", func(t *testing.T) {
		for _, c := range []struct {
			path, header, want string
		}{
			{"/v1/blast-radius?format=csv&limit=1", httpapi.HeaderTruncated, "true"},
			{"/v1/blast-radius?format=csv&limit=100000", httpapi.HeaderTruncated, ""},
			{"/v1/unresolved?format=csv&limit=1", httpapi.HeaderLimitReached, "true"},
			{"/v1/unresolved?format=csv&limit=100000", httpapi.HeaderLimitReached, ""},
		} {
			resp, body := get(c.path, tenantOp)
			if resp.StatusCode != 200 || resp.Header.Get(c.header) != c.want {
				t.Errorf("GET %s = %d, %s %q; want 200, %q (%s)", c.path, resp.StatusCode, c.header, resp.Header.Get(c.header), c.want, body)
			}
		}
		resp, body := get("/v1/blast-radius?limit=1", tenantOp)
		var br projections.BlastRadius
		if err := json.Unmarshal([]byte(body), &br); err != nil || resp.Header.Get(httpapi.HeaderTotalCount) != strconv.Itoa(br.Total) || br.Total < 2 {
			t.Errorf("GET blast-radius?limit=1: %s %q, total %d, %v; want the total in the header", httpapi.HeaderTotalCount, resp.Header.Get(httpapi.HeaderTotalCount), br.Total, err)
		}
	})

	t.Run("client maps errors", func(t *testing.T) {
		c := s.client(t)
		if _, err := c.Trace(t.Context(), projectionstest.Log(projectionstest.LogConfig{Seed: 99, Calls: 1})[0].Key()); !errors.Is(err, projections.ErrNotFound) {
			t.Errorf("Trace of an unknown key: %v, want ErrNotFound", err)
		}
	})
}

// stalledQueries is a projection that answers nothing until its caller
// gives up, as a scan of a whole history would.
type stalledQueries struct {
	projections.Queries
	deadlines chan bool
}

func (s stalledQueries) BlastRadius(ctx context.Context, _ projections.Filter) (projections.BlastRadius, error) {
	_, ok := ctx.Deadline()
	s.deadlines <- ok
	<-ctx.Done()
	return projections.BlastRadius{}, ctx.Err()
}

func (s stalledQueries) Trace(ctx context.Context, _ ledger.CallKey) ([]ledger.Event, error) {
	_, ok := ctx.Deadline()
	s.deadlines <- ok
	<-ctx.Done()
	return nil, ctx.Err()
}

// A question's query runs under the API's timeout, however long the
// client waits, and one that runs out answers 504 query_timeout.
func TestQueryTimeout(t *testing.T) {
	q := stalledQueries{deadlines: make(chan bool, 2)}
	srv, a := operatorServer(t, httpapi.QueryConfig{Queries: q, Timeout: 100 * time.Millisecond}, nil)
	for _, path := range []string{httpapi.PathBlastRadius + "?tool=refund_order", httpapi.PathTrace + "t_a/k1"} {
		status, code, _ := getAs(t, srv.URL+path, a)
		if status != http.StatusGatewayTimeout || code != "query_timeout" {
			t.Errorf("%s = %d %q; want 504 query_timeout", path, status, code)
		}
		if !<-q.deadlines {
			t.Errorf("%s: the query ran without a deadline", path)
		}
	}
}

// tooLargeQueries is a projection whose store stops every question at its
// memory bound.
type tooLargeQueries struct{ projections.Queries }

func (tooLargeQueries) Unresolved(context.Context, projections.Filter) ([]projections.Call, error) {
	return nil, fmt.Errorf("chstore: unresolved: %w (4 MiB): code: 241", projections.ErrQuestionTooLarge)
}

// A question the store stops at its memory bound is answered 422
// question_too_large, which the client gives back as ErrQuestionTooLarge,
// not as the projection being unavailable.
func TestQuestionTooLarge(t *testing.T) {
	srv, a := operatorServer(t, httpapi.QueryConfig{Queries: tooLargeQueries{}}, nil)
	status, code, _ := getAs(t, srv.URL+httpapi.PathUnresolved, a)
	if status != http.StatusUnprocessableEntity || code != "question_too_large" {
		t.Errorf("unresolved = %d %q; want 422 question_too_large", status, code)
	}
	c := &httpapi.QueryClient{Base: srv.URL, Bearer: func(string) (string, error) { return a, nil }}
	if _, err := c.Unresolved(t.Context(), projections.Filter{Tenant: "t_a"}); !errors.Is(err, projections.ErrQuestionTooLarge) {
		t.Errorf("client: %v; want ErrQuestionTooLarge", err)
	}
}

// stalledQuestions serves the query API of cfg over q, with a 2 s
// timeout, and returns the URL of a blast radius question and a function
// minting an operator's assertion of a tenant.
func stalledQuestions(t *testing.T, q stalledQueries, cfg httpapi.QueryConfig) (string, func(tenant string) string) {
	t.Helper()
	cfg.Queries, cfg.Timeout = q, 2*time.Second
	srv, as := operatorsServer(t, cfg, nil)
	return srv.URL + httpapi.PathBlastRadius + "?tool=refund_order", as
}

// Questions are bounded across tenants too: with MaxQuestions running, a
// question of a tenant that has none running is answered 429.
func TestQuestionsBoundedOverall(t *testing.T) {
	q := stalledQueries{deadlines: make(chan bool, 4)}
	u, as := stalledQuestions(t, q, httpapi.QueryConfig{MaxQuestionsPerTenant: 8, MaxQuestions: 2})
	running := make(chan int, 2)
	for _, tenant := range []string{"t_a", "t_b"} {
		go func() {
			status, _, _ := getAs(t, u, as(tenant))
			running <- status
		}()
		<-q.deadlines
	}
	if status, code, _ := getAs(t, u, as("t_c")); status != http.StatusTooManyRequests || code != "too_many_questions" {
		t.Errorf("a third tenant's question while two run, of at most 2 = %d %q; want 429 too_many_questions", status, code)
	}
	<-running
	<-running
}

// A trace takes a question's place as the other questions do: with a
// tenant's MaxQuestionsPerTenant running, its next trace is answered 429
// too_many_questions. Before, traces were unbounded, and one tenant's
// operator tracing in parallel held the connections every tenant's
// agents look their calls up through.
func TestTracesBoundedAsQuestions(t *testing.T) {
	q := stalledQueries{deadlines: make(chan bool, 2)}
	u, as := stalledQuestions(t, q, httpapi.QueryConfig{MaxQuestionsPerTenant: 1})
	trace := strings.Replace(u, httpapi.PathBlastRadius+"?tool=refund_order", httpapi.PathTrace+"t_a/k1", 1)
	first := make(chan int, 1)
	go func() {
		status, _, _ := getAs(t, trace, as("t_a"))
		first <- status
	}()
	<-q.deadlines // t_a's first trace is running
	for _, next := range []string{trace, u} {
		if status, code, _ := getAs(t, next, as("t_a")); status != http.StatusTooManyRequests || code != "too_many_questions" {
			t.Errorf("%s of t_a while its trace runs = %d %q; want 429 too_many_questions", next, status, code)
		}
	}
	<-first
}

// bigAnswers answers every blast radius with 200,000 calls: megabytes of
// JSON, more than a socket buffers.
type bigAnswers struct{ projections.Queries }

func (bigAnswers) BlastRadius(_ context.Context, f projections.Filter) (projections.BlastRadius, error) {
	calls := make([]projections.Call, 200_000)
	for i := range calls {
		calls[i] = projections.Call{TenantID: f.Tenant, IdempotencyKey: fmt.Sprintf("key-%06d", i), Tool: "refund_order"}
	}
	return projections.BlastRadius{Total: len(calls), Calls: calls}, nil
}

// Trace answers every trace with 100,000 events.
func (bigAnswers) Trace(_ context.Context, key ledger.CallKey) ([]ledger.Event, error) {
	evs := make([]ledger.Event, 100_000)
	for i := range evs {
		evs[i] = ledger.Event{TenantID: key.TenantID, IdempotencyKey: key.IdempotencyKey, Seq: int64(i + 1), Type: "requested", Tool: "refund_order"}
	}
	return evs, nil
}

// A question's slot is given back once the store answered, not once the
// answer is written: a client that asks and never reads does not hold it,
// and another question goes through. A trace's too: before, a trace held
// its slot while its answer was written, up to WriteTimeout.
func TestQuestionSlotNotHeldByASlowReader(t *testing.T) {
	for _, path := range []string{httpapi.PathBlastRadius + "?tool=refund_order", httpapi.PathTrace + "t_a/k1"} {
		t.Run(path, func(t *testing.T) {
			srv, as := operatorsServer(t, httpapi.QueryConfig{Queries: bigAnswers{}, MaxQuestions: 1}, nil)
			conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			// Asks, and never reads the answer.
			fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n", path, as("t_a"))
			ledgertest.WaitFor(t, 10*time.Second, func() error {
				status, code, _ := getAs(t, srv.URL+httpapi.PathBlastRadius+"?tool=refund_order&limit=1", as("t_b"))
				if status != http.StatusOK {
					return fmt.Errorf("a second question while the first's answer is unread: %d %q; want 200", status, code)
				}
				return nil
			})
		})
	}
}

// The answers a tenant's clients asked for and do not read are bounded as
// its questions are: past MaxQuestionsPerTenant of them, its next
// question is answered 429 too_many_answers, while another tenant's goes
// through. Before, each question's slot went back once the store
// answered, so a client that asked and never read piled up answers of up
// to 100,000 calls, each held for WriteTimeout, until the API ran out
// of memory.
func TestUnreadAnswersBounded(t *testing.T) {
	srv, as := operatorsServer(t, httpapi.QueryConfig{Queries: bigAnswers{}, MaxQuestionsPerTenant: 2}, nil)
	for i := range 2 {
		conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		// Asks, reads the status line (one at a time, so that each is
		// answered, not refused), and never reads the rest.
		fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n", httpapi.PathBlastRadius+"?tool=refund_order", as("t_a"))
		if err := conn.SetReadDeadline(time.Now().Add(30 * time.Second)); err != nil {
			t.Fatal(err)
		}
		if line, err := bufio.NewReader(conn).ReadString('\n'); err != nil || !strings.Contains(line, " 200 ") {
			t.Fatalf("unread question #%d: status line %q, %v; want 200", i+1, line, err)
		}
	}
	if status, code, _ := getAs(t, srv.URL+httpapi.PathBlastRadius+"?tool=refund_order&limit=1", as("t_a")); status != http.StatusTooManyRequests || code != "too_many_answers" {
		t.Errorf("a third question of the tenant with two answers unread: %d %q; want 429 too_many_answers", status, code)
	}
	if status, code, _ := getAs(t, srv.URL+httpapi.PathBlastRadius+"?tool=refund_order&limit=1", as("t_b")); status != http.StatusOK {
		t.Errorf("another tenant's question meanwhile: %d %q; want 200", status, code)
	}
}

// An answer a client does not read is given up after WriteTimeout: the
// server closes the connection, and lets the answer's memory go. Before,
// nothing bounded it, and an operator could hold answers of 100,000
// calls in the API's memory for as long as their connections lasted.
func TestAnswerNotHeldPastItsWriteTimeout(t *testing.T) {
	for _, path := range []string{httpapi.PathBlastRadius + "?tool=refund_order", httpapi.PathTrace + "t_a/k"} {
		t.Run(path, func(t *testing.T) { testAnswerNotHeldPastItsWriteTimeout(t, path) })
	}
}

func testAnswerNotHeldPastItsWriteTimeout(t *testing.T, path string) {
	srv, as := operatorsServer(t, httpapi.QueryConfig{Queries: bigAnswers{}, WriteTimeout: 300 * time.Millisecond}, nil)
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer %s\r\n\r\n", path, as("t_a"))
	time.Sleep(2 * time.Second) // not reading, past the write timeout
	if err := conn.SetReadDeadline(time.Now().Add(20 * time.Second)); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(conn)
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		t.Fatalf("read %d bytes, then the server still held the connection open 20 s later; want it closed", len(got))
	}
	// A whole chunked answer ends with its last, empty chunk.
	if bytes.HasSuffix(got, []byte("\r\n0\r\n\r\n")) {
		t.Errorf("the whole answer (%d bytes) was written to a client that did not read for 2 s; want it given up after 300 ms", len(got))
	}
}

// operatorServer serves the query API of cfg (its Guard set here),
// through wrap if not nil, and returns it with an assertion of an
// operator of tenant t_a.
func operatorServer(t *testing.T, cfg httpapi.QueryConfig, wrap func(http.Handler) http.Handler) (*httptest.Server, string) {
	t.Helper()
	srv, as := operatorsServer(t, cfg, wrap)
	return srv, as("t_a")
}

// operatorsServer is operatorServer, with a function minting the
// assertion of an operator of any tenant.
func operatorsServer(t *testing.T, cfg httpapi.QueryConfig, wrap func(http.Handler) http.Handler) (*httptest.Server, func(tenant string) string) {
	t.Helper()
	id := processorstest.NewIdentity(t)
	cfg.Guard = func(next func(http.ResponseWriter, *http.Request, httpapi.Operator)) http.HandlerFunc {
		return identity.Require(id.Verifier, "test", "an operator", nil, func(w http.ResponseWriter, r *http.Request, who identity.Identity) {
			next(w, r, httpapi.Operator{User: who.User, Tenant: who.Tenant, Roles: who.Roles})
		})
	}
	h, err := httpapi.QueryHandler(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if wrap != nil {
		h = wrap(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv, func(tenant string) string {
		a, err := id.Issuer.Mint(identity.Identity{User: "u_responder", Agent: "cli", Tenant: tenant, Roles: []string{"operator"}}, processorstest.Audience, 10*time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
}

// getAs asks u with the assertion a, and returns the answer's status and,
// for an error, its code and message.
func getAs(t *testing.T, u, a string) (status int, code, message string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+a)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Error struct{ Code, Message string }
	}
	_ = json.NewDecoder(resp.Body).Decode(&body)
	return resp.StatusCode, body.Error.Code, body.Error.Message
}

// outcomesAsked is a projection that counts the Outcomes questions that
// reach it, and answers none.
type outcomesAsked struct {
	projections.Queries
	asked *atomic.Int32
}

func (o outcomesAsked) Outcomes(context.Context, projections.Filter, time.Duration) ([]projections.OutcomeCount, error) {
	o.asked.Add(1)
	return nil, nil
}

// An Outcomes question over more than MaxOutcomeBuckets buckets is
// refused as an invalid filter by the server, on its own clock, before
// the projection is asked, and by the client before it is sent; without
// since, the window starts at the epoch.
func TestOutcomesBucketBound(t *testing.T) {
	now := time.Date(2026, 11, 30, 14, 0, 0, 0, time.UTC)
	var asked, requests atomic.Int32
	srv, a := operatorServer(t, httpapi.QueryConfig{Queries: outcomesAsked{asked: &asked}, Now: func() time.Time { return now }},
		func(h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				requests.Add(1)
				h.ServeHTTP(w, r)
			})
		})
	for _, c := range []struct {
		name, query string
		refused     bool
	}{
		{"two hours by the second", "since=2h&bucket=1s", false},
		{"the bound by the second", "since=2026-11-30T10:00:00Z&until=2026-11-30T12:46:40Z&bucket=1s", false},
		{"one over the bound", "since=2026-11-30T10:00:00Z&until=2026-11-30T12:46:41Z&bucket=1s", true},
		{"a month by the second", "since=720h&bucket=1s", true},
		{"no since, the default bucket", "", true},
		{"no since, by the week", "bucket=168h", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			asked.Store(0)
			status, code, message := getAs(t, srv.URL+httpapi.PathOutcomes+"?"+c.query, a)
			switch {
			case c.refused && (status != http.StatusBadRequest || code != "invalid_filter" || asked.Load() != 0):
				t.Errorf("GET ?%s = %d %q, projection asked %d times; want 400 invalid_filter, not asked", c.query, status, code, asked.Load())
			case !c.refused && (status != http.StatusOK || asked.Load() != 1):
				t.Errorf("GET ?%s = %d %q (%s), projection asked %d times; want 200, asked once", c.query, status, code, message, asked.Load())
			}
		})
	}

	t.Run("client", func(t *testing.T) {
		c := &httpapi.QueryClient{Base: srv.URL, Bearer: func(string) (string, error) { return a, nil }}
		requests.Store(0)
		for _, q := range []struct {
			f      projections.Filter
			bucket time.Duration
		}{
			{projections.Filter{Tenant: "t_a", Since: time.Now().Add(-30 * 24 * time.Hour)}, time.Second},
			{projections.Filter{Tenant: "t_a"}, 5 * time.Minute},
		} {
			if _, err := c.Outcomes(t.Context(), q.f, q.bucket); !errors.Is(err, projections.ErrInvalidFilter) {
				t.Errorf("Outcomes(%+v, %s) = %v; want ErrInvalidFilter", q.f, q.bucket, err)
			}
		}
		if n := requests.Load(); n != 0 {
			t.Errorf("the client sent %d questions over the bound; want none", n)
		}
	})
}

// The operators of one tenant have at most MaxQuestionsPerTenant
// questions running at once: one more is answered 429
// too_many_questions, Retry-After 1, while another tenant's question
// still runs; once one is answered, the next goes through. Before, one
// tenant's parallel scans of its whole history reached the store however
// many there were.
func TestQuestionsBoundedPerTenant(t *testing.T) {
	q := stalledQueries{deadlines: make(chan bool, 4)}
	u, as := stalledQuestions(t, q, httpapi.QueryConfig{MaxQuestionsPerTenant: 1})
	first := make(chan int, 1)
	go func() {
		status, _, _ := getAs(t, u, as("t_a"))
		first <- status
	}()
	<-q.deadlines // t_a's first question is running
	if status, code, _ := getAs(t, u, as("t_a")); status != http.StatusTooManyRequests || code != "too_many_questions" {
		t.Errorf("a second question of t_a while its first runs = %d %q; want 429 too_many_questions", status, code)
	}
	other := make(chan int, 1)
	go func() {
		status, _, _ := getAs(t, u, as("t_b"))
		other <- status
	}()
	<-q.deadlines // t_b's question runs beside t_a's
	if status := <-first; status != http.StatusGatewayTimeout {
		t.Errorf("t_a's first question = %d; want 504 (the stalled store)", status)
	}
	<-other
	go func() {
		status, _, _ := getAs(t, u, as("t_a"))
		first <- status
	}()
	<-q.deadlines // once answered, t_a asks again
	<-first
}

// A trace holding as many refused submissions under its key as a
// projection keeps (projections.MaxRefusals) says so in
// HeaderRefusalsLimitReached, the bound `ledger trace --clickhouse-dsn`
// notes: the answer is a bare array, and before, a responder took the
// earliest 100 for them all without a word. The refusals kept are the
// earliest half and the latest half: before, the earliest 100, and the
// latest ones, often those nearest an incident, and those an agent's
// ?wait= looks for its own refusal among, were left out. Over the
// embedded index and over ClickHouse.
func TestTraceSaysItsRefusalsWereCut(t *testing.T) {
	for _, backend := range []struct {
		name string
		open func(t *testing.T) projectionstest.Projection
	}{
		{"callindex", func(t *testing.T) projectionstest.Projection {
			ix, err := callindex.Open(filepath.Join(t.TempDir(), "index.db"), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ix.Close() })
			return ix
		}},
		{"chstore", func(t *testing.T) projectionstest.Projection {
			s, err := chstore.Open(t.Context(), chstore.Config{DSN: chtest.DSN(t), Database: chtest.FreshDatabase(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			if err := s.Migrate(t.Context()); err != nil {
				t.Fatal(err)
			}
			return s
		}},
	} {
		t.Run(backend.name, func(t *testing.T) {
			p := backend.open(t)
			log := projectionstest.Log(projectionstest.LogConfig{Seed: 5, Calls: 4, Tenants: 1})
			var keys []ledger.CallKey
			for _, e := range log {
				if !slices.Contains(keys, e.Key()) {
					keys = append(keys, e.Key())
				}
			}
			start := log[0].At.Add(-time.Hour)
			cases := []struct {
				name     string
				key      ledger.CallKey
				refusals int
				cut      bool
			}{
				{"a call flooded", keys[0], projections.MaxRefusals + 30, true},
				{"a key refused only", ledger.CallKey{TenantID: keys[0].TenantID, IdempotencyKey: "refused-only"}, projections.MaxRefusals + 1, true},
				{"as many as kept", keys[1], projections.MaxRefusals, true},
				{"one fewer", keys[2], projections.MaxRefusals - 1, false},
				{"more than half", ledger.CallKey{TenantID: keys[0].TenantID, IdempotencyKey: "refused-70"}, projections.MaxRefusals/2 + 20, false},
				{"none", keys[3], 0, false},
			}
			floods := make([][]ledger.Event, len(cases))
			for i, c := range cases {
				floods[i] = projectionstest.Flood(c.key, c.refusals, uint64(i+1), start)
				log = append(log, floods[i]...)
			}
			projectionstest.Write(t, p, log, 64)
			srv, as := operatorsServer(t, httpapi.QueryConfig{Queries: p}, nil)
			for i, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, srv.URL+httpapi.PathTrace+c.key.TenantID+"/"+c.key.IdempotencyKey, nil)
					if err != nil {
						t.Fatal(err)
					}
					req.Header.Set("Authorization", "Bearer "+as(c.key.TenantID))
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					defer resp.Body.Close()
					var evs []ledger.Event
					if err := json.NewDecoder(resp.Body).Decode(&evs); resp.StatusCode != http.StatusOK || err != nil {
						t.Fatalf("GET trace of %s = %d, %v; want 200 and its events", c.key, resp.StatusCode, err)
					}
					want := ""
					if c.cut {
						want = "true"
					}
					if got := resp.Header.Get(httpapi.HeaderRefusalsLimitReached); got != want {
						t.Errorf("GET trace of %s with %d refusals: %s %q; want %q", c.key, c.refusals, httpapi.HeaderRefusalsLimitReached, got, want)
					}
					// The refusals shown are the earliest and the latest
					// (half as many as the projection keeps each), by
					// time then event id.
					var got []string
					for _, e := range evs {
						if e.Refusal() {
							got = append(got, e.EventID)
						}
					}
					earliest := slices.SortedFunc(slices.Values(floods[i]), func(a, b ledger.Event) int {
						return cmp.Or(a.At.Compare(b.At), strings.Compare(a.EventID, b.EventID))
					})
					if half := projections.MaxRefusals / 2; len(earliest) > 2*half {
						earliest = append(earliest[:half:half], earliest[len(earliest)-half:]...)
					}
					var wantIDs []string
					for _, e := range earliest {
						wantIDs = append(wantIDs, e.EventID)
					}
					if !slices.Equal(got, wantIDs) {
						t.Errorf("GET trace of %s: refusals %d shown, %v; want the earliest and the latest %d, %v", c.key, len(got), got, len(wantIDs), wantIDs)
					}
				})
			}
		})
	}
}
