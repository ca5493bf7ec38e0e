-- Execution records: the exactly-once dedupe record of every call, and its
-- transactional outbox. Applied by Store.Migrate; every statement is
-- idempotent. The same DDL runs on PostgreSQL and CockroachDB.
--
-- {table}, {lease_index}, {unlogged_index}, {status_index},
-- {tenant_status_index}, {journal} and {journal_index} are replaced by Migrate with the (schema-qualified)
-- names, {statuses} with the quoted list of processors.Statuses,
-- {listed_statuses} with that of the statuses ByStatus serves through an
-- index. Migrate then drops the indexes older
-- builds created in their place (pgstore.obsoleteIndexes). Statements
-- end with ";" at the end of a line: Migrate runs them one by one, and
-- only those whose object is missing. An index's statement must read
-- "CREATE INDEX IF NOT EXISTS {name} ON {table}": Migrate recognises it
-- so, and on PostgreSQL makes it CONCURRENTLY for a table that exists.
--
-- Integers are BIGINT everywhere: CockroachDB's INT is 64-bit, PostgreSQL's
-- is 32-bit; BIGINT means the same on both.
CREATE TABLE IF NOT EXISTS {table} (
    tenant_id       TEXT        NOT NULL,
    idempotency_key TEXT        NOT NULL,
    call_id         TEXT        NOT NULL,
    arguments_hash  TEXT        NOT NULL,
    tool            TEXT        NOT NULL,
    tool_version    BIGINT      NOT NULL,
    arguments       BYTEA,
    deadline_at     TIMESTAMPTZ,
    status          TEXT        NOT NULL,
    -- Fencing token: +1 on every claim; Complete must present it.
    epoch           BIGINT      NOT NULL DEFAULT 0,
    attempt         BIGINT      NOT NULL DEFAULT 0,
    lease_owner     TEXT        NOT NULL DEFAULT '',
    lease_until     TIMESTAMPTZ,
    result          BYTEA,
    seq             BIGINT      NOT NULL DEFAULT 0,
    logged_seq      BIGINT      NOT NULL DEFAULT 0,
    outbox          BYTEA,
    created_at      TIMESTAMPTZ NOT NULL,
    updated_at      TIMESTAMPTZ NOT NULL,
    -- The verified user the call was admitted for: another user's
    -- admission under the key is a conflict, never a retry. '' for an
    -- identity without a user, and in the rows of older builds.
    user_id         TEXT        NOT NULL DEFAULT '',
    -- The per-call credential as the claims named it (never the token),
    -- written with each claim, so that the claim that takes the call
    -- after its lease ran out learns what may have reached the tool: the
    -- call's jti, the first claim's that named one and kept after it,
    -- and the latest claim's family. '' for none, and in the rows of
    -- older builds.
    jti             TEXT        NOT NULL DEFAULT '',
    credential_family TEXT      NOT NULL DEFAULT '',
    -- How many times an executor of the call's compensation found the
    -- call undoable before sending the undo (MarkUndo); every move
    -- compares it, as it does seq, so that a move decided before the
    -- undo started does not apply. 0 in the rows of older builds.
    undo_marks      BIGINT      NOT NULL DEFAULT 0,
    -- The families of the claims whose lease lapsed (their owners died
    -- or stalled, and may have sent requests under them), in the order
    -- they lapsed, each once: a claim that takes the call over adds the
    -- family the record named, so that one owner dying after another
    -- loses neither's (see processors.Record.LapsedFamilies). Empty in
    -- the rows of older builds.
    lapsed_families TEXT[]      NOT NULL DEFAULT ARRAY[]::TEXT[],
    -- The digest of the tool's definition the call was admitted under
    -- (schemas.Tool.Digest): the definition every process acting on the
    -- call must hold. '' in the rows of older builds: binds nothing.
    tool_digest     TEXT        NOT NULL DEFAULT '',
    -- What the reconcilers noted while the call's status lookups did not
    -- answer (processors.Unanswered): the seq it is of (stale once the
    -- call moved on), the end of the first failing round, and whether the
    -- tool said meanwhile that the call is in progress. 0, NULL, false
    -- for none, and in the rows of older builds.
    unanswered_seq         BIGINT      NOT NULL DEFAULT 0,
    unanswered_since       TIMESTAMPTZ,
    unanswered_in_progress BOOLEAN     NOT NULL DEFAULT false,
    -- The dedupe rests on this key, not on the isolation level: two
    -- admissions of one call cannot both insert.
    PRIMARY KEY (tenant_id, idempotency_key),
    -- A table created by an older build has an older list here: Migrate
    -- replaces the constraint when its list differs from processors.Statuses.
    CONSTRAINT execution_records_status CHECK (status IN ({statuses}))
);

