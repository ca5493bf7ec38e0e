// Package processors holds what the ledger's processors share: the contract
// of the execution store (the exactly-once dedupe record, with its
// implementations in processors/pgstore and processors/boltstore and its
// contract suite in processors/storetest) and the sorting of errors by
// behaviour.
//
// The execution record doubles as a transactional outbox: whoever moves a
// call forward (intake, executor) writes the events it is about to append
// into the record in the same database transaction that moves the call, and
// marks them logged once the Kafka transaction carrying them committed. A
// crash between the two leaves unlogged events that the next processor to
// touch the call appends again; consumers drop the duplicate (key, seq).
// An authorized call's admission is marked by the executor's claim, which
// comes from reading its event in the log (Claim.Logged), and by the
// intake only if it is still unclaimed a few seconds later. The executor
// marks its outcomes in advance, with their completion, under a journal
// entry per step (Completion.Journal): it settles the entry after its
// Kafka transaction, or as not logged when that did not commit, and the
// sweep (Unlogged) settles as not logged the entries of an executor that
// died.
package processors

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/schemas"
)

// Status is the execution store's view of a call. It follows the call's
// state machine but only the states the store itself moves through.
type Status string

// Statuses of an execution record.
const (
	StatusAuthorized     Status = "authorized"      // admitted and allowed; waiting for a claim
	StatusDenied         Status = "denied"          // admitted and refused by the intake; never runs
	StatusPending        Status = "pending"         // admitted, waiting for something other than the executor (approval)
	StatusExecuting      Status = "executing"       // claimed under a lease
	StatusSucceeded      Status = "succeeded"       // the tool's effect happened
	StatusFailed         Status = "failed"          // the tool refused or failed; no effect
	StatusOutcomeUnknown Status = "outcome_unknown" // the effect may or may not have happened
	StatusExpired        Status = "expired"         // the deadline (or a pending approval) passed before the call could run
	StatusRejected       Status = "rejected"        // an approver refused it; never runs
	StatusCompensated    Status = "compensated"     // its effect was undone
	StatusParked         Status = "parked"          // outcome unknown, and the reconciler handed it to a human
)

// ListedStatuses are the statuses whose calls are listed by status, per
// tenant too (ByStatus, TenantByStatus): those the approval queue, its
// expiry and the reconciler read, which few calls reach. The stores index
// them for those listings; every call's path goes through none of them,
// so that it pays nothing for those indexes. Changing the list changes
// pgstore's partial indexes' predicate, which needs new index names
// (CREATE INDEX IF NOT EXISTS would keep the old ones), and boltstore's
// indexLayout.
var ListedStatuses = []Status{StatusPending, StatusOutcomeUnknown, StatusParked, StatusRejected, StatusExpired, StatusCompensated}

// Listed reports whether s is one of ListedStatuses.
func (s Status) Listed() bool { return slices.Contains(ListedStatuses, s) }

// Done reports whether the executor will never run the call again.
func (s Status) Done() bool {
	switch s {
	case StatusDenied, StatusSucceeded, StatusFailed, StatusOutcomeUnknown, StatusExpired, StatusRejected, StatusCompensated, StatusParked:
		return true
	}
	return false
}

// ErrNotFound: no record for the key.
var ErrNotFound = errors.New("execution record not found")

// ErrRejected: the store refuses the data itself (a value it cannot hold,
// a constraint it breaks); sending the same data again will not help.
// Callers branch on it to set the offending item aside instead of retrying
// the batch forever.
var ErrRejected = errors.New("store rejected the data")

// Statuses lists every Status, for stores that check them.
var Statuses = []Status{
	StatusAuthorized, StatusDenied, StatusPending, StatusExecuting,
	StatusSucceeded, StatusFailed, StatusOutcomeUnknown, StatusExpired,
	StatusRejected, StatusCompensated, StatusParked,
}

