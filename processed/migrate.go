package processed

import (
	"context"
	"embed"

	"github.com/idemq/idemq/internal/pgmigrate"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

var migrations = pgmigrate.Load("processed", migrationFS, "migrations")

// Migration is one embedded schema migration.
type Migration = pgmigrate.Migration

// AppliedMigration is a row of the migrations-tracking table.
type AppliedMigration = pgmigrate.Applied

// Migrations returns the embedded migrations, oldest first.
func Migrations() []Migration { return migrations.Migrations() }

// LatestVersion is the version Migrate brings the table to.
func LatestVersion() int { return migrations.Latest() }

func (s *Store) target(ctx context.Context) (pgmigrate.Target, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return pgmigrate.Target{}, err
	}
	return pgmigrate.Target{Schema: st.schema, Table: s.cfg.Table,
		Indexes: map[string]string{"processed_at_index": "_processed_at", "retention_table": retentionSuffix,
			"commit_check": commitCheckSuffix, "commit_guard": "_commit_guard"}}, nil
}

// Migrate creates the schema if it is missing, then applies the pending
// migrations and records them in the table Config.Table+"_migrations", all in
// one transaction under an advisory lock keyed on the schema and table. It is
// idempotent, and safe to run from several processes at once: the others wait
// and then find nothing to do.
//
// With Config.Partitioned, Migrate then makes the table partitioned, in a
// second transaction: a missing or empty table is created partitioned; a
// plain table with rows is renamed Table+"_legacy" and attached as the
// partition of everything up to the end of the current interval, which
// takes an exclusive lock on it and scans it once (claims wait meanwhile),
// and its grants are copied to the new parent. The legacy partition is
// dropped whole once its upper bound is older than the retention. Then it
// creates the partitions of the current interval and the next ones
// (EnsurePartitions).
func (s *Store) Migrate(ctx context.Context) error {
	_, err := s.migrate(ctx)
	return err
}

// migrate is Migrate, returning the migrations it applied.
func (s *Store) migrate(ctx context.Context) ([]Migration, error) {
	t, err := s.target(ctx)
	if err != nil {
		return nil, err
	}
	applied, err := migrations.Migrate(ctx, s.db, t)
	if err != nil || !s.cfg.Partitioned {
		return applied, err
	}
	return applied, s.migratePartitioned(ctx)
}

// Version returns the highest applied migration version, or 0 if Migrate
// has never run.
func (s *Store) Version(ctx context.Context) (int, error) {
	t, err := s.target(ctx)
	if err != nil {
		return 0, err
	}
	return migrations.Version(ctx, s.db, t)
}

// Applied returns the rows of the migrations-tracking table, oldest first,
// or none if Migrate has never run.
func (s *Store) Applied(ctx context.Context) ([]AppliedMigration, error) {
	t, err := s.target(ctx)
	if err != nil {
		return nil, err
	}
	return migrations.AppliedTo(ctx, s.db, t)
}
