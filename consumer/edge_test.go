package consumer_test

// Regression tests for the edges of issue 14: each failed (or, for the
// crashes, killed the test binary) on 8924c08.

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// uniqueTable creates a table with a unique column, for handlers that
// provoke a unique_violation.
func (b *bundle) uniqueTable(name string) string {
	b.t.Helper()
	qt := pgx.Identifier{b.schema, name}.Sanitize()
	if _, err := b.pool.Exec(context.Background(), "CREATE TABLE "+qt+" (v text UNIQUE); INSERT INTO "+qt+" VALUES ('taken')"); err != nil {
		b.t.Fatal(err)
	}
	return qt
}

// swallowing is a handler that, for a body "poison", runs an INSERT that
// violates a unique constraint and ignores its error (a common idiom), then
// returns nil; other bodies get the normal effect.
func (b *bundle) swallowing(qt string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if string(m.Body) == "poison" {
			_, _ = tx.Exec(ctx, "INSERT INTO "+qt+" VALUES ('taken')") // error ignored
			return nil
		}
		return b.insertEffect(ctx, tx, m)
	}
}

func TestEdgeIgnoredStatementErrorIsHandlerError(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	qt := b.uniqueTable("taken")
	b.publish(&consumer.Message{ID: "poison", Key: "k", Body: []byte("poison")},
		&consumer.Message{ID: "next", Key: "k", Body: []byte("next")})
	cfg := b.config(b.swallowing(qt))
	cfg.Retry.MaxAttempts = 3
	r := start(t, cfg)
	waitFor(t, "poison dead-lettered and its key's next message applied", func() bool {
		return r.rt.Stats().DeadLettered == 1 && r.rt.Stats().Applied == 1 && b.settled()
	})
	s := r.rt.Stats()
	if s.DBErrors != 0 || s.Retries != 2 {
		t.Errorf("stats %+v: an ignored statement error is the handler's, retried on its budget (2 retries), not a database error", s)
	}
	dl := b.dlq.list()
	if len(dl) != 1 || dl[0].f.Class != consumer.ClassRetryableExhausted || !strings.Contains(dl[0].f.Err.Error(), "ignoring its error") {
		t.Fatalf("dead letters %+v: want one retryable-exhausted saying the statement's error was ignored", dl)
	}
	if got := b.effectCounts(); len(got) != 1 || got["next"] != 1 {
		t.Fatalf("effects %v, want next once", got)
	}
}

func TestEdgeIgnoredStatementErrorInBatchSinksOnlyItself(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	qt := b.uniqueTable("taken")
	b.publish(msg("a", "a"), msg("b", "b"), msg("poison", "poison"), msg("c", "c"), msg("d", "d"))
	cfg := b.config(b.swallowing(qt))
	cfg.BatchSize, cfg.BatchWait, cfg.Concurrency = 5, 500*time.Millisecond, 1
	cfg.Retry.MaxAttempts = 2
	r := start(t, cfg)
	waitFor(t, "four applied and the poison dead-lettered", func() bool {
		return r.rt.Stats().Applied == 4 && r.rt.Stats().DeadLettered == 1 && b.settled()
	})
	got := b.effectCounts()
	for _, id := range []string{"a", "b", "c", "d"} {
		if got[id] != 1 {
			t.Errorf("%s applied %d times, want 1", id, got[id])
		}
	}
	if len(got) != 4 || r.rt.Stats().DBErrors != 0 {
		t.Errorf("effects %v, stats %+v", got, r.rt.Stats())
	}
}

func TestEdgeHandlerEndingTheTransactionIsDeadLettered(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			b := newBundle(t)
			b.publish(msg("m", "x"), msg("after", "y"))
			r := start(t, b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				if m.ID == "after" {
					return b.insertEffect(ctx, tx, m)
				}
				if err := b.insertEffect(ctx, tx, m); err != nil {
					return err
				}
				if end == "commit" {
					_ = tx.Commit(ctx) // the error is ignored, as careless code does
				} else {
					_ = tx.Rollback(ctx)
				}
				return nil
			}))
			waitFor(t, "dead-lettered", func() bool { return r.rt.Stats().DeadLettered == 1 && r.rt.Stats().Applied == 1 && b.settled() })
			dl := b.dlq.list()
			if dl[0].f.Class != consumer.ClassPermanent || !strings.Contains(dl[0].f.Err.Error(), "called tx.Commit or tx.Rollback") {
				t.Fatalf("dead letter %v (%s): want permanent, saying the handler ended the transaction", dl[0].f.Err, dl[0].f.Class)
			}
			if s := r.rt.Stats(); s.DBErrors != 0 || s.Retries != 0 {
				t.Fatalf("stats %+v: misuse is not a database error and is not retried", s)
			}
			if got := b.effectCounts(); got["m"] != 0 || got["after"] != 1 {
				t.Fatalf("effects %v: the misusing handler's effect must not be committed", got)
			}
		})
	}
}

