package memory

import (
	"context"
	"fmt"
	"slices"

	"github.com/idemq/idemq/consumer"
)

// SubscribeOptions configures a Subscription. The zero value selects the
// defaults.
type SubscribeOptions struct {
	// Prefetch is the most unacked deliveries the subscription holds at
	// once; Receive blocks while it holds that many, like a RabbitMQ
	// consumer with basic.qos. Defaults to the runtime's window
	// (Concurrency × BatchSize, see consumer.Source's Configure) when a
	// runtime consumes it, and to 64 otherwise. Negative
	// values are invalid.
	Prefetch int
	// DeadLetter is the queue, on the same Broker, that the
	// Subscription's dead-letterer writes to (see
	// Subscription.DeadLetterer). Defaults to "<queue>.dlq".
	DeadLetter string
}

func (o SubscribeOptions) withDefaults() SubscribeOptions {
	if o.Prefetch == 0 {
		o.Prefetch = defaultPrefetch
	}
	return o
}

func (o SubscribeOptions) validate() error {
	if o.Prefetch < 0 {
		return &consumer.ConfigError{Field: "Prefetch", Reason: fmt.Sprintf("%d, must not be negative", o.Prefetch)}
	}
	return nil
}

// Subscription is a consumer on one queue. It implements consumer.Source:
// Receive takes the message at the head of the queue, and the message stays
// owned by the subscription until its delivery is acked or nacked. Several
// subscriptions on one queue compete for its messages.
type Subscription struct {
	b  *Broker
	q  *queue
	dl consumer.DeadLetterer
	// prefetch is guarded by b.mu; fixedPrefetch says the caller chose it.
	prefetch      int
	fixedPrefetch bool
	// done is closed by Close.
	done chan struct{}

	// Guarded by b.mu.
	closed   bool
	inflight map[*delivery]struct{}
}

// Window returns the subscription's prefetch.
func (s *Subscription) Window() int {
	s.b.mu.Lock()
	defer s.b.mu.Unlock()
	return s.prefetch
}

// Configure implements consumer.Source's Configure: unless
// SubscribeOptions.Prefetch was set, the prefetch becomes the runtime's
// window, so that every worker (or batch lane) can be busy at once. It
// returns the prefetch in force.
func (s *Subscription) Configure(set consumer.SourceSettings) int {
	s.b.mu.Lock()
	defer s.b.mu.Unlock()
	if !s.fixedPrefetch && set.Window > 0 {
		s.prefetch = set.Window
	}
	return s.prefetch
}

// Subscribe opens a subscription on queue, creating the queue if needed.
// The caller must Close it.
func (b *Broker) Subscribe(queue string, opts SubscribeOptions) (*Subscription, error) {
	if queue == "" {
		return nil, fmt.Errorf("memory: subscribe: %w", ErrEmptyQueueName)
	}
	if err := opts.validate(); err != nil {
		return nil, err
	}
	fixed := opts.Prefetch != 0
	opts = opts.withDefaults()
	if opts.DeadLetter == "" {
		opts.DeadLetter = queue + ".dlq"
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return &Subscription{
		b:             b,
		q:             b.queueLocked(queue),
		dl:            b.deadLetterer(opts.DeadLetter),
		prefetch:      opts.Prefetch,
		fixedPrefetch: fixed,
		done:          make(chan struct{}),
		inflight:      make(map[*delivery]struct{}),
	}, nil
}

// Queue returns the name of the subscribed queue.
func (s *Subscription) Queue() string { return s.q.name }

// Unacked returns the number of deliveries this subscription holds that are
// not yet acked or nacked.
func (s *Subscription) Unacked() int {
	s.b.mu.Lock()
	defer s.b.mu.Unlock()
	return len(s.inflight)
}

func (s *Subscription) closedErr(op string) error {
	return fmt.Errorf("memory: %s on queue %q: %w", op, s.q.name, consumer.ErrSourceClosed)
}

// Receive returns the delivery of the message at the head of the queue. It
// blocks while the queue is empty or the subscription holds Prefetch unacked
// deliveries, until a message is ready, ctx is done (the error wraps
// ctx.Err()), or the subscription is closed (the error wraps
// consumer.ErrSourceClosed). Concurrent Receive calls, on this or other
// subscriptions of the queue, are served in the order they started waiting.
func (s *Subscription) Receive(ctx context.Context) (consumer.Delivery, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("memory: receive on queue %q: %w", s.q.name, err)
	}
	b := s.b
	b.mu.Lock()
	if s.closed {
		b.mu.Unlock()
		return nil, s.closedErr("receive")
	}
	w := &waiter{sub: s, ch: make(chan *delivery, 1)}
	s.q.waiters = append(s.q.waiters, w)
	b.dispatchLocked(s.q)
	b.mu.Unlock()

	var got *delivery
	select {
	case got = <-w.ch:
	case <-ctx.Done():
	case <-s.done:
	}

	b.mu.Lock()
	defer b.mu.Unlock()
	if got == nil {
		if i := slices.Index(s.q.waiters, w); i >= 0 {
			s.q.removeWaiterAt(i)
		} else {
			// Dispatched meanwhile, or dropped by Close.
			select {
			case got = <-w.ch:
			default:
			}
		}
	}
	if s.closed {
		// Close requeued got, if any, with the other unacked deliveries.
		return nil, s.closedErr("receive")
	}
	if got != nil {
		return got, nil
	}
	return nil, fmt.Errorf("memory: receive on queue %q: %w", s.q.name, ctx.Err())
}

