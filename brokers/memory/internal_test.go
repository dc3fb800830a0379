package memory

import (
	"context"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
)

// TestReceiveCancelledWhileDispatched forces the race between a Receive's
// context ending and the broker handing that Receive a message: the message
// must be returned, not lost.
func TestReceiveCancelledWhileDispatched(t *testing.T) {
	ctx, cancelAll := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancelAll()
	b := NewBroker()
	sub, err := b.Subscribe("q", SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()

	for i := range 200 {
		rctx, cancel := context.WithCancel(ctx)
		type result struct {
			d   consumer.Delivery
			err error
		}
		ch := make(chan result, 1)
		go func() {
			d, err := sub.Receive(rctx)
			ch <- result{d, err}
		}()
		if err := b.WaitFor(ctx, "q", func(s QueueStats) bool { return s.Waiting == 1 }); err != nil {
			t.Fatal(err)
		}
		// Cancel and dispatch under the lock, so the receiver sees both
		// at once.
		b.mu.Lock()
		cancel()
		q := b.queues["q"]
		q.ready = append(q.ready, &entry{msg: &consumer.Message{Body: []byte{byte(i)}}})
		q.stats.Published++
		b.dispatchLocked(q)
		b.mu.Unlock()

		r := <-ch
		if r.err != nil {
			t.Fatalf("iteration %d: Receive returned %v although a message was handed to it", i, r.err)
		}
		if err := r.d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if s := b.Stats("q"); s.Acked != 200 || !Drained(s) || s.Waiting != 0 {
		t.Errorf("stats %+v", s)
	}
}
