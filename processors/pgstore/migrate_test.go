package pgstore

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
)

// openPG opens a store in a fresh schema for a test of how PostgreSQL
// takes locks during a migration; it skips the test on CockroachDB, which
// changes schemas online whatever Migrate asks.
func openPG(t *testing.T) (*Store, Config) {
	t.Helper()
	dsn := testDSN(t)
	cfg := Config{DSN: dsn, Schema: newSchema(t, dsn)}
	s := open(t, cfg)
	t.Cleanup(func() { s.Close() })
	if s.CockroachDB() {
		t.Skip("PostgreSQL's locks during a migration: CockroachDB's schema changes are online")
	}
	return s, cfg
}

// openWithoutIndex opens a store with openPG and drops its tenant status
// index, as a table the build before that index left it.
func openWithoutIndex(t *testing.T) (*Store, Config) {
	t.Helper()
	s, cfg := openPG(t)
	drop := "DROP INDEX " + pgx.Identifier{cfg.Schema, tenantStatusIndexName}.Sanitize()
	if _, err := s.pool.Exec(t.Context(), drop); err != nil {
		t.Fatalf("%s: %v", drop, err)
	}
	return s, cfg
}

// holdWrite opens a transaction on s's pool that keeps a write lock on
// its records table until the returned function ends it, as a process
// stalled inside a transaction does; the test's end ends it too, before
// the store is closed (which would wait for it). It also returns the
// holding session's pid.
func holdWrite(t *testing.T, s *Store) (release func(), pid uint32) {
	t.Helper()
	ctx := t.Context()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	release = func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }
	t.Cleanup(release)
	if _, err := tx.Exec(ctx, "UPDATE "+s.table+" SET seq = seq WHERE false"); err != nil {
		t.Fatal(err)
	}
	return release, tx.Conn().PgConn().PID()
}

// TestMigrateBuildsIndexConcurrently: an index added to a table that
// exists is built without blocking writes. While another transaction is
// open on the table, the migration waits for it, and meanwhile a write
// through another session goes through; once the transaction ends the
// migration completes with the index valid. A plain CREATE INDEX queued
// for a SHARE lock behind the open transaction, and every write queued
// behind it.
func TestMigrateBuildsIndexConcurrently(t *testing.T) {
	s, cfg := openWithoutIndex(t)
	ctx := t.Context()
	release, _ := holdWrite(t, s)
	k := migrateWhileHeld(t, s, cfg, release, "the index builds", func() { waitForLock(t, s, "CREATE INDEX") })
	if got, err := s.TenantByStatus(ctx, "t_acme", processors.StatusPending, 10); err != nil || len(got) != 1 || got[0].Key != k {
		t.Errorf("TenantByStatus(t_acme) after the migration = %v, %v; want the call admitted during it", got, err)
	}
}

// TestMigrateRebuildsInvalidIndex: an index that a CONCURRENTLY build left
// invalid (here: cancelled while it waited) counts as missing, and the
// next migration drops it and builds it again; IF NOT EXISTS alone would
// keep the invalid one, which no query can use, for good.
func TestMigrateRebuildsInvalidIndex(t *testing.T) {
	s, cfg := openWithoutIndex(t)
	ctx := t.Context()
	release, _ := holdWrite(t, s)
	conn, err := Connect(ctx, cfg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	build := "CREATE INDEX CONCURRENTLY " + pgx.Identifier{tenantStatusIndexName}.Sanitize() + " ON " + s.table + " (tenant_id)"
	if _, err := conn.Exec(ctx, "SET statement_timeout = '300ms'"); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, build); err == nil {
		t.Fatalf("%s with a transaction open and a 300 ms timeout succeeded; want it cancelled, leaving the index invalid", build)
	}
	release()
	var valid bool
	err = conn.QueryRow(ctx, `SELECT i.indisvalid FROM pg_catalog.pg_index AS i
JOIN pg_catalog.pg_class AS c ON c.oid = i.indexrelid
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2`, cfg.Schema, tenantStatusIndexName).Scan(&valid)
	if err != nil || valid {
		t.Fatalf("the cancelled build's index: valid %v, %v; want an invalid index left", valid, err)
	}
	c := newChecker(t, cfg)
	if st, err := c.Schema(ctx); err != nil || !slices.Equal(st.MissingIndexes, []string{tenantStatusIndexName}) {
		t.Fatalf("Schema() with the index invalid = %+v, %v; want it missing", st, err)
	}
	open(t, cfg).Close() // migrates
	st, err := c.Schema(ctx)
	if err != nil || !st.Current() {
		t.Fatalf("Schema() after the migration = %+v, %v; want current", st, err)
	}
	var def string
	if err := conn.QueryRow(ctx, "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = $2", cfg.Schema, tenantStatusIndexName).Scan(&def); err != nil {
		t.Fatal(err)
	}
	if want := "(tenant_id, status, updated_at, idempotency_key)"; !strings.Contains(def, want) {
		t.Errorf("index after the migration = %q; want schema.sql's, on %s", def, want)
	}
}

