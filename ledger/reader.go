package ledger

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// PartitionFor is the partition of a record keyed key on a topic of n
// partitions (FNV-1a 32 of the key). The ledger's producers use it for
// every keyed record, so a reader that knows a call's key reads one
// partition instead of the whole topic.
func PartitionFor(key []byte, n int) int32 {
	if n <= 1 {
		return 0
	}
	h := fnv.New32a()
	h.Write(key)
	return int32(h.Sum32() % uint32(n))
}

// Partitioner places keyed records with PartitionFor; unkeyed records go
// to partition 0.
func Partitioner() kgo.Partitioner {
	return kgo.BasicConsistentPartitioner(func(string) func(*kgo.Record, int) int {
		return func(r *kgo.Record, n int) int { return int(PartitionFor(r.Key, n)) }
	})
}

// ReadCall returns every event of key on topic that was committed when the
// call began, in log order: the call's steps, and any refused submissions
// (seq 0) under its key. An event appended more than once (the ledger
// appends an outbox again when the log may lack it; the copies share its
// event id) is returned once, where it first appears. It reads only the
// key's partition.
func ReadCall(ctx context.Context, cc ClientConfig, topic string, key CallKey) ([]Event, error) {
	var evs []Event
	err := scanKey(ctx, cc, topic, key, 0, false, func(e Event, _ int64) bool {
		evs = append(evs, e)
		return false
	})
	return firstCopies(evs), err
}

// firstCopies returns evs without the copies of an event (its event id
// seen before), each kept where it first appears.
func firstCopies(evs []Event) []Event {
	seen := make(map[string]bool, len(evs))
	return slices.DeleteFunc(evs, func(e Event) bool {
		if e.EventID == "" {
			return false
		}
		dup := seen[e.EventID]
		seen[e.EventID] = true
		return dup
	})
}

// historyWindow is how many offsets CallBefore reads first; each window
// it reads after that is twice as long as the one before.
const historyWindow = 4096

// CopySkew bounds how much earlier than a call's requested event (its
// At, the intake's clock) the record of any of the call's events, or of
// a copy of one, may be timestamped (the clock of the producer, or of
// the broker for a topic of LogAppendTime), and how much earlier than it
// any later event of the call may be dated: how far apart those clocks
// may be.
const CopySkew = time.Minute

// stampedFrom is how many of a window's first records CallBefore reads
// the time of: the latest of them is when the window starts, so that one
// record stamped by a clock set back does not end the read.
const stampedFrom = 8

