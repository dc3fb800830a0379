package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/processed"
)

// defaultDatabaseURL is used when neither --database-url nor DATABASE_URL
// is set.
const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// connectTimeout bounds connecting when the URL sets no connect_timeout.
const connectTimeout = 10 * time.Second

// dbFlags are the flags every database command takes.
type dbFlags struct {
	url    string
	schema string
	table  string
}

func (d *dbFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&d.url, "database-url", "", "Postgres URL or DSN (default $DATABASE_URL, then "+defaultDatabaseURL+")")
	fs.StringVar(&d.schema, "schema", "", "schema of the dedup table (default: the connection's current schema, the first on its search_path)")
	fs.StringVar(&d.table, "table", "processed_messages", "name of the dedup table")
}

// databaseURL returns the URL to use and where it came from.
func (d *dbFlags) databaseURL(e *env) (u, from string) {
	switch {
	case d.url != "":
		return d.url, "--database-url"
	case e.getenv("DATABASE_URL") != "":
		return e.getenv("DATABASE_URL"), "DATABASE_URL"
	default:
		return defaultDatabaseURL, "the default"
	}
}

// openStore validates the table names, connects, and returns the store and
// the connection, which the caller closes. The store has the layout the
// table has (see open); batch, pause and duty configure its purge.
func (d *dbFlags) openStore(ctx context.Context, e *env, batch int, pause time.Duration, duty float64) (*processed.Store, *pgx.Conn, error) {
	store, _, conn, err := d.open(ctx, e, processed.Config{PurgeBatchSize: batch, PurgePause: pause, PurgeDutyCycle: duty})
	return store, conn, err
}

// open is openStore with the rest of the store's Config given: it fills in
// the schema and table from the flags, validates them before connecting,
// connects, and sets cfg.Partitioned to the layout the table has
// (see detectLayout), so that the store never refuses the table for its
// layout, whichever it is; a table that does not exist yet keeps cfg's. It
// returns the store, the Config it was made with, and the connection,
// which the caller closes.
func (d *dbFlags) open(ctx context.Context, e *env, cfg processed.Config) (*processed.Store, processed.Config, *pgx.Conn, error) {
	cfg, conn, err := d.connect(ctx, e, cfg)
	if err != nil {
		return nil, cfg, nil, err
	}
	store, err := processed.New(conn, cfg)
	if err != nil {
		closeConn(conn)
		return nil, cfg, nil, err
	}
	return store, cfg, conn, nil
}

// connect validates the names of cfg (the schema and table set from the
// flags) before connecting, so that a hostile --table is rejected without
// touching the database, then connects and returns cfg with Partitioned
// set to the table's layout (see detectLayout), and the connection.
func (d *dbFlags) connect(ctx context.Context, e *env, cfg processed.Config) (processed.Config, *pgx.Conn, error) {
	cfg.Schema, cfg.Table = d.schema, d.table
	if _, err := processed.New(&pgx.Conn{}, cfg); err != nil {
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return cfg, nil, usagef("invalid --%s: %s", strings.ToLower(strings.ReplaceAll(ce.Field, "PurgeBatchSize", "batch-size")), ce.Reason)
		}
		return cfg, nil, &usageError{msg: err.Error()}
	}
	raw, from := d.databaseURL(e)
	pcfg, err := pgx.ParseConfig(raw)
	if err != nil {
		return cfg, nil, redact.Error(fmt.Errorf("invalid database URL %s (from %s; set DATABASE_URL or --database-url): %w", redact.DSN(raw), from, err), raw)
	}
	if pcfg.ConnectTimeout == 0 {
		pcfg.ConnectTimeout = connectTimeout
	}
	conn, err := pgx.ConnectConfig(ctx, pcfg)
	if err != nil {
		return cfg, nil, redact.Error(fmt.Errorf("cannot connect to Postgres at %s (URL from %s; set DATABASE_URL or --database-url): %w", redact.DSN(raw), from, err), raw)
	}
	detected, err := detectLayout(ctx, conn, cfg)
	if err != nil {
		closeConn(conn)
		return cfg, nil, err
	}
	return detected, conn, nil
}

// detectLayout returns cfg with Partitioned and ShardKeyInPrimaryKey set
// to what the table it names has, cfg as it is if the table does not
// exist yet: the command works on whatever table it finds, where a
// consumer states the layout it expects and its store refuses a table
// that disagrees.
func detectLayout(ctx context.Context, conn *pgx.Conn, cfg processed.Config) (processed.Config, error) {
	l, err := readLayout(ctx, conn, cfg.Schema, cfg.Table)
	if err == nil && l != layoutNone {
		cfg.Partitioned = l == layoutGenerations
		cfg.ShardKeyInPrimaryKey, err = keyedByShard(ctx, conn, cfg.Schema, cfg.Table)
	}
	return cfg, err
}

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// hint explains ErrNotMigrated (a table that does not exist, or has the
// range-partitioned layout of earlier versions) with the command that
// fixes it.
func hint(err error, store *processed.Store) error {
	if errors.Is(err, consumer.ErrNotMigrated) {
		return fmt.Errorf("%s is not migrated: run 'idemq migrate --schema %s --table %s' (%w)", store, store.Schema(), store.Table(), err)
	}
	return err
}
