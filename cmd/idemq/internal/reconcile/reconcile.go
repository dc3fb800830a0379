package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/keys"
)

// The query shapes, for a quoted table %s. Each is paged with a keyset
// over an index, or looks keys up by primary key or unique index; the
// EXPLAIN test checks that none is a sequential scan.
const (
	// sentPage pages the outbox's sent rows of a window over the partial
	// index (sent_at) WHERE sent_at IS NOT NULL, in (sent_at, seq) order.
	sentPage = `SELECT seq, destination, message_id, sent_at FROM %s
WHERE sent_at IS NOT NULL AND sent_at >= $1 AND sent_at < $2
  AND sent_at >= $3 AND (sent_at, seq) > ($3, $4)
  AND destination = ANY($5)
ORDER BY sent_at, seq
LIMIT $6`
	// oldestSent is the outbox's oldest sent row, from the same index.
	oldestSent = `SELECT sent_at FROM %s WHERE sent_at IS NOT NULL ORDER BY sent_at LIMIT 1`
	// pendingFirst and pendingPage page the unsent rows over the partial
	// index (next_attempt_at, seq) WHERE sent_at IS NULL.
	pendingFirst = `SELECT seq, next_attempt_at, destination, message_id, created_at, attempts, coalesce(last_error, '') FROM %s
WHERE sent_at IS NULL
ORDER BY next_attempt_at, seq
LIMIT $1`
	pendingPage = `SELECT seq, next_attempt_at, destination, message_id, created_at, attempts, coalesce(last_error, '') FROM %s
WHERE sent_at IS NULL AND (next_attempt_at, seq) > ($2, $3)
ORDER BY next_attempt_at, seq
LIMIT $1`
	// outboxIDs looks message ids up by the unique index (destination,
	// message_id), one probe per id: a join with the ids rather than
	// message_id = ANY($2), which the planner may answer by reading every
	// row of the destination.
	outboxIDs = `SELECT o.message_id FROM unnest($2::text[]) AS k(id)
JOIN %s AS o ON o.destination = $1 AND o.message_id = k.id`
	// dedupPage pages a consumer's dedup rows of a window over the index
	// (consumer COLLATE "C", processed_at): the COLLATE "C" is what makes
	// the planner take it.
	dedupPage = `SELECT message_id, processed_at FROM %s
WHERE consumer COLLATE "C" = $1 AND processed_at >= $2 AND processed_at < $3
  AND processed_at >= $4 AND (processed_at > $4 OR message_id COLLATE "C" > $5)
ORDER BY processed_at, message_id COLLATE "C"
LIMIT $6`
	// dedupIDs counts a consumer's dedup rows of message ids (distinct),
	// by the primary key (consumer, message_id), one probe per id.
	dedupIDs = `SELECT d.message_id, count(*) FROM unnest($2::text[]) AS k(id)
JOIN %s AS d ON d.consumer = $1 AND d.message_id = k.id
GROUP BY d.message_id`
	// horizon is a consumer's purge horizon (processed.Store.Purge
	// records it): its rows processed before it may be gone.
	horizon = `SELECT purge_before FROM %s WHERE consumer = $1`
	// planSettings begin every transaction: each query has an index path
	// (a lookup: a nested loop probing the index once per id), and the
	// planner must take it whatever the statistics say. On a table of
	// 100,000 rows it would rather hash a third of the table than probe
	// it 1,000 times, and a table grows between two ANALYZEs; a page must
	// cost the same, bounded by the page size, on any table. A page reads
	// the index in its order and stops at the page's end, where a bitmap
	// scan would read the rest of the window each time.
	planSettings = `SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off`
)

// database is a Database being read.
type database struct {
	Database
	// horizons hold the table of the dedup table's purge horizons, if it
	// exists; oldestSent the outbox's oldest sent row (zero if none or
	// not read).
	horizons   *Table
	oldestSent time.Time
}

// run is one Run.
type run struct {
	cfg  Config
	dbs  map[string]*database
	rep  *Report
	now  time.Time
	end  time.Time
	dead map[string]map[string]bool
	// twice holds the ids already reported applied twice, by consumer.
	twice map[string]map[string]bool
	// windows are the checks' windows that start after Since.
	windows []*Window
}

