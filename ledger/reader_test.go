package ledger_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// ReadCall returns a call's events once each, though the log holds some
// twice (an outbox appended again: an approval that finds the intake's
// events not yet marked logged publishes them with its own), and keeps
// distinct events that share a seq (refused submissions, seq 0).
func TestReadCallDropsCopies(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}
	at := time.Date(2026, 12, 3, 7, 0, 0, 0, time.UTC)
	ev := func(id string, seq int64, typ statemachine.EventType) ledger.Event {
		return ledger.Event{EventID: id, Seq: seq, Type: typ, At: at, TenantID: key.TenantID, IdempotencyKey: key.IdempotencyKey,
			CallID: "c1", Tool: "refund_order", ToolVersion: 1, ArgumentsHash: "sha256:00"}
	}
	requested, pending := ev("e1", 1, statemachine.EventRequested), ev("e2", 2, statemachine.EventApprovalPending)
	approved := ev("e3", 3, statemachine.EventApproved)
	refusedA, refusedB := ev("r1", 0, statemachine.EventRejected), ev("r2", 0, statemachine.EventRejected)
	var recs []*kgo.Record
	for _, e := range []ledger.Event{refusedA, requested, pending, refusedB, requested, pending, approved} {
		r, err := e.Record(k.Topics.Events)
		if err != nil {
			t.Fatal(err)
		}
		recs = append(recs, r)
	}
	// Placed as the ledger's producers place them.
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	evs, err := ledger.ReadCall(t.Context(), k.Client, k.Topics.Events, key)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range evs {
		got = append(got, e.EventID)
	}
	if diff := cmp.Diff([]string{"r1", "e1", "e2", "r2", "e3"}, got); diff != "" {
		t.Errorf("events read (-want +got):\n%s", diff)
	}
}

// A key whose partition was emptied up to its end (retention deleted
// every record, or a DeleteRecords) has no events: ReadCall says so at
// once. Before, it fetched from the log's start, which held nothing and
// would never hold what it waited for, until its context ended (ledger
// trace, whose context has no deadline, hung).
func TestReadCallOfAnEmptiedPartition(t *testing.T) {
	readEmptied(t, ledgertest.New(t, ledgertest.Options{Partitions: 1}))
}

// Nor when the records go after the reader listed where the log starts
// (retention, a DeleteRecords, meanwhile: here, its listing answered as
// before they went): franz-go resumes the partition at its new start in
// silence, and no record came to move the reader past the part deleted.
// It waited for good (ledger dlq, ledger trace hung with nothing to say).
func TestReadCallOfAPartitionEmptiedMeanwhile(t *testing.T) {
	k := ledgertest.NewInProcess(t, ledgertest.Options{Partitions: 1})
	readEmptied(t, k, func() { k.Cluster.ControlKey(int16(kmsg.ListOffsets), ledgertest.StaleStartOffsets) })
}

// readEmptied writes two events of a call, deletes them, runs then (if
// any), and reads the call, which must end at once with none.
func readEmptied(t *testing.T, k *ledgertest.Kafka, then ...func()) {
	t.Helper()
	key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "gone"}
	e := ledger.Event{EventID: "e1", Seq: 1, Type: statemachine.EventRequested, At: time.Now().UTC(), TenantID: key.TenantID,
		IdempotencyKey: key.IdempotencyKey, CallID: "c1", Tool: "refund_order", ToolVersion: 1, ArgumentsHash: "sha256:00"}
	r, err := e.Record(k.Topics.Events)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.ProduceSync(t.Context(), r, r).FirstErr(); err != nil {
		t.Fatal(err)
	}
	adm := kadm.NewClient(cl)
	ends, err := adm.ListEndOffsets(t.Context(), k.Topics.Events)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := adm.DeleteRecords(t.Context(), ends.Offsets()); err != nil {
		t.Fatal(err)
	}
	for _, f := range then {
		f()
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	evs, err := ledger.ReadCall(ctx, k.Client, k.Topics.Events, key)
	if err != nil || len(evs) != 0 {
		t.Errorf("ReadCall of an emptied partition = %d events, %v; want none, at once", len(evs), err)
	}
}

