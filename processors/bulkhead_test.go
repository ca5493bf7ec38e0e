package processors_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// The noisy neighbour: one tenant's calls to a tool hang until their
// deadline while seven other tenants call the same tool at the same steady
// rate. The seven's p99 latency (submit to terminal event) must stay
// within 10% of a run where nobody hangs.
//
// The two runs are two ledgers side by side, each with its own Kafka,
// store, backend and processors, sending the same load at the same time:
// whatever else the machine is doing (a CI machine runs other packages'
// tests meanwhile) slows both alike, so the comparison measures the
// hang, not the neighbours.
//
// What is measured is the steady state, after a warm-up of bhWarmRounds
// rounds that both runs have: the first call of a tenant that hangs is
// waited for up to the executor's step budget (nothing tells it apart
// from a slow call yet), and those few calls are not what the
// requirement is about. The warm-up's figures are logged.
const (
	bhTenants    = 8
	bhPerTenant  = 54 // 432 calls a run; after the warm-up 350 of the good tenants' are measured
	bhWarmRounds = 4
	bhEvery      = 15 * time.Millisecond // one call every 15 ms, round robin over the tenants
	bhLatency    = 50 * time.Millisecond // the tool's own time, which dominates p99
	bhDeadline   = 4000                  // ms: tenant 0's calls' deadline, where the hanging ones end
	bhBadTenant  = "t_bh0"
)

// bhRun is what one run measured.
type bhRun struct {
	good []time.Duration // the seven good tenants' latencies after the warm-up
	warm []time.Duration // and during it
	bad  map[string]int  // the hanging tenant's calls by final event and reason
}

func TestHangingTenantLeavesOthersLatencyAlone(t *testing.T) {
	// The stores' files go to memory where the machine has a tmpfs:
	// a disk's fsync stalls (tens of milliseconds, at random, in
	// either run) would otherwise be most of the p99's noise.
	if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
		t.Setenv("TMPDIR", "/dev/shm")
	}
	// The comparison is of two p99s of 350 calls each: one scheduling
	// stall in one run moves its p99 by more than the margin. A failed
	// comparison is measured once more, and the test fails only if both
	// pairs do. A hang that held the others up costs them a step budget
	// or a deadline in every pair, and fails both.
	for pair := 1; ; pair++ {
		a, b, slack := compareTenants(t, pair)
		if b <= a+slack {
			return
		}
		if pair == 2 {
			t.Errorf("good tenants' p99 with one tenant hanging = %v; want within %v of %v (the run without the fault), in both pairs", b, slack, a)
			return
		}
		t.Logf("pair 1: good tenants' p99 with one tenant hanging = %v, more than %v above %v: measuring a second pair", b, slack, a)
	}
}

// compareTenants runs the two ledgers side by side and returns the good
// tenants' p99 without the fault and with it, and the margin allowed.
func compareTenants(t *testing.T, pair int) (base, noisy, slack time.Duration) {
	var without, with bhRun
	t.Run(fmt.Sprintf("side by side %d", pair), func(t *testing.T) {
		t.Run("no fault", func(t *testing.T) {
			t.Parallel()
			without = runTenants(t, false)
		})
		t.Run("tenant 0 hangs", func(t *testing.T) {
			t.Parallel()
			with = runTenants(t, true)
		})
	})
	if len(without.good) == 0 || len(with.good) == 0 {
		t.Fatal("a run measured nothing")
	}
	a, b := percentile(without.good, 0.99), percentile(with.good, 0.99)
	t.Logf("pair %d, good tenants, no fault:     p50 %v p90 %v p99 %v max %v (%d calls)", pair, percentile(without.good, 0.5), percentile(without.good, 0.9), a, percentile(without.good, 1), len(without.good))
	t.Logf("pair %d, good tenants, tenant hangs: p50 %v p90 %v p99 %v max %v (%d calls)", pair, percentile(with.good, 0.5), percentile(with.good, 0.9), b, percentile(with.good, 1), len(with.good))
	t.Logf("pair %d, hanging tenant's calls: %v", pair, with.bad)
	t.Logf("pair %d, warm-up (not measured): good tenants' max %v without the fault, %v with it", pair, percentile(without.warm, 1), percentile(with.warm, 1))
	// The requirement is 10%. A run's p99 also moves by scheduling
	// noise of a few milliseconds, so the test allows 10% or 15 ms,
	// whichever is larger; a hang that held the others up would cost
	// them a step budget or a deadline, far more than that.
	return a, b, max(a/10, 15*time.Millisecond)
}

