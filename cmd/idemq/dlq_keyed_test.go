package main

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/processed"
)

// TestEdgeDLQReplayOnKeyedShards: on shards whose table keeps the shard
// key in its primary key, o-1 applied under tenant-a and o-1 of tenant-b
// (the same body) dead-lettered are two messages. `dlq replay
// --shard-url` looks the dead letter up by its own key: it will apply,
// and is republished, not dropped as applied (it looked it up by id).
func TestEdgeDLQReplayOnKeyedShards(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	urls := shardDatabases(t, 1)
	s, err := processed.OpenSharded(ctx, urls, processed.Config{ShardKeyInPrimaryKey: true}, processed.ShardedConfig{Map: processed.ShardMap{Shards: 1}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	body := `{"sync":true}`
	fp := (&consumer.Message{Body: []byte(body)}).Fingerprint()
	claim(t, s.Shard(0), dedup.Claim{Consumer: "billing", MessageID: "o-1", Fingerprint: fp, Partition: -1, Offset: -1,
		Route: dedup.Route{Key: "tenant-a"}})
	f := newRedisFixtureWith(ctx, t, redisstream.Config{})
	if err := f.dl.DeadLetter(ctx, &consumer.Message{ID: "o-1", Key: "tenant-b", Body: []byte(body), Source: f.work, Partition: -1, Offset: -1},
		consumer.Failure{Consumer: "billing", MessageID: "o-1", Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1,
			FirstFailure: time.Now(), LastFailure: time.Now()}); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"dlq", "replay", "--stream-key", f.dead, "--retention", "72h", "--shard-url", urls[0]}, f.args[2:]...)
	want(t, idemq(t, append(args, "--dry-run")...), exitOK, "1 will apply, 0 already applied", "")
	want(t, idemq(t, args...), exitOK, "republished 1", "")
}
