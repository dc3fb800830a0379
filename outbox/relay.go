package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/cenkalti/backoff/v4"

	"github.com/idemq/idemq/consumer"
)

// PublishFunc publishes msgs, in order, to destination (a queue or topic) and
// returns nil only once the broker has durably accepted every one of them: a
// confirmed publish, an acknowledged write.
//
// To say which messages failed, return one [MessageError] (or any error
// with a method MessageIndex() int) per failed message, alone, wrapped, or joined with
// errors.Join: the relay then takes every message not named as confirmed
// and marks it sent, and retries only the named ones, each with its own
// backoff. Any other error says nothing about which messages were
// confirmed: if msgs holds more than one message, the relay publishes each
// of them again in a call of its own, so that each row gets its own outcome
// and a poison message fails alone. A message the first call did confirm is
// then published a second time, once; consumers deduplicate it by id. (If
// the first two of those calls fail as well, the broker is taken to be down
// and the remaining messages fail with the first error, unpublished.) With
// the idemq brokers:
//
//	// RabbitMQ: straight to the queue named by the destination.
//	func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
//		return rabbitPublisher.Publish(ctx, "", dest, msgs...)
//	}
//	// Kafka: the destination is the topic.
//	kafkaPublisher.Publish
type PublishFunc func(ctx context.Context, destination string, msgs ...*consumer.Message) error

// The defaults and limits of RelayConfig's fields, which their doc
// comments state.
const (
	defaultBatchSize       = 100
	defaultPollInterval    = 500 * time.Millisecond
	defaultPublishTimeout  = 30 * time.Second
	defaultPurgeInterval   = 10 * time.Minute
	defaultInitialInterval = time.Second
	defaultMaxInterval     = 5 * time.Minute
	defaultMultiplier      = 2.0
	defaultJitter          = 0.2
	maxBatchSize           = 10_000
	// defaultLeaseFactor: Lease defaults to this many times PublishTimeout.
	defaultLeaseFactor = 3
	// maxLease is the longest Lease accepted.
	maxLease = 7 * 24 * time.Hour
)

