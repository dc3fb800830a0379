package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/testdb"
)

// TestWalkThrough runs the example and checks that README.md shows every
// line it prints.
func TestWalkThrough(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.URL())
	var out bytes.Buffer
	if err := run(context.Background(), &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if !strings.Contains(string(readme), line) {
			t.Errorf("README.md lacks the line %q", line)
		}
	}
}
