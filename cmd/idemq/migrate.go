package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/processed"
)

var migrateCommand = &command{
	name:    "migrate",
	summary: "create or upgrade the dedup table",
	help: `Creates the schema if it is missing, then applies the pending migrations of
the dedup table (schema.table) and records them in schema.table_migrations,
in one transaction under an advisory lock. It is idempotent and safe to run
from several processes at once: the others wait, then find nothing to do.
It prints the version it migrated to and the table's layout.

With --partitioned, the table gets the partitioned layout (see
processed.Config.Partitioned), in a second transaction: its rows live in
three generations, the tables <table>_g0 (the current one), <table>_g1 and
<table>_g2, and <table> becomes a view of the three; <table>_generations
records when each became current. Old rows then go a generation at a time:
the janitor's upkeep retires (truncates) the oldest generation once every
consumer with rows in it has recorded a purge horizon past its end, and
makes a fresh one current every half of the longest purge age recorded.
The upkeep needs to own the tables.

A table that does not exist is created so. A plain table is converted,
keeping its rows: they become the generation before the first, <table>_g1,
and are retired with it. A table of the range-partitioned layout of earlier
versions is made plain again first, with its rows and grants (one pass over
them), then converted. Convert with the consumers stopped, and restart them
with Config.Partitioned set: a store that read the plain layout refuses to
claim into the converted table (consumer.ErrNotMigrated), and a runtime
using it stops. There is no way back to a plain table here.

Without --partitioned, a table that has the partitioned layout keeps it
(its migrations are applied too), a plain table stays plain, and a table of
the earlier range-partitioned layout is made plain again, with its rows.

With --shard-key-in-primary-key, a plain table's primary key becomes
(consumer, shard_key, message_id), in a transaction of its own, keeping its
rows (those claimed without a shard key get the empty one), for a
distributed Postgres (Citus) that distributes the table by shard_key beside
the business tables (see processed.Config.ShardKeyInPrimaryKey and
docs/sharding.md). A table keyed so stays so.

Examples:
  idemq migrate
  idemq migrate --partitioned`,
	run: runMigrate,
}

// tableLayout is the layout a dedup table has in the database, as migrate
// reports it.
type tableLayout string

const (
	// layoutNone: the table does not exist.
	layoutNone tableLayout = "none"
	// layoutPlain: one plain table.
	layoutPlain tableLayout = "plain"
	// layoutGenerations: the partitioned layout, a view of three
	// generations (processed.Config.Partitioned).
	layoutGenerations tableLayout = "partitioned"
	// layoutRanges: the range-partitioned table of earlier versions,
	// which Migrate makes plain again.
	layoutRanges tableLayout = "range-partitioned"
)

// readLayout reads the layout of the table schema.table through conn; an
// empty schema is the connection's current_schema(), as a store without
// Config.Schema resolves it.
func readLayout(ctx context.Context, conn *pgx.Conn, schema, table string) (tableLayout, error) {
	var kind *string
	if err := conn.QueryRow(ctx, `SELECT (SELECT relkind::text FROM pg_class
	WHERE oid = to_regclass(quote_ident(coalesce(nullif($1, ''), current_schema())) || '.' || quote_ident($2)))`,
		schema, table).Scan(&kind); err != nil {
		return "", fmt.Errorf("read the layout of %s: %w", table, err)
	}
	switch {
	case kind == nil:
		return layoutNone, nil
	case *kind == "r":
		return layoutPlain, nil
	case *kind == "v":
		return layoutGenerations, nil
	case *kind == "p":
		return layoutRanges, nil
	}
	return tableLayout("relkind " + *kind), nil
}

