package brokertest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
)

// promptly bounds calls that must return at once, such as Receive on a
// closed source or with a cancelled context.
const promptly = 5 * time.Second

// byBody indexes the published messages by body.
func byBody(msgs []*consumer.Message) map[string]*consumer.Message {
	m := make(map[string]*consumer.Message, len(msgs))
	for _, msg := range msgs {
		m[string(msg.Body)] = msg
	}
	return m
}

// checkMessage compares a received message with the published one, field by
// field as far as the features say the broker carries them.
func (s *suite) checkMessage(t *testing.T, got, want *consumer.Message) {
	t.Helper()
	if string(got.Body) != string(want.Body) {
		t.Errorf("body: got %q, want %q", got.Body, want.Body)
		return
	}
	if got.Key != want.Key {
		t.Errorf("%s: key: got %q, want %q", want.Body, got.Key, want.Key)
	}
	if s.f.MessageID && got.ID != want.ID {
		t.Errorf("%s: id: got %q, want %q", want.Body, got.ID, want.ID)
	}
	if s.f.Headers {
		for k, v := range want.Headers {
			if got.Header(k) != v {
				t.Errorf("%s: header %q: got %q, want %q", want.Body, k, got.Header(k), v)
			}
		}
	}
}

// checkSet asserts that ds holds exactly the published messages, each once,
// and that each carries what the features promise.
func (s *suite) checkSet(t *testing.T, ds []consumer.Delivery, msgs []*consumer.Message) {
	t.Helper()
	want := byBody(msgs)
	seen := make(map[string]int, len(ds))
	for _, d := range ds {
		body := string(d.Message().Body)
		seen[body]++
		w, ok := want[body]
		switch {
		case !ok:
			t.Errorf("received a message that was never published: %q", body)
		case seen[body] == 2:
			t.Errorf("received %q more than once", body)
		default:
			s.checkMessage(t, d.Message(), w)
		}
	}
	missing := 0
	for body := range want {
		if seen[body] == 0 {
			if missing < 10 {
				t.Errorf("message %q never received", body)
			}
			missing++
		}
	}
	if missing > 0 {
		t.Errorf("%d of %d messages never received", missing, len(want))
	}
}

// testPublishReceiveAck: published messages arrive intact and, once acked,
// are gone for good.
func testPublishReceiveAck(t *testing.T, s *suite) {
	src := s.h.NewSource(t)
	s.settledAreGone(t, src, "pra", 10, 3, func(ds []consumer.Delivery) { AckAll(s.ctx, t, ds) })
}

// settledAreGone publishes n messages over keys keys, receives them on src,
// settles them with settle, closes src, and checks that a new source
// receives nothing.
func (s *suite) settledAreGone(t *testing.T, src consumer.Source, prefix string, n, keys int, settle func([]consumer.Delivery)) {
	t.Helper()
	msgs := NewMessages(prefix, n, keys)
	Publish(s.ctx, t, s.h, msgs...)
	ds := ReceiveN(s.ctx, t, src, n)
	s.checkSet(t, ds, msgs)
	settle(ds)
	closeSource(t, src)

	src2 := s.h.NewSource(t)
	defer closeSource(t, src2)
	ReceiveNone(s.ctx, t, src2, s.cfg.QuietWait)
}

// testNackRequeue: a message nacked with requeue comes again, flagged as
// redelivered, until it is acked.
func testNackRequeue(t *testing.T, s *suite) {
	msgs := NewMessages("nack", 1, 1)
	Publish(s.ctx, t, s.h, msgs...)

	src := s.h.NewSource(t)
	defer closeSource(t, src)

	d := Receive(s.ctx, t, src)
	s.checkMessage(t, d.Message(), msgs[0])
	if d.Message().Redelivered {
		t.Errorf("first delivery has Redelivered set")
	}
	for i := range 2 {
		if err := d.Nack(s.ctx, true); err != nil {
			t.Fatalf("nack %d: %v", i+1, err)
		}
		d = Receive(s.ctx, t, src)
		s.checkMessage(t, d.Message(), msgs[0])
		if s.f.RedeliveredFlag && !d.Message().Redelivered {
			t.Errorf("delivery after nack %d: Redelivered not set", i+1)
		}
	}
	if err := d.Ack(s.ctx); err != nil {
		t.Fatalf("ack: %v", err)
	}
	ReceiveNone(s.ctx, t, src, s.cfg.QuietWait)
}

