package reconcile

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/keys"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}

const step = "ledger-entry-recorded/v1"

// service is one service's schema in the test database.
type service struct {
	t      *testing.T
	pool   *pgxpool.Pool
	schema string
}

// newService makes a fresh schema with an outbox and a dedup table, made
// by the packages' own migrations.
func newService(t *testing.T) *service {
	t.Helper()
	ctx := context.Background()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	ob, err := outbox.New(pool, outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return &service{t: t, pool: pool, schema: schema}
}

func (s *service) exec(sql string, args ...any) {
	s.t.Helper()
	if _, err := s.pool.Exec(context.Background(), sql, args...); err != nil {
		s.t.Fatalf("%s: %v", sql, err)
	}
}

func (s *service) table(name string) string { return pgx.Identifier{s.schema, name}.Sanitize() }

// sent writes an outbox row for dest, created a second before sentAt and
// sent then; a zero sentAt leaves it unsent, created at created.
func (s *service) outboxRow(dest, id string, created time.Time, sentAt *time.Time) {
	s.t.Helper()
	s.exec(`INSERT INTO `+s.table("outbox")+` (destination, message_id, body, created_at, next_attempt_at, sent_at, attempts) VALUES ($1, $2, '\x7b7d', $3, $3, $4, CASE WHEN $4::timestamptz IS NULL THEN 0 ELSE 1 END)`,
		dest, id, created, sentAt)
}

func (s *service) sent(dest, id string, at time.Time) {
	s.t.Helper()
	s.outboxRow(dest, id, at.Add(-time.Second), &at)
}

func (s *service) applied(consumerName, id string, at time.Time) {
	s.t.Helper()
	s.exec(`INSERT INTO `+s.table("processed_messages")+` (consumer, message_id, fingerprint, processed_at) VALUES ($1, $2, $3, $4)`,
		consumerName, id, make([]byte, 32), at)
}

// chain is the three services of examples/chain: payments publishes to
// chain.charges, ledger applies and forwards to chain.ledger, notify
// applies.
type chain struct {
	payments, ledger, notify *service
	now                      time.Time
}

func newChain(t *testing.T) *chain {
	return &chain{payments: newService(t), ledger: newService(t), notify: newService(t), now: time.Now()}
}

// key runs one key through the whole chain, its charge sent at at.
func (c *chain) key(id string, at time.Time) {
	c.payments.sent("chain.charges", id, at)
	c.ledger.applied("ledger", id, at.Add(time.Second))
	child := keys.ChildKey(id, step)
	c.ledger.outboxRow("chain.ledger", child, at.Add(time.Second), ptr(at.Add(2*time.Second)))
	c.notify.applied("notify", child, at.Add(3*time.Second))
}

// history gives each outbox a row sent long before the window, as a
// system that has run for a while has: otherwise the checks of a dedup
// row's origin and forward start at the outboxes' first sent row.
func (c *chain) history() *chain {
	c.payments.sent("old", "old-1", c.now.Add(-10*time.Hour))
	c.ledger.sent("old", "old-1", c.now.Add(-10*time.Hour))
	return c
}

func ptr[T any](v T) *T { return &v }

func (c *chain) config() Config {
	p := c.payments.pool
	return Config{
		Databases: []Database{
			{Name: "payments", DB: p, Outbox: Table{Schema: c.payments.schema}, Dedup: Table{Schema: c.payments.schema}},
			{Name: "ledger", DB: p, Outbox: Table{Schema: c.ledger.schema}, Dedup: Table{Schema: c.ledger.schema}},
			{Name: "notify", DB: p, Outbox: Table{Schema: c.notify.schema}, Dedup: Table{Schema: c.notify.schema}},
		},
		Flows: []Flow{
			{Producer: "payments", Destination: "chain.charges", Consumer: "ledger", ConsumerDatabases: []string{"ledger"}},
			{Producer: "ledger", Destination: "chain.ledger", Consumer: "notify", ConsumerDatabases: []string{"notify"}},
		},
		Forwards:    []Forward{{Consumer: "ledger", ConsumerDatabases: []string{"ledger"}, OutboxDatabases: []string{"ledger"}, Destination: "chain.ledger", Step: step}},
		Since:       c.now.Add(-6 * time.Hour),
		SampleLimit: 100,
		Now:         func() time.Time { return c.now },
	}
}

func mustRun(t *testing.T, cfg Config) *Report {
	t.Helper()
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func ids(k Kind) []string {
	var out []string
	for _, s := range k.Samples {
		out = append(out, s.MessageID)
	}
	slices.Sort(out)
	return out
}

// wantKind checks a kind's count and its samples' ids (all of them: the
// tests keep fewer than SampleLimit).
func wantKind(t *testing.T, name string, k Kind, want ...string) {
	t.Helper()
	slices.Sort(want)
	if k.Count != int64(len(want)) || !slices.Equal(ids(k), want) {
		t.Errorf("%s: count %d, ids %q; want %d, %q", name, k.Count, ids(k), len(want), want)
	}
}

func TestCleanChain(t *testing.T) {
	t.Parallel()
	c := newChain(t).history()
	for i := range 20 {
		c.key(fmt.Sprintf("charge-%02d", i), c.now.Add(-time.Hour+time.Duration(i)*time.Minute))
	}
	rep := mustRun(t, c.config())
	if !rep.Clean || rep.Discrepancies != 0 {
		var b strings.Builder
		_ = rep.WriteText(&b)
		t.Fatalf("a clean chain is not reported clean:\n%s", b.String())
	}
	for _, k := range rep.Kinds() {
		wantKind(t, k.Key, k.Kind)
	}
	if rep.Scanned != (Scanned{Sent: 40, Dedup: 40, Pending: 0}) {
		t.Errorf("scanned %+v, want 40 sent rows (20 per outbox) and 40 dedup rows", rep.Scanned)
	}
	if len(rep.Windows) != 0 || len(rep.Warnings) != 0 {
		t.Errorf("windows %+v, warnings %q", rep.Windows, rep.Warnings)
	}
}

func TestEachDiscrepancy(t *testing.T) {
	t.Parallel()
	c := newChain(t).history()
	at := c.now.Add(-time.Hour)
	for i := range 5 {
		c.key(fmt.Sprintf("ok-%d", i), at.Add(time.Duration(i)*time.Second))
	}
	// Published, never applied: sent half an hour ago, no dedup row.
	c.payments.sent("chain.charges", "lost-1", c.now.Add(-30*time.Minute))
	// Published a minute ago: in flight, within the grace.
	c.payments.sent("chain.charges", "inflight-1", c.now.Add(-time.Minute))
	// Published, dead-lettered: listed in DeadLettered.
	c.payments.sent("chain.charges", "dead-1", c.now.Add(-20*time.Minute))
	// Stuck unsent: created an hour ago; a young one is not stuck.
	c.payments.outboxRow("chain.charges", "stuck-1", c.now.Add(-time.Hour), nil)
	c.payments.outboxRow("chain.charges", "young-1", c.now.Add(-time.Minute), nil)
	// Unknown origin: a ledger dedup row whose id no payments outbox
	// row has (forwarded and notified, so only its origin is wrong).
	c.ledger.applied("ledger", "ghost-1", at)
	c.ledger.sent("chain.ledger", keys.ChildKey("ghost-1", step), at.Add(time.Second))
	c.notify.applied("notify", keys.ChildKey("ghost-1", step), at.Add(2*time.Second))
	// Applied, not forwarded: charged and applied, no ledger outbox row.
	c.payments.sent("chain.charges", "noforward-1", at)
	c.ledger.applied("ledger", "noforward-1", at.Add(time.Second))
	// Another destination of the same outbox is not this flow's.
	c.payments.sent("elsewhere", "other-1", at)
	// Dead rows outside the window are not reported.
	c.payments.sent("chain.charges", "old-lost", c.now.Add(-7*time.Hour))
	c.ledger.applied("ledger", "old-ghost", c.now.Add(-7*time.Hour))

	cfg := c.config()
	cfg.DeadLettered = map[string][]string{"ledger": {"dead-1"}}
	rep := mustRun(t, cfg)
	wantKind(t, "never_applied", rep.NeverApplied, "lost-1")
	wantKind(t, "dead_lettered", rep.DeadLettered, "dead-1")
	wantKind(t, "stuck_unsent", rep.StuckUnsent, "stuck-1")
	wantKind(t, "unknown_origin", rep.UnknownOrigin, "ghost-1")
	wantKind(t, "not_forwarded", rep.NotForwarded, "noforward-1")
	wantKind(t, "applied_twice", rep.AppliedTwice)
	if rep.Clean || rep.Discrepancies != 4 {
		t.Errorf("clean %v, %d discrepancies; want 4", rep.Clean, rep.Discrepancies)
	}
	s := rep.NeverApplied.Samples[0]
	if s.Consumer != "ledger" || s.Destination != "chain.charges" || s.Database != "payments" || !s.At.Equal(c.now.Add(-30*time.Minute).Truncate(time.Microsecond)) {
		t.Errorf("never applied sample %+v", s)
	}
	if s := rep.NotForwarded.Samples[0]; s.ChildID != keys.ChildKey("noforward-1", step) || s.Database != "ledger" || s.Destination != "chain.ledger" {
		t.Errorf("not forwarded sample %+v", s)
	}
	if s := rep.StuckUnsent.Samples[0]; s.Database != "payments" || s.Destination != "chain.charges" || !strings.Contains(s.Detail, "0 attempts") {
		t.Errorf("stuck sample %+v", s)
	}

	// Without the dead letters, dead-1 is never applied, and the report
	// says where dead letters go.
	cfg.DeadLettered = nil
	rep = mustRun(t, cfg)
	wantKind(t, "never_applied", rep.NeverApplied, "lost-1", "dead-1")
	if !slices.Contains(rep.Warnings, DeadLetterNote) {
		t.Errorf("warnings %q lack the dead-letter note", rep.Warnings)
	}
	var b strings.Builder
	if err := rep.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"5 DISCREPANCIES", "published, never applied            2", "lost-1  consumer ledger  destination chain.charges  in payments",
		"idemq dlq inspect", "stuck-1", "(seq "} {
		if !strings.Contains(b.String(), w) {
			t.Errorf("summary lacks %q:\n%s", w, b.String())
		}
	}
}

// TestAppliedTwiceAcrossShards: a consumer sharded over two databases,
// one id applied in both, is reported once; with the grace, an id only in
// one is not.
func TestAppliedTwiceAcrossShards(t *testing.T) {
	t.Parallel()
	p, s1, s2 := newService(t), newService(t), newService(t)
	now := time.Now()
	at := now.Add(-time.Hour)
	for i := range 10 {
		id := fmt.Sprintf("m-%d", i)
		p.sent("orders", id, at)
		shard := s1
		if i%2 == 1 {
			shard = s2
		}
		shard.applied("billing", id, at.Add(time.Second))
	}
	s2.applied("billing", "m-4", at.Add(time.Minute)) // also in s1
	// Another consumer's row of the same id is not a copy.
	s2.applied("shipping", "m-2", at)
	cfg := Config{
		Databases: []Database{
			{Name: "orders", DB: p.pool, Outbox: Table{Schema: p.schema}},
			{Name: "s1", DB: s1.pool, Dedup: Table{Schema: s1.schema}},
			{Name: "s2", DB: s2.pool, Dedup: Table{Schema: s2.schema}},
		},
		Flows: []Flow{{Producer: "orders", Destination: "orders", Consumer: "billing", ConsumerDatabases: []string{"s1", "s2"}}},
		Now:   func() time.Time { return now },
	}
	rep := mustRun(t, cfg)
	wantKind(t, "applied_twice", rep.AppliedTwice, "m-4")
	if c := rep.AppliedTwice.Samples[0].Copies; c["s1"] != 1 || c["s2"] != 1 || len(c) != 2 {
		t.Errorf("copies %v", c)
	}
	wantKind(t, "never_applied", rep.NeverApplied)
	wantKind(t, "unknown_origin", rep.UnknownOrigin)
	if rep.Discrepancies != 1 {
		t.Errorf("%d discrepancies, want 1", rep.Discrepancies)
	}
}

// TestPaging runs 100 keys through pages of 7, with rows that share their
// timestamps across page boundaries, and every tenth key broken one way or
// another: each is reported once, and every row is read once.
func TestPaging(t *testing.T) {
	t.Parallel()
	c := newChain(t).history()
	base := c.now.Add(-2 * time.Hour).Truncate(time.Second)
	var lost, unforwarded []string
	for i := range 100 {
		id := fmt.Sprintf("k-%03d", i)
		at := base.Add(time.Duration(i/5) * time.Minute) // five keys per instant
		switch i % 10 {
		case 3:
			c.payments.sent("chain.charges", id, at)
			lost = append(lost, id)
		case 7:
			c.payments.sent("chain.charges", id, at)
			c.ledger.applied("ledger", id, at.Add(time.Second))
			unforwarded = append(unforwarded, id)
		default:
			c.key(id, at)
		}
	}
	for i := range 30 {
		c.payments.outboxRow("chain.charges", fmt.Sprintf("stuck-%02d", i), base, nil)
	}
	var progress []Progress
	cfg := c.config()
	cfg.PageSize = 7
	cfg.Progress = func(p Progress) { progress = append(progress, p) }
	rep := mustRun(t, cfg)
	wantKind(t, "never_applied", rep.NeverApplied, lost...)
	wantKind(t, "not_forwarded", rep.NotForwarded, unforwarded...)
	if rep.StuckUnsent.Count != 30 {
		t.Errorf("stuck %d, want 30", rep.StuckUnsent.Count)
	}
	wantKind(t, "unknown_origin", rep.UnknownOrigin)
	wantKind(t, "applied_twice", rep.AppliedTwice)
	// payments sent 100, ledger forwarded 80; ledger applied 90, notify 80.
	if rep.Scanned != (Scanned{Sent: 180, Dedup: 170, Pending: 30}) {
		t.Errorf("scanned %+v", rep.Scanned)
	}
	if len(progress) < 180/7 {
		t.Errorf("%d progress calls for pages of 7", len(progress))
	}

	// Samples are bounded; counts are not.
	cfg.SampleLimit = 3
	cfg.Progress = nil
	rep = mustRun(t, cfg)
	if rep.NeverApplied.Count != 10 || len(rep.NeverApplied.Samples) != 3 {
		t.Errorf("never applied: %d, %d samples", rep.NeverApplied.Count, len(rep.NeverApplied.Samples))
	}
}

// TestPurgeHorizons: a window older than what the tables keep starts
// later, with a warning, instead of reporting what a purge removed.
func TestPurgeHorizons(t *testing.T) {
	t.Parallel()
	windows := func(rep *Report) map[string]time.Time {
		m := map[string]time.Time{}
		for _, w := range rep.Windows {
			m[w.Check+" "+w.Subject] = w.Start
		}
		return m
	}
	micro := func(t time.Time) time.Time { return t.UTC().Truncate(time.Microsecond) }

	t.Run("dedup purged", func(t *testing.T) {
		t.Parallel()
		c := newChain(t)
		// The ledger purged its dedup rows before now-3h (Store.Purge
		// records the horizon).
		c.ledger.exec(`INSERT INTO `+c.ledger.table("processed_messages_horizons")+` (consumer, purge_before, older_than_ms) VALUES ('ledger', $1, 0)`, c.now.Add(-3*time.Hour))
		// So a charge sent 4h ago lost its dedup row: not reported.
		c.payments.sent("chain.charges", "purged-1", c.now.Add(-4*time.Hour))
		c.payments.sent("chain.charges", "lost-1", c.now.Add(-time.Hour))
		rep := mustRun(t, c.config())
		wantKind(t, "never_applied", rep.NeverApplied, "lost-1")
		if got := windows(rep)["never_applied payments:chain.charges->ledger:ledger"]; !got.Equal(micro(c.now.Add(-3 * time.Hour))) {
			t.Errorf("windows %+v", rep.Windows)
		}
		if !strings.Contains(strings.Join(rep.Warnings, "\n"), `consumer "ledger" purges its dedup rows in ledger before then`) {
			t.Errorf("warnings %q", rep.Warnings)
		}
	})

	t.Run("outbox purged", func(t *testing.T) {
		t.Parallel()
		c := newChain(t)
		// The payments outbox holds nothing sent before now-2h: a
		// ledger row of 2.5h ago lost its origin; not reported.
		for i := range 3 {
			c.key(fmt.Sprintf("k-%d", i), c.now.Add(-2*time.Hour+time.Duration(i)*time.Minute))
		}
		c.ledger.applied("ledger", "purged-2", c.now.Add(-150*time.Minute))
		c.ledger.applied("ledger", "ghost-1", c.now.Add(-time.Hour))
		cfg := c.config()
		cfg.Forwards = nil
		rep := mustRun(t, cfg)
		wantKind(t, "unknown_origin", rep.UnknownOrigin, "ghost-1")
		if got := windows(rep)[`unknown_origin consumer "ledger"`]; !got.Equal(micro(c.now.Add(-2*time.Hour + 5*time.Minute))) {
			t.Errorf("windows %+v", rep.Windows)
		}
		// The forward's outbox was purged the same way.
		cfg.Forwards = c.config().Forwards
		rep = mustRun(t, cfg)
		wantKind(t, "not_forwarded", rep.NotForwarded, "ghost-1")
		if got := windows(rep)["not_forwarded ledger:ledger=>ledger:chain.ledger@"+step]; !got.Equal(micro(c.now.Add(-2*time.Hour + 2*time.Second))) {
			t.Errorf("windows %+v", rep.Windows)
		}
	})
}

func TestReportJSON(t *testing.T) {
	t.Parallel()
	c := newChain(t).history()
	c.key("a", c.now.Add(-time.Hour))
	c.payments.sent("chain.charges", "lost-1", c.now.Add(-time.Hour))
	rep := mustRun(t, c.config())
	b, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"checked_at", "since", "until", "end", "grace_seconds", "page_size", "flows", "forwards", "windows", "warnings",
		"never_applied", "applied_twice", "stuck_unsent", "unknown_origin", "not_forwarded", "dead_lettered", "scanned", "discrepancies", "clean"} {
		if _, ok := m[k]; !ok {
			t.Errorf("JSON lacks %q: %s", k, b)
		}
	}
	na := m["never_applied"].(map[string]any)
	if na["count"].(float64) != 1 {
		t.Errorf("never_applied %v", na)
	}
	s := na["samples"].([]any)[0].(map[string]any)
	for k, v := range map[string]any{"message_id": "lost-1", "consumer": "ledger", "destination": "chain.charges", "database": "payments"} {
		if s[k] != v {
			t.Errorf("sample %s = %v, want %v", k, s[k], v)
		}
	}
	if m["clean"] != false || m["discrepancies"].(float64) != 1 {
		t.Errorf("clean %v, discrepancies %v", m["clean"], m["discrepancies"])
	}
	// Empty kinds are [] not null, so that readers need no special case.
	if !strings.Contains(string(b), `"applied_twice":{"count":0,"samples":[]}`) {
		t.Errorf("empty kind: %s", b)
	}
	var back Report
	if err := json.Unmarshal(b, &back); err != nil || back.NeverApplied.Samples[0].MessageID != "lost-1" {
		t.Errorf("round trip: %v %+v", err, back.NeverApplied)
	}
}

