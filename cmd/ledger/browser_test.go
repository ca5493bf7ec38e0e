package main

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// browser is a headless Chromium driven through the DevTools protocol. It
// records every JavaScript dialog a page opens (an alert from injected
// script would be one), and dismisses it.
type browser struct {
	ctx context.Context

	mu      sync.Mutex
	dialogs []string
}

// newBrowser starts Debian's Chromium (LEDGER_TEST_CHROMIUM, which
// deploy/testservices.sh sets) for t, at 1280x800, closed when t ends.
func newBrowser(t *testing.T) *browser {
	t.Helper()
	path := os.Getenv("LEDGER_TEST_CHROMIUM")
	if path == "" {
		const how = `install it with: eval "$(bash deploy/testservices.sh start)"`
		if os.Getenv("LEDGER_TEST_REQUIRE") == "1" {
			t.Fatal("LEDGER_TEST_CHROMIUM is not set and LEDGER_TEST_REQUIRE=1: the console's browser tests need Chromium; " + how)
		}
		t.Skip("SKIPPING: LEDGER_TEST_CHROMIUM is not set; " + how)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 800),
		// The machine has no network beyond loopback: nothing may try.
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("no-proxy-server", true),
	)
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancel()
		cancelAlloc()
	})
	b := &browser{ctx: ctx}
	// Start the browser now, so that a missing library fails here; the
	// page area itself is 1280x800, whatever the window's frame takes.
	if err := chromedp.Do(ctx, chromedp.EmulateViewport(1280, 800)); err != nil {
		t.Fatalf("start chromium %s: %v", path, err)
	}
	// A dialog blocks the page: record it and close it from here.
	dialogs := chromedp.Events(ctx, page.JavascriptDialogOpening)
	go func() {
		for ev, err := range dialogs {
			if err != nil {
				return
			}
			b.mu.Lock()
			b.dialogs = append(b.dialogs, ev.Message)
			b.mu.Unlock()
			_, _ = chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: false})
		}
	}()
	return b
}

// do runs actions with a deadline, failing t on error.
func (b *browser) do(t *testing.T, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		t.Fatalf("browser: %s: %v", what, err)
	}
}

// get runs one action that returns a value, failing t on error.
func get[T any](t *testing.T, b *browser, what string, a chromedp.Action[T]) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, a)
	if err != nil {
		t.Fatalf("browser: %s: %v", what, err)
	}
	return v
}

// opened returns the messages of the dialogs pages opened so far.
func (b *browser) opened() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.dialogs...)
}
