package approvals

import (
	"context"
	"fmt"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// DefaultTimerEvery is how often RunTimer looks for lapsed approvals when
// not told.
const DefaultTimerEvery = time.Second

// ExpireDue expires the pending approvals whose expires_at has come: each
// moves pending -> expired with an expired event (reason approval_expired).
// It looks at up to Config.ExpireBatch pending records, oldest first from
// where the last call stopped, and returns how many it expired: expiry
// does not follow admission order (a call's deadline can shorten it), so
// the calls page through the pending records, one page a call, in passes
// that go back to the oldest once they reach the newest or those that
// arrived since the pass began (processors.SweepPass), rather than read
// the same oldest page every time. Several instances may run it at once:
// the move's compare-and-set expires each approval exactly once, and only
// the instance whose move applied publishes the event.
//
// The pending approvals a pass sees, and left pending, are what Pending
// reports once the pass ends.
func (s *Service) ExpireDue(ctx context.Context) (int, error) {
	s.mu.Lock()
	starting := s.expirePass.Starting()
	recs, err := s.expirePass.Page(ctx, s.cfg.Store, processors.StatusPending, s.cfg.ExpireBatch, s.cfg.Now())
	ended := s.expirePass.Starting()
	s.mu.Unlock()
	if err != nil {
		return 0, fmt.Errorf("approvals: read pending: %w", err)
	}
	now := s.cfg.Now().UTC()
	var (
		fs      []*found
		evs     []ledger.Event
		to      []processors.Status
		waiting pendingCount
	)
	for _, rec := range recs {
		f, err := s.read(rec)
		if err != nil {
			s.cfg.Logger.Error("unreadable pending approval", "call_key", rec.Key.String(), "err", err)
			waiting.add(rec.CreatedAt)
			continue
		}
		exp := f.approval.ExpiresAt
		if exp.IsZero() {
			// Nothing says when it lapses; a human must look.
			s.cfg.Logger.Error("pending approval without expiry", "call_key", rec.Key.String())
			waiting.add(f.approval.RequestedAt)
			continue
		}
		if now.Before(exp) {
			waiting.add(f.approval.RequestedAt)
			continue
		}
		ev := s.event(f, now)
		ev.Type = statemachine.EventExpired
		ev.ApprovalID = f.approval.ID
		ev.Reason = ReasonApprovalExpired
		ev.ExpiresAt = &exp
		fs, evs, to = append(fs, f), append(evs, ev), append(to, processors.StatusExpired)
	}
	s.count(starting, ended, waiting)
	if len(fs) == 0 {
		return 0, nil
	}
	moved, err := s.move(ctx, fs, evs, to)
	if err != nil {
		return 0, err
	}
	for _, rec := range moved {
		s.cfg.Logger.Info("approval expired", "approval_id", ID(rec.Key), "call_key", rec.Key.String())
	}
	return len(moved), nil
}

// count adds a page's pending approvals to the pass's, and publishes
// the pass's count once it ended (Pending).
func (s *Service) count(starting, ended bool, page pendingCount) {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	if starting {
		s.counting = pendingCount{}
	}
	s.counting.merge(page)
	if ended {
		s.seen = s.counting
	}
}

// Pending reports the pending approvals as the timer's last whole pass
// over them saw them: how many, and when the call of the oldest was
// requested (zero when none, or before a pass has ended). Approvals it
// expired are not counted.
func (s *Service) Pending() (n int, oldest time.Time) {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	return s.seen.n, s.seen.oldest
}

// TimerErr is the error of RunTimer's last round, nil when it succeeded
// or before the first: the approvals that lapse meanwhile stay pending
// (their approval is refused all the same).
func (s *Service) TimerErr() error {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	return s.timerErr
}

// RunTimer runs ExpireDue every interval (DefaultTimerEvery when not
// positive), each round bounded by Config.RoundTimeout, until ctx ends,
// then returns nil. An error of one round is logged, kept for TimerErr,
// and the next round tries again.
func (s *Service) RunTimer(ctx context.Context, every time.Duration) error {
	if every <= 0 {
		every = DefaultTimerEvery
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RoundTimeout)
		_, err := s.ExpireDue(rctx)
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			s.cfg.Logger.Warn("expire approvals", "err", err)
		}
		s.statsMu.Lock()
		s.timerErr = err
		s.statsMu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
