package processed_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

func TestMigrationsEmbedded(t *testing.T) {
	t.Parallel()
	ms := processed.Migrations()
	if len(ms) == 0 || processed.LatestVersion() != len(ms) {
		t.Fatalf("Migrations: %d, LatestVersion %d", len(ms), processed.LatestVersion())
	}
	for i, m := range ms {
		if m.Version != i+1 || m.Name == "" || !(strings.Contains(m.SQL, "{{table}}") || strings.Contains(m.SQL, "{{schema}}")) {
			t.Errorf("migration %d: %+v", i, m)
		}
	}
}

func TestMigrateIdempotent(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	s, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	if v, err := s.Version(ctx(t)); err != nil || v != 0 {
		t.Fatalf("Version before: %d, %v", v, err)
	}
	for i := range 2 {
		if err := s.Migrate(ctx(t)); err != nil {
			t.Fatalf("Migrate #%d: %v", i+1, err)
		}
		if v, err := s.Version(ctx(t)); err != nil || v != processed.LatestVersion() {
			t.Fatalf("Version after #%d: %d, %v", i+1, v, err)
		}
	}
	applied, err := s.Applied(ctx(t))
	if err != nil || len(applied) != processed.LatestVersion() || applied[0].Version != 1 || applied[0].Name != "create" || applied[0].AppliedAt.IsZero() {
		t.Fatalf("Applied: %+v, %v", applied, err)
	}
}

// dropSchemaLater drops a schema the test creates through Migrate.
func dropSchemaLater(t *testing.T, schema string) {
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := testdb.Pool(t).Exec(c, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
}

func TestMigrateConcurrent(t *testing.T) {
	t.Parallel()
	// A schema that does not exist yet, so the racers also race to create it.
	schema := testdb.Schema(t) + "_race"
	dropSchemaLater(t, schema)

	const n = 8
	tables := []string{"processed_messages", "other_dedup"}
	conns := make([]*pgx.Conn, n)
	for i := range conns {
		c, err := pgx.Connect(ctx(t), testdb.URL())
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
		t.Cleanup(func() { _ = c.Close(context.Background()) })
	}
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			// Two tables, so migrators holding different table locks
			// race to create the schema too.
			s, err := processed.New(c, processed.Config{Schema: schema, Table: tables[i%2]})
			if err != nil {
				errs[i] = err
				return
			}
			<-start
			errs[i] = s.Migrate(ctx(t))
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("migrator %d: %v", i, err)
		}
	}

	for _, table := range tables {
		var versions int
		if err := testdb.Pool(t).QueryRow(ctx(t),
			"SELECT count(*) FROM "+pgx.Identifier{schema, table + "_migrations"}.Sanitize()).Scan(&versions); err != nil {
			t.Fatal(err)
		}
		if versions != processed.LatestVersion() {
			t.Errorf("%s: %d migration rows, want %d", table, versions, processed.LatestVersion())
		}
	}
	var n2 int
	if err := testdb.Pool(t).QueryRow(ctx(t),
		"SELECT count(*) FROM pg_tables WHERE schemaname = $1", schema).Scan(&n2); err != nil {
		t.Fatal(err)
	}
	if n2 != 10 { // two tables, each with its _migrations, _retention, _horizons and _shard_map
		t.Errorf("%d tables in %s, want 10", n2, schema)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	long := strings.Repeat("a", 64)
	for _, tc := range []struct {
		name  string
		cfg   processed.Config
		field string
	}{
		{"injection", processed.Config{Table: "x; drop table y"}, "Table"},
		{"quote", processed.Config{Table: `a"b`}, "Table"},
		{"schema injection", processed.Config{Schema: `public"; drop schema public; --`}, "Schema"},
		{"dot", processed.Config{Table: "public.t"}, "Table"},
		{"leading digit", processed.Config{Table: "1t"}, "Table"},
		{"space", processed.Config{Schema: "my schema"}, "Schema"},
		{"unicode", processed.Config{Table: "tëst"}, "Table"},
		{"64 bytes", processed.Config{Table: long}, "Table"},
		{"49 bytes", processed.Config{Schema: long[:49]}, "Schema"},
		{"negative batch", processed.Config{PurgeBatchSize: -1}, "PurgeBatchSize"},
		{"negative pause", processed.Config{PurgePause: -time.Millisecond}, "PurgePause"},
		{"pause -2ns", processed.Config{PurgePause: -2}, "PurgePause"},
		{"duty above 1", processed.Config{PurgeDutyCycle: 1.5}, "PurgeDutyCycle"},
		{"negative duty", processed.Config{PurgeDutyCycle: -0.1}, "PurgeDutyCycle"},
	} {
		_, err := processed.New(pool, tc.cfg)
		var ce *consumer.ConfigError
		if !errors.Is(err, consumer.ErrInvalidConfig) || !errors.As(err, &ce) || ce.Field != tc.field {
			t.Errorf("%s: New(%+v) = %v, want a ConfigError for %s", tc.name, tc.cfg, err, tc.field)
		}
	}
	if _, err := processed.New(nil, processed.Config{}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("New(nil): %v", err)
	}
	for _, cfg := range []processed.Config{{}, {Schema: "S_1", Table: "_t"}, {Table: long[:48]}, {PurgePause: -1}, {PurgePause: -1, PurgeDutyCycle: 1}} {
		s, err := processed.New(pool, cfg)
		if err != nil {
			t.Errorf("New(%+v): %v", cfg, err)
			continue
		}
		// The schema comes from the search_path, on first use.
		if cfg == (processed.Config{}) && (s.Schema() != "" || s.Table() != "processed_messages") {
			t.Errorf("defaults: %s", s)
		}
	}
}

