package chstore

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ClickHouse/clickhouse-go/v2"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
	"github.com/toolcall-ledger/ledger/projections/projectionstest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// openStore opens a migrated store on a fresh database, dropped when the
// test ends.
func openStore(t testing.TB) *Store {
	t.Helper()
	return openStoreWith(t, Config{})
}

// openStoreWith is openStore with cfg, its DSN and database set here.
func openStoreWith(t testing.TB, cfg Config) *Store {
	t.Helper()
	cfg.DSN, cfg.Database = chtest.DSN(t), chtest.FreshDatabase(t)
	s, err := Open(context.Background(), cfg)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return s
}

// t0 is when the fixture starts: a whole minute, so that buckets are easy
// to tell.
var t0 = time.Date(2026, 3, 10, 12, 0, 0, 0, time.UTC)

func at(d time.Duration) time.Time { return t0.Add(d) }

// week is an Outcomes bucket wide enough to ask about everything since
// the epoch (projections.MaxOutcomeBuckets).
const week = 7 * 24 * time.Hour

// fixture is a small log written by hand:
//
//	acme/a1    refund_order ord_1  requested, authorized (allow v7), executing, succeeded
//	acme/a1    a refusal under a1's key (denied, seq 0, decision deny v8)
//	acme/b1    refund_order ord_2  requested, approval_pending (v7), approved by u_alice, executing, outcome_unknown
//	acme/c1    get_weather         requested, denied (deny v8)
//	globex/d1  refund_order ord_1  requested, approval_pending (v7)
//	globex/e1  get_weather         an hour later: requested, authorized (allow v8), executing, failed
//	acme/z9    a refusal alone, without a tool
type fixture struct {
	a, b, c, d, e []ledger.Event
	refusalA      ledger.Event
	refusalZ      ledger.Event
	actions       []control.Action
}

func newFixture() fixture {
	var f fixture
	n := 0
	ev := func(tenant, key, tool, resource string, seq int64, typ statemachine.EventType, when time.Time, edit func(e *ledger.Event)) ledger.Event {
		n++
		e := ledger.Event{
			V: ledger.EncodingVersion, EventID: fmt.Sprintf("ev-%03d", n), Type: typ, Seq: seq, At: when, Actor: "test",
			TenantID: tenant, IdempotencyKey: key, CallID: "call-" + key, UserID: "u_" + tenant, AgentID: "agent_1",
			Tool: tool, ToolVersion: 2, Resource: resource, TraceID: "trace-" + key, ArgumentsHash: "sha256:" + key,
		}
		if edit != nil {
			edit(&e)
		}
		// As a reader of the log sees it.
		b, err := e.Encode()
		if err != nil {
			panic(err)
		}
		out, err := ledger.DecodeEvent(b)
		if err != nil {
			panic(err)
		}
		return out
	}
	decide := func(decision, pv string) func(*ledger.Event) {
		return func(e *ledger.Event) { e.Decision, e.PolicyVersion, e.PolicyID = decision, pv, []string{"p1"} }
	}
	cred := func(jti, family string, more func(*ledger.Event)) func(*ledger.Event) {
		return func(e *ledger.Event) {
			e.JTI, e.CredentialFamily, e.Attempt = jti, family, 1
			if more != nil {
				more(e)
			}
		}
	}
	ms := time.Millisecond
	exp := at(15 * time.Minute)

	f.a = []ledger.Event{
		ev("acme", "a1", "refund_order", "ord_1", 1, statemachine.EventRequested, at(200*ms), func(e *ledger.Event) {
			e.Arguments = []byte(`{"order_id":"ord_1"}`)
		}),
		ev("acme", "a1", "refund_order", "ord_1", 2, statemachine.EventAuthorized, at(1500*ms), decide("allow", "v7")),
		ev("acme", "a1", "refund_order", "ord_1", 3, statemachine.EventExecuting, at(2100*ms), cred("j-a1", "refund_order:acme:1", nil)),
		ev("acme", "a1", "refund_order", "ord_1", 4, statemachine.EventSucceeded, at(3000*ms), cred("j-a1", "refund_order:acme:1", func(e *ledger.Event) {
			e.LatencyMS, e.ResultDigest, e.ResultBytes = 40, "sha256:r", 12
		})),
	}
	f.refusalA = ev("acme", "a1", "refund_order", "", 0, statemachine.EventDenied, at(5*time.Second), func(e *ledger.Event) {
		e.Decision, e.PolicyVersion, e.Reason, e.Pointer = "deny", "v8", "idempotency_key_reused", "/arguments"
	})
	approval := func(e *ledger.Event) { e.ApprovalID = "ap-b1" }
	f.b = []ledger.Event{
		ev("acme", "b1", "refund_order", "ord_2", 1, statemachine.EventRequested, at(10*time.Second), nil),
		ev("acme", "b1", "refund_order", "ord_2", 2, statemachine.EventApprovalPending, at(11*time.Second), func(e *ledger.Event) {
			decide("require_approval", "v7")(e)
			e.ApprovalID, e.ExpiresAt, e.Reason = "ap-b1", &exp, "approval_required"
		}),
		ev("acme", "b1", "refund_order", "ord_2", 3, statemachine.EventApproved, at(70*time.Second), func(e *ledger.Event) {
			e.ApprovalID, e.Approver, e.ExpiresAt = "ap-b1", "u_alice", &exp
		}),
		ev("acme", "b1", "refund_order", "ord_2", 4, statemachine.EventExecuting, at(71*time.Second), cred("j-b1", "refund_order:acme:1", func(e *ledger.Event) {
			approval(e)
			e.Approver = "u_alice"
		})),
		ev("acme", "b1", "refund_order", "ord_2", 5, statemachine.EventOutcomeUnknown, at(72500*ms), cred("j-b1", "refund_order:acme:1", func(e *ledger.Event) {
			approval(e)
			e.Approver, e.Reason, e.ErrorCode = "u_alice", "outcome_ambiguous", "timeout"
		})),
	}
	f.c = []ledger.Event{
		ev("acme", "c1", "get_weather", "", 1, statemachine.EventRequested, at(20*time.Second), nil),
		ev("acme", "c1", "get_weather", "", 2, statemachine.EventDenied, at(20400*ms), func(e *ledger.Event) {
			decide("deny", "v8")(e)
			e.Reason = "policy_denied"
		}),
	}
	f.d = []ledger.Event{
		ev("globex", "d1", "refund_order", "ord_1", 1, statemachine.EventRequested, at(30*time.Second), nil),
		ev("globex", "d1", "refund_order", "ord_1", 2, statemachine.EventApprovalPending, at(31*time.Second), func(e *ledger.Event) {
			decide("require_approval", "v7")(e)
			e.ApprovalID, e.ExpiresAt, e.Reason = "ap-d1", &exp, "approval_required"
		}),
	}
	f.e = []ledger.Event{
		ev("globex", "e1", "get_weather", "", 1, statemachine.EventRequested, at(time.Hour), nil),
		ev("globex", "e1", "get_weather", "", 2, statemachine.EventAuthorized, at(time.Hour+time.Second), decide("allow", "v8")),
		ev("globex", "e1", "get_weather", "", 3, statemachine.EventExecuting, at(time.Hour+2*time.Second), cred("j-e1", "get_weather:globex:1", nil)),
		ev("globex", "e1", "get_weather", "", 4, statemachine.EventFailed, at(time.Hour+3*time.Second), cred("j-e1", "get_weather:globex:1", func(e *ledger.Event) {
			e.Reason, e.ErrorCode = "tool_failed", "http_500"
		})),
	}
	f.refusalZ = ev("acme", "z9", "", "", 0, statemachine.EventRejected, at(6*time.Second), func(e *ledger.Event) {
		e.Reason, e.Pointer = "malformed_envelope", "/tool"
	})
	f.actions = []control.Action{
		{V: 1, Kind: control.KindFreeze, Subject: control.ToolSubject("refund_order", "acme"), Tool: "refund_order", Tenant: "acme",
			By: "u_ops", ByTenant: "*", Reason: "incident 7", At: at(80 * time.Second)},
		{V: 1, Kind: control.KindRevoke, Subject: control.JTISubject("j-b1"), JTI: "j-b1",
			By: "u_ops", ByTenant: "*", Reason: "incident 7", At: at(81*time.Second + 5*ms)},
	}
	return f
}

// log is the fixture's events as a partitioned topic might interleave
// them: each call's events in order.
func (f fixture) log() []ledger.Event {
	var out []ledger.Event
	out = append(out, f.a[0], f.a[1], f.b[0], f.a[2], f.a[3], f.refusalA, f.refusalZ)
	out = append(out, f.b[1:]...)
	out = append(out, f.c...)
	out = append(out, f.d...)
	out = append(out, f.e...)
	return out
}

