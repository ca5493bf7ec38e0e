package callindex

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// The kinds of reference refs indexes, as its keys name them.
const (
	refJTI      = "jti"
	refFamily   = "credential_family"
	refPolicy   = "policy_version"
	refRole     = "role"
	refApprover = "approver"
	refApproval = "approval_id"
	refCallID   = "call_id"
	refTraceID  = "trace_id"
	// refToolDigest is on a call's requested event alone
	// (projections.AdmittedUnder).
	refToolDigest = "tool_digest"
)

// maxRefValue bounds a value as a refs key spells it: a longer one is
// indexed under its hash, which keeps every key within bbolt's limit.
const maxRefValue = 512

// refs returns the references e carries, as (kind, value) pairs.
func refs(e *ledger.Event) [][2]string {
	var out [][2]string
	add := func(kind, v string) {
		if v != "" {
			out = append(out, [2]string{kind, v})
		}
	}
	add(refJTI, e.JTI)
	add(refFamily, e.CredentialFamily)
	for _, f := range e.EarlierCredentialFamilies {
		add(refFamily, f)
	}
	if projections.PolicyDecision(e.Decision) && e.PolicyVersion != "" {
		add(refPolicy, e.PolicyVersion)
		for _, role := range e.Roles {
			add(refRole, role)
		}
	}
	add(refApprover, e.Approver)
	add(refApproval, e.ApprovalID)
	add(refCallID, e.CallID)
	add(refTraceID, e.TraceID)
	if projections.AdmittedUnder(e, e.ToolDigest) {
		add(refToolDigest, e.ToolDigest)
	}
	return out
}

// refPrefix is the start of the refs keys of kind and value, and of
// tenant unless all.
func refPrefix(kind, value, tenant string, all bool) []byte {
	if len(value) > maxRefValue {
		sum := sha256.Sum256([]byte(value))
		value = "sha256:" + hex.EncodeToString(sum[:])
	}
	b := make([]byte, 0, len(kind)+len(value)+len(tenant)+3)
	b = append(append(append(b, kind...), 0), value...)
	b = append(b, 0)
	if !all {
		b = append(append(b, tenant...), 0)
	}
	return b
}

// unresolvedPrefix is the start of the unresolved keys of tenant, or of
// every key when all.
func unresolvedPrefix(tenant string, all bool) []byte {
	if all {
		return nil
	}
	return append([]byte(tenant), 0)
}

// index keeps refs and unresolved in step with call c, stored under k,
// whose events added are new.
func index(tx *bolt.Tx, k string, c *Call, added []ledger.Event) error {
	rb := tx.Bucket(bucketRefs)
	for i := range added {
		e := &added[i]
		for _, r := range refs(e) {
			key := append(refPrefix(r[0], r[1], e.TenantID, false), e.IdempotencyKey...)
			if err := rb.Put(key, []byte(k)); err != nil {
				return fmt.Errorf("index %s of %s: %w", r[0], k, err)
			}
		}
	}
	latest, ok := c.latest()
	if !ok {
		return nil
	}
	ub := tx.Bucket(bucketUnresolved)
	key := append(unresolvedPrefix(latest.TenantID, false), latest.IdempotencyKey...)
	var err error
	if latest.Unresolved() {
		err = ub.Put(key, []byte(k))
	} else {
		err = ub.Delete(key)
	}
	if err != nil {
		return fmt.Errorf("index %s as unresolved: %w", k, err)
	}
	return nil
}

// actionKey is where an action is kept: its place on the control topic,
// and its subject, so that a record delivered twice is kept once.
func actionKey(a projections.Action) []byte {
	b := make([]byte, 12, 12+len(a.Action.Subject))
	binary.BigEndian.PutUint32(b, uint32(a.Partition))
	binary.BigEndian.PutUint64(b[4:], uint64(a.Offset))
	return append(b, a.Action.Subject...)
}

// Trace returns the events under key: the refused submissions by time,
// at most MaxRefusals of them (the earliest and the latest), then the
// call's events in seq order. A trace holding MaxRefusals refusals may
// leave those between out (the
// query API says so, httpapi.HeaderRefusalsLimitReached); how many is not
// told, as Call.RefusalsDropped counts a dropped refusal delivered again
// once more.
func (ix *Index) Trace(ctx context.Context, key ledger.CallKey) ([]ledger.Event, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	c, err := ix.Get(key)
	if err != nil {
		return nil, fmt.Errorf("trace %s: %w", key, err)
	}
	if len(c.Refusals) == 0 && len(c.Events) == 0 {
		return nil, fmt.Errorf("trace %s: %w", key, ErrNotFound)
	}
	out := make([]ledger.Event, 0, len(c.Refusals)+len(c.Events))
	out = append(out, c.Refusals...)
	// Sorted as kept; files written before kept them as they came.
	slices.SortFunc(out, projections.CompareRefusals)
	return append(out, c.Events...), nil
}

