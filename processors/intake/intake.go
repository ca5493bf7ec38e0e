// Package intake is the ledger's front door: it turns raw envelopes from the
// request topic into the first events of a call, or into a refusal, or (for
// records that cannot even be read) into a DLQ record with the reason.
// Nothing it reads is dropped silently.
package intake

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Reasons the intake gives, beyond the decoder's codes (ledger.Code*).
const (
	ReasonHashMismatch        = "arguments_hash_mismatch"
	ReasonUnknownTool         = "unknown_tool"
	ReasonUnknownToolVersion  = "unknown_tool_version"
	ReasonInvalidArguments    = "invalid_arguments"
	ReasonNoPolicy            = "no_policy"
	ReasonIdempotencyKeyReuse = "idempotency_key_reused"
	ReasonUnidentifiable      = "unidentifiable_request"
	// ReasonScopeMismatch: the envelope's scope disagrees with the
	// verified assertion.
	ReasonScopeMismatch = "scope_mismatch"
	// ReasonRateLimited: a policy's rate limit refused the call; the
	// refusal carries retry_after_ms and the key stays free.
	ReasonRateLimited = "rate_limited"
	// ReasonAssertionPrefix prefixes the verifier's reason for a refused
	// assertion: "assertion_expired", "assertion_alg_not_allowed"...
	ReasonAssertionPrefix = "assertion_"
	// ReasonToolFrozen: an operator froze the tool (the kill switch).
	ReasonToolFrozen = "tool_frozen"
	// ReasonApprovalRequired: a deciding policy asks for a human first.
	ReasonApprovalRequired = "approval_required"
	// ReasonReservedKey: the idempotency key has a form reserved for the
	// ledger's own calls (compensations).
	ReasonReservedKey = "reserved_key"
	// ReasonStoreRejected: the execution store cannot hold the
	// envelope's data (processors.ErrRejected).
	ReasonStoreRejected = "store_rejected"
	// ReasonControlStale: this intake's copy of the control topic (the
	// policy version activated, the freezes) is older than
	// Config.ControlMaxStaleness; the call is refused like a rate-limited
	// one, its key free for the retry.
	ReasonControlStale = "control_state_stale"
)

// Verifier verifies an agent's identity assertion. Implementations are
// safe for concurrent use; ctx bounds any key refresh.
type Verifier interface {
	Verify(ctx context.Context, assertion string) (identity.Identity, error)
}

// Freezes says whether the kill switch froze a tool, for all tenants or
// for one, and how old the copy of the control topic that says so is
// (Staleness: -1 until it first caught up); policy activations come
// through the same copy. Implementations are safe for concurrent use and
// cheap: they are asked for every call.
type Freezes interface {
	Frozen(tool, tenant string) (control.Action, bool)
	Staleness() time.Duration
}

// Decider decides a call with the active policies, failing closed.
type Decider interface {
	Decide(ctx context.Context, r policy.Request) policy.Decision
}

// Store is the part of the execution store the intake uses.
type Store interface {
	Admit(ctx context.Context, as []processors.Admission) ([]processors.AdmitResult, error)
	MarkLogged(ctx context.Context, ls []processors.Logged) error
	// Get tells a resent call from a new one when the policies cannot
	// decide (checkCall).
	Get(ctx context.Context, key ledger.CallKey) (processors.Record, error)
}

// DefaultPolicyRetryAfter is Config.PolicyRetryAfter's default.
const DefaultPolicyRetryAfter = time.Second

// Config configures the intake.
type Config struct {
	// Registry of tools. Required.
	Registry *schemas.Registry
	// Store records each call on first sight. Required.
	Store Store
	// Identity verifies the envelope's assertion; who asks comes from it
	// alone, never from the scope or the arguments. Without one, Step
	// refuses every envelope (only Submit, for calls the ledger makes
	// itself, works).
	Identity Verifier
	// Policy decides every call. Required. The policies' rate limits are
	// kept by the Store, across all intake instances, if it is a
	// processors.RateLimiter: it then charges a call in the transaction
	// that admits it (processors.Admission.Rates), to the budget of
	// every deciding policy with a limit, or, if any is spent, refuses
	// it (rate_limited) and charges none. With a store that is not, a
	// call under a rate limit is refused (rate_limited).
	Policy Decider
	// PolicyRetryAfter is the retry_after_ms of the refusal of a call the
	// policies could not decide (policy.Decision.Transient: a timeout, no
	// active set); default DefaultPolicyRetryAfter. Such a call is
	// refused like a rate-limited one, not denied: nothing runs, and its
	// key stays free for the retry, which is decided afresh.
	PolicyRetryAfter time.Duration
	// ApprovalTTL bounds how long a call waits for approval; default 15m,
	// and never past the call's deadline.
	ApprovalTTL time.Duration
	// Channel is what policies see as context.channel; default "kafka",
	// the agents' calls' (policy's doc lists the values policies see).
	Channel string
	// Freezes, when set, refuses calls to frozen tools (tool_frozen; the
	// key stays free for after the unfreeze).
	Freezes Freezes
	// ControlMaxStaleness is how old Freezes' copy of the control topic
	// may be when a call is decided: past it, the call is refused retry
	// later (control_state_stale), for the policy version activated since
	// may deny it. Zero: control.DefaultMaxStaleness; negative: not
	// checked.
	ControlMaxStaleness time.Duration
	// SyncPolicies, when set, brings Policy to the policy version that
	// Freezes' copy of the control topic activates (policy.Engine's
	// Activate); called before a step (or Submit) decides its calls, so
	// that the calls are decided with the version the copy holds. Nil:
	// the engine follows the activations on its own ticks, and a call
	// decided before the next one is decided with the version replaced.
	SyncPolicies func()
	// Versions, when set, reads the version of the resource of a call
	// that must wait for an approval, from its tool's resource_version
	// endpoint (BaseURL resolves relative ones), for the pending
	// approval to hold: the approval is refused if the resource changed
	// since (approvals.ErrResourceChanged). It waits at most
	// VersionTimeout (default 1 s) for a step's calls together, for the
	// step waits with them; an unread version leaves the approval to bind
	// the one it finds.
	Versions       processors.VersionReader
	BaseURL        string
	VersionTimeout time.Duration
	// Topics; defaults as ledger.Topics.
	Topics ledger.Topics
	// Limits on envelopes; defaults 256 KiB and depth 32.
	Limits ledger.Limits
	// Actor names this instance in events; default "intake".
	Actor string
	// MarkDelay is how long an authorized call's admission waits, once
	// its events are in the log, before the intake marks it logged; the
	// executor's claim marks it first, without a write of its own.
	// Default 3s: well inside the executors' sweep of unlogged records
	// (executor.Config.UnloggedGrace, 10s by default), which would
	// otherwise append the events of a call still waiting again.
	MarkDelay time.Duration
	// RatePruneEvery is how often the intake deletes up to
	// RatePruneBatch rate buckets that are full again, which mean the
	// same as none (processors.RatePruner), so that the buckets of users
	// and agents seen once do not pile up in the store. Default
	// DefaultRatePruneEvery; negative: never.
	RatePruneEvery time.Duration
	// Now is the clock; default time.Now.
	Now func() time.Time
	// Logger; nil discards.
	Logger *slog.Logger
}

// Processor is the intake. Everything it needs to know about earlier
// envelopes is in the store; the only per-call state it holds is the
// marks it makes later (laterMarks), which are safe to lose.
type Processor struct {
	cfg   Config
	later laterMarks
	// limits: the store keeps rate limits (see Config.Policy).
	limits bool
	base   *url.URL // Config.BaseURL
	// pruner prunes the store's rate buckets, nil when it cannot;
	// pruned is when a step last asked it to.
	pruner processors.RatePruner
	pruned time.Time
}

// DefaultRatePruneEvery is Config.RatePruneEvery's default.
const DefaultRatePruneEvery = time.Minute

