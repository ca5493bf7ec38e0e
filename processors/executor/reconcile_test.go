package executor_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
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
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// afterLanding is a clock past the landing window (executor.Landing) of
// the rig's calls gone unknown now: an operator may resolve them failed.
func afterLanding() time.Time { return time.Now().Add(10 * time.Minute) }

func (r *rig) reconciler() *executor.Reconciler {
	r.t.Helper()
	return r.reconcilerAt(time.Now)
}

func (r *rig) reconcilerAt(now func() time.Time) *executor.Reconciler {
	r.t.Helper()
	return r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Now = now })
}

// reconcilerWith is the rig's reconciler with set applied to its
// configuration.
func (r *rig) reconcilerWith(set func(*executor.ReconcilerConfig)) *executor.Reconciler {
	r.t.Helper()
	cfg := executor.ReconcilerConfig{
		Registry: r.reg, Store: r.store, Looker: httptool.New(httptool.Config{}), BaseURL: r.url,
		Backoff: time.Millisecond, SweepEvery: time.Hour, Now: time.Now,
	}
	set(&cfg)
	rc, err := executor.NewReconciler(cfg)
	if err != nil {
		r.t.Fatal(err)
	}
	return rc
}

// unknown runs an authorized call through the executor into
// outcome_unknown and returns the event that says so.
func (r *rig) unknown(auth *kgo.Record) *kgo.Record {
	r.t.Helper()
	return r.unknownWith(auth, nil)
}

// unknownWith is unknown with the executor's configuration changed by set.
func (r *rig) unknownWith(auth *kgo.Record, set func(*executor.Config)) *kgo.Record {
	r.t.Helper()
	out, err := r.executor(func(c *executor.Config) {
		c.MaxAttempts = 2
		if set != nil {
			set(c)
		}
	}).Step(r.t.Context(), []*kgo.Record{auth})
	if err != nil {
		r.t.Fatal(err)
	}
	if err := out.Committed(r.t.Context()); err != nil {
		r.t.Fatal(err)
	}
	last := out.Records[len(out.Records)-1]
	if string(ledger.Header(last, ledger.HeaderEventType)) != string(statemachine.EventOutcomeUnknown) {
		r.t.Fatalf("the call ended %s; want outcome_unknown", ledger.Header(last, ledger.HeaderEventType))
	}
	return last
}

func (r *rig) reconcile(rc *executor.Reconciler, recs ...*kgo.Record) []string {
	r.t.Helper()
	// The reconciler appends the events the record held again, ahead of
	// its own: only those past the events it was given are its own.
	var last int64
	for _, e := range decodeAll(r.t, recs) {
		last = max(last, e.Seq)
	}
	var own []ledger.Event
	for _, e := range r.reconcileAll(rc, recs...) {
		if e.Seq > last {
			own = append(own, e)
		}
	}
	return summary(own)
}

// reconcileAll runs one reconciler step on recs, commits it, and returns
// every event it appended.
func (r *rig) reconcileAll(rc *executor.Reconciler, recs ...*kgo.Record) []ledger.Event {
	r.t.Helper()
	out, err := rc.Step(r.t.Context(), recs)
	if err != nil {
		r.t.Fatal(err)
	}
	if out.Committed != nil {
		if err := out.Committed(r.t.Context()); err != nil {
			r.t.Fatal(err)
		}
	}
	return decodeAll(r.t, out.Records)
}

// The response was lost after the tool applied the call, every time: the
// status lookup finds the effect, and the call is recorded succeeded, with
// one effect at the tool.
func TestReconcileResponseLostAfterEffect(t *testing.T) {
	r := newRig(t)
	unknown := r.unknownLostResponse("lost-resp")
	if diff := cmp.Diff([]string{"succeeded(" + executor.ReasonReconciled + ")"}, r.reconcile(r.reconciler(), unknown)); diff != "" {
		t.Errorf("reconciled events (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/lost-resp"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
	rec, err := r.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "lost-resp"})
	if err != nil || rec.Status != processors.StatusSucceeded {
		t.Errorf("record %s, %v; want succeeded", rec.Status, err)
	}
	// A redelivered outcome_unknown finds the call settled: nothing more.
	if got := r.reconcile(r.reconciler(), unknown); len(got) != 0 {
		t.Errorf("a second pass appended %v; want nothing", got)
	}
}

// A call reconciled succeeded keeps the result its tool's status lookup
// answered, made safe as the executor makes a tool's answer: masked
// where the call's masks say (here its registry entry's), the event's
// digest then of the masked result, never of the answer as it came,
// which would confirm a guess of the hidden value to whoever reads the
// events. Before, it kept no result, and a masked call's event carried
// the digest of the unmasked lookup answer.
func TestReconcileKeepsTheLookupsResult(t *testing.T) {
	for _, masked := range []bool{false, true} {
		reg := processorstest.RegistryWith(t, "../testdata/registry", "create_ticket", func(entry map[string]any) {
			if masked {
				entry["mask"] = []any{"ticket_id"}
			}
		})
		r := newRigWith(t, reg, demobackend.Config{})
		evs := r.reconcileAll(r.reconciler(), r.unknownLostResponse("lost-result"))
		last := evs[len(evs)-1]
		if last.Type != statemachine.EventSucceeded || last.Reason != executor.ReasonReconciled {
			t.Fatalf("masked %v: reconciled %v; want it to end succeeded", masked, summary(evs))
		}
		var effs []demobackend.Effect // applied, not the replays of the executor's retries
		for _, e := range r.backend.Effects() {
			if !e.Replay {
				effs = append(effs, e)
			}
		}
		var answer struct {
			TicketID string `json:"ticket_id"`
		}
		if len(effs) != 1 || json.Unmarshal(effs[0].Result, &answer) != nil || answer.TicketID == "" {
			t.Fatalf("masked %v: effects %+v; want one applied, its answer with a ticket id", masked, effs)
		}
		rec, err := r.store.Get(t.Context(), last.Key())
		if err != nil {
			t.Fatal(err)
		}
		if kept := strings.Contains(string(rec.Result), `"ticket_id":"`+answer.TicketID+`"`); kept == masked || !strings.Contains(string(rec.Result), `"content"`) {
			t.Errorf("masked %v: stored result %s; want the lookup's result, its ticket id shown %v", masked, rec.Result, !masked)
		}
		raw := sha256.Sum256(effs[0].Result)
		if got := last.ResultDigest == "sha256:"+hex.EncodeToString(raw[:]); got == masked || last.ResultDigest == "" {
			t.Errorf("masked %v: succeeded with digest %q; want one, of the result as the tool gave it only unmasked", masked, last.ResultDigest)
		}
	}
}

