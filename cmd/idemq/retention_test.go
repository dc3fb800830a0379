package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// TestMigratePartitionedAndStatus: migrate --partitioned converts a plain
// table with rows; status, processed show and purge work on it, and status
// weighs the retention against the janitor's duplicate ages.
func TestMigratePartitionedAndStatus(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	fp := sha256.Sum256([]byte("x"))
	claim(t, s, consumer.Claim{Consumer: "billing", MessageID: "m-1", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	want(t, idemq(t, append([]string{"migrate", "--partition-interval", "1h"}, args...)...), exitUsage, "", "--partition-interval needs --partitioned")
	want(t, idemq(t, append([]string{"migrate", "--partitioned", "--partition-interval", "1h"}, args...)...), exitOK, "partitioned", "")
	want(t, idemq(t, append([]string{"migrate", "--partitioned", "--partition-interval", "1h"}, args...)...), exitOK, "already at version", "")
	part, err := processed.New(testdb.Pool(t), processed.Config{Schema: s.Schema(), Partitioned: true, PartitionInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	claim(t, part, consumer.Claim{Consumer: "billing", MessageID: "m-2", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	want(t, idemq(t, append([]string{"processed", "show"}, append(args, "billing", "m-1")...)...), exitOK, "m-1", "")

	// One janitor report: duplicates up to 4h old, retention 72h.
	b := make([]int64, len(consumer.DupAgeBounds)+1)
	b[0], b[8] = 998, 2 // within 1s; within 4h
	now := time.Now()
	if err := part.RecordRetention(context.Background(), consumer.RetentionReport{Consumer: "billing",
		WindowStart: now.Add(-10 * time.Minute), WindowEnd: now, Duplicates: 1000, Buckets: b, MaxAge: 3*time.Hour + 40*time.Minute,
		Retention: 72 * time.Hour, HorizonState: "clear", PurgedOlderThan: 72 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	r := idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...)
	for _, line := range []string{
		"partitions:      4, 0 sealed (",
		"duplicates:      1000 in 10m",
		"up to 3h40m after the original (p99.9",
		"retention:       3d0h: covered\n",
		"purge horizon:   nothing redeliverable",
	} {
		want(t, r, exitOK, line, "")
	}
	r = idemq(t, append([]string{"status", "--consumer", "billing", "--retention", "6h"}, args...)...)
	want(t, r, exitOK, "retention:       6h0m: covered, but the margin is thin", "")
	r = idemq(t, append([]string{"status", "--consumer", "billing", "--retention", "2h", "--json"}, args...)...)
	var got statusReport
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	if !got.Partitioned || got.Evidence == nil || got.Evidence.Verdict != "not covered" || got.Rows != 2 {
		t.Fatalf("json %s", r.stdout)
	}
	// The purge drops nothing live, and says so.
	r = idemq(t, append([]string{"processed", "purge", "--older-than", "1h"}, args...)...)
	if r.code != exitOK {
		t.Fatalf("purge: %+v", r)
	}
	if !strings.Contains(idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...).stdout, "dedup rows:      2") {
		t.Fatal("purge removed live rows")
	}
}
