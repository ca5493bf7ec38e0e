package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/processors/storetest"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
)

// allDoctorChecks is every check doctor reports, in its order.
var allDoctorChecks = slices.Concat(kafkaCheckNames, storeCheckNames, clickhouseCheckNames, policyCheckNames)

// runDoctor runs `ledger doctor` with args and returns its stdout and
// error.
func runDoctor(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out strings.Builder
	root := newRoot()
	root.SetArgs(append([]string{"doctor"}, args...))
	root.SetOut(&out)
	root.SetErr(io.Discard)
	err := root.ExecuteContext(t.Context())
	t.Logf("ledger doctor %s:\n%s(err: %v)", strings.Join(args, " "), out.String(), err)
	return out.String(), err
}

// kafkaArgs are the flags naming a cluster and its topics.
func kafkaArgs(brokers []string, topics ledger.Topics) []string {
	return []string{
		"--kafka-brokers", strings.Join(brokers, ","),
		"--topic-requests", topics.Requests, "--topic-events", topics.Events,
		"--topic-control", topics.Control, "--topic-dlq", topics.DLQ,
	}
}

// tableRow is one parsed line of doctor's table.
type tableRow struct {
	status checkStatus
	detail string
}

// parseTable reads doctor's table: check -> row, and the checks in order.
func parseTable(t *testing.T, out string) (map[string]tableRow, []string) {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) == 0 || strings.Join(strings.Fields(lines[0]), " ") != "CHECK STATUS DETAIL" {
		t.Fatalf("doctor's table starts with %q; want the header CHECK STATUS DETAIL", lines[0])
	}
	rows := make(map[string]tableRow)
	var order []string
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		if len(f) < 3 {
			t.Fatalf("table line %q: want check, status and detail", l)
		}
		rows[f[0]] = tableRow{status: checkStatus(f[1]), detail: strings.Join(f[2:], " ")}
		order = append(order, f[0])
	}
	return rows, order
}

// TestDoctorHealthy: topics as EnsureTopics creates them, a migrated store
// and a migrated projection are all ok, and doctor exits 0.
func TestDoctorHealthy(t *testing.T) {
	ctx := t.Context()
	k := ledgertest.New(t, ledgertest.Options{})

	dsn := freshSchemaDSN(t)
	st, err := pgstore.Open(ctx, pgstore.Config{DSN: dsn})
	if err != nil {
		t.Fatalf("pgstore.Open() = %v", err)
	}
	st.Close()

	chDSN, chDB := chtest.DSN(t), chtest.FreshDatabase(t)
	ch, err := chstore.Open(ctx, chstore.Config{DSN: chDSN, Database: chDB})
	if err != nil {
		t.Fatalf("chstore.Open() = %v", err)
	}
	defer ch.Close()
	if err := ch.Migrate(ctx); err != nil {
		t.Fatalf("Migrate() = %v", err)
	}

	policies, versions := t.TempDir(), t.TempDir()
	writePolicy(t, policies, "", goodPolicy)
	writePolicy(t, versions, "v1", goodPolicy)
	out, err := runDoctor(t, append(kafkaArgs(k.Client.Brokers, k.Topics),
		"--expect-replication-factor", "1", "--expect-min-insync", "1",
		"--crdb-dsn", dsn, "--clickhouse-dsn", chDSN, "--clickhouse-database", chDB,
		"--policy-dir", policies, "--policy-versions-dir", versions)...)
	if err != nil {
		t.Errorf("doctor on a healthy deployment = %v; want nil", err)
	}
	rows, order := parseTable(t, out)
	if diff := cmp.Diff(allDoctorChecks, order); diff != "" {
		t.Errorf("checks reported (-want +got):\n%s", diff)
	}
	for _, c := range allDoctorChecks {
		if rows[c].status != statusOK {
			t.Errorf("%s: %s (%s); want ok", c, rows[c].status, rows[c].detail)
		}
	}
}

