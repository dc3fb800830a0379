package outbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

func testCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// fixture is a migrated outbox in a fresh schema, with a business table.
type fixture struct {
	pool   *pgxpool.Pool
	schema string
	ob     *outbox.Outbox
	orders string // quoted business table
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	ctx := testCtx(t, 30*time.Second)
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	ob, err := outbox.New(pool, outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	orders := pgx.Identifier{schema, "orders"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+orders+" (id text PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	return &fixture{pool: pool, schema: schema, ob: ob, orders: orders}
}

func (f *fixture) table() string { return pgx.Identifier{f.schema, "outbox"}.Sanitize() }

// placeOrder inserts an order and enqueues its event in one transaction.
func (f *fixture) placeOrder(t *testing.T, id string, msg outbox.Message, commit bool) {
	t.Helper()
	ctx := testCtx(t, 30*time.Second)
	tx, err := f.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "INSERT INTO "+f.orders+" (id) VALUES ($1)", id); err != nil {
		t.Fatal(err)
	}
	if err := f.ob.Enqueue(ctx, tx, msg); err != nil {
		t.Fatalf("Enqueue: %v", err)
	}
	if commit {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

func (f *fixture) count(t *testing.T, table, where string, args ...any) int {
	t.Helper()
	var n int
	q := "SELECT count(*) FROM " + table
	if where != "" {
		q += " WHERE " + where
	}
	if err := f.pool.QueryRow(testCtx(t, 10*time.Second), q, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// eventually polls cond until it holds or d passes.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// runRelay runs r until the test ends, and fails the test if Run errs.
func runRelay(t *testing.T, r *outbox.Relay) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("Run did not return")
		}
	}
	t.Cleanup(stop)
	return stop
}

// RabbitMQ helpers.

func amqpURL() string {
	if u := os.Getenv("IDEMQ_TEST_AMQP_URL"); u != "" {
		return u
	}
	return rabbitmq.DefaultURL
}

func admin(t testing.TB, f func(ch *amqp.Channel) error) error {
	t.Helper()
	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		t.Fatalf("dial %s: %v", amqpURL(), err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	return f(ch)
}

// newQueue declares a fresh durable queue with its dead-letter queue (the
// topology a rabbitmq.Source checks for), deleted at cleanup.
func newQueue(t *testing.T) string {
	t.Helper()
	var b [5]byte
	_, _ = rand.Read(b[:])
	q := "idemq-test.outbox." + strings.ReplaceAll(t.Name(), "/", ".") + "." + hex.EncodeToString(b[:])
	if err := rabbitmq.DeclareTopology(context.Background(), amqpURL(), rabbitmq.Topology{Queue: q}); err != nil {
		t.Fatalf("declare %s: %v", q, err)
	}
	t.Cleanup(func() {
		_ = admin(t, func(ch *amqp.Channel) error {
			_, err := ch.QueueDelete(q, false, false, false)
			_, _ = ch.QueueDelete(rabbitmq.DLQName(q), false, false, false)
			_ = ch.ExchangeDelete(q+".dlx", false, false)
			return err
		})
	})
	return q
}

func queueDepth(t *testing.T, q string) int {
	t.Helper()
	var n int
	if err := admin(t, func(ch *amqp.Channel) error {
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		n = st.Messages
		return err
	}); err != nil {
		t.Fatalf("inspect %s: %v", q, err)
	}
	return n
}

func newPublisher(t *testing.T) *rabbitmq.Publisher {
	t.Helper()
	p, err := rabbitmq.NewPublisher(testCtx(t, 30*time.Second), rabbitmq.PublisherConfig{URL: amqpURL()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}
