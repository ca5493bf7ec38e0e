package ledger

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger/failpoint"
)

// Output is what one step of a processor appends, and what it must do once
// the append committed.
type Output struct {
	// Records to produce in the step's transaction.
	Records []*kgo.Record
	// Committed, if set, runs after the transaction carrying Records and
	// the consumed offsets committed (to mark an outbox logged, say). It
	// runs at most once and never for an aborted transaction; a failure
	// there is safe to lose, because the outbox is appended again. It runs
	// in the background, overlapping the next step, and the after-commit
	// steps of one loop run one at a time, in order.
	Committed func(ctx context.Context) error
	// Abandoned, if set, runs when the step's Records will not be in
	// the log through this step: its transaction aborted, failed, or
	// ended in doubt (it may then have committed after all, so undo
	// only what is safe to do again), or the session ended first. It
	// runs at most once, never with Committed, and before the batch is
	// redelivered, so that the redelivery's step sees what it undid (an
	// outbox marked logged in advance, say). A failure is logged.
	//
	// A step on an empty batch that returns hooks and no Records gets a
	// transaction only when earlier batches' offsets are waiting for one
	// (see Step): then Committed runs after it; otherwise Abandoned runs
	// at once.
	Abandoned func(ctx context.Context) error
}

// Step processes one polled batch of records. It may see an empty batch
// when nothing arrived for LoopConfig.Tick, so that time-driven work (lease
// sweeps, expiries) runs on an idle topic. Per-record problems are the
// step's to turn into events or DLQ records; a returned error means "try
// the batch again later": the loop aborts, rewinds to the committed offsets
// and redelivers, unless it wraps ErrStop. A batch whose step returns an empty Output (no records,
// no hooks) is committed by the next transaction, not by one of its own:
// a crash or a rebalance before then delivers it again, so an empty Output
// must mean that delivering the batch again is safe: the step did
// nothing, or nothing that a redelivery would do twice.
type Step func(ctx context.Context, recs []*kgo.Record) (Output, error)

// TransactionTimeout is the transaction timeout every loop's producer
// asks for: a broker whose transaction.max.timeout.ms is lower refuses
// the producer id, and the loop never starts (ledger doctor checks it).
const TransactionTimeout = time.Minute

// ErrStop, wrapped in a step's error, ends the loop rather than redeliver
// the batch: the step met a record that no redelivery to this process
// gets past (one of an encoding newer than it reads), and which it must
// not pass over either. The loop aborts the batch's transaction and leaves
// the group, so that the partitions go at once to the other members (a
// newer build, during an upgrade), and Run returns the error: the process
// ends, to be replaced.
var ErrStop = errors.New("loop stopped")

// LoopConfig configures a consume-process-produce loop.
type LoopConfig struct {
	Client ClientConfig
	// Group is the consumer group. Required.
	Group string
	// Topics to consume. Required.
	Topics []string
	// TransactionalID must be unique per running instance and stable
	// across its restarts, so that a restarted instance fences its
	// predecessor's open transaction. Required.
	TransactionalID string
	// MaxPollRecords bounds a batch; default 500.
	MaxPollRecords int
	// Tick is how long a poll waits before the step runs on an empty
	// batch; default 1s.
	Tick time.Duration
	// Linger, when positive, is how long the loop waits for more
	// records after a poll returned some (at least LingerFrom), up to
	// MaxPollRecords, before the step runs: fewer and larger steps,
	// which pay their Kafka transaction and store round trips once for
	// more calls, for up to Linger of latency. 0, the default, runs the
	// step at once.
	Linger time.Duration
	// LingerFrom is how many records a poll must return for the loop
	// to linger (of those Acts counts); 0 or 1: any. A poll that finds
	// several records waiting finds the loop under load, where its
	// steps' fixed costs are what the machine runs short of and a larger
	// step saves more than the linger costs; a lone record at low load
	// would only wait. At most MaxPollRecords.
	LingerFrom int
	// Acts, if set, says which records the step acts on, of those it
	// reads: LingerFrom counts only those. A loop that reads several
	// records a unit of work (the executor reads a call's requested and
	// authorized events together, and its own events besides) would
	// otherwise linger for a lone call. Nil: every record.
	Acts func(*kgo.Record) bool
	// Logger; nil discards.
	Logger *slog.Logger
	// Opts are extra franz-go options for the session's client.
	Opts []kgo.Opt
	// Failpoint, if set, is hit after a non-empty poll
	// (failpoint.Consumed), after the batch's events are produced and
	// before EndTxn (failpoint.Produced), and after EndTxn committed
	// (failpoint.Committed): the reliability suite crashes processors
	// there.
	Failpoint failpoint.Hook
	// Metrics, if set, counts the loop's transactions.
	Metrics LoopMetrics
	// MaxBatchBytes bounds what a fetched batch may decompress to;
	// default DefaultMaxBatchBytes. A batch past it (a few kilobytes of
	// zstd can decompress to gigabytes) is skipped, not read: without
	// the bound, one such batch, which anyone allowed to write the
	// topic can produce, would crash every instance it is handed to in
	// turn, or, past franz-go's own 1 GiB, stop its partition for good.
	MaxBatchBytes int
	// Skipped, if set, returns the records to append for a batch
	// skipped for its size (the intake's DLQ record), committed with
	// the offset past it: the batch at offsets [from, next) of topic's
	// partition.
	Skipped func(topic string, partition int32, from, next int64) []*kgo.Record
}

// DefaultMaxBatchBytes is LoopConfig.MaxBatchBytes' default: 16 MiB,
// some sixty envelopes of the intake's largest, a hundred times a
// producer's usual batch, and small beside a process's memory.
const DefaultMaxBatchBytes = 16 << 20

// MinMaxBatchBytes is the least LoopConfig.MaxBatchBytes: 1 MiB, over
// the 1,000,012 bytes before compression that the ledger's own producers
// (franz-go's default, Kafka's max.message.bytes) put in a batch. A loop
// reading the events topic must never skip one of those: an authorized
// event skipped leaves its call authorized, claimed by no executor.
const MinMaxBatchBytes = 1 << 20

