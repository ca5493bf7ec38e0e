package executor_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// byCall groups a step's events by call: "t_a/k" -> executing, succeeded.
func byCall(t *testing.T, recs []*kgo.Record) map[string][]string {
	t.Helper()
	m := map[string][]string{}
	for _, e := range decodeAll(t, recs) {
		m[e.Key().String()] = append(m[e.Key().String()], summary([]ledger.Event{e})...)
	}
	return m
}

// stepUntil runs empty steps, committing each, until the calls of want
// all have events, and returns the events they got.
func stepUntil(t *testing.T, x *executor.Executor, timeout time.Duration, want ...string) map[string][]string {
	t.Helper()
	got := map[string][]string{}
	ledgertest.WaitFor(t, timeout, func() error {
		out, err := x.Step(t.Context(), nil)
		if err != nil {
			return err
		}
		for k, evs := range byCall(t, out.Records) {
			got[k] = append(got[k], evs...)
		}
		if out.Committed != nil {
			if err := out.Committed(t.Context()); err != nil {
				return err
			}
		}
		for _, k := range want {
			if _, ok := got[k]; !ok {
				return fmt.Errorf("no events yet for %s", k)
			}
		}
		return nil
	})
	return got
}

var ticket = map[string]any{"title": "t"}

// note is a notify call's arguments.
var note = map[string]any{"to": "a@example.com", "subject": "s"}

// admitNotes admits n notify calls of tenant, keyed prefix-0, prefix-1...,
// and returns their authorized events and their keys.
func (r *rig) admitNotes(tenant, prefix string, n int, deadlineMS int64) (recs []*kgo.Record, keys []string) {
	for i := range n {
		key := fmt.Sprintf("%s-%d", prefix, i)
		recs = append(recs, r.admitAs(tenant, "notify", key, note, deadlineMS))
		keys = append(keys, tenant+"/"+key)
	}
	return recs, keys
}

// A call slower than the step budget does not hold up the others of its
// batch: the step returns with their events, and the slow call's events
// come with a later step, with no new record to bring them.
func TestSlowCallCarriedOver(t *testing.T) {
	r := newRig(t)
	// Slow, but within create_ticket's 2s timeout.
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: 1200 * time.Millisecond})
	x := r.executor(func(c *executor.Config) { c.StepBudget = 300 * time.Millisecond })
	slow := r.admitAs("t_slow", "create_ticket", "slow", ticket, 0)
	fast := r.admitAs("t_a", "create_ticket", "fast", ticket, 0)

	start := time.Now()
	out, err := x.Step(t.Context(), []*kgo.Record{slow, fast})
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string][]string{"t_a/fast": {"executing", "succeeded"}}, byCall(t, out.Records)); diff != "" {
		t.Errorf("first step's events (-want +got):\n%s", diff)
	}
	if took > 900*time.Millisecond {
		t.Errorf("the step took %v; want about its 300ms budget, not the slow call's 1.2s", took)
	}
	if err := out.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}

	later := stepUntil(t, x, 10*time.Second, "t_slow/slow")
	if diff := cmp.Diff(map[string][]string{"t_slow/slow": {"executing", "succeeded"}}, later); diff != "" {
		t.Errorf("later steps' events (-want +got):\n%s", diff)
	}
	for _, k := range []string{"t_a/fast", "t_slow/slow"} {
		key, _ := ledger.ParseCallKey(k)
		rec, err := r.store.Get(t.Context(), key)
		if err != nil {
			t.Fatal(err)
		}
		if rec.Status != processors.StatusSucceeded || rec.Unlogged() {
			t.Errorf("%s record %s (unlogged %v); want succeeded and logged", k, rec.Status, rec.Unlogged())
		}
		if n := r.backend.AppliedIn("create_ticket", key.TenantID, k); n != 1 {
			t.Errorf("%s applied %d times; want 1", k, n)
		}
	}
}