// Record is one call's execution record.
type Record struct {
	Key           ledger.CallKey
	CallID        string
	ArgumentsHash string
	// UserID is the verified user the call was admitted for (empty: an
	// identity without a user, or a record an older build admitted).
	UserID      string
	Tool        string
	ToolVersion int
	// ToolDigest is the digest of the tool's definition the call was
	// admitted under (schemas.Tool.Digest): every process that acts on
	// the call takes the tool by it (schemas.Registry.Bound). Empty on a
	// record an older build admitted.
	ToolDigest string
	// Arguments is the canonical JSON (RFC 8785) of the call's arguments,
	// unredacted: what the intake validated and hashed, and what runs.
	Arguments  []byte
	DeadlineAt time.Time // zero: no deadline
	Status     Status
	// Epoch is the fencing token: it grows by one with every claim, and
	// only the holder of the current epoch may complete the call.
	Epoch int64
	// Attempt counts the tool invocations so far: a completion's, or,
	// while executing, those of claims given back after the tool
	// answered them without effect (Release.Attempt).
	Attempt    int
	LeaseOwner string
	LeaseUntil time.Time
	// Result is the sanitized result of a finished call.
	Result []byte
	// Seq is the seq of the last event written into the record's outbox;
	// LoggedSeq the highest seq known, or marked in advance under a
	// journal entry not yet settled (Completion.Journal), to be in the
	// log: Unlogged() may be false while a step's events are on their
	// way, and the entry's settling reverts it if they do not arrive.
	// Outbox holds the encoded events (ledger.EncodeEvents) of the
	// latest step.
	Seq       int64
	LoggedSeq int64
	Outbox    []byte
	CreatedAt time.Time
	UpdatedAt time.Time
	// Credential is the call's per-call credential as its claims named
	// it (Claim.Credential), recorded before any request of a claim
	// left: the jti of the first claim that named one, kept for the
	// call's life, and the family of the latest claim. Zero when none
	// named one (a deployment that mints none, or a record of an older
	// build).
	Credential CallCredential
	// LapsedFamilies are the families of the call's earlier claims
	// whose credentials may have reached the tool, in the order they
	// ended, each once. Those of the claims whose lease ran out (their
	// owners died or stalled, and may have sent the call's requests
	// under them): the claim that takes the call over adds the family
	// the record named, the expired claim's, so that it is not lost
	// should the new owner die too before it records anything (its
	// Prior names only its own predecessor's). And those of the claims
	// given back after the tool answered their requests without effect
	// (Release.Sent): the next claim may name another family, its key
	// rotated meanwhile. The first MaxLapsedFamilies are kept. Empty
	// for a call no such claim of ended, and in the records of older
	// builds.
	LapsedFamilies []string
	// UndoMarks counts the times an executor of the call's compensation
	// found the call undoable and went on to send the undo (MarkUndo).
	// Every Move carries the count it read (Move.FromUndoMarks), so that
	// a move decided before a compensation started (a call settled failed
	// by its status lookup, or by an operator) does not apply once the
	// undo may be on its way. Zero for a call nothing undid, and in the
	// records of older builds.
	UndoMarks int64
	// Unanswered is what the reconcilers noted of the call while its
	// status lookups did not answer (NoteUnanswered); it holds at the
	// step it names alone (UnansweredAt).
	Unanswered Unanswered
}

// Unanswered is what the reconcilers noted of a call in outcome_unknown
// whose status lookups have not answered: kept on its record, so that a
// reconciler that restarts, or takes the call over from another, neither
// starts the wait for an answer again nor forgets that the tool said the
// call is in progress (an undo sent then may come first and cancel
// nothing). The zero Unanswered notes nothing.
type Unanswered struct {
	// Seq is the record's Seq when it was noted: the note is of the call
	// at that step, and says nothing once the call moved on.
	Seq int64
	// Since is the end of the first round of lookups that failed (or a
	// reconciler's breaker held off) since none answered, by the clock of
	// the reconciler that ran it (the reconcilers' hosts' clocks must
	// agree: ledger doctor --max-clock-skew); zero once a lookup answered.
	Since time.Time
	// InProgress: a lookup was answered by the tool, saying that the call
	// is in progress. An answer after it does not clear it: once the tool
	// said so, nothing automatic undoes the call at this step.
	InProgress bool
}

// UnansweredAt returns r's note of unanswered lookups, if it is of the
// call's current step (Unanswered.Seq is Seq) and notes anything.
func (r *Record) UnansweredAt() (Unanswered, bool) {
	n := r.Unanswered
	if n.Seq != r.Seq || (n.Since.IsZero() && !n.InProgress) {
		return Unanswered{}, false
	}
	return n, true
}

