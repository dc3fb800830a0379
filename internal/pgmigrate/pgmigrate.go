// Package pgmigrate applies embedded, numbered SQL migrations to one table of
// a configurable schema, for idemq's Postgres stores (processed, outbox,
// httpidem). It also validates the schema and table names those stores
// accept.
//
// Migrations are files named NNNN_name.sql, numbered from 1 without gaps.
// Their text may use {{schema}} and {{table}} (the quoted, schema-qualified
// table) and any other placeholders a Target supplies; every substitution is
// a quoted identifier, never raw input. Applied versions are recorded in the
// table Target.Table+"_migrations".
package pgmigrate

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/consumer"
)

// MaxIdentifierLen is the longest schema or table name accepted, in bytes. It
// leaves room for the suffixes the stores append (such as "_migrations")
// within Postgres's 63-byte identifier limit.
const MaxIdentifierLen = 48

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// ValidIdent returns a *consumer.ConfigError for field unless s is a plain
// identifier: letters, digits and underscores, not starting with a digit, at
// most MaxIdentifierLen bytes.
func ValidIdent(field, s string) error {
	switch {
	case len(s) > MaxIdentifierLen:
		return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf("%d bytes, more than %d", len(s), MaxIdentifierLen)}
	case !identRE.MatchString(s):
		return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf("%q is not a plain identifier (letters, digits and underscores, not starting with a digit)", s)}
	}
	return nil
}

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

// Applied is a row of the migrations-tracking table.
type Applied struct {
	Version   int
	Name      string
	AppliedAt time.Time
}

// Set is the migrations of one package.
type Set struct {
	// Pkg names the package in errors and in the advisory-lock keys.
	Pkg        string
	migrations []Migration
	err        error
}

// Load reads the files dir/NNNN_name.sql of fsys, ordered by number. An
// invalid set is reported by every later call.
func Load(pkg string, fsys fs.FS, dir string) *Set {
	s := &Set{Pkg: pkg}
	s.migrations, s.err = load(pkg, fsys, dir)
	return s
}

func load(pkg string, fsys fs.FS, dir string) ([]Migration, error) {
	files, err := fs.Glob(fsys, dir+"/*.sql")
	if err != nil {
		return nil, err
	}
	var ms []Migration
	for _, f := range files {
		base := strings.TrimSuffix(path.Base(f), ".sql")
		num, name, ok := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v < 1 || name == "" {
			return nil, fmt.Errorf("%s: migration file %s: want NNNN_name.sql", pkg, f)
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
			return nil, fmt.Errorf("%s: migration versions not contiguous: %d at position %d", pkg, m.Version, i+1)
		}
	}
	return ms, nil
}

// Migrations returns the migrations, oldest first.
func (s *Set) Migrations() []Migration { return append([]Migration(nil), s.migrations...) }

// Latest is the version Migrate brings a table to.
func (s *Set) Latest() int { return len(s.migrations) }