// CallBefore finds a call's events by reading its partition backwards
// from the given end: it stops at the call's last requested event, so
// that what lies before it is never read (here, a record under the key
// that does not decode, which a read from the log's start fails at), and
// it goes back in windows each twice as long as the one before until it
// finds that event, or reads the whole partition when there is none.
func TestCallBeforeReadsBackToTheCallsStart(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	at := time.Date(2026, 12, 8, 7, 0, 0, 0, time.UTC)
	produce := func(key ledger.CallKey, evs ...ledger.Event) {
		t.Helper()
		var recs []*kgo.Record
		for _, e := range evs {
			e.TenantID, e.IdempotencyKey, e.At = key.TenantID, key.IdempotencyKey, at
			r, err := e.Record(k.Topics.Events)
			if err != nil {
				t.Fatal(err)
			}
			recs = append(recs, r)
		}
		if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	refusals := func(prefix string, n int) []ledger.Event {
		evs := make([]ledger.Event, n)
		for i := range evs {
			evs[i] = ledger.Event{EventID: fmt.Sprintf("%s%d", prefix, i), Type: statemachine.EventDenied, CallID: "earlier", Reason: "rate_limited"}
		}
		return evs
	}
	step := func(id string, seq int64, typ statemachine.EventType) ledger.Event {
		return ledger.Event{EventID: id, Seq: seq, Type: typ, CallID: "c1", Tool: "create_ticket", ToolVersion: 1, ArgumentsHash: "sha256:00"}
	}
	end := func() int64 {
		t.Helper()
		ends, err := kadm.NewClient(cl).ListEndOffsets(t.Context(), k.Topics.Events)
		if err != nil {
			t.Fatal(err)
		}
		o, _ := ends.Lookup(k.Topics.Events, 0)
		return o.Offset
	}
	ids := func(evs []ledger.Event) []string {
		var got []string
		for _, e := range evs {
			got = append(got, e.EventID)
		}
		return got
	}

	// A call begun well past an unreadable record under its key, its
	// outbox appended a second time from its start.
	near := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "near"}
	if err := cl.ProduceSync(t.Context(), &kgo.Record{Topic: k.Topics.Events, Key: []byte(near.String()), Value: []byte("not an event")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	produce(near, refusals("r", 5000)...)
	produce(near, step("e1", 1, statemachine.EventRequested), step("e2", 2, statemachine.EventAuthorized),
		step("e1", 1, statemachine.EventRequested), step("e2", 2, statemachine.EventAuthorized),
		step("e3", 3, statemachine.EventExecuting), step("e4", 4, statemachine.EventSucceeded))
	if _, err := ledger.ReadCall(t.Context(), k.Client, k.Topics.Events, near); err == nil {
		t.Fatal("ReadCall read past the record that does not decode; the test needs it read from the start")
	}
	var reached []int64
	hi := end()
	evs, err := ledger.CallBefore(t.Context(), k.Client, k.Topics.Events, near, hi, func(o int64) { reached = append(reached, o) })
	if err != nil {
		t.Fatalf("CallBefore: %v", err)
	}
	if diff := cmp.Diff([]string{"e1", "e2", "e3", "e4"}, ids(evs)); diff != "" {
		t.Errorf("events of the call (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]int64{hi - 4096}, reached); diff != "" {
		t.Errorf("windows read from (-want +got):\n%s", diff)
	}

	// A call whose start lies three windows back, and a key with no call:
	// the whole partition is read.
	far := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "far"}
	produce(far, step("f1", 1, statemachine.EventRequested))
	start := end() - 1
	produce(far, refusals("s", 13000)...)
	produce(far, step("f2", 2, statemachine.EventDenied))
	reached, hi = nil, end()
	evs, err = ledger.CallBefore(t.Context(), k.Client, k.Topics.Events, far, hi, func(o int64) { reached = append(reached, o) })
	if err != nil {
		t.Fatalf("CallBefore: %v", err)
	}
	if got := ids(evs); len(got) != 13002 || got[0] != "f1" || got[13001] != "f2" {
		t.Errorf("events of the call: %d, from %v; want 13,002, from f1 to f2", len(got), got[:min(len(got), 3)])
	}
	if want := []int64{hi - 4096, hi - 4096 - 8192, max(hi-4096-8192-16384, 0)}; !cmp.Equal(want, reached) || reached[2] > start {
		t.Errorf("windows read from %v; want %v, the last at or before the call's start, %d", reached, want, start)
	}
	none := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "none"}
	produce(none, refusals("n", 3)...)
	reached = nil
	evs, err = ledger.CallBefore(t.Context(), k.Client, k.Topics.Events, none, end(), func(o int64) { reached = append(reached, o) })
	if err != nil || !cmp.Equal([]string{"n0", "n1", "n2"}, ids(evs)) || len(reached) == 0 || reached[len(reached)-1] != 0 {
		// The unreadable record is under another key: read, and passed over.
		t.Errorf("CallBefore of a key with no call = %v, %v, from %v; want its three refusals, read down to 0", ids(evs), err, reached)
	}
}
