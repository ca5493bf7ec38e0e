package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// A KEY holding a "/" is read as <tenant_id>/<key> first, then as a key
// of --tenant, which the command says when it finds that: `ledger trace
// inv/2024/001` finds t_demo's call inv/2024/001. Before, it looked up
// tenant inv's key 2024/001 alone, and answered that there were no
// events.
func TestTraceKeyHoldingASlash(t *testing.T) {
	_, cc, topics, _ := roleKfake(t)
	// Placed as the ledger places a call's events, where trace reads.
	cl, err := ledger.NewClient(cc, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	produce := func(tenant, key string) {
		t.Helper()
		e := ledger.Event{EventID: tenant + "|" + key, Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(),
			TenantID: tenant, IdempotencyKey: key, Tool: "create_ticket"}
		rec, err := e.Record(topics.Events)
		if err != nil {
			t.Fatal(err)
		}
		if err := cl.ProduceSync(t.Context(), rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	trace := func(key string) (tenant, notes string) {
		t.Helper()
		out, notes := cliSplit(t, append([]string{"trace", key, "--json"}, roleArgs(cc, topics)...)...)
		var evs []ledger.Event
		if err := json.Unmarshal([]byte(out), &evs); err != nil || len(evs) != 1 {
			t.Fatalf("trace %s = %q, %v; want one event", key, out, err)
		}
		return evs[0].TenantID, notes
	}

	produce("t_demo", "inv/2024/001")
	if tenant, notes := trace("inv/2024/001"); tenant != "t_demo" || !strings.Contains(notes, "no call inv/2024/001; call t_demo/inv/2024/001 (tenant t_demo)") {
		t.Errorf("trace inv/2024/001 found tenant %q's call, noting %q; want t_demo's, saying so", tenant, notes)
	}
	// Once tenant inv has a call 2024/001, it is the first reading.
	produce("inv", "2024/001")
	if tenant, notes := trace("inv/2024/001"); tenant != "inv" || notes != "" {
		t.Errorf("trace inv/2024/001 found tenant %q's call, noting %q; want inv's, with no note", tenant, notes)
	}
	err = cliErr(t, append([]string{"trace", "nobody/k"}, roleArgs(cc, topics)...)...)
	if err == nil || !strings.Contains(err.Error(), "no events for nobody/k nor for t_demo/nobody/k") {
		t.Errorf("trace of a key nobody has = %v; want both readings named", err)
	}
}

// A trace from the projection holding as many refused submissions as the
// projection keeps under a key says that later ones are not shown: a
// looping agent's latest refusals, nearest the incident, were missing
// without a word.
func TestTraceSaysItsRefusalsAreCut(t *testing.T) {
	refusals := func(n int) []ledger.Event {
		evs := make([]ledger.Event, n, n+2)
		for i := range evs {
			evs[i] = ledger.Event{Type: statemachine.EventDenied, Reason: "idempotency_key_reused"}
		}
		return append(evs, ledger.Event{Type: statemachine.EventRequested, Seq: 1}, ledger.Event{Type: statemachine.EventAuthorized, Seq: 2})
	}
	if note := refusalsCut(refusals(projections.MaxRefusals - 1)); note != "" {
		t.Errorf("%d refusals: note %q; want none", projections.MaxRefusals-1, note)
	}
	if note := refusalsCut(refusals(projections.MaxRefusals)); !strings.Contains(note, "the earliest and the latest") || !strings.Contains(note, "those between are not") {
		t.Errorf("%d refusals: note %q; want it to say those between the earliest and the latest are not shown", projections.MaxRefusals, note)
	}
}
