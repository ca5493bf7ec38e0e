package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
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

	stop, stopped := startCommand(t, args(append([]string{"approvals", "serve", "--instance-id", "stop-approvals", "--http-addr", approvalsAddr,
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
	staged := stopWhilePublishing(t, cluster, topics.Events, stop, stopped)
	if _, err := cliOut(t.Context(), "approvals", "approve", id, "--api", "http://"+approvalsAddr, "--data-dir", dataDir, "--user", "u_boss", "--hash", shown.Hash); err != nil {
		t.Errorf("approving as the server is told to stop: %v; want the decision answered", err)
	}
	staged(t)

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

// ledger reconciler's operators' API, told to stop while it publishes a
// freeze, finishes it first: the operator is answered, and the freeze is
// on the control topic. Before, the server was closed at once, and the
// publisher with it, cutting the freeze between its check and its
// publish: the operator saw a broken connection, and the freeze was
// perhaps never written.
func TestReconcilerAPIFinishesAFreezeWhenStopped(t *testing.T) {
	cluster, cc, topics, admin := roleKfake(t)
	dataDir := t.TempDir()
	_, jwks := devIssuerKeys(t, dataDir)
	addr := freeAddrs(t, 1)[0]
	stop, stopped := startCommand(t, append(roleArgs(cc, topics), "reconciler", "--crdb-dsn", freshSchemaDSN(t), "--data-dir", t.TempDir(),
		"--instance-id", "stop-reconciler", "--tools-base-url", "http://127.0.0.1:1", "--http-addr", addr,
		"--issuer", DevIssuer, "--jwks-file", jwks)...)
	defer stop()
	api := []string{"--api", "http://" + addr, "--data-dir", dataDir, "--user", "u_ops"}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		_, err := cliOut(t.Context(), append([]string{"control", "show"}, api...)...)
		return err
	})

	// The broker holds the freeze's publish; the command is told to stop
	// as it does.
	staged := stopWhilePublishing(t, cluster, topics.Control, stop, stopped)
	if _, err := cliOut(t.Context(), append([]string{"control", "freeze", "--tool", "refund_order", "--reason", "incident 7"}, api...)...); err != nil {
		t.Errorf("freezing as the server is told to stop: %v; want the freeze answered", err)
	}
	staged(t)
	if !controlHolds(t, admin, topics.Control, "refund_order") {
		t.Errorf("the control topic has no freeze of refund_order after the command stopped; want the one answered")
	}
}

// controlHolds reports whether topic, the control topic, holds a freeze of
// tool.
func controlHolds(t *testing.T, admin *kgo.Client, topic, tool string) bool {
	t.Helper()
	cl, err := ledger.NewClient(ledger.ClientConfig{Brokers: admin.OptValue(kgo.SeedBrokers).([]string)},
		kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		found := false
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
			var a ledger.ControlAction
			if json.Unmarshal(r.Value, &a) == nil && a.Kind == "freeze" && a.Tool == tool {
				found = true
			}
		})
		if found {
			return true
		}
	}
	return false
}

// stopWhilePublishing has cluster hold every produce to topic for a
// second, and calls stop as it holds the first (the test then reads the
// answer of the request that published); other produces (a loop's) pass. staged, called once that answer is in, fails
// the test unless the stop was staged so, waits for the command's end
// (stopped), and fails the test if the command ended before the publish
// it was told to stop during was let through: an in-process command's
// servers outlive its end, and only that says the process would have
// exited under them.
func stopWhilePublishing(t *testing.T, cluster *kfake.Cluster, topic string, stop func() error, stopped <-chan struct{}) (staged func(t *testing.T)) {
	t.Helper()
	// A produce names its topics by id from Produce v13 on.
	cl, err := ledger.NewClient(ledger.ClientConfig{Brokers: cluster.ListenAddrs()})
	if err != nil {
		t.Fatal(err)
	}
	details, err := kadm.NewClient(cl).ListTopics(t.Context(), topic)
	cl.Close()
	if err != nil || details[topic].Err != nil {
		t.Fatalf("topic %s: %v %v", topic, err, details[topic].Err)
	}
	id := details[topic].ID
	var (
		once     sync.Once
		released atomic.Int64 // when the first held produce was let through
		ended    atomic.Int64 // when the command ended
	)
	publishing := make(chan struct{})
	cluster.ControlKey(int16(kmsg.Produce), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		if !slices.ContainsFunc(kreq.(*kmsg.ProduceRequest).Topics, func(pt kmsg.ProduceRequestTopic) bool { return pt.Topic == topic || pt.TopicID == id }) {
			return nil, nil, false
		}
		first := false
		once.Do(func() { close(publishing); first = true })
		// Held without holding the cluster's other connections (a
		// loop's, a group's leave), as a slow broker would.
		cluster.SleepControl(func() { time.Sleep(time.Second) })
		if first {
			released.Store(time.Now().UnixNano())
		}
		return nil, nil, false
	})
	go func() {
		<-publishing
		_ = stop()
	}()
	go func() {
		<-stopped
		ended.Store(time.Now().UnixNano())
	}()
	return func(t *testing.T) {
		t.Helper()
		select {
		case <-publishing:
		default:
			t.Fatal("nothing was published: the stop was not staged")
		}
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		<-stopped
		for ended.Load() == 0 {
			time.Sleep(time.Millisecond)
		}
		if r := released.Load(); r == 0 || ended.Load() < r {
			t.Errorf("the command ended %s before the publish it was told to stop during was let through; want it to wait for that", time.Duration(r-ended.Load()))
		}
	}
}
