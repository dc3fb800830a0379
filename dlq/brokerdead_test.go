package dlq_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// TestRmqBrokerDeadLetters: a quorum queue's delivery limit makes RabbitMQ
// dead-letter messages itself, raw, without idemq's envelope: here, ones
// a consumer received and lost again and again, never applied. Inspect
// groups them as their own class, ClassBroker, under the queue they died
// in, with the broker's reason and time; the dry run finds them not
// applied; replay runs them through the consumer's dedup path, and each is
// applied once.
func TestRmqBrokerDeadLetters(t *testing.T) {
	e := rmqNewEnv(t, func(tp *rabbitmq.Topology) { tp.Quorum, tp.DeliveryLimit = true, 1 })
	msgs := rmqMessages("limit", 3)
	e.publish(e.queue, msgs...)

	// A consumer whose connection dies under every delivery: each comes
	// back with its delivery count raised, until the limit.
	deadline := time.Now().Add(30 * time.Second)
	for e.depth(e.dlqName) < len(msgs) {
		if time.Now().After(deadline) {
			t.Fatalf("the broker dead-lettered %d of %d messages", e.depth(e.dlqName), len(msgs))
		}
		rmqAdmin(t, func(ch *amqp.Channel) error {
			_, _, err := ch.Get(e.queue, false) // closing the channel returns it
			return err
		})
	}

	rep, err := dlq.Inspect(e.ctx, e.browser(), dlq.Filter{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Total != 3 || rep.Malformed != 0 || len(rep.Groups) != 1 {
		t.Fatalf("inspect: %+v", rep)
	}
	g := rep.Groups[0]
	if g.Class != consumer.ClassBroker || !slices.Equal(g.Sources, []string{e.queue}) || !strings.Contains(g.Error, "delivery_limit") ||
		g.LastSeen.IsZero() || time.Since(g.LastSeen) > time.Minute {
		t.Fatalf("group %+v: want class %s, source %s, the broker's reason and time", g, consumer.ClassBroker, e.queue)
	}

	cl, err := dlq.Classify(e.ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store, Consumer: rmqConsumerName, Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if cl.WillApply != 3 || cl.BeyondHorizon != 0 {
		t.Fatalf("dry run: %+v", cl)
	}
	res := e.replay(func(c *dlq.ReplayConfig) { c.Retention = time.Hour })
	if res.Applied != 3 {
		t.Fatalf("replay: %+v", res)
	}
	e.expectEffects(rmqIDs(msgs)...)
}
