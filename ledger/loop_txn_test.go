package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// faultableKafka is the in-process cluster, whatever cluster
// LEDGER_TEST_KAFKA_BROKERS names: the tests inject broker faults.
func faultableKafka(t *testing.T) *ledgertest.Kafka {
	return ledgertest.NewInProcess(t, ledgertest.Options{Partitions: 2})
}

// copyLoop is a loop that copies requests to the events topic; set, if
// any, changes its configuration first.
func copyLoop(t *testing.T, k *ledgertest.Kafka, txn string, set ...func(*ledger.LoopConfig)) *ledger.Loop {
	t.Helper()
	cfg := ledger.LoopConfig{
		Client: k.Client, Group: k.Group("copy"), Topics: []string{k.Topics.Requests},
		TransactionalID: txn, Tick: 50 * time.Millisecond,
		// A fetch in flight is not redone when a partition becomes
		// fetchable: a session resuming at committed offsets would see
		// its records only after franz-go's default 5s fetch wait.
		Opts: []kgo.Opt{kgo.FetchMaxWait(100 * time.Millisecond)},
	}
	for _, s := range set {
		s(&cfg)
	}
	l, err := ledger.NewLoop(cfg, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		var out ledger.Output
		for _, r := range recs {
			out.Records = append(out.Records, &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value})
		}
		return out, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// publishRequests puts n records on the requests topic.
func publishRequests(t *testing.T, k *ledgertest.Kafka, n int) {
	t.Helper()
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	recs := make([]*kgo.Record, n)
	for i := range recs {
		recs[i] = &kgo.Record{Topic: k.Topics.Requests, Key: fmt.Appendf(nil, "k%d", i), Value: []byte("v")}
	}
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// transactionState is the coordinator's state of txn ("Ongoing", ...).
func transactionState(t *testing.T, k *ledgertest.Kafka, txn string) string {
	t.Helper()
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	txs, err := kadm.NewClient(cl).DescribeTransactions(t.Context(), txn)
	if err != nil {
		t.Fatalf("describe transaction %s: %v", txn, err)
	}
	d, ok := txs[txn]
	if !ok || d.Err != nil {
		t.Fatalf("describe transaction %s: %v", txn, d.Err)
	}
	return d.State
}

// A session discarded after EndTxn failed leaves its transaction open,
// with the batch's offsets pending in the group. The next session must
// fence it at once: until the transaction ends, the group's offsets are
// unstable and the new session cannot even learn where to resume, so
// waiting for the broker's transaction timeout (a minute) stalls the
// processor that long.
func TestLoopRestartAfterEndTxnFailureFencesAtOnce(t *testing.T) {
	k := faultableKafka(t)
	const n = 20
	publishRequests(t, k, n)
	f := failCommit(k)
	defer f.Remove()

	loop := copyLoop(t, k, "copy-1")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitCommitted(t, k, n, 15*time.Second)
	if f.Hits() != 1 {
		t.Errorf("EndTxn failed %d times; want 1", f.Hits())
	}
}

// A step whose transaction did not commit has its Abandoned run, once and
// before the batch comes again, and never its Committed; the steps that
// commit have their Committed run and never their Abandoned.
func TestLoopAbandonedRunsForATransactionThatDidNotCommit(t *testing.T) {
	k := faultableKafka(t)
	const n = 20
	publishRequests(t, k, n)
	f := failCommit(k)
	defer f.Remove()

	var (
		mu    sync.Mutex
		trail []string // "step i", "committed i", "abandoned i", in order
	)
	note := func(format string, i int) {
		mu.Lock()
		defer mu.Unlock()
		trail = append(trail, fmt.Sprintf(format, i))
	}
	steps := 0
	loop, err := ledger.NewLoop(ledger.LoopConfig{
		Client: k.Client, Group: k.Group("copy"), Topics: []string{k.Topics.Requests},
		TransactionalID: "copy-1", Tick: 50 * time.Millisecond,
		Opts: []kgo.Opt{kgo.FetchMaxWait(100 * time.Millisecond)},
	}, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		if len(recs) == 0 {
			return ledger.Output{}, nil
		}
		steps++
		i := steps
		note("step %d", i)
		out := ledger.Output{
			Committed: func(context.Context) error { note("committed %d", i); return nil },
			Abandoned: func(context.Context) error { note("abandoned %d", i); return nil },
		}
		for _, r := range recs {
			out.Records = append(out.Records, &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value})
		}
		return out, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	waitCommitted(t, k, n, 15*time.Second)
	cancel()
	<-done

	mu.Lock()
	defer mu.Unlock()
	if f.Hits() != 1 {
		t.Fatalf("EndTxn failed %d times; want 1", f.Hits())
	}
	ended := make(map[int]string)
	abandoned := 0
	for j, e := range trail {
		var what string
		var i int
		if _, err := fmt.Sscanf(e, "%s %d", &what, &i); err != nil {
			t.Fatalf("trail entry %q: %v", e, err)
		}
		if what == "step" {
			continue
		}
		if prev, ok := ended[i]; ok {
			t.Errorf("step %d: %s after %s; want one of them, once", i, what, prev)
		}
		ended[i] = what
		if what == "abandoned" {
			abandoned++
			// Before the redelivery: the next entry after the step's
			// own is this one.
			if j == 0 || trail[j-1] != fmt.Sprintf("step %d", i) {
				t.Errorf("abandoned %d follows %q; want it right after its step, before the batch comes again (trail %q)", i, trail[max(j-1, 0)], trail)
			}
		}
	}
	if abandoned != 1 {
		t.Errorf("%d steps abandoned; want 1, the one whose commit failed (trail %q)", abandoned, trail)
	}
	for i := 1; i <= steps; i++ {
		if ended[i] == "" {
			t.Errorf("step %d neither committed nor abandoned (trail %q)", i, trail)
		}
	}
}

// A process that died mid-commit leaves its transaction open, with the
// batch's offsets pending in the group, and nothing of it aborts it. Its
// successor, with the same transactional id, must fence it before it
// consumes, for the same reason as above.
func TestLoopFencesAPredecessorThatDiedMidCommit(t *testing.T) {
	k := faultableKafka(t)
	const n = 20
	publishRequests(t, k, n)

	// The predecessor: it consumes the batch, produces its copies and
	// commits the offsets into its transaction; its EndTxn fails and
	// it dies without a word.
	pre, err := kgo.NewGroupTransactSession(
		kgo.SeedBrokers(k.Client.Brokers...), kgo.ConsumerGroup(k.Group("copy")), kgo.ConsumeTopics(k.Topics.Requests),
		kgo.TransactionalID("copy-1"), kgo.TransactionTimeout(time.Minute),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.RequireStableFetchOffsets(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
	)
	if err != nil {
		t.Fatal(err)
	}
	var recs []*kgo.Record
	for len(recs) == 0 {
		fs := pre.PollFetches(t.Context())
		if err := fs.Err0(); err != nil {
			t.Fatal(err)
		}
		recs = fs.Records()
	}
	if err := pre.Begin(); err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if err := pre.ProduceSync(t.Context(), &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	f := k.Cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.EndTxn}, TopLevel: true, Err: kerr.InvalidTxnState})
	if _, err := pre.End(t.Context(), kgo.TryCommit); err == nil || f.Hits() != 1 {
		t.Fatalf("predecessor's commit: %v, %d EndTxn failed; want it failed", err, f.Hits())
	}
	pre.Close()
	if got := transactionState(t, k, "copy-1"); got != "Ongoing" {
		t.Fatalf("the predecessor's transaction is %s; want it left open", got)
	}

	loop := copyLoop(t, k, "copy-1")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitCommitted(t, k, n, 15*time.Second)
}

// failCommit fails the cluster's next EndTxn request that commits.
func failCommit(k *ledgertest.Kafka) *kfake.FaultHandle {
	return k.Cluster.Fault(kfake.Fault{
		Keys: []kmsg.Key{kmsg.EndTxn}, TopLevel: true, Err: kerr.InvalidTxnState,
		When: func(r kmsg.Request) bool { return r.(*kmsg.EndTxnRequest).Commit },
	})
}

// waitCommitted waits until the copy group committed n requests.
func waitCommitted(t *testing.T, k *ledgertest.Kafka, n int64, timeout time.Duration) {
	t.Helper()
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ledgertest.WaitFor(t, timeout, func() error {
		got, err := groupCommitted(t.Context(), cl, k.Group("copy"))
		if err != nil {
			return err
		}
		if got < n {
			return fmt.Errorf("the group committed %d of %d requests", got, n)
		}
		return nil
	})
}

// groupCommitted is what group has committed, summed over its partitions.
func groupCommitted(ctx context.Context, cl *kgo.Client, group string) (int64, error) {
	offs, err := kadm.NewClient(cl).FetchOffsets(ctx, group)
	if err != nil {
		return 0, err
	}
	var got int64
	offs.Each(func(o kadm.OffsetResponse) { got += max(o.At, 0) })
	return got, nil
}

// A loop stopped while a transaction is open aborts it: no successor
// with its transactional id may come to fence it, and until it ends every
// read_committed reader of its partitions waits.
func TestLoopShutdownAbortsTheOpenTransaction(t *testing.T) {
	k := faultableKafka(t)
	publishRequests(t, k, 20)
	loop := copyLoop(t, k, "copy-1")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The shutdown comes while the commit is on its way, and the
	// commit never arrives.
	var stopped atomic.Bool
	k.Cluster.ControlKey(int16(kmsg.EndTxn), func(kmsg.Request) (kmsg.Response, error, bool) {
		if stopped.Swap(true) {
			return nil, nil, false
		}
		cancel()
		return nil, errors.New("connection lost with the commit"), true
	})
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the loop did not stop")
	}
	if !stopped.Load() {
		t.Fatal("the loop stopped before its commit")
	}
	if got := transactionState(t, k, "copy-1"); got == "Ongoing" {
		t.Errorf("after the loop stopped its transaction is %s; want it ended", got)
	}
}

