-- Where the projection's records end, per partition of the events and
-- control topics: Write adds a row for each partition of a batch after
-- the batch's rows, so the projection holds every record before
-- next_offset. The projector compares it with its consumer group's
-- committed offsets, and reads again what a database restored from an
-- older backup lacks. Rows pile up, one a partition a batch, until
-- merges keep the highest of each partition; readers take max().
CREATE TABLE IF NOT EXISTS {db}.projection_positions
(
    topic       String,
    partition   Int32,
    next_offset Int64,
    written_at  DateTime
)
ENGINE = ReplacingMergeTree(next_offset)
ORDER BY (topic, partition)
