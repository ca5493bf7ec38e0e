package pgstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/storetest"
)

func testDSN(t *testing.T) string { return storetest.PGDSN(t) }

func newSchema(t *testing.T, dsn string) string { return storetest.FreshSchema(t, dsn) }

func open(t *testing.T, cfg Config) *Store {
	t.Helper()
	s, err := Open(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Open() = %v", err)
	}
	return s
}

func TestContract(t *testing.T) {
	dsn := testDSN(t)
	storetest.Run(t, func(t *testing.T) processors.Store {
		return open(t, Config{DSN: dsn, Schema: newSchema(t, dsn)})
	})
}

func TestOpenValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
	}{
		{"no DSN", Config{}},
		{"negative retries", Config{DSN: "postgres://x@127.0.0.1/x", MaxRetries: -1}},
		{"negative conns", Config{DSN: "postgres://x@127.0.0.1/x", MaxConns: -1}},
		{"unparsable DSN", Config{DSN: "postgres://u:hunter2@127.0.0.1:notaport/x"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Open(t.Context(), tc.cfg)
			if err == nil {
				t.Fatalf("Open(%s) = nil error; want an error", tc.name)
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Errorf("Open error %q leaks the DSN's password", err)
			}
		})
	}
}

// TestMigrate: the DDL is idempotent, quotes the schema name, and the
// dedupe rests on the primary key, not on isolation.
func TestMigrate(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn) + ` Odd "Name"`
	t.Cleanup(func() { storetest.DropSchema(t, dsn, schema) })
	s := open(t, Config{DSN: dsn, Schema: schema})
	defer s.Close()
	ctx := t.Context()

	for i := range 2 {
		if err := s.Migrate(ctx); err != nil {
			t.Fatalf("Migrate() run %d = %v; want nil (idempotent)", i+2, err)
		}
	}
	var version string
	if err := s.pool.QueryRow(ctx, "SELECT version()").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if got, want := s.CockroachDB(), strings.Contains(version, "CockroachDB"); got != want {
		t.Errorf("CockroachDB() = %v for %q; want %v", got, version, want)
	}

	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
	if _, err := s.Admit(ctx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized}}); err != nil {
		t.Fatalf("Admit in schema %q = %v", schema, err)
	}
	// A plain INSERT of the same key, bypassing ON CONFLICT, must be
	// refused by the constraint.
	_, err := s.pool.Exec(ctx, "INSERT INTO "+s.table+` (tenant_id, idempotency_key, call_id, arguments_hash, tool, tool_version, status, created_at, updated_at)
VALUES ($1, $2, 'c2', 'h2', 'x', 1, 'authorized', now(), now())`, k.TenantID, k.IdempotencyKey)
	if sqlState(err) != "23505" {
		t.Errorf("duplicate INSERT = %v; want a unique violation (23505)", err)
	}
	// And the store's own status check holds in the database too.
	_, err = s.pool.Exec(ctx, "UPDATE "+s.table+" SET status = 'bogus'")
	if sqlState(err) != "23514" {
		t.Errorf("UPDATE to an unknown status = %v; want a check violation (23514)", err)
	}
}

// TestConcurrentPools: executors in different processes (here two pools)
// claiming the same calls; exactly one claim per call wins, and the losers
// see Busy, never an error: their serialization failures are retried.
func TestConcurrentPools(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	a := open(t, Config{DSN: dsn, Schema: schema, MaxConns: 8})
	defer a.Close()
	b := open(t, Config{DSN: dsn, Schema: schema, MaxConns: 8, SkipMigrate: true})
	defer b.Close()
	ctx := t.Context()

	const (
		calls    = 5
		claimers = 16
	)
	for call := range calls {
		k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: fmt.Sprintf("run_1:step_%d", call)}
		if _, err := a.Admit(ctx, []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized}}); err != nil {
			t.Fatal(err)
		}
		var (
			wg       sync.WaitGroup
			mu       sync.Mutex
			outcomes = map[processors.ClaimOutcome]int{}
			errs     []error
		)
		start := make(chan struct{})
		for i := range claimers {
			s := a
			if i%2 == 1 {
				s = b
			}
			wg.Go(func() {
				<-start
				got, err := s.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: fmt.Sprintf("executor-%d", i), Lease: time.Hour}})
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, err)
					return
				}
				outcomes[got[0].Outcome]++
			})
		}
		close(start)
		wg.Wait()
		for _, err := range errs {
			t.Errorf("call %d: Claim = %v; want no error (serialization failures retried)", call, err)
		}
		if outcomes[processors.Claimed] != 1 || outcomes[processors.Busy] != claimers-1 {
			t.Errorf("call %d: outcomes %v; want 1 Claimed and %d Busy", call, outcomes, claimers-1)
		}
		r, err := b.Get(ctx, k)
		if err != nil || r.Epoch != 1 {
			t.Errorf("call %d: Get = epoch %d, %v; want epoch 1", call, r.Epoch, err)
		}
	}
}

