package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/natstest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

func TestMain(m *testing.M) {
	_ = natstest.EnsureAnchor(nats.DefaultURL) // see natstest
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}

type result struct {
	code           int
	stdout, stderr string
}

func idemq(t *testing.T, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out, errOut bytes.Buffer
	code := run(ctx, args, &out, &errOut)
	return result{code, out.String(), errOut.String()}
}

// dbArgs are the database flags for a fresh schema.
func dbArgs(t *testing.T) (schema string, args []string) {
	schema = testdb.Schema(t)
	return schema, []string{"--database-url", testdb.URL(), "--schema", schema}
}

func want(t *testing.T, r result, code int, stdout, stderr string) {
	t.Helper()
	if r.code != code || !strings.Contains(r.stdout, stdout) || !strings.Contains(r.stderr, stderr) {
		t.Fatalf("got exit %d\nstdout: %s\nstderr: %s\nwant exit %d, stdout containing %q, stderr containing %q",
			r.code, r.stdout, r.stderr, code, stdout, stderr)
	}
}

// migrated migrates a plain dedup table in a fresh schema, and returns a
// store of it and the database flags.
func migrated(t *testing.T) (*processed.Store, []string) {
	t.Helper()
	schema, args := dbArgs(t)
	want(t, idemq(t, append([]string{"migrate"}, args...)...), 0, fmt.Sprintf("migrated from version 0 to %d", latestVersion()), "")
	s, err := processed.New(testdb.Pool(t), processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	return s, args
}

// claim claims c in s with BeginClaim, the runtime's path, and commits;
// the claim must be new.
func claim(t *testing.T, s *processed.Store, c dedup.Claim) {
	t.Helper()
	ctx := context.Background()
	tx, res, err := s.BeginClaim(ctx, []dedup.Claim{c})
	if tx != nil {
		defer func() { _ = tx.Rollback(ctx) }()
	}
	if err != nil || res[0].Outcome != dedup.ClaimNew {
		t.Fatalf("BeginClaim(%s/%s): %+v, %v", c.Consumer, c.MessageID, res, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestMigrateTwice(t *testing.T) {
	t.Parallel()
	schema, args := dbArgs(t)
	latest := latestVersion()
	want(t, idemq(t, append([]string{"migrate"}, args...)...), 0, fmt.Sprintf("%s.processed_messages: migrated from version 0 to %d\n", schema, latest), "")
	want(t, idemq(t, append([]string{"migrate"}, args...)...), 0, fmt.Sprintf("already at version %d", latest), "")
	want(t, idemq(t, append([]string{"migrate"}, args...)...), 0, schema+".processed_messages: plain table (idemq migrate --partitioned converts it", "")

	// A custom table, given after the other flags.
	want(t, idemq(t, append([]string{"migrate"}, append(args, "--table", "Dedup")...)...), 0, schema+".Dedup: migrated", "")
	rows, err := testdb.Pool(t).Query(context.Background(),
		"SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY tablename COLLATE \"C\"", schema)
	if err != nil {
		t.Fatal(err)
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	// Two plain tables, each with its _horizons, _migrations, _retention
	// and _shard_map.
	if got, want := strings.Join(tables, " "), "Dedup Dedup_horizons Dedup_migrations Dedup_retention Dedup_shard_map "+
		"processed_messages processed_messages_horizons processed_messages_migrations processed_messages_retention processed_messages_shard_map"; got != want {
		t.Errorf("tables in %s: %s, want %s", schema, got, want)
	}
}

func TestProcessedShow(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	fp := sha256.Sum256([]byte("pay 10"))
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m-1", Fingerprint: fp, Source: "payments", Partition: 4, Offset: 99})
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m 2", Fingerprint: fp, Partition: -1, Offset: -1})

	r := idemq(t, append([]string{"processed", "show", "billing", "m-1"}, args...)...)
	for _, line := range []string{"consumer:     billing", "message id:   m-1", "sha256:" + hex.EncodeToString(fp[:]),
		"source:       payments", "partition:    4", "offset:       99", "processed at: "} {
		want(t, r, 0, line, "")
	}
	// Flags may follow the arguments; NULL partition and offset print "-".
	r = idemq(t, append(append([]string{"processed", "show"}, args...), "billing", "m 2")...)
	want(t, r, 0, "partition:    -\noffset:       -", "")

	r = idemq(t, append([]string{"processed", "show", "--json", "billing", "m-1"}, args...)...)
	want(t, r, 0, "", "")
	var j jsonRecord
	if err := json.Unmarshal([]byte(r.stdout), &j); err != nil {
		t.Fatalf("--json output %q: %v", r.stdout, err)
	}
	if j.MessageID != "m-1" || j.Fingerprint != hex.EncodeToString(fp[:]) || j.Partition == nil || *j.Partition != 4 || j.ProcessedAt.IsZero() {
		t.Errorf("--json: %+v", j)
	}

	want(t, idemq(t, append([]string{"processed", "show", "billing", "m-3"}, args...)...), 1, "", "not found")
	want(t, idemq(t, append([]string{"processed", "show", "shipping", "m-1"}, args...)...), 1, "", "not found")
	// An id that looks like a flag, after "--".
	want(t, idemq(t, append(append([]string{"processed", "show"}, args...), "--", "billing", "-m")...), 1, "", `message id "-m"`)
}

func TestProcessedShowNotMigrated(t *testing.T) {
	t.Parallel()
	_, args := dbArgs(t)
	want(t, idemq(t, append([]string{"processed", "show", "a", "b"}, args...)...), 1, "", "run 'idemq migrate")
}

// TestProcessedPurge: on a plain table, purge --consumer deletes that
// consumer's old rows, in batches, and no other consumer's, and records
// only its purge horizon; --all-consumers then purges every consumer's.
func TestProcessedPurge(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	for i := range 7 {
		claim(t, s, dedup.Claim{Consumer: "c", MessageID: fmt.Sprint(i), Partition: -1, Offset: -1})
		claim(t, s, dedup.Claim{Consumer: "d", MessageID: fmt.Sprint(i), Partition: -1, Offset: -1})
	}
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	backdate := func(age string, ids ...string) {
		if _, err := testdb.Pool(t).Exec(context.Background(),
			"UPDATE "+table+" SET processed_at = now() - $1::interval WHERE message_id = ANY($2)", age, ids); err != nil {
			t.Fatal(err)
		}
	}
	backdate("3 days", "0", "1", "2")
	backdate("5 hours", "3", "4")
	rows := func(name string) int64 {
		t.Helper()
		st, err := s.Stats(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		return st.Rows
	}
	purge := func(flags ...string) result {
		return idemq(t, append(append([]string{"processed", "purge"}, flags...), args...)...)
	}

	want(t, purge("--consumer", "c", "--older-than", "2d", "--batch-size", "2"),
		0, `deleted 3 records of consumer "c" processed more than 48h0m0s ago from `+s.String()+" (plain table)\n", "")
	if c, d := rows("c"), rows("d"); c != 4 || d != 7 {
		t.Fatalf("after purging c: c has %d rows, d %d; want 4 and 7 (d's are not c's to purge)", c, d)
	}
	if got := horizons(t, s); strings.Join(got, ",") != "c" {
		t.Fatalf("purge horizons recorded for %v, want [c]", got)
	}
	want(t, purge("--consumer", "c", "--older-than", "2d"), 0, `deleted 0 records of consumer "c"`, "")

	// Every consumer's: d's three old rows go now.
	want(t, purge("--all-consumers", "--older-than", "2d"), 0, "deleted 3 records of any consumer processed more than 48h0m0s ago", "")
	if c, d := rows("c"), rows("d"); c != 4 || d != 4 {
		t.Fatalf("after purging all: c has %d rows, d %d; want 4 and 4", c, d)
	}
	if got := horizons(t, s); strings.Join(got, ",") != "c,d" {
		t.Fatalf("purge horizons recorded for %v, want [c d]", got)
	}
	want(t, purge("--consumer", "d", "--older-than", "1h", "--pause", "0"), 0, `deleted 2 records of consumer "d"`, "")
	if c, d := rows("c"), rows("d"); c != 4 || d != 2 {
		t.Fatalf("after purging d by 1h: c has %d rows, d %d; want 4 and 2", c, d)
	}
}

// horizons returns the consumers whose purge horizon s's table records.
func horizons(t *testing.T, s *processed.Store) []string {
	t.Helper()
	rows, err := testdb.Pool(t).Query(context.Background(),
		"SELECT consumer FROM "+pgx.Identifier{s.Schema(), s.Table() + "_horizons"}.Sanitize()+" ORDER BY consumer")
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// TestProcessedPurgePartitioned: on the partitioned layout, purge
// --consumer records only that consumer's horizon and retires nothing
// while another consumer with rows in the oldest generation holds it, and
// says who; --all-consumers records every consumer's, and the generation
// goes.
func TestProcessedPurgePartitioned(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	for _, c := range []dedup.Claim{{Consumer: "a", MessageID: "a-1"}, {Consumer: "a", MessageID: "a-2"}, {Consumer: "b", MessageID: "b-1"}} {
		c.Partition, c.Offset = -1, -1
		claim(t, s, c)
	}
	want(t, idemq(t, append([]string{"migrate", "--partitioned"}, args...)...), exitOK, "converted to the partitioned layout", "")
	part, err := processed.New(testdb.Pool(t), processed.Config{Schema: s.Schema(), Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	claim(t, part, dedup.Claim{Consumer: "a", MessageID: "a-3", Partition: -1, Offset: -1})
	rows := func(name string) int64 {
		t.Helper()
		st, err := part.Stats(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		return st.Rows
	}
	purge := func(flags ...string) result {
		return idemq(t, append(append([]string{"processed", "purge"}, flags...), args...)...)
	}

	// a's purge by 1ms: the upkeep makes a fresh generation current (the
	// plain table's rows become the oldest), but b, which has rows there
	// and recorded no horizon, holds it.
	time.Sleep(20 * time.Millisecond)
	r := purge("--consumer", "a", "--older-than", "1ms")
	want(t, r, exitOK, `recorded the purge horizon of consumer "a" on `+s.String()+" (partitioned layout): records processed more than 1ms ago may go\n", "")
	want(t, r, exitOK, "retired no generation: records go a generation at a time", "")
	want(t, r, exitOK, `the oldest generation, processed_messages_g2 (ended `, "")
	want(t, r, exitOK, `is held by "b": their purge horizons are not past its end`, "")
	if a, b := rows("a"), rows("b"); a != 3 || b != 1 {
		t.Fatalf("after a's purge: a has %d rows, b %d; want 3 and 1", a, b)
	}
	if got := horizons(t, s); strings.Join(got, ",") != "a" {
		t.Fatalf("purge horizons recorded for %v, want [a]", got)
	}
	if _, err := testdb.Pool(t).Exec(context.Background(), "ANALYZE "+pgx.Identifier{s.Schema(), s.Table() + "_g2"}.Sanitize()); err != nil {
		t.Fatal(err)
	}

	// Every consumer's: b allows it too, and the oldest generation (a-1,
	// a-2 and b-1) goes; a-3, claimed after the conversion, stays.
	time.Sleep(20 * time.Millisecond)
	r = purge("--all-consumers", "--older-than", "1ms", "--batch-size", "1")
	want(t, r, exitOK, "recorded the purge horizon of every consumer with records on "+s.String()+" (partitioned layout)", "")
	want(t, r, exitOK, "retired about 3 records", "")
	if strings.Contains(r.stdout, "held by") {
		t.Errorf("the oldest generation is held after every consumer purged:\n%s", r.stdout)
	}
	if a, b := rows("a"), rows("b"); a != 1 || b != 0 {
		t.Fatalf("after purging all: a has %d rows, b %d; want 1 and 0", a, b)
	}
	if got := horizons(t, s); strings.Join(got, ",") != "a,b" {
		t.Fatalf("purge horizons recorded for %v, want [a b]", got)
	}
}

func TestUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args           []string
		code           int
		stdout, stderr string
	}{
		{nil, 2, "", "Commands:"},
		{[]string{"--help"}, 0, "processed show <consumer> <id>", ""},
		{[]string{"-h"}, 0, "migrate", ""},
		{[]string{"help"}, 0, "processed purge", ""},
		{[]string{"help", "migrate"}, 0, "-schema", ""},
		{[]string{"migrate", "--help"}, 0, "idemq migrate [flags]", ""},
		{[]string{"processed", "purge", "-h"}, 0, "-older-than duration", ""},
		{[]string{"processed", "show", "--help"}, 0, "-json", ""},
		{[]string{"processed"}, 2, "", "idemq processed <command>"},
		{[]string{"processed", "--help"}, 0, "processed show", ""},
		{[]string{"nope"}, 2, "", `unknown command "nope"`},
		{[]string{"processed", "nope"}, 2, "", `unknown command "processed nope"`},
		{[]string{"migrate", "extra"}, 2, "", `unexpected argument "extra"`},
		{[]string{"migrate", "--bogus"}, 2, "", "flag provided but not defined: -bogus"},
		{[]string{"processed", "show", "only-one"}, 2, "", "want 2 arguments"},
		{[]string{"processed", "show", "a", "b", "c"}, 2, "", "want 2 arguments"},
		{[]string{"processed", "purge", "-h"}, 0, "-all-consumers", ""},
		{[]string{"processed", "purge", "--help"}, 0, "partitioned layout: records go a generation at a time", ""},
		// Whose records: exactly one of --consumer and --all-consumers.
		{[]string{"processed", "purge"}, 2, "", "say whose records to purge: --consumer <name> for one consumer's, or --all-consumers for every consumer's"},
		{[]string{"processed", "purge", "--older-than", "1h"}, 2, "", "say whose records to purge"},
		{[]string{"processed", "purge", "--older-than", "1h", "--consumer", "c", "--all-consumers"}, 2, "", "give either --consumer <name> or --all-consumers, not both"},
		{[]string{"processed", "purge", "--all-consumers", "--older-than", "1h", "--consumer="}, 2, "", "give either --consumer <name> or --all-consumers, not both"},
		{[]string{"processed", "purge", "--older-than", "1h", "--consumer="}, 2, "", "--consumer needs a consumer's name"},
		{[]string{"processed", "purge", "--consumer", "c"}, 2, "", "--older-than is required"},
		{[]string{"processed", "purge", "--all-consumers"}, 2, "", "--older-than is required"},
		{[]string{"processed", "purge", "--consumer", "c", "--older-than", "abc"}, 2, "", "want a duration such as 72h"},
		{[]string{"processed", "purge", "--consumer", "c", "--older-than", "-1h"}, 2, "", "must be positive"},
		{[]string{"processed", "purge", "--all-consumers", "--older-than", "0s"}, 2, "", "must be positive"},
		{[]string{"processed", "purge", "--consumer", "c", "--older-than", "1h", "--batch-size", "0"}, 2, "", "--batch-size must be positive"},
		{[]string{"processed", "purge", "--consumer", "c", "--older-than", "1h", "--pause", "-1s"}, 2, "", "--pause must not be negative"},
		{[]string{"migrate", "--partition-interval", "24h"}, 2, "", "flag provided but not defined: -partition-interval"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			args := tc.args
			if c, _ := findCommand(args); c != nil {
				// No database is reachable: usage errors must not need one.
				args = append(args[:len(args):len(args)], "--database-url", "postgres://postgres@127.0.0.1:1/x")
			}
			r := idemq(t, args...)
			want(t, r, tc.code, tc.stdout, tc.stderr)
		})
	}
}

func TestHostileNamesRejected(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"migrate", "--table", "x; drop table y"},
		{"migrate", "--table", `a"b`},
		{"migrate", "--schema", "public; drop schema public cascade"},
		{"migrate", "--table", strings.Repeat("t", 64)},
		{"processed", "show", "--table", "x; drop table y", "a", "b"},
		{"processed", "purge", "--consumer", "c", "--older-than", "1h", "--schema", `"`},
	} {
		// The names are rejected before connecting: the URL is unreachable.
		r := idemq(t, append(args, "--database-url", "postgres://postgres@127.0.0.1:1/x")...)
		want(t, r, 2, "", "invalid --")
		if !strings.Contains(r.stderr, "not a plain identifier") && !strings.Contains(r.stderr, "bytes, more than") {
			t.Errorf("%v: stderr %q", args, r.stderr)
		}
	}
}

func TestCannotConnect(t *testing.T) {
	t.Parallel()
	r := idemq(t, "migrate", "--database-url", "postgres://someone:s3cret@127.0.0.1:1/x")
	want(t, r, 1, "", "cannot connect to Postgres at postgres://someone:xxxxx@127.0.0.1:1/x")
	want(t, r, 1, "", "DATABASE_URL")
	if strings.Contains(r.stderr, "s3cret") {
		t.Errorf("password leaked: %s", r.stderr)
	}
	want(t, idemq(t, "migrate", "--database-url", "::not a url::"), 1, "", "invalid database URL")
}

func TestDatabaseURLFromEnvironment(t *testing.T) {
	t.Parallel()
	getenv := func(name string) string {
		if name == "DATABASE_URL" {
			return "postgres://someone:s3cret@127.0.0.1:1/x"
		}
		return ""
	}
	var out, errOut bytes.Buffer
	code := runEnv(context.Background(), []string{"processed", "purge", "--consumer", "c", "--older-than", "1h"}, &env{&out, &errOut, getenv})
	r := result{code, out.String(), errOut.String()}
	want(t, r, 1, "", "postgres://someone:xxxxx@127.0.0.1:1/x (URL from DATABASE_URL")
	if strings.Contains(r.stderr, "s3cret") {
		t.Errorf("password leaked: %s", r.stderr)
	}
	// The flag wins over the environment.
	_, args := dbArgs(t)
	out.Reset()
	errOut.Reset()
	code = runEnv(context.Background(), append([]string{"migrate"}, args...), &env{&out, &errOut, getenv})
	want(t, result{code, out.String(), errOut.String()}, 0, "migrated", "")
}

func TestCancelledContext(t *testing.T) {
	t.Parallel()
	_, args := dbArgs(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // as if SIGINT arrived
	var out, errOut bytes.Buffer
	if code := run(ctx, append([]string{"migrate"}, args...), &out, &errOut); code != 1 {
		t.Fatalf("exit %d, want 1; stderr %s", code, errOut.String())
	}
	if !strings.Contains(errOut.String(), "interrupted") {
		t.Errorf("stderr %q, want it to say interrupted", errOut.String())
	}
}
