package outbox

import (
	"context"
	"embed"

	"github.com/idemq/idemq/internal/pgmigrate"
	"github.com/idemq/idemq/processed"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

var migrations = pgmigrate.Load("outbox", migrationFS, "migrations")

// Migrations returns the embedded migrations, oldest first; the last one's
// Version is the version [Outbox.Migrate] brings the table to. Migrate
// applies them, so most programs never call this: it is for reviewing the
// schema changes, or for applying them with a migration tool of your own,
// replacing the {{...}} placeholders in their SQL with quoted identifiers
// as Migrate does ({{table}} is the schema-qualified table, the others
// name Table plus a suffix).
func Migrations() []processed.Migration { return migrations.Migrations() }

// Migrate creates the schema if it is missing, then applies the pending
// migrations and records them in the table Config.Table+"_migrations", all in
// one transaction under an advisory lock keyed on the schema and table. It is
// idempotent and safe to run from several processes at once.
func (o *Outbox) Migrate(ctx context.Context) error {
	t, err := o.table.Target(ctx, o.db)
	if err != nil {
		return err
	}
	_, err = migrations.Migrate(ctx, o.db, t)
	return err
}

// Version returns the highest applied migration version, or 0 if Migrate
// has never run.
func (o *Outbox) Version(ctx context.Context) (int, error) {
	t, err := o.table.Target(ctx, o.db)
	if err != nil {
		return 0, err
	}
	return migrations.Version(ctx, o.db, t)
}
