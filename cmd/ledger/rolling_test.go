package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// TestRollingRestartUnderLoad restarts the executor processes one at a
// time with SIGTERM, as a rolling deployment does, while calls keep
// arriving: each must exit cleanly, draining the calls it runs into the
// store, and the whole history must show nothing lost, duplicated or left
// behind (the same checks as the chaos suite, without crashes).
func TestRollingRestartUnderLoad(t *testing.T) {
	history := filepath.Join(t.TempDir(), "history.jsonl")
	rep := runChaosCmd(t,
		"--duration", "40s", "--rate", "40", "--min-calls", "1500",
		"--min-crashes", "0", "--pause=false", "--restart-every", "4s", "--executors", "3", "--drain", "3m",
		"--history", history,
	)
	c := rep.Check
	// An email whose claim lapsed in a restart (a drain that could not
	// record it in time) is parked, never sent again.
	emails := emailsOf(t, history)
	if emails.succeeded == 0 || rep.SpentCredentials != 0 {
		t.Errorf("%d emails succeeded, %d requests under a spent credential; want some, none", emails.succeeded, rep.SpentCredentials)
	}
	// 40 s at one restart every 4 s: about 9, each executor about 3 times.
	if rep.GracefulRestarts < 6 || rep.UnexpectedExits != 0 {
		t.Errorf("%d graceful restarts, %d unexpected exits; want at least 6 and none", rep.GracefulRestarts, rep.UnexpectedExits)
	}
	if c.Submitted < 1500 || c.Terminal+emails.parked != c.Submitted || c.StoreChecked != c.Submitted {
		t.Errorf("submitted %d, terminal %d, emails parked %d, store records checked %d; want every one of at least 1500 terminal, or an email parked", c.Submitted, c.Terminal, emails.parked, c.StoreChecked)
	}
	if f := c.Failures(); len(f) != 0 || rep.Witness.Duplicates != 0 || c.Effects == 0 {
		t.Errorf("failures %q, duplicates at the tools %d, effects %d; want none, 0, some", f, rep.Witness.Duplicates, c.Effects)
	}
}

// runChaosCmd runs `ledger chaos` with args on a fresh PostgreSQL schema,
// as an operator would, and returns its JSON report; the test fails if
// the command does.
// chaosEmails is what a chaos run's history says of its emails.
type chaosEmails struct {
	// succeeded and parked count the emails (send_email) that succeeded
	// and that the reconciler parked for a human.
	succeeded, parked int
}

// emailsOf reads a chaos run's history (--history), and fails the test
// for a parked call of another tool than send_email: the reconciler
// resolves those of every other tool of the load.
func emailsOf(t *testing.T, path string) chaosEmails {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var e chaosEmails
	emails := map[string]bool{}
	for line := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
		var h struct {
			Event, Key, State, Envelope string
			Parked                      bool
		}
		if err := json.Unmarshal([]byte(line), &h); err != nil {
			t.Fatalf("history line %q: %v", line, err)
		}
		switch {
		case h.Event == "submitted" && strings.Contains(h.Envelope, `"tool":"send_email"`):
			emails[h.Key] = true
		case h.Event != "outcome":
		case h.Parked && !emails[h.Key]:
			t.Errorf("call %s parked; only an email may be (the reconciler resolves every other tool)", h.Key)
		case h.Parked:
			e.parked++
		case emails[h.Key] && h.State == string(statemachine.StateSucceeded):
			e.succeeded++
		}
	}
	return e
}

func runChaosCmd(t *testing.T, args ...string) chaosReport {
	t.Helper()
	dsn := freshSchemaDSN(t)
	t.Setenv(runMainEnv, "1")
	// As the bench's, chaos's processes get the DSN in their environment.
	defer noChildArgument(t, dsnHost(t, dsn))()
	dir := t.TempDir()
	jsonOut := filepath.Join(dir, "chaos.json")
	var out, progress strings.Builder
	root := newRoot()
	root.SetArgs(append([]string{"--log-level", "warn", "chaos", "--crdb-dsn", dsn,
		"--json", jsonOut, "--work-dir", filepath.Join(dir, "work"), "--keep"}, args...))
	root.SetOut(&out)
	root.SetErr(&progress)
	err := root.ExecuteContext(t.Context())
	t.Logf("ledger chaos %s:\n%s", strings.Join(args, " "), out.String())
	if err != nil {
		t.Fatalf("ledger chaos: %v\nprogress:\n%s\nlogs in %s", err, progress.String(), filepath.Join(dir, "work"))
	}
	b, err := os.ReadFile(jsonOut)
	if err != nil {
		t.Fatal(err)
	}
	var rep chaosReport
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	return rep
}
