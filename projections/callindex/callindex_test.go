package callindex_test

import (
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/statemachine"
)

func ev(key string, seq int64, t statemachine.EventType, reason string) ledger.Event {
	return ledger.Event{
		EventID: key + "-" + string(rune('a'+seq)) + string(t), Type: t, Seq: seq,
		At: time.Unix(1700000000+seq, 0).UTC(), TenantID: "t_a", IdempotencyKey: key,
		ArgumentsHash: "sha256:00", Reason: reason, Attempt: 1,
	}
}

func TestIndexFoldsIdempotently(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index.db")
	ix, err := callindex.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	call := []ledger.Event{
		ev("k", 1, statemachine.EventRequested, ""),
		ev("k", 2, statemachine.EventAuthorized, ""),
		ev("k", 3, statemachine.EventExecuting, ""),
		ev("k", 4, statemachine.EventSucceeded, ""),
	}
	// At-least-once delivery: the first two events come twice, across
	// batches.
	if err := ix.Apply(call[:2]); err != nil {
		t.Fatal(err)
	}
	if err := ix.Apply(append(append([]ledger.Event{}, call[:2]...), call[2:]...)); err != nil {
		t.Fatal(err)
	}
	refusal := ev("k", 0, statemachine.EventDenied, "idempotency_key_reused")
	if err := ix.Apply([]ledger.Event{refusal, refusal}); err != nil {
		t.Fatal(err)
	}
	// A flood of refusals keeps the first MaxRefusals.
	var flood []ledger.Event
	for i := range callindex.MaxRefusals + 5 {
		r := refusal
		r.EventID = fmt.Sprintf("flood-%d", i)
		flood = append(flood, r)
	}
	if err := ix.Apply(flood); err != nil {
		t.Fatal(err)
	}
	// A gap is an anomaly, not a state change; the event stays in the
	// trace.
	if err := ix.Apply([]ledger.Event{ev("k", 9, statemachine.EventCompensated, "")}); err != nil {
		t.Fatal(err)
	}
	ix.Close()

	// Reopened: everything was on disk.
	ix, err = callindex.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	c, err := ix.Get(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if c.State != statemachine.StateSucceeded || c.Seq != 4 || len(c.Events) != 5 || !c.Settled() {
		t.Errorf("call = %s seq %d with %d events; want succeeded seq 4 with 5", c.State, c.Seq, len(c.Events))
	}
	if len(c.Refusals) != callindex.MaxRefusals || c.RefusalsDropped != 6 || c.Anomalies != 1 {
		t.Errorf("refusals %d (+%d dropped), anomalies %d; want %d (+6) and 1", len(c.Refusals), c.RefusalsDropped, c.Anomalies, callindex.MaxRefusals)
	}
	// Tenant-scoped: the same key under another tenant is unknown.
	if _, err := ix.Get(ledger.CallKey{TenantID: "t_b", IdempotencyKey: "k"}); !errors.Is(err, callindex.ErrNotFound) {
		t.Errorf("other tenant's lookup = %v; want ErrNotFound", err)
	}
}
