package loadtest

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Tool is one tool of the offered mix.
type Tool struct {
	Name    string
	Version int
	// Weight is the tool's share of the calls, relative to the others'.
	Weight int
	// Args returns call i's arguments.
	Args func(i int64) map[string]any
	// DeadlineMS, when positive, is this tool's envelopes' deadline
	// instead of Config.DeadlineMS.
	DeadlineMS int64
}

// DemoTool returns the demo backend's tool name with arguments that the
// demo policies allow without a human: a weather read, a ticket, a small
// refund, an email within the tenant's own domain. The email is the one
// tool without idempotency downstream (a second request is a second
// effect, which the witness counts), and its policy allows a tenant 60 a
// minute: a mix must keep it under that, or its calls are refused for now
// and sent again. Other demo tools need approval, which a load cannot
// give.
func DemoTool(name string, weight int) (Tool, error) {
	var args func(i int64) map[string]any
	switch name {
	case "get_weather":
		cities := []string{"Sydney", "Berlin", "Lagos", "Lima", "Osaka", "Oslo", "Quito", "Pune"}
		args = func(i int64) map[string]any { return map[string]any{"city": cities[i%int64(len(cities))]} }
	case "create_ticket":
		args = func(i int64) map[string]any {
			return map[string]any{"title": "bench ticket " + strconv.FormatInt(i, 10)}
		}
	case "refund_order":
		args = func(i int64) map[string]any {
			return map[string]any{"order_id": "ord_" + strconv.FormatInt(i, 36), "amount_cents": 100 + i%900, "currency": "AUD"}
		}
	case "send_email":
		args = func(i int64) map[string]any {
			return map[string]any{"to": "agent-" + strconv.FormatInt(i%16, 10) + "@example.com", "subject": "load note " + strconv.FormatInt(i, 10)}
		}
	default:
		return Tool{}, fmt.Errorf("loadtest: no benchmark arguments for tool %q (known: get_weather, create_ticket, refund_order, send_email)", name)
	}
	if weight <= 0 {
		return Tool{}, fmt.Errorf("loadtest: tool %q: weight %d must be positive", name, weight)
	}
	return Tool{Name: name, Version: 1, Weight: weight, Args: args}, nil
}

// ParseMix reads "get_weather=3,create_ticket=1" (a bare name weighs 1)
// into demo tools.
func ParseMix(s string) ([]Tool, error) {
	var tools []Tool
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, w, hasW := strings.Cut(part, "=")
		weight := 1
		if hasW {
			n, err := strconv.Atoi(w)
			if err != nil {
				return nil, fmt.Errorf("loadtest: mix %q: weight of %s: %w", s, name, err)
			}
			weight = n
		}
		t, err := DemoTool(name, weight)
		if err != nil {
			return nil, err
		}
		tools = append(tools, t)
	}
	if len(tools) == 0 {
		return nil, fmt.Errorf("loadtest: mix %q names no tool", s)
	}
	return tools, nil
}

// Minter mints the agents' identity assertions; identity.Issuer is one.
type Minter interface {
	Mint(id identity.Identity, audience string, ttl time.Duration) (string, error)
}