// echoingLooker asks the status lookup and answers for the tool that
// stored its echo of the call's request under the key: a credential in
// the result, the executor's, which the reconciler never saw.
type echoingLooker struct{ executor.Looker }

func (e echoingLooker) Lookup(ctx context.Context, target string, req httptool.Request) (httptool.Response, error) {
	resp, err := e.Looker.Lookup(ctx, target, req)
	if err == nil {
		enc := base64.RawURLEncoding.EncodeToString
		token := enc([]byte(`{"alg":"EdDSA","typ":"ledger-credential+jwt"}`)) + "." + enc([]byte(`{"jti":"j1"}`)) + "." + enc([]byte("sig"))
		resp.Body = []byte(`{"state":"applied","result":{"ticket_id":"tk_1","debug":{"authorization":"Bearer ` + token + `"}}}`)
	}
	return resp, err
}

// A lookup's result that holds a credential (an executor's, which the
// tool echoed and stored) is kept without content, code
// result_holds_secret: the reconciler cannot know the tokens the call's
// executors sent, so any it finds is one. Before, it was kept where the
// agent reads it.
func TestReconcileWithholdsALookupResultHoldingACredential(t *testing.T) {
	r := newRig(t)
	unknown := r.unknownLostResponse("echoed-token")
	evs := r.reconcileAll(r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Looker = echoingLooker{c.Looker} }), unknown)
	last := evs[len(evs)-1]
	if last.Type != statemachine.EventSucceeded || last.ErrorCode != executor.CodeResultHoldsSecret {
		t.Fatalf("reconciled %v, code %q; want succeeded, result_holds_secret", summary(evs), last.ErrorCode)
	}
	rec, err := r.store.Get(t.Context(), last.Key())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(rec.Result), "content") || strings.Contains(string(rec.Result), "eyJ") {
		t.Errorf("stored result %s; want it without its content", rec.Result)
	}
}

// cuttingLooker asks the status lookup and cuts its answer after the
// state, as the client does at a tool's result size when the answer
// carries a result as large.
type cuttingLooker struct{ executor.Looker }

func (c cuttingLooker) Lookup(ctx context.Context, target string, req httptool.Request) (httptool.Response, error) {
	resp, err := c.Looker.Lookup(ctx, target, req)
	if err == nil {
		resp.Body = []byte(`{"state":"applied","result":{"ticket_id":"tk_1","notes":"aaaa`)
		resp.Truncated = true
	}
	return resp, err
}

// settlingLooker settles the call as failed, as an operator would, before
// it answers the status lookup.
type settlingLooker struct {
	executor.Looker
	settle func()
}

func (l settlingLooker) Lookup(ctx context.Context, target string, req httptool.Request) (httptool.Response, error) {
	l.settle()
	return l.Looker.Lookup(ctx, target, req)
}

// A lookup that answers "applied" for a call an operator resolved failed
// while it was asked leaves the call as settled, and says so at Error:
// the tool's word that the effect happened was dropped without a trace.
func TestReconcileLookupContradictingASettlementIsReported(t *testing.T) {
	r := newRig(t)
	unknown := r.unknownLostResponse("contra")
	logs := &ledgertest.LogBuffer{}
	var rc *executor.Reconciler
	op := identity.Identity{Tenant: "t_a", User: "u_ops", Roles: []string{"operator"}}
	// The operator resolves it once its last attempt can no longer land.
	resolver := r.reconcilerAt(afterLanding)
	rc = r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Logger = slog.New(slog.NewTextHandler(logs, nil))
		c.Looker = settlingLooker{Looker: c.Looker, settle: func() {
			if _, err := resolver.Resolve(t.Context(), op, ledger.CallKey{TenantID: "t_a", IdempotencyKey: "contra"}, executor.Resolution{As: processors.StatusFailed, Evidence: "the provider said no"}); err != nil {
				t.Errorf("Resolve(failed) = %v", err)
			}
		}}
	})
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Errorf("reconciled %v; want nothing (settled meanwhile)", got)
	}
	if rec, err := r.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "contra"}); err != nil || rec.Status != processors.StatusFailed {
		t.Errorf("record %s, %v; want failed, as settled", rec.Status, err)
	}
	if !strings.Contains(logs.String(), "level=ERROR") || !strings.Contains(logs.String(), "contradicts how the call was settled") {
		t.Errorf("logs %q; want the contradiction at Error", logs.String())
	}
}

// A status lookup's answer cut at the tool's result size (it carries the
// call's result) still says what happened when its state comes before the
// cut: the call is settled succeeded. Before, the cut answer did not
// parse, every lookup counted as failed, and the call was parked (or,
// under undo_unknown, its confirmed effect undone).
func TestReconcileReadsACutLookupAnswer(t *testing.T) {
	r := newRig(t)
	unknown := r.unknownLostResponse("cut-answer")
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Looker = cuttingLooker{c.Looker} })
	if diff := cmp.Diff([]string{"succeeded(" + executor.ReasonReconciled + ")"}, r.reconcile(rc, unknown)); diff != "" {
		t.Errorf("reconciled events (-want +got):\n%s", diff)
	}
}

