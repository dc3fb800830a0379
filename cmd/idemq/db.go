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
	fs.StringVar(&d.table, "table", processed.DefaultTable, "name of the dedup table")
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
// the connection, which the caller closes.
func (d *dbFlags) openStore(ctx context.Context, e *env, batch int, pause time.Duration, duty float64) (*processed.Store, *pgx.Conn, error) {
	// Validate the names before connecting, so that a hostile --table is
	// rejected without touching the database.
	cfg := processed.Config{Schema: d.schema, Table: d.table, PurgeBatchSize: batch, PurgePause: pause, PurgeDutyCycle: duty}
	if _, err := processed.New(&pgx.Conn{}, cfg); err != nil {
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return nil, nil, usagef("invalid --%s: %s", strings.ToLower(strings.ReplaceAll(ce.Field, "PurgeBatchSize", "batch-size")), ce.Reason)
		}
		return nil, nil, &usageError{msg: err.Error()}
	}
	raw, from := d.databaseURL(e)
	pcfg, err := pgx.ParseConfig(raw)
	if err != nil {
		return nil, nil, redact.Error(fmt.Errorf("invalid database URL %s (from %s; set DATABASE_URL or --database-url): %w", redact.DSN(raw), from, err), raw)
	}
	if pcfg.ConnectTimeout == 0 {
		pcfg.ConnectTimeout = connectTimeout
	}
	conn, err := pgx.ConnectConfig(ctx, pcfg)
	if err != nil {
		return nil, nil, redact.Error(fmt.Errorf("cannot connect to Postgres at %s (URL from %s; set DATABASE_URL or --database-url): %w", redact.DSN(raw), from, err), raw)
	}
	store, err := processed.New(conn, cfg)
	if err != nil {
		_ = conn.Close(context.Background())
		return nil, nil, err
	}
	return store, conn, nil
}

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// hint explains ErrNotMigrated with the command that fixes it.
func hint(err error, store *processed.Store) error {
	if errors.Is(err, processed.ErrNotMigrated) {
		return fmt.Errorf("%s does not exist: run 'idemq migrate --schema %s --table %s' (%w)", store, store.Schema(), store.Table(), err)
	}
	return err
}
