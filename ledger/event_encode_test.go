package ledger

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// reflectEncode is the encoding appendEvent replaces: encoding/json over
// Event, HTML escaping off.
func reflectEncode(e *Event) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(e); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// checkSameEncoding fails t unless appendEvent and encoding/json agree
// on e: the same bytes, or both an error.
func checkSameEncoding(t *testing.T, e *Event) {
	t.Helper()
	want, wantErr := reflectEncode(e)
	got, gotErr := appendEvent(nil, e)
	if (wantErr != nil) != (gotErr != nil) {
		t.Fatalf("appendEvent error = %v; encoding/json error = %v", gotErr, wantErr)
	}
	if wantErr == nil && !bytes.Equal(got, want) {
		t.Fatalf("appendEvent:\n%s\nencoding/json:\n%s", got, want)
	}
}

// everyField returns an event with every field set to a value of its
// kind, found by reflection: a field added to Event that appendEvent
// leaves out makes the encodings differ.
func everyField(t *testing.T) Event {
	t.Helper()
	var e Event
	v := reflect.ValueOf(&e).Elem()
	at := time.Date(2026, 12, 1, 23, 30, 5, 123456789, time.FixedZone("x", 90*60))
	for i := 0; i < v.NumField(); i++ {
		f := v.Field(i)
		name := v.Type().Field(i).Name
		switch f.Interface().(type) {
		case time.Time:
			f.Set(reflect.ValueOf(at))
		case *time.Time:
			f.Set(reflect.ValueOf(&at))
		case json.RawMessage:
			f.Set(reflect.ValueOf(json.RawMessage(` { "a" : [1, 2.5, "x"], "b": null } `)))
		case []string:
			f.Set(reflect.ValueOf([]string{name + "-1", name + "-2"}))
		default:
			switch f.Kind() {
			case reflect.String:
				f.SetString(strings.ToLower(name) + "-value")
			case reflect.Int, reflect.Int64:
				f.SetInt(int64(i + 1))
			default:
				t.Fatalf("Event.%s is a %s: teach appendEvent and this test its encoding", name, f.Type())
			}
		}
	}
	return e
}

func TestAppendEventMatchesEncodingJSON(t *testing.T) {
	full := everyField(t)
	at := time.Date(2026, 12, 1, 23, 30, 5, 0, time.UTC)
	cases := map[string]Event{
		"every field":              full,
		"only the required fields": {V: 1, Type: statemachine.EventAuthorized, At: at},
		"zero event":               {},
		"escapes": {V: 1, EventID: "a\"b\\c", Actor: "tab\there\nnew\rline\x00\x1f\x7f",
			TenantID: "<html>&amp;</html>", IdempotencyKey: "café ☕ \u2028\u2029", Detail: "bad \xff\xfe utf-8",
			PolicyID: []string{"", "\"quoted\""}, At: at,
			// One byte to escape each, so that no other byte takes the
			// string down the slow path.
			Purpose: `C:\dir`, Channel: `say "hi"`, Tool: "bell\x07", Resource: "é"},
		"empty slices are left out": {V: 1, PolicyID: []string{}, Obligations: []string{}, Arguments: json.RawMessage{}, At: at},
		"arguments with escapes":    {V: 1, Arguments: json.RawMessage("{\"html\": \"<b>&</b>\", \"u\": \"\\u2028\"}\n"), At: at},
		"negative numbers":          {V: 1, Seq: -3, ToolVersion: -1, RetryAfterMS: -9, LatencyMS: -1, At: at},
		"times in zones":            {V: 1, At: time.Date(1, 1, 1, 0, 0, 0, 0, time.FixedZone("odd", -(23*3600+59*60+59))), DeadlineAt: &at},
		// What encoding/json refuses, appendEvent refuses.
		"bad arguments":  {V: 1, Arguments: json.RawMessage(`{"a":`), At: at},
		"year 10000":     {V: 1, At: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)},
		"negative year":  {V: 1, At: time.Date(-1, 1, 1, 0, 0, 0, 0, time.UTC)},
		"offset of 24 h": {V: 1, At: at.In(time.FixedZone("far", 24*3600))},
		"expiry past 9999": {V: 1, At: at, ExpiresAt: func() *time.Time {
			t := time.Date(12000, 1, 1, 0, 0, 0, 0, time.UTC)
			return &t
		}()},
	}
	for name, e := range cases {
		t.Run(name, func(t *testing.T) { checkSameEncoding(t, &e) })
	}
}

func TestAppendEventRefusesWhatEncodingJSONRefuses(t *testing.T) {
	// The cases above check agreement; this one checks that agreement is
	// not two successes, so a reference that stopped refusing is noticed.
	e := Event{V: 1, Arguments: json.RawMessage(`{"a":`)}
	if _, err := appendEvent(nil, &e); err == nil {
		t.Fatal("appendEvent accepted arguments that are not JSON")
	}
	e = Event{V: 1, At: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}
	if _, err := appendEvent(nil, &e); err == nil {
		t.Fatal("appendEvent accepted year 10000")
	}
}

