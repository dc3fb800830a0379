package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testdb"
)

// TestMain runs main instead of the tests when the test binary is started
// by runMain, so tests can see main's output and exit status.
func TestMain(m *testing.M) {
	if os.Getenv("RABBITMQ_EXAMPLE_TEST_MAIN") == "1" {
		os.Args = append([]string{"rabbitmq"}, os.Args[1:]...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runMain runs the program with args and the environment plus env, and
// returns its exit status and output.
func runMain(t *testing.T, env []string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(append(os.Environ(), "RABBITMQ_EXAMPLE_TEST_MAIN=1"), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return cmd.ProcessState.ExitCode(), out.String(), errOut.String()
}

// secret is the password of the URLs below.
const secret = "hunter2Secret"

// deadPort returns a loopback port nothing listens on.
func deadPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return port
}

// amqpURL is the broker the tests use.
func amqpURL() string {
	if u := os.Getenv("IDEMQ_TEST_AMQP_URL"); u != "" {
		return u
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// TestRabbitMQExamplePasswordNeverPrinted runs the program with broker and
// database URLs that carry a password, unreachable, unparseable or refused:
// it fails with a clear error that does not contain the password.
func TestRabbitMQExamplePasswordNeverPrinted(t *testing.T) {
	port := deadPort(t)
	for _, c := range []struct {
		amqp, db, stderr string
	}{
		{"amqp://app:" + secret + "@127.0.0.1:" + port + "/", testdb.URL(), "cannot reach RabbitMQ at amqp://app:xxxxx@127.0.0.1:" + port + "/"},
		{"amqp://app:" + secret + "@127.0.0.1:notaport/", testdb.URL(), "invalid AMQP_URL: percent-encode reserved characters"},
		{"amqp://app:" + secret + "%zz@127.0.0.1:" + port + "/", testdb.URL(), "invalid AMQP_URL: percent-encode reserved characters"},
		{"amqp://guest:" + secret + "@127.0.0.1:5672/", testdb.URL(), "cannot reach RabbitMQ at amqp://guest:xxxxx@127.0.0.1:5672/"},
		{amqpURL(), "postgres://app:" + secret + "@127.0.0.1:" + port + "/test?connect_timeout=2", "cannot reach Postgres (start it, or set DATABASE_URL): "},
		{amqpURL(), "host=127.0.0.1 port=" + port + " user=app password=" + secret + " connect_timeout=2", "cannot reach Postgres (start it, or set DATABASE_URL): "},
		{amqpURL(), "postgres://app:" + secret + "@[::1/test", "invalid DATABASE_URL: check its syntax and parameters"},
	} {
		code, stdout, stderr := runMain(t, []string{"AMQP_URL=" + c.amqp, "DATABASE_URL=" + c.db})
		if code != 1 || !strings.Contains(stderr, c.stderr) {
			t.Errorf("AMQP_URL %s, DATABASE_URL %s: exit %d, stderr %q; want 1 and %q", c.amqp, c.db, code, stderr, c.stderr)
		}
		if strings.Contains(stdout+stderr, secret) {
			t.Errorf("the password leaked:\nstdout: %s\nstderr: %s", stdout, stderr)
		}
	}
}

// TestRabbitMQExampleHelp: -h and --help print the usage and exit 0; a bad
// flag exits 2.
func TestRabbitMQExampleHelp(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out.String(), "-payments") {
		t.Fatalf("run -h: %v\n%s", err, out.String())
	}
	for _, arg := range []string{"-h", "--help"} {
		code, stdout, stderr := runMain(t, nil, arg)
		if code != 0 || !strings.Contains(stdout, "Usage: go run ./examples/rabbitmq") || !strings.Contains(stdout, "-concurrency") || stderr != "" {
			t.Errorf("%s: exit %d\nstdout: %s\nstderr: %s", arg, code, stdout, stderr)
		}
	}
	if code, _, stderr := runMain(t, nil, "-nosuchflag"); code != 2 || !strings.Contains(stderr, "-nosuchflag") {
		t.Errorf("bad flag: exit %d, stderr %s", code, stderr)
	}
}

func TestRabbitMQExample(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.URL())
	if u := os.Getenv("IDEMQ_TEST_AMQP_URL"); u != "" {
		t.Setenv("AMQP_URL", u)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, []string{"-payments", "60", "-concurrency", "4"}, &out); err != nil {
		t.Fatalf("example: %v\n%s", err, out.String())
	}
	for _, want := range []string{
		`applied\s+60\n`,
		`duplicates skipped\s+12\n`,
		`dead-lettered\s+1\n`,
		`DLQ depth\s+1\s`,
		`1 x permanent: permanent: unknown account "acct-404"`,
		`balances match\s+true\s`,
		`OK: every payment applied exactly once`,
	} {
		if !regexp.MustCompile(want).MatchString(out.String()) {
			t.Errorf("summary lacks %s:\n%s", want, out.String())
		}
	}
}
