package processed

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
)

// Open connects to the database at databaseURL (a postgres:// URL or a
// keyword/value string, as pgxpool.ParseConfig reads it; empty uses the PG*
// environment variables) and returns a store that owns its pool: the one
// Postgres handle a consumer.Config needs, which also serves migrations,
// lookups and purges. Close closes the pool.
//
// The pool holds cfg.MaxConns connections at most (the URL's pool_max_conns,
// else 20), opened as they are needed. Open fails if the
// database does not answer, and learns the schema from the search_path
// when cfg.Schema is empty. It does not create the table: call Migrate, or
// run `idemq migrate`. It reads the table's layout if the table exists, and
// refuses a partitioned table when cfg does not set Partitioned.
func Open(ctx context.Context, databaseURL string, cfg Config) (*Store, error) {
	if err := cfg.withDefaults().validate(); err != nil {
		return nil, err
	}
	pcfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("processed: open: %w", err)
	}
	inURL := strings.Contains(databaseURL, "pool_max_conns")
	switch {
	case cfg.MaxConns != 0 && inURL:
		return nil, &consumer.ConfigError{Field: "MaxConns", Reason: "set twice: in Config and as the URL's pool_max_conns; keep one"}
	case cfg.MaxConns != 0:
		pcfg.MaxConns = int32(min(cfg.MaxConns, 1<<30))
	case !inURL:
		pcfg.MaxConns = defaultMaxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("processed: open: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("processed: open %s: %w", endpoint(pcfg), err)
	}
	cfg.MaxConns = 0 // said to the pool; New refuses it
	s, err := New(pool, cfg)
	if err != nil {
		pool.Close()
		return nil, err
	}
	s.pool = pool
	// The schema, and the table's layout if it has one: a table that is
	// not migrated yet is Migrate's to make; one whose layout disagrees
	// with cfg is refused.
	if _, err := s.statements(ctx); err != nil && !errors.Is(err, consumer.ErrNotMigrated) {
		pool.Close()
		return nil, err
	}
	return s, nil
}

// endpoint names the database for messages, without credentials.
func endpoint(c *pgxpool.Config) string {
	cc := c.ConnConfig
	return fmt.Sprintf("database %q on %s:%d as %q", cc.Database, cc.Host, cc.Port, cc.User)
}
