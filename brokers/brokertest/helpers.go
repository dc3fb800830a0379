package brokertest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
)

// Headers the suite sets on the messages it makes.
const (
	// HeaderSeq holds a test message's sequence number.
	HeaderSeq = "x-brokertest-seq"
)

// NewMessages makes n distinct test messages. Message i has ID
// "<prefix>-id-<i>", body "<prefix>-<i>" (zero-padded, so bodies identify
// messages even on brokers without MessageID), the header HeaderSeq set to i,
// and, when keys > 0, Key "k<i mod keys>".
func NewMessages(prefix string, n, keys int) []*consumer.Message {
	msgs := make([]*consumer.Message, n)
	for i := range msgs {
		m := &consumer.Message{
			ID:      fmt.Sprintf("%s-id-%06d", prefix, i),
			Body:    fmt.Appendf(nil, "%s-%06d", prefix, i),
			Headers: map[string]string{HeaderSeq: fmt.Sprint(i)},
		}
		if keys > 0 {
			m.Key = fmt.Sprintf("k%d", i%keys)
		}
		msgs[i] = m
	}
	return msgs
}

// Publish publishes deep copies of msgs through h, failing t on error.
func Publish(ctx context.Context, t testing.TB, h Harness, msgs ...*consumer.Message) {
	t.Helper()
	cp := make([]*consumer.Message, len(msgs))
	for i, m := range msgs {
		cp[i] = m.Clone()
	}
	if err := h.Publish(ctx, cp...); err != nil {
		t.Fatalf("publish %d messages: %v", len(msgs), err)
	}
}

// Receive receives one delivery from src, failing t on error or if it
// returns a nil delivery or message.
func Receive(ctx context.Context, t testing.TB, src consumer.Source) consumer.Delivery {
	t.Helper()
	d, err := src.Receive(ctx)
	if err != nil {
		t.Fatalf("receive: %v", err)
	}
	if d == nil || d.Message() == nil {
		t.Fatalf("receive: got a nil delivery or message without an error")
	}
	return d
}

// ReceiveN receives n deliveries from src without settling them, failing t
// if any Receive fails (for example because ctx expired first).
func ReceiveN(ctx context.Context, t testing.TB, src consumer.Source, n int) []consumer.Delivery {
	t.Helper()
	out := make([]consumer.Delivery, 0, n)
	for len(out) < n {
		d, err := src.Receive(ctx)
		if err != nil {
			t.Fatalf("receive %d of %d: %v", len(out)+1, n, err)
		}
		if d == nil || d.Message() == nil {
			t.Fatalf("receive %d of %d: nil delivery or message without an error", len(out)+1, n)
		}
		out = append(out, d)
	}
	return out
}

// AckAll acks every delivery, failing t on the first error.
func AckAll(ctx context.Context, t testing.TB, ds []consumer.Delivery) {
	t.Helper()
	for _, d := range ds {
		if err := d.Ack(ctx); err != nil {
			t.Fatalf("ack %q: %v", d.Message().Body, err)
		}
	}
}

// ReceiveNone asserts that nothing arrives on src within wait. A delivery
// that does arrive fails t and is nacked with requeue; an error other than
// the wait's own deadline also fails t.
func ReceiveNone(ctx context.Context, t testing.TB, src consumer.Source, wait time.Duration) {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	d, err := src.Receive(wctx)
	switch {
	case err == nil:
		body := "<nil>"
		if d != nil && d.Message() != nil {
			body = string(d.Message().Body)
		}
		t.Errorf("expected no message within %s, got %q", wait, body)
		if d != nil {
			_ = d.Nack(ctx, true)
		}
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		// Nothing arrived: the expected outcome.
	default:
		t.Errorf("expected no message within %s; Receive failed instead: %v", wait, err)
	}
}

// Bodies returns the bodies of the deliveries' messages, as strings.
func Bodies(ds []consumer.Delivery) []string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = string(d.Message().Body)
	}
	return out
}

// closeSource closes src, failing t on error.
func closeSource(t testing.TB, src consumer.Source) {
	t.Helper()
	if err := src.Close(); err != nil {
		t.Errorf("close source: %v", err)
	}
}
