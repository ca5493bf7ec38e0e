package pgstore

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/toolcall-ledger/ledger/processors"
)

// TestBatchPlansUnderBacklog: with statistics taken when authorized and
// executing rows were rare, and then a backlog of them, a claim or a
// completion of a batch is not planned through a status index, which
// would read the whole backlog for every batch (20,000 calls claimed at
// once completed at 406 calls/s that way, against 10,000 and more
// without). A claim goes through the primary key.
func TestBatchPlansUnderBacklog(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	s := open(t, Config{DSN: dsn, Schema: schema})
	defer s.Close()
	ctx := t.Context()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	insert := func(status string, from, n int) {
		t.Helper()
		_, err := s.pool.Exec(ctx, `INSERT INTO `+s.table+`
    (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, epoch, seq, logged_seq, created_at, updated_at)
SELECT 't_plan', 'k' || g, 'c' || g, 'h', 'create_ticket', 1, $1, 1, 2, 2, now(), now()
FROM generate_series($2::BIGINT, $3::BIGINT) AS g`, status, from, from+n-1)
		if err != nil {
			t.Fatal(err)
		}
	}
	insert("succeeded", 0, 30000)
	if _, err := s.pool.Exec(ctx, "ANALYZE "+s.table); err != nil {
		t.Fatal(err)
	}
	insert("authorized", 30000, 5000)
	insert("executing", 35000, 5000)

	b := newPlanBatch(500, func(i int) string { return fmt.Sprint("k", 30000+i) })
	for _, q := range []struct {
		name   string
		sql    string
		args   []any
		pkOnly bool
	}{
		{"claim", s.q.claim, b.claimArgs(), true},
		{"complete", s.q.complete, b.completeArgs(), false},
		{"journal revert", s.q.journalRevert, b.revertArgs(), false},
	} {
		plan, indexes := explain(t, s, q.name, q.sql, q.args...)
		if slices.ContainsFunc(indexes, func(n string) bool { return n != "execution_records_pkey" }) || (q.pkOnly && len(indexes) == 0) {
			t.Errorf("%s is planned through %v; want the primary key only:\n%s", q.name, indexes, plan)
		}
	}
}

// TestBatchPlansSmallTable: on a small table, where the planner would
// rather read the whole table than use an index, a batch still reads the
// table through its primary key: under SERIALIZABLE a sequential scan
// locks the whole table for conflict checks, and a batch that does it is
// aborted by every concurrent writer (the long stalls of a chaos run,
// whose tables hold a few thousand calls, were large completions retried
// until their deadline).
func TestBatchPlansSmallTable(t *testing.T) {
	dsn := testDSN(t)
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn)})
	defer s.Close()
	if s.CockroachDB() {
		t.Skip("CockroachDB has no table-wide predicate locks; its plans are its own")
	}
	ctx := t.Context()
	_, err := s.pool.Exec(ctx, `INSERT INTO `+s.table+`
    (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, epoch, seq, logged_seq, created_at, updated_at)
SELECT 't_plan', 'k' || g, 'c' || g, 'h', 'create_ticket', 1, CASE WHEN g % 5 = 0 THEN 'executing' ELSE 'succeeded' END,
       1, 2, 1, now(), now()
FROM generate_series(1, 4000) AS g`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(ctx, "ANALYZE "+s.table); err != nil {
		t.Fatal(err)
	}
	b := newPlanBatch(681, func(i int) string { return fmt.Sprint("k", 5*i) })
	for _, q := range []struct {
		name string
		sql  string
		args []any
	}{
		{"select keys", s.q.selectKeysForUpdate, []any{b.ts, b.ks}},
		{"claim", s.q.claim, b.claimArgs()},
		{"complete", s.q.complete, b.completeArgs()},
		{"mark logged", s.q.markLogged, []any{b.ts, b.ks, b.seqs, b.logged}},
		{"journal revert", s.q.journalRevert, b.revertArgs()},
	} {
		plan, indexes := explain(t, s, q.name, q.sql, q.args...)
		if bytes.Contains(plan, []byte(`"Seq Scan"`)) || !slices.Equal(slices.Compact(indexes), []string{"execution_records_pkey"}) {
			t.Errorf("%s is planned with a sequential scan or through %v; want the primary key only:\n%s", q.name, indexes, plan)
		}
	}
}

