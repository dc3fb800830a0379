package rabbitmq_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// TestDeadLetterTooLargeHeaders: RabbitMQ sends a message's properties in
// one frame, which must fit the connection's frame_max (131072 by default),
// and closes the whole connection (501 FRAME_ERROR) on one that does not. A
// message whose headers fit, but not with the dead letter's envelope
// headers added, is dead-lettered with its headers dropped and said so,
// and the Source's connection, which the dead letter goes out on, lives on.
func TestDeadLetterTooLargeHeaders(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	topo := rabbitmq.Topology{Queue: uniqueName(t)}
	deleteTopologyLater(t, topo)
	if err := rabbitmq.DeclareTopology(ctx, amqpURL(), topo); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, rabbitmq.Config{Queue: topo.Queue})
	pub := newPublisher(t, rabbitmq.PublisherConfig{})

	// 130,950 bytes of header: the original's properties frame fits, with
	// about 50 bytes to spare.
	big := &consumer.Message{ID: "big-1", Body: []byte("a body"),
		Headers: map[string]string{"trace": strings.Repeat("t", 130_950), "tenant": "acme"}}
	if err := pub.Publish(ctx, "", topo.Queue, big); err != nil {
		t.Fatalf("the broker refused the original: %v", err)
	}
	d := brokertest.Receive(ctx, t, src)
	if err := src.DeadLetterer().DeadLetter(ctx, d.Message(), consumer.Failure{Consumer: "c", MessageID: "big-1",
		Class: consumer.ClassPermanent, Err: errors.New("cannot parse")}); err != nil {
		t.Fatalf("DeadLetter: %v", err)
	}
	mustAck(ctx, t, d)
	if n := src.Stats().Reconnects; n != 0 {
		t.Errorf("the Source reconnected %d times: the dead letter broke its connection", n)
	}

	m := brokertest.Receive(ctx, t, dlqSource(t, rabbitmq.DLQName(topo.Queue))).Message()
	r, err := dlq.Parse(m)
	if err != nil {
		t.Fatal(err)
	}
	if r.Truncated != "headers" || r.MessageID != "big-1" || string(m.Body) != "a body" || r.Source != topo.Queue {
		t.Fatalf("dead letter %+v, body %q: want the whole body, its headers dropped and said so", r, m.Body)
	}
	if _, ok := m.Headers["trace"]; ok {
		t.Error("the dead letter kept the 130,950-byte header")
	}
	if m.Headers["tenant"] != "acme" {
		t.Errorf("the dead letter dropped the small header too: %v", m.Headers["tenant"])
	}
}

// TestPublishHeadersTooLarge: Publish refuses, without sending it, a
// message whose properties do not fit one frame, with a PublishError
// wrapping consumer.ErrMessageTooLarge; the connection stays up, and the
// other messages of the call and the next call go through.
func TestPublishHeadersTooLarge(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := uniqueName(t)
	declareQueue(t, q)
	pub := newPublisher(t, rabbitmq.PublisherConfig{})
	huge := &consumer.Message{ID: "huge-1", Body: []byte("b"), Headers: map[string]string{"h": strings.Repeat("h", 140_000)}}
	err := pub.Publish(ctx, "", q, huge)
	var pe *rabbitmq.PublishError
	if !errors.Is(err, consumer.ErrMessageTooLarge) || !errors.As(err, &pe) || pe.MessageID != "huge-1" {
		t.Fatalf("Publish: %v, want a PublishError wrapping consumer.ErrMessageTooLarge", err)
	}
	if err := pub.Publish(ctx, "", q, &consumer.Message{ID: "small-1", Body: []byte("b")}); err != nil {
		t.Fatalf("the next publish: %v", err)
	}

	// The bound is the broker's to the byte: properties of exactly
	// frame_max-8 = 131064 bytes go through (14 bytes of frame fields, the
	// table's 4, 7 for the header's name and type, 1 for the delivery
	// mode and 5 for the message id: 31 besides the value), one more byte
	// is refused before it is sent. Were the count short, the broker
	// would close the connection; were it long, the first would fail.
	edge := func(n int) *consumer.Message {
		return &consumer.Message{ID: "edge", Body: []byte("b"), Headers: map[string]string{"h": strings.Repeat("e", n)}}
	}
	if err := pub.Publish(ctx, "", q, edge(131064-31)); err != nil {
		t.Fatalf("properties of exactly 131064 bytes: %v", err)
	}
	if err := pub.Publish(ctx, "", q, edge(131064-31+1), &consumer.Message{ID: "after", Body: []byte("b")}); !errors.Is(err, consumer.ErrMessageTooLarge) ||
		!errors.As(err, &pe) || pe.Index != 0 || strings.Contains(err.Error(), "after") {
		t.Fatalf("properties of 131065 bytes: %v, want only message 0 refused, as too large", err)
	}
	if n := queueDepth(t, q); n != 3 {
		t.Fatalf("queue holds %d messages, want 3 (small-1, the edge, after)", n)
	}
}
