// Package pgstore is the production execution store (processors.Store) on
// CockroachDB, with PostgreSQL as its wire-compatible stand-in in tests.
// The SQL is the subset both accept; comments mark where CockroachDB
// differs.
//
// Every method is one SERIALIZABLE transaction over the whole batch
// (except, on PostgreSQL, Admit, Claim, Complete, Release, MarkLogged,
// MarkUndo, NoteUnanswered, ReadBack, PruneRates, Settle and the
// journal's revert, at READ COMMITTED: see relaxed), its statements
// pipelined (pgx.Batch) so that a batch costs one round trip plus BEGIN and COMMIT, not one per call. On
// PostgreSQL the writes of a call's hot path send BEGIN and COMMIT in the
// same round trip as their statements (batchTx): one round trip, where a
// batch of a few calls, as at low load, cost three. Serialization
// failures (SQLSTATE 40001) restart the whole transaction, a bounded
// number of times:
//
//   - on PostgreSQL with crdb.ExecuteCtx around pgx.BeginTxFunc (or a
//     pipelined transaction, batchTx): a fresh transaction per attempt,
//     with jittered backoff between attempts;
//   - on CockroachDB (detected from version() at Open) with
//     crdbpgxv5.ExecuteTx, CockroachDB's savepoint protocol, which keeps
//     the transaction's priority across restarts. It must not be used on
//     PostgreSQL, where RELEASE SAVEPOINT commits nothing: the protocol
//     ignores the error of the real COMMIT, so a commit-time 40001 is a
//     lost write reported as success, and it never recovers from a
//     statement-level 40001 either.
//
// Errors whose SQLSTATE says the data itself is the problem (class 22, a
// data exception such as a NUL in TEXT; class 23, an integrity constraint
// such as the status CHECK, except 23505) wrap processors.ErrRejected as
// well as the *pgconn.PgError, and are never retried.
//
// On PostgreSQL the store's sessions plan without sequential scans
// (noSeqScans): under SERIALIZABLE one would lock the whole table.
//
// Dedupe rests on the table's primary key (tenant_id, idempotency_key)
// and INSERT ... ON CONFLICT DO NOTHING, not on the isolation level alone.
// Leases are measured against the database's now() (the transaction's
// start time on both engines), never against the client's clock.
package pgstore

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cockroachdb/cockroach-go/v2/crdb"
	crdbpgx "github.com/cockroachdb/cockroach-go/v2/crdb/crdbpgxv5"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/failpoint"
	"github.com/toolcall-ledger/ledger/processors"
)

//go:embed schema.sql
var schemaSQL string

// Table, index and constraint names; Config.Schema qualifies the table
// and, implicitly, its indexes.
const (
	tableName         = "execution_records"
	leaseIndexName    = "execution_records_executing_lease_until"
	unloggedIndexName = "execution_records_unlogged_updated_at"
	statusIndexName   = "execution_records_listed_updated_at"
	// tenantStatusIndexName serves TenantByStatus: statusIndexName's
	// entries, the tenant first.
	tenantStatusIndexName = "execution_records_tenant_listed_updated_at"
	statusCheckName       = "execution_records_status"
	journalTableName      = "execution_journal"
	journalIndexName      = "execution_journal_created_at"
)

// journalCols are the journal table's columns (schema.sql).
var journalCols = []string{"id", "created_at", "tenant_ids", "idempotency_keys", "epochs", "seqs", "from_seqs"}

// obsoleteIndexes are indexes older builds created on the execution
// records table, replaced by leaseIndexName and statusIndexName: full
// indexes on (status, lease_until) and (status, updated_at), which took
// an entry for every update of every call. Migrate drops them.
var obsoleteIndexes = []string{"execution_records_status_lease_until", "execution_records_status_updated_at"}

// listedStatuses are the statuses ByStatus serves through statusIndexName
// (and TenantByStatus through tenantStatusIndexName). Changing the list
// changes the indexes' predicate, which needs new index names (CREATE
// INDEX IF NOT EXISTS keeps the old ones).
var listedStatuses = processors.ListedStatuses

// DefaultMaxRetries is Config.MaxRetries' default.
const DefaultMaxRetries = 30

// Config configures the store.
type Config struct {
	// DSN is the pgx connection string (URL or key=value), e.g.
	// postgres://ledger@127.0.0.1:26257/ledger?sslmode=verify-full.
	// Required. Pool settings in it (pool_max_conns...) apply.
	DSN string
	// Schema holds the table, created by Migrate if missing. Default:
	// where the connection's search_path finds the tables when Open runs
	// (the first of its schemas that holds them; for new tables,
	// current_schema(): public on PostgreSQL and CockroachDB), and every
	// statement names that schema from then on, so that a schema added
	// to the search_path later cannot divert them. Tests use one schema
	// per test.
	Schema string
	// SkipMigrate stops Open from applying the schema. Default false: Open
	// runs Migrate, which is idempotent. Deployments that apply the DDL
	// (schema.sql) out of band, or whose user may not run DDL, set it.
	SkipMigrate bool
	// MaxConns caps the pool. Default: the DSN's pool_max_conns, else
	// pgxpool's default (max(4, GOMAXPROCS)).
	MaxConns int32
	// MaxRetries bounds the restarts of one transaction after
	// serialization failures. Default DefaultMaxRetries. Bounded so that
	// a pathological hot key surfaces as an error (classified retry-later,
	// since it wraps the last 40001) instead of holding a connection
	// forever: crdb's own defaults are 50 for ExecuteCtx and unbounded for
	// the savepoint protocol.
	MaxRetries int
	// Logger receives lifecycle logs and a Warn per transaction retry.
	// Nil discards.
	Logger *slog.Logger
	// Failpoint, if set, is hit when a claim's statements are sent (on
	// PostgreSQL with their COMMIT) and no answer is read
	// (failpoint.ClaimSent): the reliability suite crashes the executor
	// there.
	Failpoint failpoint.Hook
	// Retried, if set, is called with the operation ("admit", "claim",
	// ...) each time a transaction runs again after a serialization
	// failure or a deadlock: for a metric, since a storm of them costs
	// whole batches while every call still succeeds.
	Retried func(op string)
	// PlainOutboxes writes outboxes uncompressed, as builds before
	// compressed outboxes did (see outboxS2). Either form is read
	// whatever it is set to. Set it while a rolling upgrade from such a
	// build runs, so that the processes still on the older build can
	// read what the upgraded ones write; unset it once none is left.
	PlainOutboxes bool
	// MigrationWaitReport is how often a migration on PostgreSQL logs
	// how far the index it builds has come and which sessions'
	// transactions it waits for (an index built CONCURRENTLY waits for
	// every older one in the database). Default
	// DefaultMigrationWaitReport.
	MigrationWaitReport time.Duration
}

// DefaultMigrationWaitReport is Config.MigrationWaitReport's default.
const DefaultMigrationWaitReport = 10 * time.Second

func (c *Config) setDefaults() {
	if c.MaxRetries == 0 {
		c.MaxRetries = DefaultMaxRetries
	}
	if c.MigrationWaitReport == 0 {
		c.MigrationWaitReport = DefaultMigrationWaitReport
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

func (c *Config) validate() error {
	if c.DSN == "" {
		return errors.New("pgstore: DSN is required")
	}
	if c.MaxRetries < 0 {
		return fmt.Errorf("pgstore: MaxRetries %d is negative", c.MaxRetries)
	}
	if c.MigrationWaitReport < 0 {
		return fmt.Errorf("pgstore: MigrationWaitReport %v is negative", c.MigrationWaitReport)
	}
	if c.MaxConns < 0 {
		return fmt.Errorf("pgstore: MaxConns %d is negative", c.MaxConns)
	}
	return nil
}

// Store is the SQL execution store. It is safe for concurrent use.
type Store struct {
	pool       *pgxpool.Pool
	log        *slog.Logger
	crdb       bool
	maxRetries int
	schema     string // sanitized identifier, or "": qualifies the tables
	schemaName string // Config.Schema as given, else as resolved at Open
	ownSchema  bool   // Config.Schema: Migrate creates the schema too
	table      string // sanitized, qualified by schema if set
	journal    string // the journal table, as table
	q          queries
	failpoint  failpoint.Hook
	retried    func(op string)
	// packMin is the shortest outbox stored compressed; -1 with
	// Config.PlainOutboxes.
	packMin int
	// waitReport is Config.MigrationWaitReport.
	waitReport time.Duration
}

var _ processors.Store = (*Store)(nil)

// dsnError is the error of a DSN that pgx would not take. The DSN may
// hold a password, and pgx's own error quotes it: only a file the DSN
// names that cannot be read (its sslrootcert, sslcert or sslkey, which
// pgx reads as it parses) is said, since that is what an operator must
// fix and says nothing secret.
func dsnError(err error) error {
	if pe, ok := errors.AsType[*fs.PathError](err); ok {
		return fmt.Errorf("pgstore: the DSN names a file that cannot be read: %w", pe)
	}
	return errors.New("pgstore: cannot parse DSN")
}

// Open connects, detects CockroachDB and, unless cfg.SkipMigrate, applies
// the schema.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, dsnError(err)
	}
	if cfg.MaxConns > 0 {
		pcfg.MaxConns = cfg.MaxConns
	}
	pcfg.AfterConnect = noSeqScans
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("pgstore: connect: %w", err)
	}
	var version string
	if err := pool.QueryRow(ctx, "SELECT version()").Scan(&version); err != nil {
		pool.Close()
		return nil, fmt.Errorf("pgstore: connect: %w", err)
	}
	s := &Store{
		pool:       pool,
		log:        cfg.Logger,
		crdb:       strings.Contains(version, "CockroachDB"),
		maxRetries: cfg.MaxRetries,
		table:      pgx.Identifier{tableName}.Sanitize(),
		journal:    pgx.Identifier{journalTableName}.Sanitize(),
		failpoint:  cfg.Failpoint,
		retried:    cfg.Retried,
		packMin:    outboxMinPack,
		waitReport: cfg.MigrationWaitReport,
	}
	schema, own := cfg.Schema, cfg.Schema != ""
	if !own {
		// Resolved once, and every statement named by it: DDL and DML
		// resolve an unqualified name each its own way (see
		// resolveSchemaSQL).
		var found, cur pgtype.Text
		if err := pool.QueryRow(ctx, resolveSchemaSQL, tableName).Scan(&found, &cur); err != nil {
			pool.Close()
			return nil, fmt.Errorf("pgstore: resolve the tables' schema: %w", err)
		}
		schema = found.String
		if schema == "" && !cfg.SkipMigrate {
			// Migrate creates them there. A store that does not
			// migrate, opened before the tables are made (ledger api's
			// results, read only), names them unqualified: pinned to
			// current_schema(), it would miss them made elsewhere.
			schema = cur.String
		}
	}
	if schema != "" {
		s.schema, s.schemaName, s.ownSchema = pgx.Identifier{schema}.Sanitize(), schema, own
		s.table = pgx.Identifier{schema, tableName}.Sanitize()
		s.journal = pgx.Identifier{schema, journalTableName}.Sanitize()
	}
	if cfg.PlainOutboxes {
		s.packMin = -1
	}
	s.q = newQueries(s.table, s.journal)
	if !cfg.SkipMigrate {
		if err := s.Migrate(ctx); err != nil {
			pool.Close()
			return nil, err
		}
	}
	cfg.Logger.Info("execution store opened", "cockroachdb", s.crdb, "schema", s.schemaName, "max_conns", pool.Config().MaxConns)
	return s, nil
}

// CockroachDB reports whether the server said it is CockroachDB, which
// selects the savepoint retry protocol.
func (s *Store) CockroachDB() bool { return s.crdb }

// Ping checks that the database answers, for readiness checks.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("execution store: %w", err)
	}
	return nil
}

// Close closes the pool, waiting for connections in use to be released.
func (s *Store) Close() error {
	s.pool.Close()
	return nil
}

// noSeqScans makes a PostgreSQL session plan without sequential scans
// where it can. Under SERIALIZABLE a sequential scan takes a predicate
// lock on the whole table (PostgreSQL's manual, "Serializable Isolation
// Level"), so a batch planned that way, which is the planner's choice on
// a small table (every table is small at first; chaos and test schemas
// stay small), conflicts with every concurrent writer: it and they are
// aborted with 40001 again and again, and a large batch can retry until
// its deadline. Through the primary key a batch locks its own rows'
// pages. CockroachDB tracks conflicts per key, has no such setting, and
// announces itself with the crdb_version parameter.
func noSeqScans(ctx context.Context, conn *pgx.Conn) error {
	if conn.PgConn().ParameterStatus("crdb_version") != "" {
		return nil
	}
	if _, err := conn.Exec(ctx, "SET enable_seqscan = off"); err != nil {
		return fmt.Errorf("pgstore: set enable_seqscan: %w", err)
	}
	return nil
}

