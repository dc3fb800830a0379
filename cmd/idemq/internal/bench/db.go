package bench

import (
	"context"
	"crypto/sha256"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/processed"
)

// prefillConsumer owns the prefilled dedup rows.
const prefillConsumer = "bench-prefill"

// purgeOlderThan is the purge window: prefilled rows are 30 days old, the
// run's own rows are new.
const purgeOlderThan = 24 * time.Hour

func (r *runner) setupDB(ctx context.Context) error {
	dsn := r.cfg.DatabaseURL
	pcfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return redact.Error(fmt.Errorf("invalid database URL %s: %w", redact.DSN(dsn), err), dsn)
	}
	// The consumer's connections, plus the purge loop, the progress and
	// verification queries.
	pcfg.MaxConns = int32(r.cfg.Concurrency + 3)
	if r.cfg.Shards > 0 {
		pcfg.MaxConns = 2 // to create and drop the shards, which have pools of their own
	}
	if pcfg.ConnConfig.ConnectTimeout == 0 {
		pcfg.ConnConfig.ConnectTimeout = 10 * time.Second
	}
	connectErr := func(err error) error {
		return redact.Error(fmt.Errorf("connect to Postgres at %s (set --database-url or DATABASE_URL): %w", redact.DSN(dsn), err), dsn)
	}
	if r.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return connectErr(err)
	}
	if err := r.pool.Ping(ctx); err != nil {
		return connectErr(err)
	}
	if r.cfg.Shards > 0 {
		return r.setupShards(ctx)
	}
	if r.cfg.Schema != "" {
		r.schema, r.tag = r.cfg.Schema, randomHex(4)
		var exists bool
		if err := r.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)`, r.schema).Scan(&exists); err != nil {
			return fmt.Errorf("schema %s: %w", r.schema, err)
		}
		if !exists {
			return fmt.Errorf("schema %q does not exist (--schema runs in an existing one)", r.schema)
		}
		// The table's layout decides: the view of the generations is the
		// partitioned one.
		var kind *string
		if err := r.pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)`, r.dedupTable()).Scan(&kind); err != nil {
			return fmt.Errorf("schema %s: %w", r.schema, err)
		}
		r.partitioned = kind != nil && *kind == "v"
		if r.partitioned && (slices.Contains(r.cfg.Modes, ModeNaive) || slices.Contains(r.cfg.Modes, ModeNaive1)) {
			return fmt.Errorf("schema %s: its dedup table is partitioned, and the naive modes need a plain one", r.schema)
		}
	} else {
		schema := "idemq_bench_" + randomHex(6)
		if _, err := r.pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
			return fmt.Errorf("create schema: %w", err)
		}
		r.schema, r.own, r.partitioned = schema, true, r.cfg.Partitioned
	}
	store, err := r.store()
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return nil
}

// dedupStore is a run's dedup store: a processed.Store on the run's
// schema, or with Config.Shards a processed.Sharded over the shards'.
type dedupStore interface {
	dedup.Store
	Migrate(ctx context.Context) error
}

// store returns a new dedup store for a mode's runtime or purge loop.
func (r *runner) store() (dedupStore, error) {
	cfg := processed.Config{Schema: r.schema, Partitioned: r.partitioned,
		PurgePause: r.cfg.PurgePause, PurgeDutyCycle: r.cfg.PurgeDutyCycle}
	if r.cfg.Shards == 0 {
		st, err := processed.New(r.pool, cfg)
		if err != nil {
			return nil, fmt.Errorf("dedup store: %w", err)
		}
		return st, nil
	}
	stores := make([]*processed.Store, len(r.shards))
	for i, sh := range r.shards {
		st, err := processed.New(sh.pool, cfg)
		if err != nil {
			return nil, fmt.Errorf("dedup store of shard %d (%s): %w", i, sh.name, err)
		}
		stores[i] = st
	}
	s, err := processed.NewSharded(stores, processed.ShardedConfig{Map: processed.ShardMap{Shards: len(stores)}})
	if err != nil {
		return nil, fmt.Errorf("sharded dedup store: %w", err)
	}
	return s, nil
}

