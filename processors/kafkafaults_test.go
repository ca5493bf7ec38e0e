package processors_test

// Broker faults under load, one test per class: produce errors, lost
// responses, EndTxn failures, transaction aborts, fencing, group rebalances
// mid-transaction, and a broker restart with its data directory. Each test
// runs writes (create_ticket, refund_order, and notify, which has no
// idempotency and so shows a second effect as a duplicate) through intake
// and executor on PostgreSQL while kfake misbehaves, then checks the far
// side: every call terminal and succeeded, exactly one effect per call at
// the tools, and each call's events in the read_committed log folding into
// a legal sequence. Every fault counts its firings and each test demands a
// minimum, so that none passes without its fault.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// faultPolicies let the test tenants run refunds without approval, so
// that every call of the load is a write that reaches its tool.
const faultPolicies = `@id("faults-writes")
permit (principal, action, resource)
when { principal.tenant == resource.tenant };`

// The load: waves of calls at a steady pace, at least faultMinWaves of
// them and more (up to faultMaxWaves) until every fault fired its target.
const (
	faultWave      = 10
	faultMinWaves  = 15
	faultMaxWaves  = 30
	faultWavePause = 40 * time.Millisecond
)

// healTimeout is how long after the faults healed every call must be
// terminal.
const healTimeout = 30 * time.Second

// Messages of ledger.Loop that show what a fault did to a session.
const (
	msgRestart = "transact session restart"
	msgAborted = "transaction aborted by rebalance, redelivering"
	// msgCoordinatorAborted: aborted with no revocation seen.
	msgCoordinatorAborted = "transaction aborted with no revocation seen (by its coordinator, or for a membership lost meanwhile), redelivering"
	msgCommitted          = "batch committed"
)

// fault is one injected fault: how often it fired, how often it must have
// fired for the test to mean anything, and how to heal the cluster (nil
// when nothing needs healing).
type fault struct {
	name   string
	target int
	fired  func() int
	heal   func()
}

// sampler picks every nth request it is asked about and counts what it
// picked. It is safe to call from kfake's control goroutines and fault
// filters.
type sampler struct {
	every int64
	seen  atomic.Int64
}

func (s *sampler) pick() bool { return s.seen.Add(1)%s.every == 0 }

// injectFault installs a kfake fault that answers every nth matching
// request with err, at most budget times.
func injectFault(c *kfake.Cluster, name string, target, budget int, every int64, f kfake.Fault, when func(kmsg.Request) bool) *fault {
	s := &sampler{every: every}
	f.Count = budget
	f.When = func(r kmsg.Request) bool { return (when == nil || when(r)) && s.pick() }
	h := c.Fault(f)
	return &fault{name: name, target: target, fired: h.Hits, heal: h.Remove}
}

// faultLoad is one test's load and what it saw.
type faultLoad struct {
	t    *testing.T
	h    *harness
	logs *logTally
	envs []envelope
	keys []ledger.CallKey
	sent int
}

// startFaultRun starts a fault harness on brokers (the in-process cluster
// when empty) with an intake and one executor, and warms the load up.
func startFaultRun(t *testing.T, brokers string) (*harness, *faultLoad) {
	t.Helper()
	h := newFaultHarness(t, brokers)
	l := newFaultLoad(t, h)
	h.startIntake("intake-1")
	l.executor("executor-1")
	l.warmUp()
	return h, l
}

// newFaultLoad prepares the load on h: policies that let every call run,
// a log tally, and the envelopes (faultMaxWaves waves' worth, across four
// tenants and three write tools). Start processors after it, so that
// they log to the tally.
func newFaultLoad(t *testing.T, h *harness) *faultLoad {
	t.Helper()
	h.policy.Swap(loadSet(t, "faults", faultPolicies))
	l := &faultLoad{t: t, h: h, logs: newLogTally(h.logger.Handler())}
	h.logger = slog.New(l.logs)
	tenants := []string{"t_a", "t_b", "t_c", "t_d"}
	assertions := make(map[string]string, len(tenants))
	for _, tn := range tenants {
		assertions[tn] = h.ident.Assertion(t, tn, "u_1")
	}
	for i := range faultMaxWaves * faultWave {
		tn := tenants[i%len(tenants)]
		key := fmt.Sprintf("call-%03d", i)
		var e envelope
		switch i % 5 {
		case 0, 1:
			e = h.newEnvelopeSigned(tn, key, "create_ticket", map[string]any{"title": fmt.Sprintf("ticket %d", i)}, assertions[tn])
		case 2, 3:
			e = h.newEnvelopeSigned(tn, key, "refund_order", map[string]any{"order_id": fmt.Sprintf("ord_%d", i), "amount_cents": 100 + i, "currency": "AUD"}, assertions[tn])
		default:
			e = h.newEnvelopeSigned(tn, key, "notify", map[string]any{"to": "ops@example.com", "subject": fmt.Sprintf("note %d", i)}, assertions[tn])
		}
		l.envs = append(l.envs, e)
		l.keys = append(l.keys, e.key())
	}
	return l
}

