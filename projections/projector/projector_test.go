package projector

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/http/httptest"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// recSink is a Sink that stores the batches it took. hook, if set, runs
// first: an error from it fails the Write and nothing is stored.
type recSink struct {
	mu      sync.Mutex
	batches []projections.Batch
	calls   int
	hook    func(ctx context.Context, call int, b projections.Batch) error
}

func (s *recSink) Write(ctx context.Context, b projections.Batch) error {
	s.mu.Lock()
	s.calls++
	call, hook := s.calls, s.hook
	s.mu.Unlock()
	if hook != nil {
		if err := hook(ctx, call, b); err != nil {
			return err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.batches = append(s.batches, projections.Batch{
		Events: slices.Clone(b.Events), Actions: slices.Clone(b.Actions),
	})
	return nil
}

func (s *recSink) setHook(h func(ctx context.Context, call int, b projections.Batch) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hook = h
}

// events counts the event ids the sink took.
func (s *recSink) events() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int)
	for _, b := range s.batches {
		for _, e := range b.Events {
			out[e.EventID]++
		}
	}
	return out
}

// actions counts the action subjects the sink took.
func (s *recSink) actions() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int)
	for _, b := range s.batches {
		for _, a := range b.Actions {
			out[a.Action.Subject]++
		}
	}
	return out
}

func (s *recSink) all() []projections.Batch {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.batches)
}

// set returns ids as a set, each counted once.
func set(ids ...string) map[string]int {
	out := make(map[string]int)
	for _, id := range ids {
		out[id] = 1
	}
	return out
}

// once returns the keys of m, each counted once.
func once(m map[string]int) map[string]int {
	return set(slices.Collect(maps.Keys(m))...)
}

func ids(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%03d", prefix, i)
	}
	return out
}

func eventRecord(t testing.TB, topic, id string) *kgo.Record {
	t.Helper()
	e := ledger.Event{
		EventID: id, Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(), Actor: "intake",
		TenantID: "t_a", IdempotencyKey: "key-" + id, Tool: "refund_order",
	}
	r, err := e.Record(topic)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func eventRecords(t testing.TB, topic string, ids []string) []*kgo.Record {
	out := make([]*kgo.Record, len(ids))
	for i, id := range ids {
		out[i] = eventRecord(t, topic, id)
	}
	return out
}

func actionRecord(t testing.TB, topic, tool string) *kgo.Record {
	t.Helper()
	a := ledger.ControlAction{
		V: 1, Kind: "freeze", Subject: "tool:" + tool, Tool: tool,
		By: "op_root", ByTenant: "*", Reason: "test", At: time.Now().UTC(),
	}
	b, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	return &kgo.Record{Topic: topic, Key: []byte(a.Subject), Value: b}
}

// produce appends recs outside a transaction.
func produce(t testing.TB, k *ledgertest.Kafka, recs ...*kgo.Record) {
	t.Helper()
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// spread sets the records' partitions round robin over n partitions.
func spread(recs []*kgo.Record, n int32) []*kgo.Record {
	for i, r := range recs {
		r.Partition = int32(i) % n
	}
	return recs
}

// beginTxn opens a transaction and appends recs in it, leaving it open.
func beginTxn(t testing.TB, k *ledgertest.Kafka, id string, recs ...*kgo.Record) *kgo.Client {
	t.Helper()
	cl, err := ledger.NewClient(k.Client, kgo.TransactionalID(id), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	if err := cl.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatalf("produce in transaction %s: %v", id, err)
	}
	return cl
}

func endTxn(t testing.TB, cl *kgo.Client, how kgo.TransactionEndTry) {
	t.Helper()
	if err := cl.EndTransaction(t.Context(), how); err != nil {
		t.Fatalf("end transaction: %v", err)
	}
}

// produceTxn appends recs in a transaction and commits or aborts it.
func produceTxn(t testing.TB, k *ledgertest.Kafka, id string, how kgo.TransactionEndTry, recs ...*kgo.Record) {
	t.Helper()
	cl := beginTxn(t, k, id, recs...)
	endTxn(t, cl, how)
	cl.Close()
}

func admin(t testing.TB, k *ledgertest.Kafka) *kadm.Client {
	t.Helper()
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return kadm.NewClient(cl)
}

// committed returns the group's committed offsets.
func committed(t testing.TB, adm *kadm.Client, group string) map[string]map[int32]int64 {
	t.Helper()
	os, err := adm.FetchOffsets(t.Context(), group)
	if errors.Is(err, kerr.GroupIDNotFound) {
		return nil
	}
	if err != nil {
		t.Fatalf("fetch offsets: %v", err)
	}
	out := make(map[string]map[int32]int64)
	os.Each(func(o kadm.OffsetResponse) {
		if o.Err == nil && o.At >= 0 {
			if out[o.Topic] == nil {
				out[o.Topic] = make(map[int32]int64)
			}
			out[o.Topic][o.Partition] = o.At
		}
	})
	return out
}

// highWatermarks returns the end offsets of the events and control topics.
func highWatermarks(t testing.TB, adm *kadm.Client, k *ledgertest.Kafka) map[string]map[int32]int64 {
	t.Helper()
	l, err := adm.ListEndOffsets(t.Context(), k.Topics.Events, k.Topics.Control)
	if err == nil {
		err = l.Error()
	}
	if err != nil {
		t.Fatalf("list end offsets: %v", err)
	}
	out := make(map[string]map[int32]int64)
	l.Each(func(o kadm.ListedOffset) {
		if out[o.Topic] == nil {
			out[o.Topic] = make(map[int32]int64)
		}
		out[o.Topic][o.Partition] = o.Offset
	})
	return out
}

// waitCaughtUp waits until the group committed the high watermark of
// every partition that has records.
func waitCaughtUp(t testing.TB, adm *kadm.Client, k *ledgertest.Kafka, group string) {
	t.Helper()
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		ends := highWatermarks(t, adm, k)
		got := committed(t, adm, group)
		for topic, ps := range ends {
			for p, end := range ps {
				if end > 0 && got[topic][p] != end {
					return fmt.Errorf("%s/%d: committed %d, end %d", topic, p, got[topic][p], end)
				}
			}
		}
		return nil
	})
}

// receive waits for a value on ch.
func receive(t testing.TB, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatal("nothing received after 30s")
	}
}

// logRecorder is a slog handler that keeps the records.
type logRecorder struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (h *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (h *logRecorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.recs = append(h.recs, r.Clone())
	return nil
}
func (h *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *logRecorder) WithGroup(string) slog.Handler      { return h }

func (h *logRecorder) records(msg string) []slog.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []slog.Record
	for _, r := range h.recs {
		if r.Message == msg {
			out = append(out, r)
		}
	}
	return out
}

func attrs(r slog.Record) map[string]string {
	out := make(map[string]string)
	r.Attrs(func(a slog.Attr) bool {
		out[a.Key] = a.Value.String()
		return true
	})
	return out
}

