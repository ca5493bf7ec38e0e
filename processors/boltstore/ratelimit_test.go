package boltstore

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	bolt "go.etcd.io/bbolt"

	"github.com/toolcall-ledger/ledger/processors"
)

// TestRateLimitClock: the limiter runs on Config.Now, to the microsecond:
// a refused request's RetryAfter is exact, the request is refused a
// microsecond before it and admitted at it.
func TestRateLimitClock(t *testing.T) {
	clock := &fakeClock{t: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	s := openAt(t, filepath.Join(t.TempDir(), "executions.db"), clock.Now)
	defer s.Close()
	r := processors.RateRequest{Bucket: "t_acme/refund_order", Limit: 3, Window: 3 * time.Second}

	got := mustTake(t, s, r, r, r, r)
	want := []processors.RateResult{
		{Allowed: true, Remaining: 2}, {Allowed: true, Remaining: 1}, {Allowed: true, Remaining: 0},
		{RetryAfter: time.Second},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("Take(4 x 3 per 3s) at one instant (-want +got):\n%s", diff)
	}
	clock.Advance(time.Second - time.Microsecond)
	if got, want := mustTake(t, s, r)[0], (processors.RateResult{RetryAfter: time.Microsecond}); got != want {
		t.Errorf("Take 1µs before RetryAfter = %+v; want %+v", got, want)
	}
	clock.Advance(time.Microsecond)
	if got, want := mustTake(t, s, r)[0], (processors.RateResult{Allowed: true}); got != want {
		t.Errorf("Take at RetryAfter = %+v; want %+v", got, want)
	}
	// Idle for a whole window: full again, not more than full.
	clock.Advance(time.Hour)
	got = mustTake(t, s, r, r, r, r)
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Take(4 x 3 per 3s) after an idle hour (-want +got):\n%s", diff)
	}
}

// TestRateLimitPersists: the buckets survive a restart of `ledger dev`, and
// a file written before the rates bucket existed opens and limits without
// a format change.
func TestRateLimitPersists(t *testing.T) {
	path := filepath.Join(t.TempDir(), "executions.db")
	// A file as an earlier build wrote it: no rates bucket.
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketRecords, bucketLeases} {
			if _, err := tx.CreateBucket(b); err != nil {
				return err
			}
		}
		meta, err := tx.CreateBucket(bucketMeta)
		if err != nil {
			return err
		}
		return meta.Put(metaFormat, []byte(format))
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}

	clock := &fakeClock{t: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	r := processors.RateRequest{Bucket: "t_acme/refund_order", Limit: 2, Window: time.Minute}
	s := openAt(t, path, clock.Now)
	if got := mustTake(t, s, r, r); !got[0].Allowed || !got[1].Allowed {
		t.Fatalf("Take(2 x 2 per minute) on an old file = %+v; want both allowed", got)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	clock.Advance(10 * time.Second)
	s = openAt(t, path, clock.Now)
	defer s.Close()
	if got, want := mustTake(t, s, r)[0], (processors.RateResult{RetryAfter: 20 * time.Second}); got != want {
		t.Errorf("Take after a restart = %+v; want %+v (the burst before the restart still counts)", got, want)
	}
}

func mustTake(t *testing.T, s *Store, rs ...processors.RateRequest) []processors.RateResult {
	t.Helper()
	got, err := s.Take(t.Context(), rs)
	if err != nil {
		t.Fatalf("Take(%v) = %v; want no error", rs, err)
	}
	return got
}
