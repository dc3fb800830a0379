// Package franz connects idemq to Kafka with franz-go/kgo, for read_committed
// at speed: a Source that consumes a topic as a member of a consumer group
// and reads only committed transactional data. It does not import
// brokers/kafka, so it does not pull in kafka-go.
//
// # When to use it
//
// Use this Source for topics written by transactional producers (Kafka
// Streams with exactly-once, Flink's Kafka sink, Spring with a
// KafkaTransactionManager, any client with a transactional.id). It fetches
// with the read_committed isolation level, as the Java client does when
// asked to: records of aborted transactions are never delivered, nothing
// past the last stable offset is read, and transaction markers (control
// records) never reach a handler. brokers/kafka's Source, on kafka-go, is
// the default for every other topic.
//
// # Delivery and commits
//
// Messages look exactly like those of brokers/kafka's Source: the id comes
// from the same idempotency-key header with the same "topic/partition/offset"
// fallback, Key is the ordering key ("topic/partition"; order by the
// record key with consumer.Config.OrderingKey, as brokers/kafka shows),
// RecordKey the record key, and Metadata carries the same "kafka.*" entries. The two Sources can take turns on one group.
//
// Offsets are committed manually and never before the record's effect is
// durable: per partition, only up to the highest offset below which every
// record is acked, every Config.CommitInterval, when a rebalance revokes the
// partition and on Close. Polls block rebalances only until the polled
// records are registered (kgo.BlockRebalanceOnPoll), so a record always
// belongs to the assignment it was fetched under. When a rebalance revokes
// a partition, the Source stops handing its records out, waits up to
// Config.DrainTimeout for those in flight, commits what they allow, and
// never commits for it again; a partition lost (session expiry) is dropped
// without a commit. Later acks return consumer.ErrDeliveryStale and the
// next owner re-reads the records, which the dedup store absorbs.
//
// A nacked record is handed out again by the Source itself, flagged
// Redelivered, as in brokers/kafka.
//
// Source.DeadLetterer is the runtime's dead-letterer: it produces each
// failed message in package dlq's envelope, acknowledged by every in-sync
// replica and with its record key, to a dead-letter topic
// ("<topic>.dlq", or Config.DeadLetter.Topic), on
// the Source's own franz-go client. NewSource builds and validates it from
// Config.DeadLetter, so the accessor cannot fail. It is owned by the Source
// and closed by Source.Close; there is nothing else to close.
//
// The Source has consumer.Source's optional Configure method: consumer.New
// tells it the runtime's logger and window. The Source and franz-go log to
// the runtime's logger, with "topic" and "group"
// attributes; without Config.MaxInFlight, a window (Concurrency×BatchSize)
// larger than the default raises it. A consumer with its dead-letter topic
// takes three constructor calls:
//
//	store, err := processed.New(pool, processed.Config{})
//	src, err := franz.NewSource(franz.Config{Brokers: brokers, Topic: "payments", Group: "ledger"})
//	rt, err := consumer.New(consumer.Config{Source: src, Logger: logger, ...})
package franz