// Config configures a load run.
type Config struct {
	// Client reaches the Kafka cluster the ledger reads. Required.
	Client ledger.ClientConfig
	// Topics are the ledger's topics.
	Topics ledger.Topics
	// Minter mints each tenant's agent assertion, as the agents' identity
	// provider would. Required.
	Minter Minter
	// Audience of the assertions; default identity.DefaultAudience.
	Audience string
	// Tenants share the calls round robin; default 8.
	Tenants int
	// Tools is the mix. Required.
	Tools []Tool
	// Calls to submit; 0 submits for Duration instead. One of the two is
	// required.
	Calls int64
	// Duration of submission when Calls is 0.
	Duration time.Duration
	// Until, if set, extends a submission for Duration: past Duration,
	// calls go on arriving until Until reports true, or until
	// MaxDuration. The reliability suite keeps the load up until every
	// crash point was hit often enough.
	Until func() bool
	// MaxDuration bounds a submission that Until extends; default
	// Duration (no extension).
	MaxDuration time.Duration
	// OnSubmit, if set, sees every envelope record as it is published,
	// with its scheduled (open loop) or actual (closed loop) arrival: a
	// history recorder. A call submitted again (RetryLater) is seen again,
	// with the time it is sent again. It runs on the submitting goroutine,
	// and on the goroutines that submit calls again, so it must be quick
	// and safe for concurrent use.
	OnSubmit func(rec *kgo.Record, at time.Time)
	// RetryLater is how many times a call refused for now is submitted
	// again, as an agent does: a denied event that names a wait
	// (retry_after_ms: a policy set that could not decide in time, a rate
	// limit) does not end the call; its envelope goes out again, same
	// key, once the wait has passed. The refusal after the last resend
	// ends it. Default 3; negative: never, the first refusal ends it.
	RetryLater int
	// Concurrency is the number of calls in flight in a closed loop (each
	// finished call lets the next one in); default 64. Ignored in an open
	// loop.
	Concurrency int
	// Rate, when positive, makes the loop open: calls arrive at Rate per
	// second whatever the ledger does, and latency counts from the
	// scheduled arrival, so a ledger that falls behind is charged for
	// the wait (no coordinated omission).
	Rate float64
	// MaxInFlight stops an open loop that the ledger cannot keep up with
	// (Result.Saturated); default 200,000.
	MaxInFlight int
	// RunID prefixes every idempotency key, so that runs never collide
	// and the witness can pick out this run's effects; default random.
	RunID string
	// DeadlineMS is each envelope's deadline; default 60,000.
	DeadlineMS int64
	// Drain is how long to wait, after the last submission, for the calls
	// still in flight; the rest count as lost. A closed loop in which no
	// call finishes for Drain stops submitting. Default 2 minutes.
	Drain time.Duration
	// Progress, if set, is called every ProgressEvery (default 1s).
	Progress      func(Progress)
	ProgressEvery time.Duration
	// TimelineEvery is the length of the intervals of Result.Timeline;
	// default 1s.
	TimelineEvery time.Duration
	// Usage, if set, returns running totals of what the system under
	// test has spent (see Usage); the timeline records their growth in
	// each interval. It runs on the timeline's goroutine once an
	// interval.
	Usage func() Usage
}

func (c *Config) setDefaults() error {
	if c.Minter == nil || len(c.Tools) == 0 || len(c.Client.Brokers) == 0 {
		return errors.New("loadtest: Client, Minter and Tools are required")
	}
	if c.Calls <= 0 && c.Duration <= 0 {
		return errors.New("loadtest: set Calls or Duration")
	}
	for _, t := range c.Tools {
		if t.Weight <= 0 || t.Args == nil || t.Name == "" {
			return fmt.Errorf("loadtest: tool %q needs a name, a positive weight and arguments", t.Name)
		}
	}
	c.Topics = c.Topics.WithDefaults()
	if c.Audience == "" {
		c.Audience = identity.DefaultAudience
	}
	if c.Tenants <= 0 {
		c.Tenants = 8
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 64
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = 200_000
	}
	if c.RunID == "" {
		c.RunID = "b" + strconv.FormatUint(rand.Uint64()&0xffffffffff, 36)
	}
	for _, ch := range c.RunID {
		// Idempotency keys are printable ASCII; '-' and '/' and ':' are
		// the key's own separators.
		if ch < 0x21 || ch > 0x7e || strings.ContainsRune("-/:", ch) {
			return fmt.Errorf("loadtest: run id %q must be printable ASCII without spaces, '-', '/' or ':'", c.RunID)
		}
	}
	if c.DeadlineMS <= 0 {
		c.DeadlineMS = 60_000
	}
	if c.RetryLater == 0 {
		c.RetryLater = 3
	}
	if c.Drain <= 0 {
		c.Drain = 2 * time.Minute
	}
	if c.ProgressEvery <= 0 {
		c.ProgressEvery = time.Second
	}
	if c.TimelineEvery <= 0 {
		c.TimelineEvery = time.Second
	}
	return nil
}

// Progress is a snapshot of a run, for a progress line.
type Progress struct {
	Elapsed   time.Duration
	Submitted int64
	Done      int64
	InFlight  int
	// Rate is the calls/s finished since the previous snapshot.
	Rate float64
	// P99 of the end-to-end latency so far.
	P99 time.Duration
}

