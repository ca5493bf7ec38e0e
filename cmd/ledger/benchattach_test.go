package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/loadtest"
)

// TestBenchAttached drives a `ledger dev` that is already running, as a
// user benchmarks a deployment: the calls go to its topics and its tools'
// backend, where each run's effects are counted; the ledger keeps running
// on its topics afterwards, and the direct floor, refused by dev's
// backend (it checks the ledger's credentials), says where it went.
func TestBenchAttached(t *testing.T) {
	dir := t.TempDir()
	addrs := freeAddrs(t, 3)
	dev := startDev(t, filepath.Join(dir, "dev"), addrs[0], addrs[1], addrs[2])
	jsonOut := filepath.Join(dir, "bench.json")
	// The dev ledger runs in this test's process: its CPU, measured
	// through --ledger-pid, is this process's.
	out := runBenchCmd(t, "--attach", "--kafka-brokers", dev.kafka, "--data-dir", dev.dir,
		"--tools-url", "http://"+dev.backend, "--ledger-pid", strconv.Itoa(os.Getpid()), "--ledger-ops", "http://"+dev.api,
		"--calls", "300", "--warmup", "50", "--concurrency", "32", "--sweep", "300",
		"--limits=false", "--json", jsonOut, "--work-dir", filepath.Join(dir, "work"))
	rep := readReport(t, jsonOut)
	if !strings.Contains(rep.Attached, "requests toolcalls.requests") || !strings.Contains(rep.Attached, dev.backend) {
		t.Errorf("attached %q; want the dev ledger's topics and backend named", rep.Attached)
	}
	if !strings.Contains(out, "ledger: already running, not started by the benchmark") {
		t.Errorf("the table does not say the ledger was already running:\n%s", out)
	}
	if len(rep.Runs) != 2 {
		t.Fatalf("%d runs; want the main run and one open-loop run", len(rep.Runs))
	}
	for _, r := range rep.Runs {
		// Each run's effects at dev's backend are its own: the runs
		// share the topics and the backend, not their keys.
		if r.Result.Finished != 300 || r.Result.ByState["succeeded"] != 300 || r.Result.Lost != 0 ||
			r.Witness.Effects != 300 || r.Witness.Duplicates != 0 || r.Witness.Missing != 0 {
			t.Errorf("%s: %d finished (%v), %d lost, witness %+v; want 300 succeeded, each with one effect at dev's backend", r.Name, r.Result.Finished, r.Result.ByState, r.Result.Lost, r.Witness)
		}
		if r.Processes != 1 || r.LedgerCPU <= 0 || r.PeakRSS <= 0 || r.Executors != 0 {
			t.Errorf("%s: %d processes, CPU %v, peak RSS %d, %d executors; want the named process measured, executors unknown", r.Name, r.Processes, r.LedgerCPU, r.PeakRSS, r.Executors)
		}
		// dev's loops, read from its API (--ledger-ops), fill the
		// timeline's loop columns.
		var intake, executors time.Duration
		var steps int64
		for _, iv := range r.Result.Timeline {
			if iv.Usage != nil {
				intake, executors, steps = intake+iv.Usage.IntakeLoop, executors+iv.Usage.ExecutorLoops, steps+iv.Usage.ExecutorSteps
			}
		}
		if intake <= 0 || executors <= 0 || steps <= 0 {
			t.Errorf("%s: the timeline's loops: intake %v, executors %v in %d steps; want dev's loops read", r.Name, intake, executors, steps)
		}
	}
	if row := benchRow(out, "ledger"); len(row) < 3 || row[2] != "-" {
		t.Errorf("main row %q; want its executors column -", row)
	}
	if d := rep.Direct; d == nil || d.Calls != 300 || d.Errors != 0 || !strings.Contains(d.Note, "status 401") {
		t.Errorf("direct %+v; want 300 calls to a backend of the bench's own, noted as such", d)
	}
	// Nothing of the ledger's was dropped: its topics are there, and it
	// still runs a call.
	admin, err := ledger.NewClient(ledger.ClientConfig{Brokers: []string{dev.kafka}})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	topics, err := kadm.NewClient(admin).ListTopics(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"toolcalls.requests", "toolcalls.events"} {
		if !topics.Has(name) {
			t.Errorf("topic %s gone after the bench; have %v", name, topics.Names())
		}
	}
	if got := cli(t, "--kafka-brokers", dev.kafka, "submit", "--data-dir", dev.dir, "--tool", "get_weather", "--args", `{"city":"Oslo"}`, "--wait", "--json"); !strings.Contains(got, `"succeeded"`) {
		t.Errorf("a call after the bench: %s; want it succeeded", got)
	}
}

