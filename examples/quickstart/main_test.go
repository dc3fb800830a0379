package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/testdb"
)

func TestQuickstartSummary(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.URL())
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-payments", "800", "-concurrency", "4"}, &out); err != nil {
		t.Fatalf("quickstart: %v\n%s", err, out.String())
	}
	for _, want := range []string{"duplicates skipped", "fingerprint-mismatch=2", "missing-id=3", "0 wrong", "OK: every payment applied exactly once"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
}

func TestQuickstartUnreachableDatabase(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	err := run(context.Background(), nil, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "cannot reach Postgres") || !strings.Contains(err.Error(), "DATABASE_URL") {
		t.Fatalf("got %v, want a clear unreachable-database error", err)
	}
}
