package storetest

import (
	"context"
	"errors"
	"net"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func TestClassify(t *testing.T) {
	cases := []struct {
		sql  string
		want stmtKind
	}{
		{"commit", stmtCommit},
		{"COMMIT;", stmtCommit},
		{"  Commit   Transaction ; ", stmtCommit},
		{"end", stmtCommit},
		{"begin isolation level serializable read write", stmtBegin},
		{"BEGIN", stmtBegin},
		{"start transaction", stmtBegin},
		{"rollback", stmtRollback},
		{"ABORT", stmtRollback},
		{"rollback to savepoint cockroach_restart", stmtOther},
		{"RELEASE SAVEPOINT cockroach_restart", stmtRelease},
		{"release savepoint other", stmtOther},
		{"SELECT 'commit'", stmtOther},
		{"UPDATE t SET status = 'executing'; COMMIT", stmtOther},
		{"", stmtOther},
	}
	for _, tc := range cases {
		if got := classify(tc.sql); got != tc.want {
			t.Errorf("classify(%q) = %d; want %d", tc.sql, got, tc.want)
		}
	}
}

func TestProxyDSN(t *testing.T) {
	p, err := NewProxy("127.0.0.1:1")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	host, port, _ := net.SplitHostPort(p.Addr())
	cases := []struct{ dsn, want string }{
		{"postgres://ledger@127.0.0.1:55432/ledger?sslmode=disable", "postgres://ledger@" + p.Addr() + "/ledger?sslmode=disable"},
		{"postgresql://u:pw@db.example:26257/x", "postgresql://u:pw@" + p.Addr() + "/x"},
		{"host=db.example port=5432 user=u dbname=x", "host=db.example port=5432 user=u dbname=x host=" + host + " port=" + port},
	}
	for _, tc := range cases {
		got, err := p.DSN(tc.dsn)
		if err != nil {
			t.Errorf("DSN(%q): %v", tc.dsn, err)
			continue
		}
		if got != tc.want {
			t.Errorf("DSN(%q) = %q; want %q", tc.dsn, got, tc.want)
		}
		// The rewritten DSN must reach the proxy.
		cfg, err := pgconn.ParseConfig(got)
		if err != nil {
			t.Fatalf("parse %q: %v", got, err)
		}
		if a := net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))); a != p.Addr() {
			t.Errorf("DSN(%q) connects to %s; want %s", tc.dsn, a, p.Addr())
		}
	}
	if _, err := PGAddr("host=/var/run/postgresql"); err == nil {
		t.Error("PGAddr of a Unix socket DSN: no error")
	}
}

// proxyTable makes a table in a fresh schema and returns its name.
func proxyTable(t *testing.T, dsn string) string {
	t.Helper()
	schema := FreshSchema(t, dsn)
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	table := pgx.Identifier{schema, "t"}.Sanitize()
	for _, stmt := range []string{
		"CREATE SCHEMA " + pgx.Identifier{schema}.Sanitize(),
		"CREATE TABLE " + table + " (k TEXT PRIMARY KEY, v INT NOT NULL)",
	} {
		if _, err := conn.Exec(t.Context(), stmt); err != nil {
			t.Fatal(err)
		}
	}
	return table
}

