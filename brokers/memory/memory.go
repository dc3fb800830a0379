// Package memory is an in-process message broker with real at-least-once
// semantics, for tests, examples and demos of idemq.
//
// It is modelled on watermill's pubsub/gochannel, but acks behave like
// RabbitMQ's: a message stays in its queue until a delivery of it is acked.
// Nack with requeue, and closing a subscription with unacked deliveries, put
// messages back at the head of the queue with Redelivered set; Nack without
// requeue moves a message to the queue's dead-letter queue, if one is set with
// [Broker.SetDeadLetterQueue], or drops it. Several subscriptions on one queue
// compete for its messages, served in the order they asked for them.
//
// Nothing is persisted: a message is "durable" once it is in the Broker's
// memory, which is what tests of the runtime need. The broker starts no
// goroutines.
package memory

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemq/idemq/consumer"
)

// defaultPrefetch is the number of unacked deliveries a subscription may hold
// when SubscribeOptions.Prefetch is zero.
const defaultPrefetch = 64

// ErrEmptyQueueName is returned (wrapped) when a queue name is empty.
var ErrEmptyQueueName = errors.New("memory: empty queue name")

// ErrNilMessage is returned (wrapped) by Publish when a message is nil.
var ErrNilMessage = errors.New("memory: nil message")

// Broker is an in-process broker. Its zero value is not usable; make one
// with NewBroker. A Broker is safe for concurrent use.
type Broker struct {
	mu      sync.Mutex
	queues  map[string]*queue
	nextTag uint64
}

// NewBroker returns an empty broker. Queues are created on first use.
func NewBroker() *Broker {
	return &Broker{queues: make(map[string]*queue)}
}

// queue is one named queue. All fields are guarded by Broker.mu.
type queue struct {
	name string
	// ready holds the messages waiting for delivery, head first.
	ready []*entry
	// waiters are the Receive calls waiting for a message, oldest first.
	waiters []*waiter
	// unacked is the number of deliveries out and not yet settled.
	unacked int
	// dlq is the dead-letter queue for Nack without requeue; "" drops.
	dlq   string
	stats QueueStats
	// changed is closed, and replaced, whenever the queue changes.
	changed chan struct{}
}

// entry is one stored message.
type entry struct {
	msg *consumer.Message
	// redelivered: the message was delivered before.
	redelivered bool
}

// waiter is one Receive call waiting for a message.
type waiter struct {
	sub *Subscription
	// ch receives the delivery handed to this waiter; it has room for
	// one, so the broker never blocks on it.
	ch chan *delivery
}

// QueueStats counts what happened to a queue. Ready, Unacked and Waiting are
// the current state; the rest are totals since the queue was created.
type QueueStats struct {
	// Ready is the number of messages waiting for delivery.
	Ready int
	// Unacked is the number of deliveries out and not yet settled.
	Unacked int
	// Waiting is the number of Receive calls blocked on the queue.
	Waiting int
	// Published counts messages stored in the queue, dead-lettered
	// copies included.
	Published int
	// Delivered counts deliveries handed to subscribers, redeliveries
	// included.
	Delivered int
	// Acked counts deliveries acked.
	Acked int
	// Requeued counts messages put back at the head for redelivery, by
	// Nack with requeue or by closing a subscription.
	Requeued int
	// DeadLettered counts messages moved to the dead-letter queue by Nack
	// without requeue.
	DeadLettered int
	// Dropped counts messages discarded by Nack without requeue when no
	// dead-letter queue is set.
	Dropped int
}

// queueLocked returns the named queue, creating it. b.mu must be held.
func (b *Broker) queueLocked(name string) *queue {
	q, ok := b.queues[name]
	if !ok {
		q = &queue{name: name, changed: make(chan struct{})}
		b.queues[name] = q
	}
	return q
}

// notify wakes WaitFor callers. b.mu must be held.
func (q *queue) notify() {
	close(q.changed)
	q.changed = make(chan struct{})
}

