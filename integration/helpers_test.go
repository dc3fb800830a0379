//go:build integration

package integration

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
	"github.com/idemq/idemq/processed"
)

// testCtx returns a context cancelled after d or when the test ends.
func testCtx(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

var unsafeChars = regexp.MustCompile(`[^a-z0-9]+`)

// uniqueName returns prefix plus a lower-case slug of the test name and a
// random suffix: a fresh schema, queue, topic or group name per test.
func uniqueName(t testing.TB, prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	n := strings.Trim(unsafeChars.ReplaceAllString(strings.ToLower(t.Name()), "_"), "_")
	if len(n) > 30 {
		n = n[len(n)-30:]
	}
	return prefix + "_" + n + "_" + hex.EncodeToString(b[:])
}

// newPool opens a pool on url, closed when the test ends.
func newPool(t testing.TB, url string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(testCtx(t, 30*time.Second), cfg)
	if err != nil {
		t.Fatalf("pgxpool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// db is one test's database side: a schema with the dedup store and an
// effects table that has no unique constraint, so a double apply shows up as
// two rows.
type db struct {
	url     string
	pool    *pgxpool.Pool
	schema  string
	store   *processed.Store
	effects string // quoted, schema-qualified
}

// newDB creates a fresh schema on the Postgres service, migrates the dedup
// store into it and creates the effects table. The schema is dropped when
// the test ends.
func newDB(t testing.TB) *db {
	t.Helper()
	_, url := postgres(t)
	ctx := testCtx(t, 60*time.Second)
	pool := newPool(t, url, 16)
	schema := uniqueName(t, "idemq")
	if len(schema) > pgmigrate.MaxIdentifierLen {
		schema = schema[:pgmigrate.MaxIdentifierLen]
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		// The server may just have been restarted: retry on a fresh
		// connection until the deadline.
		err := poll(context.Background(), 30*time.Second, func(ctx context.Context) error {
			conn, err := pgx.Connect(ctx, url)
			if err != nil {
				return err
			}
			defer conn.Close(context.Background())
			_, err = conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
			return err
		})
		if err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (message_id text NOT NULL, body text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		t.Fatalf("create effects table: %v", err)
	}
	return &db{url: url, pool: pool, schema: schema, store: store, effects: effects}
}

// handler applies a message by inserting one effects row, in the claim's
// transaction.
func (d *db) handler(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+d.effects+" (message_id, body) VALUES ($1, $2)", msg.ID, string(msg.Body))
	return err
}

// effectCounts returns the number of effect rows per message id. It retries
// until the deadline, so it works right after a Postgres restart.
func (d *db) effectCounts(t testing.TB) map[string]int {
	t.Helper()
	var counts map[string]int
	err := poll(context.Background(), 30*time.Second, func(ctx context.Context) error {
		conn, err := pgx.Connect(ctx, d.url)
		if err != nil {
			return err
		}
		defer conn.Close(context.Background())
		rows, err := conn.Query(ctx, "SELECT message_id, count(*) FROM "+d.effects+" GROUP BY message_id")
		if err != nil {
			return err
		}
		c := map[string]int{}
		for rows.Next() {
			var id string
			var n int
			if err := rows.Scan(&id, &n); err != nil {
				return err
			}
			c[id] = n
		}
		if err := rows.Err(); err != nil {
			return err
		}
		counts = c
		return nil
	})
	if err != nil {
		t.Fatalf("count effects: %v", err)
	}
	return counts
}

// dedupRows returns the number of dedup rows for consumer name.
func (d *db) dedupRows(t testing.TB, name string) int {
	t.Helper()
	var n int
	err := poll(context.Background(), 30*time.Second, func(ctx context.Context) error {
		q := "SELECT count(*) FROM " + pgx.Identifier{d.schema, d.store.Table()}.Sanitize() + " WHERE consumer = $1"
		return d.pool.QueryRow(ctx, q, name).Scan(&n)
	})
	if err != nil {
		t.Fatalf("count dedup rows: %v", err)
	}
	return n
}

// assertExactlyOnce checks that every id in want has exactly one effect row
// and that no other id has any.
func (d *db) assertExactlyOnce(t testing.TB, want []string) {
	t.Helper()
	counts := d.effectCounts(t)
	var missing, doubled []string
	for _, id := range want {
		switch n := counts[id]; {
		case n == 0:
			missing = append(missing, id)
		case n > 1:
			doubled = append(doubled, fmt.Sprintf("%s×%d", id, n))
		}
		delete(counts, id)
	}
	if len(missing) > 0 {
		t.Errorf("%d of %d ids never applied (lost): %s", len(missing), len(want), sample(missing))
	}
	if len(doubled) > 0 {
		t.Errorf("%d ids applied more than once: %s", len(doubled), sample(doubled))
	}
	if len(counts) > 0 {
		t.Errorf("%d unexpected ids applied", len(counts))
	}
}

func sample(s []string) string {
	if len(s) > 10 {
		return strings.Join(s[:10], ", ") + ", ..."
	}
	return strings.Join(s, ", ")
}

// runtime is a consumer.Runtime running in the background.
type runtime struct {
	rt   *consumer.Runtime
	stop func() error
}

// startRuntime builds a runtime with the test's defaults, applies mod, and
// runs it until stop is called or the test ends. Dead-lettering fails the
// test: no message in these suites should ever be dead-lettered.
func startRuntime(t testing.TB, d *db, src consumer.Source, mod func(*consumer.Config)) *runtime {
	t.Helper()
	cfg := consumer.Config{
		Name:        "integration",
		Source:      src,
		Store:       d.store,
		Handler:     d.handler,
		Concurrency: 4,
		DeadLetterer: consumer.DeadLettererFunc(func(_ context.Context, msg *consumer.Message, f consumer.Failure) error {
			t.Errorf("unexpected dead-letter of %q: %s: %v", msg.ID, f.Class, f.Err)
			return errors.New("the test refuses dead-letters")
		}),
		// Keep retrying through outages rather than dead-lettering.
		Retry: consumer.RetryConfig{
			MaxAttempts:     1 << 20,
			InitialInterval: 50 * time.Millisecond,
			MaxInterval:     500 * time.Millisecond,
			MaxElapsed:      3 * time.Minute,
		},
		ShutdownTimeout: 20 * time.Second,
	}
	if mod != nil {
		mod(&cfg)
	}
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatalf("consumer.New: %v", err)
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
			case <-time.After(time.Minute):
				runErr = errors.New("Run did not return within a minute of cancel")
			}
		})
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return &runtime{rt: rt, stop: stop}
}

// waitFor polls cond every 50ms until it holds, failing t after timeout
// with what, and the runtime's stats if rt is not nil.
func waitFor(t testing.TB, timeout time.Duration, what string, rt *runtime, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			if rt != nil {
				t.Fatalf("timed out after %s waiting for %s; runtime stats %+v", timeout, what, rt.rt.Stats())
			}
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// poll calls f until it returns nil or timeout passes, returning the last
// error then.
func poll(ctx context.Context, timeout time.Duration, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		attempt, cancelAttempt := context.WithTimeout(ctx, 5*time.Second)
		err := f(attempt)
		cancelAttempt()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("after %s: %w", timeout, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// workload returns n distinct messages plus a duplicate of every dupEvery-th
// one (same id and body, published again later), and the distinct ids.
func workload(prefix string, n, dupEvery int) (msgs []*consumer.Message, ids []string) {
	var dups []*consumer.Message
	for i := range n {
		m := &consumer.Message{
			ID:   fmt.Sprintf("%s-%05d", prefix, i),
			Body: []byte(fmt.Sprintf(`{"n":%d}`, i)),
		}
		msgs = append(msgs, m)
		ids = append(ids, m.ID)
		if dupEvery > 0 && i%dupEvery == 0 {
			dups = append(dups, m.Clone())
		}
	}
	// Interleave the duplicates: after each tenth original.
	out := make([]*consumer.Message, 0, len(msgs)+len(dups))
	for i, m := range msgs {
		out = append(out, m)
		if i%10 == 9 && len(dups) > 0 {
			out = append(out, dups[0])
			dups = dups[1:]
		}
	}
	return append(out, dups...), ids
}
