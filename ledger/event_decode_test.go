package ledger

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// checkFastDecode fails t if decodeEventFast accepts b and decodes it
// otherwise than encoding/json does.
func checkFastDecode(t *testing.T, b []byte) (ok bool) {
	t.Helper()
	got, ok := decodeEventFast(b)
	if !ok {
		return false
	}
	var want Event
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatalf("decodeEventFast accepted %q, which encoding/json refuses: %v", b, err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decodeEventFast(%q):\n%+v\nencoding/json:\n%+v", b, got, want)
	}
	return true
}

func TestDecodeEventFast(t *testing.T) {
	// What the encoder writes for events without arguments and with
	// plain strings, the fast decoder reads: else it would never serve.
	full := everyField(t)
	full.Arguments = nil
	at := time.Date(2026, 12, 1, 23, 30, 5, 0, time.UTC)
	for name, e := range map[string]Event{
		"every field but arguments": full,
		"authorized": {V: 1, EventID: "0193a1f4", Type: statemachine.EventAuthorized, Seq: 2, At: at, Actor: "intake",
			TenantID: "t1", IdempotencyKey: "run_1:step_2", PolicyID: []string{"p1", "p2"}, Obligations: []string{}},
		"negative and zero": {V: 1, Seq: -7, At: at, RetryAfterMS: -1},
	} {
		b, err := e.Encode()
		if err != nil {
			t.Fatal(err)
		}
		if !checkFastDecode(t, b) {
			t.Errorf("%s: decodeEventFast refused the encoder's own %s", name, b)
		}
	}
	// What it leaves to encoding/json.
	for _, b := range []string{
		`{"v":1,"arguments":{"a":1}}`,         // a nested value
		`{"v":1,"detail":"caf\u00e9"}`,        // an escape
		`{"v":1,"detail":"café"}`,             // beyond ASCII
		`{"V":1}`,                             // a key in another case
		`{"v":1,"extra":2}`,                   // an unknown key
		`{"v":1} `,                            // trailing space
		`{ "v":1}`,                            // whitespace
		`{"v":1.0}`,                           // not an integer
		`{"v":01}`,                            // not JSON
		`{"v":99999999999999999999}`,          // out of range
		`{"v":1,"at":"2026-13-01T00:00:00Z"}`, // no such month
		`{"v":1,"at":null}`,                   // null
		`{"v":1,"policy_id":["a",1]}`,         // not all strings
		`{"v":1,"policy_id":["a",]}`,          // not JSON
		`{"v":2,"roles_given":false}`,         // false spelt out
		`{"v":2,"roles_given":null}`,          // null
		`{"v":2,"roles_given":truer}`,         // not JSON
		`{"v":1,}`,                            // not JSON
		`{"v":1}{}`,                           // trailing data
		`[]`,                                  // not an object
	} {
		if checkFastDecode(t, []byte(b)) {
			t.Errorf("decodeEventFast accepted %s; want it left to encoding/json", b)
		}
	}
	// Both paths give DecodeEvent's answer.
	for _, b := range []string{`{"v":1,"seq":3,"type":"authorized"}`, `{"v":1, "seq":3, "type":"authorized"}`} {
		e, err := DecodeEvent([]byte(b))
		if err != nil || e.Seq != 3 || e.Type != statemachine.EventAuthorized {
			t.Errorf("DecodeEvent(%s) = %+v, %v", b, e, err)
		}
	}
}

func FuzzDecodeEventFast(f *testing.F) {
	full := Event{V: 1, EventID: "e", Type: statemachine.EventSucceeded, Seq: 4, At: time.Unix(1700000000, 5).UTC(), Actor: "x",
		TenantID: "t", IdempotencyKey: "k", PolicyID: []string{"a"}, Obligations: []string{}, Attempt: 2, LatencyMS: 9}
	b, _ := full.Encode()
	f.Add(b)
	f.Add([]byte(`{"v":1,"seq":-0,"at":"2026-12-01T23:30:05.123+01:30","deadline_at":"0001-01-01T00:00:00Z","policy_id":[]}`))
	f.Add([]byte(`{"v":1,"seq":1,"seq":2,"policy_id":["a"],"policy_id":["b","c"]}`))
	f.Add([]byte(`{}`))
	f.Add([]byte(`{"v":2,"roles":["a","b"],"roles_given":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		checkFastDecode(t, b)
	})
}

func BenchmarkDecodeEvent(b *testing.B) {
	e := Event{V: 1, EventID: "0193a1f4-7c3e-7b6a-9c1d-3f2e1a0b9c8d", Type: statemachine.EventAuthorized, Seq: 2,
		At: time.Now().UTC(), Actor: "intake", TenantID: "tenant-3", IdempotencyKey: "bench-1234:step_2:create_ticket",
		CallID: "call_0193a1f47c3e", UserID: "user-7", AgentID: "agent-2", Tool: "create_ticket", ToolVersion: 1,
		ArgumentsHash: "sha256:5f1d0c0e8b6a7f9e3c2b1a0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f", TraceID: "4bf92f3577b34da6a3ce929d0e0e4736",
		PolicyID: []string{"allow-tickets"}, PolicyVersion: "v41:9f2c", Decision: "allow"}
	buf, err := e.Encode()
	if err != nil {
		b.Fatal(err)
	}
	b.Run("fast", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := decodeEventFast(buf); !ok {
				b.Fatal("refused")
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var e Event
			if err := json.Unmarshal(buf, &e); err != nil {
				b.Fatal(err)
			}
		}
	})
}
