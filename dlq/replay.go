package dlq

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/idemq/idemq/consumer"
)

// ReplayConfig configures Replay.
type ReplayConfig struct {
	// Browser reads the dead-letter queue. Required. Replay closes it.
	Browser Browser
	// Consumer is the live consumer's configuration: the same Name (the
	// dedup scope), DB, Store, Handler and MessageID, and a DeadLetterer
	// for messages that fail again (normally the same dead-letter queue;
	// if nil, its Source's own, as in the live consumer). Its Source is
	// replaced by the browser. Its Retention is the default
	// of Retention below; the replay itself runs no janitor, so nothing is
	// purged by the replay while it runs (the live consumer's janitor
	// keeps its own schedule). Its OrderingKey is not run on a message
	// whose envelope recorded the original's ordering key (Entry.Key):
	// that key is already OrderingKey's.
	Consumer consumer.Config
	// Filter selects what to replay. Filter.Consumer is forced to
	// Consumer.Name. Messages that do not match stay in the queue.
	Filter Filter
	// Limit is the most messages to replay. Defaults to 0: no limit.
	Limit int
	// Rate caps replayed messages per second. Defaults to 0: no cap.
	Rate float64
	// Retention is the dedup store's retention window, for the
	// replay-horizon guard: a message whose dedup row may have been purged
	// could be applied twice by a replay, so it is left in the queue,
	// counted as BeyondHorizon, unless Force is set. A message is dated by
	// the earliest of its first failure (history included), its timestamp
	// and, for a fingerprint mismatch, the time the original with the same
	// id was applied (x-idemq-original-processed-at); a mismatch whose
	// original's row is gone from Consumer.Store is refused too, and so is
	// a mismatch envelope without that header when Consumer.Store cannot
	// look rows up (has no Lookup method, as *processed.Store has).
	// Defaults to Consumer.Retention, the live consumer's janitor window;
	// with neither set there is no guard.
	Retention time.Duration
	// Force replays messages beyond the retention horizon too: the only
	// way to turn the guard off when Consumer.Retention is set.
	Force bool
	// VerifyKeys, if set, replays only messages whose envelope is signed
	// (Options.SigningKey) with one of these keys; the others stay in the
	// queue, counted as Unverified. List the current key first and keys
	// being rotated out after it. Defaults to none: envelopes are trusted
	// as they are, and whoever can publish to the dead-letter queue can
	// choose a message's consumer, dedup id and source.
	VerifyKeys [][]byte
	// Progress, if set, is called after each replayed message settles.
	Progress func(Result)
}

// Result counts what a replay or dry run saw and did.
type Result struct {
	// Scanned counts messages read from the dead-letter queue.
	Scanned int64 `json:"scanned"`
	// Matched counts messages that passed the filter and the horizon guard.
	Matched int64 `json:"matched"`
	// Applied counts messages whose effect was applied now.
	Applied int64 `json:"applied"`
	// Skipped counts messages already applied before: acked, no effect.
	Skipped int64 `json:"skipped_already_applied"`
	// FailedAgain counts messages that failed again and went back to the
	// dead-letter queue with their history grown.
	FailedAgain int64 `json:"failed_again"`
	// Mismatched counts messages whose id was applied with a different
	// payload: dead-lettered again as fingerprint-mismatch.
	Mismatched int64 `json:"mismatched"`
	// BeyondHorizon counts messages left in the queue by the retention
	// guard.
	BeyondHorizon int64 `json:"beyond_horizon"`
	// Unsettled counts matched messages that stayed in the queue because
	// they could not be settled (for example the dead-letter publish
	// failed) or the replay stopped early.
	Unsettled int64 `json:"unsettled"`
	// Malformed counts messages with an unreadable envelope, left in the
	// queue.
	Malformed int64 `json:"malformed"`
	// Unverified counts selected messages left in the queue because their
	// envelope is not signed by any of VerifyKeys.
	Unverified int64 `json:"unverified"`
	// Truncated counts selected messages left in the queue because they
	// were cut to fit the broker (HeaderTruncated): their body is not
	// whole, so it is never applied.
	Truncated int64 `json:"truncated"`
}

// errEnd marks the end of the dead-letter queue to the runtime.
var errEnd = errors.New("dlq: end of dead-letter queue")

