package readmetour

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
)

const (
	tourEnv            = "IDEMQ_README_TOUR"
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultAMQPURL     = "amqp://guest:guest@127.0.0.1:5672/"
	// commandTimeout bounds one README command.
	commandTimeout = 5 * time.Minute
)

// What the tour leaves behind, dropped before it starts so that it runs on
// a fresh database: the schemas of the quickstart and of examples/nats and
// examples/redis, the dedup table `idemq migrate` creates in public with its
// tables and functions, and the RabbitMQ queues and exchange of
// examples/rabbitmq-dlq. (The other examples recreate their own schemas and
// queues, and their tests may be using them.) The NATS and Redis streams
// (streams_test.go) are deleted after the tour as well.
var (
	tourSchemas   = []string{"idemq_quickstart", "idemq_example_nats", "idemq_redis"}
	tourTables    = []string{"processed_messages", "processed_messages_migrations", "processed_messages_retention", "processed_messages_horizons", "processed_messages_shard_map"} // in public
	tourFunctions = []string{"processed_messages_commit_check(text)", "processed_messages_commit_guard()"}                                                                         // in public
	tourQueues    = []string{"payments", "payments.dlq"}
	tourExchanges = []string{"payments.dlx"}
)

// TestReadmeTour runs every command of README.md's sh blocks, in order,
// from the repository root, each with bash -euo pipefail, on a fresh
// database, and fails on the first that exits non-zero. Blocks marked
// "<!-- tour: skip (reason) -->" are left out. It runs only with
// IDEMQ_README_TOUR=1 (it takes a minute or two and the README's own test
// command would run it again); then a missing prerequisite fails it.
func TestReadmeTour(t *testing.T) {
	if os.Getenv(tourEnv) != "1" {
		t.Skipf("set %s=1 to run the README tour (.ci/run does)", tourEnv)
	}
	root := repoRoot(t)
	blocks := docBlocks(t, root)
	var cmds []command
	skipped := 0
	for _, b := range blocks {
		if b.lang != "sh" {
			continue
		}
		if b.skip != "" {
			t.Logf("%s: sh block skipped: %s", b.where(), b.skip)
			skipped++
			continue
		}
		cmds = append(cmds, shellCommands(t, b)...)
	}
	if len(cmds) == 0 {
		t.Fatal("README.md and docs/ have no sh commands to run")
	}
	t.Logf("%d commands to run, %d sh blocks skipped", len(cmds), skipped)

	for _, tool := range []string{"bash", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is not on PATH: %v", tool, err)
		}
	}
	ctx := context.Background()
	dbURL := envOr("DATABASE_URL", defaultDatabaseURL)
	amqpURL := envOr("AMQP_URL", defaultAMQPURL)
	resetDatabase(ctx, t, dbURL)
	resetRabbitMQ(t, amqpURL)
	if err := resetStreams(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := resetStreams(); err != nil {
			t.Errorf("after the tour: %v", err)
		}
	})

	// `go install` puts idemq in GOBIN, or GOPATH/bin: first on PATH, so
	// that the README's idemq is the one it just installed.
	bin := goEnv(t, "GOBIN")
	if bin == "" {
		bin = filepath.Join(strings.Split(goEnv(t, "GOPATH"), string(os.PathListSeparator))[0], "bin")
	}
	env := append(os.Environ(), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"), tourEnv+"=")

	started := time.Now()
	for _, c := range cmds {
		cctx, cancel := context.WithTimeout(ctx, commandTimeout)
		cmd := exec.CommandContext(cctx, "bash", "-euo", "pipefail", "-c", c.text)
		cmd.Dir = root
		cmd.Env = env
		cmd.Stdin = nil // no stdin, as in CI
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		cmd.WaitDelay = 10 * time.Second
		t0 := time.Now()
		err := cmd.Run()
		timedOut := cctx.Err() != nil
		cancel()
		if err != nil {
			code := -1
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				code = ee.ExitCode()
			}
			if timedOut {
				err = fmt.Errorf("%w (killed after %s)", err, commandTimeout)
			}
			t.Fatalf("%s: command failed (exit code %d, %v):\n  %s\noutput:\n%s", c.where, code, err, c.text, out.String())
		}
		t.Logf("%s: ok in %s: %s", c.where, time.Since(t0).Round(time.Millisecond), c.text)
	}
	t.Logf("tour: %d commands in %s", len(cmds), time.Since(started).Round(time.Millisecond))
	if err := checkDLQsRead(); err != nil {
		t.Fatal(err)
	}
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func goEnv(t *testing.T, name string) string {
	t.Helper()
	out, err := exec.Command("go", "env", name).Output()
	if err != nil {
		t.Fatalf("go env %s: %v", name, err)
	}
	return strings.TrimSpace(string(out))
}

func resetDatabase(ctx context.Context, t *testing.T, url string) {
	t.Helper()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(cctx, url)
	if err != nil {
		t.Fatalf("the tour needs Postgres (DATABASE_URL, default %s): %v", defaultDatabaseURL, err)
	}
	defer conn.Close(ctx)
	for _, s := range tourSchemas {
		if _, err := conn.Exec(cctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{s}.Sanitize()+" CASCADE"); err != nil {
			t.Fatalf("drop schema %s: %v", s, err)
		}
	}
	for _, tbl := range tourTables {
		if _, err := conn.Exec(cctx, "DROP TABLE IF EXISTS "+pgx.Identifier{"public", tbl}.Sanitize()); err != nil {
			t.Fatalf("drop table public.%s: %v", tbl, err)
		}
	}
	for _, fn := range tourFunctions {
		if _, err := conn.Exec(cctx, "DROP FUNCTION IF EXISTS public."+fn); err != nil {
			t.Fatalf("drop function public.%s: %v", fn, err)
		}
	}
}

func resetRabbitMQ(t *testing.T, url string) {
	t.Helper()
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(10 * time.Second)})
	if err != nil {
		t.Fatalf("the tour needs RabbitMQ (AMQP_URL, default %s): %v", defaultAMQPURL, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	for _, q := range tourQueues {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			t.Fatalf("delete queue %s: %v", q, err)
		}
	}
	for _, x := range tourExchanges {
		if err := ch.ExchangeDelete(x, false, false); err != nil {
			t.Fatalf("delete exchange %s: %v", x, err)
		}
	}
}