func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// count reads the rows of table directly, around the proxy.
func count(t *testing.T, dsn, table, where string) int {
	t.Helper()
	conn := connect(t, dsn)
	var n int
	if err := conn.QueryRow(t.Context(), "SELECT count(*) FROM "+table+" WHERE "+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestProxyForwardsAndCutsAll(t *testing.T) {
	dsn := PGDSN(t)
	p, proxied := StartProxy(t, dsn)
	a, b := connect(t, proxied), connect(t, proxied)
	for _, c := range []*pgx.Conn{a, b} {
		var n int
		if err := c.QueryRow(t.Context(), "SELECT $1::INT + 1", 41).Scan(&n); err != nil || n != 42 {
			t.Fatalf("query through the proxy: %d, %v", n, err)
		}
	}
	if got := p.CutAll(); got != 2 {
		t.Errorf("CutAll cut %d connections; want 2", got)
	}
	for _, c := range []*pgx.Conn{a, b} {
		if _, err := c.Exec(t.Context(), "SELECT 1"); err == nil {
			t.Error("query on a cut connection succeeded")
		}
	}
	// New connections are served as before.
	c := connect(t, proxied)
	if _, err := c.Exec(t.Context(), "SELECT 1"); err != nil {
		t.Fatalf("after CutAll: %v", err)
	}
	got := p.Stats()
	if got.Accepted-got.Cancels != 3 || got.Cut != 2 || got.Opaque != 0 {
		t.Errorf("stats = %+v; want 3 accepted besides cancel requests, 2 cut, none opaque", got)
	}
}

func TestProxyDelay(t *testing.T) {
	dsn := PGDSN(t)
	p, proxied := StartProxy(t, dsn)
	c := connect(t, proxied)
	const d = 150 * time.Millisecond
	p.SetDelay(d)
	start := time.Now()
	if _, err := c.Exec(t.Context(), "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < d {
		t.Errorf("a round trip under a %v delay took %v", d, took)
	}
	if got := p.Stats().Delayed; got < 1 {
		t.Errorf("Delayed = %d; want at least 1", got)
	}
	p.SetDelay(0)
	before := p.Stats().Delayed
	start = time.Now()
	if _, err := c.Exec(t.Context(), "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took >= d {
		t.Errorf("a round trip after healing took %v", took)
	}
	if got := p.Stats().Delayed; got != before {
		t.Errorf("Delayed went from %d to %d after healing", before, got)
	}
	// Healing releases a chunk held under a long delay at once.
	p.SetDelay(time.Hour)
	errc := make(chan error, 1)
	go func() {
		_, err := c.Exec(context.Background(), "SELECT 1")
		errc <- err
	}()
	waitFor(t, 5*time.Second, func() error {
		if p.Stats().Delayed == before {
			return errors.New("not held yet")
		}
		return nil
	})
	p.SetDelay(0)
	select {
	case err := <-errc:
		if err != nil {
			t.Errorf("query released by healing: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("healing did not release a held query")
	}
	before = p.Stats().Delayed

	// A cut interrupts a held chunk at once.
	p.SetDelay(time.Minute)
	go func() {
		_, err := c.Exec(context.Background(), "SELECT 1")
		errc <- err
	}()
	waitFor(t, 5*time.Second, func() error {
		if p.Stats().Delayed == before {
			return errors.New("not held yet")
		}
		return nil
	})
	p.CutAll()
	select {
	case err := <-errc:
		if err == nil {
			t.Error("a query held across a cut succeeded")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a cut did not end a held query")
	}
}

// A transaction whose COMMIT is cut has committed, and its client got an
// error: whatever the protocol pgx (or another client) commits with.
func TestProxyCutAfterCommit(t *testing.T) {
	dsn := PGDSN(t)
	table := proxyTable(t, dsn)
	p, proxied := StartProxy(t, dsn)
	ctx := t.Context()

	insert := func(c *pgx.Conn, k string) error {
		return pgx.BeginTxFunc(ctx, c, pgx.TxOptions{IsoLevel: pgx.Serializable}, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+table+" (k, v) VALUES ($1, 1)", k)
			return err
		})
	}
	cut := p.CutAfterCommitOf(1, "INSERT INTO "+table)
	c := connect(t, proxied)
	// Not aimed at: a transaction of other statements commits as usual.
	if err := pgx.BeginTxFunc(ctx, c, pgx.TxOptions{}, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "SELECT count(*) FROM "+table)
		return err
	}); err != nil {
		t.Fatalf("unaimed transaction: %v", err)
	}
	if err := insert(c, "a"); err == nil {
		t.Fatal("commit cut by the proxy returned no error")
	}
	if got := count(t, dsn, table, "k = 'a'"); got != 1 {
		t.Errorf("the cut transaction's row: %d; want 1 (committed)", got)
	}
	// The arming is used up: the next commit goes through.
	c = connect(t, proxied)
	if err := insert(c, "b"); err != nil {
		t.Fatalf("commit after the arming is used up: %v", err)
	}
	if got, want := [3]int{cut.Fired(), cut.Committed(), cut.Failed()}, [3]int{1, 1, 0}; got != want {
		t.Errorf("fired, committed, failed = %v; want %v", got, want)
	}

	// The extended protocol: COMMIT as Parse/Bind/Execute/Sync.
	cut = p.CutAfterCommit(1)
	pc := c.PgConn()
	if err := pc.Exec(ctx, "BEGIN; INSERT INTO "+table+" (k, v) VALUES ('c', 1)").Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := pc.ExecParams(ctx, "COMMIT", nil, nil, nil, nil).Close(); err == nil {
		t.Error("extended-protocol commit cut by the proxy returned no error")
	}
	if got := count(t, dsn, table, "k = 'c'"); got != 1 || cut.Committed() != 1 {
		t.Errorf("extended-protocol commit: row %d, committed %d; want 1, 1", got, cut.Committed())
	}

	// A transaction that failed before its COMMIT: the server answers
	// ROLLBACK, and the cut counts a commit that did not happen.
	cut = p.CutAfterCommit(1)
	c = connect(t, proxied)
	if _, err := c.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	_, _ = c.Exec(ctx, "INSERT INTO "+table+" (k, v) VALUES ('d', 1/0)")
	if _, err := c.Exec(ctx, "COMMIT"); err == nil {
		t.Error("cut commit of a failed transaction returned no error")
	}
	if got, want := [3]int{cut.Fired(), cut.Committed(), cut.Failed()}, [3]int{1, 0, 1}; got != want {
		t.Errorf("failed transaction: fired, committed, failed = %v; want %v", got, want)
	}
	if got := count(t, dsn, table, "k = 'd'"); got != 0 {
		t.Errorf("failed transaction's row: %d; want 0", got)
	}

	// A pipeline: BEGIN, the statements and COMMIT before one Sync (as
	// pgstore sends its hot-path transactions). The cut answer is the
	// COMMIT's, past those of the statements ahead of it.
	pipeline := func(v string) error {
		b := &pgx.Batch{}
		b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
		b.Queue("INSERT INTO " + table + " (k, v) VALUES ('" + v + "', 1)")
		b.Queue("INSERT INTO " + table + " (k, v) VALUES ('" + v + "-2', 1)")
		b.Queue("COMMIT")
		return connect(t, proxied).SendBatch(ctx, b).Close()
	}
	cut = p.CutAfterCommit(1)
	if err := pipeline("e"); err == nil {
		t.Error("pipelined commit cut by the proxy returned no error")
	}
	if got, want := [3]int{cut.Fired(), cut.Committed(), cut.Failed()}, [3]int{1, 1, 0}; got != want {
		t.Errorf("pipelined commit: fired, committed, failed = %v; want %v", got, want)
	}
	if got := count(t, dsn, table, "k IN ('e', 'e-2')"); got != 2 {
		t.Errorf("pipelined commit's rows: %d; want 2", got)
	}
	// A pipeline whose statement fails: the server skips its COMMIT.
	cut = p.CutAfterCommit(1)
	if err := pipeline("e"); err == nil {
		t.Error("pipeline with a duplicate key returned no error")
	}
	if got, want := [3]int{cut.Fired(), cut.Committed(), cut.Failed()}, [3]int{1, 0, 1}; got != want {
		t.Errorf("failed pipeline: fired, committed, failed = %v; want %v", got, want)
	}
	st := p.Stats()
	if st.CommitCuts != 5 || st.Commits < 7 {
		t.Errorf("stats = %+v; want 5 commit cuts of at least 7 commits", st)
	}
}

// sslmode=prefer asks the server for TLS first; a server without TLS
// says no and the connection goes on in the clear, readable.
func TestProxySSLNegotiation(t *testing.T) {
	dsn := PGDSN(t)
	table := proxyTable(t, dsn)
	p, proxied := StartProxy(t, dsn)
	if u, err := url.Parse(proxied); err == nil && u.Scheme != "" {
		q := u.Query()
		q.Set("sslmode", "prefer")
		u.RawQuery = q.Encode()
		proxied = u.String()
	} else {
		proxied += " sslmode=prefer"
	}
	cut := p.CutAfterCommit(1)
	c := connect(t, proxied)
	err := pgx.BeginTxFunc(t.Context(), c, pgx.TxOptions{}, func(tx pgx.Tx) error {
		_, err := tx.Exec(t.Context(), "INSERT INTO "+table+" (k, v) VALUES ('s', 1)")
		return err
	})
	if p.Stats().Opaque > 0 {
		// The server speaks TLS: the proxy cannot read the connection,
		// and says so.
		if err != nil || cut.Fired() != 0 {
			t.Errorf("encrypted connection: commit error %v, %d cuts; want none", err, cut.Fired())
		}
		return
	}
	if err == nil || cut.Committed() != 1 {
		t.Errorf("after a refused SSLRequest: commit error %v, %d committed cuts; want an error and 1", err, cut.Committed())
	}
}

func TestProxyCloseClosesEverything(t *testing.T) {
	dsn := PGDSN(t)
	target, err := PGAddr(dsn)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewProxy(target)
	if err != nil {
		t.Fatal(err)
	}
	proxied, err := p.DSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var conns []*pgx.Conn
	for range 3 {
		conns = append(conns, connect(t, proxied))
	}
	// One of them held by a delay when the proxy closes.
	p.SetDelay(time.Minute)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, _ = conns[0].Exec(context.Background(), "SELECT 1")
	}()
	waitFor(t, 5*time.Second, func() error {
		if p.Stats().Delayed == 0 {
			return errors.New("not held yet")
		}
		return nil
	})
	done := make(chan struct{})
	go func() { p.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return")
	}
	wg.Wait()
	var errs []bool
	for _, c := range conns[1:] {
		_, err := c.Exec(t.Context(), "SELECT 1")
		errs = append(errs, err != nil)
	}
	if diff := cmp.Diff([]bool{true, true}, errs); diff != "" {
		t.Errorf("queries after Close failed (-want +got):\n%s", diff)
	}
	if c, err := net.DialTimeout("tcp", p.Addr(), time.Second); err == nil {
		c.Close()
		t.Error("the proxy accepts connections after Close")
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// DelayCommitsOf holds back the COMMITs of the transactions it aims at,
// after their statements reached the server, and no others.
func TestProxyDelayCommitsOf(t *testing.T) {
	dsn := PGDSN(t)
	table := proxyTable(t, dsn)
	p, proxied := StartProxy(t, dsn)
	ctx := t.Context()
	const d = 300 * time.Millisecond
	p.DelayCommitsOf("INSERT INTO "+table, d)

	// Not aimed at: no delay, none counted.
	c := connect(t, proxied)
	if err := pgx.BeginTxFunc(ctx, c, pgx.TxOptions{}, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "SELECT count(*) FROM "+table)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if got := p.Stats().CommitsDelayed; got != 0 {
		t.Errorf("CommitsDelayed = %d after a transaction not aimed at; want 0", got)
	}

	// Aimed at, pipelined as pgstore sends it: the insert is on the
	// server (its row locked, not yet visible) while the COMMIT waits.
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	b.Queue("INSERT INTO " + table + " (k, v) VALUES ('a', 1)")
	b.Queue("COMMIT")
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- connect(t, proxied).SendBatch(ctx, b).Close() }()
	waitFor(t, 5*time.Second, func() error {
		if p.Stats().CommitsDelayed == 0 {
			return errors.New("commit not held yet")
		}
		return nil
	})
	if got := count(t, dsn, table, "k = 'a'"); got != 0 {
		t.Errorf("row visible while its COMMIT is held: %d; want 0", got)
	}
	if err := <-done; err != nil {
		t.Fatalf("delayed transaction: %v", err)
	}
	if took := time.Since(start); took < d {
		t.Errorf("a transaction whose commit was held %v took %v", d, took)
	}
	if got := count(t, dsn, table, "k = 'a'"); got != 1 {
		t.Errorf("delayed transaction's row: %d; want 1 (committed)", got)
	}

	// Stopped: commits go at once again.
	p.DelayCommitsOf("INSERT INTO "+table, 0)
	before := p.Stats().CommitsDelayed
	if err := pgx.BeginTxFunc(ctx, connect(t, proxied), pgx.TxOptions{}, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO "+table+" (k, v) VALUES ('b', 1)")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if got := p.Stats().CommitsDelayed; got != before {
		t.Errorf("CommitsDelayed went from %d to %d after the delay was stopped", before, got)
	}
}
