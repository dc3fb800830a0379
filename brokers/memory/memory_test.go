package memory_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"go.uber.org/goleak"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// harness runs the conformance suite on a fresh broker per test.
type harness struct {
	b     *memory.Broker
	queue string
}

func (h *harness) Publish(ctx context.Context, msgs ...*consumer.Message) error {
	return h.b.Publish(ctx, h.queue, msgs...)
}

func (h *harness) NewSource(t *testing.T) consumer.Source {
	t.Helper()
	sub, err := h.b.Subscribe(h.queue, memory.SubscribeOptions{})
	if err != nil {
		t.Fatalf("subscribe: %v", err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

func TestConformance(t *testing.T) {
	brokertest.Run(t, brokertest.Config{
		Features: brokertest.Features{
			NackRequeue:        true,
			RedeliveredFlag:    true,
			GlobalOrder:        true,
			CompetingConsumers: true,
			MessageID:          true,
			Headers:            true,
		},
		NewHarness: func(t *testing.T) brokertest.Harness {
			return &harness{b: memory.NewBroker(), queue: "conformance"}
		},
	})
}

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func subscribe(t *testing.T, b *memory.Broker, queue string, prefetch int) *memory.Subscription {
	t.Helper()
	sub, err := b.Subscribe(queue, memory.SubscribeOptions{Prefetch: prefetch})
	if err != nil {
		t.Fatalf("subscribe: %v", err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

func publish(t *testing.T, b *memory.Broker, queue string, bodies ...string) {
	t.Helper()
	msgs := make([]*consumer.Message, len(bodies))
	for i, body := range bodies {
		msgs[i] = &consumer.Message{ID: "id-" + body, Body: []byte(body)}
	}
	if err := b.Publish(context.Background(), queue, msgs...); err != nil {
		t.Fatalf("publish: %v", err)
	}
}

func receive(ctx context.Context, t *testing.T, src consumer.Source) consumer.Delivery {
	t.Helper()
	d, err := src.Receive(ctx)
	if err != nil {
		t.Fatalf("receive: %v", err)
	}
	return d
}

func bodies(msgs []*consumer.Message) string {
	var s []string
	for _, m := range msgs {
		s = append(s, string(m.Body))
	}
	return strings.Join(s, ",")
}

func TestPublishSetsFieldsAndCopies(t *testing.T) {
	ctx := testCtx(t)
	b := memory.NewBroker()
	orig := &consumer.Message{
		ID: "m1", Key: "k", Body: []byte("hello"),
		Headers:   map[string]string{"h": "v"},
		Partition: 7, Offset: 42, Redelivered: true, Attempt: 3,
	}
	if err := b.Publish(ctx, "q", orig); err != nil {
		t.Fatal(err)
	}
	// Mutating the published message must not reach the stored copy.
	orig.Body[0] = 'J'
	orig.Headers["h"] = "changed"

	d := receive(ctx, t, subscribe(t, b, "q", 0))
	m := d.Message()
	if string(m.Body) != "hello" || m.Header("h") != "v" || m.ID != "m1" || m.Key != "k" {
		t.Errorf("stored message was not a deep copy: %+v", m)
	}
	if m.Source != "q" || m.Partition != -1 || m.Offset != -1 {
		t.Errorf("Source/Partition/Offset = %q/%d/%d, want q/-1/-1", m.Source, m.Partition, m.Offset)
	}
	if m.Redelivered || m.Attempt != 0 {
		t.Errorf("Redelivered/Attempt = %v/%d, want false/0", m.Redelivered, m.Attempt)
	}
	if m.Timestamp.IsZero() {
		t.Error("Timestamp not set")
	}
	// Mutating the delivered message must not reach the stored one.
	m.Body[0] = 'X'
	if err := d.Nack(ctx, true); err != nil {
		t.Fatal(err)
	}
	if got := b.Messages("q"); len(got) != 1 || string(got[0].Body) != "hello" || !got[0].Redelivered {
		t.Errorf("Messages after nack = %+v, want one redelivered hello", got)
	}
}

func TestPublishErrors(t *testing.T) {
	b := memory.NewBroker()
	if err := b.Publish(context.Background(), "", &consumer.Message{}); !errors.Is(err, memory.ErrEmptyQueueName) {
		t.Errorf("empty queue: %v", err)
	}
	if err := b.Publish(context.Background(), "q", &consumer.Message{}, nil); !errors.Is(err, memory.ErrNilMessage) {
		t.Errorf("nil message: %v", err)
	}
	if b.Ready("q") != 0 {
		t.Errorf("a failed publish stored %d messages", b.Ready("q"))
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := b.Publish(ctx, "q", &consumer.Message{}); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled publish: %v", err)
	}
}

func TestSubscribeValidates(t *testing.T) {
	b := memory.NewBroker()
	_, err := b.Subscribe("q", memory.SubscribeOptions{Prefetch: -1})
	if !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("negative prefetch: got %v, want ErrInvalidConfig", err)
	}
	if _, err := b.Subscribe("", memory.SubscribeOptions{}); !errors.Is(err, memory.ErrEmptyQueueName) {
		t.Errorf("empty queue: got %v", err)
	}
}

func TestNackRequeueGoesToHead(t *testing.T) {
	ctx := testCtx(t)
	b := memory.NewBroker()
	publish(t, b, "q", "a", "b", "c")
	sub := subscribe(t, b, "q", 0)
	d := receive(ctx, t, sub)
	if err := d.Nack(ctx, true); err != nil {
		t.Fatal(err)
	}
	if got := bodies(b.Messages("q")); got != "a,b,c" {
		t.Errorf("queue after nack = %s, want a,b,c", got)
	}
	d = receive(ctx, t, sub)
	if string(d.Message().Body) != "a" || !d.Message().Redelivered {
		t.Errorf("after nack got %q redelivered=%v, want a redelivered", d.Message().Body, d.Message().Redelivered)
	}
	if got := b.Redeliveries("q"); got != 1 {
		t.Errorf("Redeliveries = %d, want 1", got)
	}
}

func TestDoubleSettleIsStale(t *testing.T) {
	ctx := testCtx(t)
	b := memory.NewBroker()
	publish(t, b, "q", "a", "b")
	sub := subscribe(t, b, "q", 0)
	d := receive(ctx, t, sub)
	if err := d.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	if err := d.Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("second ack: got %v, want ErrDeliveryStale", err)
	}
	if err := d.Nack(ctx, true); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("nack after ack: got %v, want ErrDeliveryStale", err)
	}
	s := b.Stats("q")
	if s.Ready != 1 || s.Unacked != 0 || s.Acked != 1 || s.Requeued != 0 {
		t.Errorf("stats after double settle = %+v", s)
	}
}

func TestDeadLetterQueue(t *testing.T) {
	ctx := testCtx(t)
	b := memory.NewBroker()
	b.SetDeadLetterQueue("q", "q.dlq")
	publish(t, b, "q", "a")
	sub := subscribe(t, b, "q", 0)
	d := receive(ctx, t, sub)
	if err := d.Nack(ctx, false); err != nil {
		t.Fatal(err)
	}
	if b.Ready("q") != 0 || b.Unacked("q") != 0 {
		t.Errorf("q: ready %d unacked %d, want 0 0", b.Ready("q"), b.Unacked("q"))
	}
	dl := b.Messages("q.dlq")
	if len(dl) != 1 {
		t.Fatalf("dlq holds %d messages, want 1", len(dl))
	}
	m := dl[0]
	if string(m.Body) != "a" || m.ID != "id-a" || m.Source != "q.dlq" {
		t.Errorf("dead-lettered message = %+v", m)
	}
	if m.Header(memory.HeaderFirstDeathQueue) != "q" || m.Header(memory.HeaderFirstDeathReason) != "rejected" {
		t.Errorf("dead-letter headers = %v", m.Headers)
	}
	if s := b.Stats("q"); s.DeadLettered != 1 || s.Dropped != 0 {
		t.Errorf("stats = %+v", s)
	}

	// Without a dead-letter queue the message is dropped.
	b.SetDeadLetterQueue("q", "")
	publish(t, b, "q", "b")
	d = receive(ctx, t, sub)
	if err := d.Nack(ctx, false); err != nil {
		t.Fatal(err)
	}
	if s := b.Stats("q"); s.Ready != 0 || s.Unacked != 0 || s.Dropped != 1 {
		t.Errorf("stats after drop = %+v", s)
	}
	if b.Ready("q.dlq") != 1 {
		t.Errorf("dlq holds %d, want still 1", b.Ready("q.dlq"))
	}
}

func TestPrefetchBound(t *testing.T) {
	ctx := testCtx(t)
	b := memory.NewBroker()
	publish(t, b, "q", "a", "b", "c", "d")
	sub := subscribe(t, b, "q", 2)
	d1 := receive(ctx, t, sub)
	receive(ctx, t, sub)

	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if d, err := sub.Receive(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("third receive at prefetch 2: got (%v, %v), want DeadlineExceeded", d, err)
	}
	if b.Ready("q") != 2 || b.Unacked("q") != 2 || sub.Unacked() != 2 {
		t.Errorf("ready %d unacked %d sub %d, want 2 2 2", b.Ready("q"), b.Unacked("q"), sub.Unacked())
	}

	// Another subscription is not held back by the full one.
	other := subscribe(t, b, "q", 1)
	if d := receive(ctx, t, other); string(d.Message().Body) != "c" {
		t.Errorf("other subscription got %q, want c", d.Message().Body)
	}

	// A blocked Receive is released by an ack that frees a slot.
	got := make(chan consumer.Delivery, 1)
	go func() {
		d, err := sub.Receive(ctx)
		if err != nil {
			t.Errorf("blocked receive: %v", err)
		}
		got <- d
	}()
	if err := b.WaitFor(ctx, "q", func(s memory.QueueStats) bool { return s.Waiting == 1 }); err != nil {
		t.Fatal(err)
	}
	if err := d1.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-got:
		if d == nil || string(d.Message().Body) != "d" {
			t.Errorf("released receive got %v, want d", d)
		}
	case <-ctx.Done():
		t.Fatal("receive not released by ack")
	}
}

func TestCloseRequeuesAndStaleSettle(t *testing.T) {
	ctx := testCtx(t)
	b := memory.NewBroker()
	publish(t, b, "q", "a", "b", "c", "d")
	sub := subscribe(t, b, "q", 0)
	ds := []consumer.Delivery{receive(ctx, t, sub), receive(ctx, t, sub), receive(ctx, t, sub)}
	if err := ds[1].Ack(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	if err := sub.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
	msgs := b.Messages("q")
	if got := bodies(msgs); got != "a,c,d" {
		t.Fatalf("queue after close = %s, want a,c,d (unacked back at the head, in order)", got)
	}
	if !msgs[0].Redelivered || !msgs[1].Redelivered || msgs[2].Redelivered {
		t.Errorf("redelivered flags = %v %v %v, want true true false", msgs[0].Redelivered, msgs[1].Redelivered, msgs[2].Redelivered)
	}

	// Settling the old deliveries fails and must not touch the requeued
	// copies.
	for _, d := range []consumer.Delivery{ds[0], ds[2]} {
		if err := d.Ack(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
			t.Errorf("ack after close: got %v, want ErrSourceClosed", err)
		}
		if err := d.Nack(ctx, false); !errors.Is(err, consumer.ErrSourceClosed) {
			t.Errorf("nack after close: got %v, want ErrSourceClosed", err)
		}
	}
	if err := ds[1].Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("ack of a delivery acked before close: got %v, want ErrDeliveryStale", err)
	}
	s := b.Stats("q")
	if s.Ready != 3 || s.Unacked != 0 || s.Acked != 1 || s.Requeued != 2 {
		t.Errorf("stats = %+v", s)
	}
	if _, err := sub.Receive(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("receive after close: %v", err)
	}
}

func TestDeadLettererHeaders(t *testing.T) {
	ctx := testCtx(t)
	b := memory.NewBroker()
	first := time.Date(2024, 1, 2, 3, 4, 5, 6, time.UTC)
	last := first.Add(1500 * time.Millisecond)
	long := strings.Repeat("é", 600) // 1200 bytes, two per rune
	msg := &consumer.Message{
		ID: "m1", Key: "k", Body: []byte(`{"n":1}`), Source: "orders",
		Headers: map[string]string{"trace": "t1"}, Redelivered: true, Attempt: 5,
	}
	f := consumer.Failure{
		Consumer: "billing", MessageID: "m1", Class: consumer.ClassRetryableExhausted,
		Err: errors.New(long), Attempts: 5, FirstFailure: first, LastFailure: last,
	}
	sub, err := b.Subscribe("orders", memory.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.DeadLetterer().DeadLetter(ctx, msg, f); err != nil {
		t.Fatal(err)
	}
	// Stored before DeadLetter returned.
	got := b.Messages("orders.dlq")
	if len(got) != 1 {
		t.Fatalf("dlq holds %d messages, want 1", len(got))
	}
	m := got[0]
	if string(m.Body) != `{"n":1}` || m.ID != "m1" || m.Key != "k" || m.Header("trace") != "t1" {
		t.Errorf("copy changed the message: %+v", m)
	}
	if m.Source != "orders.dlq" || m.Redelivered {
		t.Errorf("copy Source/Redelivered = %q/%v", m.Source, m.Redelivered)
	}
	want := map[string]string{
		"x-idemq-consumer":      "billing",
		"x-idemq-message-id":    "m1",
		"x-idemq-error-class":   "retryable-exhausted",
		"x-idemq-attempts":      "5",
		"x-idemq-first-failure": "2024-01-02T03:04:05.000000006Z",
		"x-idemq-last-failure":  "2024-01-02T03:04:06.500000006Z",
		"x-idemq-source":        "orders",
	}
	for k, v := range want {
		if m.Header(k) != v {
			t.Errorf("header %s = %q, want %q", k, m.Header(k), v)
		}
	}
	e := m.Header("x-idemq-error")
	if len(e) > 1024 || len(e) < 1024-20 || !utf8.ValidString(e) || !strings.HasSuffix(e, "[truncated]") { // 1024: the default dlq.Options.MaxErrorBytes
		t.Errorf("error header: %d bytes, valid UTF-8 %v; want a marked cut of at most %d bytes", len(e), utf8.ValidString(e), 1024)
	}
	if m.Header("x-idemq-host") == "" || m.Header("x-idemq-dead-letters") != "1" {
		t.Errorf("host/dead-letters headers missing: %v", m.Headers)
	}
	// The original is untouched.
	if len(msg.Headers) != 1 || msg.Source != "orders" {
		t.Errorf("DeadLetter mutated the original: %+v", msg)
	}

	ctx2, cancel := context.WithCancel(ctx)
	cancel()
	if err := sub.DeadLetterer().DeadLetter(ctx2, msg, f); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled DeadLetter: %v", err)
	}

	// SubscribeOptions.DeadLetter names another queue.
	other, err := b.Subscribe("orders", memory.SubscribeOptions{DeadLetter: "billing-failures"})
	if err != nil {
		t.Fatal(err)
	}
	if err := other.DeadLetterer().DeadLetter(ctx, msg, f); err != nil || b.Ready("billing-failures") != 1 || b.Ready("orders.dlq") != 1 {
		t.Errorf("DeadLetter to billing-failures: %v; it holds %d, orders.dlq %d; want 1 and 1", err, b.Ready("billing-failures"), b.Ready("orders.dlq"))
	}
}

// TestStressNoLoss races receivers with tiny deadlines, competing
// subscriptions, nacks and closes against a publisher, and checks that every
// message is eventually acked exactly once and the queue drains.
func TestStressNoLoss(t *testing.T) {
	ctx := testCtx(t)
	b := memory.NewBroker()
	const n = 2000
	var acked sync.Map
	var ackCount atomic.Int64
	var wg sync.WaitGroup
	stop, cancel := context.WithCancel(ctx)
	defer cancel()
	for w := range 4 {
		wg.Go(func() {
			for i := 0; stop.Err() == nil; i++ {
				sub, err := b.Subscribe("q", memory.SubscribeOptions{Prefetch: 1 + w})
				if err != nil {
					t.Error(err)
					return
				}
				for j := 0; j < 50 && stop.Err() == nil; j++ {
					rctx, rcancel := context.WithTimeout(stop, time.Duration(j%3)*time.Millisecond)
					d, err := sub.Receive(rctx)
					rcancel()
					if err != nil {
						continue
					}
					switch (i + j) % 7 {
					case 0:
						_ = d.Nack(ctx, true)
					case 1:
						// Left unacked: the Close below requeues it.
					default:
						if d.Ack(ctx) == nil {
							if _, dup := acked.LoadOrStore(string(d.Message().Body), true); dup {
								t.Errorf("%q acked twice", d.Message().Body)
							}
							ackCount.Add(1)
						}
					}
				}
				_ = sub.Close()
			}
		})
	}
	for i := range n {
		publish(t, b, "q", fmt.Sprint(i))
	}
	err := b.WaitFor(ctx, "q", func(s memory.QueueStats) bool { return s.Acked == n })
	cancel()
	wg.Wait()
	if err != nil {
		t.Fatalf("%v; stats %+v", err, b.Stats("q"))
	}
	if s := b.Stats("q"); !memory.Drained(s) || ackCount.Load() != n {
		t.Errorf("stats %+v, acked %d, want drained and %d", s, ackCount.Load(), n)
	}
}

func TestWaitForHonoursContext(t *testing.T) {
	b := memory.NewBroker()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := b.WaitFor(ctx, "q", func(s memory.QueueStats) bool { return s.Ready > 0 })
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("got %v, want DeadlineExceeded", err)
	}
}
