package kafka_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
)

// TestConformance runs the shared broker suite against kfake over TCP.
//
// Kafka keeps order per partition, not globally; Nack requeues through the
// Source's own redelivery queue; a record re-read by a new source after a
// Close or rebalance cannot be flagged as redelivered, so RedeliveredFlag is
// false (the flag is still set on Nack redeliveries, tested below).
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
// is the key whose order it checks, and Kafka orders by record key (a
// Publisher writes RecordKey, never Key).
func (h *harness) Publish(ctx context.Context, msgs ...*consumer.Message) error {
	return h.e.pub.Publish(ctx, h.e.topic, withRecordKeys(msgs)...)
}

// withRecordKeys returns copies of msgs whose RecordKey is their Key.
func withRecordKeys(msgs []*consumer.Message) []*consumer.Message {
	out := make([]*consumer.Message, len(msgs))
	for i, m := range msgs {
		c := m.Clone()
		if c.Key != "" {
			c.RecordKey = []byte(c.Key)
		}
		out[i] = c
	}
	return out
}

// NewSource returns once the new source is a member of the group with an
// assignment, as a queue consumer is subscribed once created. Otherwise a
// source could take messages from partitions that a rebalance is about to
// give to the next one, which the CompetingConsumers test's lock-step
// publishing cannot tell from a broker that does not share.
func (h *harness) NewSource(t *testing.T) consumer.Source {
	s := h.e.source(t)
	waitFor(t, 20*time.Second, "the source to join its group", func() bool {
		_, ok := s.Assigned()
		return ok
	})
	return &keySource{t: t, Source: s}
}

// keySource presents the record key as Message.Key, because the suite
// compares Message.Key with the published key. The Kafka Source's Key is the
// ordering key "topic/partition" (the runtime serialises on it); the record
// key is RecordKey. keySource checks the ordering key and passes everything
// else through untouched.
type keySource struct {
	t *testing.T
	*kafka.Source
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
	if m.Metadata["kafka.key"] != string(m.RecordKey) {
		k.t.Errorf("record key %q, but Metadata[kafka.key] %q", m.RecordKey, m.Metadata["kafka.key"])
	}
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
