package projector

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
)

// ReplayConfig configures Replay.
type ReplayConfig struct {
	Client ledger.ClientConfig
	// Topics; the events and control topics are replayed.
	Topics ledger.Topics
	// MaxBatch bounds the records of a Write; default DefaultMaxBatch.
	MaxBatch int
	// MaxBatchBytes bounds the bytes (keys and values) of the records of
	// a Write, as Config.MaxBatchBytes; default DefaultMaxBatchBytes.
	MaxBatchBytes int
	// Logger; nil discards.
	Logger *slog.Logger
	// SkipDeleted goes on past records the log deleted before the
	// replay read them (Progress.Deleted counts them) instead of
	// stopping with ErrRecordsDeleted: for a rebuild whose operator
	// accepts what retention took (rebuild --force).
	SkipDeleted bool
}

// Progress is how far a Replay got.
type Progress struct {
	// Done is the number of records (events and actions) written to the
	// sink.
	Done int64
	// Total is the number of offsets from the log start to the end
	// offsets over every partition: an upper bound on Done, since
	// transaction markers, aborted records and undecodable records take
	// offsets too.
	Total int64
	// Read is how many of Total's offsets the replay has passed.
	Read int64
	// Undecodable counts records that did not decode and were skipped.
	Undecodable int64
	// UnknownTypes counts events of a type the state machine does not
	// know: written, but moving no call (projections.KnownType).
	UnknownTypes int64
	// Deleted counts the offsets the log deleted before the replay read
	// them, gone past with ReplayConfig.SkipDeleted.
	Deleted int64
	// Rate is records written per second so far.
	Rate float64
	// ETA is the time left at the pace so far; 0 when unknown or done.
	ETA time.Duration
	// Elapsed is the time since the replay started.
	Elapsed time.Duration
	// Ends are the end offsets replayed to, per topic and partition:
	// every record below them is in the sink, none at or above. Set a
	// group's offsets to them (CommitOffsets) to go on from there.
	Ends map[string]map[int32]int64
	// Final is set on the last report, once the replay ended.
	Final bool
	// Failed is set, with Final, when the replay stopped on an error
	// (which Replay returns): Read is then short of Total.
	Failed bool
}

// Fraction is the part of Total read, in [0, 1].
func (p Progress) Fraction() float64 {
	if p.Total <= 0 {
		return 1
	}
	return min(1, float64(p.Read)/float64(p.Total))
}

// replayIdle is how long a poll waits before the replay looks at stalled
// partitions, and how often at most it reports progress.
const replayIdle = 500 * time.Millisecond

// replayPart is one partition's replay.
type replayPart struct {
	start, end, pos int64
	done            bool
}

