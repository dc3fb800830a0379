package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// shardDatabases creates n databases on the test server, dropped when the
// test ends, and returns their URLs.
func shardDatabases(t *testing.T, n int) []string {
	t.Helper()
	base, err := url.Parse(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	var urls []string
	for i := range n {
		name := "idemq_test_shard_" + hex.EncodeToString(b[:]) + "_" + string(rune('0'+i))
		if _, err := testdb.Pool(t).Exec(context.Background(), "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = testdb.Pool(t).Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		})
		u := *base
		u.Path = "/" + name
		urls = append(urls, u.String())
	}
	return urls
}

// status --shard-url shows each shard's report under what it records of
// the map, and the totals; URLs given in another order are flagged.
func TestStatusShards(t *testing.T) {
	t.Parallel()
	urls, s := migratedShards(t, 2)
	ctx := context.Background()
	for i, shard := range []int{0, 1, 1} {
		tx, res, err := s.BeginClaim(ctx, []dedup.Claim{{Consumer: "ledger", MessageID: "m" + string(rune('0'+i)),
			Partition: -1, Offset: -1, Route: dedup.Route{Shard: shard, Was: shard}}})
		if err != nil || res[0].Outcome != dedup.ClaimNew {
			t.Fatalf("claim %d: %+v, %v", i, res, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}

	r := idemq(t, "status", "--consumer", "ledger", "--shard-url", urls[0], "--shard-url", urls[1])
	for _, line := range []string{
		"shard 0: " + urls[0] + " (records shard 0 of key/2)\n",
		"shard 1: " + urls[1] + " (records shard 1 of key/2)\n",
		"  dedup rows:      1 (1 in the table, all consumers)\n",
		"  dedup rows:      2 (2 in the table, all consumers)\n",
		"total over 2 shards:\n  dedup rows: 3 (3 in the tables, all consumers)\n",
		"  last applied: m2 at ",
	} {
		want(t, r, exitOK, line, "")
	}
	want(t, idemq(t, "status", "--consumer", "ledger", "--shard-url", urls[1], "--shard-url", urls[0]), exitOK,
		"(records shard 1 of key/2 (given as shard 0: the URLs are in another order than the map's))", "")

	r = idemq(t, "status", "--consumer", "ledger", "--shard-url", urls[0], "--shard-url", urls[1], "--json")
	var got statusSharded
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil || r.code != exitOK {
		t.Fatalf("--json: %v\n%s%s", err, r.stdout, r.stderr)
	}
	if got.Total.Rows != 3 || len(got.Shards) != 2 || got.Shards[1].Report.Rows != 2 || got.Shards[1].Records != "shard 1 of key/2" ||
		got.Total.LastApplied == nil || time.Since(got.Total.LastApplied.ProcessedAt) > time.Minute {
		t.Fatalf("--json: %+v", got)
	}

	want(t, idemq(t, "status", "--consumer", "ledger", "--shard-url", urls[0], "--database-url", urls[1]), exitUsage, "", "--shard-url and --database-url")
}

// migratedShards is a sharded store of key/n over n fresh databases,
// migrated, closed when the test ends, and the databases' URLs.
func migratedShards(t *testing.T, n int) ([]string, *processed.Sharded) {
	t.Helper()
	ctx := context.Background()
	urls := shardDatabases(t, n)
	s, err := processed.OpenSharded(ctx, urls, processed.Config{}, processed.ShardedConfig{Map: processed.ShardMap{Shards: n}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return urls, s
}
