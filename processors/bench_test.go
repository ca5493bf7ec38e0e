package processors_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// benchConcurrency is how many calls are in flight at once, closed loop:
// each worker submits a call, waits for its terminal event, and submits
// the next.
const benchConcurrency = 32

// BenchmarkEndToEnd measures calls through the whole ledger on `ledger
// dev`'s engines (kfake, the embedded store) against the same calls made
// directly to the demo backend, side by side in one run. It reports
// calls/s and the p50 / p99 latency from publishing the envelope to the
// terminal event reaching a read_committed consumer.
//
//	go test -run '^$' -bench EndToEnd -benchtime 3000x ./processors/
func BenchmarkEndToEnd(b *testing.B) {
	for _, tool := range []struct {
		name string
		args func(i int) map[string]any
	}{
		{"get_weather", func(i int) map[string]any { return map[string]any{"city": fmt.Sprintf("city %d", i%50)} }},
		{"create_ticket", func(i int) map[string]any { return map[string]any{"title": fmt.Sprintf("ticket %d", i)} }},
	} {
		b.Run("direct/"+tool.name, func(b *testing.B) {
			h := newHarness(b, storeEmbedded, 12)
			cl := httptool.New(httptool.Config{})
			run(b, func(ctx context.Context, i int) error {
				args := mustJSON(b, tool.args(i))
				_, err := cl.Call(ctx, httptool.Request{
					URL: h.tools + "/tools/" + tool.name, IdempotencyKey: fmt.Sprintf("t_bench/direct-%d", i),
					TenantID: "t_bench", CallID: "c", Attempt: 1, Arguments: args,
				})
				return err
			})
		})
		b.Run("ledger/"+tool.name, func(b *testing.B) {
			// The whole path: a verified assertion, a Cedar decision,
			// a per-call credential the tool verifies.
			broker, err := credentials.New(credentials.Config{})
			if err != nil {
				b.Fatal(err)
			}
			verifier, err := credentials.NewVerifier(credentials.VerifierConfig{Audience: demobackend.DefaultAudience, Keys: broker.Keys})
			if err != nil {
				b.Fatal(err)
			}
			h := newHarness(b, storeEmbedded, 12, func(c *demobackend.Config) { c.Credentials = verifier })
			h.startIntake("intake-bench")
			cfg := h.executorConfig("executor-bench")
			cfg.Credentials = broker
			h.startExecutor(cfg)
			w := newTerminalWatcher(b, h)
			run(b, func(ctx context.Context, i int) error {
				e := h.newEnvelope("t_bench", fmt.Sprintf("%s-%d", tool.name, i), tool.name, tool.args(i))
				done := w.expect(e.key().String())
				h.publish(e.key().String(), mustJSON(b, e))
				select {
				case st := <-done:
					if st != statemachine.StateSucceeded {
						return fmt.Errorf("%s ended %s", e.key(), st)
					}
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			})
		})
	}
}

// run calls call b.N times from benchConcurrency workers and reports
// calls/s and latency percentiles.
func run(b *testing.B, call func(ctx context.Context, i int) error) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var (
		next = int64(-1)
		mu   sync.Mutex
		lat  = make([]time.Duration, 0, b.N)
		wg   sync.WaitGroup
	)
	b.ResetTimer()
	start := time.Now()
	for range benchConcurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(atomic.AddInt64(&next, 1))
				if i >= b.N || ctx.Err() != nil {
					return
				}
				t0 := time.Now()
				if err := call(ctx, i); err != nil {
					b.Error(err)
					cancel()
					return
				}
				d := time.Since(t0)
				mu.Lock()
				lat = append(lat, d)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	slices.Sort(lat)
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds()) / 1000
	}
	b.ReportMetric(float64(len(lat))/elapsed.Seconds(), "calls/s")
	b.ReportMetric(pct(0.50), "p50_ms")
	b.ReportMetric(pct(0.99), "p99_ms")
}

// terminalWatcher follows the events topic and tells whoever waits for a
// call when its terminal event is committed.
type terminalWatcher struct {
	mu      sync.Mutex
	waiting map[string]chan statemachine.State
}

func newTerminalWatcher(b *testing.B, h *harness) *terminalWatcher {
	w := &terminalWatcher{waiting: make(map[string]chan statemachine.State)}
	cl, err := ledger.NewClient(h.kafka.Client, kgo.ConsumeTopics(h.kafka.Topics.Events))
	if err != nil {
		b.Fatal(err)
	}
	h.run("watcher", func(ctx context.Context) error {
		defer cl.Close()
		for ctx.Err() == nil {
			cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
				t := statemachine.EventType(ledger.Header(r, ledger.HeaderEventType))
				var st statemachine.State
				switch t {
				case statemachine.EventSucceeded, statemachine.EventFailed, statemachine.EventOutcomeUnknown, statemachine.EventDenied, statemachine.EventExpired:
					st = statemachine.State(t)
				default:
					return
				}
				w.mu.Lock()
				ch := w.waiting[string(r.Key)]
				delete(w.waiting, string(r.Key))
				w.mu.Unlock()
				if ch != nil {
					ch <- st
				}
			})
		}
		return nil
	})
	return w
}

func (w *terminalWatcher) expect(key string) <-chan statemachine.State {
	ch := make(chan statemachine.State, 1)
	w.mu.Lock()
	w.waiting[key] = ch
	w.mu.Unlock()
	return ch
}