// Replay runs the dead-lettered messages selected by cfg through a
// consumer.Runtime built from cfg.Consumer, so through the same dedup path as
// the live consumer: already-applied messages are acked and counted as
// skipped, fixed ones apply exactly once, and those that still fail go back
// to the dead-letter queue. Messages whose dedup row may have been purged
// stay in the queue (see ReplayConfig.Retention). It returns when the
// queue, as it was at the start, has been read, or when ctx is done.
func Replay(ctx context.Context, cfg ReplayConfig) (Result, error) {
	if cfg.Browser == nil {
		return Result{}, &consumer.ConfigError{Field: "Browser", Reason: "required"}
	}
	retention := cfg.Retention
	if retention == 0 {
		retention = cfg.Consumer.Retention
	}
	if cfg.Limit < 0 || cfg.Rate < 0 || retention < 0 {
		_ = cfg.Browser.Close()
		return Result{}, &consumer.ConfigError{Field: "Limit/Rate/Retention", Reason: "negative"}
	}
	verify, err := newVerifier(cfg.VerifyKeys)
	if err != nil {
		_ = cfg.Browser.Close()
		return Result{}, err
	}
	filter := cfg.Filter
	filter.Consumer = cfg.Consumer.Name
	lookup, _ := cfg.Consumer.Store.(lookuper)
	name := cfg.Consumer.Name
	log := cfg.Consumer.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	src := &replaySource{browser: cfg.Browser, filter: filter, limit: cfg.Limit, force: cfg.Force,
		guard: horizon{retention: retention, lookup: lookup, scope: func(Record) string { return name }},
		rate:  newLimiter(cfg.Rate), verify: verify, log: log}

	cc := cfg.Consumer
	// The runtime defaults DeadLetterer to its Source's own; the replay's
	// Source is the browser, so take the live Source's before replacing it.
	if d, ok := cc.Source.(interface{ DeadLetterer() consumer.DeadLetterer }); ok && cc.DeadLetterer == nil {
		cc.DeadLetterer = d.DeadLetterer()
	}
	cc.Source = src
	// No janitor in the replay: it is a bounded pass, not the live
	// consumer, and a purge now could remove the rows the guard just
	// relied on.
	cc.Retention = 0
	idFunc := cc.MessageID
	if idFunc == nil {
		idFunc = func(m *consumer.Message) (string, error) { return m.ID, nil } // the runtime's default
	}
	// The envelope holds the id the live consumer extracted; prefer it,
	// so a replay dedupes on exactly the same id.
	cc.MessageID = func(m *consumer.Message) (string, error) {
		if _, ok := m.Headers[headerErrorClass]; ok {
			// An empty id in an envelope is a missing-id dead letter:
			// it stays one, rather than taking a broker-made id.
			return m.Header(headerMessageID), nil
		}
		return idFunc(m)
	}
	// The envelope holds the ordering key the live consumer's OrderingKey
	// made, which Restore gives back: running OrderingKey on it again
	// would order, route and claim the message under another key (on a
	// processed.Sharded, another shard, or a new row of a table keyed by
	// shard key: applied twice).
	if orderingKey := cc.OrderingKey; orderingKey != nil {
		cc.OrderingKey = func(m *consumer.Message) string {
			if m.Header(headerOriginalKey) != "" {
				return m.Key
			}
			return orderingKey(m)
		}
	}
	counter := &replayCounter{src: src, progress: cfg.Progress}
	cc.Hooks = append(append([]consumer.Hook(nil), cc.Hooks...), counter)
	rt, err := consumer.New(cc)
	if err != nil {
		_ = cfg.Browser.Close()
		return Result{}, fmt.Errorf("dlq: replay: %w", err)
	}
	err = rt.Run(ctx)
	res := src.result()
	res.Unsettled = res.Matched - res.Applied - res.Skipped - res.FailedAgain - res.Mismatched
	switch {
	case errors.Is(err, errEnd):
		err = nil
	case err != nil:
		err = fmt.Errorf("dlq: replay: %w", err)
	case ctx.Err() != nil:
		err = fmt.Errorf("dlq: replay stopped: %w", context.Cause(ctx))
	}
	if src.err != nil && err == nil {
		err = src.err
	}
	return res, err
}

// replaySource feeds the runtime the matching messages of a Browser.
type replaySource struct {
	browser Browser
	filter  Filter
	limit   int
	guard   horizon
	force   bool
	rate    *limiter
	verify  verifier
	log     *slog.Logger

	mu  sync.Mutex // guards res and err against the hooks
	res Result
	err error
}