// Merged is the note a record holds once n (NoteUnanswered's) is
// merged into stored, its note: n alone if stored is of another Seq.
// Of the same Seq: InProgress if either says so; no Since if n's is zero
// (a lookup answered), else the earlier of the two. A note of neither
// is the zero Unanswered.
func (n Unanswered) Merged(stored Unanswered) Unanswered {
	if stored.Seq == n.Seq {
		n.InProgress = n.InProgress || stored.InProgress
		if !n.Since.IsZero() && !stored.Since.IsZero() && stored.Since.Before(n.Since) {
			n.Since = stored.Since
		}
	}
	if n.Since.IsZero() && !n.InProgress {
		return Unanswered{} // nothing noted
	}
	return n
}

// Equal reports whether n and o note the same, their Since the same
// instant.
func (n Unanswered) Equal(o Unanswered) bool {
	return n.Seq == o.Seq && n.Since.Equal(o.Since) && n.InProgress == o.InProgress
}

// CallCredential names a call's per-call credential by its jti and its
// family (credentials.Credential's), never by its token: what an
// incident responder asks the events about, and revokes.
type CallCredential struct {
	JTI    string
	Family string
}

// IsZero reports whether c names no credential.
func (c CallCredential) IsZero() bool { return c == CallCredential{} }

// MaxLapsedFamilies bounds Record.LapsedFamilies: a call whose owners
// kept dying (one that crashes every executor it reaches, say) keeps
// its first ones; the latest is always the takeover's Prior. Families
// repeat (an executor's key signs for a day), so the bound is reached
// only by that many executors or days.
const MaxLapsedFamilies = 32

// LapseFamily is lapsed (Record.LapsedFamilies) once a claim took over
// a call whose expired claim named family, or a claim was given back
// after its requests under family reached the tool (Release.Sent): with
// family added, unless it is empty, already there, or the list is full.
// It never writes into lapsed's array.
func LapseFamily(lapsed []string, family string) []string {
	if family == "" || slices.Contains(lapsed, family) || len(lapsed) >= MaxLapsedFamilies {
		return lapsed
	}
	return append(slices.Clip(lapsed), family)
}

// maxCredentialName bounds a jti and a family in a claim: the ledger's
// are 22 and at most 270 bytes (a tool, a tenant and an epoch).
const maxCredentialName = 512

// Unlogged reports whether the record holds events that may be missing from
// the log.
func (r *Record) Unlogged() bool { return r.LoggedSeq < r.Seq && len(r.Outbox) > 0 }

// Cursor is a place in a listing's order (a time, then the key): that of
// the record it was taken from, which need not be listed any more. The
// time is the record's update time in Unlogged's and ByStatusAfter's
// order, its lease's end in ExpiredAfter's. They list the records after
// it, so that a sweep can go on past a page it could not act on instead
// of reading the same page again. The zero Cursor is before every record.
type Cursor struct {
	At  time.Time
	Key ledger.CallKey
}

// IsZero reports whether c is the zero Cursor.
func (c Cursor) IsZero() bool { return c.At.IsZero() && c.Key == ledger.CallKey{} }

// Cursor is r's place in Unlogged's and ByStatusAfter's order.
func (r *Record) Cursor() Cursor { return Cursor{At: r.UpdatedAt, Key: r.Key} }

// ToolIn returns r's tool from reg as the call was admitted: the
// version r names, defined as it was then (schemas.Registry.Bound). A
// registry that defines the version otherwise does not have the call's
// tool: an error wrapping schemas.ErrOtherDefinition.
func (r *Record) ToolIn(reg *schemas.Registry) (*schemas.Tool, error) {
	return reg.Bound(r.Tool, r.ToolVersion, r.ToolDigest)
}

// LeaseCursor is r's place in ExpiredAfter's order.
func (r *Record) LeaseCursor() Cursor { return Cursor{At: r.LeaseUntil, Key: r.Key} }

// Admission is what the intake records on first sight of a call.
type Admission struct {
	Key           ledger.CallKey
	CallID        string
	ArgumentsHash string
	// UserID is the verified identity's user: a key another user holds
	// is not theirs to retry (see Answer).
	UserID      string
	Tool        string
	ToolVersion int
	// ToolDigest is the digest of the definition the intake admitted the
	// call under (Record.ToolDigest).
	ToolDigest string
	Arguments  []byte
	DeadlineAt time.Time
	Status     Status // StatusAuthorized, StatusDenied or StatusPending
	Seq        int64  // seq of the last event in Outbox
	Outbox     []byte
	// Records, when set, are Outbox's events as records for the log,
	// encoded with it (ledger.EncodeOutbox). The stores ignore them.
	Records []*kgo.Record
	// Rates, when set, charge the call to rate limits (see RateLimiter
	// for the buckets' semantics; the buckets are the same as Take's)
	// in the transaction that admits it, all or nothing (ChargeAll):
	// the key is admitted only if every bucket admits its request, and
	// the buckets are charged only then, every one of them. So a call
	// is charged once, when it is first recorded: a Duplicate or a
	// Conflict charges nothing, nor does the redelivery of a batch that
	// was admitted before its step failed, and a charge never outlives
	// an admission rolled back. A refused one is Limited, and creates
	// and charges nothing, not even to the buckets that had room. Empty:
	// no limit.
	Rates []RateRequest
}