// Once a tenant's call to a tool runs past the budget, steps stop waiting
// for that tenant's new calls to it, so its next slow call costs the
// other tenants nothing.
func TestSlowTenantsNextCallsNotWaitedFor(t *testing.T) {
	r := newRig(t)
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: 1500 * time.Millisecond})
	budget := 600 * time.Millisecond
	x := r.executor(func(c *executor.Config) { c.StepBudget = budget })

	out, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_slow", "create_ticket", "slow-1", ticket, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 0 {
		t.Errorf("first step appended %v; want nothing yet", byCall(t, out.Records))
	}

	start := time.Now()
	out, err = x.Step(t.Context(), []*kgo.Record{
		r.admitAs("t_slow", "create_ticket", "slow-2", ticket, 0),
		r.admitAs("t_a", "create_ticket", "fast", ticket, 0),
	})
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string][]string{"t_a/fast": {"executing", "succeeded"}}, byCall(t, out.Records)); diff != "" {
		t.Errorf("second step's events (-want +got):\n%s", diff)
	}
	if took >= budget*8/10 {
		t.Errorf("the second step took %v; want it done with the fast call, well before the %v budget", took, budget)
	}
	if err := out.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	later := stepUntil(t, x, 10*time.Second, "t_slow/slow-1", "t_slow/slow-2")
	want := map[string][]string{"t_slow/slow-1": {"executing", "succeeded"}, "t_slow/slow-2": {"executing", "succeeded"}}
	if diff := cmp.Diff(want, later); diff != "" {
		t.Errorf("later steps' events (-want +got):\n%s", diff)
	}
}

// A tenant whose calls hang holds at most its share of the tool's
// bulkhead while another tenant uses the tool: the other tenant's call
// still runs at once. With one bulkhead for all (a share of 1), or when
// the hanging tenant was alone on the tool until then (a lone tenant may
// use the whole bulkhead), the same call waits for a slot.
func TestTenantShareLeavesSlotsForOthers(t *testing.T) {
	for _, tc := range []struct {
		name        string
		share       float64
		otherBefore bool  // the other tenant called the tool before the hang
		inFlight    int64 // the hanging tenant's requests at the tool
		fastNow     bool  // the other tenant's call ends in its own step
	}{
		// notify's bulkhead is 4: a share of 0.25 is one slot.
		{"shares", 0.25, true, 1, true},
		{"one bulkhead", 1, true, 4, false},
		{"alone until then", 0.25, false, 4, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			r.backend.SetTenantFault("send_email", "t_slow", demobackend.Fault{Hang: true})
			x := r.executor(func(c *executor.Config) {
				c.StepBudget = 200 * time.Millisecond
				c.TenantShare = tc.share
				c.MaxAttempts = 1
				// A call whose slot comes too late in its lease is
				// given back, and claimed again by the sweep.
				c.SweepEvery = 100 * time.Millisecond
			})
			var before int64
			if tc.otherBefore {
				out, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_a", "notify", "before", note, 0)})
				if err != nil {
					t.Fatal(err)
				}
				if diff := cmp.Diff(map[string][]string{"t_a/before": {"executing", "succeeded"}}, byCall(t, out.Records)); diff != "" {
					t.Fatalf("other tenant's first call (-want +got):\n%s", diff)
				}
				before = 1
			}
			hung, keys := r.admitNotes("t_slow", "hung", 4, 1500)
			out, err := x.Step(t.Context(), hung)
			if err != nil {
				t.Fatal(err)
			}
			if len(out.Records) != 0 {
				t.Fatalf("the hanging calls' step appended %v; want nothing yet", byCall(t, out.Records))
			}
			ledgertest.WaitFor(t, 5*time.Second, func() error {
				if n := r.backend.Requests() - before; n != tc.inFlight {
					return fmt.Errorf("%d hanging requests at the tool; want %d", n, tc.inFlight)
				}
				return nil
			})

			out, err = x.Step(t.Context(), []*kgo.Record{r.admitAs("t_a", "notify", "fast", note, 0)})
			if err != nil {
				t.Fatal(err)
			}
			got := byCall(t, out.Records)
			if tc.fastNow {
				if diff := cmp.Diff(map[string][]string{"t_a/fast": {"executing", "succeeded"}}, got); diff != "" {
					t.Errorf("other tenant's step (-want +got):\n%s", diff)
				}
			} else if len(got) != 0 {
				t.Errorf("other tenant's step appended %v; want nothing, its call waiting for a slot", got)
			}
			if out.Committed != nil { // nil when the step recorded nothing
				if err := out.Committed(t.Context()); err != nil {
					t.Fatal(err)
				}
			}
			// Nothing is lost: every call ends, the hanging ones at
			// their deadline.
			if !tc.fastNow {
				keys = append(keys, "t_a/fast")
			}
			later := stepUntil(t, x, 10*time.Second, keys...)
			for _, k := range keys {
				evs := later[k]
				switch {
				case k == "t_a/fast":
					if diff := cmp.Diff([]string{"executing", "succeeded"}, evs); diff != "" {
						t.Errorf("%s (-want +got):\n%s", k, diff)
					}
				case len(evs) != 2 || evs[0] != "executing" || evs[1] == "succeeded":
					t.Errorf("%s: %v; want executing and an end at the deadline", k, evs)
				}
			}
		})
	}
}

