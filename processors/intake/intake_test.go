package intake_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/boltstore"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/processors/processorstest"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// fixture is an intake and the identity its envelopes are signed by.
type fixture struct {
	in    *intake.Processor
	ident *processorstest.Identity
	store processors.Store
}

func newIntake(t *testing.T) *fixture {
	return newIntakeWith(t, func(*intake.Config) {})
}

// newIntakeWith is newIntake with its config changed by set.
func newIntakeWith(t *testing.T, set func(*intake.Config)) *fixture {
	t.Helper()
	st, err := boltstore.Open(boltstore.Config{Path: filepath.Join(t.TempDir(), "x.db")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	reg, err := schemas.Load(os.DirFS("../testdata/registry"))
	if err != nil {
		t.Fatal(err)
	}
	ident := processorstest.NewIdentity(t)
	cfg := intake.Config{Registry: reg, Store: st, Identity: ident.Verifier, Policy: processorstest.Policy(t, "../testdata/policies")}
	set(&cfg)
	in, err := intake.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{in: in, ident: ident, store: st}
}

func (f *fixture) envelopeRecord(t *testing.T, key string, args map[string]any) *kgo.Record {
	t.Helper()
	return f.toolRecord(t, "create_ticket", 1, key, args)
}

// toolRecord is an envelope record calling tool at version.
func (f *fixture) toolRecord(t *testing.T, tool string, version int, key string, args map[string]any) *kgo.Record {
	t.Helper()
	raw, _ := json.Marshal(args)
	tree, err := ledger.Decode(raw, ledger.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	hash, err := ledger.ArgumentsHash("t_a", tool, version, tree)
	if err != nil {
		t.Fatal(err)
	}
	v, _ := json.Marshal(map[string]any{
		"tool": tool, "tool_version": version, "call_id": "c_" + key, "arguments": args,
		"scope": map[string]any{"tenant_id": "t_a"}, "idempotency_key": key, "arguments_hash": hash,
		"assertion": f.ident.Assertion(t, "t_a", "u_1"),
	})
	return &kgo.Record{Topic: "toolcalls.requests", Value: v}
}

// withAssertion is the envelope record r with another assertion.
func withAssertion(t *testing.T, r *kgo.Record, assertion string) *kgo.Record {
	t.Helper()
	var env map[string]any
	if err := json.Unmarshal(r.Value, &env); err != nil {
		t.Fatal(err)
	}
	env["assertion"] = assertion
	v, err := json.Marshal(env)
	if err != nil {
		t.Fatal(err)
	}
	return &kgo.Record{Topic: r.Topic, Value: v}
}

func events(t *testing.T, out ledger.Output) []ledger.Event {
	t.Helper()
	var evs []ledger.Event
	for _, r := range out.Records {
		e, err := ledger.DecodeEvent(r.Value)
		if err != nil {
			t.Fatal(err)
		}
		evs = append(evs, e)
	}
	return evs
}

// summaryOf is evs as tenant:type, in order.
func summaryOf(evs []ledger.Event) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = e.TenantID + ":" + string(e.Type)
	}
	return out
}

// A crash between the store and the log: the redelivered envelope appends
// the same events again (readers drop the duplicate seq); once the log has
// them, a retry appends nothing.
func TestIntakeReappendsUnloggedEvents(t *testing.T) {
	f := newIntake(t)
	rec := f.envelopeRecord(t, "k1", map[string]any{"title": "t"})
	first, err := f.in.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	if got := len(first.Records); got != 2 {
		t.Fatalf("first step appended %d events; want requested + authorized", got)
	}
	// The transaction aborted; Committed never ran.
	again, err := f.in.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(events(t, first), events(t, again)); diff != "" {
		t.Errorf("re-appended events differ (-first +again):\n%s", diff)
	}
	if err := again.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	third, err := f.in.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	if len(third.Records) != 0 {
		t.Errorf("a retry after the log has the call appended %d records; want 0", len(third.Records))
	}
}

// Within one batch, a retry and a reuse of the same key.
func TestIntakeBatchWithRetryAndReuse(t *testing.T) {
	f := newIntake(t)
	a := f.envelopeRecord(t, "k2", map[string]any{"title": "a"})
	b := f.envelopeRecord(t, "k2", map[string]any{"title": "b"})
	out, err := f.in.Step(t.Context(), []*kgo.Record{a, a, b})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range events(t, out) {
		got = append(got, string(e.Type)+"/"+e.Reason)
	}
	want := []string{"requested/", "authorized/" + policy.ReasonAllowed, "denied/" + intake.ReasonIdempotencyKeyReuse}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
}

// Another user's submission under a key is refused, whatever its
// arguments, and in the same words either way: as a retry, the same
// arguments went unanswered while other ones were refused, which told a
// user who guessed another's key whether they also guessed the arguments.
func TestIntakeAnotherUsersKeyIsNotARetry(t *testing.T) {
	f := newIntake(t)
	as := func(r *kgo.Record, user string) *kgo.Record {
		return withAssertion(t, r, f.ident.Assertion(t, "t_a", user))
	}
	same := f.envelopeRecord(t, "k4", map[string]any{"title": "a"})
	other := f.envelopeRecord(t, "k4", map[string]any{"title": "b"})
	out, err := f.in.Step(t.Context(), []*kgo.Record{same})
	if err != nil {
		t.Fatal(err)
	}
	if err := out.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	var refusals []ledger.Event
	for _, r := range []*kgo.Record{as(same, "u_2"), as(other, "u_2")} {
		out, err := f.in.Step(t.Context(), []*kgo.Record{r})
		if err != nil {
			t.Fatal(err)
		}
		evs := events(t, out)
		if len(evs) != 1 || evs[0].Type != statemachine.EventDenied || evs[0].Reason != intake.ReasonIdempotencyKeyReuse || evs[0].Seq != 0 || evs[0].UserID != "u_2" {
			t.Fatalf("u_2's submission under u_1's key: events %+v; want one refusal (seq 0) of u_2, %s", evs, intake.ReasonIdempotencyKeyReuse)
		}
		refusals = append(refusals, evs[0])
	}
	if a, b := refusals[0], refusals[1]; a.Pointer != b.Pointer || a.Detail != b.Detail {
		t.Errorf("refusals of u_2's same and other arguments differ: %q %q against %q %q; want the same words", a.Pointer, a.Detail, b.Pointer, b.Detail)
	}
	// u_1's own retry is still a retry: no refusal (the call's own
	// events may go out again, its admission not yet marked logged).
	out, err = f.in.Step(t.Context(), []*kgo.Record{same})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range events(t, out) {
		if e.Seq == 0 || e.Type == statemachine.EventDenied {
			t.Errorf("u_1's retry appended %s (seq %d, %s); want no refusal", e.Type, e.Seq, e.Reason)
		}
	}
	if r, err := f.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k4"}); err != nil || r.UserID != "u_1" || r.Seq != 2 {
		t.Errorf("record = user %q seq %d, %v; want u_1's, untouched at seq 2", r.UserID, r.Seq, err)
	}
}

// With the policies given roles, a call is decided with its caller's
// roles, and its first events carry them, and that they were given, even
// none (encoding version 2), so that the executor decides an approved
// call again with the same; without, the policies see no roles attribute
// and the events say so (version 1).
func TestIntakeDecidesWithTheCallersRoles(t *testing.T) {
	dir := processorstest.PolicyDir(t, `@id("support") permit (principal, action == Action::"tool::create_ticket", resource)
  when { principal has roles && principal.roles.contains("support") };`)
	for _, tc := range []struct {
		name      string
		engine    *policy.Engine
		roles     []string
		allowed   bool
		wantRoles []string
		given     bool
	}{
		{"given roles, a supporter", processorstest.PolicyWithRoles(t, dir), []string{"support", "billing"}, true, []string{"billing", "support"}, true},
		{"given roles, no roles", processorstest.PolicyWithRoles(t, dir), nil, false, nil, true},
		{"not given roles", processorstest.Policy(t, dir), []string{"support"}, false, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newIntakeWith(t, func(c *intake.Config) { c.Policy = tc.engine })
			rec := withAssertion(t, f.envelopeRecord(t, "k-roles", map[string]any{"title": "t"}), f.ident.AssertionWithRoles(t, "t_a", "u_1", tc.roles...))
			out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
			if err != nil {
				t.Fatal(err)
			}
			evs := events(t, out)
			if len(evs) != 2 || evs[0].Type != statemachine.EventRequested || (evs[1].Type == statemachine.EventAuthorized) != tc.allowed {
				t.Fatalf("events %v; want requested, then authorized %v", evs, tc.allowed)
			}
			wantV := 1
			if tc.given {
				wantV = 2
			}
			for _, e := range evs {
				if !slices.Equal(e.Roles, tc.wantRoles) || e.RolesGiven != tc.given || e.V != wantV {
					t.Errorf("%s event: roles %q (given %v), v%d; want %q (given %v), v%d", e.Type, e.Roles, e.RolesGiven, e.V, tc.wantRoles, tc.given, wantV)
				}
			}
		})
	}
}

// A call's first events name the tool definition it is admitted under,
// the digest its record binds it to, so that a responder reads it in the
// log, the trace and the projections; an older build that ignores it
// reads the events as before (version 1, as without roles).
func TestIntakeEventsNameTheToolDefinition(t *testing.T) {
	reg, err := schemas.Load(os.DirFS("../testdata/registry"))
	if err != nil {
		t.Fatal(err)
	}
	tool, err := reg.Lookup("create_ticket", 1)
	if err != nil || tool.Digest() == "" {
		t.Fatalf("create_ticket v1: %v; want it, with a digest", err)
	}
	f := newIntake(t)
	rec := f.envelopeRecord(t, "k-digest", map[string]any{"title": "t"})
	out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	evs := events(t, out)
	if len(evs) != 2 {
		t.Fatalf("events %v; want requested, authorized", evs)
	}
	for _, e := range evs {
		if e.ToolDigest != tool.Digest() || e.V != 1 {
			t.Errorf("%s event: tool digest %q, v%d; want %q, v1", e.Type, e.ToolDigest, e.V, tool.Digest())
		}
	}
	stored, err := f.store.Get(t.Context(), evs[0].Key())
	if err != nil || stored.ToolDigest != tool.Digest() {
		t.Errorf("the record binds %q (%v); want %q", stored.ToolDigest, err, tool.Digest())
	}
}

// rejecting wraps the real store and makes it reject one key's data, as
// PostgreSQL rejects a value it cannot hold.
type rejecting struct {
	intake.Store
	key string
}

func (r rejecting) Admit(ctx context.Context, as []processors.Admission) ([]processors.AdmitResult, error) {
	for _, a := range as {
		if a.Key.IdempotencyKey == r.key {
			return nil, fmt.Errorf("value too odd: %w", processors.ErrRejected)
		}
	}
	return r.Store.Admit(ctx, as)
}

// rejectingLimiter is rejecting over a store that keeps rate limits.
type rejectingLimiter struct {
	rejecting
	processors.RateLimiter
}

