package executor_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
)

// An approved call whose re-check the policies cannot answer in time is
// not denied: nothing is sent, and its claim is given back (executing, no
// owner). Once the policies answer, the sweep of expired leases claims it
// afresh (not as a takeover, which would make it outcome_unknown) and it
// runs, once. Before, the timeout was the approved call's final denial.
//
// A store that fails to take the claim back, even when asked again, does
// not end the call either: the executor holds the claim, takes nothing
// over past its lease, and gives it back at a step once the store takes
// it. Before, the call ended failed, not started.
func TestApprovedCallSurvivesAPolicyTimeout(t *testing.T) {
	for _, tc := range []struct {
		name           string
		failedReleases bool
	}{
		{"claim given back", false},
		{"store fails to take the claim back", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			engine, stalled := processorstest.StallingPolicy(t, processorstest.PolicyDir(t, `@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`))
			r := newRig(t)
			ev, approved := r.admitApproved("kp", time.Now().Add(time.Hour), "")
			st := &failingReleases{Store: r.store}
			st.fail.Store(tc.failedReleases)
			x := r.executor(func(c *executor.Config) {
				c.Store, c.Policy, c.SweepEvery = st, engine, time.Nanosecond
				// A lease of one attempt, for the case that waits for it
				// to lapse.
				c.MaxAttempts = 1
			})

			stalled.Store(true)
			out, err := x.Step(t.Context(), []*kgo.Record{approved})
			if err != nil {
				t.Fatal(err)
			}
			if got := summary(decodeAll(t, out.Records)); len(got) != 0 {
				t.Fatalf("a re-check that timed out appended %v; want nothing (the call waits)", got)
			}
			rec, err := r.store.Get(t.Context(), ev.Key())
			if err != nil {
				t.Fatal(err)
			}
			owner := ""
			if tc.failedReleases {
				owner = "x-test"
				if n := st.tries.Load(); n < 2 {
					t.Errorf("the store was asked %d times to take the claim back; want it asked again", n)
				}
			}
			if rec.Status != processors.StatusExecuting || rec.LeaseOwner != owner || rec.Attempt != 0 {
				t.Errorf("after the timeout the record is %s owned by %q, attempt %d; want executing, owned by %q, attempt 0", rec.Status, rec.LeaseOwner, rec.Attempt, owner)
			}
			if tc.failedReleases {
				// Past the claim's lease, steps (and their sweeps) take
				// nothing over while the store still fails.
				ledgertest.WaitFor(t, 10*time.Second, func() error {
					if err := stepAppendsNothing(t, x, "while the store failed to take the claim back"); err != nil {
						return err
					}
					if exp, err := r.store.Expired(t.Context(), 10); err != nil || len(exp) == 0 {
						return errors.Join(err, errors.New("the lease has not lapsed yet"))
					}
					return nil
				})
				if err := stepAppendsNothing(t, x, "past the lease"); err != nil {
					t.Fatal(err)
				}
				if held, err := r.store.Get(t.Context(), ev.Key()); err != nil || held.Epoch != rec.Epoch || held.LeaseOwner != owner {
					t.Fatalf("past the lease the record is at epoch %d owned by %q (%v); want %d, %q: not taken over", held.Epoch, held.LeaseOwner, err, rec.Epoch, owner)
				}
				st.fail.Store(false)
			}
			// While the policies still cannot answer, the sweep claims it
			// again (a new epoch) and gives it back again.
			ledgertest.WaitFor(t, 10*time.Second, func() error {
				if err := stepAppendsNothing(t, x, "with a second re-check that timed out"); err != nil {
					return err
				}
				again, err := r.store.Get(t.Context(), ev.Key())
				if err != nil {
					return err
				}
				if again.Epoch == rec.Epoch || again.LeaseOwner != "" {
					return errors.New("not claimed and given back again yet")
				}
				return nil
			})
			if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kp"); n != 0 {
				t.Fatalf("refund applied %d times while the policies could not decide; want 0", n)
			}

			stalled.Store(false)
			if diff := cmp.Diff([]string{"executing", "succeeded"}, stepUntilItRuns(t, x)); diff != "" {
				t.Errorf("once the policies answer (-want +got):\n%s", diff)
			}
			// A redelivery of the approved event finds it done.
			if out, err := x.Step(t.Context(), []*kgo.Record{approved}); err != nil || len(out.Records) != 0 {
				t.Errorf("redelivery after the run: %d records, %v; want none", len(out.Records), err)
			}
			if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kp"); n != 1 {
				t.Errorf("refund applied %d times; want 1", n)
			}
		})
	}
}

// stepUntilItRuns steps x, with no new events (its sweeps claim what was
// given back), until a step appends some, and returns their summary.
func stepUntilItRuns(t *testing.T, x *executor.Executor) []string {
	t.Helper()
	var got []string
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		out, err := x.Step(t.Context(), nil)
		if err != nil {
			return err
		}
		got = append(got, summary(decodeAll(t, out.Records))...)
		if len(got) == 0 {
			return errors.New("the call has not run yet")
		}
		return nil
	})
	return got
}

