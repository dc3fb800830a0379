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

// TestEdgeKafkaDeadLetterKeepsItsShardKey: on a processed.Sharded with the default
// shard map, a Kafka message's shard key is its ordering key, its
// topic and partition (or what Config.OrderingKey makes of it: here the
// record key added, as brokers/kafka's doc suggests); on a table that
// keeps the shard key in its primary key, the id is unique per key. A dead
// letter lives in another topic, but it is the same message: classified,
// requeued and replayed, it is looked up and claimed under the key it was
// consumed with, and a replay does not run OrderingKey on that key again.
// Here one id is dead-lettered, then applied from a second copy, and
// another is applied, then dead-lettered as a fingerprint mismatch: a
// replay applies neither again.
func TestEdgeKafkaDeadLetterKeepsItsShardKey(t *testing.T) {
	t.Parallel()
	for name, orderingKey := range map[string]func(*consumer.Message) string{
		"default":      nil,
		"ordering key": func(m *consumer.Message) string { return m.Key + "/" + string(m.RecordKey) },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			kafDeadLetterKeepsItsShardKey(t, orderingKey)
		})
	}
}

func kafDeadLetterKeepsItsShardKey(t *testing.T, orderingKey func(*consumer.Message) string) {
	e := kafNewEnv(t)
	e.orderingKey = orderingKey
	st, err := processed.New(e.pool, processed.Config{Schema: e.store.Schema(), ShardKeyInPrimaryKey: true})
	if err != nil {
		t.Fatal(err)
	}
	if e.sharded, err = processed.NewSharded([]*processed.Store{st}, processed.ShardedConfig{Map: processed.ShardMap{Shards: 1}}); err != nil {
		t.Fatal(err)
	}
	if err := e.sharded.Migrate(e.ctx); err != nil {
		t.Fatal(err)
	}

	ms := kafMessages("k", 2)
	late, mismatched := ms[0], ms[1]
	// Each id's copies share a record key, so a partition, so a shard key.
	late.RecordKey, mismatched.RecordKey = []byte(late.Key), []byte(mismatched.Key)
	e.setFailing(late.ID)
	e.publish(e.topic, late, mismatched)
	if s := e.consume(2); s.DeadLettered != 1 || s.Applied != 1 {
		t.Fatalf("first pass: %+v, want %s dead-lettered and %s applied", s, late.ID, mismatched.ID)
	}
	e.mu.Lock()
	delete(e.failIDs, late.ID)
	e.mu.Unlock()
	other := mismatched.Clone()
	other.Body = []byte(`{"another":"payload"}`)
	e.publish(e.topic, late, other)
	if s := e.consume(2); s.DeadLettered != 1 || s.Applied != 1 {
		t.Fatalf("second pass: %+v, want %s applied and the other %s dead-lettered", s, late.ID, mismatched.ID)
	}
	e.expectEffects(late.ID, mismatched.ID)

	cl, err := dlq.Classify(e.ctx, dlq.ClassifyConfig{Browser: e.browser(""), Store: e.sharded, Consumer: kafConsumerName})
	if err != nil {
		t.Fatal(err)
	}
	if cl.AlreadyApplied != 1 || cl.Mismatch != 1 || cl.WillApply != 0 {
		t.Fatalf("classified %+v, want one already applied and one mismatch", cl)
	}
	res := e.replay("replay", nil)
	if res.Skipped != 1 || res.Mismatched != 1 || res.Applied != 0 {
		t.Fatalf("replay: %+v, want one skipped and one mismatched", res)
	}
	e.expectEffects(late.ID, mismatched.ID)
}
