package bench

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/redact"
)

// --- Redis Streams ---

type redisEnv struct {
	cfg Config
	rdb *redis.Client
	pub *redisstream.Publisher
}

func newRedisEnv(ctx context.Context, cfg Config) (*redisEnv, error) {
	rdb, err := dialRedis(ctx, cfg.RedisURL)
	if err != nil {
		return nil, err
	}
	pub, err := redisstream.NewPublisher(ctx, redisstream.PublisherConfig{URL: cfg.RedisURL})
	if err != nil {
		_ = rdb.Close()
		return nil, err
	}
	return &redisEnv{cfg: cfg, rdb: rdb, pub: pub}, nil
}

// dialRedis opens a raw go-redis client and pings the server. Its error
// names the URL without its password.
func dialRedis(ctx context.Context, url string) (*redis.Client, error) {
	wrap := func(err error) error {
		return redact.Error(fmt.Errorf("connect to Redis at %s (set --redis-url or REDIS_URL): %w", redact.URL(url), err), url)
	}
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, wrap(err)
	}
	rdb := redis.NewClient(opts)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		_ = rdb.Close()
		return nil, wrap(err)
	}
	return rdb, nil
}

func (e *redisEnv) target(context.Context, Mode) (target, error) {
	return &redisTarget{e: e, stream: targetName("s")}, nil
}

func (e *redisEnv) close() {
	if e == nil {
		return
	}
	_ = e.pub.Close()
	_ = e.rdb.Close()
}

type redisTarget struct {
	e      *redisEnv
	stream string
}

func (t *redisTarget) publish(ctx context.Context, msgs []*consumer.Message) error {
	_, err := t.e.pub.Publish(ctx, t.stream, msgs...)
	return err
}

// source is the adapter's Source with its defaults: it reads at most the
// runtime's window per XREADGROUP and holds twice that unsettled.
func (t *redisTarget) source(ctx context.Context, m Mode) (consumer.Source, error) {
	return redisstream.NewSource(ctx, redisstream.Config{
		URL:    t.e.cfg.RedisURL,
		Stream: t.stream,
		Group:  "bench-" + string(m),
	})
}

// consume is the plain go-redis recipe: a consumer group created at 0, one
// reader doing XREADGROUP > with COUNT up to the prefetch's free slots
// (entries read and not yet acked never exceed the prefetch), workers
// goroutines handling the entries, and one XACK per entry.
func (t *redisTarget) consume(ctx context.Context, m Mode, workers int, handle rawHandler) error {
	rdb, err := dialRedis(ctx, t.e.cfg.RedisURL)
	if err != nil {
		return err
	}
	defer rdb.Close()
	group, name := "bench-raw-"+string(m), "bench-raw-1"
	if err := rdb.XGroupCreateMkStream(ctx, t.stream, group, "0").Err(); err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
		return fmt.Errorf("create group: %w", err)
	}
	pf := prefetch(t.e.cfg, m)
	slots := make(chan struct{}, pf)
	entries := make(chan redis.XMessage, pf)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var e redis.XMessage
				select {
				case <-ctx.Done():
					return
				case e = <-entries:
				}
				str := func(k string) string { s, _ := e.Values[k].(string); return s }
				if err := handle(ctx, str("idempotency-key"), []byte(str("body")), str(HeaderPublishedAt)); err != nil {
					return // ctx is done; the entry stays pending
				}
				_ = rdb.XAck(ctx, t.stream, group, e.ID).Err()
				<-slots
			}
		}()
	}
	defer wg.Wait()
	for {
		// One slot, waiting for it, then every other free one.
		select {
		case <-ctx.Done():
			return nil
		case slots <- struct{}{}:
		}
		n := 1
	more:
		for n < pf {
			select {
			case slots <- struct{}{}:
				n++
			default:
				break more
			}
		}
		res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group: group, Consumer: name, Streams: []string{t.stream, ">"}, Count: int64(n), Block: time.Second,
		}).Result()
		got := 0
		if err == nil && len(res) == 1 {
			got = len(res[0].Messages)
			for _, e := range res[0].Messages {
				entries <- e
			}
		}
		for range n - got {
			<-slots
		}
		if err != nil && !errors.Is(err, redis.Nil) {
			if ctx.Err() != nil {
				return nil
			}
			sleepCtx(ctx, 10*time.Millisecond)
		}
	}
}

func (t *redisTarget) ready(context.Context, int) error { return nil }

func (t *redisTarget) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = t.e.rdb.Del(ctx, t.stream, redisstream.DLQName(t.stream)).Err()
}
