package httpapi_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// publisher records what the API published, and plays the ledger: when
// asked, it folds a settled call into the index for the published key.
type publisher struct {
	mu     sync.Mutex
	keys   []string
	fail   bool
	settle func(key string)
	// hang: Publish blocks until its context ends, as a producer does
	// retrying a partition without a leader.
	hang bool
}

func (p *publisher) Publish(ctx context.Context, key, _ []byte) error {
	if p.hang {
		<-ctx.Done()
		return ctx.Err()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fail {
		return errors.New("broker down")
	}
	p.keys = append(p.keys, string(key))
	if p.settle != nil {
		go p.settle(string(key))
	}
	return nil
}

// published returns the keys published so far.
func (p *publisher) published() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.keys)
}

// osloHash is the arguments hash of validEnvelope's call, which the
// calls settledAs makes carry.
var osloHash = func() string {
	tree, _ := ledger.Decode([]byte(`{"city":"Oslo"}`), ledger.Limits{})
	hash, err := ledger.ArgumentsHash("t_a", "get_weather", 1, tree)
	if err != nil {
		panic(err)
	}
	return hash
}()

func validEnvelope(t *testing.T, key string) string {
	t.Helper()
	b, _ := json.Marshal(map[string]any{
		"tool": "get_weather", "tool_version": 1, "call_id": "c1", "arguments": map[string]any{"city": "Oslo"},
		"scope": map[string]any{"tenant_id": "t_a"}, "idempotency_key": key, "arguments_hash": osloHash,
	})
	return string(b)
}

