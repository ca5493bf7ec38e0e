package executor_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// switchedFreezes is a kill switch a test turns on, and whose state a
// test makes stale (not known to be current) until fresh is closed.
type switchedFreezes struct {
	on    atomic.Bool
	stale atomic.Bool
	fresh chan struct{}
	// revoked, if set, is a family's revocation, or a jti's.
	revoked atomic.Pointer[control.Action]
	// unfreezeOnCurrent: the next Current finds the copy caught up with
	// an unfreeze (on is turned off).
	unfreezeOnCurrent atomic.Bool
}

func (f *switchedFreezes) Revoked(jti, family string) (control.Action, bool) {
	if a := f.revoked.Load(); a != nil && (a.Family != "" && a.Family == family || a.JTI != "" && a.JTI == jti) {
		return *a, true
	}
	return control.Action{}, false
}

func (f *switchedFreezes) Current(ctx context.Context, maxStaleness time.Duration) error {
	if f.unfreezeOnCurrent.CompareAndSwap(true, false) {
		f.on.Store(false)
	}
	if !f.stale.Load() {
		return nil
	}
	// Current at once when it is, whatever ctx, as control.State: the
	// executor's gate asks with a context already done.
	select {
	case <-f.fresh:
		return nil
	default:
	}
	select {
	case <-f.fresh:
		return nil
	case <-ctx.Done():
		return &control.StaleError{MaxStaleness: maxStaleness, Err: ctx.Err()}
	}
}

func (f *switchedFreezes) CurrentAsOf(ctx context.Context, _ time.Time) error {
	return f.Current(ctx, time.Second)
}

func (f *switchedFreezes) Frozen(tool, _ string) (control.Action, bool) {
	if f.on.Load() {
		return control.Action{Kind: control.KindFreeze, Tool: tool, By: "ops", Reason: "incident"}, true
	}
	return control.Action{}, false
}

// freezeAfterFirstRequest serves the rig's backend and turns fz on once
// the first request has been answered, as an operator's freeze landing
// during a retry's backoff; it counts the requests that reach it.
func freezeAfterFirstRequest(t *testing.T, r *rig, fz *switchedFreezes) (url string, requests *atomic.Int64) {
	t.Helper()
	return afterFirstRequest(t, r, func() { fz.on.Store(true) })
}

// afterFirstRequest is a tool server in front of r's backend that calls
// then once its first request was answered.
func afterFirstRequest(t *testing.T, r *rig, then func()) (url string, requests *atomic.Int64) {
	t.Helper()
	requests = new(atomic.Int64)
	h := r.backend.Handler()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		h.ServeHTTP(w, q)
		if requests.Add(1) == 1 {
			then()
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL, requests
}

// liftedFreezes is a kill switch that holds a tenant's freeze for the
// first frozenFor reads of it, and then has lifted it.
type liftedFreezes struct {
	switchedFreezes
	reads     atomic.Int64
	frozenFor int64
}

func (f *liftedFreezes) Frozen(tool, tenant string) (control.Action, bool) {
	if f.reads.Add(1) > f.frozenFor {
		return control.Action{}, false
	}
	return control.Action{Kind: control.KindFreeze, Tool: tool, Tenant: tenant, By: "ops", ByTenant: tenant, Reason: "incident 7",
		At: time.Date(2026, 12, 7, 9, 30, 0, 0, time.UTC)}, true
}

// A request a freeze held back is refused with that freeze, even when it
// is lifted before the refusal is written: the refusal names the freeze
// the check saw. Before, the freeze was read again, and a lifted one named
// none: "frozen for every tenant since 0001-01-01" for a tenant's freeze.
// (The reads: the call's start, then its attempt's check.)
func TestHeldBackNamesTheFreezeItSaw(t *testing.T) {
	r := newRig(t)
	auth := r.admit("create_ticket", "lifted", map[string]any{"title": "t"}, 0)
	x := r.executor(func(c *executor.Config) { c.Freezes = &liftedFreezes{frozenFor: 2} })
	out, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"denied(" + executor.ReasonToolFrozen + ")"}, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	if want := "create_ticket is frozen for this tenant since 2026-12-07T09:30:00Z"; evs[0].Detail != want {
		t.Errorf("the refusal says %q; want %q", evs[0].Detail, want)
	}
	if n := r.backend.Requests(); n != 0 {
		t.Errorf("%d requests reached the tool; want none", n)
	}
}

// A freeze stops every request that would leave after it, retries
// included (before, only a call's first attempt looked at the kill
// switch). A retry after an answer that says the tool did nothing (429)
// ends the call failed, code tool_frozen; one after a request that got no
// answer, or a 5xx (neither says the effect does not exist), ends it
// outcome_unknown for the reconciler. A revocation of the family of the
// call's credential stops the retry too, code credential_family_revoked:
// before, it was looked at after the mint only, and a retry sent the
// revoked credential, which the tools refuse (401: failed tool_refused,
// with nothing to say why). After a 429 it passes: the call, which did
// nothing, is given back, its record naming the revoked family as one
// its requests reached the tool under, to be sent again under a
// credential issued after the revocation (it was failed, its key spent).
// A revocation of the call's jti stops it as a freeze does, under its
// own code, credential_revoked (it was said credential_family_revoked, a
// revocation nobody made).
func TestFreezeStopsRetries(t *testing.T) {
	for _, hold := range []string{executor.ReasonToolFrozen, executor.ReasonCredentialRevoked, executor.ReasonJTIRevoked} {
		t.Run(hold, func(t *testing.T) { testHoldStopsRetries(t, hold) })
	}
}

