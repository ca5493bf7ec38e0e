// Package httpapi is the ledger's HTTP API: agents submit envelopes and ask
// where their calls are. It reads from the call index and the execution
// store's results, and writes only to the request topic, like any agent.
package httpapi

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Publisher puts a raw envelope on the request topic under key.
// Implementations are safe for concurrent use and return once the broker
// acknowledged the record.
type Publisher interface {
	Publish(ctx context.Context, key, value []byte) error
}

// Calls answers what is known of a call: callindex.ErrNotFound when
// nothing is.
type Calls interface {
	Call(ctx context.Context, key ledger.CallKey) (callindex.Call, error)
}

// UserCalls is Calls that also reads a key with the refusals of one user
// alone: a store that keeps at most projections.MaxRefusals of a key's
// refusals then keeps that many of the user's. With a Caller, an agent's
// lookups and waits read through it when Calls is one, so that another
// user of the tenant, flooding the key with refused envelopes, cannot
// push the agent's own refusal out of its view or its wait. Through Call
// alone, the refusals are cut across all users first.
type UserCalls interface {
	UserCall(ctx context.Context, key ledger.CallKey, user string) (callindex.Call, error)
}

// Result is the sanitized result that the execution store holds under a
// key, with what names the call it belongs to.
type Result struct {
	CallID, ArgumentsHash string
	Body                  json.RawMessage // nil: none (yet)
}

// Results returns the Result held under key: the zero Result if there is
// no record.
type Results interface {
	Result(ctx context.Context, key ledger.CallKey) (Result, error)
}

// ResultTimeout bounds each read of Results, so that a store that does
// not answer withholds results (ResultUnavailable) rather than holding
// the agents' lookups.
const ResultTimeout = 5 * time.Second

// Agent is the verified caller of an agents' request: the tenant and
// the user of its identity assertion.
type Agent struct{ Tenant, User string }

// Check is a named readiness check for /healthz.
type Check struct {
	Name  string
	Check func(ctx context.Context) error
	// Degrades: failing, the check says so ("degraded") without taking
	// the API out of service (200): what it checks serves only some of
	// the API (ClickHouse: lookups and questions), and the rest (the
	// agents' submissions, the approvals, the kill switch) must stay up.
	Degrades bool
}

// Config configures the API.
type Config struct {
	Publisher Publisher // required
	// Calls, optional, answers GET /v1/calls/{key} and ?wait= on POST.
	// Without it neither is served.
	Calls Calls
	// Caller, when set, authenticates the agents: it returns the
	// request's verified caller (an agent's identity assertion as a
	// bearer token), and an error refuses the request (401).
	//   - GET /v1/calls/{key} reads the caller's tenant's calls alone; a
	//     tenant_id, if given, must be that one (another's call is not
	//     found).
	//   - POST ?wait= needs a caller of the envelope's tenant (the
	//     envelope's own assertion is verified by the intake, later):
	//     without one, or of another tenant, it is refused (401, 403)
	//     before anything is published, and the wait reads that tenant's
	//     call alone.
	//   - A call is the user's who made it (the user_id of its requested
	//     event, which the intake took from the verified assertion): to
	//     another user of the tenant it is not found, and the view shows
	//     that user's own refusals under the key alone (see forAgent).
	// Nil: the tenant is tenant_id's (or the envelope's), unchecked, and
	// results are served to whoever asks (ledger dev, on loopback).
	Caller func(r *http.Request) (Agent, error)
	// Assertion, with a Caller, verifies an envelope's own identity
	// assertion as the intake will, returning its agent, or an error
	// whose text is the refusal's reason. A submission whose assertion
	// the intake would refuse (expired, say: an envelope sent again
	// later) is answered 400 assertion_<reason> and not published: the
	// intake's refusal goes under its reserved tenant, where the bearer's
	// ?wait= cannot see it, and only ran out. Nil: not checked here.
	Assertion func(ctx context.Context, assertion string) (Agent, error)
	// MaxLookupsPerTenant and MaxLookups bound the agents' lookups
	// running at once with a Caller (each a query of the store behind
	// Calls, and a read of Results), of one tenant and in all: one more
	// GET /v1/calls/{key} is answered 429 too_many_lookups, Retry-After
	// 1, and a ?wait= looks again later. Defaults:
	// DefaultMaxLookupsPerTenant, DefaultMaxLookups.
	MaxLookupsPerTenant, MaxLookups int
	// Results, optional, serves the results of calls that ran a tool
	// (succeeded, failed, compensated); without it their views say
	// result_withheld not_served.
	Results Results
	Checks  []Check
	// Limits on envelopes; as the intake's.
	Limits ledger.Limits
	// MaxWait bounds ?wait= on POST /v1/calls; default 30s.
	MaxWait time.Duration
	// MaxWaitsPerTenant and MaxWaits bound the submissions waiting
	// (?wait=) at once, of one tenant and in all: each holds its
	// connection, two goroutines and their buffers for up to MaxWait,
	// and the submission budget bounds their rate, not their number
	// (an agent sending a call that waits for approval again and again
	// with ?wait= held 500 a second for 30 s). One more is published and
	// answered 202 at once, without waiting, its body's wait_skipped
	// saying why: its status_url, a lookup, is bounded. Defaults:
	// DefaultMaxWaitsPerTenant, DefaultMaxWaits.
	MaxWaitsPerTenant, MaxWaits int
	// WriteTimeout bounds the writing of an agent's answer (a call's
	// view, megabytes for a call of many long events, in memory until
	// written): an agent that asks and does not read holds its
	// connection, a goroutine and that memory no longer than this. It
	// runs from when the answer is ready, so that a ?wait= is not cut.
	// Default: DefaultAnswerWriteTimeout.
	WriteTimeout time.Duration
	// PublishTimeout bounds a submission's publish, answered 503
	// publish_failed when it runs out; default DefaultPublishTimeout.
	PublishTimeout time.Duration
	// SubmitRate and SubmitBurst bound each tenant's submissions
	// through this process: SubmitRate a second, in bursts of up to
	// SubmitBurst. One more is answered 429 too_many_submissions with
	// Retry-After, and nothing of it is published. With a Caller the
	// tenant is the bearer's, and the bound is checked before the body
	// is read; without one, the envelope's. Defaults: DefaultSubmitRate,
	// and two seconds of SubmitRate; a negative SubmitRate: no bound.
	SubmitRate  float64
	SubmitBurst int
	Logger      *slog.Logger
}

