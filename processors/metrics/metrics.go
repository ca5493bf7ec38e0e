// Package metrics is the Prometheus side of a ledger process: one
// registry per process (no global state), the counters and histograms the
// processors report to through their own small interfaces, and the gauges
// read at scrape time from the executor's breakers and bulkheads, the
// reconciler's unknown outcomes and the consumer groups' lag.
//
// Every series is named ledger_*; deploy/README.md ("Observability")
// lists them.
package metrics

import (
	"context"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/expfmt"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
)

// stageBuckets span a local claim (sub-millisecond) to a tool at its
// timeout (tens of seconds).
var stageBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}

// Registry holds one process's metrics. Its methods are safe for
// concurrent use; the zero value is not usable: call New.
type Registry struct {
	// reg holds the role's series, runtime the Go runtime's and the
	// process's: apart, so that roles sharing a process (Serve) serve the
	// latter once.
	reg     *prometheus.Registry
	runtime *prometheus.Registry
	role    string

	events       *eventCounters
	consumed     prometheus.Counter
	transactions *prometheus.CounterVec
	stages       *prometheus.HistogramVec
	claims       *prometheus.CounterVec
	toolCalls    *prometheus.HistogramVec
	storeRetries *prometheus.CounterVec
	unreadable   prometheus.Counter
	undecodable  prometheus.Counter
	undos        *prometheus.CounterVec
	deleted      *prometheus.CounterVec
	skipped      *prometheus.CounterVec
	fetchErrors  *prometheus.CounterVec
	dlq          *prometheus.CounterVec
	breakerMoves *prometheus.CounterVec
	// The approval queue's, registered by ApprovalQueue.
	approvalDecisions *prometheus.CounterVec
	approvalAnswers   *prometheus.CounterVec
	unpublished       prometheus.Counter
}

