// Package ledgertest gives tests a Kafka to talk to: an in-process kfake
// cluster by default, or the real cluster named by LEDGER_TEST_KAFKA_BROKERS
// (comma separated), with a fresh set of topics per test either way.
package ledgertest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/toolcall-ledger/ledger/ledger"
)

// Kafka is a cluster with the ledger's topics created.
type Kafka struct {
	Client ledger.ClientConfig
	Topics ledger.Topics
	// Cluster is the in-process cluster, or nil against a real one. Tests
	// inject broker faults through it (ControlKey).
	Cluster *kfake.Cluster
}

// Options tune New.
type Options struct {
	// Partitions per topic; default 4.
	Partitions int32
	// KfakeOpts are extra options for the in-process cluster.
	KfakeOpts []kfake.Opt
}

// New returns a Kafka for t, closed when t ends.
func New(t testing.TB, o Options) *Kafka {
	t.Helper()
	if o.Partitions <= 0 {
		o.Partitions = 4
	}
	k := &Kafka{}
	suffix := randomSuffix()
	if seeds := os.Getenv("LEDGER_TEST_KAFKA_BROKERS"); seeds != "" {
		k.Client.Brokers = strings.Split(seeds, ",")
		// Topic names unique per test, so runs against a shared
		// cluster do not see each other.
		k.Topics = ledger.Topics{
			Requests: "test." + suffix + ".requests",
			Events:   "test." + suffix + ".events",
			Control:  "test." + suffix + ".control",
			DLQ:      "test." + suffix + ".dlq",
		}
	} else {
		opts := append([]kfake.Opt{
			kfake.NumBrokers(1),
			kfake.GroupMinSessionTimeout(500 * time.Millisecond),
		}, o.KfakeOpts...)
		c, err := kfake.NewCluster(opts...)
		if err != nil {
			t.Fatalf("kfake: %v", err)
		}
		t.Cleanup(c.Close)
		k.Cluster = c
		k.Client.Brokers = c.ListenAddrs()
		k.Topics = ledger.Topics{}.WithDefaults()
	}
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatalf("kafka client: %v", err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ledger.EnsureTopics(ctx, cl, ledger.TopicConfig{Topics: k.Topics, Partitions: o.Partitions}); err != nil {
		t.Fatalf("create topics: %v", err)
	}
	return k
}

// Group returns a consumer group name unique to this Kafka, so that tests
// against a shared cluster never join each other's groups.
func (k *Kafka) Group(name string) string {
	if k.Cluster != nil {
		return name
	}
	return k.Topics.Events + "." + name
}

func randomSuffix() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// WaitFor polls cond until it returns nil or timeout passes, then fails t
// with cond's last error.
func WaitFor(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := 10 * time.Millisecond
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %v", timeout, err)
		}
		time.Sleep(tick)
		tick = min(tick*2, 200*time.Millisecond)
	}
}
