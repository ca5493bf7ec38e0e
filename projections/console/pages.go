package console

import (
	"cmp"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// maxDecided is how many decided or expired approvals the queue shows.
const maxDecided = 25

// approvalRow is an approval with what the queue shows of its times.
type approvalRow struct {
	approval
	URL       string
	Age       string
	ExpiresIn string
	Overdue   bool
}

type approvalsPage struct {
	Pending    []approvalRow
	PendingErr string
	// PendingMore: the queue is longer than the list shows.
	PendingMore bool
	Decided     []approvalRow
	DecidedErr  []string
}

func (c *Console) row(a approval, now time.Time) approvalRow {
	// What the agent's arguments put on the page shows as it is: its
	// characters that do not show escaped here, and the rest in the order
	// they are held (the templates' <bdo dir="ltr">), so that
	// right-to-left letters cannot reorder the digits beside them.
	for _, f := range []*string{&a.Preview.Resource, &a.Preview.Amount, &a.Requester.User, &a.Requester.Agent, &a.CallID} {
		*f, _ = visible(*f)
	}
	a.Requester.Roles = slices.Clone(a.Requester.Roles)
	for i := range a.Requester.Roles {
		a.Requester.Roles[i], _ = visible(a.Requester.Roles[i])
	}
	row := approvalRow{approval: a, URL: approvalURL(a.ID), Age: fmtDuration(now.Sub(a.RequestedAt))}
	switch {
	case a.ExpiresAt.IsZero():
		row.ExpiresIn = "—"
	case now.Before(a.ExpiresAt):
		row.ExpiresIn = fmtDuration(a.ExpiresAt.Sub(now))
	default:
		row.ExpiresIn, row.Overdue = "overdue", true
	}
	return row
}

func (c *Console) serveApprovals(w http.ResponseWriter, r *http.Request, s *session) {
	now := c.cfg.Now()
	var p approvalsPage
	var pending approvalList
	if _, err := c.call(r, s, http.MethodGet, pathApprovals, url.Values{"state": {"pending"}}, nil, &pending); err != nil {
		p.PendingErr = describe(err)
	}
	for _, a := range pending.Approvals {
		p.Pending = append(p.Pending, c.row(a, now))
	}
	p.PendingMore = pending.More
	// The API lists rejected and expired approvals; approved ones move on
	// to the executor and are found under Calls.
	for _, state := range []string{"rejected", "expired"} {
		var l approvalList
		if _, err := c.call(r, s, http.MethodGet, pathApprovals, url.Values{"state": {state}}, nil, &l); err != nil {
			p.DecidedErr = append(p.DecidedErr, state+": "+describe(err))
			continue
		}
		for _, a := range l.Approvals {
			p.Decided = append(p.Decided, c.row(a, now))
		}
	}
	decidedAt := func(a approvalRow) time.Time {
		if a.DecidedAt != nil {
			return *a.DecidedAt
		}
		return a.ExpiresAt
	}
	slices.SortStableFunc(p.Decided, func(a, b approvalRow) int { return decidedAt(b).Compare(decidedAt(a)) })
	if len(p.Decided) > maxDecided {
		p.Decided = p.Decided[:maxDecided]
	}
	c.render(w, r, s, "approvals", "Approvals", p)
}

type approvalPage struct {
	A         approvalRow
	CallURL   string
	Args      []argRow
	ArgsCut   bool
	ArgsErr   string
	Pending   bool
	ActionURL string
	// NotShown, on a pending approval, says why the page offers no
	// approval: it could not show every argument it would approve as
	// it is (cut, unparsable, missing, or holding characters that do not
	// show), and an approval binds them all.
	NotShown string
}

func (c *Console) serveApproval(w http.ResponseWriter, r *http.Request, s *session) {
	id := r.PathValue("id")
	var a approval
	status, err := c.call(r, s, http.MethodGet, apiApprovalPath(id), nil, nil, &a)
	if err != nil {
		c.refused(w, r, s, status, "Approval", err, "/approvals")
		return
	}
	p := approvalPage{
		A:         c.row(a, c.cfg.Now()),
		CallURL:   callURL(a.TenantID, a.IdempotencyKey),
		Pending:   a.State == "pending",
		ActionURL: approvalURL(a.ID),
	}
	rows, cut, err := flattenArgs(a.Preview.Arguments)
	if err != nil {
		p.ArgsErr = "the arguments do not parse as JSON"
	}
	p.Args, p.ArgsCut = rows, cut
	switch {
	case err != nil:
		p.NotShown = "its arguments do not parse"
	case cut:
		p.NotShown = fmt.Sprintf("it shows only the first %d of its arguments' fields", maxArgRows)
	case len(rows) == 0:
		p.NotShown = "it has no arguments to show"
	case slices.ContainsFunc(rows, func(r argRow) bool { return r.Hidden }):
		p.NotShown = `some of its arguments hold characters that do not show on a page as they are (direction overrides, zero-width or control characters, spaces at either end or in a row, which a page collapses: shown above as \u escapes), so what the page shows is not what would be approved`
	}
	c.render(w, r, s, "approval", "Approval "+a.Tool, p)
}

// refused renders a page whose one API answer was a refusal, with the
// API's status when it gave one.
func (c *Console) refused(w http.ResponseWriter, r *http.Request, s *session, status int, what string, err error, back string) {
	if status < 400 {
		status = http.StatusBadGateway
	}
	c.renderStatus(w, r, s, status, "message", what, messagePage{
		Heading: what + ": the ledger refused",
		Text:    describe(err),
		Back:    back,
	})
}

// paramKey is the search form's idempotency key: it opens the call's
// timeline rather than asking a question.
const paramKey = "key"

// callsParams are the search form's fields that go to /v1/blast-radius.
var callsParams = []string{
	projections.ParamTenant, projections.ParamAllTenants, projections.ParamTool, projections.ParamState,
	projections.ParamCallID, projections.ParamTraceID, projections.ParamToolDigest, projections.ParamSince, projections.ParamUntil,
}

// states are the call states, for the search form.
var states = []statemachine.State{
	statemachine.StateRequested, statemachine.StateApprovalPending, statemachine.StateAuthorized,
	statemachine.StateExecuting, statemachine.StateSucceeded, statemachine.StateFailed,
	statemachine.StateOutcomeUnknown, statemachine.StateCompensated, statemachine.StateDenied,
	statemachine.StateRejected, statemachine.StateExpired,
}

// pick returns the non-empty values of names in q: only what the form
// names goes to the API, so nothing else in the address widens a
// question.
func pick(q url.Values, names []string) url.Values {
	out := url.Values{}
	for _, n := range names {
		if v := strings.TrimSpace(q.Get(n)); v != "" {
			if n == projections.ParamAllTenants && v != "true" {
				continue
			}
			out.Set(n, v)
		}
	}
	return out
}

// callRow is a call as the console lists it.
type callRow struct {
	projections.Call
	URL         string
	ApprovalURL string
	Parked      bool
	Age         string
}

func (c *Console) callRows(calls []projections.Call, now time.Time) []callRow {
	rows := make([]callRow, len(calls))
	for i, cl := range calls {
		rows[i] = callRow{Call: cl, URL: callURL(cl.TenantID, cl.IdempotencyKey), Parked: cl.LastEvent == statemachine.EventParked, Age: fmtDuration(now.Sub(cl.UpdatedAt))}
		if cl.State == statemachine.StateApprovalPending {
			rows[i].ApprovalURL = approvalURL(cl.Key().ApprovalID())
		}
	}
	return rows
}

type callsPage struct {
	Form            url.Values
	States          []statemachine.State
	Searched        bool
	SearchErr       string
	Total           int
	Truncated       bool
	Results         []callRow
	Unresolved      []callRow
	UnresolvedErr   string
	UnresolvedScope string
	// UnresolvedMore: more calls wait than the list holds (the oldest).
	UnresolvedMore bool
	Back           string
}

func (c *Console) serveCalls(w http.ResponseWriter, r *http.Request, s *session) {
	q := r.URL.Query()
	if key := strings.TrimSpace(q.Get(paramKey)); key != "" {
		tenant := strings.TrimSpace(q.Get(projections.ParamTenant))
		if tenant == "" && s.id.Tenant != "*" {
			tenant = s.id.Tenant
		}
		if tenant != "" {
			http.Redirect(w, r, callURL(tenant, key), http.StatusSeeOther)
			return
		}
	}
	now := c.cfg.Now()
	p := callsPage{Form: q, States: states, Back: localPath(r.URL.RequestURI(), "/calls")}
	if key := strings.TrimSpace(q.Get(paramKey)); key != "" {
		p.Searched, p.SearchErr = true, "Name the call's tenant to open it by key."
	} else if params := pick(q, callsParams); len(params) > 0 {
		p.Searched = true
		var br projections.BlastRadius
		if _, err := c.call(r, s, http.MethodGet, pathBlastRadius, params, nil, &br); err != nil {
			p.SearchErr = describe(err)
		} else {
			p.Total, p.Truncated, p.Results = br.Total, br.Truncated, c.callRows(br.Calls, now)
		}
	}

	// The unresolved calls of the tenant the form names, or of every
	// tenant for a platform operator who names none.
	uq := pick(q, []string{projections.ParamTenant, projections.ParamAllTenants, projections.ParamTool})
	if uq.Get(projections.ParamTenant) == "" && s.id.Tenant == "*" {
		uq.Set(projections.ParamAllTenants, "true")
	}
	switch {
	case uq.Get(projections.ParamTenant) != "":
		p.UnresolvedScope = "tenant " + uq.Get(projections.ParamTenant)
	case uq.Get(projections.ParamAllTenants) == "true":
		p.UnresolvedScope = "all tenants"
	default:
		p.UnresolvedScope = "tenant " + s.id.Tenant
	}
	var unresolved []projections.Call
	if _, h, err := c.callHeader(r, s, http.MethodGet, pathUnresolved, uq, nil, &unresolved); err != nil {
		p.UnresolvedErr = describe(err)
	} else {
		p.UnresolvedMore = h.Get(headerLimitReached) == "true"
	}
	p.Unresolved = c.callRows(unresolved, now)
	c.render(w, r, s, "calls", "Calls", p)
}

// eventRow is one event of a timeline.
type eventRow struct {
	ledger.Event
	Latency string
}

type callPage struct {
	Tenant, Key string
	Summary     projections.Call
	State       string
	Events      []eventRow
	Refusals    []eventRow
	// RefusalsCut: the trace holds as many refusals as the projection
	// keeps under a key, the earliest and the latest; those between may
	// be missing, and the log has them all.
	RefusalsCut bool
	Args        []argRow
	ArgsCut     bool
	Result      string
	HasResult   bool
	ResultErr   string
	// ResultNotServed: the call view, the result's only source, is the
	// agents' (ledger api): a result may be held and not be shown here.
	ResultNotServed bool
	CanResolve      bool
	CanCompensate   bool
	ApprovalURL     string
	Back            string
	TraceURL        string
	// ToolDigest is the tool definition the call was admitted under, as
	// its requested event names it, whole (a question matches it whole);
	// ToolDigestURL lists the tenant's calls admitted under it.
	ToolDigest    string
	ToolDigestURL string
}

func (c *Console) serveCall(w http.ResponseWriter, r *http.Request, s *session) {
	tenant, key := r.PathValue("tenant"), r.PathValue("key")
	back := callURL(tenant, key)
	var evs []ledger.Event
	status, h, err := c.callHeader(r, s, http.MethodGet, apiTracePath(tenant, key), nil, nil, &evs)
	if err != nil {
		c.refused(w, r, s, status, "Call "+tenant+"/"+key, err, "/calls")
		return
	}
	p := callPage{Tenant: tenant, Key: key, Back: back, RefusalsCut: h.Get(headerRefusalsLimitReached) == "true"}
	var last *ledger.Event
	for i := range evs {
		e := &evs[i]
		row := eventRow{Event: *e}
		if e.LatencyMS > 0 {
			row.Latency = (time.Duration(e.LatencyMS) * time.Millisecond).String()
		}
		if e.Refusal() {
			p.Refusals = append(p.Refusals, row)
			continue
		}
		p.Events = append(p.Events, row)
		if projections.KnownType(e.Type) {
			// An unknown type moves no call, as in the projections.
			last = e
		}
		if e.Type == statemachine.EventRequested && e.ToolDigest != "" {
			p.ToolDigest = e.ToolDigest
			p.ToolDigestURL = "/calls?" + url.Values{projections.ParamToolDigest: {e.ToolDigest}, projections.ParamTenant: {tenant}}.Encode()
		}
		if e.Type == statemachine.EventRequested && len(e.Arguments) > 0 {
			// They decoded with the event, as JSON: flattening them
			// fails on nothing else.
			p.Args, p.ArgsCut, _ = flattenArgs(e.Arguments)
		}
	}
	if last != nil {
		p.Summary = projections.CallOf(last)
		// The identity fields as the earliest event has them: later
		// events may leave some out.
		for _, e := range p.Events {
			p.Summary.CallID = cmp.Or(p.Summary.CallID, e.CallID)
			p.Summary.TraceID = cmp.Or(p.Summary.TraceID, e.TraceID)
			p.Summary.AgentID = cmp.Or(p.Summary.AgentID, e.AgentID)
			p.Summary.UserID = cmp.Or(p.Summary.UserID, e.UserID)
			p.Summary.Resource = cmp.Or(p.Summary.Resource, e.Resource)
			p.Summary.Tool = cmp.Or(p.Summary.Tool, e.Tool)
		}
		p.State = string(p.Summary.State)
		if p.Summary.TraceID != "" {
			p.TraceURL = "/calls?" + url.Values{projections.ParamTraceID: {p.Summary.TraceID}, projections.ParamTenant: {tenant}}.Encode()
		}
	}
	// The result and the current state, from the agents' call view, once
	// the trace (which an operator of the tenant may read) answered.
	var v callView
	if _, err := c.call(r, s, http.MethodGet, pathCalls+url.PathEscape(key), url.Values{"tenant_id": {tenant}}, nil, &v); err != nil {
		// Not found, or not for staff: `ledger api` serves the view to
		// agents alone (their assertions' audience), and without the
		// result; the trace above is the page.
		ae, ok := errors.AsType[*apiError](err)
		switch {
		case ok && ae.Status == http.StatusUnauthorized:
			// Said of the calls that ran a tool; the others hold none.
			switch statemachine.State(p.State) {
			case statemachine.StateSucceeded, statemachine.StateFailed, statemachine.StateCompensated:
				p.ResultNotServed = true
			}
		case !ok || ae.Status != http.StatusNotFound:
			p.ResultErr = describe(err)
		}
	} else {
		if v.State != "" {
			p.State = v.State
		}
		if len(v.Result) > 0 && string(v.Result) != "null" {
			p.Result, p.HasResult = prettyJSON(v.Result), true
		}
	}
	p.CanResolve = p.State == string(statemachine.StateOutcomeUnknown)
	p.CanCompensate = p.CanResolve || p.State == string(statemachine.StateSucceeded)
	if p.State == string(statemachine.StateApprovalPending) {
		p.ApprovalURL = approvalURL(ledger.CallKey{TenantID: tenant, IdempotencyKey: key}.ApprovalID())
	}
	c.render(w, r, s, "call", "Call "+key, p)
}

// breaker is one tool's breaker state.
type breaker struct {
	Tool, State string
}

type healthPage struct {
	Health    *Health
	HealthErr string
	Breakers  []breaker
	Lag       string
	Freezes   []ledger.ControlAction
	// FrozenTools counts the tools Freezes names: a tool frozen for
	// every tenant and for one is one frozen tool.
	FrozenTools int
	Revocations int
	ControlErr  string
}

func (c *Console) serveHealth(w http.ResponseWriter, r *http.Request, s *session) {
	var p healthPage
	var h Health
	if _, err := c.call(r, s, http.MethodGet, pathHealth, nil, nil, &h); err != nil {
		p.HealthErr = describe(err)
	} else {
		p.Health = &h
		for tool, st := range h.Breakers {
			p.Breakers = append(p.Breakers, breaker{Tool: tool, State: st})
		}
		slices.SortFunc(p.Breakers, func(a, b breaker) int { return strings.Compare(a.Tool, b.Tool) })
		p.Lag = fmtDuration(time.Duration(h.ProjectionLagSeconds * float64(time.Second)))
		if h.ProjectionLagSeconds > 0 && h.ProjectionLagSeconds < 1 {
			p.Lag = "under 1s"
		}
	}
	var snap controlSnapshot
	if _, err := c.call(r, s, http.MethodGet, pathControl, nil, nil, &snap); err != nil {
		p.ControlErr = describe(err)
	} else {
		p.Freezes, p.Revocations = snap.Freezes, len(snap.Revocations)
		tools := make(map[string]bool, len(snap.Freezes))
		for _, a := range snap.Freezes {
			tools[a.Tool] = true
		}
		p.FrozenTools = len(tools)
	}
	c.render(w, r, s, "health", "Health", p)
}
