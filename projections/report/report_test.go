package report

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

func TestSafeCell(t *testing.T) {
	for in, want := range map[string]string{
		"":                  "",
		"ord_42":            "ord_42",
		"=HYPERLINK(\"x\")": "'=HYPERLINK(\"x\")",
		"+1":                "'+1",
		"-2+3":              "'-2+3",
		"@SUM(A1)":          "'@SUM(A1)",
		"  =1+1":            "'  =1+1",
		"＝1+1":              "'＝1+1",
		"\t=1":              "'\t=1",
		"a=b":               "a=b",
	} {
		if got := SafeCell(in); got != want {
			t.Errorf("SafeCell(%q) = %q; want %q", in, got, want)
		}
	}
}

// Values from agents and tools cannot break a CSV row, run as a formula,
// or move a terminal's cursor.
func TestHostileValues(t *testing.T) {
	c := projections.Call{
		TenantID: "t_a", IdempotencyKey: "k\n1,\"x\"", Tool: "refund_order", State: statemachine.StateSucceeded,
		Resource: "=cmd|' /C calc'!A0", Reason: "\x1b[2J\x1b[Hcleared", UpdatedAt: time.Unix(0, 0),
	}
	var buf bytes.Buffer
	if err := CallsCSV(&buf, []projections.Call{c}); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&buf).ReadAll()
	if err != nil || len(rows) != 2 {
		t.Fatalf("CSV of a hostile call: %d rows, %v", len(rows), err)
	}
	if rows[1][2] != c.IdempotencyKey || rows[1][7] != "'"+c.Resource {
		t.Errorf("CSV cells %q, %q; want the key intact and the resource quoted as text", rows[1][2], rows[1][7])
	}
	buf.Reset()
	if err := CallsTable(&buf, []projections.Call{c}); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(buf.String(), "\x1b") || strings.Count(buf.String(), "\n") != 2 {
		t.Errorf("table of a hostile call:\n%q", buf.String())
	}
	note := EventNote(ledger.Event{Type: statemachine.EventFailed, Seq: 4, Reason: c.Reason, Detail: "line\nbreak"})
	if strings.ContainsAny(note, "\x1b\n") {
		t.Errorf("EventNote keeps control characters: %q", note)
	}
}

// A call's events table names the credential of each event that names
// one: the executing event of a call taken over names the dead owners'
// families (the latest, then those before it), its outcome the new
// owner's.
func TestEventsTableNamesEachCredential(t *testing.T) {
	var buf bytes.Buffer
	if err := EventsTable(&buf, []ledger.Event{
		{Type: statemachine.EventExecuting, Seq: 3, Attempt: 1, JTI: "jti-1", CredentialFamily: "create_ticket:t_a:1", EarlierCredentialFamilies: []string{"create_ticket:t_a:0", "create_ticket:t_b:0"}},
		{Type: statemachine.EventSucceeded, Seq: 4, Attempt: 2, JTI: "jti-1", CredentialFamily: "create_ticket:t_a:2"},
	}); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 3 || !strings.Contains(lines[1], "jti=jti-1 family=create_ticket:t_a:1 earlier_families=create_ticket:t_a:0,create_ticket:t_b:0") ||
		!strings.Contains(lines[2], "jti=jti-1 family=create_ticket:t_a:2") || strings.Contains(lines[2], "earlier") {
		t.Errorf("events table:\n%s\nwant each event's jti and families", buf.String())
	}
}

// A call's events table shows each event's detail: who asked for a
// compensation and why, an operator's evidence for a resolution. Before,
// only --json did, though the README sends operators to the table. A
// long one is cut, and --json has it whole.
func TestEventsTableShowsDetail(t *testing.T) {
	var buf bytes.Buffer
	long := strings.Repeat("x", 2*maxNoteDetail)
	if err := EventsTable(&buf, []ledger.Event{
		{Type: statemachine.EventRequested, Seq: 1, Detail: "asked for by u_approver: goods returned"},
		{Type: statemachine.EventSucceeded, Seq: 6, Reason: "resolved_by_operator", Detail: long},
	}); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 3 || !strings.Contains(lines[1], `detail="asked for by u_approver: goods returned"`) ||
		!strings.Contains(lines[2], `detail="`+long[:maxNoteDetail]+`…"`) || strings.Contains(lines[2], long[:maxNoteDetail+1]) {
		t.Errorf("events table:\n%s\nwant each event's detail, a long one cut at %d characters", buf.String(), maxNoteDetail)
	}
}

