-- The shard key in the dedup key (Config.ShardKeyInPrimaryKey), for a
-- distributed Postgres (Citus) that distributes the table by shard_key,
-- co-located with business tables distributed by the same key: every
-- unique index of a distributed table must hold its distribution column.
-- The primary key becomes (consumer, shard_key, message_id); an id is then
-- unique per consumer and key. Lookups by id (Lookup, the dead-letter dry
-- run, a reshard's look at the old shard) read the index on (consumer,
-- message_id). Rows claimed without a key (by a store of one database)
-- get the empty key.
UPDATE {{table}} SET shard_key = '' WHERE shard_key IS NULL;
ALTER TABLE {{table}} ALTER COLUMN shard_key SET DEFAULT '', ALTER COLUMN shard_key SET NOT NULL;
DO $$
DECLARE
    pk text;
BEGIN
    SELECT conname INTO pk FROM pg_constraint WHERE conrelid = '{{table}}'::regclass AND contype = 'p';
    EXECUTE format('ALTER TABLE {{table}} DROP CONSTRAINT %I, ADD PRIMARY KEY (consumer, shard_key, message_id)', pk);
END
$$;
CREATE INDEX {{consumer_id_index}} ON {{table}} (consumer, message_id);
