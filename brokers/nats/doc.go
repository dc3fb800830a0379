// Package natsjs connects idemq to NATS JetStream through nats.go's
// jetstream package. It lives in brokers/nats but is named natsjs, so that
// it does not clash with the client's own package nats, which Config.Options
// takes:
//
//	import natsjs "github.com/idemq/idemq/brokers/nats"
//
// [Source] implements [consumer.Source] with its optional Configure,
// AckBatch, RedeliveryHorizon and DeadLetterer methods: it consumes a stream
// through a durable pull consumer with explicit acks. [NewSource] connects,
// declares [Config].Topology if set, and checks the stream and the
// dead-letter subject, but pulls nothing: the first Receive creates (or
// updates) the durable consumer with the AckWait, MaxDeliver and
// MaxAckPending in force, MaxAckPending being 2× the runtime's window
// (Concurrency × BatchSize) unless [Config].MaxAckPending fixes it, and
// the client buffers at most a window's worth of messages besides the ones
// the runtime holds. [Source.RedeliveryHorizon] tells the runtime's
// janitor when the stream stored the oldest message the durable could
// still hand out (the first on its subject past its ack floor), so that no
// dedup row is purged while its message can come back.
//
// Acks are confirmed: each ack asks the server for an answer, and Ack
// returns nil only once the server recorded it; AckBatch sends a batch's
// acks together and waits for all their answers at once. The runtime acks only after the dedup row and the
// effect (or the dead-letter copy) committed. Nack is a nak delayed by
// [Config].NakDelay; a message is never terminated (Term), whatever the
// requeue flag, since JetStream has no dead-letter queue of its own and
// idemq never drops a message it has not dead-lettered. While the runtime
// holds a delivery, the Source sends InProgress every AckWait/3, so a
// handler slower than AckWait is not redelivered under itself; the
// keep-alive stops at Ack, Nack and Close. Close stops pulling, naks every
// delivery it holds or has buffered and not settled (they come back at
// once), and closes the connection. A process that dies without Close
// sends nothing: its messages come back once AckWait has passed, and the
// dedup store skips those it had applied. The client reconnects by itself;
// acks are valid across reconnections, since JetStream tracks them by
// sequence, not by connection.
//
// Each JetStream message becomes a [consumer.Message]: ID from the
// Nats-Msg-Id header, which [Publisher] sets (an id kept elsewhere is read
// by the runtime's consumer.Config.MessageID), Key from the x-idemq-key
// header, which [Publisher] writes (order by something else, the subject
// say, with consumer.Config.OrderingKey), Source the subject, Partition -1, Offset the stream sequence,
// Redelivered when the server counts more than one delivery, Timestamp
// when the stream stored it, and the stream, consumer, sequences and
// delivery count in Metadata.
//
// MaxDeliver defaults to -1, unlimited, and should stay so (or large): the
// runtime retries and dead-letters failing messages itself, so JetStream's
// delivery count only grows through crashes, lost acks and shutdowns. A
// message that reaches MaxDeliver is never delivered again and never
// dead-lettered: it stays in the stream, with only the server's
// $JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES advisory to show for it.
//
// [Publisher] publishes with JetStream acknowledgements: Publish returns
// only once the stream stored every message, Message.ID travels as
// Nats-Msg-Id (so the stream drops a republished copy inside its duplicate
// window), and failures are [*PublishError] values wrapping [ErrNoStream],
// [ErrRejected], [ErrUnconfirmed] or [ErrDuplicate].
//
// [Source.DeadLetterer] is the runtime's dead-letterer, made by NewSource
// from [Config].DeadLetter: it publishes each failed message in package
// dlq's envelope to the dead-letter subject, by default "<subject>.dlq",
// which some stream must capture ([Config].Topology declares one,
// "<stream>_DLQ"), and returns only once that stream acknowledged it. It
// uses the Source's connection and is closed with it.
//
// Persistence: the runtime's guarantee holds as far as JetStream keeps
// what it acknowledged. On file storage a publish ack (of a work message or
// a dead letter) and the consumer's ack state are written to the operating
// system at once but flushed to disk only periodically (every two minutes
// by default; sync_interval, or sync: always, on recent servers): the
// nats-server process may crash without loss, but losing the machine can
// lose recently acknowledged messages, or forget acks so that applied
// messages come back, which dedup absorbs. Where that matters, replicate
// the streams (Topology.Replicas 3) or have the server sync every write.
// Memory storage loses everything at a restart.
//
// [Browser] reads a dead-letter subject without consuming it, for the dlq
// package's Inspect, Classify, Replay and Requeue: an ordered consumer reads
// the messages stored when it opened, and acking a browsed delivery deletes
// that message from the stream.
package natsjs