// Publish stores deep copies of msgs at the tail of queue, in order. Each
// copy gets Source set to the queue name, Partition and Offset set to -1, and
// Timestamp set to now if it is zero; Redelivered and Attempt are cleared.
// Publish returns once all the messages are stored, or an error and stores
// none of them.
func (b *Broker) Publish(ctx context.Context, queue string, msgs ...*consumer.Message) error {
	if queue == "" {
		return fmt.Errorf("memory: publish: %w", ErrEmptyQueueName)
	}
	for i, m := range msgs {
		if m == nil {
			return fmt.Errorf("memory: publish to %q: message %d: %w", queue, i, ErrNilMessage)
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("memory: publish to %q: %w", queue, err)
	}
	entries := make([]*entry, len(msgs))
	now := time.Now()
	for i, m := range msgs {
		c := m.Clone()
		c.Source = queue
		c.Partition = -1
		c.Offset = -1
		c.Redelivered = false
		c.Attempt = 0
		if c.Timestamp.IsZero() {
			c.Timestamp = now
		}
		entries[i] = &entry{msg: c}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	q := b.queueLocked(queue)
	q.ready = append(q.ready, entries...)
	q.stats.Published += len(entries)
	b.dispatchLocked(q)
	return nil
}

// SetDeadLetterQueue makes Nack without requeue, on deliveries from queue,
// move the message to dlq, like a RabbitMQ dead-letter exchange. An empty dlq
// removes the setting: such messages are then dropped.
func (b *Broker) SetDeadLetterQueue(queue, dlq string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.queueLocked(queue).dlq = dlq
	if dlq != "" {
		b.queueLocked(dlq)
	}
}

// dispatchLocked hands ready messages to waiting receivers, oldest waiter
// first, skipping waiters whose subscription is at its prefetch limit.
// b.mu must be held.
func (b *Broker) dispatchLocked(q *queue) {
	defer q.notify()
	i := 0
	for i < len(q.waiters) && len(q.ready) > 0 {
		w := q.waiters[i]
		if w.sub.closed || len(w.sub.inflight) >= w.sub.prefetch {
			i++
			continue
		}
		e := q.ready[0]
		q.ready[0] = nil
		q.ready = q.ready[1:]
		q.removeWaiterAt(i)
		w.ch <- b.deliverLocked(q, w.sub, e)
	}
}

// deliverLocked makes a delivery of e to sub. b.mu must be held.
func (b *Broker) deliverLocked(q *queue, sub *Subscription, e *entry) *delivery {
	b.nextTag++
	m := e.msg.Clone()
	m.Redelivered = e.redelivered
	d := &delivery{sub: sub, entry: e, msg: m, tag: b.nextTag}
	sub.inflight[d] = struct{}{}
	q.unacked++
	q.stats.Delivered++
	return d
}

// requeueLocked puts e back at the head of q, marked redelivered.
// b.mu must be held.
func (q *queue) requeueLocked(e *entry) {
	e.redelivered = true
	q.ready = append(q.ready, nil)
	copy(q.ready[1:], q.ready)
	q.ready[0] = e
	q.stats.Requeued++
}

// Ready returns the number of messages in queue waiting for delivery.
func (b *Broker) Ready(queue string) int { return b.Stats(queue).Ready }

// Unacked returns the number of deliveries from queue that are out and not
// yet acked or nacked.
func (b *Broker) Unacked(queue string) int { return b.Stats(queue).Unacked }

// Redeliveries returns the number of times a message of queue was put back
// for redelivery, by Nack with requeue or by closing a subscription.
func (b *Broker) Redeliveries(queue string) int { return b.Stats(queue).Requeued }

// Stats returns queue's counters. A queue never used has zero stats.
func (b *Broker) Stats(queue string) QueueStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	q, ok := b.queues[queue]
	if !ok {
		return QueueStats{}
	}
	return q.statsLocked()
}

func (q *queue) statsLocked() QueueStats {
	s := q.stats
	s.Ready = len(q.ready)
	s.Unacked = q.unacked
	s.Waiting = len(q.waiters)
	return s
}

// Messages returns copies of the messages waiting in queue, head first, with
// Redelivered set on those delivered before. It does not deliver them.
func (b *Broker) Messages(queue string) []*consumer.Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	q, ok := b.queues[queue]
	if !ok {
		return nil
	}
	out := make([]*consumer.Message, len(q.ready))
	for i, e := range q.ready {
		out[i] = e.msg.Clone()
		out[i].Redelivered = e.redelivered
	}
	return out
}

// WaitFor blocks until cond, called with queue's current stats after each
// change to the queue, returns true, or ctx is done. It is meant for tests:
// for example, wait until a queue is drained with
//
//	b.WaitFor(ctx, "orders", func(s memory.QueueStats) bool {
//		return s.Ready == 0 && s.Unacked == 0
//	})
func (b *Broker) WaitFor(ctx context.Context, queue string, cond func(QueueStats) bool) error {
	for {
		b.mu.Lock()
		q := b.queueLocked(queue)
		ok := cond(q.statsLocked())
		changed := q.changed
		b.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("memory: wait on queue %q: %w", queue, ctx.Err())
		}
	}
}

// Drained reports whether queue has no ready and no unacked messages.
func Drained(s QueueStats) bool { return s.Ready == 0 && s.Unacked == 0 }
