package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/identity"
)

// freeAddr is a loopback address nobody listens on, for a command under
// test to listen on, picked as the bench picks its processes' (below
// the kernel's ephemeral range: see freeLoopbackAddrs).
func freeAddr(t *testing.T) string {
	t.Helper()
	addr, err := freeLoopbackAddr()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

// freeAddrs is n addresses as freeAddr's, all different.
func freeAddrs(t *testing.T, n int) []string {
	t.Helper()
	addrs, err := freeLoopbackAddrs(n)
	if err != nil {
		t.Fatal(err)
	}
	return addrs
}

// runCommand runs the ledger command line args in process until the
// test ends, when its context is cancelled and it must return, without
// an error, within 30 s. exited, for a readiness loop, fails the test at
// once if the command has returned already.
func runCommand(t *testing.T, args ...string) (exited func()) {
	t.Helper()
	stop, stopped := startCommand(t, args...)
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Error(err)
		}
	})
	return func() {
		select {
		case <-stopped:
			t.Fatalf("ledger %s exited: %v", strings.Join(args, " "), stop())
		default:
		}
	}
}

// startCommand runs a ledger subcommand in process. stop ends its
// context, waits for it to return (30 s at most) and returns its error;
// it may be called again, from any goroutine, and answers the same.
// stopped is closed once the command returned.
func startCommand(t *testing.T, args ...string) (stop func() error, stopped <-chan struct{}) {
	t.Helper()
	name := strings.Join(args, " ")
	ctx, cancel := context.WithCancel(context.Background())
	var err error
	done := make(chan struct{})
	root := newRoot()
	root.SetArgs(args)
	root.SetOut(io.Discard)
	go func() {
		err = root.ExecuteContext(ctx)
		close(done)
	}()
	stop = sync.OnceValue(func() error {
		cancel()
		select {
		case <-done:
			if err != nil {
				return fmt.Errorf("ledger %s: %w", name, err)
			}
			return nil
		case <-time.After(30 * time.Second):
			return fmt.Errorf("ledger %s did not stop within 30s of its context's end", name)
		}
	})
	return stop, done
}

type devRun struct {
	kafka, api, backend string
	dir                 string
	stop                func()
}

// startDev runs `ledger dev` in process and waits until its API is healthy.
func startDev(t *testing.T, dir, kafka, api, backend string, extra ...string) *devRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	root := newRoot()
	root.SetArgs(append([]string{"dev", "--data-dir", dir, "--kafka-addr", kafka, "--http-addr", api, "--backend-addr", backend, "--partitions", "3", "--log-level", "warn"}, extra...))
	root.SetOut(io.Discard)
	go func() { done <- root.ExecuteContext(ctx) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("ledger dev: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("ledger dev did not stop within 30s of Ctrl-C")
		}
	}
	t.Cleanup(stop)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		select {
		case err := <-done:
			stopped = true // it did stop: nothing to wait for
			t.Fatalf("ledger dev exited: %v", err)
		default:
		}
		return healthz(api)
	})
	return &devRun{kafka: kafka, api: api, backend: backend, dir: dir, stop: stop}
}

// healthz is nil once the server at addr answers GET /healthz with 200.
func healthz(addr string) error {
	resp, err := http.Get("http://" + addr + "/healthz")
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("healthz %d", resp.StatusCode)
	}
	return nil
}

// approveShown approves the approval id as u_boss, with the hash that
// approvals show prints for it.
func approveShown(t *testing.T, id, api, dir string) {
	t.Helper()
	var a struct {
		Hash string `json:"arguments_hash"`
	}
	if err := json.Unmarshal([]byte(cli(t, "approvals", "show", id, "--api", "http://"+api, "--data-dir", dir, "--user", "u_boss")), &a); err != nil || a.Hash == "" {
		t.Fatalf("approvals show %s: hash %q, %v", id, a.Hash, err)
	}
	cli(t, "approvals", "approve", id, "--api", "http://"+api, "--data-dir", dir, "--user", "u_boss", "--hash", a.Hash)
}

// cli runs a ledger subcommand and returns its output.
func cli(t *testing.T, args ...string) string {
	t.Helper()
	var out bytes.Buffer
	runCLI(t, &out, &out, args)
	return out.String()
}

