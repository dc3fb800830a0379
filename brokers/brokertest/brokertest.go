// Package brokertest is the conformance suite every idemq broker adapter
// runs: memory, rabbitmq, kafka, franz, nats and redisstream. It checks the
// optional methods of consumer.Source (Configure, AckBatch,
// RedeliveryHorizon) on a Source that has them. An adapter provides a Harness
// (publish to a fresh queue or topic, open sources on it) and a Features
// value saying which behaviours its broker has; Run executes every test
// that applies.
package brokertest

import (
	"context"
	"testing"
	"time"

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

	// Timeout bounds each subtest: every Receive, Publish, Ack and Nack
	// in it runs under a context with this deadline. Defaults to 30s.
	Timeout time.Duration
	// QuietWait is how long the suite waits to conclude that nothing more
	// arrives on a source (after acks, say). Longer is stricter but
	// slower. Defaults to 500ms.
	QuietWait time.Duration
}

// Defaults for Config.
const (
	defaultTimeout   = 30 * time.Second
	defaultQuietWait = 500 * time.Millisecond
)

func (c Config) withDefaults() Config {
	if c.Timeout <= 0 {
		c.Timeout = defaultTimeout
	}
	if c.QuietWait <= 0 {
		c.QuietWait = defaultQuietWait
	}
	return c
}

// Run runs the conformance suite: one subtest per behaviour that cfg.Features
// says the broker has, each on a fresh harness from cfg.NewHarness. Every
// subtest is bounded by cfg.Timeout and fails, rather than hangs, when the
// broker misbehaves.
func Run(t *testing.T, cfg Config) {
	t.Helper()
	if cfg.NewHarness == nil {
		t.Fatal("brokertest: Config.NewHarness is nil")
	}
	cfg = cfg.withDefaults()
	f := cfg.Features

	tests := []struct {
		name string
		run  func(t *testing.T, s *suite)
		when bool
	}{
		{"PublishReceiveAck", testPublishReceiveAck, true},
		{"NackRequeue", testNackRequeue, f.NackRequeue},
		{"CloseRequeuesUnacked", testCloseRequeuesUnacked, true},
		{"OrderSingleConsumer", testOrderSingleConsumer, true},
		{"CompetingConsumers", testCompetingConsumers, f.CompetingConsumers},
		{"ManyMessages", testManyMessages, true},
		{"ReceiveAfterClose", testReceiveAfterClose, true},
		{"ReceiveHonoursContext", testReceiveHonoursContext, true},
		{"DoubleAck", testDoubleAck, true},
		// The optional methods of consumer.Source: each is checked
		// when the Source has it, and skipped (visibly) otherwise.
		{"Configure", testConfigure, true},
		{"AckBatch", testAckBatch, true},
		{"RedeliveryHorizon", testRedeliveryHorizon, true},
	}
	for _, tc := range tests {
		if !tc.when {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
			t.Cleanup(cancel)
			h := cfg.NewHarness(t)
			if h == nil {
				t.Fatal("brokertest: NewHarness returned nil")
			}
			tc.run(t, &suite{cfg: cfg, f: f, h: h, ctx: ctx})
		})
	}
}

// suite is the state one subtest works with.
type suite struct {
	cfg Config
	f   Features
	h   Harness
	ctx context.Context
}
