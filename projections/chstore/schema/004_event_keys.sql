-- Which tools and times a key's events (refusals included) were written
-- under, so that Trace reads the events table by a range of its sort key
-- (tenant, tool, time) instead of scanning the tenant.
CREATE TABLE IF NOT EXISTS {db}.event_keys
(
    tenant_id       String,
    idempotency_key String,
    tool            String,
    at              DateTime,
    event_id        String
)
ENGINE = ReplacingMergeTree
ORDER BY (tenant_id, idempotency_key, tool, at, event_id)
