package processors_test

// Issue 4 end to end: an approval binds the exact arguments, expires, is
// used once, and yields to a newer policy that denies.

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
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/approvals"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/statemachine"
)

const approvalPolicies = `
@id("tickets") permit (principal, action == Action::"tool::create_ticket", resource);
@id("refunds") @obligation("require_approval")
permit (principal, action == Action::"tool::refund_order", resource);`

// boss approves for tenant t_a; u_1 (the requester of h.newEnvelope)
// may not approve its own calls.
var boss = identity.Identity{User: "u_boss", Agent: "console", Tenant: "t_a", Roles: []string{"approver"}}

// kafkaPublisher publishes approval events to the harness's Kafka.
type kafkaPublisher struct{ cl *kgo.Client }

func (p kafkaPublisher) Publish(ctx context.Context, recs ...*kgo.Record) error {
	return p.cl.ProduceSync(ctx, recs...).FirstErr()
}

func (h *harness) approvals(actor string) *approvals.Service {
	h.t.Helper()
	s, err := approvals.New(approvals.Config{
		Store: h.store, Registry: h.reg, Identity: h.ident.Verifier,
		Publisher: kafkaPublisher{h.pub}, Topics: h.kafka.Topics, Actor: actor, Logger: h.logger,
		Versions: httptool.New(httptool.Config{}), BaseURL: h.tools,
	})
	if err != nil {
		h.t.Fatal(err)
	}
	return s
}

// pendingRefunds submits n refunds and waits until each waits for
// approval.
func (h *harness) pendingRefunds(prefix string, n int) []envelope {
	h.t.Helper()
	envs := make([]envelope, n)
	keys := make([]ledger.CallKey, n)
	for i := range envs {
		envs[i] = h.newEnvelope("t_a", fmt.Sprintf("%s-%04d", prefix, i), "refund_order", map[string]any{"order_id": fmt.Sprintf("ord_%d", i), "amount_cents": 50000, "currency": "AUD"})
		keys[i] = envs[i].key()
	}
	h.submit(envs...)
	for k, c := range h.waitSettled(time.Minute, keys...) {
		if c.State != statemachine.StateApprovalPending {
			h.t.Fatalf("%s is %s; want approval_pending", k, c.State)
		}
	}
	return envs
}

func (h *harness) refundsApplied() int {
	n := 0
	for _, e := range h.backend.Effects() {
		if e.Tool == "refund_order" && !e.Replay {
			n++
		}
	}
	return n
}

// 1,000 approvals whose arguments were altered in the store after they
// were approved: none runs; each is denied for its arguments.
func TestApprovedArgumentsAlteredNeverRun(t *testing.T) {
	h := newHarness(t, storeSQL, 12)
	h.policy.Swap(loadSet(t, "approvals", approvalPolicies))
	h.startIntake("intake-1")
	svc := h.approvals("approvals-1")
	envs := h.pendingRefunds("altered", 1000)
	for _, e := range envs {
		if _, err := svc.Approve(t.Context(), boss, e.key().ApprovalID(), e.ArgumentsHash); err != nil {
			t.Fatalf("approve %s: %v", e.key(), err)
		}
	}
	// Someone with access to the store changes what will run.
	conn, err := pgx.Connect(t.Context(), h.pgDSN)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	// Half get other arguments; the other half other arguments and a
	// hash to match them.
	table := pgx.Identifier{h.pgSchema, "execution_records"}.Sanitize()
	tag, err := conn.Exec(t.Context(), "UPDATE "+table+
		` SET arguments = convert_to('{"amount_cents":1000000,"currency":"AUD","order_id":"ord_attacker"}', 'UTF8') WHERE status = 'authorized'`)
	if err != nil || tag.RowsAffected() != 1000 {
		t.Fatalf("tamper: %v, %d rows", err, tag.RowsAffected())
	}
	tag, err = conn.Exec(t.Context(), "UPDATE "+table+
		` SET arguments_hash = 'sha256:`+strings.Repeat("ab", 32)+`' WHERE status = 'authorized' AND idempotency_key >= 'altered-0500'`)
	if err != nil || tag.RowsAffected() != 500 {
		t.Fatalf("tamper hashes: %v, %d rows", err, tag.RowsAffected())
	}
	h.startExecutor(h.executorConfig("executor-1"))
	keys := make([]ledger.CallKey, len(envs))
	for i, e := range envs {
		keys[i] = e.key()
	}
	for k, c := range h.waitTerminal(time.Minute, keys...) {
		last := c.Events[len(c.Events)-1]
		if c.State != statemachine.StateDenied || last.Reason != executor.ReasonArgumentIntegrity {
			t.Fatalf("%s ended %s (%s); want denied for %s", k, c.State, last.Reason, executor.ReasonArgumentIntegrity)
		}
	}
	if n := h.refundsApplied(); n != 0 {
		t.Errorf("%d refunds ran; want 0", n)
	}
}

