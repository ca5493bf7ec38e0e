package console

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
)

// Every action below runs after authed checked the session, the CSRF
// token and the origin, sends the session's assertion to one API, and
// ends with a 303 back and a flash that names the person and the outcome:
// the API's answer, or its refusal's code and message.

// refusedFlash is the flash of a refused action.
func refusedFlash(s *session, what string, err error) flash {
	if errors.Is(err, errActionBrokenOff) {
		return flash{Text: fmt.Sprintf("%s: %s may or may not have been taken — %s", s.id.User, what, describe(err))}
	}
	return flash{Text: fmt.Sprintf("%s: %s was refused — %s", s.id.User, what, describe(err))}
}

func (c *Console) logAction(s *session, action, target string, err error) {
	if errors.Is(err, errActionBrokenOff) {
		c.cfg.Logger.Warn("console action sent, its answer broken off: it may have been taken", "user", s.id.User, "tenant", s.id.Tenant, "action", action, "target", target)
		return
	}
	if err != nil {
		c.cfg.Logger.Info("console action refused", "user", s.id.User, "tenant", s.id.Tenant, "action", action, "target", target, "err", describe(err))
		return
	}
	c.cfg.Logger.Info("console action", "user", s.id.User, "tenant", s.id.Tenant, "action", action, "target", target)
}

func (c *Console) postApprove(w http.ResponseWriter, r *http.Request, s *session) {
	id := r.PathValue("id")
	back := approvalURL(id)
	var a approval
	_, err := c.call(r, s, http.MethodPost, apiApprovalPath(id)+"/approve", nil, approveBody{ArgumentsHash: r.PostForm.Get("arguments_hash")}, &a)
	c.logAction(s, "approve", id, err)
	if err != nil {
		c.redirect(w, r, s, back, refusedFlash(s, "the approval", err))
		return
	}
	c.redirect(w, r, s, back, flash{OK: true, Text: fmt.Sprintf("%s approved the %s call %s/%s (arguments %s).", s.id.User, a.Tool, a.TenantID, a.IdempotencyKey, a.ArgumentsHash)})
}

func (c *Console) postReject(w http.ResponseWriter, r *http.Request, s *session) {
	id := r.PathValue("id")
	back := approvalURL(id)
	var a approval
	_, err := c.call(r, s, http.MethodPost, apiApprovalPath(id)+"/reject", nil, rejectBody{Reason: r.PostForm.Get("reason")}, &a)
	c.logAction(s, "reject", id, err)
	if err != nil {
		c.redirect(w, r, s, back, refusedFlash(s, "the rejection", err))
		return
	}
	c.redirect(w, r, s, back, flash{OK: true, Text: fmt.Sprintf("%s rejected the %s call %s/%s.", s.id.User, a.Tool, a.TenantID, a.IdempotencyKey)})
}

func (c *Console) postResolve(w http.ResponseWriter, r *http.Request, s *session) {
	f := r.PostForm
	key := ledger.CallKey{TenantID: f.Get("tenant"), IdempotencyKey: f.Get("key")}
	back := localPath(f.Get("back"), "/calls")
	as := f.Get("as")
	var ev ledger.Event
	_, err := c.call(r, s, http.MethodPost, pathResolutions, nil, resolveBody{
		TenantID: key.TenantID, IdempotencyKey: key.IdempotencyKey, As: as, Evidence: f.Get("evidence"),
		CancelCompensation: f.Get("cancel_compensation") == "on",
	}, &ev)
	c.logAction(s, "resolve", key.String(), err)
	if err != nil {
		c.redirect(w, r, s, back, refusedFlash(s, "the resolution of "+key.String(), err))
		return
	}
	c.redirect(w, r, s, back, flash{OK: true, Text: fmt.Sprintf("%s resolved %s as %s (event %s, seq %d).", s.id.User, key, as, ev.Type, ev.Seq)})
}

func (c *Console) postCompensate(w http.ResponseWriter, r *http.Request, s *session) {
	f := r.PostForm
	key := ledger.CallKey{TenantID: f.Get("tenant"), IdempotencyKey: f.Get("key")}
	back := localPath(f.Get("back"), "/calls")
	ans, err := c.compensate(r, s, key, f.Get("reason"))
	if err != nil {
		c.redirect(w, r, s, back, refusedFlash(s, "the compensation of "+key.String(), err))
		return
	}
	c.redirect(w, r, s, back, flash{OK: true, Text: fmt.Sprintf("%s asked to compensate %s: %s.", s.id.User, key, compensationOutcome(ans))})
}

