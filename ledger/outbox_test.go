package ledger

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// TestEncodeOutbox: one encoding serves both destinations: the outbox
// decodes to the events, and each record is the event's own record, byte
// for byte.
func TestEncodeOutbox(t *testing.T) {
	at := time.Date(2026, 11, 30, 12, 0, 0, 123456789, time.UTC)
	evs := []Event{
		{EventID: "e1", Type: statemachine.EventRequested, Seq: 1, At: at, Actor: "intake/a", TenantID: "t_a", IdempotencyKey: "k<1>&",
			Tool: "create_ticket", ToolVersion: 1, Arguments: json.RawMessage(`{"title":"<b>x</b> & y"}`)},
		{EventID: "e2", Type: statemachine.EventAuthorized, Seq: 2, At: at, Actor: "intake/a", TenantID: "t_a", IdempotencyKey: "k<1>&",
			PolicyID: []string{"read-tools"}, Decision: "allow"},
	}
	outbox, recs, err := EncodeOutbox(evs, "events")
	if err != nil {
		t.Fatal(err)
	}
	if !json.Valid(outbox) {
		t.Fatalf("outbox is not JSON: %s", outbox)
	}
	got, err := DecodeEvents(outbox)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]Event, len(evs))
	for i := range evs {
		want[i] = evs[i]
		want[i].V = 1 // no roles: the version every build reads
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("outbox decodes differently (-want +got):\n%s", d)
	}
	if len(recs) != len(evs) {
		t.Fatalf("%d records for %d events", len(recs), len(evs))
	}
	for i := range evs {
		r, err := evs[i].Record("events")
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(recs[i].Value, r.Value) || !bytes.Equal(recs[i].Key, r.Key) || recs[i].Topic != "events" ||
			string(Header(recs[i], HeaderEventType)) != string(evs[i].Type) {
			t.Errorf("record %d differs from Event.Record:\n got %s %s\nwant %s %s", i, recs[i].Key, recs[i].Value, r.Key, r.Value)
		}
	}
	if legacy, err := EncodeEvents(evs); err != nil || !bytes.Equal(legacy, outbox) {
		t.Errorf("EncodeEvents = %s, %v; want the outbox %s", legacy, err, outbox)
	}
	if empty, recs, err := EncodeOutbox(nil, "events"); err != nil || string(empty) != "[]" || len(recs) != 0 {
		t.Errorf("EncodeOutbox(nil) = %s, %d records, %v; want [], none", empty, len(recs), err)
	}
}

// BenchmarkOutbox compares the executor's path before and after
// EncodeOutbox: encoding the outbox, then decoding it and encoding each
// event again for its record; or encoding each event once.
func BenchmarkOutbox(b *testing.B) {
	at := time.Now().UTC()
	evs := []Event{
		{EventID: "e3", Type: statemachine.EventExecuting, Seq: 3, At: at, Actor: "executor/a", TenantID: "t_a", IdempotencyKey: "run:1",
			Tool: "create_ticket", ToolVersion: 1, ArgumentsHash: "sha256:00", JTI: "jti", CredentialScope: "tool::create_ticket", Attempt: 1},
		{EventID: "e4", Type: statemachine.EventSucceeded, Seq: 4, At: at, Actor: "executor/a", TenantID: "t_a", IdempotencyKey: "run:1",
			Tool: "create_ticket", ToolVersion: 1, ArgumentsHash: "sha256:00", JTI: "jti", ResultDigest: "sha256:11", ResultBytes: 42, LatencyMS: 3},
	}
	b.Run("encode-decode-encode", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			outbox, err := EncodeEvents(evs)
			if err != nil {
				b.Fatal(err)
			}
			back, err := DecodeEvents(outbox)
			if err != nil {
				b.Fatal(err)
			}
			for i := range back {
				if _, err := back[i].Record("events"); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	b.Run("encode-once", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, _, err := EncodeOutbox(evs, "events"); err != nil {
				b.Fatal(err)
			}
		}
	})
}