func testHoldStopsRetries(t *testing.T, hold string) {
	for _, tc := range []struct {
		name, tool, backendTool string
		args                    map[string]any
		fault                   demobackend.Fault
		want                    []string
		applied                 int
	}{
		{"after 429", "notify", demobackend.ToolSendEmail, map[string]any{"to": "a@example.com", "subject": "s"},
			demobackend.Fault{FailStatus: http.StatusTooManyRequests, FailTimes: 1},
			[]string{"executing", "failed(" + executor.ReasonUnavailable + ")"}, 0},
		{"after 503", "create_ticket", demobackend.ToolCreateTicket, map[string]any{"title": "t"},
			demobackend.Fault{FailStatus: http.StatusServiceUnavailable, FailTimes: 1},
			[]string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, 0},
		{"after no answer", "create_ticket", demobackend.ToolCreateTicket, map[string]any{"title": "t"},
			demobackend.Fault{ApplyThenDrop: true, FailTimes: 1},
			[]string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			auth := r.admit(tc.tool, "kf", tc.args, 0)
			r.backend.SetFault(tc.backendTool, tc.fault)
			fz := &switchedFreezes{}
			broker, err := credentials.New(credentials.Config{})
			if err != nil {
				t.Fatal(err)
			}
			url, requests := afterFirstRequest(t, r, func() {
				switch hold {
				case executor.ReasonToolFrozen:
					fz.on.Store(true)
				case executor.ReasonJTIRevoked:
					// The jti its claim recorded, as a responder reads it
					// off the call's events.
					rec, err := r.store.Get(context.Background(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "kf"})
					if err != nil || rec.Credential.JTI == "" {
						t.Errorf("the call's record names jti %q (%v); want one", rec.Credential.JTI, err)
					}
					fz.revoked.Store(&control.Action{Kind: control.KindRevoke, JTI: rec.Credential.JTI, At: time.Now(), Reason: "token leaked"})
				default:
					// After the mint: the credential, issued in a second
					// before now, falls in the revocation.
					fz.revoked.Store(&control.Action{Kind: control.KindRevoke, Family: credentials.FamilyOf(tc.tool, "t_a", broker.KeyEpoch()),
						At: time.Now(), Reason: "executor compromised"})
				}
			})
			x := r.executor(func(c *executor.Config) {
				c.Freezes, c.BaseURL, c.RetryBackoff, c.Credentials, c.RevocationSkew = fz, url, 20*time.Millisecond, broker, time.Minute
			})
			out, err := x.Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if hold == executor.ReasonCredentialRevoked && tc.fault.FailStatus == http.StatusTooManyRequests {
				family := credentials.FamilyOf(tc.tool, "t_a", broker.KeyEpoch())
				if rec := r.givenBackAfter(auth, 1); len(evs) != 0 || !slices.Equal(rec.LapsedFamilies, []string{family}) {
					t.Errorf("events %v, the record's earlier families %q; want none (given back), [%s]", summary(evs), rec.LapsedFamilies, family)
				}
			} else {
				if diff := cmp.Diff(tc.want, summary(evs)); diff != "" {
					t.Fatalf("events (-want +got):\n%s", diff)
				}
				if last := evs[len(evs)-1]; last.ErrorCode != hold || last.Attempt != 1 {
					t.Errorf("error code %q, attempt %d; want %q, 1 (the one sent)", last.ErrorCode, last.Attempt, hold)
				}
			}
			if n := requests.Load(); n != 1 {
				t.Errorf("%d requests reached the tool; want 1 (none after the freeze)", n)
			}
			if n := r.backend.AppliedIn(tc.backendTool, "t_a", "t_a/kf"); n != tc.applied {
				t.Errorf("applied %d times; want %d", n, tc.applied)
			}
		})
	}
}

// A call taken over from an owner that died sends nothing to a frozen
// tool either. It is not denied, since the first owner may have sent it:
// its outcome is left to the reconciler.
func TestTakeoverOfAFrozenToolSendsNothing(t *testing.T) {
	r := newRig(t)
	auth := r.admit("create_ticket", "kt", map[string]any{"title": "t"}, 0)
	ev := authorizedEvent(t, auth)
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
	fz := &switchedFreezes{}
	fz.on.Store(true)
	out, err := r.executor(func(c *executor.Config) { c.Freezes = fz }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	leftToReconciler(t, r, out, executor.ReasonToolFrozen, "create_ticket", "kt")
}

// A call taken over from an owner that died before it sent anything is
// held to its approval like a first run: here the approval expired
// meanwhile, so nothing is sent; and since the first owner may have sent,
// the outcome is left to the reconciler rather than denied.
func TestTakeoverRechecksTheApproval(t *testing.T) {
	r := newRig(t)
	expires := time.Now().Add(300 * time.Millisecond)
	ev, rec := r.admitApproved("kr", expires, "")
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash) // claimed while approved, then the owner died
	time.Sleep(time.Until(expires) + 50*time.Millisecond)
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	leftToReconciler(t, r, out, executor.ReasonApprovalExpired, "refund_order", "kr")
}

// A taken-over approved call of a frozen tool does not read the
// resource's version at the tool to check its approval either: it is
// held back before, its outcome left to the reconciler. Before, the
// version read reached the frozen tool.
func TestTakeoverOfAnApprovedCallReadsNothingAtAFrozenTool(t *testing.T) {
	r := newRig(t)
	ev, approved := r.admitApproved("kf", time.Now().Add(time.Hour), "v0")
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
	versions := &flakyVersions{version: "v0"}
	fz := &switchedFreezes{}
	fz.on.Store(true)
	out, err := r.executor(func(c *executor.Config) { c.Freezes, c.Versions = fz, versions }).Step(t.Context(), []*kgo.Record{approved})
	if err != nil {
		t.Fatal(err)
	}
	leftToReconciler(t, r, out, executor.ReasonToolFrozen, demobackend.ToolRefundOrder, "kf")
	if n := versions.asked.Load(); n != 0 {
		t.Errorf("the frozen tool was asked the resource's version %d times; want none", n)
	}
}

