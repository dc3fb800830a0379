package main

import (
	"context"
	"errors"
	"io"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/redact"
)

// go-redis logs its connection pool's dial failures to the process's
// stderr, past the command's own output; every one of them also comes back
// as the error a command reports.
func init() { redis.SetLogger(quietRedisLog{}) }

type quietRedisLog struct{}

func (quietRedisLog) Printf(context.Context, string, ...any) {}

// redisURLOr is the Redis URL of a flag, else $REDIS_URL, else the default.
func redisURLOr(flagValue string, e *env) string {
	if flagValue != "" {
		return flagValue
	}
	if u := e.getenv("REDIS_URL"); u != "" {
		return u
	}
	return redisstream.DefaultURL
}

// validateRedis checks the Redis Streams selection; keyFlag is the flag's
// name, for the message.
func (b *brokerFlags) validateRedis(e *env, keyFlag string) error {
	if b.streamKey == "" {
		return usagef("%s is required with --broker redis", keyFlag)
	}
	b.redisURL = redisURLOr(b.redisURL, e)
	return nil
}

// openRedisDLQ opens a Redis Streams dead-letter stream: a browser that
// reads the entries it holds now with XRANGE (no consumer group; acking an
// entry deletes it, XDEL) and, with withPublisher, a publisher that adds
// each original back to its source stream (XADD), its dedup id in the
// idempotency-key field and its body in the consumer's body field
// (--redis-body-field).
func openRedisDLQ(ctx context.Context, b *brokerFlags, withPublisher bool) (*dlqConn, error) {
	br, err := redisstream.NewBrowser(ctx, redisstream.BrowserConfig{URL: b.redisURL, Stream: b.streamKey,
		BodyField: b.redisBodyField})
	if err != nil {
		return nil, redact.Error(err, b.redisURL)
	}
	c := &dlqConn{browser: br, close: func() { _ = br.Close() }}
	if withPublisher {
		pub, err := redisstream.NewPublisher(ctx, redisstream.PublisherConfig{URL: b.redisURL,
			BodyField: b.redisBodyField})
		if err != nil {
			_ = br.Close()
			return nil, redact.Error(err, b.redisURL)
		}
		c.publish = func(ctx context.Context, stream string, m *consumer.Message) error {
			_, err := pub.Publish(ctx, stream, m)
			return err
		}
		c.close = func() { _ = br.Close(); _ = pub.Close() }
	}
	return c, nil
}

// statusRedisDepth reads the number of entries of the dead-letter stream
// (XLEN) and the time of the oldest, from its entry id. A stream that does
// not exist yet (nothing was ever dead-lettered to it) has depth 0.
func statusRedisDepth(ctx context.Context, b *brokerFlags) statusDLQ {
	d := statusDLQ{Broker: "redis", Name: b.streamKey}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	br, err := redisstream.NewBrowser(ctx, redisstream.BrowserConfig{URL: b.redisURL, Stream: b.streamKey, DialTimeout: statusTimeout})
	if err != nil {
		d.Error = redact.Error(err, b.redisURL).Error()
		return d
	}
	defer br.Close()
	depth := br.Depth()
	if depth > 0 {
		first, err := br.Next(ctx)
		switch {
		case errors.Is(err, io.EOF):
			// Deleted since: nothing older is left.
		case err != nil:
			d.Error = redact.Error(err, b.redisURL).Error()
			return d
		default:
			if at := first.Message().Timestamp; !at.IsZero() {
				at = at.UTC()
				d.Oldest = &at
			}
		}
	}
	d.Depth = &depth
	return d
}
