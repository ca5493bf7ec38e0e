package ledger_test

import (
	"bytes"
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
		return copied(k, recs), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// copied is the output of a step that copies recs to the events topic.
func copied(k *ledgertest.Kafka, recs []*kgo.Record) ledger.Output {
	var out ledger.Output
	for _, r := range recs {
		out.Records = append(out.Records, &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value})
	}
	return out
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
type consumedCounter struct{ n, deleted, reports, skipped, fetchErrors atomic.Int64 }

func (c *consumedCounter) Committed(consumed int, _ []*kgo.Record, _, _ time.Duration) {
	c.n.Add(int64(consumed))
}
func (c *consumedCounter) NotCommitted(string) {}
func (c *consumedCounter) RecordsDeleted(_ string, n int64) {
	c.deleted.Add(n)
	c.reports.Add(1)
}
func (c *consumedCounter) BatchSkipped(string) { c.skipped.Add(1) }
func (c *consumedCounter) FetchFailed(string)  { c.fetchErrors.Add(1) }

// Records the log deleted (retention) before the loop read them are not
// skipped in silence: the loop resumes at the log's start, as it must,
// and says at Error how many it never processed, and counts them, once.
// Before, franz-go's reset to the log start was logged at Info, below
// what the ledger logs: requests went undecided, unseen.
func TestLoopReportsRecordsDeletedUnread(t *testing.T) {
	k := faultableKafka(t)
	p := newPartitionZero(t, k)
	p.produce("k", 10)
	// The group had processed offsets 0 and 1; then, while it was down,
	// retention deleted everything before offset 8.
	p.commit(2)
	p.deleteBefore(8)
	// A tick far longer than the test, and a step that produces nothing:
	// the batches are held, the group's offset stays before the gap, and
	// every poll meets it again.
	logs, metrics, seen := p.holdingLoop()
	ledgertest.WaitFor(t, 20*time.Second, func() error {
		if seen.Load() < 2 || metrics.reports.Load() == 0 {
			return fmt.Errorf("records seen %d, gaps reported %d; want the 2 left, and the gap", seen.Load(), metrics.reports.Load())
		}
		return nil
	})
	p.produce("later", 3)
	waitSeen(t, seen, 5, "the 3 published since too")
	if n, r := metrics.deleted.Load(), metrics.reports.Load(); n != 6 || r != 1 {
		t.Errorf("reported %d records deleted in %d reports; want 6 (offsets 2 to 7), once", n, r)
	}
	line := logs.String()
	if !strings.Contains(line, `"level":"ERROR"`) || !strings.Contains(line, "records deleted from the log before this loop read them") || !strings.Contains(line, `"records_lost":6`) {
		t.Errorf("log %s; want the gap at Error, 6 records lost", line)
	}
}

// Records the loop polled, and holds uncommitted, deleted by retention
// before the next fetch (a loop lagging near the topic's retention) were
// read, not lost: nothing is reported. Before, the gap was measured from
// the group's committed offset, and the loop said at Error, and counted,
// that records it had read (and was about to commit) were never
// processed.
func TestLoopDoesNotCountRecordsItRead(t *testing.T) {
	k := faultableKafka(t)
	p := newPartitionZero(t, k)
	p.produce("k", 5)
	p.commit(0)
	// The batches are held (a tick far longer than the test): the
	// group's offset stays at 0 while the loop reads on.
	logs, metrics, seen := p.holdingLoop()
	waitSeen(t, seen, 5, "the 5 published")
	p.deleteBefore(5)
	p.produce("later", 3)
	waitSeen(t, seen, 8, "the 3 published since too")
	if n, r := metrics.deleted.Load(), metrics.reports.Load(); n != 0 || r != 0 {
		t.Errorf("reported %d records deleted in %d reports; want none: the loop had read them", n, r)
	}
	if line := logs.String(); strings.Contains(line, "records deleted from the log") {
		t.Errorf("log %s; want no gap reported", line)
	}
}

// waitSeen waits until a loop's steps saw n records (what, the last of
// them).
func waitSeen(t *testing.T, seen *atomic.Int64, n int64, what string) {
	t.Helper()
	ledgertest.WaitFor(t, 20*time.Second, func() error {
		if seen.Load() < n {
			return fmt.Errorf("records seen %d; want %s", seen.Load(), what)
		}
		return nil
	})
}

// partitionZero writes to, and commits and deletes on, partition 0 of
// the request topic, for a copy group's loop.
type partitionZero struct {
	t   *testing.T
	k   *ledgertest.Kafka
	cl  *kgo.Client
	adm *kadm.Client
}

func newPartitionZero(t *testing.T, k *ledgertest.Kafka) *partitionZero {
	t.Helper()
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return &partitionZero{t: t, k: k, cl: cl, adm: kadm.NewClient(cl)}
}

// produce writes n records, keyed prefix0...
func (p *partitionZero) produce(prefix string, n int) {
	p.t.Helper()
	for i := range n {
		if err := p.cl.ProduceSync(p.t.Context(), &kgo.Record{Topic: p.k.Topics.Requests, Partition: 0, Key: fmt.Appendf(nil, "%s%d", prefix, i), Value: []byte("v")}).FirstErr(); err != nil {
			p.t.Fatal(err)
		}
	}
}

// commit sets the copy group's committed offset.
func (p *partitionZero) commit(offset int64) {
	p.t.Helper()
	var committed kadm.Offsets
	committed.AddOffset(p.k.Topics.Requests, 0, offset, -1)
	if resps, err := p.adm.CommitOffsets(p.t.Context(), p.k.Group("copy"), committed); err != nil || resps.Error() != nil {
		p.t.Fatalf("commit offsets: %v %v", err, resps.Error())
	}
}

// deleteBefore deletes the records before offset, as retention does.
func (p *partitionZero) deleteBefore(offset int64) {
	p.t.Helper()
	rq := p.k.Topics.Requests
	deleted, err := p.adm.DeleteRecords(p.t.Context(), kadm.Offsets{rq: {0: {Topic: rq, Partition: 0, At: offset, LeaderEpoch: -1}}})
	if err == nil {
		err = deleted.Error()
	}
	if err != nil {
		p.t.Fatalf("delete records: %v", err)
	}
}

// holdingLoop runs the copy group's loop with a step that produces
// nothing and a tick far longer than the test: every batch is held, the
// group's offset stays where it was. It returns the loop's log, its
// metrics and how many records its steps saw.
func (p *partitionZero) holdingLoop() (*ledgertest.LogBuffer, *consumedCounter, *atomic.Int64) {
	logs, metrics, seen := new(ledgertest.LogBuffer), &consumedCounter{}, new(atomic.Int64)
	runCopyGroupLoop(p.t, p.k, ledger.LoopConfig{Tick: time.Hour, Metrics: metrics, Logger: slog.New(slog.NewJSONHandler(logs, nil))},
		func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
			seen.Add(int64(len(recs)))
			return ledger.Output{}, nil
		})
	return logs, metrics, seen
}