// One tenant's failures open its own breaker for the tool, not the
// other tenants'.
func TestBreakerPerTenant(t *testing.T) {
	r := newRig(t)
	r.backend.SetTenantFault("create_ticket", "t_bad", demobackend.Fault{FailStatus: 503})
	x := r.executor(func(c *executor.Config) {
		c.MaxAttempts = 1
		c.Breaker = executor.BreakerConfig{MinRequests: 3, FailureRatio: 0.5, OpenFor: time.Hour}
	})
	var codes []string
	for i := range 4 {
		out, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_bad", "create_ticket", fmt.Sprintf("bad-%d", i), ticket, 0)})
		if err != nil {
			t.Fatal(err)
		}
		evs := decodeAll(t, out.Records)
		codes = append(codes, evs[len(evs)-1].ErrorCode)
	}
	if diff := cmp.Diff([]string{"http_503", "http_503", "http_503", "breaker_open"}, codes); diff != "" {
		t.Errorf("failing tenant's error codes (-want +got):\n%s", diff)
	}
	out, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_a", "create_ticket", "good", ticket, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string][]string{"t_a/good": {"executing", "succeeded"}}, byCall(t, out.Records)); diff != "" {
		t.Errorf("other tenant's call (-want +got):\n%s", diff)
	}
	want := map[string]string{"create_ticket/t_bad": "open", "create_ticket/t_a": "closed"}
	if diff := cmp.Diff(want, x.BreakerStates()); diff != "" {
		t.Errorf("breaker states (-want +got):\n%s", diff)
	}
}

// A request the adapter refuses to send (ErrInvalidRequest: here a
// credential over plain http off loopback) says nothing of the tool, and
// does not count toward its breaker: the tenant's other calls are not
// refused breaker_open for it. Before, such refusals counted as the
// tool's failures and opened the tenant's breaker. Nor is it counted as
// a request that failed at the tool (ledger_tool_call_duration_seconds'
// result error): it is one not sent.
func TestBreakerIgnoresRequestsNeverSent(t *testing.T) {
	r := newRig(t)
	broker, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	reg := metrics.New("executor", nil)
	x := r.executor(func(c *executor.Config) {
		c.MaxAttempts, c.Metrics = 1, reg
		c.Breaker = executor.BreakerConfig{MinRequests: 3, FailureRatio: 0.5, OpenFor: time.Hour}
		// A documentation address: never dialled, the adapter refuses
		// to send a credential there in clear.
		c.BaseURL, c.Credentials = "http://192.0.2.1:9", broker
	})
	var codes []string
	for i := range 4 {
		out, err := x.Step(t.Context(), []*kgo.Record{r.admit("create_ticket", fmt.Sprintf("unsendable-%d", i), ticket, 0)})
		if err != nil {
			t.Fatal(err)
		}
		evs := decodeAll(t, out.Records)
		codes = append(codes, evs[len(evs)-1].ErrorCode)
	}
	for i, code := range codes {
		if code == "breaker_open" {
			t.Errorf("call %d: %s; want the adapter's refusal, the breaker closed (codes %v)", i, code, codes)
		}
	}
	if st := x.BreakerStates()["create_ticket/t_a"]; st == "open" {
		t.Errorf("the tenant's breaker is %s; want closed", st)
	}
	results := map[string]float64{}
	for _, res := range []string{"not_sent", "error"} {
		results[res] = counter(t, reg, "ledger_tool_call_duration_seconds", "tool", "create_ticket", "result", res)
	}
	if diff := cmp.Diff(map[string]float64{"not_sent": 4, "error": 0}, results); diff != "" {
		t.Errorf("requests to the tool by result (-want +got):\n%s", diff)
	}
}

