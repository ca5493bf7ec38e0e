// Package report renders the projections' answers for people: aligned
// text tables for a terminal, and CSV for a spreadsheet. Every value in
// them may come from an agent or a tool (a key, a resource, a reason), so
// tables strip control characters and CSV cells that a spreadsheet would
// run as a formula are quoted as text.
package report

import (
	"encoding/csv"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// CallColumns are the columns of a list of calls, in CSV and tables.
var CallColumns = []string{
	"updated_at", "tenant_id", "idempotency_key", "tool", "state", "last_event", "seq",
	"resource", "agent_id", "user_id", "policy_version", "approver", "jti",
	"credential_family", "reason", "error_code", "call_id", "trace_id", "tool_digest",
}

func callRow(c projections.Call) []string {
	return []string{
		c.UpdatedAt.UTC().Format(time.RFC3339Nano), c.TenantID, c.IdempotencyKey, c.Tool,
		string(c.State), string(c.LastEvent), strconv.FormatInt(c.Seq, 10), c.Resource,
		c.AgentID, c.UserID, c.PolicyVersion, c.Approver, c.JTI, c.CredentialFamily,
		c.Reason, c.ErrorCode, c.CallID, c.TraceID, c.ToolDigest,
	}
}

// CallsCSV writes calls as CSV with a header row.
func CallsCSV(w io.Writer, calls []projections.Call) error {
	rows := make([][]string, 0, len(calls)+1)
	rows = append(rows, CallColumns)
	for _, c := range calls {
		rows = append(rows, callRow(c))
	}
	return writeCSV(w, rows)
}

// OutcomesCSV writes outcome counts as CSV with a header row.
func OutcomesCSV(w io.Writer, os []projections.OutcomeCount) error {
	rows := [][]string{{"bucket", "tool", "state", "calls"}}
	for _, o := range os {
		rows = append(rows, []string{o.Bucket.UTC().Format(time.RFC3339), o.Tool, string(o.State), strconv.Itoa(o.Calls)})
	}
	return writeCSV(w, rows)
}

// tableCallColumns are the columns a terminal has room for.
var tableCallColumns = []string{"UPDATED (UTC)", "TENANT", "KEY", "TOOL", "STATE", "RESOURCE", "POLICY", "APPROVER", "JTI"}

func tableCallRow(c projections.Call) []string {
	state := string(c.State)
	if c.LastEvent == statemachine.EventParked {
		state += " (parked)"
	}
	return []string{
		c.UpdatedAt.UTC().Format("2006-01-02 15:04:05"), c.TenantID, c.IdempotencyKey, c.Tool,
		state, c.Resource, c.PolicyVersion, c.Approver, c.JTI,
	}
}

// CallsTable writes calls as an aligned table.
func CallsTable(w io.Writer, calls []projections.Call) error {
	rows := [][]string{tableCallColumns}
	for _, c := range calls {
		rows = append(rows, tableCallRow(c))
	}
	return writeTable(w, rows)
}

// BlastRadiusTable writes a blast radius for a responder: the totals and
// counts first, then the calls. Each count shows its largest values; the
// numbers of values are the answer's Distinct, which the counts' lists
// (cut at projections.MaxCounts) may fall short of.
func BlastRadiusTable(w io.Writer, br projections.BlastRadius) error {
	fmt.Fprintf(w, "%d calls", br.Total)
	if br.Truncated {
		fmt.Fprintf(w, " (listing the %d most recent; --limit for more)", len(br.Calls))
	}
	// A call without a resource is counted under the empty value, which
	// is no resource. Were it cut from a list (it would have to be
	// smaller than MaxCounts others), the number would count it.
	resources := distinct(br.Distinct.Resources, br.ByResource)
	if slices.ContainsFunc(br.ByResource, func(c projections.Count) bool { return c.Value == "" }) {
		resources--
	}
	fmt.Fprintf(w, ", %d tenants, %d resources\n\n", distinct(br.Distinct.Tenants, br.ByTenant), resources)
	for _, g := range []struct {
		title  string
		counts []projections.Count
		values int
	}{
		{"TENANT", br.ByTenant, br.Distinct.Tenants}, {"STATE", br.ByState, br.Distinct.States},
		{"TOOL", br.ByTool, br.Distinct.Tools}, {"RESOURCE", br.ByResource, br.Distinct.Resources},
	} {
		if len(g.counts) == 0 {
			continue
		}
		rows := [][]string{{g.title, "CALLS"}}
		for i, c := range g.counts {
			if i == tableCounts {
				rows = append(rows, []string{fmt.Sprintf("(%d more)", distinct(g.values, g.counts)-i), ""})
				break
			}
			v := c.Value
			if v == "" {
				v = "-"
			}
			rows = append(rows, []string{v, strconv.Itoa(c.Calls)})
		}
		if err := writeTable(w, rows); err != nil {
			return err
		}
		fmt.Fprintln(w)
	}
	return CallsTable(w, br.Calls)
}

// tableCounts is how many values of each count a table shows.
const tableCounts = 20

// distinct is the number of values a count has: as the answer says, or,
// from a server that does not say, as many as it lists.
func distinct(n int, counts []projections.Count) int { return max(n, len(counts)) }

// BlastRadiusCSV writes a blast radius's calls as CSV: one row per listed
// call. The counts are in the JSON form.
func BlastRadiusCSV(w io.Writer, br projections.BlastRadius) error {
	return CallsCSV(w, br.Calls)
}

// OutcomesTable writes outcome counts as an aligned table.
func OutcomesTable(w io.Writer, os []projections.OutcomeCount) error {
	rows := [][]string{{"BUCKET (UTC)", "TOOL", "STATE", "CALLS"}}
	for _, o := range os {
		rows = append(rows, []string{o.Bucket.UTC().Format("2006-01-02 15:04:05"), o.Tool, string(o.State), strconv.Itoa(o.Calls)})
	}
	return writeTable(w, rows)
}

// EventsTable writes a call's events as an aligned table, one line each.
func EventsTable(w io.Writer, evs []ledger.Event) error {
	rows := [][]string{{"SEQ", "TYPE", "AT", "ACTOR", "ATTEMPT", "NOTE"}}
	for _, e := range evs {
		seq := strconv.FormatInt(e.Seq, 10)
		if e.Refusal() {
			seq = "-"
		}
		attempt := ""
		if e.Attempt > 0 {
			attempt = strconv.Itoa(e.Attempt)
		}
		rows = append(rows, []string{seq, string(e.Type), e.At.UTC().Format(time.RFC3339Nano), e.Actor, attempt, EventNote(e)})
	}
	return writeTable(w, rows)
}

// EventNote is the one-line gist of an event for humans, safe to print:
// the reason, resource and detail come from agents and tools.
func EventNote(e ledger.Event) string { return Printable(eventNote(e)) }

func eventNote(e ledger.Event) string {
	var parts []string
	if e.Refusal() {
		parts = append(parts, "refused submission")
	}
	if e.Reason != "" {
		parts = append(parts, "reason="+e.Reason)
	}
	if e.Type == statemachine.EventRequested || e.Type == statemachine.EventApproved {
		parts = append(parts, "hash="+short(e.ArgumentsHash))
	}
	if e.Resource != "" && e.Type == statemachine.EventRequested {
		parts = append(parts, "resource="+e.Resource)
	}
	// The definition the call is bound to: said once, where it was.
	if e.ToolDigest != "" && e.Type == statemachine.EventRequested {
		parts = append(parts, "tool_def="+short(e.ToolDigest))
	}
	if e.PolicyVersion != "" && e.Type != statemachine.EventExecuting {
		parts = append(parts, "policy="+e.PolicyVersion)
	}
	if e.Approver != "" {
		parts = append(parts, "approver="+e.Approver)
	}
	if e.ApprovalID != "" && e.Type != statemachine.EventExecuting {
		parts = append(parts, "approval="+e.ApprovalID)
	}
	// On every event that names one, executing included: a call taken
	// over names there the credential of the owner that died, which may
	// have reached the tool, and its outcome another family.
	if e.JTI != "" {
		parts = append(parts, "jti="+e.JTI)
	}
	if e.CredentialFamily != "" {
		parts = append(parts, "family="+e.CredentialFamily)
	}
	if len(e.EarlierCredentialFamilies) > 0 {
		// Owners before that one died too, perhaps after sending.
		parts = append(parts, "earlier_families="+strings.Join(e.EarlierCredentialFamilies, ","))
	}
	if e.Pointer != "" {
		parts = append(parts, "pointer="+e.Pointer)
	}
	if e.ErrorCode != "" {
		parts = append(parts, "error="+e.ErrorCode)
	}
	if e.LatencyMS > 0 {
		parts = append(parts, fmt.Sprintf("latency=%dms", e.LatencyMS))
	}
	if e.ResultDigest != "" {
		parts = append(parts, "result="+short(e.ResultDigest))
	}
	// Last, for it is the longest: a compensation's reason and who asked
	// for it, an operator's evidence for a resolution, why a refusal.
	if e.Detail != "" {
		parts = append(parts, "detail="+strconv.Quote(clip(e.Detail, maxNoteDetail)))
	}
	return strings.Join(parts, " ")
}

// maxNoteDetail is how many characters of an event's detail a table
// shows; --json has it whole.
const maxNoteDetail = 160

// clip is s cut to n runes, with an ellipsis when cut.
func clip(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n]) + "…"
}