// An approval is used once: approved 100 times over, and its approved
// event replayed 100 times, the refund runs once.
func TestApprovalUsedOnce(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	h.policy.Swap(loadSet(t, "approvals", approvalPolicies))
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))
	svcs := []*approvals.Service{h.approvals("approvals-1"), h.approvals("approvals-2")}
	e := h.pendingRefunds("once", 1)[0]

	var applied atomic.Int32
	var wg sync.WaitGroup
	for i := range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := svcs[i%2].Approve(t.Context(), boss, e.key().ApprovalID(), e.ArgumentsHash)
			switch {
			case err == nil:
				applied.Add(1)
			case !errors.Is(err, approvals.ErrNotPending):
				t.Errorf("approve: %v; want nil or ErrNotPending", err)
			}
		}()
	}
	wg.Wait()
	if n := applied.Load(); n != 1 {
		t.Fatalf("%d approvals applied; want 1", n)
	}
	c := h.waitTerminal(30*time.Second, e.key())[e.key()]
	// Replay the approved event 100 times.
	var approved ledger.Event
	for _, ev := range c.Events {
		if ev.Type == statemachine.EventApproved {
			approved = ev
		}
	}
	if approved.Approver != boss.User || approved.ArgumentsHash != e.ArgumentsHash || approved.ApprovalID != e.key().ApprovalID() {
		t.Fatalf("approved event %+v; want bound to %s, %s, %s", approved, boss.User, e.ArgumentsHash, e.key().ApprovalID())
	}
	rec, err := approved.Record(h.kafka.Topics.Events)
	if err != nil {
		t.Fatal(err)
	}
	recs := make([]*kgo.Record, 100)
	for i := range recs {
		r := *rec
		recs[i] = &r
	}
	if err := h.pub.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	waitEventsConsumed(t, h)
	if got := eventTypes(c.Events); got != "1:requested 2:approval_pending 3:approved 4:executing 5:succeeded" {
		t.Errorf("events %s", got)
	}
	if n := h.refundsApplied(); n != 1 {
		t.Errorf("%d refunds ran; want 1", n)
	}
}

// waitEventsConsumed waits until the executor group caught up with the
// events topic.
func waitEventsConsumed(t *testing.T, h *harness) {
	t.Helper()
	adm, err := ledger.NewClient(h.kafka.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer adm.Close()
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		end, err := endTotal(t.Context(), adm, h.kafka.Topics.Events)
		if err != nil {
			return err
		}
		got, err := committedTotal(t.Context(), adm, h.kafka.Group("executor"), h.kafka.Topics.Events)
		if err != nil {
			return err
		}
		if got < end-int64(h.partitions()) {
			return fmt.Errorf("executor committed %d of %d", got, end)
		}
		return nil
	})
}

