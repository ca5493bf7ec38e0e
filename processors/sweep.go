package processors

import (
	"context"
	"time"
)

// StatusLister lists the records in a status after a Cursor
// (Store.ByStatusAfter).
type StatusLister interface {
	ByStatusAfter(ctx context.Context, status Status, after Cursor, limit int) ([]Record, error)
}

// SweepPass is where a pass of sweeps through a listing is (the records
// in one status, the expired leases): a sweep reading the oldest page
// every time would never reach the records behind a page of records that
// stay listed (calls parked for a human, approvals that lapse later than
// newer ones, expired claims this build cannot take). The zero SweepPass
// starts at the oldest.
type SweepPass struct {
	after Cursor    // the last record listed; zero: the pass starts
	start time.Time // when the pass started
}

// Starting reports whether the next Page starts a pass, from the oldest.
func (p *SweepPass) Starting() bool { return p.after.IsZero() }

// Page lists a sweep's page of the records in status: those after the
// pass's last, oldest update first, at most limit. now is the sweep's
// time. A full page moves the pass to its end, for the next sweep to go
// on from there. A page that is not full ends the pass, as does one that
// reaches records updated since the pass started: those arrive as fast as
// the sweeps read, maybe, and a pass that went on to them would never
// come back to the oldest. The next sweep then starts again from the
// oldest. (The start is the sweeper's clock, an update time the store's:
// a store clock ahead by X ends passes at records updated in the X before
// their start, which they reach once they are older than that; one behind
// takes a pass that much further. Every pass still ends.)
func (p *SweepPass) Page(ctx context.Context, st StatusLister, status Status, limit int, now time.Time) ([]Record, error) {
	list := func(ctx context.Context, after Cursor, limit int) ([]Record, error) {
		return st.ByStatusAfter(ctx, status, after, limit)
	}
	return p.PageOf(ctx, list, (*Record).Cursor, limit, now)
}

// PageOf is Page through any listing after a Cursor: list, whose order
// place gives (Record.Cursor for an update time's, Record.LeaseCursor
// for ExpiredAfter's), ending the pass as Page does.
func (p *SweepPass) PageOf(ctx context.Context, list func(ctx context.Context, after Cursor, limit int) ([]Record, error), place func(*Record) Cursor, limit int, now time.Time) ([]Record, error) {
	if p.after.IsZero() {
		p.start = now
	}
	recs, err := list(ctx, p.after, limit)
	if err != nil {
		return nil, err
	}
	p.after = Cursor{}
	if last := len(recs) - 1; last+1 == limit {
		if c := place(&recs[last]); c.At.Before(p.start) {
			p.after = c
		}
	}
	return recs, nil
}
