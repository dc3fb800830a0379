// Package processed is the Postgres dedup store: the table that records which
// message ids each consumer has applied.
//
// [Store.BeginClaim] begins a transaction and inserts a row per message in
// it, with INSERT ... ON CONFLICT DO NOTHING, so each claim commits or rolls
// back together with the handler's effect. A concurrent claim of the same id
// waits on the primary key until the first transaction ends: if it
// committed, the second claim reports a duplicate; if it rolled back, the
// second claim inserts. Each row keeps the sha256 fingerprint of the
// payload, so the same id carrying a different payload is reported as a
// mismatch rather than skipped silently.
//
// The schema is created by [Store.Migrate] (or `idemq migrate`) from
// embedded, numbered SQL migrations. Old rows go by [Store.Purge], each
// consumer's by its own retention. The table has one of two layouts: a
// plain table, whose purge deletes rows in batches, or, with
// [Config.Partitioned], three generations of rows whose upkeep
// ([Store.Maintain]) retires the oldest whole (see generations.go).
//
// A claim's duplicate detection relies on READ COMMITTED, which BeginClaim
// sets whatever the session's default.
//
// # Synchronous commit
//
// The runtime acks a message once its transaction's COMMIT returns, so
// BeginClaim makes that commit synchronous: a synchronous_commit of off or
// local (the session's, from the server, database, role or URL, or the
// handler's SET LOCAL) is raised to on in the transaction, by the claim
// and again at COMMIT, by the commit guard's trigger. The stronger values, remote_write and
// remote_apply, which make a COMMIT wait for the synchronous standbys that
// synchronous_standby_names names (and on waits for their flush), are
// kept as the session has them: setting a role's or database's
// synchronous_commit to remote_apply is how an operator asks for it.
// [Store.Durability] reads how many servers hold a commit when its COMMIT
// returns; the runtime logs it when Run starts, with a warning when a
// standby streams asynchronously (a failover to it can lose acked
// messages), and `idemq status` prints it.
//
// # PgBouncer and other transaction-pooling proxies
//
// The store works through a proxy that pools server connections per
// transaction (PgBouncer with pool_mode = transaction) only if pgx prepares
// no named statement that outlives a transaction: put
// default_query_exec_mode=exec (or simple_protocol) in the database URL, as
// in
//
//	postgres://app@pgbouncer:6432/app?default_query_exec_mode=exec
//
// or set ConnConfig.DefaultQueryExecMode on a pool of your own. With pgx's
// default mode, cache_statement, a transaction runs on whichever server
// connection is free, which lacks the statements pgx prepared on another
// ("prepared statement "stmtcache_…" does not exist", SQLSTATE 26000) or
// already has them from another client ("… already exists", 42P05). The
// store returns those as the configuration error of
// [consumer.StatementCacheError], which names the fix, and the runtime
// stops on it: Run returns it, having requeued what it held and
// dead-lettered nothing for it. (A statement that did run ran the right
// SQL: pgx names a cached statement by a hash of its text.) Session pooling
// works in any mode. PgBouncer 1.21 and later can track protocol-level
// prepared statements itself (max_prepared_statements above 0); the tests
// run Debian's 1.18, which cannot, with max_prepared_statements = 0 on
// later versions.
package processed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/pgmigrate"
)

// DB is the database handle of idemq's three Postgres components: New
// takes one, and so do outbox.New and httpidem.New. It is a *pgxpool.Pool
// (what Open makes, and what you pass in most programs), or a *pgx.Conn,
// which serves one goroutine at a time.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ErrNotFound is returned by [Store.Lookup] when no row matches. Compare
// with errors.Is.
//
// Errors caused by the dedup table (or its schema) not existing, or not
// yet having the layout the Config asks for, wrap
// [consumer.ErrNotMigrated], on which the runtime stops instead of
// retrying: run [Store.Migrate] or `idemq migrate`.
var ErrNotFound = errors.New("processed: not found")

// maxClaimAttempts bounds the insert/select loop of a claim whose
// conflicting row disappears (is purged) between the two statements.
const maxClaimAttempts = 3

// Table name suffixes.
const (
	retentionSuffix   = "_retention"    // the janitor's reports (migration 0002)
	commitCheckSuffix = "_commit_check" // the commit's check of earlier versions (migration 0004)
	commitGuardSuffix = "_commit_guard" // the commit guard (migrations 0004 and 0009)
	horizonsSuffix    = "_horizons"     // each consumer's purge horizon (migration 0005)
)

// Store is the Postgres dedup store and the runtime's database handle: it
// implements dedup.Store, so a consumer.Config takes it as its one
// Postgres field, and the same Store serves migrations, lookups, stats and
// purges. It is safe for concurrent use, except when made with New over a
// *pgx.Conn, which is one connection.
type Store struct {
	db DB
	// pool is the handle Open made, which Close closes; nil for New.
	pool *pgxpool.Pool
	cfg  Config
	// schema is Config.Schema or the search_path's, once resolved; st the
	// statements, built once the table's layout is known (see
	// statements).
	schema    *pgmigrate.Schema
	st        atomic.Pointer[statements]
	resolveMu sync.Mutex
	// tokens numbers the transactions BeginClaim begins, after
	// tokenPrefix, random per store (see txOptions).
	tokens      atomic.Uint64
	tokenPrefix string
}

