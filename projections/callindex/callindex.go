// Package callindex is the embedded projection of the events topic: for
// every call, its events and its folded state, in a bbolt file. It is what
// `ledger dev` and the HTTP API answer "where is my call" from, and it
// implements projections.Sink and projections.Queries, the same answers
// chstore gives from ClickHouse. Applying an event twice is harmless
// (events are deduplicated by event id), so a consumer commits offsets
// after writing and replays on restart.
//
// The file holds these buckets:
//
//	calls       "<tenant>/<key>" → the Call, JSON
//	refs        kind \x00 value \x00 tenant \x00 key → "<tenant>/<key>"
//	unresolved  tenant \x00 key → "<tenant>/<key>", while the call waits
//	actions     partition (4 bytes) offset (8 bytes) subject → the Action, JSON
//	meta        "layout" → the layout version the file is indexed for
//
// refs indexes the references BlastRadius names (jti, credential_family,
// policy_version and role from decision events, approver, approval_id, call_id,
// trace_id, tool_digest from requested events) so that a question naming one reads only the calls that
// carry it; tenant-, tool- and state-only questions scan calls, whose
// keys put a tenant's calls together. Every index is a superset: queries check each call they read
// against the filter, so a key that a long or odd value makes ambiguous
// can only cost a read, never a wrong answer.
package callindex

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// ErrNotFound: the index knows nothing under the key. It is
// projections.ErrNotFound, so that Get's and Trace's callers branch on
// one sentinel.
var ErrNotFound = projections.ErrNotFound

var (
	bucketCalls      = []byte("calls")
	bucketRefs       = []byte("refs")
	bucketUnresolved = []byte("unresolved")
	bucketActions    = []byte("actions")
	bucketMeta       = []byte("meta")
)

// layout names the buckets' current layout: a file written before refs
// and unresolved existed (layout 1), before refs held call_id and
// trace_id (2), before they held the roles of decisions (3), or before
// they held the tool definitions calls were admitted under (4), is
// indexed again when opened.
var (
	metaLayout = []byte("layout")
	layout     = []byte("5")
)

// MaxRefusals is how many refused submissions the index keeps per key.
const MaxRefusals = projections.MaxRefusals

// Call is what the index knows of one call key.
type Call struct {
	Key ledger.CallKey `json:"-"`
	// State and Seq are the state machine's fold of Events: events that
	// do not fold are skipped (see Anomalies).
	State statemachine.State `json:"state"`
	Seq   int64              `json:"seq"`
	// Events are every event under the key with seq 1 and up, each once
	// (by event id), in seq order, whether or not they fold: the log as
	// it is, for the trace.
	Events []ledger.Event `json:"events"`
	// Refusals are envelopes refused under this key (seq 0 events), by
	// time: at most MaxRefusals of them, the earliest and the latest
	// (projections.KeepRefusals); RefusalsDropped counts the
	// rest, so that a flood of bad envelopes cannot grow a call's record
	// without bound. A dropped refusal delivered again counts again.
	Refusals        []ledger.Event `json:"refusals,omitempty"`
	RefusalsDropped int            `json:"refusals_dropped,omitempty"`
	// Anomalies counts the events that do not fold now (an illegal
	// transition, or a gap that a late event has not filled yet): a
	// human should look.
	Anomalies int `json:"anomalies,omitempty"`
}

// Settled reports whether the call will not move without a human.
func (c *Call) Settled() bool { return c.Seq > 0 && c.State.Settled() }

// add records e in c and reports whether it was new to c.
func (c *Call) add(e ledger.Event) bool {
	if e.Refusal() {
		for _, r := range c.Refusals {
			if r.EventID == e.EventID {
				return false
			}
		}
		// Keep the earliest and the latest (projections.KeepRefusals),
		// as every projection does, whatever order they arrive in: of
		// MaxRefusals+1, the one dropped is the middle one, which no
		// later refusal brings back to either end.
		i, _ := slices.BinarySearchFunc(c.Refusals, e, projections.CompareRefusals)
		if len(c.Refusals) < MaxRefusals {
			c.Refusals = slices.Insert(c.Refusals, i, e)
			return true
		}
		c.RefusalsDropped++
		if i == MaxRefusals/2 {
			return false // e itself is the middle one
		}
		c.Refusals = slices.Insert(c.Refusals, i, e)
		c.Refusals = slices.Delete(c.Refusals, MaxRefusals/2, MaxRefusals/2+1)
		return true
	}
	for _, x := range c.Events {
		if x.EventID == e.EventID {
			return false
		}
	}
	// After every event of the same or a lower seq: in seq order, ties
	// in arrival order.
	i := len(c.Events)
	for i > 0 && c.Events[i-1].Seq > e.Seq {
		i--
	}
	c.Events = slices.Insert(c.Events, i, e)
	return true
}

// refold sets State, Seq and Anomalies from Events. A late event can fill
// a gap, so the fold starts over rather than continuing.
func (c *Call) refold() {
	var sc statemachine.Call
	anomalies := 0
	for i := range c.Events {
		next, _, err := statemachine.Apply(sc, c.Events[i].Transition())
		switch {
		case errors.Is(err, statemachine.ErrDuplicateEvent):
			continue
		case err != nil:
			anomalies++
			continue
		}
		sc = next
	}
	c.State, c.Seq, c.Anomalies = sc.State, sc.Seq, anomalies
}

