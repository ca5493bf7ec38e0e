// Package projector feeds projections from Kafka. It reads the events and
// control topics read_committed in a consumer group, hands the records to
// a projections.Sink in batches, and commits a batch's offsets only once
// the sink's Write returned nil: a projection may see a record twice
// (after a crash or a rebalance), never miss one.
//
// Offsets. A batch's offset for a partition is the one after the last
// record read into it. The client keeps transaction markers
// (kgo.KeepControlRecords), so that this offset moves past the commit or
// abort marker that ends a transaction: a caught-up group's committed
// offset is the high watermark, and lag in records reaches 0.
//
// Gaps. When retention deleted records of a partition before the
// projector read them, kgo goes on at the log start without a word; the
// projector sees it (the records start past where the partition's next
// record must be, and so does the log) and stops with ErrRecordsDeleted,
// never committing the partition past the gap.
//
// Ends. A sink that records where its records end
// (projections.Positioned: ClickHouse) is asked before each batch and at
// each lag refresh; a partition it holds less of than the group committed
// (a database restored from an older backup) is read again from its end
// (checkPositions, checkCommitted, applyRereads), one whose end it has
// shown and then lost (a restore refilling the tables) is held, its
// fetches paused, until the end is back (unless it never had a record
// before the group's offset: holds), and one with no end yet gets one
// where the group is. That
// the projection had an end outlives the process: the group's offsets are
// committed with metadata saying so (endsMark), which a partition's next
// owner reads before it writes anything of it (learnMarks), so that a
// projector restarted or rebalanced during a restore holds the partition
// too.
//
// Rebalances. Polls and the rebalance callbacks exclude each other
// (kgo.BlockRebalanceOnPoll, allowed again right after each poll), and a
// commit excludes the callbacks (commitMu). A revoked or lost partition's
// records that are not committed yet are dropped from the batch being
// built, and an in-flight batch never commits that partition's offset: its
// next owner reads them again from the group's committed offset. Writing
// and committing them in the callback instead would hold the whole group's
// rebalance hostage to a sink that may be down, and a lost partition
// cannot be committed anyway; the Sink contract makes the second write
// harmless.
//
// Beside Projector, the package has Replay (rebuild a projection from the
// log start without a group), Status (a group's lag from the brokers, with kadm)
// and CommitOffsets (move a stopped group to where a replay ended).
//
// File map: projector.go (Projector, Config, the poll loop, commits,
// rebalances), metrics.go (Lag, Metrics, Histogram, the Prometheus
// handler), status.go (Status, CommitOffsets, direct fetches),
// replay.go (Replay, Progress, NewBar).
package projector

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
)

// Defaults of Config.
const (
	DefaultGroup    = "ledger-projector"
	DefaultMaxBatch = 5000
	// DefaultMaxBatchBytes bounds a batch's bytes: a requested event
	// may carry up to 256 KiB of arguments, and 5,000 of them held
	// decoded, encoded and in the store client's columns would be
	// gigabytes.
	DefaultMaxBatchBytes = 64 << 20
	DefaultMaxWait       = 250 * time.Millisecond
	// DefaultLagRefresh is how often the lag is read from the brokers.
	DefaultLagRefresh = 5 * time.Second
)

// endsMark is the metadata of the offsets the projector commits when its
// sink records where its records end: the projection had recorded an end
// of the partition, at or past the offset, when the group committed it.
// kgo's own metadata (the member id), an older build's, and commits from
// outside the group (CommitOffsets) are anything else.
const endsMark = "ledger-projector:ends/1"

// Config configures a Projector.
type Config struct {
	// Client is the Kafka connection. Brokers are required.
	Client ledger.ClientConfig
	// Topics names the topics; the projector reads Events and Control.
	// Empty names take the defaults.
	Topics ledger.Topics
	// Group is the consumer group; default DefaultGroup. Every projection
	// needs its own group: the group's offsets are how far that
	// projection got.
	Group string
	// MaxBatch bounds the records in a batch (every record read,
	// including transaction markers and undecodable ones); default
	// DefaultMaxBatch.
	MaxBatch int
	// MaxBatchBytes bounds the bytes (keys and values) read into a
	// batch: one that holds that much is written. A fetch brings at most
	// about that much, so a batch holds at most about twice it. Default
	// DefaultMaxBatchBytes.
	MaxBatchBytes int
	// MaxWait is how long after its first record a batch that is not
	// full is written anyway; default DefaultMaxWait. It is measured on
	// the wall clock, not with Now.
	MaxWait time.Duration
	// LagRefresh is how often the projector reads its partitions' high
	// watermarks (and, for partitions it has not read yet, the group's
	// committed offsets) from the brokers, as Status does, for Lag;
	// default DefaultLagRefresh. Fetches keep the ends current only while
	// they return records, and none are made while a write is retried.
	LagRefresh time.Duration
	// Logger; nil discards.
	Logger *slog.Logger
	// Now is the clock for lag in seconds and the projection latency;
	// default time.Now.
	Now func() time.Time
}

