package consistency

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// TestCheckRun writes a run's history to Kafka, every check failing at
// least once beside calls that pass, and checks every figure of the report.
func TestCheckRun(t *testing.T) {
	t.Parallel()
	k := newKafka(t, 2)
	topic := k.Topics.Events
	a, zombie := producer(t, k, "executor-1"), producer(t, k, "executor-2")
	plain := producer(t, k, "")

	// A record only the ledger could not have written, first on its
	// partition.
	produce(t, plain, []*kgo.Record{{Topic: topic, Key: []byte("t1/junk"), Value: []byte("not json")}})
	junkPartition := ledger.PartitionFor([]byte("t1/junk"), 2)

	var committed []ledger.Event
	commit := func(evs ...ledger.Event) {
		t.Helper()
		txn(t, a, true, records(t, topic, evs))
		committed = append(committed, evs...)
	}
	join := func(parts ...[]ledger.Event) []ledger.Event {
		var out []ledger.Event
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	s := time.Second
	commit(history(key("ok"), s, succeeded...)...)
	reappended := history(key("reappended"), 2*s, succeeded...)
	commit(reappended...)
	commit(history(key("read"), 3*s, succeeded...)...)
	commit(history(key("dup"), s, succeeded...)...)
	commit(history(key("missing"), s, succeeded...)...)
	commit(history(key("failed-orphan"), s, req, auth, exec, fail)...)
	commit(history(key("conflict"), s, succeeded...)...)
	commit(ev(key("conflict"), 4, fail, 4*s))
	commit(history(key("unknown-resolved"), s, req, auth, exec, unknown, ok)...)
	commit(join(history(key("unknown-compensated"), s, req, auth, exec, unknown), []ledger.Event{ev(key("unknown-compensated"), 5, comp, 10*s)})...)
	commit(history(key("parked"), s, req, auth, exec, unknown, parked)...)
	commit(history(key("unresolved"), s, req, auth, exec, unknown)...)
	commit(history(key("denied"), s, req, denied)...)
	commit(ev(key("refused"), 0, denied, 0))
	commit(history(key("pending"), s, req, pendingA)...)
	commit(history(key("compensated"), s, req, auth, exec, ok, comp)...)
	compensation := key("compensated").CompensationKey()
	commit(history(compensation, s, succeeded...)...)
	commit(history(key("stuck"), s, req, auth)...)
	commit(history(key("illegal"), s, req, exec)...)
	commit(join(history(key("gap"), s, req, auth), []ledger.Event{ev(key("gap"), 4, ok, 4*s)})...)
	// The executor that ran "aborted" died before its transaction
	// committed; a zombie's transaction, which would have forked "ok" at
	// seq 4, was aborted too.
	abortedCall := history(key("aborted"), s, succeeded...)
	commit(abortedCall[:2]...)
	txn(t, a, false, records(t, topic, abortedCall[2:]))
	txn(t, zombie, false, records(t, topic, []ledger.Event{ev(key("ok"), 4, fail, 4*s)}))
	// A restarted executor re-appends reappended's last two events, left
	// out of the log as far as its store knew.
	commit(reappended[2:]...)

	l := readLogT(t, k, readOpts{})

	submitted := []Submitted{{key("ok"), base.Add(s)}} // submitted twice: the earlier time counts
	for _, c := range []string{
		"ok", "reappended", "read", "dup", "missing", "failed-orphan", "stuck", "never", "aborted", "conflict",
		"unknown-resolved", "unknown-compensated", "parked", "unresolved", "denied", "refused", "pending", "compensated",
	} {
		submitted = append(submitted, Submitted{key(c), base})
	}
	effect := func(tool, call string) demobackend.Effect {
		return demobackend.Effect{Tool: tool, TenantID: "t1", IdempotencyKey: "t1/" + call}
	}
	replay := effect("create_ticket", "reappended")
	replay.Replay = true
	read := effect("get_weather", "read")
	read.Read = true
	effects := []demobackend.Effect{
		effect("create_ticket", "ok"),
		effect("create_ticket", "reappended"), replay,
		read, read,
		effect("send_email", "dup"), effect("send_email", "dup"),
		effect("create_ticket", "failed-orphan"),
		effect("create_ticket", "ghost"),
		effect("create_ticket", "conflict"),
		effect("send_email", "unknown-resolved"),
		effect("send_email", "unknown-compensated"),
		effect("refund_order", "compensated"),
		effect("cancel_refund", compensation.IdempotencyKey),
	}

	r := Check(l, submitted, effects)

	// The undecodable record's example carries the decoder's message.
	undecodable := r.Examples["undecodable"]
	if prefix := fmt.Sprintf("%d/0 t1/junk: decode event:", junkPartition); len(undecodable) != 1 || !strings.HasPrefix(undecodable[0], prefix) {
		t.Errorf("Examples[undecodable] = %q; want one starting %q", undecodable, prefix)
	}
	delete(r.Examples, "undecodable")

	want := Report{
		Submitted: 18, Terminal: 11, Refused: 1, Pending: 1, Lost: 3,
		Calls: 19, Events: int64(len(committed)), DuplicateEvents: 2, ConflictingEvents: 1, IllegalTransitions: 2,
		AbortedRecords: 3, Undecodable: 1,
		Effects: 11, DuplicateEffects: 1, MissingEffects: 1, OrphanEffects: 2,
		OutcomeUnknown: 4, Unresolved: 1, Parked: 1,
		// Terminal after 2, 4 (six calls), 5, 8, 10 and 12 seconds.
		TimeToTerminalP50: 4 * s, TimeToTerminalP99: 12 * s,
		// Resolved after 1 and 6 seconds.
		TimeToResolveP50: s, TimeToResolveP99: 6 * s,
		Examples: map[string][]string{
			"lost":                {"t1/aborted authorized", "t1/never no event", "t1/stuck authorized"},
			"conflicting_events":  {"t1/conflict seq 4"},
			"illegal_transitions": {"t1/gap seq 4 succeeded: seq gap: seq 4 after 2", `t1/illegal seq 2 executing: invalid transition from "requested" on "executing"`},
			"duplicate_effects":   {"send_email:t1/dup 2 effects"},
			"missing_effects":     {"t1/missing"},
			"orphan_effects":      {"create_ticket:t1/failed-orphan failed", "create_ticket:t1/ghost not in the log"},
			"unresolved":          {"t1/unresolved"},
			"parked":              {"t1/parked"},
		},
	}
	if diff := cmp.Diff(want, r); diff != "" {
		t.Errorf("Check (-want +got):\n%s", diff)
	}

	wantF := []string{
		"lost: 3 (t1/aborted authorized, t1/never no event, t1/stuck authorized)",
		"conflicting_events: 1 (t1/conflict seq 4)",
		`illegal_transitions: 2 (t1/gap seq 4 succeeded: seq gap: seq 4 after 2, t1/illegal seq 2 executing: invalid transition from "requested" on "executing")`,
		"undecodable: 1",
		"duplicate_effects: 1 (send_email:t1/dup 2 effects)",
		"missing_effects: 1 (t1/missing)",
		"orphan_effects: 2 (create_ticket:t1/failed-orphan failed, create_ticket:t1/ghost not in the log)",
		"unresolved: 1 (t1/unresolved)",
	}
	if diff := cmp.Diff(wantF, r.Failures()); diff != "" {
		t.Errorf("Failures() (-want +got):\n%s", diff)
	}

	var buf bytes.Buffer
	if err := r.WriteTable(&buf); err != nil {
		t.Fatalf("WriteTable: %v", err)
	}
	table := make(map[string][]string)
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		f := strings.Fields(line)
		table[f[0]] = f[1:]
	}
	for name, row := range map[string][]string{
		"figure":               {"value"},
		"submitted":            {"18"},
		"lost":                 {"3", "FAIL", "(must", "be", "0)"},
		"aborted_records":      {"3"},
		"aborted_visible":      {"0", "ok"},
		"unresolved":           {"1", "FAIL", "(must", "be", "0)"},
		"parked":               {"1"},
		"time_to_terminal_p50": {"4s"},
		"time_to_terminal_p99": {"12s"},
		"time_to_resolve_p99":  {"6s"},
	} {
		if diff := cmp.Diff(row, table[name]); diff != "" {
			t.Errorf("WriteTable row %s (-want +got):\n%s\ntable:\n%s", name, diff, buf.String())
		}
	}
	if len(table) != len(r.rows())+5 {
		t.Errorf("WriteTable wrote %d rows; want %d:\n%s", len(table), len(r.rows())+5, buf.String())
	}
}

