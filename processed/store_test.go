package processed_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// setup returns a migrated store in a fresh schema, and the shared pool.
func setup(t *testing.T, cfg processed.Config) (*processed.Store, *pgxpool.Pool) {
	t.Helper()
	pool := testdb.Pool(t)
	if cfg.Schema == "" {
		cfg.Schema = testdb.Schema(t)
	}
	s, err := processed.New(pool, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := s.Migrate(ctx(t)); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return s, pool
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func claimOf(consumerName, id, body string) consumer.Claim {
	return consumer.Claim{
		Consumer:    consumerName,
		MessageID:   id,
		Fingerprint: sha256.Sum256([]byte(body)),
		Source:      "orders",
		Partition:   -1,
		Offset:      -1,
	}
}

// claimTx claims c in its own transaction and commits it.
func claimTx(t *testing.T, db processed.DB, s *processed.Store, c consumer.Claim) consumer.ClaimResult {
	t.Helper()
	tx, err := db.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	res, err := s.Claim(ctx(t), tx, c)
	if err != nil {
		t.Fatalf("Claim(%s/%s): %v", c.Consumer, c.MessageID, err)
	}
	if err := tx.Commit(ctx(t)); err != nil {
		t.Fatal(err)
	}
	return res
}

func TestClaimNewDuplicateMismatch(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})

	c := claimOf("billing", "m-1", "pay 10")
	c.Partition, c.Offset = 3, 42
	if got := claimTx(t, pool, s, c); got.Outcome != consumer.ClaimNew || !got.ProcessedAt.IsZero() {
		t.Fatalf("first claim: %+v, want new with zero ProcessedAt", got)
	}
	rec, err := s.Lookup(ctx(t), "billing", "m-1")
	if err != nil {
		t.Fatal(err)
	}

	dup := claimTx(t, pool, s, c)
	if dup.Outcome != consumer.ClaimDuplicate {
		t.Fatalf("second claim: %v, want duplicate", dup.Outcome)
	}
	if !dup.ProcessedAt.Equal(rec.ProcessedAt) {
		t.Errorf("duplicate ProcessedAt %v, want the row's %v", dup.ProcessedAt, rec.ProcessedAt)
	}

	mis := claimTx(t, pool, s, claimOf("billing", "m-1", "pay 1000"))
	if mis.Outcome != consumer.ClaimMismatch || !mis.ProcessedAt.Equal(rec.ProcessedAt) {
		t.Fatalf("different payload: %+v, want mismatch at %v", mis, rec.ProcessedAt)
	}
	// The mismatch did not overwrite the row.
	if rec2, err := s.Lookup(ctx(t), "billing", "m-1"); err != nil || string(rec2.Fingerprint) != string(c.Fingerprint[:]) {
		t.Fatalf("row after mismatch: %+v, %v", rec2, err)
	}

	// The consumer is the dedup scope.
	if got := claimTx(t, pool, s, claimOf("shipping", "m-1", "pay 10")); got.Outcome != consumer.ClaimNew {
		t.Fatalf("other consumer, same id: %v, want new", got.Outcome)
	}
}

func TestClaimRejectsEmptyIDs(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	tx, err := pool.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	for _, c := range []consumer.Claim{claimOf("", "m", "x"), claimOf("c", "", "x")} {
		if _, err := s.Claim(ctx(t), tx, c); err == nil {
			t.Errorf("Claim(%q, %q) succeeded", c.Consumer, c.MessageID)
		}
	}
	if _, err := s.Claim(ctx(t), nil, claimOf("c", "m", "x")); err == nil {
		t.Error("Claim with nil tx succeeded")
	}
}

