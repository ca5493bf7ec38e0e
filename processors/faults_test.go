package processors_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// committedTotal sums the offsets group committed on topic.
func committedTotal(ctx context.Context, cl *kgo.Client, group, topic string) (int64, error) {
	offs, err := kadm.NewClient(cl).FetchOffsets(ctx, group)
	if err != nil {
		return 0, err
	}
	var n int64
	offs.Each(func(o kadm.OffsetResponse) {
		if o.Topic == topic && o.Err == nil {
			n += o.At
		}
	})
	return n, nil
}

// Every class of malformed envelope is refused with its reason and the
// pointer of the offending field; none is lost, none reaches a tool, and
// the key stays free for a corrected envelope.
func TestMalformedEnvelopesAreRefusedWithPointer(t *testing.T) {
	h := newHarness(t, storeEmbedded, 4)
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))

	good := h.newEnvelope("t_a", "k", "get_weather", map[string]any{"city": "Oslo"})
	hash := good.ArgumentsHash
	// env is a raw envelope for key with the given middle part.
	env := func(key, tool, args, extra string) []byte {
		return fmt.Appendf(nil, `{"tool":%q,"tool_version":1,"call_id":"call_%s","arguments":%s,"scope":{"tenant_id":"t_a"},"idempotency_key":%q,"arguments_hash":%q,"assertion":%q%s}`,
			tool, key, args, key, hash, good.Assertion, extra)
	}
	deep := strings.Repeat(`{"a":`, 40) + "1" + strings.Repeat("}", 40)
	huge := `{"city":"` + strings.Repeat("x", 300<<10) + `"}`
	cases := []struct {
		name       string
		key        string
		value      []byte
		reason     string
		pointer    string // exact, or a prefix when prefixOnly is set
		prefixOnly bool
	}{
		{"duplicate key", "dup", []byte(`{"tool":"get_weather","tool":"create_ticket","tool_version":1,"call_id":"call_dup","arguments":{"city":"Oslo"},"scope":{"tenant_id":"t_a"},"idempotency_key":"dup","arguments_hash":"` + hash + `"}`), ledger.CodeDuplicateKey, "/tool", false},
		{"case-variant key", "case", env("case", "get_weather", `{"city":"Oslo","City":"Rome"}`, ""), ledger.CodeCaseVariantKey, "/arguments/City", false},
		{"control character", "ctl", []byte(`{"tool":"get_weather","tool_version":1,"call_id":"call_ctl\u0000","arguments":{"city":"Oslo"},"scope":{"tenant_id":"t_a"},"idempotency_key":"ctl","arguments_hash":"` + hash + `"}`), ledger.CodeInvalidEnvelope, "/call_id", false},
		{"unknown field", "unknown", env("unknown", "get_weather", `{"city":"Oslo"}`, `,"priority":"urgent"`), ledger.CodeUnknownField, "/priority", false},
		{"too deep", "deep", env("deep", "get_weather", deep, ""), ledger.CodeTooDeep, "/arguments", true},
		{"too large", "large", env("large", "get_weather", huge, ""), ledger.CodeTooLarge, "", false},
		{"hash mismatch", "hash", env("hash", "get_weather", `{"city":"Bergen"}`, ""), intake.ReasonHashMismatch, "/arguments_hash", false},
	}
	// Checks after the hash need envelopes with a correct hash.
	type tcase = struct {
		name       string
		key        string
		value      []byte
		reason     string
		pointer    string
		prefixOnly bool
	}
	unknownTool := h.newEnvelope("t_a", "tool", "launch_missiles", map[string]any{"city": "Oslo"})
	extraArg := h.newEnvelope("t_a", "args", "get_weather", map[string]any{"city": "Oslo", "zip": "0150"})
	missingArg := h.newEnvelope("t_a", "missing", "get_weather", map[string]any{"unit": "c"})
	cases = append(cases,
		tcase{"unknown tool", "tool", mustJSON(t, unknownTool), intake.ReasonUnknownTool, "/tool", false},
		tcase{"extra argument", "args", mustJSON(t, extraArg), intake.ReasonInvalidArguments, "/arguments/zip", false},
		tcase{"missing argument", "missing", mustJSON(t, missingArg), intake.ReasonInvalidArguments, "/arguments/city", false},
	)

	for _, tc := range cases {
		h.publish("t_a/"+tc.key, tc.value)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// Refusals before the sender is verified are filed under the
			// reserved tenant; the others under the verified one.
			key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: tc.key}
			if tc.reason != intake.ReasonHashMismatch && tc.reason != intake.ReasonUnknownTool && tc.reason != intake.ReasonInvalidArguments {
				key.TenantID = ledger.UnverifiedTenant
			}
			ref := h.waitRefused(30*time.Second, key)
			okPtr := ref.Pointer == tc.pointer || tc.prefixOnly && strings.HasPrefix(ref.Pointer, tc.pointer)
			if ref.Reason != tc.reason || !okPtr {
				t.Errorf("refusal = %s at %q (%s); want %s at %q", ref.Reason, ref.Pointer, ref.Detail, tc.reason, tc.pointer)
			}
			if ref.Type != statemachine.EventDenied || ref.Seq != 0 || !strings.HasPrefix(ref.CallID, "call_"+tc.key) {
				t.Errorf("refusal is %s seq %d for %q; want denied seq 0 for call_%s", ref.Type, ref.Seq, ref.CallID, tc.key)
			}
			c, _ := h.index.Get(key)
			if len(c.Events) != 0 {
				t.Errorf("refused envelope started a call: %s", eventTypes(c.Events))
			}
		})
	}
	if n := len(h.backend.Effects()); n != 0 {
		t.Errorf("backend saw %d requests; want 0", n)
	}

	// The key of a refused envelope is still free.
	fixed := h.newEnvelope("t_a", "unknown", "get_weather", map[string]any{"city": "Oslo"})
	h.submit(fixed)
	c := h.waitSettled(30*time.Second, fixed.key())[fixed.key()]
	if c.State != statemachine.StateSucceeded {
		t.Errorf("corrected envelope under a refused key: state %q; want succeeded", c.State)
	}
}

