// Package approvals is the approval queue (DESIGN §5, issue 4): a human
// approves or rejects a call that a policy routed to approval_pending, bound
// to the exact arguments they saw, once, before the approval lapses; a timer
// expires the approvals nobody decided.
//
// An approval has no table of its own: its state is the call's execution
// record. A pending record is a waiting approval; approving moves it to
// authorized (the executor runs it on the approved event), rejecting to
// rejected, expiring to expired. Each decision is one compare-and-set
// (processors.Move) on the record's status and seq, so of an approve, a
// reject, an expiry and a second approve racing for one approval exactly one
// applies, whatever the number of instances.
//
// The move writes the decision's event into the record's outbox, after the
// events already there (so that none the log may still lack is dropped, and
// the preview stays readable); the service then publishes those the log
// lacks and marks them logged. If the publish fails the
// decision still stands: the event waits in the outbox and the executor's
// unlogged sweep appends it.
//
// Once the call has run, the executor's events have replaced the decision
// in the outbox. They carry the approver on, so the approval still says
// who approved it, but not when it was approved nor until when the
// approval was good: it shows neither (the log's approved event has both).
package approvals

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Errors callers branch on. The HTTP handler maps each to a status and a
// machine-readable code.
var (
	// ErrNotApprover: the caller lacks the approver role.
	ErrNotApprover = errors.New("approvals: caller is not an approver")
	// ErrNotFound: no approval under this id in the caller's tenant. An
	// approval of another tenant is reported exactly alike, so that its
	// existence is never revealed.
	ErrNotFound = errors.New("approvals: approval not found")
	// ErrSelfApproval: the approver (or the agent presenting the
	// approver's assertion) requested the call.
	ErrSelfApproval = errors.New("approvals: an approver may not decide their own call")
	// ErrNotPending: the approval was already decided, expired or used.
	ErrNotPending = errors.New("approvals: approval is not pending")
	// ErrExpired: the approval's time is up; the timer expires it.
	ErrExpired = errors.New("approvals: approval has expired")
	// ErrHashMismatch: the approver's arguments hash is not the call's:
	// they did not see what would run.
	ErrHashMismatch = errors.New("approvals: arguments hash does not match the call")
	// ErrInvalidRequest: the request itself is malformed (a reject without
	// a reason, an unknown state filter).
	ErrInvalidRequest = errors.New("approvals: invalid request")
	// ErrUnsupported: the request is well formed but not served (listing
	// approved approvals).
	ErrUnsupported = errors.New("approvals: unsupported")
)

// ReasonApprovalExpired is the reason on the expired event the timer emits.
const ReasonApprovalExpired = "approval_expired"

// ReasonRejected is the machine-readable reason on a rejected event; the
// approver's own words go in the event's detail.
const ReasonRejected = "rejected_by_approver"

// MaxReasonBytes bounds the reason an approver gives for a rejection.
const MaxReasonBytes = 2000

// obligationRequireApproval is how the policy engine lists the approval
// obligation on events (policy.Obligations.List).
const obligationRequireApproval = "require_approval"

// State is an approval's state, derived from its call's record.
type State string

// The states of an approval.
const (
	StatePending  State = "pending"
	StateApproved State = "approved"
	StateRejected State = "rejected"
	StateExpired  State = "expired"
)

// ID returns the approval id of the call under k: one per call, derived
// from its key, so that every processor names it alike.
func ID(k ledger.CallKey) string { return k.ApprovalID() }

// ParseID is the inverse of ID.
func ParseID(id string) (ledger.CallKey, error) { return ledger.ParseApprovalID(id) }

// Store is the part of the execution store the approval queue uses. See
// processors.Store for the contract; implementations are safe for
// concurrent use.
type Store interface {
	Get(ctx context.Context, key ledger.CallKey) (processors.Record, error)
	processors.StatusLister
	TenantByStatus(ctx context.Context, tenant string, status processors.Status, limit int) ([]processors.Record, error)
	TenantLatestByStatus(ctx context.Context, tenant string, status processors.Status, before processors.Cursor, limit int) ([]processors.Record, error)
	Move(ctx context.Context, ms []processors.Move) ([]bool, error)
	ReadBack(ctx context.Context, key ledger.CallKey) (processors.Record, error)
	MarkLogged(ctx context.Context, ls []processors.Logged) error
}

// Publisher appends records to the log. Implementations are safe for
// concurrent use and return once the broker acknowledged every record (or
// with an error, after which some may still have been written: readers
// drop duplicate (key, seq)).
type Publisher interface {
	Publish(ctx context.Context, recs ...*kgo.Record) error
}

// Verifier verifies an approver's assertion. Implementations are safe for
// concurrent use; ctx bounds any key refresh.
type Verifier interface {
	Verify(ctx context.Context, assertion string) (identity.Identity, error)
}

