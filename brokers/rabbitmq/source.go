package rabbitmq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/internal/wire"
)

// Keys of consumer.Message.Metadata set by Source.
const (
	MetaRoutingKey  = "routing_key"
	MetaExchange    = "exchange"
	MetaDeliveryTag = "delivery_tag"
	MetaConsumerTag = "consumer_tag"
)

// Defaults for Config.
const (
	// defaultPrefetch is the prefetch of a Source whose Config.Prefetch
	// is 0 and that no runtime configured (Configure was never called):
	// twice the runtime's default Concurrency (8), what the runtime's
	// defaults would ask for.
	defaultPrefetch           = 16
	defaultReconnectInitial   = 100 * time.Millisecond
	defaultReconnectMax       = 30 * time.Second
	maxPrefetch               = 65535 // basic.qos prefetch-count is a short
	consumerCancelCloseWindow = 5 * time.Second
)

// Config configures a Source. The zero value of every optional field selects
// a documented default.
//
// The runtime's Concurrency, BatchSize and Logger are not restated here:
// consumer.New passes them to the Source through Configure.
type Config struct {
	// URL is the broker's AMQP URL, one URL: a comma-separated list is
	// refused (a cluster's other nodes go in FailoverURLs). Defaults to
	// DefaultURL, amqp://guest:guest@127.0.0.1:5672/.
	URL string
	// FailoverURLs are the AMQP URLs of the cluster's other nodes, if
	// any. Every connection, the first and each reconnect, tries the
	// nodes in turn, URL first, starting after the node a connection was
	// last lost to: a consumer whose node dies moves to another node at
	// its first reconnect (Reconnect.InitialInterval later), and the
	// backoff grows only once every node has refused. Use them with
	// quorum queues (Topology.Quorum), which every node serves. Defaults
	// to none.
	FailoverURLs []string
	// Queue is the queue to consume. Required. It must exist: set
	// Topology to have NewSource declare it, or declare it beforehand
	// (DeclareTopology, say).
	Queue string
	// Topology, if set, is declared by NewSource before anything else,
	// exactly as DeclareTopology declares it (idempotent, but an error if
	// a queue already exists with other arguments), on a connection of
	// its own that NewSource closes once the topology is declared. Its
	// Queue defaults to Config.Queue and, if set, must equal it. Defaults
	// to nil: NewSource declares nothing, and Queue and the dead-letter
	// queue must already exist.
	Topology *Topology
	// DeadLetter configures the Source's dead-letterer, see
	// Source.DeadLetterer. Its Queue defaults to Topology.DeadLetterQueue
	// (as DeclareTopology defaults it) when Topology is set, so that a
	// dead-letter queue the topology names is never restated, and to
	// DLQName(Queue) otherwise. NewSource fails unless that queue exists.
	DeadLetter DeadLetterConfig
	// Prefetch is the most deliveries the broker sends without an ack
	// (basic.qos prefetch-count). 0, the default, sizes it from the
	// runtime: twice the window consumer.New passes to Configure
	// (Concurrency × BatchSize), at most 65535, so that a message (or a
	// batch) is waiting whenever a worker frees up. A Source no runtime
	// configures uses 16. A non-zero Prefetch is used as is, whatever the
	// runtime's window (the runtime then caps its batches to what it lets
	// in): leave it 0 unless the broker's unacked deliveries per consumer
	// must be bounded apart from the runtime's settings (the chaos suite
	// pins it so, to bound a killed worker's redeliveries). AMQP reads a prefetch of
	// 0 as unbounded, which idemq never asks for: there is no way to ask
	// for unbounded. At most 65535; negative values are rejected.
	Prefetch int
	// ConsumerTag names the consumer on the broker. Defaults to a
	// generated "idemq-<queue>-<random>" tag.
	ConsumerTag string
	// ConnectionName is shown by the broker's management tools. Defaults
	// to none.
	ConnectionName string

	// Reconnect paces reconnection after the connection or channel is
	// lost.
	Reconnect ReconnectConfig
	// DialTimeout bounds each connection attempt, handshake included.
	// Defaults to 30s.
	DialTimeout time.Duration
}

// ReconnectConfig is an exponential backoff between reconnection attempts.
// Attempts go on until they succeed, Receive's context is done, or the
// Source is closed.
type ReconnectConfig struct {
	// InitialInterval is the first delay. Defaults to 100ms.
	InitialInterval time.Duration
	// MaxInterval caps each delay. Defaults to 30s.
	MaxInterval time.Duration
}

