package ledger

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/plugin/kslog"
)

// Topics names the ledger's Kafka topics.
type Topics struct {
	// Requests carries raw envelopes from agents. Default "toolcalls.requests".
	Requests string
	// Events is the ledger itself. Default "toolcalls.events".
	Events string
	// Control carries the kill switch and revocations; compacted.
	// Default "toolcalls.control".
	Control string
	// DLQ holds requests that could not even be parsed, with the reason.
	// Default "toolcalls.dlq".
	DLQ string
}

// WithDefaults fills empty names with the defaults.
func (t Topics) WithDefaults() Topics {
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	def(&t.Requests, "toolcalls.requests")
	def(&t.Events, "toolcalls.events")
	def(&t.Control, "toolcalls.control")
	def(&t.DLQ, "toolcalls.dlq")
	return t
}

// TopicConfig sizes the topics EnsureTopics creates.
type TopicConfig struct {
	Topics Topics
	// Partitions per topic; default 12. Calls are keyed by tenant-scoped
	// key, so partitions bound how far intake and executor scale out.
	Partitions int32
	// ReplicationFactor; default 1 (ledger dev). Production: 3, with
	// min.insync.replicas 2.
	ReplicationFactor int16
}

// EnsureTopics creates the ledger's topics where they do not exist. It
// leaves existing topics alone, and asks to create only those it did not
// find: brokers check the Create permission before whether a topic
// exists, so that a principal without it (a role's) may run it as a
// check once an admin created the topics.
func EnsureTopics(ctx context.Context, cl *kgo.Client, cfg TopicConfig) error {
	t := cfg.Topics.WithDefaults()
	if cfg.Partitions <= 0 {
		cfg.Partitions = 12
	}
	if cfg.ReplicationFactor <= 0 {
		cfg.ReplicationFactor = 1
	}
	adm := kadm.NewClient(cl)
	// A principal that may not describe the topics (an admin granted
	// Create alone) lists none: every one is then asked to be created,
	// and a refusal says the listing failed too.
	existing, listErr := adm.ListTopics(ctx, t.Requests, t.Events, t.Control, t.DLQ)
	// The events are the ledger, and the control topic's latest action
	// per subject must survive forever (a freeze, a revocation): neither
	// may take the brokers' default retention, 7 days, and lose them.
	compact, forever := "compact", "-1"
	for _, spec := range []struct {
		name    string
		configs map[string]*string
	}{
		{t.Requests, nil},
		{t.Events, map[string]*string{"retention.ms": &forever, "retention.bytes": &forever}},
		{t.Control, map[string]*string{"cleanup.policy": &compact, "retention.ms": &forever}},
		{t.DLQ, nil},
	} {
		if d, ok := existing[spec.name]; ok && d.Err == nil {
			continue
		}
		_, err := adm.CreateTopic(ctx, cfg.Partitions, cfg.ReplicationFactor, spec.configs, spec.name)
		if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			if listErr != nil {
				return fmt.Errorf("create topic %s: %w (listing the topics first failed too: %v)", spec.name, err, listErr)
			}
			return fmt.Errorf("create topic %s: %w", spec.name, err)
		}
	}
	return nil
}

// ClientConfig is what every Kafka client of the ledger shares.
type ClientConfig struct {
	// Brokers to bootstrap from. Required.
	Brokers []string
	// Logger receives franz-go's logs at Warn and above. Nil discards.
	Logger *slog.Logger
	// Opts are extra franz-go options (tuning), applied last. TLS and
	// SASL belong in Security: a kgo.Dialer, kgo.DialTLSConfig or
	// kgo.SASL here escapes its checks (a password sent in clear) or
	// conflicts with its dialer.
	Opts []kgo.Opt
	// SessionTimeout is how long a consumer-group member (a Loop) may go
	// silent before the group takes its partitions away; a Loop then
	// heartbeats every third of it (at most every 3s). Default franz-go's
	// 45s.
	SessionTimeout time.Duration
	// RebalanceTimeout is how long a rebalance waits for the members to
	// rejoin, and so how long a member may take to end the transaction
	// it is in when one starts. Default franz-go's 60s.
	RebalanceTimeout time.Duration
	// Security is TLS and SASL for every connection; the zero value is
	// plaintext without authentication.
	Security Security
}

