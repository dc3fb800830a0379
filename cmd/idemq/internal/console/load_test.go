package console

import (
	"context"
	"net/http/httptest"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// TestChartsPageLoad measures the overview's charts on a big dedup table:
// IDEMQ_CONSOLE_LOAD_ROWS rows (for instance 5000000) over a week, 60% of
// them in the last day of one consumer, the rest in two others; it logs
// the time of the first page load (every bucket counted), of a second one
// (closed buckets from the cache) and of the charts alone in each, and the
// plans of the first load's count queries. With
// IDEMQ_CONSOLE_LOAD_LAYOUT=partitioned the table has the partitioned
// layout, its rows in the generations by age (g0 the last two days, g1
// and g2 the rest), each in the order they would have been claimed. It
// fills a schema of its own, dropped at the end. docs/observability.md
// reports its figures.
func TestChartsPageLoad(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("IDEMQ_CONSOLE_LOAD_ROWS"))
	if n <= 0 {
		t.Skip("set IDEMQ_CONSOLE_LOAD_ROWS (e.g. 5000000) to measure the charts on a big dedup table")
	}
	ctx := context.Background()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	partitioned := os.Getenv("IDEMQ_CONSOLE_LOAD_LAYOUT") == "partitioned"
	store, err := processed.New(pool, processed.Config{Schema: schema, Partitioned: partitioned})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	tbl := pgx.Identifier{schema, "processed_messages"}.Sanitize()
	busy := n * 6 / 10
	start := time.Now()
	rows := `SELECT 'ledger' AS consumer, 'l-' || i AS message_id, decode(repeat('00', 32), 'hex') AS fingerprint, now() - (i::float8 / $1) * interval '24 hours' AS processed_at FROM generate_series(1, $1) AS i
UNION ALL SELECT 'consumer-' || (i % 2), 'o-' || i, decode(repeat('00', 32), 'hex'), now() - (i::float8 / $2) * interval '7 days' FROM generate_series(1, $2) AS i`
	// Each table's rows, by age: [from, to) days.
	type part struct {
		table    string
		from, to int
	}
	parts := []part{{tbl, 0, 8}}
	if partitioned {
		parts = nil
		for g, days := range [][2]int{{0, 2}, {2, 5}, {5, 8}} {
			parts = append(parts, part{pgx.Identifier{schema, "processed_messages_g" + strconv.Itoa(g)}.Sanitize(), days[0], days[1]})
		}
	}
	for _, p := range parts {
		for _, q := range []struct {
			sql  string
			args []any
		}{
			{`INSERT INTO ` + p.table + ` (consumer, message_id, fingerprint, processed_at)
SELECT * FROM (` + rows + `) AS r WHERE processed_at <= now() - $3 * interval '1 day' AND processed_at > now() - $4 * interval '1 day' ORDER BY processed_at`,
				[]any{busy, n - busy, p.from, p.to}},
			{`VACUUM (ANALYZE) ` + p.table, nil},
		} {
			if _, err := pool.Exec(ctx, q.sql, q.args...); err != nil {
				t.Fatal(err)
			}
		}
	}
	var size string
	if err := pool.QueryRow(ctx, `SELECT pg_size_pretty(sum(pg_total_relation_size(t::regclass))) FROM unnest($1::text[]) AS t`, func() (ts []string) {
		for _, p := range parts {
			ts = append(ts, p.table)
		}
		return ts
	}()).Scan(&size); err != nil {
		t.Fatal(err)
	}
	t.Logf("filled %d rows (%d of ledger in the last day; partitioned: %t) in %s: %s with their indexes", n, busy, partitioned, time.Since(start).Round(time.Second), size)

	srv, err := New(Config{Store: store, DB: pool, Consumers: []string{"ledger"}})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	var queries []countRange
	srv.countHook = func(r countRange) { queries = append(queries, r) }
	ts := httptest.NewServer(srv)
	defer ts.Close()
	names := []string{"consumer-0", "consumer-1", "ledger"}
	charts := func() time.Duration {
		t0 := time.Now()
		now, closed, err := srv.clock(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range srv.activity(ctx, names, now, closed) {
			if p.Hour.Err != "" || p.Day.Err != "" {
				t.Fatalf("%s %s", p.Hour.Err, p.Day.Err)
			}
		}
		return time.Since(t0)
	}
	page := func(path string) time.Duration {
		t0 := time.Now()
		resp, err := ts.Client().Get(ts.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("GET %s: %d", path, resp.StatusCode)
		}
		return time.Since(t0)
	}
	first := charts()
	t.Logf("charts, first load (every bucket counted): %s; count queries %+v", first.Round(time.Millisecond), queries)
	queries = nil
	second := charts()
	t.Logf("charts, second load (closed buckets cached): %s; count queries %+v", second.Round(time.Millisecond), queries)
	// A fresh console, through HTTP: the page as a whole, with the
	// overview's row counts (Store.Stats, a count of every row of each
	// consumer, without Config.Status).
	srv.counts = &countCache{m: map[countKey]int64{}}
	t.Logf("GET / first: %s, second: %s", page("/").Round(time.Millisecond), page("/").Round(time.Millisecond))
	t.Logf("GET /consumer?name=ledger (cache warm): %s", page("/consumer?name=ledger").Round(time.Millisecond))
	srv.counts = &countCache{m: map[countKey]int64{}}
	t.Logf("GET /consumer?name=ledger (cache cold): %s", page("/consumer?name=ledger").Round(time.Millisecond))

	now, _, _ := srv.clock(ctx)
	hw, dw := windowsAt(now)
	for _, q := range []struct {
		name string
		args []any
	}{
		{"minutes", []any{names, hw.start, hw.end(), int64(60)}},
		{"hours", []any{names, dw.start, hw.start.Truncate(time.Hour), int64(3600)}},
	} {
		t.Logf("EXPLAIN ANALYZE, %s:\n%s", q.name, explain(t, pool, "EXPLAIN (ANALYZE, BUFFERS) "+appliedSQL(tbl), q.args...))
	}
}