// Calls given back (an open breaker, say) are swept up again a page at a
// time, and a full page brings the next sweep a twenty-fifth of
// SweepEvery later, not SweepEvery later: a backlog drains at SweepLimit
// a fifth of a second by default. Before, one page a SweepEvery (100
// calls every 5 s), and a tenant's backlog after its breaker opened
// waited past the deadlines of calls that could run.
func TestGivenBackBacklogDrains(t *testing.T) {
	r := newRig(t)
	const calls = 6
	for i := range calls {
		auth := r.admit("create_ticket", fmt.Sprintf("back-%d", i), ticket, 0)
		ev := authorizedEvent(t, auth)
		cl, err := r.store.Claim(t.Context(), []processors.Claim{{Key: ev.Key(), ArgumentsHash: ev.ArgumentsHash, Owner: "x-first", Lease: time.Minute}})
		if err != nil || cl[0].Outcome != processors.Claimed {
			t.Fatalf("claim = %+v, %v", cl, err)
		}
		if applied, err := r.store.Release(t.Context(), []processors.Release{{Key: ev.Key(), Epoch: cl[0].Record.Epoch}}); err != nil || !applied[0] {
			t.Fatalf("release = %v, %v", applied, err)
		}
	}
	// A full page at the first sweep, and at the next: 100 ms apart.
	x := r.executor(func(c *executor.Config) { c.SweepLimit, c.SweepEvery = 2, 2500*time.Millisecond })
	succeeded := 0
	for end := time.Now().Add(time.Second); time.Now().Before(end) && succeeded < calls; time.Sleep(50 * time.Millisecond) {
		out, err := x.Step(t.Context(), nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range decodeAll(t, out.Records) {
			if e.Type == statemachine.EventSucceeded {
				succeeded++
			}
		}
	}
	if succeeded != calls {
		t.Errorf("%d of the %d calls given back ran within a second; want all (a page of 2 every 100 ms)", succeeded, calls)
	}
}

// At MaxInFlight calls in flight a step waits for one to end before it
// claims more, and hands out the ended call's events with its own.
func TestMaxInFlightBackPressure(t *testing.T) {
	r := newRig(t)
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: 500 * time.Millisecond})
	x := r.executor(func(c *executor.Config) {
		c.StepBudget = 50 * time.Millisecond
		c.MaxInFlight = 1
	})
	out, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_slow", "create_ticket", "slow", ticket, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 0 {
		t.Fatalf("first step appended %v; want nothing yet", byCall(t, out.Records))
	}
	out, err = x.Step(t.Context(), []*kgo.Record{r.admitAs("t_a", "create_ticket", "next", ticket, 0)})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{"t_slow/slow": {"executing", "succeeded"}, "t_a/next": {"executing", "succeeded"}}
	if diff := cmp.Diff(want, byCall(t, out.Records)); diff != "" {
		t.Errorf("second step's events (-want +got):\n%s", diff)
	}
}

