package pgstore

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// rateTableName is the rate limiter's table (schema.sql), qualified like
// the execution records.
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
	lock, update, prune string
}

func (s *Store) rateQueries() rateQueries {
	t := s.rateTable()
	pruneLock := " FOR UPDATE"
	if s.crdb {
		pruneLock = ""
	}
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
		// On PostgreSQL the rows are locked in bucket order, as lock
		// takes them, so that a prune and a charge sharing buckets
		// queue on the first common one instead of deadlocking
		// (PostgreSQL then aborts one after deadlock_timeout, a
		// second). Not on CockroachDB, where a SERIALIZABLE FOR UPDATE
		// locks every row its scan reads (tat has no index: every
		// bucket passed before limit full ones), holding up the charges
		// of live buckets; it resolves deadlocks itself, at once, with
		// a retryable error (40001). The outer tat test again:
		// at READ COMMITTED a row charged after the statement's snapshot
		// is tested again, as the charge left it, once its lock is
		// released, and kept. No index on tat, which every charge would
		// write: the read stops at limit full buckets, which most are
		// once limits by user are in use, and reads the table through
		// once when few are.
		prune: `DELETE FROM ` + t + `
WHERE bucket IN (SELECT bucket FROM ` + t + ` WHERE tat < now() ORDER BY bucket LIMIT $1` + pruneLock + `) AND tat < now()`,
	}
}

// Take implements processors.RateLimiter: one SERIALIZABLE transaction per
// batch, restarted whole on serialization failures like every other
// method. Two round trips: lock (and create) the batch's buckets, reading
// the database's clock; then, after processors.GCRA ran over the requests
// in order (each one alone, a ChargeAll of its own), write the buckets that
// admitted something.
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
	buckets = lockOrder(buckets)
	q := s.rateQueries()

	var out []processors.RateResult
	err := s.inTx(ctx, "take", pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, q.lock, buckets)
		tats, now, err := scanLocked(rows, len(buckets))
		if err != nil {
			return err
		}
		groups := make([][]processors.RateRequest, len(rs))
		for i := range rs {
			groups[i] = rs[i : i+1]
		}
		res, _, next := gcraBatch(groups, tats, now)
		out = make([]processors.RateResult, len(rs))
		for i := range res {
			out[i] = res[i][0]
		}
		if len(next) == 0 {
			return nil
		}
		ubs, uts := updateArgs(next)
		_, err = tx.Exec(ctx, q.update, ubs, uts)
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// PruneRates implements processors.RatePruner: one statement, at the
// relaxed isolation level (READ COMMITTED on PostgreSQL, whose
// serializable read of the table would conflict with every charge
// meanwhile).
func (s *Store) PruneRates(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	var n int64
	err := s.inTxAt(ctx, "prune rates", s.relaxed(), pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, s.rateQueries().prune, limit)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("pgstore prune rates: %w", err)
	}
	return int(n), nil
}

// lockOrder sorts buckets and drops duplicates: the order lock takes them
// in, and ON CONFLICT DO UPDATE may not touch a row twice in one
// statement.
func lockOrder(buckets []string) []string {
	slices.Sort(buckets)
	return slices.Compact(buckets)
}

// scanLocked reads lock's rows: each bucket's tat, and the database's
// clock. want is how many buckets were locked.
func scanLocked(rows pgx.Rows, want int) (map[string]time.Time, time.Time, error) {
	tats := make(map[string]time.Time, want)
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
		return nil, time.Time{}, err
	}
	if len(tats) != want {
		return nil, time.Time{}, fmt.Errorf("locked %d of %d buckets", len(tats), want)
	}
	return tats, now, nil
}

// gcraBatch applies groups of requests in order to the buckets' tats at
// now, each group all or nothing (processors.ChargeAll), a later group
// seeing what an earlier one took. It returns each group's results and
// whether it was charged, and the new tat of each bucket charged; tats is
// not changed.
func gcraBatch(groups [][]processors.RateRequest, tats map[string]time.Time, now time.Time) ([][]processors.RateResult, []bool, map[string]time.Time) {
	cur := maps.Clone(tats)
	out, ok := make([][]processors.RateResult, len(groups)), make([]bool, len(groups))
	for i, g := range groups {
		out[i], ok[i] = processors.ChargeAll(cur, now, g)
	}
	// A charge always moves a bucket's tat forward: the buckets whose
	// tat changed are those charged.
	next := make(map[string]time.Time)
	for b, t := range cur {
		if !t.Equal(tats[b]) {
			next[b] = t
		}
	}
	return out, ok, next
}

// updateArgs are update's arrays for the buckets' new tats, in bucket
// order.
func updateArgs(next map[string]time.Time) ([]string, []time.Time) {
	bs := slices.Sorted(maps.Keys(next))
	ts := make([]time.Time, len(bs))
	for i, b := range bs {
		ts[i] = next[b]
	}
	return bs, ts
}

// charged reports whether any admission of as is charged to a rate limit.
func charged(as []processors.Admission) bool {
	return slices.ContainsFunc(as, func(a processors.Admission) bool { return len(a.Rates) > 0 })
}

// rateAnswers are the rate limits' answers of a charged batch: the keys
// their buckets refused, and the charges of the keys admitted.
type rateAnswers struct {
	limited, charged map[ledger.CallKey][]processors.RateResult
}