func (c *Config) setDefaults() {
	c.Topics = c.Topics.WithDefaults()
	if c.Group == "" {
		c.Group = DefaultGroup
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = DefaultMaxBatch
	}
	if c.MaxBatchBytes <= 0 {
		c.MaxBatchBytes = DefaultMaxBatchBytes
	}
	if c.MaxWait <= 0 {
		c.MaxWait = DefaultMaxWait
	}
	if c.LagRefresh <= 0 {
		c.LagRefresh = DefaultLagRefresh
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
}

func (c *Config) validate() error {
	switch {
	case len(c.Client.Brokers) == 0:
		return errors.New("projector: no kafka brokers")
	case c.Topics.Events == c.Topics.Control:
		return fmt.Errorf("projector: events and control are the same topic %q", c.Topics.Events)
	}
	return nil
}

// Projector consumes the events and control topics into a Sink. Run it
// once; Lag, Metrics, Latency and ServeHTTP may be called concurrently
// with Run and with each other.
type Projector struct {
	cfg  Config
	sink projections.Sink
	// positioned is sink when it records where its records end; nil
	// else.
	positioned projections.Positioned
	logger     *slog.Logger
	running    atomic.Bool

	// commitMu is held across a commit and across the rebalance
	// callbacks, so that no offset of a partition is committed once its
	// revocation returned. Lock order: commitMu, then mu.
	commitMu sync.Mutex
	// mu guards parts, pending, interrupt and woken.
	mu      sync.Mutex
	parts   map[topicPartition]*partState
	pending *pendingBatch
	// interrupt ends the poll in progress, if any; woken says a reread
	// or a resume waits for applyRereads, so that the lag refresh's
	// findings apply at once rather than when the poll times out (a lag
	// refresh, with no records coming).
	interrupt context.CancelFunc
	woken     bool
	// assignedNow has the lag refresh run at once when partitions are
	// assigned: the lag, and what a database restored while the
	// projector was stopped lacks of a partition no record comes to,
	// are known then, not a LagRefresh later.
	assignedNow chan struct{}

	written      atomic.Int64
	batches      atomic.Int64
	writeErrors  atomic.Int64
	undecodable  atomic.Int64
	commitErrors atomic.Int64
	gaps         atomic.Int64
	unknownTypes atomic.Int64
	rereads      atomic.Int64
	latency      Histogram

	// stop, set and read by Run's goroutine only, is why Run must stop:
	// a record it must not skip (ErrNewerRecord), or records the log
	// deleted before they were read (ErrRecordsDeleted).
	stop error
}

type topicPartition struct {
	topic     string
	partition int32
}

// partState is what the projector knows of one partition it was assigned.
type partState struct {
	owned bool
	// gen changes whenever the partition is revoked or lost: an
	// in-flight batch commits the partition only if gen did not change
	// since the batch was taken.
	gen uint64
	// end is the high watermark, from the last fetch with records or
	// the last refresh from the brokers (refreshLag); -1 before either.
	end int64
	// committed is the offset the group will resume from: the last
	// offset committed, or where this assignment started reading; -1
	// before the first fetch.
	committed int64
	// next is where this assignment's next record must be: the offset
	// after the last record read, or before the first fetch the offset
	// the group committed; -1 while unknown (the group never committed
	// on the partition, so reading starts at the log start). A fetch
	// whose records start past next while the log starts past it too
	// skipped records the log deleted before they were read.
	next int64
	// pendingOldest and inflightOldest are the timestamps of the oldest
	// record read but not yet written, in the batch being built and in
	// the batch being written; zero when there is none.
	pendingOldest, inflightOldest time.Time
	// start is where the partition's log starts, from the last lag
	// refresh; -1 before it.
	start int64
	// endSeen: the sink has shown or taken an end of the partition in
	// this assignment. Once it has, an end gone is a table being
	// replaced (a restore dropping and filling the tables one by one),
	// not a partition never recorded: nothing is written for it, lest
	// an end recorded now outlast the restore's and hide what it lacks.
	// endGone: its end is gone and the partition held for it (holds),
	// as logged; the lag refresh clears it once the end is back.
	endSeen, endGone bool
	// hold: checkPositions found the end gone, and applyRereads is to
	// pause the partition's fetches once it has moved it back; paused:
	// it did, until the lag refresh sees the end back (checkCommitted),
	// so that a partition held for long (a restore from a backup
	// without ends, until record-ends) neither slows the others nor is
	// read over and over.
	hold, paused bool
	// learned: the group's commit of the partition was read in this
	// assignment (learnMarks); marked: that commit, or one of this
	// assignment, carries endsMark. A partition learned marked is
	// endSeen from the start.
	learned, marked bool
	// reread, when not negative, is where the partition must be read
	// from again before the next poll (applyRereads): where the
	// projection's records end, short of where the group is
	// (checkPositions, checkCommitted).
	reread int64
}

// pendingBatch is the batch being built.
type pendingBatch struct {
	batch projections.Batch
	// records counts every record read into the batch, per partition
	// too: markers and undecodable records are not in batch, but their
	// offsets are committed with it.
	records int
	counts  map[topicPartition]int
	// bytes counts the keys and values of the records read, per
	// partition too, so that a revocation takes its partitions' share
	// off: a batch emptied by one must not stay full, or the loop
	// would neither poll nor flush again.
	bytes int
	sizes map[topicPartition]int
	// next is, per partition, the offset after the last record read.
	next map[topicPartition]kgo.EpochOffset
	// from is, per partition, where its first record read into the
	// batch had to be (partState.next then); -1 when unknown.
	from map[topicPartition]int64
	// started is when the first record was read (wall clock).
	started time.Time
}

func newPendingBatch() *pendingBatch {
	return &pendingBatch{counts: make(map[topicPartition]int), sizes: make(map[topicPartition]int), next: make(map[topicPartition]kgo.EpochOffset), from: make(map[topicPartition]int64)}
}

// add counts the records of a part read, and where its partition now
// ends.
func (b *pendingBatch) add(rp *readPart) {
	b.records += rp.records
	b.bytes += rp.bytes
	b.counts[rp.tp] += rp.records
	b.sizes[rp.tp] += rp.bytes
	b.next[rp.tp] = rp.next
	if _, ok := b.from[rp.tp]; !ok {
		b.from[rp.tp] = rp.from
	}
}

// drop takes a partition's records off the counts and returns how many
// there were; their events and actions are the caller's to remove.
func (b *pendingBatch) drop(tp topicPartition) int {
	n := b.counts[tp]
	b.records -= n
	b.bytes -= b.sizes[tp]
	delete(b.counts, tp)
	delete(b.sizes, tp)
	delete(b.next, tp)
	delete(b.from, tp)
	return n
}

// dropParts takes the records of the partitions gone out of the batch,
// and returns how many there were.
func (b *pendingBatch) dropParts(gone map[topicPartition]bool, t ledger.Topics) int {
	if len(gone) == 0 {
		return 0
	}
	dropped := 0
	for tp := range gone {
		dropped += b.drop(tp)
	}
	evs := b.batch.Events[:0]
	for _, e := range b.batch.Events {
		if !gone[topicPartition{t.Events, e.Partition}] {
			evs = append(evs, e)
		}
	}
	acts := b.batch.Actions[:0]
	for _, a := range b.batch.Actions {
		if !gone[topicPartition{t.Control, a.Partition}] {
			acts = append(acts, a)
		}
	}
	b.batch.Events, b.batch.Actions = evs, acts
	if b.records == 0 {
		b.started = time.Time{}
	}
	return dropped
}

// New returns a projector that writes to sink.
func New(cfg Config, sink projections.Sink) (*Projector, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if sink == nil {
		return nil, errors.New("projector: no sink")
	}
	positioned, _ := sink.(projections.Positioned)
	return &Projector{
		cfg:         cfg,
		sink:        sink,
		positioned:  positioned,
		logger:      cfg.Logger.With("group", cfg.Group),
		parts:       make(map[topicPartition]*partState),
		pending:     newPendingBatch(),
		assignedNow: make(chan struct{}, 1),
	}, nil
}

// Run consumes until ctx is done, then leaves the group and returns nil.
// Records read but not committed at that point are read again by the
// group's next member. It returns an error only when the client cannot
// run at all.
func (p *Projector) Run(ctx context.Context) error {
	if !p.running.CompareAndSwap(false, true) {
		return errors.New("projector: already running")
	}
	defer p.running.Store(false)
	p.stop = nil

	t := p.cfg.Topics
	cl, err := ledger.NewClient(p.cfg.Client,
		kgo.ConsumerGroup(p.cfg.Group),
		kgo.ConsumeTopics(t.Events, t.Control),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
		kgo.KeepControlRecords(),
		// A fetch in flight when partitions are assigned does not ask
		// for them; kgo's 5s default would hold new partitions back
		// that long after every rebalance. 500ms is Kafka's default.
		kgo.FetchMaxWait(500*time.Millisecond),
		batchFetchBytes(p.cfg.MaxBatchBytes),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsAssigned(p.assigned),
		kgo.OnPartitionsRevoked(p.revoked),
		kgo.OnPartitionsLost(p.revoked),
	)
	if err != nil {
		return fmt.Errorf("projector: %w", err)
	}
	// Close leaves the group, which revokes everything: the callback
	// drops what was not committed.
	defer cl.Close()
	// The lag refresh ends before the client closes (defers run last
	// first).
	refreshCtx, stopRefresh := context.WithCancel(ctx)
	var refreshing sync.WaitGroup
	refreshing.Go(func() { p.refreshLag(refreshCtx, cl) })
	defer refreshing.Wait()
	defer stopRefresh()
	p.logger.Info("projector started", "events_topic", t.Events, "control_topic", t.Control,
		"max_batch", p.cfg.MaxBatch, "max_wait", p.cfg.MaxWait)

	for ctx.Err() == nil {
		p.mu.Lock()
		room := p.cfg.MaxBatch - p.pending.records
		full := p.pending.bytes >= p.cfg.MaxBatchBytes
		started := p.pending.started
		p.mu.Unlock()

		if room > 0 && !full && (started.IsZero() || time.Since(started) < p.cfg.MaxWait) {
			p.applyRereads(cl)
			// One context a poll, each cancelled after it: one
			// made and dropped would stay among ctx's children.
			var pollCtx context.Context
			var cancel context.CancelFunc
			switch {
			case !started.IsZero():
				pollCtx, cancel = context.WithDeadline(ctx, started.Add(p.cfg.MaxWait))
			case p.positioned != nil:
				// Back between polls, should no record come (wake
				// ends the poll sooner).
				pollCtx, cancel = context.WithTimeout(ctx, p.cfg.LagRefresh)
			default:
				pollCtx, cancel = context.WithCancel(ctx)
			}
			p.mu.Lock()
			p.interrupt = cancel
			if p.woken || p.stop != nil {
				// A stop (applyRereads found records deleted)
				// waits for no poll.
				cancel()
			}
			p.mu.Unlock()
			fetches := cl.PollRecords(pollCtx, room)
			p.mu.Lock()
			p.interrupt = nil
			p.mu.Unlock()
			cancel()
			p.read(cl, fetches)
			// Rebalances wait while polled records are not yet in
			// the batch (BlockRebalanceOnPoll), and only then.
			cl.AllowRebalance()
			if fetches.IsClientClosed() {
				return errors.New("projector: kafka client closed")
			}
			if p.stop != nil {
				// What came before the newer record, or before the
				// deleted ones, is written and committed; then stop,
				// loudly.
				if err := p.flush(ctx, cl); err != nil {
					return nil
				}
				if errors.Is(p.stop, ErrRecordsDeleted) {
					p.logger.Error("projector stopped: records were deleted from the log before they were projected", "err", p.stop)
				} else {
					p.logger.Error("projector stopped: upgrade it to read the log", "err", p.stop)
				}
				return p.stop
			}
		}
		if ctx.Err() != nil {
			break
		}
		if p.due() {
			if err := p.flush(ctx, cl); err != nil {
				break // ctx is done
			}
		}
	}
	p.logger.Info("projector stopping")
	return nil
}

// refreshLag reads the assigned partitions' ends, and where this
// assignment has not read yet the group's committed offsets, from the
// brokers every LagRefresh until ctx is done: the lag goes on growing while
// writes fail and nothing is polled, and it covers partitions no fetch
// returned records of.
func (p *Projector) refreshLag(ctx context.Context, cl *kgo.Client) {
	adm := kadm.NewClient(cl)
	topics := []string{p.cfg.Topics.Events, p.cfg.Topics.Control}
	tick := time.NewTicker(p.cfg.LagRefresh)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-p.assignedNow:
		}
		// A partition revoked (and maybe assigned again) while the
		// brokers answered takes nothing from the answer.
		gens := make(map[topicPartition]uint64)
		p.mu.Lock()
		for tp, st := range p.parts {
			if st.owned {
				gens[tp] = st.gen
			}
		}
		p.mu.Unlock()
		if len(gens) == 0 {
			continue
		}
		pos, err := positions(ctx, adm, p.cfg.Group, topics)
		if err != nil {
			if ctx.Err() == nil {
				p.logger.Warn("lag refresh failed; trying again later", "err", err)
			}
			// The ends are still compared with where the group
			// is, as last known: a held partition whose end is
			// back must not wait for every partition of both
			// topics to answer (one without a leader).
			p.checkCommitted(ctx, cl, adm)
			continue
		}
		p.mu.Lock()
		for tp, gen := range gens {
			st := p.parts[tp]
			ps, ok := pos[tp]
			if !ok || !st.owned || st.gen != gen {
				continue
			}
			st.end, st.start = ps.End, ps.Start
			if st.committed < 0 {
				// As Status counts it: from the log start when the
				// group never committed.
				st.committed = ps.Committed
				if st.committed < 0 {
					st.committed = ps.Start
				}
			}
		}
		p.mu.Unlock()
		p.checkCommitted(ctx, cl, adm)
	}
}

