package kafka

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkamsg"
)

// DLQName is the dead-letter topic of topic that Source.DeadLetterer (and
// brokers/franz's) publishes to by default: topic + ".dlq".
func DLQName(topic string) string { return kafkamsg.DLQName(topic) }

// DeadLetterConfig configures the dead-letterer of a Source (Source.DeadLetterer),
// as Config.DeadLetter, and of brokers/franz's, as its Config.DeadLetter.
// The zero value dead-letters to DLQName of the Source's topic, with
// unsigned envelopes.
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
	t, err := kafkamsg.DeadLetterTopic(c.Topic, topic)
	if err != nil {
		return "", bad("DeadLetterConfig.Topic", "%v", err)
	}
	return t, nil
}

// DeadLetterer returns the Source's dead-letterer, for the runtime's
// consumer.Config.DeadLetterer. NewSource builds it from Config.DeadLetter,
// so this never fails and always returns the same one. It writes each
// failed message, wrapped in package dlq's envelope, to the dead-letter
// topic (by default DLQName(Config.Topic)). DeadLetter returns nil only once
// every in-sync replica acknowledged the write (acks=all), so the runtime
// never commits an original's offset before its dead-letter copy is
// durable. The copy keeps the record key (Message.RecordKey), so it lands in
// the partition that key hashes to.
//
// It writes through a Publisher on the Source's own transport (the
// Dialer's TLS and SASL included), which connects on the first dead letter.
// The Source owns it: Close closes it after the group is left, and
// DeadLetter after Close returns an error wrapping consumer.ErrSourceClosed.
// The runtime closes its Source only after the in-flight messages, dead
// letters included, have drained, so nothing needs closing besides the
// Source.
func (s *Source) DeadLetterer() consumer.DeadLetterer { return s.dl }

// newDeadLetterer validates cfg.DeadLetter and builds the Source's
// dead-letterer and its Publisher, which logs where the Source does. It
// does not contact the brokers. NewSource calls it.
func (s *Source) newDeadLetterer() error {
	cfg := s.cfg
	topic, err := cfg.DeadLetter.DeadLetterTopic(cfg.Topic)
	if err != nil {
		return bad("DeadLetter.Topic", "%v", configReason(err))
	}
	pub, err := newPublisher(PublisherConfig{
		Brokers:   cfg.Brokers,
		Transport: s.transport,
	}, s.logger)
	if err != nil {
		return err
	}
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		if s.isClosed() {
			return fmt.Errorf("kafka: dead-letter to %q: %w", topic, consumer.ErrSourceClosed)
		}
		err := pub.Publish(ctx, topic, m)
		if errors.Is(err, ErrPublisherClosed) {
			return fmt.Errorf("kafka: dead-letter to %q: %w", topic, consumer.ErrSourceClosed)
		}
		return err
	}, cfg.DeadLetter.Options)
	if err != nil {
		_ = pub.Close()
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return bad("DeadLetter.Options."+ce.Field, "%s", ce.Reason)
		}
		return bad("DeadLetter.Options", "%v", err)
	}
	s.dlPub, s.dl = pub, dl
	return nil
}

// configReason is the reason of a *consumer.ConfigError, or err's text.
func configReason(err error) string {
	var ce *consumer.ConfigError
	if errors.As(err, &ce) {
		return ce.Reason
	}
	return err.Error()
}
