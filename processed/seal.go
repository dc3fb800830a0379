package processed

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/consumer"
)

// Sealed partitions and their membership filters.
//
// Without them a claim of a new id on a partitioned table must look the id
// up in every partition, so its cost grows with the number of partitions
// and with the rows in them. Past partitions never take another claim: a
// claim's processed_at is its transaction's start, and the clock has moved
// on. The janitor seals each one, oldest first, once the clock is past its
// upper bound (SealPartitions):
//
//  1. It adds the constraint CHECK (false) NOT VALID to the partition, which
//     refuses every new row (existing rows are not checked). Adding it takes
//     the partition's ACCESS EXCLUSIVE lock, so it waits for every
//     transaction that could still insert into it; a claim whose
//     transaction started before the boundary and that arrives afterwards
//     fails with a check violation instead of inserting unseen, and the
//     runtime retries it in a new transaction, which lands in the current
//     partition.
//  2. It reads the partition's (consumer, message id) pairs and builds a
//     Bloom filter of them: filterBitsPerID bits per id, filterHashes bit
//     positions per id, split into filterBuckets rows of the table
//     Table+"_filter" keyed by (bucket, partition), so that a claim reads a
//     few hundred bytes per sealed partition, from one index page.
//  3. In one transaction, it writes the filter's rows and the partition's
//     row in Table+"_sealed".
//
// A claim then looks the id up directly only in the partitions the sealed
// ones do not cover: processed_at at or past the newest sealed partition's
// upper bound (partition pruning skips the others), and the DEFAULT
// partition, which may hold rows of any time (the fast claims skip it while
// it is empty below its floor: see partition.go). For the sealed partitions it
// reads the id's filter rows (or tests the store's copy of them: see
// filtercache.go): a Bloom filter has no false negatives, so if no filter
// has all of the id's bits the id is in no sealed partition, and the claim
// inserts it. If one has them (the id is there, or, for about one new id in
// 10,000 per sealed partition of ten million ids, a false positive), the
// claim falls back to the full lookup of every partition (with the copy in
// memory, to a probe of the partitions whose filters have them). Since partitions are sealed
// oldest first, every range partition below the newest sealed one's upper
// bound is sealed; the claim reads that bound and the filters in one
// snapshot, and the filter rows commit with the partition's sealed row.
// Dropping a partition deletes its filter rows and its sealed row with it.
const (
	sealedSuffix = "_sealed"
	filterSuffix = "_filter"
	// filterBuckets is the number of filter rows per sealed partition.
	filterBuckets = 1 << 15
	// filterBitsPerID and filterHashes set the filter's false-positive
	// rate: (1-e^(-10/20))^10 is 0.009%; measured, with the spread of ids
	// over buckets, 0.010% per sealed partition of ten million ids and
	// 0.027% of one million (TestFilterRates). A row holds
	// filterBitsPerID/8 bytes per id of its bucket, and must fit an index
	// entry (maxFilterBytes): past about 34 million ids in one partition
	// the rows are capped and the false-positive rate rises, so a
	// partition should hold fewer (use a shorter PartitionInterval).
	// Partitions sealed with another size (earlier versions used 14
	// bits per id) keep their rows: a row's bit count is its length.
	filterBitsPerID = 20
	filterHashes    = 10
	// minFilterBytes and maxFilterBytes bound a filter row's bits.
	minFilterBytes = 16
	maxFilterBytes = 2600
	// sealDelayMax bounds how long past its upper bound a partition waits
	// to be sealed (a shorter interval waits one interval).
	sealDelayMax = time.Minute
)

// filterKey is where an id's bits are in the filters: the row (bucket),
// and the start and step of its filterHashes bit positions, each taken
// modulo the row's bit count. It is derived from the id's claim lock key,
// which already hashes (consumer, message id).
type filterKey struct {
	bucket int32
	h1, h2 int64
}

// mix64 is the splitmix64 finalizer.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