// Run checks cfg's flows and forwards over the window and returns the
// report. It returns an error, and no report, if cfg is invalid (a
// *consumer.ConfigError) or a database cannot be read; discrepancies are
// in the report, not an error.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	nowFn := cfg.Now
	if nowFn == nil {
		nowFn = time.Now
	}
	now := nowFn()
	cfg = cfg.withDefaults(now)
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	end := cfg.Until
	if g := now.Add(-cfg.Grace); g.Before(end) {
		end = g
	}
	if !cfg.Since.Before(end) {
		return nil, configError("Since", "%s is not before now minus Grace (%s): nothing in the window is old enough to judge", cfg.Since.UTC().Format(time.RFC3339), cfg.Grace)
	}
	r := &run{cfg: cfg, dbs: map[string]*database{}, now: now, end: end,
		dead: map[string]map[string]bool{}, twice: map[string]map[string]bool{},
		rep: &Report{CheckedAt: now.UTC(), Since: cfg.Since.UTC(), Until: cfg.Until.UTC(), End: end.UTC(),
			GraceSeconds: cfg.Grace.Seconds(), PageSize: cfg.PageSize,
			Flows: []string{}, Forwards: []string{}, Windows: []Window{}, Warnings: []string{}}}
	for _, f := range cfg.Flows {
		r.rep.Flows = append(r.rep.Flows, f.String())
	}
	for _, f := range cfg.Forwards {
		r.rep.Forwards = append(r.rep.Forwards, f.String())
	}
	for name, ids := range cfg.DeadLettered {
		r.dead[name] = map[string]bool{}
		for _, id := range ids {
			r.dead[name][id] = true
		}
	}
	for _, k := range []*Kind{&r.rep.NeverApplied, &r.rep.AppliedTwice, &r.rep.StuckUnsent, &r.rep.UnknownOrigin, &r.rep.NotForwarded, &r.rep.DeadLettered} {
		k.Samples = []Sample{}
	}
	if err := r.prepare(ctx); err != nil {
		return nil, err
	}
	if err := r.sent(ctx); err != nil {
		return nil, err
	}
	if err := r.dedup(ctx); err != nil {
		return nil, err
	}
	if err := r.pending(ctx); err != nil {
		return nil, err
	}
	r.finish()
	return r.rep, nil
}

// read runs fn in a READ ONLY transaction on d, and rolls it back.
func (r *run) read(ctx context.Context, d *database, iso pgx.TxIsoLevel, fn func(pgx.Tx) error) error {
	tx, err := d.DB.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly, IsoLevel: iso})
	if err != nil {
		return fmt.Errorf("reconcile: database %s: begin a read-only transaction: %w", d.Name, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, planSettings); err != nil {
		return fmt.Errorf("reconcile: database %s: %s: %w", d.Name, planSettings, err)
	}
	return fn(tx)
}

// roles returns which databases are read as producers (their outbox) and
// as consumers' (their dedup table).
func (r *run) roles() (outboxes, dedups map[string]bool) {
	outboxes, dedups = map[string]bool{}, map[string]bool{}
	for _, f := range r.cfg.Flows {
		outboxes[f.Producer] = true
		for _, d := range f.ConsumerDatabases {
			dedups[d] = true
		}
	}
	for _, f := range r.cfg.Forwards {
		for _, d := range f.ConsumerDatabases {
			dedups[d] = true
		}
		for _, d := range f.OutboxDatabases {
			outboxes[d] = true
		}
	}
	return outboxes, dedups
}

