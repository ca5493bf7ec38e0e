package main

import (
	"strings"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// TestReconcilerUnansweredFor: `ledger reconciler --unanswered-for` is how
// long a call's status lookups may go unanswered before it is parked for
// a human. Here nothing answers them (the tools' address refuses), and
// with a millisecond the second sweep (10 s after the first, which only
// notes the failure) parks the call; the default would ask again for
// minutes. A negative value is refused, naming the flag.
func TestReconcilerUnansweredFor(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	dsn := freshSchemaDSN(t)
	st, err := pgstore.Open(t.Context(), pgstore.Config{DSN: dsn})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := st.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	// A refund whose outcome is unknown: refund_order declares a status
	// lookup.
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "unanswered"}
	var evs []ledger.Event
	outbox := func(types ...statemachine.EventType) []byte {
		for _, typ := range types {
			evs = append(evs, ledger.Event{V: 1, Type: typ, Seq: int64(len(evs) + 1), TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey,
				CallID: "c", UserID: "u", AgentID: "a", Tool: "refund_order", ToolVersion: 1, ArgumentsHash: "h", At: time.Now()})
		}
		b, err := ledger.EncodeEvents(evs)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	if _, err := st.Admit(t.Context(), []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "refund_order", ToolVersion: 1,
		Arguments: []byte(`{"order_id":"ord_1","amount_cents":100,"currency":"AUD"}`), Status: processors.StatusPending, Seq: 2,
		Outbox: outbox(statemachine.EventRequested, statemachine.EventApprovalPending)}}); err != nil {
		t.Fatal(err)
	}
	if ok, err := st.Move(t.Context(), []processors.Move{{Key: k, From: processors.StatusPending, FromSeq: 2, To: processors.StatusOutcomeUnknown, Seq: 3,
		Outbox: outbox(statemachine.EventOutcomeUnknown)}}); err != nil || !ok[0] {
		t.Fatalf("move to outcome_unknown: %v, %v", ok, err)
	}
	args := append(roleArgs(cc, topics), "reconciler", "--crdb-dsn", dsn, "--data-dir", t.TempDir(), "--instance-id", "unanswered",
		"--tools-base-url", "http://127.0.0.1:1")
	if err := cliErr(t, append(args, "--unanswered-for", "-1s")...); err == nil || !strings.Contains(err.Error(), "--unanswered-for -1s: must not be negative") {
		t.Errorf("--unanswered-for -1s: %v; want it refused, naming the flag", err)
	}
	exited := runCommand(t, append(args, "--unanswered-for", "1ms")...)
	ledgertest.WaitFor(t, time.Minute, func() error {
		exited()
		rec, err := st.Get(t.Context(), k)
		if err != nil {
			return err
		}
		if rec.Status != processors.StatusParked {
			return &statusError{rec.Status}
		}
		evs, err := ledger.DecodeEvents(rec.Outbox)
		if err != nil {
			return err
		}
		if last := evs[len(evs)-1]; last.Reason != executor.ReasonLookupFailed || !strings.Contains(last.Detail, "none answered for 1ms") {
			t.Fatalf("parked: %s (%s); want %s after its lookups went unanswered", last.Reason, last.Detail, executor.ReasonLookupFailed)
		}
		return nil
	})
}

// statusError says a record is not yet in the status waited for.
type statusError struct{ status processors.Status }

func (e *statusError) Error() string { return "the call is " + string(e.status) + "; want it parked" }
