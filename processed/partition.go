package processed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"sort"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgpurge"
)

// The partitioned dedup table.
//
// The parent is range-partitioned on processed_at, the claim's transaction
// time. Each range partition covers one PartitionInterval, aligned on the
// Unix epoch, and is named Table+"_p"+<Unix seconds of its lower bound>;
// Table+"_default" is the DEFAULT partition, which takes the claims no
// range partition covers; Table+"_legacy" is the plain table a conversion
// attached, from MINVALUE to the end of the interval it was converted in.
// Every partition has its own primary key on (consumer, message_id); the
// parent has none, since Postgres cannot enforce one without the partition
// key. Uniqueness across partitions is the claim's: see claimLockKey.
//
// The DEFAULT partition has a floor: the constraint Table+"_floor", CHECK
// (processed_at >= F) NOT VALID, F being the end of the run of range
// partitions that holds the present (see setFloor). A claim goes to the
// DEFAULT partition only when no range partition covers its transaction's
// start, so all the floor refuses is a claim from a transaction that began
// in a gap of the past (before a partition a purge dropped, or in a lapse
// of the janitor): it fails with a check violation, and the runtime retries
// it in a new transaction, which a range partition takes. So while the
// DEFAULT partition is empty and its floor is at or past the end of the
// partition that holds the present, no claim can add a row to it before
// that end, and the fast claims do not look in it (see fast).

const (
	defaultSuffix = "_default"
	legacySuffix  = "_legacy"
	// floorSuffix names the DEFAULT partition's floor constraint.
	floorSuffix = "_floor"
	// retentionSuffix names the janitor's table (migration 0002).
	retentionSuffix = "_retention"
	// partitionLockTimeout bounds the wait of partition DDL for the
	// table's lock: DDL waiting on a long claim transaction would queue
	// every claim behind it.
	partitionLockTimeout = "2s"
)

// claimLockKey is the pg_advisory_xact_lock key of a claim of id by name on
// a partitioned table: every claim of one id takes it before it looks for
// the id and inserts it, so two claims of one id serialise, and the second,
// whose statements start after the first committed, sees its row, in
// whatever partition it is. Unrelated ids that collide only wait for each
// other.
func claimLockKey(name, id string) int64 {
	h := fnv.New64a()
	h.Write([]byte("idemq.processed.claim\x00"))
	h.Write([]byte(name))
	h.Write([]byte{0})
	h.Write([]byte(id))
	return int64(h.Sum64())
}

// claimLockKeys returns the lock keys of claims, sorted, so that concurrent
// batches take their locks in one order and cannot deadlock.
func claimLockKeys(claims []consumer.Claim) []int64 {
	keys := make([]int64, len(claims))
	for i, c := range claims {
		keys[i] = claimLockKey(c.Consumer, c.MessageID)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i] < keys[j] })
	return keys
}

// partitionedSQL sets the claim statements of st for a partitioned table.
func partitionedSQL(st *statements) {
	t := st.qTable
	st.partitioned = true
	// The lock statements also make the commit synchronous, as claimOne
	// does.
	st.lock = `SELECT set_config('synchronous_commit', 'on', true), set_config('idemq.tx', $2, true), pg_advisory_xact_lock($1::bigint)`
	// unnest scans the array in order: the locks are taken in the order
	// of the sorted keys.
	st.batchLock = `SELECT set_config('synchronous_commit', 'on', true), set_config('idemq.tx', $2, true), (SELECT count(pg_advisory_xact_lock(k)) FROM unnest($1::bigint[]) AS u(k))`
	// The full lookup (insert, existing, batchInsert, batchExisting)
	// probes every partition's primary key through the parent. It runs
	// between noScans and restoreScans, with sequential scans off, since
	// a partition's statistics are those of when it was last analyzed:
	// the current partition, new and empty or nearly so when a plan is
	// made, would be planned as a sequential scan, and that plan stays
	// cached in the connection's prepared statement while the partition
	// grows to millions of rows (until autovacuum analyzes it again,
	// which may take long when it is busy with the older partitions):
	// claims then slowed down tenfold in the benchmark. Plans are made
	// when a prepared statement is first run or replanned, both between
	// the two, so they always use the indexes; restoreScans puts the
	// session's setting back before the handler runs. The fast claims
	// (seal.go) need neither: see buildFast.
	st.restoreScans = `SELECT set_config('enable_seqscan', current_setting('idemq.enable_seqscan'), true)`
	st.insert = `INSERT INTO ` + t + ` (consumer, message_id, fingerprint, source, partition, "offset")
SELECT $1::text, $2::text, $3::bytea, $4::text, $5::integer, $6::bigint
WHERE NOT EXISTS (SELECT 1 FROM ` + t + ` WHERE consumer = $1::text AND message_id = $2::text)`
	st.batchInsert = `INSERT INTO ` + t + ` (consumer, message_id, fingerprint, source, partition, "offset")
SELECT $1::text, u.id, u.fp, u.src, NULLIF(u.part, -1), NULLIF(u.off, -1)
FROM unnest($2::text[], $3::bytea[], $4::text[], $5::int[], $6::bigint[]) AS u(id, fp, src, part, off)
WHERE NOT EXISTS (SELECT 1 FROM ` + t + ` p WHERE p.consumer = $1::text AND p.message_id = u.id)
RETURNING message_id`
}

