package projector

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
)

// Errors callers branch on.
var (
	// ErrNeverCommitted: the group has no committed offset on the
	// topics; its lag is every record since the log start.
	ErrNeverCommitted = errors.New("the group has never committed offsets")
	// ErrGroupActive: the group has members, so its offsets cannot be
	// set from outside.
	ErrGroupActive = errors.New("the group has active members")
)

// StatusConfig names what Status reports on.
type StatusConfig struct {
	Client ledger.ClientConfig
	// Topics; the events and control topics are reported.
	Topics ledger.Topics
	// Group; default DefaultGroup.
	Group string
}

// GroupStatus is a consumer group's position on the events and control
// topics, read from the brokers, without the projector.
type GroupStatus struct {
	Group string `json:"group"`
	// State is the group's state as its coordinator reports it (Empty,
	// Stable, PreparingRebalance, ..., Dead for no group).
	State string `json:"state"`
	// Members is the number of members in the group.
	Members int `json:"members"`
	// Records is the sum of the partitions' lag in records; Time the
	// largest lag in time.
	Records int64         `json:"lag_records"`
	Time    time.Duration `json:"lag_time_ns"`
	// Partitions by topic and partition.
	Partitions []PartitionStatus `json:"partitions"`
}

// PartitionStatus is one partition's position.
type PartitionStatus struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	// Committed is the group's committed offset; -1 when it never
	// committed one on this partition.
	Committed int64 `json:"committed"`
	// Start is the log start offset, End the high watermark, Stable the
	// last stable offset (below it, every transaction is decided; it is
	// less than End while a transaction is open).
	Start  int64 `json:"start"`
	End    int64 `json:"end"`
	Stable int64 `json:"stable"`
	// Records is End minus Committed (minus Start when nothing is
	// committed): what the group has still to read, transaction markers
	// and open transactions included.
	Records int64 `json:"lag_records"`
	// Time is how old the first record at the committed offset is, by
	// its Kafka timestamp; 0 when caught up.
	Time time.Duration `json:"lag_time_ns"`
	// Projected is where the projection's records end, as it says
	// (SetEnds); nil when not asked, or it has no end for the partition.
	Projected *int64 `json:"projected,omitempty"`
	// Ended: the group's offset was committed by a projector whose
	// projection recorded an end of the partition there. A projector
	// holds such a partition while the projection has no end of it (a
	// restore in progress, or a database restored from a backup taken
	// before ends were recorded).
	Ended bool `json:"ended,omitempty"`
}

// SetEnds sets each partition's Projected from pos, where the projection
// says its records end (projections.Positioned), and returns the
// partitions the projection holds less of than the group committed (a
// database restored from an older backup, whose records a running
// projector reads again), and those it has no end of though the group says
// it had one (Ended: a projector holds them, but where the group is at
// 0).
func (s *GroupStatus) SetEnds(pos projections.Positions) (behind, held int) {
	for i := range s.Partitions {
		p := &s.Partitions[i]
		end, ok := pos.Lookup(p.Topic, p.Partition)
		switch {
		case ok:
			p.Projected = &end
			if end < p.Committed {
				behind++
			}
		case p.Ended && holds(p.Committed):
			held++
		}
	}
	return behind, held
}

