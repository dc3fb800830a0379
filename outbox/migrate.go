package outbox

import (
	"context"
	"embed"

	"github.com/idemq/idemq/internal/pgmigrate"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

var migrations = pgmigrate.Load("outbox", migrationFS, "migrations")

// Migration is one embedded schema migration.
type Migration = pgmigrate.Migration

// Migrations returns the embedded migrations, oldest first.
func Migrations() []Migration { return migrations.Migrations() }

// LatestVersion is the version Migrate brings the table to.
func LatestVersion() int { return migrations.Latest() }

func (o *Outbox) target() pgmigrate.Target {
	return pgmigrate.Target{Schema: o.cfg.Schema, Table: o.cfg.Table, Indexes: map[string]string{"id_index": "_id", "pending_index": "_pending", "sent_index": "_sent"}}
}

// Migrate creates the schema if it is missing, then applies the pending
// migrations and records them in the table Config.Table+"_migrations", all in
// one transaction under an advisory lock keyed on the schema and table. It is
// idempotent and safe to run from several processes at once.
func (o *Outbox) Migrate(ctx context.Context) error {
	_, err := migrations.Migrate(ctx, o.db, o.target())
	return err
}

// Version returns the highest applied migration version, or 0 if Migrate
// has never run.
func (o *Outbox) Version(ctx context.Context) (int, error) {
	return migrations.Version(ctx, o.db, o.target())
}
