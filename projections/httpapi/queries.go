package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/report"
)

// The responders' query routes.
const (
	PathBlastRadius = "/v1/blast-radius"
	PathOutcomes    = "/v1/outcomes"
	PathUnresolved  = "/v1/unresolved"
	// PathTrace is followed by <tenant>/<idempotency_key>.
	PathTrace = "/v1/trace/"
)

// PlatformTenant is the tenant of an operator who may ask about every
// tenant (as the control plane's).
const PlatformTenant = "*"

// ParamFormat chooses an answer's form: json (default) or csv.
const ParamFormat = "format"

// Operator is who asks a question, as the guard authenticated them.
type Operator struct {
	User   string
	Tenant string
	Roles  []string
}

// Guard wraps a handler so that it runs only for an authenticated
// operator; any other request it answers itself (401). The ledger's guard
// verifies the operator's assertion (processors/identity).
type Guard func(next func(w http.ResponseWriter, r *http.Request, op Operator)) http.HandlerFunc

// QueryConfig configures the responders' query API.
type QueryConfig struct {
	// Queries answers; required.
	Queries projections.Queries
	// Guard authenticates the operator asking; required. It answers
	// 401 itself for a request without a valid assertion.
	Guard Guard
	// OperatorRole is the role an operator must hold; default
	// "operator".
	OperatorRole string
	// Timeout bounds each question's query, so that a client that stays
	// connected cannot hold a scan of the whole history open for as long
	// as it likes (on ClickHouse the deadline also goes to the server, as
	// max_execution_time); past it the answer is 504 query_timeout.
	// Default: DefaultQueryTimeout.
	Timeout time.Duration
	// WriteTimeout bounds the writing of an answer (up to 100,000 calls,
	// in memory until written): an operator's client that asks and does
	// not read holds its connection and that memory no longer than
	// this. The answers being written are bounded too, as the questions
	// running are: MaxQuestionsPerTenant of a tenant's (one more is
	// answered 429 too_many_answers), and answersPerQuestion times
	// MaxQuestions in all, so that a client that asks and never reads
	// cannot pile answers up in memory. Default:
	// DefaultAnswerWriteTimeout.
	WriteTimeout time.Duration
	// MaxQuestionsPerTenant bounds the questions (blast radius, outcomes,
	// unresolved: the scans) that the operators of one tenant ("*" for
	// the platform's) have running at once; one more is answered 429
	// too_many_questions, Retry-After 1, so that one tenant cannot
	// starve the store of the others' questions and the projector's
	// writes. Default: DefaultMaxQuestionsPerTenant.
	MaxQuestionsPerTenant int
	// MaxQuestions bounds those questions across every tenant, so that
	// many tenants' operators together cannot either; one more is
	// answered the same. Default: DefaultMaxQuestions.
	MaxQuestions int
	Now          func() time.Time
	Logger       *slog.Logger
}

// DefaultQueryTimeout is QueryConfig.Timeout's default.
const DefaultQueryTimeout = 30 * time.Second

// DefaultAnswerWriteTimeout is QueryConfig.WriteTimeout's default, and
// Config.WriteTimeout's.
const DefaultAnswerWriteTimeout = time.Minute

// DefaultMaxQuestionsPerTenant is QueryConfig.MaxQuestionsPerTenant's
// default.
const DefaultMaxQuestionsPerTenant = 8

// DefaultMaxQuestions is QueryConfig.MaxQuestions's default: four
// tenants' worth of questions at once.
const DefaultMaxQuestions = 32

