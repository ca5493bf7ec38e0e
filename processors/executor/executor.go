// Package executor runs authorized calls exactly once (DESIGN §5): it claims
// each call in the execution store under a lease and a fencing epoch, runs
// the tool through its breaker, bulkhead and deadline with the idempotency
// key passed downstream, records the outcome in the store, and only then
// appends executing + the terminal event in a short Kafka transaction.
//
// What "once" rests on, step by step:
//   - the claim commits before the tool is called, so a redelivered
//     authorized event finds the call executing or done and does not run it
//     again;
//   - a claim whose owner died mid-call is found by its expired lease (on
//     redelivery or by the periodic sweep): an idempotency-native tool runs
//     again with the same downstream key, any other tool goes to
//     outcome_unknown for the reconciler, because whether it ran is unknown;
//   - only the holder of the current epoch may complete a call, so an owner
//     that lost its lease cannot overwrite the outcome;
//   - the outcome's events sit in the record's outbox until the log has
//     them, so a crash between the store and the log loses nothing;
//   - a call that outlives its step's budget is carried over: the
//     authorized event's offset commits before the call ends (with the
//     next transaction, when the step recorded nothing), which the
//     durable claim makes safe (a crash leaves the lease to expire and the
//     sweep to reclaim, as above), and the outcome is recorded and
//     appended by a later step, or, at shutdown, recorded by the call
//     itself and appended from the outbox by the sweep;
//   - under load (events already fetched for the next step) a step does
//     not wait for the calls it starts: the next step records those that
//     ended while it claims its own batch, in a second store transaction
//     on other calls. That is the carry-over above, taken early; a step
//     with nothing fetched waits for every call left running, so an
//     outcome never waits for a poll's tick.
package executor

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/sony/gobreaker/v2"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/failpoint"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/compensation"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/processors/tracing"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Store is the part of the execution store the executor uses.
type Store interface {
	Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error)
	Complete(ctx context.Context, cs []processors.Completion) ([]bool, error)
	Release(ctx context.Context, rs []processors.Release) ([]bool, error)
	MarkLogged(ctx context.Context, ls []processors.Logged) error
	Settle(ctx context.Context, journals []string, logged bool) error
	ExpiredAfter(ctx context.Context, after processors.Cursor, limit int) ([]processors.Record, error)
	Unlogged(ctx context.Context, olderThan time.Duration, after processors.Cursor, limit int) ([]processors.Record, error)
	Move(ctx context.Context, ms []processors.Move) ([]bool, error)
	MarkUndo(ctx context.Context, key ledger.CallKey, undoable []processors.Status) (processors.Status, bool, error)
	Get(ctx context.Context, key ledger.CallKey) (processors.Record, error)
}

// Minter mints the short-lived credential of one execution. The token
// goes only to the tool's adapter.
type Minter interface {
	Mint(g credentials.Grant) (credentials.Credential, error)
	// KeyEpoch is the epoch of the key that signs now, which names the
	// family (credentials.FamilyOf) a claim records.
	KeyEpoch() int64
}

// Freezes says whether the kill switch froze a tool, for all tenants or
// for one; asked right before each request leaves. Current returns nil
// once the answers are known to include every freeze made up to
// maxStaleness ago, and an error if ctx ends first.
type Freezes interface {
	Frozen(tool, tenant string) (control.Action, bool)
	Current(ctx context.Context, maxStaleness time.Duration) error
	// CurrentAsOf returns nil once every action committed before t is
	// known (control.State.CurrentAsOf).
	CurrentAsOf(ctx context.Context, t time.Time) error
	// Revoked returns the revocation of jti or of family, if any.
	Revoked(jti, family string) (control.Action, bool)
}

// heldBack is an attempt that a check right before its request would
// leave stopped: nothing was sent. why is the reason (and error code) it
// gives the call.
type heldBack struct {
	why string
	// decision, for an approved call the policies in force deny before
	// a retry, is their decision.
	decision *policy.Decision
	// freeze, for a request a freeze held back, is the freeze the check
	// saw: read again, it may be lifted by then, and name none.
	freeze *control.Action
}

// frozenBy is the hold of a request that freeze a stopped.
func frozenBy(a control.Action) *heldBack { return &heldBack{why: ReasonToolFrozen, freeze: &a} }

func (h *heldBack) Error() string { return "request held back: " + h.why }

var (
	// errApprovalLapsed: an approved call's approval expired before an
	// attempt was sent (I4: no request of it leaves past its expiry).
	errApprovalLapsed = &heldBack{why: ReasonApprovalExpired}
	// errCredentialRotated and errCredentialLate: the call's credential
	// would expire before its request could land, and could not be
	// minted again, the signing key having rotated since the claim named
	// its family, or too little of the call's time being left for one
	// (credentials expire on whole seconds): sent, the tool would refuse
	// it (401).
	errCredentialRotated = &heldBack{why: "credential_key_rotated"}
	errCredentialLate    = &heldBack{why: "credential_late"}
	// errRevoked: the family of the call's credential was revoked before
	// an attempt was sent: the tools would refuse it (401).
	errRevoked = &heldBack{why: ReasonCredentialRevoked}
	// errNoSlotInLease: the wait for a slot of the tool's bulkhead took
	// the claim's lease (not the call's deadline), before the attempt
	// was sent.
	errNoSlotInLease = errors.New("no bulkhead slot within the claim's lease")
	// errStaleInLease: the wait for a copy of the control topic known
	// current took the claim's lease (not the call's deadline), or most
	// of what it left the attempt, before the attempt was sent.
	errStaleInLease = errors.New("control state not current within the claim's lease")
	// errJTIRevoked: the call's jti was, which the tools refuse for good.
	errJTIRevoked = &heldBack{why: ReasonJTIRevoked}
)

// Secrets hands out the long-lived secrets tool backends demand.
type Secrets interface {
	Secret(name string) (string, error)
}

// errNoKeystore: a tool demands a backend secret, and no Secrets is
// configured.
var errNoKeystore = errors.New("no keystore for the tool's backend secret")

// backendSecret is the long-lived secret tool's backend demands, if it
// demands one, from secrets. The error names the secret, never its value.
func backendSecret(secrets Secrets, tool *schemas.Tool) (string, error) {
	ref := tool.Backend.SecretRef
	switch {
	case ref == "":
		return "", nil
	case secrets == nil:
		return "", fmt.Errorf("%w (secret_ref %s)", errNoKeystore, ref)
	}
	sec, err := secrets.Secret(ref)
	if err != nil {
		return "", fmt.Errorf("backend secret %s: %w", ref, err)
	}
	return sec, nil
}

// Decider decides a call with the active policies, failing closed.
type Decider interface {
	Decide(ctx context.Context, r policy.Request) policy.Decision
}

// Caller calls a tool over its transport. Implementations are safe for
// concurrent use and honour ctx's deadline.
type Caller interface {
	Call(ctx context.Context, r httptool.Request) (httptool.Response, error)
}

// Reasons and error codes the executor gives.
const (
	ReasonLeaseExpired     = "lease_expired_mid_call"
	ReasonDeadlineExceeded = "deadline_exceeded"
	// ReasonToolFailed: a read tool answered 5xx, or nothing, to every
	// attempt.
	ReasonToolFailed        = "tool_failed"
	ReasonToolRefused       = "tool_refused"
	ReasonOutcomeAmbiguous  = "outcome_ambiguous"
	ReasonUnavailable       = "tool_unavailable"
	ReasonArgumentIntegrity = "arguments_integrity"
	ReasonUnknownTool       = "unknown_tool"
	// ReasonOtherDefinition: the executor's registry defines the call's
	// tool version otherwise than the intake's that admitted it
	// (schemas.ErrOtherDefinition); nothing was sent.
	ReasonOtherDefinition = "tool_defined_otherwise"
	ReasonNoCredential    = "credential_unavailable"
	// ReasonResourceChanged: the approved call's resource changed since
	// the approval: denied when the executor's read finds it, failed
	// (code http_412) when the tool does, refusing the If-Match the
	// approved version went with.
	ReasonResourceChanged = "resource_changed"
	// ReasonVersionUnreadable: the approved call's resource version could
	// not be read to confirm it: given back, and checked again later (a
	// taken-over call goes to outcome_unknown with it, as
	// reclaimed_resource_version_unreadable).
	ReasonVersionUnreadable = "resource_version_unreadable"
	// ReasonNothingToUndo: a compensation whose call turned out to have
	// had no effect.
	ReasonNothingToUndo = "nothing_to_undo"
	// ReasonToolFrozen: an operator froze the tool before the call started.
	ReasonToolFrozen = "tool_frozen"
	// CodeControlStale: no request left because the kill switch's state
	// was not known to be current until the call's deadline.
	CodeControlStale = "control_state_stale"
	// CodeResultUnmaskable: a succeeded call whose result is kept without
	// its content, since the masks its policy or tool asks for could not
	// be applied to it (not a tree ledger.Decode reads).
	CodeResultUnmaskable = "result_unmaskable"
	// CodeResultLost: a succeeded call whose answer's body was lost on
	// the way after its 2xx status line (cut, or past the tool's
	// timeout): kept without content.
	CodeResultLost = "result_lost"
	// CodeResultHoldsSecret: a succeeded call whose result is kept
	// without its content, since it holds a secret the request carried
	// (the call's credential, the backend's secret): a tool that echoes
	// its request's headers, say. Neither is ever to reach the agent.
	CodeResultHoldsSecret = "result_holds_secret"
	// ReasonApprovalExpired: the approval's time ran out before the call
	// could run.
	ReasonApprovalExpired = "approval_expired"
)

// Config configures an executor.
type Config struct {
	// Registry of tools. Required.
	Registry *schemas.Registry
	// Store is the execution store. Required.
	Store Store
	// Caller reaches the tools. Required.
	Caller Caller
	// Credentials mints each execution's credential (sent as
	// Authorization: Bearer). Nil sends none, for tools that need none.
	Credentials Minter
	// Versions reads resource versions: an approved call whose resource
	// changed since the approval is denied (resource_changed). Nil skips
	// the check.
	Versions processors.VersionReader
	// Secrets holds the backends' long-lived secrets (registry
	// backend.secret_ref). A tool that names one fails without it.
	Secrets Secrets
	// Freezes, when set, stops calls to a frozen tool that have not
	// started yet (denied, tool_frozen), however long ago they were
	// authorized; calls already in flight finish or time out.
	Freezes Freezes
	// RevocationSkew is how long after a credential family's revocation
	// the tools still refuse the family's credentials (control's
	// Config.RevocationSkew, the clocks' allowance): a call that would
	// mint one then is given back until the window passed, rather than
	// sent to be refused. Zero: credentials.DefaultSkew.
	RevocationSkew time.Duration
	// ControlMaxStaleness is how old Freezes may be when a request
	// leaves: a request waits, up to its call's deadline or its claim's
	// lease, for a copy known to hold every freeze made up to this long
	// ago. A call whose deadline ends the wait fails, code
	// control_state_stale; one whose lease ends it first, having sent
	// nothing, is given back (processors.Store.Release) for
	// RetryBackoff, to be claimed again. Zero:
	// control.DefaultMaxStaleness; negative: not checked.
	ControlMaxStaleness time.Duration
	// Policy decides an approved call again right before it runs, with
	// the policies in force then: a newer version that denies wins. Nil
	// skips the re-check. A re-check the policies cannot answer
	// (policy.Decision.Transient: a timeout, no
	// active set) denies nothing: nothing is sent, and the claim is given
	// back (processors.Store.Release) for RetryBackoff, after which the
	// sweep of expired leases (SweepEvery) claims the call again, until
	// the policies answer, the approval expires or the call's deadline
	// passes. A claim the store fails to take back is held and asked
	// again (releaseHeld; Drain asks last); another executor may take the
	// call over once its lease lapses, as one that may have been sent. A
	// taken-over call is not given back (its first owner may have sent
	// it): its outcome is left to the reconciler, as for any other
	// refusal.
	Policy Decider
	// BaseURL resolves tools' relative backend URLs. Required when any
	// tool's URL is relative.
	BaseURL string
	// Topics; defaults as ledger.Topics.
	Topics ledger.Topics
	// Owner names this instance in leases and events; default
	// "executor-<hostname>-<pid>". It must differ between live instances.
	Owner string
	// MaxAttempts bounds tool invocations per claim; default 3. Retries
	// stay inside executing as numbered attempts.
	MaxAttempts int
	// RetryBackoff is the first pause between attempts, doubled each
	// time; default 100ms.
	RetryBackoff time.Duration
	// FrozenRecheck is how long a call that a decision stands behind (an
	// approval, or a compensation) is given back for when its tool is
	// frozen before it starts, before it is claimed again to see whether
	// the freeze was lifted; default 5s.
	FrozenRecheck time.Duration
	// LeaseMargin is added to the longest a claim can take (attempts ×
	// tool timeout + backoff) to make the lease; default 10s. The tool is
	// never called after the lease's end minus the margin.
	LeaseMargin time.Duration
	// SweepEvery is how often the executor looks for claims whose lease
	// expired (an owner that died mid-call, or calls given back: an open
	// breaker, policies that could not decide); default 5s. A sweep whose
	// page of expired claims was full sweeps again a twenty-fifth of that
	// later (200 ms by default), so that a backlog (calls given back
	// while a tool's breaker was open) drains at SweepLimit a fifth of a
	// second, not a page every SweepEvery, past the deadlines of calls
	// that could run.
	SweepEvery time.Duration
	// SweepLimit bounds one sweep; default 100. The sweeps of expired
	// claims and of unlogged records each read a page of SweepLimit
	// records a sweep, each page after the last until one is not full
	// or reaches records newer than the pass (processors.SweepPass), so
	// that a pass over N of them takes about N/SweepLimit sweeps:
	// records a sweep cannot act on (unreadable outboxes) delay the
	// others by that, never for good.
	SweepLimit int
	// UnloggedGrace is how long a finished call's events may stay out of
	// the log before the sweep appends them; default 10s. It covers the
	// case where this instance's transaction aborted in a rebalance after
	// the instance that took the partition over had skipped the call as
	// busy, so no redelivery would ever bring it back; and the calls
	// carried over past a step (see StepBudget) or left to the next one
	// under load, whose authorized events were committed before they
	// ended (with the next transaction, when their step recorded
	// nothing), when the transaction carrying their outcome aborted, the
	// step failed after recording them, or the executor shut down first.
	// It is also the age at which a step's journal entry (its outcomes,
	// logged in the store in advance) counts as abandoned: the sweep
	// settles it as not logged and appends the outcomes. After an
	// executor crash between its completions and its Kafka commit,
	// those calls' events wait that long, even when redelivered (a
	// redelivery finds them finished and logged, and skips them).
	// It also covers an authorized call not yet claimed, whose admission
	// the intake marks logged only after intake.Config.MarkDelay (3s by
	// default): keep the grace above that, or such calls' events are
	// appended twice (harmless, but wasted).
	UnloggedGrace time.Duration
	// StepBudget bounds how long a step waits for the calls it claimed
	// (and for those earlier steps under load did not wait for) before
	// it hands what finished to the log; default 200ms (less once events
	// for the next step are fetched: their calls would wait behind this
	// step's slow ones). A call
	// still running then is carried over: its outcome goes out with a
	// later step (the loop runs one at least every tick), so one hanging
	// call holds up neither its batch nor the batches after it. While a
	// tool has carried calls of a tenant, steps do not wait for that
	// tenant's new calls to it at all, so a hanging tenant costs the
	// others at most one budget per episode. Carrying a call over is safe
	// because its claim is durable: if this instance dies first, the
	// lease expires and the sweep reclaims the call as for any crash.
	// Negative waits for every claimed call, as before carry-over.
	StepBudget time.Duration
	// MaxInFlight bounds the calls this instance has running or waiting
	// to be recorded, carried ones included; default 4096. At the bound
	// a step waits for calls to end before it claims more (the loop's
	// back-pressure), which keeps memory bounded when a tool hangs for
	// everyone.
	MaxInFlight int
	// DrainTimeout is how long a step that finds its context done (the
	// executor is shutting down) waits for the calls still running to
	// end and be recorded; default 10s. Calls running past it go on in
	// the background and record their outcomes in the store themselves
	// (their events follow from the outbox through the sweep); if the
	// process exits first, their leases expire and the sweep reclaims
	// them like a crash's: an idempotency-native tool runs again with
	// the same downstream key, any other call goes to outcome_unknown.
	// Never a second effect. See also Drain.
	DrainTimeout time.Duration
	// HandoffWait is how long a finished call's outcome waits for a
	// step to take it before the call records it in the store itself,
	// outside any step (its events then follow from the outbox through
	// the sweep of unlogged outcomes); default 5s. Steps come every
	// tick, so an outcome waits longer only while none runs (a Kafka
	// session restarting, a step failing again and again): without the
	// bound, its lease could lapse meanwhile, and a takeover would find
	// a call whose outcome this executor knew as one that may have been
	// sent.
	HandoffWait time.Duration
	// TenantShare is the fraction of each tool's bulkhead (its
	// MaxConcurrency) that one tenant's calls may hold while other
	// tenants use the tool, so that one tenant's hanging calls leave
	// slots for the others; default 0.25. A tenant gets max(1,
	// floor(MaxConcurrency × TenantShare)) slots. A tenant that is the
	// only one to have called the tool within a breaker window
	// (Breaker.Window) may use the whole bulkhead, so that a lone
	// tenant's bursts lose nothing. 1 lets any tenant fill the bulkhead.
	TenantShare float64
	// Breaker configures the circuit breakers, one per tool and tenant:
	// one tenant's failures do not open the tool for the others.
	Breaker BreakerConfig
	// Now is the clock; default time.Now.
	Now func() time.Time
	// Logger; nil discards.
	Logger *slog.Logger
	// Failpoint, if set, is hit after a batch's claims commit
	// (failpoint.Claimed), before its results are written
	// (failpoint.ResponseReceived) and after (failpoint.ResultWritten):
	// the reliability suite crashes the executor there.
	Failpoint failpoint.Hook
	// Metrics, if set, receives the executor's measurements.
	Metrics Metrics
	// Tracer, if set, exports a span for each call (ledger.execute) and
	// each request to its tool (tool.call), in the agent's trace; the
	// tool gets the request's span as its traceparent.
	Tracer trace.Tracer
}

