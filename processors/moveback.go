package processors

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
)

// MoveStore is the part of an execution store that MoveOrReadBack uses.
type MoveStore interface {
	Move(ctx context.Context, ms []Move) ([]bool, error)
	ReadBack(ctx context.Context, key ledger.CallKey) (Record, error)
}

// ErrMoveUnknown: a decision's write failed, and its record could not be
// read back to tell whether it applied all the same. The person is to
// read the call (or the approval) before deciding again: told the write
// failed, they would take the decision for not made, and the next
// attempt's refusal (no longer pending) for someone else's.
var ErrMoveUnknown = errors.New("the write failed, and whether it applied could not be read back")

// MoveOrReadBack applies ms, a person's decisions (an approval, an
// operator's resolution), in st, and reports which applied. Once sent,
// the write runs to its end under a time of its own (timeout), whether or
// not the person still waits: cancelled mid-commit, a decision that may
// have applied would be answered as failed. When the write fails it may
// have committed all the same (CockroachDB's ambiguous result, a
// connection lost on COMMIT), so the records are read back, under a time
// of their own too: the moves are one transaction, and a record holding
// its move's own event (eventIDs[i], the last of its outbox) at the
// move's status and seq says that it committed, and which moves applied.
// The read back (Store.ReadBack) waits for a write still in flight, one
// whose commit goes on after its client gave up: read before it ends, a
// decision that then commits was reported as not taken. When the read
// back finds them applied, failedWrite is the write's error, for the
// log; when it finds every record where its move found it, or moved by
// another's decision at the move's seq, err is; when it fails, or finds
// a record moved on past the move's seq (which the move may have been,
// its event since out of the outbox), err is ErrMoveUnknown.
func MoveOrReadBack(ctx context.Context, st MoveStore, ms []Move, eventIDs []string, timeout time.Duration) (applied []bool, failedWrite, err error) {
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	applied, moveErr := st.Move(mctx, ms)
	if moveErr == nil {
		return applied, nil, nil
	}
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer rcancel()
	applied = make([]bool, len(ms))
	committed, unsure := false, false
	for i, m := range ms {
		rec, err := st.ReadBack(rctx, m.Key)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: %w", ErrMoveUnknown, errors.Join(moveErr, err))
		}
		switch {
		case rec.Seq > m.Seq:
			unsure = true
		case rec.Status != m.To || rec.Seq != m.Seq:
		default:
			if out, err := ledger.DecodeEvents(rec.Outbox); err == nil && len(out) > 0 && out[len(out)-1].EventID == eventIDs[i] {
				applied[i], committed = true, true
			}
		}
	}
	switch {
	case committed:
		return applied, moveErr, nil
	case unsure:
		return nil, nil, fmt.Errorf("%w: %w (the call has moved on since)", ErrMoveUnknown, moveErr)
	}
	return nil, nil, moveErr
}
