// Package chstore is the ClickHouse projection of the ledger
// (DESIGN.md §7): the projector writes every committed event and control
// record into it (Store.Write, a projections.Sink), and responders ask it
// the questions of projections.Queries.
//
// Tables (DDL in schema/, applied by Migrate):
//
//   - events: every event, refusals included, sorted by (tenant, tool,
//     time) and carrying its exact wire form for Trace;
//   - calls: one row per event with the call as that event shows it
//     (projections.CallOf); a call is its highest-seq row;
//   - call_refs: the lookup orders of blast radius (jti, credential
//     family, policy version and caller's roles of decisions, approver,
//     approval id, call id and trace id, and each call's requested
//     event);
//   - event_keys: which tools and times a key's events were written
//     under, so that Trace reads events by a range of their sort key;
//   - control_actions: every control record;
//   - schema_migrations: the schema versions applied.
//
// Every table is a ReplacingMergeTree whose sort key identifies a row, so
// that a batch written twice collapses on merge; but a merge happens
// whenever ClickHouse likes, so no query relies on it: each one groups by
// the event id or by the call (uniqExact, argMax), and answers the same
// before and after merges.
//
// The DDL and queries keep to what ClickHouse 18.16 (the server the tests
// run against) and current releases both accept: no Map, JSON,
// DateTime64, LowCardinality, TTL or codecs; times are a DateTime (whole
// seconds) plus a UInt32 of nanoseconds; every INSERT names its columns.
//
// File map: chstore.go (Config, Open, Migrate, Checksums, Swap),
// write.go (Write and the rows of each table), query.go (the queries),
// schema/ (the DDL), chtest (test helpers).
package chstore

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/ClickHouse/clickhouse-go/v2"
	"github.com/ClickHouse/clickhouse-go/v2/lib/driver"

	"github.com/toolcall-ledger/ledger/projections"
)

// DefaultDatabase is the database used when neither Config.Database nor
// the DSN names one.
const DefaultDatabase = "ledger"

// Config configures a Store.
type Config struct {
	// DSN is the ClickHouse server, native protocol, as
	// clickhouse.ParseDSN reads it, e.g.
	// "clickhouse://default@127.0.0.1:9000/ledger". Required.
	DSN string
	// Database holds the projection's tables; it overrides the DSN's
	// database. Default: the DSN's, else DefaultDatabase. It must be a
	// plain identifier (letters, digits, underscores), since it is part
	// of every statement's text.
	Database string
	// QuestionMaxMemory bounds the memory ClickHouse may use for one of
	// the responders' questions (max_memory_usage), in bytes, so that one
	// broad scan cannot take what the projector's inserts and the other
	// questions need; past it the question fails with
	// projections.ErrQuestionTooLarge. Default: DefaultQuestionMaxMemory;
	// negative: the server's own limit.
	QuestionMaxMemory int64
	// MaxConns is how many connections the store may open at once
	// unless the DSN says (max_open_conns): as many as its callers run
	// queries at once, else the rest, a readiness check's ping among
	// them, wait for one until their deadlines. The server bounds the
	// queries of every client together (max_concurrent_queries, 100 by
	// default), the projector's inserts included: a DSN's lower
	// max_open_conns keeps a process under its share. Default:
	// clickhouse-go's (10).
	MaxConns int
	// Logger receives migrations and swaps; default: discard.
	Logger *slog.Logger
}

// DefaultQuestionMaxMemory is Config.QuestionMaxMemory's default: ample
// for a question over millions of calls (each call's latest row is a few
// hundred bytes), a tenth of ClickHouse's own default.
const DefaultQuestionMaxMemory = 1 << 30

// memoryLimitExceeded is ClickHouse's MEMORY_LIMIT_EXCEEDED error code.
const memoryLimitExceeded = 241

// tableTooLargeToDrop is ClickHouse's TABLE_SIZE_EXCEEDS_MAX_DROP_SIZE_LIMIT
// error code: the server refuses to drop a table larger than its
// max_table_size_to_drop (50 GB by default).
const tableTooLargeToDrop = 359

