package ledger_test

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

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
