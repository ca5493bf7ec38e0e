package projectionstest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Projection is what the suite tests: a sink that answers queries.
type Projection interface {
	projections.Sink
	projections.Queries
}

// Run holds the projection that open returns (a fresh, empty one per
// call) to the oracle's answers over a generated log, written once and
// then again.
func Run(t *testing.T, open func(t *testing.T) Projection) {
	cfg := LogConfig{Seed: 7, Calls: 600, Tenants: 4}
	log := Log(cfg)
	// One key flooded with more refusals than a trace shows, spread
	// through the log.
	flooded := log[len(log)/2].Key()
	for i, e := range Flood(flooded, projections.MaxRefusals+30, 7, cfg.withDefaults().Start) {
		at := (i*7919 + 13) % len(log)
		log = slices.Insert(log, at, e)
	}
	oracle := NewOracle(log)

	t.Run("answers", func(t *testing.T) {
		p := open(t)
		Write(t, p, log, 97)
		Check(t, p, oracle, cfg)
	})
	t.Run("written twice", func(t *testing.T) {
		p := open(t)
		Write(t, p, log, 250)
		// A projector that crashed before committing re-reads what it
		// wrote, in other batches.
		Write(t, p, log, 61)
		Check(t, p, oracle, cfg)
	})
	t.Run("counts cut", func(t *testing.T) {
		p := open(t)
		ctx := t.Context()
		start := cfg.withDefaults().Start
		n := projections.MaxCounts + 40
		wide := Wide(n, start)
		Write(t, p, wide, 500)
		o := NewOracle(wide)
		for _, q := range []projections.Filter{
			{AllTenants: true},
			{AllTenants: true, Tool: "get_weather", Limit: 10},
			{AllTenants: true, Since: start.Add(30 * time.Second), Until: start.Add(time.Duration(n-30) * time.Second)},
			{AllTenants: true, State: statemachine.StateDenied},
			{Tenant: "t_hot"},
		} {
			f, err := q.Check()
			if err != nil {
				t.Fatalf("question %+v: %v", q, err)
			}
			got, err := p.BlastRadius(ctx, q)
			if err != nil {
				t.Fatalf("BlastRadius(%s): %v", describe(q), err)
			}
			if diff := cmp.Diff(o.BlastRadius(f), got, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("BlastRadius(%s) (-oracle +projection):\n%s", describe(q), diff)
			}
		}
		// What the cut keeps, worked out from Wide rather than by the
		// oracle: the hot values, then the ties by value.
		br, err := p.BlastRadius(ctx, projections.Filter{AllTenants: true})
		if err != nil {
			t.Fatal(err)
		}
		calls := n + 11
		if br.Total != calls || len(br.Calls) != projections.DefaultLimit || !br.Truncated {
			t.Errorf("BlastRadius(all) = %d calls, %d listed (truncated %t); want %d, %d listed, truncated", br.Total, len(br.Calls), br.Truncated, calls, projections.DefaultLimit)
		}
		if want := (projections.Distinct{Tenants: n + 2, States: 2, Tools: 3, Resources: n + 2}); br.Distinct != want || !br.CountsCut() {
			t.Errorf("BlastRadius(all).Distinct = %+v (cut %t); want %+v, cut", br.Distinct, br.CountsCut(), want)
		}
		for _, d := range []struct {
			name         string
			counts       []projections.Count
			prefix, hot  string
			warm, lastOf string
		}{
			{"ByResource", br.ByResource, "res_", "res_hot", "res_warm", fmt.Sprintf("res_%05d", projections.MaxCounts-3)},
			{"ByTenant", br.ByTenant, "t_", "t_hot", "t_warm", fmt.Sprintf("t_%05d", projections.MaxCounts-3)},
		} {
			if len(d.counts) != projections.MaxCounts {
				t.Errorf("%s lists %d values; want the %d largest", d.name, len(d.counts), projections.MaxCounts)
				continue
			}
			want := []projections.Count{{Value: d.hot, Calls: 7}, {Value: d.warm, Calls: 4}, {Value: d.prefix + "00000", Calls: 1}}
			if diff := cmp.Diff(want, d.counts[:3]); diff != "" {
				t.Errorf("%s begins (-want +got):\n%s", d.name, diff)
			}
			if last := d.counts[len(d.counts)-1]; last != (projections.Count{Value: d.lastOf, Calls: 1}) {
				t.Errorf("%s ends with %+v; want %s, 1 call", d.name, last, d.lastOf)
			}
		}
		sum := 0
		for _, c := range br.ByState {
			sum += c.Calls
		}
		if sum != calls {
			t.Errorf("ByState %+v adds up to %d calls; want all %d", br.ByState, sum, calls)
		}
	})
	t.Run("unknown event types", func(t *testing.T) {
		// A newer ledger's event types, in events of this encoding:
		// their calls stay as their last known event left them.
		unknown, waiting := WithUnknownTypes(log, 3)
		if waiting == 0 {
			t.Fatal("no waiting call got an event of an unknown type: the generator changed?")
		}
		p := open(t)
		Write(t, p, unknown, 97)
		Check(t, p, NewOracle(unknown), cfg)
	})
	t.Run("refused", func(t *testing.T) {
		p := open(t)
		ctx := t.Context()
		for _, q := range []struct {
			name string
			ask  func() error
		}{
			{"blast radius in an unknown state", func() error {
				_, err := p.BlastRadius(ctx, projections.Filter{Tenant: "t_00", State: "done"})
				return err
			}},
			{"outcomes by state", func() error {
				_, err := p.Outcomes(ctx, projections.Filter{Tenant: "t_00", State: statemachine.StateSucceeded}, time.Minute)
				return err
			}},
			{"outcomes by call id", func() error {
				_, err := p.Outcomes(ctx, projections.Filter{Tenant: "t_00", CallID: "c-1"}, time.Minute)
				return err
			}},
			// A bucket of a second: one more than MaxOutcomeBuckets of
			// them, a month of them (to now), every one since the epoch.
			{"outcomes over too many buckets", func() error {
				since := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
				_, err := p.Outcomes(ctx, projections.Filter{Tenant: "t_00", Since: since, Until: since.Add((projections.MaxOutcomeBuckets + 1) * time.Second)}, time.Second)
				return err
			}},
			{"outcomes over a month by the second", func() error {
				_, err := p.Outcomes(ctx, projections.Filter{Tenant: "t_00", Since: time.Now().Add(-30 * 24 * time.Hour)}, time.Second)
				return err
			}},
			{"outcomes without a window by the hour", func() error {
				_, err := p.Outcomes(ctx, projections.Filter{AllTenants: true}, time.Hour)
				return err
			}},
			{"unresolved by state", func() error {
				_, err := p.Unresolved(ctx, projections.Filter{Tenant: "t_00", State: statemachine.StateOutcomeUnknown})
				return err
			}},
			{"unresolved by trace id", func() error {
				_, err := p.Unresolved(ctx, projections.Filter{Tenant: "t_00", TraceID: "tr-1"})
				return err
			}},
		} {
			if err := q.ask(); !errors.Is(err, projections.ErrInvalidFilter) {
				t.Errorf("%s: err = %v, want ErrInvalidFilter", q.name, err)
			}
		}
		if _, err := p.BlastRadius(ctx, projections.Filter{CallID: "c-1"}); !errors.Is(err, projections.ErrTenantRequired) {
			t.Errorf("BlastRadius by call id without a tenant: err = %v, want ErrTenantRequired", err)
		}
	})
	t.Run("tenant required", func(t *testing.T) {
		p := open(t)
		ctx := t.Context()
		if _, err := p.BlastRadius(ctx, projections.Filter{JTI: "x"}); !errors.Is(err, projections.ErrTenantRequired) {
			t.Errorf("BlastRadius without a tenant: err = %v, want ErrTenantRequired", err)
		}
		if _, err := p.Outcomes(ctx, projections.Filter{}, time.Minute); !errors.Is(err, projections.ErrTenantRequired) {
			t.Errorf("Outcomes without a tenant: err = %v, want ErrTenantRequired", err)
		}
		if _, err := p.Unresolved(ctx, projections.Filter{}); !errors.Is(err, projections.ErrTenantRequired) {
			t.Errorf("Unresolved without a tenant: err = %v, want ErrTenantRequired", err)
		}
		if _, err := p.Outcomes(ctx, projections.Filter{AllTenants: true}, 1500*time.Millisecond); !errors.Is(err, projections.ErrInvalidFilter) {
			t.Errorf("Outcomes with a 1.5s bucket: err = %v, want ErrInvalidFilter", err)
		}
		if _, err := p.Trace(ctx, ledger.CallKey{TenantID: "t_00", IdempotencyKey: "nothing-here"}); !errors.Is(err, projections.ErrNotFound) {
			t.Errorf("Trace of an unknown key: err = %v, want ErrNotFound", err)
		}
	})
}

