package processed_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/processed"
)

// A process that starts while one shard is down claims on the others,
// whose records say they are this map's; on the shard that is down its
// claims fail until it answers. Another map, or a reshard, is refused or
// waits as before: it needs every shard's record.
func TestShardedStartsWithAShardDown(t *testing.T) {
	t.Parallel()
	dbs := newShardDBs(t, 3)
	migratedSharded(t, stores(dbs[:2]), processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	dead, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/test?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	defer dead.Close()
	down, err := processed.New(dead, processed.Config{Schema: dbs[1].schema})
	if err != nil {
		t.Fatal(err)
	}
	on := func(s *processed.Sharded, shard int, id string) error {
		c := claimOf("ledger", id, "x")
		c.Route = dedup.Route{Shard: shard, Was: shard, Key: "k"}
		tx, _, err := s.BeginClaim(ctx(t), []dedup.Claim{c})
		if tx != nil {
			if err == nil {
				err = tx.Commit(ctx(t))
			}
			_ = tx.Rollback(ctx(t))
		}
		return err
	}
	s, err := processed.NewSharded([]*processed.Store{dbs[0].store, down}, processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b"} {
		if err := on(s, 0, id); err != nil {
			t.Fatalf("claim %s on shard 0 with shard 1 down: %v", id, err)
		}
	}
	if err := on(s, 1, "c"); err == nil {
		t.Fatal("a claim on the shard that is down succeeded")
	}

	other, err := processed.NewSharded([]*processed.Store{dbs[0].store, down}, processed.ShardedConfig{Map: processed.ShardMap{Name: "tenant", Shards: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if err := on(other, 0, "d"); err == nil {
		t.Fatal("a store of another map claimed on shard 0")
	}
	resharding, err := processed.NewSharded([]*processed.Store{dbs[0].store, down, dbs[2].store}, processed.ShardedConfig{
		Map: processed.ShardMap{Shards: 3}, Previous: &processed.ShardMap{Shards: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if err := on(resharding, 0, "e"); err == nil || errors.Is(err, processed.ErrShardMapChanged) {
		t.Fatalf("a reshard with a shard down: %v, want the shard's error", err)
	}
}