// charge decides, in batch order, which of the admissions as[idx...] (of
// free keys, one per key) their buckets admit, each all or nothing, from
// the buckets' locked tats at now. It returns the answers and the new
// tats of the buckets charged.
func charge(as []processors.Admission, idx []int, tats map[string]time.Time, now time.Time) (rateAnswers, map[string]time.Time) {
	var (
		groups [][]processors.RateRequest
		keys   []ledger.CallKey
	)
	for _, i := range idx {
		if len(as[i].Rates) > 0 {
			groups, keys = append(groups, as[i].Rates), append(keys, as[i].Key)
		}
	}
	res, ok, next := gcraBatch(groups, tats, now)
	ans := rateAnswers{limited: make(map[ledger.CallKey][]processors.RateResult), charged: make(map[ledger.CallKey][]processors.RateResult)}
	for j, r := range res {
		if ok[j] {
			ans.charged[keys[j]] = r
		} else {
			ans.limited[keys[j]] = r
		}
	}
	return ans, next
}

// admitCharged is Admit for a batch with admissions charged to rate
// limits (processors.Admission.Rates). The charges commit with the
// admissions, in one transaction at Admit's isolation level, and only the
// first admission of a free key is charged. Two round trips where Admit's
// other batches take one, plus BEGIN and COMMIT: the buckets (created if
// missing, and locked) with the batch's existing records; then, once
// processors.ChargeAll has decided in Go which free keys their buckets
// admit (all of an admission's buckets, or it is refused and charges
// none), their insert with the buckets' update.
//
// At READ COMMITTED (PostgreSQL) it stays exact. Each bucket's row lock
// is held from the first statement to the commit, and the records are
// read after it is taken (each statement sees what committed before it
// began), so an admission that charged the same bucket is seen, and its
// key found taken. A key another transaction inserted between the read
// and the insert, charged to another bucket or to none, is skipped by the
// insert (ON CONFLICT DO NOTHING): the buckets are then written again as
// if it had not been charged, still under their locks (a refusal decided
// meanwhile stands; it erred towards refusing). At SERIALIZABLE
// (CockroachDB) that insert fails with 40001 instead, and the
// transaction runs again whole. Both engines take the same statements.
func (s *Store) admitCharged(ctx context.Context, as []processors.Admission) ([]processors.AdmitResult, error) {
	first := make(map[ledger.CallKey]int, len(as))
	var ts, ks, buckets []string
	for i, a := range as {
		if _, ok := first[a.Key]; ok {
			continue
		}
		first[a.Key] = i
		ts, ks = append(ts, a.Key.TenantID), append(ks, a.Key.IdempotencyKey)
		for _, r := range a.Rates {
			buckets = append(buckets, r.Bucket)
		}
	}
	buckets = lockOrder(buckets)
	q := s.rateQueries()

	var (
		existing []processors.Record
		inserted []insertedRow
		rows     admitRows
		rates    rateAnswers
	)
	err := s.inTxAt(ctx, "admit", s.relaxed(), pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
		// This run's answers only: a run retried starts afresh.
		existing, inserted, rows = nil, nil, admitRows{}
		b := &pgx.Batch{}
		b.Queue(q.lock, buckets)
		b.Queue(s.q.selectKeys, ts, ks)
		br := tx.SendBatch(ctx, b)
		// A statement's error comes with reading its rows.
		locked, _ := br.Query()
		tats, now, err := scanLocked(locked, len(buckets))
		if err == nil {
			found, _ := br.Query()
			existing, err = pgx.CollectRows(found, s.scanRecord)
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}

		pre := byKey(existing)
		var free []int // the first admission of each free key, in batch order
		for i, a := range as {
			if _, taken := pre[a.Key]; !taken && first[a.Key] == i {
				free = append(free, i)
			}
		}
		var next map[string]time.Time
		rates, next = charge(as, free, tats, now)
		var tried []int
		for _, i := range free {
			if _, refused := rates.limited[as[i].Key]; !refused {
				tried = append(tried, i)
				rows.add(as[i], s.packMin)
			}
		}
		if len(tried) == 0 {
			return nil
		}
		b = &pgx.Batch{}
		inserts := rows.queue(b, s.q.insert)
		if len(next) > 0 {
			ubs, uts := updateArgs(next)
			b.Queue(q.update, ubs, uts)
		}
		br = tx.SendBatch(ctx, b)
		inserted, err = readInserted(br, inserts)
		if err == nil && len(next) > 0 {
			_, err = br.Exec()
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil || len(inserted) == len(tried) {
			return err
		}
		// Keys taken meanwhile by another transaction: charge only the
		// admissions inserted, from the same locked tats, and write
		// every bucket charged above again (one that is charged for
		// nothing now goes back to its tat).
		got := make(map[ledger.CallKey]bool, len(inserted))
		for _, r := range inserted {
			got[r.key] = true
		}
		kept := slices.DeleteFunc(slices.Clone(tried), func(i int) bool { return !got[as[i].Key] })
		ans, again := charge(as, kept, tats, now)
		rates.charged = ans.charged
		for bucket := range next {
			if _, ok := again[bucket]; !ok {
				again[bucket] = tats[bucket]
			}
		}
		ubs, uts := updateArgs(again)
		_, err = tx.Exec(ctx, q.update, ubs, uts)
		return err
	})
	if err != nil {
		return nil, err
	}
	out, err := s.admitted(ctx, as, first, rows.ts, rows.ks, existing, inserted, rates)
	if err != nil {
		// As Admit: the admissions (and their charges) committed.
		return nil, fmt.Errorf("pgstore admit: %w", err)
	}
	return out, nil
}
