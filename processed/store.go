// Package processed is the Postgres dedup store: the table that records which
// message ids each consumer has applied.
//
// [Store.Claim] inserts a row in the caller's transaction, with
// INSERT ... ON CONFLICT DO NOTHING, so the claim commits or rolls back
// together with the handler's effect. A concurrent claim of the same id waits
// on the primary key until the first transaction ends: if it committed, the
// second claim reports a duplicate; if it rolled back, the second claim
// inserts. Each row keeps the sha256 fingerprint of the payload, so the same
// id carrying a different payload is reported as a mismatch rather than
// skipped silently.
//
// The table is created by [Store.Migrate] (or `idemq migrate`) from embedded,
// numbered SQL migrations, and old rows are deleted by [Store.Purge].
//
// Claim's duplicate detection relies on READ COMMITTED, Postgres's default
// isolation level. Under REPEATABLE READ or SERIALIZABLE a claim that races a
// concurrent commit fails with a serialization error instead, which the
// caller must retry in a new transaction.
package processed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
	"github.com/idemq/idemq/internal/pgpurge"
)

// DB is what the store needs from a database handle. *pgxpool.Pool and
// *pgx.Conn satisfy it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Sentinel errors. Compare with errors.Is.
var (
	// ErrNotFound is returned by Lookup when no row matches.
	ErrNotFound = errors.New("processed: not found")
	// ErrNotMigrated is wrapped by errors caused by the dedup table (or its
	// schema) not existing: run Store.Migrate or `idemq migrate`. It wraps
	// consumer.ErrNotMigrated, on which the runtime stops instead of
	// retrying.
	ErrNotMigrated = fmt.Errorf("processed: table does not exist (run migrations): %w", consumer.ErrNotMigrated)
)

// maxClaimAttempts bounds the insert/select loop of Claim when the
// conflicting row disappears (is purged) between the two statements.
const maxClaimAttempts = 3

// Store is the Postgres dedup store. It implements consumer.Store and
// consumer.Purger. It is safe for concurrent use.
type Store struct {
	db  DB
	cfg Config
	// qTable is the quoted, schema-qualified table name.
	qTable string
	sql    struct {
		insert, existing, purge, lookup, stats string
	}
}

var (
	_ consumer.Store  = (*Store)(nil)
	_ consumer.Purger = (*Store)(nil)
)

