package rabbitmq

import (
	"errors"
	"fmt"
)

// Sentinel errors returned (wrapped) by the Publisher. Compare with
// errors.Is.
var (
	// ErrUnroutable: the broker returned a mandatory message because no
	// queue was bound to receive it.
	ErrUnroutable = errors.New("rabbitmq: message unroutable")
	// ErrNacked: the broker refused to take responsibility for a message
	// (a publisher-confirm nack). Publishing it again is safe.
	ErrNacked = errors.New("rabbitmq: message nacked by broker")
	// ErrUnconfirmed: the channel or connection was lost before the broker
	// confirmed a message. It may or may not have been enqueued; publish
	// it again, and let deduplication absorb a second copy.
	ErrUnconfirmed = errors.New("rabbitmq: message not confirmed: channel lost")
	// ErrPublisherClosed is returned by Publish after Close.
	ErrPublisherClosed = errors.New("rabbitmq: publisher closed")
	// ErrTooLong: an exchange, routing key or header name is longer than
	// the 255 bytes AMQP allows. Nothing was sent.
	ErrTooLong = errors.New("rabbitmq: longer than the 255 bytes AMQP allows")
)

// PublishError reports which message of a Publish call failed. Err wraps one
// of ErrUnroutable, ErrNacked or ErrUnconfirmed. Publish joins one
// PublishError per failed message with errors.Join.
type PublishError struct {
	// Index is the message's position in the Publish call.
	Index int
	// MessageID is the message's ID.
	MessageID string
	// Err is the reason.
	Err error
}

// Error describes the failed message and why it failed.
func (e *PublishError) Error() string {
	return fmt.Sprintf("rabbitmq: publish message %d (id %q): %v", e.Index, e.MessageID, e.Err)
}

// Unwrap returns Err.
func (e *PublishError) Unwrap() error { return e.Err }

// MessageIndex returns Index: the outbox relay, counting the error as an
// outbox.MessageError, reads it to retry only the messages that failed,
// never their confirmed siblings.
func (e *PublishError) MessageIndex() int { return e.Index }
