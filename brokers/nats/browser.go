package natsjs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/consumer"
)

// defaultBrowseIdle is how long Browser.Next waits for the next message
// before it concludes the pass is over.
const defaultBrowseIdle = 2 * time.Second

// BrowserConfig configures a Browser. The zero value of every optional field
// selects a documented default. The message mapping fields mean the same as
// in Config, so a browsed message looks exactly like a consumed one.
type BrowserConfig struct {
	// URL is the server's URL, or a comma-separated list of them.
	// Defaults to nats://127.0.0.1:4222 (nats.DefaultURL).
	URL string
	// Options are extra connection options. Defaults to none.
	Options []nats.Option
	// Subject is the subject to browse, typically a dead-letter subject
	// (Config.DeadLetter.Subject, by default DLQSubject of the work
	// subject). Required; no wildcards.
	Subject string
	// Stream is the stream that stores Subject. Defaults to the one the
	// server says captures it.
	Stream string

	// Idle is how long Next waits for a message before it reports the end
	// of the pass (io.EOF): messages deleted meanwhile leave nothing to
	// wait for. Defaults to 2s.
	Idle time.Duration
}

func (c BrowserConfig) withDefaults() BrowserConfig {
	if c.URL == "" {
		c.URL = nats.DefaultURL
	}
	if c.Idle == 0 {
		c.Idle = defaultBrowseIdle
	}
	return c
}

func (c BrowserConfig) validate() error {
	if err := checkSubject("Subject", c.Subject, false); err != nil {
		return err
	}
	if c.Stream != "" {
		if err := checkStreamName("Stream", c.Stream); err != nil {
			return err
		}
	}
	switch {
	case c.Idle < 0:
		return configError("Idle", "negative")
	}
	return checkURL(c.URL)
}

// Browser reads the messages of one subject of a stream, as they were when
// it was opened, without consuming them: a message leaves the stream only
// when its delivery is acked, which deletes it (by sequence). It implements
// dlq.Browser, for inspecting, classifying, replaying and requeueing a
// dead-letter subject. Create it with NewBrowser; it is meant for one pass
// by one goroutine.
//
// NewBrowser notes the sequence of the subject's last message. Next then
// reads the subject from its first message with an ordered consumer (an
// ephemeral one, without acks, that leaves no trace on the server) and
// returns io.EOF after that last message, so messages dead-lettered again
// during a replay are not read twice in one pass. Nack does nothing: the
// message stays. Close ends the pass; unacked messages simply stay.
type Browser struct {
	cfg    BrowserConfig
	nc     *nats.Conn
	stream jetstream.Stream
	oc     jetstream.Consumer
	m      mapper
	last   uint64 // 0: the subject was empty

	life context.Context // done at Close
	stop context.CancelFunc

	mu     sync.Mutex
	it     jetstream.MessagesContext
	done   bool
	closed atomic.Bool
}

// NewBrowser connects and notes the subject's last message.
func NewBrowser(ctx context.Context, cfg BrowserConfig) (*Browser, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	nc, err := connect(ctx, cfg.URL, "idemq-browser", nil, cfg.Options)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Browser, error) {
		nc.Close()
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(fmt.Errorf("natsjs: jetstream: %w", err))
	}
	if cfg.Stream == "" {
		if cfg.Stream, err = js.StreamNameBySubject(ctx, cfg.Subject); err != nil {
			return fail(fmt.Errorf("natsjs: browse %q: no stream captures it: %w", cfg.Subject, err))
		}
	}
	stream, err := js.Stream(ctx, cfg.Stream)
	if err != nil {
		return fail(fmt.Errorf("natsjs: browse %q: stream %q: %w", cfg.Subject, cfg.Stream, err))
	}
	b := &Browser{cfg: cfg, nc: nc, stream: stream,
		m: mapper{}}
	b.life, b.stop = context.WithCancel(context.Background())
	last, err := stream.GetLastMsgForSubject(ctx, cfg.Subject)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		b.done = true
		return b, nil
	case err != nil:
		return fail(fmt.Errorf("natsjs: browse %q: last message: %w", cfg.Subject, err))
	}
	b.last = last.Sequence
	b.oc, err = js.OrderedConsumer(ctx, cfg.Stream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{cfg.Subject},
		DeliverPolicy:  jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return fail(fmt.Errorf("natsjs: browse %q: ordered consumer: %w", cfg.Subject, err))
	}
	return b, nil
}