// TestSweepPlans: Expired, ByStatus of a listed status, TenantByStatus
// (and TenantLatestByStatus, the index read backwards, from its end or
// from a cursor) and Unlogged (from
// the oldest, or after a cursor) are answered through their partial
// indexes, on a table where nearly every call has ended and is logged (the
// indexes hold none of those), so that none reads the calls that ended;
// and TenantByStatus reads no other tenant's entries.
func TestSweepPlans(t *testing.T) {
	dsn := testDSN(t)
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn)})
	defer s.Close()
	ctx := t.Context()
	_, err := s.pool.Exec(ctx, `INSERT INTO `+s.table+`
    (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, epoch, seq, logged_seq, lease_until, created_at, updated_at)
SELECT 't_plan', 'k' || g, 'c' || g, 'h', 'create_ticket', 1,
       CASE WHEN g % 1000 = 0 THEN 'executing' WHEN g % 1000 = 1 THEN 'pending' WHEN g % 1000 = 2 THEN 'outcome_unknown' ELSE 'succeeded' END,
       1, 2, CASE WHEN g % 1000 = 3 THEN 1 ELSE 2 END, CASE WHEN g % 1000 = 0 THEN now() - INTERVAL '1 minute' END,
       now(), now() - g * INTERVAL '1 millisecond'
FROM generate_series(1, 30000) AS g`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(ctx, "ANALYZE "+s.table); err != nil {
		t.Fatal(err)
	}
	cursor := []any{time.Now().Add(-time.Minute), "t_plan", "k1003"}
	for _, q := range []struct {
		name, sql, index string
		args             []any
	}{
		{"expired", s.q.expired, leaseIndexName, []any{100}},
		{"expired after", s.q.expiredAfter, leaseIndexName, append([]any{100}, cursor...)},
		{"by status pending", s.q.byListedStatus[processors.StatusPending], statusIndexName, []any{100}},
		{"by status outcome_unknown", s.q.byListedStatus[processors.StatusOutcomeUnknown], statusIndexName, []any{100}},
		{"by status pending after", s.q.byListedStatusAfter[processors.StatusPending], statusIndexName, append([]any{100}, cursor...)},
		{"unlogged", s.q.unlogged, unloggedIndexName, []any{0, 100}},
		{"unlogged after", s.q.unloggedAfter, unloggedIndexName, append([]any{0, 100}, cursor...)},
	} {
		plan, indexes := explain(t, s, q.name, q.sql, q.args...)
		if !slices.Equal(indexes, []string{q.index}) {
			t.Errorf("%s is planned through %v; want %s only:\n%s", q.name, indexes, q.index, plan)
		}
	}
	// The sweep of stale journal entries finds them through the journal's
	// index, not by reading every entry.
	if plan, indexes := explain(t, s, "journal take stale", s.q.journalTakeStale, 0, 100); !slices.Contains(indexes, journalIndexName) || bytes.Contains(plan, []byte(`"Seq Scan"`)) {
		t.Errorf("journal take stale is planned through %v; want %s, without a sequential scan:\n%s", indexes, journalIndexName, plan)
	}
	// And they answer: 30 of each.
	for _, st := range []processors.Status{processors.StatusPending, processors.StatusOutcomeUnknown} {
		if got, err := s.ByStatus(ctx, st, 100); err != nil || len(got) != 30 {
			t.Errorf("ByStatus(%s) = %d records, %v; want 30", st, len(got), err)
		}
	}
	if got, err := s.Expired(ctx, 100); err != nil || len(got) != 30 {
		t.Errorf("Expired() = %d records, %v; want 30", len(got), err)
	}
	if got, err := s.Unlogged(ctx, 0, processors.Cursor{}, 100); err != nil || len(got) != 30 {
		t.Errorf("Unlogged() = %d records, %v; want 30", len(got), err)
	}

	// A tenant's listing reads its own entries only, however many
	// another tenant has: t_busy's 20,000 pending calls, all older than
	// t_plan's, are not read (and filtered out) on the way to t_plan's
	// 30. Nor does the busy tenant's own listing read the index in its
	// ByStatus order: the tenant's range is in the listing's order.
	_, err = s.pool.Exec(ctx, `INSERT INTO `+s.table+`
    (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, epoch, seq, logged_seq, created_at, updated_at)
SELECT 't_busy', 'k' || g, 'c' || g, 'h', 'create_ticket', 1, 'pending', 1, 2, 2,
       now(), now() - INTERVAL '1 hour' - g * INTERVAL '1 millisecond'
FROM generate_series(1, 20000) AS g`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(ctx, "ANALYZE "+s.table); err != nil {
		t.Fatal(err)
	}
	for _, st := range []processors.Status{processors.StatusPending, processors.StatusOutcomeUnknown, processors.StatusRejected, processors.StatusExpired} {
		for _, tenant := range []string{"t_plan", "t_busy"} {
			name := fmt.Sprintf("tenant %s by status %s", tenant, st)
			for _, q := range []struct {
				name, sql string
				args      []any
			}{
				{name, s.q.tenantByListedStatus[st], []any{tenant, 100}},
				{name + ", newest first", s.q.tenantLatestByListedStatus[st], []any{tenant, 100}},
				{name + ", newest first before a cursor", s.q.tenantLatestByListedStatusBefore[st], []any{tenant, 100, time.Now().Add(-time.Minute), "k1003"}},
			} {
				plan, indexes := explain(t, s, q.name, q.sql, q.args...)
				if !slices.Equal(indexes, []string{tenantStatusIndexName}) || bytes.Contains(plan, []byte(`Sort"`)) {
					t.Errorf("%s is planned through %v; want %s only, without a sort:\n%s", q.name, indexes, tenantStatusIndexName, plan)
				}
			}
		}
	}
	if got, err := s.TenantByStatus(ctx, "t_plan", processors.StatusPending, 100); err != nil || len(got) != 30 {
		t.Errorf("TenantByStatus(t_plan, pending) = %d records, %v; want 30", len(got), err)
	}
}

// planBatch is a batch's statement arguments, for EXPLAIN: tenant
// t_plan, the keys key(i), hash h, epoch 1, completions to succeeded.
type planBatch struct {
	ts, ks, hs, owners, statuses       []string
	jtis, families                     []string
	leases, logged, ords, epochs, seqs []int64
	blobs                              [][]byte
	journaled                          []bool
}

func newPlanBatch(n int, key func(i int) string) planBatch {
	var b planBatch
	for i := range n {
		b.ts, b.ks, b.hs, b.owners = append(b.ts, "t_plan"), append(b.ks, key(i)), append(b.hs, "h"), append(b.owners, "x")
		b.jtis, b.families = append(b.jtis, "jti"), append(b.families, "family")
		b.leases, b.ords, b.epochs, b.seqs = append(b.leases, 1e6), append(b.ords, int64(i)), append(b.epochs, 1), append(b.seqs, 4)
		b.logged = append(b.logged, 2)
		b.statuses, b.blobs = append(b.statuses, "succeeded"), append(b.blobs, []byte("[]"))
		b.journaled = append(b.journaled, true)
	}
	return b
}

func (b planBatch) claimArgs() []any {
	return []any{b.ts, b.ks, b.hs, b.owners, b.leases, b.logged, b.ords, b.jtis, b.families}
}

func (b planBatch) completeArgs() []any {
	return []any{b.ts, b.ks, b.epochs, b.statuses, b.ords, b.blobs, b.seqs, b.blobs, b.ords, b.journaled}
}

// revertArgs are the journal revert's: the batch's completions, from 2.
func (b planBatch) revertArgs() []any {
	return []any{b.ts, b.ks, b.epochs, b.seqs, b.logged}
}

// explain returns the plan of sql with args (EXPLAIN (FORMAT JSON)) and
// the indexes it reads.
func explain(t *testing.T, s *Store, name, sql string, args ...any) ([]byte, []string) {
	t.Helper()
	var plan []byte
	if err := s.pool.QueryRow(t.Context(), "EXPLAIN (FORMAT JSON) "+sql, args...).Scan(&plan); err != nil {
		t.Fatalf("explain %s: %v", name, err)
	}
	var indexes []string
	collectIndexes(t, plan, &indexes)
	return plan, indexes
}

// collectIndexes appends every "Index Name" of an EXPLAIN (FORMAT JSON)
// plan.
func collectIndexes(t *testing.T, plan []byte, out *[]string) {
	t.Helper()
	var v any
	if err := json.Unmarshal(plan, &v); err != nil {
		t.Fatal(err)
	}
	var walk func(any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if name, ok := v["Index Name"].(string); ok {
				*out = append(*out, name)
			}
			for _, c := range v {
				walk(c)
			}
		case []any:
			for _, c := range v {
				walk(c)
			}
		}
	}
	walk(v)
}

// TestDeadlockRetried: PostgreSQL's answer to a deadlock (40P01, one
// transaction aborted) is retried whole like a serialization failure,
// and a deadlock that persists still fails with its own SQLSTATE.
func TestDeadlockRetried(t *testing.T) {
	dsn := testDSN(t)
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn), MaxRetries: 3})
	defer s.Close()
	var n int
	err := s.inTx(t.Context(), "deadlocks once", pgx.ReadOnly, func(context.Context, pgx.Tx) error {
		n++
		if n == 1 {
			return &pgconn.PgError{Code: codeDeadlock, Message: "synthetic deadlock"}
		}
		return nil
	})
	if err != nil || n != 2 {
		t.Errorf("inTx = %v after %d attempts; want nil after 2", err, n)
	}
	n = 0
	err = s.inTx(t.Context(), "always deadlocks", pgx.ReadOnly, func(context.Context, pgx.Tx) error {
		n++
		return &pgconn.PgError{Code: codeDeadlock, Message: "synthetic deadlock"}
	})
	if n != 4 || sqlState(err) != codeDeadlock {
		t.Errorf("inTx = %v after %d attempts; want SQLSTATE %s after 4", err, n, codeDeadlock)
	}
}