// latest returns the call as its highest-seq event of a known type shows
// it; false when the key holds only refusals, or events of unknown types.
func (c *Call) latest() (projections.Call, bool) { return projections.Latest(c.Events) }

// Index is the call index. It is safe for concurrent use.
type Index struct {
	db     *bolt.DB
	logger *slog.Logger
}

// The Index is a projection.
var (
	_ projections.Sink    = (*Index)(nil)
	_ projections.Queries = (*Index)(nil)
)

// Open opens (creating if needed) the index file at path.
func Open(path string, logger *slog.Logger) (*Index, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open call index %s: %w", path, err)
	}
	ix := &Index{db: db, logger: logger}
	if err := db.Update(ix.init); err != nil {
		db.Close()
		return nil, fmt.Errorf("init call index: %w", err)
	}
	return ix, nil
}

// init creates the buckets and, in a file written by an older layout,
// builds the indexes from the calls.
func (ix *Index) init(tx *bolt.Tx) error {
	for _, name := range [][]byte{bucketCalls, bucketRefs, bucketUnresolved, bucketActions, bucketMeta} {
		if _, err := tx.CreateBucketIfNotExists(name); err != nil {
			return err
		}
	}
	meta := tx.Bucket(bucketMeta)
	if string(meta.Get(metaLayout)) == string(layout) {
		return nil
	}
	for _, name := range [][]byte{bucketRefs, bucketUnresolved} {
		if err := tx.DeleteBucket(name); err != nil {
			return err
		}
		if _, err := tx.CreateBucket(name); err != nil {
			return err
		}
	}
	n := 0
	err := tx.Bucket(bucketCalls).ForEach(func(k, raw []byte) error {
		var c Call
		if err := json.Unmarshal(raw, &c); err != nil {
			return fmt.Errorf("call %s: %w", k, err)
		}
		n++
		return index(tx, string(k), &c, c.Events)
	})
	if err != nil {
		return err
	}
	ix.logger.Info("call index rebuilt", "calls", n)
	return meta.Put(metaLayout, layout)
}

// Close closes the file.
func (ix *Index) Close() error { return ix.db.Close() }

// Apply folds evs into the index in one write.
func (ix *Index) Apply(evs []ledger.Event) error {
	return ix.db.Update(func(tx *bolt.Tx) error { return ix.write(tx, evs, nil) })
}

// Write applies the batch's events and keeps its control actions, in one
// transaction: it returns once they are on disk. Writing a batch again
// changes no answer: events are kept once per event id, actions once per
// partition, offset and subject.
func (ix *Index) Write(ctx context.Context, b projections.Batch) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	evs := make([]ledger.Event, len(b.Events))
	for i := range b.Events {
		evs[i] = b.Events[i].Event
	}
	if err := ix.db.Update(func(tx *bolt.Tx) error { return ix.write(tx, evs, b.Actions) }); err != nil {
		return fmt.Errorf("write %d records to the call index: %w", b.Len(), err)
	}
	return nil
}

// write folds evs into their calls, keeps the indexes in step and stores
// actions, within tx.
func (ix *Index) write(tx *bolt.Tx, evs []ledger.Event, actions []projections.Action) error {
	calls := tx.Bucket(bucketCalls)
	type touched struct {
		call      *Call
		anomalies int
		added     []ledger.Event
	}
	cache := make(map[string]*touched)
	for i := range evs {
		e := evs[i]
		k := e.Key().String()
		t, ok := cache[k]
		if !ok {
			t = &touched{call: &Call{}}
			if raw := calls.Get([]byte(k)); raw != nil {
				if err := json.Unmarshal(raw, t.call); err != nil {
					return fmt.Errorf("call %s: %w", k, err)
				}
			}
			t.anomalies = t.call.Anomalies
			cache[k] = t
		}
		if t.call.add(e) && !e.Refusal() {
			t.added = append(t.added, e)
		}
	}
	for k, t := range cache {
		c := t.call
		c.refold()
		if c.Anomalies > t.anomalies {
			ix.logger.Error("events do not fold", "call_key", k, "anomalies", c.Anomalies, "state", c.State, "seq", c.Seq)
		}
		raw, err := json.Marshal(c)
		if err != nil {
			return fmt.Errorf("call %s: %w", k, err)
		}
		if err := calls.Put([]byte(k), raw); err != nil {
			return fmt.Errorf("call %s: %w", k, err)
		}
		if err := index(tx, k, c, t.added); err != nil {
			return err
		}
	}
	acts := tx.Bucket(bucketActions)
	for _, a := range actions {
		raw, err := json.Marshal(a)
		if err != nil {
			return fmt.Errorf("action %s: %w", a.Action.Subject, err)
		}
		if err := acts.Put(actionKey(a), raw); err != nil {
			return fmt.Errorf("action %s: %w", a.Action.Subject, err)
		}
	}
	return nil
}

// CallOf folds a call key's events (refusals among them), in any order,
// into the Call the index would hold after applying them: for a view of a
// call read from elsewhere (the ClickHouse projection's trace).
// ErrNotFound when there are none.
func CallOf(key ledger.CallKey, evs []ledger.Event) (Call, error) {
	if len(evs) == 0 {
		return Call{}, ErrNotFound
	}
	c := Call{Key: key}
	for _, e := range evs {
		c.add(e)
	}
	c.refold()
	return c, nil
}

// Call is Get, for the HTTP API's call views (httpapi.Calls).
func (ix *Index) Call(_ context.Context, key ledger.CallKey) (Call, error) { return ix.Get(key) }

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