// LoopMetrics receives a loop's measurements (metrics.Registry is one).
type LoopMetrics interface {
	// Committed: a transaction committed the records a step produced,
	// with the offsets of the consumed records; step is how long the step
	// took, txn how long producing and ending the transaction did.
	Committed(consumed int, produced []*kgo.Record, step, txn time.Duration)
	// NotCommitted: a step's work was not committed, and why:
	// "rebalanced" (the group's rebalance aborted the transaction),
	// "aborted" (its coordinator did, with no rebalance), "step_failed",
	// "stopped" (ErrStop) or "failed".
	NotCommitted(result string)
	// RecordsDeleted: n records of topic were deleted from the log
	// (retention, DeleteRecords) before the loop read them.
	RecordsDeleted(topic string, n int64)
	// BatchSkipped: a batch of topic was skipped, unread, for what it
	// decompresses to (LoopConfig.MaxBatchBytes).
	BatchSkipped(topic string)
	// FetchFailed: a fetch of a partition of topic failed with an error
	// franz-go gave the poll (one it did not retry itself).
	FetchFailed(topic string)
}

// nopLoopMetrics measures nothing.
type nopLoopMetrics struct{}

func (nopLoopMetrics) Committed(int, []*kgo.Record, time.Duration, time.Duration) {}
func (nopLoopMetrics) NotCommitted(string)                                        {}
func (nopLoopMetrics) RecordsDeleted(string, int64)                               {}
func (nopLoopMetrics) BatchSkipped(string)                                        {}
func (nopLoopMetrics) FetchFailed(string)                                         {}

