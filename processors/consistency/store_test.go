package consistency

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// storeRecords is a StoreReader over a map.
type storeRecords map[ledger.CallKey]processors.Status

func (m storeRecords) Get(_ context.Context, k ledger.CallKey) (processors.Record, error) {
	s, ok := m[k]
	if !ok {
		return processors.Record{}, processors.ErrNotFound
	}
	return processors.Record{Key: k, Status: s}, nil
}

// TestCheckStore: every call's record must say what its events fold to; a
// parked call's record says parked, and a key the log never admitted needs
// no record.
func TestCheckStore(t *testing.T) {
	ms := time.Millisecond
	good, parkedCall, wrong, missing, refusedOnly := key("good"), key("parked"), key("wrong"), key("missing"), key("never")
	log := memLog(slices.Concat(
		history(good, ms, succeeded...),
		history(parkedCall, ms, req, auth, exec, unknown, parked),
		history(wrong, ms, succeeded...),
		history(missing, ms, req, auth),
	)...)
	st := storeRecords{good: processors.StatusSucceeded, parkedCall: processors.StatusParked, wrong: processors.StatusExecuting}
	var subs []Submitted
	for _, k := range []ledger.CallKey{good, parkedCall, wrong, missing, refusedOnly} {
		subs = append(subs, Submitted{Key: k, At: base})
	}
	if diff := cmp.Diff(Outcome{State: "outcome_unknown", Seq: 5, Parked: true}, log.Outcome(parkedCall)); diff != "" {
		t.Errorf("Outcome(parked) (-want +got):\n%s", diff)
	}
	if got := log.Outcome(refusedOnly); got != (Outcome{}) {
		t.Errorf("Outcome of a key the log never saw = %+v; want the zero Outcome", got)
	}
	r := Check(log, subs, nil)
	if err := CheckStore(t.Context(), &r, log, subs, st); err != nil {
		t.Fatal(err)
	}
	if r.StoreChecked != 4 || r.StoreDisagreements != 2 {
		t.Errorf("checked %d, disagreements %d; want 4, 2", r.StoreChecked, r.StoreDisagreements)
	}
	want := []string{"t1/missing no record, log authorized", "t1/wrong store executing, log succeeded"}
	if diff := cmp.Diff(want, r.Examples["store_disagreements"]); diff != "" {
		t.Errorf("examples (-want +got):\n%s", diff)
	}
	if !slices.ContainsFunc(r.Failures(), func(f string) bool { return strings.HasPrefix(f, "store_disagreements: 2") }) {
		t.Errorf("Failures() = %q; want store_disagreements among them", r.Failures())
	}
}
