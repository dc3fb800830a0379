package consumer_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testlog"
	"github.com/idemq/idemq/processed"
)

// horizonSub is a Source whose redelivery horizon the test sets.
type horizonSub struct {
	consumer.Source
	mu      sync.Mutex
	horizon time.Time
	known   bool
}

func (h *horizonSub) set(t time.Time, known bool) {
	h.mu.Lock()
	h.horizon, h.known = t, known
	h.mu.Unlock()
}

func (h *horizonSub) RedeliveryHorizon(context.Context) (time.Time, bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.horizon, h.known, nil
}

// TestJanitorHorizon: the janitor purges by the retention while the
// source's horizon is within it, holds the purge back to the horizon when it
// is older, does not purge while the source cannot tell, and records each
// round, with the duplicates' ages.
func TestJanitorHorizon(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	table := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	old := func(id string, age time.Duration) {
		if _, err := b.pool.Exec(context.Background(), `INSERT INTO `+table+` (consumer, message_id, fingerprint, processed_at)
VALUES ('test-consumer', $1, sha256('x'), now() - $2::bigint * interval '1 microsecond')`, id, age.Microseconds()); err != nil {
			t.Fatal(err)
		}
	}
	old("2h", 2*time.Hour)
	old("4h", 4*time.Hour)
	rows := func() int64 {
		st, err := b.store.Stats(context.Background(), "test-consumer")
		if err != nil {
			t.Fatal(err)
		}
		return st.Rows
	}
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error { return b.insertEffect(ctx, tx, m) })
	src := &horizonSub{Source: cfg.Source}
	src.set(time.Time{}, false) // cannot tell
	cfg.Source = src
	cfg.Retention, cfg.JanitorInterval, cfg.HorizonMargin = time.Hour, 50*time.Millisecond, -1
	start(t, cfg)

	// A duplicate, for the evidence.
	b.publish(msg("d1", "x"))
	waitFor(t, "d1 applied", b.settled)
	b.publish(msg("d1", "x"))
	waitFor(t, "d1 again", b.settled)

	summary := func() processed.RetentionSummary {
		s, err := b.store.Retention(context.Background(), "test-consumer", time.Now().Add(-time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	waitFor(t, "a report with the duplicate", func() bool { return summary().Duplicates == 1 })
	if s := summary(); s.HorizonState != "unknown" || s.Max <= 0 || s.P999 <= 0 || s.P999 > time.Second {
		t.Fatalf("summary %+v", s)
	}
	if n := rows(); n != 3 {
		t.Fatalf("%d rows while the horizon is unknown, want 3 (no purge)", n)
	}
	// Horizon 3h ago: rows older than 3h go, the 2h one stays although
	// it is older than the retention.
	src.set(time.Now().Add(-3*time.Hour), true)
	waitFor(t, "the 4h row purged", func() bool { return rows() == 2 })
	waitFor(t, "a held report", func() bool { return summary().HorizonState == "held" })
	time.Sleep(200 * time.Millisecond)
	if n := rows(); n != 2 {
		t.Fatalf("%d rows with the horizon 3h ago, want 2", n)
	}
	// Nothing redeliverable: the retention decides.
	src.set(time.Time{}, true)
	waitFor(t, "the 2h row purged", func() bool { return rows() == 1 })
	waitFor(t, "a clear report", func() bool { return summary().HorizonState == "clear" })
	if s := summary(); s.HorizonState != "clear" || s.Retention != time.Hour || s.PurgedOlderThan != time.Hour {
		t.Fatalf("summary %+v", s)
	}
}

// TestPartitionedRuntimeExactlyOnce: a runtime over the partitioned layout,
// whose janitor rotates its generations every half retention (3s), gets
// every id several times, in waves across a rotation, per message and in
// batches: each id is applied once.
func TestPartitionedRuntimeExactlyOnce(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{false, true} {
		t.Run(map[bool]string{false: "per message", true: "batch"}[batch], func(t *testing.T) {
			t.Parallel()
			b := newBundle(t)
			part, err := processed.New(b.pool, processed.Config{Schema: b.schema, Partitioned: true})
			if err != nil {
				t.Fatal(err)
			}
			if err := part.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			b.store = part
			h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error { return b.insertEffect(ctx, tx, m) }
			cfg := b.config(h)
			if batch {
				cfg = batchConfig(b, h)
				cfg.BatchSize = 8
			}
			cfg.Concurrency = 8
			cfg.Retention, cfg.JanitorInterval = 6*time.Second, 100*time.Millisecond
			cfg.Store = part
			start(t, cfg)
			gens := func() []processed.Generation {
				g, err := part.Generations(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				return g
			}
			first := gens()[0].BeganAt
			const ids, waves = 40, 16
			for w := 0; w < waves; w++ {
				var wave []*consumer.Message
				for i := 0; i < ids; i++ {
					// Each wave sends every id; ids also repeat within a
					// wave, so that concurrent claims of one id race.
					m := msg(fmt.Sprintf("id-%02d", i), "body")
					wave = append(wave, m, msg(m.ID, "body"))
				}
				b.publish(wave...)
				time.Sleep(250 * time.Millisecond)
			}
			waitFor(t, "everything settled", b.settled)
			if !gens()[0].BeganAt.After(first) {
				t.Fatalf("no rotation in %d waves: %+v", waves, gens())
			}
			assertOnce(t, b, ids)
		})
	}
}

// panickyUpkeep is the bundle's store whose janitor calls (Maintain, Purge,
// RecordRetention) panic the first time each is called.
type panickyUpkeep struct {
	*processed.Store
	maintained, purged, recorded atomic.Int32
}

func (p *panickyUpkeep) Maintain(ctx context.Context) error {
	if p.maintained.Add(1) == 1 {
		panic("store: maintain")
	}
	return p.Store.Maintain(ctx)
}

func (p *panickyUpkeep) Purge(ctx context.Context, name string, olderThan time.Duration) (int64, error) {
	if p.purged.Add(1) == 1 {
		panic("store: purge")
	}
	return p.Store.Purge(ctx, name, olderThan)
}

func (p *panickyUpkeep) RecordRetention(ctx context.Context, r dedup.RetentionReport) error {
	if p.recorded.Add(1) == 1 {
		panic("store: record retention")
	}
	return p.Store.RecordRetention(ctx, r)
}

// TestJanitorSurvivesPanickingStore: a Store's upkeep that panics in the
// janitor (a Store is the caller's to implement) is logged as an error, and
// neither crashes the process nor stops the janitor or the consumer.
func TestJanitorSurvivesPanickingStore(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	store := &panickyUpkeep{Store: b.store}
	cfg := b.config(b.insertEffect)
	cfg.Store = store
	cfg.Retention, cfg.JanitorInterval = time.Hour, 20*time.Millisecond
	var logs *testlog.Buffer
	cfg.Logger, logs = testlog.New(slog.LevelInfo)
	r := start(t, cfg)
	waitFor(t, "janitor rounds after the panics", func() bool {
		return store.maintained.Load() >= 3 && store.purged.Load() >= 3 && store.recorded.Load() >= 3
	})
	b.publish(msgs("after", 5)...)
	waitFor(t, "applied", func() bool { return r.rt.Stats().Applied == 5 && b.settled() })
	for _, want := range []string{"store: maintain", "store: purge", "store: record retention"} {
		if !strings.Contains(logs.String(), want) {
			t.Fatalf("no error logged for the panic %q:\n%s", want, logs.String())
		}
	}
}