// memLog is a Log of evs, as ReadLog would keep them had it read them
// committed in this order.
func memLog(evs ...ledger.Event) *Log {
	l := &Log{calls: make(map[ledger.CallKey]*callLog)}
	for i := range evs {
		l.add(&evs[i])
	}
	l.sortEvents()
	return l
}

// counts are the figures TestCheckRules compares.
type counts struct {
	Terminal, Lost, Refused, Pending                       int
	DuplicateEvents, ConflictingEvents, IllegalTransitions int
	DuplicateEffects, MissingEffects, OrphanEffects        int
	OutcomeUnknown, Unresolved, Parked                     int
	UnnamedCredentials, CredentialEffects                  int
	TimeToResolveP99                                       time.Duration
}

func countsOf(r Report) counts {
	return counts{
		Terminal: r.Terminal, Lost: r.Lost, Refused: r.Refused, Pending: r.Pending,
		DuplicateEvents: r.DuplicateEvents, ConflictingEvents: r.ConflictingEvents, IllegalTransitions: r.IllegalTransitions,
		DuplicateEffects: r.DuplicateEffects, MissingEffects: r.MissingEffects, OrphanEffects: r.OrphanEffects,
		OutcomeUnknown: r.OutcomeUnknown, Unresolved: r.Unresolved, Parked: r.Parked,
		UnnamedCredentials: r.UnnamedCredentials, CredentialEffects: r.CredentialEffects, TimeToResolveP99: r.TimeToResolveP99,
	}
}