// TestBenchAttachedPagesOverMutualTLS: the bench asks an attached
// ledger's pages (--ledger-ops) with the client flags, as every client of
// the ledger's own servers does: a deployment's may be served by a
// private CA and require a client certificate.
func TestBenchAttachedPagesOverMutualTLS(t *testing.T) {
	dir := t.TempDir()
	addrs := freeAddrs(t, 3)
	dev := startDev(t, filepath.Join(dir, "dev"), addrs[0], addrs[1], addrs[2])
	pki := ledgertest.NewPKI(t)
	server, client := pki.Server("ops"), pki.Client("bench", "bench-client")
	// dev's pages, behind a server that requires a certificate pki
	// signed, and notes whose.
	var (
		mu   sync.Mutex
		seen = make(map[string]int)
	)
	proxy := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: "http", Host: dev.api})
	ops := "https://" + startHTTP(t, httpTLSFlags{certFile: server.CertFile, keyFile: server.KeyFile, clientCAFile: pki.CAFile}, nil,
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			seen[r.TLS.PeerCertificates[0].Subject.CommonName+" "+r.URL.Path]++
			mu.Unlock()
			proxy.ServeHTTP(w, r)
		}))
	t.Setenv("LEDGER_HTTP_CLIENT_CERT", client.CertFile)
	t.Setenv("LEDGER_HTTP_CLIENT_KEY", client.KeyFile)
	t.Setenv("LEDGER_HTTP_CLIENT_CA", pki.CAFile)
	jsonOut := filepath.Join(dir, "bench.json")
	runBenchCmd(t, "--attach", "--kafka-brokers", dev.kafka, "--data-dir", dev.dir,
		"--tools-url", "http://"+dev.backend, "--ledger-ops", ops,
		"--calls", "100", "--warmup", "20", "--concurrency", "16",
		"--direct=false", "--limits=false", "--json", jsonOut, "--work-dir", filepath.Join(dir, "work"))
	// Asked before the load (the address checked) and by the run's
	// timeline, at its start and its end at least: counted as they come,
	// whether or not the reading met its deadline.
	mu.Lock()
	asked := seen["bench-client "+loopsPath]
	mu.Unlock()
	if asked < 3 {
		t.Errorf("%s asked %d times with the client certificate bench-client; want the check and the timeline's readings", loopsPath, asked)
	}
	if rep := readReport(t, jsonOut); len(rep.Runs) != 1 || rep.Runs[0].Result.Finished != 100 {
		t.Errorf("runs %+v; want one of 100 calls finished", rep.Runs)
	}
}

