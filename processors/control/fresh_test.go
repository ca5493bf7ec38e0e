package control

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// A State whose consumer stops reading (here: its fetches are held by the
// broker) is not current once a freeze it has not read is on the topic:
// Current says so rather than let a caller act on the State without the
// freeze; once the fetches go through, it is current again, with the
// freeze. Without the probe of the topic's ends, nothing told the stalled
// State from one with nothing to read.
func TestStateStaleWhileFetchesStall(t *testing.T) {
	k := ledgertest.NewInProcess(t, ledgertest.Options{Partitions: 1})
	s := runState(t, k)
	waitReady(t, s)
	within := func(d time.Duration) context.Context {
		ctx, cancel := context.WithTimeout(t.Context(), d)
		t.Cleanup(cancel)
		return ctx
	}
	if err := s.Current(within(5*time.Second), time.Second); err != nil {
		t.Fatalf("Current after Ready = %v; want nil", err)
	}

	release := ledgertest.StallFetches(t, k.Cluster)
	a := Action{V: 1, Kind: KindFreeze, Subject: ToolSubject("refund_order", ""), Tool: "refund_order", By: "op", ByTenant: "*", Reason: "incident", At: time.Now().UTC()}
	b, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	if err := newKafkaPublisher(t, k).Publish(t.Context(), &kgo.Record{Topic: k.Topics.Control, Key: []byte(a.Subject), Value: b}); err != nil {
		t.Fatal(err)
	}

	// It was current when the freeze was published; it is not once the
	// staleness allowed has passed since.
	const maxStaleness = 300 * time.Millisecond
	time.Sleep(maxStaleness + 100*time.Millisecond)
	err = s.Current(within(time.Second), maxStaleness)
	var se *StaleError
	if !errors.Is(err, ErrStale) || !errors.Is(err, context.DeadlineExceeded) || !errors.As(err, &se) {
		t.Fatalf("Current with a freeze not read = %v; want a StaleError (ErrStale, deadline exceeded)", err)
	}
	if se.AsOf.IsZero() || se.MaxStaleness != maxStaleness {
		t.Errorf("StaleError = %+v; want the State's AsOf and the staleness allowed", se)
	}
	if _, frozen := s.Frozen("refund_order", "t_a"); frozen {
		t.Fatal("the freeze was read while the fetches were held: the test does not test a stall")
	}
	if st := s.Staleness(); st <= maxStaleness {
		t.Errorf("Staleness while stalled = %s; want more than %s", st, maxStaleness)
	}
	t.Logf("stalled: %v", err)

	release()
	if err := s.Current(within(10*time.Second), maxStaleness); err != nil {
		t.Fatalf("Current after the fetches resumed = %v; want nil", err)
	}
	if _, frozen := s.Frozen("refund_order", "t_a"); !frozen {
		t.Error("current again, without the freeze")
	}
}

// A State with nothing new to read stays current: the probe confirms it
// every 250 ms, records or not. One whose Run ended does not, and Current
// says so at once rather than wait for it.
func TestStateCurrentWithoutRecords(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	s := NewState(nil)
	if st := s.Staleness(); st != -1 {
		t.Errorf("Staleness before Run = %s; want -1", st)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, k.Client, k.Topics.Control) }()
	waitReady(t, s)

	time.Sleep(1200 * time.Millisecond)
	if st := s.Staleness(); st < 0 || st > 800*time.Millisecond {
		t.Errorf("Staleness 1.2s after Ready, nothing published = %s; want under 800ms", st)
	}
	short, cancelShort := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancelShort()
	if err := s.Current(short, time.Second); err != nil {
		t.Errorf("Current = %v; want nil", err)
	}

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run = %v", err)
	}
	time.Sleep(600 * time.Millisecond)
	// It does not wait for a State that will not catch up.
	if err := s.Current(t.Context(), 500*time.Millisecond); !errors.Is(err, ErrStale) || !errors.Is(err, ErrStopped) {
		t.Errorf("Current 600ms after Run ended = %v; want ErrStale, ErrStopped", err)
	}
}
