package boltstore

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
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

// indexEntries returns the keys of index bucket b.
func indexEntries(t *testing.T, s *Store, b []byte) []string {
	t.Helper()
	var ks []string
	if err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(b).ForEach(func(k, _ []byte) error { ks = append(ks, string(k)); return nil })
	}); err != nil {
		t.Fatalf("read index %s: %v", b, err)
	}
	return ks
}

// checkIndexes fails unless every derived index holds exactly the entries
// the records call for, computed here independently of put.
func checkIndexes(t *testing.T, s *Store) {
	t.Helper()
	want := map[string][]string{}
	if err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketRecords).ForEach(func(rk, v []byte) error {
			var d diskRecord
			if err := json.Unmarshal(v, &d); err != nil {
				return err
			}
			r := d.record()
			if r.Status == processors.StatusExecuting {
				want[string(bucketLeases)] = append(want[string(bucketLeases)], string(timeKey(r.LeaseUntil, rk)))
			} else if r.LoggedSeq < r.Seq {
				want[string(bucketUnlogged)] = append(want[string(bucketUnlogged)], string(timeKey(r.UpdatedAt, rk)))
			}
			sk := append(binary.AppendUvarint(nil, uint64(len(r.Status))), r.Status...)
			want[string(bucketStatus)] = append(want[string(bucketStatus)], string(sk)+string(timeKey(r.UpdatedAt, rk)))
			if r.Status.Listed() {
				tk := append(binary.AppendUvarint(nil, uint64(len(r.Key.TenantID))), r.Key.TenantID...)
				want[string(bucketTenantStatus)] = append(want[string(bucketTenantStatus)], string(tk)+string(sk)+string(timeKey(r.UpdatedAt, []byte(r.Key.IdempotencyKey))))
			}
			return nil
		})
	}); err != nil {
		t.Fatal(err)
	}
	for _, b := range indexBuckets {
		w := slices.Sorted(slices.Values(want[string(b)]))
		if got := indexEntries(t, s, b); !slices.Equal(got, w) {
			t.Errorf("index %s = %q; want %q", b, got, w)
		}
	}
}

// TestIndexesInStep: every write path keeps the four indexes exactly in
// step with the records, and their sizes say which records they hold.
func TestIndexesInStep(t *testing.T) {
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	s := openAt(t, filepath.Join(t.TempDir(), "x.db"), clock.Now)
	defer s.Close()
	ctx := t.Context()
	k3 := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "run_1:step_3:refund_order"}
	denied := admission(k2)
	denied.Status = processors.StatusDenied
	pending := admission(k3)
	pending.Status = processors.StatusPending
	claimK1 := func(owner string) func() error {
		return func() error {
			_, err := s.Claim(ctx, []processors.Claim{{Key: k1, ArgumentsHash: "sha256:aa", Owner: owner, Lease: time.Minute}})
			return err
		}
	}
	steps := []struct {
		name                           string
		do                             func() error
		leases, unlogged, statusGroups int
	}{
		{"admit authorized", func() error { _, err := s.Admit(ctx, []processors.Admission{admission(k1)}); return err }, 0, 1, 1},
		{"admit denied", func() error { _, err := s.Admit(ctx, []processors.Admission{denied}); return err }, 0, 2, 2},
		{"claim", claimK1("e1"), 1, 1, 2},
		{"reclaim", func() error { clock.Advance(2 * time.Minute); return claimK1("e2")() }, 1, 1, 2},
		{"complete", func() error {
			clock.Advance(time.Second)
			_, err := s.Complete(ctx, []processors.Completion{{Key: k1, Epoch: 2, Status: processors.StatusSucceeded, Seq: 4, Outbox: []byte("o")}})
			return err
		}, 0, 2, 2},
		{"mark logged partly", func() error { return s.MarkLogged(ctx, []processors.Logged{{Key: k1, Seq: 3}}) }, 0, 2, 2},
		{"mark logged", func() error { return s.MarkLogged(ctx, []processors.Logged{{Key: k1, Seq: 4}, {Key: k2, Seq: 2}}) }, 0, 0, 2},
		{"admit pending", func() error { _, err := s.Admit(ctx, []processors.Admission{pending}); return err }, 0, 1, 3},
		{"mark pending logged", func() error { return s.MarkLogged(ctx, []processors.Logged{{Key: k3, Seq: 2}}) }, 0, 0, 3},
		{"move twice in a batch", func() error {
			clock.Advance(time.Second)
			_, err := s.Move(ctx, []processors.Move{
				{Key: k3, From: processors.StatusPending, FromSeq: 2, To: processors.StatusAuthorized, Seq: 3},
				{Key: k3, From: processors.StatusAuthorized, FromSeq: 3, To: processors.StatusPending, Seq: 4},
			})
			return err
		}, 0, 1, 3},
		{"stale move", func() error {
			_, err := s.Move(ctx, []processors.Move{{Key: k3, From: processors.StatusPending, FromSeq: 2, To: processors.StatusRejected, Seq: 3}})
			return err
		}, 0, 1, 3},
		{"move", func() error {
			_, err := s.Move(ctx, []processors.Move{{Key: k3, From: processors.StatusPending, FromSeq: 4, To: processors.StatusRejected, Seq: 5}})
			return err
		}, 0, 1, 3},
		{"rate limiter", func() error {
			_, err := s.Take(ctx, []processors.RateRequest{{Bucket: "t_acme/refund_order", Limit: 1, Window: time.Second}})
			return err
		}, 0, 1, 3},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		checkIndexes(t, s)
		groups := map[processors.Status]bool{}
		for _, st := range processors.Statuses {
			if rs, err := s.ByStatus(ctx, st, 100); err != nil {
				t.Fatalf("ByStatus(%q) = %v", st, err)
			} else if len(rs) > 0 {
				groups[st] = true
			}
		}
		got := []int{len(indexEntries(t, s, bucketLeases)), len(indexEntries(t, s, bucketUnlogged)), len(groups)}
		if want := []int{st.leases, st.unlogged, st.statusGroups}; !slices.Equal(got, want) {
			t.Errorf("after %s: lease, unlogged entries and statuses in use = %v; want %v", st.name, got, want)
		}
	}
	if r, err := s.Get(ctx, k3); err != nil || r.Status != processors.StatusRejected || r.Seq != 5 {
		t.Errorf("Get(%v) = %q seq %d, %v; want rejected at 5", k3, r.Status, r.Seq, err)
	}
}