func (c *LoopConfig) setDefaults() {
	if c.MaxPollRecords <= 0 {
		c.MaxPollRecords = 500
	}
	if c.Tick <= 0 {
		c.Tick = time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Metrics == nil {
		c.Metrics = nopLoopMetrics{}
	}
	if c.MaxBatchBytes <= 0 {
		c.MaxBatchBytes = DefaultMaxBatchBytes
	}
}

func (c *LoopConfig) validate() error {
	switch {
	case c.Group == "":
		return errors.New("loop: no consumer group")
	case len(c.Topics) == 0:
		return errors.New("loop: no topics")
	case c.TransactionalID == "":
		return errors.New("loop: no transactional id")
	case c.Linger < 0 || c.Linger >= c.Tick:
		// A linger as long as a tick would hold every batch for it.
		return fmt.Errorf("loop: linger %v must be at least 0 and shorter than the tick (%v)", c.Linger, c.Tick)
	case c.MaxBatchBytes < MinMaxBatchBytes:
		return fmt.Errorf("loop: max batch bytes %d is below %d: the ledger's own producers write batches of up to 1,000,012 bytes, which a loop would skip unread", c.MaxBatchBytes, MinMaxBatchBytes)
	case c.LingerFrom < 0 || c.LingerFrom > c.MaxPollRecords:
		// More than a poll returns would never linger.
		return fmt.Errorf("loop: linger from %d records: must be at least 0 and at most a poll's %d", c.LingerFrom, c.MaxPollRecords)
	}
	return nil
}

// Loop is a consume-process-produce loop on a franz-go GroupTransactSession:
// it reads committed records only, with stable fetch offsets, and the
// records a step appends commit together with the offsets it consumed, or
// not at all. The transaction begins only after the step returned, so no
// Kafka transaction is ever held open across a tool call.
type Loop struct {
	cfg  LoopConfig
	step Step

	// lastPoll is when a live session last returned from a poll, in
	// nanoseconds since born, plus one; 0 while no session is live.
	// Measured from born's monotonic reading, a step of the wall clock
	// (NTP) moves neither it nor Ready's judgement of it.
	lastPoll atomic.Int64
	born     time.Time
	// client is the live session's client, nil between sessions.
	client atomic.Pointer[kgo.Client]
	// stepTime and txnTime add up, in nanoseconds, the time spent in
	// steps and in the transactions after them; steps counts the steps
	// given records (Time).
	stepTime, txnTime, steps atomic.Int64
	// The group's news, in the order it came (marks, a counter: not
	// the wall clock, which may be set back between them): groupErr is
	// the last error of the group's management (a join refused, say),
	// assigned the mark of the last assignment, session the live
	// session's start. The polls of a member that cannot join go on,
	// empty, and alone would say it is doing its work.
	marks    atomic.Int64
	groupErr atomic.Pointer[groupError]
	assigned atomic.Int64
	session  atomic.Pointer[sessionMark]
	// revoked is the mark of the last revocation or loss of partitions:
	// a transaction that did not commit after one was aborted by the
	// rebalance, one that did not commit without, by its coordinator.
	revoked atomic.Int64
	// unreadable is the partition whose fetches have failed longest,
	// each poll after the last, with no record read from it meanwhile,
	// nil if none: franz-go fetches again and again a batch it cannot
	// decode (corrupt, say), and keeps its error, without the offsets a
	// skip would need, at the partition, whose every later record then
	// goes unread.
	unreadable atomic.Pointer[fetchFailure]
}

// fetchFailure is a partition whose fetches have failed since a time,
// and the last error.
type fetchFailure struct {
	tp          topicPartition
	since, last time.Time
	err         error
}

// groupError is an error of the group's management, and its mark.
type groupError struct {
	mark int64
	err  error
}

// sessionMark is a session's start: its mark, and when, on the
// monotonic clock.
type sessionMark struct {
	mark int64
	at   time.Time
}

// groupHooks records the group's management errors for Ready.
type groupHooks struct{ l *Loop }

// OnGroupManageError implements kgo.HookGroupManageError.
func (h groupHooks) OnGroupManageError(err error) {
	h.l.groupErr.Store(&groupError{mark: h.l.marks.Add(1), err: err})
}

// LoopTime is how a loop has spent its time since it started: in steps,
// and in the transactions after them (from Begin to End's return,
// committed or aborted; one that failed to begin or to flush is left
// out). The rest it spent polling, waiting for records mostly,
// and in what neither counts: waiting for the previous commit's
// after-commit work, undoing an abandoned step, backing off after a
// failure. Each counts when it ends, so the growth over an interval can
// exceed the interval by a step or a transaction under way at its start.
type LoopTime struct {
	Step        time.Duration `json:"step_ns"`
	Transaction time.Duration `json:"transaction_ns"`
	// Steps counts the steps given records (polls that returned
	// nothing step too, briefly, and are not counted): over an
	// interval, busy time divided by steps is the loop's cycle.
	Steps int64 `json:"steps"`
}

// Time returns the loop's time so far. Safe from any goroutine: a
// benchmark reads it every second to tell a loop that has no idle time
// from one that waits for records.
func (l *Loop) Time() LoopTime {
	return LoopTime{Step: time.Duration(l.stepTime.Load()), Transaction: time.Duration(l.txnTime.Load()), Steps: l.steps.Load()}
}

// Buffered is how many records the live session has fetched that no poll
// has returned yet: work already waiting for the next step. A step may
// use it to decide not to wait for what it started and to leave it to the
// next one. It is 0 between sessions.
func (l *Loop) Buffered() int64 {
	if cl := l.client.Load(); cl != nil {
		return cl.BufferedFetchRecords()
	}
	return 0
}

// Group is the loop's consumer group.
func (l *Loop) Group() string { return l.cfg.Group }

// ErrNotReady is what Ready returns while the loop has no live session.
var ErrNotReady = errors.New("loop: not ready")

// Ready reports whether the loop is doing its work: a session is live
// (its producer id initialised, so Kafka answers), it polled within
// three ticks, and no partition's fetches have failed for longer than
// that. It wraps ErrNotReady with why not.
func (l *Loop) Ready() error {
	last := l.lastPoll.Load()
	if last == 0 {
		return fmt.Errorf("%w: no live Kafka session (group %s)", ErrNotReady, l.cfg.Group)
	}
	window := l.readyWindow()
	// Failing still, and over a span past the window: one error alone
	// (a reset after data loss, say) is no partition left unread.
	if f := l.unreadable.Load(); f != nil && f.last.Sub(f.since) > window && time.Since(f.last) <= window {
		return fmt.Errorf("%w: every fetch of %s/%d has failed for %s, nothing read from it since (group %s): %v",
			ErrNotReady, f.tp.topic, f.tp.partition, time.Since(f.since).Round(time.Second), l.cfg.Group, f.err)
	}
	if age := time.Since(l.born) - time.Duration(last-1); age > window {
		return fmt.Errorf("%w: no poll for %s (group %s): a step or a transaction is stuck", ErrNotReady, age.Round(time.Second), l.cfg.Group)
	}
	// A member the group does not take (a join refused: no right to the
	// group, say; the coordinator unreachable) polls on, empty, and
	// retries: not ready from its group's error until partitions (none,
	// even) are assigned again, nor while none have been since the
	// session started, past the window. franz-go reports a join's
	// failure only once its retries are spent, which can take longer
	// than the window: the error is not counted as old.
	assigned := l.assigned.Load()
	if e := l.groupErr.Load(); e != nil && e.mark > assigned {
		return fmt.Errorf("%w: the consumer group %s: %v", ErrNotReady, l.cfg.Group, e.err)
	}
	if s := l.session.Load(); s != nil && assigned < s.mark && time.Since(s.at) > window {
		return fmt.Errorf("%w: the consumer group %s has assigned this member nothing since its session started", ErrNotReady, l.cfg.Group)
	}
	return nil
}

// readyWindow is how long Ready lets a poll, a join or a partition's
// failing fetches take before it says the loop is not doing its work.
func (l *Loop) readyWindow() time.Duration { return 3*l.cfg.Tick + 5*time.Second }

// NewLoop validates cfg and returns a loop that runs step.
func NewLoop(cfg LoopConfig, step Step) (*Loop, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Loop{cfg: cfg, step: step, born: time.Now()}, nil
}

// Run runs the loop until ctx is done. After an error that leaves the
// transactional producer in doubt (EndTxn failed, a produce timed out) it
// aborts what it can and discards the session, and starts a new one, which
// re-initialises the producer id before it consumes, fencing whatever the
// old one left open. A transaction open when ctx ends is aborted. It
// returns nil on a clean shutdown, and a step's error that wraps ErrStop
// once the session has ended.
func (l *Loop) Run(ctx context.Context) error {
	const firstBackoff = 100 * time.Millisecond
	backoff := firstBackoff
	for ctx.Err() == nil {
		var progressed bool
		err := l.runSession(ctx, &progressed)
		l.lastPoll.Store(0)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, ErrStop) {
			return err
		}
		if progressed && !errors.Is(err, errPartitionDropped) {
			// The session worked for a while: this failure starts a
			// new series rather than continuing the last one.
			backoff = firstBackoff
		}
		l.cfg.Metrics.NotCommitted("failed")
		l.cfg.Logger.Warn("transact session restart", "group", l.cfg.Group, "err", err, "backoff", backoff)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(jitter(backoff)):
		}
		backoff = min(backoff*2, 10*time.Second)
	}
	return nil
}

// partitionDropped reports whether err, reported for topic's partition by
// a poll, means the session goes on without that partition: franz-go
// drops a partition whose committed offset fetch failed with a Kafka
// error that is not retriable, or that the coordinator kept omitting, and
// tells it only through such an error. Anything else (data loss, a batch
// that does not decode, the group's errors of no partition) franz-go
// reports and goes on, or retries, by itself: restarting would only stall
// the healthy partitions too.
func partitionDropped(topic string, err error) bool {
	var ke *kerr.Error
	switch {
	case topic == "":
		return false
	case errors.As(err, &ke):
		return !ke.Retriable
	}
	// franz-go's own error for an omitted partition is not exported.
	return strings.Contains(err.Error(), offsetFetchOmitted)
}

// offsetFetchOmitted is the text of franz-go's error for a partition the
// coordinator kept leaving out of its OffsetFetch answers.
const offsetFetchOmitted = "omitted a requested partition from an OffsetFetch response"