// Replay writes every committed record of the events and control topics
// to sink, from the log start to the end offsets it reads when it starts,
// with no consumer group, and returns the progress at the end, whose
// Ends say where it stopped. progress, if not nil, is called at most
// every 500ms and once at the end (Final).
//
// The end of a partition is its last stable offset, the end a
// read_committed reader can reach: below it every transaction is decided,
// while the high watermark may sit past an open transaction that a
// read_committed reader waits on. A partition is done when the replay read
// a record (transaction markers count) at or past end-1, or when a
// direct fetch shows that the offsets left before the end hold only
// aborted records, which a consumer skips without returning anything.
//
// A Write that fails is retried; after 5 failures Replay returns the error
// with the progress so far. Writing the same records again is harmless, so
// a failed replay can be run again from the start.
func Replay(ctx context.Context, cfg ReplayConfig, sink projections.Sink, progress func(Progress)) (Progress, error) {
	cfg.Topics = cfg.Topics.WithDefaults()
	if cfg.MaxBatch <= 0 {
		cfg.MaxBatch = DefaultMaxBatch
	}
	if cfg.MaxBatchBytes <= 0 {
		cfg.MaxBatchBytes = DefaultMaxBatchBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if sink == nil {
		return Progress{}, errors.New("replay: no sink")
	}
	if progress == nil {
		progress = func(Progress) {}
	}
	r := &replay{cfg: cfg, sink: sink, progress: progress, began: time.Now(), parts: make(map[topicPartition]*replayPart)}

	admCl, err := ledger.NewClient(cfg.Client)
	if err != nil {
		return Progress{}, fmt.Errorf("replay: %w", err)
	}
	defer admCl.Close()
	r.admCl, r.adm = admCl, kadm.NewClient(admCl)
	r.topics = []string{cfg.Topics.Events, cfg.Topics.Control}
	starts, _, stables, err := listOffsets(ctx, r.adm, r.topics)
	if err != nil {
		return Progress{}, fmt.Errorf("replay: %w", err)
	}
	r.prog.Ends = stables
	consume := make(map[string]map[int32]kgo.Offset)
	for topic, ps := range stables {
		for partition, end := range ps {
			start := min(starts[topic][partition], end)
			rp := &replayPart{start: start, end: end, pos: start, done: start >= end}
			r.parts[topicPartition{topic, partition}] = rp
			r.prog.Total += end - start
			if !rp.done {
				r.remaining++
				if consume[topic] == nil {
					consume[topic] = make(map[int32]kgo.Offset)
				}
				consume[topic][partition] = kgo.NewOffset().At(start)
			}
		}
	}
	cfg.Logger.Info("replay started", "records", r.prog.Total, "partitions", len(r.parts))
	if r.remaining > 0 {
		cl, err := ledger.NewClient(cfg.Client,
			kgo.ConsumePartitions(consume),
			kgo.FetchIsolationLevel(kgo.ReadCommitted()),
			kgo.KeepControlRecords(),
			batchFetchBytes(cfg.MaxBatchBytes),
		)
		if err != nil {
			return r.prog, fmt.Errorf("replay: %w", err)
		}
		defer cl.Close()
		if err := r.run(ctx, cl); err != nil {
			r.prog.Failed = true
			r.report(true)
			return r.prog, err
		}
	}
	r.report(true)
	cfg.Logger.Info("replay done", "records", r.prog.Done, "undecodable", r.prog.Undecodable, "unknown_types", r.prog.UnknownTypes, "elapsed", r.prog.Elapsed)
	return r.prog, nil
}

type replay struct {
	cfg       ReplayConfig
	sink      projections.Sink
	progress  func(Progress)
	admCl     *kgo.Client
	adm       *kadm.Client
	topics    []string
	parts     map[topicPartition]*replayPart
	remaining int
	batch     projections.Batch
	// bytes counts the keys and values of the batch's records.
	bytes    int
	prog     Progress
	began    time.Time
	reported time.Time
	// stop is a record the replay cannot skip (ErrNewerRecord).
	stop error
}

func (r *replay) run(ctx context.Context, cl *kgo.Client) error {
	for r.remaining > 0 {
		pollCtx, cancel := context.WithTimeout(ctx, replayIdle)
		fetches := cl.PollRecords(pollCtx, max(1, r.cfg.MaxBatch-r.batch.Len()))
		cancel()
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("replay: %w", err)
		}
		if fetches.IsClientClosed() {
			return errors.New("replay: kafka client closed")
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
				r.cfg.Logger.Warn("fetch error", "topic", topic, "partition", partition, "err", err)
			}
		})
		n := 0
		fetches.EachPartition(func(ftp kgo.FetchTopicPartition) {
			if len(ftp.Records) == 0 || r.gap(ftp) {
				return
			}
			for _, rec := range ftp.Records {
				n++
				r.take(cl, rec)
			}
		})
		if r.stop != nil {
			return r.stop
		}
		if n == 0 && r.remaining > 0 {
			if err := r.probe(ctx, cl); err != nil {
				return err
			}
		}
		if r.batch.Len() >= r.cfg.MaxBatch || r.bytes >= r.cfg.MaxBatchBytes || r.batch.Len() > 0 && (n == 0 || r.remaining == 0) {
			if err := r.write(ctx); err != nil {
				return err
			}
		}
		if time.Since(r.reported) >= replayIdle {
			r.report(false)
		}
	}
	if r.batch.Len() > 0 {
		return r.write(ctx)
	}
	return nil
}

// gap reports, and stops the replay at, records of ftp's partition that
// the log deleted before the replay read them: retention moved the log's
// start past the replay's position after it listed where to start, and
// the client went on from the new start without a word. The rebuild
// would lack them while its Progress.Ends said it held every record
// below, and rebuild --swap would commit the group past them.
func (r *replay) gap(ftp kgo.FetchTopicPartition) bool {
	tp := topicPartition{ftp.Topic, ftp.Partition}
	rp := r.parts[tp]
	if rp == nil || rp.done {
		return false
	}
	return r.deleted(tp, rp, ftp.Records[0].Offset, ftp.LogStartOffset)
}