// A tool that demands its backend secret of every request gets it with
// the status lookups too: the call whose response was lost is found
// applied. Before, the reconciler sent no secret, every lookup was
// refused 401, and the call was parked (and, under a policy that undoes
// such calls, compensated) although one lookup could settle it.
func TestReconcileSendsTheBackendSecret(t *testing.T) {
	const secret = "ticket-api-key-0b1c"
	reg := processorstest.RegistryWith(t, "../testdata/registry", "create_ticket", func(entry map[string]any) {
		entry["backend"].(map[string]any)["secret_ref"] = "ticket_api_key"
	})
	r := newRigWith(t, reg, demobackend.Config{BackendSecrets: map[string]string{demobackend.ToolCreateTicket: secret}})
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "ticket_api_key"), []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	keystore := credentials.NewKeystore(dir)
	r.backend.SetFault(demobackend.ToolCreateTicket, demobackend.Fault{ApplyThenDrop: true})
	unknown := r.unknownWith(r.admit("create_ticket", "kb", map[string]any{"title": "t"}, 0), func(c *executor.Config) { c.Secrets = keystore })
	r.backend.ClearFaults()
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Secrets = keystore })
	if diff := cmp.Diff([]string{"succeeded(" + executor.ReasonReconciled + ")"}, r.reconcile(rc, unknown)); diff != "" {
		t.Errorf("reconciled events (-want +got):\n%s", diff)
	}
	if refused := r.backend.Refusals(); len(refused) != 0 {
		t.Errorf("the backend refused %+v; want no request without its secret", refused)
	}
	if n := r.backend.AppliedIn(demobackend.ToolCreateTicket, "t_a", "t_a/kb"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// unknownNeverSent runs a create_ticket call under key into
// outcome_unknown, the tool hanging until the deadline and applying
// nothing, and returns the event that says so and the call's record.
func (r *rig) unknownNeverSent(key string) (*kgo.Record, processors.Record) {
	r.t.Helper()
	r.backend.SetFault("create_ticket", demobackend.Fault{Hang: true})
	unknown := r.unknown(r.admit("create_ticket", key, map[string]any{"title": "t"}, 1500))
	r.backend.ClearFaults()
	rec, err := r.store.Get(r.t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: key})
	if err != nil {
		r.t.Fatal(err)
	}
	return unknown, rec
}

// The tool never got the call (it hung until the deadline): the lookup
// finds nothing, and the call is recorded failed. A negative credential
// skew (none) waits as long: before, it shortened the wait below the
// tool's timeout, and not found was final at once.
func TestReconcileNothingApplied(t *testing.T) {
	for _, skew := range []time.Duration{0, -time.Minute} {
		t.Run(fmt.Sprint("credential skew ", skew), func(t *testing.T) {
			r := newRig(t)
			unknown, rec := r.unknownNeverSent("never")
			// The clocks are the outcome's time in the store plus d.
			at := func(d time.Duration) *executor.Reconciler {
				return r.reconcilerWith(func(c *executor.ReconcilerConfig) {
					c.CredentialSkew, c.Now = skew, func() time.Time { return rec.UpdatedAt.Add(d) }
				})
			}
			const timeout = 2 * time.Second // create_ticket's
			// While the last attempt could still land, not found proves
			// nothing; nor does it just past the tool's timeout, by a
			// clock that may run ahead of the store's.
			for _, d := range []time.Duration{0, timeout + executor.NotFoundSkew - time.Second} {
				if got := r.reconcile(at(d), unknown); len(got) != 0 {
					t.Errorf("reconciled %v at %v past the outcome; want nothing yet", got, d)
				}
			}
			if diff := cmp.Diff([]string{"failed(" + executor.ReasonReconciled + ")"}, r.reconcile(at(timeout+executor.NotFoundSkew+time.Second), unknown)); diff != "" {
				t.Errorf("reconciled events (-want +got):\n%s", diff)
			}
			if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/never"); n != 0 {
				t.Errorf("applied %d times; want 0", n)
			}
		})
	}
}

// A reconciler whose registry defines the call's tool version otherwise
// than the intake's that admitted it (here create_ticket.v1 edited to
// declare no status lookup, by which it would park the call for a human)
// does not settle the call by its own definition: it waits, as for a tool
// version it lacks, and one with the admitted definition resolves it.
func TestReconcileOtherDefinitionWaits(t *testing.T) {
	r := newRig(t)
	unknown, rec := r.unknownNeverSent("edited")
	edited := processorstest.RegistryWith(t, "../testdata/registry", "create_ticket", func(entry map[string]any) {
		delete(entry, "status_lookup")
	})
	later := func() time.Time { return rec.UpdatedAt.Add(time.Minute) }
	other := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Registry, c.Now = edited, later })
	if got := r.reconcile(other, unknown); len(got) != 0 {
		t.Errorf("the reconciler with the edited registry reconciled %v; want nothing", got)
	}
	if diff := cmp.Diff([]string{"failed(" + executor.ReasonReconciled + ")"}, r.reconcile(r.reconcilerAt(later), unknown)); diff != "" {
		t.Errorf("the reconciler with the admitted definition (-want +got):\n%s", diff)
	}
}

