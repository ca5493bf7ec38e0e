package console

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// incidentParams are the incident form's fields: a blast radius question.
var incidentParams = []string{
	projections.ParamTenant, projections.ParamAllTenants, projections.ParamJTI,
	projections.ParamCredentialFamily, projections.ParamTool, projections.ParamPolicyVersion,
	projections.ParamDecision, projections.ParamRole, projections.ParamApprover, projections.ParamSince, projections.ParamUntil,
}

// maxListed is how many of a blast radius's calls the incident page lists;
// the CSV export has every call the API lists.
const maxListed = 200

// The incident actions, as the confirmation page and its POST name them.
const (
	actFreeze       = "freeze"
	actRevokeJTI    = "revoke_jti"
	actRevokeFamily = "revoke_family"
	actCompensate   = "compensate"
)

// incidentAction is a link to an action's confirmation.
type incidentAction struct {
	Label, URL, Note string
}

type incidentsPage struct {
	Form      url.Values
	Decisions []string
	Asked     bool
	Err       string
	Total     int
	Truncated bool
	Listed    int
	ByTenant  []projections.Count
	ByState   []projections.Count
	// Tenants and States are how many values the counts have, of which
	// ByTenant and ByState list at most projections.MaxCounts.
	Tenants   int
	States    int
	Calls     []callRow
	Histogram *histogram
	HistErr   string
	CSVURL    string
	Actions   []incidentAction
	// ActionsNote says what the actions leave out: more credential
	// families than offered.
	ActionsNote string
	Succeeded   int
}

func (c *Console) serveIncidents(w http.ResponseWriter, r *http.Request, s *session) {
	q := pick(r.URL.Query(), incidentParams)
	p := incidentsPage{Form: r.URL.Query(), Decisions: []string{"allow", "deny", "require_approval"}, Asked: len(q) > 0}
	if !p.Asked {
		c.render(w, r, s, "incidents", "Incidents", p)
		return
	}
	now := c.cfg.Now()
	p.CSVURL = queryString("/incidents.csv", q)
	var br projections.BlastRadius
	if _, err := c.call(r, s, http.MethodGet, pathBlastRadius, q, nil, &br); err != nil {
		p.Err = describe(err)
	} else {
		p.Total, p.Truncated, p.ByTenant, p.ByState = br.Total, br.Truncated, br.ByTenant, br.ByState
		// A server that does not say how many values there are lists
		// them all.
		p.Tenants, p.States = max(br.Distinct.Tenants, len(br.ByTenant)), max(br.Distinct.States, len(br.ByState))
		p.Listed = len(br.Calls)
		listed := br.Calls
		if len(listed) > maxListed {
			listed = listed[:maxListed]
		}
		p.Calls = c.callRows(listed, now)
		p.Succeeded = len(succeeded(br.Calls))
	}
	p.Histogram, p.HistErr = c.outcomes(r, s, q, now)

	link := func(action string) string {
		aq := url.Values{"action": {action}}
		for k, v := range q {
			aq[k] = v
		}
		return queryString("/incidents/confirm", aq)
	}
	if t := q.Get(projections.ParamTool); t != "" {
		p.Actions = append(p.Actions, incidentAction{Label: "Freeze " + t + "…", URL: link(actFreeze), Note: "stop new and not-yet-started calls to the tool"})
	}
	j := q.Get(projections.ParamJTI)
	if j != "" && s.id.Tenant == "*" {
		p.Actions = append(p.Actions, incidentAction{Label: "Revoke credential " + j + "…", URL: link(actRevokeJTI), Note: "for good; tool backends refuse it at introspection"})
	}
	if f := q.Get(projections.ParamCredentialFamily); f != "" {
		p.Actions = append(p.Actions, incidentAction{Label: "Revoke family " + f + "…", URL: link(actRevokeFamily), Note: "every credential issued in the family so far"})
	} else if j != "" && s.id.Tenant != "*" {
		// Only a platform operator revokes a single jti (the control
		// API refuses a tenant's): a tenant's operator revokes the
		// families the credential's calls were sent under.
		families, more := c.familiesOf(r, s, br.Calls, j)
		if more {
			p.ActionsNote = fmt.Sprintf("The credential's calls name more families than the %d offered here, or more calls than the %d read for them: look at the calls' traces, or ask a platform operator to revoke the credential itself.", maxFamiliesOffered, maxTracesRead)
		}
		for _, f := range families {
			aq := url.Values{"action": {actRevokeFamily}, projections.ParamCredentialFamily: {f}}
			for _, k := range []string{projections.ParamTenant, projections.ParamAllTenants} {
				if v, ok := q[k]; ok {
					aq[k] = v
				}
			}
			p.Actions = append(p.Actions, incidentAction{Label: "Revoke family " + f + "…", URL: queryString("/incidents/confirm", aq),
				Note: "a family the credential's calls were sent under (a single credential only a platform operator revokes): every credential issued in it so far"})
		}
	}
	if p.Err == "" && p.Succeeded > 0 {
		p.Actions = append(p.Actions, incidentAction{Label: "Compensate all succeeded calls…", URL: link(actCompensate), Note: strconv.Itoa(p.Succeeded) + " listed call(s) succeeded"})
	}
	c.render(w, r, s, "incidents", "Incidents", p)
}