// withDefaults fills in the defaults. Prefetch and Logger are left as they
// are: 0 and nil mean "from Configure".
func (c Config) withDefaults() Config {
	if c.URL == "" {
		c.URL = DefaultURL
	}
	if c.Topology != nil {
		t := *c.Topology // the caller's Topology is not modified
		if t.Queue == "" {
			t.Queue = c.Queue
		}
		t = t.withDefaults()
		c.Topology = &t
	}
	if c.DeadLetter.Queue == "" {
		if c.Topology != nil {
			c.DeadLetter.Queue = c.Topology.DeadLetterQueue
		} else {
			c.DeadLetter.Queue = DLQName(c.Queue)
		}
	}
	if c.Reconnect.InitialInterval == 0 {
		c.Reconnect.InitialInterval = defaultReconnectInitial
	}
	if c.Reconnect.MaxInterval == 0 {
		c.Reconnect.MaxInterval = max(defaultReconnectMax, c.Reconnect.InitialInterval)
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = defaultDialTimeout
	}
	return c
}

func configError(field, format string, args ...any) error {
	return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// prefixField qualifies the field of a *consumer.ConfigError with the
// struct it is in, "Topology." say.
func prefixField(prefix string, err error) error {
	var ce *consumer.ConfigError
	if errors.As(err, &ce) {
		return &consumer.ConfigError{Field: prefix + ce.Field, Reason: ce.Reason}
	}
	return err
}

// validate checks a config that has had its defaults applied.
func (c Config) validate() error {
	if err := checkName("Queue", c.Queue); err != nil {
		return err
	}
	if c.Topology != nil {
		if c.Topology.Queue != c.Queue {
			return configError("Topology.Queue", "%q differs from Queue %q; leave it empty", c.Topology.Queue, c.Queue)
		}
		if err := c.Topology.validate(); err != nil {
			return prefixField("Topology.", err)
		}
	}
	if err := checkName("DeadLetter.Queue", c.DeadLetter.Queue); err != nil {
		return err
	}
	switch {
	case c.DeadLetter.Queue == c.Queue:
		return configError("DeadLetter.Queue", "%q is the Source's own queue: dead letters would be consumed again", c.DeadLetter.Queue)
	case len(c.ConsumerTag) > maxShortstr:
		return configError("ConsumerTag", "%d bytes, more than AMQP's %d-byte limit", len(c.ConsumerTag), maxShortstr)
	case c.Prefetch < 0:
		return configError("Prefetch", "%d is negative; 0 sizes it from the runtime's window", c.Prefetch)
	case c.Prefetch > maxPrefetch:
		return configError("Prefetch", "%d, at most %d", c.Prefetch, maxPrefetch)
	case c.Reconnect.InitialInterval < 0 || c.Reconnect.MaxInterval < 0:
		return configError("Reconnect", "negative interval")
	case c.Reconnect.MaxInterval < c.Reconnect.InitialInterval:
		return configError("Reconnect.MaxInterval", "%s is less than InitialInterval %s", c.Reconnect.MaxInterval, c.Reconnect.InitialInterval)
	case c.DialTimeout < 0:
		return configError("DialTimeout", "negative")
	}
	return checkNodes(c.URL, c.FailoverURLs)
}

// Stats are a Source's counters since it was created.
type Stats struct {
	// Received counts deliveries returned by Receive.
	Received int64
	// Acked and Nacked count successful Ack and Nack calls.
	Acked  int64
	Nacked int64
	// Abandoned counts Ack and Nack calls on deliveries whose channel was
	// gone (lost or closed): the broker redelivers those messages.
	Abandoned int64
	// Reconnects counts sessions opened after a lost one.
	Reconnects int64
	// MultipleAcks counts the multiple acks AckBatch sent, each settling
	// several deliveries in one broker call.
	MultipleAcks int64
}

// Source consumes one RabbitMQ queue. It implements consumer.Source and
// consumer.Source's Configure; create it with NewSource. It is safe for
// concurrent use.
type Source struct {
	cfg   Config
	nodes *nodes
	log   atomic.Pointer[slog.Logger] // set by NewSource, or by Configure before the first Receive
	dl    consumer.DeadLetterer

	life     context.Context // done once Close starts
	stop     context.CancelFunc
	stopOnce sync.Once
	closeErr error

	// connecting is a one-slot semaphore held by whoever opens a session
	// or starts a session's consumer, and by Close while it tears the
	// last session down.
	connecting chan struct{}
	bo         backoff.BackOff // guarded by connecting
	opened     int64           // sessions opened; guarded by connecting

	mu   sync.Mutex
	sess *session // nil when there is no live session
	// started is set, under mu, by the first Receive: from then on every
	// session consumes, and Configure changes nothing.
	started atomic.Bool
	// prefetch is the prefetch in force. Configure may change it, under
	// mu, until started is set; it is constant afterwards.
	prefetch atomic.Int32

	// dlIdle are confirm-mode channels for the dead-letterer, on the
	// connection of the session they were opened on.
	dlMu   sync.Mutex
	dlIdle []*pubChannel

	received, acked, nacked, abandoned, reconnects, multiAcks atomic.Int64
	// backlogUntil is the count of received deliveries at which the
	// backlog found when the current consumer started ends; -1 before
	// the first consumer. See RedeliveryHorizon.
	backlogUntil atomic.Int64
}

// session is one connection and, once the Source consumes, its consumer.
// Deliveries belong to the session that received them.
type session struct {
	conn *amqp.Connection
	node int                       // the index of conn's node in Source.nodes
	cons atomic.Pointer[consuming] // nil until the session consumes
	dead atomic.Bool               // set once the session is known lost or closed

	mu       sync.Mutex
	unacked  map[uint64]bool // tags received and not yet acked; true: committed, ack deferred (see AckBatch)
	deferred int             // the true entries of unacked
	recv     []recvMark      // when the tags were received, for RedeliveryHorizon (horizon.go)
}

// consuming is a session's consumer: a channel with the prefetch set, and
// the deliveries basic.consume streams on it.
type consuming struct {
	ch         *amqp.Channel
	tag        string
	deliveries <-chan amqp.Delivery
	closes     chan *amqp.Error // the channel's NotifyClose, buffered
}

// NewSource validates cfg, declares cfg.Topology if set, and connects: it
// fails fast if the config is invalid, the broker cannot be reached, or
// cfg.Queue or the dead-letter queue (cfg.DeadLetter.Queue) does not exist.
// Later losses are recovered by Receive.
//
// NewSource does not consume yet: basic.qos does not change the prefetch
// of a consumer already started, so the first Receive sets the prefetch
// (as Configure sized it) and starts the consumer. Until then the broker
// pushes the Source nothing, and the queue's messages stay ready for other
// consumers. The connection NewSource opened is kept for the first session
// and for the dead-letterer.
//
// The caller closes the Source (the runtime closes its Source when Run
// returns); Close also closes the dead-letterer's channels.
func NewSource(ctx context.Context, cfg Config) (*Source, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	bo := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(cfg.Reconnect.InitialInterval),
		backoff.WithMaxInterval(cfg.Reconnect.MaxInterval),
		backoff.WithMaxElapsedTime(0),
	)
	life, stop := context.WithCancel(context.Background())
	s := &Source{
		cfg:        cfg,
		life:       life,
		stop:       stop,
		connecting: make(chan struct{}, 1),
		bo:         bo,
		nodes:      newNodes(cfg.URL, cfg.FailoverURLs),
	}
	prefetch := cfg.Prefetch
	if prefetch == 0 {
		prefetch = defaultPrefetch
	}
	s.prefetch.Store(int32(prefetch))
	s.backlogUntil.Store(-1)
	// The runtime's logger comes with Configure; until then, and without
	// a runtime, the Source's logs are discarded.
	s.log.Store(slog.New(slog.DiscardHandler))
	dl, err := dlq.NewDeadLetterer(s.publishDeadLetter, cfg.DeadLetter.Options)
	if err != nil {
		stop()
		return nil, prefixField("DeadLetter.Options.", err)
	}
	s.dl = dl
	if cfg.Topology != nil {
		if err := declareTopology(ctx, s.nodes, cfg.ConnectionName, cfg.DialTimeout, *cfg.Topology); err != nil {
			stop()
			return nil, err
		}
	}
	sess, err := s.open(ctx) // not started: it only connects
	if err == nil {
		err = s.checkQueues(ctx, sess.conn)
		if err != nil {
			_ = sess.shutdown(false)
		}
	}
	if err != nil {
		stop()
		return nil, err
	}
	s.opened++
	s.sess = sess
	return s, nil
}

