package rabbitmq

import (
	"context"
	"errors"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
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

// PublisherOnClosedConn puts p in the state amqp091 leaves for a moment
// when a connection dies: the connection reports itself closed while its
// channels do not yet. It dials and closes a connection and makes it p's
// and its idle channels' (whose own channels stay open on the live one),
// and returns it and the live one, which the caller closes.
func PublisherOnClosedConn(p *Publisher, url string) (dead, live *amqp.Connection, err error) {
	if dead, err = closedConn(url); err != nil {
		return nil, nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.idle) == 0 {
		return nil, nil, errors.New("the publisher has no idle channel")
	}
	live = p.conn
	p.conn = dead
	for _, pc := range p.idle {
		pc.conn = dead
	}
	return dead, live, nil
}

// PublisherConn returns p's connection.
func PublisherConn(p *Publisher) *amqp.Connection {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.conn
}

// PublishDeadLetter publishes m to s's dead-letter queue as its
// dead-letterer does.
func PublishDeadLetter(ctx context.Context, s *Source, m *consumer.Message) error {
	return s.publishDeadLetter(ctx, m)
}

// SourceOnClosedConn is PublisherOnClosedConn for s's session and its idle
// dead-letter channels.
func SourceOnClosedConn(s *Source, url string) (dead, live *amqp.Connection, err error) {
	if dead, err = closedConn(url); err != nil {
		return nil, nil, err
	}
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	s.dlMu.Lock()
	defer s.dlMu.Unlock()
	if sess == nil || len(s.dlIdle) == 0 {
		return nil, nil, errors.New("the source has no session or no idle dead-letter channel")
	}
	live = sess.conn
	sess.conn = dead
	for _, pc := range s.dlIdle {
		pc.conn = dead
	}
	return dead, live, nil
}

// SourceConn returns the connection of s's session, or nil.
func SourceConn(s *Source) *amqp.Connection {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sess == nil {
		return nil
	}
	return s.sess.conn
}

// closedConn dials url and closes the connection.
func closedConn(url string) (*amqp.Connection, error) {
	c, err := amqp.Dial(url)
	if err != nil {
		return nil, err
	}
	return c, c.Close()
}