// statements are the store's SQL, for one resolved schema and layout.
type statements struct {
	schema string
	// qTable is the quoted, schema-qualified table: the plain table, or
	// the view of the generations.
	qTable string
	// layout does what the table's layout does its own way.
	layout layout
	// insert claims a batch (RETURNING the ids it inserted); existing
	// reads the rows of the ids it did not insert. insertOne and
	// existingOne do the same for a single claim, with scalar arguments:
	// a transaction per message (strict mode) is the runtime's hottest
	// path, and the arrays cost it about a fifth of its throughput.
	insert, existing, insertOne, existingOne string
	// syncCommit makes the transaction's commit synchronous (see
	// raiseSyncCommit) and records its token ($7 of the inserts, which do
	// the same for each row they try; see BeginClaim).
	syncCommit    string
	lookup, stats string
	// lookupKey is lookup of one shard key's row ($3), on a table with
	// the shard key in its primary key.
	lookupKey string
	// horizons is the table of purge horizons, recordHorizon its upsert.
	horizons, recordHorizon string
	// shardMap is the table of a sharded store's map (see Sharded).
	shardMap string
	// keyed says the primary key holds the shard key
	// (Config.ShardKeyInPrimaryKey).
	keyed bool
}

// conflictKey is the primary key's columns, the claims' ON CONFLICT
// target.
func (st *statements) conflictKey() string {
	if st.keyed {
		return "(consumer, shard_key, message_id)"
	}
	return "(consumer, message_id)"
}

// Store is a dedup.Store with the three optional methods dedup.Store
// lists.
var _ interface {
	dedup.Store
	Maintain(ctx context.Context) error
	RecordRetention(ctx context.Context, r dedup.RetentionReport) error
	Durability(ctx context.Context) (dedup.Durability, error)
} = (*Store)(nil)

