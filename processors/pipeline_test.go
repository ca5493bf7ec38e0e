package processors_test

// These tests run the intake and the executor on their real loops against
// Kafka (kfake, or LEDGER_TEST_KAFKA_BROKERS), the execution store
// (PostgreSQL as the stand-in for CockroachDB, and the embedded store), and
// the demo backend, which counts every effect where it happens.

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/boltstore"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
	"github.com/toolcall-ledger/ledger/processors/storetest"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/projector"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// harness is one ledger: Kafka, a store, the demo backend, a call index,
// and the processors the test starts.
type harness struct {
	t       testing.TB
	kafka   *ledgertest.Kafka
	store   processors.Store
	backend *demobackend.Server
	tools   string // the backend's base URL
	reg     *schemas.Registry
	index   *callindex.Index
	pub     *kgo.Client
	logger  *slog.Logger
	ident   *processorstest.Identity
	policy  *policy.Engine
	// approvalTTL, when set, is the intake's approval TTL.
	approvalTTL time.Duration
	// pgDSN and pgSchema locate the SQL store, for tests that tamper
	// with it.
	pgDSN, pgSchema string
	nparts          int32
}

func (h *harness) partitions() int32 { return h.nparts }

type storeKind string

const (
	storeSQL      storeKind = "sql"
	storeEmbedded storeKind = "embedded"
)

func newHarness(t testing.TB, kind storeKind, partitions int32, backendOpts ...func(*demobackend.Config)) *harness {
	t.Helper()
	h := &harness{t: t, logger: testLogger(t), ident: processorstest.NewIdentity(t), policy: processorstest.Policy(t, "testdata/policies")}
	h.kafka = ledgertest.New(t, ledgertest.Options{Partitions: partitions})
	h.nparts = partitions
	switch kind {
	case storeSQL:
		dsn := storetest.PGDSN(t)
		h.pgDSN, h.pgSchema = dsn, storetest.FreshSchema(t, dsn)
		st, err := pgstore.Open(t.Context(), pgstore.Config{DSN: dsn, Schema: h.pgSchema})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		h.store = st
	case storeEmbedded:
		st, err := boltstore.Open(boltstore.Config{Path: filepath.Join(t.TempDir(), "executions.db")})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		h.store = st
	}
	bc := demobackend.Config{}
	for _, o := range backendOpts {
		o(&bc)
	}
	h.backend = demobackend.New(bc)
	srv := httptest.NewServer(h.backend.Handler())
	t.Cleanup(func() { h.backend.Close(); srv.Close() })
	h.tools = srv.URL
	reg, err := schemas.Load(os.DirFS("testdata/registry"))
	if err != nil {
		t.Fatal(err)
	}
	h.reg = reg
	h.index, err = callindex.Open(filepath.Join(t.TempDir(), "index.db"), h.logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.index.Close() })
	indexer, err := projector.New(projector.Config{
		Client: h.kafka.Client, Topics: h.kafka.Topics, Group: h.kafka.Group("callindex"),
		MaxWait: 5 * time.Millisecond, Logger: h.logger,
	}, h.index)
	if err != nil {
		t.Fatal(err)
	}
	h.run("callindex", func(ctx context.Context) error {
		return indexer.Run(ctx)
	})
	h.pub, err = ledger.NewClient(h.kafka.Client, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.pub.Close)
	return h
}

