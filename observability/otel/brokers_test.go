package idemqotel_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkatest"
	idemqotel "github.com/idemq/idemq/observability/otel"
)

func amqpURL() string {
	if u := os.Getenv("IDEMQ_TEST_AMQP_URL"); u != "" {
		return u
	}
	return rabbitmq.DefaultURL
}

// checkRoundTrip checks the spans of a run over a real broker: ok applied
// and later skipped as a duplicate, flaky retried once, bad dead-lettered.
func checkRoundTrip(t *testing.T, tr *tracing, system, source string, s *seen, okSC, flakySC, badSC trace.SpanContext) {
	t.Helper()
	name := "process " + source
	p := tr.childrenOf(t, okSC, name, 1)[0]
	wantAttrs(t, p, map[string]any{
		"messaging.system": system, "messaging.destination.name": source, "messaging.message.id": "ok",
		"messaging.operation.type": "process", "messaging.consumer.group.name": "ledger",
	})
	if got := s.get("ok"); len(got) != 1 || got[0].TraceID() != okSC.TraceID() || got[0].SpanID() != p.SpanContext().SpanID() {
		t.Errorf("ok's handler ran with %v, want process span %v in the producer's trace", got, p.SpanContext())
	}
	event(t, tr.childrenOf(t, okSC, "duplicate "+source, 1)[0], "idemq.duplicate")

	tr.childrenOf(t, flakySC, name, 2)
	event(t, tr.childrenOf(t, flakySC, "retry "+source, 1)[0], "idemq.retry")

	if bp := tr.childrenOf(t, badSC, name, 1)[0]; bp.Status().Code != codes.Error {
		t.Errorf("bad's process span status %v", bp.Status())
	}
	event(t, tr.childrenOf(t, badSC, "dead_letter "+source, 1)[0], "idemq.dead_lettered")
}

// checkDLQCopy checks that the dead-letter copy carries the producer's
// context and the envelope.
func checkDLQCopy(t *testing.T, msg *consumer.Message, badSC trace.SpanContext) {
	t.Helper()
	sc := trace.SpanContextFromContext(idemqotel.Extract(context.Background(), msg))
	if sc.TraceID() != badSC.TraceID() || sc.SpanID() != badSC.SpanID() {
		t.Errorf("the DLQ copy carries %v, want the producer's %v (headers %v)", sc, badSC, msg.Headers)
	}
	rec, err := dlq.Parse(msg)
	if err != nil || rec.Class != consumer.ClassPermanent || rec.MessageID != "bad" {
		t.Errorf("DLQ envelope: %+v, %v", rec, err)
	}
}

// TestRabbitMQRoundTrip sends traced messages through a real RabbitMQ
// queue, consumes them with the runtime, and dead-letters one to a real
// dead-letter queue.
func TestRabbitMQRoundTrip(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	queue := randomName("idemq-oteltest")
	if err := rabbitmq.DeclareTopology(ctx, amqpURL(), rabbitmq.Topology{Queue: queue}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn, err := amqp.Dial(amqpURL())
		if err != nil {
			t.Errorf("cleanup: %v", err)
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("cleanup: %v", err)
			return
		}
		for _, q := range []string{queue, queue + ".dlq"} {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		}
		if err := ch.ExchangeDelete(queue+".dlx", false, false); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: amqpURL()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL(), Queue: queue})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return pub.Publish(ctx, "", queue+".dlq", m)
	}, dlq.Options{})
	if err != nil {
		t.Fatal(err)
	}

	tr := newTracing(t)
	tracing := idemqotel.New(idemqotel.Options{Consumer: "ledger", TracerProvider: tr.tp})
	var s seen
	rt, err := consumer.New(consumer.Config{
		Name: "ledger", Source: src, Store: migratedStore(t), Concurrency: 4, BatchSize: 1, // one handler call per delivery, one process span
		Handler: handler(&s), Middleware: []consumer.Middleware{tracing.Middleware()}, Hooks: []consumer.Hook{tracing},
		DeadLetterer:    dl,
		Retry:           consumer.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
		ShutdownTimeout: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, rt)

	ok, okSC := tr.produce(&consumer.Message{ID: "ok", Body: []byte("10")})
	flaky, flakySC := tr.produce(&consumer.Message{ID: "flaky", Body: []byte("20")})
	bad, badSC := tr.produce(&consumer.Message{ID: "bad", Body: []byte("30")})
	if err := pub.Publish(ctx, "", queue, ok, flaky, bad); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "2 applied, 1 dead-lettered", func() bool { s := rt.Stats(); return s.Applied == 2 && s.DeadLettered == 1 })
	if err := pub.Publish(ctx, "", queue, ok); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a duplicate", func() bool { return rt.Stats().Duplicates == 1 })
	stop()

	checkRoundTrip(t, tr, "rabbitmq", queue, &s, okSC, flakySC, badSC)
	p := tr.childrenOf(t, okSC, "process "+queue, 1)[0]
	wantAttrs(t, p, map[string]any{"messaging.rabbitmq.destination.routing_key": queue})

	b, err := rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{URL: amqpURL(), Queue: queue + ".dlq"})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if b.Depth() != 1 {
		t.Fatalf("DLQ depth %d, want 1", b.Depth())
	}
	d, err := b.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	checkDLQCopy(t, d.Message(), badSC)
}

