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

// outboxS2Above sorts after every compressed outbox and before anything
// else that sorts after outboxS2: a range scan's upper bound.
const outboxS2Above = "\x00s3"

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

// castagnoli is the CRC-32C table of the outboxes' checksums (read-only).
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// isPacked reports whether a stored outbox is in the compressed form.
func isPacked(stored []byte) bool {
	return len(stored) >= len(outboxS2) && string(stored[:len(outboxS2)]) == outboxS2
}

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
	binary.BigEndian.PutUint32(buf[len(outboxS2):], crc32.Checksum(outbox, castagnoli))
	// Encode writes into the room it is given when there is enough, as
	// MaxEncodedLen makes sure; append keeps the result right if not.
	return append(buf, s2.Encode(buf[outboxHeader:cap(buf)], outbox)...)
}

// unpackOutbox returns the events of a stored outbox, in either form.
func unpackOutbox(stored []byte) ([]byte, error) {
	if !isPacked(stored) {
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
	if crc32.Checksum(out, castagnoli) != sum {
		return nil, fmt.Errorf("%w: checksum mismatch", errOutbox)
	}
	return out, nil
}

// RewriteProgress is how far a RewritePlainOutboxes has gone.
type RewriteProgress struct {
	// Scanned is the records read so far, in key order; Rewritten those
	// of them whose outbox was compressed and is now plain; Skipped
	// those whose outbox was compressed and changed between the read
	// and the rewrite (a process still writing).
	Scanned, Rewritten, Skipped int64
	// Remaining, once the pass is over, is the compressed outboxes left
	// in the table: written behind the pass's cursor, or skipped.
	Remaining int64
}

// ErrOutboxesRemain is returned by RewritePlainOutboxes when its pass
// ended with compressed outboxes still in the table: some process kept
// writing them, and an older build would refuse them.
var ErrOutboxesRemain = errors.New("pgstore: compressed outboxes remain")

// RewritePlainOutboxes rewrites every compressed outbox as plain JSON:
// what going back to a build that reads only plain outboxes needs. It
// reads the table once, in key order, batch records at a time, and
// rewrites each batch's compressed outboxes in one transaction (retried
// as the store's others are) that leaves alone any record changed since
// it was read. Then it counts what is still compressed, and returns
// ErrOutboxesRemain if any is: run it once no process writes compressed
// outboxes (every one runs with Config.PlainOutboxes). A damaged
// compressed outbox stops it with an error naming the call. progress,
// if set, is called after each batch.
func (s *Store) RewritePlainOutboxes(ctx context.Context, batch int, progress func(RewriteProgress)) (RewriteProgress, error) {
	if batch <= 0 {
		batch = 1000
	}
	var (
		p            RewriteProgress
		lastT, lastK string
		scan         = "SELECT tenant_id, idempotency_key, outbox FROM " + s.table + " ORDER BY tenant_id, idempotency_key LIMIT $1"
		scanAfter    = "SELECT tenant_id, idempotency_key, outbox FROM " + s.table + " WHERE (tenant_id, idempotency_key) > ($2, $3) ORDER BY tenant_id, idempotency_key LIMIT $1"
		readT, readK string
		stored       []byte
	)
	for first := true; ; first = false {
		var (
			rows pgx.Rows
			err  error
			w    outboxRewrite
			read int
		)
		if first {
			rows, err = s.pool.Query(ctx, scan, batch)
		} else {
			rows, err = s.pool.Query(ctx, scanAfter, batch, lastT, lastK)
		}
		if err != nil {
			return p, fmt.Errorf("pgstore: rewrite outboxes: %w", err)
		}
		_, err = pgx.ForEachRow(rows, []any{&readT, &readK, &stored}, func() error {
			read++
			lastT, lastK = readT, readK
			if !isPacked(stored) {
				return nil
			}
			plain, err := unpackOutbox(stored)
			if err != nil {
				return fmt.Errorf("call %s/%s: %w", readT, readK, err)
			}
			w.ts, w.ks = append(w.ts, readT), append(w.ks, readK)
			w.olds, w.plains = append(w.olds, bytes.Clone(stored)), append(w.plains, plain)
			return nil
		})
		if err != nil {
			return p, fmt.Errorf("pgstore: rewrite outboxes: %w", err)
		}
		p.Scanned += int64(read)
		if len(w.ts) > 0 {
			n, err := s.rewriteOutboxes(ctx, w)
			if err != nil {
				return p, err
			}
			p.Rewritten += n
			p.Skipped += int64(len(w.ts)) - n
		}
		if progress != nil {
			progress(p)
		}
		if read < batch {
			break
		}
	}
	if err := s.pool.QueryRow(ctx, "SELECT count(*) FROM "+s.table+" WHERE outbox >= $1 AND outbox < $2",
		[]byte(outboxS2), []byte(outboxS2Above)).Scan(&p.Remaining); err != nil {
		return p, fmt.Errorf("pgstore: count compressed outboxes: %w", err)
	}
	if p.Remaining > 0 {
		return p, fmt.Errorf("%w: %d, written or changed while the rewrite ran: with every process on plain outboxes, run it again", ErrOutboxesRemain, p.Remaining)
	}
	return p, nil
}

// outboxRewrite is one batch of RewritePlainOutboxes: each record's key,
// the compressed outbox it was read with, and that outbox as plain JSON.
type outboxRewrite struct {
	ts, ks       []string
	olds, plains [][]byte
}

// rewriteOutboxes writes w's plain outboxes over the compressed ones,
// only where a record still holds the outbox it was read with, and
// returns how many it wrote.
func (s *Store) rewriteOutboxes(ctx context.Context, w outboxRewrite) (int64, error) {
	var n int64
	err := s.inTx(ctx, "rewrite outboxes", pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
		n = 0
		// In statements of at most maxStatementBytes of data each.
		for _, sp := range statementSpans(len(w.ts), func(i int) int { return len(w.olds[i]) + len(w.plains[i]) }) {
			lo, hi := sp[0], sp[1]
			tag, err := tx.Exec(ctx, "UPDATE "+s.table+" AS r SET outbox = u.plain "+
				"FROM unnest($1::TEXT[], $2::TEXT[], $3::BYTEA[], $4::BYTEA[]) AS u (t, k, old, plain) "+
				"WHERE r.tenant_id = u.t AND r.idempotency_key = u.k AND r.outbox = u.old", w.ts[lo:hi], w.ks[lo:hi], w.olds[lo:hi], w.plains[lo:hi])
			if err != nil {
				return err
			}
			n += tag.RowsAffected()
		}
		return nil
	})
	if err != nil {
		return 0, err // inTx's error names the operation
	}
	return n, nil
}
