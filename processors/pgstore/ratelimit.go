package pgstore

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/toolcall-ledger/ledger/processors"
)

// rateTableName is the rate limiter's table (schema.sql); Config.Schema
// qualifies it like the execution records.
const rateTableName = "rate_limits"

var _ processors.RateLimiter = (*Store)(nil)

// rateTable is the rate limiter's table name, sanitized and qualified by
// the schema if one is set.
func (s *Store) rateTable() string {
	t := pgx.Identifier{rateTableName}.Sanitize()
	if s.schema != "" {
		return s.schema + "." + t
	}
	return t
}

// rateQueries is the rate limiter's SQL with the table name filled in.
type rateQueries struct {
	lock, update string
}

func (s *Store) rateQueries() rateQueries {
	t := s.rateTable()
	return rateQueries{
		// Creates the missing buckets (tat = now(): an idle bucket is
		// full) and locks every bucket of the batch, existing or new, in
		// one statement and in bucket order, so that two batches sharing
		// buckets queue on the first common one instead of deadlocking
		// (PostgreSQL's 40P01 is not a retryable error). The no-op DO
		// UPDATE is what takes the lock on an existing row and returns it;
		// under SERIALIZABLE a row another transaction changed since this
		// one's snapshot is a 40001 here, retried whole. now() is the
		// transaction's timestamp on both engines: one clock reading per
		// batch.
		//
		// CockroachDB: INSERT ... ON CONFLICT ... DO UPDATE, RETURNING
		// expressions, and unnest in FROM are all supported (it also has
		// UPSERT, which PostgreSQL lacks). It orders and retries
		// contended transactions itself (40001), rather than detecting
		// deadlocks.
		lock: `INSERT INTO ` + t + ` AS r (bucket, tat)
SELECT u.bucket, now() FROM unnest($1::TEXT[]) AS u (bucket) ORDER BY u.bucket
ON CONFLICT (bucket) DO UPDATE SET tat = r.tat
RETURNING r.bucket, r.tat, now()`,
		// Only buckets that admitted something change; their rows are
		// already locked by lock. Timestamps travel as TIMESTAMPTZ, whose
		// microsecond precision is the one GCRA computes in.
		update: `UPDATE ` + t + ` AS r SET tat = u.tat
FROM unnest($1::TEXT[], $2::TIMESTAMPTZ[]) AS u (bucket, tat)
WHERE r.bucket = u.bucket`,
	}
}

// Take implements processors.RateLimiter: one SERIALIZABLE transaction per
// batch, restarted whole on serialization failures like every other
// method. Two round trips: lock (and create) the batch's buckets, reading
// the database's clock; then, after processors.GCRA ran over the requests
// in order, write the buckets that admitted something.
func (s *Store) Take(ctx context.Context, rs []processors.RateRequest) ([]processors.RateResult, error) {
	if err := processors.CheckRateRequests(rs); err != nil {
		return nil, fmt.Errorf("pgstore take: %w", err)
	}
	if len(rs) == 0 {
		return []processors.RateResult{}, nil
	}
	buckets := make([]string, 0, len(rs))
	for _, r := range rs {
		buckets = append(buckets, r.Bucket)
	}
	// Sorted and distinct: the lock order, and ON CONFLICT DO UPDATE may
	// not touch a row twice in one statement.
	slices.Sort(buckets)
	buckets = slices.Compact(buckets)
	q := s.rateQueries()

	var out []processors.RateResult
	err := s.inTx(ctx, "take", pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, q.lock, buckets)
		tats := make(map[string]time.Time, len(buckets))
		var (
			now    time.Time
			bucket string
			tat    time.Time
		)
		_, err := pgx.ForEachRow(rows, []any{&bucket, &tat, &now}, func() error {
			tats[bucket] = tat
			return nil
		})
		if err != nil {
			return err
		}
		if len(tats) != len(buckets) {
			return fmt.Errorf("locked %d of %d buckets", len(tats), len(buckets))
		}

		out = make([]processors.RateResult, len(rs))
		changed := make(map[string]bool, len(buckets))
		for i, r := range rs {
			next, res := processors.GCRA(tats[r.Bucket], now, r)
			if res.Allowed {
				tats[r.Bucket] = next
				changed[r.Bucket] = true
			}
			out[i] = res
		}
		if len(changed) == 0 {
			return nil
		}
		var ubs []string
		var uts []time.Time
		for _, b := range buckets {
			if changed[b] {
				ubs, uts = append(ubs, b), append(uts, tats[b])
			}
		}
		_, err = tx.Exec(ctx, q.update, ubs, uts)
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
