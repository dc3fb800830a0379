package natsjs_test

import (
	"context"
	"testing"

	"github.com/idemq/idemq/brokers/brokertest"
	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
)

// harness publishes to and consumes from one fresh stream; its sources
// share one durable consumer.
type harness struct {
	n   names
	pub *natsjs.Publisher
}

func (h *harness) Publish(ctx context.Context, msgs ...*consumer.Message) error {
	return h.pub.Publish(ctx, h.n.subject, msgs...)
}

func (h *harness) NewSource(t *testing.T) consumer.Source {
	return newSource(t, h.n.config())
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
			return &harness{n: newTopology(t, 0), pub: newPublisher(t, natsjs.PublisherConfig{})}
		},
	})
}
