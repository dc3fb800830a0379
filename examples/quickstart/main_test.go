package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/testdb"
)

// TestMain runs main instead of the tests when the test binary is started
// by runMain, so tests can see main's output and exit status.
func TestMain(m *testing.M) {
	if os.Getenv("QUICKSTART_TEST_MAIN") == "1" {
		os.Args = append([]string{"quickstart"}, os.Args[1:]...)
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
	cmd.Env = append(append(os.Environ(), "QUICKSTART_TEST_MAIN=1"), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return cmd.ProcessState.ExitCode(), out.String(), errOut.String()
}

// quickstartSchemaOID returns the oid of the schema the quickstart uses by
// default, or 0 if it does not exist.
func quickstartSchemaOID(t *testing.T) uint32 {
	t.Helper()
	var oid uint32
	err := testdb.Pool(t).QueryRow(context.Background(), "SELECT oid FROM pg_namespace WHERE nspname = $1", defaultSchema).Scan(&oid)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatal(err)
	}
	return oid
}

// TestQuickstartSummary runs the quickstart in a schema of its own: running
// the tests never touches idemq_quickstart, so `idemq status` afterwards
// still shows the last real run.
func TestQuickstartSummary(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.URL())
	before := quickstartSchemaOID(t)
	schema := testdb.Schema(t)
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-payments", "800", "-concurrency", "4", "-schema", schema}, &out); err != nil {
		t.Fatalf("quickstart: %v\n%s", err, out.String())
	}
	for _, want := range []string{"duplicates skipped", "fingerprint-mismatch=2", "missing-id=3", "0 wrong", "OK: every payment applied exactly once"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
	var rows int
	if err := testdb.Pool(t).QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{schema, "processed_messages"}.Sanitize()).Scan(&rows); err != nil || rows == 0 {
		t.Errorf("%d dedup rows in %s, %v", rows, schema, err)
	}
	if after := quickstartSchemaOID(t); after != before {
		t.Errorf("the test recreated %s (oid %d, then %d)", defaultSchema, before, after)
	}
}

func TestQuickstartUnreachableDatabase(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	err := run(context.Background(), nil, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "cannot reach Postgres (start it, or set DATABASE_URL): ") || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("got %v, want a clear unreachable-database error", err)
	}
}

// secret is the password of the database URLs below.
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

// TestQuickstartPasswordNeverPrinted runs the program against unreachable
// and unparseable DATABASE_URLs that carry a password: it fails with a
// clear error that does not contain the password.
func TestQuickstartPasswordNeverPrinted(t *testing.T) {
	port := deadPort(t)
	for _, c := range []struct{ url, stderr string }{
		{"postgres://app:" + secret + "@127.0.0.1:" + port + "/test?connect_timeout=2", "cannot reach Postgres (start it, or set DATABASE_URL): "},
		{"postgres://app@127.0.0.1:" + port + "/test?sslpassword=" + secret + "&password=" + secret, "cannot reach Postgres (start it, or set DATABASE_URL): "},
		{"host=127.0.0.1 port=" + port + " user=app password='" + secret + "' connect_timeout=2", "cannot reach Postgres (start it, or set DATABASE_URL): "},
		{"postgres://app:" + secret + "@127.0.0.1:notaport/test", "invalid DATABASE_URL: check its syntax and parameters"},
		{"host=127.0.0.1 port=notaport user=app password=" + secret, "invalid DATABASE_URL: check its syntax and parameters"},
	} {
		code, stdout, stderr := runMain(t, []string{"DATABASE_URL=" + c.url})
		if code != 1 || !strings.Contains(stderr, c.stderr) {
			t.Errorf("DATABASE_URL %s: exit %d, stderr %q; want 1 and %q", c.url, code, stderr, c.stderr)
		}
		if strings.Contains(stdout+stderr, secret) {
			t.Errorf("the password leaked:\nstdout: %s\nstderr: %s", stdout, stderr)
		}
	}
}

// TestQuickstartHelp: -h and --help print the usage and exit 0; a bad flag
// exits 2.
func TestQuickstartHelp(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out.String(), "-schema") {
		t.Fatalf("run -h: %v\n%s", err, out.String())
	}
	for _, arg := range []string{"-h", "--help"} {
		code, stdout, stderr := runMain(t, nil, arg)
		if code != 0 || !strings.Contains(stdout, "Usage: go run ./examples/quickstart") || !strings.Contains(stdout, "-payments") || stderr != "" {
			t.Errorf("%s: exit %d\nstdout: %s\nstderr: %s", arg, code, stdout, stderr)
		}
	}
	if code, _, stderr := runMain(t, nil, "-nosuchflag"); code != 2 || !strings.Contains(stderr, "-nosuchflag") || !strings.Contains(stderr, "-h") {
		t.Errorf("bad flag: exit %d, stderr %s", code, stderr)
	}
}
