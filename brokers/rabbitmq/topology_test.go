package rabbitmq_test

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
)

func TestTopologyValidation(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 10*time.Second)
	for _, tc := range []struct {
		name  string
		topo  rabbitmq.Topology
		field string
	}{
		{"empty queue", rabbitmq.Topology{}, "Queue"},
		{"delivery limit on classic", rabbitmq.Topology{Queue: "q", DeliveryLimit: 3}, "DeliveryLimit"},
		{"negative delivery limit", rabbitmq.Topology{Queue: "q", Quorum: true, DeliveryLimit: -1}, "DeliveryLimit"},
		{"dlq is the queue", rabbitmq.Topology{Queue: "q", DeadLetterQueue: "q"}, "DeadLetterQueue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := rabbitmq.DeclareTopology(ctx, amqpURL(), tc.topo)
			var ce *consumer.ConfigError
			if !errors.Is(err, consumer.ErrInvalidConfig) || !errors.As(err, &ce) || ce.Field != tc.field {
				t.Fatalf("got %v, want a ConfigError for %s", err, tc.field)
			}
		})
	}
}

func deleteTopologyLater(t *testing.T, topo rabbitmq.Topology) {
	deleteLater(t, topo.Queue, topo.Queue+".dlq")
	t.Cleanup(func() {
		_ = admin(t, func(ch *amqp.Channel) error { return ch.ExchangeDelete(topo.Queue+".dlx", false, false) })
	})
}

// TestTopologyClassic: a message rejected without requeue lands in the DLQ.
func TestTopologyClassic(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	topo := rabbitmq.Topology{Queue: uniqueName(t)}
	deleteTopologyLater(t, topo)
	if err := rabbitmq.DeclareTopology(ctx, amqpURL(), topo); err != nil {
		t.Fatal(err)
	}
	if err := rabbitmq.DeclareTopology(ctx, amqpURL(), topo); err != nil {
		t.Fatalf("declaring again: %v", err)
	}
	msgs := brokertest.NewMessages("dl", 1, 0)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", topo.Queue, msgs...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, rabbitmq.Config{Queue: topo.Queue})
	if err := brokertest.Receive(ctx, t, src).Nack(ctx, false); err != nil {
		t.Fatal(err)
	}
	dlq := dlqSource(t, topo.Queue+".dlq")
	d := brokertest.Receive(ctx, t, dlq)
	if d.Message().ID != msgs[0].ID || d.Message().Header("x-first-death-reason") != "rejected" {
		t.Errorf("dead-lettered message: got id %q, headers %v", d.Message().ID, d.Message().Headers)
	}
	mustAck(ctx, t, d)
}

// TestTopologyQuorum: a quorum queue with a delivery limit dead-letters a
// message that keeps being requeued.
func TestTopologyQuorum(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	topo := rabbitmq.Topology{Queue: uniqueName(t), Quorum: true, DeliveryLimit: 1}
	deleteTopologyLater(t, topo)
	if err := rabbitmq.DeclareTopology(ctx, amqpURL(), topo); err != nil {
		t.Fatal(err)
	}
	// It really is a quorum queue: redeclaring it as classic is refused.
	if err := rabbitmq.DeclareTopology(ctx, amqpURL(), rabbitmq.Topology{Queue: topo.Queue}); err == nil {
		t.Error("redeclaring the quorum queue as classic succeeded")
	}
	msgs := brokertest.NewMessages("limit", 1, 0)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", topo.Queue, msgs...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, rabbitmq.Config{Queue: topo.Queue})
	dlq := dlqSource(t, topo.Queue+".dlq")
	// Requeue until the broker gives up on the message.
	deliveries := 0
	for {
		short, cancel := context.WithTimeout(ctx, time.Second)
		d, err := src.Receive(short)
		cancel()
		if errors.Is(err, context.DeadlineExceeded) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		deliveries++
		if deliveries > 5 {
			t.Fatalf("message still delivered after %d requeues", deliveries)
		}
		if err := d.Nack(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("delivered %d times before dead-lettering", deliveries)
	if deliveries != topo.DeliveryLimit+1 {
		t.Errorf("delivered %d times, want %d (the first delivery plus DeliveryLimit redeliveries)", deliveries, topo.DeliveryLimit+1)
	}
	d := brokertest.Receive(ctx, t, dlq)
	if d.Message().ID != msgs[0].ID {
		t.Errorf("dead-lettered message: got id %q", d.Message().ID)
	}
	mustAck(ctx, t, d)
}