// Metrics receives an executor's measurements (metrics.Registry is one).
type Metrics interface {
	// Claims: n claims ended in result (see claimResult), were given
	// back unsent ("released"), or were held because the store failed to
	// take them back ("held": releaseClaim).
	Claims(result string, n int)
	// Stage: a stage ("claim", "complete") took d.
	Stage(stage string, d time.Duration)
	// ToolCall: one request to tool ended in result ("ok", "refused",
	// "error", "not_sent", "breaker_open") after d.
	ToolCall(tool, result string, d time.Duration)
	// UnreadableOutboxes: n records' events could not be read from
	// their outboxes, and were not appended; counted each time a sweep
	// or a claim meets one.
	UnreadableOutboxes(n int)
	// UndecodableEvents: n events of the log that may authorize a call
	// could not be read (damaged: a newer encoding stops the executor
	// instead), and were passed over: their calls stay unrun.
	UndecodableEvents(n int)
	// BreakerChanged: one of tool's breakers (each tenant has its own)
	// changed its state to to ("open", "half-open", "closed").
	BreakerChanged(tool, to string)
}

type nopMetrics struct{}

func (nopMetrics) Claims(string, int)                     {}
func (nopMetrics) Stage(string, time.Duration)            {}
func (nopMetrics) ToolCall(string, string, time.Duration) {}
func (nopMetrics) UnreadableOutboxes(int)                 {}
func (nopMetrics) UndecodableEvents(int)                  {}
func (nopMetrics) BreakerChanged(string, string)          {}

// claimResult names a claim's outcome for metrics.
func claimResult(o processors.ClaimOutcome) string {
	switch o {
	case processors.Claimed:
		return "claimed"
	case processors.Reclaimed:
		return "reclaimed"
	case processors.Busy:
		return "busy"
	case processors.Finished:
		return "finished"
	case processors.Mismatch:
		return "mismatch"
	case processors.Missing:
		return "missing"
	case processors.NotReady:
		return "not_ready"
	}
	return "other"
}

// BreakerConfig configures the circuit breakers, one per tool and tenant.
type BreakerConfig struct {
	// MinRequests in a window before the breaker may trip; default 10.
	MinRequests uint32
	// FailureRatio at which it trips; default 0.5.
	FailureRatio float64
	// Window over which failures are counted; default 30s.
	Window time.Duration
	// OpenFor is how long it stays open before probing; default 10s.
	OpenFor time.Duration
	// ConsecutiveFailures in a row trip it whatever the window's volume:
	// a tool that hangs, whose tenant's share of its bulkhead lets few
	// requests a window (one slot, a 10 s timeout: three), never reaches
	// MinRequests; default 5. The window is made to hold this many of
	// the tool's timeouts and one more.
	ConsecutiveFailures uint32
}

func (c *Config) setDefaults() {
	c.Topics = c.Topics.WithDefaults()
	if c.Owner == "" {
		host, _ := os.Hostname()
		c.Owner = fmt.Sprintf("executor-%s-%d", host, os.Getpid())
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 3
	}
	if c.RetryBackoff <= 0 {
		c.RetryBackoff = 100 * time.Millisecond
	}
	if c.FrozenRecheck <= 0 {
		c.FrozenRecheck = 5 * time.Second
	}
	if c.RevocationSkew == 0 {
		c.RevocationSkew = credentials.DefaultSkew
	}
	if c.ControlMaxStaleness == 0 {
		c.ControlMaxStaleness = control.DefaultMaxStaleness
	}
	if c.LeaseMargin <= 0 {
		c.LeaseMargin = 10 * time.Second
	}
	if c.SweepEvery <= 0 {
		c.SweepEvery = 5 * time.Second
	}
	if c.SweepLimit <= 0 {
		c.SweepLimit = 100
	}
	if c.UnloggedGrace <= 0 {
		c.UnloggedGrace = 10 * time.Second
	}
	if c.StepBudget == 0 {
		c.StepBudget = 200 * time.Millisecond
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = 4096
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = 10 * time.Second
	}
	if c.HandoffWait <= 0 {
		c.HandoffWait = 5 * time.Second
	}
	if c.TenantShare <= 0 {
		c.TenantShare = 0.25
	}
	c.TenantShare = min(c.TenantShare, 1)
	if c.Breaker.MinRequests == 0 {
		c.Breaker.MinRequests = 10
	}
	if c.Breaker.FailureRatio <= 0 {
		c.Breaker.FailureRatio = 0.5
	}
	if c.Breaker.Window <= 0 {
		c.Breaker.Window = 30 * time.Second
	}
	if c.Breaker.OpenFor <= 0 {
		c.Breaker.OpenFor = 10 * time.Second
	}
	if c.Breaker.ConsecutiveFailures == 0 {
		c.Breaker.ConsecutiveFailures = 5
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Metrics == nil {
		c.Metrics = nopMetrics{}
	}
}

// Executor is one executor instance. Its in-memory state is per tool and
// tenant (breakers, bulkheads) and per call in flight: the calls running,
// carried over from earlier steps, bounded by MaxInFlight; nothing is
// kept per call once its outcome is handed to a step.
type Executor struct {
	cfg  Config
	base *url.URL
	// noWait is a context already done: the kill switch's gate asks
	// whether its copy is current without waiting for it.
	noWait context.Context

	mu        sync.Mutex
	guards    map[string]*toolGuard // by tool name
	lastPrune time.Time
	lastSwp   time.Time
	// sweepFull: the last sweep's page of expired claims was full, so
	// the next comes sooner (Config.SweepEvery).
	sweepFull bool
	// expiredPass and unloggedPass are where the sweeps of expired
	// claims and of unlogged records are (see Step); only Step uses
	// them.
	expiredPass, unloggedPass processors.SweepPass

	// running are the calls in flight, by key (under mu); done hands
	// finished calls to the next step that waits for them.
	running map[ledger.CallKey]struct{}
	// held are the claims of calls that sent nothing and that the store
	// failed to take back (releaseClaim), by key (under mu): each step
	// asks it again (releaseHeld), and until then they count as in
	// flight.
	held map[ledger.CallKey]processors.Release
	// heldTried is when a step last asked the store to take the held
	// claims back (under mu).
	heldTried time.Time
	done      chan *flight
	// draining is closed by Drain: no step will take a finished call's
	// outcome any more, and the call records it itself.
	draining  chan struct{}
	drainOnce sync.Once
	// wake tells a waiting step that a call recorded its outcome
	// itself (flight.alone): one token stands for any number.
	wake    chan struct{}
	flights flights
	// unwaited are calls in flight that the step which started them did
	// not wait for (under mu).
	unwaited map[*flight]struct{}

	// backlog counts the records fetched for the next step (the loop's
	// Buffered); nil when the executor runs without its Loop.
	backlog func() int64

	// journals names the store's journal entries of this executor's
	// steps (processors.Completion.Journal): journalID, then a step
	// number. The random part keeps a restarted process with the same
	// Owner (a container's pid 1) off its predecessor's entries.
	journalID string
	journals  atomic.Uint64
}

// New validates cfg and returns an executor.
func New(cfg Config) (*Executor, error) {
	if cfg.Registry == nil || cfg.Store == nil || cfg.Caller == nil {
		return nil, errors.New("executor: registry, store and caller are required")
	}
	cfg.setDefaults()
	x := newExecutor(cfg)
	base, err := processors.ParseBaseURL(cfg.BaseURL)
	if err != nil {
		return nil, fmt.Errorf("executor: %w", err)
	}
	x.base = base
	return x, nil
}

// job is one call this step works on.
type job struct {
	tmpl  ledger.Event // identity fields for the events the call gets
	claim processors.Claim
}

// Step handles one batch of events: it is a ledger.Step. It acts on
// authorized events and ignores the rest. It records the calls that
// ended since the last step while it claims the batch's calls, and runs
// them. With more events already fetched it returns then; otherwise it
// waits for them, and for the calls earlier steps did not wait for, up to
// Config.StepBudget. It returns the events of every call it recorded.
func (x *Executor) Step(ctx context.Context, recs []*kgo.Record) (_ ledger.Output, err error) {
	var got []*flight // ended calls taken from the flights and not yet recorded
	// The outcomes this step records are logged in the store with their
	// completion, under the store's journal entries named here (one for
	// the outcomes recorded while the batch is claimed, one for those
	// after: distinct, so that neither write rewrites the other's
	// entry); they are settled after the step's transaction, or undone
	// if it does not commit. Two entries a step, not a write a call.
	step := x.journalID + strconv.FormatUint(x.journals.Add(1), 10)
	var journals []string // the entries that may exist
	defer func() {
		if err != nil && len(got) > 0 {
			// The step failed after taking ended calls: no later step
			// will see them again, so record them now; their events
			// follow from the outbox through the sweep.
			x.recordAlone(ctx, got...)
		}
		if err != nil && len(journals) > 0 {
			// Their events will not be in this step's transaction:
			// back to unlogged now, so that a redelivery or the sweep
			// appends them.
			x.settle(ctx, journals, false)
		}
	}()
	x.releaseHeld(ctx, false)
	jobs := make(map[ledger.CallKey]*job)
	var (
		order    []ledger.CallKey
		reappend []processors.Record // finished calls whose events the log lacks
	)
	// logged is the seq of the event read from the log that the claim
	// comes from (0 from a sweep): a claim records that the call's
	// events up to it are in the log, which spares the intake a write
	// of its own.
	add := func(tmpl ledger.Event, hash string, logged int64) {
		k := tmpl.Key()
		if _, ok := jobs[k]; ok {
			return
		}
		if x.inFlight(k) {
			// Carried over from an earlier step: its outcome comes
			// with a later one, even if its lease ran out meanwhile.
			return
		}
		lease := x.leaseFor(tmpl.Tool, tmpl.ToolVersion)
		jobs[k] = &job{tmpl: tmpl, claim: processors.Claim{Key: k, ArgumentsHash: hash, Owner: x.cfg.Owner, Lease: lease, Logged: logged}}
		order = append(order, k)
	}
	for _, r := range recs {
		if !mayAuthorize(r) {
			continue
		}
		ev, err := ledger.DecodeEvent(r.Value)
		if errors.Is(err, ledger.ErrUnsupportedEncoding) {
			// A newer build wrote it (an upgrade out of order: the
			// setting that turns a new encoding on came before every
			// executor read it). Passing over it would leave its call
			// unrun for good, since no claim of it exists for a sweep
			// to find; this process stops instead, and the partition
			// goes to a member that reads it, or waits for one.
			x.cfg.Logger.Error("executor stopped: the events topic holds an event of a newer encoding than this build reads; upgrade it",
				"topic", r.Topic, "partition", r.Partition, "offset", r.Offset, "err", err)
			return ledger.Output{}, fmt.Errorf("%w: %s/%d at offset %d: %w", ledger.ErrStop, r.Topic, r.Partition, r.Offset, err)
		}
		if err != nil {
			// The events topic is written only by the ledger: an event
			// that does not decode at all is damage, or a bug, that a
			// human must see; stopping would stop every executor it
			// is handed to in turn.
			x.cfg.Logger.Error("undecodable event", "topic", r.Topic, "partition", r.Partition, "offset", r.Offset, "err", err)
			x.cfg.Metrics.UndecodableEvents(1)
			continue
		}
		if ev.Type != statemachine.EventAuthorized && ev.Type != statemachine.EventApproved {
			continue
		}
		add(template(ev), ev.ArgumentsHash, ev.Seq)
	}
	if now := x.cfg.Now(); now.Sub(x.lastSwp) >= x.cfg.SweepEvery || x.sweepFull && now.Sub(x.lastSwp) >= x.cfg.SweepEvery/25 {
		x.lastSwp = now
		// A pass of pages, not the oldest page every time: an expired
		// claim this step does not take stays first in the lease's
		// order (its outbox unreadable by this build after a rollback,
		// or in flight here), and a page full of them would keep every
		// claim behind them from being taken over.
		expired, err := x.expiredPass.PageOf(ctx, x.cfg.Store.ExpiredAfter, (*processors.Record).LeaseCursor, x.cfg.SweepLimit, now)
		if err != nil {
			return ledger.Output{}, fmt.Errorf("sweep expired leases: %w", err)
		}
		x.sweepFull = len(expired) == x.cfg.SweepLimit
		for _, rec := range expired {
			tmpl, err := recordTemplate(rec)
			if err != nil {
				x.cfg.Logger.Error("expired claim without context", "call_key", rec.Key.String(), "err", err)
				continue
			}
			add(tmpl, rec.ArgumentsHash, 0)
		}
		// A page after the last, not the oldest page every time: a
		// record whose outbox this build cannot read stays unlogged
		// (see outbox below), and a page full of them would keep every
		// record behind them out of the log for good. A page that is
		// not full ends the pass (as does one reaching records updated
		// since the pass started), and the next sweep starts again from
		// the oldest; records that went back to unlogged behind the
		// cursor meanwhile (a journal entry settled as not logged keeps
		// their update time) wait for that. One page a sweep, as before.
		listUnlogged := func(ctx context.Context, after processors.Cursor, limit int) ([]processors.Record, error) {
			return x.cfg.Store.Unlogged(ctx, x.cfg.UnloggedGrace, after, limit)
		}
		unlogged, err := x.unloggedPass.PageOf(ctx, listUnlogged, (*processors.Record).Cursor, x.cfg.SweepLimit, now)
		if err != nil {
			// The expired claims read above are taken over all the
			// same: failing the step here, every sweep, would stop the
			// recovery of every call whose executor died for as long
			// as this listing fails (a journal entry it cannot read,
			// say), and it is retried at the next sweep.
			x.cfg.Logger.Error("sweep of unlogged outcomes failed; the expired claims are taken over all the same", "err", err)
		}
		for _, rec := range unlogged {
			if _, ok := jobs[rec.Key]; ok {
				continue
			}
			x.cfg.Logger.Warn("appending a call's events left out of the log", "call_key", rec.Key.String(), "seq", rec.Seq, "logged_seq", rec.LoggedSeq)
			reappend = append(reappend, rec)
		}
	}
	if len(order) == 0 && len(reappend) == 0 && x.flights.count() == 0 {
		return ledger.Output{}, nil
	}

	// At the bound of calls in flight, wait for some to end before
	// claiming more: the loop's back-pressure.
	for len(order) > 0 && x.flights.count() >= x.cfg.MaxInFlight && ctx.Err() == nil {
		select {
		case f := <-x.done:
			x.landed(f)
			got = append(got, f)
		case <-x.wake:
		case <-ctx.Done():
		}
	}
	// The calls that ended since the last step (carried over, or left
	// by a step that did not wait for them) are recorded while this
	// batch is claimed: they are other calls, and each is a store round
	// trip the step would otherwise wait for in turn.
	got = x.takeEnded(got)
	early := completions(got)
	// From here a failure to record them is tried once more outside the
	// step, else left to the leases, as after a crash.
	got = nil
	var (
		earlyApplied []bool
		earlyErr     error
		recording    sync.WaitGroup
		// retryEarly are the early outcomes whose recording failed.
		retryEarly []processors.Completion
	)
	if len(early) > 0 {
		journals = append(journals, step+"/early")
		recording.Go(func() { earlyApplied, earlyErr = x.record(ctx, step+"/early", early) })
	}
	var (
		results []processors.ClaimResult
		// claimedAt is just before the claim was asked, on this
		// executor's clock.
		claimedAt time.Time
	)
	if len(order) > 0 {
		// A claim names the credential its requests will carry, before
		// any leaves: a call its executor sent and died on is still
		// found under it, and the one that takes the call over names
		// it. The store keeps a call's first jti; the claim's record
		// says which to send. The key's epoch is read last, so that a
		// rotation between the claim and the mint is rare.
		var keyEpoch int64
		if x.cfg.Credentials != nil {
			keyEpoch = x.cfg.Credentials.KeyEpoch()
		}
		claims := make([]processors.Claim, len(order))
		for i, k := range order {
			j := jobs[k]
			if x.cfg.Credentials != nil {
				j.claim.Credential = processors.CallCredential{JTI: credentials.NewJTI(), Family: credentials.FamilyOf(j.tmpl.Tool, k.TenantID, keyEpoch)}
			}
			claims[i] = j.claim
		}
		var err error
		claimedAt = time.Now()
		if results, err = x.cfg.Store.Claim(ctx, claims); err != nil {
			recording.Wait()
			if earlyErr != nil {
				// Once more on their own, as below: known outcomes,
				// left to their leases, would come back as calls that
				// may have run.
				x.completeAlone(ctx, early)
			}
			return ledger.Output{}, fmt.Errorf("claim %d calls: %w", len(claims), err)
		}
		x.cfg.Metrics.Stage("claim", time.Since(claimedAt))
		x.cfg.Failpoint.Hit(failpoint.Claimed)
		x.countClaims(results)
	}
	recording.Wait()
	if earlyErr != nil {
		// Those calls are left to their leases, as after a crash; the
		// step goes on, for failing it now would leave this batch's
		// claims unlaunched until their leases expire too, and make
		// calls that never ran look as if they might have. The write
		// may have committed all the same (an ambiguous commit): its
		// journal entry is settled as not logged now, never with the
		// step's, so that the sweep appends what it recorded.
		x.cfg.Logger.Error("record finished calls; trying once more outside the step, else their leases will expire", "calls", len(early), "err", earlyErr)
		x.settle(ctx, journals[:1], false)
		// Once more on their own, once the batch just claimed is
		// launched (its leases run meanwhile): their outcomes are
		// known, and left to the leases they would come back as calls
		// that may have run (a retry fenced out changes nothing).
		retryEarly = early
		early = nil
		journals = journals[1:]
	}

	var (
		out            []*kgo.Record
		logged         []processors.Logged
		waiting        = make(map[*flight]struct{}) // the calls this step waits for
		mismatched     []ledger.Event
		mismatchedRecs []processors.Record
	)
	// Even when shutting down, the batch just claimed is launched: a
	// claim left unlaunched would expire and make calls that never ran
	// look as if they might have. The checks after the launch end the
	// step.
	x.appendRecorded(early, earlyApplied, &out)
	// With more events already fetched, the step does not wait for the
	// calls it starts: the next step, which follows at once, records
	// those that ended by then while it claims its own batch. Otherwise
	// it waits for them (up to StepBudget), and for the calls earlier
	// steps left, so that an outcome never waits for a poll's tick.
	pipelined := x.cfg.StepBudget >= 0 && x.backlog != nil && x.backlog() > 0
	if !pipelined {
		// A call that earlier steps left and that has run a whole
		// budget since is taken for slow, not waited for again: a
		// step that waited for it would hold up this step's outcomes
		// for a budget, once the steps under load that left it stop.
		now := time.Now()
		x.mu.Lock()
		for f := range x.unwaited {
			// (One that ended is waited for: it is on its way.)
			if !f.ended && x.outlasted(f, now) {
				x.carryLocked(f)
				continue
			}
			waiting[f] = struct{}{}
		}
		x.mu.Unlock()
	}
	// outbox appends a record's outbox again, all of it: its LoggedSeq
	// may be an executor's mark in advance that a move went past (an
	// unknown outcome resolved while the step that recorded it was
	// lost), and appending only the events past it would put the
	// move's event in the log ahead of the step's. The outbox holds one
	// step's events, so this is what the log lacks in the usual case.
	//
	// An outbox this build cannot read (written by a newer one, or
	// damaged) is left out, loudly and counted, and stays unlogged for a
	// build that reads it (and for a human: its events never reached
	// the log): failing the step for it would leave the batch just
	// claimed unlaunched, its calls looking as if they might have run
	// once their leases expire, and fail every later sweep the same way.
	outbox := func(rec processors.Record) {
		evs, err := ledger.DecodeEvents(rec.Outbox)
		rs := make([]*kgo.Record, 0, len(evs))
		for k := 0; err == nil && k < len(evs); k++ {
			var r *kgo.Record
			if r, err = evs[k].Record(x.cfg.Topics.Events); err == nil {
				rs = append(rs, r)
			}
		}
		if err != nil {
			x.cfg.Logger.Error("a call's events cannot be read from its record: not appended; a build that reads them will append them",
				"call_key", rec.Key.String(), "seq", rec.Seq, "logged_seq", rec.LoggedSeq, "err", err)
			x.cfg.Metrics.UnreadableOutboxes(1)
			return
		}
		out = append(out, rs...)
		logged = append(logged, processors.Logged{Key: rec.Key, Seq: rec.Seq, Base: rec.LoggedSeq})
	}
	for _, rec := range reappend {
		outbox(rec)
	}
	for i, res := range results {
		j := jobs[order[i]]
		rec := res.Record
		switch res.Outcome {
		case processors.Claimed, processors.Reclaimed:
			// The lease as this executor's clock keeps it, counted from
			// before the claim was asked: it ends no later than the
			// store's, which the database counted from later. The
			// store's lease_until is on the database's clock, ahead of
			// this one or behind it: read on this one, it would end
			// the call's time early (or late) by the difference.
			rec.LeaseUntil = claimedAt.Add(j.claim.Lease)
			f, wait := x.launch(ctx, j.tmpl, rec, res.Outcome == processors.Reclaimed, res.Prior)
			switch {
			case x.cfg.StepBudget < 0, wait && !pipelined:
				waiting[f] = struct{}{}
			case wait:
				x.leave(f)
			}
		case processors.Finished:
			if rec.Unlogged() {
				outbox(rec)
			}
		case processors.Busy:
			x.cfg.Logger.Debug("call busy elsewhere", "call_key", rec.Key.String(), "trace_id", j.tmpl.TraceID, "lease_owner", rec.LeaseOwner)
		case processors.NotReady:
			x.cfg.Logger.Warn("authorized event for a call not ready", "call_key", order[i].String(), "trace_id", j.tmpl.TraceID, "status", rec.Status)
		case processors.Mismatch:
			// The record's arguments hash is not the one the call was
			// authorized (or approved) with: someone changed the store.
			// It must not run, nor sit authorized forever.
			x.cfg.Logger.Error("authorized event disagrees with the execution record", "call_key", order[i].String(), "trace_id", j.tmpl.TraceID)
			if rec.Status == processors.StatusAuthorized {
				mismatched = append(mismatched, j.tmpl)
				mismatchedRecs = append(mismatchedRecs, rec)
			}
		case processors.Missing:
			x.cfg.Logger.Error("authorized event without execution record", "call_key", order[i].String(), "trace_id", j.tmpl.TraceID)
		}
	}
	x.completeAlone(ctx, retryEarly)
	if !pipelined || ctx.Err() != nil {
		got = x.await(ctx, got, waiting)
	}
	if ctx.Err() != nil {
		// Shutting down: the calls still running record their own
		// outcomes when they end; give them a while to do so.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), x.cfg.DrainTimeout)
		if err := x.flights.wait(dctx); err != nil {
			x.cfg.Logger.Warn("calls still running at shutdown; they record their outcomes if the store is still open, or their leases expire", "calls", x.flights.count())
		}
		cancel()
	}
	if err := x.denyMismatched(ctx, mismatched, mismatchedRecs, &out, &logged); err != nil {
		return ledger.Output{}, err
	}

	done := completions(got)
	if len(done) > 0 {
		journals = append(journals, step+"/done")
		applied, err := x.record(ctx, step+"/done", done)
		if err != nil {
			// got is recorded on its own as the step fails.
			return ledger.Output{}, err
		}
		got = nil
		if ctx.Err() != nil {
			// Shutting down: the outcomes are in the store, and their
			// events go out from the outbox on redelivery or through
			// the sweep.
			return ledger.Output{}, ctx.Err()
		}
		x.appendRecorded(done, applied, &out)
	}
	if ctx.Err() != nil {
		return ledger.Output{}, ctx.Err()
	}
	committed := func(ctx context.Context) error {
		// Even at shutdown: an entry left unsettled is appended again
		// by the sweep.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		var err error
		if len(logged) > 0 {
			err = x.cfg.Store.MarkLogged(ctx, logged)
		}
		return errors.Join(err, x.cfg.Store.Settle(ctx, journals, true))
	}
	output := ledger.Output{Records: out}
	if len(logged) > 0 || len(journals) > 0 {
		output.Committed = committed
	}
	if len(journals) > 0 {
		output.Abandoned = func(ctx context.Context) error { return x.cfg.Store.Settle(ctx, journals, false) }
	}
	// A step that recorded and appended nothing (it claimed and started
	// calls it did not wait for, or read only events it ignores while
	// calls ran) returns an empty output: the loop commits its batch's
	// offsets with the next transaction instead of one of its own. Were
	// the batch delivered again first, its claims would find the calls
	// in flight here, running under a live lease, or finished, or, once
	// a lease expired, reclaim them as the sweep would (a tool without
	// idempotency goes to outcome_unknown): nothing runs twice.
	return output, nil
}

// settle settles the step's journal entries outside its output, when
// the step failed: a failure leaves them to the sweep of unlogged
// outcomes, which settles them once they are UnloggedGrace old.
func (x *Executor) settle(ctx context.Context, journals []string, logged bool) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := x.cfg.Store.Settle(sctx, journals, logged); err != nil {
		x.cfg.Logger.Warn("settle a step's journal entries; the sweep settles them", "journals", journals, "err", err)
	}
}

