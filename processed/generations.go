package processed

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The partitioned layout (Config.Partitioned, migration gen/0001).
//
// The rows live in three generations, the tables Table+"_g0", "_g1" and
// "_g2", each with its primary key on (consumer, message_id). g0 is the
// current generation. A claim inserts into g0 with ON CONFLICT DO NOTHING,
// but only the ids that neither g1 nor g2 holds (NOT EXISTS on their
// primary keys), in one statement; the store reads rows from the three.
// Which generation a row lives in depends on when it was claimed, never on
// its processed_at, so no clock, and no setting of the session, can make a
// claim miss a committed row. A fourth table, "_g3", holds a retired
// generation until the upkeep has emptied it; no claim reads it. The view
// Table shows the four.
//
// The upkeep (maintain) rotates the generations, under the table's DDL lock
// (one upkeep at a time, across processes) and in one transaction, as soon
// as g2 may be retired: every consumer with rows in it has recorded a purge
// horizon at or past the generation's end, when g1 became current (see
// Store.Purge; a consumer that never records one holds its rows). With g2
// empty, it rotates once g0 has been current for half the longest purge age
// the consumers have recorded. The rotation renames the tables: g2 becomes g3
// (retired), g1 becomes g2, g0 becomes g1, and g3, empty, becomes g0. Rows
// then live between their consumer's purge age and about one and a half
// times the longest. Then, in a transaction of its own, the upkeep empties
// g3 with a TRUNCATE; no claim waits for that.
//
// The rotation takes the four tables' ACCESS EXCLUSIVE locks, waiting at
// most a second (see setLockTimeout), else it is postponed to the next
// round, with an error for the janitor to log (a claim transaction held
// them that long); while another upkeep holds the DDL lock, it is that
// one's work. So it waits for
// every claim transaction that took its locks before it, and the claims
// that queue behind it resolve the names g0, g1 and g2 again once it
// commits (Postgres does, for a plain statement and for a prepared one
// alike), and take their snapshot after that: every row of the generation
// that was current is committed and visible to them, in g1. No claim can
// insert into a generation after it stopped being current, so the primary
// key of g0 alone settles two concurrent claims of one id. The renames
// change only the catalog: the claims wait milliseconds, whatever the size
// of the generation retired.
//
// The table Table+"_generations" numbers the generations and says when
// each became current, read by the database's clock after the rotation's
// locks are taken: g0 holds the highest number, g1 the one before, g2 the
// one before that. A generation ended when the next one began.
type generations struct {
	// tables are the quoted, qualified g0 to g3; names their unqualified
	// names, and spare the name g3 passes through while they rotate.
	tables [genCount + 1]string
	names  [genCount + 1]string
	spare  string
	// meta is the quoted, qualified table of generations.
	meta string
	// postponed is when a rotation was last postponed (Unix nanoseconds),
	// 0 if the last one was not.
	postponed atomic.Int64
}

// genCount is the number of generations claims look in.
const genCount = 3

// retired is the index of the table of the retired generation, g3.
const retired = genCount

// setLockTimeout bounds the upkeep's wait for the generations' locks, as
// claims queue behind a lock the upkeep waits for: 1s, and in any case
// half the server's deadlock_timeout. A claim planned before a rotation
// takes its locks in the order the generations had then, so it and the
// next upkeep can wait for each other; the upkeep then gives up first,
// before the deadlock detector could pick the claim, and tries again at
// the next round.
const setLockTimeout = `SELECT set_config('lock_timeout',
	least(1000, extract(epoch FROM current_setting('deadlock_timeout')::interval) * 500)::int || 'ms', true)`

func newGenerations(schema, table string) *generations {
	g := &generations{
		spare: pgx.Identifier{table + "_gx"}.Sanitize(),
		meta:  pgx.Identifier{schema, table + "_generations"}.Sanitize(),
	}
	for i := range g.tables {
		g.names[i] = table + "_g" + strconv.Itoa(i)
		g.tables[i] = pgx.Identifier{schema, g.names[i]}.Sanitize()
	}
	return g
}

