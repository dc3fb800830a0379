package consumer

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/idemq/idemq/consumer/dedup"
)

// Config configures a Runtime. The zero value of every optional field selects
// the default its doc states; New validates the rest.
//
// Two defaults depend on which handler is set:
//
//	             Handler   BatchHandler
//	BatchSize    32        100
//	BatchWait    0         5ms
//
// With a Handler, a lane groups only the deliveries already waiting when it
// starts a transaction, so a delivery that arrives alone is applied alone, at
// once; a BatchHandler is called for whole batches, so it waits a little to
// fill them.
type Config struct {
	// Name is the consumer's name and its dedup scope: two consumers with
	// different names each apply a message once. Required; at most 200
	// bytes.
	Name string
	// Source delivers the messages. Required. The runtime closes it when
	// Run returns.
	Source Source
	// Store is the Postgres handle: it begins each message's transaction
	// and records its claim in it. Required; use processed.Open (or
	// processed.New over a pool of your own). Its pool should hold at
	// least Concurrency connections, one more with Retention; New logs a
	// warning if it holds fewer. Through a proxy that pools connections
	// per transaction (PgBouncer in pool_mode=transaction), the database
	// URL needs default_query_exec_mode=exec (or simple_protocol): with
	// pgx's default, cached prepared statements, Run stops with the error
	// of StatementCacheError.
	Store dedup.Store
	// Handler applies a message's effect. Set exactly one of Handler and
	// BatchHandler.
	Handler Handler
	// BatchHandler applies the effects of a batch of new messages at once;
	// it turns on batch mode. Set exactly one of Handler and BatchHandler.
	BatchHandler BatchHandler
	// Middleware wraps Handler, first outermost. It cannot be used with
	// BatchHandler.
	Middleware []Middleware
	// DeadLetterer receives messages that cannot be applied: failed
	// messages must be stored somewhere durable before they are acked.
	// Defaults to the Source's own dead-letterer (see Source), which every
	// adapter in brokers/ has, writing where its configuration says
	// (Config.DeadLetter; memory's SubscribeOptions.DeadLetter); required
	// with any other Source. Set it only to send dead letters somewhere
	// else (a table, say).
	DeadLetterer DeadLetterer

	// MessageID extracts the dedup id. Defaults to Message.ID (the
	// broker's message id).
	MessageID func(*Message) (string, error)
	// OrderingKey returns a message's ordering key (see Message.Key).
	// Defaults to Message.Key as the Source filled it in. Set it to order
	// by something else: a header a foreign producer writes, a NATS
	// subject, a Kafka record key. The runtime sets Message.Key to its
	// result as each message is received, so hooks, the handler and a
	// dead letter see the key the message was ordered by (a dlq replay
	// keeps that key). Publishers other than Kafka's carry Message.Key,
	// so a message requeued from the dead-letter queue reaches it again
	// with that key: on those brokers the function must give a message
	// whose key it made the same key, or a sharded store claims the
	// requeued message under another. A panic is logged and leaves
	// Message.Key as it was.
	OrderingKey func(*Message) string
	// Concurrency is the number of messages handled at once, or in batch
	// mode the number of batches. Defaults to 8. Messages with the same Key
	// are still handled one at a time, in order. With a ShardedStore it is
	// per shard: each shard has Concurrency lanes, and the source's window
	// grows with the shard count.
	Concurrency int
	// BatchSize is the most deliveries one transaction holds. Above 1,
	// deliveries are grouped: claimed with one statement and applied in
	// one transaction, the Handler called for each new one in turn (or
	// the BatchHandler once for all), then acked together. A failing
	// message is isolated by splitting the group, so it never sinks the
	// others and nothing is applied twice; a deadlock or serialization
	// failure is retried whole once, then message by message, and makes
	// the lanes shrink their groups for a while (see docs/batch-mode.md,
	// "Hot rows").
	//
	// Defaults to 32 with Handler and 100 with BatchHandler (see the table
	// above): under load many messages share one commit. At most 10,000.
	//
	// 1 gives strict one transaction per message. Choose it for handlers
	// that hold locks for long or call out of process: in a group, a
	// handler's transaction stays open while the handlers after it run,
	// and when a later message fails, the earlier ones run again (in a
	// fresh transaction, so only effects outside it, such as HTTP calls,
	// repeat).
	BatchSize int
	// BatchWait is the longest a partly filled group waits for more
	// deliveries. Defaults to 0 with Handler (only deliveries already
	// waiting are grouped) and to 5ms with BatchHandler; -1 asks for no
	// wait with a BatchHandler too.
	BatchWait time.Duration
	// MaxBodyBytes is the largest body handled; larger ones are
	// dead-lettered as ClassTooLarge. Defaults to 1 MiB; -1 disables the
	// limit.
	MaxBodyBytes int
	// MaxIDBytes is the longest usable message id; a longer one is
	// dead-lettered as ClassMissingID. Defaults to 512.
	MaxIDBytes int
	// HandlerTimeout bounds each handler attempt. Defaults to 0: no
	// timeout.
	HandlerTimeout time.Duration

	// Retry bounds in-process retries of handler errors.
	Retry RetryConfig

	// ShutdownTimeout is how long Run waits, once its context is done, for
	// in-flight messages to finish. Then their contexts are cancelled with
	// cause ErrShutdown, their transactions roll back and they are
	// requeued; a COMMIT already sent is not cancelled, and Run waits for
	// its answer (see SlowCommit). Defaults to 30s.
	ShutdownTimeout time.Duration
	// SlowCommit is how long a COMMIT may wait for the database's answer
	// before the runtime logs a warning, and another with its duration
	// once it returns; HookCommit measures every COMMIT. A synchronous
	// standby that is slow or gone, a saturated disk or a lock taken at
	// commit shows there first. The runtime never cancels a COMMIT, not
	// even at a hard stop: Postgres answers a cancelled COMMIT that waits
	// for a synchronous standby by committing locally and reporting
	// success, which would ack a commit the standbys may not have. A
	// COMMIT whose connection is lost has an unknown outcome, and is never
	// acked. Defaults to 1s; -1 disables the warning.
	SlowCommit time.Duration

	// Retention, if positive, runs a janitor that calls Store.Purge with
	// it every JanitorInterval. Defaults to 0: no janitor.
	//
	// If the Source has a RedeliveryHorizon method (see Source), the
	// janitor never purges a row the
	// source could still redeliver the message of: it purges only rows
	// older than both Retention and the source's RedeliveryHorizon minus
	// HorizonMargin, skips the purge while the source cannot tell, and
	// warns when the horizon is older than the retention. It also records
	// the ages of the duplicates it sees, and what it purged, in the Store
	// if the Store has a RecordRetention method (see dedup.Store), for `idemq
	// status` to weigh the retention against.
	Retention time.Duration
	// JanitorInterval is the time between purges, and between the
	// Store's upkeep (its Maintain method: on the partitioned layout of the dedup
	// table, retiring and rotating its generations). Defaults to 10m.
	JanitorInterval time.Duration
	// HorizonMargin is how much older than the Source's redelivery horizon
	// a row must be to be purged: room for the skew between the broker's
	// timestamps and the database's clock, and for the time between
	// reading the horizon and the purge's cutoff. Only with a
	// Source with a RedeliveryHorizon. Defaults to 5m; -1 for none (for
	// tests).
	HorizonMargin time.Duration

	// Logger receives the runtime's logs. Defaults to a logger that
	// discards everything.
	Logger *slog.Logger
	// Hooks receive events for metrics and tracing; see Hook.
	Hooks []Hook
}

