package chstore

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
	"golang.org/x/sync/errgroup"
)

// The store is what the projector writes to and what responders ask.
var (
	_ projections.Sink    = (*Store)(nil)
	_ projections.Queries = (*Store)(nil)
)

// placeholders is n bound parameters, comma-separated.
func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?, ", n), ", ")
}

// maxTraceRanges bounds the ranges of the events table a trace reads one
// by one: a call's events are under one tool, and a few more come from
// refusals naming others, or from a compensation or resolution days
// after the call.
const maxTraceRanges = 16

// maxTracePoints bounds the (tool, second) points of a key that a trace
// reads from event_keys to lay out its ranges; a key with more (refusals
// sent again and again) is read by one range per tool.
const maxTracePoints = 256

// traceGap is the longest gap, in seconds, between a key's events under
// one tool that one range of the events table spans: the events table is
// sorted by tenant, tool and time, so a range reads every event of the
// tenant's tool in it, and a call resolved or compensated days later
// would read days of the tool's traffic as one range.
const traceGap = 300

// traceRange is a span of the events table: one tool's rows from one
// second to another, both included.
type traceRange struct {
	tool     string
	from, to uint32
}

// traceRanges lays out the ranges that cover points (the seconds at
// which a key's events were written, per tool, each tool's ascending):
// one per run of seconds no more than traceGap apart; or, past
// maxTraceRanges of those, one per tool from its first second to its
// last; or nil, past maxTraceRanges tools.
func traceRanges(points map[string][]uint32) []traceRange {
	tools := slices.Sorted(maps.Keys(points))
	if len(tools) > maxTraceRanges {
		return nil
	}
	var out []traceRange
	for _, tool := range tools {
		ps := points[tool]
		r := traceRange{tool, ps[0], ps[0]}
		for _, p := range ps[1:] {
			if p-r.to > traceGap {
				out = append(out, r)
				r.from = p
			}
			r.to = p
		}
		out = append(out, r)
	}
	if len(out) <= maxTraceRanges {
		return out
	}
	out = out[:0]
	for _, tool := range tools {
		ps := points[tool]
		out = append(out, traceRange{tool, ps[0], ps[len(ps)-1]})
	}
	return out
}

// Trace returns the events under key: refusals first by time (at most
// MaxRefusals, the earliest and the latest), then the call's events by
// seq, each event once.
//
// event_keys tells under which tools and times the key's events were
// written, so that the events table is read by ranges of its sort key
// (tenant, tool, time) around them (traceRanges).
func (s *Store) Trace(ctx context.Context, key ledger.CallKey) ([]ledger.Event, error) {
	return s.trace(ctx, key, "")
}

// UserTrace is Trace with the refusals of user alone (those whose
// verified user it is): at most MaxRefusals of user's, the earliest and
// the latest, however many other users' there are. An agent's view of a
// key is its user's (httpapi), and cut from every user's refusals,
// another user of the tenant flooding the key with refused envelopes
// would push the agent's own refusal out of it, and out of its wait.
// ErrNotFound when the key holds neither a call nor a refusal of user.
// User "" is Trace: every user's refusals.
func (s *Store) UserTrace(ctx context.Context, key ledger.CallKey, user string) ([]ledger.Event, error) {
	return s.trace(ctx, key, user)
}

