package memory

import (
	"context"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// DeadLetterer returns the Subscription's dead-letterer, which the runtime
// uses unless consumer.Config.DeadLetterer is set: it stores a copy of each
// failed message in the SubscribeOptions.DeadLetter queue of the same
// Broker, body and headers unchanged, wrapped in the failure envelope that
// package dlq defines for every broker (the x-idemq-* headers, which
// dlq.Parse reads). DeadLetter returns once the copy is stored, which for
// the memory broker is durable enough. It keeps working after Close.
func (s *Subscription) DeadLetterer() consumer.DeadLetterer { return s.dl }

func (b *Broker) deadLetterer(queue string) consumer.DeadLetterer {
	// NewDeadLetterer fails only for a nil func or invalid options,
	// neither of which can happen here.
	d, _ := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return b.Publish(ctx, queue, m)
	}, dlq.Options{})
	return d
}