// Result is what a run measured.
type Result struct {
	Mode      string  `json:"mode"` // "closed" or "open"
	Offered   float64 `json:"offered_per_sec,omitempty"`
	Submitted int64   `json:"submitted"`
	// Finished counts calls that reached a terminal state (or
	// outcome_unknown, which waits visibly for the reconciler).
	Finished int64            `json:"finished"`
	ByState  map[string]int64 `json:"by_state"`
	// Lost are calls submitted but not finished when the drain ended.
	Lost int64 `json:"lost"`
	// RetriedLater counts the envelopes submitted again after a refusal
	// for now (Config.RetryLater), RetryReasons them by the refusal's
	// reason (policy_timeout, rate_limited, ...). Their calls' latency
	// counts from the first submission.
	RetriedLater int64            `json:"retried_later,omitempty"`
	RetryReasons map[string]int64 `json:"retry_reasons,omitempty"`
	// Saturated: an open loop stopped early because MaxInFlight calls
	// were waiting.
	Saturated bool          `json:"saturated,omitempty"`
	Elapsed   time.Duration `json:"elapsed_ns"`
	PerSec    float64       `json:"calls_per_sec"`
	// E2E is publish (or scheduled arrival) to the terminal event read
	// committed; Added is E2E minus the tool call's own time as the
	// executor measured it (the terminal event's tool_us: its requests'
	// time, not the executor's waits; latency_ms from an older build).
	E2E   Percentiles `json:"e2e"`
	Added Percentiles `json:"added"`
	// Stages splits the end-to-end latency of the calls that ran
	// (Stages.Calls of them) where it is spent; see Stages.
	Stages Stages `json:"stages"`
	// Timeline is the run in intervals of Config.TimelineEvery, from the
	// first submission to the end of the drain.
	Timeline []Interval `json:"timeline,omitempty"`
	// RunID prefixes the run's idempotency keys.
	RunID string `json:"run_id"`

	e2e, added *Histogram
	stages     [4]*Histogram // intake, claim, call, record
	succeeded  []uint64      // bit i: call i succeeded
}

// Stages splits a call's end-to-end latency into four parts that add up
// to it, from when the benchmark read the call's authorized and terminal
// events and from the times the terminal event carries (its at, and its
// tool_us: the tool's requests). Only the calls the executor ended
// count.
//
// Claim and Record subtract a time the executor's clock took from one
// the benchmark's clock took: with the two on different machines, their
// clocks' offset moves time between Claim and Record (a negative part
// counts as 0). Intake and Call use one clock each. A call the executor ended without reaching the tool
// (expired, say) counts with a Call of 0. A call sent again after a
// refusal for now (Config.RetryLater) counts from its last sending: its
// parts add up to its end-to-end latency less the waits before it.
type Stages struct {
	// Calls is how many calls the percentiles cover.
	Calls int64 `json:"calls"`
	// Intake: publish to the authorized event read committed. The
	// request's wait in its partition, the intake's checks, policy and
	// admission, and the intake's Kafka transaction.
	Intake Percentiles `json:"intake"`
	// Claim: from there to the tool's requests. The executor's fetch,
	// the step it was in, the claim, and its waits before and between
	// the requests: the bulkhead, the credential, retries' backoffs.
	Claim Percentiles `json:"claim"`
	// Call: the tool's requests, as the terminal event's tool_us (an
	// older build's latency_ms: the executor's waits in).
	Call Percentiles `json:"call"`
	// Record: from the terminal event's time to its read committed. The
	// completion, the executor's Kafka transaction, the benchmark's fetch.
	Record Percentiles `json:"record"`
}

// Percentiles summarises a latency histogram.
type Percentiles struct {
	P50  time.Duration `json:"p50_ns"`
	P95  time.Duration `json:"p95_ns"`
	P99  time.Duration `json:"p99_ns"`
	P999 time.Duration `json:"p999_ns"`
	Max  time.Duration `json:"max_ns"`
}

// PercentilesOf summarises h.
func PercentilesOf(h *Histogram) Percentiles {
	return Percentiles{P50: h.Quantile(0.50), P95: h.Quantile(0.95), P99: h.Quantile(0.99), P999: h.Quantile(0.999), Max: h.Max()}
}

// Point is the result as a point of a latency against load plot.
func (r Result) Point() LoadPoint {
	return LoadPoint{Offered: r.Offered, Achieved: r.PerSec, P50: r.E2E.P50, P95: r.E2E.P95, P99: r.E2E.P99, P999: r.E2E.P999}
}

