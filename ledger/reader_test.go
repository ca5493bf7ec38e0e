package ledger_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// ReadCall returns a call's events once each, though the log holds some
// twice (an outbox appended again: an approval that finds the intake's
// events not yet marked logged publishes them with its own), and keeps
// distinct events that share a seq (refused submissions, seq 0).
func TestReadCallDropsCopies(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}
	at := time.Date(2026, 12, 3, 7, 0, 0, 0, time.UTC)
	ev := func(id string, seq int64, typ statemachine.EventType) ledger.Event {
		return ledger.Event{EventID: id, Seq: seq, Type: typ, At: at, TenantID: key.TenantID, IdempotencyKey: key.IdempotencyKey,
			CallID: "c1", Tool: "refund_order", ToolVersion: 1, ArgumentsHash: "sha256:00"}
	}
	requested, pending := ev("e1", 1, statemachine.EventRequested), ev("e2", 2, statemachine.EventApprovalPending)
	approved := ev("e3", 3, statemachine.EventApproved)
	refusedA, refusedB := ev("r1", 0, statemachine.EventRejected), ev("r2", 0, statemachine.EventRejected)
	var recs []*kgo.Record
	for _, e := range []ledger.Event{refusedA, requested, pending, refusedB, requested, pending, approved} {
		r, err := e.Record(k.Topics.Events)
		if err != nil {
			t.Fatal(err)
		}
		recs = append(recs, r)
	}
	// Placed as the ledger's producers place them.
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	evs, err := ledger.ReadCall(t.Context(), k.Client, k.Topics.Events, key)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range evs {
		got = append(got, e.EventID)
	}
	if diff := cmp.Diff([]string{"r1", "e1", "e2", "r2", "e3"}, got); diff != "" {
		t.Errorf("events read (-want +got):\n%s", diff)
	}
}

// A key whose partition was emptied up to its end (retention deleted
// every record, or a DeleteRecords) has no events: ReadCall says so at
// once. Before, it fetched from the log's start, which held nothing and
// would never hold what it waited for, until its context ended (ledger
// trace, whose context has no deadline, hung).
func TestReadCallOfAnEmptiedPartition(t *testing.T) {
	readEmptied(t, ledgertest.New(t, ledgertest.Options{Partitions: 1}))
}

// Nor when the records go after the reader listed where the log starts
// (retention, a DeleteRecords, meanwhile: here, its listing answered as
// before they went): franz-go resumes the partition at its new start in
// silence, and no record came to move the reader past the part deleted.
// It waited for good (ledger dlq, ledger trace hung with nothing to say).
func TestReadCallOfAPartitionEmptiedMeanwhile(t *testing.T) {
	k := ledgertest.NewInProcess(t, ledgertest.Options{Partitions: 1})
	readEmptied(t, k, func() { k.Cluster.ControlKey(int16(kmsg.ListOffsets), ledgertest.StaleStartOffsets) })
}

// readEmptied writes two events of a call, deletes them, runs then (if
// any), and reads the call, which must end at once with none.
func readEmptied(t *testing.T, k *ledgertest.Kafka, then ...func()) {
	t.Helper()
	key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "gone"}
	e := ledger.Event{EventID: "e1", Seq: 1, Type: statemachine.EventRequested, At: time.Now().UTC(), TenantID: key.TenantID,
		IdempotencyKey: key.IdempotencyKey, CallID: "c1", Tool: "refund_order", ToolVersion: 1, ArgumentsHash: "sha256:00"}
	r, err := e.Record(k.Topics.Events)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.ProduceSync(t.Context(), r, r).FirstErr(); err != nil {
		t.Fatal(err)
	}
	adm := kadm.NewClient(cl)
	ends, err := adm.ListEndOffsets(t.Context(), k.Topics.Events)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := adm.DeleteRecords(t.Context(), ends.Offsets()); err != nil {
		t.Fatal(err)
	}
	for _, f := range then {
		f()
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	evs, err := ledger.ReadCall(ctx, k.Client, k.Topics.Events, key)
	if err != nil || len(evs) != 0 {
		t.Errorf("ReadCall of an emptied partition = %d events, %v; want none, at once", len(evs), err)
	}
}