// checkQueues fails unless the Source's queue and its dead-letter queue
// exist, with passive declares on throwaway channels of conn (a missing
// queue closes the channel it was asked on).
func (s *Source) checkQueues(ctx context.Context, conn *amqp.Connection) error {
	check := func(queue, what, hint string) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		ch, err := conn.Channel()
		if err != nil {
			return fmt.Errorf("rabbitmq: %s %q: open channel: %w", what, queue, err)
		}
		defer func() { _ = ch.Close() }()
		if _, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err != nil {
			return queueCheckError(what, queue, hint, err)
		}
		return nil
	}
	if err := check(s.cfg.Queue, "queue", "declare it: set Config.Topology, or call DeclareTopology"); err != nil {
		return err
	}
	return check(s.cfg.DeadLetter.Queue, "dead-letter queue", fmt.Sprintf(
		"declare it: set Config.Topology, or call DeclareTopology, which declares %s; or name an existing queue in Config.DeadLetter.Queue",
		DLQName(s.cfg.Queue)))
}

// queueCheckError says why checking that a queue exists failed. Only the
// broker's 404 means that it does not exist, and only then does the error
// give hint, how to declare it: a lost connection, a refused access or a
// closing broker say so instead.
func queueCheckError(what, queue, hint string, err error) error {
	var ae *amqp.Error
	isAMQP := errors.As(err, &ae)
	switch {
	case isAMQP && ae.Code == amqp.NotFound:
		return fmt.Errorf("rabbitmq: %s %q does not exist (%s): %w", what, queue, hint, err)
	case isAMQP && ae.Code == amqp.AccessRefused:
		return fmt.Errorf("rabbitmq: the broker refused access to %s %q: check the user's permissions on it: %w", what, queue, err)
	case isAMQP && ae.Code == amqp.ConnectionForced:
		return fmt.Errorf("rabbitmq: the broker closed the connection while checking %s %q (a node shutting down, or an operator): %w", what, queue, err)
	case isClosed(err) || (isAMQP && ae.Code == amqp.FrameError) || errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed):
		// amqp091 reports a failed read of the socket as a 501 frame error.
		return fmt.Errorf("rabbitmq: the connection was lost while checking %s %q, so whether it exists is unknown: %w", what, queue, err)
	}
	return fmt.Errorf("rabbitmq: check %s %q: %w", what, queue, err)
}

