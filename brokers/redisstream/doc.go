// Package redisstream connects idemq to Redis Streams through go-redis: a
// Source that consumes a stream as a member of a consumer group, its
// dead-letterer, a Publisher and a Browser. It needs Redis 7.0 or later.
//
// # Delivery and acks
//
// [NewSource] creates the stream and the group if they are missing (XGROUP
// CREATE ... MKSTREAM at [Config].StartID, "0" by default: a new group reads
// the whole stream, and dedup skips what was applied). Receive reads new
// entries with XREADGROUP, at most the runtime's window (Concurrency ×
// BatchSize, passed to Configure) per call and twice that held unsettled,
// waiting up to [Config].Block on the server. The Source XACKs an entry
// only when the runtime acks it, which is after the dedup row and the
// effect (or the dead-letter copy) committed; [Source.AckBatch] acks a
// whole batch with one XACK. A failed XACK leaves the entry pending: the
// Source re-delivers it and dedup skips it.
//
// # Nack, redelivery and idle claims
//
// Redis has no negative acknowledgement. Nack with requeue claims the entry
// back to the Source's own consumer (XCLAIM, which counts the delivery) and
// returns it again from Receive, flagged Redelivered. A consumer that dies
// leaves its entries pending; every Source of the group claims entries
// idle for [Config].MinIdle (30s by default) with XAUTOCLAIM, at start and
// every [Config].ClaimInterval. Since handlers and their retries can take
// longer than MinIdle, a live Source keeps the entries it holds alive every
// [Config].KeepAlive (MinIdle/3): a script resets their idle time (XCLAIM
// ... JUSTID to itself) only for entries it still owns, like NATS's
// InProgress, so MinIdle only has to exceed the longest pause of a live
// process, not the longest handler. An entry claimed anyway (a process
// stalled past MinIdle) is handled twice at once and applied once: dedup.
// Message.Redelivered is set on every delivery but a first XREADGROUP >
// (claims, nacks and recovered own entries all have a delivery count above
// one); Metadata[MetaDelivery] says which path it took.
//
// [Source.RedeliveryHorizon] is the optional method of [consumer.Source]: it tells
// the runtime's janitor when the oldest entry the group could still
// deliver was added (the older of its oldest pending entry and the first
// entry past its last-delivered id, read from their ids), so that no dedup
// row is purged while its entry can come back.
//
// Close stops reading and hands every unacked entry to the consumer
// "idemq.released", marked idle for years, so that the next XAUTOCLAIM of
// any consumer in the group takes it at once (the equivalent of RabbitMQ's
// requeue on close), then removes its own consumer name from the group. A
// Source with a fixed [Config].Consumer takes back its own pending entries
// when it starts, without waiting for MinIdle.
//
// # Message ids
//
// Message.ID comes from the "idempotency-key" entry field; [Publisher]
// writes Message.ID there. The body is the "body" field
// ([Config].BodyField), Message.Key the "x-idemq-key" field, which
// [Publisher] writes from a non-empty Key, and every other field, the id
// and key fields included, is a header. Without the id
// field the id falls back to "<stream>/<entry id>": it deduplicates
// redeliveries of the same entry, NOT duplicates made by producers (a
// producer retry is a new entry with a new id, applied again). Set the
// field whenever duplicates matter, or refuse the fallback in the runtime,
// consumer.Config.MessageID = consumer.IDFromHeader("idempotency-key"), so
// that entries without it are dead-lettered as consumer.ClassMissingID; a
// consumer whose producers use another field reads it the same way. The entry id is
// in Metadata[MetaEntryID], and the id of the entry a message first had is
// kept in the [HeaderEntryID] header, across dead-lettering and requeue.
//
// # Dead letters and browsing
//
// [Source.DeadLetterer] is the runtime's dead-letterer, built and validated
// by NewSource from [Config].DeadLetter: it XADDs each failed message in
// package dlq's envelope to "<stream>.dlq" ([DLQName]) on the Source's own
// connections, and is closed with the Source. [Browser] reads a
// dead-letter stream with XRANGE up to its last entry at open, without a
// group, for dlq.Inspect, dlq.Classify, dlq.Replay and dlq.Requeue; acking
// a browsed entry deletes it (XDEL).
//
// # Persistence
//
// Redis acknowledges a write before it is on disk unless it runs with
// appendonly yes and appendfsync always. Anything less breaks the
// invariant on a server crash: an acked dead letter can vanish, and so can
// the group's pending entries and the stream itself. [Config].RequireAOF
// makes NewSource refuse such a server; otherwise the Source logs a
// warning. Publisher's MaxLen, off by default, trims entries whether they
// were acked or not: a trimmed unacked entry is lost (Stats.Deleted counts
// them when they are claimed).
package redisstream
