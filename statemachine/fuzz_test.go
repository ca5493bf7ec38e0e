package statemachine_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	sm "github.com/toolcall-ledger/ledger/statemachine"
)

// propertySeed fixes TestApplyRandomSequences' draws; sequence i uses
// PCG(propertySeed, i), so a failure names everything needed to replay it.
const propertySeed uint64 = 0x5eed_2026

// maxFuzzEvents bounds a fuzz sequence so that each input stays fast.
const maxFuzzEvents = 64

// generator returns the next event to offer a call in state c, or false
// when the sequence is over. Refused events leave c as it was, so
// generators may build events relative to it.
type generator func(c sm.Call) (sm.Event, bool)

// sequenceResult is what checkSequence saw.
type sequenceResult struct {
	offered  []sm.Event
	accepted []sm.Event
	visited  []sm.State
	final    sm.Call
}

// checkSequence offers gen's events in order to an empty call, keeps what
// Apply accepts, and returns the first broken invariant:
//   - a refusal wraps exactly the sentinel its seq calls for, leaves the
//     call unchanged and asks for no effects;
//   - after a Terminal state the only accepted event is compensated from
//     succeeded, and nothing is accepted after compensated;
//   - the accepted seqs are exactly 1..n;
//   - every accepted step is an edge of Transitions and of wantEdges, with
//     that edge's effects;
//   - the arguments hash never changes once requested;
//   - the final call equals Fold of the accepted events, also when each is
//     delivered twice.
func checkSequence(gen generator) (sequenceResult, error) {
	want := wantEdges()
	var r sequenceResult
	c := sm.Call{}
	r.visited = append(r.visited, c.State)
	for {
		ev, ok := gen(c)
		if !ok {
			break
		}
		r.offered = append(r.offered, ev)
		next, effects, err := sm.Apply(c, ev)
		if err != nil {
			var wantErr error
			switch {
			case ev.Seq <= c.Seq:
				wantErr = sm.ErrDuplicateEvent
			case ev.Seq > c.Seq+1:
				wantErr = sm.ErrSeqGap
			default:
				wantErr = sm.ErrInvalidTransition
			}
			if !errors.Is(err, wantErr) {
				return r, fmt.Errorf("event %d %+v on %+v: error %v; want %v", len(r.offered), ev, c, err, wantErr)
			}
			if diff := diffCalls(c, next); diff != "" {
				return r, fmt.Errorf("event %d %+v refused but changed the call (-before +after):\n%s", len(r.offered), ev, diff)
			}
			if effects != nil {
				return r, fmt.Errorf("event %d %+v refused but effects = %v", len(r.offered), ev, effects)
			}
			continue
		}

		if c.State.Terminal() && (c.State != sm.StateSucceeded || ev.Type != sm.EventCompensated) {
			return r, fmt.Errorf("event %d: %q accepted after terminal %q", len(r.offered), ev.Type, c.State)
		}
		if wantSeq := int64(len(r.accepted)) + 1; ev.Seq != wantSeq || next.Seq != wantSeq {
			return r, fmt.Errorf("event %d: accepted at seq %d (call seq %d); want %d", len(r.offered), ev.Seq, next.Seq, wantSeq)
		}
		if !inTransitions(c.State, ev.Type, next.State) {
			return r, fmt.Errorf("event %d: step %q --%s--> %q is not in Transitions", len(r.offered), c.State, ev.Type, next.State)
		}
		e, legal := want[c.State][ev.Type]
		if !legal || e.to != next.State {
			return r, fmt.Errorf("event %d: step %q --%s--> %q is not in DESIGN §4", len(r.offered), c.State, ev.Type, next.State)
		}
		if diff := cmp.Diff(e.effects, effects, cmpopts.EquateEmpty()); diff != "" {
			return r, fmt.Errorf("event %d: %q --%s--> effects mismatch (-want +got):\n%s", len(r.offered), c.State, ev.Type, diff)
		}
		if c.State != sm.StateNone && next.ArgumentsHash != c.ArgumentsHash {
			return r, fmt.Errorf("event %d: arguments hash changed from %q to %q", len(r.offered), c.ArgumentsHash, next.ArgumentsHash)
		}
		r.accepted = append(r.accepted, ev)
		r.visited = append(r.visited, next.State)
		c = next
	}
	r.final = c

	folded, err := sm.Fold(r.accepted)
	if err != nil {
		return r, fmt.Errorf("Fold(accepted) error: %v", err)
	}
	if diff := diffCalls(c, folded); diff != "" {
		return r, fmt.Errorf("Fold(accepted) mismatch (-applied +folded):\n%s", diff)
	}
	var twice []sm.Event
	for _, ev := range r.accepted {
		twice = append(twice, ev, ev)
	}
	folded, err = sm.Fold(twice)
	if err != nil {
		return r, fmt.Errorf("Fold(accepted, each twice) error: %v", err)
	}
	if diff := diffCalls(c, folded); diff != "" {
		return r, fmt.Errorf("Fold(accepted, each twice) mismatch (-applied +folded):\n%s", diff)
	}
	return r, nil
}

