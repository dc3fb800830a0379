-- Whether every shard records the map (processed.Sharded). A first use
-- records the map shard by shard, each as not complete, and marks the
-- records complete once every shard holds one: so a shard without a record
-- beside complete ones is a database that was replaced (its dedup rows
-- gone), while records that are not complete are a first use under way, or
-- one a crash interrupted, which the next process finishes. Records made
-- before this migration are taken as complete, as they were then; a record
-- inserted by a process of an earlier version, still running, is not.
ALTER TABLE {{schema}}.{{shard_map_table}} ADD COLUMN complete boolean NOT NULL DEFAULT true;
ALTER TABLE {{schema}}.{{shard_map_table}} ALTER COLUMN complete SET DEFAULT false;
