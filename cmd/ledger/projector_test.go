package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/projections/projector"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// TestProjectorSkipDeleted: `ledger projector skip-deleted` moves a
// stopped projector's group past records the log deleted before they were
// projected (where the projector stops, ErrRecordsDeleted), and only
// there.
func TestProjectorSkipDeleted(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	group := k.Group("skip-deleted")
	ev := k.Topics.Events
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	for i := range 10 {
		e := ledger.Event{EventID: fmt.Sprintf("e-%d", i), Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(),
			TenantID: "t_a", IdempotencyKey: fmt.Sprintf("k-%d", i), Tool: "refund_order"}
		r, err := e.Record(ev)
		if err != nil {
			t.Fatal(err)
		}
		r.Partition = int32(i % 2) // offsets 0 to 4 on each partition
		recs = append(recs, r)
	}
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	adm := kadm.NewClient(cl)
	// Partition 0 committed at 1, then lost everything before 3; partition
	// 1 committed at 4, past what was lost (before 2).
	if err := projector.CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 1, 1: 4}}); err != nil {
		t.Fatal(err)
	}
	resps, err := adm.DeleteRecords(t.Context(), kadm.Offsets{ev: {
		0: {Topic: ev, Partition: 0, At: 3, LeaderEpoch: -1},
		1: {Topic: ev, Partition: 1, At: 2, LeaderEpoch: -1},
	}})
	if err == nil {
		err = resps.Error()
	}
	if err != nil {
		t.Fatalf("delete records: %v", err)
	}

	flags := []string{"--kafka-brokers", strings.Join(k.Client.Brokers, ","), "--topic-events", ev, "--topic-control", k.Topics.Control, "--group", group}
	out := cli(t, append([]string{"projector", "skip-deleted"}, flags...)...)
	if want := ev + "/0: offsets 1 to 2 were deleted before they were projected; the group goes on from 3"; !strings.Contains(out, want) || strings.Contains(out, ev+"/1") {
		t.Errorf("skip-deleted said:\n%s\nwant %q, and nothing of partition 1", out, want)
	}
	got, err := adm.FetchOffsets(t.Context(), group)
	if err != nil {
		t.Fatal(err)
	}
	for partition, want := range map[int32]int64{0: 3, 1: 4} {
		if o, _ := got.Lookup(ev, partition); o.At != want {
			t.Errorf("committed offset of %s/%d = %d; want %d", ev, partition, o.At, want)
		}
	}
	if out := cli(t, append([]string{"projector", "skip-deleted"}, flags...)...); !strings.Contains(out, "nothing to skip") {
		t.Errorf("skip-deleted again said:\n%s\nwant nothing to skip", out)
	}
}