// forceDrop says how to drop a table the server refuses to drop for its
// size.
const forceDrop = "create the flag file flags/force_drop_table in the server's data path (e.g. /var/lib/clickhouse/flags/force_drop_table, writable by the server, which removes it after one drop: one file per table), " +
	"or raise max_table_size_to_drop in the server config (0: no limit)"

// dbNameRE is what a database name may be: it is spliced into SQL.
var dbNameRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,127}$`)

// Store is the ClickHouse projection. It is safe for concurrent use.
type Store struct {
	conn   driver.Conn
	db     string
	addr   string
	logger *slog.Logger
	// questionMem is Config.QuestionMaxMemory, 0 for none.
	questionMem int64
	// lackingIDs is how many event ids of a month Lacking compares at
	// once, at most about; default lackingIDs.
	lackingIDs uint64
	// failDrop, if set, is asked before each DROP TABLE of a table
	// (by name) and its error returned as the server's: tests make a
	// drop fail as a server refusing a table over max_table_size_to_drop
	// does, which they cannot configure.
	failDrop func(table string) error
}

// Open connects to the server of cfg.DSN and checks that it answers. It
// neither creates the database nor its tables: Migrate does.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	if cfg.DSN == "" {
		return nil, errors.New("chstore: a DSN is required")
	}
	opts, err := clickhouse.ParseDSN(cfg.DSN)
	if err != nil {
		// The DSN may hold a password: do not repeat it.
		return nil, fmt.Errorf("chstore: parse DSN: %w", err)
	}
	db := cfg.Database
	if db == "" {
		db = opts.Auth.Database
	}
	if db == "" {
		db = DefaultDatabase
	}
	if !dbNameRE.MatchString(db) {
		return nil, fmt.Errorf("chstore: database name %q: must be letters, digits and underscores, not starting with a digit", db)
	}
	// Connect without a database: it may not exist before Migrate, and
	// the handshake would fail. Every statement names the database.
	opts.Auth.Database = ""
	if opts.MaxOpenConns == 0 && cfg.MaxConns > 0 {
		opts.MaxOpenConns = cfg.MaxConns
		if opts.MaxIdleConns == 0 {
			// clickhouse-go's 5 would close, and open again, a
			// connection for every query past the fifth at once.
			opts.MaxIdleConns = max(5, cfg.MaxConns/4)
		}
	}
	addr := strings.Join(opts.Addr, ",")
	conn, err := clickhouse.Open(opts)
	if err != nil {
		return nil, fmt.Errorf("chstore: open clickhouse at %s (database %s): %w", addr, db, err)
	}
	if err := conn.Ping(ctx); err != nil {
		conn.Close()
		return nil, fmt.Errorf("chstore: clickhouse at %s (database %s) does not answer: %w", addr, db, err)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	mem := cfg.QuestionMaxMemory
	switch {
	case mem == 0:
		mem = DefaultQuestionMaxMemory
	case mem < 0:
		mem = 0
	}
	if mem > 0 {
		// The setting goes with every question, and would override a
		// stricter limit the server's profile gives this user: the
		// smaller of the two is kept.
		var server string
		if err := conn.QueryRow(ctx, "SELECT value FROM system.settings WHERE name = 'max_memory_usage'").Scan(&server); err == nil {
			if n, err := strconv.ParseInt(server, 10, 64); err == nil && n > 0 && n < mem {
				mem = n
			}
		}
	}
	return &Store{conn: conn, db: db, addr: addr, logger: logger, questionMem: mem}, nil
}

// Close closes the connections.
func (s *Store) Close() error { return s.conn.Close() }

// Ping checks that the server answers, for readiness checks.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.conn.Ping(ctx); err != nil {
		return s.wrap("ping", err)
	}
	return nil
}

// Database is the database holding the store's tables.
func (s *Store) Database() string { return s.db }

// table names a table of the store's database as SQL text.
func (s *Store) table(name string) string { return "`" + s.db + "`.`" + name + "`" }

// wrap says where an error happened: which server and database.
func (s *Store) wrap(what string, err error) error {
	return fmt.Errorf("chstore: %s (clickhouse at %s, database %s): %w", what, s.addr, s.db, err)
}

// question readies ctx for the queries of one of the responders'
// questions: the server holds them to the store's memory bound.
func (s *Store) question(ctx context.Context) context.Context {
	if s.questionMem <= 0 {
		return ctx
	}
	// An int: clickhouse-go sends settings to servers before 19.x as
	// varints, and of a number only an int.
	return clickhouse.Context(ctx, clickhouse.WithSettings(clickhouse.Settings{"max_memory_usage": int(s.questionMem)}))
}

// wrapQuestion is wrap for a question's queries: one the server stopped
// at the memory bound is also projections.ErrQuestionTooLarge.
func (s *Store) wrapQuestion(what string, err error) error {
	var ex *clickhouse.Exception
	// The query's own limit, not the server's or the user's (a server
	// short of memory says "(total)"): only the question is too large.
	if errors.As(err, &ex) && ex.Code == memoryLimitExceeded && queryMemoryBound(ex.Message) {
		return fmt.Errorf("chstore: %s (clickhouse at %s, database %s): %w (%d MiB): %w",
			what, s.addr, s.db, projections.ErrQuestionTooLarge, s.questionMem>>20, err)
	}
	return s.wrap(what, err)
}

// queryMemoryBound reports whether a MEMORY_LIMIT_EXCEEDED message names
// the query's own bound: "Memory limit (for query) exceeded" up to 24.x,
// "Query memory limit exceeded" since, where the server's bound is
// "(total) memory limit exceeded" and the user's "User memory limit
// exceeded".
func queryMemoryBound(msg string) bool {
	m := strings.ToLower(msg)
	return strings.Contains(m, "(for query)") || strings.Contains(m, "query memory limit")
}

//go:embed schema/*.sql
var schemaFS embed.FS

// migration is one numbered file of schema/.
type migration struct {
	version    uint32
	name       string
	statements []string
}

// migrations reads schema/: files named NNN_name.sql, applied in order
// of NNN, each a version.
func migrations() ([]migration, error) {
	names, err := fs.Glob(schemaFS, "schema/*.sql")
	if err != nil {
		return nil, err
	}
	var ms []migration
	for _, path := range names {
		base := strings.TrimSuffix(strings.TrimPrefix(path, "schema/"), ".sql")
		num, _, ok := strings.Cut(base, "_")
		v, err := strconv.ParseUint(num, 10, 32)
		if !ok || err != nil || v == 0 {
			return nil, fmt.Errorf("schema file %s: want NNN_name.sql", path)
		}
		raw, err := schemaFS.ReadFile(path)
		if err != nil {
			return nil, err
		}
		// Drop comment lines, then split statements on ';'.
		var lines []string
		for _, l := range strings.Split(string(raw), "\n") {
			if !strings.HasPrefix(strings.TrimSpace(l), "--") {
				lines = append(lines, l)
			}
		}
		var stmts []string
		for _, st := range strings.Split(strings.Join(lines, "\n"), ";") {
			if st = strings.TrimSpace(st); st != "" {
				if _, _, ok := addedColumn(st); anyAddColumnRE.MatchString(st) && !ok {
					return nil, fmt.Errorf("schema file %s: an ADD COLUMN is ALTER TABLE {db}.<table> ADD COLUMN <column> <type>, one a statement, so that Migrate can tell it done", path)
				}
				stmts = append(stmts, st)
			}
		}
		ms = append(ms, migration{version: uint32(v), name: base, statements: stmts})
	}
	slices.SortFunc(ms, func(a, b migration) int { return int(a.version) - int(b.version) })
	for i := 1; i < len(ms); i++ {
		if ms[i].version == ms[i-1].version {
			return nil, fmt.Errorf("schema files %s and %s have the same version", ms[i-1].name, ms[i].name)
		}
	}
	return ms, nil
}

// fills reports whether m fills rows in from those already projected (an
// INSERT ... SELECT), or adds a column a projector of an older build
// would leave empty in the rows it writes meanwhile, as opposed to
// changing only what that projector does not write.
func (m migration) fills() bool {
	return slices.ContainsFunc(m.statements, func(st string) bool {
		_, _, add := addedColumn(st)
		return strings.HasPrefix(strings.ToUpper(st), "INSERT") || add
	})
}

// PendingFills returns the names of the migrations Migrate would apply
// that fill rows in from the rows already projected, or add a column. A
// projector of an older build writing while one runs adds rows it does
// not fill, or leaves the column empty in, for good: stop the projector
// first. A database never migrated has nothing
// to fill from.
func (s *Store) PendingFills(ctx context.Context) ([]string, error) {
	v, err := s.SchemaVersion(ctx)
	if err != nil || v == 0 {
		return nil, err
	}
	ms, err := migrations()
	if err != nil {
		return nil, s.wrap("read schema", err)
	}
	var out []string
	for _, m := range ms {
		if int(m.version) > v && m.fills() {
			out = append(out, m.name)
		}
	}
	return out, nil
}

// LatestVersion is the schema version this build's Migrate brings a
// database to.
func LatestVersion() int {
	ms, err := migrations()
	if err != nil || len(ms) == 0 {
		return 0
	}
	return int(ms[len(ms)-1].version)
}

// createTableRE names the table a migration's CREATE TABLE creates.
var createTableRE = regexp.MustCompile(`(?is)^CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?\{db\}\.(\w+)`)

// CreatedAfter names the tables the migrations past version create: those
// a database at version lacks until it is migrated. A table of an earlier
// version, missing, was dropped by hand: Migrate does not create it again.
func CreatedAfter(version int) []string {
	ms, err := migrations()
	if err != nil {
		return nil
	}
	var out []string
	for _, m := range ms {
		if int(m.version) <= version {
			continue
		}
		for _, st := range m.statements {
			if t := createTableRE.FindStringSubmatch(st); t != nil {
				out = append(out, t[1])
			}
		}
	}
	return out
}

// Migrate creates the database and brings its tables to LatestVersion.
// Every statement is idempotent (IF NOT EXISTS; an ADD COLUMN whose column
// exists is skipped) and applied versions are recorded in
// schema_migrations, so running it again, or from two
// processes at once, is harmless.
func (s *Store) Migrate(ctx context.Context) error {
	ms, err := migrations()
	if err != nil {
		return s.wrap("read schema", err)
	}
	if err := s.conn.Exec(ctx, "CREATE DATABASE IF NOT EXISTS `"+s.db+"`"); err != nil {
		return s.wrap("create database", err)
	}
	if err := s.conn.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+s.table("schema_migrations")+
		" (version UInt32, name String, applied_at DateTime) ENGINE = ReplacingMergeTree ORDER BY version"); err != nil {
		return s.wrap("create schema_migrations", err)
	}
	applied, err := s.applied(ctx)
	if err != nil {
		return err
	}
	for _, m := range ms {
		if applied[m.version] {
			continue
		}
		for _, st := range m.statements {
			if err := s.apply(ctx, strings.ReplaceAll(st, "{db}", "`"+s.db+"`")); err != nil {
				return s.wrap("apply schema "+m.name, err)
			}
		}
		if err := s.conn.Exec(ctx, "INSERT INTO "+s.table("schema_migrations")+
			" (version, name, applied_at) SELECT ?, ?, now()", m.version, m.name); err != nil {
			return s.wrap("record schema "+m.name, err)
		}
		s.logger.Info("schema applied", "database", s.db, "version", m.version, "name", m.name)
	}
	return nil
}

// addColumnRE matches an ALTER TABLE ... ADD COLUMN of one column (before
// or after {db} is filled in), naming the table and the column; migrations
// refuses any other form of ADD COLUMN, whose rerun apply could not tell
// done.
var addColumnRE = regexp.MustCompile(`(?is)^ALTER\s+TABLE\s+(?:\{db\}|` + "`[^`]+`" + `)\.(\w+)\s+ADD\s+COLUMN\s+(\w+)\s(.*)$`)

// anyAddColumnRE finds an ADD COLUMN anywhere in a statement, and
// moreClausesRE a clause after the first of an ALTER.
var (
	anyAddColumnRE = regexp.MustCompile(`(?i)\bADD\s+COLUMN\b`)
	moreClausesRE  = regexp.MustCompile(`(?i),\s*(ADD|DROP|MODIFY|CLEAR|COMMENT|RENAME)\s`)
)

// addedColumn reports whether st is an ADD COLUMN of the one form apply
// can tell done (addColumnRE, and no IF NOT EXISTS, which 18.16 lacks),
// and of which table and column.
func addedColumn(st string) (table, column string, ok bool) {
	m := addColumnRE.FindStringSubmatch(st)
	if m == nil || strings.EqualFold(m[2], "IF") || moreClausesRE.MatchString(m[3]) {
		return "", "", false
	}
	return m[1], m[2], true
}

// apply runs one statement of a migration. An ADD COLUMN whose column
// exists, before it or once it failed (another Migrate added it
// meanwhile), counts as applied: ClickHouse 18.16 has no ADD COLUMN IF
// NOT EXISTS, and every other statement is idempotent.
func (s *Store) apply(ctx context.Context, st string) error {
	table, column, ok := addedColumn(st)
	if !ok {
		return s.conn.Exec(ctx, st)
	}
	exists := func() (bool, error) {
		var n uint64
		err := s.conn.QueryRow(ctx, "SELECT count() FROM system.columns WHERE database = ? AND table = ? AND name = ?", s.db, table, column).Scan(&n)
		return n > 0, err
	}
	if ok, err := exists(); err != nil || ok {
		return err
	}
	err := s.conn.Exec(ctx, st)
	if err != nil {
		if ok, _ := exists(); ok {
			return nil
		}
	}
	return err
}

// applied returns the versions schema_migrations records.
func (s *Store) applied(ctx context.Context) (map[uint32]bool, error) {
	rows, err := s.conn.Query(ctx, "SELECT DISTINCT version FROM "+s.table("schema_migrations"))
	if err != nil {
		return nil, s.wrap("read schema_migrations", err)
	}
	defer rows.Close()
	out := make(map[uint32]bool)
	for rows.Next() {
		var v uint32
		if err := rows.Scan(&v); err != nil {
			return nil, s.wrap("read schema_migrations", err)
		}
		out[v] = true
	}
	if err := rows.Err(); err != nil {
		return nil, s.wrap("read schema_migrations", err)
	}
	return out, nil
}

// SchemaVersion is the highest schema version applied to the database:
// 0 when Migrate never ran.
func (s *Store) SchemaVersion(ctx context.Context) (int, error) {
	var n uint64
	if err := s.conn.QueryRow(ctx, "SELECT count() FROM system.tables WHERE database = ? AND name = 'schema_migrations'", s.db).Scan(&n); err != nil {
		return 0, s.wrap("look for schema_migrations", err)
	}
	if n == 0 {
		return 0, nil
	}
	applied, err := s.applied(ctx)
	if err != nil {
		return 0, err
	}
	v := uint32(0)
	for a := range applied {
		v = max(v, a)
	}
	return int(v), nil
}

// tables lists the database's tables; none when it does not exist.
func (s *Store) tables(ctx context.Context) (map[string]bool, error) {
	rows, err := s.conn.Query(ctx, "SELECT name FROM system.tables WHERE database = ?", s.db)
	if err != nil {
		return nil, s.wrap("list tables", err)
	}
	defer rows.Close()
	have := make(map[string]bool)
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, s.wrap("list tables", err)
		}
		have[n] = true
	}
	if err := rows.Err(); err != nil {
		return nil, s.wrap("list tables", err)
	}
	return have, nil
}

