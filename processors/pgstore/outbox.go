package pgstore

import (
	"errors"
	"fmt"

	"github.com/klauspost/compress/s2"
)

// An outbox is a step's events as a JSON array (ledger.EncodeEvents):
// about 1.5 KB for a call's executing and succeeded events. Every
// transition of a row writes a new version of it, and each version keeps
// its outbox until vacuum (on CockroachDB, until MVCC garbage
// collection), so the outbox is most of what the table, its log and the
// wire carry per call. The store writes it compressed with S2 (a
// Snappy-compatible block format): JSON events shrink by about half for
// a microsecond or two of CPU.
//
// A compressed outbox starts with outboxS2, whose zero byte begins no
// JSON document, so the two forms tell themselves apart: outboxes of
// rows an older build wrote, or written with Config.PlainOutboxes, read
// as they are.
const outboxS2 = "\x00s2"

// outboxMinPack is the shortest outbox worth compressing: a single
// small event gains too little to pay for the work.
const outboxMinPack = 256

// maxOutboxBytes bounds an outbox's decompressed size, so that a corrupt
// length cannot make a read allocate without limit. Far above any real
// outbox: a few events, whose arguments and results have limits of
// their own (256 KiB of arguments by default).
const maxOutboxBytes = 64 << 20

// errOutbox: a stored outbox is marked compressed and does not decode.
var errOutbox = errors.New("pgstore: corrupt compressed outbox")

// packOutbox returns the form of outbox to store: compressed when it is
// at least minLen bytes long; never when minLen is negative.
func packOutbox(outbox []byte, minLen int) []byte {
	if minLen < 0 || len(outbox) == 0 || len(outbox) < minLen {
		return outbox
	}
	buf := make([]byte, len(outboxS2), len(outboxS2)+s2.MaxEncodedLen(len(outbox)))
	copy(buf, outboxS2)
	return append(buf, s2.Encode(buf[len(buf):cap(buf)], outbox)...)
}

// unpackOutbox returns the events of a stored outbox, in either form.
func unpackOutbox(stored []byte) ([]byte, error) {
	if len(stored) < len(outboxS2) || string(stored[:len(outboxS2)]) != outboxS2 {
		return stored, nil
	}
	body := stored[len(outboxS2):]
	n, err := s2.DecodedLen(body)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errOutbox, err)
	}
	if n > maxOutboxBytes {
		return nil, fmt.Errorf("%w: %d bytes decompressed, more than %d", errOutbox, n, maxOutboxBytes)
	}
	out, err := s2.Decode(make([]byte, n), body)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errOutbox, err)
	}
	return out, nil
}
