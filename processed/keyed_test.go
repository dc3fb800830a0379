package processed_test

import (
	"errors"
	"fmt"
	"strings"
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
	// A row without a key would never be found again by a keyed claim:
	// the conversion waits until it has one.
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	if err := s.Migrate(ctx(t)); err == nil || !strings.Contains(err.Error(), "1 dedup rows") {
		t.Fatalf("converting with a row without a key: %v, want a refusal", err)
	}
	if _, err := pool.Exec(ctx(t), `UPDATE `+table+` SET shard_key = 'acct-9' WHERE message_id = 'unkeyed'`); err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
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
	if err != nil || fmt.Sprint(keys) != "[keyed=acct-1 unkeyed=acct-9]" {
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

// MoveRows between shards whose tables keep the shard key in their primary
// key moves each row of an id and key on its own: the rows of one id under
// two keys the map places apart are parted, and pages that end between
// two rows of one id lose neither.
func TestShardKeyInPrimaryKeyMoveRows(t *testing.T) {
	t.Parallel()
	shards, s := keyedShards(t, processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	on := keysOn(t, s, 2, 1600)
	// On shard 0: one row that stays first, then 750 ids under two keys
	// both placed on shard 1 (a page of 1000 ends between the two rows of
	// an id), then id "x" under a key of each shard.
	type row struct{ id, key string }
	rows := []row{{"a-0", on[0][0]}}
	for i := range 750 {
		id := fmt.Sprintf("m%04d", i)
		rows = append(rows, row{id, on[1][2*i]}, row{id, on[1][2*i+1]})
	}
	rows = append(rows, row{"x", on[0][1]}, row{"x", on[1][1500]})
	tbl := pgx.Identifier{shards[0].Schema(), shards[0].Table()}.Sanitize()
	for _, r := range rows {
		if _, err := shards[0].Pool().Exec(ctx(t), `INSERT INTO `+tbl+` (consumer, message_id, fingerprint, shard_key) VALUES ('c', $1, sha256(convert_to($2, 'UTF8')), $2)`, r.id, r.key); err != nil {
			t.Fatal(err)
		}
	}
	rep, err := s.MoveRows(ctx(t), 0, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Moved != 1501 || rep.Unkeyed != 0 {
		t.Fatalf("moved %+v, want the 1501 rows placed on shard 1", rep)
	}
	left := func(st *processed.Store) []string {
		t.Helper()
		q, err := st.Pool().Query(ctx(t), `SELECT message_id || '=' || shard_key FROM `+pgx.Identifier{st.Schema(), st.Table()}.Sanitize()+` ORDER BY 1`)
		if err != nil {
			t.Fatal(err)
		}
		out, err := pgx.CollectRows(q, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	if got, want := fmt.Sprint(left(shards[0])), fmt.Sprint([]string{"a-0=" + on[0][0], "x=" + on[0][1]}); got != want {
		t.Fatalf("shard 0 keeps %s, want %s", got, want)
	}
	if n := len(left(shards[1])); n != 1501 {
		t.Fatalf("shard 1 holds %d rows, want 1501", n)
	}
}

// During a reshard of shards that keep the shard key in their primary key,
// a moved message is looked up on its old shard under its own key: the
// same id applied there under another key does not make it a duplicate.
func TestShardKeyInPrimaryKeyReshard(t *testing.T) {
	t.Parallel()
	everyKeyOn0 := func(string) (int, error) { return 0, nil }
	_, s := keyedShards(t, processed.ShardedConfig{Map: processed.ShardMap{Name: "new", Shards: 2},
		Previous: &processed.ShardMap{Name: "old", Shards: 2, Place: everyKeyOn0}})
	on := keysOn(t, s, 1, 1)
	stayKey, movedKey := on[0][0], on[1][0]
	route := func(key string) dedup.Route {
		r, err := s.Route(&consumer.Message{ID: "x", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	// x under stayKey was applied on shard 0 before the reshard.
	old := claimOf("c", "x", "body")
	old.Route = route(stayKey)
	claim(t, s, old)
	moved := claimOf("c", "x", "body")
	moved.Route = route(movedKey)
	if moved.Route.Was != 0 || moved.Route.Shard != 1 {
		t.Fatalf("route %+v, want from shard 0 to 1", moved.Route)
	}
	if got := claim(t, s, moved)[0].Outcome; got != dedup.ClaimNew {
		t.Fatalf("x under the moved key: %v, want new (x was applied under another key)", got)
	}
	if got := claim(t, s, moved)[0].Outcome; got != dedup.ClaimDuplicate {
		t.Fatalf("x under the moved key again: %v, want duplicate", got)
	}
}

// keyedShards is a Sharded of cfg over two stores, each in a schema of its
// own, that keep the shard key in their primary key, migrated.
func keyedShards(t *testing.T, cfg processed.ShardedConfig) ([]*processed.Store, *processed.Sharded) {
	t.Helper()
	var shards []*processed.Store
	for range 2 {
		st, _ := setup(t, processed.Config{ShardKeyInPrimaryKey: true})
		shards = append(shards, st)
	}
	return shards, migratedSharded(t, shards, cfg)
}

// keysOn finds keys ("k-<n>") that s's map places on shard 0 and on shard
// 1, at least n0 and n1 of them.
func keysOn(t *testing.T, s *processed.Sharded, n0, n1 int) map[int][]string {
	t.Helper()
	on := map[int][]string{}
	for i := 0; len(on[0]) < n0 || len(on[1]) < n1; i++ {
		k := fmt.Sprintf("k-%d", i)
		r, err := s.Route(&consumer.Message{ID: "x", Key: k})
		if err != nil {
			t.Fatal(err)
		}
		on[r.Shard] = append(on[r.Shard], k)
	}
	return on
}

// A reshard that changes the shard key function: a message applied under
// its key by the old map would be looked up under the new map's key (on
// tables that keep the shard key in their primary key), and its row moved
// by MoveRows to where the new map places the old key, so it could be
// applied a second time. Route refuses such a message during the reshard
// (the runtime dead-letters it as unroutable, with the reason), and
// routes those whose key stays.
func TestEdgeShardedReshardChangingTheKeyIsRefused(t *testing.T) {
	t.Parallel()
	header := func(h string) func(*consumer.Message) (string, error) {
		return func(m *consumer.Message) (string, error) { return m.Header(h), nil }
	}
	byTenant := processed.ShardMap{Name: "tenant", Shards: 2, Key: header("tenant")}
	byAccount := processed.ShardMap{Name: "account", Shards: 2, Key: header("account")}
	shards, before := keyedShards(t, processed.ShardedConfig{Map: byTenant})
	during := migratedSharded(t, shards, processed.ShardedConfig{Map: byAccount, Previous: &byTenant})
	for i := range 40 {
		msg := &consumer.Message{ID: fmt.Sprintf("m-%d", i), Headers: map[string]string{
			"tenant": fmt.Sprintf("t-%d", i), "account": fmt.Sprintf("a-%d", i)}}
		c := claimOf("c", msg.ID, "body")
		r, err := before.Route(msg)
		if err != nil {
			t.Fatal(err)
		}
		c.Route = r
		if got := claim(t, before, c)[0].Outcome; got != dedup.ClaimNew {
			t.Fatalf("%s under the old map: %v, want new", msg.ID, got)
		}
		if r, err := during.Route(msg); err == nil || !strings.Contains(err.Error(), "shard key changes") {
			t.Fatalf("%s during the reshard: route %+v, %v, want it refused: its shard key changes", msg.ID, r, err)
		}
		msg.Headers["account"] = msg.Headers["tenant"] // the same key under both maps
		if _, err := during.Route(msg); err != nil {
			t.Fatalf("%s with the same key under both maps: %v", msg.ID, err)
		}
	}
}
