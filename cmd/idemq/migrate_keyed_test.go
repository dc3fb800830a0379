package main

import (
	"context"
	"crypto/sha256"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
)

// migrate --shard-key-in-primary-key converts a plain table, keeping its
// rows, once each has a shard key; the other commands then take the table
// as it is (a store without the setting refuses it), and a later migrate
// keeps it.
func TestMigrateShardKeyInPrimaryKey(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	fp := sha256.Sum256([]byte("x"))
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m-1", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	convert := append([]string{"migrate", "--shard-key-in-primary-key"}, args...)
	want(t, idemq(t, convert...), exitFail, "", "1 dedup rows of "+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()+" have no shard key")
	if _, err := testdb.Pool(t).Exec(context.Background(), `UPDATE `+pgx.Identifier{s.Schema(), s.Table()}.Sanitize()+` SET shard_key = 'acct-1'`); err != nil {
		t.Fatal(err)
	}
	want(t, idemq(t, convert...), exitOK, s.String()+": primary key (consumer, shard_key, message_id)", "")
	want(t, idemq(t, append([]string{"migrate"}, args...)...), exitOK, s.String()+": primary key (consumer, shard_key, message_id)", "")
	want(t, idemq(t, append([]string{"processed", "show"}, append(args, "billing", "m-1")...)...), exitOK, "m-1", "")
	want(t, idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...), exitOK, "dedup rows:", "")
	want(t, idemq(t, append([]string{"migrate", "--shard-key-in-primary-key", "--partitioned"}, args...)...), exitUsage, "", "--partitioned and --shard-key-in-primary-key")
}
