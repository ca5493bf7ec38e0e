package projectionstest

import (
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// The generated calls are legal lifecycles: every call folds without an
// error, so the projections are tested on logs the ledger can write.
func TestGeneratedCallsFold(t *testing.T) {
	log := Log(LogConfig{Seed: 3, Calls: 2000})
	o := NewOracle(log)
	calls := 0
	for _, k := range o.Keys() {
		evs := o.Events(k)
		if len(evs) == 0 {
			continue
		}
		calls++
		tr := make([]statemachine.Event, len(evs))
		for i := range evs {
			tr[i] = evs[i].Transition()
		}
		if _, err := statemachine.Fold(tr); err != nil {
			t.Errorf("call %s does not fold: %v", k, err)
		}
	}
	if calls != 2000 {
		t.Errorf("%d calls in the log, want 2000", calls)
	}
	dups := len(log) - len(uniqueIDs(log))
	if dups == 0 {
		t.Error("the log has no re-published event")
	}
	checkCoverage(t, o)
}

// The same seed and index give the same call.
func TestGeneratorRepeats(t *testing.T) {
	a, b := NewGenerator(LogConfig{Seed: 9}), NewGenerator(LogConfig{Seed: 9})
	for i := range 50 {
		x, y := a.Call(i), b.Call(i)
		if len(x) != len(y) || x[len(x)-1].EventID != y[len(y)-1].EventID || !x[0].At.Equal(y[0].At) {
			t.Fatalf("call %d differs between two generators of one seed", i)
		}
	}
}

func uniqueIDs(log []ledger.Event) map[string]bool {
	m := map[string]bool{}
	for _, e := range log {
		m[e.EventID] = true
	}
	return m
}

// Most questions the suite asks have answers in its log: a projection
// that answers nothing fails the suite.
func TestQuestionsHaveAnswers(t *testing.T) {
	cfg := LogConfig{Seed: 7, Calls: 600, Tenants: 4}
	o := NewOracle(Log(cfg))
	qs := Questions(o, cfg)
	answered := 0
	for _, q := range qs {
		f, err := q.Check()
		if err != nil {
			t.Fatalf("question %+v: %v", q, err)
		}
		if o.BlastRadius(f).Total > 0 {
			answered++
		}
	}
	if answered < len(qs)*3/4 {
		t.Errorf("%d of %d questions have answers, want at least three quarters", answered, len(qs))
	}
	if n := len(o.Unresolved(projections.Filter{AllTenants: true, Limit: 1000})); n == 0 {
		t.Error("no unresolved call in the log")
	}
}

// Questions by role have answers, and not every call: the roles are on
// some calls' decisions, not on those of the log's first quarter, nor on
// its approvers' decisions. A role no caller has matches nothing.
func TestRoleQuestionsHaveAnswers(t *testing.T) {
	cfg := LogConfig{Seed: 7, Calls: 600, Tenants: 4}
	o := NewOracle(Log(cfg))
	all := o.BlastRadius(mustCheck(t, projections.Filter{AllTenants: true, Limit: projections.MaxLimit})).Total
	for _, tc := range []struct {
		f    projections.Filter
		some bool
	}{
		{projections.Filter{AllTenants: true, Role: "support"}, true},
		{projections.Filter{AllTenants: true, Role: "contractor", Decision: "deny"}, true},
		{projections.Filter{AllTenants: true, Role: "admin", Decision: "require_approval"}, true},
		{projections.Filter{AllTenants: true, Role: "auditor"}, false},
	} {
		got := o.BlastRadius(mustCheck(t, tc.f)).Total
		if tc.some != (got > 0) || got >= all {
			t.Errorf("%+v: %d of %d calls; want some %v, fewer than all", tc.f, got, all, tc.some)
		}
	}
	// A denial no policy made (a frozen tool's, no policy version) is
	// not a decision made with the call's roles.
	frozen := 0
	for _, k := range o.Keys() {
		for _, e := range o.Events(k) {
			if e.Type != statemachine.EventDenied || e.Reason != "tool_frozen" || len(e.Roles) == 0 {
				continue
			}
			frozen++
			f := projections.Filter{Tenant: e.TenantID, CallID: e.CallID, Role: e.Roles[0], Decision: "deny"}
			if got := o.BlastRadius(mustCheck(t, f)).Total; got != 0 {
				t.Errorf("%+v: %d calls; want none, the denial is no policy's", f, got)
			}
		}
	}
	if frozen == 0 {
		t.Error("the log has no frozen tool's denial of a call with roles")
	}
	// The first quarter was decided without roles.
	first := cfg.withDefaults().Start.Add(cfg.withDefaults().Span / 4)
	if got := o.BlastRadius(mustCheck(t, projections.Filter{AllTenants: true, Role: "support", Until: first.Add(-time.Minute)})).Total; got != 0 {
		t.Errorf("calls of the first quarter by role: %d; want 0", got)
	}
}

func mustCheck(t *testing.T, f projections.Filter) projections.Filter {
	t.Helper()
	f, err := f.Check()
	if err != nil {
		t.Fatal(err)
	}
	return f
}
