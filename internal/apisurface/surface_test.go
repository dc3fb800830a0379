package apisurface

import (
	"maps"
	"slices"
	"testing"
)

// budget is each public package's most exported top-level names. Raising
// one is a decision to make in review, with the new names' reason; the
// test fails when a package grows past it, or when one shrinks (lower the
// budget then, so that the room is not taken back unnoticed).
var budget = map[string]int{
	"brokers/brokertest":       12,
	"brokers/franz":            4,
	"brokers/kafka":            12,
	"brokers/memory":           10,
	"brokers/nats":             27,
	"brokers/rabbitmq":         26,
	"brokers/redisstream":      21,
	"consumer":                 50, // +ExecLater (a group's writes in one round trip), +ShardedStore and ClassUnroutable (issue 34)
	"consumer/dedup":           12, // +Route: a claim's shard
	"dlq":                      38,
	"httpidem":                 11,
	"idemqtest":                12,
	"keys":                     6,
	"observability/otel":       6,
	"observability/prometheus": 4,
	"outbox":                   18,
	"processed":                20, // +Sharded, NewSharded, OpenSharded, ShardedConfig, ShardMap, ErrShardMapChanged, ErrReshardUnfinished, MoveReport
}

// totalBudget is the most exported top-level names of all public packages
// together.
const totalBudget = 300

// TestSurfaceBudget counts the exported top-level names (functions, types,
// variables, constants; not methods or fields) of every public package
// and holds each to its budget.
func TestSurfaceBudget(t *testing.T) {
	dirs, err := Public("../..")
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, d := range dirs {
		names, err := Exported("../../" + d)
		if err != nil {
			t.Fatal(err)
		}
		total += len(names)
		b, ok := budget[d]
		switch {
		case !ok:
			t.Errorf("%s: a new public package with %d exported names has no budget", d, len(names))
		case len(names) > b:
			t.Errorf("%s: %d exported names, over its budget of %d: %v", d, len(names), b, names)
		case len(names) < b:
			t.Errorf("%s: %d exported names, under its budget of %d: lower the budget", d, len(names), b)
		}
	}
	for _, d := range slices.Sorted(maps.Keys(budget)) {
		if !slices.Contains(dirs, d) {
			t.Errorf("%s has a budget but is not a public package", d)
		}
	}
	if total > totalBudget {
		t.Errorf("%d exported names in all, over the budget of %d", total, totalBudget)
	}
	t.Logf("%d exported names in %d public packages (budget %d)", total, len(dirs), totalBudget)
}

// TestExportedCountsOnlyTopLevelNames checks the counter on this package.
func TestExportedCountsOnlyTopLevelNames(t *testing.T) {
	names, err := Exported(".")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"BrokenDocLinks", "ConfigTables", "Exported", "Public"}; !slices.Equal(names, want) {
		t.Errorf("names %v, want %v", names, want)
	}
}