// RatePruneBatch bounds the rate buckets one store call of a prune
// deletes: a prune deletes batch after batch while they come back full.
const RatePruneBatch = 1000

// rateUpkeepTimeout bounds a prune, and so how long it holds up the step
// it runs in: a stalled store costs the step that much, and what is left
// waits for the next time.
const rateUpkeepTimeout = 2 * time.Second

// New validates cfg and returns an intake.
func New(cfg Config) (*Processor, error) {
	if cfg.Registry == nil || cfg.Store == nil || cfg.Policy == nil {
		return nil, errors.New("intake: registry, store and policy are required")
	}
	if cfg.ApprovalTTL <= 0 {
		cfg.ApprovalTTL = 15 * time.Minute
	}
	if cfg.PolicyRetryAfter <= 0 {
		cfg.PolicyRetryAfter = DefaultPolicyRetryAfter
	}
	if cfg.VersionTimeout <= 0 {
		cfg.VersionTimeout = time.Second
	}
	if cfg.ControlMaxStaleness == 0 {
		cfg.ControlMaxStaleness = control.DefaultMaxStaleness
	}
	if cfg.Channel == "" {
		cfg.Channel = "kafka"
	}
	cfg.Topics = cfg.Topics.WithDefaults()
	cfg.Limits = cfg.Limits.WithDefaults()
	if cfg.Actor == "" {
		cfg.Actor = "intake"
	}
	if cfg.MarkDelay <= 0 {
		cfg.MarkDelay = 3 * time.Second
	}
	if cfg.RatePruneEvery == 0 {
		cfg.RatePruneEvery = DefaultRatePruneEvery
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	_, limits := cfg.Store.(processors.RateLimiter)
	base, err := processors.ParseBaseURL(cfg.BaseURL)
	if err != nil {
		return nil, fmt.Errorf("intake: %w", err)
	}
	p := &Processor{cfg: cfg, limits: limits, base: base}
	if pr, ok := cfg.Store.(processors.RatePruner); ok && limits && cfg.RatePruneEvery > 0 {
		p.pruner = pr
		// The first prune a period after the start: processes that
		// start together do not all prune at once.
		p.pruned = cfg.Now()
	}
	return p, nil
}

// pruneRates deletes rate buckets that are full again once every
// RatePruneEvery. A failure is logged, and waits for the next time: the
// buckets mean the same pruned or not.
func (p *Processor) pruneRates(ctx context.Context, now time.Time) {
	if p.pruner == nil || now.Sub(p.pruned) < p.cfg.RatePruneEvery {
		return
	}
	p.pruned = now
	pctx, cancel := context.WithTimeout(ctx, rateUpkeepTimeout)
	defer cancel()
	// Batch after batch while they come back full, within the budget:
	// a fixed batch a period would fall behind users who come faster.
	total := 0
	for pctx.Err() == nil {
		n, err := p.pruner.PruneRates(pctx, RatePruneBatch)
		total += n
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, context.DeadlineExceeded) {
				p.cfg.Logger.Warn("prune rate buckets that are full again", "err", err)
			}
			break
		}
		if n < RatePruneBatch {
			break
		}
	}
	if total > 0 {
		p.cfg.Logger.Debug("pruned rate buckets that were full again", "buckets", total)
	}
}

// checked is an envelope that passed every check: who asks, which tool,
// and the policy's decision.
type checked struct {
	env      *ledger.Envelope
	id       identity.Identity
	tool     *schemas.Tool
	decision policy.Decision
	// args are the arguments in canonical form, as hashed; tree is them
	// decoded, what the schema validates, the policies decide and the
	// audit copy shows.
	args []byte
	tree any
	// sent is when the call's deadline counts from (requestSent).
	sent time.Time
	// version is the resource's version, read for a call that waits for
	// an approval.
	version string
	// own: a call the ledger makes itself (Submit), under a key the
	// ledger derives, which whoever may ask for it asks for again.
	own bool
	// why is the reason Submit was given, for the requested event.
	why string
	// carries, for a call carrying another call's arguments (Submit's),
	// is that call's tool: its audit copy hides what that tool's would.
	carries *schemas.Tool
	// standing, when set, is the record of the very call c is a copy of
	// (resent, or redelivered after the transaction that admitted it
	// aborted), found under its key by a check that would have refused
	// it: its assertion lapsed since, or this intake's registry lacks or
	// defines otherwise its tool (another intake admitted it, mid-
	// deploy). The store answers it, as a duplicate (settle): a refusal
	// where its sender reads would be taken for the end of a call that
	// goes on to run. The other fields but env and id are unset.
	standing *processors.Record
}

// user is the user c's record is admitted for, whose call its key is
// (processors.Admission.UserID): none for the ledger's own calls, so that
// a second operator's request of a compensation another asked for (or
// the reconciler did) is answered as the retry it is, not refused.
func (c *checked) user() string {
	if c.own {
		return ""
	}
	return c.id.User
}

// key is the call's key under the verified tenant.
func (c *checked) key() ledger.CallKey {
	return ledger.CallKey{TenantID: c.id.Tenant, IdempotencyKey: c.env.IdempotencyKey}
}

// pending is a checked envelope waiting for the store to say whether its
// key is free.
type pending struct {
	*checked
	admission processors.Admission
}

// Step handles one batch of request records: it is a ledger.Step. The
// checks of the records (the assertion's signature, the schema, the
// policy) run in parallel; the store sees the batch in one round trip.
func (p *Processor) Step(ctx context.Context, recs []*kgo.Record) (ledger.Output, error) {
	now := p.cfg.Now().UTC()
	p.pruneRates(ctx, now)
	if len(recs) == 0 {
		// An idle tick: marks held for later fall due without a commit
		// to run them after. Bounded, so that a stalled store cannot
		// stop the polls (a lost mark is safe).
		mctx, cancel := context.WithTimeout(ctx, idleMarkTimeout)
		err := p.markLogged(mctx, nil)
		cancel()
		if err != nil && ctx.Err() == nil {
			p.cfg.Logger.Warn("mark admissions logged", "err", err)
		}
		return ledger.Output{}, nil
	}
	results := make([]checkResult, len(recs))
	stale := p.syncPolicies()
	// The batch's reads of keys that may hold a resent call, however
	// many of its envelopes read one (an agent's flood of calls to a tool
	// this intake lacks, say): a store that hangs costs the batch one
	// keyStandsTimeout, not that much an envelope.
	reads := &keyReads{store: p.cfg.Store}
	parallel(len(recs), func(i int) {
		results[i] = p.check(ctx, recs[i], now, stale, reads)
	})
	var (
		out   []*kgo.Record
		calls []*checked
	)
	for _, r := range results {
		if r.err != nil {
			return ledger.Output{}, r.err
		}
		if r.c != nil {
			calls = append(calls, r.c)
		}
	}
	// copies are the refusals of copies whose assertion lapsed, or whose
	// tool was frozen when they were checked, of a key another copy in
	// this batch is checked for: the check looked the key up before this
	// batch admitted anything, and what stands under it is known once
	// the batch is settled. (A freeze is read as each copy is checked: a
	// freeze or an unfreeze landing meanwhile refuses one of two
	// identical copies and admits the other.)
	var copies []*ledger.Event
	for _, r := range results {
		switch {
		case r.dlq != nil:
			out = append(out, r.dlq)
		case r.refusal != nil:
			// Rare (a lapsed or frozen copy beside its call): the
			// batch is looked through only then.
			if (lapsedRefusal(r.refusal) || frozenRefusal(r.refusal)) && slices.ContainsFunc(calls, func(c *checked) bool { return c.key() == r.refusal.Key() }) {
				copies = append(copies, r.refusal)
				continue
			}
			if r.unproven {
				unverify(r.refusal)
			}
			rec, err := r.refusal.Record(p.cfg.Topics.Events)
			if err != nil {
				return ledger.Output{}, err
			}
			out = append(out, rec)
		}
	}
	p.readVersions(ctx, calls)
	settled, logged, later, stands, err := p.settle(ctx, calls, now)
	if err != nil {
		return ledger.Output{}, err
	}
	out = append(out, settled...)
	for _, ev := range copies {
		// A copy of the very call that stands under its key now
		// (admitted by this batch, or answered by the store) is
		// answered by it, as a duplicate would be: refused, even under
		// the reserved tenant, it would end its sender's wait, and the
		// call would run all the same. Of another call, or of a key
		// nothing took (the other copy refused: rate limited, a key
		// reused), a lapsed copy is refused where the key's readers do
		// not take it for its call's end, and a frozen one as it was.
		if cur, ok := stands[ev.Key()]; ok && (processors.Admission{ArgumentsHash: ev.ArgumentsHash, UserID: ev.UserID}).Answer(cur) == processors.Duplicate {
			continue
		}
		if lapsedRefusal(ev) {
			unverify(ev)
		}
		rec, err := ev.Record(p.cfg.Topics.Events)
		if err != nil {
			return ledger.Output{}, err
		}
		out = append(out, rec)
	}
	committed := func(ctx context.Context) error {
		p.later.add(p.cfg.Now().Add(p.cfg.MarkDelay), later)
		return p.markLogged(ctx, logged)
	}
	return ledger.Output{Records: out, Committed: committed}, nil
}

