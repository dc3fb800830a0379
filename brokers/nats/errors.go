package natsjs

import (
	"errors"
	"fmt"
)

// Sentinel errors returned (wrapped) by the Publisher and the dead-letterer.
// Compare with errors.Is.
var (
	// ErrNoStream: no JetStream stream captures the subject (the server
	// answered "no responders"). Nothing was stored.
	ErrNoStream = errors.New("natsjs: no stream captures the subject")
	// ErrRejected: the stream refused the message (a limit, a wrong
	// expected sequence, a message too large). Nothing was stored.
	ErrRejected = errors.New("natsjs: message rejected by the stream")
	// ErrUnconfirmed: no publish acknowledgement arrived (the context
	// ended, the connection was lost, the ack timed out). The message may
	// or may not be stored; publishing it again with the same Nats-Msg-Id
	// is safe within the stream's duplicate window, and deduplication by
	// the consumer absorbs a second copy beyond it.
	ErrUnconfirmed = errors.New("natsjs: message not confirmed")
	// ErrDuplicate: with PublisherConfig.RejectDuplicates, the stream
	// discarded the message as a duplicate of one with the same
	// Nats-Msg-Id inside its duplicate window: it holds the earlier copy,
	// not this one.
	ErrDuplicate = errors.New("natsjs: message discarded as a duplicate")
	// ErrPublisherClosed is returned by Publish after Close.
	ErrPublisherClosed = errors.New("natsjs: publisher closed")
)

// PublishError reports which message of a Publish call failed. Err wraps one
// of ErrNoStream, ErrRejected, ErrUnconfirmed or ErrDuplicate. Publish joins
// one PublishError per failed message with errors.Join.
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
	return fmt.Sprintf("natsjs: publish message %d (id %q): %v", e.Index, e.MessageID, e.Err)
}

// Unwrap returns Err.
func (e *PublishError) Unwrap() error { return e.Err }

// MessageIndex returns Index: the outbox relay, counting the error as an
// outbox.MessageError, reads it to retry only the messages that failed,
// never their confirmed siblings.
func (e *PublishError) MessageIndex() int { return e.Index }