func newAPI(t *testing.T, pub *publisher, edits ...func(*httpapi.Config)) (*httptest.Server, *callindex.Index) {
	t.Helper()
	ix, err := callindex.Open(filepath.Join(t.TempDir(), "ix.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ix.Close() })
	cfg := httpapi.Config{Publisher: pub, Calls: ix}
	for _, edit := range edits {
		edit(&cfg)
	}
	api, err := httpapi.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	return srv, ix
}

func decodeErr(t *testing.T, resp *http.Response) (code, pointer string) {
	t.Helper()
	defer resp.Body.Close()
	var body struct {
		Error struct{ Code, Pointer string } `json:"error"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&body)
	return body.Error.Code, body.Error.Pointer
}

func TestSubmitRefusesMalformedWithoutPublishing(t *testing.T) {
	pub := &publisher{}
	srv, _ := newAPI(t, pub)
	for _, tc := range []struct {
		name, body, code, pointer string
		status                    int
	}{
		{"not json", `nope`, ledger.CodeInvalidJSON, "", 400},
		{"unknown field", strings.Replace(validEnvelope(t, "k"), `{"arguments"`, `{"extra":1,"arguments"`, 1), ledger.CodeUnknownField, "/extra", 400},
		{"too large", `{"x":"` + strings.Repeat("a", 300<<10) + `"}`, ledger.CodeTooLarge, "", 413},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := http.Post(srv.URL+"/v1/calls", "application/json", strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			code, ptr := decodeErr(t, resp)
			if resp.StatusCode != tc.status || code != tc.code || ptr != tc.pointer {
				t.Errorf("POST = %d %s at %q; want %d %s at %q", resp.StatusCode, code, ptr, tc.status, tc.code, tc.pointer)
			}
		})
	}
	if len(pub.keys) != 0 {
		t.Errorf("published %v; want nothing", pub.keys)
	}
}

func TestSubmitPublishesUnderTenantKeyAndWaits(t *testing.T) {
	pub := &publisher{}
	srv, ix := newAPI(t, pub)
	pub.settle = settled(ix)
	resp, err := http.Post(srv.URL+"/v1/calls?wait=10s", "application/json", strings.NewReader(validEnvelope(t, "k1")))
	if err != nil {
		t.Fatal(err)
	}
	var v httpapi.CallView
	_ = json.NewDecoder(resp.Body).Decode(&v)
	resp.Body.Close()
	if resp.StatusCode != 200 || v.State != "succeeded" || len(v.Events) != 4 {
		t.Errorf("POST ?wait = %d %q with %d events; want 200 succeeded with 4", resp.StatusCode, v.State, len(v.Events))
	}
	if len(pub.keys) != 1 || pub.keys[0] != "t_a/k1" {
		t.Errorf("published keys %v; want [t_a/k1]", pub.keys)
	}

	resp, err = http.Get(srv.URL + "/v1/calls/k1")
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := decodeErr(t, resp); resp.StatusCode != 400 || code != "missing_tenant" {
		t.Errorf("GET without tenant = %d %s; want 400 missing_tenant", resp.StatusCode, code)
	}
	resp, err = http.Get(srv.URL + "/v1/calls/x?tenant_id=t_a/k1")
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := decodeErr(t, resp); resp.StatusCode != 400 || code != "invalid_tenant" {
		t.Errorf("GET with a '/' in the tenant = %d %s; want 400 invalid_tenant", resp.StatusCode, code)
	}
	resp, err = http.Get(srv.URL + "/v1/calls/k1?tenant_id=t_b")
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := decodeErr(t, resp); resp.StatusCode != 404 || code != "not_found" {
		t.Errorf("GET as another tenant = %d %s; want 404 not_found", resp.StatusCode, code)
	}
}

// A publish that fails, or that does not end (a producer retrying a
// partition without a leader), is answered 503 publish_failed, which an
// agent sends again. Before, the second held the request as long as the
// agent waited.
func TestSubmitPublishFailureIsRetryable(t *testing.T) {
	for name, pub := range map[string]*publisher{"failing": {fail: true}, "hanging": {hang: true}} {
		srv, _ := newAPI(t, pub, func(c *httpapi.Config) { c.PublishTimeout = 200 * time.Millisecond })
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/calls", strings.NewReader(validEnvelope(t, "k2")))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			cancel()
			t.Fatalf("%s: %v", name, err)
		}
		if code, _ := decodeErr(t, resp); resp.StatusCode != 503 || code != "publish_failed" {
			t.Errorf("POST with the broker %s = %d %s; want 503 publish_failed", name, resp.StatusCode, code)
		}
		cancel()
	}
}

// A body that cannot be read whole for another reason than its size is
// answered 400 invalid_request, not 413 too_large, which says that
// sending it again cannot pass.
func TestSubmitUnreadableBody(t *testing.T) {
	pub := &publisher{}
	srv, _ := newAPI(t, pub)
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// A chunked body whose chunk size is not hexadecimal.
	if _, err := io.WriteString(conn, "POST /v1/calls HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := decodeErr(t, resp); resp.StatusCode != http.StatusBadRequest || code != "invalid_request" {
		t.Errorf("POST with a broken chunked body = %d %s; want 400 invalid_request", resp.StatusCode, code)
	}
	if keys := pub.published(); len(keys) != 0 {
		t.Errorf("published %v; want nothing", keys)
	}
}

// A body that runs out the server's read timeout (a slow link) is
// answered 408 request_timeout, which a client sends again, with a
// message of its own: before, 400 invalid_request, which clients take as
// final, quoting the read error, which names the server's address.
func TestSubmitBodyTooSlow(t *testing.T) {
	pub := &publisher{}
	api, err := httpapi.New(httpapi.Config{Publisher: pub})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(api)
	srv.Config.ReadTimeout = 200 * time.Millisecond
	srv.Start()
	t.Cleanup(srv.Close)
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Half of the body promised; the rest never comes.
	if _, err := io.WriteString(conn, "POST /v1/calls HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nContent-Type: application/json\r\n\r\n{\"tool\": \"create_ticket\","); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(raw), `"request_timeout"`) {
		t.Errorf("POST of a body slower than the read timeout = %d %s; want 408 request_timeout", resp.StatusCode, raw)
	}
	if addr := strings.TrimPrefix(srv.URL, "http://"); strings.Contains(string(raw), addr) || strings.Contains(string(raw), "i/o timeout") {
		t.Errorf("the answer quotes the read error: %s", raw)
	}
	if !httpapi.IsTransient(&httpapi.APIError{Status: resp.StatusCode, Code: "request_timeout"}) {
		t.Error("IsTransient(408) = false; want true: sent again it may pass")
	}
	if keys := pub.published(); len(keys) != 0 {
		t.Errorf("published %v; want nothing", keys)
	}
}

// /healthz, which anyone may ask, says which check failed and not why:
// the error names the store's address and database, which go to the log.
func TestHealthHidesErrors(t *testing.T) {
	logs := &ledgertest.LogBuffer{}
	status, body, got := getHealth(t, httpapi.Config{Publisher: &publisher{}, Logger: slog.New(slog.NewJSONHandler(logs, nil)), Checks: []httpapi.Check{
		{Name: "kafka", Check: func(context.Context) error { return nil }},
		{Name: "clickhouse", Check: func(context.Context) error {
			return errors.New("clickhouse at 10.1.2.3:9000, database ledger_prod: dial tcp: connection refused")
		}},
	}})
	if status != http.StatusServiceUnavailable {
		t.Errorf("status %d; want 503", status)
	}
	if want := map[string]string{"kafka": "ok", "clickhouse": "unavailable"}; !maps.Equal(got.Checks, want) {
		t.Errorf("checks %v; want %v", got.Checks, want)
	}
	if strings.Contains(string(body), "10.1.2.3") || strings.Contains(string(body), "ledger_prod") {
		t.Errorf("the health answer shows the error: %s", body)
	}
	if !strings.Contains(logs.String(), "10.1.2.3:9000") {
		t.Errorf("the error is not in the log: %s", logs.String())
	}
}

// A check that degrades the API (ClickHouse's: lookups and questions)
// says so without taking it out of service, which would take the agents'
// submissions, the approvals and the kill switch with it; one that does
// not (Kafka's) takes it out. Each check has its own budget: one that
// hangs does not fail the others.
func TestHealthDegraded(t *testing.T) {
	down := func(context.Context) error { return errors.New("down") }
	hangs := func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }
	ok := func(ctx context.Context) error { return ctx.Err() } // answers within its budget
	for _, tc := range []struct {
		name       string
		checks     []httpapi.Check
		wantStatus int
		want       string
		wantChecks map[string]string
	}{
		{"clickhouse down", []httpapi.Check{{Name: "kafka", Check: ok}, {Name: "clickhouse", Check: down, Degrades: true}},
			http.StatusOK, "degraded", map[string]string{"kafka": "ok", "clickhouse": "unavailable"}},
		{"kafka down", []httpapi.Check{{Name: "kafka", Check: down}, {Name: "clickhouse", Check: ok, Degrades: true}},
			http.StatusServiceUnavailable, "unavailable", map[string]string{"kafka": "unavailable", "clickhouse": "ok"}},
		{"both down", []httpapi.Check{{Name: "clickhouse", Check: down, Degrades: true}, {Name: "kafka", Check: down}},
			http.StatusServiceUnavailable, "unavailable", map[string]string{"kafka": "unavailable", "clickhouse": "unavailable"}},
		{"one hangs", []httpapi.Check{{Name: "kafka", Check: hangs}, {Name: "clickhouse", Check: ok, Degrades: true}},
			http.StatusServiceUnavailable, "unavailable", map[string]string{"kafka": "unavailable", "clickhouse": "ok"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, _, got := getHealth(t, httpapi.Config{Publisher: &publisher{}, Checks: tc.checks})
			if status != tc.wantStatus || got.Status != tc.want || !maps.Equal(got.Checks, tc.wantChecks) {
				t.Errorf("/healthz: %d %s %v; want %d %s %v", status, got.Status, got.Checks, tc.wantStatus, tc.want, tc.wantChecks)
			}
		})
	}
}

// /healthz, which anyone may ask, runs its checks once for every asker
// meanwhile and serves that answer for a second: each run pings
// ClickHouse from the lookups' pool and Kafka, and logs every failed
// check, so that a crowd of askers took both from the agents during an
// outage. Every asker still gets the answer, failures included.
func TestHealthChecksOnceForManyAskers(t *testing.T) {
	var runs atomic.Int32
	api, err := httpapi.New(httpapi.Config{Publisher: &publisher{}, Checks: []httpapi.Check{{Name: "clickhouse", Check: func(context.Context) error {
		runs.Add(1)
		time.Sleep(50 * time.Millisecond) // a slow ClickHouse
		return errors.New("down")
	}}}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	const askers = 40
	var wg sync.WaitGroup
	var unavailable atomic.Int32
	for range askers {
		wg.Go(func() {
			resp, err := http.Get(srv.URL + "/healthz")
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
			if resp.StatusCode == http.StatusServiceUnavailable {
				unavailable.Add(1)
			}
		})
	}
	wg.Wait()
	if n := runs.Load(); n > 2 {
		t.Errorf("%d askers at once ran the checks %d times; want once (twice if a run ended as others arrived)", askers, n)
	}
	if n := unavailable.Load(); n != askers {
		t.Errorf("%d of %d askers told unavailable; want all", n, askers)
	}
}

// health is a /healthz answer.
type health struct {
	Status string
	Checks map[string]string
}

// getHealth asks /healthz of an API of cfg.
func getHealth(t *testing.T, cfg httpapi.Config) (status int, body []byte, got health) {
	t.Helper()
	api, err := httpapi.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	resp, err := http.Get(srv.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, body, got
}

// A wait answers this submission: a call settled under the key with
// other arguments is an earlier one, and a refusal under the key before
// the submission an earlier one's; the wait goes on until the
// submission's own refusal (or its end), answered in refused, with the
// call under the key but not its result. Before, it answered at once
// with the earlier call and its result, which the agent took for its own.
func TestWaitAnswersThisSubmission(t *testing.T) {
	pub := &publisher{}
	// The earlier call's record, with its result.
	srv, ix := newAPI(t, pub, func(c *httpapi.Config) { c.Results = otherCallResults{"c0", "sha256:other"} })
	var earlier []ledger.Event
	for i, ty := range []statemachine.EventType{statemachine.EventRequested, statemachine.EventAuthorized, statemachine.EventExecuting, statemachine.EventSucceeded} {
		earlier = append(earlier, ledger.Event{EventID: "e" + string(ty), Type: ty, Seq: int64(i + 1), At: time.Now(), TenantID: "t_a", IdempotencyKey: "k9", CallID: "c0", ArgumentsHash: "sha256:other", Attempt: 1})
	}
	reuse := func(id string) ledger.Event {
		return ledger.Event{EventID: id, Type: statemachine.EventDenied, Seq: 0, At: time.Now(), TenantID: "t_a", IdempotencyKey: "k9", CallID: "c1", Reason: "idempotency_key_reused", Pointer: "/arguments_hash"}
	}
	// An earlier submission of the same envelope, refused already.
	if err := ix.Apply(append(earlier, reuse("r0"))); err != nil {
		t.Fatal(err)
	}
	// A wait long enough for the look before publishing, which
	// ?wait= bounds.
	resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=2s", "", validEnvelope(t, "k9"))
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Errorf("POST ?wait under a key settled with other arguments, refused before = %d; want 202, no answer yet", resp.StatusCode)
	}
	pub.settle = func(string) { _ = ix.Apply([]ledger.Event{reuse("r1")}) }
	resp = do(t, http.MethodPost, srv.URL+"/v1/calls?wait=5s", "", validEnvelope(t, "k9"))
	var v httpapi.CallView
	_ = json.NewDecoder(resp.Body).Decode(&v)
	resp.Body.Close()
	if resp.StatusCode != 200 || v.Refused == nil || v.Refused.EventID != "r1" || v.Result != nil {
		t.Errorf("POST ?wait, then refused: %d, refused %+v, result %s; want 200 with the refusal r1 and no result", resp.StatusCode, v.Refused, v.Result)
	}
}

// Without a Caller (ledger dev), a call settled under the key with the
// submission's arguments but by another user is no answer to it either:
// the intake refuses the second user (idempotency_key_reused), in the
// same words whatever its arguments, and the wait answers with that
// refusal, not with the other user's call and its result. Before, it
// answered at once with that call, and with its result.
func TestWaitPassesOverAnotherUsersCall(t *testing.T) {
	pub := &publisher{}
	srv, ix := newAPI(t, pub, func(c *httpapi.Config) { c.Results = otherCallResults{"c1", osloHash} })
	settledAs(ix, "u_first")("t_a/k7")
	pub.settle = func(string) {
		_ = ix.Apply([]ledger.Event{{EventID: "r1", Type: statemachine.EventDenied, At: time.Now(), TenantID: "t_a", IdempotencyKey: "k7",
			CallID: "c2", UserID: "u_second", Reason: "idempotency_key_reused", Pointer: "/idempotency_key"}})
	}
	b, _ := json.Marshal(map[string]any{
		"tool": "get_weather", "tool_version": 1, "call_id": "c2", "arguments": map[string]any{"city": "Oslo"},
		"scope": map[string]any{"tenant_id": "t_a", "user_id": "u_second"}, "idempotency_key": "k7", "arguments_hash": osloHash,
	})
	resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=5s", "", string(b))
	var v httpapi.CallView
	_ = json.NewDecoder(resp.Body).Decode(&v)
	resp.Body.Close()
	if resp.StatusCode != 200 || v.Refused == nil || v.Refused.EventID != "r1" || v.Result != nil {
		t.Errorf("POST ?wait as u_second under u_first's call: %d, refused %+v, result %s; want 200 with its refusal r1 and no result", resp.StatusCode, v.Refused, v.Result)
	}
}

// An agent whose submission reused another user's key sees, under the
// key, its own refusal alone: not the other user's call (its state, its
// events, its arguments), nor that user's refusals. Its wait is answered
// with its refusal, and the view carries nothing of the other call.
func TestAnotherUsersKeyShowsOnlyOwnRefusals(t *testing.T) {
	pub := &publisher{}
	srv, ix := newAPI(t, pub, func(c *httpapi.Config) { c.Caller, c.Results = agentOf, resultsOf{"t_a/k1": `{"temp_c":9}`} })
	settledAs(ix, "u1")("t_a/k1")
	refusal := func(id, user string) ledger.Event {
		return ledger.Event{EventID: id, Type: statemachine.EventDenied, At: time.Now(), TenantID: "t_a", IdempotencyKey: "k1", CallID: "c1",
			UserID: user, Reason: "idempotency_key_reused", Pointer: "/arguments_hash"}
	}
	if err := ix.Apply([]ledger.Event{refusal("r-u1", "u1"), refusal("r-u3", "u3")}); err != nil {
		t.Fatal(err)
	}
	pub.settle = func(string) { _ = ix.Apply([]ledger.Event{refusal("r-u2", "u2")}) }
	resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=5s", "Bearer agent-of-t_a/u2", validEnvelope(t, "k1"))
	var waited httpapi.CallView
	_ = json.NewDecoder(resp.Body).Decode(&waited)
	resp.Body.Close()
	if resp.StatusCode != 200 || waited.Refused == nil || waited.Refused.EventID != "r-u2" {
		t.Fatalf("POST ?wait as u2, refused: %d, refused %+v; want 200 with its refusal r-u2", resp.StatusCode, waited.Refused)
	}
	resp = do(t, http.MethodGet, srv.URL+"/v1/calls/k1", "Bearer agent-of-t_a/u2", "")
	var got httpapi.CallView
	_ = json.NewDecoder(resp.Body).Decode(&got)
	resp.Body.Close()
	for what, v := range map[string]httpapi.CallView{"the wait's answer": waited, "GET": got} {
		var refusals []string
		for _, r := range v.Refusals {
			refusals = append(refusals, r.EventID)
		}
		if v.State != "" || len(v.Events) != 0 || v.Result != nil || v.ResultWithheld != "" || !slices.Equal(refusals, []string{"r-u2"}) {
			t.Errorf("%s as u2 = state %q, %d events, result %s %q, refusals %v; want no call, its refusal r-u2 alone",
				what, v.State, len(v.Events), v.Result, v.ResultWithheld, refusals)
		}
	}
}

// flakyCalls fails its first lookup, then answers from the index.
type flakyCalls struct {
	ix     *callindex.Index
	failed *atomic.Bool
}

func (f flakyCalls) Call(ctx context.Context, key ledger.CallKey) (callindex.Call, error) {
	if f.failed.CompareAndSwap(false, true) {
		return callindex.Call{}, errors.New("index unavailable")
	}
	return f.ix.Call(ctx, key)
}

// A lookup the index does not answer (its outage, or ledger api's
// ClickHouse not open yet) is answered 503 call_index_unavailable with a
// Retry-After, which agents' clients take as transient; asked again once
// the index answers, the call is there.
func TestLookupTheIndexDidNotAnswer(t *testing.T) {
	srv, ix := newAPI(t, &publisher{}, func(c *httpapi.Config) {
		c.Calls = flakyCalls{ix: c.Calls.(*callindex.Index), failed: new(atomic.Bool)}
	})
	if err := ix.Apply([]ledger.Event{{EventID: "e1", Type: statemachine.EventRequested, At: time.Now(), TenantID: "t_a", IdempotencyKey: "k9", CallID: "c9"}}); err != nil {
		t.Fatal(err)
	}
	resp := do(t, http.MethodGet, srv.URL+"/v1/calls/k9?tenant_id=t_a", "", "")
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	err := &httpapi.APIError{Status: resp.StatusCode}
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "5" || !strings.Contains(string(body), `"call_index_unavailable"`) || !httpapi.IsTransient(err) {
		t.Errorf("GET while the index does not answer = %d, Retry-After %q, %s; want 503 call_index_unavailable, Retry-After 5, transient",
			resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	resp = do(t, http.MethodGet, srv.URL+"/v1/calls/k9?tenant_id=t_a", "", "")
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET once the index answers = %d; want 200", resp.StatusCode)
	}
}

// When the index cannot say which refusals were under the key before a
// submission (its look before publishing failed), a refusal of the same
// call id dated before the submission arrived is still no answer to it.
func TestWaitPassesOverRefusalsDatedBefore(t *testing.T) {
	srv, ix := newAPI(t, &publisher{}, func(c *httpapi.Config) {
		c.Calls = flakyCalls{ix: c.Calls.(*callindex.Index), failed: new(atomic.Bool)}
	})
	if err := ix.Apply([]ledger.Event{{EventID: "old", Type: statemachine.EventDenied, At: time.Now().Add(-time.Minute), TenantID: "t_a", IdempotencyKey: "k8", CallID: "c1", Reason: "policy_timeout", RetryAfterMS: 100}}); err != nil {
		t.Fatal(err)
	}
	resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=300ms", "", validEnvelope(t, "k8"))
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Errorf("POST ?wait with a refusal of the call id from a minute before = %d; want 202, no answer yet", resp.StatusCode)
	}
}

// A refusal of an earlier submission that the index shows only after
// this one was published (a projection behind) is no answer to it: it is
// dated before the submission arrived. Before, a readable index's set of
// earlier refusals was the only filter, and the wait answered the agent
// refused while its call, admitted, ran.
func TestWaitPassesOverALaggingOldRefusal(t *testing.T) {
	pub := &publisher{}
	srv, ix := newAPI(t, pub)
	refusal := func(id string, at time.Time) ledger.Event {
		return ledger.Event{EventID: id, Type: statemachine.EventDenied, At: at, TenantID: "t_a", IdempotencyKey: "k9", CallID: "c1", Reason: "tool_frozen"}
	}
	// The index shows one earlier refusal when the submission arrives,
	// and another, older still, once it is published.
	if err := ix.Apply([]ledger.Event{refusal("shown", time.Now().Add(-2*time.Minute))}); err != nil {
		t.Fatal(err)
	}
	pub.settle = func(string) { _ = ix.Apply([]ledger.Event{refusal("late", time.Now().Add(-time.Minute))}) }
	resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=300ms", "", validEnvelope(t, "k9"))
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Errorf("POST ?wait with a refusal of the call id from a minute before, shown once published = %d; want 202, no answer yet", resp.StatusCode)
	}
}

// An agent retrying under one key (refused rate_limited again and again)
// is answered its own refusal however many came before: the index keeps
// the latest refusals under a key beside the earliest. Before, it kept
// the earliest projections.MaxRefusals alone, and from the 101st
// submission on every ?wait= ran out, answered 202 without its refusal.
func TestWaitFindsItsRefusalAfterMany(t *testing.T) {
	pub := &publisher{}
	srv, ix := newAPI(t, pub)
	refusal := func(id string, at time.Time) ledger.Event {
		return ledger.Event{EventID: id, Type: statemachine.EventDenied, At: at, TenantID: "t_a", IdempotencyKey: "k7", CallID: "c1", Reason: "rate_limited", RetryAfterMS: 100}
	}
	var earlier []ledger.Event
	for i := range projections.MaxRefusals + 20 {
		earlier = append(earlier, refusal(fmt.Sprintf("r%03d", i), time.Now().Add(-time.Minute+time.Duration(i)*time.Millisecond)))
	}
	if err := ix.Apply(earlier); err != nil {
		t.Fatal(err)
	}
	pub.settle = func(string) { _ = ix.Apply([]ledger.Event{refusal("r-new", time.Now())}) }
	resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=3s", "", validEnvelope(t, "k7"))
	var v httpapi.CallView
	_ = json.NewDecoder(resp.Body).Decode(&v)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || v.Refused == nil || v.Refused.EventID != "r-new" {
		t.Errorf("POST ?wait under a key refused %d times before, then refused: %d, refused %+v; want 200 with the refusal r-new", len(earlier), resp.StatusCode, v.Refused)
	}
}

// agentOf is a Caller for the tests: "Bearer agent-of-<tenant>/<user>"
// stands for an agent's verified assertion.
func agentOf(r *http.Request) (httpapi.Agent, error) {
	who, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer agent-of-")
	if !ok {
		return httpapi.Agent{}, errors.New("missing_bearer")
	}
	tenant, user, _ := strings.Cut(who, "/")
	return httpapi.Agent{Tenant: tenant, User: user}, nil
}

// do sends a request with auth as its Authorization ("": none).
func do(t *testing.T, method, url, auth, body string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// With a Caller, a call is read for the verified caller's tenant alone:
// without a caller, 401; another tenant's key, or a tenant_id naming
// another, not found.
func TestCallsForTheVerifiedCallerOnly(t *testing.T) {
	srv, ix := newAPI(t, &publisher{}, func(c *httpapi.Config) { c.Caller = agentOf })
	for _, k := range []ledger.CallKey{{TenantID: "t_a", IdempotencyKey: "k1"}, {TenantID: "t_b", IdempotencyKey: "k2"}} {
		if err := ix.Apply([]ledger.Event{{EventID: "e-" + k.IdempotencyKey, Type: statemachine.EventRequested, Seq: 1, At: time.Now(),
			TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey, ArgumentsHash: "sha256:x", UserID: "u1"}}); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		path, auth string
		status     int
	}{
		{"/v1/calls/k1", "Bearer agent-of-t_a/u1", 200},
		{"/v1/calls/k1?tenant_id=t_a", "Bearer agent-of-t_a/u1", 200},
		{"/v1/calls/k1?tenant_id=t_a", "", 401},
		{"/v1/calls/k2", "Bearer agent-of-t_a/u1", 404},
		{"/v1/calls/k2?tenant_id=t_b", "Bearer agent-of-t_a/u1", 404},
		{"/v1/calls/k2", "Bearer agent-of-t_b/u1", 200},
	} {
		resp := do(t, http.MethodGet, srv.URL+tc.path, tc.auth, "")
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("GET %s as %q = %d; want %d", tc.path, tc.auth, resp.StatusCode, tc.status)
		}
	}
}

// With a Caller, POST ?wait= waits for a caller of the envelope's tenant
// alone, and refuses the others before publishing anything (so that
// they may send it again): without a bearer, 401; with another
// tenant's, 403 tenant_mismatch. Without ?wait= too: the request topic
// is not open to whoever reaches the API (before, anyone published
// there, the intake verifying only the envelope's own assertion).
func TestWaitForTheVerifiedCallerOnly(t *testing.T) {
	pub := &publisher{}
	results := resultsOf{"t_a/k1": `{"temp_c":9}`}
	srv, ix := newAPI(t, pub, func(c *httpapi.Config) { c.Caller, c.Results = agentOf, results })
	pub.settle = settledAs(ix, "u1")
	post := func(auth, query string) *http.Response {
		t.Helper()
		return do(t, http.MethodPost, srv.URL+"/v1/calls"+query, auth, validEnvelope(t, "k1"))
	}
	for _, tc := range []struct {
		auth, code string
		status     int
	}{
		{"", "unauthenticated", http.StatusUnauthorized},
		{"Bearer agent-of-t_b/u1", "tenant_mismatch", http.StatusForbidden},
	} {
		resp := post(tc.auth, "?wait=5s")
		if code, _ := decodeErr(t, resp); resp.StatusCode != tc.status || code != tc.code {
			t.Errorf("POST ?wait as %q = %d %s; want %d %s", tc.auth, resp.StatusCode, code, tc.status, tc.code)
		}
	}
	// An envelope another user's (its scope says so, or its assertion,
	// read unverified): its call would be that user's, which the wait
	// cannot see.
	otherUsers := func(edit func(map[string]any)) string {
		var env map[string]any
		_ = json.Unmarshal([]byte(validEnvelope(t, "k1")), &env)
		edit(env)
		b, _ := json.Marshal(env)
		return string(b)
	}
	payload := base64.RawURLEncoding.EncodeToString([]byte(`{"sub":"u1","tenant":"t_a"}`))
	for what, env := range map[string]string{
		"scope.user_id": otherUsers(func(env map[string]any) { env["scope"].(map[string]any)["user_id"] = "u1" }),
		"assertion":     otherUsers(func(env map[string]any) { env["assertion"] = "eyJhbGciOiJFZERTQSJ9." + payload + ".c2ln" }),
	} {
		resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=5s", "Bearer agent-of-t_a/u2", env)
		if code, _ := decodeErr(t, resp); resp.StatusCode != http.StatusForbidden || code != "user_mismatch" {
			t.Errorf("POST ?wait as u2 of an envelope whose %s is u1's = %d %s; want 403 user_mismatch", what, resp.StatusCode, code)
		}
	}
	if keys := pub.published(); len(keys) != 0 {
		t.Fatalf("refused waits published %v; want nothing", keys)
	}

	resp := post("Bearer agent-of-t_a/u1", "?wait=5s")
	var v httpapi.CallView
	_ = json.NewDecoder(resp.Body).Decode(&v)
	resp.Body.Close()
	if resp.StatusCode != 200 || v.State != "succeeded" || compact(v.Result) != `{"temp_c":9}` {
		t.Errorf("POST ?wait as u1 = %d %q result %s withheld %q; want 200 succeeded, its result", resp.StatusCode, v.State, v.Result, v.ResultWithheld)
	}
	// Another user's wait on the same envelope is not answered with u1's
	// call: the wait runs out (202).
	resp = post("Bearer agent-of-t_a/u2", "?wait=1s")
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted || strings.Contains(string(body), "succeeded") {
		t.Errorf("POST ?wait as u2 on u1's call = %d %s; want 202, without u1's call", resp.StatusCode, body)
	}
	for _, tc := range []struct {
		auth, code string
		status     int
	}{
		{"", "unauthenticated", http.StatusUnauthorized},
		{"Bearer agent-of-t_b/u1", "tenant_mismatch", http.StatusForbidden},
		// Its user is not what a submission checks: the intake decides
		// whose call it is, from the envelope's assertion.
		{"Bearer agent-of-t_a/u2", "", http.StatusAccepted},
	} {
		resp := post(tc.auth, "")
		if code, _ := decodeErr(t, resp); resp.StatusCode != tc.status || code != tc.code {
			t.Errorf("POST without ?wait as %q = %d %s; want %d %s", tc.auth, resp.StatusCode, code, tc.status, tc.code)
		}
	}
	if keys := pub.published(); len(keys) != 3 {
		t.Errorf("published %v; want t_a/k1 three times", keys)
	}
}

// With an Assertion check, an envelope whose own assertion the intake
// would refuse (expired: sent again later) is answered 400
// assertion_<reason>, and one of another tenant than the bearer 403, both
// before anything is published. Before, it was published, the intake
// refused it under its reserved tenant, and the bearer's ?wait= ran out
// without a word.
func TestSubmissionsAssertionCheckedBeforePublishing(t *testing.T) {
	pub := &publisher{}
	srv, _ := newAPI(t, pub, func(c *httpapi.Config) {
		c.Caller = agentOf
		c.Assertion = func(_ context.Context, a string) (httpapi.Agent, error) {
			switch a {
			case "expired.as.sertion":
				return httpapi.Agent{}, errors.New("expired")
			case "tb.as.sertion":
				return httpapi.Agent{Tenant: "t_b", User: "u1"}, nil
			case "u2.as.sertion":
				return httpapi.Agent{Tenant: "t_a", User: "u2"}, nil
			}
			return httpapi.Agent{Tenant: "t_a", User: "u1"}, nil
		}
	})
	withAssertion := func(a string) string {
		var env map[string]any
		_ = json.Unmarshal([]byte(validEnvelope(t, "k1")), &env)
		env["assertion"] = a
		b, _ := json.Marshal(env)
		return string(b)
	}
	for _, tc := range []struct {
		assertion, code string
		status          int
	}{
		{"expired.as.sertion", "assertion_expired", http.StatusBadRequest},
		{"tb.as.sertion", "tenant_mismatch", http.StatusForbidden},
	} {
		for _, query := range []string{"", "?wait=5s"} {
			resp := do(t, http.MethodPost, srv.URL+"/v1/calls"+query, "Bearer agent-of-t_a/u1", withAssertion(tc.assertion))
			if code, _ := decodeErr(t, resp); resp.StatusCode != tc.status || code != tc.code {
				t.Errorf("POST%s of an envelope with assertion %s = %d %s; want %d %s", query, tc.assertion, resp.StatusCode, code, tc.status, tc.code)
			}
		}
	}
	// A wait on an envelope whose assertion is verified as another
	// user's, whatever its scope says (here the bearer's user): the call
	// would be that user's, which the wait cannot see.
	var env map[string]any
	_ = json.Unmarshal([]byte(withAssertion("u2.as.sertion")), &env)
	env["scope"].(map[string]any)["user_id"] = "u1"
	scoped, _ := json.Marshal(env)
	resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=5s", "Bearer agent-of-t_a/u1", string(scoped))
	if code, _ := decodeErr(t, resp); resp.StatusCode != http.StatusForbidden || code != "user_mismatch" {
		t.Errorf("POST ?wait as u1 of an envelope scoped to u1 with u2's assertion = %d %s; want 403 user_mismatch", resp.StatusCode, code)
	}
	if keys := pub.published(); len(keys) != 0 {
		t.Fatalf("refused submissions published %v; want nothing", keys)
	}
	if resp := do(t, http.MethodPost, srv.URL+"/v1/calls", "Bearer agent-of-t_a/u1", withAssertion("good.as.sertion")); resp.StatusCode != http.StatusAccepted {
		t.Errorf("POST of an envelope with a good assertion = %d; want 202", resp.StatusCode)
	}
}

// compact is raw without the API's indentation ("" for none).
func compact(raw json.RawMessage) string {
	var b bytes.Buffer
	if json.Compact(&b, raw) != nil {
		return string(raw)
	}
	return b.String()
}

// resultsOf serves the results of the keys it holds, as those of the
// calls settledAs makes (call id c1, osloHash).
type resultsOf map[string]string

func (r resultsOf) Result(_ context.Context, key ledger.CallKey) (httpapi.Result, error) {
	if res, ok := r[key.String()]; ok {
		return httpapi.Result{CallID: "c1", ArgumentsHash: osloHash, Body: json.RawMessage(res)}, nil
	}
	return httpapi.Result{}, nil
}

// failingResults cannot read any result.
type failingResults struct{}

func (failingResults) Result(context.Context, ledger.CallKey) (httpapi.Result, error) {
	return httpapi.Result{}, errors.New("store down")
}

// otherCallResults holds, under every key, a record whose call id or
// hash is another call's.
type otherCallResults struct{ callID, hash string }

func (o otherCallResults) Result(context.Context, ledger.CallKey) (httpapi.Result, error) {
	return httpapi.Result{CallID: o.callID, ArgumentsHash: o.hash, Body: json.RawMessage(`{"secret":1}`)}, nil
}

// A call, and so its result, is the user's who made it alone: to another
// user of its tenant it is not found (its arguments are in its events),
// and to a caller without a user neither. Without Results, a call that ran says result_withheld not_served,
// unavailable when they cannot be read, and gone when the store's record
// under its key is another call's; one that ran no tool says nothing of
// a result. Without a Caller (ledger
// dev), the result is served to whoever asks.
func TestResultForTheCallersUserOnly(t *testing.T) {
	results := resultsOf{"t_a/k1": `{"temp_c":9}`, "t_a/k2": `{"denied":"yet a record"}`}
	srv, ix := newAPI(t, &publisher{}, func(c *httpapi.Config) { c.Caller, c.Results = agentOf, results })
	settledAs(ix, "u1")("t_a/k1")
	denied := []ledger.Event{
		{EventID: "d1", Type: statemachine.EventRequested, Seq: 1, At: time.Now(), TenantID: "t_a", IdempotencyKey: "k2", ArgumentsHash: "sha256:x", UserID: "u1", CallID: "c1"},
		{EventID: "d2", Type: statemachine.EventDenied, Seq: 2, At: time.Now(), TenantID: "t_a", IdempotencyKey: "k2", ArgumentsHash: "sha256:x", Reason: "policy_denied"},
	}
	if err := ix.Apply(denied); err != nil {
		t.Fatal(err)
	}
	view := func(srv *httptest.Server, path, auth string) httpapi.CallView {
		t.Helper()
		resp := do(t, http.MethodGet, srv.URL+path, auth, "")
		defer resp.Body.Close()
		var v httpapi.CallView
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil || resp.StatusCode != 200 {
			t.Fatalf("GET %s as %q: %d %v", path, auth, resp.StatusCode, err)
		}
		return v
	}
	for _, tc := range []struct {
		path, auth, result, withheld string
	}{
		{"/v1/calls/k1", "Bearer agent-of-t_a/u1", `{"temp_c":9}`, ""},
		{"/v1/calls/k2", "Bearer agent-of-t_a/u1", "", ""},
	} {
		if v := view(srv, tc.path, tc.auth); compact(v.Result) != tc.result || v.ResultWithheld != tc.withheld {
			t.Errorf("GET %s as %q: result %s, withheld %q; want %s, %q", tc.path, tc.auth, v.Result, v.ResultWithheld, tc.result, tc.withheld)
		}
	}
	for _, auth := range []string{"Bearer agent-of-t_a/u2", "Bearer agent-of-t_a/"} {
		for _, path := range []string{"/v1/calls/k1", "/v1/calls/k2"} {
			resp := do(t, http.MethodGet, srv.URL+path, auth, "")
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusNotFound || strings.Contains(string(body), osloHash) || strings.Contains(string(body), "sha256:x") {
				t.Errorf("GET %s as %q (u1's call) = %d %s; want 404, nothing of the call", path, auth, resp.StatusCode, body)
			}
		}
	}

	noResults, ix2 := newAPI(t, &publisher{}, func(c *httpapi.Config) { c.Caller = agentOf })
	settledAs(ix2, "u1")("t_a/k1")
	if v := view(noResults, "/v1/calls/k1", "Bearer agent-of-t_a/u1"); v.Result != nil || v.ResultWithheld != httpapi.ResultNotServed {
		t.Errorf("without Results: result %s, withheld %q; want none, %q", v.Result, v.ResultWithheld, httpapi.ResultNotServed)
	}
	down, ix4 := newAPI(t, &publisher{}, func(c *httpapi.Config) { c.Caller, c.Results = agentOf, failingResults{} })
	settledAs(ix4, "u1")("t_a/k1")
	if v := view(down, "/v1/calls/k1", "Bearer agent-of-t_a/u1"); v.Result != nil || v.ResultWithheld != httpapi.ResultUnavailable {
		t.Errorf("with the results unreadable: result %s, withheld %q; want none, %q", v.Result, v.ResultWithheld, httpapi.ResultUnavailable)
	}
	for _, o := range []otherCallResults{{"c2", osloHash}, {"c1", "sha256:y"}} {
		other, ix5 := newAPI(t, &publisher{}, func(c *httpapi.Config) { c.Caller, c.Results = agentOf, o })
		settledAs(ix5, "u1")("t_a/k1")
		if v := view(other, "/v1/calls/k1", "Bearer agent-of-t_a/u1"); v.Result != nil || v.ResultWithheld != httpapi.ResultGone {
			t.Errorf("with a record of call %s, hash %s under the key: result %s, withheld %q; want none, %q", o.callID, o.hash, v.Result, v.ResultWithheld, httpapi.ResultGone)
		}
	}
	dev, ix3 := newAPI(t, &publisher{}, func(c *httpapi.Config) { c.Results = results })
	settledAs(ix3, "u1")("t_a/k1")
	if v := view(dev, "/v1/calls/k1?tenant_id=t_a", ""); compact(v.Result) != `{"temp_c":9}` {
		t.Errorf("without a Caller: result %s; want the call's", v.Result)
	}
}

// settled is a publisher's settle that has each published call succeed at
// once in ix.
func settled(ix *callindex.Index) func(key string) { return settledAs(ix, "") }

// settledAs is settled for calls made by user.
func settledAs(ix *callindex.Index, user string) func(key string) {
	return func(key string) {
		k, _ := ledger.ParseCallKey(key)
		var evs []ledger.Event
		for i, ty := range []statemachine.EventType{statemachine.EventRequested, statemachine.EventAuthorized, statemachine.EventExecuting, statemachine.EventSucceeded} {
			evs = append(evs, ledger.Event{EventID: string(ty), Type: ty, Seq: int64(i + 1), At: time.Now(), TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey, ArgumentsHash: osloHash, Attempt: 1})
		}
		evs[0].UserID, evs[0].CallID = user, "c1"
		_ = ix.Apply(evs)
	}
}

// blockingCalls answers every lookup once released, counting those
// waiting.
type blockingCalls struct {
	release chan struct{}
	waiting chan struct{}
}

func (b blockingCalls) Call(ctx context.Context, key ledger.CallKey) (callindex.Call, error) {
	b.waiting <- struct{}{}
	select {
	case <-b.release:
	case <-ctx.Done():
	}
	return callindex.Call{}, callindex.ErrNotFound
}

// A wait's looks are its tenant's lookups: with MaxLookupsPerTenant of
// them running, it does not query the store behind Calls, and answers
// 202 when the wait runs out.
func TestWaitLooksAreBoundedLookups(t *testing.T) {
	calls := blockingCalls{release: make(chan struct{}), waiting: make(chan struct{}, 8)}
	pub := &publisher{}
	srv, _ := newAPI(t, pub, func(c *httpapi.Config) { c.Calls, c.Caller, c.MaxLookupsPerTenant = calls, agentOf, 1 })
	held := make(chan int, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+"/v1/calls/k", nil)
		req.Header.Set("Authorization", "Bearer agent-of-t_a/u1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err) // not Fatal: not the test's goroutine
			calls.waiting <- struct{}{}
			held <- 0
			return
		}
		resp.Body.Close()
		held <- resp.StatusCode
	}()
	<-calls.waiting // t_a's one lookup is running
	resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=300ms", "Bearer agent-of-t_a/u1", validEnvelope(t, "k1"))
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Errorf("POST ?wait while t_a's lookups run = %d; want 202 once the wait ran out", resp.StatusCode)
	}
	if n := len(calls.waiting); n != 0 {
		t.Errorf("the wait queried the store %d times past the bound; want 0", n)
	}
	close(calls.release)
	if code := <-held; code != http.StatusNotFound {
		t.Errorf("the held lookup answered %d; want 404", code)
	}
}

// bigCalls answers every key with a call whose view is megabytes long
// (events with long details): more than a connection's buffers hold.
type bigCalls struct{}

func (bigCalls) Call(_ context.Context, key ledger.CallKey) (callindex.Call, error) {
	c := callindex.Call{Key: key, State: statemachine.StateAuthorized, Seq: 2}
	detail := strings.Repeat("x", 1<<12)
	for i := range 4096 {
		c.Events = append(c.Events, ledger.Event{EventID: fmt.Sprint("e", i), Type: statemachine.EventRequested, Seq: 1,
			TenantID: key.TenantID, IdempotencyKey: key.IdempotencyKey, UserID: "u1", Detail: detail})
	}
	return c, nil
}

// A lookup's slot is given back once the store answered, not once the
// answer is written: an agent that asks and never reads does not hold
// its tenant's lookups, and the tenant's next GET goes through. Before,
// the slot was held while the answer was written, and eight such agents
// had every other agent of the tenant answered 429.
func TestLookupSlotNotHeldByASlowReader(t *testing.T) {
	srv, _ := newAPI(t, &publisher{}, func(c *httpapi.Config) {
		c.Calls, c.Caller, c.MaxLookupsPerTenant = bigCalls{}, agentOf, 1
	})
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Asks, and never reads the answer.
	fmt.Fprintf(conn, "GET /v1/calls/k HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer agent-of-t_a/u1\r\n\r\n")
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		resp := do(t, http.MethodGet, srv.URL+"/v1/calls/k2", "Bearer agent-of-t_a/u1", "")
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("a second lookup of t_a while the first's answer is unread: %d; want 200", resp.StatusCode)
		}
		return nil
	})
}

// settledBigCalls answers every key with bigCalls' call, settled as
// validEnvelope's: the answer of its POST ?wait=.
type settledBigCalls struct{}

func (settledBigCalls) Call(ctx context.Context, key ledger.CallKey) (callindex.Call, error) {
	c, err := bigCalls{}.Call(ctx, key)
	c.State = statemachine.StateSucceeded
	for i := range c.Events {
		c.Events[i].CallID, c.Events[i].ArgumentsHash = "c1", osloHash
	}
	return c, err
}

// stuckCalls is an index whose every look runs until its context ends (a
// slow ClickHouse); started says a look began.
type stuckCalls struct{ started chan struct{} }

func (c stuckCalls) Call(ctx context.Context, _ ledger.CallKey) (callindex.Call, error) {
	select {
	case c.started <- struct{}{}:
	default:
	}
	<-ctx.Done()
	return callindex.Call{}, ctx.Err()
}

// EndWaits ends a wait whose look is running too, answered 202 with its
// status URL: a shutdown's grace (5 s) is shorter than a look's bound, and
// a wait still looking was cut by it, its agent getting a reset.
func TestEndWaitsEndsARunningLook(t *testing.T) {
	calls := stuckCalls{started: make(chan struct{}, 1)}
	api, err := httpapi.New(httpapi.Config{Publisher: &publisher{}, Calls: calls, Caller: agentOf})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	answered := make(chan *http.Response, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/calls?wait=30s", strings.NewReader(validEnvelope(t, "k")))
		req.Header.Set("Authorization", "Bearer agent-of-t_a/u1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			resp = &http.Response{StatusCode: 0, Status: err.Error(), Body: io.NopCloser(strings.NewReader(""))}
		}
		answered <- resp
	}()
	// The look for earlier refusals before publishing (bounded to 2 s),
	// then the wait's first look, running when EndWaits comes.
	<-calls.started
	<-calls.started
	api.EndWaits()
	select {
	case resp := <-answered:
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted {
			t.Errorf("the wait ended while looking: %s; want 202 with its status URL", resp.Status)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the wait still looks 10 s after EndWaits; want it answered 202 at once")
	}
}

// An answer that its agent does not read, GET's or POST ?wait='s, is
// written for WriteTimeout at most: then the server gives up and closes
// the connection. Before, the agents' answers had no write deadline (nor
// did ledger api's server), and an agent asking again and again without
// reading held an encoded view, a goroutine and a connection per request
// for good.
func TestAnswerWriteBounded(t *testing.T) {
	for _, tc := range []struct {
		name    string
		calls   httpapi.Calls
		request string
	}{
		{"GET", bigCalls{}, "GET /v1/calls/k HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer agent-of-t_a/u1\r\n\r\n"},
		{"POST ?wait=", settledBigCalls{}, fmt.Sprintf("POST /v1/calls?wait=10s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer agent-of-t_a/u1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
			len(validEnvelope(t, "k")), validEnvelope(t, "k"))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			api, err := httpapi.New(httpapi.Config{Publisher: &publisher{}, Calls: tc.calls, Caller: agentOf, WriteTimeout: 200 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewUnstartedServer(api)
			closed := make(chan struct{})
			srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
				if s == http.StateClosed {
					close(closed) // the one connection of the test
				}
			}
			srv.Start()
			t.Cleanup(srv.Close)
			conn, err := net.Dial("tcp", srv.Listener.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			// Asks, and never reads the answer.
			if _, err := io.WriteString(conn, tc.request); err != nil {
				t.Fatal(err)
			}
			select {
			case <-closed:
			case <-time.After(10 * time.Second):
				t.Fatal("the server still writes an unread answer 10s on; want it given up after WriteTimeout (200ms)")
			}
		})
	}
}

// An invalid ?wait= is refused 400 invalid_wait before anything is
// published, and GET, which does not wait, refuses one too. Before, both
// took it as no wait: POST ?wait=30 published and answered 202 at once.
func TestInvalidWaitRefused(t *testing.T) {
	pub := &publisher{}
	srv, _ := newAPI(t, pub)
	for _, tc := range []struct{ name, method, path string }{
		{"no unit", http.MethodPost, "/v1/calls?wait=30"},
		{"not a duration", http.MethodPost, "/v1/calls?wait=abc"},
		{"negative", http.MethodPost, "/v1/calls?wait=-1s"},
		{"on GET", http.MethodGet, "/v1/calls/k1?tenant_id=t_a&wait=10s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := do(t, tc.method, srv.URL+tc.path, "", validEnvelope(t, "k1"))
			if code, _ := decodeErr(t, resp); resp.StatusCode != http.StatusBadRequest || code != "invalid_wait" {
				t.Errorf("%s %s = %d %s; want 400 invalid_wait", tc.method, tc.path, resp.StatusCode, code)
			}
		})
	}
	if keys := pub.published(); len(keys) != 0 {
		t.Errorf("published %v; want nothing", keys)
	}
	// No wait, or none asked for, still publishes and answers 202.
	for _, path := range []string{"/v1/calls", "/v1/calls?wait=", "/v1/calls?wait=0s"} {
		resp := do(t, http.MethodPost, srv.URL+path, "", validEnvelope(t, "k1"))
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted {
			t.Errorf("POST %s = %d; want 202", path, resp.StatusCode)
		}
	}
}

// The agents' lookups are bounded per tenant: with MaxLookupsPerTenant
// of a tenant's running, one more is answered 429 too_many_lookups, and
// another tenant's still runs. Before, every agent's GET was a store
// query with no bound but its timeout.
func TestAgentLookupsBoundedPerTenant(t *testing.T) {
	calls := blockingCalls{release: make(chan struct{}), waiting: make(chan struct{}, 8)}
	srv, _ := newAPI(t, &publisher{}, func(c *httpapi.Config) {
		c.Calls, c.MaxLookupsPerTenant = calls, 2
		c.Caller = agentOf
	})
	get := func(tenant string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, srv.URL+"/v1/calls/k", nil)
		req.Header.Set("Authorization", "Bearer agent-of-"+tenant)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			return nil
		}
		resp.Body.Close()
		return resp
	}
	done := make(chan int, 3)
	for _, tenant := range []string{"t_a", "t_a", "t_b"} {
		go func() {
			if resp := get(tenant); resp != nil {
				done <- resp.StatusCode
			}
		}()
	}
	for range 3 {
		<-calls.waiting // t_a's two and t_b's one are running
	}
	if resp := get("t_a"); resp == nil || resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "1" {
		t.Errorf("a third lookup of t_a while two run: %v; want 429 with Retry-After 1", resp)
	}
	close(calls.release)
	for range 3 {
		if code := <-done; code != http.StatusNotFound {
			t.Errorf("a lookup within the bound answered %d; want 404 (nothing there)", code)
		}
	}
}

// envelopeOf is validEnvelope's call for tenant.
func envelopeOf(t *testing.T, tenant, key string) string {
	t.Helper()
	tree, _ := ledger.Decode([]byte(`{"city":"Oslo"}`), ledger.Limits{})
	hash, err := ledger.ArgumentsHash(tenant, "get_weather", 1, tree)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(map[string]any{
		"tool": "get_weather", "tool_version": 1, "call_id": "c1", "arguments": map[string]any{"city": "Oslo"},
		"scope": map[string]any{"tenant_id": tenant}, "idempotency_key": key, "arguments_hash": hash,
	})
	return string(b)
}

// A tenant's submissions are bounded by its own budget: past it, 429
// too_many_submissions with Retry-After and nothing published, while
// another tenant's go on; a malformed envelope is charged too, an
// anonymous request to no one (it is refused before its body is read);
// the budget refills.
func TestSubmitsBoundedPerTenant(t *testing.T) {
	pub := &publisher{}
	srv, _ := newAPI(t, pub, func(c *httpapi.Config) {
		c.Caller, c.SubmitRate, c.SubmitBurst = agentOf, 1, 3
	})
	post := func(auth, body string) (int, string, *http.Response) {
		t.Helper()
		resp := do(t, http.MethodPost, srv.URL+"/v1/calls", auth, body)
		code, _ := decodeErr(t, resp)
		return resp.StatusCode, code, resp
	}
	for i := range 5 {
		// Read before the bearer, the body would be answered 400.
		if status, code, _ := post("", "{not json"); status != http.StatusUnauthorized {
			t.Fatalf("anonymous malformed submission %d = %d %s; want 401, the bearer checked first", i, status, code)
		}
	}
	for i, body := range []string{envelopeOf(t, "t_a", "k1"), "{not json", envelopeOf(t, "t_a", "k2")} {
		if status, code, _ := post("Bearer agent-of-t_a/u1", body); status == http.StatusTooManyRequests {
			t.Fatalf("t_a's submission %d within its burst of 3 = %d %s", i, status, code)
		}
	}
	status, code, resp := post("Bearer agent-of-t_a/u1", envelopeOf(t, "t_a", "k3"))
	if status != http.StatusTooManyRequests || code != "too_many_submissions" || resp.Header.Get("Retry-After") != "1" {
		t.Fatalf("t_a's fourth submission at 1/s, burst 3 = %d %s, Retry-After %q; want 429 too_many_submissions, Retry-After 1", status, code, resp.Header.Get("Retry-After"))
	}
	if got := pub.published(); !slices.Equal(got, []string{"t_a/k1", "t_a/k2"}) {
		t.Fatalf("published %v; want t_a/k1 and t_a/k2 alone", got)
	}
	if status, code, _ := post("Bearer agent-of-t_b/u1", envelopeOf(t, "t_b", "k1")); status != http.StatusAccepted {
		t.Fatalf("t_b's first submission while t_a is past its budget = %d %s; want 202", status, code)
	}
	time.Sleep(time.Second) // Retry-After
	if status, code, _ := post("Bearer agent-of-t_a/u1", envelopeOf(t, "t_a", "k3")); status != http.StatusAccepted {
		t.Fatalf("t_a's submission after Retry-After = %d %s; want 202", status, code)
	}
}

// Without a Caller (ledger dev), the budget is the envelope's tenant's;
// a negative SubmitRate bounds nothing.
func TestSubmitsBoundedByEnvelopeTenant(t *testing.T) {
	pub := &publisher{}
	srv, _ := newAPI(t, pub, func(c *httpapi.Config) { c.SubmitRate, c.SubmitBurst = 1, 1 })
	for _, tc := range []struct {
		tenant, key string
		want        int
	}{{"t_a", "k1", http.StatusAccepted}, {"t_a", "k2", http.StatusTooManyRequests}, {"t_b", "k1", http.StatusAccepted}} {
		resp := do(t, http.MethodPost, srv.URL+"/v1/calls", "", envelopeOf(t, tc.tenant, tc.key))
		if code, _ := decodeErr(t, resp); resp.StatusCode != tc.want {
			t.Errorf("submission of %s/%s = %d %s; want %d", tc.tenant, tc.key, resp.StatusCode, code, tc.want)
		}
	}

	unbounded, _ := newAPI(t, &publisher{}, func(c *httpapi.Config) { c.SubmitRate = -1 })
	for i := range 3 * httpapi.DefaultSubmitRate {
		resp := do(t, http.MethodPost, unbounded.URL+"/v1/calls", "", envelopeOf(t, "t_a", fmt.Sprint("k", i)))
		if code, _ := decodeErr(t, resp); resp.StatusCode != http.StatusAccepted {
			t.Fatalf("submission %d with no bound = %d %s; want 202", i, resp.StatusCode, code)
		}
	}
}

// cuttingCalls holds a key's refusals and cuts them as the ClickHouse
// trace does (projections.KeepRefusals): across every user's through
// Call, across the user's alone through UserCall.
type cuttingCalls struct {
	mu       sync.Mutex
	refusals []ledger.Event // by time
	byUser   atomic.Int32   // UserCall's reads
}

func (c *cuttingCalls) add(evs ...ledger.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.refusals = append(c.refusals, evs...)
}

func (c *cuttingCalls) Call(ctx context.Context, key ledger.CallKey) (callindex.Call, error) {
	return c.cut(key, func(ledger.Event) bool { return true })
}

func (c *cuttingCalls) UserCall(ctx context.Context, key ledger.CallKey, user string) (callindex.Call, error) {
	c.byUser.Add(1)
	return c.cut(key, func(e ledger.Event) bool { return e.UserID == user })
}

func (c *cuttingCalls) cut(key ledger.CallKey, keep func(ledger.Event) bool) (callindex.Call, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var refused []ledger.Event
	for _, e := range c.refusals {
		if e.Key() == key && keep(e) {
			refused = append(refused, e)
		}
	}
	if len(refused) == 0 {
		return callindex.Call{}, callindex.ErrNotFound
	}
	return callindex.Call{Key: key, Refusals: projections.KeepRefusals(refused)}, nil
}

// Another user of the tenant flooding a key with refused envelopes does
// not push an agent's own refusal out of its wait or its GET: read
// through UserCalls, the refusals are cut among the agent's user's alone.
// Cut among every user's, the flood after it left it out of both.
func TestAnotherUsersFloodKeepsOwnRefusalInView(t *testing.T) {
	calls := &cuttingCalls{}
	pub := &publisher{}
	srv, _ := newAPI(t, pub, func(c *httpapi.Config) { c.Caller, c.Calls = agentOf, calls })
	refusal := func(id, user string, at time.Time) ledger.Event {
		return ledger.Event{EventID: id, Type: statemachine.EventDenied, At: at, TenantID: "t_a", IdempotencyKey: "k1", CallID: "c1",
			UserID: user, Reason: "invalid_arguments", Pointer: "/arguments/city"}
	}
	flood := func(from time.Time, prefix string) (evs []ledger.Event) {
		for i := range projections.MaxRefusals {
			evs = append(evs, refusal(fmt.Sprintf("%s-%03d", prefix, i), "u_flood", from.Add(time.Duration(i+1)*time.Microsecond)))
		}
		return evs
	}
	calls.add(flood(time.Now().Add(-time.Minute), "before")...)
	pub.settle = func(string) {
		// Refused, then flooded past before the wait's first look.
		now := time.Now()
		calls.add(append([]ledger.Event{refusal("r-own", "u_own", now)}, flood(now, "after")...)...)
	}
	resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=2s", "Bearer agent-of-t_a/u_own", validEnvelope(t, "k1"))
	var waited httpapi.CallView
	_ = json.NewDecoder(resp.Body).Decode(&waited)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || waited.Refused == nil || waited.Refused.EventID != "r-own" {
		t.Errorf("POST ?wait as u_own, refused, then %d refusals of u_flood: %d, refused %+v; want 200 with r-own", projections.MaxRefusals, resp.StatusCode, waited.Refused)
	}
	resp = do(t, http.MethodGet, srv.URL+"/v1/calls/k1", "Bearer agent-of-t_a/u_own", "")
	var got httpapi.CallView
	_ = json.NewDecoder(resp.Body).Decode(&got)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || len(got.Refusals) != 1 || got.Refusals[0].EventID != "r-own" {
		t.Errorf("GET as u_own after the flood = %d with %d refusals; want 200 with r-own alone", resp.StatusCode, len(got.Refusals))
	}
	if calls.byUser.Load() == 0 {
		t.Error("the agent's reads never went through UserCall")
	}
}

// A refusal of another copy of the call (its call id sent again with
// other bytes: a fresh assertion, say), dated after this submission, is
// no answer to it: the wait goes on, and answers with the call this copy
// joined once it settled. This copy's own refusal still answers it.
// Before, any refusal of the call id did, and an agent was told its call
// was refused while it ran.
func TestWaitPassesOverAnotherCopysRefusal(t *testing.T) {
	pub := &publisher{}
	srv, ix := newAPI(t, pub)
	refusal := func(key, id, digest string) ledger.Event {
		return ledger.Event{EventID: id, Type: statemachine.EventDenied, At: time.Now(), TenantID: "t_a", IdempotencyKey: key, CallID: "c1",
			Reason: "assertion_expired", Pointer: "/assertion", RequestDigest: digest}
	}
	wait := func(body string) httpapi.CallView {
		t.Helper()
		resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=5s", "", body)
		var v httpapi.CallView
		_ = json.NewDecoder(resp.Body).Decode(&v)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("POST ?wait = %d; want 200", resp.StatusCode)
		}
		return v
	}
	body := validEnvelope(t, "k8")
	pub.settle = func(key string) {
		_ = ix.Apply([]ledger.Event{refusal("k8", "other-copy", ledger.RequestDigest([]byte(body+" ")))})
		time.Sleep(100 * time.Millisecond) // looked at meanwhile
		settledAs(ix, "")(key)
	}
	if v := wait(body); v.Refused != nil || v.State != string(statemachine.StateSucceeded) {
		t.Errorf("POST ?wait with another copy refused meanwhile: refused %+v, state %q; want the call succeeded", v.Refused, v.State)
	}

	// This copy's own refusal answers it; so does one naming no copy
	// (an older build's).
	for i, named := range []bool{true, false} {
		key := fmt.Sprint("k8-", i)
		body := validEnvelope(t, key)
		digest := ""
		if named {
			digest = ledger.RequestDigest([]byte(body))
		}
		pub.settle = func(string) { _ = ix.Apply([]ledger.Event{refusal(key, "this-copy", digest)}) }
		if v := wait(body); v.Refused == nil || v.Refused.EventID != "this-copy" {
			t.Errorf("POST ?wait, refused naming request %q: refused %+v; want that refusal", digest, v.Refused)
		}
	}
}

// A bearer, or an envelope's assertion, that cannot be verified now (the
// issuer's keys stale here, or its kid not looked for in keys loaded
// since it came) is answered 503 keys_unavailable with a Retry-After (the
// verifier's, in whole seconds rounded up), nothing published, which
// clients send again: not 401 or 400, which said the agent's assertion
// was bad.
func TestStaleKeysAnswerTryLater(t *testing.T) {
	unknownKID := &httpapi.CannotVerifyNowError{Reason: "unknown_kid", RetryAfter: 1500 * time.Millisecond}
	for _, tc := range []struct {
		name       string
		edit       func(*httpapi.Config)
		retryAfter string
	}{
		{"the bearer", func(c *httpapi.Config) {
			c.Caller = func(*http.Request) (httpapi.Agent, error) { return httpapi.Agent{}, httpapi.ErrCannotVerifyNow }
		}, "30"},
		{"the envelope's assertion", func(c *httpapi.Config) {
			c.Caller = agentOf
			c.Assertion = func(context.Context, string) (httpapi.Agent, error) {
				return httpapi.Agent{}, httpapi.ErrCannotVerifyNow
			}
		}, "30"},
		{"the bearer's unknown kid", func(c *httpapi.Config) {
			c.Caller = func(*http.Request) (httpapi.Agent, error) { return httpapi.Agent{}, unknownKID }
		}, "2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub := &publisher{}
			srv, _ := newAPI(t, pub, tc.edit)
			resp := do(t, http.MethodPost, srv.URL+"/v1/calls", "Bearer agent-of-t_a/u1", validEnvelope(t, "k1"))
			code, _ := decodeErr(t, resp)
			if resp.StatusCode != http.StatusServiceUnavailable || code != "keys_unavailable" || resp.Header.Get("Retry-After") != tc.retryAfter {
				t.Errorf("= %d %s, Retry-After %q; want 503 keys_unavailable, Retry-After %s", resp.StatusCode, code, resp.Header.Get("Retry-After"), tc.retryAfter)
			}
			if got := pub.published(); len(got) != 0 {
				t.Errorf("published %v; want nothing", got)
			}
			if !httpapi.IsTransient(&httpapi.APIError{Status: resp.StatusCode, Code: code}) {
				t.Error("clients do not send it again")
			}
		})
	}
}

// Submissions waiting (?wait=) are bounded per tenant, as lookups are:
// one more is published and answered 202 at once, saying why it did not
// wait, and its status_url is the bounded lookup. Before, only their rate
// was bounded: an agent resending a call that waits for approval held
// thousands of connections for 30 s each. Answers carry no-store: their
// tenant is the bearer's, which their URL does not name.
func TestWaitsBounded(t *testing.T) {
	pub := &publisher{}
	srv, _ := newAPI(t, pub, func(c *httpapi.Config) {
		c.Caller, c.MaxWaitsPerTenant, c.MaxWait = agentOf, 1, 2*time.Second
	})
	type answer struct {
		code    int
		skipped string
	}
	post := func(key string) answer {
		resp := do(t, http.MethodPost, srv.URL+"/v1/calls?wait=2s", "Bearer agent-of-t_a/u1", validEnvelope(t, key))
		defer resp.Body.Close()
		var body map[string]string
		_ = json.NewDecoder(resp.Body).Decode(&body)
		if cc, vary := resp.Header.Get("Cache-Control"), resp.Header.Get("Vary"); cc != "no-store" || vary != "Authorization" {
			t.Errorf("POST %s: Cache-Control %q, Vary %q; want no-store, Authorization", key, cc, vary)
		}
		return answer{resp.StatusCode, body["wait_skipped"]}
	}
	first := make(chan answer, 1)
	go func() { first <- post("w1") }()
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if len(pub.published()) < 1 {
			return errors.New("the first submission is not published yet")
		}
		return nil
	})
	if got := post("w2"); got.code != http.StatusAccepted || !strings.HasPrefix(got.skipped, "too_many_waits") {
		t.Errorf("a second wait of t_a: %d, wait_skipped %q; want 202 at once, too_many_waits", got.code, got.skipped)
	}
	if n := len(pub.published()); n != 2 {
		t.Errorf("%d submissions published; want 2, the one that did not wait too", n)
	}
	if got := <-first; got.code != http.StatusAccepted || got.skipped != "" {
		t.Errorf("the first wait: %d, wait_skipped %q; want 202 once it ran out, not skipped", got.code, got.skipped)
	}
	// Its slot given back, the next one waits.
	if got := post("w3"); got.skipped != "" {
		t.Errorf("a wait after the first ended: wait_skipped %q; want it waited", got.skipped)
	}
}
