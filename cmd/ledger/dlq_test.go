package main

import (
	"bufio"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// ledger dlq prints what the intake put on the DLQ: each record's reason,
// detail and source, the request's copy on asking (tokens redacted as the
// intake wrote it), by reason, within --since, as JSON lines; what is not
// printable in it escaped. Before, the DLQ was documented and nothing of
// the ledger's read it.
func TestDLQCommand(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	now := time.Now()
	src := &kgo.Record{Topic: k.Topics.Requests, Partition: 1, Offset: 7, Value: []byte("not json at all \x1b[31m")}
	bad := ledger.DLQRecord(k.Topics.DLQ, src, "invalid_json", "invalid literal at offset 0")
	bad.Timestamp = now
	binary := ledger.DLQRecord(k.Topics.DLQ, &kgo.Record{Topic: k.Topics.Requests, Value: []byte{0xff, 0xfe, 'x'}}, "invalid_json", "invalid character")
	binary.Timestamp = now
	batch := ledger.DLQBatchRecord(k.Topics.DLQ, k.Topics.Requests, 0, 100, 140, 16<<20)
	batch.Timestamp = now
	old := ledger.DLQRecord(k.Topics.DLQ, src, "not_an_object", "written two hours ago")
	old.Timestamp = now.Add(-2 * time.Hour)
	if err := cl.ProduceSync(t.Context(), old, bad, binary, batch).FirstErr(); err != nil {
		t.Fatal(err)
	}
	args := func(more ...string) []string {
		return append(append([]string{"dlq"}, kafkaArgs(k.Client.Brokers, k.Topics)...), more...)
	}

	out := cli(t, args()...)
	for _, want := range []string{
		"invalid_json  from " + k.Topics.Requests + "/1/7\n    invalid literal at offset 0\n",
		"batch_too_large  from " + k.Topics.Requests + "/0/100\n",
		"4 records (" + k.Topics.DLQ + "): batch_too_large 1, invalid_json 2, not_an_object 1\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("ledger dlq printed:\n%s\nwant it to hold %q", out, want)
		}
	}
	if strings.Contains(out, "not json at all") {
		t.Errorf("ledger dlq printed the requests' copies without --value:\n%s", out)
	}
	out = cli(t, args("--since", "1h", "--reason", "invalid_json", "--value")...)
	if !strings.Contains(out, "request: not json at all ?[31m\n") || strings.Contains(out, "\x1b") {
		t.Errorf("ledger dlq --value printed:\n%q\nwant the request's copy, its escape sequence made printable", out)
	}
	if want := "2 records (" + k.Topics.DLQ + ", reason invalid_json, written in the last 1h0m0s): invalid_json 2\n"; !strings.HasSuffix(out, want) {
		t.Errorf("ledger dlq --since 1h --reason invalid_json ended:\n%s\nwant %q", out, want)
	}

	var got []dlqJSON
	sc := bufio.NewScanner(strings.NewReader(cli(t, args("--json", "--value", "--since", "1h")...)))
	for sc.Scan() {
		var j dlqJSON
		if err := json.Unmarshal(sc.Bytes(), &j); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		got = append(got, j)
	}
	if len(got) != 3 {
		t.Fatalf("--json printed %d records; want 3 (the two-hour-old one left out)", len(got))
	}
	values := map[string]int{}
	for _, j := range got {
		switch {
		case j.Value != nil && *j.Value == string(src.Value) && j.Source == k.Topics.Requests+"/1/7":
			values["text"]++
		case string(j.ValueBase64) == "\xff\xfex":
			values["binary"]++
		case j.Reason == ledger.ReasonBatchTooLarge && j.Value == nil && j.ValueBase64 == nil:
			values["batch"]++
		}
	}
	if values["text"] != 1 || values["binary"] != 1 || values["batch"] != 1 {
		t.Errorf("--json records %+v; want one request's copy as text, one not UTF-8 in value_base64, the batch without", got)
	}
}
