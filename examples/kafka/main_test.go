package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"regexp"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testdb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}

// TestKafkaExample runs the example on its in-process cluster (KAFKA_BROKERS
// unset), in batch mode and one transaction per order.
func TestKafkaExample(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.URL())
	t.Setenv("KAFKA_BROKERS", "")
	for _, batch := range []string{"16", "1"} {
		t.Run("batch="+batch, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			var out bytes.Buffer
			if err := run(ctx, []string{"-orders", "80", "-concurrency", "3", "-batch", batch}, &out); err != nil {
				t.Fatalf("example: %v\n%s", err, out.String())
			}
			for _, want := range []string{
				`in-process kfake, 3 partitions`,
				`applied\s+80\n`,
				`duplicates skipped\s+16\n`,
				`dead-lettered\s+1\n`,
				`uncommitted offsets\s+0\n`,
				`DLQ records\s+1\s`,
				`1 x permanent: permanent: unknown customer "cust-404"`,
				`bookings\s+80\s+\(80 distinct`,
				`totals match\s+true\s`,
				`OK: every order applied exactly once`,
			} {
				if !regexp.MustCompile(want).MatchString(out.String()) {
					t.Errorf("summary lacks %s:\n%s", want, out.String())
				}
			}
		})
	}
}

// TestKafkaExampleExternalCluster: with KAFKA_BROKERS set the example uses
// that cluster, here a kfake cluster of the test's own.
func TestKafkaExampleExternalCluster(t *testing.T) {
	c := kafkatest.Start(t)
	t.Setenv("DATABASE_URL", testdb.URL())
	t.Setenv("KAFKA_BROKERS", c.Addrs()[0])
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, []string{"-orders", "40"}, &out); err != nil {
		t.Fatalf("example: %v\n%s", err, out.String())
	}
	for _, want := range []string{`\(KAFKA_BROKERS, 3 partitions\)`, `applied\s+40\n`, `OK: every order applied exactly once`} {
		if !regexp.MustCompile(want).MatchString(out.String()) {
			t.Errorf("summary lacks %s:\n%s", want, out.String())
		}
	}
}

// TestKafkaExampleRedactsPasswords: a password in DATABASE_URL never
// reaches the example's errors, whether the URL cannot be parsed or the
// server cannot be reached.
func TestKafkaExampleRedactsPasswords(t *testing.T) {
	t.Setenv("KAFKA_BROKERS", "")
	for _, url := range []string{
		"postgres://app:hunter2pw@127.0.0.1:1/test?connect_timeout=1",
		"postgres://app:hunter2pw@127.0.0.1:1/test?sslmode=bogus",
		"host=127.0.0.1 port=1 user=app password=hunter2pw connect_timeout=1",
	} {
		t.Setenv("DATABASE_URL", url)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		var out bytes.Buffer
		err := run(ctx, []string{"-orders", "10"}, &out)
		cancel()
		if err == nil {
			t.Fatalf("%s: run succeeded against a closed port", redactedForTest(url))
		}
		if msg := err.Error() + out.String(); bytes.Contains([]byte(msg), []byte("hunter2pw")) {
			t.Fatalf("the password leaked: %s", msg)
		}
	}
}

func redactedForTest(s string) string {
	return regexp.MustCompile(`hunter2pw`).ReplaceAllString(s, "xxxxx")
}

// TestKafkaExampleHelp: -h prints the usage and is not a failure.
func TestKafkaExampleHelp(t *testing.T) {
	var out bytes.Buffer
	err := run(context.Background(), []string{"-h"}, &out)
	if !errors.Is(err, flag.ErrHelp) || !bytes.Contains(out.Bytes(), []byte("-orders")) {
		t.Fatalf("run -h = %v, output %q", err, out.String())
	}
}