func testLogger(t testing.TB) *slog.Logger {
	if os.Getenv("LEDGER_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// run starts fn in the background until the test ends or the returned stop
// is called; stop waits for fn to return.
func (h *harness) run(name string, fn func(ctx context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := fn(ctx); err != nil && ctx.Err() == nil {
			h.t.Errorf("%s: %v", name, err)
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	h.t.Cleanup(stop)
	return stop
}

func (h *harness) startIntake(instance string) (stop func()) {
	h.t.Helper()
	in, err := intake.New(intake.Config{
		Registry: h.reg, Store: h.store, Topics: h.kafka.Topics, Actor: instance, Logger: h.logger,
		Identity: h.ident.Verifier, Policy: h.policy, ApprovalTTL: h.approvalTTL,
		Versions: httptool.New(httptool.Config{}), BaseURL: h.tools,
	})
	if err != nil {
		h.t.Fatal(err)
	}
	loop, err := in.Loop(ledger.LoopConfig{Client: h.kafka.Client, Group: h.kafka.Group("intake"), Tick: 100 * time.Millisecond})
	if err != nil {
		h.t.Fatal(err)
	}
	return h.run(instance, loop.Run)
}

func (h *harness) executorConfig(instance string) executor.Config {
	return executor.Config{
		Registry:    h.reg,
		Store:       h.store,
		Caller:      httptool.New(httptool.Config{}),
		BaseURL:     h.tools,
		Topics:      h.kafka.Topics,
		Owner:       instance,
		Policy:      h.policy,
		Versions:    httptool.New(httptool.Config{}),
		MaxAttempts: 2,
		LeaseMargin: 500 * time.Millisecond,
		SweepEvery:  300 * time.Millisecond,
		Logger:      h.logger,
	}
}

func (h *harness) startExecutor(cfg executor.Config) (stop func()) {
	h.t.Helper()
	x, err := executor.New(cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	loop, err := x.Loop(ledger.LoopConfig{Client: h.kafka.Client, Group: h.kafka.Group("executor"), Tick: 100 * time.Millisecond})
	if err != nil {
		h.t.Fatal(err)
	}
	return h.run(cfg.Owner, loop.Run)
}

// envelope is a well-formed envelope with a correct hash and a valid
// assertion for its tenant.
type envelope struct {
	Tool           string         `json:"tool"`
	ToolVersion    int            `json:"tool_version"`
	CallID         string         `json:"call_id"`
	Arguments      map[string]any `json:"arguments"`
	Scope          map[string]any `json:"scope"`
	IdempotencyKey string         `json:"idempotency_key"`
	ArgumentsHash  string         `json:"arguments_hash"`
	DeadlineMS     int64          `json:"deadline_ms,omitempty"`
	Assertion      string         `json:"assertion,omitempty"`
	TraceID        string         `json:"trace_id,omitempty"`
}

func (h *harness) newEnvelope(tenant, key, tool string, args map[string]any) envelope {
	h.t.Helper()
	return h.newEnvelopeSigned(tenant, key, tool, args, h.ident.Assertion(h.t, tenant, "u_1"))
}

// newEnvelopeSigned is newEnvelope with a given assertion (minting one per
// envelope costs more than a load test can spend).
func (h *harness) newEnvelopeSigned(tenant, key, tool string, args map[string]any, assertion string) envelope {
	t := h.t
	t.Helper()
	tree, err := ledger.Decode(mustJSON(t, args), ledger.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	hash, err := ledger.ArgumentsHash(tenant, tool, 1, tree)
	if err != nil {
		t.Fatal(err)
	}
	return envelope{
		Tool: tool, ToolVersion: 1, CallID: "call_" + key, Arguments: args,
		Scope:          map[string]any{"tenant_id": tenant, "user_id": "u_1"},
		IdempotencyKey: key, ArgumentsHash: hash,
		Assertion: assertion,
	}
}

func (e envelope) key() ledger.CallKey {
	return ledger.CallKey{TenantID: e.Scope["tenant_id"].(string), IdempotencyKey: e.IdempotencyKey}
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// publish puts raw records on the request topic, keyed like agents key
// them.
func (h *harness) publish(key string, values ...[]byte) {
	h.t.Helper()
	recs := make([]*kgo.Record, len(values))
	for i, v := range values {
		recs[i] = &kgo.Record{Topic: h.kafka.Topics.Requests, Key: []byte(key), Value: v}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.pub.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		h.t.Fatalf("publish: %v", err)
	}
}

func (h *harness) submit(envs ...envelope) {
	h.t.Helper()
	for _, e := range envs {
		h.publish(e.key().String(), mustJSON(h.t, e))
	}
}

// waitSettled waits until every key has settled in the index and returns
// the calls.
func (h *harness) waitSettled(timeout time.Duration, keys ...ledger.CallKey) map[ledger.CallKey]callindex.Call {
	h.t.Helper()
	calls := make(map[ledger.CallKey]callindex.Call, len(keys))
	ledgertest.WaitFor(h.t, timeout, func() error {
		unsettled := 0
		var example string
		for _, k := range keys {
			if c, ok := calls[k]; ok && c.Settled() {
				continue
			}
			c, err := h.index.Get(k)
			if err == nil {
				calls[k] = c
				if c.Settled() {
					continue
				}
			}
			unsettled++
			example = fmt.Sprintf("%s (state %q)", k, c.State)
		}
		if unsettled > 0 {
			return fmt.Errorf("%d of %d calls not settled, e.g. %s", unsettled, len(keys), example)
		}
		return nil
	})
	return calls
}

// waitTerminal waits until every key's call is terminal (waitSettled also
// accepts a call that waits, for approval or a human) and returns the
// calls.
func (h *harness) waitTerminal(timeout time.Duration, keys ...ledger.CallKey) map[ledger.CallKey]callindex.Call {
	h.t.Helper()
	calls := make(map[ledger.CallKey]callindex.Call, len(keys))
	ledgertest.WaitFor(h.t, timeout, func() error {
		for _, k := range keys {
			c, err := h.index.Get(k)
			if err != nil {
				return fmt.Errorf("%s: %w", k, err)
			}
			if !c.State.Terminal() {
				// The last event's reason tells a stuck call from a
				// slow one.
				var last ledger.Event
				if len(c.Events) > 0 {
					last = c.Events[len(c.Events)-1]
				}
				return fmt.Errorf("%s is %q (%s; %s %s)", k, c.State, eventTypes(c.Events), last.Reason, last.ErrorCode)
			}
			calls[k] = c
		}
		return nil
	})
	return calls
}

// waitRefused waits until key has a refusal and returns it.
func (h *harness) waitRefused(timeout time.Duration, key ledger.CallKey) ledger.Event {
	h.t.Helper()
	var ref ledger.Event
	ledgertest.WaitFor(h.t, timeout, func() error {
		c, err := h.index.Get(key)
		if err != nil {
			return err
		}
		if len(c.Refusals) == 0 {
			return fmt.Errorf("%s: no refusal yet (state %q)", key, c.State)
		}
		ref = c.Refusals[0]
		return nil
	})
	return ref
}

func eventTypes(evs []ledger.Event) string {
	var ts []string
	for _, e := range evs {
		ts = append(ts, fmt.Sprintf("%d:%s", e.Seq, e.Type))
	}
	return strings.Join(ts, " ")
}

func stores(t *testing.T, fn func(t *testing.T, kind storeKind)) {
	for _, kind := range []storeKind{storeSQL, storeEmbedded} {
		t.Run(string(kind), func(t *testing.T) { fn(t, kind) })
	}
}

func TestCallRunsToSucceeded(t *testing.T) {
	stores(t, func(t *testing.T, kind storeKind) {
		h := newHarness(t, kind, 4)
		h.startIntake("intake-1")
		h.startExecutor(h.executorConfig("executor-1"))

		weather := h.newEnvelope("t_a", "weather-1", "get_weather", map[string]any{"city": "Sydney"})
		ticket := h.newEnvelope("t_a", "ticket-1", "create_ticket", map[string]any{"title": "Printer on fire"})
		h.submit(weather, ticket)
		calls := h.waitSettled(30*time.Second, weather.key(), ticket.key())
		for _, e := range []envelope{weather, ticket} {
			c := calls[e.key()]
			if got, want := eventTypes(c.Events), "1:requested 2:authorized 3:executing 4:succeeded"; got != want {
				t.Errorf("%s events = %s; want %s", e.key(), got, want)
			}
			if got := h.backend.AppliedIn(e.Tool, "t_a", e.key().String()); got != 1 && e.Tool != "get_weather" {
				t.Errorf("%s applied %d times at the tool; want 1", e.key(), got)
			}
			rec, err := h.store.Get(t.Context(), e.key())
			if err != nil {
				t.Fatal(err)
			}
			if rec.Status != processors.StatusSucceeded || !strings.Contains(string(rec.Result), `"untrusted":true`) {
				t.Errorf("%s record = %s %s; want succeeded with an untrusted-marked result", e.key(), rec.Status, rec.Result)
			}
			last := c.Events[len(c.Events)-1]
			if !strings.HasPrefix(last.ResultDigest, "sha256:") || last.ResultBytes == 0 {
				t.Errorf("%s terminal event carries digest %q, %d bytes; want a sha256 digest of a non-empty result", e.key(), last.ResultDigest, last.ResultBytes)
			}
			// Events carry the result's digest, never the result.
			if e.Tool == "create_ticket" && strings.Contains(string(mustJSON(t, c.Events)), "tkt_") {
				t.Errorf("%s: a result field leaked into the events: %s", e.key(), mustJSON(t, c.Events))
			}
		}
	})
}

// The same envelope published 100 times reaches the tool once.
func TestDuplicateEnvelopesExecuteOnce(t *testing.T) {
	stores(t, func(t *testing.T, kind storeKind) {
		h := newHarness(t, kind, 4)
		ticket := h.newEnvelope("t_a", "dup-ticket", "create_ticket", map[string]any{"title": "once"})
		note := h.newEnvelope("t_a", "dup-notify", "notify", map[string]any{"to": "a@example.com", "subject": "once"})
		for range 100 {
			h.submit(ticket, note)
		}
		// Start the processors after the duplicates are all on the
		// topic, so that batches hold many copies at once, and again
		// while more arrive.
		h.startIntake("intake-1")
		h.startExecutor(h.executorConfig("executor-1"))
		for range 20 {
			h.submit(ticket, note)
		}
		calls := h.waitSettled(60*time.Second, ticket.key(), note.key())
		// Let every copy reach the intake before counting.
		waitRequestsConsumed(t, h, 240)
		for _, e := range []envelope{ticket, note} {
			c := calls[e.key()]
			if got, want := eventTypes(c.Events), "1:requested 2:authorized 3:executing 4:succeeded"; got != want {
				t.Errorf("%s events = %s; want %s", e.key(), got, want)
			}
			if len(c.Refusals) != 0 || c.Anomalies != 0 {
				t.Errorf("%s: %d refusals, %d anomalies; want none", e.key(), len(c.Refusals), c.Anomalies)
			}
		}
		// Every request the tools saw, replays included.
		seen := map[string]int{}
		for _, eff := range h.backend.Effects() {
			seen[eff.Tool+" "+eff.IdempotencyKey]++
		}
		if got := seen["create_ticket "+ticket.key().String()]; got != 1 {
			t.Errorf("create_ticket received %d requests; want 1", got)
		}
		if got := seen["send_email "+note.key().String()]; got != 1 {
			t.Errorf("notify (send_email) received %d requests; want 1", got)
		}
	})
}

// waitRequestsConsumed waits until the intake group committed past n
// request records, so counts taken afterwards include every copy.
func waitRequestsConsumed(t *testing.T, h *harness, n int64) {
	t.Helper()
	adm, err := ledger.NewClient(h.kafka.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer adm.Close()
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		got, err := committedTotal(t.Context(), adm, h.kafka.Group("intake"), h.kafka.Topics.Requests)
		if err != nil {
			return err
		}
		if got < n {
			return fmt.Errorf("intake committed %d of %d requests", got, n)
		}
		return nil
	})
}

func TestTenantsSharingAKeyAreTwoCalls(t *testing.T) {
	stores(t, func(t *testing.T, kind storeKind) {
		h := newHarness(t, kind, 4)
		h.startIntake("intake-1")
		h.startExecutor(h.executorConfig("executor-1"))
		a := h.newEnvelope("t_a", "shared-key", "create_ticket", map[string]any{"title": "A's ticket"})
		b := h.newEnvelope("t_b", "shared-key", "create_ticket", map[string]any{"title": "B's ticket"})
		h.submit(a, b)
		calls := h.waitSettled(30*time.Second, a.key(), b.key())
		for _, e := range []envelope{a, b} {
			c := calls[e.key()]
			if c.State != statemachine.StateSucceeded || len(c.Refusals) != 0 {
				t.Errorf("%s: state %q, %d refusals; want succeeded, none", e.key(), c.State, len(c.Refusals))
			}
			if got := h.backend.AppliedIn("create_ticket", e.key().TenantID, e.key().String()); got != 1 {
				t.Errorf("%s applied %d times; want 1", e.key(), got)
			}
			if c.Events[0].ArgumentsHash != e.ArgumentsHash {
				t.Errorf("%s requested with hash %s; want its own %s", e.key(), c.Events[0].ArgumentsHash, e.ArgumentsHash)
			}
		}
		ra, _ := h.store.Get(t.Context(), a.key())
		rb, _ := h.store.Get(t.Context(), b.key())
		if ra.ArgumentsHash == rb.ArgumentsHash || string(ra.Result) == string(rb.Result) {
			t.Errorf("tenants' records share hash or result: %s / %s", ra.Result, rb.Result)
		}
	})
}

func TestKeyReusedWithOtherArgumentsIsRefused(t *testing.T) {
	stores(t, func(t *testing.T, kind storeKind) {
		h := newHarness(t, kind, 4)
		h.startIntake("intake-1")
		h.startExecutor(h.executorConfig("executor-1"))
		first := h.newEnvelope("t_a", "reused", "create_ticket", map[string]any{"title": "first"})
		h.submit(first)
		h.waitSettled(30*time.Second, first.key())

		second := h.newEnvelope("t_a", "reused", "create_ticket", map[string]any{"title": "second"})
		second.CallID = "call_second"
		h.submit(second)
		ref := h.waitRefused(30*time.Second, second.key())
		if ref.Reason != intake.ReasonIdempotencyKeyReuse || ref.Pointer != "/arguments_hash" || ref.CallID != "call_second" {
			t.Errorf("refusal = %s at %s for %s; want %s at /arguments_hash for call_second", ref.Reason, ref.Pointer, ref.CallID, intake.ReasonIdempotencyKeyReuse)
		}
		c, _ := h.index.Get(first.key())
		if got, want := eventTypes(c.Events), "1:requested 2:authorized 3:executing 4:succeeded"; got != want {
			t.Errorf("original call events = %s; want %s (untouched)", got, want)
		}
		if got := h.backend.AppliedIn("create_ticket", "t_a", first.key().String()); got != 1 {
			t.Errorf("applied %d times; want 1", got)
		}
	})
}

func TestHighRiskToolDeniedWithoutPolicy(t *testing.T) {
	h := newHarness(t, storeEmbedded, 4)
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))
	refund := h.newEnvelope("t_a", "refund-1", "refund_order", map[string]any{"order_id": "ord_1", "amount_cents": 4500, "currency": "AUD"})
	h.submit(refund)
	c := h.waitSettled(30*time.Second, refund.key())[refund.key()]
	if got, want := eventTypes(c.Events), "1:requested 2:denied"; got != want {
		t.Fatalf("events = %s; want %s", got, want)
	}
	if c.Events[1].Reason != intake.ReasonNoPolicy {
		t.Errorf("denied reason = %q; want %q", c.Events[1].Reason, intake.ReasonNoPolicy)
	}
	if n := len(h.backend.Effects()); n != 0 {
		t.Errorf("backend saw %d requests; want 0", n)
	}
}