// Write writes log to p in batches of n events, in the log's order.
func Write(t testing.TB, p projections.Sink, log []ledger.Event, n int) {
	t.Helper()
	for i := 0; i < len(log); i += n {
		var b projections.Batch
		for j, e := range log[i:min(i+n, len(log))] {
			b.Events = append(b.Events, projections.Event{Event: e, Offset: int64(i + j), Produced: e.At})
		}
		if err := p.Write(context.Background(), b); err != nil {
			t.Fatalf("write events %d..: %v", i, err)
		}
	}
}

// Questions are the filters Check asks about a log of cfg: by every kind
// of reference, alone and together, per tenant and across tenants, with
// and without a window, and narrowed by state.
func Questions(o *Oracle, cfg LogConfig) []projections.Filter {
	cfg = cfg.withDefaults()
	var qs []projections.Filter
	keys := o.Keys()
	// A sample of calls that ran: their credentials and families.
	ran := 0
	for _, k := range keys {
		evs := o.Events(k)
		i := slices.IndexFunc(evs, func(e ledger.Event) bool { return e.JTI != "" })
		if i < 0 {
			continue
		}
		e := evs[i]
		qs = append(qs,
			projections.Filter{Tenant: e.TenantID, JTI: e.JTI},
			projections.Filter{AllTenants: true, JTI: e.JTI},
			projections.Filter{Tenant: other(e.TenantID), JTI: e.JTI},
			projections.Filter{AllTenants: true, CredentialFamily: e.CredentialFamily},
			projections.Filter{Tenant: e.TenantID, CredentialFamily: e.CredentialFamily, Since: e.At.Add(time.Second), Limit: 3},
		)
		// A state narrows a credential's calls: to the call that used
		// it, as it is now, or to none.
		if ran < 4 {
			qs = append(qs,
				projections.Filter{Tenant: e.TenantID, JTI: e.JTI, State: stateNow(evs)},
				projections.Filter{Tenant: e.TenantID, JTI: e.JTI, State: statemachine.StateApprovalPending},
				projections.Filter{AllTenants: true, CredentialFamily: e.CredentialFamily, State: statemachine.StateSucceeded},
			)
		}
		if ran++; ran == 12 {
			break
		}
	}
	// A sample of calls taken over after owners died in a row: the
	// families of the owners before the last one find them too.
	earlier := 0
	for _, k := range keys {
		evs := o.Events(k)
		i := slices.IndexFunc(evs, func(e ledger.Event) bool { return len(e.EarlierCredentialFamilies) > 0 })
		if i < 0 {
			continue
		}
		e := evs[i]
		qs = append(qs,
			projections.Filter{AllTenants: true, CredentialFamily: e.EarlierCredentialFamilies[0]},
			projections.Filter{Tenant: e.TenantID, CredentialFamily: e.EarlierCredentialFamilies[0], Since: e.At, Until: e.At.Add(time.Second)},
		)
		if earlier++; earlier == 4 {
			break
		}
	}
	mid := cfg.Start.Add(cfg.Span / 2)
	// By label, by label@hash, and by a prefix of a label, which is not
	// a label and matches nothing.
	for _, v := range []string{"v40", "v41", "v43", PolicyVersion(42), "v4"} {
		qs = append(qs,
			projections.Filter{AllTenants: true, PolicyVersion: v},
			projections.Filter{AllTenants: true, PolicyVersion: v, Decision: "allow", Since: mid.Add(-time.Hour), Until: mid},
			projections.Filter{Tenant: "t_01", PolicyVersion: v, Decision: "deny"},
			projections.Filter{Tenant: "t_02", PolicyVersion: v, Decision: "require_approval", Tool: "refund_order"},
		)
	}
	for _, a := range Approvers {
		qs = append(qs,
			projections.Filter{AllTenants: true, Approver: a},
			projections.Filter{Tenant: "t_00", Approver: a, Since: cfg.Start.Add(20 * time.Minute), Until: cfg.Start.Add(80 * time.Minute)},
			projections.Filter{AllTenants: true, Approver: a, PolicyVersion: "v41"},
		)
	}
	// By a role the callers' assertions gave the policies, one no
	// caller has, and a role's decisions of one kind, under a version.
	for _, role := range append(slices.Clone(Roles), "auditor") {
		qs = append(qs,
			projections.Filter{AllTenants: true, Role: role},
			projections.Filter{Tenant: "t_01", Role: role, Since: mid.Add(-time.Hour), Until: mid},
			projections.Filter{AllTenants: true, Role: role, Decision: "deny"},
			projections.Filter{Tenant: "t_02", Role: role, PolicyVersion: "v42", Decision: "require_approval"},
			projections.Filter{AllTenants: true, Role: role, Approver: Approvers[0], State: statemachine.StateSucceeded},
		)
	}
	for _, k := range keys {
		evs := o.Events(k)
		if i := slices.IndexFunc(evs, func(e ledger.Event) bool { return e.ApprovalID != "" }); i >= 0 {
			qs = append(qs, projections.Filter{Tenant: k.TenantID, ApprovalID: evs[i].ApprovalID})
			break
		}
	}
	// An approver's decision carries the policy version but is not the
	// policy's: a window holding the approval but not the policy's
	// decision does not match the version.
	approvals := 0
	for _, k := range keys {
		evs := o.Events(k)
		i := slices.IndexFunc(evs, func(e ledger.Event) bool { return e.Type == statemachine.EventApproved })
		if i < 1 || evs[i].At.Unix() == evs[i-1].At.Unix() {
			continue
		}
		qs = append(qs, projections.Filter{Tenant: k.TenantID, PolicyVersion: evs[i].PolicyVersion, Since: evs[i].At})
		if approvals++; approvals == 5 {
			break
		}
	}
	for _, tool := range Tools {
		qs = append(qs,
			projections.Filter{AllTenants: true, Tool: tool, Since: mid.Add(-time.Hour), Until: mid},
			projections.Filter{Tenant: "t_03", Tool: tool},
			// The calls requested in the window, by their state now,
			// which some reached after the window.
			projections.Filter{AllTenants: true, Tool: tool, State: statemachine.StateSucceeded, Since: mid.Add(-time.Hour), Until: mid},
			projections.Filter{Tenant: "t_02", Tool: tool, State: statemachine.StateDenied, Since: mid.Add(-time.Hour)},
		)
	}
	// Calls by their call id: every event carries it, so a window from a
	// call's second event (in a later second than its first) finds the
	// call too, and one ending at its requested event finds none.
	byCall := 0
	for i, k := range keys {
		evs := o.Events(k)
		if i%max(1, len(keys)/7) != 0 || len(evs) < 2 {
			continue
		}
		first, second := evs[0], evs[1]
		qs = append(qs,
			projections.Filter{Tenant: k.TenantID, CallID: first.CallID},
			projections.Filter{AllTenants: true, CallID: first.CallID, Tool: first.Tool},
			projections.Filter{Tenant: other(k.TenantID), CallID: first.CallID},
			projections.Filter{Tenant: k.TenantID, CallID: first.CallID, Until: first.At},
			projections.Filter{AllTenants: true, CallID: first.CallID, State: stateNow(evs)},
		)
		if second.At.Unix() > first.At.Unix() {
			qs = append(qs, projections.Filter{Tenant: k.TenantID, CallID: first.CallID, Since: second.At})
		}
		if byCall++; byCall == 6 {
			break
		}
	}
	// Calls by trace: a trace may hold calls of several tenants and
	// tools, which the tenant and tool narrow.
	byTrace := 0
	for i, k := range keys {
		evs := o.Events(k)
		if i%max(1, len(keys)/6+5) != 0 || len(evs) == 0 {
			continue
		}
		e := evs[0]
		qs = append(qs,
			projections.Filter{AllTenants: true, TraceID: e.TraceID},
			projections.Filter{Tenant: k.TenantID, TraceID: e.TraceID},
			projections.Filter{AllTenants: true, TraceID: e.TraceID, Tool: e.Tool, Since: e.At},
			projections.Filter{AllTenants: true, TraceID: e.TraceID, State: stateNow(evs)},
		)
		if byTrace++; byTrace == 6 {
			break
		}
	}
	// Calls by the tool definition they were admitted under: each of a
	// tool's two, narrowed by tenant, by tool (another's finds none), by
	// state and by window; a window from a call's second event (in a
	// later second) does not find it, though that event names the
	// definition too; and a definition no call was admitted under.
	for i, tool := range Tools {
		for _, edited := range []bool{false, true} {
			d := toolDigest(tool, edited)
			qs = append(qs,
				projections.Filter{AllTenants: true, ToolDigest: d},
				projections.Filter{Tenant: "t_01", ToolDigest: d},
				projections.Filter{AllTenants: true, ToolDigest: d, Tool: tool, State: statemachine.StateSucceeded},
				projections.Filter{AllTenants: true, ToolDigest: d, Tool: Tools[(i+1)%len(Tools)]},
				projections.Filter{Tenant: "t_02", ToolDigest: d, Since: mid.Add(-time.Hour), Until: mid},
			)
		}
	}
	byDigest := 0
	for _, k := range keys {
		evs := o.Events(k)
		if len(evs) < 2 || evs[0].ToolDigest == "" || evs[1].At.Unix() == evs[0].At.Unix() {
			continue
		}
		qs = append(qs,
			projections.Filter{Tenant: k.TenantID, ToolDigest: evs[0].ToolDigest, Since: evs[1].At},
			projections.Filter{Tenant: k.TenantID, ToolDigest: evs[0].ToolDigest, Until: evs[1].At},
		)
		if byDigest++; byDigest == 4 {
			break
		}
	}
	qs = append(qs, projections.Filter{AllTenants: true, ToolDigest: toolDigest("no_such_tool", false)})
	// A tenant's calls by their state alone: each state the log ends
	// calls in, spread over the tenants, and one no call stays in.
	for i, st := range []statemachine.State{
		statemachine.StateSucceeded, statemachine.StateFailed, statemachine.StateDenied,
		statemachine.StateRejected, statemachine.StateExpired, statemachine.StateApprovalPending,
		statemachine.StateOutcomeUnknown, statemachine.StateCompensated,
	} {
		qs = append(qs, projections.Filter{Tenant: fmt.Sprintf("t_%02d", i%cfg.Tenants), State: st})
	}
	qs = append(qs,
		projections.Filter{Tenant: "t_00", State: statemachine.StateExecuting},
		projections.Filter{AllTenants: true, State: statemachine.StateSucceeded, Limit: 10},
		// Approvals lapse 15 minutes after the request: some of these
		// calls expired after the window.
		projections.Filter{AllTenants: true, State: statemachine.StateExpired, Since: mid.Add(-30 * time.Minute), Until: mid},
	)
	qs = append(qs,
		projections.Filter{Tenant: "t_00"},
		projections.Filter{AllTenants: true, Limit: 25},
		projections.Filter{Tenant: "t_nobody"},
		projections.Filter{AllTenants: true, JTI: "jti-never-issued"},
		// A window of one second, its ends exact.
		projections.Filter{AllTenants: true, Since: mid, Until: mid.Add(time.Second)},
	)
	return qs
}