// errPartitionDropped marks a session ended by partitionDropped: a cause
// that may well persist (an ACL), so its restarts back off however much
// the sessions progressed before it struck, rather than rejoin the group
// every 100 ms and stall the healthy partitions with every rebalance.
var errPartitionDropped = errors.New("partition left out of the session")

// runSession runs one transact session until it fails or ctx ends. It
// sets *progressed once a transaction of the session committed.
func (l *Loop) runSession(ctx context.Context, progressed *bool) (rerr error) {
	l.session.Store(&sessionMark{mark: l.marks.Add(1), at: time.Now()})
	base, err := l.cfg.Client.baseOpts()
	if err != nil {
		return err
	}
	dec, err := newWideZstdDecoded(l.cfg.MaxBatchBytes)
	if err != nil {
		return err
	}
	defer dec.Close()
	// The topics are added once the producer id is initialised (below),
	// so that the group is joined only then.
	opts := append(base,
		kgo.ConsumerGroup(l.cfg.Group),
		kgo.TransactionalID(l.cfg.TransactionalID),
		// The client id names the instance to the brokers: group
		// descriptions (kafka-consumer-groups --describe), quotas and
		// broker logs show which instance holds which partitions.
		kgo.ClientID(l.cfg.TransactionalID),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.RequireStableFetchOffsets(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.TransactionTimeout(TransactionTimeout),
		// A fetch waits on the broker at most a tick: with franz-go's
		// default of 5s, a session that resumes with one partition
		// empty sees the others' records only when that wait ends.
		kgo.FetchMaxWait(l.cfg.Tick),
		kgo.RecordPartitioner(Partitioner()),
		kgo.MaxDecompressBatchBytes(l.cfg.MaxBatchBytes),
		kgo.WithDecompressor(dec),
		kgo.WithHooks(groupHooks{l}),
		kgo.OnPartitionsAssigned(func(context.Context, *kgo.Client, map[string][]int32) { l.assigned.Store(l.marks.Add(1)) }),
		// (The session's own hooks, which make its next End abort, call
		// these after theirs.)
		kgo.OnPartitionsRevoked(func(_ context.Context, _ *kgo.Client, rev map[string][]int32) {
			if len(rev) > 0 {
				l.revoked.Store(l.marks.Add(1))
			}
		}),
		kgo.OnPartitionsLost(func(context.Context, *kgo.Client, map[string][]int32) { l.revoked.Store(l.marks.Add(1)) }),
	)
	if d := l.cfg.Client.SessionTimeout; d > 0 {
		opts = append(opts, kgo.SessionTimeout(d), kgo.HeartbeatInterval(min(d/3, 3*time.Second)))
	}
	if d := l.cfg.Client.RebalanceTimeout; d > 0 {
		opts = append(opts, kgo.RebalanceTimeout(d))
	}
	sess, err := kgo.NewGroupTransactSession(append(opts, l.cfg.Opts...)...)
	if err != nil {
		return fmt.Errorf("new transact session: %w", err)
	}
	defer func() {
		if rerr != nil && ctx.Err() == nil {
			l.leaveGroup(ctx, sess.Client())
		}
		sess.Close()
	}()
	l.client.Store(sess.Client())
	defer l.client.Store(nil)
	defer l.unreadable.Store(nil)

	var (
		stepFailures int
		// ended is the mark when the session's last transaction ended
		// (or it started): a revocation after it is one the next End
		// saw.
		ended       = l.marks.Load()
		afterCommit chan struct{} // closed when the last after-commit step is done
		// held counts the records of batches whose step did nothing,
		// held since heldSince: their offsets are committed by the next
		// transaction.
		held      int
		heldSince time.Time
		// pending: the batches skipped for their size (skipBatch)
		// that no committed transaction has carried yet, by where
		// they start. Every transaction carries them (the offsets past
		// them, the records LoopConfig.Skipped returned), and only one
		// that commits clears them. One that does not rewinds the
		// session to the committed offsets, where a batch is fetched
		// and skipped again (it replaces its entry), except on a
		// partition the group never committed: there franz-go takes
		// the offset past the batch for where consuming started, and
		// only the entry here still says that the batch was skipped.
		pending = make(map[batchStart]skippedBatch)
	)
	defer func() {
		if afterCommit != nil {
			<-afterCommit
		}
	}()

	// Fence first, then join the group. A predecessor with this
	// transactional id (the session this one replaces, or the process
	// before a restart) may have left a transaction open with offsets
	// pending in the group; until it ends the group's offsets are
	// unstable and this session cannot learn where to resume. franz-go
	// initialises the producer id, which ends that transaction, only at
	// the first produce, which then never comes: the session would wait
	// out the broker's transaction timeout.
	if _, _, err := sess.Client().ProducerID(ctx); err != nil {
		return fmt.Errorf("init producer id: %w", err)
	}
	sess.Client().AddConsumeTopics(l.cfg.Topics...)
	// open: a transaction may be open on the broker, from Begin until an
	// End that returned. Leaving with one open aborts it: every
	// read_committed reader of its partitions waits until it ends, and
	// after a shutdown no successor may come to fence it.
	open := false
	defer func() {
		if !open {
			return
		}
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if _, err := sess.End(actx, kgo.TryAbort); err != nil {
			l.cfg.Logger.Warn("abort of the open transaction failed; the broker ends it at its timeout", "group", l.cfg.Group, "err", err)
		}
	}()
	// reported are the partitions whose deleted records this session
	// reported already, by the offset it resumed from.
	reported := make(map[gap]bool)
	// read is, by partition, the offset after the last record this
	// session polled, since it last resumed from the group's committed
	// offsets (an abort rewinds to them, and so does an assignment);
	// readSince is the assignment it holds for.
	read, readSince := make(map[topicPartition]int64), l.assigned.Load()
	// failing are the partitions whose fetches have failed since the
	// last record read from them (Ready).
	failing := make(map[topicPartition]*fetchFailure)
	// poll returns up to n records, waiting until deadline for the
	// first.
	poll := func(deadline time.Time, n int) ([]*kgo.Record, error) {
		pollCtx, cancel := context.WithDeadline(ctx, deadline)
		fetches := sess.PollRecords(pollCtx, n)
		cancel()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		l.lastPoll.Store(int64(time.Since(l.born)) + 1)
		if fetches.IsClientClosed() {
			return nil, errors.New("client closed")
		}
		var dropped error
		fetches.EachError(func(t string, p int32, err error) {
			if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
				return
			}
			if tl, ok := errors.AsType[*kgo.ErrDecompressTooLarge](err); ok {
				pending[batchStart{tl.Topic, tl.Partition, tl.Offset}] = l.skipBatch(sess.Client(), tl)
				return
			}
			l.cfg.Logger.Warn("fetch error", "topic", t, "partition", p, "err", err)
			l.cfg.Metrics.FetchFailed(t)
			now := time.Now()
			tp := topicPartition{t, p}
			if failing[tp] == nil {
				failing[tp] = &fetchFailure{tp: tp, since: now}
			}
			failing[tp].last, failing[tp].err = now, err
			if dropped == nil && partitionDropped(t, err) {
				dropped = fmt.Errorf("%w: %s/%d: %w", errPartitionDropped, t, p, err)
			}
		})
		if a := l.assigned.Load(); a != readSince {
			clear(read)
			readSince = a
		}
		l.checkDeleted(sess.Client(), fetches, reported, read)
		l.noteUnreadable(fetches, failing)
		if dropped != nil {
			// franz-go goes on without a partition whose committed
			// offset it could not fetch (an authorization error, a
			// coordinator that omitted it) until the next rebalance,
			// which may never come: its calls would wait unseen. A new
			// session joins again and asks again, and until it works
			// the loop fails loudly rather than serve the rest.
			return nil, dropped
		}
		return fetches.Records(), nil
	}
	for {
		recs, err := poll(time.Now().Add(l.cfg.Tick), l.cfg.MaxPollRecords)
		if err != nil {
			return err
		}
		if l.cfg.Linger > 0 && l.lingers(recs) {
			// Wait for more, as a producer's linger does: one step,
			// one transaction and one store round trip for all of them.
			until := time.Now().Add(l.cfg.Linger)
			for len(recs) < l.cfg.MaxPollRecords && time.Now().Before(until) {
				more, err := poll(until, l.cfg.MaxPollRecords-len(recs))
				if err != nil {
					return err
				}
				recs = append(recs, more...)
			}
		}
		if len(recs) > 0 {
			l.cfg.Failpoint.Hit(failpoint.Consumed)
		}

		t0 := time.Now()
		out, err := l.step(ctx, recs)
		stepDur := time.Since(t0)
		l.stepTime.Add(int64(stepDur))
		if len(recs) > 0 {
			l.steps.Add(1)
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, ErrStop) {
				// Nothing was produced; leaving the session (below)
				// rewinds nothing, and the group's next member
				// resumes at the committed offsets.
				l.cfg.Metrics.NotCommitted("stopped")
				l.cfg.Logger.Error("step stopped the loop", "group", l.cfg.Group, "records", len(recs)+held, "err", err)
				return err
			}
			stepFailures++
			l.cfg.Metrics.NotCommitted("step_failed")
			l.cfg.Logger.Warn("step failed, redelivering batch", "group", l.cfg.Group, "records", len(recs)+held, "err", err)
			// Aborting rewinds the session to the committed offsets,
			// so the batch comes again.
			if _, err := sess.End(ctx, kgo.TryAbort); err != nil {
				return fmt.Errorf("abort after step failure: %w", err)
			}
			ended = l.marks.Load() // the session forgot the revocations too
			clear(read)            // rewound to the committed offsets
			held = 0
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(jitter(min(time.Duration(stepFailures)*100*time.Millisecond, 5*time.Second))):
			}
			continue
		}
		stepFailures = 0
		abandon := func() {
			if out.Abandoned == nil {
				return
			}
			actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			if err := out.Abandoned(actx); err != nil {
				l.cfg.Logger.Warn("abandoned step's undo failed", "group", l.cfg.Group, "err", err)
			}
		}
		// A step that returned nothing to append and nothing to do
		// after the commit (an executor reading its own events, or
		// claiming calls it did not wait for) leaves no effect for a
		// transaction to carry: the batch's offsets are committed by
		// the next one, which spares the log a transaction for every
		// such batch. At low load that was every other transaction of
		// the executor. A redelivery of such a batch is harmless: the
		// step does nothing again, or finds what it did (the
		// executor's claims) durable. What is held is committed on its
		// own by an idle poll (the traffic stopped), or by the first
		// step to return after it waited a tick (a loop that ignores
		// most of what it reads, as the reconciler does, may never see
		// an idle poll): the group's offsets, its lag, and what a
		// restart reads again stay within about a tick (two, with the
		// steps' own time, at worst).
		consumed := len(recs) // this batch's records, counted when committed
		// forced: batches were skipped, and a transaction commits the
		// offsets past them now, with what LoopConfig.Skipped returned,
		// whatever the step did.
		forced := len(pending) > 0
		if forced {
			for _, k := range slices.SortedFunc(maps.Keys(pending), batchStart.compare) {
				out.Records = append(out.Records, pending[k].records...)
			}
		}
		if len(out.Records) == 0 && out.Committed == nil && out.Abandoned == nil && len(recs) > 0 {
			if held == 0 {
				heldSince = time.Now()
			}
			held, consumed = held+len(recs), 0
		}
		if consumed == 0 && len(out.Records) == 0 && !forced {
			due := held > 0 && (len(recs) == 0 || time.Since(heldSince) >= l.cfg.Tick)
			if !due {
				abandon()
				continue
			}
		}

		if err := sess.Begin(); err != nil {
			abandon()
			return fmt.Errorf("begin transaction: %w", err)
		}
		open = true
		var (
			mu         sync.Mutex
			produceErr error
		)
		for _, r := range out.Records {
			sess.Produce(ctx, r, func(_ *kgo.Record, err error) {
				mu.Lock()
				defer mu.Unlock()
				if err != nil && produceErr == nil {
					produceErr = err
				}
			})
		}
		// Flush waits for every promise, so produceErr is settled below.
		if err := sess.Client().Flush(ctx); err != nil {
			abandon()
			return fmt.Errorf("flush: %w", err)
		}
		mu.Lock()
		failed := produceErr
		mu.Unlock()
		if failed == nil {
			l.cfg.Failpoint.Hit(failpoint.Produced)
		}
		// End flushes, then commits only if every produce succeeded,
		// the group did not rebalance, and the offsets committed.
		var committed bool
		recordsOnly := failed == nil && consumed == 0 && held == 0 && !forced && len(sess.Client().UncommittedOffsets()) == 0
		if recordsOnly {
			// No offsets to commit: records alone (an executor's
			// outcomes of calls that ended after their step, on an
			// idle poll). The session's End would take the missing
			// offset commit's answer for an old broker's and hold the
			// loop 500 ms after the commit, to shelter offsets this
			// transaction does not carry; nor does a rebalance meanwhile
			// concern them (a revoke during it is still seen by the next
			// End, which aborts as it would have). The transaction is
			// ended by the client, at once. Not one meant to carry
			// offsets (records polled or held, a skipped batch's) whose
			// partitions a revoke took from the uncommitted ones: End
			// sees the revoke, and aborts it.
			committed, err = endRecordsOnly(ctx, sess.Client())
		} else {
			committed, err = sess.End(ctx, kgo.TransactionEndTry(failed == nil))
		}
		txnDur := time.Since(t0) - stepDur
		l.txnTime.Add(int64(txnDur))
		if err != nil {
			abandon()
			return fmt.Errorf("end transaction: %w", err)
		}
		open = false
		if failed != nil {
			abandon()
			return fmt.Errorf("produce: %w", failed)
		}
		// A revocation the session's End saw aborts it: counted as the
		// rebalance's. The records-only end does not look (the next End
		// does), and its abort is never the rebalance's.
		rebalanced := !recordsOnly && l.revoked.Load() > ended
		if !recordsOnly {
			ended = l.marks.Load()
		}
		if !committed {
			clear(read) // rewound to the committed offsets
			abandon()
			// The abort rewound the session to the committed offsets:
			// the held batches come again too.
			if rebalanced {
				l.cfg.Metrics.NotCommitted("rebalanced")
				l.cfg.Logger.Info("transaction aborted by rebalance, redelivering", "group", l.cfg.Group, "records", consumed+held)
			} else {
				// With no revocation seen: the coordinator turned the
				// commit into an abort (it moved, failed, or answered
				// that it could not be made), or refused the offsets for
				// a member the group no longer knows (whose loss the
				// session reports after this End): worth a look if it
				// goes on.
				l.cfg.Metrics.NotCommitted("aborted")
				l.cfg.Logger.Warn("transaction aborted with no revocation seen (by its coordinator, or for a membership lost meanwhile), redelivering", "group", l.cfg.Group, "records", consumed+held)
			}
			held = 0
			continue
		}
		consumed += held
		held = 0
		for _, k := range slices.SortedFunc(maps.Keys(pending), batchStart.compare) {
			l.cfg.Logger.Error("batch skipped unread: it decompresses to more than the loop's bound", "topic", k.topic, "partition", k.partition,
				"from_offset", k.from, "to_offset", pending[k].next, "max_batch_bytes", l.cfg.MaxBatchBytes)
			l.cfg.Metrics.BatchSkipped(k.topic)
		}
		clear(pending)
		*progressed = true
		l.cfg.Failpoint.Hit(failpoint.Committed)
		l.cfg.Metrics.Committed(consumed, out.Records, stepDur, txnDur)
		l.cfg.Logger.Debug("batch committed", "group", l.cfg.Group, "records", consumed, "appended", len(out.Records), "step", stepDur, "transaction", txnDur)
		if out.Committed != nil {
			// The after-commit step (marking outboxes logged) overlaps
			// the next poll and step; one runs at a time, in order.
			if afterCommit != nil {
				<-afterCommit
			}
			done := make(chan struct{})
			afterCommit = done
			go func(fn func(context.Context) error) {
				defer close(done)
				if err := fn(ctx); err != nil && ctx.Err() == nil {
					l.cfg.Logger.Warn("after-commit step failed", "group", l.cfg.Group, "err", err)
				}
			}(out.Committed)
		}
	}
}

