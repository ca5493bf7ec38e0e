package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/cockroachdb/cockroach-go/v2/crdb"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/toolcall-ledger/ledger/processors"
)

// Checker looks at a database the way Open would use it, and changes
// nothing: it never runs DDL, and it reads the schema inside a READ ONLY
// transaction. `ledger doctor` uses it to say whether the store is
// reachable and migrated without migrating it. It holds one connection
// and is not safe for concurrent use.
type Checker struct {
	conn   *pgx.Conn
	schema string // Config.Schema, raw; "" for the connection's current_schema()
}

// NewChecker connects to cfg.DSN. Only DSN and Schema of cfg matter; the
// error never repeats the DSN, which may hold a password.
func NewChecker(ctx context.Context, cfg Config) (*Checker, error) {
	if cfg.DSN == "" {
		return nil, errors.New("pgstore: DSN is required")
	}
	conn, err := Connect(ctx, cfg.DSN)
	if err != nil {
		return nil, err
	}
	return &Checker{conn: conn, schema: cfg.Schema}, nil
}

// Connect opens one connection to the store's database: what Open's pool
// would open, for tools that need one session (schema set-up, checks).
// The DSN's pool settings (pool_max_conns...), which Open honours, are
// left out: given to a single connection, PostgreSQL refuses them as
// unknown parameters. The error never repeats the DSN.
func Connect(ctx context.Context, dsn string) (*pgx.Conn, error) {
	pcfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, dsnError(err)
	}
	conn, err := pgx.ConnectConfig(ctx, pcfg.ConnConfig)
	if err != nil {
		return nil, fmt.Errorf("pgstore: connect: %w", err)
	}
	return conn, nil
}

// Close closes the connection.
func (c *Checker) Close(ctx context.Context) error { return c.conn.Close(ctx) }

// Server is what a database says of itself.
type Server struct {
	// Version is version()'s answer.
	Version string
	// CockroachDB is whether Version names CockroachDB, which Open uses to
	// choose the transaction retry protocol.
	CockroachDB bool
}

// Server reads the server's version.
func (c *Checker) Server(ctx context.Context) (Server, error) {
	var v string
	if err := c.conn.QueryRow(ctx, "SELECT version()").Scan(&v); err != nil {
		return Server{}, fmt.Errorf("pgstore: read version: %w", err)
	}
	return Server{Version: v, CockroachDB: strings.Contains(v, "CockroachDB")}, nil
}

// Now is the database's now(), for measuring the skew between the local
// clock and the database's: leases are measured against the latter.
func (c *Checker) Now(ctx context.Context) (time.Time, error) {
	var t time.Time
	if err := c.conn.QueryRow(ctx, "SELECT now()").Scan(&t); err != nil {
		return time.Time{}, fmt.Errorf("pgstore: read now(): %w", err)
	}
	return t, nil
}

// SchemaStatus compares a database's schema with the one this build's
// Migrate creates. The store's schema has no version number: its version
// is its tables, columns, indexes and status check, which is what is
// compared.
type SchemaStatus struct {
	// Schema is where the tables were looked for: Config.Schema, else the
	// connection's current_schema(); "" when the search_path names no
	// schema that exists.
	Schema string
	// MissingTables, MissingColumns ("table.column") and MissingIndexes
	// are what Migrate would create. A schema Migrate never ran on lacks
	// every table (and so reports no columns or indexes).
	MissingTables  []string
	MissingColumns []string
	MissingIndexes []string
	// ObsoleteIndexes are indexes an older build created that this build
	// no longer uses, which Migrate drops: the schema works with them,
	// but every write pays for them.
	ObsoleteIndexes []string
	// MissingStatusCheck is whether the execution records table has no
	// status CHECK constraint (Migrate adds it).
	MissingStatusCheck bool
	// UnvalidatedStatusCheck is whether, on PostgreSQL, the status check
	// was added NOT VALID and never validated (a migration that stopped
	// halfway): new writes are checked, the rows before it were not.
	// Migrate validates it.
	UnvalidatedStatusCheck bool
	// MissingStatuses are the statuses of processors.Statuses that the
	// status check refuses: a table an older build created, which
	// Migrate widens.
	MissingStatuses []processors.Status
	// NewerStatuses are statuses the check allows that this build does not
	// know: a newer build migrated the table. This build works with it
	// (Migrate only ever widens the check).
	NewerStatuses []string
}

