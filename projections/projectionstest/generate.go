package projectionstest

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// LogConfig shapes a generated log.
type LogConfig struct {
	// Seed makes the log repeatable.
	Seed uint64
	// Calls is the number of calls; default 500.
	Calls int
	// Tenants is the number of tenants (t_00, t_01...); default 4.
	Tenants int
	// Start is when the first call is requested; the calls are spread
	// evenly over Span (default 2h) from it. Default: 2026-11-30 10:00 UTC.
	Start time.Time
	Span  time.Duration
	// PolicyEvery is how long each policy version is in force, v40, v41...
	// from Start; default 30m.
	PolicyEvery time.Duration
}

func (c LogConfig) withDefaults() LogConfig {
	if c.Calls <= 0 {
		c.Calls = 500
	}
	if c.Tenants <= 0 {
		c.Tenants = 4
	}
	if c.Start.IsZero() {
		c.Start = time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	}
	if c.Span <= 0 {
		c.Span = 2 * time.Hour
	}
	if c.PolicyEvery <= 0 {
		c.PolicyEvery = 30 * time.Minute
	}
	return c
}

// Approvers are the generated logs' approvers.
var Approvers = []string{"u_alice", "u_bob", "u_carol"}

// Roles are the roles the generated logs' callers have. The calls of the
// log's first quarter were decided without roles (before --policy-roles
// was on); each later one with one of roleSets, some with none given.
var Roles = []string{"admin", "contractor", "support"}

var roleSets = [][]string{{"support"}, {"contractor", "support"}, {"admin"}, nil}

// Tools are the generated logs' tools; refund_order's calls name a
// resource.
var Tools = []string{"get_weather", "create_ticket", "refund_order", "send_email"}

