package console

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// sharded makes the bundle's dedup store the first of two shards: the
// second, a store in a schema of its own, takes the rows of pay-3 and
// other-9, and gets two rows of ledger applied now.
func sharded(t *testing.T) option {
	return func(c *Config) {
		ctx := context.Background()
		pool := testdb.Pool(t)
		s1 := migratedStore(t, pool, processed.Config{Schema: testdb.Schema(t)})
		from := pgx.Identifier{c.Store.Schema(), c.Store.Table()}.Sanitize()
		to := pgx.Identifier{s1.Schema(), s1.Table()}.Sanitize()
		for _, sql := range []string{
			`WITH moved AS (DELETE FROM ` + from + ` WHERE message_id IN ('pay-3', 'other-9') RETURNING *) INSERT INTO ` + to + ` SELECT * FROM moved`,
			`INSERT INTO ` + to + ` (consumer, message_id, fingerprint, source) VALUES ('ledger', 'now-1', sha256(''), 'payments'), ('ledger', 'now-2', sha256(''), 'payments')`,
		} {
			if _, err := pool.Exec(ctx, sql); err != nil {
				t.Fatal(err)
			}
		}
		c.Shards = []Shard{{Store: c.Store, DB: c.DB}, {Store: s1, DB: pool}}
		c.Store, c.DB = nil, nil
	}
}

// TestConsoleSharded: over a sharded dedup store, the overview and a
// consumer's page show each shard's rows and their total, the applied
// chart sums the shards, and lookups and the dry run find a row on
// whichever shard holds it.
func TestConsoleSharded(t *testing.T) {
	b := newBundle(t, sharded(t))
	c := b.client()

	body := c.mustGet("/")
	row := regexp.MustCompile(`(?s)<tr>\s*<td><a href="/lookup\?consumer=ledger">ledger</a>.*?<td class="num">(\d+)</td>`).FindStringSubmatch(body)
	if row == nil || row[1] != "5" {
		t.Errorf("ledger's total: %v, want 5 rows (1 on shard 0, 4 on shard 1)", row)
	}
	must(t, body, `<tr class="shard" data-shard="0">`, `<tr class="shard" data-shard="1">`)
	shardRows := regexp.MustCompile(`(?s)<tr class="shard" data-shard="(\d)">\s*<td class="dim">shard \d</td>\s*<td class="num">(\d+)</td>`).FindAllStringSubmatch(body, -1)
	var got []string
	for _, m := range shardRows {
		got = append(got, m[1]+":"+m[2])
	}
	if strings.Join(got, " ") != "0:1 1:4" {
		t.Errorf("ledger's shard rows: %v, want [0:1 1:4]", got)
	}
	counts, _ := charts(t, body)
	if n := sum(counts["applied-hour"]); n != 2 {
		t.Errorf("applied in the last hour: %d, want the 2 of shard 1 (%v)", n, counts["applied-hour"])
	}

	page := c.mustGet("/consumer?name=ledger")
	must(t, page, `id="consumer-rows">5<`, `id="consumer-shards"`, `<tr data-shard="1"><td>shard 1</td><td class="num">4</td>`)

	// pay-3 was applied on shard 1, with another payload: a mismatch, not
	// a message to apply again.
	dry := c.mustGet("/dry-run?" + sel(b.fingerprint("pay-1")))
	must(t, dry, `data-count="already-applied">1<`, `data-count="fingerprint-mismatch">1<`, `data-count="will-apply">1<`)
	look := c.mustGet("/lookup?consumer=ledger&id=pay-3")
	must(t, look, "payments")
	mustNot(t, look, "Not applied")
}

// TestConsoleShardsConfig: shards replace Store and DB.
func TestConsoleShardsConfig(t *testing.T) {
	pool := testdb.Pool(t)
	store := migratedStore(t, pool, processed.Config{Schema: testdb.Schema(t)})
	for _, cfg := range []Config{
		{Store: store, DB: pool, Shards: []Shard{{Store: store, DB: pool}}},
		{Shards: []Shard{{Store: store, DB: pool}, {Store: store}}},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v): no error", cfg)
		}
	}
	srv, err := New(Config{Shards: []Shard{{Store: store, DB: pool}}, Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	srv.Close()
}
