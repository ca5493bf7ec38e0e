package consistency

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// base is the time every test history starts from.
var base = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

// key is tenant t1's call key k.
func key(k string) ledger.CallKey { return ledger.CallKey{TenantID: "t1", IdempotencyKey: k} }

// ev is call k's event of type typ at seq, at base+at, with what the state
// machine's guards need. Its id is derived from (k, seq, typ, variant): the
// same arguments give the same event, as a re-append does.
func ev(k ledger.CallKey, seq int64, typ statemachine.EventType, at time.Duration) ledger.Event {
	e := ledger.Event{
		EventID:        fmt.Sprintf("%s/%d/%s", k, seq, typ),
		Type:           typ,
		Seq:            seq,
		At:             base.Add(at),
		Actor:          "test",
		TenantID:       k.TenantID,
		IdempotencyKey: k.IdempotencyKey,
		Tool:           "create_ticket",
		ToolVersion:    1,
		ArgumentsHash:  "hash-" + k.IdempotencyKey,
	}
	switch typ {
	case statemachine.EventDenied, statemachine.EventFailed, statemachine.EventOutcomeUnknown,
		statemachine.EventParked, statemachine.EventRejected, statemachine.EventExpired:
		e.Reason = "test_reason"
	case statemachine.EventExecuting:
		e.Attempt = 1
	case statemachine.EventApprovalPending, statemachine.EventApproved:
		exp := base.Add(time.Hour)
		e.ExpiresAt = &exp
		if typ == statemachine.EventApproved {
			e.ApprovalID = k.ApprovalID()
		}
	}
	return e
}

// history is call k's events of types at seqs 1, 2, ..., the event of seq
// i at base + i*step.
func history(k ledger.CallKey, step time.Duration, types ...statemachine.EventType) []ledger.Event {
	evs := make([]ledger.Event, len(types))
	for i, t := range types {
		seq := int64(i + 1)
		evs[i] = ev(k, seq, t, time.Duration(seq)*step)
	}
	return evs
}

// Shorthands for the event types.
const (
	req      = statemachine.EventRequested
	auth     = statemachine.EventAuthorized
	exec     = statemachine.EventExecuting
	ok       = statemachine.EventSucceeded
	fail     = statemachine.EventFailed
	unknown  = statemachine.EventOutcomeUnknown
	parked   = statemachine.EventParked
	comp     = statemachine.EventCompensated
	denied   = statemachine.EventDenied
	pendingA = statemachine.EventApprovalPending
)

// succeeded is the types of a call that ran and succeeded.
var succeeded = []statemachine.EventType{req, auth, exec, ok}

// newKafka is an in-process cluster (or the one LEDGER_TEST_KAFKA_BROKERS
// names) with the ledger's topics.
func newKafka(t *testing.T, partitions int32) *ledgertest.Kafka {
	t.Helper()
	return ledgertest.New(t, ledgertest.Options{Partitions: partitions})
}

// producer is a client producing to k's topics with the ledger's
// partitioner; with a transactional id when txid is not empty.
func producer(t *testing.T, k *ledgertest.Kafka, txid string) *kgo.Client {
	t.Helper()
	opts := []kgo.Opt{kgo.RecordPartitioner(ledger.Partitioner())}
	if txid != "" {
		opts = append(opts, kgo.TransactionalID(txid))
	}
	cl, err := ledger.NewClient(k.Client, opts...)
	if err != nil {
		t.Fatalf("producer: %v", err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// records are evs as records of topic.
func records(t *testing.T, topic string, evs []ledger.Event) []*kgo.Record {
	t.Helper()
	recs := make([]*kgo.Record, len(evs))
	for i := range evs {
		r, err := evs[i].Record(topic)
		if err != nil {
			t.Fatalf("record: %v", err)
		}
		recs[i] = r
	}
	return recs
}

// produce writes recs through cl and waits for them.
func produce(t *testing.T, cl *kgo.Client, recs []*kgo.Record) {
	t.Helper()
	if len(recs) == 0 {
		return
	}
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// begin starts a transaction on cl.
func begin(t *testing.T, cl *kgo.Client) {
	t.Helper()
	if err := cl.BeginTransaction(); err != nil {
		t.Fatalf("begin transaction: %v", err)
	}
}

// end commits or aborts cl's transaction.
func end(t *testing.T, cl *kgo.Client, commit bool) {
	t.Helper()
	if err := cl.EndTransaction(t.Context(), kgo.TransactionEndTry(commit)); err != nil {
		t.Fatalf("end transaction (commit %v): %v", commit, err)
	}
}

// txn writes recs through cl in one transaction, committed or aborted.
func txn(t *testing.T, cl *kgo.Client, commit bool, recs []*kgo.Record) {
	t.Helper()
	begin(t, cl)
	produce(t, cl, recs)
	end(t, cl, commit)
}

// readLogT reads k's events topic with o, within a minute.
func readLogT(t *testing.T, k *ledgertest.Kafka, o readOpts) *Log {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	l, err := readLog(ctx, k.Client, k.Topics.Events, o)
	if err != nil {
		t.Fatalf("read log: %v", err)
	}
	return l
}

// offsets reads every data record below the end offsets of topic at
// isolation, independently of ReadLog, and returns their partition ->
// offsets.
func offsets(t *testing.T, k *ledgertest.Kafka, isolation kgo.IsolationLevel) map[int32][]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	parts, err := listOffsets(ctx, k.Client, k.Topics.Events)
	if err != nil {
		t.Fatalf("list offsets: %v", err)
	}
	cl, err := ledger.NewClient(k.Client,
		kgo.ConsumeTopics(k.Topics.Events),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchIsolationLevel(isolation),
		kgo.FetchMaxWait(100*time.Millisecond),
	)
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	defer cl.Close()
	want := make(map[int32]int64)
	for _, p := range parts {
		want[p.id] = p.end
		if isolation == kgo.ReadCommitted() {
			want[p.id] = p.stable
		}
	}
	got := make(map[int32][]int64)
	// Everything is in the log already: the read is done once polls stay
	// empty (read_committed skips aborted records and markers, so no
	// offset tells that it is done). A poll that finds nothing returns
	// when its own short deadline passes.
	for idle := 0; idle < 2; {
		pctx, pcancel := context.WithTimeout(ctx, 500*time.Millisecond)
		fs := cl.PollFetches(pctx)
		pcancel()
		if ctx.Err() != nil {
			t.Fatalf("read %s: %v", k.Topics.Events, ctx.Err())
		}
		n := 0
		fs.EachError(func(_ string, _ int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
				t.Fatalf("read %s: %v", k.Topics.Events, err)
			}
		})
		fs.EachRecord(func(r *kgo.Record) {
			if r.Offset < want[r.Partition] {
				got[r.Partition] = append(got[r.Partition], r.Offset)
				n++
			}
		})
		if n == 0 {
			idle++
		} else {
			idle = 0
		}
	}
	return got
}
