package readmetour

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/brokers/redisstream"
)

// The streams of examples/nats and examples/redis, which the README's
// `idemq dlq` commands read and replay into: deleted before the tour, so
// that it starts from nothing, and after it, so that it leaves nothing.
var (
	tourNATSStreams = []string{"PAYMENTS", "PAYMENTS_DLQ"}
	tourRedisKeys   = []string{"payments", "payments.dlq"}
)

// The dead-letter streams the README's `idemq dlq --subject payments.dlq`
// and `--stream-key payments.dlq` read, which the examples must leave
// holding dead letters: a Redis key that does not exist reads as an empty
// DLQ, so the commands would pass reading nothing.
const (
	tourNATSDLQ  = "PAYMENTS_DLQ"
	tourRedisDLQ = "payments.dlq"
)

// streamServers are connections to the NATS server at $NATS_URL and the
// Redis server at $REDIS_URL (default the local ones).
type streamServers struct {
	nc  *nats.Conn
	js  jetstream.JetStream
	rdb *redis.Client
}

func dialStreamServers() (*streamServers, error) {
	nc, err := nats.Connect(envOr("NATS_URL", nats.DefaultURL), nats.Timeout(10*time.Second))
	if err != nil {
		return nil, fmt.Errorf("the tour needs NATS with JetStream (NATS_URL, default %s): %w", nats.DefaultURL, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	opt, err := redis.ParseURL(envOr("REDIS_URL", redisstream.DefaultURL))
	if err != nil {
		nc.Close()
		return nil, errors.New("REDIS_URL is not a redis:// or rediss:// URL")
	}
	return &streamServers{nc: nc, js: js, rdb: redis.NewClient(opt)}, nil
}

func (s *streamServers) close() {
	s.nc.Close()
	_ = s.rdb.Close()
}

// resetStreams deletes the tour's NATS JetStream streams and Redis keys.
func resetStreams() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := dialStreamServers()
	if err != nil {
		return err
	}
	defer s.close()
	for _, n := range tourNATSStreams {
		if err := s.js.DeleteStream(ctx, n); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("delete NATS stream %s: %w", n, err)
		}
	}
	if err := s.rdb.Del(ctx, tourRedisKeys...).Err(); err != nil {
		return fmt.Errorf("the tour needs Redis (REDIS_URL, default %s): delete %v: %w", redisstream.DefaultURL, tourRedisKeys, err)
	}
	return nil
}

// checkDLQsRead fails unless the NATS and Redis dead-letter streams the
// README's commands name hold dead letters after the tour.
func checkDLQsRead() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := dialStreamServers()
	if err != nil {
		return err
	}
	defer s.close()
	st, err := s.js.Stream(ctx, tourNATSDLQ)
	if err != nil {
		return fmt.Errorf("NATS stream %s, which examples/nats leaves for the README's `idemq dlq --subject payments.dlq`: %w", tourNATSDLQ, err)
	}
	if st.CachedInfo().State.Msgs == 0 {
		return fmt.Errorf("NATS stream %s is empty: the README's `idemq dlq --subject payments.dlq` read nothing", tourNATSDLQ)
	}
	n, err := s.rdb.XLen(ctx, tourRedisDLQ).Result()
	if err != nil {
		return fmt.Errorf("Redis stream %s: %w", tourRedisDLQ, err)
	}
	if n == 0 {
		return fmt.Errorf("Redis stream %s is empty or missing (examples/redis leaves its dead letters there): the README's `idemq dlq --stream-key %[1]s` read nothing", tourRedisDLQ)
	}
	return nil
}