// DropIfEmpty drops the store's database if it holds no table (a rebuild's,
// once Swap moved its tables out), and says whether it did.
func (s *Store) DropIfEmpty(ctx context.Context) (bool, error) {
	have, err := s.tables(ctx)
	if err != nil || len(have) > 0 {
		return false, err
	}
	return true, s.DropDatabase(ctx)
}

// DropDatabase drops the store's database and every table in it: for
// tests, and to clean up after a rebuild.
func (s *Store) DropDatabase(ctx context.Context) error {
	if err := s.conn.Exec(ctx, "DROP DATABASE IF EXISTS `"+s.db+"`"); err != nil {
		return s.wrap("drop database", err)
	}
	return nil
}

// drop drops table of the store's database, if it exists.
func (s *Store) drop(ctx context.Context, table string) error {
	if s.failDrop != nil {
		if err := s.failDrop(table); err != nil {
			return err
		}
	}
	return s.conn.Exec(ctx, "DROP TABLE IF EXISTS "+s.table(table))
}

// dropTable is drop, its error saying where, and explained when the
// server refuses to drop the table for its size.
func (s *Store) dropTable(ctx context.Context, table string) error {
	err := s.drop(ctx, table)
	var ex *clickhouse.Exception
	switch {
	case err == nil:
		return nil
	case errors.As(err, &ex) && ex.Code == tableTooLargeToDrop:
		return s.wrap("drop "+table+", larger than the server's max_table_size_to_drop (50 GB by default): to drop it, "+forceDrop+"; then try again", err)
	default:
		return s.wrap("drop "+table, err)
	}
}