// Status reads the group's committed offsets and the topics' ends, for a
// group whose projector may or may not run. With no committed offset on any
// partition, it returns the status (lag counted from the log start) and an
// error wrapping ErrNeverCommitted.
func Status(ctx context.Context, cfg StatusConfig) (GroupStatus, error) {
	cfg.Topics = cfg.Topics.WithDefaults()
	if cfg.Group == "" {
		cfg.Group = DefaultGroup
	}
	cl, err := ledger.NewClient(cfg.Client)
	if err != nil {
		return GroupStatus{}, fmt.Errorf("status: %w", err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	topics := []string{cfg.Topics.Events, cfg.Topics.Control}

	st := GroupStatus{Group: cfg.Group}
	st.State, st.Members, err = describeGroup(ctx, adm, cfg.Group)
	if err != nil {
		return GroupStatus{}, err
	}
	pos, err := positions(ctx, adm, cfg.Group, topics)
	if err != nil {
		return GroupStatus{}, fmt.Errorf("status: %w", err)
	}
	var md kadm.Metadata
	now := time.Now()
	anyCommitted := false
	for _, s := range pos {
		anyCommitted = anyCommitted || s.Committed >= 0
		from := s.Committed
		if from < 0 {
			from = s.Start
		}
		s.Records = max(0, s.End-max(from, s.Start))
		if s.Records > 0 {
			if md.Topics == nil {
				if md, err = adm.Metadata(ctx, topics...); err != nil {
					return GroupStatus{}, fmt.Errorf("status: metadata: %w", err)
				}
			}
			ts, ok, err := firstTimestamp(ctx, cl, md, s.Topic, s.Partition, max(from, s.Start), s.End)
			if err != nil {
				return GroupStatus{}, fmt.Errorf("status: read %s/%d at %d: %w", s.Topic, s.Partition, from, err)
			}
			if ok {
				s.Time = max(0, now.Sub(ts))
			}
		}
		st.Records += s.Records
		st.Time = max(st.Time, s.Time)
		st.Partitions = append(st.Partitions, s)
	}
	slices.SortFunc(st.Partitions, func(a, b PartitionStatus) int {
		return cmp.Or(strings.Compare(a.Topic, b.Topic), cmp.Compare(a.Partition, b.Partition))
	})
	if !anyCommitted {
		return st, fmt.Errorf("group %s: %w: its lag is every record since the log start", cfg.Group, ErrNeverCommitted)
	}
	return st, nil
}

// positions reads from the brokers, for every partition of topics, the
// group's committed offset (-1 where it has none), the log start, the high
// watermark and the last stable offset: what Status reports, and what a
// running Projector refreshes its lag from.
func positions(ctx context.Context, adm *kadm.Client, group string, topics []string) (map[topicPartition]PartitionStatus, error) {
	committed, err := adm.FetchOffsets(ctx, group)
	if errors.Is(err, kerr.GroupIDNotFound) {
		committed, err = nil, nil // no group: nothing committed
	}
	if err != nil {
		return nil, fmt.Errorf("fetch the offsets of group %s: %w", group, err)
	}
	starts, ends, stables, err := listOffsets(ctx, adm, topics)
	if err != nil {
		return nil, err
	}
	out := make(map[topicPartition]PartitionStatus)
	for topic, ps := range ends {
		for partition, end := range ps {
			s := PartitionStatus{
				Topic: topic, Partition: partition, Committed: -1,
				Start: starts[topic][partition], End: end, Stable: stables[topic][partition],
			}
			if o, ok := committed.Lookup(topic, partition); ok && o.Err == nil && o.At >= 0 {
				s.Committed, s.Ended = o.At, o.Metadata == endsMark
			}
			out[topicPartition{topic, partition}] = s
		}
	}
	return out, nil
}

// describeGroup returns the group's state and its number of members; a
// group that does not exist is "Dead" with none.
func describeGroup(ctx context.Context, adm *kadm.Client, group string) (string, int, error) {
	gs, err := adm.DescribeGroups(ctx, group)
	if err != nil {
		return "", 0, fmt.Errorf("describe group %s: %w", group, err)
	}
	g, ok := gs[group]
	switch {
	case !ok || errors.Is(g.Err, kerr.GroupIDNotFound):
		return "Dead", 0, nil
	case g.Err != nil:
		return "", 0, fmt.Errorf("describe group %s: %w", group, g.Err)
	}
	return g.State, len(g.Members), nil
}

// listOffsets returns every partition's log start, high watermark and last
// stable offset.
func listOffsets(ctx context.Context, adm *kadm.Client, topics []string) (starts, ends, stables map[string]map[int32]int64, err error) {
	get := func(what string, list func(context.Context, ...string) (kadm.ListedOffsets, error)) (map[string]map[int32]int64, error) {
		l, err := list(ctx, topics...)
		if err == nil {
			err = l.Error()
		}
		if err != nil {
			return nil, fmt.Errorf("list %s offsets: %w", what, err)
		}
		out := make(map[string]map[int32]int64)
		l.Each(func(o kadm.ListedOffset) {
			if out[o.Topic] == nil {
				out[o.Topic] = make(map[int32]int64)
			}
			out[o.Topic][o.Partition] = o.Offset
		})
		for _, t := range topics {
			if len(out[t]) == 0 {
				return nil, fmt.Errorf("list %s offsets: topic %s has no partitions", what, t)
			}
		}
		return out, nil
	}
	if starts, err = get("start", adm.ListStartOffsets); err != nil {
		return nil, nil, nil, err
	}
	if ends, err = get("end", adm.ListEndOffsets); err != nil {
		return nil, nil, nil, err
	}
	// ListCommittedOffsets asks read_committed: the last stable offset.
	if stables, err = get("last stable", adm.ListCommittedOffsets); err != nil {
		return nil, nil, nil, err
	}
	return starts, ends, stables, nil
}

// firstTimestamp returns the timestamp of the first record at or after
// offset and before end, read uncommitted (a record of an open
// transaction is lag too), with no group.
func firstTimestamp(ctx context.Context, cl *kgo.Client, md kadm.Metadata, topic string, partition int32, offset, end int64) (time.Time, bool, error) {
	for i := 0; i < 10 && offset < end; i++ {
		fp, next, err := fetchOnce(ctx, cl, md, topic, partition, offset, false)
		if err != nil {
			return time.Time{}, false, err
		}
		for _, r := range fp.Records {
			if !r.Attrs.IsControl() && r.Offset >= offset && r.Offset < end {
				return r.Timestamp, true, nil
			}
		}
		if next <= offset {
			break
		}
		offset = next
	}
	return time.Time{}, false, nil
}

// HoldsRecords reports whether topic/partition holds a committed record
// (not a transaction's marker) in [from, to), read committed. A range of
// aborted writes and their markers alone holds none, though its offsets
// advance: a projector commits past them and writes nothing. It reads at
// most maxHoldsFetches fetches, and says yes past them.
func HoldsRecords(ctx context.Context, cc ledger.ClientConfig, topic string, partition int32, from, to int64) (bool, error) {
	if from >= to {
		return false, nil
	}
	cl, err := ledger.NewClient(cc)
	if err != nil {
		return false, err
	}
	defer cl.Close()
	md, err := kadm.NewClient(cl).Metadata(ctx, topic)
	if err != nil {
		return false, fmt.Errorf("metadata: %w", err)
	}
	for range maxHoldsFetches {
		fp, next, err := fetchOnce(ctx, cl, md, topic, partition, from, true)
		if err != nil {
			return false, fmt.Errorf("read %s/%d at %d: %w", topic, partition, from, err)
		}
		for _, r := range fp.Records {
			if !r.Attrs.IsControl() && r.Offset >= from && r.Offset < to {
				return true, nil
			}
		}
		if next >= to {
			return false, nil
		}
		if next <= from {
			// Nothing readable yet (an open transaction): what it
			// will hold is not known.
			return true, nil
		}
		from = next
	}
	return true, nil
}

// maxHoldsFetches bounds HoldsRecords' reading: 64 MiB.
const maxHoldsFetches = 64

// fetchMaxBytes bounds a direct fetch.
const fetchMaxBytes = 1 << 20

// fetchOnce issues one fetch of topic/partition at offset to the
// partition's leader, outside any consumer, and returns what a consumer at
// that isolation level reads (transaction markers kept) and the offset
// after everything the response covered, aborted records and markers
// included. It is how a reader learns that the records ahead of it are
// all aborted, which a kgo consumer skips without a trace.
func fetchOnce(ctx context.Context, cl *kgo.Client, md kadm.Metadata, topic string, partition int32, offset int64, readCommitted bool) (kgo.FetchPartition, int64, error) {
	td, ok := md.Topics[topic]
	if !ok || td.Err != nil {
		return kgo.FetchPartition{}, offset, fmt.Errorf("no metadata for topic %s", topic)
	}
	pd, ok := td.Partitions[partition]
	if !ok || pd.Err != nil || pd.Leader < 0 {
		return kgo.FetchPartition{}, offset, fmt.Errorf("no leader for %s/%d", topic, partition)
	}
	req := kmsg.NewPtrFetchRequest()
	req.MaxWaitMillis = 100
	req.MinBytes = 1
	req.MaxBytes = fetchMaxBytes
	iso := kgo.ReadUncommitted()
	if readCommitted {
		req.IsolationLevel = 1
		iso = kgo.ReadCommitted()
	}
	rt := kmsg.NewFetchRequestTopic()
	rt.Topic = topic
	rt.TopicID = td.ID
	rp := kmsg.NewFetchRequestTopicPartition()
	rp.Partition = partition
	rp.FetchOffset = offset
	rp.PartitionMaxBytes = fetchMaxBytes
	rt.Partitions = append(rt.Partitions, rp)
	req.Topics = append(req.Topics, rt)

	resp, err := req.RequestWith(ctx, cl.Broker(int(pd.Leader)))
	if err != nil {
		return kgo.FetchPartition{}, offset, err
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return kgo.FetchPartition{}, offset, err
	}
	for i := range resp.Topics {
		t := &resp.Topics[i]
		if t.Topic != topic && t.TopicID != td.ID {
			continue
		}
		for j := range t.Partitions {
			p := &t.Partitions[j]
			if p.Partition != partition {
				continue
			}
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				return kgo.FetchPartition{}, offset, err
			}
			fp, next := kgo.ProcessFetchPartition(kgo.ProcessFetchPartitionOpts{
				KeepControlRecords: true,
				Offset:             offset,
				IsolationLevel:     iso,
				Topic:              topic,
				Partition:          partition,
			}, p, kgo.DefaultDecompressor(), nil)
			return fp, next, fp.Err
		}
	}
	return kgo.FetchPartition{}, offset, fmt.Errorf("fetch response without %s/%d", topic, partition)
}

// Table returns the status as rows of cells, a header first.
func (s GroupStatus) Table() [][]string {
	projected := slices.ContainsFunc(s.Partitions, func(p PartitionStatus) bool { return p.Projected != nil })
	head := []string{"TOPIC", "PARTITION", "COMMITTED", "START", "END", "STABLE", "LAG", "LAG_TIME"}
	if projected {
		head = append(head, "PROJECTED")
	}
	rows := [][]string{head}
	for _, p := range s.Partitions {
		committed := "-"
		if p.Committed >= 0 {
			committed = strconv.FormatInt(p.Committed, 10)
		}
		row := []string{
			p.Topic, strconv.Itoa(int(p.Partition)), committed,
			strconv.FormatInt(p.Start, 10), strconv.FormatInt(p.End, 10), strconv.FormatInt(p.Stable, 10),
			strconv.FormatInt(p.Records, 10), p.Time.Round(time.Millisecond).String(),
		}
		if projected {
			end := "-"
			if p.Projected != nil {
				end = strconv.FormatInt(*p.Projected, 10)
			}
			row = append(row, end)
		}
		rows = append(rows, row)
	}
	return rows
}

// String renders the status as a table for a terminal.
func (s GroupStatus) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "group %s: %s, %d members; lag %d records, %s\n", s.Group, s.State, s.Members, s.Records, s.Time.Round(time.Millisecond))
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	for _, row := range s.Table() {
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	_ = tw.Flush()
	return b.String()
}

