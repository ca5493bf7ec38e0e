package intake

import (
	"context"
	"sync"
	"time"

	"github.com/toolcall-ledger/ledger/processors"
)

// laterMarks holds the admissions of authorized calls, once their events
// are in the log, until Config.MarkDelay has passed. By then an executor
// has nearly always claimed them, and a claim made from the authorized
// event records the events logged (processors.Claim.Logged): marking
// them then finds nothing to write, where marking them at once would
// rewrite every admitted row. A call still waiting for a claim is marked
// then, so that the executors' sweep of unlogged records does not append
// its events a second time.
//
// Losing them (a crash, a failed mark) is safe, as for any mark: the
// events are appended again and readers drop the duplicates.
type laterMarks struct {
	mu sync.Mutex
	q  []laterMark // in commit order, so in order of due
}

// idleMarkTimeout bounds the marks an idle Step makes.
const idleMarkTimeout = 5 * time.Second

type laterMark struct {
	due time.Time
	ls  []processors.Logged
}

// add holds ls until due.
func (m *laterMarks) add(due time.Time, ls []processors.Logged) {
	if len(ls) == 0 {
		return
	}
	m.mu.Lock()
	m.q = append(m.q, laterMark{due: due, ls: ls})
	m.mu.Unlock()
}

// take removes and returns, appended to ls, every mark due by now.
func (m *laterMarks) take(now time.Time, ls []processors.Logged) []processors.Logged {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for n < len(m.q) && !m.q[n].due.After(now) {
		ls = append(ls, m.q[n].ls...)
		n++
	}
	if n > 0 {
		// Cleared so that the backing array does not keep them.
		clear(m.q[:n])
		m.q = m.q[n:]
	}
	return ls
}

// markLogged marks ls logged, with the later marks that are due.
func (p *Processor) markLogged(ctx context.Context, ls []processors.Logged) error {
	ls = p.later.take(p.cfg.Now(), ls)
	if len(ls) == 0 {
		return nil
	}
	return p.cfg.Store.MarkLogged(ctx, ls)
}