// A partition written in transactions, read to its end and then idle
// past its retention, loses the last transaction's commit marker, which
// is where its group resumes: that is no record lost, and is not counted.
func TestLoopDoesNotCountADeletedMarker(t *testing.T) {
	k := faultableKafka(t)
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.TransactionalID("agent-host"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	rq := k.Topics.Requests
	produce := func(key string) {
		t.Helper()
		if err := cl.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		if err := cl.ProduceSync(t.Context(), &kgo.Record{Topic: rq, Partition: 0, Key: []byte(key), Value: []byte("v")}).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if err := cl.EndTransaction(t.Context(), kgo.TryCommit); err != nil {
			t.Fatal(err)
		}
	}
	metrics := &consumedCounter{}
	var seen atomic.Int64
	step := func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		seen.Add(int64(len(recs)))
		var out ledger.Output
		for _, r := range recs {
			out.Records = append(out.Records, &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value})
		}
		return out, nil
	}
	produce("before")
	stop := runLoopUntil(t, k, metrics, step, func() bool { return seen.Load() == 1 && metrics.n.Load() == 1 })
	stop()
	// Retention takes everything, the marker (offset 1) with the record.
	adm := kadm.NewClient(cl)
	deleted, err := adm.DeleteRecords(t.Context(), kadm.Offsets{rq: {0: {Topic: rq, Partition: 0, At: 2, LeaderEpoch: -1}}})
	if err == nil {
		err = deleted.Error()
	}
	if err != nil {
		t.Fatalf("delete records: %v", err)
	}
	produce("after")
	stop = runLoopUntil(t, k, metrics, step, func() bool { return seen.Load() == 2 })
	stop()
	if n := metrics.reports.Load(); n != 0 {
		t.Errorf("%d gaps counted (%d records); want none: only a marker was deleted", n, metrics.deleted.Load())
	}

	// Written without a transaction (as the ledger writes requests), one
	// offset is one record: deleted unread, it is counted. (Partition 1,
	// which no transaction wrote.)
	plain, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	producePlain := func(keys ...string) {
		t.Helper()
		for _, key := range keys {
			if err := plain.ProduceSync(t.Context(), &kgo.Record{Topic: rq, Partition: 1, Key: []byte(key), Value: []byte("v")}).FirstErr(); err != nil {
				t.Fatal(err)
			}
		}
	}
	producePlain("read")
	stop = runLoopUntil(t, k, metrics, step, func() bool { return seen.Load() == 3 && metrics.n.Load() == 3 })
	stop()
	producePlain("lost", "kept") // offsets 1 and 2
	deleted, err = adm.DeleteRecords(t.Context(), kadm.Offsets{rq: {1: {Topic: rq, Partition: 1, At: 2, LeaderEpoch: -1}}})
	if err == nil {
		err = deleted.Error()
	}
	if err != nil {
		t.Fatalf("delete records: %v", err)
	}
	stop = runLoopUntil(t, k, metrics, step, func() bool { return seen.Load() == 4 })
	stop()
	if n, r := metrics.deleted.Load(), metrics.reports.Load(); n != 1 || r != 1 {
		t.Errorf("after one plain record deleted unread: %d records in %d reports; want 1 in 1", n, r)
	}
}

// runLoopUntil runs a loop of the copy group with step until done holds,
// and returns what stops it.
func runLoopUntil(t *testing.T, k *ledgertest.Kafka, metrics *consumedCounter, step ledger.Step, done func() bool) (stop func()) {
	t.Helper()
	l, err := ledger.NewLoop(ledger.LoopConfig{Client: k.Client, Group: k.Group("copy"), Topics: []string{k.Topics.Requests},
		TransactionalID: "copy-1", Tick: 50 * time.Millisecond, Metrics: metrics, Opts: []kgo.Opt{kgo.FetchMaxWait(100 * time.Millisecond)}}, step)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan error, 1)
	go func() { ended <- l.Run(ctx) }()
	ledgertest.WaitFor(t, 20*time.Second, func() error {
		if !done() {
			return errors.New("not yet")
		}
		return nil
	})
	return func() { cancel(); <-ended }
}

