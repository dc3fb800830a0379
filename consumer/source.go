package consumer

import (
	"context"
	"log/slog"
	"time"
)

// Source is a stream of deliveries from a broker. The adapters in
// brokers/ (memory, rabbitmq, kafka, franz, nats, redisstream) implement
// it, and third parties may implement it for other brokers.
// Implementations must be safe for concurrent use: the runtime calls
// Receive from one goroutine and acks from many.
//
// Receive and Close are required. A Source may also have any of these
// methods, which the runtime finds by type assertion; every adapter in
// brokers/ has all four, and brokertest.Run checks the first three when a
// Source has them:
//
//   - Configure(s SourceSettings) (window int): takes the runtime's window
//     and logger, so that neither is said twice. New calls it once, before
//     the first Receive. It returns the window the source will actually
//     hold: s.Window, unless its own configuration fixed another bound (an
//     explicit prefetch, say); 0 means no fixed bound. In batch mode the
//     runtime caps each lane's batch at window/Concurrency rather than
//     wait for deliveries the window cannot let in. A source used without
//     a runtime keeps its own defaults.
//   - AckBatch(ctx context.Context, ds []Delivery) error: settles many
//     deliveries in fewer broker calls than one each (RabbitMQ multiple
//     acks, Kafka offset commits). The runtime then acks every committed
//     transaction's deliveries through it; acks of dead-lettered
//     deliveries go through Delivery.Ack. It may send the acks later than
//     the call, never earlier; the source must send whatever still waits
//     when it is closed.
//   - RedeliveryHorizon(ctx context.Context) (horizon time.Time, ok bool,
//     err error): the oldest time a message the broker could still deliver
//     again can have been applied at, as far as the source can tell (for
//     Kafka, the timestamp of the oldest record past the group's committed
//     offsets; for RabbitMQ, the receipt of the oldest unsettled delivery).
//     The janitor then never purges a dedup row whose message could come
//     back (see Config.Retention). ok is false when the source cannot tell
//     yet (not joined, backlog not yet drained, broker unreachable): the
//     janitor then does not purge. A zero horizon with ok true means
//     nothing could be redelivered: the retention alone decides.
//   - DeadLetterer() DeadLetterer: the Source's own dead-letterer, which
//     writes to the dead-letter queue its configuration names (the
//     adapters' Config.DeadLetter), on the Source's own connection. The
//     runtime uses it when Config.DeadLetterer is nil, so that a broker's
//     dead-letter destination is said in one place.
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

// SourceSettings is what the runtime tells its Source through Configure (see
// Source), so that neither the window nor the logger is said twice: once on
// consumer.Config is enough.
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

// configurable, batchAcker, horizonSource and deadLetterSource are the
// optional methods of a Source (see Source).
type (
	configurable interface {
		Configure(s SourceSettings) (window int)
	}
	batchAcker interface {
		AckBatch(ctx context.Context, ds []Delivery) error
	}
	horizonSource interface {
		RedeliveryHorizon(ctx context.Context) (horizon time.Time, ok bool, err error)
	}
	deadLetterSource interface {
		DeadLetterer() DeadLetterer
	}
)