// A tool without a status lookup is never retried blindly: the call is
// parked for a human, who resolves it with the evidence.
func TestReconcileParksAndOperatorResolves(t *testing.T) {
	r := newRig(t)
	// The owner applied the effect, then died before recording it.
	auth := r.admit("notify", "crashed", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
	ev := authorizedEvent(t, auth)
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
	if _, err := httptool.New(httptool.Config{}).Call(t.Context(), httptool.Request{URL: r.url + "/tools/send_email", IdempotencyKey: "t_a/crashed", TenantID: "t_a", CallID: "c", Attempt: 1, Arguments: []byte(`{"to":"a@example.com","subject":"s"}`)}); err != nil {
		t.Fatal(err)
	}
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if last := evs[len(evs)-1]; last.Type != statemachine.EventOutcomeUnknown {
		t.Fatalf("after the crash the call is %s; want outcome_unknown", last.Type)
	}
	if err := out.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	rc := r.reconciler()
	if diff := cmp.Diff([]string{"parked(" + executor.ReasonNoStatusLookup + ")"}, r.reconcile(rc, out.Records[len(out.Records)-1])); diff != "" {
		t.Errorf("reconciled events (-want +got):\n%s", diff)
	}
	// Parked calls are not looked at again.
	if got := r.reconcile(rc, out.Records[len(out.Records)-1]); len(got) != 0 {
		t.Errorf("a parked call was reconciled again: %v", got)
	}
	key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "crashed"}
	nobody := identity.Identity{User: "u_1", Tenant: "t_a"}
	if _, err := rc.Resolve(t.Context(), nobody, key, executor.Resolution{As: processors.StatusSucceeded, Evidence: "looked"}); err == nil {
		t.Errorf("a non-operator resolved a call")
	}
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	evs, err = rc.Resolve(t.Context(), ops, key, executor.Resolution{As: processors.StatusSucceeded, Evidence: "the mail server's log has message 17"})
	if err != nil {
		t.Fatal(err)
	}
	resolved := evs[len(evs)-1]
	if resolved.Type != statemachine.EventSucceeded || resolved.Actor != "operator:u_ops" || resolved.Detail == "" || resolved.Seq != 6 {
		t.Errorf("resolution %+v; want succeeded by operator:u_ops with the evidence at seq 6", resolved)
	}
	if _, err := rc.Resolve(t.Context(), ops, key, executor.Resolution{As: processors.StatusFailed, Evidence: "again"}); err == nil {
		t.Errorf("a resolved call was resolved again")
	}
	if n := r.backend.AppliedIn("send_email", "t_a", "t_a/crashed"); n != 1 {
		t.Errorf("applied %d times; want 1 (never retried blindly)", n)
	}
}

// unknownLookupDown runs a ticket under key into outcome_unknown (its
// response lost) and then fails the tool's status lookup (503).
func (r *rig) unknownLookupDown(key string) *kgo.Record {
	r.t.Helper()
	unknown := r.unknownLostResponse(key)
	r.backend.SetFault("create_ticket/status", demobackend.Fault{FailStatus: 503})
	return unknown
}

// unknownLostResponse runs a ticket under key into outcome_unknown: the
// tool applied it and its response was lost, every time.
func (r *rig) unknownLostResponse(key string) *kgo.Record {
	r.t.Helper()
	r.backend.SetFault("create_ticket", demobackend.Fault{ApplyThenDrop: true})
	unknown := r.unknown(r.admit("create_ticket", key, map[string]any{"title": "t"}, 0))
	r.backend.ClearFaults()
	return unknown
}

// A status lookup that fails leaves the call for a later sweep: a
// burst of failures (the tool's status endpoint down, a stalled host
// timing lookups out) is no reason to hand it to a human. One that keeps
// failing parks the call, with the reason, once it has for UnansweredFor.
func TestReconcileLookupFailingParks(t *testing.T) {
	r := newRig(t)
	unknown := r.unknownLookupDown("dark")
	var later atomic.Bool // the clock past UnansweredFor
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.UnansweredFor = time.Minute
		c.Now = func() time.Time {
			if later.Load() {
				return time.Now().Add(2 * time.Minute)
			}
			return time.Now()
		}
	})
	before := r.backend.Requests()
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Errorf("after its lookups failed: %q; want nothing recorded, the call left for a later sweep", got)
	}
	if n := r.backend.Requests() - before; n != 3 {
		t.Errorf("%d status lookups; want MaxAttempts (3)", n)
	}
	later.Store(true)
	if diff := cmp.Diff([]string{"parked(" + executor.ReasonLookupFailed + ")"}, r.reconcile(rc, unknown)); diff != "" {
		t.Errorf("past UnansweredFor (-want +got):\n%s", diff)
	}
}

// A lookup the reconciler's own breaker holds off (open after other
// lookups failed) says nothing about the call: the call waits for a later
// pass, outcome_unknown, rather than being parked for a human; once it has
// waited UnansweredFor, it is parked like a call whose lookups failed.
func TestReconcileBreakerOpenWaits(t *testing.T) {
	r := newRig(t)
	unknown := r.unknownLookupDown("held-off")
	var later atomic.Bool // the clock past UnansweredFor
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		// Open at the first failure, for longer than the test.
		c.Breaker = executor.BreakerConfig{MinRequests: 1, FailureRatio: 0.5, Window: time.Hour, OpenFor: time.Hour}
		c.UnansweredFor = time.Minute
		c.Now = func() time.Time {
			if later.Load() {
				return time.Now().Add(2 * time.Minute)
			}
			return time.Now()
		}
	})
	// One lookup reaches the tool (503) and opens the breaker; the next
	// are held off.
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Errorf("with the breaker open: %q; want nothing recorded, the call left for a later pass", got)
	}
	if rec, err := r.store.Get(t.Context(), decodeAll(t, []*kgo.Record{unknown})[0].Key()); err != nil || rec.Status != processors.StatusOutcomeUnknown {
		t.Errorf("record %v (%v); want it still outcome_unknown", rec.Status, err)
	}
	later.Store(true)
	if diff := cmp.Diff([]string{"parked(" + executor.ReasonLookupFailed + ")"}, r.reconcile(rc, unknown)); diff != "" {
		t.Errorf("past UnansweredFor (-want +got):\n%s", diff)
	}
}

