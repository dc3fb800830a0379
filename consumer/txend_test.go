package consumer_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

// endings are SQL statements a handler may run to end the runtime's
// transaction itself. Each leaves the connection outside the transaction
// the runtime began: idle (PREPARE TRANSACTION too, refused with the
// default max_prepared_transactions = 0), or in a transaction the handler
// began.
var endings = map[string][]string{
	"rollback": {"ROLLBACK"},
	"commit":   {"COMMIT"},
	"end":      {"END"},
	"abort":    {"ABORT"},
	"prepare":  {"PREPARE TRANSACTION 'idemq-test'"},
	"restart":  {"ROLLBACK", "BEGIN"},
	// One simple-protocol query: the connection is in a transaction
	// again when the handler returns, one the runtime did not begin.
	"restart-in-one": {"ROLLBACK; BEGIN"},
	"commit-in-one":  {"COMMIT; BEGIN"},
	// Not an ending, but it closes the cursor a processed store's commit
	// checks for (its CLOSE is how the commit finds a transaction begun
	// anew): refused the same way, nothing committed.
	"close-all": {"CLOSE ALL"},
}

// TestHandlerEndingTheTransactionWithSQL: a handler that ends the runtime's
// transaction with SQL, ignoring any error, must not have its message acked
// as applied with nothing applied, and the handlers after it in a group must
// not run outside the transaction. Every effect has its dedup row and every
// dedup row its effect; the misusing message is dead-lettered (permanent,
// with the reason) with nothing applied, even when the handler ran COMMIT
// (the store's commit guard refuses it), and the others are applied once.
func TestHandlerEndingTheTransactionWithSQL(t *testing.T) {
	t.Parallel()
	modes := map[string]func(*consumer.Config, consumer.Handler){
		"strict": func(c *consumer.Config, h consumer.Handler) { c.Handler, c.BatchSize = h, 1 },
		"grouped": func(c *consumer.Config, h consumer.Handler) {
			c.Handler, c.Concurrency, c.BatchWait = h, 1, 50_000_000 // 50ms: one group of all three
		},
		"batch": func(c *consumer.Config, h consumer.Handler) {
			c.Handler = nil
			c.Concurrency, c.BatchWait = 1, 50_000_000
			c.BatchHandler = func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
				for _, m := range ms {
					if err := h(ctx, tx, m); err != nil {
						return err
					}
				}
				return nil
			}
		},
	}
	for mode, set := range modes {
		for name, stmts := range endings {
			t.Run(mode+"/"+name, func(t *testing.T) {
				t.Parallel()
				b := newBundle(t)
				b.publish(msg("m", "misuse"), msg("a", "x"), msg("b", "y"))
				h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
					if err := b.insertEffect(ctx, tx, m); err != nil {
						return err
					}
					if m.ID == "m" {
						for _, s := range stmts {
							_, _ = tx.Exec(ctx, s) // errors ignored, as careless code does
						}
					}
					return nil
				}
				cfg := b.config(nil)
				set(&cfg, h)
				r := start(t, cfg)
				waitFor(t, "all settled", func() bool {
					s := r.rt.Stats()
					return b.settled() && s.InFlight == 0
				})
				effects := b.effectCounts()
				for _, id := range []string{"m", "a", "b"} {
					_, err := b.store.Lookup(context.Background(), "test-consumer", id)
					claimed := err == nil
					if err != nil && !errors.Is(err, processed.ErrNotFound) {
						t.Fatal(err)
					}
					if want := map[bool]int{true: 1, false: 0}[claimed]; effects[id] != want {
						t.Errorf("%s: %d effects with its dedup row %v: want %d", id, effects[id], map[bool]string{true: "present", false: "absent"}[claimed], want)
					}
					if id != "m" && effects[id] != 1 {
						t.Errorf("%s: %d effects, want 1", id, effects[id])
					}
				}
				var dead []string
				for _, e := range b.dlq.list() {
					dead = append(dead, e.msg.ID)
					if e.msg.ID == "m" && (e.f.Class != consumer.ClassPermanent || !strings.Contains(e.f.Err.Error(), "ended the runtime's transaction")) {
						t.Errorf("m dead-lettered as %s: %v; want permanent, saying the handler ended the transaction", e.f.Class, e.f.Err)
					}
				}
				if effects["m"] != 0 || len(dead) != 1 || dead[0] != "m" {
					t.Errorf("m: %d effects, dead letters %v: want m not applied and dead-lettered, alone", effects["m"], dead)
				}
			})
		}
	}
}

// TestHandlerSavepointRecovers: a handler may recover from a failed
// statement in a savepoint (tx.Begin) and go on in the runtime's
// transaction; the guard on the transaction carries over to the savepoint.
func TestHandlerSavepointRecovers(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("s", "x"))
	r := start(t, b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := sp.Exec(ctx, "SELECT 1/0"); err == nil {
			return errors.New("division by zero succeeded")
		}
		if err := sp.Rollback(ctx); err != nil {
			return err
		}
		sp, err = tx.Begin(ctx)
		if err != nil {
			return err
		}
		if err := b.insertEffect(ctx, sp, m); err != nil {
			return err
		}
		return sp.Commit(ctx)
	}))
	waitFor(t, "applied", func() bool { return r.rt.Stats().Applied == 1 && b.settled() })
	if got := b.effectCounts(); got["s"] != 1 {
		t.Fatalf("effects %v", got)
	}
}

// TestSessionKilledAtCommitIsNotTheHandlers: a session the server ends
// while the handler holds its transaction open (here
// idle_in_transaction_session_timeout, a FATAL error of class 25 at
// COMMIT) is a lost connection, retried, not a handler that ended the
// transaction: the message is applied on the next attempt.
func TestSessionKilledAtCommitIsNotTheHandlers(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	conf := b.pool.Config()
	conf.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "300"
	conf.MaxConns = 4
	pool, err := newPool(context.Background(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	store, err := processed.New(pool, processed.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	b.publish(msg("slow", "x"))
	var attempts atomic.Int32
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := b.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		if attempts.Add(1) == 1 {
			time.Sleep(700 * time.Millisecond) // idle in transaction past the timeout
		}
		return nil
	})
	cfg.Store, cfg.BatchSize = store, 1
	r := start(t, cfg)
	waitFor(t, "applied", func() bool { s := r.rt.Stats(); return (s.Applied == 1 || s.DeadLettered == 1) && b.settled() })
	if dl := b.dlq.list(); len(dl) != 0 {
		t.Fatalf("dead-lettered as %s: %v; want a lost connection, retried", dl[0].f.Class, dl[0].f.Err)
	}
	if got := b.effectCounts(); got["slow"] != 1 || attempts.Load() < 2 {
		t.Fatalf("effects %v after %d attempts", got, attempts.Load())
	}
}