// New returns the registry of a process running role ("intake",
// "executor", "reconciler", ...), with the Go runtime's and the process's
// own collectors (CPU, RSS, GC, goroutines) registered. known reports
// whether a tool is in the process's tool registry (schemas.Registry.Has):
// events of other tools are counted under UnregisteredTool. Nil knows no
// tool.
func New(role string, known func(tool string) bool) *Registry {
	r := &Registry{reg: prometheus.NewRegistry(), runtime: runtimeRegistry(), role: role}
	constRole := prometheus.Labels{"role": role}
	r.events = newEventCounters(prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_events_total", ConstLabels: constRole,
		Help: "Events this process appended to the log in committed transactions, by event type (the intake's decisions, the executor's outcomes) and tool (" + UnregisteredTool + " for a tool the registry does not hold, as in the refusal of an envelope naming one).",
	}, []string{"type", "tool"}), known)
	r.consumed = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ledger_records_consumed_total", ConstLabels: constRole,
		Help: "Records consumed in committed transactions.",
	})
	r.transactions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_transactions_total", ConstLabels: constRole,
		Help: "Consume-process-produce transactions, by result: committed, rebalanced (aborted by a group rebalance, redelivered), aborted (aborted with no revocation seen: by the coordinator, or for a membership lost meanwhile; redelivered), step_failed (redelivered), stopped (the process ends), failed (the session restarts).",
	}, []string{"result"})
	r.stages = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "ledger_stage_duration_seconds", ConstLabels: constRole, Buckets: stageBuckets,
		Help: "Time spent per stage: step (processing a polled batch), transaction (produce and EndTxn), claim, complete (writing outcomes to the store).",
	}, []string{"stage"})
	r.claims = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_claims_total", ConstLabels: constRole,
		Help: "Claims on calls by result: claimed, reclaimed (an expired lease taken over), busy (a claim conflict: another executor holds the lease), finished, mismatch, missing, not_ready; released (a claim given back with nothing sent the tool may have applied: the policies unable to decide an approved call's re-check, the resource's version unreadable, the tool's breaker open); held (one the store failed to take back, held by the executor and asked again).",
	}, []string{"result"})
	r.toolCalls = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "ledger_tool_call_duration_seconds", ConstLabels: constRole, Buckets: stageBuckets,
		Help: "Requests to tools, from the bulkhead slot taken to the response, by tool and result (ok, refused, error, not_sent, breaker_open).",
	}, []string{"tool", "result"})
	r.storeRetries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_store_retries_total", ConstLabels: constRole,
		Help: "Execution store transactions run again after a serialization failure or a deadlock, by operation (admit, claim, complete, mark logged, ...). Each throws a whole batch's work away.",
	}, []string{"op"})
	r.unreadable = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ledger_outboxes_unreadable_total", ConstLabels: constRole,
		Help: "Execution records whose events this build could not read from their outbox (written by a newer build, or damaged), so did not append: counted each time a sweep or a claim meets one. Their events are not in the log; each is logged with its call key.",
	})
	r.undecodable = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ledger_events_undecodable_total", ConstLabels: constRole,
		Help: "Events of the log that a role acts on which did not decode (damaged: one of a newer encoding stops the role instead), so were passed over. An executor's (authorized, approved): their calls stay authorized and unrun. A reconciler's (outcome_unknown, succeeded): its sweep settles an unknown outcome all the same, but a compensation's success is lost. Counted each time a step meets one; each is logged at Error with its partition and offset.",
	})
	r.undos = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_compensation_requests_total", ConstLabels: constRole,
		Help: "The reconciler's requests for automatic compensations (undo_unknown), by result: requested, failed (asked again later), held (its tool frozen: asked again later, not counted), refused (for good) and abandoned (failed its last attempt); the last two leave the call to a human.",
	}, []string{"result"})
	r.deleted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_records_deleted_unread_total", ConstLabels: constRole,
		Help: "Records the log deleted (retention, DeleteRecords) before this process's loop read them, by topic: requests no one decided, events no one acted on. Each gap is logged at Error; a human must look.",
	}, []string{"topic"})
	r.skipped = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_batches_skipped_total", ConstLabels: constRole,
		Help: "Fetched batches skipped unread because they decompress to more than --max-batch-bytes, by topic: each is logged at Error with its offsets (the intake also writes a DLQ record, batch_too_large); its records are still in the log.",
	}, []string{"topic"})
	r.fetchErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_fetch_errors_total", ConstLabels: constRole,
		Help: "Fetches of a partition that failed with an error the Kafka client gave the loop, by topic: each is logged at Warn with its partition. One that keeps rising is a partition the loop cannot read past (a batch the client cannot decode, which it fetches again and again); /readyz fails once that has lasted three ticks and 5 s.",
	}, []string{"topic"})
	r.dlq = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_dlq_records_total", ConstLabels: constRole,
		Help: "Records this process appended to the DLQ (committed), by reason: requests that could not be read as an envelope, and batches skipped for their size.",
	}, []string{"reason"})
	r.breakerMoves = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_breaker_transitions_total", ConstLabels: constRole,
		Help: "Circuit breakers' changes of state, by tool and the state changed to (open, half-open, closed), summed over the tenants' breakers of the tool: a count of open going up faster than every breaker window is a tool that keeps failing its probes; each change is logged at Warn with its tenant.",
	}, []string{"tool", "to"})
	r.approvalDecisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_approval_decisions_total", ConstLabels: constRole,
		Help: "Decisions the approval queue took (each applied once, whatever the instances), by decision: approved, rejected, expired (by the timer).",
	}, []string{"decision"})
	r.approvalAnswers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ledger_approval_requests_total", ConstLabels: constRole,
		Help: "Answers of the approval queue's HTTP API, by action (list, get, approve, reject) and HTTP status: 401 an assertion refused, 409 a decision refused (its code, in the answer, says why), 503 to be asked again.",
	}, []string{"action", "code"})
	r.unpublished = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ledger_approval_events_unpublished_total", ConstLabels: constRole,
		Help: "Decisions the approval queue took whose events it failed to publish: the executors' unlogged sweep appends them, 10 s or more later, which an approval's window may not outlast.",
	})
	r.reg.MustRegister(r.events.vec, r.consumed, r.transactions, r.stages, r.claims, r.toolCalls, r.storeRetries, r.unreadable, r.undecodable, r.undos, r.deleted, r.skipped, r.fetchErrors, r.dlq, r.breakerMoves)
	return r
}

// runtimeRegistry holds the Go runtime's series and the process's
// (go_*, process_*).
func runtimeRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// StoreRetried counts one execution store transaction run again
// (pgstore.Config.Retried).
func (r *Registry) StoreRetried(op string) { r.storeRetries.WithLabelValues(op).Inc() }

// CompensationRequest counts one of the reconciler's requests for an
// automatic compensation, by result (executor.ReconcilerMetrics).
func (r *Registry) CompensationRequest(result string) { r.undos.WithLabelValues(result).Inc() }