// Config configures the approval queue.
type Config struct {
	// Store is the execution store. Required.
	Store Store
	// Registry describes tools for the preview. Required.
	Registry *schemas.Registry
	// Identity verifies approvers' bearer assertions for the HTTP API.
	// Required.
	Identity Verifier
	// Publisher appends the decisions' events. Required.
	Publisher Publisher
	// Topics; defaults as ledger.Topics.
	Topics ledger.Topics
	// ApproverRole is the role an approver's assertion must carry;
	// default "approver".
	ApproverRole string
	// Actor names this instance on the events it emits; default
	// "approvals". The approver of an approval or rejection is on the
	// event's approver field.
	Actor string
	// ListLimit bounds the approvals one List answers with, and the
	// records each of its reads takes from the store: the approver's
	// tenant's, the oldest pending (the queue's head, one read) or the
	// latest decided. Those read on, newest first, past the records in
	// the status that are not approvals (a call whose deadline passed
	// before it ran is expired too), at most ListPages reads. Default
	// 1000.
	ListLimit int
	// Versions reads resource versions for tools that declare how, and
	// BaseURL resolves their relative URLs. Nil: approvals bind no
	// resource version.
	Versions processors.VersionReader
	BaseURL  string
	// Freezes, when set, is the kill switch's state (a copy of the
	// control topic): an approval that would read its resource's
	// version at the tool is refused while the tool is frozen
	// (ErrToolFrozen), and while the copy is not known current within
	// ControlMaxStaleness (ErrUnavailable). Nil: the version is read
	// whatever the kill switch says.
	Freezes Freezes
	// ControlMaxStaleness: see Freezes. Zero: control.DefaultMaxStaleness.
	ControlMaxStaleness time.Duration
	// ExpireBatch bounds the pending records one ExpireDue looks at, a
	// page of them in their update order; default 500. A timer round
	// (RunTimer) reads one page: with N approvals pending, one lapses
	// within about N/ExpireBatch + 1 rounds of its time.
	ExpireBatch int
	// RoundTimeout bounds one round of RunTimer, so that a store read
	// that hangs fails the round (TimerErr) rather than stop the timer
	// unseen; default 30 s. (A write of decisions, once sent, runs to
	// its end: WriteTimeout.)
	RoundTimeout time.Duration
	// WriteTimeout bounds the store's write of decisions, which runs to
	// its end once sent whatever becomes of the request, and then the
	// read that checks whether a write that failed applied; default 10 s.
	WriteTimeout time.Duration
	// Now is the clock; default time.Now.
	Now func() time.Time
	// Metrics, when set, counts the decisions taken and the API's
	// answers (metrics.Registry implements it). Nil counts nothing.
	Metrics Metrics
	// Logger; nil discards.
	Logger *slog.Logger
}

// Metrics is what the queue reports to its process's metrics.
// Implementations are safe for concurrent use.
type Metrics interface {
	// ApprovalDecided counts a decision taken (its move applied), by
	// the event it emitted: approved, rejected or expired.
	ApprovalDecided(decision string)
	// ApprovalAnswered counts an answer of the HTTP API, by action
	// (list, get, approve, reject) and HTTP status.
	ApprovalAnswered(action string, status int)
	// ApprovalsUnpublished counts decisions taken whose events the
	// queue failed to publish: the executor's unlogged sweep appends
	// them, 10 s or more later.
	ApprovalsUnpublished(n int)
}

// noMetrics counts nothing.
type noMetrics struct{}

func (noMetrics) ApprovalDecided(string)       {}
func (noMetrics) ApprovalAnswered(string, int) {}
func (noMetrics) ApprovalsUnpublished(int)     {}

