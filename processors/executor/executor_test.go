package executor_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/boltstore"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// rig drives the intake's and the executor's steps by hand, without
// Kafka, against the embedded store and the demo backend: each test
// decides exactly which records a step sees and which commits happen.
type rig struct {
	t       *testing.T
	store   processors.Store
	reg     *schemas.Registry
	backend *demobackend.Server
	url     string
	in      *intake.Processor
	ident   *processorstest.Identity
}

func newRig(t *testing.T) *rig {
	t.Helper()
	reg, err := schemas.Load(os.DirFS("../testdata/registry"))
	if err != nil {
		t.Fatal(err)
	}
	return newRigWith(t, reg, demobackend.Config{})
}

// newRigWith is newRig with registry reg and a backend configured by bc.
func newRigWith(t *testing.T, reg *schemas.Registry, bc demobackend.Config) *rig {
	t.Helper()
	return newRigStore(t, reg, bc, boltstore.Config{})
}

// newRigStore is newRigWith on a store configured by sc (its Path set
// here).
func newRigStore(t *testing.T, reg *schemas.Registry, bc demobackend.Config, sc boltstore.Config) *rig {
	t.Helper()
	sc.Path = filepath.Join(t.TempDir(), "x.db")
	st, err := boltstore.Open(sc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	b := demobackend.New(bc)
	srv := httptest.NewServer(b.Handler())
	t.Cleanup(func() { b.Close(); srv.Close() })
	ident := processorstest.NewIdentity(t)
	in, err := intake.New(intake.Config{Registry: reg, Store: st, Identity: ident.Verifier, Policy: processorstest.Policy(t, "../testdata/policies")})
	if err != nil {
		t.Fatal(err)
	}
	return &rig{t: t, store: st, reg: reg, backend: b, url: srv.URL, in: in, ident: ident}
}

func (r *rig) executor(mod func(*executor.Config)) *executor.Executor {
	r.t.Helper()
	cfg := executor.Config{
		Registry: r.reg, Store: r.store, Caller: httptool.New(httptool.Config{}),
		BaseURL: r.url, Owner: "x-test", MaxAttempts: 2, RetryBackoff: time.Millisecond,
		LeaseMargin: 10 * time.Millisecond, SweepEvery: time.Hour,
		// The rig reads each call's events from the step that ran it;
		// the carry-over tests set a budget.
		StepBudget: -1,
	}
	if mod != nil {
		mod(&cfg)
	}
	x, err := executor.New(cfg)
	if err != nil {
		r.t.Fatal(err)
	}
	return x
}

// admit runs an envelope through the intake's step, commits it, and
// returns the authorized event's record.
func (r *rig) admit(tool, key string, args map[string]any, deadlineMS int64) *kgo.Record {
	r.t.Helper()
	return r.admitAs("t_a", tool, key, args, deadlineMS)
}

// admitAs is admit for a tenant's call.
func (r *rig) admitAs(tenant, tool, key string, args map[string]any, deadlineMS int64) *kgo.Record {
	r.t.Helper()
	argBytes, _ := json.Marshal(args)
	tree, err := ledger.Decode(argBytes, ledger.Limits{})
	if err != nil {
		r.t.Fatal(err)
	}
	hash, err := ledger.ArgumentsHash(tenant, tool, 1, tree)
	if err != nil {
		r.t.Fatal(err)
	}
	env := map[string]any{
		"tool": tool, "tool_version": 1, "call_id": "call_" + key, "arguments": args,
		"scope": map[string]any{"tenant_id": tenant}, "idempotency_key": key, "arguments_hash": hash,
		"assertion": r.ident.Assertion(r.t, tenant, "u_1"),
	}
	if deadlineMS > 0 {
		env["deadline_ms"] = deadlineMS
	}
	val, _ := json.Marshal(env)
	out, err := r.in.Step(r.t.Context(), []*kgo.Record{{Topic: "toolcalls.requests", Value: val}})
	if err != nil {
		r.t.Fatal(err)
	}
	if err := out.Committed(r.t.Context()); err != nil {
		r.t.Fatal(err)
	}
	for _, rec := range out.Records {
		if string(ledger.Header(rec, ledger.HeaderEventType)) == string(statemachine.EventAuthorized) {
			return rec
		}
	}
	r.t.Fatalf("intake did not authorize %s: %d records", key, len(out.Records))
	return nil
}

func decodeAll(t *testing.T, recs []*kgo.Record) []ledger.Event {
	t.Helper()
	var evs []ledger.Event
	for _, r := range recs {
		e, err := ledger.DecodeEvent(r.Value)
		if err != nil {
			t.Fatal(err)
		}
		evs = append(evs, e)
	}
	return evs
}

func summary(evs []ledger.Event) []string {
	var s []string
	for _, e := range evs {
		x := string(e.Type)
		if e.Reason != "" {
			x += "(" + e.Reason + ")"
		}
		s = append(s, x)
	}
	return s
}

// stepEndsAs runs one step of x on rec and checks the events it appends
// (their summary) and the last one's error code.
func stepEndsAs(t *testing.T, x *executor.Executor, rec *kgo.Record, want []string, code string) {
	t.Helper()
	out, err := x.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff(want, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	if got := evs[len(evs)-1].ErrorCode; got != code {
		t.Errorf("error code %q; want %q", got, code)
	}
}

// claimAsDeadOwner claims key as an owner that then dies, and waits until
// its lease is over.
func (r *rig) claimAsDeadOwner(key ledger.CallKey, hash string) {
	r.t.Helper()
	r.claimAsDeadOwnerWith(key, hash, processors.CallCredential{})
}

// claimAsDeadOwnerWith is claimAsDeadOwner, the dead owner's claim naming
// cred, the credential it minted and may have sent.
func (r *rig) claimAsDeadOwnerWith(key ledger.CallKey, hash string, cred processors.CallCredential) {
	r.t.Helper()
	res, err := r.store.Claim(r.t.Context(), []processors.Claim{{Key: key, ArgumentsHash: hash, Owner: "dead", Lease: 20 * time.Millisecond, Credential: cred}})
	// Reclaimed: the owner before it died too.
	if err != nil || res[0].Outcome != processors.Claimed && res[0].Outcome != processors.Reclaimed {
		r.t.Fatalf("claim as dead owner: %v %+v", err, res)
	}
	ledgertest.WaitFor(r.t, 5*time.Second, func() error {
		exp, err := r.store.Expired(r.t.Context(), 10)
		if err != nil {
			return err
		}
		if len(exp) == 0 {
			return context.DeadlineExceeded
		}
		return nil
	})
}

// givenBack checks that the call of auth, its authorized event, was
// given back (executing, no owner, no attempt recorded), and returns its
// record.
func (r *rig) givenBack(auth *kgo.Record) processors.Record {
	r.t.Helper()
	return r.givenBackAfter(auth, 0)
}

// givenBackAfter is givenBack for a call whose requests the tool
// answered without effect, attempts of them: the record's attempt says
// how many.
func (r *rig) givenBackAfter(auth *kgo.Record, attempts int) processors.Record {
	r.t.Helper()
	ev := authorizedEvent(r.t, auth)
	rec, err := r.store.Get(r.t.Context(), ev.Key())
	if err != nil {
		r.t.Fatal(err)
	}
	if rec.Status != processors.StatusExecuting || rec.LeaseOwner != "" || rec.Attempt != attempts {
		r.t.Errorf("%s is %s owned by %q, attempt %d; want given back (executing, no owner, attempt %d)", rec.Key, rec.Status, rec.LeaseOwner, rec.Attempt, attempts)
	}
	return rec
}

func authorizedEvent(t *testing.T, rec *kgo.Record) ledger.Event {
	t.Helper()
	e, err := ledger.DecodeEvent(rec.Value)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestStepRunsAuthorizedCall(t *testing.T) {
	r := newRig(t)
	auth := r.admit("create_ticket", "k1", map[string]any{"title": "t"}, 0)
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	if evs[0].Seq != 3 || evs[1].Seq != 4 || evs[1].Attempt != 1 {
		t.Errorf("seqs %d,%d attempt %d; want 3,4 attempt 1", evs[0].Seq, evs[1].Seq, evs[1].Attempt)
	}
	effs := r.backend.Effects()
	if len(effs) != 1 || effs[0].IdempotencyKey != "t_a/k1" {
		t.Errorf("backend effects %+v; want one with Idempotency-Key t_a/k1", effs)
	}
	// Its events name the definition it ran by: the one its record binds.
	rec, err := r.store.Get(t.Context(), evs[0].Key())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range evs {
		if rec.ToolDigest == "" || e.ToolDigest != rec.ToolDigest {
			t.Errorf("%s event names tool digest %q; want the record's, %q", e.Type, e.ToolDigest, rec.ToolDigest)
		}
	}
}

// A lost Kafka commit after the store recorded the outcome: the redelivered
// authorized event re-appends the same events and does not run the tool.
func TestOutcomeReappendedWhenCommitLost(t *testing.T) {
	r := newRig(t)
	x := r.executor(nil)
	auth := r.admit("notify", "k2", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
	first, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	// The transaction aborted: the loop runs Abandoned, never Committed,
	// before the batch comes again.
	if first.Abandoned == nil {
		t.Fatal("a step that recorded an outcome has no Abandoned; want the undo of its journal entry")
	}
	if err := first.Abandoned(t.Context()); err != nil {
		t.Fatal(err)
	}
	again, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(decodeAll(t, first.Records), decodeAll(t, again.Records)); diff != "" {
		t.Errorf("re-appended events differ (-first +again):\n%s", diff)
	}
	if n := r.backend.Requests(); n != 1 {
		t.Errorf("tool received %d requests; want 1", n)
	}
	// Once committed, a further redelivery appends nothing.
	if err := again.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	third, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if len(third.Records) != 0 || r.backend.Requests() != 1 {
		t.Errorf("after commit: %d records, %d requests; want 0, 1", len(third.Records), r.backend.Requests())
	}
}

// An owner died mid-call: a tool without idempotency must not run again.
func TestExpiredLeaseOnNoneToolIsOutcomeUnknown(t *testing.T) {
	r := newRig(t)
	auth := r.admit("notify", "k3", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
	ev := authorizedEvent(t, auth)
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, summary(decodeAll(t, out.Records))); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if n := r.backend.Requests(); n != 0 {
		t.Errorf("tool received %d requests; want 0", n)
	}
}

// An owner died mid-call: an idempotency-native tool runs again, with the
// same downstream key.
func TestExpiredLeaseOnNativeToolRetriesWithSameKey(t *testing.T) {
	r := newRig(t)
	auth := r.admit("create_ticket", "k4", map[string]any{"title": "t"}, 0)
	ev := authorizedEvent(t, auth)
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(decodeAll(t, out.Records))); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/k4"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// The sweep finds a dead owner's call without any event arriving.
func TestSweepFindsExpiredClaims(t *testing.T) {
	r := newRig(t)
	auth := r.admit("notify", "k5", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
	ev := authorizedEvent(t, auth)
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
	x := r.executor(func(c *executor.Config) { c.SweepEvery = time.Nanosecond })
	out, err := x.Step(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	if evs[1].CallID != "call_k5" || evs[1].Tool != "notify" {
		t.Errorf("swept events lost the call's identity: %+v", evs[1])
	}
}

func TestDeadlinePassedBeforeExecutionExpires(t *testing.T) {
	r := newRig(t)
	auth := r.admit("create_ticket", "k6", map[string]any{"title": "t"}, 1)
	x := r.executor(func(c *executor.Config) {
		c.Now = func() time.Time { return time.Now().Add(time.Second) }
	})
	out, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"expired(" + executor.ReasonDeadlineExceeded + ")"}, summary(decodeAll(t, out.Records))); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if n := r.backend.Requests(); n != 0 {
		t.Errorf("tool received %d requests; want 0", n)
	}
}

// A tool without idempotency that applied the effect and then failed: the
// outcome is ambiguous, and it is not retried. A 408 is such a failure: a
// proxy answers it when the tool took too long, which may be after the
// tool applied the call (before, it was taken for a throttle, and the
// call sent again).
func TestNoneToolServerErrorIsNotRetried(t *testing.T) {
	for _, status := range []int{http.StatusInternalServerError, http.StatusRequestTimeout} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			r := newRig(t)
			r.backend.SetFault("send_email", demobackend.Fault{ApplyThenFail: status})
			auth := r.admit("notify", "k7", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
			out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, summary(evs)); diff != "" {
				t.Errorf("events (-want +got):\n%s", diff)
			}
			if n := r.backend.AppliedIn("send_email", "t_a", "t_a/k7"); n != 1 {
				t.Errorf("applied %d times; want exactly 1 (no retry)", n)
			}
			if code := evs[len(evs)-1].ErrorCode; code != fmt.Sprintf("http_%d", status) {
				t.Errorf("error code %q; want http_%d", code, status)
			}
		})
	}
}

// countingCaller answers every request with err, and counts them.
type countingCaller struct {
	n   atomic.Int32
	err error
}

func (c *countingCaller) Call(context.Context, httptool.Request) (httptool.Response, error) {
	c.n.Add(1)
	return httptool.Response{}, c.err
}

// A Caller's error of no kind the executor knows may have reached the
// tool: a tool without idempotency is not sent it again, and its outcome
// is unknown.
func TestUnclassifiedCallerErrorIsNotRetried(t *testing.T) {
	r := newRig(t)
	caller := &countingCaller{err: errors.New("a transport of its own failed")}
	auth := r.admit("notify", "k-odd", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
	out, err := r.executor(func(c *executor.Config) { c.Caller = caller }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, summary(decodeAll(t, out.Records))); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if n := caller.n.Load(); n != 1 {
		t.Errorf("%d requests; want exactly 1 (no retry)", n)
	}
}

// A native tool that applied the effect and answered 5xx (it failed after
// its effect, or a gateway in front of it lost its answer) has not said
// that nothing happened: a retry under the same key that replays the
// stored answer settles the call, and when none does (the tool keeps
// answering 5xx, or no retry is left) its outcome is unknown, for the
// reconciler to look up. Before, it ended failed (tool_failed), and the
// agent, told nothing happened, could apply it again under a new key.
func TestNativeToolServerErrorAfterItsEffectIsNeverFailed(t *testing.T) {
	for _, tc := range []struct {
		name     string
		fault    demobackend.Fault
		attempts int
		want     []string
		code     string
	}{
		{"every attempt answered 502", demobackend.Fault{ApplyThenFail: http.StatusBadGateway}, 0,
			[]string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, "http_502"},
		{"one attempt, answered 504", demobackend.Fault{ApplyThenFail: http.StatusGatewayTimeout}, 1,
			[]string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, "http_504"},
		// A proxy's 408 after the tool applied it: no room to ask again.
		{"one attempt, answered 408", demobackend.Fault{ApplyThenFail: http.StatusRequestTimeout}, 1,
			[]string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, "http_408"},
		{"408, then the retry replays", demobackend.Fault{ApplyThenFail: http.StatusRequestTimeout, FailTimes: 1}, 0,
			[]string{"executing", "succeeded"}, ""},
		{"502, then the retry replays", demobackend.Fault{ApplyThenFail: http.StatusBadGateway, FailTimes: 1}, 0,
			[]string{"executing", "succeeded"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			r.backend.SetFault("create_ticket", tc.fault)
			auth := r.admit("create_ticket", "k5xx", map[string]any{"title": "t"}, 0)
			x := r.executor(func(c *executor.Config) {
				if tc.attempts > 0 {
					c.MaxAttempts = tc.attempts
				}
			})
			out, err := x.Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if diff := cmp.Diff(tc.want, summary(evs)); diff != "" {
				t.Fatalf("events (-want +got):\n%s", diff)
			}
			if last := evs[len(evs)-1]; last.ErrorCode != tc.code {
				t.Errorf("error code %q; want %q", last.ErrorCode, tc.code)
			}
			if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/k5xx"); n != 1 {
				t.Errorf("applied %d times; want 1", n)
			}
		})
	}
}

// A read tool has no effect to be unsure of: a 5xx, or no answer, on
// every attempt ends the call failed (tool_failed), retried first, not
// outcome_unknown, which would park it for a human when the tool declares
// no status lookup, as reads do not; an answer the client cannot place (a
// redirect: its URL moved) fails at once, saying the status, not retried
// into a timeout.
func TestReadToolFailuresEndFailed(t *testing.T) {
	for _, tc := range []struct {
		name     string
		fault    demobackend.Fault
		code     string
		requests int64
	}{
		{"5xx", demobackend.Fault{FailStatus: http.StatusServiceUnavailable}, "http_503", 2},
		{"no answer", demobackend.Fault{Hang: true}, executor.CodeTimeout, 2},
		{"the connection closed", demobackend.Fault{ApplyThenDrop: true}, executor.CodeConnectionLost, 2},
		{"a redirect", demobackend.Fault{FailStatus: http.StatusMovedPermanently}, "http_301", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			r.backend.SetFault("get_weather", tc.fault)
			auth := r.admit("get_weather", "kread", map[string]any{"city": "Oslo"}, 0)
			out, err := r.executor(func(c *executor.Config) { c.MaxAttempts = 2 }).Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if diff := cmp.Diff([]string{"executing", "failed(" + executor.ReasonToolFailed + ")"}, summary(evs)); diff != "" {
				t.Fatalf("events (-want +got):\n%s", diff)
			}
			if code, n := evs[1].ErrorCode, r.backend.Requests(); code != tc.code || n != tc.requests {
				t.Errorf("error code %q after %d requests; want %q after %d", code, n, tc.code, tc.requests)
			}
		})
	}
}

