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
// With [Config.Partitioned] the table is range-partitioned by claim time
// instead, and Purge drops whole partitions; a claim then takes an advisory
// lock on its id before it looks for it in every partition, which keeps ids
// unique across partitions (see Config.Partitioned and partition.go).
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
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
	"github.com/idemq/idemq/internal/pgpurge"
)

// DB is a database handle a Store can be made from with New: a
// *pgxpool.Pool (what Open makes), or a *pgx.Conn for one goroutine at a
// time. A pgx.Tx satisfies the interface but New refuses it: its Begin starts
// a savepoint, whose release is not a durable commit.
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

// Store is the Postgres dedup store and the runtime's database handle: it
// implements consumer.Store, so a consumer.Config takes it as its one
// Postgres field, and the same Store serves migrations, lookups, stats and
// purges. It is safe for concurrent use, except when made with New over a
// *pgx.Conn, which is one connection.
type Store struct {
	db DB
	// pool is the handle Open made, which Close closes; nil for New.
	pool *pgxpool.Pool
	cfg  Config
	// st holds the statements, built once the schema is known: in New
	// when Config.Schema is set, otherwise on first use (see statements).
	st        atomic.Pointer[statements]
	resolveMu sync.Mutex
	// fastSQL holds a partitioned table's fast claim statements, built on
	// first use and refreshed (see fast).
	fastSQL atomic.Pointer[fastClaims]
	fastMu  sync.Mutex
	// filters holds the cached filters of sealed partitions (see
	// filtercache.go); cacheMu serialises CacheFilters.
	filters atomic.Pointer[filterSet]
	cacheMu sync.Mutex
	// tokens numbers the transactions BeginClaim begins, after
	// tokenPrefix, random per store (see txOptions).
	tokens      atomic.Uint64
	tokenPrefix string
}

// commitCheckSuffix names the function that checks a claim transaction's
// token before its commit (migration 0003).
const commitCheckSuffix = "_commit_check"

// statements are the store's SQL, for one resolved schema.
type statements struct {
	schema string
	// qTable is the quoted, schema-qualified table name.
	qTable                                 string
	insert, existing, purge, lookup, stats string
	batchInsert, batchExisting             string
	// claimOne is the pipelined single claim on a plain table: see
	// newStatements.
	claimOne string
	// syncCommit makes the transaction's commit synchronous and records
	// its token (see Store.token); commitCheck is the function that checks
	// the token before the commit (migration 0003).
	syncCommit, commitCheck string
	// partitioned: the claims take the advisory locks lock (one key) or
	// batchLock (sorted keys) before their inserts; see partition.go.
	partitioned     bool
	lock, batchLock string
	// restoreScans ends the claim's statements on a partitioned table:
	// see partitionedSQL.
	restoreScans string
	// qDefault is a partitioned table's DEFAULT partition, qSealed and
	// qFilter the tables of its seals: see seal.go.
	qDefault, qSealed, qFilter string
}

var _ consumer.Store = (*Store)(nil)

