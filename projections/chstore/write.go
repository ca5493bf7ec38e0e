package chstore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// tableDef is a table Write fills: its name and its columns, in the order
// of the rows built for it. The same list makes the INSERT's column list
// and the checksum.
type tableDef struct {
	name string
	cols []string
}

// The tables, in the order Write fills them.
var (
	eventsTable = tableDef{"events", []string{
		"tenant_id", "tool", "at", "at_ns", "idempotency_key", "seq", "event_id", "type", "state", "actor",
		"call_id", "tool_version", "agent_id", "user_id", "resource", "arguments_hash", "trace_id",
		"policy_version", "decision", "approver", "approval_id", "jti", "credential_family",
		"reason", "error_code", "attempt", "latency_ms", "tool_digest", "body",
	}}
	eventKeysTable = tableDef{"event_keys", []string{"tenant_id", "idempotency_key", "tool", "at", "event_id"}}
	callRefsTable  = tableDef{"call_refs", []string{
		"kind", "value", "at", "tenant_id", "idempotency_key", "event_id", "tool", "decision", "seq",
	}}
	callsTable = tableDef{"calls", []string{
		"tenant_id", "idempotency_key", "seq", "event_id", "call_id", "tool", "tool_version", "agent_id",
		"user_id", "resource", "trace_id", "state", "last_event", "updated_at", "updated_at_ns",
		"policy_version", "approver", "approval_id", "jti", "credential_family", "reason", "error_code",
		"tool_digest",
	}}
	actionsTable = tableDef{"control_actions", []string{
		"subject", "at", "at_ns", "action_id", "kind", "tool", "tenant", "jti", "family", "policy",
		"by_user", "by_tenant", "reason", "policy_hash", "action",
	}}
	tables = []tableDef{eventsTable, eventKeysTable, callRefsTable, callsTable, actionsTable}
	// positionsTable is written after the others (Write), and is no
	// part of the content the checksums compare: a rebuild and the live
	// projection end at different offsets with the same rows.
	positionsTable = tableDef{"projection_positions", []string{"topic", "partition", "next_offset", "written_at"}}
)

// The kinds of call_refs rows.
const (
	refJTI           = "jti"
	refFamily        = "credential_family"
	refPolicyVersion = "policy_version"
	refApprover      = "approver"
	refApprovalID    = "approval_id"
	// refRole is a role the caller's assertion gave the policies, on
	// their decision events, with the decision.
	refRole = "role"
	// refCallID and refTraceID are on every event of a call, so that a
	// call is found by them over any window its events fall in.
	refCallID  = "call_id"
	refTraceID = "trace_id"
	// refToolDigest is the tool definition a call was admitted under,
	// on its requested event alone (projections.AdmittedUnder).
	refToolDigest = "tool_digest"
	// refRequested is a call's requested event; its value is the tenant,
	// so that a tenant's calls over a window are one range.
	refRequested = "requested"
)

// dateTime is t as a DateTime column holds it: whole seconds since the
// epoch, clamped to what a DateTime can hold (1970 to 2106).
func dateTime(t time.Time) time.Time {
	return time.Unix(unixSeconds(t), 0).UTC()
}

// unixSeconds is t in whole seconds, clamped to a DateTime's range.
func unixSeconds(t time.Time) int64 {
	return min(max(t.Unix(), 0), math.MaxUint32)
}

// tableRows are the rows of one Write, per table.
type tableRows map[string][][]any

func (r tableRows) add(t tableDef, row ...any) { r[t.name] = append(r[t.name], row) }

// eventRows adds the rows of pe to r. Its body is the event as the log
// holds it (pe.Raw), so that a field this build does not know is kept:
// re-encoded, the event would lose it, and a rebuild by a later build
// would not have the live projection's checksums.
func eventRows(r tableRows, pe projections.Event) error {
	e, body := pe.Event, pe.Raw
	if len(body) == 0 {
		var err error
		if body, err = e.Encode(); err != nil {
			return fmt.Errorf("event %s of %s: %w", e.EventID, e.Key(), err)
		}
	}
	id := e.EventID
	if id == "" {
		// Every event has an id; should one not, its wire form stands
		// in, so that writing it twice still collapses.
		sum := sha256.Sum256(body)
		id = "sha256:" + hex.EncodeToString(sum[:])
	}
	state, _ := statemachine.Target(e.Type)
	at, ns := dateTime(e.At), uint32(e.At.Nanosecond())
	r.add(eventsTable, e.TenantID, e.Tool, at, ns, e.IdempotencyKey, e.Seq, id, string(e.Type), string(state), e.Actor,
		e.CallID, int64(e.ToolVersion), e.AgentID, e.UserID, e.Resource, e.ArgumentsHash, e.TraceID,
		e.PolicyVersion, e.Decision, e.Approver, e.ApprovalID, e.JTI, e.CredentialFamily,
		e.Reason, e.ErrorCode, int64(e.Attempt), e.LatencyMS, e.ToolDigest, string(body))
	r.add(eventKeysTable, e.TenantID, e.IdempotencyKey, e.Tool, at, id)
	if e.Refusal() {
		// A refused submission is not a step of a call: only Trace
		// shows it.
		return nil
	}
	ref := func(kind, value, decision string) {
		r.add(callRefsTable, kind, value, at, e.TenantID, e.IdempotencyKey, id, e.Tool, decision, e.Seq)
	}
	if e.JTI != "" {
		ref(refJTI, e.JTI, "")
	}
	if e.CredentialFamily != "" {
		ref(refFamily, e.CredentialFamily, "")
	}
	for _, f := range e.EarlierCredentialFamilies {
		if f != "" {
			ref(refFamily, f, "")
		}
	}
	if e.PolicyVersion != "" && projections.PolicyDecision(e.Decision) {
		ref(refPolicyVersion, e.PolicyVersion, e.Decision)
		for _, role := range e.Roles {
			if role != "" {
				ref(refRole, role, e.Decision)
			}
		}
	}
	if e.Approver != "" {
		ref(refApprover, e.Approver, "")
	}
	if e.ApprovalID != "" {
		ref(refApprovalID, e.ApprovalID, "")
	}
	if e.CallID != "" {
		ref(refCallID, e.CallID, "")
	}
	if e.TraceID != "" {
		ref(refTraceID, e.TraceID, "")
	}
	if e.Seq == 1 && e.Type == statemachine.EventRequested {
		ref(refRequested, e.TenantID, "")
	}
	if e.ToolDigest != "" && projections.AdmittedUnder(&e, e.ToolDigest) {
		ref(refToolDigest, e.ToolDigest, "")
	}
	if !projections.KnownType(e.Type) {
		// It moves no call: the call's latest row stays the one of its
		// last event of a known type.
		return nil
	}
	c := projections.CallOf(&e)
	r.add(callsTable, c.TenantID, c.IdempotencyKey, c.Seq, id, c.CallID, c.Tool, int64(c.ToolVersion), c.AgentID,
		c.UserID, c.Resource, c.TraceID, string(c.State), string(c.LastEvent), at, ns,
		c.PolicyVersion, c.Approver, c.ApprovalID, c.JTI, c.CredentialFamily, c.Reason, c.ErrorCode,
		c.ToolDigest)
	return nil
}

