package httpidem

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

	"github.com/jackc/pgx/v5"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Migration is one embedded schema migration.
type Migration struct {
	// Version numbers migrations from 1, without gaps.
	Version int
	// Name is the file name without its number and extension.
	Name string
	// SQL is the migration's text, with placeholders unexpanded.
	SQL string
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
			return nil, fmt.Errorf("httpidem: migration file %s: want NNNN_name.sql", f)
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
			return nil, fmt.Errorf("httpidem: migration versions not contiguous: %d at position %d", m.Version, i+1)
		}
	}
	return ms, nil
}

// Migrations returns the embedded migrations, oldest first.
func Migrations() []Migration { return append([]Migration(nil), migrations...) }

// LatestVersion is the version Migrate brings the table to.
func LatestVersion() int { return len(migrations) }

func (m *Middleware) expand(sql string) string {
	ident := func(suffix string) string { return pgx.Identifier{m.cfg.Table + suffix}.Sanitize() }
	return strings.NewReplacer(
		"{{schema}}", pgx.Identifier{m.cfg.Schema}.Sanitize(),
		"{{table}}", m.qTable,
		"{{created_at_index}}", ident("_created_at"),
	).Replace(sql)
}

func (m *Middleware) migrationsTable() string {
	return pgx.Identifier{m.cfg.Schema, m.cfg.Table + "_migrations"}.Sanitize()
}

// lockKey returns the pg_advisory_xact_lock key for name.
func lockKey(name string) int64 {
	h := fnv.New64a()
	h.Write([]byte("idemq.httpidem.migrate:" + name))
	return int64(h.Sum64())
}

// Migrate creates the schema if it is missing, then applies the pending
// migrations and records them in the table Config.Table+"_migrations", all in
// one transaction under an advisory lock keyed on the schema and table. It is
// idempotent and safe to run from several processes at once.
func (m *Middleware) Migrate(ctx context.Context) error {
	if migrationsErr != nil {
		return migrationsErr
	}
	tx, err := m.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("httpidem: migrate %s: begin: %w", m, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	fail := func(step string, err error) error {
		return fmt.Errorf("httpidem: migrate %s: %s: %w", m, step, err)
	}
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"); err != nil {
		return fail("set isolation", err)
	}
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey("table:"+m.cfg.Schema+"."+m.cfg.Table)); err != nil {
		return fail("lock", err)
	}
	schemaExists := func() (bool, error) {
		var ok bool
		err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", m.cfg.Schema).Scan(&ok)
		return ok, err
	}
	exists, err := schemaExists()
	if err != nil {
		return fail("check schema", err)
	}
	if !exists {
		// Migrators of other tables may be creating the same schema.
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey("schema:"+m.cfg.Schema)); err != nil {
			return fail("lock schema", err)
		}
		if exists, err = schemaExists(); err != nil {
			return fail("check schema", err)
		}
		if !exists {
			if _, err := tx.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{m.cfg.Schema}.Sanitize()); err != nil {
				return fail("create schema", err)
			}
		}
	}
	mt := m.migrationsTable()
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
	for _, mig := range migrations {
		if mig.Version <= current {
			continue
		}
		if _, err := tx.Exec(ctx, m.expand(mig.SQL)); err != nil {
			return fail(fmt.Sprintf("apply %04d_%s", mig.Version, mig.Name), err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+mt+" (version, name) VALUES ($1, $2)", mig.Version, mig.Name); err != nil {
			return fail(fmt.Sprintf("record %04d_%s", mig.Version, mig.Name), err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fail("commit", err)
	}
	return nil
}

// Version returns the highest applied migration version, or 0 if Migrate
// has never run.
func (m *Middleware) Version(ctx context.Context) (int, error) {
	var exists bool
	if err := m.db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, m.migrationsTable()).Scan(&exists); err != nil {
		return 0, m.wrap("version", err)
	}
	if !exists {
		return 0, nil
	}
	var v int
	if err := m.db.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+m.migrationsTable()).Scan(&v); err != nil {
		return 0, m.wrap("version", err)
	}
	return v, nil
}
