package pgstore

import (
	"fmt"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// BenchmarkCallLifecycle: the store's writes of one call on the
// exactly-once path (admit, mark logged, claim, complete, mark logged), in
// batches of 500 as the loops send them, with this build's indexes and
// with the full status indexes older builds created beside them. One op
// is one batch; calls/s is the figure to compare.
func BenchmarkCallLifecycle(b *testing.B) {
	for _, older := range []bool{true, false} {
		b.Run(fmt.Sprint("older-indexes=", older), func(b *testing.B) {
			dsn := testDSN(b)
			// Plain: its outboxes are zeros, which would compress to
			// nearly nothing, and its figures compare with earlier ones.
			s := open(b, Config{DSN: dsn, Schema: newSchema(b, dsn), PlainOutboxes: true})
			defer s.Close()
			if older {
				addOlderIndexes(b, s)
			}
			const batch = 500
			outbox := make([]byte, 700)
			n := 0
			for b.Loop() {
				runBatch(b, s, n, batch, outbox, outbox)
				n += batch
			}
			b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "calls/s")
		})
	}
}

// BenchmarkOutboxes: the same lifecycle with real events in the
// outboxes (a call's requested and authorized events at admission, its
// executing and succeeded ones at completion), written as they are and
// compressed. Besides calls/s it reports what the table and its indexes
// grew by per call, every row version included (nothing vacuums them
// during the run).
func BenchmarkOutboxes(b *testing.B) {
	k := ledger.CallKey{TenantID: "t_bench", IdempotencyKey: "00000000:run-0"}
	admitted := outboxOf(b, k, statemachine.EventRequested, statemachine.EventAuthorized)
	completed := outboxOf(b, k, statemachine.EventExecuting, statemachine.EventSucceeded)
	for _, plain := range []bool{true, false} {
		name := map[bool]string{true: "plain", false: "s2"}[plain]
		b.Run(name, func(b *testing.B) {
			dsn := testDSN(b)
			s := open(b, Config{DSN: dsn, Schema: newSchema(b, dsn), PlainOutboxes: plain})
			defer s.Close()
			const batch = 500
			n := 0
			for b.Loop() {
				runBatch(b, s, n, batch, admitted, completed)
				n += batch
			}
			b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "calls/s")
			var size int64
			if err := s.pool.QueryRow(b.Context(), "SELECT pg_total_relation_size($1::regclass)", s.table).Scan(&size); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(size)/float64(n), "table-B/call")
		})
	}
}

func runBatch(b testing.TB, s *Store, from, batch int, admitted, completed []byte) {
	ctx := b.Context()
	as := make([]processors.Admission, batch)
	cs := make([]processors.Claim, batch)
	ls := make([]processors.Logged, batch)
	for i := range batch {
		k := ledger.CallKey{TenantID: "t_bench", IdempotencyKey: fmt.Sprintf("%08x:run-%d", (from+i)*2654435761%(1<<32), from+i)}
		as[i] = processors.Admission{
			Key: k, CallID: fmt.Sprint("c", from+i), ArgumentsHash: "h", Tool: "create_ticket", ToolVersion: 1,
			Arguments: []byte(`{"title":"t"}`), DeadlineAt: time.Now().Add(time.Hour),
			Status: processors.StatusAuthorized, Seq: 2, Outbox: admitted,
		}
		// Named as an executor that mints credentials names them.
		cs[i] = processors.Claim{Key: k, ArgumentsHash: "h", Owner: "bench", Lease: time.Minute,
			Credential: processors.CallCredential{JTI: credentials.NewJTI(), Family: credentials.FamilyOf("create_ticket", k.TenantID, 1796517237)}}
		ls[i] = processors.Logged{Key: k, Seq: 2}
	}
	if _, err := s.Admit(ctx, as); err != nil {
		b.Fatal(err)
	}
	if err := s.MarkLogged(ctx, ls); err != nil {
		b.Fatal(err)
	}
	res, err := s.Claim(ctx, cs)
	if err != nil {
		b.Fatal(err)
	}
	done := make([]processors.Completion, batch)
	for i, r := range res {
		if r.Outcome != processors.Claimed {
			b.Fatalf("claim %v: outcome %d", cs[i].Key, r.Outcome)
		}
		done[i] = processors.Completion{
			Key: cs[i].Key, Epoch: r.Record.Epoch, Status: processors.StatusSucceeded, Attempt: 1,
			Result: []byte(`{"ticket_id":"T-1"}`), Seq: 4, Outbox: completed,
		}
		ls[i].Seq = 4
	}
	applied, err := s.Complete(ctx, done)
	if err != nil {
		b.Fatal(err)
	}
	for i, ok := range applied {
		if !ok {
			b.Fatalf("complete %v: not applied", done[i].Key)
		}
	}
	if err := s.MarkLogged(ctx, ls); err != nil {
		b.Fatal(err)
	}
}
