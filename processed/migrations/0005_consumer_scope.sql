-- Each consumer's purges are its own. A janitor records here the horizon
-- it purges by (Store.Purge): rows of that consumer processed before
-- purge_before may go. The plain table deletes them; the partitioned
-- layout retires a generation only once every consumer with rows in it
-- has a horizon past the generation's end, so a consumer that never
-- records one keeps its rows until an operator says otherwise (idemq
-- processed purge).
CREATE TABLE {{schema}}.{{horizons_table}} (
    consumer      text        PRIMARY KEY,
    purge_before  timestamptz NOT NULL,
    older_than_ms bigint      NOT NULL,
    recorded_at   timestamptz NOT NULL DEFAULT now()
);

-- Purge deletes one consumer's rows by age. The index has the "C"
-- collation, which only the purge's statement asks for: a claim's probe of
-- (consumer, message_id) can then never pick it over the primary key, as
-- the planner would when the statistics do not know the consumer (the
-- smaller index wins the tie, and the probe reads every row of the
-- consumer).
DROP INDEX IF EXISTS {{schema}}.{{processed_at_index}};
CREATE INDEX {{consumer_processed_at_index}} ON {{table}} (consumer COLLATE "C", processed_at);