// cliSplit is cli with what the command wrote to stdout and to stderr
// apart: the answer a script reads, and the notes beside it.
func cliSplit(t *testing.T, args ...string) (stdout, stderr string) {
	t.Helper()
	var out, errs bytes.Buffer
	runCLI(t, &out, &errs, args)
	return out.String(), errs.String()
}

func runCLI(t *testing.T, stdout, stderr *bytes.Buffer, args []string) {
	t.Helper()
	root := newRoot()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	if err := root.ExecuteContext(t.Context()); err != nil {
		t.Fatalf("ledger %s: %v\n%s%s", strings.Join(args, " "), err, stdout, stderr)
	}
}

type callView struct {
	State   string `json:"state"`
	Settled bool   `json:"settled"`
	Events  []struct {
		Seq  int64  `json:"seq"`
		Type string `json:"type"`
	} `json:"events"`
	Result json.RawMessage `json:"result"`
}

func getCall(t *testing.T, api, key string) (int, callView) {
	t.Helper()
	resp, err := http.Get("http://" + api + "/v1/calls/" + key + "?tenant_id=t_demo")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v callView
	_ = json.NewDecoder(resp.Body).Decode(&v)
	return resp.StatusCode, v
}

func types(v callView) string {
	var s []string
	for _, e := range v.Events {
		s = append(s, e.Type)
	}
	return strings.Join(s, ",")
}

