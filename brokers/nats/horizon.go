package natsjs

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/consumer"
)

// RedeliveryHorizon implements the RedeliveryHorizon of consumer.Source: it returns the time
// the stream stored the oldest message the durable consumer could still
// hand out, the first message on its filter subject past its ack floor (or,
// with no delivery awaiting its ack, past the last one delivered). That
// covers the messages delivered and not acked (in flight, nak'ed, or held
// by a process that died, which come back after AckWait) and those not yet
// delivered; a message acked out of order above the floor holds the
// horizon back too, and so may one that reached MaxDeliver. With no such
// message in the stream (every message acked, or the unacked ones removed
// from the stream by its limits or a purge) the horizon is zero: nothing
// is redeliverable. Without the durable (before the first Receive creates
// it, or after it was deleted) it is the oldest message on the subject,
// where the consumer Receive creates starts. A consumer the server holds
// with another filter than Config.Subject is read over every subject of
// the stream.
//
// It asks the server each time, so it covers every Source sharing Durable,
// those of processes that died included. A message cannot be applied
// before the stream stored it; the horizon assumes the stream's timestamps
// do not decrease with the sequence, up to the skew of the server's clock,
// which consumer.Config.HorizonMargin covers. If the server cannot be
// asked, it returns the error, and the janitor does not purge.
func (s *Source) RedeliveryHorizon(ctx context.Context) (time.Time, bool, error) {
	fail := func(what string, err error) (time.Time, bool, error) {
		return time.Time{}, false, fmt.Errorf("natsjs: horizon of consumer %q on stream %q: %s: %w", s.cfg.Durable, s.cfg.Stream, what, err)
	}
	if s.life.Err() != nil {
		return fail("closed", consumer.ErrSourceClosed)
	}
	from, filter := uint64(1), s.cfg.Subject
	c, err := s.js.Consumer(ctx, s.cfg.Stream, s.cfg.Durable)
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		// Receive creates it with DeliverAllPolicy: from the start.
	case err != nil:
		return fail("consumer info", err)
	default:
		info := c.CachedInfo()
		from = info.AckFloor.Stream + 1
		if info.NumAckPending == 0 {
			// Everything delivered is settled: only what is not
			// delivered yet can come. (A 2.9 server leaves the ack floor
			// below a pending message it drops because the stream lost
			// it, until the next ack.)
			from = max(from, info.Delivered.Stream+1)
		}
		if info.Config.FilterSubject != filter || len(info.Config.FilterSubjects) > 0 {
			filter = ""
		}
	}
	if filter == "" {
		filter = ">" // every subject of the stream
	}
	st, err := s.js.Stream(ctx, s.cfg.Stream)
	if err != nil {
		return fail("stream info", err)
	}
	m, err := st.GetMsg(ctx, from, jetstream.WithGetMsgSubject(filter))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return time.Time{}, true, nil // nothing left to hand out
	case err != nil:
		return fail(fmt.Sprintf("first message on %s from sequence %d", filter, from), err)
	}
	return m.Time, true, nil
}
