package rabbitmq

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/internal/wire"
)

// defaultPublisherChannels is PublisherConfig.Channels' default.
const defaultPublisherChannels = 4

// returnBuffer is the capacity of each channel's basic.return queue. Publish
// drains it while it waits for confirms.
const returnBuffer = 64

// PublisherConfig configures a Publisher. The zero value of every optional
// field selects a documented default.
type PublisherConfig struct {
	// URL is the broker's AMQP URL, one URL: a comma-separated list is
	// refused (a cluster's other nodes go in FailoverURLs). Defaults to
	// DefaultURL, amqp://guest:guest@127.0.0.1:5672/.
	URL string
	// FailoverURLs are the AMQP URLs of the cluster's other nodes, if any:
	// each connection tries the nodes in turn, as Config.FailoverURLs
	// says. Defaults to none.
	FailoverURLs []string
	// ConnectionName is shown by the broker's management tools. Defaults
	// to none.
	ConnectionName string
	// Channels is the most Publish calls in flight at once; each uses a
	// channel of its own. Defaults to 4.
	Channels int
	// DialTimeout bounds each connection attempt, handshake included.
	// Defaults to 30s.
	DialTimeout time.Duration
	// Logger receives connection logs. Defaults to a logger that discards
	// everything.
	Logger *slog.Logger
}

