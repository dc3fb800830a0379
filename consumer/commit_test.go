package consumer_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// commits records the HookCommit calls.
type commits struct {
	consumer.HookDefaults
	mu    sync.Mutex
	calls []commitCall
}

type commitCall struct {
	applied int
	dur     time.Duration
	err     error
}

func (c *commits) OnCommit(_ context.Context, applied int, dur time.Duration, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, commitCall{applied, dur, err})
}

func (c *commits) list() []commitCall {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]commitCall(nil), c.calls...)
}

// logBuffer is a log the runtime writes and the test reads.
type logBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestHardStopNeverCancelsCommit: on a server of the test's own whose
// COMMITs wait for a synchronous standby that never connects, a message's
// COMMIT waits; a hard stop does not cancel it, although the store's pool
// answers a cancelled context with a cancel request, which Postgres would
// answer by committing locally and reporting success: the message stays
// unacked. The slow COMMIT is logged while it waits. Once the standby is
// no longer required, the COMMIT returns, the message is acked, its
// duration is logged and measured, and Run returns.
func TestHardStopNeverCancelsCommit(t *testing.T) {
	t.Parallel()
	primary := testdb.NewCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conf, err := pgxpool.ParseConfig(primary.URL())
	if err != nil {
		t.Fatal(err)
	}
	conf.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: 10 * time.Second}
	}
	pool, err := pgxpool.NewWithConfig(ctx, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	store, err := processed.New(pool, processed.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	primary.Exec(t, "CREATE TABLE effects (message_id text)")
	primary.Set(t, "synchronous_standby_names", "ghost")

	broker := memory.NewBroker()
	sub, err := broker.Subscribe(queue, memory.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var log logBuffer
	hook := &commits{}
	rt, err := consumer.New(consumer.Config{
		Name: "sync", Source: sub, Store: store,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO effects VALUES ($1)", m.ID)
			return err
		},
		Concurrency: 1, BatchSize: 1, ShutdownTimeout: 200 * time.Millisecond, SlowCommit: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&log, nil)), Hooks: []consumer.Hook{hook},
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- rt.Run(runCtx) }()
	if err := broker.Publish(ctx, queue, msg("m1", "x")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a COMMIT waiting for the synchronous standby", func() bool {
		var n int
		_ = primary.QueryRow(t, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'").Scan(&n)
		return n == 1
	})

	// Stop: the soft stop ends after 200ms, then the hard stop.
	stop()
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) while the COMMIT waited; stats %+v, log:\n%s", err, rt.Stats(), log.String())
	case <-time.After(time.Second):
	}
	if s := rt.Stats(); s.Applied != 0 || broker.Unacked(queue) != 1 {
		t.Fatalf("after the hard stop, with the COMMIT waiting: stats %+v, %d unacked; want nothing applied or acked, log:\n%s",
			s, broker.Unacked(queue), log.String())
	}
	if l := log.String(); !strings.Contains(l, `level=WARN msg="idemq: a COMMIT is slow: it still waits for the database's answer"`) ||
		!strings.Contains(l, `message_id=m1 waited=100ms messages=1`) {
		t.Errorf("no slow-COMMIT warning while it waits:\n%s", log.String())
	}

	// The standby is no longer required: the COMMIT returns.
	primary.Set(t, "synchronous_standby_names", "")
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("Run did not return once the COMMIT could; log:\n%s", log.String())
	}
	if s := rt.Stats(); s.Applied != 1 || !memory.Drained(broker.Stats(queue)) {
		t.Fatalf("once the COMMIT returned: stats %+v, queue %+v; want it applied and acked", s, broker.Stats(queue))
	}
	calls := hook.list()
	if len(calls) != 1 || calls[0].applied != 1 || calls[0].err != nil || calls[0].dur < time.Second {
		t.Errorf("OnCommit calls %+v; want one, of 1 message, committed, after over 1s", calls)
	}
	if !strings.Contains(log.String(), `level=WARN msg="idemq: a slow COMMIT returned" consumer=sync source=work message_id=m1 took=`) {
		t.Errorf("no warning when the slow COMMIT returned:\n%s", log.String())
	}
}

// TestSlowCommit: a COMMIT slower than SlowCommit (here a deferred
// trigger sleeps in it) is logged while it waits and when it returns, and
// HookCommit measures each COMMIT once, with its outcome: one per message
// with BatchSize 1, and one that failed (the trigger refuses it) before
// its message is dead-lettered. With SlowCommit -1 nothing is logged.
func TestSlowCommit(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		slow time.Duration
		logs bool
	}{{50 * time.Millisecond, true}, {-1, false}} {
		b := newBundle(t)
		ctx := context.Background()
		fn := pgx.Identifier{b.schema, "slow_commit"}.Sanitize()
		if _, err := b.pool.Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_sleep(0.2);
	IF NEW.body = 'refused' THEN RAISE EXCEPTION 'refused at commit'; END IF;
	RETURN NULL;
END$$;
CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON `+b.effects+` DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION `+fn+`()`); err != nil {
			t.Fatal(err)
		}
		var log logBuffer
		hook := &commits{}
		cfg := b.config(b.insertEffect)
		cfg.BatchSize, cfg.Concurrency, cfg.SlowCommit = 1, 1, c.slow
		cfg.Retry.MaxAttempts = 1
		cfg.Logger = slog.New(slog.NewTextHandler(&log, nil))
		cfg.Hooks = []consumer.Hook{hook}
		b.publish(msg("a", "x"), msg("b", "y"), msg("c", "refused"))
		r := start(t, cfg)
		waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().Applied == 2 && r.rt.Stats().DeadLettered == 1 })
		r.stop(t)
		calls := hook.list()
		if len(calls) != 3 {
			t.Fatalf("SlowCommit %s: OnCommit calls %+v; want 3", c.slow, calls)
		}
		for i, call := range calls {
			if call.applied != 1 || call.dur < 200*time.Millisecond || (call.err != nil) != (i == 2) {
				t.Errorf("SlowCommit %s: OnCommit call %d: %+v; want 1 message, over 200ms, failed only for the third", c.slow, i, call)
			}
		}
		got := log.String()
		waits := strings.Count(got, `msg="idemq: a COMMIT is slow: it still waits for the database's answer"`)
		returned := strings.Count(got, `msg="idemq: a slow COMMIT returned"`)
		failed := strings.Count(got, `msg="idemq: a slow COMMIT returned" consumer=test-consumer source=work message_id=c took=`)
		if c.logs && (waits != 3 || returned != 3 || failed != 1 || !strings.Contains(got, `error="ERROR: refused at commit`)) {
			t.Errorf("SlowCommit %s: %d waiting and %d returned warnings (%d failed); want 3, 3 (1 with its error):\n%s", c.slow, waits, returned, failed, got)
		}
		if !c.logs && waits+returned != 0 {
			t.Errorf("SlowCommit -1 logged slow COMMITs:\n%s", got)
		}
	}
}
