package natsjs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

const (
	// closeDrainWait bounds how long Close waits for the iterator to give
	// up its buffered messages, and for the connection to flush the naks.
	closeDrainWait = 2 * time.Second
	// releaseDelay is the nak delay of the deliveries Close gives back:
	// short, but not next to none. A plain nak of the last message
	// delivered makes a NATS 2.9 server deliver it twice, and so did a
	// 1ms delay on a loaded machine: the naked messages came due while the
	// closing Source's pull request was still open on the server, which
	// handed the last one out again as a first delivery and kept another
	// until AckWait (TestConformance/CloseRequeuesUnacked failed every
	// time with three CPU hogs running; with 100ms, 16 of 16 passed).
	releaseDelay = 100 * time.Millisecond
	// retryInitial and retryMax bound the backoff between attempts to
	// open the pull (and to declare and check at start). The cap is short:
	// a consumer resumes within about retryMax of an outage's end. In a
	// cluster the outage is often the metadata leader's election, during
	// which creating the consumer was refused with 503 for 20 s and more
	// in long-nats-cluster; a request a second per Source costs nothing.
	retryInitial = 100 * time.Millisecond
	retryMax     = time.Second
	// ackAttempt bounds one ack's wait for the server's answer; a failed
	// ack is sent again after ackRetryInitial, doubling to ackRetryMax,
	// until AckWait runs out (see acker.ack).
	ackAttempt      = 2 * time.Second
	ackRetryInitial = 50 * time.Millisecond
	ackRetryMax     = time.Second
)

// Stats are a Source's counters since it was created.
type Stats struct {
	// Received counts deliveries returned by Receive.
	Received int64
	// Acked counts acks the server confirmed; AckFailures those it did
	// not (the message comes back after AckWait, and dedup skips it).
	Acked       int64
	AckFailures int64
	// AckRetries counts acks sent again after one got no answer.
	AckRetries int64
	// Nacked counts Nack calls (naks sent).
	Nacked int64
	// KeepAlives counts InProgress keep-alives sent for held deliveries.
	KeepAlives int64
	// Released counts deliveries the Source nak'ed at Close: received
	// (or buffered) and never settled.
	Released int64
	// Restarts counts the pull iterators opened after a failed one (a
	// deleted consumer, say).
	Restarts int64
}

// Source consumes a JetStream stream through a durable pull consumer with
// explicit acks. It implements consumer.Source, consumer.Source's Configure,
// consumer.Source's AckBatch and consumer.Source's RedeliveryHorizon; create it with NewSource. It is safe for
// concurrent use.
type Source struct {
	cfg Config
	nc  *nats.Conn
	js  jetstream.JetStream
	dl  consumer.DeadLetterer
	log atomic.Pointer[slog.Logger]
	m   mapper
	ack *acker

	life     context.Context // done once Close starts
	stop     context.CancelFunc
	stopOnce sync.Once

	// opening is held by whoever creates the consumer and its iterator.
	opening sync.Mutex

	mu      sync.Mutex
	started bool // set by the first Receive; Configure changes nothing after
	window  int  // deliveries the client buffers: the runtime's window
	pending int  // MaxAckPending in force
	iter    jetstream.MessagesContext
	held    map[*delivery]struct{}

	received, acked, ackFailures, ackRetries, nacked, keepAlives, released, restarts atomic.Int64
}

// NewSource validates cfg, connects, declares cfg.Topology if set, checks
// that the stream exists and that a stream captures the dead-letter
// subject, and makes the Source's dead-letterer. It consumes nothing: the
// durable consumer is created (or updated) and pulled from at the first
// Receive, so that the MaxAckPending the runtime's window asks for through
// Configure is the one the server applies.
func NewSource(ctx context.Context, cfg Config) (*Source, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Source{
		cfg:    cfg,
		window: defaultWindow,
		held:   map[*delivery]struct{}{},
	}
	s.pending = s.maxAckPending(s.window)
	var err error
	if s.dl, err = dlq.NewDeadLetterer(s.publishDeadLetter, cfg.DeadLetter.Options); err != nil {
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return nil, &consumer.ConfigError{Field: "DeadLetter.Options." + ce.Field, Reason: ce.Reason}
		}
		return nil, err
	}
	// The runtime's logger comes with Configure; until then, and without
	// a runtime, the Source's logs are discarded.
	s.log.Store(slog.New(slog.DiscardHandler))
	nc, err := connect(ctx, cfg.URL, "idemq-"+cfg.Durable, s.logger, cfg.Options)
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("natsjs: jetstream: %w", err)
	}
	// Each request is sent again if it gets no answer: during an
	// election one may be lost, and the caller's context may be long.
	if cfg.Topology != nil {
		if err := retryAPI(ctx, func(ctx context.Context) error { return declare(ctx, js, cfg) }); err != nil {
			nc.Close()
			return nil, err
		}
	}
	if err := retryAPI(ctx, func(ctx context.Context) error { return check(ctx, js, cfg) }); err != nil {
		nc.Close()
		return nil, err
	}
	s.nc, s.js = nc, js
	if s.ack, err = newAcker(s); err != nil {
		nc.Close()
		return nil, err
	}
	s.life, s.stop = context.WithCancel(context.Background())
	return s, nil
}