// An approved call of a frozen tool that cannot wait the freeze out (its
// approval lapses first) is denied tool_frozen before its approval's
// check reads the resource's version at the tool. On a copy of the kill
// switch not known current it is not ended at all: the freeze may have
// been lifted.
func TestApprovedCallReadsNothingAtAFrozenTool(t *testing.T) {
	r := newRig(t)
	const recheck = 300 * time.Millisecond
	versions := &flakyVersions{version: "v0"}
	fz := &switchedFreezes{}
	fz.on.Store(true)
	x := r.executor(func(c *executor.Config) { c.Freezes, c.Versions, c.FrozenRecheck = fz, versions, recheck })
	// (It lapses for the executor a second before its expiry.)
	_, lapsing := r.admitApproved("lapsing-v", time.Now().Add(time.Second+recheck/2), "v0")
	stepEndsAs(t, x, lapsing, []string{"denied(" + executor.ReasonToolFrozen + ")"}, "")
	if n := versions.asked.Load(); n != 0 {
		t.Errorf("the frozen tool was asked the resource's version %d times; want none", n)
	}

	fz.stale.Store(true)
	fz.fresh = make(chan struct{})
	ev, stale := r.admitApproved("lapsing-stale", time.Now().Add(time.Second+recheck/2), "v0")
	out, err := x.Step(t.Context(), []*kgo.Record{stale})
	if err != nil {
		t.Fatal(err)
	}
	if evs := decodeAll(t, out.Records); slices.ContainsFunc(evs, func(e ledger.Event) bool { return e.Type == statemachine.EventDenied }) {
		t.Errorf("on a stale copy of the kill switch: %v; want the call not denied", summary(evs))
	}
	if rec, err := r.store.Get(t.Context(), ev.Key()); err != nil || rec.Status == processors.StatusDenied {
		t.Errorf("on a stale copy the call's record is %s (%v); want it not denied", rec.Status, err)
	}
	if n := versions.asked.Load(); n != 0 {
		t.Errorf("on a stale copy the frozen tool was asked the resource's version %d times; want none", n)
	}

	// Stale, and not knowing the freeze, when first asked; current
	// within the check's budget, the freeze then known: acted on before
	// the version is read.
	fz.on.Store(false)
	fz.fresh = make(chan struct{})
	time.AfterFunc(100*time.Millisecond, func() { fz.on.Store(true); close(fz.fresh) })
	_, catching := r.admitApproved("lapsing-catching-up", time.Now().Add(time.Second+recheck/2), "v0")
	stepEndsAs(t, x, catching, []string{"denied(" + executor.ReasonToolFrozen + ")"}, "")
	if n := versions.asked.Load(); n != 0 {
		t.Errorf("a copy that caught up with the freeze: the frozen tool was asked the resource's version %d times; want none", n)
	}

	// Frozen when first asked, and the copy then found current with the
	// unfreeze applied: the freeze is asked again, and the call runs.
	fz.stale.Store(false)
	fz.on.Store(true)
	fz.unfreezeOnCurrent.Store(true)
	_, caughtUp := r.admitApproved("lapsing-caught-up", time.Now().Add(time.Second+recheck/2), "v0")
	stepEndsAs(t, x, caughtUp, []string{"executing", "succeeded"}, "")
}

// leftToReconciler checks that a taken-over call's step sent nothing to
// tool and ended the call outcome_unknown, code reclaimed_<why>.
func leftToReconciler(t *testing.T, r *rig, out ledger.Output, why, tool, key string) {
	t.Helper()
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, summary(evs)); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
		return
	}
	if code := evs[len(evs)-1].ErrorCode; code != "reclaimed_"+why {
		t.Errorf("error code %q; want reclaimed_%s", code, why)
	}
	if n := r.backend.AppliedIn(tool, "t_a", "t_a/"+key); n != 0 {
		t.Errorf("%s applied %d times; want 0", tool, n)
	}
}

// A freeze made while a request's new connection is still being opened
// (a slow dial: a host that drops connections, a TLS handshake) stops it:
// the kill switch is asked again once the connection is ready, before
// the request is written, and the call is denied tool_frozen, nothing
// sent. Before, the check came before the dial only, and the request
// reached the tool seconds after the freeze.
func TestFreezeDuringASlowDialStopsTheRequest(t *testing.T) {
	r := newRig(t)
	auth := r.admit("create_ticket", "slow-dial", map[string]any{"title": "t"}, 10_000)
	slow := slowDialClient()
	fz := &switchedFreezes{}
	x := r.executor(func(c *executor.Config) {
		c.Caller, c.Freezes = httptool.New(httptool.Config{Client: slow}), fz
	})
	time.AfterFunc(200*time.Millisecond, func() { fz.on.Store(true) }) // mid-dial
	stepEndsAs(t, x, auth, []string{"denied(" + executor.ReasonToolFrozen + ")"}, "")
	// Its headers may have gone (a tool's server starts a handler on
	// them); never the whole request.
	if effects := r.backend.Effects(); len(effects) != 0 {
		t.Errorf("the tool applied %+v; want nothing after the freeze", effects)
	}

	// An approval that lapses mid-dial stops the request as well (I4).
	// (It lapses for the executor a second before its expiry, the margin
	// it keeps for the hosts' clocks: 300 ms into the dial.)
	_, approved := r.admitApproved("slow-dial-approved", time.Now().Add(time.Second+300*time.Millisecond), "")
	x = r.executor(func(c *executor.Config) { c.Caller = httptool.New(httptool.Config{Client: slow}) })
	stepEndsAs(t, x, approved, []string{"denied(" + executor.ReasonApprovalExpired + ")"}, "")
	if effects := r.backend.Effects(); len(effects) != 0 {
		t.Errorf("the tool applied %+v; want nothing past the approval's expiry", effects)
	}
}

// slowDialClient is a client whose every request opens a connection of its
// own, each taking a second to dial: a host that drops connections.
func slowDialClient() *http.Client {
	var dialer net.Dialer
	return &http.Client{Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		select {
		case <-time.After(time.Second):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return dialer.DialContext(ctx, network, addr)
	}}}
}

// dialingClient is a client whose every request opens a connection of
// its own, calling dialing as it dials: after the request's last check
// before it leaves, before its gate.
func dialingClient(dialing func()) *http.Client {
	var dialer net.Dialer
	return &http.Client{Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		dialing()
		return dialer.DialContext(ctx, network, addr)
	}}}
}