// A batch whose step does nothing (records it ignores, as an executor
// reads its own events) gets no transaction of its own: its offsets are
// committed by the next transaction; when the traffic stops, by one an
// idle poll starts; and when ignored records keep coming, by one once
// they have waited a tick.
func TestLoopHoldsIgnoredBatchesForTheNextTransaction(t *testing.T) {
	for _, tc := range []struct {
		name string
		tick time.Duration
	}{
		// A tick far longer than the test: only the next batch with
		// work can commit the ignored ones.
		{"next transaction", time.Hour},
		// Nothing follows the ignored batches: an idle poll commits them.
		{"idle poll", 300 * time.Millisecond},
		// Ignored records keep coming, faster than the tick: no poll is
		// idle, and the held offsets are committed once they waited a
		// tick.
		{"held a tick", 300 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := faultableKafka(t)
			var commits atomic.Int64
			k.Cluster.ControlKey(int16(kmsg.EndTxn), func(r kmsg.Request) (kmsg.Response, error, bool) {
				if r.(*kmsg.EndTxnRequest).Commit {
					commits.Add(1)
				}
				k.Cluster.KeepControl()
				return nil, nil, false
			})
			// records the step saw; batches of ignored records; batches with work
			var seen, ignoredBatches, worked atomic.Int64
			metrics := &consumedCounter{}
			publishKey := runCopyGroupLoop(t, k, ledger.LoopConfig{Tick: tc.tick, Metrics: metrics}, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
				seen.Add(int64(len(recs)))
				var out ledger.Output
				for _, r := range recs {
					if string(r.Value) != "ignore" {
						out.Records = append(out.Records, &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value})
					}
				}
				switch {
				case len(out.Records) > 0:
					worked.Add(1)
				case len(recs) > 0:
					ignoredBatches.Add(1)
				}
				return out, nil
			})
			n := 0 // records published
			publish := func(value string) {
				t.Helper()
				publishKey(fmt.Sprint("k", n), value)
				n++
			}
			// The loop reports a commit to its metrics once EndTxn has
			// returned to it, after the group's offsets show the
			// commit: wait for the report too. A reset before the first
			// record's report leaves that record in the count, and a
			// check before the last report reads the count short.
			waitReported := func(want int64) {
				t.Helper()
				ledgertest.WaitFor(t, 15*time.Second, func() error {
					if got := metrics.n.Load(); got < want {
						return fmt.Errorf("the loop's metrics count %d records committed; want %d", got, want)
					}
					return nil
				})
			}
			// A first record with work, once the loop is in its group
			// and polling; then count from zero.
			publish("copy")
			waitCommitted(t, k, 1, 15*time.Second)
			waitReported(1)
			commits.Store(0)
			worked.Store(0)
			metrics.n.Store(0)

			if tc.name == "held a tick" {
				// 40 ms apart for 3 ticks: the offsets must be committed
				// while the records still come.
				stop := time.Now().Add(3 * tc.tick)
				for time.Now().Before(stop) {
					publish("ignore")
					time.Sleep(40 * time.Millisecond)
				}
				cl, err := ledger.NewClient(k.Client)
				if err != nil {
					t.Fatal(err)
				}
				defer cl.Close()
				got, err := groupCommitted(t.Context(), cl, k.Group("copy"))
				if err != nil {
					t.Fatal(err)
				}
				if got < 2 {
					t.Fatalf("the group committed %d records after %v of ignored records; want them committed a tick after they came", got, 3*tc.tick)
				}
				return
			}
			// Ignored records, one produce each, 5 ms apart: the step
			// sees them in one or more batches.
			const ignored = 10
			for range ignored {
				publish("ignore")
				time.Sleep(5 * time.Millisecond)
			}
			ledgertest.WaitFor(t, 15*time.Second, func() error {
				if got := seen.Load(); got < ignored+1 {
					return fmt.Errorf("the step saw %d of %d records", got, ignored+1)
				}
				return nil
			})
			want := int64(ignored)
			if tc.name == "next transaction" {
				if c := commits.Load(); c != 0 {
					t.Fatalf("%d transactions committed for %d batches of ignored records; want none", c, ignoredBatches.Load())
				}
				publish("copy")
				want++
			}
			waitCommitted(t, k, want+1, 15*time.Second)
			waitReported(want)
			c, w, b := commits.Load(), worked.Load(), ignoredBatches.Load()
			switch tc.name {
			case "next transaction":
				if c != w {
					t.Errorf("%d transactions committed for %d batches with work; want as many", c, w)
				}
			case "idle poll":
				// One for the idle poll; more only if the records came
				// more than a tick apart.
				if c < 1 || c > b {
					t.Errorf("%d transactions committed for %d batches of ignored records; want at least 1 and at most one each", c, b)
				}
			}
			if got := metrics.n.Load(); got != want {
				t.Errorf("the loop's metrics count %d records committed; want %d", got, want)
			}
		})
	}
}

// With Linger the loop waits that long after a poll for more records,
// so that records arriving within it make one step; without, each makes
// its own.
func TestLoopLinger(t *testing.T) {
	for _, linger := range []time.Duration{0, 800 * time.Millisecond} {
		t.Run(fmt.Sprint("linger=", linger), func(t *testing.T) {
			k := faultableKafka(t)
			publish, batches := lingerLoop(t, k, ledger.LoopConfig{Tick: 2 * time.Second, Linger: linger}, nil)
			// Three records 100 ms apart, one partition (one key).
			for i := 1; i <= 3; i++ {
				publish(i)
				time.Sleep(100 * time.Millisecond)
			}
			waitCommitted(t, k, 4, 15*time.Second)
			got := batches()
			if linger > 0 && !slices.Equal(got, []int{3}) {
				t.Errorf("batches %v; want the three records in one step", got)
			}
			if linger == 0 && len(got) < 2 {
				t.Errorf("batches %v without linger; want more than one step", got)
			}
		})
	}
	if _, err := ledger.NewLoop(ledger.LoopConfig{Group: "g", Topics: []string{"t"}, TransactionalID: "x", Tick: time.Second, Linger: time.Second}, nil); err == nil {
		t.Error("a linger as long as the tick was accepted")
	}
}

// A loop's bound on what a batch decompresses to is at least 1 MiB: the
// ledger's own producers write batches of up to 1,000,012 bytes, and a
// loop that skipped one of the events topic's would leave its authorized
// calls unclaimed for good. Before, any bound was taken.
func TestLoopMaxBatchBytesAtLeastTheLedgersBatches(t *testing.T) {
	cfg := func(n int) ledger.LoopConfig {
		return ledger.LoopConfig{Group: "g", Topics: []string{"t"}, TransactionalID: "x", Tick: time.Second, MaxBatchBytes: n}
	}
	if _, err := ledger.NewLoop(cfg(ledger.MinMaxBatchBytes-1), nil); err == nil || !strings.Contains(err.Error(), "1,000,012") {
		t.Errorf("NewLoop with a bound of %d bytes: %v; want it refused, saying why", ledger.MinMaxBatchBytes-1, err)
	}
	if _, err := ledger.NewLoop(cfg(ledger.MinMaxBatchBytes), nil); err != nil {
		t.Errorf("NewLoop with a bound of %d bytes: %v; want it taken", ledger.MinMaxBatchBytes, err)
	}
}

// lingerLoop runs a copy loop with cfg whose step notes the size of each
// batch (after calling during, if set, with it), and returns how to
// publish "v<i>" (all on one partition) and the sizes noted since "v0",
// which it published and saw committed: the loop is in its group and
// polling by then.
func lingerLoop(t *testing.T, k *ledgertest.Kafka, cfg ledger.LoopConfig, during func([]*kgo.Record)) (publish func(i int), batches func() []int) {
	t.Helper()
	var (
		mu    sync.Mutex
		sizes []int
	)
	publishKey := runCopyGroupLoop(t, k, cfg, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		if len(recs) == 0 {
			return ledger.Output{}, nil
		}
		mu.Lock()
		sizes = append(sizes, len(recs))
		mu.Unlock()
		if during != nil {
			during(recs)
		}
		var out ledger.Output
		for _, r := range recs {
			out.Records = append(out.Records, &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value})
		}
		return out, nil
	})
	publish = func(i int) { publishKey("k", fmt.Sprint("v", i)) }
	publish(0)
	waitCommitted(t, k, 1, 15*time.Second)
	mu.Lock()
	sizes = nil
	mu.Unlock()
	return publish, func() []int {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(sizes)
	}
}