func TestReadOnly(t *testing.T) {
	t.Parallel()
	c := newChain(t).history()
	c.key("a", c.now.Add(-time.Hour))
	// A DB that refuses any transaction that is not read-only.
	cfg := c.config()
	for i := range cfg.Databases {
		cfg.Databases[i].DB = readOnlyDB{t: t, db: c.payments.pool}
	}
	rep := mustRun(t, cfg)
	if !rep.Clean {
		t.Errorf("not clean: %+v", rep)
	}
}

type readOnlyDB struct {
	t  *testing.T
	db DB
}

func (d readOnlyDB) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	if opts.AccessMode != pgx.ReadOnly {
		d.t.Errorf("a transaction of access mode %q", opts.AccessMode)
	}
	tx, err := d.db.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	var ro string
	if err := tx.QueryRow(ctx, "SHOW transaction_read_only").Scan(&ro); err != nil || ro != "on" {
		d.t.Errorf("transaction_read_only = %q, %v", ro, err)
	}
	return tx, nil
}

func TestMissingTable(t *testing.T) {
	t.Parallel()
	c := newChain(t)
	cfg := c.config()
	cfg.Databases[0].Outbox.Name = "nope"
	_, err := Run(context.Background(), cfg)
	if !errors.Is(err, consumer.ErrNotMigrated) || !strings.Contains(err.Error(), "database payments") || !strings.Contains(err.Error(), ".nope does not exist") {
		t.Errorf("err = %v", err)
	}
}