// testCloseRequeuesUnacked: closing a source gives its unacked deliveries
// back, and settling them afterwards cannot lose them.
func testCloseRequeuesUnacked(t *testing.T, s *suite) {
	const n = 5
	msgs := NewMessages("close", n, 2)
	Publish(s.ctx, t, s.h, msgs...)

	src := s.h.NewSource(t)
	old := ReceiveN(s.ctx, t, src, n)
	s.checkSet(t, old, msgs)
	closeSource(t, src)

	// Acks on a closed source must fail or be no-ops; either way the
	// message must come again.
	for i, d := range old {
		if err := d.Ack(s.ctx); i == 0 {
			t.Logf("ack after close returned %v", err)
		}
	}

	src2 := s.h.NewSource(t)
	defer closeSource(t, src2)
	again := ReceiveN(s.ctx, t, src2, n)
	s.checkSet(t, again, msgs)
	if s.f.RedeliveredFlag {
		for _, d := range again {
			if !d.Message().Redelivered {
				t.Errorf("%q: Redelivered not set after close", d.Message().Body)
			}
		}
	}
	AckAll(s.ctx, t, again)
	ReceiveNone(s.ctx, t, src2, s.cfg.QuietWait)
}

// testOrderSingleConsumer: one source receives in publish order, or per key
// in publish order when the broker has no global order.
func testOrderSingleConsumer(t *testing.T, s *suite) {
	const n, keys = 200, 8
	msgs := NewMessages("order", n, keys)
	Publish(s.ctx, t, s.h, msgs...)
	want := byBody(msgs)

	src := s.h.NewSource(t)
	defer closeSource(t, src)

	var got []string
	lastPerKey := map[string]int{}
	last := -1
	for range n {
		d := Receive(s.ctx, t, src)
		m := d.Message()
		w, ok := want[string(m.Body)]
		if !ok {
			t.Fatalf("received a message that was never published: %q", m.Body)
		}
		var seq int
		if _, err := fmt.Sscan(w.Headers[HeaderSeq], &seq); err != nil {
			t.Fatalf("bad test message %q: %v", w.Body, err)
		}
		if s.f.GlobalOrder {
			if seq <= last {
				t.Errorf("global order broken: message %d after %d", seq, last)
			}
			last = seq
		}
		if p, ok := lastPerKey[w.Key]; ok && seq <= p {
			t.Errorf("order for key %q broken: message %d after %d", w.Key, seq, p)
		}
		lastPerKey[w.Key] = seq
		got = append(got, string(m.Body))
		if err := d.Ack(s.ctx); err != nil {
			t.Fatalf("ack: %v", err)
		}
	}
	if len(got) != n {
		t.Fatalf("received %d messages, want %d", len(got), n)
	}
}

