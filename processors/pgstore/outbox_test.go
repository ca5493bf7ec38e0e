package pgstore

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/storetest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// outboxOf encodes a call's events of types, as the intake and the
// executor do: the outbox the store keeps for the row.
func outboxOf(t testing.TB, key ledger.CallKey, types ...statemachine.EventType) []byte {
	t.Helper()
	at := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	var evs []ledger.Event
	for i, typ := range types {
		evs = append(evs, ledger.Event{
			EventID: fmt.Sprintf("01a236ee-8a4c-7422-b17d-b5c5ef8982%02d", i), Type: typ, Seq: int64(i + 1), At: at,
			Actor: "executor/node-1", TenantID: key.TenantID, IdempotencyKey: key.IdempotencyKey,
			CallID: "call_" + key.IdempotencyKey, Tool: "create_ticket", ToolVersion: 1,
			ArgumentsHash: "sha256:9e8d17a1f2273f665b7cbdfff2736da42b8d1f7c1feb3f0a3c9460c6817b138c",
			TraceID:       "tr_" + key.IdempotencyKey, PolicyVersion: "demo@3edb213b0a69",
		})
	}
	b, err := ledger.EncodeEvents(evs)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestPackOutbox(t *testing.T) {
	events := outboxOf(t, ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}, statemachine.EventExecuting, statemachine.EventSucceeded)
	packed := packOutbox(events, outboxMinPack)
	if !bytes.HasPrefix(packed, []byte(outboxS2)) {
		t.Fatalf("a %d-byte outbox was stored as it is; want it compressed", len(events))
	}
	// Two events of one call repeat their keys and most values.
	if len(packed) > len(events)*2/3 {
		t.Errorf("compressed %d bytes into %d; want at most two thirds", len(events), len(packed))
	}
	if got, err := unpackOutbox(packed); err != nil || !bytes.Equal(got, events) {
		t.Errorf("unpackOutbox(packOutbox(x)) = %q, %v; want x back", got, err)
	}
	for _, tc := range []struct {
		name   string
		outbox []byte
		minLen int
	}{
		{"short", []byte(`[{"seq":1}]`), outboxMinPack},
		{"empty", nil, 1},
		{"plain", events, -1},
	} {
		if got := packOutbox(tc.outbox, tc.minLen); !bytes.Equal(got, tc.outbox) {
			t.Errorf("%s: packOutbox = %q; want the outbox as it is", tc.name, got)
		}
		// What an older build wrote reads as it is.
		if got, err := unpackOutbox(tc.outbox); err != nil || !bytes.Equal(got, tc.outbox) {
			t.Errorf("%s: unpackOutbox = %q, %v; want the outbox as it is", tc.name, got, err)
		}
	}
}

func TestUnpackOutboxCorrupt(t *testing.T) {
	good := packOutbox(outboxOf(t, ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}, statemachine.EventExecuting, statemachine.EventSucceeded), 1)
	huge := binary.AppendUvarint([]byte(outboxS2), maxOutboxBytes+1)
	for name, b := range map[string][]byte{
		"truncated":     good[:len(good)/2],
		"no length":     []byte(outboxS2),
		"bad body":      append([]byte(outboxS2), 0x20, 0xff, 0xff, 0xff),
		"too large":     append(huge, 0, 0, 0),
		"flipped bytes": append(append([]byte{}, good[:len(good)-8]...), bytes.Repeat([]byte{0xfe}, 8)...),
	} {
		if got, err := unpackOutbox(b); !errors.Is(err, errOutbox) {
			t.Errorf("%s: unpackOutbox = %q, %v; want errOutbox", name, got, err)
		}
	}
}

// TestContractCompressedOutboxes runs the store's contract with every
// outbox compressed, however short: each path that writes one and each
// that reads one must give back the bytes it was given.
func TestContractCompressedOutboxes(t *testing.T) {
	dsn := testDSN(t)
	storetest.Run(t, func(t *testing.T) processors.Store {
		s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn)})
		s.packMin = 1
		return s
	})
}

