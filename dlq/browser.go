package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/idemq/idemq/consumer"
)

// Browser reads the messages of a dead-letter queue as they were when it was
// opened, without consuming them: a message leaves the queue only when its
// delivery is acked. Next returns an error wrapping io.EOF once every message
// present at the start has been returned, so messages dead-lettered again
// during a replay are not read twice in one pass. Close gives every message
// that was not acked back to the queue (RabbitMQ: requeued; Kafka: nothing
// committed).
//
// The RabbitMQ and Kafka adapters provide browsers; SourceBrowser turns any
// consumer.Source into one.
type Browser interface {
	Next(ctx context.Context) (consumer.Delivery, error)
	Close() error
}

// SourceBrowser returns a Browser that reads at most limit deliveries from
// src, and reports io.EOF after that or when nothing arrives for idle
// (which defaults to 2s when zero). Use it with a source whose prefetch
// allows limit unacked deliveries, such as a memory broker subscription; a
// limit of 0 reads until idle. Close closes src.
func SourceBrowser(src consumer.Source, limit int, idle time.Duration) Browser {
	if idle <= 0 {
		idle = 2 * time.Second
	}
	return &sourceBrowser{src: src, limit: limit, idle: idle}
}

type sourceBrowser struct {
	src   consumer.Source
	limit int
	idle  time.Duration
	read  int
}

func (b *sourceBrowser) Next(ctx context.Context) (consumer.Delivery, error) {
	if b.limit > 0 && b.read >= b.limit {
		return nil, io.EOF
	}
	rctx, cancel := context.WithTimeout(ctx, b.idle)
	defer cancel()
	d, err := b.src.Receive(rctx)
	if err != nil {
		if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
			return nil, io.EOF
		}
		return nil, err
	}
	b.read++
	return d, nil
}

func (b *sourceBrowser) Close() error { return b.src.Close() }

// Filter selects dead-lettered messages. Empty fields match everything;
// non-empty fields must all match.
type Filter struct {
	// Consumer keeps messages dead-lettered by this consumer (the
	// x-idemq-consumer header). Replay sets it to its consumer's name, so
	// a shared DLQ never replays one consumer's messages through another.
	Consumer string
	// Classes keeps messages whose latest failure has one of these
	// classes.
	Classes []consumer.FailureClass
	// MessageIDs keeps these dedup ids.
	MessageIDs []string
	// Sources keeps messages that first came from these queues or topics.
	Sources []string
	// Since and Until bound the latest failure time (inclusive, exclusive).
	Since, Until time.Time
}

// Match reports whether r passes the filter.
func (f Filter) Match(r Record) bool {
	switch {
	case f.Consumer != "" && r.Consumer != "" && r.Consumer != f.Consumer:
		return false
	case len(f.Classes) > 0 && !slices.Contains(f.Classes, r.Class):
		return false
	case len(f.MessageIDs) > 0 && !slices.Contains(f.MessageIDs, r.MessageID):
		return false
	case len(f.Sources) > 0 && !slices.Contains(f.Sources, r.Source):
		return false
	case !f.Since.IsZero() && r.LastFailure.Before(f.Since):
		return false
	case !f.Until.IsZero() && !r.LastFailure.Before(f.Until):
		return false
	}
	return true
}

// FirstSeen is the earliest time the record knows of: its first failure, or
// the first failure in its history.
func (r Record) FirstSeen() time.Time {
	t := r.FirstFailure
	if t.IsZero() {
		t = r.LastFailure
	}
	for _, h := range r.History {
		if !h.FirstFailure.IsZero() && h.FirstFailure.Before(t) {
			t = h.FirstFailure
		}
	}
	return t
}

// readRecord parses the envelope of a browsed message. A message without
// an envelope gets a record built from the message: one the broker
// dead-lettered itself gets class consumer.ClassBroker (see brokerRecord).
func readRecord(msg *consumer.Message) (Record, error) {
	r, err := Parse(msg)
	if errors.Is(err, ErrNoEnvelope) {
		if r, ok := brokerRecord(msg); ok {
			return r, nil
		}
		return Record{Entry: Entry{MessageID: msg.ID, Source: msg.Source, Partition: -1, Offset: -1}}, nil
	}
	return r, err
}

// The headers RabbitMQ adds to a message it dead-letters itself, as the
// rabbitmq adapter maps them: x-death, its deaths, as a JSON array, most
// recent first (the adapter writes AMQP arrays and tables as JSON).
const (
	headerFirstDeathQueue  = "x-first-death-queue"
	headerFirstDeathReason = "x-first-death-reason"
	headerDeath            = "x-death"
	headerDeliveryCount    = "x-delivery-count"
)

// brokerRecord reads a message the broker dead-lettered itself, without
// idemq's envelope: its class is consumer.ClassBroker, its source the queue
// it died in (a replay republishes it there), its error the broker's
// reason, its failure time the broker's, and its consumer unknown (a
// replay or dry run checks the dedup table under the consumer it is
// given).
func brokerRecord(msg *consumer.Message) (Record, bool) {
	h := msg.Headers
	reason, queue := h[headerFirstDeathReason], h[headerFirstDeathQueue]
	if reason == "" || queue == "" {
		return Record{}, false
	}
	r := Record{Entry: Entry{MessageID: msg.ID, Class: consumer.ClassBroker, Source: queue, Partition: -1, Offset: -1}}
	var deaths []struct {
		Queue  string    `json:"queue"`
		Reason string    `json:"reason"`
		Count  int       `json:"count"`
		Time   time.Time `json:"time"`
	}
	if err := json.Unmarshal([]byte(h[headerDeath]), &deaths); err == nil {
		for _, d := range deaths {
			if d.Queue == queue && d.Reason == reason {
				r.LastFailure, r.FirstFailure, r.DeadLetters = d.Time, d.Time, d.Count
				break
			}
		}
	}
	r.Error = "dead-lettered by the broker: " + reason + " in queue " + strconv.Quote(queue)
	if n := h[headerDeliveryCount]; n != "" {
		r.Error += " after " + n + " redeliveries"
	}
	return r, true
}

// limiter paces a loop to rate events per second (0: unlimited).
type limiter struct {
	mu    sync.Mutex
	every time.Duration
	next  time.Time
}

func newLimiter(rate float64) *limiter {
	if rate <= 0 {
		return &limiter{}
	}
	return &limiter{every: time.Duration(float64(time.Second) / rate)}
}

func (l *limiter) wait(ctx context.Context) error {
	if l.every == 0 {
		return nil
	}
	l.mu.Lock()
	now := time.Now()
	if l.next.Before(now) {
		l.next = now
	}
	wait := l.next.Sub(now)
	l.next = l.next.Add(l.every)
	l.mu.Unlock()
	if wait <= 0 {
		return nil
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("dlq: rate limit wait: %w", ctx.Err())
	}
}