// A write whose every attempt got no answer ends outcome_unknown, its
// code saying which way the answer failed to come: connection_lost when
// the tool closed the connection (a crash, a proxy's reset), timeout when
// the tool was still working at the attempt's end. Before, a connection
// lost read "timeout" for a native tool, sending whoever looked to the
// tool's latency, and "unknown" for the others.
func TestNoAnswerSaysWhy(t *testing.T) {
	for _, tc := range []struct {
		name, tool string
		fault      demobackend.Fault
		code       string
	}{
		{"native, the connection closed", "create_ticket", demobackend.Fault{ApplyThenDrop: true}, executor.CodeConnectionLost},
		{"native, no answer in time", "create_ticket", demobackend.Fault{Hang: true}, executor.CodeTimeout},
		{"not idempotent, the connection closed", "notify", demobackend.Fault{ApplyThenDrop: true}, executor.CodeConnectionLost},
		{"not idempotent, no answer in time", "notify", demobackend.Fault{Hang: true}, executor.CodeTimeout},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			// notify is the backend's send_email.
			route, args := "create_ticket", map[string]any{"title": "t"}
			if tc.tool == "notify" {
				route, args = "send_email", note
			}
			r.backend.SetFault(route, tc.fault)
			auth := r.admit(tc.tool, "k-"+tc.code, args, 0)
			stepEndsAs(t, r.executor(func(c *executor.Config) { c.MaxAttempts = 2 }), auth,
				[]string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, tc.code)
		})
	}
}

