package pgstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/storetest"
)

func testDSN(t testing.TB) string { return storetest.PGDSN(t) }

func newSchema(t testing.TB, dsn string) string { return storetest.FreshSchema(t, dsn) }

func open(t testing.TB, cfg Config) *Store {
	t.Helper()
	s, err := Open(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Open() = %v", err)
	}
	return s
}

// addOlderIndexes creates on s's table the full status indexes that
// builds before the partial ones created (obsoleteIndexes), as such a
// build left them.
func addOlderIndexes(t testing.TB, s *Store) {
	t.Helper()
	for i, cols := range []string{"(status, lease_until)", "(status, updated_at)"} {
		stmt := "CREATE INDEX " + pgx.Identifier{obsoleteIndexes[i]}.Sanitize() + " ON " + s.table + " " + cols
		if _, err := s.pool.Exec(t.Context(), stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
}

func TestContract(t *testing.T) {
	dsn := testDSN(t)
	storetest.Run(t, func(t *testing.T) processors.Store {
		return open(t, Config{DSN: dsn, Schema: newSchema(t, dsn)})
	})
}

func TestOpenValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
	}{
		{"no DSN", Config{}},
		{"negative retries", Config{DSN: "postgres://x@127.0.0.1/x", MaxRetries: -1}},
		{"negative conns", Config{DSN: "postgres://x@127.0.0.1/x", MaxConns: -1}},
		{"unparsable DSN", Config{DSN: "postgres://u:hunter2@127.0.0.1:notaport/x"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Open(t.Context(), tc.cfg)
			if err == nil {
				t.Fatalf("Open(%s) = nil error; want an error", tc.name)
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Errorf("Open error %q leaks the DSN's password", err)
			}
		})
	}
}

// TestMigrate: the DDL is idempotent, quotes the schema name, and the
// dedupe rests on the primary key, not on isolation.
func TestMigrate(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn) + ` Odd "Name"`
	t.Cleanup(func() { storetest.DropSchema(t, dsn, schema) })
	s := open(t, Config{DSN: dsn, Schema: schema})
	defer s.Close()
	ctx := t.Context()

	for i := range 2 {
		if err := s.Migrate(ctx); err != nil {
			t.Fatalf("Migrate() run %d = %v; want nil (idempotent)", i+2, err)
		}
	}
	var version string
	if err := s.pool.QueryRow(ctx, "SELECT version()").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if got, want := s.CockroachDB(), strings.Contains(version, "CockroachDB"); got != want {
		t.Errorf("CockroachDB() = %v for %q; want %v", got, version, want)
	}

	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
	if _, err := s.Admit(ctx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized}}); err != nil {
		t.Fatalf("Admit in schema %q = %v", schema, err)
	}
	// A plain INSERT of the same key, bypassing ON CONFLICT, must be
	// refused by the constraint.
	_, err := s.pool.Exec(ctx, "INSERT INTO "+s.table+` (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, created_at, updated_at)
VALUES ($1, $2, 'c2', 'h2', 'x', 1, 'authorized', now(), now())`, k.TenantID, k.IdempotencyKey)
	if sqlState(err) != "23505" {
		t.Errorf("duplicate INSERT = %v; want a unique violation (23505)", err)
	}
	// And the store's own status check holds in the database too.
	_, err = s.pool.Exec(ctx, "UPDATE "+s.table+" SET status = 'bogus'")
	if sqlState(err) != "23514" {
		t.Errorf("UPDATE to an unknown status = %v; want a check violation (23514)", err)
	}
	// Unlogged's partial index, with its predicate.
	var def string
	if err := s.pool.QueryRow(ctx, "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = $2", schema, unloggedIndexName).Scan(&def); err != nil {
		t.Fatalf("read index %s: %v", unloggedIndexName, err)
	}
	if !strings.Contains(def, "(updated_at) WHERE (logged_seq < seq)") {
		t.Errorf("index %s = %q; want a partial index on (updated_at) WHERE logged_seq < seq", unloggedIndexName, def)
	}
	// Expired's, ByStatus's and TenantByStatus's indexes: partial, so
	// that the statuses every call passes through write no entry in them.
	const listed = " WHERE (status = ANY (ARRAY['pending'::text, 'outcome_unknown'::text, 'parked'::text, 'rejected'::text, 'expired'::text, 'compensated'::text]))"
	for ix, want := range map[string]string{
		leaseIndexName:        "(lease_until) WHERE (status = 'executing'::text)",
		statusIndexName:       "(status, updated_at)" + listed,
		tenantStatusIndexName: "(tenant_id, status, updated_at, idempotency_key)" + listed,
	} {
		if err := s.pool.QueryRow(ctx, "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = $2", schema, ix).Scan(&def); err != nil {
			t.Fatalf("read index %s: %v", ix, err)
		}
		if !strings.HasSuffix(def, want) {
			t.Errorf("index %s = %q; want it to end %q", ix, def, want)
		}
	}
}

// TestMigrateCurrentWaitsForNoWriter: a process that starts (Open, and
// so Migrate) while another holds a write transaction open on the store's
// tables, as one stalled mid-transaction does, starts at once, because a
// schema that is already this build's gets no DDL. On PostgreSQL, CREATE
// INDEX IF NOT EXISTS of an existing index waited for that transaction,
// and every writer after it waited behind. (CockroachDB takes no table
// locks: there the test passes either way.)
func TestMigrateCurrentWaitsForNoWriter(t *testing.T) {
	dsn := testDSN(t)
	cfg := Config{DSN: dsn, Schema: newSchema(t, dsn)}
	s := open(t, cfg)
	defer s.Close()
	ctx := t.Context()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// Statements that write nothing still take the tables' write locks,
	// which a transaction keeps until it ends.
	for _, stmt := range []string{
		"UPDATE " + s.table + " SET seq = seq WHERE false",
		"DELETE FROM " + s.journal + " WHERE false",
		"INSERT INTO " + s.rateTable() + " (bucket, tat) VALUES ('held', now())",
	} {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	// Far longer than a start takes; the old Migrate waited for good.
	octx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	s2, err := Open(octx, cfg)
	if err != nil {
		t.Fatalf("Open while another session's write transaction is open = %v; want it to start without waiting for that transaction", err)
	}
	defer s2.Close()
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
	if _, err := s2.Admit(octx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized}}); err != nil {
		t.Errorf("Admit through the new store while the transaction is open = %v", err)
	}
}

// TestMigrateDropsObsoleteIndexes: the full status indexes an older build
// created are reported by the checker and dropped by the next Migrate,
// which leaves the rows and the current indexes as they were.
func TestMigrateDropsObsoleteIndexes(t *testing.T) {
	for _, qualified := range []bool{true, false} {
		t.Run(fmt.Sprint("qualified=", qualified), func(t *testing.T) {
			dsn := testDSN(t)
			schema := newSchema(t, dsn)
			cfg := Config{DSN: dsn, Schema: schema}
			if qualified {
				// A name that needs quoting, in DROP INDEX too.
				schema += ` Odd "Name"`
				t.Cleanup(func() { storetest.DropSchema(t, dsn, schema) })
				cfg.Schema = schema
			} else {
				// Unqualified: the table resolves through the
				// search_path, which names the schema.
				open(t, cfg).Close()
				cfg = Config{DSN: dsn + sep(dsn) + "search_path=" + schema}
			}
			s := open(t, cfg)
			defer s.Close()
			ctx := t.Context()
			c := newChecker(t, cfg)
			addOlderIndexes(t, s)
			k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
			if _, err := s.Admit(ctx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusPending}}); err != nil {
				t.Fatal(err)
			}
			st, err := c.Schema(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(st.ObsoleteIndexes, obsoleteIndexes) || !st.Current() {
				t.Errorf("before Migrate: ObsoleteIndexes = %v, Current() = %v; want %v, true", st.ObsoleteIndexes, st.Current(), obsoleteIndexes)
			}
			for i := range 2 {
				if err := s.Migrate(ctx); err != nil {
					t.Fatalf("Migrate() run %d = %v", i+1, err)
				}
			}
			if st, err = c.Schema(ctx); err != nil || len(st.ObsoleteIndexes) != 0 || !st.Current() {
				t.Errorf("after Migrate: Schema() = %+v, %v; want no obsolete index, current", st, err)
			}
			if got, err := s.ByStatus(ctx, processors.StatusPending, 10); err != nil || len(got) != 1 || got[0].Key != k {
				t.Errorf("ByStatus(pending) after Migrate = %v, %v; want the one record", got, err)
			}
		})
	}
}

