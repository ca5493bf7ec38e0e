package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/projections"
)

// An approval's resource and requester come from an agent's call: in the
// table, a newline, a tab or a terminal escape in them neither forges a
// row nor reaches the approver's terminal. Before, the table printed
// them as they were.
func TestApprovalsTableKeepsAgentTextInItsCell(t *testing.T) {
	now := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	a := approvalView{ID: "ap_1", Tool: "refund_order", State: "pending", ExpiresAt: now.Add(5 * time.Minute)}
	a.Requester.User, a.Requester.Agent = "u_1", "agent\x1b]0;owned\x07"
	a.Preview.Resource = "ord_1\x1b[2J\nap_2\tcreate_ticket\tu_boss\u202e"
	a.Preview.Amount = "45.00 AUD"
	var b strings.Builder
	if err := approvalsTable(&b, []approvalView{a}, now); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	if strings.ContainsAny(out, "\x1b\x07\t\u202e") {
		t.Errorf("the table carries a control character, an escape or a bidi override:\n%q", out)
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if len(lines) != 2 || !strings.Contains(lines[1], "ord_1?[2J?ap_2?create_ticket?u_boss?") || !strings.Contains(lines[1], "5m0s") {
		t.Errorf("table:\n%s\nwant a header and one row, the resource's controls shown as '?'", out)
	}
	if strings.Contains(out, "roles:") {
		t.Errorf("the table shows roles for a call decided without them:\n%s", out)
	}
}

// The requester's roles, where the policies were given them, are in the
// requester's cell, "none" for none.
func TestApprovalsTableShowsTheRequestersRoles(t *testing.T) {
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	a := approvalView{ID: "ap_1", Tool: "refund_order", State: "pending", ExpiresAt: now.Add(time.Minute)}
	a.Requester.User, a.Requester.Agent = "u_1", "agent_1"
	a.Requester.Roles, a.Requester.RolesGiven = []string{"contractor", "support"}, true
	b := a
	b.ID, b.Requester.Roles = "ap_2", nil
	var out strings.Builder
	if err := approvalsTable(&out, []approvalView{a, b}, now); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 3 || !strings.Contains(lines[1], "u_1 (agent_1) roles: contractor,support") || !strings.Contains(lines[2], "u_1 (agent_1) roles: none") {
		t.Errorf("table:\n%s\nwant the roles in the requester's cells", out.String())
	}
}

// An approved call's row says where the call stands, and why it ended
// when it did without running.
func TestApprovalsTableSaysWhatBecameOfTheCall(t *testing.T) {
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	a := approvalView{ID: "ap_1", Tool: "refund_order", State: "approved", CallStatus: "denied", CallReason: "approval_expired"}
	b := approvalView{ID: "ap_2", Tool: "refund_order", State: "approved", CallStatus: "succeeded"}
	c := approvalView{ID: "ap_3", Tool: "refund_order", State: "rejected"}
	var out strings.Builder
	if err := approvalsTable(&out, []approvalView{a, b, c}, now); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 4 || !strings.HasSuffix(lines[1], "approved (call denied: approval_expired)") || !strings.HasSuffix(lines[2], "approved (call succeeded)") || !strings.HasSuffix(lines[3], "rejected") {
		t.Errorf("table:\n%s\nwant each approved call's state beside its approval's", out.String())
	}
}

// ledger approvals show prints an agent's arguments with what a terminal
// would not show as it is escaped (an 8-bit CSI, a bidi override, a
// zero-width space): the console sends approvers there to read such
// calls in full. Before, the bytes reached the terminal raw.
func TestApprovalsShowEscapesHiddenRunes(t *testing.T) {
	srv := answering(t, "/v1/approvals/ap_1", "{\"id\":\"ap_1\",\"preview\":{\"arguments\":{\"subject\":\"hello \u009b8m\u202eevil\u200b\"}}}")
	out := cli(t, "approvals", "show", "ap_1", "--api", srv.URL, "--assertion", "tok")
	if strings.ContainsAny(out, "\u009b\u202e\u200b") {
		t.Errorf("approvals show printed a hidden rune raw:\n%q", out)
	}
	if !strings.Contains(out, `hello \u009b8m\u202eevil\u200b`) {
		t.Errorf("approvals show:\n%s\nwant the subject with its hidden runes escaped", out)
	}
}

// Every JSON the CLI prints for a terminal escapes what one would not
// show as it is: ledger blast-radius --json printed an agent's call id
// (which the envelope's schema lets hold C1 controls and bidi overrides)
// raw, so that one tenant's agent could repaint what a platform
// responder reads. The table form replaced them already.
func TestBlastRadiusJSONEscapesHiddenRunes(t *testing.T) {
	srv := answering(t, "/v1/blast-radius", "{\"total\":1,\"calls\":[{\"tenant_id\":\"t_demo\",\"idempotency_key\":\"k\",\"call_id\":\"c \u009b2J\u202eevil\",\"state\":\"succeeded\"}]}")
	out := cli(t, "blast-radius", "--json", "--tool", "get_weather", "--tenant", "t_demo", "--api", srv.URL, "--assertion", "tok")
	if strings.ContainsAny(out, "\u009b\u202e") {
		t.Errorf("blast-radius --json printed a hidden rune raw:\n%q", out)
	}
	if !strings.Contains(out, `c \u009b2J\u202eevil`) {
		t.Errorf("blast-radius --json:\n%s\nwant the call id with its hidden runes escaped", out)
	}
}

// A blast radius whose list is not all its calls says why, on stderr
// beside the JSON: the limit cut it, or (from ClickHouse) the counts and
// the list were read while the projection took writes. Before, both were
// put down to --limit, a limit of 1000 over 2 calls listed as none.
func TestBlastRadiusNotes(t *testing.T) {
	for _, c := range []struct {
		name, answer, note string
	}{
		{"limit", `{"filter":{"limit":1},"total":2,"calls":[{"idempotency_key":"k"}],"truncated":true}`, "warning: listed 1 of the 2 matching calls (--limit)"},
		{"moved", `{"filter":{"limit":1000},"total":2,"calls":[]}`, "warning: the counts (2 calls) and the list (0) were read while the projection took writes, and disagree; ask again"},
		{"all", `{"filter":{"limit":1000},"total":1,"calls":[{"tenant_id":"t_demo","idempotency_key":"k","tool":"get_weather","state":"succeeded"}],
			"by_tenant":[{"value":"t_demo","calls":1}],"by_state":[{"value":"succeeded","calls":1}],"by_tool":[{"value":"get_weather","calls":1}],"by_resource":[{"value":"","calls":1}],
			"distinct":{"tenants":1,"states":1,"tools":1,"resources":1}}`, ""},
		{"recounted", `{"filter":{"limit":1000},"total":1,"calls":[{"tenant_id":"t_demo","idempotency_key":"k","tool":"get_weather","state":"succeeded"}],
			"by_tenant":[{"value":"t_demo","calls":1}],"by_state":[{"value":"outcome_unknown","calls":1}],"by_tool":[{"value":"get_weather","calls":1}],"by_resource":[{"value":"","calls":1}],
			"distinct":{"tenants":1,"states":1,"tools":1,"resources":1}}`, "warning: the counts (1 calls) and the list (1) were read while the projection took writes, and disagree; ask again"},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := answering(t, "/v1/blast-radius", c.answer)
			out, notes := cliSplit(t, "blast-radius", "--json", "--tool", "get_weather", "--tenant", "t_demo", "--api", srv.URL, "--assertion", "tok")
			var br projections.BlastRadius
			if err := json.Unmarshal([]byte(out), &br); err != nil {
				t.Fatalf("stdout is not the answer: %v\n%s", err, out)
			}
			if c.note == "" && notes != "" || !strings.Contains(notes, c.note) {
				t.Errorf("stderr: %q; want %q", notes, c.note)
			}
		})
	}
}

