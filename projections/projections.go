package projections

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Event is a committed event with where it was read from.
type Event struct {
	ledger.Event
	// Partition and Offset locate the record on the events topic.
	Partition int32
	Offset    int64
	// Produced is the record's timestamp: when it was appended.
	Produced time.Time
	// Raw is the record's value, the event as the log holds it, which a
	// projection that keeps events keeps rather than Event re-encoded:
	// a field this build does not know (one a newer writer added
	// without a new encoding) is kept too. Empty: Event's encoding.
	Raw []byte
}

// Action is a committed control record (a freeze, unfreeze, revocation or
// policy activation) with where it was read from.
type Action struct {
	Action    ledger.ControlAction
	Partition int32
	Offset    int64
}

// Batch is what the projector hands a Sink at once: records committed to
// the events and control topics, in each partition's order.
type Batch struct {
	Events  []Event
	Actions []Action
	// Ends are, for each partition read into the batch, the offset after
	// its last record read (transaction markers and records written as
	// nothing included): every record of the partition before it has
	// been handed to the sink, in this batch or before. A sink that
	// records them (Positioned) lets the projector find a projection
	// restored from an older copy of itself.
	Ends []End
}

// End is where a batch ends in one partition of a topic.
type End struct {
	Topic     string
	Partition int32
	// Next is the offset after the partition's last record read.
	Next int64
}

// Positions are, by topic and partition, where a projection's records
// end: it holds every record before the offset (Batch.Ends).
type Positions map[string]map[int32]int64

// Set records next as where topic's partition ends.
func (p Positions) Set(topic string, partition int32, next int64) {
	if p[topic] == nil {
		p[topic] = make(map[int32]int64)
	}
	p[topic][partition] = next
}

// Ends lists p, as a Batch's Ends.
func (p Positions) Ends() []End {
	var out []End
	for topic, parts := range p {
		for partition, next := range parts {
			out = append(out, End{Topic: topic, Partition: partition, Next: next})
		}
	}
	return out
}

// Lookup is where topic's partition ends, and whether it is known.
func (p Positions) Lookup(topic string, partition int32) (int64, bool) {
	next, ok := p[topic][partition]
	return next, ok
}

// Positioned is a Sink that records each batch's Ends with its rows, in
// the same Write, after them: Positions says where the projection holds
// records up to, as the projection itself says, not the consumer group.
// A projection restored from a backup says less than the group
// committed, and the projector reads the difference again. A sink
// written only before positions were recorded has none for a partition
// until its next Write.
type Positioned interface {
	Sink
	Positions(ctx context.Context) (Positions, error)
}

// Len is the number of records in the batch.
func (b Batch) Len() int { return len(b.Events) + len(b.Actions) }

// Sink is a projection that the projector writes to. Write returns only
// once the batch is durable in the projection; the projector commits the
// batch's offsets after that, so a batch may be written again after a
// crash, and writing it again must change no answer.
type Sink interface {
	Write(ctx context.Context, b Batch) error
}

// Queries is what a projection answers. Every method but Trace refuses a
// Filter without a tenant unless it says AllTenants (ErrTenantRequired).
type Queries interface {
	// Trace returns the events under key, each event once: the refused
	// submissions (seq 0) first, by time then event id, at most
	// MaxRefusals of them (KeepRefusals: the earliest and the latest),
	// then the call's events in seq order. No events: ErrNotFound.
	Trace(ctx context.Context, key ledger.CallKey) ([]ledger.Event, error)
	// BlastRadius returns the calls matching f and what they add up to.
	// It is the only question that takes f.State.
	BlastRadius(ctx context.Context, f Filter) (BlastRadius, error)
	// Outcomes counts the calls that reached each outcome, by tool and
	// bucket of the outcome event's time. f may name only Tenant,
	// AllTenants, Tool, Since and Until, over at most MaxOutcomeBuckets
	// buckets (CheckOutcomes).
	Outcomes(ctx context.Context, f Filter, bucket time.Duration) ([]OutcomeCount, error)
	// Unresolved returns the calls that wait on someone: outcome_unknown
	// (parked or not) and approval_pending, oldest first. f may name only
	// Tenant, AllTenants, Tool and Limit.
	Unresolved(ctx context.Context, f Filter) ([]Call, error)
}

