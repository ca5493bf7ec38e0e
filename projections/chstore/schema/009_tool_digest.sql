-- events and calls gain tool_digest: the digest of the tool definition a
-- call was admitted under (ledger.Event.ToolDigest), carried by every
-- event of the call. Rows projected before keep it empty: their events
-- carry none. ClickHouse 18.16 has no ADD COLUMN IF NOT EXISTS: Migrate
-- skips an ADD COLUMN whose column exists.
ALTER TABLE {db}.events ADD COLUMN tool_digest String DEFAULT '';

ALTER TABLE {db}.calls ADD COLUMN tool_digest String DEFAULT ''