func (c *Config) setDefaults() {
	c.Topics = c.Topics.WithDefaults()
	if c.ApproverRole == "" {
		c.ApproverRole = "approver"
	}
	if c.Actor == "" {
		c.Actor = "approvals"
	}
	if c.ListLimit <= 0 {
		c.ListLimit = 1000
	}
	if c.ExpireBatch <= 0 {
		c.ExpireBatch = 500
	}
	if c.WriteTimeout <= 0 {
		c.WriteTimeout = 10 * time.Second
	}
	if c.RoundTimeout <= 0 {
		c.RoundTimeout = 30 * time.Second
	}
	if c.ControlMaxStaleness == 0 {
		c.ControlMaxStaleness = control.DefaultMaxStaleness
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Metrics == nil {
		c.Metrics = noMetrics{}
	}
}

// Service is the approval queue. It keeps no state of its own: several
// instances may serve the same store at once.
type Service struct {
	cfg  Config
	base *url.URL // Config.BaseURL

	// mu guards expirePass, and is held across its page's read.
	mu sync.Mutex
	// expirePass is where the next ExpireDue reads on from.
	expirePass processors.SweepPass

	// statsMu guards what the timer reports, read by every scrape and
	// readiness probe: never held across a store's read, which may
	// hang.
	statsMu sync.Mutex
	// counting is the pending approvals the pass in progress has seen
	// so far, and seen those of the last pass that ended (Pending).
	counting, seen pendingCount
	// timerErr is the last timer round's error (TimerErr).
	timerErr error
}

// pendingCount is how many pending approvals a pass of the timer saw,
// and when the call of the oldest was requested.
type pendingCount struct {
	n      int
	oldest time.Time
}

// add counts one pending approval requested at (zero: not known).
func (c *pendingCount) add(at time.Time) { c.merge(pendingCount{n: 1, oldest: at}) }

// merge adds o's approvals to c's.
func (c *pendingCount) merge(o pendingCount) {
	c.n += o.n
	if !o.oldest.IsZero() && (c.oldest.IsZero() || o.oldest.Before(c.oldest)) {
		c.oldest = o.oldest
	}
}

// New validates cfg and returns the approval queue.
func New(cfg Config) (*Service, error) {
	if cfg.Store == nil || cfg.Registry == nil || cfg.Identity == nil || cfg.Publisher == nil {
		return nil, errors.New("approvals: store, registry, identity verifier and publisher are required")
	}
	cfg.setDefaults()
	base, err := processors.ParseBaseURL(cfg.BaseURL)
	if err != nil {
		return nil, fmt.Errorf("approvals: %w", err)
	}
	return &Service{cfg: cfg, base: base}, nil
}

// publishTimeout bounds the publish of decisions taken, which no longer
// follows the request that took them.
const publishTimeout = 10 * time.Second

// Approval is what the queue shows of one approval.
type Approval struct {
	ID             string    `json:"id"`
	TenantID       string    `json:"tenant_id"`
	IdempotencyKey string    `json:"idempotency_key"`
	CallID         string    `json:"call_id"`
	Tool           string    `json:"tool"`
	ToolVersion    int       `json:"tool_version"`
	Requester      Requester `json:"requester"`
	// ArgumentsHash is what an approver must send back to approve: the
	// hash of the call's arguments, whole. The preview shows their audit
	// copy, in which the fields the registry redacts and the policies
	// mask read "[redacted]": an approver approves them unseen.
	ArgumentsHash string   `json:"arguments_hash"`
	PolicyVersion string   `json:"policy_version,omitempty"`
	PolicyIDs     []string `json:"policy_ids,omitempty"`
	// RequestedAt is when the intake admitted the call; ExpiresAt when a
	// pending approval lapses (and, once approved, until when the approval
	// is good). ExpiresAt and DecidedAt are absent once the call has run:
	// the record no longer holds them.
	RequestedAt time.Time  `json:"requested_at"`
	ExpiresAt   time.Time  `json:"expires_at,omitzero"`
	State       State      `json:"state"`
	DecidedBy   string     `json:"decided_by,omitempty"`
	DecidedAt   *time.Time `json:"decided_at,omitempty"`
	// Reason is the approver's reason for a rejection, or why the
	// approval expired.
	Reason string `json:"reason,omitempty"`
	// CallStatus is, once approved, where the call stands (its status
	// in the execution store: authorized, executing, succeeded...), and
	// CallReason why it ended, when it ended without running: an
	// approval taken with too little of it left lapses before the
	// call's request can leave (denied, approval_expired), and the
	// approval alone would not say that nothing came of it.
	CallStatus string  `json:"call_status,omitempty"`
	CallReason string  `json:"call_reason,omitempty"`
	Preview    Preview `json:"preview"`
}

// Requester is who asked for the call.
type Requester struct {
	User  string `json:"user"`
	Agent string `json:"agent"`
	// Roles are the roles of the requester's assertion that the
	// policies were given (--policy-roles), when RolesGiven; a call
	// decided without them shows neither.
	Roles      []string `json:"roles,omitempty"`
	RolesGiven bool     `json:"roles_given,omitempty"`
}

// Preview is what an approver reads before deciding. Once the call has run,
// the record no longer holds the requested event and the arguments,
// resource and amount are left out.
type Preview struct {
	Tool        string `json:"tool"`
	Description string `json:"description,omitempty"`
	Effect      string `json:"effect,omitempty"`
	Risk        string `json:"risk,omitempty"`
	// Resource is the value at the tool's resource pointer.
	Resource string `json:"resource,omitempty"`
	// Arguments are the audit copy: redacted per the registry and masked
	// per the deciding policies.
	Arguments json.RawMessage `json:"arguments,omitempty"`
	// Amount is amount_cents and currency in human form ("45.00 AUD",
	// "4500 JPY"): amount_cents counts the currency's minor unit.
	Amount       string `json:"amount,omitempty"`
	Compensation string `json:"compensation,omitempty"`
}

// found is an approval and the record and events it was read from.
type found struct {
	rec       processors.Record
	evs       []ledger.Event
	requested *ledger.Event // seq 1, while the outbox holds it
	pending   *ledger.Event // the approval_pending decision
	approval  Approval
}

// isApprover reports whether id carries the approver role.
func (s *Service) isApprover(id identity.Identity) bool {
	return id.User != "" && id.Tenant != "" && slices.Contains(id.Roles, s.cfg.ApproverRole)
}

// List returns the approver's tenant's approvals in state ("" means
// pending), without their arguments (Get has them): pending ones oldest first, the queue's head; rejected and
// expired ones newest first, since they stay so for good and the oldest
// would hide every later one. "pending", "rejected" and "expired" are served;
// "approved" wraps ErrUnsupported (approved calls move on through the
// executor and are better found in the call index); anything else wraps
// ErrInvalidRequest. more says the list stopped at its bound
// (Config.ListLimit approvals, or records read) with approvals maybe left
// out: a queue longer than that shows its oldest, and the approver must
// be told that others wait.
func (s *Service) List(ctx context.Context, approver identity.Identity, state string) (_ []Approval, more bool, _ error) {
	if !s.isApprover(approver) {
		return nil, false, ErrNotApprover
	}
	var status processors.Status
	switch State(state) {
	case "", StatePending:
		status, state = processors.StatusPending, string(StatePending)
	case StateRejected:
		status = processors.StatusRejected
	case StateExpired:
		status = processors.StatusExpired
	case StateApproved:
		return nil, false, fmt.Errorf("%w: listing approved approvals", ErrUnsupported)
	default:
		return nil, false, fmt.Errorf("%w: unknown state %q", ErrInvalidRequest, state)
	}
	// The tenant's own, so that another tenant's queue, however long,
	// does not hide it.
	out := []Approval{}
	var before processors.Cursor
	// One record more than the list holds: an approval past the bound
	// says that more wait, and none past it that the list is whole.
	read := s.cfg.ListLimit + 1
	for page := 1; ; page++ {
		var recs []processors.Record
		var err error
		if status == processors.StatusPending {
			recs, err = s.cfg.Store.TenantByStatus(ctx, approver.Tenant, status, read)
		} else {
			recs, err = s.cfg.Store.TenantLatestByStatus(ctx, approver.Tenant, status, before, read)
		}
		if err != nil {
			return nil, false, fmt.Errorf("approvals: list %s: %w", status, err)
		}
		for _, rec := range recs {
			if rec.Key.TenantID != approver.Tenant {
				continue // the store's filter, checked again: never another tenant's
			}
			f, err := s.read(rec)
			if err != nil {
				if !errors.Is(err, ErrNotFound) {
					s.cfg.Logger.Error("unreadable approval", "call_key", rec.Key.String(), "err", err)
				}
				continue // not an approval: a call expired by its deadline, say
			}
			if string(f.approval.State) == state {
				if len(out) == s.cfg.ListLimit {
					return out, true, nil // one more than the list holds
				}
				// Without its arguments: up to an envelope's size
				// each, a list's could take the service's memory;
				// Get has them.
				a := f.approval
				a.Preview.Arguments = nil
				out = append(out, a)
			}
		}
		if status == processors.StatusPending || len(recs) < read || page == ListPages {
			// A full page unread past: records (approvals among them,
			// maybe) were left.
			return out, len(recs) == read, nil
		}
		before = recs[len(recs)-1].Cursor()
	}
}

// ListPages bounds the reads of one List of decided approvals, each of
// Config.ListLimit+1 records: past that many records that are not
// approvals, the older approvals are not listed.
const ListPages = 10

// Get returns one approval of the approver's tenant.
func (s *Service) Get(ctx context.Context, approver identity.Identity, id string) (Approval, error) {
	f, err := s.find(ctx, approver, id)
	if err != nil {
		return Approval{}, err
	}
	return f.approval, nil
}

// find checks the approver and reads the approval id names in their
// tenant.
func (s *Service) find(ctx context.Context, approver identity.Identity, id string) (*found, error) {
	if !s.isApprover(approver) {
		return nil, ErrNotApprover
	}
	key, err := ParseID(id)
	if err != nil || key.TenantID != approver.Tenant {
		// Another tenant's approval is not found, not forbidden: the
		// answer must not tell that it exists.
		return nil, ErrNotFound
	}
	rec, err := s.cfg.Store.Get(ctx, key)
	if errors.Is(err, processors.ErrNotFound) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("approvals: read %s: %w", key, err)
	}
	return s.read(rec)
}

