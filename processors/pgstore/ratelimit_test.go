package pgstore

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// TestRateLimitAcrossPools is the cross-instance guarantee: intake
// instances in different processes (here two stores, two pools) sharing a
// bucket admit exactly Limit uses between them, with no errors (their
// serialization failures are retried), in single-bucket and in
// multi-bucket batches taken in opposite orders.
func TestRateLimitAcrossPools(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	a := open(t, Config{DSN: dsn, Schema: schema, MaxConns: 8})
	defer a.Close()
	b := open(t, Config{DSN: dsn, Schema: schema, MaxConns: 8, SkipMigrate: true})
	defer b.Close()

	const (
		callers = 40
		limit   = 10
	)
	x := processors.RateRequest{Bucket: "t_acme/refund_order", Limit: limit, Window: time.Hour}
	y := processors.RateRequest{Bucket: "t_acme/send_email", Limit: limit, Window: time.Hour}
	z := processors.RateRequest{Bucket: "t_other/refund_order", Limit: limit, Window: time.Hour}
	batches := [][]processors.RateRequest{{x}, {y, z}, {z, y}, {x, z}}

	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		allowed = map[string]int{}
		perPool [2]int
		errs    []error
	)
	start := make(chan struct{})
	for i := range callers {
		s, pool := a, 0
		if i%2 == 1 {
			s, pool = b, 1
		}
		rs := batches[i%len(batches)]
		wg.Go(func() {
			<-start
			got, err := s.Take(t.Context(), rs)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("caller %d: %w", i, err))
				return
			}
			for j, res := range got {
				if res.Allowed {
					allowed[rs[j].Bucket]++
					perPool[pool]++
				}
			}
		})
	}
	close(start)
	wg.Wait()

	for _, err := range errs {
		t.Errorf("Take = %v; want no error (serialization failures retried)", err)
	}
	want := map[string]int{x.Bucket: limit, y.Bucket: limit, z.Bucket: limit}
	if diff := cmp.Diff(want, allowed); diff != "" {
		t.Errorf("allowed per bucket over two pools (-want +got):\n%s", diff)
	}
	if perPool[0] == 0 || perPool[1] == 0 {
		// Not a limiter failure, but then the test proved nothing about
		// sharing.
		t.Errorf("allowed per pool = %v; want both pools to have been admitted some", perPool)
	}
	// Either instance sees the other's uses.
	for _, s := range []*Store{a, b} {
		got, err := s.Take(t.Context(), []processors.RateRequest{x})
		if err != nil || got[0].Allowed {
			t.Errorf("Take after the race = %+v, %v; want refused", got, err)
		}
	}
}

// TestRateLimitTable: the state is one row per bucket in the schema's
// rate_limits table, with the database's clock: the tat of a fresh bucket
// after one use is one interval after the database's now().
func TestRateLimitTable(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	s := open(t, Config{DSN: dsn, Schema: schema})
	defer s.Close()
	ctx := t.Context()

	r := processors.RateRequest{Bucket: "t_acme/refund_order", Limit: 4, Window: time.Hour}
	if _, err := s.Take(ctx, []processors.RateRequest{r, r}); err != nil {
		t.Fatal(err)
	}
	var n, secs int64
	err := s.pool.QueryRow(ctx, "SELECT count(*), max(extract(epoch FROM tat - now()))::BIGINT FROM "+s.rateTable()).Scan(&n, &secs)
	if err != nil {
		t.Fatal(err)
	}
	ahead := time.Duration(secs) * time.Second
	// Two uses of 15 minutes each, minus the seconds the test took.
	if n != 1 || ahead < 29*time.Minute || ahead > 30*time.Minute {
		t.Errorf("rate_limits = %d rows, tat %v ahead of now(); want 1 row, tat about 30m ahead", n, ahead)
	}
	// A second Migrate leaves the table and its rows alone.
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate() again = %v", err)
	}
	got, err := s.Take(ctx, []processors.RateRequest{r, r, r})
	if err != nil {
		t.Fatal(err)
	}
	if got[0].Allowed != true || got[1].Allowed != true || got[2].Allowed != false {
		t.Errorf("Take(3 more of limit 4 after 2) after Migrate = %+v; want allowed, allowed, refused", got)
	}
}