// batchStart names a batch by where it starts.
type batchStart struct {
	topic     string
	partition int32
	from      int64
}

func (a batchStart) compare(b batchStart) int {
	return cmp.Or(strings.Compare(a.topic, b.topic), cmp.Compare(a.partition, b.partition), cmp.Compare(a.from, b.from))
}

// skippedBatch is a batch skipped for its size: the offset past it, and
// the records LoopConfig.Skipped returned for it.
type skippedBatch struct {
	next    int64
	records []*kgo.Record
}

// skipBatch moves the session past a batch that decompresses to more than
// MaxBatchBytes, which franz-go does not read: it stops fetching the
// partition until told where to go on. The batch stays in the log, where
// a human can read it with a client of a larger bound. It is logged at
// Error and counted once a transaction committed the offset past it.
func (l *Loop) skipBatch(cl *kgo.Client, e *kgo.ErrDecompressTooLarge) skippedBatch {
	l.cfg.Logger.Warn("skipping a batch unread: it decompresses to more than the loop's bound", "topic", e.Topic, "partition", e.Partition,
		"from_offset", e.Offset, "to_offset", e.NextOffset, "max_batch_bytes", l.cfg.MaxBatchBytes)
	cl.SetOffsets(map[string]map[int32]kgo.EpochOffset{e.Topic: {e.Partition: {Epoch: e.Epoch, Offset: e.NextOffset}}})
	sb := skippedBatch{next: e.NextOffset}
	if l.cfg.Skipped != nil {
		sb.records = l.cfg.Skipped(e.Topic, e.Partition, e.Offset, e.NextOffset)
	}
	return sb
}

