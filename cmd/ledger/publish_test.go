package main

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// An envelope the broker may have written (its produce request timed out
// there) is retried by franz-go past its context, for as long as that
// lasts: Publish gives up at its context's end all the same, saying that
// the envelope may yet be published, and the agents' API answers 503.
// Before, it waited on the produce, and the agent's request with it.
func TestPublishGivesUpAtItsContextsEnd(t *testing.T) {
	k := ledgertest.NewInProcess(t, ledgertest.Options{Partitions: 1})
	f := k.Cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: k.Topics.Requests, Err: kerr.RequestTimedOut, Count: -1})
	defer f.Remove()
	p, err := newPublisher(k.Client, k.Topics.Requests)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- p.Publish(ctx, []byte("t_a/k"), []byte(`{}`)) }()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Publish = %v; want its context's deadline", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Publish did not return at its context's end while the broker timed the produce out")
	}
	if f.Hits() == 0 {
		t.Error("no produce request reached the broker")
	}
}
