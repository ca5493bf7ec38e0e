package loadtest

// These tests run the load generator against a real ledger in the test
// process: Kafka (kfake through ledgertest, or LEDGER_TEST_KAFKA_BROKERS),
// the embedded execution store, the demo tool backend over HTTP, and the
// intake and the executor on their transactional loops, wired as
// `ledger bench node` wires them.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/boltstore"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/schemas"
)

// drvIssuer names the tests' agent identity provider.
const drvIssuer = "https://bench.test"

// drvRunTimeout bounds one Run, so that a ledger that stops answering
// fails the test instead of hanging it.
const drvRunTimeout = 60 * time.Second

// drvLedger is one ledger in the test process and what a load run needs
// to reach it.
type drvLedger struct {
	t       *testing.T
	kafka   *ledgertest.Kafka
	store   *boltstore.Store
	backend *demobackend.Server
	tools   string // the backend's base URL
	reg     *schemas.Registry
	policy  *policy.Engine
	issuer  *identity.Issuer
}

// drvNewLedger starts Kafka, the store, the backend and an intake; the
// executor only when withExecutor, so that a test can offer load to a
// ledger that authorizes calls and never runs them.
func drvNewLedger(t *testing.T, withExecutor bool) *drvLedger {
	t.Helper()
	return drvStart(t, drvOptions{executor: withExecutor})
}

// drvOptions vary the ledger drvStart starts.
type drvOptions struct {
	executor bool
	// noPolicies starts the policy engine with no active set, so that
	// the intake refuses every call for now (policy_unavailable) until
	// the test swaps one in; policyRetryAfter is the wait it names.
	noPolicies       bool
	policyRetryAfter time.Duration
}

// drvStart starts the ledger o describes.
func drvStart(t *testing.T, o drvOptions) *drvLedger {
	t.Helper()
	l := &drvLedger{t: t}
	l.kafka = ledgertest.New(t, ledgertest.Options{Partitions: 4})
	st, err := boltstore.Open(boltstore.Config{Path: filepath.Join(t.TempDir(), "executions.db")})
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	t.Cleanup(func() {
		if err := st.Close(); err != nil {
			t.Errorf("close store: %v", err)
		}
	})
	l.store = st
	l.backend = demobackend.New(demobackend.Config{})
	srv := httptest.NewServer(l.backend.Handler())
	t.Cleanup(func() { l.backend.Close(); srv.Close() })
	l.tools = srv.URL
	if l.reg, err = schemas.Demo(); err != nil {
		t.Fatalf("demo registry: %v", err)
	}
	set, err := policy.Demo()
	if err != nil {
		t.Fatalf("demo policies: %v", err)
	}
	// The default 50ms evaluation deadline refuses a call now and then
	// (policy_timeout) when the race detector slows a loaded process;
	// these tests measure the load generator, not policy latency.
	if o.noPolicies {
		set = nil
	}
	if l.policy, err = policy.NewEngine(policy.Config{Set: set, Timeout: 10 * time.Second}); err != nil {
		t.Fatalf("policy engine: %v", err)
	}
	if l.issuer, err = identity.LoadOrCreateIssuer(filepath.Join(t.TempDir(), "issuer.key"), drvIssuer); err != nil {
		t.Fatalf("issuer: %v", err)
	}
	ver, err := identity.New(t.Context(), identity.Config{Issuer: drvIssuer, Keys: l.issuer.Keys()})
	if err != nil {
		t.Fatalf("verifier: %v", err)
	}
	in, err := intake.New(intake.Config{
		Registry: l.reg, Store: st, Identity: ver, Policy: l.policy,
		Topics: l.kafka.Topics, Actor: "intake/drv", PolicyRetryAfter: o.policyRetryAfter,
	})
	if err != nil {
		t.Fatalf("intake: %v", err)
	}
	loop, err := in.Loop(ledger.LoopConfig{Client: l.kafka.Client, Group: l.kafka.Group("intake"), Tick: 100 * time.Millisecond})
	if err != nil {
		t.Fatalf("intake loop: %v", err)
	}
	drvGo(t, "intake", loop.Run)
	if o.executor {
		l.startExecutor()
	}
	return l
}

// startExecutor starts an executor on its loop, stopped when the test
// ends.
func (l *drvLedger) startExecutor() {
	t := l.t
	t.Helper()
	tools := httptool.New(httptool.Config{})
	x, err := executor.New(executor.Config{
		Registry: l.reg, Store: l.store, Caller: tools, Versions: tools, Policy: l.policy,
		BaseURL: l.tools, Topics: l.kafka.Topics, Owner: "executor/drv",
	})
	if err != nil {
		t.Fatalf("executor: %v", err)
	}
	loop, err := x.Loop(ledger.LoopConfig{Client: l.kafka.Client, Group: l.kafka.Group("executor"), Tick: 100 * time.Millisecond})
	if err != nil {
		t.Fatalf("executor loop: %v", err)
	}
	drvGo(t, "executor", loop.Run)
}

