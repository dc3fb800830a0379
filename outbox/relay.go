package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/cenkalti/backoff/v4"

	"github.com/idemq/idemq/consumer"
)

// PublishFunc publishes msgs, in order, to destination (a queue or topic) and
// returns only once the broker has durably accepted every one of them: a
// confirmed publish, an acknowledged write. A non-nil error means the relay
// retries all of msgs later. With the idemq brokers:
//
//	// RabbitMQ: straight to the queue named by the destination.
//	func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
//		return rabbitPublisher.Publish(ctx, "", dest, msgs...)
//	}
//	// Kafka: the destination is the topic.
//	kafkaPublisher.Publish
type PublishFunc func(ctx context.Context, destination string, msgs ...*consumer.Message) error

// Defaults for RelayConfig.
const (
	DefaultBatchSize       = 100
	DefaultPollInterval    = 500 * time.Millisecond
	DefaultPublishTimeout  = 30 * time.Second
	DefaultPurgeInterval   = 10 * time.Minute
	DefaultInitialInterval = time.Second
	DefaultMaxInterval     = 5 * time.Minute
	DefaultMultiplier      = 2.0
	DefaultJitter          = 0.2
	maxBatchSize           = 10_000
)

// RelayConfig configures a Relay. The zero value of every optional field
// selects a documented default.
type RelayConfig struct {
	// Publish delivers messages to the broker. Required.
	Publish PublishFunc
	// BatchSize is the most rows locked and published per transaction.
	// Defaults to 100; at most 10,000.
	BatchSize int
	// PollInterval is the wait between polls once no row is due. A full
	// batch is followed by the next one at once. Defaults to 500ms.
	PollInterval time.Duration
	// PublishTimeout bounds each Publish call. Defaults to 30s.
	PublishTimeout time.Duration
	// Backoff paces the retries of rows whose publish failed.
	Backoff BackoffConfig
	// Retention, if positive, makes the relay purge rows sent more than
	// Retention ago every PurgeInterval. Defaults to 0: never; call
	// Outbox.Purge yourself.
	Retention time.Duration
	// PurgeInterval is the time between purges. Defaults to 10m.
	PurgeInterval time.Duration
	// Logger receives the relay's logs. Defaults to a logger that
	// discards everything.
	Logger *slog.Logger
	// Hooks receive events for metrics; each must implement at least one
	// of HookPublished and HookPublishFailed.
	Hooks []Hook
}

// BackoffConfig is the exponential backoff between publish attempts of a row:
// after its n-th failure a row is due again after about
// InitialInterval * Multiplier^(n-1), capped at MaxInterval, randomised by
// ±Jitter.
type BackoffConfig struct {
	// InitialInterval is the delay after the first failure. Defaults to 1s.
	InitialInterval time.Duration
	// MaxInterval caps the delay. Defaults to 5m.
	MaxInterval time.Duration
	// Multiplier grows the delay after each failure. Defaults to 2; at
	// least 1.
	Multiplier float64
	// Jitter is the randomization factor, between 0 and 1. Defaults to
	// 0.2; a negative value disables it.
	Jitter float64
}

// Hook is a value implementing HookPublished, HookPublishFailed or both.
// Hooks are called synchronously by the relay and must be fast.
type Hook any

// HookPublished is called after a Publish call succeeded, before the rows
// are marked sent.
type HookPublished interface {
	OnPublished(ctx context.Context, destination string, msgs []*consumer.Message, took time.Duration)
}

// HookPublishFailed is called after a Publish call failed; the rows are due
// again after retryIn.
type HookPublishFailed interface {
	OnPublishFailed(ctx context.Context, destination string, msgs []*consumer.Message, err error, retryIn time.Duration)
}

// RelayStats are a Relay's counters since it was created.
type RelayStats struct {
	// Batches counts transactions that locked at least one row.
	Batches int64
	// Published counts messages whose publish succeeded and whose row was
	// marked sent.
	Published int64
	// Failed counts message publishes that failed and were rescheduled.
	Failed int64
	// Errors counts batches that failed for another reason (the database,
	// a lost commit); their rows are published again later.
	Errors int64
	// Purged counts rows deleted by the relay's retention.
	Purged int64
}

