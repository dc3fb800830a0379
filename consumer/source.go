package consumer

import "context"

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

// WindowedSource is implemented by sources that hold at most a fixed number
// of unsettled deliveries at once: RabbitMQ's prefetch, the memory broker's.
// Batch mode uses it: a lane's batch cannot fill past what the window lets
// in, so the runtime caps batches at Window()/Concurrency (at least 1)
// rather than wait BatchWait for deliveries that cannot come, and New logs a
// warning when the window is below Concurrency×BatchSize.
type WindowedSource interface {
	Source
	// Window is the most deliveries the source holds unsettled at once.
	// 0 means no fixed bound.
	Window() int
}