// TestSchemaIndexes: Migrate recognises every index statement of
// schema.sql (to skip one that exists and build a missing one
// CONCURRENTLY), and nothing else, comments included, as one.
func TestSchemaIndexes(t *testing.T) {
	var got []string
	creates := 0
	for _, tmpl := range strings.Split(schemaSQL, ";\n") {
		if strings.Contains(stripComments(tmpl), "CREATE INDEX") {
			creates++
		}
		if index, table, ok := schemaIndexOf(tmpl); ok {
			got = append(got, table+"."+index)
		}
	}
	want := []string{tableName + "." + leaseIndexName, tableName + "." + statusIndexName, tableName + "." + tenantStatusIndexName,
		tableName + "." + unloggedIndexName, journalTableName + "." + journalIndexName}
	if !slices.Equal(got, want) || creates != len(want) {
		t.Errorf("index statements recognised in schema.sql = %v (of %d CREATE INDEX); want %v", got, creates, want)
	}
	if _, _, ok := schemaIndexOf("-- CREATE INDEX IF NOT EXISTS {lease_index} ON {table}\nCREATE TABLE IF NOT EXISTS {table} (a BIGINT)"); ok {
		t.Error("a statement whose comment reads like an index statement was taken for one")
	}
}

// TestMigrateDropsOnlyItsOwnIndex: a store that finds its schema through
// the search_path (no Config.Schema), missing an index that a store in a
// schema further down the search_path has, builds its own and leaves the
// other's alone. Unqualified, the DROP INDEX that clears an invalid build
// first found the other schema's index of the same name and dropped it.
func TestMigrateDropsOnlyItsOwnIndex(t *testing.T) {
	mine, cfg := openWithoutIndex(t)
	mine.Close()
	dsn := testDSN(t)
	other := Config{DSN: dsn, Schema: newSchema(t, dsn)}
	open(t, other).Close()

	path := Config{DSN: dsn + sep(dsn) + "search_path=" + cfg.Schema + "," + other.Schema}
	open(t, path).Close() // migrates cfg.Schema, unqualified
	for _, c := range []Config{cfg, other} {
		if st, err := newChecker(t, c).Schema(t.Context()); err != nil || !st.Current() {
			t.Errorf("schema %s after the unqualified store's migration = %+v, %v; want current", c.Schema, st, err)
		}
	}
}