// TestRateLimitErrorsKeepSecrets: whatever goes wrong in Take, its error
// never carries the DSN's password. The test server trusts loopback, so a
// canary password in the DSN does not stop the store from opening.
func TestRateLimitErrorsKeepSecrets(t *testing.T) {
	const canary = "canary-pw-7f3a9c"
	dsn := testDSN(t)
	u, err := url.Parse(dsn)
	if err != nil || u.User == nil {
		t.Fatalf("LEDGER_TEST_PG_DSN is not a URL with a user; cannot place a canary password")
	}
	u.User = url.UserPassword(u.User.Username(), canary)
	s, err := Open(t.Context(), Config{DSN: u.String(), Schema: newSchema(t, dsn)})
	if err != nil {
		if strings.Contains(err.Error(), canary) {
			t.Fatalf("Open error leaks the password: %v", err)
		}
		t.Fatalf("Open(DSN with a password) = %v; the test server must accept it (trust auth)", err)
	}

	valid := processors.RateRequest{Bucket: "t_acme/refund_order", Limit: 1, Window: time.Hour}
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	var errs []error
	if _, err := s.Take(t.Context(), []processors.RateRequest{valid, {Bucket: "", Limit: 1, Window: time.Hour}}); err != nil {
		errs = append(errs, err)
	}
	if _, err := s.Take(cancelled, []processors.RateRequest{valid}); err != nil {
		errs = append(errs, err)
	}
	s.Close()
	if _, err := s.Take(t.Context(), []processors.RateRequest{valid}); err != nil {
		errs = append(errs, err)
	}
	if len(errs) != 3 {
		t.Fatalf("got %d errors from invalid, cancelled and closed Takes; want 3", len(errs))
	}
	for _, err := range errs {
		if strings.Contains(err.Error(), canary) || strings.Contains(fmt.Sprintf("%+v", err), canary) {
			t.Errorf("Take error %q leaks the DSN's password", err)
		}
	}
}

// TestAdmitChargedSkipsAKeyInsertedMeanwhile: at READ COMMITTED, a key
// that another transaction inserts between the charged batch's read and
// its insert (charged to another bucket, or to none) is answered against
// that record, and its charge is undone before the commit: the buckets
// hold the charges of the admissions inserted, no more, and the fresh
// key's charges to both its buckets stand.
func TestAdmitChargedSkipsAKeyInsertedMeanwhile(t *testing.T) {
	s, logs := openRelaxed(t)
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
	fresh := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "fresh"}
	r := processors.RateRequest{Bucket: "t_acme/x/2/h/p", Limit: 2, Window: time.Hour}
	q := processors.RateRequest{Bucket: "t_acme/x/1/h/q", Limit: 1, Window: time.Hour}
	res := admitWhileInserted(t, s, k, []processors.Admission{
		{Key: fresh, CallID: "c_fresh", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized, Seq: 2, Rates: []processors.RateRequest{r, q}},
		{Key: k, CallID: "c_second", ArgumentsHash: "h", Tool: "x", Status: processors.StatusAuthorized, Seq: 2, Rates: []processors.RateRequest{r}},
	})
	if len(res) != 2 || res[0].Outcome != processors.Admitted || res[1].Outcome != processors.Duplicate || res[1].Record.CallID != "c_first" {
		t.Fatalf("Admit() = %+v; want the fresh key admitted and a Duplicate of call c_first", res)
	}
	if want := []processors.RateResult{{Allowed: true, Remaining: 1}, {Allowed: true, Remaining: 0}}; !cmp.Equal(want, res[0].Rates) {
		t.Errorf("fresh key's charges = %+v; want %+v (the only ones)", res[0].Rates, want)
	}
	// One charge of two on r, the fresh key's on q: one use of r left,
	// none of q.
	left, err := s.Take(t.Context(), []processors.RateRequest{r, r, q})
	if err != nil {
		t.Fatal(err)
	}
	if !left[0].Allowed || left[1].Allowed || left[2].Allowed {
		t.Errorf("Take(r, r, q) after the batch = %+v; want one allowed, then refused twice: the skipped key uncharged, the fresh one charged", left)
	}
	if strings.Contains(logs.String(), "transaction retry") {
		t.Errorf("Admit was retried:\n%s", logs.String())
	}
}