// Approve approves the call behind id, bound to argumentsHash: the hash of
// the arguments the approver saw. The approval emits approved, valid until
// the pending approval's expires_at, and the call becomes authorized.
func (s *Service) Approve(ctx context.Context, approver identity.Identity, id, argumentsHash string) (Approval, error) {
	return s.decide(ctx, approver, id, func(f *found, ev *ledger.Event) (processors.Status, error) {
		if argumentsHash != f.rec.ArgumentsHash {
			return "", ErrHashMismatch
		}
		if err := argumentsIntact(f); err != nil {
			return "", err
		}
		// What the approver was shown, and what the approval binds (the
		// resource's version), come from this service's definition of
		// the tool: one other than the call's, or none (a version this
		// service's registry lacks yet, in a rolling deploy), is no
		// ground to approve on. (Rejecting needs no definition.)
		tool, err := f.rec.ToolIn(s.cfg.Registry)
		if err != nil {
			return "", err
		}
		v, read, err := s.resourceVersion(ctx, tool, f.rec)
		if err != nil {
			if errors.Is(err, ErrToolFrozen) || errors.Is(err, ErrControlStale) {
				return "", err
			}
			if processors.VersionReadLater(err) {
				return "", fmt.Errorf("%w: %v", ErrUnavailable, err)
			}
			// Gone (404), refused, or not to be asked: trying again
			// will not help. A version the call was requested at
			// cannot be confirmed, as the executor would find; without
			// one, the approval binds none, as the intake admitted it.
			if p := f.pending; p != nil && p.ResourceVersion != "" {
				return "", fmt.Errorf("%w: its version cannot be read (%v); the call was requested at %s", ErrResourceChanged, err, p.ResourceVersion)
			}
			v, read = "", false
		}
		// The approval binds the resource as it was when the call was
		// requested, if the intake read its version then: one changed
		// since is not what the call was proposed for.
		if p := f.pending; p != nil && p.ResourceVersion != "" {
			switch {
			case !read:
				// Not for now: this service reads no version of the
				// tool (no reader, a registry without it).
				return "", fmt.Errorf("%w: the call was requested at version %s, and this approvals service cannot read the resource's version to compare", ErrVersionUnconfirmed, p.ResourceVersion)
			case v != p.ResourceVersion:
				return "", fmt.Errorf("%w: it is at version %s; the call was requested at %s", ErrResourceChanged, v, p.ResourceVersion)
			}
		}
		ev.ResourceVersion = v
		ev.Type = statemachine.EventApproved
		ev.ApprovalID = f.approval.ID
		ev.Decision = "approve"
		exp := f.approval.ExpiresAt
		ev.ExpiresAt = &exp
		return processors.StatusAuthorized, nil
	})
}

