package rabbitmq

import (
	"context"
	"fmt"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// DeadLetterConfig configures the Source's dead-letterer (Config.DeadLetter,
// see Source.DeadLetterer). The zero value dead-letters to the topology's
// dead-letter queue, with unsigned envelopes.
type DeadLetterConfig struct {
	// Queue is the queue dead letters are published to, through the
	// default exchange. It must exist (NewSource checks it) and differ
	// from the Source's queue. Defaults to Config.Topology's
	// DeadLetterQueue when Config.Topology is set, and otherwise to
	// DLQName(Config.Queue), the dead-letter queue DeclareTopology
	// declares by default. Set it only for a dead-letter queue that
	// neither names: one DeclareTopology declared with another
	// Topology.DeadLetterQueue, say.
	Queue string
	// Options tune the failure envelope: Host, MaxErrorBytes,
	// MaxHistory, and SigningKey to sign it. Defaults to the zero
	// dlq.Options: unsigned envelopes.
	Options dlq.Options
}

// DeadLetterer returns the Source's dead-letterer, for the runtime's
// consumer.Config.DeadLetterer. NewSource made it from Config.DeadLetter,
// and checked that its queue exists; every call returns the same one. It
// publishes each failed message, wrapped in package dlq's envelope, to
// Config.DeadLetter.Queue (by default the topology's dead-letter queue).
// DeadLetter returns nil only once the broker confirmed the copy
// (publisher confirms, persistent, mandatory: a dead-letter queue that is
// gone is an error wrapping ErrUnroutable, not a silent drop), so the
// runtime never acks an original before its dead-letter copy is durable.
//
// It opens no connection of its own: it publishes on confirm-mode channels
// of the Source's connection, and after a lost connection on the one the
// Source reconnects with. Publishing never starts the Source's consumer:
// before the first Receive the Source stays connected without consuming.
//
// The Source owns the dead-letterer: Source.Close closes its channels with
// the connection, and DeadLetter after Close returns an error wrapping
// consumer.ErrSourceClosed. The runtime closes its Source only after the
// in-flight messages, dead letters included, have drained, so there is
// nothing to close besides the Source.
//
// If the connection is lost between the confirm and the original's ack,
// RabbitMQ redelivers the original, which then fails and is dead-lettered
// again: the dead-letter queue may hold a message twice, with the same
// x-idemq-message-id, and a replay applies it once.
func (s *Source) DeadLetterer() consumer.DeadLetterer { return s.dl }

// publishDeadLetter publishes m to the dead-letter queue on a confirm-mode
// channel of the current session's connection and waits for the confirm.
// It never starts the consumer (see session).
func (s *Source) publishDeadLetter(ctx context.Context, m *consumer.Message) error {
	queue := s.cfg.DeadLetter.Queue
	msgs := []*consumer.Message{m}
	if err := checkPublish("", queue, msgs); err != nil {
		return err
	}
	for retried := false; ; retried = true {
		if err := s.closedErr(); err != nil {
			return err
		}
		sess, err := s.session(ctx)
		if err != nil {
			return err
		}
		pc, err := s.deadLetterChannel(sess)
		if err != nil {
			if s.life.Err() != nil {
				return fmt.Errorf("%w (%v)", s.closedErr(), err)
			}
			if sess.conn.IsClosed() && !retried {
				// The connection died and Receive has not noticed
				// yet: retire the session and publish on the next.
				s.lost(sess)
				continue
			}
			return fmt.Errorf("rabbitmq: dead-letter to %q: %w", queue, err)
		}
		healthy, err := publishOn(ctx, pc, "", queue, msgs)
		s.releaseDeadLetterChannel(pc, healthy)
		if err != nil && s.life.Err() != nil {
			return fmt.Errorf("%w (%w)", s.closedErr(), err)
		}
		return err
	}
}

// deadLetterChannel returns an idle confirm-mode channel on sess's
// connection, or opens one. Channels of earlier connections are discarded.
func (s *Source) deadLetterChannel(sess *session) (*pubChannel, error) {
	s.dlMu.Lock()
	defer s.dlMu.Unlock()
	for len(s.dlIdle) > 0 {
		pc := s.dlIdle[len(s.dlIdle)-1]
		s.dlIdle = s.dlIdle[:len(s.dlIdle)-1]
		// amqp091 marks a dying connection closed before it closes its
		// channels: see Publisher.channel.
		if pc.conn == sess.conn && !sess.conn.IsClosed() && !pc.ch.IsClosed() {
			return pc, nil
		}
		_ = pc.ch.Close()
	}
	return openConfirmChannel(sess.conn)
}

// releaseDeadLetterChannel keeps a healthy channel for the next dead letter,
// and closes any other.
func (s *Source) releaseDeadLetterChannel(pc *pubChannel, healthy bool) {
	s.dlMu.Lock()
	defer s.dlMu.Unlock()
	if !healthy || s.life.Err() != nil || pc.conn.IsClosed() || pc.ch.IsClosed() {
		_ = pc.ch.Close()
		return
	}
	s.dlIdle = append(s.dlIdle, pc)
}

// closeDeadLetterChannels closes the idle dead-letter channels; Close calls
// it before it closes the connection.
func (s *Source) closeDeadLetterChannels() {
	s.dlMu.Lock()
	idle := s.dlIdle
	s.dlIdle = nil
	s.dlMu.Unlock()
	for _, pc := range idle {
		_ = pc.ch.Close()
	}
}