// The sweep of unknown outcomes pages through them: calls whose lookups
// the breaker holds off stay outcome_unknown, oldest first, and a sweep
// that read the oldest page every time never reached the calls behind a
// page of them.
func TestReconcileSweepPagesPastHeldOff(t *testing.T) {
	r := newRig(t)
	r.unknownLookupDown("held-1")
	r.unknownLookupDown("held-2")
	// A newer call, of a tool without a status lookup: a sweep that
	// reaches it parks it for a human.
	r.backend.SetFault("send_email", demobackend.Fault{ApplyThenDrop: true})
	r.unknown(r.admit("notify", "newer", map[string]any{"to": "a@example.com", "subject": "s"}, 0))
	r.backend.ClearFaults()
	r.backend.SetFault("create_ticket/status", demobackend.Fault{FailStatus: 503})
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Breaker = executor.BreakerConfig{MinRequests: 1, FailureRatio: 0.5, Window: time.Hour, OpenFor: time.Hour}
		c.SweepEvery = time.Nanosecond
	})
	executor.SetSweepLimit(rc, 2)
	var got []string
	for range 3 {
		for _, e := range r.reconcileAll(rc) {
			// The record's own events go out again ahead of the
			// reconciler's: its moves are the settled ones.
			if e.Type != statemachine.EventExecuting && e.Type != statemachine.EventOutcomeUnknown {
				got = append(got, e.IdempotencyKey+":"+string(e.Type)+"("+e.Reason+")")
			}
		}
	}
	if diff := cmp.Diff([]string{"newer:parked(" + executor.ReasonNoStatusLookup + ")"}, got); diff != "" {
		t.Errorf("three sweeps of two calls each, the oldest two held off (-want +got):\n%s", diff)
	}
}

// A pass of sweeps ends when it reaches calls that went outcome_unknown
// after it started, and goes back to the oldest: calls held off arriving
// a page a sweep would otherwise keep it from ever coming back. The gauge
// is of the oldest calls at every sweep, not those of a pass's start.
func TestReconcileSweepPassEnds(t *testing.T) {
	r := newRig(t)
	held1 := decodeAll(t, []*kgo.Record{r.unknownLookupDown("held-1")})[0].Key()
	held2 := decodeAll(t, []*kgo.Record{r.unknownLookupDown("held-2")})[0].Key()
	var later atomic.Bool // the clock past UnansweredFor
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Breaker = executor.BreakerConfig{MinRequests: 1, FailureRatio: 0.5, Window: time.Hour, OpenFor: time.Hour}
		c.SweepEvery, c.UnansweredFor = time.Nanosecond, time.Minute
		c.Now = func() time.Time {
			if later.Load() {
				return time.Now().Add(2 * time.Minute)
			}
			return time.Now()
		}
	})
	executor.SetSweepLimit(rc, 2)
	parked := func() []string {
		var keys []string
		for _, e := range r.reconcileAll(rc) {
			if e.Type == statemachine.EventParked {
				keys = append(keys, e.IdempotencyKey)
			}
		}
		slices.Sort(keys) // looked up at once, recorded as they end
		return keys
	}
	oldest := func(k ledger.CallKey) time.Time {
		rec, err := r.store.Get(t.Context(), k)
		if err != nil {
			t.Fatal(err)
		}
		return rec.UpdatedAt
	}

	// The pass starts: the two oldest, held off (the first lookup opens
	// the breaker), fill the page.
	if got := parked(); len(got) != 0 {
		t.Fatalf("first sweep parked %v; want the calls held off, left", got)
	}
	if n, at := rc.Unknown(); n != 2 || !at.Equal(oldest(held1)) {
		t.Errorf("after the first sweep: Unknown() = %d, %v; want 2 since held-1's update", n, at)
	}
	if n, at := rc.Parked(); n != 0 || !at.IsZero() {
		t.Errorf("after the first sweep: Parked() = %d, %v; want none", n, at)
	}
	// Two more go outcome_unknown during the pass; the oldest is
	// resolved by hand; the clock passes UnansweredFor.
	for _, k := range []string{"new-1", "new-2"} {
		// Taken as failing here since before the clock passes
		// UnansweredFor, as held-2's lookups did at the first sweep: a
		// call is parked only once they have failed here for the bound.
		ev := decodeAll(t, []*kgo.Record{r.unknownLookupDown(k)})[0]
		executor.NoteLookupsFailing(rc, ev.Key(), time.Now())
	}
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	if _, err := rc.Resolve(t.Context(), ops, held1, executor.Resolution{As: processors.StatusSucceeded, Evidence: "the ticket is there"}); err != nil {
		t.Fatal(err)
	}
	later.Store(true)
	if diff := cmp.Diff([]string{"new-1", "new-2"}, parked()); diff != "" {
		t.Errorf("second sweep, the pass's next page (-want +got):\n%s", diff)
	}
	if n, at := rc.Unknown(); n != 2 || !at.Equal(oldest(held2)) {
		t.Errorf("after the second sweep: Unknown() = %d, %v; want 2 since held-2's update, held-1 resolved", n, at)
	}
	// That page was of calls newer than the pass: the next sweep starts
	// again from the oldest.
	if diff := cmp.Diff([]string{"held-2"}, parked()); diff != "" {
		t.Errorf("third sweep, back at the oldest (-want +got):\n%s", diff)
	}
	// Parked, they leave outcome_unknown's gauge for the parked calls'
	// (as the third sweep began: new-1 and new-2).
	if n, at := rc.Parked(); n != 2 || !at.Equal(oldest(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "new-1"})) && !at.Equal(oldest(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "new-2"})) {
		t.Errorf("after the third sweep: Parked() = %d, %v; want 2, since new-1's or new-2's park", n, at)
	}
}