// RetryConfig bounds retries of handler errors. Errors made by Permanent and
// handler panics are never retried. Each attempt runs in a fresh transaction.
//
// A transient error is retried with exponential backoff until MaxElapsed
// has passed since the first failure or MaxAttempts attempts were made,
// whichever comes first; then the message is dead-lettered. With the
// defaults the time bound governs: a message that keeps failing is retried
// for 45 to 60 seconds (about 15 attempts), long enough to ride out a short
// downstream blip instead of dead-lettering everything that arrives during
// it. Meanwhile it holds its key and one of the Concurrency slots.
type RetryConfig struct {
	// MaxAttempts is the total number of handler attempts, the first
	// included. Defaults to 25; 1 disables retries.
	MaxAttempts int
	// InitialInterval is the first backoff delay. Defaults to 100ms.
	InitialInterval time.Duration
	// MaxInterval caps each delay (before a random jitter of ±50%).
	// Defaults to 10s.
	MaxInterval time.Duration
	// MaxElapsed caps the time spent retrying one message, from its first
	// failure. Defaults to 1m.
	MaxElapsed time.Duration
	// MaxConnLosses is how many times one message's transaction may lose
	// its database connection, while the database stays reachable, before
	// the message is dead-lettered as ClassRetryableExhausted: a message
	// that deterministically costs its connection (a statement that kills
	// its backend, idle_in_transaction_session_timeout under a slow
	// handler) is poison. Losses while the database is unreachable (an
	// outage, a restart) never count: those are retried for as long as it
	// takes. Defaults to 5.
	MaxConnLosses int
}

