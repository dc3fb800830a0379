package rabbitmq_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/testlog"
)

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 10*time.Second)
	for _, tc := range []struct {
		name  string
		cfg   rabbitmq.Config
		field string
	}{
		{"empty queue", rabbitmq.Config{}, "Queue"},
		{"negative prefetch", rabbitmq.Config{Queue: "q", Prefetch: -1}, "Prefetch"},
		{"prefetch too large", rabbitmq.Config{Queue: "q", Prefetch: 70000}, "Prefetch"},
		{"topology of another queue", rabbitmq.Config{Queue: "q", Topology: &rabbitmq.Topology{Queue: "other"}}, "Topology.Queue"},
		{"invalid topology", rabbitmq.Config{Queue: "q", Topology: &rabbitmq.Topology{DeliveryLimit: 3}}, "Topology.DeliveryLimit"},
		{"topology dead-lettering to its queue", rabbitmq.Config{Queue: "q", Topology: &rabbitmq.Topology{DeadLetterQueue: "q"}}, "Topology.DeadLetterQueue"},
		{"dead letters to the queue", rabbitmq.Config{Queue: "q", DeadLetter: rabbitmq.DeadLetterConfig{Queue: "q"}}, "DeadLetter.Queue"},
		{"dead-letter queue too long", rabbitmq.Config{Queue: "q", DeadLetter: rabbitmq.DeadLetterConfig{Queue: strings.Repeat("d", 256)}}, "DeadLetter.Queue"},
		{"invalid dead-letter options", rabbitmq.Config{Queue: "q", DeadLetter: rabbitmq.DeadLetterConfig{Options: dlq.Options{MaxHistory: -1}}}, "DeadLetter.Options.MaxHistory"},
		{"negative reconnect", rabbitmq.Config{Queue: "q", Reconnect: rabbitmq.ReconnectConfig{InitialInterval: -1}}, "Reconnect"},
		{"max below initial", rabbitmq.Config{Queue: "q", Reconnect: rabbitmq.ReconnectConfig{InitialInterval: time.Second, MaxInterval: time.Millisecond}}, "Reconnect.MaxInterval"},
		{"bad url", rabbitmq.Config{Queue: "q", URL: "http://example.com"}, "URL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := rabbitmq.NewSource(ctx, tc.cfg)
			if err == nil {
				_ = s.Close()
				t.Fatal("NewSource accepted an invalid config")
			}
			var ce *consumer.ConfigError
			if !errors.Is(err, consumer.ErrInvalidConfig) || !errors.As(err, &ce) || ce.Field != tc.field {
				t.Fatalf("got %v, want a *consumer.ConfigError for field %s", err, tc.field)
			}
		})
	}

	t.Run("publisher", func(t *testing.T) {
		_, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{Channels: -1})
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != "Channels" {
			t.Fatalf("got %v, want a ConfigError for Channels", err)
		}
	})
	t.Run("missing queue", func(t *testing.T) {
		s, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL(), Queue: uniqueName(t)})
		if err == nil {
			_ = s.Close()
			t.Fatal("NewSource on a missing queue succeeded")
		}
		t.Logf("as expected: %v", err)
	})
}

