package executor_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	dto "github.com/prometheus/client_model/go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// admitUnreadable stores a finished call whose events are not known to be
// in the log and whose outbox this build cannot read (an encoding version
// from a newer build).
func (r *rig) admitUnreadable(key string) ledger.CallKey {
	r.t.Helper()
	return r.admitDenied(key, []byte(`[{"v":99,"type":"denied","seq":2}]`))
}

// admitDenied stores a call the intake denied, with outbox as the events
// of its admission (seq 2), none of them known to be in the log.
func (r *rig) admitDenied(key string, outbox []byte) ledger.CallKey {
	r.t.Helper()
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: key}
	if _, err := r.store.Admit(r.t.Context(), []processors.Admission{{Key: k, CallID: "c_" + key, ArgumentsHash: "sha256:00", Tool: "notify", ToolVersion: 1,
		Arguments: []byte(`{}`), Status: processors.StatusDenied, Seq: 2, Outbox: outbox}}); err != nil {
		r.t.Fatal(err)
	}
	return k
}

// An outbox the executor cannot read, met by the sweep or by a claim,
// is left out of the step (and stays unlogged, for a build that reads
// it); the step still launches the batch it claimed, instead of failing
// and leaving those claims to expire, a call of a tool without
// idempotency then ending outcome_unknown although it never ran.
func TestUnreadableOutboxDoesNotStrandTheBatch(t *testing.T) {
	for _, via := range []string{"sweep", "claim"} {
		t.Run(via, func(t *testing.T) {
			r := newRig(t)
			bad := r.admitUnreadable("from-newer-build")
			time.Sleep(20 * time.Millisecond) // past the unlogged grace below
			x := r.executor(func(c *executor.Config) { c.UnloggedGrace = 10 * time.Millisecond })
			recs := []*kgo.Record{r.admit("notify", "n1", map[string]any{"to": "a@example.com", "subject": "s"}, 0)}
			if via == "claim" {
				// An authorized event for the finished call: its claim
				// finds it Finished and unlogged.
				x = r.executor(nil) // no sweep: the claim alone meets it
				ev := ledger.Event{EventID: "e_bad", IdempotencyKey: bad.IdempotencyKey, CallID: "c_" + bad.IdempotencyKey, Seq: 1,
					Type: statemachine.EventAuthorized, At: time.Now().UTC(), TenantID: bad.TenantID, UserID: "u_1",
					Tool: "notify", ToolVersion: 1, ArgumentsHash: "sha256:00"}
				rec, err := ev.Record("toolcalls.events")
				if err != nil {
					t.Fatal(err)
				}
				recs = append([]*kgo.Record{rec}, recs...)
			}
			out, err := x.Step(t.Context(), recs)
			if err != nil {
				t.Fatalf("step failed: %v", err)
			}
			if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(decodeAll(t, out.Records))); diff != "" {
				t.Errorf("events (-want +got):\n%s", diff)
			}
			if n := r.backend.AppliedIn("send_email", "t_a", "t_a/n1"); n != 1 {
				t.Errorf("n1 applied %d times; want 1", n)
			}
			if err := out.Committed(t.Context()); err != nil {
				t.Fatal(err)
			}
			got, err := r.store.Get(t.Context(), bad)
			if err != nil {
				t.Fatal(err)
			}
			if !got.Unlogged() {
				t.Errorf("the unreadable call was marked logged (logged_seq %d, seq %d): its events would never be appended", got.LoggedSeq, got.Seq)
			}
		})
	}
}

// hangingVersions is a resource-version endpoint that takes the request
// and never answers.
type hangingVersions struct{ asked chan struct{} }

func (h hangingVersions) ResourceVersion(ctx context.Context, _, _, _ string) (string, error) {
	h.asked <- struct{}{}
	<-ctx.Done()
	return "", ctx.Err()
}