// lapsedRefusal reports whether ev is the refusal of an envelope whose
// assertion only a time bound refused, filed under its tenant's key (the
// other refusals of an assertion go under ledger.UnverifiedTenant).
func lapsedRefusal(ev *ledger.Event) bool {
	return strings.HasPrefix(ev.Reason, ReasonAssertionPrefix) && ev.TenantID != ledger.UnverifiedTenant
}

// frozenRefusal reports whether ev is the final refusal of a call to a
// frozen tool (not one for now: the key's state could not be read).
func frozenRefusal(ev *ledger.Event) bool {
	return ev.Reason == ReasonToolFrozen && ev.RetryAfterMS == 0
}

// unverify files the refusal ev under ledger.UnverifiedTenant, naming no
// one, as an assertion's refusal that does not go to its sender is.
func unverify(ev *ledger.Event) {
	ev.TenantID, ev.UserID, ev.AgentID, ev.Purpose = ledger.UnverifiedTenant, "", "", ""
}

// refusalTenant is the tenant an identity's refusal goes under: its own,
// or ledger.UnverifiedTenant when the assertion's tenant claim is not a
// tenant id the schema allows. Unchecked against the scope, such a claim
// ("acme/ops") would file the refusal under another tenant's Kafka key
// (acme's call "ops/run1"), where its reader would take it for its own.
func refusalTenant(id identity.Identity) string {
	if schemas.ValidTenantID(id.Tenant) {
		return id.Tenant
	}
	return ledger.UnverifiedTenant
}

// parallel runs fn(0..n-1) on up to GOMAXPROCS goroutines and returns
// when all are done. A small batch runs inline: a goroutine costs more
// than its checks.
func parallel(n int, fn func(i int)) {
	workers := min(runtime.GOMAXPROCS(0), n/8)
	if workers <= 1 {
		for i := range n {
			fn(i)
		}
		return
	}
	var (
		next atomic.Int64
		wg   sync.WaitGroup
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				fn(i)
			}
		}()
	}
	wg.Wait()
}

// settle takes checked calls the rest of the way: the store says whether
// each key is free and, for a call under a rate limit, whether the limit
// admits it. It returns the records to append (the calls' first events,
// refusals, and events a crash left out of the log), what to mark logged
// once they are in, the authorized admissions to mark later
// (laterMarks), and the calls that stand under the keys answered with
// them (admitted, or answered as duplicates), each as its record.
func (p *Processor) settle(ctx context.Context, calls []*checked, now time.Time) (out []*kgo.Record, logged, later []processors.Logged, stands map[ledger.CallKey]processors.Record, _ error) {
	var (
		admits  []pending
		emitErr error
	)
	emit := func(evs ...ledger.Event) {
		for i := range evs {
			r, err := evs[i].Record(p.cfg.Topics.Events)
			if err != nil && emitErr == nil {
				emitErr = err
			}
			out = append(out, r)
		}
	}
	// A key's events go out once per batch, however many copies of its
	// envelope the batch holds.
	emitted := make(map[ledger.CallKey]bool)
	stands = make(map[ledger.CallKey]processors.Record)
	// duplicate answers a copy of the call cur holds (under key, sent as
	// env): its events go out again if the log may lack them.
	duplicate := func(key ledger.CallKey, cur processors.Record, env *ledger.Envelope) {
		// Its events are in the log unless a crash came between the
		// store and the log; then they go out again and readers drop
		// the duplicate (key, seq). (An executor's outcome marked in
		// advance under a journal entry looks logged here; the entry's
		// settling or the sweep appends it if not.) The whole outbox,
		// as the executor's sweep does: the record's mark may be one in
		// advance that a move went past.
		if !cur.Unlogged() || emitted[key] {
			p.cfg.Logger.Debug("duplicate envelope", "call_key", key.String(), "trace_id", env.TraceID)
			return
		}
		emitted[key] = true
		evs, err := ledger.DecodeEvents(cur.Outbox)
		if err != nil {
			// A newer build's encoding (mid-upgrade), or a damaged
			// record: left out and unlogged, for a build that reads it
			// (the executors' sweep counts it). Failing the batch would
			// redeliver it for as long as this build runs, holding up
			// the partition.
			p.cfg.Logger.Error("a duplicate's stored events cannot be read: not appended; a build that reads them will append them",
				"call_key", cur.Key.String(), "seq", cur.Seq, "logged_seq", cur.LoggedSeq, "err", err)
			return
		}
		emit(evs...)
		logged = append(logged, processors.Logged{Key: cur.Key, Seq: cur.Seq, Base: cur.LoggedSeq})
	}
	for _, c := range calls {
		if c.standing != nil {
			stands[c.key()] = *c.standing
			duplicate(c.key(), *c.standing, c.env)
			continue
		}
		rates := p.rates(c, now)
		if len(rates) > 0 && !p.limits {
			emit(p.refuse(c.key(), c.env, c.id, now, ReasonRateLimited, "", "a policy sets a rate limit and this intake's store keeps none"))
			continue
		}
		a, err := p.admission(c, now)
		if err != nil {
			return nil, nil, nil, nil, err
		}
		// Charged by the store with the admission, not before: a
		// duplicate, a retry of this batch after its step failed, or
		// a key reused, takes nothing.
		a.Rates = rates
		admits = append(admits, pending{checked: c, admission: a})
	}
	if len(admits) == 0 {
		return out, logged, nil, stands, emitErr
	}

	as := make([]processors.Admission, len(admits))
	for i := range admits {
		as[i] = admits[i].admission
	}
	results, rejected, alone, err := p.admit(ctx, as)
	if err != nil {
		return nil, nil, nil, nil, fmt.Errorf("admit %d calls: %w", len(as), err)
	}
	for i, res := range results {
		a := admits[i]
		if rejected[i] {
			emit(p.refuse(a.key(), a.env, a.id, now, ReasonStoreRejected, "",
				"the execution store cannot hold this envelope's data"))
			continue
		}
		switch res.Outcome {
		case processors.Admitted:
			stands[a.admission.Key] = a.admission.Record(now)
			emitted[a.admission.Key] = true
			out = append(out, a.admission.Records...)
			l := processors.Logged{Key: a.admission.Key, Seq: a.admission.Seq}
			if a.admission.Status == processors.StatusAuthorized {
				later = append(later, l)
			} else {
				logged = append(logged, l)
			}
		case processors.Duplicate:
			// A retry of a call we already hold.
			stands[a.admission.Key] = res.Record
			duplicate(a.admission.Key, res.Record, a.env)
		case processors.Conflict:
			pointer, detail := reusedKey(res.Record, a.id)
			emit(p.refuse(a.key(), a.env, a.id, now, ReasonIdempotencyKeyReuse, pointer, detail))
		case processors.Limited:
			// A later copy of a key (a key reused with other arguments)
			// gets its first copy's answer when the batch was admitted
			// whole: the budgets that refused are the ones the first
			// copy's policies named. Admitted alone, each copy was
			// charged on its own.
			// (Found by a scan: refusals are rare, and a batch that
			// has none builds no index.)
			charged := a.checked
			for j := 0; !alone && j < i; j++ {
				if admits[j].admission.Key == a.admission.Key {
					charged = admits[j].checked
					break
				}
			}
			// The policies named are those whose budgets refused.
			emit(p.retryLater(a.checked, charged.decision, now, ReasonRateLimited, limitedDetail(charged, res.Rates), res.RetryAfter()))
		default:
			return nil, nil, nil, nil, fmt.Errorf("admit %s: unexpected outcome %d", a.admission.Key, res.Outcome)
		}
	}
	return out, logged, later, stands, emitErr
}

