package processed_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

func TestClaimBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	store, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	claim := func(id, body string) consumer.Claim {
		return consumer.Claim{Consumer: "c", MessageID: id, Fingerprint: sha256.Sum256([]byte(body)), Source: "q", Partition: -1, Offset: -1}
	}
	// Commit a and b first.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	res, err := store.ClaimBatch(ctx, tx, []consumer.Claim{claim("a", "1"), claim("b", "2")})
	if err != nil || res[0].Outcome != consumer.ClaimNew || res[1].Outcome != consumer.ClaimNew {
		t.Fatalf("first batch: %v %+v", err, res)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var claims []consumer.Claim
	for i := 0; i < 50; i++ {
		claims = append(claims, claim(fmt.Sprintf("n-%d", i), "x"))
	}
	claims = append(claims, claim("b", "2"), claim("a", "changed"))
	res, err = store.ClaimBatch(ctx, tx, claims)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		if res[i].Outcome != consumer.ClaimNew {
			t.Fatalf("claim %d: %v", i, res[i].Outcome)
		}
	}
	if res[50].Outcome != consumer.ClaimDuplicate || res[50].ProcessedAt.IsZero() {
		t.Fatalf("b: %+v", res[50])
	}
	if res[51].Outcome != consumer.ClaimMismatch {
		t.Fatalf("a: %+v", res[51])
	}
	if _, err := store.ClaimBatch(ctx, tx, []consumer.Claim{claim("z", "1"), claim("z", "1")}); err == nil {
		t.Fatal("repeated id accepted")
	}
}

func TestClaimBatchWaitsForConcurrentClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	store, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	c := consumer.Claim{Consumer: "c", MessageID: "x", Fingerprint: sha256.Sum256([]byte("b")), Partition: -1, Offset: -1}
	first, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Claim(ctx, first, c); err != nil {
		t.Fatal(err)
	}
	done := make(chan consumer.ClaimResult, 1)
	go func() {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		defer tx.Rollback(ctx)
		res, err := store.ClaimBatch(ctx, tx, []consumer.Claim{c})
		if err != nil {
			t.Error(err)
		}
		done <- res[0]
	}()
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := <-done; got.Outcome != consumer.ClaimDuplicate {
		t.Fatalf("concurrent batch claim after commit: %v", got.Outcome)
	}
}

// TestClaimBatchLookupProbesPrimaryKey: ClaimBatch's lookup of conflicting
// ids probes (consumer, message_id) once per id, in custom and in generic
// plans, even when the statistics do not know the consumer. The plain
// "consumer = $1 AND message_id = ANY($2)" is planned here as a scan of
// every row of the consumer with message_id as a filter.
func TestClaimBatchLookupProbesPrimaryKey(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	fill := func(consumerName string, n int) {
		t.Helper()
		if _, err := pool.Exec(ctx(t), `INSERT INTO `+table+` (consumer, message_id, fingerprint)
			SELECT $1, 'id-' || g, sha256(int8send(g)) FROM generate_series(1, $2::int) AS g`, consumerName, n); err != nil {
			t.Fatal(err)
		}
	}
	fill("other", 20000)
	if _, err := pool.Exec(ctx(t), "ANALYZE "+table); err != nil {
		t.Fatal(err)
	}
	fill("c", 5000) // after ANALYZE: unknown to the statistics

	_, existing := s.BatchSQL()
	conn, err := pool.Acquire(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx(t), "PREPARE idemq_plan_test(text, text[]) AS "+existing); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = conn.Exec(context.Background(), "DEALLOCATE idemq_plan_test") }()
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		if _, err := conn.Exec(ctx(t), "SET plan_cache_mode = "+mode); err != nil {
			t.Fatal(err)
		}
		rows, err := conn.Query(ctx(t), "EXPLAIN EXECUTE idemq_plan_test('c', ARRAY['id-1', 'id-2', 'id-3'])", pgx.QueryExecModeSimpleProtocol)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		plan := strings.Join(lines, "\n")
		if !strings.Contains(plan, "message_id = u.id") || strings.Contains(plan, "Filter") {
			t.Errorf("%s: the lookup does not probe the primary key per id:\n%s", mode, plan)
		}
	}
	if _, err := conn.Exec(ctx(t), "RESET plan_cache_mode"); err != nil {
		t.Fatal(err)
	}
}
