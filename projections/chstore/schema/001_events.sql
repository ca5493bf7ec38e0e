-- Every event, as the log holds it. The sort key starts with tenant, tool
-- and time so that the questions a responder asks (a tenant's tool over a
-- window) are range reads, and ends with the event id so that an event
-- written twice collapses into one row on merge. Queries never rely on the
-- merge: they group by event_id. body is the event's exact wire form
-- (its record's value), what Trace returns.
CREATE TABLE IF NOT EXISTS {db}.events
(
    tenant_id         String,
    tool              String,
    at                DateTime,
    at_ns             UInt32,
    idempotency_key   String,
    seq               Int64,
    event_id          String,
    type              String,
    state             String,
    actor             String,
    call_id           String,
    tool_version      Int64,
    agent_id          String,
    user_id           String,
    resource          String,
    arguments_hash    String,
    trace_id          String,
    policy_version    String,
    decision          String,
    approver          String,
    approval_id       String,
    jti               String,
    credential_family String,
    reason            String,
    error_code        String,
    attempt           Int64,
    latency_ms        Int64,
    body              String
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(at)
ORDER BY (tenant_id, tool, at, idempotency_key, event_id)