func newFilterKey(name, id string) filterKey {
	h := uint64(claimLockKey(name, id))
	a, b := mix64(h), mix64(h^0x9e3779b97f4a7c15)
	return filterKey{
		bucket: int32(a & (filterBuckets - 1)),
		h1:     int64(a >> 32),
		h2:     int64(b>>32) | 1,
	}
}

// positions returns the id's bit positions in a row of nbits bits, by
// enhanced double hashing: h1 + j*h2 + (j^3-j)/6, modulo nbits (the cubic
// term keeps the positions of two ids from following one another, as
// plain double hashing's arithmetic progressions do in small rows).
func (k filterKey) positions(nbits int64, out []int64) []int64 {
	out = out[:0]
	for j := int64(0); j < filterHashes; j++ {
		out = append(out, (k.h1+j*k.h2+cubic(j))%nbits)
	}
	return out
}

// cubic is (j^3-j)/6.
func cubic(j int64) int64 { return (j*j*j - j) / 6 }

// filterMatch is the SQL condition that the filter row f has every bit of
// the id whose key parts are h1 and h2 (SQL expressions), as positions
// computes them; get_bit numbers bits from the low bit of the first byte.
func filterMatch(f, h1, h2 string) string {
	var b strings.Builder
	for j := 0; j < filterHashes; j++ {
		if j > 0 {
			b.WriteString("\n\tAND ")
		}
		fmt.Fprintf(&b, "get_bit(%s.bits, ((%s + %d * %s + %d) %% (8 * length(%s.bits)))::integer) = 1", f, h1, j, h2, cubic(int64(j)), f)
	}
	return b.String()
}

// sealedSQL sets the names of the seals' tables.
func sealedSQL(st *statements, qDefault, qSealed, qFilter string) {
	st.qDefault, st.qSealed, st.qFilter = qDefault, qSealed, qFilter
}

// fastClaims are the first claim statements of a partitioned table, which
// skip the sealed partitions. They insert into the partition that holds
// the present by its name, with ON CONFLICT on its primary key, and name the
// other partitions they probe, rather than going through the parent, so that
// a claim locks and opens only those: a statement on the parent locks every
// partition and its index, past the lock manager's fast path.
//
// They are built from the partitions at one time, and are correct until
// the clock passes the upper bound of that partition (validUntil): until
// then every row of a committed claim (whose processed_at, its
// transaction's start, is before this statement's start) is in the
// partition they insert into, found by ON CONFLICT; in another partition
// they probe (the unsealed past ones, the DEFAULT partition unless it was
// empty below a floor past that bound); or in a
// sealed partition, whose filter they read when any partition was sealed
// when they were built, or the claim tests in memory when the store holds
// the filters of all of those (see filtercache.go; one sealed since is
// still probed by name). Past
// it, or in a transaction that began before the partition's lower bound,
// they insert nothing, so the claim falls back to the full lookup. A purge
// that drops a partition they name makes them fail (undefined_table): they
// are then built again, and the claim retried.
type fastClaims struct {
	insert, batchInsert string
	// existing and batchExisting read a row where insert and batchInsert
	// look (the partition they insert into, and those they probe), for
	// the ids they did not insert.
	existing, batchExisting string
	// filter: the statements read the seals' filter, and take the
	// filter's keys as arguments.
	filter bool
	// cached, when not nil, are the cached filters of every partition
	// sealed when the statements were built (which do not read the filter
	// table): the claim tests its ids against them (see filtercache.go).
	cached cachedFilters
	// validUntil is when the statements stop inserting (by the
	// database's clock); refreshAt when the store builds them again (by
	// this process's).
	validUntil, refreshAt time.Time
	// cur, probe and defaultClass are what they were built from (see
	// buildFast), for their variants.
	cur          partitionInfo
	probe        []string
	defaultClass int
	// variants holds, by the names of the sealed partitions they also
	// probe, the statements for ids those partitions' cached filters may
	// hold (see variant).
	variants sync.Map
}