func (c PublisherConfig) withDefaults() PublisherConfig {
	if c.URL == "" {
		c.URL = DefaultURL
	}
	if c.Channels == 0 {
		c.Channels = defaultPublisherChannels
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = defaultDialTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c PublisherConfig) validate() error {
	switch {
	case c.Channels < 1:
		return configError("Channels", "%d, must be at least 1", c.Channels)
	case c.DialTimeout < 0:
		return configError("DialTimeout", "negative")
	}
	return checkNodes(c.URL, c.FailoverURLs)
}

// Publisher publishes messages with publisher confirms, persistent delivery
// and the mandatory flag. It keeps one connection, opened again on the next
// Publish after it is lost. It is safe for concurrent use; create it with
// NewPublisher.
type Publisher struct {
	cfg   PublisherConfig
	log   *slog.Logger
	sem   chan struct{} // Channels slots
	nodes *nodes

	mu     sync.Mutex
	conn   *amqp.Connection
	node   int // the index of conn's node in nodes
	idle   []*pubChannel
	closed bool
}

// pubChannel is a confirm-mode channel used by one Publish call at a time.
type pubChannel struct {
	conn    *amqp.Connection
	ch      *amqp.Channel
	returns chan amqp.Return
	closes  chan *amqp.Error
	// closeReason is what came on closes, once read.
	closeReason string
}

// NewPublisher validates cfg and connects.
func NewPublisher(ctx context.Context, cfg PublisherConfig) (*Publisher, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	p := &Publisher{cfg: cfg, log: cfg.Logger, sem: make(chan struct{}, cfg.Channels), nodes: newNodes(cfg.URL, cfg.FailoverURLs)}
	conn, node, err := p.nodes.dial(ctx, cfg.ConnectionName, cfg.DialTimeout)
	if err != nil {
		return nil, err
	}
	p.conn, p.node = conn, node
	return p, nil
}

// Publish publishes msgs, in order, to exchange with routingKey, and returns
// once the broker has confirmed every one of them: for a durable queue, once
// it is persisted. Use exchange "" and the queue's name as routingKey to
// publish straight to a queue.
//
// Message.ID becomes the AMQP MessageId, Headers the headers (plus Key in
// a non-empty Key in the x-idemq-key header, where the Source reads it), Timestamp the timestamp; the delivery
// mode is persistent. A message that no queue receives is an error wrapping
// ErrUnroutable, a broker nack one wrapping ErrNacked, and a connection lost
// before the confirm one wrapping ErrUnconfirmed. A message whose headers
// and properties do not fit one frame of the connection's frame_max
// (131072 bytes by default) is not sent: its error wraps
// consumer.ErrMessageTooLarge. Each failed message gets a
// *PublishError; they are joined with errors.Join. Publishing the failed
// messages again is safe: consumers deduplicate by id.
func (p *Publisher) Publish(ctx context.Context, exchange, routingKey string, msgs ...*consumer.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	if err := checkPublish(exchange, routingKey, msgs); err != nil {
		return err
	}
	select {
	case p.sem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("rabbitmq: publish: %w", ctx.Err())
	}
	defer func() { <-p.sem }()

	pc, err := p.channel(ctx)
	if err != nil {
		return err
	}
	healthy, err := publishOn(ctx, pc, exchange, routingKey, msgs)
	if healthy {
		p.release(pc)
	} else {
		_ = pc.ch.Close()
	}
	return err
}

// checkPublish refuses what amqp091 cannot send. Over-long short strings
// make it write a broken frame, which closes the whole connection.
func checkPublish(exchange, routingKey string, msgs []*consumer.Message) error {
	if len(exchange) > maxShortstr || len(routingKey) > maxShortstr {
		return fmt.Errorf("rabbitmq: publish: exchange or routing key: %w", ErrTooLong)
	}
	for i, m := range msgs {
		if m == nil {
			return fmt.Errorf("rabbitmq: publish: message %d is nil", i)
		}
		for k := range m.Headers {
			if len(k) > maxShortstr {
				return fmt.Errorf("rabbitmq: publish: message %d: header name of %d bytes: %w", i, len(k), ErrTooLong)
			}
		}
	}
	return nil
}

// publishOn publishes msgs on pc, which the caller holds alone, and waits
// for every confirm; see Publish for the errors. healthy reports whether pc
// may serve another call: false once its channel is closed, the broker
// nacked on it, or confirms or returns for this call may still arrive.
func publishOn(ctx context.Context, pc *pubChannel, exchange, routingKey string, msgs []*consumer.Message) (healthy bool, err error) {
	confirms := make([]*amqp.DeferredConfirmation, len(msgs))
	// tooLarge[i], if set, is why msgs[i] is not sent: its properties do
	// not fit one frame, and the broker would close the whole connection
	// on it.
	tooLarge := make([]error, len(msgs))
	for i, m := range msgs {
		pub := publishing(m)
		if err := checkFrame(pc.conn.Config.FrameSize, pub); err != nil {
			tooLarge[i] = err
			continue
		}
		dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, routingKey, true, false, pub)
		if err != nil {
			if ctxErr := ctx.Err(); ctxErr != nil {
				return false, fmt.Errorf("rabbitmq: publish: %w", ctxErr)
			}
			// Not one message of the call is confirmed: those before i
			// were sent without their confirms awaited, those after it
			// never. Name them all, so that a caller retrying only the
			// named ones (the outbox relay, by MessageIndex) loses none.
			reason := pc.reason(err)
			errs := make([]error, len(msgs))
			for j := range msgs {
				err := tooLarge[j]
				if err == nil {
					err = fmt.Errorf("%w: %s", ErrUnconfirmed, reason)
				}
				errs[j] = &PublishError{Index: j, MessageID: msgs[j].ID, Err: err}
			}
			return false, errors.Join(errs...)
		}
		confirms[i] = dc
	}

	// A basic.return reaches pc.returns before the confirm of the same
	// message completes, so once every confirm is in, every return for
	// this call has been queued. The channel serves one call at a time,
	// so they all belong to this call.
	var returns []amqp.Return
	retCh := pc.returns // nil once amqp091 closes it with the channel
	for _, dc := range confirms {
		if dc == nil {
			continue // not sent
		}
	wait:
		for {
			select {
			case <-dc.Done():
				break wait
			case r, ok := <-retCh:
				if !ok {
					retCh = nil
					continue
				}
				returns = append(returns, r)
			case <-ctx.Done():
				// Returns still due would be misattributed to the
				// next call: the channel is discarded.
				return false, fmt.Errorf("rabbitmq: publish: waiting for confirms: %w", ctx.Err())
			}
		}
	}
drain:
	for retCh != nil {
		select {
		case r, ok := <-retCh:
			if !ok {
				break drain
			}
			returns = append(returns, r)
		default:
			break drain
		}
	}

	returned := matchReturns(msgs, returns)
	lost := pc.ch.IsClosed()
	nacked := false
	var errs []error
	for i, dc := range confirms {
		var reason error
		switch {
		case tooLarge[i] != nil:
			reason = tooLarge[i]
		case returned[i] != nil:
			reason = fmt.Errorf("%w: exchange %q, routing key %q: %d %s", ErrUnroutable, exchange, routingKey, returned[i].ReplyCode, returned[i].ReplyText)
		case dc.Acked():
			continue
		case lost:
			// amqp091 resolves pending confirms as nacks when the
			// channel closes.
			reason = fmt.Errorf("%w: %s", ErrUnconfirmed, pc.reason(nil))
		default:
			reason, nacked = ErrNacked, true
		}
		errs = append(errs, &PublishError{Index: i, MessageID: msgs[i].ID, Err: reason})
	}
	// A channel the broker nacked on is not used again: RabbitMQ 3.10 kept
	// nacking every publish on a confirm channel opened just before a
	// quorum queue's leader node died, while a fresh channel on the same
	// connection was acked at once.
	return !lost && !nacked, errors.Join(errs...)
}