// TestLoopLingerFrom: with LingerFrom, a loop lingers after a poll that
// found that many records waiting (they came while a step ran) and runs
// a lone record's step at once; records the step does not act on (Acts)
// do not count.
func TestLoopLingerFrom(t *testing.T) {
	k := faultableKafka(t)
	hold := make(chan struct{})
	acts := func(r *kgo.Record) bool { return strings.HasPrefix(string(r.Value), "v") }
	publish, batches := lingerLoop(t, k, ledger.LoopConfig{Tick: 2 * time.Second, Linger: 800 * time.Millisecond, LingerFrom: 2, Acts: acts}, func(recs []*kgo.Record) {
		if string(recs[0].Value) == "v1" {
			<-hold // the next records arrive while this step runs
		}
	})
	// Released at the latest before the loop stops (cleanups run last
	// first), or a failure before the release would hang the test.
	release := sync.OnceFunc(func() { close(hold) })
	t.Cleanup(release)
	// Records produced together: a fetch brings them together, where
	// records produced apart could come a poll each (franz-go holds a
	// broker's fetch until a poll takes it).
	pair, err := ledger.NewClient(k.Client, kgo.ProducerLinger(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer pair.Close()
	publishPair := func(a, b string) {
		t.Helper()
		if err := pair.ProduceSync(t.Context(),
			&kgo.Record{Topic: k.Topics.Requests, Key: []byte("k"), Value: []byte(a)},
			&kgo.Record{Topic: k.Topics.Requests, Key: []byte("k"), Value: []byte(b)},
		).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	// v1 alone, its step held while v2 and v3 arrive: the next poll
	// finds two records and lingers, so v4, 100 ms after the step ends,
	// joins them.
	publish(1)
	for deadline := time.Now().Add(15 * time.Second); len(batches()) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("v1's step did not run in 15s")
		}
	}
	publishPair("v2", "v3")
	time.Sleep(300 * time.Millisecond) // fetched into the client meanwhile
	release()
	time.Sleep(100 * time.Millisecond)
	publish(4)
	waitCommitted(t, k, 5, 15*time.Second)
	// Then two lone records 500 ms apart: a step each, at once.
	publish(5)
	time.Sleep(500 * time.Millisecond)
	publish(6)
	waitCommitted(t, k, 7, 15*time.Second)
	// Two records the step does not act on, found together, and v9
	// 100 ms later: no linger, two steps.
	publishPair("x7", "x8")
	time.Sleep(100 * time.Millisecond)
	publish(9)
	waitCommitted(t, k, 10, 15*time.Second)
	if got := batches(); !slices.Equal(got, []int{1, 3, 1, 1, 2, 1}) {
		t.Errorf("batches %v; want [1 3 1 1 2 1]: v1 alone, v2-v4 in one lingering step, v5 and v6 alone, x7 and x8 without lingering, v9 alone", got)
	}
	for _, from := range []int{-1, 501} {
		if _, err := ledger.NewLoop(ledger.LoopConfig{Group: "g", Topics: []string{"t"}, TransactionalID: "x", MaxPollRecords: 500, LingerFrom: from}, nil); err == nil {
			t.Errorf("LingerFrom %d with polls of 500 was accepted", from)
		}
	}
}

// TestLoopTime: a loop counts the time its steps took and the time its
// transactions took, and not the time it waited for records.
func TestLoopTime(t *testing.T) {
	k := faultableKafka(t)
	const stepTook = 30 * time.Millisecond
	var steps atomic.Int64
	loop, err := ledger.NewLoop(ledger.LoopConfig{
		Client: k.Client, Group: k.Group("copy"), Topics: []string{k.Topics.Requests},
		TransactionalID: "copy-1", Tick: 50 * time.Millisecond,
		Opts: []kgo.Opt{kgo.FetchMaxWait(100 * time.Millisecond)},
	}, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		var out ledger.Output
		if len(recs) == 0 {
			return out, nil
		}
		steps.Add(1)
		time.Sleep(stepTook)
		for _, r := range recs {
			out.Records = append(out.Records, &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value})
		}
		return out, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if lt := loop.Time(); lt != (ledger.LoopTime{}) {
		t.Fatalf("Time before Run = %+v; want zero", lt)
	}
	start := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	defer func() { cancel(); <-done }()
	publishRequests(t, k, 5)
	waitCommitted(t, k, 5, 15*time.Second)
	const idle = 600 * time.Millisecond
	time.Sleep(idle)  // polls that return nothing
	n := steps.Load() // before Time: a step counts there once it ended
	lt, lived := loop.Time(), time.Since(start)
	if n == 0 || lt.Steps != n || lt.Step < time.Duration(n)*stepTook {
		t.Errorf("Time() = %+v after %d steps of %v each; want them counted (the idle polls not), and at least their sum", lt, n, stepTook)
	}
	if lt.Transaction <= 0 {
		t.Errorf("Time().Transaction = %v after committed steps; want their transactions' time", lt.Transaction)
	}
	if busy := lt.Step + lt.Transaction; busy > lived-idle/2 {
		t.Errorf("steps and transactions %v of the %v the loop lived, %v of it idle; want the idle polls counted in neither", busy, lived, idle)
	}
}

// failOffsetFetchOf answers the first OffsetFetch of a consumer (franz-go's
// asks for stable offsets; kadm's, which the tests use, does not) with no
// committed offsets and, for partition, a non-retriable error, as a broker
// whose ACLs deny the group that topic would. It counts the requests it
// answered.
func failOffsetFetchOf(k *ledgertest.Kafka, partition int32) *atomic.Int64 {
	c := k.Cluster
	var hits atomic.Int64
	c.ControlKey(int16(kmsg.OffsetFetch), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		req := kreq.(*kmsg.OffsetFetchRequest)
		if !req.RequireStable {
			return nil, nil, false // not handled: kept for the next
		}
		hits.Add(1)
		resp := req.ResponseKind().(*kmsg.OffsetFetchResponse)
		resp.Version = req.Version
		part := func(p int32) kmsg.OffsetFetchResponseGroupTopicPartition {
			rp := kmsg.NewOffsetFetchResponseGroupTopicPartition()
			rp.Partition, rp.Offset = p, -1
			if p == partition {
				rp.ErrorCode = kerr.TopicAuthorizationFailed.Code
			}
			return rp
		}
		for _, g := range req.Groups {
			rg := kmsg.NewOffsetFetchResponseGroup()
			rg.Group = g.Group
			for _, t := range g.Topics {
				rt := kmsg.NewOffsetFetchResponseGroupTopic()
				rt.Topic, rt.TopicID = t.Topic, t.TopicID
				for _, p := range t.Partitions {
					rt.Partitions = append(rt.Partitions, part(p))
				}
				rg.Topics = append(rg.Topics, rt)
			}
			resp.Groups = append(resp.Groups, rg)
		}
		for _, t := range req.Topics { // before v8
			rt := kmsg.NewOffsetFetchResponseTopic()
			rt.Topic = t.Topic
			for _, p := range t.Partitions {
				gp := part(p)
				rp := kmsg.NewOffsetFetchResponseTopicPartition()
				rp.Partition, rp.Offset, rp.ErrorCode = gp.Partition, gp.Offset, gp.ErrorCode
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
	return &hits
}

// A partition whose committed offset could not be fetched, for a reason
// that is not retriable, is not left out of the loop: franz-go goes on
// without it until the next rebalance, which in a quiet group never
// comes, and the requests on it were never processed. The loop restarts
// its session, which asks again, and every request is processed.
func TestLoopRejoinsForAPartitionItCouldNotResume(t *testing.T) {
	k := faultableKafka(t)
	const n = 20
	publishRequests(t, k, n) // over both partitions
	hits := failOffsetFetchOf(k, 1)

	loop := copyLoop(t, k, "copy-1")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitCommitted(t, k, n, 20*time.Second)
	if hits.Load() != 1 {
		t.Errorf("offset fetches failed: %d; want 1", hits.Load())
	}
}

// A session that progressed and then lost a partition (a poll reports a
// non-retriable error for it, such as an ACL denying the group that
// topic) still backs off before the next: the cause usually persists, and
// a loop that rejoined every 100 ms would rebalance the group, and stall
// its healthy partitions, as often. Here every session commits some of a
// steady flow of requests and then has partition 1 denied to its fetches;
// the sessions' joins (counted by the broker) thin out, and the backoffs
// the loop logs double from one restart to the next.
func TestLoopBacksOffAfterProgressWhileAPartitionStaysDenied(t *testing.T) {
	k := faultableKafka(t)
	c := k.Cluster
	var (
		mu     sync.Mutex
		joins  []time.Time // a session's first JoinGroup each
		armed  atomic.Bool // the current session has committed
		denied atomic.Int64
	)
	c.ControlKey(int16(kmsg.JoinGroup), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		// A new client joins without a member id; a rejoin within a
		// session has one.
		if kreq.(*kmsg.JoinGroupRequest).MemberID == "" {
			mu.Lock()
			joins = append(joins, time.Now())
			mu.Unlock()
			armed.Store(false)
		}
		return nil, nil, false
	})
	c.ControlKey(int16(kmsg.EndTxn), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if kreq.(*kmsg.EndTxnRequest).Commit {
			armed.Store(true)
		}
		return nil, nil, false
	})
	c.ControlKey(int16(kmsg.Fetch), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if !armed.Load() {
			return nil, nil, false
		}
		// Partition 1 denied, the others left out of the answer
		// (nothing new for them in this fetch).
		req := kreq.(*kmsg.FetchRequest)
		resp := req.ResponseKind().(*kmsg.FetchResponse)
		resp.Version = req.Version
		for _, rt := range req.Topics {
			t := kmsg.NewFetchResponseTopic()
			t.Topic, t.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				if rp.Partition != 1 {
					continue
				}
				p := kmsg.NewFetchResponseTopicPartition()
				p.Partition, p.ErrorCode = 1, kerr.TopicAuthorizationFailed.Code
				p.HighWatermark, p.LastStableOffset, p.LogStartOffset = -1, -1, -1
				t.Partitions = append(t.Partitions, p)
			}
			resp.Topics = append(resp.Topics, t)
		}
		denied.Add(1)
		return resp, nil, true
	})

	// A steady flow of requests, for every session to make progress with.
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	flow, stopFlow := context.WithCancel(context.Background())
	var flowing sync.WaitGroup
	flowing.Go(func() {
		for i := 0; flow.Err() == nil; i++ {
			_ = cl.ProduceSync(flow, &kgo.Record{Topic: k.Topics.Requests, Key: fmt.Appendf(nil, "k%d", i), Value: []byte("v")}).FirstErr()
			select {
			case <-flow.Done():
			case <-time.After(10 * time.Millisecond):
			}
		}
	})
	defer func() { stopFlow(); flowing.Wait() }()

	backoffs := &backoffLog{}
	loop := copyLoop(t, k, "copy-1", func(cfg *ledger.LoopConfig) { cfg.Logger = slog.New(backoffs) })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	defer func() { cancel(); <-done }()

	// The window: from the first session's join. The restarts' backoffs
	// (at least half of 100 ms, 200 ms, ... each, with jitter) let at most
	// 7 sessions join in it, however fast the sessions themselves are; a
	// slow machine only makes fewer. Restarts every 100 ms join dozens
	// (62 on the machine this was written on).
	const window = 6 * time.Second
	ledgertest.WaitFor(t, 20*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(joins) == 0 {
			return errors.New("the loop has not joined the group")
		}
		return nil
	})
	mu.Lock()
	first := joins[0]
	mu.Unlock()
	select {
	case <-time.After(time.Until(first.Add(window))):
	case err := <-done:
		t.Fatalf("the loop returned %v", err)
	}
	mu.Lock()
	var in int
	for _, j := range joins {
		if j.Sub(first) <= window {
			in++
		}
	}
	mu.Unlock()
	if in > 10 {
		t.Errorf("%d sessions joined the group within %v; want at most 7 (10 with slack), the restarts backing off", in, window)
	}
	if in < 3 || denied.Load() < int64(in-1) {
		t.Fatalf("%d sessions joined, %d fetches denied after a commit; want at least 3 sessions, each ended by a denial once it had committed", in, denied.Load())
	}
	// Deterministic, whatever the machine's speed: each restart's backoff
	// (before jitter) doubles the last.
	got := backoffs.values()
	for i := 1; i < len(got); i++ {
		if want := min(2*got[i-1], 10*time.Second); got[i] != want {
			t.Errorf("restart backoffs %v; want each double the last: the sessions' progress does not reset them", got)
			break
		}
	}
}

