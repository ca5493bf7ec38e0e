package main

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
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
	addrs := freeAddrs(t, 3)
	kafka, api, backend := addrs[0], addrs[1], addrs[2]
	dev := startDev(t, dir, kafka, api, backend, "--clickhouse-dsn", dsn, "--clickhouse-database", db)
	direct := []string{"--clickhouse-dsn", dsn, "--clickhouse-database", db}
	viaAPI := []string{"--api", "http://" + api, "--data-dir", dir}

	submit := func(tool, args, key string, more ...string) string {
		return cli(t, append([]string{"submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", tool, "--args", args, "--key", key, "--wait", "--timeout", "60s"}, more...)...)
	}
	// The first weather call's caller has roles, which dev gives the
	// policies (--policy-roles).
	contractor := strings.TrimSpace(cli(t, "token", "--data-dir", dir, "--tenant", "t_demo", "--user", "u_temp", "--roles", "contractor,support"))
	for i, city := range []string{"Sydney", "Hobart", "Perth"} {
		var more []string
		if i == 0 {
			more = []string{"--assertion", contractor, "--user", "u_temp"}
		}
		submit("get_weather", fmt.Sprintf(`{"city":%q}`, city), fmt.Sprintf("inc-weather-%d", i), more...)
	}
	if out := submit("refund_order", `{"order_id":"ord_77","amount_cents":45000,"currency":"AUD"}`, "inc-refund"); !strings.Contains(out, "approval_pending") {
		t.Fatalf("refund:\n%s", out)
	}
	approveShown(t, ledger.CallKey{TenantID: "t_demo", IdempotencyKey: "inc-refund"}.ApprovalID(), api, dir)
	if out := submit("refund_order", `{"order_id":"ord_78","amount_cents":52000,"currency":"AUD"}`, "inc-refund-pending"); !strings.Contains(out, "approval_pending") {
		t.Fatalf("second refund:\n%s", out)
	}

	blast := func(source []string, args ...string) projections.BlastRadius {
		t.Helper()
		var br projections.BlastRadius
		// A note (the limit cut the list, or the projection moved while
		// it answered) goes to stderr, beside the JSON.
		out, notes := cliSplit(t, append(append([]string{"blast-radius", "--json"}, source...), args...)...)
		if err := json.Unmarshal([]byte(out), &br); err != nil {
			t.Fatalf("blast-radius %v: %v\n%s%s", args, err, out, notes)
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
	// A caller's role finds the calls its policies decided with it.
	for name, source := range map[string][]string{"clickhouse": direct, "api": viaAPI} {
		for _, c := range []struct {
			args []string
			want int
		}{
			{[]string{"--role", "contractor"}, 1},
			{[]string{"--role", "support", "--decision", "allow", "--tool", "get_weather"}, 1},
			{[]string{"--role", "contractor", "--decision", "deny"}, 0},
			{[]string{"--role", "operator"}, 0},
		} {
			br := blast(source, append(c.args, "--tenant", "t_demo")...)
			if br.Total != c.want || c.want == 1 && (len(br.Calls) != 1 || br.Calls[0].IdempotencyKey != "inc-weather-0") {
				t.Errorf("%s: blast radius of %v: %+v; want %d call(s), inc-weather-0", name, c.args, br, c.want)
			}
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
	if err := json.Unmarshal([]byte(cli(t, append([]string{"outcomes", "--json", "--tenant", "t_demo", "--bucket", "1h", "--since", "2h"}, viaAPI...)...)), &outcomes); err != nil {
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
	// More buckets than an answer may have: by the second over a month,
	// or by the hour since the epoch (no --since).
	for name, source := range map[string][]string{"clickhouse": direct, "api": viaAPI} {
		for _, args := range [][]string{{"--bucket", "1s", "--since", "720h"}, {"--bucket", "1h"}} {
			if err := cliErr(t, append(append([]string{"outcomes", "--tenant", "t_demo"}, args...), source...)...); !errors.Is(err, projections.ErrInvalidFilter) {
				t.Errorf("%s: outcomes %v: %v; want ErrInvalidFilter", name, args, err)
			}
		}
	}
	if table := cli(t, append([]string{"unresolved", "--tenant", "t_demo"}, direct...)...); !strings.Contains(table, "inc-refund-pending") || strings.Contains(table, "inc-refund ") {
		t.Errorf("unresolved:\n%s", table)
	}
	// A list cut at --limit says so on stderr, which a CSV export (here
	// three weather calls, two listed) has no room for; a whole one does
	// not.
	for name, source := range map[string][]string{"clickhouse": direct, "api": viaAPI} {
		for _, c := range []struct {
			args []string
			rows int
			note string
		}{
			{[]string{"blast-radius", "--csv", "--tool", "get_weather", "--tenant", "t_demo", "--limit", "2"}, 3, "listed 2 of the 3 matching calls"},
			{[]string{"blast-radius", "--csv", "--tool", "get_weather", "--tenant", "t_demo"}, 4, ""},
			{[]string{"unresolved", "--csv", "--tenant", "t_demo", "--limit", "1"}, 2, "more may be waiting"},
		} {
			stdout, stderr := cliSplit(t, append(c.args, source...)...)
			rows, err := csv.NewReader(strings.NewReader(stdout)).ReadAll()
			if err != nil || len(rows) != c.rows || (c.note == "") != (stderr == "") || !strings.Contains(stderr, c.note) {
				t.Errorf("%s: %v: %d rows (%v), stderr %q; want %d rows, a note %q", name, c.args, len(rows), err, stderr, c.rows, c.note)
			}
		}
	}

	// The trace from ClickHouse is the log's.
	fromLog := cli(t, "trace", "t_demo/inc-refund", "--kafka-brokers", kafka, "--json")
	fromCH := cli(t, append([]string{"trace", "t_demo/inc-refund", "--json"}, direct...)...)
	if fromLog != fromCH {
		// Both whole: the diff elides what they share, which is what
		// tells an event missing from one from one written twice.
		t.Errorf("trace from ClickHouse differs from the log's:\n%s\nthe log's:\n%s\nClickHouse's:\n%s", cmp.Diff(fromLog, fromCH), fromLog, fromCH)
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
	// The rebuild records where its records end, the replay's ends: those
	// of the caught-up live projection.
	positions := func(db string) projections.Positions {
		st, err := chstore.Open(t.Context(), chstore.Config{DSN: dsn, Database: db})
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		pos, err := st.Positions(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		return pos
	}
	livePos, rebuiltPos := positions(db), positions(db+"_rebuild")
	for topic, parts := range livePos {
		for partition, end := range parts {
			if got, _ := rebuiltPos.Lookup(topic, partition); got != end {
				t.Errorf("the rebuild's records end at %d on %s/%d; the live projection's at %d", got, topic, partition, end)
			}
		}
	}
	if len(livePos) == 0 {
		t.Errorf("the live projection records no ends")
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

// `ledger outcomes` refuses a question over more than
// projections.MaxOutcomeBuckets buckets before it asks the API (here,
// nothing listens there).
func TestOutcomesCLIBucketBound(t *testing.T) {
	api := "http://" + freeAddr(t)
	for _, args := range [][]string{
		{"--bucket", "1s", "--since", "720h"},
		{"--bucket", "1s", "--since", "2026-11-01T00:00:00Z", "--until", "2026-11-01T02:46:41Z"},
		{"--bucket", "5m"},
	} {
		err := cliErr(t, append([]string{"outcomes", "--api", api, "--assertion", "unused", "--tenant", "t_demo"}, args...)...)
		if !errors.Is(err, projections.ErrInvalidFilter) || !strings.Contains(err.Error(), "buckets") {
			t.Errorf("outcomes %v: %v; want ErrInvalidFilter, saying how many buckets", args, err)
		}
	}
}

// readOnlyDSN is dsn (a URL) whose sessions refuse every write and DDL.
func readOnlyDSN(t *testing.T, dsn string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("options", strings.TrimSpace(q.Get("options")+" -c default_transaction_read_only=on"))
	// Spaces as %20: libpq's URLs, and pgx's, take a + as itself.
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
	return u.String()
}

// `ledger api`, the production front door, against a running ledger:
// agents' calls and the responders' questions from ClickHouse, the
// approvals and control APIs of the other roles through its proxy, and
// the console signed in with a pasted assertion (no dev login there).
func TestAPIRole(t *testing.T) {
	dsn, db := chtest.DSN(t), chtest.FreshDatabase(t)
	dir := t.TempDir()
	addrs := freeAddrs(t, 6)
	kafka, devAPI, backend, addr := addrs[0], addrs[1], addrs[2], addrs[3]
	// The execution store in PostgreSQL, as deployed, so that ledger api
	// can read the results from it.
	storeDSN := freshSchemaDSN(t)
	startDev(t, dir, kafka, devAPI, backend, "--clickhouse-dsn", dsn, "--clickhouse-database", db, "--crdb-dsn", storeDSN)
	submit := func(tool, args, key string) string {
		return cli(t, "submit", "--kafka-brokers", kafka, "--data-dir", dir, "--tool", tool, "--args", args, "--key", key, "--deadline", "10m", "--wait", "--timeout", "60s")
	}
	submit("get_weather", `{"city":"Perth"}`, "api-weather")
	if out := submit("refund_order", `{"order_id":"ord_api1","amount_cents":45000,"currency":"AUD"}`, "api-refund"); !strings.Contains(out, "approval_pending") {
		t.Fatalf("refund:\n%s", out)
	}

	// The dev issuer stands in for the identity provider: its public
	// keys in a file, as an operator would configure them.
	iss, jwks := devIssuerKeys(t, dir)
	if err := cliErr(t, "api", "--kafka-brokers", kafka, "--http-addr", addr, "--clickhouse-dsn", dsn, "--clickhouse-database", db,
		"--issuer", DevIssuer, "--jwks-file", jwks, "--agents-audience", identity.ApproverAudience); err == nil || !strings.Contains(err.Error(), "--agents-audience") {
		t.Errorf("ledger api with the agents' audience the staff's: %v; want refused, naming --agents-audience", err)
	}
	startAPI := func(addr, storeDSN string) {
		t.Helper()
		exited := runCommand(t, "api", "--kafka-brokers", kafka, "--http-addr", addr, "--clickhouse-dsn", dsn, "--clickhouse-database", db,
			"--crdb-dsn", storeDSN, "--issuer", DevIssuer, "--jwks-file", jwks, "--approvals-url", "http://"+devAPI, "--operators-url", "http://"+devAPI,
			"--projector-group", devProjectorGroup, "--secure-cookies=false", "--log-level", "warn")
		ledgertest.WaitFor(t, 30*time.Second, func() error {
			exited()
			return healthz(addr)
		})
	}
	// In read-only sessions: it runs no DDL and writes nothing.
	startAPI(addr, readOnlyDSN(t, storeDSN))
	base := "http://" + addr
	operator, err := iss.Mint(identity.Identity{Tenant: "t_demo", User: "u_ops", Agent: "test", Roles: []string{"operator", "approver"}}, identity.ApproverAudience, 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	// sendTo sends body to path at base with assertion as its bearer
	// token ("": none).
	sendTo := func(base, method, assertion, path string, body []byte) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, base+path, bytes.NewReader(body))
		if assertion != "" {
			req.Header.Set("Authorization", "Bearer "+assertion)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	send := func(method, assertion, path string, body []byte) (int, string) {
		t.Helper()
		return sendTo(base, method, assertion, path, body)
	}
	callAs := func(assertion, path string) (int, string) {
		t.Helper()
		return send(http.MethodGet, assertion, path, nil)
	}
	get := func(path string) (int, string) { t.Helper(); return callAs(operator, path) }
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if code, body := get("/v1/trace/t_demo/api-weather"); code != 200 || !strings.Contains(body, `"succeeded"`) {
			return fmt.Errorf("trace through ledger api: %d %s", code, body)
		}
		return nil
	})
	// The projection inserts into its tables at once, not atomically
	// (chstore.Write): the trace's table can show the call before the
	// one the blast radius reads does.
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if code, body := get("/v1/blast-radius?tool=get_weather"); code != 200 || !strings.Contains(body, "api-weather") {
			return fmt.Errorf("blast radius through ledger api: %d %s", code, body)
		}
		return nil
	})
	// An agent reads its own tenant's call, from ClickHouse, with its
	// identity assertion; no other tenant's, and not without one. The
	// call, and its result from the execution store, are its user's alone
	// (ledger submit's u_demo): to another user of t_demo it is not found.
	agentAs := func(tenant, user string) string {
		tok, err := iss.Mint(identity.Identity{Tenant: tenant, User: user, Agent: "agent_test"}, identity.DefaultAudience, 10*time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	agentOf := func(tenant string) string { return agentAs(tenant, "u_agent") }
	if code, body := callAs(agentOf("t_demo"), "/v1/calls/api-weather"); code != 404 || strings.Contains(body, "succeeded") || strings.Contains(body, "Perth") {
		t.Errorf("GET /v1/calls/api-weather as another user of t_demo: %d %s; want 404, nothing of the call", code, body)
	}
	// "conditions" is in the weather, the result, alone. The api opens
	// the store in the background: unavailable until then.
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if code, body := callAs(agentAs("t_demo", "u_demo"), "/v1/calls/api-weather"); code != 200 || !strings.Contains(body, `"result"`) || !strings.Contains(body, `"conditions"`) {
			return fmt.Errorf("GET /v1/calls/api-weather as its user: %d %s; want its call with the weather", code, body)
		}
		return nil
	})
	// POST ?wait= answers the call's user with the settled call and its
	// result; without the bearer, or with another tenant's, it is refused.
	sf := submitFlags{tool: "get_weather", toolVersion: 1, args: `{"city":"Darwin"}`, tenant: "t_demo", user: "u_demo", key: "api-wait", deadline: time.Minute, dataDir: dir}
	env, err := sf.envelope()
	if err != nil {
		t.Fatal(err)
	}
	postWait := func(assertion string) (int, string) {
		t.Helper()
		return send(http.MethodPost, assertion, "/v1/calls?wait=30s", env)
	}
	if code, body := postWait(""); code != http.StatusUnauthorized {
		t.Errorf("POST ?wait without a bearer: %d %s; want 401", code, body)
	}
	if code, body := postWait(agentAs("t_other", "u_demo")); code != http.StatusForbidden || !strings.Contains(body, "tenant_mismatch") {
		t.Errorf("POST ?wait as an agent of another tenant: %d %s; want 403 tenant_mismatch", code, body)
	}
	// The envelope's own assertion is checked as the intake will, before
	// anything is published: one the intake would refuse (here the
	// staff's audience), 400 assertion_<reason>; another tenant's, 403.
	withAssertion := func(a string) []byte {
		t.Helper()
		var m map[string]any
		if err := json.Unmarshal(env, &m); err != nil {
			t.Fatal(err)
		}
		m["assertion"] = a
		b, _ := json.Marshal(m)
		return b
	}
	if code, body := send(http.MethodPost, agentAs("t_demo", "u_demo"), "/v1/calls", withAssertion(operator)); code != http.StatusBadRequest || !strings.Contains(body, `"assertion_`) || !strings.Contains(body, `"/assertion"`) {
		t.Errorf("POST of an envelope whose assertion is the staff's: %d %s; want 400 assertion_<reason> at /assertion", code, body)
	}
	if code, body := send(http.MethodPost, agentAs("t_demo", "u_demo"), "/v1/calls", withAssertion(agentAs("t_other", "u_demo"))); code != http.StatusForbidden || !strings.Contains(body, "tenant_mismatch") {
		t.Errorf("POST of an envelope whose assertion is another tenant's: %d %s; want 403 tenant_mismatch", code, body)
	}
	if code, body := postWait(agentAs("t_demo", "u_demo")); code != 200 || !strings.Contains(body, `"state": "succeeded"`) || !strings.Contains(body, `"conditions"`) {
		t.Errorf("POST ?wait as the call's user: %d %s; want 200, succeeded, with the weather", code, body)
	}
	// ledger submit --api: an agent's CLI with no access to Kafka gets
	// its call, with its result, from the API; a reused key with other
	// arguments is refused.
	viaAPI := func(key, city string, extra ...string) string {
		return cli(t, append([]string{"submit", "--api", base, "--data-dir", dir, "--tool", "get_weather", "--args", `{"city":"` + city + `"}`,
			"--key", key, "--wait", "--timeout", "60s"}, extra...)...)
	}
	if out := viaAPI("api-cli", "Hobart"); !strings.Contains(out, "t_demo/api-cli is succeeded") || !strings.Contains(out, "result (untrusted content from the tool):") || !strings.Contains(out, `"conditions"`) {
		t.Errorf("submit --api --wait:\n%s", out)
	}
	var v httpapi.CallView
	if out := viaAPI("api-cli-json", "Hobart", "--json"); json.Unmarshal([]byte(out), &v) != nil || v.State != "succeeded" || !strings.Contains(string(v.Result), "conditions") {
		t.Errorf("submit --api --wait --json: want the call with its result:\n%s", out)
	}
	if out := viaAPI("api-cli", "Cairns"); !strings.Contains(out, "refused: idempotency_key_reused at /arguments_hash") || strings.Contains(out, "conditions") {
		t.Errorf("submit --api --wait, the key reused with other arguments: want refused, without the earlier call's result:\n%s", out)
	}
	var refusal ledger.Event
	if out := viaAPI("api-cli", "Cairns", "--json"); json.Unmarshal([]byte(out), &refusal) != nil || refusal.Reason != "idempotency_key_reused" {
		t.Errorf("submit --api --wait --json, the key reused with other arguments: want the refusal as JSON:\n%s", out)
	}
	// A store that does not answer keeps neither the API from starting
	// nor serving: its results are withheld, unavailable.
	down := addrs[4]
	startAPI(down, "postgres://ledger@"+addrs[5]+"/ledger?sslmode=disable&connect_timeout=1")
	// Its ClickHouse opens in the background too: until then a lookup is
	// to be asked again (503), never a fault.
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		code, body := sendTo("http://"+down, http.MethodGet, agentAs("t_demo", "u_demo"), "/v1/calls/api-weather", nil)
		if code == http.StatusServiceUnavailable && strings.Contains(body, "call_index_unavailable") {
			return fmt.Errorf("GET from an api whose ClickHouse is not open yet: %d %s", code, body)
		}
		if code != 200 || !strings.Contains(body, `"result_withheld": "unavailable"`) {
			t.Errorf("GET from an api whose store does not answer: %d %s; want the call, its result unavailable (or 503 call_index_unavailable until its ClickHouse opened)", code, body)
		}
		return nil
	})
	for _, tc := range []struct {
		who, assertion, path string
		code                 int
	}{
		{"no assertion", "", "/v1/calls/api-weather", http.StatusUnauthorized},
		{"an operator's assertion (another audience)", operator, "/v1/calls/api-weather", http.StatusUnauthorized},
		{"an agent of another tenant", agentOf("t_other"), "/v1/calls/api-weather", http.StatusNotFound},
		{"an agent of another tenant naming t_demo", agentOf("t_other"), "/v1/calls/api-weather?tenant_id=t_demo", http.StatusNotFound},
		{"an assertion of the ledger's own tenant", agentOf(ledger.UnverifiedTenant), "/v1/calls/api-weather", http.StatusUnauthorized},
	} {
		if code, body := callAs(tc.assertion, tc.path); code != tc.code {
			t.Errorf("GET %s with %s: %d %s; want %d", tc.path, tc.who, code, body, tc.code)
		}
	}
	if code, body := get("/v1/approvals"); code != 200 || !strings.Contains(body, "ord_api1") {
		t.Errorf("approvals through ledger api's proxy: %d %s", code, body)
	}
	if code, body := get("/v1/control"); code != 200 {
		t.Errorf("control through ledger api's proxy: %d %s", code, body)
	}
	if code, body := get("/v1/health"); code != 200 || !strings.Contains(body, "projection_lag_records") {
		t.Errorf("health: %d %s", code, body)
	}
	// An approver who is not an operator does not see it.
	approver, err := iss.Mint(identity.Identity{Tenant: "t_demo", User: "u_appr", Agent: "test", Roles: []string{"approver"}}, identity.ApproverAudience, 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	req0, _ := http.NewRequest(http.MethodGet, base+"/v1/health", nil)
	req0.Header.Set("Authorization", "Bearer "+approver)
	if resp, err := http.DefaultClient.Do(req0); err != nil || resp.StatusCode != http.StatusForbidden {
		t.Errorf("health for an approver: %v %v; want 403", resp.StatusCode, err)
	} else {
		resp.Body.Close()
	}

	// The console: a pasted assertion signs in; there is no dev login.
	jar, _ := cookiejar.New(nil)
	hc := &http.Client{Jar: jar}
	resp, err := hc.Get(base + "/login")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.Contains(string(page), "/login/dev") {
		t.Error("ledger api's sign-in page offers the dev login")
	}
	m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(string(page))
	if m == nil {
		t.Fatalf("no CSRF token on the sign-in page:\n%s", page)
	}
	req, _ := http.NewRequest(http.MethodPost, base+"/login", strings.NewReader(url.Values{"csrf": {m[1]}, "assertion": {operator}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", base)
	resp, err = hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	queue, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasSuffix(resp.Request.URL.Path, "/approvals") || !strings.Contains(string(queue), "ord_api1") {
		t.Errorf("console after signing in: %d at %s:\n%s", resp.StatusCode, resp.Request.URL, queue)
	}
}