// reusedKey is the pointer and the detail of a refusal of a key that
// holds another call, cur, to a submission by id. Another user's call is
// not described: the same words whatever its arguments, so that the
// refusal does not tell a user who guessed the key whether they also
// guessed the arguments (see processors.Admission.Answer).
func reusedKey(cur processors.Record, id identity.Identity) (pointer, detail string) {
	if cur.UserID != "" && cur.UserID != id.User {
		return "/idempotency_key", "the idempotency key is already used by another user's call"
	}
	return "/arguments_hash", "the idempotency key is already used by a call with other arguments"
}

// admit records a batch of admissions. When the store rejects the data of
// the batch, it admits them one by one to find the ones it rejects, so
// that one bad envelope cannot stall its partition; rejected[i] marks
// those, and alone says so. Any other error is returned, and the batch is
// retried whole.
func (p *Processor) admit(ctx context.Context, as []processors.Admission) (results []processors.AdmitResult, rejected []bool, alone bool, err error) {
	rejected = make([]bool, len(as))
	results, err = p.cfg.Store.Admit(ctx, as)
	if err == nil || !errors.Is(err, processors.ErrRejected) {
		return results, rejected, false, err
	}
	results = make([]processors.AdmitResult, len(as))
	for i := range as {
		res, err := p.cfg.Store.Admit(ctx, as[i:i+1])
		switch {
		case errors.Is(err, processors.ErrRejected):
			p.cfg.Logger.Warn("store rejected an admission", "call_key", as[i].Key.String(), "err", err)
			rejected[i] = true
		case err != nil:
			return nil, nil, false, err
		default:
			results[i] = res[0]
		}
	}
	return results, rejected, true, nil
}

// checkResult is what check made of one record: one of the checked call,
// a refusal event, a DLQ record, or the error of a store read that failed
// (the batch is then tried again).
type checkResult struct {
	c       *checked
	refusal *ledger.Event
	dlq     *kgo.Record
	err     error
	// unproven: refusal, of an unproven lapsed assertion
	// (identity.LapsedError), is under its tenant's key only until Step
	// knows whether a copy in the batch answers it; otherwise it goes
	// under the reserved tenant.
	unproven bool
}

// check runs every check of one record in DESIGN §5's order: strict
// decode, the assertion, the scope against it, the hash, the registry,
// the arguments, and the policy.
func (p *Processor) check(ctx context.Context, rec *kgo.Record, now time.Time, stale string, reads *keyReads) checkResult {
	env, err := ledger.DecodeEnvelope(rec.Value, p.cfg.Limits)
	if err != nil {
		var de *ledger.DecodeError
		if !errors.As(err, &de) {
			de = &ledger.DecodeError{Code: ledger.CodeInvalidJSON, Detail: err.Error()}
		}
		key, callID, ok := ledger.LenientKey(rec.Value)
		if !ok {
			p.cfg.Logger.Warn("request to dlq", "topic", rec.Topic, "partition", rec.Partition, "offset", rec.Offset, "reason", de.Code)
			return checkResult{dlq: ledger.DLQRecord(p.cfg.Topics.DLQ, rec, de.Code, de.Error())}
		}
		// Nobody vouches for this sender: the refusal goes under the
		// reserved tenant, never under the one the record claims.
		key.TenantID = ledger.UnverifiedTenant
		ev := p.refuse(key, &ledger.Envelope{CallID: callID, Published: rec.Value}, identity.Identity{}, now, de.Code, de.Pointer, de.Detail)
		return checkResult{refusal: &ev}
	}
	// Kept for a refusal's RequestDigest, hashed only then.
	env.Published = rec.Value
	refuse := func(key ledger.CallKey, id identity.Identity, reason, pointer, detail string) checkResult {
		ev := p.refuse(key, env, id, now, reason, pointer, detail)
		return checkResult{refusal: &ev}
	}

	if p.cfg.Identity == nil {
		unverified := ledger.CallKey{TenantID: ledger.UnverifiedTenant, IdempotencyKey: env.IdempotencyKey}
		return refuse(unverified, identity.Identity{}, ReasonAssertionPrefix+"unverifiable", "/assertion", "this intake verifies no assertions")
	}
	id, err := p.cfg.Identity.Verify(ctx, env.Assertion)
	if err != nil {
		reason := token.ReasonOf(err)
		if reason == "" {
			reason = "invalid"
		}
		var te *token.Error
		detail := "the assertion was refused"
		if errors.As(err, &te) {
			detail = te.Detail
		}
		unverified := ledger.CallKey{TenantID: ledger.UnverifiedTenant, IdempotencyKey: env.IdempotencyKey}
		// Only a tenant id the schema allows: the claim was never
		// checked against the envelope's scope, and one the store cannot
		// hold (a NUL) would fail every step of the partition.
		if lapsed, ok := errors.AsType[*identity.LapsedError](err); ok && schemas.ValidTenantID(lapsed.Identity.Tenant) {
			// Its signature proves whose it is, and only a time bound
			// refuses it (one that expired on its way here, say): the
			// refusal goes where its sender, and its tenant's
			// operators, can see it. Unless the key holds a call there
			// (a copy of an envelope already admitted, sent again or
			// redelivered after a crash): that call's events answer
			// the sender, and a refusal under its key would read as
			// its end.
			key := ledger.CallKey{TenantID: lapsed.Identity.Tenant, IdempotencyKey: env.IdempotencyKey}
			// A key that cannot be looked up fails the batch, to be
			// tried again: filed under the reserved tenant, the
			// refusal would be lost to its sender for good.
			switch cur, err := reads.get(ctx, key); {
			case errors.Is(err, processors.ErrNotFound):
				ev := p.refuse(key, env, lapsed.Identity, now, ReasonAssertionPrefix+reason, "/assertion", detail)
				// Unproven, it goes under the reserved tenant, unless
				// another copy in the batch stands for the very call
				// it copies (Step).
				return checkResult{refusal: &ev, unproven: lapsed.Unproven}
			case errors.Is(err, processors.ErrRejected):
				// The store will never take the key: asked again,
				// it would stall the partition for good.
			case err != nil:
				return checkResult{err: fmt.Errorf("look up %s for a lapsed assertion: %w", key, err)}
			case sameCall(cur, env, lapsed.Identity.User):
				// A copy of that very call: answered as its
				// duplicate, its events sent again if the log lacks
				// them. Refused, even under the reserved tenant, it
				// would end its sender's wait (ledger submit --wait
				// follows that key too) while the call runs.
				return checkResult{c: &checked{env: env, id: lapsed.Identity, standing: &cur}}
			}
		}
		res := refuse(unverified, identity.Identity{}, ReasonAssertionPrefix+reason, "/assertion", detail)
		if after, ok := identity.RetryAfter(err); ok {
			// This intake's keys cannot judge the assertion now (stale,
			// or not loaded since its kid came), not the assertion
			// wrong: refused for now, as on a stale control copy, so
			// that its sender sends it again rather than taking the
			// refusal for the call's end (a copy of a call that stands
			// included, which no key can be looked up for without a
			// tenant).
			res.refusal.RetryAfterMS = max(after, time.Millisecond).Milliseconds()
		}
		return res
	}
	if _, reserved := env.Key().Compensates(); reserved {
		// Keys of compensation calls are the ledger's: an agent's call
		// under one would pass for the undoing of another call.
		return refuse(ledger.CallKey{TenantID: refusalTenant(id), IdempotencyKey: env.IdempotencyKey}, id, ReasonReservedKey, "/idempotency_key",
			"idempotency keys ending in :compensate are reserved for the ledger's compensation calls")
	}
	c, refusal := p.checkCall(ctx, env, id, nil, now, stale, reads)
	if c != nil {
		c.sent = requestSent(rec.Timestamp, now)
	}
	return checkResult{c: c, refusal: refusal}
}

