package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/idemq/idemq/consumer"
)

// AckBatch acks deliveries this Source delivered, in as few broker calls as
// it safely can. It implements consumer.Source's AckBatch for the runtime's batch
// mode, which calls it after the batch's transaction committed.
//
// A multiple ack acks every outstanding tag up to the one given, so it may
// only be sent up to the lowest tag still in flight on that channel. With
// concurrent batches most batches lie above another one still running, and
// acking them one by one would cost a broker call per message. So AckBatch
// defers them instead: a committed delivery waits, unacked, until every
// tag below it is settled, and then goes in one multiple ack with its
// neighbours. Deferring never acks before the commit, only later; a crash
// meanwhile makes the broker redeliver committed messages, which dedup
// skips. At most half the prefetch window waits like this: past that, the
// waiting deliveries are acked one by one, so a slow batch never stalls the
// channel. Close acks whatever still waits.
//
// Deliveries of a lost channel are abandoned (ErrDeliveryStale), exactly as
// Ack does. An error can also concern deliveries deferred by an earlier
// call, whose ack went out with this one.
func (s *Source) AckBatch(ctx context.Context, ds []consumer.Delivery) error {
	bySession := map[*session][]*delivery{}
	var errs []error
	for _, cd := range ds {
		d, ok := cd.(*delivery)
		if !ok || d.src != s {
			errs = append(errs, fmt.Errorf("rabbitmq: ack batch: %T is not a delivery of this source", cd))
			continue
		}
		bySession[d.sess] = append(bySession[d.sess], d)
	}
	for sess, group := range bySession {
		errs = append(errs, s.ackSession(sess, group))
	}
	return errors.Join(errs...)
}

func (s *Source) ackSession(sess *session, group []*delivery) error {
	var errs []error
	mine := make([]*delivery, 0, len(group))
	for _, d := range group {
		if !d.settled.CompareAndSwap(false, true) {
			errs = append(errs, fmt.Errorf("rabbitmq: ack delivery %d: already settled: %w", d.tag, consumer.ErrDeliveryStale))
			continue
		}
		mine = append(mine, d)
	}
	if len(mine) == 0 {
		return errors.Join(errs...)
	}
	if sess.dead.Load() {
		for _, d := range mine {
			errs = append(errs, d.abandon("ack", nil))
		}
		return errors.Join(errs...)
	}
	sess.mu.Lock()
	defer sess.mu.Unlock()
	for _, d := range mine {
		if _, ok := sess.unacked[d.tag]; !ok {
			// Not outstanding on this channel: acking it would close
			// the channel (unknown tag). The broker redelivers it if
			// it still holds it; dedup skips it.
			errs = append(errs, d.abandon("ack", errors.New("tag not outstanding")))
			continue
		}
		sess.unacked[d.tag] = true
		sess.deferred++
	}
	errs = append(errs, s.flushLocked(sess, s.maxDeferred()))
	return errors.Join(errs...)
}

// maxDeferred is how many committed deliveries may wait for a multiple ack.
func (s *Source) maxDeferred() int { return max(1, s.Window()/2) }

// flushLocked acks the deferred deliveries of sess that lie below every tag
// still in flight, with one multiple ack, and then, while more than keep
// remain deferred, the rest one by one, lowest first. sess.mu must be held:
// acks go out under it, so that no multiple ack is ever sent after one with
// a higher tag (the broker would close the channel for an unknown tag).
func (s *Source) flushLocked(sess *session, keep int) error {
	if sess.deferred == 0 {
		return nil
	}
	c := sess.cons.Load() // non-nil: deferred deliveries came from it
	if sess.dead.Load() || c == nil {
		return s.abandonDeferredLocked(sess, "ack", nil)
	}
	limit := ^uint64(0)
	for t, deferred := range sess.unacked {
		if !deferred && t < limit {
			limit = t
		}
	}
	var below, above []uint64
	for t, deferred := range sess.unacked {
		switch {
		case !deferred:
		case t < limit:
			below = append(below, t)
		default:
			above = append(above, t)
		}
	}
	if len(below) > 0 {
		top := slices.Max(below)
		if err := c.ch.Ack(top, len(below) > 1); err != nil {
			return s.abandonDeferredLocked(sess, "ack", err)
		}
		for _, t := range below {
			delete(sess.unacked, t)
		}
		sess.deferred -= len(below)
		s.acked.Add(int64(len(below)))
		if len(below) > 1 {
			s.multiAcks.Add(1)
		}
	}
	if len(above) <= keep {
		return nil
	}
	slices.Sort(above)
	for _, t := range above[:len(above)-keep] {
		if err := c.ch.Ack(t, false); err != nil {
			return s.abandonDeferredLocked(sess, "ack", err)
		}
		delete(sess.unacked, t)
		sess.deferred--
		s.acked.Add(1)
	}
	return nil
}

// abandonDeferredLocked gives up the deferred deliveries of a lost channel:
// the broker redelivers them and dedup skips them. sess.mu must be held.
func (s *Source) abandonDeferredLocked(sess *session, op string, cause error) error {
	var tags []uint64
	for t, deferred := range sess.unacked {
		if deferred {
			tags = append(tags, t)
			delete(sess.unacked, t)
		}
	}
	sess.deferred = 0
	if len(tags) == 0 {
		return nil
	}
	slices.Sort(tags)
	s.abandoned.Add(int64(len(tags)))
	return fmt.Errorf("rabbitmq: %s of %d committed deliveries (tags %d to %d) of queue %q: %w",
		op, len(tags), tags[0], tags[len(tags)-1], s.cfg.Queue, s.staleErr(cause))
}

// flushDeferred acks what deferred deliveries it can after a settlement
// lowered the lowest tag in flight; with all, it acks every one (at Close).
// Failures are logged: the deliveries are redelivered and skipped by dedup.
func (s *Source) flushDeferred(sess *session, all bool) {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	keep := s.maxDeferred()
	if all {
		keep = 0
	}
	if err := s.flushLocked(sess, keep); err != nil {
		s.logger().Warn("rabbitmq: deferred acks failed; the broker will redeliver those messages and dedup will skip them", "error", err)
	}
}
