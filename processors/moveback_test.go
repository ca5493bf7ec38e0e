package processors_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// readBackStore is a MoveStore whose Move fails (a connection lost on
// COMMIT) and whose ReadBack answers rec, or readErr.
type readBackStore struct {
	rec     processors.Record
	readErr error
}

var errCommitLost = errors.New("connection lost on COMMIT")

func (s readBackStore) Move(context.Context, []processors.Move) ([]bool, error) {
	return nil, errCommitLost
}

func (s readBackStore) ReadBack(context.Context, ledger.CallKey) (processors.Record, error) {
	return s.rec, s.readErr
}

// outboxOf is an outbox whose last event is id's, at seq.
func outboxOf(t *testing.T, k ledger.CallKey, id string, seq int64) []byte {
	t.Helper()
	b, err := ledger.EncodeEvents([]ledger.Event{{EventID: id, TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey, CallID: "call_1", Seq: seq, Type: "approved"}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A decision whose write failed is taken for applied only when the read
// back finds its own event at its seq; for not applied when it finds the
// record where the move found it, or another's decision at that seq; and
// for unknown when the read fails or finds the call moved on past the
// move's seq, where the move may have applied before the next step: told
// "not applied", the person would decide again, or take the decision
// they see for someone else's.
func TestMoveOrReadBack(t *testing.T) {
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}
	m := processors.Move{Key: k, From: processors.StatusPending, FromSeq: 2, To: processors.StatusAuthorized, Seq: 3}
	at := func(st processors.Status, seq int64, id string) processors.Record {
		return processors.Record{Key: k, Status: st, Seq: seq, Outbox: outboxOf(t, k, id, seq)}
	}
	for _, tc := range []struct {
		name        string
		store       readBackStore
		applied     bool
		wantErr     error
		wantUnknown bool
	}{
		{"applied", readBackStore{rec: at(processors.StatusAuthorized, 3, "ev_mine")}, true, nil, false},
		{"where it was", readBackStore{rec: at(processors.StatusPending, 2, "ev_intake")}, false, errCommitLost, false},
		{"another's decision at its seq", readBackStore{rec: at(processors.StatusRejected, 3, "ev_theirs")}, false, errCommitLost, false},
		{"another's identical move", readBackStore{rec: at(processors.StatusAuthorized, 3, "ev_theirs")}, false, errCommitLost, false},
		{"moved on since", readBackStore{rec: at(processors.StatusExecuting, 4, "ev_claim")}, false, errCommitLost, true},
		{"unreadable", readBackStore{readErr: errors.New("connection refused")}, false, errCommitLost, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			applied, failedWrite, err := processors.MoveOrReadBack(t.Context(), tc.store, []processors.Move{m}, []string{"ev_mine"}, time.Second)
			if tc.applied {
				if err != nil || len(applied) != 1 || !applied[0] || !errors.Is(failedWrite, errCommitLost) {
					t.Errorf("MoveOrReadBack = %v, %v, %v; want [true], the write's error for the log, nil", applied, failedWrite, err)
				}
				return
			}
			if applied != nil || failedWrite != nil || !errors.Is(err, tc.wantErr) || errors.Is(err, processors.ErrMoveUnknown) != tc.wantUnknown {
				t.Errorf("MoveOrReadBack = %v, %v, %v; want nil, nil, the write's error, ErrMoveUnknown %v", applied, failedWrite, err, tc.wantUnknown)
			}
		})
	}
}
