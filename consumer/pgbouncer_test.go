package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// The statement-cache errors: pgx's default query exec mode
// (cache_statement) prepares each statement once per connection under a
// name stmtcache_…, which a transaction-pooling proxy such as PgBouncer
// breaks: the next transaction of the same client connection may run on
// another server connection, which lacks the statement (26000) or already
// has it from another client (42P05). It is the configuration's fault,
// never the message's: the runtime stops with a configuration error that
// names the fix, and dead-letters nothing.

// wantStatementCacheStop checks that err is the configuration error of the
// statement cache, naming the fix.
func wantStatementCacheStop(t *testing.T, err error) {
	t.Helper()
	var ce *consumer.ConfigError
	if !errors.Is(err, consumer.ErrInvalidConfig) || !errors.As(err, &ce) || ce.Field != "Store" {
		t.Fatalf("Run = %v; want a *consumer.ConfigError for Store", err)
	}
	for _, want := range []string{"default_query_exec_mode=exec", "simple_protocol", "stmtcache_"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("Run = %v; want it to name %q", err, want)
		}
	}
}

// runUntilStop runs rt until Run returns by itself, for at most d; then it
// cancels it and fails.
func runUntilStop(t *testing.T, rt *consumer.Runtime, dlq *recordingDLQ, d time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		cancel()
		err := <-done
		classes := map[consumer.FailureClass]int{}
		for _, e := range dlq.list() {
			classes[e.f.Class]++
		}
		t.Fatalf("Run did not stop within %s (then returned %v); stats %+v; dead-lettered by class %v", d, err, rt.Stats(), classes)
		return nil
	}
}

// storeThrough opens a store on the bundle's schema through databaseURL.
func storeThrough(t *testing.T, b *bundle, databaseURL string, maxConns int) *processed.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := processed.Open(ctx, databaseURL, processed.Config{Schema: b.schema, MaxConns: maxConns})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// checkOnceOrPending checks that every message of all was applied at most
// once, and that each one not applied is back in the broker.
func checkOnceOrPending(t *testing.T, b *bundle, all []*consumer.Message) (applied int) {
	t.Helper()
	counts := b.effectCounts()
	pending := map[string]bool{}
	for _, m := range b.broker.Messages(queue) {
		pending[m.ID] = true
	}
	for _, m := range all {
		switch n := counts[m.ID]; {
		case n > 1:
			t.Errorf("%s applied %d times", m.ID, n)
		case n == 1:
			applied++
		case !pending[m.ID]:
			t.Errorf("%s neither applied nor back in the broker: lost", m.ID)
		}
	}
	if n := b.broker.Unacked(queue); n != 0 {
		t.Errorf("%d deliveries still unacked after Run returned", n)
	}
	return applied
}

// TestPgBouncerStatementCacheStopsRun: through PgBouncer in transaction
// mode (two server connections for four workers), with pgx's default query
// exec mode. The statement-cache errors come from the claims and from the
// handler's statements; Run stops with the configuration error naming the
// fix, nothing is dead-lettered, nothing applied twice, and every message
// not applied is still in the broker. Then the same messages, through the
// same PgBouncer with default_query_exec_mode=exec, are all applied
// exactly once.
func TestPgBouncerStatementCacheStopsRun(t *testing.T) {
	for _, mode := range []struct {
		name      string
		batchSize int
	}{{"strict", 1}, {"grouped", 0}} {
		t.Run(mode.name, func(t *testing.T) {
			// A PgBouncer of its own: server connections that hold no
			// statement yet, so that Open succeeds (TestOpenThroughPgBouncer
			// in processed shows Open failing on one that does).
			url := testdb.PgBouncer(t, testdb.PgBouncerOptions{PoolMode: "transaction", PoolSize: 2})
			b := newBundle(t)
			all := msgs("m", 300)
			b.publish(all...)

			cfg := b.config(b.insertEffect)
			cfg.Store = storeThrough(t, b, url, 4)
			cfg.Concurrency, cfg.BatchSize = 4, mode.batchSize
			rt, err := consumer.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = runUntilStop(t, rt, b.dlq, 30*time.Second)
			wantStatementCacheStop(t, err)
			if dl := b.dlq.list(); len(dl) != 0 {
				t.Fatalf("%d messages dead-lettered (first: %s: %v); want none", len(dl), dl[0].f.Class, dl[0].f.Err)
			}
			applied := checkOnceOrPending(t, b, all)
			t.Logf("stopped after applying %d of %d: %v", applied, len(all), err)

			// The fix the error names: every message applied exactly once.
			cfg = b.config(b.insertEffect)
			cfg.Store = storeThrough(t, b, url+"&default_query_exec_mode=exec", 4)
			cfg.Concurrency, cfg.BatchSize = 4, mode.batchSize
			r := start(t, cfg)
			waitFor(t, "the rest applied", func() bool { return b.settled() })
			r.stop(t)
			for _, m := range all {
				if n := b.effectCounts()[m.ID]; n != 1 {
					t.Fatalf("%s applied %d times, want exactly once", m.ID, n)
				}
			}
			if dl := b.dlq.list(); len(dl) != 0 {
				t.Fatalf("%d messages dead-lettered after the fix", len(dl))
			}
		})
	}
}