// TestMigrateStatusCheckStepsOutOfTheLockQueue: widening the status check
// while another transaction is open on the table does not stop the
// table's writes. The ALTER that needs the table's ACCESS EXCLUSIVE lock
// gives up after a moment and tries again later; queued for good, it held
// every later read and write behind it until the open transaction ended.
func TestMigrateStatusCheckStepsOutOfTheLockQueue(t *testing.T) {
	s, cfg := openPG(t)
	ctx := t.Context()
	// The check as a build with fewer statuses left it.
	narrow := []string{
		"ALTER TABLE " + s.table + " DROP CONSTRAINT " + statusCheckName,
		"ALTER TABLE " + s.table + " ADD CONSTRAINT " + statusCheckName + " CHECK (status IN ('authorized', 'pending', 'executing', 'succeeded'))",
	}
	for _, stmt := range narrow {
		if _, err := s.pool.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	migrateSteppingOut(t, s, cfg, "the status check waits for the table")
}

// migrateSteppingOut migrates cfg while a transaction holds s's table, as
// migrateWhileHeld, once the migration's ALTER logs that it stepped out
// of the lock queue to wait.
func migrateSteppingOut(t *testing.T, s *Store, cfg Config, during string) {
	t.Helper()
	release, _ := holdWrite(t, s)
	logs := &ledgertest.LogBuffer{}
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	migrateWhileHeld(t, s, cfg, release, during, func() {
		waitForLog(t, logs, "waits for transactions on the table")
	})
}

// TestMigrateAddColumnStepsOutOfTheLockQueue: adding a column to a table
// an older build created, while another transaction is open on the
// table, does not stop the table's writes, as the status check's ALTER.
func TestMigrateAddColumnStepsOutOfTheLockQueue(t *testing.T) {
	s, cfg := openPG(t)
	if _, err := s.pool.Exec(t.Context(), "ALTER TABLE "+s.table+" DROP COLUMN user_id"); err != nil {
		t.Fatal(err)
	}
	migrateSteppingOut(t, s, cfg, "the column's addition waits for the table")
}

// TestMigrateIndexBuildEndedByLockTimeoutFails: an index build that the
// deployment's own lock_timeout ends (here the session's, as a role's or
// a database's setting would be) fails the migration. Tried again, IF
// NOT EXISTS kept the invalid index the first try left, and the
// migration reported success with an index no query can use.
func TestMigrateIndexBuildEndedByLockTimeoutFails(t *testing.T) {
	s, cfg := openWithoutIndex(t)
	release, _ := holdWrite(t, s)
	cfg.DSN += "&lock_timeout=200ms"
	s2, err := Open(t.Context(), cfg)
	if err == nil {
		s2.Close()
	}
	release()
	var valid bool
	qerr := s.pool.QueryRow(t.Context(), `SELECT i.indisvalid FROM pg_catalog.pg_index AS i
JOIN pg_catalog.pg_class AS c ON c.oid = i.indexrelid
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2`, cfg.Schema, tenantStatusIndexName).Scan(&valid)
	switch {
	case err == nil && (qerr != nil || !valid):
		t.Errorf("Open = nil with index %s valid %v (%v); want an error, or the index built", tenantStatusIndexName, valid, qerr)
	case err != nil && sqlState(err) != codeLockNotAvailable:
		t.Errorf("Open = %v; want the lock timeout's error (55P03)", err)
	}
}

// migrateWhileHeld opens cfg, and so migrates it, while release's
// transaction holds s's table: once waiting returns (the migration waits
// for the table), a write through s must go through at once; then the
// transaction ends, and the migration must end with the schema current.
// It returns the key of the call written.
func migrateWhileHeld(t *testing.T, s *Store, cfg Config, release func(), during string, waiting func()) ledger.CallKey {
	t.Helper()
	ctx := t.Context()
	migrated := make(chan error, 1)
	go func() {
		s2, err := Open(ctx, cfg)
		if err == nil {
			s2.Close()
		}
		migrated <- err
	}()
	waiting()
	wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	// Named columns a table of every build has: the migration may be
	// adding one.
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "during"}
	if _, err := s.pool.Exec(wctx, "INSERT INTO "+s.table+` (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, created_at, updated_at)
VALUES ($1, $2, 'c', 'h', 'x', 1, 'pending', now(), now())`, k.TenantID, k.IdempotencyKey); err != nil {
		t.Fatalf("a write while %s = %v; want it to go on", during, err)
	}
	release()
	// An index build also waits for every older transaction in the
	// database, other tests' included: a budget of its own, generous.
	select {
	case err := <-migrated:
		if err != nil {
			t.Fatalf("Open (migrating) = %v", err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the migration did not end within 2 minutes of the open transaction's end")
	}
	if st, err := newChecker(t, cfg).Schema(ctx); err != nil || !st.Current() {
		t.Errorf("Schema() after the migration = %+v, %v; want current", st, err)
	}
	return k
}

// TestMigrateValidatesAnUnvalidatedCheck: a status check that a migration
// added NOT VALID and never validated (it stopped halfway) is reported
// (not current) and validated by the next migration; it was taken as
// current for good, its rows never checked.
func TestMigrateValidatesAnUnvalidatedCheck(t *testing.T) {
	s, cfg := openPG(t)
	ctx := t.Context()
	halfway := "ALTER TABLE " + s.table + " DROP CONSTRAINT " + statusCheckName + ", ADD CONSTRAINT " + statusCheckName +
		" CHECK (status IN (" + quoteStatuses(processors.Statuses) + ")) NOT VALID"
	if _, err := s.pool.Exec(ctx, halfway); err != nil {
		t.Fatalf("%s: %v", halfway, err)
	}
	c := newChecker(t, cfg)
	if st, err := c.Schema(ctx); err != nil || !st.UnvalidatedStatusCheck || st.Current() {
		t.Fatalf("Schema() with the check not validated = %+v, %v; want it reported, not current", st, err)
	}
	open(t, cfg).Close() // migrates
	if st, err := c.Schema(ctx); err != nil || st.UnvalidatedStatusCheck || !st.Current() {
		t.Errorf("Schema() after the migration = %+v, %v; want the check validated, current", st, err)
	}
}

// TestMigrateNamesWhatItWaitsFor: a migration that waits for another
// session's transaction (here an index build, for a transaction left open
// on the table) logs that session, and the build's phase and progress, so
// that an upgrade that seems to hang says what holds it.
func TestMigrateNamesWhatItWaitsFor(t *testing.T) {
	s, cfg := openWithoutIndex(t)
	release, holder := holdWrite(t, s)
	logs := &ledgertest.LogBuffer{}
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	cfg.MigrationWaitReport = 50 * time.Millisecond
	migrateWhileHeld(t, s, cfg, release, "the index builds", func() {
		waitForLog(t, logs, fmt.Sprintf("pid %d (", holder))
		waitForLog(t, logs, fmt.Sprintf(`index=%s phase="waiting for writers before build" lockers=0/1`, tenantStatusIndexName))
	})
}

// waitForLog waits until the log holds text.
func waitForLog(t *testing.T, logs *ledgertest.LogBuffer, text string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(logs.String(), text); {
		if time.Now().After(deadline) {
			t.Fatalf("the migration never logged %q; its log:\n%s", text, logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