// newFaultHarness is the harness the fault tests share: PostgreSQL, where
// the executor's claims are what keeps effects single, and a tool
// latency, so that transactions and calls overlap the faults.
//
// brokers names the cluster: "" is the in-process one, which the tests
// need to inject faults, whatever cluster LEDGER_TEST_KAFKA_BROKERS gives
// the other tests.
//
// Two franz-go waits are cut, or a few faults would stall the pipeline
// for longer than the test runs: metadata may be refreshed every 100ms
// rather than every 5s (a produce that failed with a retriable error is
// retried only after fresh metadata), and a fetch waits at most 200ms
// rather than 5s for data (a session that resumes at committed offsets,
// after a restart or a rebalance, sees its records only once the fetch
// in flight returns).
func newFaultHarness(t *testing.T, brokers string) *harness {
	t.Setenv("LEDGER_TEST_KAFKA_BROKERS", brokers)
	h := newHarness(t, storeSQL, 6, func(c *demobackend.Config) { c.Latency = 5 * time.Millisecond })
	h.kafka.Client.Opts = append(h.kafka.Client.Opts, kgo.MetadataMinAge(100*time.Millisecond), kgo.FetchMaxWait(200*time.Millisecond))
	return h
}

// executor starts an executor named owner. A finished call whose events
// missed the log (its transaction aborted after another member skipped it
// as busy) is appended after two seconds rather than ten, to keep the
// tests short. (An authorized call waiting longer than that for a claim
// is appended again too, before its intake's later mark: harmless.)
func (l *faultLoad) executor(owner string) (stop func()) {
	cfg := l.h.executorConfig(owner)
	cfg.UnloggedGrace = 2 * time.Second
	return l.h.startExecutor(cfg)
}

// submitWave publishes the next wave of calls, in one produce.
func (l *faultLoad) submitWave() {
	l.t.Helper()
	recs := make([]*kgo.Record, 0, faultWave)
	for _, e := range l.envs[l.sent : l.sent+faultWave] {
		recs = append(recs, &kgo.Record{Topic: l.h.kafka.Topics.Requests, Key: []byte(e.key().String()), Value: mustJSON(l.t, e)})
	}
	ctx, cancel := context.WithTimeout(l.t.Context(), 30*time.Second)
	defer cancel()
	if err := l.h.pub.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		l.t.Fatalf("publish: %v", err)
	}
	l.sent += faultWave
}

// warmUp submits the first wave and waits until it is done, so that the
// groups have formed and the producers have their ids before any fault.
func (l *faultLoad) warmUp() {
	l.t.Helper()
	l.submitWave()
	l.h.waitTerminal(60*time.Second, l.keys[:l.sent]...)
}

// run submits waves, calling onWave (if set) after each, until at least
// faultMinWaves were sent and every fault reached its target, or
// faultMaxWaves were sent; it then gives trailing faults a few seconds and
// heals them all.
func (l *faultLoad) run(onWave func(wave int), faults ...*fault) {
	l.t.Helper()
	reached := func() bool {
		for _, f := range faults {
			if f.fired() < f.target {
				return false
			}
		}
		return true
	}
	for wave := l.sent / faultWave; wave < faultMaxWaves; wave++ {
		l.submitWave()
		if onWave != nil {
			onWave(wave)
		}
		if wave+1 >= faultMinWaves && reached() {
			break
		}
		time.Sleep(faultWavePause)
	}
	// The processors may still be catching up with the load, and a
	// fault on their requests fire as they do.
	for deadline := time.Now().Add(10 * time.Second); !reached() && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	for _, f := range faults {
		if f.heal != nil {
			f.heal()
		}
	}
}

