package policy

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

var decisionOpts = cmp.Options{
	cmpopts.IgnoreFields(Decision{}, "Detail"),
	cmpopts.EquateEmpty(),
}

// at is a fixed decision time: 2026-03-04 13:05:06 UTC.
var at = time.Date(2026, 3, 4, 13, 5, 6, 0, time.UTC)

func amount(n int64) *int64 { return &n }

// refund is a typical refund_order request for tenant t_acme.
func refund(cents int64) Request {
	return Request{
		Tenant: "t_acme", User: "u_88", Agent: "agent_support", Purpose: "customer_refund_after_dispute",
		Tool: "refund_order", ToolVersion: 1, Effect: "external_side_effect", Risk: "high",
		Resource: "ord_1029", ResourceTenant: "t_acme", Amount: amount(cents), Channel: "agent",
		Arguments: map[string]any{
			"order_id": "ord_1029", "amount_cents": json.Number(itoa(cents)), "currency": "AUD",
			"reason": "damaged in transit",
		},
		Time: at,
	}
}

func itoa(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}

func email(to string) Request {
	return Request{
		Tenant: "t_acme", User: "u_88", Agent: "agent_support", Tool: "send_email", ToolVersion: 1,
		Effect: "external_side_effect", Risk: "high", ResourceTenant: "t_acme", Channel: "agent",
		Arguments: map[string]any{"to": to, "subject": "Your refund", "body": "hello"},
		Time:      at,
	}
}

func simple(tool string) Request {
	return Request{
		Tenant: "t_acme", User: "u_88", Agent: "agent_support", Tool: tool, ToolVersion: 1,
		Effect: "read", Risk: "low", ResourceTenant: "t_acme", Channel: "api",
		Arguments: map[string]any{"city": "Sydney"}, Time: at,
	}
}

func demoEngine(t testing.TB) (*Engine, *Set) {
	t.Helper()
	s, err := Demo()
	if err != nil {
		t.Fatalf("Demo() error = %v", err)
	}
	e, err := NewEngine(Config{Set: s})
	if err != nil {
		t.Fatalf("NewEngine() error = %v", err)
	}
	return e, s
}

