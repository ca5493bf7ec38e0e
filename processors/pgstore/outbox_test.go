package pgstore

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/s2"

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
	header := func(extra ...byte) []byte { return append([]byte(outboxS2+"\x00\x00\x00\x00"), extra...) }
	flip := func(i int) []byte {
		b := bytes.Clone(good)
		b[i] ^= 0x10
		return b
	}
	for name, b := range map[string][]byte{
		"truncated":        good[:len(good)/2],
		"no checksum":      []byte(outboxS2 + "\x01"),
		"no length":        header(),
		"bad body":         header(0x20, 0xff, 0xff, 0xff),
		"too large":        append(binary.AppendUvarint(header(), maxOutboxBytes+1), 0, 0, 0),
		"checksum flipped": flip(len(outboxS2)),
		// S2 blocks carry no checksum: a flipped literal decodes into
		// other bytes without complaint, and only the CRC catches it.
		"literal flipped": flip(silentFlip(t, good)),
	} {
		if got, err := unpackOutbox(b); !errors.Is(err, errOutbox) {
			t.Errorf("%s: unpackOutbox = %q, %v; want errOutbox", name, got, err)
		}
	}
}

// silentFlip finds a byte of a compressed outbox's block whose flip S2
// decodes without an error into other bytes.
func silentFlip(t *testing.T, packed []byte) int {
	t.Helper()
	want, err := s2.Decode(nil, packed[outboxHeader:])
	if err != nil {
		t.Fatal(err)
	}
	for i := len(packed) - 1; i >= outboxHeader; i-- {
		b := bytes.Clone(packed[outboxHeader:])
		b[i-outboxHeader] ^= 0x10
		if got, err := s2.Decode(nil, b); err == nil && !bytes.Equal(got, want) {
			return i
		}
	}
	t.Fatal("no byte of the block flips silently")
	return 0
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

// TestOutboxStoredCompressed checks what the table holds: admissions,
// moves and completions write their outboxes compressed, reads give them back as
// written, and a store with PlainOutboxes writes what an older build
// would, which both read.
func TestOutboxStoredCompressed(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	s := open(t, Config{DSN: dsn, Schema: schema})
	plain := open(t, Config{DSN: dsn, Schema: schema, PlainOutboxes: true})
	for _, tc := range []struct {
		name       string
		st         *Store
		compressed bool
	}{{"default", s, true}, {"PlainOutboxes", plain, false}} {
		k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k-" + tc.name}
		admitted := outboxOf(t, k, statemachine.EventRequested, statemachine.EventApprovalPending)
		if _, err := tc.st.Admit(t.Context(), []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "create_ticket", ToolVersion: 1, Status: processors.StatusPending, Seq: 2, Outbox: admitted}}); err != nil {
			t.Fatal(err)
		}
		moved := outboxOf(t, k, statemachine.EventRequested, statemachine.EventApprovalPending, statemachine.EventAuthorized)
		completed := outboxOf(t, k, statemachine.EventExecuting, statemachine.EventSucceeded)
		steps := []struct {
			what   string
			outbox []byte
			write  func() error
		}{
			{"admission", admitted, func() error { return nil }},
			{"move", moved, func() error {
				ok, err := tc.st.Move(t.Context(), []processors.Move{{Key: k, From: processors.StatusPending, FromSeq: 2, To: processors.StatusAuthorized, Seq: 3, Outbox: moved}})
				if err != nil || len(ok) != 1 || !ok[0] {
					return fmt.Errorf("move: %v, %v", ok, err)
				}
				return nil
			}},
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
			raw := stored(t, s, k)
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

	// A damaged compressed outbox fails no read: the record comes back
	// with its outbox as stored, which its reader's decoding refuses, as
	// it would a damaged plain one; the other records of a batch are
	// unaffected.
	damaged := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k-damaged"}
	fine := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k-fine"}
	for _, k := range []ledger.CallKey{damaged, fine} {
		if _, err := s.Admit(t.Context(), []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "create_ticket", ToolVersion: 1, Status: processors.StatusAuthorized, Seq: 2,
			Outbox: outboxOf(t, k, statemachine.EventRequested, statemachine.EventAuthorized)}}); err != nil {
			t.Fatal(err)
		}
	}
	bad := append(bytes.Clone(stored(t, s, damaged)[:outboxHeader]), 0x20, 0xff)
	if _, err := s.pool.Exec(t.Context(), "UPDATE "+s.table+" SET outbox = $3 WHERE tenant_id = $1 AND idempotency_key = $2", damaged.TenantID, damaged.IdempotencyKey, bad); err != nil {
		t.Fatal(err)
	}
	res, err := s.Claim(t.Context(), []processors.Claim{
		{Key: damaged, ArgumentsHash: "h", Owner: "o", Lease: time.Minute},
		{Key: fine, ArgumentsHash: "h", Owner: "o", Lease: time.Minute},
	})
	if err != nil || len(res) != 2 || res[0].Outcome != processors.Claimed || res[1].Outcome != processors.Claimed {
		t.Fatalf("Claim of a batch with a damaged outbox = %+v, %v; want both claimed", res, err)
	}
	if !bytes.Equal(res[0].Record.Outbox, bad) {
		t.Errorf("damaged outbox read as %q; want it as stored, %q", res[0].Record.Outbox, bad)
	}
	if _, err := ledger.DecodeEvents(res[0].Record.Outbox); err == nil {
		t.Error("the damaged outbox decoded into events; want its reader to refuse it")
	}
	if _, err := ledger.DecodeEvents(res[1].Record.Outbox); err != nil {
		t.Errorf("the sound outbox of the same batch: %v", err)
	}
}

