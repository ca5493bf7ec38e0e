package pgstore

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/storetest"
)

// TestHotPathRoundTrips counts, through a proxy, the round trips each
// write of a call's hot path makes once its statements are prepared:
// each is one, BEGIN and COMMIT pipelined with its statements.
func TestHotPathRoundTrips(t *testing.T) {
	dsn := testDSN(t)
	p, proxied := storetest.StartProxy(t, dsn)
	// One connection, so that the second run of each write finds its
	// statements prepared.
	s := open(t, Config{DSN: proxied, Schema: newSchema(t, dsn), MaxConns: 1})
	defer s.Close()
	if s.crdb {
		t.Skip("CockroachDB runs these under its savepoint protocol")
	}
	ctx := t.Context()
	roundTrips := func(name string, want int, fn func(i int) error) {
		t.Helper()
		for i := range 2 {
			before := p.Stats().RoundTrips
			if err := fn(i); err != nil {
				t.Fatalf("%s #%d: %v", name, i, err)
			}
			if got := p.Stats().RoundTrips - before; i == 1 && got != want {
				t.Errorf("%s: %d round trips; want %d", name, got, want)
			}
		}
	}
	key := func(i int) ledger.CallKey {
		return ledger.CallKey{TenantID: "t_acme", IdempotencyKey: fmt.Sprintf("rt-%d", i)}
	}
	epochs := map[int]int64{}
	roundTrips("admit", 1, func(i int) error {
		_, err := s.Admit(ctx, []processors.Admission{{Key: key(i), CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized, Seq: 2, Outbox: []byte("[]")}})
		return err
	})
	roundTrips("claim", 1, func(i int) error {
		res, err := s.Claim(ctx, []processors.Claim{{Key: key(i), ArgumentsHash: "h", Owner: "executor-1", Lease: time.Minute, Logged: 2}})
		if err == nil && res[0].Outcome != processors.Claimed {
			err = fmt.Errorf("outcome %v; want claimed", res[0].Outcome)
		}
		if err == nil {
			epochs[i] = res[0].Record.Epoch
		}
		return err
	})
	roundTrips("complete", 1, func(i int) error {
		applied, err := s.Complete(ctx, []processors.Completion{{
			Key: key(i), Epoch: epochs[i], Status: processors.StatusSucceeded, Attempt: 1,
			Seq: 4, Outbox: []byte("[]"), Journal: fmt.Sprintf("step-%d", i), From: 2,
		}})
		if err == nil && !applied[0] {
			err = errors.New("not applied")
		}
		return err
	})
	roundTrips("settle", 1, func(i int) error { return s.Settle(ctx, []string{fmt.Sprintf("step-%d", i)}, true) })
	roundTrips("mark logged", 1, func(i int) error {
		return s.MarkLogged(ctx, []processors.Logged{{Key: key(i), Seq: 4}})
	})
}

