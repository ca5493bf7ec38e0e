package main

import (
	"io"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
)

// TestGCPercent checks that --gc-percent sets the collector's target, that
// its default is the ledger's, and that GOGC in the environment wins.
func TestGCPercent(t *testing.T) {
	orig, had := os.LookupEnv("GOGC")
	prev := debug.SetGCPercent(100)
	t.Cleanup(func() {
		debug.SetGCPercent(prev)
		if had {
			os.Setenv("GOGC", orig)
		} else {
			os.Unsetenv("GOGC")
		}
	})

	f := newRoot().PersistentFlags().Lookup("gc-percent")
	if f == nil || f.DefValue != strconv.Itoa(defaultGCPercent) {
		t.Fatalf("--gc-percent flag = %+v, want default %d", f, defaultGCPercent)
	}

	os.Unsetenv("GOGC")
	(&globals{gcPercent: 250}).applyGC()
	if got := debug.SetGCPercent(100); got != 250 {
		t.Errorf("GOGC unset: collector target %d, want 250 from --gc-percent", got)
	}

	os.Setenv("GOGC", "100")
	(&globals{gcPercent: 250}).applyGC()
	if got := debug.SetGCPercent(100); got != 100 {
		t.Errorf("GOGC=100 set: collector target %d, want GOGC's 100", got)
	}
}

// With --json, a command that fails says why as JSON, as the API's errors
// are: its code (an API answer's, unexpected_answer for an answer that
// is not the API's, a decode error's, else "failed"), its
// message, and the status and pointer where it has them. Without --json
// it is a line of text, as before. Before, --json's failures were text
// alone, which a script reading --json could not tell apart.
func TestErrorsAsJSON(t *testing.T) {
	srv := answeringWith(t, http.MethodPost, "/v1/control/freeze", http.StatusForbidden, `{"error":{"code":"forbidden","message":"not an operator"}}`)
	proxy := answeringWith(t, http.MethodPost, "/v1/control/freeze", http.StatusBadGateway, `<html>502 Bad Gateway</html>`)
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"an API's refusal", []string{"control", "freeze", "--tool", "t", "--reason", "r", "--api", srv.URL, "--assertion", "tok", "--json"},
			`{"error":{"code":"forbidden","message":"POST /v1/control/freeze: 403 forbidden: not an operator","status":403}}`},
		{"bad arguments", []string{"submit", "--tool", "get_weather", "--args", `{city:"x"}`, "--json", "--data-dir", t.TempDir()},
			`"code":"invalid_json"`},
		{"not the API's answer", []string{"control", "freeze", "--tool", "t", "--reason", "r", "--api", proxy.URL, "--assertion", "tok", "--json"},
			`{"error":{"code":"unexpected_answer","message":"POST /v1/control/freeze: 502 unexpected_answer: Bad Gateway","status":502}}`},
		{"anything else", []string{"control", "freeze", "--tool", "t", "--api", srv.URL, "--assertion", "tok", "--json"},
			`{"error":{"code":"failed","message":"--reason is required: every control action says why"}}`},
		{"without --json", []string{"control", "freeze", "--tool", "t", "--api", srv.URL, "--assertion", "tok"},
			"ledger: --reason is required: every control action says why"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := newRoot()
			root.SetArgs(tc.args)
			root.SetOut(io.Discard)
			root.SetErr(io.Discard)
			cmd, err := root.ExecuteContextC(t.Context())
			if err == nil {
				t.Fatal("the command succeeded; want it to fail")
			}
			var out strings.Builder
			reportError(&out, cmd, err)
			if !strings.Contains(out.String(), tc.want) {
				t.Errorf("reported:\n%s\nwant it to hold %s", out.String(), tc.want)
			}
		})
	}
}