// backoffLog keeps the backoff of every "transact session restart" the
// loop logs.
type backoffLog struct {
	mu  sync.Mutex
	got []time.Duration
}

func (h *backoffLog) Enabled(context.Context, slog.Level) bool { return true }

func (h *backoffLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "transact session restart" {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "backoff" {
			h.mu.Lock()
			h.got = append(h.got, a.Value.Duration())
			h.mu.Unlock()
		}
		return true
	})
	return nil
}

func (h *backoffLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *backoffLog) WithGroup(string) slog.Handler      { return h }

func (h *backoffLog) values() []time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.got)
}

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
	// their own when nothing follows the batch. The first transaction
	// after the skip failing (failOnce: its step fails) loses nothing:
	// on a partition the group never committed, franz-go's rewind does
	// not go back before the batch, and the skip is carried on to the
	// next transaction (before, its DLQ record was lost, and the offset
	// past the batch committed without it).
	for _, tc := range []struct{ hook, after, failOnce bool }{{true, true, false}, {false, true, false}, {false, false, false}, {true, false, true}} {
		t.Run(fmt.Sprintf("hook %v, a record after %v, a failed step %v", tc.hook, tc.after, tc.failOnce), func(t *testing.T) { skipsABatch(t, tc.hook, tc.after, tc.failOnce) })
	}
}

