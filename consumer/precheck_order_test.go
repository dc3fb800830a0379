package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// A message the runtime dead-letters before any claim (here: it has no
// id) is settled after the messages of its key before it in its group:
// the first, which fails twice and then applies, comes first, in every
// mode.
func TestEdgeDeadLetterBeforeClaimKeepsKeyOrder(t *testing.T) {
	for _, mode := range threeModes {
		t.Run(mode.name, func(t *testing.T) {
			b := newBundle(t)
			var (
				mu     sync.Mutex
				events []string
			)
			note := func(s string) { mu.Lock(); events = append(events, s); mu.Unlock() }
			b.dlq.onCall = func(m *consumer.Message) error { note("dead-letter " + string(m.Body)); return nil }
			b.publish(&consumer.Message{ID: "first", Key: "k", Body: []byte("first")},
				&consumer.Message{ID: "", Key: "k", Body: []byte("second, no id")})
			var calls atomic.Int32
			cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				if calls.Add(1) < 3 {
					return errors.New("transient")
				}
				note("apply " + m.ID)
				return b.insertEffect(ctx, tx, m)
			})
			cfg.Concurrency, cfg.BatchSize = 1, mode.batchSize
			r := start(t, cfg)
			waitFor(t, "both settled", func() bool {
				st := r.rt.Stats()
				return b.settled() && st.InFlight == 0 && st.Received == 2
			})
			mu.Lock()
			defer mu.Unlock()
			if fmt.Sprint(events) != "[apply first dead-letter second, no id]" {
				t.Fatalf("key k settled as %q, want the first applied, then the second dead-lettered", events)
			}
		})
	}
}

// At a hard stop, a message that fails the input checks after a message of
// its key that was not settled is requeued with it, not dead-lettered
// ahead of it.
func TestEdgeDeadLetterBeforeClaimAtShutdown(t *testing.T) {
	for _, mode := range threeModes {
		t.Run(mode.name, func(t *testing.T) {
			b := newBundle(t)
			b.publish(&consumer.Message{ID: "first", Key: "k", Body: []byte("first")},
				&consumer.Message{ID: "", Key: "k", Body: []byte("second, no id")})
			var calls atomic.Int32
			cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				calls.Add(1)
				return errors.New("transient")
			})
			cfg.Retry = consumer.RetryConfig{InitialInterval: 50 * time.Millisecond, MaxInterval: 50 * time.Millisecond, MaxAttempts: 1000}
			cfg.Concurrency, cfg.BatchSize = 1, mode.batchSize
			cfg.ShutdownTimeout = 200 * time.Millisecond
			r := start(t, cfg)
			waitFor(t, "the first tried", func() bool { return calls.Load() > 0 })
			r.stop(t)
			if dl := b.dlq.list(); len(dl) != 0 || b.broker.Ready(queue) != 2 {
				t.Fatalf("%d dead letters, %d requeued: want both requeued, the key in order", len(dl), b.broker.Ready(queue))
			}
		})
	}
}
