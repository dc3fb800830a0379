package console

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

// TestChartQueriesUseIndexes EXPLAINs every query the charts send, with the
// parameters a page load gives them (a custom plan) and as a generic plan
// (pgx prepares statements; Postgres may switch to a generic plan after
// five runs), on a dedup table of 300,000 rows over 30 days (as a
// retention of a month keeps them) in three
// consumers, 15,000 janitor reports and an outbox of 200,000 rows, one in
// 50 unsent, all analyzed, with enable_seqscan left on. No plan may read
// the dedup table, its reports or the outbox with a sequential scan, and
// the applied and backlog scans must be bounded by the window in their
// index condition.
func TestChartQueriesUseIndexes(t *testing.T) {
	if testing.Short() {
		t.Skip("fills tables of 300,000 rows")
	}
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	migratedStore(t, pool, processed.Config{Schema: schema})
	ob, err := outbox.New(pool, outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	dd := pgx.Identifier{schema, "processed_messages"}.Sanitize()
	rt := pgx.Identifier{schema, "processed_messages_retention"}.Sanitize()
	ot := pgx.Identifier{schema, "outbox"}.Sanitize()
	for _, sql := range []string{
		`INSERT INTO ` + dd + ` (consumer, message_id, fingerprint, processed_at)
SELECT 'consumer-' || (i % 3), 'm-' || i, decode(repeat('00', 32), 'hex'), now() - (i * 8.64) * interval '1 second'
FROM generate_series(1, 300000) AS i`,
		`INSERT INTO ` + rt + ` (consumer, window_start, window_end, duplicates, buckets, bucket_bounds_ms, retention_ms)
SELECT 'consumer-' || (i % 3), now() - i * interval '10 minutes' - interval '10 minutes', now() - i * interval '10 minutes', i % 7, '{1,2}', '{1000}', 86400000
FROM generate_series(1, 15000) AS i`,
		`INSERT INTO ` + ot + ` (destination, message_id, body, created_at, next_attempt_at, sent_at)
SELECT 'dest', 'o-' || i, '\x00', now() - i * interval '1 second', now() - i * interval '1 second',
       CASE WHEN i % 50 = 0 THEN NULL ELSE now() - i * interval '1 second' + interval '1 second' END
FROM generate_series(1, 200000) AS i`,
		`ANALYZE ` + dd, `ANALYZE ` + rt, `ANALYZE ` + ot,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now()
	hw, dw := windowsAt(now)
	names := []string{"consumer-1"}
	for _, q := range []struct {
		name, sql, types string
		args             []any
		table, cond      string
	}{
		{"applied, minutes", appliedSQL(dd), "text[], timestamptz, timestamptz, bigint", []any{names, hw.start, hw.end(), int64(60)}, "processed_messages", "processed_at >="},
		{"applied, hours, two consumers", appliedSQL(dd), "text[], timestamptz, timestamptz, bigint", []any{[]string{"consumer-1", "consumer-2"}, dw.start, dw.end(), int64(3600)}, "processed_messages", "processed_at >="},
		{"duplicates", retentionSQL(rt), "text[], timestamptz, timestamptz", []any{names, dw.start, dw.end()}, "processed_messages_retention", "window_end >="},
		{"outbox backlog", backlogSQL(ot), "timestamptz, timestamptz", []any{dw.start, now}, "outbox", "next_attempt_at >="},
		{"consumers", consumersSQL(dd), "", nil, "processed_messages", "consumer >"},
	} {
		checkPlans(t, pool, q.name, q.sql, q.types, q.args, q.cond)
	}
}

// checkPlans EXPLAINs sql with args, as a custom plan and (with types) as
// a generic one, and fails unless both read every table by an index whose
// condition holds cond.
func checkPlans(t *testing.T, pool *pgxpool.Pool, name, sql, types string, args []any, cond string) {
	t.Helper()
	// ANALYZE runs the query: plain EXPLAIN does not show the subplan of
	// the consumers' recursive query.
	plans := map[string]string{"custom": explain(t, pool, "EXPLAIN (ANALYZE, COSTS OFF) "+sql, args...)}
	if types != "" {
		plans["generic"] = explainGeneric(t, pool, sql, types, args)
	}
	for kind, plan := range plans {
		if strings.Contains(plan, "Seq Scan") || !strings.Contains(plan, "Index") {
			t.Errorf("%s, %s plan: not an index scan:\n%s", name, kind, plan)
		}
		if !strings.Contains(plan, "Index Cond: ") || !strings.Contains(plan[strings.Index(plan, "Index Cond: "):], cond) {
			t.Errorf("%s, %s plan: the index is not bounded by %q:\n%s", name, kind, cond, plan)
		}
		t.Logf("%s, %s plan:\n%s", name, kind, plan)
	}
}

// TestChartQueriesUseIndexesPartitioned: on the partitioned layout, with
// 300,000 rows over 30 days in its four generations (the retired one not
// yet emptied), analyzed, the applied chart's count reads each
// generation by its BRIN index on processed_at, bounded by the window.
func TestChartQueriesUseIndexesPartitioned(t *testing.T) {
	if testing.Short() {
		t.Skip("fills tables of 300,000 rows")
	}
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	migratedStore(t, pool, processed.Config{Schema: schema, Partitioned: true})
	// Each generation holds a span of the 30 days, in the order its rows
	// were claimed: g3 the oldest, g0 the newest.
	for g := range 4 {
		tbl := pgx.Identifier{schema, "processed_messages_g" + strconv.Itoa(g)}.Sanitize()
		if _, err := pool.Exec(ctx, `INSERT INTO `+tbl+` (consumer, message_id, fingerprint, processed_at)
SELECT 'consumer-' || (i % 3), 'm-' || i, decode(repeat('00', 32), 'hex'), now() - (300000 - i) * 8.64 * interval '1 second'
FROM generate_series($1::int * 75000 + 1, $1::int * 75000 + 75000) AS i ORDER BY i`, 3-g); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+tbl); err != nil {
			t.Fatal(err)
		}
	}
	dd := pgx.Identifier{schema, "processed_messages"}.Sanitize()
	hw, dw := windowsAt(time.Now())
	checkPlans(t, pool, "applied, minutes", appliedSQL(dd), "text[], timestamptz, timestamptz, bigint",
		[]any{[]string{"consumer-1"}, hw.start, hw.end(), int64(60)}, "processed_at >=")
	checkPlans(t, pool, "applied, hours, two consumers", appliedSQL(dd), "text[], timestamptz, timestamptz, bigint",
		[]any{[]string{"consumer-1", "consumer-2"}, dw.start, dw.end(), int64(3600)}, "processed_at >=")
}

func explain(t *testing.T, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, sql string, args ...any) string {
	t.Helper()
	rows, err := db.Query(context.Background(), sql, args...)
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return strings.Join(lines, "\n")
}

// explainGeneric is the generic plan of sql: PREPAREd, then EXPLAIN
// EXECUTEd with plan_cache_mode forcing it, in a transaction rolled back.
func explainGeneric(t *testing.T, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, sql, types string, args []any) string {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = force_generic_plan"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "PREPARE chart_plan("+types+") AS "+sql); err != nil {
		t.Fatal(err)
	}
	// PREPARE outlives the transaction: the connection goes back to the
	// pool without it.
	defer func() { _, _ = tx.Exec(ctx, "DEALLOCATE chart_plan") }()
	// EXECUTE takes values, not parameters: literals (a generic plan
	// does not look at them anyway).
	lits := make([]string, len(args))
	for i, a := range args {
		switch v := a.(type) {
		case []string:
			lits[i] = "ARRAY['" + strings.Join(v, "', '") + "']"
		case time.Time:
			lits[i] = "'" + v.UTC().Format(time.RFC3339Nano) + "'"
		case int64:
			lits[i] = strconv.FormatInt(v, 10)
		default:
			t.Fatalf("no literal for %T", a)
		}
	}
	return explain(t, tx, "EXPLAIN EXECUTE chart_plan("+strings.Join(lits, ", ")+")")
}