// prepare resolves the tables' schemas, checks that they exist, and reads
// the horizons: each outbox's oldest sent row, and whether the dedup
// table has a table of purge horizons.
func (r *run) prepare(ctx context.Context) error {
	outboxes, dedups := r.roles()
	for _, cd := range r.cfg.Databases {
		d := &database{Database: cd}
		r.dbs[d.Name] = d
		err := r.read(ctx, d, pgx.ReadCommitted, func(tx pgx.Tx) error {
			var current *string
			if err := tx.QueryRow(ctx, `SELECT current_schema()`).Scan(&current); err != nil {
				return err
			}
			for _, t := range []*Table{&d.Outbox, &d.Dedup} {
				if t.Schema != "" {
					continue
				}
				if current == nil {
					return fmt.Errorf("the table %s: the connection's search_path names no existing schema: give its schema", t.Name)
				}
				t.Schema = *current
			}
			exists := func(t Table) (bool, error) {
				var ok bool
				err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.quoted()).Scan(&ok)
				return ok, err
			}
			if outboxes[d.Name] {
				ok, err := exists(d.Outbox)
				if err != nil {
					return err
				}
				if !ok {
					return fmt.Errorf("the outbox table %s does not exist: %w", d.Outbox, consumer.ErrNotMigrated)
				}
				if err := tx.QueryRow(ctx, fmt.Sprintf(oldestSent, d.Outbox.quoted())).Scan(&d.oldestSent); err != nil && !errors.Is(err, pgx.ErrNoRows) {
					return fmt.Errorf("read the oldest sent row of %s: %w", d.Outbox, err)
				}
			}
			if dedups[d.Name] {
				ok, err := exists(d.Dedup)
				if err != nil {
					return err
				}
				if !ok {
					return fmt.Errorf("the dedup table %s does not exist: %w", d.Dedup, consumer.ErrNotMigrated)
				}
				h := Table{Schema: d.Dedup.Schema, Name: d.Dedup.Name + "_horizons"}
				if ok, err := exists(h); err != nil {
					return err
				} else if ok {
					d.horizons = &h
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("reconcile: database %s: %w", d.Name, err)
		}
	}
	return nil
}

// purgeHorizon returns the latest purge horizon of consumer name in dbs,
// and the database that has it; zero if none recorded one.
func (r *run) purgeHorizon(ctx context.Context, name string, dbs []string) (time.Time, string, error) {
	var latest time.Time
	var where string
	for _, n := range dbs {
		d := r.dbs[n]
		if d.horizons == nil {
			continue
		}
		var t time.Time
		err := r.read(ctx, d, pgx.ReadCommitted, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, fmt.Sprintf(horizon, d.horizons.quoted()), name).Scan(&t)
		})
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			return latest, "", fmt.Errorf("reconcile: database %s: read the purge horizon of %q: %w", n, name, err)
		case t.After(latest):
			latest, where = t, n
		}
	}
	return latest, where, nil
}

// start returns the later of Since and h and, when h is later, the
// Window that says so, in which the pass counts the rows before it whose
// counterpart it did not find: a purge may have removed it, so they are
// not reported.
func (r *run) start(check, subject string, h time.Time, reason string) (time.Time, *Window) {
	if !h.After(r.cfg.Since) {
		return r.cfg.Since, nil
	}
	w := &Window{Check: check, Subject: subject, Start: h.UTC(), Reason: reason}
	r.windows = append(r.windows, w)
	return h, w
}

// skip counts a row before its check's window start.
func skip(w *Window) {
	if w != nil {
		w.Skipped++
	}
}

// finish fills in the report's windows, warnings and totals.
func (r *run) finish() {
	rep := r.rep
	for _, w := range r.windows {
		rep.Windows = append(rep.Windows, *w)
		if w.Skipped > 0 {
			rep.Warnings = append(rep.Warnings, fmt.Sprintf("%s of %s: %d rows of the window before %s lack their counterpart, which a purge may have removed, so they are not reported: %s; keep the window within both retentions",
				w.Check, w.Subject, w.Skipped, w.Start.Format(time.RFC3339), w.Reason))
		}
	}
	if rep.DeadLettered.Count == 0 && rep.NeverApplied.Count > 0 {
		rep.Warnings = append(rep.Warnings, DeadLetterNote)
	}
	rep.Discrepancies = rep.NeverApplied.Count + rep.AppliedTwice.Count + rep.StuckUnsent.Count + rep.UnknownOrigin.Count + rep.NotForwarded.Count
	rep.Clean = rep.Discrepancies == 0
}