// QueryHandler serves the responders' questions:
//
//	GET /v1/blast-radius?jti=..&tenant=..   projections.BlastRadius
//	GET /v1/outcomes?bucket=5m&tenant=..    []projections.OutcomeCount (at most projections.MaxOutcomeBuckets buckets)
//	GET /v1/unresolved?tenant=..            []projections.Call
//	GET /v1/trace/<tenant>/<key>            []ledger.Event
//
// Every route takes an operator's assertion as Authorization: Bearer. An
// operator of one tenant asks about that tenant only (a question without
// a tenant is about theirs); a platform operator (tenant "*") may name any
// tenant, or all_tenants=true. The filter parameters are projections'
// (projections.FilterFromValues); format=csv answers CSV. A list cut
// short says so in headers (HeaderTruncated, HeaderLimitReached); a
// trace, which shows at most projections.MaxRefusals refused
// submissions (the earliest and the latest), says it holds that many in
// HeaderRefusalsLimitReached.
func QueryHandler(cfg QueryConfig) (http.Handler, error) {
	if cfg.Queries == nil || cfg.Guard == nil {
		return nil, errors.New("httpapi: queries and guard are required")
	}
	if cfg.OperatorRole == "" {
		cfg.OperatorRole = "operator"
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultQueryTimeout
	}
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = DefaultAnswerWriteTimeout
	}
	if cfg.MaxQuestionsPerTenant <= 0 {
		cfg.MaxQuestionsPerTenant = DefaultMaxQuestionsPerTenant
	}
	if cfg.MaxQuestions <= 0 {
		cfg.MaxQuestions = DefaultMaxQuestions
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	q := &queries{cfg: cfg, limit: newLimiter(cfg.MaxQuestionsPerTenant, cfg.MaxQuestions, "questions", "too_many_questions"),
		answers: newLimiter(cfg.MaxQuestionsPerTenant, answersPerQuestion*cfg.MaxQuestions, "answers being written (asked, and not yet read)", "too_many_answers")}
	mux := http.NewServeMux()
	auth := cfg.Guard
	mux.HandleFunc("GET "+PathBlastRadius, auth(q.blastRadius))
	mux.HandleFunc("GET "+PathOutcomes, auth(q.outcomes))
	mux.HandleFunc("GET "+PathUnresolved, auth(q.unresolved))
	mux.HandleFunc("GET "+PathTrace+"{tenant}/{key...}", auth(q.trace))
	return httpjson.Unmatched(mux), nil
}

type queries struct {
	cfg QueryConfig

	// limit bounds the questions running, MaxQuestionsPerTenant of a
	// tenant's operators and MaxQuestions in all.
	limit *limiter
	// answers bounds the questions asked and not yet answered whole:
	// running, or their answers being written. A tenant's are as many
	// as its questions may be; in all, more than the questions, so that
	// one tenant's unread answers do not keep every other tenant's
	// questions out.
	answers *limiter
}

// answersPerQuestion is how many answers may be held, in all, for each
// question that may run.
const answersPerQuestion = 4

// limiter bounds the requests of one kind running at once: perTenant of
// one tenant's and all of every tenant's, so that one tenant cannot
// starve the store of the others' requests and the projector's writes.
type limiter struct {
	perTenant, all int
	what, code     string // "questions", and the 429's code

	mu sync.Mutex
	// running counts each tenant's requests running, total all of them.
	running map[string]int
	total   int
}

func newLimiter(perTenant, all int, what, code string) *limiter {
	return &limiter{perTenant: perTenant, all: all, what: what, code: code, running: make(map[string]int)}
}

// start counts a request of tenant as running, and returns its end; or,
// with perTenant of the tenant's or all in all running, answers 429 with
// Retry-After 1 and returns false.
func (l *limiter) start(w http.ResponseWriter, tenant string) (end func(), ok bool) {
	end, busy := l.try(tenant)
	if busy != "" {
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusTooManyRequests, apiError{Code: l.code,
			Message: busy + "; ask again when one has been answered"})
		return nil, false
	}
	return end, true
}

// try counts a request of tenant as running, and returns its end; or,
// with perTenant of the tenant's or all in all running, says which bound
// is full and counts nothing.
func (l *limiter) try(tenant string) (end func(), busy string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.running[tenant] >= l.perTenant:
		return nil, fmt.Sprintf("%d %s of your tenant are running", l.perTenant, l.what)
	case l.total >= l.all:
		return nil, fmt.Sprintf("%d %s are running, of every tenant", l.all, l.what)
	}
	l.running[tenant]++
	l.total++
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.total--
		if l.running[tenant]--; l.running[tenant] == 0 {
			delete(l.running, tenant)
		}
	}, ""
}

// operator answers 403 unless id is an operator.
func (q *queries) operator(w http.ResponseWriter, id Operator) bool {
	if id.User == "" || id.Tenant == "" || !slices.Contains(id.Roles, q.cfg.OperatorRole) {
		writeError(w, http.StatusForbidden, apiError{Code: "forbidden", Message: "the assertion does not carry the " + q.cfg.OperatorRole + " role"})
		return false
	}
	return true
}

// filter reads the request's filter and scopes it to what id may ask.
func (q *queries) filter(w http.ResponseWriter, r *http.Request, id Operator, extra ...string) (projections.Filter, bool) {
	if !q.operator(w, id) {
		return projections.Filter{}, false
	}
	f, err := projections.FilterFromValues(r.URL.Query(), q.cfg.Now(), append(extra, ParamFormat)...)
	if err != nil {
		writeError(w, http.StatusBadRequest, apiError{Code: "invalid_filter", Message: err.Error()})
		return f, false
	}
	if id.Tenant != PlatformTenant {
		if f.AllTenants || (f.Tenant != "" && f.Tenant != id.Tenant) {
			writeError(w, http.StatusForbidden, apiError{Code: "forbidden", Message: "an operator of tenant " + id.Tenant + " may ask about that tenant only"})
			return f, false
		}
		f.Tenant = id.Tenant
	}
	return f, true
}

