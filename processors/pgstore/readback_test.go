package pgstore

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// inFlightMove is the store, whose Move is sent and then given up on
// while it waits for the row (a COMMIT waiting on a disk or a standby,
// whose client's deadline broke the connection: PostgreSQL goes on with
// it). Once sent, it returns an error when proceed is closed; done has
// the move's end.
type inFlightMove struct {
	*Store
	sent, proceed chan struct{}
	done          chan error
}

func (s *inFlightMove) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	go func() {
		_, err := s.Store.Move(context.WithoutCancel(ctx), ms)
		s.done <- err
	}()
	close(s.sent)
	<-s.proceed
	return nil, errors.New("connection lost on COMMIT")
}

// A decision whose write is still in flight when its writer gives up is
// read back once that write ends: ReadBack waits for the row's lock.
// Read with a plain SELECT, the record was as before the write, and the
// decision, which then committed, was reported as not taken: the
// approver was answered 500, then 409 "no longer pending" when they
// tried again.
func TestReadBackWaitsForAWriteInFlight(t *testing.T) {
	s, cfg := openPG(t)
	ctx := t.Context()
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "in-flight"}
	ev := func(id string, seq int64) ledger.Event {
		return ledger.Event{EventID: id, TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey, CallID: "call_1", Seq: seq, Type: "approval_pending"}
	}
	admitted, err := ledger.EncodeEvents([]ledger.Event{ev("ev_1", 1), ev("ev_2", 2)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Admit(ctx, []processors.Admission{{
		Key: k, CallID: "call_1", ArgumentsHash: "h", UserID: "u_1", Tool: "refund_order", ToolVersion: 1,
		Arguments: []byte(`{}`), Status: processors.StatusPending, Seq: 2, Outbox: admitted,
	}}); err != nil {
		t.Fatal(err)
	}
	approved := ev("ev_approved", 3)
	approved.Type = "approved"
	outbox, err := ledger.EncodeEvents([]ledger.Event{approved})
	if err != nil {
		t.Fatal(err)
	}
	m := processors.Move{Key: k, From: processors.StatusPending, FromSeq: 2, To: processors.StatusAuthorized, Seq: 3, Outbox: outbox}

	// Another transaction holds the row, so that the move waits.
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(context.WithoutCancel(ctx))
	if _, err := holder.Exec(ctx, "SELECT 1 FROM "+s.table+" WHERE tenant_id = $1 AND idempotency_key = $2 FOR UPDATE", k.TenantID, k.IdempotencyKey); err != nil {
		t.Fatal(err)
	}
	monitor := connect(t, cfg.DSN)
	// waiters waits until n sessions wait on a lock of this test's
	// schema, failing t if the read back ends first.
	type outcome struct {
		applied     []bool
		failedWrite error
		err         error
	}
	res := make(chan outcome, 1)
	waiters := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; {
			var waiting int
			if err := monitor.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND position($1 in query) > 0", cfg.Schema).Scan(&waiting); err != nil {
				t.Fatal(err)
			}
			if waiting >= n {
				return
			}
			select {
			case o := <-res:
				t.Fatalf("MoveOrReadBack ended with %d sessions waiting for the row, before the write in flight: %v, %v, %v", waiting, o.applied, o.failedWrite, o.err)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d sessions wait for the row after 10 s; want %d", waiting, n)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	st := &inFlightMove{Store: s, sent: make(chan struct{}), proceed: make(chan struct{}), done: make(chan error, 1)}
	go func() {
		applied, failedWrite, err := processors.MoveOrReadBack(ctx, st, []processors.Move{m}, []string{approved.EventID}, 30*time.Second)
		res <- outcome{applied, failedWrite, err}
	}()
	<-st.sent
	waiters(1) // the move
	close(st.proceed)
	waiters(2) // and the read back behind it
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-st.done; err != nil {
		t.Fatalf("the move in flight: %v", err)
	}
	o := <-res
	if o.err != nil || len(o.applied) != 1 || !o.applied[0] || o.failedWrite == nil {
		t.Errorf("MoveOrReadBack = %v, %v, %v; want [true] (the write committed), its error for the log, nil", o.applied, o.failedWrite, o.err)
	}
	if rec, err := s.Get(ctx, k); err != nil || rec.Status != processors.StatusAuthorized {
		t.Errorf("Get = %s, %v; want authorized", rec.Status, err)
	}
}