// oneError returns the attributes of the one record logged with msg,
// failing t unless there is exactly one and it is at Error.
func oneError(t *testing.T, logs *logRecorder, msg string) map[string]string {
	t.Helper()
	recs := logs.records(msg)
	if len(recs) != 1 || recs[0].Level != slog.LevelError {
		t.Fatalf("logged %q %d times (%v); want once, at Error", msg, len(recs), recs)
	}
	return attrs(recs[0])
}

// start runs a projector in group until the test ends or stop is called.
func start(t *testing.T, k *ledgertest.Kafka, group string, sink projections.Sink, mod func(*Config)) (*Projector, func()) {
	t.Helper()
	p := newProjector(t, k, group, sink, mod)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	var stopOnce sync.Once
	stop := func() {
		stopOnce.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run = %v; want nil", err)
				}
			case <-time.After(30 * time.Second):
				t.Error("Run did not return after its context was canceled")
			}
		})
	}
	t.Cleanup(stop)
	return p, stop
}

// newProjector returns a projector in group, its config changed by mod.
func newProjector(t *testing.T, k *ledgertest.Kafka, group string, sink projections.Sink, mod func(*Config)) *Projector {
	t.Helper()
	cfg := Config{Client: k.Client, Topics: k.Topics, Group: group, MaxWait: 50 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	p, err := New(cfg, sink)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// runToStop runs a projector in group until it stops by itself, or for
// 30s, and returns it with what Run returned.
func runToStop(t *testing.T, k *ledgertest.Kafka, group string, sink projections.Sink, mod func(*Config)) (*Projector, error) {
	t.Helper()
	p := newProjector(t, k, group, sink, mod)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	return p, p.Run(ctx)
}

func TestCommittedTransactionsOnly(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	committedIDs, abortedIDs, plainIDs := ids("c", 6), ids("a", 4), ids("p", 3)
	produceTxn(t, k, "txn-commit", kgo.TryCommit, append(spread(eventRecords(t, k.Topics.Events, committedIDs), 4),
		actionRecord(t, k.Topics.Control, "tool_a"))...)
	produceTxn(t, k, "txn-abort", kgo.TryAbort, append(spread(eventRecords(t, k.Topics.Events, abortedIDs), 4),
		actionRecord(t, k.Topics.Control, "tool_b"))...)
	produce(t, k, spread(eventRecords(t, k.Topics.Events, plainIDs), 4)...)

	sink := &recSink{}
	group := k.Group("committed-only")
	p, _ := start(t, k, group, sink, nil)
	// Caught up: every offset, the aborted records' included, is behind
	// the group.
	waitCaughtUp(t, adm, k, group)

	want := set(append(committedIDs, plainIDs...)...)
	if diff := cmp.Diff(want, sink.events()); diff != "" {
		t.Errorf("events written (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(set("tool:tool_a"), sink.actions()); diff != "" {
		t.Errorf("actions written (-want +got):\n%s", diff)
	}
	for _, b := range sink.all() {
		for _, e := range b.Events {
			if e.Produced.IsZero() || e.Offset < 0 {
				t.Errorf("event %s: Produced %v, Offset %d; want both set", e.EventID, e.Produced, e.Offset)
			}
		}
	}
	if m := p.Metrics(); m.Written != int64(len(want)+1) || m.WriteErrors != 0 || m.Undecodable != 0 {
		t.Errorf("Metrics = %+v; want %d written, no errors", m, len(want)+1)
	}
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if l := p.Lag(); l.Records != 0 || l.Time != 0 {
			return fmt.Errorf("Lag = %+v; want 0 once caught up", l)
		}
		return nil
	})
}

func TestCommitOnlyAfterWrite(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("commit-after-write")
	want := ids("e", 20)
	produce(t, k, spread(eventRecords(t, k.Topics.Events, want), 4)...)

	const failures = 3
	var committedWhileFailing atomic.Bool
	sink := &recSink{}
	sink.setHook(func(_ context.Context, call int, _ projections.Batch) error {
		if call > failures {
			return nil
		}
		if len(committed(t, adm, group)) > 0 {
			committedWhileFailing.Store(true)
		}
		return errors.New("projection down")
	})
	p, _ := start(t, k, group, sink, nil)
	waitCaughtUp(t, adm, k, group)

	if committedWhileFailing.Load() {
		t.Error("offsets were committed while the sink failed every write")
	}
	// No rebalance, so no redelivery: each event exactly once.
	if diff := cmp.Diff(set(want...), sink.events()); diff != "" {
		t.Errorf("events written (-want +got):\n%s", diff)
	}
	if m := p.Metrics(); m.WriteErrors != failures || m.Written != int64(len(want)) {
		t.Errorf("Metrics = %+v; want %d write errors, %d written", m, failures, len(want))
	}
}

// bigEventRecords are events of 100 KiB each (their arguments), one per
// id.
func bigEventRecords(t testing.TB, topic string, ids []string) []*kgo.Record {
	t.Helper()
	rng := rand.New(rand.NewPCG(1, 2))
	out := make([]*kgo.Record, len(ids))
	for i, id := range ids {
		// Random, so that compression does not shrink them.
		note := make([]byte, 75<<10)
		for j := range note {
			note[j] = byte(rng.Uint32())
		}
		args, err := json.Marshal(map[string][]byte{"note": note})
		if err != nil {
			t.Fatal(err)
		}
		e := ledger.Event{
			EventID: id, Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(), Actor: "intake",
			TenantID: "t_a", IdempotencyKey: "key-" + id, Tool: "refund_order", Arguments: args,
		}
		if out[i], err = e.Record(topic); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// checkBatchBytes fails unless every batch sink took is within about
// twice bound (it is written once it holds bound, and a fetch brings at
// most about bound), and they were several.
func checkBatchBytes(t *testing.T, sink *recSink, bound int) {
	t.Helper()
	batches := sink.all()
	for i, b := range batches {
		n := 0
		for _, e := range b.Events {
			n += len(e.Arguments)
		}
		if n > 2*bound+200<<10 {
			t.Errorf("batch %d of %d holds %d KiB of arguments; want at most about %d KiB", i, len(batches), n>>10, 2*bound>>10)
		}
	}
	if len(batches) < 3 {
		t.Errorf("%d batches; want at least 3 of 3 MiB bounded by %d KiB", len(batches), bound>>10)
	}
}

// A batch is bounded in bytes as well as in records: large events (a
// requested event carries up to 256 KiB of arguments) are written in
// several batches, not held by the thousand, both by the projector and
// by a replay.
func TestBatchBoundedInBytes(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	adm := admin(t, k)
	want := ids("big", 30)
	for _, r := range bigEventRecords(t, k.Topics.Events, want) {
		produce(t, k, r) // a record batch each: a fetch returns whole ones
	}
	const bound = 512 << 10

	sink := &recSink{}
	group := k.Group("bytes")
	start(t, k, group, sink, func(c *Config) { c.MaxBatchBytes, c.MaxWait = bound, time.Minute })
	waitCaughtUp(t, adm, k, group)
	if diff := cmp.Diff(set(want...), sink.events()); diff != "" {
		t.Errorf("events written (-want +got):\n%s", diff)
	}
	checkBatchBytes(t, sink, bound)

	replayed := &recSink{}
	if _, err := Replay(t.Context(), ReplayConfig{Client: k.Client, Topics: k.Topics, MaxBatchBytes: bound}, replayed, nil); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(set(want...), replayed.events()); diff != "" {
		t.Errorf("events replayed (-want +got):\n%s", diff)
	}
	checkBatchBytes(t, replayed, bound)
}

func TestNewMemberRereadsUncommitted(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("crash")
	first, second := ids("first", 10), ids("second", 10)
	produce(t, k, spread(eventRecords(t, k.Topics.Events, first), 4)...)

	sinkA := &recSink{}
	_, stopA := start(t, k, group, sinkA, nil)
	waitCaughtUp(t, adm, k, group)
	before := committed(t, adm, group)

	// From now on A's writes land but the projector never hears so: a
	// crash between the write and the commit.
	landed := &recSink{}
	sinkA.setHook(func(ctx context.Context, _ int, b projections.Batch) error {
		_ = landed.Write(ctx, b)
		return errors.New("connection reset after the write")
	})
	produce(t, k, spread(eventRecords(t, k.Topics.Events, second), 4)...)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if got := once(landed.events()); !cmp.Equal(got, set(second...)) {
			return fmt.Errorf("landed %v; want every second event", got)
		}
		return nil
	})
	stopA()
	if diff := cmp.Diff(before, committed(t, adm, group)); diff != "" {
		t.Fatalf("offsets moved although no write succeeded (-before +after):\n%s", diff)
	}

	sinkB := &recSink{}
	start(t, k, group, sinkB, nil)
	waitCaughtUp(t, adm, k, group)
	if diff := cmp.Diff(set(second...), once(sinkB.events())); diff != "" {
		t.Errorf("events the new member wrote (-want +got):\n%s", diff)
	}
}

func TestUndecodableRecords(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("undecodable")
	ev, ctl := k.Topics.Events, k.Topics.Control
	recs := []*kgo.Record{
		eventRecord(t, ev, "ok-1"),
		{Topic: ev, Key: []byte("t_a/bad"), Value: []byte("not json")},
		{Topic: ev, Key: []byte("t_a/unversioned"), Value: []byte(`{"event_id":"unversioned","type":"requested","seq":1}`)},
		eventRecord(t, ev, "ok-2"),
		{Topic: ctl, Key: []byte("tool:x"), Value: []byte("{bad")},
		{Topic: ctl, Key: []byte("tool:y")}, // a tombstone
		actionRecord(t, ctl, "tool_c"),
	}
	produce(t, k, recs...) // all on partition 0, in this order

	logs := &logRecorder{}
	sink := &recSink{}
	p, _ := start(t, k, group, sink, func(c *Config) { c.Logger = slog.New(logs) })
	waitCaughtUp(t, adm, k, group)

	if diff := cmp.Diff(set("ok-1", "ok-2"), sink.events()); diff != "" {
		t.Errorf("events written (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(set("tool:tool_c"), sink.actions()); diff != "" {
		t.Errorf("actions written (-want +got):\n%s", diff)
	}
	if got := p.Metrics().Undecodable; got != 4 {
		t.Errorf("Metrics().Undecodable = %d; want 4", got)
	}
	var got []string
	for _, r := range logs.records("undecodable record skipped") {
		a := attrs(r)
		if r.Level != slog.LevelError || a["err"] == "" {
			t.Errorf("log %v %v; want an error with the cause", r.Level, a)
		}
		got = append(got, a["topic"]+"/"+a["partition"]+"/"+a["offset"])
	}
	slices.Sort(got)
	want := []string{ctl + "/0/0", ctl + "/0/1", ev + "/0/1", ev + "/0/2"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("undecodable records logged (-want +got):\n%s", diff)
	}
}

func TestLagAndStatus(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("lag")
	scfg := StatusConfig{Client: k.Client, Topics: k.Topics, Group: group}

	if _, err := Status(t.Context(), scfg); !errors.Is(err, ErrNeverCommitted) {
		t.Errorf("Status of a group that never committed: err = %v; want ErrNeverCommitted", err)
	}

	produce(t, k, spread(eventRecords(t, k.Topics.Events, ids("before", 8)), 4)...)
	var blocked atomic.Bool
	release := make(chan struct{})
	entered := make(chan struct{}, 100)
	sink := &recSink{}
	sink.setHook(func(ctx context.Context, _ int, _ projections.Batch) error {
		if !blocked.Load() {
			return nil
		}
		select {
		case entered <- struct{}{}:
		default:
		}
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	p, _ := start(t, k, group, sink, nil)
	waitCaughtUp(t, adm, k, group)
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if l := p.Lag(); l.Records != 0 || l.Time != 0 {
			return fmt.Errorf("Lag = %+v; want 0", l)
		}
		return nil
	})
	st, err := Status(t.Context(), scfg)
	if err != nil || st.Records != 0 || st.Time != 0 {
		t.Fatalf("Status caught up = %+v, %v; want no lag", st, err)
	}

	// One committed transaction on one partition: its records reach
	// the projector in one fetch, with the high watermark after them.
	blocked.Store(true)
	produceTxn(t, k, "lag-txn", kgo.TryCommit, eventRecords(t, k.Topics.Events, ids("after", 5))...)
	receive(t, entered)
	var lag Lag
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		lag = p.Lag()
		if lag.Records <= 0 || lag.Time <= 0 {
			return fmt.Errorf("Lag = %+v; want > 0 while the sink is blocked", lag)
		}
		return nil
	})
	st, err = Status(t.Context(), scfg)
	if err != nil {
		t.Fatal(err)
	}
	if st.Records != lag.Records {
		t.Errorf("Status lag %d records; Lag %d", st.Records, lag.Records)
	}
	for _, pl := range lag.Partitions {
		i := slices.IndexFunc(st.Partitions, func(ps PartitionStatus) bool {
			return ps.Topic == pl.Topic && ps.Partition == pl.Partition
		})
		if i < 0 {
			t.Errorf("Status has no %s/%d", pl.Topic, pl.Partition)
			continue
		}
		ps := st.Partitions[i]
		if ps.End != pl.End || ps.Records != pl.Records {
			t.Errorf("%s/%d: Status end %d, lag %d; Lag end %d, lag %d", pl.Topic, pl.Partition, ps.End, ps.Records, pl.End, pl.Records)
		}
		if d := ps.Time - pl.Time; (pl.Records > 0) != (ps.Time > 0) || d < -time.Second || d > time.Second {
			t.Errorf("%s/%d: Status lag %s; Lag %s", pl.Topic, pl.Partition, ps.Time, pl.Time)
		}
	}
	if !strings.Contains(st.String(), k.Topics.Events) {
		t.Errorf("Status.String() = %q; want the topics listed", st.String())
	}

	close(release)
	waitCaughtUp(t, adm, k, group)
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if l := p.Lag(); l.Records != 0 || l.Time != 0 {
			return fmt.Errorf("Lag = %+v; want 0 once caught up", l)
		}
		return nil
	})
	st, err = Status(t.Context(), scfg)
	if err != nil || st.Records != 0 || st.Time != 0 {
		t.Errorf("Status caught up = %+v, %v; want no lag", st, err)
	}
}

