package bench

// The retention benchmark: claim throughput on the partitioned dedup store
// (three generations) with a large prefill against the plain table with a
// smaller one, and the cost to a running consumer of retiring a generation
// (TRUNCATE) against the DELETE purge of the plain table. Opt-in, since it
// loads millions of rows:
//
//	IDEMQ_RETENTION_BENCH=1 go test -count=1 -timeout 60m -v ./cmd/idemq/internal/bench -run TestRetentionBench
//
// Sizes: IDEMQ_RB_PLAIN_ROWS (default 10000000), IDEMQ_RB_PART_ROWS
// (100000000), IDEMQ_RB_SECONDS (15), IDEMQ_RB_CONCURRENCY (8),
// IDEMQ_RB_DAYS (10), IDEMQ_RB_ROUNDS (3), IDEMQ_RB_GROUP (claims per
// transaction, 1; the runtime's default groups hold up to 32). Set
// IDEMQ_RB_KEEP=1 to keep the schemas (for `idemq bench --schema`; the plain
// one is then not converted at the end),
// IDEMQ_RB_REUSE=<plain>,<partitioned> to measure kept schemas again
// without a prefill, and IDEMQ_RB_NO_PURGE=1 to stop before the purge
// (which deletes rows).
//
// The plain prefill spreads over IDEMQ_RB_DAYS past days. The partitioned
// one puts 45% of its rows in each of the two past generations and 10% in
// the current one, as a table in its steady state has them. The purge then
// retires the oldest generation on the partitioned store (a rotation, then
// the TRUNCATE of the retired table), and deletes the older half of the
// plain table's rows with the DELETE purge, each beside a claiming
// consumer.

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// rbDays is how many past days the prefill spreads over (one partition
// each on the partitioned store).
var rbDays = envInt("IDEMQ_RB_DAYS", 10)

type rbTable struct {
	name  string
	store *processed.Store
	pool  *pgxpool.Pool
	table string // quoted
}

func rbSetup(t *testing.T, ctx context.Context, pool *pgxpool.Pool, name string, partitioned bool, reuse string) *rbTable {
	t.Helper()
	schema := reuse
	if schema == "" {
		schema = "idemq_rb_" + name + "_" + randomHex(4)
		if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	if os.Getenv("IDEMQ_RB_KEEP") == "" {
		t.Cleanup(func() {
			_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		})
	}
	cfg := processed.Config{Schema: schema, Partitioned: partitioned}
	s, err := processed.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return &rbTable{name: name, store: s, pool: pool, table: pgx.Identifier{schema, s.Table()}.Sanitize()}
}

// prefill inserts n rows of consumer "bench", ids prefix-<g>, at noon of
// day daysAgo0 + g%days back, in chunks, into the plain table, or into the
// partitioned layout's generations: ids up to 45% of n in g2, up to 90% in
// g1, the rest in g0.
func (rb *rbTable) prefill(t *testing.T, ctx context.Context, prefix string, n, daysAgo0, days int, partitioned bool) time.Duration {
	t.Helper()
	start := time.Now()
	const chunk = 1_000_000
	gen := func(i int) string {
		return pgx.Identifier{rb.store.Schema(), rb.store.Table() + "_g" + strconv.Itoa(i)}.Sanitize()
	}
	for lo := 1; lo <= n; lo += chunk {
		hi := min(lo+chunk-1, n)
		into := rb.table
		if partitioned {
			switch {
			case lo <= n*45/100:
				into, hi = gen(2), min(hi, n*45/100)
			case lo <= n*90/100:
				into, hi = gen(1), min(hi, n*90/100)
			default:
				into = gen(0)
			}
		}
		_, err := rb.pool.Exec(ctx, `INSERT INTO `+into+` (consumer, message_id, fingerprint, processed_at, source)
SELECT 'bench', $1 || g, sha256(g::text::bytea),
	date_trunc('day', now()) - (($2 + g % $3) || ' days')::interval + interval '12 hours', 'prefill'
FROM generate_series($4::bigint, $5::bigint) g`, prefix, daysAgo0, days, lo, hi)
		if err != nil {
			t.Fatal(err)
		}
		lo = hi + 1 - chunk
	}
	tables := []string{rb.table}
	if partitioned {
		tables = []string{gen(0), gen(1), gen(2)}
		// The generations began 3, 2 and 1 days ago.
		if _, err := rb.pool.Exec(ctx, `UPDATE `+pgx.Identifier{rb.store.Schema(), rb.store.Table() + "_generations"}.Sanitize()+`
SET began_at = now() - ((SELECT max(generation) FROM `+pgx.Identifier{rb.store.Schema(), rb.store.Table() + "_generations"}.Sanitize()+`) - generation + 1) * interval '1 day'`); err != nil {
			t.Fatal(err)
		}
	}
	for _, tbl := range tables {
		if _, err := rb.pool.Exec(ctx, `VACUUM (ANALYZE) `+tbl); err != nil {
			t.Fatal(err)
		}
	}
	return time.Since(start)
}

// rbGroup is how many claims each transaction of claimLoad holds
// (IDEMQ_RB_GROUP, default 1): 1 is strict per-message mode; more is what
// the runtime's default grouping claims under load (up to 32 per lane).
var rbGroup = envInt("IDEMQ_RB_GROUP", 1)

// claimLoad claims new ids (or, with dupPrefix, prefilled ones) from conc
// goroutines, rbGroup claims per transaction, until stop is closed; it
// counts the claims into n.
func claimLoad(ctx context.Context, s *processed.Store, conc int, prefix string, dupPrefix string, dupN int, stop <-chan struct{}, n *atomic.Int64, errs chan<- error) *sync.WaitGroup {
	var wg sync.WaitGroup
	for g := 0; g < conc; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; ; {
				select {
				case <-stop:
					return
				default:
				}
				claims := make([]dedup.Claim, 0, rbGroup)
				seen := map[string]bool{}
				for len(claims) < rbGroup {
					id := fmt.Sprintf("%s-%d-%d", prefix, g, i)
					if dupPrefix != "" {
						id = dupPrefix + strconv.Itoa(1+(g*7919+i*104729)%dupN)
					}
					i++
					if !seen[id] {
						seen[id] = true
						claims = append(claims, dedup.Claim{Consumer: "bench", MessageID: id, Fingerprint: sha256.Sum256([]byte(id)), Partition: -1, Offset: -1})
					}
				}
				sort.Slice(claims, func(a, b int) bool { return claims[a].MessageID < claims[b].MessageID })
				tx, _, err := s.BeginClaim(ctx, claims)
				if err == nil {
					err = tx.Commit(ctx)
				}
				if err != nil {
					if tx != nil {
						_ = tx.Rollback(ctx)
					}
					select {
					case errs <- err:
					default:
					}
					return
				}
				n.Add(int64(len(claims)))
			}
		}(g)
	}
	return &wg
}