func TestMessageMapping(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	ts := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	if err := admin(t, func(ch *amqp.Channel) error {
		return ch.PublishWithContext(ctx, "", q, false, false, amqp.Publishing{
			MessageId: "prop-id",
			Timestamp: ts,
			Headers: amqp.Table{
				"s":       "text",
				"i":       int32(42),
				"l":       int64(-7),
				"b":       true,
				"t":       ts,
				"bytes":   []byte("raw"),
				"my-id":   "header-id",
				keyHeader: "acct-1",
			},
			Body: []byte("payload"),
		})
	}); err != nil {
		t.Fatal(err)
	}

	src := newSource(t, rabbitmq.Config{Queue: q, ConsumerTag: "mapping-test"})
	d := brokertest.Receive(ctx, t, src)
	m := d.Message()
	check := func(what, got, want string) {
		t.Helper()
		if got != want {
			t.Errorf("%s: got %q, want %q", what, got, want)
		}
	}
	check("ID", m.ID, "prop-id")
	check("Key", m.Key, "acct-1")
	check("Body", string(m.Body), "payload")
	check("Source", m.Source, q)
	for k, want := range map[string]string{"s": "text", "i": "42", "l": "-7", "b": "true", "t": "2024-05-06T07:08:09Z", "bytes": "raw"} {
		check("header "+k, m.Header(k), want)
	}
	check("routing key", m.Metadata[rabbitmq.MetaRoutingKey], q)
	check("exchange", m.Metadata[rabbitmq.MetaExchange], "")
	check("delivery tag", m.Metadata[rabbitmq.MetaDeliveryTag], "1")
	check("consumer tag", m.Metadata[rabbitmq.MetaConsumerTag], "mapping-test")
	if m.Partition != -1 || m.Offset != -1 {
		t.Errorf("Partition, Offset: got %d, %d, want -1, -1", m.Partition, m.Offset)
	}
	if !m.Timestamp.Equal(ts) {
		t.Errorf("Timestamp: got %v, want %v", m.Timestamp, ts)
	}
	if m.Redelivered {
		t.Error("first delivery flagged Redelivered")
	}
	if err := d.Nack(ctx, true); err != nil {
		t.Fatal(err)
	}
	d = brokertest.Receive(ctx, t, src)
	if !d.Message().Redelivered {
		t.Error("delivery after a requeueing nack not flagged Redelivered")
	}
	// The id can come from a header instead, through the runtime's
	// MessageID: the header reaches Message.Headers as published.
	id, _ := consumer.IDFromHeader("my-id")(d.Message())
	check("ID from header", id, "header-id")
	mustAck(ctx, t, d)
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestPrefetchBound: with prefetch k and no acks, exactly k deliveries
// arrive; each ack lets one more through. The prefetch is 2×DefaultConcurrency
// without a runtime, twice the window Configure passes otherwise, and an
// explicit Prefetch wins over both; Configure returns the one in force.
func TestPrefetchBound(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	for _, tc := range []struct {
		name      string
		cfg       rabbitmq.Config
		configure *consumer.SourceSettings // nil: not called
		k         int
	}{
		{"default without a runtime", rabbitmq.Config{}, nil, rabbitmq.DefaultPrefetch},
		{"from the window", rabbitmq.Config{}, &consumer.SourceSettings{Window: 5}, 10},
		{"window of 0 keeps the default", rabbitmq.Config{}, &consumer.SourceSettings{}, rabbitmq.DefaultPrefetch},
		{"explicit", rabbitmq.Config{Prefetch: 3}, nil, 3},
		{"explicit wins over the window", rabbitmq.Config{Prefetch: 3}, &consumer.SourceSettings{Window: 5}, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			q := newQueue(t)
			pub := newPublisher(t, rabbitmq.PublisherConfig{})
			if err := pub.Publish(ctx, "", q, brokertest.NewMessages("pf", 30, 0)...); err != nil {
				t.Fatal(err)
			}
			cfg := tc.cfg
			cfg.Queue = q
			src := newSource(t, cfg)
			if tc.configure != nil {
				if w := src.Configure(*tc.configure); w != tc.k {
					t.Fatalf("Configure(%+v) = %d, want %d", *tc.configure, w, tc.k)
				}
			}
			if w := src.Window(); w != tc.k {
				t.Fatalf("Window() = %d, want %d", w, tc.k)
			}
			ds := brokertest.ReceiveN(ctx, t, src, tc.k)
			brokertest.ReceiveNone(ctx, t, src, 500*time.Millisecond)
			mustAck(ctx, t, ds[0])
			d := brokertest.Receive(ctx, t, src)
			brokertest.ReceiveNone(ctx, t, src, 300*time.Millisecond)
			mustAck(ctx, t, d)
			brokertest.AckAll(ctx, t, ds[1:])
		})
	}
}

// TestReconnectAfterConnectionCut cuts the TCP connection under a source
// with unacked deliveries: the source reconnects inside Receive, the old
// deliveries' acks fail with ErrDeliveryStale, and every message comes
// again and is acked on the new channel.
func TestReconnectAfterConnectionCut(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	q := newQueue(t)
	px := newProxy(t)
	const n = 10
	msgs := brokertest.NewMessages("cut", n, 0)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, msgs...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, rabbitmq.Config{
		URL:       px.URL(t),
		Queue:     q,
		Reconnect: rabbitmq.ReconnectConfig{InitialInterval: 10 * time.Millisecond, MaxInterval: 200 * time.Millisecond},
	})
	old := brokertest.ReceiveN(ctx, t, src, n/2)
	if c := px.Cut(); c == 0 {
		t.Fatal("proxy had no connection to cut")
	}
	// Until the client notices, an ack may still be written to the dead
	// socket and "succeed" (the broker redelivers regardless, and dedup
	// absorbs it). From then on, every ack of an old delivery must fail.
	waitFor(t, 10*time.Second, "the source to notice the cut", func() bool { return rabbitmq.SourceConnLost(src) })

	// Receive until every message has been acked on a live channel.
	acked := map[string]bool{}
	stale := 0
	for len(acked) < n {
		d := brokertest.Receive(ctx, t, src)
		body := string(d.Message().Body)
		err := d.Ack(ctx)
		switch {
		case err == nil:
			if acked[body] {
				t.Errorf("%q acked twice", body)
			}
			acked[body] = true
		case isStale(err):
			stale++ // a delivery from the dead channel
		default:
			t.Fatalf("ack %q: %v", body, err)
		}
	}
	for _, d := range old {
		err := d.Ack(ctx)
		if !isStale(err) {
			t.Errorf("ack of %q from the dead channel: got %v, want ErrDeliveryStale", d.Message().Body, err)
		}
	}
	st := src.Stats()
	t.Logf("stats: %+v; stale deliveries received after the cut: %d", st, stale)
	if st.Reconnects < 1 {
		t.Errorf("Reconnects = %d, want at least 1", st.Reconnects)
	}
	if want := int64(n/2 + stale); st.Abandoned != want {
		t.Errorf("Abandoned = %d, want %d", st.Abandoned, want)
	}
	if st.Acked != n {
		t.Errorf("Acked = %d, want %d", st.Acked, n)
	}
	brokertest.ReceiveNone(ctx, t, src, 500*time.Millisecond)
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	if d := queueDepth(t, q); d != 0 {
		t.Errorf("%d messages left in the queue", d)
	}
}