func TestClaimRolledBackLeavesNoRow(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	c := claimOf("billing", "m-rb", "x")

	tx, err := pool.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if res, err := s.Claim(ctx(t), tx, c); err != nil || res.Outcome != consumer.ClaimNew {
		t.Fatalf("Claim: %+v, %v", res, err)
	}
	if err := tx.Rollback(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Lookup(ctx(t), "billing", "m-rb"); !errors.Is(err, processed.ErrNotFound) {
		t.Fatalf("Lookup after rollback: %v, want ErrNotFound", err)
	}
	if got := claimTx(t, pool, s, c); got.Outcome != consumer.ClaimNew {
		t.Fatalf("claim after rollback: %v, want new", got.Outcome)
	}
}

// waitUntilBlocked polls until the backend pid waits on a lock.
func waitUntilBlocked(t *testing.T, pool *pgxpool.Pool, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting bool
		err := pool.QueryRow(ctx(t),
			`SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, int32(pid)).Scan(&waiting)
		if err != nil {
			t.Fatalf("pg_stat_activity: %v", err)
		}
		if waiting {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("backend %d never blocked on a lock", pid)
		}
		time.Sleep(5 * time.Millisecond) // polling interval, not synchronisation
	}
}

type claimAnswer struct {
	res consumer.ClaimResult
	err error
}

// claimOnConn claims c on conn in a transaction of its own and commits it;
// it is how B claims in TestConcurrentClaims.
type claimOnConn func(ctx context.Context, conn *pgxpool.Conn, s *processed.Store, c consumer.Claim) (consumer.ClaimResult, error)

// claimers are the two ways to claim: Claim in a begun transaction, and
// BeginClaim, which pipelines BEGIN and the claim.
var claimers = map[string]claimOnConn{
	"claim": func(ctx context.Context, conn *pgxpool.Conn, s *processed.Store, c consumer.Claim) (consumer.ClaimResult, error) {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return consumer.ClaimResult{}, err
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		res, err := s.Claim(ctx, tx, c)
		if err != nil {
			return res, err
		}
		return res, tx.Commit(ctx)
	},
	"queued": func(ctx context.Context, conn *pgxpool.Conn, s *processed.Store, c consumer.Claim) (consumer.ClaimResult, error) {
		// A store over the one connection pipelines BEGIN and the claim.
		on, err := processed.New(conn.Conn(), processed.Config{Schema: s.Schema(), Table: s.Table()})
		if err != nil {
			return consumer.ClaimResult{}, err
		}
		tx, res, err := on.BeginClaim(ctx, []consumer.Claim{c})
		if tx != nil {
			defer func() { _ = tx.Rollback(context.Background()) }()
		}
		if err != nil {
			return consumer.ClaimResult{}, err
		}
		return res[0], tx.Commit(ctx)
	},
}

// TestConcurrentClaims: a claim of an id another transaction has claimed
// but not committed waits for it, then answers duplicate (it committed) or
// new (it rolled back), with either way of claiming.
func TestConcurrentClaims(t *testing.T) {
	t.Parallel()
	for name, claimB := range claimers {
		for _, firstCommits := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/first_commits=%v", name, firstCommits), func(t *testing.T) {
				t.Parallel()
				s, pool := setup(t, processed.Config{})
				c := claimOf("billing", "m-race", "x")

				txA, err := pool.Begin(ctx(t))
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = txA.Rollback(context.Background()) }()
				if res, err := s.Claim(ctx(t), txA, c); err != nil || res.Outcome != consumer.ClaimNew {
					t.Fatalf("A: %+v, %v", res, err)
				}

				connB, err := pool.Acquire(ctx(t))
				if err != nil {
					t.Fatal(err)
				}
				pidB := connB.Conn().PgConn().PID()
				answer := make(chan claimAnswer, 1)
				go func() {
					defer connB.Release()
					res, err := claimB(ctx(t), connB, s, c)
					answer <- claimAnswer{res, err}
				}()

				waitUntilBlocked(t, pool, pidB)
				select {
				case a := <-answer:
					t.Fatalf("B answered %+v while A's claim was uncommitted", a)
				default:
				}

				if firstCommits {
					err = txA.Commit(ctx(t))
				} else {
					err = txA.Rollback(ctx(t))
				}
				if err != nil {
					t.Fatal(err)
				}

				var a claimAnswer
				select {
				case a = <-answer:
				case <-time.After(10 * time.Second):
					t.Fatal("B still blocked after A finished")
				}
				want := consumer.ClaimDuplicate
				if !firstCommits {
					want = consumer.ClaimNew
				}
				if a.err != nil || a.res.Outcome != want {
					t.Fatalf("B: %+v, %v; want %v", a.res, a.err, want)
				}
				st, err := s.Stats(ctx(t), "billing")
				if err != nil || st.Rows != 1 {
					t.Fatalf("Stats: %+v, %v; want 1 row", st, err)
				}
			})
		}
	}
}

// A claim waiting on a concurrent purge of the same row inserts it afresh
// once the purge commits.
func TestClaimWaitsForConcurrentDelete(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	c := claimOf("billing", "m-del", "x")
	claimTx(t, pool, s, c)

	del, err := pool.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = del.Rollback(context.Background()) }()
	if _, err := del.Exec(ctx(t), "DELETE FROM "+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()); err != nil {
		t.Fatal(err)
	}

	tx, err := pool.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	pid := tx.Conn().PgConn().PID()
	answer := make(chan claimAnswer, 1)
	go func() {
		res, err := s.Claim(ctx(t), tx, c)
		answer <- claimAnswer{res, err}
	}()
	waitUntilBlocked(t, pool, pid)
	if err := del.Commit(ctx(t)); err != nil {
		t.Fatal(err)
	}
	select {
	case a := <-answer:
		if a.err != nil || a.res.Outcome != consumer.ClaimNew {
			t.Fatalf("claim after purge: %+v, %v; want new", a.res, a.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("claim still blocked")
	}
}

// hookTx runs hooks before the store's statements, to make the conflicting
// row vanish between Claim's insert and its select.
type hookTx struct {
	pgx.Tx
	beforeExec, beforeQueryRow func()
}

func (h hookTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if h.beforeExec != nil {
		h.beforeExec()
	}
	return h.Tx.Exec(ctx, sql, args...)
}

func (h hookTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if h.beforeQueryRow != nil {
		h.beforeQueryRow()
	}
	return h.Tx.QueryRow(ctx, sql, args...)
}

func TestClaimRetriesWhenRowVanishes(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	exec := func(sql string, args ...any) {
		if _, err := pool.Exec(ctx(t), sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	c := claimOf("billing", "m-v", "x")
	purge := func() { exec("DELETE FROM " + table) }
	insert := func() {
		exec("INSERT INTO "+table+" (consumer, message_id, fingerprint) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
			c.Consumer, c.MessageID, c.Fingerprint[:])
	}

	t.Run("once", func(t *testing.T) {
		tx, err := pool.Begin(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		insert()
		purged := 0
		h := hookTx{Tx: tx, beforeQueryRow: func() {
			if purged == 0 {
				purge()
			}
			purged++
		}}
		res, err := s.Claim(ctx(t), h, c)
		if err != nil || res.Outcome != consumer.ClaimNew {
			t.Fatalf("Claim: %+v, %v; want new after one retry", res, err)
		}
	})
	t.Run("always", func(t *testing.T) {
		tx, err := pool.Begin(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		h := hookTx{Tx: tx, beforeExec: insert, beforeQueryRow: purge}
		if res, err := s.Claim(ctx(t), h, c); err == nil {
			t.Fatalf("Claim: %+v, want an error after bounded retries", res)
		}
	})
}

func TestPurge(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ old, fresh, batch int }{
		{old: 7, fresh: 3, batch: 3}, // batches of 3, 3, 1
		{old: 6, fresh: 2, batch: 3}, // 3, 3, 0
		{old: 0, fresh: 2, batch: 3},
		{old: 5, fresh: 0, batch: 1000},
	} {
		t.Run(fmt.Sprintf("old=%d/fresh=%d/batch=%d", tc.old, tc.fresh, tc.batch), func(t *testing.T) {
			t.Parallel()
			s, pool := setup(t, processed.Config{PurgeBatchSize: tc.batch})
			table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
			for i := range tc.old + tc.fresh {
				claimTx(t, pool, s, claimOf(fmt.Sprintf("c%d", i%2), fmt.Sprintf("m-%d", i), "x"))
			}
			if _, err := pool.Exec(ctx(t), `UPDATE `+table+` SET processed_at = now() - interval '2 hours'
				WHERE message_id IN (SELECT message_id FROM `+table+` ORDER BY message_id LIMIT $1)`, tc.old); err != nil {
				t.Fatal(err)
			}
			n, err := s.Purge(ctx(t), time.Hour)
			if err != nil || n != int64(tc.old) {
				t.Fatalf("Purge: %d, %v; want %d", n, err, tc.old)
			}
			st, err := s.Stats(ctx(t), "")
			if err != nil || st.Rows != int64(tc.fresh) {
				t.Fatalf("rows left: %+v, %v; want %d", st, err, tc.fresh)
			}
			if n, err := s.Purge(ctx(t), time.Hour); err != nil || n != 0 {
				t.Fatalf("second Purge: %d, %v; want 0", n, err)
			}
		})
	}
}

// TestPurgePause: a paced purge waits PurgePause between batches (7 rows in
// batches of 3 make two pauses) and stops during a pause when ctx ends.
func TestPurgePause(t *testing.T) {
	t.Parallel()
	const pause = 150 * time.Millisecond
	s, pool := setup(t, processed.Config{PurgeBatchSize: 3, PurgePause: pause})
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	age := func() {
		if _, err := pool.Exec(ctx(t), `UPDATE `+table+` SET processed_at = now() - interval '2 hours'`); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 7 {
		claimTx(t, pool, s, claimOf("c", fmt.Sprintf("m-%d", i), "x"))
	}
	age()
	start := time.Now()
	if n, err := s.Purge(ctx(t), time.Hour); err != nil || n != 7 {
		t.Fatalf("Purge: %d, %v; want 7", n, err)
	}
	if el := time.Since(start); el < 2*pause {
		t.Fatalf("7 rows in batches of 3 took %s, want at least two pauses of %s", el, pause)
	}

	for i := range 7 {
		claimTx(t, pool, s, claimOf("c", fmt.Sprintf("m-%d", i), "x"))
	}
	age()
	cctx, cancel := context.WithTimeout(ctx(t), pause/2) // ends in the first pause
	defer cancel()
	n, err := s.Purge(cctx, time.Hour)
	if !errors.Is(err, context.DeadlineExceeded) || n != 3 {
		t.Fatalf("Purge cancelled in a pause: %d, %v; want 3 rows and the context's error", n, err)
	}
}

func TestPurgeRejectsNonPositive(t *testing.T) {
	t.Parallel()
	s, _ := setup(t, processed.Config{})
	for _, d := range []time.Duration{0, -time.Hour} {
		if _, err := s.Purge(ctx(t), d); err == nil {
			t.Errorf("Purge(%s) succeeded", d)
		}
	}
}

func TestLookup(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	a := claimOf("billing", "m-a", "body")
	a.Source, a.Partition, a.Offset = "payments", 0, 0
	b := claimOf("billing", "m-b", "body")
	claimTx(t, pool, s, a)
	claimTx(t, pool, s, b)

	ra, err := s.Lookup(ctx(t), "billing", "m-a")
	if err != nil {
		t.Fatal(err)
	}
	if ra.Consumer != "billing" || ra.MessageID != "m-a" || string(ra.Fingerprint) != string(a.Fingerprint[:]) ||
		ra.Source != "payments" || ra.Partition == nil || *ra.Partition != 0 || ra.Offset == nil || *ra.Offset != 0 ||
		time.Since(ra.ProcessedAt) > time.Minute {
		t.Errorf("Lookup m-a: %+v", ra)
	}
	rb, err := s.Lookup(ctx(t), "billing", "m-b")
	if err != nil {
		t.Fatal(err)
	}
	if rb.Partition != nil || rb.Offset != nil {
		t.Errorf("negative partition/offset stored as %v/%v, want NULL", rb.Partition, rb.Offset)
	}
	if _, err := s.Lookup(ctx(t), "shipping", "m-a"); !errors.Is(err, processed.ErrNotFound) {
		t.Errorf("Lookup other consumer: %v, want ErrNotFound", err)
	}
}

func TestStats(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	if st, err := s.Stats(ctx(t), ""); err != nil || st.Rows != 0 || !st.Oldest.IsZero() {
		t.Fatalf("empty Stats: %+v, %v", st, err)
	}
	claimTx(t, pool, s, claimOf("a", "1", "x"))
	claimTx(t, pool, s, claimOf("a", "2", "x"))
	claimTx(t, pool, s, claimOf("b", "1", "x"))
	if st, err := s.Stats(ctx(t), "a"); err != nil || st.Rows != 2 || st.Oldest.IsZero() {
		t.Errorf("Stats(a): %+v, %v", st, err)
	}
	if st, err := s.Stats(ctx(t), ""); err != nil || st.Rows != 3 {
		t.Errorf("Stats(all): %+v, %v", st, err)
	}
}

func TestNotMigrated(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	s, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := s.Claim(ctx(t), tx, claimOf("a", "1", "x")); !errors.Is(err, processed.ErrNotMigrated) {
		t.Errorf("Claim: %v, want ErrNotMigrated", err)
	}
	if _, err := s.Lookup(ctx(t), "a", "1"); !errors.Is(err, processed.ErrNotMigrated) {
		t.Errorf("Lookup: %v, want ErrNotMigrated", err)
	}
	if v, err := s.Version(ctx(t)); err != nil || v != 0 {
		t.Errorf("Version: %d, %v; want 0", v, err)
	}
}
