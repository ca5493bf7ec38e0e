package loadtest

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Limit is one raw limit measured: what one part of the ledger does alone,
// on the same engine the end-to-end run used, so that the ledger's
// throughput can be judged as a share of it.
type Limit struct {
	// Name says which part: "kafka_txn_consume_produce", "store_claims",
	// "store_complete".
	Name string `json:"name"`
	// Ops is the records copied or the calls claimed (completed).
	Ops int `json:"ops"`
	// Elapsed is the timed part only; setup and checks are not in it.
	Elapsed time.Duration `json:"elapsed_ns"`
	// PerSec is Ops over Elapsed.
	PerSec float64 `json:"per_sec"`
	// Batch is the records per transaction, or the calls per store call.
	Batch int `json:"batch"`
	// Note says what exactly was measured, in one line.
	Note string `json:"note,omitempty"`
}

// Names of the limits.
const (
	limitNameKafka    = "kafka_txn_consume_produce"
	limitNameClaims   = "store_claims"
	limitNameComplete = "store_complete"
)

const (
	// limitTenant owns every call and record a limit run writes, apart
	// from any real tenant.
	limitTenant = "t_limit"
	// limitTopicPrefix names the topics (and the consumer group and
	// transactional id) of a Kafka limit run.
	limitTopicPrefix = "ledger-bench-limit-"
	// limitOwner holds the store limit's leases.
	limitOwner = "limit"
	// limitLease is long enough that no claim of a run expires during it.
	limitLease = time.Minute
	// limitStall ends a Kafka run that has not committed anything for this
	// long: a broken broker or a fenced producer would otherwise keep the
	// loop retrying until the caller's context ends.
	limitStall = 2 * time.Minute
	// limitReadTimeout bounds the read-back of the sink topic.
	limitReadTimeout = 5 * time.Minute
	// limitCleanupTimeout bounds the best-effort deletion of what a run
	// created, which runs even when the caller's context is done.
	limitCleanupTimeout = 30 * time.Second
	// limitProgressEvery spaces the progress calls, so that a caller
	// printing each one does not slow the timed part.
	limitProgressEvery = 250 * time.Millisecond
)

// KafkaTxnLimit measures franz-go's transactional consume-process-produce
// throughput on the brokers of cc, with the machinery the intake and the
// executor use: ledger.Loop (a GroupTransactSession reading read_committed,
// committing the consumed offsets with the produced records), polling up
// to batch records per transaction.
//
// It creates two fresh topics of partitions partitions (RF 1, names
// prefixed "ledger-bench-limit-"), fills the source with records ledger
// events (~700 bytes, keyed by call), untimed, then times a loop whose step copies
// each record to the sink, from the first polled batch to the commit of the
// last. Afterwards it reads the sink back, read_committed, and fails unless
// it holds every source record exactly once: a raw limit that lost or
// duplicated records would be wrong. The topics and the group are deleted
// at the end, best effort.
//
// progress, if not nil, is called now and then with the records copied
// (committed) so far, from one goroutine at a time.
func KafkaTxnLimit(ctx context.Context, cc ledger.ClientConfig, records, batch, partitions int, progress func(done int)) (Limit, error) {
	return limitKafkaTxn(ctx, cc, records, batch, partitions, progress, nil)
}

