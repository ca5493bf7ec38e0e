package consistency

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Log is the events topic as ReadLog found it: the committed events of
// every call, kept compact, and what the two reads learned about aborted
// transactions.
//
// The check covers the records below each partition's last stable offset
// (LSO) as listed when ReadLog was called. A transaction still open then is
// neither committed nor aborted, and read_committed returns nothing at or
// past its first record, so every data record at or past the LSO (in the
// open transaction, or committed behind it) is left out and counted in
// UnstableRecords instead. Check the log once the processors have stopped
// or their transactions have ended (a restarted producer aborts its
// predecessor's; the broker aborts one whose timeout passed).
type Log struct {
	// Topic is the topic read.
	Topic string `json:"topic"`
	// Partitions is the topic's partition count.
	Partitions int `json:"partitions"`
	// Events counts the committed events kept (refusals included): data
	// records below the LSO that the read_committed read returned, that
	// belong to no aborted transaction, and that decoded.
	Events int64 `json:"events"`
	// AbortedRecords counts the data records of aborted transactions
	// anywhere below the end offsets: in the log, hidden from
	// read_committed consumers. A crash mid-transaction leaves some; they
	// are not failures.
	AbortedRecords int64 `json:"aborted_records"`
	// AbortedVisible counts the records of aborted transactions that the
	// read_committed read returned. Must be 0: a consumer at
	// read_uncommitted (franz-go's default) returns every one of them.
	// They are left out of the call histories.
	AbortedVisible int64 `json:"aborted_visible"`
	// HiddenRecords counts committed data records below the LSO (outside
	// any transaction, or in one whose COMMIT marker the uncommitted read
	// saw) that the read_committed read did not return. Must be 0.
	HiddenRecords int64 `json:"hidden_records"`
	// UnstableRecords counts data records, not aborted, at or past the LSO
	// listed at the call: in a transaction still open, or committed behind
	// one. They are not checked. Must be 0 for the check to be complete.
	UnstableRecords int64 `json:"unstable_records"`
	// Undecodable counts committed records that ledger.DecodeEvent refused.
	// Must be 0: only the ledger writes the topic.
	Undecodable int64 `json:"undecodable"`

	calls map[ledger.CallKey]*callLog
	strs  interner
	// aborted are the offsets of aborted records, sorted, per partition.
	aborted map[int32][]int64
	// examples of AbortedVisible, HiddenRecords and Undecodable, as
	// "<partition>/<offset>" (and the record key where there is one).
	abortedEx, hiddenEx, undecodableEx samples
}

// callLog is one call's committed events (seq 1 and up; in seq order, log
// order within one seq, once ReadLog returns) and how many refused
// submissions (seq 0) were filed under its key.
type callLog struct {
	events   []event
	refusals int
}

// event is what the checks keep of one committed event: the fields
// statemachine.Apply reads, with the strings interned in Log.strs (an
// arguments hash is shared by all of a call's events, a reason by many
// calls) and the times as Unix nanoseconds (0 for none). About 56 bytes an
// event, against a kilobyte or more decoded.
type event struct {
	at, expires int64
	seq         int64
	// id is the FNV-64a hash of the event id: a re-appended event keeps
	// its id, two different events at one seq do not.
	id             uint64
	attempt        int32
	typ, reason    uint32
	hash, approval uint32
	jti            uint32
}

// ReadLog reads topic twice, from the start of every partition to its end
// offset (high watermark) as listed at the call: once read_uncommitted with
// the control records, to find which records belong to aborted
// transactions, and once read_committed, as every consumer of the ledger
// reads it. See Log for what is kept and what is left out.
func ReadLog(ctx context.Context, cfg ledger.ClientConfig, topic string) (*Log, error) {
	return readLog(ctx, cfg, topic, readOpts{})
}

// readOpts let a test show that the checks of the second read can fail.
type readOpts struct {
	// uncommitted makes the second read read_uncommitted, to show
	// AbortedVisible catching such a reader.
	uncommitted bool
	// lose, if set, drops the records of the second read it returns true
	// for, as a reader that skips records would.
	lose func(*kgo.Record) bool
}

func readLog(ctx context.Context, cfg ledger.ClientConfig, topic string, o readOpts) (*Log, error) {
	parts, err := listOffsets(ctx, cfg, topic)
	if err != nil {
		return nil, err
	}
	l := &Log{Topic: topic, Partitions: len(parts), calls: make(map[ledger.CallKey]*callLog), aborted: make(map[int32][]int64)}
	if err := l.readUncommitted(ctx, cfg, parts); err != nil {
		return nil, err
	}
	if err := l.readCommitted(ctx, cfg, parts, o); err != nil {
		return nil, err
	}
	for _, p := range parts {
		if len(p.aborted) > 0 {
			l.aborted[p.id] = p.aborted
		}
	}
	l.sortEvents()
	return l, nil
}