// Defaults of Config's bounds on the agents' lookups.
const (
	DefaultMaxLookupsPerTenant = 8
	DefaultMaxLookups          = 64
)

// Defaults of Config's bounds on the submissions waiting: a waiting
// submission costs some 30 KiB, so the bound in all is some 30 MiB. A
// wait looks its call up every 200 ms at most, each look one of its
// tenant's lookups (DefaultMaxLookupsPerTenant): a tenant's 32 waits
// leave room for the lookups of those that did not wait.
const (
	DefaultMaxWaitsPerTenant = 32
	DefaultMaxWaits          = 1024
)

// Server is the HTTP API.
type Server struct {
	cfg     Config
	mux     *http.ServeMux
	handler http.Handler  // mux, its unmatched requests answered in JSON
	lookups *limiter      // with a Caller, the agents' lookups running
	waits   *limiter      // the submissions waiting (?wait=)
	submits *submitBudget // each tenant's submissions; nil: unbounded
	// waitsEndedCtx is cancelled by EndWaits.
	waitsEndedCtx context.Context
	endWaits      context.CancelFunc
	// healthRun runs the checks for every /healthz asked meanwhile, and
	// healthLast is their last answer, served for healthFresh: anyone
	// may ask /healthz, and each ask pinged ClickHouse (from the
	// lookups' pool) and Kafka, and logged every failed check.
	healthRun  singleflight.Group
	healthLast atomic.Pointer[healthAnswer]
}

// healthFresh is how long a /healthz answer is served again.
const healthFresh = time.Second

// healthAnswer is a /healthz answer and when its checks ended.
type healthAnswer struct {
	code int
	body map[string]any
	at   time.Time
}

// New returns the API.
func New(cfg Config) (*Server, error) {
	if cfg.Publisher == nil {
		return nil, errors.New("httpapi: a publisher is required")
	}
	cfg.Limits = cfg.Limits.WithDefaults()
	if cfg.PublishTimeout <= 0 {
		cfg.PublishTimeout = DefaultPublishTimeout
	}
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = 30 * time.Second
	}
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = DefaultAnswerWriteTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxLookupsPerTenant <= 0 {
		cfg.MaxLookupsPerTenant = DefaultMaxLookupsPerTenant
	}
	if cfg.MaxLookups <= 0 {
		cfg.MaxLookups = DefaultMaxLookups
	}
	if cfg.MaxWaitsPerTenant <= 0 {
		cfg.MaxWaitsPerTenant = DefaultMaxWaitsPerTenant
	}
	if cfg.MaxWaits <= 0 {
		cfg.MaxWaits = DefaultMaxWaits
	}
	if cfg.SubmitRate == 0 {
		cfg.SubmitRate = DefaultSubmitRate
	}
	if cfg.SubmitBurst <= 0 {
		cfg.SubmitBurst = max(1, int(math.Ceil(2*cfg.SubmitRate)))
	}
	s := &Server{cfg: cfg, mux: http.NewServeMux(), lookups: newLimiter(cfg.MaxLookupsPerTenant, cfg.MaxLookups, "lookups", "too_many_lookups"),
		waits: newLimiter(cfg.MaxWaitsPerTenant, cfg.MaxWaits, "submissions waiting", "too_many_waits")}
	s.submits = newSubmitBudget(cfg.SubmitRate, cfg.SubmitBurst, time.Now)
	s.waitsEndedCtx, s.endWaits = context.WithCancel(context.Background())
	s.mux.HandleFunc("POST /v1/calls", s.submit)
	if cfg.Calls != nil {
		s.mux.HandleFunc("GET /v1/calls/{key}", s.get)
	}
	s.mux.HandleFunc("GET /healthz", s.health)
	s.handler = httpjson.Unmatched(s.mux)
	return s, nil
}

