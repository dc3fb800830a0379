package dlq

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemq/idemq/consumer"
)

// PublishFunc publishes one message to the dead-letter queue or topic and
// returns only once the broker has durably accepted it (a confirmed
// publish, an acknowledged write).
type PublishFunc func(ctx context.Context, msg *consumer.Message) error

// DeadLetterer implements consumer.DeadLetterer for any broker: it wraps the
// failed message in the envelope and publishes it with a PublishFunc.
//
// The broker adapters make one from their Source, publishing on the
// Source's own connection and closed with it: rabbitmq.Source.DeadLetterer
// (to the topology's dead-letter queue), kafka.Source.DeadLetterer and
// franz.Source.DeadLetterer (to the topic's "<topic>.dlq"), and
// memory.Broker.DeadLetterer. NewDeadLetterer is for other brokers, or
// another publish path, for instance:
//
//	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
//		return publisher.Publish(ctx, "", "payments.dlq", m)
//	}, dlq.Options{})
type DeadLetterer struct {
	publish PublishFunc
	opts    Options
}

var _ consumer.DeadLetterer = (*DeadLetterer)(nil)

// NewDeadLetterer returns a DeadLetterer publishing through publish.
func NewDeadLetterer(publish PublishFunc, opts Options) (*DeadLetterer, error) {
	if publish == nil {
		return nil, &consumer.ConfigError{Field: "publish", Reason: "required"}
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	return &DeadLetterer{publish: publish, opts: opts}, nil
}

// DeadLetter publishes the envelope of msg and returns once the broker
// accepted it. The runtime acks the original only after a nil return.
func (d *DeadLetterer) DeadLetter(ctx context.Context, msg *consumer.Message, f consumer.Failure) error {
	if msg == nil {
		return errors.New("dlq: nil message")
	}
	if err := d.publish(ctx, Envelope(msg, f, d.opts)); err != nil {
		return fmt.Errorf("dlq: publish dead letter for %q: %w", f.MessageID, err)
	}
	return nil
}
