package rabbitmq_test

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
)

// TestPublishConfirmed: once Publish returns, every message is in the queue,
// persistent, with its id, headers and key; concurrent publishes are safe.
func TestPublishConfirmed(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	pub := newPublisher(t, rabbitmq.PublisherConfig{Channels: 2})
	const workers, per = 6, 25
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			msgs := brokertest.NewMessages(string(rune('a'+w)), per, 3)
			for _, m := range msgs {
				m.Timestamp = time.Unix(1700000000, 0)
			}
			errs <- pub.Publish(ctx, "", q, msgs...)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	// Confirmed means enqueued: no polling needed.
	if d := queueDepth(t, q); d != workers*per {
		t.Fatalf("queue holds %d messages right after the confirms, want %d", d, workers*per)
	}
	src := newSource(t, rabbitmq.Config{Queue: q})
	d := brokertest.Receive(ctx, t, src)
	m := d.Message()
	if m.ID == "" || m.Key == "" || m.Header(brokertest.HeaderSeq) == "" || !m.Timestamp.Equal(time.Unix(1700000000, 0)) {
		t.Errorf("message lost fields on the way: %+v", m)
	}
	mustAck(ctx, t, d)
}

// TestPublishUnroutable: with mandatory set, a message no queue receives is
// an ErrUnroutable error for exactly that message, not a silent drop; a
// missing exchange is an error too; the publisher keeps working after both.
func TestPublishUnroutable(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	pub := newPublisher(t, rabbitmq.PublisherConfig{Channels: 1})

	msgs := brokertest.NewMessages("lost", 3, 0)
	err := pub.Publish(ctx, "", uniqueName(t), msgs...)
	if !errors.Is(err, rabbitmq.ErrUnroutable) {
		t.Fatalf("publish to a queue that does not exist: got %v, want ErrUnroutable", err)
	}
	seen := map[int]bool{}
	for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
		var pe *rabbitmq.PublishError
		if !errors.As(e, &pe) || !errors.Is(pe, rabbitmq.ErrUnroutable) || pe.MessageID != msgs[pe.Index].ID {
			t.Errorf("unexpected error %v", e)
			continue
		}
		seen[pe.Index] = true
	}
	if len(seen) != 3 {
		t.Errorf("got errors for messages %v, want all 3", seen)
	}

	err = pub.Publish(ctx, uniqueName(t), "x", msgs[0])
	if err == nil || !errors.Is(err, rabbitmq.ErrUnconfirmed) {
		t.Fatalf("publish to a missing exchange: got %v, want ErrUnconfirmed", err)
	}
	t.Logf("missing exchange: %v", err)

	ok := brokertest.NewMessages("ok", 2, 0)
	if err := pub.Publish(ctx, "", q, ok...); err != nil {
		t.Fatalf("publish after failures: %v", err)
	}
	if d := queueDepth(t, q); d != 2 {
		t.Fatalf("queue holds %d messages, want 2", d)
	}
}

// TestPublisherReconnects: after its connection is cut, the publisher
// reconnects on the next Publish.
func TestPublisherReconnects(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	px := newProxy(t)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: px.URL(t)})
	if err := pub.Publish(ctx, "", q, brokertest.NewMessages("before", 1, 0)...); err != nil {
		t.Fatal(err)
	}
	px.Cut()
	waitFor(t, 10*time.Second, "the publisher to notice the cut", func() bool { return rabbitmq.PublisherConnClosed(pub) })
	if err := pub.Publish(ctx, "", q, brokertest.NewMessages("after", 1, 0)...); err != nil {
		t.Fatalf("publish after the cut: %v", err)
	}
	if d := queueDepth(t, q); d != 2 {
		t.Fatalf("queue holds %d messages, want 2", d)
	}
}

