package kafka

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// DLQName is the dead-letter topic of topic that Source.DeadLetterer (and
// brokers/franz's) publishes to by default: topic + ".dlq".
func DLQName(topic string) string { return topic + ".dlq" }

// DeadLetterConfig configures Source.DeadLetterer, and brokers/franz's. The
// zero value dead-letters to DLQName of the Source's topic, with unsigned
// envelopes.
type DeadLetterConfig struct {
	// Topic is the dead-letter topic. It must exist, unless the brokers
	// create topics on first write: a write to a missing topic fails, and
	// the runtime retries it with the original uncommitted. It must differ
	// from the Source's topic. Defaults to DLQName(Config.Topic).
	Topic string
	// Options tune the failure envelope: Host, MaxErrorBytes,
	// MaxHistory, and SigningKey to sign it. Defaults to the zero
	// dlq.Options: unsigned envelopes.
	Options dlq.Options
}

// DeadLetterTopic returns the dead-letter topic of a Source consuming topic: c.Topic,
// or DLQName(topic) if it is empty. It fails if that is not a legal topic
// name or is topic itself.
func (c DeadLetterConfig) DeadLetterTopic(topic string) (string, error) {
	t := c.Topic
	if t == "" {
		t = DLQName(topic)
	}
	if err := validTopic(t); err != nil {
		return "", bad("DeadLetterConfig.Topic", "%v", err)
	}
	if t == topic {
		return "", bad("DeadLetterConfig.Topic", "%q is the Source's own topic: dead letters would be consumed again", t)
	}
	return t, nil
}

// DeadLetterer returns a dead-letterer for the runtime's
// consumer.Config.DeadLetterer that writes each failed message, wrapped in
// package dlq's envelope, to the dead-letter topic (by default
// DLQName(Config.Topic)). DeadLetter returns nil only once every in-sync
// replica acknowledged the write (acks=all), so the runtime never commits
// an original's offset before its dead-letter copy is durable. The copy keeps
// the record key (Message.RecordKey), so it lands in the partition that key
// hashes to.
//
// It writes through a Publisher on the Source's own transport (the
// Dialer's TLS and SASL included), made once per Source and shared by its
// dead-letterers. The Source owns it: Close closes it after the group is
// left, and DeadLetter after Close returns an error wrapping
// consumer.ErrSourceClosed. The runtime closes its Source only after the
// in-flight messages, dead letters included, have drained, so nothing needs
// closing besides the Source. Like NewSource, it does not contact the
// brokers.
func (s *Source) DeadLetterer(cfg DeadLetterConfig) (*dlq.DeadLetterer, error) {
	topic, err := cfg.DeadLetterTopic(s.cfg.Topic)
	if err != nil {
		return nil, err
	}
	pub, err := s.deadLetterPublisher()
	if err != nil {
		return nil, err
	}
	return dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		if s.isClosed() {
			return fmt.Errorf("kafka: dead-letter to %q: %w", topic, consumer.ErrSourceClosed)
		}
		err := pub.Publish(ctx, topic, m)
		if errors.Is(err, ErrPublisherClosed) {
			return fmt.Errorf("kafka: dead-letter to %q: %w", topic, consumer.ErrSourceClosed)
		}
		return err
	}, cfg.Options)
}

// deadLetterPublisher returns the Source's dead-letter Publisher, making it
// on first use.
func (s *Source) deadLetterPublisher() (*Publisher, error) {
	s.dlMu.Lock()
	defer s.dlMu.Unlock()
	if s.isClosed() {
		return nil, fmt.Errorf("kafka: dead-letterer: %w", consumer.ErrSourceClosed)
	}
	if s.dlPub == nil {
		pub, err := NewPublisher(PublisherConfig{
			Brokers:   s.cfg.Brokers,
			IDHeader:  s.cfg.IDHeader,
			Transport: s.transport,
			Logger:    s.cfg.Logger,
		})
		if err != nil {
			return nil, err
		}
		s.dlPub = pub
	}
	return s.dlPub, nil
}

// closeDeadLetterPublisher closes the dead-letter Publisher, if any, once
// its writes in flight are done. Close calls it.
func (s *Source) closeDeadLetterPublisher() error {
	s.dlMu.Lock()
	pub := s.dlPub
	s.dlMu.Unlock()
	if pub == nil {
		return nil
	}
	return pub.Close()
}
