package processed

import (
	"context"
	"embed"
	"fmt"
	"hash/fnv"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Migration is one embedded schema migration.
type Migration struct {
	// Version numbers migrations from 1, without gaps.
	Version int
	// Name is the file name without its number and extension, such as
	// "create".
	Name string
	// SQL is the migration's text, with placeholders unexpanded.
	SQL string
}

// AppliedMigration is a row of the migrations-tracking table.
type AppliedMigration struct {
	Version   int
	Name      string
	AppliedAt time.Time
}

var migrations, migrationsErr = loadMigrations(migrationFS)

// loadMigrations reads files named NNNN_name.sql, ordered by number.
func loadMigrations(fsys fs.FS) ([]Migration, error) {
	files, err := fs.Glob(fsys, "migrations/*.sql")
	if err != nil {
		return nil, err
	}
	var ms []Migration
	for _, f := range files {
		base := strings.TrimSuffix(path.Base(f), ".sql")
		num, name, ok := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v < 1 || name == "" {
			return nil, fmt.Errorf("processed: migration file %s: want NNNN_name.sql", f)
		}
		b, err := fs.ReadFile(fsys, f)
		if err != nil {
			return nil, err
		}
		ms = append(ms, Migration{Version: v, Name: name, SQL: string(b)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].Version < ms[j].Version })
	for i, m := range ms {
		if m.Version != i+1 {
			return nil, fmt.Errorf("processed: migration versions not contiguous: %d at position %d", m.Version, i+1)
		}
	}
	return ms, nil
}

// Migrations returns the embedded migrations, oldest first.
func Migrations() []Migration {
	return append([]Migration(nil), migrations...)
}

// LatestVersion is the version Migrate brings the table to.
func LatestVersion() int { return len(migrations) }

// expand replaces the placeholders of a migration with quoted identifiers:
// {{schema}}, {{table}} (schema-qualified), {{processed_at_index}}.
func (s *Store) expand(sql string) string {
	return strings.NewReplacer(
		"{{schema}}", pgx.Identifier{s.cfg.Schema}.Sanitize(),
		"{{table}}", s.qTable,
		"{{processed_at_index}}", pgx.Identifier{s.cfg.Table + "_processed_at"}.Sanitize(),
	).Replace(sql)
}

func (s *Store) migrationsTable() string {
	return pgx.Identifier{s.cfg.Schema, s.cfg.Table + "_migrations"}.Sanitize()
}

// lockKey returns the pg_advisory_xact_lock key for name: an FNV-1a hash
// of "idemq.processed.migrate:" + name. Migrate locks "table:schema.table",
// and "schema:schema" while it creates the schema.
func lockKey(name string) int64 {
	h := fnv.New64a()
	h.Write([]byte("idemq.processed.migrate:" + name))
	return int64(h.Sum64())
}

// Migrate creates the schema if it is missing, then applies the pending
// migrations and records them in the table Config.Table+"_migrations", all in
// one transaction under an advisory lock keyed on the schema and table. It is
// idempotent, and safe to run from several processes at once: the others wait
// and then find nothing to do.
func (s *Store) Migrate(ctx context.Context) error {
	_, err := s.migrate(ctx)
	return err
}

// migrate is Migrate, returning the migrations it applied.
func (s *Store) migrate(ctx context.Context) ([]Migration, error) {
	if migrationsErr != nil {
		return nil, migrationsErr
	}
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("processed: migrate %s: begin: %w", s, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()

	fail := func(step string, err error) ([]Migration, error) {
		return nil, fmt.Errorf("processed: migrate %s: %s: %w", s, step, err)
	}
	// Each statement must see what a migrator that held the lock before us
	// committed, whatever default_transaction_isolation says.
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"); err != nil {
		return fail("set isolation", err)
	}
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey("table:"+s.cfg.Schema+"."+s.cfg.Table)); err != nil {
		return fail("lock", err)
	}
	// Check before creating: CREATE SCHEMA IF NOT EXISTS needs the CREATE
	// privilege on the database even when the schema exists.
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", s.cfg.Schema).Scan(&exists); err != nil {
		return fail("check schema", err)
	}
	if !exists {
		// Migrators of other tables may be creating the same schema.
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey("schema:"+s.cfg.Schema)); err != nil {
			return fail("lock schema", err)
		}
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", s.cfg.Schema).Scan(&exists); err != nil {
			return fail("check schema", err)
		}
	}
	if !exists {
		if _, err := tx.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{s.cfg.Schema}.Sanitize()); err != nil {
			return fail("create schema", err)
		}
	}
	mt := s.migrationsTable()
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+mt+` (
	version    integer     PRIMARY KEY,
	name       text        NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now()
)`); err != nil {
		return fail("create migrations table", err)
	}
	var current int
	if err := tx.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+mt).Scan(&current); err != nil {
		return fail("read version", err)
	}
	var applied []Migration
	for _, m := range migrations {
		if m.Version <= current {
			continue
		}
		if _, err := tx.Exec(ctx, s.expand(m.SQL)); err != nil {
			return fail(fmt.Sprintf("apply %04d_%s", m.Version, m.Name), err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+mt+" (version, name) VALUES ($1, $2)", m.Version, m.Name); err != nil {
			return fail(fmt.Sprintf("record %04d_%s", m.Version, m.Name), err)
		}
		applied = append(applied, m)
	}
	if err := tx.Commit(ctx); err != nil {
		return fail("commit", err)
	}
	return applied, nil
}

// Version returns the highest applied migration version, or 0 if Migrate
// has never run.
func (s *Store) Version(ctx context.Context) (int, error) {
	var exists bool
	err := s.db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, s.migrationsTable()).Scan(&exists)
	if err != nil {
		return 0, s.wrap("version", err)
	}
	if !exists {
		return 0, nil
	}
	var v int
	if err := s.db.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+s.migrationsTable()).Scan(&v); err != nil {
		return 0, s.wrap("version", err)
	}
	return v, nil
}

// Applied returns the rows of the migrations-tracking table, oldest first,
// or none if Migrate has never run.
func (s *Store) Applied(ctx context.Context) ([]AppliedMigration, error) {
	v, err := s.Version(ctx)
	if err != nil || v == 0 {
		return nil, err
	}
	rows, err := s.db.Query(ctx, "SELECT version, name, applied_at FROM "+s.migrationsTable()+" ORDER BY version")
	if err != nil {
		return nil, s.wrap("applied migrations", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[AppliedMigration])
	if err != nil {
		return nil, s.wrap("applied migrations", err)
	}
	return out, nil
}