// BlastRadius returns the calls matching f (see the projections package
// doc) and what they add up to. A filter naming a reference reads only
// the calls refs lists under it.
func (ix *Index) BlastRadius(ctx context.Context, f projections.Filter) (projections.BlastRadius, error) {
	f, err := f.Check()
	if err != nil {
		return projections.BlastRadius{}, err
	}
	var calls []projections.Call
	err = ix.db.View(func(tx *bolt.Tx) error {
		return eachCandidate(ctx, tx, f, func(c *Call) {
			if !matches(f, c.Events) {
				return
			}
			// The state narrows on the call as it is now.
			if latest, ok := c.latest(); ok && (f.State == "" || latest.State == f.State) {
				calls = append(calls, latest)
			}
		})
	})
	if err != nil {
		return projections.BlastRadius{}, fmt.Errorf("blast radius: %w", err)
	}
	return projections.Summarize(f, calls), nil
}

// eachCandidate calls fn with every call that may match f, each once:
// the calls refs lists under the most selective reference f names, or
// else the tenant's calls (every call across tenants).
func eachCandidate(ctx context.Context, tx *bolt.Tx, f projections.Filter, fn func(c *Call)) error {
	calls := tx.Bucket(bucketCalls)
	load := func(k, raw []byte) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		var c Call
		if err := json.Unmarshal(raw, &c); err != nil {
			return fmt.Errorf("call %s: %w", k, err)
		}
		fn(&c)
		return nil
	}
	var kind, value string
	for _, r := range [][2]string{
		{refCallID, f.CallID}, {refApproval, f.ApprovalID}, {refJTI, f.JTI}, {refTraceID, f.TraceID}, {refToolDigest, f.ToolDigest},
		{refFamily, f.CredentialFamily}, {refApprover, f.Approver}, {refRole, f.Role}, {refPolicy, f.PolicyVersion},
	} {
		if r[1] != "" {
			kind, value = r[0], r[1]
			break
		}
	}
	if kind == "" {
		return scan(calls, tenantPrefix(f.Tenant, f.AllTenants), load)
	}
	// A value with a NUL in it can make one call appear twice under a
	// prefix: read each once.
	seen := make(map[string]bool)
	visit := func(_, k []byte) error {
		if seen[string(k)] {
			return nil
		}
		seen[string(k)] = true
		raw := calls.Get(k)
		if raw == nil {
			return fmt.Errorf("%s %q lists call %s, which is not in the index", kind, value, k)
		}
		return load(k, raw)
	}
	refs := tx.Bucket(bucketRefs)
	if err := scan(refs, refPrefix(kind, value, f.Tenant, f.AllTenants), visit); err != nil {
		return err
	}
	if kind != refPolicy || strings.Contains(value, "@") {
		return nil
	}
	// A policy label: its versions label@hash too, every tenant's under
	// one prefix (matches checks each call's tenant).
	label := []byte(kind + "\x00" + value + "@")
	of := tenantPrefix(f.Tenant, f.AllTenants)
	return scan(refs, label, func(rk, k []byte) error {
		if !bytes.HasPrefix(k, of) {
			return nil
		}
		return visit(rk, k)
	})
}

// tenantPrefix is the start of tenant's keys in calls, or of every key
// when all.
func tenantPrefix(tenant string, all bool) []byte {
	if all {
		return nil
	}
	return []byte(tenant + "/")
}

// scan calls fn with every key and value of b that starts with prefix.
func scan(b *bolt.Bucket, prefix []byte, fn func(k, v []byte) error) error {
	cur := b.Cursor()
	for k, v := cur.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, v = cur.Next() {
		if err := fn(k, v); err != nil {
			return err
		}
	}
	return nil
}

// narrows reports whether e is of f's tenant and tool, where f names them.
func narrows(f projections.Filter, e *ledger.Event) bool {
	return (f.Tenant == "" || e.TenantID == f.Tenant) && (f.Tool == "" || e.Tool == f.Tool)
}

