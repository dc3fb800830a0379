-- One row per (scope, idempotency key): the claim while the request runs,
-- then the stored response.
CREATE TABLE {{table}} (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    fingerprint  bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    method       text        NOT NULL,
    path         text        NOT NULL,
    state        text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    lock_token   text,
    locked_until timestamptz,
    takeovers    integer     NOT NULL DEFAULT 0,
    status       integer,
    headers      jsonb,
    body         bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    PRIMARY KEY (scope, key)
);

-- Purge deletes by age.
CREATE INDEX {{created_at_index}} ON {{table}} (created_at);