// Migrated is whether Migrate ran here at all: some of its tables exist.
func (s SchemaStatus) Migrated() bool {
	return len(s.MissingTables) < len(checkedColumns)
}

// Current is whether the schema holds everything this build's Migrate
// creates.
func (s SchemaStatus) Current() bool {
	return len(s.MissingTables) == 0 && len(s.MissingColumns) == 0 && len(s.MissingIndexes) == 0 &&
		!s.MissingStatusCheck && !s.UnvalidatedStatusCheck && len(s.MissingStatuses) == 0
}

// checkedColumns are the tables of schema.sql and the columns the store's
// queries use.
var checkedColumns = map[string][]string{
	tableName:        recordCols,
	rateTableName:    {"bucket", "tat"},
	journalTableName: journalCols,
}

// Schema reads the schema, in a READ ONLY transaction.
func (c *Checker) Schema(ctx context.Context) (SchemaStatus, error) {
	srv, err := c.Server(ctx)
	if err != nil {
		return SchemaStatus{}, err
	}
	return readSchema(ctx, c.conn, c.schema, srv.CockroachDB)
}

// txBeginner is what readSchema reads through: one connection, or a pool.
type txBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// resolveSchemaSQL is where the execution store's tables are (the table
// named by $1): the first schema of the search_path that holds it, as an
// unqualified SELECT or UPDATE would find it, NULL when none does; and
// where a CREATE TABLE would put it, current_schema(), NULL when the
// search_path names no schema that exists. The two differ once a schema is added
// ahead of the tables' (a schema named as the user, "$user" leading the
// default search_path): CREATE TABLE IF NOT EXISTS would then make empty
// tables there, which new connections would read while older ones kept
// the real ones, and calls already done would be admitted and run again.
const resolveSchemaSQL = `SELECT (SELECT p.s FROM unnest(current_schemas(false)) WITH ORDINALITY AS p (s, i)
WHERE EXISTS (SELECT 1 FROM information_schema.tables t WHERE t.table_schema = p.s AND t.table_name = $1)
ORDER BY p.i LIMIT 1), current_schema()`

// readSchema reads the schema of schema ("": where the tables are, as
// resolveSchemaSQL finds them) in a READ ONLY transaction on db. It reads only the
// catalogs, so it takes no lock on the tables themselves and waits for no
// writer. On PostgreSQL (cockroach false) an index left invalid by a
// CREATE INDEX CONCURRENTLY that failed counts as missing: queries cannot
// use it, and Migrate builds it again.
//
// A serialization failure (40001) reads it all again in a new
// transaction, after a backoff: CockroachDB can fail even a read-only
// transaction so (a read within another's uncertainty interval, a
// concurrent schema change), and every process start reads the schema.
func readSchema(ctx context.Context, db txBeginner, schema string, cockroach bool) (SchemaStatus, error) {
	var st SchemaStatus
	tries := 0
	err := crdb.ExecuteCtx(crdb.WithMaxRetries(ctx, schemaReadRetries), func(ctx context.Context, _ ...any) error {
		if tries++; tries > 1 {
			if err := backoff(ctx, tries-1); err != nil {
				return err
			}
		}
		var err error
		st, err = readSchemaOnce(ctx, db, schema, cockroach)
		return err
	})
	return st, err
}

// schemaReadRetries bounds readSchema's retries: with backoff's 100 ms
// cap, a few seconds in all.
const schemaReadRetries = 30

