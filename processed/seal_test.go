package processed_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// sealFixture makes an hourly partitioned store with three past partitions
// (5 to 2 hours ago) of perPart rows each, ids old-<p>-<g> with the
// fingerprint of body "p", and returns the store and the partitions' names.
func sealFixture(t *testing.T, perPart int) (*processed.Store, *pgxpool.Pool, []string) {
	t.Helper()
	s, pool := partitionedSetup(t, time.Hour)
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	var names []string
	for p := 0; p < 3; p++ {
		name := fmt.Sprintf("%s_past%d", s.Table(), p)
		names = append(names, name)
		if _, err := pool.Exec(ctx(t), fmt.Sprintf(`CREATE TABLE %s PARTITION OF %s (PRIMARY KEY (consumer, message_id))
FOR VALUES FROM (date_trunc('hour', now()) - interval '%d hours') TO (date_trunc('hour', now()) - interval '%d hours')`,
			pgx.Identifier{s.Schema(), name}.Sanitize(), table, 5-p, 4-p)); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx(t), fmt.Sprintf(`INSERT INTO %s (consumer, message_id, fingerprint, processed_at)
SELECT 'c', 'old-%d-' || g, sha256('p'), date_trunc('hour', now()) - interval '%d minutes' FROM generate_series(1, %d) g`,
			table, p, (5-p)*60-30, perPart)); err != nil {
			t.Fatal(err)
		}
	}
	return s, pool, names
}

// cacheModes runs f twice: claims reading the sealed partitions' filters
// from the filter table, and from the store's cache (cache does what it
// takes to fill it; it is nil in the first run).
func cacheModes(t *testing.T, f func(t *testing.T, cache func(*processed.Store))) {
	t.Run("table", func(t *testing.T) {
		t.Parallel()
		f(t, nil)
	})
	t.Run("cached", func(t *testing.T) {
		t.Parallel()
		f(t, func(s *processed.Store) {
			t.Helper()
			if _, err := s.CacheFilters(ctx(t)); err != nil {
				t.Fatal(err)
			}
			sealed, err := s.Sealed(ctx(t))
			if err != nil {
				t.Fatal(err)
			}
			if got := s.CachedFilters(); len(got) != len(sealed) {
				t.Fatalf("cached filters of %v, want the %d sealed partitions", got, len(sealed))
			}
		})
	})
}

// readsFilterTable reports whether the store's fast claim statement reads
// the filter table.
func readsFilterTable(t *testing.T, s *processed.Store) bool {
	t.Helper()
	sql, err := s.FastInsertSQL(ctx(t))
	if err != nil || sql == "" {
		t.Fatalf("fast insert: %q, %v", sql, err)
	}
	return strings.Contains(sql, s.Table()+"_filter")
}

// TestSealedPartitionsKeepUniqueness: once past partitions are sealed, a
// claim of a new id no longer looks them up, yet every id they hold is
// still found, in every claim path (Claim, the pipelined single claim, the
// pipelined batch, ClaimBatch), with its fingerprint checked, whether the
// claims read the filters from the table or from the store's cache; a
// sealed partition refuses new rows; and a purge that drops a sealed
// partition drops its seal, and the cache forgets it.
func TestSealedPartitionsKeepUniqueness(t *testing.T) {
	t.Parallel()
	cacheModes(t, testSealedUniqueness)
}

