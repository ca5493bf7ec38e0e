package executor_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// newGuardedRig is newRig with a tool backend that verifies the per-call
// credential (recording each effect's jti), and the broker that mints it.
func newGuardedRig(t *testing.T) (*rig, *credentials.Broker, *demobackend.Server) {
	t.Helper()
	r := newRig(t)
	broker, _, guarded := newGuardedBackend(t, credentials.Config{})
	srv := httptest.NewServer(guarded.Handler())
	t.Cleanup(srv.Close)
	r.url = srv.URL
	return r, broker, guarded
}

// newGuardedBackend is a credential broker of cfg (its clock cfg.Now,
// nil: the real one), a verifier of its credentials on the same clock,
// and a tool backend that verifies them, closed when t ends.
func newGuardedBackend(t *testing.T, cfg credentials.Config) (*credentials.Broker, *credentials.Verifier, *demobackend.Server) {
	t.Helper()
	broker, err := credentials.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := credentials.NewVerifier(credentials.VerifierConfig{Audience: "demo-backend", Keys: broker.Keys, Now: cfg.Now})
	if err != nil {
		t.Fatal(err)
	}
	guarded := demobackend.New(demobackend.Config{Credentials: verifier})
	t.Cleanup(func() { guarded.Close() })
	return broker, verifier, guarded
}

// The claim records the credential before its request leaves: the one
// the tool was sent, whose jti and family the events name.
func TestClaimRecordsTheCredentialSent(t *testing.T) {
	r, broker, guarded := newGuardedRig(t)
	auth := r.admit("create_ticket", "claimcred", map[string]any{"title": "t"}, 0)
	evs, rec := stepSucceeds(t, r, r.executor(func(c *executor.Config) { c.Credentials = broker }), auth)
	effs := guarded.Effects()
	want := processors.CallCredential{JTI: effs[0].JTI, Family: credentials.FamilyOf("create_ticket", "t_a", broker.KeyEpoch())}
	if len(effs) != 1 || rec.Credential != want {
		t.Fatalf("record names %+v, tool effects %+v; want the one credential sent, %+v", rec.Credential, effs, want)
	}
	for _, e := range evs {
		if e.JTI != want.JTI || e.CredentialFamily != want.Family {
			t.Errorf("%s names jti %q family %q; want the claim's %+v", e.Type, e.JTI, e.CredentialFamily, want)
		}
	}
}

// admitClaimedByTheDead admits a call of tool and has a dead owner claim
// it under a credential of its own, which it returns with the call's
// authorized event.
func (r *rig) admitClaimedByTheDead(tool, key string, args map[string]any) (*kgo.Record, processors.CallCredential) {
	r.t.Helper()
	dead := processors.CallCredential{JTI: credentials.NewJTI(), Family: tool + ":t_a:1"}
	auth := r.admit(tool, key, args, 0)
	ev := authorizedEvent(r.t, auth)
	r.claimAsDeadOwnerWith(ev.Key(), ev.ArgumentsHash, dead)
	return auth, dead
}

// takeovers are the two ways a call taken over goes on: a tool without
// idempotency is not asked again (its outcome is unknown), a native one
// is, under the new owner's family.
var takeovers = []struct {
	tool   string
	args   map[string]any
	events []string
	// asked: the new owner sends, under its own family.
	asked bool
}{
	{"notify", map[string]any{"to": "a@example.com", "subject": "s"}, []string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, false},
	{"create_ticket", map[string]any{"title": "t"}, []string{"executing", "succeeded"}, true},
}

