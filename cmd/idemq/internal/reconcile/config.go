// Package reconcile joins what the producers of a chain of services
// recorded in their outboxes with what the consumers recorded in their
// dedup tables, over a time window, and reports what does not match:
// messages published but never applied, messages applied twice, outbox rows
// stuck unsent, dedup rows of unknown origin, and messages applied but not
// forwarded under their derived key. It is what `idemq reconcile` runs, and
// the chaos harness can call Run too.
//
// It only reads: every query runs in a READ ONLY transaction, pages with a
// keyset over an index (the outbox's sent and pending partial indexes, the
// dedup table's (consumer COLLATE "C", processed_at) index) and looks rows
// up in batches by primary key or unique index.
package reconcile

import (
	"context"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
)

// The defaults of Config's fields, which their doc comments state.
const (
	defaultWindow      = 24 * time.Hour
	defaultGrace       = 5 * time.Minute
	defaultPageSize    = 1000
	maxPageSize        = 100000
	defaultSampleLimit = 10
	defaultOutbox      = "outbox"
	defaultDedup       = "processed_messages"
)

// DB is a database: a *pgxpool.Pool or a *pgx.Conn. Run begins a READ
// ONLY transaction on it for each query and rolls it back.
type DB interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// Table names a table. Schema defaults to the connection's
// current_schema(), the first existing schema of its search_path.
type Table struct {
	Schema, Name string
}

// String returns "schema.table", unquoted, for messages.
func (t Table) String() string { return t.Schema + "." + t.Name }

func (t Table) quoted() string { return pgx.Identifier{t.Schema, t.Name}.Sanitize() }

// Database is one service's database: its outbox and its dedup table.
type Database struct {
	// Name is how flows refer to the database: letters, digits, '_', '-'
	// and '.'. Required, unique.
	Name string
	// DB is the connection. Required. Several Databases may share one
	// (services in schemas of one database).
	DB DB
	// Outbox is the outbox table (package outbox), read when the database
	// is a producer in a Flow or the outbox side of a Forward. Its Name
	// defaults to "outbox", its Schema to the connection's current schema.
	Outbox Table
	// Dedup is the dedup table (package processed), read when the
	// database is a consumer's. Its Name defaults to "processed_messages",
	// its Schema to the connection's current schema.
	Dedup Table
}

// Flow is a delivery: the outbox rows of the database Producer for
// Destination are published by a relay and applied by the consumer named
// Consumer, which records a dedup row in one of ConsumerDatabases.
type Flow struct {
	// Producer names the Database whose outbox holds the messages.
	// Required.
	Producer string
	// Destination is the outbox rows' destination (a queue, topic,
	// subject or stream key). Required.
	Destination string
	// Consumer is the consumer's name: the dedup scope, consumer.Config's
	// Name. Required.
	Consumer string
	// ConsumerDatabases name the Databases where Consumer records its
	// dedup rows: one, or several when the consumer is sharded. A message
	// applied in two of them is applied twice. Required.
	ConsumerDatabases []string
}

// String is the flow as `idemq reconcile --flow` takes it.
func (f Flow) String() string {
	return f.Producer + ":" + f.Destination + "->" + joinNames(f.ConsumerDatabases) + ":" + f.Consumer
}

// Forward says that a consumer forwards what it applies: for each dedup
// row of Consumer in one of ConsumerDatabases, the same transaction wrote
// an outbox row with message id keys.ChildKey(the row's message id, Step)
// for Destination into the outbox of one of OutboxDatabases.
type Forward struct {
	// Consumer is the consumer's name. Required.
	Consumer string
	// ConsumerDatabases name the Databases of Consumer's dedup rows to
	// check. Required.
	ConsumerDatabases []string
	// OutboxDatabases name the Databases whose outbox must hold the
	// forwarded row: usually the consumer's own. Required.
	OutboxDatabases []string
	// Destination is the forwarded rows' destination. Required.
	Destination string
	// Step is the step name the child id derives from (keys.ChildKey).
	// Required.
	Step string
}

