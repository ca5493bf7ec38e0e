package executor

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/sony/gobreaker/v2"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/compensation"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// defaultSweepLimit bounds the calls one sweep lists in a status.
const defaultSweepLimit = 100

// Reasons the reconciler gives.
const (
	// ReasonReconciled: the tool's status lookup said what happened.
	ReasonReconciled = "reconciled"
	// ReasonNoStatusLookup: the tool declares no way to ask what
	// happened; a human must find out (parked).
	ReasonNoStatusLookup = "no_status_lookup"
	// ReasonLookupFailed: the status lookup kept failing (parked).
	ReasonLookupFailed = "status_lookup_failed"
	// ReasonLookupPending: the status lookups went unanswered for the
	// bound, and the tool said meanwhile that the call is in progress
	// (parked, and never undone: it may land yet).
	ReasonLookupPending = compensation.ReasonLookupPending
	// ReasonResolvedByOperator: an operator settled the call by hand.
	ReasonResolvedByOperator = "resolved_by_operator"
)

// Errors the reconciler's callers branch on.
var (
	// ErrNotUnknown: the call is not (or no longer) outcome_unknown.
	ErrNotUnknown = errors.New("executor: the call's outcome is not unknown")
	// ErrCallChanged: the call moved on while it was being resolved
	// (the reconciler parked it, or asked for its compensation), and
	// its outcome is still not known: look at it again.
	ErrCallChanged = errors.New("executor: the call changed while it was being resolved")
	// ErrForbidden: the identity may not resolve the call.
	ErrForbidden = errors.New("executor: not an operator of the call's tenant")
	// ErrUndoUnderWay: the call's compensation is under way or has undone
	// it; its outcome settles the call, not a resolution as failed.
	ErrUndoUnderWay = errors.New("executor: the call's compensation is under way or has undone it")
	// ErrInvalidResolution: the resolution itself is malformed (its as,
	// its evidence).
	ErrInvalidResolution = errors.New("executor: invalid resolution")
	// ErrNoContext: the call's record holds no events this build can
	// read (an outbox a newer build wrote): nothing to settle it from.
	ErrNoContext = errors.New("executor: the call's record cannot be read")
	// ErrAutomaticUndoPending: the compensation the reconciler asked for
	// (undo_unknown), which operators' requests to undo the call join, is
	// still to run, and a call resolved succeeded is one it leaves as it
	// is: resolving so needs Resolution.CancelCompensation, and waits for
	// one an executor is running.
	ErrAutomaticUndoPending = errors.New("executor: the reconciler's compensation of the call is pending, and does not undo a call resolved succeeded")
)

// Resolution is what an operator found out about a call whose outcome was
// unknown.
type Resolution struct {
	// As is succeeded or failed.
	As processors.Status
	// Evidence says how the operator found out (required).
	Evidence string
	// CancelCompensation confirms a resolution as succeeded while the
	// compensation the reconciler asked for is still to run: it then
	// ends nothing_to_undo, an operator's request that joined it with
	// it. One an executor is running is waited for all the same.
	CancelCompensation bool
}

// ReconcilerStore is the part of the execution store the reconciler uses.
type ReconcilerStore interface {
	Get(ctx context.Context, key ledger.CallKey) (processors.Record, error)
	ByStatusAfter(ctx context.Context, status processors.Status, after processors.Cursor, limit int) ([]processors.Record, error)
	Move(ctx context.Context, ms []processors.Move) ([]bool, error)
	ReadBack(ctx context.Context, key ledger.CallKey) (processors.Record, error)
	// Complete denies a compensation an executor gave back, fenced by
	// its claim's epoch (a confirmed resolution's cancelUndo).
	Complete(ctx context.Context, cs []processors.Completion) ([]bool, error)
	MarkLogged(ctx context.Context, ls []processors.Logged) error
	// NoteUnanswered keeps what the reconcilers learnt of a call whose
	// lookups do not answer.
	NoteUnanswered(ctx context.Context, key ledger.CallKey, n processors.Unanswered) (processors.Unanswered, bool, error)
}

// Looker asks a tool what became of a call, by its idempotency key.
type Looker interface {
	Lookup(ctx context.Context, lookupURL string, r httptool.Request) (httptool.Response, error)
}

// Compensator runs a call's declared compensation as a governed call of
// its own (processors/compensation.Service does).
type Compensator interface {
	Compensate(ctx context.Context, operator identity.Identity, key ledger.CallKey, reason string) (ledger.CallKey, []ledger.Event, error)
}

// ReasonCompensating: the outcome could not be established, a policy
// says to undo such calls, and the compensation was requested (parked
// until it succeeds, then compensated).
const ReasonCompensating = compensation.ReasonRequested

// ReasonUndoAbandoned: a call parked compensation_requested whose
// compensation could not be requested (refused for good, or failing past
// ReconcilerConfig.UndoAttempts) is parked again with this reason, for a
// human; the event's detail says why.
const ReasonUndoAbandoned = "compensation_abandoned"

// DefaultUndoAttempts is ReconcilerConfig.UndoAttempts' default.
const DefaultUndoAttempts = 10

// undoTimeout bounds one request for a compensation (the intake's store
// write and the publish): the step waits for it, and a hang would stall
// the reconciler; one cut short is asked again like any failure.
const undoTimeout = 30 * time.Second

// notFoundSkew is how far the reconciler's clock may run ahead of the
// store's before a status lookup's "not found" is taken as final too
// early: ten times the 500 ms CockroachDB lets its own nodes' clocks
// drift apart, for hosts that NTP keeps within milliseconds.
const notFoundSkew = 5 * time.Second

// ReconcilerMetrics receives a reconciler's measurements (metrics.Registry
// is one). Its methods are called from the reconciler's step, one at a
// time.
type ReconcilerMetrics interface {
	// CompensationRequest: one request for an automatic compensation
	// ended in result: "requested", "failed" (asked again later),
	// "refused" (for good) or "abandoned" (failed its last attempt);
	// the last two hand the call to a human.
	CompensationRequest(result string)
	// UndecodableEvents: n events of the log that may settle a call or
	// end its compensation were passed over, damaged.
	UndecodableEvents(n int)
}

type nopReconcilerMetrics struct{}

func (nopReconcilerMetrics) CompensationRequest(string) {}
func (nopReconcilerMetrics) UndecodableEvents(int)      {}

// ReconcilerConfig configures a reconciler.
type ReconcilerConfig struct {
	Registry *schemas.Registry // required
	Store    ReconcilerStore   // required
	Looker   Looker            // required
	// Credentials mints the lookup's credential (the tool checks it as it
	// checks the call's). Nil sends none.
	Credentials Minter
	// CredentialSkew is how long past its expiry a tool accepts a call's
	// credential (its verifier's Skew). A call's credential expires by
	// its claim's lease, before another executor takes the call over; but
	// an executor paused past that lease with its request about to leave
	// can still have it accepted until then. So a status lookup's
	// not_found is not final, nor a park's compensation asked for, until
	// it has passed since the outcome was recorded (as the tool's
	// timeout must). Zero: credentials.DefaultSkew when Credentials is
	// set (the deployment mints credentials), none otherwise; negative:
	// none of the deployment's own (a tool's declared skew still counts).
	CredentialSkew time.Duration
	// Secrets holds the backends' long-lived secrets (registry
	// backend.secret_ref), sent with the lookups of a tool that demands
	// one as with its calls. Nil: the lookups of such a tool fail, and
	// its calls are parked once unanswered for UnansweredFor.
	Secrets Secrets
	// BaseURL resolves relative status lookup URLs.
	BaseURL string
	Topics  ledger.Topics
	// Owner names this instance in events; default "reconciler".
	Owner string
	// MaxAttempts bounds the lookups of one call per pass; default 3,
	// with Backoff (default 200ms) doubling between them.
	MaxAttempts int
	Backoff     time.Duration
	// UnansweredFor bounds how long a call may wait, outcome_unknown, for a
	// status lookup that answers: until then a pass whose lookups failed
	// (MaxAttempts of them: the tool's status endpoint down or slow, a
	// host that stalled and timed them out) or that this reconciler's own
	// breaker kept from being sent leaves the call for a later sweep, since
	// it learned nothing about the call. The call is parked for a human
	// (status_lookup_failed) at a round of lookups that fails once they
	// have failed (or been held off) for UnansweredFor, counted from the
	// end of the first such round of any reconciler (noted on the call's
	// record, processors.Unanswered, so that a restart or a rebalance
	// does not start the wait again), and it is that long since the
	// call's last change: never within a sweep interval (SweepEvery, or
	// UnansweredFor if shorter) of the first round that fails in this
	// reconciler. Default DefaultUnansweredFor.
	UnansweredFor time.Duration
	// SweepEvery is how often unknown outcomes are looked for in the
	// store besides the events that announce them; default 10s.
	SweepEvery time.Duration
	// OperatorRole may resolve calls by hand; default "operator".
	OperatorRole string
	// Compensator, when set, undoes calls whose outcome cannot be
	// established and whose deciding policy carries the undo_unknown
	// obligation, for tools that declare a compensation.
	Compensator Compensator
	// UndoAttempts bounds the requests for one such compensation that
	// fail for a reason that may pass (a store or Kafka error, a
	// timeout, a rate limit); default DefaultUndoAttempts. One refused
	// because its tool is frozen is asked again at each sweep for as
	// long as the freeze lasts, and not counted.
	// The first is made once the call is parked, the others at sweeps
	// (SweepEvery): the next one, then after 1, 2, 4... sweep
	// intervals, the last about 43 minutes after the first with the
	// defaults. After the last, or at once on a refusal that asking
	// again will not change (a policy's, an error that says it is
	// terminal), the call is parked again, compensation_abandoned, for a
	// human. The count is this process's: a restarted reconciler asks
	// again, which is safe, since a call has one compensation key and
	// the intake admits it once.
	UndoAttempts int
	// Freezes, if set, is the kill switch: a status lookup of a frozen
	// tool (for every tenant, or for the call's) is not sent, nor one
	// while the copy of the control topic is not known to hold every
	// freeze made up to ControlMaxStaleness ago (waited for up to a
	// second). The call waits for a later sweep, as for a lookup its
	// breaker held off, but its lookups are not counted as failing: a
	// freeze is no reason to hand a call to a human, nor, under
	// undo_unknown, to undo it.
	Freezes Freezes
	// ControlMaxStaleness is Config.ControlMaxStaleness, for Freezes.
	// Zero: control.DefaultMaxStaleness; negative: not checked.
	ControlMaxStaleness time.Duration
	// Metrics, if set, counts the requests for automatic compensations.
	Metrics ReconcilerMetrics
	Breaker BreakerConfig
	Now     func() time.Time
	Logger  *slog.Logger
}

// DefaultUnansweredFor is ReconcilerConfig.UnansweredFor's default: many times a
// breaker's default OpenFor, so that a breaker that closes again lets the
// calls be asked, and short enough that a human hears of a lookup that
// stays out of reach.
const DefaultUnansweredFor = 5 * time.Minute

