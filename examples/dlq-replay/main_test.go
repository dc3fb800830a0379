package main

import (
	"bytes"
	"context"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/testdb"
)

// TestWalkThrough runs the walk-through and checks its output, and that
// README.md shows that output.
func TestWalkThrough(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.URL())
	var out bytes.Buffer
	if err := run(context.Background(), &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, want := range []string{"12 dead-lettered", "1 group, still 12 in the DLQ",
		`12 × permanent from orders (consumer shop): permanent: parse order <id>: unknown currency "<q>" (handler bug)`,
		`e.g. permanent: parse order order-0`, "11 will apply, 1 already applied", "1 unverified",
		"applied 11, skipped 1", "left 1 unverified", "applied 0, skipped 12", "OK:"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}

	// The README shows every line the program prints, in the same words.
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	// The sample text names whichever order was dead-lettered first.
	shown := sampleOrder.ReplaceAllString(string(readme), "${1}NN")
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if line = sampleOrder.ReplaceAllString(line, "${1}NN"); !strings.Contains(shown, line) {
			t.Errorf("README.md lacks the line %q", line)
		}
	}
}

var sampleOrder = regexp.MustCompile(`(e\.g\. permanent: parse order order-0)\d\d`)

// TestHelp: -h and --help print the usage and exit 0 without running the
// walk-through; a flag or an argument it does not take exits 2.
func TestHelp(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none") // never reached
	for _, tc := range []struct {
		args           []string
		code           int
		stdout, stderr string
	}{
		{[]string{"-h"}, 0, "Usage: go run ./examples/dlq-replay", ""},
		{[]string{"--help"}, 0, "seven steps", ""},
		{[]string{"-help"}, 0, "DATABASE_URL", ""},
		{[]string{"-v"}, 2, "", "flag provided but not defined: -v"},
		{[]string{"now"}, 2, "", `unexpected argument "now"`},
	} {
		var out, errOut bytes.Buffer
		code := cli(tc.args, &out, &errOut)
		if code != tc.code || !strings.Contains(out.String(), tc.stdout) || !strings.Contains(errOut.String(), tc.stderr) ||
			strings.Contains(out.String(), "1. fail") || (tc.code == 0 && errOut.Len() > 0) || (tc.code != 0 && out.Len() > 0) {
			t.Errorf("%v: exit %d\nstdout: %s\nstderr: %s\nwant exit %d, stdout with %q, stderr with %q",
				tc.args, code, out.String(), errOut.String(), tc.code, tc.stdout, tc.stderr)
		}
	}
}
