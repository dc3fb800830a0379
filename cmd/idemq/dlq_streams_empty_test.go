package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/dlq"
)

// TestDLQRedisMissingStreamSaidSo: a Redis stream key that does not exist
// (nothing was dead-lettered to it yet, or the key or database is wrong)
// reads as zero dead letters, as an emptied DLQ does; inspect, the dry run
// and replay say on stderr that it does not exist, and keep --json's
// stdout JSON. An existing stream that was emptied gets no such note.
func TestDLQRedisMissingStreamSaidSo(t *testing.T) {
	t.Parallel()
	_, db := dbArgs(t)
	missing := "idemq-cli-test-" + randHex(5) + ".dlq"
	const note = `does not exist`

	r := idemq(t, "dlq", "inspect", "--stream-key", missing)
	want(t, r, exitOK, "0 dead-lettered messages in 0 groups", `Redis stream "`+missing+`" `+note)
	r = idemq(t, "dlq", "inspect", "--stream-key", missing, "--json")
	want(t, r, exitOK, "", note)
	var rep dlq.Report
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || rep.Total != 0 {
		t.Fatalf("inspect --json: %v %+v\n%s", err, rep, r.stdout)
	}
	replay := append([]string{"dlq", "replay", "--stream-key", missing, "--retention", "72h"}, db...)
	want(t, idemq(t, append(replay, "--dry-run")...), exitOK, "dry run: scanned 0", note)
	want(t, idemq(t, replay...), exitOK, "replay: scanned 0", note)

	// The same key, created and emptied: an empty DLQ, nothing to note.
	rdb := redisClient(t)
	ctx := context.Background()
	t.Cleanup(func() { _ = rdb.Del(context.Background(), missing).Err() })
	id, err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: missing, Values: []string{"k", "v"}}).Result()
	if err == nil {
		err = rdb.XDel(ctx, missing, id).Err()
	}
	if err != nil {
		t.Fatal(err)
	}
	r = idemq(t, "dlq", "inspect", "--stream-key", missing)
	want(t, r, exitOK, "0 dead-lettered messages in 0 groups", "")
	if r.stderr != "" {
		t.Fatalf("an emptied stream: stderr %q, want nothing", r.stderr)
	}
}
