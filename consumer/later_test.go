package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// laterEffect is insertEffect through ExecLater.
func (b *bundle) laterEffect(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	return consumer.ExecLater(ctx, tx, "INSERT INTO "+b.effects+" (message_id, key, body) VALUES ($1, $2, $3)", m.ID, m.Key, string(m.Body))
}

// effectTracer counts the statements that write the effects table: those
// sent on their own, and those sent in batches.
type effectTracer struct {
	table          string
	alone, batched atomic.Int64
	batches        atomic.Int64
}

func (e *effectTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, e.table) {
		e.alone.Add(1)
	}
	return ctx
}

func (e *effectTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (e *effectTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return context.WithValue(ctx, e, new(bool))
}

func (e *effectTracer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	if strings.Contains(d.SQL, e.table) {
		e.batched.Add(1)
		if seen := ctx.Value(e).(*bool); !*seen {
			*seen = true
			e.batches.Add(1)
		}
	}
}

func (e *effectTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// tracedStore points b's runtime at a pool that traces the effects table's
// statements.
func (b *bundle) tracedStore(t *testing.T) (*processed.Store, *effectTracer) {
	t.Helper()
	conf, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	tr := &effectTracer{table: b.effects}
	conf.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(context.Background(), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	store, err := processed.New(pool, processed.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	return store, tr
}

// A group's handlers that write with ExecLater send their writes in one
// batch per transaction, never one statement each, and each message is
// applied once.
func TestExecLaterSendsTheGroupsWritesInOneBatch(t *testing.T) {
	t.Parallel()
	for _, strict := range []bool{false, true} {
		t.Run(fmt.Sprintf("strict=%v", strict), func(t *testing.T) {
			t.Parallel()
			b := newBundle(t)
			const total = 300
			b.publish(msgs("m", total)...)
			b.publish(msgs("m", 20)...) // duplicates
			store, tr := b.tracedStore(t)
			cfg := b.config(b.laterEffect)
			cfg.Store = store
			if strict {
				cfg.BatchSize = 1
			}
			r := start(t, cfg)
			waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Received == total+20 })
			assertOnce(t, b, total)
			if n := tr.alone.Load(); n != 0 {
				t.Fatalf("%d writes of the effects table were sent on their own", n)
			}
			if n := tr.batched.Load(); n != total {
				t.Fatalf("%d writes of the effects table were sent in batches, want %d", n, total)
			}
			batches := tr.batches.Load()
			t.Logf("%d writes in %d batches", total, batches)
			if strict && batches != total {
				t.Fatalf("strict mode: %d batches, want one per message (%d)", batches, total)
			}
			if !strict && batches > total/2 {
				t.Fatalf("%d batches for %d preloaded messages: the group's writes were not sent together", batches, total)
			}
		})
	}
}

// A handler's own statement runs after what the handlers before it queued,
// so it reads it: the second message of a key, in the same transaction as
// the first, sees the first's effect.
func TestExecLaterRunsBeforeTheNextDirectStatement(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	const keys = 60
	var all []*consumer.Message
	for k := 0; k < keys; k++ {
		first, second := msg(fmt.Sprintf("k%02d-1", k), "x"), msg(fmt.Sprintf("k%02d-2", k), "y")
		first.Key, second.Key = fmt.Sprintf("k%02d", k), fmt.Sprintf("k%02d", k)
		all = append(all, first, second)
	}
	b.publish(all...)
	gs := &groupSizes{}
	var mu sync.Mutex
	saw := map[string]int{}
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if strings.HasSuffix(m.ID, "-2") {
			var n int
			if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+b.effects+" WHERE key = $1", m.Key).Scan(&n); err != nil {
				return err
			}
			mu.Lock()
			saw[m.ID] = n
			mu.Unlock()
		}
		return b.laterEffect(ctx, tx, m)
	})
	cfg.Hooks = []consumer.Hook{gs}
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Applied == 2*keys })
	assertOnce(t, b, 2*keys)
	b.effectsByKey(t)
	grouped := 0
	for _, n := range gs.list() {
		grouped += n
	}
	if grouped < keys {
		t.Fatalf("only %d of %d messages were grouped: the test proves little", grouped, 2*keys)
	}
	mu.Lock()
	defer mu.Unlock()
	for id, n := range saw {
		if n != 1 {
			t.Fatalf("%s saw %d effects of its key, want the first message's one", id, n)
		}
	}
}

