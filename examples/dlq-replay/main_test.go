package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/testdb"
)

func TestWalkThrough(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.URL())
	var out bytes.Buffer
	if err := run(context.Background(), &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, want := range []string{"12 dead-lettered", "11 will apply, 1 already applied", "1 unverified", "applied 11, skipped 1", "left 1 unverified", "applied 0, skipped 12", "OK:"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}
