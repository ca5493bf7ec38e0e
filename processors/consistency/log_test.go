package consistency

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
)

// TestReadLogAborted writes committed and aborted transactions from two
// producers, interleaved on one partition, and checks that ReadLog finds
// every aborted record, that a real read_committed read returns none of
// them, and that a read_uncommitted reader returns all of them (so that
// AbortedVisible fails for it).
func TestReadLogAborted(t *testing.T) {
	t.Parallel()
	k := newKafka(t, 2)
	topic := k.Topics.Events
	a, b := producer(t, k, "a"), producer(t, k, "b")
	plain := producer(t, k, "")

	// The interleaved calls share partitions: b1 and a2 partition 0, a3
	// and b2 partition 1.
	for _, pair := range [][2]string{{"b1", "a2"}, {"a3", "b2"}} {
		p0, p1 := ledger.PartitionFor([]byte(key(pair[0]).String()), 2), ledger.PartitionFor([]byte(key(pair[1]).String()), 2)
		if p0 != p1 {
			t.Fatalf("%s and %s on partitions %d and %d; want one", pair[0], pair[1], p0, p1)
		}
	}
	committed := map[string]int{} // call -> committed events
	// A commits a whole call.
	txn(t, a, true, records(t, topic, history(key("a1"), time.Second, succeeded...)))
	committed["a1"] = 4
	// B opens a transaction, A commits another call meanwhile, B aborts:
	// B's records straddle A's.
	begin(t, b)
	produce(t, b, records(t, topic, history(key("b1"), time.Second, req, auth)))
	txn(t, a, true, records(t, topic, history(key("a2"), time.Second, req, auth)))
	committed["a2"] = 2
	produce(t, b, records(t, topic, history(key("a1"), time.Second, req)))
	end(t, b, false)
	// A writes outside a transaction (idempotent only): committed.
	produce(t, plain, records(t, topic, history(key("p1"), time.Second, req)))
	committed["p1"] = 1
	// A aborts a whole transaction after B's next one commits.
	begin(t, a)
	produce(t, a, records(t, topic, history(key("a3"), time.Second, succeeded...)))
	txn(t, b, true, records(t, topic, history(key("b2"), time.Second, req, denied)))
	committed["b2"] = 2
	end(t, a, false)
	const aborted = 3 + 4 // b1's two and a1's one from B, a3's four from A

	l := readLogT(t, k, readOpts{})
	if l.AbortedRecords != aborted || l.AbortedVisible != 0 || l.HiddenRecords != 0 || l.UnstableRecords != 0 || l.Undecodable != 0 {
		t.Errorf("ReadLog = aborted %d, visible %d, hidden %d, unstable %d, undecodable %d; want %d, 0, 0, 0, 0",
			l.AbortedRecords, l.AbortedVisible, l.HiddenRecords, l.UnstableRecords, l.Undecodable, aborted)
	}
	if l.Partitions != 2 || l.Events != 9 {
		t.Errorf("ReadLog = %d partitions, %d events; want 2, 9", l.Partitions, l.Events)
	}
	got := map[string]int{}
	for ck, c := range l.calls {
		got[ck.IdempotencyKey] = len(c.events)
	}
	if diff := cmp.Diff(committed, got); diff != "" {
		t.Errorf("committed events per call (-want +got):\n%s", diff)
	}
	// a1 is whole and clean: B's aborted requested at seq 1 is neither a
	// duplicate nor a conflict.
	effects := []demobackend.Effect{{Tool: "create_ticket", TenantID: "t1", IdempotencyKey: "t1/a1"}}
	if r := Check(l, nil, effects); len(r.Failures()) != 0 || r.DuplicateEvents != 0 || r.Calls != 4 {
		t.Errorf("Check = failures %q, %d duplicate events, %d calls; want none, 0, 4", r.Failures(), r.DuplicateEvents, r.Calls)
	}

	// The aborted set is real: a read_committed consumer of its own never
	// returns one of its offsets, a read_uncommitted one returns them all.
	var n int
	for _, offs := range l.aborted {
		n += len(offs)
	}
	if n != aborted {
		t.Fatalf("aborted offsets = %v; want %d of them", l.aborted, aborted)
	}
	rc, ru := offsets(t, k, kgo.ReadCommitted()), offsets(t, k, kgo.ReadUncommitted())
	for p, offs := range l.aborted {
		for _, o := range offs {
			if slices.Contains(rc[p], o) {
				t.Errorf("read_committed returned aborted record %d/%d", p, o)
			}
			if !slices.Contains(ru[p], o) {
				t.Errorf("read_uncommitted did not return aborted record %d/%d", p, o)
			}
		}
	}
	var committedN int
	for _, offs := range rc {
		committedN += len(offs)
	}
	if committedN != 9 {
		t.Errorf("read_committed returned %d records; want 9", committedN)
	}

	// A reader at read_uncommitted fails the check.
	lu := readLogT(t, k, readOpts{uncommitted: true})
	if lu.AbortedVisible != aborted || lu.AbortedRecords != aborted {
		t.Errorf("read_uncommitted: aborted %d, visible %d; want %d, %d", lu.AbortedRecords, lu.AbortedVisible, aborted, aborted)
	}
	r := Check(lu, nil, effects)
	if f := r.Failures(); len(f) != 1 || !strings.HasPrefix(f[0], "aborted_visible: 7 (") {
		t.Errorf("read_uncommitted: Failures() = %q; want aborted_visible: 7 only", f)
	}
	if len(r.Examples["aborted_visible"]) != aborted {
		t.Errorf("read_uncommitted: examples %q; want %d", r.Examples["aborted_visible"], aborted)
	}
	// Its aborted records are left out of the histories.
	if lu.Events != l.Events {
		t.Errorf("read_uncommitted kept %d events; want the %d committed", lu.Events, l.Events)
	}
}