// One envelope the store rejects is refused on its own; the rest of its
// batch goes through, and the partition does not stall.
func TestIntakeSetsAsideWhatTheStoreRejects(t *testing.T) {
	st, err := boltstore.Open(boltstore.Config{Path: filepath.Join(t.TempDir(), "x.db")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	reg, err := schemas.Load(os.DirFS("../testdata/registry"))
	if err != nil {
		t.Fatal(err)
	}
	ident := processorstest.NewIdentity(t)
	in, err := intake.New(intake.Config{Registry: reg, Store: rejecting{Store: st, key: "odd"}, Identity: ident.Verifier, Policy: processorstest.Policy(t, "../testdata/policies")})
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{in: in, ident: ident}
	out, err := f.in.Step(t.Context(), []*kgo.Record{
		f.envelopeRecord(t, "fine-1", map[string]any{"title": "a"}),
		f.envelopeRecord(t, "odd", map[string]any{"title": "b"}),
		f.envelopeRecord(t, "fine-2", map[string]any{"title": "c"}),
	})
	if err != nil {
		t.Fatalf("Step = %v; want the batch to go through", err)
	}
	var got []string
	for _, e := range events(t, out) {
		got = append(got, e.IdempotencyKey+":"+string(e.Type)+"/"+e.Reason)
	}
	want := []string{"fine-1:requested/", "fine-1:authorized/" + policy.ReasonAllowed, "odd:denied/" + intake.ReasonStoreRejected, "fine-2:requested/", "fine-2:authorized/" + policy.ReasonAllowed}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
}

// An intake without an identity verifier (one that only runs the ledger's
// own calls) refuses every envelope it is sent.
func TestIntakeWithoutVerifierRefusesEnvelopes(t *testing.T) {
	f := newIntake(t)
	st, err := boltstore.Open(boltstore.Config{Path: filepath.Join(t.TempDir(), "y.db")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	reg, err := schemas.Load(os.DirFS("../testdata/registry"))
	if err != nil {
		t.Fatal(err)
	}
	blind, err := intake.New(intake.Config{Registry: reg, Store: st, Policy: processorstest.Policy(t, "../testdata/policies")})
	if err != nil {
		t.Fatal(err)
	}
	out, err := blind.Step(t.Context(), []*kgo.Record{f.envelopeRecord(t, "k9", map[string]any{"title": "t"})})
	if err != nil {
		t.Fatal(err)
	}
	evs := events(t, out)
	if len(evs) != 1 || evs[0].Reason != intake.ReasonAssertionPrefix+"unverifiable" || evs[0].TenantID != ledger.UnverifiedTenant {
		t.Errorf("events %+v; want one refusal, assertion_unverifiable, under %s", evs, ledger.UnverifiedTenant)
	}
}

// An agent cannot use a key of the form the ledger's compensation calls
// use: its call would pass for the undoing of another call.
func TestIntakeRefusesReservedKeys(t *testing.T) {
	f := newIntake(t)
	out, err := f.in.Step(t.Context(), []*kgo.Record{f.envelopeRecord(t, "order-1:compensate", map[string]any{"title": "t"})})
	if err != nil {
		t.Fatal(err)
	}
	evs := events(t, out)
	if len(evs) != 1 || evs[0].Reason != intake.ReasonReservedKey || evs[0].Pointer != "/idempotency_key" {
		t.Errorf("events %+v; want one refusal, %s at /idempotency_key", evs, intake.ReasonReservedKey)
	}
}

// A refusal of a submission whose assertion was verified says who was
// refused: the verified user and agent (a scope that claims another
// tenant, a reserved key, arguments that do not match their hash), never
// the user the envelope's scope names. One refused before its assertion
// was verified names nobody.
func TestRefusalsNameTheVerifiedCaller(t *testing.T) {
	f := newIntake(t)
	retarget := func(r *kgo.Record, edit func(map[string]any)) *kgo.Record {
		var env map[string]any
		if err := json.Unmarshal(r.Value, &env); err != nil {
			t.Fatal(err)
		}
		edit(env)
		v, err := json.Marshal(env)
		if err != nil {
			t.Fatal(err)
		}
		return &kgo.Record{Topic: r.Topic, Value: v}
	}
	tests := []struct {
		name       string
		rec        *kgo.Record
		wantReason string
		wantUser   string
		wantAgent  string
	}{
		{"scope claims another tenant and user", retarget(f.envelopeRecord(t, "cross", map[string]any{"title": "t"}), func(env map[string]any) {
			env["scope"] = map[string]any{"tenant_id": "t_b", "user_id": "u_other"}
		}), intake.ReasonScopeMismatch, "u_1", "agent_test"},
		{"reserved key", f.envelopeRecord(t, "order-1:compensate", map[string]any{"title": "t"}), intake.ReasonReservedKey, "u_1", "agent_test"},
		{"arguments do not match their hash", retarget(f.envelopeRecord(t, "hash", map[string]any{"title": "t"}), func(env map[string]any) {
			env["arguments"] = map[string]any{"title": "other"}
		}), intake.ReasonHashMismatch, "u_1", "agent_test"},
		{"assertion not verified", retarget(f.envelopeRecord(t, "forged", map[string]any{"title": "t"}), func(env map[string]any) {
			env["assertion"] = "a.b.c"
		}), "", "", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out, err := f.in.Step(t.Context(), []*kgo.Record{tc.rec})
			if err != nil {
				t.Fatal(err)
			}
			evs := events(t, out)
			if len(evs) != 1 || evs[0].Type != statemachine.EventDenied {
				t.Fatalf("events %+v; want one refusal", evs)
			}
			ev := evs[0]
			if tc.wantReason != "" && ev.Reason != tc.wantReason {
				t.Errorf("reason %q; want %q", ev.Reason, tc.wantReason)
			}
			if ev.UserID != tc.wantUser || ev.AgentID != tc.wantAgent {
				t.Errorf("refusal names user %q, agent %q; want %q, %q", ev.UserID, ev.AgentID, tc.wantUser, tc.wantAgent)
			}
		})
	}
}

// A refusal stays a small record whatever the envelope's member names: a
// name the pointer and the detail would quote is cut (the pointer to a
// whole ancestor), so the refusal cannot outgrow a Kafka record and stall
// the partition.
func TestIntakeRefusalsAreBounded(t *testing.T) {
	f := newIntake(t)
	valid := f.envelopeRecord(t, "bounded", map[string]any{"title": "t"})
	// 85,000 LINE SEPARATORs: 255 KB as UTF-8, six-fold once escaped.
	long := strings.Repeat("\u2028", 85_000)
	withMember := func(v []byte, member string) []byte {
		return append(bytes.Clone(bytes.TrimSuffix(v, []byte("}"))), `,"`+member+`":1}`...)
	}
	tests := []struct {
		name        string
		value       []byte
		wantReason  string
		wantPointer string
	}{
		{"unknown member with a huge name", withMember(valid.Value, long), ledger.CodeUnknownField, ""},
		{"unknown member with a short name", withMember(valid.Value, "x"), ledger.CodeUnknownField, "/x"},
		{"argument with a huge name twice", bytes.Replace(valid.Value, []byte(`{"title":"t"}`), []byte(`{"title":"t","`+long[:120_000]+`":1,"`+long[:120_000]+`":2}`), 1),
			ledger.CodeDuplicateKey, "/arguments"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out, err := f.in.Step(t.Context(), []*kgo.Record{{Topic: "toolcalls.requests", Value: tc.value}})
			if err != nil {
				t.Fatal(err)
			}
			evs := events(t, out)
			if len(evs) != 1 || evs[0].Reason != tc.wantReason || evs[0].Pointer != tc.wantPointer {
				t.Fatalf("events %+v; want one refusal, %s at %q", evs, tc.wantReason, tc.wantPointer)
			}
			if n := len(out.Records[0].Key) + len(out.Records[0].Value); n > 4<<10 {
				t.Errorf("refusal record of %d bytes; want at most 4 KiB", n)
			}
			if !utf8.ValidString(evs[0].Detail) || len(evs[0].Detail) > 1<<10 {
				t.Errorf("detail of %d bytes (valid UTF-8: %v); want at most 1 KiB of valid UTF-8", len(evs[0].Detail), utf8.ValidString(evs[0].Detail))
			}
		})
	}
}

// An authorized call's admission is marked logged MarkDelay after its
// events are in the log, not at once: by then an executor's claim has
// usually marked it without a write of its own. A denied call, which no
// executor claims, is marked at once.
func TestIntakeMarksAuthorizedCallsLater(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	const delay = 3 * time.Second
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Now = func() time.Time { return now }
		c.MarkDelay = delay
	})
	authorized := f.envelopeRecord(t, "later", map[string]any{"title": "t"})
	// refund_order is high risk: the test policies deny it (no_policy).
	denied := f.toolRecord(t, "refund_order", 1, "at-once", map[string]any{"order_id": "ord_1", "amount_cents": 100, "currency": "EUR"})
	out, err := f.in.Step(t.Context(), []*kgo.Record{authorized, denied})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range events(t, out) {
		got = append(got, e.IdempotencyKey+":"+string(e.Type))
	}
	if want := []string{"later:requested", "later:authorized", "at-once:requested", "at-once:denied"}; !slices.Equal(got, want) {
		t.Fatalf("events %v; want %v", got, want)
	}
	if err := out.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	logged := func(key string) int64 {
		t.Helper()
		r, err := f.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: key})
		if err != nil {
			t.Fatal(err)
		}
		return r.LoggedSeq
	}
	if got := logged("at-once"); got != 2 {
		t.Errorf("denied call logged to %d after the commit; want 2, at once", got)
	}
	if got := logged("later"); got != 0 {
		t.Errorf("authorized call logged to %d after the commit; want 0 until %v later", got, delay)
	}
	// Idle ticks make the marks that fell due.
	now = now.Add(delay - time.Millisecond)
	if _, err := f.in.Step(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
	if got := logged("later"); got != 0 {
		t.Errorf("authorized call logged to %d before its delay; want 0", got)
	}
	now = now.Add(time.Millisecond)
	if _, err := f.in.Step(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
	if got := logged("later"); got != 2 {
		t.Errorf("authorized call logged to %d once its delay passed; want 2", got)
	}
}

// The arguments are canonicalized once: the record keeps them canonical,
// as they were hashed, so that the executor can check them without
// decoding them (ledger.HashCanonicalArguments); arguments that cannot be
// canonicalized are refused, pointing into them.
func TestIntakeKeepsTheHashedCanonicalArguments(t *testing.T) {
	f := newIntake(t)
	id := identity.Identity{Tenant: "t_a", User: "u_1", Agent: "ledger-compensation"}
	args := map[string]any{"title": "Printer on fire", "priority": "high"}
	hash, err := ledger.ArgumentsHash("t_a", "create_ticket", 1, args)
	if err != nil {
		t.Fatal(err)
	}
	env := &ledger.Envelope{
		Tool: "create_ticket", ToolVersion: 1, CallID: "c_1", Scope: ledger.Scope{TenantID: "t_a", UserID: "u_1"},
		IdempotencyKey: "k_canonical", ArgumentsHash: hash, Arguments: args,
	}
	evs, err := f.in.Submit(t.Context(), env, id, nil, "")
	if err != nil || len(evs) == 0 || evs[len(evs)-1].Type != "authorized" {
		t.Fatalf("Submit = %+v, %v; want the call authorized", evs, err)
	}
	rec, err := f.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k_canonical"})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"priority":"high","title":"Printer on fire"}`; string(rec.Arguments) != want {
		t.Errorf("stored arguments %s; want the canonical %s", rec.Arguments, want)
	}
	if h, err := ledger.HashCanonicalArguments("t_a", "create_ticket", 1, rec.Arguments); err != nil || h != rec.ArgumentsHash {
		t.Errorf("stored arguments hash to %s (%v); the record says %s", h, err, rec.ArgumentsHash)
	}

	// Canonical numbers can be longer than the ones sent: arguments
	// whose canonical form outgrows what the executor reads back are
	// refused, not stored.
	nums := make([]any, ledger.DefaultMaxBytes/16)
	for i := range nums {
		nums[i] = json.Number("1e15") // 1000000000000000 in canonical form
	}
	long := *env
	long.IdempotencyKey = "k_long"
	long.Arguments = map[string]any{"title": "x", "n": nums}
	if long.ArgumentsHash, err = ledger.ArgumentsHash("t_a", "create_ticket", 1, long.Arguments); err != nil {
		t.Fatal(err)
	}
	evs, err = f.in.Submit(t.Context(), &long, id, nil, "")
	if err != nil || len(evs) != 1 || evs[0].Reason != ledger.CodeTooLarge || evs[0].Pointer != "/arguments" {
		t.Fatalf("Submit(arguments whose canonical form is too large) = %+v, %v; want one refusal, too_large at /arguments", evs, err)
	}
	if _, err := f.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k_long"}); err == nil {
		t.Errorf("the refused call has a record")
	}

	bad := *env
	bad.IdempotencyKey = "k_nan"
	bad.Arguments = map[string]any{"title": "x", "priority": math.NaN()}
	evs, err = f.in.Submit(t.Context(), &bad, id, nil, "")
	if err != nil || len(evs) != 1 {
		t.Fatalf("Submit(NaN) = %+v, %v; want one refusal", evs, err)
	}
	if ev := evs[0]; ev.Type != "denied" || ev.Reason != ledger.CodeNumberOutOfRange || ev.Pointer != "/arguments/priority" {
		t.Errorf("Submit(NaN) refused %s (%s at %q); want denied (%s at /arguments/priority)", ev.Type, ev.Reason, ev.Pointer, ledger.CodeNumberOutOfRange)
	}
}

// staleControls is a copy of the control topic without freezes, as old
// as staleness says.
type staleControls struct{ staleness atomic.Int64 }

func (*staleControls) Frozen(string, string) (control.Action, bool) { return control.Action{}, false }
func (s *staleControls) Staleness() time.Duration                   { return time.Duration(s.staleness.Load()) }

