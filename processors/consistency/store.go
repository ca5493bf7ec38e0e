package consistency

import (
	"context"
	"errors"
	"fmt"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// StoreReader reads execution records; processors.Store has it.
type StoreReader interface {
	Get(ctx context.Context, key ledger.CallKey) (processors.Record, error)
}

// CheckStore compares the execution record of every submitted call that the
// committed log holds with the state the log folds the call to, and counts
// in r.StoreChecked and r.StoreDisagreements (which must be 0): the store
// and the log are two records of one history, and a reader of either must
// learn the same outcome. Run it after the processors stopped. A key the
// log never admitted (refused, lost) needs no record; a call whose events
// do not fold is counted once, as an illegal transition, not here.
func CheckStore(ctx context.Context, r *Report, log *Log, submitted []Submitted, st StoreReader) error {
	var ex samples
	for _, s := range submitted {
		c, ok := log.calls[s.Key]
		if !ok || len(c.events) == 0 {
			continue
		}
		f := log.fold(c)
		if f.illegal != "" {
			continue
		}
		want := processors.Status(f.state)
		switch {
		case f.parked:
			want = processors.StatusParked
		case f.state == statemachine.StateApprovalPending:
			want = processors.StatusPending
		}
		r.StoreChecked++
		rec, err := st.Get(ctx, s.Key)
		switch {
		case errors.Is(err, processors.ErrNotFound):
			r.StoreDisagreements++
			ex.add(fmt.Sprintf("%s no record, log %s", s.Key, want))
		case err != nil:
			return fmt.Errorf("consistency: read the record of %s: %w", s.Key, err)
		case rec.Status != want:
			r.StoreDisagreements++
			ex.add(fmt.Sprintf("%s store %s, log %s", s.Key, rec.Status, want))
		}
	}
	if len(ex.xs) > 0 {
		if r.Examples == nil {
			r.Examples = map[string][]string{}
		}
		r.Examples["store_disagreements"] = ex.xs
	}
	return nil
}
