package boltstore

import (
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	bolt "go.etcd.io/bbolt"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/storetest"
)

func TestContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T) processors.Store {
		s, err := Open(Config{Path: filepath.Join(t.TempDir(), "executions.db")})
		if err != nil {
			t.Fatalf("Open() = %v", err)
		}
		return s
	})
}

// fakeClock is a settable clock for Config.Now.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func openAt(t *testing.T, path string, now func() time.Time) *Store {
	t.Helper()
	s, err := Open(Config{Path: path, Now: now})
	if err != nil {
		t.Fatalf("Open(%s) = %v", path, err)
	}
	return s
}

var (
	k1 = ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "run_1:step_1:refund_order"}
	k2 = ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "run_1:step_2:refund_order"}
)

func admission(k ledger.CallKey) processors.Admission {
	return processors.Admission{
		Key: k, CallID: "call_1", ArgumentsHash: "sha256:aa", Tool: "refund_order", ToolVersion: 3,
		Arguments: []byte(`{"amount_cents":4500}`), DeadlineAt: time.Date(2031, 1, 2, 3, 4, 5, 6, time.UTC),
		Status: processors.StatusAuthorized, Seq: 2, Outbox: []byte("outbox"),
	}
}

// TestClock: leases follow Config.Now, not the wall clock.
func TestClock(t *testing.T) {
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	s := openAt(t, filepath.Join(t.TempDir(), "x.db"), clock.Now)
	defer s.Close()
	ctx := t.Context()

	if _, err := s.Admit(ctx, []processors.Admission{admission(k1)}); err != nil {
		t.Fatal(err)
	}
	got, err := s.Claim(ctx, []processors.Claim{{Key: k1, ArgumentsHash: "sha256:aa", Owner: "e1", Lease: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	if want := clock.Now().Add(time.Minute); !got[0].Record.LeaseUntil.Equal(want) {
		t.Errorf("LeaseUntil = %v; want %v (the injected clock plus the lease)", got[0].Record.LeaseUntil, want)
	}

	tests := []struct {
		name        string
		advance     time.Duration
		wantExpired int
		wantClaim   processors.ClaimOutcome
	}{
		{"lease live", 59 * time.Second, 0, processors.Busy},
		{"lease ends now", time.Second, 0, processors.Busy}, // lease_until < now, strictly
		{"lease over", time.Nanosecond, 1, processors.Reclaimed},
	}
	for _, tc := range tests {
		clock.Advance(tc.advance)
		exp, err := s.Expired(ctx, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(exp) != tc.wantExpired {
			t.Errorf("%s: Expired = %d records; want %d", tc.name, len(exp), tc.wantExpired)
		}
		c, err := s.Claim(ctx, []processors.Claim{{Key: k1, ArgumentsHash: "sha256:aa", Owner: "e2", Lease: time.Minute}})
		if err != nil {
			t.Fatal(err)
		}
		if c[0].Outcome != tc.wantClaim {
			t.Errorf("%s: Claim outcome = %v; want %v", tc.name, c[0].Outcome, tc.wantClaim)
		}
	}
	if exp, _ := s.Expired(ctx, 10); len(exp) != 0 {
		t.Errorf("Expired after reclaim = %d records; want 0", len(exp))
	}
}

// TestDurable: every step survives Close and Open, including the lease
// index that Expired reads.
func TestDurable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "data", "executions.db") // directory created by Open
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	ctx := t.Context()

	s := openAt(t, path, clock.Now)
	if _, err := s.Admit(ctx, []processors.Admission{admission(k1), admission(k2)}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Claim(ctx, []processors.Claim{
		{Key: k1, ArgumentsHash: "sha256:aa", Owner: "e1", Lease: time.Minute},
		{Key: k2, ArgumentsHash: "sha256:aa", Owner: "e1", Lease: time.Hour},
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Complete(ctx, []processors.Completion{{Key: k2, Epoch: 1, Status: processors.StatusSucceeded, Attempt: 1, Result: []byte("ok"), Seq: 4, Outbox: []byte("o2")}}); err != nil {
		t.Fatal(err)
	}
	if err := s.MarkLogged(ctx, []processors.Logged{{Key: k2, Seq: 3}}); err != nil {
		t.Fatal(err)
	}
	want1, _ := s.Get(ctx, k1)
	want2, _ := s.Get(ctx, k2)
	if err := s.Close(); err != nil {
		t.Fatalf("Close() = %v", err)
	}

	s = openAt(t, path, clock.Now)
	defer s.Close()
	for _, want := range []processors.Record{want1, want2} {
		got, err := s.Get(ctx, want.Key)
		if err != nil {
			t.Fatalf("Get(%v) after reopen = %v", want.Key, err)
		}
		if diff := cmp.Diff(want, got, cmpopts.EquateEmpty()); diff != "" {
			t.Errorf("Get(%v) after reopen (-before +after):\n%s", want.Key, diff)
		}
	}
	clock.Advance(2 * time.Minute)
	exp, err := s.Expired(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(exp) != 1 || exp[0].Key != k1 {
		t.Errorf("Expired after reopen = %v; want only %v", exp, k1)
	}
	// Admit after reopen still dedupes.
	res, err := s.Admit(ctx, []processors.Admission{admission(k2)})
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Outcome != processors.Duplicate {
		t.Errorf("Admit after reopen outcome = %v; want Duplicate", res[0].Outcome)
	}
}

// TestLeaseIndex: the lease index holds exactly one entry per executing
// record, so Expired can never list a finished call or miss a live one.
func TestLeaseIndex(t *testing.T) {
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	s := openAt(t, filepath.Join(t.TempDir(), "x.db"), clock.Now)
	defer s.Close()
	ctx := t.Context()
	entries := func() int {
		n := 0
		if err := s.db.View(func(tx *bolt.Tx) error { n = tx.Bucket(bucketLeases).Stats().KeyN; return nil }); err != nil {
			t.Fatal(err)
		}
		return n
	}
	steps := []struct {
		name string
		do   func() error
		want int
	}{
		{"admit", func() error { _, err := s.Admit(ctx, []processors.Admission{admission(k1)}); return err }, 0},
		{"claim", func() error {
			_, err := s.Claim(ctx, []processors.Claim{{Key: k1, ArgumentsHash: "sha256:aa", Owner: "e1", Lease: time.Second}})
			return err
		}, 1},
		{"reclaim", func() error {
			clock.Advance(2 * time.Second)
			_, err := s.Claim(ctx, []processors.Claim{{Key: k1, ArgumentsHash: "sha256:aa", Owner: "e2", Lease: time.Second}})
			return err
		}, 1},
		{"stale complete", func() error {
			_, err := s.Complete(ctx, []processors.Completion{{Key: k1, Epoch: 1, Status: processors.StatusFailed}})
			return err
		}, 1},
		{"complete", func() error {
			_, err := s.Complete(ctx, []processors.Completion{{Key: k1, Epoch: 2, Status: processors.StatusFailed}})
			return err
		}, 0},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if got := entries(); got != st.want {
			t.Errorf("after %s: %d lease index entries; want %d", st.name, got, st.want)
		}
	}
}

func TestOpenErrors(t *testing.T) {
	t.Run("no path", func(t *testing.T) {
		if _, err := Open(Config{}); err == nil {
			t.Errorf("Open(no path) = nil error; want an error")
		}
	})
	t.Run("locked", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "x.db")
		s := openAt(t, path, nil)
		defer s.Close()
		if s2, err := Open(Config{Path: path, OpenTimeout: 50 * time.Millisecond}); err == nil {
			s2.Close()
			t.Errorf("second Open of an open file = nil error; want a lock timeout")
		}
	})
	t.Run("other format", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "x.db")
		s := openAt(t, path, nil)
		if err := s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketMeta).Put(metaFormat, []byte("99")) }); err != nil {
			t.Fatal(err)
		}
		s.Close()
		if _, err := Open(Config{Path: path}); !errors.Is(err, ErrFormat) {
			t.Errorf("Open(format 99) = %v; want ErrFormat", err)
		}
	})
}