// Migrate applies the embedded schema (schema.sql), CREATE ... IF NOT
// EXISTS only, then brings the status CHECK of a table an older build
// created up to processors.Statuses (see migrateStatusCheck). It is safe
// to run on every start and from several processes.
//
// It reads the catalogs first (as `ledger doctor` does) and runs no DDL at
// all when the schema is already this build's, which is every start but
// the first after an upgrade. On PostgreSQL even CREATE INDEX IF NOT
// EXISTS of an index that exists takes a SHARE lock on its table before
// it finds the index: it waits for every open transaction that wrote to
// the table, and every write after it queues behind it. A process
// starting while another was stalled inside a transaction (a paused
// executor, a long GC) stopped every writer of the store until the
// stalled one went on.
//
// For the same reason, on PostgreSQL an index added to a table that
// already exists (an upgrade) is built CONCURRENTLY, and an obsolete one
// dropped so: writes go on while it builds, where a plain CREATE INDEX
// blocked them for as long as it read the table. One process migrates at
// a time (an advisory lock on a session of its own, since CONCURRENTLY
// runs outside transactions), so that an index another process is still
// building is never taken for one a failed build left invalid, which is
// dropped and built again. CockroachDB builds and drops indexes online.
func (s *Store) Migrate(ctx context.Context) error {
	st, err := readSchema(ctx, s.pool, s.schemaName, s.crdb)
	if err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	if st.Current() && len(st.ObsoleteIndexes) == 0 {
		return nil
	}
	if s.crdb {
		return s.applySchema(ctx, s.pool, st)
	}
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	// Out of the pool: closing it releases the lock, whatever happened.
	conn := pc.Hijack()
	defer conn.Close(context.WithoutCancel(ctx))
	if err := s.lockMigration(ctx, conn, st.Schema); err != nil {
		return err
	}
	// Another process may have migrated while this one waited.
	if st, err = readSchema(ctx, conn, s.schemaName, false); err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	if st.Current() && len(st.ObsoleteIndexes) == 0 {
		return nil
	}
	stop := s.reportProgress(ctx, conn.PgConn().PID())
	defer stop()
	return s.applySchema(ctx, conn, st)
}

// reportProgress logs, every waitReport until the returned function is
// called, how far the index that the migration's session pid builds has
// come (PostgreSQL's pg_stat_progress_create_index: its phase, and the
// lockers, blocks and tuples of the phase done and in all) and the
// sessions whose transactions it waits for (pg_blocking_pids), so that an
// operator whose upgrade takes long sees that it moves, or what holds it.
// The sessions' queries are not logged: they may hold anything.
func (s *Store) reportProgress(ctx context.Context, pid uint32) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(s.waitReport)
		defer tick.Stop()
		for {
			select {
			case <-tick.C:
			case <-ctx.Done():
				return
			}
			s.reportIndexBuild(ctx, pid)
			// pid 0 is a prepared transaction, which has no session; a
			// role that may not see other roles' sessions in full gets
			// NULL state and start: unknown, not zero.
			rows, _ := s.pool.Query(ctx, `SELECT b.pid, coalesce(a.usename, ''), coalesce(a.application_name, ''), a.state,
       extract(epoch FROM now() - a.xact_start)::FLOAT8
FROM (SELECT DISTINCT unnest(pg_catalog.pg_blocking_pids($1)) AS pid) AS b
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = b.pid
ORDER BY b.pid`, int64(pid))
			var (
				sessions    []string
				other       int32
				user, app   string
				state       pgtype.Text
				secondsOpen pgtype.Float8
			)
			_, err := pgx.ForEachRow(rows, []any{&other, &user, &app, &state, &secondsOpen}, func() error {
				if other == 0 {
					sessions = append(sessions, "a prepared transaction (see pg_prepared_xacts)")
					return nil
				}
				st, open := "unknown", "unknown"
				if state.Valid {
					st = state.String
				}
				if secondsOpen.Valid {
					open = time.Duration(secondsOpen.Float64 * float64(time.Second)).Round(time.Second).String()
				}
				sessions = append(sessions, fmt.Sprintf("pid %d (user %q, application %q, %s, its transaction open %s)", other, user, app, st, open))
				return nil
			})
			switch {
			case err != nil && ctx.Err() == nil:
				s.log.Debug("execution store: cannot read what the migration waits for", "err", err)
			case err == nil && len(sessions) > 0:
				s.log.Info("execution store: the migration waits for other sessions' transactions to end", "sessions", strings.Join(sessions, "; "))
			}
		}
	}()
	return func() { cancel(); <-done }
}

// reportIndexBuild logs the progress of the index that session pid
// builds, if it builds one. A count whose phase does not use it (zero in
// all) is left out.
func (s *Store) reportIndexBuild(ctx context.Context, pid uint32) {
	var (
		index, phase              string
		lockersDone, lockersTotal int64
		blocksDone, blocksTotal   int64
		tuplesDone, tuplesTotal   int64
	)
	err := s.pool.QueryRow(ctx, `SELECT coalesce(c.relname, ''), p.phase, p.lockers_done, p.lockers_total,
       p.blocks_done, p.blocks_total, p.tuples_done, p.tuples_total
FROM pg_catalog.pg_stat_progress_create_index AS p
LEFT JOIN pg_catalog.pg_class AS c ON c.oid = p.index_relid
WHERE p.pid = $1`, int64(pid)).Scan(&index, &phase, &lockersDone, &lockersTotal, &blocksDone, &blocksTotal, &tuplesDone, &tuplesTotal)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return
	case err != nil:
		if ctx.Err() == nil {
			s.log.Debug("execution store: cannot read how far the migration's index build has come", "err", err)
		}
		return
	}
	attrs := []any{"index", index, "phase", phase}
	for _, c := range []struct {
		name        string
		done, total int64
	}{{"lockers", lockersDone, lockersTotal}, {"blocks", blocksDone, blocksTotal}, {"tuples", tuplesDone, tuplesTotal}} {
		if c.total > 0 {
			attrs = append(attrs, c.name, fmt.Sprintf("%d/%d", c.done, c.total))
		}
	}
	s.log.Info("execution store: the migration builds an index", attrs...)
}

// ddlConn is what a migration runs its statements on: the pool, or on
// PostgreSQL the session that holds the migration lock.
type ddlConn interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// lockMigration takes the migration lock on conn, polling for it: a
// session blocked in pg_advisory_lock would hold a snapshot while it
// waits, and a CREATE INDEX CONCURRENTLY of the holder waits for every
// older snapshot, so the two would deadlock.
func (s *Store) lockMigration(ctx context.Context, conn *pgx.Conn, schema string) error {
	key := migrateLockKey(schema)
	for waited := false; ; waited = true {
		var ok bool
		if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", key).Scan(&ok); err != nil {
			return fmt.Errorf("pgstore: migrate: take the migration lock: %w", err)
		}
		if ok {
			return nil
		}
		if !waited {
			s.log.Info("execution store: another process is migrating the schema; waiting for it")
		}
		select {
		case <-time.After(100*time.Millisecond + rand.N(100*time.Millisecond)):
		case <-ctx.Done():
			return fmt.Errorf("pgstore: migrate: wait for another process's migration: %w", ctx.Err())
		}
	}
}

// migrateLockKey is the advisory lock of the migrations of the tables in
// schema (as readSchema resolved it, so that a store named by its schema
// and one that finds it through the search_path take the same lock): one
// per schema, so that stores in other schemas migrate side by side.
func migrateLockKey(schema string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("toolcall-ledger pgstore migrate " + schema))
	return int64(h.Sum64())
}

// schemaIndex matches an index's statement in schema.sql: its name's and
// its table's placeholders.
var schemaIndex = regexp.MustCompile(`CREATE INDEX IF NOT EXISTS (\{\w+\}) ON (\{\w+\})`)

// schemaIndexes are the indexes schema.sql creates, in its order: each
// one's placeholder there, its name, and its table. Migrate, readSchema
// and the replacement of the placeholders all read this one list.
var schemaIndexes = []struct{ placeholder, name, table string }{
	{"{lease_index}", leaseIndexName, tableName},
	{"{status_index}", statusIndexName, tableName},
	{"{tenant_status_index}", tenantStatusIndexName, tableName},
	{"{unlogged_index}", unloggedIndexName, tableName},
	{"{journal_index}", journalIndexName, journalTableName},
}

// schemaTables name the tables of schema.sql's placeholders that indexes
// are on.
var schemaTables = map[string]string{"{table}": tableName, "{journal}": journalTableName}

// schemaColumn matches a column's addition in schema.sql: its table's
// placeholder and the column.
var schemaColumn = regexp.MustCompile(`ALTER TABLE (\{\w+\}) ADD COLUMN IF NOT EXISTS (\w+)`)

// schemaColumnOf returns the column a statement of schema.sql adds to an
// existing table, and that table, and whether it adds one; comments do
// not count.
func schemaColumnOf(tmpl string) (column, table string, ok bool) {
	m := schemaColumn.FindStringSubmatch(stripComments(tmpl))
	if m == nil || schemaTables[m[1]] == "" {
		return "", "", false
	}
	return m[2], schemaTables[m[1]], true
}

// schemaIndexOf returns the index a statement of schema.sql creates and
// its table, and whether it creates one of schemaIndexes; comments do not
// count.
func schemaIndexOf(tmpl string) (index, table string, ok bool) {
	m := schemaIndex.FindStringSubmatch(stripComments(tmpl))
	if m == nil {
		return "", "", false
	}
	for _, ix := range schemaIndexes {
		if ix.placeholder == m[1] && ix.table == schemaTables[m[2]] {
			return ix.name, ix.table, true
		}
	}
	return "", "", false
}

// applySchema runs schema.sql's statements that st says are needed, then
// drops the obsolete indexes and widens the status check.
func (s *Store) applySchema(ctx context.Context, db ddlConn, st SchemaStatus) error {
	pairs := []string{
		"{table}", s.table,
		"{statuses}", quoteStatuses(processors.Statuses),
		"{listed_statuses}", quoteStatuses(listedStatuses),
		"{rate_limits}", s.rateTable(),
		"{journal}", s.journal,
	}
	for _, ix := range schemaIndexes {
		pairs = append(pairs, ix.placeholder, pgx.Identifier{ix.name}.Sanitize())
	}
	r := strings.NewReplacer(pairs...)
	var stmts []string
	// stepped are the statements bounded by withLockTimeout, which try
	// again when they step out of the lock queue. No other: an index
	// build that a lock_timeout of the deployment's ended may have left
	// an invalid index, which a retry's IF NOT EXISTS would keep.
	stepped := make(map[int]bool)
	if s.ownSchema {
		stmts = append(stmts, "CREATE SCHEMA IF NOT EXISTS "+s.schema)
	}
	for _, tmpl := range strings.Split(schemaSQL, ";\n") {
		stmt := r.Replace(tmpl)
		if col, table, ok := schemaColumnOf(tmpl); ok {
			// Added to a table an older build created; a table this
			// run creates has it already.
			if slices.Contains(st.MissingColumns, table+"."+col) {
				s.log.Info("execution store: adding a column to an existing table", "column", col, "table", table)
				if !s.crdb {
					// Its lock stops the table's reads and writes
					// while it queues: see ddlLockTimeout.
					stmt = withLockTimeout(stmt)
					stepped[len(stmts)] = true
				}
				stmts = append(stmts, stmt)
			}
			continue
		}
		index, table, ok := schemaIndexOf(tmpl)
		if !ok || slices.Contains(st.MissingTables, table) {
			// Not an index, or one of a table this run creates:
			// empty, so a plain CREATE INDEX costs nothing.
			stmts = append(stmts, stmt)
			continue
		}
		if !slices.Contains(st.MissingIndexes, index) {
			continue // there, and valid
		}
		// It reads the whole table: say so before, not after.
		s.log.Info("execution store: adding an index to an existing table", "index", index, "table", table, "concurrently", !s.crdb)
		if !s.crdb {
			// One a failed build left invalid goes first; IF NOT
			// EXISTS would keep it.
			stmts = append(stmts, s.dropIndex(st.Schema, index))
			stmt = strings.Replace(stmt, "CREATE INDEX IF NOT EXISTS", "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1)
		}
		stmts = append(stmts, stmt)
	}
	// One statement at a time, each idempotent, rather than one
	// multi-statement transaction: CockroachDB advises against schema
	// changes inside explicit or multi-statement transactions, and
	// PostgreSQL runs CONCURRENTLY only outside them.
	for i, stmt := range stmts {
		if strings.TrimSpace(stripComments(stmt)) == "" {
			continue
		}
		var err error
		for duplicates, waits := 0, 0; duplicates < 3; {
			_, err = db.Exec(ctx, stmt)
			code := sqlState(err)
			if code == codeLockNotAvailable && stepped[i] {
				// A column's addition stepped out of the lock queue
				// (withLockTimeout): it tries again.
				waits++
				if err := s.awaitLock(ctx, waits, "add a column"); err != nil {
					return err
				}
				continue
			}
			// PostgreSQL's IF NOT EXISTS is not atomic against a
			// concurrent creator of the same object: the loser sees a
			// duplicate (23505 on the catalog, 42P07 relation, 42P06
			// schema, 42710 the row type of a table created at the same
			// moment). The next try finds the object and succeeds.
			if code != "23505" && code != "42P07" && code != "42P06" && code != "42710" {
				break
			}
			duplicates++
		}
		if err != nil {
			return fmt.Errorf("pgstore: migrate: %w", err)
		}
	}
	// The obsolete indexes go once their replacements exist. Until then
	// a table an older build created keeps paying for them on every
	// write. An older build still running during a rolling upgrade works
	// without them: its Expired matches the new lease index, and its
	// ByStatus scans.
	for _, name := range st.ObsoleteIndexes {
		if _, err := db.Exec(ctx, s.dropIndex(st.Schema, name)); err != nil {
			return fmt.Errorf("pgstore: migrate: drop the obsolete index %s: %w", name, err)
		}
	}
	return s.migrateStatusCheck(ctx, db)
}

// dropIndex is the statement that drops the index name of s's tables, in
// schema as readSchema resolved it, if it exists: CONCURRENTLY on
// PostgreSQL, so that writes go on meanwhile. PostgreSQL names the index
// schema.index, qualified always: unqualified, DROP INDEX looks through
// the whole search_path, and would drop another store's index of the same
// name further down it. CockroachDB names it table@index.
func (s *Store) dropIndex(schema, name string) string {
	switch {
	case s.crdb:
		return "DROP INDEX IF EXISTS " + s.table + "@" + pgx.Identifier{name}.Sanitize()
	case schema != "":
		return "DROP INDEX CONCURRENTLY IF EXISTS " + pgx.Identifier{schema, name}.Sanitize()
	default:
		// No schema of the search_path exists: neither does the index.
		return "DROP INDEX CONCURRENTLY IF EXISTS " + pgx.Identifier{name}.Sanitize()
	}
}

// migrateStatusCheck widens the status CHECK of an existing table, which
// CREATE TABLE IF NOT EXISTS leaves as an older build wrote it (the list
// before 'expired' made completing a call as expired fail with 23514).
//
// It reads the constraint's definition first and changes nothing when the
// constraint already allows every status of processors.Statuses, so a
// normal start costs one catalog query. It only ever widens, to the union
// of both lists: statuses this build does not know were added by a newer
// build, and dropping them during a rolling upgrade would refuse that
// build's writes.
//
// To widen, it drops and re-adds the constraint; every row is validated,
// once per change of the list. A concurrent Migrate that added it first
// makes the ADD fail with 42710; the definition is then read again. On
// CockroachDB the two are statements of their own rather than one ALTER
// TABLE with two subcommands, which its legacy schema changer refuses for
// one constraint name (cockroachdb/cockroach issue 96831): between them
// the table has no status check (the stores check statuses before writing
// anyway), and the ADD is an online schema change.
//
// On PostgreSQL it is one ALTER TABLE (there, the DROP subcommand runs
// before the ADD, so the swap has no gap), adding the constraint NOT
// VALID; then VALIDATE CONSTRAINT scans the rows under a lock that lets
// reads and writes go on. An ADD that validated scanned the whole table
// under an ACCESS EXCLUSIVE lock, which stops every read and write. A
// constraint left not validated (a process that died before VALIDATE, a
// VALIDATE that failed) is validated by the next Migrate; readSchema
// reports it meanwhile.
func (s *Store) migrateStatusCheck(ctx context.Context, db ddlConn) error {
	constraint := pgx.Identifier{statusCheckName}.Sanitize()
	validate := "ALTER TABLE " + s.table + " VALIDATE CONSTRAINT " + constraint
	for duplicates, waits := 0, 0; ; {
		// NULL: pg_get_constraintdef found the row gone (a concurrent
		// Migrate dropped it after this query's catalog snapshot).
		var def pgtype.Text
		validated := true
		err := db.QueryRow(ctx, readStatusCheck, s.table, statusCheckName).Scan(&def, &validated)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			// Missing (dropped by hand, or a concurrent Migrate is between
			// its two statements): add it.
		case err != nil:
			return fmt.Errorf("pgstore: migrate: read the status check: %w", err)
		}
		// CockroachDB validates as part of the ADD's schema change, and
		// shows the constraint not validated while that runs.
		validated = validated || s.crdb
		have := slices.Compact(slices.Sorted(slices.Values(quotedLiterals(def.String))))
		want := slices.Clone(processors.Statuses)
		for _, l := range have {
			if !slices.Contains(want, processors.Status(l)) {
				want = append(want, processors.Status(l))
			}
		}
		var stmts []string
		switch {
		case len(want) == len(have) && validated:
			return nil // have holds every status of ours, and nothing else
		case len(want) == len(have):
			stmts = []string{validate}
		case s.crdb:
			stmts = []string{
				"ALTER TABLE " + s.table + " DROP CONSTRAINT IF EXISTS " + constraint,
				"ALTER TABLE " + s.table + " ADD CONSTRAINT " + constraint + " CHECK (status IN (" + quoteStatuses(want) + "))",
			}
		default:
			// VALIDATE's lock lets reads and writes go on: it may wait.
			stmts = []string{withLockTimeout("ALTER TABLE " + s.table + " DROP CONSTRAINT IF EXISTS " + constraint +
				", ADD CONSTRAINT " + constraint + " CHECK (status IN (" + quoteStatuses(want) + ")) NOT VALID"), validate}
		}
		if duplicates+waits == 0 {
			s.log.Info("execution store widening the status check", "old", def.String, "validated", validated)
		}
		for _, stmt := range stmts {
			if _, err = db.Exec(ctx, stmt); err != nil {
				break
			}
		}
		switch code := sqlState(err); {
		case err == nil:
			return nil
		case code == codeLockNotAvailable:
			waits++
			if err := s.awaitLock(ctx, waits, "replace the status check"); err != nil {
				return err
			}
		case code == "42710" && duplicates < 2:
			duplicates++
		default:
			return fmt.Errorf("pgstore: migrate: replace the status check: %w", err)
		}
	}
}

