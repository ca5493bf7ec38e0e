package main

import (
	"path/filepath"
	"slices"
	"testing"
)

// Every process of a chaos run that mints credentials (the executors and
// the reconciler) keeps its keys in a directory of its own: the broker
// rotates and publishes keys there, and two brokers in one directory
// would race at a rotation.
func TestChaosSlotsKeepTheirOwnKeys(t *testing.T) {
	dir := t.TempDir()
	seen := map[string]string{}
	for _, s := range chaosSlots(dir, 3, "http://127.0.0.1:1", "jwks.json", nil, []string{"--crdb-dsn", "postgres://x"}) {
		if s.role == "intake" {
			continue
		}
		keys := credentialKeyDir(s.args)
		if keys == "" {
			t.Errorf("%s: %q has neither --credential-key-dir nor --data-dir", s.name, s.args)
			continue
		}
		if other, ok := seen[keys]; ok {
			t.Errorf("%s and %s both keep their credential keys in %s", other, s.name, keys)
		}
		seen[keys] = s.name
	}
	if len(seen) != 4 {
		t.Errorf("credential key directories %v; want one for each of 3 executors and the reconciler", seen)
	}
}

// credentialKeyDir is where a role started with args keeps its credential
// keys: --credential-key-dir, by default <data-dir>/credentials.
func credentialKeyDir(args []string) string {
	flag := func(name string) string {
		if i := slices.Index(args, name); i >= 0 && i+1 < len(args) {
			return args[i+1]
		}
		return ""
	}
	if d := flag("--credential-key-dir"); d != "" {
		return d
	}
	if d := flag("--data-dir"); d != "" {
		return filepath.Join(d, "credentials")
	}
	return ""
}
