package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/keys"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

// maxLease is the longest RelayConfig.Lease accepted.
const maxLease = 7 * 24 * time.Hour

func TestEnqueueCommitsAndRollsBackWithTheBusinessChange(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	msg := outbox.Message{Destination: "orders.placed", ID: keys.ChildKey("order-1", "order-placed-event/v1"),
		Key: "cust-1", Headers: map[string]string{"type": "order.placed"}, Body: []byte(`{"order":"order-1"}`)}

	f.placeOrder(t, "order-1", msg, false) // rolled back
	if n := f.count(t, f.orders, ""); n != 0 {
		t.Fatalf("orders after rollback = %d", n)
	}
	if n := f.count(t, f.table(), ""); n != 0 {
		t.Fatalf("outbox rows after rollback = %d, want 0: the message must not outlive its transaction", n)
	}

	f.placeOrder(t, "order-1", msg, true)
	if n := f.count(t, f.orders, ""); n != 1 {
		t.Fatalf("orders after commit = %d", n)
	}
	var (
		key     string
		headers map[string]string
		body    []byte
		sent    *time.Time
		att     int
	)
	err := f.pool.QueryRow(testCtx(t, 10*time.Second),
		"SELECT key, headers, body, sent_at, attempts FROM "+f.table()+" WHERE destination = $1 AND message_id = $2",
		msg.Destination, msg.ID).Scan(&key, &headers, &body, &sent, &att)
	if err != nil {
		t.Fatalf("outbox row after commit: %v", err)
	}
	if key != "cust-1" || headers["type"] != "order.placed" || string(body) != string(msg.Body) || sent != nil || att != 0 {
		t.Fatalf("row = key %q headers %v body %q sent %v attempts %d", key, headers, body, sent, att)
	}
	st, err := f.ob.Stats(testCtx(t, 10*time.Second))
	if err != nil || st.Pending != 1 || st.Sent != 0 || st.OldestPending.IsZero() {
		t.Fatalf("Stats = %+v, %v", st, err)
	}
}

func TestEnqueueIsIdempotentPerDestinationAndID(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := testCtx(t, 30*time.Second)
	msg := outbox.Message{Destination: "d", ID: "m1", Body: []byte("a")}
	enqueue := func(m outbox.Message) error {
		return pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error { return f.ob.Enqueue(ctx, tx, m) })
	}
	if err := enqueue(msg); err != nil {
		t.Fatal(err)
	}
	if err := enqueue(msg); err != nil {
		t.Fatalf("same message again: %v, want nil", err)
	}
	if n := f.count(t, f.table(), ""); n != 1 {
		t.Fatalf("rows = %d, want 1", n)
	}
	changed := msg
	changed.Body = []byte("b")
	if err := enqueue(changed); !errors.Is(err, outbox.ErrConflict) {
		t.Fatalf("same id, other body: %v, want ErrConflict", err)
	}
	other := msg
	other.Destination = "e"
	if err := enqueue(other); err != nil {
		t.Fatalf("same id, other destination: %v", err)
	}
	for _, bad := range []outbox.Message{{ID: "x"}, {Destination: "d"}} {
		if err := enqueue(bad); err == nil {
			t.Errorf("Enqueue(%+v) = nil, want error", bad)
		}
	}
	if err := f.ob.Enqueue(ctx, nil, msg); err == nil {
		t.Error("nil tx: want error")
	}
}

