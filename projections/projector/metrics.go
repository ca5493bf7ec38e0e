package projector

import (
	"bufio"
	"cmp"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// Lag is how far the projection is behind the topics.
type Lag struct {
	// Records is the sum of the partitions' lag in records.
	Records int64
	// Time is the largest of the partitions' lag in time.
	Time time.Duration
	// Held counts the assigned partitions held because the projection's
	// end of them is gone (a restore in progress, or a database restored
	// from a backup without ends): nothing of them is fetched or written
	// until it is back.
	Held int
	// Partitions are the partitions assigned to this projector, by topic
	// and partition, once a fetch or a refresh from the brokers (every
	// Config.LagRefresh) told their end.
	Partitions []PartitionLag
}

// PartitionLag is one partition's lag.
type PartitionLag struct {
	Topic     string
	Partition int32
	// End is the high watermark, as the last fetch that returned records
	// or the last refresh from the brokers saw it, whichever came later.
	End int64
	// Committed is where the group resumes reading: the last offset
	// committed, or where this assignment started.
	Committed int64
	// Records is End minus Committed: records, transaction markers
	// included, the projection has not committed yet.
	Records int64
	// Time is how old the oldest record read but not yet written is,
	// by its Kafka timestamp; 0 when every record read is written.
	Time time.Duration
}

// Lag returns the projector's lag now.
func (p *Projector) Lag() Lag {
	now := p.cfg.Now()
	p.mu.Lock()
	var l Lag
	for tp, st := range p.parts {
		// Paused or not: one no record comes to is held by the lag
		// refresh alone.
		if st.owned && st.endGone {
			l.Held++
		}
		if !st.owned || st.end < 0 || st.committed < 0 {
			continue
		}
		pl := PartitionLag{Topic: tp.topic, Partition: tp.partition, End: st.end, Committed: st.committed,
			Records: max(0, st.end-st.committed)}
		oldest := st.pendingOldest
		if !st.inflightOldest.IsZero() && (oldest.IsZero() || st.inflightOldest.Before(oldest)) {
			oldest = st.inflightOldest
		}
		if !oldest.IsZero() {
			pl.Time = max(0, now.Sub(oldest))
		}
		l.Records += pl.Records
		l.Time = max(l.Time, pl.Time)
		l.Partitions = append(l.Partitions, pl)
	}
	p.mu.Unlock()
	slices.SortFunc(l.Partitions, func(a, b PartitionLag) int {
		return cmp.Or(strings.Compare(a.Topic, b.Topic), cmp.Compare(a.Partition, b.Partition))
	})
	return l
}

// Metrics are the projector's counters since New.
type Metrics struct {
	// Written counts records (events and actions) handed to the sink in
	// a Write that returned nil; records read again after a rebalance
	// or restart count again.
	Written int64
	// Batches counts Writes that returned nil.
	Batches int64
	// WriteErrors counts Writes that returned an error.
	WriteErrors int64
	// Undecodable counts records that did not decode and were skipped.
	Undecodable int64
	// CommitErrors counts offset commits that failed.
	CommitErrors int64
	// Gaps counts the partitions found to have lost records to the
	// log's retention (or DeleteRecords) before the projector read them;
	// the projector stops at the first (ErrRecordsDeleted).
	Gaps int64
	// UnknownTypes counts events of a type the state machine does not
	// know: projected, but moving no call (projections.KnownType).
	UnknownTypes int64
	// Rereads counts the partitions read again from where the
	// projection's records end (projections.Positioned), because it
	// lacked records the group had committed past: a database restored
	// from an older backup.
	Rereads int64
}

// Metrics returns the counters now.
func (p *Projector) Metrics() Metrics {
	return Metrics{
		Written:      p.written.Load(),
		Batches:      p.batches.Load(),
		WriteErrors:  p.writeErrors.Load(),
		Undecodable:  p.undecodable.Load(),
		CommitErrors: p.commitErrors.Load(),
		Gaps:         p.gaps.Load(),
		UnknownTypes: p.unknownTypes.Load(),
		Rereads:      p.rereads.Load(),
	}
}

// Latency is the end-to-end projection latency of every event written:
// the time its Write returned minus the record's timestamp.
func (p *Projector) Latency() *Histogram { return &p.latency }

// ServeHTTP writes the projector's metrics in the Prometheus text format.
func (p *Projector) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	bw := bufio.NewWriter(w)
	p.writeMetrics(bw)
	_ = bw.Flush()
}

