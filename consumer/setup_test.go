package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

const queue = "work"

// bundle is everything a runtime test needs beside the runtime itself.
type bundle struct {
	t       *testing.T
	broker  *memory.Broker
	pool    *pgxpool.Pool
	schema  string
	store   *processed.Store
	dlq     *recordingDLQ
	effects string // quoted name of the effects table
}

// recordingDLQ is a DeadLetterer that keeps what it is given and can be made
// to fail.
type recordingDLQ struct {
	mu       sync.Mutex
	entries  []dlqEntry
	failNext int                           // fail this many calls first
	onCall   func(*consumer.Message) error // optional, called before recording
}

type dlqEntry struct {
	msg *consumer.Message
	f   consumer.Failure
}

func (d *recordingDLQ) DeadLetter(_ context.Context, msg *consumer.Message, f consumer.Failure) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.onCall != nil {
		if err := d.onCall(msg); err != nil {
			return err
		}
	}
	if d.failNext > 0 {
		d.failNext--
		return errors.New("dead-letter queue unavailable")
	}
	d.entries = append(d.entries, dlqEntry{msg, f})
	return nil
}

func (d *recordingDLQ) list() []dlqEntry {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]dlqEntry(nil), d.entries...)
}

func newBundle(t *testing.T) *bundle {
	t.Helper()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	b := &bundle{t: t, broker: memory.NewBroker(), pool: pool, schema: schema, store: store, dlq: &recordingDLQ{},
		effects: pgx.Identifier{schema, "effects"}.Sanitize()}
	// No unique constraint: a duplicate effect shows up as a second row.
	if _, err := pool.Exec(ctx, "CREATE TABLE "+b.effects+" (seq bigserial, message_id text, key text, body text)"); err != nil {
		t.Fatal(err)
	}
	return b
}

// insertEffect is the business change the test handlers make.
func (b *bundle) insertEffect(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+b.effects+" (message_id, key, body) VALUES ($1, $2, $3)", m.ID, m.Key, string(m.Body))
	return err
}

// config returns a runtime config over a fresh subscription to the test queue.
func (b *bundle) config(h consumer.Handler) consumer.Config {
	b.t.Helper()
	sub, err := b.broker.Subscribe(queue, memory.SubscribeOptions{})
	if err != nil {
		b.t.Fatal(err)
	}
	return consumer.Config{
		Name:            "test-consumer",
		Source:          sub,
		Store:           b.store,
		Handler:         h,
		DeadLetterer:    b.dlq,
		Retry:           consumer.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
		ShutdownTimeout: 5 * time.Second,
	}
}

func (b *bundle) publish(msgs ...*consumer.Message) {
	b.t.Helper()
	if err := b.broker.Publish(context.Background(), queue, msgs...); err != nil {
		b.t.Fatal(err)
	}
}

// effectCounts returns the number of effect rows per message id.
func (b *bundle) effectCounts() map[string]int {
	b.t.Helper()
	rows, err := b.pool.Query(context.Background(), "SELECT message_id, count(*) FROM "+b.effects+" GROUP BY message_id")
	if err != nil {
		b.t.Fatal(err)
	}
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			b.t.Fatal(err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		b.t.Fatal(err)
	}
	return out
}

// running is a runtime started in the background.
type running struct {
	rt     *consumer.Runtime
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

func start(t *testing.T, cfg consumer.Config) *running {
	t.Helper()
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{rt: rt, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- rt.Run(ctx) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop cancels the runtime and waits for Run to return.
func (r *running) stop(t *testing.T) {
	t.Helper()
	r.once.Do(func() {
		r.cancel()
		select {
		case err := <-r.done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("Run did not return within 30s of cancel")
		}
	})
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// settled reports whether the broker holds nothing for the test queue.
func (b *bundle) settled() bool {
	return b.broker.Ready(queue) == 0 && b.broker.Unacked(queue) == 0
}

func msg(id, body string) *consumer.Message {
	return &consumer.Message{ID: id, Body: []byte(body)}
}

func msgs(prefix string, n int) []*consumer.Message {
	out := make([]*consumer.Message, n)
	for i := range out {
		out[i] = msg(fmt.Sprintf("%s-%d", prefix, i), fmt.Sprintf("body %d", i))
	}
	return out
}

func newPool(ctx context.Context, conf *pgxpool.Config) (*pgxpool.Pool, error) {
	return pgxpool.NewWithConfig(ctx, conf)
}

// effectsByKey returns the effects' message ids per key, in the order they
// were applied, and fails the test if any key's ids were applied out of
// order (ids sort in publish order).
func (b *bundle) effectsByKey(t *testing.T) map[string][]string {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), "SELECT key, message_id FROM "+b.effects+" ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	by := map[string][]string{}
	for rows.Next() {
		var key, id string
		if err := rows.Scan(&key, &id); err != nil {
			t.Fatal(err)
		}
		if ids := by[key]; len(ids) > 0 && id <= ids[len(ids)-1] {
			t.Fatalf("key %s: %s applied after %s", key, id, ids[len(ids)-1])
		}
		by[key] = append(by[key], id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return by
}

// threeModes are the runtime's modes by their BatchSize: strict (one
// message a transaction), the grouped default, and batch mode.
var threeModes = []struct {
	name      string
	batchSize int
}{{"strict", 1}, {"grouped", 0}, {"batch", 10}}
