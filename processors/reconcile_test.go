package processors_test

// Issue 5 end to end: unknown outcomes resolved or parked, with every
// effect at the tools accounted for; compensation as a governed call.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/compensation"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/statemachine"
)

func (h *harness) startReconciler(owner string) *executor.Reconciler {
	h.t.Helper()
	return h.startReconcilerWith(owner, h.compensation())
}

// startReconcilerWith starts a reconciler asking comp for compensations.
func (h *harness) startReconcilerWith(owner string, comp executor.Compensator) *executor.Reconciler {
	h.t.Helper()
	rc, err := executor.NewReconciler(executor.ReconcilerConfig{
		Registry: h.reg, Store: h.store, Looker: httptool.New(httptool.Config{}), BaseURL: h.tools,
		Topics: h.kafka.Topics, Owner: owner, Backoff: 10 * time.Millisecond, SweepEvery: 500 * time.Millisecond, Logger: h.logger,
		// Calls whose lookups keep failing are parked after a second
		// of sweeps, not the default minutes.
		UnansweredFor: time.Second, Compensator: comp,
	})
	if err != nil {
		h.t.Fatal(err)
	}
	loop, err := rc.Loop(ledger.LoopConfig{Client: h.kafka.Client, Group: h.kafka.Group("reconciler"), Tick: 100 * time.Millisecond})
	if err != nil {
		h.t.Fatal(err)
	}
	h.run(owner, loop.Run)
	return rc
}

// With responses lost after the effect, an executor that crashes after
// effects and before recording them, and an executor killed mid-run,
// every call ends resolved (succeeded, failed) or parked with a reason;
// no effect is applied twice, and every effect at the tools belongs to a
// call recorded succeeded or parked for a human.
func TestUnknownOutcomesResolvedOrParked(t *testing.T) {
	h := newHarness(t, storeSQL, 12, func(c *demobackend.Config) { c.Latency = 5 * time.Millisecond })
	// The first requests of each tool apply and lose their response.
	h.backend.SetFault("create_ticket", demobackend.Fault{ApplyThenDrop: true, FailTimes: 60})
	h.backend.SetFault("send_email", demobackend.Fault{ApplyThenDrop: true, FailTimes: 30})
	h.startIntake("intake-1")
	// The faults would trip the breakers; this test is about what
	// happens to the calls that reach the tools.
	cfg := h.executorConfig("executor-1")
	cfg.Breaker.MinRequests, cfg.Breaker.ConsecutiveFailures = 1<<20, 1<<20
	// The first executor crashes after its first batches' effects and
	// before it records them: their claims stay until their leases end.
	cfg.Store = &crashBeforeRecord{Store: h.store, crashes: 2}
	first := h.startExecutor(cfg)
	h.startReconciler("reconciler-1")

	const n = 400
	envs := make([]envelope, n)
	keys := make([]ledger.CallKey, n)
	assertion := h.ident.Assertion(t, "t_a", "u_1")
	for i := range envs {
		if i%2 == 0 {
			envs[i] = h.newEnvelopeSigned("t_a", fmt.Sprintf("u-ticket-%04d", i), "create_ticket", map[string]any{"title": "t"}, assertion)
		} else {
			envs[i] = h.newEnvelopeSigned("t_a", fmt.Sprintf("u-notify-%04d", i), "notify", map[string]any{"to": "a@example.com", "subject": "s"}, assertion)
		}
		keys[i] = envs[i].key()
	}
	h.submit(envs...)
	waitEffects(h, 100)
	first() // the executor dies mid-run; another takes over
	cfg.Owner = "executor-2"
	cfg.Store = h.store
	h.startExecutor(cfg)

	outcomes := map[string]int{}
	ledgertest.WaitFor(t, 2*time.Minute, func() error {
		clear(outcomes)
		for _, k := range keys {
			c, err := h.index.Get(k)
			if err != nil || !c.Settled() {
				rec, _ := h.store.Get(t.Context(), k)
				return fmt.Errorf("%s has not settled: index %q %s (refusals %d, anomalies %d, err %v); store %s seq %d logged %d owner %q", k, c.State, eventTypes(c.Events), len(c.Refusals), c.Anomalies, err, rec.Status, rec.Seq, rec.LoggedSeq, rec.LeaseOwner)
			}
			last := c.Events[len(c.Events)-1]
			if c.State == statemachine.StateOutcomeUnknown && last.Type != statemachine.EventParked {
				return fmt.Errorf("%s is unknown and not yet parked", k)
			}
			outcomes[string(last.Type)+" "+last.Reason]++
		}
		return nil
	})
	if dups := h.backend.Duplicates(); len(dups) != 0 {
		t.Errorf("duplicate effects: %v", dups)
	}
	orphans := 0
	for _, e := range h.backend.Effects() {
		if e.Replay || e.Read {
			continue
		}
		k, err := ledger.ParseCallKey(e.IdempotencyKey)
		if err != nil {
			t.Fatal(err)
		}
		c, _ := h.index.Get(k)
		if c.State != statemachine.StateSucceeded && !(c.State == statemachine.StateOutcomeUnknown && c.Events[len(c.Events)-1].Type == statemachine.EventParked) {
			orphans++
			t.Errorf("orphan effect: %s applied, the call is %s", k, c.State)
		}
	}
	for o := range outcomes {
		if strings.HasPrefix(o, "parked") && o != "parked "+executor.ReasonNoStatusLookup {
			t.Errorf("unexpected parking %q", o)
		}
	}
	// Which unknowns the status lookups resolve depends on how the lost
	// responses and the crash interleave; that tools without a lookup
	// were parked, never retried, does not.
	if outcomes["parked "+executor.ReasonNoStatusLookup] == 0 {
		t.Errorf("the faults produced no parked call: %v", outcomes)
	}
	t.Logf("%d calls: %v; %d orphan effects", n, outcomes, orphans)
}