// TestMigrateAddsTenantStatusIndex: a table as the build before the
// tenant status index left it (every index but that one), holding pending
// calls, gets the index at the next Open, and TenantByStatus answers the
// same before and after.
func TestMigrateAddsTenantStatusIndex(t *testing.T) {
	dsn := testDSN(t)
	cfg := Config{DSN: dsn, Schema: newSchema(t, dsn)}
	s := open(t, cfg)
	ctx := t.Context()
	drop := "DROP INDEX " + pgx.Identifier{cfg.Schema, tenantStatusIndexName}.Sanitize()
	if _, err := s.pool.Exec(ctx, drop); err != nil {
		t.Fatalf("%s: %v", drop, err)
	}
	var as []processors.Admission
	for i, tenant := range []string{"t_acme", "t_other", "t_acme"} {
		as = append(as, processors.Admission{Key: ledger.CallKey{TenantID: tenant, IdempotencyKey: fmt.Sprint("k", i)}, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusPending})
	}
	if _, err := s.Admit(ctx, as); err != nil {
		t.Fatal(err)
	}
	before, err := s.TenantByStatus(ctx, "t_acme", processors.StatusPending, 10)
	if err != nil || len(before) != 2 {
		t.Fatalf("TenantByStatus(t_acme) without the index = %d records, %v; want 2", len(before), err)
	}
	c := newChecker(t, cfg)
	if st, err := c.Schema(ctx); err != nil || !slices.Equal(st.MissingIndexes, []string{tenantStatusIndexName}) || st.Current() {
		t.Fatalf("Schema() without the index = %+v, %v; want it missing", st, err)
	}
	s.Close()

	s = open(t, cfg) // runs Migrate
	defer s.Close()
	if st, err := c.Schema(ctx); err != nil || !st.Current() {
		t.Errorf("Schema() after Open = %+v, %v; want current", st, err)
	}
	after, err := s.TenantByStatus(ctx, "t_acme", processors.StatusPending, 10)
	if err != nil || !slices.EqualFunc(after, before, func(a, b processors.Record) bool { return a.Key == b.Key }) {
		t.Errorf("TenantByStatus(t_acme) after Open = %v, %v; want the records listed before", after, err)
	}
}

// oldTableDDL is execution_records as builds before 'expired' created it:
// its status check lacks 'expired'. Frozen here; do not update it.
const oldTableDDL = `CREATE TABLE %s (
    tenant_id       TEXT        NOT NULL,
    idempotency_key TEXT        NOT NULL,
    call_id         TEXT        NOT NULL,
    arguments_hash  TEXT        NOT NULL,
    tool            TEXT        NOT NULL,
    tool_version    BIGINT      NOT NULL,
    arguments       BYTEA,
    deadline_at     TIMESTAMPTZ,
    status          TEXT        NOT NULL,
    epoch           BIGINT      NOT NULL DEFAULT 0,
    attempt         BIGINT      NOT NULL DEFAULT 0,
    lease_owner     TEXT        NOT NULL DEFAULT '',
    lease_until     TIMESTAMPTZ,
    result          BYTEA,
    seq             BIGINT      NOT NULL DEFAULT 0,
    logged_seq      BIGINT      NOT NULL DEFAULT 0,
    outbox          BYTEA,
    created_at      TIMESTAMPTZ NOT NULL,
    updated_at      TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (tenant_id, idempotency_key),
    CONSTRAINT execution_records_status CHECK (status IN
        ('authorized', 'denied', 'pending', 'executing', 'succeeded', 'failed', 'outcome_unknown'))
)`

// oldTable creates, in a schema of its own, the table of oldTableDDL with
// one row (key "old", succeeded, arguments hash "h"), and returns the
// store's DSN, the schema and a connection to it.
func oldTable(t *testing.T) (dsn, schema string, conn *pgx.Conn) {
	t.Helper()
	dsn = testDSN(t)
	schema = newSchema(t, dsn)
	ctx := t.Context()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.WithoutCancel(ctx)) })
	table := pgx.Identifier{schema, tableName}.Sanitize()
	for _, stmt := range []string{
		"CREATE SCHEMA " + pgx.Identifier{schema}.Sanitize(),
		fmt.Sprintf(oldTableDDL, table),
		"INSERT INTO " + table + ` (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, created_at, updated_at)
VALUES ('t_acme', 'old', 'c', 'h', 'x', 1, 'succeeded', now(), now())`,
	} {
		if _, err := conn.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	return dsn, schema, conn
}

