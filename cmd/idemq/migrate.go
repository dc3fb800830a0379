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
It is idempotent and safe to run from several processes at once.

With --partitioned, the dedup table becomes a partitioned table (see
processed.Config.Partitioned): created so if it does not exist; a plain
table with rows is renamed <table>_legacy and attached as the partition of
everything up to the end of the current interval, under an exclusive lock
and one scan of it (consumers wait meanwhile: run it in a quiet moment);
its grants are copied to the new table. Consumers must then open the store
with Partitioned set (a plain store's claims fail on a partitioned table).

Examples:
  idemq migrate
  idemq migrate --partitioned --partition-interval 24h`,
	run: runMigrate,
}

func runMigrate(ctx context.Context, e *env, c *command, args []string) error {
	var (
		db          dbFlags
		partitioned bool
		interval    durationFlag
	)
	fs := c.flagSet()
	db.register(fs)
	fs.BoolVar(&partitioned, "partitioned", false, "make the dedup table a partitioned one, converting a plain table")
	fs.Var(&interval, "partition-interval", "with --partitioned, the `duration` of one partition (default 24h; at least 1s)")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	if interval.set && !partitioned {
		return usagef("--partition-interval needs --partitioned")
	}
	store, conn, err := db.openStore(ctx, e, 0, 0, 0)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	if partitioned {
		cfg := processed.Config{Schema: db.schema, Table: db.table, Partitioned: true}
		if interval.set {
			cfg.PartitionInterval = interval.d
		}
		if store, err = processed.New(conn, cfg); err != nil {
			return &usageError{msg: err.Error()}
		}
	}

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
	} else {
		fmt.Fprintf(e.stdout, "%s: migrated from version %d to %d\n", store, before, after)
	}
	if partitioned {
		fmt.Fprintf(e.stdout, "%s: partitioned\n", store)
	}
	return nil
}