// Reject rejects the call behind id; reason, the approver's words, is
// required. The call becomes rejected and never runs.
func (s *Service) Reject(ctx context.Context, approver identity.Identity, id, reason string) (Approval, error) {
	reason = strings.TrimSpace(reason)
	switch {
	case reason == "":
		return Approval{}, fmt.Errorf("%w: a rejection needs a reason", ErrInvalidRequest)
	case len(reason) > MaxReasonBytes:
		return Approval{}, fmt.Errorf("%w: reason longer than %d bytes", ErrInvalidRequest, MaxReasonBytes)
	}
	return s.decide(ctx, approver, id, func(f *found, ev *ledger.Event) (processors.Status, error) {
		ev.Type = statemachine.EventRejected
		ev.ApprovalID = f.approval.ID
		ev.Decision = "reject"
		ev.Reason = ReasonRejected
		ev.Detail = reason
		return processors.StatusRejected, nil
	})
}

// decide runs the checks every decision shares, lets step fill in the
// event and say where the record goes, and moves the record.
func (s *Service) decide(ctx context.Context, approver identity.Identity, id string, step func(*found, *ledger.Event) (processors.Status, error)) (Approval, error) {
	f, err := s.find(ctx, approver, id)
	if err != nil {
		return Approval{}, err
	}
	a := f.approval
	now := s.cfg.Now().UTC()
	switch {
	case a.Requester.User == "":
		// Without the requester there is no telling a self-approval.
		return Approval{}, fmt.Errorf("approvals: %s: the record does not say who requested the call", f.rec.Key)
	case strings.EqualFold(a.Requester.User, approver.User),
		// The agent that asked may not decide either, whoever it
		// claims to act for now. Compared without case: an identity
		// provider whose logins ignore it may put either in the
		// subject, and the same person would approve their own call.
		a.Requester.Agent != "" && strings.EqualFold(a.Requester.Agent, approver.Agent):
		return Approval{}, ErrSelfApproval
	case f.rec.Status != processors.StatusPending:
		return Approval{}, ErrNotPending
	case a.ExpiresAt.IsZero():
		return Approval{}, fmt.Errorf("approvals: %s: the record does not say when the approval expires", f.rec.Key)
	case !now.Before(a.ExpiresAt):
		return Approval{}, ErrExpired
	}
	ev := s.event(f, now)
	ev.Approver = approver.User
	to, err := step(f, &ev)
	if err != nil {
		return Approval{}, err
	}
	// The step may have waited (an approval reads the resource's version,
	// for up to the tool's timeout): the decision is made, and stamped,
	// now, and not past the expiry.
	if now = s.cfg.Now().UTC(); !now.Before(a.ExpiresAt) {
		return Approval{}, ErrExpired
	}
	ev.At = now
	moved, err := s.move(ctx, []*found{f}, []ledger.Event{ev}, []processors.Status{to})
	if err != nil {
		return Approval{}, err
	}
	if len(moved) == 0 {
		// Another decision (or the timer) got there first.
		return Approval{}, ErrNotPending
	}
	s.cfg.Logger.Info("approval decided", "approval_id", a.ID, "call_key", f.rec.Key.String(), "decision", string(ev.Type), "approver", approver.User)
	after, err := s.read(moved[0])
	if err != nil {
		return Approval{}, err
	}
	return after.approval, nil
}

// ErrArgumentIntegrity: the call's stored arguments are not those its
// events name (rewritten in the store, with a hash of their own): what
// the approver was shown is not what would run.
var ErrArgumentIntegrity = errors.New("approvals: the call's stored arguments are not the ones it was requested with")

// argumentsIntact checks that what an approval of f would bind and run
// is what the call was requested with: the record's arguments hash to
// its hash, which is the one its requested and approval_pending events
// name (the preview is the requested event's). Anyone who can write the
// store can compute a hash for arguments of their own.
func argumentsIntact(f *found) error {
	for _, ev := range []*ledger.Event{f.requested, f.pending} {
		if ev != nil && ev.ArgumentsHash != "" && ev.ArgumentsHash != f.rec.ArgumentsHash {
			return fmt.Errorf("%w: the record's hash %s, its %s event's %s", ErrArgumentIntegrity, f.rec.ArgumentsHash, ev.Type, ev.ArgumentsHash)
		}
	}
	if err := processors.VerifyArguments(f.rec); err != nil {
		return fmt.Errorf("%w: %w", ErrArgumentIntegrity, err)
	}
	return nil
}

// ErrResourceChanged: the call's resource changed since the call was
// requested; it cannot be approved as it was proposed.
var ErrResourceChanged = errors.New("approvals: the resource changed since the call was requested")

// ErrVersionUnconfirmed: the call was requested at a resource version
// this service cannot read to compare (it has no reader, or no registry
// entry for the tool's version): asking again will not help.
var ErrVersionUnconfirmed = errors.New("approvals: the resource's version cannot be confirmed here")