// The executor recorded an unknown outcome, logged in advance under its
// step's journal entry, and died before its transaction: the reconciler
// parks the call, appending only its own event, for the record says the
// rest is logged, and an operator may resolve it after that. The sweep
// then settles the entry as not logged and appends the executor's events
// from the outbox, which every move kept, so that the log has no gap.
func TestReconcileAfterExecutorDiedKeepsItsEvents(t *testing.T) {
	for _, resolve := range []bool{false, true} {
		t.Run(fmt.Sprintf("resolved=%v", resolve), func(t *testing.T) {
			r := newRig(t)
			auth := r.admit("notify", "died", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
			ev := authorizedEvent(t, auth)
			r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
			out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			if got := summary(decodeAll(t, out.Records)); len(got) != 2 || got[0] != "executing" {
				t.Fatalf("executor step events %v; want executing, outcome_unknown", got)
			}
			// Neither Committed nor Abandoned: the process is gone. The
			// reconciler appends what the record held ahead of its own
			// event, so that the log has no gap before it.
			rc := r.reconciler()
			var got []string
			for _, e := range r.reconcileAll(rc, out.Records[len(out.Records)-1]) {
				got = append(got, fmt.Sprintf("%d %s", e.Seq, e.Type))
			}
			if diff := cmp.Diff([]string{"3 executing", "4 outcome_unknown", "5 parked"}, got); diff != "" {
				t.Errorf("reconciled events (-want +got):\n%s", diff)
			}
			if resolve {
				ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
				evs, err := rc.Resolve(t.Context(), ops, ev.Key(), executor.Resolution{As: processors.StatusSucceeded, Evidence: "the mail server's log"})
				if err != nil {
					t.Fatal(err)
				}
				if last := evs[len(evs)-1]; last.Seq != 6 || last.Actor != "operator:u_ops" {
					t.Fatalf("resolution %+v; want seq 6 by operator:u_ops", last)
				}
			}
			seen := make(map[int64]string)
			for _, e := range decodeAll(t, r.sweep().Records) {
				seen[e.Seq] = string(e.Type)
			}
			if seen[3] != "executing" || seen[4] != "outcome_unknown" {
				t.Errorf("the sweep appended %v by seq; want the executor's executing (3) and outcome_unknown (4) among them", seen)
			}
			if resolve && seen[6] != "succeeded" {
				t.Errorf("the sweep appended %v by seq; want the resolution (6) among them, from the outbox", seen)
			}
		})
	}
}

// The executor's step and then the reconciler's were both lost: the
// record holds the parked event past a mark made in advance. A redelivered
// authorized event finds it finished and appends the whole outbox, in
// order, not only the events past that mark.
func TestRedeliveryAfterLostReconciliationAppendsInOrder(t *testing.T) {
	r := newRig(t)
	auth := r.admit("notify", "lost-twice", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
	ev := authorizedEvent(t, auth)
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	// The reconciler's transaction is lost too: no Committed.
	if _, err := r.reconciler().Step(t.Context(), out.Records[len(out.Records)-1:]); err != nil {
		t.Fatal(err)
	}
	again, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range decodeAll(t, again.Records) {
		got = append(got, fmt.Sprintf("%d %s", e.Seq, e.Type))
	}
	if diff := cmp.Diff([]string{"3 executing", "4 outcome_unknown", "5 parked"}, got); diff != "" {
		t.Errorf("redelivery appended (-want +got):\n%s", diff)
	}
	// The reclaimed call was never sent again (a tool without native
	// idempotency), nor by the redelivery.
	if n := r.backend.Requests(); n != 0 {
		t.Errorf("tool received %d requests; want 0", n)
	}
}

// lateLooker is a status lookup whose answer comes after the clock moved
// on: slow answers the request after advancing it.
type lateLooker struct {
	executor.Looker
	slow func()
}

func (l lateLooker) Lookup(ctx context.Context, url string, req httptool.Request) (httptool.Response, error) {
	resp, err := l.Looker.Lookup(ctx, url, req)
	l.slow()
	return resp, err
}

// A "not found" is taken for final by when its lookup was sent, not by
// when it answered: a lookup sent while the last attempt could still land
// may have been read before it did, however late its answer.
func TestReconcileNotFoundCountsFromTheLookupsSending(t *testing.T) {
	r := newRig(t)
	unknown, rec := r.unknownNeverSent("late-answer")
	const timeout = 2 * time.Second // create_ticket's
	var mu sync.Mutex
	d := timeout + executor.NotFoundSkew - time.Second // sent too early to tell
	now := func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		return rec.UpdatedAt.Add(d)
	}
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Now = now
		c.Looker = lateLooker{Looker: c.Looker, slow: func() {
			mu.Lock()
			defer mu.Unlock()
			d = timeout + executor.NotFoundSkew + 5*time.Second // answered well past it
		}}
	})
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Errorf("reconciled %v on a lookup sent before the last attempt's time was up; want nothing yet", got)
	}
}

// offsetClock is a reconciler's clock running ahead of the real one by
// what the test adds to it.
type offsetClock struct{ ahead atomic.Int64 }

func (c *offsetClock) now() time.Time      { return time.Now().Add(time.Duration(c.ahead.Load())) }
func (c *offsetClock) add(d time.Duration) { c.ahead.Add(int64(d)) }