// lateMinter is a credential broker for which the call's deadline leaves
// no time: what credentials.Broker answers within the deadline's second.
type lateMinter struct{}

func (lateMinter) Mint(g credentials.Grant) (credentials.Credential, error) {
	return credentials.Credential{}, fmt.Errorf("mint %s: %w", g.Tool, credentials.ErrDeadlinePassed)
}

func (lateMinter) KeyEpoch() int64 { return 1 }

// A call whose deadline leaves too little time for its credential expires
// (deadline_exceeded), as one past its deadline does; it does not fail for
// want of a credential, which would point operators at the broker.
func TestCallTooLateForACredentialExpires(t *testing.T) {
	r := newRig(t)
	auth := r.admit("create_ticket", "klate", map[string]any{"title": "t"}, 800)
	out, err := r.executor(func(c *executor.Config) { c.Credentials = lateMinter{} }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"expired(" + executor.ReasonDeadlineExceeded + ")"}, summary(decodeAll(t, out.Records))); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if n := r.backend.Requests(); n != 0 {
		t.Errorf("tool received %d requests; want 0", n)
	}
}

// claimedAgainAndRun steps x over auth until the call, given back, is
// claimed again and succeeds.
func claimedAgainAndRun(t *testing.T, x *executor.Executor, auth *kgo.Record) []ledger.Event {
	t.Helper()
	return claimedAgainEndsAs(t, x, auth, []string{"executing", "succeeded"})
}

// claimedAgainEndsAs steps auth until its call is claimed again and ends
// with the events want (summary), which it returns.
func claimedAgainEndsAs(t *testing.T, x *executor.Executor, auth *kgo.Record, want []string) []ledger.Event {
	t.Helper()
	var evs []ledger.Event
	ledgertest.WaitFor(t, 5*time.Second, func() error {
		out, err := x.Step(t.Context(), []*kgo.Record{auth})
		if err != nil {
			return err
		}
		evs = decodeAll(t, out.Records)
		if diff := cmp.Diff(want, summary(evs)); diff != "" {
			return fmt.Errorf("claimed again (-want +got):\n%s", diff)
		}
		return nil
	})
	return evs
}

// onceLate is a credential broker whose first Mint comes too late: the
// claim's lease ends within the second it is asked in.
type onceLate struct {
	*credentials.Broker
	asked atomic.Int32
}

func (o *onceLate) Mint(g credentials.Grant) (credentials.Credential, error) {
	if o.asked.Add(1) == 1 {
		return credentials.Credential{}, fmt.Errorf("mint %s: %w", g.Tool, credentials.ErrDeadlinePassed)
	}
	return o.Broker.Mint(g)
}

