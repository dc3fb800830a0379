//go:build integration

package integration

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
)

// ackRecorder wraps a Source and records, for each acked delivery, the
// message id, so the test can check after the fact that every ack had its
// effect.
type ackRecorder struct {
	consumer.Source
	mu    sync.Mutex
	acked map[string]int
}

func (r *ackRecorder) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := r.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return &recordedDelivery{Delivery: d, r: r}, nil
}

func (r *ackRecorder) ackedIDs() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]int, len(r.acked))
	for k, v := range r.acked {
		out[k] = v
	}
	return out
}

type recordedDelivery struct {
	consumer.Delivery
	r *ackRecorder
}

func (d *recordedDelivery) Ack(ctx context.Context) error {
	err := d.Delivery.Ack(ctx)
	if err == nil {
		d.r.mu.Lock()
		d.r.acked[d.Message().ID]++
		d.r.mu.Unlock()
	}
	return err
}

// slowHandler is d.handler after a short sleep inside the transaction, so
// that transactions are open when a fault hits.
func slowHandler(d *db, sleep time.Duration) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if _, err := tx.Exec(ctx, "SELECT pg_sleep($1)", sleep.Seconds()); err != nil {
			return err
		}
		return d.handler(ctx, tx, msg)
	}
}

// TestPostgresMemoryExactlyOnce is the baseline: the in-memory broker, the
// Postgres container, a workload with duplicates, one effect per id.
func TestPostgresMemoryExactlyOnce(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	d := newDB(t)
	b := memory.NewBroker()
	msgs, ids := workload("pgmem", 300, 3)
	if err := b.Publish(ctx, "q", msgs...); err != nil {
		t.Fatal(err)
	}
	sub, err := b.Subscribe("q", memory.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rt := startRuntime(t, d, sub, nil)
	waitFor(t, time.Minute, "the queue to drain", rt, func() bool { return memory.Drained(b.Stats("q")) })
	if err := rt.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	st := rt.rt.Stats()
	if st.Applied != int64(len(ids)) || st.Duplicates != int64(len(msgs)-len(ids)) {
		t.Errorf("stats %+v: want %d applied and %d duplicates", st, len(ids), len(msgs)-len(ids))
	}
	d.assertExactlyOnce(t, ids)
	if n := d.dedupRows(t, "integration"); n != len(ids) {
		t.Errorf("%d dedup rows, want %d", n, len(ids))
	}
}

// TestFaultPostgresRestart crashes the Postgres container (SIGKILL) while
// handlers are mid-transaction, then starts it again on the same address.
// Acked messages are never redelivered by the broker, so an ack that went
// out before its effect was durable would show up as a lost id. Every id
// must end up applied exactly once, and every ack must have its effect.
func TestFaultPostgresRestart(t *testing.T) {
	pg, _ := postgres(t)
	pg.container(t)
	ctx := testCtx(t, 4*time.Minute)
	d := newDB(t)
	b := memory.NewBroker()
	msgs, ids := workload("pgrestart", 400, 4)
	if err := b.Publish(ctx, "q", msgs...); err != nil {
		t.Fatal(err)
	}
	sub, err := b.Subscribe("q", memory.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	src := &ackRecorder{Source: sub, acked: map[string]int{}}
	rt := startRuntime(t, d, src, func(c *consumer.Config) { c.Handler = slowHandler(d, 5*time.Millisecond) })

	waitFor(t, time.Minute, "a quarter of the ids applied", rt, func() bool { return rt.rt.Stats().Applied >= int64(len(ids)/4) })
	before := rt.rt.Stats()
	t0 := time.Now()
	pg.kill(t)
	t.Logf("killed Postgres in %s with stats %+v", time.Since(t0), before)
	t0 = time.Now()
	pg.start(t)
	t.Logf("Postgres back in %s; stats %+v", time.Since(t0), rt.rt.Stats())

	waitFor(t, 2*time.Minute, "the queue to drain after the restart", rt, func() bool { return memory.Drained(b.Stats("q")) })
	if err := rt.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	st := rt.rt.Stats()
	t.Logf("final stats %+v, queue %+v", st, b.Stats("q"))
	if before.Applied >= int64(len(ids)) {
		t.Errorf("everything was applied before the crash: the fault hit nothing")
	}
	d.assertExactlyOnce(t, ids)
	effects := d.effectCounts(t)
	for id := range src.ackedIDs() {
		if effects[id] != 1 {
			t.Errorf("id %s was acked but has %d effects", id, effects[id])
		}
	}
}
