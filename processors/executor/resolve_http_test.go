package executor_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/identity"
)

// operatorVerifier takes every assertion for the operator u_ops of t_a.
type operatorVerifier struct{}

func (operatorVerifier) Verify(context.Context, string) (identity.Identity, error) {
	return identity.Identity{User: "u_ops", Tenant: "t_a", Roles: []string{"operator"}}, nil
}

// discardPublisher takes every record and keeps none.
type discardPublisher struct{}

func (discardPublisher) Publish(context.Context, ...*kgo.Record) error { return nil }

// failingGets is the store with every Get failing.
type failingGets struct{ processors.Store }

func (failingGets) Get(context.Context, ledger.CallKey) (processors.Record, error) {
	return processors.Record{}, errors.New("dial tcp 10.0.0.7:26257: connection refused")
}

// POST /v1/resolutions answers each refusal with its own status and code:
// a malformed resolution 400, a resolution as failed while the call's
// compensation is under way 409 compensation_under_way (as succeeded
// goes through), and a store that fails 503 without its error's text.
// Before, a store failure answered 400 invalid_request with the store's
// message.
func TestResolveHandlerStatuses(t *testing.T) {
	r := newRig(t)
	orig, _ := r.unknownRefundToUndo()
	r.admitCompensation(orig.Key(), "u_operator")
	body := func(as string) string {
		return `{"tenant_id":"t_a","idempotency_key":"` + orig.IdempotencyKey + `","as":"` + as + `","evidence":"the bank's statement"}`
	}
	for _, tc := range []struct {
		name   string
		store  processors.Store
		body   string
		status int
		code   string // the error's code, or the event's type
	}{
		{"malformed", r.store, strings.Replace(body("failed"), "failed", "maybe", 1), http.StatusBadRequest, "invalid_request"},
		{"store down", failingGets{r.store}, body("failed"), http.StatusServiceUnavailable, "unavailable"},
		{"failed while undoing", r.store, body("failed"), http.StatusConflict, "compensation_under_way"},
		{"succeeded while undoing", r.store, body("succeeded"), http.StatusOK, "succeeded"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rc := r.reconcilerWith(func(c *executor.ReconcilerConfig) { c.Store = tc.store })
			srv := httptest.NewServer(rc.ResolveHandler(operatorVerifier{}, discardPublisher{}))
			defer srv.Close()
			req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/v1/resolutions", strings.NewReader(tc.body))
			req.Header.Set("Authorization", "Bearer x")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			got, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status || !strings.Contains(string(got), `"`+tc.code+`"`) {
				t.Errorf("%s: %d %s; want %d %s", tc.name, resp.StatusCode, got, tc.status, tc.code)
			}
			if strings.Contains(string(got), "10.0.0.7") {
				t.Errorf("the answer names the store's address: %s", got)
			}
		})
	}
	if rec, err := r.store.Get(t.Context(), orig.Key()); err != nil || rec.Status != processors.StatusSucceeded {
		t.Errorf("after the resolution as succeeded the call is %s (%v); want succeeded", rec.Status, err)
	}
}
