package ledger

import (
	"strconv"

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
