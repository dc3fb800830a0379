package rabbitmq_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testlog"
)

// TestNoConsumeBeforeReceive: NewSource connects but does not consume, so a
// message published afterwards stays ready in the queue, and another
// consumer can take it, until the first Receive; dead-lettering before then
// does not start the consumer either.
func TestNoConsumeBeforeReceive(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	src := newSource(t, rabbitmq.Config{Queue: q})
	pub := newPublisher(t, rabbitmq.PublisherConfig{})
	msgs := brokertest.NewMessages("lazy", 2, 0)
	if err := pub.Publish(ctx, "", q, msgs[0]); err != nil {
		t.Fatal(err)
	}
	f := consumer.Failure{Consumer: "c", MessageID: "x", Class: consumer.ClassPermanent, Err: errors.New("bad")}
	if err := src.DeadLetterer().DeadLetter(ctx, &consumer.Message{ID: "x", Body: []byte("x")}, f); err != nil {
		t.Fatal(err)
	}
	if d := queueDepth(t, rabbitmq.DLQName(q)); d != 1 {
		t.Errorf("%d dead letters, want 1", d)
	}
	// Long enough for a consumer, had one been started, to be pushed the
	// message.
	time.Sleep(300 * time.Millisecond)
	if m, c := queueState(t, q); m != 1 || c != 0 {
		t.Fatalf("before the first Receive: %d ready messages and %d consumers, want 1 and 0", m, c)
	}
	// Another connection can take it with basic.get.
	if err := admin(t, func(ch *amqp.Channel) error {
		d, ok, err := ch.Get(q, true)
		if err != nil {
			return err
		}
		if !ok || d.MessageId != msgs[0].ID {
			t.Errorf("basic.get: ok %v, id %q; want %q", ok, d.MessageId, msgs[0].ID)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	if err := pub.Publish(ctx, "", q, msgs[1]); err != nil {
		t.Fatal(err)
	}
	d := brokertest.Receive(ctx, t, src)
	if d.Message().ID != msgs[1].ID {
		t.Errorf("received %q, want %q", d.Message().ID, msgs[1].ID)
	}
	if _, c := queueState(t, q); c != 1 {
		t.Errorf("%d consumers after the first Receive, want 1", c)
	}
	mustAck(ctx, t, d)
}

// TestNoConsumeBeforeReceiveAcrossReconnect: a dead letter published after
// the connection was lost, before the first Receive, reconnects the Source
// without starting its consumer; the first Receive then consumes on that
// connection.
func TestNoConsumeBeforeReceiveAcrossReconnect(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	px := newProxy(t)
	src := newSource(t, rabbitmq.Config{
		URL:       px.URL(t),
		Queue:     q,
		Reconnect: rabbitmq.ReconnectConfig{InitialInterval: 10 * time.Millisecond, MaxInterval: 100 * time.Millisecond},
	})
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, brokertest.NewMessages("rc", 1, 0)...); err != nil {
		t.Fatal(err)
	}
	px.Cut()
	waitFor(t, 10*time.Second, "the source to notice the cut", func() bool { return rabbitmq.SourceConnLost(src) })
	f := consumer.Failure{Consumer: "c", MessageID: "x", Class: consumer.ClassPermanent, Err: errors.New("bad")}
	if err := src.DeadLetterer().DeadLetter(ctx, &consumer.Message{ID: "x", Body: []byte("x")}, f); err != nil {
		t.Fatal(err)
	}
	if st := src.Stats(); st.Reconnects != 1 {
		t.Errorf("Reconnects = %d, want 1", st.Reconnects)
	}
	time.Sleep(300 * time.Millisecond)
	if m, c := queueState(t, q); m != 1 || c != 0 {
		t.Fatalf("after a dead letter reconnected: %d ready messages and %d consumers, want 1 and 0", m, c)
	}
	mustAck(ctx, t, brokertest.Receive(ctx, t, src))
	if n := px.Accepted(); n != 2 {
		t.Errorf("%d connections through the proxy, want 2: the first Receive consumes on the dead letter's connection", n)
	}
}

// TestConfigureAfterReceive: once the first Receive started the consumer,
// Configure changes nothing and returns the prefetch in force; calling it
// while Receive runs is race-free.
func TestConfigureAfterReceive(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, brokertest.NewMessages("late", 20, 0)...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, rabbitmq.Config{Queue: q})
	log, _ := testlog.New(slog.LevelDebug)
	var wg sync.WaitGroup
	start := make(chan struct{})
	wg.Go(func() {
		<-start
		for i := 0; i < 100; i++ {
			src.Configure(consumer.SourceSettings{Window: 1 + i%3, Logger: log})
		}
	})
	close(start)
	ds := brokertest.ReceiveN(ctx, t, src, 2)
	wg.Wait()
	w := src.Window()
	if w != rabbitmq.DefaultPrefetch && w != 2 && w != 4 && w != 6 {
		t.Fatalf("Window() = %d", w)
	}
	if got := src.Configure(consumer.SourceSettings{Window: 100}); got != w {
		t.Errorf("Configure after Receive = %d, want the prefetch in force, %d", got, w)
	}
	if got := src.Window(); got != w {
		t.Errorf("Configure after Receive changed the prefetch from %d to %d", w, got)
	}
	// The broker holds the prefetch that was in force at the first
	// Receive: w deliveries, no more.
	ds = append(ds, brokertest.ReceiveN(ctx, t, src, w-2)...)
	brokertest.ReceiveNone(ctx, t, src, 300*time.Millisecond)
	brokertest.AckAll(ctx, t, ds)
}

// TestConfigTopology: NewSource declares Config.Topology (idempotently, so
// a second Source with the same topology is fine), and the dead-letterer
// sends to the topology's own DeadLetterQueue without its being restated.
func TestConfigTopology(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := uniqueName(t)
	failed := q + ".failed"
	deleteLater(t, q, failed)
	t.Cleanup(func() {
		_ = admin(t, func(ch *amqp.Channel) error { return ch.ExchangeDelete(q+".dlx", false, false) })
	})
	topo := &rabbitmq.Topology{DeadLetterQueue: failed}
	src := newSource(t, rabbitmq.Config{Queue: q, Topology: topo})
	if topo.Queue != "" {
		t.Errorf("NewSource modified the caller's Topology: Queue %q", topo.Queue)
	}
	again := newSource(t, rabbitmq.Config{Queue: q, Topology: &rabbitmq.Topology{Queue: q, DeadLetterQueue: failed}})
	if err := again.Close(); err != nil {
		t.Fatal(err)
	}

	msg := brokertest.NewMessages("topo", 1, 0)[0]
	f := consumer.Failure{Consumer: "c", MessageID: msg.ID, Class: consumer.ClassPermanent, Err: errors.New("bad")}
	if err := src.DeadLetterer().DeadLetter(ctx, msg, f); err != nil {
		t.Fatal(err)
	}
	if d := queueDepth(t, failed); d != 1 {
		t.Errorf("%d messages in the topology's dead-letter queue %s, want 1", d, failed)
	}
	// The work queue was declared with the topology's dead-letter
	// exchange: a message the broker dead-letters lands there too.
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, msg); err != nil {
		t.Fatal(err)
	}
	d := brokertest.Receive(ctx, t, src)
	if err := d.Nack(ctx, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the broker's dead letter", func() bool { return queueDepth(t, failed) == 2 })
	if err := admin(t, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclarePassive(rabbitmq.DLQName(q), true, false, false, false, nil)
		return err
	}); err == nil {
		t.Errorf("%s exists: the topology named another dead-letter queue", rabbitmq.DLQName(q))
	}

	// A topology that conflicts with the queue as it exists fails
	// NewSource.
	if _, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL(), Queue: q, Topology: &rabbitmq.Topology{Quorum: true, DeadLetterQueue: failed}}); err == nil {
		t.Error("NewSource with a topology conflicting with the declared queue: nil error")
	} else {
		t.Logf("as expected: %v", err)
	}
}