// flakyVersions is a resource-version endpoint whose first fails reads
// fail; later ones answer version.
type flakyVersions struct {
	fails   int32
	asked   atomic.Int32
	version string
}

func (f *flakyVersions) ResourceVersion(context.Context, string, string, string) (string, error) {
	if f.asked.Add(1) <= f.fails {
		return "", errors.New("503 Service Unavailable")
	}
	return f.version, nil
}

// An approved call whose resource version cannot be read to confirm the
// approval (the endpoint answers 503 once) sends nothing and is not
// denied: the claim is given back, and once the version reads (the one
// approved) the call runs, once. Before, one failed read ended the
// approved call denied, resource_changed, which it was not.
func TestApprovedCallSurvivesAnUnreadableVersion(t *testing.T) {
	r := newRig(t)
	// v0: the demo backend's order as it is, which the tool checks too
	// (If-Match).
	ev, approved := r.admitApproved("kv", time.Now().Add(time.Hour), "v0")
	versions := &flakyVersions{fails: 1, version: "v0"}
	x := r.executor(func(c *executor.Config) {
		c.Versions, c.SweepEvery = versions, time.Nanosecond
	})
	stepGivesBack(t, r, x, approved, ev.Key(), "a version that could not be read")
	if diff := cmp.Diff([]string{"executing", "succeeded"}, stepUntilItRuns(t, x)); diff != "" {
		t.Errorf("once the version reads (-want +got):\n%s", diff)
	}
	if n := versions.asked.Load(); n != 2 {
		t.Errorf("version read %d times; want 2 (the failed read, then the one that confirmed it)", n)
	}
	if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kv"); n != 1 {
		t.Errorf("refund applied %d times; want 1", n)
	}
}

// staleVersions is a resource-version endpoint read just before a
// change: it answers version whatever the resource's now.
type staleVersions struct{ version string }

func (s staleVersions) ResourceVersion(context.Context, string, string, string) (string, error) {
	return s.version, nil
}

// Two refunds of one order approved at the same version (an agent that
// retried under a new key; both approved): the executor's read of the
// version can come before the first refund lands, and both would run.
// To a tool that declares it honours If-Match (resource_version.if_match,
// as the demo backend does), the approved version goes as If-Match, and
// the tool refuses the second, 412: it ends failed resource_changed,
// nothing applied. Before, both refunded. A tool that does not declare it
// gets no If-Match (it could check it against tags of its own).
func TestApprovedVersionGoesToTheToolAsIfMatch(t *testing.T) {
	for _, tc := range []struct {
		name     string
		declared bool
		second   []string
		code     string
		applied  int
	}{
		{"declared", true, []string{"executing", "failed(" + executor.ReasonResourceChanged + ")"}, "http_412", 0},
		{"not declared", false, []string{"executing", "succeeded"}, "", 1},
		// A version that cannot be a strong entity tag is not sent, and
		// the tool's 412 to anything else would not be taken for it.
		{"declared, a weak tag", true, []string{"executing", "succeeded"}, "", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := processorstest.RegistryWith(t, "../testdata/registry", "refund_order", func(entry map[string]any) {
				entry["resource_version"].(map[string]any)["if_match"] = tc.declared
			})
			r := newRigWith(t, reg, demobackend.Config{})
			version := "v0"
			if strings.HasSuffix(tc.name, "weak tag") {
				version = `W/"v0"`
			}
			_, first := r.admitApproved("ka", time.Now().Add(time.Hour), version)
			_, second := r.admitApproved("kb", time.Now().Add(time.Hour), version)
			x := r.executor(func(c *executor.Config) { c.Versions = staleVersions{version} })
			stepEndsAs(t, x, first, []string{"executing", "succeeded"}, "")
			stepEndsAs(t, x, second, tc.second, tc.code)
			if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kb"); n != tc.applied {
				t.Errorf("the second refund applied %d times; want %d", n, tc.applied)
			}
		})
	}
}

// goneVersions is a resource-version endpoint that answers err.
type goneVersions struct{ err error }

func (g goneVersions) ResourceVersion(context.Context, string, string, string) (string, error) {
	return "", g.err
}

// A version read that will not succeed by waiting (404: the resource is
// gone; 403; a URL that cannot be asked) denies the approved call,
// resource_changed, at once, as a version that differs does: only errors
// that may pass give the claim back. Before the distinction, a deleted
// order's approved refund was claimed, given back and logged every sweep
// until its approval expired, and then denied for the expiry.
func TestApprovedCallWithAVersionThatCannotBeReadIsDenied(t *testing.T) {
	for _, err := range []error{
		&httptool.Error{Kind: httptool.ServerError, Status: http.StatusNotFound, Detail: "resource version"},
		&httptool.Error{Kind: httptool.ServerError, Status: http.StatusForbidden, Detail: "resource version"},
		&httptool.Error{Kind: httptool.ServerError, Status: http.StatusMovedPermanently, Detail: "resource version"},
		fmt.Errorf("resource version url: %w", httptool.ErrInvalidRequest),
		fmt.Errorf("%w: relative url without a base url", processors.ErrVersionURL),
	} {
		t.Run(err.Error(), func(t *testing.T) {
			r := newRig(t)
			_, approved := r.admitApproved("kg", time.Now().Add(time.Hour), "v1")
			x := r.executor(func(c *executor.Config) { c.Versions = goneVersions{err} })
			stepEndsAs(t, x, approved, []string{"denied(" + executor.ReasonResourceChanged + ")"}, "")
			if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kg"); n != 0 {
				t.Errorf("refund applied %d times; want 0", n)
			}
		})
	}
}

