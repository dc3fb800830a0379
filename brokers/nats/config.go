package natsjs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/redact"
)

// Defaults for Config, PublisherConfig and BrowserConfig.
const (
	// defaultAckWait is how long JetStream waits for an ack before it
	// redelivers; the Source's keep-alive (InProgress every AckWait/3)
	// holds it off while a handler runs.
	defaultAckWait = 30 * time.Second
	// defaultNakDelay is how long JetStream waits before it redelivers a
	// message the runtime gave back (Nack with requeue).
	defaultNakDelay = time.Second
	// defaultWindow is the window of a Source no runtime configured
	// (Configure never called): the runtime's default Concurrency, 8.
	defaultWindow = 8
	// dialTimeout bounds each attempt to reach one server, and so what a
	// server that answers nothing (cut off by a partition) costs a
	// connection before the next server is tried: nats.go's own default.
	// With 10 s, a Source started during a partition could wait 10 s per
	// silent server (TestNewSourceWhileAServerIsCutOff).
	dialTimeout = 2 * time.Second
	// headerMsgID is JetStream's deduplication header, Nats-Msg-Id: the
	// Publisher sets it from Message.ID and the Source reads Message.ID
	// from it.
	headerMsgID = jetstream.MsgIDHeader
	// dlqSuffix is appended to Config.Subject to name the default
	// dead-letter subject.
	dlqSuffix = ".dlq"
	// DLQStreamSuffix is appended to Config.Stream to name the stream
	// Config.Topology declares for the dead letters.
	DLQStreamSuffix = "_DLQ"
)

// Keys of consumer.Message.Metadata set by Source and Browser.
const (
	MetaStream       = "stream"
	MetaConsumer     = "consumer"
	MetaSubject      = "subject"
	MetaStreamSeq    = "stream_seq"
	MetaConsumerSeq  = "consumer_seq"
	MetaNumDelivered = "num_delivered"
	MetaNumPending   = "num_pending"
)

// DLQSubject returns the default dead-letter subject of subject:
// subject + ".dlq".
func DLQSubject(subject string) string { return subject + dlqSuffix }

// Config configures a Source. The zero value of every optional field selects
// a documented default.
//
// The runtime's Concurrency, BatchSize and Logger are not restated here:
// consumer.New passes them to the Source through Configure.
type Config struct {
	// URL is the server's URL, or a comma-separated list of them.
	// Credentials may be given in it (nats://user:password@host:4222) or
	// through Options; they never appear in errors or logs. Defaults to
	// nats.DefaultURL, nats://127.0.0.1:4222.
	URL string
	// Options are extra connection options (credentials files, TLS, a
	// connection name...), applied after the Source's own: reconnecting
	// forever (nats.MaxReconnects(-1)), 2 s to reach each server, a ping
	// every 5 s with 2 outstanding at most, and writes that give up after
	// 5 s, so that a server cut off by a partition is left within 15 s. An
	// option that makes the client give up reconnecting makes Receive
	// return an error once the connection is closed for good. Defaults
	// to none.
	Options []nats.Option
	// Stream is the JetStream stream to consume. Required. It must exist,
	// unless Topology is set.
	Stream string
	// Subject is the consumer's filter subject; it may hold wildcards.
	// Defaults to "": every subject of the stream. Without a Subject (or
	// with a wildcard one) DeadLetter.Subject has no default and must be
	// set.
	Subject string
	// Durable names the durable pull consumer, which holds the Source's
	// position in the stream; Sources with the same Durable share its
	// messages. Required. The first Receive creates it if missing, or
	// updates its AckWait, MaxAckPending and MaxDeliver; a new one starts
	// at the beginning of the stream.
	Durable string
	// Topology, if set, is declared by NewSource before anything else:
	// the stream and its dead-letter stream are created if missing (an
	// existing one is never modified; it is an error if it does not
	// capture the subjects asked for). Defaults to nil: NewSource declares
	// nothing, and both streams must already exist.
	Topology *Topology
	// DeadLetter configures the Source's dead-letterer, see
	// Source.DeadLetterer. Its Subject defaults to DLQSubject(Subject).
	// NewSource fails unless some stream captures it.
	DeadLetter DeadLetterConfig

	// AckWait is how long JetStream waits for an ack before it
	// redelivers. While the runtime holds a delivery the Source sends
	// InProgress every AckWait/3, so a slow handler is not redelivered
	// under itself; a process that dies stops the keep-alive and its
	// messages come back after AckWait. At least 1s. Defaults to
	// 30s.
	AckWait time.Duration
	// MaxAckPending is the most deliveries JetStream hands out without an
	// ack, across every Source sharing Durable. 0, the default, sizes it
	// from the runtime: twice the window consumer.New passes to Configure
	// (Concurrency × BatchSize), or 16 without a runtime. A
	// positive value is used as is. Negative values (JetStream's
	// "unlimited") are rejected. It is not the runtime's window said
	// again: it is the durable consumer's, shared by every process
	// consuming it, so a fleet can fix one bound for all.
	MaxAckPending int
	// MaxDeliver caps JetStream's deliveries of one message. Defaults to
	// -1, unlimited, which is what idemq wants: the runtime retries and
	// dead-letters a failing message itself, so a delivery count only
	// grows through crashes, lost acks and shutdowns, and a message
	// JetStream stops delivering is stranded in the stream (with only a
	// MAX_DELIVERIES advisory to show for it), neither applied nor
	// dead-lettered. If you set it, set it large. 0 means the default;
	// values below -1, and 1 (never redeliver), are rejected.
	MaxDeliver int
	// NakDelay is how long JetStream waits before it redelivers a message
	// the runtime gave back (Nack with requeue, at shutdown say).
	// Defaults to 1s. Negative values are rejected.
	NakDelay time.Duration
}