// TestPublisherReconnectsBeforeChannelsClose: amqp091 marks a dying
// connection closed before it closes its channels. A Publish in that
// moment must reconnect, not take an idle channel of the dead connection
// (CI saw "publish after the cut: ... channel lost").
func TestPublisherReconnectsBeforeChannelsClose(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL()})
	if err := pub.Publish(ctx, "", q, brokertest.NewMessages("before", 1, 0)...); err != nil {
		t.Fatal(err)
	}
	dead, live, err := rabbitmq.PublisherOnClosedConn(pub, amqpURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = live.Close() })
	if err := pub.Publish(ctx, "", q, brokertest.NewMessages("after", 1, 0)...); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if c := rabbitmq.PublisherConn(pub); c == dead || c.IsClosed() {
		t.Fatalf("the publisher published on an idle channel of its closed connection instead of reconnecting")
	}
	if d := queueDepth(t, q); d != 2 {
		t.Fatalf("queue holds %d messages, want 2", d)
	}
}

func TestPublisherClose(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	pub := newPublisher(t, rabbitmq.PublisherConfig{})
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pub.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	err := pub.Publish(ctx, "", "q", &consumer.Message{ID: "x"})
	if !errors.Is(err, rabbitmq.ErrPublisherClosed) {
		t.Fatalf("Publish after Close: got %v, want ErrPublisherClosed", err)
	}
	if err := pub.Publish(ctx, "", "q", nil); err == nil {
		t.Fatal("Publish accepted a nil message")
	}
}

func TestPublishRefusesOverlongFieldsAndKeepsWorking(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	pub := newPublisher(t, rabbitmq.PublisherConfig{})
	long := strings.Repeat("h", 256)
	err := pub.Publish(ctx, "", q, &consumer.Message{ID: "a", Headers: map[string]string{long: "v"}})
	if !errors.Is(err, rabbitmq.ErrTooLong) {
		t.Fatalf("over-long header name: %v", err)
	}
	if err := pub.Publish(ctx, "", long, &consumer.Message{ID: "b"}); !errors.Is(err, rabbitmq.ErrTooLong) {
		t.Fatalf("over-long routing key: %v", err)
	}
	// An id too long for message-id is published without it, and the
	// connection survives.
	longID := strings.Repeat("i", 300)
	if err := pub.Publish(ctx, "", q, &consumer.Message{ID: longID, Body: []byte("x"), Headers: map[string]string{"id": longID}}); err != nil {
		t.Fatalf("long id: %v", err)
	}
	if err := pub.Publish(ctx, "", q, &consumer.Message{ID: "short", Body: []byte("y")}); err != nil {
		t.Fatalf("publisher broken after a long id: %v", err)
	}
	src := newSource(t, rabbitmq.Config{Queue: q})
	d, err := src.Receive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// consumer.Config.MessageID reads a long id from its header.
	if id, _ := consumer.IDFromHeader("id")(d.Message()); id != longID {
		t.Fatalf("long id lost: %q", id)
	}
	mustAck(ctx, t, d)
}

// TestPublishNamesEveryUnconfirmedMessage: when the channel fails part way
// through a call (a missing exchange closes it), every message the broker
// did not confirm is named by a PublishError, those never sent included, so
// that a caller retrying only the named ones (the outbox relay) loses none.
func TestPublishNamesEveryUnconfirmedMessage(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	pub := newPublisher(t, rabbitmq.PublisherConfig{Channels: 1})
	const n = 2000
	msgs := brokertest.NewMessages("gone", n, 0)
	err := pub.Publish(ctx, uniqueName(t), "x", msgs...)
	if err == nil {
		t.Fatal("publish to a missing exchange succeeded")
	}
	seen := map[int]bool{}
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("error names no message: %v", err)
	}
	for _, e := range joined.Unwrap() {
		var pe *rabbitmq.PublishError
		if errors.As(e, &pe) {
			seen[pe.MessageIndex()] = true
		}
	}
	if len(seen) != n {
		t.Fatalf("errors name %d of the %d unconfirmed messages", len(seen), n)
	}
}
