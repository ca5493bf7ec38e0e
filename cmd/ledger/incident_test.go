package main

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
)

// An incident responder's session on `ledger dev --clickhouse-dsn`: real
// calls go through the ledger into ClickHouse, and the CLI answers from it
// directly and through the dev's query API the same way: the blast radius
// of a credential and of an approver, outcome counts, the unresolved
// list, a trace equal to the log's; then a rebuild from the log has the
// live projection's checksums.
func TestDevIncidentQueries(t *testing.T) {
	dsn, db := chtest.DSN(t), chtest.FreshDatabase(t)
	dir := t.TempDir()
	kafka, api, backend := freeAddr(t), freeAddr(t), freeAddr(t)
	dev := startDev(t, dir, kafka, api, backend, "--clickhouse-dsn", dsn, "--clickhouse-database", db)
	direct := []string{"--clickhouse-dsn", dsn, "--clickhouse-database", db}
	viaAPI := []string{"--api", "http://" + api, "--data-dir", dir}

	submit := func(tool, args, key string) string {
		return cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", tool, "--args", args, "--key", key, "--wait", "--timeout", "60s")
	}
	for i, city := range []string{"Sydney", "Hobart", "Perth"} {
		submit("get_weather", fmt.Sprintf(`{"city":%q}`, city), fmt.Sprintf("inc-weather-%d", i))
	}
	if out := submit("refund_order", `{"order_id":"ord_77","amount_cents":45000,"currency":"AUD"}`, "inc-refund"); !strings.Contains(out, "approval_pending") {
		t.Fatalf("refund:\n%s", out)
	}
	cli(t, "approvals", "approve", ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "inc-refund"}.ApprovalID(), "--api", "http://"+api, "--data-dir", dir, "--user", "u_boss")
	if out := submit("refund_order", `{"order_id":"ord_78","amount_cents":52000,"currency":"AUD"}`, "inc-refund-pending"); !strings.Contains(out, "approval_pending") {
		t.Fatalf("second refund:\n%s", out)
	}

	blast := func(source []string, args ...string) projections.BlastRadius {
		t.Helper()
		var br projections.BlastRadius
		out := cli(t, append(append([]string{"blast-radius", "--json"}, source...), args...)...)
		if err := json.Unmarshal([]byte(out), &br); err != nil {
			t.Fatalf("blast-radius %v: %v\n%s", args, err, out)
		}
		return br
	}
	// The projection catches up with the log.
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		br := blast(direct, "--tenant", "t_demo", "--tool", "refund_order")
		states := map[string]int{}
		for _, c := range br.ByState {
			states[c.Value] = c.Calls
		}
		if states["succeeded"] != 1 || states["approval_pending"] != 1 {
			return fmt.Errorf("refunds by state: %v", states)
		}
		return nil
	})

	// A credential's blast radius is exactly the call that used it: the
	// log says which.
	var evs []ledger.Event
	if err := json.Unmarshal([]byte(cli(t, "trace", "t_demo/inc-weather-1", "--kafka-brokers", kafka, "--json")), &evs); err != nil {
		t.Fatal(err)
	}
	var jti string
	for _, e := range evs {
		if e.JTI != "" {
			jti = e.JTI
		}
	}
	if jti == "" {
		t.Fatalf("the log's trace of inc-weather-1 carries no jti: %+v", evs)
	}
	for name, source := range map[string][]string{"clickhouse": direct, "api": viaAPI} {
		br := blast(source, "--jti", jti, "--all-tenants")
		if br.Total != 1 || len(br.Calls) != 1 || br.Calls[0].IdempotencyKey != "inc-weather-1" || br.Calls[0].State != "succeeded" {
			t.Errorf("%s: blast radius of %s: %+v; want inc-weather-1, succeeded", name, jti, br)
		}
	}
	if a, b := blast(direct, "--tool", "get_weather", "--tenant", "t_demo"), blast(viaAPI, "--tool", "get_weather", "--tenant", "t_demo"); a.Total != 3 || !cmp.Equal(a, b) {
		t.Errorf("weather calls: %d directly, and through the API: %s", a.Total, cmp.Diff(a, b))
	}

	// The approver's decisions, as CSV.
	rows, err := csv.NewReader(strings.NewReader(cli(t, append([]string{"blast-radius", "--csv", "--approver", "u_boss", "--tenant", "t_demo"}, direct...)...))).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 2 || rows[1][2] != "inc-refund" || rows[1][7] != "ord_77" {
		t.Errorf("u_boss's calls as CSV: %v; want the header and inc-refund on ord_77", rows)
	}

	// Outcomes and the unresolved list.
	var outcomes []projections.OutcomeCount
	if err := json.Unmarshal([]byte(cli(t, append([]string{"outcomes", "--json", "--tenant", "t_demo", "--bucket", "1h"}, viaAPI...)...)), &outcomes); err != nil {
		t.Fatal(err)
	}
	weather := 0
	for _, o := range outcomes {
		if o.Tool == "get_weather" && o.State == "succeeded" {
			weather += o.Calls
		}
	}
	if weather != 3 {
		t.Errorf("succeeded weather calls by the hour: %d in %+v; want 3", weather, outcomes)
	}
	if table := cli(t, append([]string{"unresolved", "--tenant", "t_demo"}, direct...)...); !strings.Contains(table, "inc-refund-pending") || strings.Contains(table, "inc-refund ") {
		t.Errorf("unresolved:\n%s", table)
	}

	// The trace from ClickHouse is the log's.
	fromLog := cli(t, "trace", "t_demo/inc-refund", "--kafka-brokers", kafka, "--json")
	fromCH := cli(t, append([]string{"trace", "t_demo/inc-refund", "--json"}, direct...)...)
	if fromLog != fromCH {
		t.Errorf("trace from ClickHouse differs from the log's:\n%s", cmp.Diff(fromLog, fromCH))
	}

	// A rebuild from the log has the live projection's checksums once the
	// live one is caught up.
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		status := cli(t, "projector", "status", "--kafka-brokers", kafka, "--group", devProjectorGroup)
		if !strings.Contains(status, "lag 0 records") {
			return fmt.Errorf("projector status:\n%s", status)
		}
		return nil
	})
	live := cli(t, append([]string{"projector", "checksums"}, direct...)...)
	// A swap while the dev's projector runs in the group is refused
	// before any replay.
	if err := cliErr(t, append([]string{"projector", "rebuild", "--swap", "--kafka-brokers", kafka, "--group", devProjectorGroup, "--into", db + "_never"}, direct...)...); err == nil || !strings.Contains(err.Error(), "stop the projector") {
		t.Errorf("rebuild --swap with the projector running: %v", err)
	}
	// A projector on an empty database behind a group that already
	// projected would leave out the log before its offsets: refused.
	empty := chtest.FreshDatabase(t)
	cli(t, "projector", "migrate", "--clickhouse-dsn", dsn, "--clickhouse-database", empty)
	if err := cliErr(t, "projector", "--kafka-brokers", kafka, "--group", devProjectorGroup, "--clickhouse-dsn", dsn, "--clickhouse-database", empty, "--metrics-addr", ""); err == nil || !strings.Contains(err.Error(), "holds no events") {
		t.Errorf("projector on an empty database behind a used group: %v", err)
	}
	rebuilt := cli(t, append([]string{"projector", "rebuild", "--kafka-brokers", kafka, "--into", db + "_rebuild"}, direct...)...)
	t.Cleanup(func() { chtest.DropDatabase(t, dsn, db+"_rebuild") })
	if !strings.Contains(rebuilt, live) {
		t.Errorf("rebuild checksums differ from the live ones:\nlive:\n%s\nrebuild:\n%s", live, rebuilt)
	}

	// dev restarted on the same data directory with a new, empty
	// database projects the whole log into it, not only what came after
	// its group's offsets.
	dev.stop()
	again := chtest.FreshDatabase(t)
	startDev(t, dir, kafka, api, backend, "--clickhouse-dsn", dsn, "--clickhouse-database", again)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if br := blast([]string{"--clickhouse-dsn", dsn, "--clickhouse-database", again}, "--tenant", "t_demo"); br.Total != 5 {
			return fmt.Errorf("%d calls in the new database, want all 5", br.Total)
		}
		return nil
	})
}

// cliErr runs a ledger subcommand that is expected to fail, and returns
// its error.
func cliErr(t *testing.T, args ...string) error {
	t.Helper()
	root := newRoot()
	root.SetArgs(args)
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	return root.ExecuteContext(t.Context())
}
