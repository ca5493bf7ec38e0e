// Package callindex is the embedded projection of the events topic: for
// every call, its folded state and its events, in a bbolt file. It is what
// `ledger dev` and the HTTP API answer "where is my call" from. Applying an
// event twice is harmless (calls are idempotent on (key, seq)), so the
// consumer commits offsets after writing and replays on restart.
package callindex

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	bolt "go.etcd.io/bbolt"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// ErrNotFound: the index knows nothing under the key.
var ErrNotFound = errors.New("call not found")

var bucketCalls = []byte("calls")

// MaxRefusals is how many refused submissions the index keeps per key.
const MaxRefusals = 100

// Call is what the index knows of one call key.
type Call struct {
	Key   ledger.CallKey     `json:"-"`
	State statemachine.State `json:"state"`
	Seq   int64              `json:"seq"`
	// Events are the call's steps in seq order, duplicates dropped.
	Events []ledger.Event `json:"events"`
	// Refusals are envelopes refused under this key (seq 0 events), the
	// first MaxRefusals of them; RefusalsDropped counts the rest, so that
	// a flood of bad envelopes cannot grow a call's record without bound.
	Refusals        []ledger.Event `json:"refusals,omitempty"`
	RefusalsDropped int            `json:"refusals_dropped,omitempty"`
	// Anomalies counts events that did not fold (an illegal transition
	// or a gap): a human should look.
	Anomalies int `json:"anomalies,omitempty"`
}

// Settled reports whether the call will not move without a human.
func (c *Call) Settled() bool { return c.Seq > 0 && c.State.Settled() }

// fold returns the state machine's view of the call.
func (c *Call) fold() statemachine.Call {
	evs := make([]statemachine.Event, len(c.Events))
	for i := range c.Events {
		evs[i] = c.Events[i].Transition()
	}
	sc, _ := statemachine.Fold(evs)
	return sc
}

// Index is the call index. It is safe for concurrent use.
type Index struct {
	db     *bolt.DB
	logger *slog.Logger
}

// Open opens (creating if needed) the index file at path.
func Open(path string, logger *slog.Logger) (*Index, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open call index %s: %w", path, err)
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(bucketCalls)
		return err
	}); err != nil {
		db.Close()
		return nil, fmt.Errorf("init call index: %w", err)
	}
	return &Index{db: db, logger: logger}, nil
}

// Close closes the file.
func (ix *Index) Close() error { return ix.db.Close() }

// Apply folds evs into the index in one write.
func (ix *Index) Apply(evs []ledger.Event) error {
	return ix.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketCalls)
		cache := make(map[string]*Call)
		for i := range evs {
			e := evs[i]
			k := e.Key().String()
			c, ok := cache[k]
			if !ok {
				c = &Call{}
				if raw := b.Get([]byte(k)); raw != nil {
					if err := json.Unmarshal(raw, c); err != nil {
						return fmt.Errorf("call %s: %w", k, err)
					}
				}
				cache[k] = c
			}
			ix.apply(c, e)
		}
		for k, c := range cache {
			raw, err := json.Marshal(c)
			if err != nil {
				return err
			}
			if err := b.Put([]byte(k), raw); err != nil {
				return err
			}
		}
		return nil
	})
}

func (ix *Index) apply(c *Call, e ledger.Event) {
	if e.Refusal() {
		for _, r := range c.Refusals {
			if r.EventID == e.EventID {
				return
			}
		}
		if len(c.Refusals) >= MaxRefusals {
			c.RefusalsDropped++
			return
		}
		c.Refusals = append(c.Refusals, e)
		return
	}
	next, _, err := statemachine.Apply(c.fold(), e.Transition())
	switch {
	case errors.Is(err, statemachine.ErrDuplicateEvent):
		return
	case err != nil:
		c.Anomalies++
		ix.logger.Error("event does not fold", "call_key", e.Key().String(), "seq", e.Seq, "type", e.Type, "err", err)
		return
	}
	c.State, c.Seq = next.State, next.Seq
	c.Events = append(c.Events, e)
}

// Get returns what the index knows under key.
func (ix *Index) Get(key ledger.CallKey) (Call, error) {
	var c Call
	err := ix.db.View(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bucketCalls).Get([]byte(key.String()))
		if raw == nil {
			return ErrNotFound
		}
		return json.Unmarshal(raw, &c)
	})
	c.Key = key
	return c, err
}

// RunConfig configures the index's consumer.
type RunConfig struct {
	Client ledger.ClientConfig
	// Topic is the events topic. Required.
	Topic string
	// Group is the consumer group; default "ledger-callindex".
	Group string
}

// Run consumes the events topic into the index until ctx is done. Offsets
// are committed only after the events they cover are written.
func (ix *Index) Run(ctx context.Context, cfg RunConfig) error {
	if cfg.Group == "" {
		cfg.Group = "ledger-callindex"
	}
	cl, err := ledger.NewClient(cfg.Client,
		kgo.ConsumerGroup(cfg.Group),
		kgo.ConsumeTopics(cfg.Topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
	)
	if err != nil {
		return err
	}
	defer cl.Close()
	for {
		fetches := cl.PollRecords(ctx, 1000)
		if ctx.Err() != nil {
			return nil
		}
		fetches.EachError(func(t string, p int32, err error) {
			ix.logger.Warn("fetch error", "topic", t, "partition", p, "err", err)
		})
		recs := fetches.Records()
		if len(recs) == 0 {
			continue
		}
		evs := make([]ledger.Event, 0, len(recs))
		for _, r := range recs {
			e, err := ledger.DecodeEvent(r.Value)
			if err != nil {
				ix.logger.Error("undecodable event", "topic", r.Topic, "partition", r.Partition, "offset", r.Offset, "err", err)
				continue
			}
			evs = append(evs, e)
		}
		if err := ix.Apply(evs); err != nil {
			// Without the write the offsets must not move: stop, and
			// let the owner restart us from the committed offsets.
			return fmt.Errorf("apply %d events: %w", len(evs), err)
		}
		if err := cl.CommitRecords(ctx, recs...); err != nil && ctx.Err() == nil {
			ix.logger.Warn("commit offsets", "err", err)
		}
	}
}