// rate runs claimLoad for d and returns claims per second.
func rate(t *testing.T, ctx context.Context, s *processed.Store, conc int, prefix, dupPrefix string, dupN int, d time.Duration) float64 {
	t.Helper()
	var n atomic.Int64
	stop := make(chan struct{})
	errs := make(chan error, 1)
	wg := claimLoad(ctx, s, conc, prefix, dupPrefix, dupN, stop, &n, errs)
	time.Sleep(d)
	close(stop)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	return float64(n.Load()) / d.Seconds()
}

// duringPurge runs the claim load before (baseline), during and after
// purge, and returns the baseline rate, the rate while purge ran, and how
// long it took.
func duringPurge(t *testing.T, ctx context.Context, s *processed.Store, conc int, prefix string, baseline time.Duration, purge func() (int64, error)) (base, during float64, took time.Duration, rows int64) {
	t.Helper()
	var n atomic.Int64
	stop := make(chan struct{})
	errs := make(chan error, 1)
	wg := claimLoad(ctx, s, conc, prefix, "", 0, stop, &n, errs)
	time.Sleep(2 * time.Second) // warm up
	n0 := n.Load()
	time.Sleep(baseline)
	base = float64(n.Load()-n0) / baseline.Seconds()
	n1 := n.Load()
	start := time.Now()
	rows, err := purge()
	took = time.Since(start)
	// Over at least the baseline's length, so that a fast drop is
	// weighed over a window as long as the one it is compared with.
	if took < baseline {
		time.Sleep(baseline - took)
	}
	window := time.Since(start)
	during = float64(n.Load()-n1) / window.Seconds()
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	return base, during, took, rows
}

