package processed_test

import (
	"errors"
	"fmt"
	"math/rand"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

func partitionedSetup(t *testing.T, every time.Duration) (*processed.Store, *pgxpool.Pool) {
	t.Helper()
	return setup(t, processed.Config{Partitioned: true, PartitionInterval: every})
}

// partitionCount returns the table's partitions.
func partitionNames(t *testing.T, pool *pgxpool.Pool, s *processed.Store) []string {
	t.Helper()
	rows, err := pool.Query(ctx(t), `SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1) ORDER BY 1`, pgx.Identifier{s.Schema(), s.Table()}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return names
}

func TestPartitionedClaimDuplicateMismatch(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Hour)
	if p, err := s.Partitioned(ctx(t)); err != nil || !p {
		t.Fatalf("Partitioned = %v, %v", p, err)
	}
	if n := len(partitionNames(t, pool, s)); n != 1+1+processed.DefaultPartitionsAhead {
		t.Fatalf("%d partitions after Migrate, want default + current + %d ahead: %v", n, processed.DefaultPartitionsAhead, partitionNames(t, pool, s))
	}
	if err := s.Migrate(ctx(t)); err != nil {
		t.Fatalf("second Migrate: %v", err)
	}
	if r := claimTx(t, pool, s, claimOf("c", "m1", "a")); r.Outcome != consumer.ClaimNew {
		t.Fatalf("first claim: %v", r.Outcome)
	}
	r := claimTx(t, pool, s, claimOf("c", "m1", "a"))
	if r.Outcome != consumer.ClaimDuplicate || r.ProcessedAt.IsZero() {
		t.Fatalf("second claim: %+v", r)
	}
	if r := claimTx(t, pool, s, claimOf("c", "m1", "b")); r.Outcome != consumer.ClaimMismatch {
		t.Fatalf("other payload: %v", r.Outcome)
	}
	if r := claimTx(t, pool, s, claimOf("other", "m1", "b")); r.Outcome != consumer.ClaimNew {
		t.Fatalf("other consumer: %v", r.Outcome)
	}
	// The pipelined paths.
	for _, batch := range [][]consumer.Claim{
		{claimOf("c", "m1", "a")},
		{claimOf("c", "m1", "a"), claimOf("c", "m2", "a"), claimOf("c", "m3", "x")},
	} {
		tx, res, err := s.BeginClaim(ctx(t), batch)
		if err != nil {
			t.Fatal(err)
		}
		if res[0].Outcome != consumer.ClaimDuplicate {
			t.Fatalf("BeginClaim(%d): m1 is %v", len(batch), res[0].Outcome)
		}
		for _, r := range res[1:] {
			if r.Outcome != consumer.ClaimNew {
				t.Fatalf("BeginClaim: %v", res)
			}
		}
		if err := tx.Commit(ctx(t)); err != nil {
			t.Fatal(err)
		}
	}
	rec, err := s.Lookup(ctx(t), "c", "m2")
	if err != nil || rec.MessageID != "m2" {
		t.Fatalf("Lookup: %+v, %v", rec, err)
	}
	if _, err := s.Lookup(ctx(t), "c", "nope"); !errors.Is(err, processed.ErrNotFound) {
		t.Fatalf("Lookup missing: %v", err)
	}
	st, err := s.Stats(ctx(t), "c")
	if err != nil || st.Rows != 3 {
		t.Fatalf("Stats: %+v, %v", st, err)
	}
}

// TestPartitionedPurgeDropsPartitions: a purge drops the partitions wholly
// older than the retention, keeps the rest, and deletes old rows from the
// DEFAULT partition.
func TestPartitionedPurgeDropsPartitions(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Hour)
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	old := pgx.Identifier{s.Schema(), s.Table() + "_old"}.Sanitize()
	// A partition of 3 to 2 hours ago, and a row 5h old in the default,
	// as a table from before the DEFAULT partition's floor may hold (the
	// purge puts the floor back).
	if _, err := pool.Exec(ctx(t), `CREATE TABLE `+old+` PARTITION OF `+table+` (PRIMARY KEY (consumer, message_id))
FOR VALUES FROM (date_trunc('hour', now()) - interval '3 hours') TO (date_trunc('hour', now()) - interval '2 hours');
ALTER TABLE `+pgx.Identifier{s.Schema(), s.Table() + "_default"}.Sanitize()+` DROP CONSTRAINT `+pgx.Identifier{s.Table() + "_floor"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx(t), `INSERT INTO `+table+` (consumer, message_id, fingerprint, processed_at)
SELECT 'c', 'old'||g, sha256('x'), date_trunc('hour', now()) - interval '150 minutes' FROM generate_series(1, 100) g;
INSERT INTO `+table+` (consumer, message_id, fingerprint, processed_at) VALUES ('c', 'default-old', sha256('x'), now() - interval '5 hours')`); err != nil {
		t.Fatal(err)
	}
	claimTx(t, pool, s, claimOf("c", "new", "a"))
	n, err := s.Purge(ctx(t), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if n != 101 {
		t.Fatalf("purged %d, want 101", n)
	}
	if f, _, err := s.Floor(ctx(t)); err != nil || f == nil {
		t.Fatalf("the purge did not put the DEFAULT partition's floor back: %v, %v", f, err)
	}
	for _, name := range partitionNames(t, pool, s) {
		if name == s.Table()+"_old" {
			t.Fatalf("partition %s survived", name)
		}
	}
	st, _ := s.Stats(ctx(t), "")
	if st.Rows != 1 {
		t.Fatalf("%d rows left, want 1", st.Rows)
	}
	// A partition not yet wholly older than the retention stays.
	if n, err := s.Purge(ctx(t), time.Nanosecond*1000); err != nil || n != 0 {
		t.Fatalf("purge of the live partition: %d, %v", n, err)
	}
}

// TestPartitionedMigrateFromPlain converts a plain table with rows: they
// stay claimable (a redelivery is a duplicate), the grants follow.
func TestPartitionedMigrateFromPlain(t *testing.T) {
	t.Parallel()
	schema := testdb.Schema(t)
	plain, pool := setup(t, processed.Config{Schema: schema})
	claimTx(t, pool, plain, claimOf("c", "before", "a"))
	part, err := processed.New(pool, processed.Config{Schema: schema, Partitioned: true, PartitionInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := part.Migrate(ctx(t)); err != nil {
		t.Fatalf("Migrate --partitioned: %v", err)
	}
	if p, _ := part.Partitioned(ctx(t)); !p {
		t.Fatal("not partitioned")
	}
	if r := claimTx(t, pool, part, claimOf("c", "before", "a")); r.Outcome != consumer.ClaimDuplicate {
		t.Fatalf("claim of a legacy row: %v", r.Outcome)
	}
	if r := claimTx(t, pool, part, claimOf("c", "after", "a")); r.Outcome != consumer.ClaimNew {
		t.Fatalf("new claim: %v", r.Outcome)
	}
	names := partitionNames(t, pool, part)
	if names[0] != part.Table()+"_default" || names[1] != part.Table()+"_legacy" {
		t.Fatalf("partitions %v", names)
	}
	// A store still configured plain cannot claim on it: an error, not a
	// double apply.
	tx, err := pool.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx(t)) }()
	if _, err := plain.Claim(ctx(t), tx, claimOf("c", "before", "a")); err == nil {
		t.Fatal("a plain store claimed on the partitioned table")
	}
	_ = tx.Rollback(ctx(t))
	if err := part.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
}

// TestPartitionedConcurrentAcrossBoundary is the design's proof: many
// goroutines claim the same ids at once, just as a partition boundary
// passes (1s partitions), so that some claims' transactions start on one
// side and some on the other; per message and in batches. Each id must be
// applied exactly once: one row in the whole table, one effect.
func TestPartitionedConcurrentAcrossBoundary(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Second)
	effects := pgx.Identifier{s.Schema(), "effects"}.Sanitize()
	if _, err := pool.Exec(ctx(t), `CREATE TABLE `+effects+` (id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	const (
		rounds     = 4
		goroutines = 12
		ids        = 8
	)
	c := ctx(t)
	var applied atomic.Int64
	sides := map[string]bool{}
	for round := 0; round < rounds; round++ {
		if _, err := s.EnsurePartitions(c); err != nil {
			t.Fatal(err)
		}
		// Start 3ms before the next boundary, by the database's clock.
		var frac float64
		if err := pool.QueryRow(c, `SELECT extract(epoch FROM clock_timestamp()) - floor(extract(epoch FROM clock_timestamp()))`).Scan(&frac); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration((1-frac)*float64(time.Second)) - 3*time.Millisecond)
		batch := round%2 == 1
		var wg sync.WaitGroup
		errs := make(chan error, goroutines)
		for g := 0; g < goroutines; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				rnd := rand.New(rand.NewSource(int64(g*1000 + round)))
				time.Sleep(time.Duration(rnd.Intn(6000)) * time.Microsecond)
				var claims []consumer.Claim
				for i := 0; i < ids; i++ {
					claims = append(claims, claimOf("c", fmt.Sprintf("r%d-m%d", round, i), "p"))
				}
				if !batch {
					claims = claims[rnd.Intn(ids):][:1]
				} else {
					rnd.Shuffle(len(claims), func(i, j int) { claims[i], claims[j] = claims[j], claims[i] })
					claims = claims[:1+rnd.Intn(ids)]
					sort.Slice(claims, func(i, j int) bool { return claims[i].MessageID < claims[j].MessageID })
				}
				tx, res, err := s.BeginClaim(c, claims)
				if err != nil {
					if tx != nil {
						_ = tx.Rollback(c)
					}
					errs <- err
					return
				}
				defer func() { _ = tx.Rollback(c) }()
				for i, r := range res {
					if r.Outcome == consumer.ClaimNew {
						if _, err := tx.Exec(c, `INSERT INTO `+effects+` VALUES ($1)`, claims[i].MessageID); err != nil {
							errs <- err
							return
						}
						applied.Add(1)
					}
				}
				time.Sleep(2 * time.Millisecond) // hold the claims
				if err := tx.Commit(c); err != nil {
					errs <- err
				}
			}(g)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		rows, err := pool.Query(c, `SELECT tableoid::regclass::text FROM `+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()+` WHERE message_id LIKE $1`, fmt.Sprintf("r%d-%%", round))
		if err != nil {
			t.Fatal(err)
		}
		parts, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, p := range parts {
			sides[p] = true
		}
	}
	var dupIDs, dupEffects int
	if err := pool.QueryRow(c, `SELECT count(*) FROM (SELECT message_id FROM `+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()+` GROUP BY 1 HAVING count(*) > 1) d`).Scan(&dupIDs); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(c, `SELECT count(*) FROM (SELECT id FROM `+effects+` GROUP BY 1 HAVING count(*) > 1) d`).Scan(&dupEffects); err != nil {
		t.Fatal(err)
	}
	if dupIDs != 0 || dupEffects != 0 {
		t.Fatalf("%d ids with more than one row, %d with more than one effect", dupIDs, dupEffects)
	}
	t.Logf("applied %d, rows landed in %d partitions", applied.Load(), len(sides))
	if len(sides) < 2 {
		t.Fatalf("the rounds did not straddle a boundary: %v", sides)
	}
}

// TestPartitionedClaimLockOrder: batches of overlapping ids, taken in any
// order by callers, do not deadlock (the locks are sorted by key).
func TestPartitionedClaimLockOrder(t *testing.T) {
	t.Parallel()
	s, _ := partitionedSetup(t, time.Hour)
	c := ctx(t)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rnd := rand.New(rand.NewSource(int64(g)))
			for i := 0; i < 20; i++ {
				var claims []consumer.Claim
				for _, k := range rnd.Perm(10)[:5] {
					claims = append(claims, claimOf("c", fmt.Sprintf("m%d", k), "p"))
				}
				tx, _, err := s.BeginClaim(c, claims)
				if err != nil {
					if tx != nil {
						_ = tx.Rollback(c)
					}
					errs <- err
					return
				}
				if err := tx.Rollback(c); err != nil {
					errs <- err
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// TestPartitionedClaimRestoresSeqscan: the claim turns sequential scans off
// for its own statements only; the handler's statements in the same
// transaction see the session's setting.
func TestPartitionedClaimRestoresSeqscan(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Hour)
	for i, claims := range [][]consumer.Claim{
		{claimOf("c", "s1", "a")},
		{claimOf("c", "s1", "a")}, // a duplicate
		{claimOf("c", "s2", "a"), claimOf("c", "s3", "a")},
		{claimOf("c", "s2", "a"), claimOf("c", "s4", "a")},
	} {
		// BeginClaim, then Claim or ClaimBatch in the caller's
		// transaction, of other ids in the same pattern.
		for _, own := range []bool{false, true} {
			var (
				tx  pgx.Tx
				err error
			)
			if own {
				if tx, err = pool.Begin(ctx(t)); err == nil {
					var mine []consumer.Claim
					for _, c := range claims {
						mine = append(mine, claimOf("c", "own-"+c.MessageID, "a"))
					}
					if len(mine) == 1 {
						_, err = s.Claim(ctx(t), tx, mine[0])
					} else {
						_, err = s.ClaimBatch(ctx(t), tx, mine)
					}
				}
			} else {
				tx, _, err = s.BeginClaim(ctx(t), claims)
			}
			if err != nil {
				t.Fatal(err)
			}
			var v string
			if err := tx.QueryRow(ctx(t), `SHOW enable_seqscan`).Scan(&v); err != nil || v != "on" {
				t.Fatalf("enable_seqscan %q after claim %d of %d (own transaction %v): %v", v, i, len(claims), own, err)
			}
			if err := tx.Commit(ctx(t)); err != nil {
				t.Fatal(err)
			}
		}
	}
}
