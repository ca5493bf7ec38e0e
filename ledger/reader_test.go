package ledger_test

import (
	"context"
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