func (b *Browser) closedErr() error {
	return fmt.Errorf("natsjs: browse %q: %w", b.cfg.Subject, consumer.ErrSourceClosed)
}

// Next returns the next message, or an error wrapping io.EOF once the last
// message present at NewBrowser has been returned (or nothing arrived for
// BrowserConfig.Idle).
func (b *Browser) Next(ctx context.Context) (consumer.Delivery, error) {
	if b.closed.Load() {
		return nil, b.closedErr()
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return nil, io.EOF
	}
	if b.it == nil {
		it, err := b.oc.Messages(jetstream.PullMaxMessages(64))
		if err != nil {
			return nil, fmt.Errorf("natsjs: browse %q: %w", b.cfg.Subject, err)
		}
		b.it = it
	}
	nctx, cancel := context.WithTimeout(ctx, b.cfg.Idle)
	defer cancel()
	defer context.AfterFunc(b.life, cancel)()
	m, err := b.it.Next(jetstream.NextContext(nctx))
	if err != nil {
		switch {
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case b.closed.Load():
			return nil, b.closedErr()
		case errors.Is(err, context.DeadlineExceeded):
			b.done = true
			return nil, io.EOF
		}
		return nil, fmt.Errorf("natsjs: browse %q: %w", b.cfg.Subject, err)
	}
	md, err := m.Metadata()
	if err != nil {
		return nil, fmt.Errorf("natsjs: browse %q: %w", b.cfg.Subject, err)
	}
	seq := md.Sequence.Stream
	if seq > b.last {
		b.done = true
		return nil, io.EOF
	}
	if seq == b.last || md.NumPending == 0 {
		b.done = true
	}
	msg := b.m.message(m)
	msg.Redelivered = false // an ordered consumer's count says nothing
	return &browsedDelivery{b: b, seq: seq, msg: msg}, nil
}

// Close ends the pass and closes the connection. Messages that were not
// acked stay in the stream. Close is idempotent.
func (b *Browser) Close() error {
	if !b.closed.CompareAndSwap(false, true) {
		return nil
	}
	b.stop() // releases a Next in progress
	b.mu.Lock()
	if b.it != nil {
		b.it.Stop()
	}
	b.mu.Unlock()
	b.nc.Close()
	return nil
}

// browsedDelivery is one browsed message.
type browsedDelivery struct {
	b       *Browser
	seq     uint64
	msg     *consumer.Message
	settled atomic.Bool
}

func (d *browsedDelivery) Message() *consumer.Message { return d.msg }

// Ack deletes the message from the stream. A message already deleted (by
// another pass, say) is not an error.
func (d *browsedDelivery) Ack(ctx context.Context) error {
	if d.b.closed.Load() {
		return fmt.Errorf("natsjs: delete stream seq %d: %w", d.seq, d.b.closedErr())
	}
	if !d.settled.CompareAndSwap(false, true) {
		return fmt.Errorf("natsjs: delete stream seq %d: already settled: %w", d.seq, consumer.ErrDeliveryStale)
	}
	if err := d.b.stream.DeleteMsg(ctx, d.seq); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		d.settled.Store(false)
		return fmt.Errorf("natsjs: delete stream seq %d of %q: %w", d.seq, d.b.cfg.Stream, err)
	}
	return nil
}

// Nack leaves the message in the stream, with or without requeue.
func (d *browsedDelivery) Nack(ctx context.Context, requeue bool) error {
	if d.b.closed.Load() {
		return fmt.Errorf("natsjs: nack stream seq %d: %w", d.seq, d.b.closedErr())
	}
	if !d.settled.CompareAndSwap(false, true) {
		return fmt.Errorf("natsjs: nack stream seq %d: already settled: %w", d.seq, consumer.ErrDeliveryStale)
	}
	return nil
}