// ErrUnavailable: something the decision needs could not be read.
var ErrUnavailable = errors.New("approvals: cannot read the resource's version now")

// ErrToolFrozen: the approval would read the resource's version at a tool
// the kill switch froze. No request reaches a frozen tool: approve once it
// is unfrozen, or reject.
var ErrToolFrozen = errors.New("approvals: the tool is frozen, and the resource's version the approval binds cannot be read")

// ErrControlStale: the approval would read the resource's version at the
// tool, and this service's copy of the control topic is not known current
// (a freeze of the tool may not be read yet). Try again.
var ErrControlStale = errors.New("approvals: the kill switch's state is not known current")

// Freezes is the part of the kill switch's state (control.State) the
// approval queue asks before it reads a resource's version at a tool.
type Freezes interface {
	Current(ctx context.Context, maxStaleness time.Duration) error
	Frozen(tool, tenant string) (control.Action, bool)
}

// resourceVersion reads the version of the call's resource, when its tool
// declares how and this service can read it (read false otherwise).
func (s *Service) resourceVersion(ctx context.Context, tool *schemas.Tool, rec processors.Record) (v string, read bool, err error) {
	if s.cfg.Versions == nil {
		return "", false, nil
	}
	args, err := ledger.Decode(rec.Arguments, ledger.Limits{})
	if err != nil {
		return "", false, nil
	}
	// Bounded as a call to the tool is: an approver's request must not
	// hang on a version endpoint that does not answer.
	ctx, cancel := context.WithTimeout(ctx, tool.Timeout())
	defer cancel()
	vr := s.cfg.Versions
	if s.cfg.Freezes != nil {
		vr = gatedVersions{VersionReader: vr, freezes: s.cfg.Freezes, maxStaleness: s.cfg.ControlMaxStaleness, tool: tool.Name}
	}
	return processors.ResourceVersion(ctx, vr, s.base, tool, args, rec.Key.TenantID)
}

// gatedVersions reads a resource's version at tool only as an executor's
// request goes: to a tool the kill switch is known not to have frozen. It
// is asked only for a read that would be made (the call names its
// resource).
type gatedVersions struct {
	processors.VersionReader
	freezes      Freezes
	maxStaleness time.Duration
	tool         string
}

func (g gatedVersions) ResourceVersion(ctx context.Context, versionURL, resource, tenant string) (string, error) {
	if err := g.freezes.Current(ctx, g.maxStaleness); err != nil {
		return "", fmt.Errorf("%w: %w", ErrControlStale, err)
	}
	if a, frozen := g.freezes.Frozen(g.tool, tenant); frozen {
		return "", fmt.Errorf("%w (%s)", ErrToolFrozen, control.FrozenDetail(g.tool, a))
	}
	return g.VersionReader.ResourceVersion(ctx, versionURL, resource, tenant)
}

// event starts the next event of f's call: the identity fields of the
// requested event and the policy fields of the pending decision, so that
// the event stands on its own in the log and for whoever acts on it next.
func (s *Service) event(f *found, now time.Time) ledger.Event {
	src := f.requested
	if src == nil {
		src = f.pending
	}
	ev := ledger.Event{
		EventID:        uuid.Must(uuid.NewV7()).String(),
		Seq:            f.rec.Seq + 1,
		At:             now,
		Actor:          s.cfg.Actor,
		TenantID:       f.rec.Key.TenantID,
		IdempotencyKey: f.rec.Key.IdempotencyKey,
		CallID:         f.rec.CallID,
		Tool:           f.rec.Tool,
		ToolVersion:    f.rec.ToolVersion,
		ToolDigest:     f.rec.ToolDigest,
		ArgumentsHash:  f.rec.ArgumentsHash,
	}
	if src != nil {
		ev.UserID, ev.AgentID, ev.TraceID = src.UserID, src.AgentID, src.TraceID
		ev.Purpose, ev.Channel, ev.Resource = src.Purpose, src.Channel, src.Resource
		// The executor decides the approved call again with them.
		ev.Roles, ev.RolesGiven = slices.Clone(src.Roles), src.RolesGiven
	}
	if p := f.pending; p != nil {
		ev.PolicyID = slices.Clone(p.PolicyID)
		ev.PolicyVersion = p.PolicyVersion
		ev.Obligations = slices.Clone(p.Obligations)
	}
	return ev
}

