package rabbitmq_test

import (
	"context"
	"errors"
	"io"
	"slices"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// The Browser satisfies dlq.Browser structurally; package rabbitmq does not
// import dlq.
var _ dlq.Browser = (*rabbitmq.Browser)(nil)

func newBrowser(t *testing.T, cfg rabbitmq.BrowserConfig) *rabbitmq.Browser {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = amqpURL()
	}
	b, err := rabbitmq.NewBrowser(testCtx(t, 30*time.Second), cfg)
	if err != nil {
		t.Fatalf("new browser: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("close browser: %v", err)
		}
	})
	return b
}

// browseAll reads b to its end and returns the deliveries, failing t unless
// the end is an io.EOF.
func browseAll(ctx context.Context, t *testing.T, b *rabbitmq.Browser) []consumer.Delivery {
	t.Helper()
	var ds []consumer.Delivery
	for {
		d, err := b.Next(ctx)
		if errors.Is(err, io.EOF) {
			return ds
		}
		if err != nil {
			t.Fatalf("browse: %v", err)
		}
		ds = append(ds, d)
	}
}

func ids(ds []consumer.Delivery) []string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = d.Message().ID
	}
	return out
}

func msgIDs(msgs []*consumer.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.ID
	}
	return out
}

// drainIDs consumes every message of q (destructively) and returns their
// ids in queue order.
func drainIDs(t *testing.T, q string) []string {
	t.Helper()
	var out []string
	if err := admin(t, func(ch *amqp.Channel) error {
		for {
			d, ok, err := ch.Get(q, true)
			if err != nil || !ok {
				return err
			}
			out = append(out, d.MessageId)
		}
	}); err != nil {
		t.Fatalf("drain %s: %v", q, err)
	}
	return out
}

// waitDepth waits until q holds want ready messages. Requeueing at close is
// asynchronous in the broker, so depth is polled.
func waitDepth(t *testing.T, q string, want int) {
	t.Helper()
	var got int
	deadline := time.Now().Add(10 * time.Second)
	for {
		if got = queueDepth(t, q); got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue %s holds %d ready messages, want %d", q, got, want)
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}
}

// TestBrowserLeavesQueueIntact: a browse that acks nothing reads every
// message in order, then io.EOF, and leaves the queue exactly as it was:
// same depth, same ids, same order, twice over.
func TestBrowserLeavesQueueIntact(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	q := newQueue(t)
	const n = 25
	msgs := brokertest.NewMessages("intact", n, 0)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, msgs...); err != nil {
		t.Fatal(err)
	}
	want := msgIDs(msgs)
	for pass := 1; pass <= 2; pass++ {
		b := newBrowser(t, rabbitmq.BrowserConfig{Queue: q})
		if b.Depth() != n {
			t.Fatalf("pass %d: Depth %d, want %d", pass, b.Depth(), n)
		}
		ds := browseAll(ctx, t, b)
		if got := ids(ds); !slices.Equal(got, want) {
			t.Fatalf("pass %d: browsed %v, want %v", pass, got, want)
		}
		// The end is sticky.
		if _, err := b.Next(ctx); !errors.Is(err, io.EOF) {
			t.Fatalf("pass %d: Next after the end: %v, want io.EOF", pass, err)
		}
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
		waitDepth(t, q, n)
	}
	if got := drainIDs(t, q); !slices.Equal(got, want) {
		t.Fatalf("after browsing, the queue holds %v, want %v", got, want)
	}
}