// Reconciler resolves unknown outcomes: it asks the tool's status lookup
// what happened and records succeeded or failed with the evidence, or
// parks the call for a human with the reason. Lookups go through
// breakers and bulkheads per tool and tenant, like the executor's calls.
type Reconciler struct {
	cfg     ReconcilerConfig
	x       *Executor // for its guards and URL resolution
	lastSwp time.Time

	// undos holds the automatic compensations that could not be
	// requested, by the parked call's key; only the step (one at a time)
	// touches it.
	undos map[ledger.CallKey]*undoState
	// undoEnded are the calls whose compensation this reconciler read
	// ending without undoing anything (denied, rejected, failed,
	// expired): the next sweep looks at them whatever page of the
	// parked calls it reads, which behind many calls parked for a human
	// may be many sweeps away. Only the step touches it.
	undoEnded map[ledger.CallKey]bool
	// parkedPass is where the sweeps of parked calls are: calls parked
	// for a human stay parked, oldest first, and a sweep reading the
	// oldest page every time would never reach the calls behind a page
	// of them. Only the step touches it.
	parkedPass processors.SweepPass
	// unknownPass is the same for the sweeps of unknown outcomes: calls
	// whose lookups are held off (the reconciler's breaker open) stay
	// outcome_unknown, oldest first, until they have failed for
	// UnansweredFor (due).
	unknownPass processors.SweepPass
	// sweepLimit bounds the calls one sweep lists in a status.
	sweepLimit int

	// unknown and parked are what the last sweep saw of the oldest
	// calls in outcome_unknown and parked.
	mu            sync.Mutex
	unknown       int
	oldestUnknown time.Time
	parked        int
	oldestParked  time.Time
	// failing is, for the calls whose lookups have not answered since,
	// when this reconciler first saw them fail (or be held off): what it
	// notes on the call's record (processors.Unanswered), and what due
	// asks a sweep interval of, so that the first round of lookups after
	// a downtime, or over a backlog older than the bound, or a second
	// round in the same burst, parks nothing. An entry goes when a lookup
	// answers (a not found too early to be final included) or the kill
	// switch holds one (restartWait), or when a
	// whole pass of the unknown outcomes' sweep has neither listed the
	// call nor seen its lookups fail (resolved elsewhere, parked): not
	// when the call is parked, for a park that does not land must not
	// start the wait again. Under mu.
	failing map[ledger.CallKey]failingSince
	// unknownPasses counts the passes of the unknown outcomes' sweep
	// that have ended, for failing's entries to say which pass last saw
	// them. Under mu.
	unknownPasses uint64
	// heldWarned is when warnHeld last warned. Under mu.
	heldWarned time.Time
}

// failingSince is what the reconciler remembers of a call whose status
// lookups fail.
type failingSince struct {
	since     time.Time // the end of the call's first round of lookups that failed
	sweepPass uint64    // the last sweep pass that listed the call or saw its lookups fail
	// inProgress: a lookup since was answered by the tool, saying the
	// call is in progress.
	inProgress bool
}

// undoState is what the reconciler remembers of an automatic compensation
// it could not request.
type undoState struct {
	failures int       // requests that failed for a reason that may pass
	holds    int       // requests refused, its tool frozen, since the last other answer
	next     time.Time // asked again at the first sweep from then
	abandon  string    // set: not asked again, the call goes to a human, for this reason
}

// Unknown reports the calls in outcome_unknown at the last sweep (at most
// the sweep's limit) and since when the oldest of them has been so; the
// zero time when there were none.
func (r *Reconciler) Unknown() (n int, oldest time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.unknown, r.oldestUnknown
}

// Parked reports the calls parked at the last sweep (at most the sweep's
// limit), each waiting for a human or for the compensation a policy
// asked for, and since when the oldest of them has been parked; the zero
// time when there were none. A call whose lookups do not answer leaves
// outcome_unknown for parked after UnansweredFor: only this says it
// still waits.
func (r *Reconciler) Parked() (n int, oldest time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.parked, r.oldestParked
}

// NewReconciler validates cfg and returns a reconciler.
func NewReconciler(cfg ReconcilerConfig) (*Reconciler, error) {
	if cfg.Registry == nil || cfg.Store == nil || cfg.Looker == nil {
		return nil, errors.New("reconciler: registry, store and looker are required")
	}
	if cfg.Owner == "" {
		cfg.Owner = "reconciler"
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 3
	}
	if cfg.Backoff <= 0 {
		cfg.Backoff = 200 * time.Millisecond
	}
	if cfg.UnansweredFor <= 0 {
		cfg.UnansweredFor = DefaultUnansweredFor
	}
	if cfg.ControlMaxStaleness == 0 {
		cfg.ControlMaxStaleness = control.DefaultMaxStaleness
	}
	if cfg.SweepEvery <= 0 {
		cfg.SweepEvery = 10 * time.Second
	}
	if cfg.OperatorRole == "" {
		cfg.OperatorRole = "operator"
	}
	if cfg.UndoAttempts <= 0 {
		cfg.UndoAttempts = DefaultUndoAttempts
	}
	if cfg.Metrics == nil {
		cfg.Metrics = nopReconcilerMetrics{}
	}
	switch {
	case cfg.CredentialSkew == 0 && cfg.Credentials != nil:
		cfg.CredentialSkew = credentials.DefaultSkew
	case cfg.CredentialSkew < 0 && cfg.Credentials != nil:
		// None of its own, where credentials are minted: a tool's
		// declared skew and the attempt's slack still count, which
		// Landing adds for a skew above zero only.
		cfg.CredentialSkew = time.Nanosecond
	case cfg.CredentialSkew < 0:
		// None, not less than none: a negative skew would shorten the
		// landing window below the tool's timeout (Landing).
		cfg.CredentialSkew = 0
	}
	cfg.Topics = cfg.Topics.WithDefaults()
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	xc := Config{Registry: cfg.Registry, Breaker: cfg.Breaker, Logger: cfg.Logger}
	xc.setDefaults()
	x := newExecutor(xc)
	if cfg.BaseURL != "" {
		u, err := url.Parse(cfg.BaseURL)
		if err != nil {
			return nil, fmt.Errorf("reconciler: base url: %w", err)
		}
		x.base = u
	}
	return &Reconciler{cfg: cfg, x: x, undos: make(map[ledger.CallKey]*undoState), undoEnded: make(map[ledger.CallKey]bool), failing: make(map[ledger.CallKey]failingSince), sweepLimit: defaultSweepLimit}, nil
}

// Loop returns the reconciler on a consume-process-produce loop over the
// events topic; lc's Group defaults to "ledger-reconciler".
func (r *Reconciler) Loop(lc ledger.LoopConfig) (*ledger.Loop, error) {
	if lc.Group == "" {
		lc.Group = "ledger-reconciler"
	}
	if len(lc.Topics) == 0 {
		lc.Topics = []string{r.cfg.Topics.Events}
	}
	if lc.TransactionalID == "" {
		lc.TransactionalID = lc.Group + "-" + r.cfg.Owner
	}
	if lc.Logger == nil {
		lc.Logger = r.cfg.Logger
	}
	return ledger.NewLoop(lc, r.Step)
}

// Step handles a batch of events: it is a ledger.Step. It acts on
// outcome_unknown events, and now and then on the unknown outcomes in the
// store (those whose lookups failed before, or whose event it missed).
func (r *Reconciler) Step(ctx context.Context, recs []*kgo.Record) (ledger.Output, error) {
	var (
		keys        []ledger.CallKey
		compensated []ledger.Event // succeeded compensation calls
	)
	seen := make(map[ledger.CallKey]bool)
	undone := make(map[ledger.CallKey]bool) // compensations whose success is in the batch
	for _, rec := range recs {
		t := statemachine.EventType(ledger.Header(rec, ledger.HeaderEventType))
		if t != statemachine.EventOutcomeUnknown && t != statemachine.EventSucceeded && !undidNothing(t, rec) {
			continue
		}
		ev, err := ledger.DecodeEvent(rec.Value)
		if errors.Is(err, ledger.ErrUnsupportedEncoding) {
			// A newer build wrote it (an upgrade out of order). Passed
			// over, an operator's compensation's success would be lost
			// for good (a sweep finds again only those of automatic
			// compensations): its call would stay succeeded, or parked
			// for a human who may undo it a second time. This process
			// stops instead, as an executor does, and the partition
			// goes to a member that reads it.
			r.cfg.Logger.Error("reconciler stopped: the events topic holds an event of a newer encoding than this build reads; upgrade it",
				"topic", rec.Topic, "partition", rec.Partition, "offset", rec.Offset, "err", err)
			return ledger.Output{}, fmt.Errorf("%w: %s/%d at offset %d: %w", ledger.ErrStop, rec.Topic, rec.Partition, rec.Offset, err)
		}
		if err != nil {
			// Damage, or a bug, for a human to see (see the executor's).
			r.cfg.Logger.Error("undecodable event", "topic", rec.Topic, "partition", rec.Partition, "offset", rec.Offset, "err", err)
			r.cfg.Metrics.UndecodableEvents(1)
			continue
		}
		if undidNothing(ev.Type, rec) {
			if orig, ok := ev.Key().Compensates(); ok {
				r.undoEnded[orig] = true
			}
			continue
		}
		if ev.Type == statemachine.EventSucceeded {
			// Once per compensation: the same event twice in a batch (a
			// re-append of its outbox) would be two moves from one
			// state, the second failing the step, and the redelivery
			// would then find the move made and append nothing.
			if _, ok := ev.Key().Compensates(); ok && !undone[ev.Key()] {
				undone[ev.Key()] = true
				compensated = append(compensated, ev)
			}
			continue
		}
		if k := ev.Key(); !seen[k] {
			seen[k] = true
			keys = append(keys, k)
		}
	}
	var candidates []processors.Record
	for _, k := range keys {
		rec, err := r.cfg.Store.Get(ctx, k)
		if errors.Is(err, processors.ErrNotFound) {
			r.cfg.Logger.Error("unknown outcome without execution record", "call_key", k.String())
			continue
		}
		if err != nil {
			return ledger.Output{}, err
		}
		candidates = append(candidates, rec)
	}
	var handed []pendingMove // parks handed to a human by the sweep
	if now := r.cfg.Now(); now.Sub(r.lastSwp) >= r.cfg.SweepEvery {
		r.lastSwp = now
		oldestPage := r.unknownPass.Starting()
		unknown, err := r.unknownPass.Page(ctx, r.cfg.Store, processors.StatusOutcomeUnknown, r.sweepLimit, now)
		if err != nil {
			return ledger.Output{}, fmt.Errorf("sweep unknown outcomes: %w", err)
		}
		r.swept(unknown, r.unknownPass.Starting())
		// The gauge is of the oldest calls, read at every sweep: a
		// pass past them would leave it showing a call since resolved.
		oldest := unknown
		if !oldestPage {
			if oldest, err = r.cfg.Store.ByStatusAfter(ctx, processors.StatusOutcomeUnknown, processors.Cursor{}, r.sweepLimit); err != nil {
				return ledger.Output{}, fmt.Errorf("sweep unknown outcomes: %w", err)
			}
		}
		parked, err := r.cfg.Store.ByStatusAfter(ctx, processors.StatusParked, processors.Cursor{}, r.sweepLimit)
		if err != nil {
			return ledger.Output{}, fmt.Errorf("sweep parked calls: %w", err)
		}
		r.mu.Lock()
		r.unknown, r.oldestUnknown = len(oldest), time.Time{}
		if len(oldest) > 0 {
			r.oldestUnknown = oldest[0].UpdatedAt
		}
		r.parked, r.oldestParked = len(parked), time.Time{}
		if len(parked) > 0 {
			r.oldestParked = parked[0].UpdatedAt
		}
		r.mu.Unlock()
		for _, rec := range unknown {
			if !seen[rec.Key] {
				seen[rec.Key] = true
				candidates = append(candidates, rec)
			}
		}
		var done []ledger.Event
		if handed, done, err = r.retryUndos(ctx); err != nil {
			return ledger.Output{}, err
		}
		for _, ev := range done {
			if !undone[ev.Key()] {
				undone[ev.Key()] = true
				compensated = append(compensated, ev)
			}
		}
	}

	var (
		mu    sync.Mutex
		moves []pendingMove
		wg    sync.WaitGroup
		// left counts the calls whose lookups failed this step, said
		// in one line rather than one per call and sweep for as long as
		// a tool's status endpoint is down.
		left struct {
			n   int
			key ledger.CallKey
			err error
		}
	)
	for _, rec := range candidates {
		if rec.Status != processors.StatusOutcomeUnknown {
			continue // resolved, or parked for a human
		}
		wg.Add(1)
		go func() {
			// Owned by this step: bounded by the lookups' attempts.
			defer wg.Done()
			m, ok, failed := r.reconcile(context.WithoutCancel(ctx), rec)
			mu.Lock()
			defer mu.Unlock()
			if ok {
				moves = append(moves, m)
			}
			if failed != nil {
				if left.n++; left.err == nil {
					left.key, left.err = rec.Key, failed
				}
			}
		}()
	}
	wg.Wait()
	if left.n > 0 {
		r.cfg.Logger.Warn("status lookups failed or said the calls are in progress; the calls wait for a later sweep, and are parked once unanswered for the bound",
			"calls", left.n, "unanswered_for", r.cfg.UnansweredFor, "call_key", left.key.String(), "err", left.err)
	}
	moves = append(moves, handed...)
	for _, ev := range compensated {
		m, ok, err := r.compensate(ctx, ev)
		if err != nil {
			return ledger.Output{}, err
		}
		if ok {
			moves = append(moves, m)
		}
	}
	return r.apply(ctx, moves)
}

