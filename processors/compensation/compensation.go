// Package compensation undoes calls: on an operator's request it runs the
// compensation a tool declares (refund_order's is cancel_refund) as a
// ledger call of its own, with its own key derived from the original's,
// through the intake's checks, the same policies, the executor and a
// credential of its own. The reconciler appends compensated to the
// original once the compensation succeeded.
package compensation

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Errors callers branch on. Each is terminal (Terminal reports true):
// asking again gets the same answer, which the reconciler, asking for
// compensations itself, does not retry.
var (
	// ErrForbidden: not an operator of the call's tenant.
	ErrForbidden error = terminalError("compensation: not an operator of the call's tenant")
	// ErrNotCompensable: the call did not (or may not have) taken effect,
	// or was compensated already.
	ErrNotCompensable error = terminalError("compensation: only a succeeded call, or one whose outcome is unknown, can be compensated")
	// ErrNoCompensation: the tool declares no compensation.
	ErrNoCompensation error = terminalError("compensation: the tool declares no compensation")
	// ErrAutomaticCompensationPending: the compensation the reconciler
	// asked for (AutomaticUser) is still to run, and the call has since
	// been settled succeeded, which an automatic compensation does not
	// undo: a request now would be taken for it, and undo nothing.
	ErrAutomaticCompensationPending error = terminalError("compensation: the reconciler's automatic compensation of the call is pending, and does not undo a call settled succeeded")
	// ErrSettled: the reconciler asked (AutomaticUser) to undo a call no
	// longer parked for its compensation (ReasonRequested): settled by an
	// operator since it was listed, or handed to one. The
	// compensation it would start undoes nothing, and would spend the
	// call's one compensation key, which an operator may need.
	ErrSettled error = terminalError("compensation: the call is no longer parked for its compensation; the reconciler's automatic compensation undoes only a call so parked")
	// ErrCompensationFailed: the call's compensation ran and did not
	// undo it (failed, denied, expired).
	ErrCompensationFailed error = terminalError("compensation: the compensation did not succeed")
	// ErrCompensationUnsettled: the call's compensation ran, and whether
	// it undid the call is not known (its outcome unknown, or parked):
	// undone by hand now, the call could be undone twice. Its own
	// outcome is what to settle first.
	ErrCompensationUnsettled error = terminalError("compensation: whether the compensation undid the call is not known")
	// ErrArgumentsChanged: the call's stored arguments no longer hash to
	// the hash it was admitted with (changed in the store): what it ran,
	// and so what to undo, cannot be told from them.
	ErrArgumentsChanged error = terminalError("compensation: the call's stored arguments do not match the hash it was admitted with; what it did must be undone by hand")
	// ErrInvalidReason: the reason is empty, or longer than
	// MaxReasonBytes.
	ErrInvalidReason error = terminalError("compensation: invalid reason")
)

// ErrMayStillLand: the call's outcome went unknown so recently that its
// last attempt may still reach the tool (Config.Landing): an undo sent
// now could come first, undo nothing, and have the call recorded
// compensated with its effect standing. Not terminal: ask again from the
// time its *LandingError names.
var ErrMayStillLand = errors.New("compensation: the call's last attempt may still reach the tool")

// LandingError is ErrMayStillLand with the time from which the call's
// compensation may be asked for.
type LandingError struct{ Until time.Time }

func (e *LandingError) Error() string {
	return fmt.Sprintf("%v: its outcome went unknown moments ago; ask again from %s", ErrMayStillLand, e.Until.UTC().Format(time.RFC3339))
}

// SetRetryAfter sets w's Retry-After to the whole seconds until err's
// LandingError lets the action be asked for again, if err is one.
func SetRetryAfter(w http.ResponseWriter, err error) {
	if le, ok := errors.AsType[*LandingError](err); ok {
		httpjson.SetRetryAfter(w, time.Until(le.Until))
	}
}