func TestRecordKeyUnambiguous(t *testing.T) {
	// Without the length prefix these two would share a key.
	a := recordKey(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "bc"})
	b := recordKey(ledger.CallKey{TenantID: "t_ab", IdempotencyKey: "c"})
	if string(a) == string(b) {
		t.Errorf("recordKey collides for (t_a, bc) and (t_ab, c): %x", a)
	}
}

func TestTimeKeyOrder(t *testing.T) {
	times := []time.Time{
		time.Unix(-5, 0), time.Unix(0, 0), time.Unix(0, 1), time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC),
	}
	for i := 1; i < len(times); i++ {
		lo, hi := timeKey(times[i-1], nil), timeKey(times[i], nil)
		if string(lo) >= string(hi) {
			t.Errorf("timeKey(%v) = %x >= timeKey(%v) = %x; want byte order to follow time", times[i-1], lo, times[i], hi)
		}
		if got := keyTime(hi); !got.Equal(times[i]) {
			t.Errorf("keyTime(timeKey(%v)) = %v", times[i], got)
		}
	}
}

// unloggedEntries counts the unlogged index's entries.
func unloggedEntries(t *testing.T, s *Store) int {
	t.Helper()
	n := 0
	if err := s.db.View(func(tx *bolt.Tx) error { n = tx.Bucket(bucketUnlogged).Stats().KeyN; return nil }); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestUnloggedIndex: the unlogged index holds exactly the done records
// with LoggedSeq < Seq, through every step that can change either.
func TestUnloggedIndex(t *testing.T) {
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	s := openAt(t, filepath.Join(t.TempDir(), "x.db"), clock.Now)
	defer s.Close()
	ctx := t.Context()
	denied := admission(k2)
	denied.Status = processors.StatusDenied
	steps := []struct {
		name string
		do   func() error
		want int
	}{
		{"admit authorized", func() error { _, err := s.Admit(ctx, []processors.Admission{admission(k1)}); return err }, 0},
		{"admit denied", func() error { _, err := s.Admit(ctx, []processors.Admission{denied}); return err }, 1},
		{"claim", func() error {
			_, err := s.Claim(ctx, []processors.Claim{{Key: k1, ArgumentsHash: "sha256:aa", Owner: "e1", Lease: time.Minute}})
			return err
		}, 1},
		{"complete", func() error {
			clock.Advance(time.Second)
			_, err := s.Complete(ctx, []processors.Completion{{Key: k1, Epoch: 1, Status: processors.StatusSucceeded, Seq: 4, Outbox: []byte("o")}})
			return err
		}, 2},
		{"mark logged partly", func() error { return s.MarkLogged(ctx, []processors.Logged{{Key: k1, Seq: 3}}) }, 2},
		{"mark logged", func() error { return s.MarkLogged(ctx, []processors.Logged{{Key: k1, Seq: 4}, {Key: k2, Seq: 2}}) }, 0},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if got := unloggedEntries(t, s); got != st.want {
			t.Errorf("after %s: %d unlogged index entries; want %d", st.name, got, st.want)
		}
	}
}

// TestUnloggedClock: olderThan counts back from Config.Now, strictly.
func TestUnloggedClock(t *testing.T) {
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	s := openAt(t, filepath.Join(t.TempDir(), "x.db"), clock.Now)
	defer s.Close()
	ctx := t.Context()
	denied := admission(k1)
	denied.Status = processors.StatusDenied
	if _, err := s.Admit(ctx, []processors.Admission{denied}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		advance time.Duration
		want    int
	}{
		{"just updated", 0, 0},
		{"exactly olderThan", time.Minute, 0}, // updated_at < now - olderThan, strictly
		{"older", time.Nanosecond, 1},
	}
	for _, tc := range tests {
		clock.Advance(tc.advance)
		got, err := s.Unlogged(ctx, time.Minute, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != tc.want {
			t.Errorf("%s: Unlogged(1m) = %d records; want %d", tc.name, len(got), tc.want)
		}
	}
}

// TestUnloggedBackfill: a file written before the unlogged index existed
// (no bucket) gets it built by Open, format unchanged.
func TestUnloggedBackfill(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.db")
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	ctx := t.Context()
	s := openAt(t, path, clock.Now)
	denied := admission(k1)
	denied.Status = processors.StatusDenied
	if _, err := s.Admit(ctx, []processors.Admission{denied, admission(k2)}); err != nil {
		t.Fatal(err)
	}
	// What an older build's file looks like.
	if err := s.db.Update(func(tx *bolt.Tx) error { return tx.DeleteBucket(bucketUnlogged) }); err != nil {
		t.Fatal(err)
	}
	s.Close()

	s = openAt(t, path, clock.Now)
	defer s.Close()
	if got := unloggedEntries(t, s); got != 1 {
		t.Errorf("unlogged index after reopen: %d entries; want 1 (the denied record)", got)
	}
	clock.Advance(time.Hour)
	got, err := s.Unlogged(ctx, time.Minute, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Key != k1 {
		t.Errorf("Unlogged after backfill = %v; want only %v", got, k1)
	}
	if err := s.db.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketMeta).Get(metaFormat); string(v) != format {
			t.Errorf("format after backfill = %q; want %q (unchanged)", v, format)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// TestRejectedKeyTooLong: a key bbolt cannot hold is refused as the
// data's fault, before anything is written.
func TestRejectedKeyTooLong(t *testing.T) {
	s := openAt(t, filepath.Join(t.TempDir(), "x.db"), nil)
	defer s.Close()
	long := admission(ledger.CallKey{TenantID: "t_acme", IdempotencyKey: strings.Repeat("k", bolt.MaxKeySize)})
	if _, err := s.Admit(t.Context(), []processors.Admission{admission(k1), long}); !errors.Is(err, processors.ErrRejected) {
		t.Errorf("Admit(key of %d bytes) = %v; want an error wrapping ErrRejected", bolt.MaxKeySize, err)
	}
	if _, err := s.Get(t.Context(), k1); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("Get(%v) after the rejected batch = %v; want ErrNotFound", k1, err)
	}
}
