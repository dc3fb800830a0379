-- The shard key of a claim a sharded store made (processed.Sharded): the
-- key its map placed the message by, so that a reshard can move the rows of
-- the keys that change shard (Sharded.MoveRows). NULL for a store of one
-- database. On the partitioned layout every generation gets it, and the
-- view shows it.
DO $$
BEGIN
    IF to_regclass('{{schema}}.{{g0}}') IS NOT NULL THEN
        ALTER TABLE {{schema}}.{{g0}} ADD COLUMN shard_key text;
        ALTER TABLE {{schema}}.{{g1}} ADD COLUMN shard_key text;
        ALTER TABLE {{schema}}.{{g2}} ADD COLUMN shard_key text;
        ALTER TABLE {{schema}}.{{g3}} ADD COLUMN shard_key text;
        CREATE OR REPLACE VIEW {{table}} AS
            SELECT * FROM {{schema}}.{{g0}}
            UNION ALL SELECT * FROM {{schema}}.{{g1}}
            UNION ALL SELECT * FROM {{schema}}.{{g2}}
            UNION ALL SELECT * FROM {{schema}}.{{g3}};
    ELSE
        ALTER TABLE {{table}} ADD COLUMN shard_key text;
    END IF;
END
$$;