// A call with no deadline of its own whose claim's lease leaves too
// little time for a credential (a tool with a short timeout has a lease
// of a second or less) sends nothing and is given back, then claimed
// again and run. Before, it ended failed (credential_unavailable), its
// key spent, for a timing of the claim's.
func TestLeaseTooShortForACredentialIsGivenBack(t *testing.T) {
	r := newRig(t)
	broker, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	auth := r.admit("create_ticket", "klease", map[string]any{"title": "t"}, 0)
	x := r.executor(func(c *executor.Config) { c.Credentials = &onceLate{Broker: broker} })
	out, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if evs := decodeAll(t, out.Records); len(evs) != 0 || r.backend.Requests() != 0 {
		t.Fatalf("lease too short for a credential: events %v, %d tool requests; want none, the call given back", summary(evs), r.backend.Requests())
	}
	claimedAgainAndRun(t, x, auth)
	if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/klease"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// A native tool that answers with a redirect on every attempt leaves its
// outcome unknown under the answer's status (http_302), not "timeout":
// the tool answered.
func TestNativeToolRedirectNamesItsStatus(t *testing.T) {
	r := newRig(t)
	r.backend.SetFault("create_ticket", demobackend.Fault{FailStatus: http.StatusFound})
	auth := r.admit("create_ticket", "k302", map[string]any{"title": "t"}, 0)
	out, err := r.executor(func(c *executor.Config) { c.MaxAttempts = 2 }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	if code := evs[1].ErrorCode; code != "http_302" {
		t.Errorf("error code %q; want http_302", code)
	}
}

// A native tool whose response was lost after it applied: the retry with
// the same key replays, the effect stays single.
func TestNativeToolLostResponseRetriedWithSameKey(t *testing.T) {
	r := newRig(t)
	r.backend.SetFault("create_ticket", demobackend.Fault{ApplyThenDrop: true, FailTimes: 1})
	auth := r.admit("create_ticket", "k8", map[string]any{"title": "t"}, 0)
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	if evs[1].Attempt != 2 {
		t.Errorf("attempt = %d; want 2", evs[1].Attempt)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/k8"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// A native tool's attempt that got no answer may have applied: a retry
// answered 409 (an idempotent API's "a request with this key is in
// progress") or 5xx (itself ambiguous) says nothing of it, nor does a 4xx that a backend
// gives before it looks the key up (401: the call's credential family
// revoked since; 422: "already refunded", a check of the state the first
// attempt changed), so the call's outcome is unknown, never failed, which
// would tell the agent that nothing happened.
func TestNativeRetryAfterLostAnswerNeverFails(t *testing.T) {
	for _, status := range []int{http.StatusConflict, http.StatusServiceUnavailable, http.StatusUnauthorized, http.StatusUnprocessableEntity} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			r := newRig(t)
			// The first request reaches the tool, which applies it, and
			// its answer is lost; every later one is answered status.
			var requests atomic.Int32
			tool := r.backend.Handler()
			front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				if requests.Add(1) > 1 {
					w.WriteHeader(status)
					return
				}
				tool.ServeHTTP(httptest.NewRecorder(), req)
				conn, _, err := w.(http.Hijacker).Hijack()
				if err != nil {
					t.Error(err)
					return
				}
				conn.Close()
			}))
			defer front.Close()
			auth := r.admit("create_ticket", "k-lost", map[string]any{"title": "t"}, 0)
			out, err := r.executor(func(c *executor.Config) { c.BaseURL = front.URL }).Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if diff := cmp.Diff([]string{"executing", "outcome_unknown(outcome_ambiguous)"}, summary(evs)); diff != "" {
				t.Fatalf("events (-want +got):\n%s", diff)
			}
			want := fmt.Sprintf("retried_http_%d", status)
			if status >= 500 {
				want = fmt.Sprintf("http_%d", status)
			}
			if evs[1].ErrorCode != want {
				t.Errorf("error code %q; want %q", evs[1].ErrorCode, want)
			}
			if n := requests.Load(); n != 2 {
				t.Errorf("%d requests; want 2 (the lost one, then a retry)", n)
			}
			if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/k-lost"); n != 1 {
				t.Errorf("applied %d times; want 1", n)
			}
		})
	}
}

// A tool that keeps failing trips its breaker; later calls fail fast
// without reaching it.
func TestBreakerOpensAndFailsFast(t *testing.T) {
	r := newRig(t)
	r.backend.SetFault("create_ticket", demobackend.Fault{FailStatus: 503})
	x := r.executor(func(c *executor.Config) {
		c.MaxAttempts = 1
		c.Breaker = executor.BreakerConfig{MinRequests: 3, FailureRatio: 0.5, OpenFor: time.Hour}
	})
	var codes []string
	for i := range 6 {
		auth := r.admit("create_ticket", "b"+string(rune('0'+i)), map[string]any{"title": "t"}, 0)
		out, err := x.Step(t.Context(), []*kgo.Record{auth})
		if err != nil {
			t.Fatal(err)
		}
		evs := decodeAll(t, out.Records)
		codes = append(codes, evs[len(evs)-1].ErrorCode)
	}
	want := []string{"http_503", "http_503", "http_503", "breaker_open", "breaker_open", "breaker_open"}
	if diff := cmp.Diff(want, codes); diff != "" {
		t.Errorf("error codes (-want +got):\n%s", diff)
	}
	if n := r.backend.Requests(); n != 3 {
		t.Errorf("tool received %d requests; want 3 (the rest failed fast)", n)
	}
	if got := x.BreakerStates()["create_ticket/t_a"]; got != "open" {
		t.Errorf("breaker state %q; want open", got)
	}
}

// An open breaker is a passing refusal (DESIGN: it fails fast with a
// retryable error): a call that sent nothing is given back until the
// breaker may let it through, and then runs, once, under its key. Before,
// it ended failed, and the agent's retry under its key met that failure
// of a call never sent. One whose deadline leaves no room for the wait
// ends failed breaker_open, as before. Each of the breaker's changes is
// counted (ledger_breaker_transitions_total), for alerts on a tool whose
// breaker opens and closes again faster than a gauge is scraped.
func TestOpenBreakerGivesTheCallBack(t *testing.T) {
	r := newRig(t)
	r.backend.SetFault("create_ticket", demobackend.Fault{FailStatus: 503, FailTimes: 1})
	reg := metrics.New("executor", nil)
	x := r.executor(func(c *executor.Config) {
		c.MaxAttempts, c.SweepEvery, c.Metrics = 1, 10*time.Millisecond, reg
		c.Breaker = executor.BreakerConfig{MinRequests: 1, FailureRatio: 0.5, OpenFor: 300 * time.Millisecond}
	})
	step := func(auth *kgo.Record) []string {
		t.Helper()
		out, err := x.Step(t.Context(), []*kgo.Record{auth})
		if err != nil {
			t.Fatal(err)
		}
		return summary(decodeAll(t, out.Records))
	}
	ticket := map[string]any{"title": "t"}
	if got := step(r.admit("create_ticket", "trip", ticket, 0)); len(got) != 2 || x.BreakerStates()["create_ticket/t_a"] != "open" {
		t.Fatalf("the call that trips the breaker: %v, breaker %q; want it run, and the breaker open", got, x.BreakerStates()["create_ticket/t_a"])
	}
	short := r.admit("create_ticket", "short", ticket, 200)
	if diff := cmp.Diff([]string{"executing", "failed(" + executor.ReasonUnavailable + ")"}, step(short)); diff != "" {
		t.Errorf("a call due before the breaker may close (-want +got):\n%s", diff)
	}
	long := r.admit("create_ticket", "long", ticket, 60_000)
	if got := step(long); len(got) != 0 {
		t.Fatalf("a call with time to wait for the breaker: %v; want nothing recorded yet (given back)", got)
	}
	longEv := authorizedEvent(t, long)
	if rec, err := r.store.Get(t.Context(), longEv.Key()); err != nil || rec.Status != processors.StatusExecuting || rec.LeaseOwner != "" {
		t.Fatalf("its record: %s owned by %q (%v); want executing, given back", rec.Status, rec.LeaseOwner, err)
	}
	if diff := cmp.Diff([]string{"executing", "succeeded"}, stepUntilItRuns(t, x)); diff != "" {
		t.Errorf("once the breaker lets it through (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/long"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
	if n := r.backend.AppliedIn("create_ticket", "t_a", "t_a/short"); n != 0 {
		t.Errorf("the short call applied %d times; want 0", n)
	}
	moves := map[string]float64{}
	for _, to := range []string{"open", "half-open", "closed"} {
		moves[to] = counter(t, reg, "ledger_breaker_transitions_total", "tool", "create_ticket", "to", to)
	}
	if diff := cmp.Diff(map[string]float64{"open": 1, "half-open": 1, "closed": 1}, moves); diff != "" {
		t.Errorf("ledger_breaker_transitions_total by state changed to (-want +got):\n%s", diff)
	}
}

// A tool that answers 429 with Retry-After is asked again after that
// long, not after the executor's shorter backoff; one that asks for more
// than the call has left is not asked again, and the call fails
// (nothing applied, as the 429 said). Before, Retry-After was not heeded.
func TestRetryAfterIsHeeded(t *testing.T) {
	for _, tc := range []struct {
		name       string
		retryAfter string
		deadlineMS int64
		want       []string
		requests   int32
	}{
		{"within the call's time", "1", 10_000, []string{"executing", "succeeded"}, 2},
		{"past the call's time", "120", 3_000, []string{"executing", "failed(" + executor.ReasonUnavailable + ")"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			var (
				requests atomic.Int32
				first    atomic.Int64
				second   atomic.Int64
			)
			tool := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				switch requests.Add(1) {
				case 1:
					first.Store(time.Now().UnixNano())
					w.Header().Set("Retry-After", tc.retryAfter)
					w.WriteHeader(http.StatusTooManyRequests)
				default:
					second.Store(time.Now().UnixNano())
					w.Header().Set("Content-Type", "application/json")
					_, _ = w.Write([]byte(`{"ticket_id":"tkt_1"}`))
				}
			}))
			t.Cleanup(tool.Close)
			r.url = tool.URL
			auth := r.admit("create_ticket", "retry-after", map[string]any{"title": "t"}, tc.deadlineMS)
			stepEndsAs(t, r.executor(nil), auth, tc.want, map[int32]string{1: "http_429", 2: ""}[tc.requests])
			if n := requests.Load(); n != tc.requests {
				t.Errorf("the tool was asked %d times; want %d", n, tc.requests)
			}
			if tc.requests == 2 {
				if waited := time.Duration(second.Load() - first.Load()); waited < time.Second {
					t.Errorf("asked again %s after the 429; want at least its Retry-After, 1s", waited)
				}
			}
		})
	}
}

