package franz_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/consumer"
)

// TestConformance runs the shared broker suite against kfake over TCP, with
// the features brokers/kafka's Source has: order per partition, Nack
// through the Source's own redelivery queue, and no Redelivered flag on a
// record re-read after a Close or rebalance.
func TestConformance(t *testing.T) {
	brokertest.Run(t, brokertest.Config{
		Features: brokertest.Features{
			NackRequeue:        true,
			RedeliveredFlag:    false,
			GlobalOrder:        false,
			CompetingConsumers: true,
			MessageID:          true,
			Headers:            true,
		},
		NewHarness: func(t *testing.T) brokertest.Harness {
			return &harness{e: newEnv(t, 4)}
		},
		// A new source must join the group before it could receive a
		// wrongly redelivered message: wait long enough for that.
		QuietWait: 1500 * time.Millisecond,
	})
}

type harness struct{ e *env }

// Publish publishes msgs with their Key as the record key: the suite's Key
// is the key whose order it checks, and Kafka orders by record key.
func (h *harness) Publish(ctx context.Context, msgs ...*consumer.Message) error {
	out := make([]*consumer.Message, len(msgs))
	for i, m := range msgs {
		c := m.Clone()
		if c.Key != "" {
			c.RecordKey = []byte(c.Key)
		}
		out[i] = c
	}
	return h.e.pub.Publish(ctx, h.e.topic, out...)
}

// NewSource returns once the new source is a member of the group with an
// assignment, as a queue consumer is subscribed once created.
func (h *harness) NewSource(t *testing.T) consumer.Source {
	s := h.e.source(t)
	waitFor(t, 20*time.Second, "the source to join its group", func() bool {
		ps, ok := s.Assigned()
		return ok && len(ps) > 0
	})
	return &keySource{t: t, Source: s}
}

// keySource presents the record key as Message.Key, because the suite
// compares Message.Key with the published key; it checks that Key is the
// ordering key "topic/partition" first.
type keySource struct {
	t *testing.T
	*franz.Source
}

func (k *keySource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := k.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	m := d.Message()
	if want := m.Source + "/" + strconv.Itoa(int(m.Partition)); m.Key != want {
		k.t.Errorf("ordering key: got %q, want %q", m.Key, want)
	}
	c := m.Clone()
	c.Key = string(m.RecordKey)
	return keyDelivery{Delivery: d, msg: c}, nil
}

type keyDelivery struct {
	consumer.Delivery
	msg *consumer.Message
}

func (d keyDelivery) Message() *consumer.Message { return d.msg }

// AckBatch hands the Source back its own deliveries.
func (k *keySource) AckBatch(ctx context.Context, ds []consumer.Delivery) error {
	own := make([]consumer.Delivery, len(ds))
	for i, d := range ds {
		own[i] = d.(keyDelivery).Delivery
	}
	return k.Source.AckBatch(ctx, own)
}
