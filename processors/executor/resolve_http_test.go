package executor_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/compensation"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
	"github.com/toolcall-ledger/ledger/schemas"
)

// operatorVerifier takes every assertion for the operator u_ops of t_a.
type operatorVerifier struct{}

func (operatorVerifier) Verify(context.Context, string) (identity.Identity, error) {
	return identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}, nil
}

// discardPublisher takes every record and keeps none.
type discardPublisher struct{}

func (discardPublisher) Publish(context.Context, ...*kgo.Record) error { return nil }

// failingGets is the store with every Get failing.
type failingGets struct{ processors.Store }

func (failingGets) Get(context.Context, ledger.CallKey) (processors.Record, error) {
	return processors.Record{}, errors.New("dial tcp 10.0.0.7:26257: connection refused")
}

// POST /v1/resolutions answers each refusal with its own status and code:
// a malformed resolution 400, a resolution as failed while the call's
// compensation is under way 409 compensation_under_way (as succeeded
// goes through), and a store that fails 503 without its error's text.
// Before, a store failure answered 400 invalid_request with the store's
// message.
func TestResolveHandlerStatuses(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	r.admitCompensation(orig.Key(), "u_operator")
	body := func(as string) string {
		return `{"tenant_id":"t_a","idempotency_key":"` + orig.IdempotencyKey + `","as":"` + as + `","evidence":"the bank's statement"}`
	}
	for _, tc := range []struct {
		name   string
		store  processors.Store
		body   string
		status int
		code   string // the error's code, or the event's type
	}{
		{"malformed", r.store, strings.Replace(body("failed"), "failed", "maybe", 1), http.StatusBadRequest, "invalid_request"},
		{"store down", failingGets{r.store}, body("failed"), http.StatusServiceUnavailable, "unavailable"},
		{"failed while undoing", r.store, body("failed"), http.StatusConflict, "compensation_under_way"},
		{"succeeded while undoing", r.store, body("succeeded"), http.StatusOK, "succeeded"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Store = tc.store })
			status, got := postResolution(t, rc, tc.body)
			if status != tc.status || !strings.Contains(got, `"`+tc.code+`"`) {
				t.Errorf("%s: %d %s; want %d %s", tc.name, status, got, tc.status, tc.code)
			}
			if strings.Contains(got, "10.0.0.7") {
				t.Errorf("the answer names the store's address: %s", got)
			}
		})
	}
	if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusSucceeded {
		t.Errorf("after the resolution as succeeded the call is %s (%v); want succeeded", rec.Status, err)
	}
}

// Behind the reconciler's pending compensation, POST /v1/resolutions as
// succeeded is refused 409 automatic_compensation_pending, until the body
// confirms it with cancel_compensation.
func TestResolveHandlerBehindTheReconcilersUndo(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	r.admitCompensation(orig.Key(), executor.ReconcilerUser)
	rc := r.reconciler()
	body := `{"tenant_id":"t_a","idempotency_key":"` + orig.IdempotencyKey + `","as":"succeeded","evidence":"the bank's statement"`
	if status, got := postResolution(t, rc, body+`}`); status != http.StatusConflict || !strings.Contains(got, `"automatic_compensation_pending"`) || !strings.Contains(got, "cancel_compensation") {
		t.Errorf("unconfirmed: %d %s; want 409 automatic_compensation_pending naming cancel_compensation", status, got)
	}
	if status, got := postResolution(t, rc, body+`,"cancel_compensation":true}`); status != http.StatusOK || !strings.Contains(got, `"succeeded"`) {
		t.Errorf("confirmed: %d %s; want 200 succeeded", status, got)
	}
}