// record writes the outcomes of ended calls to the store, logged under
// journal, even during shutdown (the events then follow from the outbox
// on redelivery or through the sweep, once the journal entry is settled
// as not logged). applied[i] is false for a call this executor was
// fenced out of. An error means the tools ran but their outcomes are not
// recorded: the leases will expire and the sweep will find the calls.
func (x *Executor) record(ctx context.Context, journal string, cs []processors.Completion) ([]bool, error) {
	for i := range cs {
		cs[i].Journal = journal
	}
	x.cfg.Failpoint.Hit(failpoint.ResponseReceived)
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	t0 := time.Now()
	applied, err := x.cfg.Store.Complete(cctx, cs)
	x.cfg.Metrics.Stage("complete", time.Since(t0))
	if err != nil {
		return nil, fmt.Errorf("complete %d calls: %w", len(cs), err)
	}
	x.cfg.Failpoint.Hit(failpoint.ResultWritten)
	return applied, nil
}

// appendRecorded adds the events of the recorded calls to out, skipping
// those this executor was fenced out of.
func (x *Executor) appendRecorded(cs []processors.Completion, applied []bool, out *[]*kgo.Record) {
	for i, c := range cs {
		if !applied[i] {
			x.cfg.Logger.Warn("fenced out of call", "call_key", c.Key.String(), "epoch", c.Epoch)
			continue
		}
		*out = append(*out, c.Records...)
	}
}

// await takes ended calls from the flights until every call in waiting
// has ended, the step budget is spent, events for the next step are
// fetched (the backlog: the calls they authorize would wait behind this
// step's slow ones), or ctx is done, and then whatever else has ended by
// now, carried over from earlier steps. The calls of waiting still
// running carry over to later steps (carry: past a budget, their tenants'
// new calls are not waited for) or, when the next events came first, are
// left to the next step that waits, unless they have run a whole budget
// since their launch (stopWaiting).
func (x *Executor) await(ctx context.Context, got []*flight, waiting map[*flight]struct{}) []*flight {
	var budget, fetched <-chan time.Time
	if x.cfg.StepBudget > 0 && len(waiting) > 0 {
		t := time.NewTimer(x.cfg.StepBudget)
		defer t.Stop()
		budget = t.C
		if x.backlog != nil {
			tk := time.NewTicker(backlogEvery)
			defer tk.Stop()
			fetched = tk.C
		}
	}
	next := false // the wait ended for the next step's events
wait:
	for len(waiting) > 0 {
		select {
		case f := <-x.done:
			x.landed(f)
			delete(waiting, f)
			got = append(got, f)
		case <-x.wake:
			x.mu.Lock()
			for f := range waiting {
				if f.alone {
					delete(waiting, f)
				}
			}
			x.mu.Unlock()
		case <-budget:
			break wait
		case <-fetched:
			if x.backlog() > 0 {
				next = true
				break wait
			}
		case <-ctx.Done():
			break wait
		}
	}
	switch {
	case len(waiting) == 0 || ctx.Err() != nil:
	case next:
		// Not waited for a whole budget by this step: left, as a step
		// under load leaves the calls it starts, unless running that
		// long since their launch (stopWaiting).
		x.stopWaiting(waiting)
	default:
		x.carry(waiting)
		x.cfg.Logger.Debug("calls carried over past the step budget", "calls", len(waiting))
	}
	return x.takeEnded(got)
}

// leaseFor is how long a claim on a tool may take, with margin. A tool
// the registry no longer knows fails at once, under the default timeout.
func (x *Executor) leaseFor(name string, version int) time.Duration {
	timeout := schemas.DefaultTimeout
	if t, err := x.cfg.Registry.Lookup(name, version); err == nil {
		timeout = t.Timeout()
	}
	attempts := time.Duration(x.cfg.MaxAttempts)
	return attempts*timeout + attempts*x.cfg.RetryBackoff*2 + x.cfg.LeaseMargin
}

// execute runs one claimed call and returns its completion, in a span of
// the call's trace when the executor traces. g is the tenant's guard for
// the tool, held by the caller; nil takes one here.
func (x *Executor) execute(ctx context.Context, tmpl *ledger.Event, rec *processors.Record, reclaimed bool, prior processors.CallCredential, g *guard) processors.Completion {
	if x.cfg.Tracer == nil {
		// No span to start, nor its attributes to build.
		return x.executeCall(ctx, tmpl, rec, reclaimed, prior, g)
	}
	ctx, span := tracing.StartCall(ctx, x.cfg.Tracer, "ledger.execute", tmpl.TraceID, rec.Key.String(),
		trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(
			attribute.String("ledger.call_key", rec.Key.String()),
			attribute.String("ledger.tenant", rec.Key.TenantID),
			attribute.String("ledger.tool", rec.Tool),
			attribute.Int64("ledger.epoch", rec.Epoch),
			attribute.Bool("ledger.reclaimed", reclaimed),
		))
	c := x.executeCall(ctx, tmpl, rec, reclaimed, prior, g)
	span.SetAttributes(attribute.String("ledger.status", string(c.Status)))
	if c.Status != processors.StatusSucceeded {
		span.SetStatus(codes.Error, string(c.Status))
	}
	span.End()
	return c
}

// callLog logs about one call, with the call's attributes. Unlike
// Logger.With, which formats them at once, it builds them only for a record
// the handler keeps: nearly every call logs nothing, and formatting its key
// for nothing was 3% of the executor's CPU.
type callLog struct {
	ctx     context.Context
	l       *slog.Logger
	rec     *processors.Record
	traceID string
}

func (c callLog) log(level slog.Level, msg string, args ...any) {
	if !c.l.Enabled(c.ctx, level) {
		return
	}
	all := append([]any{"call_key", c.rec.Key.String(), "trace_id", c.traceID, "tool", c.rec.Tool, "epoch", c.rec.Epoch}, args...)
	c.l.Log(c.ctx, level, msg, all...)
}

func (c callLog) Info(msg string, args ...any)  { c.log(slog.LevelInfo, msg, args...) }
func (c callLog) Warn(msg string, args ...any)  { c.log(slog.LevelWarn, msg, args...) }
func (c callLog) Error(msg string, args ...any) { c.log(slog.LevelError, msg, args...) }