// answerError maps a query's error to a status.
func (q *queries) answerError(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, projections.ErrTenantRequired):
		writeError(w, http.StatusBadRequest, apiError{Code: "tenant_required", Message: err.Error() + ": tenant=<id> or all_tenants=true"})
	case errors.Is(err, projections.ErrInvalidFilter):
		writeError(w, http.StatusBadRequest, apiError{Code: "invalid_filter", Message: err.Error()})
	case errors.Is(err, projections.ErrNotFound):
		writeError(w, http.StatusNotFound, apiError{Code: "not_found", Message: err.Error()})
	case errors.Is(err, projections.ErrQuestionTooLarge):
		q.cfg.Logger.Warn("query stopped at its memory bound", "err", err)
		writeError(w, http.StatusUnprocessableEntity, apiError{Code: "question_too_large", Message: projections.ErrQuestionTooLarge.Error() + "; narrow it (since, until, tool, tenant)"})
	case errors.Is(err, context.DeadlineExceeded):
		q.cfg.Logger.Warn("query timed out", "timeout", q.cfg.Timeout, "err", err)
		writeError(w, http.StatusGatewayTimeout, apiError{Code: "query_timeout", Message: "the question took longer than " + q.cfg.Timeout.String() + "; narrow it (since, until, tool, tenant)"})
	default:
		q.cfg.Logger.Error("query failed", "err", err)
		writeError(w, http.StatusServiceUnavailable, apiError{Code: "projection_unavailable", Message: "the projection could not answer; see the server's log"})
	}
}

// Headers of a question's answer that says what its list left out: a
// blast radius's list cut at the limit (with the number of matching
// calls), a list of calls that fills the limit, past which more may
// match (the unresolved calls, whose answer has no total), and a trace
// that holds as many refused submissions as a projection keeps under a
// key (projections.RefusalsFull), which may leave those between the
// earliest and the latest out.
const (
	HeaderTruncated            = "X-Truncated"
	HeaderTotalCount           = "X-Total-Count"
	HeaderLimitReached         = "X-Limit-Reached"
	HeaderRefusalsLimitReached = "X-Refusals-Limit-Reached"
)

// writeWithin bounds the writing of the answer about to be written to d
// from now: a client that asks and does not read holds its connection, a
// goroutine and the answer no longer. Set once the answer is ready, so
// that what it took (a query, a wait) does not count; the server clears
// it after the request.
func writeWithin(w http.ResponseWriter, d time.Duration) {
	// None where the writer supports none (a console streaming it on).
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(d))
}

// csvWanted reports whether the request asks for CSV, answering 400 for a
// format it does not know.
func csvWanted(w http.ResponseWriter, r *http.Request) (csv, ok bool) {
	switch r.URL.Query().Get(ParamFormat) {
	case "", "json":
		return false, true
	case "csv":
		return true, true
	}
	writeError(w, http.StatusBadRequest, apiError{Code: "invalid_format", Message: "format must be json or csv"})
	return false, false
}

// ask answers one question: it reads and scopes the filter (extra names
// the question's own parameters), asks, and writes the answer as JSON or,
// with format=csv, as the CSV file name.csv.
func (q *queries) ask(w http.ResponseWriter, r *http.Request, id Operator, name string, extra []string, question func(ctx context.Context, f projections.Filter) (any, func(io.Writer) error, error)) {
	f, ok := q.filter(w, r, id, extra...)
	if !ok {
		return
	}
	csv, ok := csvWanted(w, r)
	if !ok {
		return
	}
	end, ok := q.limit.start(w, id.Tenant)
	if !ok {
		return
	}
	// Asked first, so that a question running says so.
	answered, ok := q.answers.start(w, id.Tenant)
	if !ok {
		end()
		return
	}
	defer answered()
	ctx, cancel := context.WithTimeout(r.Context(), q.cfg.Timeout)
	defer cancel()
	v, toCSV, err := func() (any, func(io.Writer) error, error) {
		// The slot is the store's: it is given back before the answer
		// is written, which a client that does not read could hold up.
		defer end()
		return question(ctx, f)
	}()
	if err != nil {
		q.answerError(w, err)
		return
	}
	q.cfg.Logger.Info("question answered", "question", name, "operator", id.User, "operator_tenant", id.Tenant, "filter", f.Values().Encode())
	// What a list left out, in headers too: the CSV form has no room for
	// it, and an export cut at the limit must not pass for the whole.
	switch a := v.(type) {
	case projections.BlastRadius:
		if a.Truncated {
			w.Header().Set(HeaderTruncated, "true")
			w.Header().Set(HeaderTotalCount, strconv.Itoa(a.Total))
		}
	case []projections.Call:
		if f.Full(len(a)) {
			w.Header().Set(HeaderLimitReached, "true")
		}
	}
	writeWithin(w, q.cfg.WriteTimeout)
	if !csv {
		writeJSON(w, http.StatusOK, v)
		return
	}
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Disposition", `attachment; filename="`+name+`.csv"`)
	w.Header().Set("X-Content-Type-Options", "nosniff")
	noStore(w)
	w.WriteHeader(http.StatusOK)
	if err := toCSV(w); err != nil {
		q.cfg.Logger.Warn("write csv", "question", name, "err", err)
	}
}