// Defaults for Config, each stated in its field's doc.
const (
	defaultConcurrency     = 8
	defaultMaxBodyBytes    = 1 << 20
	defaultMaxIDBytes      = 512
	defaultShutdownTimeout = 30 * time.Second
	defaultSlowCommit      = time.Second
	defaultJanitorInterval = 10 * time.Minute
	defaultHorizonMargin   = 5 * time.Minute
	defaultMaxAttempts     = 25
	defaultInitialInterval = 100 * time.Millisecond
	defaultMaxInterval     = 10 * time.Second
	defaultMaxElapsed      = time.Minute
	defaultMaxConnLosses   = 5
	defaultGroupSize       = 32
	defaultBatchSize       = 100
	defaultBatchWait       = 5 * time.Millisecond
	maxBatchSize           = 10_000
	maxNameLen             = 200
)

// withDefaults returns a copy of c with defaults filled in.
func (c Config) withDefaults() Config {
	if c.MessageID == nil {
		c.MessageID = idFromMessage
	}
	if d, ok := c.Source.(deadLetterSource); ok && c.DeadLetterer == nil {
		c.DeadLetterer = d.DeadLetterer()
	}
	if c.Concurrency == 0 {
		c.Concurrency = defaultConcurrency
	}
	if c.BatchSize == 0 {
		c.BatchSize = defaultGroupSize
		if c.BatchHandler != nil {
			c.BatchSize = defaultBatchSize
		}
	}
	if c.BatchWait == 0 && c.BatchHandler != nil {
		c.BatchWait = defaultBatchWait
	}
	if c.MaxIDBytes == 0 {
		c.MaxIDBytes = defaultMaxIDBytes
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = defaultMaxBodyBytes
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = defaultShutdownTimeout
	}
	if c.SlowCommit == 0 {
		c.SlowCommit = defaultSlowCommit
	}
	if c.JanitorInterval == 0 {
		c.JanitorInterval = defaultJanitorInterval
	}
	if c.HorizonMargin == 0 {
		c.HorizonMargin = defaultHorizonMargin
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	c.Retry = c.Retry.withDefaults()
	return c
}

func (r RetryConfig) withDefaults() RetryConfig {
	if r.MaxAttempts == 0 {
		r.MaxAttempts = defaultMaxAttempts
	}
	if r.InitialInterval == 0 {
		r.InitialInterval = defaultInitialInterval
	}
	if r.MaxInterval == 0 {
		r.MaxInterval = defaultMaxInterval
	}
	if r.MaxElapsed == 0 {
		r.MaxElapsed = defaultMaxElapsed
	}
	if r.MaxConnLosses == 0 {
		r.MaxConnLosses = defaultMaxConnLosses
	}
	return r
}

func (c Config) validate() error {
	bad := func(field, format string, args ...any) error {
		return &ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case c.Name == "":
		return bad("Name", "required: it is the dedup scope")
	case len(c.Name) > maxNameLen:
		return bad("Name", "%d bytes, more than %d", len(c.Name), maxNameLen)
	case !isText(c.Name):
		return bad("Name", "%q is not valid UTF-8 text without NUL bytes; it is stored in Postgres", c.Name)
	case c.Source == nil:
		return bad("Source", "required")
	case c.Store == nil:
		return bad("Store", "required: use processed.Open")
	case c.Store.MaxConns() == 1 && c.Concurrency > 1:
		return bad("Store", "it has one connection, which is not safe for concurrent use, but Concurrency is %d; "+
			"use processed.Open (or a *pgxpool.Pool), or set Concurrency to 1", c.Concurrency)
	case c.Store.MaxConns() == 1 && c.Retention > 0:
		return bad("Store", "it has one connection, and the janitor that Retention starts would use it concurrently with the worker; use processed.Open (or a *pgxpool.Pool)")
	case c.Handler == nil && c.BatchHandler == nil:
		return bad("Handler", "required (or BatchHandler)")
	case c.Handler != nil && c.BatchHandler != nil:
		return bad("BatchHandler", "set Handler or BatchHandler, not both")
	case c.BatchHandler != nil && len(c.Middleware) > 0:
		return bad("Middleware", "wraps Handler; it cannot wrap a BatchHandler")
	case c.BatchSize < 1 || c.BatchSize > maxBatchSize:
		return bad("BatchSize", "%d, must be between 1 and %d", c.BatchSize, maxBatchSize)
	case c.BatchWait < 0 && c.BatchWait != -1:
		return bad("BatchWait", "%s: must be positive, 0 for the default, or -1 for no wait", c.BatchWait)
	case c.DeadLetterer == nil:
		return bad("DeadLetterer", "required, as the Source has no dead-letterer of its own: failed messages must be stored durably before they are acked")
	case c.Concurrency < 1:
		return bad("Concurrency", "%d, must be at least 1", c.Concurrency)
	case c.MaxBodyBytes < -1:
		return bad("MaxBodyBytes", "%d, must be positive, or -1 for no limit", c.MaxBodyBytes)
	case c.MaxIDBytes < 1:
		return bad("MaxIDBytes", "%d, must be positive", c.MaxIDBytes)
	case c.HandlerTimeout < 0:
		return bad("HandlerTimeout", "negative")
	case c.ShutdownTimeout < 0:
		return bad("ShutdownTimeout", "negative")
	case c.SlowCommit < -1:
		return bad("SlowCommit", "%s: must be positive, 0 for the default, or -1 to disable the warning", c.SlowCommit)
	case c.Retention < 0:
		return bad("Retention", "negative")
	case c.HorizonMargin < -1:
		return bad("HorizonMargin", "negative, other than -1 for none")
	case c.JanitorInterval < 0:
		return bad("JanitorInterval", "negative")
	case c.Retry.MaxConnLosses < 1:
		return bad("Retry.MaxConnLosses", "%d, must be at least 1", c.Retry.MaxConnLosses)
	case c.Retry.MaxAttempts < 1:
		return bad("Retry.MaxAttempts", "%d, must be at least 1", c.Retry.MaxAttempts)
	case c.Retry.InitialInterval < 0 || c.Retry.MaxInterval < 0 || c.Retry.MaxElapsed < 0:
		return bad("Retry", "negative interval")
	case c.Retry.MaxInterval < c.Retry.InitialInterval:
		return bad("Retry.MaxInterval", "%s is less than InitialInterval %s", c.Retry.MaxInterval, c.Retry.InitialInterval)
	}
	for i, mw := range c.Middleware {
		if mw == nil {
			return bad(fmt.Sprintf("Middleware[%d]", i), "nil")
		}
	}
	for i, h := range c.Hooks {
		if !recognised(h) {
			return bad(fmt.Sprintf("Hooks[%d]", i), "%T implements no Hook interface", h)
		}
	}
	return nil
}
