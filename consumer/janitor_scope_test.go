package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// TestJanitorPurgesOnlyItsOwnConsumer: on a dedup table shared by two
// consumers, one runtime's janitor purges its own consumer's rows, by its
// own retention, and none of the other's: a consumer with a longer
// retention, or no janitor at all, keeps every row it has.
func TestJanitorPurgesOnlyItsOwnConsumer(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	table := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	for _, name := range []string{"test-consumer", "other"} {
		if _, err := b.pool.Exec(context.Background(), `INSERT INTO `+table+` (consumer, message_id, fingerprint, processed_at)
VALUES ($1, 'old', sha256('x'), now() - interval '2 hours')`, name); err != nil {
			t.Fatal(err)
		}
	}
	rows := func(name string) int64 {
		st, err := b.store.Stats(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		return st.Rows
	}
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error { return b.insertEffect(ctx, tx, m) })
	cfg.Retention, cfg.JanitorInterval = time.Hour, 20*time.Millisecond
	start(t, cfg)
	waitFor(t, "the janitor's purge of its own row", func() bool { return rows("test-consumer") == 0 })
	time.Sleep(100 * time.Millisecond) // a few more rounds
	if n := rows("other"); n != 1 {
		t.Fatalf("the other consumer has %d rows: its row was purged by another consumer's janitor", n)
	}
}
