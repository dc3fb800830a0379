//go:build integration

package integration

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
)

// rabbitEnv is one test's queue on the RabbitMQ service.
type rabbitEnv struct {
	svc   *service
	url   string
	queue string
}

// newRabbitEnv declares a fresh queue (with its dead-letter exchange and
// queue), deleted when the test ends.
func newRabbitEnv(t testing.TB) *rabbitEnv {
	t.Helper()
	svc, url := rabbit(t)
	q := uniqueName(t, "idemq")
	ctx := testCtx(t, time.Minute)
	if err := rabbitmq.DeclareTopology(ctx, url, rabbitmq.Topology{Queue: q}); err != nil {
		t.Fatalf("declare topology: %v", err)
	}
	t.Cleanup(func() {
		err := poll(context.Background(), 30*time.Second, func(ctx context.Context) error {
			return withChannel(ctx, url, func(ch *amqp.Channel) error {
				if _, err := ch.QueueDelete(q, false, false, false); err != nil {
					return err
				}
				if _, err := ch.QueueDelete(q+".dlq", false, false, false); err != nil {
					return err
				}
				return ch.ExchangeDelete(q+".dlx", false, false)
			})
		})
		if err != nil {
			t.Errorf("delete queue %s: %v", q, err)
		}
	})
	return &rabbitEnv{svc: svc, url: url, queue: q}
}

// publish publishes msgs to the queue with a new publisher, waiting for the
// broker's confirms.
func (e *rabbitEnv) publish(t testing.TB, msgs ...*consumer.Message) {
	t.Helper()
	ctx := testCtx(t, time.Minute)
	p, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: e.url})
	if err != nil {
		t.Fatalf("publisher: %v", err)
	}
	defer p.Close()
	if err := p.Publish(ctx, "", e.queue, msgs...); err != nil {
		t.Fatalf("publish: %v", err)
	}
}

// source opens a Source on the queue that reconnects quickly; the runtime
// sizes its prefetch unless mod sets one.
func (e *rabbitEnv) source(t testing.TB, mod ...func(*rabbitmq.Config)) *rabbitmq.Source {
	t.Helper()
	cfg := rabbitmq.Config{
		URL:         e.url,
		Queue:       e.queue,
		Reconnect:   rabbitmq.ReconnectConfig{InitialInterval: 100 * time.Millisecond, MaxInterval: time.Second},
		DialTimeout: 5 * time.Second,
	}
	for _, m := range mod {
		m(&cfg)
	}
	src, err := rabbitmq.NewSource(testCtx(t, time.Minute), cfg)
	if err != nil {
		t.Fatalf("source: %v", err)
	}
	t.Cleanup(func() { _ = src.Close() })
	return src
}

// depth returns the number of ready messages in the queue and in its
// dead-letter queue.
func (e *rabbitEnv) depth(ctx context.Context) (ready, dead int, err error) {
	err = withChannel(ctx, e.url, func(ch *amqp.Channel) error {
		q, err := ch.QueueDeclarePassive(e.queue, true, false, false, false, nil)
		if err != nil {
			return err
		}
		dq, err := ch.QueueDeclarePassive(e.queue+".dlq", true, false, false, false, nil)
		if err != nil {
			return err
		}
		ready, dead = q.Messages, dq.Messages
		return nil
	})
	return ready, dead, err
}