// An executor that stops while it holds a claim the store failed to take
// back (TestApprovedCallSurvivesAPolicyTimeout) asks the store once more
// in Drain, so that a store back by then gets the claim (and the call is
// claimed afresh later, not taken over as one that may have been sent);
// a claim still held is logged with its key.
func TestDrainGivesHeldClaimsBack(t *testing.T) {
	for _, tc := range []struct {
		name       string
		storeBack  bool
		wantOwner  string
		wantLogged bool
	}{
		{"store back by shutdown", true, "", false},
		{"store still failing", false, "x-test", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			engine, stalled := processorstest.StallingPolicy(t, processorstest.PolicyDir(t, `@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`))
			r := newRig(t)
			ev, approved := r.admitApproved("kd", time.Now().Add(time.Hour), "")
			st := &failingReleases{Store: r.store}
			st.fail.Store(true)
			logs := &ledgertest.LogBuffer{}
			reg := metrics.New("executor", nil)
			x := r.executor(func(c *executor.Config) {
				c.Store, c.Policy, c.Metrics = st, engine, reg
				c.Logger = slog.New(slog.NewTextHandler(logs, nil))
			})
			stalled.Store(true)
			if out, err := x.Step(t.Context(), []*kgo.Record{approved}); err != nil || len(out.Records) != 0 {
				t.Fatalf("a re-check that timed out: %d records, %v; want none (the call waits)", len(out.Records), err)
			}
			if n := counter(t, reg, "ledger_claims_total", "result", "held"); n != 1 {
				t.Errorf("ledger_claims_total{result=\"held\"} = %v; want 1", n)
			}
			st.fail.Store(!tc.storeBack)
			if err := x.Drain(t.Context()); err != nil {
				t.Fatal(err)
			}
			rec, err := r.store.Get(t.Context(), ev.Key())
			if err != nil {
				t.Fatal(err)
			}
			if rec.Status != processors.StatusExecuting || rec.LeaseOwner != tc.wantOwner {
				t.Errorf("after Drain the record is %s owned by %q; want executing, owned by %q", rec.Status, rec.LeaseOwner, tc.wantOwner)
			}
			logged := strings.Contains(logs.String(), "claims not given back at shutdown") && strings.Contains(logs.String(), ev.Key().String())
			if logged != tc.wantLogged {
				t.Errorf("the held claim's key logged at shutdown: %v; want %v; log:\n%s", logged, tc.wantLogged, logs)
			}
			if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kd"); n != 0 {
				t.Errorf("refund applied %d times; want 0", n)
			}
		})
	}
}

// stepAppendsNothing runs a step of x, which must append nothing (the
// call waits), and returns the step's error.
func stepAppendsNothing(t *testing.T, x *executor.Executor, when string) error {
	t.Helper()
	out, err := x.Step(t.Context(), nil)
	if err == nil && len(out.Records) != 0 {
		t.Fatalf("a step %s appended %v; want nothing (the call waits)", when, summary(decodeAll(t, out.Records)))
	}
	return err
}

// failingReleases is the store, except that Release fails while fail is
// set; tries counts the Release calls.
type failingReleases struct {
	executor.Store
	fail  atomic.Bool
	tries atomic.Int64
}

func (s *failingReleases) Release(ctx context.Context, rs []processors.Release) ([]bool, error) {
	s.tries.Add(1)
	if s.fail.Load() {
		return nil, errors.New("store unavailable")
	}
	return s.Store.Release(ctx, rs)
}