func skipsABatch(t *testing.T, hook, after, failOnce bool) {
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
		failed  bool
	)
	cfg := ledger.LoopConfig{Tick: 50 * time.Millisecond, Metrics: metrics, MaxBatchBytes: 1 << 20, Logger: slog.New(slog.NewJSONHandler(&logs, nil))}
	if hook {
		cfg.Skipped = skipsToDLQ(k, &mu, &skipped)
	}
	runCopyGroupLoop(t, k, cfg, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		mu.Lock()
		defer mu.Unlock()
		if failOnce && len(skipped) > 0 && !failed {
			failed = true
			return ledger.Output{}, errors.New("store unavailable")
		}
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
	if failOnce && !failed {
		t.Error("no step failed after the skip")
	}
	dlq := readCommitted(t, k, k.Topics.DLQ, 1)
	if len(dlq) != 1 {
		t.Errorf("%d DLQ records committed; want 1", len(dlq))
	}
	if reason := string(ledger.Header(dlq[0], ledger.HeaderDLQReason)); reason != ledger.ReasonBatchTooLarge || string(ledger.Header(dlq[0], ledger.HeaderDLQSource)) != rq+"/0/0" {
		t.Errorf("DLQ record reason %q source %q; want %s at %s/0/0", reason, ledger.Header(dlq[0], ledger.HeaderDLQSource), ledger.ReasonBatchTooLarge, rq)
	}
}

// skipsToDLQ is a LoopConfig.Skipped that keeps each skipped batch's
// offsets in skipped, under mu, and writes its DLQ record, as the
// intake's does.
func skipsToDLQ(k *ledgertest.Kafka, mu *sync.Mutex, skipped *[][2]int64) func(string, int32, int64, int64) []*kgo.Record {
	return func(topic string, partition int32, from, next int64) []*kgo.Record {
		mu.Lock()
		defer mu.Unlock()
		*skipped = append(*skipped, [2]int64{from, next})
		return []*kgo.Record{ledger.DLQBatchRecord(k.Topics.DLQ, topic, partition, from, next, 1<<20)}
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

// A member the group does not take (its joins refused: no right to the
// group) is not ready, though its polls go on, empty: before, /readyz
// said it did its work while it held no partition and processed nothing.
// Once a join is taken, it is ready again.
func TestLoopNotReadyWhileTheGroupRefusesIt(t *testing.T) {
	k := faultableKafka(t)
	c := k.Cluster
	var refuse atomic.Bool
	refuse.Store(true)
	c.ControlKey(int16(kmsg.JoinGroup), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if !refuse.Load() {
			return nil, nil, false
		}
		req := kreq.(*kmsg.JoinGroupRequest)
		resp := req.ResponseKind().(*kmsg.JoinGroupResponse)
		resp.Version = req.Version
		resp.ErrorCode = kerr.GroupAuthorizationFailed.Code
		return resp, nil, true
	})
	l := copyLoop(t, k, "copy-1")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	ledgertest.WaitFor(t, 20*time.Second, func() error {
		if err := l.Ready(); err == nil || !strings.Contains(err.Error(), "consumer group") {
			return fmt.Errorf("Ready() = %v; want not ready, the group refusing it", err)
		}
		return nil
	})
	// For as long as it refuses: past the loop's window, which franz-go's
	// retries of a join can outlast.
	for end := time.Now().Add(6 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		if err := l.Ready(); err == nil {
			t.Fatal("Ready() = nil while the group still refuses the member")
		}
	}
	refuse.Store(false)
	ledgertest.WaitFor(t, 30*time.Second, l.Ready)
}

// A step's error that wraps ErrStop ends Run, where any other redelivers
// the batch for ever: the record it met (one of a newer encoding) is one
// that no redelivery gets past, and the loop must not commit past it
// either. The group resumes at the record, with another member: what the
// stopped loop committed before stays committed once, and the rest is
// copied once.
func TestLoopErrStopEndsRun(t *testing.T) {
	k := faultableKafka(t)
	const n = 10
	publishRequests(t, k, n)
	cfg := ledger.LoopConfig{
		Client: k.Client, Group: k.Group("copy"), Topics: []string{k.Topics.Requests},
		TransactionalID: "copy-stop", Tick: 50 * time.Millisecond, MaxPollRecords: 3,
		Opts: []kgo.Opt{kgo.FetchMaxWait(100 * time.Millisecond)},
	}
	stopping, err := ledger.NewLoop(cfg, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		var out ledger.Output
		for _, r := range recs {
			if string(r.Key) == "k7" {
				return ledger.Output{}, fmt.Errorf("%w: met %s", ledger.ErrStop, r.Key)
			}
			out.Records = append(out.Records, &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value})
		}
		return out, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- stopping.Run(t.Context()) }()
	select {
	case err := <-done:
		if !errors.Is(err, ledger.ErrStop) {
			t.Fatalf("Run = %v; want an error wrapping ErrStop", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Run still runs 20s after its step stopped it")
	}
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	got, err := groupCommitted(t.Context(), cl, k.Group("copy"))
	t.Logf("stopped loop committed %d", got)
	if err != nil || got >= n {
		t.Fatalf("the stopped loop committed %d of %d requests (%v); want fewer: it committed past the record that stopped it", got, n, err)
	}

	next := copyLoop(t, k, "copy-next")
	ctx, cancel := context.WithCancel(context.Background())
	nextDone := make(chan error, 1)
	go func() { nextDone <- next.Run(ctx) }()
	defer func() { cancel(); <-nextDone }()
	waitCommitted(t, k, n, 20*time.Second)
	seen := make(map[string]int)
	for _, r := range readCommitted(t, k, k.Topics.Events, n) {
		seen[string(r.Key)]++
	}
	for i := range n {
		if key := fmt.Sprintf("k%d", i); seen[key] != 1 {
			t.Errorf("%s copied %d times; want once", key, seen[key])
		}
	}
}

// A transaction that carries records and no offsets (an executor's
// outcomes of calls that ended after their step, recorded on an idle
// poll) ends at once. Before, the session's End took the offset commit it
// skipped for an old broker's answer and held the loop 500 ms after the
// commit, which franz-go logs at debug: in every such transaction, no step
// ran and nothing was polled for half a second.
func TestLoopRecordsOnlyTransactionDoesNotWait(t *testing.T) {
	k := faultableKafka(t)
	var kafkaLog ledgertest.LogBuffer
	var later atomic.Bool
	committed := make(chan struct{})
	loop, err := ledger.NewLoop(ledger.LoopConfig{
		Client: k.Client, Group: k.Group("late"), Topics: []string{k.Topics.Requests},
		TransactionalID: "late-1", Tick: 50 * time.Millisecond,
		Opts: []kgo.Opt{kgo.FetchMaxWait(100 * time.Millisecond), kgo.WithLogger(kgo.BasicLogger(&kafkaLog, kgo.LogLevelDebug, nil))},
	}, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		var out ledger.Output
		switch {
		case len(recs) > 0:
			for _, r := range recs {
				out.Records = append(out.Records, &kgo.Record{Topic: k.Topics.Events, Key: r.Key, Value: r.Value})
			}
			later.Store(true)
		case later.Swap(false):
			out.Records = []*kgo.Record{{Topic: k.Topics.Events, Key: []byte("late"), Value: []byte("outcome")}}
			out.Committed = func(context.Context) error {
				close(committed)
				return nil
			}
		}
		return out, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	defer func() { cancel(); <-done }()
	publishRequests(t, k, 1)
	select {
	case <-committed:
	case <-time.After(15 * time.Second):
		t.Fatal("the transaction of records alone did not commit")
	}
	for _, line := range kafkaLog.Lines() {
		if strings.Contains(line, "sleeping 500ms") {
			t.Errorf("the loop waited after a transaction of records alone, as franz-go says: %s", line)
		}
	}
}

// notCommitted records why the loop's transactions did not commit.
type notCommitted struct {
	consumedCounter
	mu      sync.Mutex
	results []string
}

func (c *notCommitted) NotCommitted(result string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.results = append(c.results, result)
}

func (c *notCommitted) seen() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.results)
}

// A transaction its coordinator aborts with no rebalance (an offset
// commit it refuses) is counted and logged as aborted, not as one a
// rebalance aborted, which would send an operator to the group's members
// rather than the coordinator; its records come again and commit.
func TestLoopTellsACoordinatorsAbortFromARebalance(t *testing.T) {
	k := faultableKafka(t)
	// Once: the next TxnOffsetCommit's partitions answer an error the
	// session ends by aborting.
	k.Cluster.ControlKey(int16(kmsg.TxnOffsetCommit), func(r kmsg.Request) (kmsg.Response, error, bool) {
		req := r.(*kmsg.TxnOffsetCommitRequest)
		resp := req.ResponseKind().(*kmsg.TxnOffsetCommitResponse)
		resp.Version = req.Version
		for _, rt := range req.Topics {
			t := kmsg.NewTxnOffsetCommitResponseTopic()
			t.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				p := kmsg.NewTxnOffsetCommitResponseTopicPartition()
				p.Partition, p.ErrorCode = rp.Partition, kerr.UnknownServerError.Code
				t.Partitions = append(t.Partitions, p)
			}
			resp.Topics = append(resp.Topics, t)
		}
		return resp, nil, true
	})
	metrics := &notCommitted{}
	publish := runCopyGroupLoop(t, k, ledger.LoopConfig{Metrics: metrics}, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		return copied(k, recs), nil
	})
	publish("k1", "v1")
	waitCommitted(t, k, 1, 15*time.Second)
	if got := metrics.seen(); !slices.Equal(got, []string{"aborted"}) {
		t.Errorf("transactions not committed: %q; want one, aborted (by its coordinator, not a rebalance)", got)
	}
}

