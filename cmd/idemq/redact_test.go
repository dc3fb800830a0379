package main

import (
	"net"
	"strconv"
	"strings"
	"testing"
)

// secret is the password every hostile URL below carries. It must never be
// printed.
const secret = "hunter2Secret"

// deadPort returns a loopback port nothing listens on: it is bound, then
// released, so a connection to it is refused at once.
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

// noSecret fails the test if r printed the password anywhere.
func noSecret(t *testing.T, r result) {
	t.Helper()
	if strings.Contains(r.stdout, secret) || strings.Contains(r.stderr, secret) {
		t.Fatalf("the password leaked:\nstdout: %s\nstderr: %s", r.stdout, r.stderr)
	}
}

// TestDatabaseURLPasswordNeverPrinted runs the database commands with
// URLs and DSNs that carry a password, against a port nothing listens on
// and in shapes pgx cannot parse: each fails with a clear error, and none
// prints the password.
func TestDatabaseURLPasswordNeverPrinted(t *testing.T) {
	port := deadPort(t)
	cases := []struct {
		name, url, stderr string
	}{
		{"url unreachable", "postgres://app:" + secret + "@127.0.0.1:" + port + "/test?sslmode=disable&connect_timeout=5", "cannot connect to Postgres at postgres://app:xxxxx@127.0.0.1:" + port},
		{"postgresql scheme", "postgresql://app:" + secret + "@127.0.0.1:" + port + "/test?sslmode=disable", "cannot connect to Postgres"},
		{"password in query", "postgres://app@127.0.0.1:" + port + "/test?sslmode=disable&password=" + secret, "cannot connect to Postgres"},
		{"keyword/value DSN", "host=127.0.0.1 port=" + port + " user=app password=" + secret + " dbname=test sslmode=disable", "cannot connect to Postgres at (the DSN)"},
		{"quoted keyword/value DSN", "host=127.0.0.1 port=" + port + " user=app password='" + secret + "' dbname=test sslmode=disable", "cannot connect to Postgres at (the DSN)"},
		{"url bad port", "postgres://app:" + secret + "@127.0.0.1:notaport/test", "invalid database URL"},
		{"url bad escape", "postgres://app:" + secret + "%zz@127.0.0.1:" + port + "/test", "invalid database URL"},
		{"url bad host", "postgres://app:" + secret + "@[::1/test", "invalid database URL"},
		{"dsn bad port", "host=127.0.0.1 port=notaport user=app password=" + secret, "invalid database URL"},
		{"dsn spaces around =", "host=127.0.0.1 port=notaport user=app password = " + secret, "invalid database URL"},
		{"dsn unterminated quote", "host=127.0.0.1 user=app password='" + secret, "invalid database URL"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for _, args := range [][]string{
				{"migrate", "--database-url", c.url},
				{"processed", "show", "--database-url", c.url, "ledger", "id-1"},
				{"processed", "purge", "--database-url", c.url, "--all-consumers", "--older-than", "72h"},
			} {
				r := idemq(t, args...)
				noSecret(t, r)
				want(t, r, exitFail, "", c.stderr)
			}
		})
	}
}

// TestDatabaseURLFromEnvironmentNeverPrinted: the same for DATABASE_URL.
func TestDatabaseURLFromEnvironmentNeverPrinted(t *testing.T) {
	url := "postgres://app:" + secret + "@127.0.0.1:" + deadPort(t) + "/test?sslmode=disable"
	t.Setenv("DATABASE_URL", url)
	r := idemq(t, "migrate")
	noSecret(t, r)
	want(t, r, exitFail, "", "URL from DATABASE_URL")
}

// TestAMQPURLPasswordNeverPrinted runs the dlq commands with AMQP URLs that
// carry a password: a port nothing listens on, unparseable URLs, and the
// real broker refusing the credentials.
func TestAMQPURLPasswordNeverPrinted(t *testing.T) {
	port := deadPort(t)
	cases := []struct {
		name, url, stderr string
	}{
		{"unreachable", "amqp://app:" + secret + "@127.0.0.1:" + port + "/", "rabbitmq: dial amqp://app:xxxxx@127.0.0.1:" + port},
		{"bad port", "amqp://app:" + secret + "@127.0.0.1:notaport/", "URL"},
		{"bad escape", "amqp://app:" + secret + "%zz@127.0.0.1:" + port + "/", "URL"},
		{"bad host", "amqp://app:" + secret + "@[::1/", "URL"},
		{"wrong password", "amqp://guest:" + secret + "@127.0.0.1:5672/", "rabbitmq: dial amqp://guest:xxxxx@127.0.0.1:5672/"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for _, args := range [][]string{
				{"dlq", "inspect", "--queue", "some.dlq", "--amqp-url", c.url},
				{"dlq", "replay", "--queue", "some.dlq", "--dry-run", "--amqp-url", c.url},
			} {
				r := idemq(t, args...)
				noSecret(t, r)
				want(t, r, exitFail, "", c.stderr)
			}
		})
	}
	t.Run("from AMQP_URL", func(t *testing.T) {
		t.Setenv("AMQP_URL", "amqp://app:"+secret+"@127.0.0.1:"+port+"/")
		r := idemq(t, "dlq", "inspect", "--queue", "some.dlq")
		noSecret(t, r)
		want(t, r, exitFail, "", "rabbitmq: dial")
	})
}