// TestMigrateStatusCheck: on a table an older build created, Migrate
// widens the status check so that a call can complete as expired (it
// failed with 23514 before), keeps the rows, keeps refusing unknown
// statuses, and leaves an up-to-date check alone.
func TestMigrateStatusCheck(t *testing.T) {
	dsn, schema, conn := oldTable(t)
	ctx := t.Context()
	// The bug, as it was: the old check refuses 'expired'.
	if _, err := conn.Exec(ctx, "UPDATE "+pgx.Identifier{schema, tableName}.Sanitize()+" SET status = 'expired'"); sqlState(err) != "23514" {
		t.Fatalf("UPDATE to expired under the old check = %v; want 23514 (the test's premise)", err)
	}

	s := open(t, Config{DSN: dsn, Schema: schema}) // runs Migrate
	defer s.Close()
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
	if _, err := s.Admit(ctx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized}}); err != nil {
		t.Fatal(err)
	}
	c, err := s.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	applied, err := s.Complete(ctx, []processors.Completion{{Key: k, Epoch: c[0].Record.Epoch, Status: processors.StatusExpired, Seq: 3, Outbox: []byte("x")}})
	if err != nil || !applied[0] {
		t.Fatalf("Complete(expired) after Migrate = %v, %v; want applied", applied, err)
	}
	if r, err := s.Get(ctx, k); err != nil || r.Status != processors.StatusExpired {
		t.Errorf("Get = %q, %v; want expired", r.Status, err)
	}
	if r, err := s.Get(ctx, ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "old"}); err != nil || r.Status != processors.StatusSucceeded {
		t.Errorf("Get(the old row) = %q, %v; want it kept, succeeded", r.Status, err)
	}
	if _, err := s.pool.Exec(ctx, "UPDATE "+s.table+" SET status = 'bogus'"); sqlState(err) != "23514" {
		t.Errorf("UPDATE to an unknown status after Migrate = %v; want a check violation (23514)", err)
	}
	// Checked against the rows there, not only against later writes
	// (on PostgreSQL it is added NOT VALID, then validated).
	var validated bool
	if err := s.pool.QueryRow(ctx, "SELECT convalidated FROM pg_catalog.pg_constraint WHERE conrelid = $1::TEXT::REGCLASS AND conname = $2", s.table, statusCheckName).Scan(&validated); err != nil || !validated {
		t.Errorf("the widened status check: validated %v, %v; want validated", validated, err)
	}

	// Up to date now: Migrate does not replace the constraint again (its
	// oid would change).
	constraintOID := func() uint32 {
		t.Helper()
		var oid uint32
		if err := s.pool.QueryRow(ctx, "SELECT oid FROM pg_catalog.pg_constraint WHERE conrelid = $1::TEXT::REGCLASS AND conname = $2", s.table, statusCheckName).Scan(&oid); err != nil {
			t.Fatalf("read the status check: %v", err)
		}
		return oid
	}
	before := constraintOID()
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate() again = %v", err)
	}
	if after := constraintOID(); after != before {
		t.Errorf("status check oid %d -> %d after Migrate on an up-to-date table; want it left alone", before, after)
	}

	// A newer build's statuses are kept: a wider list is left alone, and
	// a list that lacks some of ours gets the union.
	setCheck := func(list string) {
		t.Helper()
		for _, stmt := range []string{
			"ALTER TABLE " + s.table + " DROP CONSTRAINT " + statusCheckName,
			"ALTER TABLE " + s.table + " ADD CONSTRAINT " + statusCheckName + " CHECK (status IN (" + list + "))",
		} {
			if _, err := s.pool.Exec(ctx, stmt); err != nil {
				t.Fatalf("%s: %v", stmt, err)
			}
		}
	}
	setCheck(quoteStatuses(processors.Statuses) + ", 'future'")
	before = constraintOID()
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate() with a wider check = %v", err)
	}
	if after := constraintOID(); after != before {
		t.Errorf("status check oid %d -> %d after Migrate on a wider check; want it left alone", before, after)
	}
	setCheck("'succeeded', 'expired', 'future'")
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate() with a partial check = %v", err)
	}
	var def string
	if err := s.pool.QueryRow(ctx, "SELECT pg_get_constraintdef(oid) FROM pg_catalog.pg_constraint WHERE conrelid = $1::TEXT::REGCLASS AND conname = $2", s.table, statusCheckName).Scan(&def); err != nil {
		t.Fatal(err)
	}
	got := slices.Sorted(slices.Values(quotedLiterals(def)))
	want := slices.Sorted(slices.Values(append(quotedLiterals(quoteStatuses(processors.Statuses)), "future")))
	if !slices.Equal(got, want) {
		t.Errorf("status check after Migrate on a partial check allows %q; want %q (ours and the newer build's)", got, want)
	}
}

// TestMigrateAddsUserColumn: a table created before execution records
// held their user gets the column, its rows keep their data with no user
// (a retry of such a call by any user is still a Duplicate, compared by
// its hash alone), and a new admission's user is kept and compared. It
// gets the credential's columns too, its rows naming none.
func TestMigrateAddsUserColumn(t *testing.T) {
	dsn, schema, _ := oldTable(t)
	ctx := t.Context()
	c := newChecker(t, Config{DSN: dsn, Schema: schema})
	st, err := c.Schema(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, col := range []string{"user_id", "jti", "credential_family", "undo_marks", "tool_digest", "unanswered_seq", "unanswered_since", "unanswered_in_progress"} {
		if !slices.Contains(st.MissingColumns, tableName+"."+col) {
			t.Fatalf("Schema() of the old table = %+v; want %s missing (the test's premise)", st, col)
		}
	}

	s := open(t, Config{DSN: dsn, Schema: schema}) // runs Migrate
	defer s.Close()
	if st, err := c.Schema(ctx); err != nil || !st.Current() {
		t.Errorf("Schema() after Open = %+v, %v; want current", st, err)
	}
	old := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "old"}
	if r, err := s.Get(ctx, old); err != nil || r.Status != processors.StatusSucceeded || r.UserID != "" || !r.Credential.IsZero() || r.Unanswered != (processors.Unanswered{}) {
		t.Errorf("Get(the old row) = %q user %q credential %+v unanswered %+v, %v; want it kept, succeeded, no user, no credential, nothing noted", r.Status, r.UserID, r.Credential, r.Unanswered, err)
	}
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "new"}
	got, err := s.Admit(ctx, []processors.Admission{
		{Key: old, CallID: "c", ArgumentsHash: "h", UserID: "u_bob", Tool: "x", Status: processors.StatusAuthorized},
		{Key: k, CallID: "c", ArgumentsHash: "h", UserID: "u_alice", Tool: "x", Status: processors.StatusAuthorized},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got[0].Outcome != processors.Duplicate || got[1].Outcome != processors.Admitted {
		t.Errorf("Admit(old key by u_bob, new key by u_alice) = %v, %v; want Duplicate, Admitted", got[0].Outcome, got[1].Outcome)
	}
	got, err = s.Admit(ctx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", UserID: "u_bob", Tool: "x", Status: processors.StatusAuthorized}})
	if err != nil || got[0].Outcome != processors.Conflict || got[0].Record.UserID != "u_alice" {
		t.Errorf("Admit(new key by u_bob) = %+v, %v; want Conflict with u_alice's record", got, err)
	}
}

// TestMigrateAddsCredentialColumns: a table of the build before claims
// recorded their credential (it has user_id) gets jti, credential_family
// and lapsed_families; a call it had claimed names none, and the claim
// that takes it over once its lease ran out is told so (no Prior, no
// lapsed family) and records its own, which the next takeover adds to the
// lapsed families.
func TestMigrateAddsCredentialColumns(t *testing.T) {
	dsn := testDSN(t)
	cfg := Config{DSN: dsn, Schema: newSchema(t, dsn)}
	ctx := t.Context()
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "claimed-before"}
	prev := open(t, cfg)
	admitAuthorized(t, prev, k)
	if res, err := prev.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Millisecond}}); err != nil || res[0].Outcome != processors.Claimed {
		t.Fatalf("Claim = %+v, %v; want Claimed", res, err)
	}
	cols := []string{"jti", "credential_family", "lapsed_families"}
	var missing []string
	for _, col := range cols {
		if _, err := prev.pool.Exec(ctx, "ALTER TABLE "+prev.table+" DROP COLUMN "+col); err != nil {
			t.Fatal(err)
		}
		missing = append(missing, tableName+"."+col)
	}
	prev.Close()
	c := newChecker(t, cfg)
	st, err := c.Schema(ctx)
	if err != nil || st.Current() || !slices.Equal(st.MissingColumns, missing) {
		t.Fatalf("Schema() of the previous build's table = %+v, %v; want %q missing, not current (the test's premise)", st, err, cols)
	}

	s := open(t, cfg) // runs Migrate
	defer s.Close()
	if st, err := c.Schema(ctx); err != nil || !st.Current() {
		t.Errorf("Schema() after Open = %+v, %v; want current", st, err)
	}
	if r, err := s.Get(ctx, k); err != nil || r.Status != processors.StatusExecuting || !r.Credential.IsZero() || len(r.LapsedFamilies) != 0 {
		t.Errorf("Get(the call claimed before) = %q credential %+v lapsed %q, %v; want executing, no credential", r.Status, r.Credential, r.LapsedFamilies, err)
	}
	cred := processors.CallCredential{JTI: "jti-2", Family: "x/t_acme/2"}
	res, err := s.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: "executor-2", Lease: time.Millisecond, Credential: cred}})
	if err != nil || res[0].Outcome != processors.Reclaimed || !res[0].Prior.IsZero() || res[0].Record.Credential != cred || len(res[0].Record.LapsedFamilies) != 0 {
		t.Fatalf("Claim of the lapsed call = %+v, %v; want Reclaimed, no Prior, no lapsed family, credential %+v", res, err, cred)
	}
	if r, err := s.Get(ctx, k); err != nil || r.Credential != cred {
		t.Errorf("Get after the reclaim = credential %+v, %v; want %+v", r.Credential, err, cred)
	}
	ledgertest.WaitFor(t, 5*time.Second, func() error {
		res, err = s.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: "executor-3", Lease: time.Hour}})
		if err == nil && res[0].Outcome != processors.Reclaimed {
			err = fmt.Errorf("Claim outcome %v; want Reclaimed", res[0].Outcome)
		}
		return err
	})
	if got := res[0].Record.LapsedFamilies; !slices.Equal(got, []string{cred.Family}) {
		t.Errorf("second takeover's record: lapsed families %q; want %q, the first takeover's", got, cred.Family)
	}
}