// diffCalls is cmp.Diff(a, b) with == first: diffing every step makes the
// property test slow under -race.
func diffCalls(a, b sm.Call) string {
	if a == b {
		return ""
	}
	return cmp.Diff(a, b)
}

// inTransitions reports whether sm.Transitions has an edge from on to.
func inTransitions(from sm.State, on sm.EventType, to sm.State) bool {
	for _, t := range sm.Transitions {
		if t.On == on && t.To == to && slices.Contains(t.From, from) {
			return true
		}
	}
	return false
}

// randomGenerator draws up to n events. Two in three are of a type with an
// edge from the call's state (from wantEdges, not from the code under
// test), so that sequences get past requested; most carry the next seq;
// each guard field is broken now and then.
func randomGenerator(r *rand.Rand, n int) generator {
	want := wantEdges()
	return func(c sm.Call) (sm.Event, bool) {
		if n == 0 {
			return sm.Event{}, false
		}
		n--
		typ := sm.EventTypes[r.IntN(len(sm.EventTypes))]
		if legal := sortedTypes(want, c.State); len(legal) > 0 && r.IntN(3) > 0 {
			typ = legal[r.IntN(len(legal))]
		}
		ev := validEvent(c, typ)
		switch r.IntN(10) {
		case 0:
			ev.Seq = c.Seq // duplicate
		case 1:
			ev.Seq = c.Seq + 2 + r.Int64N(3) // gap
		case 2:
			ev.Seq = r.Int64N(c.Seq + 1) // old, or a seq-0 refusal
		}
		switch r.IntN(8) {
		case 0:
			ev.ArgumentsHash = ""
		case 1:
			ev.ArgumentsHash = otherHash
		}
		if r.IntN(6) == 0 {
			ev.Reason = ""
		}
		if r.IntN(6) == 0 {
			ev.Attempt = r.IntN(3) - 1
		}
		if r.IntN(6) == 0 {
			ev.ApprovalID = ""
		}
		if r.IntN(6) == 0 {
			ev.ExpiresAt = time.Time{}
		}
		switch r.IntN(8) {
		case 0:
			ev.At = c.PendingExpiresAt.Add(-time.Nanosecond)
		case 1:
			ev.At = c.PendingExpiresAt
		case 2:
			ev.At = c.PendingExpiresAt.Add(time.Hour)
		case 3:
			ev.At = time.Time{}
		}
		return ev, true
	}
}

