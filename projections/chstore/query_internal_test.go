package chstore

import (
	"testing"

	"github.com/toolcall-ledger/ledger/projections"
)

// A blast radius's list is cut when it holds more calls than the limit,
// whatever the total counted beside it says: a call that lands between
// the two queries made the list one longer than the total, and the
// answer passed for whole. Before, it was cut only when the total said.
func TestCutList(t *testing.T) {
	calls := make([]projections.Call, 4)
	for _, tc := range []struct {
		read, limit, total int
		want               int
		truncated          bool
	}{
		{4, 3, 3, 3, true}, // the extra call read; the counts, earlier, did not see it
		{3, 3, 5, 3, true}, // the counts say more
		{3, 3, 3, 3, false},
		{2, 3, 2, 2, false},
	} {
		got, truncated := cutList(calls[:tc.read], tc.limit, tc.total)
		if len(got) != tc.want || truncated != tc.truncated {
			t.Errorf("cutList(%d calls, limit %d, total %d) = %d calls, truncated %v; want %d, %v", tc.read, tc.limit, tc.total, len(got), truncated, tc.want, tc.truncated)
		}
	}
}