// The approval binds the version of the resource the approver saw: a
// refund whose order changed after the approval is denied.
func TestApprovalBindsResourceVersion(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	h.policy.Swap(loadSet(t, "approvals", approvalPolicies))
	h.startIntake("intake-1")
	svc := h.approvals("approvals-1")
	envs := h.pendingRefunds("version", 3)
	if c, err := h.index.Get(envs[0].key()); err != nil || !slices.ContainsFunc(c.Events, func(ev ledger.Event) bool {
		return ev.Type == statemachine.EventApprovalPending && ev.ResourceVersion != ""
	}) {
		t.Errorf("the approval_pending event holds no resource version (%v)", err)
	}
	// The third order changes while its call waits for the approval: the
	// approval, for the order as the call was requested, is refused, and
	// the call stays pending. (Before, the approval took the order as it
	// was when the approver clicked.)
	h.backend.BumpResource("t_a", "ord_2")
	if _, err := svc.Approve(t.Context(), boss, envs[2].key().ApprovalID(), envs[2].ArgumentsHash); !errors.Is(err, approvals.ErrResourceChanged) {
		t.Errorf("approving a call whose order changed since its request: %v; want ErrResourceChanged", err)
	}
	if a, err := svc.Get(t.Context(), boss, envs[2].key().ApprovalID()); err != nil || a.State != approvals.StatePending {
		t.Errorf("after the refused approval: %+v, %v; want pending", a, err)
	}
	for _, e := range envs[:2] {
		if _, err := svc.Approve(t.Context(), boss, e.key().ApprovalID(), e.ArgumentsHash); err != nil {
			t.Fatal(err)
		}
	}
	// The first order changes between the approval and the execution.
	h.backend.BumpResource("t_a", "ord_0")
	h.startExecutor(h.executorConfig("executor-1"))
	calls := h.waitTerminal(30*time.Second, envs[0].key(), envs[1].key())
	changed, same := calls[envs[0].key()], calls[envs[1].key()]
	if last := changed.Events[len(changed.Events)-1]; changed.State != statemachine.StateDenied || last.Reason != executor.ReasonResourceChanged {
		t.Errorf("changed order: %s (%s); want denied, %s", changed.State, last.Reason, executor.ReasonResourceChanged)
	}
	if same.State != statemachine.StateSucceeded {
		t.Errorf("unchanged order: %s; want succeeded", same.State)
	}
	for _, ev := range same.Events {
		if ev.Type == statemachine.EventApproved && ev.ResourceVersion == "" {
			t.Errorf("the approved event binds no resource version")
		}
	}
	if n := h.refundsApplied(); n != 1 {
		t.Errorf("%d refunds ran; want 1", n)
	}
}

// Self-approval and another tenant's approver are refused; nothing runs.
// So is the requester, or its agent, named in other case (an identity
// provider whose logins ignore case may put either in the subject).
func TestApprovalRefusedToRequesterAndOtherTenant(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	h.policy.Swap(loadSet(t, "approvals", approvalPolicies))
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))
	svc := h.approvals("approvals-1")
	e := h.pendingRefunds("refused", 1)[0]
	self := identity.Identity{User: "u_1", Agent: "a", Tenant: "t_a", Roles: []string{"approver"}}
	if _, err := svc.Approve(t.Context(), self, e.key().ApprovalID(), e.ArgumentsHash); !errors.Is(err, approvals.ErrSelfApproval) {
		t.Errorf("self-approval: %v; want ErrSelfApproval", err)
	}
	selfInCapitals := identity.Identity{User: "U_1", Agent: "a", Tenant: "t_a", Roles: []string{"approver"}}
	if _, err := svc.Approve(t.Context(), selfInCapitals, e.key().ApprovalID(), e.ArgumentsHash); !errors.Is(err, approvals.ErrSelfApproval) {
		t.Errorf("self-approval as U_1: %v; want ErrSelfApproval", err)
	}
	// The agent that asked, presenting some approver's assertion.
	for _, agent := range []string{"agent_test", "Agent_Test"} {
		sameAgent := identity.Identity{User: "u_boss", Agent: agent, Tenant: "t_a", Roles: []string{"approver"}}
		if _, err := svc.Approve(t.Context(), sameAgent, e.key().ApprovalID(), e.ArgumentsHash); !errors.Is(err, approvals.ErrSelfApproval) {
			t.Errorf("approval by the requesting agent as %s: %v; want ErrSelfApproval", agent, err)
		}
	}
	other := identity.Identity{User: "u_boss", Agent: "a", Tenant: "t_b", Roles: []string{"approver"}}
	if _, err := svc.Approve(t.Context(), other, e.key().ApprovalID(), e.ArgumentsHash); !errors.Is(err, approvals.ErrNotFound) {
		t.Errorf("another tenant's approver: %v; want ErrNotFound", err)
	}
	if c, _ := h.index.Get(e.key()); c.State != statemachine.StateApprovalPending || h.refundsApplied() != 0 {
		t.Errorf("after refused approvals: %s, %d refunds; want still pending, 0", c.State, h.refundsApplied())
	}
}