// TestUnloggedClock: olderThan counts back from Config.Now, strictly.
func TestUnloggedClock(t *testing.T) {
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	s := openAt(t, filepath.Join(t.TempDir(), "x.db"), clock.Now)
	defer s.Close()
	ctx := t.Context()
	if _, err := s.Admit(ctx, []processors.Admission{admission(k1)}); err != nil {
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
		got, err := s.Unlogged(ctx, time.Minute, processors.Cursor{}, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != tc.want {
			t.Errorf("%s: Unlogged(1m) = %d records; want %d", tc.name, len(got), tc.want)
		}
	}
}

// rebuildCounter counts the "rebuilt its indexes" logs.
type rebuildCounter struct{ n *atomic.Int32 }

func (h rebuildCounter) Enabled(context.Context, slog.Level) bool { return true }
func (h rebuildCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Message == "execution store rebuilt its indexes" {
		h.n.Add(1)
	}
	return nil
}
func (h rebuildCounter) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h rebuildCounter) WithGroup(string) slog.Handler      { return h }

// TestIndexRebuild: Open rebuilds the indexes from the records when they
// cannot be trusted (a file of an earlier layout, a write by code that
// does not maintain them), and only then; the format stays "1".
// moveTo rewrites the records of keys as a build that keeps no index
// would: in status, at seq 7, a second later.
func moveTo(tx *bolt.Tx, status processors.Status, keys ...ledger.CallKey) error {
	recs := tx.Bucket(bucketRecords)
	for _, k := range keys {
		var d diskRecord
		if err := json.Unmarshal(recs.Get(recordKey(k)), &d); err != nil {
			return err
		}
		d.Status, d.Seq, d.UpdatedAt = status, 7, d.UpdatedAt.Add(time.Second)
		v, err := json.Marshal(d)
		if err != nil {
			return err
		}
		if err := recs.Put(recordKey(k), v); err != nil {
			return err
		}
	}
	return nil
}