// TestCheckRules checks Check's rules one at a time on a call c1, without
// Kafka: the log is built as ReadLog builds it.
func TestCheckRules(t *testing.T) {
	t.Parallel()
	c1 := key("c1")
	s := time.Second
	at := func(e ledger.Event, d time.Duration) ledger.Event { e.At = base.Add(d); return e }
	with := func(e ledger.Event, f func(*ledger.Event)) ledger.Event { f(&e); return e }
	eff := func(tool string, mod func(*demobackend.Effect)) demobackend.Effect {
		ef := demobackend.Effect{Tool: tool, TenantID: "t1", IdempotencyKey: "t1/c1"}
		if mod != nil {
			mod(&ef)
		}
		return ef
	}
	approved := history(c1, s, req, pendingA, statemachine.EventApproved, exec, ok)
	tests := []struct {
		name    string
		evs     []ledger.Event
		effects []demobackend.Effect
		want    counts
	}{{
		name:    "approval flow",
		evs:     approved,
		effects: []demobackend.Effect{eff("refund_order", nil)},
		want:    counts{Terminal: 1},
	}, {
		name: "approval after its expiry",
		evs:  append(approved[:2:2], at(approved[2], 2*time.Hour)),
		want: counts{Pending: 1, IllegalTransitions: 1},
	}, {
		name: "executing without an attempt",
		evs:  append(history(c1, s, req, auth), with(ev(c1, 3, exec, 3*s), func(e *ledger.Event) { e.Attempt = 0 })),
		want: counts{Lost: 1, IllegalTransitions: 1},
	}, {
		name: "arguments hash changed",
		evs:  append(history(c1, s, req, auth), with(ev(c1, 3, exec, 3*s), func(e *ledger.Event) { e.ArgumentsHash = "other" })),
		want: counts{Lost: 1, IllegalTransitions: 1},
	}, {
		name: "no requested event",
		evs:  []ledger.Event{ev(c1, 1, auth, s)},
		want: counts{Lost: 1, IllegalTransitions: 1},
	}, {
		name: "seq order, not log order",
		evs: func() []ledger.Event {
			h := history(c1, s, req, auth, exec, ok, comp)
			return []ledger.Event{h[0], h[1], h[4], h[2], h[3]}
		}(),
		effects: []demobackend.Effect{eff("refund_order", nil)},
		want:    counts{Terminal: 1},
	}, {
		name: "re-appended and conflicting at one seq",
		evs: func() []ledger.Event {
			h := history(c1, s, succeeded...)
			return append(h, ev(c1, 4, fail, 4*s), h[3], h[2])
		}(),
		effects: []demobackend.Effect{eff("create_ticket", nil)},
		want:    counts{Terminal: 1, DuplicateEvents: 2, ConflictingEvents: 1},
	}, {
		name:    "parked, then resolved",
		evs:     append(history(c1, s, req, auth, exec, unknown, parked), ev(c1, 6, fail, 30*s)),
		effects: []demobackend.Effect{eff("send_email", nil)},
		want:    counts{Terminal: 1, OutcomeUnknown: 1, OrphanEffects: 1, TimeToResolveP99: 26 * s},
	}, {
		name:    "unresolved with an effect",
		evs:     history(c1, s, req, auth, exec, unknown),
		effects: []demobackend.Effect{eff("send_email", nil)},
		want:    counts{OutcomeUnknown: 1, Unresolved: 1, OrphanEffects: 1},
	}, {
		name:    "compensated from an unknown outcome, with its effect",
		evs:     history(c1, s, req, auth, exec, unknown, comp),
		effects: []demobackend.Effect{eff("send_email", nil)},
		want:    counts{Terminal: 1, OutcomeUnknown: 1, TimeToResolveP99: s},
	}, {
		name: "compensated after success, never applied",
		evs:  history(c1, s, req, auth, exec, ok, comp),
		want: counts{Terminal: 1, MissingEffects: 1},
	}, {
		name:    "succeeded on a replay only",
		evs:     history(c1, s, succeeded...),
		effects: []demobackend.Effect{eff("create_ticket", func(e *demobackend.Effect) { e.Replay = true })},
		want:    counts{Terminal: 1, MissingEffects: 1},
	}, {
		name:    "a read is the read tool's effect",
		evs:     history(c1, s, succeeded...),
		effects: []demobackend.Effect{eff("get_weather", func(e *demobackend.Effect) { e.Read = true })},
		want:    counts{Terminal: 1},
	}, {
		name: "bare key, key without tenant: one call",
		evs:  history(c1, s, succeeded...),
		effects: []demobackend.Effect{
			eff("send_email", func(e *demobackend.Effect) { e.IdempotencyKey = "c1" }),
			eff("send_email", func(e *demobackend.Effect) { e.TenantID = "" }),
		},
		want: counts{Terminal: 1, DuplicateEffects: 1},
	}, {
		name: "one key in two tenants: two calls",
		evs:  history(c1, s, succeeded...),
		effects: []demobackend.Effect{
			eff("send_email", nil),
			eff("send_email", func(e *demobackend.Effect) { e.TenantID, e.IdempotencyKey = "t2", "t2/c1" }),
		},
		want: counts{Terminal: 1, OrphanEffects: 1},
	}, {
		// The second request carried a jti no event names (its
		// executor died before recording, and the one that took the
		// call over did not name it): counted once, reads and replays
		// alike; an effect without a jti is not.
		name: "an effect's credential no event names",
		evs: append(history(c1, s, req, auth), with(ev(c1, 3, exec, 3*s), func(e *ledger.Event) { e.JTI = "jti-1" }),
			with(ev(c1, 4, ok, 4*s), func(e *ledger.Event) { e.JTI = "jti-1" })),
		effects: []demobackend.Effect{
			eff("create_ticket", func(e *demobackend.Effect) { e.JTI = "jti-1" }),
			eff("create_ticket", func(e *demobackend.Effect) { e.JTI, e.Replay = "jti-lost", true }),
			eff("create_ticket", func(e *demobackend.Effect) { e.Replay = true }),
		},
		want: counts{Terminal: 1, UnnamedCredentials: 1, CredentialEffects: 2},
	}, {
		name:    "an effect's credential named by another call only",
		evs:     append(history(c1, s, req, auth, exec, ok), with(ev(key("c2"), 1, req, s), func(e *ledger.Event) { e.JTI = "jti-1" })),
		effects: []demobackend.Effect{eff("create_ticket", func(e *demobackend.Effect) { e.JTI = "jti-1" })},
		want:    counts{Terminal: 1, UnnamedCredentials: 1, CredentialEffects: 1},
	}, {
		name:    "refused and later submitted properly",
		evs:     append([]ledger.Event{ev(c1, 0, denied, 0)}, history(c1, s, req, pendingA)...),
		effects: nil,
		want:    counts{Pending: 1},
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := Check(memLog(tc.evs...), []Submitted{{c1, base}}, tc.effects)
			if diff := cmp.Diff(tc.want, countsOf(r)); diff != "" {
				t.Errorf("Check (-want +got):\n%s\nexamples: %q", diff, r.Examples)
			}
		})
	}
}