// variant returns the statements of f that also probe the sealed
// partitions of the filters m, by name: the statements for ids that one
// of them may hold. Every other sealed partition's filter says the ids are
// not there; the statements find them anywhere else f's do. They run with
// sequential scans off, since they probe partitions whose plans were not
// made for them.
func (f *fastClaims) variant(st *statements, m []*sealedFilter) *fastClaims {
	names := make([]string, len(m))
	for i, sf := range m {
		names[i] = sf.partition
	}
	sort.Strings(names)
	key := strings.Join(names, "\x00")
	if v, ok := f.variants.Load(key); ok {
		return v.(*fastClaims)
	}
	probe := append([]string(nil), f.probe...)
	for _, n := range names {
		probe = append(probe, pgx.Identifier{st.schema, n}.Sanitize())
	}
	v, _ := f.variants.LoadOrStore(key, buildFast(st, f.cur, probe, false, f.defaultClass))
	return v.(*fastClaims)
}

// fastRefresh is how often a store rebuilds its fast claim statements,
// so that they stop probing partitions sealed since, and are planned
// again once the DEFAULT partition has grown (see buildFast).
const fastRefresh = time.Minute

// buildFast builds the fast claim statements that insert into the partition
// cur, probe the partitions named probe (quoted) and, unless defaultClass is
// -1, the DEFAULT partition, and read the seals' filter if filter is true.
//
// They run with the session's enable_seqscan, unlike the full lookup: the
// partition that grows (cur) is reached through ON CONFLICT, which always
// uses its primary key; the past partitions probed are full; the filter is
// read only once a seal has filled it. Only the DEFAULT partition may be
// empty when a plan is made and grow after, and only while no partition
// holds the present, when these statements are not used: its rows come
// from claims that found none. The statements carry the DEFAULT
// partition's size class (defaultClass), so that a rebuild after it grew
// past a power of two makes each connection plan them afresh, while the
// text, and each connection's prepared statement, stays the same
// otherwise. The class is -1 when the DEFAULT partition was empty and its
// floor at or past cur's upper bound, read in that order: no claim can add
// a row to it until then (see the top of partition.go), so the statements
// do not probe it.
func buildFast(st *statements, cur partitionInfo, probe []string, filter bool, defaultClass int) *fastClaims {
	guard := `statement_timestamp() < ` + pgTime(*cur.upper)
	if cur.lower != nil {
		guard = `now() >= ` + pgTime(*cur.lower) + ` AND ` + guard
	}
	given := probe
	if defaultClass >= 0 {
		probe = append(probe[:len(probe):len(probe)], st.qDefault)
	}
	qCur := pgx.Identifier{st.schema, cur.name}.Sanitize()
	var one, many strings.Builder
	var ex, batchEx []string
	for _, q := range probe {
		one.WriteString("\nAND NOT EXISTS (SELECT 1 FROM " + q + " p WHERE p.consumer = $1::text AND p.message_id = $2::text)")
		many.WriteString("\nAND NOT EXISTS (SELECT 1 FROM " + q + " p WHERE p.consumer = $1::text AND p.message_id = u.id)")
	}
	for _, q := range append([]string{qCur}, probe...) {
		ex = append(ex, "SELECT fingerprint, processed_at FROM "+q+" WHERE consumer = $1::text AND message_id = $2::text")
		batchEx = append(batchEx, "SELECT message_id, fingerprint, processed_at FROM "+q+" WHERE consumer = $1::text AND message_id = u.id")
	}
	if filter {
		one.WriteString("\nAND NOT EXISTS (SELECT 1 FROM " + st.qFilter + " f WHERE f.bucket = $7::integer\n\tAND " + filterMatch("f", "$8::bigint", "$9::bigint") + ")")
		many.WriteString("\nAND NOT EXISTS (SELECT 1 FROM " + st.qFilter + " f WHERE f.bucket = u.fb\n\tAND " + filterMatch("f", "u.h1", "u.h2") + ")")
	}
	// Without a filter to read, the statements take the full lookup's
	// arguments (see args and batchArgs).
	unnest := `unnest($2::text[], $3::bytea[], $4::text[], $5::int[], $6::bigint[]) AS u(id, fp, src, part, off)`
	if filter {
		unnest = `unnest($2::text[], $3::bytea[], $4::text[], $5::int[], $6::bigint[], $7::int[], $8::bigint[], $9::bigint[])
	AS u(id, fp, src, part, off, fb, h1, h2)`
	}
	comment := `DEFAULT partition size class ` + strconv.Itoa(defaultClass)
	if defaultClass < 0 {
		comment = `DEFAULT partition empty below its floor`
	}
	head := `/* idemq fast claim; ` + comment + ` */
INSERT INTO ` + qCur + ` (consumer, message_id, fingerprint, source, partition, "offset")`
	return &fastClaims{
		validUntil:   *cur.upper,
		filter:       filter,
		cur:          cur,
		probe:        given,
		defaultClass: defaultClass,
		existing:     "/* idemq fast existing */\n" + strings.Join(ex, "\nUNION ALL\n") + "\nLIMIT 1",
		batchExisting: `/* idemq fast existing */
SELECT p.message_id, p.fingerprint, p.processed_at
FROM unnest($2::text[]) AS u(id)
CROSS JOIN LATERAL (
` + strings.Join(batchEx, "\nUNION ALL\n") + `
LIMIT 1) AS p`,
		insert: head + `
SELECT $1::text, $2::text, $3::bytea, $4::text, $5::integer, $6::bigint
WHERE ` + guard + one.String() + `
ON CONFLICT (consumer, message_id) DO NOTHING`,
		batchInsert: head + `
SELECT $1::text, u.id, u.fp, u.src, NULLIF(u.part, -1), NULLIF(u.off, -1)
FROM ` + unnest + `
WHERE ` + guard + many.String() + `
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING message_id`,
	}
}

