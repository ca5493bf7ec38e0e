package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/failpoint"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/boltstore"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/schemas"
)

// kafkaFlags name the cluster and the topics.
type kafkaFlags struct {
	brokers    []string
	requests   string
	events     string
	control    string
	dlq        string
	partitions int32
	replicas   int16
	// sessionTimeout and rebalanceTimeout configure the processors'
	// consumer-group membership.
	sessionTimeout   time.Duration
	rebalanceTimeout time.Duration
	// security is TLS and SASL for every client of the cluster.
	security ledger.Security
	// groupPrefix names the processors' consumer groups and
	// transactional ids (loopIDs).
	groupPrefix string
}

// loopIDs are a processor loop's consumer group and transactional id.
type loopIDs struct{ group, txn string }

// kafkaNameRE is what a group prefix may hold: Kafka takes any string as
// a group or transactional id, but these characters keep the names, and
// the ACL prefixes that grant them, free of quoting surprises.
var kafkaNameRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,200}$`)

// loopIDs returns role's loop's group, "<prefix>-<role>", and its
// transactional id, "<prefix>-<role>-<instance>": one per instance, so
// that a restarted instance fences its old self and no other.
func (k *kafkaFlags) loopIDs(role, instance string) (loopIDs, error) {
	p := k.groupPrefix
	if p == "" {
		p = defaultGroupPrefix
	}
	if !kafkaNameRE.MatchString(p) {
		return loopIDs{}, fmt.Errorf("--kafka-group-prefix %q: want up to 200 letters, digits, '.', '_' or '-'", p)
	}
	// Negative, Kafka would use its own default while the loop's leave
	// of the group gave up at once.
	if k.sessionTimeout < 0 || k.rebalanceTimeout < 0 {
		return loopIDs{}, fmt.Errorf("--session-timeout %v, --rebalance-timeout %v: must not be negative", k.sessionTimeout, k.rebalanceTimeout)
	}
	return loopIDs{group: p + "-" + role, txn: p + "-" + role + "-" + instance}, nil
}

// defaultGroupPrefix is --kafka-group-prefix's default.
const defaultGroupPrefix = "ledger"

func (k *kafkaFlags) register(fs *pflag.FlagSet) {
	fs.StringSliceVar(&k.brokers, "kafka-brokers", []string{devKafkaAddr}, "Kafka bootstrap brokers, comma separated")
	fs.StringVar(&k.requests, "topic-requests", "toolcalls.requests", "topic agents publish envelopes to")
	fs.StringVar(&k.events, "topic-events", "toolcalls.events", "the ledger's events topic")
	fs.StringVar(&k.control, "topic-control", "toolcalls.control", "compacted control topic (kill switch, revocations)")
	fs.StringVar(&k.dlq, "topic-dlq", "toolcalls.dlq", "topic for requests that cannot be parsed")
	fs.Int32Var(&k.partitions, "partitions", 12, "partitions per topic when the ledger creates its topics")
	fs.Int16Var(&k.replicas, "replication-factor", 1, "replication factor when the ledger creates its topics (3 in production)")
	fs.StringVar(&k.groupPrefix, "kafka-group-prefix", defaultGroupPrefix, "prefix of the intake's, executors' and reconciler's consumer groups (<prefix>-intake, <prefix>-executor, <prefix>-reconciler) and transactional ids (<prefix>-<role>-<instance-id>): two ledgers on one Kafka cluster need prefixes of their own (and the projector its own --group), none starting with another's <prefix>-, and ACLs grant them by prefix. Choose it once: new groups have no offsets, so a changed prefix reads the topics again from their start")
	fs.DurationVar(&k.sessionTimeout, "session-timeout", 45*time.Second, "how long an intake or executor may go silent before its consumer group gives its partitions to the others")
	fs.DurationVar(&k.rebalanceTimeout, "rebalance-timeout", time.Minute, "how long a rebalance of an intake or executor group waits for its members to rejoin (and for each to end the transaction it is in)")
	tc, sc := &k.security.TLS, &k.security.SASL
	fs.BoolVar(&tc.Enabled, "kafka-tls", false, "connect to Kafka over TLS (implied by any other --kafka-tls-* flag)")
	fs.StringVar(&tc.CAFile, "kafka-tls-ca", "", "PEM file of the CAs that sign the brokers' certificates (default: the system's roots); read again by new connections when it changes")
	fs.StringVar(&tc.CertFile, "kafka-tls-cert", "", "PEM client certificate, for brokers that require mutual TLS (with --kafka-tls-key); read again with its key by new connections when they change")
	fs.StringVar(&tc.KeyFile, "kafka-tls-key", "", "PEM key of --kafka-tls-cert")
	fs.StringVar(&tc.ServerName, "kafka-tls-server-name", "", "name to verify every broker's certificate against (default: the host dialled)")
	fs.BoolVar(&tc.InsecureSkipVerify, "kafka-tls-insecure-skip-verify", false, "accept any broker certificate (encrypted but unauthenticated; debugging only)")
	fs.StringVar(&sc.Mechanism, "kafka-sasl-mechanism", "", "SASL mechanism: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (default: none)")
	fs.StringVar(&sc.User, "kafka-sasl-user", "", "SASL user, for PLAIN and SCRAM")
	fs.StringVar(&sc.Password, "kafka-sasl-password", "", "SASL password, for PLAIN and SCRAM; prefer LEDGER_KAFKA_SASL_PASSWORD over the command line, where other users see it")
	fs.StringVar(&sc.TokenFile, "kafka-sasl-token-file", "", "file holding the OAUTHBEARER token, read again at every authentication so that it can be rotated in place")
	fs.BoolVar(&sc.AllowPlaintext, "kafka-sasl-allow-plaintext", false, "let PLAIN and OAUTHBEARER send the password or the token without TLS to brokers other than loopback ones (a network trusted end to end); without it such a connection is refused before anything is sent")
}

func (k *kafkaFlags) topics() ledger.Topics {
	return ledger.Topics{Requests: k.requests, Events: k.events, Control: k.control, DLQ: k.dlq}
}

func (k *kafkaFlags) client(logger *slog.Logger) ledger.ClientConfig {
	return ledger.ClientConfig{Brokers: k.brokers, Logger: logger, SessionTimeout: k.sessionTimeout, RebalanceTimeout: k.rebalanceTimeout, Security: k.security}
}

func (k *kafkaFlags) topicConfig() ledger.TopicConfig {
	return ledger.TopicConfig{Topics: k.topics(), Partitions: k.partitions, ReplicationFactor: k.replicas}
}

// storeFlags choose the execution store.
type storeFlags struct {
	crdbDSN string
	dataDir string
	// plainOutboxes: pgstore.Config.PlainOutboxes.
	plainOutboxes bool
	// failpoint is the SQL store's crash hook, set by a role that runs
	// under the reliability suite; nil otherwise.
	failpoint failpoint.Hook
	// retried, if set, counts the SQL store's transaction retries.
	retried func(op string)
}

func (s *storeFlags) register(fs *pflag.FlagSet, withDataDir bool) {
	fs.StringVar(&s.crdbDSN, "crdb-dsn", "", "CockroachDB (or PostgreSQL) DSN for the execution store, e.g. postgresql://root@localhost:26257/ledger?sslmode=disable")
	fs.BoolVar(&s.plainOutboxes, "plain-outboxes", false, "with --crdb-dsn, store the events' outboxes uncompressed, as builds before compressed outboxes did: set it during a rolling upgrade from such a build (both forms are always read)")
	if withDataDir {
		fs.StringVar(&s.dataDir, "data-dir", devDataDir, "directory for embedded state (Kafka log, execution store, call index)")
	}
}

// openStore opens the configured execution store: CockroachDB/PostgreSQL
// when a DSN is set, else the embedded store in the data directory.
func (s *storeFlags) openStore(ctx context.Context, logger *slog.Logger) (processors.Store, string, error) {
	if s.crdbDSN != "" {
		st, err := pgstore.Open(ctx, pgstore.Config{DSN: s.crdbDSN, Logger: logger, Failpoint: s.failpoint, Retried: s.retried, PlainOutboxes: s.plainOutboxes})
		if err != nil {
			return nil, "", err
		}
		return st, "sql (" + redactDSN(s.crdbDSN) + ")", nil
	}
	if s.dataDir == "" {
		return nil, "", fmt.Errorf("no --crdb-dsn and no --data-dir: nowhere to keep execution records")
	}
	path := filepath.Join(s.dataDir, "executions.db")
	st, err := boltstore.Open(boltstore.Config{Path: path, Logger: logger})
	if err != nil {
		return nil, "", err
	}
	return st, "embedded (" + path + ")", nil
}

// redactDSN hides a DSN's secrets for logs and banners: the password of
// its user information and the values of its query parameters that may
// be secret (the drivers take password and sslpassword, the passphrase
// of an encrypted client key, there too). A DSN that is no URL with a
// host (PostgreSQL's keyword=value form) is not shown at all.
func redactDSN(dsn string) string {
	u, err := parseURL(dsn)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return "(dsn)"
	}
	if u.RawQuery != "" {
		q := u.Query()
		for name, vs := range q {
			if secretParam(name) {
				for i := range vs {
					vs[i] = "xxxxx"
				}
			}
		}
		u.RawQuery = q.Encode()
	}
	return u.Redacted()
}

// secretParam reports whether a DSN's query parameter may hold a secret.
func secretParam(name string) bool {
	name = strings.ToLower(name)
	for _, s := range []string{"pass", "secret", "token", "credential"} {
		if strings.Contains(name, s) {
			return true
		}
	}
	return false
}

// registryFlags choose the tool registry.
type registryFlags struct{ dir string }

func (r *registryFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&r.dir, "registry-dir", "", "directory holding tools/<name>.v<version>.json (default: the built-in demo registry)")
}

// load loads the registry; logger, when not nil, is told when it is the
// built-in demo's: the processes of a deployment decide and run each call
// by the definitions of their own registries, and one left on the demo's
// runs another definition under the same name and version (an
// idempotency its backend does not have, another schema).
func (r *registryFlags) load(logger *slog.Logger) (*schemas.Registry, error) {
	if r.dir != "" {
		reg, err := schemas.Load(os.DirFS(r.dir))
		if err == nil && logger != nil {
			logger.Info("tool registry loaded", "dir", r.dir, "tools", toolDigests(reg))
		}
		return reg, err
	}
	reg, err := schemas.Demo()
	if err == nil && logger != nil {
		logger.Warn("no --registry-dir: the built-in demo registry's tools are in force; every process of a deployment must load the same registry, or the calls one admits are not run, approved or reconciled by another (tool_defined_otherwise)", "tools", toolDigests(reg))
	}
	return reg, err
}

// toolDigests lists reg's tool versions with the start of their digests
// ("create_ticket.v1=sha256:1f2e3d4c5b6a,..."): the same list in two
// processes' logs says they hold the same definitions.
func toolDigests(reg *schemas.Registry) string {
	var names []string
	for _, t := range reg.Tools() {
		d := t.Digest()
		names = append(names, fmt.Sprintf("%s.v%d=%s", t.Name, t.Version, d[:min(len(d), len("sha256:")+12)]))
	}
	return strings.Join(names, ",")
}

func instanceID() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		h = "local"
	}
	return h
}

// kgoPublisher publishes envelopes to the request topic.
type kgoPublisher struct {
	cl    *kgo.Client
	topic string
}

func newPublisher(cc ledger.ClientConfig, topic string) (*kgoPublisher, error) {
	cl, err := ledger.NewClient(cc, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		return nil, err
	}
	return &kgoPublisher{cl: cl, topic: topic}, nil
}

// Publish produces the envelope and waits for its acknowledgement until
// ctx ends. franz-go stops honouring a record's context once its batch
// was sent, and retries one the broker may have written (a request timed
// out, too few in-sync replicas after the append) for as long as that
// lasts: the wait is the caller's to bound, and an envelope given up on
// may yet be published. Sending it again under its key is safe: an
// identical envelope is the same call.
func (p *kgoPublisher) Publish(ctx context.Context, key, value []byte) error {
	done := make(chan error, 1)
	p.cl.Produce(ctx, &kgo.Record{Topic: p.topic, Key: key, Value: value}, func(_ *kgo.Record, err error) { done <- err })
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("not acknowledged, and may yet be published: %w", ctx.Err())
	}
}

func (p *kgoPublisher) Close() { p.cl.Close() }

// eventPublisher appends the events of steps outside a transactional loop
// (approval decisions, expiries) to the events topic. Their events are in
// the execution store's outbox first, so a failed publish is appended
// later by the executor's sweep.
type eventPublisher struct{ cl *kgo.Client }

func newEventPublisher(cc ledger.ClientConfig) (*eventPublisher, error) {
	cl, err := ledger.NewClient(cc, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		return nil, err
	}
	return &eventPublisher{cl: cl}, nil
}

func (p *eventPublisher) Publish(ctx context.Context, recs ...*kgo.Record) error {
	return p.cl.ProduceSync(ctx, recs...).FirstErr()
}

func (p *eventPublisher) Close() { p.cl.Close() }
