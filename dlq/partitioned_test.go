package dlq_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// TestPartitionedStoreDryRunAndHorizon: the dry run and the replay-horizon
// guard find a mismatch's original on the partitioned store (converted
// from a plain table, the original in the generation before the first), and the replay
// applies nothing twice.
func TestPartitionedStoreDryRunAndHorizon(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	ctx := context.Background()
	part, err := processed.New(e.pool, processed.Config{Schema: e.store.Schema(), Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	e.publish(1)
	e.consume() // the original, applied on the plain table
	if err := part.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	e.store = part
	const id = "o-000"
	now := time.Now()
	m := dlq.Envelope(&consumer.Message{ID: id, Body: []byte(`{"order":"other"}`), Source: memQueue, Partition: -1, Offset: -1},
		consumer.Failure{Consumer: "billing", MessageID: id, Class: consumer.ClassFingerprintMismatch, Err: errors.New("mismatch"),
			FirstFailure: now, LastFailure: now, ProcessedAt: now.Add(-time.Hour)}, dlq.Options{})
	if err := e.broker.Publish(ctx, memDLQ, m); err != nil {
		t.Fatal(err)
	}
	c, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: part, Retention: edgeRetention})
	if err != nil {
		t.Fatal(err)
	}
	if c.BeyondHorizon != 0 || c.Mismatch != 1 {
		t.Fatalf("dry run: %+v", c)
	}
	c, err = dlq.Classify(ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: part, Retention: time.Nanosecond * 1000})
	if err != nil {
		t.Fatal(err)
	}
	if c.BeyondHorizon != 1 || !strings.Contains(c.Items[0].HorizonReason, "ago") {
		t.Fatalf("dry run with a tiny retention: %+v", c)
	}
	res := e.replay(func(c *dlq.ReplayConfig) { c.Retention = edgeRetention })
	if res.BeyondHorizon != 0 || res.Mismatched != 1 || res.Applied != 0 {
		t.Fatalf("replay: %+v", res)
	}
	if rows, _ := e.effectCount(); rows != 1 {
		t.Fatalf("%d effect rows, want 1", rows)
	}
}