// Close closes the connection. Publish calls in flight fail with
// ErrUnconfirmed; later ones with ErrPublisherClosed. Close is idempotent.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	for _, pc := range p.idle {
		_ = pc.ch.Close()
	}
	p.idle = nil
	if p.conn != nil && !p.conn.IsClosed() {
		if err := p.conn.CloseDeadline(time.Now().Add(consumerCancelCloseWindow)); err != nil && !isClosed(err) {
			return fmt.Errorf("rabbitmq: close publisher: %w", err)
		}
	}
	return nil
}

// channel returns an idle confirm-mode channel, or opens one, reconnecting
// first if the connection was lost.
func (p *Publisher) channel(ctx context.Context) (*pubChannel, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrPublisherClosed
	}
	// amqp091 marks a dying connection closed before it closes its
	// channels: an idle channel is taken only while its connection is
	// open too.
	for len(p.idle) > 0 {
		pc := p.idle[len(p.idle)-1]
		p.idle = p.idle[:len(p.idle)-1]
		if pc.conn == p.conn && !p.conn.IsClosed() && !pc.ch.IsClosed() {
			return pc, nil
		}
		_ = pc.ch.Close()
	}
	if p.conn == nil || p.conn.IsClosed() {
		p.idle = nil
		if p.conn != nil {
			p.nodes.lost(p.node)
		}
		p.log.Info("rabbitmq: publisher reconnecting", slog.String("nodes", p.nodes.String()))
		conn, node, err := p.nodes.dial(ctx, p.cfg.ConnectionName, p.cfg.DialTimeout)
		if err != nil {
			return nil, err
		}
		p.conn, p.node = conn, node
		p.log.Info("rabbitmq: publisher reconnected", slog.String("url", redact.URL(p.nodes.urls[node])))
	}
	pc, err := openConfirmChannel(p.conn)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: publisher: %w", err)
	}
	return pc, nil
}

// openConfirmChannel opens a confirm-mode channel on conn.
func openConfirmChannel(conn *amqp.Connection) (*pubChannel, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("enable confirms: %w", err)
	}
	return &pubChannel{
		conn:    conn,
		ch:      ch,
		returns: ch.NotifyReturn(make(chan amqp.Return, returnBuffer)),
		closes:  ch.NotifyClose(make(chan *amqp.Error, 1)),
	}, nil
}

// release returns a healthy channel to the idle list.
func (p *Publisher) release(pc *pubChannel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || pc.conn != p.conn || pc.conn.IsClosed() || pc.ch.IsClosed() {
		_ = pc.ch.Close()
		return
	}
	p.idle = append(p.idle, pc)
}