// switchedControls is a current copy of the control topic whose every
// tool is frozen while frozen is set.
type switchedControls struct{ frozen atomic.Bool }

func (s *switchedControls) Frozen(tool, _ string) (control.Action, bool) {
	if !s.frozen.Load() {
		return control.Action{}, false
	}
	return control.Action{Kind: control.KindFreeze, Tool: tool, At: time.Now()}, true
}
func (*switchedControls) Staleness() time.Duration { return 0 }

// A call resent under its key while its tool is frozen is answered by the
// store, as a resend is (its events, or nothing new), not refused
// tool_frozen: its agent would take the call, which stands (its approval
// pending, say, to run after the unfreeze), for refused, and might send
// it again under another key. A new key is refused tool_frozen.
func TestIntakeFrozenToolResendOfAStandingCall(t *testing.T) {
	controls := &switchedControls{}
	f := newIntakeWith(t, func(c *intake.Config) { c.Freezes = controls })
	summary := func(out ledger.Output) []string {
		var got []string
		for _, e := range events(t, out) {
			got = append(got, fmt.Sprintf("%s@%d(%s)", e.Type, e.Seq, e.Reason))
		}
		return got
	}
	rec := f.envelopeRecord(t, "standing", map[string]any{"title": "t"})
	out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	if got := summary(out); !slices.Equal(got, []string{"requested@1()", "authorized@2(allowed)"}) {
		t.Fatalf("before the freeze: %v", got)
	}
	controls.frozen.Store(true)
	out, err = f.in.Step(t.Context(), []*kgo.Record{rec, f.envelopeRecord(t, "new", map[string]any{"title": "t"})})
	if err != nil {
		t.Fatal(err)
	}
	got := summary(out)
	if !slices.Contains(got, "denied@0(tool_frozen)") {
		t.Errorf("the new key while frozen: %v; want denied@0(tool_frozen)", got)
	}
	for _, e := range events(t, out) {
		if e.IdempotencyKey == "standing" && e.Type == "denied" {
			t.Errorf("the resend of a standing call while its tool is frozen: %s@%d(%s); want the store's answer, no refusal", e.Type, e.Seq, e.Reason)
		}
	}
}

// flippingControls answers the first check that asks whether the tool
// is frozen with first, and every later one with its opposite: a freeze,
// or an unfreeze, landing while a batch is checked.
type flippingControls struct {
	first bool
	asked atomic.Int32
}

func (c *flippingControls) Frozen(tool, _ string) (control.Action, bool) {
	if (c.asked.Add(1) == 1) != c.first {
		return control.Action{}, false
	}
	return control.Action{Kind: control.KindFreeze, Tool: tool, At: time.Now()}, true
}
func (*flippingControls) Staleness() time.Duration { return 0 }

// Of two identical copies of an envelope in one batch (a producer's
// retry), one checked while the tool was frozen and the other after the
// unfreeze, the call is admitted from the second and the first is
// answered by it, as a duplicate is: refused tool_frozen under the key,
// it read as the call's end to the sender waiting on it (ledger submit
// --wait matches it by call id and digest), while the call ran. When the
// other copy is refused too (the store rejects its data), the frozen
// copy's refusal stands.
func TestFrozenCopyInTheBatchThatAdmitsItsCall(t *testing.T) {
	for _, rejected := range []bool{false, true} {
		f := newIntakeWith(t, func(c *intake.Config) {
			c.Freezes = &flippingControls{first: true}
			if rejected {
				c.Store = rejecting{Store: c.Store, key: "twice"}
			}
		})
		rec := f.envelopeRecord(t, "twice", map[string]any{"title": "t"})
		again := *rec
		out, err := f.in.Step(t.Context(), []*kgo.Record{rec, &again})
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, e := range events(t, out) {
			got = append(got, string(e.Type)+"("+e.Reason+")")
		}
		want := []string{"requested()", "authorized(allowed)"}
		if rejected {
			want = []string{"denied(" + intake.ReasonToolFrozen + ")", "denied(" + intake.ReasonStoreRejected + ")"}
		}
		if slices.Sort(got); !slices.Equal(got, slices.Sorted(slices.Values(want))) {
			t.Errorf("the other copy rejected %v: events %v; want %v", rejected, got, want)
		}
	}
}

// failingGets is a store whose reads of one record fail.
type failingGets struct{ intake.Store }

func (failingGets) Get(context.Context, ledger.CallKey) (processors.Record, error) {
	return processors.Record{}, errors.New("connection reset")
}

// A call to a frozen tool whose key cannot be looked up (a store slow or
// down) is refused for now, to be sent again, not as a new call would be:
// refused tool_frozen outright, a resend of a call that stands was taken
// for refused.
func TestIntakeFrozenToolKeyNotReadable(t *testing.T) {
	controls := &switchedControls{}
	controls.frozen.Store(true)
	f := newIntakeWith(t, func(c *intake.Config) { c.Freezes, c.Store = controls, failingGets{c.Store} })
	out, err := f.in.Step(t.Context(), []*kgo.Record{f.envelopeRecord(t, "unreadable", map[string]any{"title": "t"})})
	if err != nil {
		t.Fatal(err)
	}
	evs := events(t, out)
	if len(evs) != 1 || evs[0].Reason != intake.ReasonToolFrozen || evs[0].RetryAfterMS <= 0 {
		t.Errorf("events %+v; want one refusal for now (tool_frozen with retry_after_ms)", evs)
	}
}

// An intake whose copy of the control topic is stale does not decide: a
// policy version activated since (one that denies, say) would not be
// honoured. The call is refused for now, control_state_stale with
// retry_after_ms, its key free; once the copy is current, the retry is
// decided.
func TestIntakeWithAStaleControlCopyDecidesNothing(t *testing.T) {
	controls := &staleControls{}
	f := newIntakeWith(t, func(c *intake.Config) { c.Freezes, c.ControlMaxStaleness = controls, 2*time.Second })
	rec := f.envelopeRecord(t, "stale", map[string]any{"title": "t"})
	for _, tc := range []struct {
		staleness time.Duration
		want      []string
	}{
		{-1, []string{"denied@0(control_state_stale) retry_after_ms=1000"}}, // never caught up
		{3 * time.Second, []string{"denied@0(control_state_stale) retry_after_ms=1000"}},
		{time.Second, []string{"requested@1()", "authorized@2(allowed)"}},
	} {
		controls.staleness.Store(int64(tc.staleness))
		out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, e := range events(t, out) {
			s := fmt.Sprintf("%s@%d(%s)", e.Type, e.Seq, e.Reason)
			if e.RetryAfterMS != 0 {
				s += fmt.Sprintf(" retry_after_ms=%d", e.RetryAfterMS)
			}
			got = append(got, s)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("with the copy %s old: %v; want %v", tc.staleness, got, tc.want)
		}
	}
}

// staleFrozenControls is a stale copy of the control topic whose every
// tool is frozen.
type staleFrozenControls struct{ staleControls }

func (*staleFrozenControls) Frozen(tool, _ string) (control.Action, bool) {
	return control.Action{Kind: control.KindFreeze, Tool: tool, At: time.Now()}, true
}

// A stale copy's freeze is no more told than its policies decide: the
// freeze may have been lifted since. The call is refused for now,
// control_state_stale with retry_after_ms, as any call on a stale copy.
// Before, it was refused tool_frozen, with no retry, and its agent may
// have stopped sending to a tool no longer frozen.
func TestIntakeStaleCopysFreezeIsNotTold(t *testing.T) {
	controls := &staleFrozenControls{}
	controls.staleness.Store(int64(3 * time.Second))
	f := newIntakeWith(t, func(c *intake.Config) { c.Freezes, c.ControlMaxStaleness = controls, 2*time.Second })
	out, err := f.in.Step(t.Context(), []*kgo.Record{f.envelopeRecord(t, "stale-frozen", map[string]any{"title": "t"})})
	if err != nil {
		t.Fatal(err)
	}
	evs := events(t, out)
	if len(evs) != 1 || evs[0].Reason != intake.ReasonControlStale || evs[0].RetryAfterMS <= 0 {
		t.Errorf("events %+v; want one refusal for now, control_state_stale with retry_after_ms", evs)
	}
}

// A copy of the control topic that catches up while a step checks its
// calls does not pass them decided with the version the step's policies
// were brought to while it was stale: the step's calls wait for the
// next. Before, staleness was asked per call, after the sync, and a call
// checked once the copy had caught up was decided under the superseded
// version.
func TestIntakeDecidesNothingSyncedFromAStaleCopy(t *testing.T) {
	controls := &staleControls{}
	controls.staleness.Store(int64(time.Minute))
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Freezes, c.ControlMaxStaleness = controls, 2*time.Second
		// The copy catches up right after the policies were brought
		// to what it held.
		c.SyncPolicies = func() { controls.staleness.Store(0) }
	})
	if _, got := f.step(t, f.envelopeRecord(t, "caught-up", map[string]any{"title": "t"})); !slices.Equal(got, []string{"caught-up:denied/" + intake.ReasonControlStale}) {
		t.Errorf("a call checked after the copy caught up: %v; want refused for now (control_state_stale)", got)
	}
	if _, got := f.step(t, f.envelopeRecord(t, "next", map[string]any{"title": "t"})); !slices.Contains(got, "next:authorized/allowed") {
		t.Errorf("the next step's call: %v; want authorized", got)
	}
}

// staleningControls is a copy of the control topic current when a step
// syncs its policies that goes stale while the step checks its calls
// (its kill switch is asked before the decision).
type staleningControls struct{ staleControls }

func (s *staleningControls) Frozen(string, string) (control.Action, bool) {
	s.staleness.Store(int64(time.Minute))
	return control.Action{}, false
}

// A copy of the control topic current when the step synced its policies
// but stale by the time a call is decided (the step's checks before it,
// an assertion's key refresh say, outlasted the bound) does not decide
// it either: the bound holds when a call is decided, as before the
// step's one verdict was taken.
func TestIntakeDecidesNothingOnACopyGoneStale(t *testing.T) {
	controls := &staleningControls{}
	f := newIntakeWith(t, func(c *intake.Config) { c.Freezes, c.ControlMaxStaleness = controls, 2*time.Second })
	if _, got := f.step(t, f.envelopeRecord(t, "gone-stale", map[string]any{"title": "t"})); !slices.Equal(got, []string{"gone-stale:denied/" + intake.ReasonControlStale}) {
		t.Errorf("a call decided once the copy went stale: %v; want refused for now (control_state_stale)", got)
	}
}

// catchingUpControls is a copy of the control topic that went stale
// while a call's assertion was verified (a key refresh that outlasted the
// bound), missed a freeze there, and caught up right after its freeze was
// read.
type catchingUpControls struct{ staleControls }

func (c *catchingUpControls) Frozen(string, string) (control.Action, bool) {
	defer c.staleness.Store(0)
	return control.Action{}, false
}

// stalingVerifier is a verifier whose verification outlasts the control
// copy's bound: the copy is stale once it answers.
type stalingVerifier struct {
	intake.Verifier
	controls *catchingUpControls
}

func (v stalingVerifier) Verify(ctx context.Context, assertion string) (identity.Identity, error) {
	v.controls.staleness.Store(int64(time.Minute))
	return v.Verifier.Verify(ctx, assertion)
}

// A freeze is read from a copy known current when it is read: a copy that
// went stale before it and caught up after (the decision's check then
// passing) is caught there, and the call refused for now. Before, the
// call was decided, and admitted, under a freeze the copy had missed.
func TestIntakeReadsTheFreezeFromACurrentCopy(t *testing.T) {
	controls := &catchingUpControls{}
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Freezes, c.ControlMaxStaleness = controls, 2*time.Second
		c.Identity = stalingVerifier{Verifier: c.Identity, controls: controls}
	})
	if _, got := f.step(t, f.envelopeRecord(t, "caught-up", map[string]any{"title": "t"})); !slices.Equal(got, []string{"caught-up:denied/" + intake.ReasonControlStale}) {
		t.Errorf("a call whose freeze was read from a stale copy: %v; want refused for now (control_state_stale)", got)
	}
}

