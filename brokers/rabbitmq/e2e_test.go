package rabbitmq_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// e2e is a runtime over a RabbitMQ source, writing one row per applied
// message into a table with no unique constraint, so a double apply shows.
type e2e struct {
	pool    *pgxpool.Pool
	store   *processed.Store
	effects string // quoted table name
}

func newE2E(t *testing.T) *e2e {
	t.Helper()
	ctx := testCtx(t, 30*time.Second)
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (message_id text NOT NULL, body text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return &e2e{pool: pool, store: store, effects: effects}
}

// run starts a runtime on src with handler h (before the insert) and
// returns a stop function that cancels it and returns Run's error.
func (e *e2e) run(t *testing.T, src consumer.Source, concurrency int, before func(*consumer.Message)) (*consumer.Runtime, func() error) {
	t.Helper()
	rt, err := consumer.New(consumer.Config{
		Name:        "e2e",
		Source:      src,
		Store:       e.store,
		Concurrency: concurrency,
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if before != nil {
				before(msg)
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (message_id, body) VALUES ($1, $2)", msg.ID, string(msg.Body))
			return err
		},
		DeadLetterer: consumer.DeadLettererFunc(func(_ context.Context, msg *consumer.Message, f consumer.Failure) error {
			t.Errorf("unexpected dead-letter of %q: %s: %v", msg.ID, f.Class, f.Err)
			return errors.New("test refuses dead-letters")
		}),
		ShutdownTimeout: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop := func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(30 * time.Second):
				runErr = errors.New("Run did not return within 30s of cancel")
			}
		})
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return rt, stop
}

// counts returns the number of effect rows and of distinct ids among them.
func (e *e2e) counts(t *testing.T) (rows, distinct int) {
	t.Helper()
	ctx := testCtx(t, 10*time.Second)
	if err := e.pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT message_id) FROM "+e.effects).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	return rows, distinct
}

// TestE2EDuplicates: the same MessageId published twice is applied once.
func TestE2EDuplicates(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	e := newE2E(t)
	q := newQueue(t)
	msgs := brokertest.NewMessages("dup", 5, 0)
	// msgs[0] again, a redelivery in all but name, between the others.
	all := []*consumer.Message{msgs[0], msgs[1], msgs[0].Clone(), msgs[2], msgs[3], msgs[4]}
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, all...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, rabbitmq.Config{Queue: q})
	rt, stop := e.run(t, src, 2, nil)
	waitFor(t, 30*time.Second, "6 messages settled", func() bool {
		st := rt.Stats()
		return st.Applied+st.Duplicates == int64(len(all)) && st.InFlight == 0
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	st := rt.Stats()
	if st.Applied != 5 || st.Duplicates != 1 {
		t.Errorf("runtime stats %+v, want 5 applied and 1 duplicate", st)
	}
	rows, distinct := e.counts(t)
	if rows != 5 || distinct != 5 {
		t.Errorf("effects: %d rows for %d ids, want 5 for 5", rows, distinct)
	}
	if d := queueDepth(t, q); d != 0 {
		t.Errorf("%d messages left in the queue", d)
	}
}

// TestE2EConnectionCutExactlyOnce cuts the AMQP connection while handlers
// are mid-transaction: their commits go through but their acks cannot, so
// RabbitMQ redelivers those messages on the new connection. Every id must
// still be applied exactly once, and nothing lost.
func TestE2EConnectionCutExactlyOnce(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 90*time.Second)
	e := newE2E(t)
	q := newQueue(t)
	px := newProxy(t)

	const n, concurrency = 200, 4
	msgs := brokertest.NewMessages("cut", n, 0)
	// Every 20th message is published twice.
	all := append([]*consumer.Message(nil), msgs...)
	for i := 0; i < n; i += 20 {
		all = append(all, msgs[i].Clone())
	}
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, all...); err != nil {
		t.Fatal(err)
	}

	// Handlers block once 50 messages have started, until the cut.
	var started, blocked atomic.Int64
	gate := make(chan struct{})
	var opened sync.Once
	open := func() { opened.Do(func() { close(gate) }) }
	src := newSource(t, rabbitmq.Config{
		URL:       px.URL(t),
		Queue:     q,
		Reconnect: rabbitmq.ReconnectConfig{InitialInterval: 10 * time.Millisecond, MaxInterval: 200 * time.Millisecond},
	})
	rt, stop := e.run(t, src, concurrency, func(*consumer.Message) {
		if started.Add(1) > 50 {
			blocked.Add(1)
			<-gate
		}
	})
	// Registered after e.run's, so it runs first: a failing test must not
	// leave handlers blocked, or stopping the runtime would wait forever.
	t.Cleanup(open)
	// Grouped by default: how many lanes are mid-transaction depends on
	// how the deliveries were grouped; one is enough.
	waitFor(t, 30*time.Second, "a handler blocked mid-stream", func() bool { return blocked.Load() >= 1 })
	if c := px.Cut(); c == 0 {
		t.Fatal("proxy had no connection to cut")
	}
	// Noticed: the session is gone, or already replaced (with room in the
	// runtime's window, Receive reconnects while the handlers are blocked).
	waitFor(t, 10*time.Second, "the source to notice the cut", func() bool {
		return rabbitmq.SourceConnLost(src) || src.Stats().Reconnects > 0
	})
	open()

	waitFor(t, 60*time.Second, fmt.Sprintf("all %d ids applied", n), func() bool {
		_, distinct := e.counts(t)
		return distinct == n
	})
	// Let the redeliveries of the messages whose acks were lost be
	// recognised as duplicates: the queue drains completely.
	waitFor(t, 30*time.Second, "queue drained", func() bool {
		st := rt.Stats()
		return st.InFlight == 0 && queueDepth(t, q) == 0 && st.Applied+st.Duplicates >= int64(len(all)+concurrency)
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	rows, distinct := e.counts(t)
	if rows != n || distinct != n {
		t.Errorf("effects: %d rows for %d ids, want exactly one row for each of %d ids", rows, distinct, n)
	}
	st, sst := rt.Stats(), src.Stats()
	t.Logf("runtime %+v; source %+v", st, sst)
	if st.Applied != n {
		t.Errorf("Applied = %d, want %d", st.Applied, n)
	}
	if sst.Reconnects < 1 {
		t.Errorf("source Reconnects = %d, want at least 1", sst.Reconnects)
	}
	if st.AckFailures < concurrency || sst.Abandoned < concurrency {
		t.Errorf("AckFailures = %d, Abandoned = %d: the %d blocked messages should have failed to ack", st.AckFailures, sst.Abandoned, concurrency)
	}
	// Whatever is left for a later consumer (nothing, normally) is a
	// duplicate of an applied id.
	leftover := newSource(t, rabbitmq.Config{Queue: q})
	brokertest.ReceiveNone(ctx, t, leftover, 500*time.Millisecond)
}
