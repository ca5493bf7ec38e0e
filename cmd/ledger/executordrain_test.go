package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// A stopping executor serves its credential keys until the calls it still
// runs have drained: a tool that first asks for them then, to check the
// credential of a call sent just before the stop, finds them and applies
// the call. Here the demo backend checks credentials against the
// executor's --jwks-addr, and the one call is held on its way to it
// until the executor has left its group (its stop under way); the tool
// then fetches the keys for the first time. Before, the keys were served
// on the command's context, gone at the stop, and the tool refused the
// call (401): it ended failed, its effect never applied.
func TestExecutorServesKeysUntilItsCallsDrain(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	dsn, dataDir := freshSchemaDSN(t), t.TempDir()
	_, jwks := devIssuerKeys(t, dataDir)
	addrs := freeAddrs(t, 2)
	backend, jwksAddr := addrs[0], addrs[1]
	startDemoBackend(t, backend, "--credential-jwks-url", "http://"+jwksAddr+"/.well-known/jwks.json")

	front, arrived, release := holdingFront(t, backend, 0)

	role := func(args ...string) []string {
		return append(roleArgs(cc, topics), append(args, "--crdb-dsn", dsn)...)
	}
	intakeExited := runCommand(t, role("intake", "--data-dir", t.TempDir(), "--instance-id", "drain-intake",
		"--issuer", DevIssuer, "--jwks-file", jwks)...)
	stopExecutor, executorStopped := startCommand(t, role("executor", "--data-dir", t.TempDir(), "--instance-id", "drain-executor",
		"--tools-base-url", front.URL, "--jwks-addr", jwksAddr)...)
	t.Cleanup(func() { _ = stopExecutor() })

	key := ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "drain-ticket"}
	cli(t, append(roleArgs(cc, topics), "submit", "--data-dir", dataDir, "--tool", "create_ticket",
		"--args", `{"title":"held at the stop"}`, "--tenant", key.TenantID, "--key", key.IdempotencyKey)...)
	select {
	case <-arrived:
	case <-executorStopped:
		t.Fatalf("the executor exited before the call reached the tool: %v", stopExecutor())
	case <-time.After(60 * time.Second):
		t.Fatal("the call never reached the tool")
	}
	intakeExited()

	// Stop the executor with the call at the tool. Its keys stay served
	// while it waits for the call: asked for a second, they answer every
	// time (before, the first ask after the stop was refused).
	stopErr := make(chan error, 1)
	go func() { stopErr <- stopExecutor() }()
	keysURL := "http://" + jwksAddr + "/.well-known/jwks.json"
	for range 10 {
		time.Sleep(100 * time.Millisecond)
		resp, err := http.Get(keysURL)
		if err != nil {
			t.Fatalf("the stopping executor's keys, with its call still at the tool: %v", err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("the stopping executor's keys, with its call still at the tool: %s", resp.Status)
		}
	}
	select {
	case err := <-stopErr:
		t.Fatalf("the executor exited with its call still at the tool: %v", err)
	default:
	}
	release()
	if err := <-stopErr; err != nil {
		t.Fatalf("the executor's stop: %v", err)
	}
	resp, err := http.Get("http://" + backend + "/effects")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), key.IdempotencyKey) {
		t.Errorf("the demo backend applied no effect for %s: %s", key.IdempotencyKey, b)
	}

	// The outcome, recorded in the store after the loop stopped, is
	// published by the next executor's sweep.
	runCommand(t, role("executor", "--data-dir", t.TempDir(), "--instance-id", "drain-executor-2",
		"--tools-base-url", "http://"+backend)...)
	var seen []string
	ledgertest.WaitFor(t, 60*time.Second, func() error {
		events, err := ledger.ReadCall(t.Context(), cc, topics.Events, key)
		if err != nil {
			return err
		}
		seen = seen[:0]
		for _, e := range events {
			seen = append(seen, string(e.Type))
		}
		if len(seen) == 0 || !slices.Contains([]string{"succeeded", "failed", "outcome_unknown"}, seen[len(seen)-1]) {
			return fmt.Errorf("the call's events %v; want it settled", seen)
		}
		return nil
	})
	if seen[len(seen)-1] != "succeeded" {
		t.Errorf("the call's events %v; want it to end succeeded", seen)
	}
}