// logger returns the Source's logger, with its queue attribute.
func (s *Source) logger() *slog.Logger { return s.log.Load() }

// Receive returns the next delivery. The first call starts the consumer
// (see NewSource). If the connection or channel has been lost it
// reconnects, with backoff, until it succeeds, ctx is done or the Source
// is closed. After Close it returns an error wrapping
// consumer.ErrSourceClosed.
func (s *Source) Receive(ctx context.Context) (consumer.Delivery, error) {
	s.start()
	for {
		if err := s.closedErr(); err != nil {
			return nil, err
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		sess, cons, err := s.consumer(ctx)
		if err != nil {
			return nil, err
		}
		select {
		case d, ok := <-cons.deliveries:
			if !ok {
				s.lost(sess)
				continue
			}
			s.received.Add(1)
			return s.newDelivery(sess, d), nil
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.life.Done():
			return nil, s.closedErr()
		}
	}
}

// Close cancels the consumer and closes the channel and connection. The
// broker requeues every delivery that was not acked, for the next consumer.
// Ack and Nack on deliveries received before Close then return errors
// wrapping consumer.ErrSourceClosed, and so does DeadLetter on the Source's
// dead-letterer (see DeadLetterer), whose channels Close closes too. Close
// is idempotent.
func (s *Source) Close() error {
	s.stopOnce.Do(func() {
		s.stop()
		// Wait for a reconnection in progress; it sees life is done and
		// discards what it opened.
		s.connecting <- struct{}{}
		defer func() { <-s.connecting }()
		s.mu.Lock()
		sess := s.sess
		s.sess = nil
		s.mu.Unlock()
		s.closeDeadLetterChannels()
		if sess != nil {
			// Committed deliveries still waiting for a multiple ack
			// are acked now, not requeued by the channel's close.
			s.flushDeferred(sess, true)
			s.closeErr = sess.shutdown(true)
		}
	})
	return s.closeErr
}

// Window returns the prefetch in force: the most deliveries the broker
// sends this Source unacked.
func (s *Source) Window() int { return int(s.prefetch.Load()) }

// Configure implements consumer.Source's Configure; consumer.New calls it
// once, before the first Receive. Unless Config.Prefetch was set, the
// prefetch becomes 2×set.Window (at most 65535), so that a message or
// batch is waiting whenever a worker frees up; a Window of 0 or less keeps
// the prefetch as it was. The Source logs to set.Logger, with its queue
// attribute. It returns the prefetch in force,
// which is the window the runtime can count on.
//
// Configure is safe to call concurrently with Receive, but once the first
// Receive has started the consumer it has no effect: it changes neither the
// prefetch nor the logger, and returns the prefetch in force.
func (s *Source) Configure(set consumer.SourceSettings) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started.Load() {
		return int(s.prefetch.Load())
	}
	if s.cfg.Prefetch == 0 && set.Window > 0 {
		p := maxPrefetch
		if set.Window <= maxPrefetch/2 {
			p = 2 * set.Window
		}
		s.prefetch.Store(int32(p))
	}
	if set.Logger != nil {
		s.log.Store(set.Logger.With(slog.String("queue", s.cfg.Queue)))
	}
	return int(s.prefetch.Load())
}

