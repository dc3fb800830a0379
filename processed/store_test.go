package processed_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
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

func claimOf(consumerName, id, body string) dedup.Claim {
	return dedup.Claim{
		Consumer:    consumerName,
		MessageID:   id,
		Fingerprint: sha256.Sum256([]byte(body)),
		Source:      "orders",
		Partition:   -1,
		Offset:      -1,
	}
}

// claim claims cs with BeginClaim, the runtime's path, and commits.
func claim(t *testing.T, s dedup.Store, cs ...dedup.Claim) []dedup.ClaimResult {
	t.Helper()
	tx, res, err := s.BeginClaim(ctx(t), cs)
	if tx != nil {
		defer func() { _ = tx.Rollback(context.Background()) }()
	}
	if err != nil {
		t.Fatalf("BeginClaim(%s/%s, %d claims): %v", cs[0].Consumer, cs[0].MessageID, len(cs), err)
	}
	if err := tx.Commit(ctx(t)); err != nil {
		t.Fatalf("commit: %v", err)
	}
	return res
}

// table is the quoted table (or view) of s.
func table(s interface {
	Schema() string
	Table() string
}) string {
	return pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
}

func TestPurgeDeletesInBatches(t *testing.T) {
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
			for i := range tc.old + tc.fresh {
				claim(t, s, claimOf("c", fmt.Sprintf("m-%d", i), "x"))
			}
			claim(t, s, claimOf("other", "old", "x"))
			if _, err := pool.Exec(ctx(t), `UPDATE `+table(s)+` SET processed_at = now() - interval '2 hours'
				WHERE consumer = 'other' OR message_id IN (SELECT message_id FROM `+table(s)+` WHERE consumer = 'c' ORDER BY message_id LIMIT $1)`, tc.old); err != nil {
				t.Fatal(err)
			}
			n, err := s.Purge(ctx(t), "c", time.Hour)
			if err != nil || n != int64(tc.old) {
				t.Fatalf("Purge: %d, %v; want %d", n, err, tc.old)
			}
			if st, err := s.Stats(ctx(t), "c"); err != nil || st.Rows != int64(tc.fresh) {
				t.Fatalf("rows left: %+v, %v; want %d", st, err, tc.fresh)
			}
			if st, err := s.Stats(ctx(t), "other"); err != nil || st.Rows != 1 {
				t.Fatalf("the other consumer's rows: %+v, %v; want its old row kept", st, err)
			}
			if n, err := s.Purge(ctx(t), "c", time.Hour); err != nil || n != 0 {
				t.Fatalf("second Purge: %d, %v; want 0", n, err)
			}
			if n, err := s.PurgeAll(ctx(t), time.Hour); err != nil || n != 1 {
				t.Fatalf("PurgeAll: %d, %v; want the other consumer's row", n, err)
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
	age := func() {
		if _, err := pool.Exec(ctx(t), `UPDATE `+table(s)+` SET processed_at = now() - interval '2 hours'`); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 7 {
		claim(t, s, claimOf("c", fmt.Sprintf("m-%d", i), "x"))
	}
	age()
	start := time.Now()
	if n, err := s.Purge(ctx(t), "c", time.Hour); err != nil || n != 7 {
		t.Fatalf("Purge: %d, %v; want 7", n, err)
	}
	if el := time.Since(start); el < 2*pause {
		t.Fatalf("7 rows in batches of 3 took %s, want at least two pauses of %s", el, pause)
	}

	for i := range 7 {
		claim(t, s, claimOf("c", fmt.Sprintf("m-%d", i), "x"))
	}
	age()
	cctx, cancel := context.WithTimeout(ctx(t), pause/2) // ends in the first pause
	defer cancel()
	n, err := s.Purge(cctx, "c", time.Hour)
	if !errors.Is(err, context.DeadlineExceeded) || n != 3 {
		t.Fatalf("Purge cancelled in a pause: %d, %v; want 3 rows and the context's error", n, err)
	}
}

func TestPurgeRejectsNonsense(t *testing.T) {
	t.Parallel()
	s, _ := setup(t, processed.Config{})
	for _, d := range []time.Duration{0, -time.Hour} {
		if _, err := s.Purge(ctx(t), "c", d); err == nil {
			t.Errorf("Purge(%s) succeeded", d)
		}
	}
	if _, err := s.Purge(ctx(t), "", time.Hour); err == nil {
		t.Error("Purge of no consumer succeeded")
	}
}

// TestLayoutMismatch: a store reads the table's layout once and refuses a
// Config that disagrees: a partitioned Config over a plain table is not
// migrated (Migrate converts it), a plain Config over a partitioned table
// is a configuration error, at Open too.
func TestLayoutMismatch(t *testing.T) {
	t.Parallel()
	plain, pool := setup(t, processed.Config{})
	claim(t, plain, claimOf("c", "before", "x"))
	part, err := processed.New(pool, processed.Config{Schema: plain.Schema(), Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := part.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "m", "x")}); !errors.Is(err, consumer.ErrNotMigrated) ||
		!strings.Contains(err.Error(), "Migrate converts it") {
		t.Fatalf("partitioned store over a plain table: %v, want ErrNotMigrated", err)
	}
	if err := part.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
	// The plain store read its layout before the conversion: it stops
	// (ErrNotMigrated) rather than claim into the view.
	if _, _, err := plain.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "m", "x")}); !errors.Is(err, consumer.ErrNotMigrated) {
		t.Fatalf("plain store after the conversion: %v, want ErrNotMigrated", err)
	}
	if r := claim(t, part, claimOf("c", "before", "x")); r[0].Outcome != dedup.ClaimDuplicate {
		t.Fatalf("the plain table's row after the conversion: %v, want duplicate", r[0].Outcome)
	}
	fresh, err := processed.New(pool, processed.Config{Schema: plain.Schema()})
	if err != nil {
		t.Fatal(err)
	}
	var ce *consumer.ConfigError
	if _, err := fresh.Lookup(ctx(t), "c", "before"); !errors.As(err, &ce) || ce.Field != "Partitioned" {
		t.Fatalf("plain store over a partitioned table: %v, want a ConfigError on Partitioned", err)
	}
	u := testdb.URL()
	if _, err := processed.Open(ctx(t), u, processed.Config{Schema: plain.Schema()}); !errors.As(err, &ce) {
		t.Fatalf("Open with a plain Config over a partitioned table: %v, want a ConfigError", err)
	}
	s, err := processed.Open(ctx(t), u, processed.Config{Schema: testdb.Schema(t), Partitioned: true})
	if err != nil {
		t.Fatalf("Open before Migrate: %v", err)
	}
	s.Close()
}