// Handler serves the registry in the Prometheus text format.
func (r *Registry) Handler() http.Handler {
	return promhttp.HandlerFor(r.Gatherer(), promhttp.HandlerOpts{Registry: r.reg})
}

// Gatherer is the registry, runtime series included, for tests and for
// serving elsewhere.
func (r *Registry) Gatherer() prometheus.Gatherer { return prometheus.Gatherers{r.reg, r.runtime} }

// Serve serves, in the Prometheus text format, the series own writes in
// that format (nil: none), then those of regs, then the Go runtime's and
// the process's once: for a process whose metrics are its own (the
// projector's), or whose roles share it (ledger dev), each role's series
// carrying its role label as in a process of its own. A family the
// registries share (ledger_events_total of the intake and the executor)
// is served once, with the series of each.
func Serve(own http.Handler, regs ...*Registry) http.Handler {
	gs := make(prometheus.Gatherers, 0, len(regs)+1)
	for _, r := range regs {
		gs = append(gs, r.reg)
	}
	if len(regs) > 0 {
		gs = append(gs, regs[0].runtime)
	} else {
		gs = append(gs, runtimeRegistry())
	}
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		fams, err := gs.Gather()
		if err != nil {
			// A collector that breaks the format's rules: fail the
			// scrape, as promhttp does, rather than serve a part.
			http.Error(w, "gathering metrics: "+err.Error(), http.StatusInternalServerError)
			return
		}
		format := expfmt.NewFormat(expfmt.TypeTextPlain)
		w.Header().Set("Content-Type", string(format))
		if own != nil {
			own.ServeHTTP(w, req)
		}
		enc := expfmt.NewEncoder(w, format)
		for _, f := range fams {
			if enc.Encode(f) != nil {
				return
			}
		}
	})
}

// Committed counts a committed transaction: the records it consumed and
// the events it appended. It implements ledger.LoopMetrics.
func (r *Registry) Committed(consumed int, produced []*kgo.Record, step, txn time.Duration) {
	r.transactions.WithLabelValues("committed").Inc()
	r.consumed.Add(float64(consumed))
	r.stages.WithLabelValues("step").Observe(step.Seconds())
	r.stages.WithLabelValues("transaction").Observe(txn.Seconds())
	for _, rec := range produced {
		typ := ledger.Header(rec, ledger.HeaderEventType)
		if typ == nil {
			if reason := ledger.Header(rec, ledger.HeaderDLQReason); reason != nil {
				// The reasons are the ledger's own codes, a handful.
				r.dlq.WithLabelValues(string(reason)).Inc()
			}
			continue
		}
		r.events.counter(typ, ledger.Header(rec, ledger.HeaderTool)).Inc()
	}
}

// UnregisteredTool is the tool label of the events of a tool that the
// process's registry does not hold.
const UnregisteredTool = "(unregistered)"

// eventCounters are ledger_events_total's counters, by event type and
// tool, found from the records' header bytes without a string or a label
// slice made per event.
//
// The tool label is bounded by the registry: a refusal names the tool its
// envelope named, and an envelope is refused before, or because, its tool
// is looked up (a bad assertion, an unknown tool). Labelled as sent, any
// sender, even one with no valid assertion, could add a series per name
// it makes up, to every intake's memory and to Prometheus.
type eventCounters struct {
	vec   *prometheus.CounterVec
	known func(tool string) bool

	mu sync.Mutex
	// byType holds, per event type, the counters of the registered
	// tools met so far and of UnregisteredTool; event types are the
	// ledger's own, a handful.
	byType map[string]map[string]prometheus.Counter
}

func newEventCounters(vec *prometheus.CounterVec, known func(string) bool) *eventCounters {
	if known == nil {
		known = func(string) bool { return false }
	}
	return &eventCounters{vec: vec, known: known, byType: make(map[string]map[string]prometheus.Counter)}
}

// counter returns the counter of events of type typ and tool tool.
func (c *eventCounters) counter(typ, tool []byte) prometheus.Counter {
	c.mu.Lock()
	defer c.mu.Unlock()
	// m[string(b)] looks up without allocating; only a miss makes
	// strings.
	tools := c.byType[string(typ)]
	if ctr, ok := tools[string(tool)]; ok {
		return ctr
	}
	if tools == nil {
		tools = make(map[string]prometheus.Counter)
		c.byType[string(typ)] = tools
	}
	label := string(tool)
	if label != "" && !c.known(label) {
		// Not cached under its own name, which would grow the map by
		// the names made up: found again through known each time.
		if ctr, ok := tools[UnregisteredTool]; ok {
			return ctr
		}
		label = UnregisteredTool
	}
	ctr := c.vec.WithLabelValues(string(typ), label)
	tools[label] = ctr
	return ctr
}