// batches splits the log into batches of n events, the actions in the
// last.
func (f fixture) batches(n int) []projections.Batch {
	log := f.log()
	var out []projections.Batch
	for i := 0; i < len(log); i += n {
		var b projections.Batch
		for j, e := range log[i:min(i+n, len(log))] {
			b.Events = append(b.Events, projections.Event{Event: e, Offset: int64(i + j), Produced: e.At})
		}
		out = append(out, b)
	}
	for i, a := range f.actions {
		out[len(out)-1].Actions = append(out[len(out)-1].Actions, projections.Action{Action: a, Offset: int64(i)})
	}
	return out
}

func write(t testing.TB, s *Store, bs []projections.Batch) {
	t.Helper()
	for _, b := range bs {
		if err := s.Write(context.Background(), b); err != nil {
			t.Fatalf("write: %v", err)
		}
	}
}

func last(evs []ledger.Event) projections.Call { return projections.CallOf(&evs[len(evs)-1]) }

func TestMigrateTwice(t *testing.T) {
	s := openStore(t)
	ctx := t.Context()
	v, err := s.SchemaVersion(ctx)
	if err != nil {
		t.Fatalf("schema version: %v", err)
	}
	if v != LatestVersion() || v == 0 {
		t.Fatalf("schema version after Migrate = %d, want %d", v, LatestVersion())
	}
	tablesNow := func() []string { return tablesLike(t, s, "%") }
	before := tablesNow()
	want := []string{"call_refs", "calls", "control_actions", "event_keys", "events", "projection_positions", "schema_migrations"}
	if diff := cmp.Diff(want, before); diff != "" {
		t.Errorf("tables (-want +got):\n%s", diff)
	}
	write(t, s, newFixture().batches(100))
	sums, err := s.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("migrate again: %v", err)
	}
	if v2, err := s.SchemaVersion(ctx); err != nil || v2 != v {
		t.Errorf("schema version after a second Migrate = %d, %v; want %d", v2, err, v)
	}
	if diff := cmp.Diff(before, tablesNow()); diff != "" {
		t.Errorf("tables changed by a second Migrate (-before +after):\n%s", diff)
	}
	var recorded uint64
	if err := s.conn.QueryRow(ctx, "SELECT count() FROM "+s.table("schema_migrations")).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if int(recorded) != v {
		t.Errorf("schema_migrations holds %d rows, want one per version (%d)", recorded, v)
	}
	sums2, err := s.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(sums, sums2); diff != "" {
		t.Errorf("checksums changed by a second Migrate (-before +after):\n%s", diff)
	}
}

// callTraceRefsVersion is the schema version that adds call_refs' call_id
// and trace_id rows.
const callTraceRefsVersion = 6

// deleteRows deletes the rows of table that cond selects, and waits for
// the mutation to be done.
func deleteRows(t *testing.T, s *Store, table, cond string) {
	t.Helper()
	ctx := t.Context()
	if err := s.conn.Exec(ctx, "ALTER TABLE "+s.table(table)+" DELETE WHERE "+cond); err != nil {
		t.Fatalf("delete from %s: %v", table, err)
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		var n uint64
		if err := s.conn.QueryRow(ctx, "SELECT count() FROM system.mutations WHERE database = ? AND table = ? AND is_done = 0", s.db, table).Scan(&n); err != nil {
			return err
		}
		if n > 0 {
			return fmt.Errorf("%d mutations of %s not done", n, table)
		}
		return nil
	})
}

// A database projected before call_refs held call ids and trace ids:
// Migrate fills them in from the events, the rows Write would have
// written, and the questions by call id and trace id answer as on a
// database written since.
func TestMigrateFillsCallAndTraceRefs(t *testing.T) {
	s := openStore(t)
	f := newFixture()
	write(t, s, f.batches(4))
	migrateAgain(t, s, callTraceRefsVersion, "kind IN ('call_id', 'trace_id')", projections.Filter{AllTenants: true, CallID: "call-b1"})
	check(t, s, f)
}