// readStatusCheck reads the status check of table $1: its definition and
// whether it was validated. pg_constraint and pg_get_constraintdef exist
// on both engines; they print the expression differently (PostgreSQL
// status = ANY (ARRAY['a'::text, ...]), CockroachDB status IN
// ('a':::STRING, ...)), so only the quoted literals are compared.
const readStatusCheck = `SELECT pg_get_constraintdef(oid), convalidated FROM pg_catalog.pg_constraint
WHERE conrelid = $1::TEXT::REGCLASS AND conname = $2`

// codeLockNotAvailable is PostgreSQL's lock_not_available: a statement
// gave up waiting for a lock after lock_timeout.
const codeLockNotAvailable = "55P03"

// ddlLockTimeout bounds how long, on PostgreSQL, an ALTER TABLE of the
// migration queues for its table's ACCESS EXCLUSIVE lock: while it waits,
// every later read and write of the table waits behind it. Past it the
// ALTER steps out and tries again ddlLockRetry later, so writes are held
// up at most this long at a time, not for as long as the longest
// transaction on the table lasts.
const (
	ddlLockTimeout = 100 * time.Millisecond
	ddlLockRetry   = time.Second
)

// awaitLock waits before a migration's ALTER TABLE tries again, the
// waits-th time it gave up waiting for its table's lock
// (codeLockNotAvailable): transactions on the table (a long one, or a
// process stalled inside one) hold it, and the ALTER steps out of the
// lock queue, where every later read and write would wait behind it. It
// logs every 30th wait. what names the ALTER, for the log and the error.
func (s *Store) awaitLock(ctx context.Context, waits int, what string) error {
	if waits%30 == 1 {
		s.log.Info("execution store: the migration waits for transactions on the table to end", "step", what, "waited", time.Duration(waits-1)*ddlLockRetry)
	}
	select {
	case <-time.After(ddlLockRetry):
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pgstore: migrate: %s: %w", what, ctx.Err())
	}
}

// withLockTimeout returns stmt, a PostgreSQL statement, bounded by
// ddlLockTimeout: sent as one query, the two run in one implicit
// transaction, so SET LOCAL ends with it.
func withLockTimeout(stmt string) string {
	return fmt.Sprintf("SET LOCAL lock_timeout = '%dms'; %s", ddlLockTimeout.Milliseconds(), stmt)
}

// quoteStatuses is the SQL list of ss: 'a', 'b'.
func quoteStatuses(ss []processors.Status) string {
	q := make([]string, len(ss))
	for i, st := range ss {
		q[i] = "'" + strings.ReplaceAll(string(st), "'", "''") + "'"
	}
	return strings.Join(q, ", ")
}

// literalRE matches a single-quoted SQL string literal.
var literalRE = regexp.MustCompile(`'((?:[^']|'')*)'`)

// quotedLiterals returns the string literals of a SQL expression, unquoted.
func quotedLiterals(expr string) []string {
	var out []string
	for _, m := range literalRE.FindAllStringSubmatch(expr, -1) {
		out = append(out, strings.ReplaceAll(m[1], "''", "'"))
	}
	return out
}

// stripComments drops "--" line comments, to recognise a piece of the DDL
// that holds no statement.
func stripComments(sql string) string {
	var b strings.Builder
	for line := range strings.Lines(sql) {
		if code, _, _ := strings.Cut(line, "--"); code != "" {
			b.WriteString(code)
		}
	}
	return b.String()
}

// codeDeadlock is PostgreSQL's deadlock_detected: it breaks a deadlock by
// aborting one of the transactions, which, like a serialization failure,
// is safe to run again whole.
const codeDeadlock = "40P01"

// retryable makes an error retried as a serialization failure is (the
// retry loop goes by SQLSTATE 40001): a deadlock. The error itself stays
// reachable.
type retryable struct{ err error }

func (d retryable) Error() string    { return d.err.Error() }
func (d retryable) Unwrap() error    { return d.err }
func (d retryable) SQLState() string { return "40001" }

func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// inTx runs fn in one SERIALIZABLE transaction, restarted whole on
// serialization failures (see the package comment for which protocol).
// fn must not have effects outside the transaction: it may run more than
// once, and only the last run's results may be kept.
func (s *Store) inTx(ctx context.Context, op string, mode pgx.TxAccessMode, fn func(ctx context.Context, tx pgx.Tx) error) error {
	// Set explicitly: PostgreSQL defaults to READ COMMITTED, CockroachDB
	// to SERIALIZABLE (or READ COMMITTED where a cluster enabled it).
	return s.inTxAt(ctx, op, pgx.Serializable, mode, fn)
}

// relaxed is the isolation level of Admit, Claim, Complete, Release,
// MarkLogged, MarkUndo, NoteUnanswered, ReadBack and the journal's
// settling (Settle, and Unlogged's of stale entries): READ COMMITTED on
// PostgreSQL. Each decides every record on the
// record alone, under its row lock: Admit by the primary key, Claim by a
// locking read and an UPDATE whose WHERE repeats the claim's conditions,
// Complete and Release by an UPDATE fenced by epoch and status,
// MarkLogged only raises a counter, and a journal entry's revert is
// fenced by epoch; the entries
// themselves are deleted by primary key, one deleter winning. A concurrent writer of the row makes
// them wait and then decide on its write (PostgreSQL re-checks an
// UPDATE's WHERE against the new row), where SERIALIZABLE failed them
// with 40001: on a row another transaction had just written (the
// intake's mark-logged as the executor claims the calls it sees
// committed), and, with several executors, on index pages they merely
// shared. CockroachDB stays at SERIALIZABLE: READ COMMITTED there is a
// cluster setting, and it tracks conflicts per key, not per page.
func (s *Store) relaxed() pgx.TxIsoLevel {
	if s.crdb {
		return pgx.Serializable
	}
	return pgx.ReadCommitted
}

// inTxAt is inTx at another isolation level, for the methods that run at
// relaxed.
func (s *Store) inTxAt(ctx context.Context, op string, iso pgx.TxIsoLevel, mode pgx.TxAccessMode, fn func(ctx context.Context, tx pgx.Tx) error) error {
	opts := pgx.TxOptions{IsoLevel: iso, AccessMode: mode}
	ctx = crdb.WithMaxRetries(ctx, s.maxRetries)
	a := s.attempts(op)
	run := func(tx pgx.Tx) error {
		return a.run(func() error { return fn(ctx, tx) })
	}
	var err error
	if s.crdb {
		err = crdbpgx.ExecuteTx(ctx, s.pool, opts, run)
	} else {
		err = a.retry(ctx, func(ctx context.Context) error {
			// A commit-time 40001 comes back from BeginTxFunc's COMMIT,
			// and the retry runs it again like any other.
			return pgx.BeginTxFunc(ctx, s.pool, opts, run)
		})
	}
	return s.txError(op, err)
}

// attempts counts the runs of one transaction's body, so that a run
// after the first is logged and counted as a retry.
type attempts struct {
	s     *Store
	op    string
	tries int
	last  error
}

func (s *Store) attempts(op string) *attempts { return &attempts{s: s, op: op} }

// run runs one attempt of the body.
func (a *attempts) run(body func() error) error {
	a.tries++
	if a.tries > 1 {
		a.s.log.Warn("execution store transaction retry", "op", a.op, "attempt", a.tries, "err", a.last)
		if a.s.retried != nil {
			a.s.retried(a.op)
		}
	}
	a.last = body()
	return a.last
}

// retry runs one PostgreSQL transaction (once) until it commits or
// fails for good: crdb.ExecuteCtx restarts it whole on a serialization
// failure, up to the context's retry limit, here also on a deadlock,
// with jittered backoff between attempts.
func (a *attempts) retry(ctx context.Context, once func(ctx context.Context) error) error {
	return crdb.ExecuteCtx(ctx, func(ctx context.Context, _ ...any) error {
		if a.tries > 0 {
			if err := backoff(ctx, a.tries); err != nil {
				return err
			}
		}
		err := once(ctx)
		// What the body returned, or else the COMMIT's error.
		a.last = err
		if sqlState(err) == codeDeadlock {
			return retryable{err}
		}
		return err
	})
}

// txError wraps a transaction's final error for the caller of op.
func (s *Store) txError(op string, err error) error {
	if err == nil {
		return nil
	}
	if rejectedCode(sqlState(err)) {
		// Both stay reachable: callers branch on ErrRejected, tests and
		// logs want the SQLSTATE.
		return fmt.Errorf("pgstore %s: %w: %w", op, processors.ErrRejected, err)
	}
	return fmt.Errorf("pgstore %s: %w", op, err)
}

// rejectedCode reports whether SQLSTATE code says the data itself is the
// problem, so that sending it again cannot help: class 22 (data exception:
// a NUL or invalid UTF-8 in TEXT, a value out of range) and class 23
// (integrity constraint violation: the status CHECK, a NOT NULL), except
// 23505, a unique violation, which can be a race with a concurrent writer
// that a retry resolves. The retry loops never retry these (they retry
// 40001 only).
func rejectedCode(code string) bool {
	return code != "23505" && (strings.HasPrefix(code, "22") || strings.HasPrefix(code, "23"))
}

