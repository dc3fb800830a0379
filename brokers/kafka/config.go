package kafka

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkamsg"
	kafkago "github.com/segmentio/kafka-go"
)

// Defaults for Config and PublisherConfig.
const (
	defaultCommitInterval    = time.Second
	defaultMaxInFlight       = 256
	defaultDrainTimeout      = 5 * time.Second
	defaultSessionTimeout    = 30 * time.Second
	defaultHeartbeatInterval = 3 * time.Second
	defaultRebalanceTimeout  = 30 * time.Second
	defaultJoinGroupBackoff  = time.Second
	defaultFetchMaxWait      = 500 * time.Millisecond
	defaultFetchMaxBytes     = 10 << 20
	defaultBatchTimeout      = time.Millisecond
	defaultWriteTimeout      = 10 * time.Second
)

// Config configures a Source. The zero value of every optional field selects
// the documented default.
type Config struct {
	// Brokers are the bootstrap brokers' host:port addresses. Required.
	Brokers []string
	// Topic is the topic to consume. Required.
	Topic string
	// GroupID is the Kafka consumer group. Members of one group split the
	// topic's partitions and share committed offsets. Required.
	GroupID string

	// CommitInterval is how often the highest contiguous acked offset of
	// each partition is committed. Offsets are also committed when a
	// rebalance takes the partitions away and on Close. A crash loses at
	// most an interval's worth of commits; those records are re-read and
	// deduplicated. Defaults to 1s.
	CommitInterval time.Duration
	// MaxInFlight is the number of records of one partition that may be
	// handed out and not yet committable (acked, with every earlier record
	// acked too). Fetching from the partition pauses at the limit.
	// Defaults to 256, or to the runtime's window (Concurrency×BatchSize,
	// which consumer.New passes to Configure) if that is larger, so that
	// one partition can keep every worker busy. An explicit value is kept
	// whatever the window. It is not the runtime's window said again: it
	// bounds one partition's records, including acked ones stuck behind an
	// unacked one (the commit point), which the window does not count.
	MaxInFlight int
	// DrainTimeout is how long, when a rebalance ends this member's
	// generation, the Source waits for messages already handed out to be
	// acked before it commits and lets the group move on. Messages still
	// unsettled then are abandoned: their acks return
	// consumer.ErrDeliveryStale and the partition's next owner re-reads
	// them. It must be less than RebalanceTimeout. Defaults to 5s.
	DrainTimeout time.Duration
	// StartOffset is where to start reading a partition that has no
	// committed offset: kafka-go's FirstOffset or LastOffset. Defaults to
	// FirstOffset.
	StartOffset int64

	// SessionTimeout is the group session timeout: a member not heard from
	// for this long is removed from the group. Defaults to 30s.
	SessionTimeout time.Duration
	// HeartbeatInterval is the time between heartbeats; it must be less
	// than SessionTimeout. Defaults to 3s.
	HeartbeatInterval time.Duration
	// RebalanceTimeout is how long the coordinator waits for members to
	// rejoin during a rebalance. Defaults to 30s.
	RebalanceTimeout time.Duration
	// JoinGroupBackoff is the wait before rejoining the group after an
	// error. Defaults to 1s.
	JoinGroupBackoff time.Duration
	// FetchMaxWait is how long a fetch waits on the broker for new
	// records. Defaults to 500ms.
	FetchMaxWait time.Duration
	// FetchMaxBytes bounds one fetch response per partition. Defaults to
	// 10 MiB.
	FetchMaxBytes int

	// DeadLetter configures the Source's dead-letterer (see
	// Source.DeadLetterer): its topic, by default DLQName(Topic), and its
	// envelope options. NewSource validates it. The zero value
	// dead-letters to "<Topic>.dlq" with unsigned envelopes.
	// A Topic longer than 245 bytes needs DeadLetter.Topic set: the
	// default name would be too long for Kafka, and NewSource rejects it.
	DeadLetter DeadLetterConfig

	// Dialer opens broker connections, for TLS or SASL. Defaults to
	// kafka-go's DefaultDialer.
	Dialer *kafkago.Dialer
}

