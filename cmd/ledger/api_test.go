package main

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/projections/console"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/projections/projector"
)

// ledger api's /v1/health says the projection's lag when Kafka says it
// (0 for a projector that never committed), and that it is unknown, not
// 0, when Kafka refuses or does not answer within the bound; operators
// alone ask.
func TestAPIHealth(t *testing.T) {
	policy := func() string { return "v41@abc" }
	operator := httpapi.Operator{User: "u_ops", Tenant: "t_a", Roles: []string{console.RoleOperator}}
	for _, tc := range []struct {
		name    string
		lag     func(context.Context) (projector.GroupStatus, error)
		op      httpapi.Operator
		status  int
		records int64
		unknown bool
	}{
		{"known", func(context.Context) (projector.GroupStatus, error) {
			return projector.GroupStatus{Records: 12, Time: 3 * time.Second}, nil
		}, operator, 200, 12, false},
		{"never committed", func(context.Context) (projector.GroupStatus, error) {
			return projector.GroupStatus{Records: 7}, projector.ErrNeverCommitted
		}, operator, 200, 7, false},
		{"kafka refuses", func(context.Context) (projector.GroupStatus, error) {
			return projector.GroupStatus{}, errors.New("not authorized to describe group")
		}, operator, 200, 0, true},
		{"kafka silent", func(ctx context.Context) (projector.GroupStatus, error) {
			select {
			case <-ctx.Done(): // the bound ends
				return projector.GroupStatus{}, ctx.Err()
			case <-time.After(10 * time.Second): // no bound: a lag, too late
				return projector.GroupStatus{Records: 99}, nil
			}
		}, operator, 200, 0, true},
		{"not an operator", nil, httpapi.Operator{User: "u_a", Tenant: "t_a", Roles: []string{console.RoleApprover}}, 403, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			apiHealth(policy, tc.lag, 50*time.Millisecond, slog.New(slog.DiscardHandler))(rec, httptest.NewRequest(http.MethodGet, "/v1/health", nil), tc.op)
			if rec.Code != tc.status {
				t.Fatalf("status %d; want %d: %s", rec.Code, tc.status, rec.Body)
			}
			if tc.status != 200 {
				return
			}
			var h console.Health
			if err := json.Unmarshal(rec.Body.Bytes(), &h); err != nil {
				t.Fatal(err)
			}
			if h.Policy != "v41@abc" || h.ProjectionLagRecords != tc.records || h.ProjectionLagUnknown != tc.unknown || !h.BreakersUnknown {
				t.Errorf("health %+v; want policy v41@abc, lag %d records, unknown %v, breakers unknown (the executors')", h, tc.records, tc.unknown)
			}
		})
	}
}