// Stats returns the Source's counters.
func (s *Source) Stats() Stats {
	return Stats{
		Received:     s.received.Load(),
		Acked:        s.acked.Load(),
		Nacked:       s.nacked.Load(),
		Abandoned:    s.abandoned.Load(),
		Reconnects:   s.reconnects.Load(),
		MultipleAcks: s.multiAcks.Load(),
	}
}

func (s *Source) closedErr() error {
	if s.life.Err() != nil {
		return fmt.Errorf("rabbitmq: queue %q: %w", s.cfg.Queue, consumer.ErrSourceClosed)
	}
	return nil
}

// start marks the Source started: from now on every session consumes, and
// Configure changes nothing.
func (s *Source) start() {
	if !s.started.Load() {
		s.mu.Lock() // Configure checks started and sets the prefetch under mu
		first := !s.started.Load()
		s.started.Store(true)
		s.mu.Unlock()
		if first {
			s.warnDeliveryLimit()
		}
	}
}

// safeDeliveryLimit is the smallest quorum-queue delivery limit
// (Topology.DeliveryLimit) a Source starts without a warning: RabbitMQ
// 4.x's default, 20.
const safeDeliveryLimit = 20

// warnDeliveryLimit warns when the Source's topology gives its quorum
// queue a delivery limit small enough for lost connections to dead-letter
// messages that were never applied.
func (s *Source) warnDeliveryLimit() {
	t := s.cfg.Topology
	if t == nil || !t.Quorum || t.DeliveryLimit == 0 || t.DeliveryLimit >= safeDeliveryLimit {
		return
	}
	s.logger().Warn(fmt.Sprintf("rabbitmq: the quorum queue's delivery limit is %d: every connection or node lost, and every restart, "+
		"while a message is in flight (up to the prefetch, %d messages) counts as a delivery, and at the limit the broker "+
		"dead-letters it itself, perhaps never applied, without idemq's envelope (idemq dlq reads such dead letters as class broker "+
		"and replays them). idemq retries in the process and needs no broker limit: set Topology.DeliveryLimit to %d or more",
		t.DeliveryLimit, s.prefetch.Load(), safeDeliveryLimit),
		slog.Int("delivery_limit", t.DeliveryLimit), slog.Int("prefetch", int(s.prefetch.Load())))
}

// consumer returns a live session that consumes. A session opened before
// the first Receive (by NewSource, or by a dead letter reconnecting) has no
// consumer yet: consumer starts it.
func (s *Source) consumer(ctx context.Context) (*session, *consuming, error) {
	for {
		sess, err := s.session(ctx)
		if err != nil {
			return nil, nil, err
		}
		if c := sess.cons.Load(); c != nil {
			return sess, c, nil
		}
		c, err := s.startConsuming(ctx, sess)
		if c != nil {
			return sess, c, nil
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, nil, ctxErr
		}
		if closed := s.closedErr(); closed != nil {
			return nil, nil, closed
		}
		// The session could not consume (its connection died, say):
		// retire it, and let session open the next, with backoff.
		s.logger().Warn("rabbitmq: could not start consuming; reconnecting", slog.Any("error", err))
		s.lost(sess)
	}
}