// toolDigest stands for the digest of tool's definition (schemas.Tool's
// form, "sha256:" and 64 hex digits); edited, for that of a definition
// edited in place, which calls of the same version may have been
// admitted under too.
func toolDigest(tool string, edited bool) string {
	def := tool
	if edited {
		def += " (edited)"
	}
	sum := sha256.Sum256([]byte(def))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// Generator produces the events of generated calls, one call at a time,
// so that a log of millions of events need not be held in memory.
type Generator struct {
	cfg LogConfig
}

// NewGenerator returns a generator for cfg.
func NewGenerator(cfg LogConfig) *Generator { return &Generator{cfg: cfg.withDefaults()} }

// Calls is the number of calls the generator makes.
func (g *Generator) Calls() int { return g.cfg.Calls }

// Call returns the events of call i, in seq order, in the form the log
// holds them (encoded and decoded once). The same i always gives the same
// events.
func (g *Generator) Call(i int) []ledger.Event {
	cfg := g.cfg
	r := rand.New(rand.NewPCG(cfg.Seed, uint64(i)))
	at := cfg.Start.Add(time.Duration(int64(cfg.Span) / int64(cfg.Calls) * int64(i))).Add(time.Duration(r.Int64N(int64(time.Second))))
	tenant := fmt.Sprintf("t_%02d", r.IntN(cfg.Tenants))
	tool := Tools[r.IntN(len(Tools))]
	key := fmt.Sprintf("k-%d-%07d", cfg.Seed, i)
	base := ledger.Event{
		TenantID: tenant, IdempotencyKey: key, CallID: fmt.Sprintf("c-%d-%07d", cfg.Seed, i),
		UserID: fmt.Sprintf("u_%d", r.IntN(50)), AgentID: fmt.Sprintf("a_%d", r.IntN(10)),
		// Three calls in a row share a trace, as an agent's run makes
		// several calls, here not always of one tenant or tool.
		Channel: "kafka", Tool: tool, ToolVersion: 1, TraceID: fmt.Sprintf("%032x", uint64(i/3)+1),
		ArgumentsHash: fmt.Sprintf("sha256:%064x", uint64(i)+1),
	}
	if i >= cfg.Calls/4 {
		// Not drawn from r, so that the rest of the log is as it was
		// before calls had roles.
		base.Roles, base.RolesGiven = roleSets[i%len(roleSets)], true
	}
	if i%5 != 0 {
		// Every call but one in five (an older build's) names the
		// definition it was admitted under; not drawn from r either.
		base.ToolDigest = toolDigest(tool, i%7 == 1)
	}
	args := `{"city":"Lisbon"}`
	if tool == "refund_order" {
		base.Resource = fmt.Sprintf("ord_%d", r.IntN(cfg.Calls/4+1))
		args = fmt.Sprintf(`{"amount":%d,"order_id":%q,"reason":"[REDACTED]"}`, r.IntN(900)+1, base.Resource)
	}
	base.PolicyVersion = PolicyVersion(40 + int(at.Sub(cfg.Start)/cfg.PolicyEvery))
	epoch := at.Unix() / 3600
	jti := fmt.Sprintf("jti-%d-%07d", cfg.Seed, i)
	family := fmt.Sprintf("%s:%s:%d", tool, tenant, epoch)

	var evs []ledger.Event
	add := func(t statemachine.EventType, edit func(e *ledger.Event)) {
		at = at.Add(time.Duration(1+r.IntN(900)) * time.Millisecond)
		e := base
		e.EventID = fmt.Sprintf("e-%d-%07d-%d", cfg.Seed, i, len(evs)+1)
		e.Type, e.Seq, e.At, e.Actor = t, int64(len(evs)+1), at, "gen"
		if edit != nil {
			edit(&e)
		}
		evs = append(evs, e)
		// What follows an event carries its policy and approval
		// fields, as the executor's template does.
		base.Approver, base.ApprovalID = e.Approver, e.ApprovalID
	}
	decide := func(decision string) func(e *ledger.Event) {
		return func(e *ledger.Event) { e.Decision = decision; e.PolicyID = []string{"p_" + tool} }
	}
	// rechecked: the call was approved, and the executor decides it
	// again under the version in force when it runs; its executing
	// event records that allow, and what follows carries that version.
	rechecked := false
	run := func(ends ...statemachine.EventType) {
		attempt := 1 + r.IntN(2)
		add(statemachine.EventExecuting, func(e *ledger.Event) {
			e.Attempt, e.JTI, e.CredentialFamily, e.CredentialScope = attempt, jti, family, tool
			if i%13 == 5 {
				// Taken over after owners died in a row: the one before
				// the last signed under the previous hour's key, the
				// family of that hour's calls.
				e.EarlierCredentialFamilies = []string{fmt.Sprintf("%s:%s:%d", tool, tenant, epoch-1)}
			}
			if rechecked {
				decide("allow")(e)
				e.PolicyVersion = PolicyVersion(40 + int(at.Sub(cfg.Start)/cfg.PolicyEvery))
				base.PolicyVersion = e.PolicyVersion
			}
		})
		for _, end := range ends {
			add(end, func(e *ledger.Event) {
				e.Attempt, e.JTI, e.CredentialFamily, e.CredentialScope = attempt, jti, family, tool
				switch end {
				case statemachine.EventFailed:
					e.Reason, e.ErrorCode = "tool_failed", "http_500"
				case statemachine.EventOutcomeUnknown:
					e.Reason, e.ErrorCode = "outcome_ambiguous", "timeout"
				case statemachine.EventParked:
					e.Reason = "unresolved"
				case statemachine.EventSucceeded:
					e.ResultDigest, e.ResultBytes, e.LatencyMS = "sha256:"+fmt.Sprintf("%064x", i), 42, int64(r.IntN(200))
				}
			})
		}
	}
	var exp time.Time
	approve := func(then func()) {
		approval := key + ":approval"
		exp = at.Add(15 * time.Minute)
		add(statemachine.EventApprovalPending, func(e *ledger.Event) {
			decide("require_approval")(e)
			e.ApprovalID, e.ExpiresAt, e.Reason = approval, &exp, "approval_required"
		})
		if then != nil {
			then()
		}
	}
	approver := Approvers[r.IntN(len(Approvers))]

	add(statemachine.EventRequested, func(e *ledger.Event) {
		e.Arguments = json.RawMessage(args)
		e.PolicyVersion = ""
	})
	switch p := r.IntN(100); {
	case p < 50:
		add(statemachine.EventAuthorized, decide("allow"))
		run(statemachine.EventSucceeded)
	case p < 58:
		add(statemachine.EventAuthorized, decide("allow"))
		run(statemachine.EventFailed)
	case p < 68:
		add(statemachine.EventDenied, func(e *ledger.Event) { decide("deny")(e); e.Reason = "policy_denied" })
	case p < 76:
		approve(func() {
			add(statemachine.EventApproved, func(e *ledger.Event) { e.Approver, e.ExpiresAt, e.Decision = approver, &exp, "approve" })
			rechecked = true
			run(statemachine.EventSucceeded)
		})
	case p < 80:
		approve(func() {
			add(statemachine.EventRejected, func(e *ledger.Event) { e.Approver, e.Reason, e.Decision = approver, "not_today", "reject" })
		})
	case p < 83:
		approve(func() {
			at = exp
			add(statemachine.EventExpired, func(e *ledger.Event) { e.Reason = "approval_expired" })
		})
	case p < 86:
		approve(nil)
	case p < 89:
		add(statemachine.EventAuthorized, decide("allow"))
		run(statemachine.EventOutcomeUnknown)
	case p < 92:
		add(statemachine.EventAuthorized, decide("allow"))
		run(statemachine.EventOutcomeUnknown, statemachine.EventParked)
	case p < 94:
		add(statemachine.EventAuthorized, decide("allow"))
		run(statemachine.EventOutcomeUnknown, statemachine.EventCompensated)
	case p < 96:
		add(statemachine.EventAuthorized, decide("allow"))
		run(statemachine.EventOutcomeUnknown, statemachine.EventSucceeded)
	case p < 98 && i%2 == 0:
		add(statemachine.EventAuthorized, decide("allow"))
		add(statemachine.EventExpired, func(e *ledger.Event) { e.Reason = "deadline_exceeded" })
	case p < 98:
		// Denied by the executor, no policy deciding (the tool was
		// frozen): a deny without a policy version, the call's roles
		// still on it.
		add(statemachine.EventAuthorized, decide("allow"))
		add(statemachine.EventDenied, func(e *ledger.Event) {
			e.Decision, e.Reason, e.PolicyVersion, e.PolicyID = "deny", "tool_frozen", "", nil
		})
	default:
		// Allowed at intake, denied by the executor's re-check under
		// the next policy version.
		add(statemachine.EventAuthorized, decide("allow"))
		add(statemachine.EventDenied, func(e *ledger.Event) {
			decide("deny")(e)
			e.Reason = "policy_changed"
			e.PolicyVersion = PolicyVersion(41 + int(at.Sub(cfg.Start)/cfg.PolicyEvery))
		})
	}
	// Now and then the same key is submitted again with other
	// arguments: a refusal, seq 0, that leaves the call alone.
	if r.IntN(25) == 0 {
		add(statemachine.EventDenied, func(e *ledger.Event) {
			e.Seq, e.Decision, e.Reason, e.Pointer = 0, "deny", "idempotency_key_reused", "/arguments"
			e.PolicyVersion, e.Approver, e.ApprovalID = "", "", ""
			e.Roles, e.RolesGiven, e.ToolDigest = nil, false, ""
		})
	}
	// Builds of two kinds at once: one in eleven calls has its last step
	// written by an older executor, which names no definition; one in
	// thirteen was admitted by an older intake (its requested and
	// decision events name none), and the services after it name the
	// definition from the record.
	if base.ToolDigest != "" && len(evs) > 2 {
		switch {
		case i%11 == 3:
			for j := len(evs) - 1; j >= 0; j-- {
				if evs[j].Seq > 0 {
					evs[j].ToolDigest = ""
					break
				}
			}
		case i%13 == 4:
			evs[0].ToolDigest, evs[1].ToolDigest = "", ""
		}
	}
	for j := range evs {
		evs[j] = roundTrip(evs[j])
	}
	return evs
}

// roundTrip returns e as a reader of the log sees it.
func roundTrip(e ledger.Event) ledger.Event {
	b, err := e.Encode()
	if err != nil {
		panic(fmt.Sprintf("projectionstest: generated event does not encode: %v", err))
	}
	out, err := ledger.DecodeEvent(b)
	if err != nil {
		panic(fmt.Sprintf("projectionstest: generated event does not decode: %v", err))
	}
	return out
}

// Log returns the whole log of cfg as a broker would hold it: calls
// interleaved (each call's events in order, as one partition keeps them),
// with some events published twice, as an outbox re-publish after a crash
// does.
func Log(cfg LogConfig) []ledger.Event {
	g := NewGenerator(cfg)
	r := rand.New(rand.NewPCG(g.cfg.Seed, 1<<62))
	queues := make([][]ledger.Event, g.Calls())
	for i := range queues {
		queues[i] = g.Call(i)
	}
	var log []ledger.Event
	// Interleave: take the next event of a random call among a window
	// of open calls, so that calls overlap in time as they do live.
	const window = 16
	next := 0
	var open []int
	for next < len(queues) || len(open) > 0 {
		for len(open) < window && next < len(queues) {
			open = append(open, next)
			next++
		}
		k := r.IntN(len(open))
		q := open[k]
		e := queues[q][0]
		queues[q] = queues[q][1:]
		log = append(log, e)
		if r.IntN(40) == 0 {
			log = append(log, e)
		}
		if len(queues[q]) == 0 {
			open = append(open[:k], open[k+1:]...)
		}
	}
	return log
}

// UnknownType is an event type no state machine knows, as a newer ledger
// could write while keeping the encoding version.
const UnknownType statemachine.EventType = "escalated_to_legal"

// WithUnknownTypes returns log with an event of UnknownType after the last
// event of every nth call, and how many of those calls wait on someone
// (approval_pending, outcome_unknown): the projections must keep those
// waiting.
func WithUnknownTypes(log []ledger.Event, n int) ([]ledger.Event, int) {
	o := NewOracle(log)
	out := slices.Clone(log)
	waiting := 0
	for i, k := range o.Keys() {
		evs := o.Events(k)
		if i%n != 0 || len(evs) == 0 {
			continue
		}
		last := evs[len(evs)-1]
		if s := stateNow(evs); s == statemachine.StateApprovalPending || s == statemachine.StateOutcomeUnknown {
			waiting++
		}
		out = append(out, roundTrip(ledger.Event{
			EventID: fmt.Sprintf("unknown-%04d", i), Type: UnknownType, Seq: last.Seq + 1, At: last.At.Add(time.Second),
			Actor: "future", TenantID: last.TenantID, IdempotencyKey: last.IdempotencyKey, CallID: last.CallID,
			UserID: last.UserID, AgentID: last.AgentID, Tool: last.Tool, ToolVersion: last.ToolVersion, ToolDigest: last.ToolDigest,
			Resource: last.Resource, ArgumentsHash: last.ArgumentsHash, TraceID: last.TraceID,
		}))
	}
	return out, waiting
}

// Flood returns n refused submissions under key, as a client retrying a
// bad envelope in a loop leaves them: times within a minute of start,
// some equal, in no particular order.
func Flood(key ledger.CallKey, n int, seed uint64, start time.Time) []ledger.Event {
	r := rand.New(rand.NewPCG(seed, uint64(n)))
	out := make([]ledger.Event, n)
	for i := range out {
		out[i] = roundTrip(ledger.Event{
			EventID: fmt.Sprintf("flood-%d-%04d", seed, r.IntN(1_000_000)*1000+i), Type: statemachine.EventDenied, Seq: 0,
			At:       start.Add(time.Duration(r.IntN(60)) * time.Second),
			Actor:    "gen",
			TenantID: key.TenantID, IdempotencyKey: key.IdempotencyKey,
			Decision: "deny", Reason: "idempotency_key_reused", Pointer: "/arguments",
		})
	}
	return out
}

// Wide returns the log of n calls, each of its own tenant and resource,
// and of a few more on hot ones (7 calls of t_hot on res_hot, 4 of
// t_warm on res_warm): a blast radius whose counts of tenants and
// resources have more values than it lists (projections.MaxCounts) once
// n is near that, the largest standing out of many ties. Every third
// call is denied; the calls are a second apart from start.
func Wide(n int, start time.Time) []ledger.Event {
	var log []ledger.Event
	call := func(i int, tenant, resource, tool string) {
		base := ledger.Event{
			TenantID: tenant, IdempotencyKey: fmt.Sprintf("wide-%05d", i), CallID: fmt.Sprintf("wide-c-%05d", i),
			Channel: "kafka", Tool: tool, ToolVersion: 1, TraceID: fmt.Sprintf("%032x", uint64(i)+1),
			ArgumentsHash: fmt.Sprintf("sha256:%064x", uint64(i)+1), Resource: resource, Actor: "gen",
		}
		at := start.Add(time.Duration(i) * time.Second)
		e := base
		e.EventID, e.Type, e.Seq, e.At = fmt.Sprintf("wide-e-%05d-1", i), statemachine.EventRequested, 1, at
		e.Arguments = json.RawMessage(fmt.Sprintf(`{"order_id":%q}`, resource))
		log = append(log, roundTrip(e))
		if i%3 == 0 {
			e := base
			e.EventID, e.Type, e.Seq, e.At = fmt.Sprintf("wide-e-%05d-2", i), statemachine.EventDenied, 2, at.Add(100*time.Millisecond)
			// A bare label, as a version without a hash.
			e.Decision, e.Reason, e.PolicyVersion = "deny", "policy_denied", "v40"
			log = append(log, roundTrip(e))
		}
	}
	for i := range n {
		call(i, fmt.Sprintf("t_%05d", i), fmt.Sprintf("res_%05d", i), Tools[i%2])
	}
	for i := range 11 {
		tenant, resource := "t_hot", "res_hot"
		if i >= 7 {
			tenant, resource = "t_warm", "res_warm"
		}
		call(n+i, tenant, resource, "refund_order")
	}
	return log
}

// PolicyVersion is the version of label vN as the intake writes it on
// decision events: label@ and 12 hex digits of its files' hash.
func PolicyVersion(n int) string {
	return fmt.Sprintf("v%d@%012x", n, uint64(n)*0x9e3779b97f4a7c15>>16)
}