// A check before the call that hangs (here the approved resource's
// version) ends well within the call's time and its lease: the claim is
// given back, nothing sent, to be checked again later; not left executing
// past its lease and in flight, where this executor's sweeps would never
// reclaim it, nor denied, as if the version had changed, nor failed as
// not started, which would end the approved call for a passing hang.
//
// The lease is kept on this executor's clock too: with the store's clock
// an hour ahead, the lease_until it returns is an hour later than this
// executor's view of the lease, and the call still ends within the lease.
func TestHangingPreCallCheckEndsWithinTheLease(t *testing.T) {
	for _, skew := range []time.Duration{0, time.Hour} {
		t.Run("store clock ahead "+skew.String(), func(t *testing.T) { hangingPreCallCheck(t, skew) })
	}
}

// storeClockAhead is the store, with its clock ahead by skew: the leases
// it grants end skew later.
type storeClockAhead struct {
	executor.Store
	skew time.Duration
}

func (s storeClockAhead) Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error) {
	res, err := s.Store.Claim(ctx, cs)
	for i := range res {
		if !res[i].Record.LeaseUntil.IsZero() {
			res[i].Record.LeaseUntil = res[i].Record.LeaseUntil.Add(s.skew)
		}
	}
	return res, err
}

func hangingPreCallCheck(t *testing.T, skew time.Duration) {
	r := newRig(t)
	ev, rec := r.admitApproved("k1", time.Now().Add(time.Hour), "v1")
	key := ev.Key()
	hv := hangingVersions{asked: make(chan struct{}, 1)}
	// One attempt of refund_order's 2 s: a lease of about 2 s.
	x := r.executor(func(c *executor.Config) {
		c.Versions, c.MaxAttempts = hv, 1
		c.Store = storeClockAhead{Store: c.Store, skew: skew}
	})
	var (
		out ledger.Output
		err error
	)
	stepped := make(chan struct{})
	go func() {
		defer close(stepped)
		out, err = x.Step(t.Context(), []*kgo.Record{rec})
	}()
	select {
	case <-stepped:
	case <-time.After(15 * time.Second):
		t.Fatal("the step still waits for the call 15 s after it was claimed for about 2 s")
	}
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-hv.asked:
	default:
		t.Fatal("the resource's version was never asked for")
	}
	if got := summary(decodeAll(t, out.Records)); len(got) != 0 {
		t.Errorf("events %v; want none: the call waits to be checked again", got)
	}
	if n, _ := x.InFlight(); n != 0 {
		t.Errorf("%d calls still in flight", n)
	}
	got, err := r.store.Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if got.Status != processors.StatusExecuting || got.LeaseOwner != "" || got.Attempt != 0 {
		t.Errorf("record %s owned by %q, attempt %d; want executing, given back (no owner), attempt 0", got.Status, got.LeaseOwner, got.Attempt)
	}
	if n := r.backend.AppliedIn("refund_order", "t_a", "t_a/k1"); n != 0 {
		t.Errorf("refund applied %d times; want 0", n)
	}
}

// admitApproved stores a refund_order call as the approval service leaves
// an approved one (authorized, its approved event in the outbox) and
// returns that event and its record; the approval expires at expires and
// binds the resource's version when version is set, and the decision
// carries obligations.
func (r *rig) admitApproved(key string, expires time.Time, version string, obligations ...string) (ledger.Event, *kgo.Record) {
	r.t.Helper()
	return r.admitApprovedWith(key, func(ev *ledger.Event) {
		ev.ExpiresAt, ev.ResourceVersion, ev.Obligations = &expires, version, obligations
	})
}

