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

// over returns a store for s's table over db.
func over(t *testing.T, db processed.DB, s *processed.Store) *processed.Store {
	t.Helper()
	o, err := processed.New(db, processed.Config{Schema: s.Schema(), Table: s.Table()})
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// queueClaim begins a transaction and claims c in it with BeginClaim over
// pool, the pipelined path the runtime takes, and returns the open
// transaction and the outcome. The caller commits or rolls back.
func queueClaim(t *testing.T, pool *pgxpool.Pool, s *processed.Store, c consumer.Claim) (pgx.Tx, consumer.ClaimResult, error) {
	t.Helper()
	tx, res, err := over(t, pool, s).BeginClaim(ctx(t), []consumer.Claim{c})
	if tx != nil {
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	}
	if err != nil {
		return tx, consumer.ClaimResult{}, err
	}
	if len(res) != 1 {
		t.Fatalf("BeginClaim: %d results for 1 claim", len(res))
	}
	return tx, res[0], nil
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

// afterBatchDB runs after once, when the first batch sent on the pool has
// been read: between the pipelined INSERT and the read of the row it
// conflicted with.
type afterBatchDB struct {
	*pgxpool.Pool
	after func()
}

type afterResults struct {
	pgx.BatchResults
	after func()
}

func (d afterBatchDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return afterResults{d.Pool.SendBatch(ctx, b), d.after}
}

func (r afterResults) Close() error {
	err := r.BatchResults.Close()
	r.after()
	return err
}

// TestQueueClaimRowPurgedBeforeFinish: the pipelined claim waited for a
// concurrent claim of its id, which committed after the claim's snapshot, so
// the claim's statement could not see the row; a purge then deleted it before
// the separate read. The id is claimed afresh.
func TestQueueClaimRowPurgedBeforeFinish(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	c := claimOf("billing", "q-v", "x")
	txA, err := pool.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = txA.Rollback(context.Background()) }()
	if res, err := s.Claim(ctx(t), txA, c); err != nil || res.Outcome != consumer.ClaimNew {
		t.Fatalf("A: %+v, %v", res, err)
	}

	purge := func() {
		if _, err := pool.Exec(ctx(t), "DELETE FROM "+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()); err != nil {
			t.Error(err)
		}
	}
	type answer struct {
		tx  pgx.Tx
		res []consumer.ClaimResult
		err error
	}
	done := make(chan answer, 1)
	// B claims on a pool of one connection, whose PID is known.
	pcfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 1
	one, err := pgxpool.NewWithConfig(ctx(t), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(one.Close)
	conn, err := one.Acquire(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	pidB := conn.Conn().PgConn().PID()
	conn.Release()
	b := over(t, afterBatchDB{one, purge}, s)
	go func() {
		tx, res, err := b.BeginClaim(ctx(t), []consumer.Claim{c})
		done <- answer{tx, res, err}
	}()
	waitUntilBlocked(t, pool, pidB)
	if err := txA.Commit(ctx(t)); err != nil {
		t.Fatal(err)
	}
	a := <-done
	if a.tx != nil {
		defer func() { _ = a.tx.Rollback(context.Background()) }()
	}
	if a.err != nil || a.res[0].Outcome != consumer.ClaimNew {
		t.Fatalf("claim after purge: %+v, %v; want new", a.res, a.err)
	}
	if err := a.tx.Commit(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Lookup(ctx(t), "billing", "q-v"); err != nil {
		t.Fatalf("Lookup: %v", err)
	}
}

// TestQueueClaimErrors: an unmigrated table fails the batch with
// ErrNotMigrated, and its connection is released with the rollback; empty
// ids are errors.
func TestQueueClaimErrors(t *testing.T) {
	t.Parallel()
	pool := modePool(t, pgx.QueryExecModeCacheStatement)
	s, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	tx, _, err := s.BeginClaim(ctx(t), []consumer.Claim{claimOf("a", "1", "x")})
	if !errors.Is(err, processed.ErrNotMigrated) {
		t.Errorf("unmigrated: %v, want ErrNotMigrated", err)
	}
	if tx != nil {
		_ = tx.Rollback(ctx(t))
	}
	if got := pool.Stat().AcquiredConns(); got != 0 {
		t.Errorf("%d connections still acquired after the failed batch's rollback", got)
	}

	s, _ = setup(t, processed.Config{})
	for _, c := range []consumer.Claim{claimOf("", "m", "x"), claimOf("c", "", "x")} {
		if _, res, err := queueClaim(t, pool, s, c); err == nil {
			t.Errorf("queued claim of %q/%q: %+v, want an error", c.Consumer, c.MessageID, res)
		}
	}
}

// TestBeginClaimBatchPipelined: several claims begun in one pipelined round
// trip give ClaimBatch's answers (new, duplicate, mismatch) whatever the
// pool's query exec mode, and roll back with their transaction.
func TestBeginClaimBatchPipelined(t *testing.T) {
	t.Parallel()
	modes := map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement,
		"exec":            pgx.QueryExecModeExec,
		"simple_protocol": pgx.QueryExecModeSimpleProtocol,
	}
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			base, _ := setup(t, processed.Config{})
			s := over(t, modePool(t, mode), base)
			queueClaimCommit(t, modePool(t, mode), base, claimOf("billing", "b-dup", "x"))
			queueClaimCommit(t, modePool(t, mode), base, claimOf("billing", "b-mis", "x"))
			claims := []consumer.Claim{claimOf("billing", "b-dup", "x"), claimOf("billing", "b-mis", "other"), claimOf("billing", "b-new", "x")}
			tx, res, err := s.BeginClaim(ctx(t), claims)
			if err != nil {
				t.Fatal(err)
			}
			want := []consumer.ClaimOutcome{consumer.ClaimDuplicate, consumer.ClaimMismatch, consumer.ClaimNew}
			for i, r := range res {
				if r.Outcome != want[i] || (want[i] != consumer.ClaimNew && r.ProcessedAt.IsZero()) {
					t.Errorf("claim %s: %+v, want %v", claims[i].MessageID, r, want[i])
				}
			}
			if err := tx.Rollback(ctx(t)); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Lookup(ctx(t), "billing", "b-new"); !errors.Is(err, processed.ErrNotFound) {
				t.Fatalf("after rollback: %v, want ErrNotFound", err)
			}
			tx, res, err = s.BeginClaim(ctx(t), claims[2:])
			if err != nil || res[0].Outcome != consumer.ClaimNew {
				t.Fatalf("claim after rollback: %+v, %v", res, err)
			}
			_ = tx.Rollback(ctx(t))
		})
	}
}