// compensation is the compensation service on the harness's store, with
// an intake of its own for the governed call.
func (h *harness) compensation() *compensation.Service {
	h.t.Helper()
	submitter, err := intake.New(intake.Config{Registry: h.reg, Store: h.store, Topics: h.kafka.Topics, Identity: h.ident.Verifier, Policy: h.policy, Actor: "compensation"})
	if err != nil {
		h.t.Fatal(err)
	}
	svc, err := compensation.New(compensation.Config{Store: h.store, Registry: h.reg, Intake: submitter, Publisher: kafkaPublisher{h.pub}, Topics: h.kafka.Topics})
	if err != nil {
		h.t.Fatal(err)
	}
	return svc
}

// A refund whose outcome cannot be established (the response lost, the
// status lookup down) is undone automatically where its policy says so:
// the compensation runs as a governed call, and the refund ends
// compensated. A first request for the compensation that fails (Kafka or
// the store unavailable) is made again by a sweep: still one
// compensation, run once.
func TestUnknownOutcomeUndoneWherePolicySays(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail int // requests for the compensation that fail first
	}{
		{"asked once", 0},
		{"asked again after a failure", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, storeSQL, 4)
			h.policy.Swap(loadSet(t, "undo", `
@id("refunds") @obligation("undo_unknown") permit (principal, action == Action::"tool::refund_order", resource);
@id("compensations") permit (principal, action == Action::"tool::cancel_refund", resource) when { principal.tenant == resource.tenant };`))
			h.backend.SetFault("refund_order", demobackend.Fault{ApplyThenDrop: true})
			h.backend.SetFault("refund_order/status", demobackend.Fault{FailStatus: 503})
			h.startIntake("intake-1")
			h.startExecutor(h.executorConfig("executor-1"))
			comp := &failingCompensator{Compensator: h.compensation()}
			comp.fail.Store(int32(tc.fail))
			h.startReconcilerWith("reconciler-1", comp)
			refund := h.newEnvelope("t_a", "undo-1", "refund_order", map[string]any{"order_id": "ord_u", "amount_cents": 4500, "currency": "AUD"})
			h.submit(refund)
			c := h.waitTerminal(time.Minute, refund.key())[refund.key()]
			if c.State != statemachine.StateCompensated {
				t.Fatalf("refund ended %s (%s); want compensated", c.State, eventTypes(c.Events))
			}
			var parked ledger.Event
			for _, ev := range c.Events {
				if ev.Type == statemachine.EventParked {
					parked = ev
				}
			}
			if parked.Reason != executor.ReasonCompensating {
				t.Errorf("parked for %q; want %q", parked.Reason, executor.ReasonCompensating)
			}
			if n := comp.asked.Load(); n != int32(tc.fail+1) {
				t.Errorf("compensation asked for %d times; want %d", n, tc.fail+1)
			}
			if n := h.backend.AppliedIn("cancel_refund", "t_a", refund.key().CompensationKey().String()); n != 1 {
				t.Errorf("cancel_refund applied %d times; want 1", n)
			}
		})
	}
}

