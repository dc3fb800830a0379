package redisstream

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/internal/wire"
)

// DefaultURL is the server used when a config leaves URL empty.
const DefaultURL = "redis://127.0.0.1:6379/0"

// Defaults for Config, PublisherConfig and BrowserConfig.
const (
	// idField is the entry field holding the message id: Publisher writes
	// Message.ID there, and the Source reads it back.
	idField = "idempotency-key"
	// defaultBodyField is the entry field holding the body.
	defaultBodyField = "body"
	// defaultStartID is where a consumer group that does not exist yet
	// starts: "0", the beginning of the stream.
	defaultStartID = "0"
	// defaultMinIdle is how long an entry must have been pending, without
	// a keep-alive, before another consumer may claim it.
	defaultMinIdle = 30 * time.Second
	// defaultClaimInterval is how often a Source looks for entries to
	// claim (XAUTOCLAIM) and for entries of its own it lost track of.
	defaultClaimInterval = 5 * time.Second
	// defaultBlock is how long one XREADGROUP waits for new entries.
	defaultBlock = 2 * time.Second
	// defaultDialTimeout bounds each connection attempt.
	defaultDialTimeout = 5 * time.Second
	// defaultWindow is the window of a Source no runtime configured: the
	// runtime's default Concurrency.
	defaultWindow = 8
	// releasedConsumer is the consumer name Close hands a Source's
	// unacked entries to, marked idle for so long that any consumer's next
	// XAUTOCLAIM takes them.
	releasedConsumer = "idemq.released"
	// dlqSuffix is appended to a stream's name to name its dead-letter
	// stream.
	dlqSuffix = ".dlq"

	maxWindow = 10_000
	// releasedIdle is the idle time Close gives released entries: ten
	// years, past any MinIdle.
	releasedIdle = 10 * 365 * 24 * time.Hour
)

// DLQName returns the default dead-letter stream of stream:
// "<stream>.dlq".
func DLQName(stream string) string { return stream + dlqSuffix }

// fallbackID is the message id of an entry without the id field:
// "<stream>/<entry id>". It deduplicates redeliveries of that entry (a
// claim after a crash, a nack), NOT duplicates made by producers: a
// producer's retry is a new entry with a new entry id, and is applied again.
func fallbackID(stream, entryID string) string { return stream + "/" + entryID }