// backoff sleeps before retry n (n >= 1): full jitter over 1ms doubling to
// 100ms, so that transactions that collided do not collide again in step.
func backoff(ctx context.Context, n int) error {
	ceiling := min(100*time.Millisecond, time.Millisecond<<min(n-1, 7))
	t := time.NewTimer(rand.N(ceiling) + 1)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// ---------------------------------------------------------------- queries

// recordCols is the column list of every query that returns whole
// records, in recordScan order.
var recordCols = []string{
	"tenant_id", "idempotency_key", "call_id", "arguments_hash", "tool", "tool_version",
	"arguments", "deadline_at", "status", "epoch", "attempt", "lease_owner", "lease_until",
	"result", "seq", "logged_seq", "outbox", "created_at", "updated_at", "user_id",
	"jti", "credential_family", "undo_marks", "lapsed_families", "tool_digest",
	"unanswered_seq", "unanswered_since", "unanswered_in_progress",
}

// queries holds the SQL with the table name filled in.
type queries struct {
	selectKeys, selectKeysForUpdate, insert, claim, complete, release, move, markLogged, expired, unlogged, byStatus, get string
	// getForUpdate is get waiting out a write in flight (ReadBack).
	getForUpdate string
	// markUndo counts a compensation's mark on a record whose status is
	// one of the undoable; status reads the status of one it did not.
	markUndo, status string
	// noteUnanswered merges a reconciler's note into a record still at
	// its seq (processors.Unanswered.Merged).
	noteUnanswered string
	// unloggedAfter is unlogged from a processors.Cursor on; expiredAfter
	// is expired so.
	unloggedAfter, expiredAfter string
	// The journal (processors.Completion.Journal): an entry written with
	// a batch's completions, deleted when settled as logged, taken (by
	// name, or once stale) and reverted when settled as not logged.
	journalInsert, journalDelete, journalTake, journalTakeStale, journalRevert string
	// byListedStatus holds ByStatus's query for each of listedStatuses,
	// the status written as a literal: a parameter would hide from the
	// planner (of a prepared, generic plan) that the partial index
	// covers it.
	byListedStatus map[processors.Status]string
	// tenantByStatus and tenantByListedStatus are TenantByStatus's, as
	// byStatus and byListedStatus are ByStatus's.
	tenantByStatus       string
	tenantByListedStatus map[processors.Status]string
	// tenantLatestByStatus and tenantLatestByListedStatus are
	// TenantLatestByStatus's, and their Before forms from a cursor on.
	tenantLatestByStatus             string
	tenantLatestByListedStatus       map[processors.Status]string
	tenantLatestByStatusBefore       string
	tenantLatestByListedStatusBefore map[processors.Status]string
	// byStatusAfter and byListedStatusAfter are ByStatusAfter's.
	byStatusAfter       string
	byListedStatusAfter map[processors.Status]string
}

func newQueries(table, journal string) queries {
	r := strings.NewReplacer("{table}", table, "{journal}", journal, "{cols}", strings.Join(recordCols, ", "))
	// In key order: claims of overlapping batches lock their rows in one
	// order and do not deadlock each other. The other batch statements
	// lock in their plan's order (key order through the primary key, not
	// after a hash join), so a deadlock stays possible between them; inTx
	// retries it whole.
	selectKeys := `SELECT {cols} FROM {table}
WHERE (tenant_id, idempotency_key) IN (SELECT t, k FROM unnest($1::TEXT[], $2::TEXT[]) AS u (t, k))
ORDER BY tenant_id, idempotency_key`
	// Ties (one batch's records share now()) are sorted by key. The
	// status and the limit are filled in below.
	byStatus := `SELECT {cols} FROM {table}
WHERE status = %s%s
ORDER BY updated_at, tenant_id, idempotency_key
LIMIT %s`
	// Newest first: the tenant status index read backwards.
	latestByStatus := strings.Replace(byStatus, "ORDER BY updated_at, tenant_id, idempotency_key",
		"ORDER BY updated_at DESC, tenant_id DESC, idempotency_key DESC", 1)
	// One tenant's: for a listed status, the tenant's range of the
	// tenant status index, in its order; otherwise the scan.
	ofTenant := func(param string) string { return "\n  AND tenant_id = " + param }
	// After a cursor, as unloggedAfter below (the first of the three
	// parameters is the cursor's time).
	pastCursor := func(first int) string {
		ts, t, k := fmt.Sprintf("$%d", first), fmt.Sprintf("$%d", first+1), fmt.Sprintf("$%d", first+2)
		return "\n  AND updated_at >= " + ts + "::TIMESTAMPTZ\n  AND (updated_at, tenant_id, idempotency_key) > (" + ts + "::TIMESTAMPTZ, " + t + "::TEXT, " + k + "::TEXT)"
	}
	// Before a cursor, for one tenant's newest first: the tenant fixed,
	// the row value is the tenant status index's last two columns (the
	// first of the two parameters is the cursor's time).
	beforeCursor := func(first int) string {
		ts, k := fmt.Sprintf("$%d", first), fmt.Sprintf("$%d", first+1)
		return "\n  AND updated_at <= " + ts + "::TIMESTAMPTZ\n  AND (updated_at, idempotency_key) < (" + ts + "::TIMESTAMPTZ, " + k + "::TEXT)"
	}
	// Served by the lease index, whose predicate is repeated word for
	// word. The cursor's condition, if any, is filled in below.
	expired := `SELECT {cols} FROM {table}
WHERE status = 'executing' AND lease_until < now()%s
ORDER BY lease_until, tenant_id, idempotency_key
LIMIT $1`
	// Served by the partial index on updated_at WHERE logged_seq < seq:
	// the predicate is repeated word for word so that both engines
	// match it. The status filter leaves out executing calls, whose
	// completion writes the outbox again (and whose executor may still
	// be about to append it); it is a residual filter, not part of the
	// index predicate, so that the index an older build created still
	// serves. "<>" rather than a list of the others, so that a status a
	// newer build added is swept too. older_us * INTERVAL as in claim.
	// The cursor's condition, if any, is filled in below.
	unlogged := `SELECT {cols} FROM {table}
WHERE logged_seq < seq AND status <> 'executing'
  AND updated_at < now() - $1::BIGINT * INTERVAL '1 microsecond'%s
ORDER BY updated_at, tenant_id, idempotency_key
LIMIT $2`
	// After a cursor: the row comparison is exact, in the ORDER BY's
	// order (same columns, same collation). The plain updated_at >= $3
	// states where the index range starts, for a planner that would not
	// derive it from the row comparison (PostgreSQL does). Where the
	// engines differ: PostgreSQL's index holds updated_at alone, so it
	// reads again, and filters out, the rows of the cursor's time up to
	// the cursor (one transaction's rows share its now(): one batch at
	// most); CockroachDB keys a secondary index by the primary key
	// after its own columns, so its index is in the ORDER BY's order and
	// the row comparison can start the range at the cursor itself.
	unloggedAfter := `
  AND updated_at >= $3::TIMESTAMPTZ
  AND (updated_at, tenant_id, idempotency_key) > ($3::TIMESTAMPTZ, $4::TEXT, $5::TEXT)`
	q := queries{
		selectKeys: r.Replace(selectKeys),
		// claim and complete test the status through COALESCE (status is
		// NOT NULL: it changes nothing) so that neither engine can answer
		// them from a status index. Statistics say authorized and
		// executing rows are rare, which holds until a backlog builds (an
		// executor down, an overload, many calls claimed at once): the
		// planner would then read every such row and compare it with
		// every key of the batch, a cost that grows with the backlog times
		// the batch, just when the backlog must drain. Through the primary
		// key (or, on a small table, one scan), a batch costs its own
		// size.
		//
		// FOR UPDATE: claimers of one key queue on the row lock instead of
		// all reading, all writing and all but one failing at commit. On
		// PostgreSQL (READ COMMITTED) the queued ones then read the row
		// as the first left it; on CockroachDB the lock avoids most
		// restarts.
		selectKeysForUpdate: r.Replace(selectKeys + "\nFOR UPDATE"),
		// RETURNING only what the database set (the timestamps, the
		// deadline at its precision): the rest of each inserted record
		// is its admission, and sending the arguments and the outbox back
		// cost both ends as much as sending them.
		//
		// The primary key dedupes; DO NOTHING leaves existing rows as they
		// are. A row a concurrent transaction committed after this one's
		// first read is a serialization failure under SERIALIZABLE (on
		// CockroachDB, retried) and, at READ COMMITTED (PostgreSQL), a
		// skip that Admit sees and reads: never a silent one.
		insert: r.Replace(`INSERT INTO {table}
    (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version,
     arguments, deadline_at, status, seq, outbox, created_at, updated_at, user_id, tool_digest)
SELECT u.t, u.k, u.call_id, u.h, u.tool, u.tool_version,
       u.arguments, u.deadline_at, u.status, u.seq, u.outbox, now(), now(), u.user_id, u.tool_digest
FROM unnest($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::TEXT[], $5::TEXT[], $6::BIGINT[],
            $7::BYTEA[], $8::TIMESTAMPTZ[], $9::TEXT[], $10::BIGINT[], $11::BYTEA[], $12::TEXT[], $13::TEXT[])
     AS u (t, k, call_id, h, tool, tool_version, arguments, deadline_at, status, seq, outbox, user_id, tool_digest)
ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
RETURNING tenant_id, idempotency_key, deadline_at, created_at`),
		// RETURNING only what the claim set: the rest of each record is
		// as the batch's first statement read it, under the row lock, and
		// sending the arguments and the outbox back again cost both ends.
		// One claim per (key, hash), the first in the batch (DISTINCT ON
		// ... ORDER BY ord): only the claim whose hash matches the record
		// can join, so each record is claimed at most once per batch and by
		// the first claim with its hash. UPDATE ... FROM with several
		// matching rows would otherwise pick one unpredictably (on both
		// engines). now() is the transaction's timestamp on both engines.
		// lease_us * INTERVAL: PostgreSQL resolves BIGINT * INTERVAL
		// through float8, CockroachDB has INT * INTERVAL; both exact at
		// microsecond precision. logged_seq: a claim made from an event
		// read from the log records that the record's events up to it
		// are there (never past the record's seq, never lowered). jti:
		// the call's, kept once a claim named one; credential_family: the
		// claim's, '' for none (Claim reads the earlier ones first, for a
		// reclaim's Prior). lapsed_families: a takeover (a lease with an
		// owner, expired) adds the family the expired claim named, once,
		// up to processors.MaxLapsedFamilies; array_length is NULL for
		// an empty array on both engines.
		claim: r.Replace(`UPDATE {table} AS r
SET status = 'executing', epoch = r.epoch + 1, lease_owner = u.owner,
    lease_until = now() + u.lease_us * INTERVAL '1 microsecond', updated_at = now(),
    logged_seq = GREATEST(r.logged_seq, LEAST(u.logged, r.seq)),
    jti = CASE WHEN r.jti = '' THEN u.jti ELSE r.jti END, credential_family = u.credential_family,
    lapsed_families = CASE
      WHEN COALESCE(r.status, '') = 'executing' AND r.lease_owner <> '' AND r.credential_family <> ''
        AND NOT (r.credential_family = ANY (r.lapsed_families))
        AND COALESCE(array_length(r.lapsed_families, 1), 0) < ` + strconv.Itoa(processors.MaxLapsedFamilies) + `
      THEN array_append(r.lapsed_families, r.credential_family) ELSE r.lapsed_families END
FROM (SELECT DISTINCT ON (t, k, h) t, k, h, owner, lease_us, logged, ord, jti, credential_family
      FROM unnest($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::TEXT[], $5::BIGINT[], $6::BIGINT[], $7::BIGINT[],
                  $8::TEXT[], $9::TEXT[])
           AS u (t, k, h, owner, lease_us, logged, ord, jti, credential_family)
      ORDER BY t, k, h, ord) AS u
WHERE r.tenant_id = u.t AND r.idempotency_key = u.k AND r.arguments_hash = u.h
  AND (COALESCE(r.status, '') = 'authorized' OR (COALESCE(r.status, '') = 'executing' AND r.lease_until < now()))
RETURNING u.ord, r.epoch, r.lease_owner, r.lease_until, r.updated_at, r.logged_seq, r.jti, r.credential_family,
          r.lapsed_families`),
		// The fence: epoch and status in the WHERE clause. One completion
		// per (key, epoch), the first in the batch: only one epoch is
		// current, so at most one completion per record applies. A
		// journaled completion is logged at once (its journal entry,
		// written in the same transaction, says it may not be yet), so
		// the row never enters the unlogged index and no later write of
		// it is needed.
		complete: r.Replace(`UPDATE {table} AS r
SET status = u.status, attempt = u.attempt, result = u.result, seq = u.seq, outbox = u.outbox,
    lease_owner = '', lease_until = NULL, updated_at = now(),
    logged_seq = CASE WHEN u.journaled THEN u.seq ELSE r.logged_seq END
FROM (SELECT DISTINCT ON (t, k, epoch) t, k, epoch, status, attempt, result, seq, outbox, ord, journaled
      FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[], $4::TEXT[], $5::BIGINT[],
                  $6::BYTEA[], $7::BIGINT[], $8::BYTEA[], $9::BIGINT[], $10::BOOL[])
           AS u (t, k, epoch, status, attempt, result, seq, outbox, ord, journaled)
      ORDER BY t, k, epoch, ord) AS u
WHERE r.tenant_id = u.t AND r.idempotency_key = u.k AND r.epoch = u.epoch
  AND COALESCE(r.status, '') = 'executing'
RETURNING u.ord`),
		// Fenced as complete. The record stays executing, with no owner:
		// the lease index lists it once the release ends, and a claim
		// then finds no owner and answers Claimed (see Store.claimed).
		// after_us * INTERVAL as in claim; the sent family joins
		// lapsed_families as a takeover's does, and the attempt never
		// goes down.
		release: r.Replace(`UPDATE {table} AS r
SET lease_owner = '', lease_until = now() + u.after_us * INTERVAL '1 microsecond', updated_at = now(),
    attempt = GREATEST(r.attempt, u.attempt),
    lapsed_families = CASE
      WHEN u.sent <> '' AND NOT (u.sent = ANY (r.lapsed_families))
        AND COALESCE(array_length(r.lapsed_families, 1), 0) < ` + strconv.Itoa(processors.MaxLapsedFamilies) + `
      THEN array_append(r.lapsed_families, u.sent) ELSE r.lapsed_families END
FROM (SELECT DISTINCT ON (t, k, epoch) t, k, epoch, after_us, ord, sent, attempt
      FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[], $4::BIGINT[], $5::BIGINT[], $6::TEXT[], $7::BIGINT[])
           AS u (t, k, epoch, after_us, ord, sent, attempt)
      ORDER BY t, k, epoch, ord) AS u
WHERE r.tenant_id = u.t AND r.idempotency_key = u.k AND r.epoch = u.epoch
  AND COALESCE(r.status, '') = 'executing'
RETURNING u.ord`),
		// The compare-and-set: status and seq in the WHERE clause. The
		// keys of one statement are distinct (Move sends a key's second
		// move in a second statement, which sees the first's write), so
		// UPDATE ... FROM never has two candidate rows for one record.
		// logged_seq, epoch, the lease, attempt and undo_marks stay as
		// they are, and the result unless the move carries one (a NULL
		// element otherwise). "to" is reserved: to_status.
		move: r.Replace(`UPDATE {table} AS r
SET status = u.to_status, seq = u.seq, outbox = u.outbox, result = COALESCE(u.result, r.result), updated_at = now()
FROM unnest($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::BIGINT[], $5::TEXT[], $6::BIGINT[], $7::BYTEA[], $8::BIGINT[], $9::BIGINT[], $10::BYTEA[], $11::BOOLEAN[])
     AS u (t, k, from_status, from_seq, to_status, seq, outbox, ord, from_undo_marks, result, unless_in_progress)
WHERE r.tenant_id = u.t AND r.idempotency_key = u.k
  AND r.status = u.from_status AND r.seq = u.from_seq AND r.undo_marks = u.from_undo_marks
  AND NOT (u.unless_in_progress AND r.unanswered_seq = u.from_seq AND r.unanswered_in_progress)
RETURNING u.ord`),
		// A single-row UPDATE whose WHERE holds the condition: under READ
		// COMMITTED, PostgreSQL re-checks it against a row a concurrent
		// move just wrote. updated_at is left alone: the call took no
		// step.
		markUndo: r.Replace(`UPDATE {table} SET undo_marks = undo_marks + 1
WHERE tenant_id = $1 AND idempotency_key = $2 AND status = ANY($3::TEXT[])
RETURNING status`),
		status: r.Replace(`SELECT status FROM {table} WHERE tenant_id = $1 AND idempotency_key = $2`),
		// processors.Unanswered.Merged, in SQL: every right-hand side
		// reads the row as it was. No NULL reaches LEAST, whose handling
		// of one is PostgreSQL's own. updated_at is left alone.
		noteUnanswered: r.Replace(`UPDATE {table} SET
  unanswered_seq = $3::BIGINT,
  unanswered_since = CASE WHEN $4::TIMESTAMPTZ IS NULL THEN NULL
    WHEN unanswered_seq = $3::BIGINT THEN LEAST(COALESCE(unanswered_since, $4::TIMESTAMPTZ), $4::TIMESTAMPTZ)
    ELSE $4::TIMESTAMPTZ END,
  unanswered_in_progress = CASE WHEN unanswered_seq = $3::BIGINT THEN unanswered_in_progress OR $5::BOOLEAN
    ELSE $5::BOOLEAN END
WHERE tenant_id = $1 AND idempotency_key = $2 AND seq = $3::BIGINT
RETURNING unanswered_seq, unanswered_since, unanswered_in_progress`),
		// GREATEST plus the WHERE: monotonic, and rows already logged that
		// far are not rewritten; nor rows logged less far than the mark's
		// base (processors.Logged.Base: a journal entry's revert came in
		// between). The highest mark of a key in the batch, with its
		// base. updated_at is left alone: it dates the call's last step,
		// not bookkeeping.
		markLogged: r.Replace(`UPDATE {table} AS r
SET logged_seq = GREATEST(r.logged_seq, u.seq)
FROM (SELECT DISTINCT ON (t, k) t, k, seq, base
      FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[], $4::BIGINT[]) AS u (t, k, seq, base)
      ORDER BY t, k, seq DESC, base DESC) AS u
WHERE r.tenant_id = u.t AND r.idempotency_key = u.k AND r.logged_seq < u.seq AND r.logged_seq >= u.base`),
		// An entry lists every journaled completion of its batch, applied
		// or fenced out: the revert matches a record only at the
		// completion's epoch, which a fenced-out completion never has.
		// A later batch under the same name adds its calls to the entry
		// (which keeps its first created_at).
		journalInsert: r.Replace(`INSERT INTO {journal} AS j (id, created_at, tenant_ids, idempotency_keys, epochs, seqs, from_seqs)
VALUES ($1, now(), $2::TEXT[], $3::TEXT[], $4::BIGINT[], $5::BIGINT[], $6::BIGINT[])
ON CONFLICT (id) DO UPDATE SET
    tenant_ids = j.tenant_ids || excluded.tenant_ids, idempotency_keys = j.idempotency_keys || excluded.idempotency_keys,
    epochs = j.epochs || excluded.epochs, seqs = j.seqs || excluded.seqs, from_seqs = j.from_seqs || excluded.from_seqs`),
		journalDelete: r.Replace(`DELETE FROM {journal} WHERE id = ANY($1::TEXT[])`),
		journalTake: r.Replace(`DELETE FROM {journal} WHERE id = ANY($1::TEXT[])
RETURNING tenant_ids, idempotency_keys, epochs, seqs, from_seqs`),
		// Through the created_at index. The oldest entries while the
		// calls listed before each number under limit: at most limit
		// entries are read, since each lists a call at least. An entry
		// another transaction holds (a sweep or its writer settling it)
		// is passed over, not waited for: that transaction settles it,
		// or leaves it to a later sweep if it does not commit. Waiting
		// made a sweep, and the executor step it runs in, wait as long
		// as a stalled process kept its transaction open, while every
		// other executor's sweep queued on the same oldest entries.
		// SKIP LOCKED: PostgreSQL 9.5, CockroachDB 22.2. older_us *
		// INTERVAL as in claim.
		journalTakeStale: r.Replace(`DELETE FROM {journal}
WHERE id IN (SELECT id
             FROM (SELECT id, sum(cardinality(idempotency_keys)) OVER (ORDER BY created_at, id) - cardinality(idempotency_keys) AS before
                   FROM (SELECT id, created_at, idempotency_keys FROM {journal}
                         WHERE created_at < now() - $1::BIGINT * INTERVAL '1 microsecond'
                         ORDER BY created_at, id LIMIT $2::BIGINT
                         FOR UPDATE SKIP LOCKED) AS oldest) AS counted
             WHERE before < $2::BIGINT)
RETURNING tenant_ids, idempotency_keys, epochs, seqs, from_seqs`),
		// Every record the completion applied to (same epoch; a fenced-out
		// completion's never matches), whatever was marked since: a
		// record that moved on (an unknown outcome resolved) keeps the
		// completion's events in its outbox, and its mover appended only
		// those past the mark in advance. Appending again is safe;
		// leaving them out is not. One element per (key, epoch) at most
		// matches a record, since only one completion per epoch applies.
		// updated_at stays: it dates the call's last step, and
		// Unlogged's grace counts from it.
		journalRevert: r.Replace(`UPDATE {table} AS r
SET logged_seq = u.from_seq
FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[], $4::BIGINT[], $5::BIGINT[]) AS u (t, k, epoch, seq, from_seq)
WHERE r.tenant_id = u.t AND r.idempotency_key = u.k AND r.epoch = u.epoch
  AND r.logged_seq > u.from_seq`),
		expired: r.Replace(fmt.Sprintf(expired, "")),
		// After a cursor as unloggedAfter, in the lease's order.
		expiredAfter: r.Replace(fmt.Sprintf(expired, `
  AND lease_until >= $2::TIMESTAMPTZ
  AND (lease_until, tenant_id, idempotency_key) > ($2::TIMESTAMPTZ, $3::TEXT, $4::TEXT)`)),
		unlogged:      r.Replace(fmt.Sprintf(unlogged, "")),
		unloggedAfter: r.Replace(fmt.Sprintf(unlogged, unloggedAfter)),
		// A status outside listedStatuses: a scan.
		byStatus:                         r.Replace(fmt.Sprintf(byStatus, "$1", "", "$2")),
		tenantByStatus:                   r.Replace(fmt.Sprintf(byStatus, "$1", ofTenant("$2"), "$3")),
		tenantLatestByStatus:             r.Replace(fmt.Sprintf(latestByStatus, "$1", ofTenant("$2"), "$3")),
		tenantLatestByStatusBefore:       r.Replace(fmt.Sprintf(latestByStatus, "$1", ofTenant("$2")+beforeCursor(4), "$3")),
		byStatusAfter:                    r.Replace(fmt.Sprintf(byStatus, "$1", pastCursor(3), "$2")),
		get:                              r.Replace(`SELECT {cols} FROM {table} WHERE tenant_id = $1 AND idempotency_key = $2`),
		getForUpdate:                     r.Replace(`SELECT {cols} FROM {table} WHERE tenant_id = $1 AND idempotency_key = $2 FOR UPDATE`),
		byListedStatus:                   make(map[processors.Status]string, len(listedStatuses)),
		tenantByListedStatus:             make(map[processors.Status]string, len(listedStatuses)),
		byListedStatusAfter:              make(map[processors.Status]string, len(listedStatuses)),
		tenantLatestByListedStatus:       make(map[processors.Status]string, len(listedStatuses)),
		tenantLatestByListedStatusBefore: make(map[processors.Status]string, len(listedStatuses)),
	}
	for _, st := range listedStatuses {
		// Served by the status index (the tenant's: the tenant status
		// index), in its order.
		q.byListedStatus[st] = r.Replace(fmt.Sprintf(byStatus, quoteStatuses([]processors.Status{st}), "", "$1"))
		q.tenantByListedStatus[st] = r.Replace(fmt.Sprintf(byStatus, quoteStatuses([]processors.Status{st}), ofTenant("$1"), "$2"))
		q.tenantLatestByListedStatus[st] = r.Replace(fmt.Sprintf(latestByStatus, quoteStatuses([]processors.Status{st}), ofTenant("$1"), "$2"))
		q.tenantLatestByListedStatusBefore[st] = r.Replace(fmt.Sprintf(latestByStatus, quoteStatuses([]processors.Status{st}), ofTenant("$1")+beforeCursor(3), "$2"))
		q.byListedStatusAfter[st] = r.Replace(fmt.Sprintf(byStatus, quoteStatuses([]processors.Status{st}), pastCursor(2), "$1"))
	}
	return q
}

// recordScan receives one row in recordCols order.
type recordScan struct {
	r                    processors.Record
	toolVersion, attempt int64
	deadline, leaseUntil pgtype.Timestamptz
	status               string
	unanswered           unansweredScan
}

// unansweredScan receives the unanswered_* columns.
type unansweredScan struct {
	seq        int64
	since      pgtype.Timestamptz
	inProgress bool
}

func (u *unansweredScan) dest() []any { return []any{&u.seq, &u.since, &u.inProgress} }

func (u *unansweredScan) note() processors.Unanswered {
	n := processors.Unanswered{Seq: u.seq, InProgress: u.inProgress}
	if u.since.Valid {
		n.Since = u.since.Time.UTC()
	}
	if n.Since.IsZero() && !n.InProgress {
		return processors.Unanswered{} // nothing noted, at any seq
	}
	return n
}

func (x *recordScan) dest() []any {
	r := &x.r
	return append([]any{
		&r.Key.TenantID, &r.Key.IdempotencyKey, &r.CallID, &r.ArgumentsHash, &r.Tool, &x.toolVersion,
		&r.Arguments, &x.deadline, &x.status, &r.Epoch, &x.attempt, &r.LeaseOwner, &x.leaseUntil,
		&r.Result, &r.Seq, &r.LoggedSeq, &r.Outbox, &r.CreatedAt, &r.UpdatedAt, &r.UserID,
		&r.Credential.JTI, &r.Credential.Family, &r.UndoMarks, &r.LapsedFamilies, &r.ToolDigest,
	}, x.unanswered.dest()...)
}

func (x *recordScan) record() processors.Record {
	r := x.r
	r.ToolVersion = int(x.toolVersion)
	r.Attempt = int(x.attempt)
	r.Status = processors.Status(x.status)
	if x.deadline.Valid {
		r.DeadlineAt = x.deadline.Time.UTC()
	}
	if x.leaseUntil.Valid {
		r.LeaseUntil = x.leaseUntil.Time.UTC()
	}
	r.CreatedAt = r.CreatedAt.UTC()
	r.UpdatedAt = r.UpdatedAt.UTC()
	r.Unanswered = x.unanswered.note()
	return r
}

// scanRecord reads a row into a record, its outbox decompressed. An
// outbox that does not decompress is passed on as stored (and logged):
// its reader's decoding refuses that record alone, as it would a damaged
// plain outbox. Failing the scan instead would fail whole batches, and
// on PostgreSQL after their writes had committed (see inBatchTx's read).
func (s *Store) scanRecord(row pgx.CollectableRow) (processors.Record, error) {
	var x recordScan
	if err := row.Scan(x.dest()...); err != nil {
		return processors.Record{}, err
	}
	r := x.record()
	if out, err := unpackOutbox(r.Outbox); err != nil {
		s.log.Error("execution record's outbox does not decompress: passed on as stored", "call_key", r.Key.String(), "err", err)
	} else {
		r.Outbox = out
	}
	return r, nil
}

// insertedRow is an admission's RETURNING row: the key and what the
// database set.
type insertedRow struct {
	key       ledger.CallKey
	deadline  pgtype.Timestamptz
	createdAt time.Time
}

func scanInserted(row pgx.CollectableRow) (insertedRow, error) {
	var r insertedRow
	err := row.Scan(&r.key.TenantID, &r.key.IdempotencyKey, &r.deadline, &r.createdAt)
	return r, err
}

// record is the record a's insert stored.
func (i insertedRow) record(a processors.Admission) processors.Record {
	r := a.Record(i.createdAt.UTC())
	r.DeadlineAt = time.Time{}
	if i.deadline.Valid {
		r.DeadlineAt = i.deadline.Time.UTC()
	}
	return r
}

// claimedRow is a claim's RETURNING row: the batch position it answers
// and what the claim set.
type claimedRow struct {
	ord, epoch, loggedSeq int64
	owner                 string
	leaseUntil            pgtype.Timestamptz
	updatedAt             time.Time
	credential            processors.CallCredential
	lapsedFamilies        []string
}

func scanClaimed(row pgx.CollectableRow) (claimedRow, error) {
	var c claimedRow
	err := row.Scan(&c.ord, &c.epoch, &c.owner, &c.leaseUntil, &c.updatedAt, &c.loggedSeq, &c.credential.JTI, &c.credential.Family, &c.lapsedFamilies)
	return c, err
}

// apply is r as the claim left it.
func (c claimedRow) apply(r processors.Record) processors.Record {
	r.Status = processors.StatusExecuting
	r.Epoch, r.LeaseOwner, r.LeaseUntil = c.epoch, c.owner, time.Time{}
	if c.leaseUntil.Valid {
		r.LeaseUntil = c.leaseUntil.Time.UTC()
	}
	r.UpdatedAt = c.updatedAt.UTC()
	r.LoggedSeq = c.loggedSeq
	r.Credential, r.LapsedFamilies = c.credential, c.lapsedFamilies
	return r
}

func timestamptz(t time.Time) pgtype.Timestamptz {
	return pgtype.Timestamptz{Time: t, Valid: !t.IsZero()}
}

// byKey indexes records by key.
func byKey(rs []processors.Record) map[ledger.CallKey]processors.Record {
	m := make(map[ledger.CallKey]processors.Record, len(rs))
	for _, r := range rs {
		m[r.Key] = r
	}
	return m
}

// ---------------------------------------------------------------- Store

// Admit implements processors.Store. One round trip: the existing records
// of the batch's keys, then the insert of the rest; a second only for keys
// another transaction inserted in between.
//
// On PostgreSQL it runs at READ COMMITTED: it reads and inserts, never
// updates, and the primary key alone decides which admission of a key
// creates it. Under SERIALIZABLE its reads of the key index's pages were
// rw-conflicts with the executor's claims of the calls admitted just
// before (the claim rewrites those pages), and one of the two failed with
// 40001. CockroachDB stays at SERIALIZABLE.
func (s *Store) Admit(ctx context.Context, as []processors.Admission) ([]processors.AdmitResult, error) {
	if err := processors.CheckAdmissions(as); err != nil {
		return nil, fmt.Errorf("pgstore admit: %w: %w", processors.ErrRejected, err)
	}
	if len(as) == 0 {
		return []processors.AdmitResult{}, nil
	}
	if charged(as) {
		return s.admitCharged(ctx, as)
	}
	// Only the first admission of a key is inserted (first: its index in
	// as); later ones in the batch are answered against it, as if they
	// came after it.
	first := make(map[ledger.CallKey]int, len(as))
	var rows admitRows
	for i, a := range as {
		if _, ok := first[a.Key]; ok {
			continue
		}
		first[a.Key] = i
		rows.add(a, s.packMin)
	}

	var (
		existing []processors.Record
		inserted []insertedRow
		inserts  int // statements queued
	)
	// One round trip, BEGIN and COMMIT included (PostgreSQL): what the
	// results may call for, another read of a few keys, comes after.
	err := s.inBatchTx(ctx, "admit", s.relaxed(), batchTx{
		queue: func(b *pgx.Batch) {
			b.Queue(s.q.selectKeys, rows.ts, rows.ks)
			inserts = rows.queue(b, s.q.insert)
		},
		read: func(br pgx.BatchResults) error {
			rows, _ := br.Query()
			var err error
			if existing, err = pgx.CollectRows(rows, s.scanRecord); err != nil {
				return err
			}
			inserted, err = readInserted(br, inserts)
			return err
		},
	})
	if err != nil {
		return nil, err
	}
	out, err := s.admitted(ctx, as, first, rows.ts, rows.ks, existing, inserted, rateAnswers{})
	if err != nil {
		// The admissions committed: the caller's retry finds them, as
		// after a COMMIT whose answer was lost.
		return nil, fmt.Errorf("pgstore admit: %w", err)
	}
	return out, nil
}

// admitRows are the admissions a batch inserts, as the insert
// statement's arrays.
type admitRows struct {
	ts, ks, callIDs, hashes, tools, statuses, users, digests []string
	toolVersions, seqs                                       []int64
	arguments, outboxes                                      [][]byte
	deadlines                                                []pgtype.Timestamptz
}

// add appends a, its outbox packed from packMin bytes on.
func (r *admitRows) add(a processors.Admission, packMin int) {
	r.ts, r.ks = append(r.ts, a.Key.TenantID), append(r.ks, a.Key.IdempotencyKey)
	r.callIDs, r.hashes, r.tools = append(r.callIDs, a.CallID), append(r.hashes, a.ArgumentsHash), append(r.tools, a.Tool)
	r.toolVersions, r.arguments = append(r.toolVersions, int64(a.ToolVersion)), append(r.arguments, a.Arguments)
	r.deadlines, r.statuses = append(r.deadlines, timestamptz(a.DeadlineAt)), append(r.statuses, string(a.Status))
	r.seqs, r.outboxes = append(r.seqs, a.Seq), append(r.outboxes, packOutbox(a.Outbox, packMin))
	r.users, r.digests = append(r.users, a.UserID), append(r.digests, a.ToolDigest)
}

// queue queues insert (queries.insert) of the rows, in as many
// statements as their data needs (statementSpans), and returns how many.
func (r *admitRows) queue(b *pgx.Batch, insert string) int {
	spans := statementSpans(len(r.ts), func(i int) int { return len(r.arguments[i]) + len(r.outboxes[i]) })
	for _, sp := range spans {
		lo, hi := sp[0], sp[1]
		b.Queue(insert, r.ts[lo:hi], r.ks[lo:hi], r.callIDs[lo:hi], r.hashes[lo:hi], r.tools[lo:hi], r.toolVersions[lo:hi],
			r.arguments[lo:hi], r.deadlines[lo:hi], r.statuses[lo:hi], r.seqs[lo:hi], r.outboxes[lo:hi], r.users[lo:hi], r.digests[lo:hi])
	}
	return len(spans)
}

// readInserted reads the rows that n insert statements (admitRows.queue)
// returned.
func readInserted(br pgx.BatchResults, n int) ([]insertedRow, error) {
	var out []insertedRow
	for range n {
		rows, _ := br.Query()
		got, err := pgx.CollectRows(rows, scanInserted)
		if err != nil {
			return nil, err
		}
		out = append(out, got...)
	}
	return out, nil
}

// maxStatementBytes bounds the data (arguments, outboxes, results) one
// statement of a write carries in its parameters: a statement's arrays
// go to the server in one message (Bind), which CockroachDB refuses past
// sql.conn.max_read_buffer_message_size, 16 MiB by default, where
// PostgreSQL takes up to 1 GiB. The refusal is no serialization failure,
// so the same batch would fail again at every retry. A batch with more
// data is written by several statements, in the same transaction.
const maxStatementBytes = 8 << 20

// statementSpans splits n rows, of size(i) bytes of data each, into
// consecutive ranges [lo, hi) of at most maxStatementBytes of data (a row
// larger than that alone), one statement's each.
func statementSpans(n int, size func(i int) int) [][2]int {
	var (
		spans [][2]int
		lo    int
		bytes int
	)
	for i := range n {
		sz := size(i) + statementRowBytes
		if i > lo && bytes+sz > maxStatementBytes {
			spans = append(spans, [2]int{lo, i})
			lo, bytes = i, 0
		}
		bytes += sz
	}
	if n > lo {
		spans = append(spans, [2]int{lo, n})
	}
	return spans
}

// statementRowBytes is what a row's other parameters (its key, status,
// numbers) add to its data, generously.
const statementRowBytes = 1 << 10

// admitted answers each admission of as from the records the batch found
// (existing) and those it inserted, reading again the keys of ts and ks
// (those it tried to insert) that are in neither, now that the batch
// committed. first indexes each key's first admission in as. rates are
// the rate limits' answers of a charged batch (admitCharged), zero for
// another.
func (s *Store) admitted(ctx context.Context, as []processors.Admission, first map[ledger.CallKey]int, ts, ks []string, existing []processors.Record, inserted []insertedRow, rates rateAnswers) ([]processors.AdmitResult, error) {
	pre, ins := byKey(existing), make(map[ledger.CallKey]processors.Record, len(inserted))
	for _, r := range inserted {
		// An inserted record is its key's first admission in the
		// batch (the one Admit sent), with what the database set.
		i, ok := first[r.key]
		if !ok {
			return nil, fmt.Errorf("pgstore admit: inserted %v, which the batch does not hold", r.key)
		}
		ins[r.key] = r.record(as[i])
	}
	// A key neither there at the first read nor inserted: another
	// admission inserted it in between, and the insert, having
	// waited for that transaction to commit, did nothing. At READ
	// COMMITTED a new statement sees it. (Under SERIALIZABLE the
	// insert fails with 40001 instead, and the whole transaction
	// runs again.) One statement of its own: nothing here needs the
	// admission's transaction.
	var lateTs, lateKs []string
	for i := range ts {
		k := ledger.CallKey{TenantID: ts[i], IdempotencyKey: ks[i]}
		if _, ok := pre[k]; !ok {
			if _, ok := ins[k]; !ok {
				lateTs, lateKs = append(lateTs, ts[i]), append(lateKs, ks[i])
			}
		}
	}
	if len(lateTs) > 0 {
		rows, _ := s.pool.Query(ctx, s.q.selectKeys, lateTs, lateKs)
		late, err := pgx.CollectRows(rows, s.scanRecord)
		if err != nil {
			return nil, err
		}
		for _, r := range late {
			pre[r.Key] = r
		}
	}
	out := make([]processors.AdmitResult, len(as))
	answered := make(map[ledger.CallKey]bool, len(ins))
	for i, a := range as {
		if res, ok := rates.limited[a.Key]; ok {
			out[i] = processors.AdmitResult{Outcome: processors.Limited, Rates: res}
			continue
		}
		if r, ok := ins[a.Key]; ok && !answered[a.Key] {
			answered[a.Key] = true
			out[i] = processors.AdmitResult{Outcome: processors.Admitted, Record: r, Rates: rates.charged[a.Key]}
			continue
		}
		r, ok := pre[a.Key]
		if !ok {
			r, ok = ins[a.Key]
		}
		if !ok {
			// Neither there before, nor inserted, nor there on the
			// second read: under SERIALIZABLE a concurrent insert
			// should have been a 40001; at READ COMMITTED the record
			// was deleted in between. Refuse rather than guess.
			return nil, fmt.Errorf("admission %d (%v): key neither found nor inserted", i, a.Key)
		}
		out[i] = processors.AdmitResult{Outcome: a.Answer(r), Record: r}
	}
	return out, nil
}

// Claim implements processors.Store. One round trip: the batch's records
// as they were (locked), then the conditional claim of the claimable ones.
// At READ COMMITTED (PostgreSQL) the two statements see what was
// committed when each began: a record admitted in between is claimed but
// not read, and is read once the claim committed.
func (s *Store) Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error) {
	if err := processors.CheckClaims(cs); err != nil {
		return nil, fmt.Errorf("pgstore claim: %w: %w", processors.ErrRejected, err)
	}
	if len(cs) == 0 {
		return []processors.ClaimResult{}, nil
	}
	var (
		ts, ks, hashes, owners []string
		jtis, families         []string
		leases, logged, ords   []int64
	)
	for i, c := range cs {
		ts, ks = append(ts, c.Key.TenantID), append(ks, c.Key.IdempotencyKey)
		hashes, owners = append(hashes, c.ArgumentsHash), append(owners, c.Owner)
		jtis, families = append(jtis, c.Credential.JTI), append(families, c.Credential.Family)
		// Rounded up to whole microseconds, the databases' precision.
		leases = append(leases, int64((c.Lease+time.Microsecond-1)/time.Microsecond))
		logged, ords = append(logged, c.Logged), append(ords, int64(i))
	}

	var (
		before  []processors.Record
		claimed []claimedRow
	)
	// One round trip, BEGIN and COMMIT included (PostgreSQL).
	err := s.inBatchTx(ctx, "claim", s.relaxed(), batchTx{
		queue: func(b *pgx.Batch) {
			b.Queue(s.q.selectKeysForUpdate, ts, ks)
			b.Queue(s.q.claim, ts, ks, hashes, owners, leases, logged, ords, jtis, families)
		},
		sent: func() { s.failpoint.Hit(failpoint.ClaimSent) },
		read: func(br pgx.BatchResults) error {
			rows, _ := br.Query()
			var err error
			if before, err = pgx.CollectRows(rows, s.scanRecord); err != nil {
				return err
			}
			rows, _ = br.Query()
			claimed, err = pgx.CollectRows(rows, scanClaimed)
			return err
		},
	})
	if err != nil {
		return nil, err
	}
	out, err := s.claimed(ctx, cs, before, claimed)
	if err != nil {
		// The claims committed: the calls stay leased to this owner
		// until the lease ends, as after a COMMIT whose answer was lost.
		return nil, fmt.Errorf("pgstore claim: %w", err)
	}
	return out, nil
}

