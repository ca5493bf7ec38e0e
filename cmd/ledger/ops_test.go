package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

type readyBody struct {
	Ready  bool `json:"ready"`
	Checks []struct {
		Name  string `json:"name"`
		OK    bool   `json:"ok"`
		Error string `json:"error"`
	} `json:"checks"`
}

func getReady(url string) (int, readyBody, error) {
	var rb readyBody
	resp, err := http.Get(url)
	if err != nil {
		return 0, rb, err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&rb); err != nil {
		return resp.StatusCode, rb, fmt.Errorf("readyz body: %w", err)
	}
	return resp.StatusCode, rb, nil
}

// TestExecutorOpsEndpoints runs `ledger executor --metrics-addr` on an
// in-process Kafka and PostgreSQL and checks its operational endpoint:
// /readyz turns ready once its loop, Kafka, the store and its copy of the
// control topic answer, /metrics serves the executor's series (its
// consumer group's lag and its control copy's staleness among them),
// /readyz turns unready, naming the control topic, while the executor
// cannot read an action on it, and unready, naming Kafka, when the
// cluster goes away.
func TestExecutorOpsEndpoints(t *testing.T) {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			cluster.Close()
		}
	})
	cc := ledger.ClientConfig{Brokers: cluster.ListenAddrs()}
	topics := ledger.Topics{Requests: "ops.requests", Events: "ops.events", Control: "ops.control", DLQ: "ops.dlq"}
	admin, err := ledger.NewClient(cc)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if err := ledger.EnsureTopics(t.Context(), admin, ledger.TopicConfig{Topics: topics, Partitions: 3}); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	dsn := freshSchemaDSN(t)

	exited := runCommand(t, "--log-level", "error",
		"--kafka-brokers", strings.Join(cc.Brokers, ","),
		"--topic-requests", topics.Requests, "--topic-events", topics.Events,
		"--topic-control", topics.Control, "--topic-dlq", topics.DLQ,
		"executor", "--crdb-dsn", dsn, "--data-dir", t.TempDir(), "--instance-id", "ops-test",
		"--metrics-addr", addr, "--pprof", "--tools-base-url", "http://127.0.0.1:1",
	)

	readyz := "http://" + addr + "/readyz"
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		exited()
		code, rb, err := getReady(readyz)
		if err != nil {
			return err
		}
		if code != http.StatusOK || !rb.Ready {
			return fmt.Errorf("readyz %d %+v", code, rb)
		}
		names := map[string]bool{}
		for _, c := range rb.Checks {
			names[c.Name] = c.OK
		}
		if !names["loop"] || !names["kafka"] || !names["store"] || !names["control"] {
			return fmt.Errorf("readyz checks %+v; want loop, kafka, store and control ok", rb.Checks)
		}
		return nil
	})

	// Events the executor has nothing to do for: it consumes and commits
	// them, so its group has offsets and a lag of 0.
	for i := range 6 {
		rec := &kgo.Record{Topic: topics.Events, Key: []byte("k" + strconv.Itoa(i)), Value: []byte(`{}`),
			Headers: []kgo.RecordHeader{{Key: ledger.HeaderEventType, Value: []byte("denied")}}}
		if err := admin.ProduceSync(t.Context(), rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		exited()
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		body := string(b)
		for _, want := range []string{
			`ledger_records_consumed_total{role="executor"} 6`,
			`ledger_transactions_total{result="committed",role="executor"}`,
			`ledger_calls_in_flight_max{role="executor"} 4096`,
			`ledger_consumer_lag_records{group="ledger-executor",partition="0",role="executor",topic="ops.events"} 0`,
			`ledger_control_staleness_seconds{role="executor"} 0.`,
			"process_resident_memory_bytes",
			"go_goroutines",
		} {
			if !strings.Contains(body, want) {
				return fmt.Errorf("metrics lack %q", want)
			}
		}
		return nil
	})
	// The loop's time, for ledger bench --attach --ledger-ops: it has
	// stepped over the six events and committed them.
	times, err := readLoops(t.Context(), http.DefaultClient, "http://"+addr+loopsPath)
	if err != nil {
		t.Fatal(err)
	}
	if lt, ok := times["executor"]; !ok || len(times) != 1 || lt.Steps == 0 || lt.Step <= 0 || lt.Transaction <= 0 {
		t.Errorf("GET /loops = %+v; want the executor's loop, with steps and a transaction", times)
	}

	wantPprof(t, "http://"+addr, true)

	// The executor's fetches are held while an action is on the control
	// topic: it cannot know whether it is frozen. (Every fetch: within a
	// fetch session, a request need not name the topics it reads.)
	unstall := ledgertest.StallFetches(t, cluster)
	if err := admin.ProduceSync(t.Context(), &kgo.Record{Topic: topics.Control, Key: []byte("tool:create_ticket"), Value: []byte(`{}`)}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	controlReady := func(want bool) error {
		exited()
		code, rb, err := getReady(readyz)
		if err != nil {
			return err
		}
		for _, c := range rb.Checks {
			if c.Name == "control" && c.OK == want && (want || c.Error != "") && rb.Ready == want && (code == http.StatusOK) == want {
				return nil
			}
		}
		return fmt.Errorf("readyz %d %+v; want control ok=%v", code, rb, want)
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error { return controlReady(false) })
	unstall()
	ledgertest.WaitFor(t, 30*time.Second, func() error { return controlReady(true) })

	cluster.Close()
	closed = true
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		code, rb, err := getReady(readyz)
		if err != nil {
			return err
		}
		if code != http.StatusServiceUnavailable || rb.Ready {
			return fmt.Errorf("readyz %d ready=%v with Kafka gone; want 503", code, rb.Ready)
		}
		for _, c := range rb.Checks {
			if c.Name == "kafka" && !c.OK && c.Error != "" {
				return nil
			}
		}
		return fmt.Errorf("readyz checks %+v; want kafka failing with a reason", rb.Checks)
	})
	if resp, err := http.Get("http://" + addr + "/healthz"); err != nil || resp.StatusCode != http.StatusOK {
		t.Errorf("healthz with Kafka gone: %v %v; want 200 (the process lives; readiness is /readyz)", resp, err)
	} else {
		resp.Body.Close()
	}
}