// move applies one decision per found record as a compare-and-set from
// pending at its current seq, publishes the events of the moves that
// applied and marks them logged. It returns the moved records as they now
// are. A failed publish is logged, not returned: the decision stands and
// the events wait in the outbox for the executor's unlogged sweep.
func (s *Service) move(ctx context.Context, fs []*found, evs []ledger.Event, to []processors.Status) ([]processors.Record, error) {
	ms := make([]processors.Move, len(fs))
	for i, f := range fs {
		// The outbox keeps the events before the decision: those the
		// log may still lack go out again with it (a move must never
		// drop an event that was not logged yet), and the preview can
		// still be read from the record.
		outbox, err := ledger.EncodeEvents(append(slices.Clone(f.evs), evs[i]))
		if err != nil {
			return nil, fmt.Errorf("approvals: %s: %w", f.rec.Key, err)
		}
		ms[i] = processors.Move{
			Key: f.rec.Key, From: processors.StatusPending, FromSeq: f.rec.Seq, FromUndoMarks: f.rec.UndoMarks,
			To: to[i], Seq: evs[i].Seq, Outbox: outbox,
		}
	}
	// Once sent, the write runs to its end whether or not the approver
	// still waits (a client gone, the CLI's timeout, a server stopping),
	// and one that failed is read back: it may have applied.
	ids := make([]string, len(evs))
	for i := range evs {
		ids[i] = evs[i].EventID
	}
	applied, failedWrite, err := processors.MoveOrReadBack(ctx, s.cfg.Store, ms, ids, s.cfg.WriteTimeout)
	if err != nil {
		return nil, fmt.Errorf("approvals: move %d records: %w", len(ms), err)
	}
	if failedWrite != nil {
		s.cfg.Logger.Warn("a decision's write failed, and had applied: taken", "err", failedWrite)
	}
	var (
		moved  []processors.Record
		recs   []*kgo.Record
		logged []processors.Logged
	)
	for i, f := range fs {
		if !applied[i] {
			continue
		}
		s.cfg.Metrics.ApprovalDecided(string(evs[i].Type))
		rec := f.rec
		rec.Status, rec.Seq, rec.Outbox = ms[i].To, ms[i].Seq, ms[i].Outbox
		moved = append(moved, rec)
		for _, e := range append(slices.Clone(f.evs), evs[i]) {
			if e.Seq <= f.rec.LoggedSeq {
				continue
			}
			r, err := e.Record(s.cfg.Topics.Events)
			if err != nil {
				return nil, err
			}
			recs = append(recs, r)
		}
		logged = append(logged, processors.Logged{Key: rec.Key, Seq: rec.Seq, Base: rec.LoggedSeq})
	}
	if len(recs) == 0 {
		return moved, nil
	}
	// The decisions are taken: published whether or not the approver
	// still waits for the answer (a client gone, a server shutting
	// down), since one left to the unlogged sweep reaches the executors
	// 10 s or more later, which can outlast an approval's window.
	pctx, pcancel := context.WithTimeout(context.WithoutCancel(ctx), publishTimeout)
	defer pcancel()
	if err := s.cfg.Publisher.Publish(pctx, recs...); err != nil {
		s.cfg.Logger.Warn("publish decisions failed; the unlogged sweep will append them", "records", len(logged), "err", err)
		s.cfg.Metrics.ApprovalsUnpublished(len(logged))
		return moved, nil
	}
	if err := s.cfg.Store.MarkLogged(pctx, logged); err != nil {
		// The events are in the log; the sweep appends them again and
		// readers drop the duplicates.
		s.cfg.Logger.Warn("mark decisions logged", "records", len(logged), "err", err)
	}
	return moved, nil
}

// read derives the approval from a record and the events in its outbox. A
// record that never waited for approval wraps ErrNotFound.
func (s *Service) read(rec processors.Record) (*found, error) {
	evs, err := ledger.DecodeEvents(rec.Outbox)
	if err != nil {
		return nil, fmt.Errorf("approvals: %s: outbox: %w", rec.Key, err)
	}
	f := &found{rec: rec, evs: evs}
	var decision *ledger.Event
	for i := range evs {
		e := &evs[i]
		switch {
		case e.Type == statemachine.EventRequested:
			f.requested = e
		case e.Type == statemachine.EventApprovalPending:
			f.pending = e
		case e.Type == statemachine.EventApproved, e.Type == statemachine.EventRejected,
			e.Type == statemachine.EventExpired && e.Reason == ReasonApprovalExpired:
			decision = e
		}
	}
	var state State
	switch rec.Status {
	case processors.StatusPending:
		state = StatePending
	case processors.StatusRejected:
		state = StateRejected
	case processors.StatusExpired:
		switch {
		case decision != nil && decision.Type == statemachine.EventExpired:
			state = StateExpired
		case waitedForApproval(f, decision):
			// Approved, then the call's deadline passed before it
			// could run.
			state = StateApproved
		}
	default:
		if waitedForApproval(f, decision) {
			state = StateApproved
		}
	}
	if state == "" {
		return nil, ErrNotFound
	}

	// Identity fields: from the earliest event the outbox still holds.
	var src *ledger.Event
	for _, e := range []*ledger.Event{f.requested, f.pending, decision} {
		if e != nil {
			src = e
			break
		}
	}
	if src == nil && len(evs) > 0 {
		src = &evs[len(evs)-1]
	}
	a := Approval{
		ID:             ID(rec.Key),
		TenantID:       rec.Key.TenantID,
		IdempotencyKey: rec.Key.IdempotencyKey,
		CallID:         rec.CallID,
		Tool:           rec.Tool,
		ToolVersion:    rec.ToolVersion,
		ArgumentsHash:  rec.ArgumentsHash,
		RequestedAt:    rec.CreatedAt,
		State:          state,
	}
	if src != nil {
		a.Requester = Requester{User: src.UserID, Agent: src.AgentID, Roles: src.Roles, RolesGiven: src.RolesGiven || len(src.Roles) > 0}
		a.PolicyVersion, a.PolicyIDs = src.PolicyVersion, src.PolicyID
	}
	if p := f.pending; p != nil {
		a.PolicyVersion, a.PolicyIDs = p.PolicyVersion, p.PolicyID
		if p.ExpiresAt != nil {
			a.ExpiresAt = *p.ExpiresAt
		}
	}
	if f.requested != nil {
		a.RequestedAt = f.requested.At
	}
	if d := decision; d != nil {
		if a.ExpiresAt.IsZero() && d.ExpiresAt != nil {
			a.ExpiresAt = *d.ExpiresAt
		}
		at := d.At
		a.DecidedAt = &at
		a.DecidedBy = d.Approver
		switch d.Type {
		case statemachine.EventRejected:
			if a.DecidedBy == "" {
				// The reconciler's rejection of an automatic
				// compensation it cancels names the operator as
				// its actor, not as an approver.
				a.DecidedBy = d.Actor
			}
			a.Reason = d.Detail
			if a.Reason == "" {
				a.Reason = d.Reason
			}
		case statemachine.EventExpired:
			a.Reason = d.Reason
		}
	} else if state == StateApproved {
		// The call ran: the executor's events replaced the approved
		// one, and carry its approver on.
		for i := len(evs) - 1; i >= 0; i-- {
			if e := &evs[i]; e.ApprovalID != "" && e.Approver != "" {
				a.DecidedBy = e.Approver
				break
			}
		}
	}
	if state == StateApproved {
		a.CallStatus = string(rec.Status)
		if rec.Status.Done() && rec.Status != processors.StatusSucceeded && len(evs) > 0 {
			a.CallReason = evs[len(evs)-1].Reason
		}
	}
	a.Preview = s.preview(rec, f.requested)
	f.approval = a
	return f, nil
}