func TestReplay(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	ev := k.Topics.Events
	committedIDs, plainIDs := ids("c", 5), ids("p", 2)
	produceTxn(t, k, "r-commit", kgo.TryCommit, append(spread(eventRecords(t, ev, committedIDs), 4),
		actionRecord(t, k.Topics.Control, "tool_a"))...)
	produceTxn(t, k, "r-abort", kgo.TryAbort, append(spread(eventRecords(t, ev, ids("a", 3)), 4),
		actionRecord(t, k.Topics.Control, "tool_b"))...)
	produce(t, k, spread(eventRecords(t, ev, plainIDs), 4)...)
	// On partition 0: a transaction that will abort, then one that
	// stays open; the abort marker lands after the open transaction's
	// first record, so the last stable offset sits right after an
	// aborted record whose marker is past it.
	txnA := beginTxn(t, k, "r-interleaved-a", eventRecord(t, ev, "x-aborted"))
	txnB := beginTxn(t, k, "r-open", eventRecord(t, ev, "x-open"))
	endTxn(t, txnA, kgo.TryAbort)

	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	sink := &recSink{}
	var reports []Progress
	logs := &logRecorder{}
	rcfg := ReplayConfig{Client: k.Client, Topics: k.Topics, MaxBatch: 3, Logger: slog.New(logs)}
	prog, err := Replay(ctx, rcfg, sink, func(p Progress) {
		reports = append(reports, p)
	})
	if err != nil {
		t.Fatalf("Replay: %v", err)
	}
	want := set(append(committedIDs, plainIDs...)...)
	if diff := cmp.Diff(want, sink.events()); diff != "" {
		t.Errorf("events replayed (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(set("tool:tool_a"), sink.actions()); diff != "" {
		t.Errorf("actions replayed (-want +got):\n%s", diff)
	}
	if prog.Done != int64(len(want)+1) || prog.Read != prog.Total || !prog.Final {
		t.Errorf("Replay progress = %+v; want Done %d, Read == Total, Final", prog, len(want)+1)
	}
	if len(reports) == 0 || !cmp.Equal(reports[len(reports)-1], prog) {
		t.Errorf("last progress report %+v; want %+v", reports, prog)
	}
	for i, r := range reports[:max(0, len(reports)-1)] {
		if r.Final {
			t.Errorf("report %d of %d is final", i, len(reports))
		}
	}
	// Partition 0 ends in an aborted record that a consumer skips
	// silently: only a direct fetch tells that nothing is left.
	var probed []string
	for _, r := range logs.records("replay: only aborted records left before the end") {
		a := attrs(r)
		probed = append(probed, a["topic"]+"/"+a["partition"])
	}
	if diff := cmp.Diff([]string{ev + "/0"}, probed); diff != "" {
		t.Errorf("partitions ended by a direct fetch (-want +got):\n%s", diff)
	}
	hwm := highWatermarks(t, adm, k)
	if got := prog.Ends[ev][0]; got >= hwm[ev][0] {
		t.Errorf("replayed partition 0 to %d; want below the high watermark %d (the open transaction)", got, hwm[ev][0])
	}

	// The open transaction commits, and more comes; a group set to the
	// replay's ends reads only that.
	endTxn(t, txnB, kgo.TryCommit)
	produce(t, k, spread(eventRecords(t, ev, ids("later", 3)), 4)...)
	group := k.Group("after-replay")
	if err := CommitOffsets(t.Context(), k.Client, group, prog.Ends); err != nil {
		t.Fatalf("CommitOffsets: %v", err)
	}
	after := &recSink{}
	start(t, k, group, after, nil)
	waitCaughtUp(t, adm, k, group)
	if diff := cmp.Diff(set(append(ids("later", 3), "x-open")...), once(after.events())); diff != "" {
		t.Errorf("events after the replay (-want +got):\n%s", diff)
	}
	if err := CommitOffsets(t.Context(), k.Client, group, prog.Ends); !errors.Is(err, ErrGroupActive) {
		t.Errorf("CommitOffsets on a running group: err = %v; want ErrGroupActive", err)
	}
}

// Records the log deleted after the replay listed where to start, before
// it read them (retention moving the log's start meanwhile), stop the
// replay with ErrRecordsDeleted: before, the client went on from the new
// start without a word, and the replay answered that it held every record
// below its ends. Told to skip them (rebuild --force), it goes on and
// counts them. The race is staged with the in-process broker: the records
// are deleted first, and the replay is told the log's old start.
func TestReplayStopsAtDeletedRecords(t *testing.T) {
	t.Parallel()
	c, k := deletedLog(t, "rd", "d", 8)
	ev := k.Topics.Events

	c.ControlKey(int16(kmsg.ListOffsets), ledgertest.StaleStartOffsets)
	sink := &recSink{}
	logs := &logRecorder{}
	var last Progress
	_, err := Replay(t.Context(), ReplayConfig{Client: k.Client, Topics: k.Topics, Logger: slog.New(logs)}, sink, func(p Progress) { last = p })
	if !errors.Is(err, ErrRecordsDeleted) {
		t.Fatalf("Replay past records deleted under it = %v (events written %v); want ErrRecordsDeleted", err, sink.events())
	}
	if !last.Final || !last.Failed || last.Read >= last.Total {
		t.Errorf("last progress report of the failed replay %+v; want Final and Failed, Read short of Total", last)
	}
	if a := oneError(t, logs, "records deleted from the log before the replay read them"); a["topic"] != ev || a["partition"] != "0" || a["next_offset"] != "0" || a["log_start"] != "8" {
		t.Errorf("gap log %v; want %s/0 from offset 0 to the log start 8", a, ev)
	}

	c.ControlKey(int16(kmsg.ListOffsets), ledgertest.StaleStartOffsets)
	sink = &recSink{}
	prog, err := Replay(t.Context(), ReplayConfig{Client: k.Client, Topics: k.Topics, SkipDeleted: true}, sink, nil)
	if err != nil || prog.Deleted != 8 || !cmp.Equal(sink.events(), set("d-008", "d-009")) {
		t.Errorf("Replay skipping deleted records = %+v, %v, events %v; want 8 offsets deleted, d-008 and d-009 written", prog, err, sink.events())
	}
}

// A partition that retention empties while a replay reads the others
// (its log start now its end) stops the replay too, or with SkipDeleted
// counts its records as deleted and ends. The consumer goes on at the new
// log start, where it finds nothing, and before, the replay waited for the
// partition's records for good, warning at every idle poll.
func TestReplayStopsAtAPartitionEmptiedUnderIt(t *testing.T) {
	t.Parallel()
	c, k := deletedLog(t, "re", "e", 10)
	ev := k.Topics.Events
	// A replay that waits for good fails here rather than hang the suite.
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()

	c.ControlKey(int16(kmsg.ListOffsets), ledgertest.StaleStartOffsets)
	logs := &logRecorder{}
	_, err := Replay(ctx, ReplayConfig{Client: k.Client, Topics: k.Topics, Logger: slog.New(logs)}, &recSink{}, nil)
	if !errors.Is(err, ErrRecordsDeleted) {
		t.Fatalf("Replay of a partition emptied under it = %v; want ErrRecordsDeleted", err)
	}
	if a := oneError(t, logs, "records deleted from the log before the replay read them"); a["partition"] != "0" || a["next_offset"] != "0" || a["log_start"] != "10" || a["offsets_lost"] != "10" {
		t.Errorf("gap log %v; want %s/0 from offset 0 to the log start 10", a, ev)
	}

	c.ControlKey(int16(kmsg.ListOffsets), ledgertest.StaleStartOffsets)
	sink := &recSink{}
	prog, err := Replay(ctx, ReplayConfig{Client: k.Client, Topics: k.Topics, SkipDeleted: true}, sink, nil)
	if err != nil || prog.Deleted != 10 || prog.Read != prog.Total || len(sink.events()) != 0 {
		t.Errorf("Replay skipping an emptied partition = %+v, %v, events %v; want its 10 offsets deleted and read, nothing written", prog, err, sink.events())
	}
}

// deletedLog is a cluster of its own whose events topic (of two
// partitions, its topics named with prefix) has ten events in partition 0
// (ids "<id>-000" on, offsets 0 to 9), those before offset at deleted.
func deletedLog(t *testing.T, prefix, id string, at int64) (*kfake.Cluster, *ledgertest.Kafka) {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	k := &ledgertest.Kafka{Client: ledger.ClientConfig{Brokers: c.ListenAddrs()}, Cluster: c,
		Topics: ledger.Topics{Requests: prefix + ".requests", Events: prefix + ".events", Control: prefix + ".control", DLQ: prefix + ".dlq"}}
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	if err := ledger.EnsureTopics(t.Context(), cl, ledger.TopicConfig{Topics: k.Topics, Partitions: 2}); err != nil {
		t.Fatal(err)
	}
	ev := k.Topics.Events
	produce(t, k, eventRecords(t, ev, ids(id, 10))...)
	resps, err := admin(t, k).DeleteRecords(t.Context(), kadm.Offsets{ev: {0: {Topic: ev, Partition: 0, At: at, LeaderEpoch: -1}}})
	if err == nil {
		err = resps.Error()
	}
	if err != nil {
		t.Fatalf("delete records: %v", err)
	}
	return c, k
}

func TestReplayEmpty(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	sink := &recSink{}
	prog, err := Replay(t.Context(), ReplayConfig{Client: k.Client, Topics: k.Topics}, sink, nil)
	if err != nil || prog.Done != 0 || prog.Total != 0 || !prog.Final || len(prog.Ends[k.Topics.Events]) != 4 {
		t.Errorf("Replay of empty topics = %+v, %v; want nothing done, four partitions' ends", prog, err)
	}
}

func TestRebalanceLosesNothing(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("rebalance")
	fast := func(c *Config) {
		c.Client.Opts = append(slices.Clone(c.Client.Opts), kgo.HeartbeatInterval(100*time.Millisecond))
	}
	first, second := ids("r1", 40), ids("r2", 40)
	produce(t, k, spread(eventRecords(t, k.Topics.Events, first), 4)...)

	sinkA, sinkB := &recSink{}, &recSink{}
	start(t, k, group, sinkA, fast)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if len(sinkA.events()) == 0 {
			return errors.New("A wrote nothing yet")
		}
		return nil
	})
	start(t, k, group, sinkB, fast)
	// B joins; the group rebalances; what comes next is split.
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		st, err := Status(t.Context(), StatusConfig{Client: k.Client, Topics: k.Topics, Group: group})
		if err != nil || st.Members != 2 || st.State != "Stable" {
			return fmt.Errorf("group %s, %d members, %v; want Stable with 2", st.State, st.Members, err)
		}
		return nil
	})
	produce(t, k, spread(eventRecords(t, k.Topics.Events, second), 4)...)
	waitCaughtUp(t, adm, k, group)

	all := once(sinkA.events())
	maps.Copy(all, once(sinkB.events()))
	if diff := cmp.Diff(set(append(first, second...)...), all); diff != "" {
		t.Errorf("events written by A or B (-want +got):\n%s", diff)
	}
	if len(sinkB.events()) == 0 {
		t.Error("B wrote nothing; want a share of the partitions")
	}
}

