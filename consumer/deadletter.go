package consumer

import (
	"context"
	"time"
)

// FailureClass says why a message was dead-lettered. The values are part of
// the DLQ header contract.
type FailureClass string

// Failure classes.
const (
	// ClassRetryableExhausted: the handler kept failing until the retry
	// budget ran out.
	ClassRetryableExhausted FailureClass = "retryable-exhausted"
	// ClassPermanent: the handler returned an error made by Permanent.
	ClassPermanent FailureClass = "permanent"
	// ClassPanic: the handler panicked. Panics are not retried.
	ClassPanic FailureClass = "panic"
	// ClassMissingID: no usable message id: none could be extracted, it
	// was empty, it was longer than Config.MaxIDBytes, or it was not
	// valid UTF-8 text without NUL bytes (Postgres cannot store it).
	ClassMissingID FailureClass = "missing-id"
	// ClassFingerprintMismatch: the id was applied before with a
	// different payload.
	ClassFingerprintMismatch FailureClass = "fingerprint-mismatch"
	// ClassTooLarge: the body is over Config.MaxBodyBytes.
	ClassTooLarge FailureClass = "too-large"
	// ClassTimeout: the last attempt ran over Config.HandlerTimeout.
	ClassTimeout FailureClass = "timeout"
	// ClassBroker: the broker dead-lettered the message itself, without
	// idemq's envelope (RabbitMQ's delivery limit, a TTL or a length
	// limit), perhaps before it was ever applied. The runtime never gives
	// it; package dlq reads it off the broker's own headers.
	ClassBroker FailureClass = "broker"
	// ClassUnroutable: the Store is sharded (a ShardedStore) and could
	// not say which shard the message belongs to (its shard key was
	// missing, or the map's function failed). It is never claimed on a
	// shard of its own choosing.
	ClassUnroutable FailureClass = "unroutable"
)

// Failure describes why a message is being dead-lettered.
type Failure struct {
	// Consumer is the name of the consumer that gave up.
	Consumer string
	// MessageID is the extracted dedup id; empty for ClassMissingID.
	MessageID string
	// Class is the failure class.
	Class FailureClass
	// Err is the last error.
	Err error
	// Attempts is the number of handler attempts made (0 when the
	// handler never ran).
	Attempts int
	// FirstFailure and LastFailure bound the failed attempts.
	FirstFailure time.Time
	LastFailure  time.Time
	// ProcessedAt is, for ClassFingerprintMismatch, when the original
	// message with the same id was applied: its dedup row is the one a
	// replay depends on, so the replay-horizon guard dates the dead letter
	// by the earlier of this and FirstFailure. Zero for other classes.
	ProcessedAt time.Time
}

// DeadLetterer durably stores a copy of a failed message with the reason.
// The runtime acks the original only after DeadLetter returned nil, so
// DeadLetter must return only once the copy is durable (a confirmed
// publish, a committed row). If it returns an error (or panics) the call is
// retried with backoff while the original stays unacked and later messages
// with its key wait; at shutdown the original is requeued. The broker
// adapters' Sources have one of their own, which the runtime uses unless
// Config.DeadLetterer is set; dlq.NewDeadLetterer wraps any other
// confirmed publish.
type DeadLetterer interface {
	DeadLetter(ctx context.Context, msg *Message, f Failure) error
}

// DeadLettererFunc adapts a function to DeadLetterer.
type DeadLettererFunc func(ctx context.Context, msg *Message, f Failure) error

// DeadLetter calls f.
func (f DeadLettererFunc) DeadLetter(ctx context.Context, msg *Message, fl Failure) error {
	return f(ctx, msg, fl)
}