// fast returns the fast claim statements, building them when there are
// none or it is time to refresh them, reading through q (the store's DB,
// or the transaction a caller of Claim or ClaimBatch holds); nil when no
// partition holds the present (the claims then take the full lookup).
func (s *Store) fast(ctx context.Context, q querier, st *statements) (*fastClaims, error) {
	if f := s.fastSQL.Load(); f != nil && time.Now().Before(f.refreshAt) {
		return f.orNil(), nil
	}
	s.fastMu.Lock()
	defer s.fastMu.Unlock()
	if f := s.fastSQL.Load(); f != nil && time.Now().Before(f.refreshAt) {
		return f.orNil(), nil
	}
	dbNow, parts, sealed, err := s.partitionState(ctx, q, st, "claim", true)
	if err != nil {
		return nil, err
	}
	// The partition that holds the present: the partitions ahead are
	// empty until its upper bound, and are not probed. With none (its
	// claims go to the DEFAULT partition, until some process creates
	// one), there are no fast statements: the claims take the full
	// lookup.
	var cur *partitionInfo
	for i, p := range parts {
		if p.upper != nil && (p.lower == nil || !p.lower.After(dbNow)) && dbNow.Before(*p.upper) {
			cur = &parts[i]
		}
	}
	refresh := time.Now().Add(fastRefresh)
	if cur == nil {
		s.fastSQL.Store(&fastClaims{refreshAt: refresh})
		return nil, nil
	}
	var probe []string
	for _, p := range parts {
		if p.name != cur.name && p.upper != nil && !isSealed(sealed, p.name) && (p.lower == nil || p.lower.Before(*cur.upper)) {
			probe = append(probe, pgx.Identifier{st.schema, p.name}.Sanitize())
		}
	}
	// The floor first, then the size: a floor read is one whose claims
	// below it were refused since it was set, and any row a claim added
	// before it shows in the size, committed or not.
	floor, err := readFloor(ctx, q, st, s.cfg.Table+floorSuffix)
	if err != nil {
		return nil, s.wrap("claim: the DEFAULT partition's floor", err)
	}
	var defaultPages int64
	if err := q.QueryRow(ctx, `SELECT pg_relation_size($1::regclass) / current_setting('block_size')::bigint`, st.qDefault).Scan(&defaultPages); err != nil {
		return nil, s.wrap("claim: the DEFAULT partition's size", err)
	}
	defaultClass := bits.Len64(uint64(max(defaultPages, 0)))
	if defaultPages == 0 && floor != nil && !floor.Before(*cur.upper) {
		defaultClass = -1 // empty, and stays so until cur's end: not probed
	}
	cached := s.filters.Load().cover(sealed)
	f := buildFast(st, *cur, probe, len(sealed) > 0 && cached == nil, defaultClass)
	f.cached = cached
	// Rebuilt when the present passes into the next partition, by this
	// process's clock (a late rebuild only makes claims fall back).
	f.refreshAt = refresh
	if at := time.Now().Add(cur.upper.Sub(dbNow)); at.Before(refresh) {
		f.refreshAt = at
	}
	s.fastSQL.Store(f)
	return f, nil
}