// inflight is a call submitted and not yet finished.
type inflight struct {
	start time.Time
	// authorized is when the call's authorized event was read.
	authorized time.Time
	// retried counts its envelope's resends after refusals for now;
	// sent is when the last of them went out (zero: none did).
	retried int
	sent    time.Time
}

// lastSent is when the call's envelope last went out.
func (c inflight) lastSent() time.Time {
	if c.sent.IsZero() {
		return c.start
	}
	return c.sent
}

// run is the state of one load run.
type run struct {
	cfg Config
	pub *kgo.Client

	tokensMu sync.Mutex  // the submitting goroutine and the resends build envelopes
	tokens   []assertion // per tenant: the agent's assertion

	// resends are the calls waiting to be submitted again, by call
	// (under mu), and resending those whose time came: each leaves the
	// map when its timer fires, so that nothing of a call is kept once
	// it is sent again.
	resends   map[int64]*time.Timer
	resending sync.WaitGroup

	mu       sync.Mutex
	waiting  map[int64]inflight
	res      Result
	open     openInterval  // the timeline's interval in progress
	sem      chan struct{} // closed loop: one token per call in flight
	drained  chan struct{} // closed when nothing waits after the last submission
	lastDone time.Time
	finished bool      // no more submissions
	drainEnd time.Time // when Run stops waiting for calls, once finished

	submitted atomic.Int64
	done      atomic.Int64
	pubErr    atomic.Pointer[error]
	mix       mix
}

// Run offers cfg's load to the ledger behind cfg.Client and measures it.
// It follows the events topic from its current end (read committed), so
// start it against a ledger that is already running.
func Run(ctx context.Context, cfg Config) (Result, error) {
	if err := cfg.setDefaults(); err != nil {
		return Result{}, err
	}
	r := &run{
		cfg:     cfg,
		waiting: make(map[int64]inflight),
		drained: make(chan struct{}),
		res: Result{
			Mode: "closed", ByState: make(map[string]int64), RunID: cfg.RunID,
			e2e: NewHistogram(), added: NewHistogram(),
		},
	}
	for i := range r.res.stages {
		r.res.stages[i] = NewHistogram()
	}
	if cfg.Rate > 0 {
		r.res.Mode, r.res.Offered = "open", cfg.Rate
	} else {
		r.sem = make(chan struct{}, cfg.Concurrency)
	}
	r.mix = newMix(cfg.Tools)
	// An assertion per tenant: agents reuse theirs until it nears its
	// expiry, and so does the benchmark (envelope renews them).
	r.tokens = make([]assertion, cfg.Tenants)
	for t := range cfg.Tenants {
		if err := r.mint(t, time.Now()); err != nil {
			return Result{}, err
		}
	}

	watch, err := r.follow(ctx)
	if err != nil {
		return Result{}, err
	}
	defer watch.Close()
	r.pub, err = ledger.NewClient(cfg.Client, kgo.RecordPartitioner(ledger.Partitioner()), kgo.ProducerLinger(time.Millisecond), kgo.MaxBufferedRecords(1<<20))
	if err != nil {
		return Result{}, err
	}
	defer r.pub.Close()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	watched := make(chan error, 1)
	go func() { watched <- r.watch(ctx, watch) }()
	progressDone, progressStopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(progressStopped)
		r.progress(ctx, progressDone)
	}()

	start := time.Now()
	timelineDone, timeline := make(chan struct{}), make(chan []Interval, 1)
	go func() { timeline <- r.timeline(start, timelineDone) }()
	err = r.submit(ctx, start)
	r.mu.Lock()
	r.finished = true
	r.drainEnd = time.Now().Add(cfg.Drain)
	if len(r.waiting) == 0 {
		close(r.drained)
	}
	r.mu.Unlock()
	watcherDone := false
	if err == nil {
		select {
		case <-r.drained:
		case <-time.After(time.Until(r.drainEnd)):
		case err = <-watched:
			watcherDone = true
			if err == nil {
				err = errors.New("loadtest: events consumer stopped")
			}
		case <-ctx.Done():
			err = ctx.Err()
		}
	}
	// The result is read only once nothing else writes it: the events
	// follower and the progress reporter have returned. The timeline's
	// last interval closes after the follower's last finish, so that
	// the intervals hold every call the result counts.
	cancel()
	close(progressDone)
	<-progressStopped
	if !watcherDone {
		<-watched
	}
	r.stopResends()
	close(timelineDone)
	intervals := <-timeline
	if p := r.pubErr.Load(); p != nil && err == nil {
		err = *p
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	res := r.res
	res.Timeline = intervals
	res.Submitted = r.submitted.Load()
	res.Finished = r.done.Load()
	res.Lost = int64(len(r.waiting))
	end := r.lastDone
	if end.IsZero() {
		end = time.Now()
	}
	res.Elapsed = end.Sub(start)
	if res.Elapsed > 0 {
		res.PerSec = float64(res.Finished) / res.Elapsed.Seconds()
	}
	res.E2E, res.Added = PercentilesOf(res.e2e), PercentilesOf(res.added)
	res.Stages = Stages{
		Calls:  res.stages[0].Count(),
		Intake: PercentilesOf(res.stages[0]), Claim: PercentilesOf(res.stages[1]),
		Call: PercentilesOf(res.stages[2]), Record: PercentilesOf(res.stages[3]),
	}
	return res, err
}