// compensate records that the call a succeeded compensation call undid is
// compensated.
func (r *Reconciler) compensate(ctx context.Context, comp ledger.Event) (pendingMove, bool, error) {
	orig, _ := comp.Key().Compensates()
	rec, err := r.cfg.Store.Get(ctx, orig)
	if errors.Is(err, processors.ErrNotFound) {
		r.cfg.Logger.Error("compensation of an unknown call", "call_key", comp.Key().String())
		return pendingMove{}, false, nil
	}
	if err != nil {
		return pendingMove{}, false, err
	}
	switch rec.Status {
	case processors.StatusSucceeded, processors.StatusOutcomeUnknown, processors.StatusParked:
	case processors.StatusCompensated:
		return pendingMove{}, false, nil
	default:
		// Settled as having had no effect (a lookup, an operator) while
		// the undo ran: Resolve refuses that, but one may have passed
		// its check just before the compensation started. Nothing
		// records an undo against such a call; a human must look.
		r.cfg.Logger.Error("a compensation succeeded for a call recorded without an effect; a human must check what it undid",
			"call_key", orig.String(), "status", string(rec.Status), "compensation_key", comp.Key().String())
		return pendingMove{}, false, nil
	}
	// Only the compensation the original's tool declares undoes it (the
	// intake reserves the keys, this checks the tool as well).
	tool, err := rec.ToolIn(r.cfg.Registry)
	switch {
	case err != nil:
		// Not in this reconciler's registry (a rolling deploy): the
		// declared compensation cannot be checked here, and the key is
		// one only the compensation service runs a call under. Dropped,
		// the success would be recorded nowhere.
		r.cfg.Logger.Warn("the compensated call's tool is not in this reconciler's registry; its compensation is taken as the declared one", "call_key", rec.Key.String(),
			"tool", rec.Tool, "tool_version", rec.ToolVersion, "compensation_key", comp.Key().String(), "err", err)
	case tool.Compensation == nil || tool.Compensation.Tool != comp.Tool || tool.Compensation.Version != comp.ToolVersion:
		// The registry changed since the compensation was asked for (a
		// release declaring another compensation, or another version
		// of it): the key is one only the compensation service runs a
		// call under, and it ran the one declared then. Dropped, the
		// success would be recorded nowhere, at every sweep, and the
		// call it undid could never be settled (a resolution waits for
		// that compensation, and the key is spent).
		r.cfg.Logger.Warn("the compensated call's tool now declares another compensation than the one that ran; taken as the one declared when it was asked for",
			"call_key", rec.Key.String(), "compensation_key", comp.Key().String(), "tool", comp.Tool, "tool_version", comp.ToolVersion)
	}
	tmpl, err := recordTemplate(rec)
	if err != nil {
		// As for every call without context: left out, not the step's
		// failure, which would come back with every redelivery of the
		// batch and stop reconciling the partition's other calls.
		r.cfg.Logger.Error("compensated call without context; it stays as it is", "call_key", rec.Key.String(), "compensation_key", comp.Key().String(), "err", err)
		return pendingMove{}, false, nil
	}
	m := r.settle(rec, tmpl, processors.StatusCompensated, statemachine.EventCompensated, "compensated",
		"undone by the compensation call "+comp.Key().String()+" ("+comp.Tool+")", nil)
	m.move.From = rec.Status
	m.mustApply = true
	return m, true, nil
}

// pendingMove is a decided move and the events it appends: any the
// record held that the log may lack, then the step's own (last). A move
// that must apply (a compensation's success) fails the step when it does
// not, so that its event comes again and is decided on the fresh record.
type pendingMove struct {
	move      processors.Move
	evs       []ledger.Event
	mustApply bool
	// base is the record's LoggedSeq as read: the mark after the
	// append applies only while the record is still logged that far
	// (processors.Logged.Base).
	base int64
	// undo, when set, is the reason of the compensation the move's park
	// asks for, requested once the move applied.
	undo string
}

// by makes the move's own event (the last) an actor's, in the events
// appended and in the outbox, which holds the same events.
func (m *pendingMove) by(actor string) {
	m.evs[len(m.evs)-1].Actor = actor
	m.move.Outbox, _ = ledger.EncodeEvents(m.evs)
}

// logged is the mark of the move's events, once they are in the log.
func (m *pendingMove) logged() processors.Logged {
	return processors.Logged{Key: m.move.Key, Seq: m.move.Seq, Base: m.base}
}

// reconcile asks the tool what became of rec and returns the move that
// records it, if any. When it leaves the call for a later sweep because
// the lookups failed, failed is their last error.
func (r *Reconciler) reconcile(ctx context.Context, rec processors.Record) (_ pendingMove, ok bool, failed error) {
	log := r.cfg.Logger.With("call_key", rec.Key.String(), "tool", rec.Tool)
	tmpl, err := recordTemplate(rec)
	if err != nil {
		log.Error("unknown outcome without context", "err", err)
		return pendingMove{}, false, nil
	}
	tool, err := rec.ToolIn(r.cfg.Registry)
	if err != nil {
		// Not in this reconciler's registry (one not yet upgraded, in a
		// rolling deploy, meeting a call of a newer version): what the
		// tool declares is not known here, which is no reason to park
		// the call as if it declared no lookup. It waits, as for a
		// lookup that failed, for a reconciler that knows the tool, and
		// is parked once none has for the bound (a version withdrawn
		// from every registry).
		last := fmt.Errorf("tool %s version %d is not in this reconciler's registry as the call was admitted: %w", rec.Tool, rec.ToolVersion, err)
		return r.unanswered(ctx, rec, tmpl, nil, last, "its tool version is not in the reconciler's registry as the call was admitted, and has not been", false)
	}
	if tool.StatusLookup == nil || tool.StatusLookup.URL == "" {
		detail := "the tool declares no status lookup: a human must find out what happened (ledger calls resolve)"
		if tool != nil && tool.Compensation != nil {
			detail += "; it declares the compensation " + tool.Compensation.String()
		}
		return r.parkOrWait(rec, tmpl, tool, ReasonNoStatusLookup, detail)
	}
	target, err := r.x.resolve(tool.StatusLookup.URL)
	if err != nil {
		// Parked as any call whose outcome cannot be found out: undone
		// if its policy says so.
		return r.parkOrWait(rec, tmpl, tool, ReasonLookupFailed, "bad status lookup url")
	}
	if why, stale := r.heldByKillSwitch(ctx, tool.Name, rec.Key.TenantID); why != "" {
		// Nothing minted, nothing sent.
		return r.heldOff(ctx, log, rec, lookupHeld{why, stale})
	}
	var lc *lookupCredential
	if r.cfg.Credentials != nil {
		grant := credentials.Grant{
			Tenant: rec.Key.TenantID, User: tmpl.UserID, Agent: tmpl.AgentID, Executor: r.cfg.Owner,
			Tool: tool.Name, ToolVersion: tool.Version, Audience: tool.Backend.Audience,
			CallID: rec.CallID, IdempotencyKey: rec.Key.String(),
			// It reads what the call did; it must not let anyone do it.
			// A jti of its own: the call's may be revoked (leaked with
			// its request), which must not keep the reconciler from
			// finding out what the call did, and undo an effect that
			// happened.
			Action: credentials.StatusScope(tool.Name),
		}
		cred, err := r.mintLookup(grant, tool)
		if err != nil {
			return r.parkOrWait(rec, tmpl, tool, ReasonLookupFailed, "no credential for the lookup: "+err.Error())
		}
		// Renewed under the same jti and family (lookupCredential).
		grant.JTI, grant.Family = cred.JTI, cred.Family
		lc = &lookupCredential{grant: grant, cred: cred}
		// The events this pass appends name the credential the lookup
		// was sent under, so that its jti, which a tool's logs show,
		// leads a responder to the call, and its family (this
		// reconciler's) may be revoked.
		tmpl.JTI, tmpl.CredentialScope, tmpl.CredentialFamily = cred.JTI, cred.Scope, cred.Family
	}
	g := r.x.guard(tool, rec.Key.TenantID)
	defer r.x.release(g)
	tries := r.cfg.MaxAttempts
	sec, last := backendSecret(r.cfg.Secrets, tool)
	if last != nil {
		// Failed lookups, none asked: the call waits for a sweep that
		// has the secret, and is parked once unanswered for the bound.
		log.Debug("backend secret unavailable for the status lookup", "err", last)
		tries = 0
	}
	// pending: a lookup of this pass was answered by the tool, saying
	// the call is not settled yet (in progress); remembered (failed).
	pending := false
attempts:
	for n := range tries {
		if n > 0 {
			time.Sleep(r.cfg.Backoff << (n - 1))
		}
		resp, sent, err := r.lookup(ctx, g, tool, target, rec, lc, sec)
		var (
			he   *httptool.Error
			held lookupHeld
		)
		switch {
		case errors.As(err, &held):
			// Frozen since the pass began (while the lookup waited for
			// a slot, or between its tries): this one is not sent.
			return r.heldOff(ctx, log, rec, held)
		case errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests):
			// Not asked: the breaker is open because other lookups of
			// the tool failed (a host that stalled can time a burst of
			// them out). Asking again in this pass would be held off
			// too.
			last = err
			break attempts
		case err == nil && lookupState(resp) == "applied":
			r.restartWait(ctx, rec)
			return r.settle(rec, tmpl, processors.StatusSucceeded, statemachine.EventSucceeded, ReasonReconciled,
				"status lookup: the tool applied the call", lookupResult(tool, tmpl, resp, secrets{bearer: lc.token(), backend: sec, anyToken: true})), true, nil
		case errors.As(err, &he) && he.Status == 404 && lookupState(resp) == "not_found":
			r.restartWait(ctx, rec)
			// Not found is final only if the lookup was sent once the
			// last attempt could no longer land: it started before the
			// outcome was recorded and lasts at most the tool's
			// timeout. When the lookup was sent, not when it answered:
			// one sent earlier may have been read before that attempt
			// landed, however late its answer comes. The record's time
			// is the store's clock (PostgreSQL's, CockroachDB's now()),
			// this one the reconciler's: a host running ahead of the
			// database would end the wait early, so it lasts
			// notFoundSkew longer. A paused executor's request may land
			// later, while its credential is accepted (CredentialSkew).
			if sent.Before(rec.UpdatedAt.Add(Landing(tool, r.cfg.CredentialSkew))) {
				log.Debug("not found yet; asking again after the last attempt's time is up")
				return pendingMove{}, false, nil
			}
			// An operator's compensation of the call under way may undo
			// it (its executor found the call undoable before this
			// answer): recorded failed now, the call would say it had no
			// effect while its undo ran. The compensation's outcome
			// settles it, as resolve refuses an operator's failed
			// (ErrUndoUnderWay). One whose executor checks the call
			// after rec was read fences the move out (UndoMarks).
			switch comp, err := r.cfg.Store.Get(ctx, rec.Key.CompensationKey()); {
			case errors.Is(err, processors.ErrNotFound):
			case err != nil:
				return r.unanswered(ctx, rec, tmpl, tool, fmt.Errorf("read its compensation: %w", err), "its compensation could not be read to settle it failed", false)
			case !undoneNothing(comp.Status):
				log.Info("not found, but its compensation is under way: its outcome settles the call", "compensation", comp.Status)
				return pendingMove{}, false, nil
			}
			return r.settle(rec, tmpl, processors.StatusFailed, statemachine.EventFailed, ReasonReconciled,
				"status lookup: the tool has no trace of the call; it did not apply it", nil), true, nil
		case err == nil && lookupState(resp) != "" && lookupState(resp) != "not_found",
			errors.As(err, &he) && (he.Status == http.StatusConflict || he.Status == http.StatusTooEarly):
			// The tool is still at it (the lookup protocol's "anything
			// else": 409, or a state of its own, say "pending"): an
			// answer, not a failure. Its request may land yet, later
			// than any landing window. The pass ends here, for the
			// answer to be noted on the record at once: another
			// reconciler's park for failing lookups, which may ask for
			// an undo, does not land once it is (UnlessInProgress).
			last, pending = fmt.Errorf("status lookup answered that the call is in progress (%q): %w", lookupState(resp), cmp.Or(err, errNotSettled)), true
			break attempts
		case err == nil:
			last = fmt.Errorf("status lookup answered %q", lookupState(resp))
		default:
			last = err
		}
		log.Debug("status lookup failed", "attempt", n+1, "err", last)
	}
	return r.unanswered(ctx, rec, tmpl, tool, last, "the status lookups of its last pass failed or were held off, and none answered", pending)
}

