-- The shard key in the dedup key (Config.ShardKeyInPrimaryKey), for a
-- distributed Postgres (Citus) that distributes the table by shard_key,
-- co-located with business tables distributed by the same key: every
-- unique index of a distributed table must hold its distribution column.
-- The primary key becomes (consumer, shard_key, message_id); an id is then
-- unique per consumer and key. Lookups by id (Lookup, the dead-letter dry
-- run) read the index on (consumer, message_id).
--
-- A row without a shard key (claimed by a store of one database, or before
-- migration 0007) could never be found again by a claim, which always has
-- one: its message would be applied a second time. So the conversion is
-- refused while there are such rows. The empty key is the default of rows
-- inserted by hand, and counts as none.
DO $$
DECLARE
    n bigint;
    pk text;
BEGIN
    SELECT count(*) INTO n FROM {{table}} WHERE shard_key IS NULL OR shard_key = '';
    IF n > 0 THEN
        RAISE EXCEPTION 'processed: % dedup rows of {{table}} have no shard key, and a claim with one would not find them: set their shard_key to the key your map gives their messages, or purge them, then migrate again', n;
    END IF;
    SELECT conname INTO pk FROM pg_constraint WHERE conrelid = '{{table}}'::regclass AND contype = 'p';
    EXECUTE format('ALTER TABLE {{table}} DROP CONSTRAINT %I, ADD PRIMARY KEY (consumer, shard_key, message_id)', pk);
END
$$;
ALTER TABLE {{table}} ALTER COLUMN shard_key SET DEFAULT '', ALTER COLUMN shard_key SET NOT NULL;
CREATE INDEX {{consumer_id_index}} ON {{table}} (consumer, message_id);