// TestBrowserAckRemoves: acked messages leave the queue; nacked-with-requeue
// and untouched ones come back, in order, at Close; a requeueing nack does
// not make a message come back within the same pass.
func TestBrowserAckRemoves(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	q := newQueue(t)
	const n = 12
	msgs := brokertest.NewMessages("ack", n, 0)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, msgs...); err != nil {
		t.Fatal(err)
	}
	b := newBrowser(t, rabbitmq.BrowserConfig{Queue: q})
	var kept []string
	for i := range n {
		d, err := b.Next(ctx)
		if err != nil {
			t.Fatalf("next %d: %v", i, err)
		}
		switch i % 3 {
		case 0:
			mustAck(ctx, t, d)
		case 1:
			if err := d.Nack(ctx, true); err != nil {
				t.Fatal(err)
			}
			kept = append(kept, d.Message().ID)
		default:
			kept = append(kept, d.Message().ID)
		}
	}
	if d, err := b.Next(ctx); !errors.Is(err, io.EOF) {
		t.Fatalf("after %d messages: got %v, %v; want io.EOF (a requeueing nack must not bring a message back in the same pass)", n, d, err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	waitDepth(t, q, len(kept))
	if got := drainIDs(t, q); !slices.Equal(got, kept) {
		t.Fatalf("queue holds %v, want %v", got, kept)
	}
}

// TestBrowserSnapshot: a browser reads at most the messages present when it
// opened, and stops early if someone else takes them.
func TestBrowserSnapshot(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	pub := newPublisher(t, rabbitmq.PublisherConfig{})

	t.Run("later messages are not read", func(t *testing.T) {
		q := newQueue(t)
		if err := pub.Publish(ctx, "", q, brokertest.NewMessages("early", 5, 0)...); err != nil {
			t.Fatal(err)
		}
		b := newBrowser(t, rabbitmq.BrowserConfig{Queue: q})
		first, err := b.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// A replay that dead-letters a message again appends a copy.
		if err := pub.Publish(ctx, "", q, brokertest.NewMessages("late", 3, 0)...); err != nil {
			t.Fatal(err)
		}
		mustAck(ctx, t, first)
		rest := browseAll(ctx, t, b)
		if len(rest) != 4 {
			t.Fatalf("browsed %d more messages (%v), want the 4 present at the start", len(rest), ids(rest))
		}
		for _, d := range rest {
			if d.Message().ID[:5] != "early" {
				t.Errorf("browsed %s, published after the browser opened", d.Message().ID)
			}
		}
	})

	t.Run("emptied under the browser", func(t *testing.T) {
		q := newQueue(t)
		if err := pub.Publish(ctx, "", q, brokertest.NewMessages("taken", 5, 0)...); err != nil {
			t.Fatal(err)
		}
		b := newBrowser(t, rabbitmq.BrowserConfig{Queue: q})
		if got := len(drainIDs(t, q)); got != 5 {
			t.Fatalf("drained %d", got)
		}
		if d, err := b.Next(ctx); !errors.Is(err, io.EOF) {
			t.Fatalf("Next on an emptied queue: %v, %v; want io.EOF", d, err)
		}
	})

	t.Run("empty queue", func(t *testing.T) {
		b := newBrowser(t, rabbitmq.BrowserConfig{Queue: newQueue(t)})
		if b.Depth() != 0 {
			t.Fatalf("Depth %d", b.Depth())
		}
		if _, err := b.Next(ctx); !errors.Is(err, io.EOF) {
			t.Fatalf("Next: %v, want io.EOF", err)
		}
	})
}

// TestBrowserMapping: a browsed message is mapped exactly as the Source maps
// a consumed one, including the id and key options.
func TestBrowserMapping(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	ts := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	if err := admin(t, func(ch *amqp.Channel) error {
		return ch.PublishWithContext(ctx, "", q, false, false, amqp.Publishing{
			MessageId: "prop-id",
			Timestamp: ts,
			Headers:   amqp.Table{"s": "text", "i": int32(42), "my-id": "header-id", keyHeader: "acct-1"},
			Body:      []byte("payload"),
		})
	}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		wantID string
	}{
		{"property", "prop-id"},
	} {
		b := newBrowser(t, rabbitmq.BrowserConfig{Queue: q})
		d, err := b.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		bm := d.Message()
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
		waitDepth(t, q, 1)
		src := newSource(t, rabbitmq.Config{Queue: q})
		sd := brokertest.Receive(ctx, t, src)
		sm := sd.Message()
		if err := sd.Nack(ctx, true); err != nil {
			t.Fatal(err)
		}
		if err := src.Close(); err != nil {
			t.Fatal(err)
		}
		waitDepth(t, q, 1)
		if bm.ID != tc.wantID || sm.ID != tc.wantID {
			t.Errorf("%s: ids %q (browser), %q (source), want %q", tc.name, bm.ID, sm.ID, tc.wantID)
		}
		if bm.Key != "acct-1" || bm.Key != sm.Key || string(bm.Body) != string(sm.Body) || bm.Source != q || sm.Source != q ||
			bm.Partition != -1 || bm.Offset != -1 || !bm.Timestamp.Equal(ts) || !bm.Timestamp.Equal(sm.Timestamp) ||
			bm.Metadata[rabbitmq.MetaRoutingKey] != q {
			t.Errorf("%s: browser and source disagree:\nbrowser %+v\nsource  %+v", tc.name, bm, sm)
		}
		for k, v := range sm.Headers {
			if bm.Headers[k] != v {
				t.Errorf("%s: header %s: browser %q, source %q", tc.name, k, bm.Headers[k], v)
			}
		}
		if len(bm.Headers) != len(sm.Headers) {
			t.Errorf("%s: %d headers browsed, %d consumed", tc.name, len(bm.Headers), len(sm.Headers))
		}
	}
}

// TestBrowserClosed: after Close, Next and the deliveries' Ack and Nack
// fail with ErrSourceClosed, a second settle with ErrDeliveryStale, and the
// messages are back in the queue.
func TestBrowserClosed(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, brokertest.NewMessages("closed", 3, 0)...); err != nil {
		t.Fatal(err)
	}
	b := newBrowser(t, rabbitmq.BrowserConfig{Queue: q})
	ds := browseAll(ctx, t, b)
	if len(ds) != 3 {
		t.Fatalf("browsed %d", len(ds))
	}
	mustAck(ctx, t, ds[0])
	if err := ds[0].Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("second ack: %v, want ErrDeliveryStale", err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := b.Next(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("Next after Close: %v, want ErrSourceClosed", err)
	}
	if err := ds[1].Ack(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("Ack after Close: %v, want ErrSourceClosed", err)
	}
	if err := ds[2].Nack(ctx, true); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("Nack after Close: %v, want ErrSourceClosed", err)
	}
	waitDepth(t, q, 2)
}

