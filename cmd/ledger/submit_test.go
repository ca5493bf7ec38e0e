package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// TestSubmitWaitAfterResend: what submit --wait says when its wait ends
// after it sent the envelope again. A resend that failed is said as it
// failed, even with a deadline of its own (not as the call not settling);
// a resend admitted, whose call still runs at --timeout, leaves the call's
// state said, not the refusal it answered.
func TestSubmitWaitAfterResend(t *testing.T) {
	cc, topics, _ := roleCluster(t)
	producer, err := ledger.NewClient(cc, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(producer.Close)
	// append stands in for the intake: it appends evs to the events topic.
	appendEvents := func(ctx context.Context, evs ...ledger.Event) error {
		for _, e := range evs {
			rec, err := e.Record(topics.Events)
			if err != nil {
				return err
			}
			if err := producer.ProduceSync(ctx, rec).FirstErr(); err != nil {
				return err
			}
		}
		return nil
	}
	refusedForNow := func(key ledger.CallKey) ledger.Event {
		return ledger.Event{V: 1, EventID: "refusal-" + key.IdempotencyKey, Type: statemachine.EventDenied, TenantID: key.TenantID,
			IdempotencyKey: key.IdempotencyKey, CallID: "call-" + key.IdempotencyKey, Reason: "rate_limited", RetryAfterMS: 10, At: time.Now()}
	}
	wait := func(key ledger.CallKey, timeout time.Duration, publish func(context.Context) error) error {
		w, err := newCallWait(t.Context(), cc, topics.Events, key, "call-"+key.IdempotencyKey, []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		w.lastSent = time.Now()
		if err := appendEvents(t.Context(), refusedForNow(key)); err != nil {
			t.Fatal(err)
		}
		return w.run(t.Context(), &submitFlags{retryLater: 3, timeout: timeout}, io.Discard, publish)
	}

	// The resend's publish ran out of its own time.
	stuck := fmt.Errorf("publish to %s: %w", topics.Requests, context.DeadlineExceeded)
	if err := wait(ledger.CallKey{TenantID: "t_a", IdempotencyKey: "stuck"}, time.Minute, func(context.Context) error { return stuck }); !errors.Is(err, stuck) {
		t.Errorf("a resend that failed: %v; want %v", err, stuck)
	}

	// The resend is admitted; the call is requested, and goes no further.
	running := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "running"}
	// Its --timeout leaves a loaded machine time to read the refusal and
	// send again: the wait lasts all of it.
	err = wait(running, 8*time.Second, func(ctx context.Context) error {
		return appendEvents(ctx, ledger.Event{V: 1, EventID: "requested-running", Seq: 1, Type: statemachine.EventRequested,
			TenantID: running.TenantID, IdempotencyKey: running.IdempotencyKey, CallID: "call-running", ArgumentsHash: "h", At: time.Now()})
	})
	if err == nil || !strings.Contains(err.Error(), `(state "requested")`) || strings.Contains(err.Error(), "refusal") {
		t.Errorf("a resend admitted, its call still running at --timeout: %v; want the call's state said", err)
	}
}
