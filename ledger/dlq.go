package ledger

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Bounds of a DLQ record. A request that goes to the DLQ may be as large as
// the request topic allows (an operator may have raised its
// max.message.bytes), while the DLQ and the producer that writes it keep
// the broker's 1 MB default; a copy that did not fit would fail the
// intake's transaction on every redelivery and stall its partition behind
// one record. So the copy is cut to fit, and the cut is said.
const (
	// DLQMaxValueBytes is the most of a request's value a DLQ record
	// keeps: every envelope the intake's default limit (256 KiB) admits
	// fits whole, with room to spare under a 1 MB record.
	DLQMaxValueBytes = 512 << 10
	// dlqMaxKeyBytes bounds the copy of the request's key.
	dlqMaxKeyBytes = 1 << 10
	// dlqMaxDetailBytes bounds the human detail header, which may quote
	// key names of the request.
	dlqMaxDetailBytes = 1 << 10
)

// HeaderDLQTruncated is set on a DLQ record whose copy of the request's
// value was cut at DLQMaxValueBytes; its value is the original length in
// bytes, in decimal. The whole request stays on the request topic, at the
// offset HeaderDLQSource names, for as long as that topic keeps it.
const HeaderDLQTruncated = "ledger-dlq-truncated"

// boundDLQ cuts a DLQ record's copies to the bounds above. Tokens are
// redacted before the cut, so that no cut can leave half a token that the
// redaction would no longer recognise.
func boundDLQ(r *kgo.Record, origValue int) *kgo.Record {
	if len(r.Value) > DLQMaxValueBytes {
		r.Value = r.Value[:DLQMaxValueBytes:DLQMaxValueBytes]
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: HeaderDLQTruncated, Value: strconv.AppendInt(nil, int64(origValue), 10)})
	}
	if len(r.Key) > dlqMaxKeyBytes {
		r.Key = r.Key[:dlqMaxKeyBytes:dlqMaxKeyBytes]
	}
	for i := range r.Headers {
		if h := &r.Headers[i]; h.Key == HeaderDLQDetail && len(h.Value) > dlqMaxDetailBytes {
			h.Value = append(h.Value[:dlqMaxDetailBytes:dlqMaxDetailBytes], " [cut]"...)
		}
	}
	return r
}

// DLQEntry is a record of the DLQ as ReadDLQ reads it: a request the
// intake could not read, or a batch it skipped unread, and why.
type DLQEntry struct {
	Partition int32
	Offset    int64
	// Time is when the intake wrote it (the record's timestamp).
	Time time.Time
	// Reason is machine-readable (HeaderDLQReason), Detail for people,
	// Source the request's topic, partition and offset.
	Reason, Detail, Source string
	// TruncatedFrom, when not zero, is the request's length: Value is
	// its first DLQMaxValueBytes (HeaderDLQTruncated).
	TruncatedFrom int64
	// Key and Value are the request's, tokens redacted; none for a
	// skipped batch.
	Key, Value []byte
}

// dlqEntry reads r, a DLQ record.
func dlqEntry(r *kgo.Record) DLQEntry {
	e := DLQEntry{
		Partition: r.Partition, Offset: r.Offset, Time: r.Timestamp,
		Reason: string(Header(r, HeaderDLQReason)), Detail: string(Header(r, HeaderDLQDetail)), Source: string(Header(r, HeaderDLQSource)),
		Key: r.Key, Value: r.Value,
	}
	if n, err := strconv.ParseInt(string(Header(r, HeaderDLQTruncated)), 10, 64); err == nil {
		e.TruncatedFrom = n
	}
	return e
}

// ReadDLQ calls fn with each record of the DLQ topic written at or after
// since (every one it holds when since is zero) and committed when
// ReadDLQ begins, partition by partition in offset order, or on and on
// when follow, until fn returns true or ctx is done.
func ReadDLQ(ctx context.Context, cc ClientConfig, topic string, since time.Time, follow bool, fn func(DLQEntry) bool) error {
	admin, err := NewClient(cc)
	if err != nil {
		return err
	}
	defer admin.Close()
	adm := kadm.NewClient(admin)
	n, err := partitions(ctx, adm, topic)
	if err != nil {
		return err
	}
	from := make(map[int32]int64, n)
	for p := range int32(n) {
		from[p] = 0
	}
	if !since.IsZero() {
		after, err := adm.ListOffsetsAfterMilli(ctx, since.UnixMilli(), topic)
		if err != nil {
			return fmt.Errorf("list offsets %s after %s: %w", topic, since.Format(time.RFC3339), err)
		}
		for p := range from {
			o, _ := after.Lookup(topic, p)
			if o.Err != nil {
				return fmt.Errorf("list offsets %s/%d after %s: %w", topic, p, since.Format(time.RFC3339), o.Err)
			}
			from[p] = o.Offset
		}
	}
	return scan(ctx, cc, admin, topic, from, nil, follow, func(r *kgo.Record) (bool, error) {
		return fn(dlqEntry(r)), nil
	})
}