// partition is what the reads track of one partition.
type partition struct {
	id int32
	// start is the log start offset, stable the LSO and end the high
	// watermark, listed at the call.
	start, stable, end int64

	// pending are each producer's transactional records since its last
	// marker, during the uncommitted read.
	pending map[int64][]int64
	// aborted are the offsets of aborted records, sorted once the
	// uncommitted read ends.
	aborted []int64
	// committed counts the data records below stable that read_committed
	// must return; last is the highest offset below stable that it
	// returns (data or control record), -1 for none.
	committed int64
	last      int64

	// seen counts the data records below stable that the second read
	// returned, abortedSeen those of them that were aborted.
	seen, abortedSeen int64
}

// listOffsets lists the log start offset, the LSO, then the high watermark
// of every partition. In that order, every record below the LSO belongs to
// a transaction whose marker is below the high watermark: the uncommitted
// read sees how each one ended.
func listOffsets(ctx context.Context, cfg ledger.ClientConfig, topic string) ([]*partition, error) {
	cl, err := ledger.NewClient(cfg)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err == nil {
		err = starts.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("consistency: start offsets of %s: %w", topic, err)
	}
	stable, err := adm.ListCommittedOffsets(ctx, topic)
	if err == nil {
		err = stable.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("consistency: last stable offsets of %s: %w", topic, err)
	}
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("consistency: end offsets of %s: %w", topic, err)
	}
	var parts []*partition
	ends.Each(func(o kadm.ListedOffset) {
		p := &partition{id: o.Partition, end: o.Offset, stable: o.Offset, last: -1, pending: make(map[int64][]int64)}
		if s, ok := stable.Lookup(topic, o.Partition); ok && s.Offset < p.stable {
			p.stable = s.Offset
		}
		if s, ok := starts.Lookup(topic, o.Partition); ok {
			p.start = min(s.Offset, p.end)
		}
		parts = append(parts, p)
	})
	if len(parts) == 0 {
		return nil, fmt.Errorf("consistency: topic %s has no partitions", topic)
	}
	slices.SortFunc(parts, func(a, b *partition) int { return int(a.id - b.id) })
	return parts, nil
}

// Control record types: the second int16 of a control record's key.
const (
	controlAbort  = 0
	controlCommit = 1
)

// readUncommitted reads every record below the end offsets, markers
// included, and sorts each transactional record into aborted, committed or
// still open by its producer's next marker on the partition.
func (l *Log) readUncommitted(ctx context.Context, cfg ledger.ClientConfig, parts []*partition) error {
	err := consume(ctx, cfg, l.Topic, parts, kgo.ReadUncommitted(),
		func(p *partition) int64 { return p.end },
		func(p *partition, r *kgo.Record) error {
			if r.Offset >= p.end {
				return nil
			}
			switch {
			case r.Attrs.IsControl():
				if len(r.Key) < 4 {
					return fmt.Errorf("consistency: control record at %s/%d/%d with a %d-byte key", l.Topic, p.id, r.Offset, len(r.Key))
				}
				if r.Offset < p.stable {
					p.last = max(p.last, r.Offset)
				}
				typ := int16(r.Key[2])<<8 | int16(r.Key[3])
				if typ != controlAbort && typ != controlCommit {
					return nil // not a transaction marker: it ends nothing
				}
				offs := p.pending[r.ProducerID]
				delete(p.pending, r.ProducerID)
				if typ == controlAbort {
					p.aborted = append(p.aborted, offs...)
					l.AbortedRecords += int64(len(offs))
					return nil
				}
				for _, o := range offs {
					p.committedRecord(o, l)
				}
			case r.Attrs.IsTransactional():
				p.pending[r.ProducerID] = append(p.pending[r.ProducerID], r.Offset)
			default:
				p.committedRecord(r.Offset, l)
			}
			return nil
		})
	if err != nil {
		return err
	}
	for _, p := range parts {
		// Transactions without a marker below the end are open: their
		// records sit at or past the LSO.
		for _, offs := range p.pending {
			l.UnstableRecords += int64(len(offs))
		}
		p.pending = nil
		slices.Sort(p.aborted)
	}
	return nil
}

// committedRecord counts a committed data record at off: one that
// read_committed must return if it lies below the LSO.
func (p *partition) committedRecord(off int64, l *Log) {
	if off >= p.stable {
		l.UnstableRecords++
		return
	}
	p.committed++
	p.last = max(p.last, off)
}

// readCommitted reads every partition up to its LSO (read committed, but
// for a test) and keeps the events of every record that no
// aborted transaction holds.
func (l *Log) readCommitted(ctx context.Context, cfg ledger.ClientConfig, parts []*partition, o readOpts) error {
	// Control records are kept so that a partition whose last records
	// below the LSO are markers is seen to be done.
	isolation := kgo.ReadCommitted()
	if o.uncommitted {
		isolation = kgo.ReadUncommitted()
	}
	err := consume(ctx, cfg, l.Topic, parts, isolation,
		func(p *partition) int64 { return p.last + 1 },
		func(p *partition, r *kgo.Record) error {
			if r.Offset >= p.stable || r.Attrs.IsControl() || (o.lose != nil && o.lose(r)) {
				return nil
			}
			p.seen++
			if _, aborted := slices.BinarySearch(p.aborted, r.Offset); aborted {
				l.AbortedVisible++
				p.abortedSeen++
				l.abortedEx.add(fmt.Sprintf("%d/%d %s", p.id, r.Offset, r.Key))
				return nil
			}
			e, err := ledger.DecodeEvent(r.Value)
			if err != nil {
				l.Undecodable++
				l.undecodableEx.add(fmt.Sprintf("%d/%d %s: %v", p.id, r.Offset, r.Key, err))
				return nil
			}
			l.add(&e)
			return nil
		})
	if err != nil {
		return err
	}
	for _, p := range parts {
		if hidden := p.committed - (p.seen - p.abortedSeen); hidden > 0 {
			l.HiddenRecords += hidden
			l.hiddenEx.add(fmt.Sprintf("%d: %d of %d committed records below offset %d not returned", p.id, hidden, p.committed, p.stable))
		}
	}
	return nil
}