// CallBefore returns the events of key's latest call below offset end of
// its partition of topic (as EndOffsets gives it): those of the call of
// the last requested event there (by call id, and dated no more than
// CopySkew before it: an earlier call under the same call id, the same
// envelope sent before, is not this one), each once (as ReadCall),
// in log order, which is not always seq order: an outbox appended again
// (a resend answered before its events were marked logged; the
// executors' sweep) puts copies of a call's first events after the ones
// that follow them, so a reader folds them by seq.
//
// It reads the partition backwards from end, in windows each twice as
// long as the one before, down to the last requested event, and on down
// to a window that starts with records stamped more than CopySkew before
// that event's time, past which none of the call's can lie: a call begun
// shortly before end costs a read of about its own span, however long
// the log before it. floor, unless nil, is asked after each window that
// found no requested event for a time (the start of a call the caller
// found elsewhere) the read need go back no further than in the same
// way; it may wait for the caller's news. A key with neither costs a read of
// the whole partition, and CallBefore returns what there is: refusals,
// or the rest of a call whose start retention deleted. A record under
// the key that does not decode fails it only where it may be one of the
// call's: at or past the call's first event, or, with no call found,
// stamped no earlier than CopySkew before the floor, if there is one.
// reached, unless nil, is told the offset down to which the partition
// was read, as each window is.
func CallBefore(ctx context.Context, cc ClientConfig, topic string, key CallKey, end int64, floor func() time.Time, reached func(offset int64)) ([]Event, error) {
	admin, n, err := openTopic(ctx, cc, topic)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	adm := kadm.NewClient(admin)
	k := []byte(key.String())
	p := PartitionFor(k, n)
	type read struct {
		e      Event
		offset int64
	}
	var (
		later     []read // of the key, from lo to end, in log order
		lo        = end
		bad       error // the undecodable record under the key read last in the log, if any
		badOffset int64
		badStamp  time.Time
	)
	// readDown reads the partition from from up to lo, takes lo down to
	// from, and returns when the records read start (stampedFrom).
	readDown := func(from int64) (time.Time, error) {
		var (
			window  []read
			stamped int
			starts  time.Time
		)
		err := scan(ctx, cc, admin, topic, map[int32]int64{p: from}, map[int32]int64{p: lo}, false, func(r *kgo.Record) (bool, error) {
			if stamped < stampedFrom {
				stamped++
				if r.Timestamp.After(starts) {
					starts = r.Timestamp
				}
			}
			if string(r.Key) != string(k) {
				return false, nil
			}
			e, err := DecodeEvent(r.Value)
			if err != nil {
				if bad == nil || r.Offset > badOffset {
					bad, badOffset, badStamp = fmt.Errorf("event at %s/%d/%d: %w", topic, r.Partition, r.Offset, err), r.Offset, r.Timestamp
				}
				return false, nil
			}
			window = append(window, read{e, r.Offset})
			return false, nil
		})
		if err != nil {
			return time.Time{}, err
		}
		later, lo = append(window, later...), from
		if reached != nil {
			reached(lo)
		}
		return starts, nil
	}
	var (
		last  *Event    // the last requested event read
		since time.Time // how far back the read need go, as last or floor says
	)
	for w := int64(historyWindow); ; w *= 2 {
		starts, err := adm.ListStartOffsets(ctx, topic)
		if err != nil {
			return nil, fmt.Errorf("list offsets %s: %w", topic, err)
		}
		st, _ := starts.Lookup(topic, p)
		if st.Err != nil {
			return nil, fmt.Errorf("list offsets %s/%d: %w", topic, p, st.Err)
		}
		if lo <= st.Offset {
			break
		}
		began, err := readDown(max(lo-w, st.Offset))
		if err != nil {
			return nil, err
		}
		for i := len(later) - 1; i >= 0 && last == nil; i-- {
			if later[i].e.Type == statemachine.EventRequested {
				e := later[i].e
				last = &e
			}
		}
		switch {
		case last != nil:
			since = last.At
		case floor != nil:
			since = floor()
		}
		if !since.IsZero() && !began.IsZero() && began.Before(since.Add(-CopySkew)) {
			break
		}
	}
	if last == nil {
		// One stamped before the floor cannot be the call's.
		if bad != nil && (since.IsZero() || !badStamp.Before(since.Add(-CopySkew))) {
			return nil, bad
		}
		evs := make([]Event, len(later))
		for i := range later {
			evs[i] = later[i].e
		}
		return firstCopies(evs), nil
	}
	// The call's events, not those of an earlier call under the same
	// call id (the same envelope sent before, the store having lost the
	// key since), dated before it.
	var evs []Event
	first := int64(-1)
	for _, r := range later {
		if r.e.CallID == last.CallID && !r.e.Refusal() && !r.e.At.Before(last.At.Add(-CopySkew)) {
			if first < 0 {
				first = r.offset
			}
			evs = append(evs, r.e)
		}
	}
	if bad != nil && badOffset >= first {
		return nil, bad
	}
	return firstCopies(evs), nil
}

// FollowCall calls fn with each event of key on topic, and its offset,
// from offset from (0: the log's start) and then live, until fn returns
// true or ctx is done. An event at an offset below what EndOffsets said
// of key was in the log then.
func FollowCall(ctx context.Context, cc ClientConfig, topic string, key CallKey, from int64, fn func(e Event, offset int64) bool) error {
	return scanKey(ctx, cc, topic, key, from, true, fn)
}

// EndOffsets returns, for each of keys, the end of its partition of topic
// (its high watermark): every event of the key appended from now on is at
// that offset or past it. A submitter reads it before it publishes, to
// tell the answers to its envelope from those to an earlier one.
func EndOffsets(ctx context.Context, cc ClientConfig, topic string, keys ...CallKey) ([]int64, error) {
	admin, n, err := openTopic(ctx, cc, topic)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	ends, err := kadm.NewClient(admin).ListEndOffsets(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("list offsets %s: %w", topic, err)
	}
	offsets := make([]int64, len(keys))
	for i, key := range keys {
		p := PartitionFor([]byte(key.String()), n)
		end, _ := ends.Lookup(topic, p)
		if end.Err != nil {
			return nil, fmt.Errorf("list offsets %s/%d: %w", topic, p, end.Err)
		}
		offsets[i] = end.Offset
	}
	return offsets, nil
}

// openTopic returns a client for asking about topic, which the caller
// closes, and how many partitions topic has.
func openTopic(ctx context.Context, cc ClientConfig, topic string) (*kgo.Client, int, error) {
	admin, err := NewClient(cc)
	if err != nil {
		return nil, 0, err
	}
	n, err := partitions(ctx, kadm.NewClient(admin), topic)
	if err != nil {
		admin.Close()
		return nil, 0, err
	}
	return admin, n, nil
}

// partitions returns how many partitions topic has.
func partitions(ctx context.Context, adm *kadm.Client, topic string) (int, error) {
	details, err := adm.ListTopics(ctx, topic)
	if err != nil {
		return 0, fmt.Errorf("describe %s: %w", topic, err)
	}
	d, ok := details[topic]
	if !ok || d.Err != nil {
		return 0, fmt.Errorf("describe %s: %v", topic, d.Err)
	}
	return len(d.Partitions), nil
}