// TestChannelClosedByBroker: a 406 PRECONDITION_FAILED channel close, which
// is how the broker enforces consumer_timeout, is recovered like any other
// loss.
func TestChannelClosedByBroker(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	msgs := brokertest.NewMessages("406", 3, 0)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, msgs...); err != nil {
		t.Fatal(err)
	}
	log, logs := testlog.New(slog.LevelInfo)
	src := newSource(t, rabbitmq.Config{
		Queue:     q,
		Reconnect: rabbitmq.ReconnectConfig{InitialInterval: 10 * time.Millisecond},
	})
	src.Configure(consumer.SourceSettings{Logger: log}) // the runtime's logger
	first := brokertest.Receive(ctx, t, src)
	if err := rabbitmq.BreakChannel(src); err != nil {
		t.Fatal(err)
	}
	acked := map[string]bool{}
	for len(acked) < len(msgs) {
		d := brokertest.Receive(ctx, t, src)
		if err := d.Ack(ctx); err == nil {
			acked[string(d.Message().Body)] = true
		} else if !isStale(err) {
			t.Fatalf("ack: %v", err)
		}
	}
	if err := first.Ack(ctx); !isStale(err) {
		t.Errorf("ack from the closed channel: got %v, want ErrDeliveryStale", err)
	}
	if st := src.Stats(); st.Reconnects != 1 {
		t.Errorf("Reconnects = %d, want 1", st.Reconnects)
	}
	if !strings.Contains(logs.String(), "406") {
		t.Errorf("the 406 close was not logged:\n%s", logs.String())
	}
}

// TestCloseCancelsAndRequeues: Close with unacked deliveries returns them to
// the queue for the next consumer, and settling them afterwards reports
// ErrSourceClosed.
func TestCloseCancelsAndRequeues(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	msgs := brokertest.NewMessages("close", 4, 0)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, msgs...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, rabbitmq.Config{Queue: q})
	ds := brokertest.ReceiveN(ctx, t, src, 4)
	mustAck(ctx, t, ds[0])
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	if err := src.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for _, d := range ds[1:] {
		if err := d.Nack(ctx, true); !errors.Is(err, consumer.ErrSourceClosed) {
			t.Errorf("nack after Close: got %v, want ErrSourceClosed", err)
		}
	}
	if _, err := src.Receive(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("Receive after Close: got %v, want ErrSourceClosed", err)
	}
	waitFor(t, 10*time.Second, "3 requeued messages", func() bool { return queueDepth(t, q) == 3 })
	next := newSource(t, rabbitmq.Config{Queue: q})
	again := brokertest.ReceiveN(ctx, t, next, 3)
	for i, d := range again {
		if want := string(msgs[i+1].Body); string(d.Message().Body) != want || !d.Message().Redelivered {
			t.Errorf("requeued %d: got %q (redelivered %v), want %q redelivered", i, d.Message().Body, d.Message().Redelivered, want)
		}
	}
	brokertest.AckAll(ctx, t, again)
}

// TestReceiveWaitsForBroker: a source that lost its broker keeps retrying
// inside Receive until ctx is done, and Close interrupts it.
func TestReceiveWaitsForBroker(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	px := newProxy(t)
	src := newSource(t, rabbitmq.Config{URL: px.URL(t), Queue: q})
	_ = px.ln.Close() // no more connections through the proxy
	px.Cut()
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := src.Receive(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Receive with the broker unreachable: got %v, want DeadlineExceeded", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := src.Receive(ctx)
		done <- err
	}()
	if err := src.Close(); err != nil {
		t.Logf("close: %v", err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, consumer.ErrSourceClosed) {
			t.Fatalf("Receive interrupted by Close: got %v, want ErrSourceClosed", err)
		}
	case <-ctx.Done():
		t.Fatal("Close did not interrupt Receive")
	}
}