// DB is what migrations need from a database handle.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// QueryDB is a DB that can also run queries returning many rows.
type QueryDB interface {
	DB
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Target is the table a Set is applied to.
type Target struct {
	// Schema and Table must have passed ValidIdent.
	Schema, Table string
	// Line names a line of migrations applied to the table beside its
	// main line, as river keeps its own: "" for the main line, whose
	// versions are recorded in Table+"_migrations"; another line's are
	// recorded in Table+"_"+Line+"_migrations".
	Line string
	// Indexes maps placeholder names to suffixes of the table's name: an
	// entry "created_at_index": "_created_at" makes {{created_at_index}}
	// expand to the quoted identifier Table+"_created_at".
	Indexes map[string]string
}

func (t Target) String() string {
	if t.Line != "" {
		return t.Schema + "." + t.Table + " (" + t.Line + " migrations)"
	}
	return t.Schema + "." + t.Table
}

func (t Target) expand(sql string) string {
	pairs := []string{
		"{{schema}}", pgx.Identifier{t.Schema}.Sanitize(),
		"{{table}}", pgx.Identifier{t.Schema, t.Table}.Sanitize(),
	}
	for name, suffix := range t.Indexes {
		pairs = append(pairs, "{{"+name+"}}", pgx.Identifier{t.Table + suffix}.Sanitize())
	}
	return strings.NewReplacer(pairs...).Replace(sql)
}

func (t Target) migrationsTable() string {
	if t.Line != "" {
		return pgx.Identifier{t.Schema, t.Table + "_" + t.Line + "_migrations"}.Sanitize()
	}
	return pgx.Identifier{t.Schema, t.Table + "_migrations"}.Sanitize()
}

// lockKey returns the pg_advisory_xact_lock key for name within pkg.
func (s *Set) lockKey(name string) int64 {
	h := fnv.New64a()
	h.Write([]byte("idemq." + s.Pkg + ".migrate:" + name))
	return int64(h.Sum64())
}

// Migrate creates the schema if it is missing, then applies the pending
// migrations and records them, all in one transaction under an advisory lock
// keyed on the schema and table. It is idempotent, and safe to run from
// several processes at once: the others wait, then find nothing to do. It
// returns the migrations it applied.
func (s *Set) Migrate(ctx context.Context, db DB, t Target) ([]Migration, error) {
	if s.err != nil {
		return nil, s.err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("%s: migrate %s: begin: %w", s.Pkg, t, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()

	fail := func(step string, err error) ([]Migration, error) {
		return nil, fmt.Errorf("%s: migrate %s: %s: %w", s.Pkg, t, step, err)
	}
	// Each statement must see what a migrator that held the lock before us
	// committed, whatever default_transaction_isolation says.
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"); err != nil {
		return fail("set isolation", err)
	}
	// One lock per table, whatever the line: a line's migrations may
	// change what the main line's apply to.
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", s.lockKey("table:"+t.Schema+"."+t.Table)); err != nil {
		return fail("lock", err)
	}
	// Check before creating: CREATE SCHEMA IF NOT EXISTS needs the CREATE
	// privilege on the database even when the schema exists.
	schemaExists := func() (bool, error) {
		var exists bool
		err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", t.Schema).Scan(&exists)
		return exists, err
	}
	exists, err := schemaExists()
	if err != nil {
		return fail("check schema", err)
	}
	if !exists {
		// Migrators of other tables may be creating the same schema.
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", s.lockKey("schema:"+t.Schema)); err != nil {
			return fail("lock schema", err)
		}
		if exists, err = schemaExists(); err != nil {
			return fail("check schema", err)
		}
	}
	if !exists {
		if _, err := tx.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{t.Schema}.Sanitize()); err != nil {
			return fail("create schema", err)
		}
	}
	mt := t.migrationsTable()
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
	for _, m := range s.migrations {
		if m.Version <= current {
			continue
		}
		if _, err := tx.Exec(ctx, t.expand(m.SQL)); err != nil {
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

// Version returns the highest applied migration version of t, or 0 if
// Migrate has never run on it.
func (s *Set) Version(ctx context.Context, db DB, t Target) (int, error) {
	var exists bool
	if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.migrationsTable()).Scan(&exists); err != nil {
		return 0, fmt.Errorf("%s: version of %s: %w", s.Pkg, t, err)
	}
	if !exists {
		return 0, nil
	}
	var v int
	if err := db.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+t.migrationsTable()).Scan(&v); err != nil {
		return 0, fmt.Errorf("%s: version of %s: %w", s.Pkg, t, err)
	}
	return v, nil
}

// AppliedTo returns the rows of t's migrations-tracking table, oldest first,
// or none if Migrate has never run on it.
func (s *Set) AppliedTo(ctx context.Context, db QueryDB, t Target) ([]Applied, error) {
	v, err := s.Version(ctx, db, t)
	if err != nil || v == 0 {
		return nil, err
	}
	rows, err := db.Query(ctx, "SELECT version, name, applied_at FROM "+t.migrationsTable()+" ORDER BY version")
	if err != nil {
		return nil, fmt.Errorf("%s: applied migrations of %s: %w", s.Pkg, t, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Applied])
	if err != nil {
		return nil, fmt.Errorf("%s: applied migrations of %s: %w", s.Pkg, t, err)
	}
	return out, nil
}

// IsUndefined reports whether err is Postgres saying a table or schema does
// not exist: the store was not migrated.
func IsUndefined(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") // undefined_table, invalid_schema_name
}
