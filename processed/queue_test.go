package processed_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// modePool returns a pool of its own whose queries use mode, closed at the
// end of the test.
func modePool(t *testing.T, mode pgx.QueryExecMode) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.DefaultQueryExecMode = mode
	pool, err := pgxpool.NewWithConfig(ctx(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// queueClaim begins a transaction with a batch carrying c's queued claim,
// the way the runtime does, and returns the open transaction and the
// outcome. The caller commits or rolls back.
func queueClaim(t *testing.T, pool *pgxpool.Pool, s *processed.Store, c consumer.Claim) (pgx.Tx, consumer.ClaimResult, error) {
	t.Helper()
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	finish := s.QueueClaim(b, c)
	br := pool.SendBatch(ctx(t), b)
	tx := br.Tx()
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	res, err := finish(ctx(t), tx, br.Close())
	return tx, res, err
}

// queueClaimCommit claims c with queueClaim and commits.
func queueClaimCommit(t *testing.T, pool *pgxpool.Pool, s *processed.Store, c consumer.Claim) consumer.ClaimResult {
	t.Helper()
	tx, res, err := queueClaim(t, pool, s, c)
	if err != nil {
		t.Fatalf("queued claim of %s/%s: %v", c.Consumer, c.MessageID, err)
	}
	if err := tx.Commit(ctx(t)); err != nil {
		t.Fatal(err)
	}
	return res
}

// TestQueueClaim: a claim queued on the batch that begins the transaction
// gives the answers Claim gives, whatever the pool's query exec mode (the
// simple protocol is what PgBouncer users run).
func TestQueueClaim(t *testing.T) {
	t.Parallel()
	modes := map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement,
		"cache_describe":  pgx.QueryExecModeCacheDescribe,
		"describe_exec":   pgx.QueryExecModeDescribeExec,
		"exec":            pgx.QueryExecModeExec,
		"simple_protocol": pgx.QueryExecModeSimpleProtocol,
	}
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s, _ := setup(t, processed.Config{})
			pool := modePool(t, mode)
			c := claimOf("billing", "q-1", "pay 10")
			c.Partition, c.Offset = 2, 7
			for i := 0; i < 2; i++ { // twice: cached statements on the second round
				id := c
				id.MessageID += string(rune('a' + i))
				if got := queueClaimCommit(t, pool, s, id); got.Outcome != consumer.ClaimNew {
					t.Fatalf("first claim: %+v, want new", got)
				}
				rec, err := s.Lookup(ctx(t), "billing", id.MessageID)
				if err != nil {
					t.Fatal(err)
				}
				if rec.Partition == nil || *rec.Partition != 2 || rec.Offset == nil || *rec.Offset != 7 || rec.Source != "orders" {
					t.Fatalf("row: %+v", rec)
				}
				if got := queueClaimCommit(t, pool, s, id); got.Outcome != consumer.ClaimDuplicate || !got.ProcessedAt.Equal(rec.ProcessedAt) {
					t.Fatalf("second claim: %+v, want duplicate at %v", got, rec.ProcessedAt)
				}
				other := claimOf("billing", id.MessageID, "pay 1000")
				if got := queueClaimCommit(t, pool, s, other); got.Outcome != consumer.ClaimMismatch {
					t.Fatalf("different payload: %+v, want mismatch", got)
				}
				if got := queueClaimCommit(t, pool, s, claimOf("shipping", id.MessageID, "pay 10")); got.Outcome != consumer.ClaimNew {
					t.Fatalf("other consumer: %+v, want new", got)
				}
			}
			if st, err := s.Stats(ctx(t), ""); err != nil || st.Rows != 4 {
				t.Fatalf("Stats: %+v, %v; want 4 rows", st, err)
			}
		})
	}
}

// TestQueueClaimRolledBack: a queued claim rolls back with its transaction.
func TestQueueClaimRolledBack(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	c := claimOf("billing", "q-rb", "x")
	tx, res, err := queueClaim(t, pool, s, c)
	if err != nil || res.Outcome != consumer.ClaimNew {
		t.Fatalf("claim: %+v, %v", res, err)
	}
	if err := tx.Rollback(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Lookup(ctx(t), "billing", "q-rb"); !errors.Is(err, processed.ErrNotFound) {
		t.Fatalf("Lookup after rollback: %v, want ErrNotFound", err)
	}
	if got := queueClaimCommit(t, pool, s, c); got.Outcome != consumer.ClaimNew {
		t.Fatalf("claim after rollback: %+v, want new", got)
	}
}

// TestQueueClaimRowPurgedBeforeFinish: the queued insert conflicted, then a
// purge deleted the row before finish read it; finish claims the id afresh.
func TestQueueClaimRowPurgedBeforeFinish(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	c := claimOf("billing", "q-v", "x")
	queueClaimCommit(t, pool, s, c)

	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	finish := s.QueueClaim(b, c)
	br := pool.SendBatch(ctx(t), b)
	tx := br.Tx()
	defer func() { _ = tx.Rollback(context.Background()) }()
	sendErr := br.Close()
	if _, err := pool.Exec(ctx(t), "DELETE FROM "+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	res, err := finish(ctx(t), tx, sendErr)
	if err != nil || res.Outcome != consumer.ClaimNew {
		t.Fatalf("finish after purge: %+v, %v; want new", res, err)
	}
	if err := tx.Commit(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Lookup(ctx(t), "billing", "q-v"); err != nil {
		t.Fatalf("Lookup: %v", err)
	}
}

// TestQueueClaimErrors: an unmigrated table fails the batch with
// ErrNotMigrated; empty ids and a finish before the batch ran are errors.
func TestQueueClaimErrors(t *testing.T) {
	t.Parallel()
	pool := modePool(t, pgx.QueryExecModeCacheStatement)
	s, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	tx, _, err := queueClaim(t, pool, s, claimOf("a", "1", "x"))
	if !errors.Is(err, processed.ErrNotMigrated) {
		t.Errorf("unmigrated: %v, want ErrNotMigrated", err)
	}
	_ = tx.Rollback(ctx(t))
	if got := pool.Stat().AcquiredConns(); got != 0 {
		t.Errorf("%d connections still acquired after the failed batch's rollback", got)
	}

	s, _ = setup(t, processed.Config{})
	for _, c := range []consumer.Claim{claimOf("", "m", "x"), claimOf("c", "", "x")} {
		if _, res, err := queueClaim(t, pool, s, c); err == nil {
			t.Errorf("queued claim of %q/%q: %+v, want an error", c.Consumer, c.MessageID, res)
		}
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	finish := s.QueueClaim(b, claimOf("c", "early", "x"))
	tx, err = pool.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := finish(ctx(t), tx, nil); err == nil {
		t.Error("finish before the batch was sent succeeded")
	}
}