// NotCommitted counts a transaction that did not commit, by why
// ("rebalanced", "aborted", "step_failed", "stopped", "failed"). It implements
// ledger.LoopMetrics.
func (r *Registry) NotCommitted(result string) {
	r.transactions.WithLabelValues(result).Inc()
}

// RecordsDeleted counts n records of topic deleted before the loop read
// them. It implements ledger.LoopMetrics.
func (r *Registry) RecordsDeleted(topic string, n int64) {
	r.deleted.WithLabelValues(topic).Add(float64(n))
}

// BatchSkipped counts a batch of topic skipped unread for its size. It
// implements ledger.LoopMetrics.
func (r *Registry) BatchSkipped(topic string) {
	r.skipped.WithLabelValues(topic).Inc()
}

// FetchFailed counts a failed fetch of a partition of topic. It
// implements ledger.LoopMetrics.
func (r *Registry) FetchFailed(topic string) {
	r.fetchErrors.WithLabelValues(topic).Inc()
}

// Stage observes how long a stage took.
func (r *Registry) Stage(stage string, d time.Duration) {
	r.stages.WithLabelValues(stage).Observe(d.Seconds())
}

// Claims counts n claims that ended in result.
func (r *Registry) Claims(result string, n int) {
	r.claims.WithLabelValues(result).Add(float64(n))
}

// ToolCall observes one request to a tool.
func (r *Registry) ToolCall(tool, result string, d time.Duration) {
	r.toolCalls.WithLabelValues(tool, result).Observe(d.Seconds())
}

// UnreadableOutboxes counts n records whose outboxes could not be read.
func (r *Registry) UnreadableOutboxes(n int) { r.unreadable.Add(float64(n)) }

// UndecodableEvents counts n events that a role would act on (that may
// authorize a call, for an executor; settle one or end its compensation,
// for a reconciler), passed over unread.
func (r *Registry) UndecodableEvents(n int) { r.undecodable.Add(float64(n)) }

// BreakerChanged counts one circuit breaker of tool changing its state
// to to ("open", "half-open", "closed").
func (r *Registry) BreakerChanged(tool, to string) { r.breakerMoves.WithLabelValues(tool, to).Inc() }

// Breakers reports the circuit breakers' states at each scrape:
// ledger_breaker_state{tool,tenant} is 0 closed, 1 half-open, 2 open.
// states returns them keyed "tool/tenant" (executor.BreakerStates).
func (r *Registry) Breakers(states func() map[string]string) {
	desc := prometheus.NewDesc("ledger_breaker_state", "Circuit breaker state per tool and tenant: 0 closed, 1 half-open, 2 open.", []string{"tool", "tenant"}, prometheus.Labels{"role": r.role})
	r.reg.MustRegister(newCollector(func(ch chan<- prometheus.Metric) {
		for key, state := range states() {
			tool, tenant := splitKey(key)
			ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, breakerValue(state), tool, tenant)
		}
	}, desc))
}

func splitKey(key string) (tool, tenant string) {
	for i := len(key) - 1; i >= 0; i-- {
		if key[i] == '/' {
			return key[:i], key[i+1:]
		}
	}
	return key, ""
}

func breakerValue(state string) float64 {
	switch state {
	case "half-open":
		return 1
	case "open":
		return 2
	}
	return 0
}

// Bulkhead is one tool's bulkhead at a scrape: slots in use and in all.
type Bulkhead struct {
	InUse, Size int
}

// BulkheadsOf converts an executor's bulkhead states (any struct of the
// same two fields, such as executor.BulkheadState) for Bulkheads, so
// that this package need not import the executor.
func BulkheadsOf[B ~struct{ InUse, Size int }](states map[string]B) map[string]Bulkhead {
	out := make(map[string]Bulkhead, len(states))
	for tool, b := range states {
		out[tool] = Bulkhead(b)
	}
	return out
}