// noScans turns sequential scans off for the full lookup's statements,
// saving the session's setting for restoreScans (see partitionedSQL).
const noScans = `SELECT set_config('idemq.enable_seqscan', current_setting('enable_seqscan'), true),
	set_config('enable_seqscan', 'off', true)`

// withoutScans runs f, the full lookup's statements of op in tx, between
// noScans and restoreScans (see partitionedSQL).
func (s *Store) withoutScans(ctx context.Context, tx pgx.Tx, st *statements, op string, f func() error) error {
	if _, err := tx.Exec(ctx, noScans); err != nil {
		return s.wrap(op+": turn sequential scans off", err)
	}
	if err := f(); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, st.restoreScans); err != nil {
		return s.wrap(op+": restore enable_seqscan", err)
	}
	return nil
}

// existingNoScans is existing, between noScans and restoreScans, in one
// round trip, with sql: st.existing, or a fast insert's existing, which
// looks only where that insert did; wrap wraps its errors.
func (s *Store) existingNoScans(ctx context.Context, st *statements, tx pgx.Tx, sql string, wrap func(op string, err error) error, c consumer.Claim) (res consumer.ClaimResult, found bool, err error) {
	var (
		fp []byte
		at time.Time
	)
	b := &pgx.Batch{}
	b.Queue(noScans)
	b.Queue(sql, c.Consumer, c.MessageID).QueryRow(func(row pgx.Row) error {
		err := row.Scan(&fp, &at)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		found = err == nil
		return err
	})
	b.Queue(st.restoreScans)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return consumer.ClaimResult{}, false, wrap("claim: select existing", err)
	}
	if !found {
		return consumer.ClaimResult{}, false, nil
	}
	out := consumer.ClaimDuplicate
	if !bytes.Equal(fp, c.Fingerprint[:]) {
		out = consumer.ClaimMismatch
	}
	return consumer.ClaimResult{Outcome: out, ProcessedAt: at}, true, nil
}