// String is the forward as `idemq reconcile --flow` takes it.
func (f Forward) String() string {
	return joinNames(f.ConsumerDatabases) + ":" + f.Consumer + "=>" + joinNames(f.OutboxDatabases) + ":" + f.Destination + "@" + f.Step
}

func joinNames(names []string) string {
	s := ""
	for i, n := range names {
		if i > 0 {
			s += ","
		}
		s += n
	}
	return s
}

// Progress is what Run has read so far, for a progress line.
type Progress struct {
	// Phase is "sent", "dedup" or "pending": which pass is reading.
	Phase string
	// Database is the Database being read.
	Database string
	// Rows counts the rows the pass has read in Database so far.
	Rows int64
}

// Config configures Run. The zero value of each optional field is a
// working default.
type Config struct {
	// Databases are the services' databases. Required.
	Databases []Database
	// Flows are the deliveries between them. At least one Flow or
	// Forward is required.
	Flows []Flow
	// Forwards are the derived-key forwards to check.
	Forwards []Forward
	// Since is the start of the window (inclusive): outbox rows sent and
	// dedup rows processed from then on are checked. Defaults to 24 hours
	// before Until.
	Since time.Time
	// Until is the end of the window (exclusive). Defaults to now; a time
	// after now is now. The window ends earlier, at now minus Grace, if
	// that is earlier.
	Until time.Time
	// Grace is how old a row must be to be judged: a message sent less
	// than Grace ago may still be in flight, an unsent row younger than
	// Grace is not stuck. It also covers the clocks of the databases
	// differing, and the lag of a consumer at the outbox's purge horizon.
	// Defaults to 5 minutes.
	Grace time.Duration
	// PageSize is the number of rows each page reads, and the size of each
	// batch looked up by key. Defaults to 1000; at most 100000.
	PageSize int
	// SampleLimit bounds the samples the Report keeps of each kind of
	// discrepancy. Defaults to 10.
	SampleLimit int
	// DeadLettered holds, by consumer name, message ids known to be in
	// the consumer's dead-letter queue. A message published but never
	// applied whose id is among them counts as dead-lettered, not as never
	// applied. Defaults to none: every such message counts as never
	// applied.
	DeadLettered map[string][]string
	// Progress, if set, is called after each page.
	Progress func(Progress)
	// Now returns the current time. Defaults to time.Now.
	Now func() time.Time
	// Logger defaults to discarding.
	Logger *slog.Logger
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)

