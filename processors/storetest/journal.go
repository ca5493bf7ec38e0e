package storetest

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// journalTests are the contract of Completion.Journal and Settle.
func journalTests() []contractTest {
	return []contractTest{
		{"Journal/LoggedAtOnce", testJournalLoggedAtOnce},
		{"Journal/SettleNotLogged", testJournalSettleNotLogged},
		{"Journal/Stale", testJournalStale},
		{"Journal/StaleLimitCountsCalls", testJournalStaleLimitCountsCalls},
		{"Journal/Fenced", testJournalFenced},
		{"Journal/MovedOn", testJournalMovedOn},
		{"Journal/Shared", testJournalShared},
		{"Journal/MarkAfterRevert", testJournalMarkAfterRevert},
		{"Journal/Invalid", testJournalInvalid},
	}
}

func mustSettle(t *testing.T, s processors.Store, logged bool, journals ...string) {
	t.Helper()
	if err := s.Settle(t.Context(), journals, logged); err != nil {
		t.Fatalf("Settle(%q, logged %v) = %v; want nil", journals, logged, err)
	}
}

// completeJournaled admits k, logs the admission's events, claims it and
// completes it as succeeded (seq 4, from 2) under journal. It returns the
// record.
func completeJournaled(t *testing.T, s processors.Store, k ledger.CallKey, journal string) processors.Record {
	t.Helper()
	c := admitClaimed(t, s, k, "executor-1", longLease)
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 2})
	if applied := mustComplete(t, s, journaledCompletion(k, c.Epoch, journal)); !applied[0] {
		t.Fatalf("Complete(%v, journal %q) applied = false; want true", k, journal)
	}
	return mustGet(t, s, k)
}

func journaledCompletion(k ledger.CallKey, epoch int64, journal string) processors.Completion {
	return processors.Completion{
		Key: k, Epoch: epoch, Status: processors.StatusSucceeded, Attempt: 1, Result: []byte(`{"ok":true}`),
		Seq: 4, Outbox: []byte(`[{"seq":3},{"seq":4}]`), Journal: journal, From: 2,
	}
}

// testJournalLoggedAtOnce: a journaled completion is logged in the same
// write, stays so while its entry is young, and settling the entry as
// logged changes nothing in the record.
func testJournalLoggedAtOnce(t *testing.T, s processors.Store) {
	k, other := key("journal:logged"), key("journal:plain")
	done := completeJournaled(t, s, k, "step-1")
	if done.LoggedSeq != 4 || done.Unlogged() {
		t.Fatalf("after a journaled Complete: LoggedSeq %d Unlogged %v; want 4 false", done.LoggedSeq, done.Unlogged())
	}
	// A completion without a journal in the same kind of batch keeps the
	// old contract: unlogged until marked.
	c := admitClaimed(t, s, other, "executor-1", longLease)
	mustComplete(t, s, processors.Completion{Key: other, Epoch: c.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Seq: 4, Outbox: []byte("x")})
	if r := mustGet(t, s, other); r.LoggedSeq != 0 || !r.Unlogged() {
		t.Errorf("after a Complete without journal: LoggedSeq %d Unlogged %v; want 0 true", r.LoggedSeq, r.Unlogged())
	}

	// Young entry: not settled by a sweep with a long olderThan.
	if got := mustUnlogged(t, s, time.Hour, 100); len(got) != 0 {
		t.Errorf("Unlogged(1h) with a young journal entry = %v; want none", keysOf(got))
	}
	checkUnchanged(t, s, k, done)

	mustSettle(t, s, true, "step-1")
	checkUnchanged(t, s, k, done)
	// The entry is gone: however old it would be, no sweep reverts it.
	waitUnlogged(t, s, []ledger.CallKey{other})
	checkUnchanged(t, s, k, done)
	// Settling again, or a name never written, is no error.
	mustSettle(t, s, true, "step-1", "never-written")
	mustSettle(t, s, false, "step-1", "never-written")
	checkUnchanged(t, s, k, done)
}

// testJournalSettleNotLogged: an entry settled as not logged puts each
// call back to LoggedSeq = From, and nothing else moves (UpdatedAt
// included: Unlogged's grace counts from the completion).
func testJournalSettleNotLogged(t *testing.T, s processors.Store) {
	k := key("journal:aborted")
	done := completeJournaled(t, s, k, "step-aborted")
	mustSettle(t, s, false, "step-aborted")
	want := done
	want.LoggedSeq = 2
	checkUnchanged(t, s, k, want)
	if r := mustGet(t, s, k); !r.Unlogged() {
		t.Errorf("Unlogged() after Settle(not logged) = false; want true")
	}
	got := waitUnlogged(t, s, []ledger.CallKey{k})
	if diff := cmp.Diff(want, got[0], equateEmpty); diff != "" {
		t.Errorf("Unlogged record after the revert (-want +got):\n%s", diff)
	}
	// The entry went with the revert: once the events are appended and
	// marked, settling the name again reverts nothing.
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 4})
	mustSettle(t, s, false, "step-aborted")
	if r := mustGet(t, s, k); r.LoggedSeq != 4 {
		t.Errorf("LoggedSeq after a second Settle(not logged) = %d; want 4", r.LoggedSeq)
	}
}

