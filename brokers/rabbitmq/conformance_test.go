package rabbitmq_test

import (
	"context"
	"testing"
	"time"

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

// NewSource returns a Source that already consumes, as a runtime's would
// once it called Receive: a Source does not consume before its first
// Receive, and CompetingConsumers needs both of its sources consuming
// before it publishes, or the first to call Receive would be pushed a whole
// batch.
func (h *harness) NewSource(t *testing.T) consumer.Source {
	src := newSource(t, rabbitmq.Config{Queue: h.queue})
	if err := rabbitmq.StartConsuming(testCtx(t, 30*time.Second), src); err != nil {
		t.Fatal(err)
	}
	return src
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
