// Package brokertest is the conformance suite every idemq broker adapter
// runs: the memory broker, RabbitMQ and Kafka. An adapter provides a Harness
// (publish to a fresh queue or topic, open sources on it) and a Features
// value saying which behaviours its broker has; Run executes every test
// that applies.
package brokertest

import (
	"context"
	"testing"

	"github.com/idemq/idemq/consumer"
)

// Features says what a broker supports. Tests for a missing feature are not
// run; they are not reported as skipped passes either.
type Features struct {
	// NackRequeue: Nack(ctx, true) makes the broker redeliver the message.
	NackRequeue bool
	// RedeliveredFlag: a redelivered message has Message.Redelivered set.
	RedeliveredFlag bool
	// GlobalOrder: one source receives messages in publish order. When
	// false, order is only kept per Message.Key (Kafka partitions).
	GlobalOrder bool
	// CompetingConsumers: two sources on one queue split its messages.
	CompetingConsumers bool
	// MessageID: the broker carries Message.ID from publisher to source.
	MessageID bool
	// Headers: the broker carries Message.Headers.
	Headers bool
}

// Harness is what an adapter gives the suite for one test: a fresh queue or
// topic, a way to publish to it, and a way to consume it.
type Harness interface {
	// Publish publishes msgs, in order, to the test's queue or topic and
	// returns once the broker has accepted them durably.
	Publish(ctx context.Context, msgs ...*consumer.Message) error
	// NewSource opens a new source on the test's queue or topic. The
	// suite closes it, but the harness should also close it at cleanup.
	NewSource(t *testing.T) consumer.Source
}

// Config tells Run how to make a Harness and what the broker supports.
type Config struct {
	Features Features
	// NewHarness makes a harness on a fresh queue or topic for one test.
	NewHarness func(t *testing.T) Harness
}