// check waits for the load to finish and checks the far side; it fails
// the test for any fault that did not fire its target.
func (l *faultLoad) check(faults ...*fault) {
	t, h := l.t, l.h
	t.Helper()
	var fired []string
	for _, f := range faults {
		n := f.fired()
		fired = append(fired, fmt.Sprintf("%s=%d", f.name, n))
		if n < f.target {
			t.Errorf("fault %s fired %d times; want at least %d (the test would prove nothing)", f.name, n, f.target)
		}
	}
	envs, keys := l.envs[:l.sent], l.keys[:l.sent]

	// None lost: every call reaches a terminal state, and soon: a
	// transaction left open blocks its partitions until the broker's
	// transaction timeout (a minute), which is a stall, not a recovery.
	calls, lost := l.waitTerminal(healTimeout, keys)
	for i, k := range lost {
		if i == 5 {
			t.Errorf("... and %d more", len(lost)-5)
			break
		}
		t.Errorf("%s lost: state %q %s after the faults healed", k, calls[k].State, healTimeout)
	}

	// One effect per call, and none twice.
	states := map[statemachine.State]int{}
	for i, e := range envs {
		c, ok := calls[keys[i]]
		if !ok {
			continue
		}
		states[c.State]++
		applied := h.backend.AppliedIn(toolRoute(e.Tool), keys[i].TenantID, keys[i].String())
		if c.State != statemachine.StateSucceeded || applied != 1 {
			t.Errorf("%s (%s) ended %s (%s) with %d effects at the tool; want succeeded with 1 (events %s)", keys[i], e.Tool, c.State, c.Events[len(c.Events)-1].Reason+" "+c.Events[len(c.Events)-1].Detail, applied, eventTypes(c.Events))
		}
	}
	dups := h.backend.Duplicates()
	if len(dups) != 0 {
		t.Errorf("duplicate effects at the tools: %v", dups)
	}
	effects, replays := 0, 0
	for _, ef := range h.backend.Effects() {
		switch {
		case ef.Replay:
			replays++
		case !ef.Read:
			effects++
		}
	}
	if effects != len(envs) {
		t.Errorf("%d effects at the tools for %d calls", effects, len(envs))
	}

	// The committed log: each call's events fold, copies of an event
	// (appended again from an outbox) are the same event, and nothing
	// else is in it.
	copies := l.checkLog(keys)

	t.Logf("%d calls: %v; lost %d, duplicate effects %d, replays at the tools %d; log: %d re-appended events; loops: %d commits, %d aborted, %d session restarts; faults fired: %s",
		len(envs), states, len(lost), len(dups), replays, copies,
		l.logs.count(msgCommitted), l.logs.count(msgAborted)+l.logs.count(msgCoordinatorAborted), l.logs.count(msgRestart), strings.Join(fired, " "))
}