// A call carried over when the executor shuts down is not lost: it runs
// to its end and records its outcome itself, Drain waits for that, and
// its events follow through the sweep of unlogged outcomes.
func TestShutdownRecordsCarriedCalls(t *testing.T) {
	r := newRig(t)
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: 500 * time.Millisecond})
	x := r.executor(func(c *executor.Config) { c.StepBudget = 50 * time.Millisecond })
	ctx, cancel := context.WithCancel(t.Context())
	out, err := x.Step(ctx, []*kgo.Record{r.admitAs("t_slow", "create_ticket", "slow", ticket, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 0 {
		t.Fatalf("step appended %v; want nothing yet", byCall(t, out.Records))
	}
	cancel() // the loop stops; no step will come
	dctx, dcancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer dcancel()
	if err := x.Drain(dctx); err != nil {
		t.Fatalf("drain: %v", err)
	}
	key := ledger.CallKey{TenantID: "t_slow", IdempotencyKey: "slow"}
	rec, err := r.store.Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status != processors.StatusSucceeded || !rec.Unlogged() {
		t.Fatalf("after shutdown the record is %s (unlogged %v); want succeeded, waiting for the log", rec.Status, rec.Unlogged())
	}
	next := r.executor(func(c *executor.Config) {
		c.SweepEvery = time.Nanosecond
		c.UnloggedGrace = time.Millisecond
	})
	got := stepUntil(t, next, 5*time.Second, key.String())
	if diff := cmp.Diff(map[string][]string{key.String(): {"executing", "succeeded"}}, got); diff != "" {
		t.Errorf("swept events (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_slow", key.String()); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// A call carried over when the loop stops with its context live (a step
// returned ledger.ErrStop: an event of a newer encoding) records its
// outcome once Drain begins, as at a shutdown: before, it waited for a
// step that would never come, Drain ran out its time, and the call was
// left to its lease, to be taken over as one that may have been sent,
// though this executor knew it had succeeded.
func TestStoppedLoopRecordsCarriedCalls(t *testing.T) {
	r := newRig(t)
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: 300 * time.Millisecond})
	x := r.executor(func(c *executor.Config) { c.StepBudget = 50 * time.Millisecond })
	out, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_slow", "create_ticket", "slow", ticket, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 0 {
		t.Fatalf("step appended %v; want nothing yet", byCall(t, out.Records))
	}
	newer := &kgo.Record{Topic: ledger.Topics{}.WithDefaults().Events, Key: []byte("t_a/newer"),
		Value:   []byte(`{"v":99,"type":"authorized","seq":2,"tenant_id":"t_a","idempotency_key":"newer"}`),
		Headers: []kgo.RecordHeader{{Key: ledger.HeaderEventType, Value: []byte("authorized")}}}
	if _, err := x.Step(t.Context(), []*kgo.Record{newer}); !errors.Is(err, ledger.ErrStop) {
		t.Fatalf("step: %v; want ErrStop", err)
	}
	dctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	if err := x.Drain(dctx); err != nil {
		t.Fatalf("drain: %v", err)
	}
	key := ledger.CallKey{TenantID: "t_slow", IdempotencyKey: "slow"}
	if rec, err := r.store.Get(t.Context(), key); err != nil || rec.Status != processors.StatusSucceeded || !rec.Unlogged() {
		t.Fatalf("after the drain the record is %s, unlogged %v (%v); want succeeded, waiting for the log", rec.Status, rec.Unlogged(), err)
	}
}

// A finished call's outcome that no step takes within HandoffWait (steps
// stalled: a Kafka session restarting) is recorded by the call itself,
// before its lease may lapse; a later step no longer waits for it. Before,
// it waited for a step however long, and a takeover after its lease found
// a call whose outcome was known as one that may have been sent.
func TestOutcomeRecordedWhenNoStepTakesIt(t *testing.T) {
	r := newRig(t)
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: 200 * time.Millisecond})
	x := r.executor(func(c *executor.Config) {
		c.StepBudget = 20 * time.Millisecond
		c.HandoffWait = 100 * time.Millisecond
	})
	out, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_slow", "create_ticket", "slow", ticket, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 0 {
		t.Fatalf("step appended %v; want nothing yet", byCall(t, out.Records))
	}
	key := ledger.CallKey{TenantID: "t_slow", IdempotencyKey: "slow"}
	ledgertest.WaitFor(t, 5*time.Second, func() error {
		rec, err := r.store.Get(t.Context(), key)
		if err != nil {
			return err
		}
		if rec.Status != processors.StatusSucceeded || !rec.Unlogged() {
			return fmt.Errorf("with no step the record is %s, unlogged %v; want succeeded, waiting for the log", rec.Status, rec.Unlogged())
		}
		return nil
	})
	if n, _ := x.InFlight(); n != 0 {
		t.Errorf("%d calls in flight after the call recorded itself; want 0", n)
	}
	// The next step neither waits for it nor appends its events: they
	// come from the sweep of unlogged outcomes, once.
	out, err = x.Step(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 0 {
		t.Errorf("the next step appended %v; want nothing (the sweep appends them)", byCall(t, out.Records))
	}
	if n := r.backend.AppliedIn("create_ticket", "t_slow", key.String()); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// A step that waits for its calls (here for all of them, StepBudget < 0)
// stops waiting for one that recorded its outcome itself: with the
// shortest HandoffWait, calls record themselves before the step is
// ready to take them. Before, such a step waited for ever.
func TestStepDoesNotWaitForACallThatRecordedItself(t *testing.T) {
	r := newRig(t)
	x := r.executor(func(c *executor.Config) { c.HandoffWait = time.Nanosecond })
	for i := range 5 {
		key := fmt.Sprintf("self-%d", i)
		done := make(chan error, 1)
		go func() {
			_, err := x.Step(t.Context(), []*kgo.Record{r.admit("create_ticket", key, ticket, 0)})
			done <- err
		}()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the step still waits 10s on", key)
		}
		if rec, err := r.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: key}); err != nil || rec.Status != processors.StatusSucceeded {
			t.Fatalf("%s: the record is %s (%v); want succeeded", key, rec.Status, err)
		}
	}
}