func TestApplyRandomSequences(t *testing.T) {
	t.Parallel()
	const sequences = 5000
	t.Logf("seed %#x, %d sequences", propertySeed, sequences)
	reached := map[sm.State]int{}
	compensatedAfterSucceeded := 0
	for i := range sequences {
		r := rand.New(rand.NewPCG(propertySeed, uint64(i)))
		res, err := checkSequence(randomGenerator(r, 1+r.IntN(24)))
		if err != nil {
			t.Fatalf("seed %#x sequence %d: %v\noffered: %+v", propertySeed, i, err, res.offered)
		}
		for j, s := range res.visited {
			reached[s]++
			if s == sm.StateCompensated && res.visited[j-1] == sm.StateSucceeded {
				compensatedAfterSucceeded++
			}
		}
	}
	// A generator that never got anywhere would pass every invariant
	// above; make sure it exercised every state.
	for _, s := range sm.States {
		if reached[s] == 0 {
			t.Errorf("no random sequence reached %q; reached %v", s, reached)
		}
	}
	if compensatedAfterSucceeded == 0 {
		t.Errorf("no random sequence compensated a succeeded call")
	}
}

// fuzzGenerator decodes data three bytes per event, at most maxFuzzEvents:
//   - byte 0: index into sm.EventTypes (mod its length);
//   - byte 1: seq offset from the next seq, as int8 (0 = the next seq,
//     0xff = the current one, i.e. a duplicate);
//   - byte 2: flags that break guard fields; 0 satisfies every guard.
//     bit 0 empty hash, bit 1 other hash, bit 2 no reason, bit 3 no
//     attempt, bit 4 no approval id, bit 5 no expiry, bit 6 at one
//     nanosecond before the pending expiry, bit 7 at the pending expiry.
func fuzzGenerator(data []byte) generator {
	n := 0
	return func(c sm.Call) (sm.Event, bool) {
		if len(data) < 3 || n == maxFuzzEvents {
			return sm.Event{}, false
		}
		b := data[:3]
		data = data[3:]
		n++
		ev := validEvent(c, sm.EventTypes[int(b[0])%len(sm.EventTypes)])
		ev.Seq = c.Seq + 1 + int64(int8(b[1]))
		flags := b[2]
		if flags&(1<<0) != 0 {
			ev.ArgumentsHash = ""
		}
		if flags&(1<<1) != 0 {
			ev.ArgumentsHash = otherHash
		}
		if flags&(1<<2) != 0 {
			ev.Reason = ""
		}
		if flags&(1<<3) != 0 {
			ev.Attempt = 0
		}
		if flags&(1<<4) != 0 {
			ev.ApprovalID = ""
		}
		if flags&(1<<5) != 0 {
			ev.ExpiresAt = time.Time{}
		}
		if flags&(1<<6) != 0 {
			ev.At = c.PendingExpiresAt.Add(-time.Nanosecond)
		}
		if flags&(1<<7) != 0 {
			ev.At = c.PendingExpiresAt
		}
		return ev, true
	}
}

// encodePath is the fuzz input that offers p's events, all valid; with
// redeliver, each event is followed by a duplicate of itself.
func encodePath(p path, redeliver bool) []byte {
	var b []byte
	for _, typ := range p.events {
		b = append(b, byte(slices.Index(sm.EventTypes, typ)), 0, 0)
		if redeliver {
			b = append(b, byte(slices.Index(sm.EventTypes, typ)), 0xff, 0)
		}
	}
	return b
}

func TestFuzzGeneratorReplaysPaths(t *testing.T) {
	t.Parallel()
	// The seeds only help the fuzzer if they decode to the paths they
	// came from.
	for _, p := range testPaths() {
		for _, redeliver := range []bool{false, true} {
			res, err := checkSequence(fuzzGenerator(encodePath(p, redeliver)))
			if err != nil {
				t.Fatalf("path %s (redeliver %v): %v", p.name, redeliver, err)
			}
			if res.final.State != p.want || len(res.accepted) != len(p.events) {
				t.Errorf("path %s (redeliver %v) decodes to %q after %d events; want %q after %d",
					p.name, redeliver, res.final.State, len(res.accepted), p.want, len(p.events))
			}
		}
	}
}

func FuzzApplySequence(f *testing.F) {
	for _, p := range testPaths() {
		f.Add(encodePath(p, false))
		f.Add(encodePath(p, true))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		res, err := checkSequence(fuzzGenerator(data))
		if err != nil {
			t.Fatalf("%v\noffered: %+v", err, res.offered)
		}
	})
}