// relkind returns the table's pg_class.relkind: 'r' for a plain table, 'p'
// for a partitioned one, 0 if it does not exist.
func (s *Store) relkind(ctx context.Context, db DB, st *statements) (byte, error) {
	var kind *string
	if err := db.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)`, st.qTable).Scan(&kind); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, nil
		}
		return 0, err
	}
	if kind == nil || *kind == "" {
		return 0, nil
	}
	return (*kind)[0], nil
}

// partitionedStatements returns the statements, and whether the table is
// a partitioned one (also when Config.Partitioned is not set).
func (s *Store) partitionedStatements(ctx context.Context) (*statements, bool, error) {
	st, err := s.statements(ctx)
	if err != nil || st.partitioned {
		return st, err == nil, err
	}
	kind, err := s.relkind(ctx, s.db, st)
	return st, kind == 'p', err
}

// Partitioned reports whether the table is a partitioned one.
func (s *Store) Partitioned(ctx context.Context) (bool, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return false, err
	}
	k, err := s.relkind(ctx, s.db, st)
	if err != nil {
		return false, s.wrap("read the table's kind", err)
	}
	return k == 'p', nil
}

// interval is the partition interval; DefaultPartitionInterval for a
// store configured without Partitioned that found a partitioned table.
func (s *Store) interval() time.Duration {
	if s.cfg.PartitionInterval > 0 {
		return s.cfg.PartitionInterval
	}
	return DefaultPartitionInterval
}

// bucket returns the lower bound of the interval holding t.
func bucket(t time.Time, every time.Duration) time.Time {
	secs := int64(every / time.Second)
	u := t.Unix()
	u -= ((u % secs) + secs) % secs
	return time.Unix(u, 0).UTC()
}

// pgTime is t as a timestamptz literal.
func pgTime(t time.Time) string {
	return "'" + t.UTC().Format("2006-01-02 15:04:05.999999") + "+00'"
}

func (s *Store) partitionIdent(st *statements, suffix string) string {
	return pgx.Identifier{st.schema, s.cfg.Table + suffix}.Sanitize()
}

// ddlLockKey serialises the partition DDL of one table across processes.
func ddlLockKey(st *statements) int64 {
	h := fnv.New64a()
	h.Write([]byte("idemq.processed.partitions:" + st.qTable))
	return int64(h.Sum64())
}

// ddlTx runs f in a transaction holding the table's DDL lock, with a lock
// timeout.
func (s *Store) ddlTx(ctx context.Context, st *statements, f func(pgx.Tx) error) error {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '`+partitionLockTimeout+`'`); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, ddlLockKey(st)); err != nil {
		return err
	}
	if err := f(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// createParent creates the partitioned parent and its DEFAULT partition.
func (s *Store) createParent(ctx context.Context, tx pgx.Tx, st *statements) error {
	_, err := tx.Exec(ctx, `CREATE TABLE `+st.qTable+` (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     bigint,
    -- Named as migration 0001 names it, so a converted table attaches.
    CONSTRAINT `+pgx.Identifier{s.cfg.Table + "_fingerprint_check"}.Sanitize()+` CHECK (octet_length(fingerprint) = 32)
) PARTITION BY RANGE (processed_at);
CREATE TABLE `+s.partitionIdent(st, defaultSuffix)+` PARTITION OF `+st.qTable+`
    (PRIMARY KEY (consumer, message_id)) DEFAULT;
CREATE INDEX ON `+s.partitionIdent(st, defaultSuffix)+` (processed_at)`)
	return err
}

// convert makes the plain table a partitioned one, under an exclusive lock:
// an empty table is replaced; a table with rows becomes the partition
// Table+"_legacy" of the new parent, covering everything up to the end of
// the current interval (attaching it scans it once), and its grants are
// copied to the parent.
func (s *Store) convert(ctx context.Context, tx pgx.Tx, st *statements) error {
	if _, err := tx.Exec(ctx, `LOCK TABLE `+st.qTable+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		return err
	}
	var (
		empty  bool
		now    time.Time
		newest *time.Time
	)
	if err := tx.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM `+st.qTable+`), now(), (SELECT max(processed_at) FROM `+st.qTable+`)`).Scan(&empty, &now, &newest); err != nil {
		return err
	}
	if empty {
		if _, err := tx.Exec(ctx, `DROP TABLE `+st.qTable); err != nil {
			return err
		}
		return s.createParent(ctx, tx, st)
	}
	grants, err := tableGrants(ctx, tx, st.schema, s.cfg.Table)
	if err != nil {
		return err
	}
	upTo := now
	if newest != nil && newest.After(upTo) {
		upTo = *newest
	}
	boundary := bucket(upTo, s.interval()).Add(s.interval())
	legacy := s.partitionIdent(st, legacySuffix)
	if _, err := tx.Exec(ctx, `ALTER TABLE `+st.qTable+` RENAME TO `+pgx.Identifier{s.cfg.Table + legacySuffix}.Sanitize()); err != nil {
		return err
	}
	if err := s.createParent(ctx, tx, st); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `ALTER TABLE `+st.qTable+` ATTACH PARTITION `+legacy+` FOR VALUES FROM (MINVALUE) TO (`+pgTime(boundary)+`)`); err != nil {
		return err
	}
	for _, g := range grants {
		if _, err := tx.Exec(ctx, `GRANT `+g[1]+` ON `+st.qTable+`, `+s.partitionIdent(st, defaultSuffix)+` TO `+g[0]); err != nil {
			return fmt.Errorf("copy the grant of %s to %s: %w", g[1], g[0], err)
		}
	}
	return nil
}

// tableGrants returns (grantee, privilege) pairs on schema.table, the
// grantee quoted (or PUBLIC), excluding the owner's own.
func tableGrants(ctx context.Context, tx pgx.Tx, schema, table string) ([][2]string, error) {
	var out [][2]string
	rows, err := tx.Query(ctx, `SELECT g.grantee, g.privilege_type FROM information_schema.role_table_grants g
JOIN pg_class c ON c.relname = g.table_name JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = g.table_schema
WHERE g.table_schema = $1 AND g.table_name = $2 AND g.grantee <> pg_get_userbyid(c.relowner)`, schema, table)
	if err != nil {
		return nil, err
	}
	var grantee, priv string
	_, err = pgx.ForEachRow(rows, []any{&grantee, &priv}, func() error {
		who := pgx.Identifier{grantee}.Sanitize()
		if grantee == "PUBLIC" {
			who = "PUBLIC"
		}
		out = append(out, [2]string{who, priv})
		return nil
	})
	return out, err
}

// migratePartitioned converts the table to a partitioned one if it is
// plain, and creates the partitions of the current interval and the next.
func (s *Store) migratePartitioned(ctx context.Context) error {
	st, err := s.statements(ctx)
	if err != nil {
		return err
	}
	err = s.ddlTx(ctx, st, func(tx pgx.Tx) error {
		var kind *string
		if err := tx.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)`, st.qTable).Scan(&kind); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		switch {
		case kind == nil:
			if err := s.createParent(ctx, tx, st); err != nil {
				return err
			}
		case *kind == "r":
			if err := s.convert(ctx, tx, st); err != nil {
				return err
			}
		}
		return s.createSealTables(ctx, tx, st)
	})
	if err != nil {
		return s.wrap("migrate: partition", err)
	}
	_, err = s.EnsurePartitions(ctx)
	return err
}