// limitKafkaTxn is KafkaTxnLimit; beforeDelete, if set, runs after the
// run's own check and before the topics are deleted, so that a test can
// look at them.
func limitKafkaTxn(ctx context.Context, cc ledger.ClientConfig, records, batch, partitions int, progress func(int),
	beforeDelete func(ctx context.Context, source, sink string) error,
) (Limit, error) {
	switch {
	case records <= 0:
		return Limit{}, fmt.Errorf("kafka limit: records %d: want at least 1", records)
	case batch <= 0:
		return Limit{}, fmt.Errorf("kafka limit: batch %d: want at least 1", batch)
	case partitions <= 0 || partitions > math.MaxInt32:
		return Limit{}, fmt.Errorf("kafka limit: partitions %d: want 1 to %d", partitions, math.MaxInt32)
	}
	runID, err := limitRunID()
	if err != nil {
		return Limit{}, err
	}
	name := limitTopicPrefix + runID
	source, sink := name+"-source", name+"-sink"

	admin, err := ledger.NewClient(cc)
	if err != nil {
		return Limit{}, fmt.Errorf("kafka limit: %w", err)
	}
	defer admin.Close()
	adm := kadm.NewClient(admin)
	defer limitDeleteKafka(ctx, cc, adm, name, source, sink)
	for _, topic := range []string{source, sink} {
		if _, err := adm.CreateTopic(ctx, int32(partitions), 1, nil, topic); err != nil {
			return Limit{}, fmt.Errorf("kafka limit: create topic %s: %w", topic, err)
		}
	}

	size, err := limitFillSource(ctx, cc, source, runID, records)
	if err != nil {
		return Limit{}, err
	}
	l, err := limitCopy(ctx, cc, name, source, sink, records, batch, progress)
	if err != nil {
		return Limit{}, err
	}
	count, err := limitCountSink(ctx, cc, sink, limitKeyPrefix(runID), records)
	if err != nil {
		return Limit{}, err
	}
	if !count.exact() {
		return Limit{}, fmt.Errorf("kafka limit: %s holds %d committed records: %d missing, %d duplicated, %d foreign; want each of %d exactly once",
			sink, count.Total, count.Missing, count.Duplicated, count.Foreign, records)
	}
	if beforeDelete != nil {
		if err := beforeDelete(ctx, source, sink); err != nil {
			return Limit{}, err
		}
	}
	l.Note = fmt.Sprintf("ledger.Loop (GroupTransactSession, read_committed) copying %d-byte event records 1:1 between %d-partition topics, up to %d per transaction; timed from the first poll to the last commit",
		size, partitions, batch)
	return l, nil
}