// TestLoggerFromConfigure: a Source logs to the logger Configure passes,
// with its queue attribute.
func TestLoggerFromConfigure(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	{
		q := newQueue(t)
		if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, brokertest.NewMessages("log", 1, 0)...); err != nil {
			t.Fatal(err)
		}
		runtimeLog, runtimeLogs := testlog.New(slog.LevelInfo)
		src := newSource(t, rabbitmq.Config{Queue: q, Reconnect: rabbitmq.ReconnectConfig{InitialInterval: 10 * time.Millisecond}})
		src.Configure(consumer.SourceSettings{Window: 1, Logger: runtimeLog})
		first := brokertest.Receive(ctx, t, src)
		if err := rabbitmq.BreakChannel(src); err != nil {
			t.Fatal(err)
		}
		mustAck(ctx, t, brokertest.Receive(ctx, t, src)) // the redelivery, on the new channel
		if err := first.Ack(ctx); !isStale(err) {
			t.Errorf("ack from the broken channel: %v, want ErrDeliveryStale", err)
		}
		if out := runtimeLogs.String(); !strings.Contains(out, "consumer lost") || !strings.Contains(out, "406") || !strings.Contains(out, "queue="+q) {
			t.Errorf("the lost channel was not logged, with the queue, to the runtime's logger:\n%s", out)
		}
	}
}

// TestRuntimeConfiguresSource: consumer.New sizes the prefetch from its
// Concurrency and hands its logger to a Source that has none: a lost
// channel shows up in the runtime's log.
func TestRuntimeConfiguresSource(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	e := newE2E(t)
	q := newQueue(t)
	src := newSource(t, rabbitmq.Config{Queue: q, Reconnect: rabbitmq.ReconnectConfig{InitialInterval: 10 * time.Millisecond}})
	log, logs := testlog.New(slog.LevelInfo)
	applied := make(chan string, 100)
	rt, err := consumer.New(consumer.Config{
		Name: "cfg", Source: src, Store: e.store, Concurrency: 3, BatchSize: 2, Logger: log,
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			applied <- msg.ID
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if w := src.Window(); w != 12 {
		t.Fatalf("prefetch after consumer.New with Concurrency 3 and BatchSize 2: %d, want 2×3×2 = 12", w)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- rt.Run(runCtx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	pub := newPublisher(t, rabbitmq.PublisherConfig{})
	if err := pub.Publish(ctx, "", q, brokertest.NewMessages("a", 1, 0)...); err != nil {
		t.Fatal(err)
	}
	<-applied
	waitFor(t, 10*time.Second, "the first message settled", func() bool { return rt.Stats().InFlight == 0 })
	if err := rabbitmq.BreakChannel(src); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the reconnect", func() bool { return src.Stats().Reconnects == 1 })
	if err := pub.Publish(ctx, "", q, brokertest.NewMessages("b", 1, 0)...); err != nil {
		t.Fatal(err)
	}
	<-applied
	waitFor(t, 10*time.Second, "the lost channel logged", func() bool {
		out := logs.String()
		return strings.Contains(out, "consumer lost") && strings.Contains(out, "queue="+q) && strings.Contains(out, "consumer=cfg")
	})
}