func tenantName(t int) string { return "t_bench" + strconv.Itoa(t) }

// CallKey is the key of call i of run runID with tenants tenants (as
// Config.RunID and Config.Tenants, defaults applied): what a checker needs
// to list every call a run submitted (Result.Submitted of them, from 0).
func CallKey(runID string, tenants int, i int64) ledger.CallKey {
	return ledger.CallKey{TenantID: tenantName(int(i % int64(tenants))), IdempotencyKey: callKey(runID, i)}
}

// callKey is call i's idempotency key, shaped as agents' keys are (a run
// id, then the step): "<8 hex digits>:<run id>-<i>". The leading digits
// scatter the keys as agents' random run ids do; keys that grow in order
// would all land on the last pages of the store's index, which is not
// what a ledger serving many agents sees.
func callKey(runID string, i int64) string {
	h := uint32(i) * 2654435761 // Knuth's multiplicative hash: a bijection on uint32
	return fmt.Sprintf("%08x:%s-%d", h, runID, i)
}

// callIndex returns i from a call key "<tenant>/<callKey>", as the events
// and the tools' Idempotency-Key carry it.
func callIndex(key, runID string) (int64, bool) {
	_, idem, ok := strings.Cut(key, "/")
	if !ok {
		return 0, false
	}
	_, rest, ok := strings.Cut(idem, ":"+runID+"-")
	if !ok {
		return 0, false
	}
	i, err := strconv.ParseInt(rest, 10, 64)
	return i, err == nil && i >= 0
}

// follow returns a read-committed consumer of the events topic from its
// current end, so that the run sees its own calls' events only.
func (r *run) follow(ctx context.Context) (*kgo.Client, error) {
	admin, err := ledger.NewClient(r.cfg.Client)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	ends, err := kadm.NewClient(admin).ListEndOffsets(ctx, r.cfg.Topics.Events)
	if err != nil {
		return nil, fmt.Errorf("loadtest: end offsets of %s: %w", r.cfg.Topics.Events, err)
	}
	if err := ends.Error(); err != nil {
		return nil, fmt.Errorf("loadtest: end offsets of %s: %w", r.cfg.Topics.Events, err)
	}
	parts := make(map[int32]kgo.Offset)
	ends.Each(func(o kadm.ListedOffset) { parts[o.Partition] = kgo.NewOffset().At(o.Offset) })
	if len(parts) == 0 {
		return nil, fmt.Errorf("loadtest: topic %s has no partitions", r.cfg.Topics.Events)
	}
	return ledger.NewClient(r.cfg.Client,
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{r.cfg.Topics.Events: parts}),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.FetchMaxWait(50*time.Millisecond),
	)
}

// finishing reports whether an event type ends a call for the benchmark:
// a terminal state, or outcome_unknown (which waits for the reconciler,
// visibly).
func finishing(t statemachine.EventType) bool {
	switch t {
	case statemachine.EventSucceeded, statemachine.EventFailed, statemachine.EventDenied,
		statemachine.EventExpired, statemachine.EventRejected, statemachine.EventOutcomeUnknown,
		statemachine.EventApprovalPending:
		return true
	}
	return false
}