// Record is the record that admitting a creates at now: what a says,
// in a fresh state (no claim, no outcome, nothing logged).
func (a Admission) Record(now time.Time) Record {
	deadline := a.DeadlineAt
	if !deadline.IsZero() {
		deadline = deadline.UTC()
	}
	return Record{
		Key: a.Key, CallID: a.CallID, ArgumentsHash: a.ArgumentsHash, UserID: a.UserID,
		Tool: a.Tool, ToolVersion: a.ToolVersion, ToolDigest: a.ToolDigest, Arguments: a.Arguments,
		DeadlineAt: deadline, Status: a.Status, Seq: a.Seq, Outbox: a.Outbox,
		CreatedAt: now, UpdatedAt: now,
	}
}

// Answer is a's outcome against the record its key already holds, cur:
// Duplicate when a is the same call (same arguments hash) from the same
// user, Conflict otherwise. Another user's admission is a Conflict even
// with the same arguments: as a Duplicate it would be answered as a retry
// of a call its user cannot see, so that a user who guessed another's key
// could confirm a guess of its arguments (a Conflict is refused alike,
// whatever the arguments). A record without a user (admitted by a build
// that recorded none), or an admission without one (a call the ledger
// makes itself, under a key it derives, which agents cannot submit), is
// compared by its hash alone.
func (a Admission) Answer(cur Record) AdmitOutcome {
	if cur.ArgumentsHash != a.ArgumentsHash || (cur.UserID != "" && a.UserID != "" && cur.UserID != a.UserID) {
		return Conflict
	}
	return Duplicate
}

// AdmitOutcome says what Admit found.
type AdmitOutcome int

// Outcomes of Admit.
const (
	// Admitted: the key was free; the record now exists.
	Admitted AdmitOutcome = iota + 1
	// Duplicate: the key exists with the same arguments hash and user: a
	// retry of the same call (Admission.Answer). The existing record is
	// returned.
	Duplicate
	// Conflict: the key exists with another arguments hash, or another
	// user's: the key was reused for a different call
	// (idempotency_key_reused).
	Conflict
	// Limited: the key was free, but one or more of the admission's
	// Rates buckets refused it (AdmitResult.RetryAfter says when to
	// retry). Nothing was created or charged: the key stays free.
	Limited
)

// AdmitResult is Admit's answer for one admission. Record is the existing
// record for Duplicate and Conflict, the new one for Admitted, and empty
// for Limited. Rates answers an admission with Rates that was Admitted
// or Limited, one result per request and in their order (ChargeAll's);
// nil otherwise. A later copy of a key in the same batch that is Limited
// gets its first copy's Rates: the copies are refused alike, on the
// first one's requests.
type AdmitResult struct {
	Outcome AdmitOutcome
	Record  Record
	Rates   []RateResult
}

// RetryAfter is, for a Limited admission, how long until every bucket
// that refused it would admit it if nothing else used them: the longest
// RetryAfter of its Rates. Zero for any other outcome.
func (r AdmitResult) RetryAfter() time.Duration {
	var d time.Duration
	for _, res := range r.Rates {
		d = max(d, res.RetryAfter)
	}
	return d
}

// Claim asks to run a call under a lease.
type Claim struct {
	Key           ledger.CallKey
	ArgumentsHash string
	Owner         string
	Lease         time.Duration
	// Logged, when non-zero, is the seq of the event the claim comes
	// from, read from the log: the record's events up to it are there,
	// and a claim that wins records so (LoggedSeq, never past the
	// record's Seq). The intake then need not mark its admission logged
	// in a write of its own. A claim from a sweep leaves it zero.
	Logged int64
	// Credential names the credential the claimer will send the call's
	// requests with, if any. A claim that wins records it in the same
	// write, so that whoever claims the call after this claim's lease
	// ran out learns what may have reached the tool under it
	// (ClaimResult.Prior): its family always (zero: none), its JTI only
	// when the record names no jti yet. A call keeps one jti over all
	// its claims, whichever executor makes them, so that its jti finds
	// every request of it, those of owners that died before they
	// recorded anything included; the claimer sends the record's
	// (ClaimResult.Record.Credential), not necessarily its own.
	Credential CallCredential
}