// shardDB is one database of a sharded run.
type shardDB struct {
	name string
	pool *pgxpool.Pool // nil until connected
}

// dbs returns the pools of the databases the modes write to: the shards',
// or the run's one.
func (r *runner) dbs() []*pgxpool.Pool {
	if r.cfg.Shards == 0 {
		return []*pgxpool.Pool{r.pool}
	}
	out := make([]*pgxpool.Pool, len(r.shards))
	for i, sh := range r.shards {
		out[i] = sh.pool
	}
	return out
}

// onShard names shard i in err, in a sharded run.
func (r *runner) onShard(i int, err error) error {
	if err == nil || r.cfg.Shards == 0 {
		return err
	}
	return fmt.Errorf("shard %d (%s): %w", i, r.shards[i].name, err)
}

// setupShards creates the shard databases on the server of r.pool, each
// with the run's schema, connects to them, and migrates them through the
// Sharded (which records its map on each). Every database it began to
// create is in r.shards, for close to drop, from before its CREATE.
func (r *runner) setupShards(ctx context.Context) error {
	dsn := r.cfg.DatabaseURL
	if err := r.checkConnections(ctx); err != nil {
		return err
	}
	tag := randomHex(6)
	r.schema, r.own, r.partitioned = "idemq_bench_"+tag, true, r.cfg.Partitioned
	for i := range r.cfg.Shards {
		sh := &shardDB{name: fmt.Sprintf("idemq_bench_%s_%d", tag, i)}
		r.shards = append(r.shards, sh)
		if _, err := r.pool.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{sh.name}.Sanitize()); err != nil {
			return fmt.Errorf("create shard database %s (the role needs CREATEDB): %w", sh.name, err)
		}
		pcfg, err := pgxpool.ParseConfig(dsn)
		if err != nil {
			return redact.Error(fmt.Errorf("invalid database URL %s: %w", redact.DSN(dsn), err), dsn)
		}
		pcfg.ConnConfig.Database = sh.name
		// The consumer's connections on this shard (Concurrency is per
		// shard), plus the purge loop's and the verification's.
		pcfg.MaxConns = int32(r.cfg.Concurrency + 2)
		if pcfg.ConnConfig.ConnectTimeout == 0 {
			pcfg.ConnConfig.ConnectTimeout = 10 * time.Second
		}
		if sh.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err == nil {
			err = sh.pool.Ping(ctx)
		}
		if err != nil {
			return redact.Error(fmt.Errorf("connect to shard database %s on %s: %w", sh.name, redact.DSN(dsn), err), dsn)
		}
		if _, err := sh.pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{r.schema}.Sanitize()); err != nil {
			return fmt.Errorf("create schema in shard database %s: %w", sh.name, err)
		}
	}
	store, err := r.store()
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate the shards: %w", err)
	}
	if r.cfg.shardsReady != nil {
		names := make([]string, len(r.shards))
		for i, sh := range r.shards {
			names[i] = sh.name
		}
		r.cfg.shardsReady(names)
	}
	return nil
}

// checkConnections refuses a sharded run whose runtime would hold more
// connections at once (Concurrency on each shard, and the purge loop's)
// than the server has free: its workers would fail to connect, and the
// modes run into their time limit.
func (r *runner) checkConnections(ctx context.Context) error {
	var maxConns, reserved, inUse int
	err := r.pool.QueryRow(ctx, `SELECT current_setting('max_connections')::int,
	current_setting('superuser_reserved_connections')::int,
	(SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int`).Scan(&maxConns, &reserved, &inUse)
	if err != nil {
		return fmt.Errorf("read the server's connection limit: %w", err)
	}
	per := r.cfg.Concurrency
	if r.cfg.PurgeDuring {
		per++
	}
	need, free := r.cfg.Shards*per, maxConns-reserved-inUse
	if need > free {
		return fmt.Errorf("%d shards at concurrency %d hold up to %d connections at once, and the server has %d free (max_connections %d, %d reserved, %d in use): lower the shards or the concurrency",
			r.cfg.Shards, r.cfg.Concurrency, need, free, maxConns, reserved, inUse)
	}
	return nil
}