// short abbreviates a "sha256:<hex>" digest for a table.
func short(digest string) string {
	if len(digest) <= 19 {
		return digest
	}
	return digest[:19] + "…"
}

// Table aligns rows for a terminal, the first the header, every cell kept
// on its line and in its column (control characters, terminal escapes
// and bidirectional overrides shown as '?'): for any table whose cells
// may come from an agent or a tool.
func Table(w io.Writer, rows [][]string) error { return writeTable(w, rows) }

// writeTable aligns rows; the first is the header.
func writeTable(w io.Writer, rows [][]string) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, r := range rows {
		cells := make([]string, len(r))
		for i, c := range r {
			cells[i] = Printable(c)
		}
		if _, err := fmt.Fprintln(tw, strings.Join(cells, "\t")); err != nil {
			return err
		}
	}
	return tw.Flush()
}

// Printable is s safe to print on a terminal, on its line and in its
// column: a value from an agent or a tool may carry newlines, tabs,
// terminal escapes or bidi overrides, each shown as '?'.
func Printable(s string) string {
	out, _ := questioned(s, Invisible)
	return out
}

// questioned is s with every rune hide reports replaced by '?', and
// whether there was one.
func questioned(s string, hide func(rune) bool) (string, bool) {
	if strings.IndexFunc(s, hide) < 0 {
		return s, false
	}
	return strings.Map(func(r rune) rune {
		if hide(r) {
			return '?'
		}
		return r
	}, s), true
}