// A step decides its calls with the policy version its copy of the
// control topic activates (SyncPolicies), not with the one the engine
// held at its last tick of following the activations. Before, calls
// decided in the half second after an activation reached the copy were
// decided, and recorded, under the version it replaced. So too for an
// activation the copy applies while a step checks its calls (an
// assertion's key fetched meanwhile, for seconds): each call is decided
// with the version the copy holds when it is decided. Before, the step's
// calls were decided with the version of its start.
func TestIntakeDecidesWithTheVersionItsCopyActivates(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "v2"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "v2", "p.cedar"), []byte(`@id("no-tickets") forbid (principal, action == Action::"tool::create_ticket", resource);
@id("rest") permit (principal, action, resource);`), 0o644); err != nil {
		t.Fatal(err)
	}
	engine := processorstest.Policy(t, "../testdata/policies")
	var active, midStep atomic.Pointer[policy.Activation]
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Policy = engine
		// What a copy of the control topic holds; the engine follows
		// no ticks here. midStep is applied to the copy right after
		// the engine is next brought to it: within a step, after its
		// start.
		c.SyncPolicies = func() {
			if a := active.Load(); a != nil {
				engine.Activate(root, *a, true)
			}
			if a := midStep.Swap(nil); a != nil {
				active.Store(a)
			}
		}
	})
	if _, got := f.step(t, f.envelopeRecord(t, "before", map[string]any{"title": "t"})); !slices.Contains(got, "before:authorized/allowed") {
		t.Fatalf("before the activation: %v; want authorized", got)
	}
	midStep.Store(&policy.Activation{Label: "v2", ID: "act-1"})
	if _, got := f.step(t, f.envelopeRecord(t, "mid", map[string]any{"title": "t"})); !slices.Contains(got, "mid:denied/"+policy.ReasonDeniedByPolicy) {
		t.Errorf("a call decided after an activation reached the copy within its step: %v; want denied by v2's forbid", got)
	}
	_, got := f.step(t, f.envelopeRecord(t, "after", map[string]any{"title": "t"}))
	if !slices.Contains(got, "after:denied/"+policy.ReasonDeniedByPolicy) {
		t.Errorf("the next step after the activation: %v; want denied by v2's forbid", got)
	}
}

// A policy that could not decide in time refuses the call for now, as a
// rate limit does: a refusal at seq 0 with retry_after_ms, and the key
// stays free, so that the agent's retry under the same key is decided
// afresh. Before, the timeout was the call's final denial (seq 2) and the
// retry a duplicate that changed nothing.
func TestIntakeRetryAfterAPolicyTimeoutIsDecidedAfresh(t *testing.T) {
	engine, stalled := processorstest.StallingPolicy(t, "../testdata/policies")
	f := newIntakeWith(t, func(c *intake.Config) { c.Policy = engine })
	rec := f.envelopeRecord(t, "slow-policy", map[string]any{"title": "t"})
	key := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "slow-policy"}

	stalled.Store(true)
	out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range events(t, out) {
		got = append(got, fmt.Sprintf("%s@%d(%s) retry_after_ms=%d versioned=%t", e.Type, e.Seq, e.Reason, e.RetryAfterMS, e.PolicyVersion != ""))
	}
	if want := []string{"denied@0(policy_timeout) retry_after_ms=1000 versioned=true"}; !slices.Equal(got, want) {
		t.Fatalf("after a policy timeout: %v; want %v", got, want)
	}
	if out.Committed != nil {
		if err := out.Committed(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	if r, err := f.store.Get(t.Context(), key); !errors.Is(err, processors.ErrNotFound) {
		t.Fatalf("after the refusal the store holds %s (%v); want the key free", r.Status, err)
	}

	// step runs rec through the intake, its events not marked logged.
	step := func() []string {
		t.Helper()
		out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, e := range events(t, out) {
			got = append(got, fmt.Sprintf("%s@%d", e.Type, e.Seq))
		}
		return got
	}
	stalled.Store(false)
	if got, want := step(), []string{"requested@1", "authorized@2"}; !slices.Equal(got, want) {
		t.Errorf("the retry once the policy answers appended %v; want %v", got, want)
	}

	// The same call resent while the policies stall again, before its
	// events were marked logged (a batch redelivered, an agent's resend):
	// a duplicate, its events sent again, not "retry later" for a call
	// that stands.
	stalled.Store(true)
	if got, want := step(), []string{"requested@1", "authorized@2"}; !slices.Equal(got, want) {
		t.Errorf("the call resent under a stalled policy appended %v; want its own events again %v", got, want)
	}
}

// policyEngine decides with a set of one policy file.
func policyEngine(t *testing.T, cedar string) *policy.Engine {
	t.Helper()
	set, err := policy.LoadFS(fstest.MapFS{"p.cedar": {Data: []byte(cedar)}}, "test")
	if err != nil {
		t.Fatal(err)
	}
	// A generous timeout, as processorstest.Policy's: a busy test
	// machine must not turn a decision into policy_timeout.
	e, err := policy.NewEngine(policy.Config{Set: set, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// A field a policy masks is hidden in the audit copy of every call of the
// tool, whatever the decision: a denial carries no obligations, and before
// the fix a denied call's requested event held the field in clear (the
// reviewer's case: a masked permit beside a forbid on priority "high").
func TestIntakeMasksTheArgumentsOfDeniedCalls(t *testing.T) {
	pol := policyEngine(t, `
@id("tickets") @mask("body")
permit (principal, action == Action::"tool::create_ticket", resource)
when { principal.tenant == resource.tenant && context.arguments.title != "unpermitted" };

@id("no-high")
forbid (principal, action == Action::"tool::create_ticket", resource)
when { context.arguments has priority && context.arguments.priority == "high" };

// Fails to evaluate for one title: no such argument.
@id("broken")
forbid (principal, action == Action::"tool::create_ticket", resource)
when { context.arguments.title == "broken" && context.arguments.no_such_argument == 1 };
`)
	f := newIntakeWith(t, func(c *intake.Config) { c.Policy = pol })
	const card = "CARD 4111111111111111"
	cases := []struct {
		key, title, priority string
		decision             string
	}{
		{"allowed", "printer", "low", "authorized/" + policy.ReasonAllowed},
		{"forbidden", "printer", "high", "denied/" + policy.ReasonDeniedByPolicy},
		{"no-permit", "unpermitted", "low", "denied/" + policy.ReasonNoPolicy},
		{"policy-error", "broken", "low", "denied/" + policy.ReasonPolicyError},
	}
	var recs []*kgo.Record
	for _, tc := range cases {
		recs = append(recs, f.envelopeRecord(t, tc.key, map[string]any{"title": tc.title, "priority": tc.priority, "body": card}))
	}
	out, err := f.in.Step(t.Context(), recs)
	if err != nil {
		t.Fatal(err)
	}
	byKey := make(map[string][]ledger.Event)
	for _, e := range events(t, out) {
		byKey[e.IdempotencyKey] = append(byKey[e.IdempotencyKey], e)
	}
	for _, tc := range cases {
		evs := byKey[tc.key]
		if len(evs) != 2 || evs[0].Type != "requested" || string(evs[1].Type)+"/"+evs[1].Reason != tc.decision {
			t.Errorf("%s: events %+v; want requested, then %s", tc.key, evs, tc.decision)
			continue
		}
		args := string(evs[0].Arguments)
		if strings.Contains(args, "4111111111111111") || !strings.Contains(args, `"body":"`+ledger.Redacted+`"`) {
			t.Errorf("%s (%s): requested event's arguments %s; want body masked", tc.key, tc.decision, args)
		}
	}
	// The whole number: a part of it ("4111") turns up in an event's
	// time now and then (08:42:11.39841112).
	for _, r := range out.Records {
		if bytes.Contains(r.Value, []byte("4111111111111111")) {
			t.Errorf("record %s holds the masked card number: %s", r.Key, r.Value)
		}
	}
}

// step runs one batch of records through the intake and returns its output
// and events as "<key>:<type>/<reason>".
func (f *fixture) step(t *testing.T, recs ...*kgo.Record) (ledger.Output, []string) {
	t.Helper()
	out, err := f.in.Step(t.Context(), recs)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range events(t, out) {
		got = append(got, e.IdempotencyKey+":"+string(e.Type)+"/"+e.Reason)
		if e.Reason == intake.ReasonRateLimited && (e.Seq != 0 || e.RetryAfterMS <= 0) {
			t.Errorf("rate-limited refusal %+v; want seq 0 with a retry-after", e)
		}
	}
	return out, got
}

// Each policy's rate limit is a budget of its own: calls under a 10/s
// permit do not spend a 1/m permit's budget, nor the other way round.
// Before, the bucket was the tenant's and the tool's alone: one call
// under the 10/s permit left the 1/m permit refused, and one under the
// 1/m permit spent the 10/s permit's burst.
//
// A call that two limited permits decide (the 1/m "slow" and the 2/m
// "triage", for high priority) is charged to both budgets, and refused
// while either is spent. Before, only the strictest limit was kept: such
// a call drew on slow's budget alone, so triage's was never drawn by it,
// and a call under both passed while triage's budget was spent.
func TestIntakeRateLimitIsPerPolicy(t *testing.T) {
	long := strings.Repeat("p", 2*processors.MaxRateBucketLen)
	pol := policyEngine(t, `
@id("fast") @rate_limit("10/s")
permit (principal, action == Action::"tool::create_ticket", resource)
when { context.arguments has priority && context.arguments.priority == "low" };

@id("slow") @rate_limit("1/m")
permit (principal, action == Action::"tool::create_ticket", resource)
when { context.arguments has priority && context.arguments.priority == "high" };

// Looser than slow, and deciding more calls: those without a priority
// too.
@id("triage") @rate_limit("2/m")
permit (principal, action == Action::"tool::create_ticket", resource)
when { !(context.arguments has priority) || context.arguments.priority == "high" };

// An id too long for a bucket name as it is.
@id("`+long+`") @rate_limit("5/m")
permit (principal, action == Action::"tool::create_ticket", resource)
when { context.arguments has priority && context.arguments.priority == "normal" };
`)
	authorized := func(key string) []string {
		return []string{key + ":requested/", key + ":authorized/" + policy.ReasonAllowed}
	}
	limited := func(key string) []string { return []string{key + ":denied/" + intake.ReasonRateLimited} }
	type call struct{ key, priority string }
	cases := []struct {
		name  string
		calls []call
		want  [][]string
		// detail, if set, is the last call's refusal's.
		detail string
	}{
		{
			name:  "the fast permit's calls leave the slow one's budget",
			calls: []call{{"fast-1", "low"}, {"slow-1", "high"}, {"slow-2", "high"}},
			want:  [][]string{authorized("fast-1"), authorized("slow-1"), limited("slow-2")},
		},
		{
			name:  "the slow permit's calls leave the fast one's budget",
			calls: []call{{"slow-1", "high"}, {"fast-1", "low"}, {"fast-2", "low"}, {"long-1", "normal"}},
			want:  [][]string{authorized("slow-1"), authorized("fast-1"), authorized("fast-2"), authorized("long-1")},
		},
		{
			name:   "a looser budget spent by calls only it decides refuses a call a stricter one also decides",
			calls:  []call{{"triage-1", ""}, {"triage-2", ""}, {"slow-1", "high"}},
			want:   [][]string{authorized("triage-1"), authorized("triage-2"), limited("slow-1")},
			detail: "at most 2/m for create_ticket in tenant t_a under policy triage",
		},
		{
			name:  "a call two limits decide draws on both budgets",
			calls: []call{{"slow-1", "high"}, {"triage-1", ""}, {"triage-2", ""}},
			want:  [][]string{authorized("slow-1"), authorized("triage-1"), limited("triage-2")},
		},
		{
			name:   "both spent: the refusal names both",
			calls:  []call{{"slow-1", "high"}, {"triage-1", ""}, {"slow-2", "high"}},
			want:   [][]string{authorized("slow-1"), authorized("triage-1"), limited("slow-2")},
			detail: "at most 1/m for create_ticket in tenant t_a under policy slow; at most 2/m for create_ticket in tenant t_a under policy triage",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newIntakeWith(t, func(c *intake.Config) { c.Policy = pol })
			var last ledger.Output
			for i, c := range tc.calls {
				args := map[string]any{"title": "t"}
				if c.priority != "" {
					args["priority"] = c.priority
				}
				out, got := f.step(t, f.envelopeRecord(t, c.key, args))
				if diff := cmp.Diff(tc.want[i], got); diff != "" {
					t.Errorf("%s (-want +got):\n%s", c.key, diff)
				}
				last = out
			}
			if tc.detail != "" {
				var got []string
				for _, e := range events(t, last) {
					got = append(got, string(e.Type)+": "+e.Detail)
				}
				if want := []string{"denied: " + tc.detail}; !cmp.Equal(want, got) {
					t.Errorf("last call's events %q; want %q", got, want)
				}
			}
		})
	}
}

// A limit "by user" is each verified user's budget, "by agent" each
// agent's: another user's (or agent's) calls do not spend it. The
// tenant's budget under the same limit is not theirs either.
func TestIntakeRateLimitByUserOrAgent(t *testing.T) {
	pol := policyEngine(t, `
@id("per-user") @rate_limit("1/m by user")
permit (principal, action == Action::"tool::create_ticket", resource)
when { context.arguments.title == "user" };

@id("per-agent") @rate_limit("1/m by agent")
permit (principal, action == Action::"tool::create_ticket", resource)
when { context.arguments.title == "agent" };
`)
	f := newIntakeWith(t, func(c *intake.Config) { c.Policy = pol })
	as := func(key, title, user, agent string) *kgo.Record {
		a, err := f.ident.Issuer.Mint(identity.Identity{Tenant: "t_a", User: user, Agent: agent}, processorstest.Audience, 10*time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		return withAssertion(t, f.envelopeRecord(t, key, map[string]any{"title": title}), a)
	}
	authorized := func(key string) []string {
		return []string{key + ":requested/", key + ":authorized/" + policy.ReasonAllowed}
	}
	limited := func(key string) []string { return []string{key + ":denied/" + intake.ReasonRateLimited} }
	for _, tc := range []struct {
		rec  *kgo.Record
		want []string
	}{
		{as("u1-1", "user", "u_1", "agent_a"), authorized("u1-1")},
		{as("u1-2", "user", "u_1", "agent_b"), limited("u1-2")},
		{as("u2-1", "user", "u_2", "agent_a"), authorized("u2-1")},
		{as("a-1", "agent", "u_1", "agent_a"), authorized("a-1")},
		{as("a-2", "agent", "u_2", "agent_a"), limited("a-2")},
		{as("b-1", "agent", "u_1", "agent_b"), authorized("b-1")},
	} {
		out, got := f.step(t, tc.rec)
		if diff := cmp.Diff(tc.want, got); diff != "" {
			t.Errorf("(-want +got):\n%s", diff)
		}
		if evs := events(t, out); len(evs) == 1 && !strings.Contains(evs[0].Detail, "at most 1/m by ") {
			t.Errorf("refusal's detail %q; want it to name the limit and whose budget it is", evs[0].Detail)
		}
	}
}

// countingPruner is a store that counts the intake's prunes of its rate
// buckets.
type countingPruner struct {
	*boltstore.Store
	prunes atomic.Int32
}

func (c *countingPruner) PruneRates(ctx context.Context, limit int) (int, error) {
	c.prunes.Add(1)
	return c.Store.PruneRates(ctx, limit)
}

// A prune deletes batch after batch while they come back full: a fixed
// batch a period fell behind users who come faster than it.
func TestIntakePrunesEveryFullBucket(t *testing.T) {
	var st *countingPruner
	t0 := time.Now()
	now := t0
	f := newIntakeWith(t, func(c *intake.Config) {
		st = &countingPruner{Store: c.Store.(*boltstore.Store)}
		c.Store, c.Now = st, func() time.Time { return now }
	})
	const n = 2*intake.RatePruneBatch + 500
	rs := make([]processors.RateRequest, n)
	for i := range rs {
		rs[i] = processors.RateRequest{Bucket: fmt.Sprintf("t_a/create_ticket/1/s by user/%d/p", i), Limit: 1, Window: time.Millisecond}
	}
	if _, err := st.Take(t.Context(), rs); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond) // the store's clock: full again
	now = t0.Add(intake.DefaultRatePruneEvery)
	if _, err := f.in.Step(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
	if got := st.prunes.Load(); got != 3 {
		t.Errorf("one prune made %d store calls for %d full buckets; want 3", got, n)
	}
	if left, err := st.Store.PruneRates(t.Context(), n); err != nil || left != 0 {
		t.Errorf("full buckets left after the prune: %d, %v; want none", left, err)
	}
}

// The intake prunes the store's full rate buckets once every
// RatePruneEvery, busy or idle, and never when told not to.
func TestIntakePrunesRateBuckets(t *testing.T) {
	for _, tc := range []struct {
		every time.Duration
		want  []int32 // prunes so far after each step
	}{
		{time.Minute, []int32{0, 1, 1, 2}},
		{-1, []int32{0, 0, 0, 0}},
	} {
		var st *countingPruner
		t0 := time.Now()
		now := t0
		f := newIntakeWith(t, func(c *intake.Config) {
			st = &countingPruner{Store: c.Store.(*boltstore.Store)}
			c.Store, c.RatePruneEvery, c.Now = st, tc.every, func() time.Time { return now }
		})
		for i, at := range []time.Duration{30 * time.Second, 61 * time.Second, 62 * time.Second, 2*time.Minute + time.Second} {
			now = t0.Add(at)
			var recs []*kgo.Record
			if i%2 == 0 {
				recs = append(recs, f.envelopeRecord(t, fmt.Sprintf("prune-%d", i), map[string]any{"title": "t"}))
			}
			if _, err := f.in.Step(t.Context(), recs); err != nil {
				t.Fatal(err)
			}
			if got := st.prunes.Load(); got != tc.want[i] {
				t.Errorf("every %v: %d prunes after the step at +%v; want %d", tc.every, got, at, tc.want[i])
			}
		}
	}
}

// Two copies of one key in a batch, with other arguments (a key reused)
// decided by other rate-limited policies: the store answers the later
// copy with the first's refusal, and the later copy's refusal names the
// budget that refused, not one of its own that had room. When the store
// rejects another envelope of the batch, the intake admits each alone:
// each copy is then charged, and refused, on its own budgets.
func TestIntakeRateLimitedCopiesNameTheRefusingBudget(t *testing.T) {
	pol := policyEngine(t, `
@id("slow") @rate_limit("1/m")
permit (principal, action == Action::"tool::create_ticket", resource)
when { context.arguments has priority && context.arguments.priority == "high" };

@id("fast") @rate_limit("1/m")
permit (principal, action == Action::"tool::create_ticket", resource)
when { context.arguments has priority && context.arguments.priority == "low" };
`)
	refusal := func(p string) string {
		return "denied/" + intake.ReasonRateLimited + ": at most 1/m for create_ticket in tenant t_a under policy " + p + " [" + p + "]"
	}
	for _, tc := range []struct {
		name  string
		alone bool   // the store rejects an envelope of the batch
		spent string // the priority whose budget is spent first
		want  []string
	}{
		{"admitted whole", false, "high", []string{refusal("slow"), refusal("slow")}},
		{"admitted alone", true, "", []string{refusal("slow"), refusal("fast")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newIntakeWith(t, func(c *intake.Config) {
				c.Policy = pol
				if tc.alone {
					c.Store = rejectingLimiter{rejecting{Store: c.Store, key: "odd"}, c.Store.(processors.RateLimiter)}
				}
			})
			spend := []string{"high", "low"}
			if tc.spent != "" {
				spend = []string{tc.spent}
			}
			for _, p := range spend {
				if _, got := f.step(t, f.envelopeRecord(t, "spent-"+p, map[string]any{"title": "t", "priority": p})); len(got) != 2 {
					t.Fatalf("the call that spends %s's budget: %q; want it authorized", p, got)
				}
			}
			batch := []*kgo.Record{
				f.envelopeRecord(t, "dup", map[string]any{"title": "t", "priority": "high"}),
				f.envelopeRecord(t, "dup", map[string]any{"title": "other", "priority": "low"}),
			}
			if tc.alone {
				batch = append([]*kgo.Record{f.envelopeRecord(t, "odd", map[string]any{"title": "o"})}, batch...)
			}
			out, _ := f.step(t, batch...)
			var got []string
			for _, e := range events(t, out) {
				if e.IdempotencyKey == "dup" {
					got = append(got, string(e.Type)+"/"+e.Reason+": "+e.Detail+" ["+strings.Join(e.PolicyID, ",")+"]")
				}
			}
			if !cmp.Equal(tc.want, got) {
				t.Errorf("the copies' events %q; want %q", got, tc.want)
			}
		})
	}
}

// A call is charged once, when the store first records it: the same
// batch redelivered after its step failed (the Kafka transaction
// aborted) appends the call's events again, and a duplicate sent later
// appends nothing; neither is charged, nor refused rate_limited while
// the call stands. Before, each charged the bucket again and came back
// rate_limited, and the redelivery left the call's events out of the log.
func TestIntakeRateLimitChargesACallOnce(t *testing.T) {
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Policy = policyEngine(t, `@id("one") @rate_limit("2/m")
permit (principal, action == Action::"tool::create_ticket", resource);`)
	})
	k1 := f.envelopeRecord(t, "k1", map[string]any{"title": "t"})
	first, got := f.step(t, k1)
	want := []string{"k1:requested/", "k1:authorized/" + policy.ReasonAllowed}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("first step (-want +got):\n%s", diff)
	}
	// The transaction aborted; Committed never ran. Redelivered twice.
	for i := range 2 {
		again, got := f.step(t, k1)
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("redelivery %d (-want +got):\n%s", i+1, diff)
		}
		if diff := cmp.Diff(events(t, first), events(t, again)); diff != "" {
			t.Errorf("redelivery %d appended other events (-first +again):\n%s", i+1, diff)
		}
		first = again
	}
	if err := first.Committed(t.Context()); err != nil {
		t.Fatal(err)
	}
	// Sent again by the agent, in a batch of its own and twice in one.
	for _, recs := range [][]*kgo.Record{{k1}, {k1, k1}} {
		if _, got := f.step(t, recs...); len(got) != 0 {
			t.Errorf("duplicate of a logged call: events %v; want none", got)
		}
	}
	// k1 was charged once: one call of the two is left.
	k2 := f.envelopeRecord(t, "k2", map[string]any{"title": "t"})
	k3 := f.envelopeRecord(t, "k3", map[string]any{"title": "t"})
	_, got = f.step(t, k2, k3, k3)
	want = []string{"k2:requested/", "k2:authorized/" + policy.ReasonAllowed,
		"k3:denied/" + intake.ReasonRateLimited, "k3:denied/" + intake.ReasonRateLimited}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("after k1 (-want +got):\n%s", diff)
	}
	if _, err := f.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k3"}); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("Get(k3) = %v; want ErrNotFound: a rate-limited key stays free", err)
	}
}

