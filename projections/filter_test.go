package projections

import (
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// A call id, a trace id and a state go through query parameters and
// come back the same.
func TestValuesRoundTrip(t *testing.T) {
	now := time.Date(2026, 11, 30, 14, 0, 0, 0, time.UTC)
	for _, f := range []Filter{
		{Tenant: "t_1", CallID: "c-1"},
		{AllTenants: true, TraceID: "4bf92f3577b34da6a3ce929d0e0e4736", Tool: "refund_order", Since: now.Add(-time.Hour)},
		{Tenant: "t_1", State: statemachine.StateOutcomeUnknown, Until: now, Limit: 5},
		{Tenant: "t_1", JTI: "j", State: statemachine.StateSucceeded, CallID: "c-2", TraceID: "tr"},
	} {
		v := f.Values()
		got, err := FilterFromValues(v, now)
		if err != nil {
			t.Errorf("FilterFromValues(%s): %v", v.Encode(), err)
			continue
		}
		if diff := cmp.Diff(f, got); diff != "" {
			t.Errorf("FilterFromValues(%s) (-want +got):\n%s", v.Encode(), diff)
		}
	}
}

// A call id and a trace id are references; a state is not, and only a
// blast radius takes one, of a state the machine knows.
func TestFilterCallTraceState(t *testing.T) {
	for _, tc := range []struct {
		name       string
		f          Filter
		references bool
		blast      error
		outcomes   error
		unresolved error
	}{
		{"call id", Filter{Tenant: "t", CallID: "c"}, true, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"trace id", Filter{Tenant: "t", TraceID: "tr"}, true, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"state", Filter{Tenant: "t", State: statemachine.StateDenied}, false, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"state with a jti", Filter{Tenant: "t", JTI: "j", State: statemachine.StateSucceeded}, true, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"unknown state", Filter{Tenant: "t", State: "done"}, false, ErrInvalidFilter, ErrInvalidFilter, ErrInvalidFilter},
		{"state without a tenant", Filter{State: statemachine.StateDenied}, false, ErrTenantRequired, ErrTenantRequired, ErrTenantRequired},
		{"neither", Filter{Tenant: "t", Tool: "x"}, false, nil, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.f.References(); got != tc.references {
				t.Errorf("References() = %v; want %v", got, tc.references)
			}
			if _, err := tc.f.Check(); !errors.Is(err, tc.blast) {
				t.Errorf("Check() = %v; want %v", err, tc.blast)
			}
			if _, err := CheckOutcomes(tc.f, time.Minute); !errors.Is(err, tc.outcomes) {
				t.Errorf("CheckOutcomes() = %v; want %v", err, tc.outcomes)
			}
			if _, err := CheckUnresolved(tc.f); !errors.Is(err, tc.unresolved) {
				t.Errorf("CheckUnresolved() = %v; want %v", err, tc.unresolved)
			}
		})
	}
}