// maxFamiliesOffered bounds the families the incidents page offers to
// revoke for a credential's calls.
const maxFamiliesOffered = 4

// maxTracesRead bounds the listed calls whose families familiesOf looks
// for, and so the traces it reads: a per-call credential normally
// touches one call.
const maxTracesRead = 2 * maxFamiliesOffered

// familiesOf returns the credential families that the events carrying jti
// name in the first maxTracesRead of calls, each event's own and those it
// names as earlier (EarlierCredentialFamilies: a call taken over across a
// key rotation is sent under one family by its first owner and another by
// the next), in the order first named, at most maxFamiliesOffered; more
// reports that there were more families, or more calls, than that. Each
// call's trace is read: its summary names the credential of its last
// event alone. A trace that cannot be read gives only what the summary
// names, and the page renders without the rest.
func (c *Console) familiesOf(r *http.Request, s *session, calls []projections.Call, jti string) (out []string, more bool) {
	add := func(f string) {
		switch {
		case f == "" || slices.Contains(out, f):
		case len(out) == maxFamiliesOffered:
			more = true
		default:
			out = append(out, f)
		}
	}
	more = len(calls) > maxTracesRead
	for _, cl := range calls[:min(len(calls), maxTracesRead)] {
		var evs []ledger.Event
		if _, err := c.call(r, s, http.MethodGet, apiTracePath(cl.TenantID, cl.IdempotencyKey), nil, nil, &evs); err != nil {
			c.cfg.Logger.Info("incidents page: trace not read, its credential families not offered but the last event's",
				"user", s.id.User, "tenant", s.id.Tenant, "call_tenant", cl.TenantID, "call_key", cl.IdempotencyKey, "err", describe(err))
			if cl.JTI == jti {
				add(cl.CredentialFamily)
			}
			continue
		}
		for _, e := range evs {
			if e.JTI == jti {
				add(e.CredentialFamily)
				for _, f := range e.EarlierCredentialFamilies {
					add(f)
				}
			}
		}
	}
	return out, more
}

// succeeded returns the keys of the succeeded calls among calls.
func succeeded(calls []projections.Call) []ledger.CallKey {
	var keys []ledger.CallKey
	for _, cl := range calls {
		if cl.State == statemachine.StateSucceeded {
			keys = append(keys, cl.Key())
		}
	}
	return keys
}