// CommitOffsets sets a stopped group's offsets to ends (topic, partition,
// offset), as Replay returns them, so that a projector started in the
// group reads only what came after. It refuses, with ErrGroupActive, a
// group that has members: they would overwrite the offsets with their
// own. A member joining between the check and the commit makes the
// broker refuse the commit.
func CommitOffsets(ctx context.Context, client ledger.ClientConfig, group string, ends map[string]map[int32]int64) error {
	if group == "" {
		return errors.New("commit offsets: no group")
	}
	cl, err := ledger.NewClient(client)
	if err != nil {
		return fmt.Errorf("commit offsets: %w", err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	state, members, err := describeGroup(ctx, adm, group)
	if err != nil {
		return fmt.Errorf("commit offsets: %w", err)
	}
	if members > 0 {
		return fmt.Errorf("commit offsets: group %s (%s, %d members): %w; stop its projectors first", group, state, members, ErrGroupActive)
	}
	os := make(kadm.Offsets)
	for topic, ps := range ends {
		for partition, at := range ps {
			os.Add(kadm.Offset{Topic: topic, Partition: partition, At: at, LeaderEpoch: -1})
		}
	}
	resps, err := adm.CommitOffsets(ctx, group, os)
	if err == nil {
		err = resps.Error()
	}
	if err != nil {
		return fmt.Errorf("commit offsets of group %s: %w", group, err)
	}
	return nil
}
