package consumer_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testlog"
)

// TestOrderingKey: Config.OrderingKey orders messages the adapter left
// unkeyed, here by a header, in strict and grouped mode: no two messages of
// one account run at once, each account's are applied in order, and the
// handler sees the key it was ordered by. A panicking OrderingKey is
// logged and leaves the message's own Key.
func TestOrderingKey(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 0} {
		t.Run(fmt.Sprintf("BatchSize %d", batch), func(t *testing.T) {
			t.Parallel()
			b := newBundle(t)
			const accounts, per = 4, 20
			var all []*consumer.Message
			for i := 0; i < per; i++ {
				for a := 0; a < accounts; a++ {
					all = append(all, &consumer.Message{ID: fmt.Sprintf("a%d-%03d", a, i), Body: []byte("x"),
						Headers: map[string]string{"account": fmt.Sprintf("a%d", a)}})
				}
			}
			all = append(all, &consumer.Message{ID: "panics", Key: "own", Body: []byte("x")})
			b.publish(all...)
			var active sync.Map
			var overlap atomic.Bool
			cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				if _, busy := active.LoadOrStore(m.Key, true); busy {
					overlap.Store(true)
				}
				defer active.Delete(m.Key)
				time.Sleep(time.Millisecond)
				return b.insertEffect(ctx, tx, m)
			})
			cfg.Concurrency, cfg.BatchSize = 8, batch
			cfg.OrderingKey = func(m *consumer.Message) string {
				if m.ID == "panics" {
					panic("no account")
				}
				return m.Header("account")
			}
			log, logs := testlog.New(slog.LevelDebug)
			cfg.Logger = log
			r := start(t, cfg)
			waitFor(t, "all applied", func() bool { return r.rt.Stats().Applied == accounts*per+1 })
			if overlap.Load() {
				t.Fatal("two messages of one account ran at once")
			}
			for key, ids := range b.effectsByKey(t) {
				for _, id := range ids {
					if (key == "own") != (id == "panics") || (key != "own" && !strings.HasPrefix(id, key+"-")) {
						t.Errorf("%s applied with key %q (the message whose OrderingKey panicked keeps its own, \"own\")", id, key)
					}
				}
			}
			if !strings.Contains(logs.String(), "OrderingKey function panicked") || !strings.Contains(logs.String(), "no account") {
				t.Errorf("the panic was not logged:\n%s", logs)
			}
		})
	}
}