// An approved call whose request the gate held back once the connection
// was ready (a freeze landed during the dial) is given back to wait the
// freeze out, as one held before it left; but the request's headers, its
// credential in them, reached the tool: the release records the
// credential's family, which the call's events then name though a later
// claim names another, and no attempt (the tool saw no whole request).
// Before, the family was on no event once the next claim named another.
func TestGateHoldAfterTheHeadersRecordsTheFamily(t *testing.T) {
	r := newRig(t)
	broker, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	family := credentials.FamilyOf(demobackend.ToolRefundOrder, "t_a", broker.KeyEpoch())
	// An agent's: a credential names one.
	_, approved := r.admitApprovedWith("gated", func(ev *ledger.Event) { ev.AgentID = "agent_1" })
	fz := &switchedFreezes{}
	x := r.executor(func(c *executor.Config) {
		c.Caller = httptool.New(httptool.Config{Client: dialingClient(func() { fz.on.Store(true) })})
		c.Freezes, c.Credentials, c.FrozenRecheck = fz, broker, time.Minute
	})
	out, err := x.Step(t.Context(), []*kgo.Record{approved})
	if err != nil {
		t.Fatal(err)
	}
	if evs := decodeAll(t, out.Records); len(evs) != 0 {
		t.Fatalf("events %v; want none (given back)", summary(evs))
	}
	if rec := r.givenBack(approved); !slices.Equal(rec.LapsedFamilies, []string{family}) {
		t.Errorf("the record given back names earlier families %q; want [%s], the family whose credential the held request's headers carried", rec.LapsedFamilies, family)
	}
	if effects := r.backend.Effects(); len(effects) != 0 {
		t.Errorf("the tool applied %+v; want nothing", effects)
	}
}

// A request the kill switch holds back at its gate says nothing of the
// tool: a half-open breaker's one probe held back leaves it half-open.
// Before, it counted a success and closed the breaker of a tool that had
// been failing and was never heard from.
func TestHeldBackProbeLeavesTheBreakerHalfOpen(t *testing.T) {
	r := newRig(t)
	r.backend.SetFault("create_ticket", demobackend.Fault{FailStatus: http.StatusServiceUnavailable, FailTimes: 1})
	fz := &switchedFreezes{}
	x := r.executor(func(c *executor.Config) {
		c.Caller, c.Freezes, c.MaxAttempts = httptool.New(httptool.Config{Client: slowDialClient()}), fz, 1
		c.Breaker = executor.BreakerConfig{MinRequests: 1, FailureRatio: 0.5, OpenFor: 100 * time.Millisecond}
	})
	ticket := map[string]any{"title": "t"}
	stepEndsAs(t, x, r.admit("create_ticket", "trips", ticket, 10_000), []string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, "http_503")
	time.Sleep(150 * time.Millisecond) // past OpenFor: the next request is the probe
	probe := r.admit("create_ticket", "probe", ticket, 10_000)
	time.AfterFunc(300*time.Millisecond, func() { fz.on.Store(true) }) // mid-dial
	stepEndsAs(t, x, probe, []string{"denied(" + executor.ReasonToolFrozen + ")"}, "")
	if got := x.BreakerStates()["create_ticket/t_a"]; got != "half-open" {
		t.Errorf("breaker %q after its probe was held back; want half-open", got)
	}
}

// An executor whose copy of the kill switch is not known to be current
// (its control consumer stalled, say) sends nothing: a request waits for
// the copy to catch up, up to its call's deadline or its claim's lease,
// whichever ends first. One that catches up in time goes out; one whose
// deadline ends the wait fails, not started, code control_state_stale;
// one whose claim's lease ends it, its deadline further off, is given
// back (executing, without an owner), to be claimed again. Before, the
// executor sent on whatever copy it had, missing the freezes it had not
// heard of; and a call whose lease ended the wait failed for good,
// control_state_stale, though nothing was sent and its deadline left
// room. One that catches up with under half of what its lease gave the
// attempt left is given back too, as a late bulkhead slot is: before, it
// was sent with that sliver, and a tool slower than that left it unknown.
func TestStaleKillSwitchSendsNothing(t *testing.T) {
	for _, tc := range []struct {
		name       string
		deadlineMS int64
		freshAfter time.Duration // 0: never
		latency    time.Duration // the tool's
		want       []string      // nil: given back
		code       string
		applied    int
	}{
		{"caught up in time", 1500, 200 * time.Millisecond, 0, []string{"executing", "succeeded"}, "", 1},
		{"never caught up", 1500, 0, 0, []string{"executing", "failed(" + executor.ReasonUnavailable + ")"}, executor.CodeControlStale, 0},
		// create_ticket's lease in the rig: two attempts of 2s.
		{"not caught up within the lease", 60_000, 0, 0, nil, "", 0},
		// About 0.5s of the lease's 4s left, under half the attempt's
		// 2s timeout, and a tool slower than that.
		{"caught up late in the lease", 60_000, 3500 * time.Millisecond, 1500 * time.Millisecond, nil, "", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			auth := r.admit("create_ticket", "ks", map[string]any{"title": "t"}, tc.deadlineMS)
			if tc.latency > 0 {
				r.backend.SetFault(demobackend.ToolCreateTicket, demobackend.Fault{Latency: tc.latency})
			}
			fz := &switchedFreezes{fresh: make(chan struct{})}
			fz.stale.Store(true)
			if tc.freshAfter > 0 {
				time.AfterFunc(tc.freshAfter, func() { close(fz.fresh) })
			}
			start := time.Now()
			x := r.executor(func(c *executor.Config) { c.Freezes = fz })
			if tc.want != nil {
				stepEndsAs(t, x, auth, tc.want, tc.code)
			} else {
				out, err := x.Step(t.Context(), []*kgo.Record{auth})
				if err != nil {
					t.Fatal(err)
				}
				if evs := decodeAll(t, out.Records); len(evs) != 0 {
					t.Fatalf("events %v, code %q; want none (given back)", summary(evs), evs[len(evs)-1].ErrorCode)
				}
				ev := authorizedEvent(t, auth)
				if rec, err := r.store.Get(t.Context(), ev.Key()); err != nil || rec.Status != processors.StatusExecuting || rec.LeaseOwner != "" {
					t.Fatalf("its record: %s owned by %q (%v); want executing, given back", rec.Status, rec.LeaseOwner, err)
				}
			}
			if n := r.backend.AppliedIn(demobackend.ToolCreateTicket, "t_a", "t_a/ks"); n != tc.applied {
				t.Errorf("applied %d times; want %d", n, tc.applied)
			}
			if n := r.backend.Requests(); tc.applied == 0 && n != 0 {
				t.Errorf("%d requests reached the tool; want none", n)
			}
			if took := time.Since(start); tc.freshAfter > 0 && took < tc.freshAfter {
				t.Errorf("the call ended after %s, before the state was current (%s)", took, tc.freshAfter)
			}
		})
	}
}