// lookupHeld is why the kill switch holds a status lookup back (see
// heldByKillSwitch).
type lookupHeld struct {
	why   string
	stale bool
}

func (h lookupHeld) Error() string { return "status lookup held: " + h.why }

// heldOff ends a pass whose lookup the kill switch held back: the call is
// asked about again at a later sweep. And the wait for an answer starts
// again after, as after one: lookups that failed before a freeze (a blip)
// say nothing of the tool once it is lifted, and one failure then must
// not hand the call to a human, or undo it.
func (r *Reconciler) heldOff(ctx context.Context, log *slog.Logger, rec processors.Record, h lookupHeld) (pendingMove, bool, error) {
	log.Debug(h.Error())
	if h.stale {
		r.warnHeld(h.why)
	}
	r.restartWait(ctx, rec)
	return pendingMove{}, false, nil
}

// heldByKillSwitch says why a status lookup of tool for tenant is not to
// be sent now: the tool is frozen, or whether it is cannot be known
// (stale). "" when it may be sent. As a call's requests, no lookup
// reaches a frozen tool, with a credential or the backend's secret.
func (r *Reconciler) heldByKillSwitch(ctx context.Context, tool, tenant string) (why string, stale bool) {
	if r.cfg.Freezes == nil {
		return "", false
	}
	if r.cfg.ControlMaxStaleness > 0 {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		err := r.cfg.Freezes.Current(cctx, r.cfg.ControlMaxStaleness)
		cancel()
		if err != nil {
			return "the kill switch's state is not known current: " + err.Error(), true
		}
	}
	if a, ok := r.cfg.Freezes.Frozen(tool, tenant); ok {
		return "the tool is frozen (" + a.Subject + ")", false
	}
	return "", false
}

// warnHeld says, at most once a sweep interval, that status lookups are
// held for want of a current copy of the control topic: every unknown
// outcome then waits, none looked up or handed over, which a freeze
// explains and this does not.
func (r *Reconciler) warnHeld(why string) {
	now := r.cfg.Now()
	r.mu.Lock()
	due := now.Sub(r.heldWarned) >= r.cfg.SweepEvery
	if due {
		r.heldWarned = now
	}
	r.mu.Unlock()
	if due {
		r.cfg.Logger.Warn("status lookups held: the calls in outcome_unknown wait until the copy of the control topic is current again", "why", why)
	}
}

// errNotSettled: a status lookup's answer said the call is not settled.
var errNotSettled = errors.New("not settled")

// unanswered leaves rec, whose pass could not find out what the call did
// (last says why), for a later sweep, or parks it (lookup_failed, why)
// once that has been so for UnansweredFor.
//
// A call whose tool said, at any round since its lookups began failing,
// that it is in progress (inProgress, this round) is parked
// status_lookup_pending instead, and never undone, whatever its policy
// says of unknown outcomes: an undo sent while the request is under way
// may come first and cancel nothing, and the call would be recorded
// compensated with its effect landing after. Nor is it for a human to
// resolve failed without asking the tool, which the detail says.
//
// What any reconciler learnt of the call's lookups since they began
// failing is on its record (processors.Unanswered), read again, merged
// with this reconciler's, right before a park: another one may have been
// told meanwhile that the call is in progress.
func (r *Reconciler) unanswered(ctx context.Context, rec processors.Record, tmpl ledger.Event, tool *schemas.Tool, last error, why string, inProgress bool) (pendingMove, bool, error) {
	now := r.cfg.Now()
	f := r.failed(rec.Key, now, inProgress)
	mine := processors.Unanswered{Seq: rec.Seq, Since: f.since, InProgress: f.inProgress}
	held, _ := rec.UnansweredAt()
	note := mine.Merged(held)
	if note.Equal(held) && !r.due(note, rec, f, now) {
		// The record says as much already, and the call waits.
		return pendingMove{}, false, last
	}
	note, ok, err := r.cfg.Store.NoteUnanswered(ctx, rec.Key, mine)
	switch {
	case err != nil:
		// Whether another reconciler heard that the call is in
		// progress is not known: no park on this.
		return pendingMove{}, false, fmt.Errorf("%w; and noting it on the call's record failed: %w", last, err)
	case !ok && inProgress:
		// Another reconciler's park may have landed between this answer
		// and its note, and asked for the call's undo.
		r.cfg.Logger.Error("the tool said the call is in progress, and the call moved on before that was noted: if it was parked for an undo, check that the undo does not precede the call's own request", "call_key", rec.Key.String(), "answer", last)
		return pendingMove{}, false, nil
	case !ok:
		r.cfg.Logger.Debug("the call moved on while its lookups failed", "call_key", rec.Key.String())
		return pendingMove{}, false, nil
	case !r.due(note, rec, f, now):
		// A pass whose lookups failed or were held off says nothing
		// about the call, and may be answered at a later sweep: a human
		// is handed the call only once its lookups have failed for
		// UnansweredFor, not after one burst of failures (nor every
		// call looked up while the breaker stays open), and not in this
		// reconciler's first sweep of them, however old the call or its
		// note: under undo_unknown a park undoes a call that may have
		// succeeded.
		return pendingMove{}, false, last
	}
	if note.InProgress {
		return r.settle(rec, tmpl, processors.StatusParked, statemachine.EventParked, ReasonLookupPending,
			fmt.Sprintf("the status lookups have not settled the call for %s, and the tool said meanwhile that it is in progress (last: %v): it may still take effect; ask the tool before resolving it, and undo it only once it has", r.cfg.UnansweredFor, last), nil), true, nil
	}
	m := r.park(rec, tmpl, tool, ReasonLookupFailed, fmt.Sprintf("%s for %s: %v", why, r.cfg.UnansweredFor, last))
	// Not if another reconciler hears "in progress" before it lands: the
	// next round parks the call status_lookup_pending instead.
	m.move.UnlessInProgress = true
	return m, true, nil
}

// due reports whether a call whose lookups failed again at now, noted so
// (note), is to be handed to a human: once they have failed here for a
// sweep interval at least (mine; the bound, if shorter), so that two
// rounds in one burst are not enough, and for UnansweredFor by the note,
// and it is as long since the call's last change.
func (r *Reconciler) due(note processors.Unanswered, rec processors.Record, mine failingSince, now time.Time) bool {
	return now.Sub(mine.since) >= min(r.cfg.SweepEvery, r.cfg.UnansweredFor) &&
		now.Sub(note.Since) >= r.cfg.UnansweredFor && !now.Before(rec.UpdatedAt.Add(r.cfg.UnansweredFor))
}

