package memory

import (
	"context"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// DeadLetterer returns a consumer.DeadLetterer that stores a copy of each
// failed message in dlqQueue on b: body and headers unchanged, wrapped in the
// failure envelope that package dlq defines for every broker (the
// x-idemq-* headers, which dlq.Parse reads). DeadLetter returns
// once the copy is stored, which for the memory broker is durable enough.
func (b *Broker) DeadLetterer(dlqQueue string) consumer.DeadLetterer {
	// NewDeadLetterer fails only for a nil func or invalid options,
	// neither of which can happen here.
	d, _ := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return b.Publish(ctx, dlqQueue, m)
	}, dlq.Options{})
	return d
}
