// Package dlq is idemq's dead-letter handling: the failure envelope written
// on every dead-lettered message, a consumer.DeadLetterer that publishes it
// to any broker, and safe replay.
//
// # The envelope
//
// A dead-lettered message keeps its body and its headers unchanged, and gains
// these headers describing the failure (times are RFC 3339 with
// nanoseconds, in UTC; numbers are decimal):
//
//	x-idemq-consumer               the consumer that gave up: the dedup scope a replay uses
//	x-idemq-message-id             the dedup id extracted from the message; empty for class missing-id
//	x-idemq-error-class            the consumer.FailureClass
//	x-idemq-error                  the last error's text, cut to Options.MaxErrorBytes
//	x-idemq-attempts               the number of handler attempts
//	x-idemq-first-failure          when the first attempt failed
//	x-idemq-last-failure           when the last attempt failed
//	x-idemq-source                 the original queue or topic
//	x-idemq-partition              the original Kafka partition; absent elsewhere
//	x-idemq-offset                 the original's Kafka offset or JetStream stream sequence; absent elsewhere
//	x-idemq-host                   the host name of the process that dead-lettered it
//	x-idemq-original-key           the original's ordering key (Message.Key), if it had one
//	x-idemq-dead-letters           how many times it was dead-lettered, this time included
//	x-idemq-history                the earlier failures (HeaderHistory)
//	x-idemq-original-processed-at  fingerprint-mismatch only: when the original with the same id was applied
//	x-idemq-signature              the envelope's HMAC, with Options.SigningKey (see Sign)
//	x-idemq-truncated              what a dead letter cut to fit its broker lacks (HeaderTruncated)
//	x-idemq-original-size          a truncated dead letter's original body size (HeaderOriginalSize)
//	x-idemq-original-sha256        a truncated dead letter's original body SHA-256 (HeaderOriginalSHA256)
//
// Parse reads them into a Record. If the message had been dead-lettered
// before, the previous failure is moved into x-idemq-history (a JSON array
// of Entry objects, oldest first, at most Options.MaxHistory entries), so
// the copy carries its whole story.
//
// # Signed envelopes
//
// Whoever can publish to a dead-letter queue can write envelope headers, and
// a replay trusts them: the consumer and dedup id it applies under, and the
// queue Requeue republishes to. With Options.SigningKey every envelope carries
// x-idemq-signature, an HMAC over the body and the x-idemq-* headers; with
// VerifyKeys, Replay, Requeue and Classify replay only envelopes signed with
// one of the keys and leave the others in the queue, counted as Unverified.
//
// # Grouping
//
// Inspect groups dead letters by their Entry.Fingerprint: the consumer, the
// original source, the error class and the shape of the error text, which
// is the text with every part that differs from one message to the next
// replaced by a placeholder (Group.Pattern):
//
//	<id>     the message's own dedup id, as a whole token (quoted, if under 3 bytes)
//	<q>      a quoted value: "...", '...' or `...`; a name Postgres quotes after
//	         constraint, relation, table, column and the like is kept
//	<time>   a timestamp (RFC 3339, Go's time.Time and layouts, HTTP dates), or a date
//	<uuid>   a UUID
//	<hex>    a hex id: 0x..., or a word of 8 or more hex digits, one of them decimal
//	<addr>   an IPv4 address (with its port), or a bracketed IPv6 one
//	<email>  an e-mail address
//	<n>      a number, with the rest of its word (1.5s, 42nd, order-0042)
//
// A SQLSTATE code, "(SQLSTATE 23505)", is kept, and so are names that hold
// digits (UTF-8, sha256, int64, HTTP/1.1); runs of white space become one
// space. A text the envelope truncated keeps only the first 256 bytes of
// its shape, followed by "…".
//
// # Replay
//
// Replay reads a dead-letter queue through a Browser and runs the messages
// through a consumer.Runtime under the same consumer name, so through the
// same dedup scope: a message already applied is skipped and acked, a fixed
// one applies exactly once, and one that still fails goes back to the
// dead-letter queue with its history grown. Classify does a dry run: it
// reads the queue, consumes nothing, and says what a replay would do.
//
// # The replay-horizon guard
//
// Replay is safe only while the dedup row of a message's id still exists;
// the consumer's janitor purges rows older than its Retention. Replay and
// Requeue therefore leave in the queue, counted as BeyondHorizon unless
// Force is set, and the dry run Classify marks as beyond the horizon, every
// message that may have outlived its row: one first seen longer ago than the
// retention, and for a fingerprint mismatch one whose original (the applied
// message with the same id, whose row is the one at risk) was applied longer
// ago, as recorded in x-idemq-original-processed-at. A mismatch whose
// original's row is already gone from the dedup store is refused too, and so
// is a mismatch envelope from before x-idemq-original-processed-at existed
// when there is no store to look the row up in. ReplayConfig.Retention
// defaults to the consumer's Retention; a replay runs no janitor of its own.
package dlq