// claimed decides each claim of cs from the records as the committed
// batch read them and the claims it won, reading the records it claimed
// without having read them.
func (s *Store) claimed(ctx context.Context, cs []processors.Claim, before []processors.Record, claimed []claimedRow) ([]processors.ClaimResult, error) {
	won := make(map[int]claimedRow, len(claimed))
	for _, c := range claimed {
		won[int(c.ord)] = c
	}
	// cur is each record as the batch has left it so far: a claim
	// later in the batch sees an earlier one's lease.
	cur := byKey(before)
	// READ COMMITTED: a record admitted between the locking read and
	// the claim, which each see what was committed when they began, was
	// claimed unread. Read now, in a statement of its own, it is the
	// record as the claim left it: nobody else claims or completes it
	// while the lease is live.
	var lateTs, lateKs []string
	for i, c := range cs {
		if _, ok := cur[c.Key]; !ok {
			if _, didWin := won[i]; didWin {
				lateTs, lateKs = append(lateTs, c.Key.TenantID), append(lateKs, c.Key.IdempotencyKey)
			}
		}
	}
	var late map[ledger.CallKey]processors.Record
	if len(lateTs) > 0 {
		rows, _ := s.pool.Query(ctx, s.q.selectKeys, lateTs, lateKs)
		recs, err := pgx.CollectRows(rows, s.scanRecord)
		if err != nil {
			return nil, fmt.Errorf("read calls claimed unread: %w", err)
		}
		late = byKey(recs)
	}
	out := make([]processors.ClaimResult, len(cs))
	for i, c := range cs {
		r, ok := cur[c.Key]
		w, didWin := won[i]
		got, admitted := late[c.Key]
		switch {
		case !ok && didWin && !admitted:
			// Claimed, committed, and gone: nothing deletes a record
			// under a live lease.
			return nil, fmt.Errorf("claim %d (%v): record admitted during the claim not found after it", i, c.Key)
		case !ok && didWin && (got.Epoch != w.epoch || got.LeaseOwner != c.Owner):
			// Claimed by another since (only after this lease ended),
			// and perhaps finished.
			out[i] = processors.ClaimResult{Outcome: processors.Busy, Record: got}
			if got.Status.Done() {
				out[i].Outcome = processors.Finished
			}
			cur[c.Key] = got
		case !ok && didWin:
			out[i] = processors.ClaimResult{Outcome: processors.Claimed, Record: got}
			cur[c.Key] = got
		case !ok && admitted && got.ArgumentsHash != c.ArgumentsHash:
			// A claim of a key admitted meanwhile, with other
			// arguments, ahead of the one that won it.
			out[i] = processors.ClaimResult{Outcome: processors.Mismatch, Record: got}
		case !ok:
			out[i] = processors.ClaimResult{Outcome: processors.Missing}
		case r.ArgumentsHash != c.ArgumentsHash:
			out[i] = processors.ClaimResult{Outcome: processors.Mismatch, Record: r}
		case didWin:
			res := processors.ClaimResult{Outcome: processors.Claimed}
			if r.Status == processors.StatusExecuting && r.LeaseOwner != "" {
				// An owner's lease ran out: it may have sent, under the
				// credential it recorded. A released claim (no owner)
				// sent nothing.
				res.Outcome, res.Prior = processors.Reclaimed, r.Credential
			}
			// At most one claim per key wins (the one with the
			// record's hash), so r is the record as read.
			claimedRec := w.apply(r)
			res.Record = claimedRec
			out[i] = res
			cur[c.Key] = claimedRec
		case r.Status.Done():
			out[i] = processors.ClaimResult{Outcome: processors.Finished, Record: r}
		case r.Status == processors.StatusPending:
			out[i] = processors.ClaimResult{Outcome: processors.NotReady, Record: r}
		case r.Status == processors.StatusExecuting:
			// Not claimed by the UPDATE, so the lease is live (an
			// expired one goes to the first claim with this hash).
			out[i] = processors.ClaimResult{Outcome: processors.Busy, Record: r}
		case !slices.Contains(processors.Statuses, r.Status):
			// A newer build's status (a rolling upgrade): not this
			// build's to claim. Answered for this key alone: the
			// batch's other claims are committed.
			out[i] = processors.ClaimResult{Outcome: processors.NotReady, Record: r}
		default:
			return nil, fmt.Errorf("claim %d (%v): record %q and not claimed", i, c.Key, r.Status)
		}
	}
	return out, nil
}