// wideZstdDecoded is franz-go's decompressor bounded at the loop's
// MaxBatchBytes (max), which also decodes the zstd frames whose declared
// window is past the bound, within it. franz-go's decoder refuses such a
// frame (its window limit is its memory bound) with an error it keeps at
// the batch, without its offsets, fetching it again and again: the
// partition stopped for good, the loop logging a Warn a fetch. Brokers
// accept windows up to 128 MiB, and write them themselves when they
// recompress a topic at a high zstd level. Decoded in one pass, a frame
// needs no window of its own, only its output: it is decoded into a
// buffer doubled as needed up to max, and one whose output is past max
// is refused as the bound's (kgo.ErrMaxDecompress: skipped, its offsets
// known). Every other error stays franz-go's.
type wideZstdDecoded struct {
	bounded kgo.Decompressor
	wide    *zstd.Decoder
	max     int
}

// zstdMaxWindow is the largest window a Kafka broker's zstd decoder
// accepts by default.
const zstdMaxWindow = 128 << 20

// newWideZstdDecoded returns franz-go's decompressor bounded at max,
// decoding wide zstd frames within it.
func newWideZstdDecoded(max int) (wideZstdDecoded, error) {
	bounded, err := boundedDecompressor(max)
	if err != nil {
		return wideZstdDecoded{}, err
	}
	wide, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
		zstd.WithDecoderMaxMemory(zstdMaxWindow), zstd.WithDecodeAllCapLimit(true))
	if err != nil {
		return wideZstdDecoded{}, fmt.Errorf("a zstd decoder of windows up to %d bytes: %w", zstdMaxWindow, err)
	}
	return wideZstdDecoded{bounded: bounded, wide: wide, max: max}, nil
}