// cancelUndo denies comp, the reconciler's compensation ck of a call an
// operator resolves succeeded keeping the success, while it has not
// started: authorized or waiting for an approval, by a compare-and-set on
// its record (Move); given
// back by an executor (executing, no lease owner: its breaker was open,
// its policies could not decide), by a completion fenced by its claim's
// epoch (Complete). So an executor claiming it at the same time either
// finds it denied and sends nothing, or has claimed it first, and the
// resolution is refused as with one running (the executor read the call
// still parked, and may undo it). Without this, a claim between the
// resolution's check and its write could undo the success the operator
// chose to keep. Nil, and nothing written, for another compensation (an
// operator's, which undoes a call resolved succeeded, as asked).
func (r *Reconciler) cancelUndo(ctx context.Context, operator identity.Identity, ck ledger.CallKey, comp processors.Record, why string) (*pendingMove, error) {
	givenBack := comp.Status == processors.StatusExecuting && comp.LeaseOwner == ""
	pending := comp.Status == processors.StatusPending
	if automatic, known := compensation.Automatic(comp); !known || !automatic || comp.Status != processors.StatusAuthorized && !givenBack && !pending {
		return nil, nil
	}
	tmpl, err := recordTemplate(comp)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoContext, err)
	}
	// One waiting for an approval ends as an approver's refusal would
	// (the state machine's way out of approval_pending), and its
	// approval's own move then loses.
	to, t := processors.StatusDenied, statemachine.EventDenied
	if pending {
		to, t = processors.StatusRejected, statemachine.EventRejected
	}
	if givenBack && len(comp.LapsedFamilies) > 0 {
		// Given back after its undo's credential reached the tool (the
		// tool answered without effect, or only its headers went): the
		// families it went under, and its jti, as an executor's events
		// name them, so that their blast radius finds it.
		tmpl.JTI, tmpl.EarlierCredentialFamilies = comp.Credential.JTI, comp.LapsedFamilies
	}
	m := r.settle(comp, tmpl, to, t, ReasonCompensationCancelled, why, nil)
	m.move.From = comp.Status
	m.by("operator:" + operator.User)
	var applied []bool
	if givenBack {
		applied, err = r.cfg.Store.Complete(ctx, []processors.Completion{{Key: ck, Epoch: comp.Epoch, Status: processors.StatusDenied,
			Attempt: comp.Attempt, Seq: m.move.Seq, Outbox: m.move.Outbox}})
	} else {
		applied, err = r.cfg.Store.Move(ctx, []processors.Move{m.move})
	}
	if err != nil {
		return nil, err
	}
	if !applied[0] {
		return nil, fmt.Errorf("%w: %s started (or changed) while the call was being resolved, and may undo the call: ask again once it has ended (ledger trace %s)",
			ErrAutomaticUndoPending, ck, ck.IdempotencyKey)
	}
	return &m, nil
}

// undoEnded says why a call whose compensation ck, comp, has ended having
// undone it, or (unknownToo) maybe, is not resolved: the compensation's
// outcome settles it. Nil when comp has not ended so, or ended undoing
// nothing.
func undoEnded(ck ledger.CallKey, comp processors.Record, unknownToo bool) error {
	switch comp.Status {
	case processors.StatusSucceeded:
		return fmt.Errorf("%w: %s succeeded: it undid the call, which is settled compensated once the reconciler reads that success; there is nothing to resolve (ledger trace %s)", ErrUndoUnderWay, ck, ck.IdempotencyKey)
	case processors.StatusOutcomeUnknown, processors.StatusParked:
		if !unknownToo {
			return nil
		}
		return fmt.Errorf("%w: whether its compensation %s undid it is not known (%s): settle the compensation first (ledger calls resolve %s)", ErrUndoUnderWay, ck, comp.Status, ck.IdempotencyKey)
	}
	return nil
}

// automaticUndoPending says why a resolution as succeeded waits for, or
// must confirm (confirmed), comp, the call's compensation ck; nil when it
// need not. Resolved succeeded, the call is one the reconciler's
// compensation leaves as it is, and an operator who asked to undo it
// since, whose request joined that one (the key is the call's), would
// find it not undone, and its key spent: the resolver says so knowingly.
// undoes is whether that compensation would undo the call as it is now
// (compensation.AutomaticUndoes): one handed to a human meanwhile it
// leaves as it is, resolved or not, and no request joins it since
// (refused, ErrAutomaticCompensationPending), so there is nothing to
// confirm. An operator's compensation undoes a call settled succeeded
// too, and settles it compensated.
func automaticUndoPending(ck ledger.CallKey, comp processors.Record, confirmed, undoes bool) error {
	if comp.Status.Done() {
		return nil
	}
	asker := "asked for by the reconciler under undo_unknown; operators' requests to undo the call since joined it"
	switch automatic, known := compensation.Automatic(comp); {
	case !known:
		// A newer build's events: it may be the reconciler's.
		asker = "whose events this build cannot read: it may be the reconciler's"
	case !automatic:
		return nil
	}
	if compensation.Running(comp) {
		// A confirmation would not stop it.
		return fmt.Errorf("%w: %s (%s) is running, and may undo the call: ask again once it has ended (ledger trace %s)",
			ErrAutomaticUndoPending, ck, asker, ck.IdempotencyKey)
	}
	if confirmed || !undoes {
		return nil
	}
	return fmt.Errorf("%w: %s (%s) is %s, and would end without undoing the call (nothing_to_undo). To have the call undone, leave it unresolved: the compensation settles it compensated once it succeeds. To keep the success, resolve with cancel_compensation (ledger calls resolve --cancel-compensation)",
		ErrAutomaticUndoPending, ck, asker, comp.Status)
}

// handedOverUndo reports whether comp, the compensation of the call rec,
// is the reconciler's, not yet running, and will undo nothing since the
// call was handed to a human meanwhile (compensation.AutomaticUndoes):
// its end settles nothing either, and the human settles the call.
func handedOverUndo(rec, comp processors.Record) bool {
	automatic, known := compensation.Automatic(comp)
	return known && automatic && !compensation.AutomaticUndoes(rec) && !compensation.Running(comp)
}

// ReconcilerUser is the user the reconciler asks for compensations as: a
// compensation call of this user undoes only an outcome still unknown
// (outcome_unknown or parked), never a call found to have succeeded.
const ReconcilerUser = compensation.AutomaticUser

// park hands a call whose outcome cannot be established to a human, or,
// when its deciding policy says to undo such calls and its tool declares a
// compensation, parks it until the compensation succeeds. The
// compensation is asked for only once the park is recorded (apply): asked
// before, a park that did not land (a failed move, another reconciler)
// left it to undo a call a later lookup may find succeeded, with no event
// to say why.
func (r *Reconciler) park(rec processors.Record, tmpl ledger.Event, tool *schemas.Tool, reason, detail string) pendingMove {
	if r.undoes(tmpl, tool) {
		m := r.settle(rec, tmpl, processors.StatusParked, statemachine.EventParked, ReasonCompensating,
			"the outcome could not be established ("+reason+"); the compensation "+rec.Key.CompensationKey().String()+" is requested", nil)
		m.undo = "outcome unknown (" + reason + "); a policy says to undo it"
		return m
	}
	return r.settle(rec, tmpl, processors.StatusParked, statemachine.EventParked, reason, detail, nil)
}

// parkOrWait parks rec at once (park), unless the park would ask for its
// compensation while the call's last attempt may still land (Landing, as
// a status lookup's not_found waits for). An undo sent before it lands
// cancels nothing, and the call would be recorded compensated with its
// effect standing. Until then it is left for a later sweep.
func (r *Reconciler) parkOrWait(rec processors.Record, tmpl ledger.Event, tool *schemas.Tool, reason, detail string) (pendingMove, bool, error) {
	if r.undoes(tmpl, tool) && r.cfg.Now().Before(rec.UpdatedAt.Add(Landing(tool, r.cfg.CredentialSkew))) {
		r.cfg.Logger.Debug("outcome unknown, to be undone once its last attempt can no longer land", "call_key", rec.Key.String(), "reason", reason)
		return pendingMove{}, false, nil
	}
	return r.park(rec, tmpl, tool, reason, detail), true, nil
}

// Landing is how long after a call of tool was recorded outcome_unknown
// a request of it may still land at the tool: its last attempt started
// before and lasts at most the tool's timeout. Where the deployment mints
// credentials, the tool accepts one of that attempt's requests, however
// late it arrives (queued on the way, or a paused executor's not yet
// sent), only while its credential is: the credential expires at most
// the tool's timeout and attemptCredentialSlack after the attempt it was
// minted for began, and is accepted credentialSkew past that, or the
// tool's backend.credential_skew_ms if longer. notFoundSkew more is for
// the clocks.
func Landing(tool *schemas.Tool, credentialSkew time.Duration) time.Duration {
	if credentialSkew > 0 {
		// The deployment mints credentials, and this tool's verifier
		// may accept them longer past their expiry.
		credentialSkew = max(credentialSkew, tool.Backend.CredentialSkew()) + attemptCredentialSlack
	}
	return tool.Timeout() + credentialSkew + notFoundSkew
}

// LandingWindow is Landing for the longest of reg's tools, with the
// tools' credential skew (ReconcilerConfig.CredentialSkew, as set).
func LandingWindow(reg *schemas.Registry, credentialSkew time.Duration) time.Duration {
	var longest time.Duration
	for _, t := range reg.Tools() {
		longest = max(longest, Landing(t, credentialSkew))
	}
	return longest
}

// undoes reports whether a park of a call of tool, decided as tmpl says,
// asks for its compensation.
func (r *Reconciler) undoes(tmpl ledger.Event, tool *schemas.Tool) bool {
	return r.cfg.Compensator != nil && tool != nil && tool.Compensation != nil && slices.Contains(tmpl.Obligations, "undo_unknown")
}

// requestUndo asks for the compensation of the call key, parked for it,
// and remembers a failure: one that may pass is asked again by later
// sweeps (retryUndos), up to UndoAttempts; one that will not, or the last
// attempt's, hands the call to a human at the next sweep. Asking again is
// safe: the compensation has one key, derived from the call's
// (CallKey.CompensationKey), which the intake admits once. It reports a
// failure that may pass: its callers ask for no more compensations in
// that step (holdUndo), since the cause (Kafka, the store) likely holds
// for the others too, and each request may wait undoTimeout.
func (r *Reconciler) requestUndo(ctx context.Context, key ledger.CallKey, reason string) (failed bool) {
	ctx, cancel := context.WithTimeout(ctx, undoTimeout)
	defer cancel()
	system := identity.Identity{User: ReconcilerUser, Agent: r.cfg.Owner, Tenant: key.TenantID, Roles: []string{r.cfg.OperatorRole}}
	_, evs, err := r.cfg.Compensator.Compensate(ctx, system, key, reason)
	lasting := err != nil && lastingErr(err)
	if last, refused := ledger.Refusing(evs); err == nil && refused {
		if last.Reason == ReasonToolFrozen {
			// A freeze is no reason to hand the call to a human
			// (Freezes), however long it lasts: asked again, the
			// attempt not counted, as the executor waits one out for a
			// compensation already admitted. Each refusal is an event
			// on the log: asked at the next sweep, then at gaps
			// doubling up to maxHoldGap, said once at Info.
			st := r.undos[key]
			if st == nil {
				st = &undoState{}
				r.undos[key] = st
			}
			st.holds++
			st.next = r.cfg.Now()
			if st.holds > 1 {
				st.next = st.next.Add(min(r.cfg.SweepEvery<<min(st.holds-2, 16), maxHoldGap))
			}
			r.cfg.Metrics.CompensationRequest("held")
			level := slog.LevelDebug
			if st.holds == 1 {
				level = slog.LevelInfo
			}
			r.cfg.Logger.Log(ctx, level, "automatic compensation held: its tool is frozen; asked again later, for as long as the freeze lasts",
				"call_key", key.String(), "detail", last.Detail, "retry_at", st.next)
			return false
		}
		err = fmt.Errorf("%s (%s)", last.Reason, last.Detail)
		lasting = !passingRefusal(last)
	}
	if err == nil {
		delete(r.undos, key)
		r.cfg.Metrics.CompensationRequest("requested")
		return false
	}
	if errors.Is(err, compensation.ErrSettled) {
		// Resolved since the sweep listed it parked: nothing to undo
		// nor to hand over.
		delete(r.undos, key)
		r.cfg.Metrics.CompensationRequest("settled")
		r.cfg.Logger.Info("automatic compensation not asked for: the call was settled meanwhile", "call_key", key.String(), "err", err)
		return false
	}
	st := r.undos[key]
	if st == nil {
		st = &undoState{}
		r.undos[key] = st
	}
	log := r.cfg.Logger.With("call_key", key.String(), "compensation_key", key.CompensationKey().String())
	if lasting {
		st.abandon = "it was refused: " + err.Error()
		r.cfg.Metrics.CompensationRequest("refused")
		log.Error("automatic compensation refused; the call is handed to a human", "err", err)
		return false
	}
	st.failures, st.holds = st.failures+1, 0
	if st.failures >= r.cfg.UndoAttempts {
		st.abandon = fmt.Sprintf("its request failed %d times, last: %v", st.failures, err)
		r.cfg.Metrics.CompensationRequest("abandoned")
		log.Error("automatic compensation abandoned after its last attempt; the call is handed to a human", "attempts", st.failures, "err", err)
		return true
	}
	// The first retry at the next sweep, then the gaps double, in
	// sweeps: one, two, four...
	st.next = r.cfg.Now()
	if st.failures > 1 {
		st.next = st.next.Add(r.cfg.SweepEvery << min(st.failures-2, 16))
	}
	r.cfg.Metrics.CompensationRequest("failed")
	log.Warn("automatic compensation request failed; it is asked again", "attempt", st.failures, "retry_at", st.next, "err", err)
	return true
}