// deleted reports whether the replay stops at records of tp's partition
// deleted before it read them: from rp.pos to logStart, when first, the
// offset the log has for it now, is past rp.pos. With SkipDeleted it
// goes on, and counts them.
func (r *replay) deleted(tp topicPartition, rp *replayPart, first, logStart int64) bool {
	from := rp.pos
	err := recordsDeleted(tp, from, first, logStart)
	if err == nil {
		return false
	}
	lost := min(logStart, rp.end) - from
	r.cfg.Logger.Error("records deleted from the log before the replay read them",
		"topic", tp.topic, "partition", tp.partition, "next_offset", from, "log_start", logStart,
		"offsets_lost", lost, "skipped", r.cfg.SkipDeleted)
	if r.cfg.SkipDeleted {
		// Its offsets count as read (Progress.Read), the rebuild
		// without them.
		r.prog.Deleted += lost
		return false
	}
	if r.stop == nil {
		r.stop = fmt.Errorf("replay: %w", err)
	}
	return true
}

// take adds a polled record to the batch, or notes that its partition is
// done.
func (r *replay) take(cl *kgo.Client, rec *kgo.Record) {
	tp := topicPartition{rec.Topic, rec.Partition}
	rp := r.parts[tp]
	if rp == nil || rp.done {
		return
	}
	if rec.Offset >= rp.end {
		// Everything between pos and end was aborted.
		r.finish(cl, tp, rp)
		return
	}
	r.prog.Read += rec.Offset + 1 - rp.pos
	rp.pos = rec.Offset + 1
	if !rec.Attrs.IsControl() {
		r.bytes += len(rec.Key) + len(rec.Value)
		n := len(r.batch.Events)
		if err := decodeRecord(rec, r.cfg.Topics, &r.batch.Events, &r.batch.Actions); newer(err) {
			// A rebuild without it would be short of it: fail.
			if r.stop == nil {
				r.stop = fmt.Errorf("%w: %s/%d at offset %d: %w", ErrNewerRecord, rec.Topic, rec.Partition, rec.Offset, err)
			}
		} else if err != nil {
			r.prog.Undecodable++
			logUndecodable(r.cfg.Logger, rec, err)
		} else if len(r.batch.Events) > n && unknownType(r.cfg.Logger, rec, &r.batch.Events[n].Event) {
			r.prog.UnknownTypes++
		}
	}
	if rp.pos >= rp.end {
		r.finish(cl, tp, rp)
	}
}

// finish marks a partition done and stops fetching it.
func (r *replay) finish(cl *kgo.Client, tp topicPartition, rp *replayPart) {
	r.prog.Read += rp.end - rp.pos
	rp.pos, rp.done = rp.end, true
	r.remaining--
	cl.PauseFetchPartitions(map[string][]int32{tp.topic: {tp.partition}})
}

// probe looks, with direct fetches, at the partitions not done after an
// idle poll: a partition whose offsets left before its end hold nothing
// a read_committed reader returns (aborted records whose abort marker
// lies past the end) is done.
func (r *replay) probe(ctx context.Context, cl *kgo.Client) error {
	if err := r.emptied(ctx, cl); err != nil {
		return err
	}
	md, err := r.adm.Metadata(ctx, r.topics...)
	if err != nil {
		r.cfg.Logger.Warn("replay: metadata", "err", err)
		return nil
	}
	for tp, rp := range r.parts {
		if rp.done {
			continue
		}
		off, visible := rp.pos, false
		for i := 0; i < 100 && off < rp.end && !visible; i++ {
			fp, next, err := fetchOnce(ctx, r.admCl, md, tp.topic, tp.partition, off, true)
			if err != nil {
				if ctx.Err() != nil {
					return fmt.Errorf("replay: %w", ctx.Err())
				}
				r.cfg.Logger.Warn("replay: direct fetch", "topic", tp.topic, "partition", tp.partition, "offset", off, "err", err)
				break
			}
			for _, rec := range fp.Records {
				if rec.Offset >= off && rec.Offset < rp.end {
					visible = true // the consumer will return it
				}
			}
			if next <= off {
				break
			}
			off = next
		}
		if !visible && off >= rp.end {
			r.cfg.Logger.Debug("replay: only aborted records left before the end", "topic", tp.topic, "partition", tp.partition,
				"offset", rp.pos, "end", rp.end)
			r.finish(cl, tp, rp)
		}
	}
	return nil
}