func (q *queries) blastRadius(w http.ResponseWriter, r *http.Request, id Operator) {
	q.ask(w, r, id, "blast-radius", nil, func(ctx context.Context, f projections.Filter) (any, func(io.Writer) error, error) {
		br, err := q.cfg.Queries.BlastRadius(ctx, f)
		return br, func(w io.Writer) error { return report.BlastRadiusCSV(w, br) }, err
	})
}

func (q *queries) outcomes(w http.ResponseWriter, r *http.Request, id Operator) {
	q.ask(w, r, id, "outcomes", []string{projections.ParamBucket}, func(ctx context.Context, f projections.Filter) (any, func(io.Writer) error, error) {
		bucket, err := projections.ParseBucket(r.URL.Query().Get(projections.ParamBucket))
		if err != nil {
			return nil, nil, err
		}
		// Checked here too, on the server's clock, so that the bound
		// holds whatever answers behind the API.
		if _, err := projections.CheckOutcomes(f, bucket, q.cfg.Now()); err != nil {
			return nil, nil, err
		}
		os, err := q.cfg.Queries.Outcomes(ctx, f, bucket)
		if os == nil {
			os = []projections.OutcomeCount{}
		}
		return os, func(w io.Writer) error { return report.OutcomesCSV(w, os) }, err
	})
}

func (q *queries) unresolved(w http.ResponseWriter, r *http.Request, id Operator) {
	q.ask(w, r, id, "unresolved", nil, func(ctx context.Context, f projections.Filter) (any, func(io.Writer) error, error) {
		calls, err := q.cfg.Queries.Unresolved(ctx, f)
		if calls == nil {
			calls = []projections.Call{}
		}
		return calls, func(w io.Writer) error { return report.CallsCSV(w, calls) }, err
	})
}

func (q *queries) trace(w http.ResponseWriter, r *http.Request, id Operator) {
	if !q.operator(w, id) {
		return
	}
	key := ledger.CallKey{TenantID: r.PathValue("tenant"), IdempotencyKey: r.PathValue("key")}
	if id.Tenant != PlatformTenant && key.TenantID != id.Tenant {
		writeError(w, http.StatusForbidden, apiError{Code: "forbidden", Message: "an operator of tenant " + id.Tenant + " may ask about that tenant only"})
		return
	}
	// A trace is a question as the others are, on the same connections:
	// unbounded, one tenant's operator tracing in parallel would hold the
	// pool every tenant's agents look their calls up through.
	end, ok := q.limit.start(w, id.Tenant)
	if !ok {
		return
	}
	// Asked first, so that a question running says so.
	answered, ok := q.answers.start(w, id.Tenant)
	if !ok {
		end()
		return
	}
	defer answered()
	ctx, cancel := context.WithTimeout(r.Context(), q.cfg.Timeout)
	defer cancel()
	evs, err := q.cfg.Queries.Trace(ctx, key)
	// The slot is the store's, given back before the answer is written,
	// as a question's is (ask).
	end()
	if err != nil {
		q.answerError(w, err)
		return
	}
	if _, full := projections.RefusalsFull(evs); full {
		// In a header, as the other lists' cuts: the answer is the
		// events, a bare array with no room for it.
		w.Header().Set(HeaderRefusalsLimitReached, "true")
	}
	writeWithin(w, q.cfg.WriteTimeout)
	// Compact, so that each event's arguments are the log's bytes: an
	// indenting encoder would re-indent them.
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	noStore(w)
	w.WriteHeader(http.StatusOK)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(evs)
}
