package boltstore

import (
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
		for i, r := range rs {
			if err := ctx.Err(); err != nil {
				return err
			}
			var err error
			if out[i], err = take(b, now, r); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("boltstore take: %w", err)
	}
	return out, nil
}

// take applies one checked request to its bucket in b at now, writing the
// bucket if the request is admitted. The bucket is read afresh: an earlier
// request of the same transaction may have written it.
func take(b *bolt.Bucket, now time.Time, r processors.RateRequest) (processors.RateResult, error) {
	var tat time.Time
	if v := b.Get([]byte(r.Bucket)); v != nil {
		var err error
		if tat, err = time.Parse(tatFormat, string(v)); err != nil {
			return processors.RateResult{}, fmt.Errorf("decode rate bucket %q: %v", r.Bucket, err)
		}
	}
	next, res := processors.GCRA(tat, now, r)
	if res.Allowed {
		if err := b.Put([]byte(r.Bucket), next.UTC().AppendFormat(nil, tatFormat)); err != nil {
			return processors.RateResult{}, err
		}
	}
	return res, nil
}
