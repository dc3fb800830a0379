package apisurface

import (
	"flag"
	"os"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite docs/configuration.md's tables from the doc comments")

// The markers around the generated part of docs/configuration.md.
const (
	beginTables = "<!-- tables: generated from the doc comments by `go test ./internal/apisurface -update`; do not edit -->"
	endTables   = "<!-- end of tables -->"
)

// TestConfigurationGuide: docs/configuration.md's tables are the
// rendering of the Config and Options structs' doc comments, so that each
// default is said once, in the code, and the guide cannot drift from it.
func TestConfigurationGuide(t *testing.T) {
	const file = "../../docs/configuration.md"
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i, j := strings.Index(doc, beginTables), strings.Index(doc, endTables)
	if i < 0 || j < i {
		t.Fatalf("%s: the markers %q and %q are missing", file, beginTables, endTables)
	}
	tables, err := ConfigTables("../..")
	if err != nil {
		t.Fatal(err)
	}
	want := doc[:i] + beginTables + "\n\n" + tables + endTables + doc[j+len(endTables):]
	if want == doc {
		return
	}
	if *update {
		if err := os.WriteFile(file, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Errorf("%s's tables differ from the doc comments: run go test ./internal/apisurface -update", file)
}

// TestDefaultOf reads the default from a doc comment's sentences.
func TestDefaultOf(t *testing.T) {
	for doc, want := range map[string]string{
		"Concurrency is the number of messages (or batches). Defaults to 8. Keys are ordered.": "Defaults to 8.",
		"Queue is the queue to consume. Required.":                                             "—",
		"Wait is how long (e.g. 5s. or so) to wait. Defaults to 1s.":                           "Defaults to 1s.",
	} {
		if got := defaultOf(doc); got != want {
			t.Errorf("defaultOf(%q) = %q, want %q", doc, got, want)
		}
	}
}
