package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/ClickHouse/clickhouse-go/v2"
	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/projections/chstore"
)

// doctorFlags are `ledger doctor`'s own flags; Kafka's are the root's.
type doctorFlags struct {
	crdbDSN         string
	clickhouseDSN   string
	clickhouseDB    string
	expectRF        int
	expectMinInsync int
	maxClockSkew    time.Duration
	timeout         time.Duration
	jsonOut         bool
	// policyDir and policyVersionsDir are this host's policies, loaded
	// with this build's rules (policyChecks).
	policyDir         string
	policyVersionsDir string
}

// minEventsRetention is the shortest finite retention of the events topic
// that doctor accepts without a warning. The events topic is the ledger:
// the audit record, and what projections are rebuilt from. Unlimited
// retention (-1) is what it should have; a finite one of at least a week
// is accepted (it is Kafka's default, and what a deployment that archives
// the log elsewhere typically keeps) and said in the detail; anything
// shorter is a warning, since events would leave the log before a
// projection rebuild or an incident review of last week could read them.
const minEventsRetention = 7 * 24 * time.Hour

func newDoctorCmd(g *globals) *cobra.Command {
	var f doctorFlags
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check a deployment and say what is wrong: Kafka, its topics, the execution store, ClickHouse, clocks",
		Long: `doctor checks, read only, what the ledger needs from its deployment and
prints one line per check: ok, warn, fail or skipped, and a detail saying what
is wrong and what to do.

  Kafka (--kafka-brokers, --topic-*): every broker answers; the four topics
    exist, their partitions have leaders; requests and events have the same
    number of partitions; replication factor and min.insync.replicas meet
    --expect-replication-factor and --expect-min-insync; the control topic is
    compacted alone (no delete: retention would take old freezes and
    revocations) and the others are not; the events topic keeps its records (no
    retention.bytes, retention.ms unlimited or at least 7 days); the events
    and DLQ topics accept records of the size the ledger writes there
    (max.message.bytes at least 1000012); every broker offers the
    transaction APIs the exactly-once loops need (Kafka 2.5+).
  Execution store (--crdb-dsn): it answers, its version, whether the schema
    holds everything this build's migrate creates, the clock skew.
  ClickHouse (--clickhouse-dsn, --clickhouse-database): it answers, its
    version, the projection's tables and schema version, the clock skew.

Nothing is created, migrated or produced. A check with nothing configured is
skipped. Each check gives up after --timeout. doctor exits non-zero when a
check fails; warnings do not fail.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := f.validate(); err != nil {
				return err
			}
			// No logger for franz-go: its retries against an unreachable
			// broker would drown the report, which says what failed.
			d := doctor{
				flags:  f,
				kafka:  g.kafka.client(nil),
				topics: g.kafka.topics().WithDefaults(),
				clock:  systemClock{},
			}
			results := d.run(cmd.Context())
			out := cmd.OutOrStdout()
			if f.jsonOut {
				if err := printJSONTo(out, results); err != nil {
					return err
				}
			} else {
				printChecks(out, results)
			}
			n := 0
			for _, r := range results {
				if r.Status == statusFail {
					n++
				}
			}
			switch {
			case n == 1:
				return errors.New("1 check failed")
			case n > 1:
				return fmt.Errorf("%d checks failed", n)
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.crdbDSN, "crdb-dsn", "", "CockroachDB (or PostgreSQL) DSN of the execution store; empty: its checks are skipped")
	fs.StringVar(&f.clickhouseDSN, "clickhouse-dsn", "", "ClickHouse of the projection (native protocol), e.g. clickhouse://default@127.0.0.1:9000/ledger; empty: its checks are skipped")
	fs.StringVar(&f.clickhouseDB, "clickhouse-database", "", "ClickHouse database of the projection's tables (default: the DSN's, else ledger)")
	fs.IntVar(&f.expectRF, "expect-replication-factor", 3, "replication factor every topic must have at least (dev setups: 1)")
	fs.IntVar(&f.expectMinInsync, "expect-min-insync", 2, "min.insync.replicas every topic must have at least (dev setups: 1)")
	fs.DurationVar(&f.maxClockSkew, "max-clock-skew", 500*time.Millisecond, "largest clock difference between this machine and a database that is ok; an approval stops letting requests leave a second before its expiry, a margin that holds while the intake's and the executors' hosts are within 500ms of the store's clock")
	fs.DurationVar(&f.timeout, "timeout", 10*time.Second, "how long each check may take")
	fs.BoolVar(&f.jsonOut, "json", false, "print the checks as a JSON array")
	fs.StringVar(&f.policyDir, "policy-dir", "", "the policies this host's intake or executor decides with (--policy-dir), loaded as this build loads them, which refuses more than older builds (a misspelt obligation, a scope no call matches): run it before an upgrade. Empty: skipped")
	fs.StringVar(&f.policyVersionsDir, "policy-versions-dir", "", "this host's policy versions (--policy-versions-dir), each <label>/*.cedar loaded as this build loads it. Empty: skipped")
	return cmd
}

func (f *doctorFlags) validate() error {
	switch {
	case f.expectRF < 1:
		return fmt.Errorf("--expect-replication-factor %d: want at least 1", f.expectRF)
	case f.expectMinInsync < 1:
		return fmt.Errorf("--expect-min-insync %d: want at least 1", f.expectMinInsync)
	case f.maxClockSkew <= 0:
		return fmt.Errorf("--max-clock-skew %s: want more than 0", f.maxClockSkew)
	case f.timeout <= 0:
		return fmt.Errorf("--timeout %s: want more than 0", f.timeout)
	}
	return nil
}

// checkStatus is a check's verdict.
type checkStatus string

const (
	statusOK      checkStatus = "ok"
	statusWarn    checkStatus = "warn"
	statusFail    checkStatus = "fail"
	statusSkipped checkStatus = "skipped"
)

// checkResult is one line of the report. Detail says what is wrong and
// what to do; the other fields are facts for machines (--json).
type checkResult struct {
	Check  string      `json:"check"`
	Status checkStatus `json:"status"`
	Detail string      `json:"detail"`
	// Topics are the topics a Kafka check found at fault.
	Topics []string `json:"topics,omitempty"`
	// Brokers are the brokers the metadata listed, as id@host:port.
	Brokers []string `json:"brokers,omitempty"`
	// Version is a server's version.
	Version string `json:"version,omitempty"`
	// SchemaVersion and WantSchemaVersion are the ClickHouse projection's
	// schema version and the one this build writes.
	SchemaVersion     *int `json:"schema_version,omitempty"`
	WantSchemaVersion *int `json:"want_schema_version,omitempty"`
	// SkewMS (the server's clock minus this machine's), its UncertaintyMS
	// and the RoundTripMS of the clock check.
	SkewMS        *float64 `json:"skew_ms,omitempty"`
	UncertaintyMS *float64 `json:"uncertainty_ms,omitempty"`
	RoundTripMS   *float64 `json:"round_trip_ms,omitempty"`
}

// result makes a checkResult; the detail is kept to one line, whatever
// the errors in it say.
func result(check string, st checkStatus, format string, args ...any) checkResult {
	detail := strings.Join(strings.Fields(fmt.Sprintf(format, args...)), " ")
	return checkResult{Check: check, Status: st, Detail: detail}
}

// printChecks writes the report as a table.
func printChecks(w io.Writer, rs []checkResult) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CHECK\tSTATUS\tDETAIL")
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", r.Check, r.Status, r.Detail)
	}
	tw.Flush()
}

// doctor runs the checks.
type doctor struct {
	flags  doctorFlags
	kafka  ledger.ClientConfig
	topics ledger.Topics
	clock  localClock
}

// run runs the three groups of checks side by side and returns their
// results in a fixed order: Kafka, the store, ClickHouse.
func (d *doctor) run(ctx context.Context) []checkResult {
	groups := []func(context.Context) []checkResult{d.kafkaChecks, d.storeChecks, d.clickhouseChecks, d.policyChecks}
	out := make([][]checkResult, len(groups))
	var wg sync.WaitGroup
	for i, fn := range groups {
		// Each goroutine ends when its checks do, each bounded by
		// --timeout.
		wg.Go(func() { out[i] = fn(ctx) })
	}
	wg.Wait()
	return slices.Concat(out...)
}

// within runs fn with the per-check timeout.
func (d *doctor) within(ctx context.Context, fn func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, d.flags.timeout)
	defer cancel()
	return fn(ctx)
}

// unreachable says why a server at where did not answer: the timeout ran
// out, or err.
func (d *doctor) unreachable(where string, err error) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Sprintf("no answer from %s within %s (%v)", where, d.flags.timeout, err)
	}
	return fmt.Sprintf("cannot reach %s (%v)", where, err)
}

// skipAll reports every named check as skipped, for why.
func skipAll(names []string, why string) []checkResult {
	out := make([]checkResult, len(names))
	for i, n := range names {
		out[i] = result(n, statusSkipped, "%s", why)
	}
	return out
}

// ------------------------------------------------------------- Policies

const (
	checkPolicyDir      = "policy.dir"
	checkPolicyVersions = "policy.versions"
)

var policyCheckNames = []string{checkPolicyDir, checkPolicyVersions}

// policyChecks loads this host's policies as this build does: a set an
// older build loaded may be refused by this one, and a role started on
// it would not start (--policy-dir), or deny every call while it is the
// version activated (--policy-versions-dir).
func (d *doctor) policyChecks(context.Context) []checkResult {
	var out []checkResult
	if dir := d.flags.policyDir; dir == "" {
		out = append(out, result(checkPolicyDir, statusSkipped, "no --policy-dir"))
	} else if set, err := policy.LoadDir(dir, "doctor"); err != nil {
		out = append(out, result(checkPolicyDir, statusFail, "the policies in %s do not load with this build: %v; a role given them would not start", dir, err))
	} else {
		out = append(out, result(checkPolicyDir, statusOK, "%d policies load from %s", len(set.PolicyIDs()), dir))
	}
	dir := d.flags.policyVersionsDir
	if dir == "" {
		return append(out, result(checkPolicyVersions, statusSkipped, "no --policy-versions-dir"))
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return append(out, result(checkPolicyVersions, statusFail, "cannot read %s: %v", dir, err))
	}
	var labels, failed []string
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		labels = append(labels, e.Name())
		if _, err := policy.LoadDir(filepath.Join(dir, e.Name()), e.Name()); err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", e.Name(), err))
		}
	}
	if len(failed) > 0 {
		return append(out, result(checkPolicyVersions, statusFail, "%d of the %d versions in %s do not load with this build, and while one is activated every call is denied: %s",
			len(failed), len(labels), dir, strings.Join(failed, "; ")))
	}
	return append(out, result(checkPolicyVersions, statusOK, "%d versions load from %s", len(labels), dir))
}

// ---------------------------------------------------------------- Kafka

const (
	checkBrokers      = "kafka.brokers"
	checkTopics       = "kafka.topics"
	checkPartitions   = "kafka.partitions"
	checkReplication  = "kafka.replication"
	checkMinInsync    = "kafka.min_insync"
	checkCleanup      = "kafka.cleanup_policy"
	checkRetention    = "kafka.events_retention"
	checkMessageBytes = "kafka.message_bytes"
	checkTransactions = "kafka.transactions"
)

var kafkaCheckNames = []string{checkBrokers, checkTopics, checkPartitions, checkReplication, checkMinInsync, checkCleanup, checkRetention, checkMessageBytes, checkTransactions}

// minRecordBytes is the least max.message.bytes of the topics the ledger
// writes whole records of its own making to (events, DLQ): its producers'
// largest batch, franz-go's default (a call's events carry its
// arguments; a request's DLQ copy is cut at ledger.DLQMaxValueBytes).
// Kafka's own default, 1048588, is above it.
const minRecordBytes = 1_000_012

// txnAPIs are the requests the exactly-once loops make, with the least
// version they need: a GroupTransactSession fences zombies by consumer
// group generation (KIP-447: TxnOffsetCommit v3, and OffsetFetch v7 for
// RequireStableFetchOffsets), which is Kafka 2.5 and later.
var txnAPIs = []struct {
	key int16
	min int16
}{
	{kmsg.FindCoordinator.Int16(), 0},
	{kmsg.InitProducerID.Int16(), 0},
	{kmsg.AddPartitionsToTxn.Int16(), 0},
	{kmsg.AddOffsetsToTxn.Int16(), 0},
	{kmsg.EndTxn.Int16(), 0},
	{kmsg.TxnOffsetCommit.Int16(), 3},
	{kmsg.OffsetFetch.Int16(), 7},
}

func (d *doctor) kafkaChecks(ctx context.Context) []checkResult {
	t := d.topics
	names := []string{t.Requests, t.Events, t.Control, t.DLQ}
	cl, err := ledger.NewClient(d.kafka)
	if err != nil {
		return append([]checkResult{result(checkBrokers, statusFail, "%v: check --kafka-brokers (LEDGER_KAFKA_BROKERS) and the other --kafka-* flags", err)},
			skipAll(kafkaCheckNames[1:], "no Kafka client (see kafka.brokers)")...)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)

	// Metadata: the brokers and the topics. Asking for named topics never
	// creates them (AllowAutoTopicCreation is false).
	var md kadm.Metadata
	err = d.within(ctx, func(ctx context.Context) (err error) {
		md, err = adm.Metadata(ctx, names...)
		return err
	})
	if err != nil {
		return append([]checkResult{result(checkBrokers, statusFail,
			"%s: check --kafka-brokers (LEDGER_KAFKA_BROKERS), that the brokers run and that this machine reaches them",
			d.unreachable(strings.Join(d.kafka.Brokers, ","), err))},
			skipAll(kafkaCheckNames[1:], "Kafka unreachable (see kafka.brokers)")...)
	}
	// ApiVersions from every broker: the metadata came from one, but
	// clients connect to each at the address it advertises.
	var versions kadm.BrokersApiVersions
	verr := d.within(ctx, func(ctx context.Context) (err error) {
		versions, err = adm.ApiVersions(ctx)
		return err
	})
	out := []checkResult{d.brokersCheck(md, versions, verr)}

	present := make([]string, 0, len(names))
	for _, n := range names {
		if md.Topics[n].Err == nil {
			present = append(present, n)
		}
	}
	out = append(out, topicsCheck(md, names), d.partitionsCheck(md))

	var configs map[string]map[string]string
	cerr := d.within(ctx, func(ctx context.Context) (err error) {
		configs, err = topicConfigs(ctx, adm, present)
		return err
	})
	out = append(out, d.replicationCheck(md, present))
	if cerr != nil {
		why := fmt.Sprintf("cannot read topic configs (%v): check the client may DescribeConfigs", cerr)
		out = append(out,
			result(checkMinInsync, statusFail, "%s", why),
			result(checkCleanup, statusFail, "%s", why),
			result(checkRetention, statusFail, "%s", why),
			result(checkMessageBytes, statusFail, "%s", why))
	} else {
		out = append(out, d.minInsyncCheck(md, present, configs), d.cleanupCheck(configs), d.retentionCheck(configs), d.messageBytesCheck(configs))
	}
	out = append(out, d.transactionsCheck(ctx, adm, md, versions, verr))
	return out
}

// brokerName is a broker as the report names it.
func brokerName(b kadm.BrokerDetail) string {
	return fmt.Sprintf("%d@%s:%d", b.NodeID, b.Host, b.Port)
}

func (d *doctor) brokersCheck(md kadm.Metadata, versions kadm.BrokersApiVersions, verr error) checkResult {
	var seen []string
	for _, b := range md.Brokers {
		seen = append(seen, brokerName(b))
	}
	r := result(checkBrokers, statusOK, "%d broker(s): %s", len(seen), strings.Join(seen, ", "))
	r.Brokers = seen
	if len(seen) == 0 {
		r.Status, r.Detail = statusFail, "the cluster lists no brokers: check that the brokers have joined the cluster"
		return r
	}
	if verr != nil {
		r.Status = statusFail
		r.Detail = fmt.Sprintf("metadata lists %s, but asking them for their API versions failed (%v): check that every broker runs", strings.Join(seen, ", "), verr)
		return r
	}
	var bad []string
	for _, b := range md.Brokers {
		if v, ok := versions[b.NodeID]; !ok || v.Err != nil {
			var err error = errors.New("no answer")
			if ok {
				err = v.Err
			}
			bad = append(bad, fmt.Sprintf("%s (%v)", brokerName(b), err))
		}
	}
	if len(bad) > 0 {
		r.Status = statusFail
		r.Detail = fmt.Sprintf("metadata lists %s, but %s do not answer at the address they advertise: check that they run and that advertised.listeners is reachable from clients", strings.Join(seen, ", "), strings.Join(bad, ", "))
	}
	return r
}

func topicsCheck(md kadm.Metadata, names []string) checkResult {
	var missing, broken, other []string
	for _, n := range names {
		td := md.Topics[n]
		switch {
		case errors.Is(td.Err, kerr.UnknownTopicOrPartition):
			missing = append(missing, n)
			continue
		case td.Err != nil:
			other = append(other, fmt.Sprintf("%s (%v)", n, td.Err))
			continue
		}
		for _, p := range td.Partitions.Sorted() {
			if p.Err != nil || p.Leader < 0 {
				broken = append(broken, fmt.Sprintf("%s/%d", n, p.Partition))
			}
		}
	}
	var faults []string
	var topics []string
	if len(missing) > 0 {
		faults = append(faults, "missing "+strings.Join(missing, ", ")+": run `ledger topics create` (it creates only the missing ones)")
		topics = append(topics, missing...)
	}
	if len(other) > 0 {
		faults = append(faults, "cannot describe "+strings.Join(other, ", ")+": check the client's ACLs (Describe on the topics)")
	}
	if len(broken) > 0 {
		faults = append(faults, "partitions without a leader: "+strings.Join(broken, ", ")+": bring their replicas' brokers back")
	}
	if len(faults) > 0 {
		r := result(checkTopics, statusFail, "%s", strings.Join(faults, "; "))
		r.Topics = topics
		return r
	}
	return result(checkTopics, statusOK, "%s exist, every partition has a leader", strings.Join(names, ", "))
}

func (d *doctor) partitionsCheck(md kadm.Metadata) checkResult {
	req, ev := md.Topics[d.topics.Requests], md.Topics[d.topics.Events]
	if req.Err != nil || ev.Err != nil {
		return result(checkPartitions, statusSkipped, "needs both %s and %s (see kafka.topics)", d.topics.Requests, d.topics.Events)
	}
	nr, ne := len(req.Partitions), len(ev.Partitions)
	switch {
	case nr < 1 || ne < 1:
		r := result(checkPartitions, statusFail, "%s has %d partitions, %s %d: recreate them with --partitions of at least 1", d.topics.Requests, nr, d.topics.Events, ne)
		r.Topics = []string{d.topics.Requests, d.topics.Events}
		return r
	case nr != ne:
		r := result(checkPartitions, statusFail,
			"%s has %d partitions, %s %d: they must be equal (a call's request and events are placed by the same key hash); adding partitions moves keys, so recreate the topics with one --partitions before they carry calls",
			d.topics.Requests, nr, d.topics.Events, ne)
		r.Topics = []string{d.topics.Requests, d.topics.Events}
		return r
	}
	return result(checkPartitions, statusOK, "%s and %s have %d partitions each", d.topics.Requests, d.topics.Events, nr)
}

func (d *doctor) replicationCheck(md kadm.Metadata, present []string) checkResult {
	if len(present) == 0 {
		return result(checkReplication, statusSkipped, "no topic to check (see kafka.topics)")
	}
	var low, under, topics []string
	rfs := make(map[string]int)
	for _, n := range present {
		rf := -1
		for _, p := range md.Topics[n].Partitions.Sorted() {
			if rf < 0 || len(p.Replicas) < rf {
				rf = len(p.Replicas)
			}
			if len(p.ISR) < len(p.Replicas) {
				under = append(under, fmt.Sprintf("%s/%d (%d of %d in sync)", n, p.Partition, len(p.ISR), len(p.Replicas)))
			}
		}
		rfs[n] = rf
		if rf < d.flags.expectRF {
			low = append(low, fmt.Sprintf("%s has %d", n, rf))
			topics = append(topics, n)
		}
	}
	if len(low) > 0 {
		r := result(checkReplication, statusFail,
			"replication factor below %d: %s; a broker loss can lose the ledger's records: raise it with a partition reassignment (kafka-reassign-partitions), or pass --expect-replication-factor for a dev setup",
			d.flags.expectRF, strings.Join(low, ", "))
		r.Topics = topics
		return r
	}
	if len(under) > 0 {
		return result(checkReplication, statusWarn, "under-replicated partitions: %s: check the brokers of the missing replicas", strings.Join(under, ", "))
	}
	parts := make([]string, 0, len(present))
	for _, n := range present {
		parts = append(parts, fmt.Sprintf("%s %d", n, rfs[n]))
	}
	return result(checkReplication, statusOK, "replication factor (at least %d): %s; all replicas in sync", d.flags.expectRF, strings.Join(parts, ", "))
}

// topicConfigs reads the named topics' configs: name -> key -> value.
func topicConfigs(ctx context.Context, adm *kadm.Client, topics []string) (map[string]map[string]string, error) {
	out := make(map[string]map[string]string, len(topics))
	if len(topics) == 0 {
		return out, nil
	}
	rcs, err := adm.DescribeTopicConfigs(ctx, topics...)
	if err != nil {
		return nil, err
	}
	for _, rc := range rcs {
		if rc.Err != nil {
			return nil, fmt.Errorf("%s: %w", rc.Name, rc.Err)
		}
		m := make(map[string]string, len(rc.Configs))
		for _, c := range rc.Configs {
			m[c.Key] = c.MaybeValue()
		}
		out[rc.Name] = m
	}
	return out, nil
}

func (d *doctor) minInsyncCheck(md kadm.Metadata, present []string, configs map[string]map[string]string) checkResult {
	if len(present) == 0 {
		return result(checkMinInsync, statusSkipped, "no topic to check (see kafka.topics)")
	}
	var low, above, stuck, tight, parts, topics []string
	for _, n := range present {
		mi := 1 // Kafka's default, if a broker does not say
		if v, ok := configs[n]["min.insync.replicas"]; ok {
			if x, err := strconv.Atoi(v); err == nil {
				mi = x
			}
		}
		parts = append(parts, fmt.Sprintf("%s %d", n, mi))
		rf := md.Topics[n].Partitions.NumReplicas()
		switch {
		case mi < d.flags.expectMinInsync:
			low = append(low, fmt.Sprintf("%s has %d", n, mi))
			topics = append(topics, n)
		case mi > rf:
			above = append(above, fmt.Sprintf("%s (%d > replication factor %d)", n, mi, rf))
			topics = append(topics, n)
		case mi == rf && rf > 1:
			tight = append(tight, n)
		}
		for _, p := range md.Topics[n].Partitions.Sorted() {
			if len(p.ISR) < mi && mi <= len(p.Replicas) {
				stuck = append(stuck, fmt.Sprintf("%s/%d (%d in sync)", n, p.Partition, len(p.ISR)))
			}
		}
	}
	var faults []string
	if len(low) > 0 {
		faults = append(faults, fmt.Sprintf("min.insync.replicas below %d: %s: an acknowledged write may live on one broker only; set it with kafka-configs --alter --add-config min.insync.replicas=%d (or pass --expect-min-insync for a dev setup)",
			d.flags.expectMinInsync, strings.Join(low, ", "), d.flags.expectMinInsync))
	}
	if len(above) > 0 {
		faults = append(faults, "min.insync.replicas above the replication factor: "+strings.Join(above, ", ")+": every write is refused; lower it or add replicas")
	}
	if len(stuck) > 0 {
		faults = append(faults, "partitions with fewer in-sync replicas than min.insync.replicas refuse writes: "+strings.Join(stuck, ", ")+": bring their brokers back")
	}
	if len(faults) > 0 {
		r := result(checkMinInsync, statusFail, "%s", strings.Join(faults, "; "))
		r.Topics = topics
		return r
	}
	if len(tight) > 0 {
		r := result(checkMinInsync, statusWarn, "min.insync.replicas equals the replication factor on %s: one broker down stops writes; lower it to replication factor - 1", strings.Join(tight, ", "))
		r.Topics = tight
		return r
	}
	return result(checkMinInsync, statusOK, "min.insync.replicas (at least %d): %s", d.flags.expectMinInsync, strings.Join(parts, ", "))
}

// compacted is whether a cleanup.policy value includes compaction.
func compacted(policy string) bool { return hasPolicy(policy, "compact") }

// deletes reports whether a cleanup.policy deletes by retention.
func deletes(policy string) bool { return hasPolicy(policy, "delete") }

// hasPolicy reports whether the cleanup.policy list policy names want.
func hasPolicy(policy, want string) bool {
	for p := range strings.SplitSeq(policy, ",") {
		if strings.TrimSpace(p) == want {
			return true
		}
	}
	return false
}

func (d *doctor) cleanupCheck(configs map[string]map[string]string) checkResult {
	t := d.topics
	var faults, topics []string
	for _, n := range []string{t.Requests, t.Events, t.Control, t.DLQ} {
		c, ok := configs[n]
		if !ok {
			continue // missing: kafka.topics says so
		}
		policy := cmp.Or(c["cleanup.policy"], "delete")
		switch {
		case n == t.Control && (!compacted(policy) || deletes(policy)):
			faults = append(faults, fmt.Sprintf("%s has cleanup.policy=%s, want compact alone (the latest freeze or revocation per key must stay forever; with delete, retention takes those older than retention.ms, and a partition it empties is one no process started since can read to its end): kafka-configs --alter --entity-type topics --entity-name %s --add-config cleanup.policy=compact", n, policy, n))
			topics = append(topics, n)
		case n != t.Control && compacted(policy):
			faults = append(faults, fmt.Sprintf("%s has cleanup.policy=%s, want delete (compaction keeps only the last record per call and loses the rest): set cleanup.policy=delete on it", n, policy))
			topics = append(topics, n)
		}
	}
	if len(faults) > 0 {
		r := result(checkCleanup, statusFail, "%s", strings.Join(faults, "; "))
		r.Topics = topics
		return r
	}
	if _, ok := configs[t.Control]; !ok {
		return result(checkCleanup, statusOK, "%s missing (see kafka.topics); the others are not compacted", t.Control)
	}
	return result(checkCleanup, statusOK, "%s is compacted, the others are not", t.Control)
}

func (d *doctor) retentionCheck(configs map[string]map[string]string) checkResult {
	n := d.topics.Events
	c, ok := configs[n]
	if !ok {
		return result(checkRetention, statusSkipped, "%s missing (see kafka.topics)", n)
	}
	warn := func(format string, args ...any) checkResult {
		r := result(checkRetention, statusWarn, format, args...)
		r.Topics = []string{n}
		return r
	}
	if b := cmp.Or(c["retention.bytes"], "-1"); b != "-1" {
		return warn("%s has retention.bytes=%s: the ledger's events are deleted by size; set retention.bytes=-1", n, b)
	}
	raw := cmp.Or(c["retention.ms"], "604800000") // Kafka's default, 7 days
	ms, err := strconv.ParseInt(raw, 10, 64)
	if err != nil {
		return warn("%s has retention.ms=%q, which is not a number: set retention.ms=-1", n, raw)
	}
	if ms < 0 {
		return result(checkRetention, statusOK, "%s keeps its events forever (retention.ms=-1)", n)
	}
	ret := time.Duration(ms) * time.Millisecond
	if ret < minEventsRetention {
		return warn("%s deletes events after %s (retention.ms=%d), under %s: the audit record and projection rebuilds lose them; set retention.ms=-1", n, ret, ms, minEventsRetention)
	}
	return result(checkRetention, statusOK, "%s keeps events %s (retention.ms=%d): older ones leave the log, so archive it or set retention.ms=-1 to rebuild projections from the start", n, ret, ms)
}

// messageBytesCheck fails when the events or the DLQ topic accepts records
// smaller than the ledger writes there: a record refused fails the
// transaction that carries it, on every redelivery, and the loop behind
// it restarts, its partitions stalled.
func (d *doctor) messageBytesCheck(configs map[string]map[string]string) checkResult {
	var small []string
	checked := 0
	for _, n := range []string{d.topics.Events, d.topics.DLQ} {
		c, ok := configs[n]
		if !ok {
			continue
		}
		checked++
		raw := c["max.message.bytes"]
		if raw == "" {
			continue // the broker's default
		}
		if v, err := strconv.ParseInt(raw, 10, 64); err != nil || v < minRecordBytes {
			small = append(small, fmt.Sprintf("%s has max.message.bytes=%s", n, raw))
		}
	}
	switch {
	case checked == 0:
		return result(checkMessageBytes, statusSkipped, "%s and %s missing (see kafka.topics)", d.topics.Events, d.topics.DLQ)
	case len(small) > 0:
		r := result(checkMessageBytes, statusFail, "%s: the ledger writes records of up to %d bytes there (a call's events carry its arguments, a request's DLQ copy up to %d bytes), and one refused fails its transaction on every redelivery, the loop's partitions stalled behind it; set max.message.bytes to at least %d",
			strings.Join(small, ", "), minRecordBytes, ledger.DLQMaxValueBytes, minRecordBytes)
		for _, n := range []string{d.topics.Events, d.topics.DLQ} {
			if strings.Contains(r.Detail, n+" has") {
				r.Topics = append(r.Topics, n)
			}
		}
		return r
	}
	return result(checkMessageBytes, statusOK, "%s and %s accept the records the ledger writes (max.message.bytes at least %d)", d.topics.Events, d.topics.DLQ, minRecordBytes)
}

func (d *doctor) transactionsCheck(ctx context.Context, adm *kadm.Client, md kadm.Metadata, versions kadm.BrokersApiVersions, verr error) checkResult {
	if verr != nil {
		return result(checkTransactions, statusSkipped, "no API versions (see kafka.brokers)")
	}
	var faults []string
	for _, b := range md.Brokers {
		v, ok := versions[b.NodeID]
		if !ok || v.Err != nil {
			continue // kafka.brokers says so
		}
		var lacking []string
		for _, api := range txnAPIs {
			name := kmsg.NameForKey(api.key)
			if _, hi, ok := v.KeyVersions(api.key); !ok {
				lacking = append(lacking, name)
			} else if hi < api.min {
				lacking = append(lacking, fmt.Sprintf("%s v%d (has v%d)", name, api.min, hi))
			}
		}
		if len(lacking) > 0 {
			faults = append(faults, fmt.Sprintf("broker %s lacks %s", brokerName(b), strings.Join(lacking, ", ")))
		}
	}
	if len(faults) > 0 {
		return result(checkTransactions, statusFail, "%s: the exactly-once loops need Kafka 2.5 or later with transactions; upgrade the brokers", strings.Join(faults, "; "))
	}
	// The transaction coordinator's own topic needs as many brokers as
	// its replication factor, or no transactional producer ever starts.
	// Best effort: a broker that does not report it is not faulted.
	// Each broker by its id: asked for none, Kafka answers with the
	// cluster's dynamic defaults only, which never hold these static
	// settings.
	ids := make([]int32, len(md.Brokers))
	for i, b := range md.Brokers {
		ids[i] = b.NodeID
	}
	var bc kadm.ResourceConfigs
	err := d.within(ctx, func(ctx context.Context) (err error) {
		bc, err = adm.DescribeBrokerConfigs(ctx, ids...)
		return err
	})
	if err == nil {
		for _, rc := range bc {
			for _, c := range rc.Configs {
				switch c.Key {
				case "transaction.state.log.replication.factor":
					if rf, err := strconv.Atoi(c.MaybeValue()); err == nil && rf > len(md.Brokers) {
						return result(checkTransactions, statusFail,
							"transaction.state.log.replication.factor=%d but the cluster has %d broker(s): transactional producers cannot start; add brokers or lower it",
							rf, len(md.Brokers))
					}
				case "transaction.max.timeout.ms":
					// Below the loops' own timeout, every producer id
					// is refused (INVALID_TRANSACTION_TIMEOUT) and no
					// loop ever starts.
					if ms, err := strconv.ParseInt(c.MaybeValue(), 10, 64); err == nil && time.Duration(ms)*time.Millisecond < ledger.TransactionTimeout {
						return result(checkTransactions, statusFail,
							"broker %s has transaction.max.timeout.ms=%d, below the %d the ledger's loops ask for: their producers are refused and nothing is decided or executed; raise it to at least %d",
							rc.Name, ms, ledger.TransactionTimeout.Milliseconds(), ledger.TransactionTimeout.Milliseconds())
					}
				}
			}
		}
	}
	return result(checkTransactions, statusOK, "every broker offers the transaction APIs (KIP-447 fencing, Kafka 2.5+)")
}

// ---------------------------------------------------------------- clocks

// localClock is this machine's clock, and a way to wait on it; tests
// give a fake.
type localClock interface {
	Now() time.Time
	Sleep(ctx context.Context, d time.Duration) error
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

func (systemClock) Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// clockSample is one reading of a server's clock, between the local clock
// just before the query was sent and just after its answer came.
type clockSample struct {
	sent, server, received time.Time
}

func (s clockSample) roundTrip() time.Duration { return s.received.Sub(s.sent) }

// skewEstimate is how far a server's clock is from this machine's.
type skewEstimate struct {
	// Skew is the server's clock minus this machine's: positive when the
	// server is ahead.
	Skew time.Duration
	// Uncertainty bounds the error: the true skew is within Skew ±
	// Uncertainty, provided the server read its clock between the send
	// and the receipt.
	Uncertainty time.Duration
	// RoundTrip is the shortest round trip of the queries.
	RoundTrip time.Duration
}

// skewSamples is how many readings a fine-grained clock gets; the one
// with the shortest round trip is kept.
const skewSamples = 3

// measureSkew estimates a server's clock skew with the midpoint method:
// the server read its clock at some instant between sending the query
// and receiving its answer, so skew = server - (sent+received)/2, within
// half the round trip.
//
// resolution is the server clock's granularity: 0 for a fine one
// (PostgreSQL's now()), a second for a DateTime (ClickHouse's now()),
// which truncates. For a coarse clock a single reading says the skew only
// to within a second, so measureSkew reads it until it ticks: the new
// reading r was exactly the server's time at an instant between the
// previous query's send and this one's receipt, which bounds the skew as
// tightly as the round trips and the polling step allow.
func measureSkew(ctx context.Context, clk localClock, read func(context.Context) (time.Time, error), resolution time.Duration) (skewEstimate, error) {
	sample := func() (clockSample, error) {
		sent := clk.Now()
		server, err := read(ctx)
		return clockSample{sent: sent, server: server, received: clk.Now()}, err
	}
	first, err := sample()
	if err != nil {
		return skewEstimate{}, err
	}
	if resolution <= 0 {
		best := first
		for range skewSamples - 1 {
			s, err := sample()
			if err != nil {
				return skewEstimate{}, err
			}
			if s.roundTrip() < best.roundTrip() {
				best = s
			}
		}
		rt := best.roundTrip()
		return skewEstimate{Skew: best.server.Sub(best.sent.Add(rt / 2)), Uncertainty: rt / 2, RoundTrip: rt}, nil
	}
	// coarse is what one reading says: the server's time was within
	// [server, server+resolution) at some instant of the query.
	coarse := func(s clockSample) skewEstimate {
		half := s.roundTrip() / 2
		return skewEstimate{
			Skew:        s.server.Add(resolution / 2).Sub(s.sent.Add(half)),
			Uncertainty: resolution/2 + half,
			RoundTrip:   s.roundTrip(),
		}
	}
	best := coarse(first)
	step := resolution / 100
	prev := first
	for clk.Now().Sub(first.sent) < 3*resolution {
		if err := clk.Sleep(ctx, step); err != nil {
			return skewEstimate{}, err
		}
		cur, err := sample()
		if err != nil {
			return skewEstimate{}, err
		}
		if c := coarse(cur); c.Uncertainty < best.Uncertainty {
			best = c
		}
		if cur.server.Sub(prev.server) == resolution {
			// Ticked once between the two queries. Worth it unless the
			// round trips are as long as the resolution.
			if span := cur.received.Sub(prev.sent); span/2 < best.Uncertainty {
				return skewEstimate{Skew: cur.server.Sub(prev.sent.Add(span / 2)), Uncertainty: span / 2, RoundTrip: best.RoundTrip}, nil
			}
			break
		}
		prev = cur
	}
	return best, nil
}

// judgeSkew: fail when the skew is surely beyond limit, ok when surely
// within it, warn when the measurement cannot tell.
func judgeSkew(check, what string, e skewEstimate, limit time.Duration) checkResult {
	abs := e.Skew
	if abs < 0 {
		abs = -abs
	}
	var r checkResult
	switch {
	case abs-e.Uncertainty > limit:
		r = result(check, statusFail, "this machine's clock and %s's differ by %s (±%s, round trip %s), more than --max-clock-skew %s: synchronise both with NTP (chrony)",
			what, fmtSkew(e.Skew), fmtDur(e.Uncertainty), fmtDur(e.RoundTrip), limit)
	case abs+e.Uncertainty <= limit:
		r = result(check, statusOK, "skew %s ±%s (%s minus this machine), round trip %s", fmtSkew(e.Skew), fmtDur(e.Uncertainty), what, fmtDur(e.RoundTrip))
	default:
		r = result(check, statusWarn, "skew %s ±%s: cannot tell whether within --max-clock-skew %s (round trip %s); run doctor closer to %s",
			fmtSkew(e.Skew), fmtDur(e.Uncertainty), limit, fmtDur(e.RoundTrip), what)
	}
	ms := func(d time.Duration) *float64 { v := float64(d) / float64(time.Millisecond); return &v }
	r.SkewMS, r.UncertaintyMS, r.RoundTripMS = ms(e.Skew), ms(e.Uncertainty), ms(e.RoundTrip)
	return r
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= time.Second || d <= -time.Second:
		return d.Round(time.Millisecond).String()
	case d >= time.Millisecond || d <= -time.Millisecond:
		return d.Round(10 * time.Microsecond).String()
	}
	return d.Round(time.Microsecond).String()
}

func fmtSkew(d time.Duration) string {
	if d >= 0 {
		return "+" + fmtDur(d)
	}
	return fmtDur(d)
}

// ---------------------------------------------------------------- store

const (
	checkStoreConnect = "store.connect"
	checkStoreSchema  = "store.schema"
	checkStoreClock   = "store.clock"
)

var storeCheckNames = []string{checkStoreConnect, checkStoreSchema, checkStoreClock}

func (d *doctor) storeChecks(ctx context.Context) []checkResult {
	if d.flags.crdbDSN == "" {
		return skipAll(storeCheckNames, "no --crdb-dsn (LEDGER_CRDB_DSN): nothing to check (the embedded store of `ledger dev` has no server)")
	}
	pcfg, err := pgx.ParseConfig(d.flags.crdbDSN)
	if err != nil {
		// The error would repeat the DSN, which may hold a password.
		return append([]checkResult{result(checkStoreConnect, statusFail, "cannot parse --crdb-dsn: want postgresql://user@host:port/database?sslmode=...")},
			skipAll(storeCheckNames[1:], "store unreachable (see store.connect)")...)
	}
	where := fmt.Sprintf("%s:%d/%s", pcfg.Host, pcfg.Port, pcfg.Database)

	var (
		ck  *pgstore.Checker
		srv pgstore.Server
	)
	err = d.within(ctx, func(ctx context.Context) (err error) {
		if ck, err = pgstore.NewChecker(ctx, pgstore.Config{DSN: d.flags.crdbDSN}); err != nil {
			return err
		}
		srv, err = ck.Server(ctx)
		return err
	})
	if ck != nil {
		defer func() {
			// Bounded: a server that stopped answering must not hold
			// the report.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.flags.timeout)
			defer cancel()
			_ = ck.Close(cctx)
		}()
	}
	if err != nil {
		return append([]checkResult{result(checkStoreConnect, statusFail, "%s: check --crdb-dsn, that the database runs, and its user and TLS settings", d.unreachable(where, err))},
			skipAll(storeCheckNames[1:], "store unreachable (see store.connect)")...)
	}
	conn := result(checkStoreConnect, statusOK, "%s at %s", shortVersion(srv.Version), where)
	if !srv.CockroachDB {
		conn.Detail += " (not CockroachDB: fine for tests and development; production runs CockroachDB)"
	}
	conn.Version = srv.Version
	out := []checkResult{conn}

	var st pgstore.SchemaStatus
	err = d.within(ctx, func(ctx context.Context) (err error) {
		st, err = ck.Schema(ctx)
		return err
	})
	out = append(out, storeSchemaCheck(st, err))

	var est skewEstimate
	err = d.within(ctx, func(ctx context.Context) (err error) {
		est, err = measureSkew(ctx, d.clock, ck.Now, 0)
		return err
	})
	if err != nil {
		out = append(out, result(checkStoreClock, statusFail, "cannot read the database's clock (%v)", err))
	} else {
		out = append(out, judgeSkew(checkStoreClock, "the database", est, d.flags.maxClockSkew))
	}
	return out
}

// shortVersion is version()'s answer up to the build details:
// "PostgreSQL 16.2", "CockroachDB CCL v24.1.0".
func shortVersion(v string) string {
	for _, sep := range []string{" on ", " ("} {
		if i := strings.Index(v, sep); i > 0 {
			v = v[:i]
		}
	}
	return v
}

func storeSchemaCheck(st pgstore.SchemaStatus, err error) checkResult {
	const migrate = "run `ledger migrate --crdb-dsn ...` (or apply processors/pgstore/schema.sql) with a user that may run DDL"
	schema := st.Schema
	if schema == "" {
		schema = "(none: the search_path names no schema that exists)"
	}
	switch {
	case err != nil:
		return result(checkStoreSchema, statusFail, "cannot read the schema (%v): check that the user may read information_schema and pg_catalog", err)
	case !st.Migrated():
		return result(checkStoreSchema, statusFail, "schema %s has none of the store's tables (%s): not migrated; %s", schema, strings.Join(st.MissingTables, ", "), migrate)
	case !st.Current():
		var missing []string
		for _, group := range [][]string{st.MissingTables, st.MissingColumns, st.MissingIndexes} {
			missing = append(missing, group...)
		}
		if st.MissingStatusCheck {
			missing = append(missing, "the status check")
		}
		if st.UnvalidatedStatusCheck {
			missing = append(missing, "a validated status check (a migration stopped before validating it)")
		}
		for _, s := range st.MissingStatuses {
			missing = append(missing, "status "+string(s))
		}
		return result(checkStoreSchema, statusFail, "schema %s is older than this build, it lacks %s: %s", schema, strings.Join(missing, ", "), migrate)
	case len(st.ObsoleteIndexes) > 0:
		return result(checkStoreSchema, statusWarn, "schema %s still has indexes an older build created and this build does not use (%s); every write pays for them: %s", schema, strings.Join(st.ObsoleteIndexes, ", "), migrate)
	case len(st.NewerStatuses) > 0:
		return result(checkStoreSchema, statusWarn, "schema %s allows statuses this build does not know (%s): a newer build migrated it; finish rolling it out", schema, strings.Join(st.NewerStatuses, ", "))
	}
	return result(checkStoreSchema, statusOK, "schema %s holds every table, column, index and status this build uses", schema)
}

// ---------------------------------------------------------------- ClickHouse

const (
	checkCHConnect = "clickhouse.connect"
	checkCHSchema  = "clickhouse.schema"
	checkCHClock   = "clickhouse.clock"
)

var clickhouseCheckNames = []string{checkCHConnect, checkCHSchema, checkCHClock}

func (d *doctor) clickhouseChecks(ctx context.Context) []checkResult {
	if d.flags.clickhouseDSN == "" {
		return skipAll(clickhouseCheckNames, "no --clickhouse-dsn (LEDGER_CLICKHOUSE_DSN): nothing to check")
	}
	opts, err := clickhouse.ParseDSN(d.flags.clickhouseDSN)
	if err != nil {
		// The error would repeat the DSN, which may hold a password.
		return append([]checkResult{result(checkCHConnect, statusFail, "cannot parse --clickhouse-dsn: want clickhouse://user@host:9000/database")},
			skipAll(clickhouseCheckNames[1:], "ClickHouse unreachable (see clickhouse.connect)")...)
	}
	addr := strings.Join(opts.Addr, ",")

	var (
		st      *chstore.Store
		version string
	)
	err = d.within(ctx, func(ctx context.Context) (err error) {
		// Open only pings: it creates nothing.
		if st, err = chstore.Open(ctx, chstore.Config{DSN: d.flags.clickhouseDSN, Database: d.flags.clickhouseDB}); err != nil {
			return err
		}
		version, err = st.ServerVersion(ctx)
		return err
	})
	if st != nil {
		defer st.Close()
	}
	if err != nil {
		return append([]checkResult{result(checkCHConnect, statusFail, "%s: check --clickhouse-dsn (native protocol port, usually 9000), that ClickHouse runs, and its user", d.unreachable(addr, err))},
			skipAll(clickhouseCheckNames[1:], "ClickHouse unreachable (see clickhouse.connect)")...)
	}
	conn := result(checkCHConnect, statusOK, "ClickHouse %s at %s", version, addr)
	conn.Version = version
	out := []checkResult{conn}

	var (
		missing []string
		have    int
	)
	err = d.within(ctx, func(ctx context.Context) (err error) {
		if missing, err = st.MissingTables(ctx); err != nil {
			return err
		}
		have, err = st.SchemaVersion(ctx)
		return err
	})
	out = append(out, clickhouseSchemaCheck(st.Database(), missing, have, chstore.LatestVersion(), err))

	var est skewEstimate
	err = d.within(ctx, func(ctx context.Context) (err error) {
		est, err = measureSkew(ctx, d.clock, st.Now, time.Second)
		return err
	})
	if err != nil {
		out = append(out, result(checkCHClock, statusFail, "cannot read ClickHouse's clock (%v)", err))
	} else {
		out = append(out, judgeSkew(checkCHClock, "ClickHouse", est, d.flags.maxClockSkew))
	}
	return out
}

// dropped are the tables of missing that a database at version have
// should hold: not created by a later version (chstore.CreatedAfter).
func dropped(missing []string, have int) []string {
	later := chstore.CreatedAfter(have)
	var out []string
	for _, t := range missing {
		if !slices.Contains(later, t) {
			out = append(out, t)
		}
	}
	return out
}

func clickhouseSchemaCheck(db string, missing []string, have, want int, err error) checkResult {
	const migrate = "run `ledger projector migrate`"
	var r checkResult
	switch {
	case err != nil:
		r = result(checkCHSchema, statusFail, "cannot read database %s's tables (%v): check the user may read system.tables", db, err)
	case len(missing) > 0 && have == 0:
		r = result(checkCHSchema, statusFail, "database %s lacks the projection's tables (%s): not migrated; %s", db, strings.Join(missing, ", "), migrate)
	case len(dropped(missing, have)) > 0:
		// Migrate creates only the tables of the versions it applies;
		// rebuild --swap refuses a live database behind this build.
		first := ""
		if have < want {
			first = "`ledger projector migrate`, then "
		}
		r = result(checkCHSchema, statusFail, "database %s at schema version %d lacks %s, which `ledger projector migrate` does not create again: dropped by hand? rebuild it (%s`ledger projector rebuild --swap`, with the projector stopped)", db, have, strings.Join(dropped(missing, have), ", "), first)
	case have < want:
		r = result(checkCHSchema, statusFail, "database %s is at schema version %d, this build writes %d: %s", db, have, want, migrate)
	case have > want:
		r = result(checkCHSchema, statusWarn, "database %s is at schema version %d, newer than this build's %d: a newer build migrated it; finish rolling it out", db, have, want)
	default:
		r = result(checkCHSchema, statusOK, "database %s holds the projection's tables at schema version %d", db, have)
	}
	if err == nil {
		r.SchemaVersion, r.WantSchemaVersion = &have, &want
	}
	return r
}