// testJournalStale: an entry its writer never settled is settled as not
// logged by Unlogged once older than olderThan, and its calls are listed
// in that same sweep.
func testJournalStale(t *testing.T, s processors.Store) {
	k := key("journal:stale")
	done := completeJournaled(t, s, k, "step-crashed")
	got := waitUnlogged(t, s, []ledger.CallKey{k})
	want := done
	want.LoggedSeq = 2
	if diff := cmp.Diff(want, got[0], equateEmpty); diff != "" {
		t.Errorf("Unlogged record of a stale entry (-want +got):\n%s", diff)
	}
	checkUnchanged(t, s, k, want)
	// The writer was only slow: its late settle finds no entry, and the
	// record stays unlogged (appending again is safe; losing is not).
	mustSettle(t, s, true, "step-crashed")
	checkUnchanged(t, s, k, want)
}

// testJournalStaleLimitCountsCalls: a sweep settles stale entries oldest
// first until they list limit calls, not limit entries, and always one at
// least.
func testJournalStaleLimitCountsCalls(t *testing.T, s processors.Store) {
	entries := []string{"step-1", "step-2", "step-3"}
	byEntry := map[string][]ledger.CallKey{}
	for _, e := range entries {
		for i := range 2 {
			k := key(fmt.Sprintf("journal:limit:%s:%d", e, i))
			completeJournaled(t, s, k, e)
			byEntry[e] = append(byEntry[e], k)
		}
	}
	// Each entry holds two calls; all three stale once this has passed.
	time.Sleep(2 * unloggedAge)
	check := func(after string, reverted map[string]bool) {
		t.Helper()
		for _, e := range entries {
			want := int64(4)
			if reverted[e] {
				want = 2
			}
			for _, k := range byEntry[e] {
				if r := mustGet(t, s, k); r.LoggedSeq != want {
					t.Errorf("after %s: Get(%v).LoggedSeq = %d; want %d (entry %s reverted: %v)", after, k, r.LoggedSeq, want, e, reverted[e])
				}
			}
		}
	}
	// Limit 3: step-1 lists 2 calls (under 3), so step-2 is taken too;
	// then 4 calls are listed and step-3 waits.
	mustUnlogged(t, s, unloggedAge, 3)
	check("Unlogged(limit 3)", map[string]bool{"step-1": true, "step-2": true})
	// Limit 1, under one entry's calls: one entry all the same.
	mustUnlogged(t, s, unloggedAge, 1)
	check("Unlogged(limit 1)", map[string]bool{"step-1": true, "step-2": true, "step-3": true})
}

// testJournalFenced: an entry lists a completion that was fenced out;
// settling it as not logged leaves the record alone, for the revert
// matches only the epoch that applied.
func testJournalFenced(t *testing.T, s processors.Store) {
	k := key("journal:fenced")
	c := admitClaimed(t, s, k, "executor-1", longLease)
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 2})
	if applied := mustComplete(t, s, journaledCompletion(k, c.Epoch+1, "step-fenced")); applied[0] {
		t.Fatalf("Complete(epoch %d of a record at %d) applied = true; want false", c.Epoch+1, c.Epoch)
	}
	if r := mustGet(t, s, k); r.LoggedSeq != 2 || r.Status != processors.StatusExecuting {
		t.Fatalf("after a fenced journaled Complete: status %q LoggedSeq %d; want executing 2", r.Status, r.LoggedSeq)
	}
	if applied := mustComplete(t, s, journaledCompletion(k, c.Epoch, "step-applied")); !applied[0] {
		t.Fatalf("Complete(current epoch) applied = false; want true")
	}
	done := mustGet(t, s, k)
	mustSettle(t, s, false, "step-fenced")
	checkUnchanged(t, s, k, done)
	mustSettle(t, s, false, "step-applied")
	if r := mustGet(t, s, k); r.LoggedSeq != 2 {
		t.Errorf("LoggedSeq after settling the applied entry as not logged = %d; want 2", r.LoggedSeq)
	}
}