// A call dead on arrival (it waited in its partition past its deadline,
// the intake down, say) is admitted to expire, and charges no rate budget:
// the tenant's live call behind it is not refused for it. Before, a
// backlog of dead calls drained the budget, and the live calls behind it
// were refused rate_limited.
func TestIntakeDeadCallsChargeNoRateBudget(t *testing.T) {
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Policy = policyEngine(t, `@id("one") @rate_limit("1/m")
permit (principal, action == Action::"tool::create_ticket", resource);`)
	})
	withDeadline := func(r *kgo.Record, sent time.Time) *kgo.Record {
		var env map[string]any
		if err := json.Unmarshal(r.Value, &env); err != nil {
			t.Fatal(err)
		}
		env["deadline_ms"] = 8000
		r.Value, _ = json.Marshal(env)
		r.Timestamp = sent
		return r
	}
	dead := withDeadline(f.envelopeRecord(t, "dead", map[string]any{"title": "t"}), time.Now().Add(-10*time.Minute))
	live := withDeadline(f.envelopeRecord(t, "live", map[string]any{"title": "t"}), time.Now())
	_, got := f.step(t, dead, live)
	want := []string{"dead:requested/", "dead:authorized/" + policy.ReasonAllowed, "live:requested/", "live:authorized/" + policy.ReasonAllowed}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("a dead call, then a live one, under a budget of one a minute (-want +got):\n%s", diff)
	}
}

// A call dead here by less than the clocks' skew (its record backdated by
// the agent, its deadline_ms 1) is charged: an executor whose clock is
// behind might run it. Before, it went uncharged, and an agent could
// spray such calls past its rate limit, one running now and then.
func TestIntakeBarelyDeadCallsAreCharged(t *testing.T) {
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Policy = policyEngine(t, `@id("one") @rate_limit("1/h")
permit (principal, action == Action::"tool::create_ticket", resource);`)
	})
	barely := f.envelopeRecord(t, "barely", map[string]any{"title": "t"})
	var env map[string]any
	if err := json.Unmarshal(barely.Value, &env); err != nil {
		t.Fatal(err)
	}
	env["deadline_ms"] = 1
	barely.Value, _ = json.Marshal(env)
	barely.Timestamp = time.Now().Add(-intake.DeadlineSkew)
	_, got := f.step(t, barely, f.envelopeRecord(t, "next", map[string]any{"title": "t"}))
	want := []string{"barely:requested/", "barely:authorized/" + policy.ReasonAllowed, "next:denied/" + intake.ReasonRateLimited}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("a call dead by less than the skew, then another, under a budget of one an hour (-want +got):\n%s", diff)
	}
}