// claimTables: the current generation takes the rows that no other
// generation has.
func (g *generations) claimTables() (string, []string) { return g.tables[0], g.tables[1:genCount] }

// allTables are the four generations' tables, the retired one included.
func (g *generations) allTables() []string { return g.tables[:] }

// readFrom is the three generations as one relation, t, for the store's
// reads: not the view, which also shows g3.
func (g *generations) readFrom() string {
	parts := make([]string, genCount)
	for i := range parts {
		parts[i] = "SELECT * FROM " + g.tables[i]
	}
	return "(" + strings.Join(parts, " UNION ALL ") + ") AS t"
}

// purge runs the upkeep: rows go a generation at a time, once every
// consumer with rows in it has recorded a horizon past its end.
func (g *generations) purge(ctx context.Context, s *Store, st *statements, _ string, _ time.Time) (int64, error) {
	return g.maintain(ctx, s, st)
}

// ddlLockKey serialises the upkeep of one table across processes.
func ddlLockKey(st *statements) int64 {
	h := fnv.New64a()
	h.Write([]byte("idemq.processed.generations:" + st.qTable))
	return int64(h.Sum64())
}

// genState is what the upkeep reads before deciding.
type genState struct {
	now time.Time
	// began holds when each generation became current, g0 first; zero
	// for one that began before the layout did.
	began [genCount]time.Time
	// maxAge is the longest purge age recorded, 0 if none.
	maxAge time.Duration
	// empty says which tables have no rows, g0 first, g3 last.
	empty [genCount + 1]bool
}

// read reads the generations' state through q.
func (g *generations) read(ctx context.Context, q pgx.Tx, st *statements) (genState, error) {
	var (
		s      genState
		began  []time.Time
		finite []bool
		maxMS  *int64
	)
	err := q.QueryRow(ctx, `SELECT clock_timestamp(),
	array(SELECT CASE WHEN isfinite(began_at) THEN began_at ELSE 'epoch' END FROM `+g.meta+` ORDER BY generation DESC LIMIT `+strconv.Itoa(genCount)+`),
	array(SELECT isfinite(began_at) FROM `+g.meta+` ORDER BY generation DESC LIMIT `+strconv.Itoa(genCount)+`),
	(SELECT max(older_than_ms) FROM `+st.horizons+`),
	NOT EXISTS (SELECT 1 FROM `+g.tables[0]+`), NOT EXISTS (SELECT 1 FROM `+g.tables[1]+`),
	NOT EXISTS (SELECT 1 FROM `+g.tables[2]+`), NOT EXISTS (SELECT 1 FROM `+g.tables[3]+`)`).
		Scan(&s.now, &began, &finite, &maxMS, &s.empty[0], &s.empty[1], &s.empty[2], &s.empty[3])
	if err != nil {
		return s, err
	}
	if len(began) != genCount {
		return s, fmt.Errorf("%s holds %d generations, want %d", g.meta, len(began), genCount)
	}
	for i := range began {
		if finite[i] {
			s.began[i] = began[i]
		}
	}
	if maxMS != nil {
		s.maxAge = time.Duration(*maxMS) * time.Millisecond
	}
	return s, nil
}