// watch reads the events topic and finishes the calls whose terminal
// events arrive.
func (r *run) watch(ctx context.Context, cl *kgo.Client) error {
	for ctx.Err() == nil {
		fs := cl.PollFetches(ctx)
		if fs.IsClientClosed() {
			return nil
		}
		var ferr error
		fs.EachError(func(_ string, _ int32, err error) {
			if !errors.Is(err, context.Canceled) && ferr == nil {
				ferr = err
			}
		})
		if ferr != nil {
			return fmt.Errorf("loadtest: fetch events: %w", ferr)
		}
		now := time.Now()
		fs.EachRecord(func(rec *kgo.Record) {
			t := statemachine.EventType(ledger.Header(rec, ledger.HeaderEventType))
			if t != statemachine.EventAuthorized && !finishing(t) {
				return
			}
			i, ok := callIndex(string(rec.Key), r.cfg.RunID)
			if !ok {
				return
			}
			if t == statemachine.EventAuthorized {
				r.authorized(i, now)
				return
			}
			var tail ledger.Event
			if t != statemachine.EventApprovalPending {
				// The ledger's own decoding: its fast path costs the
				// harness, which shares the machine, a fifth of
				// encoding/json's. A denial is read for its wait.
				tail, _ = ledger.DecodeEvent(rec.Value)
			}
			if t == statemachine.EventDenied && tail.RetryAfterMS > 0 && r.retryLater(ctx, i, tail) {
				return
			}
			// The tool's own time: its requests' (tool_us); an older
			// build's events have only the execution's, its waits in.
			tool := time.Duration(tail.ToolUS) * time.Microsecond
			if tail.ToolUS == 0 {
				tool = time.Duration(tail.LatencyMS) * time.Millisecond
			}
			r.finish(i, t, now, tail.At, tool)
		})
	}
	return nil
}

// answerMargin is what a resend's answer is given, beyond twice the last
// answer's time, before the drain ends (retryLater).
const answerMargin = time.Second

// retryLater schedules call i's envelope to go out again once the wait
// its refusal for now names has passed, and reports whether it did (or
// had already): not when the call is no longer waiting (its end was
// read), has used up Config.RetryLater, or names a wait the run would
// not see the end of: the resend's answer must come before the drain
// ends, allowing it twice the time this one took and answerMargin more.
// (While submitting goes on, the drain ends a whole Drain from now at the
// soonest.) A resend the run's end cancelled, or an answer it did not
// wait for, would leave the call lost; its refusal ends it instead. The
// call stays in flight meanwhile.
func (r *run) retryLater(ctx context.Context, i int64, refusal ledger.Event) bool {
	wait := time.Duration(refusal.RetryAfterMS) * time.Millisecond
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.waiting[i]
	if !ok || c.retried >= r.cfg.RetryLater {
		return false
	}
	if _, ok := r.resends[i]; ok {
		return true // a refusal read again: its resend is due already
	}
	now := time.Now()
	end := now.Add(r.cfg.Drain)
	if r.finished {
		end = r.drainEnd
	}
	if now.Add(wait + 2*now.Sub(c.lastSent()) + answerMargin).After(end) {
		return false
	}
	c.retried++
	r.waiting[i] = c
	if r.resends == nil {
		r.resends = make(map[int64]*time.Timer)
	}
	r.resending.Add(1)
	r.resends[i] = time.AfterFunc(wait, func() {
		defer r.resending.Done()
		rec, err := r.envelope(i)
		r.mu.Lock()
		delete(r.resends, i)
		c, ok := r.waiting[i]
		if ctx.Err() != nil || !ok {
			// The run is over (the call counts as lost), or the call
			// ended meanwhile.
			r.mu.Unlock()
			return
		}
		if err != nil {
			r.mu.Unlock()
			err = fmt.Errorf("loadtest: submit again: %w", err)
			r.pubErr.CompareAndSwap(nil, &err)
			return
		}
		// Counted as sent, under the lock the result is read with.
		now := time.Now()
		c.sent = now
		r.waiting[i] = c
		r.res.RetriedLater++
		if r.res.RetryReasons == nil {
			r.res.RetryReasons = make(map[string]int64)
		}
		r.res.RetryReasons[refusal.Reason]++
		r.mu.Unlock()
		r.publish(ctx, rec, now)
	})
	return true
}