// admitApprovedWith is admitApproved's call, its approved event changed by
// edit (expiring in an hour unless edit says otherwise).
func (r *rig) admitApprovedWith(key string, edit func(*ledger.Event)) (ledger.Event, *kgo.Record) {
	r.t.Helper()
	expires := time.Now().Add(time.Hour)
	args := []byte(`{"amount_cents":100,"currency":"AUD","order_id":"ord_1"}`)
	tree, err := ledger.Decode(args, ledger.Limits{})
	if err != nil {
		r.t.Fatal(err)
	}
	hash, err := ledger.ArgumentsHash("t_a", "refund_order", 1, tree)
	if err != nil {
		r.t.Fatal(err)
	}
	ev := ledger.Event{EventID: "e_" + key, IdempotencyKey: key, CallID: "c_" + key, Seq: 3, Type: statemachine.EventApproved,
		At: time.Now().UTC(), TenantID: "t_a", UserID: "u_1", Tool: "refund_order", ToolVersion: 1, ArgumentsHash: hash,
		ApprovalID: "ap_" + key, Approver: "boss", ExpiresAt: &expires}
	edit(&ev)
	outbox, err := ledger.EncodeEvents([]ledger.Event{ev})
	if err != nil {
		r.t.Fatal(err)
	}
	tool, err := r.reg.Lookup("refund_order", 1)
	if err != nil {
		r.t.Fatal(err)
	}
	// Under the definition's digest, as the intake admits.
	if _, err := r.store.Admit(r.t.Context(), []processors.Admission{{Key: ev.Key(), CallID: ev.CallID, ArgumentsHash: hash, Tool: "refund_order", ToolVersion: 1,
		ToolDigest: tool.Digest(), Arguments: args, Status: processors.StatusAuthorized, Seq: 3, Outbox: outbox}}); err != nil {
		r.t.Fatal(err)
	}
	rec, err := ev.Record("toolcalls.events")
	if err != nil {
		r.t.Fatal(err)
	}
	return ev, rec
}

// More unreadable outboxes than a sweep's page (SweepLimit), all older
// than a readable one, do not keep the readable one out of the log: the
// sweep goes on past the page it could not append, and the readable
// call's events are appended within the pass (here the second sweep).
// The unreadable ones stay unlogged, counted, for a build that reads them.
func TestUnreadableOutboxesDoNotStarveTheSweep(t *testing.T) {
	r := newRig(t)
	const limit = 100 // executor.Config.SweepLimit's default
	var bad []ledger.CallKey
	for i := range limit + 1 {
		bad = append(bad, r.admitUnreadable(fmt.Sprintf("from-newer-build-%03d", i)))
	}
	ev := ledger.Event{EventID: "e_good", IdempotencyKey: "readable", CallID: "c_readable", Seq: 2, Type: statemachine.EventDenied,
		At: time.Now().UTC(), TenantID: "t_a", UserID: "u_1", Tool: "notify", ToolVersion: 1, ArgumentsHash: "sha256:00", Reason: "policy"}
	outbox, err := ledger.EncodeEvents([]ledger.Event{ev})
	if err != nil {
		t.Fatal(err)
	}
	good := r.admitDenied(ev.IdempotencyKey, outbox)
	reg := metrics.New("executor", nil)
	// Every step sweeps, and every record is old enough for it.
	x := r.executor(func(c *executor.Config) {
		c.SweepEvery, c.UnloggedGrace, c.Metrics = time.Nanosecond, time.Nanosecond, reg
	})
	got := sweepUntilEvents(t, x, 2)
	if diff := cmp.Diff([]string{"denied(policy)"}, got); diff != "" {
		t.Fatalf("the readable call's events were not appended within two sweeps behind %d unreadable records (-want +got):\n%s", len(bad), diff)
	}
	if rec, err := r.store.Get(t.Context(), good); err != nil || rec.Unlogged() {
		t.Errorf("readable call after its sweep committed: unlogged %v, %v; want logged", rec.Unlogged(), err)
	}
	for _, k := range bad {
		if rec, err := r.store.Get(t.Context(), k); err != nil || !rec.Unlogged() {
			t.Fatalf("unreadable call %v: unlogged %v, %v; want unlogged, its events never appended", k, rec.Unlogged(), err)
		}
	}
	if n := counter(t, reg, "ledger_outboxes_unreadable_total"); n < float64(len(bad)) {
		t.Errorf("ledger_outboxes_unreadable_total = %v; want at least %d, one a record met", n, len(bad))
	}
}