// compensate asks POST /v1/compensations for key. A compensation the
// ledger answered and refused (its call denied: the tool frozen, the
// policies' refusal, a rate limit) is a *compensationRefusal: the API
// answers it 200, with the refusal among the call's events, and nothing
// will undo the call.
func (c *Console) compensate(r *http.Request, s *session, key ledger.CallKey, reason string) (compensationAnswer, error) {
	var ans compensationAnswer
	_, err := c.call(r, s, http.MethodPost, pathCompensations, nil, compensateBody{
		TenantID: key.TenantID, IdempotencyKey: key.IdempotencyKey, Reason: reason,
	}, &ans)
	if ev, refused := ledger.Refusing(ans.Events); err == nil && refused {
		err = &compensationRefusal{key: ans.CompensationKey, ev: ev}
	}
	c.logAction(s, "compensate", key.String(), err)
	return ans, err
}

// compensationRefusal is a compensation the ledger refused: ev, the last
// event of its call's, key.
type compensationRefusal struct {
	key string
	ev  ledger.Event
}

func (e *compensationRefusal) Error() string {
	return "compensation call " + e.key + " " + ledger.RefusalText(e.ev)
}

// compensationOutcome says what a compensation request started: its
// call's key and, if the intake already decided, its first decision.
func compensationOutcome(a compensationAnswer) string {
	out := "compensation call " + a.CompensationKey
	if len(a.Events) == 0 {
		return out + " (asked for before; see its timeline)"
	}
	last := a.Events[len(a.Events)-1]
	out += " " + string(last.Type)
	if last.Reason != "" {
		out += " (" + last.Reason + ")"
	}
	return out
}

// hidden is a hidden form field.
type hidden struct{ Name, Value string }

// confirmPage is a server-rendered confirmation: what an action will do
// and how many calls it touches, then a form that POSTs it.
type confirmPage struct {
	Heading   string
	Lines     []string
	Count     int
	Counted   bool
	CountNote string
	Calls     []callRow
	Err       string
	Action    string
	Hidden    []hidden
	Reason    string // the reason field's label; empty: none
	Submit    string
	Cancel    string
	Ready     bool
}

// serveUnfreezeConfirm shows the freeze an unfreeze would lift, as the
// control API has it now, and binds the form to it: an unfreeze posted
// after the tool was frozen again, for another reason, is refused
// (freeze_changed) rather than lifting the newer freeze unseen.
func (c *Console) serveUnfreezeConfirm(w http.ResponseWriter, r *http.Request, s *session) {
	q := r.URL.Query()
	tool, tenant := q.Get("tool"), q.Get("tenant")
	scope := "every tenant"
	if tenant != "" {
		scope = "tenant " + tenant
	}
	page := confirmPage{
		Heading: "Unfreeze " + tool,
		Action:  "/health/unfreeze",
		Reason:  "Why lift the freeze",
		Submit:  "Unfreeze " + tool,
		Cancel:  "/health",
	}
	var snap controlSnapshot
	if _, err := c.call(r, s, http.MethodGet, pathControl, nil, nil, &snap); err != nil {
		page.Err = describe(err)
		c.render(w, r, s, "confirm", "Unfreeze "+tool, page)
		return
	}
	i := slices.IndexFunc(snap.Freezes, func(a ledger.ControlAction) bool { return a.Tool == tool && a.Tenant == tenant })
	if i < 0 {
		page.Lines = []string{tool + " is not frozen for " + scope + "."}
		c.render(w, r, s, "confirm", "Unfreeze "+tool, page)
		return
	}
	fr := snap.Freezes[i]
	frozen := fmt.Sprintf("Frozen for %s by %s at %s: %s", scope, fr.By, fr.Made().UTC().Format(time.RFC3339), fr.Reason)
	if fr.By == "" {
		// A freeze of every tenant's, seen by a tenant operator: who made
		// it and why are the platform's (the control API withholds them).
		frozen = fmt.Sprintf("Frozen for %s by the platform at %s (its reason is not shown to tenants).", scope, fr.Made().UTC().Format(time.RFC3339))
	}
	if tenant == "" && s.id.Tenant != "*" {
		// The control API takes a tenant operator's unfreeze as of its
		// own tenant's freeze: this one only a platform operator lifts.
		page.Lines = []string{frozen, "Only a platform operator lifts a freeze of every tenant."}
		c.render(w, r, s, "confirm", "Unfreeze "+tool, page)
		return
	}
	runAgain := "Calls to " + tool + " for " + scope + " will be accepted and run again."
	page.Lines = []string{frozen, runAgain}
	if own := fr.Replaced; fr.ByTenant == "*" && own != nil && own.Kind == "freeze" && own.Tenant == tenant && tenant != "" {
		// The unfreeze puts the tenant's own freeze back (the
		// control API's Restored): the tool stays frozen for it.
		page.Lines[1] = fmt.Sprintf("This freeze replaced the tenant's own, by %s at %s: %s. That one stays in force: calls to %s for %s stay refused until the tenant lifts it.",
			own.By, own.At.UTC().Format(time.RFC3339), own.Reason, tool, scope)
	}
	if line := stillFrozen(snap.Freezes, tool, tenant, scope); line != "" {
		if page.Lines[1] == runAgain {
			page.Lines[1] = line // "will run again" it contradicts
		} else {
			page.Lines = append(page.Lines, line)
		}
	}
	page.Hidden = []hidden{{"tool", tool}, {"tenant", tenant}, {"freeze_at", fr.At.UTC().Format(time.RFC3339Nano)}}
	page.Ready = true
	c.render(w, r, s, "confirm", "Unfreeze "+tool, page)
}