// A batch of requests that decompresses past the intake's bound (its
// default, 16 MiB; a few kilobytes of gzip here) is skipped unread, on the
// DLQ as batch_too_large with its offsets, and the calls after it on its
// partition are decided and run. Before, the intake read any batch of up
// to 1 GiB: gigabytes from one hostile producer crashed every instance
// in turn.
func TestOversizedBatchGoesToDLQ(t *testing.T) {
	h := newHarness(t, storeEmbedded, 1)
	h.startIntake("intake-1")
	h.startExecutor(h.executorConfig("executor-1"))
	cl, err := ledger.NewClient(h.kafka.Client, kgo.ProducerBatchCompression(kgo.GzipCompression()), kgo.ProducerBatchMaxBytes(32<<20),
		kgo.ProducerLinger(time.Second), kgo.MaxBufferedBytes(64<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	zeros := make([]byte, 1<<20)
	var bomb []*kgo.Record
	for range ledger.DefaultMaxBatchBytes>>20 + 1 {
		bomb = append(bomb, &kgo.Record{Topic: h.kafka.Topics.Requests, Key: []byte("t_a/bomb"), Value: zeros})
	}
	if err := cl.ProduceSync(t.Context(), bomb...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	after := h.newEnvelope("t_a", "after-the-bomb", "get_weather", map[string]any{"city": "Oslo"})
	h.submit(after)
	if c := h.waitTerminal(30*time.Second, after.key())[after.key()]; c.State != statemachine.StateSucceeded {
		t.Errorf("the call after the batch is %s; want succeeded", c.State)
	}
	dlq, err := ledger.NewClient(h.kafka.Client, kgo.ConsumeTopics(h.kafka.Topics.DLQ), kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if err != nil {
		t.Fatal(err)
	}
	defer dlq.Close()
	var got []*kgo.Record
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		got = append(got, dlq.PollFetches(ctx).Records()...)
		if len(got) == 0 {
			return fmt.Errorf("nothing in the DLQ")
		}
		return nil
	})
	r := got[0]
	detail := string(ledger.Header(r, ledger.HeaderDLQDetail))
	if len(got) != 1 || string(ledger.Header(r, ledger.HeaderDLQReason)) != ledger.ReasonBatchTooLarge ||
		string(ledger.Header(r, ledger.HeaderDLQSource)) != h.kafka.Topics.Requests+"/0/0" || !strings.Contains(detail, fmt.Sprintf("offsets 0 to %d", len(bomb)-1)) {
		t.Errorf("DLQ: %d records, the first reason %q source %q detail %q; want one, %s, of the batch at offsets 0 to %d",
			len(got), ledger.Header(r, ledger.HeaderDLQReason), ledger.Header(r, ledger.HeaderDLQSource), detail, ledger.ReasonBatchTooLarge, len(bomb)-1)
	}
}

// Records that cannot be read as an envelope at all go to the DLQ with the
// reason, unchanged.
func TestUnparseableRequestsGoToDLQ(t *testing.T) {
	h := newHarness(t, storeEmbedded, 4)
	h.startIntake("intake-1")
	values := map[string]string{
		"not json":       `this is not json`,
		"truncated":      `{"tool":"get_weather","arguments":{`,
		"array":          `[1,2,3]`,
		"no tenant, key": `{"tool":"get_weather","tool_version":1,"arguments":{"city":"Oslo"}}`,
		// A live assertion in a record that cannot be read as a call.
		"assertion inside": `{"tool":"get_weather","assertion":"` + h.ident.Assertion(t, "t_a", "u_1") + `"}`,
	}
	for name, v := range values {
		h.publish(name, []byte(v))
	}
	cl, err := ledger.NewClient(h.kafka.Client, kgo.ConsumeTopics(h.kafka.Topics.DLQ))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	got := map[string]*kgo.Record{}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) { got[string(r.Key)] = r })
		if len(got) < len(values) {
			return fmt.Errorf("%d of %d records in the DLQ", len(got), len(values))
		}
		return nil
	})
	for name, v := range values {
		r := got[name]
		if r == nil {
			t.Errorf("%s: not in the DLQ", name)
			continue
		}
		if want := string(ledger.RedactTokens([]byte(v))); string(r.Value) != want {
			t.Errorf("%s: DLQ value %q; want the original with tokens redacted, %q", name, r.Value, want)
		}
		if strings.Contains(string(r.Value), "eyJ") {
			t.Errorf("%s: a token reached the DLQ: %s", name, r.Value)
		}
		if reason := ledger.Header(r, ledger.HeaderDLQReason); len(reason) == 0 {
			t.Errorf("%s: DLQ record without a reason", name)
		}
		if src := string(ledger.Header(r, ledger.HeaderDLQSource)); !strings.HasPrefix(src, h.kafka.Topics.Requests+"/") {
			t.Errorf("%s: DLQ source %q; want %s/<partition>/<offset>", name, src, h.kafka.Topics.Requests)
		}
	}
}