// limitFillSource produces records events to topic, keyed and partitioned
// as the ledger keys calls, and returns their mean size in bytes.
func limitFillSource(ctx context.Context, cc ledger.ClientConfig, topic, runID string, records int) (int, error) {
	cl, err := ledger.NewClient(cc, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		return 0, fmt.Errorf("kafka limit: %w", err)
	}
	defer cl.Close()
	var (
		mu       sync.Mutex
		firstErr error
		sum      int
	)
	now := time.Now()
	for i := range records {
		ev, err := limitEvent(runID, i, statemachine.EventAuthorized, 2, now)
		if err != nil {
			return 0, err
		}
		r, err := ev.Record(topic)
		if err != nil {
			return 0, fmt.Errorf("kafka limit: %w", err)
		}
		sum += len(r.Key) + len(r.Value)
		// Produce blocks while the client's buffer is full, which keeps
		// memory bounded however many records the run asks for.
		cl.Produce(ctx, r, func(_ *kgo.Record, err error) {
			if err != nil {
				mu.Lock()
				defer mu.Unlock()
				if firstErr == nil {
					firstErr = err
				}
			}
		})
	}
	if err := cl.Flush(ctx); err != nil {
		return 0, fmt.Errorf("kafka limit: fill %s: %w", topic, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if firstErr != nil {
		return 0, fmt.Errorf("kafka limit: fill %s: %w", topic, firstErr)
	}
	return sum / records, nil
}

// limitCopy runs the ledger's loop from source to sink until records
// copies committed, and times it.
func limitCopy(ctx context.Context, cc ledger.ClientConfig, name, source, sink string, records, batch int, progress func(int)) (Limit, error) {
	var (
		// copied is written in the loop's goroutine and read here for
		// the stall check; start, end and finished belong to the loop's
		// goroutine until runDone closes.
		copied   atomic.Int64
		start    time.Time
		end      time.Time
		finished bool
		done     = make(chan struct{})
		prog     = limitProgress{fn: progress}
	)
	step := func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
		if len(recs) == 0 {
			return ledger.Output{}, nil
		}
		if start.IsZero() {
			start = time.Now()
		}
		out := make([]*kgo.Record, len(recs))
		for i, r := range recs {
			out[i] = &kgo.Record{Topic: sink, Key: r.Key, Value: r.Value, Headers: r.Headers}
		}
		n := int64(len(recs))
		// Committed runs only for a committed transaction, and at most
		// once: its sum counts committed copies, never aborted ones.
		return ledger.Output{Records: out, Committed: func(context.Context) error {
			c := copied.Add(n)
			if finished {
				return nil
			}
			if c >= int64(records) {
				end, finished = time.Now(), true
				prog.report(int(c), true)
				close(done)
				return nil
			}
			prog.report(int(c), false)
			return nil
		}}, nil
	}
	loop, err := ledger.NewLoop(ledger.LoopConfig{
		Client:          cc,
		Group:           name,
		Topics:          []string{source},
		TransactionalID: name,
		MaxPollRecords:  batch,
		Logger:          cc.Logger,
	}, step)
	if err != nil {
		return Limit{}, fmt.Errorf("kafka limit: %w", err)
	}
	loopCtx, stop := context.WithCancel(ctx)
	defer stop()
	runDone := make(chan struct{})
	go func() {
		defer close(runDone)
		_ = loop.Run(loopCtx) // returns only once loopCtx is done
	}()

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var (
		seen      = copied.Load()
		lastMoved = time.Now()
		failure   error
	)
wait:
	for {
		select {
		case <-done:
			break wait
		case <-ctx.Done():
			failure = fmt.Errorf("kafka limit: %d of %d records copied: %w", copied.Load(), records, ctx.Err())
			break wait
		case <-tick.C:
			if c := copied.Load(); c != seen {
				seen, lastMoved = c, time.Now()
			} else if time.Since(lastMoved) > limitStall {
				failure = fmt.Errorf("kafka limit: no transaction committed for %v, %d of %d records copied", limitStall, c, records)
				break wait
			}
		}
	}
	stop()
	<-runDone
	if failure != nil {
		return Limit{}, failure
	}
	if c := copied.Load(); c != int64(records) {
		return Limit{}, fmt.Errorf("kafka limit: %d records copied in committed transactions; want %d", c, records)
	}
	elapsed := end.Sub(start)
	return Limit{
		Name:    limitNameKafka,
		Ops:     records,
		Elapsed: elapsed,
		PerSec:  limitPerSec(records, elapsed),
		Batch:   batch,
	}, nil
}

// limitSinkCount is what a sink topic holds, committed, against the keys
// keyPrefix+"0" to keyPrefix+(want-1) a run expects there once each.
type limitSinkCount struct {
	Total      int // committed records
	Missing    int // expected keys absent
	Duplicated int // records beyond the first of an expected key
	Foreign    int // records under any other key
}

func (c limitSinkCount) exact() bool { return c.Missing == 0 && c.Duplicated == 0 && c.Foreign == 0 }

// limitCountSink reads topic, read_committed, to its end and counts its
// records against the keys keyPrefix+"0" to keyPrefix+(want-1).
func limitCountSink(ctx context.Context, cc ledger.ClientConfig, topic, keyPrefix string, want int) (limitSinkCount, error) {
	ctx, cancel := context.WithTimeout(ctx, limitReadTimeout)
	defer cancel()
	admin, err := ledger.NewClient(cc)
	if err != nil {
		return limitSinkCount{}, fmt.Errorf("kafka limit: %w", err)
	}
	defer admin.Close()
	ends, err := kadm.NewClient(admin).ListEndOffsets(ctx, topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return limitSinkCount{}, fmt.Errorf("kafka limit: end offsets of %s: %w", topic, err)
	}
	pending := make(map[int32]int64)
	from := make(map[int32]kgo.Offset)
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			pending[o.Partition] = o.Offset
			from[o.Partition] = kgo.NewOffset().AtStart()
		}
	})

	seen := make([]int32, want)
	var total, foreign int
	if len(pending) > 0 {
		// Control records (the transaction markers) are kept so that
		// every partition's last offset, a marker after a transaction,
		// shows up and ends the read.
		cl, err := ledger.NewClient(cc,
			kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: from}),
			kgo.KeepControlRecords(),
		)
		if err != nil {
			return limitSinkCount{}, fmt.Errorf("kafka limit: %w", err)
		}
		defer cl.Close()
		for len(pending) > 0 {
			fetches := cl.PollFetches(ctx)
			if ctx.Err() != nil {
				return limitSinkCount{}, fmt.Errorf("kafka limit: read %s: %d partitions not read to their end: %w", topic, len(pending), ctx.Err())
			}
			if err := fetches.Err(); err != nil {
				return limitSinkCount{}, fmt.Errorf("kafka limit: read %s: %w", topic, err)
			}
			fetches.EachRecord(func(r *kgo.Record) {
				if end, ok := pending[r.Partition]; ok && r.Offset >= end-1 {
					delete(pending, r.Partition)
				}
				if r.Attrs.IsControl() {
					return
				}
				total++
				i, err := strconv.Atoi(strings.TrimPrefix(string(r.Key), keyPrefix))
				if !strings.HasPrefix(string(r.Key), keyPrefix) || err != nil || i < 0 || i >= want {
					foreign++
					return
				}
				seen[i]++
			})
		}
	}
	c := limitSinkCount{Total: total, Foreign: foreign}
	for _, n := range seen {
		switch {
		case n == 0:
			c.Missing++
		case n > 1:
			c.Duplicated += int(n) - 1
		}
	}
	return c, nil
}