// prior is, for a reclaimed call, the credential the expired claim named
// (processors.ClaimResult.Prior): its events name it.
func (x *Executor) executeCall(ctx context.Context, tmpl *ledger.Event, rec *processors.Record, reclaimed bool, prior processors.CallCredential, g *guard) processors.Completion {
	start := x.cfg.Now()
	c := &completion{x: x, tmpl: *tmpl, rec: *rec, start: start, reclaimed: reclaimed}
	if reclaimed {
		c.prior = prior
	}
	log := callLog{ctx: ctx, l: x.cfg.Logger, rec: rec, traceID: tmpl.TraceID}

	tool, err := rec.ToolIn(x.cfg.Registry)
	if err != nil {
		// A tool version this executor does not know yet (a rolling
		// deploy: an intake with the new registry admitted it), or
		// defines otherwise than the intake that admitted the call (a
		// registry edited in place, or another registry): given back
		// for an executor that has the call's definition, while the
		// call's deadline leaves room, rather than failed with its key
		// spent; never run by another definition, whose idempotency,
		// timeout or endpoint may not be the call's. Taken over, it may
		// have been sent by an owner that had it: what happened is for
		// a reconciler that does.
		reason, detail := ReasonUnknownTool, fmt.Sprintf("this executor does not know %s v%d; nothing was sent", rec.Tool, rec.ToolVersion)
		if errors.Is(err, schemas.ErrOtherDefinition) {
			reason, detail = ReasonOtherDefinition, err.Error()+"; nothing was sent"
		}
		switch after := max(x.cfg.SweepEvery, time.Second); {
		case reclaimed:
			log.Warn("taken-over call of a tool version this executor does not have as admitted; outcome unknown", "reason", reason, "err", err)
			return c.finish(processors.StatusOutcomeUnknown, rec.Attempt+1, ReasonLeaseExpired, "reclaimed_"+reason, nil)
		case roomFor(rec, tmpl, x.cfg.Now().Add(after)):
			return x.releaseClaim(ctx, c, log, refusal{reason: reason, after: after, detail: detail})
		}
		return c.finish(processors.StatusFailed, rec.Attempt+1, reason, "", nil)
	}
	if reclaimed && tool.Effect == schemas.EffectRead {
		// A read taken over runs as a call of its own: whatever its
		// first owner's request did changed nothing, so there is no
		// outcome to be unsure of, and none to park for a human (a read
		// declares no status lookup).
		reclaimed, c.reclaimed = false, false
	}
	pastDeadline := !rec.DeadlineAt.IsZero() && !start.Before(rec.DeadlineAt)
	if reclaimed && (tool.Idempotency != schemas.IdempotencyNative || pastDeadline) {
		// The previous owner may or may not have called the tool.
		// Calling it again could apply the effect twice, and a call
		// past its deadline must not run at all; either way only a
		// reconciler can tell what happened, never "expired".
		log.Warn("lease expired mid-call, outcome unknown")
		return c.finish(processors.StatusOutcomeUnknown, rec.Attempt+1, ReasonLeaseExpired, "", nil)
	}
	if pastDeadline {
		return c.expire()
	}
	// Never call the tool past the call's deadline, nor so late in the
	// lease that another owner might take the call over meanwhile. The
	// checks before the call (the store, the resource's version, the
	// policy) are bounded by the same: one that hangs must end the call
	// while its lease holds, not keep it executing past its lease, in
	// flight here, where no sweep of this executor reclaims it.
	stop := rec.LeaseUntil.Add(-x.cfg.LeaseMargin)
	if !rec.DeadlineAt.IsZero() && rec.DeadlineAt.Before(stop) {
		stop = rec.DeadlineAt
	}
	callCtx, cancel := context.WithDeadline(ctx, stop)
	defer cancel()
	// refuse ends a call a check before it says must not run. A check
	// that ran out of the call's time says nothing about the call: it
	// did not start, as when no attempt could. A taken-over call cannot
	// be denied, since its first owner may have sent it: what the tool
	// did is left to the reconciler.
	refuse := func(r refusal) processors.Completion {
		switch {
		case callCtx.Err() != nil:
			return c.exhausted(tool, rec.Attempt, callCtx.Err())
		case reclaimed:
			log.Warn("taken-over call refused before it was sent again; outcome unknown", "reason", r.reason, "detail", r.detail)
			return c.finish(processors.StatusOutcomeUnknown, rec.Attempt+1, ReasonLeaseExpired, "reclaimed_"+r.reason, nil)
		case r.later, r.decision.Transient():
			// The policies could not decide (or the resource's version
			// could not be read), which says nothing about the call:
			// denying would end an approved call for good on a stall.
			// Nothing was sent under this claim, and it is no
			// takeover: give it back, to be decided again later.
			return x.releaseClaim(ctx, c, log, r)
		default:
			return c.deny(r.reason, r.detail, r.decision)
		}
	}
	// An approved call's checks below read the tool (its resource's
	// version) and decide it under the policies in force, which are the
	// activation the control topic holds: on a copy of it known current,
	// waited for within the check's budget, and the freezes it then
	// holds acted on next. Decided on a stale copy, an approved call
	// would run under a version superseded as long ago as the copy is
	// stale (where the intake decides nothing on such a copy), and the
	// version read would reach a tool frozen meanwhile. It is given back
	// while the copy is not current.
	if tmpl.ApprovalID != "" && x.cfg.Freezes != nil && (tmpl.ResourceVersion != "" && x.cfg.Versions != nil || x.cfg.Policy != nil) {
		cctx, cancel := context.WithTimeout(callCtx, checkBudget(callCtx, tool))
		err := x.cfg.Freezes.Current(cctx, x.cfg.ControlMaxStaleness)
		cancel()
		if err != nil {
			return refuse(refusal{reason: ReasonUnavailable, detail: "the kill switch and the policies in force are not known: the control topic's copy is not current (" + err.Error() + ")", later: true})
		}
	}
	// A call an approval or a compensation stands behind waits out a
	// freeze of its tool (as the attempt's own check, which stays, does
	// for one frozen later): given back before the checks below, which
	// write (MarkUndo), read the tool (the resource's version) and mint,
	// every time it is claimed again while the freeze lasts. A copy of
	// the kill switch that is stale here says nothing either way.
	//
	// Any other approved call is held back here, as its attempt's gate
	// would hold it (denied tool_frozen; taken over, outcome unknown):
	// its approval's check below reads the resource's version at the
	// frozen tool. Only on a copy known current, as the gate: the end is
	// for good.
	if x.cfg.Freezes != nil {
		if a, frozen := x.cfg.Freezes.Frozen(tool.Name, rec.Key.TenantID); frozen {
			switch {
			case !reclaimed && x.waitsOutFreeze(rec, tmpl):
				return x.holdFrozen(ctx, c, log, tool.Name, a)
			case tmpl.ApprovalID != "" && x.cfg.Freezes.Current(x.noWait, x.cfg.ControlMaxStaleness) == nil:
				// Asked again once known current, as the gate asks:
				// the copy may have caught up with an unfreeze since.
				if a, frozen := x.cfg.Freezes.Frozen(tool.Name, rec.Key.TenantID); frozen {
					return refuse(refusal{reason: ReasonToolFrozen, detail: control.FrozenDetail(tool.Name, a)})
				}
			}
		}
	}
	// A compensation undoes an effect: if its call turned out to have
	// none (resolved failed meanwhile), there is nothing to undo. One the
	// reconciler asked for undoes an outcome nobody could establish: if
	// the call was found to have succeeded meanwhile (its park was never
	// recorded, and a later lookup answered), the success stands.
	//
	// The check is a write on the call's record (MarkUndo), so that a
	// move that settles the call from a read before it (failed, by its
	// status lookup or an operator) does not apply: read, the call could
	// be settled failed between the check and the send, and then undone.
	if orig, ok := rec.Key.Compensates(); ok {
		undoable := []processors.Status{processors.StatusOutcomeUnknown, processors.StatusParked}
		if tmpl.UserID != ReconcilerUser {
			undoable = append(undoable, processors.StatusSucceeded)
		}
		status, marked, err := x.cfg.Store.MarkUndo(callCtx, orig, undoable)
		if err == nil && marked && tmpl.UserID == ReconcilerUser {
			status, marked, err = x.stillToUndo(callCtx, orig)
		}
		switch {
		case err != nil && !errors.Is(err, processors.ErrNotFound) && callCtx.Err() == nil && !reclaimed:
			// Not known whether there is anything to undo: nothing is
			// sent, and the call goes back, to be tried again.
			log.Warn("the call a compensation would undo cannot be checked; given back", "err", err)
			return x.releaseClaim(ctx, c, log, refusal{reason: "store_unavailable", detail: err.Error()})
		case err != nil && !errors.Is(err, processors.ErrNotFound):
			// Out of the call's time, or taken over: as refuse says.
			return refuse(refusal{reason: "store_unavailable", detail: "the call it would undo cannot be checked"})
		case err == nil && !marked && status == processors.StatusParked:
			return refuse(refusal{reason: ReasonNothingToUndo, detail: "the call it would undo was handed to a human meanwhile, told that no compensation was requested"})
		case err == nil && !marked:
			return refuse(refusal{reason: ReasonNothingToUndo, detail: fmt.Sprintf("the call it would undo is %s", status)})
		}
	}
	// A call its policies asked to run against a sandbox backend
	// (decided by an older build, or approved under an older set) never
	// runs against the real one: none runs against a sandbox yet.
	if carriedObligations(tmpl.Obligations).Sandbox {
		return refuse(refusal{reason: policy.ReasonSandboxUnavailable, detail: "a sandbox backend is asked for, and no call runs against one"})
	}
	// An approved call is decided again before it runs, a taken-over
	// one too: its first owner may have died before it ever sent, and
	// the approval must still hold (unexpired, for the same resource
	// version, under the policies in force) for a request to leave now.
	if tmpl.ApprovalID != "" {
		if r := x.recheckApproval(callCtx, c, tool, rec, start); r != nil {
			return refuse(*r)
		}
	}
	integrity := processors.VerifyArguments(*rec)
	if integrity == nil && c.tmpl.ArgumentsHash != "" && c.tmpl.ArgumentsHash != rec.ArgumentsHash {
		// Arguments and hash rewritten together in the store: they
		// agree, but not with the hash the call's events name, which
		// its policies decided on and its approver approved. A claim
		// from the log compares them; one from a sweep claims with the
		// record's own.
		integrity = fmt.Errorf("the record's arguments hash %s is not the call's %s", rec.ArgumentsHash, c.tmpl.ArgumentsHash)
	}
	if err := integrity; err != nil {
		// What would run is not what was validated, hashed and
		// approved: it never runs.
		log.Error("arguments do not match their hash", "err", err)
		if reclaimed {
			// Not denied: its first owner may have sent it (with the
			// arguments as they were then), which the reconciler is
			// to find out. Denied, its agent would send it again.
			return c.finish(processors.StatusOutcomeUnknown, rec.Attempt+1, ReasonLeaseExpired, "reclaimed_"+ReasonArgumentIntegrity, nil)
		}
		return c.deny(ReasonArgumentIntegrity, "the stored arguments do not match the call's arguments hash", policy.Decision{})
	}
	target, err := x.resolve(tool.Backend.URL)
	if err != nil {
		return c.finish(processors.StatusFailed, rec.Attempt+1, ReasonUnavailable, "bad_backend_url", nil)
	}

	backend, err := backendSecret(x.cfg.Secrets, tool)
	switch {
	case errors.Is(err, errNoKeystore):
		return c.finish(processors.StatusFailed, rec.Attempt+1, ReasonNoCredential, "no_keystore", nil)
	case err != nil:
		log.Error("backend secret unavailable", "err", err)
		return c.finish(processors.StatusFailed, rec.Attempt+1, ReasonNoCredential, "backend_secret_unavailable", nil)
	}
	// Taken over, the call's tool may hand back a token of the dead
	// owner's, stored with its answer, which this executor never saw.
	sec := secrets{backend: backend, anyToken: reclaimed}
	if x.cfg.Credentials != nil {
		grant := credentials.Grant{
			Tenant: rec.Key.TenantID, User: tmpl.UserID, Agent: tmpl.AgentID, Executor: x.cfg.Owner,
			Tool: tool.Name, ToolVersion: tool.Version, Audience: tool.Backend.Audience,
			CallID: rec.CallID, IdempotencyKey: rec.Key.String(), Deadline: stop,
			// Every attempt sends these bytes.
			BodySHA256: credentials.BodyDigest(rec.Arguments),
			// The credential the claim recorded, or none.
			JTI: rec.Credential.JTI, Family: rec.Credential.Family,
		}
		cred, err := x.mint(grant, tool.Timeout())
		if errors.Is(err, credentials.ErrFamilyChanged) {
			if !reclaimed {
				// The key rotated between the claim and now: the
				// claim names a credential this executor can no
				// longer mint. Given back, nothing sent; the next
				// claim names the new key's family.
				return x.releaseClaim(ctx, c, log, refusal{reason: "credential_key_rotated", detail: err.Error(), after: time.Millisecond})
			}
			// Taken over, it cannot be given back (the earlier owner
			// may have sent): the call's jti under the key signing
			// now, which the events name.
			log.Warn("the signing key rotated since the claim; the call's credential minted under the new key's family", "recorded_family", rec.Credential.Family)
			grant.Family = ""
			cred, err = x.mint(grant, tool.Timeout())
		}
		if err != nil {
			// Nothing was sent: without a credential the tool is
			// not called.
			switch {
			case !errors.Is(err, credentials.ErrDeadlinePassed) || reclaimed:
				// Failed below (a takeover: outcome_unknown).
			case !rec.DeadlineAt.IsZero() && !stop.Before(rec.DeadlineAt):
				// Too little of the call's own time is left for a
				// credential (they expire on whole seconds): it
				// expires, as past its deadline, not for want of a
				// credential.
				return c.expire()
			default:
				// Too little of the claim's lease is left (a tool
				// with a short timeout has a lease of a second or
				// less, and a credential expires on a whole second
				// before its end), which says nothing of the call:
				// given back, to be claimed again under a fresh lease.
				return x.releaseClaim(ctx, c, log, refusal{reason: "credential_late", after: time.Millisecond,
					detail: fmt.Sprintf("the claim's lease ends at %s, within the second its credential would be minted in: nothing was sent", stop.Format(time.RFC3339Nano))})
			}
			log.Error("mint credential", "err", err)
			return c.finish(processors.StatusFailed, rec.Attempt+1, ReasonNoCredential, "", nil)
		}
		// Its family is known once it is minted: the key that signed it
		// names it. A credential not sent is harmless.
		if r := x.revoked(cred.JTI, cred.Family, cred.IssuedAt, c.sentUnder()); r != nil {
			return refuse(*r)
		}
		sec.bearer = cred.Token
		c.jti, c.scope, c.family, c.issued = cred.JTI, cred.Scope, cred.Family, cred.IssuedAt
		// Renewed under the same jti and family (renewCredential).
		grant.JTI, grant.Family = cred.JTI, cred.Family
		c.grant, c.expires = &grant, cred.ExpiresAt
	}

	if g == nil {
		g = x.guard(tool, rec.Key.TenantID)
		defer x.release(g)
	}
	attempt := rec.Attempt
	c.firstAttempt = attempt + 1
	if tmpl.ResourceVersion != "" && tool.ResourceVersion != nil && tool.ResourceVersion.IfMatch && ifMatch(tool, tmpl) == "" {
		// The tool asked for If-Match, and this version cannot be one:
		// the executor's read just now is all that checks it.
		log.Warn("the approved resource version cannot be sent as If-Match (not a strong entity tag); sent without", "resource_version", tmpl.ResourceVersion)
	}
	// unknownErr is the last attempt that may have reached the tool
	// and applied the effect: no answer, or a 5xx (a tool that failed
	// after its effect, a gateway that lost the tool's answer).
	var lastErr, unknownErr error
	// answered: an attempt reached the tool, which said it did nothing
	// (429), or the tool only reads: this executor's, or one of an
	// earlier claim given back after it (its release raised the
	// record's attempt). A taken-over call's earlier attempts are
	// unknown.
	answered := rec.Attempt > 0 && !reclaimed
	// lost: an attempt's 2xx answer whose body was lost (lostAttempt's):
	// the call succeeded, whatever later attempts say.
	var lost *httptool.Response
	var lostAttempt int
	for n := 0; n < x.cfg.MaxAttempts; n++ {
		if n > 0 {
			wait := x.cfg.RetryBackoff << (n - 1)
			if ra := retryAfter(lastErr); ra > wait {
				// The tool said when to ask again (Retry-After on a
				// 429 or 5xx). Past the call's time it is not asked
				// again: the last answer stands.
				if dl, ok := callCtx.Deadline(); ok && !time.Now().Add(ra).Before(dl) {
					log.Info("the tool asks to wait past the call's time; not asked again", "retry_after", ra)
					break
				}
				wait = ra
			}
			select {
			case <-callCtx.Done():
			case <-time.After(wait):
			}
		}
		if callCtx.Err() != nil {
			break
		}
		attempt++
		// Nothing this claim sent may have reached the tool, and the
		// call was not taken over: it can be given back if its wait for
		// a slot takes its lease (attempt). Any other is sent with what
		// is left, since its outcome is for a retry under its key, or
		// the reconciler, to find.
		givable := unknownErr == nil && !reclaimed
		resp, err := x.attempt(callCtx, g, tool, target, tmpl, rec, attempt, givable, &sec, c)
		if err == nil {
			return c.succeed(tool, attempt, resp, sec, false)
		}
		if he, ok := errors.AsType[*httptool.Error](err); ok && he.Kind == httptool.Unknown && he.Status >= 200 && he.Status < 300 {
			// The tool said it did it (a 2xx status line arrived whole,
			// as a refusal's would stand), and only its answer's body
			// was lost on the way (cut, or past the tool's timeout):
			// the call succeeded. A read, or a tool that replays a
			// key's answer, is asked again for the result; otherwise,
			// or if no answer comes whole, it succeeded without it.
			// Taken for an outcome unknown, it was handed to the
			// reconciler, and under undo_unknown undone; a read was
			// failed.
			lost, lostAttempt = &resp, attempt
			if tool.Effect != schemas.EffectRead && tool.Idempotency != schemas.IdempotencyNative {
				break
			}
			log.Info("the tool's answer was lost after its 2xx status; asked again for its result", "attempt", attempt, "err", err)
			answered, lastErr = true, err
			continue
		}
		if lost != nil {
			// Asked again for a lost result, which did not come: the
			// call succeeded all the same.
			break
		}
		if tool.Effect != schemas.EffectRead && spentAtTheTool(err, resp) {
			// The tool says the call's credential already had its
			// effect there (credentials.ReasonSpent): under this call's
			// key and body, so the effect is this call's, applied by a
			// request of it whose answer was lost (a proxy in between
			// that sent it again), or a copy of it. Failed, its agent
			// would send the call again under another key, and the
			// effect would happen twice. (A read has no effect to be
			// unsure of: its refusal fails it, as any.)
			log.Warn("the tool says the call's credential already had its effect; outcome unknown", "attempt", attempt)
			return c.finish(processors.StatusOutcomeUnknown, attempt, ReasonOutcomeAmbiguous, "credential_spent", nil)
		}
		if hb := x.revokedAtTheTool(callCtx, c, err); hb != nil {
			err = hb
		}
		if hb, ok := errors.AsType[*heldBack](err); ok {
			// No request leaves for a frozen tool, nor past an
			// approval's expiry, a retry's or a takeover's neither. A
			// call no request of which reached the tool is denied; one
			// whose requests the tool answered without effect failed;
			// otherwise (no answer, or a takeover) what the tool did is
			// for the reconciler to find out. A hold that passes (a
			// revoked family, a rotated key, a freeze an approval waits
			// out) gives back a call that sent nothing under its claim,
			// or only requests the tool answered without effect: they
			// leave nothing to find out, and the next claim sends the
			// call with a credential the tools accept.
			switch {
			case hb.decision != nil && hb.decision.Transient() && unknownErr != nil:
				// The policies could not decide before a retry under
				// the same key, an earlier attempt's outcome unknown:
				// this one is not sent, and they decide again before the
				// next, after the loop's backoff. If none leaves, the
				// outcome is unknown under the tool's own code, not the
				// policies' stall.
				log.Info("retry held back: the policies could not decide the approved call; decided again before the next attempt", "reason", hb.why)
				err = &httptool.Error{Kind: httptool.NotSent, Detail: "the policies could not decide the approved call before its retry was to leave", Err: hb}
			case unknownErr != nil:
				log.Warn("request held back before a retry of a call that may have reached the tool; outcome unknown", "why", hb.why)
				return c.finish(processors.StatusOutcomeUnknown, attempt-1, ReasonOutcomeAmbiguous, hb.why, nil)
			case reclaimed:
				log.Warn("taken-over call held back before it was sent again; outcome unknown", "why", hb.why)
				return c.finish(processors.StatusOutcomeUnknown, max(attempt-1, rec.Attempt+1), ReasonLeaseExpired, "reclaimed_"+hb.why, nil)
			case hb == errRevoked || hb == errJTIRevoked:
				// Given back, as when the revocation is found right
				// after the mint, until the tools accept its next
				// credential; unless the call's own jti is revoked,
				// which no credential of the call passes.
				r := x.revoked(c.jti, c.family, c.issued, c.sentUnder())
				if r == nil {
					// Undone meanwhile: claimed again at once.
					r = &refusal{reason: hb.why, later: true, detail: "the call's credential (jti " + c.jti + ", family " + c.family + ") was revoked; " + c.sentUnder()}
				}
				if answered && !r.later {
					return c.heldAfterAnswers(log, attempt, hb.why)
				}
				return refuse(*r)
			case hb == errCredentialRotated:
				// Given back, as when the key rotated before the first
				// mint; the next claim names the new key's family.
				return x.releaseClaim(ctx, c, log, refusal{reason: hb.why, after: time.Millisecond,
					detail: "the call's credential (jti " + c.jti + ", family " + c.family + ") would expire before its request could land, and could not be minted again under its family: " + c.sentUnder()})
			case hb == errCredentialLate && !rec.DeadlineAt.IsZero() && !stop.Before(rec.DeadlineAt):
				if answered {
					return c.heldAfterAnswers(log, attempt, hb.why)
				}
				// As when the first mint comes too late: too little of
				// the call's own time is left.
				return c.expire()
			case hb == errCredentialLate:
				return x.releaseClaim(ctx, c, log, refusal{reason: hb.why, after: time.Millisecond,
					detail: "the call's credential (jti " + c.jti + ") would expire before its request could land, and too little of the claim's lease is left to mint it again: " + c.sentUnder()})
			case hb.freeze != nil && x.waitsOutFreeze(rec, tmpl):
				// No takeover, and nothing the tool may have applied
				// was sent under this claim.
				return x.holdFrozen(ctx, c, log, tool.Name, *hb.freeze)
			case hb.decision != nil && hb.decision.Transient():
				// The policies could not decide: nothing the tool may
				// have applied was sent under this claim, so it is
				// given back, to be decided again, as at its start.
				log.Info("request held back: the policies could not decide the approved call; claim given back", "reason", hb.why)
				return x.releaseClaim(ctx, c, log, refusal{reason: hb.why, later: true, decision: *hb.decision,
					detail: "the policies could not decide the approved call before its request was to leave: " + hb.decision.Detail})
			case answered && hb.decision != nil:
				// Failed, naming the decision that refused it, as its
				// denial would.
				log.Info("request held back before a retry: the policies in force deny the approved call", "policy_version", hb.decision.Version)
				return c.finishWith(processors.StatusFailed, attempt-1, ReasonUnavailable, hb.why, nil,
					denial("the policies in force when its retry was to leave deny the approved call", *hb.decision))
			case answered:
				return c.heldAfterAnswers(log, attempt, hb.why)
			case hb.freeze != nil:
				a := *hb.freeze
				log.Info("tool frozen before the call started")
				return c.deny(ReasonToolFrozen, control.FrozenDetail(tool.Name, a), policy.Decision{})
			case hb.decision != nil:
				log.Info("the policies in force deny the approved call before its request could leave", "policy_version", hb.decision.Version)
				return c.deny(hb.why, "the policies in force when its request was to leave deny the approved call", *hb.decision)
			default:
				log.Info("approval expired before the call's request could leave")
				return c.deny(ReasonApprovalExpired, "the approval expired before the call's request could leave", policy.Decision{})
			}
		}
		lastErr = err
		if again := x.cfg.Now().Add(x.cfg.RetryBackoff); (errors.Is(err, errNoSlotInLease) || errors.Is(err, errStaleInLease)) &&
			waitsFor(rec, tmpl, again) {
			// Only the claim's lease ran out waiting for a slot of the
			// tool's bulkhead, for a call that may be given back
			// (givable): it is, and claimed again with a lease of its
			// own, here or by another executor, rather than sent too
			// late or failed. Unlike an open breaker's, a bulkhead's
			// backlog drains as its calls end (each within the tool's
			// timeout), so a call without a deadline is given back too.
			// A taken-over call is not: its first owner may have sent
			// it, which a claim given back would forget. So too when
			// the lease ran out waiting for a current copy of the kill
			// switch: another executor's, or this one's caught up, may
			// let the call through within its deadline.
			if errors.Is(err, errStaleInLease) {
				return x.releaseClaim(ctx, c, log, refusal{reason: CodeControlStale,
					detail: "no copy of the control topic known current within the claim's lease; " + c.sentUnder()})
			}
			return x.releaseClaim(ctx, c, log, refusal{reason: "bulkhead_full",
				detail: fmt.Sprintf("no slot of %s's bulkhead within the claim's lease; %s", tool.Name, c.sentUnder())})
		}
		if errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests) {
			// Nothing was sent, and the tenant's breaker for the tool
			// stays open longer than any backoff: waiting to try again
			// would only hold up the step. An open breaker is a
			// passing refusal: a call that sent nothing under this
			// claim is given back until the breaker may let it
			// through, and tried again, as long as its deadline (and
			// its approval) leave room. Ended failed, it would hold
			// its key for good (the agent retries under it) though
			// nothing was ever sent. Without a deadline, or too near
			// it, it ends failed (breaker_open) as before.
			if open := x.cfg.Breaker.OpenFor; n == 0 && !reclaimed && roomFor(rec, tmpl, x.cfg.Now().Add(open)) {
				return x.releaseClaim(ctx, c, log, refusal{reason: "breaker_open", after: open,
					detail: fmt.Sprintf("the breaker for %s is open for this tenant; nothing was sent", tool.Name)})
			}
			break
		}
		if errors.Is(err, httptool.ErrInvalidRequest) {
			// Nothing was sent, and sending again will not help.
			return c.finish(processors.StatusFailed, attempt, ReasonUnavailable, "invalid_request", nil)
		}
		var he *httptool.Error
		if errors.As(err, &he) {
			switch he.Kind {
			case httptool.Refused:
				if he.Status == http.StatusPreconditionFailed && ifMatch(tool, tmpl) != "" {
					// The tool found the resource at another version
					// than the approval's (If-Match): changed since
					// the last read, by a call that ran meanwhile.
					return c.finish(processors.StatusFailed, attempt, ReasonResourceChanged, "http_412", nil)
				}
				return c.finish(processors.StatusFailed, attempt, ReasonToolRefused, fmt.Sprintf("http_%d", he.Status), nil)
			case httptool.Throttled:
				answered = true
			case httptool.ServerError, httptool.Unknown:
				if tool.Effect == schemas.EffectRead {
					if he.Kind == httptool.Unknown && he.Status != 0 {
						// An answer the client cannot place (a
						// redirect, say): asking again gets the same.
						return c.finish(processors.StatusFailed, attempt, ReasonToolFailed, errorCode(he), nil)
					}
					// A read has no effect to be unsure of: its 5xx,
					// or no answer, says it failed and nothing else,
					// and running it again is harmless.
					answered = true
					break
				}
				if tool.Idempotency != schemas.IdempotencyNative {
					// A retry could apply the effect twice.
					return c.finish(processors.StatusOutcomeUnknown, attempt, ReasonOutcomeAmbiguous, errorCode(he), nil)
				}
				// A retry under the same key is safe, and its answer
				// (the tool's stored outcome for the key) settles the
				// call; until one does, the effect may have happened.
				unknownErr, c.unanswered = err, true
			}
		}
		log.Warn("tool attempt failed", "attempt", attempt, "err", err)
	}
	if lost != nil {
		log.Warn("the tool's answer was lost after its 2xx status; the call succeeded without its result", "attempt", lostAttempt)
		return c.succeed(tool, lostAttempt, *lost, sec, true)
	}
	if callCtx.Err() != nil && lastErr == nil {
		lastErr = callCtx.Err()
	}
	if unknownErr != nil && notSent(lastErr) {
		// A later attempt that never left (no slot before the
		// deadline, an open breaker) does not undo an earlier one that
		// may have reached the tool: the outcome is unknown, not
		// failed.
		lastErr = unknownErr
	}
	return c.exhausted(tool, attempt, lastErr)
}

