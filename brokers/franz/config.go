package franz

import (
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// Defaults for Config.
const (
	defaultCommitInterval    = time.Second
	defaultMaxInFlight       = 1024
	defaultDrainTimeout      = 5 * time.Second
	defaultSessionTimeout    = 30 * time.Second
	defaultHeartbeatInterval = 3 * time.Second
	defaultRebalanceTimeout  = 30 * time.Second
	defaultFetchMaxWait      = 500 * time.Millisecond
	defaultCommitTimeout     = 10 * time.Second
)

// Config configures a Source. The zero value of every optional field selects
// the documented default.
type Config struct {
	// Brokers are the bootstrap brokers' host:port addresses. Required.
	Brokers []string
	// Topic is the topic to consume. Required.
	Topic string
	// Group is the Kafka consumer group. Members of one group split the
	// topic's partitions and share committed offsets. Required.
	Group string

	// ResetToLatest makes a group without a committed offset for a
	// partition start at its end rather than its beginning. Defaults to
	// false: the earliest offset.
	ResetToLatest bool

	// CommitInterval is how often the highest contiguous acked offset of
	// each partition is committed. Offsets are also committed when a
	// rebalance revokes partitions and on Close. Defaults to 1s.
	CommitInterval time.Duration
	// CommitTimeout bounds each offset commit. Defaults to 10s.
	CommitTimeout time.Duration
	// MaxInFlight bounds the records fetched and not yet committable
	// (queued, handed out, or acked behind an unacked one), over every
	// partition: no more are polled until some are. Defaults to 1024, or
	// to the runtime's window (Concurrency×BatchSize, which consumer.New
	// passes to Configure) if that is larger. An explicit value is kept
	// whatever the window. It is not the runtime's window said again: it
	// also counts records queued and acked ones stuck behind an unacked
	// one (the commit point), which the window does not.
	MaxInFlight int
	// DrainTimeout is how long a rebalance that revokes partitions waits
	// for their handed-out messages to be settled before committing and
	// letting them go; later acks return consumer.ErrDeliveryStale and the
	// new owner re-reads those records. It must be less than
	// RebalanceTimeout. Defaults to 5s.
	DrainTimeout time.Duration
	// SessionTimeout is the group session timeout. Defaults to 30s.
	SessionTimeout time.Duration
	// HeartbeatInterval is the time between heartbeats; it must be less
	// than SessionTimeout. Defaults to 3s.
	HeartbeatInterval time.Duration
	// RebalanceTimeout is how long the coordinator waits for members to
	// rejoin during a rebalance. Defaults to 30s.
	RebalanceTimeout time.Duration
	// FetchMaxWait is how long a fetch waits on the broker for new
	// records. Defaults to 500ms.
	FetchMaxWait time.Duration

	// Options are extra franz-go client options, for TLS (kgo.DialTLSConfig),
	// SASL (kgo.SASL), client id, rack and so on. They are applied after
	// the Source's own, so they must not change what the Source relies on:
	// the consumer group and topic, manual commits (kgo.DisableAutoCommit),
	// kgo.BlockRebalanceOnPoll, the partition callbacks, and the
	// read_committed isolation level. Defaults to none.
	Options []kgo.Opt
	// DeadLetter configures the Source's dead-letterer (see
	// Source.DeadLetterer): its topic, by default "<Topic>.dlq",
	// and its envelope options. NewSource validates it. The zero value
	// dead-letters to "<Topic>.dlq" with unsigned envelopes.
	// A Topic longer than 245 bytes needs DeadLetter.Topic set: the
	// default name would be too long for Kafka, and NewSource rejects it.
	DeadLetter DeadLetterConfig
}

// DeadLetterConfig configures the Source's dead-letterer, as
// Config.DeadLetter. The zero value dead-letters to "<Topic>.dlq", with
// unsigned envelopes.
type DeadLetterConfig struct {
	// Topic is the dead-letter topic. It must exist, unless the brokers
	// create topics on first write, and differ from the Source's topic.
	// Defaults to "<Topic>.dlq".
	Topic string
	// Options tune the failure envelope. Defaults to the zero
	// dlq.Options: unsigned envelopes.
	Options dlq.Options
}

func (c Config) withDefaults() Config {
	if c.CommitInterval == 0 {
		c.CommitInterval = defaultCommitInterval
	}
	if c.CommitTimeout == 0 {
		c.CommitTimeout = defaultCommitTimeout
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = defaultMaxInFlight
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = defaultDrainTimeout
	}
	if c.SessionTimeout == 0 {
		c.SessionTimeout = defaultSessionTimeout
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = defaultHeartbeatInterval
	}
	if c.RebalanceTimeout == 0 {
		c.RebalanceTimeout = defaultRebalanceTimeout
	}
	if c.FetchMaxWait == 0 {
		c.FetchMaxWait = defaultFetchMaxWait
	}
	return c
}

func bad(field, format string, args ...any) error {
	return &consumer.ConfigError{Field: "franz." + field, Reason: fmt.Sprintf(format, args...)}
}

// validate checks a Config that already has its defaults.
func (c Config) validate() error {
	if len(c.Brokers) == 0 {
		return bad("Brokers", "required")
	}
	for i, b := range c.Brokers {
		if b == "" {
			return bad(fmt.Sprintf("Brokers[%d]", i), "empty")
		}
	}
	switch {
	case c.Topic == "":
		return bad("Topic", "required")
	case c.Group == "":
		return bad("Group", "required")
	case c.CommitInterval < 0:
		return bad("CommitInterval", "negative")
	case c.CommitTimeout < 0:
		return bad("CommitTimeout", "negative")
	case c.MaxInFlight < 0:
		return bad("MaxInFlight", "%d, must be positive", c.MaxInFlight)
	case c.DrainTimeout < 0:
		return bad("DrainTimeout", "negative")
	case c.SessionTimeout < 0 || c.HeartbeatInterval < 0 || c.RebalanceTimeout < 0:
		return bad("SessionTimeout", "negative group timeout")
	case c.HeartbeatInterval >= c.SessionTimeout:
		return bad("HeartbeatInterval", "%s is not less than SessionTimeout %s", c.HeartbeatInterval, c.SessionTimeout)
	case c.DrainTimeout >= c.RebalanceTimeout:
		return bad("DrainTimeout", "%s is not less than RebalanceTimeout %s", c.DrainTimeout, c.RebalanceTimeout)
	case c.FetchMaxWait < 0:
		return bad("FetchMaxWait", "negative")
	}
	return nil
}
