package consumer

import (
	"context"
	"log/slog"
)

// Source is a stream of deliveries from a broker. The memory, RabbitMQ and
// Kafka adapters implement it, and third parties may implement it for other
// brokers. Implementations must be safe for concurrent use: the runtime calls
// Receive from one goroutine and acks from many.
type Source interface {
	// Receive blocks until a delivery is available, ctx is done, or the
	// source is closed. After Close it returns an error wrapping
	// ErrSourceClosed. A source that can recover from broker failures
	// (reconnecting, say) does so inside Receive rather than returning.
	Receive(ctx context.Context) (Delivery, error)
	// Close stops the source. Deliveries that were received but not acked
	// go back to the broker for redelivery. Close is idempotent.
	Close() error
}

// Delivery is one received message awaiting its outcome. Exactly one of Ack
// or Nack should be called; a later call returns an error.
type Delivery interface {
	// Message returns the delivered message. The runtime may set its
	// Attempt field; other fields are read-only.
	Message() *Message
	// Ack tells the broker the message is done and must not be
	// redelivered. The runtime acks only after the dedup row and the
	// effect (or the dead-letter copy) are durable.
	Ack(ctx context.Context) error
	// Nack gives the message back. With requeue, the broker redelivers it;
	// without, the broker drops or dead-letters it by its own rules. The
	// runtime only ever nacks with requeue: its own dead-lettering goes
	// through a DeadLetterer.
	Nack(ctx context.Context, requeue bool) error
}

// SourceSettings is what the runtime tells its Source, so that neither the
// window nor the logger is said twice: once on consumer.Config is enough.
type SourceSettings struct {
	// Window is the most deliveries the runtime holds unsettled at once:
	// Concurrency × BatchSize. A source that bounds its broker's
	// unacknowledged deliveries (RabbitMQ's prefetch, JetStream's
	// MaxAckPending, the memory broker's prefetch) sizes that bound from
	// it, so that a message or batch is waiting whenever a worker frees up.
	Window int
	// Logger is the runtime's logger. A source configured without a logger
	// of its own logs here.
	Logger *slog.Logger
}

// ConfigurableSource is a Source that takes SourceSettings from the runtime.
// The memory, RabbitMQ and Kafka adapters implement it, and so may other
// adapters. New calls Configure once, before the first Receive; a source
// used without a runtime keeps its own defaults.
type ConfigurableSource interface {
	Source
	// Configure applies s and returns the window the source will actually
	// hold: s.Window, unless its own configuration fixed another bound
	// (an explicit prefetch, say); 0 means no fixed bound. In batch mode
	// the runtime caps each lane's batch at window/Concurrency, rather than
	// wait for deliveries the window cannot let in. Configure must be
	// called before the first Receive; later calls may have no effect on a
	// consumer already started.
	Configure(s SourceSettings) (window int)
}
