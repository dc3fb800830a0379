package natsjs

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/idemq/idemq/consumer"
)

// DeadLetterer returns the Source's dead-letterer, for the runtime's
// consumer.Config.DeadLetterer. NewSource made it from Config.DeadLetter,
// and checked that a stream captures its subject; every call returns the
// same one. It publishes each failed message, wrapped in package dlq's
// envelope, to Config.DeadLetter.Subject (by default "<subject>.dlq") on
// the Source's connection, and DeadLetter returns nil only once the
// dead-letter stream acknowledged the copy, so the runtime never acks an
// original before its dead-letter copy is stored.
//
// The copy carries the original's body and headers, except JetStream's own
// (Nats-Msg-Id and the other Nats-* headers): the dead-letter stream
// must not discard a second dead letter of the same id as a duplicate. If
// the connection is lost between the stream's acknowledgement and the
// original's ack, JetStream redelivers the original, which fails and is
// dead-lettered again: the dead-letter stream may then hold a message
// twice, with the same x-idemq-message-id, and a replay applies it once.
//
// The Source owns the dead-letterer: after Source.Close, DeadLetter returns
// an error wrapping consumer.ErrSourceClosed. The runtime closes its Source
// only after the in-flight messages, dead letters included, have drained.
func (s *Source) DeadLetterer() consumer.DeadLetterer { return s.dl }

func (s *Source) publishDeadLetter(ctx context.Context, m *consumer.Message) error {
	if err := s.closedErr(); err != nil {
		return err
	}
	subject := s.cfg.DeadLetter.Subject
	msgs := []*consumer.Message{m}
	err := publishAll(ctx, s.js, []*nats.Msg{natsMsg(subject, m, false)}, msgs, false)
	if err != nil {
		if cerr := s.closedErr(); cerr != nil {
			return fmt.Errorf("%w (%w)", cerr, err)
		}
		return fmt.Errorf("natsjs: dead-letter to %q: %w", subject, err)
	}
	return nil
}