// CallBefore finds a call's events by reading its partition backwards
// from the given end: it stops at the call's last requested event, and
// then reads on down only to a window that starts with records stamped
// more than a minute before that event's time, so that what lies before
// is never read
// (here, a record under the key that does not decode, which a read from
// the log's start fails at); it goes back in windows each twice as long
// as the one before until it finds that event, or reads the whole
// partition when there is none.
func TestCallBeforeReadsBackToTheCallsStart(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	c := newCallLog(t, k)
	now, old := time.Now(), time.Now().Add(-10*time.Minute)

	// A call begun well past an unreadable record under its key, with
	// earlier submissions' refusals between, its first events appended
	// a second time after the rest (an outbox appended again).
	near := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "near"}
	c.raw(near, old, "not an event")
	c.produce(near, old, c.refusals("r", 5000)...)
	c.produce(near, now, c.step("e1", 1, statemachine.EventRequested), c.step("e2", 2, statemachine.EventAuthorized),
		c.step("e3", 3, statemachine.EventExecuting), c.step("e4", 4, statemachine.EventSucceeded),
		c.step("e1", 1, statemachine.EventRequested), c.step("e2", 2, statemachine.EventAuthorized))
	if _, err := ledger.ReadCall(t.Context(), k.Client, k.Topics.Events, near); err == nil {
		t.Fatal("ReadCall read past the record that does not decode; the test needs it read from the start")
	}
	hi := c.end()
	evs, reached, err := c.before(near, hi)
	if err != nil {
		t.Fatalf("CallBefore: %v", err)
	}
	if diff := cmp.Diff([]string{"e1", "e2", "e3", "e4"}, ids(evs)); diff != "" {
		t.Errorf("events of the call (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]int64{hi - 4096}, reached); diff != "" {
		t.Errorf("read down to (-want +got):\n%s", diff)
	}

	// The copies of a call's first events lie a window past the rest:
	// it reads back to the rest, by their time.
	copied := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "copied"}
	c.produce(copied, now, c.step("c1", 1, statemachine.EventRequested), c.step("c2", 2, statemachine.EventApprovalPending),
		c.step("c3", 3, statemachine.EventApproved))
	c.produce(near, now, c.refusals("q", 5000)...)
	c.produce(copied, now, c.step("c1", 1, statemachine.EventRequested), c.step("c2", 2, statemachine.EventApprovalPending))
	hi = c.end()
	if evs, reached, err = c.before(copied, hi); err != nil || !cmp.Equal([]string{"c1", "c2", "c3"}, ids(evs)) || reached[0] != hi-4096 || reached[1] >= hi-5002 {
		t.Errorf("CallBefore of a call whose copies lie a window past it = %v, %v, read down to %v; want c1 to c3, read down to below %d", ids(evs), err, reached, hi-5002)
	}

	// Nothing at or past the end given is read, though a fetch may bring
	// it with what is before (here, a later call's requested event).
	bounded := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "bounded"}
	c.produce(bounded, now, c.step("b1", 1, statemachine.EventRequested), c.step("b2", 2, statemachine.EventAuthorized))
	hi = c.end()
	later := c.step("b9", 1, statemachine.EventRequested)
	later.CallID = "c-later"
	c.produce(bounded, now, later)
	if evs, _, err = c.before(bounded, hi); err != nil || !cmp.Equal([]string{"b1", "b2"}, ids(evs)) {
		t.Errorf("CallBefore up to %d = %v, %v; want b1, b2 and nothing of the later call", hi, ids(evs), err)
	}

	// A record under the key that does not decode fails it where it may
	// be one of the call's.
	damaged := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "damaged"}
	c.produce(damaged, now, c.step("d1", 1, statemachine.EventRequested))
	c.raw(damaged, now, "not an event")
	c.produce(damaged, now, c.step("d2", 2, statemachine.EventAuthorized))
	if evs, _, err = c.before(damaged, c.end()); err == nil {
		t.Errorf("CallBefore with a record of the call that does not decode = %v; want its error", ids(evs))
	}

	// A call whose start lies three windows back, and a key with no
	// call: the whole partition is read.
	far := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "far"}
	c.produce(far, now, c.step("f1", 1, statemachine.EventRequested))
	start := c.end() - 1
	c.produce(far, now, c.refusals("s", 13000)...)
	c.produce(far, now, c.step("f2", 2, statemachine.EventDenied))
	hi = c.end()
	evs, reached, err = c.before(far, hi)
	if err != nil {
		t.Fatalf("CallBefore: %v", err)
	}
	if got := ids(evs); !cmp.Equal([]string{"f1", "f2"}, got) {
		t.Errorf("events of the call: %v; want f1, f2", got)
	}
	if len(reached) < 3 || !cmp.Equal([]int64{hi - 4096, hi - 4096 - 8192}, reached[:2]) || reached[2] > start {
		t.Errorf("read down to %v; want %d, %d, then at or below the call's start, %d", reached, hi-4096, hi-4096-8192, start)
	}
	// A window that starts with one record stamped by a clock set back
	// does not end the read: the call's first events lie further back,
	// before copies of them.
	stamped := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "stamped"}
	c.produce(stamped, now, c.step("s1", 1, statemachine.EventRequested), c.step("s2", 2, statemachine.EventAuthorized), c.step("s3", 3, statemachine.EventExecuting))
	c.produce(near, now, c.refusals("p", 100)...)
	c.raw(near, old.Add(-time.Hour), "a record stamped by a clock set back")
	c.produce(near, now, c.refusals("u", 4093)...)
	c.produce(stamped, now, c.step("s1", 1, statemachine.EventRequested), c.step("s2", 2, statemachine.EventAuthorized))
	if evs, reached, err = c.before(stamped, c.end()); err != nil || !cmp.Equal([]string{"s1", "s2", "s3"}, ids(evs)) {
		t.Errorf("CallBefore past a window starting with a record stamped an hour back = %v, %v, read down to %v; want s1 to s3", ids(evs), err, reached)
	}

	// A floor, the start of a call found elsewhere, ends the read as a
	// requested event would: a key with none below the end (a call
	// begun after it) costs no read of the whole partition.
	floored := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "floored"}
	c.produce(near, old, c.refusals("o", 5000)...)
	c.produce(floored, now, c.refusals("g", 2)...)
	hi = c.end()
	var readTo []int64
	evs, err = ledger.CallBefore(t.Context(), k.Client, k.Topics.Events, floored, hi, func() time.Time { return now }, func(o int64) { readTo = append(readTo, o) })
	if err != nil || !cmp.Equal([]string{"g0", "g1"}, ids(evs)) || !cmp.Equal([]int64{hi - 4096}, readTo) {
		t.Errorf("CallBefore with a floor = %v, %v, read down to %v; want g0, g1, read down to %d only", ids(evs), err, readTo, hi-4096)
	}
	none := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "none"}
	c.produce(none, now, c.refusals("n", 3)...)
	evs, reached, err = c.before(none, c.end())
	if err != nil || !cmp.Equal([]string{"n0", "n1", "n2"}, ids(evs)) || len(reached) == 0 || reached[len(reached)-1] != 0 {
		// The unreadable records are under other keys: read, and
		// passed over.
		t.Errorf("CallBefore of a key with no call = %v, %v, read down to %v; want its three refusals, read down to 0", ids(evs), err, reached)
	}
}

