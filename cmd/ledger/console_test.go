package main

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// Script that must never run: arguments and, through the demo weather
// tool, results carry it to every page that shows a call.
var hostileCities = []string{
	`<img src=x onerror="window.__pwned='img';alert('img')">`,
	`"><script>window.__pwned='script';alert('script')</script>`,
	`javascript:window.__pwned='href';alert('href')`,
}

// The console in a real browser against `ledger dev`: an approver signs
// in with the dev login, approves a pending refund and sees it succeed,
// rejects another; a responder asks a blast radius and exports it as
// CSV, freezes a tool from the incident page and sees the next call
// denied; and script injected through tool arguments and results never
// runs on any page.
func TestConsoleInBrowser(t *testing.T) {
	dir := t.TempDir()
	addrs := freeAddrs(t, 3)
	kafka, api, backend := addrs[0], addrs[1], addrs[2]
	startDev(t, dir, kafka, api, backend)
	base := "http://" + api
	// The approvals must outlive the test: a call's approval expires with
	// its deadline.
	submit := func(tool, args, key string) string {
		return cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", tool, "--args", args, "--key", key, "--deadline", "10m", "--wait", "--timeout", "60s")
	}
	for i, city := range hostileCities {
		if out := submit("get_weather", fmt.Sprintf(`{"city":%q}`, city), fmt.Sprintf("xss-%d", i)); !strings.Contains(out, "is succeeded") {
			t.Fatalf("hostile weather call %d:\n%s", i, out)
		}
	}
	for _, k := range []string{"ui-refund-ok", "ui-refund-no"} {
		if out := submit("refund_order", `{"order_id":"ord_`+strings.ReplaceAll(k, "-", "")+`","amount_cents":45000,"currency":"AUD"}`, k); !strings.Contains(out, "approval_pending") {
			t.Fatalf("refund %s:\n%s", k, out)
		}
	}

	b := newBrowser(t)
	text := func(sel string) string {
		t.Helper()
		return get(t, b, "text of "+sel, chromedp.Text(chromedp.CSS(sel)))
	}
	page := func(path string) string {
		t.Helper()
		b.do(t, "open "+path, chromedp.Navigate(base+path), chromedp.WaitVisible(chromedp.CSS("main")))
		return text("main")
	}
	// With LEDGER_SCREENSHOTS_DIR set (make screenshots), the pages are
	// saved as the browser shows them, at 1280x800.
	shots := os.Getenv("LEDGER_SCREENSHOTS_DIR")
	shoot := func(name string) {
		t.Helper()
		if shots == "" {
			return
		}
		png := get(t, b, "screenshot "+name, chromedp.CaptureScreenshot())
		if err := os.WriteFile(filepath.Join(shots, name+".png"), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The detector detects: a page that runs script is caught.
	b.do(t, "open a page that runs script", chromedp.Navigate(`data:text/html,<script>window.__pwned="control";alert("control")</script>`))
	if got := get(t, b, "read window.__pwned", chromedp.Evaluate[string](`String(window.__pwned)`)); got != "control" {
		t.Fatalf("the control page's script did not run (window.__pwned=%s): the check below would prove nothing", got)
	}
	ledgertest.WaitFor(t, 5*time.Second, func() error {
		if len(b.opened()) != 1 {
			return fmt.Errorf("dialogs %v, want the control's alert", b.opened())
		}
		return nil
	})
	b.mu.Lock()
	b.dialogs = nil
	b.mu.Unlock()
	noScriptRan := func(where string) {
		t.Helper()
		pwned := get(t, b, "read window.__pwned", chromedp.Evaluate[string](`String(window.__pwned)`))
		if pwned != "undefined" || len(b.opened()) > 0 {
			t.Fatalf("injected script ran on %s: window.__pwned=%s, dialogs %v", where, pwned, b.opened())
		}
	}

	// Sign in with the dev login.
	b.do(t, "open the sign-in page", chromedp.Navigate(base+"/login"), chromedp.WaitVisible(chromedp.CSS("main")))
	shoot("login")
	b.do(t, "dev login",
		chromedp.Click(chromedp.CSS(`form[action="/login/dev"] button`)),
		// Only a signed-in page has the sign-out form.
		chromedp.WaitVisible(chromedp.CSS(`form[action="/logout"]`)))
	if loc := get(t, b, "location", chromedp.Location()); !strings.HasSuffix(loc, "/approvals") {
		t.Fatalf("after the dev login the browser is at %s, want /approvals:\n%s", loc, text("body"))
	}

	// Approve one refund, bound to the hash on the page; it runs.
	ok := ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "ui-refund-ok"}
	queue := page("/approvals")
	shoot("approvals")
	for _, want := range []string{"refund_order", "ord_uirefundok", "450.00 AUD"} {
		if !strings.Contains(queue, want) {
			t.Errorf("approvals page lacks %q:\n%s", want, queue)
		}
	}
	detail := page("/approvals/" + url.PathEscape(ok.ApprovalID()))
	shoot("approval")
	if !strings.Contains(detail, "sha256:") {
		t.Errorf("approval page shows no arguments hash:\n%s", detail)
	}
	b.do(t, "approve", chromedp.Click(chromedp.CSS(`form[action$="/approve"] button`)), chromedp.WaitVisible(chromedp.CSS(".flash")))
	if flash := text(".flash"); !strings.Contains(strings.ToLower(flash), "approved") {
		t.Errorf("flash after approving: %q", flash)
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if body := page("/calls/t_demo/ui-refund-ok"); !strings.Contains(body, "succeeded") {
			return fmt.Errorf("the approved refund's page does not show it succeeded yet")
		}
		return nil
	})
	shoot("call")

	// Reject the other, with a reason.
	no := ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "ui-refund-no"}
	page("/approvals/" + url.PathEscape(no.ApprovalID()))
	b.do(t, "reject", chromedp.SendKeys(chromedp.CSS(`form[action$="/reject"] textarea`), "customer withdrew the request"),
		chromedp.Click(chromedp.CSS(`form[action$="/reject"] button`)), chromedp.WaitVisible(chromedp.CSS(".flash")))
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if body := page("/calls/t_demo/ui-refund-no"); !strings.Contains(body, "rejected") {
			return fmt.Errorf("the rejected refund's page does not show it rejected yet")
		}
		return nil
	})

	// A blast radius by tool, exported as CSV.
	radius := page("/incidents?tool=get_weather&tenant=t_demo&since=1h")
	if !strings.Contains(radius, "t_demo") || !strings.Contains(radius, "succeeded") {
		t.Errorf("incident page for get_weather:\n%s", radius)
	}
	noScriptRan("the incident page")
	shoot("incidents")
	csv := get(t, b, "fetch the CSV export", chromedp.Evaluate[string](
		`fetch(document.querySelector('a[href^="/incidents.csv"]').href).then(r => r.text())`, chromedp.EvalAwaitPromise))
	rows := strings.Split(strings.TrimSpace(csv), "\n")
	if len(rows) != 1+len(hostileCities) || !strings.Contains(rows[0], "idempotency_key") {
		t.Errorf("CSV export: %d rows, want a header and %d calls:\n%s", len(rows), len(hostileCities), csv)
	}

	// Freeze the tool from the incident page; the next call is denied.
	b.do(t, "freeze", chromedp.Click(chromedp.CSS(`a[href*="freeze"]`)), chromedp.WaitVisible(chromedp.CSS(`form[action="/incidents/act"]`)))
	if confirm := text("main"); !strings.Contains(confirm, "get_weather") {
		t.Errorf("freeze confirmation does not name the tool:\n%s", confirm)
	}
	shoot("confirm")
	b.do(t, "confirm freeze", chromedp.SendKeys(chromedp.CSS(`form[action="/incidents/act"] textarea`), "incident 7: leaked credential"),
		chromedp.Click(chromedp.CSS(`form[action="/incidents/act"] button`)), chromedp.WaitVisible(chromedp.CSS(".flash")))
	if out := submit("get_weather", `{"city":"Oslo"}`, "after-freeze"); !strings.Contains(out, "tool_frozen") {
		t.Errorf("a call after the freeze:\n%s", out)
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		// Refused at intake: a refused submission under the key.
		if body := page("/calls/t_demo/after-freeze"); !strings.Contains(body, "Refused submissions") || !strings.Contains(body, "tool_frozen") {
			return fmt.Errorf("the call after the freeze does not show its refusal (tool_frozen) yet:\n%s", body)
		}
		return nil
	})
	if health := page("/health"); !strings.Contains(health, "get_weather") {
		t.Errorf("health page does not list the frozen tool:\n%s", health)
	}
	shoot("health")

	// Every page that shows the hostile calls, their arguments and results.
	for i := range hostileCities {
		page(fmt.Sprintf("/calls/t_demo/xss-%d", i))
		noScriptRan(fmt.Sprintf("call xss-%d", i))
	}
	page("/calls?tenant=t_demo&tool=get_weather")
	noScriptRan("the calls search")
	shoot("calls")
	page("/approvals")
	noScriptRan("the approvals page")
}