// ClaimOutcome says what Claim found.
type ClaimOutcome int

// Outcomes of Claim.
const (
	// Claimed: the call was authorized and is now executing under the
	// caller's lease, at Record.Epoch.
	Claimed ClaimOutcome = iota + 1
	// Reclaimed: the call was executing under a lease that has expired (its
	// owner died or stalled mid-call); the caller now holds it at a new
	// epoch. Whether the tool ran is unknown. A call its owner gave back
	// (Release) is Claimed instead, once its release ends: nothing was
	// sent under it.
	Reclaimed
	// Busy: another owner holds a live lease.
	Busy
	// Finished: the call is done (Status.Done); it must not run again.
	Finished
	// Mismatch: the record's arguments hash differs from the claim's.
	Mismatch
	// Missing: no record for the key.
	Missing
	// NotReady: the record exists but is not authorized (pending approval).
	NotReady
)

// ClaimResult is Claim's answer for one claim.
type ClaimResult struct {
	Outcome ClaimOutcome
	Record  Record
	// Prior, for Reclaimed, is the credential the expired claim named
	// (its Claim.Credential), which may have reached the tool: zero
	// when it named none, and for every other outcome (a released
	// claim sent nothing).
	Prior CallCredential
}

// Completion records a claimed call's outcome, fenced by the epoch.
type Completion struct {
	Key     ledger.CallKey
	Epoch   int64
	Status  Status // a Done status
	Attempt int
	Result  []byte
	Seq     int64
	Outbox  []byte
	// Records: as Admission.Records.
	Records []*kgo.Record
	// Journal, when set, records the completion as logged in the same
	// write (LoggedSeq = Seq), provisionally: the store lists it under
	// the journal entry of that name, which the caller ends with Settle
	// once its events are in the log, or once they failed to get there.
	// It spares every call a write of its own after the log's commit:
	// one entry serves a whole batch. An entry never settled (its
	// writer died) is settled as not logged by Unlogged once it is
	// older than Unlogged's olderThan. Completions of several batches
	// may share an entry: it then lists them all. Empty: the completion
	// leaves LoggedSeq as it is and the caller marks it with MarkLogged.
	Journal string
	// From is the record's Seq when the call was claimed: the events in
	// Outbox come after it. A journal entry settled as not logged puts
	// LoggedSeq back there.
	From int64
}

// Release gives a claimed call back without an outcome: its owner sent
// nothing under the claim, or only requests the tool answered without
// effect (a 429), and the call is to be tried again later (a check
// before the call could not be made: the policies could not decide an
// approved call's re-check). Fenced by the epoch, as a completion.
type Release struct {
	Key   ledger.CallKey
	Epoch int64
	// Sent is the credential family of the claim's requests that
	// reached the tool (answered without effect), empty if none did:
	// the store adds it to Record.LapsedFamilies (as LapseFamily), so
	// that the call's events name it though a later claim names
	// another (a key rotated meanwhile). The credential stays the
	// call's: a tool may hold it, in a log.
	Sent string
	// Attempt is the number of the claim's last attempt whose request
	// reached the tool (answered without effect), 0 if none did: the
	// record's attempt is raised to it, so that the next claim numbers
	// its attempts after them, and knows that the call started.
	Attempt int
	// After is how long no claim may take the call: the record stays
	// executing, without a lease owner, under a lease that ends After
	// from now (the store's clock), and Expired lists it from then.
	After time.Duration
}

