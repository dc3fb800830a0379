package console

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/pgmigrate"
)

// The charts of the overview and of a consumer's page, from what the
// database and the dead-letter queues already hold: each over the last
// hour (60 one-minute buckets) and the last day (24 one-hour buckets), the
// last bucket of each still open.
//
// Applied messages are counted from the dedup rows' processed_at through
// the index of migration 0005, (consumer COLLATE "C", processed_at): one
// range scan per window, never the table. A bucket that has closed does
// not change (a purge only lowers old buckets), so its count is kept in
// the console's memory and a page load recounts only the buckets still
// open or settling (see closedBefore). Duplicates come from the janitor's
// reports (a few rows per consumer and day, by their primary key), dead
// letters from the envelopes the overview already reads (bounded by
// Config.ScanLimit), the outbox backlog from the pending rows' partial
// index (next_attempt_at, seq) WHERE sent_at IS NULL; none of these is
// cached.

// Bucket counts of the two windows.
const (
	hourBuckets = 60 // one-minute buckets: the last hour
	dayBuckets  = 24 // one-hour buckets: the last day
)

// A bucket is closed, and its count kept, once every transaction that
// could still insert a row into it has ended. A dedup row's processed_at is
// its claim transaction's start (now()), so a bucket closes when the
// oldest transaction open on the database began after its end: at least
// settleMin after its end, at most settleMax (a transaction open longer,
// or one the console's role cannot see in pg_stat_activity beyond
// settleMin, is not waited for: its rows appear in the kept count at the
// console's next start).
const (
	settleMin = time.Minute
	settleMax = 10 * time.Minute
)

// window is the buckets of one chart: n of step from start, the last one
// holding now.
type window struct {
	start time.Time
	step  time.Duration
	n     int
	rng   string
}

func windowsAt(now time.Time) (hour, day window) {
	hour = window{start: now.Truncate(time.Minute).Add(-(hourBuckets - 1) * time.Minute), step: time.Minute, n: hourBuckets, rng: "last hour"}
	day = window{start: now.Truncate(time.Hour).Add(-(dayBuckets - 1) * time.Hour), step: time.Hour, n: dayBuckets, rng: "last day"}
	return hour, day
}

// end is the end of the window's last (open) bucket.
func (w window) end() time.Time { return w.start.Add(time.Duration(w.n) * w.step) }

// index is the bucket t falls in, or -1.
func (w window) index(t time.Time) int {
	if t.Before(w.start) || !t.Before(w.end()) {
		return -1
	}
	return int(t.Sub(w.start) / w.step)
}

func (w window) chart(id, title, unit, what string) chart {
	return chart{ID: id + "-" + strings.TrimPrefix(w.rng, "last "), Title: title, Range: w.rng, Unit: unit, What: what, Start: w.start, Step: w.step, Open: true}
}

// countKey names one closed bucket of one consumer's applied messages.
type countKey struct {
	consumer string
	step     time.Duration
	start    int64 // Unix seconds
}

// countCache keeps the counts of closed buckets.
type countCache struct {
	mu sync.Mutex
	m  map[countKey]int64
}

func (c *countCache) get(k countKey) (int64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.m[k]
	return v, ok
}

func (c *countCache) put(k countKey, v int64) {
	c.mu.Lock()
	c.m[k] = v
	c.mu.Unlock()
}

// prune forgets minutes before minutes and hours before hours.
func (c *countCache) prune(minutes, hours time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k := range c.m {
		if k.step == time.Minute && k.start < minutes.Unix() || k.step == time.Hour && k.start < hours.Unix() {
			delete(c.m, k)
		}
	}
}

// clock is the database's now and the time before which every bucket is
// closed.
type clock func(ctx context.Context) (now, closedBefore time.Time, err error)