func TestConfigAndMigrations(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	for _, cfg := range []outbox.Config{{Schema: "bad-name"}, {Table: "1x"}, {Table: strings.Repeat("a", 49)}, {PurgeBatchSize: -1}} {
		if _, err := outbox.New(pool, cfg); !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v, want ErrInvalidConfig", cfg, err)
		}
	}
	if _, err := outbox.New(nil, outbox.Config{}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("nil db: %v", err)
	}
	// A schema that does not exist yet is created; concurrent migrators
	// agree; a second Migrate is a no-op.
	schema := testdb.Schema(t) + "_ob"
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE") })
	ob, err := outbox.New(pool, outbox.Config{Schema: schema, Table: "events_out"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ob.Stats(ctx); !errors.Is(err, consumer.ErrNotMigrated) {
		t.Fatalf("Stats before Migrate = %v, want ErrNotMigrated", err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = ob.Migrate(ctx) }()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if v, err := ob.Version(ctx); err != nil || v != len(outbox.Migrations()) {
		t.Fatalf("Version = %d, %v", v, err)
	}
	if _, err := outbox.NewRelay(ob, outbox.RelayConfig{}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("relay without Publish: %v", err)
	}
	pub := func(context.Context, string, ...*consumer.Message) error { return nil }
	for _, rc := range []outbox.RelayConfig{
		{Publish: pub, BatchSize: -1},
		{Publish: pub, Backoff: outbox.BackoffConfig{InitialInterval: time.Second, MaxInterval: time.Millisecond}},
		{Publish: pub, Backoff: outbox.BackoffConfig{Multiplier: 0.5}},
		{Publish: pub, Hooks: []outbox.Hook{outbox.HookDefaults{}}}, // no event
		{Publish: pub, Lease: -time.Second},
		{Publish: pub, Lease: 10 * time.Second}, // not more than the default PublishTimeout, 30s
		{Publish: pub, PublishTimeout: time.Second, Lease: time.Second},
		{Publish: pub, Lease: maxLease + time.Second},
		{Publish: pub, PublishTimeout: 8 * 24 * time.Hour}, // the default Lease is capped at 7 days
	} {
		if _, err := outbox.NewRelay(ob, rc); !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("NewRelay(%+v) = %v, want ErrInvalidConfig", rc, err)
		}
	}
	for _, c := range []struct {
		cfg  outbox.RelayConfig
		want time.Duration
	}{
		{outbox.RelayConfig{Publish: pub}, 90 * time.Second},
		{outbox.RelayConfig{Publish: pub, PublishTimeout: 10 * time.Second}, 30 * time.Second},
		{outbox.RelayConfig{Publish: pub, PublishTimeout: 3 * 24 * time.Hour}, maxLease},
		{outbox.RelayConfig{Publish: pub, PublishTimeout: time.Second, Lease: 1500 * time.Millisecond}, 1500 * time.Millisecond},
	} {
		r, err := outbox.NewRelay(ob, c.cfg)
		if err != nil {
			t.Errorf("NewRelay(PublishTimeout %s, Lease %s): %v", c.cfg.PublishTimeout, c.cfg.Lease, err)
			continue
		}
		if got := outbox.RelayLease(r); got != c.want {
			t.Errorf("NewRelay(PublishTimeout %s, Lease %s): Lease = %s, want %s", c.cfg.PublishTimeout, c.cfg.Lease, got, c.want)
		}
	}
}

// TestCrashBeforePublishLosesNothing: the business transaction commits and
// the process dies before any relay ran. A relay started later (a new
// process) delivers the message to RabbitMQ.
func TestCrashBeforePublishLosesNothing(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	q := newQueue(t)
	id := keys.ChildKey("order-1", "order-placed-event/v1")
	f.placeOrder(t, "order-1", outbox.Message{Destination: q, ID: id, Body: []byte("placed")}, true)
	// A relay that locked the row and died before publishing rolls back
	// with its connection: simulate it with a transaction that locks the
	// row and then aborts.
	ctx := testCtx(t, 60*time.Second)
	tx, err := f.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1 FROM "+f.table()+" FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	_ = tx.Rollback(ctx)

	pub := newPublisher(t)
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{
		PollInterval: 10 * time.Millisecond,
		Publish: func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
			return pub.Publish(ctx, "", dest, msgs...)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := runRelay(t, relay)
	eventually(t, 20*time.Second, "the message in the queue", func() bool { return queueDepth(t, q) == 1 })
	eventually(t, 20*time.Second, "the row marked sent", func() bool { return f.count(t, f.table(), "sent_at IS NOT NULL") == 1 })
	stop()
	if s := relay.Stats(); s.Published != 1 || s.Failed != 0 {
		t.Fatalf("Stats = %+v", s)
	}
}

// TestRelayCrashAfterPublishIsAbsorbedDownstream: the relay dies, and its
// database sessions with it, after RabbitMQ confirmed the publish and before
// the row was marked sent. Once the crashed relay's lease expires the row is
// published again, and the idemq consumer downstream applies the message
// once.
func TestRelayCrashAfterPublishIsAbsorbedDownstream(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := testCtx(t, 90*time.Second)
	q := newQueue(t)

	// Downstream: an idemq consumer whose effect table has no unique
	// constraint, so a double apply would show.
	store, err := processed.New(f.pool, processed.Config{Schema: f.schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{f.schema, "shipments"}.Sanitize()
	if _, err := f.pool.Exec(ctx, "CREATE TABLE "+effects+" (message_id text NOT NULL, body text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL(), Queue: q})
	if err != nil {
		t.Fatal(err)
	}
	rt, err := consumer.New(consumer.Config{
		Name: "shipping", Source: src, Store: store, Concurrency: 2,
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+effects+" VALUES ($1, $2)", msg.ID, string(msg.Body))
			return err
		},
		DeadLetterer: consumer.DeadLettererFunc(func(_ context.Context, m *consumer.Message, fl consumer.Failure) error {
			t.Errorf("unexpected dead letter %q: %v", m.ID, fl.Err)
			return errors.New("no dead letters in this test")
		}),
		ShutdownTimeout: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	rtCtx, rtStop := context.WithCancel(context.Background())
	rtDone := make(chan error, 1)
	go func() { rtDone <- rt.Run(rtCtx) }()
	defer func() {
		rtStop()
		if err := <-rtDone; err != nil {
			t.Errorf("runtime: %v", err)
		}
	}()

	// Upstream: the order and its event commit together; the event id is
	// derived from the order id.
	id := keys.ChildKey("order-1", "order-placed-event/v1")
	f.placeOrder(t, "order-1", outbox.Message{Destination: q, ID: id, Body: []byte("ship order-1")}, true)

	// The relay has its own pool, so its sessions can be told apart and
	// killed.
	appName := "idemq-outbox-relay-" + strings.ToLower(strings.ReplaceAll(f.schema, "_", "-"))
	pcfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = appName
	relayPool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer relayPool.Close()
	relayOb, err := outbox.New(relayPool, outbox.Config{Schema: f.schema})
	if err != nil {
		t.Fatal(err)
	}

	pub := newPublisher(t)
	var (
		mu        sync.Mutex
		publishes = map[string]int{}
		killed    bool
	)
	relay, err := outbox.NewRelay(relayOb, outbox.RelayConfig{
		PollInterval:   10 * time.Millisecond,
		PublishTimeout: 2 * time.Second,
		Lease:          3 * time.Second,
		Backoff:        outbox.BackoffConfig{InitialInterval: 10 * time.Millisecond},
		Publish: func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
			if err := pub.Publish(ctx, "", dest, msgs...); err != nil {
				return err
			}
			mu.Lock()
			for _, m := range msgs {
				publishes[m.ID]++
			}
			mu.Unlock()
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	crash := errors.New("relay crashed")
	outbox.SetAfterPublish(relay, func(ctx context.Context) error {
		mu.Lock()
		first := !killed
		killed = true
		mu.Unlock()
		if !first {
			return nil
		}
		// The broker has the message. Now the relay "crashes" before it
		// records the outcome, and its database sessions die with it.
		if _, err := f.pool.Exec(ctx, `SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
WHERE application_name = $1`, appName); err != nil {
			t.Errorf("terminate relay sessions: %v", err)
		}
		return crash
	})
	stop := runRelay(t, relay)
	eventually(t, 30*time.Second, "the row marked sent", func() bool { return f.count(t, f.table(), "sent_at IS NOT NULL") == 1 })
	stop()
	mu.Lock()
	if publishes[id] != 2 {
		t.Fatalf("publishes of %s = %d, want 2 (the publish before the crash, and the retry)", id, publishes[id])
	}
	mu.Unlock()
	if s := relay.Stats(); s.Errors < 1 || s.Published != 1 {
		t.Fatalf("relay stats = %+v, want the crashed batch counted as an error and one publish recorded", s)
	}

	eventually(t, 30*time.Second, "both copies consumed", func() bool {
		s := rt.Stats()
		return s.Applied+s.Duplicates == 2 && s.InFlight == 0
	})
	if s := rt.Stats(); s.Applied != 1 || s.Duplicates != 1 {
		t.Fatalf("runtime stats = %+v, want 1 applied and 1 duplicate", s)
	}
	if n := f.count(t, effects, "message_id = $1", id); n != 1 {
		t.Fatalf("effects for %s = %d, want exactly 1", id, n)
	}
	if n := queueDepth(t, q); n != 0 {
		t.Fatalf("queue depth = %d, want 0", n)
	}
}

// TestAfterPublishHookAbortLeavesRowPending checks the test hook that stands
// for a crash between publish and recording the outcome: nothing is
// recorded, and once the lease expires the next batch publishes the row
// again.
func TestAfterPublishHookAbortLeavesRowPending(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	broker := memory.NewBroker()
	f.placeOrder(t, "o1", outbox.Message{Destination: "q", ID: "e1", Body: []byte("x")}, true)
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{Publish: broker.Publish, PublishTimeout: 100 * time.Millisecond, Lease: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	crash := errors.New("crash")
	outbox.SetAfterPublish(relay, func(context.Context) error { return crash })
	ctx := testCtx(t, 30*time.Second)
	if _, err := relay.RelayOnce(ctx); !errors.Is(err, crash) {
		t.Fatalf("RelayOnce = %v, want the crash", err)
	}
	if n := f.count(t, f.table(), "sent_at IS NULL AND attempts = 0"); n != 1 {
		t.Fatalf("untouched pending rows = %d, want 1", n)
	}
	// The crashed batch's lease holds the row until it expires.
	outbox.SetAfterPublish(relay, nil)
	if st, err := f.ob.Stats(ctx); err != nil || st.Leased != 1 {
		t.Fatalf("Stats after the crash = %+v, %v; want the row leased", st, err)
	}
	if n, err := relay.RelayOnce(ctx); err != nil || n != 0 {
		t.Fatalf("RelayOnce under the lease = %d, %v; want nothing due", n, err)
	}
	eventually(t, 10*time.Second, "the lease to expire", func() bool {
		st, err := f.ob.Stats(ctx)
		return err == nil && st.Leased == 0
	})
	if n, err := relay.RelayOnce(ctx); err != nil || n != 1 {
		t.Fatalf("RelayOnce = %d, %v", n, err)
	}
	if got := len(broker.Messages("q")); got != 2 {
		t.Fatalf("published copies = %d, want 2", got)
	}
	if n, err := relay.RelayOnce(ctx); err != nil || n != 0 {
		t.Fatalf("RelayOnce after sent = %d, %v; want nothing due", n, err)
	}
}

// TestConcurrentRelaysNeverDoubleSend runs two relays over one table. Each
// relay's first publish waits until the other relay is publishing too, so
// the two really hold batches at the same time; no message id is published
// twice.
func TestConcurrentRelaysNeverDoubleSend(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	q := newQueue(t)
	const total = 300
	ctx := testCtx(t, 60*time.Second)
	for batch := 0; batch < total/100; batch++ {
		err := pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error {
			for i := batch * 100; i < (batch+1)*100; i++ {
				id := keys.ChildKey(fmt.Sprintf("order-%d", i), "order-placed-event/v1")
				if err := f.ob.Enqueue(ctx, tx, outbox.Message{Destination: q, ID: id, Body: []byte(id)}); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	pub := newPublisher(t)
	var (
		mu     sync.Mutex
		counts = map[string]int{}
		arrive sync.WaitGroup
	)
	arrive.Add(2)
	allIn := make(chan struct{})
	go func() { arrive.Wait(); close(allIn) }()
	newRelay := func() *outbox.Relay {
		first := true
		r, err := outbox.NewRelay(f.ob, outbox.RelayConfig{
			BatchSize:    10,
			PollInterval: 10 * time.Millisecond,
			Publish: func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
				if first {
					first = false
					arrive.Done()
					select {
					case <-allIn:
					case <-time.After(20 * time.Second):
						t.Error("the other relay never published while this one held a batch")
					}
				}
				if err := pub.Publish(ctx, "", dest, msgs...); err != nil {
					return err
				}
				mu.Lock()
				for _, m := range msgs {
					counts[m.ID]++
				}
				mu.Unlock()
				return nil
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	r1, r2 := newRelay(), newRelay()
	stop1, stop2 := runRelay(t, r1), runRelay(t, r2)
	eventually(t, 40*time.Second, "every row sent", func() bool { return f.count(t, f.table(), "sent_at IS NOT NULL") == total })
	stop1()
	stop2()
	mu.Lock()
	defer mu.Unlock()
	if len(counts) != total {
		t.Fatalf("distinct ids published = %d, want %d", len(counts), total)
	}
	for id, n := range counts {
		if n != 1 {
			t.Errorf("id %s published %d times", id, n)
		}
	}
	s1, s2 := r1.Stats(), r2.Stats()
	if s1.Published == 0 || s2.Published == 0 || s1.Published+s2.Published != total {
		t.Fatalf("relay stats %+v and %+v, want both publishing, %d in all", s1, s2, total)
	}
	if n := queueDepth(t, q); n != total {
		t.Fatalf("queue depth = %d, want %d", n, total)
	}
}

type failHook struct {
	outbox.HookDefaults
	mu      sync.Mutex
	retryIn []time.Duration
	ok      int
}

func (h *failHook) OnPublishFailed(_ context.Context, _ string, _ []*consumer.Message, _ error, retryIn time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.retryIn = append(h.retryIn, retryIn)
}

func (h *failHook) OnPublished(context.Context, string, []*consumer.Message, time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ok++
}

// TestRetriesWithBackoff: a failing publish is recorded on the row and
// retried no sooner than the backoff allows, which doubles each time.
func TestRetriesWithBackoff(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	broker := memory.NewBroker()
	f.placeOrder(t, "o1", outbox.Message{Destination: "q", ID: "e1", Body: []byte("x")}, true)
	var (
		mu    sync.Mutex
		calls []time.Time
	)
	hook := &failHook{}
	const initial = 150 * time.Millisecond
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{
		PollInterval: 5 * time.Millisecond,
		Backoff:      outbox.BackoffConfig{InitialInterval: initial, Jitter: -1},
		Hooks:        []outbox.Hook{hook},
		Publish: func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
			mu.Lock()
			calls = append(calls, time.Now())
			n := len(calls)
			mu.Unlock()
			if n <= 2 {
				return fmt.Errorf("broker unavailable (attempt %d)", n)
			}
			return broker.Publish(ctx, dest, msgs...)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := runRelay(t, relay)
	eventually(t, 20*time.Second, "the row sent", func() bool { return f.count(t, f.table(), "sent_at IS NOT NULL") == 1 })
	stop()

	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 3 {
		t.Fatalf("publish calls = %d, want 3", len(calls))
	}
	// The database clock schedules retries; allow a little skew.
	const slack = 20 * time.Millisecond
	if d := calls[1].Sub(calls[0]); d < initial-slack {
		t.Errorf("first retry after %s, want at least %s", d, initial)
	}
	if d := calls[2].Sub(calls[1]); d < 2*initial-slack {
		t.Errorf("second retry after %s, want at least %s", d, 2*initial)
	}
	var (
		attempts int
		lastErr  string
	)
	if err := f.pool.QueryRow(testCtx(t, 10*time.Second), "SELECT attempts, last_error FROM "+f.table()).Scan(&attempts, &lastErr); err != nil {
		t.Fatal(err)
	}
	if attempts != 3 || !strings.Contains(lastErr, "attempt 2") {
		t.Fatalf("row: attempts %d, last_error %q", attempts, lastErr)
	}
	if s := relay.Stats(); s.Failed != 2 || s.Published != 1 {
		t.Fatalf("Stats = %+v", s)
	}
	hook.mu.Lock()
	defer hook.mu.Unlock()
	if len(hook.retryIn) != 2 || hook.retryIn[0] != initial || hook.retryIn[1] != 2*initial || hook.ok != 1 {
		t.Fatalf("hooks: retryIn %v, published %d", hook.retryIn, hook.ok)
	}
	if len(broker.Messages("q")) != 1 {
		t.Fatalf("delivered %d", len(broker.Messages("q")))
	}
}

func TestBackoffDelay(t *testing.T) {
	b := outbox.BackoffConfig{InitialInterval: time.Second, MaxInterval: 5 * time.Second, Jitter: -1}
	for attempts, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 5 * time.Second, 1000: 5 * time.Second} {
		if _, got := outbox.Delay(b, attempts); time.Duration(got) != want {
			t.Errorf("delay(%d) = %s, want %s", attempts, time.Duration(got), want)
		}
	}
	b.Jitter = 0.5
	for range 100 {
		if _, got := outbox.Delay(b, 1); time.Duration(got) < 500*time.Millisecond || time.Duration(got) > 1500*time.Millisecond {
			t.Fatalf("jittered delay %s out of range", time.Duration(got))
		}
	}
}

func TestPurgeDeletesOnlyOldSentRows(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := testCtx(t, 30*time.Second)
	for i := range 5 {
		f.placeOrder(t, fmt.Sprint("o", i), outbox.Message{Destination: "q", ID: fmt.Sprint("e", i), Body: []byte("x")}, true)
	}
	// e0, e1: sent long ago; e2: sent just now; e3: pending and old; e4:
	// pending.
	if _, err := f.pool.Exec(ctx, "UPDATE "+f.table()+` SET sent_at = now() - interval '2 hours' WHERE message_id IN ('e0', 'e1');
UPDATE `+f.table()+` SET sent_at = now() WHERE message_id = 'e2';
UPDATE `+f.table()+` SET created_at = now() - interval '3 hours' WHERE message_id = 'e3'`); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(f.pool, outbox.Config{Schema: f.schema, PurgeBatchSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	n, err := ob.Purge(ctx, time.Hour)
	if err != nil || n != 2 {
		t.Fatalf("Purge = %d, %v; want 2", n, err)
	}
	var left []string
	rows, _ := f.pool.Query(ctx, "SELECT message_id FROM "+f.table()+" ORDER BY message_id")
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || strings.Join(left, ",") != "e2,e3,e4" {
		t.Fatalf("left %v, %v", left, err)
	}
	if _, err := ob.Purge(ctx, 0); err == nil {
		t.Error("Purge(0): want error")
	}
	st, err := ob.Stats(ctx)
	if err != nil || st.Pending != 2 || st.Sent != 1 {
		t.Fatalf("Stats = %+v, %v", st, err)
	}
}

// TestRelayRetentionPurges checks the relay's own janitor.
func TestRelayRetentionPurges(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.placeOrder(t, "o1", outbox.Message{Destination: "q", ID: "e1", Body: []byte("x")}, true)
	if _, err := f.pool.Exec(testCtx(t, 10*time.Second), "UPDATE "+f.table()+" SET sent_at = now() - interval '2 hours'"); err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{
		Publish: memory.NewBroker().Publish, Retention: time.Hour, PurgeInterval: 10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	runRelay(t, relay)
	eventually(t, 10*time.Second, "the purge", func() bool { return relay.Stats().Purged == 1 })
	if n := f.count(t, f.table(), ""); n != 0 {
		t.Fatalf("rows = %d", n)
	}
}

// TestMigrateFromVersion1 upgrades a version 1 table holding pending,
// failing and sent rows: migration 0002 adds the lease columns, the rows
// relay as before, and applying 0002 again to a table that already has the
// columns is harmless.
func TestMigrateFromVersion1(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := testCtx(t, 30*time.Second)
	migrations := pgx.Identifier{f.schema, "outbox_migrations"}.Sanitize()
	// Back to version 1: the lease columns and 0002's record go.
	if _, err := f.pool.Exec(ctx, "ALTER TABLE "+f.table()+" DROP COLUMN lease_token, DROP COLUMN lease_owner; DELETE FROM "+migrations+" WHERE version > 1"); err != nil {
		t.Fatal(err)
	}
	if v, err := f.ob.Version(ctx); err != nil || v != 1 {
		t.Fatalf("Version = %d, %v; want 1", v, err)
	}
	for i := range 3 {
		f.placeOrder(t, fmt.Sprint("o", i), outbox.Message{Destination: "q", ID: fmt.Sprint("e", i), Body: []byte("x")}, true)
	}
	if _, err := f.pool.Exec(ctx, "UPDATE "+f.table()+` SET attempts = 2, last_error = 'broker down' WHERE message_id = 'e1';
UPDATE `+f.table()+` SET sent_at = now(), attempts = 1 WHERE message_id = 'e2'`); err != nil {
		t.Fatal(err)
	}
	broker := memory.NewBroker()
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{Publish: broker.Publish})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := relay.RelayOnce(ctx); err == nil {
		t.Fatal("RelayOnce on a version 1 table: want an error")
	}
	if err := f.ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if v, err := f.ob.Version(ctx); err != nil || v != len(outbox.Migrations()) {
		t.Fatalf("Version after Migrate = %d, %v; want %d", v, err, len(outbox.Migrations()))
	}
	if n, err := relay.RelayOnce(ctx); err != nil || n != 2 {
		t.Fatalf("RelayOnce after Migrate = %d, %v; want the 2 pending rows", n, err)
	}
	if n := f.count(t, f.table(), "sent_at IS NOT NULL AND lease_token IS NULL AND lease_owner IS NULL"); n != 3 {
		t.Fatalf("sent rows = %d, want 3", n)
	}
	if n := f.count(t, f.table(), "message_id = 'e1' AND attempts = 3"); n != 1 {
		t.Fatal("the failing row's attempts were not carried over")
	}
	if got := len(broker.Messages("q")); got != 2 {
		t.Fatalf("published %d, want 2", got)
	}
	// 0002 again, on a table that has its columns but no record of it.
	if _, err := f.pool.Exec(ctx, "DELETE FROM "+migrations+" WHERE version > 1"); err != nil {
		t.Fatal(err)
	}
	if err := f.ob.Migrate(ctx); err != nil {
		t.Fatalf("Migrate over existing lease columns: %v", err)
	}
	if v, err := f.ob.Version(ctx); err != nil || v != len(outbox.Migrations()) {
		t.Fatalf("Version = %d, %v", v, err)
	}
}

// indexed is a broker adapter's own error naming a failed message, with
// MessageIndex as outbox.MessageError has it.
type indexed struct{ i int }

func (e indexed) Error() string     { return fmt.Sprintf("message %d nacked", e.i) }
func (e indexed) MessageIndex() int { return e.i }

func TestMessageErrors(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	me := func(i int) error { return &outbox.MessageError{Index: i, Err: boom} }
	for _, c := range []struct {
		name string
		err  error
		want []int // nil: the error names no message
	}{
		{"alone", me(1), []int{1}},
		{"wrapped", fmt.Errorf("publish: %w", me(2)), []int{2}},
		{"joined", errors.Join(me(0), me(2)), []int{0, 2}},
		{"wrapped join", fmt.Errorf("publish: %w", errors.Join(me(0), indexed{1})), []int{0, 1}},
		{"an adapter's own type", errors.Join(indexed{2}), []int{2}},
		{"plain", boom, nil},
		{"joined with a plain error", errors.Join(me(0), boom), nil},
		{"out of range", me(3), nil},
		{"negative", me(-1), nil},
	} {
		got, ok := outbox.MessageErrors(c.err, 3)
		if ok != (c.want != nil) || len(got) != len(c.want) {
			t.Errorf("%s: messageErrors = %v, %v; want %v", c.name, got, ok, c.want)
			continue
		}
		for _, i := range c.want {
			if got[i] == nil {
				t.Errorf("%s: message %d not named: %v", c.name, i, got)
			}
		}
	}
	if got, _ := outbox.MessageErrors(me(1), 3); !errors.Is(got[1], boom) {
		t.Errorf("the named error %v does not wrap the cause", got[1])
	}
}

// TestBrokerDownFailsTheGroupWithoutOneCallPerMessage: when the broker fails
// every call, the one-at-a-time pass after a failed group call stops after
// two calls, and every row fails with its own backoff.
func TestBrokerDownFailsTheGroupWithoutOneCallPerMessage(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	for i := range 5 {
		f.placeOrder(t, fmt.Sprint("o", i), outbox.Message{Destination: "q", ID: fmt.Sprint("e", i), Body: []byte("x")}, true)
	}
	var (
		mu    sync.Mutex
		calls []int
	)
	hook := &failHook{}
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{
		Hooks: []outbox.Hook{hook},
		Publish: func(_ context.Context, _ string, msgs ...*consumer.Message) error {
			mu.Lock()
			defer mu.Unlock()
			calls = append(calls, len(msgs))
			return errors.New("connection refused")
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := relay.RelayOnce(testCtx(t, 30*time.Second)); err != nil || n != 5 {
		t.Fatalf("RelayOnce = %d, %v", n, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(calls) != "[5 1 1]" {
		t.Errorf("Publish calls of %v messages, want [5 1 1]", calls)
	}
	if n := f.count(t, f.table(), "sent_at IS NULL AND attempts = 1 AND last_error = 'connection refused' AND next_attempt_at > now() AND lease_token IS NULL"); n != 5 {
		t.Errorf("rows failed and rescheduled = %d, want 5", n)
	}
	if s := relay.Stats(); s.Failed != 5 || s.Published != 0 {
		t.Errorf("Stats = %+v", s)
	}
	hook.mu.Lock()
	defer hook.mu.Unlock()
	if len(hook.retryIn) != 3 || hook.ok != 0 {
		t.Errorf("failure hooks called %d times (%d published), want 3: two single messages and the three left", len(hook.retryIn), hook.ok)
	}
}

func TestRelayPublishesKeyAsRecordKey(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.placeOrder(t, "order-1", outbox.Message{Destination: "orders", ID: "e1", Key: "cust-1", Body: []byte("placed")}, true)
	f.placeOrder(t, "order-2", outbox.Message{Destination: "orders", ID: "e2", Body: []byte("placed")}, true)
	got := make(chan *consumer.Message, 2)
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{Publish: func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
		for _, m := range msgs {
			got <- m.Clone()
		}
		return nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := relay.RelayOnce(testCtx(t, 20*time.Second)); n != 2 || err != nil {
		t.Fatalf("RelayOnce = %d, %v", n, err)
	}
	for range 2 {
		m := <-got
		want := map[string]string{"e1": "cust-1", "e2": ""}[m.ID]
		if m.Key != want || string(m.RecordKey) != want || (want == "" && m.RecordKey != nil) {
			t.Errorf("%s: Key %q RecordKey %q, want %q for both (nil without a key)", m.ID, m.Key, m.RecordKey, want)
		}
	}
}

// A PublishFunc that panics fails its rows, with backoff, instead of
// crashing the relay with the rows leased.
func TestPublishFuncPanicFailsTheRow(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.placeOrder(t, "o1", outbox.Message{Destination: "q", ID: "e1", Body: []byte("x")}, true)
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{
		Publish: func(context.Context, string, ...*consumer.Message) error { panic("boom") },
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t, 30*time.Second)
	if n, err := relay.RelayOnce(ctx); err != nil || n != 1 {
		t.Fatalf("RelayOnce = %d, %v; want 1, nil", n, err)
	}
	if n := f.count(t, f.table(), "sent_at IS NULL AND attempts = 1 AND lease_token IS NULL AND strpos(last_error, $1) > 0", "panicked: boom"); n != 1 {
		t.Fatalf("failed rows recording the panic = %d, want 1", n)
	}
}

type panicHook struct{ outbox.HookDefaults }

func (panicHook) OnPublished(context.Context, string, []*consumer.Message, time.Duration) {
	panic("hook")
}

// A panicking hook is ignored: the confirmed row is still marked sent.
func TestPanickingHookDoesNotStopTheRelay(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	broker := memory.NewBroker()
	f.placeOrder(t, "o1", outbox.Message{Destination: "q", ID: "e1", Body: []byte("x")}, true)
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{Publish: broker.Publish, Hooks: []outbox.Hook{panicHook{}}})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := relay.RelayOnce(testCtx(t, 30*time.Second)); err != nil || n != 1 {
		t.Fatalf("RelayOnce = %d, %v; want 1, nil", n, err)
	}
	if n := f.count(t, f.table(), "sent_at IS NOT NULL"); n != 1 {
		t.Fatalf("sent rows = %d, want 1", n)
	}
}

// Once the lease runs short, the rows the relay did not get to are released
// unpublished at once: not failed, not left leased.
func TestLeaseRunningOutReleasesUnpublishedRows(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.placeOrder(t, "o1", outbox.Message{Destination: "slow", ID: "e1", Body: []byte("x")}, true)
	f.placeOrder(t, "o2", outbox.Message{Destination: "later", ID: "e2", Body: []byte("y")}, true)
	var calls []string
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{
		PublishTimeout: 100 * time.Millisecond,
		Lease:          300 * time.Millisecond,
		Publish: func(_ context.Context, dest string, _ ...*consumer.Message) error {
			calls = append(calls, dest)
			time.Sleep(300 * time.Millisecond) // past the point where the relay stops publishing
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := relay.RelayOnce(testCtx(t, 30*time.Second)); err != nil || n != 2 {
		t.Fatalf("RelayOnce = %d, %v; want 2, nil", n, err)
	}
	if len(calls) != 1 || calls[0] != "slow" {
		t.Fatalf("Publish calls = %v, want only slow", calls)
	}
	if n := f.count(t, f.table(), "destination = 'slow' AND sent_at IS NOT NULL"); n != 1 {
		t.Fatalf("sent slow rows = %d, want 1", n)
	}
	if n := f.count(t, f.table(), "destination = 'later' AND sent_at IS NULL AND attempts = 0 AND lease_token IS NULL AND next_attempt_at <= now()"); n != 1 {
		t.Fatalf("released later rows = %d, want 1", n)
	}
}

// A failure is fenced like a success: once another relay holds the row's
// lease, the first relay's failure (attempts, last_error, backoff) is not
// recorded over it.
func TestFencingExpiredLeaseCannotRecordFailure(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.placeOrder(t, "o1", outbox.Message{Destination: "q", ID: "e1", Body: []byte("x")}, true)
	const other = "00000000-0000-4000-8000-000000000001"
	relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{
		Publish: func(ctx context.Context, _ string, _ ...*consumer.Message) error {
			// Another relay claims the row meanwhile, as after an
			// expired lease.
			if _, err := f.pool.Exec(ctx, "UPDATE "+f.table()+" SET lease_token = $1, lease_owner = 'other'", other); err != nil {
				return err
			}
			return errors.New("nacked")
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := relay.RelayOnce(testCtx(t, 30*time.Second)); err != nil || n != 1 {
		t.Fatalf("RelayOnce = %d, %v; want 1, nil", n, err)
	}
	if n := f.count(t, f.table(), "sent_at IS NULL AND attempts = 0 AND last_error IS NULL AND lease_token = $1", other); n != 1 {
		t.Fatalf("rows still held by the other relay, untouched = %d, want 1", n)
	}
	if s := relay.Stats(); s.Failed != 0 || s.Fenced != 1 {
		t.Fatalf("stats = %+v, want the failure fenced", s)
	}
}
