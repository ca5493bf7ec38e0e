-- control_actions gains policy_hash: the content a policy activation pins
-- ("sha256:" and 64 hex digits; empty for one that names a label alone,
-- and for every other action). Rows projected before keep it empty.
-- ClickHouse 18.16 has no ADD COLUMN IF NOT EXISTS: Migrate skips an ADD
-- COLUMN whose column exists, so that running this again (a Migrate that
-- failed after it, or two at once) is harmless.
ALTER TABLE {db}.control_actions ADD COLUMN policy_hash String DEFAULT ''
