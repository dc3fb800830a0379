package consumer_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

// batchingDB is a pool that counts the batches it is sent: the store's
// pipelined claim (BEGIN and INSERT in one round trip) is one.
type batchingDB struct {
	*pgxpool.Pool
	batches *atomic.Int64
}

func (d batchingDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	d.batches.Add(1)
	return d.Pool.SendBatch(ctx, b)
}

// claimPaths runs f with the bundle's store over a pool that counts the
// batches it is sent, and checks that the claims took the pipelined path
// (BEGIN and the claim in one round trip, a batch). f can make another
// store with storeOver, over a pool of its own.
func claimPaths(t *testing.T, f func(t *testing.T, b *bundle, storeOver func(*pgxpool.Pool) *processed.Store)) {
	t.Run("pipelined", func(t *testing.T) {
		t.Parallel()
		b := newBundle(t)
		var batches atomic.Int64
		storeOver := func(pool *pgxpool.Pool) *processed.Store {
			s, err := processed.New(batchingDB{pool, &batches}, processed.Config{Schema: b.schema, Table: b.store.Table()})
			if err != nil {
				t.Fatal(err)
			}
			return s
		}
		b.store = storeOver(b.pool)
		f(t, b, storeOver)
		if batches.Load() == 0 {
			t.Fatal("path not taken: no pipelined batch")
		}
	})
}

// TestClaimPathsForceSynchronousCommit: both paths make the dedup
// transaction's commit synchronous when the session default is async.
func TestClaimPathsForceSynchronousCommit(t *testing.T) {
	t.Parallel()
	claimPaths(t, func(t *testing.T, b *bundle, storeOver func(*pgxpool.Pool) *processed.Store) {
		ctx := context.Background()
		b.publish(msg("a", "x"))
		var setting, iso string
		cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if err := tx.QueryRow(ctx, "SHOW synchronous_commit").Scan(&setting); err != nil {
				return err
			}
			return tx.QueryRow(ctx, "SHOW transaction_isolation").Scan(&iso)
		})
		conf := b.pool.Config()
		conf.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
		conf.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
		pool, err := newPool(ctx, conf)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		cfg.Store = storeOver(pool)
		r := start(t, cfg)
		waitFor(t, "applied", func() bool { return r.rt.Stats().Applied == 1 })
		if setting != "on" || iso != "read committed" {
			t.Fatalf("inside the dedup transaction: synchronous_commit %q, isolation %q; want on, read committed", setting, iso)
		}
	})
}

// TestClaimPathsFailingClaimIsRetried: when the claim fails (here the dedup
// table does not exist yet), nothing is acked or dead-lettered, no
// connection leaks, and the messages apply once the table is there.
func TestClaimPathsFailingClaimIsRetried(t *testing.T) {
	t.Parallel()
	claimPaths(t, func(t *testing.T, b *bundle, storeOver func(*pgxpool.Pool) *processed.Store) {
		ctx := context.Background()
		pool, err := newPool(ctx, b.pool.Config())
		if err != nil {
			t.Fatal(err)
		}
		// Close waits for every acquired connection: after a leak it
		// would hang instead of letting the test report it.
		defer func() {
			if !t.Failed() {
				pool.Close()
			}
		}()
		// A trigger makes every claim fail with a database error (a
		// missing table would stop the runtime: see
		// TestEdgeMissingDedupTableStopsRun).
		table := pgx.Identifier{b.schema, b.store.Table()}.Sanitize()
		fn := pgx.Identifier{b.schema, "refuse_claims"}.Sanitize()
		if _, err := b.pool.Exec(ctx, "CREATE FUNCTION "+fn+"() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'claims refused'; END$$; "+
			"CREATE TRIGGER refuse BEFORE INSERT ON "+table+" FOR EACH ROW EXECUTE FUNCTION "+fn+"()"); err != nil {
			t.Fatal(err)
		}
		b.publish(msgs("m", 3)...)
		cfg := b.config(b.insertEffect)
		cfg.Store = storeOver(pool)
		cfg.Concurrency = 2
		r := start(t, cfg)
		leaked := func() bool { return pool.Stat().AcquiredConns() > int32(cfg.Concurrency) }
		waitFor(t, "failed claims", func() bool { return r.rt.Stats().DBErrors >= 6 || leaked() })
		if leaked() {
			r.cancel()
			t.Fatalf("%d connections acquired for concurrency %d: failed claims leak them", pool.Stat().AcquiredConns(), cfg.Concurrency)
		}
		if s := r.rt.Stats(); s.Applied != 0 || s.DeadLettered != 0 || b.broker.Unacked(queue)+b.broker.Ready(queue) != 3 {
			t.Fatalf("with failing claims: stats %+v, %d unacked", s, b.broker.Unacked(queue))
		}
		if _, err := b.pool.Exec(ctx, "DROP TRIGGER refuse ON "+table); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "applied", func() bool { return b.settled() && r.rt.Stats().Applied == 3 })
		for id, n := range b.effectCounts() {
			if n != 1 {
				t.Errorf("%s applied %d times", id, n)
			}
		}
	})
}