// startConsuming starts sess's consumer, unless another caller did.
func (s *Source) startConsuming(ctx context.Context, sess *session) (*consuming, error) {
	select {
	case s.connecting <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.life.Done():
		return nil, s.closedErr()
	}
	defer func() { <-s.connecting }()
	if err := s.closedErr(); err != nil {
		return nil, err
	}
	if c := sess.cons.Load(); c != nil {
		return c, nil
	}
	if sess.dead.Load() {
		return nil, errors.New("connection lost")
	}
	c, err := s.consume(sess.conn)
	if err != nil {
		return nil, err
	}
	// Should sess have been retired meanwhile, its connection is closed
	// and with it c's delivery stream, which Receive then sees end.
	sess.cons.Store(c)
	return c, nil
}

// session returns the live session, opening a new one (with backoff) if
// there is none. It consumes if the Source has started.
func (s *Source) session(ctx context.Context) (*session, error) {
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	if sess != nil {
		return sess, nil
	}
	select {
	case s.connecting <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.life.Done():
		return nil, s.closedErr()
	}
	defer func() { <-s.connecting }()
	for {
		if err := s.closedErr(); err != nil {
			return nil, err
		}
		s.mu.Lock()
		sess = s.sess
		s.mu.Unlock()
		if sess != nil {
			return sess, nil
		}
		fresh, err := s.open(ctx)
		if err == nil {
			s.mu.Lock()
			if s.life.Err() != nil {
				s.mu.Unlock()
				_ = fresh.shutdown(false)
				return nil, s.closedErr()
			}
			s.sess = fresh
			s.mu.Unlock()
			s.opened++
			if s.opened > 1 {
				s.reconnects.Add(1)
			}
			s.bo.Reset()
			if c := fresh.cons.Load(); c != nil {
				s.logger().Info("rabbitmq: consumer reconnected", slog.String("consumer_tag", c.tag), slog.String("node", redact.URL(s.nodes.urls[fresh.node])))
			} else {
				s.logger().Info("rabbitmq: reconnected; not consuming until the first Receive", slog.String("node", redact.URL(s.nodes.urls[fresh.node])))
			}
			return fresh, nil
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, ctxErr
		}
		if s.life.Err() != nil {
			return nil, s.closedErr()
		}
		wait := s.bo.NextBackOff()
		s.logger().Warn("rabbitmq: reconnect failed", slog.Any("error", err), slog.Duration("retry_in", wait))
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-s.life.Done():
			t.Stop()
			return nil, s.closedErr()
		}
	}
}

// open dials and, if the Source has started, starts consuming. It opens a
// fresh connection each time: a lost channel usually means a lost
// connection, and a fresh one is simplest to reason about.
func (s *Source) open(ctx context.Context) (*session, error) {
	// Dialing stops when either ctx or the Source's life ends.
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stopAfter := context.AfterFunc(s.life, cancel)
	defer stopAfter()

	conn, node, err := s.nodes.dial(dctx, s.cfg.ConnectionName, s.cfg.DialTimeout)
	if err != nil {
		return nil, err
	}
	sess := &session{conn: conn, node: node}
	if s.started.Load() {
		c, err := s.consume(conn)
		if err != nil {
			_ = conn.CloseDeadline(time.Now().Add(consumerCancelCloseWindow))
			return nil, err
		}
		sess.cons.Store(c)
	}
	return sess, nil
}

// consume opens a channel on conn, sets the prefetch in force on it and
// starts the consumer.
func (s *Source) consume(conn *amqp.Connection) (*consuming, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: queue %q: open channel: %w", s.cfg.Queue, err)
	}
	fail := func(step string, err error) (*consuming, error) {
		_ = ch.Close()
		return nil, fmt.Errorf("rabbitmq: queue %q: %s: %w", s.cfg.Queue, step, err)
	}
	if err := ch.Qos(int(s.prefetch.Load()), 0, false); err != nil {
		return fail("set prefetch", err)
	}
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	tag := s.cfg.ConsumerTag
	if tag == "" {
		// A tag is a short string too: keep it within 255 bytes
		// whatever the queue's name.
		q := s.cfg.Queue
		if n := maxShortstr - len("idemq--") - 12; len(q) > n {
			q = q[:n]
		}
		tag = "idemq-" + q + "-" + randomHex(6)
	}
	if err := s.noteBacklog(ch); err != nil {
		return fail("count the backlog", err)
	}
	deliveries, err := ch.Consume(s.cfg.Queue, tag, false, false, false, false, nil)
	if err != nil {
		return fail("consume", err)
	}
	return &consuming{ch: ch, tag: tag, deliveries: deliveries, closes: closes}, nil
}

