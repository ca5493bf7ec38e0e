package approvals_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/approvals"
)

// countingMetrics counts what the queue reports, as "decision" and
// "action/status" keys.
type countingMetrics struct {
	mu          sync.Mutex
	decided     map[string]int
	answered    map[string]int
	unpublished int
}

func newCountingMetrics() *countingMetrics {
	return &countingMetrics{decided: map[string]int{}, answered: map[string]int{}}
}

func (m *countingMetrics) ApprovalDecided(decision string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.decided[decision]++
}

func (m *countingMetrics) ApprovalAnswered(action string, status int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.answered[action+"/"+http.StatusText(status)]++
}

func (m *countingMetrics) ApprovalsUnpublished(n int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.unpublished += n
}

// TestQueueMetrics: each decision taken is counted once, by the event it
// emitted, whoever took it (an approver, the timer); each answer of the
// API by action and status, an assertion refused included; and a
// decision whose events were not published as left to the sweep.
func TestQueueMetrics(t *testing.T) {
	f := newFixture(t)
	m := newCountingMetrics()
	svc := f.service(func(c *approvals.Config) { c.Metrics = m })
	approved, _ := f.refund("r-1")
	rejected, _ := f.refund("r-2")
	unpublished, _ := f.refund("r-3")
	f.refund("r-4") // expires

	if status, e := f.approveOverHTTP(svc, approved); status != http.StatusOK {
		t.Fatalf("approve: %d %+v", status, e)
	}
	if status, e := f.approveOverHTTP(svc, approved); status != http.StatusConflict {
		t.Fatalf("approve again: %d %+v; want 409", status, e)
	}
	srv := httptest.NewServer(svc.Handler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/v1/approvals")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("list without an assertion: %d; want 401", resp.StatusCode)
	}
	if _, err := svc.Reject(t.Context(), boss, approvals.ID(rejected), "not this one"); err != nil {
		t.Fatal(err)
	}
	f.pub.fail.Store(true)
	if _, err := svc.Approve(t.Context(), boss, approvals.ID(unpublished), f.record(unpublished).ArgumentsHash); err != nil {
		t.Fatal(err)
	}
	f.pub.fail.Store(false)
	f.clock.Advance(time.Hour)
	if n, err := svc.ExpireDue(t.Context()); err != nil || n != 1 {
		t.Fatalf("ExpireDue = %d, %v; want the one approval left expired", n, err)
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	if want := map[string]int{"approved": 2, "rejected": 1, "expired": 1}; !maps.Equal(m.decided, want) {
		t.Errorf("decisions counted %v; want %v", m.decided, want)
	}
	if want := map[string]int{"approve/OK": 1, "approve/Conflict": 1, "list/Unauthorized": 1}; !maps.Equal(m.answered, want) {
		t.Errorf("answers counted %v; want %v", m.answered, want)
	}
	if m.unpublished != 1 {
		t.Errorf("unpublished decisions counted %d; want 1", m.unpublished)
	}
}

// TestPendingIsTheLastWholePass: Pending reports what the timer's last
// whole pass over the pending approvals saw, page by page: nothing
// before one ended, then how many and the oldest's request time; an
// approval decided since, or expired by the pass, is not counted by the
// next.
func TestPendingIsTheLastWholePass(t *testing.T) {
	f := newFixture(t)
	svc := f.service(func(c *approvals.Config) { c.ExpireBatch = 2 })
	keys := f.refunds("p", 5)
	requested := func(id string) time.Time {
		a, err := svc.Get(t.Context(), boss, id)
		if err != nil {
			t.Fatal(err)
		}
		return a.RequestedAt
	}
	oldest, second := requested(keys[0]), requested(keys[1])
	if !oldest.Before(second) {
		t.Fatalf("the first refund was requested at %s, not before the second's %s", oldest, second)
	}
	// The pass starts after the records were written, as a timer's
	// does: one that reached records newer than its start would end.
	f.clock.Advance(time.Minute)
	round := func() {
		t.Helper()
		if _, err := svc.ExpireDue(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	wantPending := func(step string, n int, at time.Time) {
		t.Helper()
		gotN, gotAt := svc.Pending()
		if gotN != n || !gotAt.Equal(at) {
			t.Errorf("%s: Pending() = %d, %s; want %d, %s", step, gotN, gotAt, n, at)
		}
	}

	round() // 2 of 5: the pass goes on
	wantPending("a pass not yet ended", 0, time.Time{})
	round() // 4 of 5
	wantPending("a pass not yet ended", 0, time.Time{})
	round() // 5 of 5: a page not full ends the pass
	wantPending("a pass ended", 5, oldest)

	if _, err := svc.Approve(t.Context(), boss, keys[0], f.record(keyOf(t, keys[0])).ArgumentsHash); err != nil {
		t.Fatal(err)
	}
	f.clock.Advance(time.Minute)
	for range 3 { // pages of 2, 2 and none
		round()
	}
	wantPending("after the oldest was approved", 4, second)

	f.clock.Advance(time.Hour)
	for range 3 { // every one expires
		round()
	}
	wantPending("after every one expired", 0, time.Time{})
}

// keyOf is the call key of approval id.
func keyOf(t *testing.T, id string) ledger.CallKey {
	t.Helper()
	k, err := approvals.ParseID(id)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// failingList is the store, whose status listings fail while fail is
// set, and hang until their ctx ends while hang is.
type failingList struct {
	approvals.Store
	fail, hang *atomic.Bool
}

var errListing = errors.New("listing refused")

func (s failingList) ByStatusAfter(ctx context.Context, st processors.Status, after processors.Cursor, limit int) ([]processors.Record, error) {
	if s.hang != nil && s.hang.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if s.fail.Load() {
		return nil, errListing
	}
	return s.Store.ByStatusAfter(ctx, st, after, limit)
}

// TestTimerErrIsTheLastRound: TimerErr says the timer's last round
// failed, with its error, for as long as the rounds fail, and nothing
// once one works again.
func TestTimerErrIsTheLastRound(t *testing.T) {
	f := newFixture(t)
	var fail atomic.Bool
	fail.Store(true)
	svc := f.service(func(c *approvals.Config) { c.Store = failingList{Store: f.store, fail: &fail} })
	if err := svc.TimerErr(); err != nil {
		t.Fatalf("TimerErr before any round: %v; want nil", err)
	}
	startTimer(t, svc)
	waitTimerErr(t, svc, "the listing's error", func(err error) bool { return errors.Is(err, errListing) })
	fail.Store(false)
	waitTimerErr(t, svc, "nil once a round works", func(err error) bool { return err == nil })
}

// startTimer runs svc's timer every 5 ms until the test ends.
func startTimer(t *testing.T, svc *approvals.Service) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	done := make(chan error, 1)
	go func() { done <- svc.RunTimer(ctx, 5*time.Millisecond) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// waitTimerErr waits for svc.TimerErr() to be what ok accepts.
func waitTimerErr(t *testing.T, svc *approvals.Service, what string, ok func(error) bool) {
	t.Helper()
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if err := svc.TimerErr(); !ok(err) {
			return fmt.Errorf("TimerErr() = %v; want %s", err, what)
		}
		return nil
	})
}

// TestTimerRoundThatHangs: a store read that hangs fails the timer's
// round at its RoundTimeout (TimerErr says so), and meanwhile Pending and
// TimerErr, which every scrape and readiness probe asks, still answer.
// Before, they waited on the lock the hanging round held.
func TestTimerRoundThatHangs(t *testing.T) {
	f := newFixture(t)
	f.refund("r-1")
	var fail, hang atomic.Bool
	svc := f.service(func(c *approvals.Config) {
		c.Store = failingList{Store: f.store, fail: &fail, hang: &hang}
		c.RoundTimeout = 300 * time.Millisecond
	})
	f.clock.Advance(time.Minute)
	for range 2 { // a whole pass: the page, then one not full
		if _, err := svc.ExpireDue(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	if n, _ := svc.Pending(); n != 1 {
		t.Fatalf("Pending() = %d before the store hangs; want 1", n)
	}
	hang.Store(true)
	startTimer(t, svc)
	// The round hangs (for RoundTimeout) from about now; each asking
	// must answer within it, well before the round gives up.
	for range 5 {
		answered := make(chan struct{})
		go func() {
			svc.Pending()
			_ = svc.TimerErr()
			close(answered)
		}()
		select {
		case <-answered:
		case <-time.After(10 * time.Second):
			t.Fatal("Pending and TimerErr did not answer while a timer round hung")
		}
		time.Sleep(20 * time.Millisecond)
	}
	waitTimerErr(t, svc, "the round's deadline exceeded", func(err error) bool { return errors.Is(err, context.DeadlineExceeded) })
	if n, _ := svc.Pending(); n != 1 {
		t.Errorf("Pending() = %d while the rounds fail; want the last whole pass's 1", n)
	}
}
