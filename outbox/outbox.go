// Package outbox is a transactional outbox for idemq: messages a handler (or
// any code holding a pgx transaction) wants to publish are written to a
// Postgres table in that same transaction, so the business change and the
// outgoing messages commit together or not at all. A [Relay] then delivers
// the committed rows to a broker with confirmed publishes and marks them sent.
//
//	// In a consumer.Handler, or any transaction:
//	err := ob.Enqueue(ctx, tx, outbox.Message{
//		Destination: "payments.captured",
//		ID:          keys.ChildKey(msg.ID, "payment-captured-event/v1"),
//		Body:        body,
//	})
//
// # Delivery guarantees
//
// Delivery is at least once. A relay claims a batch of due rows in a short
// transaction: with SELECT ... FOR UPDATE SKIP LOCKED it picks them, writes
// a fresh lease token on them and pushes their next_attempt_at to the end
// of its lease ([RelayConfig.Lease]), and commits. It then publishes them with
// no transaction open, so no row lock or idle transaction is held across a
// network call, and records each row's outcome in a second short
// transaction whose updates check the lease token (a fencing token): a
// relay whose lease expired, and whose rows another relay has claimed since,
// cannot overwrite that relay's result. Several relays can run at once;
// until its lease expires a claimed row is not due for the others, so in
// normal operation no row is published twice. If a relay dies after the
// broker confirmed a publish but before it recorded it, the row is due
// again when the lease expires and a relay publishes it again. That
// duplicate carries the same message id, so give every outgoing message a
// stable id, derived with keys.ChildKey from the id of the operation that
// produced it, and let the consumers downstream (idemq consumers)
// deduplicate it.
//
// Each row has its own outcome. The messages of a batch are published in
// one Publish call per destination; if the call fails, the messages the
// PublishFunc names with a [MessageError] fail and the others are marked sent,
// and if it names none, each message is published again on its own (unless
// the first two of those calls fail too: the broker is down, and the group
// fails). So a poison message fails alone, and the broker's confirmed messages are never
// published again because a sibling failed (at most once more, by that
// one-at-a-time pass, when the PublishFunc cannot say which failed). A
// failed publish is recorded on the row (attempts, last_error) and retried
// after its own exponential backoff; rows keep being retried, at most every
// [BackoffConfig.MaxInterval], until they are sent. Order is not guaranteed: a
// failed message is overtaken by later ones, and relays run concurrently.
//
// # Retention and metrics
//
// Sent rows stay in the table until [Outbox.Purge] (or a relay with
// [RelayConfig.Retention]) deletes them. [Outbox.Stats] reads the pending and
// failing counts, for a gauge; [Relay.Stats] and the hooks ([Hook],
// [HookPublished], [HookPublishFailed]) count what a relay published and
// what failed.
package outbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
	"github.com/idemq/idemq/internal/pgpurge"
	"github.com/idemq/idemq/processed"
)

// ErrConflict is wrapped by the error of [Outbox.Enqueue] when a message
// with the same destination and id is already in the outbox with a
// different key or body. Enqueueing the same message twice is not an
// error. Compare with errors.Is.
//
// Errors caused by the outbox table (or its schema) not existing wrap
// [consumer.ErrNotMigrated]: run [Outbox.Migrate].
var ErrConflict = errors.New("outbox: message id already enqueued with a different payload")

// Message is one outgoing message.
type Message struct {
	// Destination is the queue or topic the relay publishes to; it is
	// passed to [RelayConfig.Publish]. Required.
	Destination string
	// ID is the message id consumers deduplicate on. Required. Derive it
	// with keys.ChildKey from the id of the operation that produces the
	// message, so that a retried operation produces the same id.
	ID string
	// Key is the ordering or partition key, if any. The relay publishes it
	// as both the message's Key and its RecordKey (a Kafka record key).
	Key string
	// Headers are application headers.
	Headers map[string]string
	// Body is the payload.
	Body []byte
}

// Outbox is an outbox table. It is safe for concurrent use; create it with
// New.
type Outbox struct {
	db  processed.DB
	cfg Config
	// table is the table, its schema resolved on first use, and the
	// statements on it.
	table *pgmigrate.Table[statements]
}

