package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// keyedProducer is a client that places keyed records as the ledger's
// producers do, closed when the test ends.
func keyedProducer(t *testing.T, cc ledger.ClientConfig) *kgo.Client {
	t.Helper()
	producer, err := ledger.NewClient(cc, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(producer.Close)
	return producer
}

// eventAppender stands in for the intake: what it returns appends events
// to topic, each to its key's partition.
func eventAppender(t *testing.T, cc ledger.ClientConfig, topic string) func(context.Context, ...ledger.Event) error {
	t.Helper()
	producer := keyedProducer(t, cc)
	return func(ctx context.Context, evs ...ledger.Event) error {
		for _, e := range evs {
			rec, err := e.Record(topic)
			if err != nil {
				return err
			}
			if err := producer.ProduceSync(ctx, rec).FirstErr(); err != nil {
				return err
			}
		}
		return nil
	}
}

// TestSubmitWaitAfterResend: what submit --wait says when its wait ends
// after it sent the envelope again. A resend that failed is said as it
// failed, even with a deadline of its own (not as the call not settling);
// a resend admitted, whose call still runs at --timeout, leaves the call's
// state said, not the refusal it answered.
func TestSubmitWaitAfterResend(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	appendEvents := eventAppender(t, cc, topics.Events)
	refusedForNow := func(key ledger.CallKey) ledger.Event {
		return ledger.Event{V: 1, EventID: "refusal-" + key.IdempotencyKey, Type: statemachine.EventDenied, TenantID: key.TenantID,
			IdempotencyKey: key.IdempotencyKey, CallID: "call-" + key.IdempotencyKey, Reason: "rate_limited", RetryAfterMS: 10, At: time.Now()}
	}
	wait := func(key ledger.CallKey, timeout time.Duration, publish func(context.Context) error) error {
		w, err := newCallWait(t.Context(), cc, topics.Events, key, "call-"+key.IdempotencyKey, []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		w.lastSent = time.Now()
		if err := appendEvents(t.Context(), refusedForNow(key)); err != nil {
			t.Fatal(err)
		}
		return w.run(t.Context(), &submitFlags{retryLater: 3, timeout: timeout}, io.Discard, publish)
	}

	// The resend's publish ran out of its own time.
	stuck := fmt.Errorf("publish to %s: %w", topics.Requests, context.DeadlineExceeded)
	if err := wait(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "stuck"}, time.Minute, func(context.Context) error { return stuck }); !errors.Is(err, stuck) {
		t.Errorf("a resend that failed: %v; want %v", err, stuck)
	}

	// The resend is admitted; the call is requested, and goes no further.
	running := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "running"}
	// Its --timeout leaves a loaded machine time to read the refusal and
	// send again: the wait lasts all of it.
	err := wait(running, 8*time.Second, func(ctx context.Context) error {
		return appendEvents(ctx, ledger.Event{V: 1, EventID: "requested-running", Seq: 1, Type: statemachine.EventRequested,
			TenantID: running.TenantID, IdempotencyKey: running.IdempotencyKey, CallID: "call-running", ArgumentsHash: "h", At: time.Now()})
	})
	if err == nil || !strings.Contains(err.Error(), `(state "requested")`) || strings.Contains(err.Error(), "refusal") {
		t.Errorf("a resend admitted, its call still running at --timeout: %v; want the call's state said", err)
	}
}