// TestBenchAttachFlags: what --attach cannot do is refused before
// anything starts, with the flag named, as are its own flags without it.
func TestBenchAttachFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--attach", "--scaling", "1,2"}, "--scaling"},
		{[]string{"--attach", "--baseline", "/bin/true"}, "--baseline"},
		{[]string{"--attach", "--executors", "2"}, "--executors"},
		{[]string{"--attach", "--kafka-process"}, "--kafka-process"},
		{[]string{"--attach", "--batch-linger", "2ms"}, "--batch-linger"},
		{[]string{"--attach", "--policy-timeout", "1s"}, "--policy-timeout"},
		{[]string{"--attach", "--tools-url", ""}, "--tools-url"},
		{[]string{"--attach", "--issuer-key", "k.jwk"}, "--issuer-key needs --issuer"},
		{[]string{"--attach", "--issuer", "idp"}, "--issuer-key"},
		{[]string{"--attach", "--ledger-pid", "0"}, "--ledger-pid"},
		{[]string{"--attach", "--ledger-ops", "127.0.0.1:9464"}, "--ledger-ops"},
		{[]string{"--ledger-ops", "http://127.0.0.1:9464"}, "--ledger-ops is for --attach"},
		{[]string{"--tools-url", "http://127.0.0.1:1"}, "--tools-url is for --attach"},
		{[]string{"--ledger-pid", "1"}, "--ledger-pid is for --attach"},
		{[]string{"--attach", "--clickhouse-dsn", "clickhouse://127.0.0.1:1"}, "--clickhouse-dsn"},
		// The running processes' profiles come from their --pprof pages,
		// for a length given when each starts.
		{[]string{"--attach", "--profile", t.TempDir(), "--calls", "0", "--duration", "5s"}, "--profile with --attach profiles the processes --ledger-ops names"},
		{[]string{"--attach", "--profile", t.TempDir(), "--ledger-ops", "http://127.0.0.1:9464"}, "needs --calls 0 and --duration"},
		{[]string{"--attach", "--data-dir", filepath.Join(t.TempDir(), "none")}, "no dev issuer key"},
		// Flags set through the environment are refused as well, named
		// with their variable.
		{[]string{"--attach", "env:LEDGER_BASELINE=/bin/true"}, "--baseline (set by LEDGER_BASELINE)"},
		{[]string{"--attach", "env:LEDGER_CLICKHOUSE_DSN=clickhouse://127.0.0.1:1"}, "--clickhouse-dsn (set by LEDGER_CLICKHOUSE_DSN)"},
		// A deployment's shell holds variables of the roles that bench
		// shares a name with: where the bench would not read them, they
		// are not refused, and the run goes on to its own checks.
		{[]string{"--calls", "-1", "env:LEDGER_DATA_DIR=/var/lib/ledger", "env:LEDGER_TOOLS_URL=http://127.0.0.1:1"}, "set --calls"},
		{[]string{"--attach", "--data-dir", filepath.Join(t.TempDir(), "none"), "env:LEDGER_ISSUER=https://idp.example", "env:LEDGER_BATCH_LINGER=2ms"}, "no dev issuer key"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var args []string
			for _, a := range tc.args {
				if kv, ok := strings.CutPrefix(a, "env:"); ok {
					k, v, _ := strings.Cut(kv, "=")
					t.Setenv(k, v)
					continue
				}
				args = append(args, a)
			}
			root := newRoot()
			root.SetArgs(append([]string{"bench"}, args...))
			root.SetOut(io.Discard)
			root.SetErr(io.Discard)
			if err := root.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("bench %v: %v; want an error naming %q", tc.args, err, tc.want)
			}
		})
	}
}

// With --attach, --tools-url must be a backend whose effects can be
// read, asked before any load: the witness counts there, and the direct
// floor may call it; and --ledger-ops must serve the loops' time.
func TestBenchAttachNotDemoBackend(t *testing.T) {
	dir := t.TempDir()
	addrs := freeAddrs(t, 3)
	dev := startDev(t, filepath.Join(dir, "dev"), addrs[0], addrs[1], addrs[2])
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	root := newRoot()
	root.SetArgs([]string{"bench", "--attach", "--kafka-brokers", dev.kafka, "--data-dir", dev.dir, "--tools-url", srv.URL, "--calls", "10", "--work-dir", filepath.Join(dir, "work")})
	var progress strings.Builder
	root.SetOut(io.Discard)
	root.SetErr(&progress)
	err := root.ExecuteContext(t.Context())
	if err == nil || !strings.Contains(err.Error(), "--tools-url "+srv.URL) || !strings.Contains(err.Error(), "404") {
		t.Fatalf("bench attached to a backend without effects: %v; want it refused, naming the URL and its answer", err)
	}
	if strings.Contains(progress.String(), "warming up") {
		t.Errorf("load offered before the backend was checked:\n%s", progress.String())
	}
	// So must --ledger-ops serve the loops' time.
	root = newRoot()
	root.SetArgs([]string{"bench", "--attach", "--kafka-brokers", dev.kafka, "--data-dir", dev.dir, "--tools-url", "http://" + dev.backend,
		"--ledger-ops", srv.URL, "--calls", "10", "--work-dir", filepath.Join(dir, "work2")})
	progress.Reset()
	root.SetOut(io.Discard)
	root.SetErr(&progress)
	err = root.ExecuteContext(t.Context())
	if err == nil || !strings.Contains(err.Error(), "--ledger-ops "+srv.URL) || strings.Contains(progress.String(), "warming up") {
		t.Errorf("bench attached with --ledger-ops that serves no loops: %v (progress %q); want it refused before the load, naming the URL", err, progress.String())
	}
	// And --profile needs the processes to serve their profiles: this dev
	// runs without --pprof.
	root = newRoot()
	root.SetArgs([]string{"bench", "--attach", "--kafka-brokers", dev.kafka, "--data-dir", dev.dir, "--tools-url", "http://" + dev.backend,
		"--ledger-ops", "http://" + dev.api, "--profile", filepath.Join(dir, "profiles"), "--calls", "0", "--duration", "1s", "--work-dir", filepath.Join(dir, "work3")})
	progress.Reset()
	root.SetOut(io.Discard)
	root.SetErr(&progress)
	err = root.ExecuteContext(t.Context())
	if err == nil || !strings.Contains(err.Error(), "start the process with --pprof") || strings.Contains(progress.String(), "warming up") {
		t.Errorf("bench --profile attached to a dev without --pprof: %v (progress %q); want it refused before the load", err, progress.String())
	}
}