// dropShard drops a shard database, ending the sessions still on it.
func (r *runner) dropShard(ctx context.Context, name string) error {
	if _, err := r.pool.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop shard database %s: %w", name, err)
	}
	return nil
}

// runKey is key, made unique to the run in a schema it does not own.
func (r *runner) runKey(key string) string {
	if r.own {
		return key
	}
	return key + "-" + r.tag
}

func (r *runner) dedupTable() string {
	return pgx.Identifier{r.schema, "processed_messages"}.Sanitize()
}

// ledgerTable is the business table of a mode's run, named after key: the
// mode, and the phase for runs after the base phase.
func (r *runner) ledgerTable(key string) string {
	return pgx.Identifier{r.schema, "ledger_" + strings.ReplaceAll(r.runKey(key), "-", "_")}.Sanitize()
}

// createLedger creates a run's business table, on every shard in a
// sharded run. It has no unique key, so that a double effect shows as
// count(*) > count(DISTINCT id).
func (r *runner) createLedger(ctx context.Context, key string) error {
	for i, db := range r.dbs() {
		_, err := db.Exec(ctx, "CREATE TABLE "+r.ledgerTable(key)+` (
	id     text        NOT NULL,
	amount bigint      NOT NULL,
	at     timestamptz NOT NULL DEFAULT now())`)
		if err != nil {
			return r.onShard(i, fmt.Errorf("create ledger: %w", err))
		}
	}
	if !r.own {
		r.ledgers = append(r.ledgers, r.ledgerTable(key))
	}
	return nil
}

// prefillDay is the SQL for the start of the day whose noon the prefilled
// rows were processed at: 30 days ago, older than any retention the bench
// purges with.
const prefillDay = `date_trunc('day', now() - interval '30 days')`

// topUpPrefill makes sure the prefill consumer has at least n rows, processed
// at noon 30 days ago (prefillDay), in the dedup table; in a sharded run,
// n in all, split evenly over the shards.
func (r *runner) topUpPrefill(ctx context.Context, n int) error {
	dbs := r.dbs()
	for i, db := range dbs {
		share := n / len(dbs)
		if i < n%len(dbs) {
			share++
		}
		if err := r.onShard(i, r.topUpPrefillIn(ctx, db, share)); err != nil {
			return err
		}
	}
	return nil
}

// topUpPrefillIn makes sure the prefill consumer has at least n rows in the
// dedup table of db, with one INSERT ... SELECT generate_series.
func (r *runner) topUpPrefillIn(ctx context.Context, db *pgxpool.Pool, n int) error {
	if n == 0 {
		return nil
	}
	var have int64
	if err := db.QueryRow(ctx, "SELECT count(*) FROM "+r.dedupTable()+" WHERE consumer = $1", prefillConsumer).Scan(&have); err != nil {
		return fmt.Errorf("count prefill: %w", err)
	}
	if have >= int64(n) {
		return nil
	}
	start := time.Now()
	conflict := ""
	if have > 0 {
		conflict = " ON CONFLICT DO NOTHING"
	}
	// On the partitioned layout the prefill is the oldest generation,
	// which ended the day after the prefill's (so that a purge may retire
	// it), as a month-old consumer's table has its old rows.
	into := r.dedupTable()
	if r.partitioned {
		into = pgx.Identifier{r.schema, "processed_messages" + "_g2"}.Sanitize()
		gens := pgx.Identifier{r.schema, "processed_messages" + "_generations"}.Sanitize()
		if _, err := db.Exec(ctx, `UPDATE `+gens+` SET began_at = `+prefillDay+` + interval '1 day'
WHERE generation = (SELECT max(generation) - 1 FROM `+gens+`) AND began_at > `+prefillDay+` + interval '1 day'`); err != nil {
			return fmt.Errorf("prefill: date the oldest generation: %w", err)
		}
	}
	_, err := db.Exec(ctx, "INSERT INTO "+into+` (consumer, message_id, fingerprint, processed_at, source)
SELECT $1, 'p-' || g, sha256(int8send(g)), `+prefillDay+` + interval '12 hours', 'prefill'
FROM generate_series(1, $2::bigint) AS g`+conflict, prefillConsumer, n)
	if err != nil {
		return fmt.Errorf("prefill: %w", err)
	}
	// Measure the table in its steady state, not the database digesting a
	// bulk load: without this, autovacuum's pass over the new rows and
	// the checkpoint flushing them overlap the next mode (on two cores
	// that cut batch-mode throughput by two thirds).
	if _, err := db.Exec(ctx, "VACUUM (ANALYZE) "+into); err != nil {
		return fmt.Errorf("vacuum: %w", err)
	}
	if _, err := db.Exec(ctx, "CHECKPOINT"); err != nil {
		// CHECKPOINT needs superuser or pg_checkpoint: go on without.
		r.log.Warn("bench: checkpoint after the prefill failed; the next mode may overlap it", "error", err)
	}
	r.log.Info("bench: prefilled the dedup table", "rows", n-int(have), "took", time.Since(start))
	return nil
}

