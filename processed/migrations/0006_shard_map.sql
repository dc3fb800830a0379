-- The shard map of a sharded store (processed.Sharded), recorded on each of
-- its shards: which shard this database is, the map its messages are
-- routed by, and, while a reshard is under way, the map before it. A
-- store whose configured map differs is refused, so that no message is
-- routed by two maps at once. A store of one database leaves it empty.
CREATE TABLE {{schema}}.{{shard_map_table}} (
    one          boolean     PRIMARY KEY DEFAULT true CHECK (one),
    shard        integer     NOT NULL CHECK (shard >= 0),
    map          text        NOT NULL,
    previous     text,
    moving_since timestamptz,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    CHECK ((previous IS NULL) = (moving_since IS NULL))
);