// emptied looks for partitions not done whose records retention deleted
// up to their end or past it, while the replay read others: the consumer
// goes on at the new log start, where it finds nothing to return, so gap
// never sees them, and the replay would wait for them for good. It stops
// the replay (ErrRecordsDeleted), or with SkipDeleted counts them and
// finishes the partition.
func (r *replay) emptied(ctx context.Context, cl *kgo.Client) error {
	starts, err := r.adm.ListStartOffsets(ctx, r.topics...)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("replay: %w", ctx.Err())
		}
		r.cfg.Logger.Warn("replay: list start offsets", "err", err)
		return nil
	}
	for tp, rp := range r.parts {
		o, ok := starts.Lookup(tp.topic, tp.partition)
		if rp.done || !ok || o.Err != nil || o.Offset <= rp.pos {
			continue
		}
		if r.deleted(tp, rp, o.Offset, o.Offset) {
			return r.stop
		}
		r.prog.Read += min(o.Offset, rp.end) - rp.pos
		rp.pos = min(o.Offset, rp.end)
		if rp.pos >= rp.end {
			r.finish(cl, tp, rp)
		}
	}
	return nil
}

// write writes the batch, retrying a few times.
func (r *replay) write(ctx context.Context) error {
	const attempts = 5
	for attempt := 1; ; attempt++ {
		err := r.sink.Write(ctx, r.batch)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("replay: %w", ctx.Err())
		}
		if attempt == attempts {
			return fmt.Errorf("replay: write %d records: %w", r.batch.Len(), err)
		}
		backoff := retryBackoff(attempt)
		r.cfg.Logger.Warn("replay: write failed, retrying", "records", r.batch.Len(), "attempt", attempt, "backoff", backoff, "err", err)
		select {
		case <-ctx.Done():
			return fmt.Errorf("replay: %w", ctx.Err())
		case <-time.After(backoff):
		}
	}
	r.prog.Done += int64(r.batch.Len())
	r.batch, r.bytes = projections.Batch{}, 0
	return nil
}

// report calls progress with the progress now.
func (r *replay) report(final bool) {
	now := time.Now()
	r.reported = now
	p := &r.prog
	p.Elapsed = now.Sub(r.began)
	p.Final = final
	p.Rate, p.ETA = 0, 0
	if secs := p.Elapsed.Seconds(); secs > 0 {
		p.Rate = float64(p.Done) / secs
		if left := p.Total - p.Read; !final && left > 0 && p.Read > 0 {
			p.ETA = time.Duration(float64(left) / (float64(p.Read) / secs) * float64(time.Second))
		}
	}
	r.progress(*p)
}

// NewBar returns a progress callback that prints to w, as
//
//	rebuild: 1234567/5000000 events (24.7%) 210k/s ETA 18s
//
// where "rebuild" is what. On a terminal it redraws the line in place;
// elsewhere (a log file, a pipe) it prints a line every 5 seconds and the
// final one.
func NewBar(w io.Writer, what string) func(Progress) {
	return newBar(w, what, isTerminal(w))
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

func newBar(w io.Writer, what string, tty bool) func(Progress) {
	var (
		printed bool
		last    time.Duration
		width   int
	)
	return func(p Progress) {
		line := barLine(what, p)
		if tty {
			pad := max(0, width-len(line))
			width = len(line)
			fmt.Fprintf(w, "\r%s%s", line, strings.Repeat(" ", pad))
			if p.Final {
				fmt.Fprintln(w)
			}
			return
		}
		if p.Final || !printed && p.Elapsed >= 5*time.Second || printed && p.Elapsed-last >= 5*time.Second {
			fmt.Fprintln(w, line)
			printed, last = true, p.Elapsed
		}
	}
}

func barLine(what string, p Progress) string {
	if p.Final {
		// Offsets count transaction markers and aborted records too:
		// say what was written.
		status, read := "done", fmt.Sprintf("%d offsets read", p.Read)
		if p.Failed {
			status, read = "stopped", fmt.Sprintf("%d of %d offsets read", p.Read, p.Total)
		}
		line := fmt.Sprintf("%s: %s, %d records written (%s) in %s, %s", what, status, p.Done, read, p.Elapsed.Round(time.Millisecond), rate(p.Rate))
		if p.Undecodable > 0 {
			line += fmt.Sprintf(", %d undecodable", p.Undecodable)
		}
		return line
	}
	line := fmt.Sprintf("%s: %d/%d records (%.1f%%) %s", what, p.Done, p.Total, 100*p.Fraction(), rate(p.Rate))
	switch {
	case p.ETA > 0:
		line += " ETA " + p.ETA.Round(time.Second).String()
	}
	if p.Undecodable > 0 {
		line += fmt.Sprintf(", %d undecodable", p.Undecodable)
	}
	return line
}

// rate renders records per second as 950/s, 210k/s or 1.2M/s.
func rate(r float64) string {
	switch {
	case r >= 1e6:
		return fmt.Sprintf("%.1fM/s", r/1e6)
	case r >= 1e3:
		return fmt.Sprintf("%.0fk/s", r/1e3)
	default:
		return fmt.Sprintf("%.0f/s", r)
	}
}
