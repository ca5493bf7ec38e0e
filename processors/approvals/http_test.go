package approvals_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/approvals"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
)

func (f *fixture) mint(id identity.Identity) string {
	f.t.Helper()
	a, err := f.ident.Issuer.Mint(id, processorstest.Audience, 10*time.Minute)
	if err != nil {
		f.t.Fatal(err)
	}
	return a
}

// The HTTP API answers each outcome with its status and code, and never
// echoes an assertion. The steps run in order: later ones depend on the
// decisions of earlier ones.
func TestHandler(t *testing.T) {
	f := newFixture(t)
	k1, _ := f.refund("r-1")
	k2, _ := f.refund("r-2")
	k3, _ := f.refund("r-3")
	hash1 := f.record(k1).ArgumentsHash
	srv := httptest.NewServer(f.svc.Handler())
	t.Cleanup(srv.Close)

	var (
		bossTok  = f.mint(boss)
		bTok     = f.mint(bossOfB)
		selfTok  = f.mint(requester)
		plainTok = f.mint(plainUser)
		// An agent's assertion for the requester: valid, no role.
		agentTok = f.ident.Assertion(t, "t_a", "u_1")
	)
	secrets := []string{bossTok, bTok, selfTok, plainTok, agentTok}
	path := func(k ledger.CallKey, suffix string) string { return "/v1/approvals/" + approvals.ID(k) + suffix }

	cases := []struct {
		name       string
		method     string
		path       string
		auth       string
		body       string
		before     func()
		wantStatus int
		wantCode   string
		check      func(t *testing.T, body []byte)
	}{
		{name: "no credentials", method: "GET", path: "/v1/approvals", wantStatus: 401, wantCode: "unauthenticated"},
		{name: "garbage bearer", method: "GET", path: "/v1/approvals", auth: "Bearer not.a.jwt", wantStatus: 401, wantCode: "unauthenticated"},
		{name: "basic auth", method: "GET", path: "/v1/approvals", auth: "Basic " + bossTok, wantStatus: 401, wantCode: "unauthenticated"},
		{name: "agent assertion without role", method: "GET", path: "/v1/approvals", auth: "Bearer " + agentTok, wantStatus: 403, wantCode: "not_approver"},
		{name: "operator is not an approver", method: "GET", path: path(k1, ""), auth: "Bearer " + plainTok, wantStatus: 403, wantCode: "not_approver"},
		{name: "no such endpoint", method: "GET", path: path(k1, "/approvez"), auth: "Bearer " + bossTok, wantStatus: 404, wantCode: "no_route"},
		{name: "method not served", method: "DELETE", path: path(k1, ""), auth: "Bearer " + bossTok, wantStatus: 405, wantCode: "method_not_allowed"},
		{name: "list pending", method: "GET", path: "/v1/approvals?state=pending", auth: "Bearer " + bossTok, wantStatus: 200,
			check: func(t *testing.T, body []byte) {
				var lr approvals.ListResponse
				if err := json.Unmarshal(body, &lr); err != nil {
					t.Fatal(err)
				}
				if len(lr.Approvals) != 3 || lr.Approvals[0].Preview.Amount != "45.00 AUD" || lr.Approvals[0].State != approvals.StatePending {
					t.Errorf("listed %+v; want 3 pending refunds of 45.00 AUD", lr.Approvals)
				}
			}},
		{name: "other tenant lists nothing", method: "GET", path: "/v1/approvals", auth: "Bearer " + bTok, wantStatus: 200,
			check: func(t *testing.T, body []byte) {
				var lr approvals.ListResponse
				if err := json.Unmarshal(body, &lr); err != nil {
					t.Fatal(err)
				}
				if lr.Approvals == nil || len(lr.Approvals) != 0 {
					t.Errorf("tenant t_b sees %+v; want an empty list", lr.Approvals)
				}
			}},
		{name: "bad state", method: "GET", path: "/v1/approvals?state=maybe", auth: "Bearer " + bossTok, wantStatus: 400, wantCode: "invalid_request"},
		{name: "other tenant reads", method: "GET", path: path(k1, ""), auth: "Bearer " + bTok, wantStatus: 404, wantCode: "not_found"},
		{name: "other tenant approves", method: "POST", path: path(k1, "/approve"), auth: "Bearer " + bTok, body: `{"arguments_hash":"` + hash1 + `"}`, wantStatus: 404, wantCode: "not_found"},
		{name: "unknown id", method: "GET", path: "/v1/approvals/apr_nope", auth: "Bearer " + bossTok, wantStatus: 404, wantCode: "not_found"},
		{name: "show", method: "GET", path: path(k1, ""), auth: "Bearer " + bossTok, wantStatus: 200,
			check: func(t *testing.T, body []byte) {
				var a approvals.Approval
				if err := json.Unmarshal(body, &a); err != nil {
					t.Fatal(err)
				}
				if a.ID != approvals.ID(k1) || a.ArgumentsHash != hash1 || a.Preview.Resource == "" {
					t.Errorf("shown %+v; want approval %s with hash %s and a resource", a, approvals.ID(k1), hash1)
				}
			}},
		{name: "self approval", method: "POST", path: path(k1, "/approve"), auth: "Bearer " + selfTok, body: `{"arguments_hash":"` + hash1 + `"}`, wantStatus: 403, wantCode: "self_approval"},
		{name: "wrong hash", method: "POST", path: path(k1, "/approve"), auth: "Bearer " + bossTok, body: `{"arguments_hash":"sha256:00"}`, wantStatus: 409, wantCode: "hash_mismatch"},
		{name: "missing hash", method: "POST", path: path(k1, "/approve"), auth: "Bearer " + bossTok, body: `{}`, wantStatus: 400, wantCode: "invalid_request"},
		{name: "unknown field", method: "POST", path: path(k1, "/approve"), auth: "Bearer " + bossTok, body: `{"arguments_hash":"` + hash1 + `","force":true}`, wantStatus: 400, wantCode: "invalid_request"},
		{name: "not json", method: "POST", path: path(k1, "/approve"), auth: "Bearer " + bossTok, body: `approve please`, wantStatus: 400, wantCode: "invalid_request"},
		{name: "trailing data", method: "POST", path: path(k1, "/approve"), auth: "Bearer " + bossTok, body: `{"arguments_hash":"` + hash1 + `"} {}`, wantStatus: 400, wantCode: "invalid_request"},
		{name: "approve", method: "POST", path: path(k1, "/approve"), auth: "Bearer " + bossTok, body: `{"arguments_hash":"` + hash1 + `"}`, wantStatus: 200,
			check: func(t *testing.T, body []byte) {
				var a approvals.Approval
				if err := json.Unmarshal(body, &a); err != nil {
					t.Fatal(err)
				}
				if a.State != approvals.StateApproved || a.DecidedBy != "u_boss" {
					t.Errorf("approval answered %s by %q; want approved by u_boss", a.State, a.DecidedBy)
				}
			}},
		{name: "approve again", method: "POST", path: path(k1, "/approve"), auth: "Bearer " + bossTok, body: `{"arguments_hash":"` + hash1 + `"}`, wantStatus: 409, wantCode: "not_pending"},
		{name: "reject without reason", method: "POST", path: path(k2, "/reject"), auth: "Bearer " + bossTok, body: `{"reason":""}`, wantStatus: 400, wantCode: "invalid_request"},
		{name: "reject", method: "POST", path: path(k2, "/reject"), auth: "Bearer " + bossTok, body: `{"reason":"duplicate refund"}`, wantStatus: 200,
			check: func(t *testing.T, body []byte) {
				var a approvals.Approval
				if err := json.Unmarshal(body, &a); err != nil {
					t.Fatal(err)
				}
				if a.State != approvals.StateRejected || a.Reason != "duplicate refund" {
					t.Errorf("rejection answered %s (%q); want rejected (duplicate refund)", a.State, a.Reason)
				}
			}},
		{name: "expired", method: "POST", path: path(k3, "/approve"), auth: "Bearer " + bossTok, body: `{"arguments_hash":"` + f.record(k3).ArgumentsHash + `"}`,
			before: func() { f.clock.Advance(time.Hour) }, wantStatus: 409, wantCode: "expired"},
		{name: "wrong method", method: "DELETE", path: path(k3, ""), auth: "Bearer " + bossTok, wantStatus: 405},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.before != nil {
				tc.before()
			}
			req, err := http.NewRequestWithContext(t.Context(), tc.method, srv.URL+tc.path, strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if tc.auth != "" {
				req.Header.Set("Authorization", tc.auth)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != tc.wantStatus {
				t.Errorf("status %d (%s); want %d", resp.StatusCode, body, tc.wantStatus)
			}
			for _, s := range secrets {
				if strings.Contains(string(body), s) || strings.Contains(strings.Join(resp.Header.Values("WWW-Authenticate"), " "), s) {
					t.Errorf("the response echoes an assertion: %s", body)
				}
			}
			if tc.wantCode != "" {
				var e struct {
					Error struct{ Code, Message string }
				}
				if err := json.Unmarshal(body, &e); err != nil {
					t.Fatalf("error body %s: %v", body, err)
				}
				if e.Error.Code != tc.wantCode || e.Error.Message == "" {
					t.Errorf("error %+v; want code %s with a message", e.Error, tc.wantCode)
				}
			}
			if tc.check != nil {
				tc.check(t, body)
			}
		})
	}
}
