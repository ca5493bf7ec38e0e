-- The latest state of every call: one row per event (refusals excepted)
-- with the fields of projections.CallOf; merges keep the highest seq per
-- call. Queries take argMax(..., seq) per call, so they are right before
-- any merge too. Not partitioned: a call's events may span months, and a
-- ReplacingMergeTree collapses rows only within a partition.
CREATE TABLE IF NOT EXISTS {db}.calls
(
    tenant_id         String,
    idempotency_key   String,
    seq               Int64,
    event_id          String,
    call_id           String,
    tool              String,
    tool_version      Int64,
    agent_id          String,
    user_id           String,
    resource          String,
    trace_id          String,
    state             String,
    last_event        String,
    updated_at        DateTime,
    updated_at_ns     UInt32,
    policy_version    String,
    approver          String,
    approval_id       String,
    jti               String,
    credential_family String,
    reason            String,
    error_code        String
)
ENGINE = ReplacingMergeTree(seq)
ORDER BY (tenant_id, idempotency_key)
