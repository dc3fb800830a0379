package redisstream

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/consumer"
)

// DeadLetterer returns the Source's dead-letterer, for the runtime's
// consumer.Config.DeadLetterer. NewSource made it from Config.DeadLetter;
// every call returns the same one. It adds each failed message, wrapped in
// package dlq's envelope, to Config.DeadLetter.Stream (by default
// "<stream>.dlq") with XADD on the Source's own connection pool, mapped as
// the Source maps entries (id, key and body fields; headers, the envelope's
// included, as fields), so that a Browser on the dead-letter stream reads
// it back. DeadLetter returns nil once the server replied to the XADD: the
// runtime acks the original only after that, and only with appendonly yes
// and appendfsync always is that reply a promise that the dead letter is on
// disk (see Config.RequireAOF).
//
// The Source owns the dead-letterer: DeadLetter after Source.Close returns
// an error wrapping consumer.ErrSourceClosed. If the original's XACK is
// lost after the dead letter was added, the original comes again, fails
// again and is dead-lettered again: the dead-letter stream may hold a
// message twice, with the same x-idemq-message-id, and a replay applies it
// once.
func (s *Source) DeadLetterer() consumer.DeadLetterer { return s.dl }

func (s *Source) publishDeadLetter(ctx context.Context, m *consumer.Message) error {
	if s.closed() {
		return s.closedErr()
	}
	_, err := xadd(ctx, s.rdb, s.mp, s.cfg.DeadLetter.Stream, s.cfg.DeadLetter.MaxLen, []*consumer.Message{m})
	if err != nil && (s.closed() || errors.Is(err, redis.ErrClosed)) {
		return fmt.Errorf("%w (%v)", s.closedErr(), err)
	}
	return err
}