// trace is Trace, of user's refusals alone when user is not "".
func (s *Store) trace(ctx context.Context, key ledger.CallKey, user string) ([]ledger.Event, error) {
	ctx = s.question(ctx)
	rows, err := s.conn.Query(ctx, "SELECT tool, toUInt32(at) AS second FROM "+s.table("event_keys")+
		" WHERE tenant_id = ? AND idempotency_key = ? GROUP BY tool, second ORDER BY tool, second LIMIT "+strconv.Itoa(maxTracePoints+1),
		key.TenantID, key.IdempotencyKey)
	if err != nil {
		return nil, s.wrapQuestion("trace: read event_keys", err)
	}
	var (
		points      = make(map[string][]uint32)
		n           int
		first, last uint32
	)
	for rows.Next() {
		var (
			tool   string
			second uint32
		)
		if err := rows.Scan(&tool, &second); err != nil {
			rows.Close()
			return nil, s.wrapQuestion("trace: read event_keys", err)
		}
		if n == 0 || second < first {
			first = second
		}
		last = max(last, second)
		points[tool] = append(points[tool], second)
		n++
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, s.wrapQuestion("trace: read event_keys", err)
	}
	if n == 0 {
		return nil, projections.ErrNotFound
	}
	var (
		ranges []string
		args   = []any{key.TenantID, key.IdempotencyKey}
	)
	if n <= maxTracePoints {
		for _, r := range traceRanges(points) {
			ranges = append(ranges, "(tool = ? AND at >= toDateTime(?) AND at <= toDateTime(?))")
			args = append(args, r.tool, r.from, r.to)
		}
	}
	if len(ranges) == 0 {
		// Refusals under the key name the tools their envelopes named,
		// any number of them (an agent can send thousands): a range
		// each would outgrow the query's size limit and make the call
		// unreadable. One range over the key's tools and times instead.
		if n > maxTracePoints {
			// The points read were the first tools' only.
			if err := s.conn.QueryRow(ctx, "SELECT toUInt32(min(at)), toUInt32(max(at)) FROM "+s.table("event_keys")+
				" WHERE tenant_id = ? AND idempotency_key = ?", key.TenantID, key.IdempotencyKey).Scan(&first, &last); err != nil {
				return nil, s.wrapQuestion("trace: read event_keys", err)
			}
		}
		ranges = []string{"(tool IN (SELECT tool FROM " + s.table("event_keys") + " WHERE tenant_id = ? AND idempotency_key = ?)" +
			" AND at >= toDateTime(?) AND at <= toDateTime(?))"}
		args = []any{key.TenantID, key.IdempotencyKey, key.TenantID, key.IdempotencyKey, first, last}
	}
	// LIMIT BY keeps the earliest half of the refusals KeepRefusals
	// keeps (one group) and every event of the call (a group each); when
	// it cut the refusals, the latest half are read after.
	half := projections.MaxRefusals / 2
	cols := "SELECT event_id, any(seq) AS e_seq, toUInt32(any(at)) AS e_at, any(at_ns) AS e_ns, any(body)," +
		" if(e_seq > 0, event_id, '') AS e_group"
	from := " FROM " + s.table("events") +
		" WHERE tenant_id = ? AND idempotency_key = ? AND (" + strings.Join(ranges, " OR ") + ")"
	if user != "" {
		from += " AND (seq > 0 OR user_id = ?)"
		args = append(args, user)
	}
	out, err := s.traceEvents(ctx, cols+from+
		" GROUP BY event_id ORDER BY e_seq > 0, e_seq, e_at, e_ns, event_id"+
		" LIMIT "+strconv.Itoa(half)+" BY e_group", args)
	if err != nil {
		return nil, err
	}
	if n := refusalsOf(out); n == half {
		// Read again rather than cut from one list of them all, which
		// a flood of refusals makes as long as the flood.
		latest, err := s.traceEvents(ctx, cols+from+" AND seq = 0"+
			" GROUP BY event_id ORDER BY e_at DESC, e_ns DESC, event_id DESC"+
			" LIMIT "+strconv.Itoa(half), args)
		if err != nil {
			return nil, err
		}
		refused := out[:n:n]
		for _, e := range latest {
			if !slices.ContainsFunc(refused, func(r ledger.Event) bool { return r.EventID == e.EventID }) {
				refused = append(refused, e)
			}
		}
		slices.SortFunc(refused, projections.CompareRefusals)
		out = append(refused, out[n:]...)
	}
	if len(out) == 0 {
		// event_keys was written and events not (a Write that failed
		// half way, to be written again): nothing to show yet. Or,
		// for a user, the key holds other users' refusals alone.
		return nil, projections.ErrNotFound
	}
	return out, nil
}

// refusalsOf is how many refusals lead trace.
func refusalsOf(trace []ledger.Event) int {
	n := 0
	for n < len(trace) && trace[n].Refusal() {
		n++
	}
	return n
}