// A transaction a rebalance aborts (a second member joins while the first
// is in a step, and takes one of its partitions) is still counted as
// rebalanced; its records come again and commit once.
func TestLoopCountsARebalancesAbortAsRebalanced(t *testing.T) {
	k := faultableKafka(t)
	metrics := &notCommitted{}
	inStep, release := make(chan struct{}), make(chan struct{})
	var first sync.Once
	run := runMembers(t, k, metrics, func(ctx context.Context, recs []*kgo.Record) (ledger.Output, error) {
		// The first step waits, in its transaction, for the rebalance
		// (or the test's end).
		first.Do(func() {
			close(inStep)
			select {
			case <-release:
			case <-ctx.Done():
			}
		})
		return copied(k, recs), nil
	})
	publishRequests(t, k, 4) // on both partitions
	<-inStep
	run.second()
	close(release)
	waitCommitted(t, k, 4, 15*time.Second)
	if got := metrics.seen(); !slices.Contains(got, "rebalanced") || slices.Contains(got, "aborted") {
		t.Errorf("transactions not committed: %q; want the rebalance's, rebalanced", got)
	}
}

// A revocation the session's next End sees is counted as the rebalance's
// even when a transaction of records alone (an executor's outcomes on an
// idle tick), which ends without the session and so without looking at
// it, came between: the End after it aborts for the revocation.
func TestLoopCountsARebalancesAbortAfterARecordsOnlyCommit(t *testing.T) {
	k := faultableKafka(t)
	metrics := &notCommitted{}
	var emit atomic.Bool
	run := runMembers(t, k, metrics, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		if len(recs) == 0 && emit.CompareAndSwap(true, false) {
			return ledger.Output{Records: []*kgo.Record{{Topic: k.Topics.Events, Key: []byte("idle"), Value: []byte("outcome")}}}, nil
		}
		return copied(k, recs), nil
	})
	run.second()
	// The records-only transaction, after the revocation.
	emit.Store(true)
	ledgertest.WaitFor(t, 15*time.Second, func() error {
		if emit.Load() {
			return errors.New("no idle step yet")
		}
		return nil
	})
	publishRequests(t, k, 4) // on both partitions: a still holds one
	waitCommitted(t, k, 4, 15*time.Second)
	if got := metrics.seen(); !slices.Contains(got, "rebalanced") || slices.Contains(got, "aborted") {
		t.Errorf("transactions not committed: %q; want the rebalance's, rebalanced", got)
	}
}