// A session that committed before it failed starts the next one after
// the first backoff again: a loop that has run for days must not wait
// ten seconds to recover from its eighth transient error, as if the
// eight had come in a row.
func TestLoopRestartBackoffResetsAfterProgress(t *testing.T) {
	k := faultableKafka(t)
	// Every batch's first commit fails; its retry, in a new session,
	// commits.
	const failures = 8
	var commits atomic.Int64
	f := k.Cluster.Fault(kfake.Fault{
		Keys: []kmsg.Key{kmsg.EndTxn}, TopLevel: true, Err: kerr.InvalidTxnState, Count: failures,
		When: func(r kmsg.Request) bool {
			return r.(*kmsg.EndTxnRequest).Commit && commits.Add(1)%2 == 1
		},
	})
	defer f.Remove()

	loop := copyLoop(t, k, "copy-1")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	defer func() { cancel(); <-done }()

	// Without the reset the restarts wait 0.1s, 0.2s, ... 6.4s (each
	// jittered down to half): the last batches would take seconds.
	for i := range failures {
		publishRequests(t, k, 1)
		waitCommitted(t, k, int64(i+1), 2*time.Second)
	}
	if got := f.Hits(); got != failures {
		t.Errorf("%d commits failed; want %d", got, failures)
	}
}