// Complete implements processors.Store.
func (s *Store) Complete(ctx context.Context, cs []processors.Completion) ([]bool, error) {
	if err := processors.CheckCompletions(cs); err != nil {
		return nil, fmt.Errorf("pgstore complete: %w: %w", processors.ErrRejected, err)
	}
	if len(cs) == 0 {
		return []bool{}, nil
	}
	var (
		ts, ks, statuses             []string
		epochs, attempts, seqs, ords []int64
		results, outboxes            [][]byte
		journaled                    []bool
		entries                      = make(map[string]*journalCalls)
		names                        []string // of entries, in batch order
	)
	for i, c := range cs {
		ts, ks, statuses = append(ts, c.Key.TenantID), append(ks, c.Key.IdempotencyKey), append(statuses, string(c.Status))
		epochs, attempts, seqs = append(epochs, c.Epoch), append(attempts, int64(c.Attempt)), append(seqs, c.Seq)
		results, outboxes, ords = append(results, c.Result), append(outboxes, packOutbox(c.Outbox, s.packMin)), append(ords, int64(i))
		journaled = append(journaled, c.Journal != "")
		if c.Journal != "" {
			e := entries[c.Journal]
			if e == nil {
				e = &journalCalls{}
				entries[c.Journal] = e
				names = append(names, c.Journal)
			}
			e.add(c.Key, c.Epoch, c.Seq, c.From)
		}
	}
	var applied []bool
	spans := statementSpans(len(cs), func(i int) int { return len(results[i]) + len(outboxes[i]) })
	// The completions and their journal entries in one round trip, BEGIN
	// and COMMIT included (PostgreSQL).
	err := s.inBatchTx(ctx, "complete", s.relaxed(), batchTx{
		queue: func(b *pgx.Batch) {
			for _, sp := range spans {
				lo, hi := sp[0], sp[1]
				b.Queue(s.q.complete, ts[lo:hi], ks[lo:hi], epochs[lo:hi], statuses[lo:hi], attempts[lo:hi], results[lo:hi], seqs[lo:hi], outboxes[lo:hi], ords[lo:hi], journaled[lo:hi])
			}
			for _, name := range names {
				e := entries[name]
				b.Queue(s.q.journalInsert, name, e.ts, e.ks, e.epochs, e.seqs, e.froms)
			}
		},
		read: func(br pgx.BatchResults) error {
			var done []int64
			for range spans {
				rows, _ := br.Query()
				got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
				if err != nil {
					return err
				}
				done = append(done, got...)
			}
			for range names {
				if _, err := br.Exec(); err != nil {
					return fmt.Errorf("journal entry: %w", err)
				}
			}
			applied = appliedOf(len(cs), done)
			return nil
		},
	})
	if err != nil {
		return nil, err
	}
	return applied, nil
}