// The README's first steps, end to end: `ledger dev`, then `ledger submit
// --wait`, then the API; then a restart on the same data directory keeps
// every call, and a retry after the restart does not run the tool again.
func TestDevEndToEnd(t *testing.T) {
	dir := t.TempDir()
	addrs := freeAddrs(t, 3)
	kafka, api, backend := addrs[0], addrs[1], addrs[2]
	dev := startDev(t, dir, kafka, api, backend)

	// An API path no route takes, or a method one does not serve, is
	// answered in JSON, not with the console's page or plain text.
	for _, tc := range []struct{ method, path, code, allow string }{
		{"GET", "/v1/nope", "no_route", ""},
		{"DELETE", "/v1/health", "method_not_allowed", "GET, HEAD"},
		{"PUT", "/v1/approvals", "method_not_allowed", "GET, HEAD"},
	} {
		req, _ := http.NewRequest(tc.method, "http://"+api+tc.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var e struct {
			Error struct{ Code string } `json:"error"`
		}
		err = json.NewDecoder(resp.Body).Decode(&e)
		resp.Body.Close()
		if err != nil || e.Error.Code != tc.code || resp.Header.Get("Allow") != tc.allow || resp.Header.Get("Content-Type") != "application/json" {
			t.Errorf("%s %s: %d %s, Allow %q (%v); want a JSON %s, Allow %q", tc.method, tc.path, resp.StatusCode, e.Error.Code, resp.Header.Get("Allow"), err, tc.code, tc.allow)
		}
	}

	out := cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"Sydney"}`, "--tenant", "t_demo", "--key", "dev-1", "--wait", "--timeout", "60s")
	for _, want := range []string{"requested", "authorized", "executing", "succeeded", "t_demo/dev-1 is succeeded"} {
		if !strings.Contains(out, want) {
			t.Errorf("submit --wait output lacks %q:\n%s", want, out)
		}
	}
	var v callView
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		code, got := getCall(t, api, "dev-1")
		if code != 200 || !got.Settled {
			return fmt.Errorf("GET /v1/calls/dev-1: %d %q", code, got.State)
		}
		v = got
		return nil
	})
	if got, want := types(v), "requested,authorized,executing,succeeded"; got != want {
		t.Errorf("API events %s; want %s", got, want)
	}
	if !strings.Contains(string(v.Result), "Sydney") || !strings.Contains(string(v.Result), `"untrusted": true`) {
		t.Errorf("API result %s; want the weather, marked untrusted", v.Result)
	}
	devOperations(t, api)
	resp, err := http.Get("http://" + api + "/v1/calls/dev-1?tenant_id=t_other")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 404 {
		t.Errorf("another tenant reading dev-1: status %d; want 404", resp.StatusCode)
	}
	// A request to a name not loopback's (a page of another site, its
	// name rebound to 127.0.0.1) is refused, by the API and the tools
	// alike: they answer whoever reaches them without asking who.
	for _, u := range []string{"http://" + api + "/v1/calls/dev-1?tenant_id=t_demo", "http://" + backend + "/effects"} {
		req, _ := http.NewRequest(http.MethodGet, u, nil)
		req.Host = "rebound.example"
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden || !strings.Contains(string(b), `"not_loopback"`) || strings.Contains(string(b), "Sydney") {
			t.Errorf("GET %s with Host rebound.example: %d %s; want 403 not_loopback", u, resp.StatusCode, b)
		}
	}

	// ledger token mints an assertion from the dev issuer; a call signed
	// with it runs, and one signed for another tenant is refused.
	tok := strings.TrimSpace(cli(t, "token", "--data-dir", dir, "--tenant", "t_demo", "--user", "u_tok"))
	if strings.Count(tok, ".") != 2 {
		t.Fatalf("ledger token printed %q; want a compact JWT", tok)
	}
	out = cli(t, "submit", "--kafka-brokers", kafka, "--assertion", tok, "--user", "u_tok", "--tool", "get_weather", "--args", `{"city":"Hobart"}`, "--key", "dev-tok", "--wait", "--timeout", "60s")
	if !strings.Contains(out, "t_demo/dev-tok is succeeded") {
		t.Errorf("submit with a minted assertion:\n%s", out)
	}
	other := strings.TrimSpace(cli(t, "token", "--data-dir", dir, "--tenant", "t_other"))
	out = cli(t, "submit", "--kafka-brokers", kafka, "--assertion", other, "--tenant", "t_demo", "--tool", "get_weather", "--args", `{"city":"Hobart"}`, "--key", "dev-forged", "--wait", "--timeout", "60s")
	// The scope claims t_demo (without --tenant, submit would claim the
	// assertion's): the refusal is recorded under the verified tenant,
	// never the claimed one; submit --wait follows it there.
	if !strings.Contains(out, "refused: scope_mismatch at /scope/tenant_id") {
		t.Errorf("submit with another tenant's assertion:\n%s", out)
	}
	if code, _ := getCall(t, api, "dev-forged"); code != 404 {
		t.Errorf("the claimed tenant t_demo has a record of the forged call (status %d)", code)
	}

	// A refund above the demo threshold waits for a human; the approver
	// sees a readable preview, approves, and it runs once.
	out = cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "refund_order", "--args", `{"order_id":"ord_1029","amount_cents":45000,"currency":"AUD"}`, "--key", "dev-refund", "--wait", "--timeout", "60s")
	if !strings.Contains(out, "t_demo/dev-refund is approval_pending") {
		t.Fatalf("refund above the threshold:\n%s", out)
	}
	id := ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "dev-refund"}.ApprovalID()
	list := cli(t, "approvals", "list", "--api", "http://"+api, "--data-dir", dir)
	for _, want := range []string{id, "refund_order", "ord_1029", "450.00 AUD", "u_demo"} {
		if !strings.Contains(list, want) {
			t.Errorf("approvals list lacks %q:\n%s", want, list)
		}
	}
	show := cli(t, "approvals", "show", id, "--api", "http://"+api, "--data-dir", dir)
	if !strings.Contains(show, `"arguments_hash"`) || !strings.Contains(show, "ord_1029") {
		t.Errorf("approvals show:\n%s", show)
	}
	// An agent's assertion is not an approver's, even with the role.
	agentTok := strings.TrimSpace(cli(t, "token", "--data-dir", dir, "--user", "u_boss", "--roles", "approver"))
	req, _ := http.NewRequest(http.MethodGet, "http://"+api+"/v1/approvals", nil)
	req.Header.Set("Authorization", "Bearer "+agentTok)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 401 {
		t.Errorf("the queue with an agent's assertion: %v %v; want 401", resp.StatusCode, err)
	} else {
		resp.Body.Close()
	}
	// The approval binds the hash the approver saw: another is refused.
	root := newRoot()
	root.SetArgs([]string{"approvals", "approve", id, "--api", "http://" + api, "--data-dir", dir, "--user", "u_boss", "--hash", "sha256:" + strings.Repeat("0", 64)})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	if err := root.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), "hash_mismatch") {
		t.Errorf("approving another hash: %v; want hash_mismatch", err)
	}
	// Without --hash it shows the approval, arguments and hash, and
	// approves nothing.
	root = newRoot()
	root.SetArgs([]string{"approvals", "approve", id, "--api", "http://" + api, "--data-dir", dir, "--user", "u_boss"})
	var shown bytes.Buffer
	root.SetOut(&shown)
	root.SetErr(io.Discard)
	if err := root.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), "--hash sha256:") ||
		!strings.Contains(shown.String(), `"arguments_hash"`) || !strings.Contains(shown.String(), "ord_") {
		t.Errorf("approving without --hash: %v, showing:\n%s\nwant the approval shown, its hash asked for, nothing approved", err, shown.String())
	}
	var after struct {
		State string `json:"state"`
	}
	if err := json.Unmarshal([]byte(cli(t, "approvals", "show", id, "--api", "http://"+api, "--data-dir", dir, "--user", "u_boss")), &after); err != nil || after.State != "pending" {
		t.Errorf("after an approve without --hash the approval is %q (%v); want still pending", after.State, err)
	}
	approveShown(t, id, api, dir)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if code, v := getCall(t, api, "dev-refund"); code != 200 || v.State != "succeeded" {
			return fmt.Errorf("refund is %q", v.State)
		}
		return nil
	})
	// Decided: approve without --hash says so, not "run again".
	root = newRoot()
	root.SetArgs([]string{"approvals", "approve", id, "--api", "http://" + api, "--data-dir", dir, "--user", "u_boss"})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	if err := root.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), "not pending") {
		t.Errorf("approving a decided approval without --hash: %v; want it said not pending", err)
	}
	refundTrace := cli(t, "trace", "dev-refund", "--tenant", "t_demo", "--kafka-brokers", kafka, "--json")
	for _, want := range []string{`"type": "approval_pending"`, `"type": "approved"`, `"approver": "u_boss"`, `"approval_id": "` + id + `"`, `"type": "succeeded"`} {
		if !strings.Contains(refundTrace, want) {
			t.Errorf("trace of the refund lacks %s:\n%s", want, refundTrace)
		}
	}
	table := cli(t, "trace", "dev-refund", "--tenant", "t_demo", "--kafka-brokers", kafka)
	for _, want := range []string{"approval_pending", "reason=approval_required", "approver=u_boss", "hash=sha256:", "jti="} {
		if !strings.Contains(table, want) {
			t.Errorf("trace table of the refund lacks %s:\n%s", want, table)
		}
	}
	effects, err := demobackend.ReadJournal(filepath.Join(dir, "effects.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	refunds := 0
	for _, e := range effects {
		if e.IdempotencyKey == "t_demo/dev-refund" && !e.Replay {
			refunds++
		}
	}
	if refunds != 1 {
		t.Errorf("the approved refund ran %d times; want 1", refunds)
	}

	trace := cli(t, "trace", "dev-1", "--tenant", "t_demo", "--kafka-brokers", kafka)
	for _, want := range []string{"requested", "authorized", "executing", "succeeded"} {
		if !strings.Contains(trace, want) {
			t.Errorf("trace lacks %q:\n%s", want, trace)
		}
	}

	// The API refuses a malformed envelope at once, with the pointer.
	resp, err = http.Post("http://"+api+"/v1/calls", "application/json", strings.NewReader(`{"tool":"get_weather","tool":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	var apiErr struct {
		Error struct{ Code, Pointer string } `json:"error"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&apiErr)
	resp.Body.Close()
	if resp.StatusCode != 400 || apiErr.Error.Code != "duplicate_key" || apiErr.Error.Pointer != "/tool" {
		t.Errorf("malformed POST: %d %+v; want 400 duplicate_key at /tool", resp.StatusCode, apiErr.Error)
	}

	// POST with ?wait answers with the settled call.
	env := cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "create_ticket", "--args", `{"title":"from the api"}`, "--key", "dev-2", "--json")
	// That published dev-2 already; post the same envelope again through
	// the API: a retry, answered with the one call.
	body := env[strings.Index(env, "{"):]
	resp, err = http.Post("http://"+api+"/v1/calls?wait=30s", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var posted callView
	_ = json.NewDecoder(resp.Body).Decode(&posted)
	resp.Body.Close()
	if resp.StatusCode != 200 || posted.State != "succeeded" {
		t.Errorf("POST ?wait: %d %q; want 200 succeeded", resp.StatusCode, posted.State)
	}

	// The kill switch: freeze refund_order, and a refund is refused
	// tool_frozen, saying since when but not the operator's reason (that
	// is control show's); unfreeze, and the same key runs.
	cli(t, "control", "freeze", "--tool", "refund_order", "--reason", "incident 42", "--api", "http://"+api, "--data-dir", dir, "--user", "u_ops")
	if shown := cli(t, "control", "show", "--api", "http://"+api, "--data-dir", dir, "--user", "u_ops"); !strings.Contains(shown, "incident 42") {
		t.Errorf("control show after a freeze:\n%s", shown)
	}
	out = cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "refund_order", "--args", `{"order_id":"ord_7","amount_cents":2500,"currency":"AUD"}`, "--key", "dev-small-refund", "--wait", "--timeout", "60s")
	if !strings.Contains(out, "refused: tool_frozen at /tool: ") || !strings.Contains(out, "refund_order is frozen for this tenant since") || strings.Contains(out, "incident 42") {
		t.Errorf("a refund while refund_order is frozen:\n%s", out)
	}
	// The unfreeze names the freeze it lifts (its at, from show): one
	// that names another is refused, and the tool stays frozen.
	var snap struct {
		Freezes []struct {
			Tool string `json:"tool"`
			At   string `json:"at"`
		} `json:"freezes"`
	}
	if shown := cli(t, "control", "show", "--api", "http://"+api, "--data-dir", dir, "--user", "u_ops"); json.Unmarshal([]byte(shown), &snap) != nil || len(snap.Freezes) != 1 {
		t.Fatalf("control show, one freeze:\n%s", shown)
	}
	if err := cliErr(t, "control", "unfreeze", "--tool", "refund_order", "--reason", "resolved", "--freeze-at", "2026-01-01T00:00:00Z",
		"--api", "http://"+api, "--data-dir", dir, "--user", "u_ops"); err == nil || !strings.Contains(err.Error(), "freeze_changed") {
		t.Errorf("unfreeze naming another freeze: %v; want refused, freeze_changed", err)
	}
	cli(t, "control", "unfreeze", "--tool", "refund_order", "--reason", "resolved", "--freeze-at", snap.Freezes[0].At,
		"--api", "http://"+api, "--data-dir", dir, "--user", "u_ops")

	// Now the small refund runs at once; an operator compensates it, and
	// the trace ends compensated.
	out = cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "refund_order", "--args", `{"order_id":"ord_7","amount_cents":2500,"currency":"AUD"}`, "--key", "dev-small-refund", "--wait", "--timeout", "60s")
	if !strings.Contains(out, "t_demo/dev-small-refund is succeeded") {
		t.Fatalf("small refund:\n%s", out)
	}
	if got := cli(t, "calls", "compensate", "dev-small-refund", "--reason", "goods returned", "--api", "http://"+api, "--data-dir", dir, "--user", "u_ops"); !strings.Contains(got, "t_demo/dev-small-refund:compensate") {
		t.Errorf("calls compensate: %s", got)
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if code, v := getCall(t, api, "dev-small-refund"); code != 200 || v.State != "compensated" {
			return fmt.Errorf("refund is %q", v.State)
		}
		return nil
	})
	if tr := cli(t, "trace", "dev-small-refund", "--tenant", "t_demo", "--kafka-brokers", kafka); !strings.Contains(tr, "compensated") {
		t.Errorf("trace of the compensated refund:\n%s", tr)
	}

	// A second refund waits for approval across the restart.
	out = cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "refund_order", "--args", `{"order_id":"ord_2048","amount_cents":30000,"currency":"AUD"}`, "--key", "dev-refund-2", "--wait", "--timeout", "60s")
	if !strings.Contains(out, "is approval_pending") {
		t.Fatalf("second refund:\n%s", out)
	}

	// Restart on the same data directory, this time with --pprof: the
	// runtime's profiles are on the API then, and only then. The call
	// index is deleted meanwhile: it is rebuilt from the log (dev-1 is
	// found below with its four events), not left to hold only what
	// comes after.
	wantPprof(t, "http://"+api, false)
	dev.stop()
	if err := os.Remove(filepath.Join(dir, "index.db")); err != nil {
		t.Fatal(err)
	}
	startDev(t, dir, kafka, api, backend, "--pprof")
	wantPprof(t, "http://"+api, true)
	id2 := ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "dev-refund-2"}.ApprovalID()
	if list := cli(t, "approvals", "list", "--api", "http://"+api, "--data-dir", dir); !strings.Contains(list, id2) {
		t.Errorf("after restart the pending approval is gone:\n%s", list)
	}
	approveShown(t, id2, api, dir)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if code, v := getCall(t, api, "dev-refund-2"); code != 200 || v.State != "succeeded" {
			return fmt.Errorf("refund approved after restart is %q", v.State)
		}
		return nil
	})
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if code, v := getCall(t, api, "dev-1"); code != 200 || v.State != "succeeded" || len(v.Events) != 4 {
			return fmt.Errorf("after restart, the index rebuilt: %d %q with %d events; want 200 succeeded with 4", code, v.State, len(v.Events))
		}
		return nil
	})
	trace = cli(t, "trace", "t_demo/dev-2", "--kafka-brokers", kafka)
	if !strings.Contains(trace, "succeeded") {
		t.Errorf("after restart, trace of dev-2 lacks succeeded:\n%s", trace)
	}
	// A retry of dev-2 after the restart: still one effect at the tool.
	resp, err = http.Post("http://"+api+"/v1/calls?wait=30s", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	effects, err = demobackend.ReadJournal(filepath.Join(dir, "effects.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range effects {
		if e.IdempotencyKey == "t_demo/dev-2" {
			n++
		}
	}
	if n != 1 {
		t.Errorf("dev-2 reached the tool %d times across the restart; want 1", n)
	}
}

// The banner says where the profiles are when --pprof serves them, and
// not otherwise.
func TestDevBannerProfiles(t *testing.T) {
	for _, on := range []bool{false, true} {
		var b strings.Builder
		printBanner(&b, banner{api: "127.0.0.1:8080", pprof: on})
		want := "Profiles             http://127.0.0.1:8080/debug/pprof/"
		if got := strings.Contains(b.String(), want); got != on {
			t.Errorf("--pprof %v: banner names the profiles: %v; want %v:\n%s", on, got, on, b.String())
		}
		if !strings.Contains(b.String(), "Credential keys      http://127.0.0.1:8080/.well-known/jwks.json\n") || !strings.Contains(b.String(), "\nTry:\n") {
			t.Errorf("--pprof %v: banner lines out of place:\n%s", on, b.String())
		}
	}
}

// The banner's example commands name what this ledger dev runs on that
// their defaults do not: another --data-dir (quoted for the shell), Kafka
// address, topics or HTTP address. Before, they assumed the defaults, and a
// submit copied from the banner of ledger dev --data-dir elsewhere found no
// dev issuer and was refused.
func TestDevBannerTryCommands(t *testing.T) {
	for _, tc := range []struct {
		name          string
		b             banner
		submit, blast string
	}{
		{"defaults", banner{dataDir: devDataDir, kafka: []string{devKafkaAddr}, api: devHTTPAddr, topics: ledger.Topics{}.WithDefaults()},
			"go run ./cmd/ledger submit --tool get_weather",
			"go run ./cmd/ledger blast-radius --tool get_weather"},
		{"defaults written otherwise", banner{dataDir: ".ledger/", kafka: []string{devKafkaAddr}, api: devHTTPAddr, topics: ledger.Topics{}.WithDefaults()},
			"go run ./cmd/ledger submit --tool get_weather",
			"go run ./cmd/ledger blast-radius --tool get_weather"},
		{"its own", banner{dataDir: "/srv/it's here", kafka: []string{"127.0.0.1:19092"}, api: "127.0.0.1:18080",
			topics: ledger.Topics{Requests: "my.requests", Events: "my.events"}.WithDefaults()},
			`go run ./cmd/ledger submit --kafka-brokers 127.0.0.1:19092 --topic-requests my.requests --topic-events my.events --data-dir '/srv/it'\''s here' --tool get_weather`,
			`go run ./cmd/ledger blast-radius --api http://127.0.0.1:18080 --data-dir '/srv/it'\''s here' --tool get_weather`},
		// A shell set up for a deployment: the commands would read its
		// variables, and reach its Kafka and its ClickHouse.
		{"a deployment's environment", banner{dataDir: devDataDir, kafka: []string{devKafkaAddr}, api: devHTTPAddr, topics: ledger.Topics{}.WithDefaults(),
			env: func(name string) (string, bool) {
				v, ok := map[string]string{"LEDGER_KAFKA_BROKERS": "kafka-1:9092", "LEDGER_TOPIC_EVENTS": "prod.events",
					"LEDGER_CLICKHOUSE_DSN": "clickhouse://ledger@clickhouse:9000/ledger", "LEDGER_API": "https://ledger.example",
					"LEDGER_ASSERTION": "a.b.c", "LEDGER_AGENT_ASSERTION": "d.e.f"}[name]
				return v, ok
			}},
			"LEDGER_AGENT_ASSERTION= go run ./cmd/ledger submit --api '' --kafka-brokers " + devKafkaAddr + " --topic-events toolcalls.events --tool get_weather",
			"go run ./cmd/ledger blast-radius --clickhouse-dsn '' --api http://" + devHTTPAddr + " --assertion '' --tool get_weather"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.b.env == nil {
				tc.b.env = func(string) (string, bool) { return "", false } // whatever this shell holds
			}
			var b strings.Builder
			printBanner(&b, tc.b)
			for _, want := range []string{"\n  " + tc.submit + " ", "\n  " + tc.blast + " "} {
				if !strings.Contains(b.String(), want) {
					t.Errorf("banner lacks %q:\n%s", want, b.String())
				}
			}
		})
	}
}