// The same on a real control State, whose consumer the broker stalls
// while a freeze of the tool is on the control topic: the executor sends
// nothing while it cannot know, and once the State reads the freeze, the
// call is denied tool_frozen. Before, it was sent on the State it had,
// without the freeze. The executor runs with the default staleness, and
// the call comes a little over a second after the freeze: the kill
// switch's promise is a second (with the default once two, this call was
// sent).
func TestStalledControlStateHoldsTheCall(t *testing.T) {
	k := ledgertest.NewInProcess(t, ledgertest.Options{Partitions: 1}) // the broker's faults are kfake's
	st := control.NewState(nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- st.Run(ctx, k.Client, k.Topics.Control) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-st.Ready():
	case <-time.After(15 * time.Second):
		t.Fatal("control state not ready after 15s")
	}

	r := newRig(t)
	auth := r.admit("create_ticket", "kc", map[string]any{"title": "t"}, 10_000)
	release := ledgertest.StallFetches(t, k.Cluster)
	freeze := control.Action{V: 1, Kind: control.KindFreeze, Subject: control.ToolSubject("create_ticket", ""), Tool: "create_ticket",
		By: "ops", ByTenant: control.PlatformTenant, Reason: "incident", At: time.Now().UTC()}
	val, err := json.Marshal(freeze)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.ProduceSync(t.Context(), &kgo.Record{Topic: k.Topics.Control, Key: []byte(freeze.Subject), Value: val}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second + 200*time.Millisecond) // the State is stale now
	time.AfterFunc(time.Second, release)

	x := r.executor(func(c *executor.Config) { c.Freezes = st })
	out, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"denied(" + executor.ReasonToolFrozen + ")"}, summary(evs)); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn(demobackend.ToolCreateTicket, "t_a", "t_a/kc"); n != 0 {
		t.Errorf("applied %d times; want 0 (frozen before it could be sent)", n)
	}
}

// A call whose credential is minted in a family revoked so recently that
// the tools still refuse the family's credentials (RevocationSkew) sends
// nothing: it is given back until the first second whose credentials
// they accept again, not sooner (its family is its executor's key's,
// which claiming it again does not change), and runs then. Before, it was
// sent, refused 401, and ended failed (tool_refused), its key spent.
// Another tenant's family, another key's, or one revoked long enough ago
// holds nothing back; one revoked a fraction of a second more than the
// window ago still does, for the credential is issued within its second.
func TestRevokedFamilyHoldsCallsBack(t *testing.T) {
	for _, tc := range []struct {
		name string
		// family is of create_ticket for tenant and key epoch epoch
		// seconds off the executor's key's; at is the revocation's time
		// off the start of the clock's second.
		tenant   string
		epoch    int64
		at       time.Duration
		held     bool
		wantEvts []string
		// lag is how far the broker's clock is behind the executor's:
		// the credential is minted before the executor looks.
		lag time.Duration
	}{
		{"just revoked", "t_a", 0, time.Hour, true, nil, 0},
		{"revoked long ago", "t_a", 0, -time.Hour, false, []string{"executing", "succeeded"}, 0},
		{"another tenant's", "t_b", 0, time.Hour, false, []string{"executing", "succeeded"}, 0},
		// Another executor's key, or this one's before it rotated.
		{"another key's", "t_a", -1, time.Hour, false, []string{"executing", "succeeded"}, 0},
		// The window ends a quarter second into the clock's second
		// (the clock reads half a second in): issued in whole seconds, a
		// credential minted now still falls in it.
		{"at the window's end", "t_a", 0, time.Second / 4, true, nil, 0},
		// Minted in the window's last second, looked at in the next:
		// what counts is the credential's iat, which the tools compare.
		{"minted within the window, looked at after it", "t_a", 0, -time.Second / 4, true, nil, 600 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			auth := r.admit("create_ticket", "kr", map[string]any{"title": "t"}, 0)
			// The executor's clock runs half a second into a second
			// when the call is first claimed.
			start := time.Now()
			second := time.Unix(start.Unix(), 0)
			offset := second.Add(time.Second / 2).Sub(start)
			clock := func() time.Time { return time.Now().Add(offset) }
			broker, err := credentials.New(credentials.Config{Now: func() time.Time { return clock().Add(-tc.lag) }})
			if err != nil {
				t.Fatal(err)
			}
			family := credentials.FamilyOf("create_ticket", tc.tenant, broker.KeyEpoch()+tc.epoch)
			revokedAt := second.Add(tc.at - time.Hour)
			fz := &switchedFreezes{}
			fz.revoked.Store(&control.Action{Kind: control.KindRevoke, Family: family, At: revokedAt, Reason: "executor compromised"})
			x := r.executor(func(c *executor.Config) {
				c.Freezes, c.RevocationSkew, c.RetryBackoff, c.Now, c.Credentials = fz, time.Hour, time.Millisecond, clock, broker
			})
			out, err := x.Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if diff := cmp.Diff(tc.wantEvts, summary(evs), cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("events (-want +got):\n%s", diff)
			}
			applied := 0
			if !tc.held {
				applied = 1
			}
			if n := r.backend.AppliedIn(demobackend.ToolCreateTicket, "t_a", "t_a/kr"); n != applied {
				t.Errorf("applied %d times; want %d", n, applied)
			}
			if !tc.held {
				if got := evs[0].CredentialFamily; got != credentials.FamilyOf("create_ticket", "t_a", broker.KeyEpoch()) {
					t.Errorf("credential family %q; want the executor's key's", got)
				}
				return
			}
			rec := r.givenBack(auth)
			// Given back until the first second after the window, by
			// the executor's clock (the store's is real time, and may
			// keep only milliseconds): not claimed again before.
			accepted := time.Unix(revokedAt.Add(time.Hour).Unix()+1, 0)
			if want := accepted.Add(-offset - time.Millisecond); rec.LeaseUntil.Before(want) {
				t.Errorf("given back until %s; want until %s at the earliest, when the tools accept the family again", rec.LeaseUntil, want)
			}
			if tc.at == time.Hour || tc.lag != 0 {
				return
			}
			out, err = x.Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			if got := summary(decodeAll(t, out.Records)); len(got) != 0 || r.backend.AppliedIn(demobackend.ToolCreateTicket, "t_a", "t_a/kr") != 0 {
				t.Errorf("stepped again within the window: events %v; want none, nothing sent", got)
			}
			time.Sleep(time.Until(rec.LeaseUntil) + 50*time.Millisecond)
			out, err = x.Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			evs = decodeAll(t, out.Records)
			if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(evs)); diff != "" {
				t.Fatalf("the call claimed again after the window (-want +got):\n%s", diff)
			}
			// The same family: the tools accept its credentials issued
			// after the window.
			if evs[0].CredentialFamily != family {
				t.Errorf("credential family %q; want %q", evs[0].CredentialFamily, family)
			}
			if n := r.backend.AppliedIn(demobackend.ToolCreateTicket, "t_a", "t_a/kr"); n != 1 {
				t.Errorf("applied %d times after the second claim; want 1", n)
			}
		})
	}
}