// TestMigrateAddsToolDigest: a table of the build before admissions
// recorded their tool's digest gets tool_digest; a call it admitted binds
// no definition (an empty digest), and a new admission's digest is kept.
func TestMigrateAddsToolDigest(t *testing.T) {
	dsn := testDSN(t)
	cfg := Config{DSN: dsn, Schema: newSchema(t, dsn)}
	ctx := t.Context()
	old := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "admitted-before"}
	prev := open(t, cfg)
	admitAuthorized(t, prev, old)
	if _, err := prev.pool.Exec(ctx, "ALTER TABLE "+prev.table+" DROP COLUMN tool_digest"); err != nil {
		t.Fatal(err)
	}
	prev.Close()
	c := newChecker(t, cfg)
	if st, err := c.Schema(ctx); err != nil || !slices.Equal(st.MissingColumns, []string{tableName + ".tool_digest"}) {
		t.Fatalf("Schema() of the previous build's table = %+v, %v; want tool_digest missing (the test's premise)", st, err)
	}

	s := open(t, cfg) // runs Migrate
	defer s.Close()
	if st, err := c.Schema(ctx); err != nil || !st.Current() {
		t.Errorf("Schema() after Open = %+v, %v; want current", st, err)
	}
	if r, err := s.Get(ctx, old); err != nil || r.Status != processors.StatusAuthorized || r.ToolDigest != "" {
		t.Errorf("Get(the call admitted before) = %q digest %q, %v; want authorized, no digest", r.Status, r.ToolDigest, err)
	}
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "admitted-after"}
	const digest = "sha256:0123"
	if _, err := s.Admit(ctx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", ToolDigest: digest, Status: processors.StatusAuthorized}}); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Get(ctx, k); err != nil || r.ToolDigest != digest {
		t.Errorf("Get(a call admitted after) = digest %q, %v; want %q", r.ToolDigest, err, digest)
	}
}

// TestMigrateAddsUndoMarks: a table of the build before compensations
// marked the call they undo gets undo_marks; a call it left with an
// unknown outcome has none, a move read from it applies, and a
// compensation's check marks it and fences out a move read before.
func TestMigrateAddsUndoMarks(t *testing.T) {
	dsn := testDSN(t)
	cfg := Config{DSN: dsn, Schema: newSchema(t, dsn)}
	ctx := t.Context()
	prev := open(t, cfg)
	unknown := func(idem string) ledger.CallKey {
		k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: idem}
		admitAuthorized(t, prev, k)
		res, err := prev.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Hour}})
		if err != nil || res[0].Outcome != processors.Claimed {
			t.Fatalf("Claim = %+v, %v; want Claimed", res, err)
		}
		done, err := prev.Complete(ctx, []processors.Completion{{Key: k, Epoch: res[0].Record.Epoch, Status: processors.StatusOutcomeUnknown, Attempt: 1, Seq: 3, Outbox: []byte(`[{"seq":3}]`)}})
		if err != nil || !done[0] {
			t.Fatalf("Complete = %v, %v; want applied", done, err)
		}
		return k
	}
	moved, undone := unknown("moved"), unknown("undone")
	if _, err := prev.pool.Exec(ctx, "ALTER TABLE "+prev.table+" DROP COLUMN undo_marks"); err != nil {
		t.Fatal(err)
	}
	prev.Close()
	c := newChecker(t, cfg)
	if st, err := c.Schema(ctx); err != nil || !slices.Equal(st.MissingColumns, []string{tableName + ".undo_marks"}) {
		t.Fatalf("Schema() of the previous build's table = %+v, %v; want undo_marks missing (the test's premise)", st, err)
	}

	s := open(t, cfg) // runs Migrate
	defer s.Close()
	if st, err := c.Schema(ctx); err != nil || !st.Current() {
		t.Errorf("Schema() after Open = %+v, %v; want current", st, err)
	}
	// read reads k, with no undo mark yet; settle moves it failed from
	// what read returned.
	read := func(k ledger.CallKey) processors.Record {
		t.Helper()
		r, err := s.Get(ctx, k)
		if err != nil || r.UndoMarks != 0 {
			t.Fatalf("Get(a call the previous build left unknown) = %d undo marks, %v; want 0", r.UndoMarks, err)
		}
		return r
	}
	settle := func(r processors.Record) bool {
		t.Helper()
		applied, err := s.Move(ctx, []processors.Move{{Key: r.Key, From: r.Status, FromSeq: r.Seq, FromUndoMarks: r.UndoMarks, To: processors.StatusFailed, Seq: r.Seq + 1}})
		if err != nil {
			t.Fatal(err)
		}
		return applied[0]
	}
	if !settle(read(moved)) {
		t.Errorf("a move of a call the previous build left unknown, read after Migrate, did not apply; want it applied")
	}
	before := read(undone)
	if st, marked, err := s.MarkUndo(ctx, undone, []processors.Status{processors.StatusOutcomeUnknown}); err != nil || !marked || st != processors.StatusOutcomeUnknown {
		t.Fatalf("MarkUndo = %s, %v, %v; want outcome_unknown, marked", st, marked, err)
	}
	if settle(before) {
		t.Errorf("a move read before the mark applied; want it refused")
	}
}

// TestMigrateStatusCheckRejected: on a table whose check has every status
// but 'rejected' (what the build before the approval queue created),
// Open widens the check, and a pending call can then be moved to rejected
// (refused with ErrRejected before: 23514).
func TestMigrateStatusCheckRejected(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	ctx := t.Context()
	s := open(t, Config{DSN: dsn, Schema: schema})
	var previous []processors.Status
	for _, st := range processors.Statuses {
		if st != processors.StatusRejected {
			previous = append(previous, st)
		}
	}
	for _, stmt := range []string{
		"ALTER TABLE " + s.table + " DROP CONSTRAINT " + statusCheckName,
		"ALTER TABLE " + s.table + " ADD CONSTRAINT " + statusCheckName + " CHECK (status IN (" + quoteStatuses(previous) + "))",
	} {
		if _, err := s.pool.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
	if _, err := s.Admit(ctx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusPending, Seq: 2}}); err != nil {
		t.Fatal(err)
	}
	reject := []processors.Move{{Key: k, From: processors.StatusPending, FromSeq: 2, To: processors.StatusRejected, Seq: 3, Outbox: []byte("x")}}
	// The premise: the previous check refuses it, as the data's fault.
	if _, err := s.Move(ctx, reject); !errors.Is(err, processors.ErrRejected) || sqlState(err) != "23514" {
		t.Fatalf("Move to rejected under the previous check = %v; want ErrRejected with 23514 (the test's premise)", err)
	}
	s.Close()

	s = open(t, Config{DSN: dsn, Schema: schema}) // runs Migrate
	defer s.Close()
	applied, err := s.Move(ctx, reject)
	if err != nil || !applied[0] {
		t.Fatalf("Move to rejected after Migrate = %v, %v; want applied", applied, err)
	}
	if r, err := s.Get(ctx, k); err != nil || r.Status != processors.StatusRejected {
		t.Errorf("Get = %q, %v; want rejected", r.Status, err)
	}
}

