package rabbitmq_test

import (
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
)

// TestRedeliveryHorizon: the horizon is unknown until the backlog found at
// the first Receive is received and settled; then it is the receipt of the
// oldest unsettled delivery, or zero when none is.
func TestRedeliveryHorizon(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	pub := newPublisher(t, rabbitmq.PublisherConfig{})
	for _, id := range []string{"b1", "b2", "b3"} {
		if err := pub.Publish(ctx, "", q, &consumer.Message{ID: id, Body: []byte(id)}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "the backlog in the queue", func() bool { return queueDepth(t, q) == 3 })
	src := newSource(t, rabbitmq.Config{Queue: q, Prefetch: 10})
	horizon := func() (time.Time, bool) {
		t.Helper()
		h, ok, err := src.RedeliveryHorizon(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return h, ok
	}
	if _, ok := horizon(); ok {
		t.Fatal("known before the first Receive")
	}
	var backlog []consumer.Delivery
	for range 3 {
		d, err := src.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		backlog = append(backlog, d)
		if _, ok := horizon(); ok {
			t.Fatalf("known with %d of the backlog received, unsettled", len(backlog))
		}
	}
	for _, d := range backlog[:2] {
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := horizon(); ok {
		t.Fatal("known with part of the backlog unsettled")
	}
	if err := backlog[2].Ack(ctx); err != nil {
		t.Fatal(err)
	}
	if h, ok := horizon(); !ok || !h.IsZero() {
		t.Fatalf("backlog settled: %v, %v; want zero, true", h, ok)
	}
	before := time.Now()
	if err := pub.Publish(ctx, "", q, &consumer.Message{ID: "n1", Body: []byte("n1")}); err != nil {
		t.Fatal(err)
	}
	d, err := src.Receive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if h, ok := horizon(); !ok || h.Before(before) || h.After(time.Now()) {
		t.Fatalf("one delivery unsettled: %v, %v; want its receipt", h, ok)
	}
	if err := d.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	if h, ok := horizon(); !ok || !h.IsZero() {
		t.Fatalf("all settled: %v, %v", h, ok)
	}
}
