package main

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
)

// dlq replay --shard-url looks each dead letter's original up on every
// shard of a sharded store: those applied on either shard are skipped.
func TestDLQReplayShards(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	urls, s := migratedShards(t, 2)
	f := newRedisFixtureWith(ctx, t, redisstream.Config{})
	for i := range 4 {
		f.deadLetter(ctx, t, fmt.Sprint("o-", i), fmt.Sprint(`{"o":`, i, `}`), consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug")})
	}
	// o-1 was applied on shard 0, o-2 on shard 1.
	for shard, id := range []string{"o-1", "o-2"} {
		body := fmt.Sprint(`{"o":`, id[2:], `}`)
		claim(t, s.Shard(shard), dedup.Claim{Consumer: "billing", MessageID: id, Fingerprint: (&consumer.Message{Body: []byte(body)}).Fingerprint(), Partition: -1, Offset: -1})
	}
	args := append([]string{"dlq", "replay", "--stream-key", f.dead, "--retention", "72h", "--shard-url", urls[0], "--shard-url", urls[1]}, f.args[2:]...)
	want(t, idemq(t, append(args, "--dry-run")...), exitOK, "2 will apply, 2 already applied, 0 fingerprint mismatch", "")
	want(t, idemq(t, args...), exitOK, "republished 2 (the consumer applies them once); skipped 2 already applied", "")
	want(t, idemq(t, append(args, "--database-url", urls[0])...), exitUsage, "", "--shard-url and --database-url")
}