// testCompetingConsumers: two sources on one queue split its messages, each
// message going to exactly one of them. The messages are published in small
// batches, each once the previous one has been received, and a source that
// got its first message (and acked it) does not receive again until the other
// got one too, so that a slow-to-start consumer goroutine cannot make the
// other take everything.
func testCompetingConsumers(t *testing.T, s *suite) {
	const n, batch = 200, 10
	msgs := NewMessages("compete", n, 16)
	want := byBody(msgs)

	srcs := []consumer.Source{s.h.NewSource(t), s.h.NewSource(t)}
	defer func() {
		for _, src := range srcs {
			closeSource(t, src)
		}
	}()

	ctx, stop := context.WithCancel(s.ctx)
	defer stop()
	var (
		mu       sync.Mutex
		total    int
		counts   = make(map[string]int, n)
		per      = make([]int, len(srcs))
		errs     []error
		wg       sync.WaitGroup
		progress = make(chan struct{}, 1)
		first    = []chan struct{}{make(chan struct{}), make(chan struct{})}
	)
	for i, src := range srcs {
		wg.Go(func() {
			for seen := 0; ; seen++ {
				if seen == 1 {
					// Let the other source get its first message.
					select {
					case <-first[1-i]:
					case <-ctx.Done():
						return
					}
				}
				d, err := src.Receive(ctx)
				if err != nil {
					if ctx.Err() == nil {
						mu.Lock()
						errs = append(errs, fmt.Errorf("source %d: receive: %w", i, err))
						mu.Unlock()
						stop()
					}
					return
				}
				ackErr := d.Ack(ctx)
				mu.Lock()
				total++
				counts[string(d.Message().Body)]++
				per[i]++
				if ackErr != nil && ctx.Err() == nil {
					errs = append(errs, fmt.Errorf("source %d: ack %q: %w", i, d.Message().Body, ackErr))
				}
				mu.Unlock()
				if seen == 0 {
					close(first[i])
				}
				select {
				case progress <- struct{}{}:
				default:
				}
			}
		})
	}

	received := func() int {
		mu.Lock()
		defer mu.Unlock()
		return total
	}
	for i := 0; i < n && ctx.Err() == nil; i += batch {
		Publish(s.ctx, t, s.h, msgs[i:min(i+batch, n)]...)
		for received() < min(i+batch, n) && ctx.Err() == nil {
			select {
			case <-progress:
			case <-ctx.Done():
			}
		}
	}
	stop()
	wg.Wait()

	for _, err := range errs {
		t.Error(err)
	}
	if s.ctx.Err() != nil {
		t.Fatalf("timed out after %d of %d deliveries (per source %v)", total, n, per)
	}
	for body, c := range counts {
		if _, ok := want[body]; !ok {
			t.Errorf("received a message that was never published: %q", body)
		} else if c != 1 {
			t.Errorf("%q received %d times across both sources, want once", body, c)
		}
	}
	if len(counts) != n {
		t.Errorf("received %d distinct messages, want %d", len(counts), n)
	}
	for i, c := range per {
		if c == 0 {
			t.Errorf("source %d received nothing; the other took all %d", i, n)
		}
	}
	t.Logf("split: %v", per)
}

// testManyMessages: a larger batch arrives complete.
func testManyMessages(t *testing.T, s *suite) {
	const n, batch = 2000, 100
	msgs := NewMessages("many", n, 16)
	for i := 0; i < n; i += batch {
		Publish(s.ctx, t, s.h, msgs[i:min(i+batch, n)]...)
	}

	src := s.h.NewSource(t)
	defer closeSource(t, src)
	ds := make([]consumer.Delivery, 0, n)
	for len(ds) < n {
		d, err := src.Receive(s.ctx)
		if err != nil {
			t.Fatalf("receive %d of %d: %v", len(ds)+1, n, err)
		}
		if err := d.Ack(s.ctx); err != nil {
			t.Fatalf("ack %q: %v", d.Message().Body, err)
		}
		ds = append(ds, d)
	}
	s.checkSet(t, ds, msgs)
}

// receiveResult is what a Receive in a goroutine returned.
type receiveResult struct {
	d   consumer.Delivery
	err error
}

// receiveAsync runs src.Receive(ctx) in a goroutine.
func receiveAsync(ctx context.Context, src consumer.Source) <-chan receiveResult {
	ch := make(chan receiveResult, 1)
	go func() {
		d, err := src.Receive(ctx)
		ch <- receiveResult{d, err}
	}()
	return ch
}