// takeOver has an executor minting with broker take auth's call over, and
// returns its events, whose summary must be want.
func (r *rig) takeOver(t *testing.T, broker *credentials.Broker, auth *kgo.Record, want []string) []ledger.Event {
	t.Helper()
	out, err := r.executor(func(c *executor.Config) { c.Credentials = broker }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff(want, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	return evs
}

// A call whose owner died after its request may have reached the tool is
// found under that request's credential: a call keeps one jti over all
// its claims, and the owner that takes it over names the dead owner's
// family on its executing event. Settled unknown (a tool without
// idempotency, not asked again), the outcome names the dead owner's
// credential too; asked again (native), the request carries the call's
// jti under the new owner's family, which its outcome names.
func TestReclaimNamesTheDeadOwnersCredential(t *testing.T) {
	for _, tc := range takeovers {
		t.Run(tc.tool, func(t *testing.T) {
			r, broker, guarded := newGuardedRig(t)
			auth, dead := r.admitClaimedByTheDead(tc.tool, "reclaim-"+tc.tool, tc.args)
			evs := r.takeOver(t, broker, auth, tc.events)
			exec, last := evs[0], evs[len(evs)-1]
			if exec.JTI != dead.JTI || exec.CredentialFamily != dead.Family || exec.CredentialScope != credentials.ToolScope(tc.tool) {
				t.Errorf("executing names jti %q family %q scope %q; want the dead owner's %+v", exec.JTI, exec.CredentialFamily, exec.CredentialScope, dead)
			}
			own := credentials.FamilyOf(tc.tool, "t_a", broker.KeyEpoch())
			effs := guarded.Effects()
			switch {
			case !tc.asked && (last.JTI != dead.JTI || last.CredentialFamily != dead.Family || len(effs) != 0):
				t.Errorf("%s names jti %q family %q, tool effects %+v; want the dead owner's %+v, the tool not asked again", last.Type, last.JTI, last.CredentialFamily, effs, dead)
			case tc.asked && (len(effs) != 1 || effs[0].JTI != dead.JTI || last.JTI != dead.JTI || last.CredentialFamily != own):
				t.Errorf("%s names jti %q family %q, tool effects %+v; want the call's jti %s under the new owner's family %s", last.Type, last.JTI, last.CredentialFamily, effs, dead.JTI, own)
			}
		})
	}
}

// When the owner that took a call over dies in turn before it recorded
// anything, the next owner names both dead owners' families: the latest
// as the executing event's credential_family, the first among its
// earlier_credential_families (on every event, for a call settled
// unknown without a credential of its own). Before, the first one's was
// on no event, and that family's blast radius missed the call.
func TestSecondTakeoverNamesEveryDeadOwnersFamily(t *testing.T) {
	for _, tc := range takeovers {
		t.Run(tc.tool, func(t *testing.T) {
			r, broker, guarded := newGuardedRig(t)
			auth, first := r.admitClaimedByTheDead(tc.tool, "reclaim-twice-"+tc.tool, tc.args)
			ev := authorizedEvent(t, auth)
			second := processors.CallCredential{JTI: credentials.NewJTI(), Family: tc.tool + ":t_a:2"}
			r.claimAsDeadOwnerWith(ev.Key(), ev.ArgumentsHash, second)
			evs := r.takeOver(t, broker, auth, tc.events)
			// The call keeps the first claim's jti over all its claims.
			exec := evs[0]
			if exec.JTI != first.JTI || exec.CredentialFamily != second.Family || !slices.Equal(exec.EarlierCredentialFamilies, []string{first.Family}) {
				t.Errorf("executing names jti %q family %q, earlier families %q; want jti %s, family %s (the owner that died last), earlier [%s] (the one before it)",
					exec.JTI, exec.CredentialFamily, exec.EarlierCredentialFamilies, first.JTI, second.Family, first.Family)
			}
			last := evs[len(evs)-1]
			own := credentials.FamilyOf(tc.tool, "t_a", broker.KeyEpoch())
			switch effs := guarded.Effects(); {
			case !tc.asked && (last.CredentialFamily != second.Family || !slices.Equal(last.EarlierCredentialFamilies, []string{first.Family}) || len(effs) != 0):
				t.Errorf("%s names family %q, earlier families %q, tool effects %+v; want the dead owners' families as on executing, the tool not asked again", last.Type, last.CredentialFamily, last.EarlierCredentialFamilies, effs)
			case tc.asked && (len(effs) != 1 || last.CredentialFamily != own || len(last.EarlierCredentialFamilies) != 0):
				t.Errorf("%s names family %q, earlier families %q, tool effects %+v; want one effect, the new owner's family %s alone", last.Type, last.CredentialFamily, last.EarlierCredentialFamilies, effs, own)
			}
		})
	}
}

// staleEpoch is a broker whose first KeyEpoch is that of a key before the
// one signing: the key rotated between the claim and the mint.
type staleEpoch struct {
	*credentials.Broker
	asked int
}

func (s *staleEpoch) KeyEpoch() int64 {
	s.asked++
	if s.asked == 1 {
		return s.Broker.KeyEpoch() - 86400
	}
	return s.Broker.KeyEpoch()
}

// A claim whose credential's family the broker no longer signs (its key
// rotated since) sends nothing: the call is given back, and claimed again
// under the new key's family, then runs.
func TestClaimAcrossAKeyRotationIsGivenBack(t *testing.T) {
	r, broker, guarded := newGuardedRig(t)
	auth := r.admit("create_ticket", "rotated", map[string]any{"title": "t"}, 0)
	x := r.executor(func(c *executor.Config) { c.Credentials = &staleEpoch{Broker: broker} })
	out, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if evs := decodeAll(t, out.Records); len(evs) != 0 || len(guarded.Effects()) != 0 {
		t.Fatalf("claimed across a rotation: events %v, tool effects %+v; want none, the call given back", summary(evs), guarded.Effects())
	}
	claimedAgainAndRun(t, x, auth)
	if effs := guarded.Effects(); len(effs) != 1 {
		t.Errorf("tool effects %+v; want one", effs)
	}
}

// A read taken over runs as a call of its own; denied before it sends (its
// tool frozen since), its one event still names the dead owner's
// credential, the one that may have read, not the one minted and never
// sent.
func TestReclaimedReadDeniedNamesTheDeadOwnersCredential(t *testing.T) {
	r, broker, guarded := newGuardedRig(t)
	auth, dead := r.admitClaimedByTheDead("get_weather", "reclaim-read", map[string]any{"city": "Oslo"})
	fz := &switchedFreezes{}
	fz.on.Store(true)
	out, err := r.executor(func(c *executor.Config) { c.Credentials, c.Freezes = broker, fz }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if len(evs) != 1 || evs[0].Type != "denied" || evs[0].JTI != dead.JTI || evs[0].CredentialFamily != dead.Family || len(guarded.Effects()) != 0 {
		t.Errorf("events %v naming %+v, tool effects %+v; want denied, naming the dead owner's %+v, nothing sent", summary(evs), evs, guarded.Effects(), dead)
	}
}

// A call taken over across a rotation of the signing key cannot be given
// back (its dead owner may have sent): it is asked again under its jti
// and the new key's family, which its outcome names.
func TestReclaimAcrossAKeyRotationRuns(t *testing.T) {
	r, broker, guarded := newGuardedRig(t)
	auth, dead := r.admitClaimedByTheDead("create_ticket", "reclaim-rotated", map[string]any{"title": "t"})
	evs, _ := stepSucceeds(t, r, r.executor(func(c *executor.Config) { c.Credentials = &staleEpoch{Broker: broker} }), auth)
	own := credentials.FamilyOf("create_ticket", "t_a", broker.KeyEpoch())
	if effs := guarded.Effects(); len(effs) != 1 || effs[0].JTI != dead.JTI || evs[1].JTI != dead.JTI || evs[1].CredentialFamily != own {
		t.Errorf("outcome names jti %q family %q, tool effects %+v; want the call's jti %s under the key signing now, %s", evs[1].JTI, evs[1].CredentialFamily, effs, dead.JTI, own)
	}
}

// jtiRevoked is a kill switch that has revoked one jti and nothing else.
type jtiRevoked struct{ jti string }

func (f jtiRevoked) Revoked(jti, _ string) (control.Action, bool) {
	if jti == f.jti {
		return control.Action{Kind: control.KindRevoke, JTI: jti, By: "ops", Reason: "leaked"}, true
	}
	return control.Action{}, false
}
func (jtiRevoked) Current(context.Context, time.Duration) error { return nil }
func (jtiRevoked) CurrentAsOf(context.Context, time.Time) error { return nil }
func (jtiRevoked) Frozen(string, string) (control.Action, bool) { return control.Action{}, false }

// A call keeps its jti for life, so once that jti is revoked the tools
// refuse every credential of the call: taken over, it is not sent again
// (the tool would answer 401, and the call end failed though its dead
// owner's request may have applied), and ends outcome_unknown for the
// reconciler to find out.
func TestReclaimOfARevokedJTISendsNothing(t *testing.T) {
	r, broker, guarded := newGuardedRig(t)
	auth, dead := r.admitClaimedByTheDead("create_ticket", "reclaim-revoked", map[string]any{"title": "t"})
	out, err := r.executor(func(c *executor.Config) { c.Credentials, c.Freezes = broker, jtiRevoked{dead.JTI} }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, summary(evs)); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if last := evs[len(evs)-1]; last.ErrorCode != "reclaimed_"+executor.ReasonJTIRevoked || last.JTI != dead.JTI || len(guarded.Effects()) != 0 || r.backend.Requests() != 0 {
		t.Errorf("outcome code %q naming jti %q, tool effects %+v; want reclaimed_%s, naming %s, nothing sent", last.ErrorCode, last.JTI, guarded.Effects(), executor.ReasonJTIRevoked, dead.JTI)
	}
}

// A call whose attempts outlast its credential (a tool with a long
// timeout: its first attempt took past the credential's five minutes and
// was answered 503) is sent again under the same credential renewed: the
// same jti and family, a later expiry, which the tool accepts. Before, the
// retry carried the expired token, the tool refused it 401, and the call
// ended outcome_unknown though the tool had applied nothing.
func TestCredentialRenewedForAnAttemptItWouldNotOutlast(t *testing.T) {
	reg := processorstest.RegistryWith(t, "../testdata/registry", "create_ticket", func(entry map[string]any) {
		entry["timeout_ms"] = 200_000
	})
	r := newRigWith(t, reg, demobackend.Config{})
	var skip atomic.Int64 // how far the shared clock is ahead
	clock := func() time.Time { return time.Now().Add(time.Duration(skip.Load())) }
	broker, _, guarded := newGuardedBackend(t, credentials.Config{Now: clock})
	guarded.SetFault(demobackend.ToolCreateTicket, demobackend.Fault{FailStatus: http.StatusServiceUnavailable, FailTimes: 1})
	var sent []string // the Authorization of each request
	tool := guarded.Handler()
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		sent = append(sent, req.Header.Get("Authorization"))
		tool.ServeHTTP(w, req)
		if len(sent) == 1 {
			// The first attempt took six minutes: past the credential's
			// five, and the tools' 30 s of skew.
			skip.Store(int64(6 * time.Minute))
		}
	}))
	t.Cleanup(front.Close)
	r.url = front.URL
	auth := r.admit("create_ticket", "renew", map[string]any{"title": "t"}, 0)
	evs, _ := stepSucceeds(t, r, r.executor(func(c *executor.Config) { c.Credentials, c.Now = broker, clock }), auth)
	effs := guarded.Effects()
	if len(sent) != 2 || len(effs) != 1 {
		t.Fatalf("%d requests, effects %+v; want 2 requests (a 503, then the renewed credential's), 1 effect", len(sent), effs)
	}
	if sent[0] == sent[1] {
		t.Errorf("the retry carried the first attempt's token; want it renewed")
	}
	if effs[0].JTI != evs[0].JTI || evs[1].JTI != evs[0].JTI {
		t.Errorf("the tool applied under jti %q, the events name %q and %q; want one jti, renewed", effs[0].JTI, evs[0].JTI, evs[1].JTI)
	}
	if want := credentials.FamilyOf("create_ticket", "t_a", broker.KeyEpoch()); evs[1].CredentialFamily != want {
		t.Errorf("family %q; want %q", evs[1].CredentialFamily, want)
	}
}

