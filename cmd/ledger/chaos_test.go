//go:build failpoints

package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestChaosBounded is the bounded part of the reliability suite that `make
// test` runs: `ledger chaos` with an intake, three executors and a
// reconciler as processes of their own on PostgreSQL, every failpoint hit
// (and every executor pause taken) at least five times under load (the
// load goes on past its minute until they are, up to four), and the whole
// history checked. The command fails on any duplicate, lost or
// orphan effect, illegal transition or visible aborted event, or a point
// hit too rarely, or an effect under a credential no event of its call
// names; the test checks the report besides.
func TestChaosBounded(t *testing.T) {
	history := filepath.Join(t.TempDir(), "history.jsonl")
	rep := runChaosCmd(t,
		"--duration", "60s", "--max-duration", "4m", "--rate", "40", "--min-calls", "2000",
		"--min-crashes", "5", "--executors", "3", "--drain", "3m", "--history", history,
	)
	c := rep.Check
	// An email (send_email: no idempotency, no status lookup) whose
	// request may have reached the tool before a crash is parked for a
	// human; every other call ends terminal.
	emails := emailsOf(t, history)
	if rep.Load.Submitted < 2000 || c.Submitted != int(rep.Load.Submitted) || c.Terminal+emails.parked != c.Submitted {
		t.Errorf("submitted %d, checked %d, terminal %d, emails parked %d: want every one of at least 2000 calls terminal, or an email parked", rep.Load.Submitted, c.Submitted, c.Terminal, emails.parked)
	}
	// The tool without idempotency ran in the load: what I1 is about.
	if emails.succeeded < 50 {
		t.Errorf("%d emails (send_email) succeeded; want at least 50", emails.succeeded)
	}
	if rep.SpentCredentials != 0 {
		t.Errorf("%d requests under a spent credential; want none", rep.SpentCredentials)
	}
	if c.Lost+c.DuplicateEffects+c.OrphanEffects+c.MissingEffects+c.IllegalTransitions+c.Unresolved+c.UnnamedCredentials != 0 || c.AbortedVisible != 0 {
		t.Errorf("check: %v", c.Failures())
	}
	if c.StoreChecked != c.Submitted || c.StoreDisagreements != 0 {
		t.Errorf("store: %d records checked of %d calls, %d disagree with the log", c.StoreChecked, c.Submitted, c.StoreDisagreements)
	}
	if c.Effects == 0 || c.Events == 0 {
		t.Errorf("check saw %d effects and %d events: nothing was checked", c.Effects, c.Events)
	}
	// Each call's time to its terminal state is from its first
	// publication to its terminal event in the log (past an
	// outcome_unknown, the reconciler's time included): within the run.
	if c.TimeToTerminalP50 <= 0 || c.TimeToTerminalP99 < c.TimeToTerminalP50 || c.TimeToTerminalP99 > 7*time.Minute {
		t.Errorf("time to terminal p50 %s, p99 %s: want within the run", c.TimeToTerminalP50, c.TimeToTerminalP99)
	}
	// The backend verifies credentials: every effect has its request's
	// jti, for unnamed_credentials to check.
	if c.CredentialEffects < c.Effects {
		t.Errorf("%d effects recorded with a jti of %d new ones: want every one", c.CredentialEffects, c.Effects)
	}
	// Crashes before EndTxn leave aborted transactions in the log; a
	// run without any did not test what it claims to.
	if c.AbortedRecords == 0 {
		t.Errorf("no aborted records in the log after %d crashes before EndTxn", rep.Crashes["executor.produced"]+rep.Crashes["intake.produced"])
	}
	// The history: every envelope as submitted, tokens redacted, and
	// every call's outcome.
	hb, err := os.ReadFile(history)
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]int64{}
	for line := range strings.SplitSeq(strings.TrimSpace(string(hb)), "\n") {
		var h struct{ Event, Key, State string }
		if err := json.Unmarshal([]byte(line), &h); err != nil {
			t.Fatalf("history line %q: %v", line, err)
		}
		kinds[h.Event]++
	}
	// An envelope sent again (refused for now) has a line of its own.
	if kinds["submitted"] != rep.Load.Submitted+rep.Load.RetriedLater || kinds["outcome"] != rep.Load.Submitted {
		t.Errorf("history has %v; want %d submitted (%d calls, %d sent again) and %d outcomes", kinds,
			rep.Load.Submitted+rep.Load.RetriedLater, rep.Load.Submitted, rep.Load.RetriedLater, rep.Load.Submitted)
	}
	if strings.Contains(string(hb), "eyJ") {
		t.Error("history holds what looks like a token; want assertions redacted")
	}
	for _, p := range []string{"intake.consumed", "intake.produced", "intake.committed",
		"executor.consumed", "executor.claim-sent", "executor.claimed", "executor.tool-applied",
		"executor.response-received", "executor.result-written", "executor.produced", "executor.committed", pausePoint} {
		if rep.Crashes[p] < 5 {
			t.Errorf("%s hit %d times; want at least 5", p, rep.Crashes[p])
		}
	}
}
