package storetest

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// unansweredTests are the contract of NoteUnanswered: what the
// reconcilers noted of a call whose status lookups do not answer outlives
// any one of them, holds at the call's step alone, and merges the notes
// of reconcilers that race.
func unansweredTests() []contractTest {
	return []contractTest{
		{"Unanswered/Merged", testUnansweredMerged},
		{"Unanswered/Forgotten", testUnansweredForgotten},
		{"Unanswered/FencesMoves", testUnansweredFencesMoves},
		{"Unanswered/Stale", testUnansweredStale},
		{"Unanswered/Missing", testUnansweredMissing},
		{"Concurrent/NoteUnanswered", testConcurrentNoteUnanswered},
	}
}

// unansweredAt is a time of a note: microseconds, the precision of
// PostgreSQL and CockroachDB.
func unansweredAt(minutes int) time.Time {
	return time.Date(2031, 5, 6, 7, 0, 0, 654321000, time.UTC).Add(time.Duration(minutes) * time.Minute)
}

// mustNoteUnanswered is NoteUnanswered failing t on an error.
func mustNoteUnanswered(t *testing.T, s processors.Store, k ledger.CallKey, n processors.Unanswered) (processors.Unanswered, bool) {
	t.Helper()
	got, ok, err := s.NoteUnanswered(t.Context(), k, n)
	if err != nil {
		t.Fatalf("NoteUnanswered(%v, %+v) = %v", k, n, err)
	}
	return got, ok
}

// testUnansweredMerged: notes of the call's step merge (the earliest
// Since, InProgress once said), a zero Since forgets, and nothing else of
// the record changes (not UpdatedAt: the call took no step).
func testUnansweredMerged(t *testing.T, s processors.Store) {
	k := key("unanswered:merged")
	before := completeUnlogged(t, s, k, processors.StatusOutcomeUnknown)
	if _, ok := before.UnansweredAt(); ok || before.Unanswered != (processors.Unanswered{}) {
		t.Fatalf("a new record's note = %+v; want none", before.Unanswered)
	}
	seq := before.Seq
	steps := []struct {
		name string
		n    processors.Unanswered
		want processors.Unanswered
	}{
		{"first", processors.Unanswered{Seq: seq, Since: unansweredAt(1)}, processors.Unanswered{Seq: seq, Since: unansweredAt(1)}},
		{"earlier", processors.Unanswered{Seq: seq, Since: unansweredAt(0)}, processors.Unanswered{Seq: seq, Since: unansweredAt(0)}},
		{"later, in progress", processors.Unanswered{Seq: seq, Since: unansweredAt(2), InProgress: true}, processors.Unanswered{Seq: seq, Since: unansweredAt(0), InProgress: true}},
		{"later, not in progress", processors.Unanswered{Seq: seq, Since: unansweredAt(3)}, processors.Unanswered{Seq: seq, Since: unansweredAt(0), InProgress: true}},
		// An answer forgets when the failures began, not that the tool
		// said the call is in progress.
		{"answered", processors.Unanswered{Seq: seq}, processors.Unanswered{Seq: seq, InProgress: true}},
		{"failing again", processors.Unanswered{Seq: seq, Since: unansweredAt(5)}, processors.Unanswered{Seq: seq, Since: unansweredAt(5), InProgress: true}},
	}
	for _, st := range steps {
		got, ok := mustNoteUnanswered(t, s, k, st.n)
		if !ok || !got.Since.Equal(st.want.Since) || got.Seq != st.want.Seq || got.InProgress != st.want.InProgress {
			t.Errorf("%s: NoteUnanswered(%+v) = %+v, %v; want %+v, true", st.name, st.n, got, ok, st.want)
		}
		rec := mustGet(t, s, k)
		if diff := cmp.Diff(st.want, rec.Unanswered); diff != "" {
			t.Errorf("%s: the record's note (-want +got):\n%s", st.name, diff)
		}
		if note, ok := rec.UnansweredAt(); ok != (st.want != processors.Unanswered{}) || note != st.want {
			t.Errorf("%s: UnansweredAt() = %+v, %v; want %+v", st.name, note, ok, st.want)
		}
		want := before
		want.Unanswered = st.want
		checkUnchanged(t, s, k, want)
	}
}

