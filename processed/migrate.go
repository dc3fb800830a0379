package processed

import (
	"context"
	"embed"
	"strconv"

	"github.com/idemq/idemq/internal/pgmigrate"
)

//go:embed migrations/*.sql migrations/gen/*.sql migrations/keyed/*.sql
var migrationFS embed.FS

var (
	migrations = pgmigrate.Load("processed", migrationFS, "migrations")
	// genMigrations make the partitioned layout (Config.Partitioned): a
	// line of their own, applied after the main line's.
	genMigrations = pgmigrate.Load("processed", migrationFS, "migrations/gen")
	// keyedMigrations put the shard key in the primary key
	// (Config.ShardKeyInPrimaryKey): a line of their own too.
	keyedMigrations = pgmigrate.Load("processed", migrationFS, "migrations/keyed")
)

// Migration is one embedded schema migration, of the dedup table or of the
// outbox's or the HTTP idempotency keys' table (their Migrations return
// this type too).
type Migration = pgmigrate.Migration

// Migrations returns the embedded migrations of the main line, oldest
// first; the last one's Version is the version [Store.Migrate] brings the
// table to. Migrate applies them, so most programs never call this: it is
// for reviewing the schema changes, or for applying them with a migration
// tool of your own, replacing the {{...}} placeholders in their SQL with
// quoted identifiers as Migrate does ({{table}} is the schema-qualified
// table, the others name Table plus a suffix).
func Migrations() []Migration { return migrations.Migrations() }

// target is the table the migrations apply to, line being "" for the main
// line and "gen" for the partitioned layout's.
func (s *Store) target(ctx context.Context, line string) (pgmigrate.Target, error) {
	schema, err := s.resolveSchema(ctx)
	if err != nil {
		return pgmigrate.Target{}, err
	}
	names := map[string]string{
		"processed_at_index":          "_processed_at",
		"consumer_processed_at_index": "_consumer_age",
		"consumer_id_index":           "_consumer_id",
		"retention_table":             retentionSuffix,
		"horizons_table":              horizonsSuffix,
		"shard_map_table":             shardMapSuffix,
		"commit_check":                commitCheckSuffix,
		"commit_guard":                commitGuardSuffix,
		"generations_table":           "_generations",
		"old_partitioned":             "_old_parent",
		"old_sealed":                  "_sealed",
		"old_filter":                  "_filter",
	}
	for i := range genCount + 1 {
		names["g"+strconv.Itoa(i)] = "_g" + strconv.Itoa(i)
		names["brin"+strconv.Itoa(i)] = "_g" + strconv.Itoa(i) + "_applied"
	}
	return pgmigrate.Target{Schema: schema, Table: s.cfg.Table, Line: line, Indexes: names}, nil
}

// Migrate creates the schema if it is missing, then applies the pending
// migrations and records them in the table Config.Table+"_migrations", all in
// one transaction under an advisory lock keyed on the schema and table. It is
// idempotent, and safe to run from several processes at once: the others wait
// and then find nothing to do.
//
// With Config.Partitioned it then applies the partitioned layout's own
// migrations (recorded in Config.Table+"_gen_migrations") in a second
// transaction: they convert the plain table, keeping its rows, which
// become the generation before the first (see Config.Partitioned). A
// table of the partitioned layout of earlier versions is made plain again
// first, with its rows (migration 0003), then converted. Convert with the
// consumers stopped: a store that read the plain layout refuses to claim
// into the converted table (consumer.ErrNotMigrated), and a runtime using it stops.
//
// With Config.ShardKeyInPrimaryKey it applies that line's migrations
// (recorded in Config.Table+"_keyed_migrations") in a transaction of its
// own: the primary key becomes (consumer, shard_key, message_id), keeping
// the rows. Convert with the consumers stopped, as above.
func (s *Store) Migrate(ctx context.Context) error {
	_, err := s.migrate(ctx)
	return err
}

// migrate is Migrate, returning the migrations it applied.
func (s *Store) migrate(ctx context.Context) ([]Migration, error) {
	t, err := s.target(ctx, "")
	if err != nil {
		return nil, err
	}
	applied, err := migrations.Migrate(ctx, s.db, t)
	if err == nil && s.cfg.Partitioned {
		t.Line = "gen"
		var more []Migration
		more, err = genMigrations.Migrate(ctx, s.db, t)
		applied = append(applied, more...)
	}
	if err == nil && s.cfg.ShardKeyInPrimaryKey {
		t.Line = "keyed"
		var more []Migration
		more, err = keyedMigrations.Migrate(ctx, s.db, t)
		applied = append(applied, more...)
	}
	// The layout is read again at the next use.
	s.st.Store(nil)
	return applied, err
}

// Version returns the highest applied migration version of the main line,
// or 0 if Migrate has never run.
func (s *Store) Version(ctx context.Context) (int, error) {
	t, err := s.target(ctx, "")
	if err != nil {
		return 0, err
	}
	return migrations.Version(ctx, s.db, t)
}