// drvGo runs fn in the background until the test ends; the cleanup
// cancels it and waits for it to return.
func drvGo(t *testing.T, name string, fn func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := fn(ctx); err != nil && ctx.Err() == nil {
			t.Errorf("%s: %v", name, err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
}

// config is a load run against l: tools is a mix for ParseMix.
func (l *drvLedger) config(mix string, runID string) Config {
	l.t.Helper()
	tools, err := ParseMix(mix)
	if err != nil {
		l.t.Fatalf("ParseMix(%q): %v", mix, err)
	}
	return Config{
		Client: l.kafka.Client, Topics: l.kafka.Topics, Minter: l.issuer,
		Tools: tools, Tenants: 3, RunID: runID, Drain: 30 * time.Second,
	}
}

// run runs cfg with the test's deadline.
func (l *drvLedger) run(cfg Config) (Result, error) {
	ctx, cancel := context.WithTimeout(l.t.Context(), drvRunTimeout)
	defer cancel()
	return Run(ctx, cfg)
}

// runEffects returns the backend's effects of run runID, by tool and by
// tenant.
func (l *drvLedger) runEffects(runID string) (byTool, byTenant map[string]int64) {
	byTool, byTenant = make(map[string]int64), make(map[string]int64)
	for _, ef := range l.backend.Effects() {
		if _, ok := callIndex(ef.IdempotencyKey, runID); !ok {
			continue
		}
		byTool[ef.Tool]++
		byTenant[ef.TenantID]++
	}
	return byTool, byTenant
}

// drvCheckPercentiles fails t unless p is ordered and its median positive.
func drvCheckPercentiles(t *testing.T, name string, p Percentiles) {
	t.Helper()
	if p.P50 <= 0 {
		t.Errorf("%s.P50 = %v; want > 0", name, p.P50)
	}
	if !(p.P50 <= p.P95 && p.P95 <= p.P99 && p.P99 <= p.P999 && p.P999 <= p.Max) {
		t.Errorf("%s = %+v; want P50 <= P95 <= P99 <= P999 <= Max", name, p)
	}
}

// drvCheckAdded fails t unless every added-latency percentile is at most
// the end-to-end one: added latency is e2e minus the tool's own time,
// call by call.
func drvCheckAdded(t *testing.T, res Result) {
	t.Helper()
	pairs := []struct {
		name       string
		added, e2e time.Duration
	}{
		{"P50", res.Added.P50, res.E2E.P50}, {"P95", res.Added.P95, res.E2E.P95},
		{"P99", res.Added.P99, res.E2E.P99}, {"Max", res.Added.Max, res.E2E.Max},
	}
	for _, p := range pairs {
		if p.added > p.e2e {
			t.Errorf("Added.%s = %v > E2E.%s = %v; want added <= e2e", p.name, p.added, p.name, p.e2e)
		}
	}
}

func TestRunClosedLoop(t *testing.T) {
	l := drvNewLedger(t, true)
	cfg := l.config("create_ticket=1,get_weather=1", "rclosed")
	cfg.Calls, cfg.Concurrency = 300, 32
	res, err := l.run(cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if res.Mode != "closed" || res.Offered != 0 || res.Saturated {
		t.Errorf("Mode, Offered, Saturated = %q, %v, %v; want closed, 0, false", res.Mode, res.Offered, res.Saturated)
	}
	if res.Submitted != 300 || res.Finished != 300 || res.Lost != 0 {
		t.Errorf("Submitted, Finished, Lost = %d, %d, %d; want 300, 300, 0", res.Submitted, res.Finished, res.Lost)
	}
	if diff := cmp.Diff(map[string]int64{"succeeded": 300}, res.ByState); diff != "" {
		t.Errorf("ByState (-want +got):\n%s", diff)
	}
	if res.RunID != "rclosed" {
		t.Errorf("RunID = %q; want rclosed", res.RunID)
	}
	drvCheckPercentiles(t, "E2E", res.E2E)
	drvCheckAdded(t, res)
	if res.Elapsed <= 0 || res.PerSec <= 0 {
		t.Errorf("Elapsed, PerSec = %v, %v; want both positive", res.Elapsed, res.PerSec)
	}
	if want := float64(res.Finished) / res.Elapsed.Seconds(); res.PerSec != want {
		t.Errorf("PerSec = %v; want Finished/Elapsed = %v", res.PerSec, want)
	}

	w := Check(res, l.backend.Effects())
	if diff := cmp.Diff(Witness{Effects: 150, Reads: 150}, w); diff != "" {
		t.Errorf("Check (-want +got):\n%s", diff)
	}
	for i := range int64(300) {
		if !res.Succeeded(i) {
			t.Errorf("Succeeded(%d) = false; want true", i)
		}
	}
	for _, i := range []int64{-1, 300, 1 << 20} {
		if res.Succeeded(i) {
			t.Errorf("Succeeded(%d) = true for a call never made", i)
		}
	}
	// The backend saw each tool and each tenant as the run spread them.
	byTool, byTenant := l.runEffects("rclosed")
	if diff := cmp.Diff(map[string]int64{"create_ticket": 150, "get_weather": 150}, byTool); diff != "" {
		t.Errorf("backend requests by tool (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(map[string]int64{"t_bench0": 100, "t_bench1": 100, "t_bench2": 100}, byTenant); diff != "" {
		t.Errorf("backend requests by tenant (-want +got):\n%s", diff)
	}
}

// The stages of the calls that ran split their end-to-end latency: the
// tool's own time shows in Call and nowhere else, and no stage of a call
// is longer than the whole of it.
func TestRunStages(t *testing.T) {
	l := drvNewLedger(t, true)
	const toolTime = 30 * time.Millisecond
	l.backend.SetFault("create_ticket", demobackend.Fault{Latency: toolTime})
	cfg := l.config("create_ticket", "rstages")
	cfg.Calls, cfg.Concurrency = 120, 16
	res, err := l.run(cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if res.Finished != 120 || res.ByState["succeeded"] != 120 {
		t.Fatalf("Finished = %d, ByState = %v; want 120 succeeded", res.Finished, res.ByState)
	}
	st := res.Stages
	if st.Calls != 120 {
		t.Errorf("Stages.Calls = %d; want 120, every call that ran", st.Calls)
	}
	for _, s := range []struct {
		name string
		p    Percentiles
	}{{"Intake", st.Intake}, {"Claim", st.Claim}, {"Call", st.Call}, {"Record", st.Record}} {
		if s.p.Max > res.E2E.Max {
			t.Errorf("Stages.%s.Max = %v > E2E.Max = %v; a part is never longer than the whole", s.name, s.p.Max, res.E2E.Max)
		}
		if s.p.P50 > s.p.P99 || s.p.P99 > s.p.Max {
			t.Errorf("Stages.%s = %+v; want P50 <= P99 <= Max", s.name, s.p)
		}
	}
	// The tool's delay is in the call, not in the ledger's own stages.
	if st.Call.P50 < toolTime {
		t.Errorf("Stages.Call.P50 = %v; want at least the tool's %v", st.Call.P50, toolTime)
	}
	if st.Intake.P50 <= 0 || st.Record.P50 <= 0 {
		t.Errorf("Stages.Intake.P50, Record.P50 = %v, %v; want both positive: each crosses a Kafka transaction", st.Intake.P50, st.Record.P50)
	}
	if own := st.Intake.Max + st.Claim.Max + st.Record.Max; own < res.Added.P50 {
		t.Errorf("intake + claim + record at most %v, added latency p50 %v: the ledger's own stages must account for it", own, res.Added.P50)
	}
}

func TestRunOpenLoop(t *testing.T) {
	l := drvNewLedger(t, true)
	cfg := l.config("create_ticket=1,get_weather=1", "ropen")
	cfg.Calls, cfg.Rate = 200, 200
	res, err := l.run(cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if res.Mode != "open" || res.Offered != 200 || res.Saturated {
		t.Errorf("Mode, Offered, Saturated = %q, %v, %v; want open, 200, false", res.Mode, res.Offered, res.Saturated)
	}
	if res.Submitted != 200 || res.Finished != 200 || res.Lost != 0 {
		t.Errorf("Submitted, Finished, Lost = %d, %d, %d; want 200, 200, 0", res.Submitted, res.Finished, res.Lost)
	}
	if diff := cmp.Diff(map[string]int64{"succeeded": 200}, res.ByState); diff != "" {
		t.Errorf("ByState (-want +got):\n%s", diff)
	}
	// Arrivals follow the schedule whatever the ledger does: the last
	// one is due 199/200 s after the start, so the run cannot be shorter
	// and cannot finish faster than offered.
	if due := 995 * time.Millisecond; res.Elapsed < due {
		t.Errorf("Elapsed = %v; want >= %v (the last arrival's schedule)", res.Elapsed, due)
	}
	if res.PerSec <= 0 || res.PerSec > 201 {
		t.Errorf("PerSec = %v; want in (0, 201]", res.PerSec)
	}
	drvCheckPercentiles(t, "E2E", res.E2E)
	drvCheckAdded(t, res)
	if diff := cmp.Diff(Witness{Effects: 100, Reads: 100}, Check(res, l.backend.Effects())); diff != "" {
		t.Errorf("Check (-want +got):\n%s", diff)
	}
}

func TestRunForDuration(t *testing.T) {
	l := drvNewLedger(t, true)
	cfg := l.config("get_weather", "rdur")
	cfg.Duration, cfg.Concurrency = 700*time.Millisecond, 8
	res, err := l.run(cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if res.Submitted <= 0 || res.Finished != res.Submitted || res.Lost != 0 {
		t.Errorf("Submitted, Finished, Lost = %d, %d, %d; want Finished == Submitted > 0, none lost", res.Submitted, res.Finished, res.Lost)
	}
	if diff := cmp.Diff(Witness{Reads: res.Submitted}, Check(res, l.backend.Effects())); diff != "" {
		t.Errorf("Check (-want +got):\n%s", diff)
	}
}

func TestRunMixSpread(t *testing.T) {
	l := drvNewLedger(t, true)
	cfg := l.config("get_weather=3,create_ticket=1", "rmix")
	cfg.Calls, cfg.Concurrency = 400, 32
	res, err := l.run(cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if res.Finished != 400 || res.Lost != 0 {
		t.Errorf("Finished, Lost = %d, %d; want 400, 0", res.Finished, res.Lost)
	}
	if diff := cmp.Diff(Witness{Effects: 100, Reads: 300}, Check(res, l.backend.Effects())); diff != "" {
		t.Errorf("Check (-want +got):\n%s", diff)
	}
	byTool, _ := l.runEffects("rmix")
	if diff := cmp.Diff(map[string]int64{"create_ticket": 100, "get_weather": 300}, byTool); diff != "" {
		t.Errorf("backend requests by tool (-want +got):\n%s", diff)
	}
}

// TestRunLost offers calls to a ledger whose executor is not running: the
// intake authorizes them and nothing finishes them. Lost calls are a
// measurement, not an error of Run.
func TestRunLost(t *testing.T) {
	l := drvNewLedger(t, false)
	var (
		mu        sync.Mutex
		snapshots []Progress
	)
	cfg := l.config("create_ticket=1,get_weather=1", "rlost")
	// The default concurrency (64) lets all 20 calls in: a closed loop
	// with fewer slots than calls waits for finishes that never come,
	// and Drain does not bound that wait, only the one after the last
	// submission.
	cfg.Calls, cfg.Drain = 20, 2*time.Second
	cfg.ProgressEvery = 100 * time.Millisecond
	cfg.Progress = func(p Progress) {
		mu.Lock()
		defer mu.Unlock()
		snapshots = append(snapshots, p)
	}
	t0 := time.Now()
	res, err := l.run(cfg)
	took := time.Since(t0)
	if err != nil {
		t.Fatalf("Run: %v; want no error (lost calls are measured, not failed)", err)
	}
	if res.Submitted != 20 || res.Finished != 0 || res.Lost != 20 {
		t.Errorf("Submitted, Finished, Lost = %d, %d, %d; want 20, 0, 20", res.Submitted, res.Finished, res.Lost)
	}
	if len(res.ByState) != 0 {
		t.Errorf("ByState = %v; want empty (authorized does not finish a call)", res.ByState)
	}
	if res.E2E != (Percentiles{}) || res.PerSec != 0 {
		t.Errorf("E2E, PerSec = %+v, %v; want zero with nothing finished", res.E2E, res.PerSec)
	}
	// With nothing finished, the run lasts the whole drain.
	if took < cfg.Drain || res.Elapsed < cfg.Drain {
		t.Errorf("Run took %v, Elapsed %v; want both >= the drain %v", took, res.Elapsed, cfg.Drain)
	}
	// The timeline covers the drain that ended the run: its intervals
	// hold every submission, and the last still has every call in flight.
	var submitted int64
	for _, iv := range res.Timeline {
		submitted += iv.Submitted
		if iv.Finished != 0 || iv.InFlight != int(submitted) {
			t.Errorf("interval %+v after %d submissions; want nothing finished and every submitted call in flight", iv, submitted)
		}
	}
	if n := len(res.Timeline); n == 0 || submitted != 20 || res.Timeline[n-1].End < cfg.Drain {
		t.Errorf("timeline of %d intervals, %d submitted; want 20 submitted and the last interval ending after the drain %v", n, submitted, cfg.Drain)
	}

	mu.Lock()
	got := append([]Progress(nil), snapshots...)
	mu.Unlock()
	if len(got) == 0 {
		t.Fatalf("Progress never called over a %v drain every %v", cfg.Drain, cfg.ProgressEvery)
	}
	for _, p := range got {
		if p.Done != 0 || p.Submitted > 20 || p.InFlight != int(p.Submitted) {
			t.Errorf("progress %+v; want nothing done and every submitted call in flight", p)
		}
	}
	if last := got[len(got)-1]; last.Submitted != 20 || last.InFlight != 20 {
		t.Errorf("last progress %+v; want 20 submitted, 20 in flight", last)
	}

	// The calls were not lost by the ledger, only unfinished: once an
	// executor runs, the backend sees every one of them, and the witness
	// counts them as orphans of the run (the tool saw them, the run never
	// heard they succeeded).
	l.startExecutor()
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if w := Check(res, l.backend.Effects()); w.Effects+w.Reads < 20 {
			return fmt.Errorf("backend saw %d of the 20 calls", w.Effects+w.Reads)
		}
		return nil
	})
	if diff := cmp.Diff(Witness{Effects: 10, Reads: 10, Orphans: 20}, Check(res, l.backend.Effects())); diff != "" {
		t.Errorf("Check after the executor ran (-want +got):\n%s", diff)
	}
}

// TestRunRetriesLater: a call the ledger refuses for now (a denied event
// naming a wait, here policy_unavailable until a policy set is active) is
// not finished: its envelope goes out again, same key, after the wait,
// and the call ends where the resend takes it, counted from its first
// submission.
func TestRunRetriesLater(t *testing.T) {
	// A wait long enough to tell the calls sent again by their latency.
	const wait = 3 * time.Second
	l := drvStart(t, drvOptions{executor: true, noPolicies: true, policyRetryAfter: wait})
	set, err := policy.Demo()
	if err != nil {
		t.Fatal(err)
	}
	cfg := l.config("create_ticket=1,get_weather=1", "rlater")
	cfg.Calls, cfg.Concurrency = 40, 8
	var (
		mu    sync.Mutex
		sends = make(map[string]int)
	)
	cfg.OnSubmit = func(rec *kgo.Record, _ time.Time) {
		mu.Lock()
		defer mu.Unlock()
		sends[string(rec.Key)]++
		if sends[string(rec.Key)] == 2 && l.policy.Active() == nil {
			// The first resend: from now on the policies decide, so
			// that it and every later envelope is allowed.
			l.policy.Swap(set)
		}
	}
	res, err := l.run(cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if res.Submitted != 40 || res.Finished != 40 || res.Lost != 0 || res.ByState["succeeded"] != 40 {
		t.Errorf("Submitted, Finished, Lost, ByState = %d, %d, %d, %v; want 40 submitted, all succeeded", res.Submitted, res.Finished, res.Lost, res.ByState)
	}
	mu.Lock()
	var resent int64
	for key, n := range sends {
		if n > 2 {
			t.Errorf("%s sent %d times; want at most twice (refused once, allowed once)", key, n)
		}
		resent += int64(n - 1)
	}
	keys := len(sends)
	mu.Unlock()
	if keys != 40 || resent == 0 {
		t.Fatalf("%d keys sent, %d resends; want 40 keys and at least one resend", keys, resent)
	}
	if res.RetriedLater != resent || !cmp.Equal(res.RetryReasons, map[string]int64{"policy_unavailable": resent}) {
		t.Errorf("RetriedLater, RetryReasons = %d, %v; want %d resends, all policy_unavailable", res.RetriedLater, res.RetryReasons, resent)
	}
	if got := drvRequests(t, l.kafka); got != 40+resent {
		t.Errorf("request topic holds %d envelopes; want %d (40 and the resends)", got, 40+resent)
	}
	if diff := cmp.Diff(Witness{Effects: 20, Reads: 20}, Check(res, l.backend.Effects())); diff != "" {
		t.Errorf("Check (-want +got):\n%s", diff)
	}
	// End to end counts the wait; the intake's stage counts from the
	// last sending, without it.
	if res.E2E.Max < wait || res.Stages.Calls != 40 || res.Stages.Intake.Max >= wait {
		t.Errorf("e2e max %v, intake stage max %v over %d calls; want the %v wait in the first only, all 40 calls staged", res.E2E.Max, res.Stages.Intake.Max, res.Stages.Calls, wait)
	}
}

// TestRunRetriesLaterEnd: a call refused for now more often than
// RetryLater allows ends with the last refusal (denied); with RetryLater
// negative, the first refusal ends it.
func TestRunRetriesLaterEnd(t *testing.T) {
	l := drvStart(t, drvOptions{noPolicies: true, policyRetryAfter: 20 * time.Millisecond})
	for _, tc := range []struct {
		retryLater int
		sends      int64 // per call
	}{{2, 3}, {-1, 1}} {
		runID := fmt.Sprintf("rend%d", tc.retryLater+1)
		before := drvRequests(t, l.kafka)
		cfg := l.config("create_ticket", runID)
		cfg.Calls, cfg.RetryLater = 10, tc.retryLater
		res, err := l.run(cfg)
		if err != nil {
			t.Fatalf("RetryLater %d: Run: %v", tc.retryLater, err)
		}
		if res.Finished != 10 || res.Lost != 0 || res.ByState["denied"] != 10 {
			t.Errorf("RetryLater %d: Finished, Lost, ByState = %d, %d, %v; want 10 denied", tc.retryLater, res.Finished, res.Lost, res.ByState)
		}
		if want := 10 * (tc.sends - 1); res.RetriedLater != want {
			t.Errorf("RetryLater %d: RetriedLater = %d; want %d", tc.retryLater, res.RetriedLater, want)
		}
		if got := drvRequests(t, l.kafka) - before; got != 10*tc.sends {
			t.Errorf("RetryLater %d: %d envelopes sent; want %d", tc.retryLater, got, 10*tc.sends)
		}
	}

	// A wait longer than the whole drain is not waited out: the
	// refusal ends the call.
	long := drvStart(t, drvOptions{noPolicies: true, policyRetryAfter: time.Minute})
	cfg := long.config("create_ticket", "rendlong")
	cfg.Calls = 10
	res, err := long.run(cfg)
	if err != nil {
		t.Fatalf("a wait past the drain: Run: %v", err)
	}
	if res.ByState["denied"] != 10 || res.Lost != 0 || res.RetriedLater != 0 {
		t.Errorf("a wait past the %v drain: ByState, Lost, RetriedLater = %v, %d, %d; want 10 denied, none sent again", cfg.Drain, res.ByState, res.Lost, res.RetriedLater)
	}

	// Nor is a wait whose resend would not be answered before the drain
	// ends (1 s of a 3 s drain, and about a second for the answer): the
	// first refusals come early and are waited out, the next ones end
	// their calls rather than leave them lost to a resend the run's end
	// would cancel (the fourth sending, at about 3 s, before).
	late := drvStart(t, drvOptions{noPolicies: true, policyRetryAfter: time.Second})
	cfg = late.config("create_ticket", "rendlate")
	cfg.Calls, cfg.Drain = 10, 3*time.Second
	res, err = late.run(cfg)
	if err != nil {
		t.Fatalf("a wait past the drain's end: Run: %v", err)
	}
	if res.ByState["denied"] != 10 || res.Lost != 0 || res.RetriedLater > 10 {
		t.Errorf("a wait past the drain's end: ByState, Lost, RetriedLater = %v, %d, %d; want 10 denied, each sent again at most once", res.ByState, res.Lost, res.RetriedLater)
	}
}

// TestRunSaturated: an open loop stops submitting once MaxInFlight calls
// wait, rather than queueing without bound.
func TestRunSaturated(t *testing.T) {
	l := drvNewLedger(t, false)
	cfg := l.config("get_weather", "rsat")
	cfg.Calls, cfg.Rate, cfg.MaxInFlight, cfg.Drain = 50, 1000, 5, 300*time.Millisecond
	res, err := l.run(cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if !res.Saturated || res.Mode != "open" {
		t.Errorf("Saturated, Mode = %v, %q; want true, open", res.Saturated, res.Mode)
	}
	if res.Submitted != 5 || res.Lost != 5 || res.Finished != 0 {
		t.Errorf("Submitted, Lost, Finished = %d, %d, %d; want 5, 5, 0", res.Submitted, res.Lost, res.Finished)
	}
}

// drvMinter counts its mints and fails them with err when set.
type drvMinter struct {
	inner Minter
	err   error
	n     atomic.Int64
}

func (m *drvMinter) Mint(id identity.Identity, audience string, ttl time.Duration) (string, error) {
	m.n.Add(1)
	if m.err != nil {
		return "", m.err
	}
	return m.inner.Mint(id, audience, ttl)
}

// drvRequests returns the records on the request topic.
func drvRequests(t *testing.T, k *ledgertest.Kafka) int64 {
	t.Helper()
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatalf("client: %v", err)
	}
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListEndOffsets(t.Context(), k.Topics.Requests)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		t.Fatalf("end offsets of %s: %v", k.Topics.Requests, err)
	}
	var n int64
	ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
	return n
}

func TestRunConfigErrors(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 4})
	iss, err := identity.LoadOrCreateIssuer(filepath.Join(t.TempDir(), "issuer.key"), drvIssuer)
	if err != nil {
		t.Fatalf("issuer: %v", err)
	}
	tools, err := ParseMix("get_weather")
	if err != nil {
		t.Fatal(err)
	}
	valid := func(m Minter) Config {
		return Config{Client: k.Client, Topics: k.Topics, Minter: m, Tools: tools, Calls: 10, Drain: time.Second}
	}
	mintErr := errors.New("minter down")
	cases := []struct {
		name    string
		mut     func(*Config)
		mintErr error
		want    string // in the error
	}{
		{name: "no tools", mut: func(c *Config) { c.Tools = nil }, want: "required"},
		{name: "no minter", mut: func(c *Config) { c.Minter = nil }, want: "required"},
		{name: "no brokers", mut: func(c *Config) { c.Client.Brokers = nil }, want: "required"},
		{name: "no calls and no duration", mut: func(c *Config) { c.Calls, c.Duration = 0, 0 }, want: "Calls or Duration"},
		{name: "negative calls and duration", mut: func(c *Config) { c.Calls, c.Duration = -1, -time.Second }, want: "Calls or Duration"},
		{name: "run id with a dash", mut: func(c *Config) { c.RunID = "run-1" }, want: "run id"},
		{name: "run id with a slash", mut: func(c *Config) { c.RunID = "run/1" }, want: "run id"},
		{name: "run id with a colon", mut: func(c *Config) { c.RunID = "run:1" }, want: "run id"},
		{name: "run id not ASCII", mut: func(c *Config) { c.RunID = "runé" }, want: "run id"},
		{name: "run id with a space", mut: func(c *Config) { c.RunID = "run 1" }, want: "run id"},
		{name: "tool without weight", mut: func(c *Config) {
			c.Tools = []Tool{{Name: "get_weather", Version: 1, Args: tools[0].Args}}
		}, want: "positive weight"},
		{name: "tool without arguments", mut: func(c *Config) {
			c.Tools = []Tool{{Name: "get_weather", Version: 1, Weight: 1}}
		}, want: "positive weight"},
		{name: "tool without name", mut: func(c *Config) {
			c.Tools = []Tool{{Version: 1, Weight: 1, Args: tools[0].Args}}
		}, want: "positive weight"},
		{name: "minter fails", mut: func(*Config) {}, mintErr: mintErr, want: "minter down"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := &drvMinter{inner: iss, err: tc.mintErr}
			cfg := valid(m)
			tc.mut(&cfg)
			res, err := Run(t.Context(), cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Run error = %v; want one containing %q", err, tc.want)
			}
			if tc.mintErr != nil && !errors.Is(err, tc.mintErr) {
				t.Errorf("Run error = %v; want the minter's error", err)
			}
			if diff := cmp.Diff(Result{}, res, cmpopts.IgnoreUnexported(Result{})); diff != "" {
				t.Errorf("Result of a failed Run (-want +got):\n%s", diff)
			}
			if tc.mintErr == nil && m.n.Load() != 0 {
				t.Errorf("minted %d assertions for an invalid config; want 0", m.n.Load())
			}
		})
	}
	if n := drvRequests(t, k); n != 0 {
		t.Errorf("request topic holds %d records after invalid runs; want 0", n)
	}
}

func TestParseMix(t *testing.T) {
	type tool struct {
		Name    string
		Version int
		Weight  int
	}
	cases := []struct {
		mix     string
		want    []tool
		wantErr string
	}{
		{mix: "get_weather=3,create_ticket=1", want: []tool{{"get_weather", 1, 3}, {"create_ticket", 1, 1}}},
		{mix: "get_weather,create_ticket", want: []tool{{"get_weather", 1, 1}, {"create_ticket", 1, 1}}},
		{mix: " refund_order=2 , get_weather ,", want: []tool{{"refund_order", 1, 2}, {"get_weather", 1, 1}}},
		{mix: "get_weather=3,nope=1", wantErr: `"nope"`},
		{mix: "cancel_refund", wantErr: `"cancel_refund"`},
		{mix: "create_ticket=6,send_email", want: []tool{{"create_ticket", 1, 6}, {"send_email", 1, 1}}},
		{mix: "get_weather=0", wantErr: "must be positive"},
		{mix: "get_weather=-2", wantErr: "must be positive"},
		{mix: "get_weather=x", wantErr: "weight of get_weather"},
		{mix: "get_weather=", wantErr: "weight of get_weather"},
		{mix: "", wantErr: "names no tool"},
		{mix: " , ,", wantErr: "names no tool"},
	}
	for _, tc := range cases {
		t.Run(tc.mix, func(t *testing.T) {
			got, err := ParseMix(tc.mix)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("ParseMix(%q) = %v, %v; want an error containing %q", tc.mix, got, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseMix(%q): %v", tc.mix, err)
			}
			var gotTools []tool
			for _, g := range got {
				gotTools = append(gotTools, tool{g.Name, g.Version, g.Weight})
				if g.Args == nil {
					t.Errorf("tool %s has no arguments", g.Name)
				}
			}
			if diff := cmp.Diff(tc.want, gotTools); diff != "" {
				t.Errorf("ParseMix(%q) (-want +got):\n%s", tc.mix, diff)
			}
		})
	}
}

// TestDemoToolArguments: every call's arguments are valid input for the
// demo registry's tool, and a refund and an email stay within what policy
// allows without approval.
func TestDemoToolArguments(t *testing.T) {
	reg, err := schemas.Demo()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"get_weather", "create_ticket", "refund_order", "send_email"} {
		tool, err := DemoTool(name, 1)
		if err != nil {
			t.Fatalf("DemoTool(%s): %v", name, err)
		}
		def, err := reg.Lookup(name, tool.Version)
		if err != nil {
			t.Fatalf("registry lookup %s.v%d: %v", name, tool.Version, err)
		}
		for i := range int64(1000) {
			raw, err := json.Marshal(tool.Args(i))
			if err != nil {
				t.Fatalf("%s call %d: %v", name, i, err)
			}
			tree, err := ledger.Decode(raw, ledger.Limits{})
			if err != nil {
				t.Fatalf("%s call %d: decode %s: %v", name, i, raw, err)
			}
			if err := def.Validate(tree); err != nil {
				t.Fatalf("%s call %d: arguments %s: %v", name, i, raw, err)
			}
			if name == "refund_order" {
				if c := tool.Args(i)["amount_cents"].(int64); c <= 0 || c > 10000 {
					t.Fatalf("refund call %d: amount_cents %d; want in (0, 10000], allowed without approval", i, c)
				}
			}
			if to := tool.Args(i)["to"]; name == "send_email" && !strings.HasSuffix(to.(string), "@example.com") {
				t.Fatalf("email call %d to %s; want @example.com, the tenant's own domain, sent without approval", i, to)
			}
		}
	}
}

// TestMixPick: over any whole number of rounds of the total weight, every
// tool gets exactly its share, and consecutive calls interleave.
func TestMixPick(t *testing.T) {
	cases := []struct {
		mix    string
		rounds int64
		want   map[string]int64
	}{
		{"get_weather=3,create_ticket=1", 100, map[string]int64{"get_weather": 300, "create_ticket": 100}},
		{"get_weather,create_ticket", 7, map[string]int64{"get_weather": 7, "create_ticket": 7}},
		{"refund_order=2,get_weather=5,create_ticket=3", 11, map[string]int64{"refund_order": 22, "get_weather": 55, "create_ticket": 33}},
		{"create_ticket=1", 5, map[string]int64{"create_ticket": 5}},
	}
	for _, tc := range cases {
		t.Run(tc.mix, func(t *testing.T) {
			tools, err := ParseMix(tc.mix)
			if err != nil {
				t.Fatal(err)
			}
			var total int64
			for _, tl := range tools {
				total += int64(tl.Weight)
			}
			m := newMix(tools)
			got := make(map[string]int64)
			for i := range tc.rounds * total {
				got[m.pick(i).Name]++
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("picks over %d calls (-want +got):\n%s", tc.rounds*total, diff)
			}
		})
	}
}

// TestCallKey: the key a call is published under comes back to its index
// from the form the ledger sends downstream, and from no other run's.
func TestCallKey(t *testing.T) {
	seen := make(map[string]int64)
	for _, i := range []int64{0, 1, 2, 63, 64, 999, 1 << 20, 1<<32 - 1} {
		key := callKey("b12", i)
		if j, dup := seen[key]; dup {
			t.Errorf("callKey(b12, %d) = callKey(b12, %d) = %q", i, j, key)
		}
		seen[key] = i
		if got, ok := callIndex(tenantName(int(i%3))+"/"+key, "b12"); !ok || got != i {
			t.Errorf("callIndex(<tenant>/%s, b12) = %d, %v; want %d, true", key, got, ok, i)
		}
		for _, other := range []string{"b1", "b123", "xb12", "12"} {
			if got, ok := callIndex(tenantName(0)+"/"+key, other); ok {
				t.Errorf("callIndex(<tenant>/%s, %s) = %d, true; want no match for another run", key, other, got)
			}
		}
		if got, ok := callIndex(key, "b12"); ok {
			t.Errorf("callIndex(%s, b12) without a tenant = %d, true; want no match", key, got)
		}
	}
	for _, key := range []string{"t/", "t/00000000:b12-", "t/00000000:b12-x", "t/00000000:b12--1", "t/00000000:b12-1.5"} {
		if got, ok := callIndex(key, "b12"); ok {
			t.Errorf("callIndex(%q, b12) = %d, true; want no match", key, got)
		}
	}
}

func TestResultPoint(t *testing.T) {
	res := Result{
		Offered: 500, PerSec: 480,
		E2E: Percentiles{P50: 1 * time.Millisecond, P95: 2 * time.Millisecond, P99: 3 * time.Millisecond, P999: 4 * time.Millisecond, Max: 5 * time.Millisecond},
	}
	want := LoadPoint{Offered: 500, Achieved: 480, P50: time.Millisecond, P95: 2 * time.Millisecond, P99: 3 * time.Millisecond, P999: 4 * time.Millisecond}
	if diff := cmp.Diff(want, res.Point()); diff != "" {
		t.Errorf("Point (-want +got):\n%s", diff)
	}
}

func TestDirect(t *testing.T) {
	backend := demobackend.New(demobackend.Config{})
	srv := httptest.NewServer(backend.Handler())
	t.Cleanup(func() { backend.Close(); srv.Close() })
	tools, err := ParseMix("get_weather=3,create_ticket=1")
	if err != nil {
		t.Fatal(err)
	}
	cl := httptool.New(httptool.Config{})
	call := func(ctx context.Context, tool Tool, tenant, key string, args []byte) error {
		_, err := cl.Call(ctx, httptool.Request{
			URL: srv.URL + "/tools/" + tool.Name, IdempotencyKey: key, TenantID: tenant,
			CallID: "call_" + key, Attempt: 1, Arguments: args,
		})
		return err
	}
	rep, err := Direct(t.Context(), DirectConfig{Tools: tools, Calls: 200, Concurrency: 8, Tenants: 2, RunID: "d1", Call: call})
	if err != nil {
		t.Fatalf("Direct: %v", err)
	}
	if rep.Calls != 200 || rep.Errors != 0 || rep.PerSec <= 0 || rep.Elapsed <= 0 {
		t.Errorf("Direct = %+v; want 200 calls, no errors, a positive rate", rep)
	}
	drvCheckPercentiles(t, "Latency", rep.Latency)
	byTool, byTenant := make(map[string]int64), make(map[string]int64)
	keys := make(map[string]bool)
	for _, ef := range backend.Effects() {
		byTool[ef.Tool]++
		byTenant[ef.TenantID]++
		keys[ef.IdempotencyKey] = true
	}
	if diff := cmp.Diff(map[string]int64{"get_weather": 150, "create_ticket": 50}, byTool); diff != "" {
		t.Errorf("backend requests by tool (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(map[string]int64{"t_bench0": 100, "t_bench1": 100}, byTenant); diff != "" {
		t.Errorf("backend requests by tenant (-want +got):\n%s", diff)
	}
	if len(keys) != 200 {
		t.Errorf("backend saw %d distinct keys; want 200", len(keys))
	}

	// Failing calls are counted, the first error returned, and the rest
	// still made.
	boom := errors.New("boom")
	var n atomic.Int64
	rep, err = Direct(t.Context(), DirectConfig{Tools: tools, Calls: 50, Concurrency: 4, RunID: "d2",
		Call: func(context.Context, Tool, string, string, []byte) error {
			if n.Add(1)%5 == 0 {
				return boom
			}
			return nil
		}})
	if !errors.Is(err, boom) {
		t.Errorf("Direct error = %v; want %v", err, boom)
	}
	if rep.Calls != 50 || rep.Errors != 10 {
		t.Errorf("Calls, Errors = %d, %d; want 50, 10", rep.Calls, rep.Errors)
	}

	for name, cfg := range map[string]DirectConfig{
		"no call":        {Tools: tools, Calls: 1, Concurrency: 1},
		"no tools":       {Calls: 1, Concurrency: 1, Call: call},
		"no calls":       {Tools: tools, Concurrency: 1, Call: call},
		"no concurrency": {Tools: tools, Calls: 1, Call: call},
	} {
		if _, err := Direct(t.Context(), cfg); err == nil {
			t.Errorf("Direct with %s: no error", name)
		}
	}
}

// TestRunResultSettled: what Run returns no longer changes: the events
// follower has stopped, so its counts agree with each other however many
// calls were still in flight when the drain ended.
func TestRunResultSettled(t *testing.T) {
	l := drvNewLedger(t, true)
	for k := range 5 {
		cfg := l.config("get_weather", fmt.Sprintf("rsettled%d", k))
		cfg.Calls, cfg.Concurrency, cfg.Drain = 300, 64, time.Nanosecond
		res, err := l.run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // time for a follower still running to write
		var byState, bits int64
		for _, v := range res.ByState {
			byState += v
		}
		for i := range int64(300) {
			if res.Succeeded(i) {
				bits++
			}
		}
		if byState != res.Finished || bits != res.ByState["succeeded"] || res.Finished+res.Lost != res.Submitted {
			t.Fatalf("run %d: finished %d, lost %d, submitted %d, states %v, succeeded bits %d: the result changed after Run returned",
				k, res.Finished, res.Lost, res.Submitted, res.ByState, bits)
		}
	}
}

// TestRunStalledClosedLoop: a closed loop on a ledger that finishes
// nothing stops after Drain, with the calls in flight lost, instead of
// waiting for its context.
func TestRunStalledClosedLoop(t *testing.T) {
	l := drvNewLedger(t, false)
	cfg := l.config("get_weather", "rstalled")
	cfg.Calls, cfg.Concurrency, cfg.Drain = 20, 4, time.Second
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	start := time.Now()
	res, err := Run(ctx, cfg)
	if err != nil {
		t.Fatalf("Run = %v; want the stall measured, not an error", err)
	}
	if res.Submitted != 4 || res.Lost != 4 || res.Finished != 0 {
		t.Errorf("submitted %d, lost %d, finished %d; want 4 submitted and lost", res.Submitted, res.Lost, res.Finished)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("Run took %s on a stalled ledger; want about two drains", d)
	}
}

// drvEnvelope builds call i of r and decodes it back.
func drvEnvelope(t *testing.T, r *run, i int64) ledger.Envelope {
	t.Helper()
	rec, err := r.envelope(i)
	if err != nil {
		t.Fatal(err)
	}
	var env ledger.Envelope
	if err := json.Unmarshal(rec.Value, &env); err != nil {
		t.Fatal(err)
	}
	return env
}

// TestEnvelopeKeysAndDeadlines: CallKey names exactly the key and tenant
// that call i is published under, and a tool's own deadline wins over the
// run's.
func TestEnvelopeKeysAndDeadlines(t *testing.T) {
	weather, err := DemoTool("get_weather", 1)
	if err != nil {
		t.Fatal(err)
	}
	refund, err := DemoTool("refund_order", 1)
	if err != nil {
		t.Fatal(err)
	}
	refund.DeadlineMS = 5_000
	cfg := Config{RunID: "k1", Tenants: 3, DeadlineMS: 60_000, Tools: []Tool{weather, refund}}
	later := time.Now().Add(time.Hour)
	r := &run{cfg: cfg, mix: newMix(cfg.Tools), tokens: []assertion{{"a0", later}, {"a1", later}, {"a2", later}}}
	for i := range int64(12) {
		env := drvEnvelope(t, r, i)
		want := CallKey(cfg.RunID, cfg.Tenants, i)
		if got := env.Key(); got != want {
			t.Errorf("call %d published as %v; CallKey says %v", i, got, want)
		}
		wantDeadline := int64(60_000)
		if env.Tool == "refund_order" {
			wantDeadline = 5_000
		}
		if env.DeadlineMS != wantDeadline {
			t.Errorf("call %d (%s): deadline %d ms; want %d", i, env.Tool, env.DeadlineMS, wantDeadline)
		}
	}
}

// TestBenchAssertionsWithinMaxLifetime: the bench's agents mint
// assertions the verifier's default bound accepts, and renew a tenant's
// once half of it has passed, so that a run longer than the bound goes on
// with valid assertions instead of one minted for the whole run.
func TestBenchAssertionsWithinMaxLifetime(t *testing.T) {
	iss, err := identity.LoadOrCreateIssuer(filepath.Join(t.TempDir(), "issuer.key"), drvIssuer)
	if err != nil {
		t.Fatal(err)
	}
	v, err := identity.New(t.Context(), identity.Config{Issuer: drvIssuer, Keys: iss.Keys()})
	if err != nil {
		t.Fatal(err)
	}
	weather, err := DemoTool("get_weather", 1)
	if err != nil {
		t.Fatal(err)
	}
	m := &drvMinter{inner: iss}
	cfg := Config{RunID: "life", Tenants: 2, Audience: identity.DefaultAudience, Minter: m, Tools: []Tool{weather}}
	r := &run{cfg: cfg, mix: newMix(cfg.Tools), tokens: make([]assertion, cfg.Tenants)}
	for tenant := range cfg.Tenants {
		if err := r.mint(tenant, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	assertionOf := func(i int64) string {
		t.Helper()
		env := drvEnvelope(t, r, i)
		if _, err := v.Verify(t.Context(), env.Assertion); err != nil {
			t.Fatalf("call %d: Verify(bench assertion) = %v; want it within the default bound", i, err)
		}
		return env.Assertion
	}
	first := assertionOf(0)
	if again := assertionOf(2); again != first || m.n.Load() != 2 {
		t.Errorf("tenant 0's second call minted again (%d mints); want the assertion reused until its renewal", m.n.Load())
	}
	// Half its life gone: the next call of tenant 0 carries a new one.
	r.tokens[0].renew = time.Now().Add(-time.Second)
	if renewed := assertionOf(4); renewed == first || m.n.Load() != 3 {
		t.Errorf("after the renewal time: same assertion %v, %d mints; want a new one, 3 mints", renewed == first, m.n.Load())
	}
	if until := time.Until(r.tokens[0].renew); until <= 0 || until > assertionTTL/2 {
		t.Errorf("next renewal in %s; want within half of %s", until, assertionTTL)
	}
}

// TestRunUntil: Until extends an open loop past Duration while it says so,
// and MaxDuration bounds the extension, on the arrival schedule.
func TestRunUntil(t *testing.T) {
	l := drvNewLedger(t, true)
	t.Run("extended", func(t *testing.T) {
		cfg := l.config("get_weather", "runtil")
		cfg.Rate, cfg.Duration, cfg.MaxDuration = 100, 200*time.Millisecond, 5*time.Second
		// Extended until 60 calls were published: counted, not timed
		// from before the run, whose set-up on a busy machine can take
		// longer than the extension (Until was then true at once).
		// Each call once, so that OnSubmit runs on the submitting
		// goroutine only.
		cfg.RetryLater = -1
		var published int
		cfg.OnSubmit = func(*kgo.Record, time.Time) { published++ }
		cfg.Until = func() bool { return published >= 60 }
		res, err := l.run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		// Duration alone gives 21 arrivals (0 to 200 ms at 100/s); the
		// extension ends at the first arrival after the 60th.
		if res.Submitted < 60 || res.Submitted > 62 || res.Lost != 0 {
			t.Errorf("submitted %d, lost %d; want 60 or just past (extended until 60 were published), none lost", res.Submitted, res.Lost)
		}
	})
	t.Run("capped", func(t *testing.T) {
		cfg := l.config("get_weather", "rcap")
		cfg.Rate, cfg.Duration, cfg.MaxDuration = 100, 200*time.Millisecond, 500*time.Millisecond
		cfg.Until = func() bool { return false }
		// Each call once: nothing sent again, so that OnSubmit runs on
		// the submitting goroutine only.
		cfg.RetryLater = -1
		var recorded []string
		cfg.OnSubmit = func(rec *kgo.Record, _ time.Time) { recorded = append(recorded, string(rec.Key)) }
		res, err := l.run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(recorded)) != res.Submitted || len(recorded) == 0 || recorded[0] != CallKey("rcap", 3, 0).String() {
			t.Errorf("OnSubmit saw %d records (first %q); want every one of the %d submitted, call 0 first", len(recorded), recorded[0:min(1, len(recorded))], res.Submitted)
		}
		// Arrivals at 0, 10, ..., 500 ms: the cap is on the schedule.
		if res.Submitted != 51 || res.Lost != 0 {
			t.Errorf("submitted %d, lost %d; want 51 (capped at 500 ms), none lost", res.Submitted, res.Lost)
		}
	})
}
