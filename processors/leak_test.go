package processors_test

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// TestNoPerCallGoroutines: once calls are finished, the intake and the
// executor hold no goroutine for them. After 3,000 more calls there are
// about as many goroutines as after the first 300: the loops, and the
// tool connections (up to three goroutines each, one connection per call
// in flight: at most 48 here), which come and go with the load. A leak
// of one goroutine in ten calls would add 300.
func TestNoPerCallGoroutines(t *testing.T) {
	h := newHarness(t, storeEmbedded, 4)
	h.startIntake("intake-leak")
	h.startExecutor(h.executorConfig("executor-leak"))
	assertion := h.ident.Assertion(t, "t_leak", "u_1")
	batch := func(from, n int) {
		t.Helper()
		keys := make([]ledger.CallKey, 0, n)
		for i := from; i < from+n; i++ {
			tool, args := "create_ticket", map[string]any{"title": fmt.Sprintf("leak %d", i)}
			if i%2 == 0 {
				tool, args = "get_weather", map[string]any{"city": "Oslo"}
			}
			e := h.newEnvelopeSigned("t_leak", fmt.Sprintf("leak-%d", i), tool, args, assertion)
			h.submit(e)
			keys = append(keys, e.key())
		}
		h.waitTerminal(time.Minute, keys...)
	}
	batch(0, 300)
	before := settledGoroutines()
	batch(300, 3000)
	var after int
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		after = settledGoroutines()
		if after > before+150 {
			return fmt.Errorf("%d goroutines after 3,000 more calls; %d before", after, before)
		}
		return nil
	})
	t.Logf("goroutines: %d after 300 calls, %d after 3,300", before, after)
}

// settledGoroutines counts goroutines after letting finished ones exit.
func settledGoroutines() int {
	runtime.GC()
	time.Sleep(200 * time.Millisecond)
	return runtime.NumGoroutine()
}