// TestBatchTx: a pipelined transaction commits all of its statements or
// none, leaves its connection usable after a failure, and is run again
// whole on a serialization failure.
func TestBatchTx(t *testing.T) {
	dsn := testDSN(t)
	var retries int
	schema := newSchema(t, dsn)
	s := open(t, Config{DSN: dsn, Schema: schema, MaxConns: 1, MaxRetries: 3, Retried: func(string) { retries++ }})
	defer s.Close()
	if s.crdb {
		t.Skip("CockroachDB runs batch transactions under its savepoint protocol")
	}
	ctx := t.Context()
	table := pgx.Identifier{schema, "batchtx"}.Sanitize()
	if _, err := s.pool.Exec(ctx, "CREATE TABLE "+table+" (k TEXT PRIMARY KEY, v INT NOT NULL DEFAULT 0)"); err != nil {
		t.Fatal(err)
	}
	stmts := func(sqls ...string) func(b *pgx.Batch) {
		return func(b *pgx.Batch) {
			for _, q := range sqls {
				b.Queue(q)
			}
		}
	}
	readAll := func(n int) func(br pgx.BatchResults) error {
		return func(br pgx.BatchResults) error {
			for range n {
				if _, err := br.Exec(); err != nil {
					return err
				}
			}
			return nil
		}
	}
	value := func(k string) int {
		t.Helper()
		v := -1
		err := s.pool.QueryRow(ctx, "SELECT v FROM "+table+" WHERE k = $1", k).Scan(&v)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		return v
	}
	insert := func(k string) string { return "INSERT INTO " + table + " (k) VALUES ('" + k + "')" }

	// A statement fails after another's write: neither commits, and the
	// data error is not retried.
	conns := s.pool.Stat().NewConnsCount()
	err := s.inBatchTx(ctx, "fails", pgx.ReadCommitted, batchTx{queue: stmts(insert("a"), "SELECT 1/0"), read: readAll(2)})
	if sqlState(err) != "22012" || !errors.Is(err, processors.ErrRejected) {
		t.Errorf("pipeline with 1/0 = %v; want SQLSTATE 22012, rejected", err)
	}
	if value("a") != -1 {
		t.Error("the failed pipeline's insert committed")
	}
	// The aborted transaction was rolled back, and its connection kept
	// (a connection left in a transaction would be replaced).
	if err := s.inBatchTx(ctx, "ok", pgx.ReadCommitted, batchTx{queue: stmts(insert("b")), read: readAll(1)}); err != nil || value("b") != 0 {
		t.Errorf("pipeline after a failed one = %v, row %d; want nil, committed", err, value("b"))
	}
	if n := s.pool.Stat().NewConnsCount() - conns; n != 0 {
		t.Errorf("%d connections opened after a failed pipeline; want 0 (rolled back and reused)", n)
	}

	// A serialization failure: another transaction holds the row's lock
	// and commits its update after the pipeline's snapshot; the
	// pipeline's update fails with 40001 and runs again whole.
	other := connect(t, dsn)
	tx, err := other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE "+table+" SET v = 10 WHERE k = 'b'"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		done <- s.inBatchTx(ctx, "conflict", pgx.RepeatableRead, batchTx{
			queue: stmts(insert("c"), "UPDATE "+table+" SET v = v + 1 WHERE k = 'b'"), read: readAll(2)})
	}()
	// Wait until the pipeline waits on the lock, then let it go. From a
	// third connection: within other's transaction pg_stat_activity
	// would be a snapshot taken at its first read.
	monitor := connect(t, dsn)
	waitOn := func() { t.Helper(); waitOnLock(t, monitor, done) }
	waitOn()
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || retries != 1 || value("b") != 11 || value("c") != 0 {
		t.Errorf("pipeline after a serialization failure = %v, %d retries, b %d, c %d; want nil, 1 retry, 11, 0", err, retries, value("b"), value("c"))
	}

	// The caller gives up while the sent pipeline waits: it is answered
	// all the same, and says that it committed, rather than being cut
	// off with its COMMIT on its way.
	tx, err = other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE "+table+" SET v = 20 WHERE k = 'b'"); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	go func() {
		done <- s.inBatchTx(cctx, "cancelled", pgx.ReadCommitted, batchTx{
			queue: stmts("UPDATE " + table + " SET v = v + 1 WHERE k = 'b'"), read: readAll(1)})
	}()
	waitOn()
	cancel()
	time.Sleep(50 * time.Millisecond)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || value("b") != 21 {
		t.Errorf("pipeline whose caller gave up = %v, b %d; want nil, 21 (committed, and said so)", err, value("b"))
	}
}

// waitOnLock returns once a transaction's UPDATE of a batchtx table waits
// on a row's lock (as monitor, a connection of its own, sees it); it
// fails t if the transaction, whose result done carries, ends first.
func waitOnLock(t *testing.T, monitor *pgx.Conn, done chan error) {
	t.Helper()
	ctx := t.Context()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		if err := monitor.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE %batchtx%'").Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			return
		}
		select {
		case err := <-done:
			t.Fatalf("the pipeline ended without waiting: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			rows, _ := monitor.Query(ctx, "SELECT state, coalesce(wait_event_type, ''), query FROM pg_stat_activity WHERE datname = current_database()")
			act, _ := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ State, Wait, Query string }])
			t.Fatalf("the pipeline never waited on the row's lock: %+v", act)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestBatchTxCockroachAnswersAfterCancel: on CockroachDB too, a hot-path