func TestQuotedLiterals(t *testing.T) {
	tests := []struct {
		name string
		def  string
		want []string
	}{
		{"postgresql", `CHECK ((status = ANY (ARRAY['authorized'::text, 'denied'::text])))`, []string{"authorized", "denied"}},
		{"cockroachdb", `CHECK ((status IN ('authorized':::STRING, 'denied':::STRING)))`, []string{"authorized", "denied"}},
		{"escaped quote", `CHECK ((status IN ('it''s', '')))`, []string{"it's", ""}},
		{"none", `CHECK ((seq >= 0))`, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := quotedLiterals(tc.def); !slices.Equal(got, tc.want) {
				t.Errorf("quotedLiterals(%q) = %q; want %q", tc.def, got, tc.want)
			}
		})
	}
}

// TestRejected: data PostgreSQL refuses wraps processors.ErrRejected, with
// the SQLSTATE still reachable, and is not retried; an error that is not
// the data's fault does not wrap it.
func TestRejected(t *testing.T) {
	dsn := testDSN(t)
	var retries atomic.Int32
	log := slog.New(countHandler{msg: "execution store transaction retry", n: &retries})
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn), Logger: log})
	defer s.Close()
	ctx := t.Context()

	ok := processors.Admission{Key: ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "ok"}, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized}
	bad := ok
	bad.Key.IdempotencyKey, bad.CallID = "nul", "call\x00id"
	_, err := s.Admit(ctx, []processors.Admission{ok, bad})
	if !errors.Is(err, processors.ErrRejected) {
		t.Errorf("Admit(call_id with NUL) = %v; want an error wrapping ErrRejected", err)
	}
	if code := sqlState(err); code != "22021" {
		t.Errorf("Admit(call_id with NUL) SQLSTATE = %q (%v); want 22021 reachable through the error", code, err)
	}
	if n := retries.Load(); n != 0 {
		t.Errorf("Admit(call_id with NUL) retried %d times; want none", n)
	}
	if _, err := s.Get(ctx, ok.Key); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("Get(%v) after the rejected batch = %v; want ErrNotFound", ok.Key, err)
	}

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Admit(cancelled, []processors.Admission{ok}); err == nil || errors.Is(err, processors.ErrRejected) {
		t.Errorf("Admit(cancelled ctx) = %v; want an error that does not wrap ErrRejected", err)
	}
}

// countHandler counts the log records with message msg.
type countHandler struct {
	msg string
	n   *atomic.Int32
}

func (h countHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		h.n.Add(1)
	}
	return nil
}
func (h countHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countHandler) WithGroup(string) slog.Handler      { return h }

// TestRejectedCodes: which SQLSTATEs inTx reports as ErrRejected, after
// one attempt.
func TestRejectedCodes(t *testing.T) {
	dsn := testDSN(t)
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn), MaxRetries: 3})
	defer s.Close()
	tests := []struct {
		code         string
		wantRejected bool
	}{
		{"22021", true},  // invalid byte sequence: a NUL in TEXT
		{"22001", true},  // string data right truncation
		{"23514", true},  // check violation: an unknown status
		{"23502", true},  // not null violation
		{"23505", false}, // unique violation: may be a race
		{"57014", false}, // query canceled
		{"08006", false}, // connection failure
		{"42P01", false}, // undefined table: our bug, not the data
	}
	for _, tc := range tests {
		t.Run(tc.code, func(t *testing.T) {
			var n int
			pe := &pgconn.PgError{Code: tc.code, Message: "synthetic"}
			err := s.inTx(t.Context(), "synthetic", pgx.ReadOnly, func(context.Context, pgx.Tx) error { n++; return pe })
			if got := errors.Is(err, processors.ErrRejected); got != tc.wantRejected {
				t.Errorf("inTx(SQLSTATE %s) = %v; ErrRejected %v, want %v", tc.code, err, got, tc.wantRejected)
			}
			if sqlState(err) != tc.code {
				t.Errorf("inTx(SQLSTATE %s) = %v; want the PgError reachable", tc.code, err)
			}
			if n != 1 {
				t.Errorf("inTx(SQLSTATE %s) ran %d times; want 1 (not retried)", tc.code, n)
			}
		})
	}
}

// TestConcurrentPools: executors in different processes (here two pools)
// claiming the same calls; exactly one claim per call wins, and the losers
// see Busy, never an error: their serialization failures are retried.
func TestConcurrentPools(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	a := open(t, Config{DSN: dsn, Schema: schema, MaxConns: 8})
	defer a.Close()
	b := open(t, Config{DSN: dsn, Schema: schema, MaxConns: 8, SkipMigrate: true})
	defer b.Close()
	ctx := t.Context()

	const (
		calls    = 5
		claimers = 16
	)
	for call := range calls {
		k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: fmt.Sprintf("run_1:step_%d", call)}
		if _, err := a.Admit(ctx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized}}); err != nil {
			t.Fatal(err)
		}
		var (
			wg       sync.WaitGroup
			mu       sync.Mutex
			outcomes = map[processors.ClaimOutcome]int{}
			errs     []error
		)
		start := make(chan struct{})
		for i := range claimers {
			s := a
			if i%2 == 1 {
				s = b
			}
			wg.Go(func() {
				<-start
				got, err := s.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: fmt.Sprintf("executor-%d", i), Lease: time.Hour}})
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, err)
					return
				}
				outcomes[got[0].Outcome]++
			})
		}
		close(start)
		wg.Wait()
		for _, err := range errs {
			t.Errorf("call %d: Claim = %v; want no error (serialization failures retried)", call, err)
		}
		if outcomes[processors.Claimed] != 1 || outcomes[processors.Busy] != claimers-1 {
			t.Errorf("call %d: outcomes %v; want 1 Claimed and %d Busy", call, outcomes, claimers-1)
		}
		r, err := b.Get(ctx, k)
		if err != nil || r.Epoch != 1 {
			t.Errorf("call %d: Get = epoch %d, %v; want epoch 1", call, r.Epoch, err)
		}
	}
}

