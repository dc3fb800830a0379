// Package consumer is the idemq runtime: it turns an at-least-once queue
// consumer into one whose effects are applied exactly once per message id.
//
// A user writes a [Handler], a plain function that receives the message and a
// pgx transaction. For every delivery the [Runtime]:
//
//  1. begins a transaction (raising synchronous_commit to on if it is off
//     or local; a stronger setting is kept);
//  2. claims the message id in the dedup store ([dedup.Store].BeginClaim, an
//     INSERT ... ON CONFLICT DO NOTHING); a duplicate skips the handler;
//  3. runs the handler in that same transaction;
//  4. commits, and only then acks the delivery.
//
// A crash anywhere leaves both the dedup row and the effect, or neither, so a
// redelivery is either applied once or recognised as a duplicate and acked.
//
// Brokers plug in through the small [Source] and [Delivery] interfaces (a
// Source's optional methods are listed in one place, Source's doc); the
// Postgres dedup store lives in package processed, the broker adapters
// (memory, rabbitmq, kafka, franz, nats, redisstream) under brokers/, and
// dead-lettering under dlq/. This package imports none of them.
package consumer