// transaction that has begun runs to its end when its caller gives up,
// rather than being cut off with its COMMIT perhaps on its way (claims
// committed and never launched, at shutdown). Run against PostgreSQL
// through the CockroachDB path (its savepoint protocol works on both),
// or against CockroachDB when the tests are given one.
func TestBatchTxCockroachAnswersAfterCancel(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	s := open(t, Config{DSN: dsn, Schema: schema, MaxConns: 1})
	defer s.Close()
	s.crdb = true
	ctx := t.Context()
	table := pgx.Identifier{schema, "batchtx_crdb"}.Sanitize()
	if _, err := s.pool.Exec(ctx, "CREATE TABLE "+table+" (k TEXT PRIMARY KEY, v INT NOT NULL DEFAULT 0)"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(ctx, "INSERT INTO "+table+" (k) VALUES ('b')"); err != nil {
		t.Fatal(err)
	}
	other := connect(t, dsn)
	monitor := connect(t, dsn)
	tx, err := other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE "+table+" SET v = 20 WHERE k = 'b'"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	cctx, cancel := context.WithCancel(ctx)
	go func() {
		done <- s.inBatchTx(cctx, "cancelled", pgx.ReadCommitted, batchTx{
			queue: func(b *pgx.Batch) { b.Queue("UPDATE " + table + " SET v = v + 1 WHERE k = 'b'") },
			read: func(br pgx.BatchResults) error {
				_, err := br.Exec()
				return err
			}})
	}()
	waitOnLock(t, monitor, done)
	cancel()
	time.Sleep(50 * time.Millisecond)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var v int
	err = <-done
	if qerr := s.pool.QueryRow(ctx, "SELECT v FROM "+table+" WHERE k = 'b'").Scan(&v); qerr != nil {
		t.Fatal(qerr)
	}
	if err != nil || v != 21 {
		t.Errorf("transaction whose caller gave up = %v, v %d; want nil, 21 (committed, and said so)", err, v)
	}
	// A caller already gone starts nothing.
	if err := s.inBatchTx(cctx, "gone", pgx.ReadCommitted, batchTx{
		queue: func(b *pgx.Batch) { b.Queue("UPDATE " + table + " SET v = 0") },
		read:  func(br pgx.BatchResults) error { _, err := br.Exec(); return err }}); !errors.Is(err, context.Canceled) {
		t.Errorf("transaction of a caller already gone = %v; want context.Canceled", err)
	}
}

// connect opens a connection of its own to dsn, closed when t ends.
func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// A write whose batch carries more data than CockroachDB takes in one
// message (16 MiB, sql.conn.max_read_buffer_message_size) is sent as
// several statements of at most maxStatementBytes each, in the same
// transaction: PostgreSQL takes one of up to 1 GiB, so only the size of
// the messages, read through a proxy, shows it. Before, one statement
// carried the whole batch, which CockroachDB refused at every retry (an
// executor's results lost, an intake's partition stalled).
func TestWritesSplitPastAMessagesSize(t *testing.T) {
	dsn := testDSN(t)
	p, proxied := storetest.StartProxy(t, dsn)
	s := open(t, Config{DSN: proxied, Schema: newSchema(t, dsn)})
	defer s.Close()
	ctx := t.Context()
	// 37.5 MiB of arguments, then 18.75 MiB of results in completions
	// and as much in moves.
	const n, size = 240, 160 << 10
	big := func(i int) []byte {
		b := make([]byte, size)
		for j := range b {
			b[j] = byte('a' + (i+j)%26)
		}
		return b
	}
	as := make([]processors.Admission, n)
	cl := make([]processors.Claim, n)
	for i := range as {
		k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: fmt.Sprintf("big-%d", i)}
		as[i] = processors.Admission{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Arguments: big(i), Status: processors.StatusAuthorized, Seq: 2, Outbox: []byte("[]")}
		cl[i] = processors.Claim{Key: k, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Minute, Logged: 2}
	}
	res, err := s.Admit(ctx, as)
	if err != nil {
		t.Fatalf("admit: %v", err)
	}
	for i, r := range res {
		if r.Outcome != processors.Admitted {
			t.Fatalf("admission %d: %v; want admitted", i, r.Outcome)
		}
	}
	claims, err := s.Claim(ctx, cl)
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	// The first half succeed with their results; the second half's
	// outcomes are unknown, then settled succeeded with theirs (a
	// reconciler's moves).
	cs := make([]processors.Completion, n)
	for i, c := range claims {
		cs[i] = processors.Completion{Key: c.Record.Key, Epoch: c.Record.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Result: big(i), Seq: 4, Outbox: []byte("[]")}
		if i >= n/2 {
			cs[i].Status, cs[i].Result = processors.StatusOutcomeUnknown, nil
		}
	}
	applied, err := s.Complete(ctx, cs)
	if err != nil {
		t.Fatalf("complete: %v", err)
	}
	for i, ok := range applied {
		if !ok {
			t.Fatalf("completion %d not applied", i)
		}
	}
	var ms []processors.Move
	for i := n / 2; i < n; i++ {
		ms = append(ms, processors.Move{Key: cs[i].Key, From: processors.StatusOutcomeUnknown, FromSeq: 4, To: processors.StatusSucceeded, Seq: 5, Outbox: []byte("[]"), Result: big(i)})
	}
	moved, err := s.Move(ctx, ms)
	if err != nil {
		t.Fatalf("move: %v", err)
	}
	for i, ok := range moved {
		if !ok {
			t.Fatalf("move %d not applied", i)
		}
	}
	if rec, err := s.Get(ctx, cs[0].Key); err != nil || rec.Status != processors.StatusSucceeded || string(rec.Result) != string(big(0)) {
		t.Fatalf("the first call: %s, %d bytes of result (%v); want succeeded with its own", rec.Status, len(rec.Result), err)
	}
	rec, err := s.Get(ctx, cs[n-1].Key)
	if err != nil || rec.Status != processors.StatusSucceeded || string(rec.Result) != string(big(n-1)) || string(rec.Arguments) != string(big(n-1)) {
		t.Fatalf("the last call: %s, %d bytes of result, %d of arguments (%v); want succeeded with its own", rec.Status, len(rec.Result), len(rec.Arguments), err)
	}
	if got := p.Stats().LargestMessage; got > 16<<20 {
		t.Errorf("the largest message sent is %d bytes; want at most 16 MiB, CockroachDB's bound", got)
	}
}