// ledger dev refuses to listen where another machine could reach it: its
// API answers every tenant's calls without credentials.
func TestDevLoopbackOnly(t *testing.T) {
	for _, args := range [][]string{
		{"--http-addr", "0.0.0.0:0"},
		{"--http-addr", ":0"},
		{"--backend-addr", "192.0.2.1:0"},
		{"--kafka-addr", "[::]:0"},
	} {
		root := newRoot()
		root.SetArgs(append([]string{"dev", "--data-dir", t.TempDir()}, args...))
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		err := root.ExecuteContext(t.Context())
		if err == nil || !strings.Contains(err.Error(), args[0]) || !strings.Contains(err.Error(), "loopback only") {
			t.Errorf("ledger dev %s: %v; want a refusal naming %s", strings.Join(args, " "), err, args[0])
		}
	}
	// Its Kafka is its own, plaintext: a deployment's TLS or SASL
	// settings (a shell set up for one) are refused, not tried on it
	// for 30 s.
	for _, env := range []string{"LEDGER_KAFKA_TLS", "LEDGER_KAFKA_SASL_MECHANISM"} {
		t.Run(env, func(t *testing.T) {
			t.Setenv(env, map[string]string{"LEDGER_KAFKA_TLS": "true", "LEDGER_KAFKA_SASL_MECHANISM": "PLAIN"}[env])
			err := cliErr(t, "dev", "--data-dir", t.TempDir())
			if err == nil || !strings.Contains(err.Error(), "runs its own Kafka, plaintext on loopback") {
				t.Errorf("ledger dev with %s set: %v; want it refused", env, err)
			}
		})
	}
	for _, addr := range []string{"127.0.0.1:1", "[::1]:1", "localhost:1"} {
		if err := loopbackOnly(addr); err != nil {
			t.Errorf("loopbackOnly(%s) = %v; want nil", addr, err)
		}
	}
}

