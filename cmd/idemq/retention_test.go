package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// TestMigratePartitionedAndStatus: migrate --partitioned converts a plain
// table with rows, and migrate without it keeps the partitioned layout;
// status, processed show and purge work on it, and status weighs the
// retention against the janitor's duplicate ages.
func TestMigratePartitionedAndStatus(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	fp := sha256.Sum256([]byte("x"))
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m-1", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	// The range-partitioned layout's flag is gone.
	want(t, idemq(t, append([]string{"migrate", "--partitioned", "--partition-interval", "1h"}, args...)...), exitUsage, "", "flag provided but not defined: -partition-interval")
	r := idemq(t, append([]string{"migrate", "--partitioned"}, args...)...)
	for _, line := range []string{
		s.String() + ": already at version ",
		s.String() + ": converted to the partitioned layout: generations processed_messages_g0 (current), processed_messages_g1 and processed_messages_g2, shown by the view processed_messages\n",
		s.String() + ": its rows are now processed_messages_g1, the generation before the first",
		"restart the consumers with Config.Partitioned set",
	} {
		want(t, r, exitOK, line, "")
	}
	if kind := relkind(t, s); kind != "v" {
		t.Fatalf("after migrate --partitioned, %s has relkind %q, want a view", s, kind)
	}
	// Again, with and without --partitioned: the layout stays.
	want(t, idemq(t, append([]string{"migrate", "--partitioned"}, args...)...), exitOK, s.String()+": already has the partitioned layout", "")
	want(t, idemq(t, append([]string{"migrate"}, args...)...), exitOK, s.String()+": already has the partitioned layout", "")
	if kind := relkind(t, s); kind != "v" {
		t.Fatalf("after migrate without --partitioned, %s has relkind %q, want a view still", s, kind)
	}
	part, err := processed.New(testdb.Pool(t), processed.Config{Schema: s.Schema(), Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	claim(t, part, dedup.Claim{Consumer: "billing", MessageID: "m-2", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	want(t, idemq(t, append([]string{"processed", "show"}, append(args, "billing", "m-1")...)...), exitOK, "m-1", "")

	// One janitor report: duplicates up to 4h old, retention 72h.
	b := make([]int64, len(dedup.AgeBounds())+1)
	b[0], b[8] = 998, 2 // within 1s; within 4h
	now := time.Now()
	if err := part.RecordRetention(context.Background(), dedup.RetentionReport{Consumer: "billing",
		WindowStart: now.Add(-10 * time.Minute), WindowEnd: now, Duplicates: 1000, Buckets: b, MaxAge: 3*time.Hour + 40*time.Minute,
		Retention: 72 * time.Hour, HorizonState: "clear", PurgedOlderThan: 72 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	r = idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...)
	for _, line := range []string{
		"layout:          partitioned: 3 generations",
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
	if !got.Partitioned || len(got.Generations) != 3 || got.Evidence == nil || got.Evidence.Verdict != "not covered" || got.Rows != 2 {
		t.Fatalf("json %s", r.stdout)
	}
	// The purge drops nothing live, and says so.
	r = idemq(t, append([]string{"processed", "purge", "--consumer", "billing", "--older-than", "1h"}, args...)...)
	want(t, r, exitOK, `recorded the purge horizon of consumer "billing" on `+s.String()+" (partitioned layout)", "")
	want(t, r, exitOK, "retired no generation", "")
	if !strings.Contains(idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...).stdout, "dedup rows:      2") {
		t.Fatal("purge removed live rows")
	}
}

// relkind returns the relkind of s's table ("" if it does not exist).
func relkind(t *testing.T, s *processed.Store) string {
	t.Helper()
	var kind *string
	if err := testdb.Pool(t).QueryRow(context.Background(), `SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1))`,
		pgx.Identifier{s.Schema(), s.Table()}.Sanitize()).Scan(&kind); err != nil {
		t.Fatal(err)
	}
	if kind == nil {
		return ""
	}
	return *kind
}

// TestMigrateEarlierPartitionedLayout: a table of the range-partitioned
// layout of earlier versions is refused by the other commands with the
// fix named, and migrate --partitioned makes it plain again, with its rows,
// then converts it, and says both.
func TestMigrateEarlierPartitionedLayout(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	fp := sha256.Sum256([]byte("x"))
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m-1", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m-2", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	// Back to the earlier layout: the table range-partitioned on
	// processed_at, and only migrations 1 and 2 applied (the later ones'
	// objects removed).
	q := func(name string) string { return pgx.Identifier{s.Schema(), name}.Sanitize() }
	for _, stmt := range []string{
		`DROP FUNCTION ` + q("processed_messages_commit_guard") + `() CASCADE`,
		`DROP FUNCTION ` + q("processed_messages_commit_check") + `(text)`,
		`DROP TABLE ` + q("processed_messages_horizons"),
		`DROP TABLE ` + q("processed_messages_shard_map"),
		`ALTER TABLE ` + q("processed_messages") + ` DROP COLUMN shard_key`,
		`ALTER TABLE ` + q("processed_messages") + ` RENAME TO processed_messages_before`,
		`CREATE TABLE ` + q("processed_messages") + ` (LIKE ` + q("processed_messages_before") + ` INCLUDING DEFAULTS INCLUDING CONSTRAINTS) PARTITION BY RANGE (processed_at)`,
		`CREATE TABLE ` + q("processed_messages_default") + ` PARTITION OF ` + q("processed_messages") + ` DEFAULT`,
		`INSERT INTO ` + q("processed_messages") + ` SELECT * FROM ` + q("processed_messages_before"),
		`DROP TABLE ` + q("processed_messages_before"),
		`DELETE FROM ` + q("processed_messages_migrations") + ` WHERE version > 2`,
	} {
		if _, err := testdb.Pool(t).Exec(context.Background(), stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	if kind := relkind(t, s); kind != "p" {
		t.Fatalf("the earlier layout has relkind %q, want p", kind)
	}
	want(t, idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...), exitFail, "",
		"has the partitioned layout of earlier versions: Migrate converts it")
	want(t, idemq(t, append([]string{"processed", "show", "billing", "m-1"}, args...)...), exitFail, "", "run 'idemq migrate --schema "+s.Schema())

	r := idemq(t, append([]string{"migrate", "--partitioned"}, args...)...)
	for _, line := range []string{
		fmt.Sprintf("%s: migrated from version 2 to %d\n", s, latestVersion()),
		s.String() + ": made the range-partitioned table of earlier versions plain again, keeping its rows and grants\n",
		s.String() + ": converted to the partitioned layout",
		s.String() + ": its rows are now processed_messages_g1",
	} {
		want(t, r, exitOK, line, "")
	}
	if kind := relkind(t, s); kind != "v" {
		t.Fatalf("after migrate --partitioned, relkind %q, want a view", kind)
	}
	r = idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...)
	want(t, r, exitOK, "dedup rows:      2 (2 in the table", "")
	want(t, r, exitOK, "layout:          partitioned: 3 generations", "")
}

// TestMigratePartitionedFresh: migrate --partitioned creates a table that
// does not exist with the partitioned layout, and says so.
func TestMigratePartitionedFresh(t *testing.T) {
	t.Parallel()
	schema, args := dbArgs(t)
	r := idemq(t, append([]string{"migrate", "--partitioned"}, args...)...)
	want(t, r, exitOK, fmt.Sprintf("%s.processed_messages: migrated from version 0 to %d\n", schema, latestVersion()), "")
	want(t, r, exitOK, schema+".processed_messages: created with the partitioned layout: generations processed_messages_g0 (current), processed_messages_g1 and processed_messages_g2", "")
	if strings.Contains(r.stdout, "converted") {
		t.Errorf("a fresh table reported as converted:\n%s", r.stdout)
	}
	s, err := processed.New(testdb.Pool(t), processed.Config{Schema: schema, Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	if kind := relkind(t, s); kind != "v" {
		t.Fatalf("relkind %q, want a view", kind)
	}
}
