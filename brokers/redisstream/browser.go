package redisstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

var _ dlq.Browser = (*Browser)(nil)

const browsePage = 100

// BrowserConfig configures a Browser. The zero value of every optional field
// selects a documented default; the mapping fields mean what they mean in
// Config, so a browsed entry looks like a consumed one.
type BrowserConfig struct {
	// URL is the server's URL. Defaults to DefaultURL.
	URL string
	// Stream is the stream to browse, typically a dead-letter stream
	// ("<stream>.dlq"). Required.
	Stream string
	// BodyField is as in Config. There is no fallback id: an entry
	// without the id field has an empty Message.ID (a dead letter's dedup
	// id is in its envelope).
	BodyField string
	// DialTimeout bounds each connection attempt. Defaults to 5s.
	DialTimeout time.Duration
}

func (c BrowserConfig) withDefaults() BrowserConfig {
	if c.URL == "" {
		c.URL = DefaultURL
	}
	if c.BodyField == "" {
		c.BodyField = defaultBodyField
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = defaultDialTimeout
	}
	return c
}

func (c BrowserConfig) validate() error {
	switch {
	case c.Stream == "":
		return configError("Stream", "required")
	case c.DialTimeout < 0:
		return configError("DialTimeout", "negative")
	}
	if err := validateBodyField(c.BodyField); err != nil {
		return err
	}
	_, err := parseURL(c.URL)
	return err
}

// Browser reads a stream as it was when the Browser was opened, without
// consuming it (XRANGE, no consumer group): it implements dlq.Browser, for
// dlq.Inspect, dlq.Classify, dlq.Replay and dlq.Requeue on a dead-letter
// stream. NewBrowser notes the stream's last entry id; Next returns the
// entries up to it, oldest first, and then an error wrapping io.EOF, so
// entries added later (dead-lettered again during a replay) are not read in
// the same pass. Acking a delivery deletes its entry (XDEL); a nacked or
// unsettled entry simply stays, and Close has nothing to give back.
type Browser struct {
	cfg   BrowserConfig
	mp    mapping
	rdb   *redis.Client
	end   string // last entry id at open; "" for an empty stream
	depth int64

	mu     sync.Mutex // serialises Next
	cursor string     // last id returned
	buf    []redis.XMessage
	done   bool

	closed    atomic.Bool
	closeOnce sync.Once
	closeErr  error
}

// NewBrowser validates cfg, connects and notes where cfg.Stream ends. A
// stream that does not exist browses as empty.
func NewBrowser(ctx context.Context, cfg BrowserConfig) (*Browser, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	rdb, err := newClient(cfg.URL, cfg.DialTimeout, 2)
	if err != nil {
		return nil, err
	}
	last, err := rdb.XRevRangeN(ctx, cfg.Stream, "+", "-", 1).Result()
	if err != nil {
		_ = rdb.Close()
		return nil, connectErr(cfg.URL, fmt.Errorf("XREVRANGE %q: %w", cfg.Stream, err))
	}
	b := &Browser{cfg: cfg, rdb: rdb, mp: mapping{bodyField: cfg.BodyField, disableFallbackID: true}}
	if len(last) == 1 {
		b.end = last[0].ID
		if b.depth, err = rdb.XLen(ctx, cfg.Stream).Result(); err != nil {
			_ = rdb.Close()
			return nil, fmt.Errorf("redisstream: XLEN %q: %w", cfg.Stream, err)
		}
	} else {
		b.done = true
	}
	return b, nil
}

// Depth is the number of entries the stream held when the Browser opened.
func (b *Browser) Depth() int64 { return b.depth }

// Next returns the next entry, or an error wrapping io.EOF after the last
// one present at open. After Close it returns an error wrapping
// consumer.ErrSourceClosed.
func (b *Browser) Next(ctx context.Context) (consumer.Delivery, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed.Load() {
		return nil, fmt.Errorf("redisstream: browse %q: %w", b.cfg.Stream, consumer.ErrSourceClosed)
	}
	if len(b.buf) == 0 && !b.done {
		start := "-"
		if b.cursor != "" {
			start = "(" + b.cursor
		}
		page, err := b.rdb.XRangeN(ctx, b.cfg.Stream, start, b.end, browsePage).Result()
		if err != nil {
			if b.closed.Load() || errors.Is(err, redis.ErrClosed) {
				return nil, fmt.Errorf("redisstream: browse %q: %v: %w", b.cfg.Stream, err, consumer.ErrSourceClosed)
			}
			return nil, fmt.Errorf("redisstream: browse %q: XRANGE: %w", b.cfg.Stream, err)
		}
		b.buf = page
		if len(page) < browsePage {
			b.done = true
		}
	}
	if len(b.buf) == 0 {
		return nil, fmt.Errorf("redisstream: browse %q: end of the stream as opened: %w", b.cfg.Stream, io.EOF)
	}
	e := b.buf[0]
	b.buf = b.buf[1:]
	b.cursor = e.ID
	if e.ID == b.end {
		b.done = true
	}
	return &browsed{b: b, id: e.ID, msg: b.mp.message(b.cfg.Stream, e)}, nil
}

// Close closes the Browser's connections. Nothing needs giving back: only
// acked entries were removed. Close is idempotent.
func (b *Browser) Close() error {
	b.closeOnce.Do(func() {
		b.closed.Store(true)
		if err := b.rdb.Close(); err != nil {
			b.closeErr = fmt.Errorf("redisstream: close browser: %w", err)
		}
	})
	return b.closeErr
}

// browsed is one entry read by a Browser.
type browsed struct {
	b       *Browser
	id      string
	msg     *consumer.Message
	settled atomic.Bool
}

func (d *browsed) Message() *consumer.Message { return d.msg }

// Ack deletes the entry from the stream (XDEL).
func (d *browsed) Ack(ctx context.Context) error {
	if !d.settled.CompareAndSwap(false, true) {
		return fmt.Errorf("redisstream: ack browsed entry %s: already settled: %w", d.id, consumer.ErrDeliveryStale)
	}
	if d.b.closed.Load() {
		return fmt.Errorf("redisstream: ack browsed entry %s: %w", d.id, consumer.ErrSourceClosed)
	}
	if err := d.b.rdb.XDel(ctx, d.b.cfg.Stream, d.id).Err(); err != nil {
		return fmt.Errorf("redisstream: delete entry %s of %q: %w", d.id, d.b.cfg.Stream, err)
	}
	return nil
}

// Nack leaves the entry in the stream.
func (d *browsed) Nack(context.Context, bool) error {
	if !d.settled.CompareAndSwap(false, true) {
		return fmt.Errorf("redisstream: nack browsed entry %s: already settled: %w", d.id, consumer.ErrDeliveryStale)
	}
	return nil
}