// 1,000 calls, with the executor stopped mid-run and another taking over
// (and, in the second case, a member joining mid-run so that partitions
// move under open transactions): no effect is applied twice at the tools
// and no call is lost.
func TestExecutorReplacedMidRunLosesNothingDuplicatesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("long fault test; run without -short")
	}
	for _, tc := range []struct {
		name string
		// change runs once some effects happened; first stops the
		// running executor.
		change func(h *harness, first func())
	}{
		{"killed and replaced", func(h *harness, first func()) {
			first()
			h.startExecutor(h.executorConfig("executor-2"))
		}},
		{"member joins then first leaves", func(h *harness, first func()) {
			// The join rebalances the group under the first member's
			// open batches; its transactions abort and their records
			// are redelivered to whichever member owns them next.
			h.startExecutor(h.executorConfig("executor-2"))
			waitEffects(h, 500)
			first()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, storeSQL, 12, func(c *demobackend.Config) { c.Latency = 10 * time.Millisecond })
			h.startIntake("intake-1")
			first := h.startExecutor(h.executorConfig("executor-1"))

			const n = 1000
			envs := make([]envelope, n)
			keys := make([]ledger.CallKey, n)
			for i := range envs {
				if i%2 == 0 {
					envs[i] = h.newEnvelope("t_load", fmt.Sprintf("ticket-%04d", i), "create_ticket", map[string]any{"title": fmt.Sprintf("ticket %d", i)})
				} else {
					envs[i] = h.newEnvelope("t_load", fmt.Sprintf("notify-%04d", i), "notify", map[string]any{"to": "ops@example.com", "subject": fmt.Sprintf("note %d", i)})
				}
				keys[i] = envs[i].key()
			}
			h.submit(envs...)
			waitEffects(h, 200)
			tc.change(h, first)

			calls := h.waitSettled(3*time.Minute, keys...)
			states := map[statemachine.State]int{}
			for i, e := range envs {
				c := calls[keys[i]]
				states[c.State]++
				if c.Anomalies != 0 {
					t.Errorf("%s: %d events did not fold", keys[i], c.Anomalies)
				}
				applied := h.backend.AppliedIn(toolRoute(e.Tool), "t_load", keys[i].String())
				switch {
				case c.State == statemachine.StateSucceeded && applied != 1:
					t.Errorf("%s succeeded with %d effects at the tool; want 1", keys[i], applied)
				case c.State == statemachine.StateOutcomeUnknown && e.Tool == "notify" && applied > 1:
					t.Errorf("%s: %d effects; want at most 1", keys[i], applied)
				case c.State != statemachine.StateSucceeded && c.State != statemachine.StateOutcomeUnknown:
					t.Errorf("%s ended %s; want succeeded (or outcome_unknown for a tool without idempotency)", keys[i], c.State)
				case c.State == statemachine.StateOutcomeUnknown && e.Tool != "notify":
					t.Errorf("%s: an idempotency-native tool ended outcome_unknown", keys[i])
				}
			}
			if dups := h.backend.Duplicates(); len(dups) != 0 {
				t.Errorf("duplicate effects at the tools: %v", dups)
			}
			t.Logf("%d calls: %v; %d requests at the tools", n, states, h.backend.Requests())
		})
	}
}

func toolRoute(tool string) string {
	if tool == "notify" {
		return "send_email"
	}
	return tool
}

func waitEffects(h *harness, n int) {
	h.t.Helper()
	ledgertest.WaitFor(h.t, time.Minute, func() error {
		if got := len(h.backend.Effects()); got < n {
			return fmt.Errorf("%d of %d effects", got, n)
		}
		return nil
	})
}

// endTotal sums the end offsets of topic.
func endTotal(ctx context.Context, cl *kgo.Client, topic string) (int64, error) {
	ends, err := kadm.NewClient(cl).ListEndOffsets(ctx, topic)
	if err != nil {
		return 0, err
	}
	var n int64
	ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
	return n, nil
}