func TestEdgeRunReturnsWhenSourceClosesWithRetention(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	cfg := b.config(b.insertEffect)
	cfg.Retention, cfg.JanitorInterval = time.Hour, time.Hour
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	time.Sleep(50 * time.Millisecond)
	_ = cfg.Source.Close() // the source ends underneath the runtime
	select {
	case err := <-done:
		if !errors.Is(err, consumer.ErrSourceClosed) {
			t.Fatalf("Run = %v, want ErrSourceClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its source closed (the janitor kept it waiting)")
	}
}

// seqDLQ records the sequence number at which each dead letter was stored.
type seqDLQ struct {
	seq      *atomic.Int64
	failures atomic.Int32 // calls to fail before storing
	mu       sync.Mutex
	stored   map[string]int64
}

func (d *seqDLQ) DeadLetter(_ context.Context, m *consumer.Message, _ consumer.Failure) error {
	if d.failures.Add(-1) >= 0 {
		return errors.New("dead-letter queue unavailable")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stored[m.ID] = d.seq.Add(1)
	return nil
}

func TestEdgeDeadLetterFailureKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{false, true} {
		name := "per-message"
		if batch {
			name = "batch"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := newBundle(t)
			var seq atomic.Int64
			var mu sync.Mutex
			applied := map[string]int64{}
			dlq := &seqDLQ{seq: &seq, stored: map[string]int64{}}
			dlq.failures.Store(6) // more than the old code's three tries
			b.publish(&consumer.Message{ID: "first", Key: "k", Body: []byte("poison")},
				&consumer.Message{ID: "second", Key: "k", Body: []byte("ok")})
			cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				if string(m.Body) == "poison" {
					return consumer.Permanent(errors.New("bad input"))
				}
				mu.Lock()
				applied[m.ID] = seq.Add(1)
				mu.Unlock()
				return b.insertEffect(ctx, tx, m)
			})
			cfg.DeadLetterer = dlq
			if batch {
				cfg.BatchSize, cfg.BatchWait = 10, 100*time.Millisecond
			}
			r := start(t, cfg)
			waitFor(t, "settled", func() bool { return r.rt.Stats().DeadLettered == 1 && r.rt.Stats().Applied == 1 && b.settled() })
			dlq.mu.Lock()
			first := dlq.stored["first"]
			dlq.mu.Unlock()
			mu.Lock()
			second := applied["second"]
			mu.Unlock()
			if first == 0 || second < first {
				t.Fatalf("key k: first was dead-lettered at step %d, second applied at step %d: same key, same order", first, second)
			}
			if s := r.rt.Stats(); s.Requeued != 0 || s.Received != 2 {
				t.Fatalf("stats %+v: the failed dead letter is retried in place, not requeued", s)
			}
		})
	}
}

func TestEdgeConnAsDBRejected(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	ctx := context.Background()
	// A pgx.Tx is not a processed.DB (it has no BeginTx), so it cannot be
	// passed: with a pgx.Tx as the database, a message would be acked while
	// its effect is only a released savepoint.
	var ce *consumer.ConfigError
	conn, err := pgx.ConnectConfig(ctx, b.pool.Config().ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	onConn, err := processed.New(conn, processed.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		mod  func(*consumer.Config)
		ok   bool
	}{
		{"conn at default concurrency", func(c *consumer.Config) { c.Store = onConn }, false},
		{"conn with retention", func(c *consumer.Config) { c.Store, c.Concurrency, c.Retention = onConn, 1, time.Hour }, false},
		{"conn alone", func(c *consumer.Config) { c.Store, c.Concurrency = onConn, 1 }, true},
	} {
		cfg := b.config(b.insertEffect)
		tc.mod(&cfg)
		_, err := consumer.New(cfg)
		switch {
		case tc.ok && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case !tc.ok && (!errors.As(err, &ce) || ce.Field != "Store"):
			t.Errorf("%s: New = %v, want a ConfigError on Store", tc.name, err)
		}
	}
}

func TestEdgeConnectionKillingMessageIsDeadLettered(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("killer", "kill"), msg("a", "a"), msg("b", "b"))
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if string(m.Body) == "kill" {
			_, err := tx.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
			return err
		}
		return b.insertEffect(ctx, tx, m)
	})
	cfg.Concurrency = 2
	r := start(t, cfg)
	waitFor(t, "the killer dead-lettered, the others applied", func() bool {
		return r.rt.Stats().DeadLettered == 1 && r.rt.Stats().Applied == 2 && b.settled()
	})
	dl := b.dlq.list()
	if dl[0].msg.ID != "killer" || dl[0].f.Class != consumer.ClassRetryableExhausted || !strings.Contains(dl[0].f.Err.Error(), "lost the database connection 5 times") {
		t.Fatalf("dead letter %s %s: %v", dl[0].msg.ID, dl[0].f.Class, dl[0].f.Err)
	}
	if s := r.rt.Stats(); s.DBErrors < 5 {
		t.Fatalf("stats %+v: each loss is a database error first", s)
	}
}