// partitionInfo is one partition of the table.
type partitionInfo struct {
	name string
	// lower is the inclusive lower bound; nil for MINVALUE (the legacy
	// partition) and the DEFAULT partition.
	lower *time.Time
	// upper is the exclusive upper bound; nil for the DEFAULT partition.
	upper *time.Time
}

// querier is what partitionState reads through: the store's DB, or a
// transaction the caller holds (so that a claim in it never waits for a
// second connection).
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// partitionState reads the database's clock (the statement's time, also
// inside a transaction), the table's partitions and, withSealed, the sealed
// ones, by name, through q; op names the caller in errors.
func (s *Store) partitionState(ctx context.Context, q querier, st *statements, op string, withSealed bool) (now time.Time, parts []partitionInfo, sealed map[string]sealInfo, err error) {
	if err = q.QueryRow(ctx, `SELECT statement_timestamp()`).Scan(&now); err != nil {
		return now, nil, nil, s.wrap(op+": clock", err)
	}
	if parts, err = s.partitions(ctx, q, st); err != nil {
		return now, nil, nil, s.wrap(op+": list partitions", err)
	}
	if !withSealed {
		return now, parts, nil, nil
	}
	sealed = map[string]sealInfo{}
	rows, err := q.Query(ctx, `SELECT partition, sealed_at, ids FROM `+st.qSealed)
	if err != nil {
		return now, nil, nil, s.wrap(op+": read sealed partitions", err)
	}
	var (
		name string
		si   sealInfo
	)
	if _, err := pgx.ForEachRow(rows, []any{&name, &si.at, &si.ids}, func() error { sealed[name] = si; return nil }); err != nil {
		return now, nil, nil, s.wrap(op+": read sealed partitions", err)
	}
	return now, parts, sealed, nil
}

// partitions lists the table's partitions with their bounds.
func (s *Store) partitions(ctx context.Context, q querier, st *statements) ([]partitionInfo, error) {
	rows, err := q.Query(ctx, `SELECT c.relname::text,
	(regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\)'))[1]::timestamptz,
	(regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1)
ORDER BY 3 NULLS LAST`, st.qTable)
	if err != nil {
		return nil, err
	}
	var (
		out          []partitionInfo
		name         string
		lower, upper *time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&name, &lower, &upper}, func() error {
		out = append(out, partitionInfo{name: name, lower: lower, upper: upper})
		return nil
	})
	return out, err
}