// firstInsert is the first insert of a claim, or of a batch of claims, on
// a partitioned table, after the lock: a fast statement when there is one,
// else the full lookup's insert, between noScans and restoreScans.
type firstInsert struct {
	st   *statements
	sql  string
	args []any
	// scansOff: the insert runs between noScans and restoreScans (the full
	// lookup's, and a fast one that probes sealed partitions by name).
	scansOff bool
	// existing reads the row of an id a fast insert did not insert, where
	// that insert looked; empty for the full lookup's.
	existing string
	// wrap wraps the errors of the insert: wrapFast for a fast one.
	wrap func(op string, err error) error
}

// firstClaim returns the first insert of c, reading the partitions through
// q if the fast statements need building.
func (s *Store) firstClaim(ctx context.Context, q querier, st *statements, c consumer.Claim) (firstInsert, error) {
	f, err := s.fast(ctx, q, st)
	if err != nil {
		return firstInsert{}, err
	}
	if f == nil {
		return firstInsert{st: st, sql: st.insert, args: claimArgs(c), scansOff: true, wrap: s.wrap}, nil
	}
	if f.cached != nil {
		if m := f.cached.matching(c); m != nil {
			// A sealed partition may hold the id: probe those that may.
			v := f.variant(st, m)
			return firstInsert{st: st, sql: v.insert, args: claimArgs(c), scansOff: true, existing: v.existing, wrap: s.wrapFast}, nil
		}
	}
	return firstInsert{st: st, sql: f.insert, args: f.args(c), existing: f.existing, wrap: s.wrapFast}, nil
}

// firstBatchClaim returns the first inserts of the pending claims of b: one,
// or, with cached filters, one for the ids no sealed partition may hold and
// one for the others, which probes the sealed partitions that may hold them
// by name.
func (s *Store) firstBatchClaim(ctx context.Context, q querier, b *batchClaim, pending []consumer.Claim) (firstInserts, error) {
	f, err := s.fast(ctx, q, b.st)
	if err != nil {
		return firstInserts{}, err
	}
	if f == nil {
		return firstInserts{wrap: s.wrap, inserts: []firstInsert{{st: b.st, sql: b.st.batchInsert, args: b.insertArgs(pending), scansOff: true}}}, nil
	}
	fis := firstInserts{wrap: s.wrapFast, existing: f.batchExisting}
	var (
		maybe   []consumer.Claim
		matched []*sealedFilter
	)
	if f.cached != nil {
		pending, maybe, matched = f.cached.split(pending)
	}
	if len(pending) > 0 {
		fis.inserts = append(fis.inserts, firstInsert{st: b.st, sql: f.batchInsert, args: f.batchArgs(b, pending)})
	}
	if len(maybe) > 0 {
		// Its reads look where both inserts did.
		v := f.variant(b.st, matched)
		fis.inserts = append(fis.inserts, firstInsert{st: b.st, sql: v.batchInsert, args: b.insertArgs(maybe), scansOff: true})
		fis.existing = v.batchExisting
	}
	return fis, nil
}