func (c Config) withDefaults() Config {
	if c.CommitInterval == 0 {
		c.CommitInterval = defaultCommitInterval
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = defaultMaxInFlight
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = defaultDrainTimeout
	}
	if c.StartOffset == 0 {
		c.StartOffset = kafkago.FirstOffset
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
	if c.JoinGroupBackoff == 0 {
		c.JoinGroupBackoff = defaultJoinGroupBackoff
	}
	if c.FetchMaxWait == 0 {
		c.FetchMaxWait = defaultFetchMaxWait
	}
	if c.FetchMaxBytes == 0 {
		c.FetchMaxBytes = defaultFetchMaxBytes
	}
	if c.Dialer == nil {
		c.Dialer = kafkago.DefaultDialer
	}
	return c
}

func bad(field, format string, args ...any) error {
	return &consumer.ConfigError{Field: "kafka." + field, Reason: fmt.Sprintf(format, args...)}
}

// validate checks a Config that already has its defaults.
func (c Config) validate() error {
	if err := validBrokers(c.Brokers); err != nil {
		return err
	}
	if err := validTopic(c.Topic); err != nil {
		return bad("Topic", "%v", err)
	}
	switch {
	case c.GroupID == "":
		return bad("GroupID", "required")
	case c.CommitInterval < 0:
		return bad("CommitInterval", "negative")
	case c.MaxInFlight < 0:
		return bad("MaxInFlight", "%d, must be positive", c.MaxInFlight)
	case c.DrainTimeout < 0:
		return bad("DrainTimeout", "negative")
	case c.StartOffset != kafkago.FirstOffset && c.StartOffset != kafkago.LastOffset:
		return bad("StartOffset", "%d, must be kafka.FirstOffset or kafka.LastOffset", c.StartOffset)
	case c.SessionTimeout < 0 || c.HeartbeatInterval < 0 || c.RebalanceTimeout < 0 || c.JoinGroupBackoff < 0:
		return bad("SessionTimeout", "negative group timeout")
	case c.HeartbeatInterval >= c.SessionTimeout:
		return bad("HeartbeatInterval", "%s is not less than SessionTimeout %s", c.HeartbeatInterval, c.SessionTimeout)
	case c.DrainTimeout >= c.RebalanceTimeout:
		return bad("DrainTimeout", "%s is not less than RebalanceTimeout %s", c.DrainTimeout, c.RebalanceTimeout)
	case c.FetchMaxWait < 0:
		return bad("FetchMaxWait", "negative")
	case c.FetchMaxBytes < 0:
		return bad("FetchMaxBytes", "negative")
	}
	return nil
}

// validTopic checks name against Kafka's rules for topic names.
func validTopic(name string) error { return kafkamsg.ValidTopic(name) }

func validBrokers(brokers []string) error {
	if len(brokers) == 0 {
		return bad("Brokers", "required")
	}
	for i, b := range brokers {
		if b == "" {
			return bad(fmt.Sprintf("Brokers[%d]", i), "empty")
		}
	}
	return nil
}

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// Brokers are the bootstrap brokers' host:port addresses. Required.
	Brokers []string
	// BatchTimeout is how long a write waits for more messages to fill a
	// batch. Publish is synchronous, so this adds to its latency.
	// Defaults to 1ms.
	BatchTimeout time.Duration
	// WriteTimeout bounds each produce request. Defaults to 10s.
	WriteTimeout time.Duration
	// AllowAutoTopicCreation lets writes to a missing topic create it,
	// where the broker allows that. Defaults to false.
	AllowAutoTopicCreation bool
	// Transport carries the requests, for TLS or SASL. Defaults to a
	// transport owned, and closed, by the Publisher.
	Transport *kafkago.Transport
	// Logger receives kafka-go's logs at debug level. Defaults to a
	// logger that discards everything.
	Logger *slog.Logger
}

func (c PublisherConfig) withDefaults() PublisherConfig {
	if c.BatchTimeout == 0 {
		c.BatchTimeout = defaultBatchTimeout
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = defaultWriteTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c PublisherConfig) validate() error {
	if err := validBrokers(c.Brokers); err != nil {
		return err
	}
	switch {
	case c.BatchTimeout < 0:
		return bad("BatchTimeout", "negative")
	case c.WriteTimeout < 0:
		return bad("WriteTimeout", "negative")
	}
	return nil
}