// checkCommitted compares, for a sink that records its ends, where they
// are with where the group committed each partition this assignment owns:
// a partition no batch comes for (no traffic) would otherwise go on
// lacking what a database restored from an older backup lost, until its
// next record. Committed offsets are taken before the ends are read:
// Write records a batch's ends before its offsets are committed, so they
// are behind only when the database lost them. Last, the partitions the
// sink has an end of are committed with endsMark where the group has them
// without it (markEnded).
func (p *Projector) checkCommitted(ctx context.Context, cl *kgo.Client, adm *kadm.Client) {
	sink := p.positioned
	if sink == nil {
		return
	}
	if err := p.learnMarks(ctx, adm); err != nil {
		if ctx.Err() == nil {
			p.logger.Warn("reading the group's committed offsets failed; trying again later", "err", err)
		}
		return
	}
	defer p.markEnded(ctx, cl)
	parts := make(map[topicPartition]owned)
	p.mu.Lock()
	for tp, st := range p.parts {
		if st.owned && st.learned && st.committed >= 0 {
			parts[tp] = owned{st.gen, st.committed, st.endSeen, st.endGone}
		}
	}
	p.mu.Unlock()
	if len(parts) == 0 {
		return
	}
	pos, err := sink.Positions(ctx)
	if err != nil {
		if ctx.Err() == nil {
			p.logger.Warn("reading the projection's positions failed; trying again later", "err", err)
		}
		return
	}
	var unrecorded []projections.End
	gens := make(map[topicPartition]uint64)
	p.mu.Lock()
	for tp, o := range parts {
		st := p.parts[tp]
		// learned too: assigned clears it without a new gen.
		// committed too: a reread applied meanwhile (applyRereads) would
		// be found lacking again, and read twice.
		if !st.owned || !st.learned || st.gen != o.gen || st.committed != o.committed || st.endSeen != o.endSeen || st.endGone != o.endGone {
			continue
		}
		end, ok := pos.Lookup(tp.topic, tp.partition)
		p.sawEnd(tp, st, ok, holds(o.committed))
		switch {
		case !ok && (!st.endSeen || !holds(o.committed)):
			unrecorded = append(unrecorded, projections.End{Topic: tp.topic, Partition: tp.partition, Next: o.committed})
			gens[tp] = o.gen
		case ok && end < o.committed && st.reread < 0:
			p.lacks(tp, st, end, o.committed)
		}
	}
	p.mu.Unlock()
	if len(unrecorded) == 0 {
		return
	}

	// A partition no batch of this build was written for (empty since
	// the projection began, or idle since an upgrade) has its end
	// recorded where the group is, as a batch would have: a backup taken
	// from now on then says where the projection stood there too, and a
	// restore of it is caught. Without it, a partition empty when the
	// backup was taken had no end, and what it received after went
	// missing for good.
	if err := sink.Write(ctx, projections.Batch{Ends: unrecorded}); err != nil {
		if ctx.Err() == nil {
			p.logger.Warn("recording where the projection's records end failed; trying again later", "err", err)
		}
		return
	}
	p.recorded(unrecorded, gens)
}

