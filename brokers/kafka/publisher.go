package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkamsg"
	kafkago "github.com/segmentio/kafka-go"
)

// ErrPublisherClosed is returned (wrapped) by Publish after Close.
var ErrPublisherClosed = errors.New("kafka: publisher closed")

// Publisher writes consumer.Messages to Kafka topics, for dead-letter topics,
// examples, benchmarks and tests. Each Publish is synchronous and waits for
// every in-sync replica to acknowledge the write (acks=all). A Publisher is
// safe for concurrent use. Create one with NewPublisher.
type Publisher struct {
	cfg       PublisherConfig
	w         *kafkago.Writer
	transport *kafkago.Transport
	owned     bool // the Publisher made transport and closes it

	mu     sync.RWMutex
	closed bool
}

// NewPublisher validates cfg and returns a Publisher. It does not connect
// until the first Publish.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	cfg = cfg.withDefaults()
	l := cfg.Logger
	return newPublisher(cfg, func() *slog.Logger { return l })
}

// newPublisher is NewPublisher with kafka-go's logs going to whatever
// logger log returns at the time, not to cfg.Logger: a Source's
// dead-letter Publisher logs where the Source does.
func newPublisher(cfg PublisherConfig, log func() *slog.Logger) (*Publisher, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	p := &Publisher{cfg: cfg, transport: cfg.Transport}
	if p.transport == nil {
		p.transport = &kafkago.Transport{}
		p.owned = true
	}
	p.w = &kafkago.Writer{
		Addr:                   kafkago.TCP(cfg.Brokers...),
		Balancer:               &kafkago.Murmur2Balancer{},
		RequiredAcks:           kafkago.RequireAll,
		Async:                  false,
		BatchTimeout:           cfg.BatchTimeout,
		WriteTimeout:           cfg.WriteTimeout,
		AllowAutoTopicCreation: cfg.AllowAutoTopicCreation,
		Transport:              p.transport,
		Logger:                 kafkaLogger(log, slog.LevelDebug),
		ErrorLogger:            kafkaLogger(log, slog.LevelWarn),
	}
	return p, nil
}

// Publish writes msgs to topic and returns once every one of them is
// acknowledged by all in-sync replicas, or with an error. Message.ID goes to
// the "idempotency-key" header (replacing a header of that name in Headers),
// Headers to record headers, RecordKey to the record key (nil writes a null
// key; records with the same key go to the same partition, by the Java
// client's murmur2 hash), Body to the value and Timestamp, if set, to the
// record timestamp. Message.Key, the runtime's ordering key (for a consumed
// record "topic/partition"), is never written: a dead-lettered or requeued
// record keeps the record key it was consumed with. Other fields are
// ignored. On error some messages may have been written.
func (p *Publisher) Publish(ctx context.Context, topic string, msgs ...*consumer.Message) error {
	if err := validTopic(topic); err != nil {
		return fmt.Errorf("kafka: publish: topic: %w", err)
	}
	if len(msgs) == 0 {
		return nil
	}
	records := make([]kafkago.Message, len(msgs))
	for i, m := range msgs {
		if m == nil {
			return fmt.Errorf("kafka: publish: message %d is nil", i)
		}
		records[i] = p.record(topic, m)
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return fmt.Errorf("kafka: publish to %q: %w", topic, ErrPublisherClosed)
	}
	if err := p.w.WriteMessages(ctx, records...); err != nil {
		switch {
		case errors.Is(err, io.ErrClosedPipe):
			err = ErrPublisherClosed
		case tooLarge(err):
			err = fmt.Errorf("%w: %w", consumer.ErrMessageTooLarge, err)
		}
		return fmt.Errorf("kafka: publish %d messages to %q: %w", len(msgs), topic, err)
	}
	return nil
}

// tooLarge reports whether a write failed for a record's size: refused by
// the writer's BatchBytes, or by the broker (max.message.bytes), for the
// whole write or, in kafka-go's WriteErrors, for one of its records.
func tooLarge(err error) bool {
	var wes kafkago.WriteErrors
	if errors.As(err, &wes) {
		return slices.ContainsFunc(wes, func(e error) bool { return e != nil && tooLarge(e) })
	}
	var mtl kafkago.MessageTooLargeError
	return errors.As(err, &mtl) || errors.Is(err, kafkago.MessageSizeTooLarge)
}

func (p *Publisher) record(topic string, m *consumer.Message) kafkago.Message {
	return kafkaRecord(kafkamsg.Out(topic, m))
}

// Close waits for Publish calls in progress, then releases the connections.
// Close is idempotent; Publish after Close returns an error wrapping
// ErrPublisherClosed.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	err := p.w.Close()
	if p.owned {
		p.transport.CloseIdleConnections()
	}
	if err != nil {
		return fmt.Errorf("kafka: close publisher: %w", err)
	}
	return nil
}