// stopResends cancels the resends not yet due and waits for those under
// way, so that nothing publishes once Run returns. The events follower,
// which schedules them, must have returned.
func (r *run) stopResends() {
	r.mu.Lock()
	for i, t := range r.resends {
		if t.Stop() {
			r.resending.Done()
		}
		delete(r.resends, i)
	}
	r.mu.Unlock()
	r.resending.Wait()
}

// publish sends an envelope record, sent at at, and notes a failure for
// Run to return.
func (r *run) publish(ctx context.Context, rec *kgo.Record, at time.Time) {
	if r.cfg.OnSubmit != nil {
		r.cfg.OnSubmit(rec, at)
	}
	r.pub.Produce(ctx, rec, func(_ *kgo.Record, err error) {
		if err != nil && !errors.Is(err, context.Canceled) {
			err = fmt.Errorf("loadtest: publish: %w", err)
			r.pubErr.CompareAndSwap(nil, &err)
		}
	})
}

// authorized notes when call i's authorized event was read.
func (r *run) authorized(i int64, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c, ok := r.waiting[i]; ok && c.authorized.IsZero() {
		c.authorized = now
		r.waiting[i] = c
	}
}

// finish ends call i, whose terminal event of type t was read at now;
// at and tool are the event's time and the executor's attempt, zero if
// it did not run.
func (r *run) finish(i int64, t statemachine.EventType, now, at time.Time, tool time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.waiting[i]
	if !ok {
		return // a re-appended event of a call already finished
	}
	delete(r.waiting, i)
	d := now.Sub(c.start)
	r.res.e2e.Record(d)
	r.res.added.Record(d - tool)
	var parts []time.Duration
	if !c.authorized.IsZero() && !at.IsZero() {
		started := at.Add(-tool)
		// A call sent again: the intake's part from its last sending,
		// not the harness's wait before it.
		parts = []time.Duration{c.authorized.Sub(c.lastSent()), started.Sub(c.authorized), tool, now.Sub(at)}
		for k, part := range parts {
			r.res.stages[k].Record(part)
		}
	}
	r.open.record(d, parts)
	st, _ := statemachine.Target(t)
	r.res.ByState[string(st)]++
	if t == statemachine.EventSucceeded {
		w := int(i / 64)
		if w >= len(r.res.succeeded) {
			r.res.succeeded = append(r.res.succeeded, make([]uint64, w+1-len(r.res.succeeded))...)
		}
		r.res.succeeded[w] |= 1 << (i % 64)
	}
	r.lastDone = now
	r.done.Add(1)
	if r.sem != nil {
		<-r.sem
	}
	if r.finished && len(r.waiting) == 0 {
		close(r.drained)
	}
}