func TestIndexRebuild(t *testing.T) {
	k3 := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "run_1:step_3:refund_order"}
	tests := []struct {
		name        string
		tamper      func(tx *bolt.Tx) error
		wantRebuild bool
	}{
		{"untouched", nil, false},
		// Even a write that changes nothing: Open cannot tell.
		{"empty write by other code", func(*bolt.Tx) error { return nil }, true},
		{"earlier layout", func(tx *bolt.Tx) error {
			// As the build before the unlogged2 and status indexes left
			// it: its own unlogged index, no stamp.
			for _, b := range [][]byte{bucketUnlogged, bucketStatus} {
				if err := tx.DeleteBucket(b); err != nil {
					return err
				}
			}
			old, err := tx.CreateBucket(bucketOldUnlogged)
			if err != nil {
				return err
			}
			if err := old.Put([]byte("junk"), nil); err != nil {
				return err
			}
			return tx.Bucket(bucketMeta).Delete(metaTxID)
		}, true},
		{"index missing", func(tx *bolt.Tx) error { return tx.DeleteBucket(bucketStatus) }, true},
		// A build that keeps its own indexes in step and stamps its
		// writes, but not the tenant status index (as those before it
		// did, with 8 bytes): k3 leaves pending, and its entry there
		// would be left stale.
		{"written by a stamping build of another layout", func(tx *bolt.Tx) error {
			if err := moveTo(tx, processors.StatusAuthorized, k3); err != nil {
				return err
			}
			return tx.Bucket(bucketMeta).Put(metaTxID, binary.BigEndian.AppendUint64(nil, uint64(tx.ID())))
		}, true},
		{"stamped with another layout", func(tx *bolt.Tx) error {
			return tx.Bucket(bucketMeta).Put(metaTxID, append(binary.BigEndian.AppendUint64(nil, uint64(tx.ID())), indexLayout+1))
		}, true},
		// A file the build before the tenant status index wrote last, as
		// it stamped it: every other index in step.
		{"tenant status index missing", func(tx *bolt.Tx) error {
			if err := tx.DeleteBucket(bucketTenantStatus); err != nil {
				return err
			}
			return stampTxID(tx)
		}, true},
		{"written by other code", func(tx *bolt.Tx) error {
			// A build that does not know the indexes moves k3 from
			// pending to authorized, and writes k1 unlogged.
			return moveTo(tx, processors.StatusAuthorized, k1, k3)
		}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "x.db")
			clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
			ctx := t.Context()
			s := openAt(t, path, clock.Now)
			denied := admission(k2)
			denied.Status = processors.StatusDenied
			pending := admission(k3)
			pending.Status = processors.StatusPending
			if _, err := s.Admit(ctx, []processors.Admission{admission(k1), denied, pending}); err != nil {
				t.Fatal(err)
			}
			if err := s.MarkLogged(ctx, []processors.Logged{{Key: k1, Seq: 2}}); err != nil {
				t.Fatal(err)
			}
			// Not s.write: the tampering is another writer's.
			if tc.tamper != nil {
				if err := s.db.Update(tc.tamper); err != nil {
					t.Fatal(err)
				}
			}
			s.Close()

			var rebuilds atomic.Int32
			s, err := Open(Config{Path: path, Now: clock.Now, Logger: slog.New(rebuildCounter{n: &rebuilds})})
			if err != nil {
				t.Fatalf("Open() = %v", err)
			}
			t.Cleanup(func() { s.Close() }) // the last one opened
			if got := rebuilds.Load() == 1; got != tc.wantRebuild {
				t.Errorf("Open rebuilt the indexes %d times; want rebuilt %v", rebuilds.Load(), tc.wantRebuild)
			}
			checkIndexes(t, s)
			clock.Advance(time.Hour)
			for _, st := range processors.Statuses {
				var want []ledger.CallKey
				for _, k := range []ledger.CallKey{k1, k2, k3} {
					if r, err := s.Get(ctx, k); err != nil {
						t.Fatal(err)
					} else if r.Status == st {
						want = append(want, k)
					}
				}
				rs, err := s.ByStatus(ctx, st, 10)
				if err != nil {
					t.Fatalf("ByStatus(%q) after reopen = %v", st, err)
				}
				var got []ledger.CallKey
				for _, r := range rs {
					got = append(got, r.Key)
				}
				if !slices.Equal(got, want) {
					t.Errorf("ByStatus(%q) after reopen = %v; want %v", st, got, want)
				}
				if rs, err = s.TenantByStatus(ctx, "t_acme", st, 10); err != nil || !slices.Equal(callKeys(rs), want) {
					t.Errorf("TenantByStatus(t_acme, %q) after reopen = %v, %v; want %v", st, callKeys(rs), err, want)
				}
			}
			if _, err := s.Unlogged(ctx, time.Minute, processors.Cursor{}, 10); err != nil {
				t.Errorf("Unlogged after reopen = %v; want nil", err)
			}
			if err := s.db.View(func(tx *bolt.Tx) error {
				if tx.Bucket(bucketOldUnlogged) != nil {
					t.Errorf("bucket %s still there after Open; want it deleted", bucketOldUnlogged)
				}
				if v := tx.Bucket(bucketMeta).Get(metaFormat); string(v) != format {
					t.Errorf("format after Open = %q; want %q (unchanged)", v, format)
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			// The store's own writes since (Open's included) leave the
			// next Open nothing to rebuild.
			if err := s.MarkLogged(ctx, []processors.Logged{{Key: k2, Seq: 2}}); err != nil {
				t.Fatal(err)
			}
			s.Close()
			rebuilds.Store(0)
			s, err = Open(Config{Path: path, Now: clock.Now, Logger: slog.New(rebuildCounter{n: &rebuilds})})
			if err != nil {
				t.Fatalf("Open() again = %v", err)
			}
			if n := rebuilds.Load(); n != 0 {
				t.Errorf("second Open rebuilt the indexes %d times; want 0 (only this code wrote since)", n)
			}
			checkIndexes(t, s)
		})
	}
}