// publishing maps m to an AMQP publishing, with a non-empty Key in the
// x-idemq-key header.
func publishing(m *consumer.Message) amqp.Publishing {
	var headers amqp.Table
	if len(m.Headers) > 0 || m.Key != "" {
		headers = make(amqp.Table, len(m.Headers)+1)
		for k, v := range m.Headers {
			headers[k] = v
		}
		if m.Key != "" {
			headers[wire.KeyHeader] = m.Key
		}
	}
	id := m.ID
	if len(id) > maxShortstr {
		// It does not fit the message-id property. A dead-letter copy
		// keeps it in its envelope; other long ids belong in a header,
		// which the consumer reads with consumer.Config.MessageID.
		id = ""
	}
	return amqp.Publishing{
		Headers:      headers,
		DeliveryMode: amqp.Persistent,
		MessageId:    id,
		Timestamp:    m.Timestamp,
		Body:         m.Body,
	}
}

// checkFrame returns an error wrapping consumer.ErrMessageTooLarge if p's
// content header, its properties, would not fit one frame of frameSize
// bytes (the connection's negotiated frame_max; 0 for no limit). RabbitMQ
// closes the whole connection (501 FRAME_ERROR) on a frame over its
// frame_max, so such a message must not be sent. The body is split into as
// many frames as it needs; its limit, max_message_size, is the broker's.
func checkFrame(frameSize int, p amqp.Publishing) error {
	if frameSize <= 0 {
		return nil
	}
	// The frame's payload (frame_max less its 7-byte header and its end
	// octet): class id, weight, body size and property flags, then each
	// property publishing sets, as amqp091 writes them.
	n := 2 + 2 + 8 + 2
	if len(p.Headers) > 0 {
		n += 4 // the table's length
		for k, v := range p.Headers {
			n += 1 + len(k) + 1 // the name, a short string, and the type
			switch v := v.(type) {
			case string:
				n += 4 + len(v)
			case []byte:
				n += 4 + len(v)
			default:
				n += 8 // publishing sets strings only; 8 is the largest of the rest
			}
		}
	}
	if p.DeliveryMode > 0 {
		n++
	}
	if p.MessageId != "" {
		n += 1 + len(p.MessageId)
	}
	if !p.Timestamp.IsZero() {
		n += 8
	}
	if limit := frameSize - 8; n > limit {
		return fmt.Errorf("%w: its headers and properties take %d bytes, the connection's frame_max allows %d",
			consumer.ErrMessageTooLarge, n, limit)
	}
	return nil
}

// reason describes why pc's channel closed, for errors.
func (pc *pubChannel) reason(err error) string {
	if pc.closeReason == "" {
		select {
		case e, ok := <-pc.closes:
			if ok && e != nil {
				pc.closeReason = e.Error()
			}
		default:
		}
	}
	switch {
	case pc.closeReason != "":
		return pc.closeReason
	case err != nil:
		return err.Error()
	default:
		return "channel closed"
	}
}

// matchReturns attributes each returned message to a distinct message of
// msgs: first by id and body, then by id, then to any message not yet
// attributed. All of msgs went to the same exchange and routing key, so
// messages that cannot be told apart are equally unroutable.
func matchReturns(msgs []*consumer.Message, returns []amqp.Return) []*amqp.Return {
	out := make([]*amqp.Return, len(msgs))
	for ri := range returns {
		r := &returns[ri]
		match := -1
		for pass := 0; pass < 3 && match < 0; pass++ {
			for i, m := range msgs {
				if out[i] != nil {
					continue
				}
				if pass == 0 && (m.ID != r.MessageId || !bytes.Equal(m.Body, r.Body)) {
					continue
				}
				if pass == 1 && m.ID != r.MessageId {
					continue
				}
				match = i
				break
			}
		}
		if match >= 0 {
			out[match] = r
		}
	}
	return out
}
