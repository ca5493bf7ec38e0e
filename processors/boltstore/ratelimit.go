package boltstore

import (
	"bytes"
	"context"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/toolcall-ledger/ledger/processors"
)

var _ processors.RateLimiter = (*Store)(nil)

// tatFormat is how a bucket's theoretical arrival time is stored: RFC 3339
// in UTC with exactly microseconds, GCRA's precision. Part of the file
// format.
const tatFormat = "2006-01-02T15:04:05.000000Z07:00"

// Take implements processors.RateLimiter in one bbolt read-write
// transaction, with one reading of Config.Now for the batch. bbolt's single
// writer makes the batch serializable, so the limit holds for every
// goroutine of the process; the file lock keeps other processes out
// entirely.
func (s *Store) Take(ctx context.Context, rs []processors.RateRequest) ([]processors.RateResult, error) {
	if err := processors.CheckRateRequests(rs); err != nil {
		return nil, fmt.Errorf("boltstore take: %w", err)
	}
	if len(rs) == 0 {
		return []processors.RateResult{}, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("boltstore take: %w", err)
	}
	out := make([]processors.RateResult, len(rs))
	err := s.write(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketRates)
		now := s.now().UTC()
		for i := range rs {
			if err := ctx.Err(); err != nil {
				return err
			}
			// Each request alone: Take's requests are independent.
			res, _, err := charge(b, now, rs[i:i+1])
			if err != nil {
				return err
			}
			out[i] = res[0]
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("boltstore take: %w", err)
	}
	return out, nil
}

// PruneRates implements processors.RatePruner in one bbolt read-write
// transaction, at one reading of Config.Now.
func (s *Store) PruneRates(ctx context.Context, limit int) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("boltstore prune rates: %w", err)
	}
	var n int
	err := s.write(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketRates)
		now := s.now().UTC()
		var full [][]byte
		c := b.Cursor()
		for k, v := c.First(); k != nil && len(full) < limit; k, v = c.Next() {
			tat, err := time.Parse(tatFormat, string(v))
			if err != nil {
				// Left for Take to report: pruning is housekeeping.
				continue
			}
			if tat.Before(now) {
				full = append(full, bytes.Clone(k))
			}
		}
		// After the walk: a cursor's deletes would move it.
		for _, k := range full {
			if err := b.Delete(k); err != nil {
				return err
			}
		}
		n = len(full)
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("boltstore prune rates: %w", err)
	}
	return n, nil
}

// charge applies checked requests all or nothing to their buckets in b at
// now (processors.ChargeAll), writing the buckets only if every one admits
// its request; ok reports whether they did. The buckets are read afresh:
// an earlier request of the same transaction may have written them.
func charge(b *bolt.Bucket, now time.Time, rs []processors.RateRequest) (_ []processors.RateResult, ok bool, _ error) {
	tats := make(map[string]time.Time, len(rs))
	for _, r := range rs {
		if v := b.Get([]byte(r.Bucket)); v != nil {
			tat, err := time.Parse(tatFormat, string(v))
			if err != nil {
				return nil, false, fmt.Errorf("decode rate bucket %q: %v", r.Bucket, err)
			}
			tats[r.Bucket] = tat
		}
	}
	res, ok := processors.ChargeAll(tats, now, rs)
	if !ok {
		return res, false, nil
	}
	for _, r := range rs {
		if err := b.Put([]byte(r.Bucket), tats[r.Bucket].UTC().AppendFormat(nil, tatFormat)); err != nil {
			return nil, false, err
		}
	}
	return res, true, nil
}