// Reset drops the projection's own tables (and its schema_migrations)
// from the store's database, and nothing else in it: a database named by
// mistake loses no table of another owner. Migrate creates them afresh.
func (s *Store) Reset(ctx context.Context) error {
	for _, n := range ownTables() {
		if err := s.dropTable(ctx, n); err != nil {
			return err
		}
	}
	return nil
}

// ownTables names every table of the projection, schema_migrations
// last.
func ownTables() []string { return append(tableNames(), "schema_migrations") }

// EventRows counts the rows of the events table (duplicates not yet
// merged included): zero means the projection holds nothing.
func (s *Store) EventRows(ctx context.Context) (uint64, error) { return s.rows(ctx, "events") }

// ControlRows counts the rows of the control_actions table (duplicates
// not yet merged count too): 0 when no control record was projected.
func (s *Store) ControlRows(ctx context.Context) (uint64, error) {
	return s.rows(ctx, "control_actions")
}

// rows counts the rows of table.
func (s *Store) rows(ctx context.Context, table string) (uint64, error) {
	var n uint64
	if err := s.conn.QueryRow(ctx, "SELECT count() FROM "+s.table(table)).Scan(&n); err != nil {
		return 0, s.wrap("count "+table, err)
	}
	return n, nil
}

// Checksum sums up a table's rows as merged.
type Checksum struct {
	// Rows is the number of rows as merged: one for each sorting key.
	Rows uint64
	// Sum is the sum, modulo 2^64, of the rows' cityHash64.
	Sum uint64
}

