package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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
	q := pendingRefund(t, "stop-refund")
	stop, stopped := startCommand(t, q.args("approvals", "serve", "--instance-id", "stop-approvals", "--http-addr", q.approvalsAddr)...)
	defer stop()
	shown := q.shown(t)

	// The broker holds the decision's publish; the command is told to
	// stop as it does.
	staged := stopWhilePublishing(t, q.cluster, q.topics.Events, stop, stopped)
	if err := q.approve(t, shown); err != nil {
		t.Errorf("approving as the server is told to stop: %v; want the decision answered", err)
	}
	staged(t)

	st, err := pgstore.Open(t.Context(), pgstore.Config{DSN: q.dsn, SkipMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	rec, err := st.Get(t.Context(), q.key)
	if err != nil || rec.Status != processors.StatusAuthorized || rec.Unlogged() {
		t.Errorf("after the command stopped the call is %s, logged %d of %d (%v); want authorized, its decision logged", rec.Status, rec.LoggedSeq, rec.Seq, err)
	}
}

// approvalQueue is a refund waiting for approval, admitted by an intake
// on an in-process Kafka and a fresh schema of PostgreSQL, for a
// `ledger approvals serve` to be started on (args).
type approvalQueue struct {
	cluster                *kfake.Cluster
	cc                     ledger.ClientConfig
	topics                 ledger.Topics
	dsn, dataDir           string
	backend, approvalsAddr string
	trust                  []string
	key                    ledger.CallKey
}

// pendingRefund submits a refund above the demo policy's threshold under
// key, in tenant t_demo, through an intake, and returns once it waits for
// approval.
func pendingRefund(t *testing.T, key string) *approvalQueue {
	t.Helper()
	cluster, cc, topics, _ := roleKfake(t)
	q := &approvalQueue{cluster: cluster, cc: cc, topics: topics, dsn: freshSchemaDSN(t), dataDir: t.TempDir(),
		key: ledger.CallKey{TenantID: "t_demo", IdempotencyKey: key}}
	_, jwks := devIssuerKeys(t, q.dataDir)
	addrs := freeAddrs(t, 2)
	q.backend, q.approvalsAddr = addrs[0], addrs[1]
	startDemoBackend(t, q.backend)
	q.trust = []string{"--issuer", DevIssuer, "--jwks-file", jwks}
	runCommand(t, append(roleArgs(cc, topics), append([]string{"intake", "--data-dir", t.TempDir(), "--instance-id", key + "-intake", "--crdb-dsn", q.dsn}, q.trust...)...)...)
	out := cli(t, append(roleArgs(cc, topics), "submit", "--data-dir", q.dataDir, "--tool", "refund_order",
		"--args", `{"order_id":"ord_7","amount_cents":45000,"currency":"AUD"}`, "--tenant", "t_demo", "--key", key,
		"--wait", "--timeout", "60s")...)
	if !strings.Contains(out, q.key.String()+" is approval_pending") {
		t.Fatalf("refund above the demo threshold:\n%s", out)
	}
	return q
}

// args is a role's command line on q's Kafka and store, trusting the dev
// issuer's assertions, its resource versions read at q's backend.
func (q *approvalQueue) args(more ...string) []string {
	return append(roleArgs(q.cc, q.topics), append(more, append([]string{"--crdb-dsn", q.dsn, "--tools-base-url", "http://" + q.backend}, q.trust...)...)...)
}

// shownApproval is what `ledger approvals show` prints of an approval.
type shownApproval struct {
	Hash string `json:"arguments_hash"`
}

// shown waits for the approvals server to show q's approval, as u_boss.
func (q *approvalQueue) shown(t *testing.T) shownApproval {
	t.Helper()
	var shown shownApproval
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		out, err := cliOut(t.Context(), "approvals", "show", q.key.ApprovalID(), "--api", "http://"+q.approvalsAddr, "--data-dir", q.dataDir, "--user", "u_boss")
		if err != nil {
			return err
		}
		return json.Unmarshal([]byte(out), &shown)
	})
	return shown
}