// A call the ledger makes itself (a compensation) is the same call
// whoever asks for it: a second operator's request, or the reconciler's
// after an operator's, is its retry, not another user's call under its
// key. Its record holds no user.
func TestIntakeSubmitIsTheSameCallForEveryAsker(t *testing.T) {
	f := newIntake(t)
	args := map[string]any{"title": "undo"}
	hash, err := ledger.ArgumentsHash("t_a", "create_ticket", 1, args)
	if err != nil {
		t.Fatal(err)
	}
	env := &ledger.Envelope{Tool: "create_ticket", ToolVersion: 1, CallID: "comp_c1", Scope: ledger.Scope{TenantID: "t_a"},
		IdempotencyKey: "k1:compensate", ArgumentsHash: hash, Arguments: args}
	for i, user := range []string{"u_op1", "u_op2", "ledger-reconciler"} {
		evs, err := f.in.Submit(t.Context(), env, identity.Identity{Tenant: "t_a", User: user, Agent: "ledger-compensation"}, nil, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range evs {
			if e.Type == statemachine.EventDenied {
				t.Errorf("ask %d (%s): %s (%s); want the call, or its retry", i+1, user, e.Type, e.Reason)
			}
		}
		if i == 0 && (len(evs) != 2 || evs[1].Type != statemachine.EventAuthorized) {
			t.Fatalf("first ask: %v; want requested, authorized", evs)
		}
	}
	if r, err := f.store.Get(t.Context(), ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1:compensate"}); err != nil || r.UserID != "" {
		t.Errorf("record user %q, %v; want none", r.UserID, err)
	}
}

// A call carrying another call's arguments (a compensation carries the
// undone call's) hides in its audit copy what the carried call's hid: the
// carried tool's registry redactions and the policies' masks for it, as
// well as its own. Before, a compensation tool without the masks put the
// undone call's masked values in clear on its requested event.
func TestIntakeSubmitHidesWhatTheCarriedCallHid(t *testing.T) {
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Policy = processorstest.Policy(t, processorstest.PolicyDir(t, `@id("tickets") permit (principal, action == Action::"tool::create_ticket", resource);
@id("cards") @mask("/body") permit (principal, action == Action::"tool::charge_card", resource);`))
	})
	args := map[string]any{"title": "undo", "body": "pin 4321", "priority": "high"}
	submit := func(key string, carries *schemas.Tool) string {
		t.Helper()
		hash, err := ledger.ArgumentsHash("t_a", "create_ticket", 1, args)
		if err != nil {
			t.Fatal(err)
		}
		env := &ledger.Envelope{Tool: "create_ticket", ToolVersion: 1, CallID: "comp_" + key, Scope: ledger.Scope{TenantID: "t_a"},
			IdempotencyKey: key, ArgumentsHash: hash, Arguments: args}
		evs, err := f.in.Submit(t.Context(), env, identity.Identity{Tenant: "t_a", User: "u_op", Agent: "ledger-compensation"}, carries, "")
		if err != nil {
			t.Fatal(err)
		}
		if len(evs) == 0 || evs[0].Type != statemachine.EventRequested {
			t.Fatalf("events %v; want requested first", evs)
		}
		return string(evs[0].Arguments)
	}
	if got := submit("k-plain:compensate", nil); !strings.Contains(got, "4321") {
		t.Fatalf("the audit copy of a call carrying none: %s; want its body in clear (nothing masks it)", got)
	}
	// The policies mask /body for the carried tool; its registry entry
	// redacts /title.
	carried := &schemas.Tool{Name: "charge_card", Redact: []string{"/title"}}
	got := submit("k-card:compensate", carried)
	for _, want := range []string{`"body":"[redacted]"`, `"title":"[redacted]"`, `"priority":"high"`} {
		if !strings.Contains(got, want) {
			t.Errorf("the audit copy %s; want %s (what the carried tool's masks hide, and nothing else)", got, want)
		}
	}
}

// The schema, the policies and the audit copy see the arguments as they
// were hashed and will run: a number spelt 4.5e3 or 4500.0 is the 4500
// it hashes as. Before, the schema took 4.5e3 for the integer 4500 while
// the policies saw no amount at all: a cap on amounts did not apply, and
// the tool was sent 4500.
func TestIntakeDecidesTheHashedArguments(t *testing.T) {
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Policy = processorstest.Policy(t, processorstest.PolicyDir(t, `@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);
@id("cap") forbid (principal, action == Action::"tool::refund_order", resource) when { context.has_amount && context.amount > 1000 };`))
	})
	id := identity.Identity{Tenant: "t_a", User: "u_1", Agent: "a"}
	for _, spelt := range []string{"4500", "4.5e3", "4500.0", "45e2"} {
		args := map[string]any{"order_id": "ord_1", "amount_cents": json.Number(spelt), "currency": "AUD"}
		hash, err := ledger.ArgumentsHash("t_a", "refund_order", 1, args)
		if err != nil {
			t.Fatal(err)
		}
		env := &ledger.Envelope{Tool: "refund_order", ToolVersion: 1, CallID: "c_" + spelt, Scope: ledger.Scope{TenantID: "t_a", UserID: "u_1"},
			IdempotencyKey: "k_" + spelt, ArgumentsHash: hash, Arguments: args}
		evs, err := f.in.Submit(t.Context(), env, id, nil, "")
		if err != nil {
			t.Fatal(err)
		}
		if last := evs[len(evs)-1]; last.Type != "denied" || len(last.PolicyID) != 1 || last.PolicyID[0] != "cap" {
			t.Errorf("amount_cents %s: %s by %v (%s); want denied by [cap]", spelt, last.Type, last.PolicyID, last.Reason)
		}
		if got := string(evs[0].Arguments); !strings.Contains(got, `"amount_cents":4500`) {
			t.Errorf("amount_cents %s: the audit copy is %s; want the hashed 4500", spelt, got)
		}
	}
}

// A call's deadline counts from when its request was published (its
// record's timestamp), allowing the producer's clock DeadlineSkew behind
// the intake's: a request that waited in its partition ten minutes (the
// intake down) with an 8 s deadline is past it when the intake reads it,
// and the executor expires it instead of running it long after its agent
// stopped waiting. Before, every deadline counted from the intake's
// reading.
func TestIntakeDeadlineCountsFromThePublish(t *testing.T) {
	now := time.Now().UTC().Truncate(time.Millisecond)
	f := newIntakeWith(t, func(c *intake.Config) { c.Now = func() time.Time { return now } })
	for _, tc := range []struct {
		name   string
		sent   time.Time
		wantAt time.Time
	}{
		{"sent ten minutes ago", now.Add(-10 * time.Minute), now.Add(-10*time.Minute + intake.DeadlineSkew + 8*time.Second)},
		{"a producer's clock 20 s behind", now.Add(-20 * time.Second), now.Add(8 * time.Second)},
		{"a producer's clock ahead", now.Add(time.Minute), now.Add(8 * time.Second)},
		{"no timestamp (Kafka's -1)", time.UnixMilli(-1), now.Add(8 * time.Second)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := f.envelopeRecord(t, "k_"+strings.ReplaceAll(tc.name, " ", "_"), map[string]any{"title": "t"})
			var env map[string]any
			if err := json.Unmarshal(rec.Value, &env); err != nil {
				t.Fatal(err)
			}
			env["deadline_ms"] = 8000
			rec.Value, _ = json.Marshal(env)
			rec.Timestamp = tc.sent
			out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
			if err != nil {
				t.Fatal(err)
			}
			evs := events(t, out)
			if len(evs) == 0 || evs[0].DeadlineAt == nil {
				t.Fatalf("events %+v; want requested with a deadline", evs)
			}
			if !evs[0].DeadlineAt.Equal(tc.wantAt) {
				t.Errorf("deadline %v; want %v", evs[0].DeadlineAt, tc.wantAt)
			}
		})
	}
}

// versionsOf answers every resource's version read with v, or err; or,
// hanging, not until the read's context ends, counting the reads waiting
// at once. reads, if set, counts every read.
type versionsOf struct {
	v       string
	err     error
	hanging bool
	waiting *atomic.Int64
	most    *atomic.Int64
	reads   *atomic.Int64
}

func (f versionsOf) ResourceVersion(ctx context.Context, _, _, _ string) (string, error) {
	if f.reads != nil {
		f.reads.Add(1)
	}
	if f.hanging {
		n := f.waiting.Add(1)
		for m := f.most.Load(); n > m && !f.most.CompareAndSwap(m, n); m = f.most.Load() {
		}
		<-ctx.Done()
		f.waiting.Add(-1)
		return "", ctx.Err()
	}
	return f.v, f.err
}

// A call admitted to wait for approval whose tool was frozen after its
// check, before its resource's version was read, reads nothing at the
// tool: the kill switch is asked again as the read is made. Before, the
// read went to the frozen tool.
func TestIntakeReadsNoVersionAtAToolFrozenSinceTheCheck(t *testing.T) {
	versions := versionsOf{v: "v7", reads: new(atomic.Int64)}
	f := newIntakeWith(t, func(c *intake.Config) {
		c.Policy = processorstest.Policy(t, processorstest.PolicyDir(t, `@id("refunds") @obligation("require_approval")
permit (principal, action == Action::"tool::refund_order", resource);`))
		c.Versions, c.BaseURL, c.VersionTimeout = versions, "http://tools.test", time.Second
		c.Freezes = &flippingControls{first: false}
	})
	out, err := f.in.Step(t.Context(), []*kgo.Record{f.toolRecord(t, "refund_order", 1, "k_frozen",
		map[string]any{"order_id": "ord_1", "amount_cents": 4500, "currency": "AUD"})})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ev := range events(t, out) {
		got = append(got, string(ev.Type)+"("+ev.ResourceVersion+")")
	}
	if !slices.Equal(got, []string{"requested()", "approval_pending()"}) || versions.reads.Load() != 0 {
		t.Errorf("events %v after %d version reads; want the call pending with no version, and none read", got, versions.reads.Load())
	}
}

// A call that must wait for an approval has its resource's version read
// when it is requested, onto its approval_pending event, for the
// approval to hold it to; a version that cannot be read leaves the event
// without one, and the call pending all the same.
func TestIntakeRecordsThePendingResourceVersion(t *testing.T) {
	const calls = 5
	for _, tc := range []struct {
		name     string
		versions versionsOf
		want     string
	}{
		{"read", versionsOf{v: "v7", reads: new(atomic.Int64)}, "v7"},
		{"unreadable", versionsOf{err: errors.New("connection refused"), reads: new(atomic.Int64)}, ""},
		{"hanging", versionsOf{hanging: true, waiting: new(atomic.Int64), most: new(atomic.Int64), reads: new(atomic.Int64)}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newIntakeWith(t, func(c *intake.Config) {
				c.Policy = processorstest.Policy(t, processorstest.PolicyDir(t, `@id("refunds") @obligation("require_approval")
permit (principal, action == Action::"tool::refund_order", resource);`))
				c.Versions, c.BaseURL, c.VersionTimeout = tc.versions, "http://tools.test", time.Second
			})
			var recs []*kgo.Record
			for i := range calls {
				recs = append(recs, f.toolRecord(t, "refund_order", 1, fmt.Sprintf("k_v%d", i),
					map[string]any{"order_id": fmt.Sprintf("ord_%d", i), "amount_cents": 4500, "currency": "AUD"}))
			}
			out, err := f.in.Step(t.Context(), recs)
			if err != nil {
				t.Fatal(err)
			}
			evs := events(t, out)
			pending := 0
			for _, ev := range evs {
				if ev.Type == "approval_pending" {
					pending++
					if ev.ResourceVersion != tc.want {
						t.Errorf("%s: resource version %q; want %q", ev.IdempotencyKey, ev.ResourceVersion, tc.want)
					}
				}
			}
			if pending != calls {
				t.Errorf("%d calls pending; want %d", pending, calls)
			}
			// A step's reads wait together, not one after another.
			if tc.versions.hanging && tc.versions.most.Load() != calls {
				t.Errorf("at most %d version reads waited at once; want all %d", tc.versions.most.Load(), calls)
			}
			// Resent, the calls are the store's to answer: their
			// versions are not read again (a hanging endpoint held up
			// every step with a resend, every tenant's calls in it).
			before := tc.versions.reads.Load()
			if _, err := f.in.Step(t.Context(), recs); err != nil {
				t.Fatal(err)
			}
			if n := tc.versions.reads.Load() - before; n != 0 {
				t.Errorf("the resends read %d resource versions; want none", n)
			}
		})
	}
}