// Checksums sums up each table's content (schema_migrations aside) over
// its rows as merged (FINAL): the same log gives the same checksums
// whether it was written live, rebuilt, written twice or merged since.
// calls counts one row per call, its latest.
//
// FINAL alone collapses a row written twice: each table's sorting key
// names its row (an event's id, a control action's digest), and the
// rows of one key are the same row. FINAL streams the table merged, so
// the server's memory does not grow with it, where a DISTINCT over the
// rows held a hash of every one at once.
func (s *Store) Checksums(ctx context.Context) (map[string]Checksum, error) {
	// Every column this build writes: a database of another schema
	// version has other columns, and its checksums no meaning here.
	if v, err := s.SchemaVersion(ctx); err != nil {
		return nil, err
	} else if v != LatestVersion() {
		return nil, s.wrap("checksums", fmt.Errorf("schema version %d, this build's %d: migrate it first", v, LatestVersion()))
	}
	out := make(map[string]Checksum, len(tables))
	for _, t := range tables {
		cols := strings.Join(t.cols, ", ")
		q := "SELECT count(), sum(cityHash64(" + cols + ")) FROM " + s.table(t.name) + " FINAL"
		var c Checksum
		if err := s.conn.QueryRow(ctx, q).Scan(&c.Rows, &c.Sum); err != nil {
			return nil, s.wrap("checksum "+t.name, err)
		}
		out[t.name] = c
	}
	return out, nil
}