// testJournalMovedOn: a record that moved on after its completion (an
// unknown outcome resolved, the held events kept in the outbox) goes
// back to From too, whether or not the move's events were marked logged
// since: its mover appended only what the mark made in advance left
// out, so the completion's events may be missing still.
func testJournalMovedOn(t *testing.T, s processors.Store) {
	for _, marked := range []bool{false, true} {
		k := key(fmt.Sprintf("journal:moved:%v", marked))
		c := admitClaimed(t, s, k, "executor-1", longLease)
		mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 2})
		comp := journaledCompletion(k, c.Epoch, "step-unknown")
		comp.Status = processors.StatusOutcomeUnknown
		mustComplete(t, s, comp)
		m := processors.Move{Key: k, From: processors.StatusOutcomeUnknown, FromSeq: 4, To: processors.StatusSucceeded, Seq: 5, Outbox: []byte(`[{"seq":3},{"seq":4},{"seq":5}]`)}
		if applied := mustMove(t, s, m); !applied[0] {
			t.Fatalf("Move(outcome_unknown -> succeeded) applied = false; want true")
		}
		if marked {
			mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 5})
		}
		want := mustGet(t, s, k)
		mustSettle(t, s, false, "step-unknown")
		want.LoggedSeq = 2
		checkUnchanged(t, s, k, want)
	}
}

// testJournalShared: completions of two batches under one name share an
// entry, and one settle reverts them all.
func testJournalShared(t *testing.T, s processors.Store) {
	k1, k2 := key("journal:shared:1"), key("journal:shared:2")
	completeJournaled(t, s, k1, "step-shared")
	completeJournaled(t, s, k2, "step-shared")
	mustSettle(t, s, false, "step-shared")
	for _, k := range []ledger.CallKey{k1, k2} {
		if r := mustGet(t, s, k); r.LoggedSeq != 2 {
			t.Errorf("Get(%v).LoggedSeq after settling the shared entry = %d; want 2", k, r.LoggedSeq)
		}
	}
}

// testJournalMarkAfterRevert: a mover read the record logged in advance,
// appended only its own event, and marks it logged; a revert came in
// between. The mark's Base (what the mover read) keeps it from covering
// the completion's events, which the sweep must still append. A mark
// from what the revert left applies.
func testJournalMarkAfterRevert(t *testing.T, s processors.Store) {
	k := key("journal:mark-after-revert")
	c := admitClaimed(t, s, k, "executor-1", longLease)
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 2})
	comp := journaledCompletion(k, c.Epoch, "step-died")
	comp.Status = processors.StatusOutcomeUnknown
	mustComplete(t, s, comp)
	read := mustGet(t, s, k)
	m := processors.Move{Key: k, From: processors.StatusOutcomeUnknown, FromSeq: 4, To: processors.StatusParked, Seq: 5, Outbox: []byte(`[{"seq":3},{"seq":4},{"seq":5}]`)}
	if applied := mustMove(t, s, m); !applied[0] {
		t.Fatalf("Move(outcome_unknown -> parked) applied = false; want true")
	}
	mustSettle(t, s, false, "step-died")
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 5, Base: read.LoggedSeq})
	if r := mustGet(t, s, k); r.LoggedSeq != 2 || !r.Unlogged() {
		t.Errorf("after a mark based on %d over a revert to 2: LoggedSeq %d Unlogged %v; want 2 true", read.LoggedSeq, r.LoggedSeq, r.Unlogged())
	}
	// In one batch, the highest mark of a key decides, with its base.
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 3, Base: 0}, processors.Logged{Key: k, Seq: 5, Base: 4})
	if r := mustGet(t, s, k); r.LoggedSeq != 2 {
		t.Errorf("after a batch whose highest mark is based past the record: LoggedSeq %d; want 2", r.LoggedSeq)
	}
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 5, Base: 2})
	if r := mustGet(t, s, k); r.LoggedSeq != 5 || r.Unlogged() {
		t.Errorf("after a mark based on 2: LoggedSeq %d Unlogged %v; want 5 false", r.LoggedSeq, r.Unlogged())
	}
}

// testJournalInvalid: a journaled completion must say where its events
// start, before its seq.
func testJournalInvalid(t *testing.T, s processors.Store) {
	k := key("journal:invalid")
	c := admitClaimed(t, s, k, "executor-1", longLease)
	for _, from := range []int64{-1, 4, 5} {
		comp := journaledCompletion(k, c.Epoch, "step-invalid")
		comp.From = from
		if _, err := s.Complete(t.Context(), []processors.Completion{comp}); !errors.Is(err, processors.ErrRejected) {
			t.Errorf("Complete(journaled, from %d, seq 4) = %v; want ErrRejected", from, err)
		}
	}
	checkUnchanged(t, s, k, c)
}
