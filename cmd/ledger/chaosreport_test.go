package main

import (
	"io"
	"strings"
	"testing"

	"github.com/toolcall-ledger/ledger/processors/loadtest"
)

// A chaos run fails on an attempt sent to the tool twice, as the bench
// does: the run's tools with effects deduplicate by key, so the witness's
// duplicate sends are what sees the executor sending twice. Before, the
// run computed them and passed whatever they were.
func TestChaosFailsOnDuplicateSends(t *testing.T) {
	r := chaosReport{Witness: loadtest.Witness{Effects: 10, Replays: 1, DuplicateSends: 1}}
	bad := strings.Join(r.failures(nil), "; ")
	if !strings.Contains(bad, "1 calls with an attempt sent to the tool twice") {
		t.Errorf("failures = %q; want the attempt sent twice", bad)
	}
	var out strings.Builder
	if err := r.writeTable(&out, nil); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "1 sent twice") {
		t.Errorf("the table does not show the attempt sent twice:\n%s", out.String())
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
