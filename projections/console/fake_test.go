package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Hostile strings an agent, a tool or a tenant could put in any field.
const (
	xssScript = `<script>alert(1)</script>`
	xssAttr   = `"><img src=x onerror=alert(1)>`
	xssURL    = `javascript:alert(1)`
)

// The assertions the fake verifier knows.
const (
	assertOperator = "assert-operator"
	assertApprover = "assert-approver"
	assertPlatform = "assert-platform"
	assertViewer   = "assert-viewer"
	assertNoRoles  = "assert-noroles"
	assertNoExpiry = "assert-noexpiry"
	assertDev      = "assert-dev"
	// One the verifier cannot judge now (ErrTryLater).
	assertKeysBehind = "assert-keys-behind"
	// Valid past the others' hour: a sign-in after theirs ended.
	assertOperatorLater = "assert-operator-later"
	assertOtherLater    = "assert-other-later"
)

// t0 is the tests' now.
var t0 = time.Date(2026, 11, 30, 14, 0, 0, 0, time.UTC)

// apiReq is one request the fake API received.
type apiReq struct {
	Method string
	Path   string // escaped
	Query  url.Values
	Auth   string
	Body   string
}

// fakeAPI plays the JSON the ledger's handlers answer (shapes copied from
// processors/approvals, processors/control, processors/compensation,
// processors/executor's resolutions, projections/httpapi), with hostile
// strings in every field a person reads. It records every request.
type fakeAPI struct {
	mu   sync.Mutex
	reqs []apiReq
	mux  *http.ServeMux
	// refuse maps "METHOD path" to a refusal the API answers instead.
	refuse map[string]refusalSpec
	// blast is the blast radius's answer; tests may change it.
	blast projections.BlastRadius
	// lagUnknown: /v1/health could not read the projection's lag.
	lagUnknown bool
	// breakersUnknown: /v1/health is ledger api's, which holds no
	// breakers.
	breakersUnknown bool
	// afterCompensation, if set, runs after each compensation asked.
	afterCompensation func()
	// approvalsMore: the pending list stops at the service's bound.
	approvalsMore bool
	// deniedCompensations maps a call's idempotency key to the refusal
	// the intake answers its compensation with (a 200, as the API does).
	deniedCompensations map[string]ledger.Event
	// traces are the traces of calls besides keyHostile's and
	// keyUnknown's; tests may add them.
	traces map[ledger.CallKey][]ledger.Event
	// tools is the control service's tool registry: as the control
	// API, a freeze of another tool is refused unknown_tool unless its
	// body says allow_unknown_tool. Tests may change it.
	tools map[string]bool
}

type refusalSpec struct {
	status        int
	code, message string
	// abort: the answer breaks off after its first bytes, as a reverse
	// proxy's does when the service behind it stops mid-answer.
	abort bool
}

func (f *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	f.mu.Lock()
	f.reqs = append(f.reqs, apiReq{Method: r.Method, Path: r.URL.EscapedPath(), Query: r.URL.Query(), Auth: r.Header.Get("Authorization"), Body: string(body)})
	ref, refused := f.refuse[r.Method+" "+r.URL.Path]
	f.mu.Unlock()
	r.Body = io.NopCloser(strings.NewReader(string(body)))
	if r.Context().Err() != nil {
		// As ledger api's proxy answers once its client went away.
		apiErr(w, http.StatusBadGateway, httpjson.CodeUpstreamUnavailable, "the request was cancelled")
		return
	}
	switch r.Header.Get("Authorization") {
	case "Bearer " + assertOperator, "Bearer " + assertApprover, "Bearer " + assertPlatform, "Bearer " + assertDev:
	default:
		apiErr(w, http.StatusUnauthorized, "unauthenticated", "an operator assertion is required as Authorization: Bearer")
		return
	}
	if refused && ref.abort {
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(`{"approvals": [`))
		panic(http.ErrAbortHandler)
	}
	if refused {
		apiErr(w, ref.status, ref.code, ref.message)
		return
	}
	f.mux.ServeHTTP(w, r)
}

// requests returns the requests received so far.
func (f *fakeAPI) requests() []apiReq {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]apiReq(nil), f.reqs...)
}