// Results are capped and marked untrusted before they leave the ledger.
func TestResultSanitized(t *testing.T) {
	r := newRig(t)
	auth := r.admit("get_weather", "k9", map[string]any{"city": "Oslo"}, 0)
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	rec, err := r.store.Get(t.Context(), evs[0].Key())
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		Untrusted bool            `json:"untrusted"`
		Source    string          `json:"source"`
		Content   json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(rec.Result, &res); err != nil {
		t.Fatal(err)
	}
	if !res.Untrusted || res.Source != "tool:get_weather@v1" || !strings.Contains(string(res.Content), "Oslo") {
		t.Errorf("stored result %s; want untrusted, source tool:get_weather@v1, with the content", rec.Result)
	}
	if !strings.HasPrefix(evs[1].ResultDigest, "sha256:") || evs[1].ResultBytes == 0 || strings.Contains(string(out.Records[1].Value), "content") {
		t.Errorf("terminal event %s; want a digest and size, not the result", out.Records[1].Value)
	}
}

// A result over the tool's cap is not kept: the call succeeded (the effect
// happened), the stored result says it was truncated, and the event says
// how big it was.
func TestOversizeResultTruncated(t *testing.T) {
	r := newRigWith(t, processorstest.RegistryWith(t, "../testdata/registry", "get_weather", func(entry map[string]any) {
		entry["max_result_bytes"] = 16
	}), demobackend.Config{})
	auth := r.admit("get_weather", "big", map[string]any{"city": "Oslo"}, 0)
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	last := evs[len(evs)-1]
	if last.Type != statemachine.EventSucceeded || last.ErrorCode != "result_truncated" {
		t.Fatalf("terminal event %s (%s); want succeeded with result_truncated", last.Type, last.ErrorCode)
	}
	rec, err := r.store.Get(t.Context(), last.Key())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(rec.Result), `"truncated":true`) || strings.Contains(string(rec.Result), "Oslo") {
		t.Errorf("stored result %s; want a truncation marker without the content", rec.Result)
	}
}

// A call reclaimed after its deadline may have run under the dead owner:
// it is an unknown outcome, never "expired" (which says it did not run),
// and it does not run again, even for a native tool.
func TestReclaimAfterDeadlineIsOutcomeUnknown(t *testing.T) {
	for _, tool := range []struct {
		name string
		args map[string]any
	}{
		{"notify", map[string]any{"to": "a@example.com", "subject": "s"}},
		{"create_ticket", map[string]any{"title": "t"}},
	} {
		t.Run(tool.name, func(t *testing.T) {
			r := newRig(t)
			auth := r.admit(tool.name, "late", tool.args, 1)
			ev := authorizedEvent(t, auth)
			r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
			x := r.executor(func(c *executor.Config) {
				c.Now = func() time.Time { return time.Now().Add(time.Second) }
			})
			out, err := x.Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff([]string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, summary(decodeAll(t, out.Records))); diff != "" {
				t.Errorf("events (-want +got):\n%s", diff)
			}
			if n := r.backend.Requests(); n != 0 {
				t.Errorf("tool received %d requests; want 0", n)
			}
		})
	}
}

// A reclaimed call that this owner cannot settle is an unknown outcome,
// not "failed": the dead owner may have reached the tool. A 409 does not
// settle it (idempotent APIs answer it while an earlier request with the
// key is still in progress), nor does a refusal, which a backend may give
// before it looks the key up (a check of the state the dead owner's
// request changed): the reconciler's lookup by key does.
func TestReclaimedCallNotSettledIsOutcomeUnknown(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status int
		want   string
	}{
		{"in progress", http.StatusConflict, "outcome_unknown(" + executor.ReasonLeaseExpired + ")"},
		{"unavailable", http.StatusServiceUnavailable, "outcome_unknown(" + executor.ReasonLeaseExpired + ")"},
		{"refused", http.StatusBadRequest, "outcome_unknown(" + executor.ReasonLeaseExpired + ")"},
		{"throttled", http.StatusTooManyRequests, "outcome_unknown(" + executor.ReasonLeaseExpired + ")"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			r.backend.SetFault("create_ticket", demobackend.Fault{FailStatus: tc.status})
			auth := r.admit("create_ticket", "reclaimed", map[string]any{"title": "t"}, 60_000)
			ev := authorizedEvent(t, auth)
			r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
			x := r.executor(func(c *executor.Config) { c.MaxAttempts = 1 })
			out, err := x.Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff([]string{"executing", tc.want}, summary(decodeAll(t, out.Records))); diff != "" {
				t.Errorf("events (-want +got):\n%s", diff)
			}
			if n := r.backend.Requests(); n != 1 {
				t.Errorf("tool received %d requests; want the one retry with the same key", n)
			}
		})
	}
}

// A read taken over from an executor that died mid-call is a call of its
// own: there is no effect to be unsure of. Past its deadline it expires,
// and answered 5xx it fails. Before, both ended outcome_unknown
// (lease_expired_mid_call), and, a read declaring no status lookup, were
// parked for a human.
func TestReclaimedReadIsACallOfItsOwn(t *testing.T) {
	for _, tc := range []struct {
		name     string
		deadline int64
		fault    demobackend.Fault
		want     []string
	}{
		{"past its deadline", 1, demobackend.Fault{}, []string{"expired(" + executor.ReasonDeadlineExceeded + ")"}},
		{"answered 5xx", 60_000, demobackend.Fault{FailStatus: http.StatusServiceUnavailable}, []string{"executing", "failed(" + executor.ReasonToolFailed + ")"}},
		{"answered", 60_000, demobackend.Fault{}, []string{"executing", "succeeded"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			r.backend.SetFault("get_weather", tc.fault)
			auth := r.admit("get_weather", "reclaimed-read", map[string]any{"city": "Oslo"}, tc.deadline)
			ev := authorizedEvent(t, auth)
			r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
			time.Sleep(5 * time.Millisecond) // past a deadline of 1 ms
			out, err := r.executor(func(c *executor.Config) { c.MaxAttempts = 1 }).Step(t.Context(), []*kgo.Record{auth})
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, summary(decodeAll(t, out.Records))); diff != "" {
				t.Errorf("events (-want +got):\n%s", diff)
			}
		})
	}
}