// Move is a compare-and-set of a record's status, for the steps outside
// the executor (an approval decided, a pending approval expired): it
// applies only while the record is still at From, at seq FromSeq and at
// FromUndoMarks (Record.UndoMarks), and then writes To, Seq and Outbox
// (the events of the step). Of several concurrent moves of one record, and
// of a move and a MarkUndo of it, one applies.
type Move struct {
	Key           ledger.CallKey
	From          Status
	FromSeq       int64
	FromUndoMarks int64
	To            Status
	Seq           int64
	Outbox        []byte
	// Result, when not nil, replaces the record's result: that of a call
	// the reconciler settles succeeded, which its tool's status lookup
	// answered. Only a move to StatusSucceeded carries one; nil leaves
	// the result as it is.
	Result []byte
	// UnlessInProgress: the move applies only if the record's note of
	// unanswered lookups at FromSeq (Unanswered) does not say that the
	// tool answered the call is in progress. A reconciler's park for
	// lookups that failed, which may ask for an undo, carries it: another
	// reconciler may hear "in progress" between its read of the note and
	// its move.
	UnlessInProgress bool
}

// Logged says that the events of a call up to Seq are in the log.
type Logged struct {
	Key ledger.CallKey
	Seq int64
	// Base is the LoggedSeq the caller read when it chose which events
	// to append (those past it): the mark applies only while the record
	// is still logged at least that far. A journal entry settled as not
	// logged meanwhile (Settle) lowered it, and events at or below Base
	// may then be missing from the log: the mark is left out, and the
	// sweep appends them. Zero for events appended without reading the
	// record (a call's own new events).
	Base int64
}

