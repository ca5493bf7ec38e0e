package boltstore

import (
	"errors"
	"path/filepath"
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

func TestLeaseKeyOrder(t *testing.T) {
	times := []time.Time{
		time.Unix(-5, 0), time.Unix(0, 0), time.Unix(0, 1), time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC),
	}
	for i := 1; i < len(times); i++ {
		lo, hi := leaseKey(times[i-1], nil), leaseKey(times[i], nil)
		if string(lo) >= string(hi) {
			t.Errorf("leaseKey(%v) = %x >= leaseKey(%v) = %x; want byte order to follow time", times[i-1], lo, times[i], hi)
		}
		if got := leaseEnd(hi); !got.Equal(times[i]) {
			t.Errorf("leaseEnd(leaseKey(%v)) = %v", times[i], got)
		}
	}
}