// lost retires a session that is gone: its delivery stream ended (the
// channel or connection closed, or the broker cancelled the consumer), or
// its connection is closed.
func (s *Source) lost(sess *session) {
	if !sess.dead.CompareAndSwap(false, true) {
		return
	}
	s.mu.Lock()
	if s.sess == sess {
		s.sess = nil
	}
	s.mu.Unlock()
	s.nodes.lost(sess.node)
	if s.life.Err() == nil {
		if c := sess.cons.Load(); c != nil {
			reason := "consumer cancelled by the broker"
			select {
			case e := <-c.closes:
				if e != nil {
					// consumer_timeout and other soft errors arrive as a
					// channel close (406 PRECONDITION_FAILED): handled like
					// any other loss.
					reason = e.Error()
				}
			default:
			}
			s.logger().Warn("rabbitmq: consumer lost; reconnecting", slog.String("reason", reason), slog.String("consumer_tag", c.tag))
		} else {
			s.logger().Warn("rabbitmq: connection lost; reconnecting")
		}
	}
	_ = sess.shutdown(false)
	// Committed deliveries whose ack was deferred are redelivered by the
	// broker and skipped by dedup; count them as abandoned.
	sess.mu.Lock()
	if err := s.abandonDeferredLocked(sess, "ack", nil); err != nil {
		s.logger().Warn("rabbitmq: deferred acks lost with the channel; dedup will skip the redeliveries", "error", err)
	}
	sess.mu.Unlock()
}