// An approved call runs under the obligations of both its approval-time
// decision and the executor's re-check of it: the policies in force at
// execution (another version, say) mask the currency, not the refund's
// id, and the id the approval-time decision
// masked stays masked in the stored result, while the events record the
// re-check's policy and version with both decisions' obligations. Before,
// the re-check's obligations replaced the approval's: the refund's id was
// stored in the clear, and undo_unknown was lost. The rate limits named
// are the approval-time decision's, which the intake charged: before,
// the re-check's were named, never charged, and the charged one dropped.
func TestRecheckKeepsTheApprovalsObligations(t *testing.T) {
	engine := processorstest.Policy(t, processorstest.PolicyDir(t, `@id("refunds-v2") @mask("currency") @rate_limit("5/h")
permit (principal, action == Action::"tool::refund_order", resource);`))
	r := newRig(t)
	ev, approved := r.admitApproved("km", time.Now().Add(time.Hour), "", "require_approval", "mask:refund_id", "rate_limit:20/m", "undo_unknown")
	out, err := r.executor(func(c *executor.Config) { c.Policy = engine }).Step(t.Context(), []*kgo.Record{approved})
	if err != nil {
		t.Fatal(err)
	}
	evs := decodeAll(t, out.Records)
	if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(evs)); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	// The rate limit is the one the intake charged, not the re-check's
	// (which charges nothing).
	want := []string{"require_approval", "mask:currency", "mask:refund_id", "rate_limit:20/m", "undo_unknown"}
	// The re-check's allow is a decision of the version in force, on the
	// executing event alone: "what did v41 allow" finds the call.
	if evs[0].Decision != "allow" || evs[1].Decision != "" {
		t.Errorf("decisions on the executing and succeeded events %q, %q; want allow, none", evs[0].Decision, evs[1].Decision)
	}
	for _, e := range evs {
		if diff := cmp.Diff(want, e.Obligations); diff != "" {
			t.Errorf("%s event's obligations (-want +got):\n%s", e.Type, diff)
		}
		if diff := cmp.Diff([]string{"refunds-v2"}, e.PolicyID); diff != "" || e.PolicyVersion != engine.Active().Version() {
			t.Errorf("%s event decided by %v at %s; want [refunds-v2] at %s (the re-check's)", e.Type, e.PolicyID, e.PolicyVersion, engine.Active().Version())
		}
	}
	content := r.storedContent(ev.Key())
	for _, f := range []string{"refund_id", "currency"} {
		if v := content[f]; v != ledger.Redacted {
			t.Errorf("stored result's %s is %v; want %q", f, v, ledger.Redacted)
		}
	}
	if v := content["order_id"]; v != "ord_1" {
		t.Errorf("stored result's order_id is %v; want ord_1 (no policy masks it)", v)
	}
}

// An approved call is decided again with the roles its events carry (the
// caller's roles the intake's policies were given), and its events go on
// carrying them. A call decided without roles (before --policy-roles was
// turned on) is decided again without them, not with an empty set: the
// executor's policies then fail closed on a policy that reads them
// (policy_error), where an empty set let a forbid on a role pass it.
func TestRecheckDecidesWithTheCallersRoles(t *testing.T) {
	engine := processorstest.PolicyWithRoles(t, processorstest.PolicyDir(t, `@id("finance-refunds")
permit (principal, action == Action::"tool::refund_order", resource) when { principal.roles.contains("finance") || context.amount < 1000 };
@id("no-contractors")
forbid (principal, action, resource) when { principal.roles.contains("contractor") };`))
	for _, tc := range []struct {
		roles []string
		given bool
		want  []string
	}{
		{[]string{"finance"}, true, []string{"succeeded"}},
		{nil, true, []string{"succeeded"}},
		{[]string{"contractor"}, true, []string{"denied(denied_by_policy)"}},
		{nil, false, []string{"denied(policy_error)"}},
		// Roles without roles_given: written by a build before it,
		// decided with them.
		{[]string{"finance"}, false, []string{"succeeded"}},
	} {
		r := newRig(t)
		_, approved := r.admitApprovedWith("kr", func(ev *ledger.Event) { ev.Roles, ev.RolesGiven = tc.roles, tc.given })
		out, err := r.executor(func(c *executor.Config) { c.Policy = engine }).Step(t.Context(), []*kgo.Record{approved})
		if err != nil {
			t.Fatal(err)
		}
		evs := decodeAll(t, out.Records)
		if got := summary(evs); len(got) == 0 || got[len(got)-1] != tc.want[0] {
			t.Errorf("roles %q: events %v; want the call to end %s", tc.roles, got, tc.want[0])
		}
		for _, e := range evs {
			// The re-check's decision was made with the roles, given
			// unless withheld; the other events carry the call's.
			given := tc.given || e.Decision != "" && len(tc.roles) > 0
			if !slices.Equal(e.Roles, tc.roles) || e.RolesGiven != given {
				t.Errorf("roles %q (given %v): %s event carries roles %q (given %v); want given %v", tc.roles, tc.given, e.Type, e.Roles, e.RolesGiven, given)
			}
		}
	}
}