// failingCompensator fails its first fail requests, as Kafka or the store
// unavailable would, before asking its Compensator; it counts them all.
type failingCompensator struct {
	executor.Compensator
	fail, asked atomic.Int32
}

func (c *failingCompensator) Compensate(ctx context.Context, op identity.Identity, key ledger.CallKey, reason string) (ledger.CallKey, []ledger.Event, error) {
	c.asked.Add(1)
	if c.fail.Add(-1) >= 0 {
		return ledger.CallKey{}, nil, errors.New("produce: kafka unavailable")
	}
	return c.Compensator.Compensate(ctx, op, key, reason)
}

// An operator compensates a succeeded refund: the compensation runs as a
// governed call of its own, and the refund is recorded compensated.
func TestCompensationIsAGovernedCall(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	h.policy.Swap(loadSet(t, "refunds", `
@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);
@id("compensations") permit (principal, action == Action::"tool::cancel_refund", resource) when { principal.tenant == resource.tenant };`))
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))
	h.startReconciler("reconciler-1")
	refund := h.newEnvelope("t_a", "refund-9", "refund_order", map[string]any{"order_id": "ord_9", "amount_cents": 4500, "currency": "AUD"})
	h.submit(refund)
	if c := h.waitSettled(30*time.Second, refund.key())[refund.key()]; c.State != statemachine.StateSucceeded {
		t.Fatalf("refund is %s", c.State)
	}

	svc := h.compensation()
	op := identity.Identity{User: "u_ops", Agent: "console", Tenant: "t_a", Roles: []string{"operator"}}
	if _, _, err := svc.Compensate(t.Context(), identity.Identity{User: "u_1", Tenant: "t_a"}, refund.key(), "x"); !errors.Is(err, compensation.ErrForbidden) {
		t.Errorf("compensation by a non-operator: %v; want ErrForbidden", err)
	}
	if _, _, err := svc.Compensate(t.Context(), op, refund.key(), strings.Repeat("r", compensation.MaxReasonBytes+1)); !errors.Is(err, compensation.ErrInvalidReason) {
		t.Errorf("compensation with a reason past %d bytes: %v; want ErrInvalidReason", compensation.MaxReasonBytes, err)
	}
	ck, evs, err := svc.Compensate(t.Context(), op, refund.key(), "customer kept the goods")
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 2 || evs[1].Type != statemachine.EventAuthorized || evs[1].PolicyID[0] != "compensations" {
		t.Fatalf("compensation started with %+v; want requested + authorized by [compensations]", evs)
	}
	calls := h.waitSettled(30*time.Second, ck)
	if calls[ck].State != statemachine.StateSucceeded {
		t.Fatalf("the compensation call is %s", calls[ck].State)
	}
	// Who asked, and why, is on the compensation's first event, as the
	// projection holds it: before, the reason went to a log line only.
	const why = "asked for by u_ops: customer kept the goods"
	if c, _ := h.index.Get(ck); len(c.Events) == 0 || c.Events[0].Type != statemachine.EventRequested || c.Events[0].Detail != why {
		t.Errorf("the compensation's events as projected: %+v; want requested first, its detail %q", c.Events, why)
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		c, _ := h.index.Get(refund.key())
		if c.State != statemachine.StateCompensated {
			return fmt.Errorf("refund is %s", c.State)
		}
		return nil
	})
	if n := h.backend.AppliedIn("cancel_refund", "t_a", ck.String()); n != 1 {
		t.Errorf("cancel_refund applied %d times; want 1", n)
	}
	if _, _, err := svc.Compensate(t.Context(), op, refund.key(), "again"); !errors.Is(err, compensation.ErrNotCompensable) {
		t.Errorf("compensating a compensated call: %v; want ErrNotCompensable", err)
	}
}

// crashBeforeRecord is the real store, except that its first Complete
// calls fail as a crash between the effect and its record would: the
// tools ran, and nothing says so.
type crashBeforeRecord struct {
	processors.Store
	crashes int32
	n       atomic.Int32
}

func (c *crashBeforeRecord) Complete(ctx context.Context, cs []processors.Completion) ([]bool, error) {
	if c.n.Add(1) <= c.crashes {
		return nil, errors.New("crashed after the effect, before the record")
	}
	return c.Store.Complete(ctx, cs)
}