// holders returns the consumers with rows in the oldest generation whose
// purge horizon is not past its end (ended; zero, before any time, for a
// generation that ended before the layout began), found by a loose scan
// of its primary key: the consumers that keep it from being retired.
func (g *generations) holders(ctx context.Context, q pgx.Tx, st *statements, ended time.Time) ([]string, error) {
	rows, err := q.Query(ctx, distinctConsumers(g.tables[genCount-1]+` AS t`)+`
SELECT c.consumer FROM c LEFT JOIN `+st.horizons+` h ON h.consumer = c.consumer
WHERE c.consumer IS NOT NULL AND (h.purge_before IS NULL OR h.purge_before < $1::timestamptz)
ORDER BY 1`, ended)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// maintain empties g3, rotates the generations if they are due (see the top
// of this file), then empties g3 again if the rotation retired rows into
// it. It returns how many rows it retired.
func (g *generations) maintain(ctx context.Context, s *Store, st *statements) (int64, error) {
	if err := g.emptyRetired(ctx, s, st); err != nil {
		return 0, err
	}
	n, err := g.rotate(ctx, s, st)
	if err != nil || n == 0 {
		return n, err
	}
	return n, g.emptyRetired(ctx, s, st)
}

// postponeFor is how long after a rotation was postponed (its locks not
// free in time) the upkeep does not try again: the janitor runs Maintain,
// then Purge, which runs it again, and one round should make claims wait
// once.
const postponeFor = 5 * time.Second

// errPostponed is wrapped by the error of a rotation that was due but
// could not take the generations' locks in time.
var errPostponed = errors.New("the rotation of the generations is due, but their locks were not free within the lock timeout " +
	"(a claim transaction held them; handlers that keep their transaction open for long hold it back): postponed to the next round")

// rotate rotates the generations if they are due, and returns how many rows
// the generation it retired held (the planner's estimate, if it has one).
func (g *generations) rotate(ctx context.Context, s *Store, st *statements) (int64, error) {
	if at := g.postponed.Load(); at != 0 && time.Since(time.Unix(0, at)) < postponeFor {
		return 0, nil
	}
	var n int64
	locking := false
	err := s.ddlTx(ctx, st, func(tx pgx.Tx) error {
		// Horizons move only after this decision is made: a consumer
		// whose horizon goes back (its broker may redeliver older
		// messages) waits for the retirement, or is seen by it.
		if _, err := tx.Exec(ctx, `LOCK TABLE `+st.horizons+` IN SHARE MODE`); err != nil {
			return err
		}
		gs, err := g.read(ctx, tx, st)
		if err != nil {
			return err
		}
		if !gs.empty[retired] {
			return nil // emptying it failed: the next round
		}
		oldestEmpty := gs.empty[genCount-1]
		if oldestEmpty {
			due := gs.maxAge > 0 && gs.now.Sub(gs.began[0]) >= gs.maxAge/(genCount-1)
			if !due || gs.empty[0] && gs.empty[1] {
				return nil // not due, or nothing to move
			}
		} else {
			// Rows that may go go at once, due or not.
			held, err := g.holders(ctx, tx, st, gs.began[genCount-2])
			if err != nil || len(held) > 0 {
				return err
			}
		}
		locking = true
		if _, err := tx.Exec(ctx, `LOCK TABLE `+strings.Join(g.tables[:], ", ")+` IN ACCESS EXCLUSIVE MODE`); err != nil {
			return err
		}
		locking = false
		if !oldestEmpty {
			// The planner's estimate: a count would read the generation.
			if err := tx.QueryRow(ctx, `SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = $1::regclass`, g.tables[genCount-1]).Scan(&n); err != nil {
				return err
			}
			n = max(n, 1) // retired rows, whatever the estimate says
		}
		b := &pgx.Batch{}
		b.Queue(`ALTER TABLE ` + g.tables[retired] + ` RENAME TO ` + g.spare)
		for i := retired - 1; i >= 0; i-- {
			b.Queue(`ALTER TABLE ` + g.tables[i] + ` RENAME TO ` + pgx.Identifier{g.names[i+1]}.Sanitize())
		}
		b.Queue(`ALTER TABLE ` + pgx.Identifier{st.schema}.Sanitize() + `.` + g.spare + ` RENAME TO ` + pgx.Identifier{g.names[0]}.Sanitize())
		b.Queue(`INSERT INTO ` + g.meta + ` SELECT max(generation) + 1, clock_timestamp() FROM ` + g.meta)
		b.Queue(`DELETE FROM ` + g.meta + ` WHERE generation <= (SELECT max(generation) FROM ` + g.meta + `) - ` + strconv.Itoa(genCount))
		return tx.SendBatch(ctx, b).Close()
	})
	var pgErr *pgconn.PgError
	if locking && errors.As(err, &pgErr) && pgErr.Code == "55P03" {
		g.postponed.Store(time.Now().UnixNano())
		return 0, fmt.Errorf("processed: upkeep of %s: %w", s, errPostponed)
	}
	if err := benign(err); err != nil {
		return 0, s.wrap("upkeep of the generations: rotate", err)
	}
	g.postponed.Store(0)
	return n, nil
}

// emptyRetired empties g3, the retired generation, if it has rows. No
// claim reads it; a claim planned before the rotation that retired it is
// planned again, once, before it runs.
func (g *generations) emptyRetired(ctx context.Context, s *Store, st *statements) error {
	err := s.ddlTx(ctx, st, func(tx pgx.Tx) error {
		var empty bool
		if err := tx.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM `+g.tables[retired]+`)`).Scan(&empty); err != nil || empty {
			return err
		}
		_, err := tx.Exec(ctx, `TRUNCATE `+g.tables[retired])
		return err
	})
	if err := benign(err); err != nil {
		return s.wrap("upkeep of the generations: empty the retired one", err)
	}
	return nil
}

// benign is err, or nil when it only means that the upkeep's work is left
// to the next round: another upkeep holds the DDL lock, or the tables'
// locks were not free within the timeout.
func benign(err error) error {
	var pgErr *pgconn.PgError
	if errors.Is(err, errBusy) || errors.As(err, &pgErr) && pgErr.Code == "55P03" {
		return nil
	}
	return err
}

// errBusy is ddlTx's error when another upkeep holds the table's DDL lock.
var errBusy = errors.New("another upkeep holds the lock")

// ddlTx runs f in a transaction holding the table's DDL lock, with a lock
// timeout; errBusy if another transaction holds the DDL lock.
func (s *Store) ddlTx(ctx context.Context, st *statements, f func(pgx.Tx) error) error {
	tx, err := s.db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, setLockTimeout); err != nil {
		return err
	}
	var locked bool
	if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1)`, ddlLockKey(st)).Scan(&locked); err != nil {
		return err
	}
	if !locked {
		return errBusy
	}
	if err := f(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// Generation describes one generation of the partitioned layout.
type Generation struct {
	// Table is the generation's table: Table+"_g0" for the current one.
	Table string
	// BeganAt is when it became current (zero for the one that holds a
	// converted plain table's rows); EndedAt when the next one did (zero
	// for the current one).
	BeganAt, EndedAt time.Time
	// Rows is the planner's estimate of its rows (-1 if it has none).
	Rows int64
	// HeldBy, for the oldest, names the consumers with rows in it whose
	// purge horizon is not past its end: they keep it from being retired.
	HeldBy []string
}

// Generations describes the generations of the partitioned layout, the
// current one first; none for a plain table.
func (s *Store) Generations(ctx context.Context) ([]Generation, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return nil, err
	}
	g, ok := st.layout.(*generations)
	if !ok {
		return nil, nil
	}
	var out []Generation
	err = pgx.BeginTxFunc(ctx, s.db, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		gs, err := g.read(ctx, tx, st)
		if err != nil {
			return err
		}
		for i := range genCount {
			gen := Generation{Table: g.names[i], BeganAt: gs.began[i]}
			if i > 0 {
				gen.EndedAt = gs.began[i-1]
			}
			if err := tx.QueryRow(ctx, `SELECT reltuples::bigint FROM pg_class WHERE oid = $1::regclass`, g.tables[i]).Scan(&gen.Rows); err != nil {
				return err
			}
			out = append(out, gen)
		}
		if !gs.empty[genCount-1] {
			out[genCount-1].HeldBy, err = g.holders(ctx, tx, st, gs.began[genCount-2])
		}
		return err
	})
	if err != nil {
		return nil, s.wrap("read the generations", err)
	}
	return out, nil
}