// Config configures a Source. The zero value of every optional field selects
// the documented default.
//
// The runtime's Concurrency, BatchSize and Logger are not restated here:
// consumer.New passes them to the Source through Configure.
type Config struct {
	// URL is the server's URL, redis://[[user]:password@]host[:port][/db]
	// or rediss:// for TLS. Defaults to DefaultURL,
	// redis://127.0.0.1:6379/0. The password never appears in errors or
	// logs.
	URL string
	// Stream is the stream to consume. Required. NewSource creates it
	// (XGROUP CREATE ... MKSTREAM) if it does not exist.
	Stream string
	// Group is the consumer group. Members of one group split the
	// stream's entries; each group gets every entry. Required. NewSource
	// creates it if it does not exist, at StartID.
	Group string
	// Consumer names this Source within the group. Two live Sources must
	// never share a name. A fixed name lets a restarted process take back
	// its own pending entries at once instead of after MinIdle. Defaults
	// to a generated "<host>-<random>" name, unique per Source.
	Consumer string
	// StartID is where NewSource creates the group when it does not
	// exist: "0" (the whole stream, so that nothing published before the
	// first consumer started is skipped; re-reading is safe, the dedup
	// store skips what was applied), "$" (only entries added from now on)
	// or an entry id. It has no effect on an existing group. Defaults to
	// "0".
	StartID string

	// MinIdle is how long an entry must have been pending, without being
	// read, claimed or kept alive, before another consumer of the group
	// may claim it (XAUTOCLAIM): the time after which a consumer that
	// died is presumed dead. A live Source keeps the entries it holds
	// alive (see KeepAlive), so MinIdle need not exceed the runtime's
	// handler and retry time; with KeepAlive disabled it must, or a slow
	// message is handled twice at once (still applied once: dedup). At
	// least 1s. Defaults to 30s.
	MinIdle time.Duration
	// KeepAlive is how often the Source resets the idle time of the
	// entries it holds (XCLAIM ... JUSTID to itself, only for entries it
	// still owns), like NATS's InProgress, so that no other consumer
	// claims an entry whose handler is still running or retrying. It must
	// be less than MinIdle/2. Defaults to MinIdle/3; -1 disables it.
	KeepAlive time.Duration
	// ClaimInterval is how often the Source claims entries idle for
	// MinIdle (XAUTOCLAIM) and re-delivers entries of its own it lost
	// track of (a reply lost with a connection). It also does both when
	// it starts. Defaults to 5s.
	ClaimInterval time.Duration
	// Block is how long one XREADGROUP waits on the server for new
	// entries. Receive's context and Close end a wait at once; Block
	// only paces claims on an idle stream. Defaults to 2s.
	Block time.Duration

	// BodyField is the entry field holding the body. Defaults to "body".
	BodyField string

	// DeadLetter configures the Source's dead-letterer (see
	// Source.DeadLetterer): its stream, by default DLQName(Stream), and
	// its envelope options.
	DeadLetter DeadLetterConfig

	// RequireAOF makes NewSource fail unless the server reports
	// appendonly yes and appendfsync always (CONFIG GET), the only
	// setting under which an acknowledged write, a dead letter or an
	// XACK, survives a crash of the server. Without it, NewSource only
	// logs a warning when the server says otherwise. Defaults to false.
	RequireAOF bool
	// DialTimeout bounds each connection attempt. Defaults to 5s.
	DialTimeout time.Duration
}

// DeadLetterConfig configures the Source's dead-letterer (Config.DeadLetter).
type DeadLetterConfig struct {
	// Stream is the stream dead letters are added to. It must differ
	// from the Source's stream. Defaults to DLQName(Config.Stream),
	// "<stream>.dlq".
	Stream string
	// MaxLen, if positive, caps the dead-letter stream (XADD MAXLEN ~),
	// dropping the oldest dead letters. Defaults to 0: no cap, which is
	// what "nothing is lost" needs.
	MaxLen int64
	// Options tune the failure envelope. Defaults to the zero
	// dlq.Options: unsigned envelopes.
	Options dlq.Options
}

func (c Config) withDefaults() Config {
	if c.URL == "" {
		c.URL = DefaultURL
	}
	if c.Consumer == "" {
		c.Consumer = generatedConsumer()
	}
	if c.StartID == "" {
		c.StartID = defaultStartID
	}
	if c.MinIdle == 0 {
		c.MinIdle = defaultMinIdle
	}
	if c.KeepAlive == 0 {
		c.KeepAlive = c.MinIdle / 3
	}
	if c.ClaimInterval == 0 {
		c.ClaimInterval = defaultClaimInterval
	}
	if c.Block == 0 {
		c.Block = defaultBlock
	}
	c.mappingDefaults()
	if c.DeadLetter.Stream == "" {
		c.DeadLetter.Stream = DLQName(c.Stream)
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = defaultDialTimeout
	}
	return c
}

func (c *Config) mappingDefaults() {
	if c.BodyField == "" {
		c.BodyField = defaultBodyField
	}
}