func TestEncodeDecodesBack(t *testing.T) {
	e := everyField(t)
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeEvent(b)
	if err != nil {
		t.Fatal(err)
	}
	// The arguments come back compacted, the times in their zone.
	want := e
	want.Arguments = json.RawMessage(`{"a":[1,2.5,"x"],"b":null}`)
	if !reflect.DeepEqual(got.Arguments, want.Arguments) {
		t.Fatalf("arguments %s; want %s", got.Arguments, want.Arguments)
	}
	if !got.At.Equal(want.At) || !got.DeadlineAt.Equal(*want.DeadlineAt) || !got.ExpiresAt.Equal(*want.ExpiresAt) {
		t.Fatalf("times %v %v %v; want %v", got.At, got.DeadlineAt, got.ExpiresAt, want.At)
	}
	got.Arguments, want.Arguments = nil, nil
	got.At, want.At = time.Time{}, time.Time{}
	got.DeadlineAt, want.DeadlineAt, got.ExpiresAt, want.ExpiresAt = nil, nil, nil, nil
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded\n%+v\nwant\n%+v", got, want)
	}
}

func FuzzEventEncoding(f *testing.F) {
	f.Add("evt_1", "authorized", int64(2), int64(1700000000123456789), 60, "tenant-a", "run_42:step_7", "", []byte(`{"a":1}`), "pol_1", 3)
	f.Add("a\"b", "x\u2028", int64(-1), int64(-62135596800000000), -3600, "\xff", "<&>", "\x00\t", []byte(" [1, {\"b\" : \"\\u00e9\"}] "), "", 0)
	f.Add("", "", int64(0), int64(253402300800000000), 86400, "", "", "", []byte(`{`), "é", -7)
	f.Fuzz(func(t *testing.T, id, typ string, seq, atNanos int64, offMin int, tenant, key, detail string, args []byte, policy string, attempt int) {
		at := time.Unix(0, atNanos).In(time.FixedZone("z", offMin*60))
		e := Event{V: 1, EventID: id, Type: statemachine.EventType(typ), Seq: seq, At: at,
			TenantID: tenant, IdempotencyKey: key, Detail: detail, Arguments: args,
			PolicyID: []string{policy, detail}, Attempt: attempt, DeadlineAt: &at}
		checkSameEncoding(t, &e)
	})
}

func BenchmarkEventEncode(b *testing.B) {
	e := Event{V: 1, EventID: "0193a1f4-7c3e-7b6a-9c1d-3f2e1a0b9c8d", Type: statemachine.EventSucceeded, Seq: 4,
		At: time.Now().UTC(), Actor: "executor", TenantID: "tenant-3", IdempotencyKey: "bench-1234:step_2:create_ticket",
		CallID: "call_0193a1f47c3e", UserID: "user-7", AgentID: "agent-2", Tool: "create_ticket", ToolVersion: 1,
		ArgumentsHash: "sha256:5f1d0c0e8b6a7f9e3c2b1a0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f", TraceID: "4bf92f3577b34da6a3ce929d0e0e4736",
		JTI: "jti_0193a1f47c3e7b6a", CredentialScope: "create_ticket:call", CredentialFamily: "create_ticket/tenant-3/1",
		Attempt: 1, ResultDigest: "sha256:0a1b2c3d4e5f", ResultBytes: 87, LatencyMS: 3}
	b.Run("appendEvent", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := e.Encode(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := reflectEncode(&e); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// v1Fields are Event's wire names at encoding version 1. A field added
// since is either informational (add it here; V stays) or binding (it
// needs a new EncodingVersion, written on the events that carry it): see
// EncodingVersion. This test fails until whoever adds one decides which.
var v1Fields = []string{
	"v", "event_id", "type", "seq", "at", "actor",
	"tenant_id", "idempotency_key", "call_id", "user_id", "agent_id", "purpose", "channel",
	"tool", "tool_version", "resource", "arguments_hash", "trace_id", "arguments", "deadline_at",
	"policy_id", "policy_version", "decision", "obligations", "approval_id", "resource_version",
	"approver", "expires_at", "jti", "credential_scope", "credential_family", "attempt", "retry_after_ms",
	"reason", "pointer", "detail", "error_code",
	"result_digest", "result_bytes", "latency_ms",
}

func TestEventFieldsAreClassified(t *testing.T) {
	known := map[string]bool{}
	for _, f := range v1Fields {
		known[f] = true
	}
	typ := reflect.TypeFor[Event]()
	seen := map[string]bool{}
	for i := range typ.NumField() {
		name, _, _ := strings.Cut(typ.Field(i).Tag.Get("json"), ",")
		seen[name] = true
		if !known[name] {
			t.Errorf("Event.%s (%q) is not a version-1 field: decide whether older builds may ignore it (informational: add it to v1Fields) or must refuse the events that carry it (binding: a new EncodingVersion, written on those events; see EncodingVersion)", typ.Field(i).Name, name)
		}
	}
	for _, f := range v1Fields {
		if !seen[f] {
			t.Errorf("v1Fields lists %q, which Event no longer has: an older build may still write it and a newer one read it", f)
		}
	}
}
