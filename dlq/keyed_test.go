package dlq_test

import (
	"context"
	"testing"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// newKeyedMemEnv is newMemEnv over a processed.Sharded of one shard whose
// table keeps the shard key in its primary key: an id is unique per key.
func newKeyedMemEnv(t *testing.T) *memEnv {
	t.Helper()
	e := newMemEnv(t)
	st, err := processed.New(e.pool, processed.Config{Schema: e.store.Schema(), ShardKeyInPrimaryKey: true})
	if err != nil {
		t.Fatal(err)
	}
	s, err := processed.NewSharded([]*processed.Store{st}, processed.ShardedConfig{Map: processed.ShardMap{Shards: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	e.sharded = s
	return e
}

// On a table that keeps the shard key in its primary key, one id may be
// applied under one key and dead-lettered under another, with the same
// body. The dead letter is not the applied message: classifying it says
// it will apply, and Requeue republishes it rather than dropping it as
// already applied.
func TestEdgeKeyedDeadLetterOfAnIdAppliedUnderAnotherKey(t *testing.T) {
	t.Parallel()
	e := newKeyedMemEnv(t)
	ctx := context.Background()
	if err := e.broker.Publish(ctx, memQueue, &consumer.Message{ID: "o-1", Key: "tenant-a", Body: []byte(`{"sync":true}`)}); err != nil {
		t.Fatal(err)
	}
	if s := e.consume(); s.Applied != 1 {
		t.Fatalf("tenant-a's o-1: %+v", s)
	}
	e.broken.Store(true)
	if err := e.broker.Publish(ctx, memQueue, &consumer.Message{ID: "o-1", Key: "tenant-b", Body: []byte(`{"sync":true}`)}); err != nil {
		t.Fatal(err)
	}
	if s := e.consume(); s.DeadLettered != 1 {
		t.Fatalf("tenant-b's o-1: %+v", s)
	}
	e.broken.Store(false)

	cl, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.sharded, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if cl.WillApply != 1 || cl.AlreadyApplied != 0 {
		t.Fatalf("classified %+v, want tenant-b's o-1 as will apply", cl)
	}
	res, err := dlq.Requeue(ctx, dlq.RequeueConfig{
		Browser: e.browser(),
		Store:   e.sharded,
		Publish: func(ctx context.Context, dest string, m *consumer.Message) error {
			return e.broker.Publish(ctx, dest, m)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Republished != 1 || res.Skipped != 0 {
		t.Fatalf("requeue %+v: tenant-b's o-1 was dropped as applied", res)
	}
	if s := e.consume(); s.Applied != 1 {
		t.Fatalf("consumer after requeue: %+v", s)
	}
	if rows, _ := e.effectCount(); rows != 2 {
		t.Fatalf("%d effects, want tenant-a's and tenant-b's", rows)
	}
}
