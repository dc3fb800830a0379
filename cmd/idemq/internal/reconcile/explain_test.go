package reconcile

import (
	"context"
	"fmt"
	"math"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestQueriesUseIndexes EXPLAINs every query shape Run sends, with
// realistic parameters, on an outbox and a dedup table of 30 days of rows
// (100,000 each, analyzed), and fails if any plan reads the outbox or the
// dedup table with a sequential scan.
func TestQueriesUseIndexes(t *testing.T) {
	if testing.Short() {
		t.Skip("fills tables of 100,000 rows")
	}
	t.Parallel()
	ctx := context.Background()
	s := newService(t)
	const n = 100000
	// Three destinations and three consumers; one row in 500 unsent.
	s.exec(`INSERT INTO `+s.table("outbox")+` (destination, message_id, body, created_at, next_attempt_at, sent_at)
SELECT 'dest-' || (i % 3), 'm-' || i, '\x00', now() - (i || ' seconds')::interval * 26, now() - (i || ' seconds')::interval * 26,
       CASE WHEN i % 500 = 0 THEN NULL ELSE now() - (i || ' seconds')::interval * 26 + interval '1 second' END
FROM generate_series(1, $1) AS i`, n)
	s.exec(`INSERT INTO `+s.table("processed_messages")+` (consumer, message_id, fingerprint, processed_at)
SELECT 'consumer-' || (i % 3), 'm-' || i, decode(repeat('00', 32), 'hex'), now() - (i || ' seconds')::interval * 26
FROM generate_series(1, $1) AS i`, n)
	s.exec(`ANALYZE ` + s.table("outbox"))
	s.exec(`ANALYZE ` + s.table("processed_messages"))

	now := time.Now()
	since, end := now.Add(-24*time.Hour), now.Add(-5*time.Minute)
	ids := make([]string, 1000)
	for i := range ids {
		ids[i] = fmt.Sprintf("m-%d", i*37+1)
	}
	ob, dd := Table{Schema: s.schema, Name: "outbox"}.quoted(), Table{Schema: s.schema, Name: "processed_messages"}.quoted()
	for _, q := range []struct {
		name, sql string
		args      []any
		probe     string
	}{
		{"sent page, first", fmt.Sprintf(sentPage, ob), []any{since, end, since, int64(math.MinInt64), []string{"dest-1"}, 1000}, "sent_at >="},
		{"sent page, later", fmt.Sprintf(sentPage, ob), []any{since, end, now.Add(-3 * time.Hour), int64(4321), []string{"dest-1", "dest-2"}, 1000}, "sent_at >="},
		{"oldest sent", fmt.Sprintf(oldestSent, ob), nil, ""},
		{"pending, first", fmt.Sprintf(pendingFirst, ob), []any{1000}, ""},
		{"pending, later", fmt.Sprintf(pendingPage, ob), []any{1000, now.Add(-10 * 24 * time.Hour), int64(5000)}, "ROW(next_attempt_at, seq) >"},
		{"outbox ids", fmt.Sprintf(outboxIDs, ob), []any{"dest-1", ids}, "message_id = k.id"},
		{"dedup page, first", fmt.Sprintf(dedupPage, dd), []any{"consumer-1", since, end, since, "", 1000}, "processed_at >="},
		{"dedup page, later", fmt.Sprintf(dedupPage, dd), []any{"consumer-1", since, end, now.Add(-3 * time.Hour), "m-77", 1000}, "processed_at >="},
		{"dedup ids", fmt.Sprintf(dedupIDs, dd), []any{"consumer-1", ids}, "message_id = k.id"},
	} {
		// As Run does: a READ ONLY transaction with its plan settings.
		tx, err := s.pool.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if _, err := tx.Exec(ctx, planSettings); err != nil {
			t.Fatal(err)
		}
		rows, err := tx.Query(ctx, "EXPLAIN "+q.sql, q.args...)
		if err != nil {
			t.Fatalf("%s: %v", q.name, err)
		}
		var plan []string
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				t.Fatal(err)
			}
			plan = append(plan, line)
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("%s: %v", q.name, err)
		}
		text := strings.Join(plan, "\n")
		if strings.Contains(text, "Seq Scan") {
			t.Errorf("%s: a sequential scan:\n%s\n%s", q.name, q.sql, text)
		}
		if !strings.Contains(text, "Index") {
			t.Errorf("%s: no index in the plan:\n%s", q.name, text)
		}
		// A page reads the index in order and stops at the page's end:
		// no bitmap scan, no full sort of the rest of the window.
		if strings.Contains(q.name, "page") && (strings.Contains(text, "Bitmap") || regexp.MustCompile(`(?m)^\s*(->\s+)?Sort\s+\(`).MatchString(text)) {
			t.Errorf("%s: not read in index order:\n%s", q.name, text)
		}
		// A lookup by id probes the index with the ids, rather than
		// reading every row of a destination or a consumer.
		if q.probe != "" && !regexp.MustCompile(`Index Cond: \(.*`+regexp.QuoteMeta(q.probe)).MatchString(text) {
			t.Errorf("%s: the index is not probed with %s:\n%s", q.name, q.probe, text)
		}
		_ = tx.Rollback(ctx)
		t.Logf("%s:\n%s", q.name, clip(text, 2000))
	}
}