// An executor whose policies are not given roles (--policy-roles off
// there, on at the intake) records its re-check's decision without them,
// allow or deny: a role's blast radius must not count a decision made
// without the role as one made with it. The call's other events keep the
// roles it was first decided with.
func TestRecheckWithoutRolesRecordsNone(t *testing.T) {
	for _, tc := range []struct {
		policies string
		want     string
	}{
		{`permit (principal, action, resource);`, "succeeded"},
		{`permit (principal, action, resource); forbid (principal, action == Action::"tool::refund_order", resource);`, "denied(denied_by_policy)"},
	} {
		engine := processorstest.Policy(t, processorstest.PolicyDir(t, tc.policies))
		r := newRig(t)
		_, approved := r.admitApprovedWith("kr", func(ev *ledger.Event) { ev.Roles, ev.RolesGiven = []string{"contractor"}, true })
		out, err := r.executor(func(c *executor.Config) { c.Policy = engine }).Step(t.Context(), []*kgo.Record{approved})
		if err != nil {
			t.Fatal(err)
		}
		evs := decodeAll(t, out.Records)
		if got := summary(evs); len(got) == 0 || got[len(got)-1] != tc.want {
			t.Fatalf("events %v; want the call to end %s", got, tc.want)
		}
		decided := 0
		for _, e := range evs {
			if e.Decision == "" {
				if !slices.Equal(e.Roles, []string{"contractor"}) || !e.RolesGiven {
					t.Errorf("%s event carries roles %q (given %v); want the call's", e.Type, e.Roles, e.RolesGiven)
				}
				continue
			}
			decided++
			if len(e.Roles) != 0 || e.RolesGiven {
				t.Errorf("the re-check's %s (%s) carries roles %q (given %v); want none", e.Type, e.Decision, e.Roles, e.RolesGiven)
			}
		}
		if decided != 1 {
			t.Errorf("%d events record the re-check's decision; want 1", decided)
		}
	}
}

// A mask obligation holds whatever the tool answers: a key spelt in
// another case is masked too (readers such as Go's encoding/json match it
// to the masked field), and a result the masks cannot be applied to (an
// integer above 2^53, a duplicate key) is kept without its content,
// code result_unmaskable, never stored whole. An empty answer has nothing
// to hide: kept as it is, not called unmaskable.
func TestMaskHoldsWhateverTheToolAnswers(t *testing.T) {
	for _, tc := range []struct {
		name, body, code string
		content          bool
	}{
		{"another case", `{"Refund_ID":"rf_secret","order_id":"ord_1"}`, "", true},
		{"a large integer", `{"refund_id":"rf_secret","order_id":12345678901234567890}`, executor.CodeResultUnmaskable, false},
		{"a duplicate key", `{"refund_id":"rf_secret","refund_id":"rf_secret"}`, executor.CodeResultUnmaskable, false},
		{"an empty answer", "", "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			r.backend.SetFault("refund_order", demobackend.Fault{Body: append([]byte{}, tc.body...)})
			ev, approved := r.admitApproved("km", time.Now().Add(time.Hour), "", "require_approval", "mask:refund_id")
			out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{approved})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if diff := cmp.Diff([]string{"executing", "succeeded"}, summary(evs)); diff != "" {
				t.Fatalf("events (-want +got):\n%s", diff)
			}
			if evs[1].ErrorCode != tc.code {
				t.Errorf("code %q; want %q", evs[1].ErrorCode, tc.code)
			}
			rec, err := r.store.Get(t.Context(), ev.Key())
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(string(rec.Result), "rf_secret") {
				t.Errorf("stored result %s shows the masked refund id", rec.Result)
			}
			if got := strings.Contains(string(rec.Result), `"content"`); got != tc.content {
				t.Errorf("stored result %s: content kept %v; want %v", rec.Result, got, tc.content)
			}
			// Nor do the events give the answer as it came away: its
			// digest would confirm a guess of the masked value, hashed
			// into the rest of the answer, which the content shows.
			raw := sha256.Sum256([]byte(tc.body))
			if evs[1].ResultDigest == "sha256:"+hex.EncodeToString(raw[:]) || evs[1].ResultBytes == len(tc.body) {
				t.Errorf("succeeded event has the digest %s and size %d of the unmasked answer", evs[1].ResultDigest, evs[1].ResultBytes)
			}
			if tc.content != (evs[1].ResultDigest != "") {
				t.Errorf("result digest %q; want one (of the masked content) only when the content is kept", evs[1].ResultDigest)
			}
		})
	}
}

// A call carrying the sandbox obligation (decided by an older intake,
// which only recorded it) is denied sandbox_unavailable before anything
// is sent: no call runs against a sandbox backend, and the real one would
// escape the rule.
func TestSandboxedCallNeverRunsAgainstTheRealBackend(t *testing.T) {
	r := newRig(t)
	ev, approved := r.admitApproved("ks", time.Now().Add(time.Hour), "", "require_approval", "sandbox")
	out, err := r.executor(nil).Step(t.Context(), []*kgo.Record{approved})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"denied(" + policy.ReasonSandboxUnavailable + ")"}, summary(decodeAll(t, out.Records))); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn("refund_order", "t_a", ev.Key().String()); n != 0 {
		t.Errorf("refund applied %d times; want 0", n)
	}
}

// jumpingClock is the executor's clock in a test: the real time, until
// jump moves it on by an hour and a half.
type jumpingClock struct{ ahead atomic.Bool }

func (c *jumpingClock) Now() time.Time {
	if c.ahead.Load() {
		return time.Now().Add(90 * time.Minute)
	}
	return time.Now()
}

func (c *jumpingClock) jump() { c.ahead.Store(true) }

// clockJumpingDecider decides as d does, and jumps clock first: the
// approval expires while the policies decide the call again.
type clockJumpingDecider struct {
	d     executor.Decider
	clock *jumpingClock
}

func (j clockJumpingDecider) Decide(ctx context.Context, r policy.Request) policy.Decision {
	j.clock.jump()
	return j.d.Decide(ctx, r)
}