// members are two loops of the copy group: a (copy-a, with the test's step
// and metrics) from the start, and b (copy-b, copying) once second is
// called; both run until the test ends.
type members struct {
	t       *testing.T
	k       *ledgertest.Kafka
	ctx     context.Context
	runs    chan error
	started int
}

// runMembers starts a and waits until it is in the group.
func runMembers(t *testing.T, k *ledgertest.Kafka, metrics ledger.LoopMetrics, step ledger.Step) *members {
	t.Helper()
	a, err := ledger.NewLoop(ledger.LoopConfig{
		Client: k.Client, Group: k.Group("copy"), Topics: []string{k.Topics.Requests},
		TransactionalID: "copy-a", Tick: 50 * time.Millisecond, Metrics: metrics,
		Opts: []kgo.Opt{kgo.FetchMaxWait(100 * time.Millisecond)},
	}, step)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	m := &members{t: t, k: k, ctx: ctx, runs: make(chan error, 2)}
	go func() { m.runs <- a.Run(ctx) }()
	m.started++
	t.Cleanup(func() {
		cancel()
		for range m.started {
			if err := <-m.runs; err != nil && !errors.Is(err, context.Canceled) {
				t.Error(err)
			}
		}
	})
	ledgertest.WaitFor(t, 15*time.Second, a.Ready)
	return m
}

// second starts b and waits until it holds a partition a gave up.
func (m *members) second() {
	m.t.Helper()
	b := copyLoop(m.t, m.k, "copy-b")
	go func() { m.runs <- b.Run(m.ctx) }()
	m.started++
	waitHolds(m.t, m.k, "copy-b")
}

// waitHolds waits until the member of the copy group whose client id is
// member holds a partition: in a cooperative rebalance, once the member
// that held it has given it up.
func waitHolds(t *testing.T, k *ledgertest.Kafka, member string) {
	t.Helper()
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		groups, err := kadm.NewClient(cl).DescribeGroups(t.Context(), k.Group("copy"))
		if err != nil {
			return err
		}
		for _, m := range groups[k.Group("copy")].Members {
			if c, ok := m.Assigned.AsConsumer(); ok && m.ClientID == member && len(c.Topics) > 0 && len(c.Topics[0].Partitions) > 0 {
				return nil
			}
		}
		return fmt.Errorf("%s holds no partition yet", member)
	})
}

// wideWindow compresses every batch as a zstd frame declaring a 32 MiB
// window, as a broker recompressing a topic at a high zstd level writes
// them (and accepts them: its decoders allow 128 MiB).
type wideWindow struct{ t *testing.T }

func (w wideWindow) Compress(_ *bytes.Buffer, src []byte, _ ...kgo.CompressFlag) ([]byte, kgo.CompressionCodecType) {
	return ledgertest.WideZstd(w.t, src, 25), kgo.CodecZstd
}

// A batch whose zstd frame declares a window past the loop's bound, its
// content within it, is read, and the records after it. Before,
// franz-go's bounded decoder refused it with an error it kept at the
// batch, without its offsets, fetching it again and again: the partition
// stopped for good, every record after it unread, the loop logging a Warn
// a fetch.
func TestLoopReadsAWideZstdBatch(t *testing.T) {
	k := faultableKafka(t)
	rq := k.Topics.Requests
	wide, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.WithCompressor(wideWindow{t}))
	if err != nil {
		t.Fatal(err)
	}
	defer wide.Close()
	// Compressible, so that the producer keeps its compressed form.
	if err := wide.ProduceSync(t.Context(), &kgo.Record{Topic: rq, Partition: 0, Key: []byte("wide"), Value: bytes.Repeat([]byte("v"), 4096)}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	plain, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if err := plain.ProduceSync(t.Context(), &kgo.Record{Topic: rq, Partition: 0, Key: []byte("after"), Value: []byte("v")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		seen    []string
		skipped [][2]int64
	)
	cfg := ledger.LoopConfig{Tick: 50 * time.Millisecond, MaxBatchBytes: 1 << 20, Skipped: skipsToDLQ(k, &mu, &skipped)}
	runCopyGroupLoop(t, k, cfg, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		mu.Lock()
		defer mu.Unlock()
		for _, r := range recs {
			seen = append(seen, string(r.Key))
		}
		return ledger.Output{}, nil
	})
	waitCommitted(t, k, 2, 20*time.Second)
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(seen, []string{"wide", "after"}) || len(skipped) != 0 {
		t.Errorf("the step saw %q, the batches skipped %v; want the wide batch's record and the one after, nothing skipped", seen, skipped)
	}
}

// notZstd labels every batch zstd and writes bytes that no decoder reads,
// as a batch damaged after its producer compressed it would be.
type notZstd struct{}

func (notZstd) Compress(*bytes.Buffer, []byte, ...kgo.CompressFlag) ([]byte, kgo.CompressionCodecType) {
	return []byte("not a zstd frame"), kgo.CodecZstd
}

// A partition holding a batch franz-go cannot decode (no frame at all,
// not a wide one) makes the loop not ready, naming the partition, once
// its fetches have failed for longer than Ready's window, and each
// failure is counted; the other partitions are read meanwhile. Before,
// the loop said it was ready while every record after the batch went
// unread, a Warn a fetch the only sign.
func TestLoopNotReadyWhileAPartitionCannotBeRead(t *testing.T) {
	k := faultableKafka(t)
	rq := k.Topics.Requests
	bad, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.WithCompressor(notZstd{}))
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	// Longer than its "compressed" form, which the producer then keeps.
	if err := bad.ProduceSync(t.Context(), &kgo.Record{Topic: rq, Partition: 0, Key: []byte("damaged"), Value: bytes.Repeat([]byte("v"), 4096)}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	var metrics consumedCounter
	l := copyLoop(t, k, "copy-1", func(c *ledger.LoopConfig) { c.Metrics = &metrics })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	plain, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if err := plain.ProduceSync(t.Context(), &kgo.Record{Topic: rq, Partition: 1, Key: []byte("readable"), Value: []byte("v")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	waitCommitted(t, k, 1, 20*time.Second)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if err := l.Ready(); err == nil || !strings.Contains(err.Error(), "every fetch of "+rq+"/0 has failed") {
			return fmt.Errorf("Ready() = %v; want not ready, naming %s/0", err, rq)
		}
		return nil
	})
	if metrics.fetchErrors.Load() == 0 {
		t.Error("no failed fetch counted")
	}
}
