package main

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/processed"
)

// processed move --to moves the dedup rows of the keys the new map places
// on the new shard, and --finish ends the reshard once nothing is left.
func TestProcessedMove(t *testing.T) {
	t.Parallel()
	urls := shardDatabases(t, 3)
	ctx := context.Background()
	two, err := processed.OpenSharded(ctx, urls[:2], processed.Config{}, processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	if err != nil {
		t.Fatal(err)
	}
	defer two.Close()
	if err := two.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var msgs []*consumer.Message
	for i := range 60 {
		m := &consumer.Message{ID: fmt.Sprintf("m%02d", i), Key: fmt.Sprintf("k%02d", i)}
		msgs = append(msgs, m)
		r, err := two.Route(m)
		if err != nil {
			t.Fatal(err)
		}
		tx, _, err := two.BeginClaim(ctx, []dedup.Claim{{Consumer: "ledger", MessageID: m.ID, Partition: -1, Offset: -1, Route: r}})
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	three, err := processed.OpenSharded(ctx, urls, processed.Config{}, processed.ShardedConfig{
		Map: processed.ShardMap{Shards: 3}, Previous: &processed.ShardMap{Shards: 2}})
	if err != nil {
		t.Fatal(err)
	}
	defer three.Close()
	if err := three.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	args := []string{"processed", "move", "--shard-url", urls[0], "--shard-url", urls[1], "--shard-url", urls[2], "--shards", "3", "--previous-shards", "2"}

	want(t, idemq(t, append(args, "--finish")...), exitFail, "", "rows from before it that the map places on another shard")
	moved := 0
	for _, m := range msgs {
		if r, _ := three.Route(m); r.Shard != r.Was {
			moved++
		}
	}
	r := idemq(t, append(args, "--to", "2")...)
	want(t, r, exitOK, fmt.Sprintf("moved %d records to shard 2, each checked there before its delete", moved), "")
	want(t, r, exitOK, "shard 0 → 2: ", "")
	want(t, idemq(t, append(args, "--finish")...), exitOK, "the reshard from key/2 to key/3 is finished", "")

	// Each id is on the shard the new map gives its key, and only there.
	for _, m := range msgs {
		rt, _ := three.Route(m)
		for i := range 3 {
			_, err := three.Shard(i).Lookup(ctx, "ledger", m.ID)
			if (err == nil) != (i == rt.Shard) {
				t.Fatalf("%s (shard %d): on shard %d: %v", m.ID, rt.Shard, i, err)
			}
		}
	}
	var n int
	if err := three.Shard(2).Pool().QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{"public", "processed_messages"}.Sanitize()+" WHERE shard_key IS NOT NULL").Scan(&n); err != nil || n != moved {
		t.Fatalf("shard 2 holds %d keyed rows, %v; want the %d moved", n, err, moved)
	}

	want(t, idemq(t, args...), exitUsage, "", "give --to (a shard of the new map) or --finish")
	want(t, idemq(t, "processed", "move", "--shard-url", urls[0], "--shard-url", urls[1], "--shards", "3", "--previous-shards", "2", "--to", "2"),
		exitUsage, "", "2 --shard-url for maps of 3 and 2 shards")
}
