-- call_refs gains the kinds call_id and trace_id: Write adds a row of
-- each per event (refusals excepted), valued with the event's call id and
-- trace id, so that blast radius finds a call, or a trace's calls, by
-- them. No DDL: this fills them in for the events projected before, from
-- the events table, as Write would have. Running it again (a Migrate that
-- failed between the two) only adds rows that merges collapse and queries
-- ignore (they group by call).
INSERT INTO {db}.call_refs (kind, value, at, tenant_id, idempotency_key, event_id, tool, decision, seq)
SELECT 'call_id', call_id, at, tenant_id, idempotency_key, event_id, tool, '', seq
FROM {db}.events
WHERE seq != 0 AND call_id != '';

INSERT INTO {db}.call_refs (kind, value, at, tenant_id, idempotency_key, event_id, tool, decision, seq)
SELECT 'trace_id', trace_id, at, tenant_id, idempotency_key, event_id, tool, '', seq
FROM {db}.events
WHERE seq != 0 AND trace_id != ''
