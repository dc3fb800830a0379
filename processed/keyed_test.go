package processed_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// Config.ShardKeyInPrimaryKey: Migrate converts a plain table, keeping its
// rows, to the key (consumer, shard_key, message_id), which every unique
// index then holds, as a distributed Postgres (Citus) requires of a table
// it distributes by shard_key. A redelivery with its key is a duplicate;
// an id under another key is another message; a claim without a key is a
// configuration error, and each store refuses the other's table.
func TestShardKeyInPrimaryKey(t *testing.T) {
	t.Parallel()
	if _, err := processed.New(testdb.Pool(t), processed.Config{ShardKeyInPrimaryKey: true, Partitioned: true}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Fatalf("with Partitioned: %v, want ErrInvalidConfig", err)
	}
	plain, pool := setup(t, processed.Config{})
	withKey := func(c dedup.Claim, key string) dedup.Claim { c.Route.Key = key; return c }
	claim(t, plain, claimOf("c", "unkeyed", "x"))
	claim(t, plain, withKey(claimOf("c", "keyed", "x"), "acct-1"))

	cfg := processed.Config{Schema: plain.Schema(), ShardKeyInPrimaryKey: true}
	s, err := processed.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.BeginClaim(ctx(t), []dedup.Claim{withKey(claimOf("c", "keyed", "x"), "acct-1")}); !errors.Is(err, consumer.ErrNotMigrated) {
		t.Fatalf("before the migration: %v, want ErrNotMigrated", err)
	}
	if err := s.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	rows, err := pool.Query(ctx(t), `SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = $1::regclass AND i.indisunique
AND NOT EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) AND a.attname = 'shard_key')`, table)
	if err != nil {
		t.Fatal(err)
	}
	if without, err := pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || len(without) > 0 {
		t.Fatalf("unique indexes without shard_key: %v, %v", without, err)
	}
	var keys []string
	rows, err = pool.Query(ctx(t), `SELECT message_id || '=' || shard_key FROM `+table+` ORDER BY message_id`)
	if err == nil {
		keys, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil || fmt.Sprint(keys) != "[keyed=acct-1 unkeyed=]" {
		t.Fatalf("rows after the migration: %v, %v", keys, err)
	}

	for _, tc := range []struct {
		claims []dedup.Claim
		want   []dedup.ClaimOutcome
	}{
		{[]dedup.Claim{withKey(claimOf("c", "keyed", "x"), "acct-1")}, []dedup.ClaimOutcome{dedup.ClaimDuplicate}},
		{[]dedup.Claim{withKey(claimOf("c", "keyed", "y"), "acct-1")}, []dedup.ClaimOutcome{dedup.ClaimMismatch}},
		{[]dedup.Claim{withKey(claimOf("c", "keyed", "x"), "acct-1"), withKey(claimOf("c", "new", "x"), "acct-1")},
			[]dedup.ClaimOutcome{dedup.ClaimDuplicate, dedup.ClaimNew}},
		{[]dedup.Claim{withKey(claimOf("c", "keyed", "w"), "acct-2")}, []dedup.ClaimOutcome{dedup.ClaimNew}},
		// Each key's row answers for its claims, in batches too.
		{[]dedup.Claim{withKey(claimOf("c", "keyed", "w"), "acct-2")}, []dedup.ClaimOutcome{dedup.ClaimDuplicate}},
		{[]dedup.Claim{withKey(claimOf("c", "keyed", "w"), "acct-2"), withKey(claimOf("c", "new", "x"), "acct-1")},
			[]dedup.ClaimOutcome{dedup.ClaimDuplicate, dedup.ClaimDuplicate}},
		{[]dedup.Claim{withKey(claimOf("c", "keyed", "x"), "acct-1")}, []dedup.ClaimOutcome{dedup.ClaimDuplicate}},
	} {
		res := claim(t, s, tc.claims...)
		for i, r := range res {
			if r.Outcome != tc.want[i] {
				t.Errorf("%s under %q: %v, want %v", tc.claims[i].MessageID, tc.claims[i].Route.Key, r.Outcome, tc.want[i])
			}
		}
	}
	tx, _, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "no-key", "x")})
	if tx != nil {
		_ = tx.Rollback(ctx(t))
	}
	if !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Fatalf("a claim without a key: %v, want ErrInvalidConfig", err)
	}
	if r, err := s.Lookup(ctx(t), "c", "new"); err != nil || r.MessageID != "new" {
		t.Fatalf("Lookup: %+v, %v", r, err)
	}
	other, err := processed.New(pool, processed.Config{Schema: plain.Schema()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.Lookup(ctx(t), "c", "new"); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Fatalf("a store without ShardKeyInPrimaryKey: %v, want ErrInvalidConfig", err)
	}
}

// Through a Sharded of one shard whose table keeps the shard key in its
// primary key (a Citus coordinator, as docs/sharding.md sets it up): each
// message is applied once, in grouped, batch and strict mode, and its
// dedup row holds the key its effect is written under.
func TestShardKeyInPrimaryKeyThroughSharded(t *testing.T) {
	t.Parallel()
	for _, bs := range []int{0, 100, 1} {
		t.Run(fmt.Sprintf("BatchSize=%d", bs), func(t *testing.T) {
			t.Parallel()
			dbs := newShardDBs(t, 1)
			st, err := processed.New(dbs[0].pool, processed.Config{Schema: dbs[0].schema, ShardKeyInPrimaryKey: true})
			if err != nil {
				t.Fatal(err)
			}
			dbs[0].store = st
			s := migratedSharded(t, stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 1}})
			broker := memory.NewBroker()
			var all []*consumer.Message
			for i := range 300 {
				all = append(all, keyed(fmt.Sprintf("m%03d", i), fmt.Sprintf("acct-%02d", i%40), "x"))
			}
			all = append(all, all[:50]...) // redelivered
			if err := broker.Publish(ctx(t), "q", all...); err != nil {
				t.Fatal(err)
			}
			stats, err := runSharded(t, broker, "q", s, &deadLetters{}, bs)
			if err != nil {
				t.Fatal(err)
			}
			if stats.Applied != 300 || stats.Duplicates != 50 || stats.DeadLettered != 0 {
				t.Fatalf("stats %+v", stats)
			}
			var apart int
			if err := dbs[0].pool.QueryRow(ctx(t), `SELECT count(*) FROM effects e
LEFT JOIN processed_messages p ON p.consumer = 'ledger' AND p.message_id = e.message_id AND p.shard_key = e.key
WHERE p.message_id IS NULL`).Scan(&apart); err != nil || apart != 0 {
				t.Fatalf("%d effects without a dedup row of their key (%v)", apart, err)
			}
			if n := len(effects(t, dbs)); n != 300 {
				t.Fatalf("%d ids with effects, want 300", n)
			}
		})
	}
}