// DeadLetterConfig configures the Source's dead-letterer (Config.DeadLetter,
// see Source.DeadLetterer).
type DeadLetterConfig struct {
	// Subject is the subject dead letters are published to. Some stream
	// must capture it (NewSource checks), and the Source must not consume
	// it. Defaults to DLQSubject(Config.Subject), "<subject>.dlq"; required
	// when Config.Subject is empty or has wildcards.
	Subject string
	// Options tune the failure envelope: Host, MaxErrorBytes, MaxHistory,
	// and SigningKey to sign it. Defaults to the zero dlq.Options:
	// unsigned envelopes.
	Options dlq.Options
}

// Topology is what Config.Topology declares: a work stream and a separate
// stream for its dead letters. The zero value declares a file-backed,
// single-replica stream named Config.Stream capturing Config.Subject, and a
// stream named Config.Stream + "_DLQ" capturing the dead-letter subject.
//
// Both use JetStream's default limits retention: an acked message stays in
// the work stream until MaxAge (or a limit of your own) removes it, so that
// other durables can read it too; a dead letter stays until a Browser's ack
// deletes it (dlq.Replay and dlq.Requeue do). Streams declared otherwise
// work the same, with two cautions: the dead-letter stream must not use
// work-queue retention (the Browser reads it with an ordered consumer), and
// a work-queue work stream allows only one durable per subject.
type Topology struct {
	// Subjects the work stream captures. Defaults to []string{Config.Subject};
	// required when Config.Subject is empty.
	Subjects []string
	// DeadLetterStream names the stream that captures
	// Config.DeadLetter.Subject. Defaults to Config.Stream + "_DLQ".
	DeadLetterStream string
	// Storage of both streams. Defaults to jetstream.FileStorage: the
	// stream survives a server restart. Memory storage loses every
	// message, unconsumed ones and dead letters included, when the server
	// restarts: use it for tests only.
	Storage jetstream.StorageType
	// Replicas of both streams. Defaults to 1.
	Replicas int
	// Duplicates is the work stream's duplicate window: a message
	// published with the Nats-Msg-Id of one stored within it is
	// discarded by the server. Defaults to the server's, 2 minutes.
	// Deduplication beyond it is the runtime's job.
	Duplicates time.Duration
	// MaxAge bounds how long the streams keep messages. Defaults to 0:
	// forever.
	MaxAge time.Duration
}

// withDefaults fills in the defaults. MaxAckPending and Logger are left as
// they are: 0 and nil mean "from Configure".
func (c Config) withDefaults() Config {
	if c.URL == "" {
		c.URL = nats.DefaultURL
	}
	if c.DeadLetter.Subject == "" && c.Subject != "" && !hasWildcard(c.Subject) {
		c.DeadLetter.Subject = DLQSubject(c.Subject)
	}
	if c.Topology != nil {
		t := *c.Topology // the caller's Topology is not modified
		if len(t.Subjects) == 0 && c.Subject != "" {
			t.Subjects = []string{c.Subject}
		}
		if t.DeadLetterStream == "" {
			t.DeadLetterStream = c.Stream + DLQStreamSuffix
		}
		if t.Replicas == 0 {
			t.Replicas = 1
		}
		c.Topology = &t
	}
	if c.AckWait == 0 {
		c.AckWait = defaultAckWait
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = -1
	}
	if c.NakDelay == 0 {
		c.NakDelay = defaultNakDelay
	}
	return c
}