// A queued statement that fails fails the message that queued it, whichever
// handler's statement sent it; the rest of its group is applied once, and it
// is dead-lettered with the statement's error.
func TestExecLaterFailureSinksOnlyItsMessage(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) {
			t.Parallel()
			b := newBundle(t)
			all := msgs("m", 40)
			all[6] = msg("bad", "x") // queues a failing statement; m-7 runs its own after it
			b.publish(all...)
			var mu sync.Mutex
			attempts := map[string]int{} // the attempt number each message's handler last saw
			write := func(ctx context.Context, tx pgx.Tx, m *consumer.Message, i int) error {
				mu.Lock()
				attempts[m.ID] = m.Attempt
				mu.Unlock()
				if m.ID == "bad" {
					return consumer.ExecLater(ctx, tx, "INSERT INTO "+b.effects+" (seq) VALUES ($1::text::bigint)", "not a number")
				}
				if i%2 == 1 {
					return b.insertEffect(ctx, tx, m) // its own statement, sent at once
				}
				return b.laterEffect(ctx, tx, m)
			}
			var cfg consumer.Config
			if batch {
				cfg = b.config(nil)
				cfg.BatchSize = 10
				cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
					for _, m := range ms {
						var i int
						fmt.Sscanf(m.ID, "m-%d", &i)
						if err := write(ctx, tx, m, i); err != nil {
							return err
						}
					}
					return nil
				}
			} else {
				i := map[string]int{}
				for n, m := range all {
					i[m.ID] = n
				}
				cfg = b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
					return write(ctx, tx, m, i[m.ID])
				})
			}
			cfg.Retry.MaxAttempts = 2
			r := start(t, cfg)
			waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && len(b.dlq.list()) == 1 })
			counts := b.effectCounts()
			for _, m := range all {
				want := 1
				if m.ID == "bad" {
					want = 0
				}
				if counts[m.ID] != want {
					t.Fatalf("%s applied %d times, want %d", m.ID, counts[m.ID], want)
				}
			}
			mu.Lock()
			for id, n := range attempts {
				if id != "bad" && n != 1 {
					t.Errorf("%s was applied at attempt %d: it was blamed for the queued statement of another", id, n)
				}
			}
			mu.Unlock()
			dl := b.dlq.list()[0]
			if dl.msg.ID != "bad" {
				t.Fatalf("dead-lettered %s, want bad", dl.msg.ID)
			}
			if reason := dl.f.Err.Error(); !strings.Contains(reason, "queued by ExecLater") || !strings.Contains(reason, "invalid input syntax") {
				t.Fatalf("reason %q: want the queued statement and its error", reason)
			}
		})
	}
}

// In a savepoint, or in a transaction not the runtime's, ExecLater runs the
// statement at once.
func TestExecLaterRunsAtOnceOutsideTheRuntimesTransaction(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := consumer.ExecLater(ctx, tx, "INSERT INTO "+b.effects+" (message_id) VALUES ('plain')"); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+b.effects).Scan(&n); err != nil || n != 1 {
		t.Fatalf("count %d, %v: ExecLater in a plain transaction did not run at once", n, err)
	}
	if err := consumer.ExecLater(ctx, tx, "INSERT INTO nope VALUES (1)"); err == nil {
		t.Fatal("a failing statement in a plain transaction returned no error")
	}

	b.publish(msg("sp", "x"))
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if err := consumer.ExecLater(ctx, sp, "INSERT INTO "+b.effects+" (message_id) VALUES ('undone')"); err != nil {
			return err
		}
		if err := sp.Rollback(ctx); err != nil {
			return err
		}
		return b.laterEffect(ctx, tx, m)
	})
	r := start(t, cfg)
	waitFor(t, "applied", func() bool { return b.settled() && r.rt.Stats().Applied == 1 })
	if c := b.effectCounts(); c["sp"] != 1 || c["undone"] != 0 || len(c) != 1 {
		t.Fatalf("effects %v: want sp only, the savepoint's statement rolled back with it", c)
	}
	if dl := b.dlq.list(); len(dl) != 0 {
		t.Fatalf("dead letters: %v", errors.New(dl[0].f.Err.Error()))
	}
}