// A tool that echoes its request's headers into its answer, and replays a
// key's first answer to its retries, hands back the credential's earlier
// token after a renewal: the result is kept without content (code
// result_holds_secret), as it is for the token sent last. Before, only
// the token sent last was looked for, and the earlier one, still valid
// for a while, was stored where the agent reads it.
func TestResultHoldingARenewedCredentialsEarlierTokenIsWithheld(t *testing.T) {
	reg := processorstest.RegistryWith(t, "../testdata/registry", "create_ticket", func(entry map[string]any) {
		entry["timeout_ms"] = 200_000
	})
	r := newRigWith(t, reg, demobackend.Config{})
	var skip atomic.Int64
	clock := func() time.Time { return time.Now().Add(time.Duration(skip.Load())) }
	broker, err := credentials.New(credentials.Config{Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	var sent []string
	var first []byte // the key's answer, as the tool stored it
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		sent = append(sent, req.Header.Get("Authorization"))
		if first == nil {
			first, _ = json.Marshal(map[string]any{"ticket_id": "tk_1", "debug": map[string]string{"authorization": req.Header.Get("Authorization")}})
			skip.Store(int64(6 * time.Minute)) // past the credential's life
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(first) // the key's answer, replayed
	}))
	t.Cleanup(echo.Close)
	r.url = echo.URL
	auth := r.admit("create_ticket", "renew-echo", map[string]any{"title": "t"}, 0)
	rec := succeededWith(t, r, r.executor(func(c *executor.Config) { c.Credentials, c.Now = broker, clock }), auth, executor.CodeResultHoldsSecret)
	if len(sent) != 2 || sent[0] == sent[1] {
		t.Fatalf("requests sent %d, the same token twice %v; want 2, the second renewed", len(sent), len(sent) == 2 && sent[0] == sent[1])
	}
	if strings.Contains(string(rec.Result), "content") || strings.Contains(string(rec.Result), "eyJ") {
		t.Errorf("stored result %s; want it without its content", rec.Result)
	}
}

