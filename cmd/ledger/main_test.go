package main

import (
	"os"
	"runtime/debug"
	"strconv"
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