// firstInserts are the first inserts of a batch of claims, each returning
// the ids it inserted.
type firstInserts struct {
	inserts []firstInsert
	// existing reads the rows of the ids they did not insert, where they
	// looked; empty for the full lookup's.
	existing string
	// wrap wraps their errors.
	wrap func(op string, err error) error
}

// queue queues the inserts on bt, each with the callback collect.
func (fis firstInserts) queue(bt *pgx.Batch, collect func(pgx.Rows) error) {
	for _, fi := range fis.inserts {
		fi.queue(bt).Query(collect)
	}
}

// queue queues the insert on bt, and returns it for its result's callback.
func (fi firstInsert) queue(bt *pgx.Batch) *pgx.QueuedQuery {
	if fi.scansOff {
		bt.Queue(noScans)
	}
	q := bt.Queue(fi.sql, fi.args...)
	if fi.scansOff {
		bt.Queue(fi.st.restoreScans)
	}
	return q
}

// orNil is f, or nil for the marker of a table with no fast statements.
func (f *fastClaims) orNil() *fastClaims {
	if f.insert == "" {
		return nil
	}
	return f
}

// forgetFast drops the fast claim statements, so that the next claim
// builds them from the partitions as they are.
func (s *Store) forgetFast() { s.fastSQL.Store(nil) }

// wrapFast is wrap for the errors of a claim that ran the fast
// statements: a partition they name that a purge has dropped is not a
// missing table, but a reason to build them again and retry.
func (s *Store) wrapFast(op string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
		s.forgetFast()
		return fmt.Errorf("processed: %s on %s: a partition the claim looked in is gone (dropped by a purge); retry: %w", op, s, err)
	}
	return s.wrap(op, err)
}

// args are the arguments of f.insert for c.
func (f *fastClaims) args(c consumer.Claim) []any {
	if !f.filter {
		return claimArgs(c)
	}
	k := newFilterKey(c.Consumer, c.MessageID)
	return append(claimArgs(c), k.bucket, k.h1, k.h2)
}

// batchArgs are the arguments of f.batchInsert for the pending claims of b.
func (f *fastClaims) batchArgs(b *batchClaim, pending []consumer.Claim) []any {
	if !f.filter {
		return b.insertArgs(pending)
	}
	buckets := make([]int32, len(pending))
	h1s := make([]int64, len(pending))
	h2s := make([]int64, len(pending))
	for i, c := range pending {
		k := newFilterKey(c.Consumer, c.MessageID)
		buckets[i], h1s[i], h2s[i] = k.bucket, k.h1, k.h2
	}
	return append(b.insertArgs(pending), buckets, h1s, h2s)
}

// createSealTables creates the tables of sealed partitions and their
// filters, if missing.
func (s *Store) createSealTables(ctx context.Context, tx pgx.Tx, st *statements) error {
	_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+st.qSealed+` (
    partition text        PRIMARY KEY,
    lo        timestamptz NOT NULL,
    hi        timestamptz NOT NULL,
    ids       bigint      NOT NULL,
    sealed_at timestamptz NOT NULL DEFAULT now()
);
-- The claim reads max(hi) through it (with sequential scans off, a scan
-- would be costed high enough to make every claim JIT-compiled).
CREATE INDEX IF NOT EXISTS `+pgx.Identifier{s.cfg.Table + sealedSuffix + "_hi"}.Sanitize()+` ON `+st.qSealed+` (hi);
-- The primary key carries the bits, so that a claim reads one bucket's
-- rows, one per sealed partition, from one index page (an index-only scan,
-- once VACUUM has marked the table's pages all-visible, as seal does).
CREATE TABLE IF NOT EXISTS `+st.qFilter+` (
    bucket    integer NOT NULL,
    partition text    NOT NULL,
    bits      bytea   NOT NULL,
    PRIMARY KEY (bucket, partition) INCLUDE (bits)
)`)
	return err
}