func TestRetentionBench(t *testing.T) {
	if os.Getenv("IDEMQ_RETENTION_BENCH") == "" {
		t.Skip("set IDEMQ_RETENTION_BENCH=1 to run (loads millions of rows)")
	}
	plainRows := envInt("IDEMQ_RB_PLAIN_ROWS", 10_000_000)
	partRows := envInt("IDEMQ_RB_PART_ROWS", 100_000_000)
	secs := time.Duration(envInt("IDEMQ_RB_SECONDS", 15)) * time.Second
	conc := envInt("IDEMQ_RB_CONCURRENCY", 8)
	ctx := context.Background()
	pcfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = int32(conc + 4)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	// IDEMQ_RB_REUSE=<plain schema>,<partitioned schema> measures the
	// schemas an earlier run kept (IDEMQ_RB_KEEP=1), prefilled with the
	// same sizes, instead of prefilling new ones.
	var reuse [2]string
	if r := os.Getenv("IDEMQ_RB_REUSE"); r != "" {
		if _, err := fmt.Sscanf(strings.ReplaceAll(r, ",", " "), "%s %s", &reuse[0], &reuse[1]); err != nil {
			t.Fatalf("IDEMQ_RB_REUSE=%q: want two schemas, comma-separated", r)
		}
	}
	plain := rbSetup(t, ctx, pool, "plain", false, reuse[0])
	part := rbSetup(t, ctx, pool, "part", true, reuse[1])
	t.Logf("schemas: plain %s, partitioned %s", plain.store.Schema(), part.store.Schema())
	if reuse[0] == "" {
		tp := plain.prefill(t, ctx, "pre-", plainRows, 1, rbDays, false)
		t.Logf("prefill plain: %d rows in %s", plainRows, tp.Round(time.Second))
		tq := part.prefill(t, ctx, "pre-", partRows, 1, rbDays, true)
		t.Logf("prefill partitioned: %d rows in three generations in %s", partRows, tq.Round(time.Second))
	}
	var size [2]string
	for i, rb := range []*rbTable{plain, part} {
		_ = pool.QueryRow(ctx, `SELECT pg_size_pretty(sum(pg_total_relation_size(c.oid))) FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relkind = 'r'`, rb.store.Schema()).Scan(&size[i])
	}
	t.Logf("sizes: plain %s, partitioned %s", size[0], size[1])

	// Interleaved rounds, so that the shared machine's load drifts over
	// both tables alike.
	rounds := envInt("IDEMQ_RB_ROUNDS", 3)
	// New ids are new in every run, also on reused schemas.
	run := time.Now().UnixNano()
	for round := 0; round < rounds; round++ {
		for _, rb := range []*rbTable{plain, part} {
			dn := map[bool]int{true: partRows, false: plainRows}[rb == part]
			r := rate(t, ctx, rb.store, conc, fmt.Sprintf("new%d-%s-%x", round, rb.name, run), "", 0, secs)
			t.Logf("RESULT round %d: claim new ids, %s (%d prefilled rows), concurrency %d, %d per transaction: %.0f claims/s", round, rb.name, dn, conc, rbGroup, r)
			r = rate(t, ctx, rb.store, conc, "", "pre-", dn, secs/3)
			t.Logf("RESULT round %d: claim duplicates of prefilled ids, %s: %.0f claims/s", round, rb.name, r)
		}
	}

	if os.Getenv("IDEMQ_RB_NO_PURGE") != "" {
		return
	}
	// The purge: the oldest generation on the partitioned store (45% of
	// its rows, retired once the consumer's horizon is past its end, a day
	// ago), the older half of the plain table's rows with the DELETE purge.
	dayStart := time.Now().UTC().Truncate(24 * time.Hour)
	for _, rb := range []*rbTable{plain, part} {
		olderThan := time.Since(dayStart.AddDate(0, 0, -(1 + rbDays/2))) // the older half of the days
		if rb == part {
			olderThan = 23 * time.Hour
		}
		base, during, took, rows := duringPurge(t, ctx, rb.store, conc, fmt.Sprintf("p-%s-%x", rb.name, run), secs/2, func() (int64, error) {
			return rb.store.Purge(ctx, "bench", olderThan)
		})
		how := "DELETE purge (default pacing: batches of 1000, duty cycle 0.25)"
		if rb == part {
			how = "generation retirement (rotation, then TRUNCATE)"
		}
		t.Logf("RESULT %s of %d rows: took %s; consumer %.0f claims/s before, %.0f during (%.1f%%)",
			how, rows, took.Round(time.Millisecond), base, during, 100*during/base)
	}

	// Converting the plain table to the partitioned layout, unless the
	// schemas are kept as they are.
	if os.Getenv("IDEMQ_RB_KEEP") != "" {
		return
	}
	st, err := plain.store.Stats(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	conv, err := processed.New(pool, processed.Config{Schema: plain.store.Schema(), Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := conv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("RESULT migrate --partitioned of a plain table of %d rows: %s (renames)", st.Rows, time.Since(start).Round(time.Millisecond))
}