// wantPprof checks that base serves the runtime's profiles (--pprof), or
// that it does not: a heap profile and a short CPU profile (both as go
// tool pprof asks for them), and never the command line, which may hold
// a secret.
func wantPprof(t *testing.T, base string, served bool) {
	t.Helper()
	get := func(path string) (int, string) {
		t.Helper()
		body, resp, err := fetch(http.DefaultClient, base+path)
		if resp == nil {
			t.Fatal(err)
		}
		return resp.StatusCode, body
	}
	code, body := get(pprofPrefix + "heap?debug=1")
	if !served {
		if code != http.StatusNotFound {
			t.Errorf("GET %s%sheap without --pprof: %d; want 404", base, pprofPrefix, code)
		}
		return
	}
	if code != http.StatusOK || !strings.Contains(body, "heap profile:") {
		t.Errorf("GET %s%sheap with --pprof: %d %.100q; want 200 with a heap profile", base, pprofPrefix, code, body)
	}
	// A CPU profile is gzipped protobuf.
	if code, body := get(pprofPrefix + "profile?seconds=1"); code != http.StatusOK || !strings.HasPrefix(body, "\x1f\x8b") {
		t.Errorf("GET %s%sprofile?seconds=1: %d with %d bytes; want 200 with a gzipped profile", base, pprofPrefix, code, len(body))
	}
	if code, _ := get(pprofPrefix + "cmdline"); code != http.StatusNotFound {
		t.Errorf("GET %s%scmdline: %d; want 404 (a command line may hold a secret)", base, pprofPrefix, code)
	}
}

// TestOpsFlagsOnlyWhereRead: the operational flags are accepted only by
// the roles that read them. ledger dev once took --metrics-addr and
// --otlp-traces-url and ignored them, the approval queue
// --otlp-traces-url, and the intake and the reconciler, which make no
// spans, --otlp-traces-url.
func TestOpsFlagsOnlyWhereRead(t *testing.T) {
	for _, args := range [][]string{
		{"dev", "--metrics-addr", "127.0.0.1:0"},
		{"dev", "--otlp-traces-url", "http://127.0.0.1:1/v1/traces"},
		{"approvals", "serve", "--otlp-traces-url", "http://127.0.0.1:1/v1/traces"},
		{"intake", "--otlp-traces-url", "http://127.0.0.1:1/v1/traces"},
		{"reconciler", "--otlp-traces-url", "http://127.0.0.1:1/v1/traces"},
		{"outcomes", "--limit", "5", "--tenant", "t"},
	} {
		if err := cliErr(t, args...); err == nil || !strings.Contains(err.Error(), "unknown flag") {
			t.Errorf("ledger %s: %v; want an unknown flag", strings.Join(args, " "), err)
		}
	}
	// --pprof serves on --metrics-addr: alone it is refused before the
	// role starts.
	for _, role := range [][]string{{"intake"}, {"executor"}, {"reconciler"}, {"approvals", "serve"}} {
		if err := cliErr(t, append(role, "--pprof")...); err == nil || !strings.Contains(err.Error(), "--pprof serves the profiles on --metrics-addr") {
			t.Errorf("ledger %s --pprof: %v; want it refused without --metrics-addr", strings.Join(role, " "), err)
		}
	}
	// A bound the probe cannot meet, or a negative one, is refused rather
	// than leave every executor stale or the check silently off; the
	// intake decides with the policy version the same copy activates.
	for _, role := range []string{"intake", "executor", "reconciler"} {
		for _, v := range []string{"100ms", "-1s"} {
			if err := cliErr(t, role, "--control-max-staleness", v); err == nil || !strings.Contains(err.Error(), "--control-max-staleness") {
				t.Errorf("ledger %s --control-max-staleness %s: %v; want it refused", role, v, err)
			}
		}
	}
	for _, role := range []string{"intake", "executor", "reconciler"} {
		cmd, _, err := newRoot().Find([]string{role})
		if err != nil {
			t.Fatal(err)
		}
		names := []string{"metrics-addr", "pprof"}
		if role == "executor" {
			names = append(names, "otlp-traces-url")
		}
		for _, name := range names {
			if cmd.Flags().Lookup(name) == nil {
				t.Errorf("ledger %s has no --%s", role, name)
			}
		}
	}
}