// matches reports whether the call with events evs carries what f
// references, as the projections package doc says; the state is
// BlastRadius's to check.
func matches(f projections.Filter, evs []ledger.Event) bool {
	carried := func(carries func(e *ledger.Event) bool) bool {
		for i := range evs {
			e := &evs[i]
			if carries(e) && narrows(f, e) && f.InWindow(e.At) {
				return true
			}
		}
		return false
	}
	if !f.References() {
		return carried(func(e *ledger.Event) bool { return e.Seq == 1 && e.Type == statemachine.EventRequested })
	}
	return (f.JTI == "" || carried(func(e *ledger.Event) bool { return e.JTI == f.JTI })) &&
		(f.CredentialFamily == "" || carried(func(e *ledger.Event) bool { return e.NamesFamily(f.CredentialFamily) })) &&
		(f.PolicyVersion == "" || carried(func(e *ledger.Event) bool {
			return projections.PolicyDecision(e.Decision) && projections.PolicyVersionMatches(f.PolicyVersion, e.PolicyVersion) &&
				(f.Decision == "" || e.Decision == f.Decision)
		})) &&
		(f.Role == "" || carried(func(e *ledger.Event) bool {
			return projections.RoleDecided(e, f.Role) && (f.Decision == "" || e.Decision == f.Decision)
		})) &&
		(f.Approver == "" || carried(func(e *ledger.Event) bool { return e.Approver == f.Approver })) &&
		(f.ApprovalID == "" || carried(func(e *ledger.Event) bool { return e.ApprovalID == f.ApprovalID })) &&
		(f.CallID == "" || carried(func(e *ledger.Event) bool { return e.CallID == f.CallID })) &&
		(f.TraceID == "" || carried(func(e *ledger.Event) bool { return e.TraceID == f.TraceID })) &&
		(f.ToolDigest == "" || carried(func(e *ledger.Event) bool { return projections.AdmittedUnder(e, f.ToolDigest) }))
}

// Outcomes counts the calls that reached each outcome, by bucket of the
// outcome event's time and its tool. It reads the tenant's calls (every
// call across tenants).
func (ix *Index) Outcomes(ctx context.Context, f projections.Filter, bucket time.Duration) ([]projections.OutcomeCount, error) {
	// The index has no clock of its own: an open window is bounded at
	// the time of asking.
	f, err := projections.CheckOutcomes(f, bucket, time.Now())
	if err != nil {
		return nil, err
	}
	type cell struct {
		bucket int64
		tool   string
		state  statemachine.State
	}
	counts := make(map[cell]int)
	err = ix.db.View(func(tx *bolt.Tx) error {
		return eachCandidate(ctx, tx, f, func(c *Call) {
			// A call counts once per cell, however many of its events
			// fall in it.
			cells := make(map[cell]bool)
			for i := range c.Events {
				e := &c.Events[i]
				if !slices.Contains(projections.OutcomeEvents, e.Type) || !narrows(f, e) || !f.InWindow(e.At) {
					continue
				}
				state, _ := statemachine.Target(e.Type)
				cells[cell{projections.BucketOf(e.At, bucket).Unix(), e.Tool, state}] = true
			}
			for k := range cells {
				counts[k]++
			}
		})
	})
	if err != nil {
		return nil, fmt.Errorf("outcomes: %w", err)
	}
	out := make([]projections.OutcomeCount, 0, len(counts))
	for k, n := range counts {
		out = append(out, projections.OutcomeCount{Bucket: time.Unix(k.bucket, 0).UTC(), Tool: k.tool, State: k.state, Calls: n})
	}
	projections.SortOutcomes(out)
	return out, nil
}

// Unresolved returns the calls that wait on someone, oldest first, the
// first f.Limit of them. It reads the calls unresolved lists.
func (ix *Index) Unresolved(ctx context.Context, f projections.Filter) ([]projections.Call, error) {
	f, err := projections.CheckUnresolved(f)
	if err != nil {
		return nil, err
	}
	out := []projections.Call{}
	err = ix.db.View(func(tx *bolt.Tx) error {
		calls := tx.Bucket(bucketCalls)
		return scan(tx.Bucket(bucketUnresolved), unresolvedPrefix(f.Tenant, f.AllTenants), func(_, k []byte) error {
			if err := ctx.Err(); err != nil {
				return err
			}
			raw := calls.Get(k)
			if raw == nil {
				return fmt.Errorf("unresolved lists call %s, which is not in the index", k)
			}
			var c Call
			if err := json.Unmarshal(raw, &c); err != nil {
				return fmt.Errorf("call %s: %w", k, err)
			}
			latest, ok := c.latest()
			if ok && latest.Unresolved() && (f.Tenant == "" || latest.TenantID == f.Tenant) && (f.Tool == "" || latest.Tool == f.Tool) {
				out = append(out, latest)
			}
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("unresolved: %w", err)
	}
	projections.SortUnresolved(out)
	if len(out) > f.Limit {
		out = out[:f.Limit]
	}
	return out, nil
}