// submit offers the calls: closed loop, as tokens come back; open loop,
// on the arrival schedule.
func (r *run) submit(ctx context.Context, start time.Time) error {
	var stop, hardStop time.Time
	if r.cfg.Calls <= 0 {
		stop = start.Add(r.cfg.Duration)
		hardStop = start.Add(max(r.cfg.Duration, r.cfg.MaxDuration))
	}
	// over: past Duration, and Until does not extend it (or no longer may).
	over := func(at time.Time) bool {
		return !stop.IsZero() && at.After(stop) && (r.cfg.Until == nil || at.After(hardStop) || r.cfg.Until())
	}
	for i := int64(0); ; i++ {
		if r.cfg.Calls > 0 && i >= r.cfg.Calls {
			return nil
		}
		if p := r.pubErr.Load(); p != nil {
			return *p
		}
		at := time.Now()
		if r.sem != nil {
			// A ledger that finishes nothing for Drain has stalled: stop
			// offering calls, and those in flight count as lost.
			stalled := time.NewTimer(r.cfg.Drain)
			select {
			case r.sem <- struct{}{}:
				stalled.Stop()
			case <-stalled.C:
				return nil
			case <-ctx.Done():
				stalled.Stop()
				return ctx.Err()
			}
			at = time.Now()
		} else {
			at = start.Add(time.Duration(float64(i) / r.cfg.Rate * float64(time.Second)))
			if wait := time.Until(at); wait > 0 {
				select {
				case <-time.After(wait):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		if over(at) {
			if r.sem != nil {
				<-r.sem
			}
			return nil
		}
		rec, err := r.envelope(i)
		if err != nil {
			return err
		}
		r.mu.Lock()
		if r.sem == nil && len(r.waiting) >= r.cfg.MaxInFlight {
			r.res.Saturated = true
			r.mu.Unlock()
			return nil
		}
		// Counted under the lock that guards waiting, so that a
		// timeline interval's submissions and calls in flight agree.
		r.waiting[i] = inflight{start: at}
		r.submitted.Add(1)
		r.mu.Unlock()
		r.publish(ctx, rec, at)
	}
}

// assertionTTL is the life of the bench's assertions: the verifier's
// default bound, for the bench's agents must pass it as real ones do.
// An assertion is renewed once half of it has passed, so that every
// envelope carries one with at least half an hour left: an intake that
// falls further behind than that refuses them as expired, as it would a
// real agent's.
const assertionTTL = identity.DefaultMaxLifetime

// assertion is a tenant's agent assertion and when to mint its successor.
// Run mints the first before submitting; then envelope renews and reads
// them, under run.tokensMu.
type assertion struct {
	token string
	renew time.Time
}

// mint mints tenant's assertion at now, valid for assertionTTL.
func (r *run) mint(tenant int, now time.Time) error {
	tok, err := r.cfg.Minter.Mint(identity.Identity{Tenant: tenantName(tenant), User: "u_bench", Agent: "bench-agent"}, r.cfg.Audience, assertionTTL)
	if err != nil {
		return err
	}
	r.tokens[tenant] = assertion{token: tok, renew: now.Add(assertionTTL / 2)}
	return nil
}

// envelope builds call i: its tool by weight, its tenant round robin.
// Built again, it is the same call (key, arguments) with the tenant's
// assertion of the moment.
func (r *run) envelope(i int64) (*kgo.Record, error) {
	tool := r.mix.pick(i)
	tenant := int(i % int64(r.cfg.Tenants))
	r.tokensMu.Lock()
	if now := time.Now(); !now.Before(r.tokens[tenant].renew) {
		if err := r.mint(tenant, now); err != nil {
			r.tokensMu.Unlock()
			return nil, err
		}
	}
	token := r.tokens[tenant].token
	r.tokensMu.Unlock()
	raw, err := json.Marshal(tool.Args(i))
	if err != nil {
		return nil, err
	}
	tree, err := ledger.Decode(raw, ledger.Limits{})
	if err != nil {
		return nil, err
	}
	hash, err := ledger.ArgumentsHash(tenantName(tenant), tool.Name, tool.Version, tree)
	if err != nil {
		return nil, err
	}
	key := callKey(r.cfg.RunID, i)
	env := ledger.Envelope{
		Tool: tool.Name, ToolVersion: tool.Version, CallID: "call_" + key,
		Scope:          ledger.Scope{TenantID: tenantName(tenant), UserID: "u_bench"},
		TraceID:        "tr_" + key,
		DeadlineMS:     cmp.Or(tool.DeadlineMS, r.cfg.DeadlineMS),
		IdempotencyKey: key, ArgumentsHash: hash, Assertion: token,
		Arguments: json.RawMessage(raw),
	}
	v, err := json.Marshal(env)
	if err != nil {
		return nil, err
	}
	return &kgo.Record{Topic: r.cfg.Topics.Requests, Key: []byte(env.Key().String()), Value: v}, nil
}

// progress reports every ProgressEvery until done closes.
func (r *run) progress(ctx context.Context, done <-chan struct{}) {
	if r.cfg.Progress == nil {
		return
	}
	t := time.NewTicker(r.cfg.ProgressEvery)
	defer t.Stop()
	start, last, lastDone := time.Now(), time.Now(), int64(0)
	for {
		select {
		case <-done:
			return
		case <-ctx.Done():
			return
		case now := <-t.C:
			d := r.done.Load()
			r.mu.Lock()
			p := Progress{
				Elapsed: now.Sub(start), Submitted: r.submitted.Load(), Done: d, InFlight: len(r.waiting),
				Rate: float64(d-lastDone) / now.Sub(last).Seconds(), P99: r.res.e2e.Quantile(0.99),
			}
			r.mu.Unlock()
			last, lastDone = now, d
			r.cfg.Progress(p)
		}
	}
}