// New returns a store for the table cfg names, over db: a *pgxpool.Pool (the
// caller keeps owning it: Close does not close it) or a *pgx.Conn, which is
// one connection, so a runtime using it must have Concurrency 1 and no
// Retention. To have the store make and own its pool, use Open. New does not
// touch the database: the store learns the schema (from db's search_path
// when Config.Schema is empty) and the table's layout on first use. Call
// Migrate to create the table.
func New(db DB, cfg Config) (*Store, error) {
	if db == nil {
		return nil, &consumer.ConfigError{Field: "db", Reason: "required"}
	}
	if cfg.MaxConns != 0 {
		return nil, &consumer.ConfigError{Field: "MaxConns", Reason: "sizes the pool Open makes; with New the pool you pass decides"}
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Store{db: db, cfg: cfg, schema: pgmigrate.NewSchema(cfg.Schema), tokenPrefix: strconv.FormatUint(rand.Uint64(), 36) + "."}, nil
}

// resolveSchema returns the schema: Config.Schema, or the database's
// current_schema() (the first existing schema of the search_path), learned
// once. A failed lookup is retried on the next call.
func (s *Store) resolveSchema(ctx context.Context) (string, error) {
	return s.schema.Resolve(ctx, s.db, "processed", s.cfg.Table)
}

// statements returns the store's SQL, reading the table's layout once: a
// plain table, or the view of a partitioned layout's generations. A table
// that does not exist yet, or has not the layout the Config asks for but
// can be migrated to it, is consumer.ErrNotMigrated, and is read again on the next
// call; a partitioned table with a Config that does not ask for it is a
// *consumer.ConfigError.
func (s *Store) statements(ctx context.Context) (*statements, error) {
	if st := s.st.Load(); st != nil {
		return st, nil
	}
	s.resolveMu.Lock()
	defer s.resolveMu.Unlock()
	if st := s.st.Load(); st != nil {
		return st, nil
	}
	schema, err := s.resolveSchema(ctx)
	if err != nil {
		return nil, err
	}
	t := pgx.Identifier{schema, s.cfg.Table}.Sanitize()
	gen := newGenerations(schema, s.cfg.Table)
	var lay layout = gen
	var (
		kind                    *string
		hasGens, current, keyed bool
	)
	// From the catalog, which needs no privilege on the tables: what the
	// table is, and whether the objects this version's claims and purges
	// use exist (the latest migrations made them).
	if err := s.db.QueryRow(ctx, `SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)), to_regclass($2) IS NOT NULL,
	EXISTS (SELECT 1 FROM pg_proc WHERE oid = to_regprocedure($3 || '()') AND prosrc LIKE '%current_query()%') AND to_regclass($4) IS NOT NULL AND (to_regclass($2) IS NULL OR to_regclass($5) IS NOT NULL)
	AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = coalesce(to_regclass($6), to_regclass($1)) AND attname = 'shard_key' AND NOT attisdropped)
	AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($7) AND attname = 'complete' AND NOT attisdropped),
	EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
		WHERE i.indrelid = to_regclass($1) AND i.indisprimary AND a.attname = 'shard_key')`,
		t, gen.meta, pgx.Identifier{schema, s.cfg.Table + commitGuardSuffix}.Sanitize(),
		pgx.Identifier{schema, s.cfg.Table + horizonsSuffix}.Sanitize(), gen.tables[retired], gen.tables[0],
		pgx.Identifier{schema, s.cfg.Table + shardMapSuffix}.Sanitize()).Scan(&kind, &hasGens, &current, &keyed); err != nil {
		return nil, s.wrap("read the table's layout", err)
	}
	notMigrated := func(why string) error {
		return fmt.Errorf("processed: %s %s: %w", s, why, consumer.ErrNotMigrated)
	}
	switch {
	case kind == nil:
		return nil, notMigrated("does not exist")
	case keyed && !s.cfg.ShardKeyInPrimaryKey:
		return nil, &consumer.ConfigError{Field: "ShardKeyInPrimaryKey", Reason: fmt.Sprintf("not set, and %s keeps the shard key in its primary key", s)}
	case *kind == "r" && s.cfg.ShardKeyInPrimaryKey && !keyed:
		return nil, notMigrated("has (consumer, message_id) as its primary key, and Config.ShardKeyInPrimaryKey asks for the shard key in it: Migrate converts it")
	case *kind == "r" && s.cfg.Partitioned:
		return nil, notMigrated("is a plain table, and Config.Partitioned asks for the partitioned layout: Migrate converts it")
	case *kind == "r":
		lay = newPlain(t)
	case *kind == "v" && hasGens && !s.cfg.Partitioned:
		return nil, &consumer.ConfigError{Field: "Partitioned", Reason: fmt.Sprintf("not set, and %s has the partitioned layout", s)}
	case *kind == "v" && hasGens:
	case *kind == "p":
		return nil, notMigrated("has the partitioned layout of earlier versions: Migrate converts it")
	default:
		return nil, fmt.Errorf("processed: %s is not a table of idemq's (relkind %q)", s, *kind)
	}
	if !current {
		// A table of earlier migrations lacks what the claims use: this
		// version of idemq refuses it until Migrate has run.
		return nil, notMigrated("lacks the objects of the latest migrations (the purge horizons, the shard key, the shard map's completeness, the commit guard that reads the commit)")
	}
	st := newStatements(schema, s.cfg.Table, lay, keyed)
	s.st.Store(st)
	return st, nil
}

// raiseSyncCommit makes the transaction's commit synchronous: it raises
// the session's synchronous_commit to on when it is off or local, and
// keeps remote_write, on and remote_apply, never downgrading what the
// server, database, role or URL asks for. (current_setting names the
// values so, whatever synonym set them: false, no or 0 read off.) It is
// not NULL.
const raiseSyncCommit = `set_config('synchronous_commit', CASE WHEN current_setting('synchronous_commit') IN ('off', 'local') THEN 'on'
	ELSE current_setting('synchronous_commit') END, true)`

func newStatements(schema, table string, lay layout, keyed bool) *statements {
	t := pgx.Identifier{schema, table}.Sanitize()
	st := &statements{schema: schema, qTable: t, layout: lay, keyed: keyed,
		horizons: pgx.Identifier{schema, table + horizonsSuffix}.Sanitize(),
		shardMap: pgx.Identifier{schema, table + shardMapSuffix}.Sanitize(),
	}
	st.syncCommit = `SELECT ` + raiseSyncCommit + `, set_config('idemq.tx', $1, true)`
	into, others := lay.claimTables()
	// The synchronous commit and the token first: a row inserted has had
	// every condition evaluated.
	where := func(id string) string {
		b := strings.Builder{}
		b.WriteString("\nWHERE " + raiseSyncCommit + " IS NOT NULL AND set_config('idemq.tx', $7, true) IS NOT NULL")
		for _, g := range others {
			b.WriteString("\n\tAND NOT EXISTS (SELECT 1 FROM " + g + " g WHERE g.consumer = $1 AND g.message_id = " + id + ")")
		}
		return b.String()
	}
	head := `INSERT INTO ` + into + ` (consumer, message_id, fingerprint, source, partition, "offset", shard_key)`
	// Without the shard key in the primary key, a claim without one
	// stores NULL; with it, every claim has one (see newBatch).
	key, keyOne := `NULLIF(u.sk, '')`, `NULLIF($8::text, '')`
	if keyed {
		key, keyOne = `u.sk`, `$8::text`
	}
	st.insert = head + `
SELECT $1, u.id, u.fp, u.src, NULLIF(u.part, -1), NULLIF(u.off, -1), ` + key + `
FROM unnest($2::text[], $3::bytea[], $4::text[], $5::int[], $6::bigint[], $8::text[]) AS u(id, fp, src, part, off, sk)` + where("u.id") + `
ON CONFLICT ` + st.conflictKey() + ` DO NOTHING
RETURNING message_id`
	st.insertOne = head + `
SELECT $1::text, $2::text, $3::bytea, $4::text, $5::integer, $6::bigint, ` + keyOne + where("$2::text") + `
ON CONFLICT ` + st.conflictKey() + ` DO NOTHING`
	from := lay.readFrom()
	// A claim's own row, by its primary key: with the shard key in it, by
	// the key as well ($3, the claims' keys, in the same order as $2).
	sameKey, sameKeyOne, arrays, cols := "", "", "$2::text[]", "id"
	if keyed {
		sameKey, sameKeyOne, arrays, cols = " AND shard_key = u.sk", " AND shard_key = $3", "$2::text[], $3::text[]", "id, sk"
	}
	st.existingOne = `SELECT fingerprint, processed_at FROM ` + from + ` WHERE consumer = $1 AND message_id = $2` + sameKeyOne + ` LIMIT 1`
	// One primary-key probe per id (per generation), whatever the planner
	// believes. The plain form, WHERE consumer = $1 AND message_id =
	// ANY($2), is planned as an index scan on consumer alone that filters
	// message_id whenever the statistics do not know the consumer (a new
	// consumer, stale statistics, or a generic plan made while the table
	// was small): it then reads every row the consumer has, per batch.
	// LIMIT 1 keeps the lateral subquery from being flattened into such a
	// join. (The purge's index on consumer and processed_at would be
	// another such scan; its collation keeps it out: migration 0005.)
	st.existing = `SELECT p.message_id, p.fingerprint, p.processed_at
FROM unnest(` + arrays + `) AS u(` + cols + `)
CROSS JOIN LATERAL (
	SELECT message_id, fingerprint, processed_at FROM ` + from + `
	WHERE consumer = $1 AND message_id = u.id` + sameKey + `
	LIMIT 1) AS p`
	st.lookup = `SELECT consumer, message_id, fingerprint, processed_at, source, partition, "offset"
FROM ` + from + ` WHERE consumer = $1 AND message_id = $2 LIMIT 1`
	st.lookupKey = `SELECT consumer, message_id, fingerprint, processed_at, source, partition, "offset"
FROM ` + from + ` WHERE consumer = $1 AND message_id = $2 AND shard_key = $3`
	st.stats = `SELECT count(*), min(processed_at) FROM ` + from + ` WHERE $1::text = '' OR consumer = $1::text`
	st.recordHorizon = `INSERT INTO ` + st.horizons + ` AS h (consumer, purge_before, older_than_ms)
VALUES ($1, now() - $2::bigint * interval '1 microsecond', $2::bigint / 1000)
ON CONFLICT (consumer) DO UPDATE SET purge_before = excluded.purge_before,
	older_than_ms = excluded.older_than_ms, recorded_at = now()
RETURNING purge_before`
	return st
}

// Schema returns the schema holding the table: Config.Schema, or the one the
// search_path names once the store has asked the database ("" until then).
func (s *Store) Schema() string { return s.schema.Get() }

// Table returns the table's name, without its schema.
func (s *Store) Table() string { return s.cfg.Table }

// String returns "schema.table", unquoted, for messages.
func (s *Store) String() string { return s.schema.Qualified(s.cfg.Table) }

// Pool returns the pool the store uses: the one Open made, or the one New
// was given; nil if New was given a connection. Use it for the queries of
// your own that belong beside the store's.
func (s *Store) Pool() *pgxpool.Pool {
	if s.pool != nil {
		return s.pool
	}
	p, _ := s.db.(*pgxpool.Pool)
	return p
}

// MaxConns implements dedup.Store: the pool's MaxConns, 1 for a
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

// Ping implements dedup.Store: it reports whether the database answers.
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

// claimCursor is the cursor a claim's transaction declares, and its commit
// closes: the CLOSE fails unless the transaction open at commit is the one
// BeginClaim began.
const claimCursor = "idemq_claim"

// txOptions returns a new token and the options of a transaction that
// carries it: READ COMMITTED, and committed by a query that names the token.
//
// The token (the setting idemq.tx, set in the transaction's first claim)
// marks the transaction as the one BeginClaim began, which also declares
// claimCursor. Its commit is one simple-protocol query, one round trip as a
// plain COMMIT, which closes the cursor, then commits, its text carrying the
// token. The CLOSE fails when the transaction open then is not the one
// BeginClaim began (a handler may have ended it with SQL and begun another,
// which must not commit); claimTx.Commit says so. At COMMIT the table's
// commit guard (migration 0009), a deferred trigger of each claimed row,
// finds the token in the query's text (current_query()): every other
// COMMIT of a transaction with a token fails (a handler's own COMMIT, END
// or PREPARE TRANSACTION), rolling it back. The guard also raises the
// transaction's synchronous_commit again, as the claim did (a handler's
// SET LOCAL synchronous_commit = off must not make the ack rest on an
// asynchronous commit).
//
// A query of its own before the COMMIT (earlier versions ran the commit
// check so) cost strict mode a tenth of its throughput, in parsing and
// planning it on every commit.
func (s *Store) txOptions() (token string, opts pgx.TxOptions) {
	token = s.tokenPrefix + strconv.FormatUint(s.tokens.Add(1), 36)
	return token, pgx.TxOptions{IsoLevel: pgx.ReadCommitted,
		CommitQuery: "/* idemq-commit " + token + " */ CLOSE " + claimCursor + "; COMMIT"}
}

// claimTx is a claim's transaction: its Commit reports a CLOSE of the claim
// cursor that failed (the transaction open at commit is not the one
// BeginClaim began) as the invalid transaction state (SQLSTATE 25000) that
// dedup.Store asks for. Nothing was committed then.
type claimTx struct {
	pgx.Tx
}

// Commit commits the claim's transaction; see claimTx.
func (tx claimTx) Commit(ctx context.Context) error {
	err := tx.Tx.Commit(ctx)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "34000" && closedClaimCursor(pgErr) { // invalid_cursor_name
		return &pgconn.PgError{Severity: "ERROR", Code: "25000", // invalid_transaction_state
			Message: "idemq: the claim's cursor " + claimCursor + " was gone at commit: a handler ended the runtime's transaction with SQL " +
				"and began another, or closed the cursor (CLOSE ALL); nothing is committed (" + pgErr.Message + ")"}
	}
	return err
}

// closedClaimCursor reports whether err, SQLSTATE 34000 at commit, is the
// commit's CLOSE finding no claim cursor: raised by Postgres's CLOSE (the
// routine, where the server reports it) and naming the cursor (its name
// is in the message in every server language). A handler's own deferred
// trigger raising 34000 at COMMIT, or closing a cursor of its own that is
// gone, is not.
func closedClaimCursor(err *pgconn.PgError) bool {
	return (err.Routine == "" || err.Routine == "PerformPortalClose") && strings.Contains(err.Message, claimCursor)
}

// BeginClaim implements dedup.Store: it begins a READ COMMITTED
// transaction whose commit is synchronous (the runtime acks once it
// returns; see the package's doc: a stronger synchronous_commit than on is
// kept) and claims every element of claims in it, which must share a
// non-empty Consumer and have distinct, non-empty message ids. results[i]
// is ClaimNew if claims[i]'s row was inserted (it commits or rolls back
// with tx), ClaimDuplicate if the id was already committed with the same
// fingerprint, and ClaimMismatch if with a different one. If another
// transaction holds an uncommitted claim of one of the ids, BeginClaim
// waits for it to end; callers that claim concurrently should sort their
// claims by id, so that two batches never wait on each other's ids in
// opposite orders.
//
// BEGIN, the claims' INSERT and the synchronous commit go to the server in
// one round trip; ids that conflicted cost one more, which reads their
// rows. A non-nil tx must be rolled back by the caller if it does not
// commit, also when err is not nil. Only the runtime's Commit of tx
// commits: see dedup.Store.
func (s *Store) BeginClaim(ctx context.Context, claims []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	b, err := newBatch(claims)
	if err != nil {
		return nil, nil, err
	}
	st, err := s.statements(ctx)
	if err != nil {
		return nil, nil, err
	}
	if st.keyed {
		for _, c := range claims {
			if c.Route.Key == "" {
				return nil, nil, fmt.Errorf("processed: %s keeps the shard key in its primary key, and message %q has no shard key: claim through a Sharded, whose map keys every message: %w",
					s, c.MessageID, consumer.ErrInvalidConfig)
			}
		}
	}
	for attempt := 1; ; attempt++ {
		tx, res, err := s.claimOnce(ctx, st, b)
		if !errors.Is(err, errClaimRaced) {
			return tx, res, err
		}
		_ = tx.Rollback(context.WithoutCancel(ctx))
		if attempt >= maxClaimAttempts {
			return nil, nil, fmt.Errorf("processed: claim on %s: rows conflicted but vanished %d times", s, attempt)
		}
	}
}

// errClaimRaced is finish's answer when rows its INSERT conflicted with
// were purged before it could read them, after it had inserted others:
// claiming them afresh in this transaction would insert ids out of the
// claims' order, behind rows it already holds, and two claims of the
// same ids could then wait on each other (a deadlock, seen beside a
// purge). The claim begins again instead, in a new transaction.
var errClaimRaced = errors.New("processed: claim raced a purge")

// claimOnce begins a transaction, claims b's ids in it and returns it with
// their results; errClaimRaced (with the transaction, to roll back) if a
// purge raced it.
func (s *Store) claimOnce(ctx context.Context, st *statements, b *batch) (pgx.Tx, []dedup.ClaimResult, error) {
	var inserted []string
	token, opts := s.txOptions()
	b.token = token
	clear(b.results)
	claims := b.claims
	// BEGIN, DECLARE and the INSERT: room for the three at once.
	bt := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 3)}
	bt.BeginTx(opts)
	bt.Queue("DECLARE " + claimCursor + " CURSOR FOR SELECT")
	if len(claims) == 1 {
		bt.Queue(st.insertOne, b.args(claims[0])...).Exec(func(tag pgconn.CommandTag) error {
			if tag.RowsAffected() == 1 {
				inserted = []string{claims[0].MessageID}
			}
			return nil
		})
	} else {
		bt.Queue(st.insert, b.insertArgs(claims)...).Query(func(rows pgx.Rows) error {
			var err error
			inserted, err = pgx.CollectRows(rows, pgx.RowTo[string])
			return err
		})
	}
	br := s.db.SendBatch(ctx, bt)
	var tx pgx.Tx
	if t := br.Tx(); t != nil {
		tx = claimTx{t}
	}
	if err := br.Close(); err != nil {
		if tx == nil {
			return nil, nil, s.wrap("claim: begin", err)
		}
		return tx, nil, s.wrap("claim: begin and insert", err)
	}
	if tx == nil {
		return nil, nil, errors.New("processed: claim: the batch began no transaction")
	}
	res, err := b.finish(ctx, s, st, tx, inserted)
	if err != nil {
		return tx, nil, err
	}
	return tx, res, nil
}