// Close closes the subscription. Its unacked deliveries go back to the head
// of the queue, in their original order and flagged as redelivered, and a
// later Ack or Nack of any of them returns an error wrapping
// consumer.ErrSourceClosed without touching the requeued message. Blocked
// and later Receive calls return an error wrapping consumer.ErrSourceClosed.
// Close is idempotent and always returns nil.
func (s *Subscription) Close() error {
	b := s.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	close(s.done)
	q := s.q
	q.waiters = slices.DeleteFunc(q.waiters, func(w *waiter) bool { return w.sub == s })

	out := make([]*delivery, 0, len(s.inflight))
	for d := range s.inflight {
		out = append(out, d)
	}
	// Requeue the newest first, so the oldest ends at the head.
	slices.SortFunc(out, func(a, b *delivery) int { return compareUint64(b.tag, a.tag) })
	for _, d := range out {
		d.state = stateClosed
		q.requeueLocked(d.entry)
		q.unacked--
	}
	clear(s.inflight)
	b.dispatchLocked(q)
	return nil
}

func compareUint64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// removeWaiterAt removes q.waiters[i]. The broker's mutex must be held.
func (q *queue) removeWaiterAt(i int) {
	q.waiters = slices.Delete(q.waiters, i, i+1)
}

// Delivery states.
const (
	stateLive = iota
	stateSettled
	stateClosed
)

// delivery is one delivery of a message to a subscription.
type delivery struct {
	sub   *Subscription
	entry *entry
	msg   *consumer.Message
	tag   uint64
	// state is guarded by the broker's mutex.
	state int
}

var _ consumer.Delivery = (*delivery)(nil)

// Message returns the delivered message: a copy of the stored one.
func (d *delivery) Message() *consumer.Message { return d.msg }

// settleLocked checks that d can be settled and marks it settled. The
// broker's mutex must be held.
func (d *delivery) settleLocked(op string) error {
	switch d.state {
	case stateSettled:
		return fmt.Errorf("memory: %s delivery %d on queue %q: already settled: %w", op, d.tag, d.sub.q.name, consumer.ErrDeliveryStale)
	case stateClosed:
		return fmt.Errorf("memory: %s delivery %d on queue %q: subscription closed and message requeued: %w", op, d.tag, d.sub.q.name, consumer.ErrSourceClosed)
	}
	d.state = stateSettled
	delete(d.sub.inflight, d)
	d.sub.q.unacked--
	return nil
}

// Ack removes the message from the queue for good. It ignores ctx: it
// cannot block.
func (d *delivery) Ack(context.Context) error {
	b := d.sub.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := d.settleLocked("ack"); err != nil {
		return err
	}
	q := d.sub.q
	q.stats.Acked++
	b.dispatchLocked(q)
	return nil
}

// Headers the broker adds to a message it dead-letters on Nack without
// requeue, after RabbitMQ's.
const (
	// HeaderFirstDeathQueue names the queue the message was rejected
	// from.
	HeaderFirstDeathQueue = "x-first-death-queue"
	// HeaderFirstDeathReason is "rejected".
	HeaderFirstDeathReason = "x-first-death-reason"
)

// Nack gives the message back. With requeue it goes back to the head of the
// queue, flagged as redelivered. Without, it moves to the queue's dead-letter
// queue (see Broker.SetDeadLetterQueue), gaining the HeaderFirstDeath*
// headers, or is dropped if none is set. It ignores ctx: it cannot block.
func (d *delivery) Nack(_ context.Context, requeue bool) error {
	b := d.sub.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := d.settleLocked("nack"); err != nil {
		return err
	}
	q := d.sub.q
	switch {
	case requeue:
		q.requeueLocked(d.entry)
	case q.dlq != "":
		m := d.entry.msg.Clone()
		if m.Headers == nil {
			m.Headers = make(map[string]string, 2)
		}
		if _, ok := m.Headers[HeaderFirstDeathQueue]; !ok {
			m.Headers[HeaderFirstDeathQueue] = q.name
			m.Headers[HeaderFirstDeathReason] = "rejected"
		}
		m.Source = q.dlq
		dq := b.queueLocked(q.dlq)
		dq.ready = append(dq.ready, &entry{msg: m})
		dq.stats.Published++
		q.stats.DeadLettered++
		b.dispatchLocked(dq)
	default:
		q.stats.Dropped++
	}
	b.dispatchLocked(q)
	return nil
}