// TestOutboxStoredCompressed checks what the table holds: admissions and
// completions write their outboxes compressed, reads give them back as
// written, and a store with PlainOutboxes writes what an older build
// would, which both read.
func TestOutboxStoredCompressed(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	s := open(t, Config{DSN: dsn, Schema: schema})
	plain := open(t, Config{DSN: dsn, Schema: schema, PlainOutboxes: true})
	stored := func(k ledger.CallKey) []byte {
		t.Helper()
		var b []byte
		if err := s.pool.QueryRow(t.Context(), "SELECT outbox FROM "+s.table+" WHERE tenant_id = $1 AND idempotency_key = $2", k.TenantID, k.IdempotencyKey).Scan(&b); err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name       string
		st         *Store
		compressed bool
	}{{"default", s, true}, {"PlainOutboxes", plain, false}} {
		k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k-" + tc.name}
		admitted := outboxOf(t, k, statemachine.EventRequested, statemachine.EventAuthorized)
		if _, err := tc.st.Admit(t.Context(), []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "create_ticket", ToolVersion: 1, Status: processors.StatusAuthorized, Seq: 2, Outbox: admitted}}); err != nil {
			t.Fatal(err)
		}
		completed := outboxOf(t, k, statemachine.EventExecuting, statemachine.EventSucceeded)
		steps := []struct {
			what   string
			outbox []byte
			write  func() error
		}{
			{"admission", admitted, func() error { return nil }},
			{"completion", completed, func() error {
				res, err := tc.st.Claim(t.Context(), []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: "o", Lease: time.Minute}})
				if err != nil || len(res) != 1 || res[0].Outcome != processors.Claimed {
					return fmt.Errorf("claim: %+v, %v", res, err)
				}
				ok, err := tc.st.Complete(t.Context(), []processors.Completion{{Key: k, Epoch: res[0].Record.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Seq: 4, Outbox: completed, From: 2}})
				if err != nil || len(ok) != 1 || !ok[0] {
					return fmt.Errorf("complete: %v, %v", ok, err)
				}
				return nil
			}},
		}
		for _, step := range steps {
			if err := step.write(); err != nil {
				t.Fatalf("%s: %s: %v", tc.name, step.what, err)
			}
			raw := stored(k)
			if got := bytes.HasPrefix(raw, []byte(outboxS2)); got != tc.compressed || tc.compressed && len(raw) >= len(step.outbox) {
				t.Errorf("%s: %s: the table holds %d bytes (compressed: %v) for a %d-byte outbox; want compressed: %v", tc.name, step.what, len(raw), got, len(step.outbox), tc.compressed)
			}
			for _, reader := range []*Store{s, plain} {
				if r := mustGetRecord(t, reader, k); !bytes.Equal(r.Outbox, step.outbox) {
					t.Errorf("%s: %s: read back %q; want %q", tc.name, step.what, r.Outbox, step.outbox)
				}
			}
		}
	}

	// A corrupt compressed outbox is an error naming the call, not a
	// panic and not events made up.
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k-default"}
	if _, err := s.pool.Exec(t.Context(), "UPDATE "+s.table+" SET outbox = $3 WHERE tenant_id = $1 AND idempotency_key = $2", k.TenantID, k.IdempotencyKey, []byte(outboxS2+"\x20\xff")); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Get(t.Context(), k); !errors.Is(err, errOutbox) || !bytes.Contains([]byte(err.Error()), []byte(k.IdempotencyKey)) {
		t.Errorf("Get of a corrupt outbox = %+v, %v; want errOutbox naming the call", r, err)
	}
}

func mustGetRecord(t *testing.T, s *Store, k ledger.CallKey) processors.Record {
	t.Helper()
	r, err := s.Get(t.Context(), k)
	if err != nil {
		t.Fatalf("Get(%v) = %v", k, err)
	}
	return r
}

// BenchmarkPackOutbox: what compressing an executor's outbox costs the
// ledger on each completion, and reading it back on a claim.
func BenchmarkPackOutbox(b *testing.B) {
	events := outboxOf(b, ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}, statemachine.EventExecuting, statemachine.EventSucceeded)
	packed := packOutbox(events, outboxMinPack)
	b.Run("pack", func(b *testing.B) {
		b.SetBytes(int64(len(events)))
		for b.Loop() {
			packOutbox(events, outboxMinPack)
		}
	})
	b.Run("unpack", func(b *testing.B) {
		b.SetBytes(int64(len(events)))
		for b.Loop() {
			if _, err := unpackOutbox(packed); err != nil {
				b.Fatal(err)
			}
		}
	})
}
