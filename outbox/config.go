package outbox

import (
	"fmt"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
)

// The defaults of Config's fields, which their doc comments state.
const (
	defaultTable          = "outbox"
	defaultPurgeBatchSize = 1000
)

// Config names the outbox table. The zero value selects the table outbox
// in the connection's current schema (usually public), as processed.Config
// and httpidem.Config do theirs.
type Config struct {
	// Schema holds the table. Migrate creates it if it is missing. It
	// must be a plain identifier (letters, digits and underscores, not
	// starting with a digit, at most 48 bytes); it is always quoted, so
	// it is case-sensitive. Defaults to the connection's current_schema():
	// the first schema of its search_path that exists, so a search_path
	// set in the URL or on the role is honoured. It is learned on first
	// use, from the outbox's handle (from the caller's transaction, for
	// Enqueue); give the same search_path to every handle that uses the
	// table, or set Schema.
	Schema string
	// Table is the outbox table's name, with the same rules as Schema.
	// Table+"_migrations" tracks applied migrations. Defaults to "outbox".
	Table string
	// PurgeBatchSize is the number of rows Purge deletes per statement.
	// Defaults to 1000.
	PurgeBatchSize int
}

func (c Config) withDefaults() Config {
	if c.Table == "" {
		c.Table = defaultTable
	}
	if c.PurgeBatchSize == 0 {
		c.PurgeBatchSize = defaultPurgeBatchSize
	}
	return c
}

func (c Config) validate() error {
	if c.Schema != "" {
		if err := validIdent("Schema", c.Schema); err != nil {
			return err
		}
	}
	if err := validIdent("Table", c.Table); err != nil {
		return err
	}
	if c.PurgeBatchSize < 1 {
		return configError("PurgeBatchSize", "%d, must be positive", c.PurgeBatchSize)
	}
	return nil
}

func validIdent(field, s string) error { return pgmigrate.ValidIdent(field, s) }

func configError(field, format string, args ...any) error {
	return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}