func testSealedUniqueness(t *testing.T, cache func(*processed.Store)) {
	const perPart = 700
	s, pool, names := sealFixture(t, perPart)
	// A seal cut short after its first step (the constraint, here under
	// another name) is finished, not stuck.
	if _, err := pool.Exec(ctx(t), `ALTER TABLE `+pgx.Identifier{s.Schema(), names[0]}.Sanitize()+` ADD CONSTRAINT half_done CHECK (false) NOT VALID`); err != nil {
		t.Fatal(err)
	}
	n, err := s.SealPartitions(ctx(t))
	if err != nil || n != 3 {
		t.Fatalf("SealPartitions = %d, %v; want 3", n, err)
	}
	if n, err := s.SealPartitions(ctx(t)); err != nil || n != 0 {
		t.Fatalf("second SealPartitions = %d, %v; want 0", n, err)
	}
	sealed, err := s.Sealed(ctx(t))
	if err != nil || len(sealed) != 3 {
		t.Fatalf("Sealed = %+v, %v", sealed, err)
	}
	for i, sp := range sealed {
		if sp.Partition != names[i] || sp.IDs != perPart || !sp.Lo.Before(sp.Hi) {
			t.Fatalf("sealed[%d] = %+v, want %s with %d ids", i, sp, names[i], perPart)
		}
	}
	if cache != nil {
		cache(s)
	}
	if got := readsFilterTable(t, s); got != (cache == nil) {
		t.Fatalf("the fast claim reads the filter table: %v, want %v", got, cache == nil)
	}

	var dup, fresh int
	count := func(res []consumer.ClaimResult, claims []consumer.Claim) {
		t.Helper()
		for i, r := range res {
			old := strings.HasPrefix(claims[i].MessageID, "old-")
			switch {
			case old && r.Outcome == consumer.ClaimDuplicate:
				dup++
			case !old && r.Outcome == consumer.ClaimNew:
				fresh++
			default:
				t.Fatalf("%s: %v", claims[i].MessageID, r.Outcome)
			}
		}
	}
	for p := 0; p < 3; p++ {
		for g := 1; g <= perPart; g++ {
			old := claimOf("c", fmt.Sprintf("old-%d-%d", p, g), "p")
			novel := claimOf("c", fmt.Sprintf("new-%d-%d", p, g), "p")
			switch g % 4 {
			case 0: // Claim in the caller's transaction
				for _, c := range []consumer.Claim{old, novel} {
					count([]consumer.ClaimResult{claimTx(t, pool, s, c)}, []consumer.Claim{c})
				}
			case 1, 2: // pipelined: one claim at a time, or a batch
				runs := [][]consumer.Claim{{old}, {novel}}
				if g%4 == 2 {
					runs = [][]consumer.Claim{{old, novel}}
				}
				for _, claims := range runs {
					tx, res, err := s.BeginClaim(ctx(t), claims)
					if err != nil {
						t.Fatal(err)
					}
					if err := tx.Commit(ctx(t)); err != nil {
						t.Fatal(err)
					}
					count(res, claims)
				}
			case 3: // ClaimBatch
				claims := []consumer.Claim{novel, old}
				tx, err := pool.Begin(ctx(t))
				if err != nil {
					t.Fatal(err)
				}
				res, err := s.ClaimBatch(ctx(t), tx, claims)
				if err != nil {
					_ = tx.Rollback(ctx(t))
					t.Fatal(err)
				}
				if err := tx.Commit(ctx(t)); err != nil {
					t.Fatal(err)
				}
				count(res, claims)
			}
		}
	}
	if dup != 3*perPart || fresh != 3*perPart {
		t.Fatalf("%d duplicates, %d new; want %d each", dup, fresh, 3*perPart)
	}
	if r := claimTx(t, pool, s, claimOf("c", "old-1-7", "other")); r.Outcome != consumer.ClaimMismatch {
		t.Fatalf("a sealed id with another payload: %v, want mismatch", r.Outcome)
	}

	// A sealed partition refuses rows: a claim whose transaction started
	// before its end fails instead of inserting where no filter sees it.
	_, err = pool.Exec(ctx(t), `INSERT INTO `+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()+` (consumer, message_id, fingerprint, processed_at)
VALUES ('c', 'late', sha256('p'), date_trunc('hour', now()) - interval '150 minutes')`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23514" {
		t.Fatalf("insert into a sealed partition: %v, want a check violation", err)
	}

	// Purging drops the two oldest partitions and their seals.
	if _, err := s.Purge(ctx(t), 3*time.Hour+time.Minute); err != nil {
		t.Fatal(err)
	}
	sealed, err = s.Sealed(ctx(t))
	if err != nil || len(sealed) != 1 || sealed[0].Partition != names[2] {
		t.Fatalf("after the purge, Sealed = %+v, %v; want only %s", sealed, err, names[2])
	}
	var filterRows int
	if err := pool.QueryRow(ctx(t), `SELECT count(DISTINCT partition) FROM `+pgx.Identifier{s.Schema(), s.Table() + "_filter"}.Sanitize()).Scan(&filterRows); err != nil || filterRows != 1 {
		t.Fatalf("filters of %d partitions after the purge (%v), want 1", filterRows, err)
	}
	if r := claimTx(t, pool, s, claimOf("c", "old-2-5", "p")); r.Outcome != consumer.ClaimDuplicate {
		t.Fatalf("an id of the sealed partition left: %v", r.Outcome)
	}
	if cache != nil {
		cache(s)
		if got := s.CachedFilters(); len(got) != 1 || got[0] != names[2] {
			t.Fatalf("after the purge, cached filters of %v; want only %s", got, names[2])
		}
		if readsFilterTable(t, s) {
			t.Fatal("after the purge, the fast claim reads the filter table")
		}
		if r := claimTx(t, pool, s, claimOf("c", "old-2-6", "p")); r.Outcome != consumer.ClaimDuplicate {
			t.Fatalf("an id of the sealed partition left, cached: %v", r.Outcome)
		}
	}
}