// A session that fails (here its EndTxn) while the group cannot take its
// LeaveGroup must still leave before the next session joins: a member
// left behind holds the group's rebalance until its session timeout
// (franz-go's 45 s), and nothing is consumed meanwhile. The leave is
// refused three times; the copy must still finish long before 45 s.
func TestLoopFailedSessionLeavesItsGroup(t *testing.T) {
	k := faultableKafka(t)
	const n = 20
	publishRequests(t, k, n)
	endTxn := k.Cluster.Fault(kfake.Fault{
		Keys: []kmsg.Key{kmsg.EndTxn}, TopLevel: true, Err: kerr.InvalidTxnState,
		When: func(r kmsg.Request) bool { return r.(*kmsg.EndTxnRequest).Commit },
	})
	defer endTxn.Remove()
	// Not retriable, so that the client's own leave gives up at once,
	// as it does (after its retries) while the broker cannot be dialled.
	leave := k.Cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.LeaveGroup}, TopLevel: true, Err: kerr.UnknownServerError, Count: 3})
	defer leave.Remove()

	loop := copyLoop(t, k, "copy-leave")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitCommitted(t, k, n, 20*time.Second)
	if endTxn.Hits() != 1 || leave.Hits() != 3 {
		t.Errorf("EndTxn failed %d times, LeaveGroup %d; want 1 and 3", endTxn.Hits(), leave.Hits())
	}
}

