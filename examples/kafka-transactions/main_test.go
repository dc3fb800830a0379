package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemq/idemq/internal/testdb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}

// TestKafkaTransactionsExample runs the example on its in-process cluster.
func TestKafkaTransactionsExample(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.URL())
	t.Setenv("KAFKA_BROKERS", "")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out); err != nil {
		t.Fatalf("example: %v\n%s", err, out.String())
	}
	for _, want := range []string{"applied             40\n", "duplicates skipped  1\n", "aborted booked      0\n",
		"markers handled     0\n", "group lag           0\n", "OK: exactly the committed payments booked, each once"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
}