// Lacking counts what s holds that other does not: events (by id) and
// control subjects. other is a database on the same server (a rebuild
// of s's). Counts would not do: a rebuild that lost old events (past
// the log's retention) and holds newer ones (written since the live
// projection's last commit) may hold as many. Events are compared a
// month (a partition) at a time, and a month of more than about
// lackingIDs events in either database a share of its ids (by hash) at a
// time, so that the server holds at most about that many ids of each at
// once: the month's ids of a large deployment, held whole, exceeded the
// server's memory bound, and the check refused every swap.
func (s *Store) Lacking(ctx context.Context, other *Store) (events, subjects uint64, err error) {
	mine, err := s.monthEvents(ctx)
	if err != nil {
		return 0, 0, err
	}
	theirs, err := other.monthEvents(ctx)
	if err != nil {
		return 0, 0, err
	}
	per := s.lackingIDs
	if per == 0 {
		per = lackingIDs
	}
	for _, m := range slices.Sorted(maps.Keys(mine)) {
		shares := (max(mine[m], theirs[m]) + per - 1) / per
		for share := range shares {
			var n uint64
			q := "SELECT count() FROM (SELECT DISTINCT event_id FROM " + s.table("events") + " WHERE toYYYYMM(at) = ? AND cityHash64(event_id) % ? = ?)" +
				" WHERE event_id NOT IN (SELECT event_id FROM " + other.table("events") + " WHERE toYYYYMM(at) = ? AND cityHash64(event_id) % ? = ?)"
			if err := s.conn.QueryRow(ctx, q, m, shares, share, m, shares, share).Scan(&n); err != nil {
				return 0, 0, s.wrap(fmt.Sprintf("events lacking from %s in month %d (share %d of %d)", other.db, m, share+1, shares), err)
			}
			events += n
		}
	}
	q := "SELECT uniqExact(subject) FROM " + s.table("control_actions") +
		" WHERE subject NOT IN (SELECT subject FROM " + other.table("control_actions") + ")"
	if err := s.conn.QueryRow(ctx, q).Scan(&subjects); err != nil {
		return 0, 0, s.wrap("control subjects lacking from "+other.db, err)
	}
	return events, subjects, nil
}

