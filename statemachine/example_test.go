package statemachine_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// A call that is authorized at intake, executed once, and succeeds. Apply
// names the effects each step asks a processor for.
func ExampleApply() {
	at := time.Date(2026, 1, 1, 9, 0, 0, 0, time.UTC)
	evs := []statemachine.Event{
		{Type: statemachine.EventRequested, Seq: 1, At: at, ArgumentsHash: "sha256:9b1d"},
		{Type: statemachine.EventAuthorized, Seq: 2, At: at.Add(10 * time.Millisecond)},
		{Type: statemachine.EventExecuting, Seq: 3, At: at.Add(20 * time.Millisecond), Attempt: 1},
		{Type: statemachine.EventSucceeded, Seq: 4, At: at.Add(90 * time.Millisecond)},
	}
	var c statemachine.Call
	for _, ev := range evs {
		next, effects, err := statemachine.Apply(c, ev)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("%q -> %q effects %v\n", c.State, next.State, effects)
		c = next
	}

	// Delivery is at least once: the same event again is a duplicate.
	_, _, err := statemachine.Apply(c, evs[3])
	fmt.Println("redelivered:", errors.Is(err, statemachine.ErrDuplicateEvent))

	// Output:
	// "" -> "requested" effects []
	// "requested" -> "authorized" effects [execute]
	// "authorized" -> "executing" effects []
	// "executing" -> "succeeded" effects [notify]
	// redelivered: true
}

// Folding the log gives the call's state; redelivered events are dropped.
func ExampleFold() {
	at := time.Date(2026, 1, 1, 9, 0, 0, 0, time.UTC)
	requested := statemachine.Event{Type: statemachine.EventRequested, Seq: 1, At: at, ArgumentsHash: "sha256:9b1d"}
	c, err := statemachine.Fold([]statemachine.Event{
		requested,
		{Type: statemachine.EventAuthorized, Seq: 2, At: at.Add(10 * time.Millisecond)},
		requested, // redelivered
		{Type: statemachine.EventExecuting, Seq: 3, At: at.Add(20 * time.Millisecond), Attempt: 1},
		{Type: statemachine.EventSucceeded, Seq: 4, At: at.Add(90 * time.Millisecond)},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(c.State, c.Seq, c.Attempt, c.State.Terminal(), c.UpdatedAt.Sub(c.RequestedAt))

	// Output:
	// succeeded 4 1 true 90ms
}