// batch is one BeginClaim in progress.
type batch struct {
	// token is its transaction's (see txOptions).
	token   string
	name    string
	claims  []dedup.Claim
	index   map[string]int
	results []dedup.ClaimResult
}

// newBatch checks claims and prepares their claim.
func newBatch(claims []dedup.Claim) (*batch, error) {
	if len(claims) == 0 {
		return nil, errors.New("processed: claim: no claims")
	}
	b := &batch{name: claims[0].Consumer, claims: claims, results: make([]dedup.ClaimResult, len(claims))}
	if len(claims) > maxScannedClaims {
		b.index = make(map[string]int, len(claims))
	}
	for i, c := range claims {
		if c.Consumer != b.name || c.Consumer == "" || c.MessageID == "" {
			return nil, fmt.Errorf("processed: claim %d: consumer %q, message id %q: want one non-empty consumer and non-empty ids", i, c.Consumer, c.MessageID)
		}
		if b.pos(c.MessageID, i) >= 0 {
			return nil, fmt.Errorf("processed: claim: message id %q appears twice", c.MessageID)
		}
		if b.index != nil {
			b.index[c.MessageID] = i
		}
	}
	return b, nil
}

// maxScannedClaims is the most claims a batch finds an id among by
// scanning them; a larger batch keeps an index of its ids. Most claims
// are of one message (strict mode, and the default when a lane takes a
// lone delivery), for which a map would be most of the claim's own
// allocation.
const maxScannedClaims = 8

