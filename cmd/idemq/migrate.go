package main

import (
	"context"
	"fmt"

	"github.com/idemq/idemq/processed"
)

var migrateCommand = &command{
	name:    "migrate",
	summary: "create or upgrade the dedup table",
	help: `Creates the schema if it is missing, then applies the pending migrations of
the dedup table (schema.table) and records them in schema.table_migrations.
It is idempotent and safe to run from several processes at once.`,
	run: runMigrate,
}

func runMigrate(ctx context.Context, e *env, c *command, args []string) error {
	var db dbFlags
	fs := c.flagSet()
	db.register(fs)
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	store, conn, err := db.openStore(ctx, e, 0, 0, 0)
	if err != nil {
		return err
	}
	defer closeConn(conn)

	before, err := store.Version(ctx)
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	after, err := store.Version(ctx)
	if err != nil {
		return err
	}
	if before == after {
		fmt.Fprintf(e.stdout, "%s: already at version %d (latest %d)\n", store, after, processed.LatestVersion())
		return nil
	}
	fmt.Fprintf(e.stdout, "%s: migrated from version %d to %d\n", store, before, after)
	return nil
}