// A duplicate of a call whose stored events this build cannot read (a
// newer build's encoding, mid-upgrade) leaves them out, and unlogged for a
// build that reads them; the batch goes on. Failing it redelivered the
// batch for as long as this build ran, holding up its partition.
func TestIntakeDuplicateWithUnreadableEventsDoesNotFailTheBatch(t *testing.T) {
	f := newIntake(t)
	newer := f.envelopeRecord(t, "k-newer", map[string]any{"title": "t"})
	var env struct {
		Hash string `json:"arguments_hash"`
	}
	if err := json.Unmarshal(newer.Value, &env); err != nil {
		t.Fatal(err)
	}
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k-newer"}
	if _, err := f.store.Admit(t.Context(), []processors.Admission{{Key: k, CallID: "c_k-newer", ArgumentsHash: env.Hash,
		Tool: "create_ticket", ToolVersion: 1, Arguments: []byte(`{"title":"t"}`), Status: processors.StatusAuthorized, Seq: 2,
		Outbox: []byte(`[{"v":99,"type":"authorized","seq":2}]`)}}); err != nil {
		t.Fatal(err)
	}
	out, err := f.in.Step(t.Context(), []*kgo.Record{newer, f.envelopeRecord(t, "k-other", map[string]any{"title": "t"})})
	if err != nil {
		t.Fatalf("step with a duplicate whose events are unreadable: %v; want the batch to go on", err)
	}
	var got []string
	for _, e := range events(t, out) {
		got = append(got, e.IdempotencyKey+" "+string(e.Type))
	}
	if diff := cmp.Diff([]string{"k-other requested", "k-other authorized"}, got); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if out.Committed != nil {
		if err := out.Committed(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	if rec, err := f.store.Get(t.Context(), k); err != nil || !rec.Unlogged() {
		t.Errorf("the unreadable call: unlogged %v, %v; want left unlogged, for a build that reads it", rec.Unlogged(), err)
	}
}

// An envelope whose assertion verifies but has expired (on its way to the
// intake: a restart, a rebalance) is refused under the tenant and user its
// signature proves, where its sender's wait and its tenant's operators
// see the refusal; one that expired longer ago than identity.LapsedGrace
// goes under the reserved tenant, as one that does not verify, and so
// does one whose key holds another call: under the key, the refusal would
// read as that call's end. Before, every such refusal went under the
// reserved tenant, and the sender's ?wait= ran out without a word.
//
// A copy of the call its key holds (sent again, or redelivered after the
// transaction that admitted it aborted) is refused nowhere: that call's
// events answer it, sent again as they are not in the log yet. Before, it
// was refused under the reserved tenant, which ledger submit --wait
// follows too, and took for the end of a call that then ran.
func TestLapsedAssertionRefusedWhereItsSenderSeesIt(t *testing.T) {
	for _, tc := range []struct {
		name         string
		late         time.Duration // the intake's clock ahead of the assertion's mint
		admitted     string        // the title of a call admitted under the key before it lapsed
		tenant, user string
	}{
		{"expired a minute ago", 11 * time.Minute, "", "t_a", "u_1"},
		{"expired an hour ago", 70 * time.Minute, "", ledger.UnverifiedTenant, ""},
		{"expired a minute ago, its call admitted", 11 * time.Minute, "t", "", ""},
		{"expired a minute ago, another call under its key", 11 * time.Minute, "another", ledger.UnverifiedTenant, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var late time.Duration
			f := lateIntake(t, &late)
			rec := f.envelopeRecord(t, "late", map[string]any{"title": "t"})
			if tc.admitted != "" {
				// Admitted, and its transaction lost: redelivered.
				if _, err := f.in.Step(t.Context(), []*kgo.Record{f.envelopeRecord(t, "late", map[string]any{"title": tc.admitted})}); err != nil {
					t.Fatal(err)
				}
			}
			late = tc.late
			out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
			if err != nil {
				t.Fatal(err)
			}
			evs := events(t, out)
			if tc.tenant == "" {
				if got := summaryOf(evs); !slices.Equal(got, []string{"t_a:requested", "t_a:authorized"}) {
					t.Fatalf("events %v; want the call's own, sent again, and no refusal", got)
				}
				return
			}
			if len(evs) != 1 || evs[0].Reason != intake.ReasonAssertionPrefix+"expired" || evs[0].Seq != 0 ||
				evs[0].TenantID != tc.tenant || evs[0].UserID != tc.user || evs[0].IdempotencyKey != "late" {
				t.Fatalf("events %+v; want one refusal, assertion_expired, under %s/late for user %q", evs, tc.tenant, tc.user)
			}
		})
	}
}

// registryWithout is the test registry with edit applied to its files
// (their names under tools/ to their contents; nil removes a file).
func registryWithout(t *testing.T, edit map[string][]byte) *schemas.Registry {
	t.Helper()
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "tools"), 0o755); err != nil {
		t.Fatal(err)
	}
	files, err := os.ReadDir("../testdata/registry/tools")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join("../testdata/registry/tools", f.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if e, ok := edit[f.Name()]; ok {
			if b = e; b == nil {
				continue
			}
		}
		if err := os.WriteFile(filepath.Join(dir, "tools", f.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	reg, err := schemas.Load(os.DirFS(dir))
	if err != nil {
		t.Fatal(err)
	}
	return reg
}

// A copy of a call an intake admitted (redelivered after its transaction
// aborted in a rebalance, or sent again) that reaches an intake whose
// registry lacks its tool, or defines it otherwise (a rolling deploy of
// the registry), is answered by the call its key holds, not refused under
// that key: a refusal there reads as the call's end to its sender, and
// the call then runs. A copy under a key that holds another call, or none,
// is refused as before; and one whose key cannot be read, for now.
func TestIntakeResentCallAnsweredWhateverItsRegistrySays(t *testing.T) {
	edited, err := os.ReadFile("../testdata/registry/tools/create_ticket.v1.json")
	if err != nil {
		t.Fatal(err)
	}
	edited = bytes.Replace(edited, []byte(`"minLength": 1`), []byte(`"minLength": 5`), 1)
	for _, tc := range []struct {
		name   string
		reg    map[string][]byte
		reason string
	}{
		{"its tool unknown here", map[string][]byte{"create_ticket.v1.json": nil}, intake.ReasonUnknownTool},
		{"its schema other here", map[string][]byte{"create_ticket.v1.json": edited}, intake.ReasonInvalidArguments},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newIntake(t)
			rec := a.envelopeRecord(t, "k-resent", map[string]any{"title": "t"})
			if _, err := a.in.Step(t.Context(), []*kgo.Record{rec}); err != nil {
				t.Fatal(err)
			}
			reads := &getFails{err: errors.New("connection reset")}
			reads.failed.Store(true) // reads answer until told otherwise
			b := newIntakeWith(t, func(c *intake.Config) {
				reads.Store = a.store
				c.Store, c.Identity, c.Registry = reads, a.ident.Verifier, registryWithout(t, tc.reg)
			})
			out, err := b.in.Step(t.Context(), []*kgo.Record{rec})
			if err != nil {
				t.Fatal(err)
			}
			// Its events are not in the log yet (A's transaction was
			// lost): sent again.
			if got := summaryOf(events(t, out)); !slices.Equal(got, []string{"t_a:requested", "t_a:authorized"}) {
				t.Errorf("the resent call: events %v; want its own, sent again, and no refusal", got)
			}
			// Another call under a key of its own: refused.
			other := a.envelopeRecord(t, "k-new", map[string]any{"title": "t"})
			out, err = b.in.Step(t.Context(), []*kgo.Record{other})
			if err != nil {
				t.Fatal(err)
			}
			if evs := events(t, out); len(evs) != 1 || evs[0].Reason != tc.reason || evs[0].Seq != 0 || evs[0].RetryAfterMS != 0 {
				t.Errorf("a new call: events %+v; want one refusal, %s, for good", evs, tc.reason)
			}
			// Its key not readable: refused for now.
			reads.always = true
			out, err = b.in.Step(t.Context(), []*kgo.Record{rec})
			if err != nil {
				t.Fatal(err)
			}
			if evs := events(t, out); len(evs) != 1 || evs[0].Reason != tc.reason || evs[0].RetryAfterMS == 0 {
				t.Errorf("the key not readable: events %+v; want one refusal, %s, for now", evs, tc.reason)
			}
		})
	}
}

// getFails is a store whose reads fail with err: the first only, unless
// always.
type getFails struct {
	intake.Store
	err    error
	always bool
	failed atomic.Bool
}

func (s *getFails) Get(ctx context.Context, key ledger.CallKey) (processors.Record, error) {
	if s.failed.CompareAndSwap(false, true) || s.always {
		return processors.Record{}, s.err
	}
	return s.Store.Get(ctx, key)
}

// An envelope whose assertion lapsed, and whose key the store cannot look
// up (a store slow or down), fails its batch, to be tried again: its
// redelivery is refused under the tenant and user its signature proves.
// Before, the refusal went under the reserved tenant, for good, where its
// sender never sees it.
func TestLapsedAssertionKeyNotReadable(t *testing.T) {
	f := lapsedIntake(t, &getFails{err: errors.New("connection reset")})
	rec := f.envelopeRecord(t, "late", map[string]any{"title": "t"})
	if out, err := f.in.Step(t.Context(), []*kgo.Record{rec}); err == nil {
		t.Fatalf("Step() with the key unreadable = %+v, nil; want an error, the batch tried again", events(t, out))
	}
	out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	evs := events(t, out)
	if len(evs) != 1 || evs[0].Reason != intake.ReasonAssertionPrefix+"expired" || evs[0].TenantID != "t_a" || evs[0].UserID != "u_1" {
		t.Errorf("events of the redelivery %+v; want one refusal, assertion_expired, under t_a/late for u_1", evs)
	}
}

// lateIntake is an intake whose verifier's clock is *late ahead, as the
// test sets it.
func lateIntake(t *testing.T, late *time.Duration) *fixture {
	t.Helper()
	return newIntakeWith(t, func(c *intake.Config) {
		v, err := identity.New(t.Context(), identity.Config{Issuer: processorstest.Issuer, Audience: processorstest.Audience,
			Keys: c.Identity.(*identity.Verifier).Keys(), Now: func() time.Time { return time.Now().Add(*late) }})
		if err != nil {
			t.Fatal(err)
		}
		c.Identity = v
	})
}

// lapsedIntake is an intake whose verifier's clock is 11 minutes ahead,
// so that the assertions it verifies have lapsed, over store (its Store
// set to the intake's), itself wrapped by wrap if given.
func lapsedIntake(t *testing.T, store *getFails, wrap ...func(intake.Store) intake.Store) *fixture {
	t.Helper()
	return newIntakeWith(t, func(c *intake.Config) {
		v, err := identity.New(t.Context(), identity.Config{Issuer: processorstest.Issuer, Audience: processorstest.Audience,
			Keys: c.Identity.(*identity.Verifier).Keys(), Now: func() time.Time { return time.Now().Add(11 * time.Minute) }})
		if err != nil {
			t.Fatal(err)
		}
		store.Store = c.Store
		c.Identity, c.Store = v, store
		for _, w := range wrap {
			c.Store = w(c.Store)
		}
	})
}

// A lapsed assertion whose key the store refuses for good
// (processors.ErrRejected: a value it cannot hold) is refused under the
// reserved tenant, and the batch goes on. Failed, it would be redelivered
// without end, stalling its partition for every tenant on it.
func TestLapsedAssertionKeyRejected(t *testing.T) {
	f := lapsedIntake(t, &getFails{err: fmt.Errorf("insert: %w", processors.ErrRejected), always: true})
	out, err := f.in.Step(t.Context(), []*kgo.Record{f.envelopeRecord(t, "late", map[string]any{"title": "t"})})
	if err != nil {
		t.Fatalf("Step() with the key refused by the store = %v; want the batch done", err)
	}
	if evs := events(t, out); len(evs) != 1 || evs[0].TenantID != ledger.UnverifiedTenant || evs[0].Reason != intake.ReasonAssertionPrefix+"expired" {
		t.Errorf("events %+v; want one refusal, assertion_expired, under %s", evs, ledger.UnverifiedTenant)
	}
}