// pos returns the position of id among the first n claims, or -1.
func (b *batch) pos(id string, n int) int {
	if b.index != nil {
		if i, ok := b.index[id]; ok && i < n {
			return i
		}
		return -1
	}
	for i, c := range b.claims[:n] {
		if c.MessageID == id {
			return i
		}
	}
	return -1
}

// at returns the position of id among the batch's claims, or -1.
func (b *batch) at(id string) int { return b.pos(id, len(b.claims)) }

// errUnclaimedID is returned when a statement returns an id the batch did
// not claim: the table's id column does not keep ids byte for byte.
func errUnclaimedID(id string) error {
	return fmt.Errorf("processed: claim: the table returned message id %q, which was not claimed: is its message_id column text?", id)
}

// args are the arguments of the single claim's INSERT; a negative
// partition or offset is stored as NULL.
func (b *batch) args(c dedup.Claim) []any {
	var partition, offset any // nil is NULL
	if c.Partition >= 0 {
		partition = c.Partition
	}
	if c.Offset >= 0 {
		offset = c.Offset
	}
	return []any{c.Consumer, c.MessageID, c.Fingerprint[:], c.Source, partition, offset, b.token, c.Route.Key}
}

// insertArgs are the arguments of the claim INSERT for pending; a negative
// partition or offset is stored as NULL.
func (b *batch) insertArgs(pending []dedup.Claim) []any {
	ids := make([]string, len(pending))
	fps := make([][]byte, len(pending))
	srcs := make([]string, len(pending))
	parts := make([]int32, len(pending))
	offs := make([]int64, len(pending))
	keys := make([]string, len(pending))
	for i, c := range pending {
		ids[i], fps[i], srcs[i], keys[i] = c.MessageID, c.Fingerprint[:], c.Source, c.Route.Key
		parts[i], offs[i] = max(c.Partition, -1), max(c.Offset, -1)
	}
	return []any{b.name, ids, fps, srcs, parts, offs, b.token, keys}
}

