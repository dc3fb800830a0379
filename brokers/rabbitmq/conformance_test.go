package rabbitmq_test

import (
	"context"
	"testing"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
)

// harness publishes to and consumes from one fresh queue.
type harness struct {
	queue string
	pub   *rabbitmq.Publisher
}

func (h *harness) Publish(ctx context.Context, msgs ...*consumer.Message) error {
	return h.pub.Publish(ctx, "", h.queue, msgs...)
}

func (h *harness) NewSource(t *testing.T) consumer.Source {
	return newSource(t, rabbitmq.Config{Queue: h.queue})
}

func TestConformance(t *testing.T) {
	t.Parallel()
	brokertest.Run(t, brokertest.Config{
		Features: brokertest.Features{
			NackRequeue:        true,
			RedeliveredFlag:    true,
			GlobalOrder:        true,
			CompetingConsumers: true,
			MessageID:          true,
			Headers:            true,
		},
		NewHarness: func(t *testing.T) brokertest.Harness {
			return &harness{queue: newQueue(t), pub: newPublisher(t, rabbitmq.PublisherConfig{})}
		},
	})
}
