package console

import (
	"context"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// seeded is a bundle whose database holds a day of activity, at a clock
// fixed by the test.
type seeded struct {
	*bundle
	now    time.Time
	hw, dw window
	// applied holds the times of the dedup rows inserted, by consumer.
	applied map[string][]time.Time
	mu      sync.Mutex
	queries []countRange
}

const evilConsumer = `<b>x</b>`

func newSeeded(t *testing.T) *seeded {
	t.Helper()
	b := newBundle(t)
	ctx := context.Background()
	s := &seeded{bundle: b, now: time.Now().UTC(), applied: map[string][]time.Time{}}
	s.hw, s.dw = windowsAt(s.now)
	b.srv.clock = func(context.Context) (time.Time, time.Time, error) { return s.now, s.now.Add(-settleMin), nil }
	b.srv.countHook = func(r countRange) {
		s.mu.Lock()
		s.queries = append(s.queries, r)
		s.mu.Unlock()
	}
	// Dedup rows: ledger in four minutes of the last hour (the open one
	// among them) and one hour earlier in the day; the evil consumer in
	// one minute.
	for _, r := range []struct {
		consumer string
		at       time.Time
		n        int
	}{
		{"ledger", s.hw.start.Add(20*time.Minute + 5*time.Second), 3},
		{"ledger", s.hw.start.Add(55*time.Minute + 5*time.Second), 7},
		{"ledger", s.now, 2},
		{"ledger", s.dw.start.Add(10*time.Hour + time.Minute), 11},
		{"ledger", s.dw.start.Add(2*time.Hour + time.Minute), 1},
		{evilConsumer, s.hw.start.Add(40 * time.Minute), 4},
	} {
		s.insertApplied(t, r.consumer, r.at, r.n)
	}
	// The janitor's reports: ledger, five minutes ago (nine duplicates of
	// up to 8s) and three hours ago (twenty, up to 50 minutes).
	bounds := dedup.AgeBounds()
	for _, r := range []struct {
		end   time.Time
		dups  int64
		maxMS int64
		fill  func([]int64)
	}{
		{s.now.Add(-5 * time.Minute), 9, 8000, func(b []int64) { b[0], b[1] = 5, 4 }},
		{s.now.Add(-3 * time.Hour), 20, 3_000_000, func(b []int64) { b[0], b[6] = 19, 1 }},
	} {
		buckets := make([]int64, len(bounds)+1)
		r.fill(buckets)
		ms := make([]int64, len(bounds))
		for i, d := range bounds {
			ms[i] = d.Milliseconds()
		}
		if _, err := b.pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{b.schema, "processed_messages_retention"}.Sanitize()+
			` (consumer, window_start, window_end, duplicates, max_ms, buckets, bucket_bounds_ms, retention_ms) VALUES ('ledger', $1, $2, $3, $4, $5, $6, 86400000)`,
			r.end.Add(-10*time.Minute), r.end, r.dups, r.maxMS, buckets, ms); err != nil {
			t.Fatal(err)
		}
	}
	// The outbox: besides newBundle's e1 (due since its enqueue, now),
	// three rows due for half an hour, two for five hours, one leased
	// (due in a minute) and one sent.
	ob := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	for i, r := range []struct {
		due  time.Time
		sent *time.Time
	}{
		{s.now.Add(-30 * time.Minute), nil}, {s.now.Add(-30 * time.Minute), nil}, {s.now.Add(-30 * time.Minute), nil},
		{s.now.Add(-5 * time.Hour), nil}, {s.now.Add(-5 * time.Hour), nil},
		{s.now.Add(time.Minute), nil},
		{s.now.Add(-10 * time.Minute), &s.now},
	} {
		if _, err := b.pool.Exec(ctx, `INSERT INTO `+ob+` (destination, message_id, body, next_attempt_at, sent_at) VALUES ('events', $1, '\x00', $2, $3)`,
			"seed-"+strconv.Itoa(i), r.due, r.sent); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

func (s *seeded) insertApplied(t *testing.T, name string, at time.Time, n int) {
	t.Helper()
	if _, err := s.pool.Exec(context.Background(), `INSERT INTO `+pgx.Identifier{s.schema, "processed_messages"}.Sanitize()+
		` (consumer, message_id, fingerprint, processed_at) SELECT $1, $1 || '-' || extract(epoch FROM $2::timestamptz)::text || '-' || i || '-' || md5(random()::text), sha256(''), $2::timestamptz FROM generate_series(1, $3) AS i`,
		name, at, n); err != nil {
		t.Fatal(err)
	}
	for range n {
		s.applied[name] = append(s.applied[name], at)
	}
}

// want is what a chart of w over consumers should count per bucket.
func (s *seeded) want(w window, consumers ...string) []int64 {
	out := make([]int64, w.n)
	for _, c := range consumers {
		for _, at := range s.applied[c] {
			if i := w.index(at); i >= 0 {
				out[i]++
			}
		}
	}
	return out
}

func (s *seeded) countQueries() []countRange {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.queries
	s.queries = nil
	return out
}

var (
	figureRE = regexp.MustCompile(`(?s)<figure class="chart" id="([a-z-]+)"(.*?)</figure>`)
	barRE    = regexp.MustCompile(`<g class="bar( open)?" data-count="(\d+)"`)
)

// charts parses a page's charts: each one's bar counts, and its markup.
func charts(t *testing.T, body string) (map[string][]int64, map[string]string) {
	t.Helper()
	counts, markup := map[string][]int64{}, map[string]string{}
	for _, m := range figureRE.FindAllStringSubmatch(body, -1) {
		var bars []int64
		for _, b := range barRE.FindAllStringSubmatch(m[2], -1) {
			n, _ := strconv.ParseInt(b[2], 10, 64)
			bars = append(bars, n)
		}
		counts[m[1]], markup[m[1]] = bars, m[2]
	}
	return counts, markup
}

func sum(xs []int64) int64 {
	var s int64
	for _, x := range xs {
		s += x
	}
	return s
}

func equalCounts(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestConsoleCharts: the overview draws applied messages (stacked by
// consumer), duplicates, dead letters by group and the outbox backlog,
// each over the last hour (60 buckets) and the last day (24), with the
// right count in every bucket.
func TestConsoleCharts(t *testing.T) {
	s := newSeeded(t)
	c := s.client()
	counts, markup := charts(t, c.mustGet("/"))
	for _, id := range []string{"applied", "duplicates", "dead-letters", "outbox"} {
		if n := len(counts[id+"-hour"]); n != hourBuckets {
			t.Errorf("%s-hour: %d bars, want %d", id, n, hourBuckets)
		}
		if n := len(counts[id+"-day"]); n != dayBuckets {
			t.Errorf("%s-day: %d bars, want %d", id, n, dayBuckets)
		}
	}
	if got, want := counts["applied-hour"], s.want(s.hw, "ledger", evilConsumer); !equalCounts(got, want) {
		t.Errorf("applied-hour %v, want %v", got, want)
	}
	if got, want := counts["applied-day"], s.want(s.dw, "ledger", evilConsumer); !equalCounts(got, want) {
		t.Errorf("applied-day %v, want %v", got, want)
	}
	// Stacked by consumer, the names escaped.
	must(t, markup["applied-hour"], `data-buckets="60"`, `data-total="16"`, `class="legend"`, "&lt;b&gt;x&lt;/b&gt;", `<g class="bar open" data-count="2"`)
	mustNot(t, markup["applied-hour"], evilConsumer)
	// Duplicates: nine in the last hour, 29 in the day, with their ages.
	if sum(counts["duplicates-hour"]) != 9 || sum(counts["duplicates-day"]) != 29 {
		t.Errorf("duplicates %v / %v", counts["duplicates-hour"], counts["duplicates-day"])
	}
	must(t, markup["duplicates-hour"], "p50 ≤ 1s · p99 ≤ 8s · max 8s")
	must(t, markup["duplicates-day"], "max 50m0s")
	// Dead letters: the six of the queue, a minute old, in four groups.
	if sum(counts["dead-letters-hour"]) != 6 || sum(counts["dead-letters-day"]) != 6 {
		t.Errorf("dead letters %v / %v", counts["dead-letters-hour"], counts["dead-letters-day"])
	}
	if n := strings.Count(markup["dead-letters-hour"], `<li><span class="swatch`); n != 4 {
		t.Errorf("dead letters: %d groups in the legend, want 4", n)
	}
	must(t, markup["dead-letters-hour"], "permanent: charge &#34;&lt;id&gt;&#34; failed: card &lt;n&gt; declined")
	mustNot(t, markup["dead-letters-hour"], "Sample truncated")
	// The outbox: e1 and three due in the last hour, two more in the
	// day; the leased one not yet due, the sent one nowhere.
	if sum(counts["outbox-hour"]) != 4 || sum(counts["outbox-day"]) != 6 {
		t.Errorf("outbox %v / %v", counts["outbox-hour"], counts["outbox-day"])
	}
	must(t, markup["outbox-hour"], "backing off): 1.", "Due before this window: about 2")
	// Every chart says what it is, in which unit, over which time.
	for id, m := range markup {
		must(t, m, `role="img"`, `<title id="`+id+`-title">`, `<desc id="`+id+`-desc">`, `class="unit"`, "time (UTC)")
	}
}

// TestConsoleChartsCache: a second page load counts only the buckets
// that had not closed at the first; a row added since to a closed bucket
// is not seen (the count kept is used), one in the open bucket is.
func TestConsoleChartsCache(t *testing.T) {
	s := newSeeded(t)
	c := s.client()
	first, _ := charts(t, c.mustGet("/"))
	q := s.countQueries()
	// The minutes from the window's start (or from the hour before, in
	// the minute after an hour ends), the hours from the day's.
	if len(q) != 2 || q[0].Step != time.Minute || q[0].From.After(s.hw.start) || !q[0].To.Equal(s.hw.end()) || q[1].Step != time.Hour || !q[1].From.Equal(s.dw.start) {
		t.Fatalf("first load's count queries: %+v", q)
	}
	s.insertApplied(t, "ledger", s.hw.start.Add(20*time.Minute), 100) // closed: not recounted
	s.insertApplied(t, "ledger", s.now, 5)                            // the open minute
	second, _ := charts(t, c.mustGet("/"))
	q = s.countQueries()
	closed := s.now.Add(-settleMin)
	if len(q) != 1 || q[0].Step != time.Minute || q[0].From.Before(closed.Truncate(time.Minute)) || !q[0].To.Equal(s.hw.end()) {
		t.Fatalf("second load's count queries: %+v, want one of the minutes from %v", q, closed.Truncate(time.Minute))
	}
	if second["applied-hour"][20] != first["applied-hour"][20] {
		t.Errorf("a closed minute was recounted: %d, then %d", first["applied-hour"][20], second["applied-hour"][20])
	}
	if second["applied-hour"][59] != first["applied-hour"][59]+5 {
		t.Errorf("the open minute: %d, then %d; want 5 more", first["applied-hour"][59], second["applied-hour"][59])
	}
	if last := dayBuckets - 1; second["applied-day"][last] != first["applied-day"][last]+5 {
		t.Errorf("the open hour: %d, then %d; want 5 more", first["applied-day"][last], second["applied-day"][last])
	}
	// The consumer's page shares the counts kept.
	c.mustGet("/consumer?name=ledger")
	if q := s.countQueries(); len(q) != 1 || q[0].Step != time.Minute {
		t.Errorf("the consumer page's count queries: %+v", q)
	}
}

// TestConsoleConsumerPage: a consumer's page draws its own charts; one
// without activity says there is no data; names are escaped.
func TestConsoleConsumerPage(t *testing.T) {
	s := newSeeded(t)
	c := s.client()
	counts, markup := charts(t, c.mustGet("/consumer?name=ledger"))
	if got, want := counts["applied-hour"], s.want(s.hw, "ledger"); !equalCounts(got, want) {
		t.Errorf("applied-hour %v, want %v", got, want)
	}
	if got, want := counts["applied-day"], s.want(s.dw, "ledger"); !equalCounts(got, want) {
		t.Errorf("applied-day %v, want %v", got, want)
	}
	mustNot(t, markup["applied-hour"], `class="legend"`) // one series
	if sum(counts["dead-letters-day"]) != 6 || sum(counts["duplicates-day"]) != 29 {
		t.Errorf("dead letters %v, duplicates %v", counts["dead-letters-day"], counts["duplicates-day"])
	}
	if _, ok := counts["outbox-hour"]; ok {
		t.Errorf("the outbox is not a consumer's")
	}

	body := c.mustGet("/consumer?name=nobody")
	counts, markup = charts(t, body)
	for _, id := range []string{"applied-hour", "applied-day", "duplicates-hour", "dead-letters-day"} {
		must(t, markup[id], `data-empty="true"`, "no data in the last ")
		if len(counts[id]) == 0 || sum(counts[id]) != 0 {
			t.Errorf("%s: bars %v, want zero-height bars", id, counts[id])
		}
	}
	must(t, markup["applied-hour"], `height="0" data-count="0"`)

	body = c.mustGet("/consumer?" + url.Values{"name": {evilConsumer}}.Encode())
	must(t, body, "<code>&lt;b&gt;x&lt;/b&gt;</code>")
	mustNot(t, body, evilConsumer)
	counts, _ = charts(t, body)
	if sum(counts["applied-hour"]) != 4 {
		t.Errorf("the evil consumer's applied %v", counts["applied-hour"])
	}
	if code, _, _ := c.get("/consumer"); code != 400 {
		t.Errorf("no name: %d", code)
	}
}

// TestConsoleChartsTruncatedSample: a queue read only up to the scan
// limit says so on the dead-letter chart.
func TestConsoleChartsTruncatedSample(t *testing.T) {
	b := newBundle(t, func(c *Config) { c.ScanLimit = 2 })
	_, markup := charts(t, b.client().mustGet("/"))
	must(t, markup["dead-letters-hour"], "Sample truncated: only the first 2 dead letters of memory:payments.dlq were read")
}

// TestConsoleChartsPartitioned: on the partitioned layout the applied
// charts count the rows of every generation, the current one, the older
// ones and a retired one not yet emptied, through their BRIN indexes on
// processed_at (migration gen/0002). Without those indexes they say why
// they are not drawn rather than read the generations whole.
func TestConsoleChartsPartitioned(t *testing.T) {
	ctx := context.Background()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	store := migratedStore(t, pool, processed.Config{Schema: schema, Partitioned: true})
	srv, err := New(Config{Store: store, DB: pool})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	now := time.Now().UTC()
	hw, dw := windowsAt(now)
	want := map[string][]int64{"hour": make([]int64, hw.n), "day": make([]int64, dw.n)}
	for i, r := range []struct {
		gen string
		at  time.Time
		n   int
	}{
		{"g0", hw.start.Add(50*time.Minute + 5*time.Second), 4},
		{"g0", now, 2},
		{"g1", hw.start.Add(10*time.Minute + 5*time.Second), 3},
		{"g2", dw.start.Add(5*time.Hour + time.Minute), 6},
		{"g3", dw.start.Add(time.Hour + time.Minute), 5},
	} {
		if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "processed_messages_" + r.gen}.Sanitize()+
			` (consumer, message_id, fingerprint, processed_at) SELECT 'ledger', 'm-' || $1::int || '-' || i, sha256(''), $2 FROM generate_series(1, $3) AS i`,
			i, r.at, r.n); err != nil {
			t.Fatal(err)
		}
		if j := hw.index(r.at); j >= 0 {
			want["hour"][j] += int64(r.n)
		}
		if j := dw.index(r.at); j >= 0 {
			want["day"][j] += int64(r.n)
		}
	}
	rows := srv.activity(ctx, []string{"ledger"}, now, now.Add(-settleMin))
	for name, c := range map[string]chartView{"hour": rows[0].Hour, "day": rows[0].Day} {
		if c.Err != "" || c.Unavailable != "" {
			t.Fatalf("applied-%s: %s%s", name, c.Err, c.Unavailable)
		}
		got := make([]int64, len(c.Counts))
		for i, b := range c.Counts {
			got[i] = sum(b)
		}
		if !equalCounts(got, want[name]) {
			t.Errorf("applied-%s: %v, want %v", name, got, want[name])
		}
	}

	// A table converted before migration gen/0002 has no such index.
	for _, g := range []string{"g0", "g1", "g2", "g3"} {
		if _, err := pool.Exec(ctx, `DROP INDEX `+pgx.Identifier{schema, "processed_messages_" + g + "_applied"}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	srv.counts = &countCache{m: map[countKey]int64{}}
	srv.countHook = func(r countRange) { t.Errorf("counted %+v", r) }
	rows = srv.activity(ctx, []string{"ledger"}, now, now.Add(-settleMin))
	if !strings.Contains(rows[0].Hour.Unavailable, "idemq migrate") || rows[0].Day.Unavailable == "" {
		t.Errorf("applied without the indexes: %+v", rows[0].Hour.chart)
	}
}

// TestSettled: buckets close a minute after their end, or later while an
// older transaction is open, but never more than settleMax late.
func TestSettled(t *testing.T) {
	now := chartStart
	at := func(d time.Duration) *time.Time { x := now.Add(d); return &x }
	for _, tc := range []struct {
		oldest *time.Time
		want   time.Time
	}{
		{nil, now.Add(-settleMin)},
		{at(-10 * time.Second), now.Add(-settleMin)},
		{at(-3 * time.Minute), now.Add(-3 * time.Minute)},
		{at(-time.Hour), now.Add(-settleMax)},
	} {
		if got := settled(now, tc.oldest); !got.Equal(tc.want) {
			t.Errorf("oldest %v: %v, want %v", tc.oldest, got, tc.want)
		}
	}
}

// TestConsoleChartsHourBoundary: in the minute after an hour ends, a fresh
// console counts that hour's minutes, and its next load sums them rather
// than recount the hour.
func TestConsoleChartsHourBoundary(t *testing.T) {
	s := newSeeded(t)
	s.now = time.Now().UTC().Truncate(time.Hour).Add(20 * time.Second)
	s.hw, s.dw = windowsAt(s.now)
	c := s.client()
	c.mustGet("/")
	q := s.countQueries()
	if len(q) != 2 || !q[0].From.Equal(s.now.Truncate(time.Hour).Add(-time.Hour)) {
		t.Fatalf("first load's count queries: %+v", q)
	}
	c.mustGet("/")
	if q := s.countQueries(); len(q) != 1 || q[0].Step != time.Minute {
		t.Fatalf("second load's count queries: %+v", q)
	}
}