// TestTenantListingReadsOwnEntries: a tenant's listing reads its own
// index entries and no other tenant's, however many of them come before
// or between its own in time: one tenant with a thousand pending calls
// costs another's approval queue nothing. It read all of them, and
// filtered them out, before the tenant status index.
func TestTenantListingReadsOwnEntries(t *testing.T) {
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	s := openAt(t, filepath.Join(t.TempDir(), "x.db"), clock.Now)
	defer s.Close()
	ctx := t.Context()
	pending := func(tenant string, from, n int) {
		t.Helper()
		var as []processors.Admission
		for i := range n {
			a := admission(ledger.CallKey{TenantID: tenant, IdempotencyKey: fmt.Sprintf("k%04d", from+i)})
			a.Status = processors.StatusPending
			as = append(as, a)
		}
		if _, err := s.Admit(ctx, as); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Second)
	}
	// t_quiet's first call, t_busy's thousand, t_quiet's next two, and
	// t_busy's next thousand. t_q is a prefix of t_quiet.
	pending("t_quiet", 0, 1)
	pending("t_busy", 0, 1000)
	pending("t_q", 0, 5)
	pending("t_quiet", 1, 2)
	pending("t_busy", 1000, 1000)

	var read int
	s.entryRead = func([]byte) { read++ }
	for _, tc := range []struct {
		tenant    string
		limit     int
		want      int
		wantFirst string
	}{
		{"t_quiet", 10, 3, "k0000"},
		{"t_quiet", 2, 2, "k0000"},
		{"t_q", 10, 5, "k0000"},
		{"t_busy", 10, 10, "k0000"},
		{"t_none", 10, 0, ""},
	} {
		read = 0
		rs, err := s.TenantByStatus(ctx, tc.tenant, processors.StatusPending, tc.limit)
		if err != nil {
			t.Fatalf("TenantByStatus(%s, pending, %d) = %v", tc.tenant, tc.limit, err)
		}
		if len(rs) != tc.want || (len(rs) > 0 && rs[0].Key.IdempotencyKey != tc.wantFirst) {
			t.Errorf("TenantByStatus(%s, pending, %d) = %v; want %d records from %s", tc.tenant, tc.limit, callKeys(rs), tc.want, tc.wantFirst)
		}
		if read != len(rs) {
			t.Errorf("TenantByStatus(%s, pending, %d) read %d index entries for %d records; want only its own", tc.tenant, tc.limit, read, len(rs))
		}
	}
}

