package rabbitmq

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
)

// BrowserConfig configures a Browser. The zero value of every optional field
// selects a documented default. The message mapping fields mean the same as
// in Config, so a browsed message looks exactly like a consumed one.
type BrowserConfig struct {
	// URL is the broker's AMQP URL, one URL: a comma-separated list is
	// refused. Defaults to DefaultURL, amqp://guest:guest@127.0.0.1:5672/.
	URL string
	// Queue is the queue to browse, typically a dead-letter queue.
	// Required. It must exist.
	Queue string
	// ConnectionName is shown by the broker's management tools. Defaults
	// to none.
	ConnectionName string

	// DialTimeout bounds the connection attempt, handshake included.
	// Defaults to 30s.
	DialTimeout time.Duration
	// Logger receives the browser's logs. Defaults to a logger that
	// discards everything.
	Logger *slog.Logger
}

func (c BrowserConfig) withDefaults() BrowserConfig {
	if c.URL == "" {
		c.URL = DefaultURL
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = defaultDialTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c BrowserConfig) validate() error {
	if err := checkName("Queue", c.Queue); err != nil {
		return err
	}
	switch {
	case c.DialTimeout < 0:
		return configError("DialTimeout", "negative")
	}
	return checkURL(c.URL)
}

// Browser reads a queue as it was when the Browser was opened, without
// consuming it: a message leaves the queue only when its delivery is acked.
// It implements the dlq.Browser interface, for inspecting, classifying and
// replaying a dead-letter queue. Create it with NewBrowser.
//
// NewBrowser notes the queue's depth (its ready messages). Next then takes
// messages one at a time with basic.get, which no prefetch limits, at most
// that many times, and returns an error wrapping io.EOF after that (or as
// soon as the queue is empty). Messages that arrive later, such as those
// dead-lettered again during a replay, are therefore not read in the same
// pass. Every message taken stays unacked, held by the Browser, until its
// delivery is acked or the Browser is closed: closing gives every one of
// them back to the queue (RabbitMQ keeps their order), so a browse that
// acks nothing leaves the queue as it was.
//
// A Nack with requeue also keeps the message held until Close, so that one
// pass never reads a message twice. If the broker closes the channel (its
// consumer_timeout, a lost connection), Next fails with an error wrapping
// consumer.ErrSourceClosed and the broker has every unacked message back.
//
// A Browser is safe for concurrent use, though concurrent Next calls are
// served one at a time.
type Browser struct {
	cfg   BrowserConfig
	log   *slog.Logger
	m     mapper
	conn  *amqp.Connection
	ch    *amqp.Channel
	depth int

	closes chan *amqp.Error // the channel's NotifyClose, buffered

	nextMu    sync.Mutex     // serialises Next
	remaining int            // basic.gets left; guarded by nextMu
	pending   chan getResult // an outstanding basic.get; guarded by nextMu

	mu     sync.Mutex // guards closed and gets.Add
	closed bool
	gets   sync.WaitGroup // outstanding basic.get goroutines

	lost      atomic.Bool // the channel or connection is gone
	closeOnce sync.Once
	closeErr  error
	reason    atomic.Pointer[string] // why the channel closed, once known
}

type getResult struct {
	d   amqp.Delivery
	ok  bool
	err error
}

// NewBrowser validates cfg, opens a connection and a channel of its own, and
// notes the depth of cfg.Queue with a passive declare. It fails if the broker
// cannot be reached or the queue does not exist.
func NewBrowser(ctx context.Context, cfg BrowserConfig) (*Browser, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	conn, err := dial(ctx, cfg.URL, cfg.ConnectionName, cfg.DialTimeout)
	if err != nil {
		return nil, err
	}
	fail := func(step string, err error) (*Browser, error) {
		_ = conn.CloseDeadline(time.Now().Add(consumerCancelCloseWindow))
		return nil, fmt.Errorf("rabbitmq: browse queue %q: %s: %w", cfg.Queue, step, err)
	}
	ch, err := conn.Channel()
	if err != nil {
		return fail("open channel", err)
	}
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	st, err := ch.QueueDeclarePassive(cfg.Queue, false, false, false, false, nil)
	if err != nil {
		return fail("read queue depth", err)
	}
	b := &Browser{
		cfg:       cfg,
		log:       cfg.Logger.With(slog.String("queue", cfg.Queue)),
		m:         mapper{queue: cfg.Queue},
		conn:      conn,
		ch:        ch,
		depth:     st.Messages,
		closes:    closes,
		remaining: st.Messages,
	}
	b.log.Debug("rabbitmq: browsing queue", slog.Int("depth", st.Messages))
	return b, nil
}

// Depth returns the number of ready messages the queue held when the
// Browser was opened: the most Next returns.
func (b *Browser) Depth() int { return b.depth }

// Next returns the next message of the queue, unacked. It returns an error
// wrapping io.EOF once Depth messages have been returned or the queue is
// empty, and one wrapping consumer.ErrSourceClosed after Close or once the
// connection is lost (a Browser does not reconnect: the broker has then
// given back every message it held, and a new pass needs a new Browser).
func (b *Browser) Next(ctx context.Context) (consumer.Delivery, error) {
	b.nextMu.Lock()
	defer b.nextMu.Unlock()
	if err := b.unusable(); err != nil {
		return nil, err
	}
	if b.remaining <= 0 && b.pending == nil {
		return nil, b.eof()
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if b.pending == nil {
		b.mu.Lock()
		if b.closed {
			b.mu.Unlock()
			return nil, b.closedErr()
		}
		b.gets.Add(1)
		b.mu.Unlock()
		res := make(chan getResult, 1)
		b.pending = res
		b.remaining--
		// amqp091's Get does not take a context: it runs on its own
		// goroutine so that Next can honour ctx. A result that arrives
		// after ctx is done is returned by the next call.
		go func() {
			defer b.gets.Done()
			d, ok, err := b.ch.Get(b.cfg.Queue, false)
			res <- getResult{d: d, ok: ok, err: err}
		}()
	}
	var r getResult
	select {
	case r = <-b.pending:
		b.pending = nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if err := b.unusable(); err != nil {
		return nil, err // a message taken is given back at Close
	}
	if r.err != nil {
		b.lost.Store(true)
		return nil, fmt.Errorf("rabbitmq: browse queue %q: channel lost (%s): %w", b.cfg.Queue, b.lostReason(r.err), consumer.ErrSourceClosed)
	}
	if !r.ok {
		b.remaining = 0
		return nil, b.eof()
	}
	return &browsed{b: b, d: r.d, msg: b.m.message(r.d)}, nil
}

// Close closes the Browser's connection. The broker gives every message
// that was taken and not acked back to the queue. Ack and Nack on its
// deliveries then return errors wrapping consumer.ErrSourceClosed. Close is
// idempotent.
func (b *Browser) Close() error {
	b.closeOnce.Do(func() {
		b.mu.Lock()
		b.closed = true
		b.mu.Unlock()
		// Closing the connection rather than the channel first: a
		// channel.close RPC could race an outstanding basic.get on the
		// same channel, while the connection's close makes that get
		// return at once. The broker requeues the unacked messages
		// either way.
		if !b.conn.IsClosed() {
			if err := b.conn.CloseDeadline(time.Now().Add(consumerCancelCloseWindow)); err != nil && !isClosed(err) {
				b.closeErr = fmt.Errorf("rabbitmq: close browser of queue %q: %w", b.cfg.Queue, err)
			}
		}
		b.gets.Wait()
	})
	return b.closeErr
}

func (b *Browser) eof() error {
	return fmt.Errorf("rabbitmq: browse queue %q: %d messages read: %w", b.cfg.Queue, b.depth, io.EOF)
}

func (b *Browser) closedErr() error {
	return fmt.Errorf("rabbitmq: browse queue %q: %w", b.cfg.Queue, consumer.ErrSourceClosed)
}

// unusable returns the error Next reports once the Browser is closed or its
// channel lost, and nil before.
func (b *Browser) unusable() error {
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	switch {
	case closed:
		return b.closedErr()
	case b.lost.Load() || b.ch.IsClosed():
		b.lost.Store(true)
		return fmt.Errorf("rabbitmq: browse queue %q: channel lost (%s): %w", b.cfg.Queue, b.lostReason(nil), consumer.ErrSourceClosed)
	}
	return nil
}

// lostReason describes why the channel closed, without exposing amqp091's
// error values.
func (b *Browser) lostReason(err error) string {
	if r := b.reason.Load(); r != nil {
		return *r
	}
	select {
	case e, ok := <-b.closes:
		if ok && e != nil {
			s := e.Error()
			b.reason.Store(&s)
			return s
		}
	default:
	}
	if err != nil {
		return err.Error()
	}
	return "channel closed"
}

// browsed implements consumer.Delivery for a message taken by a Browser.
type browsed struct {
	b       *Browser
	d       amqp.Delivery
	msg     *consumer.Message
	settled atomic.Bool
}

// Message returns the browsed message.
func (d *browsed) Message() *consumer.Message { return d.msg }

// Ack removes the message from the queue.
func (d *browsed) Ack(ctx context.Context) error {
	return d.settle("ack", func() error { return d.d.Ack(false) })
}

// Nack with requeue leaves the message held by the Browser until Close gives
// it back to the queue, so that one pass never reads a message twice.
// Without requeue the broker drops or dead-letters it by its own rules.
func (d *browsed) Nack(ctx context.Context, requeue bool) error {
	if requeue {
		return d.settle("nack", func() error { return nil })
	}
	return d.settle("nack", func() error { return d.d.Nack(false, false) })
}

func (d *browsed) settle(op string, f func() error) error {
	if !d.settled.CompareAndSwap(false, true) {
		return fmt.Errorf("rabbitmq: %s browsed delivery %d: already settled: %w", op, d.d.DeliveryTag, consumer.ErrDeliveryStale)
	}
	if err := d.b.unusable(); err != nil {
		return d.abandon(op, nil)
	}
	if err := f(); err != nil {
		d.b.lost.Store(true)
		return d.abandon(op, err)
	}
	return nil
}

func (d *browsed) abandon(op string, cause error) error {
	d.b.mu.Lock()
	closed := d.b.closed
	d.b.mu.Unlock()
	sentinel := consumer.ErrDeliveryStale
	what := "channel lost"
	if closed {
		sentinel = consumer.ErrSourceClosed
		what = "browser closed"
	}
	if cause != nil {
		// Not wrapped: amqp091's errors stay behind the boundary.
		what += " (" + cause.Error() + ")"
	}
	return fmt.Errorf("rabbitmq: %s browsed delivery %d of queue %q: %s: %w", op, d.d.DeliveryTag, d.b.cfg.Queue, what, sentinel)
}
