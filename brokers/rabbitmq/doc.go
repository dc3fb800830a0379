// Package rabbitmq connects idemq to RabbitMQ through amqp091-go.
//
// [Source] implements [consumer.Source] with its optional methods:
// it consumes one queue with manual acks and a bounded prefetch, sized
// from the runtime's window (Concurrency × BatchSize) unless
// [Config].Prefetch fixes it, and logs to the runtime's logger (both come
// through Configure). [NewSource] connects and checks the
// queue and its dead-letter queue (declaring [Config].Topology first, if
// set), but consumes nothing until the first Receive, so the prefetch the
// runtime asks for is the one the broker applies. It maps each AMQP
// delivery to a
// [consumer.Message], acks and nacks on the channel that delivered the
// message, and reconnects with backoff inside Receive when the connection or
// channel is lost. Deliveries received on a channel that has since died are
// never acked on its replacement: their Ack and Nack return an error wrapping
// [consumer.ErrDeliveryStale], RabbitMQ redelivers them, and the runtime's
// dedup store absorbs the redelivery. (An Ack that returns nil was written to
// the connection; if the connection dies before the broker reads it, the
// broker redelivers the message all the same, and dedup covers that too.)
// [Source.Stats] counts abandoned deliveries and reconnections. A broker's
// consumer_timeout, which closes the channel with 406 PRECONDITION_FAILED, is
// recovered like any other channel loss.
//
// [Publisher] publishes with publisher confirms, persistent delivery and the
// mandatory flag, so Publish returns only once the broker has taken
// responsibility for every message, and an unroutable message is an error
// ([ErrUnroutable]) instead of a silent drop.
//
// [Browser] reads a queue, typically a dead-letter queue, without consuming
// it, for the dlq package's Inspect, Classify, Replay and Requeue: it notes
// the queue's depth when it opens, takes at most that many messages with
// basic.get, and holds them unacked until they are acked or it is closed,
// which gives the rest back to the queue in their order. It never
// reconnects: a lost connection ends the pass with every unacked message
// back in the queue.
//
// [Source.DeadLetterer] is the runtime's dead-letterer, made by NewSource
// from [Config].DeadLetter: it publishes each failed message in package
// dlq's envelope, with publisher confirms, to the topology's dead-letter
// queue ([Topology].DeadLetterQueue, by default [DLQName] of the Source's
// queue, or another one), on confirm-mode channels of the Source's own
// connection, following it across reconnections. It is owned by the Source
// and closed by [Source.Close]; there is nothing else to close. A consumer
// with its dead-letter queue thus takes three constructors: the dedup
// store, NewSource, and consumer.New with Source: src, which takes the
// Source's dead-letterer when consumer.Config.DeadLetterer is nil.
//
// [DeclareTopology], or [Config].Topology, declares a durable work queue
// (classic or quorum) with a dead-letter exchange and a dead-letter queue.
package rabbitmq