// DeadlineSkew is how far a request's record timestamp (the producer's
// clock, unless the topic stamps its append time) may lag the intake's
// clock with the call's deadline still counted from the intake's: the
// skew the credentials' verification allows too.
const DeadlineSkew = 30 * time.Second

// requestSent is when a request's deadline_ms counts from: when its
// record was published (ts) as far as the clocks let the intake tell,
// which is ts plus DeadlineSkew, or now if that is later. A request that
// waited in its partition longer than that (the intake down, a backlog)
// has that much less of its deadline left, and one past it expires
// instead of running after its agent stopped waiting, and maybe asked
// again under another key. A producer whose clock is behind by less than
// DeadlineSkew shortens nothing.
func requestSent(ts, now time.Time) time.Time {
	if ts.UnixMilli() <= 0 {
		// None: Kafka's -1, an old message format's 0, a record
		// made in process.
		return now
	}
	if start := ts.Add(DeadlineSkew); start.Before(now) {
		return start
	}
	return now
}

// checkCall runs the checks that follow the identity's: the scope against
// it, the hash, the registry, the kill switch, the arguments, the policy.
//
// stale is why the control topic's copy was too old to decide with when
// the policies were brought to its activation (syncPolicies), "" if it
// was not.
func (p *Processor) checkCall(ctx context.Context, env *ledger.Envelope, id identity.Identity, carries *schemas.Tool, now time.Time, stale string, reads *keyReads) (*checked, *ledger.Event) {
	refuse := func(key ledger.CallKey, reason, pointer, detail string) (*checked, *ledger.Event) {
		ev := p.refuse(key, env, id, now, reason, pointer, detail)
		return nil, &ev
	}
	// From here on the call is the verified tenant's: a refusal goes
	// under its key, never under the one the scope claimed.
	c := &checked{env: env, id: id, carries: carries}
	if ptr, ok := scopeMismatch(env.Scope, id); !ok {
		return refuse(ledger.CallKey{TenantID: refusalTenant(id), IdempotencyKey: env.IdempotencyKey}, ReasonScopeMismatch, ptr, "the scope disagrees with the verified assertion")
	}
	// Canonical once: the hash is of these bytes, and they are what the
	// store keeps and the tool receives. The executor reads them back
	// under the default limits (to re-check an approval, say), and
	// canonical numbers can be longer than the ones sent (1e15 is 16
	// digits): a call whose canonical arguments outgrow the limit is
	// refused here, not found unreadable at execution.
	args, err := ledger.CanonicalArguments(env.Arguments)
	if err == nil && len(args) > ledger.DefaultMaxBytes {
		err = &ledger.DecodeError{Code: ledger.CodeTooLarge, Pointer: "/arguments",
			Detail: fmt.Sprintf("canonical form %d bytes, limit %d", len(args), ledger.DefaultMaxBytes)}
	}
	var hash string
	if err == nil {
		hash, err = ledger.HashCanonicalArguments(id.Tenant, env.Tool, env.ToolVersion, args)
	}
	if err != nil {
		var de *ledger.DecodeError
		code, ptr := ReasonInvalidArguments, "/arguments"
		if errors.As(err, &de) {
			code, ptr = de.Code, de.Pointer
		}
		return refuse(c.key(), code, ptr, err.Error())
	}
	c.args = args
	if hash != env.ArgumentsHash {
		return refuse(c.key(), ReasonHashMismatch, "/arguments_hash",
			"arguments_hash is not the sha256 of the canonical (RFC 8785) {arguments, tenant_id, tool, tool_version}")
	}
	// What is validated, decided and audited is what was hashed and
	// runs: the canonical arguments, not their spelling in the envelope.
	// A number sent as 4500.0 or 4.5e3 hashes as 4500, and the schema
	// takes it for that integer, while a policy reading the spelling
	// would not see an amount at all.
	if c.tree, err = ledger.Decode(args, ledger.Limits{}); err != nil {
		return refuse(c.key(), ReasonInvalidArguments, "/arguments", err.Error())
	}
	tool, err := p.cfg.Registry.Lookup(env.Tool, env.ToolVersion)
	switch {
	case errors.Is(err, schemas.ErrUnknownVersion):
		return p.refuseUnlessResent(ctx, reads, c, now, ReasonUnknownToolVersion, "/tool_version", err.Error())
	case err != nil:
		return p.refuseUnlessResent(ctx, reads, c, now, ReasonUnknownTool, "/tool", err.Error())
	}
	c.tool = tool
	if p.cfg.Freezes != nil {
		// The freeze read below is only as good as the copy it reads:
		// its freshness is taken right before it (the copy only moves
		// forward), since the step's checks before (an assertion's key
		// refresh, say) can outlast the bound, and a copy that caught up
		// by the decision's check would hide that it missed a freeze
		// here. A stale copy decides nothing (below).
		if stale == "" {
			stale = p.controlStale()
		}
		// A key already used is a resent call, which the store answers
		// whatever the freeze: refused tool_frozen, its agent would take
		// a call that stands (its approval pending, say, and run after
		// the unfreeze) for refused, and might send it again under
		// another key. The executor holds it back while it is frozen.
		// A store read for each call to a frozen tool: refusing them is
		// bounded by the store's reads while the freeze lasts; one the
		// store does not answer within keyStandsTimeout is refused for
		// now.
		// A stale copy's freeze is not told either: it may have been
		// lifted since (an agent told tool_frozen stops sending), and
		// the stale copy refuses the call for now all the same.
		if a, frozen := p.cfg.Freezes.Frozen(tool.Name, id.Tenant); frozen && stale == "" {
			switch stands, err := p.keyLookup(ctx, reads, c.key(), "a call to a frozen tool"); {
			case err != nil:
				// Not known whether it stands: refused for now, to be
				// sent again, not as a new call would be.
				ev := p.retryLater(c, policy.Decision{}, now, ReasonToolFrozen,
					control.FrozenDetail(tool.Name, a)+"; whether a call stands under the key could not be read: send it again", p.cfg.PolicyRetryAfter)
				return nil, &ev
			case !stands:
				return refuse(c.key(), ReasonToolFrozen, "/tool", control.FrozenDetail(tool.Name, a))
			}
		}
	}
	if err := tool.Validate(c.tree); err != nil {
		var ve *schemas.ValidationError
		ptr, detail := "/arguments", err.Error()
		if errors.As(err, &ve) {
			ptr, detail = "/arguments"+ve.Pointer, ve.Reason
		}
		return p.refuseUnlessResent(ctx, reads, c, now, ReasonInvalidArguments, ptr, detail)
	}
	caller := policy.Caller{Tenant: id.Tenant, User: id.User, Agent: id.Agent, Purpose: id.Purpose, Roles: id.Roles}
	if stale == "" {
		// Fresh when the policies were synced, and still, now that the
		// call is decided: the step's checks before (an assertion's
		// key refresh, say) can outlast the bound.
		stale = p.controlStale()
	}
	if stale == "" && p.cfg.SyncPolicies != nil {
		// And the policies brought again to what that copy activates,
		// read after it was found fresh: an activation it applied
		// while the step checked its calls decides the calls decided
		// after it. Nothing to do for the engine when none did.
		p.cfg.SyncPolicies()
	}
	if stale != "" {
		// An activation not yet read may deny the call: deciding it
		// under the version this copy last saw would not honour it.
		c.decision = policy.Decision{Reason: ReasonControlStale, Detail: stale}
	} else {
		req := policy.NewRequest(tool, caller, c.tree, p.cfg.Channel, now)
		if carries != nil {
			req.AuditAlso = []string{carries.Name}
		}
		c.decision = p.cfg.Policy.Decide(ctx, req)
	}
	if c.decision.Transient() || c.decision.Reason == ReasonControlStale {
		// The engine could not decide (a stall, no set), or not with
		// the policy version in force (a stale copy of the control
		// topic): that says nothing about the call, so it must not use
		// the key up as a denial would. Fail closed for now only; but a
		// key already used is a resent call, which the store answers (a
		// duplicate, its events sent again, or a key reused), whatever
		// the decision now: "retry later" would deny a call that stands.
		if p.keyStands(ctx, reads, c.key(), "a call the policies could not decide") {
			return c, nil
		}
		ev := p.retryLater(c, c.decision, now, c.decision.Reason, c.decision.Detail, p.cfg.PolicyRetryAfter)
		return nil, &ev
	}
	return c, nil
}

