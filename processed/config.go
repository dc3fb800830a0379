package processed

import (
	"fmt"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
	"github.com/idemq/idemq/internal/pgpurge"
)

// Defaults for Config.
const (
	DefaultTable = "processed_messages"
	// DefaultMaxConns is the size of the pool Open makes when neither
	// Config.MaxConns nor the URL's pool_max_conns sets it: room for a
	// runtime at Concurrency 16 with its janitor, or two at the default
	// Concurrency. Connections are opened as they are needed, so an idle
	// or lightly loaded consumer holds fewer.
	DefaultMaxConns       = 20
	DefaultPurgeBatchSize = 1000
	DefaultPurgePause     = 10 * time.Millisecond
	DefaultPurgeDutyCycle = 0.25
	// DefaultPartitionInterval is the time range of one partition of a
	// partitioned table.
	DefaultPartitionInterval = 24 * time.Hour
	// DefaultPartitionsAhead is how many partitions past the current one
	// Migrate and EnsurePartitions create.
	DefaultPartitionsAhead = 2
)

// MaxIdentifierLen is the longest Schema or Table accepted, in bytes. It
// leaves room for the suffixes the store appends (such as "_migrations")
// within Postgres's 63-byte identifier limit.
const MaxIdentifierLen = pgmigrate.MaxIdentifierLen

// Config configures a Store. The zero value selects the table
// processed_messages in the connection's current schema (usually public).
type Config struct {
	// Schema holds the dedup table. Migrate creates it if it is missing.
	// It must be a plain identifier (letters, digits and underscores, not
	// starting with a digit, at most MaxIdentifierLen bytes); it is always
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

	// Partitioned makes the dedup table a range-partitioned table, one
	// partition per PartitionInterval of claim time (processed_at), so
	// that Purge drops whole partitions instead of deleting rows.
	// Uniqueness across partitions, which Postgres cannot enforce without
	// the partition key in the index, is kept by the claim: it takes a
	// transaction-scoped advisory lock on a hash of (consumer, message id)
	// before it looks the id up in every partition and inserts it, so two
	// claims of one id serialise and the second finds the first; past
	// partitions are sealed and looked up through Bloom filters of their
	// ids (SealPartitions). Migrate
	// creates the partitioned table (converting a plain one: see
	// Migrate) and a DEFAULT partition, so a claim never fails for want of
	// a partition; the janitor creates partitions ahead (EnsurePartitions).
	// Defaults to false: one plain table with a primary key.
	Partitioned bool
	// PartitionInterval is the time range of one partition: at least a
	// second, a whole number of seconds; an hour or more in production.
	// A claim of a new id probes the index of the current partition, of
	// any past one the janitor has not sealed yet, and of the DEFAULT
	// partition, and a Bloom filter of each sealed one (see
	// SealPartitions); a partition should hold fewer than about 34
	// million ids for its filter to stay accurate.
	// Rows live between the retention and the retention plus one
	// interval, since Purge drops a partition once all of it is older
	// than the retention. Only with Partitioned. Defaults to 24h.
	PartitionInterval time.Duration
	// FilterCacheBytes bounds the memory the store spends holding the
	// Bloom filters of sealed partitions (see CacheFilters), about 2.5
	// bytes per sealed id: with all of them held, a claim of a new id
	// tests them in memory instead of reading the filter table, and costs
	// about what it costs on a plain table. The cache is used only when
	// the filters of every sealed partition fit. Only a partitioned table
	// has them. Defaults to DefaultFilterCacheBytes (256 MiB); -1 turns
	// the cache off.
	FilterCacheBytes int64

	// MaxConns sizes the pool Open makes (pgxpool's MaxConns): each of a
	// runtime's Concurrency workers holds one connection for its
	// transaction, and its janitor one more. Defaults to the URL's
	// pool_max_conns if it has one, else DefaultMaxConns; setting both is
	// an error. Only Open uses it: with New, the pool you pass decides.
	MaxConns int
}

// pace is how Purge spaces its batches.
func (c Config) pace() pgpurge.Pace {
	return pgpurge.Pace{Pause: max(c.PurgePause, 0), Duty: c.PurgeDutyCycle}
}

func (c Config) withDefaults() Config {
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.PurgeBatchSize == 0 {
		c.PurgeBatchSize = DefaultPurgeBatchSize
	}
	if c.PurgePause == 0 {
		c.PurgePause = DefaultPurgePause
	}
	if c.PurgeDutyCycle == 0 {
		c.PurgeDutyCycle = DefaultPurgeDutyCycle
	}
	if c.FilterCacheBytes == 0 {
		c.FilterCacheBytes = DefaultFilterCacheBytes
	}
	if c.Partitioned && c.PartitionInterval == 0 {
		c.PartitionInterval = DefaultPartitionInterval
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
	if c.PartitionInterval != 0 && !c.Partitioned {
		return &consumer.ConfigError{Field: "PartitionInterval", Reason: "set without Partitioned"}
	}
	if c.Partitioned && (c.PartitionInterval < time.Second || c.PartitionInterval%time.Second != 0) {
		return &consumer.ConfigError{Field: "PartitionInterval", Reason: fmt.Sprintf("%s: must be a whole number of seconds, at least 1s", c.PartitionInterval)}
	}
	if c.FilterCacheBytes < -1 {
		return &consumer.ConfigError{Field: "FilterCacheBytes", Reason: fmt.Sprintf("%d: must be positive, or -1 for no cache", c.FilterCacheBytes)}
	}
	if c.PurgeBatchSize < 1 {
		return &consumer.ConfigError{Field: "PurgeBatchSize", Reason: fmt.Sprintf("%d, must be positive", c.PurgeBatchSize)}
	}
	return nil
}

func validIdent(field, s string) error { return pgmigrate.ValidIdent(field, s) }