// Errors callers branch on.
var (
	// ErrNotFound: nothing is projected under the key.
	ErrNotFound = errors.New("not found")
	// ErrTenantRequired: a query named no tenant and did not ask across
	// tenants.
	ErrTenantRequired = errors.New("a tenant is required (or ask across tenants explicitly)")
	// ErrInvalidFilter: the filter cannot be asked; the message says why.
	ErrInvalidFilter = errors.New("invalid filter")
	// ErrQuestionTooLarge: answering needs more memory than the store
	// allows one question; a narrower filter may be answered.
	ErrQuestionTooLarge = errors.New("the question needs more memory than one question may use")
)

// MaxRefusals is how many refused submissions under one key a trace
// shows: a flood of bad envelopes under a key cannot make it unbounded.
// They are the earliest half and the latest half (KeepRefusals): the
// first show how the flood began, the last where it stands, and an
// agent waiting on its own submission's refusal finds it among them.
const MaxRefusals = 100

// CompareRefusals orders refused submissions as traces show them: by
// time, then event id.
func CompareRefusals(a, b ledger.Event) int {
	if c := a.At.Compare(b.At); c != 0 {
		return c
	}
	return strings.Compare(a.EventID, b.EventID)
}

// KeepRefusals returns what a trace keeps of the refused submissions
// sorted (CompareRefusals, each once): all of them, or, when there are
// more than MaxRefusals, the earliest MaxRefusals/2 and the latest
// MaxRefusals/2. A refusal left out of these is left out for good: any
// later refusal only moves it further from both ends. sorted is reused.
func KeepRefusals(sorted []ledger.Event) []ledger.Event {
	if len(sorted) <= MaxRefusals {
		return sorted
	}
	return append(sorted[:MaxRefusals/2], sorted[len(sorted)-MaxRefusals/2:]...)
}

// RefusalsFull counts the refused submissions of a trace, and reports
// whether they are as many as a trace keeps (MaxRefusals): those between
// the earliest and the latest may have been left out, and only the log
// has them all.
func RefusalsFull(trace []ledger.Event) (n int, full bool) {
	for i := range trace {
		if trace[i].Refusal() {
			n++
		}
	}
	return n, n >= MaxRefusals
}

// DefaultLimit is how many calls an answer lists when Filter.Limit is 0;
// counts always cover every matching call.
const DefaultLimit = 1000

// Full reports whether n calls listed under f fill its limit (Limit, or
// DefaultLimit): more calls may match than were listed.
func (f Filter) Full(n int) bool { return n >= cmp.Or(f.Limit, DefaultLimit) }

// MaxLimit bounds Filter.Limit.
const MaxLimit = 100_000

// MaxCounts is how many values a blast radius's count of each dimension
// lists (ByTenant, ByState, ByTool, ByResource): the largest. A busy
// tool's blast radius can touch hundreds of thousands of resources, an
// answer no responder reads and no page renders; BlastRadius.Distinct
// says how many values each dimension has, so that a reader knows when a
// list was cut.
const MaxCounts = 1000

// MaxOutcomeBuckets bounds the buckets an Outcomes question spans, each
// tool's counts having one row per bucket: a 1s bucket over a month would
// be 2.6 million of them. A wider bucket or a narrower window asks the
// same within the bound.
const MaxOutcomeBuckets = 10_000

// Filter selects calls; see the package doc for what matches.
type Filter struct {
	Tenant     string `json:"tenant,omitempty"`
	AllTenants bool   `json:"all_tenants,omitempty"`

	JTI              string `json:"jti,omitempty"`
	CredentialFamily string `json:"credential_family,omitempty"`
	Tool             string `json:"tool,omitempty"`
	// PolicyVersion is a version as events carry it (label@hash, the
	// label the operator gave it and its files' hash), or its label
	// alone, which matches every version of that label.
	PolicyVersion string `json:"policy_version,omitempty"`
	// Role is a role the caller's assertion gave the policies
	// (--policy-roles), on the call's decision: "every call a contractor
	// made".
	Role string `json:"role,omitempty"`
	// Decision narrows PolicyVersion and Role to decisions of one kind:
	// allow, deny or require_approval.
	Decision   string `json:"decision,omitempty"`
	Approver   string `json:"approver,omitempty"`
	ApprovalID string `json:"approval_id,omitempty"`
	// CallID and TraceID name a call, or the calls of a trace, by the
	// ids their events carry: references like JTI.
	CallID  string `json:"call_id,omitempty"`
	TraceID string `json:"trace_id,omitempty"`
	// ToolDigest names the calls admitted under one definition of a tool
	// (its digest, "sha256:..." as events carry it): "every call taken
	// in under the registry entry edited in place".
	ToolDigest string `json:"tool_digest,omitempty"`

	// State narrows the matched calls to those whose state now is State.
	// It is not a reference, and only BlastRadius takes it.
	State statemachine.State `json:"state,omitempty"`

	// Since and Until bound the matching events' times, [Since, Until),
	// in whole seconds; zero is unbounded.
	Since time.Time `json:"since,omitzero"`
	Until time.Time `json:"until,omitzero"`

	// Limit bounds the calls listed; 0 is DefaultLimit.
	Limit int `json:"limit,omitempty"`
}

