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