// A blast radius's counts are cut at projections.MaxCounts values: the
// table says how many values each has, from the answer's Distinct, not
// how many it lists.
func TestBlastRadiusTableCountsCut(t *testing.T) {
	br := projections.BlastRadius{
		Total:    60000,
		ByTenant: []projections.Count{{Value: "t_a", Calls: 60000}},
		ByState:  []projections.Count{{Value: "succeeded", Calls: 60000}},
		ByTool:   []projections.Count{{Value: "refund_order", Calls: 60000}},
		Distinct: projections.Distinct{Tenants: 1, States: 1, Tools: 1, Resources: 53211},
	}
	br.ByResource = append(br.ByResource, projections.Count{Value: "", Calls: 5000})
	for i := range projections.MaxCounts - 1 {
		br.ByResource = append(br.ByResource, projections.Count{Value: fmt.Sprintf("ord_%05d", i), Calls: 2})
	}
	var buf bytes.Buffer
	if err := BlastRadiusTable(&buf, br); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	// The empty value is no resource.
	for _, want := range []string{"60000 calls, 1 tenants, 53210 resources\n", "(53191 more)"} {
		if !strings.Contains(out, want) {
			t.Errorf("table of a cut blast radius lacks %q:\n%s", want, out)
		}
	}
}

// Invisible holds the runes drawn as nothing though printable (Unicode
// calls them default ignorable: variation selectors, the combining
// grapheme joiner, Hangul fillers; and the braille blank) with the ones
// that are not printable, and leaves letters, marks that show, symbols
// and ASCII's space alone. Before, "acme-payroll\u034f" showed as
// acme-payroll on an approval page that offered its Approve button.
func TestInvisible(t *testing.T) {
	for _, r := range []rune{'\u034f', '\ufe0f', '\U000e0100', '\u180b', '\u115f', '\u3164', '\uffa0', '\u2800', '\u202e', '\u200b', '\u009b', '\u00a0', '\n'} {
		if !Invisible(r) {
			t.Errorf("Invisible(%U) = false; want true", r)
		}
	}
	for _, r := range []rune{'a', ' ', '\u00e9', '\u0301', '\u6771', '\U0001f44d', '\u0639', '-'} {
		if Invisible(r) {
			t.Errorf("Invisible(%U) = true; want false", r)
		}
	}
	if got := Printable("acme-payroll\u034f"); got != "acme-payroll?" {
		t.Errorf("Printable = %q; want the joiner shown as ?", got)
	}
}

// TerminalText keeps a CSV's lines and tabs and replaces what would clear,
// repaint or reorder a terminal (ESC, a carriage return, a C1 control, a
// bidi override) with '?'; text with none of them is returned as it is.
func TestTerminalText(t *testing.T) {
	in := "tenant,resource\nt_a,\"acct \x1b[2J\rall \u009bclear\u202e\"\nt_b,\tok Zürich\n"
	want := "tenant,resource\nt_a,\"acct ?[2J?all ?clear?\"\nt_b,\tok Zürich\n"
	if got := string(TerminalText([]byte(in))); got != want {
		t.Errorf("TerminalText = %q; want %q", got, want)
	}
	if plain := []byte("a,b\n"); &TerminalText(plain)[0] != &plain[0] {
		t.Error("TerminalText copied text with nothing to replace")
	}
}