// zstdBlockMargin is zstd's largest block and the decoder's overrun: a
// one-pass decode whose output would pass its buffer's capacity stops
// before the block that would, which is then at most this short of it.
// (For a frame that states no content size, the decoder's assembly
// reports it as an error of its own, not ErrDecoderSizeExceeded.)
const zstdBlockMargin = 128<<10 + 64

// Decompress implements kgo.Decompressor.
func (d wideZstdDecoded) Decompress(src []byte, codec kgo.CompressionCodecType) ([]byte, error) {
	out, err := d.bounded.Decompress(src, codec)
	if err == nil || codec != kgo.CodecZstd || !errors.Is(err, zstd.ErrWindowSizeExceeded) {
		return out, err
	}
	limit := d.max + zstdBlockMargin
	for size := min(max(4*len(src), 256<<10), limit); ; size = min(2*size, limit) {
		out, err = d.wide.DecodeAll(src, make([]byte, 0, size))
		full := errors.Is(err, zstd.ErrDecoderSizeExceeded) || err != nil && cap(out)-len(out) <= zstdBlockMargin
		switch {
		case err == nil && len(out) <= d.max:
			return out, nil
		case err == nil:
			return nil, fmt.Errorf("%w: %d bytes", kgo.ErrMaxDecompress, len(out))
		case !full:
			// An error of the frame's own, as franz-go's decoder
			// would have met it.
			return nil, err
		case size == limit:
			return nil, fmt.Errorf("%w: %w", kgo.ErrMaxDecompress, err)
		}
	}
}

// Close releases the wide frames' decoder.
func (d wideZstdDecoded) Close() { d.wide.Close() }

// boundedDecompressor is franz-go's own decompressor, bounded at max: a
// decompressor given to a client (WithDecompressor) is used as it is,
// so the bounded one is taken from a client configured with the bound,
// which builds it. The client is closed at once: the decompressor is a
// value of its own.
func boundedDecompressor(max int) (kgo.Decompressor, error) {
	cl, err := kgo.NewClient(kgo.MaxDecompressBatchBytes(max))
	if err != nil {
		return nil, fmt.Errorf("a decompressor bounded at %d bytes: %w", max, err)
	}
	defer cl.Close()
	dec, ok := cl.OptValue(kgo.WithDecompressor).(kgo.Decompressor)
	if !ok {
		return nil, fmt.Errorf("a decompressor bounded at %d bytes: the client has none", max)
	}
	return dec, nil
}

// noteUnreadable forgets the partitions of failing that fetches read a
// record from, or whose fetches have not failed within Ready's window
// (franz-go went past the error, or nothing is there to fetch), and
// keeps in l.unreadable the one failing longest.
func (l *Loop) noteUnreadable(fetches kgo.Fetches, failing map[topicPartition]*fetchFailure) {
	if len(failing) == 0 {
		return
	}
	fetches.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) > 0 {
			delete(failing, topicPartition{p.Topic, p.Partition})
		}
	})
	var oldest *fetchFailure
	for tp, f := range failing {
		if time.Since(f.last) > l.readyWindow() {
			delete(failing, tp)
			continue
		}
		if oldest == nil || f.since.Before(oldest.since) {
			oldest = f
		}
	}
	if oldest != nil {
		c := *oldest
		oldest = &c
	}
	l.unreadable.Store(oldest)
}

// topicPartition names a partition.
type topicPartition struct {
	topic     string
	partition int32
}

// gap is a partition's run of deleted records, by where it starts.
type gap struct {
	topicPartition
	from int64
}