// traceEvents runs a query of Trace's, whose rows are an event's id,
// seq, second, nanoseconds, body and group, and decodes the events.
func (s *Store) traceEvents(ctx context.Context, q string, args []any) ([]ledger.Event, error) {
	rows, err := s.conn.Query(ctx, q, args...)
	if err != nil {
		return nil, s.wrapQuestion("trace: read events", err)
	}
	defer rows.Close()
	var out []ledger.Event
	for rows.Next() {
		var (
			id, body, group string
			seq             int64
			at, ns          uint32
		)
		if err := rows.Scan(&id, &seq, &at, &ns, &body, &group); err != nil {
			return nil, s.wrapQuestion("trace: read events", err)
		}
		e, err := ledger.DecodeEvent([]byte(body))
		if err != nil {
			return nil, s.wrapQuestion("trace: event "+id, err)
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, s.wrapQuestion("trace: read events", err)
	}
	return out, nil
}

// where gathers a WHERE clause's conditions and their bound values.
type where struct {
	conds []string
	args  []any
}

func (w *where) add(cond string, args ...any) {
	w.conds = append(w.conds, cond)
	w.args = append(w.args, args...)
}

func (w *where) String() string {
	if len(w.conds) == 0 {
		return "1"
	}
	return strings.Join(w.conds, " AND ")
}

// window adds f's [Since, Until) on col, a DateTime: whole seconds.
func (w *where) window(col string, f projections.Filter) {
	if !f.Since.IsZero() {
		w.add(col+" >= toDateTime(?)", unixSeconds(f.Since))
	}
	if !f.Until.IsZero() {
		w.add(col+" < toDateTime(?)", unixSeconds(f.Until))
	}
}

// tenantTool adds f's tenant and tool, where it names them.
func (w *where) tenantTool(f projections.Filter) {
	if f.Tenant != "" {
		w.add("tenant_id = ?", f.Tenant)
	}
	if f.Tool != "" {
		w.add("tool = ?", f.Tool)
	}
}

// callColumns are what latestCalls selects per call, in the order
// scanCall reads them. Aliases differ from column names: ClickHouse's
// aliases are visible to the whole query, and an alias named like a
// column would shadow it inside the other aggregates.
const callColumns = "tenant_id, idempotency_key, c_call_id, c_tool, c_tool_version, c_agent_id, c_user_id, c_resource, c_trace_id," +
	" c_state, c_last_event, c_seq, c_updated_at, c_updated_at_ns, c_policy_version, c_approver, c_approval_id, c_jti," +
	" c_credential_family, c_reason, c_error_code, c_tool_digest"

// latestCalls is a subquery: one row per call of the calls table that
// cond (with args) selects, as its highest-seq row shows it; having, if
// not empty, is a condition on those rows (on the c_ columns), its
// values bound after cond's.
func (s *Store) latestCalls(cond, having string) string {
	if having != "" {
		having = " HAVING " + having
	}
	return "SELECT tenant_id, idempotency_key," +
		" argMax(call_id, seq) AS c_call_id, argMax(tool, seq) AS c_tool, argMax(tool_version, seq) AS c_tool_version," +
		" argMax(agent_id, seq) AS c_agent_id, argMax(user_id, seq) AS c_user_id, argMax(resource, seq) AS c_resource," +
		" argMax(trace_id, seq) AS c_trace_id, argMax(state, seq) AS c_state, argMax(last_event, seq) AS c_last_event," +
		" max(seq) AS c_seq, toUInt32(argMax(updated_at, seq)) AS c_updated_at, argMax(updated_at_ns, seq) AS c_updated_at_ns," +
		" argMax(policy_version, seq) AS c_policy_version, argMax(approver, seq) AS c_approver," +
		" argMax(approval_id, seq) AS c_approval_id, argMax(jti, seq) AS c_jti," +
		" argMax(credential_family, seq) AS c_credential_family, argMax(reason, seq) AS c_reason," +
		" argMax(error_code, seq) AS c_error_code, argMax(tool_digest, seq) AS c_tool_digest" +
		" FROM " + s.table("calls") + " WHERE " + cond + " GROUP BY tenant_id, idempotency_key" + having
}

// scanner is a row of a query result.
type scanner interface{ Scan(dest ...any) error }

// scanCall reads a row of callColumns.
func scanCall(r scanner) (projections.Call, error) {
	var (
		c                  projections.Call
		toolVersion        int64
		state, last        string
		updated, updatedNS uint32
	)
	err := r.Scan(&c.TenantID, &c.IdempotencyKey, &c.CallID, &c.Tool, &toolVersion, &c.AgentID, &c.UserID, &c.Resource, &c.TraceID,
		&state, &last, &c.Seq, &updated, &updatedNS, &c.PolicyVersion, &c.Approver, &c.ApprovalID, &c.JTI,
		&c.CredentialFamily, &c.Reason, &c.ErrorCode, &c.ToolDigest)
	c.ToolVersion = int(toolVersion)
	c.State, c.LastEvent = statemachine.State(state), statemachine.EventType(last)
	c.UpdatedAt = time.Unix(int64(updated), int64(updatedNS)).UTC()
	return c, err
}

// matching is the subquery of the (tenant, key) of the calls that f
// selects, with its bound values: each reference f names must be carried
// by one of the call's events in the window, of f's tenant and tool; with
// no reference, the call's requested event.
func matching(s *Store, f projections.Filter) (string, []any) {
	var (
		kinds []string
		w     where
	)
	ref := func(kind, value string) {
		if value != "" {
			kinds = append(kinds, "(kind = ? AND value = ?)")
			w.args = append(w.args, kind, value)
		}
	}
	ref(refJTI, f.JTI)
	ref(refFamily, f.CredentialFamily)
	if f.PolicyVersion != "" {
		cond, args := "(kind = ? AND value = ?", []any{refPolicyVersion, f.PolicyVersion}
		if !strings.Contains(f.PolicyVersion, "@") {
			// A label (projections.PolicyVersionMatches): its versions
			// label@hash are a range of the sort key, '@' + 1 being 'A'.
			cond = "(kind = ? AND (value = ? OR (value >= ? AND value < ?))"
			args = append(args, f.PolicyVersion+"@", f.PolicyVersion+"A")
		}
		if f.Decision != "" {
			cond += " AND decision = ?"
			args = append(args, f.Decision)
		}
		kinds = append(kinds, cond+")")
		w.args = append(w.args, args...)
	}
	if f.Role != "" {
		cond, args := "(kind = ? AND value = ?", []any{refRole, f.Role}
		if f.Decision != "" {
			cond += " AND decision = ?"
			args = append(args, f.Decision)
		}
		kinds = append(kinds, cond+")")
		w.args = append(w.args, args...)
	}
	ref(refApprover, f.Approver)
	ref(refApprovalID, f.ApprovalID)
	ref(refCallID, f.CallID)
	ref(refTraceID, f.TraceID)
	ref(refToolDigest, f.ToolDigest)
	named := len(kinds)
	if named == 0 {
		// The requested rows are valued with their tenant.
		if f.Tenant != "" {
			kinds = append(kinds, "(kind = ? AND value = ?)")
			w.args = append(w.args, refRequested, f.Tenant)
		} else {
			kinds = append(kinds, "kind = ?")
			w.args = append(w.args, refRequested)
		}
		named = 1
	}
	w.conds = append(w.conds, "("+strings.Join(kinds, " OR ")+")")
	w.window("at", f)
	w.tenantTool(f)
	return "SELECT tenant_id, idempotency_key FROM " + s.table("call_refs") + " WHERE " + w.String() +
		" GROUP BY tenant_id, idempotency_key HAVING uniqExact(kind) = " + fmt.Sprint(named), w.args
}

// BlastRadius answers what f touched. The matching calls are found from
// call_refs by primary-key ranges, their latest rows from calls (where
// f.State narrows them), and every count is computed by the server, so
// that the answer costs two queries and the listed calls, however many
// calls match.
func (s *Store) BlastRadius(ctx context.Context, f projections.Filter) (projections.BlastRadius, error) {
	ctx = s.question(ctx)
	f, err := f.Check()
	if err != nil {
		return projections.BlastRadius{}, err
	}
	sub, subArgs := matching(s, f)
	var w where
	if f.Tenant != "" {
		w.add("tenant_id = ?", f.Tenant)
	}
	w.add("(tenant_id, idempotency_key) IN ("+sub+")", subArgs...)
	// The state narrows on the call's latest row, in the subquery both
	// the counts and the list read, so that they agree.
	having := ""
	if f.State != "" {
		having = "c_state = ?"
		w.args = append(w.args, string(f.State))
	}
	calls := s.latestCalls(w.String(), having)

	// The counts and the list are two queries over the same calls: asked
	// at once, the server works on both together. A projector's insert
	// between them makes them disagree; AskAgreeing asks again.
	return projections.AskAgreeing(ctx, func(ctx context.Context) (projections.BlastRadius, error) {
		br := projections.BlastRadius{Filter: f, Calls: []projections.Call{}}
		var list []projections.Call
		g, gctx := errgroup.WithContext(ctx)
		g.Go(func() error {
			if err := s.blastCounts(gctx, &br, calls, w.args); err != nil {
				return s.wrapQuestion("blast radius: count", err)
			}
			return nil
		})
		g.Go(func() error {
			var err error
			list, err = s.queryCalls(gctx, "SELECT "+callColumns+" FROM ("+calls+")"+
				" ORDER BY c_updated_at DESC, c_updated_at_ns DESC, tenant_id, idempotency_key LIMIT ?", append(slices.Clone(w.args), f.Limit+1)...)
			if err != nil {
				return s.wrapQuestion("blast radius: list", err)
			}
			return nil
		})
		if err := g.Wait(); err != nil {
			return projections.BlastRadius{Filter: f, Calls: []projections.Call{}}, err
		}
		br.Calls, br.Truncated = cutList(list, f.Limit, br.Total)
		return br, nil
	})
}

// cutList cuts list, read with one call more than limit, to limit, and
// reports whether calls were left out: the extra call read, or a total
// (counted beside the list) past what it holds. The counts and the list
// are two queries: a call that lands between them makes the list one
// longer than the total says, and the total alone let a list cut at the
// limit pass for the whole (a compensate-all over it left that call out).
func cutList(list []projections.Call, limit, total int) ([]projections.Call, bool) {
	if len(list) > limit {
		return list[:limit:limit], true
	}
	return list, len(list) == limit && total > len(list)
}

// blastCounts fills br's Total, counts and Distinct from the calls
// subquery, in one query: each call counts once under each dimension,
// largest first, then by value (bytewise, as strings.Compare), and LIMIT
// BY keeps the MaxCounts largest of each dimension. The grouped values are
// gathered per dimension before the cut, so that each row also carries
// its dimension's number of values and of calls, which the cut leaves
// exact (the number of calls is the Total).
func (s *Store) blastCounts(ctx context.Context, br *projections.BlastRadius, calls string, args []any) error {
	rows, err := s.conn.Query(ctx, "SELECT dim, d_values, d_calls, val, n FROM ("+
		"SELECT dim, count() AS d_values, sum(g_n) AS d_calls, groupArray(g_val) AS vals, groupArray(g_n) AS ns FROM ("+
		"SELECT d.1 AS dim, d.2 AS g_val, count() AS g_n FROM ("+calls+")"+
		" ARRAY JOIN [('tenant', tenant_id), ('state', c_state), ('tool', c_tool), ('resource', c_resource)] AS d"+
		" GROUP BY dim, g_val) GROUP BY dim)"+
		" ARRAY JOIN vals AS val, ns AS n"+
		" ORDER BY dim, n DESC, val LIMIT "+strconv.Itoa(projections.MaxCounts)+" BY dim", args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	br.ByTenant, br.ByState, br.ByTool, br.ByResource = []projections.Count{}, []projections.Count{}, []projections.Count{}, []projections.Count{}
	type dimension struct {
		counts *[]projections.Count
		values *int
	}
	dims := map[string]dimension{
		"tenant":   {&br.ByTenant, &br.Distinct.Tenants},
		"state":    {&br.ByState, &br.Distinct.States},
		"tool":     {&br.ByTool, &br.Distinct.Tools},
		"resource": {&br.ByResource, &br.Distinct.Resources},
	}
	for rows.Next() {
		var (
			dim, val         string
			values, total, n uint64
		)
		if err := rows.Scan(&dim, &values, &total, &val, &n); err != nil {
			return err
		}
		// Every call has one tenant: that dimension's calls are all of
		// them.
		if dim == "tenant" {
			br.Total = int(total)
		}
		if d, ok := dims[dim]; ok {
			*d.counts = append(*d.counts, projections.Count{Value: val, Calls: int(n)})
			*d.values = int(values)
		}
	}
	return rows.Err()
}

// queryCalls reads rows of callColumns.
func (s *Store) queryCalls(ctx context.Context, q string, args ...any) ([]projections.Call, error) {
	rows, err := s.conn.Query(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := []projections.Call{}
	for rows.Next() {
		c, err := scanCall(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// Outcomes counts the calls that reached each outcome, by tool and
// epoch-aligned bucket of the outcome event's time. A call counts once
// per bucket, tool and state, however many such events it has there.
func (s *Store) Outcomes(ctx context.Context, f projections.Filter, bucket time.Duration) ([]projections.OutcomeCount, error) {
	ctx = s.question(ctx)
	// The store has no clock of its own: an open window is bounded at
	// the time of asking.
	f, err := projections.CheckOutcomes(f, bucket, time.Now())
	if err != nil {
		return nil, err
	}
	n := uint64(bucket / time.Second)
	var w where
	w.tenantTool(f)
	w.window("at", f)
	types := make([]any, len(projections.OutcomeEvents))
	for i, t := range projections.OutcomeEvents {
		types[i] = string(t)
	}
	w.add("type IN ("+placeholders(len(types))+")", types...)
	// Refusals are not calls, whatever their type.
	w.add("seq > 0")
	rows, err := s.conn.Query(ctx, "SELECT toUInt64(intDiv(toUInt32(at), ?) * ?) AS b, tool, state,"+
		" uniqExact(tenant_id, idempotency_key) FROM "+s.table("events")+" WHERE "+w.String()+
		" GROUP BY b, tool, state ORDER BY b, tool, state", append([]any{n, n}, w.args...)...)
	if err != nil {
		return nil, s.wrapQuestion("outcomes", err)
	}
	defer rows.Close()
	out := []projections.OutcomeCount{}
	for rows.Next() {
		var (
			b, calls    uint64
			tool, state string
		)
		if err := rows.Scan(&b, &tool, &state, &calls); err != nil {
			return nil, s.wrapQuestion("outcomes", err)
		}
		out = append(out, projections.OutcomeCount{
			Bucket: time.Unix(int64(b), 0).UTC(), Tool: tool, State: statemachine.State(state), Calls: int(calls),
		})
	}
	if err := rows.Err(); err != nil {
		return nil, s.wrapQuestion("outcomes", err)
	}
	return out, nil
}

// unresolvedStates are the states Unresolved lists.
var unresolvedStates = []any{string(statemachine.StateOutcomeUnknown), string(statemachine.StateApprovalPending)}

// Unresolved lists the calls whose latest state waits on someone, oldest
// update first. Only calls that ever had such a row are folded: a call
// waits only if its latest row says so.
func (s *Store) Unresolved(ctx context.Context, f projections.Filter) ([]projections.Call, error) {
	ctx = s.question(ctx)
	f, err := projections.CheckUnresolved(f)
	if err != nil {
		return nil, err
	}
	var inner where
	if f.Tenant != "" {
		inner.add("tenant_id = ?", f.Tenant)
	}
	inner.add("state IN ("+placeholders(len(unresolvedStates))+")", unresolvedStates...)
	var w where
	if f.Tenant != "" {
		w.add("tenant_id = ?", f.Tenant)
	}
	w.add("(tenant_id, idempotency_key) IN (SELECT tenant_id, idempotency_key FROM "+s.table("calls")+" WHERE "+inner.String()+")", inner.args...)
	var outer where
	outer.add("c_state IN ("+placeholders(len(unresolvedStates))+")", unresolvedStates...)
	if f.Tool != "" {
		outer.add("c_tool = ?", f.Tool)
	}
	args := append(append(w.args, outer.args...), f.Limit)
	out, err := s.queryCalls(ctx, "SELECT "+callColumns+" FROM ("+s.latestCalls(w.String(), "")+") WHERE "+outer.String()+
		" ORDER BY c_updated_at, c_updated_at_ns, tenant_id, idempotency_key LIMIT ?", args...)
	if err != nil {
		return nil, s.wrapQuestion("unresolved", err)
	}
	return out, nil
}