func TestDemoPolicies(t *testing.T) {
	e, s := demoEngine(t)
	v := s.Version()
	internal60 := []RateLimit{{N: 60, Per: time.Minute, Policy: "email-internal"}}
	external60 := []RateLimit{{N: 60, Per: time.Minute, Policy: "email-external-needs-approval"}}
	// The refund permits mask the reason: every refund decision's audit
	// copy hides it, denials included.
	reason := []string{"/reason"}
	cases := []struct {
		name string
		req  func() Request
		want Decision
	}{
		{
			name: "get_weather allowed for any user of the tenant",
			req:  func() Request { return simple("get_weather") },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"read-tools"}, Version: v},
		},
		{
			name: "create_ticket allowed",
			req:  func() Request { r := simple("create_ticket"); r.User = "u_1"; return r },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"read-tools"}, Version: v},
		},
		{
			name: "small refund allowed without approval, reason masked",
			req:  func() Request { return refund(4500) },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"refund-small"}, Version: v, AuditMask: reason,
				Obligations: Obligations{Mask: []string{"/reason"}}},
		},
		{
			name: "refund of exactly 100.00 needs no approval",
			req:  func() Request { return refund(10000) },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"refund-small"}, Version: v, AuditMask: reason,
				Obligations: Obligations{Mask: []string{"/reason"}}},
		},
		{
			name: "refund above 100.00 needs approval",
			req:  func() Request { return refund(10001) },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"refund-large-needs-approval"}, Version: v, AuditMask: reason,
				Obligations: Obligations{RequireApproval: true, Mask: []string{"/reason"}}},
		},
		{
			name: "refund at the cap needs approval",
			req:  func() Request { return refund(1000000) },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"refund-large-needs-approval"}, Version: v, AuditMask: reason,
				Obligations: Obligations{RequireApproval: true, Mask: []string{"/reason"}}},
		},
		{
			name: "refund above the cap forbidden",
			req:  func() Request { return refund(1000001) },
			want: Decision{Reason: ReasonDeniedByPolicy, PolicyIDs: []string{"refund-cap"}, Version: v, AuditMask: reason},
		},
		{
			name: "refund without an amount matches no permit",
			req:  func() Request { r := refund(1); r.Amount = nil; return r },
			want: Decision{Reason: ReasonNoPolicy, Version: v, AuditMask: reason},
		},
		{
			name: "internal email allowed without approval, rate limited",
			req:  func() Request { return email("ops@example.com") },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"email-internal"}, Version: v,
				Obligations: Obligations{RateLimits: internal60}},
		},
		{
			name: "external email needs approval, rate limited",
			req:  func() Request { return email("someone@gmail.com") },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"email-external-needs-approval"}, Version: v,
				Obligations: Obligations{RequireApproval: true, RateLimits: external60}},
		},
		{
			name: "look-alike domain is external",
			req:  func() Request { return email("x@example.com.evil.test") },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"email-external-needs-approval"}, Version: v,
				Obligations: Obligations{RequireApproval: true, RateLimits: external60}},
		},
		{
			name: "email without a recipient argument needs approval",
			req:  func() Request { r := email(""); delete(r.Arguments, "to"); return r },
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"email-external-needs-approval"}, Version: v,
				Obligations: Obligations{RequireApproval: true, RateLimits: external60}},
		},
		{
			name: "cancel_refund allowed on the compensation channel",
			req: func() Request {
				r := simple("cancel_refund")
				r.Effect, r.Channel = "external_side_effect", "compensation"
				return r
			},
			want: Decision{Allow: true, Reason: ReasonAllowed, PolicyIDs: []string{"refund-compensation"}, Version: v},
		},
		{
			// An agent's own undo would run outside the ledger's
			// compensation, which would then run it again.
			name: "cancel_refund asked by an agent matches no permit",
			req:  func() Request { r := simple("cancel_refund"); r.Effect = "external_side_effect"; return r },
			want: Decision{Reason: ReasonNoPolicy, Version: v},
		},
		{
			name: "unknown tool matches no permit",
			req:  func() Request { return simple("drop_database") },
			want: Decision{Reason: ReasonNoPolicy, Version: v},
		},
		{
			name: "resource of another tenant denied before Cedar",
			req:  func() Request { r := refund(100); r.ResourceTenant = "t_other"; return r },
			want: Decision{Reason: ReasonCrossTenant, Version: v, AuditMask: reason},
		},
		{
			name: "empty resource tenant is cross tenant",
			req:  func() Request { r := refund(100); r.ResourceTenant = ""; return r },
			want: Decision{Reason: ReasonCrossTenant, Version: v, AuditMask: reason},
		},
		{
			name: "tenant inside the arguments grants nothing",
			req: func() Request {
				r := refund(100)
				r.ResourceTenant = "t_other"
				r.Arguments["tenant_id"] = "t_other"
				r.Arguments["tenant"] = "t_other"
				return r
			},
			want: Decision{Reason: ReasonCrossTenant, Version: v, AuditMask: reason},
		},
		{
			name: "missing user is an invalid request",
			req:  func() Request { r := refund(100); r.User = ""; return r },
			want: Decision{Reason: ReasonInvalidRequest, Version: v, AuditMask: reason},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := e.Decide(context.Background(), tc.req())
			if diff := cmp.Diff(tc.want, got, decisionOpts); diff != "" {
				t.Errorf("Decide() mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestDemoTenantIsolationWithoutGuard evaluates cross-tenant requests
// straight through Cedar, skipping the engine's guard: the demo policies
// alone must refuse them, even for tools any user may call.
func TestDemoTenantIsolationWithoutGuard(t *testing.T) {
	e, s := demoEngine(t)
	cases := []struct {
		name string
		req  Request
	}{
		{name: "get_weather", req: simple("get_weather")},
		{name: "small refund", req: refund(100)},
		{name: "internal email", req: email("ops@example.com")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.req
			if got := e.evaluate(context.Background(), s, r); !got.Allow {
				t.Fatalf("same-tenant control: evaluate() = %+v, want allowed", got)
			}
			r.ResourceTenant = "t_other"
			got := e.evaluate(context.Background(), s, r)
			want := Decision{Reason: ReasonDeniedByPolicy, PolicyIDs: []string{"tenant-isolation"}, Version: s.Version()}
			if diff := cmp.Diff(want, got, decisionOpts); diff != "" {
				t.Errorf("evaluate() cross-tenant mismatch (-want +got):\n%s", diff)
			}
		})
	}
}