// Release implements processors.Store.
func (s *Store) Release(ctx context.Context, rs []processors.Release) ([]bool, error) {
	if err := processors.CheckReleases(rs); err != nil {
		return nil, fmt.Errorf("pgstore release: %w: %w", processors.ErrRejected, err)
	}
	if len(rs) == 0 {
		return []bool{}, nil
	}
	ts, ks, sent := make([]string, len(rs)), make([]string, len(rs)), make([]string, len(rs))
	epochs, afters, ords, attempts := make([]int64, len(rs)), make([]int64, len(rs)), make([]int64, len(rs)), make([]int64, len(rs))
	for i, r := range rs {
		ts[i], ks[i], epochs[i], ords[i], sent[i], attempts[i] = r.Key.TenantID, r.Key.IdempotencyKey, r.Epoch, int64(i), r.Sent, int64(r.Attempt)
		// Rounded up to whole microseconds, as a claim's lease.
		afters[i] = int64((r.After + time.Microsecond - 1) / time.Microsecond)
	}
	var applied []bool
	err := s.inBatchTx(ctx, "release", s.relaxed(), batchTx{
		queue: func(b *pgx.Batch) { b.Queue(s.q.release, ts, ks, epochs, afters, ords, sent, attempts) },
		read: func(br pgx.BatchResults) error {
			rows, _ := br.Query()
			done, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			applied = appliedOf(len(rs), done)
			return err
		},
	})
	if err != nil {
		return nil, err
	}
	return applied, nil
}

// appliedOf is which of n inputs the batch positions done (a statement's
// RETURNING ord) name.
func appliedOf(n int, done []int64) []bool {
	applied := make([]bool, n)
	for _, i := range done {
		applied[i] = true
	}
	return applied
}

// moveRound is one statement of a Move batch: at most one move per key.
type moveRound struct {
	ts, ks, froms, tos                  []string
	fromSeqs, seqs, ords, fromUndoMarks []int64
	outboxes, results                   [][]byte
	unlessInProgress                    []bool
}

// Move implements processors.Store. The batch is split into rounds, the
// n-th round holding the n-th move of each key, one UPDATE per round,
// pipelined in one round trip: a later move of a key runs in a later
// statement of the same transaction and sees the earlier one's write.
// Batches without a repeated key are one statement.
func (s *Store) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	if err := processors.CheckMoves(ms); err != nil {
		return nil, fmt.Errorf("pgstore move: %w: %w", processors.ErrRejected, err)
	}
	if len(ms) == 0 {
		return []bool{}, nil
	}
	var rounds []*moveRound
	nth := make(map[ledger.CallKey]int, len(ms))
	for i, m := range ms {
		n := nth[m.Key]
		nth[m.Key]++
		if n == len(rounds) {
			rounds = append(rounds, &moveRound{})
		}
		r := rounds[n]
		r.ts, r.ks = append(r.ts, m.Key.TenantID), append(r.ks, m.Key.IdempotencyKey)
		r.froms, r.tos = append(r.froms, string(m.From)), append(r.tos, string(m.To))
		r.fromSeqs, r.seqs, r.ords = append(r.fromSeqs, m.FromSeq), append(r.seqs, m.Seq), append(r.ords, int64(i))
		r.fromUndoMarks = append(r.fromUndoMarks, m.FromUndoMarks)
		r.outboxes = append(r.outboxes, packOutbox(m.Outbox, s.packMin))
		r.results = append(r.results, m.Result)
		r.unlessInProgress = append(r.unlessInProgress, m.UnlessInProgress)
	}
	var applied []bool
	err := s.inTx(ctx, "move", pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
		b := &pgx.Batch{}
		statements := 0
		for _, r := range rounds {
			for _, sp := range statementSpans(len(r.ts), func(i int) int { return len(r.outboxes[i]) + len(r.results[i]) }) {
				lo, hi := sp[0], sp[1]
				b.Queue(s.q.move, r.ts[lo:hi], r.ks[lo:hi], r.froms[lo:hi], r.fromSeqs[lo:hi], r.tos[lo:hi], r.seqs[lo:hi],
					r.outboxes[lo:hi], r.ords[lo:hi], r.fromUndoMarks[lo:hi], r.results[lo:hi], r.unlessInProgress[lo:hi])
				statements++
			}
		}
		br := tx.SendBatch(ctx, b)
		applied = make([]bool, len(ms))
		for range statements {
			rows, _ := br.Query()
			done, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				br.Close()
				return err
			}
			for _, i := range done {
				applied[i] = true
			}
		}
		return br.Close()
	})
	if err != nil {
		return nil, err
	}
	return applied, nil
}

// MarkUndo implements processors.Store. It runs at relaxed: the UPDATE
// decides on the row alone, under its lock; a move that read the row
// before it fails its compare-and-set, or (SERIALIZABLE) its commit and
// then its compare-and-set once retried.
func (s *Store) MarkUndo(ctx context.Context, k ledger.CallKey, undoable []processors.Status) (processors.Status, bool, error) {
	if err := processors.CheckUndoable(undoable); err != nil {
		return "", false, fmt.Errorf("pgstore mark undo: %w: %w", processors.ErrRejected, err)
	}
	sts := make([]string, len(undoable))
	for i, st := range undoable {
		sts[i] = string(st)
	}
	var (
		status string
		marked bool
	)
	err := s.inTxAt(ctx, "mark undo", s.relaxed(), pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
		err := tx.QueryRow(ctx, s.q.markUndo, k.TenantID, k.IdempotencyKey, sts).Scan(&status)
		if marked = err == nil; !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		// Not marked: a statement of its own, which sees the row as the
		// move that settled it left it.
		return tx.QueryRow(ctx, s.q.status, k.TenantID, k.IdempotencyKey).Scan(&status)
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, fmt.Errorf("%v: %w", k, processors.ErrNotFound)
	}
	if err != nil {
		return "", false, err
	}
	return processors.Status(status), marked, nil
}