func configError(field, format string, args ...any) error {
	return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// prefixField qualifies the field of a *consumer.ConfigError.
func prefixField(prefix string, err error) error {
	var ce *consumer.ConfigError
	if errors.As(err, &ce) {
		return &consumer.ConfigError{Field: prefix + ce.Field, Reason: ce.Reason}
	}
	return err
}

var entryIDRE = regexp.MustCompile(`^[0-9]+(-[0-9]+)?$`)

func (c Config) validate() error {
	switch {
	case c.Stream == "":
		return configError("Stream", "required")
	case c.Group == "":
		return configError("Group", "required")
	case c.Consumer == releasedConsumer:
		return configError("Consumer", "%q is reserved for the entries Close releases", releasedConsumer)
	case c.StartID != "0" && c.StartID != "$" && !entryIDRE.MatchString(c.StartID):
		return configError("StartID", "%q: use \"0\", \"$\" or an entry id such as 1700000000000-0", c.StartID)
	case c.MinIdle < time.Second:
		return configError("MinIdle", "%s, at least 1s", c.MinIdle)
	case c.KeepAlive < 0 && c.KeepAlive != -1:
		return configError("KeepAlive", "%s is negative; -1 disables it", c.KeepAlive)
	case c.KeepAlive > 0 && c.KeepAlive >= c.MinIdle/2:
		return configError("KeepAlive", "%s is not less than MinIdle/2 (%s): a held entry could be claimed between two keep-alives", c.KeepAlive, c.MinIdle/2)
	case c.ClaimInterval < 0:
		return configError("ClaimInterval", "negative")
	case c.Block < time.Millisecond:
		return configError("Block", "%s, at least 1ms (0 selects the default)", c.Block)
	case c.DeadLetter.Stream == c.Stream:
		return configError("DeadLetter.Stream", "%q is the Source's own stream: dead letters would be consumed again", c.Stream)
	case c.DeadLetter.MaxLen < 0:
		return configError("DeadLetter.MaxLen", "negative")
	case c.DialTimeout < 0:
		return configError("DialTimeout", "negative")
	}
	if err := validateBodyField(c.BodyField); err != nil {
		return err
	}
	_, err := parseURL(c.URL)
	return err
}

func validateBodyField(bodyField string) error {
	if bodyField == idField || bodyField == wire.KeyHeader {
		return configError("BodyField", "%q is the id or the key field", bodyField)
	}
	return nil
}

// parseURL parses a redis:// or rediss:// URL without ever putting the URL
// (and its password) into an error: net/url's errors quote the whole URL.
func parseURL(raw string) (*redis.Options, error) {
	if _, err := url.Parse(raw); err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, configError("URL", "cannot parse the URL: %v (percent-encode reserved characters in the user name and password)", redact.Error(err, raw))
	}
	opt, err := redis.ParseURL(raw)
	if err != nil {
		return nil, configError("URL", "%v", redact.Error(err, raw))
	}
	return opt, nil
}

// newClient makes a client for raw with the given pool size. Retries are
// off: a command whose reply was lost is not silently sent again (an XADD
// would add a second entry); the callers recover themselves.
func newClient(raw string, dialTimeout time.Duration, poolSize int) (*redis.Client, error) {
	opt, err := parseURL(raw)
	if err != nil {
		return nil, err
	}
	opt.MaxRetries = -1
	opt.DialTimeout = dialTimeout
	if poolSize > 0 {
		opt.PoolSize = poolSize
	}
	return redis.NewClient(opt), nil
}

// connectErr describes a failure to reach the server at raw, without its
// password.
func connectErr(raw string, err error) error {
	return fmt.Errorf("redisstream: cannot reach Redis at %s: %w", redact.URL(raw), redact.Error(err, raw))
}

// checkAOF reads the server's persistence settings. ok reports appendonly
// yes with appendfsync always; detail says what the server reported, or why
// it could not be read (CONFIG renamed away, say).
func checkAOF(ctx context.Context, rdb *redis.Client) (ok bool, detail string) {
	vals, err := rdb.ConfigGet(ctx, "append*").Result()
	if err != nil {
		return false, "CONFIG GET failed: " + err.Error()
	}
	ao, fs := vals["appendonly"], vals["appendfsync"]
	return ao == "yes" && fs == "always", fmt.Sprintf("appendonly %q, appendfsync %q", ao, fs)
}

func generatedConsumer() string {
	host, _ := os.Hostname()
	if host == "" {
		host = "idemq"
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}