func (s *Source) withAttrs(l *slog.Logger) *slog.Logger {
	return l.With(slog.String("stream", s.cfg.Stream), slog.String("durable", s.cfg.Durable))
}

func (s *Source) logger() *slog.Logger { return s.log.Load() }

func (s *Source) maxAckPending(window int) int {
	if s.cfg.MaxAckPending > 0 {
		return s.cfg.MaxAckPending
	}
	return 2 * window
}

// Configure implements consumer.Source's Configure; consumer.New calls it
// once, before the first Receive. Unless Config.MaxAckPending was set,
// MaxAckPending becomes 2×set.Window, so that a message or batch is waiting
// whenever a worker frees up; the client buffers at most set.Window
// deliveries besides the ones the runtime holds. A Window of 0 or less
// keeps the window of a Source without a runtime, 8. The Source logs to set.Logger. It returns MaxAckPending, the window the runtime can count
// on.
//
// Once the first Receive has started the consumer, Configure changes
// nothing and returns the MaxAckPending in force.
func (s *Source) Configure(set consumer.SourceSettings) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return s.pending
	}
	if set.Window > 0 {
		s.window = set.Window
	}
	s.pending = s.maxAckPending(s.window)
	if set.Logger != nil {
		s.log.Store(s.withAttrs(set.Logger))
	}
	return s.pending
}

// Window returns the MaxAckPending in force (or to be applied at the first
// Receive): the most deliveries the server hands this consumer unacked.
func (s *Source) Window() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pending
}

// Stats returns the Source's counters.
func (s *Source) Stats() Stats {
	return Stats{
		Received:    s.received.Load(),
		Acked:       s.acked.Load(),
		AckFailures: s.ackFailures.Load(),
		AckRetries:  s.ackRetries.Load(),
		Nacked:      s.nacked.Load(),
		KeepAlives:  s.keepAlives.Load(),
		Released:    s.released.Load(),
		Restarts:    s.restarts.Load(),
	}
}

func (s *Source) closedErr() error {
	if s.life.Err() != nil {
		return fmt.Errorf("natsjs: stream %q, consumer %q: %w", s.cfg.Stream, s.cfg.Durable, consumer.ErrSourceClosed)
	}
	return nil
}

// consumerConfig is the durable consumer the Source creates or updates.
func (s *Source) consumerConfig(pending int) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       s.cfg.Durable,
		Description:   "idemq consumer",
		FilterSubject: s.cfg.Subject,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       s.cfg.AckWait,
		MaxDeliver:    s.cfg.MaxDeliver,
		MaxAckPending: pending,
	}
}

// pullExpiry is how long one pull request waits on the server.
const pullExpiry = 2 * time.Second

