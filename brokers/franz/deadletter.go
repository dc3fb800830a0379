package franz

import (
	"context"
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkamsg"
)

// DeadLetterer returns the Source's dead-letterer, for the runtime's
// consumer.Config.DeadLetterer. NewSource builds it from Config.DeadLetter,
// so this never fails and always returns the same one. It produces each
// failed message, wrapped in package dlq's envelope, to the dead-letter
// topic: Config.DeadLetter.Topic, by default
// "<topic>.dlq". The record is the one brokers/kafka's Publisher would
// write: the record key is Message.RecordKey, so the
// copy lands in the partition that key hashes to (murmur2, as the Java
// client and kafka.Publisher do), and the id goes to the idempotency-key
// header.
// DeadLetter returns nil only once the write is acknowledged by every
// in-sync replica (franz-go's default acks=all, unless Config.Options
// change it), so the runtime never commits an original's offset before its
// dead-letter copy is durable.
//
// It produces on the Source's own franz-go client (with its TLS, SASL and
// other Options), which keeps its produce connections next to its fetch
// ones. The Source owns it: Close closes the client, and DeadLetter after
// Close returns an error wrapping consumer.ErrSourceClosed. The runtime
// closes its Source only after the in-flight messages, dead letters
// included, have drained, so nothing needs closing besides the Source.
func (s *Source) DeadLetterer() consumer.DeadLetterer { return s.dl }

// newDeadLetterer validates cfg.DeadLetter and builds the Source's
// dead-letterer, which produces on s.cl. NewSource calls it before making
// the client, so an invalid config leaves nothing to close.
func (s *Source) newDeadLetterer() error {
	cfg := s.cfg
	topic, err := kafkamsg.DeadLetterTopic(cfg.DeadLetter.Topic, cfg.Topic)
	if err != nil {
		return bad("DeadLetter.Topic", "%v", err)
	}
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		if s.isClosed() {
			return fmt.Errorf("franz: dead-letter to %q: %w", topic, consumer.ErrSourceClosed)
		}
		r := kafkamsg.Out(topic, m)
		rec := &kgo.Record{Topic: topic, Key: r.Key, Value: r.Value, Timestamp: r.Time}
		if len(r.Headers) > 0 {
			rec.Headers = make([]kgo.RecordHeader, len(r.Headers))
			for i, h := range r.Headers {
				rec.Headers[i] = kgo.RecordHeader{Key: h.Key, Value: h.Value}
			}
		}
		if err := s.cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
			if errors.Is(err, kgo.ErrClientClosed) || s.isClosed() {
				return fmt.Errorf("franz: dead-letter to %q: %w (%v)", topic, consumer.ErrSourceClosed, err)
			}
			if errors.Is(err, kerr.MessageTooLarge) || errors.Is(err, kerr.RecordListTooLarge) {
				// Refused for its size, by the client's
				// ProducerBatchMaxBytes or the topic's
				// max.message.bytes: the dead-letterer retries it
				// truncated.
				err = fmt.Errorf("%w: %w", consumer.ErrMessageTooLarge, err)
			}
			return fmt.Errorf("franz: dead-letter to %q: %w", topic, err)
		}
		return nil
	}, cfg.DeadLetter.Options)
	if err != nil {
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return bad("DeadLetter.Options."+ce.Field, "%s", ce.Reason)
		}
		return bad("DeadLetter.Options", "%v", err)
	}
	s.dl = dl
	return nil
}