func scanKey(ctx context.Context, cc ClientConfig, topic string, key CallKey, from int64, follow bool, fn func(Event, int64) bool) error {
	admin, n, err := openTopic(ctx, cc, topic)
	if err != nil {
		return err
	}
	defer admin.Close()
	k := []byte(key.String())
	p := PartitionFor(k, n)
	return scan(ctx, cc, admin, topic, map[int32]int64{p: from}, nil, follow, func(r *kgo.Record) (bool, error) {
		if string(r.Key) != string(k) {
			return false, nil
		}
		e, err := DecodeEvent(r.Value)
		if err != nil {
			return true, fmt.Errorf("event at %s/%d/%d: %w", topic, r.Partition, r.Offset, err)
		}
		return fn(e, r.Offset), nil
	})
}

// startsRecheck is how long a scan to its end offsets waits for a record
// before it lists the log's starts again.
const startsRecheck = time.Second

// scan calls fn with each record of topic's partitions from, from the
// offset each names (the log's start, if later) up to the offset to
// names, or, with to nil, up to its last stable offset when scan begins
// (everything before it is committed or aborted, and read_committed shows
// the committed part), or on and on when follow, until fn says to stop
// or fails, or ctx is done. admin asks for the offsets. Transaction
// markers are read, never passed to fn, so
// that the reader knows when it has reached an end that one of them is
// at.
func scan(ctx context.Context, cc ClientConfig, admin *kgo.Client, topic string, from, to map[int32]int64, follow bool, fn func(*kgo.Record) (bool, error)) error {
	adm := kadm.NewClient(admin)
	ends, err := adm.ListCommittedOffsets(ctx, topic)
	if err != nil {
		return fmt.Errorf("list offsets %s: %w", topic, err)
	}
	// The log's start: records before it were deleted (retention, a
	// DeleteRecords), and a fetch from the start begins there. A
	// partition emptied up to its end has nothing to read, and nothing
	// would arrive to move the reader past it.
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err != nil {
		return fmt.Errorf("list offsets %s: %w", topic, err)
	}
	next := make(map[int32]int64, len(from))
	end := make(map[int32]int64, len(from))
	assign := make(map[int32]kgo.Offset, len(from))
	for p, o := range from {
		e, _ := ends.Lookup(topic, p)
		st, _ := starts.Lookup(topic, p)
		if err := cmp.Or(e.Err, st.Err); err != nil {
			return fmt.Errorf("list offsets %s/%d: %w", topic, p, err)
		}
		next[p], end[p] = max(o, st.Offset), e.Offset
		if t, ok := to[p]; ok {
			// Past the last stable offset, an open transaction's: read
			// once it ends, as a record in it may be the caller's.
			end[p] = t
		}
		if follow || next[p] < end[p] {
			assign[p] = kgo.NewOffset().At(next[p])
		}
	}
	if len(assign) == 0 {
		return nil
	}
	cl, err := NewClient(cc,
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: assign}),
		kgo.KeepControlRecords(),
	)
	if err != nil {
		return err
	}
	defer cl.Close()
	behind := func() bool {
		for p := range assign {
			if next[p] < end[p] {
				return true
			}
		}
		return false
	}
	for follow || behind() {
		pctx, cancel := ctx, context.CancelFunc(func() {})
		if !follow {
			pctx, cancel = context.WithTimeout(ctx, startsRecheck)
		}
		fetches := cl.PollFetches(pctx)
		idle := pctx.Err() != nil
		cancel()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		var ferr error
		fetches.EachError(func(_ string, p int32, err error) {
			if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				ferr = fmt.Errorf("read %s/%d: %w", topic, p, err)
			}
		})
		if ferr != nil {
			return ferr
		}
		if idle && fetches.NumRecords() == 0 {
			// Records deleted since the starts were listed (retention,
			// a DeleteRecords): franz-go resumes such a partition at
			// its log's new start, in silence, and no record comes to
			// move the reader past the part deleted.
			starts, err := adm.ListStartOffsets(ctx, topic)
			if err != nil {
				return fmt.Errorf("list offsets %s: %w", topic, err)
			}
			for p := range assign {
				if st, ok := starts.Lookup(topic, p); ok && st.Err == nil {
					next[p] = max(next[p], st.Offset)
				}
			}
			continue
		}
		for _, r := range fetches.Records() {
			next[r.Partition] = r.Offset + 1
			if t, ok := to[r.Partition]; r.Attrs.IsControl() || ok && r.Offset >= t {
				continue
			}
			if stop, err := fn(r); stop || err != nil {
				return err
			}
		}
	}
	return nil
}