// iterator returns the pull iterator, creating (or updating) the durable
// consumer and opening the iterator if there is none.
func (s *Source) iterator(ctx context.Context) (jetstream.MessagesContext, error) {
	s.mu.Lock()
	it := s.iter
	s.mu.Unlock()
	if it != nil {
		return it, nil
	}
	s.opening.Lock()
	defer s.opening.Unlock()
	s.mu.Lock()
	s.started = true
	it, window, pending := s.iter, s.window, s.pending
	s.mu.Unlock()
	if it != nil {
		return it, nil
	}
	// Bounded like NewSource's requests: one lost in an election is
	// retried by Receive instead of waiting out ctx.
	actx, cancel := context.WithTimeout(ctx, apiAttemptTimeout)
	cons, err := s.js.CreateOrUpdateConsumer(actx, s.cfg.Stream, s.consumerConfig(pending))
	cancel()
	if err != nil {
		return nil, fmt.Errorf("natsjs: create consumer %q on stream %q: %w", s.cfg.Durable, s.cfg.Stream, err)
	}
	// A short pull expiry: a pull request the server leaves unanswered
	// (seen with nats-server 2.9 under load, with MaxAckPending reached
	// while the pull arrived) holds the iterator up for no longer than
	// this, instead of the client's default 30s.
	it, err = cons.Messages(jetstream.PullMaxMessages(min(window, pending)), jetstream.PullExpiry(pullExpiry))
	if err != nil {
		return nil, fmt.Errorf("natsjs: pull from consumer %q on stream %q: %w", s.cfg.Durable, s.cfg.Stream, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.life.Err() != nil {
		it.Stop()
		return nil, s.closedErr()
	}
	s.iter = it
	return it, nil
}

// dropIterator retires a failed iterator.
func (s *Source) dropIterator(it jetstream.MessagesContext) {
	s.mu.Lock()
	if s.iter == it {
		s.iter = nil
	}
	s.mu.Unlock()
	it.Stop()
}

// permanent reports an error retrying will not cure: the server refused
// the consumer's configuration, or the connection is closed for good.
func (s *Source) permanent(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.Code != 503 && apiErr.Code != 408 &&
		!errors.Is(err, jetstream.ErrStreamNotFound) && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return true
	}
	return s.nc.IsClosed()
}

// Receive returns the next delivery. The first call creates or updates the
// durable consumer (with the MaxAckPending in force, see Configure) and
// starts pulling. The client reconnects by itself after a lost connection;
// if the pull fails otherwise (the consumer was deleted, say), Receive
// recreates the consumer and pulls again, with backoff. It returns an error
// only for ctx, after Close (wrapping consumer.ErrSourceClosed), or when the
// server refuses the consumer's configuration or the connection is closed
// for good.
func (s *Source) Receive(ctx context.Context) (consumer.Delivery, error) {
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stopAfter := context.AfterFunc(s.life, cancel)
	defer stopAfter()
	wait := retryInitial
	for {
		if err := s.closedErr(); err != nil {
			return nil, err
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		it, err := s.iterator(rctx)
		if err == nil {
			var m jetstream.Msg
			m, err = it.Next(jetstream.NextContext(rctx))
			if err == nil {
				if s.life.Err() != nil {
					_ = m.NakWithDelay(releaseDelay) // Close may have passed already
					s.released.Add(1)
					return nil, s.closedErr()
				}
				s.received.Add(1)
				return s.newDelivery(m), nil
			}
			if s.life.Err() == nil && ctx.Err() == nil {
				s.dropIterator(it)
			}
		}
		if cerr := s.closedErr(); cerr != nil {
			return nil, cerr
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if s.permanent(err) {
			return nil, err
		}
		s.restarts.Add(1)
		s.logger().Warn("natsjs: pull failed; retrying", slog.Any("error", err), slog.Duration("retry_in", wait))
		pause(rctx, wait)
		wait = min(2*wait, retryMax)
	}
}

// Close stops pulling, naks every delivery that was received (or buffered
// by the client) and not settled, so that JetStream redelivers it at once
// rather than after AckWait, and closes the connection. Ack and Nack on
// deliveries received before Close then return errors wrapping
// consumer.ErrSourceClosed, and so does DeadLetter on the Source's
// dead-letterer. A nak lost with the connection only delays the
// redelivery: the message comes back once AckWait has passed. Close is
// idempotent.
func (s *Source) Close() error {
	s.stopOnce.Do(func() {
		s.stop()
		s.opening.Lock() // wait for a consumer being opened; it sees life done
		s.opening.Unlock()
		s.mu.Lock()
		it := s.iter
		s.iter = nil
		held := make([]*delivery, 0, len(s.held))
		for d := range s.held {
			held = append(held, d)
		}
		s.mu.Unlock()
		if it != nil {
			// Drain stops pulling and keeps the buffered messages for
			// Next; they are nak'ed like the held ones.
			it.Drain()
			deadline := time.Now().Add(closeDrainWait)
			for time.Now().Before(deadline) {
				m, err := it.Next(jetstream.NextMaxWait(time.Until(deadline)))
				if err != nil {
					break
				}
				if m.NakWithDelay(releaseDelay) == nil {
					s.released.Add(1)
				}
			}
			it.Stop()
		}
		for _, d := range held {
			if d.release() {
				s.released.Add(1)
			}
		}
		_ = s.nc.FlushTimeout(closeDrainWait)
		s.nc.Close()
	})
	return nil
}

// delivery implements consumer.Delivery for one JetStream message.
type delivery struct {
	src *Source
	m   jetstream.Msg
	msg *consumer.Message

	mu      sync.Mutex
	settled bool
	timer   *time.Timer
	// due is when JetStream hands the message out again unless it hears
	// of it: AckWait after its receipt or its last keep-alive.
	due time.Time
}

func (s *Source) newDelivery(m jetstream.Msg) *delivery {
	d := &delivery{src: s, m: m, msg: s.m.message(m)}
	d.msg.Metadata[MetaConsumer] = s.cfg.Durable
	s.mu.Lock()
	s.held[d] = struct{}{}
	s.mu.Unlock()
	d.mu.Lock()
	d.due = time.Now().Add(s.cfg.AckWait)
	d.timer = time.AfterFunc(s.cfg.AckWait/3, d.keepAlive)
	d.mu.Unlock()
	return d
}

// keepAlive tells JetStream the delivery is still being worked on, so that
// AckWait restarts, and arms itself again: the runtime may hold a delivery
// (a slow handler, retries with backoff) far longer than AckWait.
func (d *delivery) keepAlive() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.settled || d.src.life.Err() != nil {
		return
	}
	sent := time.Now()
	if err := d.m.InProgress(); err != nil {
		d.src.logger().Warn("natsjs: keep-alive failed; JetStream may redeliver the message after AckWait",
			slog.String("message_id", d.msg.ID), slog.Int64("stream_seq", d.msg.Offset), slog.Any("error", err))
	} else {
		d.src.keepAlives.Add(1)
		d.due = sent.Add(d.src.cfg.AckWait)
	}
	d.timer.Reset(d.src.cfg.AckWait / 3)
}

// settle marks the delivery settled, once, and stops its keep-alive.
func (d *delivery) settle(op string) error {
	if err := d.src.closedErr(); err != nil {
		return fmt.Errorf("natsjs: %s stream seq %d: %w", op, d.msg.Offset, err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.settled {
		return fmt.Errorf("natsjs: %s stream seq %d: already settled: %w", op, d.msg.Offset, consumer.ErrDeliveryStale)
	}
	d.settled = true
	d.timer.Stop()
	d.src.mu.Lock()
	delete(d.src.held, d)
	d.src.mu.Unlock()
	return nil
}

// release naks the delivery at Close unless it is settled.
func (d *delivery) release() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.settled {
		return false
	}
	d.settled = true
	d.timer.Stop()
	return d.m.NakWithDelay(releaseDelay) == nil
}

// Message returns the delivered message.
func (d *delivery) Message() *consumer.Message { return d.msg }

// Ack acks the message and waits for the server to confirm it, so that a
// nil return means JetStream will not redeliver it. An ack that gets no
// answer is sent again until the message's AckWait runs out (see
// acker.ack); after that, or once ctx ends, Ack returns an error wrapping
// consumer.ErrDeliveryStale: the message comes back, and dedup skips it.
func (d *delivery) Ack(ctx context.Context) error {
	if err := d.settle("ack"); err != nil {
		return err
	}
	return d.src.ack.ack(ctx, []*delivery{d})
}

// earliest returns the earlier of a and b.
func earliest(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// Nack gives the message back with a nak delayed by Config.NakDelay:
// JetStream redelivers it after that delay. requeue is ignored: without it
// the message is nak'ed too, never terminated, because JetStream has no
// dead-letter queue of its own and idemq never drops a message it has not
// dead-lettered (the runtime always requeues; its dead letters go through
// Source.DeadLetterer).
func (d *delivery) Nack(ctx context.Context, requeue bool) error {
	if err := d.settle("nack"); err != nil {
		return err
	}
	if err := d.m.NakWithDelay(d.src.cfg.NakDelay); err != nil {
		return fmt.Errorf("natsjs: nack stream seq %d: %w (%v)", d.msg.Offset, consumer.ErrDeliveryStale, err)
	}
	d.src.nacked.Add(1)
	return nil
}

// AckBatch implements consumer.Source's AckBatch: it acks every delivery
// of ds at once and waits for the server to confirm each, so a batch costs
// one round trip rather than one per message, and Ack's retries apply to
// each. Deliveries of another Source are acked through their own Ack.
func (s *Source) AckBatch(ctx context.Context, ds []consumer.Delivery) error {
	own := make([]*delivery, 0, len(ds))
	var errs []error
	for _, cd := range ds {
		d, ok := cd.(*delivery)
		if !ok || d.src != s {
			errs = append(errs, cd.Ack(ctx))
			continue
		}
		if err := d.settle("ack"); err != nil {
			errs = append(errs, err)
			continue
		}
		own = append(own, d)
	}
	if len(own) > 0 {
		errs = append(errs, s.ack.ack(ctx, own))
	}
	return errors.Join(errs...)
}
