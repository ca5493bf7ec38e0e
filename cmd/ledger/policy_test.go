package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/projections/console"
)

// writePolicy writes dir/name/policy.cedar (dir itself when name is "").
func writePolicy(t *testing.T, dir, name, src string) {
	t.Helper()
	d := filepath.Join(dir, name)
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(d, ".policy.cedar.tmp")
	if err := os.WriteFile(tmp, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(d, "policy.cedar")); err != nil {
		t.Fatal(err)
	}
}

const (
	permitWeather = `@id("weather") permit (principal, action == Action::"tool::get_weather", resource);`
	forbidAll     = `@id("lockdown") forbid (principal, action, resource);`
	brokenPolicy  = `permit (principal, action`
)

// platformOperator mints a platform operator's assertion with the dev
// issuer of dataDir.
func platformOperator(t *testing.T, dataDir string) string {
	t.Helper()
	iss, err := devIssuer(dataDir)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := iss.Mint(identity.Identity{Tenant: "*", User: "u_ops", Agent: "test", Roles: []string{"operator"}}, identity.ApproverAudience, 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// activatePolicy activates the version labelled label through the
// control API at api, as an operator would.
func activatePolicy(t *testing.T, api, dataDir, label string) {
	t.Helper()
	cli(t, "control", "activate-policy", "--api", "http://"+api, "--data-dir", dataDir, "--tenant", "*", "--user", "u_ops",
		"--policy", label, "--reason", "test")
}

// settledEvent submits a get_weather call through dev's Kafka and
// returns its last event.
func settledEvent(t *testing.T, kafka, dataDir, key string) (typ, reason, version string) {
	t.Helper()
	out := cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dataDir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`,
		"--tenant", "t_demo", "--key", key, "--retry-later", "0", "--wait", "--timeout", "60s", "--json")
	var ev struct {
		Type          string `json:"type"`
		Reason        string `json:"reason"`
		PolicyVersion string `json:"policy_version"`
	}
	if err := json.Unmarshal([]byte(out[strings.LastIndex(out, "\n{")+1:]), &ev); err != nil {
		t.Fatalf("submit %s: %v\n%s", key, err, out)
	}
	return ev.Type, ev.Reason, ev.PolicyVersion
}

// TestDevPolicyActivation: in `ledger dev` with a watched --policy-dir, a
// version activated on the control topic decides the calls and stays in
// force across the directory watcher's polls; one that does not load
// denies every call and shows on /v1/health until it is fixed, when the
// next retry loads it.
func TestDevPolicyActivation(t *testing.T) {
	dir, local, versions := t.TempDir(), t.TempDir(), t.TempDir()
	writePolicy(t, local, "", permitWeather)
	writePolicy(t, versions, "lockdown", forbidAll)
	writePolicy(t, versions, "v3", brokenPolicy)
	addrs := freeAddrs(t, 3)
	kafka, api, backend := addrs[0], addrs[1], addrs[2]
	startDev(t, dir, kafka, api, backend, "--policy-dir", local, "--policy-versions-dir", versions)
	tok := platformOperator(t, dir)
	health := func() (console.Health, error) {
		var h console.Health
		req, _ := http.NewRequest(http.MethodGet, "http://"+api+"/v1/health", nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return h, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return h, fmt.Errorf("GET /v1/health: %s", resp.Status)
		}
		return h, json.NewDecoder(resp.Body).Decode(&h)
	}
	policyIs := func(label, problem string) func() error {
		return func() error {
			h, err := health()
			if err != nil {
				return err
			}
			if !strings.HasPrefix(h.Policy, label) || !strings.Contains(h.PolicyError, problem) || (problem == "") != (h.PolicyError == "") {
				return fmt.Errorf("health policy %q, policy_error %q; want %s…, an error naming %q", h.Policy, h.PolicyError, label, problem)
			}
			return nil
		}
	}

	if err := policyIs("local@", "")(); err != nil {
		t.Fatal(err)
	}
	if typ, _, v := settledEvent(t, kafka, dir, "pol-1"); typ != "succeeded" {
		t.Errorf("under the directory's set: %s (%s); want succeeded", typ, v)
	}

	activatePolicy(t, api, dir, "lockdown")
	ledgertest.WaitFor(t, 10*time.Second, policyIs("lockdown@", ""))
	// The watcher polls --policy-dir every 2 s: the activation must
	// outlast a few of its polls.
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		if err := policyIs("lockdown@", "")(); err != nil {
			t.Fatalf("with --policy-dir watched beside the activation: %v", err)
		}
	}
	if typ, reason, v := settledEvent(t, kafka, dir, "pol-2"); typ != "denied" || !strings.HasPrefix(v, "lockdown@") {
		t.Errorf("under the activated lockdown: %s (%s, %s); want denied by lockdown@…", typ, reason, v)
	}

	// A version that does not load: every call is denied, and health
	// says why, for as long as it lasts.
	activatePolicy(t, api, dir, "v3")
	ledgertest.WaitFor(t, 10*time.Second, policyIs("", `"v3"`))
	if typ, reason, _ := settledEvent(t, kafka, dir, "pol-3"); typ != "denied" || reason != "policy_unavailable" {
		t.Errorf("while the activated version does not load: %s (%s); want denied, policy_unavailable", typ, reason)
	}
	// submit --wait, as an agent, sends a call refused for now again
	// once the refusal's wait (1 s) has passed: it goes through once the
	// version loads.
	var again ledgertest.LogBuffer
	sent := make(chan error, 1)
	go func() {
		root := newRoot()
		root.SetArgs([]string{"submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`,
			"--tenant", "t_demo", "--key", "pol-3-again", "--retry-later", "30", "--wait", "--timeout", "60s"})
		root.SetOut(&again)
		root.SetErr(&again)
		sent <- root.ExecuteContext(t.Context())
	}()
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if !strings.Contains(again.String(), "refused for now: policy_unavailable; sending again in 1s (1 of 30)") {
			return fmt.Errorf("submit --wait has not been refused for now yet:\n%s", again.String())
		}
		return nil
	})
	writePolicy(t, versions, "v3", permitWeather)
	if err := <-sent; err != nil || !strings.Contains(again.String(), "t_demo/pol-3-again is succeeded") {
		t.Errorf("submit --wait --retry-later 30, refused for now until the version loads: %v; want it sent again until it succeeds:\n%s", err, again.String())
	}
	ledgertest.WaitFor(t, 10*time.Second, policyIs("v3@", ""))
	if typ, _, v := settledEvent(t, kafka, dir, "pol-4"); typ != "succeeded" || !strings.HasPrefix(v, "v3@") {
		t.Errorf("once the activated version loads: %s (%s); want succeeded under v3@…", typ, v)
	}

	// Pinned: --pin-from sends the hash of the copy reviewed, and an
	// instance whose files differ decides nothing with them.
	out := cli(t, "control", "activate-policy", "--api", "http://"+api, "--data-dir", dir, "--tenant", "*", "--user", "u_ops",
		"--policy", "lockdown", "--pin-from", versions, "--reason", "pinned")
	lockdown, err := policy.LoadDir(filepath.Join(versions, "lockdown"), "lockdown")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, `"policy_hash": "`+lockdown.Hash()+`"`) {
		t.Errorf("activate-policy --pin-from printed:\n%s\nwant the action pinning %s", out, lockdown.Hash())
	}
	ledgertest.WaitFor(t, 10*time.Second, policyIs("lockdown@", ""))
	v3, err := policy.LoadDir(filepath.Join(versions, "v3"), "v3")
	if err != nil {
		t.Fatal(err)
	}
	v3Hash := v3.Hash()
	cli(t, "control", "activate-policy", "--api", "http://"+api, "--data-dir", dir, "--tenant", "*", "--user", "u_ops",
		"--policy", "lockdown", "--policy-hash", v3Hash, "--reason", "pinned to another version's content")
	ledgertest.WaitFor(t, 10*time.Second, policyIs("", v3Hash))
	if typ, reason, _ := settledEvent(t, kafka, dir, "pol-5"); typ != "denied" || reason != "policy_unavailable" {
		t.Errorf("while the activated version's files are not the content pinned: %s (%s); want denied, policy_unavailable", typ, reason)
	}
	if err := cliErr(t, "control", "activate-policy", "--api", "http://"+api, "--data-dir", dir, "--tenant", "*", "--user", "u_ops",
		"--policy", "lockdown", "--pin-from", versions, "--policy-hash", v3Hash, "--reason", "x"); err == nil || !strings.Contains(err.Error(), lockdown.Hash()) {
		t.Errorf("--policy-hash other than --pin-from's: %v; want refused, naming the directory's hash", err)
	}
}

