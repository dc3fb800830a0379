package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/internal/testdb"
)

// TestMain runs main itself when asked to, so that a test can check its exit
// status and output as a user would see them.
func TestMain(m *testing.M) {
	if os.Getenv("IDEMQ_EXAMPLE_MAIN") == "1" {
		os.Args = append([]string{"redis"}, strings.Fields(os.Getenv("IDEMQ_EXAMPLE_ARGS"))...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func runMain(t *testing.T, args string, env ...string) (stdout, stderr string, code int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), "IDEMQ_EXAMPLE_MAIN=1", "IDEMQ_EXAMPLE_ARGS="+args), env...)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		code = exit.ExitCode()
	case err != nil:
		t.Fatal(err)
	}
	return o.String(), e.String(), code
}

// TestPayments runs the example on its own schema and stream: five payments
// applied once each (one sent twice), three dead letters listed with their
// reasons and left in the dead-letter stream, balances right.
func TestPayments(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	t.Setenv("DATABASE_URL", testdb.URL())
	stream := "idemq-test.redis-example." + strings.TrimPrefix(schema, "idemq_test_")
	var out bytes.Buffer
	if err := run(ctx, []string{"-schema", schema, "-stream", stream}, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	defer func() { _ = run(context.Background(), []string{"-stream", stream, "-delete"}, &out) }()
	for _, want := range []string{"applied 5, skipped 1 duplicates, dead-lettered 3", "2 × permanent", "1 × missing-id"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	var sum int64
	if err := pool.QueryRow(ctx, `SELECT sum(balance_cents) FROM `+schema+`.accounts`).Scan(&sum); err != nil || sum != 5000 {
		t.Errorf("balances sum to %d (%v), want 5000: each good payment applied once", sum, err)
	}
	opt, _ := redis.ParseURL(redisstream.DefaultURL)
	c := redis.NewClient(opt)
	defer c.Close()
	if n, err := c.XLen(ctx, redisstream.DLQName(stream)).Result(); err != nil || n != 3 {
		t.Errorf("%s holds %d entries (%v), want 3", redisstream.DLQName(stream), n, err)
	}
	if p, err := c.XPending(ctx, stream, consumerName).Result(); err != nil || p.Count != 0 {
		t.Errorf("pending %+v (%v), want none", p, err)
	}

	// A second run, on fresh streams, publishes the same payment ids
	// again: all six good ones are duplicates, and the three bad ones
	// dead-lettered again, the only ones the dead-letter stream holds.
	out.Reset()
	if err := run(ctx, []string{"-schema", schema, "-stream", stream}, &out); err != nil {
		t.Fatalf("second run: %v", err)
	}
	if !strings.Contains(out.String(), "applied 0, skipped 6 duplicates, dead-lettered 3") {
		t.Errorf("second run:\n%s", out.String())
	}
	if err := pool.QueryRow(ctx, `SELECT sum(balance_cents) FROM `+schema+`.accounts`).Scan(&sum); err != nil || sum != 5000 {
		t.Errorf("after a second run balances sum to %d (%v), want 5000", sum, err)
	}
	if n, err := c.XLen(ctx, redisstream.DLQName(stream)).Result(); err != nil || n != 3 {
		t.Errorf("after a second run %s holds %d entries (%v), want 3", redisstream.DLQName(stream), n, err)
	}
}

func TestHelpExitsZero(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out.String(), "Usage") {
		t.Errorf("run -h: %v\n%s", err, out.String())
	}
	stdout, stderr, code := runMain(t, "-h")
	if code != 0 || !strings.Contains(stdout, "-stream") || stderr != "" {
		t.Errorf("-h: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
}

// TestErrorsRedacted: a failure shows neither the Redis nor the Postgres
// password.
func TestErrorsRedacted(t *testing.T) {
	const redisSecret, pgSecret = "redis-s3cret", "pg-s3cret"
	for _, env := range [][]string{
		{"REDIS_URL=redis://:" + redisSecret + "@127.0.0.1:1/0", "DATABASE_URL=" + testdb.URL()},
		{"REDIS_URL=redis://:" + redisSecret + "%zz@127.0.0.1:6379/0", "DATABASE_URL=" + testdb.URL()},
		{"REDIS_URL=" + redisstream.DefaultURL, "DATABASE_URL=postgres://postgres:" + pgSecret + "@127.0.0.1:1/test?sslmode=disable"},
	} {
		_, stderr, code := runMain(t, "-schema idemq_redis_never_created -stream idemq-test.never", env...)
		if code != 1 || stderr == "" {
			t.Errorf("%v: exit %d, stderr %q; want exit 1 with an error", env, code, stderr)
		}
		if strings.Contains(stderr, redisSecret) || strings.Contains(stderr, pgSecret) {
			t.Errorf("error shows a password: %s", stderr)
		}
	}
}
