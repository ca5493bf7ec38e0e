package main

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/projections"
)

// blast-radius --tool-digest asks the API for the calls admitted under
// that definition (tool_digest), with the other flags as they are.
func TestBlastRadiusByToolDigest(t *testing.T) {
	const digest = "sha256:ee73feadf9785bb74043d9d7feab3b832debf6925884d394230384e60fdcdaf5"
	asked := make(chan projections.Filter, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f, err := projections.FilterFromValues(r.URL.Query(), time.Now())
		if r.URL.Path != "/v1/blast-radius" || err != nil {
			http.Error(w, "not this", http.StatusBadRequest)
			return
		}
		asked <- f
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"total":0,"calls":[]}`))
	}))
	t.Cleanup(srv.Close)
	cli(t, "blast-radius", "--json", "--tool-digest", digest, "--all-tenants", "--tool", "refund_order", "--api", srv.URL, "--assertion", "tok")
	select {
	case f := <-asked:
		if f.ToolDigest != digest || !f.AllTenants || f.Tool != "refund_order" {
			t.Errorf("asked %+v; want tool digest %s, all tenants, refund_order", f, digest)
		}
	default:
		t.Fatal("the API was not asked")
	}
}