// A reconciler coming back (a restart, a downtime, a backlog it had not
// reached) to a call unknown for longer than UnansweredFor does not park
// it at its first pass whose lookups fail: under undo_unknown a park
// undoes a call that may have succeeded. It parks it once the lookups
// have failed here for UnansweredFor, counted from the end of that first
// pass, however long the pass took.
func TestReconcileParksOnlyOnceFailingHereForTheBound(t *testing.T) {
	t.Run("after a downtime", func(t *testing.T) {
		r := newRig(t)
		unknown := r.unknownLookupDown("after-downtime")
		var clock offsetClock
		clock.add(10 * time.Minute)
		rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.UnansweredFor, c.Now = time.Minute, clock.now })
		if got := r.reconcile(rc, unknown); len(got) != 0 {
			t.Errorf("first failing pass, the outcome ten minutes old: %q; want nothing recorded", got)
		}
		clock.add(50 * time.Second)
		if got := r.reconcile(rc, unknown); len(got) != 0 {
			t.Errorf("failing here for 50 s of a minute: %q; want nothing recorded", got)
		}
		clock.add(20 * time.Second)
		if diff := cmp.Diff([]string{"parked(" + executor.ReasonLookupFailed + ")"}, r.reconcile(rc, unknown)); diff != "" {
			t.Errorf("failing here for 70 s of a minute (-want +got):\n%s", diff)
		}
	})
	t.Run("a first pass longer than the bound", func(t *testing.T) {
		r := newRig(t)
		unknown := r.unknownLookupDown("slow-pass")
		// A minute passes at every reading of the clock: the pass's
		// lookups take longer than UnansweredFor.
		var clock offsetClock
		rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
			c.UnansweredFor = time.Minute
			c.Now = func() time.Time { clock.add(time.Minute); return clock.now() }
		})
		if got := r.reconcile(rc, unknown); len(got) != 0 {
			t.Errorf("first failing pass: %q; want nothing recorded", got)
		}
		if diff := cmp.Diff([]string{"parked(" + executor.ReasonLookupFailed + ")"}, r.reconcile(rc, unknown)); diff != "" {
			t.Errorf("second failing pass (-want +got):\n%s", diff)
		}
	})
}

// A park that does not land (the store failing the step) leaves the
// call's failing lookups remembered: the redelivery, its lookups failing
// still, parks it at once rather than waiting the whole bound again.
func TestReconcileFailedParkKeepsTheWait(t *testing.T) {
	r := newRig(t)
	unknown := r.unknownLookupDown("park-fails")
	var clock offsetClock
	clock.add(10 * time.Minute) // the outcome older than the bound: only what the reconciler remembers holds the park back
	store := &failingMoves{Store: r.store}
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Store, c.UnansweredFor, c.Now = store, time.Minute, clock.now
	})
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Fatalf("first failing pass: %q; want nothing recorded", got)
	}
	clock.add(2 * time.Minute)
	store.n = 1
	if _, err := rc.Step(t.Context(), []*kgo.Record{unknown}); err == nil {
		t.Fatal("the step whose park failed succeeded")
	}
	if diff := cmp.Diff([]string{"parked(" + executor.ReasonLookupFailed + ")"}, r.reconcile(rc, unknown)); diff != "" {
		t.Errorf("the redelivery (-want +got):\n%s", diff)
	}
}

// A backlog of unknown outcomes whose sweep pass takes longer than any
// bound is parked at each call's second failing round of lookups: what
// the reconciler remembers of a call goes with the passes that no longer
// list it, not with the time since it last saw it, which a long pass
// would always outlast. Once parked, the calls are forgotten after a
// pass.
func TestReconcileBacklogLongerThanTheBoundIsParked(t *testing.T) {
	r := newRig(t)
	for _, k := range []string{"backlog-1", "backlog-2"} {
		r.unknownLookupDown(k)
	}
	var clock offsetClock
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.SweepEvery, c.UnansweredFor, c.Now = time.Nanosecond, time.Minute, clock.now
	})
	executor.SetSweepLimit(rc, 1)
	var parked []string
	// A call a sweep, then an empty page ending the pass, ten minutes
	// between sweeps: the first pass (sweeps 1 to 3) parks nothing, the
	// second (4 to 6) both.
	for sweep := 1; sweep <= 6; sweep++ {
		for _, e := range r.reconcileAll(rc) {
			if e.Type == statemachine.EventParked {
				parked = append(parked, fmt.Sprintf("%s(%s)@%d", e.IdempotencyKey, e.Reason, sweep))
			}
		}
		clock.add(10 * time.Minute)
	}
	want := []string{"backlog-1(" + executor.ReasonLookupFailed + ")@4", "backlog-2(" + executor.ReasonLookupFailed + ")@5"}
	if diff := cmp.Diff(want, parked); diff != "" {
		t.Errorf("six sweeps of one call each, ten minutes apart (-want +got):\n%s", diff)
	}
	if n := executor.FailingCalls(rc); n != 2 {
		t.Errorf("remembered failing: %d calls; want the 2 parked, until a pass has not listed them", n)
	}
	r.reconcileAll(rc) // a pass that lists none
	if n := executor.FailingCalls(rc); n != 0 {
		t.Errorf("after a pass without them: %d calls remembered failing; want none", n)
	}
}

