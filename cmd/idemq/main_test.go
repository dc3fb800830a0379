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
	"go.uber.org/goleak"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/natstest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

func TestMain(m *testing.M) {
	_ = natstest.EnsureAnchor(natsjs.DefaultURL) // see natstest
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

func migrated(t *testing.T) (*processed.Store, []string) {
	t.Helper()
	schema, args := dbArgs(t)
	want(t, idemq(t, append([]string{"migrate"}, args...)...), 0, "migrated from version 0 to 2", "")
	s, err := processed.New(testdb.Pool(t), processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	return s, args
}

func claim(t *testing.T, s *processed.Store, c consumer.Claim) {
	t.Helper()
	ctx := context.Background()
	tx, err := testdb.Pool(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if res, err := s.Claim(ctx, tx, c); err != nil || res.Outcome != consumer.ClaimNew {
		t.Fatalf("Claim: %+v, %v", res, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestMigrateTwice(t *testing.T) {
	t.Parallel()
	schema, args := dbArgs(t)
	want(t, idemq(t, append([]string{"migrate"}, args...)...), 0, schema+".processed_messages: migrated from version 0 to 2", "")
	want(t, idemq(t, append([]string{"migrate"}, args...)...), 0, "already at version 2", "")

	// A custom table, given after the other flags.
	want(t, idemq(t, append([]string{"migrate"}, append(args, "--table", "Dedup")...)...), 0, schema+".Dedup: migrated", "")
	var n int
	if err := testdb.Pool(t).QueryRow(context.Background(),
		"SELECT count(*) FROM pg_tables WHERE schemaname = $1", schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 6 { // two tables, each with its _migrations and _retention
		t.Errorf("%d tables in %s, want 6", n, schema)
	}
}

func TestProcessedShow(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	fp := sha256.Sum256([]byte("pay 10"))
	claim(t, s, consumer.Claim{Consumer: "billing", MessageID: "m-1", Fingerprint: fp, Source: "payments", Partition: 4, Offset: 99})
	claim(t, s, consumer.Claim{Consumer: "billing", MessageID: "m 2", Fingerprint: fp, Partition: -1, Offset: -1})

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

func TestProcessedPurge(t *testing.T) {
	t.Parallel()
	s, args := migrated(t)
	for i := range 7 {
		claim(t, s, consumer.Claim{Consumer: "c", MessageID: fmt.Sprint(i), Partition: -1, Offset: -1})
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

	want(t, idemq(t, append([]string{"processed", "purge", "--older-than", "2d", "--batch-size", "2"}, args...)...),
		0, "deleted 3 records processed more than 48h0m0s ago", "")
	want(t, idemq(t, append([]string{"processed", "purge", "--older-than", "2d"}, args...)...), 0, "deleted 0 records", "")
	want(t, idemq(t, append([]string{"processed", "purge", "--older-than", "1h", "--pause", "0"}, args...)...), 0, "deleted 2 records", "")
	st, err := s.Stats(context.Background(), "")
	if err != nil || st.Rows != 2 {
		t.Fatalf("rows left: %+v, %v; want 2", st, err)
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
		{[]string{"processed", "purge"}, 2, "", "--older-than is required"},
		{[]string{"processed", "purge", "--older-than", "abc"}, 2, "", "want a duration such as 72h"},
		{[]string{"processed", "purge", "--older-than", "-1h"}, 2, "", "must be positive"},
		{[]string{"processed", "purge", "--older-than", "0s"}, 2, "", "must be positive"},
		{[]string{"processed", "purge", "--older-than", "1h", "--batch-size", "0"}, 2, "", "--batch-size must be positive"},
		{[]string{"processed", "purge", "--older-than", "1h", "--pause", "-1s"}, 2, "", "--pause must not be negative"},
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
		{"processed", "purge", "--older-than", "1h", "--schema", `"`},
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
	code := runEnv(context.Background(), []string{"processed", "purge", "--older-than", "1h"}, &env{&out, &errOut, getenv})
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