// Shutting down mid-call does not throw the call's outcome away: the call
// finishes, its outcome is recorded, and its events follow on redelivery.
func TestShutdownRecordsRunningCalls(t *testing.T) {
	r := newRig(t)
	r.backend.SetFault("send_email", demobackend.Fault{Latency: 200 * time.Millisecond})
	auth := r.admit("notify", "slow", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
	x := r.executor(nil)
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		ledgertest.WaitFor(t, 5*time.Second, func() error {
			if r.backend.Requests() == 0 {
				return context.DeadlineExceeded
			}
			return nil
		})
		cancel()
	}()
	if _, err := x.Step(ctx, []*kgo.Record{auth}); err == nil {
		t.Fatal("Step during shutdown returned no error; want the context's")
	}
	ev := authorizedEvent(t, auth)
	rec, err := r.store.Get(t.Context(), ev.Key())
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status != processors.StatusSucceeded || !rec.Unlogged() {
		t.Fatalf("after shutdown the record is %s (unlogged %v); want succeeded, waiting for the log", rec.Status, rec.Unlogged())
	}
	out, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(decodeAll(t, out.Records))); diff != "" {
		t.Errorf("redelivered events (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("send_email", "t_a", "t_a/slow"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// A tool that answers with its request's headers (a debug endpoint, a
// hostile or careless backend) has the call's credential and the
// backend's secret in its result: the call succeeds, its result is kept
// without content (code result_holds_secret), and neither secret is
// stored, where the agent would read it. Before, the result was kept as
// the tool gave it.
func TestResultHoldingASecretIsWithheld(t *testing.T) {
	// With the characters a JSON encoder escapes (a quote, an
	// ampersand): the answer and the stored result hold it escaped.
	const secret = `ticket-api-key-5e1f0a"&<x>`
	reg := processorstest.RegistryWith(t, "../testdata/registry", "create_ticket", func(entry map[string]any) {
		entry["backend"].(map[string]any)["secret_ref"] = "ticket_api_key"
	})
	r := newRigWith(t, reg, demobackend.Config{})
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "ticket_api_key"), []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	broker, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, header string }{
		{"the credential", "Authorization"},
		{"the backend secret", "X-Backend-Secret"},
		{"the backend secret, escaped", "X-Backend-Secret"},
		// An answer the ledger's decoder refuses (an integer above
		// 2^53), kept as text, which a reader may parse all the same.
		{"the backend secret, escaped, in an answer kept as text", "X-Backend-Secret"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				v := req.Header.Get(tc.header)
				if strings.Contains(tc.name, "escaped") {
					// The same string to a JSON reader.
					v = strings.ReplaceAll(v, "-", `\u002d`)
				}
				w.Header().Set("Content-Type", "application/json")
				answer := map[string]any{"ticket_id": "tkt_1", "debug": map[string]string{"header": v}}
				if strings.HasSuffix(tc.name, "as text") {
					answer["id"] = json.Number("9007199254740993")
				}
				b, _ := json.Marshal(answer)
				if strings.Contains(tc.name, "escaped") {
					b = bytes.ReplaceAll(b, []byte(`\\u002d`), []byte(`\u002d`))
				}
				_, _ = w.Write(b)
			}))
			t.Cleanup(echo.Close)
			r.url = echo.URL
			key := "echo-" + strings.ReplaceAll(tc.name, " ", "-")
			key = strings.ReplaceAll(key, ",", "")
			auth := r.admit("create_ticket", key, map[string]any{"title": "t"}, 0)
			x := r.executor(func(c *executor.Config) { c.Credentials, c.Secrets = broker, credentials.NewKeystore(dir) })
			rec := succeededWith(t, r, x, auth, executor.CodeResultHoldsSecret)
			if strings.Contains(string(rec.Result), "content") || strings.Contains(string(rec.Result), "5e1f0a") || strings.Contains(string(rec.Result), "eyJ") {
				t.Errorf("stored result %s; want it without its content", rec.Result)
			}
		})
	}
}

// Every execution gets its own short-lived credential: the tool verifies
// it, the events carry its jti and family but never the token, and a tool
// that demands a credential refuses a call without one.
func TestExecutionCredential(t *testing.T) {
	r, broker, guarded := newGuardedRig(t)
	auth := r.admit("create_ticket", "cred", map[string]any{"title": "t"}, 0)
	minter := &grantsSeen{Minter: broker}
	out, err := r.executor(func(c *executor.Config) { c.Credentials = minter }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	last := evs[len(evs)-1]
	// The credential is bound to the exact body sent: the arguments.
	rec, err := r.store.Get(t.Context(), last.Key())
	if err != nil {
		t.Fatal(err)
	}
	if len(minter.grants) != 1 || minter.grants[0].BodySHA256 != credentials.BodyDigest(rec.Arguments) {
		t.Errorf("grants %+v; want one bound to the arguments' digest %s", minter.grants, credentials.BodyDigest(rec.Arguments))
	}
	if last.Type != statemachine.EventSucceeded || last.JTI == "" || last.CredentialFamily == "" || last.CredentialScope != "tool::create_ticket" {
		t.Fatalf("terminal event %s jti %q family %q scope %q; want succeeded with the credential's jti, family and scope", last.Type, last.JTI, last.CredentialFamily, last.CredentialScope)
	}
	effs := guarded.Effects()
	if len(effs) != 1 || effs[0].JTI != last.JTI {
		t.Errorf("tool effects %+v; want one, under jti %s", effs, last.JTI)
	}
	for _, rec := range out.Records {
		if strings.Contains(string(rec.Value), "eyJ") {
			t.Errorf("an event carries a token: %s", rec.Value)
		}
	}

	// Without a credential the tool refuses, and nothing happens.
	auth = r.admit("create_ticket", "nocred", map[string]any{"title": "t"}, 0)
	out, err = r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs = decodeAll(t, out.Records)
	if last := evs[len(evs)-1]; last.Type != statemachine.EventFailed || last.ErrorCode != "http_401" {
		t.Errorf("without a credential: %s (%s); want failed with http_401", last.Type, last.ErrorCode)
	}
	if n := len(guarded.Effects()); n != 1 {
		t.Errorf("tool effects %d; want still 1", n)
	}
}

// grantsSeen mints as Minter does, and keeps the grants.
type grantsSeen struct {
	executor.Minter
	grants []credentials.Grant
}

func (g *grantsSeen) Mint(gr credentials.Grant) (credentials.Credential, error) {
	g.grants = append(g.grants, gr)
	return g.Minter.Mint(gr)
}

// countingStore counts the store writes a step's after-commit makes.
type countingStore struct {
	processors.Store
	marked  int // calls marked through MarkLogged
	settled []string
	logged  []bool
}

func (s *countingStore) MarkLogged(ctx context.Context, ls []processors.Logged) error {
	s.marked += len(ls)
	return s.Store.MarkLogged(ctx, ls)
}

func (s *countingStore) Settle(ctx context.Context, journals []string, logged bool) error {
	s.settled = append(s.settled, journals...)
	s.logged = append(s.logged, logged)
	return s.Store.Settle(ctx, journals, logged)
}

// The outcomes a step records are logged in the store by their
// completion, under one journal entry a step, and the step's after-commit
// settles that entry instead of writing each call again.
func TestStepLogsOutcomesWithoutAWritePerCall(t *testing.T) {
	r := newRig(t)
	st := &countingStore{Store: r.store}
	x := r.executor(func(c *executor.Config) { c.Store = st })
	var auths []*kgo.Record
	for _, k := range []string{"j1", "j2", "j3"} {
		auths = append(auths, r.admit("create_ticket", k, map[string]any{"title": k}, 0))
	}
	out, err := x.Step(t.Context(), auths)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(decodeAll(t, out.Records)); n != 6 {
		t.Fatalf("step appended %d events; want 6 (executing, succeeded for 3 calls)", n)
	}
	for _, k := range []string{"j1", "j2", "j3"} {
		rec, err := r.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: k})
		if err != nil {
			t.Fatal(err)
		}
		if rec.Status != processors.StatusSucceeded || rec.LoggedSeq != rec.Seq {
			t.Errorf("%s after the step: status %q, logged %d of seq %d; want succeeded, logged to seq by the completion", k, rec.Status, rec.LoggedSeq, rec.Seq)
		}
	}
	if err := out.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	if st.marked != 0 || len(st.settled) != 1 || !st.logged[0] {
		t.Errorf("after-commit marked %d calls and settled %q (logged %v); want 0 calls marked and one entry settled as logged", st.marked, st.settled, st.logged)
	}
	// Settled: a sweep, however late, finds nothing to append.
	if swept := r.sweep(); len(swept.Records) != 0 {
		t.Errorf("sweep after the settle appended %d records; want 0", len(swept.Records))
	}
}