// misconfiguredKafka is a cluster whose DLQ topic is missing, whose
// control topic is not compacted, whose topics have one replica each
// (below an expected 2), whose events topic keeps an hour, and whose
// transactions may last 30 s, below the loops' minute.
func misconfiguredKafka(t *testing.T) ([]string, ledger.Topics) {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.BrokerConfigs(map[string]string{"transaction.max.timeout.ms": "30000"}))
	if err != nil {
		t.Fatalf("kfake: %v", err)
	}
	t.Cleanup(c.Close)
	// As Kafka does, a broker resource named "" (asked for none in
	// particular) holds the cluster's dynamic defaults only, never a
	// static setting such as this one.
	c.ControlKey(int16(kmsg.DescribeConfigs), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kreq.(*kmsg.DescribeConfigsRequest)
		resp := req.ResponseKind().(*kmsg.DescribeConfigsResponse)
		for _, r := range req.Resources {
			if r.ResourceType != kmsg.ConfigResourceTypeBroker || r.ResourceName != "" {
				return nil, nil, false
			}
			rr := kmsg.NewDescribeConfigsResponseResource()
			rr.ResourceType, rr.ResourceName = r.ResourceType, r.ResourceName
			resp.Resources = append(resp.Resources, rr)
		}
		return resp, nil, true
	})
	topics := ledger.Topics{}.WithDefaults()
	cl, err := ledger.NewClient(ledger.ClientConfig{Brokers: c.ListenAddrs()})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	hour := "3600000"
	for _, tc := range []struct {
		name    string
		configs map[string]*string
	}{
		{topics.Requests, nil},
		{topics.Events, map[string]*string{"retention.ms": &hour}},
		{topics.Control, nil}, // not compacted
	} {
		if _, err := adm.CreateTopic(t.Context(), 4, 1, tc.configs, tc.name); err != nil {
			t.Fatalf("create %s: %v", tc.name, err)
		}
	}
	return c.ListenAddrs(), topics
}

