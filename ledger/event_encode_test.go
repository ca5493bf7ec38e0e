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
			case reflect.Bool:
				f.SetBool(true)
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

// eventFieldVersions are Event's wire names, each with the encoding
// version it came in: 1 for every field of the first version, binding or
// not. A field added since is either informational (it comes in at the
// version of the build that adds it, which need not change) or binding
// (it comes in at a new EncodingVersion, which Encode writes only on the
// events that carry it): see EncodingVersion. This test fails until
// whoever adds one decides which.
var eventFieldVersions = map[string]int{
	"v": 1, "event_id": 1, "type": 1, "seq": 1, "at": 1, "actor": 1,
	"tenant_id": 1, "idempotency_key": 1, "call_id": 1, "user_id": 1, "agent_id": 1, "purpose": 1, "channel": 1,
	"tool": 1, "tool_version": 1, "resource": 1, "arguments_hash": 1, "trace_id": 1, "arguments": 1, "deadline_at": 1,
	"policy_id": 1, "policy_version": 1, "decision": 1, "obligations": 1, "approval_id": 1, "resource_version": 1,
	"approver": 1, "expires_at": 1, "jti": 1, "credential_scope": 1, "credential_family": 1, "attempt": 1, "retry_after_ms": 1,
	"reason": 1, "pointer": 1, "detail": 1, "error_code": 1, "roles": 2, "roles_given": 2,
	// Informational: an older build's projection does not index these
	// families; its rows keep the event as logged, which a newer build's
	// rebuild reads.
	"earlier_credential_families": 2,
	"result_digest":               1, "result_bytes": 1, "latency_ms": 1,
	// Informational: the tool's own time, which benchmarks subtract.
	"tool_us": 2,
	// Informational: the definition the call is bound to, for
	// responders; what binds it is the store's record (ToolDigest).
	"tool_digest": 2,
	// Informational: the copy a refusal answers, which waiting senders
	// compare; an older one takes any refusal of its call id, as before.
	"request_digest": 2,
}

func TestEventFieldsAreClassified(t *testing.T) {
	typ := reflect.TypeFor[Event]()
	seen := map[string]bool{}
	for i := range typ.NumField() {
		f := typ.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if f.Anonymous || !f.IsExported() || name == "" || name == "-" {
			t.Errorf("Event.%s is not a plain field with a json name: encoding/json would write it in a way this test (and appendEvent) do not follow", f.Name)
			continue
		}
		seen[name] = true
		if _, ok := eventFieldVersions[name]; !ok {
			t.Errorf("Event.%s (%q) has no encoding version: decide whether older builds may ignore it (informational: the version it comes in, EncodingVersion or below) or must refuse the events that carry it (binding: a new EncodingVersion, written only on those events; see EncodingVersion), and list it in eventFieldVersions", f.Name, name)
		}
	}
	newest := 0
	for f, v := range eventFieldVersions {
		if !seen[f] {
			t.Errorf("eventFieldVersions lists %q, which Event no longer has: an older build may still write it and a newer one read it", f)
		}
		newest = max(newest, v)
	}
	if newest != EncodingVersion {
		t.Errorf("the newest field came in at version %d, EncodingVersion is %d: a binding field needs the version it came in written on its events, and readers of it", newest, EncodingVersion)
	}
}

// An event carries the lowest version that holds its fields: 2 only with
// roles (binding, version 2), so that builds that read version 1 refuse
// only the events whose roles they would ignore.
func TestEncodeWritesTheVersionTheEventNeeds(t *testing.T) {
	for _, tc := range []struct {
		roles []string
		want  int
	}{{nil, 1}, {[]string{}, 1}, {[]string{"finance"}, 2}} {
		e := Event{V: EncodingVersion, EventID: "e1", Type: statemachine.EventRequested, Seq: 1, Roles: tc.roles}
		b, err := e.Encode()
		if err != nil {
			t.Fatal(err)
		}
		got, err := DecodeEvent(b)
		if err != nil || got.V != tc.want || e.V != tc.want {
			t.Errorf("roles %q: encoded v %d, decoded %+v, %v; want v%d", tc.roles, e.V, got, err, tc.want)
		}
	}
}
