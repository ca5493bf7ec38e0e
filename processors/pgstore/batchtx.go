package pgstore

import (
	"context"
	"time"

	"github.com/cockroachdb/cockroach-go/v2/crdb"
	crdbpgx "github.com/cockroachdb/cockroach-go/v2/crdb/crdbpgxv5"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// batchTx is a read-write transaction whose statements are one pipelined
// batch. On PostgreSQL its BEGIN and COMMIT travel in the batch's round
// trip: a store transaction of the hot path is one round trip instead of
// three, which at low load, where a batch holds a few calls, is most of
// what it costs both sides.
type batchTx struct {
	// queue queues the statements.
	queue func(b *pgx.Batch)
	// sent, if set, runs once the batch is on its way, before any of its
	// answers is read (a crash point).
	sent func()
	// read reads their results, in order. The COMMIT is already on its
	// way: read must fail only with the statements' errors (which keep
	// it from applying), never decide to roll back. What the results
	// call for comes after the commit.
	read func(br pgx.BatchResults) error
}

// inBatchTx runs t at iso, restarted whole on serialization failures
// and deadlocks as inTxAt is. On CockroachDB it runs inside the savepoint
// protocol (crdbpgx), its BEGIN and COMMIT round trips of their own. On
// both, a transaction that has begun is answered even if ctx ends.
func (s *Store) inBatchTx(ctx context.Context, op string, iso pgx.TxIsoLevel, t batchTx) error {
	ctx = crdb.WithMaxRetries(ctx, s.maxRetries)
	a := s.attempts(op)
	var err error
	if s.crdb {
		// Once begun, the transaction runs to its end (up to sentGrace)
		// even if ctx ends meanwhile, as pipelined does on PostgreSQL:
		// cancelled during its COMMIT it could apply unseen, claims
		// committed that the step never launches. It begins only while
		// ctx lasts: the connection is taken under it.
		conn, aerr := s.pool.Acquire(ctx)
		if aerr != nil {
			return s.txError(op, aerr)
		}
		defer conn.Release()
		if err := ctx.Err(); err != nil {
			return s.txError(op, err)
		}
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sentGrace)
		defer cancel()
		ctx = tctx
		err = crdbpgx.ExecuteTx(ctx, conn, pgx.TxOptions{IsoLevel: iso, AccessMode: pgx.ReadWrite}, func(tx pgx.Tx) error {
			return a.run(func() error {
				br := tx.SendBatch(ctx, batchOf(t.queue))
				if t.sent != nil {
					t.sent()
				}
				err := t.read(br)
				if cerr := br.Close(); err == nil {
					err = cerr
				}
				return err
			})
		})
	} else {
		err = a.retry(ctx, func(ctx context.Context) error {
			return a.run(func() error { return s.pipelined(ctx, iso, t) })
		})
	}
	return s.txError(op, err)
}

func batchOf(queue func(b *pgx.Batch)) *pgx.Batch {
	b := &pgx.Batch{}
	queue(b)
	return b
}

// sentGrace bounds the wait for a sent pipeline's answers after its
// caller's context ended.
const sentGrace = 10 * time.Second

// pipelined runs t once on PostgreSQL: BEGIN, the statements and COMMIT
// in one batch. The batch's statements up to its Sync are one unit for
// the server: after an error it skips the rest, COMMIT included, and
// leaves the transaction open and aborted, which is rolled back here; a
// failed COMMIT ends it.
//
// Once sent, the pipeline is answered even if ctx ends meanwhile (up to
// sentGrace): its COMMIT is on its way and most likely applies, and only
// its answer says so. Closing the connection instead, as a cancelled
// query does, would turn a shutdown into claims and completions that
// committed unseen.
func (s *Store) pipelined(ctx context.Context, iso pgx.TxIsoLevel, t batchTx) (err error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		conn.Release()
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sentGrace)
	defer cancel()
	// A connection left in a transaction is destroyed, not reused.
	defer conn.Release()
	defer func() {
		if err != nil {
			rollback(ctx, conn.Conn().PgConn())
		}
	}()
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL " + string(iso) + " READ WRITE")
	t.queue(b)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	if t.sent != nil {
		t.sent()
	}
	_, err = br.Exec()
	if err == nil {
		err = t.read(br)
	}
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// rollback ends a transaction a failed attempt left open, so that the
// connection goes back to the pool; if it cannot, the pool destroys the
// connection on release.
func rollback(ctx context.Context, pc *pgconn.PgConn) {
	if pc.IsClosed() || pc.TxStatus() == 'I' {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = pc.Exec(rctx, "ROLLBACK").Close()
}