// A call that an approval or a compensation stands behind, whose tool is
// frozen before it starts, is given back, nothing sent, and runs once
// the freeze is lifted: denied, its key would be spent, and with it the
// approver's decision, or the undo the reconciler asked for (which it
// runs no other of). Before, both were denied tool_frozen. An agent's
// plain call is still denied, and so is an approved call whose approval
// would lapse before it is claimed again.
func TestFrozenToolHoldsCallsADecisionStandsBehind(t *testing.T) {
	r := newRig(t)
	orig, done := r.admitApproved("undone", time.Now().Add(time.Hour), "")
	if _, err := r.executor(nil).Step(t.Context(), []*kgo.Record{done}); err != nil {
		t.Fatal(err)
	}
	// An operator's undo of the refund (the reconciler's leaves a
	// success).
	undo := r.admitCompensation(orig.Key(), "u_operator")
	_, approved := r.admitApproved("approved", time.Now().Add(time.Hour), "")
	fz := &switchedFreezes{}
	fz.on.Store(true)
	const recheck = 300 * time.Millisecond
	x := r.executor(func(c *executor.Config) { c.Freezes, c.FrozenRecheck = fz, recheck })

	stepEndsAs(t, x, r.admit("create_ticket", "plain", map[string]any{"title": "t"}, 0), []string{"denied(" + executor.ReasonToolFrozen + ")"}, "")
	// (It lapses for the executor a second before its expiry, the margin
	// it keeps for the hosts' clocks.)
	_, lapsing := r.admitApproved("lapsing", time.Now().Add(time.Second+recheck/2), "")
	stepEndsAs(t, x, lapsing, []string{"denied(" + executor.ReasonToolFrozen + ")"}, "")

	held := []*kgo.Record{approved, undo}
	before, err := r.store.Get(t.Context(), orig.Key())
	if err != nil {
		t.Fatal(err)
	}
	out, err := x.Step(t.Context(), held)
	if err != nil {
		t.Fatal(err)
	}
	if evs := decodeAll(t, out.Records); len(evs) != 0 {
		t.Fatalf("events %v while the tool is frozen; want none (given back)", summary(evs))
	}
	var until time.Time
	for _, auth := range held {
		if rec := r.givenBack(auth); rec.LeaseUntil.After(until) {
			until = rec.LeaseUntil
		}
	}
	if n := r.backend.AppliedIn("refund_order", "t_a", "t_a/approved") + r.backend.AppliedIn("cancel_refund", "t_a", "t_a/undone:compensate"); n != 0 {
		t.Errorf("%d effects while the tool is frozen; want none", n)
	}
	// Held before the checks that write: the compensation's mark of the
	// call it undoes (MarkUndo), made at every claim while the freeze
	// lasted, fenced out any move of that call read before it.
	if after, err := r.store.Get(t.Context(), orig.Key()); err != nil || after.UndoMarks != before.UndoMarks {
		t.Errorf("the undone call's undo marks went from %d to %d (%v) while its compensation was held; want unchanged", before.UndoMarks, after.UndoMarks, err)
	}

	fz.on.Store(false)
	time.Sleep(time.Until(until) + 50*time.Millisecond)
	for _, auth := range held {
		stepEndsAs(t, x, auth, []string{"executing", "succeeded"}, "")
	}
	if a, u := r.backend.AppliedIn("refund_order", "t_a", "t_a/approved"), r.backend.AppliedIn("cancel_refund", "t_a", "t_a/undone:compensate"); a != 1 || u != 1 {
		t.Errorf("after the unfreeze the approved call applied %d times, the compensation %d; want 1 each", a, u)
	}
}