func other(tenant string) string {
	if tenant == "t_00" {
		return "t_01"
	}
	return "t_00"
}

// Check asks p every question of Questions and more, and compares each
// answer with the oracle's.
func Check(t *testing.T, p projections.Queries, o *Oracle, cfg LogConfig) {
	t.Helper()
	ctx := t.Context()
	cfg = cfg.withDefaults()
	for _, q := range Questions(o, cfg) {
		f, err := q.Check()
		if err != nil {
			t.Fatalf("question %+v: %v", q, err)
		}
		got, err := p.BlastRadius(ctx, q)
		if err != nil {
			t.Errorf("BlastRadius(%s): %v", describe(q), err)
			continue
		}
		want := o.BlastRadius(f)
		if diff := cmp.Diff(want, got, cmpopts.EquateEmpty()); diff != "" {
			t.Errorf("BlastRadius(%s) (-oracle +projection):\n%s", describe(q), diff)
		}
	}
	for _, q := range []struct {
		f      projections.Filter
		bucket time.Duration
	}{
		{projections.Filter{AllTenants: true, Since: cfg.Start.Add(-time.Hour), Until: cfg.Start.Add(cfg.Span + time.Hour)}, 10 * time.Minute},
		// No window: from the epoch to now, by the week.
		{projections.Filter{Tenant: "t_01"}, 7 * 24 * time.Hour},
		{projections.Filter{Tenant: "t_02", Tool: "refund_order", Since: cfg.Start.Add(30 * time.Minute), Until: cfg.Start.Add(90 * time.Minute)}, 7 * time.Minute},
		// By the second, as many buckets as a question may span.
		{projections.Filter{AllTenants: true, Tool: "get_weather", Since: cfg.Start, Until: cfg.Start.Add(projections.MaxOutcomeBuckets * time.Second)}, time.Second},
	} {
		f, err := projections.CheckOutcomes(q.f, q.bucket, time.Now())
		if err != nil {
			t.Fatalf("outcomes question %+v: %v", q.f, err)
		}
		got, err := p.Outcomes(ctx, q.f, q.bucket)
		if err != nil {
			t.Errorf("Outcomes(%s, %s): %v", describe(q.f), q.bucket, err)
			continue
		}
		if diff := cmp.Diff(o.Outcomes(f, q.bucket), got, cmpopts.EquateEmpty()); diff != "" {
			t.Errorf("Outcomes(%s, %s) (-oracle +projection):\n%s", describe(q.f), q.bucket, diff)
		}
	}
	for _, q := range []projections.Filter{
		{AllTenants: true},
		{Tenant: "t_03"},
		{Tenant: "t_00", Tool: "refund_order"},
		{AllTenants: true, Limit: 5},
	} {
		f, err := projections.CheckUnresolved(q)
		if err != nil {
			t.Fatalf("unresolved question %+v: %v", q, err)
		}
		got, err := p.Unresolved(ctx, q)
		if err != nil {
			t.Errorf("Unresolved(%s): %v", describe(q), err)
			continue
		}
		want := o.Unresolved(f)
		if diff := cmp.Diff(want, got, cmpopts.EquateEmpty()); diff != "" {
			t.Errorf("Unresolved(%s) (-oracle +projection):\n%s", describe(q), diff)
		}
	}
	traced, refusals := 0, 0
	for i, k := range o.Keys() {
		want := o.Trace(k)
		hasRefusal := slices.ContainsFunc(want, func(e ledger.Event) bool { return e.Seq == 0 })
		if i%17 != 0 && !hasRefusal {
			continue
		}
		traced++
		if hasRefusal {
			refusals++
		}
		got, err := p.Trace(ctx, k)
		if err != nil {
			t.Errorf("Trace(%s): %v", k, err)
			continue
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("Trace(%s) (-oracle +projection):\n%s", k, diff)
		}
	}
	if traced < 20 || refusals == 0 {
		t.Fatalf("the log gave only %d traces (%d with refusals): the generator changed?", traced, refusals)
	}
	checkCoverage(t, o)
}

// checkCoverage fails if the log no longer holds what the questions are
// about, so that the suite cannot pass by asking about nothing.
func checkCoverage(t *testing.T, o *Oracle) {
	t.Helper()
	states := map[statemachine.State]int{}
	parked := 0
	for _, k := range o.Keys() {
		evs := o.Events(k)
		if len(evs) == 0 {
			continue
		}
		c, _ := latest(evs)
		states[c.State]++
		if c.LastEvent == statemachine.EventParked {
			parked++
		}
	}
	for _, s := range []statemachine.State{
		statemachine.StateSucceeded, statemachine.StateFailed, statemachine.StateDenied,
		statemachine.StateRejected, statemachine.StateExpired, statemachine.StateApprovalPending,
		statemachine.StateOutcomeUnknown, statemachine.StateCompensated,
	} {
		if states[s] == 0 {
			t.Errorf("the generated log has no call in state %s", s)
		}
	}
	if parked == 0 {
		t.Error("the generated log has no parked call")
	}
}

// describe is a filter as the failure messages show it.
func describe(f projections.Filter) string { return fmt.Sprintf("%+v", f) }