func TestRevokedPartitionsNotCommittedByOldOwner(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("revoked-inflight")
	fast := func(c *Config) {
		c.Client.Opts = append(slices.Clone(c.Client.Opts), kgo.HeartbeatInterval(100*time.Millisecond))
	}
	first, second := ids("f", 16), ids("s", 16)
	produce(t, k, spread(eventRecords(t, k.Topics.Events, first), 4)...)

	// A's first write hangs until released: its batch is in flight
	// while B joins and takes some of A's partitions.
	release, entered := make(chan struct{}), make(chan struct{}, 1)
	sinkA := &recSink{}
	sinkA.setHook(func(ctx context.Context, call int, _ projections.Batch) error {
		if call == 1 {
			entered <- struct{}{}
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
	a, _ := start(t, k, group, sinkA, fast)
	receive(t, entered)
	sinkB := &recSink{}
	b, _ := start(t, k, group, sinkB, fast)
	// B writes the records of its partitions and commits them; then
	// more comes, and B commits past what A holds in flight.
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if len(sinkB.events()) == 0 {
			return errors.New("B wrote nothing yet")
		}
		return nil
	})
	produce(t, k, spread(eventRecords(t, k.Topics.Events, second), 4)...)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		ends, got := highWatermarks(t, adm, k), committed(t, adm, group)
		lag := b.Lag()
		if len(lag.Partitions) == 0 {
			return errors.New("B owns nothing yet")
		}
		for _, pl := range lag.Partitions {
			if pl.Topic == k.Topics.Events && got[pl.Topic][pl.Partition] != ends[pl.Topic][pl.Partition] {
				return fmt.Errorf("B's %s/%d committed at %d, end %d", pl.Topic, pl.Partition, got[pl.Topic][pl.Partition], ends[pl.Topic][pl.Partition])
			}
		}
		return nil
	})

	// A's write returns: it must commit only the partitions it still
	// owns, or it would rewind B's.
	close(release)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if a.Metrics().Batches == 0 {
			return errors.New("A's write has not returned")
		}
		return nil
	})
	a.commitMu.Lock() // wait for A's commit to end
	a.commitMu.Unlock()
	waitCaughtUp(t, adm, k, group)
	all := once(sinkA.events())
	maps.Copy(all, once(sinkB.events()))
	if diff := cmp.Diff(set(append(first, second...)...), all); diff != "" {
		t.Errorf("events written by A or B (-want +got):\n%s", diff)
	}
}