// An approval that expires after the check at the call's start and before
// its request leaves (I4) stops the request: during the re-check's own
// reads, the call is denied approval_expired; during a retry's backoff
// after an answer that says the tool did nothing (429), it fails, code
// approval_expired; after a 5xx, which does not say so, its outcome is
// unknown, code approval_expired. Before, only the call's start was checked, and a
// call held up past its approval's expiry (a slow policy, a full
// bulkhead, a retry) was sent all the same.
func TestApprovalLapsingBeforeTheRequestLeaves(t *testing.T) {
	refunds := processorstest.Policy(t, processorstest.PolicyDir(t, `@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`))
	for _, tc := range []struct {
		name     string
		lapse    string // "policy": while the policies decide; "retry": after the first answer
		status   int    // the first answer, when lapse is "retry"
		want     []string
		code     string
		requests int64
	}{
		{"during the re-check", "policy", 0, []string{"denied(" + executor.ReasonApprovalExpired + ")"}, "", 0},
		{"before a retry after 429", "retry", http.StatusTooManyRequests, []string{"executing", "failed(" + executor.ReasonUnavailable + ")"}, executor.ReasonApprovalExpired, 1},
		{"before a retry after 503", "retry", http.StatusServiceUnavailable, []string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, executor.ReasonApprovalExpired, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			clock := &jumpingClock{}
			_, approved := r.admitApproved("kl", time.Now().Add(time.Hour), "")
			requests := new(atomic.Int64)
			h := r.backend.Handler()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
				h.ServeHTTP(w, q)
				if requests.Add(1) == 1 && tc.lapse == "retry" {
					clock.jump()
				}
			}))
			t.Cleanup(srv.Close)
			var decider executor.Decider = refunds
			if tc.lapse == "policy" {
				decider = clockJumpingDecider{refunds, clock}
			} else {
				// Answered without the effect: a retry would follow.
				r.backend.SetFault(demobackend.ToolRefundOrder, demobackend.Fault{FailStatus: tc.status, FailTimes: 1})
			}
			x := r.executor(func(c *executor.Config) { c.Policy, c.Now, c.BaseURL = decider, clock.Now, srv.URL })
			stepEndsAs(t, x, approved, tc.want, tc.code)
			if n := requests.Load(); n != tc.requests {
				t.Errorf("%d requests reached the tool; want %d (none past the approval's expiry)", n, tc.requests)
			}
			if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kl"); n != 0 {
				t.Errorf("refund applied %d times; want 0", n)
			}
		})
	}
}

// catchingUp is a copy of the control topic that is behind until it is
// first asked whether it is current, and then has caught up with an
// activation: the policies it holds switch from older to newer.
type catchingUp struct {
	switchedFreezes
	older, newer executor.Decider
	caught       atomic.Bool
}

func (c *catchingUp) Current(ctx context.Context, maxStaleness time.Duration) error {
	c.caught.Store(true)
	return nil
}

func (c *catchingUp) Decide(ctx context.Context, r policy.Request) policy.Decision {
	if c.caught.Load() {
		return c.newer.Decide(ctx, r)
	}
	return c.older.Decide(ctx, r)
}

// An approved call is decided again on a copy of the control topic known
// current, so under the activation in force: before, the re-check decided
// with whatever version a stale copy held, and the request left once the
// copy had caught up, with a version activated since that denies it.
func TestRecheckWaitsForACurrentActivation(t *testing.T) {
	older := processorstest.Policy(t, processorstest.PolicyDir(t, `permit (principal, action, resource);`))
	newer := processorstest.Policy(t, processorstest.PolicyDir(t, `permit (principal, action, resource);
forbid (principal, action == Action::"tool::refund_order", resource);`))
	cp := &catchingUp{older: older, newer: newer}
	r := newRig(t)
	_, approved := r.admitApproved("kc", time.Now().Add(time.Hour), "")
	stepEndsAs(t, r.executor(func(c *executor.Config) { c.Policy, c.Freezes = cp, cp }), approved, []string{"denied(denied_by_policy)"}, "")
	if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kc"); n != 0 {
		t.Errorf("refund applied %d times; want 0 (the version in force denies it)", n)
	}
}

// An approved call whose re-check waits for a copy of the control topic
// that does not catch up sends nothing and is not ended: the wait is
// bounded as the resource version's read is, the claim is given back,
// and once the copy is current the call runs, once. Before, the wait
// took the call's whole time, and the call ended failed,
// deadline_exceeded, its approval used up.
func TestApprovedCallWaitsOutAStaleControlCopy(t *testing.T) {
	r := newRig(t)
	ev, approved := r.admitApproved("ks", time.Now().Add(time.Hour), "")
	fz := &switchedFreezes{fresh: make(chan struct{})}
	fz.stale.Store(true)
	engine := processorstest.Policy(t, processorstest.PolicyDir(t, `permit (principal, action, resource);`))
	x := r.executor(func(c *executor.Config) { c.Policy, c.Freezes, c.SweepEvery = engine, fz, time.Nanosecond })
	stepGivesBack(t, r, x, approved, ev.Key(), "a re-check on a stale copy")
	close(fz.fresh)
	if diff := cmp.Diff([]string{"executing", "succeeded"}, stepUntilItRuns(t, x)); diff != "" {
		t.Errorf("once the copy is current (-want +got):\n%s", diff)
	}
	if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/ks"); n != 1 {
		t.Errorf("refund applied %d times; want 1", n)
	}
}