// EnsurePartitions creates the missing partitions of a partitioned table
// from the current interval (by the database's clock) to
// DefaultPartitionsAhead intervals ahead, and returns how many it created.
// A range whose rows already went to the DEFAULT partition is skipped: they
// stay there, and Purge deletes them from it row by row. Migrate and Purge
// call it; the janitor's Purge so keeps partitions ahead of the claims.
func (s *Store) EnsurePartitions(ctx context.Context) (int, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return 0, err
	}
	now, existing, _, err := s.partitionState(ctx, s.db, st, "partitions", false)
	if err != nil {
		return 0, err
	}
	have := map[string]bool{}
	var covered time.Time // the legacy partition's upper bound
	for _, p := range existing {
		have[p.name] = true
		if p.name == s.cfg.Table+legacySuffix && p.upper != nil {
			covered = *p.upper
		}
	}
	every := s.interval()
	created := 0
	for i := 0; i <= DefaultPartitionsAhead; i++ {
		lo := bucket(now, every).Add(time.Duration(i) * every)
		hi := lo.Add(every)
		if !hi.After(covered) {
			continue
		}
		if lo.Before(covered) {
			lo = covered
		}
		suffix := "_p" + strconv.FormatInt(lo.Unix(), 10)
		if have[s.cfg.Table+suffix] {
			continue
		}
		name := s.partitionIdent(st, suffix)
		err := s.ddlTx(ctx, st, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+name+` PARTITION OF `+st.qTable+`
    (PRIMARY KEY (consumer, message_id)) FOR VALUES FROM (`+pgTime(lo)+`) TO (`+pgTime(hi)+`)`)
			return err
		})
		if err != nil {
			// An overlapping range (a changed interval) or rows of the
			// range in the DEFAULT partition: leave it to the default.
			if ctx.Err() != nil {
				return created, ctx.Err()
			}
			continue
		}
		created++
		s.forgetFast()
	}
	if created == 0 {
		// Most rounds: nothing new. The floor is then moved, under the
		// DDL lock, only if it looks due, which saves the janitor a
		// locked transaction per round.
		old, err := readFloor(ctx, s.db, st, s.cfg.Table+floorSuffix)
		if err != nil {
			return 0, s.wrap("partitions: read the DEFAULT partition's floor", err)
		}
		if !floorDue(old, now, existing) {
			return 0, nil
		}
	}
	if err := s.setFloor(ctx, st); err != nil {
		return created, s.wrap("partitions: the DEFAULT partition's floor", err)
	}
	return created, nil
}

// setFloor sets the DEFAULT partition's floor (see the top of this file) to
// the end of the run of contiguous range partitions that holds the present,
// by the database's clock read under the table's DDL lock, so that each
// floor is set at a later present than the one before it. A floor is raised
// whenever the run grows, and lowered only when no range partition holds
// the present: to the upper bound of the last one before it (or dropped if
// there is none), so that the claims of the present, which then go to the
// DEFAULT partition, are let in. A floor past a present that a range
// partition holds is never lowered: only dropping partitions ahead by hand
// could call for it, and EnsurePartitions creates them again.
//
// Lowering a floor is safe for the fast claims because they skip the DEFAULT
// partition only while the present is in the partition they insert into
// and the floor they read is past that partition's end: a floor lowered
// later, when no range partition holds the present, is lowered after that
// end, when they have stopped inserting.
func (s *Store) setFloor(ctx context.Context, st *statements) error {
	name := s.cfg.Table + floorSuffix
	return s.ddlTx(ctx, st, func(tx pgx.Tx) error {
		now, parts, _, err := s.partitionState(ctx, tx, st, "floor", false)
		if err != nil {
			return err
		}
		old, err := readFloor(ctx, tx, st, name)
		if err != nil {
			return err
		}
		if !floorDue(old, now, parts) {
			return nil
		}
		floor, _ := floorFor(now, parts)
		q := `ALTER TABLE ` + st.qDefault + ` DROP CONSTRAINT IF EXISTS ` + pgx.Identifier{name}.Sanitize()
		if floor != nil {
			q += `, ADD CONSTRAINT ` + pgx.Identifier{name}.Sanitize() + ` CHECK (processed_at >= ` + pgTime(*floor) + `) NOT VALID`
		}
		if _, err := tx.Exec(ctx, q); err != nil {
			return err
		}
		s.forgetFast()
		return nil
	})
}

// floorDue reports whether the DEFAULT partition's floor, old (nil for
// none), is to be moved for the partitions parts at now (see setFloor).
func floorDue(old *time.Time, now time.Time, parts []partitionInfo) bool {
	floor, present := floorFor(now, parts)
	switch {
	case old == nil && floor == nil, old != nil && floor != nil && floor.Equal(*old):
		return false
	case present && old != nil && floor.Before(*old):
		return false // never lowered while a range partition holds the present
	}
	return true
}