func configError(field, format string, args ...any) error {
	return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// validate checks a config that has had its defaults applied.
func (c Config) validate() error {
	if err := checkStreamName("Stream", c.Stream); err != nil {
		return err
	}
	if err := checkConsumerName("Durable", c.Durable); err != nil {
		return err
	}
	if c.Subject != "" {
		if err := checkSubject("Subject", c.Subject, true); err != nil {
			return err
		}
	}
	if c.DeadLetter.Subject == "" {
		return configError("DeadLetter.Subject", "required: Subject %q has no default dead-letter subject (it is empty or has wildcards)", c.Subject)
	}
	if err := checkSubject("DeadLetter.Subject", c.DeadLetter.Subject, false); err != nil {
		return err
	}
	if c.Subject == "" || subjectMatches(c.Subject, c.DeadLetter.Subject) {
		// With an empty filter the Source reads every subject of its
		// stream; NewSource checks the dead-letter stream differs.
		if c.Subject != "" {
			return configError("DeadLetter.Subject", "%q matches the Source's Subject %q: dead letters would be consumed again", c.DeadLetter.Subject, c.Subject)
		}
	}
	if t := c.Topology; t != nil {
		if len(t.Subjects) == 0 {
			return configError("Topology.Subjects", "required when Subject is empty")
		}
		for _, s := range t.Subjects {
			if err := checkSubject("Topology.Subjects", s, true); err != nil {
				return err
			}
			if subjectMatches(s, c.DeadLetter.Subject) {
				return configError("Topology.Subjects", "%q captures the dead-letter subject %q in the work stream; name another DeadLetter.Subject", s, c.DeadLetter.Subject)
			}
		}
		if err := checkStreamName("Topology.DeadLetterStream", t.DeadLetterStream); err != nil {
			return err
		}
		switch {
		case t.DeadLetterStream == c.Stream:
			return configError("Topology.DeadLetterStream", "%q is the work stream", t.DeadLetterStream)
		case t.Replicas < 1 || t.Replicas > 5:
			return configError("Topology.Replicas", "%d, must be 1 to 5", t.Replicas)
		case t.Duplicates < 0:
			return configError("Topology.Duplicates", "negative")
		case t.MaxAge < 0:
			return configError("Topology.MaxAge", "negative")
		case t.Storage != jetstream.FileStorage && t.Storage != jetstream.MemoryStorage:
			return configError("Topology.Storage", "unknown storage type %d", t.Storage)
		}
	}
	switch {
	case c.AckWait < time.Second:
		return configError("AckWait", "%s, at least 1s", c.AckWait)
	case c.MaxAckPending < 0:
		return configError("MaxAckPending", "%d is negative; 0 sizes it from the runtime's window", c.MaxAckPending)
	case c.MaxDeliver < -1:
		return configError("MaxDeliver", "%d; -1 (the default) is unlimited", c.MaxDeliver)
	case c.MaxDeliver == 1:
		return configError("MaxDeliver", "1 never redelivers: a crash would strand the message undelivered; use -1 (the default)")
	case c.NakDelay < 0:
		return configError("NakDelay", "negative")
	}
	return checkURL(c.URL)
}

// checkURL parses each of a comma-separated list of server URLs, as the
// client will. The reason never shows a password.
func checkURL(raw string) error {
	for _, u := range strings.Split(raw, ",") {
		u = strings.TrimSpace(u)
		if u == "" {
			return configError("URL", "empty server URL in %q", redactURLs(raw))
		}
		if !strings.Contains(u, "://") {
			u = "nats://" + u
		}
		if _, err := url.Parse(u); err != nil {
			var ue *url.Error
			if errors.As(err, &ue) {
				err = ue.Err // ue.URL would show the password
			}
			return configError("URL", "cannot parse a server URL: %v (percent-encode reserved characters in the user name and password)", err)
		}
	}
	return nil
}

// redactURLs masks the passwords of a comma-separated list of URLs.
func redactURLs(raw string) string {
	parts := strings.Split(raw, ",")
	for i, p := range parts {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		if !strings.Contains(p, "://") {
			parts[i] = redact.URL("nats://" + p)
			continue
		}
		parts[i] = redact.URL(p)
	}
	return strings.Join(parts, ",")
}

// A connection is found dead after maxPingsOut pings sent pingInterval
// apart go unanswered, 10 to 15 s after its server fell silent, or when a
// write has not completed in flusherTimeout.
const (
	pingInterval   = 5 * time.Second
	maxPingsOut    = 2
	flusherTimeout = 5 * time.Second
)

// connect dials rawURL with idemq's default options followed by extra. The
// connection's asynchronous events go to log (nil: nowhere; the client's
// own defaults would print to stderr). Its error names the servers without
// credentials.
func connect(ctx context.Context, rawURL, name string, log func() *slog.Logger, extra []nats.Option) (*nats.Conn, error) {
	if log == nil {
		discard := slog.New(slog.DiscardHandler)
		log = func() *slog.Logger { return discard }
	}
	var forcing atomic.Bool // a ForceReconnect is under way
	opts := []nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.Timeout(dialTimeout),
		// A server cut off by a partition answers nothing, not even a
		// reset: the client finds the connection dead only by its pings.
		// nats.go pings every 2 minutes; a consumer cannot wait that long.
		nats.PingInterval(pingInterval),
		nats.MaxPingsOutstanding(maxPingsOut),
		// Once the socket's buffer is full, a write to such a server
		// blocks, and with it, under the connection's lock, every
		// publish and ack: for a minute by nats.go's default.
		nats.FlusherTimeout(flusherTimeout),
		nats.ErrorHandler(func(nc *nats.Conn, _ *nats.Subscription, err error) {
			log().Warn("natsjs: asynchronous error", slog.Any("error", err))
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() && forcing.CompareAndSwap(false, true) {
				// A write that timed out: the server is not reading.
				// nats.go keeps the connection until its pings fail,
				// and its pings wait behind the blocked writes: tens
				// of seconds. Leave it now; acks and pulls are good on
				// the next connection.
				log().Warn("natsjs: a write to the server timed out; reconnecting", slog.String("server", nc.ConnectedUrlRedacted()))
				go func() {
					defer forcing.Store(false)
					_ = nc.ForceReconnect()
				}()
			}
		}),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log().Warn("natsjs: disconnected; reconnecting", slog.Any("error", err))
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log().Info("natsjs: reconnected", slog.String("server", nc.ConnectedUrlRedacted()))
		}),
	}
	opts = append(opts, extra...)
	type result struct {
		nc  *nats.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		nc, err := nats.Connect(rawURL, opts...)
		ch <- result{nc, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, fmt.Errorf("natsjs: connect to %s: %w", redactURLs(rawURL), redact.Error(r.err, strings.Split(rawURL, ",")...))
		}
		return r.nc, nil
	case <-ctx.Done():
		go func() {
			if r := <-ch; r.nc != nil {
				r.nc.Close()
			}
		}()
		return nil, fmt.Errorf("natsjs: connect to %s: %w", redactURLs(rawURL), ctx.Err())
	}
}