// waitedForApproval reports whether a record past pending went through an
// approval: its outbox still shows the approval, or (once the executor
// replaced the outbox) its events past the intake's decision at seq 2
// carry the approval's id (the executor copies it from the approved
// event, onto a denial too, which clears the obligations) or the
// approval obligation.
func waitedForApproval(f *found, decision *ledger.Event) bool {
	if f.pending != nil || decision != nil {
		return true
	}
	if f.rec.Seq <= 2 {
		return false
	}
	for _, e := range f.evs {
		if e.ApprovalID != "" || slices.Contains(e.Obligations, obligationRequireApproval) {
			return true
		}
	}
	return false
}

// preview builds what an approver reads: the tool as the registry
// describes it and, while the record holds the requested event, its
// redacted arguments.
func (s *Service) preview(rec processors.Record, requested *ledger.Event) Preview {
	p := Preview{Tool: rec.Tool}
	tool, err := rec.ToolIn(s.cfg.Registry)
	switch {
	case errors.Is(err, schemas.ErrOtherDefinition):
		p.Description = "This approvals service defines the tool's version otherwise than the intake that admitted the call, so it cannot show what the call would do, and cannot approve it."
	case err != nil:
		p.Description = "This approvals service's registry lacks the tool's version, so it cannot show what the call would do, and cannot approve it."
	}
	if err == nil {
		p.Description = tool.Description
		p.Effect = string(tool.Effect)
		p.Risk = string(tool.Risk)
		p.Compensation = "none declared"
		if tool.Compensation != nil {
			p.Compensation = tool.Compensation.String()
		}
	}
	if requested == nil || len(requested.Arguments) == 0 {
		return p
	}
	p.Arguments = requested.Arguments
	dec := json.NewDecoder(bytes.NewReader(requested.Arguments))
	dec.UseNumber()
	var args any
	if err := dec.Decode(&args); err != nil {
		return p
	}
	if tool != nil && tool.Resource != "" {
		if v, ok := ledger.ResourceOf(args, tool.Resource); ok {
			p.Resource = v
		}
	}
	if m, ok := args.(map[string]any); ok {
		p.Amount = amount(m)
	}
	return p
}

// amount renders amount_cents and currency as "45.00 AUD": amount_cents
// in the currency's minor unit per ISO 4217, so that 4500 JPY reads
// "4500 JPY" and 4500 BHD "4.500 BHD". An approver shown hundredths of
// every currency would see a yen refund a hundredth of its size. A code
// in lower case ("jpy", as some payment APIs write it) is read as in
// upper case; anything but three letters shows no amount.
func amount(args map[string]any) string {
	n, ok := args["amount_cents"].(json.Number)
	cur, ok2 := args["currency"].(string)
	cur = strings.ToUpper(cur)
	if !ok || !ok2 || len(cur) != 3 || strings.IndexFunc(cur, func(r rune) bool { return r < 'A' || r > 'Z' }) >= 0 {
		return ""
	}
	minor, err := n.Int64()
	if err != nil {
		return ""
	}
	sign, abs := "", uint64(minor)
	if minor < 0 {
		sign, abs = "-", uint64(-minor) // two's complement: right for MinInt64 too
	}
	exp := minorUnitExponent(cur)
	if exp == 0 {
		return fmt.Sprintf("%s%d %s", sign, abs, cur)
	}
	unit := uint64(1)
	for range exp {
		unit *= 10
	}
	return fmt.Sprintf("%s%d.%0*d %s", sign, abs/unit, exp, abs%unit, cur)
}

// minorUnitExponent is the ISO 4217 number of decimals of currency's minor
// unit: 2 for every code but those listed.
func minorUnitExponent(currency string) int {
	switch currency {
	case "BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "UYI", "VND", "VUV", "XAF", "XOF", "XPF":
		return 0
	case "BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND":
		return 3
	case "CLF", "UYW":
		return 4
	}
	return 2
}
