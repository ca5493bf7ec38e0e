package main

import (
	"strings"
	"testing"
	"time"
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