// denyMismatched denies calls whose record no longer matches the hash they
// were authorized with, in one store move: denied, never run.
func (x *Executor) denyMismatched(ctx context.Context, tmpls []ledger.Event, recs []processors.Record, out *[]*kgo.Record, logged *[]processors.Logged) error {
	if len(recs) == 0 {
		return nil
	}
	moves := make([]processors.Move, len(recs))
	evs := make([]ledger.Event, len(recs))
	for i, rec := range recs {
		c := &completion{x: x, tmpl: tmpls[i], rec: rec}
		ev := c.event(statemachine.EventDenied, rec.Seq+1, x.cfg.Now())
		ev.Decision, ev.Reason = "deny", ReasonArgumentIntegrity
		ev.Detail = "the execution record's arguments hash is not the one the call was authorized with"
		ev.PolicyID, ev.PolicyVersion, ev.Obligations = nil, "", nil
		outbox, err := ledger.EncodeEvents([]ledger.Event{ev})
		if err != nil {
			return err
		}
		evs[i] = ev
		moves[i] = processors.Move{Key: rec.Key, From: processors.StatusAuthorized, FromSeq: rec.Seq, FromUndoMarks: rec.UndoMarks, To: processors.StatusDenied, Seq: rec.Seq + 1, Outbox: outbox}
	}
	applied, err := x.cfg.Store.Move(ctx, moves)
	if err != nil {
		return fmt.Errorf("deny %d mismatched calls: %w", len(moves), err)
	}
	for i, ok := range applied {
		if !ok {
			continue
		}
		r, err := evs[i].Record(x.cfg.Topics.Events)
		if err != nil {
			return err
		}
		*out = append(*out, r)
		*logged = append(*logged, processors.Logged{Key: recs[i].Key, Seq: recs[i].Seq + 1})
	}
	return nil
}

// recheckApproval checks an approved call right before it runs: the
// approval is still valid, and the policies in force now still allow the
// call. (That the arguments are the approved ones executeCall checks
// next: the record's hash is the approved event's, and VerifyArguments
// checks that what runs hashes to it. That the approval is used once the
// claim ensures: an approved call is claimed once.) It returns the
// completion that denies the call, and false, when a check fails.
func (x *Executor) recheckApproval(ctx context.Context, c *completion, tool *schemas.Tool, rec *processors.Record, now time.Time) *refusal {
	tmpl := c.tmpl
	if !approvalHolds(&tmpl, now) || tmpl.ExpiresAt == nil {
		return &refusal{reason: ReasonApprovalExpired, detail: "the approval expired before the call could run"}
	}
	args, err := ledger.Decode(rec.Arguments, ledger.Limits{})
	if err != nil {
		return &refusal{reason: ReasonArgumentIntegrity, detail: "the stored arguments do not decode"}
	}
	// (On a copy of the control topic known current: executeCall
	// waited for one.)
	if tmpl.ResourceVersion != "" && x.cfg.Versions != nil {
		vctx, cancel := context.WithTimeout(ctx, checkBudget(ctx, tool))
		v, declared, err := processors.ResourceVersion(vctx, x.cfg.Versions, x.base, tool, args, rec.Key.TenantID)
		cancel()
		if err == nil && declared && v != tmpl.ResourceVersion {
			return &refusal{reason: ReasonResourceChanged, detail: fmt.Sprintf("the resource is at version %s; the approval was for %s", v, tmpl.ResourceVersion)}
		}
		switch {
		case err != nil && processors.VersionReadLater(err):
			// Not knowing is not running: the approval is for a
			// version the executor cannot confirm, and nothing is
			// sent. Nor does the call end on an error that may
			// pass (no answer, a 5xx): it says nothing about the
			// resource. It is checked again later, until its
			// approval expires.
			return &refusal{reason: ReasonVersionUnreadable, detail: "the resource's version cannot be read to confirm the approval: " + err.Error(), later: true}
		case err != nil:
			// One that will not pass (the resource gone, a
			// refusal, a URL that cannot be asked): denied, as
			// before a version that differs.
			return &refusal{reason: ReasonResourceChanged, detail: "the resource's version cannot be read to confirm the approval: " + err.Error()}
		}
	}
	if x.cfg.Policy == nil {
		return nil
	}
	d := x.cfg.Policy.Decide(ctx, policy.NewRequest(tool, approvedCaller(*rec, tmpl), args, tmpl.Channel, now))
	if !d.Allow {
		return &refusal{reason: d.Reason, detail: "the policies in force at execution deny the approved call", decision: d}
	}
	// The call runs under the union of both decisions' obligations: the
	// approver agreed to it under the approval-time decision's (on the
	// approved event), and a policy set that differs here (a version
	// activated since, an executor with another --policy-dir) must not
	// strip a mask from its result. The events that follow record this
	// decision's policy ids and version only: a version names one set,
	// and its ids are that set's policies; the approval-time ones stay on
	// the call's approved event, which says where a carried-over
	// obligation came from.
	c.recheckedBy(d)
	return nil
}

// recheckedBy records d, the policies' decision that lets an approved call
// run (at its start, and again before each retry), on the call's events:
// its policy ids and version, and the union of its obligations with those
// recorded so far (see recheckApproval). Its rate limits are the ones the
// intake charged, not the re-check's, which charges nothing.
func (c *completion) recheckedBy(d policy.Decision) {
	c.tmpl.PolicyID, c.tmpl.PolicyVersion = d.PolicyIDs, d.Version
	obl := d.Obligations
	obl.RateLimits = nil
	c.tmpl.Obligations = withRateLimits(obl.Merge(carriedObligations(c.tmpl.Obligations)).List(), c.tmpl.Obligations)
	c.rechecked = &d
}

// approvedCaller is who asks for an approved call, decided again: who
// its events name.
func approvedCaller(rec processors.Record, tmpl ledger.Event) policy.Caller {
	return policy.Caller{Tenant: rec.Key.TenantID, User: tmpl.UserID, Agent: tmpl.AgentID, Purpose: tmpl.Purpose,
		// Events with roles were decided with them, roles_given or not
		// (builds before it wrote roles alone).
		Roles: tmpl.Roles, RolesWithheld: !tmpl.RolesGiven && len(tmpl.Roles) == 0}
}

// stillAllowed decides an approved call again before a retry, with the
// policies in force (the control copy was just found current): nil when
// they allow it (their decision is then the one the call's events record,
// and whose masks its result gets), else the request is held back with
// their decision. One that says nothing of the call (the engine stalled,
// or has no set while an activation's files are on their way) holds it
// back too, fail closed: the call is given back, to be decided again at
// its next claim, as at its start, unless what it sent may have taken
// effect. The stored arguments were checked at the call's start.
func (x *Executor) stillAllowed(ctx context.Context, c *completion, tool *schemas.Tool, rec *processors.Record, tmpl *ledger.Event) *heldBack {
	args, err := ledger.Decode(rec.Arguments, ledger.Limits{})
	if err != nil {
		return &heldBack{why: ReasonArgumentIntegrity, decision: &policy.Decision{Reason: ReasonArgumentIntegrity, Detail: "the stored arguments do not decode"}}
	}
	d := x.cfg.Policy.Decide(ctx, policy.NewRequest(tool, approvedCaller(*rec, *tmpl), args, tmpl.Channel, x.cfg.Now()))
	switch {
	case d.Allow:
		c.recheckedBy(d)
		return nil
	}
	return &heldBack{why: d.Reason, decision: &d}
}

// backlogEvery is how often a step waiting for its calls asks whether
// events for the next step were fetched meanwhile.
const backlogEvery = 5 * time.Millisecond

// checkBudget bounds a read that a check before the call's request makes
// (the resource's version, a current copy of the control topic) as one
// of the tool's requests, and to half the call's time: one that hangs
// must not take the call's time (which would end it, as not started),
// nor hold the claim until its lease runs out; the call is given back.
func checkBudget(ctx context.Context, tool *schemas.Tool) time.Duration {
	budget := tool.Timeout()
	if dl, ok := ctx.Deadline(); ok {
		budget = min(budget, time.Until(dl)/2)
	}
	return budget
}

// gate is the checks made right before a request leaves (attempt: the
// kill switch, the approval's expiry) made once more when its connection
// is ready (httptool.Request.Gate), without waiting: a new connection's
// dial and TLS handshake, which can take seconds, come between, and a
// freeze made or an approval lapsed meanwhile must still stop it. A copy
// of the kill switch not known current holds it back too; the next
// attempt waits for it.
func (x *Executor) gate(tool, tenant string, tmpl *ledger.Event, c *completion) error {
	if x.cfg.Freezes != nil {
		if err := x.cfg.Freezes.Current(x.noWait, x.cfg.ControlMaxStaleness); err != nil {
			return err
		}
		if a, frozen := x.cfg.Freezes.Frozen(tool, tenant); frozen {
			return frozenBy(a)
		}
		if err := x.heldRevoked(c); err != nil {
			return err
		}
	}
	if !approvalHolds(tmpl, x.cfg.Now()) {
		return errApprovalLapsed
	}
	return nil
}

// approvalHolds reports whether tmpl's approval, if it waited for one,
// is still good at t: no request of a call past it may leave (I4).
func approvalHolds(tmpl *ledger.Event, t time.Time) bool {
	return tmpl.ApprovalID == "" || tmpl.ExpiresAt != nil && t.Add(approvalMargin).Before(*tmpl.ExpiresAt)
}

// approvalMargin is how long before its expiry an approval stops letting
// a call's request leave. The expiry is on the intake's clock, judged on
// this executor's: each may differ from the store's by what ledger
// doctor accepts (500 ms), and so from each other by twice that. Without
// it, a request could leave after the expiry the approval states.
const approvalMargin = time.Second

// ifMatch is the version an approved call sends as If-Match: the
// approval's, to a tool that declares it honours it, when it can be a
// strong entity tag (httptool.EntityTag); else none.
func ifMatch(tool *schemas.Tool, tmpl *ledger.Event) string {
	if tool.ResourceVersion == nil || !tool.ResourceVersion.IfMatch || httptool.EntityTag(tmpl.ResourceVersion) == "" {
		return ""
	}
	return tmpl.ResourceVersion
}

