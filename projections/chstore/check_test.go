package chstore

import (
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
)

// TestMissingTables: a database never migrated lacks every table, and
// looking does not create it; after Migrate none is missing; a table
// dropped by hand is named.
func TestMissingTables(t *testing.T) {
	ctx := t.Context()
	s, err := Open(ctx, Config{DSN: chtest.DSN(t), Database: chtest.FreshDatabase(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	got, err := s.MissingTables(ctx)
	if err != nil {
		t.Fatalf("MissingTables() unmigrated = %v", err)
	}
	want := []string{"schema_migrations", "events", "event_keys", "call_refs", "calls", "control_actions", "projection_positions"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("MissingTables() unmigrated (-want +got):\n%s", diff)
	}
	var n uint64
	if err := s.conn.QueryRow(ctx, "SELECT count() FROM system.databases WHERE name = ?", s.db).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("after MissingTables(), database %s exists; want nothing created", s.db)
	}

	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate() = %v", err)
	}
	if got, err := s.MissingTables(ctx); err != nil || len(got) != 0 {
		t.Errorf("MissingTables() after Migrate = %q, %v; want none", got, err)
	}
	if err := s.conn.Exec(ctx, "DROP TABLE "+s.table("calls")); err != nil {
		t.Fatal(err)
	}
	if got, err := s.MissingTables(ctx); err != nil || !cmp.Equal(got, []string{"calls"}) {
		t.Errorf("MissingTables() after dropping calls = %q, %v; want [calls]", got, err)
	}
}

// TestServerFacts: the server's version and its clock.
func TestServerFacts(t *testing.T) {
	s := openStore(t)
	if v, err := s.ServerVersion(t.Context()); err != nil || v == "" {
		t.Errorf("ServerVersion() = %q, %v; want a version", v, err)
	}
	before := time.Now()
	now, err := s.Now(t.Context())
	if err != nil {
		t.Fatalf("Now() = %v", err)
	}
	// The test server runs on this machine: its clock is this one's, in
	// whole seconds.
	if d := now.Sub(before); d < -time.Minute || d > time.Minute {
		t.Errorf("Now() = %v, this machine %v; want the same clock", now, before)
	}
	if now.Nanosecond() != 0 {
		t.Errorf("Now() = %v; want whole seconds (a DateTime)", now)
	}
}

// TestCreatedAfter: the tables the migrations past a version create,
// every table of the projection past none of them.
func TestCreatedAfter(t *testing.T) {
	if diff := cmp.Diff([]string{"projection_positions"}, CreatedAfter(7)); diff != "" {
		t.Errorf("CreatedAfter(7) (-want +got):\n%s", diff)
	}
	got := CreatedAfter(0)
	slices.Sort(got)
	want := tableNames()
	slices.Sort(want)
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("CreatedAfter(0) (-every table +got):\n%s", diff)
	}
	if got := CreatedAfter(LatestVersion()); len(got) != 0 {
		t.Errorf("CreatedAfter(the latest version) = %v; want none", got)
	}
}
