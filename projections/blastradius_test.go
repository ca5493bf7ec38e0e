package projections

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// A blast radius read while the projection takes writes can come back
// with its counts and its list apart; AskAgreeing asks again until they
// agree, a bounded number of times, and gives up at once on an error.
func TestAskAgreeing(t *testing.T) {
	f := Filter{Limit: 2}
	// An answer of listed calls, counted as total calls in state
	// succeeded (when the list is all of them, the counts must be the
	// list's).
	answer := func(total, listed int) BlastRadius {
		calls := make([]Call, listed)
		for i := range calls {
			calls[i] = Call{TenantID: "t", IdempotencyKey: fmt.Sprint(i), State: statemachine.StateSucceeded}
		}
		br := Summarize(f, slices.Clone(calls))
		// The counts as a read apart from the list's would give them.
		for _, c := range []*[]Count{&br.ByTenant, &br.ByState, &br.ByResource} {
			if len(*c) > 0 {
				(*c)[0].Calls = total
			}
		}
		br.Total, br.Calls, br.Truncated = total, calls, total > len(calls) && len(calls) == f.Limit
		return br
	}
	// The list has the call succeeded, the counts outcome_unknown.
	recounted := answer(1, 1)
	recounted.ByState = []Count{{Value: string(statemachine.StateOutcomeUnknown), Calls: 1}}
	failed := errors.New("server gone")
	for _, c := range []struct {
		name    string
		answers []BlastRadius
		err     error
		reads   int
		agrees  bool
	}{
		{"agrees at once", []BlastRadius{answer(1, 1)}, nil, 1, true},
		{"cut at the limit agrees", []BlastRadius{answer(5, 2)}, nil, 1, true},
		{"list behind the counts", []BlastRadius{answer(2, 0), answer(2, 1), answer(2, 2)}, nil, 3, true},
		{"list ahead of the counts", []BlastRadius{answer(1, 2), answer(2, 2)}, nil, 2, true},
		{"a call counted in one state and listed in another", []BlastRadius{recounted, answer(1, 1)}, nil, 2, true},
		{"never agrees", []BlastRadius{answer(2, 0), answer(2, 1), answer(3, 1), answer(3, 2)}, nil, BlastTries, false},
		{"error", []BlastRadius{{}}, failed, 1, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			reads := 0
			br, err := AskAgreeing(t.Context(), func(context.Context) (BlastRadius, error) {
				if reads == len(c.answers) {
					return BlastRadius{}, fmt.Errorf("read %d times; %d answers", reads+1, len(c.answers))
				}
				reads++
				return c.answers[reads-1], c.err
			})
			if !errors.Is(err, c.err) || reads != c.reads || br.Agrees() != c.agrees {
				t.Errorf("AskAgreeing: err %v, %d reads, agrees %t; want err %v, %d reads, agrees %t", err, reads, br.Agrees(), c.err, c.reads, c.agrees)
			}
			if c.err == nil && !equalAnswer(br, c.answers[reads-1]) {
				t.Errorf("answered %d of %d listed; want the last read's", len(br.Calls), br.Total)
			}
		})
	}
}

func equalAnswer(a, b BlastRadius) bool {
	return a.Total == b.Total && len(a.Calls) == len(b.Calls)
}