// awaitReceive waits up to promptly for a Receive started by receiveAsync.
func awaitReceive(t *testing.T, ch <-chan receiveResult, what string) receiveResult {
	t.Helper()
	timer := time.NewTimer(promptly)
	defer timer.Stop()
	select {
	case r := <-ch:
		return r
	case <-timer.C:
		t.Fatalf("%s: Receive did not return within %s", what, promptly)
		return receiveResult{}
	}
}

// testReceiveAfterClose: Receive on a closed source, or blocked when the
// source closes, returns ErrSourceClosed promptly; Close is idempotent.
func testReceiveAfterClose(t *testing.T, s *suite) {
	src := s.h.NewSource(t)
	if err := src.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	r := awaitReceive(t, receiveAsync(s.ctx, src), "after close")
	if !errors.Is(r.err, consumer.ErrSourceClosed) {
		t.Errorf("Receive after Close: got (%v, %v), want an error wrapping ErrSourceClosed", r.d, r.err)
	}
	if err := src.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}

	// A Receive blocked on an empty queue is released by Close. The
	// Receive is given a moment to block first; returning within that
	// moment on an empty queue is itself a failure.
	src2 := s.h.NewSource(t)
	ch := receiveAsync(s.ctx, src2)
	blocked := time.NewTimer(s.cfg.QuietWait)
	defer blocked.Stop()
	select {
	case r := <-ch:
		t.Fatalf("Receive on an empty queue returned (%v, %v) instead of blocking", r.d, r.err)
	case <-blocked.C:
	}
	if err := src2.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	r = awaitReceive(t, ch, "blocked during close")
	if !errors.Is(r.err, consumer.ErrSourceClosed) {
		t.Errorf("Receive blocked during Close: got (%v, %v), want an error wrapping ErrSourceClosed", r.d, r.err)
	}
}

// testReceiveHonoursContext: Receive on an empty queue returns the context's
// error promptly, and a cancelled Receive loses no message.
func testReceiveHonoursContext(t *testing.T, s *suite) {
	src := s.h.NewSource(t)
	defer closeSource(t, src)

	cancelled, cancel := context.WithCancel(s.ctx)
	cancel()
	r := awaitReceive(t, receiveAsync(cancelled, src), "cancelled context")
	if !errors.Is(r.err, context.Canceled) {
		t.Errorf("Receive with a cancelled context: got (%v, %v), want an error wrapping context.Canceled", r.d, r.err)
	}

	short, cancel2 := context.WithTimeout(s.ctx, 200*time.Millisecond)
	defer cancel2()
	r = awaitReceive(t, receiveAsync(short, src), "short deadline")
	if !errors.Is(r.err, context.DeadlineExceeded) {
		t.Errorf("Receive with a short deadline: got (%v, %v), want an error wrapping context.DeadlineExceeded", r.d, r.err)
	}

	// The source still works, and the aborted Receives swallowed nothing.
	msgs := NewMessages("ctx", 1, 1)
	Publish(s.ctx, t, s.h, msgs...)
	d := Receive(s.ctx, t, src)
	s.checkMessage(t, d.Message(), msgs[0])
	if err := d.Ack(s.ctx); err != nil {
		t.Fatalf("ack: %v", err)
	}
}