// A failed session that shuts down while the group still refuses its
// leave sends it once more on the way out: otherwise the group keeps the
// member until its session timeout, and the process that starts next
// waits that long to be given partitions.
func TestLoopFailedSessionLeavesItsGroupAtShutdown(t *testing.T) {
	k := faultableKafka(t)
	publishRequests(t, k, 20)
	endTxn := k.Cluster.Fault(kfake.Fault{
		Keys: []kmsg.Key{kmsg.EndTxn}, TopLevel: true, Err: kerr.InvalidTxnState,
		When: func(r kmsg.Request) bool { return r.(*kmsg.EndTxnRequest).Commit },
	})
	defer endTxn.Remove()
	var refuse atomic.Bool
	refuse.Store(true)
	leave := k.Cluster.Fault(kfake.Fault{
		Keys: []kmsg.Key{kmsg.LeaveGroup}, TopLevel: true, Err: kerr.UnknownServerError, Count: -1,
		When: func(kmsg.Request) bool { return refuse.Load() },
	})
	defer leave.Remove()

	loop := copyLoop(t, k, "copy-leave-shutdown")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()

	// The client's own leave and two of the loop's were refused; the
	// loop now waits 400 ms before its next. Shutdown comes then, and
	// the group would take a leave again.
	ledgertest.WaitFor(t, 20*time.Second, func() error {
		if n := leave.Hits(); n < 3 {
			return fmt.Errorf("%d leaves refused; want 3", n)
		}
		return nil
	})
	refuse.Store(false)
	cancel()
	select {
	case err := <-done:
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after shutdown")
	}

	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	groups, err := kadm.NewClient(cl).DescribeGroups(t.Context(), k.Group("copy"))
	if err != nil {
		t.Fatal(err)
	}
	g := groups[k.Group("copy")]
	if g.Err != nil {
		t.Fatal(g.Err)
	}
	if len(g.Members) != 0 {
		t.Errorf("group %s has %d members after its only member shut down; want none (state %s)", g.Group, len(g.Members), g.State)
	}
}