// New returns a store for the table cfg names. It does not touch the
// database; call Migrate to create the table.
func New(db DB, cfg Config) (*Store, error) {
	if db == nil {
		return nil, &consumer.ConfigError{Field: "db", Reason: "required"}
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Store{db: db, cfg: cfg, qTable: pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()}
	t := s.qTable
	s.sql.insert = `INSERT INTO ` + t + ` (consumer, message_id, fingerprint, source, partition, "offset")
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (consumer, message_id) DO NOTHING`
	s.sql.existing = `SELECT fingerprint, processed_at FROM ` + t + ` WHERE consumer = $1 AND message_id = $2`
	// No FOR UPDATE: row locks need the UPDATE privilege, and the
	// runtime's role needs only SELECT, INSERT and DELETE. A row another
	// purge is deleting is waited for, then skipped.
	s.sql.purge = `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM ` + t + `
	WHERE processed_at < $1
	LIMIT $2))`
	s.sql.lookup = `SELECT consumer, message_id, fingerprint, processed_at, source, partition, "offset"
FROM ` + t + ` WHERE consumer = $1 AND message_id = $2`
	s.sql.stats = `SELECT count(*), min(processed_at) FROM ` + t + ` WHERE $1::text = '' OR consumer = $1::text`
	return s, nil
}

// Schema returns the schema holding the table.
func (s *Store) Schema() string { return s.cfg.Schema }

// Table returns the table's name, without its schema.
func (s *Store) Table() string { return s.cfg.Table }

// String returns "schema.table", unquoted, for messages.
func (s *Store) String() string { return s.cfg.Schema + "." + s.cfg.Table }

// Claim records in tx that c.Consumer is applying c.MessageID. It reports
// ClaimNew if the row was inserted (it commits or rolls back with tx),
// ClaimDuplicate if the id was already committed with the same fingerprint,
// and ClaimMismatch if it was committed with a different one. If another
// transaction holds an uncommitted claim of the same id, Claim waits for it to
// end.
//
// The common case, a new message, costs one round trip.
func (s *Store) Claim(ctx context.Context, tx pgx.Tx, c consumer.Claim) (consumer.ClaimResult, error) {
	if tx == nil {
		return consumer.ClaimResult{}, errors.New("processed: claim: nil transaction")
	}
	if c.Consumer == "" || c.MessageID == "" {
		return consumer.ClaimResult{}, fmt.Errorf("processed: claim: empty consumer (%q) or message id (%q)", c.Consumer, c.MessageID)
	}
	args := claimArgs(c)
	for attempt := 1; ; attempt++ {
		tag, err := tx.Exec(ctx, s.sql.insert, args...)
		if err != nil {
			return consumer.ClaimResult{}, s.wrap("claim: insert", err)
		}
		if tag.RowsAffected() == 1 {
			return consumer.ClaimResult{Outcome: consumer.ClaimNew}, nil
		}
		res, found, err := s.existing(ctx, tx, c)
		if err != nil || found {
			return res, err
		}
		// Purged between the two statements: claim it afresh.
		if attempt >= maxClaimAttempts {
			return consumer.ClaimResult{}, fmt.Errorf("processed: claim: row for %q/%q conflicted but vanished %d times", c.Consumer, c.MessageID, attempt)
		}
	}
}

// existing reads the committed row that made c's insert conflict and tells a
// duplicate from a mismatch. found is false if the row is gone (purged since).
// A separate statement takes a new snapshot under READ COMMITTED, so it sees
// the row of the transaction the insert waited for.
func (s *Store) existing(ctx context.Context, tx pgx.Tx, c consumer.Claim) (res consumer.ClaimResult, found bool, err error) {
	var (
		fp []byte
		at time.Time
	)
	err = tx.QueryRow(ctx, s.sql.existing, c.Consumer, c.MessageID).Scan(&fp, &at)
	if errors.Is(err, pgx.ErrNoRows) {
		return consumer.ClaimResult{}, false, nil
	}
	if err != nil {
		return consumer.ClaimResult{}, false, s.wrap("claim: select existing", err)
	}
	out := consumer.ClaimDuplicate
	if !bytes.Equal(fp, c.Fingerprint[:]) {
		out = consumer.ClaimMismatch
	}
	return consumer.ClaimResult{Outcome: out, ProcessedAt: at}, true, nil
}

// claimArgs are the arguments of the claim INSERT; a negative partition or
// offset is stored as NULL.
func claimArgs(c consumer.Claim) []any {
	var partition, offset any // nil is NULL
	if c.Partition >= 0 {
		partition = c.Partition
	}
	if c.Offset >= 0 {
		offset = c.Offset
	}
	return []any{c.Consumer, c.MessageID, c.Fingerprint[:], c.Source, partition, offset}
}

// QueueClaim implements [consumer.ClaimQueuer]: it queues the claim's INSERT
// on b, the batch that begins the caller's transaction, so the runtime pays
// one round trip for BEGIN and the claim together. finish reports the outcome
// once b has been sent and closed: a new claim at no further cost; for a
// conflict, the existing row's answer (duplicate or mismatch), read as
// [Store.Claim] reads it. A sendErr is wrapped like Claim's errors, with
// [ErrNotMigrated] when the table is missing.
func (s *Store) QueueClaim(b *pgx.Batch, c consumer.Claim) (finish func(ctx context.Context, tx pgx.Tx, sendErr error) (consumer.ClaimResult, error)) {
	if c.Consumer == "" || c.MessageID == "" {
		// Claim reports the error; nothing is queued.
		return func(ctx context.Context, tx pgx.Tx, _ error) (consumer.ClaimResult, error) {
			return s.Claim(ctx, tx, c)
		}
	}
	var (
		ran      bool
		inserted bool
	)
	b.Queue(s.sql.insert, claimArgs(c)...).Exec(func(tag pgconn.CommandTag) error {
		ran, inserted = true, tag.RowsAffected() == 1
		return nil
	})
	return func(ctx context.Context, tx pgx.Tx, sendErr error) (consumer.ClaimResult, error) {
		switch {
		case sendErr != nil:
			return consumer.ClaimResult{}, s.wrap("claim: begin and insert", sendErr)
		case tx == nil:
			return consumer.ClaimResult{}, errors.New("processed: claim: nil transaction")
		case !ran:
			return consumer.ClaimResult{}, errors.New("processed: claim: the queued insert did not run; was the batch sent and closed?")
		case inserted:
			return consumer.ClaimResult{Outcome: consumer.ClaimNew}, nil
		}
		// The insert conflicted with a committed row: read it, as Claim
		// does. If it was purged meanwhile, Claim claims the id afresh.
		res, found, err := s.existing(ctx, tx, c)
		if err != nil || found {
			return res, err
		}
		return s.Claim(ctx, tx, c)
	}
}

// Purge deletes the rows processed more than olderThan ago (by the database's
// clock) and returns how many it deleted. It deletes in batches of
// Config.PurgeBatchSize rows, each its own statement and transaction, so it
// never holds many locks for long. It needs only the SELECT and DELETE
// privileges. It stops when a batch deletes fewer rows than the batch size, or
// when ctx is done.
func (s *Store) Purge(ctx context.Context, olderThan time.Duration) (int64, error) {
	n, step, err := pgpurge.Run(ctx, s.db, s.sql.purge, olderThan, s.cfg.PurgeBatchSize, s.cfg.pace())
	if err != nil {
		return n, s.wrap(string(step), err)
	}
	return n, nil
}

// Record is one row of the dedup table.
type Record struct {
	Consumer    string
	MessageID   string
	Fingerprint []byte
	ProcessedAt time.Time
	Source      string
	// Partition and Offset are nil where the broker has none.
	Partition *int32
	Offset    *int64
}

// Lookup returns the row for consumerName and id, or an error wrapping
// ErrNotFound.
func (s *Store) Lookup(ctx context.Context, consumerName, id string) (Record, error) {
	var r Record
	err := s.db.QueryRow(ctx, s.sql.lookup, consumerName, id).Scan(
		&r.Consumer, &r.MessageID, &r.Fingerprint, &r.ProcessedAt, &r.Source, &r.Partition, &r.Offset)
	if errors.Is(err, pgx.ErrNoRows) {
		return Record{}, fmt.Errorf("%w: consumer %q, message id %q in %s", ErrNotFound, consumerName, id, s)
	}
	if err != nil {
		return Record{}, s.wrap("lookup", err)
	}
	return r, nil
}

// Stats summarises the rows of one consumer, or of all.
type Stats struct {
	// Rows is the number of rows.
	Rows int64
	// Oldest is the oldest processed_at, zero if there are no rows.
	Oldest time.Time
}

// Stats counts the rows of consumerName, or of every consumer if it is "".
// It scans the rows, so it is meant for operators, not hot paths.
func (s *Store) Stats(ctx context.Context, consumerName string) (Stats, error) {
	var (
		st     Stats
		oldest *time.Time
	)
	if err := s.db.QueryRow(ctx, s.sql.stats, consumerName).Scan(&st.Rows, &oldest); err != nil {
		return Stats{}, s.wrap("stats", err)
	}
	if oldest != nil {
		st.Oldest = *oldest
	}
	return st, nil
}

// wrap adds context to a database error and translates a missing table or
// schema into ErrNotMigrated.
func (s *Store) wrap(op string, err error) error {
	if pgmigrate.IsUndefined(err) {
		return fmt.Errorf("processed: %s on %s: %w: %w", op, s, ErrNotMigrated, err)
	}
	return fmt.Errorf("processed: %s on %s: %w", op, s, err)
}