// TestSealedFilterFalsePositivesFallBack: when a sealed partition's filter
// says an id may be there and it is not (a false positive, forced here by
// setting every bit), the claim looks in every partition and claims the id
// once, in every claim path, with the filters read from the table or from
// the store's cache.
func TestSealedFilterFalsePositivesFallBack(t *testing.T) {
	t.Parallel()
	cacheModes(t, testFalsePositives)
}

func testFalsePositives(t *testing.T, cache func(*processed.Store)) {
	s, pool, names := sealFixture(t, 50)
	if _, err := s.SealPartitions(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx(t), `INSERT INTO `+pgx.Identifier{s.Schema(), s.Table() + "_filter"}.Sanitize()+` (bucket, partition, bits)
SELECT b, $1, decode(repeat('ff', 16), 'hex') FROM generate_series(0, 32767) b
ON CONFLICT (bucket, partition) DO UPDATE SET bits = decode(repeat('ff', octet_length(excluded.bits)), 'hex')`, names[1]); err != nil {
		t.Fatal(err)
	}
	if cache != nil {
		cache(s)
	}
	for i := 0; i < 20; i++ {
		c := claimOf("c", fmt.Sprintf("fp-%d", i), "p")
		var res []consumer.ClaimResult
		switch i % 3 {
		case 0:
			res = []consumer.ClaimResult{claimTx(t, pool, s, c)}
		case 1:
			tx, r, err := s.BeginClaim(ctx(t), []consumer.Claim{c})
			if err != nil {
				t.Fatal(err)
			}
			res = r
			if err := tx.Commit(ctx(t)); err != nil {
				t.Fatal(err)
			}
		case 2:
			tx, r, err := s.BeginClaim(ctx(t), []consumer.Claim{c, claimOf("c", "old-0-1", "p")})
			if err != nil {
				t.Fatal(err)
			}
			if r[1].Outcome != consumer.ClaimDuplicate {
				t.Fatalf("old-0-1 in a batch: %v", r[1].Outcome)
			}
			res = r[:1]
			if err := tx.Commit(ctx(t)); err != nil {
				t.Fatal(err)
			}
		}
		if res[0].Outcome != consumer.ClaimNew {
			t.Fatalf("%s: %v, want new", c.MessageID, res[0].Outcome)
		}
		if r := claimTx(t, pool, s, c); r.Outcome != consumer.ClaimDuplicate {
			t.Fatalf("%s again: %v", c.MessageID, r.Outcome)
		}
	}
}