// An answer past what the CLI reads is said to be so: it was cut and
// then refused as "unexpected end of JSON input".
func TestApprovalsListAnswerTooLarge(t *testing.T) {
	srv := answering(t, "/v1/approvals", `[{"id":"ap_1","note":"`+strings.Repeat("x", 5<<20)+`"}]`)
	err := cliErr(t, "approvals", "list", "--api", srv.URL, "--assertion", "tok")
	if err == nil || !strings.Contains(err.Error(), "larger than 4 MiB") {
		t.Errorf("approvals list of a 5 MiB answer: %v; want it said to be larger than the 4 MiB read", err)
	}
}

// answering is an API that answers a GET of path with the JSON body, and
// 404 to anything else.
func answering(t *testing.T, path, body string) *httptest.Server {
	t.Helper()
	return answeringWith(t, http.MethodGet, path, http.StatusOK, body)
}

// answeringWith is answering a method's requests of path, with status.
func answeringWith(t *testing.T, method, path string, status int, body string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != method || r.URL.Path != path {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// Only a pending approval shows a time left: a rejected or expired one
// shows none. Before, a rejected approval counted down to an expiry that
// meant nothing.
func TestApprovalsTableTimeLeftOfPendingOnly(t *testing.T) {
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	var as []approvalView
	for _, state := range []string{"pending", "rejected", "expired"} {
		as = append(as, approvalView{ID: "ap_" + state, Tool: "refund_order", State: state, ExpiresAt: now.Add(10 * time.Minute)})
	}
	var out strings.Builder
	if err := approvalsTable(&out, as, now); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 4 || !strings.Contains(lines[1], "10m0s") || strings.Contains(lines[2], "10m0s") || strings.Contains(lines[3], "10m0s") {
		t.Errorf("table:\n%s\nwant a time left for the pending approval alone", out.String())
	}
}
