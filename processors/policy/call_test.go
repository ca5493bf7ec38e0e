package policy_test

import (
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/schemas"
)

// Who asks comes from the caller; the arguments name the resource and the
// amount, and a tenant or user inside them changes nothing.
func TestNewRequest(t *testing.T) {
	reg, err := schemas.Demo()
	if err != nil {
		t.Fatal(err)
	}
	tool, err := reg.Lookup("refund_order", 1)
	if err != nil {
		t.Fatal(err)
	}
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
