package executor

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/compensation"
	"github.com/toolcall-ledger/ledger/processors/identity"
)

// Publisher appends events outside a transactional loop.
type Publisher interface {
	Publish(ctx context.Context, recs ...*kgo.Record) error
}

// ResolveRequest is the body of POST /v1/resolutions.
type ResolveRequest struct {
	TenantID       string `json:"tenant_id"`
	IdempotencyKey string `json:"idempotency_key"`
	// As is "succeeded" or "failed".
	As string `json:"as"`
	// Evidence says how the operator found out.
	Evidence string `json:"evidence"`
	// CancelCompensation confirms a resolution as succeeded while the
	// reconciler's compensation of the call is pending (see Resolution).
	CancelCompensation bool `json:"cancel_compensation,omitempty"`
}

// ResolveHandler serves POST /v1/resolutions: an operator (an assertion
// verified by v, with the operator role, of the call's tenant or "*")
// settles an unknown outcome by hand. The resolution is recorded in the
// store first, then published; a failed publish is appended later by the
// executor's sweep.
func (r *Reconciler) ResolveHandler(v identity.AssertionVerifier, p Publisher) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/resolutions", identity.Require(v, "ledger-resolutions", "an operator", r.cfg.Logger, func(w http.ResponseWriter, req *http.Request, op identity.Identity) {
		var body ResolveRequest
		if err := json.NewDecoder(io.LimitReader(req.Body, 64<<10)).Decode(&body); err != nil {
			resolveError(w, http.StatusBadRequest, "invalid_request", "the body is not a resolution")
			return
		}
		key := ledger.CallKey{TenantID: body.TenantID, IdempotencyKey: body.IdempotencyKey}
		ms, err := r.resolve(req.Context(), op, key, Resolution{As: processors.Status(body.As), Evidence: body.Evidence, CancelCompensation: body.CancelCompensation})
		var (
			evs    []ledger.Event
			logged []processors.Logged
		)
		for _, m := range ms {
			evs = append(evs, m.evs...)
			logged = append(logged, m.logged())
		}
		switch {
		case errors.Is(err, errUndoCancelled) && lostRace(err):
			// First: the resolution lost a race after it cancelled the
			// compensation, which the operator must learn with its
			// code, whatever settled or changed the call.
			resolveError(w, http.StatusConflict, "compensation_cancelled", err.Error())
			return
		case errors.Is(err, processors.ErrMoveUnknown):
			// Before the cancelled compensation's own answer, which
			// says the call was not resolved.
			r.cfg.Logger.Error("a resolution's write failed, and whether it applied could not be read", "call_key", key.String(), "err", err)
			msg := "the execution store failed as the resolution was written, and could not say whether it was: it may have been taken; read the call (ledger trace) before resolving it again"
			if errors.Is(err, errUndoCancelled) {
				msg += "; its automatic compensation was cancelled (" + ReasonCompensationCancelled + "), and the ledger runs no other: undo it by hand if it must be"
			}
			resolveError(w, http.StatusServiceUnavailable, httpjson.CodeActionOutcomeUnknown, msg)
			return
		case errors.Is(err, ErrForbidden):
			resolveError(w, http.StatusForbidden, "forbidden", err.Error())
			return
		case errors.Is(err, processors.ErrNotFound):
			resolveError(w, http.StatusNotFound, "not_found", "no call under this key for this tenant")
			return
		case errors.Is(err, ErrUndoUnderWay):
			resolveError(w, http.StatusConflict, "compensation_under_way", err.Error())
			return
		case errors.Is(err, ErrAutomaticUndoPending):
			resolveError(w, http.StatusConflict, "automatic_compensation_pending", err.Error())
			return
		case errors.Is(err, compensation.ErrMayStillLand):
			compensation.SetRetryAfter(w, err)
			msg := "the call's last attempt may still reach the tool: resolved failed now, it would be recorded as having had no effect while it may still have one"
			if le, ok := errors.AsType[*compensation.LandingError](err); ok {
				msg += "; ask again from " + le.Until.UTC().Format(time.RFC3339)
			}
			resolveError(w, http.StatusConflict, "outcome_may_still_land", msg)
			return
		case errors.Is(err, ErrNotUnknown):
			resolveError(w, http.StatusConflict, "not_unknown", err.Error())
			return
		case errors.Is(err, ErrCallChanged):
			resolveError(w, http.StatusConflict, "call_changed", err.Error())
			return
		case errors.Is(err, ErrInvalidResolution):
			resolveError(w, http.StatusBadRequest, "invalid_request", err.Error())
			return
		case errors.Is(err, ErrNoContext):
			r.cfg.Logger.Error("resolution of a call whose record cannot be read", "call_key", key.String(), "err", err)
			resolveError(w, http.StatusInternalServerError, "record_unreadable", "the call's record cannot be read by this build")
			return
		case errors.Is(err, errUndoCancelled):
			// The store failed after the compensation was cancelled:
			// the operator must know it will not run.
			r.cfg.Logger.Warn("resolution failed after it cancelled the call's compensation", "call_key", key.String(), "err", err)
			resolveError(w, http.StatusServiceUnavailable, "compensation_cancelled",
				"the execution store is unavailable and the call was not resolved, but its automatic compensation was cancelled ("+ReasonCompensationCancelled+"): the ledger runs no other; resolve the call again, and undo it by hand if it must be")
			return
		case err != nil:
			// The store's: not the request's fault, and its text is
			// the server's business.
			r.cfg.Logger.Warn("resolution failed", "call_key", key.String(), "err", err)
			resolveError(w, http.StatusServiceUnavailable, "unavailable", "the execution store is unavailable; try again")
			return
		}
		recs := make([]*kgo.Record, 0, len(evs))
		for _, ev := range evs {
			rec, rerr := ev.Record(r.cfg.Topics.Events)
			if rerr != nil {
				err = rerr
				break
			}
			recs = append(recs, rec)
		}
		if err == nil {
			err = p.Publish(req.Context(), recs...)
		}
		last := evs[len(evs)-1]
		if err != nil {
			r.cfg.Logger.Warn("publish resolution; the sweep will append it", "call_key", key.String(), "err", err)
		} else if err := r.cfg.Store.MarkLogged(req.Context(), logged); err != nil {
			r.cfg.Logger.Warn("mark resolution logged", "call_key", key.String(), "err", err)
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(last)
	}))
	return httpjson.Unmatched(mux)
}

// lostRace reports whether err is a resolution's move that did not apply
// (lostResolution), whose text is the ledger's own and may be shown,
// rather than the store's failure.
func lostRace(err error) bool {
	return errors.Is(err, ErrNotUnknown) || errors.Is(err, ErrCallChanged) || errors.Is(err, ErrUndoUnderWay)
}

func resolveError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]map[string]string{"error": {"code": code, "message": msg}})
}