func configError(field, format string, args ...any) error {
	return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// withDefaults fills in the defaults; now is the run's start.
func (c Config) withDefaults(now time.Time) Config {
	if c.Until.IsZero() || c.Until.After(now) {
		c.Until = now
	}
	if c.Since.IsZero() {
		c.Since = c.Until.Add(-defaultWindow)
	}
	if c.Grace == 0 {
		c.Grace = defaultGrace
	}
	if c.PageSize == 0 {
		c.PageSize = defaultPageSize
	}
	if c.SampleLimit == 0 {
		c.SampleLimit = defaultSampleLimit
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	dbs := make([]Database, len(c.Databases))
	for i, d := range c.Databases {
		if d.Outbox.Name == "" {
			d.Outbox.Name = defaultOutbox
		}
		if d.Dedup.Name == "" {
			d.Dedup.Name = defaultDedup
		}
		dbs[i] = d
	}
	c.Databases = dbs
	return c
}

// validate checks a Config with its defaults filled in.
func (c Config) validate() error {
	switch {
	case c.Grace < 0:
		return configError("Grace", "%s, must not be negative", c.Grace)
	case c.PageSize < 1 || c.PageSize > maxPageSize:
		return configError("PageSize", "%d, want 1 to %d", c.PageSize, maxPageSize)
	case c.SampleLimit < 0:
		return configError("SampleLimit", "%d, must not be negative", c.SampleLimit)
	case !c.Since.Before(c.Until):
		return configError("Since", "%s is not before Until (%s, or now if Until is later)", c.Since.UTC().Format(time.RFC3339), c.Until.UTC().Format(time.RFC3339))
	case len(c.Databases) == 0:
		return configError("Databases", "required")
	case len(c.Flows) == 0 && len(c.Forwards) == 0:
		return configError("Flows", "give at least one Flow or Forward")
	}
	names := map[string]bool{}
	for i, d := range c.Databases {
		field := fmt.Sprintf("Databases[%d]", i)
		switch {
		case !nameRE.MatchString(d.Name):
			return configError(field+".Name", "%q: want letters, digits, '_', '-' or '.'", d.Name)
		case names[d.Name]:
			return configError(field+".Name", "%q given twice", d.Name)
		case d.DB == nil:
			return configError(field+".DB", "required (database %q)", d.Name)
		}
		names[d.Name] = true
		for _, t := range []struct {
			field string
			t     Table
		}{{".Outbox", d.Outbox}, {".Dedup", d.Dedup}} {
			if t.t.Schema != "" {
				if err := pgmigrate.ValidIdent(field+t.field+".Schema", t.t.Schema); err != nil {
					return err
				}
			}
			if err := pgmigrate.ValidIdent(field+t.field+".Name", t.t.Name); err != nil {
				return err
			}
		}
	}
	known := func(field string, list []string) error {
		if len(list) == 0 {
			return configError(field, "required")
		}
		for j, n := range list {
			if !names[n] {
				return configError(field, "no database named %q", n)
			}
			if slices.Contains(list[:j], n) {
				return configError(field, "%q given twice", n)
			}
		}
		return nil
	}
	// A consumer has one set of databases, whichever flow names it.
	consumerDBs := map[string][]string{}
	sameDBs := func(field, name string, dbs []string) error {
		sorted := slices.Sorted(slices.Values(dbs))
		if prev, ok := consumerDBs[name]; ok && !slices.Equal(prev, sorted) {
			return configError(field, "consumer %q is given the databases %v here and %v elsewhere: give a consumer the same databases everywhere", name, sorted, prev)
		}
		consumerDBs[name] = sorted
		return nil
	}
	for i, f := range c.Flows {
		field := fmt.Sprintf("Flows[%d]", i)
		switch {
		case f.Destination == "":
			return configError(field+".Destination", "required")
		case f.Consumer == "":
			return configError(field+".Consumer", "required")
		}
		if err := known(field+".Producer", []string{f.Producer}); err != nil {
			return err
		}
		if err := known(field+".ConsumerDatabases", f.ConsumerDatabases); err != nil {
			return err
		}
		if err := sameDBs(field+".ConsumerDatabases", f.Consumer, f.ConsumerDatabases); err != nil {
			return err
		}
		for j, g := range c.Flows[:i] {
			if g.Producer == f.Producer && g.Destination == f.Destination && g.Consumer == f.Consumer {
				return configError(field, "the same flow as Flows[%d] (%s)", j, g)
			}
		}
	}
	for i, f := range c.Forwards {
		field := fmt.Sprintf("Forwards[%d]", i)
		switch {
		case f.Consumer == "":
			return configError(field+".Consumer", "required")
		case f.Destination == "":
			return configError(field+".Destination", "required")
		case f.Step == "":
			return configError(field+".Step", "required: the step name of keys.ChildKey")
		}
		if err := known(field+".ConsumerDatabases", f.ConsumerDatabases); err != nil {
			return err
		}
		if err := known(field+".OutboxDatabases", f.OutboxDatabases); err != nil {
			return err
		}
		// A forward may check only some of a sharded consumer's
		// databases: each shard with its own outbox.
		if prev, ok := consumerDBs[f.Consumer]; ok {
			for _, d := range f.ConsumerDatabases {
				if !slices.Contains(prev, d) {
					return configError(field+".ConsumerDatabases", "%q is not one of consumer %q's databases %v", d, f.Consumer, prev)
				}
			}
		}
	}
	for name := range c.DeadLettered {
		if name == "" {
			return configError("DeadLettered", "a consumer name is empty")
		}
	}
	return nil
}