// ledger dev, stopped while a call is at its tool, keeps what the call's
// next attempt needs until the call has drained: its copy of the control
// topic, which the attempt is checked against and which goes stale a
// second after it stops being followed; its demo tools; and its API,
// where they introspect the attempt's credential. Here create_ticket's
// route is a front that holds the first attempt past that second after
// the stop, answers it 503, and passes the retry on to dev's demo tools.
// Before, each stopped at Ctrl-C, and the retry was refused or failed.
func TestDevStopDrainsItsCalls(t *testing.T) {
	addrs := freeAddrs(t, 3)
	kafka, api, backend := addrs[0], addrs[1], addrs[2]
	front, arrived, release := holdingFront(t, backend, http.StatusServiceUnavailable)

	// The demo tools, with create_ticket's route through the front.
	registry := t.TempDir()
	if err := os.Mkdir(filepath.Join(registry, "tools"), 0o700); err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob(filepath.Join("..", "..", "schemas", "tools", "*.json"))
	if err != nil || len(files) == 0 {
		t.Fatalf("the demo tools' schemas: %v %v", files, err)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if filepath.Base(f) == "create_ticket.v1.json" {
			b = []byte(strings.Replace(string(b), `"url": "/tools/create_ticket"`, `"url": "`+front.URL+`/tools/create_ticket"`, 1))
			if !strings.Contains(string(b), front.URL) {
				t.Fatalf("create_ticket's route not found in %s", f)
			}
		}
		if err := os.WriteFile(filepath.Join(registry, "tools", filepath.Base(f)), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	dir := t.TempDir()
	dev := startDev(t, dir, kafka, api, backend, "--registry-dir", registry)
	cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", "create_ticket",
		"--args", `{"title":"held at the stop"}`, "--key", "dev-drain")
	select {
	case <-arrived:
	case <-time.After(60 * time.Second):
		t.Fatal("the call never reached its tool")
	}
	stopped := make(chan struct{})
	go func() {
		dev.stop()
		close(stopped)
	}()
	// Past the control copy's staleness bound (a second) after the stop.
	time.Sleep(1500 * time.Millisecond)
	select {
	case <-stopped:
		t.Fatal("ledger dev exited with its call still at the tool")
	default:
	}
	release()
	<-stopped

	// Started again on its data, dev publishes the outcome the call
	// recorded as it drained, and the demo tools' journal has its effect.
	startDev(t, dir, kafka, api, backend, "--registry-dir", registry)
	var view callView
	ledgertest.WaitFor(t, 60*time.Second, func() error {
		var code int
		code, view = getCall(t, api, "dev-drain")
		if code != http.StatusOK || !view.Settled {
			return fmt.Errorf("GET dev-drain: %d %s; want it settled", code, view.State)
		}
		return nil
	})
	if view.State != "succeeded" {
		t.Errorf("dev-drain ended %s; want succeeded (%s): its retry ran against what dev still served", view.State, types(view))
	}
}

// holdingFront is a tools' front that passes requests on to the tools at
// backend, but holds the first POST until release is called: then it
// answers it with heldStatus, or passes it on too if that is 0. arrived
// closes when the first POST reaches it.
func holdingFront(t *testing.T, backend string, heldStatus int) (front *httptest.Server, arrived <-chan struct{}, release func()) {
	t.Helper()
	target, err := url.Parse("http://" + backend)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	reached, released := make(chan struct{}), make(chan struct{})
	var first sync.Once
	front = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		held := false
		if r.Method == http.MethodPost {
			first.Do(func() {
				held = true
				close(reached)
				<-released
			})
		}
		if held && heldStatus != 0 {
			http.Error(w, http.StatusText(heldStatus), heldStatus)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	release = sync.OnceFunc(func() { close(released) })
	t.Cleanup(front.Close)
	t.Cleanup(release)
	return front, reached, release
}