// ServeHTTP serves the API.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// EndWaits ends the waits of POST /v1/calls?wait= in progress, and those
// to come, each answered as a wait that ran out (202 with the status
// URL). It is for http.Server.RegisterOnShutdown: a server stopping
// would otherwise outwait them (up to MaxWait), or cut them. Safe to call
// more than once.
func (s *Server) EndWaits() { s.endWaits() }

// apiError is the one error shape the API answers with.
type apiError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	Pointer string `json:"pointer,omitempty"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	noStore(w)
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// noStore marks an answer for no cache to keep: its tenant is the
// bearer's, which its URL does not name, so a shared cache keyed by the
// URL would serve one tenant's calls to another.
func noStore(w http.ResponseWriter) {
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Add("Vary", "Authorization")
}

func writeError(w http.ResponseWriter, status int, e apiError) {
	writeJSON(w, status, map[string]apiError{"error": e})
}

// CallView is the answer of GET /v1/calls/{key}, and of POST
// /v1/calls?wait= once it has one.
type CallView struct {
	TenantID       string         `json:"tenant_id"`
	IdempotencyKey string         `json:"idempotency_key"`
	State          string         `json:"state"`
	Settled        bool           `json:"settled"`
	Events         []ledger.Event `json:"events"`
	Refusals       []ledger.Event `json:"refusals,omitempty"`
	// Result is the call's sanitized result, for the user who made the
	// call alone (with a Caller); see ResultWithheld.
	Result json.RawMessage `json:"result,omitempty"`
	// ResultWithheld, on a call that ran a tool, says why the view has
	// no result: ResultNotServed, ResultUnavailable or ResultGone.
	ResultWithheld string `json:"result_withheld,omitempty"`
	// Refused, on the answer of POST ?wait=, is this submission's
	// refusal, which ended the wait. The rest of the view is then the
	// call under the key, if any: an earlier submission's (another
	// call's, when the key was reused with other arguments), and it
	// carries no result.
	Refused *ledger.Event `json:"refused,omitempty"`
}

// Why a view has no result (CallView.ResultWithheld).
const (
	// ResultNotServed: this API does not read the results (ledger api
	// without the execution store).
	ResultNotServed = "not_served"
	// ResultUnavailable: the results could not be read just now; ask
	// again.
	ResultUnavailable = "unavailable"
	// ResultGone: the execution store no longer holds this call's
	// record (removed after its retention, or the key reused since).
	ResultGone = "gone"
)

// submit accepts an envelope. It checks the envelope as the intake will,
// so that a caller learns of a malformed one at once (400, nothing
// published), then publishes the bytes unchanged. With ?wait=DURATION it
// answers once the call settled or this submission was refused (the
// refusal in refused), or with 202 when the wait ran out. With a Caller,
// a submission without a bearer of the envelope's tenant (and, to wait,
// of its user) is refused, 401 or 403, before anything is published:
// the request topic, which Kafka's ACLs guard, is not open to whoever
// reaches the API. Each tenant's submissions are bounded (submitBudget).
func (s *Server) submit(w http.ResponseWriter, r *http.Request) {
	var agent *Agent
	if s.cfg.Caller != nil {
		// Before the body is read: an anonymous request, or one of a
		// tenant past its budget, costs no read or decoding of up to
		// Limits.MaxBytes.
		a, ok := s.authenticate(w, r)
		if !ok || !s.admit(w, a.Tenant) {
			return
		}
		agent = &a
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, int64(s.cfg.Limits.MaxBytes)+1))
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge) || err == nil && len(body) > s.cfg.Limits.MaxBytes:
		writeError(w, http.StatusRequestEntityTooLarge, apiError{Code: ledger.CodeTooLarge, Message: fmt.Sprintf("envelope larger than %d bytes", s.cfg.Limits.MaxBytes)})
		return
	case err != nil:
		// A body cut short: nothing was published. One that ran out
		// the server's read timeout (a slow link) may pass sent again,
		// and says so (408, which clients retry); the read error's
		// text, which names this server's address, is logged only.
		s.cfg.Logger.Debug("envelope not read whole", "err", err)
		switch rerr := httpjson.BodyReadError(err); {
		case errors.Is(rerr, httpjson.ErrBodyTimeout):
			writeError(w, http.StatusRequestTimeout, apiError{Code: httpjson.CodeRequestTimeout, Message: rerr.Error() + ": send it again"})
		case rerr != nil:
			writeError(w, http.StatusBadRequest, apiError{Code: "invalid_request", Message: rerr.Error()})
		default:
			writeError(w, http.StatusBadRequest, apiError{Code: "invalid_request", Message: "the envelope could not be read whole: " + err.Error()})
		}
		return
	}
	env, err := ledger.DecodeEnvelope(body, s.cfg.Limits)
	if err != nil {
		var de *ledger.DecodeError
		if errors.As(err, &de) {
			writeError(w, http.StatusBadRequest, apiError{Code: de.Code, Message: de.Error(), Pointer: de.Pointer})
			return
		}
		writeError(w, http.StatusBadRequest, apiError{Code: ledger.CodeInvalidJSON, Message: err.Error()})
		return
	}
	key := env.Key()
	if agent == nil && !s.admit(w, key.TenantID) {
		return
	}
	wait, ok := s.waitParam(w, r)
	if !ok {
		return
	}
	wait = min(wait, s.cfg.MaxWait)
	waiting := wait > 0 && s.cfg.Calls != nil
	// Unverified where nothing verifies it (ledger dev): it only tells
	// this submission's call from another's under the key.
	asserted := assertionSubject(env.Assertion)
	if agent != nil {
		// Refused before publishing, so that the caller may send it
		// again as it likes, with the right bearer or without the wait.
		if agent.Tenant != key.TenantID {
			writeError(w, http.StatusForbidden, apiError{Code: "tenant_mismatch", Pointer: "/scope/tenant_id",
				Message: "the bearer submits the calls of its own tenant alone, and the envelope names another; nothing was published"})
			return
		}
		if s.cfg.Assertion != nil {
			ea, err := s.cfg.Assertion(r.Context(), env.Assertion)
			if cannotVerifyNow(w, err) {
				return
			}
			if err != nil {
				writeError(w, http.StatusBadRequest, apiError{Code: "assertion_" + err.Error(), Pointer: "/assertion",
					Message: "the envelope's identity assertion is refused (" + err.Error() + "), as the intake would refuse it; nothing was published: send the envelope again with a valid one"})
				return
			}
			if ea.Tenant != agent.Tenant {
				writeError(w, http.StatusForbidden, apiError{Code: "tenant_mismatch", Pointer: "/assertion",
					Message: "the envelope's identity assertion is of another tenant than the bearer; nothing was published"})
				return
			}
			// The call is the verified assertion's user's, whatever the
			// scope claims (the intake refuses a scope that disagrees,
			// under that user).
			asserted = ea.User
		}
		if u := cmp.Or(asserted, env.Scope.UserID); waiting && u != "" && u != agent.User {
			// Its call would be another user's, which the wait
			// cannot see (forAgent): it would only run out.
			writeError(w, http.StatusForbidden, apiError{Code: "user_mismatch", Pointer: "/assertion",
				Message: "?wait= reads the calls of the bearer's user alone, and the envelope is another user's; nothing was published"})
			return
		}
	}
	// skipped, when set, says why a submission that asked to wait does
	// not (too many wait).
	var skipped string
	if waiting {
		end, busy := s.waits.try(key.TenantID)
		if busy != "" {
			waiting, skipped = false, s.waits.code+": "+busy+"; the call was published: follow status_url"
		} else {
			defer end()
		}
	}
	sub := submission{key: key, callID: env.CallID, own: OwnCall(env.ArgumentsHash, env.Scope.UserID, asserted), arrived: time.Now()}
	if waiting {
		// Hashed for a wait alone: the bytes can be 256 KiB.
		sub.digest = ledger.RequestDigest(body)
		sub.earlier = s.refusalsBefore(r.Context(), key, min(wait, refusalsBeforeTimeout), agent)
	}
	pctx, cancel := context.WithTimeout(r.Context(), s.cfg.PublishTimeout)
	err = s.cfg.Publisher.Publish(pctx, []byte(key.String()), body)
	cancel()
	if err != nil {
		s.cfg.Logger.Warn("publish envelope", "call_key", key.String(), "err", err)
		writeError(w, http.StatusServiceUnavailable, apiError{Code: "publish_failed", Message: "the request topic did not acknowledge the envelope (it may yet be published): send it again with the same idempotency key, an identical envelope is the same call"})
		return
	}
	var (
		v        CallView
		answered bool
	)
	if waiting {
		v, answered = s.await(r.Context(), sub, wait, agent)
	}
	writeWithin(w, s.cfg.WriteTimeout)
	if answered {
		writeJSON(w, http.StatusOK, v)
		return
	}
	accepted := map[string]string{
		"tenant_id":       key.TenantID,
		"idempotency_key": key.IdempotencyKey,
		"status_url":      "/v1/calls/" + url.PathEscape(key.IdempotencyKey) + "?tenant_id=" + url.QueryEscape(key.TenantID),
	}
	if skipped != "" {
		accepted["wait_skipped"] = skipped
		w.Header().Set("Retry-After", "1")
	}
	writeJSON(w, http.StatusAccepted, accepted)
}

// waitParam is ?wait=, 0 when absent or empty (no wait); a value that is
// not a duration of 0 or more it answers 400 invalid_wait. Not taken as
// no wait: an agent that sent ?wait=30 meant to wait.
func (s *Server) waitParam(w http.ResponseWriter, r *http.Request) (time.Duration, bool) {
	raw := r.URL.Query().Get("wait")
	if raw == "" {
		return 0, true
	}
	wait, err := time.ParseDuration(raw)
	if err != nil || wait < 0 {
		writeError(w, http.StatusBadRequest, apiError{Code: "invalid_wait",
			Message: fmt.Sprintf("wait must be a duration with its unit, such as 30s (at most %s is waited); nothing was published", s.cfg.MaxWait)})
		return 0, false
	}
	return wait, true
}

// DefaultPublishTimeout is Config.PublishTimeout's default: a producer
// retries a partition without a leader (or short of its in-sync
// replicas) for as long as it is asked to, and the agent is better told
// to send again.
const DefaultPublishTimeout = 15 * time.Second

// assertionSubject is the user an identity assertion names, read without
// verifying it; "" when it names none or is not a token.
func assertionSubject(assertion string) string {
	var claims struct {
		Sub string `json:"sub"`
	}
	if token.Unverified(assertion, &claims) != nil {
		return ""
	}
	return claims.Sub
}

// OwnCallOf tells a submission's own call from the others a key may
// hold: an earlier call under it with other arguments, or another user's
// (a key is the tenant's, and its users may guess each other's). Those
// answer the submission with a refusal (idempotency_key_reused), to
// come; their state and result are not its answer.
type OwnCallOf struct {
	argumentsHash, user string
	refused             bool
}

// OwnCall is the OwnCallOf a submission with the arguments hash given,
// its envelope's scope.user_id and its assertion's user (verified, or
// read unverified by its own sender). An empty one is not known, and
// matches any. Where the scope and the assertion name two users, the
// intake refuses the envelope (scope_mismatch): no call is its own.
func OwnCall(argumentsHash, scopeUser, assertedUser string) OwnCallOf {
	return OwnCallOf{
		argumentsHash: argumentsHash,
		user:          cmp.Or(assertedUser, scopeUser),
		refused:       scopeUser != "" && assertedUser != "" && scopeUser != assertedUser,
	}
}

// Is reports whether the call whose requested event is req is the
// submission's own.
func (o OwnCallOf) Is(req ledger.Event) bool {
	return !o.refused && (o.argumentsHash == "" || req.ArgumentsHash == o.argumentsHash) && (o.user == "" || req.UserID == o.user)
}

// submission is what a wait answers: one envelope's call.
type submission struct {
	key    ledger.CallKey
	callID string
	digest string // of the envelope's bytes, as published (RefusalOf)
	own    OwnCallOf
	// earlier are the refusals under the key before the submission, by
	// event id: a refusal of an earlier submission with the same call id
	// is no answer to this one. Nil when they could not be read; those
	// dated before arrived (less RefusalSkew) are taken as earlier
	// either way.
	earlier map[string]bool
	arrived time.Time
}

// RefusalSkew is how much earlier than a submission's arrival its
// refusal may be dated, by the intake's clock against the API's.
const RefusalSkew = 2 * time.Second

// answeredBy reports whether the refusal ref answers sub: of its call id,
// dated no earlier than its arrival (less RefusalSkew), and not one the
// index showed before it. The date is checked whether or not the index
// could be read before: one that lags may show an earlier submission's
// refusal only once this one is admitted (and run), which, taken for its
// answer, would tell the agent that a call that ran was refused.
func (sub submission) answeredBy(ref ledger.Event) bool {
	if !RefusalOf(ref, sub.callID, sub.digest) || ref.At.Before(sub.arrived.Add(-RefusalSkew)) {
		return false
	}
	return !sub.earlier[ref.EventID]
}

// RefusalOf reports whether the refusal ref may answer the envelope of
// callID published as bytes whose ledger.RequestDigest is digest: of its
// call id, and of those bytes when ref names the copy it refuses (a
// refusal of an older build does not). Another copy of the call (its
// call id sent again with a fresh assertion, say) may be refused while
// this one is admitted and runs: its refusal is no answer to this one.
func RefusalOf(ref ledger.Event, callID, digest string) bool {
	return ref.CallID == callID && (ref.RequestDigest == "" || digest == "" || ref.RequestDigest == digest)
}

// refusalsBeforeTimeout bounds the look before publishing, which delays
// the publishing.
const refusalsBeforeTimeout = 2 * time.Second

// refusalsBefore is the set of the refusals under key before a
// submission (by event id), as submission.earlier. Best effort: a refusal
// the index has not shown yet is not in it; nil when the index could not
// be read within d.
func (s *Server) refusalsBefore(ctx context.Context, key ledger.CallKey, d time.Duration, agent *Agent) map[string]bool {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	c, end, ok := s.lookCall(ctx, key, agent)
	if !ok {
		return nil
	}
	defer end()
	seen := make(map[string]bool, len(c.Refusals))
	for _, r := range c.Refusals {
		seen[r.EventID] = true
	}
	return seen
}

// lookCall reads the call under key, for an agent as one of its
// tenant's lookups (Config.MaxLookupsPerTenant), whose slot end gives
// back; ok is false, and nothing is held, when the bound is full or the
// index does not answer.
func (s *Server) lookCall(ctx context.Context, key ledger.CallKey, agent *Agent) (c callindex.Call, end func(), ok bool) {
	end = func() {}
	if agent != nil {
		var busy string
		if end, busy = s.lookups.try(agent.Tenant); busy != "" {
			return callindex.Call{}, nil, false
		}
	}
	c, err := s.call(ctx, key, agent)
	if err != nil {
		end()
		return callindex.Call{}, nil, false
	}
	return c, end, true
}

// call reads the call under key, with agent's user's refusals alone when
// Calls can cut them so (UserCalls); what agent may see of it is then
// forAgent's.
func (s *Server) call(ctx context.Context, key ledger.CallKey, agent *Agent) (callindex.Call, error) {
	if uc, ok := s.cfg.Calls.(UserCalls); ok && agent != nil && agent.User != "" {
		return uc.UserCall(ctx, key, agent.User)
	}
	return s.cfg.Calls.Call(ctx, key)
}

// await polls the index until the call settles or sub was refused, for
// at most d or until EndWaits. A call settled under the key with other
// arguments is an earlier one, not sub's answer (which is a refusal), and
// so is an earlier refusal. For an agent, each look is one of its
// tenant's lookups: with them all running, it looks later.
func (s *Server) await(ctx context.Context, sub submission, d time.Duration, agent *Agent) (CallView, bool) {
	// The result is read with ctx: a call settling as the wait ends
	// still gets it.
	wctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	// EndWaits cancels a look already running too (a slow index's, up to
	// its bound), so that the wait is answered within the shutdown's
	// grace, not cut by it.
	defer context.AfterFunc(s.waitsEndedCtx, cancel)()
	// From 20 ms, doubling to 200 ms: a quick call is answered quickly,
	// and a slow one costs the store behind Calls few queries.
	every := 20 * time.Millisecond
	look := func() (CallView, bool) {
		c, end, ok := s.lookCall(wctx, sub.key, agent)
		if !ok {
			return CallView{}, false
		}
		defer end()
		if c, ok = forAgent(c, agent); !ok {
			return CallView{}, false
		}
		for _, ref := range c.Refusals {
			if sub.answeredBy(ref) {
				v := baseView(c)
				v.Refused = &ref
				return v, true
			}
		}
		if req, _ := requested(c.Events); c.Settled() && sub.own.Is(req) {
			return s.view(ctx, c), true
		}
		return CallView{}, false
	}
	for {
		if v, ok := look(); ok {
			return v, true
		}
		select {
		case <-wctx.Done():
			return CallView{}, false
		case <-time.After(every):
		}
		every = min(2*every, 200*time.Millisecond)
	}
}

// ErrCannotVerifyNow, as (or wrapped in) a Caller's or an Assertion's
// error, says the assertion could not be judged now (the issuer's keys
// are stale here: not refreshed for longer than the verifier allows), not
// that it is bad. The request is answered 503 keys_unavailable with
// Retry-After (CannotVerifyRetryAfter) and nothing is published: refused
// 401 or 400, an agent would take its assertion for bad. A
// *CannotVerifyNowError says why and when instead.
var ErrCannotVerifyNow = errors.New("keys_stale")

// CannotVerifyRetryAfter is the Retry-After of an answer for
// ErrCannotVerifyNow, as the intake's refusal for stale keys.
const CannotVerifyRetryAfter = 30 * time.Second

// CannotVerifyNowError is ErrCannotVerifyNow (errors.Is) with the
// verifier's reason (keys_stale, or unknown_kid when its kid is none of
// the keys at hand and they could not be loaded again yet) and when to
// send again.
type CannotVerifyNowError struct {
	Reason     string
	RetryAfter time.Duration
}

func (e *CannotVerifyNowError) Error() string { return e.Reason }

// Is reports whether target is ErrCannotVerifyNow.
func (e *CannotVerifyNowError) Is(target error) bool { return target == ErrCannotVerifyNow }

// cannotVerifyNow answers 503 keys_unavailable when err is
// ErrCannotVerifyNow, and reports whether it did.
func cannotVerifyNow(w http.ResponseWriter, err error) bool {
	if !errors.Is(err, ErrCannotVerifyNow) {
		return false
	}
	why, after := ErrCannotVerifyNow.Error(), CannotVerifyRetryAfter
	if e, ok := errors.AsType[*CannotVerifyNowError](err); ok {
		why, after = e.Reason, e.RetryAfter
	}
	httpjson.SetRetryAfter(w, after)
	writeError(w, http.StatusServiceUnavailable, apiError{Code: "keys_unavailable",
		Message: fmt.Sprintf("the issuer's keys at hand here cannot judge the assertion now (%s); nothing was published: send it again after Retry-After", why)})
	return true
}

// authenticate returns the request's verified agent, or answers 401 (503
// when it cannot be verified now: ErrCannotVerifyNow).
func (s *Server) authenticate(w http.ResponseWriter, r *http.Request) (Agent, bool) {
	a, err := s.cfg.Caller(r)
	if cannotVerifyNow(w, err) {
		return Agent{}, false
	}
	if err != nil {
		w.Header().Set("WWW-Authenticate", `Bearer realm="toolcall-ledger"`)
		writeError(w, http.StatusUnauthorized, apiError{Code: "unauthenticated", Message: "an agent's identity assertion is required as a bearer token: " + err.Error()})
		return Agent{}, false
	}
	return a, true
}

// view is c with its result, if it has one to serve: c is what the
// caller may see (forAgent).
func (s *Server) view(ctx context.Context, c callindex.Call) CallView {
	v := baseView(c)
	switch c.State {
	case statemachine.StateSucceeded, statemachine.StateFailed, statemachine.StateCompensated:
	default:
		return v // no tool ran: no result to speak of
	}
	req, _ := requested(c.Events)
	switch {
	case s.cfg.Results == nil:
		v.ResultWithheld = ResultNotServed
	default:
		rctx, cancel := context.WithTimeout(ctx, ResultTimeout)
		defer cancel()
		res, err := s.cfg.Results.Result(rctx, c.Key)
		switch {
		case err != nil:
			s.cfg.Logger.Warn("read result", "call_key", c.Key.String(), "err", err)
			v.ResultWithheld = ResultUnavailable
		case res.CallID != req.CallID || res.ArgumentsHash != req.ArgumentsHash:
			// The record is not this call's, or none: never serve
			// another call's result under the same key.
			v.ResultWithheld = ResultGone
		default:
			v.Result = res.Body
		}
	}
	return v
}

// forAgent is c as agent may see it: its user's alone. The call is its
// user's (its requested event's user_id, which the intake took from the
// verified assertion), and so is a refusal (the user of the assertion it
// verified; none when it verified none). Another user's call is as if
// absent, its state, events and result withheld, so that the users of a
// tenant do not read each other's arguments (a key is the tenant's, and
// keys can be guessed); what under the key is the agent's own, its
// refusals (its key reused, say), stays. ok is false when nothing under
// the key is the agent's. A nil agent (no Caller) sees c whole.
func forAgent(c callindex.Call, agent *Agent) (callindex.Call, bool) {
	if agent == nil {
		return c, true
	}
	mine := callindex.Call{Key: c.Key}
	if req, ok := requested(c.Events); ok && agent.User != "" && req.UserID == agent.User {
		mine = c
		mine.Refusals = nil
	}
	for _, r := range c.Refusals {
		if agent.User != "" && r.UserID == agent.User {
			mine.Refusals = append(mine.Refusals, r)
		}
	}
	return mine, len(mine.Events) > 0 || len(mine.Refusals) > 0
}

// baseView is c's state and events, without a result.
func baseView(c callindex.Call) CallView {
	v := CallView{
		TenantID:       c.Key.TenantID,
		IdempotencyKey: c.Key.IdempotencyKey,
		State:          string(c.State),
		Settled:        c.Settled(),
		Events:         c.Events,
		Refusals:       c.Refusals,
	}
	if v.Events == nil {
		v.Events = []ledger.Event{}
	}
	return v
}

// Requested is the call's requested event: its arguments hash and call
// id tell whether the call is the answer to a submission (a retry of the
// same arguments under the key) or an earlier one (other arguments,
// whose submission is refused).
func (v CallView) Requested() (ledger.Event, bool) { return requested(v.Events) }

// requested is the requested event among a call's events, whose user_id
// the intake took from the call's verified assertion.
func requested(events []ledger.Event) (ledger.Event, bool) {
	for _, e := range events {
		if e.Type == statemachine.EventRequested {
			return e, true
		}
	}
	return ledger.Event{}, false
}

// get answers for the caller's tenant only: Config.Caller's, or without
// it ?tenant_id='s (ledger dev). It answers at once: a ?wait= is refused,
// not taken as no wait, which would have its agent poll in a loop.
func (s *Server) get(w http.ResponseWriter, r *http.Request) {
	if r.URL.Query().Get("wait") != "" {
		writeError(w, http.StatusBadRequest, apiError{Code: "invalid_wait",
			Message: "GET /v1/calls/{key} does not wait: ask again later, or wait with POST /v1/calls?wait=30s, which submits the envelope and answers once its call settled"})
		return
	}
	tenant := r.URL.Query().Get("tenant_id")
	var agent *Agent
	if s.cfg.Caller != nil {
		a, ok := s.authenticate(w, r)
		if !ok {
			return
		}
		if tenant != "" && tenant != a.Tenant {
			// Not forbidden: the answer must not tell that it exists.
			writeError(w, http.StatusNotFound, apiError{Code: "not_found", Message: "no call under this key for this tenant"})
			return
		}
		tenant, agent = a.Tenant, &a
	}
	if tenant == "" {
		writeError(w, http.StatusBadRequest, apiError{Code: "missing_tenant", Message: "tenant_id query parameter is required"})
		return
	}
	if strings.Contains(tenant, "/") {
		// The key is "<tenant>/<key>": a "/" in the tenant would read
		// another tenant's call.
		writeError(w, http.StatusBadRequest, apiError{Code: "invalid_tenant", Message: "tenant_id may not contain '/'"})
		return
	}
	key := ledger.CallKey{TenantID: tenant, IdempotencyKey: r.PathValue("key")}
	end := func() {}
	if s.cfg.Caller != nil {
		// Agents of many tenants share the store behind Calls.
		var ok bool
		if end, ok = s.lookups.start(w, tenant); !ok {
			return
		}
	}
	c, err := s.call(r.Context(), key, agent)
	var v CallView
	if err == nil {
		var mine bool
		if c, mine = forAgent(c, agent); mine {
			v = s.view(r.Context(), c)
		} else {
			err = callindex.ErrNotFound
		}
	}
	// The slot is the store's: given back before the answer is written,
	// which an agent that does not read would hold up.
	end()
	writeWithin(w, s.cfg.WriteTimeout)
	if errors.Is(err, callindex.ErrNotFound) {
		writeError(w, http.StatusNotFound, apiError{Code: "not_found", Message: "no call under this key for this tenant"})
		return
	}
	if err != nil {
		// The index's outage, or ledger api's ClickHouse not open yet:
		// the agent's to ask again, not a fault of its request.
		s.cfg.Logger.Error("read call index", "call_key", key.String(), "err", err)
		w.Header().Set("Retry-After", callIndexRetryAfter)
		writeError(w, http.StatusServiceUnavailable, apiError{Code: "call_index_unavailable", Message: "the call index could not be read; ask again"})
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// callIndexRetryAfter is the Retry-After, in seconds, of a lookup the
// call index did not answer.
const callIndexRetryAfter = "5"

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	h := s.healthLast.Load()
	if h == nil || time.Since(h.at) >= healthFresh {
		v, _, _ := s.healthRun.Do("", func() (any, error) {
			h := s.checkHealth()
			s.healthLast.Store(h)
			return h, nil
		})
		h = v.(*healthAnswer)
	}
	writeJSON(w, h.code, h.body)
}

// checkHealth runs the checks: all at once, each within the budget, so
// that one that hangs (a broker that does not answer) does not use up the
// others'. Not bound to one asker's request: its answer is every
// asker's.
func (s *Server) checkHealth() *healthAnswer {
	errs := make([]error, len(s.cfg.Checks))
	var wg sync.WaitGroup
	for i, c := range s.cfg.Checks {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			errs[i] = c.Check(ctx)
		})
	}
	wg.Wait()
	status, code := "ok", http.StatusOK
	checks := make(map[string]string, len(s.cfg.Checks))
	for i, c := range s.cfg.Checks {
		if err := errs[i]; err != nil {
			// The error names addresses and databases: for the log, not
			// for whoever asks an unauthenticated health check.
			s.cfg.Logger.Warn("health check failed", "check", c.Name, "err", err)
			checks[c.Name] = "unavailable"
			switch {
			case !c.Degrades:
				status, code = "unavailable", http.StatusServiceUnavailable
			case code == http.StatusOK:
				status = "degraded"
			}
			continue
		}
		checks[c.Name] = "ok"
	}
	return &healthAnswer{code: code, body: map[string]any{"status": status, "checks": checks}, at: time.Now()}
}
