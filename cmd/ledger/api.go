package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/console"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/projections/projector"
	"github.com/toolcall-ledger/ledger/schemas"
)

func newAPICmd(g *globals) *cobra.Command {
	var (
		ch                clickhouseFlags
		idf               identityFlags
		agentsMaxLifetime time.Duration
		httpAddr          string
		approvalsURL      string
		operatorsURL      string
		group             string
		secureCookies     bool
		resultsDSN        string
		submitRate        float64
		submitBurst       int
	)
	cmd := &cobra.Command{
		Use:   "api",
		Short: "Serve the HTTP API and the console: agents' calls, the responders' queries from ClickHouse, and the approvals and operators' APIs of the other roles",
		Long: `api is the ledger's front door in production. On --http-addr it serves:

  /                      the console (approvers and incident responders sign
                         in with an assertion for the approvals audience)
  POST /v1/calls         envelopes from agents, with the agent's identity
                         assertion (Authorization: Bearer, audience
                         --agents-audience) of the envelope's tenant,
                         published to the request topic; with
                         ?wait=DURATION (at most 30s; not a duration, such
                         as ?wait=30: 400 invalid_wait, nothing published),
                         answered with the settled call, as GET answers, or
                         with this submission's refusal (in "refused")
                         (--submit-rate of a tenant's a second; more:
                         429 too_many_submissions, nothing published)
  GET  /v1/calls/{key}   an agent's call, from ClickHouse: its state and
                         events, for the tenant of the agent's identity
                         assertion (Authorization: Bearer); and, with
                         --crdb-dsn, its sanitized result, for the user who
                         made the call alone
  GET  /v1/blast-radius, /v1/outcomes, /v1/unresolved, /v1/trace/...
                         the responders' questions, from ClickHouse
  /v1/approvals...       proxied to --approvals-url (ledger approvals serve)
  /v1/control..., /v1/resolutions, /v1/compensations
                         proxied to --operators-url (ledger reconciler --http-addr)
  GET  /v1/health        the active policy and the projection's lag

Every API checks its own caller; the console calls them with the signed-in
person's assertion.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			logger := g.logger()
			agentsAudience := idf.otherAudience
			if agentsAudience == idf.audience {
				// Then an agent's assertion for a user who is an operator
				// would open the console and the operators' APIs.
				return fmt.Errorf("--agents-audience %q is the staff's --staff-audience: the agents' assertions must name another", agentsAudience)
			}
			staff, err := idf.verifier(ctx, logger)
			if err != nil {
				return fmt.Errorf("the console and the queries need operators' and approvers' keys: %w", err)
			}
			// Opened in the background (below), as the results' store is:
			// a ClickHouse that does not answer costs the lookups and
			// questions (failing as in its outage), and must not keep
			// the submissions, approvals and kill switch from starting.
			if err := ch.check(); err != nil {
				return err
			}
			st := &laterQueries{}
			defer st.close()
			pub, err := newPublisher(g.kafka.client(logger), g.kafka.topics().Requests)
			if err != nil {
				return err
			}
			defer pub.Close()
			controls, err := startControls(ctx, g.kafka.client(logger), g.kafka.topics().Control, logger)
			if err != nil {
				return err
			}
			agentsTrust := idf
			agentsTrust.audience, agentsTrust.staff, agentsTrust.otherAudience = agentsAudience, false, idf.audience
			// Its own bound, not the console sessions' (which operators
			// may raise): the intake's --max-assertion-lifetime.
			agentsTrust.maxLifetime = agentsMaxLifetime
			agents, err := agentsTrust.verifier(ctx, logger)
			if err != nil {
				return fmt.Errorf("agents' calls need the agents' keys (--issuer and --jwks-*, audience --agents-audience): %w", err)
			}
			if submitRate < 0 || submitBurst < 0 {
				return fmt.Errorf("--submit-rate %g and --submit-burst %d: neither may be negative (--submit-rate 0 removes the bound)", submitRate, submitBurst)
			}
			if submitRate == 0 {
				submitRate = -1 // httpapi: no bound
			}
			cfg := httpapi.Config{
				SubmitRate: submitRate, SubmitBurst: submitBurst,
				Publisher: pub, Logger: logger.With("component", "httpapi"),
				Calls: traceCalls{st}, Caller: agentCaller(agents), Assertion: agentAssertion(agents),
				Checks: []httpapi.Check{
					// Its outage takes the submissions (answered 503
					// publish_failed), not the questions and lookups,
					// which incident responders need then most.
					{Name: "kafka", Check: func(ctx context.Context) error { return pub.cl.Ping(ctx) }, Degrades: true},
					// Its outage takes the lookups and questions, not
					// the submissions, approvals and kill switch.
					{Name: "clickhouse", Check: st.Ping, Degrades: true},
					// The agents' keys stale: their calls are refused
					// 401 (unauthenticated), the staff's still served.
					{Name: "identity", Check: agents.Err, Degrades: true},
				},
			}
			var results *laterResults
			if resultsDSN != "" {
				// Read only: the executors own the tables, and this
				// role's database user need not be allowed DDL. Opened
				// in the background (below) and not a readiness check:
				// a store that does not answer withholds results
				// (result_withheld unavailable), and must not keep the
				// front door from starting or take it out of service.
				if _, err := pgxpool.ParseConfig(resultsDSN); err != nil {
					// Not echoed: it may hold a password.
					return errors.New("--crdb-dsn: cannot parse the DSN or read its TLS files")
				}
				results = &laterResults{}
				defer results.close()
				cfg.Results = results
			}
			api, err := httpapi.New(cfg)
			if err != nil {
				return err
			}
			mux := http.NewServeMux()
			mux.Handle("/v1/calls", api) // any method: api answers 405 to all but POST
			mux.Handle("/v1/calls/", api)
			mux.Handle("GET /healthz", api)
			if err := mountQueries(mux, st, staff, logger); err != nil {
				return err
			}
			upstreams, err := g.httpClient.transport(logger, 0)
			if err != nil {
				return err
			}
			for _, route := range []struct {
				upstream string
				paths    []string
			}{
				{approvalsURL, []string{"/v1/approvals", "/v1/approvals/"}},
				{operatorsURL, []string{"/v1/control", "/v1/control/", "/v1/resolutions", "/v1/compensations"}},
			} {
				if route.upstream == "" {
					continue
				}
				proxy, err := newProxy(route.upstream, upstreams, logger)
				if err != nil {
					return err
				}
				for _, p := range route.paths {
					mux.Handle(p, proxy)
				}
			}
			status := projector.StatusConfig{Client: g.kafka.client(logger), Topics: g.kafka.topics(), Group: group}
			health := http.NewServeMux() // its own, for another method's 405
			mux.Handle("/v1/health", httpjson.Unmatched(health))
			activePolicy := func() string {
				a, _ := controls.ActivePolicy()
				return a.Policy
			}
			lag := func(ctx context.Context) (projector.GroupStatus, error) { return projector.Status(ctx, status) }
			health.Handle("GET /v1/health", operatorGuard(staff, logger)(apiHealth(activePolicy, lag, healthLagTimeout, logger)))
			ui, err := console.New(console.Config{
				API:           mux,
				Authenticate:  consoleAuthenticate(staff),
				SecureCookies: secureCookies,
				Logger:        logger.With("component", "console"),
			})
			if err != nil {
				return err
			}
			mux.Handle("/v1/", httpjson.NotFound()) // an API path no route takes: JSON, not the console's page
			mux.Handle("/", ui)

			grp, ctx := errgroup.WithContext(ctx)
			// Stopping, the agents' waits end at once, answered 202 with
			// their status URLs, rather than hold the shutdown past its
			// grace and be cut.
			if _, err := g.serve(ctx, grp, "api", httpAddr, mux, api.EndWaits); err != nil {
				return err
			}
			grp.Go(func() error {
				st.open(ctx, "ClickHouse for the lookups and questions not open; they fail until it is", func(ctx context.Context) (*chstore.Store, error) {
					return ch.open(ctx, logger.With("component", "chstore"))
				}, logger)
				return nil
			})
			if results != nil {
				grp.Go(func() error {
					results.open(ctx, "execution store for the agents' results not open; results withheld until it is", func(ctx context.Context) (*pgstore.Store, error) {
						return pgstore.Open(ctx, pgstore.Config{DSN: resultsDSN, SkipMigrate: true, Logger: logger.With("component", "results")})
					}, logger)
					return nil
				})
			}
			logger.Info("api serving", "addr", httpAddr, "clickhouse", redactDSN(ch.dsn), "approvals", approvalsURL, "operators", operatorsURL, "results", resultsDSN != "")
			return grp.Wait()
		},
	}
	fs := cmd.Flags()
	ch.register(fs)
	idf.registerStaff(fs)
	fs.StringVar(&httpAddr, "http-addr", devHTTPAddr, "where the API and the console listen")
	fs.StringVar(&approvalsURL, "approvals-url", "", "base URL of 'ledger approvals serve' (its --http-addr); empty: /v1/approvals is not served")
	fs.StringVar(&operatorsURL, "operators-url", "", "base URL of the operators' APIs ('ledger reconciler --http-addr'); empty: /v1/control, /v1/resolutions and /v1/compensations are not served")
	fs.StringVar(&group, "projector-group", projector.DefaultGroup, "the projector's consumer group, whose lag /v1/health reports")
	fs.DurationVar(&agentsMaxLifetime, "agents-max-assertion-lifetime", identity.DefaultMaxLifetime, "the longest an agent's assertion for GET /v1/calls/{key} and POST /v1/calls may be valid: the intake's --max-assertion-lifetime (--max-assertion-lifetime here bounds the staff's)")
	fs.StringVar(&resultsDSN, "crdb-dsn", "", "the execution store's CockroachDB (or PostgreSQL) DSN, read only (no DDL and no writes: a user granted SELECT on execution_records is enough): agents' calls are then served with their results; empty: without (result_withheld not_served)")
	fs.Float64Var(&submitRate, "submit-rate", httpapi.DefaultSubmitRate, "POST /v1/calls of one tenant a second, on this process (its bearer's tenant; checked before the envelope is read): more are answered 429 too_many_submissions with Retry-After and not published, so that one tenant's flood does not queue the others' calls at the intake; 0: no bound")
	fs.IntVar(&submitBurst, "submit-burst", 0, "how many of one tenant's POST /v1/calls --submit-rate lets through at once after a quiet spell; 0: two seconds of --submit-rate")
	fs.BoolVar(&secureCookies, "secure-cookies", true, "mark the console's cookies Secure and send HSTS (the console is served over TLS, here or by a proxy in front); false only for plain-HTTP trials")
	return cmd
}

// traceCalls serves agents' call views from the ClickHouse projection's
// trace of a call: what the projector has applied, seconds behind the log.
type traceCalls struct{ q *laterQueries }

var _ httpapi.UserCalls = traceCalls{}

func (c traceCalls) Call(ctx context.Context, key ledger.CallKey) (callindex.Call, error) {
	return c.UserCall(ctx, key, "")
}

// UserCall is the call under key with user's refusals alone (every
// user's for "").
func (c traceCalls) UserCall(ctx context.Context, key ledger.CallKey, user string) (callindex.Call, error) {
	// Bounded as the responders' questions are: an agent's GET is one
	// ClickHouse query, which a key's events spread over months widen.
	ctx, cancel := context.WithTimeout(ctx, agentCallTimeout)
	defer cancel()
	evs, err := c.q.UserTrace(ctx, key, user)
	if err != nil {
		return callindex.Call{}, err
	}
	return callindex.CallOf(key, evs)
}

// healthLagTimeout bounds the reading of the projection's lag for
// /v1/health, so that a Kafka that does not answer says unknown rather
// than holding the operator's request.
const healthLagTimeout = 5 * time.Second

// apiHealth answers ledger api's GET /v1/health to operators: the active
// policy, and the projection's lag as Kafka says it within timeout, or
// that it is unknown.
func apiHealth(activePolicy func() string, lag func(context.Context) (projector.GroupStatus, error), timeout time.Duration, logger *slog.Logger) func(http.ResponseWriter, *http.Request, httpapi.Operator) {
	return func(w http.ResponseWriter, r *http.Request, op httpapi.Operator) {
		if !slices.Contains(op.Roles, console.RoleOperator) {
			httpjson.Error(w, http.StatusForbidden, "forbidden", "the operator role is required")
			return
		}
		// The breakers are the executors' (their /metrics, as
		// ledger_breaker_state): none of this process's to show.
		h := console.Health{Policy: activePolicy(), Breakers: map[string]string{}, BreakersUnknown: true}
		ctx, cancel := context.WithTimeout(r.Context(), timeout)
		defer cancel()
		if s, err := lag(ctx); err == nil || errors.Is(err, projector.ErrNeverCommitted) {
			h.ProjectionLagRecords, h.ProjectionLagSeconds = s.Records, s.Time.Seconds()
		} else {
			// Not 0 behind: unknown. The error names brokers and
			// groups: for the log.
			logger.Warn("projection lag unavailable for /v1/health", "err", err)
			h.ProjectionLagUnknown = true
		}
		writeHealth(w, h)
	}
}

// agentCallTimeout bounds the ClickHouse query behind one agent's GET.
const agentCallTimeout = 10 * time.Second

// later is a store ledger api opens in the background: nil until it
// answered.
type later[T any] struct{ st atomic.Pointer[T] }

// open opens the store with open, trying again every laterRetry until it
// answers or ctx ends; unopened says so in the log at each failure.
func (l *later[T]) open(ctx context.Context, unopened string, open func(context.Context) (*T, error), logger *slog.Logger) {
	for {
		octx, cancel := context.WithTimeout(ctx, laterRetry)
		st, err := open(octx)
		cancel()
		if err == nil {
			l.st.Store(st)
			return
		}
		logger.Warn(unopened, "retry_in", laterRetry, "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(laterRetry):
		}
	}
}

// laterRetry is how long ledger api waits for a store to open, and then
// before it tries again.
const laterRetry = 10 * time.Second

// laterResults serves results from the execution store once it opened:
// until then, each read fails (result_withheld unavailable).
type laterResults struct{ later[pgstore.Store] }

func (l *laterResults) Result(ctx context.Context, key ledger.CallKey) (httpapi.Result, error) {
	st := l.st.Load()
	if st == nil {
		return httpapi.Result{}, errors.New("the execution store is not open yet")
	}
	return storeResults{st}.Result(ctx, key)
}

func (l *laterResults) close() {
	if st := l.st.Load(); st != nil {
		st.Close()
	}
}

// errClickHouseNotOpen answers the lookups and questions, and fails the
// clickhouse health check, until ledger api's ClickHouse opened.
var errClickHouseNotOpen = errors.New("clickhouse is not open yet")

// laterQueries answers from ClickHouse once it opened: until then, as in
// its outage, each lookup and question fails.
type laterQueries struct{ later[chstore.Store] }

var _ projections.Queries = (*laterQueries)(nil)

func (l *laterQueries) store() (*chstore.Store, error) {
	if st := l.st.Load(); st != nil {
		return st, nil
	}
	return nil, errClickHouseNotOpen
}

func (l *laterQueries) Trace(ctx context.Context, key ledger.CallKey) ([]ledger.Event, error) {
	st, err := l.store()
	if err != nil {
		return nil, err
	}
	return st.Trace(ctx, key)
}

// UserTrace is chstore's: the trace with user's refusals alone.
func (l *laterQueries) UserTrace(ctx context.Context, key ledger.CallKey, user string) ([]ledger.Event, error) {
	st, err := l.store()
	if err != nil {
		return nil, err
	}
	return st.UserTrace(ctx, key, user)
}

func (l *laterQueries) BlastRadius(ctx context.Context, f projections.Filter) (projections.BlastRadius, error) {
	st, err := l.store()
	if err != nil {
		return projections.BlastRadius{}, err
	}
	return st.BlastRadius(ctx, f)
}

func (l *laterQueries) Outcomes(ctx context.Context, f projections.Filter, bucket time.Duration) ([]projections.OutcomeCount, error) {
	st, err := l.store()
	if err != nil {
		return nil, err
	}
	return st.Outcomes(ctx, f, bucket)
}

func (l *laterQueries) Unresolved(ctx context.Context, f projections.Filter) ([]projections.Call, error) {
	st, err := l.store()
	if err != nil {
		return nil, err
	}
	return st.Unresolved(ctx, f)
}

// Ping is the clickhouse health check.
func (l *laterQueries) Ping(ctx context.Context) error {
	st, err := l.store()
	if err != nil {
		return err
	}
	return st.Ping(ctx)
}

func (l *laterQueries) close() {
	if st := l.st.Load(); st != nil {
		st.Close()
	}
}

// agentCaller is httpapi's Caller: the tenant and user of the agent's
// identity assertion that the request carries, verified by agents. Its
// refusal names a reason, never the assertion.
func agentCaller(agents identity.AssertionVerifier) func(r *http.Request) (httpapi.Agent, error) {
	return func(r *http.Request) (httpapi.Agent, error) {
		return agentOf(identity.Authenticate(r, agents))
	}
}

// agentAssertion is httpapi's Assertion: the tenant and user of an
// envelope's own assertion, verified by agents as the intake will.
func agentAssertion(agents identity.AssertionVerifier) func(ctx context.Context, assertion string) (httpapi.Agent, error) {
	return func(ctx context.Context, assertion string) (httpapi.Agent, error) {
		return agentOf(identity.VerifyReason(ctx, agents, assertion))
	}
}

// agentOf is the agent of a verified identity, or the reason it is none.
func agentOf(id identity.Identity, reason string, err error) (httpapi.Agent, error) {
	after, forNow := identity.RetryAfter(err)
	switch {
	case err != nil && forNow:
		// The keys at hand cannot judge it now (stale, or its kid not
		// looked for in keys loaded since it came).
		return httpapi.Agent{}, &httpapi.CannotVerifyNowError{Reason: reason, RetryAfter: after}
	case err != nil:
		return httpapi.Agent{}, errors.New(reason)
	}
	// The envelope's tenant syntax: not the ledger's own tenant, where
	// refusals of unverifiable submissions are filed.
	if !schemas.ValidTenantID(id.Tenant) {
		return httpapi.Agent{}, errors.New("tenant_not_an_agents")
	}
	return httpapi.Agent{Tenant: id.Tenant, User: id.User}, nil
}

// consoleAuthenticate signs console users in with the staff verifier.
func consoleAuthenticate(staff *identity.Verifier) func(ctx context.Context, assertion string) (console.Identity, error) {
	return func(ctx context.Context, assertion string) (console.Identity, error) {
		id, exp, err := staff.VerifyUntil(ctx, assertion)
		return console.Identity{User: id.User, Tenant: id.Tenant, Roles: id.Roles, Expires: exp}, signInErr(err)
	}
}

// signInErr is the console's error for the staff verifier's err: one that
// refuses for now only (identity.ForNowError) wraps console.ErrTryLater.
func signInErr(err error) error {
	if _, forNow := identity.RetryAfter(err); forNow {
		return fmt.Errorf("%w: %w", console.ErrTryLater, err)
	}
	return err
}

// newProxy forwards requests, with their Authorization, to the role at
// upstream, through transport.
func newProxy(upstream string, transport http.RoundTripper, logger *slog.Logger) (http.Handler, error) {
	u, err := url.Parse(upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%q is not an http(s) base URL", upstream)
	}
	p := &httputil.ReverseProxy{
		Transport: transport,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(u)
			pr.SetXForwarded()
			// The upstream authenticates the bearer; the console's
			// session cookie is not for it.
			pr.Out.Header.Del("Cookie")
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			logger.Warn("upstream unavailable", "upstream", u.Host, "path", r.URL.Path, "err", err)
			httpjson.Error(w, http.StatusBadGateway, httpjson.CodeUpstreamUnavailable, "a service behind this API does not answer; see its log")
		},
	}
	return p, nil
}