func TestLookup(t *testing.T) {
	t.Parallel()
	for _, layout := range layouts {
		t.Run(layout.name, func(t *testing.T) {
			t.Parallel()
			s, _ := setup(t, layout.cfg)
			a := claimOf("billing", "m-a", "body")
			a.Source, a.Partition, a.Offset = "payments", 0, 0
			b := claimOf("billing", "m-b", "body")
			claim(t, s, a, b)

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
			if st, err := s.Stats(ctx(t), "billing"); err != nil || st.Rows != 2 || st.Oldest.IsZero() {
				t.Errorf("Stats(billing): %+v, %v", st, err)
			}
			if st, err := s.Stats(ctx(t), "nobody"); err != nil || st.Rows != 0 || !st.Oldest.IsZero() {
				t.Errorf("Stats(nobody): %+v, %v", st, err)
			}
		})
	}
}

// TestClaimPlansProbePrimaryKeys: the claim's statements probe each
// generation's (or the plain table's) primary key once per id, in custom
// and in generic plans, even when the statistics do not know the consumer.
// The plain "consumer = $1 AND message_id = ANY($2)" is planned here as a
// scan of every row of the consumer with message_id as a filter. With the
// shard key in the primary key, the reads of existing rows match the key
// too.
func TestClaimPlansProbePrimaryKeys(t *testing.T) {
	t.Parallel()
	for _, layout := range append(layouts, keyedLayout) {
		t.Run(layout.name, func(t *testing.T) {
			t.Parallel()
			s, pool := setup(t, layout.cfg)
			fill := func(into, consumerName string, n int) {
				t.Helper()
				if _, err := pool.Exec(ctx(t), `INSERT INTO `+into+` (consumer, message_id, fingerprint)
			SELECT $1, 'id-' || g, sha256(int8send(g)) FROM generate_series(1, $2::int) AS g`, consumerName, n); err != nil {
					t.Fatal(err)
				}
			}
			tables := []string{table(s)}
			if layout.cfg.Partitioned {
				tables = []string{gen(s, 0), gen(s, 1), gen(s, 2)}
			}
			for _, tbl := range tables {
				fill(tbl, "other", 20000)
				if _, err := pool.Exec(ctx(t), "ANALYZE "+tbl); err != nil {
					t.Fatal(err)
				}
			}
			fill(tables[len(tables)-1], "c", 5000) // after ANALYZE: unknown to the statistics
			sqls, err := s.ClaimSQL(ctx(t))
			if err != nil {
				t.Fatal(err)
			}
			conn, err := pool.Acquire(ctx(t))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Release()
			tx, err := conn.Begin(ctx(t))
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			statements := map[string]struct{ types, args string }{
				"existing":    {"(text, text[])", "('c', ARRAY['id-1', 'id-2', 'id-3'])"},
				"insert":      {"(text, text[], bytea[], text[], int[], bigint[], text, text[])", "('c', ARRAY['id-1', 'id-2', 'new'], ARRAY[sha256(''), sha256(''), sha256('')], ARRAY['', '', ''], ARRAY[-1, -1, -1], ARRAY[-1, -1, -1]::bigint[], 'token', ARRAY['', '', ''])"},
				"existingOne": {"(text, text)", "('c', 'id-1')"},
				"insertOne":   {"(text, text, bytea, text, int, bigint, text, text)", "('c', 'id-1', sha256(''), '', NULL, NULL, 'token', '')"},
			}
			if layout.cfg.ShardKeyInPrimaryKey {
				statements["existing"] = struct{ types, args string }{"(text, text[], text[])", "('c', ARRAY['id-1', 'id-2', 'id-3'], ARRAY['', '', ''])"}
				statements["existingOne"] = struct{ types, args string }{"(text, text, text)", "('c', 'id-1', '')"}
			}
			for name, c := range statements {
				if _, err := tx.Exec(ctx(t), "PREPARE idemq_plan_test"+c.types+" AS "+sqls[name]); err != nil {
					t.Fatal(err)
				}
				args := c.args
				for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
					if _, err := tx.Exec(ctx(t), "SET LOCAL plan_cache_mode = "+mode); err != nil {
						t.Fatal(err)
					}
					rows, err := tx.Query(ctx(t), "EXPLAIN EXECUTE idemq_plan_test"+args, pgx.QueryExecModeSimpleProtocol)
					if err != nil {
						t.Fatal(err)
					}
					lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
					if err != nil {
						t.Fatal(err)
					}
					plan := strings.Join(lines, "\n")
					probes := strings.Count(plan, "message_id = u.id") + strings.Count(plan, "message_id = $2") + strings.Count(plan, "message_id = 'id-1'")
					if strings.Contains(plan, "Seq Scan") || strings.Contains(plan, "Filter: (message_id") ||
						(strings.HasPrefix(name, "existing") && probes != len(tables)) {
						t.Errorf("%s, %s: does not probe each primary key per id:\n%s", name, mode, plan)
					}
					if layout.cfg.ShardKeyInPrimaryKey && strings.HasPrefix(name, "existing") && !regexp.MustCompile(`(Index Cond|Filter): .*shard_key = `).MatchString(plan) {
						t.Errorf("%s, %s: does not read the row of the claim's shard key:\n%s", name, mode, plan)
					}
				}
				if _, err := tx.Exec(ctx(t), "DEALLOCATE idemq_plan_test"); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// guardOf0004 is the commit guard as migration 0004 made it: it passes a
// COMMIT only after the commit check of earlier versions.
const guardOf0004 = `BEGIN
    IF current_setting('idemq.commit', true) IS DISTINCT FROM current_setting('idemq.tx', true) THEN
        RAISE EXCEPTION 'idemq: a handler ran COMMIT' USING ERRCODE = '25000';
    END IF;
    RETURN NULL;
END`

// TestEarlierMigrationsRefused: a table migrated by an earlier version,
// without the objects this version uses (the commit guard of migration
// 0004, the shard map's completeness of 0008, the guard reading the
// commit of 0009), is not migrated for this version: the claim says so,
// and the runtime stops, rather than claiming and failing every commit, or
// retrying a sharded claim forever.
func TestEarlierMigrationsRefused(t *testing.T) {
	t.Parallel()
	lacks := map[string]func(schema, table string) string{
		"0004": func(schema, table string) string {
			return `DROP FUNCTION ` + pgx.Identifier{schema, table + "_commit_guard"}.Sanitize() + `() CASCADE`
		},
		"0009": func(schema, table string) string {
			return `CREATE OR REPLACE FUNCTION ` + pgx.Identifier{schema, table + "_commit_guard"}.Sanitize() +
				`() RETURNS trigger LANGUAGE plpgsql AS $$` + guardOf0004 + `$$`
		},
		"0008": func(schema, table string) string {
			return `ALTER TABLE ` + pgx.Identifier{schema, table + "_shard_map"}.Sanitize() + ` DROP COLUMN complete`
		},
	}
	for _, layout := range layouts {
		for before, undo := range lacks {
			t.Run(layout.name+"/"+before, func(t *testing.T) {
				t.Parallel()
				earlierMigrationRefused(t, layout.cfg, undo)
			})
		}
	}
}

// earlierMigrationRefused migrates a table with cfg, runs undo's SQL on
// it, and checks that a new store's claim is ErrNotMigrated.
func earlierMigrationRefused(t *testing.T, cfg processed.Config, undo func(schema, table string) string) {
	t.Helper()
	s, pool := setup(t, cfg)
	if _, err := pool.Exec(ctx(t), undo(s.Schema(), s.Table())); err != nil {
		t.Fatal(err)
	}
	cfg.Schema = s.Schema()
	fresh, err := processed.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	tx, _, err := fresh.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "m", "x")})
	if tx != nil {
		_ = tx.Rollback(ctx(t))
	}
	if !errors.Is(err, consumer.ErrNotMigrated) || !strings.Contains(err.Error(), "latest migrations") {
		t.Fatalf("claim on a table of earlier migrations: %v, want ErrNotMigrated", err)
	}
}

// TestRotationPostponedByALongTransaction: a claim transaction held open
// past the upkeep's lock timeout postpones a due rotation, with an error
// the janitor logs, and claims wait at most that long; once it ends, the
// rotation goes through.
func TestRotationPostponedByALongTransaction(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{Partitioned: true})
	claim(t, s, claimOf("c", "a", "x"))
	long, _, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "held", "x")})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = long.Rollback(context.Background()) }()
	start := time.Now()
	_, err = s.Purge(ctx(t), "other", time.Millisecond)
	if !errors.Is(err, processed.ErrPostponed) || time.Since(start) > 2*time.Second {
		t.Fatalf("upkeep beside a long transaction: %v after %s; want ErrPostponed within the lock timeout", err, time.Since(start))
	}
	gens, err := s.Generations(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := long.Commit(ctx(t)); err != nil {
		t.Fatal(err)
	}
	again, err := processed.New(pool, processed.Config{Schema: s.Schema(), Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := again.Maintain(ctx(t)); err != nil {
		t.Fatal(err)
	}
	after, err := again.Generations(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if after[0].BeganAt.Equal(gens[0].BeganAt) {
		t.Fatalf("no rotation once the transaction ended: %+v", after)
	}
}

// TestCommitOfAnEarlierVersionPasses: during an upgrade, processes of the
// version before migration 0009 still commit their claims by running the
// commit check (migration 0004) before COMMIT; the guard of 0009 lets that
// COMMIT through, and still refuses a plain one.
func TestCommitOfAnEarlierVersionPasses(t *testing.T) {
	t.Parallel()
	s, _ := setup(t, processed.Config{})
	check := pgx.Identifier{s.Schema(), s.Table() + "_commit_check"}.Sanitize()
	for _, c := range []struct {
		id, commit string
		ok         bool
	}{
		{"earlier", "SELECT " + check + "(current_setting('idemq.tx')); COMMIT", true},
		{"plain", "COMMIT", false},
	} {
		tx, _, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", c.id, "x")})
		if err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx(t), c.commit)
		_ = tx.Rollback(ctx(t))
		if (err == nil) != c.ok {
			t.Fatalf("%s commit: %v, want it to succeed: %v", c.id, err, c.ok)
		}
		_, err = s.Lookup(ctx(t), "c", c.id)
		if (err == nil) != c.ok {
			t.Fatalf("%s commit: lookup %v, want the claim committed: %v", c.id, err, c.ok)
		}
	}
}

// TestCommitKeepsAnotherInvalidCursorError: a COMMIT refused with SQLSTATE
// 34000 by something other than the claim's cursor (here a handler's own
// deferred trigger) keeps its code: only a missing claim cursor is the
// transaction begun anew that Commit reports as 25000.
func TestCommitKeepsAnotherInvalidCursorError(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	tbl := pgx.Identifier{s.Schema(), "audit"}.Sanitize()
	fn := pgx.Identifier{s.Schema(), "audit_refuse"}.Sanitize()
	for _, q := range []string{
		"CREATE TABLE " + tbl + " (id text)",
		"CREATE FUNCTION " + fn + "() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN " +
			"RAISE EXCEPTION 'the audit cursor is closed' USING ERRCODE = '34000'; END $$",
		"CREATE CONSTRAINT TRIGGER audit_refuse AFTER INSERT ON " + tbl +
			" DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION " + fn + "()",
	} {
		if _, err := pool.Exec(ctx(t), q); err != nil {
			t.Fatal(err)
		}
	}
	tx, _, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "m", "x")})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx(t), "INSERT INTO "+tbl+" VALUES ('m')"); err != nil {
		t.Fatal(err)
	}
	err = tx.Commit(ctx(t))
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "34000" || !strings.Contains(pgErr.Message, "audit cursor") {
		t.Fatalf("commit: %v, want the trigger's own SQLSTATE 34000", err)
	}
}