// TestDoctorKafkaMisconfigured: a missing topic, a control topic that is
// not compacted, a replication factor below the expected one and a
// transaction timeout bound below the loops' each fail and name what is
// at fault; doctor changes nothing.
func TestDoctorKafkaMisconfigured(t *testing.T) {
	brokers, topics := misconfiguredKafka(t)
	out, err := runDoctor(t, append(kafkaArgs(brokers, topics),
		"--expect-replication-factor", "2", "--expect-min-insync", "1")...)
	if err == nil || !strings.Contains(err.Error(), "4 checks failed") {
		t.Errorf("doctor = %v; want 4 checks failed", err)
	}
	rows, _ := parseTable(t, out)
	for _, tc := range []struct {
		check  string
		status checkStatus
		names  []string // topics the detail must name
		not    []string // topics it must not
	}{
		{checkBrokers, statusOK, nil, nil},
		{checkTopics, statusFail, []string{topics.DLQ, "ledger topics create"}, []string{topics.Requests, topics.Events, topics.Control}},
		{checkPartitions, statusOK, nil, nil},
		{checkReplication, statusFail, []string{topics.Requests + " has 1", topics.Events + " has 1", topics.Control + " has 1"}, []string{topics.DLQ}},
		{checkMinInsync, statusOK, nil, nil},
		{checkCleanup, statusFail, []string{topics.Control, "cleanup.policy=compact"}, []string{topics.Events}},
		{checkRetention, statusWarn, []string{topics.Events, "1h0m0s"}, nil},
		{checkTransactions, statusFail, []string{"transaction.max.timeout.ms=30000", "60000"}, nil},
		{checkStoreConnect, statusSkipped, []string{"--crdb-dsn"}, nil},
		{checkCHConnect, statusSkipped, []string{"--clickhouse-dsn"}, nil},
	} {
		r := rows[tc.check]
		if r.status != tc.status {
			t.Errorf("%s: %s (%s); want %s", tc.check, r.status, r.detail, tc.status)
		}
		for _, n := range tc.names {
			if !strings.Contains(r.detail, n) {
				t.Errorf("%s detail %q does not name %q", tc.check, r.detail, n)
			}
		}
		for _, n := range tc.not {
			if strings.Contains(r.detail, n+",") || strings.Contains(r.detail, n+" ") || strings.HasSuffix(r.detail, n) {
				t.Errorf("%s detail %q names %q, which is fine", tc.check, r.detail, n)
			}
		}
	}

	// Read only: the missing topic is still missing, the control topic
	// still not compacted.
	cl, err := ledger.NewClient(ledger.ClientConfig{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	md, err := adm.Metadata(t.Context(), topics.DLQ)
	if err != nil {
		t.Fatal(err)
	}
	if err := md.Topics[topics.DLQ].Err; !errors.Is(err, kerr.UnknownTopicOrPartition) {
		t.Errorf("after doctor, %s: %v; want it still missing", topics.DLQ, err)
	}
	rcs, err := adm.DescribeTopicConfigs(t.Context(), topics.Control)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range rcs[0].Configs {
		if c.Key == "cleanup.policy" && compacted(c.MaybeValue()) {
			t.Errorf("after doctor, %s has cleanup.policy=%s; want it unchanged", topics.Control, c.MaybeValue())
		}
	}
}

// TestDoctorJSON: --json prints an array with the same checks and
// statuses as the table, and the topics at fault.
func TestDoctorJSON(t *testing.T) {
	brokers, topics := misconfiguredKafka(t)
	args := append(kafkaArgs(brokers, topics), "--expect-replication-factor", "2", "--expect-min-insync", "1")
	table, terr := runDoctor(t, args...)
	js, jerr := runDoctor(t, append(args, "--json")...)
	if terr == nil || jerr == nil || terr.Error() != jerr.Error() {
		t.Errorf("doctor = %v, with --json %v; want the same failure", terr, jerr)
	}
	var got []checkResult
	if err := json.Unmarshal([]byte(js), &got); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, js)
	}
	rows, order := parseTable(t, table)
	var jsonOrder []string
	for _, r := range got {
		jsonOrder = append(jsonOrder, r.Check)
		if want := rows[r.Check].status; r.Status != want {
			t.Errorf("%s: --json says %s, the table %s", r.Check, r.Status, want)
		}
		if r.Detail == "" {
			t.Errorf("%s: --json has no detail", r.Check)
		}
		switch r.Check {
		case checkTopics:
			if diff := cmp.Diff([]string{topics.DLQ}, r.Topics); diff != "" {
				t.Errorf("%s topics (-want +got):\n%s", r.Check, diff)
			}
		case checkCleanup:
			if diff := cmp.Diff([]string{topics.Control}, r.Topics); diff != "" {
				t.Errorf("%s topics (-want +got):\n%s", r.Check, diff)
			}
		case checkBrokers:
			if len(r.Brokers) != 1 {
				t.Errorf("%s brokers %q; want the one broker", r.Check, r.Brokers)
			}
		}
	}
	if diff := cmp.Diff(order, jsonOrder); diff != "" {
		t.Errorf("--json checks (-table +json):\n%s", diff)
	}
}