// stored reads k's outbox as the table holds it.
func stored(t *testing.T, s *Store, k ledger.CallKey) []byte {
	t.Helper()
	var b []byte
	if err := s.pool.QueryRow(t.Context(), "SELECT outbox FROM "+s.table+" WHERE tenant_id = $1 AND idempotency_key = $2", k.TenantID, k.IdempotencyKey).Scan(&b); err != nil {
		t.Fatal(err)
	}
	return b
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

// TestFootprint counts the records and measures the tables, and shows
// what compressed outboxes save: the same calls, each admitted, claimed
// and completed with real events, take less room than with plain ones.
func TestFootprint(t *testing.T) {
	dsn := testDSN(t)
	k := ledger.CallKey{TenantID: "t_bench", IdempotencyKey: "00000000:run-0"}
	admitted := outboxOf(t, k, statemachine.EventRequested, statemachine.EventAuthorized)
	completed := outboxOf(t, k, statemachine.EventExecuting, statemachine.EventSucceeded)
	var grew [2]int64
	for i, plain := range []bool{true, false} {
		s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn), PlainOutboxes: plain})
		empty, err := s.Footprint(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		const calls = 2000
		for from := 0; from < calls; from += 500 {
			runBatch(t, s, from, 500, admitted, completed)
		}
		f, err := s.Footprint(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if empty.Records != 0 || f.Records != calls {
			t.Errorf("plain %v: %d records before, %d after %d calls; want 0 and %d", plain, empty.Records, f.Records, calls, calls)
		}
		// Three row versions of about 1 KB (compressed) to 2 KB (plain)
		// each a call, none vacuumed yet.
		if per := (f.Bytes - empty.Bytes) / calls; per < 1000 || per > 20000 {
			t.Errorf("plain %v: %d bytes a call; want between 1,000 and 20,000", plain, per)
		}
		grew[i] = f.Bytes - empty.Bytes
		s.Close()
	}
	if grew[1] >= grew[0]*3/4 {
		t.Errorf("the tables grew by %d bytes with compressed outboxes, %d with plain ones; want at least a quarter less", grew[1], grew[0])
	}
}