// consume reads parts of topic at isolation, from the start, calling fn
// with each record in offset order, until every partition has returned a
// record at or past until(p)-1. Partitions with nothing from their start
// offset to until(p) are not read.
func consume(ctx context.Context, cfg ledger.ClientConfig, topic string, parts []*partition, isolation kgo.IsolationLevel,
	until func(*partition) int64, fn func(*partition, *kgo.Record) error,
) error {
	byID := make(map[int32]*partition)
	offsets := make(map[int32]kgo.Offset)
	for _, p := range parts {
		if until(p) > p.start {
			byID[p.id] = p
			offsets[p.id] = kgo.NewOffset().AtStart()
		}
	}
	if len(byID) == 0 {
		return nil
	}
	cl, err := ledger.NewClient(cfg,
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: offsets}),
		kgo.FetchIsolationLevel(isolation),
		kgo.KeepControlRecords(),
		kgo.FetchMaxWait(250*time.Millisecond),
	)
	if err != nil {
		return err
	}
	defer cl.Close()
	for len(byID) > 0 {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("consistency: read %s: %d partitions short of their end: %w", topic, len(byID), err)
		}
		var ferr error
		fs.EachError(func(_ string, p int32, err error) {
			if ferr == nil && !errors.Is(err, context.Canceled) {
				ferr = fmt.Errorf("consistency: read %s/%d: %w", topic, p, err)
			}
		})
		if ferr != nil {
			return ferr
		}
		var rerr error
		fs.EachRecord(func(r *kgo.Record) {
			p, ok := byID[r.Partition]
			if !ok || rerr != nil {
				return
			}
			if rerr = fn(p, r); rerr != nil {
				return
			}
			if r.Offset+1 >= until(p) {
				delete(byID, p.id)
			}
		})
		if rerr != nil {
			return rerr
		}
	}
	return nil
}

// add keeps what the checks need of e.
func (l *Log) add(e *ledger.Event) {
	l.Events++
	k := e.Key()
	c := l.calls[k]
	if c == nil {
		c = &callLog{}
		l.calls[k] = c
	}
	if e.Refusal() {
		c.refusals++
		return
	}
	h := fnv.New64a()
	h.Write([]byte(e.EventID))
	ev := event{
		at:       nanos(e.At),
		seq:      e.Seq,
		id:       h.Sum64(),
		attempt:  int32(min(max(e.Attempt, 0), 1<<31-1)),
		typ:      l.strs.id(string(e.Type)),
		reason:   l.strs.id(e.Reason),
		hash:     l.strs.id(e.ArgumentsHash),
		approval: l.strs.id(e.ApprovalID),
		jti:      l.strs.id(e.JTI),
	}
	if e.ExpiresAt != nil {
		ev.expires = nanos(*e.ExpiresAt)
	}
	c.events = append(c.events, ev)
}

// names reports whether a committed event of the call k names jti.
func (l *Log) names(k ledger.CallKey, jti string) bool {
	c, ok := l.calls[k]
	if !ok {
		return false
	}
	return slices.ContainsFunc(c.events, func(e event) bool { return l.strs.str(e.jti) == jti })
}

// transition is the statemachine's view of e.
func (l *Log) transition(e *event) statemachine.Event {
	return statemachine.Event{
		Type:          statemachine.EventType(l.strs.str(e.typ)),
		Seq:           e.seq,
		At:            fromNanos(e.at),
		ArgumentsHash: l.strs.str(e.hash),
		ApprovalID:    l.strs.str(e.approval),
		ExpiresAt:     fromNanos(e.expires),
		Attempt:       int(e.attempt),
		Reason:        l.strs.str(e.reason),
	}
}

func nanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromNanos(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n).UTC()
}

// interner stores each distinct string once; id 0 is "".
type interner struct {
	ids  map[string]uint32
	strs []string
}

func (in *interner) id(s string) uint32 {
	if s == "" {
		return 0
	}
	if id, ok := in.ids[s]; ok {
		return id
	}
	if in.ids == nil {
		in.ids = make(map[string]uint32)
		in.strs = []string{""}
	}
	id := uint32(len(in.strs))
	in.ids[s] = id
	in.strs = append(in.strs, s)
	return id
}

func (in *interner) str(id uint32) string {
	if id == 0 {
		return ""
	}
	return in.strs[id]
}
