package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
)

// keyShardStore is a sharded store of four shards over one Store that
// routes key "hot" to shard 0 and every other key to shard 1.
type keyShardStore struct{ dedup.Store }

func (keyShardStore) Shards() int { return 4 }
func (keyShardStore) Route(m *consumer.Message) (dedup.Route, error) {
	n := 1
	if m.Key == "hot" {
		n = 0
	}
	return dedup.Route{Shard: n, Was: n, Key: m.Key}, nil
}
func (s keyShardStore) PingShard(ctx context.Context, _ int) error { return s.Ping(ctx) }

// A shard whose lanes are held (a slow key, its database down) fills its
// channels, and the receive loop waits to hand it the next delivery:
// cancelling Run stops that wait (the delivery is requeued) and Run
// within ShutdownTimeout, the held deliveries unacked.
func TestEdgeShardedBusyShardDoesNotBlockShutdown(t *testing.T) {
	b := newBundle(t)
	var all []*consumer.Message
	for i := range 12 {
		all = append(all, &consumer.Message{ID: fmt.Sprintf("hot-%02d", i), Key: "hot", Body: []byte("x")})
	}
	b.publish(all...)
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		<-ctx.Done() // held until the hard stop
		return ctx.Err()
	})
	cfg.Store = keyShardStore{b.store}
	cfg.Concurrency, cfg.BatchSize = 1, 2
	cfg.ShutdownTimeout = 300 * time.Millisecond
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done, finished := make(chan error, 1), make(chan struct{})
	go func() { done <- rt.Run(ctx); close(finished) }()
	// Stopped before the bundle drops its schema, which the held
	// transactions would block, if the test fails before it cancels.
	t.Cleanup(func() {
		cancel()
		select {
		case <-finished:
		case <-time.After(10 * time.Second):
		}
	})
	// Shard 0's channels are full (it holds a shard's share of the
	// slots, 4), and the receive loop waits to hand it the next delivery:
	// 7 received if the lane's first batch took two deliveries, 6 if it
	// took the first alone (the lane does not wait for a second).
	waitFor(t, "shard 0's channels filled", func() bool { return rt.Stats().Received >= 6 })
	time.Sleep(100 * time.Millisecond)
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("Run did not return 10s after cancel (ShutdownTimeout 300ms): stats %+v", rt.Stats())
	}
	if st := rt.Stats(); st.Applied != 0 || st.InFlight != 0 || st.Requeued != st.Received {
		t.Fatalf("stats %+v: want nothing applied, nothing left in flight, every delivery received requeued", st)
	}
	if b.broker.Ready(queue) != 12 || b.broker.Unacked(queue) != 0 {
		t.Fatalf("ready %d, unacked %d: want all 12 back in the queue", b.broker.Ready(queue), b.broker.Unacked(queue))
	}
}