// Is makes errors.Is(err, ErrMayStillLand) hold.
func (e *LandingError) Is(target error) bool { return target == ErrMayStillLand }

// MaxReasonBytes bounds the reason of a compensation, which the
// compensation's requested event carries (its Detail).
const MaxReasonBytes = 1024

// AutomaticUser is who the reconciler asks for a compensation as, when a
// policy says to undo an outcome nobody could establish (undo_unknown).
// The executor does not run such a compensation of a call found, or
// settled, succeeded meanwhile: the success stands.
const AutomaticUser = "ledger-reconciler"

// ReasonRequested is the reason of the park of a call whose compensation
// the reconciler asks for (AutomaticUser): its outcome could not be
// established, and a policy says to undo such calls.
const ReasonRequested = "compensation_requested"

// ReasonLookupPending is the reason of the park of a call whose status
// lookups went unanswered for long, the tool answering that the call is
// still in progress: it may still take effect.
const ReasonLookupPending = "status_lookup_pending"

// ErrOutcomeInProgress: the call's tool answered its status lookup that
// the call is still in progress (its note of unanswered lookups says so,
// or it was parked for it): an undo sent now could come first, undo
// nothing, and have the call recorded compensated while its effect then
// lands. Not terminal: it passes once the tool settles the call.
var ErrOutcomeInProgress = errors.New("compensation: the tool answered that the call is still in progress")

// inProgress reports whether rec's tool answered that the call is still
// in progress: its outcome unknown with a note that says so, or parked
// for it (ReasonLookupPending). An operator's request to undo such a call
// is refused (ErrOutcomeInProgress) while none exists. (One asked for
// before the answer still runs: held at its executor until the call
// settles, it would wait for good on a note that stays, while the
// reconciler waits for it to settle the call.)
func inProgress(rec processors.Record) bool {
	switch rec.Status {
	case processors.StatusOutcomeUnknown:
		note, ok := rec.UnansweredAt()
		return ok && note.InProgress
	case processors.StatusParked:
		return parkedFor(rec, ReasonLookupPending)
	}
	return false
}

// UndoPending reports whether rec is parked for its compensation
// (ReasonRequested): the last event of its outbox is that park.
func UndoPending(rec processors.Record) bool { return parkedFor(rec, ReasonRequested) }

// parkedFor reports whether rec is parked for reason: the last event of
// its outbox is that park.
func parkedFor(rec processors.Record, reason string) bool {
	if rec.Status != processors.StatusParked {
		return false
	}
	evs, err := ledger.DecodeEvents(rec.Outbox)
	if err != nil || len(evs) == 0 {
		return false
	}
	last := evs[len(evs)-1]
	return last.Type == statemachine.EventParked && last.Reason == reason
}

// AutomaticUndoes reports whether the reconciler's compensation undoes
// the call rec, should it run now: only a call whose outcome is still
// unknown (outcome_unknown, or parked for that compensation). Not one
// settled since, nor one another reconciler handed to a human (parked
// again, compensation_abandoned), who was told that no compensation was
// requested and may undo it by hand: that compensation ends
// nothing_to_undo.
func AutomaticUndoes(rec processors.Record) bool {
	return rec.Status == processors.StatusOutcomeUnknown || UndoPending(rec)
}

// terminalError is an error that asking again will not change.
type terminalError string

func (e terminalError) Error() string { return string(e) }

// Terminal reports that asking again will not change the answer.
func (e terminalError) Terminal() bool { return true }

// Store is the part of the execution store the service uses.
type Store interface {
	Get(ctx context.Context, key ledger.CallKey) (processors.Record, error)
	MarkLogged(ctx context.Context, ls []processors.Logged) error
}

// Submitter runs a call the ledger makes itself through the intake's
// checks (processors/intake.Processor.Submit).
type Submitter interface {
	Submit(ctx context.Context, env *ledger.Envelope, id identity.Identity, carries *schemas.Tool, why string) ([]ledger.Event, error)
}