// RelayConfig configures a Relay. The zero value of every optional field
// selects a documented default.
type RelayConfig struct {
	// Publish delivers messages to the broker. Required.
	Publish PublishFunc
	// BatchSize is the most rows claimed and published per batch.
	// Defaults to 100; at most 10,000.
	BatchSize int
	// PollInterval is the wait between polls once no row is due. A full
	// batch is followed by the next one at once. Defaults to 500ms.
	PollInterval time.Duration
	// PublishTimeout bounds each Publish call. Defaults to 30s.
	PublishTimeout time.Duration
	// Lease is how long a claimed batch belongs to the relay. The relay
	// claims due rows in a short transaction, commits, publishes them
	// with no transaction open and then records each row's outcome, only
	// if the row is still leased to it. Until the lease expires no other
	// relay claims the rows; once it has, they are due again, which is
	// how the rows of a relay that died are redelivered. A relay stops
	// publishing a batch when less than a tenth of Lease is left (each
	// Publish call is cut short to that point), so that it can record the
	// outcomes in time; rows it did not get to are released at once. It
	// must exceed PublishTimeout and be at most 7 days. Defaults to 3 ×
	// PublishTimeout (90s with the default PublishTimeout), capped at 7
	// days.
	Lease time.Duration
	// Backoff paces the retries of rows whose publish failed.
	Backoff BackoffConfig
	// Retention, if positive, makes the relay purge rows sent more than
	// Retention ago every PurgeInterval. Defaults to 0: never; call
	// [Outbox.Purge] yourself.
	Retention time.Duration
	// PurgeInterval is the time between purges. Defaults to 10m.
	PurgeInterval time.Duration
	// Logger receives the relay's logs. Defaults to a logger that
	// discards everything.
	Logger *slog.Logger
	// Hooks receive events for metrics; see [Hook]. Each must implement
	// at least one of [HookPublished] and [HookPublishFailed].
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

// Hook receives a relay's events, for metrics, as [consumer.Hook] does the
// runtime's: a hook is a type that embeds [HookDefaults], which makes it a
// Hook, and implements [HookPublished], [HookPublishFailed] or both; the
// relay detects each once, at [NewRelay], and calls only the events the
// hook implements. A hook that implements neither is refused. Hooks are
// called synchronously by the relay and must be fast; a hook that panics
// is logged and ignored.
type Hook interface {
	// IsHook marks the type as a hook. Embed HookDefaults to implement it.
	IsHook() bool
}

// HookDefaults, embedded in a struct, makes it a [Hook].
type HookDefaults struct{}

// IsHook returns true.
func (HookDefaults) IsHook() bool { return true }

// HookPublished is called once per destination of a batch with the
// messages the broker confirmed, before their rows are marked sent; took is
// the time spent publishing to that destination.
type HookPublished interface {
	Hook
	OnPublished(ctx context.Context, destination string, msgs []*consumer.Message, took time.Duration)
}

// HookPublishFailed is called with messages whose publish failed, and their
// error, before the failures are recorded: once per message that failed
// with an error of its own (named by a MessageError, or failing its own
// call when the relay publishes a group one message at a time), and once
// for the messages that failed with the group's first error (a group of
// one, or the messages left unpublished once the broker is taken to be
// down or the lease runs short). The rows are due again after retryIn (the
// shortest of their delays).
type HookPublishFailed interface {
	Hook
	OnPublishFailed(ctx context.Context, destination string, msgs []*consumer.Message, err error, retryIn time.Duration)
}

// RelayStats are a Relay's counters since it was created.
type RelayStats struct {
	// Batches counts claims that leased at least one row.
	Batches int64
	// Published counts messages whose publish succeeded and whose row was
	// marked sent.
	Published int64
	// Failed counts message publishes that failed and were rescheduled.
	Failed int64
	// Fenced counts outcomes not recorded because the row's lease had
	// expired and another relay had claimed it since (or had already
	// recorded its own outcome): that relay's result stands.
	Fenced int64
	// Errors counts batches that failed for another reason (the database,
	// a lost commit); their rows are published again later.
	Errors int64
	// Purged counts rows deleted by the relay's retention.
	Purged int64
}

func (c RelayConfig) withDefaults() RelayConfig {
	if c.BatchSize == 0 {
		c.BatchSize = defaultBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = defaultPollInterval
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = defaultPublishTimeout
	}
	if c.PurgeInterval == 0 {
		c.PurgeInterval = defaultPurgeInterval
	}
	if c.Lease == 0 && c.PublishTimeout > 0 {
		if c.PublishTimeout >= maxLease/defaultLeaseFactor {
			c.Lease = maxLease
		} else {
			c.Lease = defaultLeaseFactor * c.PublishTimeout
		}
	}
	b := &c.Backoff
	if b.InitialInterval == 0 {
		b.InitialInterval = defaultInitialInterval
	}
	if b.MaxInterval == 0 {
		b.MaxInterval = max(defaultMaxInterval, b.InitialInterval)
	}
	if b.Multiplier == 0 {
		b.Multiplier = defaultMultiplier
	}
	if b.Jitter == 0 {
		b.Jitter = defaultJitter
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
	case c.Lease < 0:
		return configError("Lease", "negative")
	case c.Lease > maxLease:
		return configError("Lease", "%s, more than the longest lease accepted, %s", c.Lease, maxLease)
	case c.Lease <= c.PublishTimeout:
		return configError("Lease", "%s, must exceed PublishTimeout %s", c.Lease, c.PublishTimeout)
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
			return configError(fmt.Sprintf("Hooks[%d]", i), "%T implements neither HookPublished nor HookPublishFailed", h)
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

	published []HookPublished
	failed    []HookPublishFailed

	// owner is written to lease_owner with each claim, for operators: the
	// host, the process and this relay.
	owner string

	running atomic.Bool
	stats   struct{ batches, published, failed, fenced, errors, purged atomic.Int64 }

	// afterPublish, set by tests, runs after the messages of a destination
	// are published, if the broker confirmed any, and before outcomes are
	// recorded; an error aborts the batch as a crash would: nothing is
	// recorded and the rows stay leased until the lease expires.
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
	r := &Relay{ob: ob, cfg: cfg, owner: leaseOwner()}
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

// logger returns the relay's logger, naming the outbox: with its schema
// once the first claim has learned it from the search_path.
func (r *Relay) logger() *slog.Logger {
	return r.cfg.Logger.With(slog.String("outbox", r.ob.String()))
}

// Stats returns a snapshot of the relay's counters.
func (r *Relay) Stats() RelayStats {
	return RelayStats{
		Batches:   r.stats.batches.Load(),
		Published: r.stats.published.Load(),
		Failed:    r.stats.failed.Load(),
		Fenced:    r.stats.fenced.Load(),
		Errors:    r.stats.errors.Load(),
		Purged:    r.stats.purged.Load(),
	}
}

// Run relays due rows until ctx is done, then finishes the batch in progress
// (its publishes are bounded by PublishTimeout and the lease) and returns
// nil. Database errors are logged and retried with backoff; they do not
// stop Run. A Relay runs once at a time.
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
			r.logger().Warn("outbox: relay batch failed", slog.Any("error", err), slog.Duration("retry_in", wait))
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

// RelayOnce relays one batch. It claims up to BatchSize due rows in a short
// transaction, leasing them to this call for Lease, and commits; it
// publishes them, grouped by destination, with no transaction open; then it
// records each row's outcome (sent, or failed with its own error and
// backoff) in a second short transaction, for the rows still leased to it.
// It returns the number of rows it claimed. Run calls it in a loop; call it
// directly to drive a relay from your own scheduler.
func (r *Relay) RelayOnce(ctx context.Context) (int, error) {
	start := time.Now()
	token, err := newLeaseToken()
	if err != nil {
		return 0, err
	}
	batch, err := r.claim(ctx, token)
	if err != nil || len(batch) == 0 {
		return 0, err
	}
	r.stats.batches.Add(1)
	// The database started the lease after start, by its own clock; by
	// ours it expires no sooner than start + Lease.
	deadline := start.Add(r.cfg.Lease - r.cfg.Lease/10)

	var (
		order  []string
		groups = map[string][]*claimed{}
	)
	for _, c := range batch {
		dest := c.msg.Source
		if _, ok := groups[dest]; !ok {
			order = append(order, dest)
		}
		groups[dest] = append(groups[dest], c)
	}
	for _, dest := range order {
		g := groups[dest]
		r.publishGroup(ctx, dest, g, deadline)
		if r.afterPublish != nil && slices.ContainsFunc(g, func(c *claimed) bool { return c.outcome == outcomeSent }) {
			if err := r.afterPublish(ctx); err != nil {
				return len(batch), err
			}
		}
	}
	// The outcomes are recorded even if ctx ended after the publishes: rows
	// the broker confirmed must be marked sent, not published again when
	// their lease expires.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	return len(batch), r.record(rctx, token, batch)
}

// outcome is what became of a claimed row.
type outcome int

const (
	outcomeUnstarted outcome = iota // not published: the lease ran out first
	outcomeSent                     // confirmed by the broker
	outcomeFailed                   // failed; err says why
)

// claimed is a row leased to a RelayOnce call, and its outcome.
type claimed struct {
	seq      int64
	attempts int
	msg      *consumer.Message
	outcome  outcome
	err      error
	retryIn  time.Duration
	// shared: err is the error of the group's first Publish call.
	shared bool
	// due is when the row was due, for ordering the batch.
	due time.Time
}

// claim leases up to BatchSize due rows to token and returns them in the
// order they were due.
func (r *Relay) claim(ctx context.Context, token string) ([]*claimed, error) {
	tx, err := r.ob.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("outbox: relay: claim: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	st, err := r.ob.table.Statements(ctx, tx)
	if err != nil {
		return nil, fmt.Errorf("outbox: relay: claim: %w", err)
	}
	rows, err := tx.Query(ctx, st.claim, r.cfg.BatchSize, token, r.owner, r.cfg.Lease.Microseconds())
	if err != nil {
		return nil, r.ob.wrap("relay: claim due rows", err)
	}
	var batch []*claimed
	for rows.Next() {
		var (
			c = &claimed{msg: &consumer.Message{Partition: -1, Offset: -1}}
			m = c.msg
		)
		if err := rows.Scan(&c.seq, &m.Source, &m.ID, &m.Key, &m.Headers, &m.Body, &m.Timestamp, &c.attempts, &c.due); err != nil {
			rows.Close()
			return nil, r.ob.wrap("relay: read claimed rows", err)
		}
		if m.Key != "" {
			// The partition key is the broker's record key: publishers
			// write RecordKey, never the runtime's ordering Key.
			m.RecordKey = []byte(m.Key)
		}
		batch = append(batch, c)
	}
	if err := rows.Err(); err != nil {
		return nil, r.ob.wrap("relay: read claimed rows", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, r.ob.wrap("relay: claim: commit", err)
	}
	slices.SortFunc(batch, func(a, b *claimed) int {
		if c := a.due.Compare(b.due); c != 0 {
			return c
		}
		return cmp.Compare(a.seq, b.seq)
	})
	return batch, nil
}

// publishGroup publishes the rows of one destination and sets each row's
// outcome. A failed call that names its failed messages settles every row;
// one that does not is followed by one call per message, so that a poison
// message fails alone, unless the first two of those fail too.
func (r *Relay) publishGroup(ctx context.Context, dest string, g []*claimed, deadline time.Time) {
	start := time.Now()
	msgs := make([]*consumer.Message, len(g))
	for i, c := range g {
		msgs[i] = c.msg
	}
	started, err := r.publish(ctx, dest, msgs, deadline)
	switch {
	case !started:
		return
	case err == nil:
		for _, c := range g {
			c.outcome = outcomeSent
		}
	default:
		if failed, ok := messageErrors(err, len(g)); ok {
			for i, c := range g {
				if e, bad := failed[i]; bad {
					r.fail(c, e)
				} else {
					c.outcome = outcomeSent
				}
			}
			break
		}
		if len(g) == 1 {
			r.fail(g[0], err)
			g[0].shared = true
			break
		}
		r.logger().Info("outbox: publish failed; publishing its messages one at a time",
			slog.String("destination", dest), slog.Int("messages", len(g)), slog.Any("error", err))
		sent, failures := false, 0
		for _, c := range g {
			var (
				started bool
				e       error
			)
			// Once the first two calls of the pass failed too, the
			// broker is failing as a whole, not one message: the rest
			// fail with the group.
			if sent || failures < 2 {
				started, e = r.publish(ctx, dest, []*consumer.Message{c.msg}, deadline)
			}
			switch {
			case !started:
				// Out of time, or the broker is down: this row
				// failed with the group.
				r.fail(c, err)
				c.shared = true
			case e == nil:
				c.outcome = outcomeSent
				sent = true
			default:
				if failed, ok := messageErrors(e, 1); ok {
					e = failed[0]
				}
				r.fail(c, e)
				failures++
			}
		}
	}
	r.notify(ctx, dest, g, err, time.Since(start))
}

// publish makes one Publish call, cut short at deadline. It returns
// started false, and makes no call, if deadline has passed. A panic in the
// PublishFunc is returned as the call's error: the rows fail and are
// retried with backoff, rather than the relay's process crashing with the
// rows leased.
func (r *Relay) publish(ctx context.Context, dest string, msgs []*consumer.Message, deadline time.Time) (started bool, err error) {
	left := time.Until(deadline)
	if left <= 0 {
		return false, nil
	}
	pctx, cancel := context.WithTimeout(ctx, min(r.cfg.PublishTimeout, left))
	defer cancel()
	defer func() {
		if v := recover(); v != nil {
			started, err = true, fmt.Errorf("outbox: relay: PublishFunc panicked: %v", v)
		}
	}()
	return true, r.cfg.Publish(pctx, dest, msgs...)
}

// fail records on c that its publish failed with err, and when it is due
// again.
func (r *Relay) fail(c *claimed, err error) {
	c.outcome = outcomeFailed
	c.err = err
	c.retryIn = r.cfg.Backoff.delay(c.attempts + 1)
}

// notify logs the failures of a group and calls the hooks. groupErr is the
// error of the group's first Publish call: failures sharing it are reported
// together.
func (r *Relay) notify(ctx context.Context, dest string, g []*claimed, groupErr error, took time.Duration) {
	var sent []*consumer.Message
	for _, c := range g {
		if c.outcome == outcomeSent {
			sent = append(sent, c.msg)
		}
	}
	if len(sent) > 0 {
		for _, h := range r.published {
			r.hook("OnPublished", func() { h.OnPublished(ctx, dest, sent, took) })
		}
	}
	report := func(msgs []*consumer.Message, err error, retryIn time.Duration) {
		r.logger().Warn("outbox: publish failed",
			slog.String("destination", dest), slog.Int("messages", len(msgs)),
			slog.Any("error", err), slog.Duration("retry_in", retryIn))
		for _, h := range r.failed {
			r.hook("OnPublishFailed", func() { h.OnPublishFailed(ctx, dest, msgs, err, retryIn) })
		}
	}
	var (
		shared  []*consumer.Message
		retryIn time.Duration
	)
	for _, c := range g {
		switch {
		case c.outcome != outcomeFailed:
		case c.shared:
			if len(shared) == 0 || c.retryIn < retryIn {
				retryIn = c.retryIn
			}
			shared = append(shared, c.msg)
		default:
			report([]*consumer.Message{c.msg}, c.err, c.retryIn)
		}
	}
	if len(shared) > 0 {
		report(shared, groupErr, retryIn)
	}
}

// hook calls a hook, recovering a panic: it runs between the publish and
// the recording of outcomes, so a panic would otherwise crash the process
// with the rows leased and the broker's confirms unrecorded.
func (r *Relay) hook(name string, call func()) {
	defer func() {
		if v := recover(); v != nil {
			r.logger().Error("outbox: hook panicked; ignored", slog.String("hook", name), slog.Any("panic", v))
		}
	}()
	call()
}

// recordTimeout bounds the transaction that records a batch's outcomes.
const recordTimeout = 30 * time.Second

// record writes the outcomes of batch in one short transaction. Each update
// applies only to rows still leased to token; the others are counted as
// fenced.
func (r *Relay) record(ctx context.Context, token string, batch []*claimed) error {
	var (
		sent, released, failed []int64
		delays                 []int64
		errs                   []string
	)
	for _, c := range batch {
		switch c.outcome {
		case outcomeSent:
			sent = append(sent, c.seq)
		case outcomeFailed:
			failed = append(failed, c.seq)
			delays = append(delays, c.retryIn.Microseconds())
			errs = append(errs, truncate(c.err.Error(), 2000))
		default:
			released = append(released, c.seq)
		}
	}
	// The claim resolved the schema.
	st, err := r.ob.table.Statements(ctx, r.ob.db)
	if err != nil {
		return fmt.Errorf("outbox: relay: record outcomes: %w", err)
	}
	tx, err := r.ob.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("outbox: relay: record outcomes: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var nSent, nFailed, nReleased int64
	if len(sent) > 0 {
		tag, err := tx.Exec(ctx, st.sent, sent, token)
		if err != nil {
			return r.ob.wrap("relay: mark sent", err)
		}
		nSent = tag.RowsAffected()
	}
	if len(failed) > 0 {
		tag, err := tx.Exec(ctx, st.failed, failed, token, delays, errs)
		if err != nil {
			return r.ob.wrap("relay: record failures", err)
		}
		nFailed = tag.RowsAffected()
	}
	if len(released) > 0 {
		tag, err := tx.Exec(ctx, st.release, released, token)
		if err != nil {
			return r.ob.wrap("relay: release unpublished rows", err)
		}
		nReleased = tag.RowsAffected()
	}
	if err := tx.Commit(ctx); err != nil {
		return r.ob.wrap("relay: record outcomes: commit", err)
	}
	r.stats.published.Add(nSent)
	r.stats.failed.Add(nFailed)
	if fenced := int64(len(batch)) - nSent - nFailed - nReleased; fenced > 0 {
		r.stats.fenced.Add(fenced)
		r.logger().Warn("outbox: lease lost before the outcomes were recorded; another relay claimed the rows since",
			slog.Int64("rows", fenced), slog.Int("sent", len(sent)), slog.Int("failed", len(failed)))
	}
	if len(released) > 0 {
		r.logger().Warn("outbox: lease running out; rows released unpublished",
			slog.Int("rows", len(released)), slog.Duration("lease", r.cfg.Lease))
	}
	return nil
}

func (r *Relay) janitor(ctx context.Context) {
	t := time.NewTicker(r.cfg.PurgeInterval)
	defer t.Stop()
	for {
		n, err := r.ob.Purge(ctx, r.cfg.Retention)
		r.stats.purged.Add(n)
		if err != nil && ctx.Err() == nil {
			r.logger().Warn("outbox: purge failed", slog.Any("error", err))
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