// waitTerminal waits until every key is terminal in the call index or
// timeout passes, and returns the calls and the keys that are not.
func (l *faultLoad) waitTerminal(timeout time.Duration, keys []ledger.CallKey) (map[ledger.CallKey]callindex.Call, []ledger.CallKey) {
	calls := make(map[ledger.CallKey]callindex.Call, len(keys))
	deadline := time.Now().Add(timeout)
	for {
		var open []ledger.CallKey
		for _, k := range keys {
			if c, ok := calls[k]; ok && c.State.Terminal() {
				continue
			}
			c, err := l.h.index.Get(k)
			if err == nil {
				calls[k] = c
				if c.State.Terminal() {
					continue
				}
			}
			open = append(open, k)
		}
		if len(open) == 0 || time.Now().After(deadline) {
			return calls, open
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// checkLog reads the events topic as a read_committed reader sees it and
// checks every call's events: they fold to succeeded, without a gap or an
// illegal step, and two events with the same seq are copies of one event.
// It returns how many copies it found.
func (l *faultLoad) checkLog(keys []ledger.CallKey) int {
	t := l.t
	t.Helper()
	log := committedEvents(t, l.h)
	copies := 0
	for _, k := range keys {
		evs := log[k]
		delete(log, k)
		ids := make(map[int64]string)
		trans := make([]statemachine.Event, 0, len(evs))
		for _, e := range evs {
			if e.Refusal() {
				t.Errorf("%s: refusal in the log: %s %s", k, e.Reason, e.Detail)
				continue
			}
			if id, ok := ids[e.Seq]; ok {
				if id != e.EventID {
					t.Errorf("%s: two different events at seq %d (%s, %s)", k, e.Seq, id, e.EventID)
				}
				copies++
			}
			ids[e.Seq] = e.EventID
			trans = append(trans, e.Transition())
		}
		c, err := statemachine.Fold(trans)
		switch {
		case err != nil:
			t.Errorf("%s: the committed events do not fold: %v (%s)", k, err, eventTypes(evs))
		case c.State != statemachine.StateSucceeded || int(c.Seq) != len(ids):
			t.Errorf("%s: the committed events fold to %s at seq %d of %d (%s); want succeeded", k, c.State, c.Seq, len(ids), eventTypes(evs))
		}
	}
	for k, evs := range log {
		t.Errorf("events for a call nobody submitted: %s: %s", k, eventTypes(evs))
	}
	return copies
}

// committedEvents reads the events topic up to its last stable offsets,
// as read_committed readers see it, and returns each call's events in log
// order.
func committedEvents(t *testing.T, h *harness) map[ledger.CallKey][]ledger.Event {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	topic := h.kafka.Topics.Events
	adm, err := ledger.NewClient(h.kafka.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer adm.Close()
	ends, err := kadm.NewClient(adm).ListCommittedOffsets(ctx, topic)
	if err != nil {
		t.Fatalf("list offsets: %v", err)
	}
	end := make(map[int32]int64)
	from := make(map[int32]kgo.Offset)
	ends.Each(func(o kadm.ListedOffset) {
		if o.Err != nil {
			t.Fatalf("list offsets %s/%d: %v", o.Topic, o.Partition, o.Err)
		}
		if o.Offset > 0 {
			end[o.Partition] = o.Offset
			from[o.Partition] = kgo.NewOffset().AtStart()
		}
	})
	out := make(map[ledger.CallKey][]ledger.Event)
	if len(end) == 0 {
		return out
	}
	// Control records are kept so that the reader sees every offset up
	// to the end, transaction markers included, and knows when it is done.
	cl, err := ledger.NewClient(h.kafka.Client,
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: from}),
		kgo.KeepControlRecords())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	remaining := len(end)
	next := make(map[int32]int64)
	for remaining > 0 {
		// A partition whose last offsets below the snapshot belong to
		// an aborted transaction that another one interleaves never
		// shows its last offset: a quiet poll ends the read, and the
		// fold of every call checks that nothing is missing.
		pollCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
		fetches := cl.PollFetches(pollCtx)
		cancel()
		if ctx.Err() != nil {
			t.Fatalf("reading the log: %v (%d partitions unread)", ctx.Err(), remaining)
		}
		fetches.EachError(func(tp string, p int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("reading %s/%d: %v", tp, p, err)
			}
		})
		if len(fetches.Records()) == 0 {
			break
		}
		for _, r := range fetches.Records() {
			if r.Offset >= end[r.Partition] {
				continue
			}
			if next[r.Partition] < end[r.Partition] && r.Offset+1 >= end[r.Partition] {
				remaining--
			}
			next[r.Partition] = r.Offset + 1
			if r.Attrs.IsControl() {
				continue
			}
			e, err := ledger.DecodeEvent(r.Value)
			if err != nil {
				t.Fatalf("event at %s/%d/%d: %v", topic, r.Partition, r.Offset, err)
			}
			out[e.Key()] = append(out[e.Key()], e)
		}
	}
	return out
}

// logTally counts log messages by text, and by text and group, so that a
// test sees what a fault did to the processors (a session restart, an
// aborted transaction) and not only that it fired. Records go on to the
// next handler.
type logTally struct {
	next   slog.Handler
	mu     *sync.Mutex
	counts map[string]int
}

func newLogTally(next slog.Handler) *logTally {
	return &logTally{next: next, mu: new(sync.Mutex), counts: make(map[string]int)}
}

func (l *logTally) Enabled(context.Context, slog.Level) bool { return true }

func (l *logTally) Handle(ctx context.Context, r slog.Record) error {
	group := ""
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "group" {
			group = a.Value.String()
			return false
		}
		return true
	})
	l.mu.Lock()
	l.counts[r.Message]++
	if group != "" {
		l.counts[r.Message+"\x00"+group]++
	}
	l.mu.Unlock()
	if l.next.Enabled(ctx, r.Level) {
		return l.next.Handle(ctx, r)
	}
	return nil
}

func (l *logTally) WithAttrs(as []slog.Attr) slog.Handler {
	c := *l
	c.next = l.next.WithAttrs(as)
	return &c
}

func (l *logTally) WithGroup(name string) slog.Handler {
	c := *l
	c.next = l.next.WithGroup(name)
	return &c
}

// count returns how often msg was logged.
func (l *logTally) count(msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.counts[msg]
}

// countIn returns how often msg was logged for group.
func (l *logTally) countIn(msg, group string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.counts[msg+"\x00"+group]
}

// relay lets a control function have a request take effect and still
// choose what the client hears: it sends the request to the broker again,
// at the version the client used, on a connection of its own, while the
// control function sleeps (a control function that blocks freezes the
// cluster). While it does, requests of the key pass through untouched,
// the relayed one among them.
type relay struct {
	c    *kfake.Cluster
	addr string
	busy atomic.Bool
}

// passing reports whether the request in hand should go through: one is
// being relayed.
func (r *relay) passing() bool { return r.busy.Load() }

// forward sends req to the broker and returns its answer. Call it only
// from a control function.
func (r *relay) forward(req kmsg.Request) (kmsg.Response, error) {
	r.busy.Store(true)
	defer r.busy.Store(false)
	var (
		resp kmsg.Response
		err  error
	)
	r.c.SleepControl(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp, err = roundTrip(ctx, r.addr, req)
	})
	return resp, err
}

