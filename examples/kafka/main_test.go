package main

import (
	"bytes"
	"context"
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