// Publisher appends events.
type Publisher interface {
	Publish(ctx context.Context, recs ...*kgo.Record) error
}

// Verifier verifies operators' assertions for the HTTP API.
type Verifier interface {
	Verify(ctx context.Context, assertion string) (identity.Identity, error)
}

// Config configures the service.
type Config struct {
	Store     Store             // required
	Registry  *schemas.Registry // required
	Intake    Submitter         // required
	Publisher Publisher         // required
	Identity  Verifier          // required for Handler
	Topics    ledger.Topics
	// OperatorRole may ask for compensations; default "operator".
	OperatorRole string
	Logger       *slog.Logger
	// Landing, if set, is how long after a call of tool went
	// outcome_unknown its last attempt may still reach the tool
	// (executor.Landing): an operator's undo of such a call is refused
	// until then (ErrMayStillLand), as the reconciler waits for its own.
	Landing func(tool *schemas.Tool) time.Duration
	// Now is the clock; default time.Now.
	Now func() time.Time
}

// Service asks for compensations.
type Service struct{ cfg Config }

// New validates cfg and returns the service.
func New(cfg Config) (*Service, error) {
	if cfg.Store == nil || cfg.Registry == nil || cfg.Intake == nil || cfg.Publisher == nil {
		return nil, errors.New("compensation: store, registry, intake and publisher are required")
	}
	cfg.Topics = cfg.Topics.WithDefaults()
	if cfg.OperatorRole == "" {
		cfg.OperatorRole = "operator"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Service{cfg: cfg}, nil
}

// landed returns when the last attempt of rec, a call of tool, can no
// longer reach the tool, if that is still to come and operator's undo
// must wait for it: rec's outcome is unknown (parked included) and the
// operator is not the reconciler, which waits for it itself. The zero
// time otherwise.
func (s *Service) landed(operator identity.Identity, rec processors.Record, tool *schemas.Tool) time.Time {
	if s.cfg.Landing == nil || operator.User == AutomaticUser ||
		rec.Status != processors.StatusOutcomeUnknown && rec.Status != processors.StatusParked {
		return time.Time{}
	}
	if until := rec.UpdatedAt.Add(s.cfg.Landing(tool)); s.cfg.Now().Before(until) {
		return until
	}
	return time.Time{}
}

// Compensate asks to undo the call key, as operator, and returns the key
// of the compensation call and the events it started with (a refusal, if
// the intake's checks or the policies refuse it; none, if it was asked for
// before and the log has it).
func (s *Service) Compensate(ctx context.Context, operator identity.Identity, key ledger.CallKey, reason string) (ledger.CallKey, []ledger.Event, error) {
	if !slices.Contains(operator.Roles, s.cfg.OperatorRole) || (operator.Tenant != key.TenantID && operator.Tenant != "*") {
		return ledger.CallKey{}, nil, ErrForbidden
	}
	if strings.TrimSpace(reason) == "" {
		return ledger.CallKey{}, nil, fmt.Errorf("%w: a reason is required", ErrInvalidReason)
	}
	if len(reason) > MaxReasonBytes {
		// It goes on the compensation's requested event.
		return ledger.CallKey{}, nil, fmt.Errorf("%w: %d bytes, more than %d", ErrInvalidReason, len(reason), MaxReasonBytes)
	}
	rec, err := s.cfg.Store.Get(ctx, key)
	if err != nil {
		return ledger.CallKey{}, nil, err
	}
	// The reconciler's first: a call settled since its sweep listed it
	// (resolved failed or succeeded, compensated), or handed to a human
	// since (another reconciler gave its compensation up: parked again,
	// compensation_abandoned), is no refusal.
	if operator.User == AutomaticUser && !UndoPending(rec) {
		return ledger.CallKey{}, nil, fmt.Errorf("%w (it is %s)", ErrSettled, rec.Status)
	}
	if rec.Status != processors.StatusSucceeded && rec.Status != processors.StatusOutcomeUnknown && rec.Status != processors.StatusParked {
		return ledger.CallKey{}, nil, fmt.Errorf("%w (it is %s)", ErrNotCompensable, rec.Status)
	}
	tool, err := rec.ToolIn(s.cfg.Registry)
	if err != nil {
		return ledger.CallKey{}, nil, err
	}
	if tool.Compensation == nil {
		return ledger.CallKey{}, nil, ErrNoCompensation
	}
	if until := s.landed(operator, rec, tool); !until.IsZero() {
		return ledger.CallKey{}, nil, &LandingError{Until: until}
	}
	comp := tool.Compensation
	ck := key.CompensationKey()
	prev, err := s.cfg.Store.Get(ctx, ck)
	if err != nil && !errors.Is(err, processors.ErrNotFound) {
		// Unread, its compensation may have ended without undoing the
		// call: asked again, it would be taken for a retry and answered
		// as under way.
		return ledger.CallKey{}, nil, fmt.Errorf("compensation: read %s: %w", ck, err)
	}
	if errors.Is(err, processors.ErrNotFound) && operator.User != AutomaticUser && inProgress(rec) {
		// None asked for yet (one that was says how it goes, below).
		// (The reconciler asks for no undo of such a call.)
		return ledger.CallKey{}, nil, fmt.Errorf("%w: an undo sent now could come first and undo nothing, and the call would be recorded compensated while its effect then lands; ask again once the tool has settled it, or resolve it (ledger calls resolve %s) once you know what it did", ErrOutcomeInProgress, key.IdempotencyKey)
	}
	if err == nil && !prev.Status.Done() && !AutomaticUndoes(rec) && operator.User != AutomaticUser {
		// This request would be the retry of the reconciler's (one key
		// per call), which will not undo the call (settled succeeded,
		// or handed to a human since it was asked for): say what
		// becomes of it now, rather than answer as if the undo were
		// under way.
		if automatic, _ := Automatic(prev); automatic {
			if Running(prev) {
				return ck, nil, fmt.Errorf("%w: %s is running, and may undo the call: ask again once it has ended (ledger trace %s)", ErrAutomaticCompensationPending, ck, ck.IdempotencyKey)
			}
			// Not started (or given back): it ends nothing_to_undo,
			// its key spent.
			return ck, nil, fmt.Errorf("%w: %s will end without running (nothing_to_undo), and the call must then be undone by hand", ErrAutomaticCompensationPending, ck)
		}
	}
	if err == nil && prev.Status.Done() && prev.Status != processors.StatusSucceeded {
		// The one compensation of this call ended without undoing it
		// (or with what it did unknown): asking again would find its
		// key used and run nothing.
		if prev.Status == processors.StatusOutcomeUnknown || prev.Status == processors.StatusParked {
			// It may have undone the call: a human undoing it by hand
			// could undo it twice. Its own outcome is what to settle.
			return ck, nil, fmt.Errorf("%w: its compensation %s is %s: settle the compensation first (ledger calls resolve %s), and do not undo the call by hand meanwhile", ErrCompensationUnsettled, ck, prev.Status, ck.IdempotencyKey)
		}
		return ck, nil, fmt.Errorf("%w: its compensation %s ended %s; a human must undo it", ErrCompensationFailed, ck, prev.Status)
	}
	// The undo is made of the call's arguments: changed in the store
	// since they were admitted, they would undo something else (another
	// order cancelled), under a hash of their own that every later check
	// passes. Checked once no compensation of the call answers for it:
	// one asked for before says how it goes.
	if err := processors.VerifyArguments(rec); err != nil {
		return ledger.CallKey{}, nil, fmt.Errorf("%w (%v)", ErrArgumentsChanged, err)
	}
	// Nor may arguments and hash have been rewritten together: they
	// would agree, and not with the hash the call's events name, which
	// its policies decided and its tool ran on (as the executor checks).
	if evs, err := ledger.DecodeEvents(rec.Outbox); err == nil && len(evs) > 0 {
		if h := evs[len(evs)-1].ArgumentsHash; h != "" && h != rec.ArgumentsHash {
			return ledger.CallKey{}, nil, fmt.Errorf("%w (the record's arguments hash %s is not the call's %s)", ErrArgumentsChanged, rec.ArgumentsHash, h)
		}
	}
	args, err := ledger.Decode(rec.Arguments, ledger.Limits{})
	if err != nil {
		return ledger.CallKey{}, nil, err
	}
	hash, err := ledger.ArgumentsHash(key.TenantID, comp.Tool, comp.Version, args)
	if err != nil {
		return ledger.CallKey{}, nil, err
	}
	env := &ledger.Envelope{
		Tool: comp.Tool, ToolVersion: comp.Version, CallID: "comp_" + rec.CallID,
		Scope:          ledger.Scope{TenantID: key.TenantID, UserID: operator.User},
		IdempotencyKey: ck.IdempotencyKey, ArgumentsHash: hash, Arguments: args,
	}
	// The operator asks; the ledger's compensation acts for them.
	who := identity.Identity{User: operator.User, Agent: "ledger-compensation", Tenant: key.TenantID, Roles: operator.Roles}
	// The arguments are the undone call's: the audit copy also hides what
	// its tool's registry entry redacts and the policies in force mask
	// for it (those in force when it was decided may have masked more:
	// its requested event shows what they hid).
	evs, err := s.cfg.Intake.Submit(ctx, env, who, tool, "asked for by "+operator.User+": "+reason)
	if err != nil {
		return ledger.CallKey{}, nil, err
	}
	s.cfg.Logger.Info("compensation requested", "call_key", key.String(), "compensation_key", ck.String(), "operator", operator.User, "reason", reason)
	if err := s.publish(ctx, ck, evs); err != nil {
		s.cfg.Logger.Warn("publish compensation; the sweep will append it", "compensation_key", ck.String(), "err", err)
	}
	return ck, evs, nil
}

// Automatic reports whether comp, a compensation's record, is one the
// reconciler asked for (its events' user is AutomaticUser); known says
// whether its events could be read to tell (a newer build's cannot).
func Automatic(comp processors.Record) (automatic, known bool) {
	evs, err := ledger.DecodeEvents(comp.Outbox)
	if err != nil || len(evs) == 0 {
		return false, false
	}
	return evs[0].UserID == AutomaticUser, true
}

// Running reports whether an executor holds comp, a compensation's
// record, and may be sending it: having found the call undoable before
// it was settled, it may yet undo it.
func Running(comp processors.Record) bool {
	return comp.Status == processors.StatusExecuting && comp.LeaseOwner != ""
}

func (s *Service) publish(ctx context.Context, ck ledger.CallKey, evs []ledger.Event) error {
	if len(evs) == 0 {
		return nil
	}
	recs := make([]*kgo.Record, len(evs))
	var last int64
	for i := range evs {
		r, err := evs[i].Record(s.cfg.Topics.Events)
		if err != nil {
			return err
		}
		recs[i] = r
		last = max(last, evs[i].Seq)
	}
	if err := s.cfg.Publisher.Publish(ctx, recs...); err != nil {
		return err
	}
	if last == 0 {
		return nil
	}
	return s.cfg.Store.MarkLogged(ctx, []processors.Logged{{Key: ck, Seq: last}})
}

// Request is the body of POST /v1/compensations.
type Request struct {
	TenantID       string `json:"tenant_id"`
	IdempotencyKey string `json:"idempotency_key"`
	Reason         string `json:"reason"`
}

// Handler serves POST /v1/compensations for operators (Authorization:
// Bearer <operator assertion>); without Config.Identity it serves nothing.
func (s *Service) Handler() http.Handler {
	mux := http.NewServeMux()
	if s.cfg.Identity == nil {
		// Nobody can be verified: the API is not served.
		return httpjson.Unmatched(mux)
	}
	mux.HandleFunc("POST /v1/compensations", identity.Require(s.cfg.Identity, "ledger-compensations", "an operator", s.cfg.Logger, func(w http.ResponseWriter, r *http.Request, op identity.Identity) {
		if op.User == AutomaticUser {
			// The reconciler's own name, which it asks in-process: a
			// staff assertion naming it would skip the wait for the
			// call's last attempt, and make its undo pass for the
			// reconciler's (compensation.Automatic).
			writeError(w, http.StatusForbidden, "forbidden", "the user "+AutomaticUser+" is reserved for the ledger's reconciler: an assertion naming it cannot ask for compensations")
			return
		}
		var body Request
		if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&body); err != nil {
			writeError(w, http.StatusBadRequest, "invalid_request", "the body is not a compensation request")
			return
		}
		ck, evs, err := s.Compensate(r.Context(), op, ledger.CallKey{TenantID: body.TenantID, IdempotencyKey: body.IdempotencyKey}, body.Reason)
		switch {
		case errors.Is(err, ErrForbidden):
			writeError(w, http.StatusForbidden, "forbidden", err.Error())
		case errors.Is(err, processors.ErrNotFound):
			writeError(w, http.StatusNotFound, "not_found", "no call under this key for this tenant")
		case errors.Is(err, ErrCompensationUnsettled):
			// Its own code: not_compensable's and compensation_failed's
			// cases are undone by hand, which this one must not be yet.
			writeError(w, http.StatusConflict, "compensation_outcome_unknown", err.Error())
		case errors.Is(err, ErrCompensationFailed):
			writeError(w, http.StatusConflict, "compensation_failed", err.Error())
		case errors.Is(err, ErrNotCompensable), errors.Is(err, ErrNoCompensation), errors.Is(err, ErrSettled):
			writeError(w, http.StatusConflict, "not_compensable", err.Error())
		case errors.Is(err, ErrAutomaticCompensationPending):
			writeError(w, http.StatusConflict, "automatic_compensation_pending", err.Error())
		case errors.Is(err, ErrArgumentsChanged):
			s.cfg.Logger.Error("compensation refused: the call's stored arguments do not match their hash", "call_key", body.TenantID+"/"+body.IdempotencyKey, "err", err)
			writeError(w, http.StatusConflict, "arguments_integrity", err.Error())
		case errors.Is(err, ErrInvalidReason):
			writeError(w, http.StatusBadRequest, "invalid_request", err.Error())
		case errors.Is(err, schemas.ErrOtherDefinition):
			// This service's registry defines the call's tool version
			// otherwise than the intake that admitted it: its declared
			// compensation may not be the call's.
			writeError(w, http.StatusConflict, "tool_defined_otherwise", err.Error())
		case errors.Is(err, schemas.ErrUnknownTool), errors.Is(err, schemas.ErrUnknownVersion):
			writeError(w, http.StatusConflict, "unknown_tool", "the call's tool version is not in this service's registry: "+err.Error())
		case errors.Is(err, ErrMayStillLand):
			SetRetryAfter(w, err)
			writeError(w, http.StatusConflict, "outcome_may_still_land", err.Error())
		case errors.Is(err, ErrOutcomeInProgress):
			writeError(w, http.StatusConflict, "outcome_in_progress", err.Error())
		case err != nil:
			s.cfg.Logger.Error("compensation request failed", "err", err)
			writeError(w, http.StatusInternalServerError, "internal", "the compensation could not be requested; try again")
		default:
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(map[string]any{"compensation_key": ck.String(), "events": evs})
		}
	}))
	return httpjson.Unmatched(mux)
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]map[string]string{"error": {"code": code, "message": msg}})
}