func (r *run) sample(k *Kind, s Sample) {
	k.Count++
	if len(k.Samples) < r.cfg.SampleLimit {
		k.Samples = append(k.Samples, s)
	}
}

func (r *run) progress(phase, db string, rows int64) {
	if r.cfg.Progress != nil {
		r.cfg.Progress(Progress{Phase: phase, Database: db, Rows: rows})
	}
}

// sent finds, for each flow, the outbox rows sent in the window that no
// consumer database holds a dedup row of: one pass over each producer's
// sent rows.
func (r *run) sent(ctx context.Context) error {
	type flowStart struct {
		Flow
		start  time.Time
		window *Window
	}
	byProducer := map[string][]flowStart{}
	for _, f := range r.cfg.Flows {
		// A dedup row processed before the consumer's purge horizon may
		// be gone; its message was sent earlier still.
		h, where, err := r.purgeHorizon(ctx, f.Consumer, f.ConsumerDatabases)
		if err != nil {
			return err
		}
		s, w := r.start("never_applied", f.String(), h,
			fmt.Sprintf("consumer %q purges its dedup rows in %s before then", f.Consumer, where))
		byProducer[f.Producer] = append(byProducer[f.Producer], flowStart{f, s, w})
	}
	for _, name := range slices.Sorted(maps.Keys(byProducer)) {
		flows := byProducer[name]
		d := r.dbs[name]
		// From Since, to count the rows a later start skips.
		from := r.cfg.Since
		var dests []string
		for _, f := range flows {
			if !slices.Contains(dests, f.Destination) {
				dests = append(dests, f.Destination)
			}
		}
		q := fmt.Sprintf(sentPage, d.Outbox.quoted())
		curAt, curSeq := from, int64(math.MinInt64)
		var scanned int64
		for {
			type row struct {
				dest, id string
				at       time.Time
			}
			var page []row
			err := r.read(ctx, d, pgx.ReadCommitted, func(tx pgx.Tx) error {
				rows, err := tx.Query(ctx, q, from, r.end, curAt, curSeq, dests, r.cfg.PageSize)
				if err != nil {
					return err
				}
				var rw row
				var seq int64
				_, err = pgx.ForEachRow(rows, []any{&seq, &rw.dest, &rw.id, &rw.at}, func() error {
					page = append(page, rw)
					curAt, curSeq = rw.at, seq
					return nil
				})
				return err
			})
			if err != nil {
				return fmt.Errorf("reconcile: database %s: page the sent rows of %s: %w", name, d.Outbox, err)
			}
			scanned += int64(len(page))
			r.rep.Scanned.Sent += int64(len(page))
			for _, f := range flows {
				var ids []string
				at := map[string]time.Time{}
				for _, rw := range page {
					if rw.dest == f.Destination {
						ids = append(ids, rw.id)
						at[rw.id] = rw.at
					}
				}
				if len(ids) == 0 {
					continue
				}
				counts, err := r.dedupCounts(ctx, f.Consumer, f.ConsumerDatabases, ids)
				if err != nil {
					return err
				}
				for _, id := range ids {
					if total(counts[id]) > 0 {
						continue
					}
					if at[id].Before(f.start) {
						skip(f.window) // its dedup row may have been purged
						continue
					}
					s := Sample{MessageID: id, Consumer: f.Consumer, Destination: f.Destination, Database: name, At: at[id].UTC()}
					if r.dead[f.Consumer][id] {
						r.sample(&r.rep.DeadLettered, s)
					} else {
						r.sample(&r.rep.NeverApplied, s)
					}
				}
			}
			r.progress("sent", name, scanned)
			if len(page) < r.cfg.PageSize {
				break
			}
		}
	}
	return nil
}

func total(m map[string]int) int {
	n := 0
	for _, c := range m {
		n += c
	}
	return n
}