// finish records the ids the INSERT inserted, reads the rows the others
// conflicted with, and claims afresh the ids whose rows were purged in
// between, until every claim has its answer.
func (b *batch) finish(ctx context.Context, s *Store, st *statements, tx pgx.Tx, inserted []string) ([]dedup.ClaimResult, error) {
	pending := b.claims
	holds := false // whether the transaction inserted a row
	for attempt := 1; ; attempt++ {
		holds = holds || len(inserted) > 0
		for _, id := range inserted {
			i := b.at(id)
			if i < 0 {
				return nil, errUnclaimedID(id)
			}
			b.results[i] = dedup.ClaimResult{Outcome: dedup.ClaimNew}
		}
		if len(inserted) == len(pending) {
			return b.results, nil
		}
		claimed := make(map[string]bool, len(inserted))
		for _, id := range inserted {
			claimed[id] = true
		}
		var conflicted []string
		for _, c := range pending {
			if !claimed[c.MessageID] {
				conflicted = append(conflicted, c.MessageID)
			}
		}
		// A new statement, so a new snapshot under READ COMMITTED: it sees
		// the rows of the transactions the insert waited for. The first
		// also makes sure of the synchronous commit and the token, which
		// an INSERT that inserted nothing may not have set.
		missing, err := b.existing(ctx, tx, st, conflicted, attempt == 1)
		if err != nil {
			return nil, s.wrap("claim: select existing", err)
		}
		// Rows purged between the two statements are claimed afresh: in
		// this transaction only while it holds no row of its own, so that
		// its ids are always inserted in the claims' order.
		pending = pending[:0:0]
		for _, id := range missing {
			pending = append(pending, b.claims[b.at(id)])
		}
		if len(pending) == 0 {
			return b.results, nil
		}
		if holds {
			return nil, errClaimRaced
		}
		if attempt >= maxClaimAttempts {
			return nil, fmt.Errorf("processed: claim on %s: %d rows conflicted but vanished %d times", s, len(pending), attempt)
		}
		if inserted, err = b.insert(ctx, tx, st, pending); err != nil {
			return nil, s.wrap("claim: insert", err)
		}
	}
}