// shutdown closes the session. With cancel, it first cancels the consumer so
// that the broker stops sending; closing the channel then requeues every
// unacked delivery.
func (sess *session) shutdown(cancel bool) error {
	sess.dead.Store(true)
	var firstErr error
	keep := func(err error) {
		if err != nil && !isClosed(err) && firstErr == nil {
			firstErr = err
		}
	}
	if c := sess.cons.Load(); c != nil {
		if cancel && !c.ch.IsClosed() {
			keep(c.ch.Cancel(c.tag, false))
		}
		if !c.ch.IsClosed() {
			keep(c.ch.Close())
		}
	}
	if !sess.conn.IsClosed() {
		keep(sess.conn.CloseDeadline(time.Now().Add(consumerCancelCloseWindow)))
	}
	if firstErr != nil {
		return fmt.Errorf("rabbitmq: close: %w", firstErr)
	}
	return nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// delivery implements consumer.Delivery for one AMQP delivery.
type delivery struct {
	src  *Source
	sess *session
	// ack and tag settle it on its channel: the rest of the amqp.Delivery
	// is in msg, and not kept twice.
	ack     amqp.Acknowledger
	tag     uint64
	msg     consumer.Message // in the delivery: one allocation for both
	settled atomic.Bool
}

func (s *Source) newDelivery(sess *session, d amqp.Delivery) *delivery {
	sess.mu.Lock()
	if sess.unacked == nil {
		sess.unacked = map[uint64]bool{}
	}
	sess.unacked[d.DeliveryTag] = false
	sess.markLocked(d.DeliveryTag, s.received.Load(), int(s.prefetch.Load()))
	sess.mu.Unlock()
	del := &delivery{src: s, sess: sess, ack: d.Acknowledger, tag: d.DeliveryTag}
	s.mapper().fill(&del.msg, d)
	return del
}

// forget removes a settled tag from the session's unacked set, and acks the
// deferred deliveries that were waiting for it.
func (s *Source) forget(sess *session, tag uint64) {
	sess.mu.Lock()
	delete(sess.unacked, tag)
	waiting := sess.deferred > 0
	sess.mu.Unlock()
	if waiting {
		s.flushDeferred(sess, false)
	}
}

func (s *Source) mapper() mapper {
	return mapper{queue: s.cfg.Queue}
}

// mapper turns AMQP deliveries from one queue into consumer.Messages. The
// Source and the Browser share it, so a browsed message looks exactly like
// a consumed one. Message.ID is the AMQP message-id property, which
// Publisher writes; a consumer that keeps its id elsewhere (a header, say)
// sets consumer.Config.MessageID. Message.Key is the x-idemq-key header,
// which Publisher writes (the header stays among Headers).
type mapper struct {
	queue string
}

func (m mapper) message(d amqp.Delivery) *consumer.Message {
	msg := new(consumer.Message)
	m.fill(msg, d)
	return msg
}

// fill sets msg from d.
func (m mapper) fill(msg *consumer.Message, d amqp.Delivery) {
	headers := make(map[string]string, len(d.Headers))
	for k, v := range d.Headers {
		headers[k] = headerString(v)
	}
	*msg = consumer.Message{
		ID:          d.MessageId,
		Key:         headers[wire.KeyHeader],
		Body:        d.Body,
		Headers:     headers,
		Source:      m.queue,
		Partition:   -1,
		Offset:      -1,
		Redelivered: d.Redelivered,
		Timestamp:   d.Timestamp,
		Metadata: map[string]string{
			MetaRoutingKey:  d.RoutingKey,
			MetaExchange:    d.Exchange,
			MetaDeliveryTag: strconv.FormatUint(d.DeliveryTag, 10),
			MetaConsumerTag: d.ConsumerTag,
		},
	}
}

// Message returns the delivered message.
func (d *delivery) Message() *consumer.Message { return &d.msg }

// Ack acks the delivery on the channel that delivered it.
func (d *delivery) Ack(ctx context.Context) error {
	return d.settle("ack", func() error { return d.ack.Ack(d.tag, false) }, &d.src.acked)
}

// Nack nacks the delivery on the channel that delivered it.
func (d *delivery) Nack(ctx context.Context, requeue bool) error {
	return d.settle("nack", func() error { return d.ack.Nack(d.tag, false, requeue) }, &d.src.nacked)
}

func (d *delivery) settle(op string, f func() error, counter *atomic.Int64) error {
	if !d.settled.CompareAndSwap(false, true) {
		return fmt.Errorf("rabbitmq: %s delivery %d: already settled: %w", op, d.tag, consumer.ErrDeliveryStale)
	}
	// A dead session's tags mean nothing on any other channel; the
	// broker has requeued the message or will when it notices.
	if d.sess.dead.Load() {
		return d.abandon(op, nil)
	}
	if err := f(); err != nil {
		return d.abandon(op, err)
	}
	counter.Add(1)
	d.src.forget(d.sess, d.tag)
	return nil
}

func (d *delivery) abandon(op string, cause error) error {
	d.src.abandoned.Add(1)
	return fmt.Errorf("rabbitmq: %s delivery %d of queue %q: %w", op, d.tag, d.src.cfg.Queue, d.src.staleErr(cause))
}

// staleErr explains why a delivery could not be settled: its channel is lost
// (ErrDeliveryStale) or the Source is closed (ErrSourceClosed).
func (s *Source) staleErr(cause error) error {
	sentinel := consumer.ErrDeliveryStale
	what := "channel lost"
	if s.life.Err() != nil {
		sentinel = consumer.ErrSourceClosed
		what = "source closed"
	}
	if cause != nil {
		// Not wrapped: amqp091's errors stay behind the boundary.
		what += " (" + cause.Error() + ")"
	}
	return fmt.Errorf("%s: %w", what, sentinel)
}

// headerString renders an AMQP header value as a string.
func headerString(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case []byte:
		return string(v)
	case bool:
		return strconv.FormatBool(v)
	case int8:
		return strconv.FormatInt(int64(v), 10)
	case int16:
		return strconv.FormatInt(int64(v), 10)
	case int32:
		return strconv.FormatInt(int64(v), 10)
	case int64:
		return strconv.FormatInt(v, 10)
	case int:
		return strconv.Itoa(v)
	case uint8:
		return strconv.FormatUint(uint64(v), 10)
	case uint16:
		return strconv.FormatUint(uint64(v), 10)
	case uint32:
		return strconv.FormatUint(uint64(v), 10)
	case uint64:
		return strconv.FormatUint(v, 10)
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32)
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64)
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano)
	case []any, amqp.Table:
		// Arrays and tables (the broker's x-death, say) as JSON, which
		// package dlq reads.
		b, err := json.Marshal(jsonValue(v))
		if err != nil {
			return fmt.Sprint(v)
		}
		return string(b)
	default:
		return fmt.Sprint(v)
	}
}

// jsonValue is v with its AMQP field values made JSON values: times as
// RFC 3339 strings, byte arrays as text, arrays and tables recursively.
func jsonValue(v any) any {
	switch v := v.(type) {
	case amqp.Table:
		out := make(map[string]any, len(v))
		for k, x := range v {
			out[k] = jsonValue(x)
		}
		return out
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = jsonValue(x)
		}
		return out
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano)
	case []byte:
		return string(v)
	case amqp.Decimal:
		return fmt.Sprint(v)
	default:
		return v
	}
}