// testUnansweredForgotten: an answer to a note that never heard "in
// progress" leaves nothing noted, and the next failure starts afresh.
func testUnansweredForgotten(t *testing.T, s processors.Store) {
	k := key("unanswered:forgotten")
	seq := completeUnlogged(t, s, k, processors.StatusOutcomeUnknown).Seq
	mustNoteUnanswered(t, s, k, processors.Unanswered{Seq: seq, Since: unansweredAt(0)})
	if got, ok := mustNoteUnanswered(t, s, k, processors.Unanswered{Seq: seq}); !ok || got != (processors.Unanswered{}) {
		t.Errorf("NoteUnanswered(answered) = %+v, %v; want nothing noted, true", got, ok)
	}
	rec := mustGet(t, s, k)
	if note, ok := rec.UnansweredAt(); ok || rec.Unanswered != (processors.Unanswered{}) {
		t.Errorf("after the answer the record notes %+v (UnansweredAt %+v, %v); want nothing", rec.Unanswered, note, ok)
	}
	want := processors.Unanswered{Seq: seq, Since: unansweredAt(9)}
	if got, ok := mustNoteUnanswered(t, s, k, want); !ok || got != want {
		t.Errorf("NoteUnanswered after the answer = %+v, %v; want %+v (its own Since, not the forgotten one)", got, ok, want)
	}
}

// testUnansweredFencesMoves: a move that carries UnlessInProgress does
// not apply once the note of its step says "in progress"; one without,
// or over a note that does not say so, does.
func testUnansweredFencesMoves(t *testing.T, s processors.Store) {
	park := func(rec processors.Record, unless bool) processors.Move {
		return processors.Move{Key: rec.Key, From: processors.StatusOutcomeUnknown, FromSeq: rec.Seq, FromUndoMarks: rec.UndoMarks,
			To: processors.StatusParked, Seq: rec.Seq + 1, Outbox: []byte(fmt.Sprintf(`[{"seq":%d}]`, rec.Seq+1)), UnlessInProgress: unless}
	}
	for _, tc := range []struct {
		name       string
		inProgress bool
		unless     bool
		applies    bool
	}{
		{"in progress, fenced", true, true, false},
		{"in progress, not fenced", true, false, true},
		{"failing, fenced", false, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := key("unanswered:fence:" + tc.name)
			rec := completeUnlogged(t, s, k, processors.StatusOutcomeUnknown)
			mustNoteUnanswered(t, s, k, processors.Unanswered{Seq: rec.Seq, Since: unansweredAt(0), InProgress: tc.inProgress})
			noted := mustGet(t, s, k)
			if applied := mustMove(t, s, park(rec, tc.unless)); applied[0] != tc.applies {
				t.Fatalf("Move(UnlessInProgress %v) over a note in progress %v applied = %v; want %v", tc.unless, tc.inProgress, applied[0], tc.applies)
			}
			if !tc.applies {
				checkUnchanged(t, s, k, noted)
			}
		})
	}
	// A note of an earlier step fences nothing.
	k := key("unanswered:fence:stale")
	rec := completeUnlogged(t, s, k, processors.StatusOutcomeUnknown)
	mustNoteUnanswered(t, s, k, processors.Unanswered{Seq: rec.Seq, Since: unansweredAt(0), InProgress: true})
	if applied := mustMove(t, s, park(rec, false)); !applied[0] {
		t.Fatal("Move to parked applied = false; want true")
	}
	parked := mustGet(t, s, k)
	resolve := processors.Move{Key: k, From: processors.StatusParked, FromSeq: parked.Seq, FromUndoMarks: parked.UndoMarks,
		To: processors.StatusFailed, Seq: parked.Seq + 1, Outbox: []byte(fmt.Sprintf(`[{"seq":%d}]`, parked.Seq+1)), UnlessInProgress: true}
	if applied := mustMove(t, s, resolve); !applied[0] {
		t.Errorf("a fenced Move over a note of the step before applied = false; want true")
	}
}