// limitDeleteKafka deletes what a Kafka run created. It runs even when
// ctx is done; a failure is logged, not returned: the measurement stands.
func limitDeleteKafka(ctx context.Context, cc ledger.ClientConfig, adm *kadm.Client, group string, topics ...string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), limitCleanupTimeout)
	defer cancel()
	var errs []error
	if _, err := adm.DeleteGroup(ctx, group); err != nil {
		errs = append(errs, fmt.Errorf("delete group %s: %w", group, err))
	}
	resps, err := adm.DeleteTopics(ctx, topics...)
	if err != nil {
		errs = append(errs, fmt.Errorf("delete topics: %w", err))
	}
	for _, r := range resps.Sorted() {
		if r.Err != nil {
			errs = append(errs, fmt.Errorf("delete topic %s: %w", r.Topic, r.Err))
		}
	}
	if err := errors.Join(errs...); err != nil && cc.Logger != nil {
		cc.Logger.Warn("kafka limit cleanup failed", "group", group, "err", err)
	}
}

// ClaimLimit measures the execution store's part of the executor's path,
// in batches of batch calls from one caller, on calls fresh calls it
// admits first (tenant "t_limit", untimed):
//
//   - "store_claims": Claim, as the executor claims authorized calls
//     (owner "limit", a one-minute lease);
//   - "store_complete": Complete (succeeded, fenced by the claim's epoch,
//     a two-event outbox, under one journal entry a batch) then Settle,
//     as the executor records outcomes and, once their events committed,
//     settles the entry.
//
// Every claim must come back Claimed and every completion applied, or it
// returns an error: a raw limit that silently did less work would be
// wrong. The calls stay in the store, succeeded; run it against the
// benchmark's store, never a production one.
//
// progress, if not nil, is called now and then with the store operations
// done so far: admissions, then claims, then completions, each counting
// calls, so that it ends at 3*calls.
func ClaimLimit(ctx context.Context, st processors.Store, calls, batch int, progress func(done int)) ([]Limit, error) {
	switch {
	case st == nil:
		return nil, errors.New("claim limit: no store")
	case calls <= 0:
		return nil, fmt.Errorf("claim limit: calls %d: want at least 1", calls)
	case batch <= 0:
		return nil, fmt.Errorf("claim limit: batch %d: want at least 1", batch)
	}
	runID, err := limitRunID()
	if err != nil {
		return nil, err
	}
	prog := limitProgress{fn: progress}
	key := func(i int) ledger.CallKey {
		return ledger.CallKey{TenantID: limitTenant, IdempotencyKey: limitIdempotencyKey(runID, i)}
	}

	// Admit, untimed: what the intake does before the executor sees a
	// call.
	now := time.Now()
	for lo := 0; lo < calls; lo += batch {
		hi := min(lo+batch, calls)
		as := make([]processors.Admission, 0, hi-lo)
		for i := lo; i < hi; i++ {
			args, hash := limitArguments(i)
			outbox, err := limitOutbox(runID, i, now, 1, statemachine.EventRequested, statemachine.EventAuthorized)
			if err != nil {
				return nil, err
			}
			as = append(as, processors.Admission{
				Key:           key(i),
				CallID:        limitCallID(runID, i),
				ArgumentsHash: hash,
				Tool:          "refund_order",
				ToolVersion:   3,
				Arguments:     args,
				DeadlineAt:    now.Add(time.Hour).Truncate(time.Microsecond),
				Status:        processors.StatusAuthorized,
				Seq:           2,
				Outbox:        outbox,
			})
		}
		res, err := st.Admit(ctx, as)
		if err != nil {
			return nil, fmt.Errorf("claim limit: admit calls %d to %d: %w", lo, hi-1, err)
		}
		if len(res) != len(as) {
			return nil, fmt.Errorf("claim limit: admit %d calls: %d results", len(as), len(res))
		}
		for j, r := range res {
			if r.Outcome != processors.Admitted {
				return nil, fmt.Errorf("claim limit: admit %v: outcome %d; want Admitted", as[j].Key, r.Outcome)
			}
		}
		prog.report(hi, false)
	}

	// Claim, timed: only the store calls are.
	epochs := make([]int64, calls)
	var claimTime time.Duration
	for lo := 0; lo < calls; lo += batch {
		hi := min(lo+batch, calls)
		cs := make([]processors.Claim, 0, hi-lo)
		for i := lo; i < hi; i++ {
			_, hash := limitArguments(i)
			// Logged: the executor claims from the authorized event (seq 2).
			cs = append(cs, processors.Claim{Key: key(i), ArgumentsHash: hash, Owner: limitOwner, Lease: limitLease, Logged: 2})
		}
		t0 := time.Now()
		res, err := st.Claim(ctx, cs)
		claimTime += time.Since(t0)
		if err != nil {
			return nil, fmt.Errorf("claim limit: claim calls %d to %d: %w", lo, hi-1, err)
		}
		if len(res) != len(cs) {
			return nil, fmt.Errorf("claim limit: claim %d calls: %d results", len(cs), len(res))
		}
		for j, r := range res {
			if r.Outcome != processors.Claimed || r.Record.Epoch <= 0 {
				return nil, fmt.Errorf("claim limit: claim %v: outcome %d at epoch %d; want Claimed", cs[j].Key, r.Outcome, r.Record.Epoch)
			}
			epochs[lo+j] = r.Record.Epoch
		}
		prog.report(calls+hi, false)
	}

	// Complete (journaled) and settle, timed: the rest of the executor's
	// store path for each call.
	var completeTime time.Duration
	done := time.Now()
	for lo := 0; lo < calls; lo += batch {
		hi := min(lo+batch, calls)
		cs := make([]processors.Completion, 0, hi-lo)
		journal := fmt.Sprintf("limit/%s/%d", runID, lo)
		for i := lo; i < hi; i++ {
			outbox, err := limitOutbox(runID, i, done, 3, statemachine.EventExecuting, statemachine.EventSucceeded)
			if err != nil {
				return nil, err
			}
			cs = append(cs, processors.Completion{
				Key:     key(i),
				Epoch:   epochs[i],
				Status:  processors.StatusSucceeded,
				Attempt: 1,
				Result:  fmt.Appendf(nil, `{"refund_id":"re_%d","status":"succeeded"}`, i),
				Seq:     4,
				Outbox:  outbox,
				Journal: journal,
				From:    2,
			})
		}
		t0 := time.Now()
		applied, err := st.Complete(ctx, cs)
		completeTime += time.Since(t0)
		if err != nil {
			return nil, fmt.Errorf("claim limit: complete calls %d to %d: %w", lo, hi-1, err)
		}
		if len(applied) != len(cs) {
			return nil, fmt.Errorf("claim limit: complete %d calls: %d results", len(cs), len(applied))
		}
		for j, ok := range applied {
			if !ok {
				return nil, fmt.Errorf("claim limit: complete %v at epoch %d: not applied", cs[j].Key, cs[j].Epoch)
			}
		}
		t0 = time.Now()
		err = st.Settle(ctx, []string{journal}, true)
		completeTime += time.Since(t0)
		if err != nil {
			return nil, fmt.Errorf("claim limit: settle the journal entry of calls %d to %d: %w", lo, hi-1, err)
		}
		prog.report(2*calls+hi, hi == calls)
	}

	return []Limit{
		{
			Name: limitNameClaims, Ops: calls, Elapsed: claimTime, PerSec: limitPerSec(calls, claimTime), Batch: batch,
			Note: fmt.Sprintf("Store.Claim of %d authorized calls per call, one caller, sequential", batch),
		},
		{
			Name: limitNameComplete, Ops: calls, Elapsed: completeTime, PerSec: limitPerSec(calls, completeTime), Batch: batch,
			Note: fmt.Sprintf("Store.Complete (succeeded, two-event outbox, journaled) then Settle of %d claimed calls per call, one caller, sequential", batch),
		},
	}, nil
}

