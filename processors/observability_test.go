package processors_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/processors/tracing"
	"github.com/toolcall-ledger/ledger/statemachine"
)

func hasAttr(attrs []attribute.KeyValue, key, value string) bool {
	for _, a := range attrs {
		if string(a.Key) == key && a.Value.AsString() == value {
			return true
		}
	}
	return false
}

// metricValue is the value of the series name{labels} in g (a counter's
// or gauge's value, a histogram's sample count), and whether it exists.
func metricValue(t *testing.T, reg *metrics.Registry, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	fams, err := reg.Gatherer().Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue series
				}
			}
			return value(m), true
		}
	}
	return 0, false
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount())
	}
	return 0
}

// TestObservability runs calls through an intake and an executor that
// report to metrics registries and log JSON, and checks the three things
// an operator reads: the metrics count what happened (calls by tool and
// decision and outcome, stage latencies, claims, breakers, bulkheads),
// every log line about a call names its call key and trace, and the
// ledger's spans join the agent's trace and reach the tool as its W3C
// traceparent.
func TestObservability(t *testing.T) {
	h := newHarness(t, storeSQL, 4)
	inMetrics, xMetrics := metrics.New("intake", h.reg.Has), metrics.New("executor", h.reg.Has)

	in, err := intake.New(intake.Config{
		Registry: h.reg, Store: h.store, Topics: h.kafka.Topics, Actor: "intake-1", Logger: h.logger,
		Identity: h.ident.Verifier, Policy: h.policy,
	})
	if err != nil {
		t.Fatal(err)
	}
	inLoop, err := in.Loop(ledger.LoopConfig{Client: h.kafka.Client, Group: h.kafka.Group("intake"), Tick: 100 * time.Millisecond, Metrics: inMetrics})
	if err != nil {
		t.Fatal(err)
	}
	h.run("intake", inLoop.Run)

	var logs ledgertest.LogBuffer
	cfg := h.executorConfig("executor-1")
	cfg.Logger = slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	cfg.Metrics = xMetrics
	spans := tracetest.NewInMemoryExporter()
	tp, err := tracing.NewProvider(t.Context(), tracing.Config{Service: "toolcall-ledger-executor", Exporter: spans})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	cfg.Tracer = tp.Tracer()
	x, err := executor.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	xMetrics.Breakers(x.BreakerStates)
	xMetrics.Bulkheads(func() map[string]metrics.Bulkhead { return metrics.BulkheadsOf(x.Bulkheads()) }, x.InFlight)
	xLoop, err := x.Loop(ledger.LoopConfig{Client: h.kafka.Client, Group: h.kafka.Group("executor"), Tick: 100 * time.Millisecond, Metrics: xMetrics})
	if err != nil {
		t.Fatal(err)
	}
	h.run("executor", xLoop.Run)

	// The ticket's first attempt fails (5xx before apply) and is retried:
	// the executor logs the failed attempt, about that call.
	h.backend.SetTenantFault("create_ticket", "t_b", demobackend.Fault{FailStatus: http.StatusServiceUnavailable, FailTimes: 1})
	const w3cTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	ticket := h.newEnvelope("t_b", "ticket-obs", "create_ticket", map[string]any{"title": "Printer on fire"})
	ticket.TraceID = w3cTrace
	weather := h.newEnvelope("t_a", "weather-obs", "get_weather", map[string]any{"city": "Sydney"})
	// A whole traceparent: the agent's span is the parent of the
	// ledger's.
	const agentTrace, agentSpan = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	weather.TraceID = "00-" + agentTrace + "-" + agentSpan + "-01"
	denied := h.newEnvelope("t_a", "refund-obs", "refund_order", map[string]any{"order_id": "ord_1", "amount_cents": 4500, "currency": "AUD"})
	// A tool nobody registered: refused, and counted without its name.
	madeUp := h.newEnvelope("t_a", "made-up-obs", "tool_made_up_by_the_sender", map[string]any{})
	h.submit(ticket, weather, denied, madeUp)
	calls := h.waitSettled(30*time.Second, ticket.key(), weather.key(), denied.key())
	for _, e := range []envelope{ticket, weather} {
		if c := calls[e.key()]; c.State != statemachine.StateSucceeded {
			t.Fatalf("%s settled as %s; want succeeded", e.key(), c.State)
		}
	}
	deniedType := calls[denied.key()].Events[len(calls[denied.key()].Events)-1].Type

	t.Run("spans", func(t *testing.T) {
		if err := tp.ForceFlush(t.Context()); err != nil {
			t.Fatal(err)
		}
		got := spans.GetSpans()
		for _, c := range []struct {
			e          envelope
			trace      string
			parentSpan string // of ledger.execute; "" for a root span
			attempts   int    // tool.call spans
		}{
			{ticket, w3cTrace, "", 2}, // the first attempt got a 503
			{weather, agentTrace, agentSpan, 1},
		} {
			key := c.e.key().String()
			var exec *tracetest.SpanStub
			var toolCalls []tracetest.SpanStub
			for i := range got {
				s := &got[i]
				if s.Name == "ledger.execute" && hasAttr(s.Attributes, "ledger.call_key", key) {
					exec = s
				}
			}
			if exec == nil {
				t.Errorf("%s: no ledger.execute span among %d", key, len(got))
				continue
			}
			if tid := exec.SpanContext.TraceID().String(); tid != c.trace {
				t.Errorf("%s: ledger.execute in trace %s; want the agent's %s", key, tid, c.trace)
			}
			if p := exec.Parent; (c.parentSpan == "") == p.IsValid() || (c.parentSpan != "" && p.SpanID().String() != c.parentSpan) {
				t.Errorf("%s: ledger.execute's parent %v; want span %q", key, p.SpanID(), c.parentSpan)
			}
			for _, s := range got {
				if s.Name == "tool.call" && s.Parent.SpanID() == exec.SpanContext.SpanID() {
					toolCalls = append(toolCalls, s)
				}
			}
			if len(toolCalls) != c.attempts {
				t.Errorf("%s: %d tool.call spans under ledger.execute; want %d", key, len(toolCalls), c.attempts)
			}
			// The tool saw the applied attempt's span as its parent.
			var seen int
			for _, ef := range h.backend.Effects() {
				if ef.IdempotencyKey != key {
					continue
				}
				seen++
				var match bool
				for _, s := range toolCalls {
					match = match || ef.Traceparent == tracing.Traceparent(s.SpanContext)
				}
				if !match || !strings.HasPrefix(ef.Traceparent, "00-"+c.trace+"-") {
					t.Errorf("%s attempt %d reached the tool with traceparent %q; want a tool.call span's of trace %s", key, ef.Attempt, ef.Traceparent, c.trace)
				}
			}
			if seen == 0 {
				t.Errorf("%s: no effect at the tool", key)
			}
		}
	})

	t.Run("metrics", func(t *testing.T) {
		for _, c := range []struct {
			reg    *metrics.Registry
			name   string
			labels map[string]string
		}{
			{inMetrics, "ledger_events_total", map[string]string{"role": "intake", "type": "authorized", "tool": "create_ticket"}},
			{inMetrics, "ledger_events_total", map[string]string{"role": "intake", "type": "authorized", "tool": "get_weather"}},
			{inMetrics, "ledger_events_total", map[string]string{"role": "intake", "type": string(deniedType), "tool": "refund_order"}},
			{inMetrics, "ledger_transactions_total", map[string]string{"result": "committed"}},
			{inMetrics, "ledger_stage_duration_seconds", map[string]string{"stage": "step"}},
			{xMetrics, "ledger_events_total", map[string]string{"role": "executor", "type": "succeeded", "tool": "create_ticket"}},
			{xMetrics, "ledger_events_total", map[string]string{"role": "executor", "type": "succeeded", "tool": "get_weather"}},
			{xMetrics, "ledger_claims_total", map[string]string{"result": "claimed"}},
			{xMetrics, "ledger_stage_duration_seconds", map[string]string{"stage": "claim"}},
			{xMetrics, "ledger_stage_duration_seconds", map[string]string{"stage": "complete"}},
			{xMetrics, "ledger_tool_call_duration_seconds", map[string]string{"tool": "create_ticket", "result": "ok"}},
			{xMetrics, "ledger_tool_call_duration_seconds", map[string]string{"tool": "create_ticket", "result": "error"}},
			{xMetrics, "ledger_bulkhead_size", map[string]string{"tool": "create_ticket"}},
			{xMetrics, "ledger_calls_in_flight_max", nil},
			{xMetrics, "process_resident_memory_bytes", nil},
		} {
			if v, ok := metricValue(t, c.reg, c.name, c.labels); !ok || v <= 0 {
				t.Errorf("%s%v = %v (present %v); want > 0", c.name, c.labels, v, ok)
			}
		}
		// The breaker of t_b's create_ticket exists and is closed (one
		// failure is under its minimum).
		if v, ok := metricValue(t, xMetrics, "ledger_breaker_state", map[string]string{"tool": "create_ticket", "tenant": "t_b"}); !ok || v != 0 {
			t.Errorf("ledger_breaker_state{create_ticket,t_b} = %v (present %v); want 0 (closed)", v, ok)
		}
		if v, _ := metricValue(t, xMetrics, "ledger_events_total", map[string]string{"type": "succeeded", "tool": "create_ticket"}); v != 1 {
			t.Errorf("executor counted %v create_ticket successes; want 1", v)
		}
		ledgertest.WaitFor(t, 30*time.Second, func() error {
			if v, _ := metricValue(t, inMetrics, "ledger_events_total", map[string]string{"type": "denied", "tool": metrics.UnregisteredTool}); v != 1 {
				return fmt.Errorf("intake counted %v refusals of unregistered tools; want 1", v)
			}
			return nil
		})
		if v, ok := metricValue(t, inMetrics, "ledger_events_total", map[string]string{"tool": madeUp.Tool}); ok {
			t.Errorf("ledger_events_total has a series of the made-up tool %q (%v); want none", madeUp.Tool, v)
		}
	})

	t.Run("logs", func(t *testing.T) {
		var about int
		for _, line := range logs.Lines() {
			var m map[string]any
			if err := json.Unmarshal([]byte(line), &m); err != nil {
				t.Fatalf("log line is not JSON: %q: %v", line, err)
			}
			key, ok := m["call_key"].(string)
			if !ok {
				continue
			}
			about++
			want := map[string]string{ticket.key().String(): ticket.TraceID, weather.key().String(): weather.TraceID}[key]
			if got, _ := m["trace_id"].(string); got != want {
				t.Errorf("log line about %s has trace_id %q; want %q: %s", key, got, want, line)
			}
		}
		if about == 0 {
			t.Errorf("no log line about a call; the failed attempt of %s should have one:\n%s", ticket.key(), strings.Join(logs.Lines(), "\n"))
		}
	})
}
