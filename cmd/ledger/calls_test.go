package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
)

// ledger calls resolve sends --cancel-compensation as the resolution's
// cancel_compensation, which a resolution as succeeded behind the
// reconciler's pending compensation needs.
func TestCallsResolveSendsCancelCompensation(t *testing.T) {
	var got []map[string]any
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/v1/resolutions" {
			http.NotFound(w, r)
			return
		}
		var body map[string]any
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		got = append(got, body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"type":"succeeded"}`))
	}))
	defer srv.Close()
	base := []string{"calls", "resolve", "k1", "--api", srv.URL, "--assertion", "tok", "--call-tenant", "t_a", "--as", "succeeded", "--evidence", "the bank's statement"}
	cli(t, base...)
	cli(t, append(base, "--cancel-compensation")...)
	if len(got) != 2 {
		t.Fatalf("%d resolutions posted; want 2", len(got))
	}
	for i, want := range []bool{false, true} {
		if got[i]["cancel_compensation"] != want || got[i]["as"] != "succeeded" || got[i]["idempotency_key"] != "k1" || got[i]["tenant_id"] != "t_a" {
			t.Errorf("resolution %d posted %v; want cancel_compensation %v", i, got[i], want)
		}
	}
}
