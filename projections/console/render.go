package console

import (
	"bytes"
	"encoding/json"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections/report"
)

// pageNames are the templates/<name>.html files, each defining "content"
// for the layout.
var pageNames = []string{
	"login", "message", "approvals", "approval", "calls", "call",
	"incidents", "confirm", "health",
}

// navOf is the nav entry each page belongs to.
var navOf = map[string]string{
	"approvals": "approvals", "approval": "approvals",
	"calls": "calls", "call": "calls",
	"incidents": "incidents", "confirm": "incidents",
	"health": "health",
}

// view is what the layout renders around a page's content.
type view struct {
	Title string
	Nav   string
	User  *Identity
	CSRF  string
	Flash *flash
	CSS   string
	JS    string
	Data  any
}

// messagePage is a page that says one thing (not found, refused).
type messagePage struct {
	Heading string
	Text    string
	Back    string
}

func (c *Console) parseTemplates() (map[string]*template.Template, error) {
	base, err := template.New("layout").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/partials.html")
	if err != nil {
		return nil, fmt.Errorf("console: templates: %w", err)
	}
	out := make(map[string]*template.Template, len(pageNames))
	for _, name := range pageNames {
		t, err := base.Clone()
		if err != nil {
			return nil, fmt.Errorf("console: templates: %w", err)
		}
		if _, err := t.ParseFS(templateFS, "templates/"+name+".html"); err != nil {
			return nil, fmt.Errorf("console: template %s: %w", name, err)
		}
		out[name] = t
	}
	return out, nil
}

func (c *Console) render(w http.ResponseWriter, r *http.Request, s *session, page, title string, data any) {
	c.renderStatus(w, r, s, http.StatusOK, page, title, data)
}