// counter is the value of a counter in reg (a histogram's: its count of
// samples): without labels of its own, or the series whose labels include
// the name-value pairs given.
func counter(t *testing.T, reg *metrics.Registry, name string, labels ...string) float64 {
	t.Helper()
	fams, err := reg.Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		value := func(m *dto.Metric) float64 {
			if h := m.GetHistogram(); h != nil {
				return float64(h.GetSampleCount())
			}
			return m.GetCounter().GetValue()
		}
		if len(labels) == 0 && len(f.GetMetric()) == 1 {
			return value(f.GetMetric()[0])
		}
	series:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue series
				}
			}
			if len(labels) > 0 {
				return value(m)
			}
		}
	}
	return 0
}

// An expired claim this build cannot take over (its outbox from a newer
// build: no template to run it from) stays first in the lease's order. A
// sweep reading the oldest page every time never reached the claims
// behind a page of them; a pass of pages does, in the next sweep.
func TestUnreadableExpiredClaimsDoNotStarveTheSweep(t *testing.T) {
	r := newRig(t)
	const limit = 3
	var claims []processors.Claim
	for i := range limit + 1 {
		k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: fmt.Sprintf("from-newer-build-%d", i)}
		if _, err := r.store.Admit(t.Context(), []processors.Admission{{Key: k, CallID: "c_" + k.IdempotencyKey, ArgumentsHash: "sha256:00",
			Tool: "notify", ToolVersion: 1, Arguments: []byte(`{}`), Status: processors.StatusAuthorized, Seq: 2,
			Outbox: []byte(`[{"v":99,"type":"authorized","seq":2}]`)}}); err != nil {
			t.Fatal(err)
		}
		claims = append(claims, processors.Claim{Key: k, ArgumentsHash: "sha256:00", Owner: "dead", Lease: 20 * time.Millisecond})
	}
	if res, err := r.store.Claim(t.Context(), claims); err != nil || len(res) != len(claims) {
		t.Fatalf("claim the unreadable calls as a dead owner: %v %+v", err, res)
	}
	// Claimed after them: its lease ends after theirs.
	auth := authorizedEvent(t, r.admit("notify", "readable", map[string]any{"to": "a@example.com", "subject": "s"}, 0))
	r.claimAsDeadOwner(auth.Key(), auth.ArgumentsHash)
	ledgertest.WaitFor(t, 5*time.Second, func() error {
		exp, err := r.store.Expired(t.Context(), 100)
		if err != nil {
			return err
		}
		if n := len(exp); n != limit+2 || exp[n-1].Key != auth.Key() {
			return fmt.Errorf("%d expired claims, the readable one last: not yet", n)
		}
		return nil
	})
	x := r.executor(func(c *executor.Config) { c.SweepEvery, c.SweepLimit = time.Nanosecond, limit })
	got := sweepUntilEvents(t, x, 3)
	if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, got); diff != "" {
		t.Fatalf("the readable expired claim was not taken over within three sweeps of %d behind %d unreadable ones (-want +got):\n%s", limit, limit+1, diff)
	}
}

// failingUnlogged is a store whose listing of unlogged records fails.
type failingUnlogged struct{ executor.Store }

func (failingUnlogged) Unlogged(context.Context, time.Duration, processors.Cursor, int) ([]processors.Record, error) {
	return nil, errors.New("revert journal: arrays of unequal lengths")
}