// TestRewritePlainOutboxes rewrites a table's compressed outboxes as
// plain JSON, as going back to an older build needs: afterwards none is
// compressed, each reads as before, and a second pass finds nothing.
func TestRewritePlainOutboxes(t *testing.T) {
	dsn := testDSN(t)
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn)})
	k := ledger.CallKey{TenantID: "t_bench", IdempotencyKey: "00000000:run-0"}
	completed := outboxOf(t, k, statemachine.EventExecuting, statemachine.EventSucceeded)
	const calls = 1200
	for from := 0; from < calls; from += 400 {
		runBatch(t, s, from, 400, outboxOf(t, k, statemachine.EventRequested, statemachine.EventAuthorized), completed)
	}
	compressed := func() (n int64) {
		t.Helper()
		if err := s.pool.QueryRow(t.Context(), "SELECT count(*) FROM "+s.table+" WHERE outbox >= $1 AND outbox < $2", []byte(outboxS2), []byte("\x00s3")).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := compressed(); n != calls {
		t.Fatalf("%d compressed outboxes before; want %d", n, calls)
	}
	var steps []RewriteProgress
	p, err := s.RewritePlainOutboxes(t.Context(), 500, func(p RewriteProgress) { steps = append(steps, p) })
	if err != nil {
		t.Fatal(err)
	}
	if want := (RewriteProgress{Scanned: calls, Rewritten: calls}); p != want || len(steps) != 3 || steps[len(steps)-1] != p {
		t.Errorf("RewritePlainOutboxes = %+v after %d progress reports (%+v); want %+v in 3 batches of at most 500", p, len(steps), steps, want)
	}
	if n := compressed(); n != 0 {
		t.Errorf("%d compressed outboxes after; want none", n)
	}
	var key string
	if err := s.pool.QueryRow(t.Context(), "SELECT idempotency_key FROM "+s.table+" LIMIT 1").Scan(&key); err != nil {
		t.Fatal(err)
	}
	if r := mustGetRecord(t, s, ledger.CallKey{TenantID: "t_bench", IdempotencyKey: key}); !bytes.Equal(r.Outbox, completed) {
		t.Errorf("outbox after the rewrite %q; want %q", r.Outbox, completed)
	}
	if again, err := s.RewritePlainOutboxes(t.Context(), 500, nil); err != nil || again != (RewriteProgress{Scanned: calls}) {
		t.Errorf("a second pass = %+v, %v; want every record scanned and none rewritten", again, err)
	}

	// A record whose outbox changed since the batch read it is left
	// alone: the rewrite writes only over the outbox it read.
	k2 := ledger.CallKey{TenantID: "t_b", IdempotencyKey: "k-changed"}
	if _, err := s.Admit(t.Context(), []processors.Admission{{Key: k2, CallID: "c", ArgumentsHash: "h", Tool: "create_ticket", ToolVersion: 1, Status: processors.StatusAuthorized, Seq: 2, Outbox: completed}}); err != nil {
		t.Fatal(err)
	}
	current := stored(t, s, k2)
	stale := packOutbox([]byte(`[{"seq":1}]`), 1)
	if n, err := s.rewriteOutboxes(t.Context(), outboxRewrite{ts: []string{k2.TenantID}, ks: []string{k2.IdempotencyKey}, olds: [][]byte{stale}, plains: [][]byte{[]byte(`[{"seq":1}]`)}}); err != nil || n != 0 {
		t.Errorf("rewrite over an outbox that changed = %d, %v; want 0 records written", n, err)
	}
	if got := stored(t, s, k2); !bytes.Equal(got, current) {
		t.Errorf("the changed record's outbox became %q; want it left as %q", got, current)
	}

	// A compressed outbox written behind the pass's cursor is counted
	// at the end, and the pass fails.
	behind := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k-behind"}
	p, err = s.RewritePlainOutboxes(t.Context(), 500, func(p RewriteProgress) {
		if p.Scanned == 500 {
			if _, err := s.Admit(t.Context(), []processors.Admission{{Key: behind, CallID: "c", ArgumentsHash: "h", Tool: "create_ticket", ToolVersion: 1, Status: processors.StatusAuthorized, Seq: 2, Outbox: completed}}); err != nil {
				t.Error(err)
			}
		}
	})
	if !errors.Is(err, ErrOutboxesRemain) || p.Remaining != 1 || p.Rewritten != 1 {
		t.Errorf("a pass with a record written behind it = %+v, %v; want k-changed rewritten, 1 remaining and ErrOutboxesRemain", p, err)
	}

	// A damaged outbox stops the rewrite, naming its call.
	if _, err := s.pool.Exec(t.Context(), "UPDATE "+s.table+" SET outbox = $2 WHERE idempotency_key = $1", key, []byte(outboxS2+"\x00\x00\x00\x00\x20\xff")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.RewritePlainOutboxes(t.Context(), 500, nil); !errors.Is(err, errOutbox) || !strings.Contains(err.Error(), key) {
		t.Errorf("rewrite over a damaged outbox: %v; want errOutbox naming %s", err, key)
	}
}