// baseOpts are the options every client uses.
func (c ClientConfig) baseOpts() ([]kgo.Opt, error) {
	if len(c.Brokers) == 0 {
		return nil, errors.New("kafka: no brokers configured")
	}
	opts := []kgo.Opt{kgo.SeedBrokers(c.Brokers...)}
	if c.Logger != nil {
		opts = append(opts, kgo.WithLogger(levelFilter{kslog.New(c.Logger.With("component", "kafka"))}))
	}
	if err := c.Security.checkBrokers(c.Brokers); err != nil {
		return nil, err
	}
	sec, err := c.Security.Opts()
	if err != nil {
		return nil, err
	}
	opts = append(opts, sec...)
	return append(opts, c.Opts...), nil
}

// levelFilter keeps franz-go's chatter at Info and below out of the
// ledger's logs.
type levelFilter struct{ kgo.Logger }

func (l levelFilter) Level() kgo.LogLevel { return kgo.LogLevelWarn }

// NewClient returns a plain client (producer, admin, or a reader that
// assigns partitions itself). Producing is idempotent; consuming, when the
// caller adds consume options, is read_committed.
func NewClient(c ClientConfig, opts ...kgo.Opt) (*kgo.Client, error) {
	base, err := c.baseOpts()
	if err != nil {
		return nil, err
	}
	base = append(base, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	cl, err := kgo.NewClient(append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("kafka client: %w", err)
	}
	return cl, nil
}

// Record builds the Kafka record for an event on topic.
func (e *Event) Record(topic string) (*kgo.Record, error) {
	b, err := e.Encode()
	if err != nil {
		return nil, err
	}
	return &kgo.Record{
		Topic: topic,
		Key:   []byte(e.Key().String()),
		Value: b,
		Headers: []kgo.RecordHeader{
			{Key: HeaderEventType, Value: []byte(e.Type)},
			{Key: HeaderTool, Value: []byte(e.Tool)},
		},
	}, nil
}

// Record headers the ledger sets.
const (
	// HeaderEventType carries the event type so that consumers can skip
	// events they do not handle without decoding them.
	HeaderEventType = "ledger-event-type"
	// HeaderTool carries the call's tool, for the same reason: metrics
	// and filters by tool without decoding.
	HeaderTool = "ledger-tool"
	// HeaderDLQReason carries the machine-readable reason a request went to
	// the DLQ; HeaderDLQDetail the human one; HeaderDLQSource the topic,
	// partition and offset it came from.
	HeaderDLQReason = "ledger-dlq-reason"
	HeaderDLQDetail = "ledger-dlq-detail"
	HeaderDLQSource = "ledger-dlq-source"
)

// Header returns the value of the first header named key, or nil.
func Header(r *kgo.Record, key string) []byte {
	for _, h := range r.Headers {
		if h.Key == key {
			return h.Value
		}
	}
	return nil
}

// ReasonBatchTooLarge is the DLQ reason of a batch of requests skipped
// unread, for what it decompresses to (LoopConfig.MaxBatchBytes).
const ReasonBatchTooLarge = "batch_too_large"

// DLQBatchRecord says on the DLQ that the batch at offsets [from, next)
// of topic's partition was skipped unread, for decompressing to more than
// max bytes: a record with no copy of the requests, which stay in the
// log there.
func DLQBatchRecord(dlq, topic string, partition int32, from, next int64, max int) *kgo.Record {
	return &kgo.Record{
		Topic: dlq,
		Headers: []kgo.RecordHeader{
			{Key: HeaderDLQReason, Value: []byte(ReasonBatchTooLarge)},
			{Key: HeaderDLQDetail, Value: fmt.Appendf(nil, "the batch at offsets %d to %d of %s/%d decompresses to more than %d bytes (--max-batch-bytes) and was not read: its requests are still in the log there, for as long as it keeps them", from, next-1, topic, partition, max)},
			{Key: HeaderDLQSource, Value: fmt.Appendf(nil, "%s/%d/%d", topic, partition, from)},
		},
	}
}

// DLQRecord wraps an unparseable request for the DLQ: the original key and
// bytes with anything that looks like a token redacted, and why. Copies
// too large for a DLQ record are cut (see DLQMaxValueBytes and
// HeaderDLQTruncated).
func DLQRecord(topic string, src *kgo.Record, reason, detail string) *kgo.Record {
	return boundDLQ(&kgo.Record{
		Topic: topic,
		Key:   RedactTokens(src.Key),
		Value: RedactTokens(src.Value),
		Headers: []kgo.RecordHeader{
			{Key: HeaderDLQReason, Value: []byte(reason)},
			{Key: HeaderDLQDetail, Value: RedactTokens([]byte(detail))},
			{Key: HeaderDLQSource, Value: fmt.Appendf(nil, "%s/%d/%d", src.Topic, src.Partition, src.Offset)},
		},
	}, len(src.Value))
}