type panickyHook struct{ consumer.HookDefaults }

func (panickyHook) OnReceived(context.Context, *consumer.Message) { panic("hook: received") }
func (panickyHook) OnApplied(context.Context, *consumer.Message, time.Duration, time.Duration) {
	panic("hook: applied")
}
func (panickyHook) OnDeadLettered(context.Context, *consumer.Message, consumer.Failure) {
	panic("hook: dead-lettered")
}

func TestEdgePanicsOutsideTheHandlerAreRecovered(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("ok-1", "fine"), msg("bad-id", "boom"), msg("ok-2", "fine"))
	cfg := b.config(b.insertEffect)
	cfg.MessageID = func(m *consumer.Message) (string, error) {
		if string(m.Body) == "boom" {
			var headers map[string]string
			headers["x"] = "nil map write" // a body-dependent panic
		}
		return m.ID, nil
	}
	cfg.Hooks = []consumer.Hook{panickyHook{}}
	var dlqPanics atomic.Int32
	cfg.DeadLetterer = consumer.DeadLettererFunc(func(ctx context.Context, m *consumer.Message, f consumer.Failure) error {
		if dlqPanics.Add(1) == 1 {
			panic("dead-letterer: first call")
		}
		return b.dlq.DeadLetter(ctx, m, f)
	})
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return r.rt.Stats().Applied == 2 && r.rt.Stats().DeadLettered == 1 && b.settled() })
	dl := b.dlq.list()
	if len(dl) != 1 || dl[0].f.Class != consumer.ClassMissingID || !strings.Contains(dl[0].f.Err.Error(), "panicked") {
		t.Fatalf("dead letters %+v: want the panicking id dead-lettered as missing-id with the panic", dl)
	}
}

func TestEdgeMissingDedupTableStopsRun(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{false, true} {
		b := newBundle(t)
		store, err := processed.New(b.pool, processed.Config{Schema: testdb.Schema(t)}) // never migrated
		if err != nil {
			t.Fatal(err)
		}
		b.publish(msgs("m", 3)...)
		cfg := b.config(b.insertEffect)
		cfg.Store = store
		if batch {
			cfg.BatchSize = 10
		}
		rt, err := consumer.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- rt.Run(context.Background()) }()
		select {
		case err := <-done:
			if !errors.Is(err, consumer.ErrNotMigrated) {
				t.Fatalf("batch=%v: Run = %v, want ErrNotMigrated", batch, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("batch=%v: Run kept retrying a missing dedup table", batch)
		}
		if n := b.broker.Ready(queue); n != 3 || rt.Stats().Applied != 0 {
			t.Fatalf("batch=%v: %d ready after the stop, stats %+v: nothing may be acked", batch, n, rt.Stats())
		}
	}
}

func TestEdgeMismatchFailureCarriesOriginalProcessedAt(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("m", "one"))
	r := start(t, b.config(b.insertEffect))
	waitFor(t, "applied", func() bool { return r.rt.Stats().Applied == 1 && b.settled() })
	row, err := b.store.Lookup(context.Background(), "test-consumer", "m")
	if err != nil {
		t.Fatal(err)
	}
	b.publish(msg("m", "two"))
	waitFor(t, "mismatch dead-lettered", func() bool { return r.rt.Stats().DeadLettered == 1 && b.settled() })
	f := b.dlq.list()[0].f
	if f.Class != consumer.ClassFingerprintMismatch || !f.ProcessedAt.Equal(row.ProcessedAt) {
		t.Fatalf("failure %s ProcessedAt %v, want the original's %v", f.Class, f.ProcessedAt, row.ProcessedAt)
	}
}