// failingClaims is the store, except that Claim fails while fail is set.
type failingClaims struct {
	executor.Store
	fail bool
}

func (s *failingClaims) Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error) {
	if s.fail {
		return nil, errors.New("store unavailable")
	}
	return s.Store.Claim(ctx, cs)
}

// carrySlowCall returns an executor on st with one slot (MaxInFlight 1),
// after a step that left a slow call t_slow/slow running: the next step
// waits for its slot, and takes its outcome.
func carrySlowCall(t *testing.T, r *rig, st executor.Store) *executor.Executor {
	t.Helper()
	r.backend.SetTenantFault("create_ticket", "t_slow", demobackend.Fault{Latency: 300 * time.Millisecond})
	x := r.executor(func(c *executor.Config) {
		c.Store = st
		c.StepBudget = 50 * time.Millisecond
		c.MaxInFlight = 1
	})
	out, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_slow", "create_ticket", "slow", ticket, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 0 {
		t.Fatalf("first step appended %v; want nothing yet", byCall(t, out.Records))
	}
	return x
}

// failingCompletes is the store, except that the next fail Completes
// fail without recording anything (a connection reset before the write).
type failingCompletes struct {
	executor.Store
	fail atomic.Int32
}

func (s *failingCompletes) Complete(ctx context.Context, cs []processors.Completion) ([]bool, error) {
	if s.fail.Add(-1) >= 0 {
		return nil, errors.New("connection reset")
	}
	return s.Store.Complete(ctx, cs)
}