// testUnansweredStale: a note is of the step it names: once the call
// moved on it notes nothing, a note of the old step is not written, and
// one of the new step replaces it whole (neither its Since nor its
// InProgress carried over).
func testUnansweredStale(t *testing.T, s processors.Store) {
	k := key("unanswered:stale")
	rec := completeUnlogged(t, s, k, processors.StatusOutcomeUnknown)
	old := rec.Seq
	mustNoteUnanswered(t, s, k, processors.Unanswered{Seq: old, Since: unansweredAt(0), InProgress: true})
	park := processors.Move{Key: k, From: processors.StatusOutcomeUnknown, FromSeq: old, FromUndoMarks: rec.UndoMarks,
		To: processors.StatusParked, Seq: old + 1, Outbox: []byte(fmt.Sprintf(`[{"seq":%d}]`, old+1))}
	if applied := mustMove(t, s, park); !applied[0] {
		t.Fatal("Move to parked applied = false; want true")
	}
	moved := mustGet(t, s, k)
	if note, ok := moved.UnansweredAt(); ok {
		t.Errorf("after the call moved on, UnansweredAt() = %+v, true; want nothing noted", note)
	}
	if got, ok := mustNoteUnanswered(t, s, k, processors.Unanswered{Seq: old, Since: unansweredAt(1)}); ok {
		t.Errorf("NoteUnanswered of the old step = %+v, true; want not written", got)
	}
	checkUnchanged(t, s, k, moved)
	want := processors.Unanswered{Seq: old + 1, Since: unansweredAt(7)}
	if got, ok := mustNoteUnanswered(t, s, k, want); !ok || got != want {
		t.Errorf("NoteUnanswered of the new step = %+v, %v; want %+v, true (the old note's Since and InProgress not carried over)", got, ok, want)
	}
	after := mustGet(t, s, k)
	if note, ok := after.UnansweredAt(); !ok || note != want {
		t.Errorf("UnansweredAt() = %+v, %v; want %+v", note, ok, want)
	}
}

// testUnansweredMissing: a note of no record is ErrNotFound, and creates
// none.
func testUnansweredMissing(t *testing.T, s processors.Store) {
	k := key("unanswered:missing")
	if _, _, err := s.NoteUnanswered(t.Context(), k, processors.Unanswered{Seq: 4, Since: unansweredAt(0)}); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("NoteUnanswered(missing) = %v; want ErrNotFound", err)
	}
	if _, err := s.Get(t.Context(), k); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("Get after NoteUnanswered(missing) = %v; want ErrNotFound", err)
	}
}

// testConcurrentNoteUnanswered: reconcilers noting one call at once
// lose none of their notes: the earliest Since stands, and the one that
// was told the call is in progress is heard.
func testConcurrentNoteUnanswered(t *testing.T, s processors.Store) {
	const n = 12
	k := key("race-unanswered")
	seq := completeUnlogged(t, s, k, processors.StatusOutcomeUnknown).Seq
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			// The earliest is in the middle, the one in progress last.
			since := unansweredAt((i + n/2) % n)
			if _, _, err := s.NoteUnanswered(t.Context(), k, processors.Unanswered{Seq: seq, Since: since, InProgress: i == n-1}); err != nil {
				t.Errorf("NoteUnanswered #%d = %v", i, err)
			}
		})
	}
	wg.Wait()
	want := processors.Unanswered{Seq: seq, Since: unansweredAt(0), InProgress: true}
	if got := mustGet(t, s, k).Unanswered; got != want {
		t.Errorf("after %d notes at once, the record's note = %+v; want %+v", n, got, want)
	}
}
