package redisstream

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/consumer"
)

// PublisherConfig configures a Publisher. The zero value of every optional
// field selects the documented default. The mapping fields must match the
// consuming Source's Config.
type PublisherConfig struct {
	// URL is the server's URL. Defaults to DefaultURL.
	URL string
	// BodyField is the field the body is written to. Defaults to "body".
	BodyField string
	// MaxLen, if positive, caps every stream published to (XADD MAXLEN ~
	// MaxLen): Redis then drops the oldest entries, read or not, acked or
	// not. A dropped entry that was never acked is lost, so leave it 0
	// unless consumers provably keep up. Defaults to 0: no cap.
	MaxLen int64
	// DialTimeout bounds each connection attempt. Defaults to 5s.
	DialTimeout time.Duration
}

func (c PublisherConfig) withDefaults() PublisherConfig {
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

func (c PublisherConfig) validate() error {
	switch {
	case c.MaxLen < 0:
		return configError("MaxLen", "negative")
	case c.DialTimeout < 0:
		return configError("DialTimeout", "negative")
	}
	if err := validateBodyField(c.BodyField); err != nil {
		return err
	}
	_, err := parseURL(c.URL)
	return err
}

// Publisher adds messages to streams with XADD. Create it with NewPublisher;
// it is safe for concurrent use.
type Publisher struct {
	cfg PublisherConfig
	mp  mapping
	rdb *redis.Client
}

// NewPublisher validates cfg and connects.
func NewPublisher(ctx context.Context, cfg PublisherConfig) (*Publisher, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	rdb, err := newClient(cfg.URL, cfg.DialTimeout, 0)
	if err != nil {
		return nil, err
	}
	if err := rdb.Ping(ctx).Err(); err != nil {
		_ = rdb.Close()
		return nil, connectErr(cfg.URL, err)
	}
	return &Publisher{cfg: cfg, mp: mapping{bodyField: cfg.BodyField}, rdb: rdb}, nil
}

// Publish adds msgs, in order, to stream (creating it if needed), in one
// round trip, and returns their entry ids. It returns once the server
// replied to every XADD; that reply means the entry is on disk only if
// the server runs with appendonly yes and appendfsync always. Message.ID
// goes to the id field, Message.Key to the key field (if configured), the
// body to the body field and every header to a field of its own; a header
// named like the body or key field is an error wrapping ErrReservedField,
// and then nothing is sent. On failure the error joins one *PublishError per
// failed message, and ids holds "" for them: a message whose reply was lost
// may have been added all the same, so publish it again only if its id
// field deduplicates it.
func (p *Publisher) Publish(ctx context.Context, stream string, msgs ...*consumer.Message) ([]string, error) {
	return xadd(ctx, p.rdb, p.mp, stream, p.cfg.MaxLen, msgs)
}

// Close closes the Publisher's connections.
func (p *Publisher) Close() error {
	if err := p.rdb.Close(); err != nil && !errors.Is(err, redis.ErrClosed) {
		return fmt.Errorf("redisstream: close publisher: %w", err)
	}
	return nil
}

// PublishError reports which message of a Publish call failed.
type PublishError struct {
	// Index is the message's position in the Publish call.
	Index int
	// MessageID is the message's ID.
	MessageID string
	// Err is the reason.
	Err error
}

// Error describes the failed message and why it failed.
func (e *PublishError) Error() string {
	return fmt.Sprintf("redisstream: publish message %d (id %q): %v", e.Index, e.MessageID, e.Err)
}

// Unwrap returns Err.
func (e *PublishError) Unwrap() error { return e.Err }

// MessageIndex returns Index, for the outbox relay, which counts it as an outbox.MessageError.
func (e *PublishError) MessageIndex() int { return e.Index }

func xadd(ctx context.Context, rdb *redis.Client, mp mapping, stream string, maxLen int64, msgs []*consumer.Message) ([]string, error) {
	if stream == "" {
		return nil, errors.New("redisstream: publish: empty stream name")
	}
	ids := make([]string, len(msgs))
	if len(msgs) == 0 {
		return ids, nil
	}
	args := make([]*redis.XAddArgs, len(msgs))
	var errs []error
	for i, m := range msgs {
		if m == nil {
			errs = append(errs, &PublishError{Index: i, Err: errors.New("nil message")})
			continue
		}
		vals, err := mp.values(m)
		if err != nil {
			errs = append(errs, &PublishError{Index: i, MessageID: m.ID, Err: err})
			continue
		}
		args[i] = &redis.XAddArgs{Stream: stream, Values: vals, MaxLen: maxLen, Approx: maxLen > 0}
	}
	if len(errs) > 0 {
		return ids, fmt.Errorf("redisstream: publish to %q: nothing sent: %w", stream, errors.Join(errs...))
	}
	cmds := make([]*redis.StringCmd, len(msgs))
	_, _ = rdb.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		for i, a := range args {
			cmds[i] = pipe.XAdd(ctx, a)
		}
		return nil
	})
	for i, c := range cmds {
		id, err := c.Result()
		if err != nil {
			errs = append(errs, &PublishError{Index: i, MessageID: msgs[i].ID, Err: err})
			continue
		}
		ids[i] = id
	}
	if len(errs) > 0 {
		return ids, fmt.Errorf("redisstream: publish to %q: %w", stream, errors.Join(errs...))
	}
	return ids, nil
}
