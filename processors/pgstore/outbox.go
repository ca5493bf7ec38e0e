package pgstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"

	"github.com/jackc/pgx/v5"
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
// A compressed outbox is outboxS2, the CRC-32C (Castagnoli) of the
// events, big-endian, and the S2 block. S2's block format has no
// checksum of its own, and a damaged block can decode into other bytes
// without an error; the CRC makes that an error. The leading zero byte
// begins no JSON document, so the two forms tell themselves apart:
// outboxes of rows an older build wrote, or written with
// Config.PlainOutboxes, read as they are.
const outboxS2 = "\x00s2"

// outboxHeader is the length of a compressed outbox before its block.
const outboxHeader = len(outboxS2) + 4

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
// at least minLen bytes long; never when minLen is negative. (Only JSON
// is given to it, which never starts with outboxS2's zero byte, so what
// it leaves as it is reads back as it is.)
func packOutbox(outbox []byte, minLen int) []byte {
	if minLen < 0 || len(outbox) == 0 || len(outbox) < minLen {
		return outbox
	}
	buf := make([]byte, outboxHeader, outboxHeader+s2.MaxEncodedLen(len(outbox)))
	copy(buf, outboxS2)
	binary.BigEndian.PutUint32(buf[len(outboxS2):], crc32.Checksum(outbox, crc32.MakeTable(crc32.Castagnoli)))
	block := s2.Encode(buf[outboxHeader:cap(buf)], outbox)
	return buf[:outboxHeader+len(block)]
}

// unpackOutbox returns the events of a stored outbox, in either form.
func unpackOutbox(stored []byte) ([]byte, error) {
	if len(stored) < len(outboxS2) || string(stored[:len(outboxS2)]) != outboxS2 {
		return stored, nil
	}
	if len(stored) < outboxHeader {
		return nil, fmt.Errorf("%w: %d bytes, shorter than its header", errOutbox, len(stored))
	}
	sum, block := binary.BigEndian.Uint32(stored[len(outboxS2):]), stored[outboxHeader:]
	n, err := s2.DecodedLen(block)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errOutbox, err)
	}
	if n > maxOutboxBytes {
		return nil, fmt.Errorf("%w: %d bytes decompressed, more than %d", errOutbox, n, maxOutboxBytes)
	}
	out, err := s2.Decode(make([]byte, n), block)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errOutbox, err)
	}
	if crc32.Checksum(out, crc32.MakeTable(crc32.Castagnoli)) != sum {
		return nil, fmt.Errorf("%w: checksum mismatch", errOutbox)
	}
	return out, nil
}

// RewriteProgress is how far a RewritePlainOutboxes has gone.
type RewriteProgress struct {
	// Scanned is the records read so far, in key order; Rewritten those
	// of them whose outbox was compressed and is now plain.
	Scanned, Rewritten int64
}

// RewritePlainOutboxes rewrites every compressed outbox as plain JSON:
// what going back to a build that reads only plain outboxes needs. It
// reads the table once, in key order, batch records at a time, and
// rewrites each compressed outbox of a batch in one statement that
// leaves alone any record changed since it was read. Run it once no
// process writes compressed outboxes (every one runs with
// Config.PlainOutboxes), or records written compressed behind its
// cursor stay so. A damaged compressed outbox stops it with an error
// naming the call. progress, if set, is called after each batch.
func (s *Store) RewritePlainOutboxes(ctx context.Context, batch int, progress func(RewriteProgress)) (RewriteProgress, error) {
	if batch <= 0 {
		batch = 1000
	}
	var (
		p            RewriteProgress
		lastT, lastK string
		first        = true
		scan         = "SELECT tenant_id, idempotency_key, outbox FROM " + s.table + " ORDER BY tenant_id, idempotency_key LIMIT $1"
		scanAfter    = "SELECT tenant_id, idempotency_key, outbox FROM " + s.table + " WHERE (tenant_id, idempotency_key) > ($2, $3) ORDER BY tenant_id, idempotency_key LIMIT $1"
		rewrite      = "UPDATE " + s.table + " AS r SET outbox = u.plain FROM unnest($1::TEXT[], $2::TEXT[], $3::BYTEA[], $4::BYTEA[]) AS u (t, k, old, plain) WHERE r.tenant_id = u.t AND r.idempotency_key = u.k AND r.outbox = u.old"
		ts, ks       []string
		olds, plains [][]byte
		readT, readK string
		outbox       []byte
		rowsRead     int
	)
	for {
		var rows pgx.Rows
		var err error
		if first {
			rows, err = s.pool.Query(ctx, scan, batch)
		} else {
			rows, err = s.pool.Query(ctx, scanAfter, batch, lastT, lastK)
		}
		if err != nil {
			return p, fmt.Errorf("pgstore: rewrite outboxes: %w", err)
		}
		ts, ks, olds, plains, rowsRead = ts[:0], ks[:0], olds[:0], plains[:0], 0
		_, err = pgx.ForEachRow(rows, []any{&readT, &readK, &outbox}, func() error {
			rowsRead++
			lastT, lastK = readT, readK
			if len(outbox) < len(outboxS2) || string(outbox[:len(outboxS2)]) != outboxS2 {
				return nil
			}
			plain, err := unpackOutbox(outbox)
			if err != nil {
				return fmt.Errorf("call %s/%s: %w", readT, readK, err)
			}
			ts, ks = append(ts, readT), append(ks, readK)
			olds, plains = append(olds, bytes.Clone(outbox)), append(plains, plain)
			return nil
		})
		if err != nil {
			return p, fmt.Errorf("pgstore: rewrite outboxes: %w", err)
		}
		first = false
		p.Scanned += int64(rowsRead)
		if len(ts) > 0 {
			tag, err := s.pool.Exec(ctx, rewrite, ts, ks, olds, plains)
			if err != nil {
				return p, fmt.Errorf("pgstore: rewrite outboxes: %w", err)
			}
			p.Rewritten += tag.RowsAffected()
		}
		if progress != nil {
			progress(p)
		}
		if rowsRead < batch {
			return p, nil
		}
	}
}