// readSchemaOnce is one attempt of readSchema.
func readSchemaOnce(ctx context.Context, db txBeginner, schema string, cockroach bool) (SchemaStatus, error) {
	var st SchemaStatus
	tx, err := db.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		return st, fmt.Errorf("pgstore: check schema: %w", err)
	}
	// Read only: there is nothing to commit.
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	st.Schema = schema
	if st.Schema == "" {
		var found, cur pgtype.Text
		if err := tx.QueryRow(ctx, resolveSchemaSQL, tableName).Scan(&found, &cur); err != nil {
			return st, fmt.Errorf("pgstore: check schema: resolve the tables' schema: %w", err)
		}
		st.Schema = cmp.Or(found.String, cur.String)
	}
	tables := slices.Sorted(maps.Keys(checkedColumns))
	have := make(map[string]map[string]bool)
	rows, err := tx.Query(ctx, `SELECT table_name, column_name FROM information_schema.columns
WHERE table_schema = $1 AND table_name = ANY($2::TEXT[])`, st.Schema, tables)
	if err != nil {
		return st, fmt.Errorf("pgstore: check schema: read columns: %w", err)
	}
	for rows.Next() {
		var t, col string
		if err := rows.Scan(&t, &col); err != nil {
			rows.Close()
			return st, fmt.Errorf("pgstore: check schema: read columns: %w", err)
		}
		if have[t] == nil {
			have[t] = make(map[string]bool)
		}
		have[t][col] = true
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("pgstore: check schema: read columns: %w", err)
	}
	for _, t := range tables {
		if have[t] == nil {
			st.MissingTables = append(st.MissingTables, t)
			continue
		}
		for _, col := range checkedColumns[t] {
			if !have[t][col] {
				st.MissingColumns = append(st.MissingColumns, t+"."+col)
			}
		}
	}
	if have[tableName] == nil {
		return st, nil
	}

	rows, err = tx.Query(ctx, "SELECT indexname FROM pg_catalog.pg_indexes WHERE schemaname = $1 AND tablename = ANY($2::TEXT[])", st.Schema, []string{tableName, journalTableName})
	if err != nil {
		return st, fmt.Errorf("pgstore: check schema: read indexes: %w", err)
	}
	indexes, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return st, fmt.Errorf("pgstore: check schema: read indexes: %w", err)
	}
	valid := slices.Clone(indexes)
	if !cockroach {
		rows, err = tx.Query(ctx, `SELECT c.relname FROM pg_catalog.pg_index AS i
JOIN pg_catalog.pg_class AS c ON c.oid = i.indexrelid
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND NOT i.indisvalid`, st.Schema)
		if err != nil {
			return st, fmt.Errorf("pgstore: check schema: read invalid indexes: %w", err)
		}
		invalid, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return st, fmt.Errorf("pgstore: check schema: read invalid indexes: %w", err)
		}
		valid = slices.DeleteFunc(valid, func(ix string) bool { return slices.Contains(invalid, ix) })
	}
	for _, ix := range schemaIndexes {
		if have[ix.table] != nil && !slices.Contains(valid, ix.name) {
			st.MissingIndexes = append(st.MissingIndexes, ix.name)
		}
	}
	// An obsolete index that a failed DROP INDEX CONCURRENTLY left invalid
	// is still written on every write: obsolete all the same.
	for _, ix := range obsoleteIndexes {
		if slices.Contains(indexes, ix) {
			st.ObsoleteIndexes = append(st.ObsoleteIndexes, ix)
		}
	}

	var def pgtype.Text
	validated := true
	err = tx.QueryRow(ctx, readStatusCheck, pgx.Identifier{st.Schema, tableName}.Sanitize(), statusCheckName).Scan(&def, &validated)
	// CockroachDB shows it not validated while the ADD's schema change
	// validates it.
	st.UnvalidatedStatusCheck = err == nil && !validated && !cockroach
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		st.MissingStatusCheck = true
		return st, nil
	case err != nil:
		return st, fmt.Errorf("pgstore: check schema: read the status check: %w", err)
	}
	allowed := quotedLiterals(def.String)
	for _, s := range processors.Statuses {
		if !slices.Contains(allowed, string(s)) {
			st.MissingStatuses = append(st.MissingStatuses, s)
		}
	}
	for _, l := range slices.Compact(slices.Sorted(slices.Values(allowed))) {
		if !slices.Contains(processors.Statuses, processors.Status(l)) {
			st.NewerStatuses = append(st.NewerStatuses, l)
		}
	}
	return st, nil
}