// TerminalJSON escapes what a terminal would not show as it is (C1
// controls, bidi overrides, zero-width and other format characters, an
// astral one as a surrogate pair), leaves the rest (letters of any
// script, emoji, JSON's own layout) alone, and the result decodes to the
// same strings.
func TestTerminalJSON(t *testing.T) {
	in := map[string]string{
		"subject": "refund \u009b8mhidden\u202e\u200b ok",
		"tag":     "x\U000E0001y",
		"shown":   "Zürich 東京 👍 \"quoted\"",
	}
	b, err := json.MarshalIndent(in, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	out := TerminalJSON(b)
	if strings.ContainsAny(string(out), "\u009b\u202e\u200b\U000E0001") {
		t.Errorf("TerminalJSON left a hidden rune: %q", out)
	}
	for _, want := range []string{`\u009b`, `\u202e`, `\u200b`, `\udb40\udc01`, "Zürich 東京 👍", "\n  \""} {
		if !strings.Contains(string(out), want) {
			t.Errorf("TerminalJSON(%s) = %s; want it to hold %q", b, out, want)
		}
	}
	var back map[string]string
	if err := json.Unmarshal(out, &back); err != nil || !maps.Equal(back, in) {
		t.Errorf("TerminalJSON's output decodes to %q (%v); want %q", back, err, in)
	}
	if plain := []byte(`{"a": "b"}`); &TerminalJSON(plain)[0] != &plain[0] {
		t.Error("TerminalJSON copied a document with nothing to escape")
	}
}

// A call's requested event names the definition of its tool the call is
// bound to, shortened, and the later events, which carry the same, do
// not repeat it; the CSV of calls has it whole, in its last column.
func TestReportsNameTheToolDefinition(t *testing.T) {
	digest := "sha256:ee73feadf9785bb74043d9d7feab3b832debf6925884d394230384e60fdcdaf5"
	if note := EventNote(ledger.Event{Type: statemachine.EventRequested, Seq: 1, ToolDigest: digest}); !strings.Contains(note, "tool_def="+digest[:19]+"…") {
		t.Errorf("requested event's note %q; want tool_def= and the digest's start", note)
	}
	if note := EventNote(ledger.Event{Type: statemachine.EventSucceeded, Seq: 4, ToolDigest: digest}); strings.Contains(note, "tool_def") {
		t.Errorf("succeeded event's note %q; want the definition said once, on requested", note)
	}
	var buf bytes.Buffer
	if err := CallsCSV(&buf, []projections.Call{{TenantID: "t_a", IdempotencyKey: "k1", ToolDigest: digest, UpdatedAt: time.Unix(0, 0)}}); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&buf).ReadAll()
	if err != nil || len(rows) != 2 {
		t.Fatalf("CSV: %d rows, %v", len(rows), err)
	}
	if last := len(rows[0]) - 1; rows[0][last] != "tool_digest" || rows[1][last] != digest {
		t.Errorf("CSV's last column %q = %q; want tool_digest = %q", rows[0][last], rows[1][last], digest)
	}
}

// The tables' times are UTC, and their headers say so, as the trace's
// and the CSV's times do with their Z: read as local time, they sent a
// responder east of UTC to ask about the wrong hours.
func TestTablesNameTheirZone(t *testing.T) {
	at := time.Date(2026, 12, 7, 2, 0, 0, 0, time.UTC)
	var calls, outcomes strings.Builder
	if err := CallsTable(&calls, []projections.Call{{UpdatedAt: at, TenantID: "t_a", IdempotencyKey: "k"}}); err != nil {
		t.Fatal(err)
	}
	if err := OutcomesTable(&outcomes, []projections.OutcomeCount{{Bucket: at, Tool: "get_weather", Calls: 1}}); err != nil {
		t.Fatal(err)
	}
	for name, out := range map[string]string{"calls": calls.String(), "outcomes": outcomes.String()} {
		header, row, _ := strings.Cut(out, "\n")
		if !strings.Contains(header, "(UTC)") || !strings.Contains(row, "2026-12-07 02:00:00") {
			t.Errorf("%s table:\n%s\nwant its time column named UTC, 02:00 shown", name, out)
		}
	}
}