// owned is a partition this assignment owned, as of its gen, and where
// the group was.
type owned struct {
	gen       uint64
	committed int64
	// endSeen and endGone as they were before the ends were read: a
	// flush that wrote the partition's first end, or found its end gone,
	// meanwhile makes the read stale.
	endSeen, endGone bool
}

// recorded marks the partitions of ends, if still owned as of gens, as
// having ends in the sink (endSeen), once they were written.
func (p *Projector) recorded(ends []projections.End, gens map[topicPartition]uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, e := range ends {
		tp := topicPartition{e.Topic, e.Partition}
		if st, gen := p.parts[tp], gens[tp]; st != nil && st.owned && st.gen == gen {
			st.endSeen = true
		}
	}
}

// learnMarks reads the group's commits of the partitions this assignment
// has not yet (learned), and takes a partition committed with endsMark as
// one whose end the sink has shown (endSeen): a restart or a rebalance
// during a restore otherwise forgets it, and the new owner, finding no end
// in the tables the restore is refilling, records one where the group is,
// which then hides what the restored database lacks. A partition is
// learned before anything of it is written (checkPositions,
// checkCommitted).
func (p *Projector) learnMarks(ctx context.Context, adm *kadm.Client) error {
	gens := make(map[topicPartition]uint64)
	p.mu.Lock()
	for tp, st := range p.parts {
		if st.owned && !st.learned {
			gens[tp] = st.gen
		}
	}
	p.mu.Unlock()
	if len(gens) == 0 {
		return nil
	}
	resps, err := adm.FetchOffsets(ctx, p.cfg.Group)
	if err != nil {
		return fmt.Errorf("fetch the offsets of group %s: %w", p.cfg.Group, err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for tp, gen := range gens {
		st := p.parts[tp]
		if !st.owned || st.gen != gen {
			continue
		}
		r, ok := resps.Lookup(tp.topic, tp.partition)
		if ok && r.Err != nil {
			return fmt.Errorf("fetch the offset of group %s on %s/%d: %w", p.cfg.Group, tp.topic, tp.partition, r.Err)
		}
		st.learned = true
		if ok && r.Metadata == endsMark {
			st.marked, st.endSeen = true, true
		}
		if ok && r.At >= 0 && st.committed < 0 {
			// Where the group is, known now: the lag refresh's
			// listing may fail for long (a partition without a
			// leader), and checkCommitted compares only partitions
			// whose offset it knows.
			st.committed = r.At
		}
	}
	return nil
}

// markEnded commits endsMark, at the offset the group is at, for each
// partition the sink has shown an end of whose commit lacks it (made by an
// older build, by rebuild --swap or skip-deleted, or where the lag refresh
// just recorded the partition's first end): no batch commits a partition
// no record comes to, and its next owner must know it had an end.
func (p *Projector) markEnded(ctx context.Context, cl *kgo.Client) {
	p.commitMu.Lock()
	defer p.commitMu.Unlock()
	offsets := make(map[string]map[int32]kgo.EpochOffset)
	gens := make(map[topicPartition]uint64)
	p.mu.Lock()
	for tp, st := range p.parts {
		// Held partitions too (endGone): their next owner must hold
		// them as well, and no batch commits them meanwhile.
		if !st.owned || !st.learned || st.marked || !st.endSeen || st.committed < 0 || st.reread >= 0 {
			continue
		}
		if offsets[tp.topic] == nil {
			offsets[tp.topic] = make(map[int32]kgo.EpochOffset)
		}
		offsets[tp.topic][tp.partition] = kgo.EpochOffset{Epoch: -1, Offset: st.committed}
		gens[tp] = st.gen
	}
	p.mu.Unlock()
	if len(offsets) == 0 {
		return
	}
	if err := commitSync(kgo.PreCommitFnContext(ctx, markEnds), cl, offsets); err != nil {
		if ctx.Err() == nil {
			p.commitErrors.Add(1)
			p.logger.Warn("committing that the projection records where its records end failed; trying again later", "err", err)
		}
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for tp, gen := range gens {
		if st := p.parts[tp]; st.owned && st.gen == gen {
			st.marked = true
		}
	}
}

// markEnds sets endsMark as the metadata of every offset req commits.
func markEnds(req *kmsg.OffsetCommitRequest) error {
	mark := endsMark
	for i := range req.Topics {
		for j := range req.Topics[i].Partitions {
			req.Topics[i].Partitions[j].Metadata = &mark
		}
	}
	return nil
}

// sawEnd notes whether the sink shows an end of tp (ok): seen once, one
// gone, where the partition is held for it (held, of holds), is logged,
// once, until it is back (endGone). mu is held.
func (p *Projector) sawEnd(tp topicPartition, st *partState, ok, held bool) {
	switch {
	case ok:
		if st.endGone {
			p.logger.Info("the projection's end of the partition is back: going on", "topic", tp.topic, "partition", tp.partition)
			p.wake() // to resume it
		}
		st.endSeen, st.endGone = true, false
	case st.endSeen && !st.endGone && held:
		st.endGone = true
		p.logger.Warn("the projection's end of the partition is gone (its table replaced: a restore in progress?): holding the partition until it is back; if the database, the restore done, has no end for the partition (a backup from before ends were recorded, or a new database), run `ledger projector rebuild --swap`, or `ledger projector record-ends` to go on without what it lacks",
			"topic", tp.topic, "partition", tp.partition)
	}
}

// lacks has tp read again from end, where the sink's records end, before
// the next poll (applyRereads), the group being at (or the batch starting
// from) at. mu is held.
func (p *Projector) lacks(tp topicPartition, st *partState, end, at int64) {
	st.reread = end
	p.wake()
	p.rereads.Add(1)
	p.logger.Warn("the projection lacks records the group committed past (a database restored from an older backup?): reading them again",
		"topic", tp.topic, "partition", tp.partition, "projection_ends_at", end, "group_at", at, "records", at-end)
}

// wake has applyRereads run before the next poll, ending the poll in
// progress. mu is held.
func (p *Projector) wake() {
	p.woken = true
	if p.interrupt != nil {
		p.interrupt()
	}
}

// due reports whether the batch being built is full or old enough.
func (p *Projector) due() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	b := p.pending
	return b.records > 0 && (b.records >= p.cfg.MaxBatch || b.bytes >= p.cfg.MaxBatchBytes || time.Since(b.started) >= p.cfg.MaxWait)
}

// batchFetchBytes bounds what one fetch brings to a batch's bound, so that
// a batch is not a fetch of kgo's default 50 MiB past its bound.
func batchFetchBytes(batchBytes int) kgo.Opt {
	return kgo.FetchMaxBytes(int32(min(batchBytes, math.MaxInt32)))
}

// readPart is what one poll read of one partition.
type readPart struct {
	tp topicPartition
	// from is where the part's first record had to be: the offset after
	// the partition's last record read, or the group's committed offset;
	// -1 when unknown.
	from     int64
	hwm      int64
	logStart int64
	first    int64
	next     kgo.EpochOffset
	oldest   time.Time
	records  int
	bytes    int
	events   []projections.Event
	actions  []projections.Action
}

// read decodes what a poll returned and adds it to the batch being built.
// A partition whose records start past records the log deleted before
// they were read adds nothing, and stops the projector (ErrRecordsDeleted).
func (p *Projector) read(cl *kgo.Client, fetches kgo.Fetches) {
	fetches.EachError(func(topic string, partition int32, err error) {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return
		}
		p.logger.Warn("fetch error", "topic", topic, "partition", partition, "err", err)
	})
	var fetched []kgo.FetchTopicPartition
	fetches.EachPartition(func(ftp kgo.FetchTopicPartition) {
		if len(ftp.Records) > 0 {
			fetched = append(fetched, ftp)
		}
	})
	if len(fetched) == 0 {
		return
	}
	// Where the group resumed reading, for the lag of a partition this
	// assignment has not committed yet, and for where its first records
	// must start. Read before taking mu: kgo takes its own lock.
	committed := cl.CommittedOffsets()
	resumed := func(tp topicPartition) int64 {
		if o, ok := committed[tp.topic][tp.partition]; ok && o.Offset >= 0 {
			return o.Offset
		}
		return -1
	}
	next := make(map[topicPartition]int64, len(fetched))
	p.mu.Lock()
	for _, ftp := range fetched {
		tp := topicPartition{ftp.Topic, ftp.Partition}
		if st := p.parts[tp]; st != nil && st.next >= 0 {
			next[tp] = st.next
		} else {
			next[tp] = resumed(tp)
		}
	}
	p.mu.Unlock()

	var parts []readPart
	// halted are the partitions this poll stopped at (a gap, a record
	// not read): a second fetch of one in the same poll must add
	// nothing either, or its records would be written and committed
	// past the point the projector stops at.
	halted := make(map[topicPartition]bool)
	for _, ftp := range fetched {
		rp := readPart{
			tp:       topicPartition{ftp.Topic, ftp.Partition},
			from:     next[topicPartition{ftp.Topic, ftp.Partition}],
			hwm:      ftp.HighWatermark,
			logStart: ftp.LogStartOffset,
			first:    ftp.Records[0].Offset,
		}
		if halted[rp.tp] {
			continue
		}
		if from := next[rp.tp]; from >= 0 {
			if err := recordsDeleted(rp.tp, from, rp.first, rp.logStart); err != nil {
				// Nothing of this partition is written or committed,
				// so that the group stays before the gap, and every
				// restart finds it again until a human moves the
				// group past it.
				p.deleted(rp.tp, from, rp.logStart, err)
				halted[rp.tp] = true
				continue
			}
		}
		for _, r := range ftp.Records {
			if !r.Attrs.IsControl() {
				if err := p.decode(r, &rp.events, &rp.actions); err != nil {
					// Nothing from here on in this partition: the
					// batch ends, and its offsets stop, before r.
					if p.stop == nil {
						p.stop = err
					}
					halted[rp.tp] = true
					break
				}
			}
			rp.records++
			rp.bytes += len(r.Key) + len(r.Value)
			rp.next = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset + 1}
			if rp.oldest.IsZero() || r.Timestamp.Before(rp.oldest) {
				rp.oldest = r.Timestamp
			}
		}
		if rp.records > 0 {
			// A poll may hold two fetches of one partition.
			next[rp.tp] = rp.next.Offset
			parts = append(parts, rp)
		}
	}
	if len(parts) == 0 {
		return
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	b := p.pending
	for i := range parts {
		rp := &parts[i]
		st := p.state(rp.tp)
		if !st.owned {
			// kgo returns records only of assigned partitions; an
			// assignment we did not hear of is still ours.
			p.logger.Warn("records of a partition not known to be assigned", "topic", rp.tp.topic, "partition", rp.tp.partition)
			st.owned = true
		}
		if rp.hwm >= 0 {
			st.end = rp.hwm
		}
		if rp.logStart >= 0 {
			st.start = rp.logStart
		}
		if st.committed < 0 {
			switch o := resumed(rp.tp); {
			case o >= 0:
				st.committed = o
			case rp.logStart >= 0:
				st.committed = rp.logStart
			default:
				st.committed = rp.first
			}
		}
		st.next = rp.next.Offset
		if st.pendingOldest.IsZero() || rp.oldest.Before(st.pendingOldest) {
			st.pendingOldest = rp.oldest
		}
		b.batch.Events = append(b.batch.Events, rp.events...)
		b.batch.Actions = append(b.batch.Actions, rp.actions...)
		b.add(rp)
	}
	if b.started.IsZero() {
		b.started = time.Now()
	}
}

// state returns the partition's state, creating it. mu is held.
func (p *Projector) state(tp topicPartition) *partState {
	st := p.parts[tp]
	if st == nil {
		st = &partState{end: -1, committed: -1, next: -1, reread: -1, start: -1}
		p.parts[tp] = st
	}
	return st
}

// decode appends r to evs or acts, or counts and logs it as undecodable.
// A record of a newer encoding than this build reads is not skipped: it
// returns ErrNewerRecord, and the projection stops before it.
func (p *Projector) decode(r *kgo.Record, evs *[]projections.Event, acts *[]projections.Action) error {
	n := len(*evs)
	err := decodeRecord(r, p.cfg.Topics, evs, acts)
	if newer(err) {
		return fmt.Errorf("%w: %s/%d at offset %d: %w", ErrNewerRecord, r.Topic, r.Partition, r.Offset, err)
	}
	if err != nil {
		p.undecodable.Add(1)
		logUndecodable(p.logger, r, err)
	}
	if len(*evs) > n && unknownType(p.logger, r, &(*evs)[n].Event) {
		p.unknownTypes.Add(1)
	}
	return nil
}

// ErrNewerRecord: the log holds a record written by a newer ledger than
// this one. Skipping it would leave the projection short of it for good,
// so the projector writes and commits what came before it and stops: the
// projector must be upgraded.
var ErrNewerRecord = errors.New("a record of a newer encoding than this projector reads")

// recordsDeleted is ErrRecordsDeleted for partition tp, whose next offset
// to read is from, when the records fetched begin at first and the log at
// logStart past it: kgo met OFFSET_OUT_OF_RANGE and went on at the log's
// start, and the records from `from` up to it are gone. Nil otherwise:
// offsets skipped above the log's start were aborted or compacted away.
// deleted stops the projector (Run's goroutine) at records of tp the log
// deleted, from from to logStart, before they were projected (err, of
// recordsDeleted).
func (p *Projector) deleted(tp topicPartition, from, logStart int64, err error) {
	p.gaps.Add(1)
	p.logger.Error("records deleted from the log before they were projected",
		"topic", tp.topic, "partition", tp.partition, "next_offset", from, "log_start", logStart,
		"offsets_lost", logStart-from)
	if p.stop == nil {
		p.stop = err
	}
}

func recordsDeleted(tp topicPartition, from, first, logStart int64) error {
	if from >= first || from >= logStart {
		return nil
	}
	return fmt.Errorf("%w: %s/%d offsets %d to %d (the log now starts at %d)",
		ErrRecordsDeleted, tp.topic, tp.partition, from, logStart-1, logStart)
}

// ErrRecordsDeleted: records of a partition were deleted from the log
// (retention, or DeleteRecords) before the projector read them, so the
// projection will never hold them. Going on would hide that for good: the
// group's committed offset would pass the gap, and nothing would tell the
// projection's readers that calls are missing from their answers. So the
// projector writes and commits what came before and stops, without
// committing the partition past the gap; a human decides (`ledger
// projector skip-deleted` moves the group past it, knowing the projection
// lacks those records). Replay stops with it too, writing nothing of the
// poll that found the gap.
var ErrRecordsDeleted = errors.New("records deleted from the log before they were projected")

// newer reports whether err says a record is of a newer encoding.
func newer(err error) bool {
	return errors.Is(err, ledger.ErrUnsupportedEncoding) || errors.Is(err, ErrUnsupportedAction)
}

// decodeRecord appends r to evs or acts, or says why it cannot.
func decodeRecord(r *kgo.Record, t ledger.Topics, evs *[]projections.Event, acts *[]projections.Action) error {
	switch r.Topic {
	case t.Events:
		e, err := ledger.DecodeEvent(r.Value)
		if err != nil {
			return err
		}
		*evs = append(*evs, projections.Event{Event: e, Partition: r.Partition, Offset: r.Offset, Produced: r.Timestamp, Raw: r.Value})
	case t.Control:
		a, err := DecodeAction(r.Value)
		if err != nil {
			return err
		}
		*acts = append(*acts, projections.Action{Action: a, Partition: r.Partition, Offset: r.Offset})
	default:
		return errors.New("a record of a topic the projector does not read")
	}
	return nil
}

// unknownType reports, and logs, whether e, decoded from r, is a step of a
// call of a type the state machine does not know. It is projected (its
// call's trace and references show it) but moves no call
// (projections.KnownType), so the call's state may be behind the log: a
// human must look, most likely upgrade the projector (the event comes from
// a newer ledger) and rebuild the projection.
func unknownType(logger *slog.Logger, r *kgo.Record, e *ledger.Event) bool {
	if e.Refusal() || projections.KnownType(e.Type) {
		return false
	}
	logger.Error("event of an unknown type: its call keeps its last known state",
		"topic", r.Topic, "partition", r.Partition, "offset", r.Offset, "type", e.Type, "call_key", e.Key().String(), "seq", e.Seq)
	return true
}

// logUndecodable logs a record that did not decode. The record is the
// log's: the projection goes on without it, and a human must look.
func logUndecodable(logger *slog.Logger, r *kgo.Record, err error) {
	logger.Error("undecodable record skipped", "topic", r.Topic, "partition", r.Partition, "offset", r.Offset, "err", err)
}

// MaxActionVersion is the newest control action encoding (the V of
// ledger.ControlAction, which the control plane writes) this build reads.
const MaxActionVersion = 1

// ErrUnsupportedAction: a control record was written by a newer ledger.
var ErrUnsupportedAction = errors.New("unsupported control action version")

// DecodeAction parses a control record's value. A tombstone (nil value) is
// not an action, and neither is an encoding newer than MaxActionVersion
// (ErrUnsupportedAction).
func DecodeAction(b []byte) (ledger.ControlAction, error) {
	if b == nil {
		return ledger.ControlAction{}, errors.New("decode action: a tombstone, not an action")
	}
	var a ledger.ControlAction
	if err := json.Unmarshal(b, &a); err != nil {
		if v, newer := ledger.NewerEncoding(b, MaxActionVersion); newer {
			return ledger.ControlAction{}, fmt.Errorf("%w: v%d (this build reads up to v%d)", ErrUnsupportedAction, v, MaxActionVersion)
		}
		return ledger.ControlAction{}, fmt.Errorf("decode action: %w", err)
	}
	switch {
	case a.V < 1:
		return ledger.ControlAction{}, errors.New("decode action: missing version")
	case a.V > MaxActionVersion:
		return ledger.ControlAction{}, fmt.Errorf("%w: v%d (this build reads up to v%d)", ErrUnsupportedAction, a.V, MaxActionVersion)
	}
	return a, nil
}

// flush writes the batch being built until the sink takes it, then
// commits its offsets. It returns an error only when ctx is done.
func (p *Projector) flush(ctx context.Context, cl *kgo.Client) error {
	p.mu.Lock()
	b := p.pending
	p.pending = newPendingBatch()
	gens := make(map[topicPartition]uint64, len(b.next))
	for tp := range b.next {
		st := p.parts[tp]
		gens[tp] = st.gen
		st.inflightOldest, st.pendingOldest = st.pendingOldest, time.Time{}
	}
	p.mu.Unlock()

	batch := b.batch
	positioned := p.positioned
	if positioned != nil {
		// Recorded even for partitions of markers alone, or where the
		// sink lacks them it would go back for them again and again.
		batch.Ends = ends(b.next)
	}
	for attempt := 1; batch.Len() > 0 || len(batch.Ends) > 0; attempt++ {
		var err error
		if positioned != nil {
			batch, err = p.checkPositions(ctx, cl, positioned, batch, b, gens)
		}
		if err == nil && (batch.Len() > 0 || len(batch.Ends) > 0) {
			err = p.sink.Write(ctx, batch)
		}
		if err == nil {
			if positioned != nil {
				p.recorded(batch.Ends, gens)
			}
			break
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		backoff := retryBackoff(attempt)
		level := slog.LevelWarn
		if attempt >= 5 {
			level = slog.LevelError // the projection falls behind: a human must look
		}
		msg := "projection write failed, retrying the batch"
		if errors.Is(err, errGroupOffsets) {
			// Kafka's, not the projection's: write_errors_total
			// is what an alert on ClickHouse refusing writes reads.
			msg = "reading the group's committed offsets failed, retrying the batch"
		} else {
			p.writeErrors.Add(1)
		}
		p.logger.Log(ctx, level, msg, "records", batch.Len(), "attempt", attempt, "backoff", backoff, "err", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff):
		}
		// Partitions revoked meanwhile belong to their next owner.
		batch = p.prune(batch, gens)
	}
	if n := batch.Len(); n > 0 {
		now := p.cfg.Now()
		for i := range batch.Events {
			p.latency.Observe(now.Sub(batch.Events[i].Produced))
		}
		p.written.Add(int64(n))
		p.batches.Add(1)
	}
	p.commit(ctx, cl, b, gens)
	return nil
}

// prune drops from batch the records of partitions revoked since gens.
func (p *Projector) prune(batch projections.Batch, gens map[topicPartition]uint64) projections.Batch {
	p.mu.Lock()
	defer p.mu.Unlock()
	t := p.cfg.Topics
	current := func(topic string, partition int32) bool {
		tp := topicPartition{topic, partition}
		st := p.parts[tp]
		return st != nil && st.owned && st.gen == gens[tp]
	}
	return filterBatch(batch, t, current)
}

// filterBatch is batch with the records and ends of the partitions keep
// keeps.
func filterBatch(batch projections.Batch, t ledger.Topics, keep func(topic string, partition int32) bool) projections.Batch {
	var out projections.Batch
	for _, e := range batch.Events {
		if keep(t.Events, e.Partition) {
			out.Events = append(out.Events, e)
		}
	}
	for _, a := range batch.Actions {
		if keep(t.Control, a.Partition) {
			out.Actions = append(out.Actions, a)
		}
	}
	for _, e := range batch.Ends {
		if keep(e.Topic, e.Partition) {
			out.Ends = append(out.Ends, e)
		}
	}
	return out
}

// ends are a batch's Ends: where it ends in each partition read into it.
func ends(next map[topicPartition]kgo.EpochOffset) []projections.End {
	out := make([]projections.End, 0, len(next))
	for tp, o := range next {
		out = append(out, projections.End{Topic: tp.topic, Partition: tp.partition, Next: o.Offset})
	}
	return out
}

// checkPositions compares where sink says its records end with where the
// batch starts, per partition. A partition whose records the sink lacks
// up to the batch's first (a database restored from a backup taken
// before the group committed past them) is taken out of the batch and
// of b's commit, and read again from the sink's end before the next
// poll: records projected twice change no answer, records never
// projected would be missing for good, without a word. A partition
// whose start is unknown (the group never committed it) or that the
// sink has no end for (written before ends were recorded) is written as
// it is. The group's commits are read first (learnMarks): a partition
// committed where the sink had an end is held while it has none.
func (p *Projector) checkPositions(ctx context.Context, cl *kgo.Client, sink projections.Positioned, batch projections.Batch, b *pendingBatch, gens map[topicPartition]uint64) (projections.Batch, error) {
	if err := p.learnMarks(ctx, kadm.NewClient(cl)); err != nil {
		return batch, fmt.Errorf("%w: %w", errGroupOffsets, err)
	}
	pos, err := sink.Positions(ctx)
	if err != nil {
		return batch, fmt.Errorf("read the projection's positions: %w", err)
	}
	// lacking: where to read each partition the sink lacks records of
	// again from; its end, or, for one whose end is gone, the batch's
	// start, until the end is back.
	lacking := make(map[topicPartition]int64)
	p.mu.Lock()
	for tp, from := range b.from {
		st := p.parts[tp]
		if !st.owned || st.gen != gens[tp] {
			// Revoked since the batch was taken: its next owner
			// reads it again from the group's offset, having read
			// the ends. Written here, its end might outlast a
			// restore's and hide what the restore lacks.
			lacking[tp] = -1
			continue
		}
		if !st.learned {
			// Not met: learnMarks just read every owned partition's.
			p.mu.Unlock()
			return batch, fmt.Errorf("the group's offset of %s/%d is not read yet", tp.topic, tp.partition)
		}
		end, ok := pos.Lookup(tp.topic, tp.partition)
		p.sawEnd(tp, st, ok, holds(from))
		switch {
		case from < 0:
		case ok && end < from:
			lacking[tp] = end
			if st.reread != end {
				// Else the lag refresh found it first: counted,
				// and logged, once.
				p.lacks(tp, st, end, from)
			}
		case !ok && st.endSeen && holds(from):
			// Held: read again from the batch's start, and not
			// fetched (applyRereads) until the end is back.
			lacking[tp] = from
			st.reread, st.hold = from, true
		}
	}
	for tp := range lacking {
		// Not committed: the group stays where it was until the
		// records are projected again.
		delete(b.next, tp)
		delete(b.from, tp)
	}
	p.mu.Unlock()
	if len(lacking) == 0 {
		return batch, nil
	}
	return filterBatch(batch, p.cfg.Topics, func(topic string, partition int32) bool {
		_, lacks := lacking[topicPartition{topic, partition}]
		return !lacks
	}), nil
}

// errGroupOffsets: checkPositions could not read the group's committed
// offsets (learnMarks), a failure of Kafka, not of the sink.
var errGroupOffsets = errors.New("read the group's committed offsets")

// holds reports whether a partition whose end the sink has shown and
// lost must be held, rather than written from at: unless the partition
// never had a record before at (at 0), for a restore can lack nothing of
// such a partition (a new database behind a group that never read a
// record of it, as dev's after its database is dropped). One whose
// records before at retention has since deleted is held: the restore may
// lack them, which only its end, back, can tell (ErrRecordsDeleted then).
func holds(at int64) bool { return at > 0 }

// applyRereads moves the partitions checkPositions found the sink
// lacking records of back to where its records end, pauses the fetches
// of those it holds, and resumes those whose end is back or that are no
// longer this assignment's (kgo keeps a pause through rebalances). It
// runs on the polling goroutine between polls, as kgo asks of
// SetOffsets; a partition revoked since is its next owner's, which checks
// again.
func (p *Projector) applyRereads(cl *kgo.Client) {
	var set map[string]map[int32]kgo.EpochOffset
	var pause, resume map[string][]int32
	gone := make(map[topicPartition]bool)
	p.mu.Lock()
	p.woken = false
	for tp, st := range p.parts {
		switch {
		case st.hold && st.owned && st.endGone:
			// (Its end back since checkPositions held it: read
			// again from the batch's start, not paused.)
			if pause == nil {
				pause = make(map[string][]int32)
			}
			pause[tp.topic] = append(pause[tp.topic], tp.partition)
			st.paused = true
		case st.paused && (!st.owned || !st.endGone):
			if resume == nil {
				resume = make(map[string][]int32)
			}
			resume[tp.topic] = append(resume[tp.topic], tp.partition)
			st.paused = false
		}
		st.hold = false
		if st.reread < 0 {
			continue
		}
		if err := recordsDeleted(tp, st.reread, st.start, st.start); st.owned && err != nil {
			// The log no longer has them: a partition with records
			// left would find so in its next fetch, but one emptied
			// by retention returns none. Stop as for any records
			// deleted before they were projected. Nothing of it is
			// written meanwhile, and its reread stays set, so that
			// neither the lag refresh nor the last flush finds it
			// lacking, and counts it read again, once more.
			p.deleted(tp, st.reread, st.start, err)
			gone[tp] = true
			continue
		} else if st.owned {
			// Records read past the end already are read again.
			gone[tp] = true
			st.pendingOldest = time.Time{}
			if set == nil {
				set = make(map[string]map[int32]kgo.EpochOffset)
			}
			if set[tp.topic] == nil {
				set[tp.topic] = make(map[int32]kgo.EpochOffset)
			}
			set[tp.topic][tp.partition] = kgo.EpochOffset{Epoch: -1, Offset: st.reread}
			// Where the next record must be, so that records the log
			// deleted since are found (ErrRecordsDeleted); and where
			// the projection resumes, for the lag, and so that
			// checkCommitted does not find the records lacking again
			// before the first of them is written.
			st.next, st.committed = st.reread, st.reread
		}
		st.reread = -1
	}
	p.pending.dropParts(gone, p.cfg.Topics)
	// Not under mu: kgo takes its own locks, which its rebalance
	// callbacks hold while they wait for mu.
	p.mu.Unlock()
	if set != nil {
		cl.SetOffsets(set)
	}
	// After SetOffsets: records of a paused partition fetched before
	// the pause are dropped, and fetched again from where it was set.
	if pause != nil {
		cl.PauseFetchPartitions(pause)
	}
	if resume != nil {
		cl.ResumeFetchPartitions(resume)
	}
}

// commit commits b's offsets of the partitions still owned since gens.
// A failed commit is logged: the records are read again after the next
// rebalance or restart, and the next batch's commit covers them.
func (p *Projector) commit(ctx context.Context, cl *kgo.Client, b *pendingBatch, gens map[topicPartition]uint64) {
	p.commitMu.Lock()
	defer p.commitMu.Unlock()

	offsets := make(map[string]map[int32]kgo.EpochOffset)
	p.mu.Lock()
	for tp, next := range b.next {
		st := p.parts[tp]
		if !st.owned || st.gen != gens[tp] {
			continue
		}
		st.inflightOldest = time.Time{}
		if offsets[tp.topic] == nil {
			offsets[tp.topic] = make(map[int32]kgo.EpochOffset)
		}
		offsets[tp.topic][tp.partition] = next
	}
	p.mu.Unlock()
	if len(offsets) == 0 {
		return
	}

	cctx := ctx
	if p.positioned != nil {
		// Every partition committed here had its end written with
		// the batch (flush).
		cctx = kgo.PreCommitFnContext(ctx, markEnds)
	}
	if cerr := commitSync(cctx, cl, offsets); cerr != nil {
		if ctx.Err() == nil {
			p.commitErrors.Add(1)
			p.logger.Warn("offset commit failed; the batch will be read again", "records", b.records, "err", cerr)
		}
		return
	}
	p.mu.Lock()
	for topic, ps := range offsets {
		for partition, o := range ps {
			if st := p.parts[topicPartition{topic, partition}]; st.gen == gens[topicPartition{topic, partition}] {
				st.committed = o.Offset
				st.marked = p.positioned != nil
			}
		}
	}
	p.mu.Unlock()
}

// commitSync commits offsets as a member of the group, and returns the
// first error, the request's or a partition's.
func commitSync(ctx context.Context, cl *kgo.Client, offsets map[string]map[int32]kgo.EpochOffset) error {
	var cerr error
	cl.CommitOffsetsSync(ctx, offsets, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
		if err != nil {
			cerr = err
			return
		}
		for _, t := range resp.Topics {
			for _, pt := range t.Partitions {
				if err := kerr.ErrorForCode(pt.ErrorCode); err != nil && cerr == nil {
					cerr = fmt.Errorf("%s/%d: %w", t.Topic, pt.Partition, err)
				}
			}
		}
	})
	return cerr
}