// TestSerializationFailureRetried forces a write skew between two
// SERIALIZABLE transactions: each reads both rows, then writes its own.
// PostgreSQL aborts one of them with 40001 (typically at COMMIT, the case
// CockroachDB's savepoint protocol would lose on PostgreSQL); inTx must
// run it again, and the result must be what a serial order gives.
func TestSerializationFailureRetried(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	s := open(t, Config{DSN: dsn, Schema: schema})
	defer s.Close()
	ctx := t.Context()
	skew := pgx.Identifier{schema, "skew"}.Sanitize()
	if _, err := s.pool.Exec(ctx, "CREATE TABLE "+skew+" (id BIGINT PRIMARY KEY, v BIGINT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(ctx, "INSERT INTO "+skew+" (id, v) VALUES (1, 0), (2, 0)"); err != nil {
		t.Fatal(err)
	}

	var (
		attempts [2]atomic.Int32
		read     sync.WaitGroup // both transactions have read, first attempt only
		wg       sync.WaitGroup
		errs     [2]error
	)
	bothRead := make(chan struct{})
	read.Add(2)
	go func() { read.Wait(); close(bothRead) }()
	for i := range 2 {
		wg.Go(func() {
			errs[i] = s.inTx(ctx, "skew", pgx.ReadWrite, func(ctx context.Context, tx pgx.Tx) error {
				n := attempts[i].Add(1)
				var sum int64
				if err := tx.QueryRow(ctx, "SELECT sum(v) FROM "+skew).Scan(&sum); err != nil {
					return err
				}
				if n == 1 {
					read.Done()
					select {
					case <-bothRead:
					case <-time.After(10 * time.Second):
						return errors.New("the other transaction never read")
					}
				}
				_, err := tx.Exec(ctx, "UPDATE "+skew+" SET v = $1 WHERE id = $2", sum+1, i+1)
				return err
			})
		})
	}
	wg.Wait()

	for i, err := range errs {
		if err != nil {
			t.Errorf("transaction %d = %v; want nil (40001 retried)", i+1, err)
		}
	}
	if total := attempts[0].Load() + attempts[1].Load(); total < 3 {
		t.Errorf("attempts = %d + %d; want at least one retry (a serialization failure was forced)", attempts[0].Load(), attempts[1].Load())
	}
	rows, _ := s.pool.Query(ctx, "SELECT v FROM "+skew+" ORDER BY v")
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	// Serial: the first writes 0+1, the second reads 1 and writes 2. Both
	// reading 0 (the anomaly) would leave [1 1].
	if want := []int64{1, 2}; !slices.Equal(vs, want) {
		t.Errorf("values after both committed = %v; want %v (a serial order)", vs, want)
	}
}

// TestRetriesBounded: a transaction that keeps failing with 40001 runs
// MaxRetries+1 times, then fails with an error that still carries the
// 40001, so the caller's classifier treats it as retry-later.
func TestRetriesBounded(t *testing.T) {
	dsn := testDSN(t)
	s := open(t, Config{DSN: dsn, Schema: newSchema(t, dsn), MaxRetries: 3})
	defer s.Close()
	var n int
	err := s.inTx(t.Context(), "always conflicts", pgx.ReadOnly, func(context.Context, pgx.Tx) error {
		n++
		return &pgconn.PgError{Code: "40001", Message: "synthetic serialization failure"}
	})
	if n != 4 {
		t.Errorf("attempts = %d; want 4 (1 + MaxRetries 3)", n)
	}
	if sqlState(err) != "40001" {
		t.Errorf("inTx error = %v; want one wrapping SQLSTATE 40001", err)
	}

	// A non-retryable error is returned at once.
	n = 0
	boom := errors.New("boom")
	if err := s.inTx(t.Context(), "fails", pgx.ReadOnly, func(context.Context, pgx.Tx) error { n++; return boom }); !errors.Is(err, boom) || n != 1 {
		t.Errorf("inTx(non-retryable) = %v after %d attempts; want boom after 1", err, n)
	}
}
