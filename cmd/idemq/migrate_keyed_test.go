package main

import (
	"crypto/sha256"
	"testing"

	"github.com/idemq/idemq/consumer/dedup"
)

// migrate --shard-key-in-primary-key converts a plain table, keeping its
// rows; the other commands then take the table as it is (a store without
// the setting refuses it), and a later migrate keeps it.
func TestMigrateShardKeyInPrimaryKey(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	fp := sha256.Sum256([]byte("x"))
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m-1", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	want(t, idemq(t, append([]string{"migrate", "--shard-key-in-primary-key"}, args...)...), exitOK,
		s.String()+": primary key (consumer, shard_key, message_id)", "")
	want(t, idemq(t, append([]string{"migrate"}, args...)...), exitOK, s.String()+": primary key (consumer, shard_key, message_id)", "")
	want(t, idemq(t, append([]string{"processed", "show"}, append(args, "billing", "m-1")...)...), exitOK, "m-1", "")
	want(t, idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...), exitOK, "dedup rows:", "")
	want(t, idemq(t, append([]string{"migrate", "--shard-key-in-primary-key", "--partitioned"}, args...)...), exitUsage, "", "--partitioned and --shard-key-in-primary-key")
}