// TestBenchAttachedProfile: with --profile, an attached run takes the
// CPU and allocation profiles of the processes --ledger-ops names
// (here ledger dev with --pprof), over the run's submitting.
func TestBenchAttachedProfile(t *testing.T) {
	dir := t.TempDir()
	// dev in a process of its own, as a user runs it: in this one, the
	// bench's own CPU profile (of the harness) would keep dev's from
	// starting.
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	addrs := freeAddrs(t, 3)
	devDir, kafka, api, backend := filepath.Join(dir, "dev"), addrs[0], addrs[1], addrs[2]
	logFile, err := os.Create(filepath.Join(dir, "dev.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	dev := exec.Command(self, "--log-level", "warn", "dev", "--data-dir", devDir, "--kafka-addr", kafka,
		"--http-addr", api, "--backend-addr", backend, "--partitions", "3", "--pprof")
	dev.Env = append(os.Environ(), runMainEnv+"=1")
	dev.Stdout, dev.Stderr = logFile, logFile
	if err := dev.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- dev.Wait() }()
	t.Cleanup(func() {
		_ = dev.Process.Signal(os.Interrupt)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = dev.Process.Kill()
			<-exited
			t.Errorf("ledger dev did not stop within 30s of SIGINT")
		}
	})
	ledgertest.WaitFor(t, 60*time.Second, func() error {
		select {
		case err := <-exited:
			b, _ := os.ReadFile(logFile.Name())
			t.Fatalf("ledger dev exited: %v\n%s", err, b)
		default:
		}
		return healthz(api)
	})
	profiles := filepath.Join(dir, "profiles")
	_, progress := runBenchCmdProgress(t, "--attach", "--kafka-brokers", kafka, "--data-dir", devDir,
		"--tools-url", "http://"+backend, "--ledger-ops", "http://"+api, "--profile", profiles,
		"--ledger-pid", strconv.Itoa(dev.Process.Pid),
		"--calls", "0", "--duration", "2s", "--warmup", "50", "--concurrency", "16",
		"--limits=false", "--direct=false", "--work-dir", filepath.Join(dir, "work"))
	for file, want := range map[string]string{
		"run1-ledger1.cpu.pprof":    "nanoseconds",
		"run1-ledger1.allocs.pprof": "alloc_space",
	} {
		path := filepath.Join(profiles, file)
		b, err := os.ReadFile(path)
		if err != nil {
			t.Errorf("%v; progress:\n%s", err, progress)
			continue
		}
		// A profile is gzipped protobuf, whose string table names its
		// sample types.
		zr, err := gzip.NewReader(bytes.NewReader(b))
		if err != nil {
			t.Errorf("%s: %v", file, err)
			continue
		}
		raw, err := io.ReadAll(zr)
		if err != nil || !bytes.Contains(raw, []byte(want)) {
			t.Errorf("%s: %d bytes (%v); want a profile naming %q", file, len(raw), err, want)
		}
		if !strings.Contains(progress, path) {
			t.Errorf("the progress does not say where %s went:\n%s", file, progress)
		}
	}
}