// limitProgress calls fn at most every limitProgressEvery, unless forced.
type limitProgress struct {
	fn   func(int)
	last time.Time
}

func (p *limitProgress) report(done int, force bool) {
	if p.fn == nil {
		return
	}
	if now := time.Now(); force || now.Sub(p.last) >= limitProgressEvery {
		p.last = now
		p.fn(done)
	}
}

// limitRunID tells one run's keys and topics from every other run's.
func limitRunID() (string, error) {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("limit run id: %w", err)
	}
	return hex.EncodeToString(b), nil
}

func limitIdempotencyKey(runID string, i int) string { return runID + "-" + strconv.Itoa(i) }

func limitCallID(runID string, i int) string { return "call_" + runID + "_" + strconv.Itoa(i) }

// limitKeyPrefix is what the Kafka record key of every call of run starts
// with; the call's index follows.
func limitKeyPrefix(runID string) string { return limitTenant + "/" + runID + "-" }

// limitArguments are call i's canonical arguments and their hash.
func limitArguments(i int) ([]byte, string) {
	args := fmt.Appendf(nil, `{"amount_cents":%d,"order_id":"ord_%d"}`, 100+i%10000, i)
	sum := sha256.Sum256(args)
	return args, "sha256:" + hex.EncodeToString(sum[:])
}