// TestPgBouncerQueryExecModes: through the same PgBouncer in transaction
// mode, the query exec modes that prepare no named statement across
// transactions apply every message exactly once.
func TestPgBouncerQueryExecModes(t *testing.T) {
	url := testdb.PgBouncer(t, testdb.PgBouncerOptions{PoolMode: "transaction", PoolSize: 2})
	for _, mode := range []string{"exec", "simple_protocol", "describe_exec", "cache_describe"} {
		t.Run(mode, func(t *testing.T) {
			b := newBundle(t)
			all := msgs("m", 300)
			b.publish(all...)
			cfg := b.config(b.insertEffect)
			cfg.Store = storeThrough(t, b, url+"&default_query_exec_mode="+mode, 4)
			cfg.Concurrency, cfg.BatchSize = 4, 1
			r := start(t, cfg)
			waitFor(t, "all applied", func() bool { return b.settled() })
			r.stop(t)
			counts := b.effectCounts()
			for _, m := range all {
				if counts[m.ID] != 1 {
					t.Fatalf("%s applied %d times, want exactly once", m.ID, counts[m.ID])
				}
			}
			if st := r.rt.Stats(); st.DeadLettered != 0 || st.Applied != int64(len(all)) {
				t.Fatalf("stats %+v: want %d applied, none dead-lettered", st, len(all))
			}
		})
	}
}

// deallocateMissing fails as a statement-cache error does when a pgx
// cached statement is missing on the server connection (26000).
const deallocateMissing = "DEALLOCATE stmtcache_0123456789abcdef0123456789abcdef0123456789abcdef"

// TestStatementCacheErrorInHandlerStopsRun: a handler whose statement meets
// a statement-cache error stops Run with the configuration error, whatever
// it makes of the error, and its message is neither applied nor
// dead-lettered: it stays in the broker.
func TestStatementCacheErrorInHandlerStopsRun(t *testing.T) {
	t.Parallel()
	returns := map[string]func(err error) error{
		"the error":           func(err error) error { return err },
		"the error as text":   func(err error) error { return fmt.Errorf("apply: %v", err) },
		"the error permanent": func(err error) error { return consumer.Permanent(err) },
		"an error of its own": func(error) error { return errors.New("could not apply") },
		"nil":                 func(error) error { return nil }, // the transaction is aborted
	}
	for name, ret := range returns {
		for _, batchSize := range []int{1, 0} {
			t.Run(fmt.Sprintf("%s/batch=%d", name, batchSize), func(t *testing.T) {
				t.Parallel()
				b := newBundle(t)
				b.publish(msg("ok", "fine"), msg("bad", "meets the error"))
				cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
					if m.ID == "bad" {
						_, err := tx.Exec(ctx, deallocateMissing)
						if err == nil {
							return errors.New("DEALLOCATE of a missing statement succeeded")
						}
						return ret(err)
					}
					return b.insertEffect(ctx, tx, m)
				})
				cfg.Concurrency, cfg.BatchSize = 1, batchSize
				rt, err := consumer.New(cfg)
				if err != nil {
					t.Fatal(err)
				}
				wantStatementCacheStop(t, runUntilStop(t, rt, b.dlq, 10*time.Second))
				if dl := b.dlq.list(); len(dl) != 0 {
					t.Fatalf("dead-lettered %s (%s: %v); want nothing", dl[0].msg.ID, dl[0].f.Class, dl[0].f.Err)
				}
				var pending []string
				for _, m := range b.broker.Messages(queue) {
					pending = append(pending, m.ID)
				}
				if !slices.Contains(pending, "bad") || b.effectCounts()["bad"] != 0 {
					t.Fatalf("pending %v, effects %v: want bad back in the broker, not applied", pending, b.effectCounts())
				}
				checkOnceOrPending(t, b, []*consumer.Message{msg("ok", ""), msg("bad", "")})
			})
		}
	}
}

// cacheFailingStore is a store whose claims, or purges, fail with the
// statement-cache error a PgBouncer in transaction mode gives.
type cacheFailingStore struct {
	dedup.Store
	claims, purges bool
}

var errAlreadyExists = fmt.Errorf("processed: claim: begin and insert on x.processed_messages: %w",
	&pgconn.PgError{Severity: "ERROR", Code: "42P05", Message: `prepared statement "stmtcache_0123456789abcdef0123456789abcdef0123456789abcdef" already exists`})

func (s cacheFailingStore) BeginClaim(ctx context.Context, claims []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	if s.claims {
		return nil, nil, errAlreadyExists
	}
	return s.Store.BeginClaim(ctx, claims)
}

func (s cacheFailingStore) Purge(ctx context.Context, name string, olderThan time.Duration) (int64, error) {
	if s.purges {
		return 0, errAlreadyExists
	}
	return s.Store.Purge(ctx, name, olderThan)
}

// TestStatementCacheErrorInStoreStopsRun: a claim, or the janitor's purge,
// failing with a statement-cache error stops Run with the configuration
// error instead of retrying it for ever; nothing is acked or dead-lettered.
func TestStatementCacheErrorInStoreStopsRun(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		store func(dedup.Store) dedup.Store
	}{
		{"claim", func(s dedup.Store) dedup.Store { return cacheFailingStore{Store: s, claims: true} }},
		{"purge", func(s dedup.Store) dedup.Store { return cacheFailingStore{Store: s, purges: true} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := newBundle(t)
			cfg := b.config(b.insertEffect)
			cfg.Store = tc.store(b.store)
			if tc.name == "claim" {
				b.publish(msgs("m", 3)...)
			} else {
				cfg.Retention = time.Hour
			}
			rt, err := consumer.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			wantStatementCacheStop(t, runUntilStop(t, rt, b.dlq, 10*time.Second))
			if st := rt.Stats(); st.Applied != 0 || st.DeadLettered != 0 {
				t.Fatalf("stats %+v: want nothing applied or dead-lettered", st)
			}
			if tc.name == "claim" && b.broker.Ready(queue) != 3 {
				t.Fatalf("%d ready after the stop, want 3", b.broker.Ready(queue))
			}
		})
	}
}