// roundTrip sends one request on a fresh connection and reads its
// response.
func roundTrip(ctx context.Context, addr string, req kmsg.Request) (kmsg.Response, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(dl); err != nil {
			return nil, fmt.Errorf("relay: %w", err)
		}
	}
	const corr = 1
	if _, err := conn.Write(kmsg.NewRequestFormatter(kmsg.FormatterClientID("faults-relay")).AppendRequest(nil, req, corr)); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	var size [4]byte
	if _, err := io.ReadFull(conn, size[:]); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	buf := make([]byte, binary.BigEndian.Uint32(size[:]))
	if _, err := io.ReadFull(conn, buf); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	if len(buf) < 4 || binary.BigEndian.Uint32(buf) != corr {
		return nil, errors.New("relay: bad response header")
	}
	body := buf[4:]
	if req.IsFlexible() {
		// The response header's tagged fields; brokers send none.
		if len(body) == 0 || body[0] != 0 {
			return nil, errors.New("relay: response header with tagged fields")
		}
		body = body[1:]
	}
	resp := req.ResponseKind()
	resp.SetVersion(req.GetVersion())
	if err := resp.ReadFrom(body); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	return resp, nil
}

// errLostResponse closes the client's connection after its request took
// effect.
var errLostResponse = errors.New("response lost on purpose")

// loseResponses lets every nth request of key that match take effect and
// then closes the client's connection instead of answering, at most
// budget times. A request the broker refused is answered as it was, and
// does not count.
func loseResponses(h *harness, name string, target, budget int, every int64, key kmsg.Key, match func(kmsg.Request) bool) *fault {
	c := h.kafka.Cluster
	r := &relay{c: c, addr: h.kafka.Client.Brokers[0]}
	s := &sampler{every: every}
	var fired atomic.Int64
	var healed atomic.Bool
	c.ControlKey(int16(key), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if healed.Load() {
			c.DropControl()
			return nil, nil, false
		}
		if r.passing() || (match != nil && !match(req)) || !s.pick() {
			return nil, nil, false
		}
		if fired.Add(1) > int64(budget) {
			fired.Add(-1)
			c.DropControl()
			return nil, nil, false
		}
		c.KeepControl()
		resp, err := r.forward(req)
		switch {
		case err != nil:
			fired.Add(-1)
			return nil, fmt.Errorf("relay: %w", err), true
		case !tookEffect(resp):
			fired.Add(-1)
			return resp, nil, true
		}
		return nil, errLostResponse, true
	})
	return &fault{name: name, target: target, fired: func() int { return int(fired.Load()) }, heal: func() { healed.Store(true) }}
}

// tookEffect reports whether resp answers a produce, a transactional
// offset commit or an EndTxn that the broker carried out in full.
func tookEffect(resp kmsg.Response) bool {
	switch r := resp.(type) {
	case *kmsg.ProduceResponse:
		for _, t := range r.Topics {
			for _, p := range t.Partitions {
				if p.ErrorCode != 0 {
					return false
				}
			}
		}
	case *kmsg.TxnOffsetCommitResponse:
		for _, t := range r.Topics {
			for _, p := range t.Partitions {
				if p.ErrorCode != 0 {
					return false
				}
			}
		}
	case *kmsg.EndTxnResponse:
		return r.ErrorCode == 0
	default:
		return false
	}
	return true
}

// observe counts the requests of key that match, letting them through.
func observe(c *kfake.Cluster, key kmsg.Key, match func(kmsg.Request) bool) *atomic.Int64 {
	var n atomic.Int64
	c.ControlKey(int16(key), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if match == nil || match(req) {
			n.Add(1)
		}
		return nil, nil, false
	})
	return &n
}

// topicID returns the id of topic, which newer produce requests carry
// in place of its name.
func topicID(t *testing.T, h *harness, topic string) [16]byte {
	t.Helper()
	cl, err := ledger.NewClient(h.kafka.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	td, err := kadm.NewClient(cl).ListTopics(t.Context(), topic)
	if err != nil || td[topic].Err != nil {
		t.Fatalf("describe %s: %v %v", topic, err, td[topic].Err)
	}
	return td[topic].ID
}

// producesTo matches produce requests that write to topic.
func producesTo(name string, id [16]byte) func(kmsg.Request) bool {
	return func(r kmsg.Request) bool {
		for _, tp := range r.(*kmsg.ProduceRequest).Topics {
			if tp.Topic == name || tp.TopicID == id {
				return true
			}
		}
		return false
	}
}

func commits(r kmsg.Request) bool { return r.(*kmsg.EndTxnRequest).Commit }

// 1. Produce requests to the events topic answered with a retriable error
// (the producer retries inside the transaction) and with a non-retriable
// one (the record fails, the loop aborts and restarts its session).
func TestKafkaFaultProduceErrors(t *testing.T) {
	h, l := startFaultRun(t, "")

	c, events := h.kafka.Cluster, h.kafka.Topics.Events
	retriable := injectFault(c, "produce NOT_ENOUGH_REPLICAS", 5, 12, 3,
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: events, Err: kerr.NotEnoughReplicas}, nil)
	leader := injectFault(c, "produce NOT_LEADER_FOR_PARTITION", 3, 6, 5,
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: events, Err: kerr.NotLeaderForPartition}, nil)
	fatal := injectFault(c, "produce INVALID_RECORD", 3, 4, 5,
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: events, Err: kerr.InvalidRecord}, nil)
	l.run(nil, retriable, leader, fatal)
	l.check(retriable, leader, fatal)
	if got := l.logs.count(msgRestart); got < 1 {
		t.Errorf("%d session restarts; want at least one (a failed produce ends the session)", got)
	}
}