// roleCluster is an in-process Kafka with the ledger's topics, and a
// client to it, for roles under test.
func roleCluster(t *testing.T) (ledger.ClientConfig, ledger.Topics, *kgo.Client) {
	t.Helper()
	_, cc, topics, admin := roleKfake(t)
	return cc, topics, admin
}

// roleKfake is roleCluster with the broker, for a test that injects its
// faults (ControlKey).
func roleKfake(t *testing.T) (*kfake.Cluster, ledger.ClientConfig, ledger.Topics, *kgo.Client) {
	t.Helper()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	cc := ledger.ClientConfig{Brokers: cluster.ListenAddrs()}
	topics := ledger.Topics{Requests: "pol.requests", Events: "pol.events", Control: "pol.control", DLQ: "pol.dlq"}
	admin, err := ledger.NewClient(cc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	if err := ledger.EnsureTopics(t.Context(), admin, ledger.TopicConfig{Topics: topics, Partitions: 3}); err != nil {
		t.Fatal(err)
	}
	return cluster, cc, topics, admin
}

// roleArgs are the global flags of a role on cc and topics.
func roleArgs(cc ledger.ClientConfig, topics ledger.Topics) []string {
	return []string{"--log-level", "error", "--kafka-brokers", strings.Join(cc.Brokers, ","),
		"--topic-requests", topics.Requests, "--topic-events", topics.Events,
		"--topic-control", topics.Control, "--topic-dlq", topics.DLQ}
}

// produceActivation writes a platform operator's activation of label on
// the control topic, as the control API does.
func produceActivation(t *testing.T, admin *kgo.Client, topic, label string) {
	t.Helper()
	a := ledger.ControlAction{V: control.ActionVersion, Kind: control.KindActivatePolicy, Subject: control.PolicySubject,
		Policy: label, By: "u_ops", ByTenant: "*", Reason: "test", At: time.Now()}
	v, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	if err := admin.ProduceSync(t.Context(), &kgo.Record{Topic: topic, Key: []byte(control.PolicySubject), Value: v}).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// policyMetric is the ledger_policy_active series the role serves on
// addr: its version label and value.
func policyMetric(addr string) (string, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	for line := range strings.Lines(string(b)) {
		if strings.HasPrefix(line, "ledger_policy_active{") {
			return strings.TrimSpace(line), nil
		}
	}
	return "", errors.New("no ledger_policy_active series")
}

// rolePolicyIs checks the role on addr decides with a version labelled
// label (none when label is ""), and that its /readyz policy check says
// so.
func rolePolicyIs(addr, label string) func() error {
	return func() error {
		m, err := policyMetric(addr)
		if err != nil {
			return err
		}
		want := `version="` + label + `@`
		if label == "" {
			want = `version=""} 0`
		}
		if !strings.Contains(m, want) {
			return fmt.Errorf("%s; want %s", m, want)
		}
		_, rb, err := getReady("http://" + addr + "/readyz")
		if err != nil {
			return err
		}
		for _, c := range rb.Checks {
			if c.Name == "policy" {
				if c.OK != (label != "") {
					return fmt.Errorf("readyz policy check ok=%v (%s) with %s", c.OK, c.Error, m)
				}
				return nil
			}
		}
		return fmt.Errorf("readyz checks %+v lack policy", rb.Checks)
	}
}

// TestRolePolicyActivation runs `ledger executor` with a watched
// --policy-dir and a --policy-versions-dir: a version activated on the
// control topic is in force and stays so across the watcher's polls; one
// that does not load is reported by /readyz (the policy check) and by
// ledger_policy_active until a retry loads it.
func TestRolePolicyActivation(t *testing.T) {
	cc, topics, admin := roleCluster(t)
	local, versions := t.TempDir(), t.TempDir()
	writePolicy(t, local, "", permitWeather)
	writePolicy(t, versions, "lockdown", forbidAll)
	writePolicy(t, versions, "v3", brokenPolicy)
	addr := freeAddr(t)
	exited := runCommand(t, append(roleArgs(cc, topics),
		"executor", "--crdb-dsn", freshSchemaDSN(t), "--data-dir", t.TempDir(), "--instance-id", "policy-test",
		"--metrics-addr", addr, "--tools-base-url", "http://127.0.0.1:1",
		"--policy-dir", local, "--policy-versions-dir", versions)...)
	wait := func(label string) {
		t.Helper()
		ledgertest.WaitFor(t, 30*time.Second, func() error { exited(); return rolePolicyIs(addr, label)() })
	}
	wait("local")

	produceActivation(t, admin, topics.Control, "lockdown")
	wait("lockdown")
	// The watcher polls --policy-dir every 2 s: the activation must
	// outlast a few of its polls.
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		if err := rolePolicyIs(addr, "lockdown")(); err != nil {
			t.Fatalf("with --policy-dir watched beside the activation: %v", err)
		}
	}

	produceActivation(t, admin, topics.Control, "v3")
	wait("")
	_, rb, err := getReady("http://" + addr + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range rb.Checks {
		if c.Name == "policy" && !strings.Contains(c.Error, `"v3"`) {
			t.Errorf("readyz policy check error %q; want the activated version named", c.Error)
		}
	}
	writePolicy(t, versions, "v3", permitWeather)
	wait("v3")
}

// TestExecutorRedecidesWithoutPolicyDir runs the roles as separate
// processes, none given --policy-dir: the intake decides with the
// built-in demo policies, and so must the executor, which decides an
// approved call again right before it runs. A refund waits for approval;
// meanwhile an operator activates a version that forbids everything; once
// the executor decides with it, the approved refund is denied and never
// reaches the tool. (An executor with no policies ran it.)
func TestExecutorRedecidesWithoutPolicyDir(t *testing.T) {
	cc, topics, admin := roleCluster(t)
	dsn, dataDir, versions := freshSchemaDSN(t), t.TempDir(), t.TempDir()
	writePolicy(t, versions, "lockdown", forbidAll)
	_, jwks := devIssuerKeys(t, dataDir)
	addrs := freeAddrs(t, 3)
	backend, approvalsAddr, execOps := addrs[0], addrs[1], addrs[2]
	startDemoBackend(t, backend)
	trust := []string{"--issuer", DevIssuer, "--jwks-file", jwks}
	role := func(args ...string) func() {
		return runCommand(t, append(roleArgs(cc, topics), append(args, "--crdb-dsn", dsn)...)...)
	}
	intakeExited := role(append([]string{"intake", "--data-dir", t.TempDir(), "--instance-id", "pol-intake", "--policy-versions-dir", versions}, trust...)...)
	execExited := role("executor", "--data-dir", t.TempDir(), "--instance-id", "pol-executor", "--policy-versions-dir", versions,
		"--tools-base-url", "http://"+backend, "--metrics-addr", execOps)
	approvalsExited := role(append([]string{"approvals", "serve", "--instance-id", "pol-approvals", "--http-addr", approvalsAddr,
		"--tools-base-url", "http://" + backend}, trust...)...)
	exited := func() { intakeExited(); execExited(); approvalsExited() }
	ledgertest.WaitFor(t, 30*time.Second, func() error { exited(); return rolePolicyIs(execOps, "demo")() })

	out := cli(t, append(roleArgs(cc, topics), "submit", "--data-dir", dataDir, "--tool", "refund_order",
		"--args", `{"order_id":"ord_7","amount_cents":45000,"currency":"AUD"}`, "--tenant", "t_demo", "--key", "pol-refund",
		"--wait", "--timeout", "60s")...)
	if !strings.Contains(out, "t_demo/pol-refund is approval_pending") {
		t.Fatalf("refund above the demo threshold:\n%s", out)
	}
	produceActivation(t, admin, topics.Control, "lockdown")
	ledgertest.WaitFor(t, 30*time.Second, func() error { exited(); return rolePolicyIs(execOps, "lockdown")() })

	id := ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "pol-refund"}.ApprovalID()
	approveShown(t, id, approvalsAddr, dataDir)
	var last ledger.Event
	ledgertest.WaitFor(t, 60*time.Second, func() error {
		exited()
		fetched, err := ledger.ReadCall(t.Context(), cc, topics.Events, ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "pol-refund"})
		if err != nil {
			return err
		}
		var seen []string
		for _, e := range fetched {
			seen = append(seen, string(e.Type))
		}
		if len(seen) == 0 || !slices.Contains([]string{"denied", "succeeded", "failed", "outcome_unknown"}, seen[len(seen)-1]) {
			return fmt.Errorf("refund events %v; want it settled", seen)
		}
		last = fetched[len(fetched)-1]
		return nil
	})
	if last.Type != "denied" || last.Reason != "denied_by_policy" || !strings.HasPrefix(last.PolicyVersion, "lockdown@") {
		t.Errorf("the approved refund ended %s (%s, %s); want denied_by_policy by lockdown@…", last.Type, last.Reason, last.PolicyVersion)
	}
	resp, err := http.Get("http://" + backend + "/effects")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.Contains(string(b), "pol-refund") {
		t.Errorf("the demo backend applied the refund the activated version forbids: %s", b)
	}
}