// keysDigest binds a confirmation to the calls it listed: if the question
// matches other calls by the time it is confirmed, nothing is done.
func keysDigest(keys []ledger.CallKey) string {
	h := sha256.New()
	for _, k := range keys {
		fmt.Fprintf(h, "%d:%s%d:%s", len(k.TenantID), k.TenantID, len(k.IdempotencyKey), k.IdempotencyKey)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// The histogram's geometry, in SVG user units.
const (
	histW, histH = 960, 220
	histLeft     = 52
	histRight    = 12
	histTop      = 12
	histBottom   = 40
	maxBuckets   = 60
)

// bucketSizes are the buckets a histogram may use, smallest first.
var bucketSizes = []time.Duration{
	time.Minute, 5 * time.Minute, 15 * time.Minute, 30 * time.Minute, time.Hour,
	3 * time.Hour, 6 * time.Hour, 12 * time.Hour, 24 * time.Hour, 7 * 24 * time.Hour,
}

// bucketFor is the smallest bucket that covers window in at most
// maxBuckets bars: one of bucketSizes, or, for a window longer than the
// largest covers, as many weeks as it takes. The bars are cut at
// maxBuckets+1, so a bucket too small would leave the window's latest
// part out of the bars and the total.
func bucketFor(window time.Duration) time.Duration {
	for _, b := range bucketSizes {
		if window/b <= maxBuckets {
			return b
		}
	}
	week := bucketSizes[len(bucketSizes)-1]
	return week * ((window + maxBuckets*week - 1) / (maxBuckets * week))
}

// stackOrder is the order of states in a bar, bottom up.
var stackOrder = []string{"succeeded", "compensated", "failed", "outcome_unknown", "denied", "rejected", "expired"}

type histogram struct {
	W, H                       int
	PlotX, PlotY, PlotW, PlotH int
	AxisY                      int
	Bars                       []bar
	YTicks                     []tick
	XTicks                     []tick
	Legend                     []legendItem
	Bucket, From, To           string
	Total                      int
	// Ignores names the parts of the question the outcomes do not
	// narrow (a jti, a policy version, a decision): the bars count every
	// call of the tenants and tool asked, not the matching calls above.
	Ignores string
}

type bar struct {
	X, W  int
	Title string
	Segs  []seg
}

type seg struct {
	Y, H  int
	Class string
}

type tick struct {
	Pos   int
	Label string
}

type legendItem struct {
	Class, State string
	Calls        int
}

// outcomes asks /v1/outcomes over the question's window (the last 24
// hours when it names none) and draws the histogram.
func (c *Console) outcomes(r *http.Request, s *session, q url.Values, now time.Time) (*histogram, string) {
	until, err := projections.ParseTime(q.Get(projections.ParamUntil), now)
	if err != nil {
		return nil, "until: " + err.Error()
	}
	if until.IsZero() {
		until = now.UTC()
	}
	since, err := projections.ParseTime(q.Get(projections.ParamSince), now)
	if err != nil {
		return nil, "since: " + err.Error()
	}
	if since.IsZero() {
		since = until.Add(-24 * time.Hour)
	}
	if !since.Before(until) {
		return nil, "the window is empty: since must be before until"
	}
	bucket := bucketFor(until.Sub(since))
	narrows := []string{projections.ParamTenant, projections.ParamAllTenants, projections.ParamTool, projections.ParamSince, projections.ParamUntil}
	var ignores []string
	for _, k := range incidentParams {
		if !slices.Contains(narrows, k) && q.Get(k) != "" {
			ignores = append(ignores, k)
		}
	}
	oq := pick(q, []string{projections.ParamTenant, projections.ParamAllTenants, projections.ParamTool})
	oq.Set(projections.ParamSince, since.UTC().Format(time.RFC3339))
	oq.Set(projections.ParamUntil, until.UTC().Format(time.RFC3339))
	oq.Set(projections.ParamBucket, bucket.String())
	var counts []projections.OutcomeCount
	if _, err := c.call(r, s, http.MethodGet, pathOutcomes, oq, nil, &counts); err != nil {
		return nil, describe(err)
	}
	h := drawHistogram(counts, since, until, bucket)
	h.Ignores = strings.Join(ignores, ", ")
	return h, ""
}

// drawHistogram lays out stacked bars of outcomes per bucket over
// [since, until). Every label is data, escaped by the template. The
// window starts where its first bucket does, as the counts do
// (projections.CheckOutcomes takes since back to it).
func drawHistogram(counts []projections.OutcomeCount, since, until time.Time, bucket time.Duration) *histogram {
	first := projections.BucketOf(since, bucket)
	h := &histogram{
		W: histW, H: histH,
		PlotX: histLeft, PlotY: histTop,
		PlotW: histW - histLeft - histRight, PlotH: histH - histTop - histBottom,
		Bucket: bucketLabel(bucket), From: fmtTime(first), To: fmtTime(until),
	}
	h.AxisY = h.PlotY + h.PlotH
	n := int(until.Sub(first)/bucket) + 1
	if until.Sub(first)%bucket == 0 {
		n--
	}
	n = max(1, min(n, maxBuckets+1))
	per := make([]map[string]int, n)
	totals := make([]int, n)
	byState := map[string]int{}
	for _, oc := range counts {
		i := int(oc.Bucket.Sub(first) / bucket)
		if i < 0 || i >= n {
			continue
		}
		st := string(oc.State)
		if !slices.Contains(stackOrder, st) {
			st = "other"
		}
		if per[i] == nil {
			per[i] = map[string]int{}
		}
		per[i][st] += oc.Calls
		totals[i] += oc.Calls
		byState[st] += oc.Calls
		h.Total += oc.Calls
	}
	top := 0
	for _, t := range totals {
		top = max(top, t)
	}
	top = niceCeil(top)
	slot := h.PlotW / n
	bw := max(1, slot-max(1, slot/6))
	order := append(append([]string{}, stackOrder...), "other")
	for i := range n {
		start := first.Add(time.Duration(i) * bucket)
		b := bar{X: h.PlotX + i*slot + (slot-bw)/2, W: bw}
		var parts []string
		y := h.AxisY
		for _, st := range order {
			v := per[i][st]
			if v == 0 {
				continue
			}
			ht := v * h.PlotH / top
			if ht == 0 {
				ht = 1
			}
			y -= ht
			b.Segs = append(b.Segs, seg{Y: y, H: ht, Class: stateClass(st)})
			parts = append(parts, fmt.Sprintf("%d %s", v, st))
		}
		if len(parts) == 0 {
			parts = []string{"no outcomes"}
		}
		b.Title = fmtTime(start) + " (" + bucketLabel(bucket) + "): " + strings.Join(parts, ", ")
		h.Bars = append(h.Bars, b)
	}
	for _, v := range []int{0, top / 2, top} {
		h.YTicks = append(h.YTicks, tick{Pos: h.AxisY - v*h.PlotH/top, Label: strconv.Itoa(v)})
	}
	every := max(1, (n+7)/8)
	layout := "15:04"
	switch {
	case bucket >= 24*time.Hour:
		layout = "Jan 2"
	case until.Sub(since) > 24*time.Hour:
		layout = "Jan 2 15:04"
	}
	for i := 0; i < n; i += every {
		h.XTicks = append(h.XTicks, tick{Pos: h.PlotX + i*slot + slot/2, Label: first.Add(time.Duration(i) * bucket).UTC().Format(layout)})
	}
	for _, st := range order {
		if byState[st] > 0 {
			h.Legend = append(h.Legend, legendItem{Class: stateClass(st), State: st, Calls: byState[st]})
		}
	}
	return h
}

// niceCeil rounds n up to 1, 2 or 5 times a power of ten (at least 1), so
// that the axis reads well.
func niceCeil(n int) int {
	if n <= 1 {
		return 1
	}
	// Bounded: p stops growing before it could overflow.
	for p := 1; p <= math.MaxInt/10; p *= 10 {
		for _, m := range []int{1, 2, 5} {
			if m*p >= n {
				return m * p
			}
		}
	}
	return n
}

func (c *Console) serveIncidentsCSV(w http.ResponseWriter, r *http.Request, s *session) {
	q := pick(r.URL.Query(), incidentParams)
	q.Set("format", "csv")
	name := "blast-radius-" + c.cfg.Now().UTC().Format("20060102T150405Z")
	err := c.stream(w, r, s, pathBlastRadius, q, func(api, h http.Header) {
		// An export cut at the API's limit says so where it goes: in
		// its name, and in the API's headers passed on. The file alone
		// would pass for the whole list.
		if api.Get(httpapi.HeaderTruncated) == "true" {
			h.Set(httpapi.HeaderTruncated, "true")
			if total, err := strconv.Atoi(api.Get(httpapi.HeaderTotalCount)); err == nil {
				h.Set(httpapi.HeaderTotalCount, strconv.Itoa(total))
				name += "-cut-of-" + strconv.Itoa(total)
			}
		}
		h.Set("Content-Type", "text/csv; charset=utf-8")
		h.Set("Content-Disposition", `attachment; filename="`+name+`.csv"`)
	})
	if err != nil {
		status := http.StatusBadGateway
		if ae, ok := errors.AsType[*apiError](err); ok && ae.Status >= 400 {
			status = ae.Status
		}
		q.Del("format")
		c.renderStatus(w, r, s, status, "message", "CSV export", messagePage{
			Heading: "CSV export: the ledger refused",
			Text:    describe(err),
			Back:    queryString("/incidents", q),
		})
	}
	c.logAction(s, "export_csv", q.Encode(), err)
}

// scopeOf names the tenants a question covers.
func scopeOf(q url.Values, s *session) string {
	switch {
	case q.Get(projections.ParamTenant) != "":
		return "tenant " + q.Get(projections.ParamTenant)
	case q.Get(projections.ParamAllTenants) == "true":
		return "all tenants"
	case s.id.Tenant == "*":
		return "no tenant named"
	}
	return "your tenant (" + s.id.Tenant + ")"
}

func (c *Console) serveConfirm(w http.ResponseWriter, r *http.Request, s *session) {
	query := r.URL.Query()
	action := query.Get("action")
	q := pick(query, incidentParams)
	back := queryString("/incidents", q)
	q = fixWindow(q, action, c.cfg.Now())
	p := confirmPage{Action: "/incidents/act", Cancel: back, Hidden: []hidden{{"action", action}}}
	for _, k := range incidentParams {
		if v := q.Get(k); v != "" {
			p.Hidden = append(p.Hidden, hidden{k, v})
		}
	}
	// A freeze or a revocation acts on everything of the tool or the
	// credential in scope, whatever else the question narrowed: count
	// that, not the question.
	countQ := q
	switch action {
	case actFreeze:
		countQ = pick(q, []string{projections.ParamTool, projections.ParamTenant, projections.ParamAllTenants})
	case actRevokeJTI:
		countQ = pick(q, []string{projections.ParamJTI, projections.ParamTenant, projections.ParamAllTenants})
	case actRevokeFamily:
		countQ = pick(q, []string{projections.ParamCredentialFamily, projections.ParamTenant, projections.ParamAllTenants})
	}
	var br projections.BlastRadius
	countErr := ""
	if _, err := c.call(r, s, http.MethodGet, pathBlastRadius, countQ, nil, &br); err != nil {
		countErr = describe(err)
		p.Err = "The question could not be counted, so nothing can be confirmed: " + countErr
	} else {
		p.Counted, p.Count = true, br.Total
	}
	// A freeze and a revocation are the incident's brakes: they are
	// offered though the count failed (the busiest tool's count is the
	// likeliest to), for they act whatever it would have said.
	brake := func(what string) {
		if !p.Counted {
			p.Err = "The calls could not be counted (" + countErr + "); the " + what + " does not depend on the count and can still be confirmed."
		}
	}
	scope := scopeOf(q, s)
	status := http.StatusOK
	switch action {
	case actFreeze:
		tool := q.Get(projections.ParamTool)
		freezeScope := "every tenant"
		switch t := q.Get(projections.ParamTenant); {
		case t != "":
			freezeScope = "tenant " + t
		case s.id.Tenant != "*":
			// A tenant operator's freeze is of its own tenant, all
			// tenants asked or not (the control API takes it so).
			freezeScope = "your tenant (" + s.id.Tenant + ")"
		}
		p.Heading, p.Submit, p.Reason = "Freeze "+tool, "Freeze "+tool, "Why freeze it"
		p.Lines = []string{
			"The intake will deny new calls to " + tool + " for " + freezeScope + ", and the executor will deny authorized calls not yet started.",
			"Calls already running are not stopped. An unfreeze (from the Health page) lifts it.",
		}
		p.CountNote = "calls to " + tool + " so far in " + scope + ", at any time and whatever else the question named: the freeze stops every call to it from now on."
		p.Ready = tool != ""
		brake("freeze")
	case actRevokeJTI, actRevokeFamily:
		what, v := "credential", q.Get(projections.ParamJTI)
		if action == actRevokeFamily {
			what, v = "credential family", q.Get(projections.ParamCredentialFamily)
		}
		p.Heading, p.Submit, p.Reason = "Revoke "+what+" "+v, "Revoke "+what, "Why revoke it"
		p.Lines = []string{
			"The " + what + " " + v + " is revoked for good: the executor stops using it and tool backends refuse it at introspection. There is no un-revoke.",
		}
		p.CountNote = "calls carry it in " + scope + ", at any time and whatever else the question named."
		p.Ready = v != ""
		if action == actRevokeJTI && s.id.Tenant != "*" {
			// The control API refuses it: say so, and offer nothing.
			p.Lines = []string{"Only a platform operator revokes a single credential. Revoke the family it was issued in instead: the incidents page offers the families of its calls."}
			p.Ready = false
			break
		}
		brake("revocation")
	case actCompensate:
		p.Heading, p.Submit, p.Reason = "Compensate every succeeded call", "Compensate them", "Why undo them"
		keys := succeeded(br.Calls)
		p.Count = len(keys)
		p.CountNote = "succeeded call(s) will each get a compensation request (POST /v1/compensations), run as a ledger call of its own through the intake's checks."
		p.Lines = []string{
			fmt.Sprintf("The question matches %d call(s) in %s; the compensations go to the succeeded ones listed below.", br.Total, scope),
		}
		if br.Truncated {
			p.Lines = append(p.Lines, fmt.Sprintf("The answer lists only %d of the %d matching calls: narrow the question to reach the others.", len(br.Calls), br.Total))
		}
		p.Calls = c.callRows(pickSucceeded(br.Calls), c.cfg.Now())
		p.Hidden = append(p.Hidden, hidden{"digest", keysDigest(keys)})
		p.Ready = p.Counted && len(keys) > 0
	default:
		p.Heading, p.Err = "Unknown action", "There is no incident action "+strconv.Quote(action)+"."
		status = http.StatusBadRequest
	}
	c.renderStatus(w, r, s, status, "confirm", p.Heading, p)
}

// fixWindow is q with its window as times: a since or until given as a
// duration before now is the time it names now, so that what the action
// asks again is the window confirmed (the compensate-all digest binds the
// calls it matched: asked again a minute later, "24h" has moved on, shed
// the calls of its first minute, and the action would be refused on
// every try). A compensation's window without an end ends now: the calls
// that succeed after the confirmation are not the ones confirmed. A value
// that is neither is left for the API to refuse.
func fixWindow(q url.Values, action string, now time.Time) url.Values {
	out := url.Values{}
	for k, v := range q {
		out[k] = v
	}
	for _, k := range []string{projections.ParamSince, projections.ParamUntil} {
		if v := out.Get(k); v != "" {
			if t, err := projections.ParseTime(v, now); err == nil {
				out.Set(k, t.Format(time.RFC3339Nano))
			}
		}
	}
	if action == actCompensate && out.Get(projections.ParamUntil) == "" {
		out.Set(projections.ParamUntil, now.UTC().Format(time.RFC3339Nano))
	}
	return out
}

func pickSucceeded(calls []projections.Call) []projections.Call {
	var out []projections.Call
	for _, cl := range calls {
		if cl.State == statemachine.StateSucceeded {
			out = append(out, cl)
		}
	}
	return out
}

// maxRefusalsShown bounds the refusals a compensate-all flash names.
const maxRefusalsShown = 3

func (c *Console) postIncidentAction(w http.ResponseWriter, r *http.Request, s *session) {
	f := r.PostForm
	q := pick(f, incidentParams)
	back := queryString("/incidents", q)
	reason := f.Get("reason")
	switch action := f.Get("action"); action {
	case actFreeze:
		body := freezeBody{toolBody: toolBody{Tool: q.Get(projections.ParamTool), Tenant: q.Get(projections.ParamTenant), Reason: reason}}
		a, status, err := c.freeze(r, s, &body)
		c.logAction(s, "freeze", body.Tool, err)
		if err != nil {
			c.redirect(w, r, s, back, refusedFlash(s, "the freeze of "+body.Tool, err))
			return
		}
		// The scope as the API applied it: a tenant operator's freeze is
		// always for their own tenant.
		text := fmt.Sprintf("%s froze %s%s%s.", s.id.User, body.Tool, freezeScopeText(a.Tenant), applied(status))
		if body.AllowUnknownTool {
			text += " The control service's tool registry does not hold " + body.Tool + ", whose calls the intake took: the reconciler's registry is behind the intake's."
		}
		c.redirect(w, r, s, back, flash{OK: true, Text: text})
	case actRevokeJTI, actRevokeFamily:
		body := revokeBody{JTI: q.Get(projections.ParamJTI), Reason: reason}
		what := "credential " + body.JTI
		if action == actRevokeFamily {
			body = revokeBody{Family: q.Get(projections.ParamCredentialFamily), Reason: reason}
			what = "credential family " + body.Family
		}
		status, err := c.call(r, s, http.MethodPost, pathControl+"/revoke", nil, body, nil)
		c.logAction(s, action, what, err)
		if err != nil {
			c.redirect(w, r, s, back, refusedFlash(s, "the revocation of "+what, err))
			return
		}
		c.redirect(w, r, s, back, flash{OK: true, Text: fmt.Sprintf("%s revoked %s%s.", s.id.User, what, applied(status))})
	case actCompensate:
		c.compensateAll(w, r, s, q, reason, f.Get("digest"))
	default:
		c.redirect(w, r, s, back, flash{Text: "There is no incident action " + strconv.Quote(action) + "; nothing was done."})
	}
}

// codeUnknownTool is the control API's refusal of a freeze of a tool its
// registry does not hold (control.CodeUnknownTool).
const codeUnknownTool = "unknown_tool"

// freeze asks the control API for body's freeze. The API refuses a tool
// its registry does not hold (unknown_tool), for a mistyped name would
// freeze nothing, and the incident form's tool is typed. But the registry
// it checks, the reconciler's, can lag the intake's (a tool rolled out to
// the intake and the executors first), and a tool whose calls the intake
// took is no typo: its freeze is asked again, saying so
// (allow_unknown_tool, set in body). A tool no call of which was taken
// keeps the check.
func (c *Console) freeze(r *http.Request, s *session, body *freezeBody) (ledger.ControlAction, int, error) {
	var a ledger.ControlAction
	status, err := c.call(r, s, http.MethodPost, pathControl+"/freeze", nil, body, &a)
	ae, ok := errors.AsType[*apiError](err)
	if !ok || ae.Code != codeUnknownTool {
		return a, status, err
	}
	taken, lookErr := c.toolTaken(r, s, body.Tool)
	if lookErr != nil {
		ref := *ae
		ref.Message += "; whether the intake took calls to " + body.Tool + " (which would freeze it anyway) could not be read: " + describe(lookErr)
		return a, status, &ref
	}
	if !taken {
		return a, status, err
	}
	body.AllowUnknownTool = true
	status, err = c.call(r, s, http.MethodPost, pathControl+"/freeze", nil, body, &a)
	return a, status, err
}

// toolTaken reports whether the projection holds a call to tool that the
// intake took, in any tenant the session may ask about: one in a state
// other than denied, the only state of a call to a tool the intake's
// registry does not hold.
func (c *Console) toolTaken(r *http.Request, s *session, tool string) (bool, error) {
	q := url.Values{projections.ParamTool: {tool}, projections.ParamLimit: {"1"}}
	if s.id.Tenant == "*" {
		// A platform operator's tool is one whatever tenant called it;
		// a tenant operator's question is of its own tenant.
		q.Set(projections.ParamAllTenants, "true")
	}
	var br projections.BlastRadius
	if _, err := c.call(r, s, http.MethodGet, pathBlastRadius, q, nil, &br); err != nil {
		return false, err
	}
	return slices.ContainsFunc(br.ByState, func(n projections.Count) bool {
		return n.Value != string(statemachine.StateDenied) && n.Calls > 0
	}), nil
}

// DefaultCompensateAllBound is Config.CompensateAllBound's default.
const DefaultCompensateAllBound = 15 * time.Minute

// compensateAll asks a compensation for every succeeded call the question
// lists now, provided they are the calls the person confirmed.
func (c *Console) compensateAll(w http.ResponseWriter, r *http.Request, s *session, q url.Values, reason, digest string) {
	back := queryString("/incidents", q)
	var br projections.BlastRadius
	if _, err := c.call(r, s, http.MethodGet, pathBlastRadius, q, nil, &br); err != nil {
		c.redirect(w, r, s, back, refusedFlash(s, "counting the calls to compensate", err))
		return
	}
	keys := succeeded(br.Calls)
	if subtle.ConstantTimeCompare([]byte(keysDigest(keys)), []byte(digest)) != 1 {
		aq := url.Values{"action": {actCompensate}}
		for k, v := range q {
			aq[k] = v
		}
		c.redirect(w, r, s, queryString("/incidents/confirm", aq), flash{Text: fmt.Sprintf("The question now matches other succeeded calls (%d) than those you confirmed; nothing was done. Review them and confirm again.", len(keys))})
		return
	}
	// Confirmed: carried out whole, whatever the browser does meanwhile
	// (a proxy's idle timeout, a tab closed), within a bound. A thousand
	// requests can take minutes, and each one after the connection went
	// was failed at once, reported as sent.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), c.cfg.CompensateAllBound)
	defer cancel()
	r = r.WithContext(ctx)
	var ok, unsent int
	var ended bool // the session's assertion ended meanwhile
	var refusals, unknown []string
	for i, k := range keys {
		if ctx.Err() != nil {
			// Past the bound a request would fail before it left, and
			// be counted as sent, maybe asked.
			unsent = len(keys) - i
			c.cfg.Logger.Warn("compensate-all ran out of its time; the rest not sent",
				"user", s.id.User, "bound", c.cfg.CompensateAllBound, "not_sent", unsent)
			break
		}
		if _, err := c.compensate(r, s, k, reason); err != nil {
			if errors.Is(err, errActionBrokenOff) {
				// Sent, and maybe taken: not a refusal.
				unknown = append(unknown, k.String())
				continue
			}
			refusals = append(refusals, k.String()+": "+describe(err))
			if ae, isAPI := errors.AsType[*apiError](err); isAPI && ae.Status == http.StatusUnauthorized {
				// The assertion ended: every other request would be
				// refused alike, and is not sent.
				ended, unsent = true, len(keys)-i-1
				break
			}
			continue
		}
		ok++
	}
	text := fmt.Sprintf("%s asked to compensate %d of %d succeeded call(s).", s.id.User, ok, len(keys))
	if len(unknown) > 0 {
		shown := unknown[:min(len(unknown), maxRefusalsShown)]
		text += fmt.Sprintf(" %d sent, their answers broken off, so maybe asked: %s", len(unknown), strings.Join(shown, "; "))
		if len(unknown) > len(shown) {
			text += "; …"
		}
		text += "."
	}
	if len(refusals) > 0 {
		shown := refusals[:min(len(refusals), maxRefusalsShown)]
		text += fmt.Sprintf(" %d refused: %s", len(refusals), strings.Join(shown, "; "))
		if len(refusals) > len(shown) {
			text += "; …"
		}
	}
	switch {
	case unsent > 0 && ended:
		text += fmt.Sprintf(" %d not sent: your session's assertion ended; sign in again and compensate them again (those asked already are not asked twice).", unsent)
	case unsent > 0:
		text += fmt.Sprintf(" %d not sent: the %s this may take ran out; compensate them again.", unsent, c.cfg.CompensateAllBound)
	}
	// The whole report, for the log too: the page that shows it may
	// never be seen (the session ended, the browser went).
	c.cfg.Logger.Info("compensate-all done", "user", s.id.User, "tenant", s.id.Tenant, "calls", len(keys), "asked", ok,
		"refused", len(refusals), "maybe_asked", len(unknown), "not_sent", unsent, "session_ended", ended)
	c.redirect(w, r, s, back, flash{OK: len(refusals) == 0 && len(unknown) == 0 && unsent == 0, Text: text})
}