// sealDelay is how long past its upper bound a partition waits to be
// sealed.
func (s *Store) sealDelay() time.Duration {
	return min(s.interval(), sealDelayMax)
}

// SealPartitions seals the partitions of a partitioned table whose upper
// bound is past (by the database's clock, with a delay of one
// PartitionInterval or a minute, whichever is shorter), oldest first, and
// returns how many it sealed: see the comment of seal.go. Claims of new ids
// then skip them, reading a Bloom filter of their ids instead. Sealing a
// partition reads its ids once, and waits (up to a lock timeout of 2s, then
// it stops, to go on at the next call) for the transactions that hold a
// lock on it. Purge calls it, so the janitor keeps the table sealed. It
// does nothing on a plain table.
func (s *Store) SealPartitions(ctx context.Context) (int, error) {
	st, partitioned, err := s.partitionedStatements(ctx)
	if err != nil || !partitioned {
		return 0, err
	}
	now, parts, sealed, err := s.partitionState(ctx, s.db, st, "seal", true)
	if err != nil {
		return 0, err
	}
	n := 0
	// partitions lists the range partitions by upper bound, DEFAULT last.
	for _, p := range parts {
		if p.upper == nil || p.upper.After(now.Add(-s.sealDelay())) {
			break
		}
		if isSealed(sealed, p.name) {
			continue
		}
		if err := s.seal(ctx, st, p); err != nil {
			return n, s.wrap("seal partition "+p.name, err)
		}
		s.forgetFast()
		n++
	}
	return n, nil
}

