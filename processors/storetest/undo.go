package storetest

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// undoTests are the contract of MarkUndo and Move.FromUndoMarks: a call
// its compensation's executor found undoable is not settled by a move
// decided before that check, so that it is never recorded as having had
// no effect while its undo is on its way.
func undoTests() []contractTest {
	return []contractTest{
		{"Undo/Marked", testUndoMarked},
		{"Undo/NotUndoable", testUndoNotUndoable},
		{"Undo/Missing", testUndoMissing},
		{"Undo/Invalid", testUndoInvalid},
		{"Undo/FencesMoves", testUndoFencesMoves},
		{"Concurrent/MoveMarkUndo", testConcurrentMoveMarkUndo},
	}
}

// unknownOrParked are the statuses an undo the reconciler asked for
// finds undoable.
var unknownOrParked = []processors.Status{processors.StatusOutcomeUnknown, processors.StatusParked}

// settleFailed is the move that settles k, read at seq 4 with marks,
// failed: a status lookup's not_found, or an operator's resolution.
func settleFailed(k ledger.CallKey, marks int64) processors.Move {
	return processors.Move{Key: k, From: processors.StatusOutcomeUnknown, FromSeq: 4, FromUndoMarks: marks,
		To: processors.StatusFailed, Seq: 5, Outbox: []byte(`[{"seq":5}]`)}
}

// mustMarkUndo is MarkUndo failing t on an error.
func mustMarkUndo(t *testing.T, s processors.Store, k ledger.CallKey, undoable []processors.Status) (processors.Status, bool) {
	t.Helper()
	st, marked, err := s.MarkUndo(t.Context(), k, undoable)
	if err != nil {
		t.Fatalf("MarkUndo(%v) = %v", k, err)
	}
	return st, marked
}

// testUndoMarked: a call in one of the undoable statuses is marked, once
// a call, and nothing else of its record changes (not UpdatedAt: the
// call took no step).
func testUndoMarked(t *testing.T, s processors.Store) {
	for _, st := range []processors.Status{processors.StatusOutcomeUnknown, processors.StatusSucceeded} {
		t.Run(string(st), func(t *testing.T) {
			k := key("undo:marked:" + string(st))
			before := completeUnlogged(t, s, k, st)
			for n := int64(1); n <= 2; n++ {
				got, marked := mustMarkUndo(t, s, k, []processors.Status{processors.StatusOutcomeUnknown, processors.StatusParked, processors.StatusSucceeded})
				if got != st || !marked {
					t.Fatalf("MarkUndo #%d = %s, marked %v; want %s, marked", n, got, marked, st)
				}
				want := before
				want.UndoMarks = n
				checkUnchanged(t, s, k, want)
			}
		})
	}
}

// testUndoNotUndoable: a call in no undoable status is not marked, and
// MarkUndo says what it is.
func testUndoNotUndoable(t *testing.T, s processors.Store) {
	for _, st := range []processors.Status{processors.StatusFailed, processors.StatusSucceeded} {
		t.Run(string(st), func(t *testing.T) {
			k := key("undo:not:" + string(st))
			before := completeUnlogged(t, s, k, st)
			got, marked := mustMarkUndo(t, s, k, unknownOrParked)
			if got != st || marked {
				t.Errorf("MarkUndo = %s, marked %v; want %s, not marked", got, marked, st)
			}
			checkUnchanged(t, s, k, before)
		})
	}
}

// testUndoMissing: MarkUndo of no record is ErrNotFound, and creates none.
func testUndoMissing(t *testing.T, s processors.Store) {
	k := key("undo:missing")
	if _, _, err := s.MarkUndo(t.Context(), k, unknownOrParked); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("MarkUndo(missing) = %v; want ErrNotFound", err)
	}
	if _, err := s.Get(t.Context(), k); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("Get after MarkUndo(missing) = %v; want ErrNotFound", err)
	}
}

// testUndoInvalid: no undoable status, or an unknown one, is the caller's
// fault, and marks nothing.
func testUndoInvalid(t *testing.T, s processors.Store) {
	k := key("undo:invalid")
	before := completeUnlogged(t, s, k, processors.StatusOutcomeUnknown)
	for _, undoable := range [][]processors.Status{nil, {processors.StatusOutcomeUnknown, "undone"}} {
		if _, _, err := s.MarkUndo(t.Context(), k, undoable); !errors.Is(err, processors.ErrRejected) {
			t.Errorf("MarkUndo(%q) = %v; want ErrRejected", undoable, err)
		}
	}
	checkUnchanged(t, s, k, before)
}

// testUndoFencesMoves: a move read before a mark does not apply; one that
// carries the mark does, and keeps it.
func testUndoFencesMoves(t *testing.T, s processors.Store) {
	k := key("undo:fences")
	completeUnlogged(t, s, k, processors.StatusOutcomeUnknown)
	mustMarkUndo(t, s, k, unknownOrParked)
	marked := mustGet(t, s, k)
	if applied := mustMove(t, s, settleFailed(k, 0)); applied[0] {
		t.Errorf("Move read before the mark applied = true; want false")
	}
	checkUnchanged(t, s, k, marked)
	if applied := mustMove(t, s, settleFailed(k, 1)); !applied[0] {
		t.Fatalf("Move read after the mark applied = false; want true")
	}
	if got := mustGet(t, s, k); got.Status != processors.StatusFailed || got.UndoMarks != 1 {
		t.Errorf("after the move the call is %s with %d undo marks; want failed, 1", got.Status, got.UndoMarks)
	}
}

// testConcurrentMoveMarkUndo: a call settled failed and its compensation's
// check, at once, many times over: exactly one of the two applies each
// time, never both (a call recorded without an effect, and undone) nor
// neither.
func testConcurrentMoveMarkUndo(t *testing.T, s processors.Store) {
	const n = 24
	for i := range n {
		k := key(fmt.Sprintf("race-undo:%d", i))
		completeUnlogged(t, s, k, processors.StatusOutcomeUnknown)
		var (
			wg     sync.WaitGroup
			moved  []bool
			marked bool
			status processors.Status
			errs   [2]error
		)
		start := make(chan struct{})
		wg.Go(func() {
			<-start
			moved, errs[0] = s.Move(t.Context(), []processors.Move{settleFailed(k, 0)})
		})
		wg.Go(func() {
			<-start
			status, marked, errs[1] = s.MarkUndo(t.Context(), k, unknownOrParked)
		})
		close(start)
		wg.Wait()
		if err := errors.Join(errs[:]...); err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		got := mustGet(t, s, k)
		switch {
		case moved[0] && marked:
			t.Fatalf("round %d: both the move and the mark applied: the call is %s, %d undo marks, and its undo would run", i, got.Status, got.UndoMarks)
		case !moved[0] && !marked:
			t.Fatalf("round %d: neither the move nor the mark applied (MarkUndo found %s)", i, status)
		case moved[0] && (got.Status != processors.StatusFailed || got.UndoMarks != 0 || status != processors.StatusFailed):
			t.Fatalf("round %d: the move won; the call is %s, %d undo marks, MarkUndo found %s; want failed, 0, failed", i, got.Status, got.UndoMarks, status)
		case marked && (got.Status != processors.StatusOutcomeUnknown || got.UndoMarks != 1):
			t.Fatalf("round %d: the mark won; the call is %s, %d undo marks; want outcome_unknown, 1", i, got.Status, got.UndoMarks)
		}
	}
}