// Store is the execution store. Each method runs as one transaction,
// retried whole on serialization failures, and takes a batch so that
// throughput is not one round trip per call. Its effect is as if the
// transaction were serializable: the methods that pgstore runs at READ
// COMMITTED on PostgreSQL (see its relaxed) decide each record on that
// record alone, under its row lock. Results are in the
// order of the inputs. Implementations are safe for concurrent use; a
// cancelled ctx abandons the transaction.
type Store interface {
	// Admit records each admission whose key is free, and answers the
	// others from the existing record. Of several admissions of one key
	// in a batch, the first decides (it is admitted, or Limited) and the
	// later ones are answered as if they came after it (a Duplicate, a
	// Conflict, or Limited alike). Admissions with Rates are charged to
	// their buckets in batch order, only those whose keys are free, each
	// all or nothing (see Admission.Rates).
	Admit(ctx context.Context, as []Admission) ([]AdmitResult, error)
	Claim(ctx context.Context, cs []Claim) ([]ClaimResult, error)
	// Complete applies each completion whose epoch is still current and
	// whose record is executing; applied[i] reports which did. A false
	// means the caller was fenced out and must not append events.
	Complete(ctx context.Context, cs []Completion) (applied []bool, err error)
	MarkLogged(ctx context.Context, ls []Logged) error
	// Release applies each release whose epoch is still current and whose
	// record is executing; applied[i] reports which did. A released
	// record stays executing with no lease owner, its seq and outbox as
	// they were, its attempt raised to Release.Attempt, until its lease
	// (Release.After) ends; the
	// claim that takes it then is Claimed, not Reclaimed. The caller
	// must have sent nothing under its claim that the tool may have
	// applied (only requests it answered without effect, whose family
	// Release.Sent names), and must hold a claim that was not Reclaimed
	// (an earlier owner may have sent): a release says that no request
	// of the call ever had an effect.
	Release(ctx context.Context, rs []Release) (applied []bool, err error)
	// Settle ends the journal entries named (see Completion.Journal).
	// With logged, their completions' events are in the log: the
	// entries go and the records stay as they are. Without, the events
	// may not be: each listed call whose completion applied (same
	// epoch) goes back to LoggedSeq = From, so that Unlogged, a claim
	// and a duplicate admission find its events to append again, and
	// the entries go. That is the one way LoggedSeq goes down, and it
	// holds whatever was marked since: a record that moved on (an
	// unknown outcome resolved) keeps the completion's events in its
	// outbox, while its mover appended only those past the mark made
	// in advance. Appending again is safe; leaving out is not. Names
	// without an entry (settled already, or never written) are
	// ignored.
	Settle(ctx context.Context, journals []string, logged bool) error
	// Expired returns up to limit records executing under a lease that
	// ended before now (the store's clock), oldest first: claims whose
	// owner died or stalled, and claims given back (Release) whose
	// release ended.
	Expired(ctx context.Context, limit int) ([]Record, error)
	// ExpiredAfter is Expired from after on (the zero Cursor: from the
	// oldest), in its order: the lease's end, then the key
	// (Record.LeaseCursor).
	ExpiredAfter(ctx context.Context, after Cursor, limit int) ([]Record, error)
	// Unlogged returns up to limit records, in any status but executing,
	// whose outbox events are not known to be in the log (LoggedSeq <
	// Seq), last updated more than olderThan ago by the store's clock,
	// oldest first (ties by key, in the store's order of keys), after
	// the Cursor after (the zero Cursor: from the oldest). They are what
	// a step left behind when its events did not reach the log (a Kafka
	// transaction aborted in a rebalance after another instance had
	// skipped the call, a publish that failed after an approval was
	// recorded), or an authorized call that no executor claimed and
	// whose intake did not get to mark it (it crashed, or its mark
	// failed). Appending them again is always safe. First, it
	// settles as not logged the journal entries (Completion.Journal)
	// written more than olderThan ago, oldest first, until they list
	// limit calls (one entry at least, so that a sweep overshoots by less
	// than one entry): their writer did not settle them in that time, and
	// their calls become unlogged records like any other (listed once old
	// enough, and within limit). limit bounds the calls, not the entries,
	// so that a sweep after many executors died stays one small
	// transaction.
	Unlogged(ctx context.Context, olderThan time.Duration, after Cursor, limit int) ([]Record, error)
	// Move applies each move whose record is still at its From status,
	// FromSeq and FromUndoMarks; applied[i] reports which did.
	Move(ctx context.Context, ms []Move) (applied []bool, err error)
	// MarkUndo is the check an executor of key's compensation makes
	// before it sends the undo: if the call's status is one of undoable,
	// it counts the mark on the record (UndoMarks), in the same write, so
	// that no move of the call read before it applies; it reports the
	// status it found, and whether it marked the record. ErrNotFound when
	// there is no record. A read instead of this write let a call be
	// settled failed (no effect) between the check and the send, and then
	// be undone.
	MarkUndo(ctx context.Context, key ledger.CallKey, undoable []Status) (Status, bool, error)
	// NoteUnanswered merges n into key's note of unanswered lookups
	// (Record.Unanswered, Unanswered.Merged) if the record is still at
	// n.Seq, and returns the note it holds after: the earliest Since
	// noted at that Seq since a lookup last answered (n with a zero
	// Since: one did), and InProgress once any note said so. A note of
	// an earlier Seq is replaced. ok is false, nothing written, when the
	// record is at another Seq (the call moved on); ErrNotFound when
	// there is no record. It moves nothing: Seq and UpdatedAt stay.
	NoteUnanswered(ctx context.Context, key ledger.CallKey, n Unanswered) (note Unanswered, ok bool, err error)
	// ByStatus returns up to limit records in status, oldest update
	// first.
	ByStatus(ctx context.Context, status Status, limit int) ([]Record, error)
	// ByStatusAfter is ByStatus from after a Cursor on (the zero Cursor:
	// from the oldest), so that a sweep can page past records that stay
	// in status for long (calls parked for a human) instead of reading
	// the same oldest page every time.
	ByStatusAfter(ctx context.Context, status Status, after Cursor, limit int) ([]Record, error)
	// TenantByStatus is ByStatus for the records of one tenant: a tenant
	// with many records in status does not hide the others' (the
	// approval queue is listed per tenant).
	TenantByStatus(ctx context.Context, tenant string, status Status, limit int) ([]Record, error)
	// TenantLatestByStatus is TenantByStatus newest update first: the
	// latest limit records of the tenant in status before the Cursor
	// before (the zero Cursor: from the newest; a record's Cursor lists
	// those listed after it), for the statuses records stay in for good
	// (an approval rejected or expired), whose oldest page would hide
	// every newer one. The tenant is required, and a cursor of another
	// tenant's is an error.
	TenantLatestByStatus(ctx context.Context, tenant string, status Status, before Cursor, limit int) ([]Record, error)
	// Get returns the record for key, or ErrNotFound.
	Get(ctx context.Context, key ledger.CallKey) (Record, error)
	// ReadBack is Get once every write of key's record still in flight
	// has ended: what a writer whose write failed (a connection lost on
	// COMMIT, a deadline) reads to learn whether it applied. A Get may
	// return the record as it was while such a write still commits.
	ReadBack(ctx context.Context, key ledger.CallKey) (Record, error)
	Close() error
}

