package rabbitmq

import (
	"context"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Topology describes a durable work queue whose rejected messages go to a
// dead-letter queue through a dead-letter exchange.
type Topology struct {
	// Queue is the work queue's name. Required, except in
	// Config.Topology, where it defaults to Config.Queue.
	Queue string
	// DeadLetterExchange is the fanout exchange the work queue
	// dead-letters to (its x-dead-letter-exchange). Defaults to
	// Queue + ".dlx".
	DeadLetterExchange string
	// DeadLetterQueue is bound to DeadLetterExchange and receives the
	// dead-lettered messages. Defaults to DLQName(Queue), Queue + ".dlq".
	// A Source whose Config.Topology this is dead-letters to it (see
	// Source.DeadLetterer) without restating it.
	DeadLetterQueue string
	// Quorum declares both queues as quorum queues (x-queue-type:
	// quorum) rather than classic ones.
	Quorum bool
	// DeliveryLimit, for quorum queues only, is the x-delivery-limit:
	// after that many redeliveries the broker dead-letters a message
	// itself, without idemq's envelope (package dlq reads such dead
	// letters as consumer.ClassBroker). Every connection or node lost,
	// and every restart, while a message is in flight counts as a
	// redelivery, and idemq retries in the process: a Source whose
	// Topology sets a limit below 20 warns when it starts consuming.
	// Defaults to 0: no limit set, which leaves the broker's default
	// (none before RabbitMQ 4.0, 20 since). Setting it on a classic queue
	// is an error.
	DeliveryLimit int
}

// DLQName is the dead-letter queue of queue that DeclareTopology declares
// when Topology.DeadLetterQueue is empty, and that Source.DeadLetterer
// publishes to when neither Config.Topology nor Config.DeadLetter.Queue
// names another: queue + ".dlq".
func DLQName(queue string) string { return queue + ".dlq" }

func (t Topology) withDefaults() Topology {
	if t.DeadLetterExchange == "" {
		t.DeadLetterExchange = t.Queue + ".dlx"
	}
	if t.DeadLetterQueue == "" {
		t.DeadLetterQueue = DLQName(t.Queue)
	}
	return t
}

func (t Topology) validate() error {
	if err := checkName("Queue", t.Queue); err != nil {
		return err
	}
	if err := checkName("DeadLetterExchange", t.DeadLetterExchange); err != nil {
		return err
	}
	if err := checkName("DeadLetterQueue", t.DeadLetterQueue); err != nil {
		return err
	}
	switch {
	case t.DeliveryLimit < 0:
		return configError("DeliveryLimit", "%d is negative", t.DeliveryLimit)
	case t.DeliveryLimit > 0 && !t.Quorum:
		return configError("DeliveryLimit", "x-delivery-limit needs a quorum queue; set Quorum")
	case t.DeadLetterQueue == t.Queue:
		return configError("DeadLetterQueue", "must differ from Queue")
	}
	return nil
}

// DeclareTopology connects to url (DefaultURL if empty) and declares t: the
// dead-letter exchange (durable fanout), the dead-letter queue bound to it,
// and the durable work queue with x-dead-letter-exchange set. Declaring is
// idempotent, but it fails if a queue already exists with other arguments.
//
// NewSource declares Config.Topology the same way.
func DeclareTopology(ctx context.Context, url string, t Topology) error {
	if url == "" {
		url = DefaultURL
	}
	return declareTopology(ctx, newNodes(url, nil), "", defaultDialTimeout, t)
}

// declareTopology declares t on a connection of its own to one of nodes,
// which it closes.
func declareTopology(ctx context.Context, nodes *nodes, connName string, dialTimeout time.Duration, t Topology) error {
	t = t.withDefaults()
	if err := t.validate(); err != nil {
		return err
	}
	conn, _, err := nodes.dial(ctx, connName, dialTimeout)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("rabbitmq: declare topology: open channel: %w", err)
	}
	queueArgs := func() amqp.Table {
		a := amqp.Table{}
		if t.Quorum {
			a[amqp.QueueTypeArg] = amqp.QueueTypeQuorum
		}
		return a
	}
	if err := ch.ExchangeDeclare(t.DeadLetterExchange, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("rabbitmq: declare exchange %q: %w", t.DeadLetterExchange, err)
	}
	if _, err := ch.QueueDeclare(t.DeadLetterQueue, true, false, false, false, queueArgs()); err != nil {
		return fmt.Errorf("rabbitmq: declare queue %q: %w", t.DeadLetterQueue, err)
	}
	if err := ch.QueueBind(t.DeadLetterQueue, "", t.DeadLetterExchange, false, nil); err != nil {
		return fmt.Errorf("rabbitmq: bind queue %q to %q: %w", t.DeadLetterQueue, t.DeadLetterExchange, err)
	}
	args := queueArgs()
	args["x-dead-letter-exchange"] = t.DeadLetterExchange
	if t.DeliveryLimit > 0 {
		args["x-delivery-limit"] = int64(t.DeliveryLimit)
	}
	if _, err := ch.QueueDeclare(t.Queue, true, false, false, false, args); err != nil {
		return fmt.Errorf("rabbitmq: declare queue %q: %w", t.Queue, err)
	}
	return nil
}