// runTenants sends bhPerTenant create_ticket calls for each of bhTenants
// tenants at a steady rate, with tenant 0's calls hanging when hang is
// set, and returns the good tenants' latencies once every call settled.
func runTenants(t *testing.T, hang bool) bhRun {
	h := newHarness(t, storeEmbedded, 4, func(c *demobackend.Config) { c.Latency = bhLatency })
	if hang {
		h.backend.SetTenantFault("create_ticket", bhBadTenant, demobackend.Fault{Hang: true})
	}
	h.startIntake("intake-1")
	cfg := h.executorConfig("executor-1")
	// The tenant's own breaker would cut its hang short after a few
	// timeouts (TestBreakerPerTenant in the executor's tests shows that
	// it opens for that tenant only); here the tenant hangs for the
	// whole run, which is what the bulkhead and the carry-over must
	// contain.
	cfg.Breaker.MinRequests, cfg.Breaker.ConsecutiveFailures = 1<<20, 1<<20
	h.startExecutor(cfg)
	w := watchSettled(t, h)

	n := bhTenants * bhPerTenant
	assertions := make([]string, bhTenants)
	for i := range assertions {
		assertions[i] = h.ident.Assertion(t, bhTenant(i), "u_1")
	}
	envs := make([]envelope, n)
	for i := range envs {
		tenant := i % bhTenants
		envs[i] = h.newEnvelopeSigned(bhTenant(tenant), fmt.Sprintf("bh-%04d", i), "create_ticket", map[string]any{"title": fmt.Sprintf("ticket %d", i)}, assertions[tenant])
		if tenant == 0 {
			// Only tenant 0's calls have a deadline: the others'
			// latencies are measured, not cut off.
			envs[i].DeadlineMS = bhDeadline
		}
	}

	sent := make([]time.Time, n)
	tick := time.NewTicker(bhEvery)
	for i, e := range envs {
		<-tick.C
		sent[i] = time.Now()
		h.submit(e)
	}
	tick.Stop()

	keys := make([]ledger.CallKey, n)
	for i, e := range envs {
		keys[i] = e.key()
	}
	ends := w.wait(t, time.Minute, keys)

	run := bhRun{bad: map[string]int{}}
	var notSucceeded []string
	for i, e := range envs {
		k := keys[i]
		end := ends[k]
		tenant := k.TenantID
		if tenant == bhBadTenant && hang {
			run.bad[string(end.ev.Type)+"("+end.ev.Reason+")"]++
			if end.ev.Type == statemachine.EventSucceeded {
				t.Errorf("%s succeeded; its tool hangs for its tenant", k)
			}
			if n := h.backend.AppliedIn(e.Tool, tenant, k.String()); n != 0 {
				t.Errorf("%s applied %d times at the tool; a hanging request applies nothing", k, n)
			}
			continue
		}
		switch {
		case tenant == bhBadTenant:
		case i < bhWarmRounds*bhTenants:
			run.warm = append(run.warm, end.at.Sub(sent[i]))
		default:
			run.good = append(run.good, end.at.Sub(sent[i]))
		}
		if end.ev.Type != statemachine.EventSucceeded {
			notSucceeded = append(notSucceeded, fmt.Sprintf("%s %s(%s %s)", k, end.ev.Type, end.ev.Reason, end.ev.ErrorCode))
			continue
		}
		if n := h.backend.AppliedIn(e.Tool, tenant, k.String()); n != 1 {
			t.Errorf("%s applied %d times at the tool; want 1", k, n)
		}
	}
	if len(notSucceeded) > 0 {
		t.Errorf("%d good tenants' calls did not succeed, e.g. %s", len(notSucceeded), notSucceeded[0])
	}
	if hang {
		// The hanging tenant's calls settle at their deadline: sent and
		// unanswered (outcome_unknown, for the reconciler), or never
		// sent because its share of the bulkhead was full (failed), or
		// failed fast once its own breaker opened.
		for outcome := range run.bad {
			switch outcome {
			case "outcome_unknown(" + executor.ReasonOutcomeAmbiguous + ")", "failed(" + executor.ReasonUnavailable + ")",
				"failed(" + executor.ReasonDeadlineExceeded + ")", "expired(" + executor.ReasonDeadlineExceeded + ")":
			default:
				t.Errorf("hanging tenant's calls ended %q; want outcome_unknown or failed at the deadline (all: %v)", outcome, run.bad)
			}
		}
	}
	// Every call is settled in the index too, terminal for the good ones.
	calls := h.waitSettled(30*time.Second, keys...)
	notTerminal := 0
	for _, k := range keys {
		if c := calls[k]; k.TenantID != bhBadTenant && !c.State.Terminal() {
			notTerminal++
		}
	}
	if notTerminal > 0 {
		t.Errorf("%d good tenants' calls are not terminal in the index", notTerminal)
	}
	if dups := h.backend.Duplicates(); len(dups) != 0 {
		t.Errorf("duplicate effects at the tool: %v", dups)
	}
	return run
}