// TestSerializationFailureRetried forces a write skew between two
// SERIALIZABLE transactions: each reads both rows, then writes its own.
// PostgreSQL aborts one of them with 40001 (typically at COMMIT, the case
// CockroachDB's savepoint protocol would lose on PostgreSQL); inTx must
// run it again, and the result must be what a serial order gives.
func TestSerializationFailureRetried(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	var retried atomic.Int32
	s := open(t, Config{DSN: dsn, Schema: schema, Retried: func(op string) {
		if op == "skew" {
			retried.Add(1)
		}
	}})
	defer s.Close()
	ctx := t.Context()
	skew := pgx.Identifier{schema, "skew"}.Sanitize()
	if _, err := s.pool.Exec(ctx, "CREATE TABLE "+skew+" (id BIGINT PRIMARY KEY, v BIGINT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(ctx, "INSERT INTO "+skew+" (id, v) VALUES (1, 0), (2, 0)"); err != nil {
		t.Fatal(err)
	}

	var (
		attempts [2]atomic.Int32
		read     sync.WaitGroup // both transactions have read, first attempt only
		wg       sync.WaitGroup
		errs     [2]error
	)
	bothRead := make(chan struct{})
	read.Add(2)
	go func() { read.Wait(); close(bothRead) }()
	for i := range 2 {
		wg.Go(func() {
			errs[i] = s.inTx(ctx, "skew", pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
				n := attempts[i].Add(1)
				var sum int64
				if err := tx.QueryRow(ctx, "SELECT sum(v) FROM "+skew).Scan(&sum); err != nil {
					return err
				}
				if n == 1 {
					read.Done()
					select {
					case <-bothRead:
					case <-time.After(10 * time.Second):
						return errors.New("the other transaction never read")
					}
				}
				_, err := tx.Exec(ctx, "UPDATE "+skew+" SET v = $1 WHERE id = $2", sum+1, i+1)
				return err
			})
		})
	}
	wg.Wait()

	for i, err := range errs {
		if err != nil {
			t.Errorf("transaction %d = %v; want nil (40001 retried)", i+1, err)
		}
	}
	total := attempts[0].Load() + attempts[1].Load()
	if total < 3 {
		t.Errorf("attempts = %d + %d; want at least one retry (a serialization failure was forced)", attempts[0].Load(), attempts[1].Load())
	}
	// Config.Retried saw each retry, named by its operation.
	if got := retried.Load(); got != total-2 {
		t.Errorf("Retried called %d times for %d retries", got, total-2)
	}
	rows, _ := s.pool.Query(ctx, "SELECT v FROM "+skew+" ORDER BY v")
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	// Serial: the first writes 0+1, the second reads 1 and writes 2. Both
	// reading 0 (the anomaly) would leave [1 1].
	if want := []int64{1, 2}; !slices.Equal(vs, want) {
		t.Errorf("values after both committed = %v; want %v (a serial order)", vs, want)
	}
}

// TestRetriesBounded: a transaction that keeps failing with 40001 runs
// MaxRetries+1 times, then fails with an error that still carries the
// 40001, so the caller's classifier treats it as retry-later.
func TestRetriesBounded(t *testing.T) {
	dsn := testDSN(t)
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn), MaxRetries: 3})
	defer s.Close()
	var n int
	err := s.inTx(t.Context(), "always conflicts", pgx.ReadOnly, func(context.Context, pgx.Tx) error {
		n++
		return &pgconn.PgError{Code: "40001", Message: "synthetic serialization failure"}
	})
	if n != 4 {
		t.Errorf("attempts = %d; want 4 (1 + MaxRetries 3)", n)
	}
	if sqlState(err) != "40001" {
		t.Errorf("inTx error = %v; want one wrapping SQLSTATE 40001", err)
	}

	// A non-retryable error is returned at once.
	n = 0
	boom := errors.New("boom")
	if err := s.inTx(t.Context(), "fails", pgx.ReadOnly, func(context.Context, pgx.Tx) error { n++; return boom }); !errors.Is(err, boom) || n != 1 {
		t.Errorf("inTx(non-retryable) = %v after %d attempts; want boom after 1", err, n)
	}
}

// TestMigrateStatusCheckConcurrent: executors starting together on a
// table an older build created all open, and the check ends up widened.
func TestMigrateStatusCheckConcurrent(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	ctx := t.Context()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	table := pgx.Identifier{schema, tableName}.Sanitize()
	for _, stmt := range []string{"CREATE SCHEMA " + pgx.Identifier{schema}.Sanitize(), fmt.Sprintf(oldTableDDL, table)} {
		if _, err := conn.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	const n = 6
	var (
		wg   sync.WaitGroup
		errs [n]error
	)
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			s, err := Open(ctx, Config{DSN: dsn, Schema: schema, MaxConns: 2})
			if err == nil {
				s.Close()
			}
			errs[i] = err
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("Open %d = %v; want nil", i, err)
		}
	}
	if _, err := conn.Exec(ctx, "INSERT INTO "+table+` (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, created_at, updated_at)
VALUES ('t_acme', 'k', 'c', 'h', 'x', 1, 'expired', now(), now())`); err != nil {
		t.Errorf("INSERT of an expired record after the concurrent Opens = %v; want nil", err)
	}
}

// TestMarkLoggedWaitsInsteadOfFailing: a MarkLogged whose row another
// transaction changed while it waited for the row's lock (the executor's
// claim of a call the intake has just logged) applies to the new row
// version once the lock is released, without a serialization failure and
// a retry. Under SERIALIZABLE it failed with 40001 and ran again.
func TestMarkLoggedWaitsInsteadOfFailing(t *testing.T) {
	s, logs := openRelaxed(t)
	ctx := t.Context()
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
	admitAuthorized(t, s, k)

	// Another writer holds the row, as a claim does between its
	// statements and its commit; MarkLogged takes its snapshot and waits
	// for the row lock.
	err := whileRowHeld(t, s, k, "epoch = epoch + 1, updated_at = now()", "logged_seq = GREATEST", nil, func() error {
		return s.MarkLogged(ctx, []processors.Logged{{Key: k, Seq: 2}})
	})
	if err != nil {
		t.Fatalf("MarkLogged() = %v", err)
	}
	r, err := s.Get(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if r.LoggedSeq != 2 || r.Epoch != 1 {
		t.Errorf("record after MarkLogged: logged_seq %d, epoch %d; want 2 and the other writer's 1", r.LoggedSeq, r.Epoch)
	}
	if strings.Contains(logs.String(), "transaction retry") {
		t.Errorf("MarkLogged was retried:\n%s", logs.String())
	}
}

// admitAuthorized admits k as an authorized call at seq 2, arguments hash "h".
func admitAuthorized(t *testing.T, s *Store, k ledger.CallKey) {
	t.Helper()
	if _, err := s.Admit(t.Context(), []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized, Seq: 2, Outbox: []byte("[]")}}); err != nil {
		t.Fatal(err)
	}
}

// whileRowHeld runs call while another transaction holds k's row, having
// updated it with the SET clause set (another writer between its
// statements and its commit): once a statement of call containing waitsOn
// waits for the row's lock, meanwhile runs (if not nil) and the other
// transaction commits. It returns call's error.
func whileRowHeld(t *testing.T, s *Store, k ledger.CallKey, set, waitsOn string, meanwhile func(), call func() error) error {
	t.Helper()
	write := "UPDATE " + s.table + " SET " + set + " WHERE tenant_id = $1 AND idempotency_key = $2"
	return whileWritten(t, s, write, k, waitsOn, meanwhile, call)
}

// whileWritten runs call while another transaction has run write (with
// k's tenant and key as $1 and $2) and not yet committed: once a
// statement of call containing waitsOn waits for a lock, meanwhile runs
// (if not nil) and the other transaction commits. It returns call's
// error.
func whileWritten(t *testing.T, s *Store, write string, k ledger.CallKey, waitsOn string, meanwhile func(), call func() error) error {
	t.Helper()
	ctx := t.Context()
	other, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(context.WithoutCancel(ctx))
	if _, err := other.Exec(ctx, write, k.TenantID, k.IdempotencyKey); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- call() }()
	waitForLock(t, s, waitsOn)
	if meanwhile != nil {
		meanwhile()
	}
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return <-done
}

// markLoggedMeanwhile is the other writer of the claim tests: the intake
// marking the call's events logged.
const markLoggedMeanwhile = "logged_seq = seq"