func (p *Projector) writeMetrics(w *bufio.Writer) {
	lag := p.Lag()
	m := p.Metrics()
	header := func(name, typ, help string) {
		fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
	}
	// Every series carries role, as the other roles' do.
	const role = `role="projector"`
	labels := func(pl PartitionLag) string {
		return `{` + role + `,topic="` + escapeLabel(pl.Topic) + `",partition="` + strconv.Itoa(int(pl.Partition)) + `"}`
	}

	header("ledger_projector_lag_records", "gauge", "Records (transaction markers included) between the group's committed offset and the high watermark, per assigned partition.")
	for _, pl := range lag.Partitions {
		fmt.Fprintf(w, "ledger_projector_lag_records%s %d\n", labels(pl), pl.Records)
	}
	header("ledger_projector_lag_seconds", "gauge", "Age of the oldest record read but not yet written, per assigned partition; 0 when caught up.")
	for _, pl := range lag.Partitions {
		fmt.Fprintf(w, "ledger_projector_lag_seconds%s %s\n", labels(pl), formatFloat(pl.Time.Seconds()))
	}
	header("ledger_projector_held_partitions", "gauge", "Assigned partitions held because the projection's record of where its records end is gone (a restore in progress, or a database restored from a backup without ends: see `ledger projector record-ends`); nothing of them is written until it is back.")
	fmt.Fprintf(w, "ledger_projector_held_partitions{%s} %d\n", role, lag.Held)
	for _, c := range []struct {
		name, help string
		v          int64
	}{
		{"ledger_projector_written_records_total", "Records written to the projection (again after a redelivery).", m.Written},
		{"ledger_projector_batches_total", "Batches written to the projection.", m.Batches},
		{"ledger_projector_write_errors_total", "Failed writes to the projection; each is retried.", m.WriteErrors},
		{"ledger_projector_undecodable_records_total", "Records that did not decode and were skipped.", m.Undecodable},
		{"ledger_projector_commit_errors_total", "Failed offset commits.", m.CommitErrors},
		{"ledger_projector_unknown_event_types_total", "Events of a type this build's state machine does not know: projected, but their calls keep their last known state.", m.UnknownTypes},
		{"ledger_projector_gaps_total", "Partitions found to have lost records to retention before they were projected; the projector stops at each.", m.Gaps},
		{"ledger_projector_rereads_total", "Partitions read again from where the projection's records end, because it lacked records the consumer group had committed past (a database restored from an older backup); each is logged at Warn.", m.Rereads},
	} {
		header(c.name, "counter", c.help)
		fmt.Fprintf(w, "%s{%s} %d\n", c.name, role, c.v)
	}

	const name = "ledger_projector_latency_seconds"
	header(name, "histogram", "Time from an event's append to the return of the write that projected it.")
	p.latency.eachBucket(func(le time.Duration, cumulative uint64) {
		fmt.Fprintf(w, "%s_bucket{%s,le=\"%s\"} %d\n", name, role, formatFloat(le.Seconds()), cumulative)
	})
	fmt.Fprintf(w, "%s_bucket{%s,le=\"+Inf\"} %d\n", name, role, p.latency.Count())
	fmt.Fprintf(w, "%s_sum{%s} %s\n", name, role, formatFloat(p.latency.Sum().Seconds()))
	fmt.Fprintf(w, "%s_count{%s} %d\n", name, role, p.latency.Count())
}

func formatFloat(f float64) string { return strconv.FormatFloat(f, 'g', -1, 64) }

// escapeLabel escapes a Prometheus label value.
func escapeLabel(s string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(s)
}

// Histogram bucketing: histPerDoubling buckets per doubling, from 1µs up
// to 2^(histBuckets/histPerDoubling) µs (about 71 minutes), and one
// bucket above. A quantile is off by at most one bucket's width, 9%.
const (
	histPerDoubling = 8
	histBuckets     = 32 * histPerDoubling
)

// Histogram counts durations in fixed log-scale buckets. It is safe for
// concurrent use; the zero value is empty and ready.
type Histogram struct {
	counts [histBuckets + 1]atomic.Uint64
	count  atomic.Uint64
	sum    atomic.Int64
	max    atomic.Int64
}

// histBound is the upper bound of bucket i (i < histBuckets).
func histBound(i int) time.Duration {
	return time.Duration(float64(time.Microsecond) * math.Exp2(float64(i)/histPerDoubling))
}

// Observe counts d. A negative d (a clock behind the record's timestamp)
// counts as 0.
func (h *Histogram) Observe(d time.Duration) {
	d = max(d, 0)
	i := 0
	if d > time.Microsecond {
		i = int(math.Ceil(histPerDoubling * math.Log2(float64(d)/float64(time.Microsecond))))
		// Float rounding may land one bucket off at a bound.
		if i > 0 && i <= histBuckets && histBound(i-1) >= d {
			i--
		}
		i = min(i, histBuckets)
	}
	h.counts[i].Add(1)
	h.count.Add(1)
	h.sum.Add(int64(d))
	for {
		m := h.max.Load()
		if int64(d) <= m || h.max.CompareAndSwap(m, int64(d)) {
			break
		}
	}
}

// Count is the number of durations observed.
func (h *Histogram) Count() uint64 { return h.count.Load() }

// Sum is the sum of the durations observed.
func (h *Histogram) Sum() time.Duration { return time.Duration(h.sum.Load()) }

// Quantile returns the q-quantile (0 < q <= 1) of the durations observed:
// the upper bound of the bucket it falls in, at most the largest
// duration observed. It is 0 with nothing observed.
func (h *Histogram) Quantile(q float64) time.Duration {
	n := h.count.Load()
	if n == 0 {
		return 0
	}
	q = min(max(q, 0), 1)
	rank := max(uint64(math.Ceil(q*float64(n))), 1)
	largest := time.Duration(h.max.Load())
	var seen uint64
	for i := range histBuckets {
		seen += h.counts[i].Load()
		if seen >= rank {
			return min(histBound(i), largest)
		}
	}
	return largest
}

// eachBucket calls fn with cumulative counts at every doubling from 1ms.
func (h *Histogram) eachBucket(fn func(le time.Duration, cumulative uint64)) {
	var seen uint64
	const from = 10 * histPerDoubling // 2^10 µs, about 1ms
	for i := range histBuckets {
		seen += h.counts[i].Load()
		if i >= from && i%histPerDoubling == 0 {
			fn(histBound(i), seen)
		}
	}
}