// migrateAgain takes s back to the schema version before version, with
// the call_refs rows where selects (those that version fills in) deleted,
// checks that q then finds no call, migrates, and checks that the
// checksums are those of the rows as Write wrote them.
func migrateAgain(t *testing.T, s *Store, version int, where string, q projections.Filter) {
	t.Helper()
	ctx := t.Context()
	want, err := s.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	deleteRows(t, s, "call_refs", where)
	deleteRows(t, s, "schema_migrations", fmt.Sprintf("version >= %d", version))
	if v, err := s.SchemaVersion(ctx); err != nil || v != version-1 {
		t.Fatalf("schema version before = %d, %v; want %d", v, err, version-1)
	}
	if br, err := s.BlastRadius(ctx, q); err != nil || br.Total != 0 {
		t.Fatalf("BlastRadius(%+v) before the migration = %d calls, %v; want none", q, br.Total, err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	got, err := s.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("checksums after the migration filled call_refs in (-written +filled):\n%s", diff)
	}
}

// toolDigestRefsVersion is the schema version that fills call_refs'
// tool_digest rows in from the events projected before.
const toolDigestRefsVersion = 10

// A database projected by a build that kept each event's tool digest but
// did not index it: Migrate fills the refs in from the requested events,
// the rows Write would have written, and the questions by tool digest
// answer as on a database written since.
func TestMigrateFillsToolDigestRefs(t *testing.T) {
	s := openStore(t)
	ctx := t.Context()
	cfg := projectionstest.LogConfig{Seed: 11, Calls: 200, Tenants: 3}
	log := projectionstest.Log(cfg)
	projectionstest.Write(t, s, log, 50)
	var digest string
	for _, e := range log {
		if projections.AdmittedUnder(&e, e.ToolDigest) && e.ToolDigest != "" {
			digest = e.ToolDigest
			break
		}
	}
	byDigest := projections.Filter{AllTenants: true, ToolDigest: digest}
	answer, err := s.BlastRadius(ctx, byDigest)
	if err != nil || answer.Total == 0 {
		t.Fatalf("BlastRadius by tool digest %q = %d calls, %v; want some", digest, answer.Total, err)
	}
	migrateAgain(t, s, toolDigestRefsVersion, "kind = 'tool_digest'", byDigest)
	if br, err := s.BlastRadius(ctx, byDigest); err != nil || br.Total != answer.Total {
		t.Errorf("BlastRadius by tool digest after the migration = %d calls, %v; want %d", br.Total, err, answer.Total)
	}
}

func TestSchemaVersionUnmigrated(t *testing.T) {
	s, err := Open(t.Context(), Config{DSN: chtest.DSN(t), Database: chtest.FreshDatabase(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if v, err := s.SchemaVersion(t.Context()); err != nil || v != 0 {
		t.Errorf("schema version of a database never migrated = %d, %v; want 0, nil", v, err)
	}
}

func TestOpenErrors(t *testing.T) {
	dsn := chtest.DSN(t)
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no DSN", Config{}, "DSN is required"},
		{"bad DSN", Config{DSN: "clickhouse://[::1"}, "parse DSN"},
		{"bad database name", Config{DSN: dsn, Database: "x; DROP DATABASE y"}, `database name "x; DROP DATABASE y"`},
		{"nobody listening", Config{DSN: "clickhouse://default@127.0.0.1:1/ledger?dial_timeout=2s"}, "clickhouse at 127.0.0.1:1 (database ledger)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Open(t.Context(), tc.cfg)
			if err == nil {
				s.Close()
				t.Fatalf("Open succeeded, want an error saying %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Open: %v; want it to say %q", err, tc.want)
			}
		})
	}
}

func TestDatabaseName(t *testing.T) {
	u, err := url.Parse(chtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path, database, want string
	}{
		{"/from_dsn", "", "from_dsn"},
		{"/from_dsn", "from_config", "from_config"},
		{"", "", DefaultDatabase},
	} {
		u.Path = tc.path
		s, err := Open(t.Context(), Config{DSN: u.String(), Database: tc.database})
		if err != nil {
			t.Fatalf("open %s: %v", u.Redacted(), err)
		}
		if got := s.Database(); got != tc.want {
			t.Errorf("database of DSN path %q and Config.Database %q = %q, want %q", tc.path, tc.database, got, tc.want)
		}
		s.Close()
	}
}

// question is one query and its answer, for comparing stores.
type question struct {
	name string
	ask  func(ctx context.Context, s *Store) (any, error)
}

func blast(f projections.Filter) question {
	return question{fmt.Sprintf("BlastRadius(%+v)", f), func(ctx context.Context, s *Store) (any, error) { return s.BlastRadius(ctx, f) }}
}

func outcomes(f projections.Filter, bucket time.Duration) question {
	return question{fmt.Sprintf("Outcomes(%+v, %s)", f, bucket), func(ctx context.Context, s *Store) (any, error) { return s.Outcomes(ctx, f, bucket) }}
}

func unresolved(f projections.Filter) question {
	return question{fmt.Sprintf("Unresolved(%+v)", f), func(ctx context.Context, s *Store) (any, error) { return s.Unresolved(ctx, f) }}
}

func trace(tenant, key string) question {
	return question{"Trace(" + tenant + "/" + key + ")", func(ctx context.Context, s *Store) (any, error) {
		return s.Trace(ctx, ledger.CallKey{TenantID: tenant, IdempotencyKey: key})
	}}
}

// expectations are the fixture's questions with the answers worked out
// by hand.
func expectations(f fixture) []struct {
	q    question
	want any
} {
	A, B, C, D, E := last(f.a), last(f.b), last(f.c), last(f.d), last(f.e)
	br := func(filter projections.Filter, calls ...projections.Call) projections.BlastRadius {
		nf, err := filter.Check()
		if err != nil {
			panic(err)
		}
		return projections.Summarize(nf, calls)
	}
	type qa = struct {
		q    question
		want any
	}
	var out []qa
	for _, tc := range []struct {
		f     projections.Filter
		calls []projections.Call
	}{
		{projections.Filter{Tenant: "acme", JTI: "j-a1"}, []projections.Call{A}},
		{projections.Filter{Tenant: "globex", JTI: "j-a1"}, nil},
		{projections.Filter{AllTenants: true, CredentialFamily: "refund_order:acme:1"}, []projections.Call{A, B}},
		{projections.Filter{AllTenants: true, CredentialFamily: "refund_order:acme:1", Since: at(60 * time.Second)}, []projections.Call{B}},
		{projections.Filter{AllTenants: true, PolicyVersion: "v7"}, []projections.Call{A, B, D}},
		{projections.Filter{AllTenants: true, PolicyVersion: "v7", Decision: "require_approval"}, []projections.Call{B, D}},
		// The refusal under a1 carries deny under v8: it is no call.
		{projections.Filter{Tenant: "acme", PolicyVersion: "v8", Decision: "deny"}, []projections.Call{C}},
		{projections.Filter{Tenant: "acme", Approver: "u_alice"}, []projections.Call{B}},
		{projections.Filter{Tenant: "globex", ApprovalID: "ap-d1"}, []projections.Call{D}},
		{projections.Filter{AllTenants: true, JTI: "j-b1", Approver: "u_alice"}, []projections.Call{B}},
		{projections.Filter{AllTenants: true, JTI: "j-a1", Approver: "u_alice"}, nil},
		{projections.Filter{Tenant: "acme"}, []projections.Call{A, B, C}},
		{projections.Filter{Tenant: "acme", Tool: "refund_order"}, []projections.Call{A, B}},
		{projections.Filter{AllTenants: true, Tool: "refund_order"}, []projections.Call{A, B, D}},
		{projections.Filter{AllTenants: true, Since: at(time.Hour)}, []projections.Call{E}},
		// [Since, Until): d1 was requested at +30s exactly.
		{projections.Filter{AllTenants: true, Until: at(30 * time.Second)}, []projections.Call{A, B, C}},
		{projections.Filter{AllTenants: true, Since: at(30 * time.Second)}, []projections.Call{D, E}},
		// Whole seconds: a1 was requested at +0.2s, in a window from +0s
		// to +1s.
		{projections.Filter{AllTenants: true, Since: at(0), Until: at(time.Second)}, []projections.Call{A}},
		{projections.Filter{AllTenants: true, Since: at(500 * time.Millisecond), Until: at(time.Second)}, []projections.Call{A}},
		{projections.Filter{AllTenants: true, Limit: 2}, []projections.Call{A, B, C, D, E}},
		{projections.Filter{Tenant: "nobody"}, nil},
		// Every event carries the call id and trace id: a1's executing
		// event at +2.1s is in a window from +2s; its refusal at +5s,
		// which carries them too, is no call.
		{projections.Filter{Tenant: "acme", CallID: "call-b1"}, []projections.Call{B}},
		{projections.Filter{AllTenants: true, CallID: "call-a1", Since: at(2 * time.Second)}, []projections.Call{A}},
		{projections.Filter{AllTenants: true, CallID: "call-a1", Since: at(4 * time.Second)}, nil},
		{projections.Filter{Tenant: "acme", CallID: "call-d1"}, nil},
		{projections.Filter{Tenant: "globex", TraceID: "trace-e1", Tool: "get_weather"}, []projections.Call{E}},
		{projections.Filter{Tenant: "globex", TraceID: "trace-e1", Tool: "refund_order"}, nil},
		// The state now narrows what matched.
		{projections.Filter{AllTenants: true, State: statemachine.StateApprovalPending}, []projections.Call{D}},
		{projections.Filter{Tenant: "acme", Tool: "refund_order", State: statemachine.StateSucceeded}, []projections.Call{A}},
		{projections.Filter{AllTenants: true, State: statemachine.StateDenied, Until: at(30 * time.Second)}, []projections.Call{C}},
		{projections.Filter{AllTenants: true, JTI: "j-b1", State: statemachine.StateOutcomeUnknown}, []projections.Call{B}},
		{projections.Filter{AllTenants: true, JTI: "j-b1", State: statemachine.StateSucceeded}, nil},
		{projections.Filter{AllTenants: true, State: statemachine.StateSucceeded, Limit: 1}, []projections.Call{A}},
	} {
		out = append(out, qa{blast(tc.f), br(tc.f, tc.calls...)})
	}
	oc := func(d time.Duration, tool string, state statemachine.State, n int) projections.OutcomeCount {
		return projections.OutcomeCount{Bucket: at(d), Tool: tool, State: state, Calls: n}
	}
	out = append(out,
		qa{outcomes(projections.Filter{AllTenants: true, Since: at(-time.Hour), Until: at(2 * time.Hour)}, time.Minute), []projections.OutcomeCount{
			oc(0, "get_weather", statemachine.StateDenied, 1),
			oc(0, "refund_order", statemachine.StateSucceeded, 1),
			oc(time.Minute, "refund_order", statemachine.StateOutcomeUnknown, 1),
			oc(time.Hour, "get_weather", statemachine.StateFailed, 1),
		}},
		qa{outcomes(projections.Filter{Tenant: "acme", Since: at(-24 * time.Hour), Until: at(24 * time.Hour)}, time.Hour), []projections.OutcomeCount{
			oc(0, "get_weather", statemachine.StateDenied, 1),
			oc(0, "refund_order", statemachine.StateOutcomeUnknown, 1),
			oc(0, "refund_order", statemachine.StateSucceeded, 1),
		}},
		// No window: from the epoch to now, which a bucket of a week
		// spans in fewer than MaxOutcomeBuckets.
		qa{outcomes(projections.Filter{Tenant: "acme"}, week), []projections.OutcomeCount{
			{Bucket: projections.BucketOf(t0, week), Tool: "get_weather", State: statemachine.StateDenied, Calls: 1},
			{Bucket: projections.BucketOf(t0, week), Tool: "refund_order", State: statemachine.StateOutcomeUnknown, Calls: 1},
			{Bucket: projections.BucketOf(t0, week), Tool: "refund_order", State: statemachine.StateSucceeded, Calls: 1},
		}},
		qa{outcomes(projections.Filter{AllTenants: true, Tool: "get_weather", Since: at(time.Minute), Until: at(2 * time.Hour)}, time.Second), []projections.OutcomeCount{
			oc(time.Hour+3*time.Second, "get_weather", statemachine.StateFailed, 1),
		}},
		qa{outcomes(projections.Filter{Tenant: "nobody", Since: at(0), Until: at(time.Hour)}, time.Second), []projections.OutcomeCount{}},
		qa{unresolved(projections.Filter{AllTenants: true}), []projections.Call{D, B}},
		qa{unresolved(projections.Filter{Tenant: "acme"}), []projections.Call{B}},
		qa{unresolved(projections.Filter{AllTenants: true, Tool: "get_weather"}), []projections.Call{}},
		qa{unresolved(projections.Filter{AllTenants: true, Limit: 1}), []projections.Call{D}},
		qa{trace("acme", "a1"), append([]ledger.Event{f.refusalA}, f.a...)},
		qa{trace("acme", "b1"), f.b},
		qa{trace("globex", "e1"), f.e},
		qa{trace("acme", "z9"), []ledger.Event{f.refusalZ}},
	)
	return out
}

// check asks every question of expectations and compares.
func check(t *testing.T, s *Store, f fixture) {
	t.Helper()
	for _, qa := range expectations(f) {
		got, err := qa.q.ask(t.Context(), s)
		if err != nil {
			t.Errorf("%s: %v", qa.q.name, err)
			continue
		}
		if diff := cmp.Diff(qa.want, got, cmpopts.EquateEmpty()); diff != "" {
			t.Errorf("%s (-want +got):\n%s", qa.q.name, diff)
		}
	}
	for _, key := range []ledger.CallKey{{TenantID: "acme", IdempotencyKey: "nothing"}, {TenantID: "globex", IdempotencyKey: "a1"}} {
		if _, err := s.Trace(t.Context(), key); !errors.Is(err, projections.ErrNotFound) {
			t.Errorf("Trace(%s): err = %v, want ErrNotFound", key, err)
		}
	}
}

func TestQueries(t *testing.T) {
	s := openStore(t)
	f := newFixture()
	write(t, s, f.batches(100))
	check(t, s, f)
}

// A question that needs more memory than the store allows one question
// is stopped by the server and answered ErrQuestionTooLarge, and the same
// question within the default bound is answered.
func TestQuestionMemoryBound(t *testing.T) {
	const calls = 400_000
	small := openStoreWith(t, Config{QuestionMaxMemory: 4 << 20})
	// Many waiting calls of one tenant, each row wide enough that their
	// latest states take far more than 4 MiB to fold.
	if err := small.conn.Exec(t.Context(), "INSERT INTO "+small.table("calls")+
		" (tenant_id, idempotency_key, seq, tool, state, resource, updated_at)"+
		" SELECT 't_a', concat('k-', toString(number)), 1, 'refund_order', 'outcome_unknown',"+
		" concat('order/', toString(number), '/', toString(cityHash64(number)), toString(cityHash64(number + 1))),"+
		" toDateTime(1773144000 + number % 3600) FROM system.numbers LIMIT "+fmt.Sprint(calls)); err != nil {
		t.Fatalf("insert: %v", err)
	}
	ample, err := Open(t.Context(), Config{DSN: chtest.DSN(t), Database: small.db})
	if err != nil {
		t.Fatal(err)
	}
	defer ample.Close()
	f := projections.Filter{Tenant: "t_a", Limit: 1}
	if _, err := small.Unresolved(t.Context(), f); !errors.Is(err, projections.ErrQuestionTooLarge) {
		t.Errorf("unresolved with a 4 MiB bound: err = %v; want ErrQuestionTooLarge", err)
	}
	got, err := ample.Unresolved(t.Context(), f)
	if err != nil || len(got) != 1 || got[0].State != statemachine.StateOutcomeUnknown {
		t.Errorf("unresolved with the default bound = %+v, %v; want one outcome_unknown call", got, err)
	}
	// A stricter limit the server gives this user (here through the
	// DSN's settings) is kept, not raised to the default bound.
	sep := "?"
	if strings.Contains(chtest.DSN(t), "?") {
		sep = "&"
	}
	strict, err := Open(t.Context(), Config{DSN: chtest.DSN(t) + sep + "max_memory_usage=4194304", Database: small.db})
	if err != nil {
		t.Fatal(err)
	}
	defer strict.Close()
	if _, err := strict.Unresolved(t.Context(), f); !errors.Is(err, projections.ErrQuestionTooLarge) {
		t.Errorf("unresolved with the server's 4 MiB limit: err = %v; want ErrQuestionTooLarge", err)
	}
}

func TestWriteTwice(t *testing.T) {
	s := openStore(t)
	f := newFixture()
	ctx := t.Context()
	write(t, s, f.batches(100))
	once, err := s.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Again, in other batches, as a projector that crashed before
	// committing would.
	write(t, s, f.batches(3))
	write(t, s, f.batches(7))
	check(t, s, f)
	twice, err := s.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(once, twice); diff != "" {
		t.Errorf("checksums after writing the log again (-once +twice):\n%s", diff)
	}
	// The checksums count distinct rows: every event once, the calls
	// once each, the actions once each.
	log := f.log()
	wantRows := map[string]uint64{"events": uint64(len(log)), "event_keys": uint64(len(log)), "calls": 5, "control_actions": 2}
	for table, n := range wantRows {
		if once[table].Rows != n {
			t.Errorf("checksum of %s counts %d rows, want %d", table, once[table].Rows, n)
		}
	}

	// A rebuild from the same log, in other batches, sums up the same.
	r := openStore(t)
	write(t, r, f.batches(5))
	rebuilt, err := r.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(once, rebuilt); diff != "" {
		t.Errorf("checksums of a rebuild (-live +rebuild):\n%s", diff)
	}
	// A log missing an event does not.
	p := openStore(t)
	bs := f.batches(100)
	bs[0].Events = bs[0].Events[:len(bs[0].Events)-1]
	write(t, p, bs)
	partial, err := p.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if cmp.Equal(once, partial) {
		t.Errorf("checksums of a log missing an event equal the whole log's: %v", partial)
	}
}

func TestOptimizeFinal(t *testing.T) {
	s := openStore(t)
	f := newFixture()
	ctx := t.Context()
	write(t, s, f.batches(4))
	write(t, s, f.batches(100))
	before, err := s.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// OPTIMIZE FINAL returns without merging when a background merge holds
	// the parts (ClickHouse 18.16 says nothing unless
	// optimize_throw_if_noop is set), so it is asked again until merged.
	var counts string
	for try := 0; ; try++ {
		for _, name := range []string{"events", "event_keys", "calls", "call_refs", "control_actions"} {
			if err := s.conn.Exec(ctx, "OPTIMIZE TABLE "+s.table(name)+" FINAL"); err != nil {
				t.Fatalf("optimize %s: %v", name, err)
			}
		}
		// Merged: calls keeps one row per call, events one per event.
		merged := true
		counts = ""
		for _, c := range []struct {
			table string
			want  uint64
		}{{"calls", 5}, {"events", uint64(len(f.log()))}} {
			var n uint64
			if err := s.conn.QueryRow(ctx, "SELECT count() FROM "+s.table(c.table)).Scan(&n); err != nil {
				t.Fatal(err)
			}
			merged = merged && n == c.want
			counts += fmt.Sprintf(" %s %d (want %d)", c.table, n, c.want)
		}
		if merged {
			break
		}
		if try == 50 {
			t.Fatalf("after 50 OPTIMIZE FINAL rounds:%s", counts)
		}
		time.Sleep(100 * time.Millisecond)
	}
	check(t, s, f)
	after, err := s.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(before, after); diff != "" {
		t.Errorf("checksums after OPTIMIZE FINAL (-before +after):\n%s", diff)
	}
}

func TestRefusalsOnlyInTrace(t *testing.T) {
	s := openStore(t)
	f := newFixture()
	ctx := t.Context()
	// Only the refusals.
	write(t, s, []projections.Batch{{Events: []projections.Event{{Event: f.refusalA}, {Event: f.refusalZ}}}})
	got, err := s.Trace(ctx, f.refusalA.Key())
	if err != nil {
		t.Fatalf("Trace of a refused key: %v", err)
	}
	if diff := cmp.Diff([]ledger.Event{f.refusalA}, got); diff != "" {
		t.Errorf("Trace of a refused key (-want +got):\n%s", diff)
	}
	for _, filter := range []projections.Filter{
		{Tenant: "acme"},
		{AllTenants: true, PolicyVersion: "v8"},
		{AllTenants: true, Tool: "refund_order"},
	} {
		br, err := s.BlastRadius(ctx, filter)
		if err != nil {
			t.Fatal(err)
		}
		if br.Total != 0 || len(br.Calls) != 0 || len(br.ByState) != 0 {
			t.Errorf("BlastRadius(%+v) of refusals only = %+v, want nothing", filter, br)
		}
	}
	if oc, err := s.Outcomes(ctx, projections.Filter{AllTenants: true}, week); err != nil || len(oc) != 0 {
		t.Errorf("Outcomes of refusals only = %+v, %v; want nothing", oc, err)
	}
	if u, err := s.Unresolved(ctx, projections.Filter{AllTenants: true}); err != nil || len(u) != 0 {
		t.Errorf("Unresolved of refusals only = %+v, %v; want nothing", u, err)
	}
	for _, table := range []string{"calls", "call_refs"} {
		var n uint64
		if err := s.conn.QueryRow(ctx, "SELECT count() FROM "+s.table(table)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("%s holds %d rows of refusals, want none", table, n)
		}
	}
}

// A key flooded with refusals that each name another tool (an agent can
// send thousands) still has a trace: its call's events, and its first
// and last refusals. Before, the trace read a range of the events table per tool,
// and the query outgrew ClickHouse's size limit: the call could not be
// read by its agents, the console or a responder.
func TestTraceOfAKeyRefusedUnderManyTools(t *testing.T) {
	s := openStore(t)
	f := newFixture()
	const tools = 5000
	evs := make([]projections.Event, 0, tools+len(f.a))
	for i := range tools {
		r := f.refusalA
		r.EventID = fmt.Sprintf("flood-%05d", i)
		r.Tool = fmt.Sprintf("t%d", i)
		r.At = f.refusalA.At.Add(time.Duration(i) * time.Millisecond)
		evs = append(evs, projections.Event{Event: r})
	}
	for _, e := range f.a {
		evs = append(evs, projections.Event{Event: e})
	}
	write(t, s, []projections.Batch{{Events: evs}})
	got, err := s.Trace(t.Context(), f.refusalA.Key())
	if err != nil {
		t.Fatalf("Trace of a key refused under %d tools: %v", tools, err)
	}
	if want := projections.MaxRefusals + len(f.a); len(got) != want {
		t.Fatalf("Trace returned %d events; want %d (%d refusals, then the call's)", len(got), want, projections.MaxRefusals)
	}
	half := projections.MaxRefusals / 2
	for i, want := range map[int]string{0: "flood-00000", half - 1: fmt.Sprintf("flood-%05d", half-1), half: fmt.Sprintf("flood-%05d", tools-half), 2*half - 1: fmt.Sprintf("flood-%05d", tools-1)} {
		if got[i].EventID != want {
			t.Errorf("refusal %d is %s; want %s (the first %d and the last %d)", i, got[i].EventID, want, half, half)
		}
	}
	if diff := cmp.Diff(f.a, got[projections.MaxRefusals:]); diff != "" {
		t.Errorf("the call's events (-want +got):\n%s", diff)
	}
}

// A user's trace of a key keeps that user's own refusals whatever
// another user of the tenant floods the key with: cut from every user's
// refusals, the flood pushed them out of the agent's view (and of its
// ?wait=). Its own flood is cut as Trace cuts any.
func TestUserTraceKeepsTheUsersOwnRefusals(t *testing.T) {
	s := openStore(t)
	f := newFixture()
	refusal := func(id, user string, i int) projections.Event {
		r := f.refusalA
		r.EventID, r.UserID = id, user
		r.At = f.refusalA.At.Add(time.Duration(i) * time.Millisecond)
		return projections.Event{Event: r}
	}
	const flood = 3 * projections.MaxRefusals
	var evs []projections.Event
	for i := range flood {
		evs = append(evs, refusal(fmt.Sprintf("flood-%05d", i), "u_flood", i))
		if i == flood/2 {
			evs = append(evs, refusal("own-1", "u_own", i), refusal("own-2", "u_own", i+1))
		}
	}
	for _, e := range f.a {
		evs = append(evs, projections.Event{Event: e})
	}
	write(t, s, []projections.Batch{{Events: evs}})
	ctx, key := t.Context(), f.refusalA.Key()
	ids := func(trace []ledger.Event) (refused []string, calls int) {
		for _, e := range trace {
			if e.Refusal() {
				refused = append(refused, e.EventID)
			} else {
				calls++
			}
		}
		return refused, calls
	}

	all, err := s.Trace(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if refused, _ := ids(all); slices.Contains(refused, "own-1") {
		t.Fatalf("Trace kept own-1 in the middle of a flood of %d: the fixture does not flood", flood)
	}
	own, err := s.UserTrace(ctx, key, "u_own")
	if err != nil {
		t.Fatal(err)
	}
	if refused, calls := ids(own); !slices.Equal(refused, []string{"own-1", "own-2"}) || calls != len(f.a) {
		t.Errorf("u_own's trace: refusals %v and %d of the call's events; want own-1, own-2 and the call's %d", refused, calls, len(f.a))
	}
	flooder, err := s.UserTrace(ctx, key, "u_flood")
	if err != nil {
		t.Fatal(err)
	}
	refused, calls := ids(flooder)
	half := projections.MaxRefusals / 2
	if len(refused) != projections.MaxRefusals || refused[0] != "flood-00000" || refused[half] != fmt.Sprintf("flood-%05d", flood-half) ||
		slices.Contains(refused, "own-1") || calls != len(f.a) {
		t.Errorf("u_flood's trace: %d refusals (%s ... %s), %d of the call's events; want its own first and last %d, and the call's %d",
			len(refused), refused[0], refused[len(refused)-1], calls, half, len(f.a))
	}
	if _, err := s.UserTrace(ctx, ledger.CallKey{TenantID: key.TenantID, IdempotencyKey: "flooded-only"}, "u_own"); !errors.Is(err, projections.ErrNotFound) {
		t.Errorf("UserTrace of an unknown key = %v; want ErrNotFound", err)
	}
	r := refusal("other-only", "u_flood", 0)
	r.IdempotencyKey = "refused-only"
	write(t, s, []projections.Batch{{Events: []projections.Event{r}}})
	if _, err := s.UserTrace(ctx, r.Key(), "u_own"); !errors.Is(err, projections.ErrNotFound) {
		t.Errorf("UserTrace of a key holding another user's refusal alone = %v; want ErrNotFound", err)
	}
}

func TestFilters(t *testing.T) {
	s := openStore(t)
	ctx := t.Context()
	for _, tc := range []struct {
		name string
		ask  func() error
		want error
	}{
		{"blast radius without tenant", func() error { _, err := s.BlastRadius(ctx, projections.Filter{JTI: "x"}); return err }, projections.ErrTenantRequired},
		{"outcomes without tenant", func() error { _, err := s.Outcomes(ctx, projections.Filter{}, time.Minute); return err }, projections.ErrTenantRequired},
		{"unresolved without tenant", func() error { _, err := s.Unresolved(ctx, projections.Filter{Tool: "x"}); return err }, projections.ErrTenantRequired},
		{"tenant and all tenants", func() error {
			_, err := s.BlastRadius(ctx, projections.Filter{Tenant: "a", AllTenants: true})
			return err
		}, projections.ErrInvalidFilter},
		{"outcomes by jti", func() error {
			_, err := s.Outcomes(ctx, projections.Filter{Tenant: "a", JTI: "x"}, time.Minute)
			return err
		}, projections.ErrInvalidFilter},
		{"sub-second bucket", func() error {
			_, err := s.Outcomes(ctx, projections.Filter{Tenant: "a"}, 1500*time.Millisecond)
			return err
		}, projections.ErrInvalidFilter},
		{"unresolved in a window", func() error {
			_, err := s.Unresolved(ctx, projections.Filter{Tenant: "a", Since: t0})
			return err
		}, projections.ErrInvalidFilter},
		{"trace of nothing", func() error {
			_, err := s.Trace(ctx, ledger.CallKey{TenantID: "a", IdempotencyKey: "k"})
			return err
		}, projections.ErrNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.ask(); !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

// TestValuesAreBound asks with values that would break a query built by
// pasting them into SQL.
func TestValuesAreBound(t *testing.T) {
	s := openStore(t)
	ctx := t.Context()
	f := newFixture()
	evil := `it's a \ 'quote' ?`
	e := f.a[0]
	e.TenantID, e.IdempotencyKey, e.EventID, e.JTI = evil, evil+"k", "ev-evil", evil
	write(t, s, []projections.Batch{{Events: []projections.Event{{Event: e}}}})
	got, err := s.Trace(ctx, e.Key())
	if err != nil {
		t.Fatalf("Trace: %v", err)
	}
	if diff := cmp.Diff([]ledger.Event{e}, got); diff != "" {
		t.Errorf("Trace (-want +got):\n%s", diff)
	}
	br, err := s.BlastRadius(ctx, projections.Filter{Tenant: evil})
	if err != nil {
		t.Fatal(err)
	}
	if br.Total != 1 || br.ByTenant[0].Value != evil {
		t.Errorf("BlastRadius by an odd tenant = %+v, want the one call", br)
	}
}

func TestSwap(t *testing.T) {
	ctx := t.Context()
	f := newFixture()
	live := openStore(t)
	// The live projection lost some events; the rebuild has all.
	bs := f.batches(100)
	write(t, live, []projections.Batch{{Events: bs[0].Events[:3]}})
	rebuild := openStore(t)
	write(t, rebuild, bs)
	want, err := rebuild.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := live.Swap(ctx, rebuild); err != nil {
		t.Fatalf("swap: %v", err)
	}
	got, err := live.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("checksums of the live database after the swap (-rebuild +live):\n%s", diff)
	}
	check(t, live, f)
	if v, err := live.SchemaVersion(ctx); err != nil || v != LatestVersion() {
		t.Errorf("schema version after the swap = %d, %v", v, err)
	}
	var left uint64
	if err := live.conn.QueryRow(ctx, "SELECT count() FROM system.tables WHERE database IN (?, ?) AND name LIKE '%_swapped_out'", live.db, rebuild.db).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d swapped-out tables left, want none", left)
	}
	if v, err := rebuild.SchemaVersion(ctx); err != nil || v != 0 {
		t.Errorf("the rebuild's database after the swap has schema version %d, %v; want it empty", v, err)
	}
	// A database not migrated cannot be swapped in.
	empty, err := Open(ctx, Config{DSN: chtest.DSN(t), Database: chtest.FreshDatabase(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer empty.Close()
	if err := live.Swap(ctx, empty); err == nil {
		t.Error("Swap with a database never migrated succeeded")
	}
	// But a database never migrated can take a rebuild: the first
	// deployment, or the way out of a swap that failed half way.
	again := openStore(t)
	write(t, again, bs)
	if err := empty.Swap(ctx, again); err != nil {
		t.Fatalf("swap a rebuild into a database never migrated: %v", err)
	}
	if got, err := empty.Checksums(ctx); err != nil || !cmp.Equal(want, got) {
		t.Errorf("checksums after swapping into a database never migrated = %v, %v; want %v", got, err, want)
	}
}

// A table the server refuses to drop for its size (over its
// max_table_size_to_drop, error 359, which tests cannot configure: the
// refusal is injected) does not fail a swap that took effect: Swap
// succeeds, so that rebuild --swap moves the group's offsets on, and
// warns which tables are left and how to drop them. Before, it failed
// after the rename. The next Swap, and Reset, stop at such a table
// before they change anything, saying what to do.
func TestSwapLeavesATableTheServerWillNotDrop(t *testing.T) {
	ctx := t.Context()
	f := newFixture()
	var logs bytes.Buffer
	live := openStoreWith(t, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	bs := f.batches(100)
	write(t, live, []projections.Batch{{Events: bs[0].Events[:3]}})
	rebuild := openStore(t)
	write(t, rebuild, bs)
	want, err := rebuild.Checksums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// tooLarge refuses to drop table of s while it exists, as the server
	// does a table over its max_table_size_to_drop.
	tooLarge := func(s *Store, table string) func(string) error {
		return func(name string) error {
			var n uint64
			if name != table {
				return nil
			}
			if err := s.conn.QueryRow(ctx, "SELECT count() FROM system.tables WHERE database = ? AND name = ?", s.db, name).Scan(&n); err != nil || n == 0 {
				return err
			}
			return &clickhouse.Exception{Code: 359, Message: "Table or Partition in " + s.table(name) + " was not dropped."}
		}
	}
	left := func() []string { return tablesLike(t, live, "%"+swapSuffix) }
	big := "events" + swapSuffix
	live.failDrop = tooLarge(live, big)
	if err := live.Swap(ctx, rebuild); err != nil {
		t.Fatalf("Swap, %s not dropped: %v; want it swapped", big, err)
	}
	if got, err := live.Checksums(ctx); err != nil || !cmp.Equal(want, got) {
		t.Errorf("checksums after the swap = %v, %v; want the rebuild's %v", got, err, want)
	}
	if got := left(); !cmp.Equal(got, []string{big}) {
		t.Errorf("tables left after the swap = %v; want [%s]", got, big)
	}
	if log := logs.String(); !strings.Contains(log, "level=WARN") || !strings.Contains(log, live.table(big)) || !strings.Contains(log, "force_drop_table") {
		t.Errorf("Swap logged:\n%s\nwant a warning naming %s and how to drop it", log, live.table(big))
	}

	// The next swap stops before the rename, saying how to drop it.
	again := openStore(t)
	write(t, again, bs)
	if err := live.Swap(ctx, again); err == nil || !strings.Contains(err.Error(), big) || !strings.Contains(err.Error(), "force_drop_table") {
		t.Errorf("Swap with %s left and not dropped: %v; want it refused, saying how to drop it", big, err)
	}
	if v, err := again.SchemaVersion(ctx); err != nil || v != LatestVersion() {
		t.Errorf("the rebuild after the refused swap is at version %d, %v; want its tables kept", v, err)
	}
	live.failDrop = nil
	if err := live.Swap(ctx, again); err != nil || len(left()) != 0 {
		t.Errorf("Swap once the server drops it: %v, tables left %v; want swapped, none left", err, left())
	}

	r := openStore(t)
	r.failDrop = tooLarge(r, "events")
	if err := r.Reset(ctx); err == nil || !strings.Contains(err.Error(), "max_table_size_to_drop") || !strings.Contains(err.Error(), "force_drop_table") {
		t.Errorf("Reset, events not dropped: %v; want it to say how to drop it", err)
	}
}

func TestDropDatabase(t *testing.T) {
	s := openStore(t)
	ctx := t.Context()
	if err := s.DropDatabase(ctx); err != nil {
		t.Fatal(err)
	}
	if v, err := s.SchemaVersion(ctx); err != nil || v != 0 {
		t.Errorf("schema version after DropDatabase = %d, %v; want 0", v, err)
	}
	if err := s.DropDatabase(ctx); err != nil {
		t.Errorf("DropDatabase twice: %v", err)
	}
}

// Reset drops the projection's tables and leaves any other table of the
// database alone.
func TestReset(t *testing.T) {
	s := openStore(t)
	ctx := t.Context()
	if err := s.conn.Exec(ctx, "CREATE TABLE "+s.table("not_ours")+" (x UInt8) ENGINE = Memory"); err != nil {
		t.Fatal(err)
	}
	if err := s.Reset(ctx); err != nil {
		t.Fatal(err)
	}
	if v, err := s.SchemaVersion(ctx); err != nil || v != 0 {
		t.Errorf("schema version after Reset = %d, %v; want 0", v, err)
	}
	var n uint64
	if err := s.conn.QueryRow(ctx, "SELECT count() FROM system.tables WHERE database = ?", s.db).Scan(&n); err != nil || n != 1 {
		t.Errorf("%d tables left after Reset (%v); want the one that is not the projection's", n, err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Errorf("Migrate after Reset: %v", err)
	}
	if n, err := s.EventRows(ctx); err != nil || n != 0 {
		t.Errorf("EventRows of a fresh projection = %d, %v; want 0", n, err)
	}
}

// policyPinVersion is the schema version that adds control_actions'
// policy_hash.
const policyPinVersion = 7

// A policy activation's pin is kept in control_actions, and the migration
// that adds its column runs again harmlessly (ClickHouse 18.16 has no ADD
// COLUMN IF NOT EXISTS): a Migrate that failed after the ALTER, its
// version not recorded, applies it once more.
func TestControlActionsKeepThePolicyPin(t *testing.T) {
	s := openStore(t)
	ctx := t.Context()
	pin := "sha256:" + strings.Repeat("ab", 32)
	at := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	write(t, s, []projections.Batch{{Actions: []projections.Action{
		{Action: ledger.ControlAction{V: 1, Kind: "activate_policy", Subject: "policy:active", Policy: "v42", PolicyHash: pin, By: "u_ops", ByTenant: "*", Reason: "rollout", At: at}},
		{Action: ledger.ControlAction{V: 1, Kind: "freeze", Subject: "tool:refund_order", Tool: "refund_order", By: "u_ops", ByTenant: "*", Reason: "incident", At: at}, Offset: 1},
	}}})
	read := func() map[string]string {
		t.Helper()
		rows, err := s.conn.Query(ctx, "SELECT subject, policy_hash FROM "+s.table("control_actions")+" FINAL ORDER BY subject")
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		got := map[string]string{}
		for rows.Next() {
			var subject, hash string
			if err := rows.Scan(&subject, &hash); err != nil {
				t.Fatal(err)
			}
			got[subject] = hash
		}
		return got
	}
	want := map[string]string{"policy:active": pin, "tool:refund_order": ""}
	if diff := cmp.Diff(want, read()); diff != "" {
		t.Errorf("control_actions' policy_hash (-want +got):\n%s", diff)
	}
	deleteRows(t, s, "schema_migrations", fmt.Sprintf("version = %d", policyPinVersion))
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate with the column there and its version unrecorded: %v", err)
	}
	if v, err := s.SchemaVersion(ctx); err != nil || v != LatestVersion() {
		t.Errorf("schema version %d, %v; want %d", v, err, LatestVersion())
	}
	if diff := cmp.Diff(want, read()); diff != "" {
		t.Errorf("control_actions' policy_hash after Migrate again (-want +got):\n%s", diff)
	}
}

// control_actions keeps each control record whole (action, its JSON), so
// that an audit tells an operator's action from a control service's: a
// copy written again after a lost race (reasserts), a tenant's freeze put
// back by a platform's unfreeze (restored). The other columns read the
// same for the operator's freeze and its copy.
func TestControlActionsKeepTheWholeRecord(t *testing.T) {
	s := openStore(t)
	ctx := t.Context()
	at := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	orig := ledger.ControlAction{V: 1, Kind: "freeze", Subject: "tool:refund_order@t_a", Tool: "refund_order", Tenant: "t_a", By: "u_ops", ByTenant: "t_a", Reason: "incident", At: at}
	again := orig
	again.At, again.Reasserts = at.Add(time.Second), &at
	write(t, s, []projections.Batch{{Actions: []projections.Action{{Action: orig}, {Action: again, Offset: 1}}}})
	rows, err := s.conn.Query(ctx, "SELECT action FROM "+s.table("control_actions")+" FINAL ORDER BY at, at_ns")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []ledger.ControlAction
	for rows.Next() {
		var raw string
		if err := rows.Scan(&raw); err != nil {
			t.Fatal(err)
		}
		var a ledger.ControlAction
		if err := json.Unmarshal([]byte(raw), &a); err != nil {
			t.Fatalf("action %q: %v", raw, err)
		}
		got = append(got, a)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]ledger.ControlAction{orig, again}, got); diff != "" {
		t.Errorf("control_actions' records (-want +got):\n%s", diff)
	}
}

// A schema file's ADD COLUMN must be of the one form Migrate can tell done
// when it runs again; the regexp knows that form before and after {db} is
// filled in.
func TestAddColumnForm(t *testing.T) {
	for _, tc := range []struct {
		st string
		ok bool
	}{
		{"ALTER TABLE {db}.control_actions ADD COLUMN policy_hash String DEFAULT ''", true},
		{"ALTER TABLE `ledger`.control_actions ADD COLUMN policy_hash String DEFAULT ''", true},
		{"ALTER TABLE {db}.t ADD COLUMN a String, ADD COLUMN b String", false},
		{"ALTER TABLE {db}.t ADD COLUMN a String,\nADD\nCOLUMN b String", false},
		{"ALTER TABLE {db}.t ADD COLUMN price Decimal(18, 2) DEFAULT 0", true},
		{"ALTER TABLE {db}.t ADD COLUMN a String, DROP COLUMN b", false},
		{"ALTER TABLE {db}.t ADD COLUMN IF NOT EXISTS a String", false},
		{"ALTER TABLE t ADD COLUMN a String", false},
	} {
		if _, _, got := addedColumn(tc.st); got != tc.ok {
			t.Errorf("%q matches: %v; want %v", tc.st, got, tc.ok)
		}
	}
	ms, err := migrations()
	if err != nil {
		t.Fatal(err)
	}
	if !ms[policyPinVersion-1].fills() {
		t.Errorf("migration %s, adding a column an older projector leaves empty, does not count as a fill", ms[policyPinVersion-1].name)
	}
}

// A store whose callers run as many queries at once as MaxConns allows
// still answers a ping (a readiness check) when MaxConns leaves room: with
// clickhouse-go's 10, ten slow queries made the ping wait for one of them.
func TestPingNotStarvedByQueries(t *testing.T) {
	for _, tc := range []struct {
		conns   int
		starved bool
	}{{0, true}, {16, false}} {
		t.Run(fmt.Sprintf("max conns %d", tc.conns), func(t *testing.T) {
			s := openStoreWith(t, Config{MaxConns: tc.conns})
			ctx, cancel := context.WithCancel(t.Context())
			var wg sync.WaitGroup
			running := make(chan struct{}, 10)
			for range 10 {
				wg.Go(func() {
					rows, err := s.conn.Query(ctx, "SELECT sleep(3)")
					running <- struct{}{}
					if err == nil {
						for rows.Next() {
						}
						rows.Close()
					}
				})
			}
			defer func() { cancel(); wg.Wait() }()
			// The queries are sent (Query returns once the server took
			// one), holding the pool's connections.
			for range 10 {
				select {
				case <-running:
				case <-time.After(10 * time.Second):
					t.Fatal("the slow queries did not start")
				}
			}
			pctx, pcancel := context.WithTimeout(t.Context(), time.Second)
			defer pcancel()
			err := s.Ping(pctx)
			if starved := err != nil; starved != tc.starved {
				t.Errorf("ping with 10 queries running and MaxConns %d: %v; want starved %v", tc.conns, err, tc.starved)
			}
		})
	}
}

// A DSN's max_open_conns wins over MaxConns, lower or higher: it is how an
// operator keeps a process under its share of the server's
// max_concurrent_queries.
func TestDSNMaxOpenConnsWins(t *testing.T) {
	dsn := chtest.DSN(t)
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	s := openStoreWith(t, Config{MaxConns: 16})
	lowered, err := Open(t.Context(), Config{DSN: dsn + sep + "max_open_conns=2", Database: s.db, MaxConns: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer lowered.Close()
	for _, tc := range []struct {
		name string
		s    *Store
		want int
	}{{"MaxConns", s, 16}, {"the DSN's", lowered, 2}} {
		if got := tc.s.conn.Stats().MaxOpenConns; got != tc.want {
			t.Errorf("%s: the pool opens %d connections at most; want %d", tc.name, got, tc.want)
		}
	}
}

// The query's own memory bound is told from the server's and the user's
// in both ClickHouse's wordings: 18.16 to 24.x name it "(for query)",
// later servers "Query memory limit". Before, only the first was known,
// and a current server's refusal of a broad question was answered as
// the projection being unavailable.
func TestQueryMemoryBoundWordings(t *testing.T) {
	for msg, want := range map[string]bool{
		"Memory limit (for query) exceeded: would use 1.00 GiB (attempt to allocate chunk of 4194304 bytes), maximum: 1.00 GiB":                     true,
		"Query memory limit exceeded: would use 1.00 GiB (attempt to allocate chunk of 4194304 bytes), maximum: 1.00 GiB.":                          true,
		"Memory limit (total) exceeded: would use 64.00 GiB (attempt to allocate chunk of 4217828 bytes), maximum: 64.00 GiB":                       false,
		"(total) memory limit exceeded: would use 2.07 GiB (attempt to allocate chunk of 4624776 bytes), current RSS 63.00 GiB, maximum: 60.00 GiB": false,
		"Memory limit (for user) exceeded: would use 89.61 GiB (attempt to allocate chunk of 4744104 bytes), maximum: 89.60 GiB":                    false,
		"User memory limit exceeded: would use 89.61 GiB (attempt to allocate chunk of 4744104 bytes), maximum: 89.60 GiB":                          false,
	} {
		if got := queryMemoryBound(msg); got != want {
			t.Errorf("queryMemoryBound(%q) = %t; want %t", msg, got, want)
		}
	}
}

// An event's body is the event as the log holds it: a field this build
// does not know (one a newer writer added without a new encoding) is
// kept, so that a later build's trace shows it and its rebuild has the
// live projection's checksums. Before, the body was the decoded event
// re-encoded, which dropped the field for good.
func TestEventBodyKeepsTheLogsBytes(t *testing.T) {
	e := projectionstest.NewGenerator(projectionstest.LogConfig{Seed: 3, Calls: 1}).Call(0)[0]
	enc, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	raw := append(bytes.TrimSuffix(bytes.TrimSpace(enc), []byte("}")), []byte(`,"field_of_a_newer_writer":"kept"}`)...)
	decoded, err := ledger.DecodeEvent(raw)
	if err != nil {
		t.Fatalf("the log's event with a field unknown here does not decode: %v", err)
	}
	r := make(tableRows)
	if err := eventRows(r, projections.Event{Event: decoded, Raw: raw}); err != nil {
		t.Fatal(err)
	}
	row := r[eventsTable.name][0]
	if body := row[len(row)-1]; body != string(raw) {
		t.Errorf("body %v; want the log's bytes %s", body, raw)
	}
}

// A trace reads the events table around the key's events, not across the
// gaps between them: a call compensated days after it ran is read by two
// short ranges, not by one that holds every event of the tenant's tool
// in those days. Before, the one range read them all, and a busy tool's
// trace of such a call timed out.
func TestTraceReadsAroundTheKeysEvents(t *testing.T) {
	s := openStore(t)
	f := newFixture()
	late := f.a[len(f.a)-1]
	late.EventID, late.Seq, late.Type, late.At = "ev-late", 5, statemachine.EventCompensated, late.At.Add(72*time.Hour)
	want := append(slices.Clone(f.a), late)
	var b projections.Batch
	for _, e := range want {
		b.Events = append(b.Events, projections.Event{Event: e})
	}
	write(t, s, []projections.Batch{b})
	// The tenant's other refunds, a second apart, between the call and
	// its compensation.
	const others = 100_000
	if err := s.conn.Exec(t.Context(), "INSERT INTO "+s.table("events")+" (tenant_id, tool, at, idempotency_key, event_id, body)"+
		" SELECT 'acme', 'refund_order', toDateTime(? + number), concat('other-', toString(number)), concat('other-', toString(number)), '{}'"+
		" FROM system.numbers LIMIT ?", f.a[0].At.Add(time.Hour).Unix(), others); err != nil {
		t.Fatal(err)
	}
	var read atomic.Uint64
	ctx := clickhouse.Context(t.Context(), clickhouse.WithProgress(func(p *clickhouse.Progress) { read.Add(p.Rows) }))
	got, err := s.Trace(ctx, late.Key())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("trace (-want +got):\n%s", diff)
	}
	// A range reads whole granules (8,192 rows) at its ends: a few of
	// them, far fewer than the others.
	t.Logf("the trace read %d rows", read.Load())
	if n := read.Load(); n == 0 || n >= others/2 {
		t.Errorf("the trace read %d rows; want some (progress reported), and far fewer than the %d events between the call's", n, others)
	}
}

// A trace's ranges: one per run of a tool's seconds no more than
// traceGap apart; past maxTraceRanges of those, one per tool; past
// maxTraceRanges tools, none (the caller reads one range over them all).
func TestTraceRanges(t *testing.T) {
	many := func(n int, step uint32) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = uint32(i) * step
		}
		return out
	}
	tools := make(map[string][]uint32)
	for i := range maxTraceRanges + 1 {
		tools[fmt.Sprintf("t%02d", i)] = []uint32{1}
	}
	for _, tc := range []struct {
		name   string
		points map[string][]uint32
		want   []traceRange
	}{
		{"one run", map[string][]uint32{"a": {100, 101, 400}}, []traceRange{{"a", 100, 400}}},
		{"a gap", map[string][]uint32{"a": {100, 101, 402, 259300}, "b": {5}}, []traceRange{{"a", 100, 101}, {"a", 402, 402}, {"a", 259300, 259300}, {"b", 5, 5}}},
		{"too many runs", map[string][]uint32{"a": many(maxTraceRanges+1, traceGap+1), "b": {5}}, []traceRange{{"a", 0, maxTraceRanges * (traceGap + 1)}, {"b", 5, 5}}},
		{"too many tools", tools, nil},
	} {
		if got := traceRanges(tc.points); !slices.Equal(got, tc.want) {
			t.Errorf("%s: traceRanges = %v; want %v", tc.name, got, tc.want)
		}
	}
}

// tablesLike lists the tables of s's database whose names are LIKE like,
// in order.
func tablesLike(t *testing.T, s *Store, like string) []string {
	t.Helper()
	rows, err := s.conn.Query(t.Context(), "SELECT name FROM system.tables WHERE database = ? AND name LIKE ? ORDER BY name", s.db, like)
	if err != nil {
		t.Fatalf("list tables: %v", err)
	}
	defer rows.Close()
	var names []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		names = append(names, n)
	}
	return names
}

// TestPositions: Write records a batch's ends after its rows, a batch of
// ends alone too (a partition of markers), and Positions is the highest
// end of each partition, as the rows stand before any merge.
func TestPositions(t *testing.T) {
	s := openStore(t)
	ctx := t.Context()
	if pos, err := s.Positions(ctx); err != nil || len(pos) != 0 {
		t.Fatalf("Positions of a fresh projection = %v, %v; want none", pos, err)
	}
	e := ledger.Event{V: 1, EventID: "e-pos", Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(), TenantID: "t_a", IdempotencyKey: "k-pos", Tool: "refund_order"}
	writes := []projections.Batch{
		{Events: []projections.Event{{Event: e, Partition: 0, Offset: 6}}, Ends: []projections.End{{Topic: "ev", Partition: 0, Next: 7}, {Topic: "ctl", Partition: 1, Next: 3}}},
		{Ends: []projections.End{{Topic: "ev", Partition: 0, Next: 9}}},
		// Written again after a crash: an older end changes nothing.
		{Events: []projections.Event{{Event: e, Partition: 0, Offset: 6}}, Ends: []projections.End{{Topic: "ev", Partition: 0, Next: 7}}},
	}
	for _, b := range writes {
		if err := s.Write(ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	pos, err := s.Positions(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(projections.Positions{"ev": {0: 9}, "ctl": {1: 3}}, pos); diff != "" {
		t.Errorf("Positions (-want +got):\n%s", diff)
	}
	if n, err := s.EventRows(ctx); err != nil || n != 2 {
		t.Errorf("events rows = %d, %v; want the event written twice", n, err)
	}
}

// TestChecksumsInBoundedMemory: a table's checksum streams its rows as
// merged, in memory that grows with its parts and columns, not its rows.
// Summed over SELECT DISTINCT, the server held a hash of every row at
// once (about 80 bytes each), and a projection of hundreds of millions of
// events failed its checksum at ClickHouse's default 10 GB bound: here,
// three million rows in two parts under 128 MiB, where the DISTINCT
// needed about twice that.
func TestChecksumsInBoundedMemory(t *testing.T) {
	s := openStore(t)
	const rows = 3_000_000
	insert := func(n int) {
		chtest.Exec(t, chtest.DSN(t), fmt.Sprintf("INSERT INTO %s (tenant_id, tool, at, idempotency_key, event_id, seq, body)"+
			" SELECT 't_a', 'refund_order', toDateTime('2026-01-01 00:00:00') + number %% 86400, toString(number), concat('e-', toString(number)), 1, ''"+
			" FROM system.numbers LIMIT %d", s.table("events"), n))
	}
	insert(rows)
	// One part, so that the bound below does not depend on when the
	// server merges: each part read costs a buffer per column.
	chtest.Exec(t, chtest.DSN(t), "OPTIMIZE TABLE "+s.table("events")+" FINAL")
	// Some written twice, in a part of their own: a projector that
	// wrote a batch and died before committing it.
	insert(1000)
	ctx := clickhouse.Context(t.Context(), clickhouse.WithSettings(clickhouse.Settings{
		"max_memory_usage": 128 << 20,
		"max_threads":      2,
		"max_block_size":   8192,
	}))
	sums, err := s.Checksums(ctx)
	if err != nil {
		t.Fatalf("Checksums under 128 MiB: %v", err)
	}
	if got := sums["events"].Rows; got != rows {
		t.Errorf("events checksum over %d rows; want the %d distinct events", got, rows)
	}
}

// Lacking compares a large month a share of its ids at a time, in bounded
// memory, and still counts every event and control subject the other
// database lacks, in every share and month. Before, a month's ids were
// held whole, twice: 600,000 of them wanted 318 MiB (the bound below is
// 64), and a deployment's month of events more than the server's own.
func TestLackingInBoundedMemory(t *testing.T) {
	live, rebuilt := openStore(t), openStore(t)
	live.lackingIDs = 100_000
	insert := func(s *Store, month string, n int, where string) {
		chtest.Exec(t, chtest.DSN(t), fmt.Sprintf("INSERT INTO %s (tenant_id, tool, at, idempotency_key, event_id, seq, body)"+
			" SELECT 't_a', 'refund_order', toDateTime('%s 00:00:00') + number %% 86400, toString(number), concat('e-%s-', toString(number)), 1, ''"+
			" FROM system.numbers WHERE %s LIMIT %d", s.table("events"), month, month, where, n))
	}
	insert(live, "2026-01-01", 600_000, "1")
	insert(live, "2026-02-01", 1000, "1")
	// The rebuild lacks 1 in 20,000 of January's (30, in every share)
	// and 1 in 250 of February's (4).
	insert(rebuilt, "2026-01-01", 600_000-30, "number % 20000 != 7")
	insert(rebuilt, "2026-02-01", 1000-4, "number % 250 != 3")
	for _, s := range []*Store{live, rebuilt} {
		chtest.Exec(t, chtest.DSN(t), "OPTIMIZE TABLE "+s.table("events")+" FINAL")
	}
	for _, subject := range []string{"tool:a", "tool:b", "family:c"} {
		chtest.Exec(t, chtest.DSN(t), fmt.Sprintf("INSERT INTO %s (subject, at, kind) SELECT '%s', now(), 'freeze'", live.table("control_actions"), subject))
		if subject != "family:c" {
			chtest.Exec(t, chtest.DSN(t), fmt.Sprintf("INSERT INTO %s (subject, at, kind) SELECT '%s', now(), 'freeze'", rebuilt.table("control_actions"), subject))
		}
	}
	ctx := clickhouse.Context(t.Context(), clickhouse.WithSettings(clickhouse.Settings{
		"max_memory_usage": 64 << 20,
		"max_threads":      2,
		"max_block_size":   8192,
	}))
	events, subjects, err := live.Lacking(ctx, rebuilt)
	if err != nil {
		t.Fatalf("Lacking under 64 MiB: %v", err)
	}
	if events != 34 || subjects != 1 {
		t.Errorf("Lacking = %d events, %d subjects; want 34 and 1", events, subjects)
	}
}