// holdUndo leaves the compensation of the call key, parked for it, to the
// next sweep, without counting an attempt: a request for another failed
// in this step.
func (r *Reconciler) holdUndo(key ledger.CallKey) {
	if r.undos[key] == nil {
		r.undos[key] = &undoState{next: r.cfg.Now()}
	}
}

// retryUndos asks again, at a sweep, for the compensations of the calls
// parked compensation_requested that have none: those this reconciler
// failed to request, when due, and those any reconciler parked (listed,
// within the sweep's limit), as a restart forgets the failures. A call
// whose compensation exists is left to it, whatever its end: its own
// events say how it went. It returns the moves that park again, for a
// human, the calls whose compensation will not be requested; and the
// success events of the compensations found succeeded, which settle
// their calls compensated (their event may never have reached this
// reconciler: one it could not read, say, with its offset committed).
func (r *Reconciler) retryUndos(ctx context.Context) ([]pendingMove, []ledger.Event, error) {
	if r.cfg.Compensator == nil {
		return nil, nil, nil
	}
	parked, err := r.parkedPass.Page(ctx, r.cfg.Store, processors.StatusParked, r.sweepLimit, r.cfg.Now())
	if err != nil {
		return nil, nil, fmt.Errorf("sweep parked calls: %w", err)
	}
	var cands []processors.Record
	listed := make(map[ledger.CallKey]bool)
	for _, rec := range parked {
		if compensation.UndoPending(rec) {
			listed[rec.Key] = true
			cands = append(cands, rec)
		}
	}
	now := r.cfg.Now()
	// add lists the call key if it is still parked for its compensation
	// (pending); a call settled meanwhile, or gone, is not.
	add := func(key ledger.CallKey) (pending bool, err error) {
		rec, err := r.cfg.Store.Get(ctx, key)
		switch {
		case errors.Is(err, processors.ErrNotFound):
			return false, nil
		case err != nil:
			return false, fmt.Errorf("sweep parked calls: %w", err)
		case !compensation.UndoPending(rec):
			return false, nil
		}
		listed[key] = true
		cands = append(cands, rec)
		return true, nil
	}
	for key, st := range r.undos {
		if listed[key] || (st.abandon == "" && now.Before(st.next)) {
			continue
		}
		pending, err := add(key)
		if err != nil {
			return nil, nil, err
		}
		if !pending {
			delete(r.undos, key) // settled meanwhile, by a human or the compensation
		}
	}
	for key := range r.undoEnded {
		if listed[key] {
			continue
		}
		if _, err := add(key); err != nil {
			return nil, nil, err
		}
	}
	clear(r.undoEnded)
	var (
		moves []pendingMove
		done  []ledger.Event
		held  bool // a request failed: the others wait for the next sweep
	)
	for _, rec := range cands {
		var why string // set: the call goes back to a human, for this reason
		// What the human can do: undo it through the ledger while the
		// call's one compensation key is free; once a compensation
		// ended under it, the ledger refuses another (compensation_failed),
		// and the call is undone by hand, then resolved.
		todo := "settle the call (ledger calls resolve) or undo it (ledger calls compensate)"
		comp, err := r.cfg.Store.Get(ctx, rec.Key.CompensationKey())
		switch {
		case errors.Is(err, processors.ErrNotFound):
			st := r.undos[rec.Key]
			if st == nil || (st.abandon == "" && !now.Before(st.next)) {
				if held {
					r.holdUndo(rec.Key)
					continue
				}
				held = r.requestUndo(context.WithoutCancel(ctx), rec.Key, "outcome unknown; a policy says to undo it (asked again)")
				st = r.undos[rec.Key]
			}
			if st == nil || st.abandon == "" {
				continue // requested, or asked again later
			}
			// The last request may have been admitted with its answer
			// lost (a commit whose reply never came, its time running
			// out mid-commit), or recorded as refused under the
			// compensation's key: read again before the call is handed
			// over as one no compensation was requested for, which a
			// human would undo through the ledger, or by hand.
			if _, err := r.cfg.Store.Get(ctx, rec.Key.CompensationKey()); !errors.Is(err, processors.ErrNotFound) {
				if err != nil {
					return nil, nil, fmt.Errorf("sweep parked calls: %w", err)
				}
				delete(r.undos, rec.Key) // it exists: its status decides, at the next sweep
				continue
			}
			why = "was not requested: " + st.abandon
		case err != nil:
			return nil, nil, fmt.Errorf("sweep parked calls: %w", err)
		case comp.Status == processors.StatusSucceeded:
			// Done: its success settles the call.
			delete(r.undos, rec.Key)
			evs, err := ledger.DecodeEvents(comp.Outbox)
			if err != nil || len(evs) == 0 || evs[len(evs)-1].Type != statemachine.EventSucceeded {
				r.cfg.Logger.Error("succeeded compensation without its success event; the call stays parked", "call_key", rec.Key.String(), "err", err)
				continue
			}
			done = append(done, evs[len(evs)-1])
			continue
		case undoneNothing(comp.Status):
			// Its own events say why; the call's park must say that
			// nothing undid it, not that it is being undone.
			why = fmt.Sprintf("ended %s without undoing anything", comp.Status)
			todo = "undo it by hand if it must be (the ledger runs no other compensation of it) and settle the call (ledger calls resolve)"
			r.cfg.Logger.Error("automatic compensation ended without undoing the call; it is handed to a human", "call_key", rec.Key.String(), "status", string(comp.Status))
		default:
			// Running, or done: its completion settles the call.
			delete(r.undos, rec.Key)
			continue
		}
		delete(r.undos, rec.Key)
		tmpl, err := recordTemplate(rec)
		if err != nil {
			r.cfg.Logger.Error("parked call without context", "call_key", rec.Key.String(), "err", err)
			continue
		}
		m := r.settle(rec, tmpl, processors.StatusParked, statemachine.EventParked, ReasonUndoAbandoned,
			"the compensation "+rec.Key.CompensationKey().String()+" a policy asks for "+why+
				"; a human must find out what happened and "+todo, nil)
		m.move.From = rec.Status
		moves = append(moves, m)
	}
	return moves, done, nil
}

// undidNothing reports whether rec, an event of type t, may say that a
// compensation ended without undoing anything: an event of such an end
// under a compensation's key. Told by the record's key, so that the
// calls' own denials, many, are not decoded for it.
func undidNothing(t statemachine.EventType, rec *kgo.Record) bool {
	switch t {
	case statemachine.EventDenied, statemachine.EventRejected, statemachine.EventFailed, statemachine.EventExpired:
		k, err := ledger.ParseCallKey(string(rec.Key))
		if err != nil {
			return false
		}
		_, ok := k.Compensates()
		return ok
	}
	return false
}

// undoneNothing reports whether a compensation in status s has ended
// without running: refused by the intake, a policy or an approver, failed
// or expired.
func undoneNothing(s processors.Status) bool {
	switch s {
	case processors.StatusDenied, processors.StatusRejected, processors.StatusFailed, processors.StatusExpired:
		return true
	}
	return false
}

// lastingErr reports whether a compensation request's error will not
// pass by asking again: one that says it is terminal (compensation's
// sentinels: not compensable, no compensation, forbidden...), or the
// call gone. Others (the store, Kafka, a timeout) may pass.
func lastingErr(err error) bool {
	var t interface{ Terminal() bool }
	return (errors.As(err, &t) && t.Terminal()) || errors.Is(err, processors.ErrNotFound)
}

// maxHoldGap bounds the gap between the requests for a compensation
// whose tool is frozen: the freeze may be lifted at any moment.
const maxHoldGap = 5 * time.Minute

// passingRefusal reports whether a compensation's refusal may pass by
// asking again: one that says when to (a rate limit's, or that of
// policies that could not decide), refused before the intake used the
// key. (A frozen tool's is not counted at all: requestUndo holds it.)
// Any other refusal (a policy's denial, recorded under the key; a check
// of the call) stands.
func passingRefusal(ev ledger.Event) bool {
	return ev.Refusal() && ev.RetryAfterMS > 0
}

// failed notes that k's lookups failed (or were held off) in a round that
// ended at now, and returns since when they have here: now at the first.
func (r *Reconciler) failed(k ledger.CallKey, now time.Time, inProgress bool) failingSince {
	r.mu.Lock()
	defer r.mu.Unlock()
	f, ok := r.failing[k]
	if !ok {
		f.since = now
	}
	f.sweepPass = r.unknownPasses
	f.inProgress = f.inProgress || inProgress
	r.failing[k] = f
	return f
}

// restartWait forgets rec's failing lookups, here and on its record, so
// that the wait for an answer (UnansweredFor) starts again: a lookup
// answered, or the kill switch held one. The record keeps that the tool
// said the call is in progress, if any reconciler heard it
// (Unanswered.InProgress). A note that stays (the store failed) makes a
// later wait shorter: it is logged.
func (r *Reconciler) restartWait(ctx context.Context, rec processors.Record) {
	r.mu.Lock()
	delete(r.failing, rec.Key)
	r.mu.Unlock()
	if n, ok := rec.UnansweredAt(); !ok || n.Since.IsZero() {
		return
	}
	if _, _, err := r.cfg.Store.NoteUnanswered(ctx, rec.Key, processors.Unanswered{Seq: rec.Seq}); err != nil {
		r.cfg.Logger.Warn("the call's note of its failing status lookups could not be cleared: a later wait for an answer may be shorter", "call_key", rec.Key.String(), "err", err)
	}
}