// TestFastClaimsAfterAnotherProcessDrops: a store whose claim statements
// name a partition that another process's purge then drops gets an error
// that is not ErrNotMigrated (which would stop a runtime), and its next
// claim, built from the partitions as they are, succeeds.
func TestFastClaimsAfterAnotherProcessDrops(t *testing.T) {
	t.Parallel()
	s, pool, _ := sealFixture(t, 10)
	if r := claimTx(t, pool, s, claimOf("c", "first", "p")); r.Outcome != consumer.ClaimNew {
		t.Fatalf("first claim: %v", r.Outcome)
	}
	other, err := processed.New(pool, processed.Config{Schema: s.Schema(), Partitioned: true, PartitionInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := other.Purge(ctx(t), 3*time.Hour+time.Minute); err != nil || n != 20 {
		t.Fatalf("the other store's purge: %d rows, %v; want the 2 oldest partitions' 20", n, err)
	}
	tx, _, err := s.BeginClaim(ctx(t), []consumer.Claim{claimOf("c", "second", "p")})
	if tx != nil {
		_ = tx.Rollback(ctx(t))
	}
	if err == nil || errors.Is(err, processed.ErrNotMigrated) || errors.Is(err, consumer.ErrNotMigrated) {
		t.Fatalf("claim naming a dropped partition: %v; want a retryable error", err)
	}
	for _, claims := range [][]consumer.Claim{{claimOf("c", "second", "p")}, {claimOf("c", "third", "p"), claimOf("c", "old-2-3", "p")}} {
		tx, res, err := s.BeginClaim(ctx(t), claims)
		if err != nil {
			t.Fatalf("the retry: %v", err)
		}
		if err := tx.Commit(ctx(t)); err != nil {
			t.Fatal(err)
		}
		if res[0].Outcome != consumer.ClaimNew || (len(res) > 1 && res[1].Outcome != consumer.ClaimDuplicate) {
			t.Fatalf("the retry: %v", res)
		}
	}
}

// TestClaimInCallersTxBuildsFastClaimsOnIt: Claim in the caller's
// transaction, on a pool whose one connection that transaction holds, must
// not wait for a second connection to build its statements (with every
// connection held by such a claim, the wait would never end).
func TestClaimInCallersTxBuildsFastClaimsOnIt(t *testing.T) {
	t.Parallel()
	s0, _, _ := sealFixture(t, 5)
	if _, err := s0.SealPartitions(ctx(t)); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	one, err := pgxpool.NewWithConfig(ctx(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	s, err := processed.New(one, processed.Config{Schema: s0.Schema(), Partitioned: true, PartitionInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	c, cancel := context.WithTimeout(ctx(t), 5*time.Second)
	defer cancel()
	tx, err := one.Begin(c)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	for _, claim := range []consumer.Claim{claimOf("c", "in-tx", "p"), claimOf("c", "old-1-2", "p")} {
		res, err := s.Claim(c, tx, claim)
		if err != nil {
			t.Fatalf("Claim(%s) holding the pool's only connection: %v", claim.MessageID, err)
		}
		want := consumer.ClaimNew
		if claim.MessageID == "old-1-2" {
			want = consumer.ClaimDuplicate
		}
		if res.Outcome != want {
			t.Fatalf("Claim(%s): %v, want %v", claim.MessageID, res.Outcome, want)
		}
	}
	res, err := s.ClaimBatch(c, tx, []consumer.Claim{claimOf("c", "in-tx-2", "p"), claimOf("c", "old-2-3", "p")})
	if err != nil || res[0].Outcome != consumer.ClaimNew || res[1].Outcome != consumer.ClaimDuplicate {
		t.Fatalf("ClaimBatch holding the pool's only connection: %v, %v", res, err)
	}
}

// beginAt begins a transaction, rolled back when the test ends unless it
// ended before, and returns it with its start time (now()).
func beginAt(t *testing.T, pool *pgxpool.Pool) (pgx.Tx, time.Time) {
	t.Helper()
	tx, err := pool.Begin(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	var start time.Time
	if err := tx.QueryRow(ctx(t), `SELECT now()`).Scan(&start); err != nil {
		t.Fatal(err)
	}
	return tx, start
}

// TestLateClaimIntoSealedPartitionFails: a claim whose transaction started
// in a partition that has since been sealed fails with a check violation
// (which the runtime retries in a new transaction) instead of inserting a
// row no filter holds; the error is not ErrNotMigrated, which would stop a
// runtime.
func TestLateClaimIntoSealedPartitionFails(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Second)
	tx, start := beginAt(t, pool)
	// Past the end of the transaction's partition and the seal delay.
	time.Sleep(time.Until(start.Truncate(time.Second).Add(2*time.Second + 300*time.Millisecond)))
	if _, err := s.EnsurePartitions(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if n, err := s.SealPartitions(ctx(t)); err != nil || n == 0 {
		t.Fatalf("SealPartitions = %d, %v; want the transaction's partition sealed", n, err)
	}
	_, err := s.Claim(ctx(t), tx, claimOf("c", "late", "p"))
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23514" || errors.Is(err, processed.ErrNotMigrated) {
		t.Fatalf("late claim into a sealed partition: %v; want a check violation", err)
	}
	// A new transaction claims it.
	if r := claimTx(t, pool, s, claimOf("c", "late", "p")); r.Outcome != consumer.ClaimNew {
		t.Fatalf("the retry: %v", r.Outcome)
	}
}

// TestClaimFromBeforeTheCurrentPartition: a claim whose transaction started
// in the previous partition, not sealed yet, while the fast statements are
// built for the current one, claims the id into the partition of its
// transaction's start (the fast statement, which inserts into the current
// partition by name, must leave it to the full lookup), and a claim of the
// same id in a new transaction waits for it and finds it.
func TestClaimFromBeforeTheCurrentPartition(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Second)
	for _, batch := range []bool{false, true} {
		id := fmt.Sprintf("early-%v", batch)
		tx, start := beginAt(t, pool)
		// Into the next partition, before the seal delay ends.
		time.Sleep(time.Until(start.Truncate(time.Second).Add(1100 * time.Millisecond)))
		if _, err := s.EnsurePartitions(ctx(t)); err != nil {
			t.Fatal(err)
		}
		// Builds the fast statements for the current partition.
		if r := claimTx(t, pool, s, claimOf("c", id+"-warm", "p")); r.Outcome != consumer.ClaimNew {
			t.Fatalf("warm-up claim: %v", r.Outcome)
		}
		var (
			res []consumer.ClaimResult
			err error
		)
		if batch {
			res, err = s.ClaimBatch(ctx(t), tx, []consumer.Claim{claimOf("c", id, "p"), claimOf("c", id+"-2", "p")})
		} else {
			var r consumer.ClaimResult
			r, err = s.Claim(ctx(t), tx, claimOf("c", id, "p"))
			res = []consumer.ClaimResult{r}
		}
		if err != nil {
			t.Fatalf("claim (batch %v) in a transaction started in the previous partition: %v", batch, err)
		}
		for i, r := range res {
			if r.Outcome != consumer.ClaimNew {
				t.Fatalf("claim %d (batch %v): %v, want new", i, batch, r.Outcome)
			}
		}
		type result struct {
			res consumer.ClaimResult
			err error
		}
		done := make(chan result, 1)
		go func() {
			tx2, res, err := s.BeginClaim(ctx(t), []consumer.Claim{claimOf("c", id, "p")})
			if tx2 != nil {
				_ = tx2.Rollback(context.Background())
			}
			if err != nil {
				done <- result{err: err}
				return
			}
			done <- result{res: res[0]}
		}()
		time.Sleep(100 * time.Millisecond)
		if err := tx.Commit(ctx(t)); err != nil {
			t.Fatal(err)
		}
		if r := <-done; r.err != nil || r.res.Outcome != consumer.ClaimDuplicate {
			t.Fatalf("the second claim (batch %v): %v, %v; want a duplicate", batch, r.res.Outcome, r.err)
		}
		var part string
		var n int
		if err := pool.QueryRow(ctx(t), `SELECT min(tableoid::regclass::text), count(*) FROM `+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()+` WHERE message_id = $1`, id).Scan(&part, &n); err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf("%s_p%d", s.Table(), start.Truncate(time.Second).Unix())
		if n != 1 || !strings.HasSuffix(part, want) {
			t.Fatalf("%d rows of %s, in %s; want one, in %s", n, id, part, want)
		}
	}
}

// TestFastClaimTextStable: rebuilding the fast claim statements (every
// minute) gives the same text while nothing changed, so that a
// connection's prepared statements do not pile up; a DEFAULT partition that
// grew past a power of two of pages changes it, so that connections plan
// the statement again.
func TestFastClaimTextStable(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Hour)
	first, err := s.FastInsertSQL(ctx(t))
	if err != nil || first == "" {
		t.Fatalf("fast insert: %q, %v", first, err)
	}
	again, err := s.FastInsertSQL(ctx(t))
	if err != nil || again != first {
		t.Fatalf("rebuilt with nothing changed:\n%s\nthen\n%s\n(%v)", first, again, err)
	}
	// Rows of next year, which no partition covers, go to the DEFAULT one
	// (its floor is below them).
	grow := func(n int) string {
		t.Helper()
		if _, err := pool.Exec(ctx(t), `INSERT INTO `+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()+` (consumer, message_id, fingerprint, processed_at)
SELECT 'c', 'future-' || g || '-' || $1::int, sha256(int8send(g)), now() + interval '1 year' FROM generate_series(1, $1::int) g`, n); err != nil {
			t.Fatal(err)
		}
		sql, err := s.FastInsertSQL(ctx(t))
		if err != nil || !strings.Contains(sql, s.Table()+"_default") {
			t.Fatalf("fast insert with rows in the DEFAULT partition does not probe it: %q, %v", sql, err)
		}
		return sql
	}
	small := grow(1)
	if again := grow(0); again != small {
		t.Fatalf("rebuilt with nothing changed:\n%s\nthen\n%s", small, again)
	}
	if grown := grow(2000); grown == small {
		t.Fatal("rebuilt after the DEFAULT partition grew: unchanged text")
	}
}

// TestFastClaimSkipsEmptyDefault: with the DEFAULT partition empty and its
// floor past the current partition, the fast claim does not probe it, and
// does again once it holds a row.
func TestFastClaimSkipsEmptyDefault(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Hour)
	sql, err := s.FastInsertSQL(ctx(t))
	if err != nil || sql == "" || strings.Contains(sql, s.Table()+"_default") {
		t.Fatalf("fast insert on an empty DEFAULT partition below its floor probes it: %q, %v", sql, err)
	}
	if _, err := pool.Exec(ctx(t), `INSERT INTO `+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()+` (consumer, message_id, fingerprint, processed_at)
VALUES ('c', 'future', sha256('x'), now() + interval '1 year')`); err != nil {
		t.Fatal(err)
	}
	if sql, err := s.FastInsertSQL(ctx(t)); err != nil || !strings.Contains(sql, s.Table()+"_default") {
		t.Fatalf("fast insert with a row in the DEFAULT partition does not probe it: %q, %v", sql, err)
	}
}

// TestDefaultFloor: the DEFAULT partition refuses rows below its floor, the
// end of the partitions ahead, so that a claim whose transaction began in a
// gap of the past (here: its partition was dropped by a purge) fails with a
// check violation, which the runtime retries, instead of inserting into the
// DEFAULT partition, which the fast claims do not look in; the floor
// follows the partitions as they are created.
func TestDefaultFloor(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Second)
	floor := func() time.Time {
		t.Helper()
		f, newest, err := s.Floor(ctx(t))
		if err != nil || f == nil || !f.Equal(newest) {
			t.Fatalf("the DEFAULT partition's floor: %v, %v; want the newest partition's upper bound %s", f, err, newest)
		}
		return *f
	}
	f0 := floor()

	tx, start := beginAt(t, pool)
	// Past the end of the transaction's partition, which a purge drops.
	time.Sleep(time.Until(start.Truncate(time.Second).Add(1200 * time.Millisecond)))
	if _, err := s.Purge(ctx(t), 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if f1 := floor(); !f1.After(f0) {
		t.Fatalf("floor %s after new partitions, want past %s", f1, f0)
	}
	_, err := s.Claim(ctx(t), tx, claimOf("c", "from-a-dropped-partition", "p"))
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23514" || errors.Is(err, processed.ErrNotMigrated) {
		t.Fatalf("claim in a transaction that began in a dropped partition: %v; want a check violation", err)
	}
	_ = tx.Rollback(ctx(t))
	// A new transaction claims it, once.
	if r := claimTx(t, pool, s, claimOf("c", "from-a-dropped-partition", "p")); r.Outcome != consumer.ClaimNew {
		t.Fatalf("the retry: %v", r.Outcome)
	}
	if r := claimTx(t, pool, s, claimOf("c", "from-a-dropped-partition", "p")); r.Outcome != consumer.ClaimDuplicate {
		t.Fatalf("the redelivery: %v", r.Outcome)
	}
}

// TestFilterCacheBudget: filters that do not all fit Config.FilterCacheBytes
// are not cached (the claims read the filter table), a cache turned off
// reads nothing, and Maintain, the janitor's upkeep, fills the cache when
// they fit.
func TestFilterCacheBudget(t *testing.T) {
	t.Parallel()
	s, pool, names := sealFixture(t, 20)
	if _, err := s.SealPartitions(ctx(t)); err != nil {
		t.Fatal(err)
	}
	// Each of the three filters has 20 rows of 16 bytes at most.
	for _, budget := range []int64{-1, 100} {
		small, err := processed.New(pool, processed.Config{Schema: s.Schema(), Partitioned: true, PartitionInterval: time.Hour, FilterCacheBytes: budget})
		if err != nil {
			t.Fatal(err)
		}
		if n, err := small.CacheFilters(ctx(t)); err != nil || n != 0 || small.CachedFilters() != nil {
			t.Fatalf("budget %d: CacheFilters = %d, %v; cached %v; want none", budget, n, err, small.CachedFilters())
		}
		if !readsFilterTable(t, small) {
			t.Fatalf("budget %d: the fast claim does not read the filter table", budget)
		}
	}
	if err := s.Maintain(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if got := s.CachedFilters(); len(got) != len(names) {
		t.Fatalf("after Maintain, cached filters of %v; want %v", got, names)
	}
	if readsFilterTable(t, s) {
		t.Fatal("after Maintain, the fast claim reads the filter table")
	}
	// A second call reads nothing again.
	if n, err := s.CacheFilters(ctx(t)); err != nil || n != 0 {
		t.Fatalf("second CacheFilters = %d, %v; want 0", n, err)
	}
}

// TestCachedFiltersUnderRotation: claims of a fixed set of ids, from many
// goroutines, per message and in batches, while 1s partitions pass, are
// sealed and have their filters cached (Maintain, looping as a janitor
// would, much faster): so ids are claimed again once their rows are in
// partitions sealed and cached, sealed and not yet cached, or not yet
// sealed. Each id must have one row and one effect.
func TestCachedFiltersUnderRotation(t *testing.T) {
	t.Parallel()
	s, pool := partitionedSetup(t, time.Second)
	c, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	effects := pgx.Identifier{s.Schema(), "effects"}.Sanitize()
	if _, err := pool.Exec(c, `CREATE TABLE `+effects+` (id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	const (
		goroutines = 8
		minIDs     = 40
		ids        = 640
		runFor     = 6 * time.Second
	)
	start := time.Now()
	stop := start.Add(runFor)
	var (
		wg                      sync.WaitGroup
		maintained, claimed     atomic.Int64
		retried, sawCachedClaim atomic.Int64
	)
	errs := make(chan error, goroutines+1)
	wg.Add(1)
	go func() { // the janitor
		defer wg.Done()
		for time.Now().Before(stop) {
			if err := s.Maintain(c); err != nil {
				errs <- fmt.Errorf("maintain: %w", err)
				return
			}
			maintained.Add(1)
			if len(s.CachedFilters()) > 0 {
				sawCachedClaim.Store(1)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rnd := rand.New(rand.NewSource(int64(g)))
			for time.Now().Before(stop) {
				n := 1
				if rnd.Intn(2) == 0 {
					n = 2 + rnd.Intn(15)
				}
				// The ids grow over the run: new ones keep coming, and
				// older ones, whose rows are by then in past partitions,
				// come again.
				hi := minIDs + int(time.Since(start)/(runFor/(ids-minIDs)))
				picked := map[int]bool{}
				var claims []consumer.Claim
				for len(claims) < n {
					if i := rnd.Intn(min(hi, ids)); !picked[i] {
						picked[i] = true
						claims = append(claims, claimOf("c", fmt.Sprintf("id-%03d", i), "p"))
					}
				}
				sort.Slice(claims, func(i, j int) bool { return claims[i].MessageID < claims[j].MessageID })
				if err := claimApply(c, s, claims, effects); err != nil {
					var pgErr *pgconn.PgError
					if errors.As(err, &pgErr) && pgErr.Code == "23514" {
						retried.Add(1) // a late claim into a partition sealed meanwhile
						continue
					}
					errs <- err
					return
				}
				claimed.Add(int64(n))
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var rowsMany, effectsMany, rowIDs, partitions int
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	if err := pool.QueryRow(c, `SELECT count(*) FILTER (WHERE n > 1), count(*) FROM (SELECT message_id, count(*) AS n FROM `+table+` GROUP BY 1) d`).Scan(&rowsMany, &rowIDs); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(c, `SELECT count(*) FROM (SELECT id FROM `+effects+` GROUP BY 1 HAVING count(*) > 1) d`).Scan(&effectsMany); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(c, `SELECT count(DISTINCT tableoid) FROM `+table).Scan(&partitions); err != nil {
		t.Fatal(err)
	}
	sealed, err := s.Sealed(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d claims, %d upkeep rounds, %d retried after a seal; %d ids in %d partitions, %d sealed, %d cached",
		claimed.Load(), maintained.Load(), retried.Load(), rowIDs, partitions, len(sealed), len(s.CachedFilters()))
	if rowsMany != 0 || effectsMany != 0 {
		t.Fatalf("%d ids with more than one row, %d with more than one effect", rowsMany, effectsMany)
	}
	if len(sealed) < 3 || sawCachedClaim.Load() == 0 || partitions < 5 {
		t.Fatalf("the run did not rotate: %d partitions sealed, cache used %v, rows in %d partitions", len(sealed), sawCachedClaim.Load() != 0, partitions)
	}
}

// claimApply claims claims in one transaction, applies an effect for each
// new one, and commits.
func claimApply(c context.Context, s *processed.Store, claims []consumer.Claim, effects string) error {
	tx, res, err := s.BeginClaim(c, claims)
	if tx != nil {
		defer func() { _ = tx.Rollback(c) }()
	}
	if err != nil {
		return err
	}
	for i, r := range res {
		if r.Outcome == consumer.ClaimNew {
			if _, err := tx.Exec(c, `INSERT INTO `+effects+` VALUES ($1)`, claims[i].MessageID); err != nil {
				return err
			}
		}
	}
	return tx.Commit(c)
}

// TestDuplicateInCurrentPartitionSkipsSealed: a duplicate of an id claimed
// in the current partition is read where the fast claim looked, so neither
// a single claim nor a batch touches the sealed partitions: here one is
// held locked by another transaction, which would block the full lookup
// (it goes through the parent, so every partition).
func TestDuplicateInCurrentPartitionSkipsSealed(t *testing.T) {
	t.Parallel()
	cacheModes(t, func(t *testing.T, cache func(*processed.Store)) {
		s, pool, names := sealFixture(t, 20)
		if _, err := s.SealPartitions(ctx(t)); err != nil {
			t.Fatal(err)
		}
		if cache != nil {
			cache(s)
		}
		if r := claimTx(t, pool, s, claimOf("c", "x", "p")); r.Outcome != consumer.ClaimNew {
			t.Fatalf("first claim: %v", r.Outcome)
		}
		locker, err := pool.Begin(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = locker.Rollback(context.Background()) }()
		if _, err := locker.Exec(ctx(t), `LOCK TABLE `+pgx.Identifier{s.Schema(), names[1]}.Sanitize()+` IN ACCESS EXCLUSIVE MODE`); err != nil {
			t.Fatal(err)
		}
		c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, claims := range [][]consumer.Claim{
			{claimOf("c", "x", "p")},
			{claimOf("c", "x", "other")},
			{claimOf("c", "x", "p"), claimOf("c", "y", "p")},
		} {
			tx, res, err := s.BeginClaim(c, claims)
			if err != nil {
				t.Fatalf("claim %v with a sealed partition locked: %v", claims[0].MessageID, err)
			}
			want := consumer.ClaimDuplicate
			if claims[0].Fingerprint != claimOf("c", "x", "p").Fingerprint {
				want = consumer.ClaimMismatch
			}
			if res[0].Outcome != want || (len(res) > 1 && res[1].Outcome != consumer.ClaimNew) {
				t.Fatalf("claims %v: %+v", claims, res)
			}
			_ = tx.Rollback(c)
		}
	})
}