// drained reports whether the runtime applied every id and settled
// everything it received, and the queue has no ready messages.
func (e *rabbitEnv) drained(rt *runtime, ids, published int) func() bool {
	return func() bool {
		st := rt.rt.Stats()
		if st.Applied < int64(ids) || st.Applied+st.Duplicates < int64(published) || st.InFlight != 0 {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ready, _, err := e.depth(ctx)
		return err == nil && ready == 0
	}
}

// assertEmpty checks, after the runtime stopped (so unacked deliveries went
// back to the queue), that nothing is left and nothing was dead-lettered.
func (e *rabbitEnv) assertEmpty(t testing.TB) {
	t.Helper()
	var ready, dead int
	err := poll(context.Background(), 30*time.Second, func(ctx context.Context) error {
		var err error
		ready, dead, err = e.depth(ctx)
		return err
	})
	if err != nil {
		t.Fatalf("queue depth: %v", err)
	}
	if ready != 0 || dead != 0 {
		t.Errorf("%d messages left in %s and %d in its DLQ, want none", ready, e.queue, dead)
	}
}

func withChannel(ctx context.Context, url string, f func(*amqp.Channel) error) error {
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	return f(ch)
}

// TestRabbitMQExactlyOnce publishes a workload with duplicates to a
// RabbitMQ container and checks one effect per id in Postgres.
func TestRabbitMQExactlyOnce(t *testing.T) {
	t.Parallel()
	d := newDB(t)
	e := newRabbitEnv(t)
	msgs, ids := workload("rmq", 300, 3)
	e.publish(t, msgs...)
	rt := startRuntime(t, d, e.source(t), nil)
	waitFor(t, 2*time.Minute, "every message applied or skipped", rt, e.drained(rt, len(ids), len(msgs)))
	if err := rt.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	st := rt.rt.Stats()
	if st.Applied != int64(len(ids)) || st.Duplicates != int64(len(msgs)-len(ids)) {
		t.Errorf("stats %+v: want %d applied and %d duplicates", st, len(ids), len(msgs)-len(ids))
	}
	d.assertExactlyOnce(t, ids)
	e.assertEmpty(t)
}

// TestFaultRabbitMQRestart stops the RabbitMQ container while messages are
// flowing and starts it again. The queue is durable and the messages
// persistent, so they survive; acks lost with the connection mean
// redeliveries, which dedup absorbs. More messages, including duplicates of
// ids applied before the restart, are published afterwards. Every id must be
// applied exactly once and the source must have reconnected.
func TestFaultRabbitMQRestart(t *testing.T) {
	e := newRabbitEnv(t)
	e.svc.container(t)
	d := newDB(t)
	first, ids1 := workload("rmqrestart-a", 400, 4)
	e.publish(t, first...)
	src := e.source(t)
	rt := startRuntime(t, d, src, func(c *consumer.Config) { c.Handler = slowHandler(d, 5*time.Millisecond) })
	waitFor(t, time.Minute, "a quarter of the ids applied", rt, func() bool { return rt.rt.Stats().Applied >= int64(len(ids1)/4) })

	before := rt.rt.Stats()
	t0 := time.Now()
	e.svc.stop(t, 10*time.Second)
	t.Logf("stopped RabbitMQ in %s; stats %+v", time.Since(t0), before)
	t0 = time.Now()
	e.svc.start(t)
	t.Logf("RabbitMQ back in %s; stats %+v", time.Since(t0), rt.rt.Stats())

	second, ids2 := workload("rmqrestart-b", 100, 0)
	second = append(second, first[:50]...) // re-sent after the restart
	e.publish(t, second...)
	ids := append(ids1, ids2...)
	published := len(first) + len(second)

	waitFor(t, 3*time.Minute, "every message applied or skipped after the restart", rt, e.drained(rt, len(ids), published))
	if err := rt.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	st := rt.rt.Stats()
	t.Logf("final stats %+v, source %+v", st, src.Stats())
	if before.Applied >= int64(len(ids1)) {
		t.Errorf("every first-batch id was applied before the stop: the fault hit nothing")
	}
	if st.Applied != int64(len(ids)) {
		t.Errorf("stats %+v: want %d applied", st, len(ids))
	}
	if src.Stats().Reconnects == 0 {
		t.Errorf("source stats %+v: no reconnect", src.Stats())
	}
	d.assertExactlyOnce(t, ids)
	e.assertEmpty(t)
}

// TestFaultRabbitMQPause freezes the RabbitMQ container (docker pause: TCP
// stays up but nothing answers, like a network stall) mid-stream for a few
// seconds, then resumes it. Nothing may be lost or applied twice.
func TestFaultRabbitMQPause(t *testing.T) {
	e := newRabbitEnv(t)
	e.svc.container(t)
	d := newDB(t)
	msgs, ids := workload("rmqpause", 400, 4)
	e.publish(t, msgs...)
	// A prefetch well below the workload, so that the pause finds
	// deliveries still in the broker (the runtime's own would take in
	// all 500).
	src := e.source(t, func(c *rabbitmq.Config) { c.Prefetch = 64 })
	rt := startRuntime(t, d, src, func(c *consumer.Config) { c.Handler = slowHandler(d, 5*time.Millisecond) })
	waitFor(t, time.Minute, "a quarter of the ids applied", rt, func() bool { return rt.rt.Stats().Applied >= int64(len(ids)/4) })

	before := rt.rt.Stats()
	e.svc.pause(t)
	paused := time.Now()
	// Stall long enough for the runtime to use up its prefetched
	// deliveries and block on the broker.
	waitFor(t, 30*time.Second, "the runtime to stall", rt, func() bool {
		return time.Since(paused) > 5*time.Second && rt.rt.Stats().InFlight == 0 ||
			time.Since(paused) > 8*time.Second
	})
	during := rt.rt.Stats()
	e.svc.unpause(t)
	t.Logf("paused RabbitMQ for %s; stats before %+v, at unpause %+v", time.Since(paused), before, during)

	waitFor(t, 3*time.Minute, "every message applied or skipped after the pause", rt, e.drained(rt, len(ids), len(msgs)))
	if err := rt.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	st := rt.rt.Stats()
	t.Logf("final stats %+v, source %+v", st, src.Stats())
	if during.Applied >= int64(len(ids)) {
		t.Errorf("every id was applied during the pause: the stall hit nothing")
	}
	d.assertExactlyOnce(t, ids)
	e.assertEmpty(t)
}