// 2. Responses lost after the broker acted: a produce to the events
// topic, a transactional offset commit and an EndTxn each take effect and
// the client's connection is closed instead of an answer; the client
// retries into a broker that already did it. Produce also gets
// REQUEST_TIMED_OUT after the append, the broker's own way of saying "done,
// but I cannot tell you".
func TestKafkaFaultLostResponses(t *testing.T) {
	h, l := startFaultRun(t, "")

	events := h.kafka.Topics.Events
	toEvents := producesTo(events, topicID(t, h, events))
	produce := loseResponses(h, "produce response lost", 3, 5, 2, kmsg.Produce, toEvents)
	offsets := loseResponses(h, "TxnOffsetCommit response lost", 3, 5, 3, kmsg.TxnOffsetCommit, nil)
	endTxn := loseResponses(h, "EndTxn response lost", 3, 5, 3, kmsg.EndTxn, nil)
	timedOut := injectFault(h.kafka.Cluster, "produce REQUEST_TIMED_OUT after append", 3, 5, 5,
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: events, Err: kerr.RequestTimedOut}, nil)
	l.run(nil, produce, offsets, endTxn, timedOut)
	l.check(produce, offsets, endTxn, timedOut)
}

// 3. EndTxn answered with errors: INVALID_TXN_STATE (fatal to the
// transaction: the loop discards its session, and the new one's
// InitProducerID fences what the old one left open), UNKNOWN_SERVER_ERROR
// (the commit is unconfirmed: the client aborts and redelivers) and
// COORDINATOR_NOT_AVAILABLE (retried).
func TestKafkaFaultEndTxnFailures(t *testing.T) {
	h, l := startFaultRun(t, "")

	c := h.kafka.Cluster
	endTxn := []kmsg.Key{kmsg.EndTxn}
	invalid := injectFault(c, "EndTxn INVALID_TXN_STATE", 3, 4, 3,
		kfake.Fault{Keys: endTxn, TopLevel: true, Err: kerr.InvalidTxnState}, commits)
	unknown := injectFault(c, "EndTxn UNKNOWN_SERVER_ERROR", 3, 4, 2,
		kfake.Fault{Keys: endTxn, TopLevel: true, Err: kerr.UnknownServerError}, commits)
	unavailable := injectFault(c, "EndTxn COORDINATOR_NOT_AVAILABLE", 3, 6, 2,
		kfake.Fault{Keys: endTxn, TopLevel: true, Err: kerr.CoordinatorNotAvailable}, nil)
	l.run(nil, invalid, unknown, unavailable)
	l.check(invalid, unknown, unavailable)
	if got := l.logs.count(msgRestart); got < 2 {
		t.Errorf("%d session restarts; want at least 2 (one per INVALID_TXN_STATE)", got)
	}
}

// 4. The coordinator aborts transactions the client asked to commit: it
// answers TRANSACTION_ABORTABLE (the client then aborts), or it aborts
// the transaction itself, really, and says so. Either way the batch's
// records and offsets are gone, and the batch must come again.
func TestKafkaFaultTransactionAborts(t *testing.T) {
	h, l := startFaultRun(t, "")

	c := h.kafka.Cluster
	abortable := injectFault(c, "EndTxn commit answered TRANSACTION_ABORTABLE", 3, 5, 2,
		kfake.Fault{Keys: []kmsg.Key{kmsg.EndTxn}, TopLevel: true, Err: kerr.TransactionAbortable}, commits)

	// A commit turned into an abort at the coordinator.
	r := &relay{c: c, addr: h.kafka.Client.Brokers[0]}
	s := &sampler{every: 3}
	var converted atomic.Int64
	var healed atomic.Bool
	const budget = 5
	c.ControlKey(int16(kmsg.EndTxn), func(req kmsg.Request) (kmsg.Response, error, bool) {
		end := req.(*kmsg.EndTxnRequest)
		if healed.Load() || converted.Load() >= budget {
			c.DropControl()
			return nil, nil, false
		}
		if r.passing() || !end.Commit || !s.pick() {
			return nil, nil, false
		}
		c.KeepControl()
		end.Commit = false
		resp, err := r.forward(end)
		if err != nil {
			return nil, err, true
		}
		aborted := resp.(*kmsg.EndTxnResponse)
		if aborted.ErrorCode == 0 {
			converted.Add(1)
			aborted.ErrorCode = kerr.TransactionAbortable.Code
		}
		return aborted, nil, true
	})
	coordinator := &fault{name: "EndTxn commit aborted by the coordinator", target: 3,
		fired: func() int { return int(converted.Load()) }, heal: func() { healed.Store(true) }}

	l.run(nil, abortable, coordinator)
	l.check(abortable, coordinator)
	// Each aborted commit comes back: redelivered in its session, or
	// after a restart.
	if aborted, fired := l.logs.count(msgAborted)+l.logs.count(msgCoordinatorAborted)+l.logs.count(msgRestart), abortable.fired()+coordinator.fired(); aborted < fired {
		t.Errorf("%d transactions aborted or sessions restarted for %d aborted commits", aborted, fired)
	}
}