// New returns a store for the table cfg names, over db: a *pgxpool.Pool (the
// caller keeps owning it: Close does not close it) or a *pgx.Conn, which is
// one connection, so a runtime using it must have Concurrency 1 and no
// Retention. To have the store make and own its pool, use Open. New does not
// touch the database, except to learn the schema from db's search_path when
// Config.Schema is empty, which it does on first use; call Migrate to create
// the table.
func New(db DB, cfg Config) (*Store, error) {
	switch db.(type) {
	case nil:
		return nil, &consumer.ConfigError{Field: "db", Reason: "required"}
	case pgx.Tx:
		return nil, &consumer.ConfigError{Field: "db", Reason: "a pgx.Tx: its commits are savepoint releases, which are not durable; pass the pool (or connection) the transaction came from"}
	}
	if cfg.MaxConns != 0 {
		return nil, &consumer.ConfigError{Field: "MaxConns", Reason: "sizes the pool Open makes; with New the pool you pass decides"}
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Store{db: db, cfg: cfg, tokenPrefix: strconv.FormatUint(rand.Uint64(), 36) + "."}
	if cfg.Schema != "" {
		s.st.Store(newStatements(cfg.Schema, cfg.Table, cfg.Partitioned))
	}
	return s, nil
}

func newStatements(schema, table string, partitioned bool) *statements {
	t := pgx.Identifier{schema, table}.Sanitize()
	st := &statements{schema: schema, qTable: t}
	st.insert = `INSERT INTO ` + t + ` (consumer, message_id, fingerprint, source, partition, "offset")
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (consumer, message_id) DO NOTHING`
	st.existing = `SELECT fingerprint, processed_at FROM ` + t + ` WHERE consumer = $1 AND message_id = $2`
	// claimOne is the claim BeginClaim pipelines after BEGIN: the
	// claim's INSERT, which also makes the transaction's commit
	// synchronous (set_config, local to the transaction), so that a new
	// message costs the statements of the hand-written recipe and nothing
	// more. Measured side by side, one statement that also read the
	// conflicting row (a CTE with UNION ALL) cost new messages more than
	// it saved duplicates; a conflict is read by a statement of its own
	// (see existing), with a new snapshot.
	st.claimOne = `INSERT INTO ` + t + ` (consumer, message_id, fingerprint, source, partition, "offset")
SELECT $1, $2, $3, $4, $5, $6 WHERE set_config('synchronous_commit', 'on', true) IS NOT NULL
	AND set_config('idemq.tx', $7, true) IS NOT NULL
ON CONFLICT (consumer, message_id) DO NOTHING`
	// No FOR UPDATE: row locks need the UPDATE privilege, and the
	// runtime's role needs only SELECT, INSERT and DELETE. A row another
	// purge is deleting is waited for, then skipped.
	st.purge = `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM ` + t + `
	WHERE processed_at < $1
	LIMIT $2))`
	st.lookup = `SELECT consumer, message_id, fingerprint, processed_at, source, partition, "offset"
FROM ` + t + ` WHERE consumer = $1 AND message_id = $2`
	st.stats = `SELECT count(*), min(processed_at) FROM ` + t + ` WHERE $1::text = '' OR consumer = $1::text`
	st.batchInsert, st.batchExisting = batchSQL(t)
	st.syncCommit = `SELECT set_config('synchronous_commit', 'on', true), set_config('idemq.tx', $1, true)`
	st.commitCheck = pgx.Identifier{schema, table + commitCheckSuffix}.Sanitize()
	// Named whatever the store was told: a store configured for a plain
	// table may find a partitioned one (Purge, SealPartitions, Sealed).
	sealedSQL(st, pgx.Identifier{schema, table + defaultSuffix}.Sanitize(),
		pgx.Identifier{schema, table + sealedSuffix}.Sanitize(), pgx.Identifier{schema, table + filterSuffix}.Sanitize())
	if partitioned {
		partitionedSQL(st)
	}
	return st
}

// statements returns the store's SQL, first learning the schema from the
// database's current_schema() (the first existing schema of the search_path)
// if Config.Schema was empty. A failed lookup is retried on the next call.
func (s *Store) statements(ctx context.Context) (*statements, error) {
	if st := s.st.Load(); st != nil {
		return st, nil
	}
	s.resolveMu.Lock()
	defer s.resolveMu.Unlock()
	if st := s.st.Load(); st != nil {
		return st, nil
	}
	schema, err := currentSchema(ctx, s.db)
	if err != nil {
		return nil, fmt.Errorf("processed: %s: %w", s.cfg.Table, err)
	}
	st := newStatements(schema, s.cfg.Table, s.cfg.Partitioned)
	s.st.Store(st)
	return st, nil
}

// currentSchema returns the schema unqualified names resolve to.
func currentSchema(ctx context.Context, db DB) (string, error) {
	var schema *string
	if err := db.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
		return "", fmt.Errorf("read the schema from search_path: %w", err)
	}
	if schema == nil {
		return "", &consumer.ConfigError{Field: "Schema", Reason: "empty, and the connection's search_path names no existing schema: create one, fix search_path, or set Config.Schema"}
	}
	if err := validIdent("Schema", *schema); err != nil {
		return "", fmt.Errorf("the search_path's schema: %w", err)
	}
	return *schema, nil
}