// dedupCounts counts the dedup rows of consumer name for ids in each of
// dbs: id -> database -> rows.
func (r *run) dedupCounts(ctx context.Context, name string, dbs []string, ids []string) (map[string]map[string]int, error) {
	out := map[string]map[string]int{}
	ids = distinct(ids)
	for _, n := range dbs {
		d := r.dbs[n]
		q := fmt.Sprintf(dedupIDs, d.Dedup.quoted())
		err := r.read(ctx, d, pgx.ReadCommitted, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, q, name, ids)
			if err != nil {
				return err
			}
			var id string
			var c int
			_, err = pgx.ForEachRow(rows, []any{&id, &c}, func() error {
				if out[id] == nil {
					out[id] = map[string]int{}
				}
				out[id][n] += c
				return nil
			})
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("reconcile: database %s: look up dedup rows of %q in %s: %w", n, name, d.Dedup, err)
		}
	}
	return out, nil
}

// outboxHas returns the ids among ids that the outbox of one of dbs holds
// for dest.
func (r *run) outboxHas(ctx context.Context, dbs []string, dest string, ids []string) (map[string]bool, error) {
	out := map[string]bool{}
	ids = distinct(ids)
	for _, n := range dbs {
		d := r.dbs[n]
		q := fmt.Sprintf(outboxIDs, d.Outbox.quoted())
		err := r.read(ctx, d, pgx.ReadCommitted, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, q, dest, ids)
			if err != nil {
				return err
			}
			var id string
			_, err = pgx.ForEachRow(rows, []any{&id}, func() error {
				out[id] = true
				return nil
			})
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("reconcile: database %s: look up outbox rows for %q in %s: %w", n, dest, d.Outbox, err)
		}
	}
	return out, nil
}

// consumerChecks is what the dedup pass checks for one consumer.
type consumerChecks struct {
	name string
	dbs  []string
	// flows feed the consumer: its rows' origin is in their producers'
	// outboxes, from originStart on.
	flows        []Flow
	originStart  time.Time
	originWindow *Window
	// forwards are its forwards, each from its own start.
	forwards  []Forward
	fwdStart  []time.Time
	fwdWindow []*Window
}

// consumers gathers the consumers of the flows and forwards, in order of
// name.
func (r *run) consumers() []*consumerChecks {
	by := map[string]*consumerChecks{}
	get := func(name string, dbs []string) *consumerChecks {
		c := by[name]
		if c == nil {
			c = &consumerChecks{name: name}
			by[name] = c
		}
		for _, d := range dbs {
			if !slices.Contains(c.dbs, d) {
				c.dbs = append(c.dbs, d)
			}
		}
		return c
	}
	for _, f := range r.cfg.Flows {
		c := get(f.Consumer, f.ConsumerDatabases)
		c.flows = append(c.flows, f)
	}
	for _, f := range r.cfg.Forwards {
		c := get(f.Consumer, f.ConsumerDatabases)
		c.forwards = append(c.forwards, f)
	}
	out := slices.Collect(maps.Values(by))
	slices.SortFunc(out, func(a, b *consumerChecks) int { return cmp.Compare(a.name, b.name) })
	for _, c := range out {
		slices.Sort(c.dbs)
	}
	return out
}

// dedup reads each consumer's dedup rows of the window, once per database,
// and checks each page: applied twice (in all the consumer's databases),
// unknown origin (the producers' outboxes), not forwarded (the forwards'
// outboxes).
func (r *run) dedup(ctx context.Context) error {
	for _, c := range r.consumers() {
		// A dedup row's message was sent before it was processed: if the
		// producer's outbox purged sent rows before its oldest, a row
		// processed shortly after may have lost its origin. Grace covers
		// the consumer's lag.
		var latest time.Time
		var reason string
		for _, f := range c.flows {
			if o := r.dbs[f.Producer].oldestSent; !o.IsZero() && o.Add(r.cfg.Grace).After(latest) {
				latest = o.Add(r.cfg.Grace)
				reason = fmt.Sprintf("the outbox %s of %s holds no sent row before %s (purged, or none was sent), plus the grace", r.dbs[f.Producer].Outbox, f.Producer, o.UTC().Format(time.RFC3339))
			}
		}
		if len(c.flows) > 0 {
			c.originStart, c.originWindow = r.start("unknown_origin", "consumer "+strconv.Quote(c.name), latest, reason)
		}
		for _, f := range c.forwards {
			var latest time.Time
			var reason string
			for _, n := range f.OutboxDatabases {
				if o := r.dbs[n].oldestSent; o.After(latest) {
					latest = o
					reason = fmt.Sprintf("the outbox %s of %s holds no sent row before then (purged, or none was sent)", r.dbs[n].Outbox, n)
				}
			}
			s, w := r.start("not_forwarded", f.String(), latest, reason)
			c.fwdStart, c.fwdWindow = append(c.fwdStart, s), append(c.fwdWindow, w)
		}
		for _, n := range c.dbs {
			if err := r.dedupDB(ctx, c, n); err != nil {
				return err
			}
		}
	}
	return nil
}