// assigned is the OnPartitionsAssigned callback.
func (p *Projector) assigned(_ context.Context, _ *kgo.Client, added map[string][]int32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for topic, ps := range added {
		for _, partition := range ps {
			st := p.state(topicPartition{topic, partition})
			st.owned, st.end, st.committed, st.next, st.reread, st.start = true, -1, -1, -1, -1, -1
			// Not paused: applyRereads resumes a partition paused
			// in an earlier assignment before the next poll.
			st.endSeen, st.endGone, st.learned, st.marked, st.hold = false, false, false, false, false
		}
	}
	if len(added) > 0 {
		p.logger.Info("partitions assigned", "partitions", added)
		select {
		case p.assignedNow <- struct{}{}:
		default: // one is due already
		}
	}
}

// revoked is the OnPartitionsRevoked and OnPartitionsLost callback: it
// drops the revoked partitions' uncommitted records (their next owner
// reads them again from the committed offset) and, holding commitMu,
// makes sure no in-flight batch commits them after it returns.
func (p *Projector) revoked(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	p.commitMu.Lock()
	defer p.commitMu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()

	gone := make(map[topicPartition]bool)
	for topic, ps := range lost {
		for _, partition := range ps {
			tp := topicPartition{topic, partition}
			gone[tp] = true
			st := p.state(tp)
			st.gen++
			st.owned, st.end, st.committed, st.next, st.reread, st.start = false, -1, -1, -1, -1, -1
			st.endSeen, st.endGone, st.learned, st.marked, st.hold = false, false, false, false, false
			st.pendingOldest, st.inflightOldest = time.Time{}, time.Time{}
		}
	}
	if len(gone) == 0 {
		return
	}
	dropped := p.pending.dropParts(gone, p.cfg.Topics)
	p.logger.Info("partitions revoked; their uncommitted records are left to the next owner",
		"partitions", lost, "dropped_records", dropped)
}

// retryBackoff is the wait before the next attempt: doubling from 100ms
// to 10s, jittered so that many projectors do not retry in step.
func retryBackoff(attempt int) time.Duration {
	d := 100 * time.Millisecond << min(attempt-1, 7)
	d = min(d, 10*time.Second)
	return d/2 + rand.N(d/2+1)
}