// Bulkheads reports, at each scrape, each tool's bulkhead
// (ledger_bulkhead_in_use and ledger_bulkhead_size by tool) and the
// calls in flight against their bound (ledger_calls_in_flight,
// ledger_calls_in_flight_max): saturation is the one over the other.
func (r *Registry) Bulkheads(tools func() map[string]Bulkhead, inFlight func() (n, max int)) {
	labels := prometheus.Labels{"role": r.role}
	inUse := prometheus.NewDesc("ledger_bulkhead_in_use", "Slots of a tool's bulkhead held by requests in flight.", []string{"tool"}, labels)
	size := prometheus.NewDesc("ledger_bulkhead_size", "Slots of a tool's bulkhead (the tool's max_concurrency).", []string{"tool"}, labels)
	flying := prometheus.NewDesc("ledger_calls_in_flight", "Calls claimed and running (or waiting for a bulkhead slot) in this process.", nil, labels)
	bound := prometheus.NewDesc("ledger_calls_in_flight_max", "The bound on calls in flight (--max-in-flight): at it, the executor stops claiming.", nil, labels)
	r.reg.MustRegister(newCollector(func(ch chan<- prometheus.Metric) {
		for tool, b := range tools() {
			ch <- prometheus.MustNewConstMetric(inUse, prometheus.GaugeValue, float64(b.InUse), tool)
			ch <- prometheus.MustNewConstMetric(size, prometheus.GaugeValue, float64(b.Size), tool)
		}
		n, m := inFlight()
		ch <- prometheus.MustNewConstMetric(flying, prometheus.GaugeValue, float64(n))
		ch <- prometheus.MustNewConstMetric(bound, prometheus.GaugeValue, float64(m))
	}, inUse, size, flying, bound))
}

// ApprovalQueue registers the approval queue's series: the decisions
// and answers counted (approvals.Metrics), and, at each scrape, the
// pending approvals as its timer last saw them (pending,
// approvals.Service.Pending): how many (ledger_approvals_pending) and
// how long ago the oldest's call was requested
// (ledger_approvals_pending_oldest_age_seconds, 0 when none).
func (r *Registry) ApprovalQueue(pending func() (n int, oldest time.Time)) {
	r.reg.MustRegister(r.approvalDecisions, r.approvalAnswers, r.unpublished)
	r.oldest(pending, "ledger_approvals_pending", "Approvals pending at the end of the approval timer's last whole pass over them.",
		"ledger_approvals_pending_oldest_age_seconds", "How long ago the call of the oldest pending approval was requested; 0 when none.")
}

// ApprovalDecided counts one decision of the approval queue
// (approvals.Metrics).
func (r *Registry) ApprovalDecided(decision string) {
	r.approvalDecisions.WithLabelValues(decision).Inc()
}

// ApprovalAnswered counts one answer of the approval queue's HTTP API
// (approvals.Metrics).
func (r *Registry) ApprovalAnswered(action string, status int) {
	r.approvalAnswers.WithLabelValues(action, strconv.Itoa(status)).Inc()
}

// ApprovalsUnpublished counts decisions whose events the approval queue
// left to the unlogged sweep (approvals.Metrics).
func (r *Registry) ApprovalsUnpublished(n int) { r.unpublished.Add(float64(n)) }

// Unknown reports, at each scrape, the calls whose outcome is unknown as
// the reconciler last saw them: how many (ledger_outcome_unknown_calls,
// up to the sweep's limit) and the age of the oldest
// (ledger_outcome_unknown_oldest_age_seconds, 0 when none).
func (r *Registry) Unknown(seen func() (n int, oldest time.Time)) {
	r.sweepOldest(seen, "ledger_outcome_unknown", "in outcome_unknown", "has been so")
}

// Parked reports, at each scrape, the parked calls as the reconciler last
// saw them, each waiting for a human or for the compensation a policy
// asked for: how many (ledger_parked_calls, up to the sweep's limit) and
// how long the oldest has been parked (ledger_parked_oldest_age_seconds,
// 0 when none).
func (r *Registry) Parked(seen func() (n int, oldest time.Time)) {
	r.sweepOldest(seen, "ledger_parked", "parked", "has been parked")
}

// sweepOldest reports the calls of a status that the reconciler's sweep
// counts (seen), as <prefix>_calls and <prefix>_oldest_age_seconds.
func (r *Registry) sweepOldest(seen func() (n int, oldest time.Time), prefix, in, since string) {
	r.oldest(seen, prefix+"_calls", "Calls "+in+" at the reconciler's last sweep (at most its sweep limit).",
		prefix+"_oldest_age_seconds", "How long the oldest call "+in+" "+since+"; 0 when none.")
}

