package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
)

// ledger approvals serve, told to stop while it publishes a decision,
// finishes it first: the approver is answered, and the decision's events
// are in the log and marked so, before the command returns. Before, the
// server was closed at once and the command returned, cutting the
// publish and its mark: the approver saw a broken connection, and the
// decision waited for the executors' unlogged sweep, 10 s or more,
// longer than a short approval's window.
func TestApprovalsServeFinishesADecisionWhenStopped(t *testing.T) {
	cluster, cc, topics, _ := roleKfake(t)
	dsn, dataDir := freshSchemaDSN(t), t.TempDir()
	_, jwks := devIssuerKeys(t, dataDir)
	addrs := freeAddrs(t, 2)
	backend, approvalsAddr := addrs[0], addrs[1]
	startDemoBackend(t, backend)
	trust := []string{"--issuer", DevIssuer, "--jwks-file", jwks}
	args := func(more ...string) []string {
		return append(roleArgs(cc, topics), append(more, "--crdb-dsn", dsn)...)
	}
	runCommand(t, args(append([]string{"intake", "--data-dir", t.TempDir(), "--instance-id", "stop-intake"}, trust...)...)...)
	out := cli(t, append(roleArgs(cc, topics), "submit", "--data-dir", dataDir, "--tool", "refund_order",
		"--args", `{"order_id":"ord_7","amount_cents":45000,"currency":"AUD"}`, "--tenant", "t_demo", "--key", "stop-refund",
		"--wait", "--timeout", "60s")...)
	if !strings.Contains(out, "t_demo/stop-refund is approval_pending") {
		t.Fatalf("refund above the demo threshold:\n%s", out)
	}

	stop, _ := startCommand(t, args(append([]string{"approvals", "serve", "--instance-id", "stop-approvals", "--http-addr", approvalsAddr,
		"--tools-base-url", "http://" + backend}, trust...)...)...)
	defer stop()
	key := ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "stop-refund"}
	id := key.ApprovalID()
	var shown struct {
		Hash string `json:"arguments_hash"`
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		out, err := cliOut(t.Context(), "approvals", "show", id, "--api", "http://"+approvalsAddr, "--data-dir", dataDir, "--user", "u_boss")
		if err != nil {
			return err
		}
		return json.Unmarshal([]byte(out), &shown)
	})

	// The broker holds the decision's publish; the command is told to
	// stop as it does.
	var (
		armed atomic.Bool
		once  sync.Once
	)
	publishing := make(chan struct{})
	cluster.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		if armed.Load() {
			once.Do(func() { close(publishing) })
			time.Sleep(500 * time.Millisecond)
		}
		return nil, nil, false
	})
	armed.Store(true)
	go func() {
		<-publishing
		_ = stop() // the test reads its answer below
	}()
	if _, err := cliOut(t.Context(), "approvals", "approve", id, "--api", "http://"+approvalsAddr, "--data-dir", dataDir, "--user", "u_boss", "--hash", shown.Hash); err != nil {
		t.Errorf("approving as the server is told to stop: %v; want the decision answered", err)
	}
	select {
	case <-publishing:
	default:
		t.Fatal("the decision was never published: the stop was not staged")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	st, err := pgstore.Open(t.Context(), pgstore.Config{DSN: dsn, SkipMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	rec, err := st.Get(t.Context(), key)
	if err != nil || rec.Status != processors.StatusAuthorized || rec.Unlogged() {
		t.Errorf("after the command stopped the call is %s, logged %d of %d (%v); want authorized, its decision logged", rec.Status, rec.LoggedSeq, rec.Seq, err)
	}
}

// cliOut runs a ledger subcommand and returns what it printed, and its
// error, for a test that waits for a command to succeed or expects it to
// fail.
func cliOut(ctx context.Context, args ...string) (string, error) {
	var out bytes.Buffer
	root := newRoot()
	root.SetArgs(args)
	root.SetOut(&out)
	root.SetErr(io.Discard)
	err := root.ExecuteContext(ctx)
	return out.String(), err
}
