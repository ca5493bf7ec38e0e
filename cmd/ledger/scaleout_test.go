package main

import (
	"strings"
	"testing"
)

// TestScaleOutKillOneExecutor kills one of three executor processes for
// good while calls keep arriving. Before the kill the three members of
// the executor group share the events topic's partitions. After it the
// two survivors hold all of them, the dead one's among them. Every call
// must still finish, with no effect twice at the tools: the survivors
// take over the dead one's partitions, and its claims once their leases
// expire.
func TestScaleOutKillOneExecutor(t *testing.T) {
	const partitions = 12 // chaos's topics
	rep := runChaosCmd(t,
		"--duration", "30s", "--rate", "40", "--min-calls", "800",
		"--min-crashes", "0", "--pause=false", "--executors", "3",
		"--kill-executor-after", "10s", "--drain", "2m",
		// Tools the reconciler resolves: every call must end terminal,
		// where the killed executor's emails in flight would be parked.
		"--mix", "create_ticket=2,refund_order=1,get_weather=1",
	)
	a := rep.Assignment
	if a == nil {
		t.Fatal("report has no executor group assignment; want the group before and after the kill")
	}
	t.Logf("killed %s; before %v; after %v (settled in %s)", a.Killed, a.Before, a.After, a.SettledIn)
	if a.Problem != "" {
		t.Errorf("assignment problem %q; want none", a.Problem)
	}

	// Before: three executors, each with some partitions, all partitions
	// owned once.
	if len(a.Before) != 3 {
		t.Errorf("%d members before the kill (%v); want 3", len(a.Before), a.Before)
	}
	for name, parts := range a.Before {
		if !strings.HasPrefix(name, "executor-") || len(parts) == 0 {
			t.Errorf("before the kill member %q owns %v; want an executor slot with at least one partition", name, parts)
		}
	}
	checkOwnsAll(t, "before the kill", a.Before, partitions)
	if _, ok := a.Before[a.Killed]; !ok {
		t.Fatalf("killed %q is not among the members before the kill %v", a.Killed, a.Before)
	}

	// After: exactly the two survivors, all partitions between them,
	// the dead one's included.
	if len(a.After) != 2 {
		t.Errorf("%d members after the kill (%v); want the 2 survivors", len(a.After), a.After)
	}
	for name := range a.Before {
		if _, ok := a.After[name]; ok == (name == a.Killed) {
			t.Errorf("after the kill of %s, member %s present: %v; want only the survivors", a.Killed, name, ok)
		}
	}
	after := checkOwnsAll(t, "after the kill", a.After, partitions)
	for _, p := range a.Before[a.Killed] {
		if owner := after[p]; owner == "" || owner == a.Killed {
			t.Errorf("partition %d of the killed %s is owned by %q after the kill; want a survivor", p, a.Killed, owner)
		}
	}

	// The work: every call terminal, nothing lost or twice, and the dead
	// executor neither restarted nor counted as an unexpected exit.
	c := rep.Check
	if c.Submitted < 800 || c.Terminal != c.Submitted || c.StoreChecked != c.Submitted || rep.Load.Lost != 0 {
		t.Errorf("submitted %d, terminal %d, store records checked %d, lost by the driver %d; want every one of at least 800 terminal, none lost",
			c.Submitted, c.Terminal, c.StoreChecked, rep.Load.Lost)
	}
	if f := c.Failures(); len(f) != 0 || rep.Witness.Duplicates != 0 || c.Effects == 0 {
		t.Errorf("failures %q, duplicates at the tools %d, effects %d; want none, 0, some", f, rep.Witness.Duplicates, c.Effects)
	}
	if rep.UnexpectedExits != 0 || rep.Restarts["executor"] != 0 {
		t.Errorf("%d unexpected exits, %d executor restarts; want none of either", rep.UnexpectedExits, rep.Restarts["executor"])
	}
}

// checkOwnsAll checks that owners hold partitions 0..n-1, each exactly
// once, and returns each partition's owner.
func checkOwnsAll(t *testing.T, when string, owners map[string][]int32, n int32) map[int32]string {
	t.Helper()
	owner := map[int32]string{}
	for name, parts := range owners {
		for _, p := range parts {
			if prev, dup := owner[p]; dup {
				t.Errorf("%s partition %d owned by both %s and %s; want one owner", when, p, prev, name)
			}
			owner[p] = name
		}
	}
	for p := range n {
		if _, ok := owner[p]; !ok {
			t.Errorf("%s partition %d has no owner (%v); want all %d owned", when, p, owners, n)
		}
	}
	if len(owner) != int(n) {
		t.Errorf("%s %d partitions owned (%v); want exactly 0..%d", when, len(owner), owners, n-1)
	}
	return owner
}
