-- Every control record: freezes, unfreezes, revocations and policy
-- activations, with who and why. action_id is a digest of the action, so
-- that a record read twice collapses into one row on merge.
CREATE TABLE IF NOT EXISTS {db}.control_actions
(
    subject   String,
    at        DateTime,
    at_ns     UInt32,
    action_id String,
    kind      String,
    tool      String,
    tenant    String,
    jti       String,
    family    String,
    policy    String,
    by_user   String,
    by_tenant String,
    reason    String
)
ENGINE = ReplacingMergeTree
ORDER BY (subject, at, at_ns, action_id)
