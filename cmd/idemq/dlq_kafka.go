package main

import (
	"context"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
)

// openKafkaDLQ opens a Kafka dead-letter topic: a browser that reads it as
// it is now, without a consumer group, so nothing is ever committed (a
// Kafka log cannot delete a record: every run reads the whole topic again,
// and already-applied records are skipped through the dedup table). With
// withPublisher it also opens a publisher that republishes records, with
// their original dedup id in the idempotency-key header, to their original
// topic.
//
// The browser does not give records without an id header a fallback id:
// the dedup id of a dead letter is the one in its envelope
// (x-idemq-message-id), and a dead letter without one (class missing-id)
// must stay without one rather than get an id made of its coordinates in
// the dead-letter topic.
func openKafkaDLQ(ctx context.Context, b *brokerFlags, withPublisher bool) (*dlqConn, error) {
	brokers := splitList(b.kafkaBrokers)
	if len(brokers) == 0 {
		return nil, usagef("--kafka-brokers %q: want host:port addresses, comma-separated", b.kafkaBrokers)
	}
	br, err := kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: brokers, Topic: b.topic})
	if err != nil {
		return nil, err
	}
	c := &dlqConn{browser: br, close: func() { _ = br.Close() }}
	if withPublisher {
		pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers})
		if err != nil {
			_ = br.Close()
			return nil, err
		}
		c.publish = func(ctx context.Context, topic string, m *consumer.Message) error {
			return pub.Publish(ctx, topic, m)
		}
		c.close = func() { _ = br.Close(); _ = pub.Close() }
	}
	return c, nil
}
