-- What the janitor saw, one row per consumer and janitor interval: the
-- ages of the duplicates the runtime skipped (the evidence for the
-- retention), the source's redelivery horizon, and what it purged.
CREATE TABLE {{schema}}.{{retention_table}} (
    consumer        text        NOT NULL,
    window_start    timestamptz NOT NULL,
    window_end      timestamptz NOT NULL,
    duplicates      bigint      NOT NULL,
    -- Duplicate ages in milliseconds: quantiles are the upper bound of
    -- the histogram bucket they fall in; max is exact.
    p50_ms          bigint,
    p99_ms          bigint,
    p999_ms         bigint,
    max_ms          bigint,
    -- Counts per bucket of the fixed bucket bounds (bucket_bounds_ms).
    buckets         bigint[]    NOT NULL,
    bucket_bounds_ms bigint[]   NOT NULL,
    retention_ms    bigint      NOT NULL,
    -- The oldest time a redelivery could carry, as the source said; NULL
    -- if the source cannot tell or has none.
    horizon         timestamptz,
    horizon_state   text        NOT NULL DEFAULT '',
    -- The age the janitor purged by: the retention, or longer when the
    -- horizon held the purge back; NULL when it did not purge.
    purged_older_than_ms bigint,
    purged          bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, window_end)
);