// swept notes the calls a page of the unknown outcomes' sweep listed,
// and, when the page ended its pass, forgets the failing lookups of the
// calls that pass neither listed nor saw fail: no longer outcome_unknown
// (resolved by another reconciler or a human, parked). A call forgotten
// that fails again is as at this reconciler's first round of it: it
// waits a sweep interval here again, and the bound as the call's note
// (processors.Unanswered) counts it. Tied to the passes, not to a time, so that a backlog
// whose pass outlasts any bound is parked at its second.
func (r *Reconciler) swept(listed []processors.Record, passEnded bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := range listed {
		if f, ok := r.failing[listed[i].Key]; ok {
			f.sweepPass = r.unknownPasses
			r.failing[listed[i].Key] = f
		}
	}
	if !passEnded {
		return
	}
	for k, f := range r.failing {
		if f.sweepPass < r.unknownPasses {
			delete(r.failing, k)
		}
	}
	r.unknownPasses++
}

// lookup asks the tool's status lookup about rec's call, through the
// tool's bulkhead and breaker, and says when the request was sent (zero
// if it was not).
func (r *Reconciler) lookup(ctx context.Context, g *guard, tool *schemas.Tool, target string, rec processors.Record, lc *lookupCredential, backend string) (resp httptool.Response, sent time.Time, err error) {
	// The kill switch is asked before each try, as the pass asked it
	// before the first: frozen meanwhile (the tool hung, its breaker
	// opened), the try is held, not refused by the breaker, a failure
	// that could hand the call to a human, or undo it. And again once
	// the slot is had, as an attempt's is: a lookup may have waited for
	// one, behind requests to a tool that hangs, for longer than a
	// freeze may take to be honoured.
	held := func() error {
		if why, stale := r.heldByKillSwitch(ctx, tool.Name, rec.Key.TenantID); why != "" {
			return lookupHeld{why, stale}
		}
		return nil
	}
	if err := held(); err != nil {
		return httptool.Response{}, time.Time{}, err
	}
	// As an attempt: a lookup its breaker will refuse takes no slot,
	// which would count its tenant as using the tool.
	if err := g.refusal(); err != nil {
		return httptool.Response{}, time.Time{}, err
	}
	release, err := r.x.acquire(ctx, g)
	if err != nil {
		return httptool.Response{}, time.Time{}, err
	}
	defer release()
	if err := held(); err != nil {
		return httptool.Response{}, time.Time{}, err
	}
	// The credential, asked about on the copy the kill switch was just
	// found current on: revoked, it is not sent (the tools refuse it,
	// and the refusal would count as a failed lookup); about to expire
	// (the tries before, a wait for the slot), it is renewed.
	if lc != nil {
		if why := r.lookupRevoked(lc.cred); why != "" {
			return httptool.Response{}, time.Time{}, lookupHeld{why: why}
		}
		if err := r.renewLookup(lc, tool); err != nil {
			return httptool.Response{}, time.Time{}, lookupHeld{why: "its credential, about to expire, could not be renewed: " + err.Error()}
		}
	}
	sec := secrets{bearer: lc.token(), backend: backend}
	resp, err = g.breaker.Execute(func() (httptool.Response, error) {
		lctx, cancel := context.WithTimeout(ctx, tool.Timeout())
		defer cancel()
		sent = r.cfg.Now()
		return r.cfg.Looker.Lookup(lctx, target, httptool.Request{
			IdempotencyKey: rec.Key.String(), CallID: rec.CallID, TenantID: rec.Key.TenantID,
			Attempt: rec.Attempt, Arguments: rec.Arguments, Credential: sec.bearer, BackendSecret: sec.backend, MaxResultBytes: tool.MaxResultBytes,
		})
	})
	if r.revokedAtTheTool(ctx, lc, err) {
		return resp, sent, lookupHeld{why: r.lookupRevoked(lc.cred)}
	}
	return resp, sent, err
}

// revokedAtTheTool reports whether err, a lookup's, is the tool's 401
// for lc's credential revoked: a revocation reaches the tools, which ask
// the introspection endpoint, up to a second before the reconciler's
// copy of the control topic, which passed the lookup. The copy is asked
// again, current as of the answer, as the executor asks it of a call's
// 401: revoked, the lookup is held, not counted a failure, which could
// hand the call to a human or undo it.
func (r *Reconciler) revokedAtTheTool(ctx context.Context, lc *lookupCredential, err error) bool {
	return lc != nil && caughtUpAfter401(ctx, r.cfg.Freezes, r.cfg.ControlMaxStaleness, err) && r.lookupRevoked(lc.cred) != ""
}

// lookupCredential is a status lookup pass's credential. Minted for one
// try (the tool's timeout and attemptCredentialSlack), as a call's
// attempt's is, and renewed under its jti and family before a try it
// would not outlast: a lookup credential good for the whole credential
// TTL let whoever read it off a tool's logs read the call's result
// (a status scope's) long after the pass had ended.
type lookupCredential struct {
	// grant mints it again: its JTI and Family are the credential's.
	grant credentials.Grant
	cred  credentials.Credential
}

// token is the credential to send; "" without one.
func (lc *lookupCredential) token() string {
	if lc == nil {
		return ""
	}
	return lc.cred.Token
}

// mintLookup mints g for one try of a status lookup of tool, from now.
func (r *Reconciler) mintLookup(g credentials.Grant, tool *schemas.Tool) (credentials.Credential, error) {
	g.Deadline = r.cfg.Now().Add(tool.Timeout() + attemptCredentialSlack)
	return r.cfg.Credentials.Mint(g)
}

// renewLookup mints lc's credential again when it would expire within a
// try of tool.
func (r *Reconciler) renewLookup(lc *lookupCredential, tool *schemas.Tool) error {
	if lc.cred.ExpiresAt.After(r.cfg.Now().Add(tool.Timeout())) {
		return nil
	}
	cred, err := r.mintLookup(lc.grant, tool)
	if err != nil {
		return err
	}
	lc.cred = cred
	return nil
}

// lookupRevoked says why cred may not be sent: it, or its family as of
// its issue (within CredentialSkew of the revocation, as the tools
// judge), was revoked. "" when it may be. A pass so held ends as one the
// kill switch holds: the next mints a credential of its own, which a
// family's revocation no longer covers once the skew has passed.
func (r *Reconciler) lookupRevoked(cred credentials.Credential) string {
	if r.cfg.Freezes == nil {
		return ""
	}
	if a, ok := r.cfg.Freezes.Revoked(cred.JTI, ""); ok && a.JTI == cred.JTI {
		return "its credential " + cred.JTI + " was revoked (" + a.Reason + ")"
	}
	if a, ok := r.cfg.Freezes.Revoked("", cred.Family); ok && control.Covers(a, cred.IssuedAt, r.cfg.CredentialSkew) {
		return "its credential's family " + cred.Family + " was revoked (" + a.Reason + ")"
	}
	return ""
}

// lookupResult is what a call settled succeeded keeps of its status
// lookup's answer, resp: the answer's "result", the call's result, made
// safe as the executor makes a tool's answer (sanitize: masked, cut, kept
// without content when it holds a secret the lookup carried), with its
// digest. Without a "result" member, or in an answer cut before it ends,
// none is kept, and the digest is the answer's, unless a mask applies:
// the masked fields may be in it. Any credential in the result is a
// secret (sent.anyToken): the reconciler cannot know the tokens the
// call's executors sent.
func lookupResult(tool *schemas.Tool, tmpl ledger.Event, resp httptool.Response, sent secrets) *sanitized {
	masks := resultMasks(tool, tmpl.Obligations)
	var answer struct {
		Result json.RawMessage `json:"result"`
	}
	if !resp.Truncated && json.Unmarshal(resp.Body, &answer) == nil && len(answer.Result) > 0 && string(answer.Result) != "null" {
		s := sanitize(tool, httptool.Response{Body: answer.Result}, masks, sent)
		s.code = s.resultCode(false, false)
		return &s
	}
	if len(masks) > 0 {
		return nil
	}
	d := digested(resp.Body)
	return &d
}

// lookupState reads {"state": ...} from a status lookup's answer. An
// answer cut at the tool's result size (it carries the call's result,
// which may be as large) is read up to its state: a state ahead of the
// cut is the tool's answer all the same, and a tool whose results fill
// the cap would otherwise never be settled by its lookups.
func lookupState(resp httptool.Response) string {
	if !resp.Truncated {
		var s struct {
			State string `json:"state"`
		}
		if json.Unmarshal(resp.Body, &s) != nil {
			return ""
		}
		return s.State
	}
	dec := json.NewDecoder(bytes.NewReader(resp.Body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return ""
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return ""
		}
		if t == "state" {
			var s string
			if dec.Decode(&s) != nil {
				return ""
			}
			return s
		}
		var skip json.RawMessage
		if dec.Decode(&skip) != nil {
			return ""
		}
	}
	return ""
}

// settle builds the move that records what the reconciler (or an
// operator) found: to, with an event of type t. The events the record
// holds go out again ahead of the new one, and stay in the outbox ahead of
// it: the log may lack them (their step's transaction aborted, or its
// executor died), and the record cannot tell for sure, for its LoggedSeq
// may be an executor's mark in advance, under a journal entry settled only
// later (processors.Completion.Journal). Leaving them out would put the
// new event after a gap in the log until that entry's sweep, or for good
// if the outbox lost them; readers drop the copies of those that were
// there. A call is reconciled rarely, so the copies cost little.
func (r *Reconciler) settle(rec processors.Record, tmpl ledger.Event, to processors.Status, t statemachine.EventType, reason, detail string, res *sanitized) pendingMove {
	ev := tmpl
	ev.EventID = uuid.Must(uuid.NewV7()).String()
	ev.Type, ev.Seq, ev.At, ev.Actor = t, rec.Seq+1, r.cfg.Now().UTC(), r.cfg.Owner
	ev.Reason, ev.Detail = reason, detail
	var result []byte
	if res != nil {
		ev.ResultDigest, ev.ResultBytes, ev.ErrorCode, result = res.digest, res.bytes, res.code, res.stored
	}
	ev.ExpiresAt = nil
	// The outbox and the events appended are the same: what the record
	// held, then the new event.
	evs, err := ledger.DecodeEvents(rec.Outbox)
	if err != nil {
		evs = nil
	}
	evs = append(evs, ev)
	outbox, _ := ledger.EncodeEvents(evs)
	return pendingMove{
		base: rec.LoggedSeq,
		move: processors.Move{Key: rec.Key, From: processors.StatusOutcomeUnknown, FromSeq: rec.Seq, FromUndoMarks: rec.UndoMarks, To: to, Seq: rec.Seq + 1, Outbox: outbox, Result: result},
		evs:  evs,
	}
}