// TestReadLogHidden: a reader that loses a committed record fails
// HiddenRecords.
func TestReadLogHidden(t *testing.T) {
	t.Parallel()
	k := newKafka(t, 1)
	a := producer(t, k, "a")
	txn(t, a, true, records(t, k.Topics.Events, history(key("c1"), time.Second, succeeded...)))
	txn(t, a, false, records(t, k.Topics.Events, history(key("c2"), time.Second, req)))

	l := readLogT(t, k, readOpts{})
	if l.HiddenRecords != 0 || l.Events != 4 {
		t.Fatalf("ReadLog = hidden %d, events %d; want 0, 4", l.HiddenRecords, l.Events)
	}
	// Lose c1's requested event (offset 0).
	lost := readLogT(t, k, readOpts{lose: func(r *kgo.Record) bool { return r.Offset == 0 }})
	if lost.HiddenRecords != 1 || lost.Events != 3 {
		t.Errorf("losing offset 0: hidden %d, events %d; want 1, 3", lost.HiddenRecords, lost.Events)
	}
	r := Check(lost, nil, nil)
	want := []string{
		"illegal_transitions: 1 (t1/c1 seq 2 authorized: seq gap: seq 2 after 0)",
		"hidden_records: 1 (0: 1 of 4 committed records below offset 7 not returned)",
	}
	if diff := cmp.Diff(want, r.Failures()); diff != "" {
		t.Errorf("Failures() (-want +got):\n%s", diff)
	}
}

// TestReadLogOpen: a transaction still open when ReadLog is called, and a
// committed record behind it, are left out and counted as unstable; once
// the transaction commits they are read.
func TestReadLogOpen(t *testing.T) {
	t.Parallel()
	k := newKafka(t, 1)
	topic := k.Topics.Events
	a, b := producer(t, k, "a"), producer(t, k, "b")
	plain := producer(t, k, "")
	txn(t, a, true, records(t, topic, history(key("x"), time.Second, req, denied)))
	begin(t, b)
	produce(t, b, records(t, topic, history(key("y"), time.Second, req, denied)))
	produce(t, plain, records(t, topic, history(key("z"), time.Second, req, denied)))

	// ReadLog must not wait for the open transaction.
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	l, err := ReadLog(ctx, k.Client, topic)
	if err != nil {
		t.Fatalf("ReadLog with an open transaction: %v", err)
	}
	if l.UnstableRecords != 4 || l.Events != 2 || l.AbortedRecords != 0 {
		t.Errorf("open: unstable %d, events %d, aborted %d; want 4, 2, 0", l.UnstableRecords, l.Events, l.AbortedRecords)
	}
	subs := []Submitted{{key("x"), base}, {key("y"), base}, {key("z"), base}}
	r := Check(l, subs, nil)
	wantF := []string{"lost: 2 (t1/y no event, t1/z no event)", "unstable_records: 4"}
	if diff := cmp.Diff(wantF, r.Failures()); diff != "" {
		t.Errorf("open: Failures() (-want +got):\n%s", diff)
	}

	end(t, b, true)
	l = readLogT(t, k, readOpts{})
	if l.UnstableRecords != 0 || l.Events != 6 {
		t.Errorf("committed: unstable %d, events %d; want 0, 6", l.UnstableRecords, l.Events)
	}
	r = Check(l, subs, nil)
	if f := r.Failures(); len(f) != 0 || r.Terminal != 3 {
		t.Errorf("committed: Failures() = %q, terminal %d; want none, 3", f, r.Terminal)
	}
}

// TestReadLogEmpty: an empty topic reads as an empty log; a missing topic
// is an error.
func TestReadLogEmpty(t *testing.T) {
	t.Parallel()
	k := newKafka(t, 3)
	l := readLogT(t, k, readOpts{})
	if l.Partitions != 3 || l.Events != 0 || len(l.calls) != 0 {
		t.Errorf("empty: %d partitions, %d events, %d calls; want 3, 0, 0", l.Partitions, l.Events, len(l.calls))
	}
	r := Check(l, []Submitted{{key("gone"), base}}, nil)
	if diff := cmp.Diff([]string{"lost: 1 (t1/gone no event)"}, r.Failures()); diff != "" {
		t.Errorf("empty: Failures() (-want +got):\n%s", diff)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if _, err := ReadLog(ctx, k.Client, "no.such.topic"); err == nil {
		t.Errorf("ReadLog(missing topic) = nil error; want one")
	}
}