func (s *replaySource) result() Result {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.res
}

func (s *replaySource) Receive(ctx context.Context) (consumer.Delivery, error) {
	for {
		s.mu.Lock()
		done := s.limit > 0 && s.res.Matched >= int64(s.limit)
		s.mu.Unlock()
		if done {
			return nil, fmt.Errorf("%w: limit reached: %w", errEnd, consumer.ErrSourceClosed)
		}
		d, err := s.browser.Next(ctx)
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: %w", errEnd, consumer.ErrSourceClosed)
		}
		if err != nil {
			if ctx.Err() == nil {
				// A broken browser ends the replay; what was not
				// acked stays in the queue.
				s.mu.Lock()
				s.err = fmt.Errorf("dlq: read dead-letter queue: %w", err)
				s.mu.Unlock()
				return nil, fmt.Errorf("%w: %w", errEnd, consumer.ErrSourceClosed)
			}
			return nil, err
		}
		msg := d.Message()
		rec, perr := readRecord(msg)
		matched := perr == nil && s.filter.Match(rec)
		trusted := matched && s.verify.trusted(msg)
		var (
			beyond string
			gerr   error
		)
		if trusted && !s.force && rec.Truncated == "" {
			// Outside the lock: it may look the original's row up.
			beyond, gerr = s.guard.check(ctx, rec, msg, time.Now())
		}
		s.mu.Lock()
		s.res.Scanned++
		switch {
		case perr != nil:
			s.res.Malformed++
			s.mu.Unlock()
			continue // left unacked: back in the queue at Close
		case !matched:
			s.mu.Unlock()
			continue
		case !trusted:
			s.res.Unverified++
			s.mu.Unlock()
			continue // left unacked: back in the queue at Close
		case rec.Truncated != "":
			s.res.Truncated++
			s.mu.Unlock()
			s.log.Warn("idemq: dlq replay: left a truncated dead letter", "message_id", rec.MessageID, "truncated", rec.Truncated,
				"original_size", rec.OriginalSize, "source", rec.Source, "offset", rec.Offset)
			continue // left unacked: back in the queue at Close
		case gerr != nil && ctx.Err() != nil:
			s.mu.Unlock()
			return nil, gerr
		case gerr != nil:
			// The guard could not look the original up: end the
			// replay, this message left in the queue.
			s.err = gerr
			s.mu.Unlock()
			return nil, fmt.Errorf("%w: %w", errEnd, consumer.ErrSourceClosed)
		case beyond != "":
			s.res.BeyondHorizon++
			s.mu.Unlock()
			s.log.Warn("idemq: dlq replay: left beyond the replay horizon", "message_id", rec.MessageID, "class", rec.Class, "reason", beyond)
			continue // left unacked: back in the queue at Close
		}
		s.res.Matched++
		s.mu.Unlock()
		if err := s.rate.wait(ctx); err != nil {
			return nil, err
		}
		return &replayDelivery{Delivery: d, msg: rec.Restore(msg)}, nil
	}
}

func (s *replaySource) Close() error { return s.browser.Close() }

type replayDelivery struct {
	consumer.Delivery
	msg *consumer.Message
}

func (d *replayDelivery) Message() *consumer.Message { return d.msg }

// replayCounter is the hook that turns runtime events into Result counts.
type replayCounter struct {
	consumer.HookDefaults
	src      *replaySource
	progress func(Result)
}

func (c *replayCounter) bump(f func(*Result)) {
	c.src.mu.Lock()
	f(&c.src.res)
	snapshot := c.src.res
	c.src.mu.Unlock()
	if c.progress != nil {
		c.progress(snapshot)
	}
}

// OnApplied implements consumer.HookApplied.
func (c *replayCounter) OnApplied(context.Context, *consumer.Message, time.Duration, time.Duration) {
	c.bump(func(r *Result) { r.Applied++ })
}

// OnDuplicate implements consumer.HookDuplicate.
func (c *replayCounter) OnDuplicate(context.Context, *consumer.Message, time.Time) {
	c.bump(func(r *Result) { r.Skipped++ })
}

// OnDeadLettered implements consumer.HookDeadLettered.
func (c *replayCounter) OnDeadLettered(_ context.Context, _ *consumer.Message, f consumer.Failure) {
	c.bump(func(r *Result) {
		if f.Class == consumer.ClassFingerprintMismatch {
			r.Mismatched++
		} else {
			r.FailedAgain++
		}
	})
}