// A call that went outcome_unknown after a sweep pass started, whose
// lookups failed through its event, keeps its wait when the pass's page
// that reaches it ends the pass: the next pass parks it once past the
// bound, not one that starts the wait again.
func TestReconcileCallNewerThanThePassKeepsItsWait(t *testing.T) {
	r := newRig(t)
	r.unknownLookupDown("older")
	var clock offsetClock
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.SweepEvery, c.UnansweredFor, c.Now = 30*time.Second, 2*time.Minute, clock.now
	})
	executor.SetSweepLimit(rc, 1)
	var parked []string
	sweep := func(n int, recs ...*kgo.Record) {
		for _, e := range r.reconcileAll(rc, recs...) {
			if e.Type == statemachine.EventParked {
				parked = append(parked, fmt.Sprintf("%s@%d", e.IdempotencyKey, n))
			}
		}
	}
	sweep(1) // starts a pass: a full page of the older call
	newer := r.unknownLookupDown("newer")
	clock.add(10 * time.Second)
	sweep(1, newer) // the newer call's event, no sweep due: failing since +10 s
	clock.add(30 * time.Second)
	sweep(2) // lists the newer call, updated since the pass started, and ends the pass
	clock.add(30 * time.Second)
	sweep(3) // the older call, failing for 70 s
	clock.add(time.Minute)
	sweep(4) // the newer call, failing for 2 min: 90 s had its wait started again at sweep 2
	if diff := cmp.Diff([]string{"newer@4"}, parked); diff != "" {
		t.Errorf("the passes' sweeps (-want +got):\n%s", diff)
	}
}

// A call whose lookup finds nothing while an operator's compensation of
// it is under way is not recorded failed: its undo may run (its executor
// found the call undoable), and the call would say it had no effect
// while it was undone. Once the compensation ended having undone
// nothing, the lookup settles the call failed. Before, the lookup
// recorded it failed at once, the state resolve refuses an operator
// (ErrUndoUnderWay).
func TestReconcileNotFoundLeavesACallBeingUndone(t *testing.T) {
	r := newRig(t)
	unknown, rec := r.unknownNeverSent("undoing")
	comp := r.admitCompensation(rec.Key, "u_operator")
	late := r.reconcilerAt(func() time.Time { return rec.UpdatedAt.Add(2*time.Second + executor.NotFoundSkew + time.Second) })
	if got := r.reconcile(late, unknown); len(got) != 0 {
		t.Errorf("reconciled %v while its compensation is authorized; want nothing", got)
	}
	if st, err := r.store.Get(t.Context(), rec.Key); err != nil || st.Status != processors.StatusOutcomeUnknown {
		t.Fatalf("the call is %s (%v); want outcome_unknown until its compensation ends", st.Status, err)
	}
	r.backend.SetFault("cancel_refund", demobackend.Fault{FailStatus: 400})
	if _, err := r.executor(nil).Step(t.Context(), []*kgo.Record{comp}); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"failed(" + executor.ReasonReconciled + ")"}, r.reconcile(late, unknown)); diff != "" {
		t.Errorf("once the compensation undid nothing (-want +got):\n%s", diff)
	}
}

// Where the deployment mints credentials, a status lookup's not_found is
// not final until the tools stop accepting the call's credentials: a
// request of its last attempt that reaches the tool late (queued on the
// way, or a paused executor's about to leave) is accepted until the
// credential's expiry (at most the attempt's timeout and
// AttemptCredentialSlack after it began, before the outcome was
// recorded) plus the tools' skew. Before, not_found was final the tool's
// timeout and 5 s after the outcome, and such a request could apply a
// call recorded failed.
func TestReconcileNotFoundWaitsOutTheCredentialSkew(t *testing.T) {
	broker, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	// A tool whose verifier accepts credentials longer past their expiry
	// says so in the registry.
	skewed := registryEdited(t, func(file string, def []byte) []byte {
		if strings.HasPrefix(file, "create_ticket.") {
			return bytes.Replace(def, []byte(`"backend": {`), []byte(`"backend": {"credential_skew_ms": 90000, `), 1)
		}
		return def
	})
	for _, tc := range []struct {
		name string
		reg  *schemas.Registry // nil: the test registry
		set  func(*executor.ReconcilerConfig)
		skew time.Duration
	}{
		{"default, with credentials", nil, func(c *executor.ReconcilerConfig) { c.Credentials = broker }, credentials.DefaultSkew},
		{"set", nil, func(c *executor.ReconcilerConfig) { c.CredentialSkew = 20 * time.Second }, 20 * time.Second},
		{"declared by the tool", skewed, func(c *executor.ReconcilerConfig) { c.Credentials = broker }, 90 * time.Second},
		// None of the deployment's own (negative) is not none of the
		// tool's: before, it dropped the tool's too.
		{"declared by the tool, none set", skewed, func(c *executor.ReconcilerConfig) { c.Credentials, c.CredentialSkew = broker, -time.Minute }, 90 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var r *rig
			if tc.reg != nil {
				r = newRigWith(t, tc.reg, demobackend.Config{})
			} else {
				r = newRig(t)
			}
			unknown, rec := r.unknownNeverSent("paused")
			at := func(d time.Duration) *executor.Reconciler {
				return r.reconcilerWith(func(c *executor.ReconcilerConfig) {
					tc.set(c)
					c.Now = func() time.Time { return rec.UpdatedAt.Add(d) }
				})
			}
			const timeout = 2 * time.Second // create_ticket's
			if got := r.reconcile(at(timeout+executor.NotFoundSkew+time.Second), unknown); len(got) != 0 {
				t.Errorf("reconciled %v past the tool's timeout, within the credential skew; want nothing yet", got)
			}
			accepted := timeout + executor.AttemptCredentialSlack + tc.skew
			if got := r.reconcile(at(accepted+executor.NotFoundSkew-time.Second), unknown); len(got) != 0 {
				t.Errorf("reconciled %v within the credential skew %s past the last attempt's end; want nothing yet", got, tc.skew)
			}
			if diff := cmp.Diff([]string{"failed(" + executor.ReasonReconciled + ")"}, r.reconcile(at(accepted+executor.NotFoundSkew+time.Second), unknown)); diff != "" {
				t.Errorf("past the credential skew (-want +got):\n%s", diff)
			}
		})
	}
}