func (f *fakeAPI) reset() {
	f.mu.Lock()
	f.reqs = nil
	f.mu.Unlock()
}

func apiErr(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]map[string]string{"error": {"code": code, "message": msg}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// Keys of the calls the fake API knows.
var (
	keyPending  = ledger.CallKey{TenantID: "acme", IdempotencyKey: "order-1"}
	keyHostile  = ledger.CallKey{TenantID: xssScript, IdempotencyKey: xssAttr}
	keyRejected = ledger.CallKey{TenantID: "acme", IdempotencyKey: "order-2"}
	keyExpired  = ledger.CallKey{TenantID: "acme", IdempotencyKey: "order-3"}
	// keyLapsed was approved, and its call denied: the approval lapsed
	// before the call's request could leave.
	keyLapsed  = ledger.CallKey{TenantID: "acme", IdempotencyKey: "order-lapsed"}
	keyOK1     = ledger.CallKey{TenantID: "acme", IdempotencyKey: "refund-1"}
	keyOK2     = ledger.CallKey{TenantID: "acme", IdempotencyKey: "refund-2"}
	keyFailed  = ledger.CallKey{TenantID: "acme", IdempotencyKey: "refund-3"}
	keyUnknown = ledger.CallKey{TenantID: "acme", IdempotencyKey: "refund-4"}
	// Pending approvals whose arguments the page cannot show whole.
	keyWideArgs = ledger.CallKey{TenantID: "acme", IdempotencyKey: "order-wide"}
	keyNoArgs   = ledger.CallKey{TenantID: "acme", IdempotencyKey: "order-none"}
	// keyBidiArgs's arguments hold characters that do not show as they
	// are: a direction override and a zero-width space.
	keyBidiArgs = ledger.CallKey{TenantID: "acme", IdempotencyKey: "order-bidi"}
	hashPending = "sha256:5f2b9c0e4b1d2a3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4"
)

// approvalJSON renders an approval as processors/approvals.Approval
// marshals it.
func approvalJSON(k ledger.CallKey, state, decidedBy string, decidedAt *time.Time, reason string) map[string]any {
	a := map[string]any{
		"id":              k.ApprovalID(),
		"tenant_id":       k.TenantID,
		"idempotency_key": k.IdempotencyKey,
		"call_id":         "call_" + xssAttr,
		"tool":            "refund_order",
		"tool_version":    1,
		"requester":       map[string]any{"user": "bob", "agent": xssScript},
		"arguments_hash":  hashPending,
		"policy_version":  "pv-7",
		"policy_ids":      []string{"refunds-over-40", xssAttr},
		"requested_at":    t0.Add(-5 * time.Minute),
		"expires_at":      t0.Add(10 * time.Minute),
		"state":           state,
		"preview": map[string]any{
			"tool":         "refund_order",
			"description":  "Refund an order " + xssScript,
			"effect":       "write",
			"risk":         "high",
			"resource":     xssURL,
			"arguments":    json.RawMessage(`{"order_id":"ord_42","amount_cents":4500,"currency":"AUD","card_number":"[redacted]","note":"` + strings.ReplaceAll(xssAttr, `"`, `\"`) + `","link":"javascript:alert(1)","nested":{"x":"<script>alert(1)</script>"}}`),
			"amount":       "45.00 AUD",
			"compensation": "cancel_refund v1 " + xssScript,
		},
	}
	if state == "pending" {
		// Decided with the requester's roles (--policy-roles); the
		// others without.
		a["requester"] = map[string]any{"user": "bob", "agent": xssScript, "roles": []string{"finance", xssScript}, "roles_given": true}
	}
	if decidedBy != "" {
		a["decided_by"] = decidedBy
	}
	if decidedAt != nil {
		a["decided_at"] = *decidedAt
	}
	if reason != "" {
		a["reason"] = reason
	}
	return a
}

func callOf(k ledger.CallKey, state statemachine.State, at time.Time) projections.Call {
	return projections.Call{
		TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey, CallID: "call-\u202e" + k.IdempotencyKey,
		Tool: "refund_order", ToolVersion: 1, AgentID: xssScript, UserID: "bob", Resource: xssURL,
		TraceID: "trace-1", State: state, LastEvent: statemachine.EventType(state), Seq: 5, UpdatedAt: at,
		PolicyVersion: "pv-7", JTI: "jti-1", CredentialFamily: "refund_order:acme:1", Reason: xssAttr,
	}
}

// testToolDigest is the tool definition the fake's traced calls were
// admitted under.
const testToolDigest = "sha256:ee73feadf9785bb74043d9d7feab3b832debf6925884d394230384e60fdcdaf5"

// traceEvents is the trace of keyHostile: every field hostile.
func traceEvents(k ledger.CallKey) []ledger.Event {
	ev := func(seq int64, typ statemachine.EventType, at time.Time) ledger.Event {
		return ledger.Event{
			V: 1, EventID: fmt.Sprintf("ev-%d", seq), Type: typ, Seq: seq, At: at, Actor: "executor",
			TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey, CallID: "call-" + xssScript,
			UserID: "bob", AgentID: xssAttr, Tool: "refund_order", ToolVersion: 1, Resource: xssURL, TraceID: xssScript,
			ToolDigest: testToolDigest,
		}
	}
	refused := ev(0, statemachine.EventDenied, t0.Add(-11*time.Minute))
	refused.Reason, refused.Detail = "key_reused", xssScript
	req := ev(1, statemachine.EventRequested, t0.Add(-10*time.Minute))
	req.Arguments = json.RawMessage(`{"order_id":"` + strings.ReplaceAll(xssAttr, `"`, `\"`) + `","secret":"[redacted]"}`)
	auth := ev(2, statemachine.EventAuthorized, t0.Add(-10*time.Minute+time.Second))
	auth.PolicyVersion, auth.Decision = "pv-7 "+xssScript, "allow"
	exe := ev(3, statemachine.EventExecuting, t0.Add(-9*time.Minute))
	exe.JTI, exe.Attempt = "jti-"+xssAttr, 2
	ok := ev(4, statemachine.EventSucceeded, t0.Add(-8*time.Minute))
	ok.LatencyMS, ok.Reason, ok.Detail, ok.Approver = 1234, xssAttr, xssURL, "carol "+xssScript
	return []ledger.Event{refused, req, auth, exe, ok}
}

func newFakeAPI() *fakeAPI {
	f := &fakeAPI{mux: http.NewServeMux(), refuse: map[string]refusalSpec{}, deniedCompensations: map[string]ledger.Event{
		"refund-frozen": {V: 1, Type: statemachine.EventDenied, Reason: "tool_frozen", Detail: "cancel_refund is frozen for tenant acme by olga: incident 12"},
	}, tools: map[string]bool{"refund_order": true, "lookup_order": true, "export_data": true, "cancel_refund": true}}
	decided := t0.Add(-time.Hour)
	expired := t0.Add(-2 * time.Hour)
	approvals := map[string]map[string]any{
		keyPending.ApprovalID():  approvalJSON(keyPending, "pending", "", nil, ""),
		keyHostile.ApprovalID():  approvalJSON(keyHostile, "pending", "", nil, ""),
		keyRejected.ApprovalID(): approvalJSON(keyRejected, "rejected", xssAttr, &decided, xssScript),
		keyExpired.ApprovalID():  approvalJSON(keyExpired, "expired", "", &expired, "approval_expired"),
	}
	lapsed := approvalJSON(keyLapsed, "approved", "carol", &decided, "")
	lapsed["call_status"], lapsed["call_reason"] = "denied", "approval_expired"
	approvals[keyLapsed.ApprovalID()] = lapsed
	// More fields than the page lists, the last one past its bound.
	wide := make([]string, maxArgRows+1)
	for i := range wide {
		wide[i] = `"x"`
	}
	for k, args := range map[ledger.CallKey]json.RawMessage{
		keyWideArgs: json.RawMessage(`{"items":[` + strings.Join(wide, ",") + `],"z_amount_cents":999999}`),
		keyNoArgs:   nil,
		keyBidiArgs: json.RawMessage(`{"destination_account":"\u202e4321-8765","note\u200b":"ok","rtl_account":"\u0639 4321-8765"}`),
	} {
		a := approvalJSON(k, "pending", "", nil, "")
		preview := a["preview"].(map[string]any)
		if k == keyBidiArgs {
			preview["resource"] = "acct_\u202e4321"
			preview["amount"] = "\u0639 45.00"
		}
		if args == nil {
			delete(preview, "arguments")
		} else {
			preview["arguments"] = args
		}
		approvals[k.ApprovalID()] = a
	}
	f.blast = projections.BlastRadius{
		Total: 4,
		Calls: []projections.Call{
			callOf(keyOK1, statemachine.StateSucceeded, t0.Add(-time.Minute)),
			callOf(keyHostile, statemachine.StateSucceeded, t0.Add(-2*time.Minute)),
			callOf(keyFailed, statemachine.StateFailed, t0.Add(-3*time.Minute)),
			callOf(keyOK2, statemachine.StateSucceeded, t0.Add(-4*time.Minute)),
		},
		ByTenant: []projections.Count{{Value: "acme", Calls: 3}, {Value: xssScript, Calls: 1}},
		ByState:  []projections.Count{{Value: "succeeded", Calls: 3}, {Value: xssAttr, Calls: 1}},
		ByTool:   []projections.Count{{Value: "refund_order", Calls: 4}},
		// More tenants than the answer lists: the page says so.
		Distinct: projections.Distinct{Tenants: 1500, States: 2, Tools: 1},
	}
	m := f.mux
	m.HandleFunc("GET /v1/approvals", func(w http.ResponseWriter, r *http.Request) {
		state := r.URL.Query().Get("state")
		out := []map[string]any{}
		for _, k := range []ledger.CallKey{keyPending, keyHostile, keyBidiArgs, keyRejected, keyExpired} {
			if a := approvals[k.ApprovalID()]; a["state"] == state {
				out = append(out, a)
			}
		}
		f.mu.Lock()
		more := f.approvalsMore
		f.mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{"approvals": out, "more": more && state == "pending"})
	})
	m.HandleFunc("GET /v1/approvals/{id}", func(w http.ResponseWriter, r *http.Request) {
		a, ok := approvals[r.PathValue("id")]
		if !ok {
			apiErr(w, http.StatusNotFound, "not_found", "no approval under this id in your tenant")
			return
		}
		writeJSON(w, http.StatusOK, a)
	})
	m.HandleFunc("POST /v1/approvals/{id}/approve", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			ArgumentsHash string `json:"arguments_hash"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		a, ok := approvals[r.PathValue("id")]
		switch {
		case !ok:
			apiErr(w, http.StatusNotFound, "not_found", "no approval under this id in your tenant")
		case body.ArgumentsHash != a["arguments_hash"]:
			apiErr(w, http.StatusConflict, "hash_mismatch", "arguments_hash is not the hash of the call's arguments; read the approval again")
		default:
			out := maps(a)
			out["state"] = "approved"
			writeJSON(w, http.StatusOK, out)
		}
	})
	m.HandleFunc("POST /v1/approvals/{id}/reject", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Reason string `json:"reason"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		a, ok := approvals[r.PathValue("id")]
		switch {
		case !ok:
			apiErr(w, http.StatusNotFound, "not_found", "no approval under this id in your tenant")
		case strings.TrimSpace(body.Reason) == "":
			apiErr(w, http.StatusBadRequest, "invalid_request", "approvals: invalid request: a rejection needs a reason")
		default:
			out := maps(a)
			out["state"], out["reason"] = "rejected", body.Reason
			writeJSON(w, http.StatusOK, out)
		}
	})
	m.HandleFunc("GET /v1/control", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{
			"freezes": []ledger.ControlAction{
				{V: 1, Kind: "freeze", Subject: "tool:" + xssScript, Tool: xssScript, By: xssAttr, ByTenant: "*", Reason: xssURL, At: t0.Add(-time.Hour)},
				{V: 1, Kind: "freeze", Subject: "tool:refund_order@acme", Tool: "refund_order", Tenant: "acme", By: "olga", ByTenant: "acme", Reason: "incident 12", At: t0.Add(-30 * time.Minute)},
				{V: 1, Kind: "freeze", Subject: "tool:lookup_order@acme", Tool: "lookup_order", Tenant: "acme", By: "root", ByTenant: "*", Reason: "incident 13", At: t0.Add(-20 * time.Minute),
					Replaced: &ledger.ControlAction{V: 1, Kind: "freeze", Subject: "tool:lookup_order@acme", Tool: "lookup_order", Tenant: "acme", By: "olga", ByTenant: "acme", Reason: "our loop", At: t0.Add(-2 * time.Hour)}},
				// Every tenant's, as the control API shows it to a tenant
				// operator: without who or why.
				{V: 1, Kind: "freeze", Subject: "tool:export_data", Tool: "export_data", ByTenant: "*", At: t0.Add(-10 * time.Minute)},
				// And the tenant's own, under it.
				{V: 1, Kind: "freeze", Subject: "tool:export_data@acme", Tool: "export_data", Tenant: "acme", By: "olga", ByTenant: "acme", Reason: "our export loop", At: t0.Add(-5 * time.Minute)},
			},
			"revocations": []ledger.ControlAction{{V: 1, Kind: "revoke", Subject: "jti:j1", JTI: "j1", By: "olga", Reason: "leak", At: t0}},
		})
	})
	control := func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var a ledger.ControlAction
		_ = json.Unmarshal(body, &a)
		var freeze struct {
			AllowUnknownTool bool `json:"allow_unknown_tool"`
		}
		_ = json.Unmarshal(body, &freeze)
		if strings.TrimSpace(a.Reason) == "" {
			apiErr(w, http.StatusBadRequest, "invalid_request", "control: invalid request: a reason is required")
			return
		}
		f.mu.Lock()
		known := f.tools[a.Tool]
		f.mu.Unlock()
		if strings.HasSuffix(r.URL.Path, "/freeze") && !known && !freeze.AllowUnknownTool {
			apiErr(w, http.StatusBadRequest, "unknown_tool", fmt.Sprintf("control: unknown tool: no tool %q in this control service's tool registry (its --registry-dir): check the name; to freeze a tool only newer executors know, say so (allow_unknown_tool, --unknown-tool)", a.Tool))
			return
		}
		if a.JTI != "" && r.Header.Get("Authorization") != "Bearer "+assertPlatform {
			// As the control API: a jti is not a tenant's to revoke.
			apiErr(w, http.StatusForbidden, "forbidden", "control: forbidden: only a platform operator may revoke a single jti; revoke the family instead")
			return
		}
		if a.Tool != "" && a.Tenant == "" && r.Header.Get("Authorization") == "Bearer "+assertOperator {
			// A tenant operator's freeze is for their own tenant.
			a.Tenant = "acme"
		}
		a.V, a.By, a.At = 1, "olga", t0
		if strings.HasSuffix(r.URL.Path, "/unfreeze") && a.Tool == "lookup_order" {
			a.Restored = &ledger.ControlAction{V: 1, Kind: "freeze", Tool: "lookup_order", Tenant: "acme", By: "olga", ByTenant: "acme", Reason: "our loop", At: t0.Add(-2 * time.Hour)}
		}
		writeJSON(w, http.StatusOK, a)
	}
	m.HandleFunc("POST /v1/control/freeze", control)
	m.HandleFunc("POST /v1/control/unfreeze", control)
	m.HandleFunc("POST /v1/control/revoke", control)
	m.HandleFunc("POST /v1/compensations", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			TenantID       string `json:"tenant_id"`
			IdempotencyKey string `json:"idempotency_key"`
			Reason         string `json:"reason"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		k := ledger.CallKey{TenantID: body.TenantID, IdempotencyKey: body.IdempotencyKey}
		if k == keyOK2 {
			apiErr(w, http.StatusConflict, "not_compensable", "compensation: the tool declares no compensation")
			return
		}
		ck := k.CompensationKey()
		f.mu.Lock()
		after := f.afterCompensation
		denied, isDenied := f.deniedCompensations[k.IdempotencyKey]
		f.mu.Unlock()
		if after != nil {
			defer after()
		}
		if isDenied {
			denied.TenantID, denied.IdempotencyKey = ck.TenantID, ck.IdempotencyKey
			writeJSON(w, http.StatusOK, map[string]any{"compensation_key": ck.String(), "events": []ledger.Event{denied}})
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"compensation_key": ck.String(), "events": []ledger.Event{
			{V: 1, EventID: "c1", Type: statemachine.EventRequested, Seq: 1, TenantID: ck.TenantID, IdempotencyKey: ck.IdempotencyKey},
			{V: 1, EventID: "c2", Type: statemachine.EventAuthorized, Seq: 2, TenantID: ck.TenantID, IdempotencyKey: ck.IdempotencyKey},
		}})
	})
	m.HandleFunc("POST /v1/resolutions", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			TenantID       string `json:"tenant_id"`
			IdempotencyKey string `json:"idempotency_key"`
			As             string `json:"as"`
			Evidence       string `json:"evidence"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		if body.As != "succeeded" && body.As != "failed" {
			apiErr(w, http.StatusBadRequest, "invalid_request", "executor: resolve as succeeded or failed")
			return
		}
		writeJSON(w, http.StatusOK, ledger.Event{V: 1, EventID: "r1", Type: statemachine.EventType(body.As), Seq: 6, TenantID: body.TenantID, IdempotencyKey: body.IdempotencyKey, Detail: body.Evidence})
	})
	m.HandleFunc("GET /v1/blast-radius", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		br := f.blast
		f.mu.Unlock()
		if r.URL.Query().Get("format") == "csv" {
			if br.Truncated { // as the API says it
				w.Header().Set(httpapi.HeaderTruncated, "true")
				w.Header().Set(httpapi.HeaderTotalCount, strconv.Itoa(br.Total))
			}
			w.Header().Set("Content-Type", "text/csv; charset=utf-8")
			w.Header().Set("Content-Disposition", `attachment; filename="blast-radius.csv"`)
			w.WriteHeader(http.StatusOK)
			_, _ = io.WriteString(w, csvBody)
			return
		}
		writeJSON(w, http.StatusOK, br)
	})
	m.HandleFunc("GET /v1/outcomes", func(w http.ResponseWriter, r *http.Request) {
		since, _ := time.Parse(time.RFC3339, r.URL.Query().Get("since"))
		bucket, _ := time.ParseDuration(r.URL.Query().Get("bucket"))
		b0 := projections.BucketOf(since, bucket)
		writeJSON(w, http.StatusOK, []projections.OutcomeCount{
			{Bucket: b0, Tool: "refund_order", State: statemachine.StateSucceeded, Calls: 3},
			{Bucket: b0, Tool: "refund_order", State: statemachine.StateFailed, Calls: 1},
			{Bucket: b0.Add(bucket), Tool: xssScript, State: statemachine.State(xssAttr), Calls: 2},
		})
	})
	m.HandleFunc("GET /v1/unresolved", func(w http.ResponseWriter, r *http.Request) {
		parked := callOf(keyUnknown, statemachine.StateOutcomeUnknown, t0.Add(-20*time.Minute))
		parked.LastEvent = statemachine.EventParked
		if r.URL.Query().Get(projections.ParamAllTenants) == "true" {
			// Across tenants, more wait than the list holds.
			w.Header().Set(headerLimitReached, "true")
		}
		writeJSON(w, http.StatusOK, []projections.Call{
			parked,
			callOf(keyHostile, statemachine.StateOutcomeUnknown, t0.Add(-15*time.Minute)),
			callOf(keyPending, statemachine.StateApprovalPending, t0.Add(-5*time.Minute)),
		})
	})
	m.HandleFunc("GET /v1/trace/{tenant}/{key...}", func(w http.ResponseWriter, r *http.Request) {
		k := ledger.CallKey{TenantID: r.PathValue("tenant"), IdempotencyKey: r.PathValue("key")}
		f.mu.Lock()
		evs, ok := f.traces[k]
		f.mu.Unlock()
		if ok {
			writeJSON(w, http.StatusOK, evs)
			return
		}
		if k != keyHostile && k != keyUnknown {
			apiErr(w, http.StatusNotFound, "not_found", "not found")
			return
		}
		writeJSON(w, http.StatusOK, traceEvents(k))
	})
	m.HandleFunc("GET /v1/calls/{key}", func(w http.ResponseWriter, r *http.Request) {
		k := ledger.CallKey{TenantID: r.URL.Query().Get("tenant_id"), IdempotencyKey: r.PathValue("key")}
		state := "succeeded"
		if k == keyUnknown {
			state = "outcome_unknown"
		}
		writeJSON(w, http.StatusOK, map[string]any{
			"tenant_id": k.TenantID, "idempotency_key": k.IdempotencyKey, "state": state, "settled": true,
			"events": traceEvents(k)[1:],
			"result": json.RawMessage(`{"refund_id":"rf_1","html":"<script>alert(1)</script>","link":"javascript:alert(1)","q":"\"><img src=x onerror=alert(1)>"}`),
		})
	})
	m.HandleFunc("GET /v1/health", func(w http.ResponseWriter, r *http.Request) {
		h := Health{
			Policy:               "pv-7 " + xssScript,
			Breakers:             map[string]string{"refund_order": "closed", "send_email": "open", xssAttr: "half-open", "odd": xssScript},
			ProjectionLagRecords: 42,
			ProjectionLagSeconds: 3.5,
		}
		f.mu.Lock()
		if f.lagUnknown {
			h.ProjectionLagRecords, h.ProjectionLagSeconds, h.ProjectionLagUnknown = 0, 0, true
		}
		if f.breakersUnknown {
			h.Breakers, h.BreakersUnknown = map[string]string{}, true
		}
		f.mu.Unlock()
		writeJSON(w, http.StatusOK, h)
	})
	return f
}