// A call's known outcome whose recording fails is recorded once more on
// its own, unlogged, so that the sweep appends its events: left to its
// lease, it would come back as a call that may have run, for the
// reconciler or a human. Both when the step records it after its batch
// ran, and when it records it beside the next batch's claim.
func TestFailedRecordingTriedAgainOnItsOwn(t *testing.T) {
	check := func(t *testing.T, r *rig, key ledger.CallKey) {
		t.Helper()
		rec, err := r.store.Get(t.Context(), key)
		if err != nil {
			t.Fatal(err)
		}
		if rec.Status != processors.StatusSucceeded || !rec.Unlogged() {
			t.Errorf("the record is %s (unlogged %v); want succeeded, waiting for the log", rec.Status, rec.Unlogged())
		}
	}
	t.Run("after the batch", func(t *testing.T) {
		r := newRig(t)
		st := &failingCompletes{Store: r.store}
		x := r.executor(func(c *executor.Config) { c.Store = st })
		st.fail.Store(1)
		if _, err := x.Step(t.Context(), []*kgo.Record{r.admit("create_ticket", "k1", ticket, 0)}); err == nil {
			t.Fatal("step whose recording failed returned no error")
		}
		check(t, r, ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"})
	})
	t.Run("beside the next claim", func(t *testing.T) {
		r := newRig(t)
		st := &failingCompletes{Store: r.store}
		x := carrySlowCall(t, r, st)
		st.fail.Store(1)
		if _, err := x.Step(t.Context(), []*kgo.Record{r.admit("create_ticket", "next", ticket, 0)}); err != nil {
			t.Fatal(err)
		}
		check(t, r, ledger.CallKey{TenantID: "t_slow", IdempotencyKey: "slow"})
	})
}

// A step that fails after it took a carried call's outcome (here: it
// waited for it at MaxInFlight, then could not claim its batch) records
// the outcome before it returns, so that the sweep appends its events:
// the failed step's batch is redelivered, the carried call's event is
// not. Its recording failing too (the same store blip), it is recorded
// once more on its own: before, the step returned on the claim's error
// and left it to its lease, to come back as a call that may have run.
func TestFailedStepRecordsTheOutcomesItTook(t *testing.T) {
	for _, recordingFails := range []bool{false, true} {
		t.Run(fmt.Sprintf("recording fails %v", recordingFails), func(t *testing.T) { testFailedStepRecordsTheOutcomesItTook(t, recordingFails) })
	}
}

func testFailedStepRecordsTheOutcomesItTook(t *testing.T, recordingFails bool) {
	r := newRig(t)
	completes := &failingCompletes{Store: r.store}
	st := &failingClaims{Store: completes}
	x := carrySlowCall(t, r, st)
	st.fail = true
	if recordingFails {
		completes.fail.Store(1)
	}
	if _, err := x.Step(t.Context(), []*kgo.Record{r.admitAs("t_a", "create_ticket", "next", ticket, 0)}); err == nil {
		t.Fatal("step with a failing store returned no error")
	}
	key := ledger.CallKey{TenantID: "t_slow", IdempotencyKey: "slow"}
	rec, err := r.store.Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status != processors.StatusSucceeded || !rec.Unlogged() {
		t.Fatalf("after the failed step the record is %s (unlogged %v); want succeeded, waiting for the log", rec.Status, rec.Unlogged())
	}
	st.fail = false
	next := r.executor(func(c *executor.Config) {
		c.SweepEvery = time.Nanosecond
		c.UnloggedGrace = time.Millisecond
	})
	got := stepUntil(t, next, 5*time.Second, key.String())
	// The failed step's call ran nowhere. Its admission is not marked
	// logged until a claim or the intake's later mark (MarkDelay), so a
	// sweep with a grace this short may append its intake events again.
	want := map[string][]string{key.String(): {"executing", "succeeded"}}
	if _, ok := got["t_a/next"]; ok {
		want["t_a/next"] = []string{"requested", "authorized(allowed)"}
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("swept events (-want +got):\n%s", diff)
	}
}

// A call whose claim's lease runs out while it waits for a slot of the
// tool's bulkhead is given back, nothing sent, and runs under a claim of
// its own later. Here one tenant's eight notify calls (no idempotency
// key; a bulkhead of 4, a 2 s timeout and so a lease of about 2 s) meet
// a tool that takes 1.5 s: the last four get their slots with half a
// second of their leases left. Before, they were sent then, timed out,
// and ended outcome_unknown, to be settled by a human, though the tool
// had applied nothing.
func TestSlotTooLateInTheLeaseGivesTheCallBack(t *testing.T) {
	r := newRig(t)
	r.backend.SetTenantFault("send_email", "t_a", demobackend.Fault{Latency: 1500 * time.Millisecond})
	x := r.executor(func(c *executor.Config) {
		c.MaxAttempts = 1
		c.SweepEvery = 100 * time.Millisecond
	})
	recs, keys := r.admitNotes("t_a", "late", 8, 0)
	out, err := x.Step(t.Context(), recs)
	if err != nil {
		t.Fatal(err)
	}
	got := byCall(t, out.Records)
	if len(got) != 4 {
		t.Errorf("the first step ended %d calls (%v); want the 4 that had slots at once", len(got), got)
	}
	if err := out.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	var back []string
	for _, k := range keys {
		if _, ok := got[k]; !ok {
			back = append(back, k)
		}
	}
	for k, evs := range stepUntil(t, x, 20*time.Second, back...) {
		got[k] = append(got[k], evs...)
	}
	for _, k := range keys {
		if diff := cmp.Diff([]string{"executing", "succeeded"}, got[k]); diff != "" {
			t.Errorf("%s (-want +got):\n%s", k, diff)
		}
		if n := r.backend.AppliedIn("send_email", "t_a", k); n != 1 {
			t.Errorf("%s applied %d times; want 1", k, n)
		}
	}
	if n := r.backend.Requests(); n != 8 {
		t.Errorf("%d requests reached the tool; want 8, one a call", n)
	}
}

// A call that cannot be given back (here one whose first attempt may
// have reached the tool: a 503 from a tool that dedupes by key) is sent
// when its slot comes late in its lease, with what is left: its retry
// under the key is how its outcome is found. Before, it was held back
// like a call that can be given back, and ended outcome_unknown.
func TestSlotTooLateForACallThatCannotBeGivenBackIsSent(t *testing.T) {
	r := newRig(t)
	r.backend.SetTenantFault("create_ticket", "t_k", demobackend.Fault{FailStatus: 503, FailTimes: 1})
	r.backend.SetTenantFault("create_ticket", "t_h", demobackend.Fault{Latency: 1900 * time.Millisecond})
	x := r.executor(func(c *executor.Config) {
		c.StepBudget = 10 * time.Millisecond
		c.RetryBackoff = 150 * time.Millisecond // a lease of 4.6 s
		c.TenantShare = 1
	})
	k := r.admitAs("t_k", "create_ticket", "retried", ticket, 0)
	var first, second []*kgo.Record
	for i := range 16 {
		first = append(first, r.admitAs("t_h", "create_ticket", fmt.Sprintf("hold-a%d", i), ticket, 0))
		second = append(second, r.admitAs("t_h", "create_ticket", fmt.Sprintf("hold-b%d", i), ticket, 0))
	}
	// The first 16 hold the slots for 1.9 s, the next 16 queue, then
	// the call: its first attempt gets the first slot given back (its
	// tenant holds none) and is answered 503, and its retry, 150 ms
	// later, waits behind the next 16 until 0.8 s of its lease is left.
	got := stepOnce(t, x, first...)
	for key, evs := range stepOnce(t, x, second...) {
		got[key] = evs
	}
	for key, evs := range stepOnce(t, x, k) {
		got[key] = evs
	}
	for key, evs := range stepUntil(t, x, 20*time.Second, "t_k/retried") {
		got[key] = append(got[key], evs...)
	}
	if diff := cmp.Diff([]string{"executing", "succeeded"}, got["t_k/retried"]); diff != "" {
		t.Errorf("the retried call (-want +got):\n%s", diff)
	}
}

// A tool that hangs opens its tenant's breaker after a few timeouts in a
// row, however few requests its share of the bulkhead lets through in a
// window: five here, one at a time, where the ratio rule wants ten. Before,
// a tenant holding one slot of a hung tool with a 10 s timeout made three
// requests a 30 s window, never the ten, and every call ran into the hang
// (outcome unknown, for a tool without a key) while the breaker stayed
// closed.
func TestHungToolOpensTheBreaker(t *testing.T) {
	reg := processorstest.RegistryWith(t, "../testdata/registry", "create_ticket", func(entry map[string]any) {
		entry["timeout_ms"] = 200
	})
	r := newRigWith(t, reg, demobackend.Config{})
	r.backend.SetFault(demobackend.ToolCreateTicket, demobackend.Fault{Latency: 2 * time.Second})
	x := r.executor(func(c *executor.Config) { c.MaxAttempts = 1 })
	for i := range 5 {
		if got := x.BreakerStates()["create_ticket/t_a"]; got == "open" {
			t.Fatalf("breaker open after %d timeouts; want it open after 5", i)
		}
		out, err := x.Step(t.Context(), []*kgo.Record{r.admit("create_ticket", fmt.Sprintf("hang-%d", i), map[string]any{"title": "t"}, 0)})
		if err != nil {
			t.Fatal(err)
		}
		if evs := decodeAll(t, out.Records); len(evs) == 0 {
			t.Fatalf("call %d: no events; want its timeout recorded", i)
		}
	}
	if got := x.BreakerStates()["create_ticket/t_a"]; got != "open" {
		t.Errorf("breaker %q after 5 timeouts in a row; want open", got)
	}
}