// contradicted reports, at Error, a lookup's answer (m, a move to
// succeeded or failed) that did not apply because the call was settled
// meanwhile the other way: a human resolved it failed while its tool said
// applied, or succeeded while its tool said it has no such call. The
// agent was told the settlement; a responder must learn that the tool
// says otherwise (an effect that happened, which a retry under a new key
// would apply twice; or one that did not).
func (r *Reconciler) contradicted(ctx context.Context, m pendingMove) {
	var against processors.Status
	switch m.move.To {
	case processors.StatusSucceeded:
		against = processors.StatusFailed
	case processors.StatusFailed:
		against = processors.StatusSucceeded
	default:
		return
	}
	cur, err := r.cfg.Store.Get(ctx, m.move.Key)
	if err != nil || cur.Status != against {
		return
	}
	ev := m.evs[len(m.evs)-1]
	r.cfg.Logger.Error("a status lookup's answer contradicts how the call was settled meanwhile: the call stays as settled; check the tool",
		"call_key", m.move.Key.String(), "settled_as", cur.Status, "lookup_says", m.move.To, "reason", ev.Reason, "detail", ev.Detail)
}

// apply records the moves, and returns the events of those that applied.
func (r *Reconciler) apply(ctx context.Context, moves []pendingMove) (ledger.Output, error) {
	if len(moves) == 0 {
		return ledger.Output{}, nil
	}
	ms := make([]processors.Move, len(moves))
	for i := range moves {
		ms[i] = moves[i].move
	}
	applied, err := r.cfg.Store.Move(ctx, ms)
	if err != nil {
		return ledger.Output{}, fmt.Errorf("record %d reconciliations: %w", len(ms), err)
	}
	var (
		out    []*kgo.Record
		logged []processors.Logged
		held   bool // a compensation's request failed: the others wait for the sweep
	)
	for i, ok := range applied {
		if !ok && moves[i].mustApply {
			return ledger.Output{}, fmt.Errorf("%s moved meanwhile; its compensation is recorded on redelivery", ms[i].Key)
		}
		if !ok {
			// Settled meanwhile, by another reconciler or a human.
			r.contradicted(ctx, moves[i])
			continue
		}
		switch {
		case moves[i].undo == "":
		case held:
			r.holdUndo(moves[i].move.Key)
		default:
			held = r.requestUndo(context.WithoutCancel(ctx), moves[i].move.Key, moves[i].undo)
		}
		for _, ev := range moves[i].evs {
			rec, err := ev.Record(r.cfg.Topics.Events)
			if err != nil {
				return ledger.Output{}, err
			}
			out = append(out, rec)
		}
		logged = append(logged, moves[i].logged())
	}
	return ledger.Output{Records: out, Committed: func(ctx context.Context) error {
		if len(logged) == 0 {
			return nil
		}
		return r.cfg.Store.MarkLogged(ctx, logged)
	}}, nil
}

// Resolve settles an unknown outcome by hand: operator found out what
// happened (evidence says how) and records it as succeeded or failed. It
// returns the events to publish, the resolution last; the move is in the
// store, so if the publish fails the executor's sweep appends them.
func (r *Reconciler) Resolve(ctx context.Context, operator identity.Identity, key ledger.CallKey, res Resolution) ([]ledger.Event, error) {
	ms, err := r.resolve(ctx, operator, key, res)
	if err != nil {
		return nil, err
	}
	var evs []ledger.Event
	for _, m := range ms {
		evs = append(evs, m.evs...)
	}
	return evs, nil
}

// ReasonCompensationCancelled: the reconciler's compensation of a call,
// not started, was denied when an operator resolved the call succeeded
// and chose to keep the success (Resolution.CancelCompensation).
const ReasonCompensationCancelled = "compensation_cancelled"

// resolve is Resolve, returning the moves it applied: the cancel of the
// reconciler's compensation, if it made one, then the call's.
func (r *Reconciler) resolve(ctx context.Context, operator identity.Identity, key ledger.CallKey, res Resolution) ([]pendingMove, error) {
	as, evidence := res.As, res.Evidence
	if !slices.Contains(operator.Roles, r.cfg.OperatorRole) || (operator.Tenant != key.TenantID && operator.Tenant != "*") {
		return nil, ErrForbidden
	}
	if as != processors.StatusSucceeded && as != processors.StatusFailed {
		return nil, fmt.Errorf("%w: as %q: want succeeded or failed", ErrInvalidResolution, as)
	}
	if strings.TrimSpace(evidence) == "" {
		return nil, fmt.Errorf("%w: evidence is required", ErrInvalidResolution)
	}
	rec, err := r.cfg.Store.Get(ctx, key)
	if err != nil {
		return nil, err
	}
	if rec.Status != processors.StatusOutcomeUnknown && rec.Status != processors.StatusParked {
		return nil, ErrNotUnknown
	}
	// Read before anything is written: a resolution that cannot record
	// the call must not have cancelled its compensation.
	tmpl, err := recordTemplate(rec)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoContext, err)
	}
	// A compensation that may undo (or has undone) the call settles it
	// compensated: resolved failed now, the call would be recorded as
	// having had no effect while its undo ran. (Resolved succeeded, an
	// operator's compensation still settles it compensated; one the
	// reconciler asked for is refused as having nothing to undo, which
	// the resolver must confirm, below, and is then cancelled.) Once the
	// compensation ended without undoing anything, or was itself
	// resolved failed, the call is the operator's to settle. The call is
	// read before its compensation: one whose executor checks the call
	// after that read fences the move out (UndoMarks, lostResolution).
	ck := key.CompensationKey()
	var cancel *pendingMove
	switch comp, err := r.cfg.Store.Get(ctx, ck); {
	case errors.Is(err, processors.ErrNotFound):
	case err != nil:
		return nil, err
	case as == processors.StatusFailed && !undoneNothing(comp.Status):
		if err := undoEnded(ck, comp, true); err != nil {
			return nil, err
		}
		if !handedOverUndo(rec, comp) {
			return nil, fmt.Errorf("%w: %s is %s, and may undo the call: its outcome settles the call (ledger trace %s)", ErrUndoUnderWay, ck, comp.Status, ck.IdempotencyKey)
		}
		// The reconciler's compensation of a call handed to a human
		// undoes nothing, and its end settles nothing: the resolution
		// is the human's. Should its executor check the call first,
		// that check fences this move out (lostResolution); after it,
		// it finds the call failed, and ends nothing_to_undo.
	case as == processors.StatusFailed:
		// Its compensation ended undoing nothing: the call is the
		// operator's to settle.
	default:
		// Undone already: the compensation's success settles the call,
		// whoever asked for it. Resolved succeeded now, the call would
		// be recorded compensated right after, and the operator not told
		// that it had been undone. (One whose own outcome is unknown
		// does not stop it: resolved succeeded, the call is what it was
		// whatever the undo did, and moves on to compensated if the
		// compensation is found to have succeeded.)
		if err := undoEnded(ck, comp, false); err != nil {
			return nil, err
		}
		if err := automaticUndoPending(ck, comp, res.CancelCompensation, compensation.AutomaticUndoes(rec)); err != nil {
			return nil, err
		}
		why := "the call it would undo was resolved succeeded by an operator, who chose to keep the success (cancel_compensation)"
		if !res.CancelCompensation {
			why = "the call it would undo was handed to a human, who resolved it succeeded: this compensation would have undone nothing"
		}
		c, err := r.cancelUndo(ctx, operator, ck, comp, why)
		if err != nil {
			return nil, err
		}
		cancel = c
	}
	if as == processors.StatusFailed {
		// (After the compensation's checks, which say more: an undo
		// under way settles the call.) Failed says nothing happened, and an agent may send the call
		// again under a new key: not while its last attempt may still
		// reach the tool, as the reconciler does not take a not_found
		// for final, nor an operator's undo go out, until then.
		window := LandingWindow(r.cfg.Registry, r.cfg.CredentialSkew)
		if tool, err := rec.ToolIn(r.cfg.Registry); err == nil {
			window = Landing(tool, r.cfg.CredentialSkew)
		}
		if until := rec.UpdatedAt.Add(window); r.cfg.Now().Before(until) {
			return nil, &compensation.LandingError{Until: until}
		}
	}
	t := statemachine.EventSucceeded
	if as == processors.StatusFailed {
		t = statemachine.EventFailed
	}
	m := r.settle(rec, tmpl, as, t, ReasonResolvedByOperator, evidence, nil)
	m.move.From = rec.Status
	m.by("operator:" + operator.User)
	// The write runs to its end whether or not the operator still
	// waits, and one that failed is read back: it may have committed
	// (the operator, told it failed, would find the call settled, and
	// might undo by hand a call resolved as it chose).
	applied, failedWrite, err := processors.MoveOrReadBack(ctx, r.cfg.Store, []processors.Move{m.move}, []string{m.evs[len(m.evs)-1].EventID}, resolveWriteTimeout)
	if failedWrite != nil {
		r.cfg.Logger.Warn("a resolution's write failed, and had applied: taken", "call_key", key.String(), "err", failedWrite)
	}
	if err == nil && !applied[0] {
		err = r.lostResolution(ctx, key, rec)
	}
	if err != nil && cancel != nil {
		// The compensation is cancelled all the same (its events wait
		// in its outbox for the sweep): the call is the operator's to
		// undo by hand, if it must be.
		return nil, fmt.Errorf("%w (its compensation %s was cancelled, %w; undo the call by hand if it must be)", err, ck, errUndoCancelled)
	}
	if err != nil {
		return nil, err
	}
	if cancel != nil {
		return []pendingMove{*cancel, m}, nil
	}
	return []pendingMove{m}, nil
}

// resolveWriteTimeout bounds the write of an operator's resolution, and
// then its read back.
const resolveWriteTimeout = 10 * time.Second

// errUndoCancelled is in the error of a resolution that cancelled the
// call's automatic compensation and then failed, which the operator must
// learn (ResolveHandler answers compensation_cancelled).
var errUndoCancelled = errors.New(ReasonCompensationCancelled + ": the ledger runs no other")

// lostResolution is the error of a resolution of rec whose move did not
// apply: the call settled by someone else (ErrNotUnknown), or moved on
// and still to settle, parked by the reconciler meanwhile
// (ErrCallChanged), which the operator must be told, for "not unknown"
// would say it was settled; or checked by its compensation's executor
// meanwhile (ErrUndoUnderWay).
func (r *Reconciler) lostResolution(ctx context.Context, key ledger.CallKey, rec processors.Record) error {
	now, err := r.cfg.Store.Get(ctx, key)
	switch {
	case err != nil || now.Status != processors.StatusOutcomeUnknown && now.Status != processors.StatusParked:
	case now.UndoMarks != rec.UndoMarks:
		// An executor of the call's compensation checked the call after
		// the resolution read it, and may be sending the undo.
		ck := key.CompensationKey()
		return fmt.Errorf("%w: %s started while the call was being resolved, and may undo it: ask again once it has ended (ledger trace %s)", ErrUndoUnderWay, ck, ck.IdempotencyKey)
	default:
		return fmt.Errorf("%w: it is %s now (seq %d, was %d): look at it again (ledger trace %s) before resolving it", ErrCallChanged, now.Status, now.Seq, rec.Seq, key.IdempotencyKey)
	}
	return ErrNotUnknown
}