// csvBody is the blast radius CSV the fake API streams.
const csvBody = "updated_at,tenant_id,idempotency_key\n2026-11-30T13:59:00Z,acme,refund-1\n2026-11-30T13:58:00Z,acme,'=cmd()\n"

func maps(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// fixture is a console over the fake API with a settable clock.
type fixture struct {
	t       *testing.T
	c       *Console
	api     *fakeAPI
	mu      sync.Mutex
	now     time.Time
	authN   int
	devUsed int
}

func (fx *fixture) clock() time.Time {
	fx.mu.Lock()
	defer fx.mu.Unlock()
	return fx.now
}

func (fx *fixture) advance(d time.Duration) {
	fx.mu.Lock()
	fx.now = fx.now.Add(d)
	fx.mu.Unlock()
}

// identities are who the fake verifier says each assertion is.
var identities = map[string]Identity{
	assertOperator:      {User: "olga", Tenant: "acme", Roles: []string{"operator"}, Expires: t0.Add(time.Hour)},
	assertApprover:      {User: "alice", Tenant: "acme", Roles: []string{"approver"}, Expires: t0.Add(time.Hour)},
	assertPlatform:      {User: "pat", Tenant: "*", Roles: []string{"operator", "approver"}, Expires: t0.Add(time.Hour)},
	assertViewer:        {User: "vic", Tenant: "acme", Roles: []string{"viewer"}, Expires: t0.Add(time.Hour)},
	assertNoRoles:       {User: "nora", Tenant: "acme", Expires: t0.Add(time.Hour)},
	assertNoExpiry:      {User: "ned", Tenant: "acme", Roles: []string{"operator"}},
	assertDev:           {User: "dev", Tenant: "*", Roles: []string{"operator", "approver"}, Expires: t0.Add(time.Hour)},
	assertOperatorLater: {User: "olga", Tenant: "acme", Roles: []string{"operator"}, Expires: t0.Add(3 * time.Hour)},
	assertOtherLater:    {User: "oscar", Tenant: "acme", Roles: []string{"operator"}, Expires: t0.Add(3 * time.Hour)},
}

type fixtureOpt func(*Config)

func withDevLogin(fx *fixture) fixtureOpt {
	return func(c *Config) {
		c.DevLogin = func(context.Context) (string, error) {
			fx.mu.Lock()
			fx.devUsed++
			fx.mu.Unlock()
			return assertDev, nil
		}
	}
}

func newFixture(t *testing.T, opts ...func(*fixture) fixtureOpt) *fixture {
	t.Helper()
	fx := &fixture{t: t, api: newFakeAPI(), now: t0}
	cfg := Config{
		API: fx.api,
		Authenticate: func(_ context.Context, assertion string) (Identity, error) {
			fx.mu.Lock()
			fx.authN++
			fx.mu.Unlock()
			id, ok := identities[assertion]
			switch {
			case assertion == assertKeysBehind:
				return Identity{}, fmt.Errorf("%w: unknown_kid, for now", ErrTryLater)
			case !ok:
				return Identity{}, errors.New("token: bad signature")
			}
			return id, nil
		},
		Now: fx.clock,
	}
	for _, o := range opts {
		o(fx)(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	fx.c = c
	return fx
}

// browser is one client of the console: its cookies and the session's
// CSRF token.
type browser struct {
	fx      *fixture
	cookies map[string]*http.Cookie
	csrf    string
	tls     bool
	// local makes the requests come from this machine to 127.0.0.1, as
	// the dev login wants.
	local bool
	// host, when set, is the name the request is addressed to.
	host string
	// ctx, when set, is the requests' context: the browser's connection.
	ctx context.Context
}

func (fx *fixture) browser() *browser {
	return &browser{fx: fx, cookies: map[string]*http.Cookie{}}
}

// do sends one request; form, when not nil, is POSTed urlencoded.
func (b *browser) do(method, target string, form url.Values, header http.Header) *httptest.ResponseRecorder {
	b.fx.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	scheme := "http"
	if b.tls {
		scheme = "https"
	}
	host := "console.test"
	if b.local {
		host = "127.0.0.1:8080"
	}
	if b.host != "" {
		host = b.host
	}
	r := httptest.NewRequest(method, scheme+"://"+host+target, body)
	if b.ctx != nil {
		r = r.WithContext(b.ctx)
	}
	if b.local {
		r.RemoteAddr = "127.0.0.1:50000"
	}
	if form != nil {
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, vs := range header {
		r.Header[k] = vs
	}
	for name, ck := range b.cookies {
		if !ck.Expires.IsZero() && !ck.Expires.After(b.fx.clock()) {
			// Expired on the console's clock: a browser sends it no more.
			delete(b.cookies, name)
			continue
		}
		r.AddCookie(&http.Cookie{Name: ck.Name, Value: ck.Value})
	}
	w := httptest.NewRecorder()
	b.fx.c.ServeHTTP(w, r)
	for _, ck := range w.Result().Cookies() {
		if ck.MaxAge < 0 || ck.Value == "" {
			delete(b.cookies, ck.Name)
			continue
		}
		b.cookies[ck.Name] = ck
	}
	return w
}

func (b *browser) get(target string) *httptest.ResponseRecorder { return b.do("GET", target, nil, nil) }

// post sends form with the session's CSRF token.
func (b *browser) post(target string, form url.Values) *httptest.ResponseRecorder {
	b.fx.t.Helper()
	if form == nil {
		form = url.Values{}
	}
	form.Set("csrf", b.csrf)
	return b.do("POST", target, form, nil)
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// csrfOf returns the CSRF token in a page's first form.
func csrfOf(t *testing.T, body string) string {
	t.Helper()
	m := csrfRE.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no csrf field in the page:\n%s", body)
	}
	return m[1]
}

// signIn signs in with assertion through the login form, learns the
// session's CSRF token, and returns the first page it is sent to.
func (b *browser) signIn(assertion string) string {
	t := b.fx.t
	t.Helper()
	login := b.get("/login")
	if login.Code != http.StatusOK {
		t.Fatalf("GET /login = %d; want 200", login.Code)
	}
	w := b.do("POST", "/login", url.Values{"csrf": {csrfOf(t, login.Body.String())}, "assertion": {assertion}}, nil)
	if w.Code != http.StatusSeeOther || w.Header().Get("Location") != "/approvals" {
		t.Fatalf("POST /login = %d to %q; want 303 to /approvals", w.Code, w.Header().Get("Location"))
	}
	page := b.get("/approvals")
	b.csrf = csrfOf(t, page.Body.String())
	return page.Body.String()
}

// signedIn returns a browser signed in with assertion.
func (fx *fixture) signedIn(assertion string) *browser {
	b := fx.browser()
	b.signIn(assertion)
	return b
}