// submit with no --assertion and no dev issuer in --data-dir (a ledger dev
// run on another one, or none yet) says so and publishes nothing; nor
// does submit --file given an --assertion it would ignore. Before,
// it published the envelope without an assertion, for the ledger to refuse
// it (assertion_missing), and --wait printed only that refusal; an
// unreadable issuer key went unsaid the same way.
func TestSubmitWithoutAnAssertionPublishesNothing(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	dir := t.TempDir()
	err := cliErr(t, append(roleArgs(cc, topics), "submit", "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`, "--wait", "--timeout", "5s")...)
	if err == nil || !strings.Contains(err.Error(), "no identity assertion: pass --assertion") || !strings.Contains(err.Error(), "run `ledger dev --data-dir "+dir+"` once first") {
		t.Errorf("submit without an assertion or a dev issuer: %v; want it to say how to get one", err)
	}
	// --file's envelope goes as is: an --assertion beside it, which it
	// ignored, is refused.
	file := filepath.Join(dir, "envelope.json")
	if err := os.WriteFile(file, []byte(`{"tool":"get_weather","arguments":{"city":"Oslo"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	err = cliErr(t, append(roleArgs(cc, topics), "submit", "--file", file, "--assertion", "a.b.c")...)
	if err == nil || !strings.Contains(err.Error(), "--assertion: for an envelope built from the flags") {
		t.Errorf("submit --file --assertion: %v; want it refused, saying --file's envelope is sent as is", err)
	}
	// So is every other flag that builds an envelope: the call went with
	// the file's key and deadline, and --wait could print an earlier
	// call's outcome under that key.
	err = cliErr(t, append(roleArgs(cc, topics), "submit", "--file", file, "--key", "retry-2", "--deadline", "15m")...)
	if err == nil || !strings.Contains(err.Error(), "--key, --deadline: for an envelope built from the flags") {
		t.Errorf("submit --file --key --deadline: %v; want both refused", err)
	}
	nothingPublished(t, cc, topics.Requests)
}

// nothingPublished fails t unless topic is empty.
func nothingPublished(t *testing.T, cc ledger.ClientConfig, topic string) {
	t.Helper()
	cl, err := ledger.NewClient(cc)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListEndOffsets(t.Context(), topic)
	if err != nil {
		t.Fatal(err)
	}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset != 0 {
			t.Errorf("%s partition %d ends at %d; want nothing published", o.Topic, o.Partition, o.Offset)
		}
	})
}

// submit refuses, before publishing, a --key the envelope schema refuses
// (the intake put such an envelope on the DLQ, and --wait waited out its
// --timeout), and an unreadable --file envelope with --wait, saying why;
// without --wait such an envelope still goes as is, and is said to be
// bound for the DLQ, not "published / (call_id )".
func TestSubmitRefusesAKeyTheLedgerWouldNot(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	dir := t.TempDir()
	for _, key := range []string{".", "..", strings.Repeat("k", 256), " lead", "caf\u00e9"} {
		err := cliErr(t, append(roleArgs(cc, topics), "submit", "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`, "--key", key, "--wait", "--timeout", "5s")...)
		if err == nil || !strings.Contains(err.Error(), "an idempotency key is 1 to 255 printable ASCII characters") {
			t.Errorf("submit --key %q: %v; want the key refused", key, err)
		}
	}
	// A tenant or a call id the intake cannot read sends the envelope
	// to the DLQ alike: refused before publishing, waiting or not.
	devIssuerKeys(t, dir)
	for _, args := range [][]string{
		{"--tenant", "acme/eu"},
		{"--tenant", strings.Repeat("t", 129)},
		{"--call-id", strings.Repeat("c", 256)},
	} {
		err := cliErr(t, append(append(roleArgs(cc, topics), "submit", "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`), args...)...)
		if err == nil || !strings.Contains(err.Error(), "would put the envelope on the DLQ; nothing was published") {
			t.Errorf("submit %s: %v; want it refused before publishing", args, err)
		}
	}
	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"tool":"get_weather",`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := cliErr(t, append(roleArgs(cc, topics), "submit", "--file", bad, "--wait", "--timeout", "5s")...); err == nil || !strings.Contains(err.Error(), "not JSON") {
		t.Errorf("submit --file (not JSON) --wait: %v; want it said to be no JSON", err)
	}
	nothingPublished(t, cc, topics.Requests)
	if out := cli(t, append(roleArgs(cc, topics), "submit", "--file", bad)...); !strings.Contains(out, "the intake puts it on the DLQ") {
		t.Errorf("submit --file (not JSON):\n%s\nwant it said to be bound for the DLQ", out)
	}
}

// submit --wait through Kafka does not take a call settled under the key
// with other arguments (an earlier one), nor one of another user with the
// same arguments, for its answer: it waits for its own submission's
// refusal (idempotency_key_reused), as through the API. Before, it folded
// the other call's events and printed its outcome: for another user's
// call, with its result hash and credential, where the refusal is said
// in the same words whatever the arguments.
func TestSubmitWaitPassesOverAnEarlierCall(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	appendEvents := eventAppender(t, cc, topics.Events)
	for _, tc := range []struct {
		name, key, hash, user, body string
	}{
		{"other arguments", "reused", "sha256:earlier", "u_1", `{"arguments_hash":"sha256:now"}`},
		{"another user", "reused-by-u_2", "sha256:now", "u_1", `{"arguments_hash":"sha256:now","scope":{"user_id":"u_2"}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: tc.key}
			var earlier []ledger.Event
			for i, ty := range []statemachine.EventType{statemachine.EventRequested, statemachine.EventAuthorized, statemachine.EventExecuting, statemachine.EventSucceeded} {
				earlier = append(earlier, ledger.Event{V: 1, EventID: "earlier-" + string(ty), Seq: int64(i + 1), Type: ty, TenantID: key.TenantID,
					IdempotencyKey: key.IdempotencyKey, CallID: "call-earlier", UserID: tc.user, ArgumentsHash: tc.hash, Attempt: 1, At: time.Now()})
			}
			if err := appendEvents(t.Context(), earlier...); err != nil {
				t.Fatal(err)
			}
			w, err := newCallWait(t.Context(), cc, topics.Events, key, "call-now", []byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			// The earlier call folds to succeeded: what the wait would take
			// for its answer, were it not another call.
			call := statemachine.Call{}
			for _, e := range earlier {
				if call, _, err = statemachine.Apply(call, e.Transition()); err != nil {
					t.Fatal(err)
				}
			}
			if call.State != statemachine.StateSucceeded {
				t.Fatalf("the earlier call folds to %s; the test needs it settled", call.State)
			}
			w.lastSent = time.Now()
			// The intake's refusal of this submission, after it went out.
			if err := appendEvents(t.Context(), ledger.Event{V: 1, EventID: "refusal-now", Type: statemachine.EventDenied, TenantID: key.TenantID,
				IdempotencyKey: key.IdempotencyKey, CallID: "call-now", ArgumentsHash: "sha256:now", Reason: "idempotency_key_reused", Pointer: "/arguments_hash", At: time.Now()}); err != nil {
				t.Fatal(err)
			}
			var out strings.Builder
			if err := w.run(t.Context(), &submitFlags{timeout: 20 * time.Second}, &out, func(context.Context) error { return nil }); err != nil {
				t.Fatalf("wait: %v", err)
			}
			if w.last == nil || w.last.EventID != "refusal-now" || strings.Contains(out.String(), "succeeded") {
				t.Errorf("the wait ended on %+v, printing:\n%s\nwant this submission's refusal, and nothing of the earlier call", w.last, out.String())
			}
		})
	}
}

// apiLedger plays the ledger behind a real API for submit --api: the
// first envelope is refused for now (rate_limited); after the second,
// the call index fails for a while, as a store behind the API might,
// then shows the call running, and only later settled, all after the
// API's wait ran out.
type apiLedger struct {
	ix *callindex.Index

	mu      sync.Mutex
	sent    int
	failing bool
}

func (l *apiLedger) Publish(_ context.Context, key, value []byte) error {
	k, env, err := published(key, value)
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sent++
	switch l.sent {
	case 1:
		time.AfterFunc(50*time.Millisecond, func() {
			_ = l.ix.Apply([]ledger.Event{{EventID: "now", Type: statemachine.EventDenied, At: time.Now(), TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey,
				CallID: env.CallID, Reason: "rate_limited", RetryAfterMS: 200}})
		})
	case 2:
		l.failing = true
		var evs []ledger.Event
		for i, ty := range []statemachine.EventType{statemachine.EventRequested, statemachine.EventAuthorized, statemachine.EventExecuting, statemachine.EventSucceeded} {
			evs = append(evs, ledger.Event{EventID: string(ty), Type: ty, Seq: int64(i + 1), At: time.Now(), TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey,
				CallID: env.CallID, UserID: env.Scope.UserID, ArgumentsHash: env.ArgumentsHash, Attempt: 1})
		}
		time.AfterFunc(600*time.Millisecond, func() {
			_ = l.ix.Apply(evs[:3]) // running: answered 200, not settled
			l.mu.Lock()
			l.failing = false
			l.mu.Unlock()
			time.AfterFunc(600*time.Millisecond, func() { _ = l.ix.Apply(evs[3:]) })
		})
	}
	return nil
}

func (l *apiLedger) Call(ctx context.Context, key ledger.CallKey) (callindex.Call, error) {
	l.mu.Lock()
	failing := l.failing
	l.mu.Unlock()
	if failing {
		return callindex.Call{}, errors.New("index unavailable")
	}
	return l.ix.Call(ctx, key)
}

// submit --api --wait through a real API (ledger dev's kind: no agents'
// authentication, the tenant in the query) whose wait is shorter than the
// call: a refusal for now is answered by sending again, a refusal under
// the key from an earlier submission with the same call id is passed
// over, the call is then polled for past the API's wait and through the
// API's failures (500), and printed once settled, not while it runs.
func TestSubmitThroughAPI(t *testing.T) {
	ix := tempIndex(t)
	l := &apiLedger{ix: ix}
	api, err := httpapi.New(httpapi.Config{Publisher: l, Calls: l, MaxWait: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	if err := ix.Apply([]ledger.Event{{EventID: "old", Type: statemachine.EventDenied, At: time.Now(), TenantID: "t_demo", IdempotencyKey: "k-api",
		CallID: "call_api", Reason: "policy_timeout", RetryAfterMS: 100}}); err != nil {
		t.Fatal(err)
	}
	out := cli(t, "submit", "--api", srv.URL, "--assertion", "a.b.c", "--tool", "get_weather", "--args", `{"city":"Oslo"}`,
		"--key", "k-api", "--call-id", "call_api", "--wait", "--timeout", "20s")
	for _, want := range []string{"refused for now: rate_limited; sending again in 200ms (1 of 3)", "seq 4  succeeded", "t_demo/k-api is succeeded", "result withheld: not_served"} {
		if !strings.Contains(out, want) {
			t.Errorf("submit --api --wait lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "policy_timeout") {
		t.Errorf("submit --api --wait answered the earlier submission's refusal:\n%s", out)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.sent != 2 {
		t.Errorf("sent %d envelopes; want 2 (one again after the refusal for now)", l.sent)
	}
}

// The commands that call the ledger's API with an assertion follow no
// redirect: an agent's (submit --api: as the bearer, and in the
// envelope), an approver's or operator's (approvals, control), a
// responder's (the queries); a redirect would send it on, to another host
// or in clear.
func TestAssertionsFollowNoRedirect(t *testing.T) {
	var mu sync.Mutex
	var reached []string
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		reached = append(reached, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		mu.Unlock()
	}))
	t.Cleanup(elsewhere.Close)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, elsewhere.URL+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	t.Cleanup(api.Close)
	for _, args := range [][]string{
		{"submit", "--api", api.URL, "--assertion", "a.b.c", "--tool", "get_weather", "--args", `{"city":"Oslo"}`},
		{"approvals", "list", "--api", api.URL, "--assertion", "a.b.c"},
		{"control", "show", "--api", api.URL, "--assertion", "a.b.c"},
		{"blast-radius", "--api", api.URL, "--assertion", "a.b.c", "--tool", "get_weather", "--tenant", "t_a"},
	} {
		if err := cliErr(t, args...); err == nil || !strings.Contains(err.Error(), "307") {
			t.Errorf("%s redirected: %v; want refused, naming the 307", strings.Join(args[:2], " "), err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(reached) != 0 {
		t.Errorf("the redirect's target was sent %v; want nothing", reached)
	}
}

// The commands that send an assertion to the API send it over http to
// loopback only: elsewhere they refuse before dialling (192.0.2.1, a
// documentation address, would not answer).
func TestAssertionsNeverInClear(t *testing.T) {
	const api = "http://192.0.2.1:8080"
	for _, args := range [][]string{
		{"submit", "--api", api, "--assertion", "a.b.c", "--tool", "get_weather", "--args", `{"city":"Oslo"}`},
		{"approvals", "list", "--api", api, "--assertion", "a.b.c"},
		{"control", "show", "--api", api, "--assertion", "a.b.c"},
		{"blast-radius", "--api", api, "--assertion", "a.b.c", "--tool", "get_weather", "--tenant", "t_a"},
	} {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		root := newRoot()
		root.SetArgs(args)
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		err := root.ExecuteContext(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "must be https off loopback") {
			t.Errorf("%s over http to 192.0.2.1: %v; want refused before sending, https off loopback", strings.Join(args[:2], " "), err)
		}
	}
}

// lateRefusal plays a ledger that refuses every envelope under a key
// already settled with other arguments, after the API's wait ran out.
type lateRefusal struct{ ix *callindex.Index }

func (l lateRefusal) Publish(_ context.Context, key, value []byte) error {
	k, env, err := published(key, value)
	if err != nil {
		return err
	}
	time.AfterFunc(900*time.Millisecond, func() {
		_ = l.ix.Apply([]ledger.Event{{EventID: "reused", Type: statemachine.EventDenied, At: time.Now(), TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey,
			CallID: env.CallID, Reason: "idempotency_key_reused", Pointer: "/arguments_hash"}})
	})
	return nil
}

// submit --api --wait, polling past the API's wait, does not take a call
// settled under the key with other arguments (an earlier one) for its
// answer: it waits for its own refusal.
func TestSubmitThroughAPIPassesOverAnEarlierCall(t *testing.T) {
	ix := tempIndex(t)
	var earlier []ledger.Event
	for i, ty := range []statemachine.EventType{statemachine.EventRequested, statemachine.EventAuthorized, statemachine.EventExecuting, statemachine.EventSucceeded} {
		earlier = append(earlier, ledger.Event{EventID: "e" + string(ty), Type: ty, Seq: int64(i + 1), At: time.Now(), TenantID: "t_demo", IdempotencyKey: "k-reused",
			CallID: "call_earlier", ArgumentsHash: "sha256:other", Attempt: 1})
	}
	if err := ix.Apply(earlier); err != nil {
		t.Fatal(err)
	}
	api, err := httpapi.New(httpapi.Config{Publisher: lateRefusal{ix}, Calls: ix, MaxWait: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	out := cli(t, "submit", "--api", srv.URL, "--assertion", "a.b.c", "--tool", "get_weather", "--args", `{"city":"Oslo"}`,
		"--key", "k-reused", "--call-id", "call_api", "--wait", "--timeout", "20s")
	if !strings.Contains(out, "refused: idempotency_key_reused at /arguments_hash") || strings.Contains(out, "is succeeded") {
		t.Errorf("submit --api --wait under a key settled with other arguments: want its own refusal, not the earlier call:\n%s", out)
	}
}

// settling plays a ledger that runs every envelope to success at once.
type settling struct{ ix *callindex.Index }

func (s settling) Publish(_ context.Context, key, value []byte) error {
	k, env, err := published(key, value)
	if err != nil {
		return err
	}
	var evs []ledger.Event
	for i, ty := range []statemachine.EventType{statemachine.EventRequested, statemachine.EventAuthorized, statemachine.EventExecuting, statemachine.EventSucceeded} {
		evs = append(evs, ledger.Event{EventID: "now-" + string(ty), Type: ty, Seq: int64(i + 1), At: time.Now(), TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey,
			CallID: env.CallID, UserID: env.Scope.UserID, ArgumentsHash: env.ArgumentsHash, Attempt: 1})
	}
	return s.ix.Apply(evs)
}

// failingFirst is calls, whose first lookup fails.
type failingFirst struct {
	calls httpapi.Calls
	n     atomic.Int32
}

func (f *failingFirst) Call(ctx context.Context, k ledger.CallKey) (callindex.Call, error) {
	if f.n.Add(1) == 1 {
		return callindex.Call{}, errors.New("clickhouse: connection reset")
	}
	return f.calls.Call(ctx, k)
}

// An earlier run's refusal of the same envelope (its call id) is not
// this submission's answer when the look at the refusals before it
// failed: submit --api --wait takes those dated before it for earlier
// ones, as the API does, and prints the call that settled. Before, it
// printed the old refusal.
func TestSubmitThroughAPIPassesOverAnOldRefusal(t *testing.T) {
	ix := tempIndex(t)
	old := ledger.Event{EventID: "old-refusal", Type: statemachine.EventDenied, At: time.Now().Add(-time.Hour), TenantID: "t_demo", IdempotencyKey: "k-again",
		CallID: "call_again", Decision: "deny", Reason: "rate_limited"}
	if err := ix.Apply([]ledger.Event{old}); err != nil {
		t.Fatal(err)
	}
	api, err := httpapi.New(httpapi.Config{Publisher: settling{ix}, Calls: &failingFirst{calls: ix}, MaxWait: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	out := cli(t, "submit", "--api", srv.URL, "--assertion", "a.b.c", "--tool", "get_weather", "--args", `{"city":"Oslo"}`,
		"--key", "k-again", "--call-id", "call_again", "--wait", "--timeout", "20s", "--retry-later", "0")
	if strings.Contains(out, "refused") || !strings.Contains(out, "succeeded") {
		t.Errorf("submit --api --wait after an old refusal of the same call id: want the call that settled:\n%s", out)
	}
}

// tempIndex is an embedded call index in a temporary file, closed at the
// end of the test.
func tempIndex(t *testing.T) *callindex.Index {
	t.Helper()
	ix, err := callindex.Open(filepath.Join(t.TempDir(), "ix.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ix.Close() })
	return ix
}

// publishedEnvelope is what the fake ledgers read of an envelope.
type publishedEnvelope struct {
	CallID        string `json:"call_id"`
	ArgumentsHash string `json:"arguments_hash"`
	// Scope.UserID stands for the user the intake would verify, which
	// its requested event carries.
	Scope struct {
		UserID string `json:"user_id"`
	} `json:"scope"`
}

// published reads the call key a record was published under and its
// envelope.
func published(key, value []byte) (ledger.CallKey, publishedEnvelope, error) {
	var env publishedEnvelope
	if err := json.Unmarshal(value, &env); err != nil {
		return ledger.CallKey{}, env, err
	}
	k, _ := ledger.ParseCallKey(string(key))
	return k, env, nil
}

// submit --assertion without --user claims no user in the envelope's
// scope, and without --tenant claims the assertion's tenant: the ledger
// takes the assertion's. Before, the scope claimed the defaults u_demo
// and t_demo, and the intake refused an assertion of any other user or
// tenant (scope_mismatch) unless --user and --tenant repeated them. A
// --user or --tenant given is still claimed, as are the user and tenant
// of an assertion submit mints.
func TestSubmitAssertionWithoutUserClaimsNone(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	dir := t.TempDir()
	devIssuerKeys(t, dir)
	alice := strings.TrimSpace(cli(t, "token", "--data-dir", dir, "--tenant", "t_acme", "--user", "u_alice"))
	for _, tc := range []struct {
		name string
		args []string
		want map[string]any
	}{
		{"assertion", []string{"--assertion", alice}, map[string]any{"tenant_id": "t_acme"}},
		{"assertion and user", []string{"--assertion", alice, "--user", "u_alice"}, map[string]any{"tenant_id": "t_acme", "user_id": "u_alice"}},
		{"assertion and tenant", []string{"--assertion", alice, "--tenant", "t_other"}, map[string]any{"tenant_id": "t_other"}},
		{"minted", []string{"--data-dir", dir}, map[string]any{"tenant_id": "t_demo", "user_id": "u_demo"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append(roleArgs(cc, topics), "submit", "--tool", "get_weather", "--args", `{"city":"Oslo"}`, "--json")
			out := cli(t, append(args, tc.args...)...)
			var env struct {
				Scope map[string]any `json:"scope"`
			}
			if err := json.Unmarshal([]byte(out), &env); err != nil {
				t.Fatalf("submit --json printed %q: %v", out, err)
			}
			if diff := cmp.Diff(tc.want, env.Scope); diff != "" {
				t.Errorf("published scope (-want +got):\n%s", diff)
			}
		})
	}
}

// submit publishes no approver's or operator's assertion: LEDGER_ASSERTION,
// the staff commands' variable, is not its (LEDGER_AGENT_ASSERTION is),
// and one naming the staff's audience is refused before anything is
// sent, from --assertion, LEDGER_AGENT_ASSERTION or a --file envelope.
// Before, a shell set up for `ledger control` and `ledger calls` made
// submit put the operator's token in the request topic, in clear for the
// topic's retention (the intake refused the call, and the record stayed).
func TestSubmitPublishesNoStaffAssertion(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	dir := t.TempDir()
	devIssuerKeys(t, dir)
	ops := strings.TrimSpace(cli(t, "token", "--data-dir", dir, "--tenant", "t_acme", "--user", "u_ops", "--operator"))
	submit := append(roleArgs(cc, topics), "submit", "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`, "--json")
	file := filepath.Join(dir, "envelope.json")
	if err := os.WriteFile(file, []byte(`{"tool":"get_weather","arguments":{"city":"Oslo"},"assertion":"`+ops+`"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		env  string
		args []string
	}{
		{"--assertion", "", append(slices.Clone(submit), "--assertion", ops)},
		{agentAssertionEnv, agentAssertionEnv, submit},
		{"--file", "", append(roleArgs(cc, topics), "submit", "--file", file)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.env != "" {
				t.Setenv(tc.env, ops)
			}
			err := cliErr(t, tc.args...)
			if err == nil || !strings.Contains(err.Error(), `names the staff's audience "toolcall-ledger-approvals"`) || strings.Contains(err.Error(), ops) {
				t.Errorf("submit with an operator's assertion: %v; want it refused, naming the audience, not the token", err)
			}
		})
	}
	nothingPublished(t, cc, topics.Requests)
	t.Setenv("LEDGER_ASSERTION", ops)
	out := cli(t, submit...)
	var printed, published struct{ Assertion string }
	if err := json.Unmarshal([]byte(out), &printed); err != nil {
		t.Fatalf("submit --json printed %q: %v", out, err)
	}
	if err := json.Unmarshal(firstRecord(t, cc, topics.Requests), &published); err != nil {
		t.Fatal(err)
	}
	if published.Assertion == "" || published.Assertion == ops {
		t.Errorf("submit with LEDGER_ASSERTION an operator's published the assertion %q; want the dev issuer's, LEDGER_ASSERTION ignored", published.Assertion)
	}
	// The envelope printed holds no assertion: it is a bearer
	// credential, and --json output goes to job logs.
	if printed.Assertion != ledger.Redacted {
		t.Errorf("submit --json printed the assertion %q; want it %s", printed.Assertion, ledger.Redacted)
	}
}

// firstRecord is the value of the first record of topic.
func firstRecord(t *testing.T, cc ledger.ClientConfig, topic string) []byte {
	t.Helper()
	cl, err := ledger.NewClient(cc, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		if recs := cl.PollFetches(ctx).Records(); len(recs) > 0 {
			return recs[0].Value
		}
	}
	t.Fatalf("no record in %s within 10s", topic)
	return nil
}

// A refusal of the call as a whole points at no field: it is printed
// without an empty "at". Before, a rate limit read "rate_limited at : ...".
func TestPrintRefusalNamesItsPointerOnlyWhenItHasOne(t *testing.T) {
	for _, tc := range []struct {
		e    ledger.Event
		want string
	}{
		{ledger.Event{Reason: "rate_limited", Detail: "at most 60/m for send_email"}, "refused: rate_limited: at most 60/m for send_email\n"},
		{ledger.Event{Reason: "invalid_arguments", Pointer: "/arguments/title", Detail: "missing"}, "refused: invalid_arguments at /arguments/title: missing\n"},
	} {
		var out strings.Builder
		printRefusal(&out, &submitFlags{}, tc.e, 1)
		if got := out.String(); got != tc.want {
			t.Errorf("printRefusal(%s) = %q; want %q", tc.e.Reason, got, tc.want)
		}
	}
}

// A refusal dated before the last sending (by more than the clocks' skew)
// is no answer to it, whether the API's wait ended on it or the call's
// refusals list it: a projection behind may show an earlier submission's
// refusal only after this one was sent, admitted and run. Before, only a
// list read when the refusals before could not be read was so filtered,
// and `submit --api --wait` printed refused for a call that ran.
func TestAnsweringRefusalNotDatedBefore(t *testing.T) {
	sent := time.Now()
	notBefore := sent.Add(-httpapi.RefusalSkew)
	old := ledger.Event{EventID: "old", CallID: "c1", Reason: "tool_frozen", At: sent.Add(-time.Minute)}
	fresh := ledger.Event{EventID: "fresh", CallID: "c1", Reason: "rate_limited", At: sent.Add(time.Second)}
	// A refusal of another copy of the call (the same call id, other
	// bytes) is no answer to this one, however fresh.
	otherCopy := ledger.Event{EventID: "other-copy", CallID: "c1", Reason: "assertion_expired", At: sent.Add(time.Second), RequestDigest: "sha256:other"}
	thisCopy := otherCopy
	thisCopy.EventID, thisCopy.RequestDigest = "this-copy", "sha256:this"
	for _, tc := range []struct {
		name string
		v    httpapi.CallView
		want string
	}{
		{"the wait's, old", httpapi.CallView{Refused: &old}, ""},
		{"listed, old", httpapi.CallView{Refusals: []ledger.Event{old}}, ""},
		{"the wait's, fresh", httpapi.CallView{Refused: &fresh}, "fresh"},
		{"listed, old and fresh", httpapi.CallView{Refusals: []ledger.Event{old, fresh}}, "fresh"},
		{"listed, another copy's", httpapi.CallView{Refusals: []ledger.Event{otherCopy}}, ""},
		{"listed, another copy's and this one's", httpapi.CallView{Refusals: []ledger.Event{otherCopy, thisCopy}}, "this-copy"},
		{"the wait's, another copy's (an older API's)", httpapi.CallView{Refused: &otherCopy}, ""},
	} {
		got := ""
		if r := answeringRefusal(tc.v, "c1", "sha256:this", map[string]bool{}, notBefore); r != nil {
			got = r.EventID
		}
		if got != tc.want {
			t.Errorf("%s: answering refusal %q; want %q", tc.name, got, tc.want)
		}
	}
}

// submit --wait with no ledger to answer it says why its wait found
// nothing, by what it read: with nothing of the call before the
// submission, only that nothing answered; with the call's partition not
// read back (here held by a transaction left open below the submission),
// both causes, and how far back it read; with a record under the key
// that does not decode, that.
func TestSubmitWaitSaysWhatItHadToRead(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	dir := t.TempDir()
	devIssuerKeys(t, dir)
	producer := keyedProducer(t, cc)
	submit := func(key string) error {
		return cliErr(t, append(roleArgs(cc, topics), "submit", "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`,
			"--tenant", "t_demo", "--key", key, "--wait", "--timeout", "2s")...)
	}

	err := submit("unanswered")
	if err == nil || !strings.Contains(err.Error(), "no event of it was read, before this submission or after it (is an intake running, reading "+topics.Requests+"?)") {
		t.Errorf("submit --wait of a new call with no ledger to answer: %v; want it to say nothing answered it", err)
	}

	held := ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "held"}
	txn, err := ledger.NewClient(cc, kgo.RecordPartitioner(ledger.Partitioner()), kgo.TransactionalID("submit-test-open"))
	if err != nil {
		t.Fatal(err)
	}
	defer txn.Close()
	if err := txn.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	if err := txn.ProduceSync(t.Context(), &kgo.Record{Topic: topics.Events, Key: []byte(held.String()), Value: []byte(`{}`)}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	err = submit(held.IdempotencyKey)
	if err == nil || !strings.Contains(err.Error(), "is an intake running, reading "+topics.Requests) || !strings.Contains(err.Error(), "its partition of "+topics.Events+", which ended at offset 1 when the envelope went out, had been read back to offset 1") {
		t.Errorf("submit --wait with its partition not read back: %v; want it to name both causes: no intake, or the call's earlier events not reached", err)
	}
	if err := txn.EndTransaction(t.Context(), kgo.TryAbort); err != nil {
		t.Fatal(err)
	}

	bad := ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "unreadable"}
	if err := producer.ProduceSync(t.Context(), &kgo.Record{Topic: topics.Events, Key: []byte(bad.String()), Value: []byte("not an event")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	err = submit(bad.IdempotencyKey)
	if err == nil || !strings.Contains(err.Error(), "read the call's earlier events: event at "+topics.Events) {
		t.Errorf("submit --wait with a record under its key that does not decode: %v; want that said", err)
	}
}

// submit --wait reads the log back from where it ended only as far as
// the call needs: a call sent before (a resend, which the intake answers
// with no event) is found at its start, and what lies before it does not
// fail the wait (here, a record under the key that does not decode,
// 5,000 records back, which a read from the log's start failed at); a
// call begun after the envelope went out needs nothing before it, even
// when that cannot be read. A call whose first events were appended
// again after the rest (an outbox appended again: a resend answered
// before they were marked logged, the executors' sweep), in the log
// before the submission or read live, is folded by seq, to the state
// the rest says: before, the wait took the copies for the call's start
// and waited on at authorized.
func TestSubmitWaitReadsBackOnlyToTheCall(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	appendEvents := eventAppender(t, cc, topics.Events)
	producer := keyedProducer(t, cc)
	earlier := func(key ledger.CallKey, garbled bool, n int) {
		t.Helper()
		appendRefusals(t, producer, topics.Events, key, n, time.Now(), garbled)
	}
	call := func(key ledger.CallKey) []ledger.Event {
		var evs []ledger.Event
		for i, ty := range []statemachine.EventType{statemachine.EventRequested, statemachine.EventAuthorized, statemachine.EventExecuting, statemachine.EventSucceeded} {
			evs = append(evs, ledger.Event{V: 1, EventID: key.IdempotencyKey + "-" + string(ty), Seq: int64(i + 1), Type: ty, TenantID: key.TenantID,
				IdempotencyKey: key.IdempotencyKey, CallID: "call-" + key.IdempotencyKey, UserID: "u_1", ArgumentsHash: "sha256:h", Attempt: 1, At: time.Now()})
		}
		return evs
	}
	// wait follows key's call, answered with evs once the envelope went
	// out.
	wait := func(key ledger.CallKey, evs ...ledger.Event) (*callWait, string, error) {
		w, err := newCallWait(t.Context(), cc, topics.Events, key, "call-"+key.IdempotencyKey, []byte(`{"arguments_hash":"sha256:h"}`))
		if err != nil {
			t.Fatal(err)
		}
		w.lastSent = time.Now()
		if err := appendEvents(t.Context(), evs...); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		err = w.run(t.Context(), &submitFlags{timeout: 20 * time.Second}, &out, func(context.Context) error { return nil })
		return w, out.String(), err
	}

	before := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "sent-before"}
	earlier(before, true, 5000)
	if err := appendEvents(t.Context(), call(before)...); err != nil {
		t.Fatal(err)
	}
	w, out, err := wait(before)
	if err != nil || w.last == nil || w.last.Type != statemachine.EventSucceeded || !strings.Contains(out, before.String()+" is succeeded") {
		t.Errorf("submit --wait of a call settled before: %v, printing:\n%s\nwant it found succeeded", err, out)
	}

	after := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "begun-after"}
	earlier(after, true, 0)
	w, out, err = wait(after, call(after)...)
	if err != nil || w.last == nil || w.last.Type != statemachine.EventSucceeded {
		t.Errorf("submit --wait of a call begun after it went out, with a record before that does not decode: %v, printing:\n%s\nwant it succeeded", err, out)
	}

	copiedBefore := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "copied-before"}
	evs := call(copiedBefore)
	if err := appendEvents(t.Context(), evs...); err != nil {
		t.Fatal(err)
	}
	earlier(copiedBefore, false, 5000)
	if err := appendEvents(t.Context(), evs[:2]...); err != nil {
		t.Fatal(err)
	}
	w, out, err = wait(copiedBefore)
	if err != nil || w.last == nil || w.last.Type != statemachine.EventSucceeded {
		t.Errorf("submit --wait of a call whose first events were appended again, 5,000 records after the rest: %v, printing:\n%s\nwant it succeeded", err, out)
	}

	copiedLive := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "copied-live"}
	evs = call(copiedLive)
	if err := appendEvents(t.Context(), evs[:2]...); err != nil {
		t.Fatal(err)
	}
	w, out, err = wait(copiedLive, evs[2], evs[3], evs[0], evs[1])
	if err != nil || w.last == nil || w.last.Type != statemachine.EventSucceeded {
		t.Errorf("submit --wait of a call whose first events were appended again, live, after the rest: %v, printing:\n%s\nwant it succeeded", err, out)
	}

	// A call approved and run before: all that was read back is folded
	// before the wait asks whether it settled, not ended at its
	// approval_pending.
	approvedBefore := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "approved-before"}
	expires := time.Now().Add(time.Hour)
	var approvedEvs []ledger.Event
	for i, ty := range []statemachine.EventType{statemachine.EventRequested, statemachine.EventApprovalPending, statemachine.EventApproved, statemachine.EventExecuting, statemachine.EventSucceeded} {
		approvedEvs = append(approvedEvs, ledger.Event{V: 1, EventID: "approved-" + string(ty), Seq: int64(i + 1), Type: ty, TenantID: approvedBefore.TenantID,
			IdempotencyKey: approvedBefore.IdempotencyKey, CallID: "call-approved", UserID: "u_1", ArgumentsHash: "sha256:h", Attempt: 1,
			ApprovalID: "approval-1", ExpiresAt: &expires, At: time.Now()})
	}
	if err := appendEvents(t.Context(), approvedEvs...); err != nil {
		t.Fatal(err)
	}
	w, out, err = wait(approvedBefore)
	if err != nil || w.last == nil || w.last.Type != statemachine.EventSucceeded || !strings.Contains(out, approvedBefore.String()+" is succeeded") {
		t.Errorf("submit --wait of a call approved and run before: %v, printing:\n%s\nwant it succeeded", err, out)
	}

	// A record under the unverified tenant's key that does not decode,
	// read live, is never this call's: the wait goes on to its end.
	garbledBeside := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "garbled-beside"}
	unverified := ledger.CallKey{TenantID: ledger.UnverifiedTenant, IdempotencyKey: garbledBeside.IdempotencyKey}
	w, err = newCallWait(t.Context(), cc, topics.Events, garbledBeside, "call-"+garbledBeside.IdempotencyKey, []byte(`{"arguments_hash":"sha256:h"}`))
	if err != nil {
		t.Fatal(err)
	}
	w.lastSent = time.Now()
	if err := producer.ProduceSync(t.Context(), &kgo.Record{Topic: topics.Events, Key: []byte(unverified.String()), Value: []byte("not an event")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	// The call's events come once the wait has read that record.
	appended := make(chan error, 1)
	go func() {
		time.Sleep(500 * time.Millisecond)
		appended <- appendEvents(t.Context(), call(garbledBeside)...)
	}()
	defer func() {
		if err := <-appended; err != nil {
			t.Error(err)
		}
	}()
	if err := w.run(t.Context(), &submitFlags{timeout: 20 * time.Second}, io.Discard, func(context.Context) error { return nil }); err != nil || w.last == nil || w.last.Type != statemachine.EventSucceeded {
		t.Errorf("submit --wait with a record under the unverified key that does not decode: %v; want the call succeeded", err)
	}

	// Another's call under the key before, and this submission's call
	// admitted under it after (the store had lost the key): followed.
	reused := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "reused-after-loss"}
	other := call(reused)
	for i := range other {
		other[i].EventID, other[i].CallID, other[i].ArgumentsHash = "other-"+other[i].EventID, "call-other", "sha256:other"
	}
	if err := appendEvents(t.Context(), other...); err != nil {
		t.Fatal(err)
	}
	w, out, err = wait(reused, call(reused)...)
	if err != nil || w.last == nil || w.last.EventID != "reused-after-loss-succeeded" {
		t.Errorf("submit --wait of a call admitted under a key another's call held: %v, printing:\n%s\nwant this call succeeded", err, out)
	}
}

// The wait follows the call of this submission, whatever order a call's
// events and another call's under the key are read in: another's call
// read first does not hide this one's, read after; an earlier call under
// the same call id (the same envelope sent before, the store having lost
// the key since), read back after this one began live, does not settle
// it; and a newer call read live replaces an earlier one read back.
func TestCallWaitPlacesItsCall(t *testing.T) {
	now := time.Now()
	call := func(id, callID, hash string, at time.Time, types ...statemachine.EventType) []ledger.Event {
		var evs []ledger.Event
		for i, ty := range types {
			evs = append(evs, ledger.Event{V: 1, EventID: id + "-" + string(ty), Seq: int64(i + 1), Type: ty, TenantID: "t_a", IdempotencyKey: "k",
				CallID: callID, UserID: "u_1", ArgumentsHash: hash, Attempt: 1, At: at})
		}
		return evs
	}
	settled := []statemachine.EventType{statemachine.EventRequested, statemachine.EventAuthorized, statemachine.EventExecuting, statemachine.EventSucceeded}
	running := settled[:2]
	type read struct {
		evs   []ledger.Event
		fresh bool
	}
	for _, tc := range []struct {
		name  string
		reads []read
		state statemachine.State
		start string // the event id of the followed call's requested event
	}{
		{"another's call first", []read{{call("other", "c-other", "sha256:other", now.Add(-time.Hour), settled...), false}, {call("own", "c-own", "sha256:h", now, settled...), true}},
			statemachine.StateSucceeded, "own-requested"},
		{"an earlier call under the call id after", []read{{call("own", "c-own", "sha256:h", now, running...), true}, {call("before", "c-own", "sha256:h", now.Add(-time.Hour), settled...), false}},
			statemachine.StateAuthorized, "own-requested"},
		{"a newer call after an earlier one", []read{{call("before", "c-own", "sha256:h", now.Add(-time.Hour), running...), false}, {call("own", "c-own", "sha256:h", now, settled...), true}},
			statemachine.StateSucceeded, "own-requested"},
		// Read live, but older than the call placed: not a newer call.
		{"an older call read live after a newer one", []read{{call("own", "c-own", "sha256:h", now.Add(-time.Hour), running...), false}, {call("older", "c-own", "sha256:h", now.Add(-2*time.Hour), settled...), true}},
			statemachine.StateAuthorized, "own-requested"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := &callWait{own: httpapi.OwnCall("sha256:h", "", ""), refusals: make(map[string]bool)}
			for _, r := range tc.reads {
				for _, e := range r.evs {
					w.take(e, r.fresh, &submitFlags{jsonOut: true}, io.Discard)
				}
			}
			if w.call.State != tc.state || w.start.EventID != tc.start {
				t.Errorf("the wait follows %q at %s; want %q at %s", w.start.EventID, w.call.State, tc.start, tc.state)
			}
		})
	}
}

// The wait of a call begun after the envelope went out reads the log
// back no further than a window that starts a minute before the call
// did: the call needs nothing older, and before, the wait read the whole
// partition back to its start for as long as the call ran (here, 20,000
// records of earlier submissions an hour old).
func TestSubmitWaitOfANewCallReadsBackLittle(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	appendEvents := eventAppender(t, cc, topics.Events)
	producer := keyedProducer(t, cc)
	key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "new-call"}
	appendRefusals(t, producer, topics.Events, key, 20000, time.Now().Add(-time.Hour), false)
	w, err := newCallWait(t.Context(), cc, topics.Events, key, "call-new", []byte(`{"arguments_hash":"sha256:h"}`))
	if err != nil {
		t.Fatal(err)
	}
	w.lastSent = time.Now()
	var evs []ledger.Event
	for i, ty := range []statemachine.EventType{statemachine.EventRequested, statemachine.EventAuthorized} {
		evs = append(evs, ledger.Event{V: 1, EventID: "new-" + string(ty), Seq: int64(i + 1), Type: ty, TenantID: key.TenantID,
			IdempotencyKey: key.IdempotencyKey, CallID: "call-new", UserID: "u_1", ArgumentsHash: "sha256:h", Attempt: 1, At: time.Now()})
	}
	if err := appendEvents(t.Context(), evs...); err != nil {
		t.Fatal(err)
	}
	err = w.run(t.Context(), &submitFlags{timeout: 3 * time.Second}, io.Discard, func(context.Context) error { return nil })
	if err == nil || !strings.Contains(err.Error(), `(state "authorized")`) {
		t.Fatalf("wait of a call left authorized: %v; want it to run out there", err)
	}
	// The first window; or, if the intake's answer came after the
	// moment the read waits for it, the second.
	if !w.histDone || w.histFrom < w.ends[0]-4096-8192 {
		t.Errorf("the read back was done: %v, down to offset %d of %d; want done, down to %d at most", w.histDone, w.histFrom, w.ends[0], w.ends[0]-4096-8192)
	}
}

// appendRefusals appends n refusals of earlier submissions under key,
// dated and stamped at, after a record that does not decode if garbled.
func appendRefusals(t *testing.T, producer *kgo.Client, topic string, key ledger.CallKey, n int, at time.Time, garbled bool) {
	t.Helper()
	var recs []*kgo.Record
	if garbled {
		recs = append(recs, &kgo.Record{Topic: topic, Key: []byte(key.String()), Value: []byte("not an event"), Timestamp: at})
	}
	for i := range n {
		e := ledger.Event{V: 1, EventID: fmt.Sprintf("refusal-%d", i), Type: statemachine.EventDenied, TenantID: key.TenantID,
			IdempotencyKey: key.IdempotencyKey, CallID: "call-earlier", Reason: "rate_limited", At: at}
		r, err := e.Record(topic)
		if err != nil {
			t.Fatal(err)
		}
		r.Timestamp = at
		recs = append(recs, r)
	}
	if err := producer.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}