// A copy of an envelope whose assertion lapsed, in the batch that admits
// the call from another copy (sent again under a fresh assertion after a
// publish that seemed to fail), is refused nowhere, whichever comes
// first: its refusal would read as the call's end to the sender waiting
// on it (ledger submit --wait follows the reserved tenant's key too),
// while the call runs. Before, the key was looked up before the batch
// admitted anything, found free, and the refusal filed under it; then
// under the reserved tenant.
//
// When the other copy is refused instead (here the store rejects its
// data), nothing stands under the key to answer the lapsed copy: it is
// refused under the reserved tenant, as it was before.
func TestLapsedCopyInTheBatchThatAdmitsItsCall(t *testing.T) {
	for _, tc := range []struct {
		lapsedFirst, rejected, unproven bool
	}{{true, false, false}, {false, false, false}, {true, true, false}, {false, true, false}, {true, false, true}, {false, true, true}} {
		lapsedFirst := tc.lapsedFirst
		var wrap []func(intake.Store) intake.Store
		if tc.rejected {
			wrap = append(wrap, func(s intake.Store) intake.Store { return rejecting{Store: s, key: "late"} })
		}
		f := lapsedIntake(t, &getFails{always: true, err: processors.ErrNotFound}, wrap...) // as the store answers: nothing admitted yet
		lapsed := f.envelopeRecord(t, "late", map[string]any{"title": "t"})                 // valid 10 minutes: lapsed to the intake, 11 ahead
		if tc.unproven {
			lapsed = withAssertion(t, lapsed, noIatAssertion(t, f)) // the same, without iat
		}
		a, err := f.ident.Issuer.Mint(identity.Identity{User: "u_1", Agent: "agent_test", Tenant: "t_a"}, processorstest.Audience, 30*time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		batch := []*kgo.Record{lapsed, withAssertion(t, lapsed, a)}
		if !lapsedFirst {
			slices.Reverse(batch)
		}
		out, err := f.in.Step(t.Context(), batch)
		if err != nil {
			t.Fatal(err)
		}
		var underKey, refused []string
		for _, e := range events(t, out) {
			if e.TenantID == "t_a" {
				underKey = append(underKey, string(e.Type)+"("+e.Reason+")")
			} else if e.Reason == intake.ReasonAssertionPrefix+"expired" {
				refused = append(refused, e.TenantID)
			}
		}
		if tc.rejected {
			if !slices.Equal(underKey, []string{"denied(" + intake.ReasonStoreRejected + ")"}) || !slices.Equal(refused, []string{ledger.UnverifiedTenant}) {
				t.Errorf("lapsed copy first %v, the other rejected: events under t_a/late %v, the lapsed copy refused under %v; want the rejection, and the refusal under %s", lapsedFirst, underKey, refused, ledger.UnverifiedTenant)
			}
			continue
		}
		if !slices.Equal(underKey, []string{"requested()", "authorized(allowed)"}) || len(refused) != 0 {
			t.Errorf("lapsed copy first %v: events under t_a/late %v, the lapsed copy refused under %v; want the call's requested and authorized alone, and no refusal", lapsedFirst, underKey, refused)
		}
	}
}

// A refusal of an assertion whose tenant claim is not a tenant id the
// schema allows (one holding a "/") goes under the reserved tenant: under
// the claim, "t_a/ops" and the key "run1" make the Kafka key of tenant
// t_a's call "ops/run1", whose readers would take the refusal for theirs.
func TestRefusalOfAMalformedTenantClaim(t *testing.T) {
	f := newIntake(t)
	rec := f.envelopeRecord(t, "run1", map[string]any{"title": "t"})
	for name, r := range map[string]*kgo.Record{
		"scope mismatch": withAssertion(t, rec, f.ident.Assertion(t, "t_a/ops", "u_1")),
		"reserved key":   withAssertion(t, f.envelopeRecord(t, "run1:compensate", map[string]any{"title": "t"}), f.ident.Assertion(t, "t_a/ops", "u_1")),
	} {
		out, err := f.in.Step(t.Context(), []*kgo.Record{r})
		if err != nil {
			t.Fatal(err)
		}
		if evs := events(t, out); len(evs) != 1 || evs[0].TenantID != ledger.UnverifiedTenant || evs[0].Seq != 0 {
			t.Errorf("%s: events %+v; want one refusal under %s", name, evs, ledger.UnverifiedTenant)
		}
	}
}

// hungReads is a store whose reads never answer: each waits for its
// context to end. It counts them.
type hungReads struct {
	intake.Store
	reads atomic.Int64
}

func (s *hungReads) Get(ctx context.Context, _ ledger.CallKey) (processors.Record, error) {
	s.reads.Add(1)
	<-ctx.Done()
	return processors.Record{}, ctx.Err()
}

// A batch's reads of keys that may hold a resent call (here: every
// envelope is for a tool this intake lacks) stop once one ran out of its
// time: a store that hangs costs the batch that once, not once an
// envelope (a flood of calls to an unknown tool would stall the
// partition for minutes). Each is refused for now.
func TestIntakeBatchStopsReadingAHungStore(t *testing.T) {
	st := &hungReads{}
	f := newIntakeWith(t, func(c *intake.Config) {
		st.Store = c.Store
		c.Store, c.Registry = st, registryWithout(t, map[string][]byte{"create_ticket.v1.json": nil})
	})
	var batch []*kgo.Record
	for i := range 40 {
		batch = append(batch, f.envelopeRecord(t, fmt.Sprint("k-", i), map[string]any{"title": "t"}))
	}
	out, err := f.in.Step(t.Context(), batch)
	if err != nil {
		t.Fatal(err)
	}
	evs := events(t, out)
	for _, e := range evs {
		if e.Reason != intake.ReasonUnknownTool || e.RetryAfterMS == 0 {
			t.Fatalf("event %+v; want unknown_tool, for now", e)
		}
	}
	if len(evs) != len(batch) {
		t.Fatalf("%d refusals for %d envelopes; want one each", len(evs), len(batch))
	}
	// The checks run on up to GOMAXPROCS goroutines: as many reads may
	// be under way when the first runs out, and none after.
	if n := st.reads.Load(); n > int64(runtime.GOMAXPROCS(0)) {
		t.Errorf("%d reads of a hung store for %d envelopes; want at most %d, those under way when the first ran out", n, len(batch), runtime.GOMAXPROCS(0))
	}
}

// noIatAssertion is an assertion of u_1 of t_a from f's issuer, valid for
// 10 minutes, that states no iat: its lifetime is unknown.
func noIatAssertion(t *testing.T, f *fixture) string {
	t.Helper()
	a, err := token.Sign(f.ident.Key, identity.TypeAssertion, identity.Claims{
		Claims: token.Claims{Issuer: processorstest.Issuer, Subject: "u_1", Audience: token.Audience{processorstest.Audience},
			ExpiresAt: token.NewNumericDate(time.Now().Add(10 * time.Minute))},
		Act: identity.Actor{Subject: "agent_test"}, Tenant: "t_a",
	})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// An assertion whose lifetime its issuer does not state (no iat: exp
// alone bounds nothing once past) never proves enough to file a refusal
// under its tenant; but a copy of its user's call that its key holds,
// redelivered after the assertion lapsed, is answered by that call all
// the same, as a duplicate. Before, it was refused under the reserved
// tenant, which ledger submit --wait follows, and the call then ran.
func TestLapsedUnprovenAssertionAnswersACopyOfItsCall(t *testing.T) {
	var late time.Duration
	f := lateIntake(t, &late)
	a := noIatAssertion(t, f)
	rec := withAssertion(t, f.envelopeRecord(t, "late", map[string]any{"title": "t"}), a)
	if out, err := f.in.Step(t.Context(), []*kgo.Record{rec}); err != nil || !slices.Equal(summaryOf(events(t, out)), []string{"t_a:requested", "t_a:authorized"}) {
		t.Fatalf("admitting the call: %v", err)
	}
	late = 11 * time.Minute
	out, err := f.in.Step(t.Context(), []*kgo.Record{rec})
	if err != nil {
		t.Fatal(err)
	}
	if got := summaryOf(events(t, out)); !slices.Equal(got, []string{"t_a:requested", "t_a:authorized"}) {
		t.Errorf("the redelivered copy: events %v; want the call's own, sent again, and no refusal", got)
	}
	out, err = f.in.Step(t.Context(), []*kgo.Record{withAssertion(t, f.envelopeRecord(t, "late-2", map[string]any{"title": "t"}), a)})
	if err != nil {
		t.Fatal(err)
	}
	if evs := events(t, out); len(evs) != 1 || evs[0].TenantID != ledger.UnverifiedTenant || evs[0].Reason != intake.ReasonAssertionPrefix+"expired" {
		t.Errorf("a new call under it: events %+v; want one refusal, assertion_expired, under %s", evs, ledger.UnverifiedTenant)
	}
}

// refusingVerifier refuses every assertion with err.
type refusingVerifier struct{ err error }

func (v refusingVerifier) Verify(context.Context, string) (identity.Identity, error) {
	return identity.Identity{}, v.err
}

// An envelope refused because this intake's keys of the issuer cannot
// judge its assertion now is refused for now (retry_after_ms, the
// verifier's): the keys are stale (not refreshed for longer than
// MaxStale), or its kid is unknown and the keys were not loaded again
// since it came. The assertion may be good, and its sender must send it
// again, not take the refusal for its call's end. Before, both were
// refused for good. An unknown kid looked for in fresh keys still is.
func TestAssertionsRefusedForNow(t *testing.T) {
	for _, tc := range []struct {
		name, reason string
		err          error
		after        time.Duration
	}{
		{"stale keys", identity.ReasonKeysStale, &identity.ForNowError{RetryAfter: identity.StaleRetryAfter,
			Err: &token.Error{Reason: identity.ReasonKeysStale, Detail: "the issuer's keys could not be loaded for 25h"}}, identity.StaleRetryAfter},
		{"unknown kid, not looked for yet", token.ReasonUnknownKID, &identity.ForNowError{RetryAfter: 42 * time.Second,
			Err: &token.Error{Reason: token.ReasonUnknownKID, Detail: "kid k2"}}, 42 * time.Second},
		{"unknown kid, looked for", token.ReasonUnknownKID, &token.Error{Reason: token.ReasonUnknownKID, Detail: "kid k2"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newIntakeWith(t, func(c *intake.Config) { c.Identity = refusingVerifier{tc.err} })
			out, got := f.step(t, f.envelopeRecord(t, "refused", map[string]any{"title": "t"}))
			evs := events(t, out)
			if !slices.Equal(got, []string{"refused:denied/" + intake.ReasonAssertionPrefix + tc.reason}) ||
				evs[0].TenantID != ledger.UnverifiedTenant || evs[0].RetryAfterMS != tc.after.Milliseconds() {
				t.Errorf("refused: %v, %+v; want refused under %s, retry after %s", got, evs, ledger.UnverifiedTenant, tc.after)
			}
		})
	}
}

// A refusal names the copy of the call it refuses, by the digest of the
// envelope's bytes as published (its call id sent again with a fresh
// assertion is another copy, refused or admitted on its own), whether
// the envelope decoded or only its key could be read.
func TestRefusalNamesTheCopyItRefuses(t *testing.T) {
	f := newIntake(t)
	bad := f.toolRecord(t, "no_such_tool", 1, "copy", map[string]any{"title": "t"})
	undecodable := &kgo.Record{Topic: "toolcalls.requests",
		Value: []byte(`{"tool":"create_ticket","tool_version":1,"call_id":"c_u","scope":{"tenant_id":"t_a"},"idempotency_key":"undecodable","arguments":{"title":"t"},"arguments_hash":"sha256:00","priority":"urgent"}`)}
	out, _ := f.step(t, bad, undecodable)
	evs := events(t, out)
	if len(evs) != 2 {
		t.Fatalf("%d events; want the two refusals", len(evs))
	}
	for i, rec := range []*kgo.Record{bad, undecodable} {
		if want := ledger.RequestDigest(rec.Value); evs[i].Seq != 0 || evs[i].RequestDigest != want {
			t.Errorf("refusal of %s names request %q; want %q", evs[i].IdempotencyKey, evs[i].RequestDigest, want)
		}
	}
}