// actionRows adds the row of a to r.
func actionRows(r tableRows, a ledger.ControlAction) error {
	a.At = a.At.UTC()
	raw, err := json.Marshal(a)
	if err != nil {
		return fmt.Errorf("control action %s: %w", a.Subject, err)
	}
	sum := sha256.Sum256(raw)
	r.add(actionsTable, a.Subject, dateTime(a.At), uint32(a.At.Nanosecond()), hex.EncodeToString(sum[:]), a.Kind,
		a.Tool, a.Tenant, a.JTI, a.Family, a.Policy, a.By, a.ByTenant, a.Reason, a.PolicyHash, string(raw))
	return nil
}

// Write inserts the batch: one INSERT per table, the tables at once, then
// the batch's Ends (Positions), once every table has its rows. It
// returns nil only once all are written. A failed Write may have
// written some tables:
// the projector writes the batch again, and rows written twice change no
// answer. Until then, a query may see events whose call it does not list
// yet.
func (s *Store) Write(ctx context.Context, b projections.Batch) error {
	r := make(tableRows, len(tables))
	for i := range b.Events {
		if err := eventRows(r, b.Events[i]); err != nil {
			return s.wrap("write", err)
		}
	}
	for i := range b.Actions {
		if err := actionRows(r, b.Actions[i].Action); err != nil {
			return s.wrap("write", err)
		}
	}
	// The tables are independent: insert into them at once, each on a
	// connection of its own, so that the server works on them together.
	g, gctx := errgroup.WithContext(ctx)
	for _, t := range tables {
		g.Go(func() error { return s.insert(gctx, t, r[t.name]) })
	}
	if err := g.Wait(); err != nil {
		return err
	}
	return s.RecordEnds(ctx, b.Ends)
}

// RecordEnds records ends as where the projection's records end, as
// Write does after a batch's rows: for a command that moves the
// projector's group past records it will never project (skip-deleted),
// or that filled the tables without a projector (a rebuild's replay).
// Positions keeps the highest end of each partition.
func (s *Store) RecordEnds(ctx context.Context, ends []projections.End) error {
	now := dateTime(time.Now())
	rows := make([][]any, 0, len(ends))
	for _, e := range ends {
		rows = append(rows, []any{e.Topic, e.Partition, e.Next, now})
	}
	return s.insert(ctx, positionsTable, rows)
}

// Positions says where the projection's records end, per partition
// (projections.Positioned): the highest end recorded for it. A partition
// no batch of this schema version was written for is not in it.
func (s *Store) Positions(ctx context.Context) (projections.Positions, error) {
	rows, err := s.conn.Query(ctx, "SELECT topic, partition, max(next_offset) FROM "+s.table(positionsTable.name)+" GROUP BY topic, partition")
	if err != nil {
		return nil, s.wrap("read positions", err)
	}
	defer rows.Close()
	out := make(projections.Positions)
	for rows.Next() {
		var (
			topic     string
			partition int32
			next      int64
		)
		if err := rows.Scan(&topic, &partition, &next); err != nil {
			return nil, s.wrap("read positions", err)
		}
		out.Set(topic, partition, next)
	}
	if err := rows.Err(); err != nil {
		return nil, s.wrap("read positions", err)
	}
	return out, nil
}

// insert sends rows to t in one batch.
func (s *Store) insert(ctx context.Context, t tableDef, rows [][]any) error {
	if len(rows) == 0 {
		return nil
	}
	batch, err := s.conn.PrepareBatch(ctx, "INSERT INTO "+s.table(t.name)+" ("+strings.Join(t.cols, ", ")+")")
	if err != nil {
		return s.wrap("prepare insert into "+t.name, err)
	}
	defer batch.Abort()
	for _, row := range rows {
		if err := batch.Append(row...); err != nil {
			return s.wrap("append to "+t.name, err)
		}
	}
	if err := batch.Send(); err != nil {
		return s.wrap(fmt.Sprintf("insert %d rows into %s", len(rows), t.name), err)
	}
	return nil
}