// keyedByShard reads whether the primary key of the table schema.table
// holds the shard key (processed.Config.ShardKeyInPrimaryKey).
func keyedByShard(ctx context.Context, conn *pgx.Conn, schema, table string) (bool, error) {
	var keyed bool
	err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
	WHERE i.indrelid = to_regclass(quote_ident(coalesce(nullif($1, ''), current_schema())) || '.' || quote_ident($2))
	AND i.indisprimary AND a.attname = 'shard_key')`, schema, table).Scan(&keyed)
	if err != nil {
		return false, fmt.Errorf("read the primary key of %s: %w", table, err)
	}
	return keyed, nil
}

// latestVersion is the version Migrate brings the dedup table's main line
// of migrations to.
func latestVersion() int {
	ms := processed.Migrations()
	return ms[len(ms)-1].Version
}

// generationNames lists the generations' tables of table, the current
// one first.
func generationNames(table string) string {
	return table + "_g0 (current), " + table + "_g1 and " + table + "_g2"
}

func runMigrate(ctx context.Context, e *env, c *command, args []string) error {
	var (
		db                dbFlags
		partitioned       bool
		shardKeyInPrimary bool
	)
	fs := c.flagSet()
	db.register(fs)
	fs.BoolVar(&shardKeyInPrimary, "shard-key-in-primary-key", false, "make the dedup key (consumer, shard_key, message_id), for a distributed Postgres (Citus) that distributes the table by shard_key; plain layout only (see processed.Config.ShardKeyInPrimaryKey)")
	fs.BoolVar(&partitioned, "partitioned", false, "give the dedup table the partitioned layout (three generations of rows, retired whole), converting a plain table and keeping its rows")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	if partitioned && shardKeyInPrimary {
		return usagef("--partitioned and --shard-key-in-primary-key: the partitioned layout keeps (consumer, message_id) as its key")
	}
	// The store takes the layout the table has (detectLayout), so that
	// a partitioned table's own migrations are applied too; --partitioned
	// asks for that layout whatever the table has.
	cfg, conn, err := db.connect(ctx, e, processed.Config{})
	if err != nil {
		return err
	}
	defer closeConn(conn)
	cfg.Partitioned = cfg.Partitioned || partitioned
	cfg.ShardKeyInPrimaryKey = cfg.ShardKeyInPrimaryKey || shardKeyInPrimary
	store, err := processed.New(conn, cfg)
	if err != nil {
		return err
	}

	before, err := store.Version(ctx)
	if err != nil {
		return err
	}
	was, err := readLayout(ctx, conn, store.Schema(), store.Table())
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
	is, err := readLayout(ctx, conn, store.Schema(), store.Table())
	if err != nil {
		return err
	}
	if before == after {
		fmt.Fprintf(e.stdout, "%s: already at version %d (latest %d)\n", store, after, latestVersion())
	} else {
		fmt.Fprintf(e.stdout, "%s: migrated from version %d to %d\n", store, before, after)
	}
	for _, line := range layoutReport(store, was, is) {
		fmt.Fprintf(e.stdout, "%s: %s\n", store, line)
	}
	if cfg.ShardKeyInPrimaryKey {
		fmt.Fprintf(e.stdout, "%s: primary key (consumer, shard_key, message_id): distribute it by shard_key, and claim through a processed.Sharded (docs/sharding.md)\n", store)
	}
	if partitioned && is != layoutGenerations {
		// Migrate succeeded, so this is not expected: fail rather than
		// let the consumers find out.
		return fmt.Errorf("%s has layout %s after migrating, want the partitioned layout", store, is)
	}
	return nil
}

// layoutReport says what migrate did to the table's layout, from was to is.
func layoutReport(store *processed.Store, was, is tableLayout) []string {
	t := store.Table()
	var out []string
	if was == layoutRanges && is != layoutRanges {
		out = append(out, "made the range-partitioned table of earlier versions plain again, keeping its rows and grants")
	}
	switch {
	case is == layoutGenerations && was == layoutGenerations:
		out = append(out, "already has the partitioned layout: generations "+generationNames(t)+", shown by the view "+t)
	case is == layoutGenerations && was == layoutNone:
		out = append(out, "created with the partitioned layout: generations "+generationNames(t)+", shown by the view "+t)
	case is == layoutGenerations:
		out = append(out,
			"converted to the partitioned layout: generations "+generationNames(t)+", shown by the view "+t,
			"its rows are now "+t+"_g1, the generation before the first, retired once every consumer with rows in it has purged past its end",
			"restart the consumers with Config.Partitioned set: a store that read the plain table refuses the converted one")
	case is == layoutPlain:
		out = append(out, "plain table (idemq migrate --partitioned converts it to the partitioned layout, keeping its rows)")
	default:
		out = append(out, "layout: "+string(is))
	}
	return out
}