// dedupDB is the dedup pass of consumer c in its database name.
func (r *run) dedupDB(ctx context.Context, c *consumerChecks, name string) error {
	d := r.dbs[name]
	// The pass starts at the earliest start among the checks: applied
	// twice is checked from Since.
	from := r.cfg.Since
	q := fmt.Sprintf(dedupPage, d.Dedup.quoted())
	curAt, curID := from, ""
	var scanned int64
	for {
		type row struct {
			id string
			at time.Time
		}
		var page []row
		err := r.read(ctx, d, pgx.ReadCommitted, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, q, c.name, from, r.end, curAt, curID, r.cfg.PageSize)
			if err != nil {
				return err
			}
			var rw row
			_, err = pgx.ForEachRow(rows, []any{&rw.id, &rw.at}, func() error {
				page = append(page, rw)
				curAt, curID = rw.at, rw.id
				return nil
			})
			return err
		})
		if err != nil {
			return fmt.Errorf("reconcile: database %s: page the dedup rows of %q in %s: %w", name, c.name, d.Dedup, err)
		}
		scanned += int64(len(page))
		r.rep.Scanned.Dedup += int64(len(page))
		if len(page) > 0 {
			ids := make([]string, len(page))
			at := map[string]time.Time{}
			for i, rw := range page {
				ids[i] = rw.id
				at[rw.id] = rw.at
			}
			if err := r.checkTwice(ctx, c, name, ids, at); err != nil {
				return err
			}
			if err := r.checkOrigin(ctx, c, name, ids, at); err != nil {
				return err
			}
			for i, f := range c.forwards {
				if !slices.Contains(f.ConsumerDatabases, name) {
					continue
				}
				if err := r.checkForward(ctx, f, name, ids, at, c.fwdStart[i], c.fwdWindow[i]); err != nil {
					return err
				}
			}
		}
		r.progress("dedup", name, scanned)
		if len(page) < r.cfg.PageSize {
			return nil
		}
	}
}

// checkTwice counts the page's ids in every database of the consumer.
func (r *run) checkTwice(ctx context.Context, c *consumerChecks, name string, ids []string, at map[string]time.Time) error {
	counts, err := r.dedupCounts(ctx, c.name, c.dbs, ids)
	if err != nil {
		return err
	}
	for _, id := range ids {
		if total(counts[id]) <= 1 || r.twice[c.name][id] {
			continue
		}
		if r.twice[c.name] == nil {
			r.twice[c.name] = map[string]bool{}
		}
		r.twice[c.name][id] = true
		r.sample(&r.rep.AppliedTwice, Sample{MessageID: id, Consumer: c.name, Database: name, At: at[id].UTC(), Copies: counts[id]})
	}
	return nil
}

// checkOrigin looks the ids up in the outboxes of the flows feeding the
// consumer.
func (r *run) checkOrigin(ctx context.Context, c *consumerChecks, name string, ids []string, at map[string]time.Time) error {
	if len(c.flows) == 0 || len(ids) == 0 {
		return nil
	}
	found := map[string]bool{}
	for _, f := range c.flows {
		has, err := r.outboxHas(ctx, []string{f.Producer}, f.Destination, ids)
		if err != nil {
			return err
		}
		maps.Copy(found, has)
	}
	for _, id := range ids {
		switch {
		case found[id]:
		case at[id].Before(c.originStart):
			skip(c.originWindow) // its outbox row may have been purged
		default:
			r.sample(&r.rep.UnknownOrigin, Sample{MessageID: id, Consumer: c.name, Database: name, At: at[id].UTC()})
		}
	}
	return nil
}

