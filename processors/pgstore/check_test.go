package pgstore

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

func newChecker(t *testing.T, cfg Config) *Checker {
	t.Helper()
	c, err := NewChecker(t.Context(), cfg)
	if err != nil {
		t.Fatalf("NewChecker() = %v", err)
	}
	t.Cleanup(func() { c.Close(t.Context()) })
	return c
}

// TestCheckerSchema: the checker tells an unmigrated schema (without
// creating it), a current one, and one that lacks pieces or allows other
// statuses, each piece named.
func TestCheckerSchema(t *testing.T) {
	ctx := t.Context()
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	c := newChecker(t, Config{DSN: dsn, Schema: schema})

	got, err := c.Schema(ctx)
	if err != nil {
		t.Fatalf("Schema() on an unmigrated schema = %v", err)
	}
	want := SchemaStatus{Schema: schema, MissingTables: []string{journalTableName, tableName, rateTableName}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Schema() unmigrated (-want +got):\n%s", diff)
	}
	if got.Migrated() || got.Current() {
		t.Errorf("unmigrated: Migrated() = %v, Current() = %v; want false, false", got.Migrated(), got.Current())
	}
	var n int
	if err := c.conn.QueryRow(ctx, "SELECT count(*) FROM pg_catalog.pg_namespace WHERE nspname = $1", schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("after Schema(), schema %s exists; want the checker to create nothing", schema)
	}

	s := open(t, Config{DSN: dsn, Schema: schema})
	defer s.Close()
	if got, err = c.Schema(ctx); err != nil {
		t.Fatalf("Schema() after Migrate = %v", err)
	}
	if diff := cmp.Diff(SchemaStatus{Schema: schema}, got); diff != "" || !got.Current() {
		t.Errorf("Schema() after Migrate (-want +got), Current() %v:\n%s", got.Current(), diff)
	}

	// An older or damaged schema: each missing piece is named, statuses
	// of a newer build are told apart.
	statuses := quoteStatuses(withoutStatus(processors.Statuses, processors.StatusParked)) + ", 'from_the_future'"
	for _, stmt := range []string{
		"DROP INDEX " + pgx.Identifier{schema, statusIndexName}.Sanitize(),
		"DROP INDEX " + pgx.Identifier{schema, tenantStatusIndexName}.Sanitize(),
		"DROP INDEX " + pgx.Identifier{schema, journalIndexName}.Sanitize(),
		"ALTER TABLE " + s.table + " DROP COLUMN outbox",
		"ALTER TABLE " + s.table + " DROP CONSTRAINT " + statusCheckName,
		"ALTER TABLE " + s.table + " ADD CONSTRAINT " + statusCheckName + " CHECK (status IN (" + statuses + "))",
		"DROP TABLE " + s.rateTable(),
	} {
		if _, err := s.pool.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	if got, err = c.Schema(ctx); err != nil {
		t.Fatalf("Schema() of a damaged schema = %v", err)
	}
	want = SchemaStatus{
		Schema:          schema,
		MissingTables:   []string{rateTableName},
		MissingColumns:  []string{tableName + ".outbox"},
		MissingIndexes:  []string{statusIndexName, tenantStatusIndexName, journalIndexName},
		MissingStatuses: []processors.Status{processors.StatusParked},
		NewerStatuses:   []string{"from_the_future"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Schema() damaged (-want +got):\n%s", diff)
	}
	if !got.Migrated() || got.Current() {
		t.Errorf("damaged: Migrated() = %v, Current() = %v; want true, false", got.Migrated(), got.Current())
	}

	if _, err := s.pool.Exec(ctx, "ALTER TABLE "+s.table+" DROP CONSTRAINT "+statusCheckName); err != nil {
		t.Fatal(err)
	}
	if got, err = c.Schema(ctx); err != nil || !got.MissingStatusCheck || got.Current() {
		t.Errorf("Schema() without the status check = %+v, %v; want MissingStatusCheck", got, err)
	}
}

// TestCheckerSearchPath: without Config.Schema the tables are looked for
// where an unqualified name resolves, the search_path's first schema.
func TestCheckerSearchPath(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	open(t, Config{DSN: dsn, Schema: schema}).Close()
	c := newChecker(t, Config{DSN: dsn + sep(dsn) + "search_path=" + schema})
	got, err := c.Schema(t.Context())
	if err != nil {
		t.Fatalf("Schema() = %v", err)
	}
	if got.Schema != schema || !got.Current() {
		t.Errorf("Schema() through the search_path = %+v; want schema %s, current", got, schema)
	}
}

// A schema added to the search_path ahead of the one holding the tables
// (a schema named as the user, whom "$user" puts first by default) does
// not move the store: Open, Migrate and the checker take the tables where
// an unqualified read finds them, and create none in the new schema.
// Before, the checker looked in current_schema(), found nothing, and
// Migrate created empty tables there, which new connections then read
// while older ones kept the real ones: a call already done was admitted
// again, and run again.
func TestTablesStayWhereTheSearchPathFindsThem(t *testing.T) {
	dsn := testDSN(t)
	old, ahead := newSchema(t, dsn), newSchema(t, dsn)
	s := open(t, Config{DSN: dsn, Schema: old})
	done := processors.Admission{Key: ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized, Seq: 2, Outbox: []byte("[]")}
	if _, err := s.Admit(t.Context(), []processors.Admission{done}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(t.Context(), "CREATE SCHEMA "+pgx.Identifier{ahead}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	s.Close()
	path := dsn + sep(dsn) + "search_path=" + ahead + "," + old
	s = open(t, Config{DSN: path})
	defer s.Close()
	res, err := s.Admit(t.Context(), []processors.Admission{done})
	if err != nil || len(res) != 1 || res[0].Outcome != processors.Duplicate {
		t.Errorf("the same call admitted again through a search_path with a schema ahead: %+v, %v; want a duplicate", res, err)
	}
	var n int
	if err := s.pool.QueryRow(t.Context(), "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1", ahead).Scan(&n); err != nil || n != 0 {
		t.Errorf("tables in the schema ahead: %d, %v; want none", n, err)
	}
	got, err := newChecker(t, Config{DSN: path}).Schema(t.Context())
	if err != nil || got.Schema != old || !got.Current() {
		t.Errorf("Schema() through the search_path = %+v, %v; want schema %s, current", got, err, old)
	}
}

// A store that does not migrate (ledger api's results, read only), opened
// before the tables are made, finds them where they are made: it names
// them unqualified, as the search_path finds them at each statement.
// Pinned to current_schema() at Open, it would read a schema that never
// gets them (one named as its user, leading the search_path), until
// restarted.
func TestStoreOpenedBeforeItsTablesFindsThem(t *testing.T) {
	dsn := testDSN(t)
	tables, ahead := newSchema(t, dsn), newSchema(t, dsn)
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	for _, sch := range []string{ahead, tables} {
		if _, err := conn.Exec(t.Context(), "CREATE SCHEMA "+pgx.Identifier{sch}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	ro := open(t, Config{DSN: dsn + sep(dsn) + "search_path=" + ahead + "," + tables, SkipMigrate: true})
	defer ro.Close()
	s := open(t, Config{DSN: dsn, Schema: tables})
	defer s.Close()
	done := processors.Admission{Key: ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized, Seq: 2, Outbox: []byte("[]")}
	if _, err := s.Admit(t.Context(), []processors.Admission{done}); err != nil {
		t.Fatal(err)
	}
	if rec, err := ro.Get(t.Context(), done.Key); err != nil || rec.CallID != "c" {
		t.Errorf("the call read through a store opened before its tables were made: %+v, %v; want it found", rec, err)
	}
}

func sep(dsn string) string {
	if !strings.Contains(dsn, "://") {
		return " "
	}
	if strings.Contains(dsn, "?") {
		return "&"
	}
	return "?"
}

func withoutStatus(ss []processors.Status, drop processors.Status) []processors.Status {
	var out []processors.Status
	for _, s := range ss {
		if s != drop {
			out = append(out, s)
		}
	}
	return out
}

// TestCheckerServer: the version and the clock of the server; a DSN that
// does not parse is not repeated.
func TestCheckerServer(t *testing.T) {
	c := newChecker(t, Config{DSN: testDSN(t)})
	srv, err := c.Server(t.Context())
	if err != nil || srv.Version == "" {
		t.Errorf("Server() = %+v, %v; want a version", srv, err)
	}
	before := time.Now()
	now, err := c.Now(t.Context())
	if err != nil {
		t.Fatalf("Now() = %v", err)
	}
	// The test server runs on this machine: its clock is this one's, give
	// or take the query.
	if d := now.Sub(before); d < -time.Minute || d > time.Minute {
		t.Errorf("Now() = %v, this machine %v; want the same clock", now, before)
	}

	_, err = NewChecker(t.Context(), Config{DSN: "postgres://u:hunter2@127.0.0.1:notaport/x"})
	if err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("NewChecker(bad DSN) = %v; want an error without the password", err)
	}
}

// TestConnectLeavesPoolSettingsOut: a DSN with pool settings, which Open
// honours, also serves the single connections of the checker (ledger
// doctor) and of schema set-up; PostgreSQL refuses pool_max_conns as a
// connection parameter.
func TestConnectLeavesPoolSettingsOut(t *testing.T) {
	dsn := testDSN(t)
	pooled := dsn + " pool_max_conns=3" // a key=value DSN
	if strings.Contains(dsn, "://") {
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		pooled = dsn + sep + "pool_max_conns=3"
	}
	conn, err := Connect(t.Context(), pooled)
	if err != nil {
		t.Fatalf("Connect(DSN with pool_max_conns) = %v", err)
	}
	var one int
	if err := conn.QueryRow(t.Context(), "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Errorf("SELECT 1 = %d, %v", one, err)
	}
	conn.Close(t.Context())
	c := newChecker(t, Config{DSN: pooled})
	if _, err := c.Server(t.Context()); err != nil {
		t.Errorf("checker on a DSN with pool_max_conns: Server() = %v", err)
	}
	_, err = Connect(t.Context(), "postgres://u:hunter2@127.0.0.1:notaport/x")
	if err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("Connect(bad DSN) = %v; want an error without the password", err)
	}
}

// failingBeginner begins its transactions on db and fails the first fail
// queries run in them with SQLSTATE code, as CockroachDB fails a read
// within another transaction's uncertainty interval with 40001.
type failingBeginner struct {
	db     txBeginner
	code   string
	fail   int
	begins int
}

func (b *failingBeginner) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	b.begins++
	tx, err := b.db.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &failingTx{Tx: tx, b: b}, nil
}

type failingTx struct {
	pgx.Tx
	b *failingBeginner
}

func (tx *failingTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if tx.b.fail > 0 {
		tx.b.fail--
		return nil, &pgconn.PgError{Code: tx.b.code, Message: "injected"}
	}
	return tx.Tx.Query(ctx, sql, args...)
}

// TestReadSchemaRetriesSerializationFailure: a read of the schema that
// fails with 40001 is read again whole in a new transaction, and gives
// what a read without the failure gives; another error ends it at once.
func TestReadSchemaRetriesSerializationFailure(t *testing.T) {
	ctx := t.Context()
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	s := open(t, Config{DSN: dsn, Schema: schema})
	defer s.Close()
	want, err := readSchema(ctx, s.pool, schema, s.CockroachDB())
	if err != nil {
		t.Fatal(err)
	}

	b := &failingBeginner{db: s.pool, code: "40001", fail: 2}
	got, err := readSchema(ctx, b, schema, s.CockroachDB())
	if err != nil {
		t.Fatalf("readSchema() with two serialization failures = %v; want it read again", err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("readSchema() after retries (-want +got):\n%s", diff)
	}
	if b.begins != 3 {
		t.Errorf("readSchema() began %d transactions; want 3 (two failed, one read)", b.begins)
	}

	b = &failingBeginner{db: s.pool, code: "42501", fail: 1}
	_, err = readSchema(ctx, b, schema, s.CockroachDB())
	if pe, ok := errors.AsType[*pgconn.PgError](err); !ok || pe.Code != "42501" {
		t.Errorf("readSchema() with insufficient privilege = %v; want the 42501", err)
	}
	if b.begins != 1 {
		t.Errorf("readSchema() with insufficient privilege began %d transactions; want 1", b.begins)
	}
}