// renderStatus renders page whole into memory first, so that a template
// error answers 500 rather than half a page.
func (c *Console) renderStatus(w http.ResponseWriter, r *http.Request, s *session, status int, page, title string, data any) {
	v := view{
		Title: title,
		Nav:   navOf[page],
		CSS:   c.assetURL("console.css"),
		JS:    c.assetURL("console.js"),
		Data:  data,
	}
	if s != nil {
		id := s.id
		v.User = &id
		v.CSRF = s.csrf
		v.Flash = c.sessions.popFlash(s)
	}
	var buf bytes.Buffer
	if err := c.pages[page].ExecuteTemplate(&buf, "layout", v); err != nil {
		c.cfg.Logger.Error("console render", "page", page, "err", err)
		http.Error(w, "the page could not be rendered", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// forbidden answers 403 with msg: nothing was done.
func (c *Console) forbidden(w http.ResponseWriter, r *http.Request, s *session, msg string) {
	c.renderStatus(w, r, s, http.StatusForbidden, "message", "Refused", messagePage{Heading: "Refused", Text: msg})
}

func (c *Console) assetURL(name string) string {
	return "/assets/" + name + "?v=" + c.assets[name].version
}

// redirect ends a POST: 303 to back with the outcome as s's flash.
func (c *Console) redirect(w http.ResponseWriter, r *http.Request, s *session, back string, f flash) {
	c.sessions.setFlash(s, f)
	http.Redirect(w, r, back, http.StatusSeeOther)
}

// localPath returns p if it is a path on this console, else def: a form's
// "back" field must not send anyone elsewhere.
func localPath(p, def string) string {
	if p == "" || p[0] != '/' || strings.HasPrefix(p, "//") || strings.ContainsAny(p, "\\\r\n\t") {
		return def
	}
	u, err := url.Parse(p)
	if err != nil || u.Scheme != "" || u.Host != "" {
		return def
	}
	return p
}

var funcs = template.FuncMap{
	"fmtTime":     fmtTime,
	"fmtTimePtr":  fmtTimePtr,
	"rfc3339":     func(t time.Time) string { return t.UTC().Format(time.RFC3339) },
	"callURL":     callURL,
	"approvalURL": approvalURL,
	// shown is an agent's text with what would not show as it is
	// escaped (visible), for a <bdo dir="ltr">: a bidi override in a call
	// id or a resource reordered what a responder read before confirming.
	"shown": func(s string) string { v, _ := visible(s); return v },
	"join":  strings.Join,
	// abbrev keeps a long id (a jti) to a table cell: the whole id is in
	// the cell's title.
	"abbrev": func(s string) string {
		if r := []rune(s); len(r) > 12 {
			return string(r[:12]) + "…"
		}
		return s
	},
	"unfreezeURL": func(tool, tenant string) string {
		return queryString("/health/unfreeze", url.Values{"tool": {tool}, "tenant": {tenant}})
	},
	"stateClass": stateClass,
	"riskClass": func(s string) string {
		switch s {
		case "low", "medium", "high":
			return "risk-" + s
		}
		return "neutral"
	},
	"formCtx": func(csrf, tenant, key, back string, id int) formCtx {
		return formCtx{CSRF: csrf, Tenant: tenant, Key: key, Back: back, ID: id}
	},
	"breakerClass": func(s string) string {
		switch s {
		case "closed":
			return "ok"
		case "half-open":
			return "warn"
		case "open":
			return "bad"
		}
		return "neutral"
	},
}

// formCtx is what the resolve and compensate forms need: ID makes their
// inputs' ids unique on a page that lists several calls.
type formCtx struct {
	CSRF, Tenant, Key, Back string
	ID                      int
}

// fmtTime renders a time for people, in UTC.
func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "—"
	}
	return t.UTC().Format("2006-01-02 15:04:05") + " UTC"
}

func fmtTimePtr(t *time.Time) string {
	if t == nil {
		return "—"
	}
	return fmtTime(*t)
}

// fmtDuration renders d coarsely: "45s", "12m 5s", "3h 20m", "2d 4h".
func fmtDuration(d time.Duration) string {
	if d < 0 {
		d = -d
	}
	d = d.Truncate(time.Second)
	switch {
	case d < time.Minute:
		return strconv.Itoa(int(d.Seconds())) + "s"
	case d < time.Hour:
		return fmt.Sprintf("%dm %ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh %dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd %dh", int(d.Hours())/24, int(d.Hours())%24)
}

// callURL is the console's timeline page of a call.
func callURL(tenant, key string) string {
	return "/calls/" + url.PathEscape(tenant) + "/" + url.PathEscape(key)
}

// approvalURL is the console's page of an approval.
func approvalURL(id string) string { return "/approvals/" + url.PathEscape(id) }

// knownStates are the states a CSS class exists for.
var knownStates = map[string]bool{
	"requested": true, "approval_pending": true, "authorized": true, "executing": true,
	"succeeded": true, "failed": true, "outcome_unknown": true, "compensated": true,
	"denied": true, "rejected": true, "expired": true, "pending": true, "approved": true,
	"parked": true,
}

// stateClass is the CSS class of a state's badge; unknown states (the
// value is the API's) share one.
func stateClass(s string) string {
	if knownStates[s] {
		return "st-" + s
	}
	return "st-other"
}

// argRow is one leaf of a call's arguments.
type argRow struct {
	Pointer string
	Value   string
	Masked  bool
	// Hidden: the pointer or the value held characters that do not show
	// (see visible), which it shows escaped.
	Hidden bool
}

// visible returns s with every character that does not show as itself
// on a page (a direction override or isolate, a zero-width or other
// format character, a control character, a space other than ASCII's, or
// one drawn as nothing: report.Invisible) written as a \u escape, and
// whether there was one. html/template escapes markup, not these: "\u202e4321-8765" shows as 5678-1234, and
// an approver would approve what it does not see. An ASCII space at
// either end, or next to another, is one of them too: a page collapses
// "ACME  Corp" into "ACME Corp" and drops "ACME Corp "'s last.
func visible(s string) (string, bool) {
	if strings.IndexFunc(s, notShown) < 0 && !strings.HasPrefix(s, " ") && !strings.HasSuffix(s, " ") && !strings.Contains(s, "  ") {
		return s, false
	}
	var b strings.Builder
	hidden := false
	for i, r := range s {
		switch {
		case r == ' ' && (i == 0 || i == len(s)-1 || s[i-1] == ' ' || s[i+1] == ' '):
			b.WriteString(`\u0020`)
			hidden = true
		case !notShown(r):
			b.WriteRune(r)
		case r > 0xFFFF:
			fmt.Fprintf(&b, "\\U%08x", r)
			hidden = true
		default:
			fmt.Fprintf(&b, "\\u%04x", r)
			hidden = true
		}
	}
	return b.String(), hidden
}

func notShown(r rune) bool { return report.Invisible(r) }

// maxArgRows bounds the rows a preview shows.
const maxArgRows = 500

// flattenArgs lists the leaves of a JSON document by JSON pointer, in key
// order; values the registry or a policy masked show as masked.
func flattenArgs(raw json.RawMessage) ([]argRow, bool, error) {
	if len(raw) == 0 {
		return nil, false, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false, err
	}
	var rows []argRow
	truncated := false
	var walk func(ptr string, v any)
	walk = func(ptr string, v any) {
		if len(rows) >= maxArgRows {
			truncated = true
			return
		}
		switch v := v.(type) {
		case map[string]any:
			if len(v) == 0 {
				rows = append(rows, argRow{Pointer: ptr, Value: "{}"})
				return
			}
			keys := make([]string, 0, len(v))
			for k := range v {
				keys = append(keys, k)
			}
			slices.Sort(keys)
			for _, k := range keys {
				walk(ptr+"/"+escapePointer(k), v[k])
			}
		case []any:
			if len(v) == 0 {
				rows = append(rows, argRow{Pointer: ptr, Value: "[]"})
				return
			}
			for i, e := range v {
				walk(ptr+"/"+strconv.Itoa(i), e)
			}
		case string:
			rows = append(rows, argRow{Pointer: ptr, Value: v, Masked: v == ledger.Redacted})
		case nil:
			rows = append(rows, argRow{Pointer: ptr, Value: "null"})
		default:
			rows = append(rows, argRow{Pointer: ptr, Value: fmt.Sprint(v)})
		}
	}
	walk("", v)
	for i := range rows {
		if rows[i].Pointer == "" {
			rows[i].Pointer = "/"
		}
		var hp, hv bool
		rows[i].Pointer, hp = visible(rows[i].Pointer)
		rows[i].Value, hv = visible(rows[i].Value)
		rows[i].Hidden = hp || hv
	}
	return rows, truncated, nil
}

func escapePointer(k string) string {
	return strings.ReplaceAll(strings.ReplaceAll(k, "~", "~0"), "/", "~1")
}

// prettyJSON indents a JSON document for a <pre>, with the \u003c, \u003e
// and \u0026 that Go's encoders write for <, > and & turned back into the
// characters people expect to read (the template escapes them for HTML
// all the same). What does not parse is shown as it is.
func prettyJSON(raw json.RawMessage) string {
	var buf bytes.Buffer
	if err := json.Indent(&buf, raw, "", "  "); err != nil {
		return string(raw)
	}
	b := buf.Bytes()
	out := make([]byte, 0, len(b))
	inString := false
	for i := 0; i < len(b); i++ {
		ch := b[i]
		switch {
		case !inString:
			inString = ch == '"'
		case ch == '"':
			inString = false
		case ch == '\\' && i+1 < len(b):
			if b[i+1] == 'u' && i+5 < len(b) {
				switch string(b[i+2 : i+6]) {
				case "003c", "003C":
					out, i = append(out, '<'), i+5
					continue
				case "003e", "003E":
					out, i = append(out, '>'), i+5
					continue
				case "0026":
					out, i = append(out, '&'), i+5
					continue
				}
			}
			// Any other escape is copied whole, so that an escaped
			// backslash is never read as the start of another.
			out = append(out, ch, b[i+1])
			i++
			continue
		}
		out = append(out, ch)
	}
	return string(out)
}

// bucketLabel names a histogram bucket for people.
func bucketLabel(d time.Duration) string {
	switch {
	case d >= 7*24*time.Hour && d%(7*24*time.Hour) == 0:
		return plural(int(d/(7*24*time.Hour)), "week")
	case d >= 24*time.Hour && d%(24*time.Hour) == 0:
		return plural(int(d/(24*time.Hour)), "day")
	case d >= time.Hour && d%time.Hour == 0:
		return plural(int(d/time.Hour), "hour")
	case d >= time.Minute && d%time.Minute == 0:
		return plural(int(d/time.Minute), "minute")
	}
	return d.String()
}

func plural(n int, unit string) string {
	if n == 1 {
		return "1 " + unit
	}
	return strconv.Itoa(n) + " " + unit + "s"
}
