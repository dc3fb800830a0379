package rabbitmq_test

import (
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
)

// TestPublisherDropsANackedChannel: a channel the broker nacked on is not
// used again. RabbitMQ 3.10 kept nacking every publish on a confirm channel
// opened just before a quorum queue's leader node died, while a fresh
// channel on the same connection was acked at once (the cluster chaos
// scenario saw 7-8 s of nacks); here a queue that rejects publishes over
// its length makes the nack.
func TestPublisherDropsANackedChannel(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := uniqueName(t)
	if err := admin(t, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	deleteLater(t, q)
	pub := newPublisher(t, rabbitmq.PublisherConfig{Channels: 1})
	if err := pub.Publish(ctx, "", q, &consumer.Message{ID: "a", Body: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	if n := rabbitmq.PublisherIdle(pub); n != 1 {
		t.Fatalf("%d idle channels after an acked publish, want 1", n)
	}
	err := pub.Publish(ctx, "", q, &consumer.Message{ID: "b", Body: []byte("2")})
	if !errors.Is(err, rabbitmq.ErrNacked) {
		t.Fatalf("publish over the queue's length: %v, want ErrNacked", err)
	}
	if n := rabbitmq.PublisherIdle(pub); n != 0 {
		t.Fatalf("%d idle channels after a nack, want 0: the nacked channel is kept", n)
	}
}
