package processed

import (
	"fmt"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
	"github.com/idemq/idemq/internal/pgpurge"
)

// The defaults of Config's fields, which their doc comments state.
const (
	defaultTable          = "processed_messages"
	defaultMaxConns       = 20
	defaultPurgeBatchSize = 1000
	defaultPurgePause     = 10 * time.Millisecond
	defaultPurgeDutyCycle = 0.25
)

// Config configures a Store. The zero value selects the table
// processed_messages in the connection's current schema (usually public).
type Config struct {
	// Schema holds the dedup table. Migrate creates it if it is missing.
	// It must be a plain identifier (letters, digits and underscores, not
	// starting with a digit, at most 48 bytes, which leaves room for the
	// suffixes the store appends, such as "_migrations"); it is always
	// quoted, so it is case-sensitive. Defaults to the connection's
	// current_schema(): the first schema of its search_path that exists,
	// so a search_path set in the URL or on the role is honoured.
	Schema string
	// Table is the dedup table's name, with the same rules as Schema. The
	// store also uses Table+"_migrations" to track applied migrations.
	// Defaults to "processed_messages".
	Table string
	// PurgeBatchSize is the number of rows Purge deletes per statement;
	// each batch is its own short transaction. Defaults to 1000.
	PurgeBatchSize int
	// PurgePause is how long Purge waits between two batches, so that
	// deleting a large backlog of expired rows (the first purge after
	// retention is turned on, or after a janitor outage) yields to the
	// consumers instead of competing with them flat out. It bounds Purge
	// to about PurgeBatchSize rows per PurgePause: with the defaults, at
	// most 100,000 rows a second, in practice about half that. Defaults to
	// 10ms; -1 for no fixed pause.
	PurgePause time.Duration
	// PurgeDutyCycle is the largest share of its time Purge spends
	// deleting: after a batch that took d, it waits at least
	// d*(1-PurgeDutyCycle)/PurgeDutyCycle, if that is longer than
	// PurgePause. Batches slow down when the database is busy, so the
	// purge then backs off further, by itself. Defaults to 0.25 (wait at
	// least three times as long as the batch took): with ten million
	// expired rows, a purge running beside a consumer cost it 4% of its
	// throughput at 0.25 and 14-15% with no duty cycle. 1 turns it off;
	// with PurgePause -1 as well, Purge runs flat out.
	PurgeDutyCycle float64

	// Partitioned asks Migrate for the partitioned layout, in which old
	// rows go a generation at a time instead of row by row: the rows live
	// in three generations, tables with a primary key each; every claim
	// inserts into the current one, after finding its id in neither of the
	// others. The janitor's upkeep (Maintain) rotates them once the
	// current one has been current for half the longest purge age the
	// consumers record and the oldest may be retired (every consumer with
	// rows in it has purged past its end, see Purge): the oldest is
	// retired and emptied with a TRUNCATE that no claim waits for, and an
	// empty table becomes current. Rows so live between their consumer's
	// retention and about one and a half times the longest. Migrate
	// converts a plain table, which becomes the generation before the
	// first, keeping its rows. The upkeep needs to own the tables.
	// Defaults to false: one plain table, whose purge deletes rows in
	// batches.
	//
	// The store reads the table's layout once, when first used: a store
	// without Partitioned refuses a partitioned table, and one with it
	// reports a plain table as not migrated until Migrate converts it.
	Partitioned bool

	// ShardKeyInPrimaryKey asks Migrate to make the dedup key (consumer,
	// shard_key, message_id) instead of (consumer, message_id), for a
	// distributed Postgres such as Citus: it distributes a table by a
	// column that every unique index must hold, and keeps ON CONFLICT and
	// whole single-node transactions for rows co-located by it. Distribute
	// the table by shard_key, co-located with your business tables (see
	// docs/sharding.md). Every claim then needs a shard key, which only a
	// Sharded gives (one shard, for a Citus coordinator; the runtime stops
	// on a claim without one), and an id is unique per consumer and key: a
	// message must keep its key when redelivered, as Message.Key and a
	// ShardMap.Key of the message do. Plain layout only. Defaults to false.
	//
	// As with Partitioned, the store reads the table's key once: a store
	// without the field refuses a table keyed so, and one with it reports
	// a table that is not as not migrated until Migrate converts it.
	ShardKeyInPrimaryKey bool

	// MaxConns sizes the pool Open makes (pgxpool's MaxConns): each of a
	// runtime's Concurrency workers holds one connection for its
	// transaction, and its janitor one more. Defaults to the URL's
	// pool_max_conns if it has one, else 20: room for a runtime at
	// Concurrency 16 with its janitor, or two at the default Concurrency
	// (connections are opened as they are needed, so an idle or lightly
	// loaded consumer holds fewer). Setting both is an error. Only Open
	// uses it: with New, the pool you pass decides.
	MaxConns int
}

// pace is how Purge spaces its batches.
func (c Config) pace() pgpurge.Pace {
	return pgpurge.Pace{Pause: max(c.PurgePause, 0), Duty: c.PurgeDutyCycle}
}

func (c Config) withDefaults() Config {
	if c.Table == "" {
		c.Table = defaultTable
	}
	if c.PurgeBatchSize == 0 {
		c.PurgeBatchSize = defaultPurgeBatchSize
	}
	if c.PurgePause == 0 {
		c.PurgePause = defaultPurgePause
	}
	if c.PurgeDutyCycle == 0 {
		c.PurgeDutyCycle = defaultPurgeDutyCycle
	}
	return c
}

func (c Config) validate() error {
	if c.Schema != "" {
		if err := validIdent("Schema", c.Schema); err != nil {
			return err
		}
	}
	if c.MaxConns < 0 {
		return &consumer.ConfigError{Field: "MaxConns", Reason: fmt.Sprintf("%d is negative", c.MaxConns)}
	}
	if err := validIdent("Table", c.Table); err != nil {
		return err
	}
	if c.PurgePause < 0 && c.PurgePause != -1 {
		return &consumer.ConfigError{Field: "PurgePause", Reason: fmt.Sprintf("%s: must be positive, or -1 for no pause", c.PurgePause)}
	}
	if !(c.PurgeDutyCycle > 0 && c.PurgeDutyCycle <= 1) {
		return &consumer.ConfigError{Field: "PurgeDutyCycle", Reason: fmt.Sprintf("%g: must be in (0, 1]; 1 turns it off", c.PurgeDutyCycle)}
	}
	if c.PurgeBatchSize < 1 {
		return &consumer.ConfigError{Field: "PurgeBatchSize", Reason: fmt.Sprintf("%d, must be positive", c.PurgeBatchSize)}
	}
	if c.ShardKeyInPrimaryKey && c.Partitioned {
		return &consumer.ConfigError{Field: "ShardKeyInPrimaryKey", Reason: "the partitioned layout keeps (consumer, message_id) as its key: set one of the two"}
	}
	return nil
}

func validIdent(field, s string) error { return pgmigrate.ValidIdent(field, s) }