// KeepControlHistory copies into s (a rebuild of from's, on the same
// server) the control actions from holds that s lacks, by action id, and
// returns how many. The control topic is compacted, keeping each
// subject's latest action, so a rebuild from it lacks the history that
// the live table holds (a tool's freeze, and who lifted it, when and
// why), which an incident's audit reads and nothing else keeps. An
// action is told by its subject, kind and time, not its action id: a
// projector of an older build digested fewer of a record's fields (a
// reassert, what an unfreeze lifts), so one record may have two ids.
// Both are at one schema version (Swap requires it).
func (s *Store) KeepControlHistory(ctx context.Context, from *Store) (uint64, error) {
	const action = "subject, at, at_ns, kind"
	missing := " FROM " + from.table("control_actions") + " WHERE (" + action + ") NOT IN (SELECT " + action + " FROM " + s.table("control_actions") + ")"
	var n uint64
	if err := s.conn.QueryRow(ctx, "SELECT uniqExact("+action+")"+missing).Scan(&n); err != nil {
		return 0, s.wrap("control actions lacking from "+s.db, err)
	}
	if n == 0 {
		return 0, nil
	}
	cols := strings.Join(actionsTable.cols, ", ")
	if err := s.conn.Exec(ctx, "INSERT INTO "+s.table("control_actions")+" ("+cols+") SELECT "+cols+missing); err != nil {
		return 0, s.wrap("copy the control actions lacking from "+s.db, err)
	}
	return n, nil
}

// lackingIDs is Lacking's default share of a month's event ids: about a
// million. ClickHouse 18.16 took about 500 bytes an id for the two sets of
// one comparison (318 MiB for 600,000), so some hundreds of megabytes; a
// month of 100 million events is then read a hundred times, minutes
// beside the hours its rebuild takes.
const lackingIDs = 1 << 20

