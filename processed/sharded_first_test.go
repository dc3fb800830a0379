package processed_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

// Processes that start together on shards no map was recorded on all
// start: while one records the map shard by shard, another that reads the
// records in between must not take the shards not yet recorded for
// databases that were replaced.
func TestEdgeShardedFirstUseByManyProcesses(t *testing.T) {
	t.Parallel()
	for round := range 10 {
		t.Run(fmt.Sprint(round), func(t *testing.T) { firstUseByMany(t) })
	}
}

// firstUseByMany starts eight processes' stores at once on three shards
// with no map recorded.
func firstUseByMany(t *testing.T) {
	t.Helper()
	dbs := unrecordedShards(t, 3)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for p := range errs {
		s, err := processed.NewSharded(stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[p] = s.Migrate(ctx(t))
		}()
	}
	wg.Wait()
	for p, err := range errs {
		if err != nil {
			t.Fatalf("process %d: %v", p, err)
		}
	}
}

// A process killed while it recorded the map on a first use leaves some
// shards without a record: the next process finishes the record instead
// of taking those shards for databases that were replaced. Once the map
// is complete, a shard that loses its record is refused again.
func TestEdgeShardedFirstUseInterrupted(t *testing.T) {
	t.Parallel()
	dbs := unrecordedShards(t, 3)
	// What a process killed after recording shard 0 leaves.
	if _, err := dbs[0].pool.Exec(ctx(t), "INSERT INTO processed_messages_shard_map (shard, map, complete) VALUES (0, 'key/3', false)"); err != nil {
		t.Fatal(err)
	}
	other, err := processed.NewSharded(stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 3, Name: "tenant", Key: func(*consumer.Message) (string, error) { return "t", nil }}})
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Migrate(ctx(t)); !errors.Is(err, processed.ErrShardMapChanged) || !strings.Contains(err.Error(), "not yet recorded on every shard") {
		t.Fatalf("another map over the interrupted first use: %v, want ErrShardMapChanged naming the first use", err)
	}
	migratedSharded(t, stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}})
	for i, d := range dbs {
		var complete bool
		if err := d.pool.QueryRow(ctx(t), "SELECT complete FROM processed_messages_shard_map WHERE shard = $1 AND map = 'key/3'", i).Scan(&complete); err != nil || !complete {
			t.Fatalf("shard %d: complete %v, %v", i, complete, err)
		}
	}
	if _, err := dbs[1].pool.Exec(ctx(t), "DELETE FROM processed_messages_shard_map"); err != nil {
		t.Fatal(err)
	}
	s, err := processed.NewSharded(stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx(t)); !errors.Is(err, processed.ErrShardMapChanged) || !strings.Contains(err.Error(), "was its database replaced") {
		t.Fatalf("a shard's record lost after the map was complete: %v, want it refused", err)
	}
}

// unrecordedShards returns n shards, migrated one by one: no map is
// recorded on them.
func unrecordedShards(t *testing.T, n int) []*shardDB {
	t.Helper()
	dbs := newShardDBs(t, n)
	for _, d := range dbs {
		if err := d.store.Migrate(ctx(t)); err != nil {
			t.Fatal(err)
		}
	}
	return dbs
}

// A map whose first use was cut short after every shard held its record
// (none marked complete), then resharded and the reshard finished, is
// complete: a shard that loses its record afterwards is refused, as after
// any other first use.
func TestEdgeShardedReshardCompletesTheMap(t *testing.T) {
	t.Parallel()
	tenant := processed.ShardMap{Name: "tenant", Shards: 2, Key: func(m *consumer.Message) (string, error) { return m.Key, nil }}
	for _, tc := range []struct {
		name string
		to   processed.ShardMap
		dbs  int
	}{
		{"renamed", tenant, 2},
		{"grown", processed.ShardMap{Shards: 3}, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dbs := unrecordedShards(t, tc.dbs)
			for i := range 2 { // what a process killed before marking them leaves
				if _, err := dbs[i].pool.Exec(ctx(t), "INSERT INTO processed_messages_shard_map (shard, map, complete) VALUES ($1, 'key/2', false)", i); err != nil {
					t.Fatal(err)
				}
			}
			during := migratedSharded(t, stores(dbs), processed.ShardedConfig{Map: tc.to, Previous: &processed.ShardMap{Shards: 2}})
			if err := during.FinishReshard(ctx(t)); err != nil {
				t.Fatal(err)
			}
			if _, err := dbs[1].pool.Exec(ctx(t), "DELETE FROM processed_messages_shard_map"); err != nil {
				t.Fatal(err)
			}
			after, err := processed.NewSharded(stores(dbs), processed.ShardedConfig{Map: tc.to})
			if err != nil {
				t.Fatal(err)
			}
			if err := after.Migrate(ctx(t)); !errors.Is(err, processed.ErrShardMapChanged) || !strings.Contains(err.Error(), "was its database replaced") {
				t.Fatalf("shard 1's record lost after the reshard: %v, want it refused", err)
			}
		})
	}
}

// A process of a version before migration 0008, still running during an
// upgrade, records a first use without saying whether it is complete;
// killed after shard 0, it leaves a record the next process finishes.
func TestEdgeShardedFirstUseByAnEarlierVersion(t *testing.T) {
	t.Parallel()
	dbs := unrecordedShards(t, 2)
	if _, err := dbs[0].pool.Exec(ctx(t), "INSERT INTO processed_messages_shard_map (shard, map) VALUES (0, 'key/2')"); err != nil {
		t.Fatal(err)
	}
	migratedSharded(t, stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
}

// After a reshard from three shards to two is finished, a process started
// with Previous still set keeps working, as FinishReshard says: the third
// shard's record was deleted by it, not lost.
func TestEdgeShardedShrunkReshardWithPreviousStillSet(t *testing.T) {
	t.Parallel()
	dbs := unrecordedShards(t, 3)
	migratedSharded(t, stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}})
	cfg := processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}, Previous: &processed.ShardMap{Shards: 3}}
	if err := migratedSharded(t, stores(dbs), cfg).FinishReshard(ctx(t)); err != nil {
		t.Fatal(err)
	}
	s, err := processed.NewSharded(stores(dbs), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx(t)); err != nil {
		t.Fatalf("a process with Previous still set after the reshard finished: %v", err)
	}
}