// NoteUnanswered implements processors.Store. It runs at relaxed, as
// MarkUndo does: the UPDATE decides on the row alone, under its lock.
func (s *Store) NoteUnanswered(ctx context.Context, k ledger.CallKey, n processors.Unanswered) (processors.Unanswered, bool, error) {
	since := pgtype.Timestamptz{Time: n.Since, Valid: !n.Since.IsZero()}
	var (
		u  unansweredScan
		ok bool
	)
	err := s.inTxAt(ctx, "note unanswered", s.relaxed(), pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
		err := tx.QueryRow(ctx, s.q.noteUnanswered, k.TenantID, k.IdempotencyKey, n.Seq, since, n.InProgress).Scan(u.dest()...)
		if ok = err == nil; !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		// Not written: there is no record, or it moved on.
		var status string
		return tx.QueryRow(ctx, s.q.status, k.TenantID, k.IdempotencyKey).Scan(&status)
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return processors.Unanswered{}, false, fmt.Errorf("%v: %w", k, processors.ErrNotFound)
	}
	if err != nil || !ok {
		return processors.Unanswered{}, false, err
	}
	return u.note(), true, nil
}

// MarkLogged implements processors.Store.
func (s *Store) MarkLogged(ctx context.Context, ls []processors.Logged) error {
	if len(ls) == 0 {
		return nil
	}
	ts, ks, seqs, bases := make([]string, len(ls)), make([]string, len(ls)), make([]int64, len(ls)), make([]int64, len(ls))
	for i, l := range ls {
		ts[i], ks[i], seqs[i], bases[i] = l.Key.TenantID, l.Key.IdempotencyKey, l.Seq, l.Base
	}
	// READ COMMITTED on PostgreSQL: the statement only raises logged_seq
	// (GREATEST, and only where it is lower), so it is right whatever it
	// runs concurrently with, and it re-reads a row another transaction
	// changed instead of failing. Under SERIALIZABLE it raced the
	// executor's claim of the rows the intake had just logged, and one of
	// the two failed with 40001.
	return s.exec(ctx, "mark logged", s.q.markLogged, ts, ks, seqs, bases)
}

// exec runs one statement as a transaction at relaxed, in one round trip
// on PostgreSQL.
func (s *Store) exec(ctx context.Context, op, sql string, args ...any) error {
	return s.inBatchTx(ctx, op, s.relaxed(), batchTx{
		queue: func(b *pgx.Batch) { b.Queue(sql, args...) },
		read: func(br pgx.BatchResults) error {
			_, err := br.Exec()
			return err
		},
	})
}

// journalCalls are the calls of one journal entry, as its columns hold
// them.
type journalCalls struct {
	ts, ks              []string
	epochs, seqs, froms []int64
}

func (e *journalCalls) add(k ledger.CallKey, epoch, seq, from int64) {
	e.ts, e.ks = append(e.ts, k.TenantID), append(e.ks, k.IdempotencyKey)
	e.epochs, e.seqs, e.froms = append(e.epochs, epoch), append(e.seqs, seq), append(e.froms, from)
}

// Settle implements processors.Store. Settled as logged, it is one DELETE
// of the entries; as not logged, the entries are deleted and their calls
// reverted in one transaction.
func (s *Store) Settle(ctx context.Context, journals []string, logged bool) error {
	if len(journals) == 0 {
		return nil
	}
	if logged {
		return s.exec(ctx, "settle", s.q.journalDelete, journals)
	}
	return s.revertJournal(ctx, "settle", s.q.journalTake, journals)
}

// revertJournal deletes the journal entries take selects (with args) and
// puts their calls' LoggedSeq back to where their claims found it, in one
// transaction: an entry is deleted only with its calls reverted. At READ
// COMMITTED on PostgreSQL, as the other writes of a call's hot path: the
// revert decides each record on its own row, under its lock.
func (s *Store) revertJournal(ctx context.Context, op, take string, args ...any) error {
	return s.inTxAt(ctx, op, s.relaxed(), pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, take, args...)
		var all journalCalls
		var e journalCalls
		_, err := pgx.ForEachRow(rows, []any{&e.ts, &e.ks, &e.epochs, &e.seqs, &e.froms}, func() error {
			if len(e.ks) != len(e.ts) || len(e.epochs) != len(e.ts) || len(e.seqs) != len(e.ts) || len(e.froms) != len(e.ts) {
				// Not this build's writing (a hand edit, a restore):
				// its calls cannot be paired with their seqs. Dropped
				// with the take, said loudly: failing here would keep
				// it oldest, and every sweep of every executor would
				// fail on it, settling no other entry and appending no
				// record's events again, for as long as it stayed.
				s.log.Error("journal entry with arrays of unequal lengths dropped: the calls it names may lack events in the log (compare ledger trace with the store)",
					"op", op, "tenant_ids", len(e.ts), "idempotency_keys", len(e.ks), "epochs", len(e.epochs), "seqs", len(e.seqs), "from_seqs", len(e.froms),
					"call_keys", journalKeys(e.ts, e.ks))
				return nil
			}
			all.ts, all.ks = append(all.ts, e.ts...), append(all.ks, e.ks...)
			all.epochs, all.seqs, all.froms = append(all.epochs, e.epochs...), append(all.seqs, e.seqs...), append(all.froms, e.froms...)
			return nil
		})
		if err != nil || len(all.ts) == 0 {
			return err
		}
		_, err = tx.Exec(ctx, s.q.journalRevert, all.ts, all.ks, all.epochs, all.seqs, all.froms)
		return err
	})
}

// journalKeys names the calls of a journal entry, as far as its arrays
// pair up.
func journalKeys(ts, ks []string) []string {
	out := make([]string, 0, min(len(ts), len(ks)))
	for i := range min(len(ts), len(ks)) {
		out = append(out, ledger.CallKey{TenantID: ts[i], IdempotencyKey: ks[i]}.String())
	}
	return out
}

// Expired implements processors.Store.
func (s *Store) Expired(ctx context.Context, limit int) ([]processors.Record, error) {
	return s.ExpiredAfter(ctx, processors.Cursor{}, limit)
}

// ExpiredAfter implements processors.Store.
func (s *Store) ExpiredAfter(ctx context.Context, after processors.Cursor, limit int) ([]processors.Record, error) {
	if limit <= 0 {
		return []processors.Record{}, nil
	}
	sql, args := s.q.expired, []any{limit}
	if !after.IsZero() {
		sql, args = s.q.expiredAfter, append(args, after.At, after.Key.TenantID, after.Key.IdempotencyKey)
	}
	var out []processors.Record
	err := s.inTx(ctx, "expired", pgx.ReadOnly, func(ctx context.Context, tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, sql, args...)
		var err error
		out, err = pgx.CollectRows(rows, s.scanRecord)
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Unlogged implements processors.Store, against the database's clock.
func (s *Store) Unlogged(ctx context.Context, olderThan time.Duration, after processors.Cursor, limit int) ([]processors.Record, error) {
	if limit <= 0 {
		return []processors.Record{}, nil
	}
	// Rounded up to whole microseconds, the databases' precision: "more
	// than olderThan ago" must not admit a record updated less long ago.
	olderUS := int64(olderThan / time.Microsecond)
	if olderThan%time.Microsecond > 0 {
		olderUS++
	}
	// Entries their writer did not settle within olderThan: their calls
	// then show in the query below (their updated_at is the entry's
	// time or earlier). Oldest first, up to about limit calls a sweep.
	if err := s.revertJournal(ctx, "settle stale", s.q.journalTakeStale, olderUS, limit); err != nil {
		return nil, err
	}
	sql, args := s.q.unlogged, []any{olderUS, limit}
	if !after.IsZero() {
		sql, args = s.q.unloggedAfter, append(args, after.At, after.Key.TenantID, after.Key.IdempotencyKey)
	}
	var out []processors.Record
	err := s.inTx(ctx, "unlogged", pgx.ReadOnly, func(ctx context.Context, tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, sql, args...)
		var err error
		out, err = pgx.CollectRows(rows, s.scanRecord)
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// ByStatus implements processors.Store. A status no record has, known or
// not, lists nothing.
func (s *Store) ByStatus(ctx context.Context, status processors.Status, limit int) ([]processors.Record, error) {
	return s.byStatus(ctx, "", status, processors.Cursor{}, false, limit)
}

// ByStatusAfter implements processors.Store.
func (s *Store) ByStatusAfter(ctx context.Context, status processors.Status, after processors.Cursor, limit int) ([]processors.Record, error) {
	return s.byStatus(ctx, "", status, after, false, limit)
}

// TenantByStatus implements processors.Store.
func (s *Store) TenantByStatus(ctx context.Context, tenant string, status processors.Status, limit int) ([]processors.Record, error) {
	return s.byStatus(ctx, tenant, status, processors.Cursor{}, false, limit)
}

// TenantLatestByStatus implements processors.Store.
func (s *Store) TenantLatestByStatus(ctx context.Context, tenant string, status processors.Status, before processors.Cursor, limit int) ([]processors.Record, error) {
	if tenant == "" {
		return nil, errors.New("pgstore: TenantLatestByStatus needs a tenant")
	}
	if !before.IsZero() && before.Key.TenantID != tenant {
		return nil, errors.New("pgstore: TenantLatestByStatus from another tenant's cursor")
	}
	return s.byStatus(ctx, tenant, status, before, true, limit)
}

// byStatus lists the records in status, of tenant ("": of every tenant),
// after the cursor after (given only without a tenant), or newest first
// when latest (given only with a tenant), before the cursor after.
func (s *Store) byStatus(ctx context.Context, tenant string, status processors.Status, after processors.Cursor, latest bool, limit int) ([]processors.Record, error) {
	if tenant != "" && !latest && !after.IsZero() {
		return nil, errors.New("pgstore: one tenant's listing from a cursor is not served oldest first")
	}
	if limit <= 0 {
		return []processors.Record{}, nil
	}
	var out []processors.Record
	// Parameters in order: the status (unless the query names it), the
	// tenant (if any), the limit, the cursor (if any).
	var args []any
	q, listed := s.q.byListedStatus[status]
	switch {
	case latest && !after.IsZero():
		q, listed = s.q.tenantLatestByListedStatusBefore[status]
	case latest:
		q, listed = s.q.tenantLatestByListedStatus[status]
	case tenant != "":
		q, listed = s.q.tenantByListedStatus[status]
	case !after.IsZero():
		q, listed = s.q.byListedStatusAfter[status]
	}
	if !listed {
		switch {
		case latest && !after.IsZero():
			q = s.q.tenantLatestByStatusBefore
		case latest:
			q = s.q.tenantLatestByStatus
		case tenant != "":
			q = s.q.tenantByStatus
		case !after.IsZero():
			q = s.q.byStatusAfter
		default:
			q = s.q.byStatus
		}
		args = append(args, string(status))
	}
	if tenant != "" {
		args = append(args, tenant)
	}
	args = append(args, limit)
	switch {
	case after.IsZero():
	case latest: // one tenant's, fixed above
		args = append(args, after.At, after.Key.IdempotencyKey)
	default: // every tenant's (checked above)
		args = append(args, after.At, after.Key.TenantID, after.Key.IdempotencyKey)
	}
	err := s.inTx(ctx, "by status", pgx.ReadOnly, func(ctx context.Context, tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, q, args...)
		var err error
		out, err = pgx.CollectRows(rows, s.scanRecord)
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Get implements processors.Store.
func (s *Store) Get(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	return s.get(ctx, "get", pgx.Serializable, pgx.ReadOnly, s.q.get, k)
}

// ReadBack implements processors.Store. FOR UPDATE waits for the
// transaction that holds the row: PostgreSQL goes on with a COMMIT whose
// client gave up (a deadline that broke the connection, with no cancel
// sent), and until it ends a plain read returns the row as it was before,
// which would report a decision that then commits as not taken.
// At READ COMMITTED (relaxed) it then reads the row that transaction left,
// where SERIALIZABLE would fail it with 40001 to be run again. CockroachDB's
// plain reads wait for a pending write's intents anyway; both accept FOR
// UPDATE.
func (s *Store) ReadBack(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	return s.get(ctx, "read back", s.relaxed(), pgx.ReadWrite, s.q.getForUpdate, k)
}

// get reads key's record with q, in a transaction of iso and mode.
func (s *Store) get(ctx context.Context, op string, iso pgx.TxIsoLevel, mode pgx.TxAccessMode, q string, k ledger.CallKey) (processors.Record, error) {
	var r processors.Record
	err := s.inTxAt(ctx, op, iso, mode, func(ctx context.Context, tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, q, k.TenantID, k.IdempotencyKey)
		var err error
		r, err = pgx.CollectExactlyOneRow(rows, s.scanRecord)
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return processors.Record{}, fmt.Errorf("%v: %w", k, processors.ErrNotFound)
	}
	if err != nil {
		return processors.Record{}, err
	}
	return r, nil
}

// Footprint is the room the store's records take.
type Footprint struct {
	// Records is the number of execution records.
	Records int64
	// Bytes is the disk space of the records' and the journal's tables,
	// with their indexes and TOAST: every row version not yet vacuumed
	// included, so it is what a workload has written and not yet given
	// back, more than what its live rows hold.
	Bytes int64
}

// ErrNoFootprint is returned by Footprint on CockroachDB, which keeps
// sizes per range, approximately and asynchronously, and has no
// pg_total_relation_size.
var ErrNoFootprint = errors.New("pgstore: the store's footprint is known on PostgreSQL only")

// Footprint counts the records and measures the tables on PostgreSQL;
// on CockroachDB it returns ErrNoFootprint. The count reads every
// record's key: for benchmarks and capacity checks, not for a hot path.
func (s *Store) Footprint(ctx context.Context) (Footprint, error) {
	if s.crdb {
		return Footprint{}, ErrNoFootprint
	}
	var f Footprint
	err := s.pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+s.table+"), pg_total_relation_size($1::regclass) + pg_total_relation_size($2::regclass)",
		s.table, s.journal).Scan(&f.Records, &f.Bytes)
	if err != nil {
		return Footprint{}, fmt.Errorf("pgstore: footprint: %w", err)
	}
	return f, nil
}