// checkForward looks up, for each id, the outbox row of its child id.
func (r *run) checkForward(ctx context.Context, f Forward, name string, ids []string, at map[string]time.Time, start time.Time, w *Window) error {
	if len(ids) == 0 {
		return nil
	}
	child := make([]string, len(ids))
	for i, id := range ids {
		child[i] = keys.ChildKey(id, f.Step)
	}
	has, err := r.outboxHas(ctx, f.OutboxDatabases, f.Destination, child)
	if err != nil {
		return err
	}
	for i, id := range ids {
		switch {
		case has[child[i]]:
		case at[id].Before(start):
			skip(w) // its forwarded row may have been purged
		default:
			r.sample(&r.rep.NotForwarded, Sample{MessageID: id, Consumer: f.Consumer, Destination: f.Destination, Database: name, At: at[id].UTC(), ChildID: child[i]})
		}
	}
	return nil
}

// pending finds the outbox rows created more than Grace ago and still
// unsent, in every outbox read: one pass over each outbox's pending
// index, in one REPEATABLE READ transaction so that rows a relay leases
// meanwhile (which moves their next_attempt_at) are seen once.
func (r *run) pending(ctx context.Context) error {
	outboxes, _ := r.roles()
	stuckBefore := r.now.Add(-r.cfg.Grace)
	for _, name := range slices.Sorted(maps.Keys(outboxes)) {
		d := r.dbs[name]
		var scanned int64
		err := r.read(ctx, d, pgx.RepeatableRead, func(tx pgx.Tx) error {
			var (
				curAt  time.Time
				curSeq int64
				first  = true
			)
			for {
				var rows pgx.Rows
				var err error
				if first {
					rows, err = tx.Query(ctx, fmt.Sprintf(pendingFirst, d.Outbox.quoted()), r.cfg.PageSize)
				} else {
					rows, err = tx.Query(ctx, fmt.Sprintf(pendingPage, d.Outbox.quoted()), r.cfg.PageSize, curAt, curSeq)
				}
				if err != nil {
					return err
				}
				first = false
				var (
					n                int
					seq              int64
					due, created     time.Time
					dest, id, lastEr string
					attempts         int
				)
				_, err = pgx.ForEachRow(rows, []any{&seq, &due, &dest, &id, &created, &attempts, &lastEr}, func() error {
					n++
					curAt, curSeq = due, seq
					if created.Before(stuckBefore) {
						detail := fmt.Sprintf("seq %d, %d attempts", seq, attempts)
						if lastEr != "" {
							detail += ", last error: " + clip(lastEr, 200)
						}
						r.sample(&r.rep.StuckUnsent, Sample{MessageID: id, Destination: dest, Database: name, At: created.UTC(), Detail: detail})
					}
					return nil
				})
				if err != nil {
					return err
				}
				scanned += int64(n)
				r.rep.Scanned.Pending += int64(n)
				r.progress("pending", name, scanned)
				if n < r.cfg.PageSize {
					return nil
				}
			}
		})
		if err != nil {
			return fmt.Errorf("reconcile: database %s: page the unsent rows of %s: %w", name, d.Outbox, err)
		}
	}
	return nil
}

// distinct returns ids without repeats, in order.
func distinct(ids []string) []string {
	seen := make(map[string]bool, len(ids))
	out := make([]string, 0, len(ids))
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out
}

// clip shortens s to at most n runes.
func clip(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n]) + "…"
}

// safe quotes s if it holds a character that is not printable, so that a
// message id cannot move a terminal's cursor.
func safe(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) >= 0 {
		return strconv.Quote(s)
	}
	return s
}

func sortedKeys(m map[string]int) []string {
	return slices.Sorted(maps.Keys(m))
}