// Invisible reports whether r does not show as itself: a rune that is not
// printable (a control, a format character such as a bidi override or a
// zero-width one, a space other than ASCII's), or a printable one drawn as
// nothing (a variation selector, the combining grapheme joiner, a Hangul
// filler, the braille blank), which an agent could put in a value to make
// it differ from what a reader sees.
func Invisible(r rune) bool {
	return !unicode.IsPrint(r) || r == '\u2800' ||
		unicode.Is(unicode.Variation_Selector, r) || unicode.Is(unicode.Other_Default_Ignorable_Code_Point, r)
}

// TerminalJSON is the JSON document b with every rune a terminal would not
// show as it is (a C1 control such as the 8-bit CSI, a bidi override, a
// zero-width character) written as its \uXXXX escape: the same JSON, which
// an agent's strings in it cannot use to hide, repaint or reorder what an
// approver reads. Encoders escape the C0 controls already, and such runes
// stand only inside strings.
func TerminalJSON(b []byte) []byte {
	if strings.IndexFunc(string(b), hidden) < 0 {
		return b
	}
	out := make([]byte, 0, len(b)+32)
	for _, r := range string(b) {
		if !hidden(r) {
			out = utf8.AppendRune(out, r)
			continue
		}
		if r > 0xFFFF {
			r1, r2 := utf16.EncodeRune(r)
			out = fmt.Appendf(out, `\u%04x\u%04x`, r1, r2)
			continue
		}
		out = fmt.Appendf(out, `\u%04x`, r)
	}
	return out
}

// TerminalText is the text b with every rune a terminal would not show as
// it is, but for newlines and tabs, replaced by '?': an agent's terminal
// escapes (ESC, carriage returns, C1 controls, bidi overrides) cannot
// clear, repaint or reorder what a reader sees.
func TerminalText(b []byte) []byte {
	out, changed := questioned(string(b), func(r rune) bool { return Invisible(r) && r != '\n' && r != '\t' })
	if !changed {
		return b
	}
	return []byte(out)
}

// hidden reports whether a terminal would not show r as it is; JSON's own
// whitespace is shown.
func hidden(r rune) bool {
	return Invisible(r) && r != '\n' && r != '\t' && r != '\r'
}

// writeCSV writes rows, every cell safe to open in a spreadsheet.
func writeCSV(w io.Writer, rows [][]string) error {
	cw := csv.NewWriter(w)
	for _, r := range rows {
		cells := make([]string, len(r))
		for i, c := range r {
			cells[i] = SafeCell(c)
		}
		if err := cw.Write(cells); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// SafeCell returns s as a CSV cell that a spreadsheet shows as text: a
// cell whose first character other than a space is = + - @ (or their
// full-width forms), a tab or a carriage return would be run as a formula
// (CSV injection), so it gets a leading apostrophe.
func SafeCell(s string) string {
	t := strings.TrimLeft(s, " ")
	if t == "" {
		return s
	}
	r, _ := utf8.DecodeRuneInString(t)
	if strings.ContainsRune("=+-@\t\r＝＋－＠", r) {
		return "'" + s
	}
	return s
}