// statements are the outbox's SQL, for one resolved schema.
type statements struct {
	insert, existing, purge, stats, claim, sent, failed, release string
}

// New returns the outbox in the table cfg names, over db: a *pgxpool.Pool
// (the caller keeps owning it), or a *pgx.Conn, which serves one goroutine
// at a time. It does not touch the database; call Migrate to create the
// table.
func New(db processed.DB, cfg Config) (*Outbox, error) {
	if db == nil {
		return nil, &consumer.ConfigError{Field: "db", Reason: "required"}
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	indexes := map[string]string{"id_index": "_id", "pending_index": "_pending", "sent_index": "_sent"}
	return &Outbox{db: db, cfg: cfg, table: pgmigrate.NewTable("outbox", cfg.Schema, cfg.Table, indexes, newStatements)}, nil
}

// newStatements returns the SQL for the quoted, qualified table t.
func newStatements(t string) *statements {
	o := &statements{}
	o.insert = `INSERT INTO ` + t + ` (destination, message_id, key, headers, body)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (destination, message_id) DO NOTHING`
	o.existing = `SELECT key, body FROM ` + t + ` WHERE destination = $1 AND message_id = $2`
	o.purge = `DELETE FROM ` + t + ` WHERE seq IN (
	SELECT seq FROM ` + t + `
	WHERE sent_at < $1
	LIMIT $2
	FOR UPDATE SKIP LOCKED)`
	o.stats = `SELECT
	count(*) FILTER (WHERE sent_at IS NULL),
	count(*) FILTER (WHERE sent_at IS NULL AND attempts > 0),
	min(created_at) FILTER (WHERE sent_at IS NULL),
	count(*) FILTER (WHERE sent_at IS NOT NULL),
	count(*) FILTER (WHERE sent_at IS NULL AND lease_token IS NOT NULL AND next_attempt_at > now())
FROM ` + t
	// The claim is one statement in its own short transaction: it leases
	// the due rows to the caller's token until clock_timestamp() + $4
	// microseconds and returns them, with the time they were due, for
	// ordering.
	o.claim = `UPDATE ` + t + ` AS o
SET lease_token = $2::uuid, lease_owner = $3,
    next_attempt_at = clock_timestamp() + $4 * interval '1 microsecond'
FROM (
	SELECT seq, next_attempt_at AS due_at FROM ` + t + `
	WHERE sent_at IS NULL AND next_attempt_at <= now()
	ORDER BY next_attempt_at, seq
	LIMIT $1
	FOR UPDATE SKIP LOCKED) AS due
WHERE o.seq = due.seq
RETURNING o.seq, o.destination, o.message_id, o.key, o.headers, o.body, o.created_at, o.attempts, due.due_at`
	// The outcomes apply only to rows still leased to the caller's token
	// ($2): the fencing check.
	o.sent = `UPDATE ` + t + `
SET sent_at = clock_timestamp(), attempts = attempts + 1, lease_token = NULL, lease_owner = NULL
WHERE seq = ANY($1) AND lease_token = $2::uuid`
	o.failed = `UPDATE ` + t + ` AS o
SET attempts = o.attempts + 1, last_error = d.error,
    next_attempt_at = clock_timestamp() + d.delay * interval '1 microsecond',
    lease_token = NULL, lease_owner = NULL
FROM unnest($1::bigint[], $3::bigint[], $4::text[]) AS d(seq, delay, error)
WHERE o.seq = d.seq AND o.lease_token = $2::uuid`
	o.release = `UPDATE ` + t + `
SET next_attempt_at = clock_timestamp(), lease_token = NULL, lease_owner = NULL
WHERE seq = ANY($1) AND lease_token = $2::uuid`
	return o
}

// Schema returns the schema holding the table: Config.Schema, or the one
// the search_path names once the outbox has asked the database ("" until
// then).
func (o *Outbox) Schema() string { return o.table.Schema() }

// Table returns the table's name, without its schema.
func (o *Outbox) Table() string { return o.cfg.Table }

// String returns "schema.table", unquoted, for messages.
func (o *Outbox) String() string { return o.table.String() }

// Enqueue writes msg to the outbox in tx, the caller's transaction: the
// message is relayed only if tx commits, and is lost with everything else in
// tx if it rolls back. Enqueue never commits or rolls back tx.
//
// Enqueueing a message whose destination and id are already in the outbox
// (even sent, until it is purged) does nothing if its key and body are the
// same, and returns an error wrapping [ErrConflict] if they differ.
func (o *Outbox) Enqueue(ctx context.Context, tx pgx.Tx, msg Message) error {
	switch {
	case tx == nil:
		return errors.New("outbox: enqueue: nil transaction")
	case msg.Destination == "":
		return fmt.Errorf("outbox: enqueue %q: empty destination", msg.ID)
	case msg.ID == "":
		return fmt.Errorf("outbox: enqueue to %q: empty message id", msg.Destination)
	}
	headers := msg.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	body := msg.Body
	if body == nil {
		body = []byte{}
	}
	st, err := o.table.Statements(ctx, tx)
	if err != nil {
		return fmt.Errorf("outbox: enqueue: %w", err)
	}
	tag, err := tx.Exec(ctx, st.insert, msg.Destination, msg.ID, msg.Key, headers, body)
	if err != nil {
		return o.wrap("enqueue", err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	var (
		key  string
		prev []byte
	)
	if err := tx.QueryRow(ctx, st.existing, msg.Destination, msg.ID).Scan(&key, &prev); err != nil {
		return o.wrap("enqueue: read existing", err)
	}
	if key != msg.Key || !bytes.Equal(prev, body) {
		return fmt.Errorf("%w: destination %q, id %q", ErrConflict, msg.Destination, msg.ID)
	}
	return nil
}

// Purge deletes the rows sent more than olderThan ago (by the database's
// clock) and returns how many it deleted. Pending rows are never purged. It
// deletes in batches of Config.PurgeBatchSize rows, each its own statement,
// and stops when a batch deletes fewer rows than that, or when ctx is done.
//
// Once a row is purged, enqueueing its destination and id again enqueues a
// new message: keep sent rows at least as long as the operations that
// produce them may be retried.
func (o *Outbox) Purge(ctx context.Context, olderThan time.Duration) (int64, error) {
	st, err := o.table.Statements(ctx, o.db)
	if err != nil {
		return 0, fmt.Errorf("outbox: purge: %w", err)
	}
	n, step, err := pgpurge.Run(ctx, o.db, st.purge, olderThan, o.cfg.PurgeBatchSize, pgpurge.Pace{})
	if err != nil {
		return n, o.wrap(string(step), err)
	}
	return n, nil
}

// Stats is a snapshot of the outbox table.
type Stats struct {
	// Pending counts rows not yet sent: the backlog gauge.
	Pending int64
	// Failing counts pending rows whose last publish failed.
	Failing int64
	// OldestPending is when the oldest pending row was enqueued; zero if
	// none is pending. Now minus it is the relay's lag.
	OldestPending time.Time
	// Sent counts sent rows not yet purged.
	Sent int64
	// Leased counts pending rows a relay has claimed and holds under a
	// lease that has not expired: rows being published now.
	Leased int64
}

// Stats reads a snapshot of the table. It scans the table, so call it from
// a metrics scrape or an operator's tool, not a hot path.
func (o *Outbox) Stats(ctx context.Context) (Stats, error) {
	var (
		s      Stats
		oldest *time.Time
	)
	st, err := o.table.Statements(ctx, o.db)
	if err != nil {
		return Stats{}, fmt.Errorf("outbox: stats: %w", err)
	}
	if err := o.db.QueryRow(ctx, st.stats).Scan(&s.Pending, &s.Failing, &oldest, &s.Sent, &s.Leased); err != nil {
		return Stats{}, o.wrap("stats", err)
	}
	if oldest != nil {
		s.OldestPending = *oldest
	}
	return s, nil
}

// wrap adds context to a database error and translates a missing table or
// schema into consumer.ErrNotMigrated.
func (o *Outbox) wrap(op string, err error) error {
	if pgmigrate.IsUndefined(err) {
		return fmt.Errorf("outbox: %s on %s: %w: %w", op, o, consumer.ErrNotMigrated, err)
	}
	return fmt.Errorf("outbox: %s on %s: %w", op, o, err)
}