// keyStands reports whether the store holds a call under key: the call
// checked (what, for the log) is then a resent one, which the store
// answers, whatever holds for a new call now. A key that cannot be looked
// up (reads) counts as free.
func (p *Processor) keyStands(ctx context.Context, reads *keyReads, key ledger.CallKey, what string) bool {
	stands, _ := p.keyLookup(ctx, reads, key, what)
	return stands
}

// keyLookup is keyStands, with the error of a lookup that failed.
func (p *Processor) keyLookup(ctx context.Context, reads *keyReads, key ledger.CallKey, what string) (bool, error) {
	_, err := reads.get(ctx, key)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, processors.ErrNotFound):
		return false, nil
	}
	p.cfg.Logger.Warn(what+": its key could not be looked up", "call_key", key.String(), "err", err)
	return false, err
}

// keyStandsTimeout bounds a read of a key that may hold a resent call
// (keyReads): a store that does not answer holds up the step no longer.
const keyStandsTimeout = 2 * time.Second

// keyReads are the reads of keys that may hold a resent call that one
// batch's checks make (keyStands, refuseUnlessResent, a lapsed copy's
// lookup). Each has keyStandsTimeout; once one ran out, the store is taken
// for hung and the batch's later ones fail at once, so that a flood of
// such envelopes costs the batch one timeout, not one an envelope. (A
// shared deadline instead would be spent by whatever else the checks
// wait for first, a key set's refresh, and fail reads that would have
// answered.)
type keyReads struct {
	store interface {
		Get(ctx context.Context, key ledger.CallKey) (processors.Record, error)
	}
	hung atomic.Bool
}

// errStoreHung: an earlier read of the batch ran out of its time.
var errStoreHung = errors.New("intake: a read of this batch's found the store not answering within its time")

