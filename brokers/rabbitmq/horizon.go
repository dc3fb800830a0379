package rabbitmq

import (
	"context"
	"sort"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// recvMark is when a delivery tag of a session was received, and the
// Source's received count after it.
type recvMark struct {
	tag uint64
	at  time.Time
	seq int64
}

// markLocked records tag's receipt; the caller holds sess.mu. Marks of tags
// already settled are dropped once they outnumber the window, so the slice
// stays a few windows long.
func (sess *session) markLocked(tag uint64, seq int64, window int) {
	sess.recv = append(sess.recv, recvMark{tag: tag, at: time.Now(), seq: seq})
	if len(sess.recv) > 2*window+64 {
		sess.pruneLocked()
	}
}

// pruneLocked drops the marks older than the oldest unacked tag and returns
// the oldest unacked tag's mark, if any. Tags grow on a channel, so the
// marks are sorted by tag.
func (sess *session) pruneLocked() (recvMark, bool) {
	if len(sess.unacked) == 0 {
		sess.recv = sess.recv[:0]
		return recvMark{}, false
	}
	oldest := ^uint64(0)
	for t := range sess.unacked {
		oldest = min(oldest, t)
	}
	i := sort.Search(len(sess.recv), func(i int) bool { return sess.recv[i].tag >= oldest })
	sess.recv = append(sess.recv[:0], sess.recv[i:]...)
	if len(sess.recv) == 0 || sess.recv[0].tag != oldest {
		return recvMark{}, false // not received through newDelivery: cannot happen
	}
	return sess.recv[0], true
}

// noteBacklog counts the messages ready in the queue as a consumer starts
// on ch: the backlog, which may hold messages applied and not acked by an
// earlier consumer (a crash, a lost connection). Until they are received and
// settled, RedeliveryHorizon cannot tell how old they are.
func (s *Source) noteBacklog(ch *amqp.Channel) error {
	q, err := ch.QueueDeclarePassive(s.cfg.Queue, true, false, false, false, nil)
	if err != nil {
		return err
	}
	s.backlogUntil.Store(s.received.Load() + int64(q.Messages))
	return nil
}

// RedeliveryHorizon implements the RedeliveryHorizon of consumer.Source: the receipt time of
// the oldest delivery still unsettled (acks deferred by AckBatch included),
// or zero if there is none. It cannot tell (ok false) before the first
// Receive, while the Source reconnects, and until the backlog that was ready
// in the queue when the current consumer started has been received and
// settled: those messages may have been applied by an earlier consumer
// that did not live to ack them, at a time nobody can read from the queue.
//
// It sees this Source's deliveries only. Other consumers of the same queue
// hold deliveries of their own, which come back to the queue if they die;
// RabbitMQ's consumer_timeout (30 minutes by default) bounds how long any
// delivery can stay unacked, so a retention well above it covers them.
func (s *Source) RedeliveryHorizon(context.Context) (time.Time, bool, error) {
	if err := s.closedErr(); err != nil {
		return time.Time{}, false, err
	}
	until := s.backlogUntil.Load()
	if !s.started.Load() || until < 0 {
		return time.Time{}, false, nil
	}
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	if sess == nil || sess.dead.Load() || sess.cons.Load() == nil {
		return time.Time{}, false, nil
	}
	sess.mu.Lock()
	oldest, any := sess.pruneLocked()
	sess.mu.Unlock()
	switch {
	case s.received.Load() < until:
		return time.Time{}, false, nil // the backlog is still arriving
	case any && oldest.seq <= until:
		return time.Time{}, false, nil // part of the backlog is unsettled
	case !any:
		return time.Time{}, true, nil
	}
	return oldest.at, true, nil
}
