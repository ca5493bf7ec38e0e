package ledger_test

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// The topics the ledger creates keep the events, and the control topic's
// actions, for good: never the brokers' default retention (7 days), which
// would delete the audit trail, and freezes and revocations a process
// reads back at its next start.
func TestEnsureTopicsKeepsEventsAndControlForever(t *testing.T) {
	k := ledgertest.NewInProcess(t, ledgertest.Options{Partitions: 1})
	topics := ledger.Topics{Requests: "r.requests", Events: "r.events", Control: "r.control", DLQ: "r.dlq"}
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := ledger.EnsureTopics(t.Context(), cl, ledger.TopicConfig{Topics: topics, Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	rcs, err := kadm.NewClient(cl).DescribeTopicConfigs(t.Context(), topics.Events, topics.Control)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]map[string]string{
		topics.Events:  {"retention.ms": "-1", "retention.bytes": "-1"},
		topics.Control: {"retention.ms": "-1", "cleanup.policy": "compact"},
	}
	for _, rc := range rcs {
		if rc.Err != nil {
			t.Fatalf("describe %s: %v", rc.Name, rc.Err)
		}
		got := map[string]string{}
		for _, c := range rc.Configs {
			if c.Value != nil {
				got[c.Key] = *c.Value
			}
		}
		for key, v := range want[rc.Name] {
			if got[key] != v {
				t.Errorf("%s %s = %q; want %q", rc.Name, key, got[key], v)
			}
		}
	}
}