// oldest reports, at each scrape, how many seen counts (the gauge named
// count) and the age of the oldest (the gauge named age, 0 when none).
func (r *Registry) oldest(seen func() (n int, oldest time.Time), count, countHelp, age, ageHelp string) {
	labels := prometheus.Labels{"role": r.role}
	countDesc := prometheus.NewDesc(count, countHelp, nil, labels)
	ageDesc := prometheus.NewDesc(age, ageHelp, nil, labels)
	r.reg.MustRegister(newCollector(func(ch chan<- prometheus.Metric) {
		n, oldest := seen()
		a := 0.0
		if n > 0 && !oldest.IsZero() {
			a = time.Since(oldest).Seconds()
		}
		ch <- prometheus.MustNewConstMetric(countDesc, prometheus.GaugeValue, float64(n))
		ch <- prometheus.MustNewConstMetric(ageDesc, prometheus.GaugeValue, a)
	}, countDesc, ageDesc))
}

// ControlStaleness reports, at each scrape, how long ago the process's
// copy of the control topic (freezes, revocations, policy activations)
// was last known to hold every action on it
// (ledger_control_staleness_seconds; -1 before it first caught up). It
// stays under a second while the copy is followed; an executor past its
// --control-max-staleness sends nothing.
func (r *Registry) ControlStaleness(staleness func() time.Duration) {
	desc := prometheus.NewDesc("ledger_control_staleness_seconds", "How long ago this process's copy of the control topic was last known to be current; -1 before it first caught up.", nil, prometheus.Labels{"role": r.role})
	r.reg.MustRegister(newCollector(func(ch chan<- prometheus.Metric) {
		st := staleness()
		v := st.Seconds()
		if st < 0 {
			v = -1
		}
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, v)
	}, desc))
}

// Policy reports, at each scrape, the policy version the process decides
// with (ledger_policy_active{version} 1), or version "" and 0 while it
// denies every call, such as while a version activated on the control
// topic does not load: the instances of a fleet that are not on the
// activated version show.
func (r *Registry) Policy(version func() string) {
	desc := prometheus.NewDesc("ledger_policy_active", "1 with the policy version this process decides with; 0 with version \"\" while it has none in force and denies every call (an activated version that does not load, or is not the content its activation pins).", []string{"version"}, prometheus.Labels{"role": r.role})
	r.reg.MustRegister(newCollector(func(ch chan<- prometheus.Metric) {
		v, up := version(), 1.0
		if v == "" {
			up = 0
		}
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, up, v)
	}, desc))
}

// lagTimeout bounds the broker round trips of one scrape's lag.
const lagTimeout = 3 * time.Second

// ConsumerLag reports, at each scrape, the consumer group's lag per
// partition (ledger_consumer_lag_records{group,topic,partition}): the
// records between its committed offset and the partition's end, which
// counts the transaction markers too. A scrape that cannot reach the
// brokers reports no lag and logs why.
func (r *Registry) ConsumerLag(adm *kadm.Client, group string, logger *slog.Logger) {
	desc := prometheus.NewDesc("ledger_consumer_lag_records", "Records between the consumer group's committed offset and the end of each partition (transaction markers included).", []string{"group", "topic", "partition"}, prometheus.Labels{"role": r.role})
	r.reg.MustRegister(newCollector(func(ch chan<- prometheus.Metric) {
		ctx, cancel := context.WithTimeout(context.Background(), lagTimeout)
		defer cancel()
		lags, err := adm.Lag(ctx, group)
		if err == nil {
			err = lags.Error()
		}
		if err != nil {
			logger.Warn("consumer lag not available", "group", group, "err", err)
			return
		}
		for _, l := range lags[group].Lag.Sorted() {
			if l.Err != nil {
				continue
			}
			ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, float64(l.Lag), group, l.Topic, strconv.Itoa(int(l.Partition)))
		}
	}, desc))
}

// collectorFunc is a collector whose metrics, of the descs, are computed
// at scrape time by collect.
type collectorFunc struct {
	collect func(chan<- prometheus.Metric)
	descs   []*prometheus.Desc
}

func newCollector(collect func(chan<- prometheus.Metric), descs ...*prometheus.Desc) collectorFunc {
	return collectorFunc{collect: collect, descs: descs}
}

// Describe implements prometheus.Collector.
func (c collectorFunc) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c collectorFunc) Collect(ch chan<- prometheus.Metric) { c.collect(ch) }