// TestDevPolicyTimeoutFlags: --policy-timeout bounds a decision and
// --policy-retry-after is the wait the refusal of an undecided call
// names; a negative budget or wait is refused at start.
func TestDevPolicyTimeoutFlags(t *testing.T) {
	dir := t.TempDir()
	addrs := freeAddrs(t, 3)
	kafka, api, backend := addrs[0], addrs[1], addrs[2]
	// No decision finishes within a nanosecond.
	startDev(t, dir, kafka, api, backend, "--policy-timeout", "1ns", "--policy-retry-after", "7s")
	type refusal struct {
		EventID      string `json:"event_id"`
		Type         string `json:"type"`
		Reason       string `json:"reason"`
		RetryAfterMS int64  `json:"retry_after_ms"`
	}
	submit := func() refusal {
		out := cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`,
			"--tenant", "t_demo", "--key", "pol-timeout", "--call-id", "pol-call", "--retry-later", "0", "--wait", "--timeout", "60s", "--json")
		var ev refusal
		if err := json.Unmarshal([]byte(out[strings.LastIndex(out, "\n{")+1:]), &ev); err != nil {
			t.Fatalf("submit: %v\n%s", err, out)
		}
		if ev.Type != "denied" || ev.Reason != "policy_timeout" || ev.RetryAfterMS != 7000 {
			t.Errorf("the call's event: %+v; want denied, policy_timeout, retry after 7000 ms", ev)
		}
		return ev
	}
	// The same envelope again (same key, same call id): its answer is a
	// refusal of its own, not the first one's, already in the log.
	if first, again := submit(), submit(); first.EventID == again.EventID {
		t.Errorf("the second submission ended on the first one's refusal %s", first.EventID)
	}
	// A wait that outlasts --timeout is not waited out: the refusal
	// ends submit --wait at once, and says so.
	out := cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`,
		"--tenant", "t_demo", "--key", "pol-timeout-2", "--retry-later", "3", "--wait", "--timeout", "6s")
	if want := "the ledger asks for a retry after 7s; sent 1 time(s)"; !strings.Contains(out, want) || strings.Contains(out, "sending again") {
		t.Errorf("submit --wait --timeout 6s, refused for now for 7 s: want %q and nothing sent again:\n%s", want, out)
	}
	if err := cliErr(t, "submit", "--kafka-brokers", kafka, "--tool", "get_weather", "--retry-later", "-1", "--wait"); err == nil || !strings.Contains(err.Error(), "--retry-later -1: must not be negative") {
		t.Errorf("submit --retry-later -1: %v; want it refused, naming the flag", err)
	}

	for _, flag := range []string{"--policy-retry-after", "--policy-timeout"} {
		root := newRoot()
		addrs := freeAddrs(t, 3)
		root.SetArgs([]string{"dev", "--data-dir", t.TempDir(), "--kafka-addr", addrs[0], "--http-addr", addrs[1], "--backend-addr", addrs[2], flag, "-1s"})
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		err := root.ExecuteContext(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), flag+" -1s: must not be negative") {
			t.Errorf("dev %s -1s: %v; want it refused, naming the flag", flag, err)
		}
	}
}