// sampleRE is a Prometheus text exposition sample line.
var sampleRE = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$`)

func TestMetricsEndpoint(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("metrics")
	produce(t, k, append(spread(eventRecords(t, k.Topics.Events, ids("m", 8)), 4),
		&kgo.Record{Topic: k.Topics.Events, Value: []byte("garbage")})...)
	p, _ := start(t, k, group, &recSink{}, nil)
	waitCaughtUp(t, adm, k, group)
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if l := p.Lag(); l.Records != 0 || len(l.Partitions) == 0 {
			return fmt.Errorf("Lag = %+v; want partitions, caught up", l)
		}
		return nil
	})

	rec := httptest.NewRecorder()
	p.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if ct := rec.Header().Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Errorf("Content-Type = %q; want text/plain", ct)
	}
	samples := make(map[string]float64)
	sc := bufio.NewScanner(rec.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "# HELP ") || strings.HasPrefix(line, "# TYPE ") {
			continue
		}
		m := sampleRE.FindStringSubmatch(line)
		if m == nil {
			t.Errorf("line does not parse: %q", line)
			continue
		}
		if !strings.Contains(m[2], `role="projector"`) {
			t.Errorf("line %q: no role label; want role=\"projector\", as the other roles' series", line)
		}
		v, err := strconv.ParseFloat(m[4], 64)
		if err != nil {
			t.Errorf("line %q: value: %v", line, err)
		}
		samples[m[1]] += v
	}
	for name, want := range map[string]float64{
		"ledger_projector_lag_records":               0,
		"ledger_projector_lag_seconds":               0,
		"ledger_projector_written_records_total":     8,
		"ledger_projector_batches_total":             -1,
		"ledger_projector_write_errors_total":        0,
		"ledger_projector_undecodable_records_total": 1,
		"ledger_projector_latency_seconds_bucket":    -1,
		"ledger_projector_latency_seconds_count":     8,
		"ledger_projector_latency_seconds_sum":       -1,
	} {
		got, ok := samples[name]
		switch {
		case !ok:
			t.Errorf("no %s sample", name)
		case want >= 0 && got != want:
			t.Errorf("%s = %v; want %v", name, got, want)
		}
	}
}

func TestHistogramQuantile(t *testing.T) {
	t.Parallel()
	var h Histogram
	if got := h.Quantile(0.5); got != 0 {
		t.Errorf("empty Quantile(0.5) = %s; want 0", got)
	}
	for i := 1; i <= 1000; i++ {
		h.Observe(time.Duration(i) * time.Millisecond)
	}
	h.Observe(-time.Second) // a clock behind the record: counts as 0
	for _, tc := range []struct {
		q    float64
		want time.Duration
	}{
		{0.5, 500 * time.Millisecond},
		{0.99, 990 * time.Millisecond},
		{1, time.Second},
	} {
		got := h.Quantile(tc.q)
		if got < tc.want || float64(got) > float64(tc.want)*1.1 {
			t.Errorf("Quantile(%v) = %s; want %s, at most 10%% over", tc.q, got, tc.want)
		}
	}
	if h.Count() != 1001 {
		t.Errorf("Count() = %d; want 1001", h.Count())
	}
	if got := h.Quantile(0.0001); got > time.Microsecond {
		t.Errorf("Quantile(0.0001) = %s; want at most 1µs, the first bucket (the negative observation)", got)
	}
}

func TestBar(t *testing.T) {
	t.Parallel()
	p := Progress{Done: 1234567, Total: 5000000, Read: 1235000, Rate: 210000, ETA: 18 * time.Second, Elapsed: time.Second}
	if got, want := barLine("rebuild", p), "rebuild: 1234567/5000000 records (24.7%) 210k/s ETA 18s"; got != want {
		t.Errorf("barLine = %q; want %q", got, want)
	}

	var b strings.Builder
	bar := newBar(&b, "rebuild", false)
	for _, s := range []int{1, 4, 6, 8, 12} {
		p.Elapsed = time.Duration(s) * time.Second
		bar(p)
	}
	p.Done, p.Read, p.Final, p.Elapsed = 4999000, 5000000, true, 23*time.Second
	bar(p)
	lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
	want := []string{
		"rebuild: 1234567/5000000 records (24.7%) 210k/s ETA 18s",
		"rebuild: 1234567/5000000 records (24.7%) 210k/s ETA 18s",
		"rebuild: done, 4999000 records written (5000000 offsets read) in 23s, 210k/s",
	}
	if diff := cmp.Diff(want, lines); diff != "" {
		t.Errorf("lines every 5s and the last (-want +got):\n%s", diff)
	}
	// A replay that failed is not done, and read only part of the log:
	// before, it said done, and counted the whole log read.
	failed := Progress{Done: 1000, Total: 5000000, Read: 1200, Rate: 210000, Elapsed: 23 * time.Second, Final: true, Failed: true}
	if got, want := barLine("rebuild", failed), "rebuild: stopped, 1000 records written (1200 of 5000000 offsets read) in 23s, 210k/s"; got != want {
		t.Errorf("barLine of a failed replay = %q; want %q", got, want)
	}

	b.Reset()
	bar = newBar(&b, "rebuild", true)
	p.Final = false
	bar(p)
	p.Final = true
	bar(p)
	if got := b.String(); strings.Count(got, "\r") != 2 || !strings.HasSuffix(got, "\n") || strings.Count(got, "\n") != 1 {
		t.Errorf("terminal output %q; want two redraws and a final newline", got)
	}
}

// A record of a newer encoding is not skipped: the projector writes and
// commits what came before it, and stops with ErrNewerRecord; so does a
// replay. Also when the newer encoding changed a field's type, which this
// build cannot decode at all: before, that one was counted undecodable
// and skipped.
func TestNewerRecordStops(t *testing.T) {
	t.Parallel()
	for name, future := range map[string]string{
		"fields as known":    `{"v":99,"event_id":"future","type":"requested","seq":1}`,
		"a field's new type": `{"v":99,"event_id":"future","type":"requested","seq":"first","at":1700000000}`,
	} {
		t.Run(name, func(t *testing.T) { t.Parallel(); newerRecordStops(t, future) })
	}
}

func newerRecordStops(t *testing.T, future string) {
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("newer")
	ev := k.Topics.Events
	produce(t, k,
		eventRecord(t, ev, "before"),
		&kgo.Record{Topic: ev, Key: []byte("t_a/future"), Value: []byte(future)},
		eventRecord(t, ev, "after"),
	) // all on partition 0, in this order

	sink := &recSink{}
	if _, err := runToStop(t, k, group, sink, nil); !errors.Is(err, ErrNewerRecord) {
		t.Fatalf("Run = %v; want ErrNewerRecord", err)
	}
	if diff := cmp.Diff(set("before"), sink.events()); diff != "" {
		t.Errorf("events written (-want +got):\n%s", diff)
	}
	if got := committed(t, adm, group)[ev][0]; got != 1 {
		t.Errorf("committed offset of %s/0 = %d; want 1, before the newer record", ev, got)
	}
	if _, err := Replay(t.Context(), ReplayConfig{Client: k.Client, Topics: k.Topics}, &recSink{}, nil); !errors.Is(err, ErrNewerRecord) {
		t.Errorf("Replay = %v; want ErrNewerRecord", err)
	}
}

// Records the log deleted (retention, DeleteRecords) before the projector
// read them are not skipped silently: the projector logs the gap at
// Error, counts it, writes and commits nothing of the partition past it,
// and stops with ErrRecordsDeleted, at every start, until the group is
// moved past the gap.
func TestDeletedRecordsStop(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("deleted")
	ev := k.Topics.Events
	produce(t, k, eventRecords(t, ev, ids("d", 10))...) // partition 0, offsets 0 to 9
	// The group projected offsets 0 and 1; then, while it was down,
	// retention deleted everything before offset 8.
	if err := CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 2}}); err != nil {
		t.Fatal(err)
	}
	resps, err := adm.DeleteRecords(t.Context(), kadm.Offsets{ev: {0: {Topic: ev, Partition: 0, At: 8, LeaderEpoch: -1}}})
	if err == nil {
		err = resps.Error()
	}
	if err != nil {
		t.Fatalf("delete records: %v", err)
	}

	for run := 1; run <= 2; run++ {
		logs := &logRecorder{}
		sink := &recSink{}
		p, err := runToStop(t, k, group, sink, func(c *Config) { c.Logger = slog.New(logs) })
		if !errors.Is(err, ErrRecordsDeleted) {
			t.Fatalf("run %d: Run = %v; want ErrRecordsDeleted", run, err)
		}
		if got := sink.events(); len(got) != 0 {
			t.Errorf("run %d: events written %v; want none of a partition past its gap", run, got)
		}
		if got := committed(t, adm, group)[ev][0]; got != 2 {
			t.Errorf("run %d: committed offset of %s/0 = %d; want 2, before the gap", run, ev, got)
		}
		if got := p.Metrics().Gaps; got != 1 {
			t.Errorf("run %d: Metrics().Gaps = %d; want 1", run, got)
		}
		if a := oneError(t, logs, "records deleted from the log before they were projected"); a["topic"] != ev || a["partition"] != "0" || a["next_offset"] != "2" || a["log_start"] != "8" {
			t.Errorf("run %d: gap log %v; want %s/0 from offset 2 to the log start 8", run, a, ev)
		}
	}

	// A human accepts the loss: the group goes on from the log start.
	if err := CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 8}}); err != nil {
		t.Fatal(err)
	}
	sink := &recSink{}
	p, _ := start(t, k, group, sink, nil)
	waitCaughtUp(t, adm, k, group)
	if diff := cmp.Diff(set("d-008", "d-009"), sink.events()); diff != "" {
		t.Errorf("events written past the accepted gap (-want +got):\n%s", diff)
	}
	if got := p.Metrics().Gaps; got != 0 {
		t.Errorf("Metrics().Gaps = %d past the accepted gap; want 0", got)
	}
}

// While writes fail the projector polls nothing, yet its lag keeps up
// with the log, as Status reads it from the brokers, and covers every
// assigned partition, those no fetch returned records of included.
func TestLagGrowsWhileWritesFail(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	group := k.Group("lag-down")
	ev := k.Topics.Events
	produce(t, k, eventRecords(t, ev, ids("first", 5))...) // partition 0
	sink := &recSink{}
	writing := make(chan struct{}, 1)
	sink.setHook(func(context.Context, int, projections.Batch) error {
		select {
		case writing <- struct{}{}:
		default:
		}
		return errors.New("clickhouse is down")
	})
	p, _ := start(t, k, group, sink, func(c *Config) { c.LagRefresh = 50 * time.Millisecond })
	receive(t, writing)
	produce(t, k, spread(eventRecords(t, ev, ids("later", 500)), 4)...)

	scfg := StatusConfig{Client: k.Client, Topics: k.Topics, Group: group}
	ledgertest.WaitFor(t, 15*time.Second, func() error {
		st, err := Status(t.Context(), scfg)
		if err != nil && !errors.Is(err, ErrNeverCommitted) {
			return err
		}
		lag := p.Lag()
		if lag.Records != 505 || st.Records != 505 || len(lag.Partitions) != len(st.Partitions) {
			return fmt.Errorf("Lag %d records over %d partitions, Status %d over %d; want 505 over every partition in both",
				lag.Records, len(lag.Partitions), st.Records, len(st.Partitions))
		}
		for i, pl := range lag.Partitions {
			if ps := st.Partitions[i]; pl.Topic != ps.Topic || pl.Partition != ps.Partition || pl.End != ps.End || pl.Records != ps.Records {
				return fmt.Errorf("Lag %+v; Status %+v", pl, ps)
			}
		}
		return nil
	})
}

// An event of a type the state machine does not know is projected (its
// call's trace shows it) and counted and logged at Error, by the
// projector and by a replay: the projections keep its call's last known
// state.
func TestUnknownEventTypes(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	adm := admin(t, k)
	group := k.Group("unknown-types")
	ev := k.Topics.Events
	future := ledger.Event{EventID: "future", Type: "escalated_to_legal", Seq: 2, At: time.Now().UTC(), Actor: "future",
		TenantID: "t_a", IdempotencyKey: "key-known", Tool: "refund_order"}
	rec, err := future.Record(ev)
	if err != nil {
		t.Fatal(err)
	}
	produce(t, k, eventRecord(t, ev, "known"), rec) // partition 0, offsets 0 and 1

	logs := &logRecorder{}
	sink := &recSink{}
	p, _ := start(t, k, group, sink, func(c *Config) { c.Logger = slog.New(logs) })
	waitCaughtUp(t, adm, k, group)
	if diff := cmp.Diff(set("known", "future"), sink.events()); diff != "" {
		t.Errorf("events written (-want +got):\n%s", diff)
	}
	if got := p.Metrics().UnknownTypes; got != 1 {
		t.Errorf("Metrics().UnknownTypes = %d; want 1", got)
	}
	if a := oneError(t, logs, "event of an unknown type: its call keeps its last known state"); a["type"] != "escalated_to_legal" || a["offset"] != "1" || a["call_key"] != "t_a/key-known" {
		t.Errorf("unknown type log %v; want the type, the offset and the call", a)
	}

	prog, err := Replay(t.Context(), ReplayConfig{Client: k.Client, Topics: k.Topics}, &recSink{}, nil)
	if err != nil || prog.UnknownTypes != 1 {
		t.Errorf("Replay = %d unknown types, %v; want 1, nil", prog.UnknownTypes, err)
	}
}

// One poll may hold two fetches of a partition. When the first starts
// past records the log deleted, the second adds nothing either: before,
// the first disarmed the check for the second, whose records were then
// written and committed past the gap, and the next start found no gap.
func TestGapHaltsEveryFetchOfThePartition(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	p := newProjector(t, k, k.Group("gap-two-fetches"), &recSink{}, nil)
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ev := k.Topics.Events
	recs := eventRecords(t, ev, ids("g", 4))
	for i, r := range recs {
		r.Partition, r.Offset = 0, int64(8+i)
	}
	// The group's next record is offset 2; the log starts at 8.
	p.mu.Lock()
	p.state(topicPartition{ev, 0}).next = 2
	p.mu.Unlock()
	part := func(rs []*kgo.Record) kgo.FetchPartition {
		return kgo.FetchPartition{Partition: 0, LogStartOffset: 8, HighWatermark: 12, Records: rs}
	}
	p.read(cl, kgo.Fetches{{Topics: []kgo.FetchTopic{{Topic: ev, Partitions: []kgo.FetchPartition{part(recs[:2]), part(recs[2:])}}}}})
	if !errors.Is(p.stop, ErrRecordsDeleted) {
		t.Errorf("stop = %v; want ErrRecordsDeleted", p.stop)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if n := len(p.pending.batch.Events); n != 0 || p.pending.records != 0 {
		t.Errorf("the batch holds %d events, %d records; want none of a partition past its gap", n, p.pending.records)
	}
}

// A revocation takes its partitions' bytes off the batch as well as their
// records: a batch full by bytes that a revocation empties is no longer
// full. Before, its bytes stayed counted, and the loop, seeing it full and
// nothing in it due, neither polled nor flushed again, spinning.
func TestRevokedPartitionsBytesLeaveTheBatch(t *testing.T) {
	t.Parallel()
	p, err := New(Config{Client: ledger.ClientConfig{Brokers: []string{"127.0.0.1:1"}}, MaxBatchBytes: 1000}, &recSink{})
	if err != nil {
		t.Fatal(err)
	}
	events := p.cfg.Topics.Events
	kept, lost := topicPartition{events, 0}, topicPartition{events, 1}
	p.pending.add(&readPart{tp: kept, records: 2, bytes: 300})
	p.pending.add(&readPart{tp: lost, records: 3, bytes: 900})
	p.pending.started = time.Now()
	if p.pending.bytes < p.cfg.MaxBatchBytes {
		t.Fatalf("batch of %d bytes; the test needs one full by bytes", p.pending.bytes)
	}
	p.revoked(t.Context(), nil, map[string][]int32{events: {1}})
	if b := p.pending; b.records != 2 || b.bytes != 300 {
		t.Errorf("after partition 1's revocation the batch holds %d records, %d bytes; want 2, 300", b.records, b.bytes)
	}
	p.revoked(t.Context(), nil, map[string][]int32{events: {0}})
	if b := p.pending; b.records != 0 || b.bytes != 0 || !b.started.IsZero() {
		t.Errorf("after every partition's revocation the batch holds %d records, %d bytes (started %v); want an empty batch", b.records, b.bytes, b.started)
	}
}

// A control action of a newer encoding is refused as newer even when it
// changed a field's type (it stops the projector); one of a known version
// that does not decode is undecodable.
func TestDecodeActionOfANewerEncoding(t *testing.T) {
	if _, err := DecodeAction([]byte(`{"v":2,"kind":"freeze","at":1700000000}`)); !errors.Is(err, ErrUnsupportedAction) {
		t.Errorf("DecodeAction of a v2 action with a field's new type: %v; want ErrUnsupportedAction", err)
	}
	if _, err := DecodeAction([]byte(`{"v":1,"kind":"freeze","at":1700000000}`)); err == nil || errors.Is(err, ErrUnsupportedAction) {
		t.Errorf("DecodeAction of a v1 action that does not decode: %v; want an error, not ErrUnsupportedAction", err)
	}
}

// The projector hands a projection the event's record value as well as
// the event decoded from it, so that a projection that keeps events keeps
// the log's bytes, fields this build does not know included.
func TestDecodeRecordKeepsTheValue(t *testing.T) {
	topics := ledger.Topics{}.WithDefaults()
	e := ledger.Event{EventID: "ev_1", Type: statemachine.EventRequested, TenantID: "t_a", IdempotencyKey: "k", Seq: 1, At: time.Unix(1_700_000_000, 0).UTC()}
	enc, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	value := append(enc[:len(enc)-1:len(enc)-1], []byte(`,"field_of_a_newer_writer":"kept"}`)...)
	var evs []projections.Event
	var acts []projections.Action
	if err := decodeRecord(&kgo.Record{Topic: topics.Events, Value: value}, topics, &evs, &acts); err != nil {
		t.Fatal(err)
	}
	if len(evs) != 1 || string(evs[0].Raw) != string(value) || evs[0].EventID != "ev_1" {
		t.Errorf("decoded %+v; want ev_1 with the record's value as Raw", evs)
	}
}

// countingCtx is a cancellable context that counts the contexts derived
// from it still registered for its cancellation (context's AfterFunc
// path, which it takes for a parent that is not its own kind).
type countingCtx struct {
	context.Context
	live atomic.Int64
}

func (c *countingCtx) Value(any) any { return nil }

func (c *countingCtx) AfterFunc(f func()) func() bool {
	c.live.Add(1)
	stop := context.AfterFunc(c.Context, f)
	var once sync.Once
	return func() bool {
		once.Do(func() { c.live.Add(-1) })
		return stop()
	}
}

// Each poll's context is released after it: one made for every poll and
// dropped stayed among Run's context's children for as long as Run ran, a
// leak of every poll's (a review's finding).
func TestRunReleasesItsPollContexts(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	inner, cancel := context.WithCancel(context.Background())
	defer cancel()
	ctx := &countingCtx{Context: inner}
	sink := &recSink{}
	p := newProjector(t, k, k.Group("poll-contexts"), sink, func(c *Config) { c.MaxBatch, c.MaxWait = 5, 20*time.Millisecond })
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	for i := range 40 {
		produce(t, k, eventRecords(t, k.Topics.Events, ids(fmt.Sprintf("pc%02d", i), 3))...)
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if n := len(sink.events()); n < 120 {
			return fmt.Errorf("%d of 120 events written", n)
		}
		return nil
	})
	if live := ctx.live.Load(); live > 4 {
		t.Errorf("%d contexts derived from Run's still registered after 40 batches; want the lag refresh's and a poll's at most", live)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