// Schema returns the schema holding the table: Config.Schema, or the one the
// search_path names once the store has asked the database ("" until then).
func (s *Store) Schema() string {
	if st := s.st.Load(); st != nil {
		return st.schema
	}
	return s.cfg.Schema
}

// Table returns the table's name, without its schema.
func (s *Store) Table() string { return s.cfg.Table }

// String returns "schema.table", unquoted, for messages.
func (s *Store) String() string {
	if schema := s.Schema(); schema != "" {
		return schema + "." + s.cfg.Table
	}
	return "(search_path)." + s.cfg.Table
}

// Pool returns the pool the store uses: the one Open made, or the one New
// was given; nil if New was given something else. Use it for the queries
// of your own that belong beside the store's.
func (s *Store) Pool() *pgxpool.Pool {
	if s.pool != nil {
		return s.pool
	}
	p, _ := s.db.(*pgxpool.Pool)
	return p
}

// MaxConns implements consumer.Store: the pool's MaxConns, 1 for a
// *pgx.Conn, 0 if unknown.
func (s *Store) MaxConns() int {
	switch db := s.db.(type) {
	case *pgxpool.Pool:
		return int(db.Config().MaxConns)
	case *pgx.Conn:
		return 1
	}
	return 0
}

// Ping implements consumer.Store: it reports whether the database answers.
func (s *Store) Ping(ctx context.Context) error {
	if p, ok := s.db.(interface{ Ping(context.Context) error }); ok {
		return p.Ping(ctx)
	}
	_, err := s.db.Exec(ctx, ";")
	return err
}

// Close closes the pool Open made, after its connections are released. For
// a store made with New it does nothing: the caller owns that handle.
func (s *Store) Close() {
	if s.pool != nil {
		s.pool.Close()
	}
}

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
	st, err := s.statements(ctx)
	if err != nil {
		return consumer.ClaimResult{}, err
	}
	if st.partitioned {
		// First skipping the sealed partitions (see seal.go); if that
		// inserts nothing, as claim does, looking everywhere.
		fi, err := s.firstClaim(ctx, tx, st, c)
		if err != nil {
			return consumer.ClaimResult{}, err
		}
		inserted := false
		b := &pgx.Batch{}
		b.Queue(st.lock, claimLockKey(c.Consumer, c.MessageID), "")
		fi.queue(b).Exec(func(tag pgconn.CommandTag) error {
			inserted = tag.RowsAffected() == 1
			return nil
		})
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return consumer.ClaimResult{}, fi.wrap("claim: lock and insert", err)
		}
		if inserted {
			return consumer.ClaimResult{Outcome: consumer.ClaimNew}, nil
		}
		// Most often a duplicate: read it first, as pipelinedClaim does.
		res, found, err := s.existingAfter(ctx, st, tx, fi, c)
		if err != nil || found {
			return res, err
		}
		return s.fullClaim(ctx, st, tx, c)
	}
	return s.claim(ctx, st, tx, c)
}

// fullClaim is claim on a partitioned table, with sequential scans off.
func (s *Store) fullClaim(ctx context.Context, st *statements, tx pgx.Tx, c consumer.Claim) (res consumer.ClaimResult, err error) {
	err = s.withoutScans(ctx, tx, st, "claim", func() error {
		res, err = s.claim(ctx, st, tx, c)
		return err
	})
	return res, err
}