// approve approves q's approval as u_boss, bound to the hash shown.
func (q *approvalQueue) approve(t *testing.T, shown shownApproval) error {
	_, err := cliOut(t.Context(), "approvals", "approve", q.key.ApprovalID(), "--api", "http://"+q.approvalsAddr, "--data-dir", q.dataDir, "--user", "u_boss", "--hash", shown.Hash)
	return err
}

// TestApprovalsServeOpsEndpoints: ledger approvals serve --metrics-addr
// serves the approval queue's operational endpoint, as the other roles
// do: /readyz ready once the store and the expiry timer work, and
// unready, naming the timer, while its rounds fail (the store's table
// gone from under it), but not for Kafka, without which approvals are
// still decided; /metrics with the approvals pending and the
// decisions and answers counted; its profiles with --pprof; no /loops,
// as it runs no loop.
func TestApprovalsServeOpsEndpoints(t *testing.T) {
	q := pendingRefund(t, "ops-refund")
	ops := freeAddr(t)
	exited := runCommand(t, q.args("approvals", "serve", "--instance-id", "ops-approvals", "--http-addr", q.approvalsAddr,
		"--metrics-addr", ops, "--pprof", "--timer-every", "100ms")...)
	readyz := "http://" + ops + "/readyz"
	ready := func(want bool) func() error {
		return func() error {
			exited()
			code, rb, err := getReady(readyz)
			if err != nil {
				return err
			}
			checks := map[string]bool{}
			for _, c := range rb.Checks {
				checks[c.Name] = c.OK
			}
			if rb.Ready != want || (code == http.StatusOK) != want || len(checks) != 2 || !checks["store"] || checks["approvals_timer"] != want {
				return fmt.Errorf("readyz %d %+v; want ready %v, store ok and approvals_timer ok=%v", code, rb, want, want)
			}
			return nil
		}
	}
	ledgertest.WaitFor(t, 30*time.Second, ready(true))

	metricsHave := func(want ...string) func() error {
		return func() error {
			resp, err := http.Get("http://" + ops + "/metrics")
			if err != nil {
				return err
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			for _, w := range want {
				if !strings.Contains(string(b), w) {
					return fmt.Errorf("metrics lack %q", w)
				}
			}
			return nil
		}
	}
	ledgertest.WaitFor(t, 30*time.Second, metricsHave(
		`ledger_approvals_pending{role="approvals"} 1`,
		`ledger_control_staleness_seconds{role="approvals"} 0.`,
		"process_resident_memory_bytes",
	))
	if err := q.approve(t, q.shown(t)); err != nil {
		t.Fatal(err)
	}
	ledgertest.WaitFor(t, 30*time.Second, metricsHave(
		`ledger_approvals_pending{role="approvals"} 0`,
		`ledger_approval_decisions_total{decision="approved",role="approvals"} 1`,
		`ledger_approval_requests_total{action="approve",code="200",role="approvals"} 1`,
		`ledger_approval_requests_total{action="get",code="200",role="approvals"}`,
	))
	if resp, err := http.Get("http://" + ops + loopsPath); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /loops: %v %v; want 404, the approval queue runs no loop", resp, err)
	} else {
		resp.Body.Close()
	}
	wantPprof(t, "http://"+ops, true)

	// The timer's rounds fail while the records' table is gone; the
	// database still answers its pings.
	conn, err := pgx.Connect(t.Context(), q.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	if _, err := conn.Exec(t.Context(), "ALTER TABLE execution_records RENAME TO execution_records_away"); err != nil {
		t.Fatal(err)
	}
	ledgertest.WaitFor(t, 30*time.Second, ready(false))
	if _, err := conn.Exec(t.Context(), "ALTER TABLE execution_records_away RENAME TO execution_records"); err != nil {
		t.Fatal(err)
	}
	ledgertest.WaitFor(t, 30*time.Second, ready(true))
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
