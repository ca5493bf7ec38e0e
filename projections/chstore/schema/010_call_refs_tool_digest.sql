-- call_refs gains the kind tool_digest: Write adds a row for each
-- requested event that names the tool definition its call was admitted
-- under (projections.AdmittedUnder), so that blast radius finds the calls
-- of one definition. No DDL: this fills them in for the requested events
-- projected before (by a build that kept tool_digest in events but did
-- not index it), as Write would have. Running it again (a Migrate that
-- failed after it) only adds rows that merges collapse and queries ignore
-- (they group by call).
INSERT INTO {db}.call_refs (kind, value, at, tenant_id, idempotency_key, event_id, tool, decision, seq)
SELECT 'tool_digest', tool_digest, at, tenant_id, idempotency_key, event_id, tool, '', seq
FROM {db}.events
WHERE seq = 1 AND type = 'requested' AND tool_digest != ''
