-- The lookup orders of blast radius: one row per reference an event
-- carries (kind jti, credential_family, approver, approval_id, and
-- policy_version for decision events, with the decision), plus a
-- 'requested' row per call, valued with its tenant, for questions by
-- tenant, tool and time alone. A lookup by kind and value, over a window,
-- is a range of the sort key. Refusals have no rows here.
-- (006 adds the kinds call_id and trace_id, on every event. The kind
-- role, a role the caller's assertion gave the policies, on decision
-- events with the decision, needs no schema of its own: calls decided
-- before the projector wrote it have no such rows until a rebuild.)
CREATE TABLE IF NOT EXISTS {db}.call_refs
(
    kind            String,
    value           String,
    at              DateTime,
    tenant_id       String,
    idempotency_key String,
    event_id        String,
    tool            String,
    decision        String,
    seq             Int64
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(at)
ORDER BY (kind, value, at, tenant_id, idempotency_key, event_id)
