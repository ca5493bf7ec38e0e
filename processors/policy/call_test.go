package policy_test

import (
	"testing"
	"testing/fstest"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/schemas"
)

// Who asks comes from the caller; the arguments name the resource and the
// amount, and a tenant or user inside them changes nothing.
func TestNewRequest(t *testing.T) {
	tool := refundOrder(t)
	args, err := ledger.Decode([]byte(`{"order_id":"ord_9","amount_cents":4500,"currency":"AUD","tenant":"t_evil","user_id":"u_root"}`), ledger.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1700000000, 0)
	r := policy.NewRequest(tool, policy.Caller{Tenant: "t_a", User: "u_1", Agent: "ag", Purpose: "refund"}, args, "kafka", now)
	if r.Tenant != "t_a" || r.ResourceTenant != "t_a" || r.User != "u_1" || r.Agent != "ag" || r.Purpose != "refund" {
		t.Errorf("request identity %+v; want the caller's", r)
	}
	if r.Resource != "ord_9" || r.Amount == nil || *r.Amount != 4500 {
		t.Errorf("resource %q amount %v; want ord_9 and 4500", r.Resource, r.Amount)
	}
	if r.Tool != "refund_order" || r.Risk != "high" || r.Effect != "external_side_effect" || r.Channel != "kafka" || !r.Time.Equal(now) {
		t.Errorf("request %+v; want the tool's registry values, the channel and the time", r)
	}
}

// An amount_cents that is there but is not an integer (a fraction, a
// string, null; an integer written 5e2 is one) is refused invalid_request
// before any policy runs: an amount rule cannot compare it. Before, it
// was taken for no amount at all, and a cap written as the demo's
// (`context.has_amount && context.amount > N`) let a refund of
// 2000000.5 through under a permit of the tool.
func TestAmountThatIsNoIntegerIsRefused(t *testing.T) {
	tool := refundOrder(t)
	set, err := policy.LoadFS(fstest.MapFS{"refunds.cedar": &fstest.MapFile{Data: []byte(`
@id("refunds")
permit (principal, action == Action::"tool::refund_order", resource);
@id("cap")
forbid (principal, action == Action::"tool::refund_order", resource)
when { context.has_amount && context.amount > 1000000 };
`)}}, "caps")
	if err != nil {
		t.Fatal(err)
	}
	e, err := policy.NewEngine(policy.Config{Set: set})
	if err != nil {
		t.Fatal(err)
	}
	caller := policy.Caller{Tenant: "t_a", User: "u_1", Agent: "ag"}
	for _, tc := range []struct {
		amount string
		allow  bool
		reason string
	}{
		{`500`, true, ""},
		{`2000000`, false, policy.ReasonDeniedByPolicy},
		{`2000000.5`, false, policy.ReasonInvalidRequest},
		{`"2000000"`, false, policy.ReasonInvalidRequest},
		{`2e6`, false, policy.ReasonDeniedByPolicy},
		{`5e2`, true, ""},
		{`500.0`, true, ""},
		{`null`, false, policy.ReasonInvalidRequest},
	} {
		args, err := ledger.Decode([]byte(`{"order_id":"ord_9","currency":"AUD","amount_cents":`+tc.amount+`}`), ledger.Limits{})
		if err != nil {
			t.Fatal(err)
		}
		d := e.Decide(t.Context(), policy.NewRequest(tool, caller, args, "kafka", time.Now()))
		if d.Allow != tc.allow || !tc.allow && d.Reason != tc.reason {
			t.Errorf("amount_cents %s: allow %v, %s (%s); want allow %v, %q", tc.amount, d.Allow, d.Reason, d.Detail, tc.allow, tc.reason)
		}
	}
}

// refundOrder is the demo registry's refund_order.
func refundOrder(t *testing.T) *schemas.Tool {
	t.Helper()
	reg, err := schemas.Demo()
	if err != nil {
		t.Fatal(err)
	}
	tool, err := reg.Lookup("refund_order", 1)
	if err != nil {
		t.Fatal(err)
	}
	return tool
}
