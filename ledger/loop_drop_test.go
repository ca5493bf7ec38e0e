package ledger

import (
	"errors"
	"fmt"
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Which poll errors make the loop start a new session: those that may
// mean franz-go went on without the partition, and no others (a restart
// costs the transaction and a rejoin).
func TestPartitionDropped(t *testing.T) {
	for _, tc := range []struct {
		name  string
		topic string
		err   error
		want  bool
	}{
		{"offsets not authorized", "requests", kerr.TopicAuthorizationFailed, true},
		{"offsets omitted by the coordinator", "requests", errors.New("broker repeatedly omitted a requested partition from an OffsetFetch response"), true},
		{"a batch that does not decode", "requests", errors.New("invalid compression codec"), false},
		{"wrapped", "requests", fmt.Errorf("fetch: %w", kerr.GroupAuthorizationFailed), true},
		{"retriable", "requests", kerr.NotLeaderForPartition, false},
		{"data loss, consumption goes on", "requests", &kgo.ErrDataLoss{Topic: "requests", Partition: 1, ConsumedTo: 9, ResetTo: 5}, false},
		{"the group's, franz-go rejoins", "", &kgo.ErrGroupSession{Err: kerr.RebalanceInProgress}, false},
		{"the group's, not retriable", "", kerr.GroupAuthorizationFailed, false},
	} {
		if got := partitionDropped(tc.topic, tc.err); got != tc.want {
			t.Errorf("%s: partitionDropped(%q, %v) = %v; want %v", tc.name, tc.topic, tc.err, got, tc.want)
		}
	}
}

// A poll makes the loop linger when it holds LingerFrom records the step
// acts on; LingerFrom 0 is 1, as documented: a poll of records the step
// ignores (an executor's own events) never lingers. Before, 0 lingered on
// every poll that returned anything.
func TestLingersOnRecordsTheStepActsOn(t *testing.T) {
	acts := func(r *kgo.Record) bool { return string(r.Value) == "acted" }
	ignored, acted := &kgo.Record{Value: []byte("ignored")}, &kgo.Record{Value: []byte("acted")}
	for _, tc := range []struct {
		from int
		acts func(*kgo.Record) bool
		recs []*kgo.Record
		want bool
	}{
		{0, acts, []*kgo.Record{ignored, ignored}, false},
		{1, acts, []*kgo.Record{ignored, ignored}, false},
		{0, acts, []*kgo.Record{ignored, acted}, true},
		{2, acts, []*kgo.Record{acted, ignored}, false},
		{2, acts, []*kgo.Record{acted, ignored, acted}, true},
		{0, nil, nil, false},
		{0, nil, []*kgo.Record{ignored}, true},
		{2, nil, []*kgo.Record{ignored}, false},
	} {
		l := &Loop{cfg: LoopConfig{LingerFrom: tc.from, Acts: tc.acts}}
		if got := l.lingers(tc.recs); got != tc.want {
			t.Errorf("LingerFrom %d, Acts set %v, %d records: lingers = %v; want %v", tc.from, tc.acts != nil, len(tc.recs), got, tc.want)
		}
	}
}