// TestClaimAndCompleteWaitInsteadOfFailing: a claim and a completion of a
// record that another transaction is writing (the intake's mark-logged
// racing the executor, which reads the call's events as they commit)
// wait for it and apply, without a serialization failure and a retry.
// Under SERIALIZABLE each failed with 40001 and ran its batch again:
// one claim in twenty at 200 calls/s, and most of the hundreds of
// retries per run with two or four executors.
func TestClaimAndCompleteWaitInsteadOfFailing(t *testing.T) {
	s, logs := openRelaxed(t)
	ctx := t.Context()
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
	admitAuthorized(t, s, k)

	var res []processors.ClaimResult
	err := whileRowHeld(t, s, k, markLoggedMeanwhile, "FOR UPDATE", nil, func() (err error) {
		res, err = s.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Hour}})
		return err
	})
	if err != nil {
		t.Fatalf("Claim() = %v", err)
	}
	if len(res) != 1 || res[0].Outcome != processors.Claimed || res[0].Record.Epoch != 1 || res[0].Record.LoggedSeq != 2 {
		t.Fatalf("Claim() = %+v; want claimed at epoch 1, with the other writer's logged_seq 2", res)
	}

	var applied []bool
	err = whileRowHeld(t, s, k, markLoggedMeanwhile, "SET status = u.status", nil, func() (err error) {
		applied, err = s.Complete(ctx, []processors.Completion{{Key: k, Epoch: 1, Status: processors.StatusSucceeded, Attempt: 1, Seq: 4, Outbox: []byte("[]")}})
		return err
	})
	if err != nil {
		t.Fatalf("Complete() = %v", err)
	}
	if len(applied) != 1 || !applied[0] {
		t.Fatalf("Complete() applied %v; want [true]", applied)
	}
	r, err := s.Get(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != processors.StatusSucceeded || r.Seq != 4 {
		t.Errorf("record after Complete: %s at seq %d; want succeeded at 4", r.Status, r.Seq)
	}
	if strings.Contains(logs.String(), "transaction retry") {
		t.Errorf("Claim or Complete was retried:\n%s", logs.String())
	}
}

// TestClaimReadsARecordAdmittedMeanwhile: at READ COMMITTED the claim's
// locking read and its UPDATE each see what was committed when they
// began, so a record admitted in between is claimed by the UPDATE and
// missing from the read. Once the claim committed, the record is read
// (no retry), and the claim answers with it as claimed: never "missing"
// for a record it claimed.
func TestClaimReadsARecordAdmittedMeanwhile(t *testing.T) {
	s, logs := openRelaxed(t)
	ctx := t.Context()
	a := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "a"}
	b := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "b"}
	admitAuthorized(t, s, a)
	// The read stops at a, locked, with b not yet admitted; b is
	// admitted while it waits.
	var res []processors.ClaimResult
	err := whileRowHeld(t, s, a, markLoggedMeanwhile, "FOR UPDATE", func() { admitAuthorized(t, s, b) }, func() (err error) {
		res, err = s.Claim(ctx, []processors.Claim{
			{Key: a, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Hour},
			// Other arguments for b, ahead of the claim that wins it.
			{Key: b, ArgumentsHash: "other", Owner: "executor-1", Lease: time.Hour},
			{Key: b, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Hour},
			// And b again after it: it sees the winner's lease.
			{Key: b, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Hour},
		})
		return err
	})
	if err != nil {
		t.Fatalf("Claim() = %v", err)
	}
	if len(res) != 4 || res[1].Outcome != processors.Mismatch || res[1].Record.Key != b {
		t.Fatalf("Claim() = %+v; want b's claim with other arguments a mismatch, with b's record", res)
	}
	if res[3].Outcome != processors.Busy || res[3].Record.LeaseOwner != "executor-1" {
		t.Fatalf("Claim()[3] = %+v; want b's second claim busy under the first one's lease", res[3])
	}
	res = res[:3]
	res = slices.Delete(res, 1, 2)
	for i, k := range []ledger.CallKey{a, b} {
		if res[i].Outcome != processors.Claimed || res[i].Record.Epoch != 1 {
			t.Fatalf("Claim() = %+v; want %v claimed at epoch 1", res, k)
		}
		r, err := s.Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != processors.StatusExecuting || r.Epoch != 1 {
			t.Errorf("%v after the claim: %s at epoch %d; want executing at 1 (one claim applied)", k, r.Status, r.Epoch)
		}
		if got := res[i].Record; got.Key != k || got.CallID != "c" || got.Status != processors.StatusExecuting || got.LeaseOwner != "executor-1" || got.LoggedSeq != r.LoggedSeq {
			t.Errorf("Claim()[%d].Record = %+v; want %v as the store holds it: %+v", i, got, k, r)
		}
	}
	if n := strings.Count(logs.String(), "transaction retry"); n != 0 {
		t.Errorf("%d retries; want none:\n%s", n, logs.String())
	}
}

// openRelaxed opens a store in a fresh schema, logging to the buffer it
// returns, for the tests of the methods that run at READ COMMITTED on
// PostgreSQL; it skips them on CockroachDB, where they stay SERIALIZABLE.
func openRelaxed(t *testing.T) (*Store, *ledgertest.LogBuffer) {
	t.Helper()
	dsn := testDSN(t)
	logs := &ledgertest.LogBuffer{}
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn), Logger: slog.New(slog.NewTextHandler(logs, nil))})
	t.Cleanup(func() { s.Close() })
	if s.CockroachDB() {
		t.Skip("the store's transactions stay SERIALIZABLE on CockroachDB")
	}
	return s, logs
}

// waitForLock waits until a statement of s containing text waits for a
// lock another transaction holds. Only statements on s's table count:
// other packages' tests run beside this one on the same server.
func waitForLock(t *testing.T, s *Store, text string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		err := s.pool.QueryRow(t.Context(), "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND strpos(query, $1) > 0 AND strpos(query, $2) > 0", text, s.table).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no statement with %q ever waited for a lock", text)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// admitWhileInserted runs Admit(as) while another transaction holds an
// insert of k (call c_first, arguments hash "h") not yet committed,
// committing it once a statement of the admission waits for it, and
// returns Admit's results.
func admitWhileInserted(t *testing.T, s *Store, k ledger.CallKey, as []processors.Admission) []processors.AdmitResult {
	t.Helper()
	insert := "INSERT INTO " + s.table + ` (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, seq, created_at, updated_at)
VALUES ($1, $2, 'c_first', 'h', 'x', 1, 'authorized', 2, now(), now())`
	var res []processors.AdmitResult
	err := whileWritten(t, s, insert, k, "INSERT INTO", nil, func() (err error) {
		res, err = s.Admit(t.Context(), as)
		return err
	})
	if err != nil {
		t.Fatalf("Admit() = %v", err)
	}
	return res
}

// TestAdmitSeesAConcurrentAdmission: an admission of a key that another
// transaction is inserting waits for it and, once it commits, answers
// against the record it created (a duplicate with the same arguments, a
// conflict with others), without a serialization failure and a retry;
// the rest of the batch is admitted. Under SERIALIZABLE the whole batch
// failed with 40001 and ran again.
func TestAdmitSeesAConcurrentAdmission(t *testing.T) {
	for _, tc := range []struct {
		hash string
		want processors.AdmitOutcome
	}{
		{"h", processors.Duplicate},
		{"other", processors.Conflict},
	} {
		t.Run(tc.hash, func(t *testing.T) {
			s, logs := openRelaxed(t)
			k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
			fresh := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "fresh"}
			res := admitWhileInserted(t, s, k, []processors.Admission{
				{Key: fresh, CallID: "c_fresh", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized, Seq: 2},
				{Key: k, CallID: "c_second", ArgumentsHash: tc.hash, Tool: "x", Status: processors.StatusAuthorized, Seq: 2},
			})
			if len(res) != 2 || res[0].Outcome != processors.Admitted || res[1].Outcome != tc.want || res[1].Record.CallID != "c_first" {
				t.Errorf("Admit() = %+v; want the fresh key admitted and %v against call c_first", res, tc.want)
			}
			if strings.Contains(logs.String(), "transaction retry") {
				t.Errorf("Admit was retried:\n%s", logs.String())
			}
		})
	}
}