// Buffered counts the records a session fetched that no poll returned
// yet, which the executor reads to tell whether more work is waiting; it
// is 0 with no live session.
func TestLoopBuffered(t *testing.T) {
	k := faultableKafka(t)
	publishRequests(t, k, 20)
	var (
		l    *ledger.Loop
		seen = make(chan int64, 1)
	)
	l, err := ledger.NewLoop(ledger.LoopConfig{
		Client: k.Client, Group: k.Group("buffered"), Topics: []string{k.Topics.Requests},
		TransactionalID: "buffered", Tick: 50 * time.Millisecond, MaxPollRecords: 1,
	}, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		if len(recs) > 0 {
			select {
			case seen <- l.Buffered():
			default:
			}
		}
		return ledger.Output{}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	select {
	case n := <-seen:
		// 20 records fetched, one polled.
		if n < 1 {
			t.Errorf("Buffered in the first step = %d; want the fetched records not yet polled", n)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no step saw a record")
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	if n := l.Buffered(); n != 0 {
		t.Errorf("Buffered after Run = %d; want 0", n)
	}
}

// runCopyGroupLoop runs a loop of the copy group on the requests topic
// with step and cfg's Tick, Linger and Metrics until the test ends, and
// returns a function that publishes one record to the requests topic.
func runCopyGroupLoop(t *testing.T, k *ledgertest.Kafka, cfg ledger.LoopConfig, step ledger.Step) (publish func(key, value string)) {
	t.Helper()
	cfg.Client, cfg.Group, cfg.Topics = k.Client, k.Group("copy"), []string{k.Topics.Requests}
	cfg.TransactionalID = "copy-1"
	cfg.Opts = []kgo.Opt{kgo.FetchMaxWait(100 * time.Millisecond)}
	l, err := ledger.NewLoop(cfg, step)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return func(key, value string) {
		t.Helper()
		r := &kgo.Record{Topic: k.Topics.Requests, Key: []byte(key), Value: []byte(value)}
		if err := cl.ProduceSync(t.Context(), r).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
}

// consumedCounter counts the records the loop's transactions committed,
// and those reported deleted unread (how many, in how many reports).
type consumedCounter struct{ n, deleted, reports, skipped atomic.Int64 }

func (c *consumedCounter) Committed(consumed int, _ []*kgo.Record, _, _ time.Duration) {
	c.n.Add(int64(consumed))
}
func (c *consumedCounter) NotCommitted(string) {}
func (c *consumedCounter) RecordsDeleted(_ string, n int64) {
	c.deleted.Add(n)
	c.reports.Add(1)
}
func (c *consumedCounter) BatchSkipped(string) { c.skipped.Add(1) }

// A batch that decompresses past the loop's bound (a few kilobytes of
// gzip that would be 3 MiB, here, against a 1 MiB bound; gigabytes from
// a hostile producer) is skipped unread: the step never sees it, the
// records LoopConfig.Skipped returns for it are appended, and the
// offset past it is committed with them, once; the records after it
// are processed. Before, franz-go decompressed any batch of up to 1 GiB
// (the process ran out of memory on each instance in turn) and stopped
// the partition for good past that.
func TestLoopSkipsABatchPastItsBound(t *testing.T) {
	// Without LoopConfig.Skipped (the executor's loops), the offsets
	// past the batch are committed all the same, by a transaction of
	// their own when nothing follows the batch.
	for _, tc := range []struct{ hook, after bool }{{true, true}, {false, true}, {false, false}} {
		t.Run(fmt.Sprintf("hook %v, a record after %v", tc.hook, tc.after), func(t *testing.T) { skipsABatch(t, tc.hook, tc.after) })
	}
}

func skipsABatch(t *testing.T, hook, after bool) {
	k := faultableKafka(t)
	rq := k.Topics.Requests
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerBatchCompression(kgo.GzipCompression()), kgo.ProducerBatchMaxBytes(4<<20), kgo.ProducerLinger(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	big := make([]byte, 1<<20)
	bomb := []*kgo.Record{
		{Topic: rq, Partition: 0, Key: []byte("big0"), Value: big},
		{Topic: rq, Partition: 0, Key: []byte("big1"), Value: big},
		{Topic: rq, Partition: 0, Key: []byte("big2"), Value: big},
	}
	if err := cl.ProduceSync(t.Context(), bomb...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	want := []string{"after"}
	if after {
		if err := cl.ProduceSync(t.Context(), &kgo.Record{Topic: rq, Partition: 0, Key: []byte("after"), Value: []byte("v")}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	} else {
		want = nil
	}

	var logs ledgertest.LogBuffer
	metrics := &consumedCounter{}
	var (
		mu      sync.Mutex
		seen    []string
		skipped [][2]int64
	)
	cfg := ledger.LoopConfig{Tick: 50 * time.Millisecond, Metrics: metrics, MaxBatchBytes: 1 << 20, Logger: slog.New(slog.NewJSONHandler(&logs, nil))}
	if hook {
		cfg.Skipped = func(topic string, partition int32, from, next int64) []*kgo.Record {
			mu.Lock()
			defer mu.Unlock()
			skipped = append(skipped, [2]int64{from, next})
			return []*kgo.Record{ledger.DLQBatchRecord(k.Topics.DLQ, topic, partition, from, next, 1<<20)}
		}
	}
	runCopyGroupLoop(t, k, cfg, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		mu.Lock()
		defer mu.Unlock()
		for _, r := range recs {
			seen = append(seen, string(r.Key))
		}
		return ledger.Output{}, nil
	})
	waitCommitted(t, k, 3+int64(len(want)), 20*time.Second)
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(seen, want) {
		t.Errorf("the step saw %q; want %q, the batch's never", seen, want)
	}
	if metrics.skipped.Load() != 1 {
		t.Errorf("%d batches counted skipped; want 1", metrics.skipped.Load())
	}
	if line := logs.String(); !strings.Contains(line, `"level":"ERROR"`) || !strings.Contains(line, "batch skipped unread") || !strings.Contains(line, `"to_offset":3`) {
		t.Errorf("log %s; want the skipped batch at Error, with its offsets", line)
	}
	if !hook {
		return
	}
	if len(skipped) != 1 || skipped[0] != [2]int64{0, 3} {
		t.Errorf("Skipped called for %v; want offsets 0 to 3, once", skipped)
	}
	dlq := readCommitted(t, k, k.Topics.DLQ, 1)
	if reason := string(ledger.Header(dlq[0], ledger.HeaderDLQReason)); reason != ledger.ReasonBatchTooLarge || string(ledger.Header(dlq[0], ledger.HeaderDLQSource)) != rq+"/0/0" {
		t.Errorf("DLQ record reason %q source %q; want %s at %s/0/0", reason, ledger.Header(dlq[0], ledger.HeaderDLQSource), ledger.ReasonBatchTooLarge, rq)
	}
}

// readCommitted reads n committed records of topic from its start.
func readCommitted(t *testing.T, k *ledgertest.Kafka, topic string, n int) []*kgo.Record {
	t.Helper()
	cl, err := ledger.NewClient(k.Client, kgo.ConsumeTopics(topic), kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if err := fs.Err0(); err != nil {
			t.Fatalf("read %s: %d of %d records: %v", topic, len(out), n, err)
		}
		out = append(out, fs.Records()...)
	}
	return out
}