// stepGivesBack runs a step of x on rec, which must append nothing (the
// call waits, what happened says why) and leave the call under key
// executing, its claim given back.
func stepGivesBack(t *testing.T, r *rig, x *executor.Executor, rec *kgo.Record, key ledger.CallKey, what string) {
	t.Helper()
	out, err := x.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	if got := summary(decodeAll(t, out.Records)); len(got) != 0 {
		t.Fatalf("%s appended %v; want nothing (the call waits)", what, got)
	}
	stored, err := r.store.Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if stored.Status != processors.StatusExecuting || stored.LeaseOwner != "" {
		t.Fatalf("record %s owned by %q; want executing, given back", stored.Status, stored.LeaseOwner)
	}
}

// switchingDecider decides as first until then is set, then as then: a
// version activated between two attempts of an approved call.
type switchingDecider struct {
	first, then executor.Decider
	switched    *atomic.Bool
}

func (s switchingDecider) Decide(ctx context.Context, r policy.Request) policy.Decision {
	if s.switched.Load() {
		return s.then.Decide(ctx, r)
	}
	return s.first.Decide(ctx, r)
}

// activatedAfterRecheck is a switchingDecider whose switch comes right
// after its first decision: a version activated while an approved call
// waited for a slot, after its re-check.
type activatedAfterRecheck struct{ switchingDecider }

func (d activatedAfterRecheck) Decide(ctx context.Context, r policy.Request) policy.Decision {
	dec := d.switchingDecider.Decide(ctx, r)
	d.switched.Store(true)
	return dec
}

// The policies in force decide an approved call's first request too,
// right before it leaves, not only at the re-check before its wait for a
// slot: a version activated during the wait that denies the call wins,
// and nothing is sent. Before, only retries were decided again.
func TestPoliciesDecideTheFirstRequest(t *testing.T) {
	allow := processorstest.Policy(t, processorstest.PolicyDir(t, `@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`))
	deny := processorstest.Policy(t, processorstest.PolicyDir(t, `@id("no-refunds") forbid (principal, action == Action::"tool::refund_order", resource);
@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`))
	r := newRig(t)
	_, approved := r.admitApproved("kf", time.Now().Add(time.Hour), "")
	x := r.executor(func(c *executor.Config) {
		c.Policy = activatedAfterRecheck{switchingDecider{allow, deny, new(atomic.Bool)}}
	})
	stepEndsAs(t, x, approved, []string{"denied(" + policy.ReasonDeniedByPolicy + ")"}, "")
	if n := r.backend.Requests(); n != 0 {
		t.Errorf("%d requests reached the tool; want none", n)
	}
}

// unavailable is an engine with no set to decide with (an activation
// whose files have not reached this executor yet).
type unavailable struct{}

func (unavailable) Decide(context.Context, policy.Request) policy.Decision {
	return policy.Decision{Reason: policy.ReasonUnavailable}
}