// dbClock reads the database's clock, the one processed_at is written
// with, and the start of the oldest transaction of a client open on this
// database (other than its own), as far as the console's role may see.
// With shards, now is shard 0's, and a bucket is closed once it is on
// every shard.
func (s *Server) dbClock(ctx context.Context) (now, closedBefore time.Time, err error) {
	for i, sh := range s.shards {
		var (
			t      time.Time
			oldest *time.Time
		)
		err = sh.DB.QueryRow(ctx, `SELECT now(), (SELECT min(xact_start) FROM pg_stat_activity
	WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid())`).Scan(&t, &oldest)
		if err != nil {
			return now, now, s.onShard(i, fmt.Errorf("read the database's clock: %w", err))
		}
		if c := settled(t, oldest); i == 0 {
			now, closedBefore = t, c
		} else if c.Before(closedBefore) {
			closedBefore = c
		}
	}
	return now, closedBefore, nil
}

// settled is the time before which buckets are closed at now, with the
// oldest open transaction (nil: none).
func settled(now time.Time, oldest *time.Time) time.Time {
	closed := now.Add(-settleMin)
	if oldest != nil && oldest.Before(closed) {
		closed = later(*oldest, now.Add(-settleMax))
	}
	return closed
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// appliedSQL counts a few consumers' dedup rows per bucket of $4 seconds,
// from $2 to $3. consumer COLLATE "C" picks the index (consumer COLLATE
// "C", processed_at) of migration 0005: one range scan per consumer,
// bounded by the window.
func appliedSQL(table string) string {
	return `SELECT consumer, floor(extract(epoch FROM processed_at) / $4::bigint)::bigint AS bucket, count(*)
FROM ` + table + `
WHERE consumer COLLATE "C" = ANY($1::text[]) AND processed_at >= $2 AND processed_at < $3
GROUP BY 1, 2`
}

// retentionSQL reads the janitor's reports of a few consumers whose window
// ended from $2 to $3, by the primary key (consumer, window_end).
func retentionSQL(table string) string {
	return `SELECT consumer, window_end, duplicates, buckets, coalesce(max_ms, 0)
FROM ` + table + `
WHERE consumer = ANY($1::text[]) AND window_end >= $2 AND window_end < $3`
}

// backlogSQL counts the unsent outbox rows per minute they became due
// (next_attempt_at: their enqueue, or the end of a backoff or a lease) from
// $1 on; those due only at $2 or later (leased, or backing off) as bucket
// -1. It reads the pending rows' partial index, (next_attempt_at, seq)
// WHERE sent_at IS NULL, from $1 on.
func backlogSQL(table string) string {
	return `SELECT CASE WHEN next_attempt_at >= $2 THEN -1 ELSE floor(extract(epoch FROM next_attempt_at) / 60)::bigint END AS bucket, count(*)
FROM ` + table + `
WHERE sent_at IS NULL AND next_attempt_at >= $1
GROUP BY 1`
}

// countRange is one count query of applied messages, as the test hook sees
// it.
type countRange struct {
	Step     time.Duration
	From, To time.Time
}

// dedupTable returns the quoted dedup table of a shard (or the one
// database), or the reason the applied chart cannot count it by time: it
// does not exist, or it has the partitioned layout without the BRIN
// indexes on processed_at that migration gen/0002 gives each generation.
// The plain layout is counted through its (consumer, processed_at) index,
// the partitioned one through the view of its generations, each scanned
// by its BRIN index.
func dedupTable(ctx context.Context, sh Shard) (table, unavailable string, err error) {
	schema, name := sh.Store.Schema(), sh.Store.Table()
	table = pgx.Identifier{schema, name}.Sanitize()
	gens := make([]string, 4)
	for i := range gens {
		gens[i] = pgx.Identifier{schema, name + "_g" + strconv.Itoa(i)}.Sanitize()
	}
	var (
		kind    *string
		indexed int
	)
	if err := sh.DB.QueryRow(ctx, `SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)),
	(SELECT count(DISTINCT i.indrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am a ON a.oid = c.relam
	 WHERE a.amname = 'brin' AND i.indrelid = ANY(ARRAY(SELECT to_regclass(g) FROM unnest($2::text[]) AS g)))`,
		table, gens).Scan(&kind, &indexed); err != nil {
		return table, "", fmt.Errorf("read the dedup table's layout: %w", err)
	}
	switch {
	case kind == nil:
		return table, "Not drawn: the dedup table " + sh.Store.String() + " does not exist.", nil
	case *kind == "v" && indexed < len(gens):
		return table, "Not drawn: the dedup table " + sh.Store.String() + " has the partitioned layout, and its generations lack the indexes on processed_at (migration gen/0002) to count by time without reading them whole: run 'idemq migrate'.", nil
	}
	return table, "", nil
}

// applied counts names' applied messages per bucket of both windows:
// closed buckets from the cache, the others with one range scan per
// window's step and table (one a shard), from the first bucket not
// cached.
func (s *Server) applied(ctx context.Context, tables []string, names []string, hw, dw window, closed time.Time) (minutes, hours map[string][]int64, err error) {
	fresh := map[countKey]int64{} // this load's counts of open buckets
	get := func(k countKey) (int64, bool) {
		if v, ok := fresh[k]; ok {
			return v, true
		}
		return s.counts.get(k)
	}
	key := func(name string, step time.Duration, t time.Time) countKey {
		return countKey{consumer: name, step: step, start: t.Unix()}
	}
	count := func(step time.Duration, from, to time.Time) error {
		if s.countHook != nil {
			s.countHook(countRange{Step: step, From: from, To: to})
		}
		got := map[countKey]int64{}
		for i, sh := range s.shards {
			rows, err := sh.DB.Query(ctx, appliedSQL(tables[i]), names, from, to, int64(step/time.Second))
			if err != nil {
				return s.onShard(i, fmt.Errorf("count applied messages: %w", err))
			}
			var (
				name   string
				bucket int64
				n      int64
			)
			if _, err := pgx.ForEachRow(rows, []any{&name, &bucket, &n}, func() error {
				got[countKey{consumer: name, step: step, start: bucket * int64(step/time.Second)}] += n
				return nil
			}); err != nil {
				return s.onShard(i, fmt.Errorf("count applied messages: %w", err))
			}
		}
		for _, name := range names {
			for t := from; t.Before(to); t = t.Add(step) {
				k := key(name, step, t)
				if !t.Add(step).After(closed) {
					s.counts.put(k, got[k])
				} else {
					fresh[k] = got[k]
				}
			}
		}
		return nil
	}

	// Minutes: from the first one not cached, to now. While the hour
	// before this one has not closed, its minutes too, so that it is
	// summed from them rather than recounted whole at each load.
	first := hw.start
	if prev := hw.end().Add(-time.Minute).Truncate(time.Hour).Add(-time.Hour); prev.Add(time.Hour).After(closed) && prev.Before(first) {
		first = prev
	}
	var from time.Time
	for _, name := range names {
		for t := first; t.Before(hw.end()); t = t.Add(time.Minute) {
			if _, ok := s.counts.get(key(name, time.Minute, t)); !ok {
				if from.IsZero() || t.Before(from) {
					from = t
				}
				break
			}
		}
	}
	if !from.IsZero() {
		if err := count(time.Minute, from, hw.end()); err != nil {
			return nil, nil, err
		}
	}
	// Hours: cached, or the sum of their minutes (the open hour always
	// is), or counted, from the first hour that is neither.
	sum := func(name string, h time.Time) (int64, bool) {
		var total int64
		for t := h; t.Before(h.Add(time.Hour)) && t.Before(hw.end()); t = t.Add(time.Minute) {
			v, ok := get(key(name, time.Minute, t))
			if !ok {
				return 0, false
			}
			total += v
		}
		return total, true
	}
	var hFrom, hTo time.Time
	for _, name := range names {
		for i := range dw.n {
			h := dw.start.Add(time.Duration(i) * time.Hour)
			k := key(name, time.Hour, h)
			if _, ok := s.counts.get(k); ok {
				continue
			}
			if v, ok := sum(name, h); ok {
				if !h.Add(time.Hour).After(closed) {
					s.counts.put(k, v)
				} else {
					fresh[k] = v
				}
				continue
			}
			if hFrom.IsZero() || h.Before(hFrom) {
				hFrom = h
			}
			hTo = later(hTo, h.Add(time.Hour))
		}
	}
	if !hFrom.IsZero() {
		if err := count(time.Hour, hFrom, hTo); err != nil {
			return nil, nil, err
		}
	}
	minutes, hours = map[string][]int64{}, map[string][]int64{}
	for _, name := range names {
		minutes[name], hours[name] = make([]int64, hw.n), make([]int64, dw.n)
		for i := range hw.n {
			minutes[name][i], _ = get(key(name, time.Minute, hw.start.Add(time.Duration(i)*time.Minute)))
		}
		for i := range dw.n {
			hours[name][i], _ = get(key(name, time.Hour, dw.start.Add(time.Duration(i)*time.Hour)))
		}
	}
	// Minutes of the hour before the window's are kept, for summing it
	// once it closes.
	s.counts.prune(hw.start.Truncate(time.Hour).Add(-time.Hour), dw.start)
	return minutes, hours, nil
}

// duplicates are the janitor's reports in the two windows.
type duplicates struct {
	hour, day map[string][]int64 // duplicates per bucket and consumer
	// hourAges and dayAges sum the reports' age histograms.
	hourAges, dayAges dedup.RetentionReport
	reports           int
}

func (s *Server) duplicates(ctx context.Context, names []string, hw, dw window) (duplicates, error) {
	d := duplicates{hour: map[string][]int64{}, day: map[string][]int64{}}
	t := pgx.Identifier{s.cfg.Store.Schema(), s.cfg.Store.Table() + "_retention"}.Sanitize()
	rows, err := s.cfg.DB.Query(ctx, retentionSQL(t), names, dw.start, dw.end())
	if pgmigrate.IsUndefined(err) {
		return d, errNoRetentionTable
	}
	if err != nil {
		return d, fmt.Errorf("read the janitor's reports: %w", err)
	}
	var (
		name    string
		end     time.Time
		n, maxA int64
		buckets []int64
	)
	add := func(r *dedup.RetentionReport) {
		for len(r.Buckets) < len(buckets) {
			r.Buckets = append(r.Buckets, 0)
		}
		for i, b := range buckets {
			r.Buckets[i] += b
		}
		r.MaxAge = max(r.MaxAge, time.Duration(maxA)*time.Millisecond)
	}
	_, err = pgx.ForEachRow(rows, []any{&name, &end, &n, &buckets, &maxA}, func() error {
		d.reports++
		if i := dw.index(end); i >= 0 {
			series(d.day, name, dw.n)[i] += n
			add(&d.dayAges)
		}
		if i := hw.index(end); i >= 0 {
			series(d.hour, name, hw.n)[i] += n
			add(&d.hourAges)
		}
		return nil
	})
	if err != nil {
		return d, fmt.Errorf("read the janitor's reports: %w", err)
	}
	return d, nil
}

var errNoRetentionTable = errors.New("no janitor reports: the dedup table's _retention table does not exist (run 'idemq migrate')")

// series returns m[name], made n long if new.
func series(m map[string][]int64, name string, n int) []int64 {
	s, ok := m[name]
	if !ok {
		s = make([]int64, n)
		m[name] = s
	}
	return s
}

// ages says a summed age histogram in words.
func ages(r dedup.RetentionReport) string {
	var total int64
	for _, b := range r.Buckets {
		total += b
	}
	if total == 0 {
		return "No duplicate was skipped in this window."
	}
	return fmt.Sprintf("Their ages (how long after the original was applied): p50 ≤ %s · p99 ≤ %s · max %s.",
		age(r.Quantile(0.5)), age(r.Quantile(0.99)), age(r.MaxAge))
}

// deadLetterTimes records, while Inspect reads a queue, the time each
// dead letter it groups was dead-lettered (its envelope's last failure),
// by failure fingerprint.
type deadLetterTimes struct {
	times map[string][]time.Time
	// untimed counts dead letters without a failure time (no envelope).
	untimed int
	// truncated names the queues whose read stopped at Config.ScanLimit.
	truncated []string
}

func newDeadLetterTimes() *deadLetterTimes {
	return &deadLetterTimes{times: map[string][]time.Time{}}
}

// recordingBrowser is a browser that tells a deadLetterTimes each message
// the filter passes, as Inspect's grouping reads them.
type recordingBrowser struct {
	dlq.Browser
	filter dlq.Filter
	out    *deadLetterTimes
	n      int
}

func (b *recordingBrowser) Next(ctx context.Context) (consumer.Delivery, error) {
	d, err := b.Browser.Next(ctx)
	if err != nil {
		return d, err
	}
	if rec, perr := readRecord(d.Message()); perr == nil && b.filter.Match(rec) {
		b.n++
		if rec.LastFailure.IsZero() {
			b.out.untimed++
		} else {
			fp := rec.Entry.Fingerprint()
			b.out.times[fp] = append(b.out.times[fp], rec.LastFailure)
		}
	}
	return d, nil
}

// deadLetterCharts are the dead letters per bucket, stacked by group;
// errs are the queues that could not be read.
func deadLetterCharts(t *deadLetterTimes, groups []groupRow, errs []string, hw, dw window, scanLimit int) (hour, day chart) {
	hour = hw.chart("dead-letters", "Dead letters per minute, by group", "dead letters / minute", "dead letters")
	day = dw.chart("dead-letters", "Dead letters per hour, by group", "dead letters / hour", "dead letters")
	names := map[string]string{}
	for _, g := range groups {
		names[g.Fingerprint] = string(g.Class) + ": " + g.Pattern
	}
	byHour, byDay := map[string][]int64{}, map[string][]int64{}
	var before, after int
	for fp, ts := range t.times {
		name := names[fp]
		if name == "" {
			name = fp
		}
		for _, ts := range ts {
			switch {
			case ts.Before(dw.start):
				before++
			case !ts.Before(dw.end()):
				after++
			}
			if i := dw.index(ts); i >= 0 {
				series(byDay, name, dw.n)[i]++
			}
			if i := hw.index(ts); i >= 0 {
				series(byHour, name, hw.n)[i]++
			}
		}
	}
	hour.Series, hour.Counts, hour.Other = stack(byHour, hw.n)
	day.Series, day.Counts, day.Other = stack(byDay, dw.n)
	var notes []string
	if len(t.truncated) > 0 {
		notes = append(notes, fmt.Sprintf("Sample truncated: only the first %d dead letters of %s were read (the console's scan limit); the bars count those.", scanLimit, strings.Join(t.truncated, ", ")))
	}
	if before > 0 {
		notes = append(notes, fmt.Sprintf("%d dead-lettered before the last day, not drawn.", before))
	}
	if after > 0 {
		notes = append(notes, fmt.Sprintf("%d dated after now (a worker's clock ahead), not drawn.", after))
	}
	if t.untimed > 0 {
		notes = append(notes, fmt.Sprintf("%d without an envelope (no failure time), not drawn.", t.untimed))
	}
	if len(errs) > 0 {
		notes = append(notes, "Not drawn, the queues that could not be read: "+strings.Join(errs, "; "))
	}
	hour.Notes, day.Notes = notes, notes
	return hour, day
}

// chartPair is one row of charts: the last hour and the last day.
type chartPair struct{ Hour, Day chartView }

func pair(h, d chart) chartPair { return chartPair{Hour: draw(h), Day: draw(d)} }

// activity builds the dedup charts of names: applied messages and
// duplicates skipped. With stacked, each chart stacks its consumers.
func (s *Server) activity(ctx context.Context, names []string, now, closed time.Time) []chartPair {
	hw, dw := windowsAt(now)
	ah := hw.chart("applied", "Applied messages per minute", "messages / minute", "applied")
	ad := dw.chart("applied", "Applied messages per hour", "messages / hour", "applied")
	dh := hw.chart("duplicates", "Duplicates skipped", "duplicates / minute", "duplicates")
	dd := dw.chart("duplicates", "Duplicates skipped", "duplicates / hour", "duplicates")
	fill := func(c *chart, byName map[string][]int64, n int) {
		if c.Err != "" || c.Unavailable != "" {
			return
		}
		full := map[string][]int64{}
		for _, name := range names {
			full[name] = series(byName, name, n)
		}
		c.Series, c.Counts, c.Other = stack(full, n)
	}
	var (
		tables   []string
		why      string
		tableErr error
	)
	for i, sh := range s.shards {
		t, w, err := dedupTable(ctx, sh)
		tables = append(tables, t)
		if err != nil && tableErr == nil {
			tableErr = s.onShard(i, err)
		}
		if w != "" && why == "" {
			why = w
			if len(s.cfg.Shards) > 0 {
				why = fmt.Sprintf("Shard %d: %s", i, w)
			}
		}
	}
	switch err := tableErr; {
	case err != nil:
		ah.Err, ad.Err = s.clean(err), s.clean(err)
	case why != "":
		ah.Unavailable, ad.Unavailable = why, why
	case len(names) > 0:
		minutes, hours, err := s.applied(ctx, tables, names, hw, dw, closed)
		if err != nil {
			ah.Err, ad.Err = s.clean(err), s.clean(err)
		}
		fill(&ah, minutes, hw.n)
		fill(&ad, hours, dw.n)
	default:
		fill(&ah, nil, hw.n)
		fill(&ad, nil, dw.n)
	}
	if len(names) > 0 {
		d, err := s.duplicates(ctx, names, hw, dw)
		switch {
		case errors.Is(err, errNoRetentionTable):
			dh.Unavailable, dd.Unavailable = err.Error(), err.Error()
		case err != nil:
			dh.Err, dd.Err = s.clean(err), s.clean(err)
		}
		fill(&dh, d.hour, hw.n)
		fill(&dd, d.day, dw.n)
		if err == nil {
			note := "From the janitor's reports (one per consumer and JanitorInterval, 10 minutes by default), each counted in the bucket its window ends in. "
			dh.Notes, dd.Notes = []string{note + ages(d.hourAges)}, []string{note + ages(d.dayAges)}
			if d.reports == 0 {
				none := "No report: no janitor runs for these consumers (consumer.Config.Retention unset), or none reported in the last day."
				dh.Notes, dd.Notes = append(dh.Notes, none), append(dd.Notes, none)
			}
		}
	} else {
		fill(&dh, nil, hw.n)
		fill(&dd, nil, dw.n)
	}
	return []chartPair{pair(ah, ad), pair(dh, dd)}
}

// backlog is the outbox chart: unsent rows by when they became due.
func (s *Server) backlog(ctx context.Context, t Table, pending int64, now time.Time) chartPair {
	hw, dw := windowsAt(now)
	title := "Outbox backlog: unsent rows by when they became due"
	h := hw.chart("outbox", title, "unsent rows / minute due", "unsent rows")
	d := dw.chart("outbox", title, "unsent rows / hour due", "unsent rows")
	h.Counts, d.Counts = zeros(hw.n), zeros(dw.n)
	rows, err := s.cfg.DB.Query(ctx, backlogSQL(pgx.Identifier{t.Schema, t.Name}.Sanitize()), dw.start, now)
	var notDue, inDay, inHour int64
	if err == nil {
		var bucket, n int64
		_, err = pgx.ForEachRow(rows, []any{&bucket, &n}, func() error {
			if bucket < 0 {
				notDue += n
				return nil
			}
			at := time.Unix(bucket*60, 0)
			if i := dw.index(at); i >= 0 {
				d.Counts[i][0] += n
				inDay += n
			}
			if i := hw.index(at); i >= 0 {
				h.Counts[i][0] += n
				inHour += n
			}
			return nil
		})
	}
	if err != nil {
		err = fmt.Errorf("count the outbox backlog: %w", err)
		h.Err, d.Err = s.clean(err), s.clean(err)
		return pair(h, d)
	}
	h.Series, d.Series = []string{"unsent"}, []string{"unsent"}
	due := "Due since: a row is due from its enqueue, or from the end of its last backoff. "
	notes := func(in int64) []string {
		out := []string{due + fmt.Sprintf("Not yet due (leased to a relay now, or backing off): %d.", notDue)}
		if earlier := pending - in - notDue; earlier > 0 {
			out = append(out, fmt.Sprintf("Due before this window: about %d (the pending count above, less those drawn and those not yet due).", earlier))
		}
		return out
	}
	h.Notes, d.Notes = notes(inHour), notes(inDay)
	return pair(h, d)
}

func zeros(n int) [][]int64 {
	out := make([][]int64, n)
	for i := range out {
		out[i] = make([]int64, 1)
	}
	return out
}

// sorted returns names sorted, each once.
func sorted(names []string) []string {
	out := slices.Clone(names)
	sort.Strings(out)
	return slices.Compact(out)
}