// ReasonCredentialRevoked: the credential family a call's credential is
// minted in was revoked so recently that the tools would refuse it (the
// call is given back until they no longer do, or, taken over, ends
// outcome_unknown as any refusal of one does).
const ReasonCredentialRevoked = "credential_family_revoked"

// ReasonJTIRevoked is the refusal of a call whose jti was revoked: a call
// keeps its jti for life, so every credential of it is refused by the
// tools from then on, and none is sent. Taken over, the call ends
// outcome_unknown (its earlier owner may have sent), for the reconciler.
const ReasonJTIRevoked = "credential_revoked"

// revoked is revokedFamily's refusal, or, before it, the refusal of a
// call whose jti was revoked (ReasonJTIRevoked), for good. sent says
// what the claim sent (completion.sentUnder), for the detail.
func (x *Executor) revoked(jti, family string, issued time.Time, sent string) *refusal {
	if x.cfg.Freezes != nil && jti != "" {
		if a, ok := x.cfg.Freezes.Revoked(jti, ""); ok && a.JTI == jti {
			return &refusal{reason: ReasonJTIRevoked,
				detail: fmt.Sprintf("credential %s, the call's, was revoked at %s (%s): the tools refuse every credential of the call; %s", jti, a.At.Format(time.RFC3339), a.Reason, sent)}
		}
	}
	return x.revokedFamily(family, issued, sent)
}

// renewCredential mints the call's credential again, under its jti and
// family, when it would expire within an attempt of timeout: a tool whose
// attempts (and the backoffs and Retry-After waits between them) outlast
// the credential's lifetime would otherwise refuse a later attempt 401, the
// call ending failed with its key spent. A renewal is the same credential
// to the tools (they bind a jti to its call, and accept it again for it)
// and to the events, which name the jti and family, not the token. It is
// asked only after the request's holds passed, so a revoked credential is
// never renewed past its revocation. A renewal that fails (the signing key
// rotated since the claim named its family, the lease ends as soon)
// leaves the credential as it was, sent while it still has
// attemptCredentialSlack to live; one that would expire sooner is not
// sent at all (errCredentialRotated, errCredentialLate): the tool would refuse it, and
// the call would end failed with its key spent. Since credentials live
// as long as an attempt, a wait for a slot or a backoff needs a renewal,
// so a key that rotated during it fails one.
func (x *Executor) renewCredential(c *completion, sec *secrets, timeout time.Duration) error {
	if c.grant == nil {
		return nil
	}
	now := x.cfg.Now()
	if c.expires.After(now.Add(timeout)) {
		return nil
	}
	cred, err := x.mint(*c.grant, timeout)
	if err != nil {
		if !c.expires.After(now.Add(attemptCredentialSlack)) {
			x.cfg.Logger.Warn("the call's credential expires before its request could land, and could not be renewed; not sent",
				"call_key", c.rec.Key.String(), "jti", c.jti, "expires", c.expires, "err", err)
			if errors.Is(err, credentials.ErrFamilyChanged) {
				return errCredentialRotated
			}
			return errCredentialLate
		}
		x.cfg.Logger.Warn("the call's credential expires within the attempt, and could not be renewed; sent as it is",
			"call_key", c.rec.Key.String(), "jti", c.jti, "expires", c.expires, "err", err)
		return nil
	}
	if !cred.ExpiresAt.After(c.expires) {
		return nil // the lease ends no later: the one minted serves as well
	}
	// The token sent so far stays a secret: a tool replaying an earlier
	// attempt's answer may echo it.
	sec.earlier = append(sec.earlier, sec.bearer)
	sec.bearer, c.issued, c.expires = cred.Token, cred.IssuedAt, cred.ExpiresAt
	return nil
}

// attemptCredentialSlack is how long past the end of the attempt it is
// minted (or renewed) for a call's credential may expire: enough that the
// whole seconds it expires on leave it valid through its attempt.
const attemptCredentialSlack = 2 * time.Second

// mint mints g for an attempt of timeout starting now: the credential
// expires no later than the attempt's end and attemptCredentialSlack,
// within g.Deadline (the claim's stop). Bound to the claim's stop alone,
// it lived up to the whole lease past a call recorded outcome_unknown
// early in it (its attempts answered at once, 503), and a request queued
// on the way to the tool was accepted long after the reconciler's
// Landing had taken the tool's not_found as final: the call settled
// failed, and applied after.
func (x *Executor) mint(g credentials.Grant, timeout time.Duration) (credentials.Credential, error) {
	if end := x.cfg.Now().Add(timeout + attemptCredentialSlack); g.Deadline.IsZero() || end.Before(g.Deadline) {
		g.Deadline = end
	}
	return x.cfg.Credentials.Mint(g)
}

// revokedAtTheTool is the hold of a request the tool refused 401 because
// the call's credential was revoked (errRevoked, errJTIRevoked), nil if
// it was not, or err is no 401. A revocation reaches the tools, which
// ask the introspection endpoint, up to a second before this executor's
// copy of the control topic, which passed the request: the copy is asked
// again, once current as of the answer, so that the call ends as one
// held back before it left (the tool applied nothing), given back until
// the tools accept its family again, rather than failed tool_refused
// with its key spent.
func (x *Executor) revokedAtTheTool(ctx context.Context, c *completion, err error) error {
	if c.grant == nil || !caughtUpAfter401(ctx, x.cfg.Freezes, x.cfg.ControlMaxStaleness, err) {
		return nil
	}
	return x.heldRevoked(c)
}

// caughtUpAfter401 reports whether err is a tool's 401 and freezes,
// asked again, is current as of its answer: a revocation the tools heard
// of first (introspection) is then in it. The copy must have heard from
// the broker since the answer came (one question for the topic's ends,
// 250 ms apart, and its round trips), not up to maxStaleness before it.
func caughtUpAfter401(ctx context.Context, freezes Freezes, maxStaleness time.Duration, err error) bool {
	he, ok := errors.AsType[*httptool.Error](err)
	if !ok || he.Kind != httptool.Refused || he.Status != http.StatusUnauthorized || freezes == nil {
		return false
	}
	answered := time.Now()
	cctx, cancel := context.WithTimeout(ctx, max(maxStaleness, time.Second))
	defer cancel()
	return freezes.CurrentAsOf(cctx, answered) == nil
}

// spentAtTheTool reports whether err is the tool's refusal of the call's
// credential as already spent by its effect: 401, its JSON body's error
// credentials.ReasonSpent (as a tool verifying with the credentials
// package answers, the demo backend among them).
func spentAtTheTool(err error, resp httptool.Response) bool {
	he, ok := errors.AsType[*httptool.Error](err)
	if !ok || he.Kind != httptool.Refused || he.Status != http.StatusUnauthorized {
		return false
	}
	var doc struct {
		Error string `json:"error"`
	}
	return json.Unmarshal(resp.Body, &doc) == nil && doc.Error == string(credentials.ReasonSpent)
}

// heldRevoked is the hold of a request whose credential was revoked, by
// its jti (errJTIRevoked) or its family (errRevoked), so that the call
// ends under the revocation's own reason; nil when neither was.
func (x *Executor) heldRevoked(c *completion) error {
	switch r := x.revoked(c.jti, c.family, c.issued, ""); {
	case r == nil:
		return nil
	case r.reason == ReasonJTIRevoked:
		return errJTIRevoked
	default:
		return errRevoked
	}
}

// revokedFamily is the refusal for now of a call whose credential was
// minted in a family revoked so recently (up to RevocationSkew ago) that
// its tool would refuse the credential: nothing is sent, and the call is
// given back until the tools accept the family's credentials again, those
// issued after the revocation's window. Before, it was sent, the tool
// answered 401, and the call ended failed (tool_refused), its key spent,
// with nothing to say why. The family is the signing key's (FamilyOf),
// which the next claim does not change: claimed again sooner, the call
// would only be given back again.
func (x *Executor) revokedFamily(family string, issued time.Time, sent string) *refusal {
	if x.cfg.Freezes == nil {
		return nil
	}
	a, ok := x.cfg.Freezes.Revoked("", family)
	if !ok || !control.Covers(a, issued, x.cfg.RevocationSkew) {
		return nil
	}
	// The tools refuse a credential of the family issued (its iat,
	// whole seconds) up to until.
	until := a.At.Add(max(x.cfg.RevocationSkew, 0))
	now := x.cfg.Now()
	// The first second whose credentials the tools accept again.
	accepted := time.Unix(until.Unix()+1, 0)
	// Past it already (the credential was minted a second earlier):
	// given back for RetryBackoff.
	return &refusal{reason: ReasonCredentialRevoked, later: true, after: max(accepted.Sub(now), 0),
		detail: fmt.Sprintf("credential family %s was revoked at %s (%s), and the tools refuse its credentials issued until %s: %s, and the call is claimed again from %s", family, a.At.Format(time.RFC3339), a.Reason, until.Format(time.RFC3339), sent, accepted.Format(time.RFC3339))}
}

// leaseBound reports whether the call's time under its claim ends with
// the claim's lease (less LeaseMargin), not at the call's own deadline.
func (x *Executor) leaseBound(rec *processors.Record) bool {
	return rec.DeadlineAt.IsZero() || !rec.DeadlineAt.Before(rec.LeaseUntil.Add(-x.cfg.LeaseMargin))
}

// waitsOutFreeze reports whether rec, whose tool is frozen, is given back
// until the freeze is lifted rather than denied: a call an approver, or
// the ledger's own undo, stands behind, with room to wait FrozenRecheck.
// Denied, its key would be spent, and with it the approval, or the one
// compensation the reconciler runs for the call; the intake lets such
// calls stand while the tool is frozen too. Its agent's plain call is
// denied, to be sent again under a new key if still wanted.
func (x *Executor) waitsOutFreeze(rec *processors.Record, tmpl *ledger.Event) bool {
	return decided(*rec, *tmpl) && waitsFor(rec, tmpl, x.cfg.Now().Add(x.cfg.FrozenRecheck))
}

// holdFrozen gives back a call that waits out its tool's freeze a (see
// waitsOutFreeze), for FrozenRecheck.
func (x *Executor) holdFrozen(ctx context.Context, c *completion, log callLog, tool string, a control.Action) processors.Completion {
	return x.releaseClaim(ctx, c, log, refusal{reason: ReasonToolFrozen, after: x.cfg.FrozenRecheck,
		detail: control.FrozenDetail(tool, a) + "; " + c.sentUnder() + ", and the call waits for the unfreeze"})
}

// sentUnder says what a claim given back sent: nothing, requests the
// tool answered without effect (sent), or the headers of one (exposed);
// and, when this claim sent nothing, what the call's earlier claims may
// have: an owner whose lease ran out (reclaimed), requests answered
// without effect (the record's attempts), or a credential's headers
// (its lapsed families).
func (c *completion) sentUnder() string {
	switch {
	case c.sent > 0:
		return "only requests the tool answered without effect were sent"
	case c.exposed:
		return "nothing was sent but a request's headers, its body held back"
	case c.reclaimed:
		return "nothing was sent under this claim; the owner whose lease ran out may have sent the call's requests"
	case c.rec.Attempt > 0:
		return "nothing was sent under this claim; an earlier claim's requests were, and the tool answered them without effect"
	case len(c.rec.LapsedFamilies) > 0:
		return "nothing was sent under this claim; an earlier claim's credential reached the tool, with a request's headers"
	}
	return "nothing was sent"
}

// heldAfterAnswers ends a call held back for good (why) before a retry,
// whose requests the tool answered without effect: it started, and did
// nothing: failed, not denied.
func (c *completion) heldAfterAnswers(log callLog, attempt int, why string) processors.Completion {
	log.Info("request held back before a retry", "why", why)
	return c.finish(processors.StatusFailed, attempt-1, ReasonUnavailable, why, nil)
}

// decided reports whether a decision beyond the call's own policies
// stands behind rec: an approver's (its authorized event follows an
// approval), or the ledger's (rec is a compensation).
func decided(rec processors.Record, tmpl ledger.Event) bool {
	_, undo := rec.Key.Compensates()
	return undo || tmpl.ApprovalID != ""
}

// roomFor reports whether the call may still run at t: before its
// deadline, and its approval's expiry if it waited for one. A call
// without a deadline has none to wait within.
func roomFor(rec *processors.Record, tmpl *ledger.Event, t time.Time) bool {
	if rec.DeadlineAt.IsZero() || !t.Before(rec.DeadlineAt) {
		return false
	}
	return approvalHolds(tmpl, t)
}

// waitsFor reports whether the call may be given back until t: it has
// room to run then (roomFor), or no deadline and an approval, if any,
// that still holds then.
func waitsFor(rec *processors.Record, tmpl *ledger.Event, t time.Time) bool {
	return rec.DeadlineAt.IsZero() && approvalHolds(tmpl, t) || roomFor(rec, tmpl, t)
}

// carriedObligations reads back, from an approved event's obligations
// (policy.Obligations.List), those an approved call keeps when the
// policies in force at execution decide it again: its masks, sandbox,
// require_approval (what tells later readers that the call waited for a
// human), and undo_unknown. That last one is kept too, though it makes
// the ledger act rather than hold back: it does not undo anything by
// itself, for the reconciler only asks for the compensation, which the
// intake decides as a call of its own under the policies in force then,
// so a set that no longer wants the undo can still deny it; dropped, it
// would leave an outcome nobody can establish to a human against the
// wish of the policy the approver saw. The rate limits are not read: the
// intake applied them before the approval, and the executor applies none.
func carriedObligations(list []string) policy.Obligations {
	return policy.Obligations{
		RequireApproval: slices.Contains(list, "require_approval"),
		Mask:            obligationMasks(list),
		Sandbox:         slices.Contains(list, "sandbox"),
		UndoUnknown:     slices.Contains(list, "undo_unknown"),
	}
}

// withRateLimits puts the rate limits of carried (an approved call's
// obligations as its approval recorded them) into list, where List puts
// them: before sandbox and undo_unknown.
func withRateLimits(list, carried []string) []string {
	var rls []string
	for _, o := range carried {
		if strings.HasPrefix(o, "rate_limit:") {
			rls = append(rls, o)
		}
	}
	i := slices.IndexFunc(list, func(o string) bool { return o == "sandbox" || o == "undo_unknown" })
	if i < 0 {
		i = len(list)
	}
	return slices.Insert(list, i, rls...)
}

// stillToUndo is the second check of a compensation the reconciler asked
// for, once its call is marked (MarkUndo): the call must still be
// outcome_unknown or parked for this compensation (AutomaticUndoes).
// Another reconciler may have handed it to a human (parked again,
// compensation_abandoned) after it found no compensation requested and
// before this one was admitted; the human, told that none was, may undo
// it by hand. Read after the mark, for the mark fences out a hand-over
// decided before it: what this finds is not undone by such a move later.
// ok is false, with the call's status, when the call is not to be undone.
func (x *Executor) stillToUndo(ctx context.Context, orig ledger.CallKey) (processors.Status, bool, error) {
	cur, err := x.cfg.Store.Get(ctx, orig)
	if err != nil {
		return "", false, err
	}
	return cur.Status, compensation.AutomaticUndoes(cur), nil
}

// releaseClaim releases the claim of a call that sent nothing (or only
// requests the tool answered without effect, whose credential family the
// release records), for the policies (or whether a compensation has
// anything to undo) could not be decided now, or the tool's breaker is
// open: the call stays executing,
// without an owner, for RetryBackoff (r.after), and the sweep of expired leases (or a
// redelivery) then claims it afresh (Claimed, not Reclaimed). It returns
// no completion: the step records nothing for the call, and the log
// still holds its approved event as its last.
//
// A store that fails is asked again a few times. Should it still fail,
// the call is neither ended nor left to its lease: ending it failed
// would end for good, on a passing store error, an approved call that
// never ran; and a lapsed lease passes for a takeover, which takes the
// call for one that may have been sent (outcome_unknown, at once for a
// tool without native idempotency). The executor holds the claim
// instead (held): the call counts as in flight here, so that neither a
// redelivery nor its sweep takes it over, and every step asks the store
// again to take it back, until it does or another owner has the call
// (which could only take it over once the lease lapsed: as after a
// crash, it then treats the call as possibly sent, and sends it at most
// once).
func (x *Executor) releaseClaim(ctx context.Context, c *completion, log callLog, r refusal) processors.Completion {
	rel := processors.Release{Key: c.rec.Key, Epoch: c.rec.Epoch, After: cmp.Or(r.after, x.cfg.RetryBackoff)}
	if c.exposed {
		// The next claim may name another family (its key rotated):
		// the call's events still name this one. And it numbers its
		// attempts after those sent, knowing that the call started.
		rel.Sent, rel.Attempt = c.family, c.sent
	}
	applied, err := x.releaseClaims(context.WithoutCancel(ctx), []processors.Release{rel}, releaseTries, 10*time.Second)
	switch {
	case err != nil:
		log.Error("give back a call not decided yet; held, to be given back by a later step", "reason", r.reason, "err", err)
		x.mu.Lock()
		x.held[rel.Key] = rel
		x.mu.Unlock()
		x.cfg.Metrics.Claims("held", 1)
		return processors.Completion{}
	case !applied[0]:
		// Fenced out: another owner holds the call now.
		log.Warn("claim lost before it could be given back", "reason", r.reason)
		return processors.Completion{}
	}
	level := slog.LevelWarn
	if r.reason == ReasonToolFrozen {
		// Every FrozenRecheck for as long as the freeze lasts, which
		// the freeze's own record says.
		level = slog.LevelDebug
	}
	log.log(level, "call not run yet (the policies, whether there is anything to undo, or the approved resource's version could not be read, the tool's breaker is open or its bulkhead had no slot (or the control topic no copy known current) within the claim's lease, its credential's family was revoked or its signing key rotated since the claim, its tool version is unknown here or defined otherwise, or its tool is frozen and an approval or a compensation stands behind it); claim given back, to be tried again", "reason", r.reason,
		"detail", r.detail, "retry_after", rel.After, "sent_family", rel.Sent)
	x.cfg.Metrics.Claims("released", 1)
	return processors.Completion{}
}