// 5. Fencing: a second executor with the same owner, and so the same
// transactional id, starts mid-run, as a replacement does while its
// predecessor still lives; each InitProducerID bumps the epoch and fences
// the other's producer, until the predecessor is stopped. Then the test
// itself re-initialises the intake's and the executor's transactional ids
// a few times, as a restarting twin would, aborting whatever they had
// open.
func TestKafkaFaultFencing(t *testing.T) {
	h := newFaultHarness(t, "")
	l := newFaultLoad(t, h)
	c := h.kafka.Cluster
	intakeTxn := h.kafka.Group("intake") + "-intake-1"
	executorTxn := h.kafka.Group("executor") + "-executor-1"
	inits := func(txn string) *atomic.Int64 {
		return observe(c, kmsg.InitProducerID, func(r kmsg.Request) bool {
			id := r.(*kmsg.InitProducerIDRequest).TransactionalID
			return id != nil && *id == txn
		})
	}
	intakeInits, executorInits := inits(intakeTxn), inits(executorTxn)
	h.startIntake("intake-1")
	original := l.executor("executor-1")
	l.warmUp()
	// Fencings are the InitProducerIDs after the first of each id.
	baseIntake, baseExecutor := intakeInits.Load(), executorInits.Load()

	cl, err := ledger.NewClient(h.kafka.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	bumps := map[string]int{}
	bump := func(txn string) {
		req := kmsg.NewPtrInitProducerIDRequest()
		req.TransactionalID = &txn
		req.TransactionTimeoutMillis = 60_000
		resp, err := req.RequestWith(t.Context(), cl)
		if err == nil {
			err = kerr.ErrorForCode(resp.ErrorCode)
		}
		if err != nil {
			t.Errorf("bump the epoch of %s: %v", txn, err)
			return
		}
		bumps[txn]++
	}

	// What fired: the twin's InitProducerID, which fenced its live
	// predecessor, and the sessions fenced by it (when the predecessor
	// produced before it was stopped, and each time the two fenced each
	// other back) and by the test's bumps. A bump that lands while a
	// processor waits to restart fences nothing: the new session's own
	// InitProducerID outdoes it.
	intakeFenced := func() int { return l.logs.countIn(msgRestart, h.kafka.Group("intake")) }
	executorFenced := func() int { return l.logs.countIn(msgRestart, h.kafka.Group("executor")) }
	faults := []*fault{
		{name: "executor twin started", target: 1, fired: func() int { return int(executorInits.Load()-baseExecutor) - bumps[executorTxn] }},
		{name: "executor session fenced", target: 2, fired: executorFenced},
		{name: "intake session fenced", target: 3, fired: intakeFenced},
	}
	// The twins first; the epochs are bumped once the predecessor is
	// gone (a fenced intake authorizes nothing, and the executors would
	// have nothing to fight over).
	stopped := -1
	l.run(func(wave int) {
		switch {
		case wave == 2:
			l.executor("executor-1") // the twin
		case stopped < 0 && (executorFenced() >= 1 || wave >= 12):
			// The predecessor goes once it noticed, as a zombie
			// does, or after a while.
			original()
			stopped = wave
		case stopped >= 0 && (wave-stopped)%3 == 1:
			if intakeFenced() < 3 {
				bump(intakeTxn)
			}
			if executorFenced() < 2 {
				bump(executorTxn)
			}
		}
	}, faults...)
	l.check(faults...)
	t.Logf("InitProducerID after the warm-up: intake %d (%d of them the test's), executor %d (%d of them the test's)",
		intakeInits.Load()-baseIntake, bumps[intakeTxn], executorInits.Load()-baseExecutor, bumps[executorTxn])
}

// 6. Group rebalances while transactions are open: executors and intakes
// join and leave during the load (three executors, one stopped, another
// started; a second intake, the first stopped). Before each change the
// test holds a member's transactional offset commit, the last step of
// its open transaction before EndTxn, and releases it only once the
// change reached the coordinator: every rebalance begins with a
// transaction open.
func TestKafkaFaultRebalancesMidTransaction(t *testing.T) {
	h := newFaultHarness(t, "")
	l := newFaultLoad(t, h)
	c := h.kafka.Cluster
	joins, leaves := observe(c, kmsg.JoinGroup, nil), observe(c, kmsg.LeaveGroup, nil)
	changes := func() int64 { return joins.Load() + leaves.Load() }
	stopIntake1 := h.startIntake("intake-1")
	stopExecutor1 := l.executor("executor-1")
	l.warmUp()
	base := joins.Load()

	var held atomic.Int64
	// during holds the next commit of the transactional id of member in
	// group, then makes change while it is held.
	during := func(group, member string, change func()) {
		if hold := holdCommit(c, h.kafka.Group(group)+"-"+member, changes); hold.wait(5 * time.Second) {
			held.Add(1)
		} else {
			t.Logf("%s committed nothing for 5s; changing the group without holding it", member)
		}
		change()
	}
	var stopExecutor2 func()
	l.run(func(wave int) {
		switch wave {
		case 2:
			during("executor", "executor-1", func() { stopExecutor2 = l.executor("executor-2") })
		case 4:
			during("executor", "executor-2", func() { l.executor("executor-3") })
		case 6:
			during("executor", "executor-2", stopExecutor1)
		case 8:
			during("intake", "intake-1", func() { h.startIntake("intake-2") })
		case 10:
			during("executor", "executor-3", func() { l.executor("executor-4") })
		case 12:
			during("intake", "intake-2", stopIntake1)
		case 13:
			during("executor", "executor-3", stopExecutor2)
		}
	})
	l.check(
		&fault{name: "membership change with a transaction open", target: 5, fired: func() int { return int(held.Load()) }},
		&fault{name: "JoinGroup", target: 8, fired: func() int { return int(joins.Load() - base) }},
	)
}

// heldCommit is a transactional offset commit held by holdCommit.
type heldCommit struct {
	held   chan struct{} // closed once a commit is held
	gaveUp atomic.Bool
}

// wait reports whether a commit was held within timeout. If none was, the
// hold is dropped.
func (hc *heldCommit) wait(timeout time.Duration) bool {
	select {
	case <-hc.held:
		return true
	case <-time.After(timeout):
		hc.gaveUp.Store(true)
		return false
	}
}

// holdCommit holds the next transactional offset commit of txn (its
// transaction is open: records produced, EndTxn to come) until changes
// (a count of JoinGroup and LeaveGroup requests) moves, that is until a
// rebalance began, or five seconds passed.
func holdCommit(c *kfake.Cluster, txn string, changes func() int64) *heldCommit {
	hc := &heldCommit{held: make(chan struct{})}
	c.ControlKey(int16(kmsg.TxnOffsetCommit), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if hc.gaveUp.Load() {
			c.DropControl()
			return nil, nil, false
		}
		if req.(*kmsg.TxnOffsetCommitRequest).TransactionalID != txn {
			return nil, nil, false
		}
		c.DropControl()
		before := changes()
		c.SleepControl(func() {
			close(hc.held)
			for deadline := time.Now().Add(5 * time.Second); changes() == before && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond)
			}
		})
		return nil, nil, false
	})
	return hc
}