// CheckAdmissions, CheckClaims and CheckCompletions refuse a batch that no
// store may apply, before any work: every implementation calls them, so
// they refuse the same batches.
func CheckAdmissions(as []Admission) error {
	for i, a := range as {
		switch a.Status {
		case StatusAuthorized, StatusDenied, StatusPending:
		default:
			return fmt.Errorf("admission %d (%v): status %q is not authorized, denied or pending", i, a.Key, a.Status)
		}
		for j, r := range a.Rates {
			if err := r.check(); err != nil {
				return fmt.Errorf("admission %d (%v): rate request %d (bucket %q): %w: %s", i, a.Key, j, r.Bucket, ErrInvalidRateRequest, err)
			}
		}
	}
	return nil
}

// CheckClaims: see CheckAdmissions.
func CheckClaims(cs []Claim) error {
	for i, c := range cs {
		if c.Lease <= 0 || c.Owner == "" {
			return fmt.Errorf("claim %d (%v): want a positive lease and an owner, got %v and %q", i, c.Key, c.Lease, c.Owner)
		}
		if len(c.Credential.JTI) > maxCredentialName || len(c.Credential.Family) > maxCredentialName {
			return fmt.Errorf("claim %d (%v): a credential's jti and family are at most %d bytes, got %d and %d", i, c.Key, maxCredentialName, len(c.Credential.JTI), len(c.Credential.Family))
		}
	}
	return nil
}

// CheckCompletions: see CheckAdmissions.
func CheckCompletions(cs []Completion) error {
	for i, c := range cs {
		if !c.Status.Done() {
			return fmt.Errorf("completion %d (%v): status %q is not a done status", i, c.Key, c.Status)
		}
		if c.Journal != "" && (c.From < 0 || c.From >= c.Seq) {
			return fmt.Errorf("completion %d (%v): journaled with from %d, not in [0, seq %d)", i, c.Key, c.From, c.Seq)
		}
	}
	return nil
}

// settles reports whether a move from a done status only settles what
// happened, never lets the call run again: an unknown outcome resolved
// (succeeded, failed, compensated) or parked for a human, a parked one
// resolved, a succeeded call compensated.
func settles(from, to Status) bool {
	switch from {
	case StatusOutcomeUnknown, StatusParked:
		return to == StatusSucceeded || to == StatusFailed || to == StatusCompensated || to == StatusParked
	case StatusSucceeded:
		return to == StatusCompensated
	}
	return false
}

// CheckReleases: see CheckAdmissions.
func CheckReleases(rs []Release) error {
	for i, r := range rs {
		if r.Epoch <= 0 || r.After < 0 || r.Attempt < 0 {
			return fmt.Errorf("release %d (%v): want a claimed epoch, a delay and an attempt not negative, got %d, %v and %d", i, r.Key, r.Epoch, r.After, r.Attempt)
		}
		if len(r.Sent) > maxCredentialName {
			return fmt.Errorf("release %d (%v): sent family of %d bytes, more than %d", i, r.Key, len(r.Sent), maxCredentialName)
		}
	}
	return nil
}

// CheckUndoable: see CheckAdmissions. MarkUndo's statuses are known ones,
// at least one.
func CheckUndoable(undoable []Status) error {
	if len(undoable) == 0 {
		return errors.New("mark undo: no undoable status")
	}
	for _, st := range undoable {
		if !slices.Contains(Statuses, st) {
			return fmt.Errorf("mark undo: unknown status %q", st)
		}
	}
	return nil
}

// CheckMoves: see CheckAdmissions. A move neither enters nor leaves
// executing (claims and completions do that), and a done call moves only
// to settle what happened (see settles): moving it back would let it run
// again.
func CheckMoves(ms []Move) error {
	for i, m := range ms {
		switch {
		case !slices.Contains(Statuses, m.From) || !slices.Contains(Statuses, m.To):
			return fmt.Errorf("move %d (%v): %q -> %q: unknown status", i, m.Key, m.From, m.To)
		case m.From == StatusExecuting || m.To == StatusExecuting:
			return fmt.Errorf("move %d (%v): %q -> %q: an executing call moves through Claim and Complete only", i, m.Key, m.From, m.To)
		case m.From.Done() && !settles(m.From, m.To):
			return fmt.Errorf("move %d (%v): %q -> %q: a done call does not move", i, m.Key, m.From, m.To)
		case m.Seq <= m.FromSeq:
			return fmt.Errorf("move %d (%v): seq %d -> %d: want it to grow", i, m.Key, m.FromSeq, m.Seq)
		case m.Result != nil && m.To != StatusSucceeded:
			return fmt.Errorf("move %d (%v): to %q with a result: only a call that succeeded has one", i, m.Key, m.To)
		}
	}
	return nil
}
