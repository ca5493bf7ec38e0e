package policy

import (
	"context"
	"testing"
)

// BenchmarkDecide measures one decision of the demo set. Run with
// -bench=Decide -benchmem; compare runs with benchstat.
func BenchmarkDecide(b *testing.B) {
	e, _ := demoEngine(b)
	cases := []struct {
		name string
		req  Request
	}{
		{name: "refund_order", req: refund(4500)},
		{name: "refund_order_approval", req: refund(50000)},
		{name: "send_email", req: email("ops@example.com")},
		{name: "cross_tenant", req: func() Request { r := refund(4500); r.ResourceTenant = "t_other"; return r }()},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if d := e.Decide(ctx, tc.req); d.Reason == ReasonPolicyError || d.Reason == ReasonPolicyTimeout {
					b.Fatalf("Decide() = %+v", d)
				}
			}
		})
	}
}