// A revocation the tool heard of before the executor's copy of the
// control topic (the tools ask the introspection endpoint, up to a second
// ahead) has the tool refuse the request 401: the executor asks its copy
// again, current as of the answer, and ends the call as one held back
// before it left: a family's revocation gives it back, nothing applied,
// until the tools accept the family again; a jti's denies it
// credential_revoked. Before, both ended failed tool_refused, code
// http_401, with nothing to say why.
func TestRevocationHeardFirstAtTheTool(t *testing.T) {
	for _, jti := range []bool{false, true} {
		r := newRig(t)
		broker, verifier, _ := newGuardedBackend(t, credentials.Config{})
		fz := &switchedFreezes{}
		front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			// The tool's introspection has the revocation; the
			// executor's copy gets it as the tool answers.
			a := &control.Action{Kind: control.KindRevoke, Family: credentials.FamilyOf("create_ticket", "t_a", broker.KeyEpoch()), At: time.Now(), Reason: "executor compromised"}
			if jti {
				if c, err := verifier.Inspect(req.Context(), strings.TrimPrefix(req.Header.Get("Authorization"), "Bearer ")); err == nil {
					a = &control.Action{Kind: control.KindRevoke, JTI: c.JTI, At: time.Now(), Reason: "leaked"}
				}
			}
			fz.revoked.Store(a)
			w.WriteHeader(http.StatusUnauthorized)
			io.WriteString(w, `{"error":"revoked"}`)
		}))
		t.Cleanup(front.Close)
		r.url = front.URL
		x := r.executor(func(c *executor.Config) { c.Credentials, c.Freezes, c.RevocationSkew = broker, fz, time.Hour })
		auth := r.admit("create_ticket", "revoked-at-tool", map[string]any{"title": "t"}, 0)
		if jti {
			stepEndsAs(t, x, auth, []string{"denied(" + executor.ReasonJTIRevoked + ")"}, "")
			// Its detail says what reached the tool: the credential,
			// with a request refused without effect (or its headers,
			// the body held back). Before, it said none was sent.
			ev := authorizedEvent(t, auth)
			rec, err := r.store.Get(t.Context(), ev.Key())
			if err != nil {
				t.Fatal(err)
			}
			evs, err := ledger.DecodeEvents(rec.Outbox)
			if err != nil {
				t.Fatal(err)
			}
			if d := evs[len(evs)-1].Detail; strings.Contains(d, "none was sent") || strings.HasSuffix(d, "; nothing was sent") {
				t.Errorf("the denial says %q; want it to say the credential reached the tool", d)
			}
			continue
		}
		out, err := x.Step(t.Context(), []*kgo.Record{auth})
		if err != nil {
			t.Fatal(err)
		}
		if evs := decodeAll(t, out.Records); len(evs) != 0 {
			t.Errorf("family revoked: events %v; want none (given back)", summary(evs))
		}
		// Its request reached the tool under the family: the record
		// keeps it for the events of the claim that sends it again.
		// The tool answers before it reads the body, so the executor
		// either reads its 401 (attempt 1) or, the revocation heard
		// first, holds the body back at its gate (no attempt): either
		// way the credential went, in the headers.
		family := credentials.FamilyOf("create_ticket", "t_a", broker.KeyEpoch())
		ev := authorizedEvent(t, auth)
		rec, err := r.store.Get(t.Context(), ev.Key())
		if err != nil {
			t.Fatal(err)
		}
		if rec.Status != processors.StatusExecuting || rec.LeaseOwner != "" || rec.Attempt > 1 || !slices.Equal(rec.LapsedFamilies, []string{family}) {
			t.Errorf("the record is %s owned by %q, attempt %d, earlier families %q; want given back (executing, no owner, attempt 0 or 1), [%s]",
				rec.Status, rec.LeaseOwner, rec.Attempt, rec.LapsedFamilies, family)
		}
	}
}

// An approved call whose tool is frozen after the tool answered its
// first request 429 (it did nothing) waits the freeze out, as one frozen
// before it started: given back, its record counting the attempt sent,
// and run once the freeze is lifted, its attempt numbered after that
// one. Should its approval lapse meanwhile, it ends failed, not denied:
// it started. Before, it ended failed, tool_frozen, at once, its key and
// its approval spent though nothing had happened.
func TestFreezeAfterAnAnswerHoldsAnApprovedCall(t *testing.T) {
	const recheck = 300 * time.Millisecond
	for _, tc := range []struct {
		name string
		// expires is the approval's expiry, from now; the executor
		// takes it to lapse a second before.
		expires time.Duration
		want    []string
		code    string
		attempt int
		applied int
	}{
		{"the freeze lifted in time", time.Hour, []string{"executing", "succeeded"}, "", 2, 1},
		// Two seconds to wait the freeze out in (FrozenRecheck past the
		// first step), whatever the machine's load.
		{"its approval lapsed meanwhile", 3 * time.Second, []string{"executing", "failed(" + executor.ReasonUnavailable + ")"}, executor.ReasonApprovalExpired, 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			expires := time.Now().Add(tc.expires)
			_, approved := r.admitApproved("approved-429", expires, "")
			r.backend.SetFault(demobackend.ToolRefundOrder, demobackend.Fault{FailStatus: http.StatusTooManyRequests, FailTimes: 1})
			fz := &switchedFreezes{}
			url, requests := afterFirstRequest(t, r, func() { fz.on.Store(true) })
			x := r.executor(func(c *executor.Config) {
				c.Freezes, c.BaseURL, c.RetryBackoff, c.FrozenRecheck = fz, url, 20*time.Millisecond, recheck
			})
			out, err := x.Step(t.Context(), []*kgo.Record{approved})
			if err != nil {
				t.Fatal(err)
			}
			if evs := decodeAll(t, out.Records); len(evs) != 0 || requests.Load() != 1 {
				t.Fatalf("events %v, %d requests at the tool; want none (given back), 1 (the 429)", summary(evs), requests.Load())
			}
			until := r.givenBackAfter(approved, 1).LeaseUntil
			if lapses := expires.Add(-time.Second); tc.expires < time.Hour && lapses.After(until) {
				until = lapses
			}

			fz.on.Store(false)
			time.Sleep(time.Until(until) + 50*time.Millisecond)
			out, err = x.Step(t.Context(), []*kgo.Record{approved})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if diff := cmp.Diff(tc.want, summary(evs)); diff != "" {
				t.Fatalf("claimed again (-want +got):\n%s", diff)
			}
			last := evs[len(evs)-1]
			if last.ErrorCode != tc.code || evs[0].Attempt != tc.attempt || last.Attempt != tc.attempt {
				t.Errorf("code %q, attempts %d and %d; want %q, %d", last.ErrorCode, evs[0].Attempt, last.Attempt, tc.code, tc.attempt)
			}
			// Failed where it would have been denied, it says why as
			// the denial would.
			if denied := last.Decision == "deny" && last.Detail != ""; denied != (tc.code != "") {
				t.Errorf("the outcome names decision %q, detail %q; want a denial's: %v", last.Decision, last.Detail, tc.code != "")
			}
			if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/approved-429"); n != tc.applied {
				t.Errorf("applied %d times; want %d", n, tc.applied)
			}
		})
	}
}