// seal seals one partition, whose range partitions before it are sealed.
func (s *Store) seal(ctx context.Context, st *statements, p partitionInfo) error {
	ident := pgx.Identifier{st.schema, p.name}.Sanitize()
	err := s.ddlTx(ctx, st, func(tx pgx.Tx) error {
		// Found by what it is, not by its name, which Postgres may have
		// cut to 63 bytes.
		var has bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = to_regclass($1)
	AND contype = 'c' AND NOT convalidated AND pg_get_constraintdef(oid) = 'CHECK (false) NOT VALID')`, ident).Scan(&has); err != nil {
			return err
		}
		if has {
			return nil
		}
		_, err := tx.Exec(ctx, `ALTER TABLE `+ident+` ADD CONSTRAINT `+pgx.Identifier{p.name + "_sealed"}.Sanitize()+` CHECK (false) NOT VALID`)
		return err
	})
	if err != nil {
		return fmt.Errorf("refuse new rows: %w", err)
	}
	// Every transaction that could insert into the partition has ended:
	// its rows are all in this statement's snapshot.
	var count int64
	if err := s.db.QueryRow(ctx, `SELECT count(*) FROM `+ident).Scan(&count); err != nil {
		return fmt.Errorf("count ids: %w", err)
	}
	// Capped to fit an index entry: past about 34 million ids the
	// false-positive rate rises instead.
	rowBytes := filterRowBytes(count)
	bits := make([]byte, filterBuckets*rowBytes)
	nbits := int64(rowBytes * 8)
	rows, err := s.db.Query(ctx, `SELECT consumer, message_id FROM `+ident)
	if err != nil {
		return fmt.Errorf("read ids: %w", err)
	}
	var (
		name, id string
		pos      []int64
		seen     int64
	)
	_, err = pgx.ForEachRow(rows, []any{&name, &id}, func() error {
		k := newFilterKey(name, id)
		row := bits[int(k.bucket)*rowBytes : int(k.bucket+1)*rowBytes]
		for _, b := range k.positions(nbits, pos) {
			row[b/8] |= 1 << (b % 8)
		}
		seen++
		return nil
	})
	if err != nil {
		return fmt.Errorf("read ids: %w", err)
	}
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// A seal left half done by a crash is redone whole.
	if _, err := tx.Exec(ctx, `DELETE FROM `+st.qFilter+` WHERE partition = $1`, p.name); err != nil {
		return fmt.Errorf("clear filter: %w", err)
	}
	// A row with no bit set matches no id: only the others are written,
	// so a small partition costs as many rows as it has ids at most.
	var filled []int32
	for i := range filterBuckets {
		for _, b := range bits[i*rowBytes : (i+1)*rowBytes] {
			if b != 0 {
				filled = append(filled, int32(i))
				break
			}
		}
	}
	src := pgx.CopyFromSlice(len(filled), func(j int) ([]any, error) {
		i := int(filled[j])
		return []any{filled[j], p.name, bits[i*rowBytes : (i+1)*rowBytes]}, nil
	})
	if _, err := tx.CopyFrom(ctx, pgx.Identifier{st.schema, s.cfg.Table + filterSuffix}, []string{"bucket", "partition", "bits"}, src); err != nil {
		return fmt.Errorf("write filter: %w", err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+st.qSealed+` (partition, lo, hi, ids) VALUES ($1, coalesce($2::timestamptz, '-infinity'), $3, $4)`,
		p.name, p.lower, *p.upper, seen); err != nil {
		return fmt.Errorf("record seal: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	// Mark the new rows' pages all-visible, for index-only scans. A
	// failure here costs speed, not correctness.
	if _, err := s.db.Exec(ctx, `VACUUM (ANALYZE) `+st.qFilter); err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return nil
}

// Maintain implements consumer.Maintainer, for the runtime's janitor: on a
// partitioned table it creates the partitions ahead (EnsurePartitions),
// seals those behind the clock (SealPartitions) and caches the sealed
// partitions' filters (CacheFilters); on a plain table it does nothing.
func (s *Store) Maintain(ctx context.Context) error {
	st, err := s.statements(ctx)
	if err != nil {
		return err
	}
	kind, err := s.relkind(ctx, s.db, st)
	if err != nil {
		return s.wrap("upkeep: read the table's kind", err)
	}
	if kind != 'p' {
		return nil
	}
	if _, err := s.EnsurePartitions(ctx); err != nil {
		return err
	}
	_, err = s.SealPartitions(ctx)
	// The filters sealed so far are cached even if a seal failed.
	_, cerr := s.CacheFilters(ctx)
	return errors.Join(err, cerr)
}

var _ consumer.Maintainer = (*Store)(nil)

// unsealStatements are run, in the transaction that drops a partition, to
// forget its seal.
func unsealStatements(st *statements) []string {
	return []string{
		`DELETE FROM ` + st.qFilter + ` WHERE partition = $1`,
		`DELETE FROM ` + st.qSealed + ` WHERE partition = $1`,
	}
}

// SealedPartition is a row of the table of sealed partitions.
type SealedPartition struct {
	// Partition is the partition's table name.
	Partition string
	// Lo and Hi are its range (Lo zero for the legacy partition).
	Lo, Hi time.Time
	// IDs is how many ids its filter holds.
	IDs      int64
	SealedAt time.Time
}

// Sealed returns the sealed partitions, oldest first; none on a plain
// table.
func (s *Store) Sealed(ctx context.Context) ([]SealedPartition, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return nil, err
	}
	var exists bool
	if err := s.db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, st.qSealed).Scan(&exists); err != nil || !exists {
		return nil, err
	}
	rows, err := s.db.Query(ctx, `SELECT partition, CASE WHEN lo = '-infinity' THEN NULL ELSE lo END, hi, ids, sealed_at FROM `+st.qSealed+` ORDER BY hi`)
	if err != nil {
		return nil, s.wrap("read sealed partitions", err)
	}
	var (
		out []SealedPartition
		sp  SealedPartition
		lo  *time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&sp.Partition, &lo, &sp.Hi, &sp.IDs, &sp.SealedAt}, func() error {
		sp.Lo = time.Time{}
		if lo != nil {
			sp.Lo = *lo
		}
		out = append(out, sp)
		return nil
	})
	return out, err
}