// A call taken over whose tool answers with a credential it stored from
// an earlier request (the dead owner's, which this executor never saw) is
// kept without content (result_holds_secret); masked, the token is hidden
// and the result kept. Before, only this executor's own tokens were
// looked for, and the dead owner's was kept where the agent reads it.
func TestTakenOverResultHoldingAnotherOwnersCredential(t *testing.T) {
	enc := base64.RawURLEncoding.EncodeToString
	deadToken := enc([]byte(`{"alg":"EdDSA","typ":"ledger-credential+jwt"}`)) + "." + enc([]byte(`{"jti":"j0"}`)) + "." + enc([]byte("sig"))
	for _, masked := range []bool{false, true} {
		reg := processorstest.RegistryWith(t, "../testdata/registry", "create_ticket", func(entry map[string]any) {
			if masked {
				entry["mask"] = []any{"debug"}
			}
		})
		r := newRigWith(t, reg, demobackend.Config{})
		echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"ticket_id":"tk_1","debug":{"authorization":"Bearer ` + deadToken + `"}}`))
		}))
		t.Cleanup(echo.Close)
		r.url = echo.URL
		broker, err := credentials.New(credentials.Config{})
		if err != nil {
			t.Fatal(err)
		}
		auth, _ := r.admitClaimedByTheDead("create_ticket", "taken-echo", map[string]any{"title": "t"})
		code := executor.CodeResultHoldsSecret
		if masked {
			code = ""
		}
		rec := succeededWith(t, r, r.executor(func(c *executor.Config) { c.Credentials = broker }), auth, code)
		if strings.Contains(string(rec.Result), deadToken) || masked != strings.Contains(string(rec.Result), "tk_1") {
			t.Errorf("masked %v: stored result %s; want no token, the content kept only masked", masked, rec.Result)
		}
	}
}

// The event that settles a call after a status lookup names the lookup's
// credential (its jti, the status scope and the reconciler's family):
// before, no event named it, and a responder who found its jti in a
// tool's logs (it reads the call's result) could find neither the call nor
// the family to revoke. Its jti is its own, not the call's: revoking the
// call's (leaked with its request) must not stop the lookups, or a call
// that succeeded would be parked, and under undo_unknown undone.
func TestReconcileLookupCredentialNamed(t *testing.T) {
	r, broker, guarded := newGuardedRig(t)
	guarded.SetFault("create_ticket", demobackend.Fault{ApplyThenDrop: true})
	unknown := r.unknownWith(r.admit("create_ticket", "lookupjti", map[string]any{"title": "t"}, 0), func(c *executor.Config) { c.Credentials = broker })
	guarded.ClearFaults()
	key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "lookupjti"}
	rec, err := r.store.Get(t.Context(), key)
	if err != nil || rec.Credential.JTI == "" {
		t.Fatalf("the call's record names credential %+v (%v); want its jti", rec.Credential, err)
	}
	minted := &mintLog{Minter: broker}
	evs := r.reconcileAll(r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Credentials = minted }), unknown)
	last := evs[len(evs)-1]
	if last.Type != statemachine.EventSucceeded {
		t.Fatalf("reconciled %s; want succeeded", last.Type)
	}
	if len(minted.creds) != 1 {
		t.Fatalf("the reconciler minted %d credentials; want 1, the lookup's", len(minted.creds))
	}
	want := []string{minted.creds[0].JTI, credentials.StatusScope("create_ticket"), credentials.FamilyOf("create_ticket", "t_a", broker.KeyEpoch())}
	if got := []string{last.JTI, last.CredentialScope, last.CredentialFamily}; !slices.Equal(got, want) {
		t.Errorf("the settling event names jti, scope, family %q; want the lookup's %q", got, want)
	}
	if last.JTI == rec.Credential.JTI {
		t.Errorf("the lookup was sent under the call's jti %s; want one of its own", rec.Credential.JTI)
	}
}

// stallingLooker is the reconciler's status lookup: it answers its first
// lookup 503 without sending it, and moves the reconciler's clock on by
// skip as it does (the try and a wait for a slot took that long); later
// ones go to next. It keeps the credential of each.
type stallingLooker struct {
	next   executor.Looker
	clock  *atomic.Int64 // the reconciler's clock's offset, ns
	skip   time.Duration
	mu     sync.Mutex
	tokens []string
}

func (l *stallingLooker) Lookup(ctx context.Context, target string, req httptool.Request) (httptool.Response, error) {
	l.mu.Lock()
	l.tokens = append(l.tokens, req.Credential)
	first := len(l.tokens) == 1
	l.mu.Unlock()
	if first {
		l.clock.Add(int64(l.skip))
		return httptool.Response{Status: http.StatusServiceUnavailable}, &httptool.Error{Kind: httptool.ServerError, Status: http.StatusServiceUnavailable}
	}
	return l.next.Lookup(ctx, target, req)
}

// A status lookup's credential lives for its try (the tool's timeout and
// 2 s), as a call's attempt's does, and a try it would not outlast (the
// tries before took long) sends it renewed, under the same jti and
// family, which the settling event names. Before, it lived the whole
// credential TTL (5 minutes), for whoever read it off a tool's logs to
// read the call's result with.
func TestReconcileLookupCredentialLivesForItsTry(t *testing.T) {
	r, broker, guarded := newGuardedRig(t)
	guarded.SetFault("create_ticket", demobackend.Fault{ApplyThenDrop: true})
	unknown := r.unknownWith(r.admit("create_ticket", "lookuplife", map[string]any{"title": "t"}, 0), func(c *executor.Config) { c.Credentials = broker })
	guarded.ClearFaults()
	tool, err := r.reg.Lookup("create_ticket", 1)
	if err != nil {
		t.Fatal(err)
	}
	minted := &mintLog{Minter: broker}
	var offset atomic.Int64
	looker := &stallingLooker{next: httptool.New(httptool.Config{}), clock: &offset, skip: time.Minute}
	evs := r.reconcileAll(r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Credentials, c.Looker, c.MaxAttempts = minted, looker, 2
		c.Now = func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }
	}), unknown)
	last := evs[len(evs)-1]
	if last.Type != statemachine.EventSucceeded {
		t.Fatalf("reconciled %s; want succeeded, on the second try", last.Type)
	}
	if len(minted.creds) != 2 || len(looker.tokens) != 2 {
		t.Fatalf("minted %d credentials for %d tries; want the first try's and its renewal", len(minted.creds), len(looker.tokens))
	}
	first, renewed := minted.creds[0], minted.creds[1]
	if life, most := first.ExpiresAt.Sub(first.IssuedAt), tool.Timeout()+3*time.Second; life > most {
		t.Errorf("the lookup's credential lives %s; want at most its try's %s", life, most)
	}
	if renewed.JTI != first.JTI || renewed.Family != first.Family || !renewed.ExpiresAt.After(first.ExpiresAt) {
		t.Errorf("renewed %s (%s) until %s; want %s's jti and family, later than %s", renewed.JTI, renewed.Family, renewed.ExpiresAt, first.JTI, first.ExpiresAt)
	}
	if looker.tokens[0] != first.Token || looker.tokens[1] != renewed.Token {
		t.Errorf("the tries were sent under credentials other than the one minted and its renewal")
	}
	if last.JTI != first.JTI {
		t.Errorf("the settling event names jti %s; want the lookup's %s", last.JTI, first.JTI)
	}
}

// A status lookup whose credential's family was revoked (the
// reconciler's, say, its lookups' tokens leaked) is held, not sent, and
// not counted a failed lookup: the tools would refuse it, and each
// refusal moved the call towards a human and an undo. Nor one whose jti
// was. Before, the reconciler went on minting and sending them.
func TestReconcileLookupOfARevokedCredentialIsHeld(t *testing.T) {
	for _, byJTI := range []bool{false, true} {
		t.Run(fmt.Sprintf("by jti %v", byJTI), func(t *testing.T) {
			r, broker, guarded := newGuardedRig(t)
			key := fmt.Sprintf("lookuprevoked-%v", byJTI)
			guarded.SetFault("create_ticket", demobackend.Fault{ApplyThenDrop: true})
			unknown := r.unknownWith(r.admit("create_ticket", key, map[string]any{"title": "t"}, 0), func(c *executor.Config) { c.Credentials = broker })
			guarded.ClearFaults()
			freezes := &switchedFreezes{fresh: make(chan struct{})}
			looker := &freezingLooker{freezes: &switchedFreezes{}}
			minter := revokingMinter{Minter: broker, freezes: freezes, byJTI: byJTI}
			rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
				c.Credentials, c.Freezes, c.Looker = minter, freezes, looker
			})
			if got := r.reconcile(rc, unknown); len(got) != 0 {
				t.Errorf("the lookup's credential revoked: %q; want nothing recorded", got)
			}
			if n := looker.sent.Load(); n != 0 {
				t.Errorf("%d status lookups sent; want none under a revoked credential", n)
			}
			noUnansweredNote(t, r, key)
		})
	}
}

// A revocation the tool heard of before the reconciler's copy of the
// control topic (the tools ask the introspection endpoint, up to a
// second ahead) has the tool refuse the lookup 401: the reconciler asks
// its copy again, current as of the answer, and holds the pass, as it
// would have held the lookup, rather than count the refusals as failed
// lookups, which move the call towards a human and an undo.
func TestReconcileLookupRevokedFirstAtTheTool(t *testing.T) {
	r, broker, guarded := newGuardedRig(t)
	guarded.SetFault("create_ticket", demobackend.Fault{ApplyThenDrop: true})
	unknown := r.unknownWith(r.admit("create_ticket", "lookup401", map[string]any{"title": "t"}, 0), func(c *executor.Config) { c.Credentials = broker })
	guarded.ClearFaults()
	freezes := &laggingRevocations{switchedFreezes: switchedFreezes{fresh: make(chan struct{})}}
	var sent atomic.Int32
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		sent.Add(1)
		// The tool's introspection has the revocation; the
		// reconciler's copy gets it once asked to be current as of
		// the answer.
		freezes.pending.Store(&control.Action{Kind: control.KindRevoke, Family: credentials.FamilyOf("create_ticket", "t_a", broker.KeyEpoch()), At: time.Now(), Reason: "leaked"})
		w.WriteHeader(http.StatusUnauthorized)
		io.WriteString(w, `{"error":"revoked"}`)
	}))
	t.Cleanup(front.Close)
	r.url = front.URL
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Credentials, c.Freezes = broker, freezes })
	if got := r.reconcile(rc, unknown); len(got) != 0 {
		t.Errorf("the lookup refused 401 for a revocation: %q; want nothing recorded", got)
	}
	if n := sent.Load(); n != 1 {
		t.Errorf("%d lookups sent; want 1, the pass held once its copy had the revocation", n)
	}
	noUnansweredNote(t, r, "lookup401")
}

// laggingRevocations is a copy of the control topic that reads the
// revocation pending only once asked to be current as of a time, as one
// behind the tools' introspection by up to a second does.
type laggingRevocations struct {
	switchedFreezes
	pending atomic.Pointer[control.Action]
}

func (f *laggingRevocations) CurrentAsOf(ctx context.Context, t time.Time) error {
	if a := f.pending.Swap(nil); a != nil {
		f.revoked.Store(a)
	}
	return f.switchedFreezes.CurrentAsOf(ctx, t)
}

// revokingMinter mints as its Minter does, and revokes each credential
// minted, or its family, on freezes, as at its mint.
type revokingMinter struct {
	executor.Minter
	freezes *switchedFreezes
	byJTI   bool
}

func (m revokingMinter) Mint(g credentials.Grant) (credentials.Credential, error) {
	c, err := m.Minter.Mint(g)
	if err == nil {
		a := control.Action{Kind: control.KindRevoke, Family: c.Family, At: c.IssuedAt, Reason: "leaked"}
		if m.byJTI {
			a.Family, a.JTI = "", c.JTI
		}
		m.freezes.revoked.Store(&a)
	}
	return c, err
}

// mintLog is a Minter that keeps what it minted.
type mintLog struct {
	executor.Minter
	creds []credentials.Credential
}

func (m *mintLog) Mint(g credentials.Grant) (credentials.Credential, error) {
	c, err := m.Minter.Mint(g)
	if err == nil {
		m.creds = append(m.creds, c)
	}
	return c, err
}

// A call's credential lives no longer than the attempt it is sent with
// (the tool's timeout and 2 s), so that a request of the call that
// reaches the tool late (queued on the way) is refused by the time the
// reconciler, Landing after the call went outcome_unknown, takes the
// tool's not_found as final. Before, the credential lived to the claim's
// stop: a call whose attempts were answered 503 at once went
// outcome_unknown with its credential good for most of its lease, and a
// queued request of it was accepted past Landing.
func TestCredentialExpiresWithItsAttempt(t *testing.T) {
	reg := processorstest.RegistryWith(t, "../testdata/registry", "create_ticket", func(entry map[string]any) {
		entry["timeout_ms"] = 10_000
	})
	tool, err := reg.Lookup("create_ticket", 1)
	if err != nil {
		t.Fatal(err)
	}
	r := newRigWith(t, reg, demobackend.Config{})
	broker, verifier, guarded := newGuardedBackend(t, credentials.Config{})
	guarded.SetFault(demobackend.ToolCreateTicket, demobackend.Fault{FailStatus: http.StatusServiceUnavailable, FailTimes: 3})
	type send struct{ at, expires time.Time }
	var (
		mu   sync.Mutex
		sent []send
	)
	handler := guarded.Handler()
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		at := time.Now()
		if c, err := verifier.Inspect(req.Context(), strings.TrimPrefix(req.Header.Get("Authorization"), "Bearer ")); err == nil {
			mu.Lock()
			sent = append(sent, send{at, c.ExpiresAt})
			mu.Unlock()
		}
		handler.ServeHTTP(w, req)
	}))
	t.Cleanup(front.Close)
	r.url = front.URL
	auth := r.admit("create_ticket", "short-lived", map[string]any{"title": "t"}, 0)
	out, err := r.executor(func(c *executor.Config) { c.Credentials = broker }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	last := evs[len(evs)-1]
	mu.Lock()
	defer mu.Unlock()
	if len(sent) < 2 || len(guarded.Effects()) != 0 {
		t.Fatalf("%d requests with a credential, effects %+v, events %v; want its attempts, each answered 503, none applied", len(sent), guarded.Effects(), summary(evs))
	}
	landing := executor.Landing(tool, credentials.DefaultSkew)
	for i, s := range sent {
		if end := s.at.Add(tool.Timeout() + 2*time.Second); s.expires.After(end) {
			t.Errorf("attempt %d, sent at %s, carried a credential expiring at %s; want by its attempt's end and 2 s, %s", i+1, s.at.Format(time.RFC3339Nano), s.expires.Format(time.RFC3339), end.Format(time.RFC3339Nano))
		}
		if accepted, settled := s.expires.Add(credentials.DefaultSkew), last.At.Add(landing); accepted.After(settled) {
			t.Errorf("attempt %d's requests are accepted until %s, past %s, when the reconciler takes a not_found of the call (%s at %s) as final", i+1, accepted.Format(time.RFC3339), settled.Format(time.RFC3339Nano), last.Type, last.At.Format(time.RFC3339Nano))
		}
	}
}

// unrenewingMinter mints the first credential, and refuses every renewal
// with err: as a broker whose signing key rotated meanwhile does
// (ErrFamilyChanged), or one asked too late (ErrDeadlinePassed).
type unrenewingMinter struct {
	executor.Minter
	err   error
	mints atomic.Int32
}

func (m *unrenewingMinter) Mint(g credentials.Grant) (credentials.Credential, error) {
	if m.mints.Add(1) > 1 {
		return credentials.Credential{}, fmt.Errorf("mint %s: %w", g.Tool, m.err)
	}
	return m.Minter.Mint(g)
}

// clockAtCurrent is the kill switch's state, whose every look at its
// freshness (the executor's, right before a request leaves) first runs
// then.
type clockAtCurrent struct {
	*switchedFreezes
	then func()
}

func (f clockAtCurrent) Current(ctx context.Context, maxStaleness time.Duration) error {
	f.then()
	return f.switchedFreezes.Current(ctx, maxStaleness)
}

// A call whose credential would expire before its request lands, and
// cannot be renewed (the signing key rotated during the wait before its
// attempt, or too little of the lease is left), is not sent: given back,
// nothing sent, to be claimed again (under the new key's family), saying
// which. Before, it was sent as it was, the tool refused it 401, and the
// call ended failed with its key spent.
func TestCredentialNotRenewedIsNotSent(t *testing.T) {
	for err, reason := range map[error]string{credentials.ErrFamilyChanged: "credential_key_rotated", credentials.ErrDeadlinePassed: "credential_late"} {
		r := newRig(t)
		var skip atomic.Int64 // how far the shared clock is ahead
		clock := func() time.Time { return time.Now().Add(time.Duration(skip.Load())) }
		broker, _, guarded := newGuardedBackend(t, credentials.Config{Now: clock})
		srv := httptest.NewServer(guarded.Handler())
		t.Cleanup(srv.Close)
		r.url = srv.URL
		// Between the mint and the request, 40 s pass: past the
		// credential's expiry (create_ticket's 2 s timeout and 2 s) and
		// the tools' 30 s of skew.
		fz := clockAtCurrent{&switchedFreezes{}, func() { skip.Store(int64(40 * time.Second)) }}
		var logs bytes.Buffer
		x := r.executor(func(c *executor.Config) {
			c.Credentials, c.Freezes, c.Now = &unrenewingMinter{Minter: broker, err: err}, fz, clock
			c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		})
		auth := r.admit("create_ticket", "unrenewed", map[string]any{"title": "t"}, 0)
		out, err := x.Step(t.Context(), []*kgo.Record{auth})
		if err != nil {
			t.Fatal(err)
		}
		if evs := decodeAll(t, out.Records); len(evs) != 0 || guarded.Requests() != 0 || len(guarded.Effects()) != 0 {
			t.Errorf("%s: events %v, %d requests at the tool, effects %+v; want none (given back, nothing sent)", reason, summary(evs), guarded.Requests(), guarded.Effects())
		}
		r.givenBack(auth)
		if !strings.Contains(logs.String(), "reason="+reason) {
			t.Errorf("the give-back's log does not say %s:\n%s", reason, logs.String())
		}
	}
}

// A call whose request the tool answered 429, and whose credential then
// could not be renewed for the retry because the signing key rotated
// meanwhile, is given back (the tool did nothing), not failed, its record
// counting the attempt sent; the claim after it sends it under the new
// key's family, numbering its attempt after that one, and its executing
// event names the family its first request reached the tool under too,
// as earlier. Claimed again past its deadline, it ends failed, not
// expired: it started. Before, the call ended failed
// (credential_key_rotated) at once, its key spent though nothing
// happened; given back without its family, the events would have named
// only the new one, and a revocation of the old family would not have
// found the call.
func TestRotationAfterAnAnswerGivesBackNamingTheFamilySent(t *testing.T) {
	for _, late := range []bool{false, true} {
		t.Run(fmt.Sprintf("late=%v", late), func(t *testing.T) { testRotationAfterAnAnswer(t, late) })
	}
}

func testRotationAfterAnAnswer(t *testing.T, late bool) {
	r := newRig(t)
	// Keys that rotate every second or so, credentials that live one:
	// the clock skips little, and the claim's lease (the store's clock)
	// still holds.
	const ttl, skew, cacheFor = time.Second, time.Millisecond, time.Millisecond
	rotateEvery := credentials.Config{TTL: ttl, Skew: skew, CacheFor: cacheFor}.MinRotateEvery()
	var skip atomic.Int64 // how far the shared clock is ahead
	clock := func() time.Time { return time.Now().Add(time.Duration(skip.Load())) }
	broker, _, guarded := newGuardedBackend(t, credentials.Config{TTL: ttl, Skew: skew, CacheFor: cacheFor, RotateEvery: rotateEvery, Now: clock})
	srv := httptest.NewServer(guarded.Handler())
	t.Cleanup(srv.Close)
	r.url = srv.URL
	guarded.SetFault(demobackend.ToolCreateTicket, demobackend.Fault{FailStatus: http.StatusTooManyRequests, FailTimes: 1})

	// Right before the retry leaves, the key rotates: the next key is
	// published, then signs, and the first credential has expired.
	var rotated atomic.Bool
	fz := clockAtCurrent{&switchedFreezes{}, func() {
		if guarded.Requests() == 1 && !rotated.Swap(true) {
			skip.Store(int64(rotateEvery - cacheFor))
			broker.KeyEpoch()
			skip.Store(int64(rotateEvery + 100*time.Millisecond))
		}
	}}
	x := r.executor(func(c *executor.Config) {
		c.Credentials, c.Freezes, c.Now, c.RetryBackoff = broker, fz, clock, 20*time.Millisecond
	})
	var deadlineMS int64
	if late {
		deadlineMS = 3000
	}
	auth := r.admit("create_ticket", "rotated-after-429", map[string]any{"title": "t"}, deadlineMS)
	out, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if evs := decodeAll(t, out.Records); len(evs) != 0 || guarded.Requests() != 1 || len(guarded.Effects()) != 0 {
		t.Fatalf("events %v, %d requests at the tool, effects %+v; want none, one request (the 429), none (given back)", summary(evs), guarded.Requests(), guarded.Effects())
	}
	// The family its claim recorded, and its request went under.
	rec := r.givenBackAfter(auth, 1)
	first := rec.Credential.Family
	if !strings.HasPrefix(first, "create_ticket:t_a:") || !slices.Equal(rec.LapsedFamilies, []string{first}) {
		t.Errorf("the record given back names earlier families %q; want [%s], the one its request reached the tool under", rec.LapsedFamilies, first)
	}

	if late {
		// Past its deadline on the executor's clock, which is ahead.
		time.Sleep(time.Until(rec.DeadlineAt) - time.Duration(skip.Load()) + 100*time.Millisecond)
		evs := claimedAgainEndsAs(t, x, auth, []string{"executing", "failed(" + executor.ReasonDeadlineExceeded + ")"})
		if evs[0].Attempt != 1 || !slices.Equal(evs[0].EarlierCredentialFamilies, []string{first}) || guarded.Requests() != 1 {
			t.Errorf("executing names attempt %d, earlier families %q, %d requests at the tool; want attempt 1 (the 429), [%s], 1", evs[0].Attempt, evs[0].EarlierCredentialFamilies, guarded.Requests(), first)
		}
		return
	}
	evs := claimedAgainAndRun(t, x, auth)
	// The executing event names the earlier families, as after a
	// takeover; the outcome, its own credential's, of a key since.
	second := evs[0].CredentialFamily
	if second == first || !strings.HasPrefix(second, "create_ticket:t_a:") {
		t.Errorf("executing names family %q; want one of a key that rotated in since %s", second, first)
	}
	if exec := evs[0]; !slices.Equal(exec.EarlierCredentialFamilies, []string{first}) || exec.Attempt != 2 {
		t.Errorf("executing names earlier families %q, attempt %d; want [%s], attempt 2 (after the 429)", exec.EarlierCredentialFamilies, exec.Attempt, first)
	}
	if last := evs[len(evs)-1]; last.CredentialFamily != second {
		t.Errorf("%s names family %q; want %s", last.Type, last.CredentialFamily, second)
	}
	if effs := guarded.Effects(); len(effs) != 1 {
		t.Errorf("tool effects %+v; want one", effs)
	}
}

// twiceSending is a proxy in front of a tool that sends each request on
// again when it lost the answer: it sends every request twice and
// answers with the second answer.
type twiceSending struct{}

func (twiceSending) RoundTrip(req *http.Request) (*http.Response, error) {
	body, err := io.ReadAll(req.Body)
	if err != nil {
		return nil, err
	}
	send := func() (*http.Response, error) {
		r := req.Clone(req.Context())
		r.Body = io.NopCloser(bytes.NewReader(body))
		return http.DefaultTransport.RoundTrip(r)
	}
	first, err := send()
	if err != nil {
		return nil, err
	}
	_, _ = io.Copy(io.Discard, first.Body)
	first.Body.Close()
	return send()
}

// spendingTool is a tool without idempotency that spends each credential
// with its effect, as one verifying with the credentials package does
// (Verifier.Spend): a second request under a bearer is refused 401
// spent, and applies nothing.
type spendingTool struct {
	mu      sync.Mutex
	spent   map[string]bool
	effects int
}

func (s *spendingTool) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	bearer := r.Header.Get("Authorization")
	w.Header().Set("Content-Type", "application/json")
	if s.spent[bearer] {
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprintf(w, `{"error":%q,"message":"the credential already had its effect"}`, credentials.ReasonSpent)
		return
	}
	s.spent[bearer] = true
	s.effects++
	fmt.Fprint(w, `{"sent":true}`)
}

// A call of a tool without idempotency whose request a proxy sent twice:
// the first applied it and spent its credential, the second was refused
// spent (401), the answer the executor got. The call's outcome is
// unknown, not failed: the tool said its credential had its effect, and
// failed, its agent would send it again under another key, the email
// twice. Before, it ended failed, tool_refused http_401.
func TestCredentialSpentAtTheToolIsNoFailure(t *testing.T) {
	r, broker, _ := newGuardedRig(t)
	tool := &spendingTool{spent: map[string]bool{}}
	srv := httptest.NewServer(tool)
	t.Cleanup(srv.Close)
	r.url = srv.URL
	auth := r.admit("notify", "spent-by-proxy", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
	x := r.executor(func(c *executor.Config) {
		c.Credentials, c.Caller = broker, httptool.New(httptool.Config{Client: &http.Client{Transport: twiceSending{}}})
	})
	stepEndsAs(t, x, auth, []string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, "credential_spent")
	if tool.effects != 1 || len(tool.spent) != 1 {
		t.Errorf("the tool applied %d effects under %d credentials; want the one the proxy's first request made", tool.effects, len(tool.spent))
	}

	// A read has no effect to be unsure of: refused spent, it failed,
	// and is not handed to the reconciler (which would park it).
	read := r.admit("get_weather", "read-spent-by-proxy", map[string]any{"city": "Oslo"}, 0)
	stepEndsAs(t, x, read, []string{"executing", "failed(" + executor.ReasonToolRefused + ")"}, "http_401")
}