// releaseTries bounds the tries to give a claim back right after its
// re-check (releaseClaim); later steps try again (releaseHeld).
const releaseTries = 4

// releaseClaims gives claims back (Store.Release), trying up to tries times
// within budget, RetryBackoff apart at first and twice as long each time
// after. Right after a re-check it is given a context that shutdown does
// not cancel: a claim not given back is held (releaseClaim).
func (x *Executor) releaseClaims(ctx context.Context, rs []processors.Release, tries int, budget time.Duration) ([]bool, error) {
	rctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	var err error
	for n := 0; n < tries; n++ {
		if n > 0 {
			select {
			case <-rctx.Done():
				return nil, err
			case <-time.After(x.cfg.RetryBackoff << (n - 1)):
			}
		}
		var applied []bool
		if applied, err = x.cfg.Store.Release(rctx, rs); err == nil {
			return applied, nil
		}
	}
	return nil, err
}

// releaseHeld asks the store again to take back the claims this
// executor holds since it failed to give them back (releaseClaim): those
// it takes back, or finds another owner of, are no longer held. A step
// asks at most once a second (or RetryBackoff, if longer), briefly and
// within the step's context, so that a store that still fails does not
// hold up every step nor fill the log; Drain asks one last time (last),
// with longer.
func (x *Executor) releaseHeld(ctx context.Context, last bool) {
	now := time.Now()
	x.mu.Lock()
	if len(x.held) == 0 || (!last && now.Sub(x.heldTried) < max(x.cfg.RetryBackoff, time.Second)) {
		x.mu.Unlock()
		return
	}
	x.heldTried = now
	rs := make([]processors.Release, 0, len(x.held))
	for _, r := range x.held {
		rs = append(rs, r)
	}
	x.mu.Unlock()
	budget := 2 * time.Second
	if last {
		ctx, budget = context.WithoutCancel(ctx), 10*time.Second
	}
	applied, err := x.releaseClaims(ctx, rs, 1, budget)
	if err != nil {
		x.cfg.Logger.Warn("give back calls held since their release failed; asked again later", "calls", len(rs), "err", err)
		return
	}
	n := 0
	x.mu.Lock()
	for i, r := range rs {
		if h, ok := x.held[r.Key]; ok && h.Epoch == r.Epoch {
			delete(x.held, r.Key)
		}
		if applied[i] {
			n++
		} else {
			x.cfg.Logger.Warn("claim lost before it could be given back", "call_key", r.Key.String(), "epoch", r.Epoch)
		}
	}
	x.mu.Unlock()
	if n > 0 {
		x.cfg.Logger.Info("calls held since their release failed given back, to be decided again", "calls", n)
		x.cfg.Metrics.Claims("released", n)
	}
}

// heldKeys are the calls whose claims this executor still holds.
func (x *Executor) heldKeys() []string {
	x.mu.Lock()
	defer x.mu.Unlock()
	keys := make([]string, 0, len(x.held))
	for k := range x.held {
		keys = append(keys, k.String())
	}
	slices.Sort(keys)
	return keys
}

// refusal is why a call must not run: a denial's reason, detail and the
// decision that denied (zero when no policy did).
type refusal struct {
	reason, detail string
	decision       policy.Decision
	// later: the check could not be made now (what it reads did not
	// answer), which says nothing about the call.
	later bool
	// after is how long a call given back (releaseClaim) waits before
	// it is claimed again; zero: Config.RetryBackoff.
	after time.Duration
}

// attempt is one tool invocation through the tenant's share of the tool's
// bulkhead and the tenant's breaker for the tool. The breaker wraps the
// deadline, so a timeout counts against the tool, for this tenant.
// secrets are what an attempt sends that must never be kept: the call's
// credential and the backend's secret, and the tokens of the credential
// sent before it was renewed (renewCredential): a tool that replays a
// key's answer may echo an earlier attempt's.
type secrets struct {
	bearer, backend string
	earlier         []string
	// anyToken: every compact JWS or JWE in the result as it would be
	// kept (masked) counts as a secret. For an answer that may hold a
	// token another executor sent, which this one never saw: the
	// reconciler's status lookups, and a call taken over (a tool that
	// stored its echo of a request replays it). A tool's result that is
	// itself a token is then withheld too, unless masked.
	anyToken bool
}

// inString reports whether v holds a secret.
func (s secrets) inString(v string) bool {
	if s.bearer != "" && strings.Contains(v, s.bearer) || s.backend != "" && strings.Contains(v, s.backend) {
		return true
	}
	if s.anyToken && string(ledger.RedactTokens([]byte(v))) != v {
		return true
	}
	for _, x := range s.earlier {
		if strings.Contains(v, x) {
			return true
		}
	}
	return false
}

// inTree reports whether a string (or key) of v, a tree as ledger.Decode
// returns it, holds a secret.
func (s secrets) inTree(v any) bool {
	switch v := v.(type) {
	case string:
		return s.inString(v)
	case []any:
		for _, e := range v {
			if s.inTree(e) {
				return true
			}
		}
	case map[string]any:
		for k, e := range v {
			if s.inTree(k) || s.inTree(e) {
				return true
			}
		}
	}
	return false
}

// in reports whether p, the answer as it came, or q, as it would be
// kept, holds a secret; any token (anyToken) is looked for in q alone,
// where a mask hides what it masks.
func (s secrets) in(p, q []byte) bool {
	if s.anyToken && !bytes.Equal(ledger.RedactTokens(q), q) {
		return true
	}
	holds := func(x string) bool {
		return x != "" && (bytes.Contains(p, []byte(x)) || bytes.Contains(q, []byte(x)))
	}
	return holds(s.bearer) || holds(s.backend) || slices.ContainsFunc(s.earlier, holds)
}

// attempt sends one attempt of the call, through its tenant's share of
// the tool's bulkhead and its breaker (see secrets). givable: the call
// may be given back (nothing of its claim may have reached the tool, and
// it was not taken over); if so, and the wait for a slot takes the
// claim's lease, the attempt is not sent and its error matches
// errNoSlotInLease; if the wait for a current copy of the kill switch
// does, errStaleInLease. Either wait that leaves it under half the time
// it had before them (late) is taken as its lease's end.
func (x *Executor) attempt(ctx context.Context, g *guard, tool *schemas.Tool, target string, tmpl *ledger.Event, rec *processors.Record, attempt int, givable bool, sec *secrets, c *completion) (httptool.Response, error) {
	left := func() time.Duration {
		dl, _ := ctx.Deadline()
		return time.Until(dl)
	}
	before := left()
	givable = givable && x.leaseBound(rec)
	// late reports whether the waits before the request left a givable
	// call less than half of the time the claim's lease gave the attempt:
	// sent now, it would have a sliver of its timeout, and a tool slower
	// than that would leave the call unknown (parked for a human, for a
	// tool without a key), and count against the tool's breaker.
	late := func() bool {
		budget := min(tool.Timeout(), before)
		return givable && min(tool.Timeout(), left()) < budget/2
	}
	// A call its breaker will refuse takes no slot, nor waits for one:
	// either would count its tenant as using the tool, and a tenant whose
	// calls all meet its open breaker would hold the others to their
	// shares while it sends nothing. It goes as Execute's refusal goes.
	if err := g.refusal(); err != nil {
		x.cfg.Metrics.ToolCall(tool.Name, toolCallResult(err), 0)
		return httptool.Response{}, err
	}
	release, err := x.acquire(ctx, g)
	if err != nil {
		if givable && errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("%w: %w", errNoSlotInLease, err)
		}
		return httptool.Response{}, &httptool.Error{Kind: httptool.NotSent, Detail: "bulkhead full until deadline", Err: err}
	}
	defer release()
	if late() {
		return httptool.Response{}, &httptool.Error{Kind: httptool.NotSent, Detail: "a bulkhead slot came too late in the claim's lease", Err: errNoSlotInLease}
	}
	// The kill switch is checked as late as possible: after the wait for
	// the bulkhead, right before each request leaves; and on a copy of
	// it known to be current, so that an executor that stopped hearing
	// the control topic stops sending rather than miss a freeze.
	if x.cfg.Freezes != nil {
		if err := x.cfg.Freezes.Current(ctx, x.cfg.ControlMaxStaleness); err != nil {
			if givable && errors.Is(err, context.DeadlineExceeded) {
				err = fmt.Errorf("%w: %w", errStaleInLease, err)
			}
			return httptool.Response{}, &httptool.Error{Kind: httptool.NotSent, Detail: "the kill switch's state is not known to be current", Err: err}
		}
		if a, frozen := x.cfg.Freezes.Frozen(tool.Name, rec.Key.TenantID); frozen {
			return httptool.Response{}, frozenBy(a)
		}
		// A revocation too: checked after the mint, it may have come
		// during a retry's backoff or the wait for a slot.
		if err := x.heldRevoked(c); err != nil {
			return httptool.Response{}, err
		}
		// A copy that caught up late in the lease leaves the request
		// as little time as a late slot does: given back as if it
		// had not caught up at all. A freeze it reads still denies
		// the call, since that is known now.
		if late() {
			return httptool.Response{}, &httptool.Error{Kind: httptool.NotSent, Detail: "the kill switch's state was known current too late in the claim's lease", Err: errStaleInLease}
		}
	}
	// An approval is checked as late (I4): recheckApproval checked it at
	// the call's start, and its own reads (the resource's version, the
	// policies), the wait for a slot and a retry's backoff can each
	// outlast it.
	if !approvalHolds(tmpl, x.cfg.Now()) {
		return httptool.Response{}, errApprovalLapsed
	}
	// And the policies in force, as at its start: a version activated
	// during a retry's backoff or the wait for a slot decides whether it
	// leaves. The first attempt's too: recheckApproval decided before
	// the wait for a slot, which may last most of the claim's lease, or
	// until the call's deadline.
	if c.rechecked != nil {
		if hb := x.stillAllowed(ctx, c, tool, rec, tmpl); hb != nil {
			return httptool.Response{}, hb
		}
	}
	if err := x.renewCredential(c, sec, tool.Timeout()); err != nil {
		return httptool.Response{}, err
	}
	ctx, span := x.startSpan(ctx, "tool.call", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("ledger.tool", tool.Name), attribute.Int("ledger.attempt", attempt)))
	defer span.End()
	var gate func() error
	// asked: the gate was asked, so the request's headers, the
	// credential in them, were written to the tool's connection.
	var asked atomic.Bool
	if x.cfg.Freezes != nil || tmpl.ApprovalID != "" {
		gate = func() error {
			asked.Store(true)
			return x.gate(tool.Name, rec.Key.TenantID, tmpl, c)
		}
	}
	t0 := time.Now()
	resp, err := g.breaker.Execute(func() (httptool.Response, error) {
		actx, cancel := context.WithTimeout(ctx, tool.Timeout())
		defer cancel()
		return x.cfg.Caller.Call(actx, httptool.Request{
			Traceparent:    tracing.Traceparent(span.SpanContext()),
			URL:            target,
			IdempotencyKey: rec.Key.String(),
			CallID:         rec.CallID,
			TenantID:       rec.Key.TenantID,
			TraceID:        tmpl.TraceID,
			Attempt:        attempt,
			Arguments:      rec.Arguments,
			Credential:     sec.bearer,
			BackendSecret:  sec.backend,
			MaxResultBytes: tool.MaxResultBytes,
			IfMatch:        ifMatch(tool, tmpl),
			Gate:           gate,
		})
	})
	var he *httptool.Error
	if err != nil && !errors.As(err, &he) && !errors.Is(err, gobreaker.ErrOpenState) && !errors.Is(err, gobreaker.ErrTooManyRequests) && !errors.Is(err, httptool.ErrInvalidRequest) {
		// A Caller's error of no kind this executor knows: the request
		// may have reached the tool, and only a tool that dedupes may
		// be sent it again. (One the adapter refused to send, an
		// invalid request, did not.)
		err = &httptool.Error{Kind: httptool.Unknown, Detail: "unclassified caller error", Err: err}
	}
	switch {
	case errors.As(err, &he) && he.Kind != httptool.NotSent:
		// The request, and the credential in it, reached the tool (or
		// what answers at its address), whatever it answered.
		c.sent, c.exposed = attempt, true
	case asked.Load():
		// Its headers did, before the gate held its body back.
		c.exposed = true
	}
	result := toolCallResult(err)
	d := time.Since(t0)
	c.toolTime += d
	x.cfg.Metrics.ToolCall(tool.Name, result, d)
	span.SetAttributes(attribute.String("ledger.result", result))
	if err != nil {
		span.SetStatus(codes.Error, result)
	}
	return resp, err
}

// startSpan starts a child of the call's span in ctx; a no-op span when
// the executor does not trace.
func (x *Executor) startSpan(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if x.cfg.Tracer == nil {
		return ctx, trace.SpanFromContext(context.Background())
	}
	return x.cfg.Tracer.Start(ctx, name, opts...)
}

// toolCallResult names a request's result for metrics.
func toolCallResult(err error) string {
	var he *httptool.Error
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
		return "breaker_open"
	case errors.As(err, &he) && he.Kind == httptool.Refused:
		return "refused"
	case errors.As(err, &he) && he.Kind == httptool.NotSent, errors.Is(err, httptool.ErrInvalidRequest):
		return "not_sent"
	}
	return "error"
}

// countClaims reports a batch of claims' results.
func (x *Executor) countClaims(results []processors.ClaimResult) {
	var n [processors.NotReady + 1]int
	for _, r := range results {
		if r.Outcome > 0 && r.Outcome <= processors.NotReady {
			n[r.Outcome]++
		}
	}
	for o, c := range n {
		if c > 0 {
			x.cfg.Metrics.Claims(claimResult(processors.ClaimOutcome(o)), c)
		}
	}
}

func (x *Executor) resolve(raw string) (string, error) {
	return processors.ResolveURL(x.base, raw)
}

// completion builds a call's completion and its events.
type completion struct {
	x            *Executor
	tmpl         ledger.Event
	rec          processors.Record
	start        time.Time
	firstAttempt int
	// reclaimed: an earlier owner's lease expired mid-call, so it may
	// have reached the tool.
	reclaimed bool
	// unanswered: an attempt of this owner may have reached the tool and
	// applied the effect, without an answer that says so (no answer, or
	// a 5xx: a native tool's, retried).
	unanswered bool
	// sent is the number of this owner's last attempt whose request
	// reached the tool, whatever it answered; 0 if none did.
	sent int
	// exposed: the credential reached the tool, with a request, or with
	// the headers of one whose body the gate held back.
	exposed bool
	// The execution's credential, for the events: its id, scope and
	// family, never the token.
	jti, scope, family string
	// prior, for a reclaimed call, is the credential the expired claim
	// named, which may have reached the tool: the executing event names
	// it, and every event does when this owner minted none.
	prior processors.CallCredential
	// issued is the credential's iat, which a family's revocation covers
	// up to a time.
	issued time.Time
	// grant minted the credential, which expires at expires; nil when
	// the executor mints none.
	grant   *credentials.Grant
	expires time.Time
	// toolTime is what the tool's requests took, summed over the
	// attempts (ledger.Event.ToolUS).
	toolTime time.Duration
	// rechecked: the decision of the policies in force at execution
	// that allowed the approved call again (recheckApproval); its
	// executing event records it, with the roles it was made with, so
	// that a policy version's (or a role's) blast radius finds the calls
	// it let run.
	rechecked *policy.Decision
}

func (c *completion) event(t statemachine.EventType, seq int64, at time.Time) ledger.Event {
	e := c.tmpl
	e.EventID = uuid.Must(uuid.NewV7()).String()
	e.Type = t
	e.Seq = seq
	e.At = at.UTC()
	e.Actor = c.x.cfg.Owner
	e.JTI, e.CredentialScope, e.CredentialFamily = c.jti, c.scope, c.family
	if c.jti == "" {
		c.namePrior(&e)
	}
	// The approval's expiry belongs to the approved event, not to what
	// follows it.
	e.ExpiresAt = nil
	return e
}

// namePrior names on e the credential of the expired claim this owner
// took the call over from, if it named one, and the families of the
// call's earlier claims whose credentials may have reached the tool
// (EarlierCredentialFamilies): each owner that took the call over and
// died in turn may have sent under its own, and a claim given back after
// its requests reached the tool sent under its own.
func (c *completion) namePrior(e *ledger.Event) {
	if !c.prior.IsZero() {
		e.JTI, e.CredentialFamily, e.CredentialScope = c.prior.JTI, c.prior.Family, credentials.ToolScope(c.rec.Tool)
	}
	// Set, not added to: the executing event is named twice (event,
	// then finish).
	e.EarlierCredentialFamilies = nil
	for _, f := range c.rec.LapsedFamilies {
		if f != e.CredentialFamily {
			e.EarlierCredentialFamilies = append(e.EarlierCredentialFamilies, f)
		}
	}
}

// finish records a terminal outcome: executing + the terminal event.
func (c *completion) finish(status processors.Status, attempt int, reason, code string, result *sanitized) processors.Completion {
	return c.finishWith(status, attempt, reason, code, result, nil)
}

