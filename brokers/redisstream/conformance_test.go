package redisstream_test

import (
	"context"
	"testing"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
)

// harness publishes to and consumes one fresh stream, all its sources
// members of one group. The suite's Key travels in the "key" field.
type harness struct {
	stream string
	pub    *redisstream.Publisher
}

func (h *harness) Publish(ctx context.Context, msgs ...*consumer.Message) error {
	_, err := h.pub.Publish(ctx, h.stream, msgs...)
	return err
}

// NewSource returns a Source as NewSource makes it: no runtime configures
// it, so it reads DefaultWindow entries at a time and holds twice that.
func (h *harness) NewSource(t *testing.T) consumer.Source {
	return newSource(t, redisstream.Config{Stream: h.stream, Group: "conformance"})
}

// TestConformance runs the shared broker suite. Redis keeps one stream in
// order; Nack re-delivers through the Source's own XCLAIM; Close releases the
// unacked entries so that the next source's XAUTOCLAIM takes them at once,
// flagged as redelivered.
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
			return &harness{stream: newStream(t, testURL()), pub: newPublisher(t, redisstream.PublisherConfig{})}
		},
	})
}