// get reads key within keyStandsTimeout, unless a read of the batch ran
// out already.
func (r *keyReads) get(ctx context.Context, key ledger.CallKey) (processors.Record, error) {
	if r.hung.Load() {
		return processors.Record{}, fmt.Errorf("read %s: %w", key, errStoreHung)
	}
	rctx, cancel := context.WithTimeout(ctx, keyStandsTimeout)
	defer cancel()
	rec, err := r.store.Get(rctx, key)
	if err != nil && errors.Is(rctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil {
		r.hung.Store(true)
	}
	return rec, err
}

// sameCall reports whether cur, the record under an envelope's key, is
// the call env carries for user: the store would answer env as its
// duplicate (processors.Admission.Answer).
func sameCall(cur processors.Record, env *ledger.Envelope, user string) bool {
	a := processors.Admission{ArgumentsHash: env.ArgumentsHash, UserID: user}
	return a.Answer(cur) == processors.Duplicate
}

// refuseUnlessResent refuses c for reason, unless its key holds that very
// call (c.standing, answered by the store): a check that depends on this
// intake's registry (the tool, its version, its schema) says nothing of a
// call another intake admitted by its own, mid-deploy, or this one before
// its registry changed, and refused under its key it would read as the
// end of a call that runs. A key that cannot be read (reads) is refused
// for now.
func (p *Processor) refuseUnlessResent(ctx context.Context, reads *keyReads, c *checked, now time.Time, reason, pointer, detail string) (*checked, *ledger.Event) {
	switch cur, err := reads.get(ctx, c.key()); {
	case err == nil && sameCall(cur, c.env, c.user()):
		c.standing = &cur
		return c, nil
	case err != nil && !errors.Is(err, processors.ErrNotFound):
		p.cfg.Logger.Warn("a call refused "+reason+": its key could not be looked up", "call_key", c.key().String(), "err", err)
		ev := p.retryLater(c, policy.Decision{}, now, reason, detail+"; whether the call stands under its key could not be read: send it again", p.cfg.PolicyRetryAfter)
		return nil, &ev
	}
	ev := p.refuse(c.key(), c.env, c.id, now, reason, pointer, detail)
	return nil, &ev
}

// maxVersionReads bounds the resource versions a step reads at once.
const maxVersionReads = 16

// readVersions reads, all at once and within one VersionTimeout for the
// batch, the versions of the resources of the calls in calls that must
// wait for an approval, their keys free, onto their checked.version: the
// step waits for them, so a version endpoint that does not answer costs the batch a
// VersionTimeout, not one a call. A version not read in time is left
// out, logged (the approval then binds the version it finds).
func (p *Processor) readVersions(ctx context.Context, calls []*checked) {
	if p.cfg.Versions == nil {
		return
	}
	var waiting []*checked
	for _, c := range calls {
		if d := c.decision; d.Allow && d.Obligations.RequireApproval && c.tool.ResourceVersion != nil {
			waiting = append(waiting, c)
		}
	}
	if len(waiting) == 0 {
		// Most steps: no timer, no goroutine.
		return
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.VersionTimeout)
	defer cancel()
	var wg sync.WaitGroup
	slots := make(chan struct{}, maxVersionReads)
	for _, c := range waiting {
		wg.Go(func() {
			select {
			case slots <- struct{}{}:
				defer func() { <-slots }()
			case <-ctx.Done():
			}
			// Not for a resend, which the store answers: a version
			// endpoint that hangs would hold up every step with one,
			// every tenant's calls in it, for nothing. Looked up with
			// the reads, within their time.
			if p.keyStands(ctx, &keyReads{store: p.cfg.Store}, c.key(), "a call waiting for an approval") {
				return
			}
			// The kill switch is asked again as the read is made: a
			// freeze that landed since the call's check (the batch's
			// other checks, the key's lookup) reads nothing at the
			// tool, as neither the approvals' reads nor the
			// executor's do; nor does a copy of the control topic not
			// known current. The approval binds the version it finds.
			if p.cfg.Freezes != nil {
				if stale := p.controlStale(); stale != "" {
					p.cfg.Logger.Info("resource version not read at the request: "+stale, "call_key", c.key().String(), "tool", c.tool.Name)
					return
				}
				if _, frozen := p.cfg.Freezes.Frozen(c.tool.Name, c.id.Tenant); frozen {
					p.cfg.Logger.Info("resource version not read at the request: the tool was frozen since the call's check", "call_key", c.key().String(), "tool", c.tool.Name)
					return
				}
			}
			v, _, err := processors.ResourceVersion(ctx, p.cfg.Versions, p.base, c.tool, c.tree, c.id.Tenant)
			if err != nil {
				p.cfg.Logger.Warn("resource version unread at the request; its approval will bind the version it finds",
					"call_key", c.key().String(), "tool", c.tool.Name, "err", err)
				return
			}
			c.version = v
		})
	}
	wg.Wait()
}

// Submit runs a call that the ledger itself makes for an authenticated
// identity (a compensation an operator asked for) through every check but
// the assertion's, the same policies, and the store. It returns the events
// to append: the call's first events, or a refusal, or nothing for a
// retry the log already has. The caller appends them and then marks them
// logged; until then they wait in the store's outbox, which the
// executor's sweep appends if the caller does not. carries, for a call
// that carries another call's arguments (a compensation carries the
// undone call's), is that call's tool: the audit copy also hides what
// its registry entry redacts and what the policies in force mask for it;
// nil for none. why, the asker's reason, is the requested event's Detail,
// so that the call's trace says why the ledger made it.
func (p *Processor) Submit(ctx context.Context, env *ledger.Envelope, id identity.Identity, carries *schemas.Tool, why string) ([]ledger.Event, error) {
	now := p.cfg.Now().UTC()
	stale := p.syncPolicies()
	c, refusal := p.checkCall(ctx, env, id, carries, now, stale, &keyReads{store: p.cfg.Store})
	if refusal != nil {
		return []ledger.Event{*refusal}, nil
	}
	c.own, c.why = true, why
	p.readVersions(ctx, []*checked{c})
	recs, _, _, _, err := p.settle(ctx, []*checked{c}, now)
	if err != nil {
		return nil, err
	}
	evs := make([]ledger.Event, len(recs))
	for i, r := range recs {
		if evs[i], err = ledger.DecodeEvent(r.Value); err != nil {
			return nil, err
		}
	}
	return evs, nil
}

// scopeMismatch compares the envelope's claims with the verified identity.
// A claim may be left out; one that is present must agree.
func scopeMismatch(s ledger.Scope, id identity.Identity) (pointer string, ok bool) {
	switch {
	case s.TenantID != id.Tenant:
		return "/scope/tenant_id", false
	case s.UserID != "" && s.UserID != id.User:
		return "/scope/user_id", false
	case s.OnBehalfOf != "" && s.OnBehalfOf != id.User:
		return "/scope/on_behalf_of", false
	case s.Purpose != "" && id.Purpose != "" && s.Purpose != id.Purpose:
		return "/scope/purpose", false
	}
	return "", true
}

// rates is what admitting c charges, or nil: an allowed call draws on the
// bucket of each of its rate_limit obligations, one per deciding policy
// with a limit, in the decision's order; all of them or, refused, none. A
// call whose deadline passed DeadlineSkew before now charges nothing.
func (p *Processor) rates(c *checked, now time.Time) []processors.RateRequest {
	rls := c.decision.Obligations.RateLimits
	if !c.decision.Allow || len(rls) == 0 {
		return nil
	}
	if d := c.env.Deadline(cmp.Or(c.sent, now)); !d.IsZero() && !d.Add(DeadlineSkew).After(now) {
		// Dead on arrival (it waited in its partition past its
		// deadline): it will expire, not run, and must not take the
		// budget of the tenant's live calls behind it. Dead by the
		// clocks' skew at least: the executor decides on its own
		// clock, and a call dead here by less (its deadline_ms and
		// record time are the agent's to choose) might run there,
		// uncharged.
		return nil
	}
	rs := make([]processors.RateRequest, len(rls))
	for i, rl := range rls {
		rs[i] = processors.RateRequest{Bucket: rateBucket(c.id, c.tool.Name, rl), Limit: rl.N, Window: rl.Per, Cost: 1}
	}
	return rs
}

// limitedDetail says which of c's rate limits refused it: those whose
// buckets refused (a refusal has a RetryAfter), from res, the store's
// answers to rates(c) in their order. The others had room, and were not
// charged either.
func limitedDetail(c *checked, res []processors.RateResult) string {
	var by []string
	for i, rl := range c.decision.Obligations.RateLimits {
		if i < len(res) && res[i].RetryAfter > 0 {
			by = append(by, fmt.Sprintf("at most %s for %s in tenant %s under policy %s", rl, c.tool.Name, c.id.Tenant, rl.Policy))
		}
	}
	return strings.Join(by, "; ")
}

// rateBucket names the budget a call by id under rl draws on: the
// verified tenant's (never one the arguments name), or within it the
// verified user's or agent's (rl.By), for the tool, under the policy that
// set the limit, at that limit. So permits with different limits, or
// different permits with the same one, never share a budget, and a
// limit changed in a new policy version starts a budget of its own. The
// tenant and the tool hold no "/" (the envelope schema and the registry
// see to it), the limit has one ("20/m", "20/m by user"), a user's or
// agent's part is hexadecimal (the first half of the SHA-256 of their
// id, which may hold anything, and is kept out of the store's bucket
// names), and the policy id comes last, as it is: the name is
// unambiguous. A policy id the name cannot hold as it is (too long, not
// UTF-8, a NUL) is replaced by its SHA-256.
func rateBucket(id identity.Identity, tool string, rl policy.RateLimit) string {
	prefix := id.Tenant + "/" + tool + "/" + rl.String() + "/"
	whose, by := "", true
	switch rl.By {
	case policy.RateByUser:
		whose = id.User
	case policy.RateByAgent:
		whose = id.Agent
	default:
		by = false
	}
	if by {
		sum := sha256.Sum256([]byte(whose))
		prefix += hex.EncodeToString(sum[:16]) + "/"
	}
	b := prefix + rl.Policy
	if len(b) > processors.MaxRateBucketLen || !utf8.ValidString(b) || strings.ContainsRune(b, 0) {
		sum := sha256.Sum256([]byte(rl.Policy))
		b = prefix + "sha256:" + hex.EncodeToString(sum[:])
	}
	return b
}

// syncPolicies brings the policies to the activation the control
// topic's copy holds, and says why that copy is too old to decide with
// ("" when it is not), as it was before: a copy that catches up after
// the policies were brought to it, while the calls are checked, must not
// pass them decided with the version it held when stale. Each call is
// checked again when it is decided (checkCall).
func (p *Processor) syncPolicies() (stale string) {
	stale = p.controlStale()
	if p.cfg.SyncPolicies != nil {
		p.cfg.SyncPolicies()
	}
	return stale
}

// controlStale says why the copy of the control topic is too old to
// decide with, or "" when it is not.
func (p *Processor) controlStale() string {
	if p.cfg.Freezes == nil || p.cfg.ControlMaxStaleness < 0 {
		return ""
	}
	switch st := p.cfg.Freezes.Staleness(); {
	case st < 0:
		return "this intake has not yet read the control topic (the policy version activated, the freezes)"
	case st > p.cfg.ControlMaxStaleness:
		return fmt.Sprintf("this intake's copy of the control topic (the policy version activated, the freezes) is %s old, more than %s", st.Round(time.Millisecond), p.cfg.ControlMaxStaleness)
	}
	return ""
}

// retryLater refuses a checked call for now: a refusal (seq 0) that
// leaves its key free, says when to try again (retry_after_ms, at least
// 1) and names the policies and version of d, the decision that refused.
// A rate limit and a policy that could not decide both refuse so; agents
// and the compensation requests retry on retry_after_ms.
func (p *Processor) retryLater(c *checked, d policy.Decision, now time.Time, reason, detail string, after time.Duration) ledger.Event {
	ev := p.refuse(c.key(), c.env, c.id, now, reason, "", detail)
	ev.RetryAfterMS = max(after.Milliseconds(), 1)
	p.decorate(&ev, d)
	return ev
}

// decorate puts the decision's policy fields on an event.
func (p *Processor) decorate(ev *ledger.Event, d policy.Decision) {
	ev.PolicyID = d.PolicyIDs
	ev.PolicyVersion = d.Version
	ev.Obligations = d.Obligations.List()
}

// admission builds a decided call's record: the events the call starts
// with go into the outbox.
func (p *Processor) admission(c *checked, now time.Time) (processors.Admission, error) {
	env, tool, d, args := c.env, c.tool, c.decision, c.args
	// The audit copy hides what the registry says to hide and what any
	// policy masks for the tool, whatever the decision: a denial carries
	// no obligations, and a denied call's arguments go to the same log,
	// projections and console as an allowed one's.
	hide := append(append(append([]string(nil), tool.Redact...), d.AuditMask...), d.Obligations.Mask...)
	if c.carries != nil {
		hide = append(hide, c.carries.Redact...)
	}
	audit := c.tree
	if len(hide) > 0 {
		// Redact copies; nothing below writes to the tree, so only when
		// it hides.
		audit = ledger.Redact(c.tree, hide)
	}
	redacted, err := ledger.Canonical(audit)
	if err != nil {
		return processors.Admission{}, err
	}
	// The resource is read from the audit copy, so that a redacted
	// resource stays redacted in every event.
	var resource string
	if tool.Resource != "" {
		if v, ok := ledger.ResourceOf(audit, tool.Resource); ok {
			resource = v
		}
	}
	deadline := env.Deadline(cmp.Or(c.sent, now))
	requested := p.event(c, now, statemachine.EventRequested, 1)
	requested.Arguments = json.RawMessage(redacted)
	requested.Resource = resource
	requested.Detail = c.why
	if !deadline.IsZero() {
		requested.DeadlineAt = &deadline
	}

	decision := p.event(c, now, statemachine.EventAuthorized, 2)
	decision.Resource = resource
	p.decorate(&decision, d)
	decision.Reason = d.Reason
	status := processors.StatusAuthorized
	switch {
	case !d.Allow:
		decision.Type = statemachine.EventDenied
		decision.Decision = "deny"
		decision.Detail = d.Detail
		status = processors.StatusDenied
	case d.Obligations.RequireApproval:
		decision.Type = statemachine.EventApprovalPending
		decision.Decision = "require_approval"
		expires := now.Add(p.cfg.ApprovalTTL)
		if !deadline.IsZero() && deadline.Before(expires) {
			expires = deadline
		}
		decision.ExpiresAt = &expires
		decision.ApprovalID = c.key().ApprovalID()
		decision.ResourceVersion = c.version
		decision.Reason = ReasonApprovalRequired
		status = processors.StatusPending
	default:
		decision.Decision = "allow"
	}
	outbox, recs, err := ledger.EncodeOutbox([]ledger.Event{requested, decision}, p.cfg.Topics.Events)
	if err != nil {
		return processors.Admission{}, err
	}
	return processors.Admission{
		Key:           c.key(),
		CallID:        env.CallID,
		ArgumentsHash: env.ArgumentsHash,
		UserID:        c.user(),
		Tool:          env.Tool,
		ToolVersion:   env.ToolVersion,
		ToolDigest:    tool.Digest(),
		Arguments:     args,
		DeadlineAt:    deadline,
		Status:        status,
		Seq:           2,
		Outbox:        outbox,
		Records:       recs,
	}, nil
}

// event returns an event of a checked call: who asks is the verified
// identity's.
func (p *Processor) event(c *checked, now time.Time, t statemachine.EventType, seq int64) ledger.Event {
	ev := envelopeEvent(c.env, p.cfg.Actor, now, t, seq)
	ev.TenantID = c.id.Tenant
	ev.UserID = c.id.User
	ev.AgentID = c.id.Agent
	ev.Purpose = c.id.Purpose
	// The roles the policies were given, so that the executor's
	// decision of an approved call gives them the same.
	ev.Roles, ev.RolesGiven = c.decision.Roles, c.decision.RolesGiven
	ev.Channel = p.cfg.Channel
	// The definition the call is admitted under (Admission.ToolDigest):
	// every later event copies it from these.
	ev.ToolDigest = c.tool.Digest()
	return ev
}

// envelopeEvent returns an event with what the envelope itself says.
func envelopeEvent(env *ledger.Envelope, actor string, now time.Time, t statemachine.EventType, seq int64) ledger.Event {
	return ledger.Event{
		EventID:        newEventID(),
		Type:           t,
		Seq:            seq,
		At:             now,
		Actor:          actor,
		TenantID:       env.Scope.TenantID,
		IdempotencyKey: env.IdempotencyKey,
		CallID:         env.CallID,
		Tool:           env.Tool,
		ToolVersion:    env.ToolVersion,
		ArgumentsHash:  env.ArgumentsHash,
		TraceID:        env.TraceID,
	}
}

// refuse records a refused submission: one denied event at seq 0, under
// key, that leaves any call under that key untouched. id is the verified
// identity of the submission (zero before one is verified): who was
// refused is what a responder asks first (who tried to cross tenants,
// whose agent exhausts a rate budget).
func (p *Processor) refuse(key ledger.CallKey, env *ledger.Envelope, id identity.Identity, now time.Time, reason, pointer, detail string) ledger.Event {
	ev := envelopeEvent(env, p.cfg.Actor, now, statemachine.EventDenied, 0)
	ev.TenantID, ev.IdempotencyKey = key.TenantID, key.IdempotencyKey
	ev.UserID, ev.AgentID, ev.Purpose = id.User, id.Agent, id.Purpose
	ev.Decision = "deny"
	ev.Reason = reason
	ev.Pointer = boundPointer(pointer, maxRefusalPointer)
	ev.Detail = boundDetail(detail, maxRefusalDetail)
	if env.Published != nil {
		// The copy refused: another copy of the call (its call id sent
		// again) is refused or admitted on its own, and its sender
		// must not take this refusal for its answer.
		ev.RequestDigest = ledger.RequestDigest(env.Published)
	}
	return ev
}

// Bounds of a refusal's pointer and detail. Both may quote member names of
// the envelope, which can be as long as the envelope (and every JSON
// encoder escapes some characters six-fold): unbounded, a refusal could
// outgrow a Kafka record and stall the intake's partition behind it.
const (
	maxRefusalPointer = 1 << 10
	maxRefusalDetail  = 1 << 10
)

// boundPointer returns the longest prefix of the JSON pointer p made of
// whole reference tokens and at most n bytes long: the pointer of an
// ancestor of the offending member, which still holds it ("" is the whole
// envelope).
func boundPointer(p string, n int) string {
	for len(p) > n {
		i := strings.LastIndexByte(p, '/')
		if i < 0 {
			return ""
		}
		p = p[:i]
	}
	return p
}

// boundDetail cuts s to at most n bytes, on a rune boundary, and says so.
func boundDetail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = " [cut]"
	cut := n - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

func newEventID() string {
	// NewV7 fails only if the system's random source does.
	return uuid.Must(uuid.NewV7()).String()
}

// Loop returns the intake on a consume-process-produce loop. lc's Group
// defaults to "ledger-intake", its Topics to the request topic, and its
// TransactionalID to "<group>-" + the actor.
func (p *Processor) Loop(lc ledger.LoopConfig) (*ledger.Loop, error) {
	if lc.Group == "" {
		lc.Group = "ledger-intake"
	}
	if len(lc.Topics) == 0 {
		lc.Topics = []string{p.cfg.Topics.Requests}
	}
	if lc.TransactionalID == "" {
		lc.TransactionalID = lc.Group + "-" + p.cfg.Actor
	}
	if lc.Logger == nil {
		lc.Logger = p.cfg.Logger
	}
	if lc.Skipped == nil {
		// A batch of requests skipped unread for its size is on the
		// DLQ, as a request that cannot be read is.
		max := cmp.Or(lc.MaxBatchBytes, ledger.DefaultMaxBatchBytes)
		lc.Skipped = func(topic string, partition int32, from, next int64) []*kgo.Record {
			return []*kgo.Record{ledger.DLQBatchRecord(p.cfg.Topics.DLQ, topic, partition, from, next, max)}
		}
	}
	return ledger.NewLoop(lc, p.Step)
}