// claim is Claim's insert and, on a conflict, select.
func (s *Store) claim(ctx context.Context, st *statements, tx pgx.Tx, c consumer.Claim) (consumer.ClaimResult, error) {
	args := claimArgs(c)
	for attempt := 1; ; attempt++ {
		tag, err := tx.Exec(ctx, st.insert, args...)
		if err != nil {
			return consumer.ClaimResult{}, s.wrap("claim: insert", err)
		}
		if tag.RowsAffected() == 1 {
			return consumer.ClaimResult{Outcome: consumer.ClaimNew}, nil
		}
		res, found, err := s.existing(ctx, st, tx, c)
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
func (s *Store) existing(ctx context.Context, st *statements, tx pgx.Tx, c consumer.Claim) (res consumer.ClaimResult, found bool, err error) {
	var (
		fp []byte
		at time.Time
	)
	err = tx.QueryRow(ctx, st.existing, c.Consumer, c.MessageID).Scan(&fp, &at)
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

// syncBegin starts a transaction whose commit is synchronous whatever the
// server or role default: the runtime acks once the commit returns, so the
// commit must be durable. Sent as one simple-protocol query, it costs one
// round trip.
const syncBegin = "BEGIN ISOLATION LEVEL READ COMMITTED; " + setSyncCommit

// setSyncCommit makes the current transaction's commit synchronous.
const setSyncCommit = "SET LOCAL synchronous_commit = on"

// beginTxer is implemented by *pgxpool.Pool and *pgx.Conn.
type beginTxer interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// batchBeginner is implemented by *pgxpool.Pool and *pgx.Conn: a batch sent
// on it can begin a transaction (pgx.Batch.BeginTx).
type batchBeginner interface {
	beginTxer
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// txOptions returns a new token and the options of a transaction that
// carries it: READ COMMITTED, and committed only after the token's check.
//
// The token (idemq.tx, set in the transaction's first statement) marks the
// transaction as the one BeginClaim began. Its commit first runs the
// table's commit check (migration 0003), which fails unless the
// transaction open then still carries the token (a handler may have ended
// it with SQL and begun another, which must not commit) and allows the
// claims' rows to commit: the table's commit guard makes every other
// COMMIT of a transaction with a token fail (a handler's own COMMIT, END
// or PREPARE TRANSACTION), rolling it back. Both checks and the COMMIT
// go in one simple-protocol query, one round trip as before.
func (s *Store) txOptions(st *statements) (token string, opts pgx.TxOptions) {
	token = s.tokenPrefix + strconv.FormatUint(s.tokens.Add(1), 36)
	return token, pgx.TxOptions{IsoLevel: pgx.ReadCommitted,
		CommitQuery: "SELECT " + st.commitCheck + "('" + token + "'); COMMIT"}
}

// begin starts a READ COMMITTED transaction with a synchronous commit.
func (s *Store) begin(ctx context.Context) (pgx.Tx, error) {
	if b, ok := s.db.(beginTxer); ok {
		st, err := s.statements(ctx)
		if err != nil {
			return nil, err
		}
		token, opts := s.txOptions(st)
		opts.BeginQuery = syncBegin + "; SELECT set_config('idemq.tx', '" + token + "', true)"
		tx, err := b.BeginTx(ctx, opts)
		if err != nil {
			return nil, s.wrap("begin", err)
		}
		return tx, nil
	}
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return nil, s.wrap("begin", err)
	}
	// The first statement of the transaction, so the isolation level can
	// still be set whatever the session's default.
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; "+setSyncCommit); err != nil {
		_ = tx.Rollback(ctx)
		return nil, s.wrap("begin: set isolation and synchronous_commit", err)
	}
	return tx, nil
}

// BeginClaim implements consumer.Store: it begins a READ COMMITTED
// transaction whose commit is synchronous (the runtime acks once it
// returns), and claims claims in it, with Claim's semantics for one claim and
// ClaimBatch's for several. For one claim, BEGIN and the INSERT go to the
// server in one pipelined round trip. A non-nil tx must be rolled back by
// the caller if it does not commit, also when err is not nil.
func (s *Store) BeginClaim(ctx context.Context, claims []consumer.Claim) (pgx.Tx, []consumer.ClaimResult, error) {
	if bb, ok := s.db.(batchBeginner); ok {
		if len(claims) == 1 {
			tx, res, err := s.pipelinedClaim(ctx, bb, claims[0])
			if err != nil {
				return tx, nil, err
			}
			return tx, []consumer.ClaimResult{res}, nil
		}
		if len(claims) > 1 {
			return s.pipelinedClaimBatch(ctx, bb, claims)
		}
	}
	tx, err := s.begin(ctx)
	if err != nil {
		return nil, nil, err
	}
	if len(claims) == 1 {
		res, err := s.Claim(ctx, tx, claims[0])
		if err != nil {
			return tx, nil, err
		}
		return tx, []consumer.ClaimResult{res}, nil
	}
	res, err := s.ClaimBatch(ctx, tx, claims)
	return tx, res, err
}

// pipelinedClaimBatch sends BEGIN, SET LOCAL and the batch INSERT of
// ClaimBatch in one round trip, then finishes as ClaimBatch does.
func (s *Store) pipelinedClaimBatch(ctx context.Context, db batchBeginner, claims []consumer.Claim) (pgx.Tx, []consumer.ClaimResult, error) {
	bc, err := s.newBatchClaim(ctx, claims)
	if err != nil {
		return nil, nil, err
	}
	var (
		inserted  []string
		ran, want = 0, 1
	)
	collect := func(rows pgx.Rows) error {
		ran++
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		inserted = append(inserted, ids...)
		return err
	}
	wrap := s.wrap
	var fis firstInserts
	b := &pgx.Batch{}
	token, opts := s.txOptions(bc.st)
	b.BeginTx(opts)
	if bc.st.partitioned {
		if fis, err = s.firstBatchClaim(ctx, s.db, bc, claims); err != nil {
			return nil, nil, err
		}
		b.Queue(bc.st.batchLock, claimLockKeys(claims), token) // synchronous commit too
		fis.queue(b, collect)
		wrap, want = fis.wrap, len(fis.inserts)
	} else {
		b.Queue(bc.st.syncCommit, token)
		b.Queue(bc.st.batchInsert, bc.insertArgs(claims)...).Query(collect)
	}
	br := db.SendBatch(ctx, b)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		if tx == nil {
			return nil, nil, s.wrap("claim batch: begin", err)
		}
		return tx, nil, wrap("claim batch: begin and insert", err)
	}
	switch {
	case tx == nil:
		return nil, nil, errors.New("processed: claim batch: the batch began no transaction")
	case ran != want:
		return tx, nil, fmt.Errorf("processed: claim batch: %d of the %d queued inserts ran", ran, want)
	}
	res, err := bc.finish(ctx, tx, inserted, fis.existing, fis.wrap)
	if err != nil {
		return tx, nil, err
	}
	return tx, res, nil
}

// pipelinedClaim sends BEGIN and the claim (on a plain table claimOne, the
// synchronous commit and the INSERT in one statement; on a partitioned one
// the lock statement and the first insert) in one batch, then, if the
// insert conflicted, reads the existing row with a new snapshot as Claim
// does.
func (s *Store) pipelinedClaim(ctx context.Context, db batchBeginner, c consumer.Claim) (pgx.Tx, consumer.ClaimResult, error) {
	if c.Consumer == "" || c.MessageID == "" {
		tx, err := s.begin(ctx)
		if err != nil {
			return nil, consumer.ClaimResult{}, err
		}
		res, err := s.Claim(ctx, tx, c) // reports the error
		return tx, res, err
	}
	st, err := s.statements(ctx)
	if err != nil {
		return nil, consumer.ClaimResult{}, err
	}
	var (
		ran, inserted, seen bool
		first               firstInsert
	)
	wrap := s.wrap
	b := &pgx.Batch{}
	token, opts := s.txOptions(st)
	b.BeginTx(opts)
	record := func(tag pgconn.CommandTag) error {
		ran, seen, inserted = true, true, tag.RowsAffected() == 1
		return nil
	}
	if st.partitioned {
		if first, err = s.firstClaim(ctx, s.db, st, c); err != nil {
			return nil, consumer.ClaimResult{}, err
		}
		b.Queue(st.lock, claimLockKey(c.Consumer, c.MessageID), token)
		first.queue(b).Exec(record)
		wrap = first.wrap
	} else {
		b.Queue(st.claimOne, append(claimArgs(c), token)...).Exec(record)
	}
	br := db.SendBatch(ctx, b)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		if tx == nil {
			return nil, consumer.ClaimResult{}, s.wrap("claim: begin", err)
		}
		return tx, consumer.ClaimResult{}, wrap("claim: begin and insert", err)
	}
	switch {
	case tx == nil:
		return nil, consumer.ClaimResult{}, errors.New("processed: claim: the batch began no transaction")
	case !ran:
		return tx, consumer.ClaimResult{}, errors.New("processed: claim: the queued insert did not run")
	case seen && inserted:
		return tx, consumer.ClaimResult{Outcome: consumer.ClaimNew}, nil
	}
	// The insert conflicted with a committed row (or, on a partitioned
	// table, a sealed partition's filter has the id): read it with a new
	// snapshot, as Claim does. If it is not there (purged meanwhile, or
	// the filter's false positive), Claim claims the id afresh, looking in
	// every partition.
	var (
		res   consumer.ClaimResult
		found bool
	)
	if st.partitioned {
		res, found, err = s.existingAfter(ctx, st, tx, first, c)
	} else {
		res, found, err = s.existing(ctx, st, tx, c)
	}
	if err != nil || found {
		return tx, res, err
	}
	if st.partitioned {
		res, err = s.fullClaim(ctx, st, tx, c) // the lock is held
	} else {
		res, err = s.claim(ctx, st, tx, c)
	}
	return tx, res, err
}