// testDoubleAck: settling a delivery twice neither panics, nor resurrects the
// message, nor breaks the source. The second call may return an error
// (preferably wrapping ErrDeliveryStale) or nil; the test logs which.
func testDoubleAck(t *testing.T, s *suite) {
	msgs := NewMessages("dack", 2, 1)
	Publish(s.ctx, t, s.h, msgs...)
	want := byBody(msgs)

	src := s.h.NewSource(t)
	d1 := Receive(s.ctx, t, src)
	first := string(d1.Message().Body)
	if _, ok := want[first]; !ok {
		t.Fatalf("received a message that was never published: %q", first)
	}
	if err := d1.Ack(s.ctx); err != nil {
		t.Fatalf("first ack: %v", err)
	}
	err := d1.Ack(s.ctx)
	t.Logf("second Ack returned %v", err)
	err = d1.Nack(s.ctx, true)
	t.Logf("Nack(requeue) after Ack returned %v", err)

	// The source still works and the acked message does not come back.
	d2 := Receive(s.ctx, t, src)
	if string(d2.Message().Body) == first {
		t.Fatalf("message %q redelivered after it was acked", first)
	}
	if _, ok := want[string(d2.Message().Body)]; !ok {
		t.Fatalf("received a message that was never published: %q", d2.Message().Body)
	}
	if err := d2.Ack(s.ctx); err != nil {
		t.Fatalf("ack of the next delivery after a double ack: %v", err)
	}
	closeSource(t, src)

	src2 := s.h.NewSource(t)
	defer closeSource(t, src2)
	ReceiveNone(s.ctx, t, src2, s.cfg.QuietWait)
}

// testConfigure: a Source with Configure takes the runtime's settings before
// its first Receive, returns a window that is not negative, and then
// delivers and acks as before.
func testConfigure(t *testing.T, s *suite) {
	const n = 6
	msgs := NewMessages("configure", n, 1)
	Publish(s.ctx, t, s.h, msgs...)
	src := s.h.NewSource(t)
	defer closeSource(t, src)
	c, ok := src.(interface {
		Configure(consumer.SourceSettings) int
	})
	if !ok {
		t.Skip("the Source has no Configure method")
	}
	if w := c.Configure(consumer.SourceSettings{Window: 2, Logger: slog.New(slog.DiscardHandler)}); w < 0 {
		t.Fatalf("Configure returned window %d", w)
	}
	ds := make([]consumer.Delivery, 0, n)
	for range n {
		d := Receive(s.ctx, t, src)
		if err := d.Ack(s.ctx); err != nil {
			t.Fatalf("ack: %v", err)
		}
		ds = append(ds, d)
	}
	s.checkSet(t, ds, msgs)
	ReceiveNone(s.ctx, t, src, s.cfg.QuietWait)
}

// testAckBatch: deliveries acked together with AckBatch are gone for good
// once the source is closed (it sends whatever acks still wait).
func testAckBatch(t *testing.T, s *suite) {
	src := s.h.NewSource(t)
	b, ok := src.(interface {
		AckBatch(context.Context, []consumer.Delivery) error
	})
	if !ok {
		closeSource(t, src)
		t.Skip("the Source has no AckBatch method")
	}
	s.settledAreGone(t, src, "ackbatch", 5, 1, func(ds []consumer.Delivery) {
		if err := b.AckBatch(s.ctx, ds); err != nil {
			t.Fatalf("AckBatch: %v", err)
		}
	})
}

// testRedeliveryHorizon: a Source with RedeliveryHorizon answers while it
// holds an unacked delivery and after it is acked, without an error, and
// never with a horizon in the future.
func testRedeliveryHorizon(t *testing.T, s *suite) {
	msgs := NewMessages("horizon", 1, 1)
	Publish(s.ctx, t, s.h, msgs...)
	src := s.h.NewSource(t)
	defer closeSource(t, src)
	h, ok := src.(interface {
		RedeliveryHorizon(context.Context) (time.Time, bool, error)
	})
	if !ok {
		t.Skip("the Source has no RedeliveryHorizon method")
	}
	check := func(when string) {
		t.Helper()
		at, ok, err := h.RedeliveryHorizon(s.ctx)
		if err != nil {
			t.Fatalf("RedeliveryHorizon %s: %v", when, err)
		}
		if ok && at.After(time.Now().Add(time.Minute)) {
			t.Errorf("RedeliveryHorizon %s: %s, in the future", when, at)
		}
	}
	d := Receive(s.ctx, t, src)
	check("with a delivery held")
	if err := d.Ack(s.ctx); err != nil {
		t.Fatalf("ack: %v", err)
	}
	check("after the ack")
}