// stillFrozen says which of freezes keeps tool frozen once its freeze for
// tenant ("": every tenant) is lifted: the freeze of every tenant, for a
// tenant's; the tenants' own, for every tenant's. "" when none does.
func stillFrozen(freezes []ledger.ControlAction, tool, tenant, scope string) string {
	if tenant != "" {
		if slices.ContainsFunc(freezes, func(a ledger.ControlAction) bool { return a.Tool == tool && a.Tenant == "" }) {
			return fmt.Sprintf("%s is also frozen for every tenant, which stays in force: calls to %s for %s stay refused until a platform operator lifts that freeze.", tool, tool, scope)
		}
		return ""
	}
	var own []string
	for _, a := range freezes {
		if a.Tool == tool && a.Tenant != "" {
			own = append(own, a.Tenant)
		}
	}
	if len(own) == 0 {
		return ""
	}
	slices.Sort(own)
	return fmt.Sprintf("Calls to %s will be accepted and run again for every tenant but these, whose own freezes stay in force: %s.", tool, strings.Join(own, ", "))
}

func (c *Console) postUnfreeze(w http.ResponseWriter, r *http.Request, s *session) {
	f := r.PostForm
	body := unfreezeBody{toolBody: toolBody{Tool: f.Get("tool"), Tenant: f.Get("tenant"), Reason: f.Get("reason")}}
	if at := f.Get("freeze_at"); at != "" {
		t, err := time.Parse(time.RFC3339Nano, at)
		if err != nil {
			c.redirect(w, r, s, "/health", flash{Text: "The unfreeze form named no freeze it could read; open it again from Health."})
			return
		}
		body.FreezeAt = &t
	}
	var a ledger.ControlAction
	status, err := c.call(r, s, http.MethodPost, pathControl+"/unfreeze", nil, body, &a)
	c.logAction(s, "unfreeze", body.Tool, err)
	if err != nil {
		c.redirect(w, r, s, "/health", refusedFlash(s, "the unfreeze of "+body.Tool, err))
		return
	}
	text := fmt.Sprintf("%s unfroze %s%s%s.", s.id.User, body.Tool, freezeScopeText(a.Tenant), applied(status))
	if a.Restored != nil {
		text += fmt.Sprintf(" The tenant's own freeze, by %s, is in force again.", a.Restored.By)
	}
	c.redirect(w, r, s, "/health", flash{OK: true, Text: text})
}

// freezeScopeText names the tenants a freeze covers, as the API's answer
// says.
func freezeScopeText(tenant string) string {
	if tenant == "" {
		return " for every tenant"
	}
	return " for tenant " + tenant
}

// applied notes a control action published but not yet applied here
// (202).
func applied(status int) string {
	if status == http.StatusAccepted {
		return " (published; this instance has not applied it yet)"
	}
	return ""
}

// queryString is q as a console URL's query, "" when empty.
func queryString(path string, q url.Values) string {
	if len(q) == 0 {
		return path
	}
	return path + "?" + q.Encode()
}
