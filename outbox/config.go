package outbox

import (
	"fmt"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
)

// Defaults for Config.
const (
	DefaultSchema         = "public"
	DefaultTable          = "outbox"
	DefaultPurgeBatchSize = 1000
)

// MaxIdentifierLen is the longest Schema or Table accepted, in bytes. It
// leaves room for the suffixes appended to Table (such as "_migrations")
// within Postgres's 63-byte identifier limit.
const MaxIdentifierLen = pgmigrate.MaxIdentifierLen

// Config names the outbox table. The zero value selects public.outbox.
type Config struct {
	// Schema holds the table. Migrate creates it if it is missing. It
	// must be a plain identifier (letters, digits and underscores, not
	// starting with a digit, at most MaxIdentifierLen bytes); it is always
	// quoted, so it is case-sensitive. Defaults to "public".
	Schema string
	// Table is the outbox table's name, with the same rules as Schema.
	// Table+"_migrations" tracks applied migrations. Defaults to "outbox".
	Table string
	// PurgeBatchSize is the number of rows Purge deletes per statement.
	// Defaults to 1000.
	PurgeBatchSize int
}

func (c Config) withDefaults() Config {
	if c.Schema == "" {
		c.Schema = DefaultSchema
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.PurgeBatchSize == 0 {
		c.PurgeBatchSize = DefaultPurgeBatchSize
	}
	return c
}

func (c Config) validate() error {
	if err := validIdent("Schema", c.Schema); err != nil {
		return err
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
