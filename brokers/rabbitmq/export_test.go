package rabbitmq

import (
	"context"
	"errors"
)

// BreakChannel makes the broker close s's current channel with 406
// PRECONDITION_FAILED, as it does on consumer_timeout, by acking a delivery
// tag the channel never issued. The connection stays up.
func BreakChannel(s *Source) error {
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	if sess == nil {
		return errors.New("no live session")
	}
	c := sess.cons.Load()
	if c == nil {
		return errors.New("the session does not consume yet")
	}
	return c.ch.Ack(1<<40, false)
}

// PublisherConnClosed reports whether p has noticed that its connection is
// gone (or has none).
func PublisherConnClosed(p *Publisher) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.conn == nil || p.conn.IsClosed()
}

// SourceConnLost reports whether s has noticed that its connection is gone
// (or has no session).
func SourceConnLost(s *Source) bool {
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	return sess == nil || sess.conn.IsClosed()
}

// StartConsuming starts s's consumer as its first Receive would, without
// taking a delivery: for tests that need two Sources consuming before
// anything is published.
func StartConsuming(ctx context.Context, s *Source) error {
	s.start()
	_, _, err := s.consumer(ctx)
	return err
}

// PublisherIdle is how many channels p keeps for its next calls.
func PublisherIdle(p *Publisher) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.idle)
}

// DefaultPrefetch is the prefetch of a Source no runtime configured.
const DefaultPrefetch = defaultPrefetch