// checkDeleted reports the records fetches skipped because the log
// deleted them before they were read: franz-go, asked for an offset
// before the log's start (its records gone to retention while the loop
// was down or behind), goes on at the start without a word above Info,
// and requests would go undecided, events unacted on, unseen. Where the
// fetch asked from is where the session's last poll of the partition
// ended (read, which it updates), or, before one since the session last
// resumed, the group's committed offset: records between it and the
// log's start are gone. (Records polled and not yet committed, deleted
// meanwhile, were read: the step that has them commits them.) Each gap
// is logged at Error and counted once per session; the loop goes on
// (what is gone cannot be read again), as the projector does not, which
// stops (its answers would be wrong). A gap of
// one offset before a record written in a transaction is logged at Warn
// alone: it is most often the commit marker of the last transaction the
// group read (its committed offset points at it), gone with an idle
// partition's old segments.
func (l *Loop) checkDeleted(cl *kgo.Client, fetches kgo.Fetches, reported map[gap]bool, read map[topicPartition]int64) {
	var committed map[string]map[int32]kgo.EpochOffset
	fetches.EachPartition(func(ftp kgo.FetchTopicPartition) {
		if len(ftp.Records) == 0 {
			return
		}
		tp := topicPartition{ftp.Topic, ftp.Partition}
		last, seen := read[tp]
		read[tp] = ftp.Records[len(ftp.Records)-1].Offset + 1
		if ftp.LogStartOffset <= 0 || ftp.Records[0].Offset < ftp.LogStartOffset {
			return
		}
		if committed == nil {
			committed = cl.CommittedOffsets()
		}
		from := int64(-1)
		if o, ok := committed[ftp.Topic][ftp.Partition]; ok {
			from = o.Offset
		}
		if seen {
			from = last
		}
		g := gap{tp, from}
		if from < 0 || from >= ftp.LogStartOffset || reported[g] {
			return
		}
		reported[g] = true
		n := ftp.LogStartOffset - from
		if n == 1 && ftp.Records[0].Attrs.IsTransactional() {
			// A group resumes at the offset after the last record it
			// was given, which on a partition written in transactions
			// is that transaction's commit marker: one idle past its
			// retention loses only the marker, not a record. (The
			// ledger's own writers of requests do not use
			// transactions: there one offset is one request.)
			l.cfg.Logger.Warn("the offset this loop resumed from was deleted from the log: a transaction's marker, or a record never processed",
				"group", l.cfg.Group, "topic", ftp.Topic, "partition", ftp.Partition, "next_offset", from, "log_start", ftp.LogStartOffset)
			return
		}
		l.cfg.Metrics.RecordsDeleted(ftp.Topic, n)
		l.cfg.Logger.Error("records deleted from the log before this loop read them: they were never processed",
			"group", l.cfg.Group, "topic", ftp.Topic, "partition", ftp.Partition, "next_offset", from, "log_start", ftp.LogStartOffset, "records_lost", n)
	})
}

// lingers reports whether a poll that returned recs makes the loop
// linger: at least LingerFrom (0 is 1, as documented) records the step
// acts on.
func (l *Loop) lingers(recs []*kgo.Record) bool {
	from := max(l.cfg.LingerFrom, 1)
	if l.cfg.Acts == nil {
		return len(recs) >= from
	}
	n := 0
	for _, r := range recs {
		if l.cfg.Acts(r) {
			if n++; n >= from {
				return true
			}
		}
	}
	return false
}

// leaveGroup takes a session that failed out of its group before the
// next session joins. Close leaves too, but gives up after the client's
// retries: when the failure was the broker going away, that LeaveGroup
// can go nowhere, the group
// keeps the old member until its session timeout, and the next
// session's join waits for it that long (franz-go's default 45 s), with
// nothing consumed meanwhile. So the leave is sent again until the group
// answers, for as long as it would keep the member anyway, and once more,
// briefly, if shutdown comes first.
func (l *Loop) leaveGroup(ctx context.Context, cl *kgo.Client) {
	lctx, cancel := context.WithTimeout(ctx, cmp.Or(l.cfg.Client.SessionTimeout, 45*time.Second))
	defer cancel()
	// The client's own leave also stops its group management, which
	// would otherwise rejoin once the group forgets the member; the
	// member id is read after it, so that it is the last one the client
	// had, not one a rejoin replaced meanwhile.
	err := cl.LeaveGroupContext(lctx)
	member, _ := cl.GroupMetadata()
	if member == "" {
		return
	}
	req := kmsg.NewPtrLeaveGroupRequest()
	req.Group = l.cfg.Group
	req.MemberID = member
	m := kmsg.NewLeaveGroupRequestMember()
	m.MemberID = member
	m.Reason = kmsg.StringPtr("transact session failed; a new session joins")
	req.Members = append(req.Members, m)
	// Sent again on any error but two: the member is gone already, or
	// the group will never let this client leave (its ACLs).
	send := func(ctx context.Context) error {
		resp, err := req.RequestWith(ctx, cl)
		if err == nil {
			if err = kerr.ErrorForCode(resp.ErrorCode); err == nil && len(resp.Members) > 0 {
				err = kerr.ErrorForCode(resp.Members[0].ErrorCode)
			}
		}
		return err
	}
	for delay := 100 * time.Millisecond; err != nil && !errors.Is(err, kerr.UnknownMemberID) && !errors.Is(err, kerr.GroupAuthorizationFailed); delay = min(2*delay, time.Second) {
		select {
		case <-lctx.Done():
			if ctx.Err() != nil {
				// Shutting down: one last try, briefly, for the
				// process that starts next would wait for this
				// member as the next session would have.
				sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lastLeave)
				err = send(sctx)
				cancel()
				if err == nil || errors.Is(err, kerr.UnknownMemberID) {
					return
				}
			}
			l.cfg.Logger.Warn("failed session could not leave its group; the next member waits for the group to drop it", "group", l.cfg.Group, "err", err)
			return
		case <-time.After(delay):
		}
		err = send(lctx)
	}
}

// lastLeave bounds the leave a failed session sends at shutdown.
const lastLeave = 2 * time.Second

// jitter spreads retries of many instances apart.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d/2 + rand.N(d/2+1)
}

// endRecordsOnly ends a transaction that commits no offsets, as
// GroupTransactSession.End would with TryCommit: an answer that says the
// commit was not made, or leaves it unconfirmed, is followed by an abort,
// and reported as not committed (the step is abandoned, its records made
// again).
func endRecordsOnly(ctx context.Context, cl *kgo.Client) (committed bool, err error) {
	err = cl.EndTransaction(ctx, kgo.TryCommit)
	if errors.Is(err, kerr.OperationNotAttempted) || errors.Is(err, kerr.TransactionAbortable) || errors.Is(err, kerr.UnknownServerError) {
		return false, cl.EndTransaction(ctx, kgo.TryAbort)
	}
	return err == nil, err
}