// callLog writes calls' events to a one-partition events topic for
// CallBefore to read.
type callLog struct {
	t  *testing.T
	k  *ledgertest.Kafka
	cl *kgo.Client
}

func newCallLog(t *testing.T, k *ledgertest.Kafka) *callLog {
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return &callLog{t, k, cl}
}

// produce appends evs under key, their records timestamped at, as is
// each event.
func (c *callLog) produce(key ledger.CallKey, at time.Time, evs ...ledger.Event) {
	c.t.Helper()
	var recs []*kgo.Record
	for _, e := range evs {
		e.TenantID, e.IdempotencyKey, e.At = key.TenantID, key.IdempotencyKey, at
		r, err := e.Record(c.k.Topics.Events)
		if err != nil {
			c.t.Fatal(err)
		}
		r.Timestamp = at
		recs = append(recs, r)
	}
	if err := c.cl.ProduceSync(c.t.Context(), recs...).FirstErr(); err != nil {
		c.t.Fatal(err)
	}
}

// raw appends value under key as it is.
func (c *callLog) raw(key ledger.CallKey, at time.Time, value string) {
	c.t.Helper()
	if err := c.cl.ProduceSync(c.t.Context(), &kgo.Record{Topic: c.k.Topics.Events, Key: []byte(key.String()), Value: []byte(value), Timestamp: at}).FirstErr(); err != nil {
		c.t.Fatal(err)
	}
}

func (c *callLog) refusals(prefix string, n int) []ledger.Event {
	evs := make([]ledger.Event, n)
	for i := range evs {
		evs[i] = ledger.Event{EventID: fmt.Sprintf("%s%d", prefix, i), Type: statemachine.EventDenied, CallID: "earlier", Reason: "rate_limited"}
	}
	return evs
}

func (c *callLog) step(id string, seq int64, typ statemachine.EventType) ledger.Event {
	return ledger.Event{EventID: id, Seq: seq, Type: typ, CallID: "c1", Tool: "create_ticket", ToolVersion: 1, ArgumentsHash: "sha256:00"}
}

func (c *callLog) end() int64 {
	c.t.Helper()
	ends, err := kadm.NewClient(c.cl).ListEndOffsets(c.t.Context(), c.k.Topics.Events)
	if err != nil {
		c.t.Fatal(err)
	}
	o, _ := ends.Lookup(c.k.Topics.Events, 0)
	return o.Offset
}

// before is CallBefore of key up to end, and the offsets it read down to.
func (c *callLog) before(key ledger.CallKey, end int64) ([]ledger.Event, []int64, error) {
	var reached []int64
	evs, err := ledger.CallBefore(c.t.Context(), c.k.Client, c.k.Topics.Events, key, end, nil, func(o int64) { reached = append(reached, o) })
	return evs, reached, err
}

func ids(evs []ledger.Event) []string {
	var got []string
	for _, e := range evs {
		got = append(got, e.EventID)
	}
	return got
}