// A freeze starts the wait for an answering lookup again: lookups that
// failed before it (a blip) say nothing of the tool once it is lifted,
// and the call's first failing round after the freeze does not hand it
// to a human however long the freeze lasted.
func TestFreezeStartsTheWaitForAnAnswerAgain(t *testing.T) {
	r := newRig(t)
	unknown := r.unknownLookupDown("frozen-wait")
	freezes := &switchedFreezes{fresh: make(chan struct{})}
	now := time.Now()
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Freezes, c.UnansweredFor = freezes, time.Minute
		c.Now = func() time.Time { return now }
	})
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Fatalf("its first failing round: %q; want it waiting", got)
	}
	freezes.on.Store(true)
	now = now.Add(30 * time.Minute)
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Fatalf("frozen: %q; want nothing recorded", got)
	}
	freezes.on.Store(false)
	now = now.Add(time.Minute)
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Errorf("its first failing round after the freeze, 31 minutes after the first: %q; want it waiting (the wait starts again)", got)
	}
	now = now.Add(2 * time.Minute)
	if diff := cmp.Diff([]string{"parked(" + executor.ReasonLookupFailed + ")"}, r.reconcile(rc, unknown)); diff != "" {
		t.Errorf("failing for the bound after the freeze (-want +got):\n%s", diff)
	}
}

// The reconciler sends no status lookup to a frozen tool, nor while
// whether it is frozen cannot be known: no credential minted, no
// backend secret sent, nothing recorded. The call waits, its lookups not
// counted as failing, and is settled by its lookup once the freeze is
// lifted. Before, the lookups kept reaching the frozen tool at every
// sweep.
func TestReconcilerLooksNothingUpAtAFrozenTool(t *testing.T) {
	r := newRig(t)
	unknown := r.unknownLostResponse("frozen-lookup")
	freezes := &switchedFreezes{fresh: make(chan struct{})}
	freezes.on.Store(true)
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Freezes = freezes })
	before := r.backend.Requests()
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Errorf("frozen: %q; want nothing recorded", got)
	}
	freezes.on.Store(false)
	freezes.stale.Store(true)
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Errorf("the kill switch's state not known current: %q; want nothing recorded", got)
	}
	if n := r.backend.Requests() - before; n != 0 {
		t.Errorf("%d status lookups reached the tool; want none", n)
	}
	noUnansweredNote(t, r, "frozen-lookup")
	close(freezes.fresh)
	if diff := cmp.Diff([]string{"succeeded(" + executor.ReasonReconciled + ")"}, r.reconcile(rc, unknown)); diff != "" {
		t.Errorf("lifted and current (-want +got):\n%s", diff)
	}
}

// freezingLooker is a status lookup that the tool answers 503 while the
// kill switch freezes it (freezes), and counts the lookups sent.
type freezingLooker struct {
	freezes *switchedFreezes
	sent    atomic.Int32
}

func (l *freezingLooker) Lookup(context.Context, string, httptool.Request) (httptool.Response, error) {
	l.sent.Add(1)
	l.freezes.on.Store(true)
	return httptool.Response{Status: http.StatusServiceUnavailable}, &httptool.Error{Kind: httptool.ServerError, Status: http.StatusServiceUnavailable}
}

// A freeze that comes during a reconciler's pass holds back the lookups
// the pass has yet to send (its tries after one that failed, or one that
// waited for a slot meanwhile), as an attempt's check after its bulkhead
// does. The pass asked once, before the first: the rest reached the frozen
// tool, with a credential and the backend's secret.
// So too when the failed lookup opened the tool's breaker, as a tool
// that hangs (and gets frozen for it) does: the next try is held, not
// refused by the breaker, a failure that could hand the call to a human.
func TestReconcilerStopsLookingUpOnceFrozen(t *testing.T) {
	for _, breakerOpens := range []bool{false, true} {
		t.Run(fmt.Sprintf("the breaker opens %v", breakerOpens), func(t *testing.T) {
			r := newRig(t)
			key := fmt.Sprintf("frozen-mid-pass-%v", breakerOpens)
			unknown := r.unknownLostResponse(key)
			freezes := &switchedFreezes{fresh: make(chan struct{})}
			looker := &freezingLooker{freezes: freezes}
			rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
				c.Freezes, c.Looker, c.MaxAttempts = freezes, looker, 3
				if breakerOpens {
					c.Breaker = executor.BreakerConfig{MinRequests: 1, FailureRatio: 0.5, OpenFor: time.Hour}
				}
			})
			if got := r.reconcile(rc, unknown); len(got) != 0 {
				t.Errorf("frozen during the pass: %q; want nothing recorded", got)
			}
			if n := looker.sent.Load(); n != 1 {
				t.Errorf("%d status lookups sent; want 1, none once the tool was frozen", n)
			}
			noUnansweredNote(t, r, key)
		})
	}
}

// noUnansweredNote fails t if the call of key (tenant t_a) has a note of
// unanswered lookups: held lookups are not failures, and a freeze
// restarts the wait for an answer.
func noUnansweredNote(t *testing.T, r *rig, key string) {
	t.Helper()
	rec, err := r.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: key})
	if err != nil {
		t.Fatal(err)
	}
	if note, ok := rec.UnansweredAt(); ok {
		t.Errorf("the call's note of unanswered lookups: %+v; want none (held lookups are not failures)", note)
	}
}