func TestValidate(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	now := time.Now()
	good := func() Config {
		return Config{
			Databases: []Database{{Name: "a", DB: pool}, {Name: "b", DB: pool}},
			Flows:     []Flow{{Producer: "a", Destination: "q", Consumer: "c", ConsumerDatabases: []string{"b"}}},
			Forwards:  []Forward{{Consumer: "c", ConsumerDatabases: []string{"b"}, OutboxDatabases: []string{"b"}, Destination: "r", Step: "s/v1"}},
			Now:       func() time.Time { return now },
		}
	}
	for name, tc := range map[string]struct {
		mod   func(*Config)
		field string
	}{
		"no databases":     {func(c *Config) { c.Databases = nil }, "Databases"},
		"no flows":         {func(c *Config) { c.Flows, c.Forwards = nil, nil }, "Flows"},
		"bad name":         {func(c *Config) { c.Databases[0].Name = "a:b" }, "Databases[0].Name"},
		"empty name":       {func(c *Config) { c.Databases[0].Name = "" }, "Databases[0].Name"},
		"twice":            {func(c *Config) { c.Databases[1].Name = "a" }, "Databases[1].Name"},
		"nil DB":           {func(c *Config) { c.Databases[1].DB = nil }, "Databases[1].DB"},
		"bad schema":       {func(c *Config) { c.Databases[0].Outbox.Schema = `x"; DROP` }, "Databases[0].Outbox.Schema"},
		"bad table":        {func(c *Config) { c.Databases[0].Dedup.Name = "a b" }, "Databases[0].Dedup.Name"},
		"unknown producer": {func(c *Config) { c.Flows[0].Producer = "z" }, "Flows[0].Producer"},
		"unknown consumer": {func(c *Config) { c.Flows[0].ConsumerDatabases = []string{"z"} }, "Flows[0].ConsumerDatabases"},
		"no consumer dbs":  {func(c *Config) { c.Flows[0].ConsumerDatabases = nil }, "Flows[0].ConsumerDatabases"},
		"db twice":         {func(c *Config) { c.Flows[0].ConsumerDatabases = []string{"b", "b"} }, "Flows[0].ConsumerDatabases"},
		"no destination":   {func(c *Config) { c.Flows[0].Destination = "" }, "Flows[0].Destination"},
		"no consumer":      {func(c *Config) { c.Flows[0].Consumer = "" }, "Flows[0].Consumer"},
		"same flow":        {func(c *Config) { c.Flows = append(c.Flows, c.Flows[0]) }, "Flows[1]"},
		"consumer dbs differ": {func(c *Config) {
			c.Flows = append(c.Flows, Flow{Producer: "b", Destination: "x", Consumer: "c", ConsumerDatabases: []string{"a"}})
		}, "Flows[1].ConsumerDatabases"},
		"forward db not the consumer's": {func(c *Config) { c.Forwards[0].ConsumerDatabases = []string{"a"} }, "Forwards[0].ConsumerDatabases"},
		"forward no step":               {func(c *Config) { c.Forwards[0].Step = "" }, "Forwards[0].Step"},
		"forward no outbox":             {func(c *Config) { c.Forwards[0].OutboxDatabases = nil }, "Forwards[0].OutboxDatabases"},
		"forward no destination":        {func(c *Config) { c.Forwards[0].Destination = "" }, "Forwards[0].Destination"},
		"since after until":             {func(c *Config) { c.Since, c.Until = now.Add(-time.Hour), now.Add(-2*time.Hour) }, "Since"},
		"since in the grace":            {func(c *Config) { c.Since = now.Add(-time.Minute) }, "Since"},
		"since in the future":           {func(c *Config) { c.Since = now.Add(time.Hour) }, "Since"},
		"negative grace":                {func(c *Config) { c.Grace = -time.Second }, "Grace"},
		"negative page":                 {func(c *Config) { c.PageSize = -1 }, "PageSize"},
		"huge page":                     {func(c *Config) { c.PageSize = maxPageSize + 1 }, "PageSize"},
		"negative samples":              {func(c *Config) { c.SampleLimit = -1 }, "SampleLimit"},
		"dead letters of nobody":        {func(c *Config) { c.DeadLettered = map[string][]string{"": {"x"}} }, "DeadLettered"},
	} {
		cfg := good()
		tc.mod(&cfg)
		_, err := Run(context.Background(), cfg)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field {
			t.Errorf("%s: err = %v, want a ConfigError of %s", name, err, tc.field)
		}
	}
}