// purgeLoop runs Purge until stop is closed (a pass in progress then
// finishes, so that its rows count) or ctx is done, pausing briefly when
// there was nothing to delete. It counts the errors in errs, and keeps the
// first.
func (r *runner) purgeLoop(ctx context.Context, stop <-chan struct{}, rows, errs *atomic.Int64, first *atomic.Pointer[error]) {
	store, err := r.store()
	if err != nil {
		errs.Add(1)
		first.CompareAndSwap(nil, &err)
		return
	}
	for ctx.Err() == nil {
		select {
		case <-stop:
			return
		default:
		}
		n, err := store.Purge(ctx, prefillConsumer, purgeOlderThan)
		rows.Add(n)
		if err != nil && ctx.Err() == nil {
			errs.Add(1)
			first.CompareAndSwap(nil, &err)
			r.log.Warn("bench: purge", "error", err)
		}
		if n == 0 {
			select {
			case <-stop:
			case <-ctx.Done():
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
}

// ledgerInsert is the per-message effect.
func (r *runner) ledgerInsert(ctx context.Context, tx pgx.Tx, ledger, id string, amount int64) error {
	if r.cfg.effect != nil {
		return r.cfg.effect(ctx, tx, ledger, id, amount)
	}
	_, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (id, amount) VALUES ($1, $2)", id, amount)
	return err
}

// handler is the per-message Handler of the idemq modes.
func (r *runner) handler(ledger string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		id, amount, err := parseBody(msg.Body)
		if err != nil {
			return consumer.Permanent(err)
		}
		return r.ledgerInsert(ctx, tx, ledger, id, amount)
	}
}

// laterHandler is handler with the ledger row written by
// consumer.ExecLater.
func (r *runner) laterHandler(ledger string) consumer.Handler {
	if r.cfg.effect != nil {
		return r.handler(ledger)
	}
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		id, amount, err := parseBody(msg.Body)
		if err != nil {
			return consumer.Permanent(err)
		}
		return consumer.ExecLater(ctx, tx, "INSERT INTO "+ledger+" (id, amount) VALUES ($1, $2)", id, amount)
	}
}

// batchHandler is the set-based BatchHandler: one INSERT for the batch.
func (r *runner) batchHandler(ledger string) consumer.BatchHandler {
	return func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		if r.cfg.effect != nil {
			for _, m := range msgs {
				id, amount, err := parseBody(m.Body)
				if err != nil {
					return consumer.Permanent(err)
				}
				if err := r.cfg.effect(ctx, tx, ledger, id, amount); err != nil {
					return err
				}
			}
			return nil
		}
		ids := make([]string, len(msgs))
		amounts := make([]int64, len(msgs))
		for i, m := range msgs {
			var err error
			if ids[i], amounts[i], err = parseBody(m.Body); err != nil {
				return consumer.Permanent(err)
			}
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (id, amount) SELECT * FROM unnest($1::text[], $2::bigint[])", ids, amounts)
		return err
	}
}

// naiveApply is the plain recipe for one message: BEGIN; claim; effect if
// new; COMMIT. It reports whether the message was new.
func (r *runner) naiveApply(ctx context.Context, name, ledger string, id string, b []byte) (bool, error) {
	fp := sha256.Sum256(b)
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	tag, err := tx.Exec(ctx, "INSERT INTO "+r.dedupTable()+" (consumer, message_id, fingerprint) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING", name, id, fp[:])
	if err != nil {
		return false, err
	}
	inserted := tag.RowsAffected() == 1
	if inserted {
		bid, amount, err := parseBody(b)
		if err != nil {
			return false, err
		}
		if err := r.ledgerInsert(ctx, tx, ledger, bid, amount); err != nil {
			return false, err
		}
	}
	return inserted, tx.Commit(ctx)
}

// verify compares the ledger and the dedup rows of consumer name with the
// workload's unique ids.
func (r *runner) verify(ctx context.Context, key, name string, res *Result) error {
	if r.cfg.Shards > 0 {
		return r.verifyShards(ctx, key, name, res)
	}
	if err := r.pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT id) FROM "+r.ledgerTable(key)).
		Scan(&res.Effects, &res.DistinctEffects); err != nil {
		return fmt.Errorf("count effects: %w", err)
	}
	var claims int64
	if err := r.pool.QueryRow(ctx, "SELECT count(*) FROM "+r.dedupTable()+" WHERE consumer = $1", name).Scan(&claims); err != nil {
		return fmt.Errorf("count dedup rows: %w", err)
	}
	u := int64(r.work.unique)
	if res.Effects != u || res.DistinctEffects != u || claims != u {
		return fmt.Errorf("%w: %d effects, %d distinct, %d dedup rows; want %d each", ErrVerify, res.Effects, res.DistinctEffects, claims, u)
	}
	return nil
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// verifyShards is verify over the shards: the ledgers of all of them
// together must hold every unique id once, the dedup rows of consumer name
// on all of them one per unique id. An id is counted once however many
// shards hold it, so that one applied on two shards while another is
// missing fails the checks, as it does in one database.
func (r *runner) verifyShards(ctx context.Context, key, name string, res *Result) error {
	u := r.work.unique
	// on[j] counts the shards whose ledger holds the workload's unique id
	// j (up to 255); others holds the ids that are not the workload's.
	on := make([]uint8, u)
	others := map[string]bool{}
	var claims, twice int64
	res.ShardEffects = make([]int64, len(r.shards))
	for i, sh := range r.shards {
		rows, err := sh.pool.Query(ctx, "SELECT id, count(*) FROM "+r.ledgerTable(key)+" GROUP BY id")
		if err != nil {
			return r.onShard(i, fmt.Errorf("count effects: %w", err))
		}
		var (
			id string
			n  int64
		)
		_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error {
			res.Effects += n
			res.ShardEffects[i] += n
			j, ok := workloadIndex(id, u)
			switch {
			case !ok:
				if !others[id] {
					others[id] = true
					res.DistinctEffects++
				}
			case on[j] == 0:
				res.DistinctEffects++
			case on[j] == 1:
				twice++ // on a second shard
			}
			if ok && on[j] < 255 {
				on[j]++
			}
			return nil
		})
		if err != nil {
			return r.onShard(i, fmt.Errorf("count effects: %w", err))
		}
		var c int64
		if err := sh.pool.QueryRow(ctx, "SELECT count(*) FROM "+r.dedupTable()+" WHERE consumer = $1", name).Scan(&c); err != nil {
			return r.onShard(i, fmt.Errorf("count dedup rows: %w", err))
		}
		claims += c
	}
	want := int64(u)
	if res.Effects != want || res.DistinctEffects != want || claims != want || twice > 0 || len(others) > 0 {
		return fmt.Errorf("%w: %d effects, %d distinct, %d dedup rows over %d shards (ledger rows by shard %v; %d ids on two shards or more, %d ids not published); want %d each",
			ErrVerify, res.Effects, res.DistinctEffects, claims, len(r.shards), res.ShardEffects, twice, len(others), want)
	}
	return nil
}

// workloadIndex returns j if id is msgID(j) of a unique id j below unique.
func workloadIndex(id string, unique int) (int, bool) {
	s, ok := strings.CutPrefix(id, "m-")
	if !ok {
		return 0, false
	}
	j, err := strconv.Atoi(s)
	if err != nil || j < 0 || j >= unique || msgID(int32(j)) != id {
		return 0, false
	}
	return j, true
}