func TestCustomNames(t *testing.T) {
	t.Parallel()
	schema := "Idemq_Custom_" + strings.TrimPrefix(testdb.Schema(t), "idemq_test_")
	dropSchemaLater(t, schema)
	table := strings.Repeat("T", 48)
	s, pool := setup(t, processed.Config{Schema: schema, Table: table})

	if v, err := s.Version(ctx(t)); err != nil || v != processed.LatestVersion() {
		t.Fatalf("Version: %d, %v", v, err)
	}
	if got := claim(t, s, claimOf("a", "1", "x"))[0]; got.Outcome != dedup.ClaimNew {
		t.Fatalf("claim: %v", got.Outcome)
	}
	if got := claim(t, s, claimOf("a", "1", "x"))[0]; got.Outcome != dedup.ClaimDuplicate {
		t.Fatalf("claim again: %v", got.Outcome)
	}
	var names []string
	rows, err := pool.Query(ctx(t), "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND (c.relkind = 'r' OR c.relname = $2) ORDER BY relname", schema, table+"_consumer_age")
	if err != nil {
		t.Fatal(err)
	}
	names, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{table, table + "_consumer_age", table + "_horizons", table + "_migrations", table + "_retention", table + "_shard_map"}
	if strings.Join(names, ",") != strings.Join(want, ",") {
		t.Errorf("relations in %s:\n got %v\nwant %v", schema, names, want)
	}
}

