-- The dedup table: one row per (consumer, message id) that was applied.
CREATE TABLE {{table}} (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    fingerprint  bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     bigint,
    PRIMARY KEY (consumer, message_id)
);

-- Purge deletes by age.
CREATE INDEX {{processed_at_index}} ON {{table}} (processed_at);
