package main

import (
	"io"
	"strings"
	"testing"

	"github.com/toolcall-ledger/ledger/processors/loadtest"
)

// A chaos run fails on what the tool saw sent twice, whatever counts it:
//   - an attempt sent twice, as the bench does: the run's tools with
//     effects deduplicate by key, so the witness's duplicate sends are
//     what sees the executor sending twice (before, the run computed
//     them and passed whatever they were);
//   - a request under a credential its effect already spent: the backend
//     refuses it (a tool without idempotency spends the jti with its
//     effect), so the witness's duplicate effects never see it.
func TestChaosFailsOnWhatTheToolSawTwice(t *testing.T) {
	for _, tc := range []struct {
		name           string
		report         chaosReport
		failure, table string
	}{
		{"attempt sent twice", chaosReport{Witness: loadtest.Witness{Effects: 10, Replays: 1, DuplicateSends: 1}},
			"1 calls with an attempt sent to the tool twice", "1 sent twice"},
		{"spent credential", chaosReport{Witness: loadtest.Witness{Effects: 10}, SpentCredentials: 2},
			"2 requests sent again under a credential already spent", "2 under a spent credential"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if bad := strings.Join(tc.report.failures(nil), "; "); !strings.Contains(bad, tc.failure) {
				t.Errorf("failures = %q; want %q", bad, tc.failure)
			}
			var out strings.Builder
			if err := tc.report.writeTable(&out, nil); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out.String(), tc.table) {
				t.Errorf("the table does not show %q:\n%s", tc.table, out.String())
			}
		})
	}
}

// --tenants below 1 is refused before the run: the load driver took it
// for 8 and the check built the calls' keys with it, dividing by zero
// after the whole run (or, negative, counting most calls lost).
func TestChaosTenantsAtLeastOne(t *testing.T) {
	for _, n := range []string{"0", "-3"} {
		root := newRoot()
		root.SetArgs([]string{"chaos", "--crdb-dsn", "postgres://unused", "--min-crashes", "0", "--tenants", n})
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		err := root.ExecuteContext(t.Context())
		if err == nil || !strings.Contains(err.Error(), "--tenants must be at least 1") {
			t.Errorf("ledger chaos --tenants %s: err %v; want it refused", n, err)
		}
	}
}