// limitEvent is an event of call i like the ledger writes: about 700
// bytes encoded, with random ids, so that it compresses as a real one does.
func limitEvent(runID string, i int, typ statemachine.EventType, seq int64, at time.Time) (ledger.Event, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return ledger.Event{}, fmt.Errorf("limit event id: %w", err)
	}
	trace := make([]byte, 16)
	if _, err := rand.Read(trace); err != nil {
		return ledger.Event{}, fmt.Errorf("limit trace id: %w", err)
	}
	_, hash := limitArguments(i)
	ev := ledger.Event{
		EventID:        id.String(),
		Type:           typ,
		Seq:            seq,
		At:             at.UTC(),
		Actor:          "limit",
		TenantID:       limitTenant,
		IdempotencyKey: limitIdempotencyKey(runID, i),
		CallID:         limitCallID(runID, i),
		UserID:         "u_limit_operator",
		AgentID:        "agent_limit_support_bot",
		Channel:        "api",
		Tool:           "refund_order",
		ToolVersion:    3,
		Resource:       "ord_" + strconv.Itoa(i),
		ArgumentsHash:  hash,
		TraceID:        hex.EncodeToString(trace),
		PolicyID:       []string{"pol_refunds_under_limit", "pol_tenant_default"},
		PolicyVersion:  "2031-05-06.1",
		Decision:       "allow",
		Obligations:    []string{"mask:card_number", "notify:finance"},
	}
	return ev, nil
}

// limitOutbox encodes call i's events of types, at seqs first, first+1...
func limitOutbox(runID string, i int, at time.Time, first int64, types ...statemachine.EventType) ([]byte, error) {
	evs := make([]ledger.Event, len(types))
	for k, typ := range types {
		ev, err := limitEvent(runID, i, typ, first+int64(k), at)
		if err != nil {
			return nil, err
		}
		evs[k] = ev
	}
	b, err := ledger.EncodeEvents(evs)
	if err != nil {
		return nil, fmt.Errorf("limit outbox: %w", err)
	}
	return b, nil
}

func limitPerSec(ops int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(ops) / d.Seconds()
}