// A resolution whose move loses to another writer says which: the call
// settled by someone else is not_unknown; the call moved on and still to
// settle (parked by the reconciler between the resolution's read and its
// move) is call_changed, to be looked at again. Before, both were
// not_unknown, "the call's outcome is not unknown", for a call still
// waiting for a human.
func TestResolveHandlerSaysWhatBeatIt(t *testing.T) {
	for _, tc := range []struct {
		name     string
		settle   bool
		wantCode string
	}{
		{"moved on, still unknown", false, `"call_changed"`},
		{"settled by another", true, `"not_unknown"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			orig, _ := r.unknownRefundToUndo()
			rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
				c.Store, c.Now = &losingMoves{Store: r.store, settle: tc.settle}, afterLanding
			})
			body := `{"tenant_id":"t_a","idempotency_key":"` + orig.IdempotencyKey + `","as":"failed","evidence":"the bank's statement"}`
			if status, got := postResolution(t, rc, body); status != http.StatusConflict || !strings.Contains(got, tc.wantCode) {
				t.Errorf("%d %s; want 409 %s", status, got, tc.wantCode)
			}
		})
	}
}

// losingMoves is a store whose moves lose to another writer: when settle,
// it applies the move itself first (someone else's, the same), else the
// record stays as it was (moved on, in the test's telling); when fail is
// set, they fail with it instead, and when ambiguous is, they apply and
// fail with it (a commit whose answer was lost).
type losingMoves struct {
	processors.Store
	settle bool
	// only, when set, is the one key whose moves lose; the others apply.
	only      *ledger.CallKey
	fail      error
	ambiguous error
	// unreadable: after an ambiguous move, the key cannot be read (its
	// node down).
	unreadable bool
	moved      atomic.Bool
}

func (l *losingMoves) Get(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	if err := l.unread(k); err != nil {
		return processors.Record{}, err
	}
	return l.Store.Get(ctx, k)
}

func (l *losingMoves) ReadBack(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	if err := l.unread(k); err != nil {
		return processors.Record{}, err
	}
	return l.Store.ReadBack(ctx, k)
}

// unread is the error of a read of k that fails (unreadable), or nil.
func (l *losingMoves) unread(k ledger.CallKey) error {
	if l.unreadable && l.moved.Load() && (l.only == nil || k == *l.only) {
		return errors.New("dial tcp 10.0.0.7:26257: connection refused")
	}
	return nil
}

func (l *losingMoves) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	if l.only != nil && (len(ms) != 1 || ms[0].Key != *l.only) {
		return l.Store.Move(ctx, ms)
	}
	if l.fail != nil {
		return nil, l.fail
	}
	if l.ambiguous != nil {
		if _, err := l.Store.Move(ctx, ms); err != nil {
			return nil, err
		}
		l.moved.Store(true)
		return nil, l.ambiguous
	}
	if l.settle {
		if _, err := l.Store.Move(ctx, ms); err != nil {
			return nil, err
		}
	}
	return make([]bool, len(ms)), nil
}

// A confirmed resolution that cancelled the reconciler's compensation and
// then lost the call's move to another writer says so: the compensation
// is cancelled, its key spent, and the call is the operator's to undo by
// hand. Before, the error said only that the call changed.
func TestResolutionLostAfterItsCancelSaysSo(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	r.admitCompensation(orig.Key(), executor.ReconcilerUser)
	k := orig.Key()
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Store = &losingMoves{Store: r.store, only: &k} })
	ops := identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}
	_, err := rc.Resolve(t.Context(), ops, k, executor.Resolution{As: processors.StatusSucceeded, Evidence: "the bank", CancelCompensation: true})
	if !errors.Is(err, executor.ErrCallChanged) || !strings.Contains(err.Error(), "was cancelled") {
		t.Errorf("resolution lost after the cancel = %v; want ErrCallChanged saying the compensation was cancelled", err)
	}
}

// A confirmed resolution that cancelled the reconciler's compensation and
// then failed on the store is answered 503 compensation_cancelled, saying
// the compensation will not run. Before, it was answered as any store
// failure (503 unavailable, "try again"), and an operator who then left
// the call parked for the automatic undo waited for one that never runs.
func TestResolveHandlerStoreFailureAfterTheCancel(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	r.admitCompensation(orig.Key(), executor.ReconcilerUser)
	k := orig.Key()
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Store = &losingMoves{Store: r.store, only: &k, fail: errors.New("dial tcp 10.0.0.7:26257: connection refused")}
	})
	body := `{"tenant_id":"t_a","idempotency_key":"` + orig.IdempotencyKey + `","as":"succeeded","evidence":"the bank's statement","cancel_compensation":true}`
	status, got := postResolution(t, rc, body)
	if status != http.StatusServiceUnavailable || !strings.Contains(got, `"compensation_cancelled"`) || !strings.Contains(got, "undo it by hand") || strings.Contains(got, "10.0.0.7") {
		t.Errorf("%d %s; want 503 compensation_cancelled saying the compensation will not run, without the store's error", status, got)
	}
	if rec, err := r.store.Get(t.Context(), k.CompensationKey()); err != nil || rec.Status != processors.StatusDenied {
		t.Errorf("the compensation is %s (%v); want denied, cancelled (the test's premise)", rec.Status, err)
	}
}

// A resolution whose write committed but answered an error (CockroachDB's
// ambiguous result, a connection lost on COMMIT) is read back and
// answered as made, with its event: before, 503 unavailable, "try again",
// and the operator's retry was refused not_unknown, for a call settled as
// they had chosen.
func TestResolveHandlerAmbiguousCommitTaken(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	k := orig.Key()
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
		c.Store, c.Now = &losingMoves{Store: r.store, only: &k, ambiguous: errors.New("result is ambiguous (error=rpc error)")}, afterLanding
	})
	body := `{"tenant_id":"t_a","idempotency_key":"` + orig.IdempotencyKey + `","as":"failed","evidence":"the bank's statement"}`
	status, got := postResolution(t, rc, body)
	if status != http.StatusOK || !strings.Contains(got, `"type":"failed"`) {
		t.Errorf("%d %s; want 200 with the failed event", status, got)
	}
	if rec, err := r.store.Get(t.Context(), k); err != nil || rec.Status != processors.StatusFailed {
		t.Errorf("the call is %s (%v); want failed", rec.Status, err)
	}
}

// A resolution whose write failed and could not be read back is answered
// 503 action_outcome_unknown, saying to read the call before resolving it
// again, and, when it cancelled the call's automatic compensation, that
// the compensation will not run: before, 503 unavailable, "try again", or
// compensation_cancelled, "the call was not resolved", and the retry was
// refused not_unknown for a call the operator's own resolution had
// settled.
func TestResolveHandlerAmbiguousCommitUnread(t *testing.T) {
	for _, cancel := range []bool{false, true} {
		r := newRig(t)
		orig, _ := r.unknownRefundToUndo()
		k := orig.Key()
		as := processors.StatusFailed
		if cancel {
			// The reconciler's undo, which a resolution of a success
			// cancels (it leaves one of a failure to run).
			r.admitCompensation(k, executor.ReconcilerUser)
			as = processors.StatusSucceeded
		}
		rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) {
			c.Store, c.Now = &losingMoves{Store: r.store, only: &k, ambiguous: errors.New("result is ambiguous (error=rpc error)"), unreadable: true}, afterLanding
		})
		body := `{"tenant_id":"t_a","idempotency_key":"` + orig.IdempotencyKey + `","as":"` + string(as) + `","evidence":"the bank's statement","cancel_compensation":` + strconv.FormatBool(cancel) + `}`
		status, got := postResolution(t, rc, body)
		if status != http.StatusServiceUnavailable || !strings.Contains(got, `"`+httpjson.CodeActionOutcomeUnknown+`"`) || !strings.Contains(got, "read the call") || strings.Contains(got, "10.0.0.7") {
			t.Errorf("cancelling the compensation %v: %d %s; want 503 %s saying to read the call, without the store's error", cancel, status, got, httpjson.CodeActionOutcomeUnknown)
		}
		if cancel && !strings.Contains(got, "undo it by hand") {
			t.Errorf("cancelling the compensation: %s; want it to say the compensation will not run", got)
		}
		if rec, err := r.store.Get(t.Context(), k); err != nil || rec.Status != as {
			t.Errorf("cancelling the compensation %v: the call is %s (%v); want %s (the write applied)", cancel, rec.Status, err, as)
		}
	}
}

// A resolution that cancelled the reconciler's compensation and then lost
// the call's move is answered with the code that says the compensation is
// cancelled, whatever beat it: before, call_changed or not_unknown, and
// compensation_cancelled only in the text.
func TestResolveHandlerLostAfterTheCancel(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	r.admitCompensation(orig.Key(), executor.ReconcilerUser)
	k := orig.Key()
	rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Store = &losingMoves{Store: r.store, only: &k} })
	body := `{"tenant_id":"t_a","idempotency_key":"` + orig.IdempotencyKey + `","as":"succeeded","evidence":"the bank's statement","cancel_compensation":true}`
	status, got := postResolution(t, rc, body)
	if status != http.StatusConflict || !strings.Contains(got, `"compensation_cancelled"`) || !strings.Contains(got, "undo the call by hand") {
		t.Errorf("%d %s; want 409 compensation_cancelled", status, got)
	}
}

// postResolution posts body to rc's POST /v1/resolutions, as the operator
// operatorVerifier verifies, and returns the answer's status and body.
func postResolution(t *testing.T, rc *executor.Reconciler, body string) (int, string) {
	t.Helper()
	status, got, _ := postResolutionHeader(t, rc, body)
	return status, got
}

// postResolutionHeader is postResolution with the answer's headers.
func postResolutionHeader(t *testing.T, rc *executor.Reconciler, body string) (int, string, http.Header) {
	t.Helper()
	return post(t, rc.ResolveHandler(operatorVerifier{}, discardPublisher{}), "/v1/resolutions", body)
}

// post sends body to h's path with a bearer, and returns the answer's
// status, body and headers.
func post(t *testing.T, h http.Handler, path, body string) (int, string, http.Header) {
	t.Helper()
	srv := httptest.NewServer(h)
	defer srv.Close()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer x")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(got), resp.Header
}

// A call whose last attempt may still reach the tool is not resolved
// failed (which says nothing happened, and lets an agent send it again
// under a new key): 409 outcome_may_still_land, with a Retry-After, until
// the landing window (executor.Landing) has passed since it went unknown,
// as an operator's undo waits, and the reconciler's not_found. Resolved
// succeeded, it may be at once. Before, a failed resolution was taken at
// any age, and a request landing after it applied the effect of a call
// recorded as having none.
func TestResolveFailedWaitsForTheLastAttempt(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	body := func(as string) string {
		return `{"tenant_id":"t_a","idempotency_key":"` + orig.IdempotencyKey + `","as":"` + as + `","evidence":"the bank's statement"}`
	}
	status, got, h := postResolutionHeader(t, r.reconciler(), body("failed"))
	if status != http.StatusConflict || !strings.Contains(got, `"outcome_may_still_land"`) || h.Get("Retry-After") == "" {
		t.Errorf("resolving failed a call gone unknown now: %d %s, Retry-After %q; want 409 outcome_may_still_land with a Retry-After", status, got, h.Get("Retry-After"))
	}
	if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusOutcomeUnknown {
		t.Fatalf("the call is %s (%v); want outcome_unknown, not resolved", rec.Status, err)
	}
	if status, got := postResolution(t, r.reconcilerAt(afterLanding), body("failed")); status != http.StatusOK || !strings.Contains(got, `"type":"failed"`) {
		t.Errorf("resolving failed once its last attempt cannot land: %d %s; want 200, failed", status, got)
	}
	r = newRig(t)
	orig, _ = r.unknownRefundToUndo()
	if status, got := postResolution(t, r.reconciler(), body("succeeded")); status != http.StatusOK || !strings.Contains(got, `"type":"succeeded"`) {
		t.Errorf("resolving succeeded a call gone unknown now: %d %s; want 200, succeeded", status, got)
	}
}

// verifierAs verifies every assertion as one operator of t_a named user.
type verifierAs string

func (v verifierAs) Verify(context.Context, string) (identity.Identity, error) {
	return identity.Identity{User: string(v), Tenant: "t_a", Roles: []string{"operator"}}, nil
}

// postCompensation asks svc's API to compensate tenant t_a's call key,
// and returns the answer's status and body.
func postCompensation(t *testing.T, svc *compensation.Service, key string) (int, string) {
	t.Helper()
	status, body, _ := post(t, svc.Handler(), "/v1/compensations", `{"tenant_id":"t_a","idempotency_key":"`+key+`","reason":"the customer asked"}`)
	return status, body
}

// An operator's assertion naming the reconciler's own user is refused by
// the compensation API: it would skip the wait for the call's last
// attempt (which the reconciler keeps itself) and make its undo pass for
// the reconciler's. Before, it was answered as the reconciler is: a
// parked call's undo went at once, without that wait. Any other operator
// is answered as before, unless the service's registry defines the call's
// tool version otherwise than the intake that admitted it: its declared
// compensation may not be the call's, and it is refused (409
// tool_defined_otherwise, where it was taken as the call's).
func TestCompensationAPIRefusesTheReconcilersName(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	edited := processorstest.RegistryWith(t, "../testdata/registry", "refund_order", func(entry map[string]any) {
		entry["timeout_ms"] = 3000
	})
	for _, tc := range []struct {
		user   string
		reg    *schemas.Registry
		status int
		code   string
	}{
		{executor.ReconcilerUser, r.reg, http.StatusForbidden, `"forbidden"`},
		{"u_ops", r.reg, http.StatusConflict, `"outcome_may_still_land"`},
		{"u_ops", edited, http.StatusConflict, `"tool_defined_otherwise"`},
	} {
		svc, err := compensation.New(compensation.Config{Store: r.store, Registry: tc.reg, Intake: r.in, Publisher: &recordingPublisher{}, Identity: verifierAs(tc.user),
			Landing: func(tool *schemas.Tool) time.Duration { return executor.Landing(tool, 0) }})
		if err != nil {
			t.Fatal(err)
		}
		status, got := postCompensation(t, svc, orig.IdempotencyKey)
		if status != tc.status || !strings.Contains(got, tc.code) {
			t.Errorf("compensation asked by %s of a call gone unknown now: %d %s; want %d %s", tc.user, status, got, tc.status, tc.code)
		}
	}
	if n := r.backend.AppliedIn("cancel_refund", "t_a", orig.Key().CompensationKey().String()); n != 0 {
		t.Errorf("cancel_refund applied %d times; want none", n)
	}
}