// sweep runs one step of an executor that sweeps at once, with no grace
// for unlogged outcomes and journal entries.
func (r *rig) sweep() ledger.Output {
	r.t.Helper()
	sweeper := r.executor(func(c *executor.Config) {
		c.SweepEvery = time.Nanosecond
		c.UnloggedGrace = time.Nanosecond
	})
	out, err := sweeper.Step(r.t.Context(), nil)
	if err != nil {
		r.t.Fatal(err)
	}
	return out
}

// A finished call whose events never reached the log, and that no
// redelivery will bring back (another instance skipped it as busy while
// this one's transaction aborted): the sweep appends its events.
func TestSweepAppendsUnloggedOutcomes(t *testing.T) {
	r := newRig(t)
	auth := r.admit("notify", "lost", map[string]any{"to": "a@example.com", "subject": "s"}, 0)
	first, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	// The transaction carrying first aborted: Committed never runs, and
	// the authorized event is not redelivered.
	x := r.executor(func(c *executor.Config) {
		c.SweepEvery = time.Nanosecond
		c.UnloggedGrace = time.Millisecond
	})
	var swept ledger.Output
	ledgertest.WaitFor(t, 5*time.Second, func() error {
		var err error
		if swept, err = x.Step(t.Context(), nil); err != nil {
			return err
		}
		if len(swept.Records) == 0 {
			return context.DeadlineExceeded
		}
		return nil
	})
	if diff := cmp.Diff(decodeAll(t, first.Records), decodeAll(t, swept.Records)); diff != "" {
		t.Errorf("swept events differ from the lost ones (-lost +swept):\n%s", diff)
	}
	if err := swept.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	again, err := x.Step(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(again.Records) != 0 {
		t.Errorf("after the log has them, the sweep appended %d records; want 0", len(again.Records))
	}
	if n := r.backend.Requests(); n != 1 {
		t.Errorf("tool received %d requests; want 1", n)
	}
}

// The executor's loop counts toward its linger only the events it may
// act on: a lone call's requested and authorized events, read together,
// are one, so that at low load the loop does not linger for it.
func TestMayAuthorize(t *testing.T) {
	for typ, want := range map[statemachine.EventType]bool{
		statemachine.EventAuthorized: true, statemachine.EventApproved: true, "": true,
		statemachine.EventRequested: false, statemachine.EventExecuting: false, statemachine.EventSucceeded: false,
	} {
		r := &kgo.Record{Value: []byte("{}")}
		if typ != "" {
			r.Headers = []kgo.RecordHeader{{Key: ledger.HeaderEventType, Value: []byte(typ)}}
		}
		if got := executor.MayAuthorize(r); got != want {
			t.Errorf("MayAuthorize(event type %q) = %v; want %v", typ, got, want)
		}
	}
	// The executor's loop counts with it unless told otherwise.
	x := newRig(t).executor(nil)
	requested := &kgo.Record{Headers: []kgo.RecordHeader{{Key: ledger.HeaderEventType, Value: []byte(statemachine.EventRequested)}}}
	authorized := &kgo.Record{Headers: []kgo.RecordHeader{{Key: ledger.HeaderEventType, Value: []byte(statemachine.EventAuthorized)}}}
	if acts := executor.LoopConfig(x, ledger.LoopConfig{}).Acts; acts == nil || acts(requested) || !acts(authorized) {
		t.Errorf("the executor loop's Acts counts a requested event, or not an authorized one; want MayAuthorize")
	}
	every := func(*kgo.Record) bool { return true }
	if acts := executor.LoopConfig(x, ledger.LoopConfig{Acts: every}).Acts; acts == nil || !acts(requested) {
		t.Errorf("the executor loop replaced the Acts it was given")
	}
}

// The terminal event says what the tool's requests took (tool_us), apart
// from the execution's own waits: a retry's backoff counts in latency_ms
// and not in tool_us. Before, only latency_ms was recorded, and a
// benchmark subtracting it as the tool's time hid the ledger's waits
// (the bulkhead's queue, backoffs) from the latency it adds.
func TestTerminalEventSaysWhatTheToolTook(t *testing.T) {
	r := newRig(t)
	// Two requests that each take 30 ms, the first failing 503, with
	// 200 ms of backoff between them.
	r.backend.SetFault(demobackend.ToolCreateTicket, demobackend.Fault{Latency: 30 * time.Millisecond, FailStatus: http.StatusServiceUnavailable, FailTimes: 1})
	auth := r.admit("create_ticket", "k-took", map[string]any{"title": "t"}, 0)
	out, err := r.executor(func(c *executor.Config) { c.RetryBackoff = 200 * time.Millisecond }).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	term := evs[1]
	if term.Attempt != 2 {
		t.Fatalf("attempt %d; want 2 (one retry)", term.Attempt)
	}
	took := time.Duration(term.ToolUS) * time.Microsecond
	if took < 30*time.Millisecond || took >= 200*time.Millisecond {
		t.Errorf("tool_us %s; want the two requests' time, at least 30 ms and without the 200 ms backoff", took)
	}
	if lat := time.Duration(term.LatencyMS) * time.Millisecond; lat < took+200*time.Millisecond-time.Millisecond {
		t.Errorf("latency_ms %s, tool_us %s; want the execution's time, the backoff in", lat, took)
	}
}

// A tool whose 2xx status line arrived and whose body was then lost (cut
// mid-answer) did what it was asked: the call succeeded. A tool that
// replays a key's answer (create_ticket) is asked again for the result,
// which a whole answer then brings; one that does not (notify: asked
// again, it would act again) is not, and the call succeeds at once, its
// result kept without content (result_lost), as does one whose answers
// are all cut. Before, the answer was taken for no answer: retried, then
// outcome unknown, for the reconciler (and under undo_unknown, undone).
func TestTwoHundredWithItsBodyLostSucceeds(t *testing.T) {
	for _, tc := range []struct {
		name, tool string
		args       map[string]any
		cutAll     bool
		requests   int32
		code       string
	}{
		{"native, the retry answers whole", "create_ticket", map[string]any{"title": "t"}, false, 2, ""},
		{"native, every answer cut", "create_ticket", map[string]any{"title": "t"}, true, 2, executor.CodeResultLost},
		{"no native idempotency", "notify", map[string]any{"to": "a@example.com", "subject": "s"}, false, 1, executor.CodeResultLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			var requests atomic.Int32
			cut := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				_, _ = io.Copy(io.Discard, req.Body)
				if requests.Add(1) > 1 && !tc.cutAll {
					w.Header().Set("Content-Type", "application/json")
					_, _ = w.Write([]byte(`{"ticket_id":"tkt_9"}`))
					return
				}
				conn, buf, err := http.NewResponseController(w).Hijack()
				if err != nil {
					return
				}
				defer conn.Close()
				_, _ = buf.WriteString("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"ticket_id\":")
				_ = buf.Flush()
			}))
			t.Cleanup(cut.Close)
			r.url = cut.URL
			auth := r.admit(tc.tool, "k-cut", tc.args, 0)
			rec := succeededWith(t, r, r.executor(nil), auth, tc.code)
			if n := requests.Load(); n != tc.requests {
				t.Errorf("the tool was asked %d times; want %d", n, tc.requests)
			}
			if kept := strings.Contains(string(rec.Result), "tkt_9"); kept != (tc.code == "") {
				t.Errorf("stored result %s; want the whole answer's result kept only when one came", rec.Result)
			}
			if strings.Contains(string(rec.Result), `"ticket_id":}`) {
				t.Errorf("stored result %s; want nothing of a cut answer", rec.Result)
			}
		})
	}
}

// succeededWith steps auth through x, checks that the call succeeded
// with the error code code, and returns its stored record.
func succeededWith(t *testing.T, r *rig, x *executor.Executor, auth *kgo.Record, code string) processors.Record {
	t.Helper()
	evs, rec := stepSucceeds(t, r, x, auth)
	if got := evs[1].ErrorCode; got != code {
		t.Errorf("code %q; want %s", got, code)
	}
	return rec
}