// finishWith is finish, the terminal event edited by edit (nil: none).
func (c *completion) finishWith(status processors.Status, attempt int, reason, code string, result *sanitized, edit func(*ledger.Event)) processors.Completion {
	now := c.x.cfg.Now()
	if attempt < 1 {
		attempt = 1
	}
	if status == processors.StatusFailed {
		// The later attempts did not settle it, but an earlier one may
		// have reached the tool: that of the owner whose lease expired,
		// or this owner's that got no answer. A retry's refusal says
		// nothing of it either: a 409 "in progress", a 5xx, and a 4xx
		// too, which a backend gives before it looks the key up (a
		// credential revoked since the first attempt: 401; a check of
		// the state the first attempt changed: "already refunded").
		// "failed" would tell the agent that nothing happened, and a
		// retry under a new key would apply the effect twice. Only the
		// reconciler, looking the key up, can tell.
		switch {
		case c.reclaimed:
			status, reason, code = processors.StatusOutcomeUnknown, ReasonLeaseExpired, "reclaimed_"+cmp.Or(code, reason)
		case c.unanswered:
			status, reason, code = processors.StatusOutcomeUnknown, ReasonOutcomeAmbiguous, "retried_"+cmp.Or(code, reason)
		}
	}
	first := c.firstAttempt
	if first < 1 || first > attempt {
		first = attempt
	}
	exec := c.event(statemachine.EventExecuting, c.rec.Seq+1, c.start)
	exec.Attempt = first
	// Executing since the expired claim, whose request may have reached
	// the tool: its credential, not this owner's.
	c.namePrior(&exec)
	if d := c.rechecked; d != nil {
		exec.Decision = "allow"
		// The roles the policies were given now: none, on an executor
		// without --policy-roles, whatever the call was first decided
		// with.
		exec.Roles, exec.RolesGiven = d.Roles, d.RolesGiven
	}
	term := c.event(terminalEvent(status), c.rec.Seq+2, now)
	term.Attempt = attempt
	term.Reason = reason
	term.ErrorCode = code
	term.LatencyMS = now.Sub(c.start).Milliseconds()
	term.ToolUS = c.toolTime.Microseconds()
	var stored []byte
	if result != nil {
		term.ResultDigest = result.digest
		term.ResultBytes = result.bytes
		stored = result.stored
	}
	if edit != nil {
		edit(&term)
	}
	return c.complete(status, attempt, stored, c.rec.Seq+2, exec, term)
}

// denial names on an event the decision that refused the call (or none)
// and why: not the decision that had allowed it.
func denial(detail string, d policy.Decision) func(*ledger.Event) {
	return func(ev *ledger.Event) {
		ev.Decision = "deny"
		ev.Detail = detail
		ev.PolicyID, ev.PolicyVersion, ev.Obligations = d.PolicyIDs, d.Version, nil
		if d.Version != "" {
			// A policy's, made with the roles it was given.
			ev.Roles, ev.RolesGiven = d.Roles, d.RolesGiven
		}
	}
}

// deny records that a check before running refused the call.
func (c *completion) deny(reason, detail string, d policy.Decision) processors.Completion {
	if c.rec.Attempt > 0 {
		// An earlier claim's requests reached the tool, which answered
		// them without effect (its release raised the record's attempt):
		// the call started, and did nothing: failed, not denied, naming
		// what refused it as the denial would.
		return c.finishWith(processors.StatusFailed, c.rec.Attempt, ReasonUnavailable, reason, nil, denial(detail, d))
	}
	ev := c.event(statemachine.EventDenied, c.rec.Seq+1, c.x.cfg.Now())
	// Denied after a takeover (a read's, which runs as a call of its
	// own): the credential that may have reached the tool, not one
	// minted and never sent.
	c.namePrior(&ev)
	ev.Reason = reason
	denial(detail, d)(&ev)
	return c.complete(processors.StatusDenied, c.rec.Attempt, nil, c.rec.Seq+1, ev)
}

// expire records that the deadline passed before the call could run.
func (c *completion) expire() processors.Completion {
	if c.rec.Attempt > 0 {
		// It ran, as deny says: failed, past its deadline.
		return c.finish(processors.StatusFailed, c.rec.Attempt, ReasonDeadlineExceeded, "", nil)
	}
	ev := c.event(statemachine.EventExpired, c.rec.Seq+1, c.x.cfg.Now())
	c.namePrior(&ev)
	ev.Reason = ReasonDeadlineExceeded
	return c.complete(processors.StatusExpired, c.rec.Attempt, nil, c.rec.Seq+1, ev)
}

func (c *completion) complete(status processors.Status, attempt int, result []byte, seq int64, evs ...ledger.Event) processors.Completion {
	outbox, recs, err := ledger.EncodeOutbox(evs, c.x.cfg.Topics.Events)
	if err != nil {
		// Events built here always encode; keep the call claimed so
		// the sweep retries it rather than inventing an outcome.
		c.x.cfg.Logger.Error("encode events", "call_key", c.rec.Key.String(), "err", err)
		return processors.Completion{}
	}
	return processors.Completion{
		Key:     c.rec.Key,
		Epoch:   c.rec.Epoch,
		Status:  status,
		Attempt: attempt,
		Result:  result,
		Seq:     seq,
		Outbox:  outbox,
		Records: recs,
		// Never past what the claim found logged: a revert must not
		// claim more than that.
		From: min(c.rec.Seq, c.rec.LoggedSeq),
	}
}

// succeed records the call succeeded with the tool's answer resp; lost:
// only part of the answer's body arrived, and none of it is kept.
func (c *completion) succeed(tool *schemas.Tool, attempt int, resp httptool.Response, sent secrets, lost bool) processors.Completion {
	if lost {
		resp.Truncated = true
	}
	s := sanitize(tool, resp, resultMasks(tool, c.tmpl.Obligations), sent)
	return c.finish(processors.StatusSucceeded, attempt, "", s.resultCode(resp.Truncated, lost), &s)
}

// resultCode is the error code of a call that succeeded with s, its
// result made safe: why it is kept without all of its content, if it is.
// truncated: the answer was cut; lost: it never came whole.
func (s *sanitized) resultCode(truncated, lost bool) string {
	switch {
	case lost:
		return CodeResultLost
	case s.holdsSecret:
		return CodeResultHoldsSecret
	case truncated:
		return "result_truncated"
	case s.withheld:
		return CodeResultUnmaskable
	}
	return ""
}

// exhausted ends a call whose attempts ran out.
func (c *completion) exhausted(tool *schemas.Tool, attempt int, err error) processors.Completion {
	var he *httptool.Error
	switch {
	case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
		return c.finish(processors.StatusFailed, attempt, ReasonUnavailable, "breaker_open", nil)
	case errors.Is(err, control.ErrStale):
		// Nothing left: the kill switch's state was stale throughout.
		return c.finish(processors.StatusFailed, attempt, ReasonUnavailable, CodeControlStale, nil)
	case errors.As(err, &he) && (he.Kind == httptool.NotSent || he.Kind == httptool.Throttled):
		// Nothing reached the tool, or it said it did nothing.
		return c.finish(processors.StatusFailed, attempt, ReasonUnavailable, errorCode(he), nil)
	case errors.As(err, &he) && he.Kind == httptool.ServerError && tool.Effect == schemas.EffectRead:
		return c.finish(processors.StatusFailed, attempt, ReasonToolFailed, errorCode(he), nil)
	case errors.As(err, &he) && (he.Kind == httptool.ServerError || he.Kind == httptool.Unknown && he.Status != 0):
		// A 5xx does not say the tool did nothing: it may have failed
		// after its effect, or a gateway in front of it may have lost
		// its answer. Only the reconciler, looking the key up, can
		// tell; "failed" would let the agent apply it again under a
		// new key. An answer that cannot be placed (a redirect) is
		// named by its status too, not taken for no answer.
		if c.reclaimed {
			return c.finish(processors.StatusOutcomeUnknown, attempt, ReasonLeaseExpired, "reclaimed_"+errorCode(he), nil)
		}
		return c.finish(processors.StatusOutcomeUnknown, attempt, ReasonOutcomeAmbiguous, errorCode(he), nil)
	case attempt == c.rec.Attempt:
		// Not a single attempt started: the deadline or lease left no
		// room. Nothing was sent.
		return c.finish(processors.StatusFailed, attempt+1, ReasonDeadlineExceeded, "not_started", nil)
	case tool.Effect == schemas.EffectRead:
		// The last attempt got no answer; a read has no effect to be
		// unsure of.
		return c.finish(processors.StatusFailed, attempt, ReasonToolFailed, noAnswerCode(err), nil)
	default:
		// The last attempt may have reached the tool.
		return c.finish(processors.StatusOutcomeUnknown, attempt, ReasonOutcomeAmbiguous, noAnswerCode(err), nil)
	}
}

// Codes of an attempt that got no answer (its error_code).
const (
	// CodeTimeout: the attempt's or the call's time ran out first.
	CodeTimeout = "timeout"
	// CodeConnectionLost: the connection to the tool failed (reset or
	// closed) after it was handed the request, before an answer came.
	CodeConnectionLost = "connection_lost"
)

// noAnswerCode names the failure of an attempt that got no answer, err:
// a connection lost is not a slow tool, and whoever reads the call's
// failure looks in another place for each.
func noAnswerCode(err error) string {
	if he, ok := errors.AsType[*httptool.Error](err); ok && transportFailed(he) && !timedOut(he.Err) {
		return CodeConnectionLost
	}
	return CodeTimeout
}

// transportFailed reports whether he is a request handed to the tool
// that got no answer: its exchange failed in the transport.
func transportFailed(he *httptool.Error) bool {
	return he.Kind == httptool.Unknown && he.Status == 0 && he.Err != nil
}

// timedOut reports whether a transport's error is time running out (or
// the executor stopping), not the connection failing.
func timedOut(err error) bool {
	ne, ok := errors.AsType[net.Error](err)
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || ok && ne.Timeout()
}

// retryAfter is the wait a tool asked for in err's answer (Retry-After),
// or 0.
func retryAfter(err error) time.Duration {
	if he, ok := errors.AsType[*httptool.Error](err); ok {
		return he.RetryAfter
	}
	return 0
}

// notSent reports whether err says an attempt never reached the tool.
func notSent(err error) bool {
	var he *httptool.Error
	return errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests) ||
		errors.As(err, &he) && (he.Kind == httptool.NotSent || he.Kind == httptool.Throttled)
}

func errorCode(he *httptool.Error) string {
	switch {
	case he.Status != 0:
		return fmt.Sprintf("http_%d", he.Status)
	case transportFailed(he):
		return noAnswerCode(he)
	}
	return strings.ToLower(he.Kind.String())
}

func terminalEvent(s processors.Status) statemachine.EventType {
	switch s {
	case processors.StatusSucceeded:
		return statemachine.EventSucceeded
	case processors.StatusOutcomeUnknown:
		return statemachine.EventOutcomeUnknown
	case processors.StatusExpired:
		return statemachine.EventExpired
	}
	return statemachine.EventFailed
}

// template keeps the identity fields of an event, for the events that
// follow it.
func template(e ledger.Event) ledger.Event {
	return ledger.Event{
		TenantID:        e.TenantID,
		IdempotencyKey:  e.IdempotencyKey,
		CallID:          e.CallID,
		UserID:          e.UserID,
		AgentID:         e.AgentID,
		Purpose:         e.Purpose,
		Roles:           e.Roles,
		RolesGiven:      e.RolesGiven,
		Channel:         e.Channel,
		Tool:            e.Tool,
		ToolVersion:     e.ToolVersion,
		ToolDigest:      e.ToolDigest,
		Resource:        e.Resource,
		ArgumentsHash:   e.ArgumentsHash,
		TraceID:         e.TraceID,
		PolicyID:        e.PolicyID,
		PolicyVersion:   e.PolicyVersion,
		Obligations:     e.Obligations,
		ApprovalID:      e.ApprovalID,
		Approver:        e.Approver,
		ExpiresAt:       e.ExpiresAt,
		ResourceVersion: e.ResourceVersion,
	}
}

// recordTemplate recovers a call's identity fields from the events in its
// record's outbox: a call found by the sweep has no event in hand.
func recordTemplate(rec processors.Record) (ledger.Event, error) {
	evs, err := ledger.DecodeEvents(rec.Outbox)
	if err != nil {
		return ledger.Event{}, err
	}
	if len(evs) == 0 {
		return ledger.Event{}, errors.New("empty outbox")
	}
	// The decision (the outbox's last event) carries the policy fields
	// and obligations.
	return template(evs[len(evs)-1]), nil
}

// sanitized is a tool's result made safe to hand back: capped, masked,
// marked untrusted, with a digest of what the tool returned.
type sanitized struct {
	stored []byte
	digest string
	bytes  int
	// withheld: the content is left out, since the masks could not be
	// applied to it.
	withheld bool
	// holdsSecret: the content is left out, since it holds a secret the
	// request carried.
	holdsSecret bool
	// code, for a result the reconciler keeps, is its resultCode.
	code string
}

// digested is a result's digest and size, of b: sha256:<hex>, the form
// events carry (result_digest).
func digested(b []byte) sanitized {
	sum := sha256.Sum256(b)
	return sanitized{digest: "sha256:" + hex.EncodeToString(sum[:]), bytes: len(b)}
}

// resultMasks returns the fields a call's result hides: its tool's
// (registry) and its policies' (mask obligations).
func resultMasks(tool *schemas.Tool, obligations []string) []string {
	return append(append([]string(nil), tool.Mask...), obligationMasks(obligations)...)
}

// obligationMasks returns the fields a policy's mask obligations hide.
func obligationMasks(obligations []string) []string {
	var masks []string
	for _, o := range obligations {
		if m, ok := strings.CutPrefix(o, "mask:"); ok {
			masks = append(masks, m)
		}
	}
	return masks
}

func sanitize(tool *schemas.Tool, resp httptool.Response, masks []string, sent secrets) sanitized {
	s := digested(resp.Body)
	var content, loose any
	if !resp.Truncated {
		switch tree, err := ledger.Decode(resp.Body, ledger.Limits{MaxBytes: max(len(resp.Body), 1)}); {
		case len(resp.Body) == 0:
			// No answer (a 204, an empty 200): nothing a mask could
			// hide, kept as the empty text it is, masks or not.
			content = ""
		case err == nil && len(masks) > 0:
			// Redact copies; the tree is ours, so only when it hides.
			content = ledger.Redact(tree, masks)
		case err == nil:
			content = tree
		case len(masks) > 0:
			// Not a tree the masks can be applied to (an integer above
			// 2^53, a duplicate key, deeper than the limit): kept, it
			// would show what they hide.
			s.withheld = true
		default:
			content = string(resp.Body)
			// Kept as text, which a reader may still parse as JSON
			// (Decode refuses what encoding/json reads: an integer
			// above 2^53, a duplicate key): searched as that reader
			// gets it too.
			dec := json.NewDecoder(bytes.NewReader(resp.Body))
			dec.UseNumber()
			if dec.Decode(&loose) != nil {
				loose = nil
			}
		}
	}
	source := "tool:" + tool.Name + "@v" + strconv.Itoa(tool.Version)
	b := appendResult(make([]byte, 0, len(resp.Body)+len(source)+64), source, resp.Truncated, content)
	if content != nil && (sent.in(resp.Body, b) || sent.inTree(content) || sent.inTree(loose)) {
		// As sent, as stored, or in any string of the answer as a
		// JSON reader gets it (escapes undone: a secret with a quote
		// or an ampersand is escaped again when stored): a masked
		// field may not hide every copy.
		s.holdsSecret = true
		b = appendResult(b[:0], source, resp.Truncated, nil)
	}
	s.stored = b
	if len(masks) > 0 {
		// The digest and size of the answer as kept, masked: those of
		// the answer as it came would give whoever reads the events
		// (the agent among them) a masked value that can be guessed (a
		// PIN, a card's last digits), hashing each guess into the rest
		// of the answer, which the masked content shows. Withheld, it
		// has neither.
		s.digest, s.bytes = "", 0
		if content != nil && !s.holdsSecret {
			d := digested(appendTree(nil, content))
			s.digest, s.bytes = d.digest, d.bytes
		}
	}
	return s
}

// mayAuthorize says whether r may be an event the executor acts on (an
// authorized or approved one): those the header names as another type
// are not, and one without the header is read to tell.
func mayAuthorize(r *kgo.Record) bool {
	t := statemachine.EventType(ledger.Header(r, ledger.HeaderEventType))
	return t == "" || t == statemachine.EventAuthorized || t == statemachine.EventApproved
}

// Loop returns the executor on a consume-process-produce loop. lc's Group
// defaults to "ledger-executor", its Topics to the events topic, its
// TransactionalID to "<group>-" + the owner, and its Tick to 100ms.
func (x *Executor) Loop(lc ledger.LoopConfig) (*ledger.Loop, error) {
	l, err := ledger.NewLoop(x.loopConfig(lc), x.Step)
	if err != nil {
		return nil, err
	}
	x.backlog = l.Buffered
	return l, nil
}

// loopConfig is lc with the executor's defaults where it leaves them.
func (x *Executor) loopConfig(lc ledger.LoopConfig) ledger.LoopConfig {
	if lc.Group == "" {
		lc.Group = "ledger-executor"
	}
	if len(lc.Topics) == 0 {
		lc.Topics = []string{x.cfg.Topics.Events}
	}
	if lc.TransactionalID == "" {
		lc.TransactionalID = lc.Group + "-" + x.cfg.Owner
	}
	if lc.Logger == nil {
		lc.Logger = x.cfg.Logger
	}
	if lc.MaxPollRecords == 0 {
		// The executor reads every event and acts on about one in four
		// (authorized, approved): a larger poll gives each claim and
		// completion round trip more calls.
		lc.MaxPollRecords = 2000
	}
	if lc.Acts == nil {
		lc.Acts = mayAuthorize
	}
	if lc.Tick == 0 {
		// A call carried over past its step's budget goes out with the
		// next step, which on an idle topic comes a tick later: a short
		// tick keeps that wait short. An empty step costs next to
		// nothing.
		lc.Tick = 100 * time.Millisecond
	}
	return lc
}