// devIssuerKeys loads the dev issuer in dir (creating it if need be), as
// the identity provider a test's roles trust, and writes its public keys
// to a file of their own, as an operator would configure them; it
// returns the issuer and the file.
func devIssuerKeys(t *testing.T, dir string) (*identity.Issuer, string) {
	t.Helper()
	iss, err := identity.LoadOrCreateIssuer(filepath.Join(dir, devIssuerFile), DevIssuer)
	if err != nil {
		t.Fatal(err)
	}
	jwks := filepath.Join(t.TempDir(), "jwks.json")
	if err := os.WriteFile(jwks, iss.Keys().JWKS(), 0o600); err != nil {
		t.Fatal(err)
	}
	return iss, jwks
}

// devOperations checks ledger dev's /metrics and /readyz after a
// get_weather call succeeded: every role's series, each under its role
// label, in one exposition a scraper accepts (a family served twice, as
// the runtime's would be by each role, is refused by the parser); and
// each role's loop and the dependencies ready.
func devOperations(t *testing.T, api string) {
	t.Helper()
	resp, err := http.Get("http://" + api + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || err != nil {
		t.Fatalf("GET /metrics: %d, %v; want 200 and the text format", resp.StatusCode, err)
	}
	// value is the series of family name whose labels include want, and
	// whether there is one.
	value := func(name string, want map[string]string) (float64, bool) {
		for _, m := range fams[name].GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			match := true
			for k, v := range want {
				match = match && labels[k] == v
			}
			if match {
				return seriesValue(m), true
			}
		}
		return 0, false
	}
	for _, want := range []map[string]string{
		{"role": "intake", "type": "authorized", "tool": "get_weather"},
		{"role": "executor", "type": "succeeded", "tool": "get_weather"},
	} {
		if v, _ := value("ledger_events_total", want); v < 1 {
			t.Errorf("ledger_events_total%v = %v; want at least 1", want, v)
		}
	}
	for _, role := range []string{"intake", "executor", "reconciler"} {
		for _, name := range []string{"ledger_control_staleness_seconds", "ledger_consumer_lag_records"} {
			if _, ok := value(name, map[string]string{"role": role}); !ok {
				t.Errorf("/metrics has no %s of role %s", name, role)
			}
		}
	}
	if v, ok := value("ledger_policy_active", map[string]string{"role": "intake"}); v != 1 || !ok {
		t.Errorf("ledger_policy_active of the intake: %v (%v); want 1", v, ok)
	}
	if _, ok := value("ledger_outcome_unknown_calls", map[string]string{"role": "reconciler"}); !ok {
		t.Errorf("/metrics has no ledger_outcome_unknown_calls of the reconciler")
	}
	if _, ok := value("ledger_approvals_pending", map[string]string{"role": "approvals"}); !ok {
		t.Errorf("/metrics has no ledger_approvals_pending of the approval queue")
	}
	if n := len(fams["go_goroutines"].GetMetric()); n != 1 {
		t.Errorf("go_goroutines has %d series; want the process's one", n)
	}

	resp, err = http.Get("http://" + api + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	var ready struct {
		Ready  bool
		Checks []struct {
			Name string
			OK   bool
		}
	}
	err = json.NewDecoder(resp.Body).Decode(&ready)
	resp.Body.Close()
	// The embedded store is not pinged: it is a file this process holds.
	var names []string
	for _, c := range ready.Checks {
		if c.OK {
			names = append(names, c.Name)
		}
	}
	if got, want := strings.Join(names, ","), "loop_intake,loop_executor,loop_reconciler,kafka,control,policy,identity,approvals_timer"; resp.StatusCode != 200 || err != nil || !ready.Ready || got != want {
		t.Errorf("GET /readyz: %d %+v (%v); want 200, ready, checks passed %s", resp.StatusCode, ready, err, want)
	}
}

// seriesValue is a counter's or a gauge's value.
func seriesValue(m *dto.Metric) float64 {
	if c := m.GetCounter(); c != nil {
		return c.GetValue()
	}
	return m.GetGauge().GetValue()
}