// monthEvents counts the event rows of each month (toYYYYMM of at).
func (s *Store) monthEvents(ctx context.Context) (map[uint32]uint64, error) {
	rows, err := s.conn.Query(ctx, "SELECT toYYYYMM(at) AS m, count() FROM "+s.table("events")+" GROUP BY m")
	if err != nil {
		return nil, s.wrap("event months", err)
	}
	defer rows.Close()
	out := make(map[uint32]uint64)
	for rows.Next() {
		var (
			m uint32
			n uint64
		)
		if err := rows.Scan(&m, &n); err != nil {
			return nil, s.wrap("event months", err)
		}
		out[m] = n
	}
	if err := rows.Err(); err != nil {
		return nil, s.wrap("event months", err)
	}
	return out, nil
}

// swapSuffix names the tables a swap moves out of the way.
const swapSuffix = "_swapped_out"

// Swap makes the tables of other's database (a rebuild) this store's:
// in one RENAME TABLE statement, each table of this database is renamed
// to <name>_swapped_out and other's table of the same name takes its
// place; then the old tables are dropped, and one the server refuses to
// drop (larger than its max_table_size_to_drop) is left, with a warning
// logged: the swap took effect. other's database is left
// without those tables (drop it with other.DropDatabase). other must be
// migrated, and this database at the same version or not migrated at all
// (a first deployment from a rebuild, or a swap that failed half way).
//
// The window: ClickHouse 18.16 has no EXCHANGE TABLES, and it renames the
// tables of one statement one after another, not atomically. For the
// moment the statement takes (milliseconds; no data is copied), a query
// may find a table missing, or read one table swapped and another not
// yet. Tables are renamed in pairs, so each table is missing only
// between its two renames. A RENAME that fails half way may leave some
// tables swapped and others not (the error says which database): the
// way out is another rebuild into a fresh database, and Swap again, which
// first drops any swapped-out leftovers, and fails if it cannot.
func (s *Store) Swap(ctx context.Context, other *Store) error {
	if other.db == s.db {
		return fmt.Errorf("chstore: swap database %s with itself", s.db)
	}
	mine, err := s.SchemaVersion(ctx)
	if err != nil {
		return err
	}
	theirs, err := other.SchemaVersion(ctx)
	if err != nil {
		return err
	}
	if theirs == 0 || mine != 0 && mine != theirs {
		behind := other.db
		if mine != 0 && mine < theirs {
			behind = s.db
		}
		return fmt.Errorf("chstore: swap database %s (schema version %d) with %s (version %d): both must be at the same version; migrate %s first", s.db, mine, other.db, theirs, behind)
	}
	names := ownTables()
	// Leftovers of a swap that failed half way, or whose drops failed.
	for _, n := range names {
		if err := s.dropTable(ctx, n+swapSuffix); err != nil {
			return err
		}
	}
	// A table this database lacks (never migrated, or a swap that failed
	// half way) has nothing to move out of the way.
	have, err := s.tables(ctx)
	if err != nil {
		return err
	}
	if err := s.conn.Exec(ctx, "CREATE DATABASE IF NOT EXISTS `"+s.db+"`"); err != nil {
		return s.wrap("create database", err)
	}
	var pairs []string
	for _, n := range names {
		if have[n] {
			pairs = append(pairs, s.table(n)+" TO "+s.table(n+swapSuffix))
		}
		pairs = append(pairs, other.table(n)+" TO "+s.table(n))
	}
	if err := s.conn.Exec(ctx, "RENAME TABLE "+strings.Join(pairs, ", ")); err != nil {
		return s.wrap("swap tables with database "+other.db, err)
	}
	s.logger.Info("projection swapped", "database", s.db, "from", other.db)
	// Swapped: a table left is only disk space, and the next Swap
	// drops it first.
	var left []string
	var errs []error
	for _, n := range names {
		if err := s.drop(ctx, n+swapSuffix); err != nil {
			left, errs = append(left, s.table(n+swapSuffix)), append(errs, err)
		}
	}
	if len(left) > 0 {
		s.logger.Warn("swapped, but tables swapped out are left: drop them by hand (DROP TABLE), as the next swap must first; for one larger than the server's max_table_size_to_drop (50 GB by default, error 359), "+forceDrop,
			"database", s.db, "tables", strings.Join(left, ", "), "err", errors.Join(errs...))
	}
	return nil
}