// TestDoctorUnmigratedStore: an empty schema is reported as not migrated,
// and doctor creates nothing in it.
func TestDoctorUnmigratedStore(t *testing.T) {
	ctx := t.Context()
	k := ledgertest.New(t, ledgertest.Options{})
	base := storetest.PGDSN(t)
	schema := storetest.FreshSchema(t, base)
	dsn, drop, err := createSchemaDSN(ctx, base, schema)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = drop() })

	out, err := runDoctor(t, append(kafkaArgs(k.Client.Brokers, k.Topics),
		"--expect-replication-factor", "1", "--expect-min-insync", "1", "--crdb-dsn", dsn)...)
	if err == nil || err.Error() != "1 check failed" {
		t.Errorf("doctor = %v; want 1 check failed", err)
	}
	rows, _ := parseTable(t, out)
	if r := rows[checkStoreSchema]; r.status != statusFail || !strings.Contains(r.detail, "not migrated") || !strings.Contains(r.detail, schema) {
		t.Errorf("%s: %s (%s); want fail, not migrated, naming schema %s", checkStoreSchema, r.status, r.detail, schema)
	}
	for _, c := range []string{checkStoreConnect, checkStoreClock} {
		if rows[c].status != statusOK {
			t.Errorf("%s: %s (%s); want ok", c, rows[c].status, rows[c].detail)
		}
	}

	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace ns ON ns.oid = c.relnamespace WHERE ns.nspname = $1`, schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("after doctor, schema %s holds %d relations; want none (doctor must not migrate)", schema, n)
	}
}

// TestDoctorUnreachableBroker: a broker that refuses connections, and one
// that accepts them and never answers, fail kafka.brokers with a message
// naming the address, within the timeout; the other Kafka checks are
// skipped rather than failed.
func TestDoctorUnreachableBroker(t *testing.T) {
	refused := func(t *testing.T) string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		return addr
	}
	silent := func(t *testing.T) string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		var (
			mu    sync.Mutex
			conns []net.Conn
			done  = make(chan struct{})
		)
		// Accepts until the listener closes at cleanup; holds the
		// connections open without a byte of answer.
		go func() {
			defer close(done)
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
			}
		}()
		t.Cleanup(func() {
			ln.Close()
			<-done
			mu.Lock()
			defer mu.Unlock()
			for _, c := range conns {
				c.Close()
			}
		})
		return ln.Addr().String()
	}
	const timeout = 2 * time.Second
	for _, tc := range []struct {
		name   string
		broker func(*testing.T) string
		says   string // what the detail says before the address
	}{
		{"refused", refused, "cannot reach "},
		{"silent", silent, "no answer from "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := tc.broker(t)
			start := time.Now()
			out, err := runDoctor(t, "--kafka-brokers", addr, "--timeout", timeout.String())
			took := time.Since(start)
			if err == nil || err.Error() != "1 check failed" {
				t.Errorf("doctor = %v; want 1 check failed", err)
			}
			// Bounded by the timeout, not by franz-go's retries; the
			// slack is for a loaded machine.
			if took > timeout+10*time.Second {
				t.Errorf("doctor took %s with --timeout %s; want it bounded by the timeout", took, timeout)
			}
			rows, _ := parseTable(t, out)
			r := rows[checkBrokers]
			if r.status != statusFail || !strings.Contains(r.detail, tc.says+addr) || !strings.Contains(r.detail, "--kafka-brokers") {
				t.Errorf("%s: %s (%s); want fail, saying %q%s and naming the flag", checkBrokers, r.status, r.detail, tc.says, addr)
			}
			if tc.name == "silent" && !strings.Contains(r.detail, "within "+timeout.String()) {
				t.Errorf("%s: %q does not say it waited %s", checkBrokers, r.detail, timeout)
			}
			for _, c := range kafkaCheckNames[1:] {
				if rows[c].status != statusSkipped {
					t.Errorf("%s: %s (%s); want skipped", c, rows[c].status, rows[c].detail)
				}
			}
		})
	}
}

// fakeClock is a local clock that moves only when told to.
type fakeClock struct{ now time.Time }

func (c *fakeClock) Now() time.Time { return c.now }

func (c *fakeClock) Sleep(_ context.Context, d time.Duration) error {
	c.now = c.now.Add(d)
	return nil
}

// fakeServer is a server whose clock is skew ahead of clk, truncated to
// resolution, reached in out and answering in back.
func fakeServer(clk *fakeClock, skew, resolution, out, back time.Duration) func(context.Context) (time.Time, error) {
	return func(context.Context) (time.Time, error) {
		clk.now = clk.now.Add(out)
		t := clk.now.Add(skew)
		if resolution > 0 {
			t = t.Truncate(resolution)
		}
		clk.now = clk.now.Add(back)
		return t, nil
	}
}

// TestDoctorSkewArithmetic: the estimate is within its uncertainty of the
// true skew, for fine and whole-second server clocks, symmetric and
// lopsided round trips, and round trips longer than a second.
func TestDoctorSkewArithmetic(t *testing.T) {
	for _, tc := range []struct {
		name                      string
		skew, resolution          time.Duration
		out, back                 time.Duration
		maxUncertainty, wantTrips time.Duration
	}{
		{"fine ahead", 120 * time.Millisecond, 0, time.Millisecond, time.Millisecond, time.Millisecond, 2 * time.Millisecond},
		{"fine behind", -3 * time.Second, 0, 5 * time.Millisecond, 5 * time.Millisecond, 5 * time.Millisecond, 10 * time.Millisecond},
		{"fine lopsided", 40 * time.Millisecond, 0, 100 * time.Microsecond, 9 * time.Millisecond, 5 * time.Millisecond, 9100 * time.Microsecond},
		{"seconds ahead", 370 * time.Millisecond, time.Second, 2 * time.Millisecond, 2 * time.Millisecond, 20 * time.Millisecond, 4 * time.Millisecond},
		{"seconds behind", -1250 * time.Millisecond, time.Second, time.Millisecond, 3 * time.Millisecond, 20 * time.Millisecond, 4 * time.Millisecond},
		{"seconds none", 0, time.Second, time.Millisecond, time.Millisecond, 20 * time.Millisecond, 2 * time.Millisecond},
		{"seconds slow link", 200 * time.Millisecond, time.Second, 800 * time.Millisecond, 700 * time.Millisecond, 1300 * time.Millisecond, 1500 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A start inside a second, so that truncation matters.
			clk := &fakeClock{now: time.Date(2026, 3, 1, 12, 0, 0, 123_456_789, time.UTC)}
			e, err := measureSkew(t.Context(), clk, fakeServer(clk, tc.skew, tc.resolution, tc.out, tc.back), tc.resolution)
			if err != nil {
				t.Fatalf("measureSkew() = %v", err)
			}
			if off := (e.Skew - tc.skew).Abs(); off > e.Uncertainty {
				t.Errorf("skew %s ±%s; the true skew %s is outside", e.Skew, e.Uncertainty, tc.skew)
			}
			if e.Uncertainty > tc.maxUncertainty {
				t.Errorf("uncertainty %s; want at most %s", e.Uncertainty, tc.maxUncertainty)
			}
			if e.RoundTrip != tc.wantTrips {
				t.Errorf("round trip %s; want %s", e.RoundTrip, tc.wantTrips)
			}
		})
	}
}

// TestDoctorSkewJudgement: ok when surely within the limit, fail when
// surely beyond, warn when the measurement cannot tell.
func TestDoctorSkewJudgement(t *testing.T) {
	const limit = 500 * time.Millisecond
	for _, tc := range []struct {
		name string
		e    skewEstimate
		want checkStatus
	}{
		{"small", skewEstimate{Skew: 3 * time.Millisecond, Uncertainty: time.Millisecond}, statusOK},
		{"at the limit", skewEstimate{Skew: -499 * time.Millisecond, Uncertainty: time.Millisecond}, statusOK},
		{"far ahead", skewEstimate{Skew: 2 * time.Second, Uncertainty: 10 * time.Millisecond}, statusFail},
		{"far behind", skewEstimate{Skew: -2 * time.Second, Uncertainty: 10 * time.Millisecond}, statusFail},
		{"cannot tell", skewEstimate{Skew: 450 * time.Millisecond, Uncertainty: 100 * time.Millisecond}, statusWarn},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := judgeSkew(checkStoreClock, "the database", tc.e, limit)
			if r.Status != tc.want {
				t.Errorf("judgeSkew(%+v) = %s (%s); want %s", tc.e, r.Status, r.Detail, tc.want)
			}
			if r.SkewMS == nil || *r.SkewMS != float64(tc.e.Skew)/float64(time.Millisecond) {
				t.Errorf("judgeSkew(%+v) skew_ms = %v; want %v", tc.e, r.SkewMS, float64(tc.e.Skew)/float64(time.Millisecond))
			}
		})
	}
}

// TestDoctorRetention: the events topic is ok with unlimited retention or
// at least a week, and a warning otherwise.
func TestDoctorRetention(t *testing.T) {
	d := &doctor{topics: ledger.Topics{}.WithDefaults()}
	ev := d.topics.Events
	for _, tc := range []struct {
		name    string
		configs map[string]string
		want    checkStatus
	}{
		{"unlimited", map[string]string{"retention.ms": "-1", "retention.bytes": "-1"}, statusOK},
		{"a week", map[string]string{"retention.ms": "604800000"}, statusOK},
		{"a month", map[string]string{"retention.ms": "2592000000"}, statusOK},
		{"a day", map[string]string{"retention.ms": "86400000"}, statusWarn},
		{"by size", map[string]string{"retention.ms": "-1", "retention.bytes": "1073741824"}, statusWarn},
		{"unset (Kafka's week)", map[string]string{}, statusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := d.retentionCheck(map[string]map[string]string{ev: tc.configs})
			if r.Status != tc.want {
				t.Errorf("retentionCheck(%v) = %s (%s); want %s", tc.configs, r.Status, r.Detail, tc.want)
			}
		})
	}
	if r := d.retentionCheck(map[string]map[string]string{}); r.Status != statusSkipped {
		t.Errorf("retentionCheck without the events topic = %s (%s); want skipped", r.Status, r.Detail)
	}
}

// TestDoctorCleanupPolicies: the control topic is compacted alone (with
// delete, retention takes old freezes and revocations, and can empty a
// partition), the others are not compacted.
func TestDoctorCleanupPolicies(t *testing.T) {
	d := &doctor{topics: ledger.Topics{}.WithDefaults()}
	tp := d.topics
	cfg := func(control, events string) map[string]map[string]string {
		return map[string]map[string]string{tp.Requests: {}, tp.Events: {"cleanup.policy": events}, tp.Control: {"cleanup.policy": control}, tp.DLQ: {}}
	}
	for _, tc := range []struct {
		name    string
		configs map[string]map[string]string
		want    checkStatus
		topics  []string
	}{
		{"as created", cfg("compact", "delete"), statusOK, nil},
		{"control compacted and deleted", cfg("compact,delete", "delete"), statusFail, []string{tp.Control}},
		{"control deleted", cfg("delete", "delete"), statusFail, []string{tp.Control}},
		{"events compacted", cfg("compact", "compact"), statusFail, []string{tp.Events}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := d.cleanupCheck(tc.configs)
			if r.Status != tc.want || !slices.Equal(r.Topics, tc.topics) {
				t.Errorf("cleanupCheck = %s %v (%s); want %s %v", r.Status, r.Topics, r.Detail, tc.want, tc.topics)
			}
		})
	}
}

// TestDoctorMessageBytes: the events and DLQ topics must accept the
// records the ledger writes there; unset, the broker's default does.
func TestDoctorMessageBytes(t *testing.T) {
	d := &doctor{topics: ledger.Topics{}.WithDefaults()}
	ev, dlq := d.topics.Events, d.topics.DLQ
	for _, tc := range []struct {
		name    string
		configs map[string]map[string]string
		want    checkStatus
		topics  []string
	}{
		{"Kafka's default", map[string]map[string]string{ev: {"max.message.bytes": "1048588"}, dlq: {"max.message.bytes": "1048588"}}, statusOK, nil},
		{"unset", map[string]map[string]string{ev: {}, dlq: {}}, statusOK, nil},
		{"a small DLQ", map[string]map[string]string{ev: {}, dlq: {"max.message.bytes": "262144"}}, statusFail, []string{dlq}},
		{"a small events topic", map[string]map[string]string{ev: {"max.message.bytes": "500000"}, dlq: {}}, statusFail, []string{ev}},
		{"neither there", map[string]map[string]string{}, statusSkipped, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := d.messageBytesCheck(tc.configs)
			if r.Status != tc.want || !slices.Equal(r.Topics, tc.topics) {
				t.Errorf("messageBytesCheck(%v) = %s %v (%s); want %s %v", tc.configs, r.Status, r.Topics, r.Detail, tc.want, tc.topics)
			}
		})
	}
}

// TestDoctorStoreSchemaJudgement: a schema that lacks something fails; one
// that works but carries an older build's indexes, or a newer build's
// statuses, warns, naming them.
func TestDoctorStoreSchemaJudgement(t *testing.T) {
	for _, tc := range []struct {
		name  string
		st    pgstore.SchemaStatus
		want  checkStatus
		names []string
	}{
		{"current", pgstore.SchemaStatus{Schema: "s"}, statusOK, []string{"schema s"}},
		{"missing index", pgstore.SchemaStatus{Schema: "s", MissingIndexes: []string{"ix_a"}}, statusFail, []string{"ix_a", "ledger migrate"}},
		{"unvalidated status check", pgstore.SchemaStatus{Schema: "s", UnvalidatedStatusCheck: true}, statusFail, []string{"validated status check", "ledger migrate"}},
		{"obsolete indexes", pgstore.SchemaStatus{Schema: "s", ObsoleteIndexes: []string{"ix_old", "ix_older"}}, statusWarn, []string{"ix_old, ix_older", "ledger migrate"}},
		{"newer statuses", pgstore.SchemaStatus{Schema: "s", NewerStatuses: []string{"later"}}, statusWarn, []string{"later"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := storeSchemaCheck(tc.st, nil)
			if r.Status != tc.want {
				t.Errorf("storeSchemaCheck(%+v) = %s (%s); want %s", tc.st, r.Status, r.Detail, tc.want)
			}
			for _, n := range tc.names {
				if !strings.Contains(r.Detail, n) {
					t.Errorf("storeSchemaCheck(%+v) detail %q; want it to name %q", tc.st, r.Detail, n)
				}
			}
		})
	}
}

// TestDoctorClickHouseSchemaJudgement: a database a version behind is
// told to migrate, though it lacks the table the next version creates;
// one at this build's version that lacks a table was changed by hand.
func TestDoctorClickHouseSchemaJudgement(t *testing.T) {
	for _, tc := range []struct {
		name    string
		missing []string
		have    int
		want    checkStatus
		says    string
	}{
		{"current", nil, 8, statusOK, "schema version 8"},
		{"a version behind", []string{"projection_positions"}, 7, statusFail, "at schema version 7, this build writes 8: run `ledger projector migrate`"},
		{"a table dropped", []string{"calls"}, 8, statusFail, "lacks calls, which `ledger projector migrate` does not create again"},
		{"a version behind, a table dropped", []string{"control_actions", "projection_positions"}, 7, statusFail, "lacks control_actions, which `ledger projector migrate` does not create again: dropped by hand? rebuild it (`ledger projector migrate`, then `ledger projector rebuild --swap`"},
		{"not migrated", []string{"schema_migrations", "events"}, 0, statusFail, "not migrated"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := clickhouseSchemaCheck("ledger", tc.missing, tc.have, 8, nil)
			if r.Status != tc.want || !strings.Contains(r.Detail, tc.says) {
				t.Errorf("clickhouseSchemaCheck(%v, %d) = %s %q; want %s saying %q", tc.missing, tc.have, r.Status, r.Detail, tc.want, tc.says)
			}
		})
	}
}

// doctor loads this host's policies as this build does, and fails a set
// that an older build loaded and this one refuses (a scope no call
// matches), naming it: a role given it would not start, or, a version
// activated, deny every call. Run before an upgrade.
func TestDoctorPolicies(t *testing.T) {
	dir, versions := t.TempDir(), t.TempDir()
	writePolicy(t, dir, "", goodPolicy)
	writePolicy(t, versions, "v1", goodPolicy)
	writePolicy(t, versions, "v2", goodPolicy+"\n"+`@id("cap") forbid (principal, action == Action::"refund_order", resource);`)
	d := &doctor{flags: doctorFlags{policyDir: dir, policyVersionsDir: versions}}
	got := map[string]checkResult{}
	for _, r := range d.policyChecks(t.Context()) {
		got[r.Check] = r
	}
	if r := got[checkPolicyDir]; r.Status != statusOK {
		t.Errorf("%s: %s %s; want ok", checkPolicyDir, r.Status, r.Detail)
	}
	if r := got[checkPolicyVersions]; r.Status != statusFail || !strings.Contains(r.Detail, "1 of the 2 versions") || !strings.Contains(r.Detail, `v2: `) {
		t.Errorf("%s: %s %s; want fail, naming v2", checkPolicyVersions, r.Status, r.Detail)
	}
	d = &doctor{}
	for _, r := range d.policyChecks(t.Context()) {
		if r.Status != statusSkipped {
			t.Errorf("%s without its flag: %s; want skipped", r.Check, r.Status)
		}
	}
}

// goodPolicy is a policy set every build loads.
const goodPolicy = `@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`
