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
// Admit, Complete, MarkLogged and a settle are one (BEGIN and COMMIT
// pipelined with the statements); Claim two (its COMMIT waits for its
// results).
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
	roundTrips("claim", 2, func(i int) error {
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
	ctx := t.Context()
	table := pgx.Identifier{schema, "batchtx"}.Sanitize()
	if _, err := s.pool.Exec(ctx, "CREATE TABLE "+table+" (k TEXT PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	insert := func(k string) func(b *pgx.Batch) {
		return func(b *pgx.Batch) { b.Queue("INSERT INTO "+table+" (k) VALUES ($1)", k) }
	}
	then := func(q func(b *pgx.Batch), more ...func(b *pgx.Batch)) func(b *pgx.Batch) {
		return func(b *pgx.Batch) {
			q(b)
			for _, m := range more {
				m(b)
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
	has := func(k string) bool {
		t.Helper()
		var n int
		if err := s.pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE k = $1", k).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}

	// A statement fails after another's write: neither commits, and the
	// data error is not retried.
	divide := func(b *pgx.Batch) { b.Queue("SELECT 1/0") }
	conns := s.pool.Stat().NewConnsCount()
	err := s.inBatchTx(ctx, "fails", pgx.ReadCommitted, batchTx{queue: then(insert("a"), divide), read: readAll(2)})
	if sqlState(err) != "22012" || !errors.Is(err, processors.ErrRejected) {
		t.Errorf("pipeline with 1/0 = %v; want SQLSTATE 22012, rejected", err)
	}
	if has("a") {
		t.Error("the failed pipeline's insert committed")
	}
	// The aborted transaction was rolled back, and its connection kept
	// (a connection left in a transaction would be replaced).
	if err := s.inBatchTx(ctx, "ok", pgx.ReadCommitted, batchTx{queue: insert("b"), read: readAll(1)}); err != nil || !has("b") {
		t.Errorf("pipeline after a failed one = %v, row %v; want nil, committed", err, has("b"))
	}
	if n := s.pool.Stat().NewConnsCount() - conns; n != 0 {
		t.Errorf("%d connections opened after a failed pipeline; want 0 (rolled back and reused)", n)
	}

	// then decides to roll back.
	refused := errors.New("refused")
	err = s.inBatchTx(ctx, "refused", pgx.ReadCommitted, batchTx{queue: insert("c"), read: readAll(1),
		then: func(context.Context, querier) error { return refused }})
	if !errors.Is(err, refused) || has("c") {
		t.Errorf("then's error = %v, row %v; want %v, rolled back", err, has("c"), refused)
	}

	// then asks for another run: the whole transaction runs again, and
	// commits once.
	runs := 0
	err = s.inBatchTx(ctx, "again", pgx.ReadCommitted, batchTx{queue: insert("d"), read: readAll(1),
		then: func(ctx context.Context, q querier) error {
			runs++
			if runs == 1 {
				return retryable{errors.New("read again")}
			}
			rows, _ := q.Query(ctx, "SELECT k FROM "+table+" WHERE k = 'd'")
			ks, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err == nil && len(ks) != 1 {
				err = fmt.Errorf("then sees %v; want its own insert", ks)
			}
			return err
		}})
	if err != nil || runs != 2 || retries != 1 || !has("d") {
		t.Errorf("retried pipeline = %v after %d runs, %d retries counted, row %v; want nil, 2, 1, committed", err, runs, retries, has("d"))
	}
}