// insert claims pending again in tx and returns the ids it inserted.
func (b *batch) insert(ctx context.Context, tx pgx.Tx, st *statements, pending []dedup.Claim) ([]string, error) {
	if len(pending) == 1 {
		tag, err := tx.Exec(ctx, st.insertOne, b.args(pending[0])...)
		if err != nil || tag.RowsAffected() == 0 {
			return nil, err
		}
		return []string{pending[0].MessageID}, nil
	}
	rows, err := tx.Query(ctx, st.insert, b.insertArgs(pending)...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// existing reads the rows of ids, records them as duplicates or
// mismatches, and returns the ids it did not find.
func (b *batch) existing(ctx context.Context, tx pgx.Tx, st *statements, ids []string, setToken bool) ([]string, error) {
	found := make(map[string]bool, len(ids))
	var (
		id string
		fp []byte
		at time.Time
	)
	record := func() error {
		i := b.at(id)
		if i < 0 {
			return errUnclaimedID(id)
		}
		out := dedup.ClaimDuplicate
		if !bytes.Equal(fp, b.claims[i].Fingerprint[:]) {
			out = dedup.ClaimMismatch
		}
		b.results[i] = dedup.ClaimResult{Outcome: out, ProcessedAt: at}
		found[id] = true
		return nil
	}
	bt := &pgx.Batch{}
	if setToken {
		bt.Queue(st.syncCommit, b.token)
	}
	if len(ids) == 1 {
		id = ids[0]
		args := []any{b.name, id}
		if st.keyed {
			args = append(args, b.claims[b.at(id)].Route.Key)
		}
		bt.Queue(st.existingOne, args...).QueryRow(func(row pgx.Row) error {
			err := row.Scan(&fp, &at)
			switch {
			case errors.Is(err, pgx.ErrNoRows):
				return nil
			case err != nil:
				return err
			}
			return record()
		})
	} else {
		args := []any{b.name, ids}
		if st.keyed {
			keys := make([]string, len(ids))
			for i, id := range ids {
				keys[i] = b.claims[b.at(id)].Route.Key
			}
			args = append(args, keys)
		}
		bt.Queue(st.existing, args...).Query(func(rows pgx.Rows) error {
			_, err := pgx.ForEachRow(rows, []any{&id, &fp, &at}, record)
			return err
		})
	}
	if err := tx.SendBatch(ctx, bt).Close(); err != nil {
		return nil, err
	}
	var missing []string
	for _, id := range ids {
		if !found[id] {
			missing = append(missing, id)
		}
	}
	return missing, nil
}

// Purge implements dedup.Store: it purges consumerName's rows processed
// more than olderThan ago (by the database's clock), and never another
// consumer's, and returns how many rows went.
//
// It first records the consumer's purge horizon, now minus olderThan, in
// the table Table+"_horizons". On a plain table it then deletes the
// consumer's older rows in batches of Config.PurgeBatchSize, each its own
// short statement, paced by PurgePause and PurgeDutyCycle; it needs the
// SELECT and DELETE privileges, and SELECT, INSERT and UPDATE on the
// horizons. On the partitioned layout it runs the upkeep (see Maintain),
// which retires the oldest generation once every consumer with rows in it
// has recorded a horizon past its end: a consumer's rows may so live
// longer than its retention, never less. The count is then that of the
// generation retired, every consumer's rows, by the planner's estimate
// when it has one.
func (s *Store) Purge(ctx context.Context, consumerName string, olderThan time.Duration) (int64, error) {
	if consumerName == "" {
		return 0, errors.New("processed: purge: no consumer named (PurgeAll purges every consumer's rows)")
	}
	if olderThan <= 0 {
		return 0, fmt.Errorf("processed: purge: olderThan is %s, must be positive", olderThan)
	}
	st, err := s.statements(ctx)
	if err != nil {
		return 0, err
	}
	var cutoff time.Time
	if err := s.db.QueryRow(ctx, st.recordHorizon, consumerName, olderThan.Microseconds()).Scan(&cutoff); err != nil {
		return 0, s.wrap("purge: record the purge horizon of "+strconv.Quote(consumerName), err)
	}
	return st.layout.purge(ctx, s, st, consumerName, cutoff)
}

// PurgeAll purges the rows of every consumer that has rows, as Purge does
// for each, recording each one's purge horizon: an operator's statement
// that, for every consumer, the rows older than olderThan may go. It
// returns how many rows went.
func (s *Store) PurgeAll(ctx context.Context, olderThan time.Duration) (int64, error) {
	names, err := s.consumers(ctx)
	if err != nil {
		return 0, err
	}
	var total int64
	for _, name := range names {
		n, err := s.Purge(ctx, name, olderThan)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// distinctConsumers is a WITH clause whose c(consumer) has the consumers of
// the rows of from (a relation named t), then a NULL: each found by one
// probe of the primary key (a loose index scan), not a read of every row.
func distinctConsumers(from string) string {
	return `WITH RECURSIVE c(consumer) AS (
	(SELECT t.consumer FROM ` + from + ` ORDER BY t.consumer LIMIT 1)
	UNION ALL
	SELECT (SELECT t.consumer FROM ` + from + ` WHERE t.consumer > c.consumer ORDER BY t.consumer LIMIT 1)
	FROM c WHERE c.consumer IS NOT NULL)`
}

// consumers returns the consumers that have rows, in order.
func (s *Store) consumers(ctx context.Context) ([]string, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := s.db.Query(ctx, distinctConsumers(st.layout.readFrom())+`
SELECT consumer FROM c WHERE consumer IS NOT NULL`)
	if err != nil {
		return nil, s.wrap("list the consumers", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, s.wrap("list the consumers", err)
	}
	return names, nil
}

// Maintain is the optional Store method of that name (see dedup.Store),
// the upkeep the runtime's janitor
// runs every JanitorInterval. On the partitioned layout it rotates the
// generations when the current one is due and every consumer with rows in
// the oldest allows its retirement, then empties the retired one (see
// generations.go); it needs to own the tables. On a plain table it does
// nothing.
func (s *Store) Maintain(ctx context.Context) error {
	st, err := s.statements(ctx)
	if err != nil {
		return err
	}
	_, err = st.layout.maintain(ctx, s, st)
	return err
}

// Row is one row of the dedup table.
type Row struct {
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
func (s *Store) Lookup(ctx context.Context, consumerName, id string) (Row, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return Row{}, err
	}
	return s.lookupWith(ctx, st.lookup, consumerName, id)
}

// lookupWith runs a lookup query of st whose first arguments are the
// consumer and the id.
func (s *Store) lookupWith(ctx context.Context, q, consumerName, id string, more ...any) (Row, error) {
	var r Row
	err := s.db.QueryRow(ctx, q, append([]any{consumerName, id}, more...)...).Scan(
		&r.Consumer, &r.MessageID, &r.Fingerprint, &r.ProcessedAt, &r.Source, &r.Partition, &r.Offset)
	if errors.Is(err, pgx.ErrNoRows) {
		return Row{}, fmt.Errorf("%w: consumer %q, message id %q in %s", ErrNotFound, consumerName, id, s)
	}
	if err != nil {
		return Row{}, s.wrap("lookup", err)
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
		out    Stats
		oldest *time.Time
	)
	st, err := s.statements(ctx)
	if err != nil {
		return Stats{}, err
	}
	if err := s.db.QueryRow(ctx, st.stats, consumerName).Scan(&out.Rows, &oldest); err != nil {
		return Stats{}, s.wrap("stats", err)
	}
	if oldest != nil {
		out.Oldest = *oldest
	}
	return out, nil
}

// wrap adds context to a database error and translates a missing table or
// schema into consumer.ErrNotMigrated, and so a table whose layout changed under
// the store (a claim into what is now the view of the generations), and a
// prepared statement of pgx's cache lost by a pooling proxy into the
// configuration error that names the fix (see the package's doc).
func (s *Store) wrap(op string, err error) error {
	var pgErr *pgconn.PgError
	if cerr := consumer.StatementCacheError(err); cerr != nil {
		return fmt.Errorf("processed: %s on %s: %w", op, s, cerr)
	}
	switch {
	case pgmigrate.IsUndefined(err):
		return fmt.Errorf("processed: %s on %s: %w: %w", op, s, consumer.ErrNotMigrated, err)
	case errors.As(err, &pgErr) && pgErr.Code == "55000" && strings.HasPrefix(op, "claim"): // cannot insert into view
		return fmt.Errorf("processed: %s on %s: the table was converted to the partitioned layout after this store read it (restart with Config.Partitioned): %w: %w", op, s, consumer.ErrNotMigrated, err)
	}
	return fmt.Errorf("processed: %s on %s: %w", op, s, err)
}