// TestClaimOfAnIDTheTableChanged: a table that does not keep ids byte for
// byte (here a trigger that upper-cases them) returns ids the claim was not
// given. The claim fails, naming the id, instead of taking it for the
// batch's first claim and leaving the others unanswered.
func TestClaimOfAnIDTheTableChanged(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	fn := pgx.Identifier{s.Schema(), "upper_id"}.Sanitize()
	for _, q := range []string{
		"CREATE FUNCTION " + fn + "() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN " +
			"NEW.message_id := upper(NEW.message_id); RETURN NEW; END $$",
		"CREATE TRIGGER upper_id BEFORE INSERT ON " + table(s) + " FOR EACH ROW EXECUTE FUNCTION " + fn + "()",
	} {
		if _, err := pool.Exec(ctx(t), q); err != nil {
			t.Fatal(err)
		}
	}
	// A batch reads the ids it inserted back (a claim of one message
	// counts the rows, so it cannot see the change).
	tx, res, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "b-1", "x"), claimOf("c", "b-2", "x")})
	if tx != nil {
		_ = tx.Rollback(ctx(t))
	}
	if err == nil || !strings.Contains(err.Error(), `"B-1", which was not claimed`) {
		t.Errorf("claim: %v, %v; want an error naming the id the table returned", res, err)
	}
}