// A sweep whose listing of unlogged records fails still takes over the
// expired claims it read: before, the step failed at every sweep, and no
// call whose executor died was recovered for as long as the listing did.
func TestFailingUnloggedListingTakesOverAllTheSame(t *testing.T) {
	r := newRig(t)
	auth := authorizedEvent(t, r.admit("notify", "dead-owner", map[string]any{"to": "a@example.com", "subject": "s"}, 0))
	r.claimAsDeadOwner(auth.Key(), auth.ArgumentsHash)
	x := r.executor(func(c *executor.Config) { c.Store, c.SweepEvery = failingUnlogged{r.store}, time.Nanosecond })
	got := sweepUntilEvents(t, x, 1)
	if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, got); diff != "" {
		t.Errorf("the expired claim's sweep (-want +got):\n%s", diff)
	}
}

// sweepUntilEvents runs steps of nothing but sweeps, each committed, up to
// sweeps of them, until one appends events, and returns their summary.
func sweepUntilEvents(t *testing.T, x *executor.Executor, sweeps int) []string {
	t.Helper()
	var got []string
	for sweep := 1; sweep <= sweeps && len(got) == 0; sweep++ {
		out, err := x.Step(t.Context(), nil)
		if err != nil {
			t.Fatalf("sweep %d: %v", sweep, err)
		}
		got = summary(decodeAll(t, out.Records))
		if out.Committed != nil {
			if err := out.Committed(t.Context()); err != nil {
				t.Fatal(err)
			}
		}
	}
	return got
}

// An authorized event that does not decode (damaged) is passed over, its
// call left unrun, and counted (ledger_events_undecodable_total), for an
// alert to say so; before, a log line at Error was all. One of a newer
// encoding (an upgrade out of order) is not passed over: the step stops
// the loop (ledger.ErrStop), so that the call waits for an executor that
// reads it rather than stay unrun for good, and nothing of the batch is
// done, the calls before it included.
func TestUndecodableAuthorizedEvent(t *testing.T) {
	event := func(key, value string) *kgo.Record {
		return &kgo.Record{Topic: ledger.Topics{}.WithDefaults().Events, Key: []byte("t_a/" + key), Value: []byte(value),
			Headers: []kgo.RecordHeader{{Key: ledger.HeaderEventType, Value: []byte("authorized")}}}
	}
	t.Run("damaged", func(t *testing.T) {
		r := newRig(t)
		reg := metrics.New("executor", nil)
		x := r.executor(func(c *executor.Config) { c.Metrics = reg })
		out, err := x.Step(t.Context(), []*kgo.Record{event("damaged", `{"v":1,"type":"authorized","seq":"two"}`)})
		if err != nil {
			t.Fatal(err)
		}
		if len(out.Records) != 0 || r.backend.Requests() != 0 {
			t.Errorf("an undecodable authorized event: %d records, %d tool requests; want none", len(out.Records), r.backend.Requests())
		}
		if n := counter(t, reg, "ledger_events_undecodable_total"); n != 1 {
			t.Errorf("ledger_events_undecodable_total = %v; want 1", n)
		}
	})
	t.Run("newer", func(t *testing.T) {
		r := newRig(t)
		reg := metrics.New("executor", nil)
		x := r.executor(func(c *executor.Config) { c.Metrics = reg })
		before := r.admit("create_ticket", "before-newer", map[string]any{"title": "t"}, 0)
		out, err := x.Step(t.Context(), []*kgo.Record{before, event("newer", `{"v":99,"type":"authorized","seq":2,"tenant_id":"t_a","idempotency_key":"newer"}`)})
		if !errors.Is(err, ledger.ErrStop) || !errors.Is(err, ledger.ErrUnsupportedEncoding) {
			t.Fatalf("a step meeting an event of a newer encoding: %v; want ErrStop and ErrUnsupportedEncoding", err)
		}
		if len(out.Records) != 0 || r.backend.Requests() != 0 {
			t.Errorf("a stopped step: %d records, %d tool requests; want none", len(out.Records), r.backend.Requests())
		}
		if n := counter(t, reg, "ledger_events_undecodable_total"); n != 0 {
			t.Errorf("ledger_events_undecodable_total = %v; want 0 (nothing was passed over)", n)
		}
	})
}
