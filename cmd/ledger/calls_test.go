package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// ledger calls resolve sends --cancel-compensation as the resolution's
// cancel_compensation, which a resolution as succeeded behind the
// reconciler's pending compensation needs.
func TestCallsResolveSendsCancelCompensation(t *testing.T) {
	srv, posted := recordingAPI(t, "/v1/resolutions", `{"type":"succeeded"}`)
	base := []string{"calls", "resolve", "k1", "--api", srv.URL, "--assertion", "tok", "--call-tenant", "t_a", "--as", "succeeded", "--evidence", "the bank's statement"}
	cli(t, base...)
	cli(t, append(base, "--cancel-compensation")...)
	got := *posted
	if len(got) != 2 {
		t.Fatalf("%d resolutions posted; want 2", len(got))
	}
	for i, want := range []bool{false, true} {
		if got[i]["cancel_compensation"] != want || got[i]["as"] != "succeeded" || got[i]["idempotency_key"] != "k1" || got[i]["tenant_id"] != "t_a" {
			t.Errorf("resolution %d posted %v; want cancel_compensation %v", i, got[i], want)
		}
	}
}

// ledger calls compensate --json prints the API's answer as JSON, as
// every other command's --json does; it printed its text line.
func TestCallsCompensateJSON(t *testing.T) {
	srv := answeringWith(t, http.MethodPost, "/v1/compensations", http.StatusOK, `{"compensation_key":"k1:compensate","events":[{"type":"requested"}]}`)
	out := cli(t, "calls", "compensate", "k1", "--api", srv.URL, "--assertion", "tok", "--call-tenant", "t_a", "--reason", "r", "--json")
	var v struct {
		CompensationKey string            `json:"compensation_key"`
		Events          []json.RawMessage `json:"events"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil || v.CompensationKey != "k1:compensate" || len(v.Events) != 1 {
		t.Errorf("calls compensate --json printed:\n%s\nwant the answer as JSON (%v)", out, err)
	}
	if out := cli(t, "calls", "compensate", "k1", "--api", srv.URL, "--assertion", "tok", "--call-tenant", "t_a", "--reason", "r"); out != "compensation requested: k1:compensate\n" {
		t.Errorf("calls compensate printed %q", out)
	}
}

// ledger calls compensate fails, saying why, when the compensation was
// answered and refused (its call denied: the tool frozen): it printed
// "compensation requested" and exited 0, and nothing would undo the call.
func TestCallsCompensateRefused(t *testing.T) {
	srv := answeringWith(t, http.MethodPost, "/v1/compensations", http.StatusOK,
		`{"compensation_key":"t_a/k1:compensate","events":[{"type":"denied","seq":0,"reason":"tool_frozen","detail":"cancel_refund is frozen"}]}`)
	args := []string{"calls", "compensate", "k1", "--api", srv.URL, "--assertion", "tok", "--call-tenant", "t_a", "--reason", "r"}
	err := cliErr(t, args...)
	if want := "compensation t_a/k1:compensate refused: denied (tool_frozen): cancel_refund is frozen; its key was not used"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("calls compensate of a refused compensation = %v; want an error with %q", err, want)
	}
	// --json prints the answer, and fails all the same.
	root := newRoot()
	var out bytes.Buffer
	root.SetArgs(append(args, "--json"))
	root.SetOut(&out)
	root.SetErr(io.Discard)
	if err := root.ExecuteContext(t.Context()); err == nil || !strings.Contains(out.String(), `"tool_frozen"`) {
		t.Errorf("calls compensate --json of a refused compensation = %v, printed %q; want the answer printed, and an error", err, out.String())
	}
}

// ledger approvals list warns, on stderr, when the service's list stopped
// at its bound: it printed the oldest 1,000 as if they were the queue.
func TestApprovalsListSaysWhenCut(t *testing.T) {
	for _, more := range []bool{false, true} {
		srv := answeringWith(t, http.MethodGet, "/v1/approvals", http.StatusOK, fmt.Sprintf(`{"approvals":[],"more":%v}`, more))
		_, stderr := cliSplit(t, "approvals", "list", "--api", srv.URL, "--assertion", "tok")
		if got := strings.Contains(stderr, "warning: listed 0 approvals, where the service stops: more are pending"); got != more {
			t.Errorf("approvals list, more %v: stderr %q", more, stderr)
		}
	}
}

// An operator's decision and its words come from the command line only:
// a LEDGER_REASON, LEDGER_AS, LEDGER_FORCE or LEDGER_SWAP left in the
// environment would make every action's, and take a rebuild's risk, for
// them; a LEDGER_HASH left from one approval would approve the next call
// of the same arguments without showing it. The commands refuse as if
// they were unset.
func TestOperatorsDecisionsNotFromTheEnvironment(t *testing.T) {
	t.Setenv("LEDGER_REASON", "left over")
	t.Setenv("LEDGER_AS", "succeeded")
	t.Setenv("LEDGER_EVIDENCE", "left over")
	t.Setenv("LEDGER_HASH", "sha256:"+strings.Repeat("a", 64))
	srv := answeringWith(t, http.MethodPost, "/v1/compensations", http.StatusOK, `{"compensation_key":"k1:compensate","events":[{"type":"requested","seq":1}]}`)
	if err := cliErr(t, "calls", "compensate", "k1", "--api", srv.URL, "--assertion", "tok"); err == nil || !strings.Contains(err.Error(), "--reason is required") {
		t.Errorf("calls compensate with LEDGER_REASON alone = %v; want --reason required", err)
	}
	var approved atomic.Int32
	apr := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			approved.Add(1)
		}
		fmt.Fprint(w, `{"id":"apr_1","state":"pending","tool":"refund_order","arguments_hash":"sha256:`+strings.Repeat("a", 64)+`"}`)
	}))
	t.Cleanup(apr.Close)
	err := cliErr(t, "approvals", "approve", "apr_1", "--api", apr.URL, "--assertion", "tok")
	if n := approved.Load(); n != 0 || err == nil || !strings.Contains(err.Error(), "no --hash") {
		t.Errorf("approvals approve with LEDGER_HASH alone: %v, %d approvals sent; want it to print the approval and approve nothing", err, n)
	}
	root := newRoot()
	for _, tc := range []struct {
		path  []string
		flags []string
	}{
		{[]string{"calls", "resolve"}, []string{"as", "evidence", "cancel-compensation"}},
		{[]string{"calls", "compensate"}, []string{"reason"}},
		{[]string{"control", "freeze"}, []string{"reason"}},
		{[]string{"control", "revoke"}, []string{"reason"}},
		{[]string{"approvals", "reject"}, []string{"reason"}},
		{[]string{"approvals", "approve"}, []string{"hash"}},
		{[]string{"projector", "rebuild"}, []string{"swap", "force"}},
	} {
		cmd, _, err := root.Find(tc.path)
		if err != nil {
			t.Fatalf("%v: %v", tc.path, err)
		}
		for _, name := range tc.flags {
			if f := cmd.Flags().Lookup(name); f == nil || f.Annotations[explicitOnly] == nil {
				t.Errorf("ledger %s --%s is read from the environment; want the flag only", strings.Join(tc.path, " "), name)
			}
		}
	}
}

// A control action the service published but had not applied within its
// wait (202) is said to be so, on stderr: an operator took it for in
// force, a freeze during an incident say.
func TestControlActionNotYetApplied(t *testing.T) {
	for _, tc := range []struct {
		status int
		said   bool
	}{{http.StatusOK, false}, {http.StatusAccepted, true}} {
		srv := answeringWith(t, http.MethodPost, "/v1/control/freeze", tc.status, `{"kind":"freeze","tool":"refund_order"}`)
		stdout, stderr := cliSplit(t, "control", "freeze", "--tool", "refund_order", "--reason", "incident", "--api", srv.URL, "--assertion", "tok")
		if said := strings.Contains(stderr, "not applied it yet (202)"); said != tc.said || !strings.Contains(stdout, `"freeze"`) {
			t.Errorf("control freeze answered %d: stdout %q, stderr %q; want the action, and the note %v", tc.status, stdout, stderr, tc.said)
		}
	}
}

// --tenant and --user name the tenant and user of a dev assertion minted
// here: with --assertion they are refused, and nothing is sent. Before,
// they were ignored, and `control freeze --tenant t_acme` by a platform
// operator froze the tool for every tenant (control's scope is
// --for-tenant). A freeze or unfreeze then says which tenants it is of.
func TestStaffAssertionRefusesDevIdentityFlags(t *testing.T) {
	var asked atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		var body struct{ Tenant string }
		_ = json.NewDecoder(r.Body).Decode(&body)
		fmt.Fprintf(w, `{"kind":"freeze","tool":"refund_order","tenant":%q}`, body.Tenant)
	}))
	t.Cleanup(srv.Close)
	for _, flag := range []string{"--tenant", "--user"} {
		err := cliErr(t, "control", "freeze", "--tool", "refund_order", "--reason", "incident", flag, "t_acme", "--api", srv.URL, "--assertion", "tok")
		if err == nil || !strings.Contains(err.Error(), flag+": only for a dev assertion") {
			t.Errorf("control freeze %s with --assertion: %v; want it refused", flag, err)
		}
	}
	if n := asked.Load(); n != 0 {
		t.Fatalf("the API was asked %d times; want nothing sent", n)
	}
	// From the environment they are ignored, as CONFIG.md says: a
	// LEDGER_TENANT set for the query commands (the tenant asked about)
	// must not refuse every staff command given an assertion.
	t.Setenv("LEDGER_TENANT", "t_other")
	t.Setenv("LEDGER_USER", "u_other")
	if err := cliErr(t, "control", "freeze", "--tool", "refund_order", "--reason", "incident", "--api", srv.URL, "--assertion", "tok"); err != nil {
		t.Errorf("control freeze with LEDGER_TENANT and LEDGER_USER set and --assertion: %v; want it sent, the variables ignored", err)
	}
	if n := asked.Load(); n != 1 {
		t.Errorf("the API was asked %d times; want once", n)
	}
	for tenant, want := range map[string]string{"": "freeze of refund_order for every tenant", "t_acme": "freeze of refund_order for tenant t_acme"} {
		_, stderr := cliSplit(t, "control", "freeze", "--tool", "refund_order", "--reason", "incident", "--for-tenant", tenant, "--api", srv.URL, "--assertion", "tok")
		if !strings.Contains(stderr, want) {
			t.Errorf("control freeze --for-tenant %q: stderr %q; want %q", tenant, stderr, want)
		}
	}
}

// control withdraw-policy asks the control API to end the activation in
// force, with the operator's reason, and prints the withdrawal.
func TestControlWithdrawPolicy(t *testing.T) {
	srv := answeringWith(t, http.MethodPost, "/v1/control/withdraw-policy", http.StatusOK, `{"kind":"withdraw_policy","subject":"policy:active","policy":"v42"}`)
	out := cli(t, "control", "withdraw-policy", "--reason", "v42 denies everything", "--api", srv.URL, "--assertion", "tok")
	if !strings.Contains(out, `"withdraw_policy"`) || !strings.Contains(out, `"v42"`) {
		t.Errorf("control withdraw-policy printed:\n%s\nwant the withdrawal of v42", out)
	}
	if err := cliErr(t, "control", "withdraw-policy", "--api", srv.URL, "--assertion", "tok"); err == nil || !strings.Contains(err.Error(), "--reason is required") {
		t.Errorf("control withdraw-policy without --reason: %v; want it refused", err)
	}
}

// ledger calls resolve|compensate KEY read KEY as <tenant_id>/<key>, as
// ledger trace does, and a key alone as one of the operator's own tenant
// (its assertion's), unless --call-tenant says which: before, a key alone
// or a <tenant_id>/<key> was always one of t_demo's, and a t_acme
// operator was refused 403 for a call of its own tenant.
func TestCallsKeyOfTheOperatorsTenant(t *testing.T) {
	dir := t.TempDir()
	devIssuerKeys(t, dir)
	acme := strings.TrimSpace(cli(t, "token", "--data-dir", dir, "--tenant", "t_acme", "--user", "u_ops", "--operator"))
	platform := strings.TrimSpace(cli(t, "token", "--data-dir", dir, "--tenant", "*", "--user", "u_root", "--operator"))
	srv, posted := recordingAPI(t, "/v1/compensations", `{"compensation_key":"x","events":[]}`)
	for _, tc := range []struct {
		args        []string
		tenant, key string
	}{
		{[]string{"r-1", "--assertion", acme}, "t_acme", "r-1"},
		{[]string{"t_beta/r-1", "--assertion", platform}, "t_beta", "r-1"},
		{[]string{"r-1", "--assertion", platform}, "t_demo", "r-1"},
		{[]string{"a/b", "--assertion", acme, "--call-tenant", "t_acme"}, "t_acme", "a/b"},
		// A tenant operator acts on its own tenant alone: a key that
		// holds a "/" naming another is one of its own.
		{[]string{"t_acme/r-2", "--assertion", acme}, "t_acme", "r-2"},
		{[]string{"agent-7/run-1", "--assertion", acme}, "t_acme", "agent-7/run-1"},
	} {
		*posted = nil
		cli(t, append([]string{"calls", "compensate", "--api", srv.URL, "--reason", "r"}, tc.args...)...)
		if got := *posted; len(got) != 1 || got[0]["tenant_id"] != tc.tenant || got[0]["idempotency_key"] != tc.key {
			t.Errorf("ledger calls compensate %v posted %v; want %s/%s", tc.args, *posted, tc.tenant, tc.key)
		}
	}
	// --call-tenant's variable counts as the flag.
	t.Setenv("LEDGER_CALL_TENANT", "t_beta")
	*posted = nil
	cli(t, "calls", "compensate", "r-1", "--api", srv.URL, "--reason", "r", "--assertion", platform)
	if got := *posted; len(got) != 1 || got[0]["tenant_id"] != "t_beta" || got[0]["idempotency_key"] != "r-1" {
		t.Errorf("ledger calls compensate r-1 with LEDGER_CALL_TENANT=t_beta posted %v; want t_beta/r-1", got)
	}
}

// recordingAPI is an operators' API that answers POST path with answer,
// keeping every body posted.
func recordingAPI(t *testing.T, path, answer string) (*httptest.Server, *[]map[string]any) {
	t.Helper()
	var posted []map[string]any
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != path {
			http.NotFound(w, r)
			return
		}
		var body map[string]any
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		posted = append(posted, body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(answer))
	}))
	t.Cleanup(srv.Close)
	return srv, &posted
}