// TestBrowserConnectionLost: a cut connection ends the browse with
// ErrSourceClosed (a browser never reconnects), acks of its deliveries fail
// with ErrDeliveryStale, and the broker has every unacked message back.
func TestBrowserConnectionLost(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	q := newQueue(t)
	px := newProxy(t)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, brokertest.NewMessages("lost", 4, 0)...); err != nil {
		t.Fatal(err)
	}
	b := newBrowser(t, rabbitmq.BrowserConfig{URL: px.URL(t), Queue: q})
	d, err := b.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	px.Cut()
	var nextErr error
	waitFor(t, 20*time.Second, "Next to fail after the cut", func() bool {
		var d2 consumer.Delivery
		d2, nextErr = b.Next(ctx)
		return d2 == nil
	})
	if !errors.Is(nextErr, consumer.ErrSourceClosed) || errors.Is(nextErr, io.EOF) {
		t.Fatalf("Next after a cut: %v, want ErrSourceClosed", nextErr)
	}
	if err := d.Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("Ack after a cut: %v, want ErrDeliveryStale", err)
	}
	waitDepth(t, q, 4)
}

// TestBrowserConfig: invalid configs are ConfigErrors; a missing queue is an
// error at NewBrowser; a cancelled context stops Next.
func TestBrowserConfig(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	for _, tc := range []struct {
		cfg   rabbitmq.BrowserConfig
		field string
	}{
		{rabbitmq.BrowserConfig{}, "Queue"},
		{rabbitmq.BrowserConfig{Queue: "q", URL: "http://example.com"}, "URL"},
		{rabbitmq.BrowserConfig{Queue: "q", DialTimeout: -1}, "DialTimeout"},
	} {
		_, err := rabbitmq.NewBrowser(ctx, tc.cfg)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field || !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("%+v: got %v, want a ConfigError for %s", tc.cfg, err, tc.field)
		}
	}
	if b, err := rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{URL: amqpURL(), Queue: uniqueName(t)}); err == nil {
		_ = b.Close()
		t.Fatal("NewBrowser on a missing queue succeeded")
	}

	q := newQueue(t)
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, brokertest.NewMessages("ctx", 1, 0)...); err != nil {
		t.Fatal(err)
	}
	b := newBrowser(t, rabbitmq.BrowserConfig{Queue: q})
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := b.Next(cctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Next with a cancelled context: %v", err)
	}
	if ds := browseAll(ctx, t, b); len(ds) != 1 {
		t.Fatalf("after a cancelled Next, browsed %d, want 1", len(ds))
	}
}