// TestUnloggedPassesOverHeldJournalEntries: the sweep of stale journal
// entries passes over an entry another transaction holds (a process
// stalled while it settles the entry: it deleted the entry and did not
// commit) instead of waiting for it: the others are settled and their
// calls listed, and the held one is taken by a later sweep once its
// holder rolled back.
func TestUnloggedPassesOverHeldJournalEntries(t *testing.T) {
	dsn := testDSN(t)
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn)})
	defer s.Close()
	ctx := t.Context()
	held, free := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "held"}, ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "free"}
	for _, k := range []ledger.CallKey{held, free} {
		admitAuthorized(t, s, k)
		res, err := s.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Hour, Logged: 2}})
		if err != nil || res[0].Outcome != processors.Claimed {
			t.Fatalf("Claim(%v) = %+v, %v; want claimed", k, res, err)
		}
		c := processors.Completion{Key: k, Epoch: res[0].Record.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Result: []byte(`{}`),
			Seq: 4, Outbox: []byte(`[]`), Journal: "step-" + k.IdempotencyKey, From: 2}
		if applied, err := s.Complete(ctx, []processors.Completion{c}); err != nil || !applied[0] {
			t.Fatalf("Complete(%v) = %v, %v; want applied", k, applied, err)
		}
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// What a settle, or another sweep, that stalled before its commit
	// holds.
	if _, err := tx.Exec(ctx, "DELETE FROM "+s.journal+" WHERE id = 'step-held'"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond) // both entries older than the sweep's 1 ms
	// Far longer than a sweep takes; the old sweep waited for the holder.
	sctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	got, err := s.Unlogged(sctx, time.Millisecond, processors.Cursor{}, 100)
	if err != nil {
		t.Fatalf("Unlogged while another transaction holds a stale entry = %v; want the sweep to pass over it", err)
	}
	if len(got) != 1 || got[0].Key != free || got[0].LoggedSeq != 2 {
		t.Errorf("Unlogged while step-held is held = %+v; want %v alone, reverted to logged seq 2", got, free)
	}
	if r, err := s.Get(ctx, held); err != nil || r.LoggedSeq != 4 {
		t.Errorf("Get(%v) while its entry is held = %+v, %v; want logged seq 4 (not reverted)", held, r, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	got, err = s.Unlogged(ctx, time.Millisecond, processors.Cursor{}, 100)
	if err != nil || len(got) != 2 {
		t.Fatalf("Unlogged after the holder ended = %+v, %v; want both calls", got, err)
	}
	if r, err := s.Get(ctx, held); err != nil || r.LoggedSeq != 2 {
		t.Errorf("Get(%v) after the holder ended = %+v, %v; want logged seq 2 (reverted)", held, r, err)
	}
}

// A record of a status this build does not know (a newer build's, in a
// rolling upgrade) is answered NotReady for its key alone: the claims of
// the batch's other keys stand. Before, Claim failed the batch after they
// had committed, so the step failed at every redelivery, and the claims
// it took were held until their leases ran out, again and again.
func TestClaimOfANewerStatus(t *testing.T) {
	ctx := t.Context()
	s := open(t, Config{DSN: testDSN(t), Schema: newSchema(t, testDSN(t))})
	newer, known := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "newer"}, ledger.CallKey{TenantID: "t_a", IdempotencyKey: "known"}
	for _, k := range []ledger.CallKey{newer, known} {
		if _, err := s.Admit(ctx, []processors.Admission{{Key: k, CallID: "c_" + k.IdempotencyKey, ArgumentsHash: "sha256:00",
			Tool: "notify", ToolVersion: 1, Arguments: []byte(`{}`), Status: processors.StatusAuthorized, Seq: 2, Outbox: []byte(`[]`)}}); err != nil {
			t.Fatal(err)
		}
	}
	// What a newer build's migration and its move would leave.
	for _, stmt := range []string{
		"ALTER TABLE " + s.table + " DROP CONSTRAINT " + statusCheckName,
		"ALTER TABLE " + s.table + " ADD CONSTRAINT " + statusCheckName + " CHECK (status IN (" + quoteStatuses(processors.Statuses) + ", 'held'))",
		"UPDATE " + s.table + " SET status = 'held' WHERE idempotency_key = 'newer'",
	} {
		if _, err := s.pool.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	res, err := s.Claim(ctx, []processors.Claim{
		{Key: newer, ArgumentsHash: "sha256:00", Owner: "x", Lease: time.Minute},
		{Key: known, ArgumentsHash: "sha256:00", Owner: "x", Lease: time.Minute},
	})
	if err != nil {
		t.Fatalf("Claim of a batch with a newer status: %v; want each key answered", err)
	}
	if res[0].Outcome != processors.NotReady || res[1].Outcome != processors.Claimed {
		t.Errorf("outcomes %v, %v; want not ready for the newer status, claimed for the other", res[0].Outcome, res[1].Outcome)
	}
}

// A journal entry this build did not write (arrays of unequal lengths: a
// hand edit, a restore) is dropped, said at Error, and the sweep goes on:
// before, Unlogged failed on it at every sweep of every executor, the
// entry stayed oldest, and no record's events were appended again.
func TestMalformedJournalEntryDoesNotStopTheSweep(t *testing.T) {
	ctx := t.Context()
	var logs ledgertest.LogBuffer
	s := open(t, Config{DSN: testDSN(t), Schema: newSchema(t, testDSN(t)), Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "unlogged"}
	if _, err := s.Admit(ctx, []processors.Admission{{Key: k, CallID: "c_1", ArgumentsHash: "sha256:00",
		Tool: "notify", ToolVersion: 1, Arguments: []byte(`{}`), Status: processors.StatusAuthorized, Seq: 2, Outbox: []byte(`[]`)}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(ctx, "INSERT INTO "+s.journal+` (id, created_at, tenant_ids, idempotency_keys, epochs, seqs, from_seqs)
VALUES ('hand-edited', now() - INTERVAL '1 hour', ARRAY['t_a', 't_b'], ARRAY['x'], ARRAY[1], ARRAY[2], ARRAY[1])`); err != nil {
		t.Fatal(err)
	}
	for sweep := 1; sweep <= 2; sweep++ {
		recs, err := s.Unlogged(ctx, 0, processors.Cursor{}, 10)
		if err != nil {
			t.Fatalf("sweep %d: Unlogged: %v; want the malformed entry set aside", sweep, err)
		}
		if len(recs) != 1 || recs[0].Key != k {
			t.Errorf("sweep %d: Unlogged listed %d records; want the unlogged call", sweep, len(recs))
		}
	}
	if !strings.Contains(logs.String(), "journal entry with arrays of unequal lengths dropped") {
		t.Errorf("log:\n%s\nwant the dropped entry said", logs.String())
	}
}