// Decisions a policy makes, as events record them. An approver's approve
// and reject are decisions too, but not the policy's.
var decisions = map[string]bool{"allow": true, "deny": true, "require_approval": true}

// PolicyVersionMatches reports whether version, as an event carries it
// (label@hash), is the policy version asked names: exactly, or by its
// label alone (so "v41" matches "v41@3f2a9c1b0d7e", never "v410@...").
func PolicyVersionMatches(asked, version string) bool {
	if version == asked {
		return true
	}
	label, _, versioned := strings.Cut(version, "@")
	return versioned && label == asked
}

// PolicyDecision reports whether d is a decision a policy made (allow,
// deny, require_approval): the events a policy version is looked up by.
func PolicyDecision(d string) bool { return decisions[d] }

// Check reports what makes f unaskable, and returns f normalised: times
// truncated to the second and in UTC, Limit defaulted.
func (f Filter) Check() (Filter, error) {
	switch {
	case f.Tenant == "" && !f.AllTenants:
		return f, ErrTenantRequired
	case f.Tenant != "" && f.AllTenants:
		return f, fmt.Errorf("%w: a tenant and all tenants at once", ErrInvalidFilter)
	case f.Decision != "" && f.PolicyVersion == "" && f.Role == "":
		return f, fmt.Errorf("%w: a decision narrows a policy version or a role; name one", ErrInvalidFilter)
	case f.Decision != "" && !decisions[f.Decision]:
		return f, fmt.Errorf("%w: decision %q is not one of allow, deny, require_approval", ErrInvalidFilter, f.Decision)
	case f.State != "" && !slices.Contains(statemachine.States, f.State):
		return f, fmt.Errorf("%w: state %q is not one of %s", ErrInvalidFilter, f.State, knownStates())
	case f.Limit < 0 || f.Limit > MaxLimit:
		return f, fmt.Errorf("%w: limit must be between 0 and %d", ErrInvalidFilter, MaxLimit)
	case f.ToolDigest != "" && !wholeDigest(f.ToolDigest):
		// Matched exactly: a digest cut short (as a trace's table or a
		// role's start log shows it) would match nothing, silently.
		return f, fmt.Errorf("%w: tool digest %q is not a whole one (sha256: and 64 lowercase hex digits): take it from the call's events (ledger trace --json) or the calls CSV's tool_digest column", ErrInvalidFilter, f.ToolDigest)
	case f.JTI != "" && strings.ContainsFunc(f.JTI, notBase64URL):
		// Matched exactly: a jti pasted with a spreadsheet's quote
		// (the CSV puts one before a cell starting with -) or a space
		// would match nothing, silently.
		return f, fmt.Errorf("%w: jti %q holds a character no jti has (they are base64url: letters, digits, - and _): copy it from the call's events (ledger trace --json), without the quote a spreadsheet puts before a cell starting with -", ErrInvalidFilter, f.JTI)
	}
	if label, hash, ok := strings.Cut(f.PolicyVersion, "@"); ok {
		// Events carry label@ and the first 12 hex digits of the
		// content's hash; the whole hash, as an activation pins it, is
		// taken for its first 12.
		hash = strings.TrimPrefix(hash, "sha256:")
		if len(hash) == 64 && lowerHex(hash) {
			hash = hash[:12]
		}
		if len(hash) != 12 || !lowerHex(hash) {
			return f, fmt.Errorf("%w: policy version %q: after the @ comes the policy content's hash, its first 12 lowercase hex digits as events carry it (or the whole sha256), or name the label alone", ErrInvalidFilter, f.PolicyVersion)
		}
		f.PolicyVersion = label + "@" + hash
	}
	if !f.Since.IsZero() {
		f.Since = f.Since.UTC().Truncate(time.Second)
	}
	if !f.Until.IsZero() {
		f.Until = f.Until.UTC().Truncate(time.Second)
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && !f.Since.Before(f.Until) {
		return f, fmt.Errorf("%w: since (%s) must be before until (%s)", ErrInvalidFilter, f.Since.Format(time.RFC3339), f.Until.Format(time.RFC3339))
	}
	if f.Limit == 0 {
		f.Limit = DefaultLimit
	}
	return f, nil
}

// notBase64URL reports whether r is no character of base64url.
func notBase64URL(r rune) bool {
	return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_')
}

// lowerHex reports whether s is lowercase hex digits only.
func lowerHex(s string) bool {
	return !strings.ContainsFunc(s, func(r rune) bool { return !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f') })
}

// wholeDigest reports whether d is a digest as events carry a tool's:
// "sha256:" and 64 lowercase hex digits.
func wholeDigest(d string) bool {
	hexDigits, ok := strings.CutPrefix(d, "sha256:")
	return ok && len(hexDigits) == 64 && lowerHex(hexDigits)
}

// knownStates lists the states a filter may name, for its errors.
func knownStates() string {
	names := make([]string, 0, len(statemachine.States))
	for _, s := range statemachine.States {
		if s != statemachine.StateNone {
			names = append(names, string(s))
		}
	}
	return strings.Join(names, ", ")
}

// References reports whether f names any reference (JTI, family, policy
// version, role, approver, approval id, call id, trace id or tool
// digest), rather than only tenant, tool, time and state.
func (f Filter) References() bool {
	return f.JTI != "" || f.CredentialFamily != "" || f.PolicyVersion != "" || f.Role != "" || f.Approver != "" || f.ApprovalID != "" ||
		f.CallID != "" || f.TraceID != "" || f.ToolDigest != ""
}

// AdmittedUnder reports whether e is a call's requested event naming the
// tool definition digest: the event a ToolDigest filter matches, once a
// call (every later event of the call carries the digest too).
func AdmittedUnder(e *ledger.Event, digest string) bool {
	return e.Type == statemachine.EventRequested && e.Seq == 1 && e.ToolDigest == digest
}

// RoleDecided reports whether e is a policy's decision made with role
// among the caller's roles it was given: the events Filter.Role matches.
// A denial no policy made (a frozen tool, an expired approval: the
// executor's, with no policy version) is not one, whatever roles the
// call carries.
func RoleDecided(e *ledger.Event, role string) bool {
	return PolicyDecision(e.Decision) && e.PolicyVersion != "" && slices.Contains(e.Roles, role)
}

// InWindow reports whether t, in whole seconds, is in [Since, Until).
func (f Filter) InWindow(t time.Time) bool {
	s := t.Unix()
	return (f.Since.IsZero() || s >= f.Since.Unix()) && (f.Until.IsZero() || s < f.Until.Unix())
}

// Call is a call as a projection knows it: the fields of its highest-seq
// event of a known type (KnownType).
type Call struct {
	TenantID       string `json:"tenant_id"`
	IdempotencyKey string `json:"idempotency_key"`
	CallID         string `json:"call_id,omitempty"`
	Tool           string `json:"tool"`
	ToolVersion    int    `json:"tool_version,omitempty"`
	AgentID        string `json:"agent_id,omitempty"`
	UserID         string `json:"user_id,omitempty"`
	Resource       string `json:"resource,omitempty"`
	TraceID        string `json:"trace_id,omitempty"`
	// ToolDigest is the digest of the tool definition the call was
	// admitted under (ledger.Event.ToolDigest), as its highest-seq event
	// names it, like every field here: empty for calls of older builds,
	// and for a call whose latest step an older build wrote (ClickHouse's
	// calls table keeps that row alone once merged). A ToolDigest filter
	// looks at the requested event instead (AdmittedUnder).
	ToolDigest string `json:"tool_digest,omitempty"`

	State statemachine.State `json:"state"`
	// LastEvent is the type of the highest-seq event: parked tells a
	// parked outcome_unknown from one the reconciler still works on.
	LastEvent statemachine.EventType `json:"last_event"`
	Seq       int64                  `json:"seq"`
	UpdatedAt time.Time              `json:"updated_at"`

	PolicyVersion    string `json:"policy_version,omitempty"`
	Approver         string `json:"approver,omitempty"`
	ApprovalID       string `json:"approval_id,omitempty"`
	JTI              string `json:"jti,omitempty"`
	CredentialFamily string `json:"credential_family,omitempty"`
	Reason           string `json:"reason,omitempty"`
	ErrorCode        string `json:"error_code,omitempty"`
}

// Key is the call's key.
func (c Call) Key() ledger.CallKey {
	return ledger.CallKey{TenantID: c.TenantID, IdempotencyKey: c.IdempotencyKey}
}

// KnownType reports whether the state machine knows event type t, and so
// the state a call is in after an event of it. An event of a type it does
// not know (written by a newer ledger that kept the encoding version, or
// by a bug) does not move its call, in every projection: the call stays
// as its last event of a known type left it, state, seq and fields, while
// the event itself is kept for the call's trace and references. The
// projector logs and counts each such event.
func KnownType(t statemachine.EventType) bool {
	_, ok := statemachine.Target(t)
	return ok
}

// Latest returns the call as its highest-seq event of a known type shows
// it; evs are the call's events in seq order. False when none is of a
// known type.
func Latest(evs []ledger.Event) (Call, bool) {
	for i := len(evs) - 1; i >= 0; i-- {
		if KnownType(evs[i].Type) {
			return CallOf(&evs[i]), true
		}
	}
	return Call{}, false
}

// CallOf returns the call as its highest-seq event of a known type, e,
// shows it. An event of an unknown type has no state: see KnownType.
func CallOf(e *ledger.Event) Call {
	state, _ := statemachine.Target(e.Type)
	return Call{
		TenantID: e.TenantID, IdempotencyKey: e.IdempotencyKey, CallID: e.CallID,
		Tool: e.Tool, ToolVersion: e.ToolVersion, ToolDigest: e.ToolDigest, AgentID: e.AgentID, UserID: e.UserID,
		Resource: e.Resource, TraceID: e.TraceID,
		State: state, LastEvent: e.Type, Seq: e.Seq, UpdatedAt: e.At.UTC(),
		PolicyVersion: e.PolicyVersion, Approver: e.Approver, ApprovalID: e.ApprovalID,
		JTI: e.JTI, CredentialFamily: e.CredentialFamily, Reason: e.Reason, ErrorCode: e.ErrorCode,
	}
}

// Count is a number of calls under a value.
type Count struct {
	Value string `json:"value"`
	Calls int    `json:"calls"`
}

// BlastRadius is the answer to "what did this touch".
type BlastRadius struct {
	Filter Filter `json:"filter"`
	// Total is the number of matching calls; Calls lists the first
	// Filter.Limit of them, most recently updated first (then by tenant
	// and key).
	Total int    `json:"total"`
	Calls []Call `json:"calls"`
	// Truncated: the list stopped at Filter.Limit with calls left out.
	Truncated bool `json:"truncated,omitempty"`
	// Counts over every matching call, largest first (then by value),
	// at most MaxCounts values each: Distinct says how many there are.
	ByTenant   []Count `json:"by_tenant"`
	ByState    []Count `json:"by_state"`
	ByTool     []Count `json:"by_tool"`
	ByResource []Count `json:"by_resource"`
	// Distinct is how many values each count has in full; a list
	// shorter than its number was cut at MaxCounts.
	Distinct Distinct `json:"distinct"`
}

// Agrees reports whether br's list is as long as its total and limit
// make it, and, when the list is every matching call, whether its counts
// are the list's. A store that reads the counts and the list apart
// (ClickHouse) can answer with the two disagreeing when a write lands
// between them: a call counted outcome_unknown and listed succeeded.
func (br BlastRadius) Agrees() bool {
	if len(br.Calls) != min(br.Total, br.Filter.Limit) {
		return false
	}
	if br.Total > br.Filter.Limit {
		return true
	}
	s := Summarize(br.Filter, slices.Clone(br.Calls))
	return slices.Equal(s.ByTenant, br.ByTenant) && slices.Equal(s.ByState, br.ByState) &&
		slices.Equal(s.ByTool, br.ByTool) && slices.Equal(s.ByResource, br.ByResource) && s.Distinct == br.Distinct
}

// BlastTries is how many times AskAgreeing reads a blast radius.
const BlastTries = 3

// AskAgreeing reads a blast radius with read until the answer Agrees, at
// most BlastTries times, and returns the last: a projection taking writes
// has moved on between two reads, and the next two usually fall between
// the same writes. Under writes that never pause, the last answer's
// Agrees is false and says so.
func AskAgreeing(ctx context.Context, read func(context.Context) (BlastRadius, error)) (BlastRadius, error) {
	for try := 1; ; try++ {
		br, err := read(ctx)
		if err != nil || br.Agrees() || try == BlastTries {
			return br, err
		}
	}
}

// Distinct is the number of distinct values of each of a blast radius's
// counts, the empty resource of calls that name none included, as the
// counts list it.
type Distinct struct {
	Tenants   int `json:"tenants"`
	States    int `json:"states"`
	Tools     int `json:"tools"`
	Resources int `json:"resources"`
}

// CountsCut reports whether any of br's counts lists fewer values than it
// has (MaxCounts).
func (br BlastRadius) CountsCut() bool {
	return len(br.ByTenant) < br.Distinct.Tenants || len(br.ByState) < br.Distinct.States ||
		len(br.ByTool) < br.Distinct.Tools || len(br.ByResource) < br.Distinct.Resources
}

// OutcomeCount is the number of calls that reached State with an event of
// Tool in the bucket starting at Bucket.
type OutcomeCount struct {
	Bucket time.Time          `json:"bucket"`
	Tool   string             `json:"tool"`
	State  statemachine.State `json:"state"`
	Calls  int                `json:"calls"`
}

// OutcomeEvents are the event types Outcomes counts: the ones that end a
// call, or hand it to someone.
var OutcomeEvents = []statemachine.EventType{
	statemachine.EventSucceeded, statemachine.EventFailed, statemachine.EventOutcomeUnknown,
	statemachine.EventCompensated, statemachine.EventDenied, statemachine.EventRejected,
	statemachine.EventExpired,
}

// CheckOutcomes checks an Outcomes question asked at now and returns its
// filter normalised: Since is taken back to the start of its bucket
// (BucketOf), so that the first bucket counts all it is labelled with,
// not the part after a since of "2h ago". The window may span at most MaxOutcomeBuckets
// buckets: a window without Until ends now, as far as that bound goes
// (the question still counts what is stamped later), and one without
// Since begins at the Unix epoch, where the projections' times begin, so
// that only a bucket of days can go without one.
func CheckOutcomes(f Filter, bucket time.Duration, now time.Time) (Filter, error) {
	f, err := f.Check()
	if err != nil {
		return f, err
	}
	switch {
	case f.References() || f.State != "":
		return f, fmt.Errorf("%w: outcomes are counted by tenant, tool and time only", ErrInvalidFilter)
	case bucket < time.Second || bucket%time.Second != 0:
		return f, fmt.Errorf("%w: the bucket must be a whole number of seconds, at least 1s", ErrInvalidFilter)
	}
	if !f.Since.IsZero() {
		f.Since = BucketOf(f.Since, bucket)
	}
	from, to := f.Since, f.Until
	if from.IsZero() {
		from = time.Unix(0, 0).UTC()
	}
	if to.IsZero() {
		to = now.UTC().Truncate(time.Second).Add(time.Second)
	}
	if n := Buckets(from, to, bucket); n > MaxOutcomeBuckets {
		start := "since " + from.Format(time.RFC3339)
		if f.Since.IsZero() {
			start = "no since (the window starts at the epoch, " + from.Format(time.RFC3339) + ")"
		}
		return f, fmt.Errorf("%w: %s to %s in buckets of %s is %d buckets, more than %d: name a later since or an until, or a wider bucket",
			ErrInvalidFilter, start, to.Format(time.RFC3339), bucket, n, MaxOutcomeBuckets)
	}
	return f, nil
}

// Buckets is the number of epoch-aligned buckets (BucketOf) that hold a
// second of [from, to), in whole seconds: how many rows per tool and
// state an Outcomes answer over that window can have.
func Buckets(from, to time.Time, bucket time.Duration) int64 {
	n := int64(bucket / time.Second)
	f, t := from.Unix(), to.Unix()
	if n <= 0 || f >= t {
		return 0
	}
	// Floor division: a window may start before the epoch.
	floor := func(s int64) int64 {
		q := s / n
		if s%n != 0 && s < 0 {
			q--
		}
		return q
	}
	return floor(t-1) - floor(f) + 1
}

// BucketOf returns the start of t's bucket: buckets are aligned on the
// Unix epoch.
func BucketOf(t time.Time, bucket time.Duration) time.Time {
	n := int64(bucket / time.Second)
	s := t.Unix()
	return time.Unix(s-s%n, 0).UTC()
}

// CheckUnresolved checks an Unresolved question and returns its filter
// normalised.
func CheckUnresolved(f Filter) (Filter, error) {
	f, err := f.Check()
	if err != nil {
		return f, err
	}
	if f.References() || f.State != "" || !f.Since.IsZero() || !f.Until.IsZero() {
		return f, fmt.Errorf("%w: unresolved calls are listed by tenant and tool only", ErrInvalidFilter)
	}
	return f, nil
}

// Unresolved reports whether c waits on someone.
func (c Call) Unresolved() bool {
	return c.State == statemachine.StateOutcomeUnknown || c.State == statemachine.StateApprovalPending
}

// Summarize builds the answer for f from every matching call: the order,
// the limit and the counts (each cut at MaxCounts) that every projection
// gives.
func Summarize(f Filter, calls []Call) BlastRadius {
	SortCalls(calls)
	br := BlastRadius{Filter: f, Total: len(calls), Calls: calls}
	if len(br.Calls) > f.Limit {
		br.Calls, br.Truncated = br.Calls[:f.Limit:f.Limit], true
	}
	count := func(value func(Call) string) ([]Count, int) {
		m := make(map[string]int)
		for _, c := range calls {
			m[value(c)]++
		}
		out := make([]Count, 0, len(m))
		for v, n := range m {
			out = append(out, Count{Value: v, Calls: n})
		}
		SortCounts(out)
		return out[:min(len(out), MaxCounts):min(len(out), MaxCounts)], len(m)
	}
	br.ByTenant, br.Distinct.Tenants = count(func(c Call) string { return c.TenantID })
	br.ByState, br.Distinct.States = count(func(c Call) string { return string(c.State) })
	br.ByTool, br.Distinct.Tools = count(func(c Call) string { return c.Tool })
	br.ByResource, br.Distinct.Resources = count(func(c Call) string { return c.Resource })
	return br
}

// SortCalls orders calls as answers list them: most recently updated
// first, then by tenant and key.
func SortCalls(calls []Call) { slices.SortFunc(calls, byUpdate(-1)) }

// byUpdate orders calls by their last update (sign 1: oldest first, -1:
// newest first), then by tenant and key.
func byUpdate(sign int) func(a, b Call) int {
	return func(a, b Call) int {
		return cmp.Or(sign*a.UpdatedAt.Compare(b.UpdatedAt),
			strings.Compare(a.TenantID, b.TenantID), strings.Compare(a.IdempotencyKey, b.IdempotencyKey))
	}
}

// SortCounts orders counts largest first, then by value.
func SortCounts(cs []Count) {
	slices.SortFunc(cs, func(a, b Count) int {
		if a.Calls != b.Calls {
			return b.Calls - a.Calls
		}
		return strings.Compare(a.Value, b.Value)
	})
}

// SortOutcomes orders outcome counts by bucket, tool and state.
func SortOutcomes(os []OutcomeCount) {
	slices.SortFunc(os, func(a, b OutcomeCount) int {
		if c := a.Bucket.Compare(b.Bucket); c != 0 {
			return c
		}
		if c := strings.Compare(a.Tool, b.Tool); c != 0 {
			return c
		}
		return strings.Compare(string(a.State), string(b.State))
	})
}

// SortUnresolved orders unresolved calls oldest first, then by tenant and
// key.
func SortUnresolved(calls []Call) { slices.SortFunc(calls, byUpdate(1)) }