// An approved call is decided again with the policies in force before
// each retry. A version activated during a retry's backoff that denies it
// stops the retry, as an approval lapsing then does: after an answer that
// says the tool did nothing (429), the call fails, code denied_by_policy;
// after a 5xx, its outcome is unknown. One that allows it decides it: the
// events name it, and its masks hide the result. An engine that cannot
// decide then (a version activated whose files have not arrived) holds
// the retry back too, failing closed: after a 429 the call is given back,
// to be decided again at its next claim. Before, the policies were asked
// at the call's start alone, and the retry went out under the version
// the activation had replaced; and, later, an undecided answer let it go
// out under the start's decision, while the intake refused every call.
func TestPoliciesDecideEachRetry(t *testing.T) {
	allow := processorstest.Policy(t, processorstest.PolicyDir(t, `@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`))
	deny := processorstest.Policy(t, processorstest.PolicyDir(t, `@id("no-refunds") forbid (principal, action == Action::"tool::refund_order", resource);
@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`))
	masking := processorstest.Policy(t, processorstest.PolicyDir(t, `@id("refunds-v2") @mask("currency") permit (principal, action == Action::"tool::refund_order", resource);`))
	for _, tc := range []struct {
		name     string
		then     executor.Decider
		status   int
		want     []string
		code     string
		requests int64
		applied  int
		version  string // the events', when it succeeds
	}{
		{"denied after 429", deny, http.StatusTooManyRequests, []string{"executing", "failed(" + executor.ReasonUnavailable + ")"}, policy.ReasonDeniedByPolicy, 1, 0, ""},
		{"denied after 503", deny, http.StatusServiceUnavailable, []string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, policy.ReasonDeniedByPolicy, 1, 0, ""},
		{"allowed with a mask", masking, http.StatusTooManyRequests, []string{"executing", "succeeded"}, "", 2, 1, masking.Active().Version()},
		{"undecided", unavailable{}, http.StatusTooManyRequests, nil, "", 1, 0, ""},
		// After a 503 the retry under the same key is held back too, and
		// decided again before each attempt left; none does, and the
		// outcome is unknown under the tool's own code, not the stall's.
		{"undecided after 503", unavailable{}, http.StatusServiceUnavailable, []string{"executing", "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")"}, "http_503", 1, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			ev, approved := r.admitApproved("kp", time.Now().Add(time.Hour), "")
			switched := new(atomic.Bool)
			requests := new(atomic.Int64)
			h := r.backend.Handler()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
				h.ServeHTTP(w, q)
				requests.Add(1)
				switched.Store(true)
			}))
			t.Cleanup(srv.Close)
			r.backend.SetFault(demobackend.ToolRefundOrder, demobackend.Fault{FailStatus: tc.status, FailTimes: 1})
			x := r.executor(func(c *executor.Config) { c.Policy, c.BaseURL = switchingDecider{allow, tc.then, switched}, srv.URL })
			out, err := x.Step(t.Context(), []*kgo.Record{approved})
			if err != nil {
				t.Fatal(err)
			}
			evs := decodeAll(t, out.Records)
			if diff := cmp.Diff(tc.want, summary(evs)); diff != "" {
				t.Fatalf("events (-want +got):\n%s", diff)
			}
			if tc.want == nil {
				// Given back (its lease ended within a second, where a
				// claim's runs for the tool's timeout and more),
				// unsettled, its one request answered without effect.
				if rec, err := r.store.Get(t.Context(), ev.Key()); err != nil || rec.Status != processors.StatusExecuting || rec.LeaseUntil.After(time.Now().Add(time.Second)) {
					t.Errorf("the call is %s, its lease until %s (%v); want executing, its claim given back", rec.Status, rec.LeaseUntil.Format(time.RFC3339Nano), err)
				}
				if n, applied := requests.Load(), r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kp"); n != tc.requests || applied != tc.applied {
					t.Errorf("%d requests reached the tool, the refund applied %d times; want %d, %d", n, applied, tc.requests, tc.applied)
				}
				return
			}
			last := evs[len(evs)-1]
			if got := last.ErrorCode; got != tc.code {
				t.Errorf("error code %q; want %q", got, tc.code)
			}
			// Failed, it names the decision that refused the retry, as
			// its denial would: "what did this version deny" finds it.
			if tc.then == deny && tc.status == http.StatusTooManyRequests &&
				(last.Decision != "deny" || last.PolicyVersion != deny.Active().Version() || !slices.Equal(last.PolicyID, []string{"no-refunds"})) {
				t.Errorf("failed names decision %q by %v at %s; want deny by [no-refunds] at %s", last.Decision, last.PolicyID, last.PolicyVersion, deny.Active().Version())
			}
			if n := requests.Load(); n != tc.requests {
				t.Errorf("%d requests reached the tool; want %d", n, tc.requests)
			}
			if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/kp"); n != tc.applied {
				t.Errorf("refund applied %d times; want %d", n, tc.applied)
			}
			if tc.version == "" {
				return
			}
			for _, e := range evs {
				if e.PolicyVersion != tc.version {
					t.Errorf("%s event decided at %s; want %s, the decision that let the retry leave", e.Type, e.PolicyVersion, tc.version)
				}
			}
			content := r.storedContent(ev.Key())
			if masked := content["currency"] == ledger.Redacted; masked != (tc.then == masking) {
				t.Errorf("stored result's currency %v; want masked: %v", content["currency"], tc.then == masking)
			}
		})
	}
}

// storedContent is the content of the result the store holds under key.
func (r *rig) storedContent(key ledger.CallKey) map[string]any {
	r.t.Helper()
	rec, err := r.store.Get(r.t.Context(), key)
	if err != nil {
		r.t.Fatal(err)
	}
	var res struct {
		Content map[string]any `json:"content"`
	}
	if err := json.Unmarshal(rec.Result, &res); err != nil {
		r.t.Fatal(err)
	}
	return res.Content
}

// An approval with less than a second left lets no request leave: its
// expiry is the intake's clock, judged on the executor's, which may differ
// by what ledger doctor accepts of each against the store (500 ms), twice
// over. Before, a call claimed 500 ms before its approval's expiry on a
// clock running late was sent after the expiry the approval states.
func TestApprovalWithinTheClockMarginDoesNotRun(t *testing.T) {
	r := newRig(t)
	_, approved := r.admitApproved("km2", time.Now().Add(500*time.Millisecond), "")
	stepEndsAs(t, r.executor(nil), approved, []string{"denied(" + executor.ReasonApprovalExpired + ")"}, "")
	if n := r.backend.AppliedIn(demobackend.ToolRefundOrder, "t_a", "t_a/km2"); n != 0 {
		t.Errorf("refund applied %d times; want 0", n)
	}
}