// TestMigrateFromEarlierPartitionedLayout: a table of the range-partitioned
// layout that earlier versions made from Go code (at migration 2) is made
// plain by Migrate, with its rows and grants, and its seal tables dropped;
// Migrate with Partitioned then converts it to generations.
func TestMigrateFromEarlierPartitionedLayout(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	q := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	retention := processed.Migrations()[1].SQL
	retention = strings.NewReplacer("{{schema}}", pgx.Identifier{schema}.Sanitize(), "{{table}}", q("processed_messages"),
		"{{retention_table}}", pgx.Identifier{"processed_messages_retention"}.Sanitize(), "{{processed_at_index}}", `"pm_at"`).Replace(retention)
	for _, sql := range []string{
		`CREATE TABLE ` + q("processed_messages_migrations") + ` (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`,
		`INSERT INTO ` + q("processed_messages_migrations") + ` (version, name) VALUES (1, 'create'), (2, 'retention')`,
		`CREATE TABLE ` + q("processed_messages") + ` (
	consumer text NOT NULL, message_id text NOT NULL, fingerprint bytea NOT NULL,
	processed_at timestamptz NOT NULL DEFAULT now(), source text NOT NULL DEFAULT '', partition integer, "offset" bigint,
	CONSTRAINT processed_messages_fingerprint_check CHECK (octet_length(fingerprint) = 32)) PARTITION BY RANGE (processed_at)`,
		`CREATE TABLE ` + q("processed_messages_default") + ` PARTITION OF ` + q("processed_messages") + ` (PRIMARY KEY (consumer, message_id)) DEFAULT`,
		`CREATE TABLE ` + q("processed_messages_p1") + ` PARTITION OF ` + q("processed_messages") + ` (PRIMARY KEY (consumer, message_id))
	FOR VALUES FROM ('2026-01-01 00:00:00+00') TO ('2026-02-01 00:00:00+00')`,
		`CREATE TABLE ` + q("processed_messages_sealed") + ` (partition text PRIMARY KEY)`,
		`CREATE TABLE ` + q("processed_messages_filter") + ` (bucket integer, partition text, bits bytea, PRIMARY KEY (bucket, partition))`,
		retention,
		`INSERT INTO ` + q("processed_messages") + ` (consumer, message_id, fingerprint, processed_at)
	VALUES ('c', 'in-january', sha256('x'), '2026-01-15 00:00:00+00'), ('c', 'recent', sha256('x'), now())`,
		// One id in two partitions, as the earlier layout's defects could
		// leave it: the first claim's row is the one kept.
		`INSERT INTO ` + q("processed_messages") + ` (consumer, message_id, fingerprint, processed_at)
	VALUES ('c', 'twice', sha256('x'), '2026-01-16 00:00:00+00'), ('c', 'twice', sha256('y'), now())`,
		`GRANT SELECT ON ` + q("processed_messages") + ` TO PUBLIC`,
	} {
		if _, err := pool.Exec(ctx(t), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	s, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "x", "x")}); !errors.Is(err, consumer.ErrNotMigrated) {
		t.Fatalf("claim before Migrate: %v, want ErrNotMigrated", err)
	}
	if err := s.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
	var kind string
	var public bool
	if err := pool.QueryRow(ctx(t), `SELECT relkind::text, has_table_privilege('public', oid, 'SELECT') FROM pg_class WHERE oid = to_regclass($1)`,
		q("processed_messages")).Scan(&kind, &public); err != nil || kind != "r" || !public {
		t.Fatalf("after Migrate: relkind %q, public SELECT %v (%v); want a plain table with the grant", kind, public, err)
	}
	var left int
	if err := pool.QueryRow(ctx(t), `SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname IN ('processed_messages_sealed', 'processed_messages_filter', 'processed_messages_default', 'processed_messages_p1')`, schema).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d tables of the earlier layout left (%v)", left, err)
	}
	for _, id := range []string{"in-january", "recent", "twice"} {
		if r := claim(t, s, claimOf("c", id, "x"))[0]; r.Outcome != dedup.ClaimDuplicate {
			t.Fatalf("%s after Migrate: %v, want duplicate", id, r.Outcome)
		}
	}
	part, err := processed.New(pool, processed.Config{Schema: schema, Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := part.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"in-january", "recent"} {
		if r := claim(t, part, claimOf("c", id, "x"))[0]; r.Outcome != dedup.ClaimDuplicate {
			t.Fatalf("%s after the conversion to generations: %v, want duplicate", id, r.Outcome)
		}
	}
	if err := pool.QueryRow(ctx(t), `SELECT has_table_privilege('public', $1, 'SELECT') AND has_table_privilege('public', $2, 'SELECT')`,
		q("processed_messages"), q("processed_messages_g0")).Scan(&public); err != nil || !public {
		t.Fatalf("grants after the conversion to generations: %v (%v)", public, err)
	}
}