// TestCheckClean: a run where everything held reports no failure, though
// it had aborted transactions, re-appended events, replays, reads and a
// parked call.
func TestCheckClean(t *testing.T) {
	t.Parallel()
	s := time.Second
	var evs []ledger.Event
	var subs []Submitted
	var effects []demobackend.Effect
	for i := range 50 {
		k := key(fmt.Sprintf("c%02d", i))
		subs = append(subs, Submitted{k, base})
		h := history(k, time.Duration(i+1)*time.Millisecond, succeeded...)
		evs = append(evs, h...)
		evs = append(evs, h[3]) // re-appended
		ef := demobackend.Effect{Tool: "refund_order", TenantID: k.TenantID, IdempotencyKey: k.String()}
		effects = append(effects, ef)
		ef.Replay = true
		effects = append(effects, ef)
	}
	p := key("parked")
	subs = append(subs, Submitted{p, base})
	evs = append(evs, history(p, s, req, auth, exec, unknown, parked)...)
	// The parked call's effect did happen: the ledger said it may have,
	// so it is no orphan.
	effects = append(effects, demobackend.Effect{Tool: "create_ticket", TenantID: p.TenantID, IdempotencyKey: p.String()})
	r := Check(memLog(evs...), subs, effects)
	if f := r.Failures(); len(f) != 0 {
		t.Errorf("Failures() = %q; want none", f)
	}
	if r.ParkedWithEffect != 1 || r.OrphanEffects != 0 {
		t.Errorf("parked with effect %d, orphans %d; want 1, 0", r.ParkedWithEffect, r.OrphanEffects)
	}
	if r.Terminal != 50 || r.Parked != 1 || r.DuplicateEvents != 50 || r.Effects != 51 {
		t.Errorf("Check = terminal %d, parked %d, duplicate events %d, effects %d; want 50, 1, 50, 51", r.Terminal, r.Parked, r.DuplicateEvents, r.Effects)
	}
	// Terminal after 4 ms ... 200 ms: nearest rank 25 and 50 of 50.
	if r.TimeToTerminalP50 != 100*time.Millisecond || r.TimeToTerminalP99 != 200*time.Millisecond {
		t.Errorf("time to terminal p50 %v, p99 %v; want 100ms, 200ms", r.TimeToTerminalP50, r.TimeToTerminalP99)
	}
	if len(r.Examples) != 2 {
		t.Errorf("Examples = %q; want parked and parked_with_effect only", r.Examples)
	}
}

// TestSamples: examples are the smallest MaxExamples, whatever the order
// they come in.
func TestSamples(t *testing.T) {
	t.Parallel()
	var s samples
	for i := 30; i > 0; i-- {
		s.add(fmt.Sprintf("k%02d", i))
		s.add(fmt.Sprintf("k%02d", i))
	}
	want := []string{"k01", "k02", "k03", "k04", "k05", "k06", "k07", "k08", "k09", "k10"}
	if diff := cmp.Diff(want, s.xs); diff != "" {
		t.Errorf("samples (-want +got):\n%s", diff)
	}
}