func (c RelayConfig) withDefaults() RelayConfig {
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	if c.PurgeInterval == 0 {
		c.PurgeInterval = DefaultPurgeInterval
	}
	b := &c.Backoff
	if b.InitialInterval == 0 {
		b.InitialInterval = DefaultInitialInterval
	}
	if b.MaxInterval == 0 {
		b.MaxInterval = max(DefaultMaxInterval, b.InitialInterval)
	}
	if b.Multiplier == 0 {
		b.Multiplier = DefaultMultiplier
	}
	if b.Jitter == 0 {
		b.Jitter = DefaultJitter
	} else if b.Jitter < 0 {
		b.Jitter = 0
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c RelayConfig) validate() error {
	switch {
	case c.Publish == nil:
		return configError("Publish", "required")
	case c.BatchSize < 1 || c.BatchSize > maxBatchSize:
		return configError("BatchSize", "%d, must be between 1 and %d", c.BatchSize, maxBatchSize)
	case c.PollInterval < 0:
		return configError("PollInterval", "negative")
	case c.PublishTimeout < 0:
		return configError("PublishTimeout", "negative")
	case c.Retention < 0:
		return configError("Retention", "negative")
	case c.PurgeInterval < 0:
		return configError("PurgeInterval", "negative")
	case c.Backoff.InitialInterval < 0:
		return configError("Backoff.InitialInterval", "negative")
	case c.Backoff.MaxInterval < c.Backoff.InitialInterval:
		return configError("Backoff.MaxInterval", "%s is less than InitialInterval %s", c.Backoff.MaxInterval, c.Backoff.InitialInterval)
	case c.Backoff.Multiplier < 1:
		return configError("Backoff.Multiplier", "%g, must be at least 1", c.Backoff.Multiplier)
	case c.Backoff.Jitter > 1:
		return configError("Backoff.Jitter", "%g, must be at most 1", c.Backoff.Jitter)
	}
	for i, h := range c.Hooks {
		_, ok1 := h.(HookPublished)
		_, ok2 := h.(HookPublishFailed)
		if !ok1 && !ok2 {
			return configError(fmt.Sprintf("Hooks[%d]", i), "%T implements no Hook interface", h)
		}
	}
	return nil
}

// delay returns the wait before the next attempt of a row that has now
// failed attempts times.
func (b BackoffConfig) delay(attempts int) time.Duration {
	eb := &backoff.ExponentialBackOff{
		InitialInterval:     b.InitialInterval,
		RandomizationFactor: b.Jitter,
		Multiplier:          b.Multiplier,
		MaxInterval:         b.MaxInterval,
		MaxElapsedTime:      0,
		Stop:                backoff.Stop,
		Clock:               backoff.SystemClock,
	}
	eb.Reset()
	// The interval stops growing at MaxInterval; 64 steps reach it for any
	// sane configuration.
	var d time.Duration
	for i := 0; i < min(max(attempts, 1), 64); i++ {
		d = eb.NextBackOff()
	}
	return d
}

// Relay delivers committed outbox rows to a broker. Create it with NewRelay
// and start it with Run. Any number of relays, in any number of processes,
// may run over the same table.
type Relay struct {
	ob  *Outbox
	cfg RelayConfig
	log *slog.Logger

	published []HookPublished
	failed    []HookPublishFailed

	running atomic.Bool
	stats   struct{ batches, published, failed, errors, purged atomic.Int64 }

	// afterPublish, set by tests, runs after a successful Publish and
	// before the rows are marked sent; an error aborts the batch as a
	// crash would: nothing is recorded.
	afterPublish func(ctx context.Context) error
}

// NewRelay validates cfg and returns a relay over ob's table, using ob's
// database handle.
func NewRelay(ob *Outbox, cfg RelayConfig) (*Relay, error) {
	if ob == nil || ob.db == nil {
		return nil, configError("ob", "required: an Outbox made by New")
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	r := &Relay{ob: ob, cfg: cfg, log: cfg.Logger.With(slog.String("outbox", ob.String()))}
	for _, h := range cfg.Hooks {
		if v, ok := h.(HookPublished); ok {
			r.published = append(r.published, v)
		}
		if v, ok := h.(HookPublishFailed); ok {
			r.failed = append(r.failed, v)
		}
	}
	return r, nil
}

// Stats returns a snapshot of the relay's counters.
func (r *Relay) Stats() RelayStats {
	return RelayStats{
		Batches:   r.stats.batches.Load(),
		Published: r.stats.published.Load(),
		Failed:    r.stats.failed.Load(),
		Errors:    r.stats.errors.Load(),
		Purged:    r.stats.purged.Load(),
	}
}

// Run relays due rows until ctx is done, then finishes the batch in progress
// (its publishes are bounded by PublishTimeout) and returns nil. Database
// errors are logged and retried with backoff; they do not stop Run. A Relay
// runs once at a time.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("outbox: Relay.Run called while already running")
	}
	defer r.running.Store(false)

	var wg sync.WaitGroup
	defer wg.Wait()
	if r.cfg.Retention > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.janitor(ctx)
		}()
	}

	errBackoff := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(50*time.Millisecond),
		backoff.WithMaxInterval(max(r.cfg.PollInterval, 5*time.Second)),
		backoff.WithMaxElapsedTime(0),
	)
	// A batch in progress finishes after ctx is done, so that rows whose
	// publish was confirmed are marked sent rather than sent again.
	work := context.WithoutCancel(ctx)
	for ctx.Err() == nil {
		n, err := r.RelayOnce(work)
		wait := time.Duration(0)
		switch {
		case err != nil:
			r.stats.errors.Add(1)
			wait = errBackoff.NextBackOff()
			r.log.Warn("outbox: relay batch failed", slog.Any("error", err), slog.Duration("retry_in", wait))
		case n < r.cfg.BatchSize:
			errBackoff.Reset()
			wait = r.cfg.PollInterval
		default:
			errBackoff.Reset()
		}
		if wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
			t.Stop()
		}
	}
	return nil
}