// Purge deletes the rows processed more than olderThan ago (by the database's
// clock) and returns how many it deleted. It deletes in batches of
// Config.PurgeBatchSize rows, each its own statement and transaction, so it
// never holds many locks for long. It needs only the SELECT and DELETE
// privileges. It stops when a batch deletes fewer rows than the batch size, or
// when ctx is done.
//
// On a partitioned table (whatever Config.Partitioned says) it first creates
// the partitions ahead (EnsurePartitions), then drops each partition whose
// whole range is older than olderThan, and deletes the old rows of the
// DEFAULT partition in batches as above; it needs to own the table. Rows so
// live between olderThan and olderThan plus one PartitionInterval. The
// count of a dropped partition's rows is the planner's estimate when it has
// one.
func (s *Store) Purge(ctx context.Context, olderThan time.Duration) (int64, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return 0, err
	}
	// By what the table is, not what the store was told: the plain
	// purge's ctids are not unique across partitions.
	kind, err := s.relkind(ctx, s.db, st)
	if err != nil {
		return 0, s.wrap("purge: read the table's kind", err)
	}
	if kind == 'p' {
		return s.purgePartitioned(ctx, st, olderThan)
	}
	n, step, err := pgpurge.Run(ctx, s.db, st.purge, olderThan, s.cfg.PurgeBatchSize, s.cfg.pace())
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
	st, err := s.statements(ctx)
	if err != nil {
		return Record{}, err
	}
	var r Record
	err = s.db.QueryRow(ctx, st.lookup, consumerName, id).Scan(
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
	q, err := s.statements(ctx)
	if err != nil {
		return Stats{}, err
	}
	if err := s.db.QueryRow(ctx, q.stats, consumerName).Scan(&st.Rows, &oldest); err != nil {
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
