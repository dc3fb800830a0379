// Package kafka connects idemq to Kafka with segmentio/kafka-go, the seed's
// client: a Source that consumes a topic as a member of a consumer group, a
// Publisher and a Browser. (brokers/franz is the other Kafka adapter, on
// franz-go; the two map records to messages the same way.)
//
// # Delivery and commits
//
// The Source reads every assigned partition in offset order and never
// commits an offset before the record's effect is durable: the runtime acks
// a message only after its transaction (or its dead-letter copy) committed,
// and the Source commits, per partition, only the highest offset below which
// every record is acked. Commits are batched every Config.CommitInterval and
// made when a rebalance ends a generation and on Close. A crash or a failed
// commit therefore only causes records to be read again, and the runtime's
// dedup store absorbs them.
//
// Messages are keyed "topic/partition", so the runtime handles each
// partition in order and different partitions concurrently. To run
// different record keys of one partition concurrently too, order by the
// record key with the runtime's consumer.Config.OrderingKey:
//
//	OrderingKey: func(m *consumer.Message) string { return m.Key + "/" + string(m.RecordKey) },
//
// Offsets are still committed only up to the highest contiguous handled
// offset, so a slow key holds back its partition's commit point, never
// past an unhandled record.
//
// # Transactional producers
//
// The Source reads committed data only, as the Java client does with
// isolation.level=read_committed: nothing past a partition's last stable
// offset is read, the records of aborted transactions are dropped, and
// transaction markers (control records) are never handed out, only counted
// as acked so that the committed offset moves past them. kafka-go's own
// Reader cannot do this (it hands out aborted records and the markers
// themselves whatever its IsolationLevel; segmentio/kafka-go issue 1332), so
// the Source fetches through kafka-go's Transport and protocol package,
// which expose batch attributes, producer ids and the aborted transactions
// of a fetch response. brokers/franz's Source, on franz-go, does the same
// with franz-go's own read_committed consumer.
//
// The Browser reads dead-letter topics written by idemq's Publisher, which
// is not transactional, with kafka-go's Reader: do not point it at a topic
// written by transactional producers.
//
// # Rebalances
//
// The Source drives kafka-go's ConsumerGroup itself instead of using its
// group Reader, which hides assignments. When a rebalance ends a generation,
// the Source stops handing out that generation's records, waits up to
// Config.DrainTimeout for the messages in flight, commits what they allow,
// and from then on never commits for those partitions again: acks that come
// later return consumer.ErrDeliveryStale and the partition's new owner
// re-reads the records, which dedup absorbs.
//
// # Message ids
//
// Message.ID comes from the "idempotency-key" record header; Publisher
// writes Message.ID there. A producer that sets it gets its retries and
// duplicates deduplicated too.
//
// Without the header the id falls back to "topic/partition/offset". That id
// deduplicates redeliveries of the same record, after a crash or a
// rebalance, but NOT duplicates made by producers: a producer retry is a new
// record at a new offset, with a new id, and its effect is applied again.
// Set the header in producers whenever duplicates matter, or refuse the
// fallback in the runtime, consumer.Config.MessageID =
// consumer.IDFromHeader("idempotency-key"), so that records without it are
// dead-lettered as consumer.ClassMissingID instead. Every record header
// reaches Message.Headers, so the runtime's MessageID can read another one
// just as well. The Browser gives no fallback id.
//
// # Dead letters
//
// Source.DeadLetterer is the runtime's dead-letterer: it writes each failed
// message in package dlq's envelope, with acks=all and its record key, to
// a dead-letter topic (DLQName of the Source's topic, "<topic>.dlq", or
// Config.DeadLetter.Topic), through a Publisher on the Source's own
// transport. NewSource builds and validates it from Config.DeadLetter, so
// the accessor cannot fail. It is owned by the Source and closed by
// Source.Close; there is nothing else to close.
//
// # Settings from the runtime
//
// The Source has consumer.Source's optional Configure method: consumer.New
// tells it the runtime's logger and window, so neither is said twice. The
// Source, kafka-go and the dead-letterer log to the runtime's logger, with "topic" and "group" attributes; without
// Config.MaxInFlight, a window (Concurrency×BatchSize) larger than the
// default raises it. A consumer with its dead-letter topic takes three
// constructor calls:
//
//	store, err := processed.New(pool, processed.Config{})
//	src, err := kafka.NewSource(kafka.Config{Brokers: brokers, Topic: "orders", GroupID: "order-service"})
//	rt, err := consumer.New(consumer.Config{Source: src, Logger: logger, ...})
//
// # Browsing a dead-letter topic
//
// Browser reads a topic, typically a dead-letter topic, as it was when it
// was opened, up to each partition's high watermark, without a consumer
// group: it implements the dlq.Browser interface used by dlq.Inspect,
// dlq.Classify, dlq.Replay and dlq.Requeue. A record cannot be deleted from
// a Kafka log, so acking a browsed record only marks it done. With
// BrowserConfig.GroupID the Browser commits, on Close, the offsets past the
// contiguous acked records, and the next pass starts there; without it
// every pass reads the whole topic again, which is safe for a replay (the
// dedup store skips what was applied) but rereads everything.
//
// # Nack
//
// Kafka cannot requeue a single record: a nacked record is handed out again
// by the Source itself, flagged Redelivered, and its offset stays
// uncommitted until it is acked. A record read again by a new consumer after
// a restart or rebalance is not flagged.
package kafka
