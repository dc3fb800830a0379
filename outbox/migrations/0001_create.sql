-- The outbox: one row per outgoing message, written in the producer's
-- transaction and delivered by a relay.
CREATE TABLE {{table}} (
    seq             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination     text        NOT NULL CHECK (destination <> ''),
    message_id      text        NOT NULL CHECK (message_id <> ''),
    key             text        NOT NULL DEFAULT '',
    headers         jsonb       NOT NULL DEFAULT '{}',
    body            bytea       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz,
    last_error      text
);

-- Enqueue is idempotent per destination and message id.
CREATE UNIQUE INDEX {{id_index}} ON {{table}} (destination, message_id);

-- The relay's poll: due rows not yet sent.
CREATE INDEX {{pending_index}} ON {{table}} (next_attempt_at, seq) WHERE sent_at IS NULL;

-- Purge: sent rows by age.
CREATE INDEX {{sent_index}} ON {{table}} (sent_at) WHERE sent_at IS NOT NULL;