-- Columns added after the table's first release, for tables an older
-- build created. Each statement must read "ALTER TABLE {table} ADD COLUMN
-- IF NOT EXISTS <column>": Migrate runs it only when readSchema finds the
-- column missing, since PostgreSQL takes the table's ACCESS EXCLUSIVE lock
-- before it looks (waiting for every open transaction on the table, with
-- every later one queued behind it), even when the column exists. A
-- constant DEFAULT makes the ADD a catalog change on PostgreSQL (11 and
-- later: no rewrite) and an online schema change on CockroachDB.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS user_id TEXT NOT NULL DEFAULT '';

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS jti TEXT NOT NULL DEFAULT '';

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS credential_family TEXT NOT NULL DEFAULT '';

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS undo_marks BIGINT NOT NULL DEFAULT 0;

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS lapsed_families TEXT[] NOT NULL DEFAULT ARRAY[]::TEXT[];

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS tool_digest TEXT NOT NULL DEFAULT '';

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS unanswered_seq BIGINT NOT NULL DEFAULT 0;

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS unanswered_since TIMESTAMPTZ;

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS unanswered_in_progress BOOLEAN NOT NULL DEFAULT false;

-- Expired: executing records whose lease ended, oldest first. Partial, so
-- that it holds only the calls in flight: every update of a row writes
-- an entry into each index whose predicate the new row version meets
-- (no update here can be HOT, the indexed columns change), and a full
-- (status, lease_until) index took one entry per update of every call.
-- The query names the status as a literal, so both engines match the
-- predicate. On a large CockroachDB cluster, hash-shard it (USING HASH)
-- if its ever-increasing lease_until concentrates writes on one range.
CREATE INDEX IF NOT EXISTS {lease_index} ON {table} (lease_until) WHERE status = 'executing';

-- ByStatus: the records in one of the listed statuses (the ones the
-- approval queue, its expiry and the reconciler list), oldest update
-- first. Partial for the same reason as {lease_index}: the statuses every
-- call passes through or ends in (authorized, executing, succeeded,
-- failed, denied) are left out, so a call's hot path writes no entry
-- here. ByStatus of a status outside the list is answered by a scan.
-- Added to existing tables by the next Migrate: on PostgreSQL built
-- CONCURRENTLY (writes go on, the build reads the table twice and waits
-- for the transactions open when it starts); on CockroachDB it is an
-- online schema change.
CREATE INDEX IF NOT EXISTS {status_index} ON {table} (status, updated_at) WHERE status IN ({listed_statuses});

-- TenantByStatus: one tenant's records in one of the listed statuses, in
-- ByStatus's order (with the tenant fixed: updated_at, then the key). The
-- tenant first, so that a tenant's approval queue reads its own entries
-- only: through {status_index} it read, and filtered out, every other
-- tenant's entry older than its own, unbounded when one tenant has a
-- million calls pending. Partial with {status_index}'s predicate, for the
-- same reason. idempotency_key completes the ORDER BY, so that PostgreSQL
-- needs no sort; CockroachDB appends the primary key's columns to every
-- secondary index anyway, so there it changes nothing. Added to existing
-- tables by the next Migrate, as {status_index} was.
CREATE INDEX IF NOT EXISTS {tenant_status_index} ON {table} (tenant_id, status, updated_at, idempotency_key) WHERE status IN ({listed_statuses});

-- Unlogged: records whose outbox may be missing from the log, oldest
-- update first. Partial, so that it holds only the few rows between a
-- step's commit and its MarkLogged (or those a failed Kafka transaction
-- left behind), not every call ever made; the query repeats the predicate
-- so that both engines can use it. The query also leaves out executing
-- records, as a filter outside the predicate: an index an older build
-- created (same name, same predicate) serves as it is. PostgreSQL and CockroachDB (20.2 and
-- later) accept partial indexes.
CREATE INDEX IF NOT EXISTS {unlogged_index} ON {table} (updated_at) WHERE logged_seq < seq;

-- Journal entries (processors.Completion.Journal): the completions of one
-- batch recorded as logged before their events reach the log, until the
-- executor settles the entry (deletes it) after its Kafka transaction.
-- One row per batch replaces a write per call. Rows live for a step's
-- transaction, so the table stays small; an entry whose writer died is
-- settled by Unlogged once older than its olderThan, through
-- {journal_index}. The calls are parallel arrays, one element per
-- completion: tenant, key, epoch, seq and the seq it was claimed at. On a
-- large CockroachDB cluster, hash-shard {journal_index} (USING HASH) if its
-- ever-increasing created_at concentrates writes on one range.
CREATE TABLE IF NOT EXISTS {journal} (
    id               TEXT        PRIMARY KEY,
    created_at       TIMESTAMPTZ NOT NULL,
    tenant_ids       TEXT[]      NOT NULL,
    idempotency_keys TEXT[]      NOT NULL,
    epochs           BIGINT[]    NOT NULL,
    seqs             BIGINT[]    NOT NULL,
    from_seqs        BIGINT[]    NOT NULL
);

CREATE INDEX IF NOT EXISTS {journal_index} ON {journal} (created_at);

-- Rate limits (processors.RateLimiter): one row per bucket, e.g.
-- "<tenant>/<tool>/<limit>/<policy id>", holding GCRA's theoretical
-- arrival time: when the bucket will be full again. A row whose tat is in
-- the past means the same as no row, so rows may be deleted when
-- tat < now() at any time: the intakes do, once a minute, a thousand at
-- a time while there are more (Store.PruneRates), for limits by user or
-- by agent make a bucket per user or agent. {rate_limits} is replaced like {table}.
CREATE TABLE IF NOT EXISTS {rate_limits} (
    bucket TEXT        PRIMARY KEY,
    tat    TIMESTAMPTZ NOT NULL
);