// floorFor returns the DEFAULT partition's floor for the partitions parts
// at now, and whether a range partition holds now: the end of the run of
// contiguous range partitions that holds now, or, if none does, the upper
// bound of the last one before now (nil if there is none).
func floorFor(now time.Time, parts []partitionInfo) (floor *time.Time, present bool) {
	var ranges []partitionInfo
	for _, p := range parts {
		if p.upper != nil { // not the DEFAULT partition
			ranges = append(ranges, p)
		}
	}
	sort.Slice(ranges, func(i, j int) bool { return ranges[i].upper.Before(*ranges[j].upper) })
	for i, p := range ranges {
		if (p.lower != nil && p.lower.After(now)) || !now.Before(*p.upper) {
			continue
		}
		end := *p.upper
		for _, q := range ranges[i+1:] {
			if q.lower == nil || !q.lower.Equal(end) {
				break
			}
			end = *q.upper
		}
		return &end, true
	}
	for _, p := range ranges {
		if !p.upper.After(now) {
			floor = p.upper
		}
	}
	return floor, false
}

// readFloor returns the floor of the DEFAULT partition's constraint name,
// nil if there is no such constraint.
func readFloor(ctx context.Context, q querier, st *statements, name string) (*time.Time, error) {
	var floor *time.Time
	err := q.QueryRow(ctx, `SELECT (regexp_match(pg_get_constraintdef(oid), '''([^'']+)'''))[1]::timestamptz
FROM pg_constraint WHERE conrelid = to_regclass($1) AND conname = $2`, st.qDefault, name).Scan(&floor)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	return floor, err
}

// purgePartitioned drops the partitions wholly older than now - olderThan
// and deletes the expired rows of the DEFAULT partition. The count of a
// dropped partition's rows is the planner's estimate (pg_class.reltuples)
// when it has one, else a count.
func (s *Store) purgePartitioned(ctx context.Context, st *statements, olderThan time.Duration) (int64, error) {
	if olderThan <= 0 {
		return 0, fmt.Errorf("processed: purge: olderThan is %s, must be positive", olderThan)
	}
	if _, err := s.EnsurePartitions(ctx); err != nil {
		return 0, err
	}
	var cutoff time.Time
	if err := s.db.QueryRow(ctx, `SELECT now() - $1::bigint * interval '1 microsecond'`, olderThan.Microseconds()).Scan(&cutoff); err != nil {
		return 0, s.wrap("purge: cutoff", err)
	}
	parts, err := s.partitions(ctx, s.db, st)
	if err != nil {
		return 0, s.wrap("purge: list partitions", err)
	}
	var total int64
	for _, p := range parts {
		if p.upper == nil || p.upper.After(cutoff) {
			continue
		}
		ident := pgx.Identifier{st.schema, p.name}.Sanitize()
		var n int64
		err := s.ddlTx(ctx, st, func(tx pgx.Tx) error {
			var est float64
			if err := tx.QueryRow(ctx, `SELECT reltuples FROM pg_class WHERE oid = to_regclass($1)`, ident).Scan(&est); err != nil {
				return err
			}
			if est >= 0 {
				n = int64(est)
			} else if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+ident).Scan(&n); err != nil {
				return err
			}
			for _, q := range unsealStatements(st) {
				if _, err := tx.Exec(ctx, q, p.name); err != nil {
					return err
				}
			}
			if _, err := tx.Exec(ctx, `ALTER TABLE `+st.qTable+` DETACH PARTITION `+ident); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `DROP TABLE `+ident)
			return err
		})
		if err != nil {
			return total, s.wrap("purge: drop partition "+p.name, err)
		}
		s.forgetFast()
		total += n
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
	def := s.partitionIdent(st, defaultSuffix)
	del := `DELETE FROM ` + def + ` WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM ` + def + `
	WHERE processed_at < $1
	LIMIT $2))`
	n, step, err := pgpurge.Run(ctx, s.db, del, olderThan, s.cfg.PurgeBatchSize, s.cfg.pace())
	total += n
	if err != nil {
		return total, s.wrap(string(step)+" (default partition)", err)
	}
	return total, nil
}

// existingAfter reads, after the first insert fi of c inserted nothing, the
// row it conflicted with: first where a fast insert looked, then, if not
// there (a filter's false positive, or a guard that stopped the insert),
// everywhere. found is false if the row is in no partition.
func (s *Store) existingAfter(ctx context.Context, st *statements, tx pgx.Tx, fi firstInsert, c consumer.Claim) (res consumer.ClaimResult, found bool, err error) {
	if fi.existing != "" {
		if res, found, err = s.existingNoScans(ctx, st, tx, fi.existing, fi.wrap, c); err != nil || found {
			return res, found, err
		}
	}
	return s.existingNoScans(ctx, st, tx, st.existing, s.wrap, c)
}