// RelayOnce relays one batch: it locks up to BatchSize due rows, publishes
// them grouped by destination, records each group's outcome and commits. It
// returns the number of rows it locked. Run calls it in a loop; call it
// directly to drive a relay from your own scheduler.
func (r *Relay) RelayOnce(ctx context.Context) (int, error) {
	tx, err := r.ob.db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("outbox: relay: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	type row struct {
		seq      int64
		attempts int
		msg      *consumer.Message
	}
	rows, err := tx.Query(ctx, r.ob.sql.claim, r.cfg.BatchSize)
	if err != nil {
		return 0, r.ob.wrap("relay: select due rows", err)
	}
	var (
		order  []string
		groups = map[string][]row{}
		n      int
	)
	for rows.Next() {
		var (
			rw   row
			dest string
			m    = &consumer.Message{Partition: -1, Offset: -1}
		)
		if err := rows.Scan(&rw.seq, &dest, &m.ID, &m.Key, &m.Headers, &m.Body, &m.Timestamp, &rw.attempts); err != nil {
			rows.Close()
			return 0, r.ob.wrap("relay: read due rows", err)
		}
		m.Source = dest
		rw.msg = m
		if _, ok := groups[dest]; !ok {
			order = append(order, dest)
		}
		groups[dest] = append(groups[dest], rw)
		n++
	}
	if err := rows.Err(); err != nil {
		return 0, r.ob.wrap("relay: read due rows", err)
	}
	if n == 0 {
		return 0, nil
	}
	r.stats.batches.Add(1)

	var (
		sent      []int64
		published int64
		failed    int64
	)
	for _, dest := range order {
		g := groups[dest]
		msgs := make([]*consumer.Message, len(g))
		for i, rw := range g {
			msgs[i] = rw.msg
		}
		start := time.Now()
		pctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
		perr := r.cfg.Publish(pctx, dest, msgs...)
		cancel()
		if perr == nil {
			for _, h := range r.published {
				h.OnPublished(ctx, dest, msgs, time.Since(start))
			}
			if r.afterPublish != nil {
				if err := r.afterPublish(ctx); err != nil {
					return n, err
				}
			}
			for _, rw := range g {
				sent = append(sent, rw.seq)
			}
			published += int64(len(g))
			continue
		}
		seqs := make([]int64, len(g))
		delays := make([]int64, len(g))
		var retryIn time.Duration
		for i, rw := range g {
			seqs[i] = rw.seq
			d := r.cfg.Backoff.delay(rw.attempts + 1)
			delays[i] = d.Microseconds()
			if i == 0 || d < retryIn {
				retryIn = d
			}
		}
		r.log.Warn("outbox: publish failed",
			slog.String("destination", dest), slog.Int("messages", len(g)),
			slog.Any("error", perr), slog.Duration("retry_in", retryIn))
		for _, h := range r.failed {
			h.OnPublishFailed(ctx, dest, msgs, perr, retryIn)
		}
		if _, err := tx.Exec(ctx, r.ob.sql.failed, seqs, truncate(perr.Error(), 2000), delays); err != nil {
			return n, r.ob.wrap("relay: record failure", err)
		}
		failed += int64(len(g))
	}
	if len(sent) > 0 {
		if _, err := tx.Exec(ctx, r.ob.sql.sent, sent); err != nil {
			return n, r.ob.wrap("relay: mark sent", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return n, r.ob.wrap("relay: commit", err)
	}
	r.stats.published.Add(published)
	r.stats.failed.Add(failed)
	return n, nil
}

func (r *Relay) janitor(ctx context.Context) {
	t := time.NewTicker(r.cfg.PurgeInterval)
	defer t.Stop()
	for {
		n, err := r.ob.Purge(ctx, r.cfg.Retention)
		r.stats.purged.Add(n)
		if err != nil && ctx.Err() == nil {
			r.log.Warn("outbox: purge failed", slog.Any("error", err))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// truncate cuts s to at most n bytes, on a rune boundary, and makes it
// valid UTF-8, as Postgres text requires.
func truncate(s string, n int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
