package main

import (
	"bytes"
	"context"
	"os"
	"regexp"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testdb"
)

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