// checkStreamName rejects a stream name JetStream refuses.
func checkStreamName(field, name string) error {
	switch {
	case name == "":
		return configError(field, "required")
	case strings.ContainsAny(name, " \t\r\n.*>/\\"):
		return configError(field, "%q: stream names cannot hold whitespace, '.', '*', '>' or path separators", name)
	case len(name) > 255:
		return configError(field, "%d bytes, at most 255", len(name))
	}
	return nil
}

// checkConsumerName rejects a durable name JetStream refuses.
func checkConsumerName(field, name string) error {
	switch {
	case name == "":
		return configError(field, "required")
	case strings.ContainsAny(name, " \t\r\n.*>/\\"):
		return configError(field, "%q: consumer names cannot hold whitespace, '.', '*', '>' or path separators", name)
	case len(name) > 255:
		return configError(field, "%d bytes, at most 255", len(name))
	}
	return nil
}

// checkSubject rejects a malformed subject; wildcards only if allowed.
func checkSubject(field, s string, wildcards bool) error {
	if s == "" {
		return configError(field, "required")
	}
	if strings.ContainsAny(s, " \t\r\n") {
		return configError(field, "%q holds whitespace", s)
	}
	toks := strings.Split(s, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return configError(field, "%q has an empty token", s)
		case (t == "*" || t == ">") && !wildcards:
			return configError(field, "%q: wildcards are not allowed here", s)
		case t == ">" && i != len(toks)-1:
			return configError(field, "%q: '>' must be the last token", s)
		case len(t) > 1 && strings.ContainsAny(t, "*>"):
			return configError(field, "%q: a wildcard must be a whole token", s)
		}
	}
	return nil
}

func hasWildcard(s string) bool {
	for _, t := range strings.Split(s, ".") {
		if t == "*" || t == ">" {
			return true
		}
	}
	return false
}

// subjectMatches reports whether the literal subject matches filter, which
// may hold wildcards.
func subjectMatches(filter, subject string) bool {
	f := strings.Split(filter, ".")
	s := strings.Split(subject, ".")
	for i, t := range f {
		if t == ">" {
			return len(s) > i
		}
		if i >= len(s) || (t != "*" && t != s[i]) {
			return false
		}
	}
	return len(f) == len(s)
}