func bhTenant(i int) string { return fmt.Sprintf("t_bh%d", i) }

// settledWatch reads the events topic and notes when each call's first
// settling event (terminal, or outcome_unknown) arrived.
type settledWatch struct {
	mu   sync.Mutex
	ends map[ledger.CallKey]settledAt
}

type settledAt struct {
	at time.Time
	ev ledger.Event
}

func watchSettled(t *testing.T, h *harness) *settledWatch {
	t.Helper()
	cl, err := ledger.NewClient(h.kafka.Client,
		kgo.ConsumeTopics(h.kafka.Topics.Events),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(10*time.Millisecond),
	)
	if err != nil {
		t.Fatal(err)
	}
	w := &settledWatch{ends: map[ledger.CallKey]settledAt{}}
	h.run("settled-watch", func(ctx context.Context) error {
		defer cl.Close()
		for {
			fs := cl.PollFetches(ctx)
			if ctx.Err() != nil {
				return nil
			}
			now := time.Now()
			fs.EachRecord(func(r *kgo.Record) {
				ev, err := ledger.DecodeEvent(r.Value)
				if err != nil {
					return
				}
				if s, ok := statemachine.Target(ev.Type); !ok || !s.Settled() || ev.Type == statemachine.EventApprovalPending {
					return
				}
				w.mu.Lock()
				defer w.mu.Unlock()
				if _, ok := w.ends[ev.Key()]; !ok {
					w.ends[ev.Key()] = settledAt{at: now, ev: ev}
				}
			})
		}
	})
	return w
}

// wait waits until every key settled and returns when and how.
func (w *settledWatch) wait(t *testing.T, timeout time.Duration, keys []ledger.CallKey) map[ledger.CallKey]settledAt {
	t.Helper()
	ledgertest.WaitFor(t, timeout, func() error {
		w.mu.Lock()
		defer w.mu.Unlock()
		missing := 0
		for _, k := range keys {
			if _, ok := w.ends[k]; !ok {
				missing++
			}
		}
		if missing > 0 {
			return fmt.Errorf("%d of %d calls not settled", missing, len(keys))
		}
		return nil
	})
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.ends)
}

// percentile is the q-quantile of ds by the nearest-rank method (q=1: the
// largest).
func percentile(ds []time.Duration, q float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(float64(len(s))*q+0.999999) - 1
	return s[max(0, min(i, len(s)-1))]
}