// A policy that denies, activated between the approval and the execution,
// wins; so does an approval's expiry.
func TestApprovalRecheckedAtExecution(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	h.approvalTTL = 3 * time.Second
	h.policy.Swap(loadSet(t, "approvals", approvalPolicies))
	h.startIntake("intake-1")
	svc := h.approvals("approvals-1")
	envs := h.pendingRefunds("recheck", 2)

	// Approved, then a version that forbids this order becomes active
	// before the executor runs it.
	if _, err := svc.Approve(t.Context(), boss, envs[0].key().ApprovalID(), envs[0].ArgumentsHash); err != nil {
		t.Fatal(err)
	}
	deny := loadSet(t, "v-deny", approvalPolicies+`
@id("no-ord-0") forbid (principal, action == Action::"tool::refund_order", resource) when { context.arguments.order_id == "ord_0" };`)
	h.policy.Swap(deny)
	stop := h.startExecutor(h.executorConfig("executor-1"))
	first := h.waitTerminal(30*time.Second, envs[0].key())[envs[0].key()]
	last := first.Events[len(first.Events)-1]
	if first.State != statemachine.StateDenied || last.PolicyVersion != deny.Version() || len(last.PolicyID) != 1 || last.PolicyID[0] != "no-ord-0" {
		t.Errorf("after a denying policy: %s by %v at %s (%s); want denied by [no-ord-0] at %s", first.State, last.PolicyID, last.PolicyVersion, last.Reason, deny.Version())
	}

	// Approved while no executor runs, and still not run when the
	// approval's time is up.
	stop()
	if _, err := svc.Approve(t.Context(), boss, envs[1].key().ApprovalID(), envs[1].ArgumentsHash); err != nil {
		t.Fatal(err)
	}
	expires := envs[1].expiry(t, h)
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if time.Now().Before(expires) {
			return errors.New("approval still valid")
		}
		return nil
	})
	h.startExecutor(h.executorConfig("executor-2"))
	second := h.waitTerminal(30*time.Second, envs[1].key())[envs[1].key()]
	if last := second.Events[len(second.Events)-1]; second.State != statemachine.StateDenied || last.Reason != executor.ReasonApprovalExpired {
		t.Errorf("after the approval expired: %s (%s); want denied, %s", second.State, last.Reason, executor.ReasonApprovalExpired)
	}
	if n := h.refundsApplied(); n != 0 {
		t.Errorf("%d refunds ran; want 0", n)
	}
	// The approvals stay readable, approved, after the executor denied
	// their calls (a denial clears the obligations that said so).
	for _, e := range envs {
		if a, err := svc.Get(t.Context(), boss, e.key().ApprovalID()); err != nil || a.State != approvals.StateApproved {
			t.Errorf("Get(%s) after the denial = %+v, %v; want approved", e.key(), a, err)
		}
	}
}

// expiry returns when the envelope's approval lapses.
func (e envelope) expiry(t *testing.T, h *harness) time.Time {
	t.Helper()
	c, err := h.index.Get(e.key())
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range c.Events {
		if ev.Type == statemachine.EventApprovalPending && ev.ExpiresAt != nil {
			return *ev.ExpiresAt
		}
	}
	t.Fatalf("%s has no pending approval", e.key())
	return time.Time{}
}

// Pending approvals past their time expire, once each, with two timers
// running; an expired approval can no longer be approved.
func TestApprovalsExpireOnceWithTwoTimers(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	h.approvalTTL = time.Second
	h.policy.Swap(loadSet(t, "approvals", approvalPolicies))
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))
	envs := h.pendingRefunds("expire", 50)
	for i := range 2 {
		svc := h.approvals(fmt.Sprintf("timer-%d", i))
		h.run(fmt.Sprintf("timer-%d", i), func(ctx context.Context) error { return svc.RunTimer(ctx, 50*time.Millisecond) })
	}
	keys := make([]ledger.CallKey, len(envs))
	for i, e := range envs {
		keys[i] = e.key()
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		for _, k := range keys {
			if c, _ := h.index.Get(k); c.State != statemachine.StateExpired {
				return fmt.Errorf("%s is %s", k, c.State)
			}
		}
		return nil
	})
	// Count expired events in the log itself: exactly one per approval.
	ids := map[ledger.CallKey]map[string]bool{}
	for _, k := range keys {
		evs, err := ledger.ReadCall(t.Context(), h.kafka.Client, h.kafka.Topics.Events, k)
		if err != nil {
			t.Fatal(err)
		}
		ids[k] = map[string]bool{}
		for _, ev := range evs {
			if ev.Type == statemachine.EventExpired {
				ids[k][ev.EventID] = true
			}
		}
		if len(ids[k]) != 1 {
			t.Errorf("%s: %d distinct expired events; want 1", k, len(ids[k]))
		}
	}
	svc := h.approvals("late")
	if _, err := svc.Approve(t.Context(), boss, envs[0].key().ApprovalID(), envs[0].ArgumentsHash); !errors.Is(err, approvals.ErrNotPending) {
		t.Errorf("approving an expired approval: %v; want ErrNotPending", err)
	}
	if n := h.refundsApplied(); n != 0 {
		t.Errorf("%d refunds ran; want 0", n)
	}
}