// callKeys are the keys of rs.
func callKeys(rs []processors.Record) []ledger.CallKey {
	ks := make([]ledger.CallKey, 0, len(rs))
	for _, r := range rs {
		ks = append(ks, r.Key)
	}
	return ks
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

// A record of a status this build does not know (a newer build's, in a
// rolling upgrade) is answered NotReady for its key alone, as in pgstore:
// before, the whole claim failed, at every redelivery of the batch.
func TestClaimOfANewerStatus(t *testing.T) {
	s := openAt(t, filepath.Join(t.TempDir(), "x.db"), time.Now)
	defer s.Close()
	ctx := t.Context()
	if _, err := s.Admit(ctx, []processors.Admission{admission(k1), admission(k2)}); err != nil {
		t.Fatal(err)
	}
	if err := s.update(ctx, "test", func(x *txn) error {
		r, _, err := x.get(k1)
		if err != nil {
			return err
		}
		next := r
		next.Status = "held"
		return x.put(&r, next)
	}); err != nil {
		t.Fatal(err)
	}
	res, err := s.Claim(ctx, []processors.Claim{
		{Key: k1, ArgumentsHash: "sha256:aa", Owner: "e1", Lease: time.Minute},
		{Key: k2, ArgumentsHash: "sha256:aa", Owner: "e1", Lease: time.Minute},
	})
	if err != nil {
		t.Fatalf("Claim of a batch with a newer status: %v; want each key answered", err)
	}
	if res[0].Outcome != processors.NotReady || res[1].Outcome != processors.Claimed {
		t.Errorf("outcomes %v, %v; want not ready for the newer status, claimed for the other", res[0].Outcome, res[1].Outcome)
	}
}

// TestCredentialOnDisk: a claim's credential is in the file under its own
// JSON names, and survives a reopen; a record of a build before per-call
// credentials (without those names) reads as naming none, so the claim
// that takes its lapsed call over has no Prior, and records its own.
func TestCredentialOnDisk(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.db")
	clock := &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	ctx := t.Context()
	s := openAt(t, path, clock.Now)
	if _, err := s.Admit(ctx, []processors.Admission{admission(k1), admission(k2)}); err != nil {
		t.Fatal(err)
	}
	first := processors.CallCredential{JTI: "jti-1", Family: "refund_order/t_acme/1"}
	if _, err := s.Claim(ctx, []processors.Claim{
		{Key: k1, ArgumentsHash: "sha256:aa", Owner: "e1", Lease: time.Minute, Credential: first},
		{Key: k2, ArgumentsHash: "sha256:aa", Owner: "e1", Lease: time.Minute, Credential: first},
	}); err != nil {
		t.Fatal(err)
	}
	// k2's record as the build before wrote it: the same JSON, without
	// the credential's names.
	if err := s.db.Update(func(tx *bolt.Tx) error {
		recs := tx.Bucket(bucketRecords)
		var fields map[string]any
		if err := json.Unmarshal(recs.Get(recordKey(k1)), &fields); err != nil {
			return err
		}
		if fields["jti"] != first.JTI || fields["credential_family"] != first.Family {
			return fmt.Errorf("stored record %v; want jti %q and credential_family %q", fields, first.JTI, first.Family)
		}
		if err := json.Unmarshal(recs.Get(recordKey(k2)), &fields); err != nil {
			return err
		}
		delete(fields, "jti")
		delete(fields, "credential_family")
		v, err := json.Marshal(fields)
		if err != nil {
			return err
		}
		return recs.Put(recordKey(k2), v)
	}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s = openAt(t, path, clock.Now)
	defer s.Close()
	if r, err := s.Get(ctx, k1); err != nil || r.Credential != first {
		t.Errorf("Get(%v) after reopen = credential %+v, %v; want %+v", k1, r.Credential, err, first)
	}
	if r, err := s.Get(ctx, k2); err != nil || !r.Credential.IsZero() || r.Status != processors.StatusExecuting {
		t.Errorf("Get(an older build's record) = %q credential %+v, %v; want executing, none", r.Status, r.Credential, err)
	}
	clock.Advance(2 * time.Minute)
	second := processors.CallCredential{JTI: "jti-2", Family: "refund_order/t_acme/2"}
	res, err := s.Claim(ctx, []processors.Claim{{Key: k2, ArgumentsHash: "sha256:aa", Owner: "e2", Lease: time.Minute, Credential: second}})
	if err != nil || res[0].Outcome != processors.Reclaimed || !res[0].Prior.IsZero() || res[0].Record.Credential != second {
		t.Errorf("Claim of the older build's lapsed call = %+v, %v; want Reclaimed, no Prior, credential %+v", res, err, second)
	}
}