// TestKafkaRoundTrip does the same through Kafka record headers, on an
// in-process kfake cluster reached over TCP by kafka-go.
func TestKafkaRoundTrip(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	c := kafkatest.Start(t)
	topic, dlqTopic := kafkatest.Name(t, "t"), kafkatest.Name(t, "dlq")
	c.CreateTopic(t, topic, 2)
	c.CreateTopic(t, dlqTopic, 1)
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: c.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	source := func(topic string) *kafka.Source {
		s, err := kafka.NewSource(kafka.Config{
			Brokers: c.Addrs(), Topic: topic, GroupID: kafkatest.Name(t, "g"),
			CommitInterval: 50 * time.Millisecond, SessionTimeout: 3 * time.Second,
			HeartbeatInterval: 100 * time.Millisecond, RebalanceTimeout: 5 * time.Second,
			DrainTimeout: time.Second, JoinGroupBackoff: 100 * time.Millisecond, FetchMaxWait: 100 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return pub.Publish(ctx, dlqTopic, m)
	}, dlq.Options{})
	if err != nil {
		t.Fatal(err)
	}

	tr := newTracing(t)
	tracing := idemqotel.New(idemqotel.Options{Consumer: "ledger", TracerProvider: tr.tp})
	var s seen
	rt, err := consumer.New(consumer.Config{
		Name: "ledger", Source: source(topic), Store: migratedStore(t), Concurrency: 4, BatchSize: 1, // one handler call per delivery, one process span
		Handler: handler(&s), Middleware: []consumer.Middleware{tracing.Middleware()}, Hooks: []consumer.Hook{tracing},
		DeadLetterer:    dl,
		Retry:           consumer.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
		ShutdownTimeout: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, rt)

	ok, okSC := tr.produce(&consumer.Message{ID: "ok", Key: "a", Body: []byte("10")})
	flaky, flakySC := tr.produce(&consumer.Message{ID: "flaky", Key: "b", Body: []byte("20")})
	bad, badSC := tr.produce(&consumer.Message{ID: "bad", Key: "c", Body: []byte("30")})
	if err := pub.Publish(ctx, topic, ok, flaky, bad); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "2 applied, 1 dead-lettered", func() bool { s := rt.Stats(); return s.Applied == 2 && s.DeadLettered == 1 })
	if err := pub.Publish(ctx, topic, ok); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a duplicate", func() bool { return rt.Stats().Duplicates == 1 })
	stop()

	checkRoundTrip(t, tr, "kafka", topic, &s, okSC, flakySC, badSC)
	p := tr.childrenOf(t, okSC, "process "+topic, 1)[0]
	part, hasPart := attr(p, "messaging.destination.partition.id")
	off, hasOff := attr(p, "messaging.kafka.offset")
	if n, err := strconv.Atoi(part.AsString()); !hasPart || !hasOff || err != nil || n < 0 || n > 1 || off.AsInt64() < 0 {
		t.Errorf("kafka process span: partition %v (%v), offset %v (%v)", part.AsString(), hasPart, off.AsInt64(), hasOff)
	}

	// Read the dead-letter copy back from its topic.
	dlqSrc := source(dlqTopic)
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()
	d, err := dlqSrc.Receive(rctx)
	if err != nil {
		t.Fatal(err)
	}
	checkDLQCopy(t, d.Message(), badSC)
	if err := d.Ack(ctx); err != nil {
		t.Error(err)
	}
}