// An attached ledger process that exits during a run ends the run,
// named, as one of the bench's own does; so does another process that
// took its pid.
func TestWatchAttachedProcess(t *testing.T) {
	for _, reused := range []bool{false, true} {
		cmd := exec.Command("sleep", "30")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		st, err := readProcStat("/proc", cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		n := &benchNode{what: "attached ledger process", pid: cmd.Process.Pid, start: st.start}
		if reused {
			// As if the pid were now another process's.
			n.start--
		}
		ctx, unwatch := watchNodes(t.Context(), []*benchNode{n})
		if !reused {
			select {
			case <-ctx.Done():
				t.Fatalf("run ended while the process ran: %v", context.Cause(ctx))
			case <-time.After(3 * attachedPoll):
			}
			_ = cmd.Process.Kill()
		}
		select {
		case <-ctx.Done():
			if cause := context.Cause(ctx); !strings.Contains(cause.Error(), "attached ledger process "+strconv.Itoa(n.pid)+" exited") {
				t.Errorf("cause %v; want the process named", cause)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("reused %v: the run went on after its attached process went", reused)
		}
		unwatch()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
}

// An attached warm-up that did not succeed says why: no ledger on the
// topics, or calls its policy or tools did not let succeed.
func TestCheckAttachedWarmup(t *testing.T) {
	e := &benchEnv{f: &benchFlags{mix: "create_ticket", tenants: 8, attachFlags: attachFlags{attach: true}}, brokers: []string{"127.0.0.1:9092"}, toolsURL: "http://127.0.0.1:8081"}
	topics := ledger.Topics{Requests: "r", Events: "e"}
	for _, tc := range []struct {
		res  loadtest.Result
		want []string // "" when the warm-up is fine
	}{
		{loadtest.Result{Finished: 50, ByState: map[string]int64{"succeeded": 50}}, nil},
		{loadtest.Result{Submitted: 32, Lost: 32, Elapsed: 30 * time.Second, ByState: map[string]int64{}}, []string{"none of the 32 calls submitted reached a terminal event in 30s", "request topic r", "events topic e"}},
		{loadtest.Result{Finished: 50, ByState: map[string]int64{"succeeded": 40, "denied": 6, "approval_pending": 4}}, []string{"4 approval_pending, 6 denied", "create_ticket"}},
		{loadtest.Result{Finished: 49, Lost: 1, ByState: map[string]int64{"succeeded": 49}}, []string{"1 lost"}},
	} {
		err := e.checkAttachedWarmup(topics, tc.res)
		if tc.want == nil {
			if err != nil {
				t.Errorf("%+v: %v; want none", tc.res, err)
			}
			continue
		}
		if err == nil || slices.ContainsFunc(tc.want, func(w string) bool { return !strings.Contains(err.Error(), w) }) {
			t.Errorf("%+v: %v; want an error with %q", tc.res, err, tc.want)
		}
	}
}

// --issuer-key names the agents' identity provider for an attached
// ledger: created when missing, with its public keys beside it for the
// intake's --jwks-file, and then the bench stops, for the intake must be
// started with them; the next time the same key, and a key set an
// operator has added to left as it is.
func TestAttachIssuer(t *testing.T) {
	key := filepath.Join(t.TempDir(), "agents.jwk")
	e := &benchEnv{f: &benchFlags{attachFlags: attachFlags{attach: true, issuerKey: key, issuerName: "https://idp.example"}}}
	_, err := e.attachIssuer()
	if !errors.Is(err, errIssuerCreated) || !strings.Contains(err.Error(), "--issuer https://idp.example --jwks-file "+key+".jwks.json") {
		t.Fatalf("first load: %v; want the key created and how the intake trusts it", err)
	}
	jwks, err := os.ReadFile(key + ".jwks.json")
	if err != nil {
		t.Fatal(err)
	}
	iss, err := e.attachIssuer()
	if err != nil {
		t.Fatal(err)
	}
	if string(iss.Keys().JWKS()) != string(jwks) {
		t.Errorf("second load: keys %s; want the created key, whose set is %s", iss.Keys().JWKS(), jwks)
	}
	// An operator's key set is not overwritten.
	mine := []byte(`{"keys":[]}`)
	if err := os.WriteFile(key+".jwks.json", mine, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := e.attachIssuer(); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(key + ".jwks.json"); string(got) != string(mine) {
		t.Errorf("key set rewritten to %s; want the operator's left", got)
	}
}