// 7. The broker stops mid-run and a new one starts on the same port with
// the same data directory, twice; the processors reconnect and finish,
// with what was committed before the restarts kept. The harness reaches
// this test's own cluster as it reaches an external one, by its address
// (LEDGER_TEST_KAFKA_BROKERS), since only this test needs to restart one.
func TestKafkaFaultBrokerRestartWithDataDir(t *testing.T) {
	opts := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.GroupMinSessionTimeout(500 * time.Millisecond),
		kfake.DataDir(t.TempDir()),
	}
	cluster, err := kfake.NewCluster(opts...)
	if err != nil {
		t.Fatal(err)
	}
	// Registered before the harness, so it runs after the processors
	// stopped; it closes whichever cluster is current.
	t.Cleanup(func() { cluster.Close() })
	addr := cluster.ListenAddrs()[0]
	_, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		t.Fatal(err)
	}
	_, l := startFaultRun(t, addr)

	restarts := 0
	restart := func() {
		cluster.Close()
		time.Sleep(time.Second)
		c, err := kfake.NewCluster(append(opts, kfake.Ports(port))...)
		if err != nil {
			t.Fatalf("restart the broker: %v", err)
		}
		cluster = c
		restarts++
	}
	l.run(func(wave int) {
		if wave == 5 || wave == 11 {
			restart()
		}
	}, &fault{name: "broker restart", target: 2, fired: func() int { return restarts }})
	l.check(&fault{name: "broker restart", target: 2, fired: func() int { return restarts }})
}
