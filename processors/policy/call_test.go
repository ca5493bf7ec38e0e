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
	e := capsEngine(t, `
@id("refunds")
permit (principal, action == Action::"tool::refund_order", resource);
@id("cap")
forbid (principal, action == Action::"tool::refund_order", resource)
when { context.has_amount && context.amount > 1000000 };
`)
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

// An integer argument is the same number to the policies however it is
// spelt, as the tools' JSON Schema integer takes them all: 5000, 5e3 and
// 5000.0 are each caught by a forbid on it, and a resource id written
// 1e3 names the resource 1000. Before, only the first reached the
// policies; the others were left out of context.arguments, and a forbid
// guarded with `has` let them through.
func TestIntegerArgumentsHoweverSpelt(t *testing.T) {
	tool := refundOrder(t)
	e := capsEngine(t, `
@id("refunds")
permit (principal, action == Action::"tool::refund_order", resource);
@id("quantity-cap")
forbid (principal, action == Action::"tool::refund_order", resource)
when { context.arguments has quantity && context.arguments.quantity > 100 };
@id("one-order")
forbid (principal, action == Action::"tool::refund_order", resource == Resource::"t_a/1000");
`)
	caller := policy.Caller{Tenant: "t_a", User: "u_1", Agent: "ag"}
	for _, tc := range []struct {
		args, policy string
	}{
		{`"order_id":"ord_9","quantity":5000`, "quantity-cap"},
		{`"order_id":"ord_9","quantity":5e3`, "quantity-cap"},
		{`"order_id":"ord_9","quantity":5000.0`, "quantity-cap"},
		{`"order_id":1000`, "one-order"},
		{`"order_id":1e3`, "one-order"},
		{`"order_id":1000.0`, "one-order"},
	} {
		args, err := ledger.Decode([]byte(`{"currency":"AUD","amount_cents":500,`+tc.args+`}`), ledger.Limits{})
		if err != nil {
			t.Fatal(err)
		}
		d := e.Decide(t.Context(), policy.NewRequest(tool, caller, args, "kafka", time.Now()))
		if d.Allow || d.Reason != policy.ReasonDeniedByPolicy || len(d.PolicyIDs) != 1 || d.PolicyIDs[0] != tc.policy {
			t.Errorf("{%s}: allow %v, %s %v (%s); want denied by %s", tc.args, d.Allow, d.Reason, d.PolicyIDs, d.Detail, tc.policy)
		}
	}
}

// capsEngine is an engine deciding with the policies src, labelled caps.
func capsEngine(t *testing.T, src string) *policy.Engine {
	t.Helper()
	set, err := policy.LoadFS(fstest.MapFS{"refunds.cedar": &fstest.MapFile{Data: []byte(src)}}, "caps")
	if err != nil {
		t.Fatal(err)
	}
	e, err := policy.NewEngine(policy.Config{Set: set})
	if err != nil {
		t.Fatal(err)
	}
	return e
}