// stepSucceeds runs one step of x on auth, checks that the call
// succeeded, and returns its events and its record.
func stepSucceeds(t *testing.T, r *rig, x *executor.Executor, auth *kgo.Record) ([]ledger.Event, processors.Record) {
	t.Helper()
	out, err := x.Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	rec, err := r.store.Get(t.Context(), evs[1].Key())
	if err != nil {
		t.Fatal(err)
	}
	return evs, rec
}

// A store whose clock is behind the executor's (here by 40 s, more than a
// call's attempts take) does not shorten the executor's calls: their
// lease is counted on the executor's clock from before the claim. Before,
// the store's lease_until was read on the executor's clock, earlier than
// now, and every call failed unsent, its key spent.
func TestStoreClockBehindShortensNothing(t *testing.T) {
	reg, err := schemas.Load(os.DirFS("../testdata/registry"))
	if err != nil {
		t.Fatal(err)
	}
	r := newRigStore(t, reg, demobackend.Config{}, boltstore.Config{Now: func() time.Time { return time.Now().Add(-40 * time.Second) }})
	auth := r.admit("create_ticket", "skewed", map[string]any{"title": "t"}, 0)
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{auth})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(decodeAll(t, out.Records))); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn(demobackend.ToolCreateTicket, "t_a", "t_a/skewed"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// An executor that does not know a call's tool version (a rolling deploy:
// an intake with the new registry admitted it) gives the call back, while
// its deadline leaves room, for one that knows it, which runs it. Before,
// it failed the call unknown_tool, its key spent. Without a deadline to
// wait within, it fails as before.
func TestUnknownToolVersionGivenBack(t *testing.T) {
	r := newRig(t)
	// The registry without notify.v1: an executor not yet upgraded.
	older := registryWithout(t, "notify")
	r.givenBackAndRun(r.executor(func(c *executor.Config) { c.Registry, c.SweepEvery = older, 10*time.Millisecond }), executor.ReasonUnknownTool)
}

// An executor whose registry defines a call's tool version otherwise than
// the intake's that admitted it (here notify.v1 edited in place to say
// native idempotency, which would let a retry resend an email) never runs
// the call by its own definition: it gives the call back while its
// deadline leaves room, for an executor with the admitted definition,
// which runs it; without a deadline the call fails, nothing sent; taken
// over from an owner that died, its outcome is unknown. Before, calls
// were bound by name and version only, and the edited definition ran.
func TestOtherDefinitionNotRun(t *testing.T) {
	r := newRig(t)
	edited := processorstest.RegistryWith(t, "../testdata/registry", "notify", func(entry map[string]any) {
		entry["idempotency"] = "native"
	})
	other := r.executor(func(c *executor.Config) { c.Registry, c.SweepEvery = edited, 10*time.Millisecond })
	r.givenBackAndRun(other, executor.ReasonOtherDefinition)

	auth := r.admit("notify", "taken-over", notifyArgs, 0)
	ev := authorizedEvent(t, auth)
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
	stepEndsAs(t, other, auth, []string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, "reclaimed_"+executor.ReasonOtherDefinition)
	if n := r.backend.AppliedIn(demobackend.ToolSendEmail, "t_a", "t_a/taken-over"); n != 0 {
		t.Errorf("the taken-over call was applied %d times; want none", n)
	}
}

// notifyArgs are arguments of a notify call.
var notifyArgs = map[string]any{"to": "a@example.com", "subject": "s"}

// givenBackAndRun has x, an executor without the test registry's notify.v1
// as the intake admits its calls, step two of them: the one without a
// deadline must fail for reason, nothing sent, and the other be given
// back, for an executor with the intake's registry to run once.
func (r *rig) givenBackAndRun(x *executor.Executor, reason string) {
	t := r.t
	t.Helper()
	out, err := x.Step(t.Context(), []*kgo.Record{r.admit("notify", "given-back", notifyArgs, 60_000), r.admit("notify", "no-deadline", notifyArgs, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string][]string{"t_a/no-deadline": {"executing", "failed(" + reason + ")"}}, byCall(t, out.Records)); diff != "" {
		t.Errorf("the step of the executor without the definition (-want +got):\n%s", diff)
	}
	rec, err := r.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "given-back"})
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status != processors.StatusExecuting || rec.LeaseOwner != "" || rec.Attempt != 0 {
		t.Fatalf("the call is %s owned by %q, attempt %d; want given back", rec.Status, rec.LeaseOwner, rec.Attempt)
	}
	if n := r.backend.Requests(); n != 0 {
		t.Fatalf("%d requests reached the tool from the executor without the definition; want none", n)
	}
	admitted := r.executor(func(c *executor.Config) { c.SweepEvery = time.Nanosecond })
	got := stepUntil(t, admitted, 10*time.Second, "t_a/given-back")
	if diff := cmp.Diff([]string{"executing", "succeeded"}, got["t_a/given-back"]); diff != "" {
		t.Errorf("the sweep of an executor with the intake's registry (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn(demobackend.ToolSendEmail, "t_a", "t_a/given-back"); n != 1 {
		t.Errorf("applied %d times; want 1", n)
	}
}

// tamperedArguments is the store, whose claims answer the record with
// arguments other than the ones hashed (changed in the store after the
// call was authorized).
type tamperedArguments struct{ executor.Store }

func (s tamperedArguments) Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error) {
	res, err := s.Store.Claim(ctx, cs)
	for i := range res {
		res[i].Record.Arguments = []byte(`{"title":"changed"}`)
	}
	return res, err
}

// tamperedPair is a store whose claims return a record whose arguments
// and hash were both rewritten, consistently: the pair agrees, but not
// with the hash the call's events name.
type tamperedPair struct{ executor.Store }

func (s tamperedPair) Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error) {
	res, err := s.Store.Claim(ctx, cs)
	for i := range res {
		rec := &res[i].Record
		rec.Arguments = []byte(`{"title":"changed"}`)
		h, herr := ledger.HashCanonicalArguments(rec.Key.TenantID, rec.Tool, rec.ToolVersion, rec.Arguments)
		if herr != nil {
			return nil, herr
		}
		rec.ArgumentsHash = h
	}
	return res, err
}

// A call whose stored arguments were rewritten with a hash of their own
// (anyone who can write the store can compute one) never runs: the
// record's hash must be the one the call's events name, which its
// policies decided on and an approver approved. Before, a claim that
// took the record's hash (a sweep's) ran the new arguments, and its
// events named the old hash.
func TestRewrittenArgumentsAndHashNeverRun(t *testing.T) {
	r := newRig(t)
	x := r.executor(func(c *executor.Config) { c.Store = tamperedPair{c.Store} })
	stepEndsAs(t, x, r.admit("create_ticket", "rewritten", map[string]any{"title": "t"}, 0), []string{"denied(" + executor.ReasonArgumentIntegrity + ")"}, "")
	if n := r.backend.Requests(); n != 0 {
		t.Errorf("%d requests reached the tool; want none", n)
	}
}

// A call whose stored arguments no longer match their hash never runs,
// and is denied; but one taken over from an owner that died is left to
// the reconciler (outcome_unknown): its first owner may have sent it.
// Before, it was denied too, and its agent, told it never ran, sent it
// again under another key.
func TestTamperedArgumentsOfATakenOverCall(t *testing.T) {
	r := newRig(t)
	x := r.executor(func(c *executor.Config) { c.Store = tamperedArguments{c.Store} })
	stepEndsAs(t, x, r.admit("create_ticket", "tampered", map[string]any{"title": "t"}, 0), []string{"denied(" + executor.ReasonArgumentIntegrity + ")"}, "")
	auth := r.admit("create_ticket", "tampered-taken-over", map[string]any{"title": "t"}, 0)
	ev := authorizedEvent(t, auth)
	r.claimAsDeadOwner(ev.Key(), ev.ArgumentsHash)
	stepEndsAs(t, x, auth, []string{"executing", "outcome_unknown(" + executor.ReasonLeaseExpired + ")"}, "reclaimed_"+executor.ReasonArgumentIntegrity)
	if n := r.backend.Requests(); n != 0 {
		t.Errorf("%d requests reached the tool; want none", n)
	}
}
