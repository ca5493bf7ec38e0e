//go:build !failpoints

package main

import (
	"io"
	"strings"
	"testing"
)

// A binary built without failpoints cannot run the chaos suite, and says
// how to get one that can, rather than run a suite that injects nothing.
func TestChaosNeedsFailpoints(t *testing.T) {
	root := newRoot()
	root.SetArgs([]string{"chaos", "--crdb-dsn", "postgres://unused"})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	err := root.ExecuteContext(t.Context())
	if err == nil || !strings.Contains(err.Error(), "-tags failpoints") {
		t.Errorf("ledger chaos without failpoints: err %v; want one naming -tags failpoints", err)
	}
}
