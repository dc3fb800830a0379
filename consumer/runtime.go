package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
)

// settleTimeout bounds an ack, nack, rollback or dead-letter call. They run
// on a context detached from shutdown so that a drained message is still
// settled properly.
const settleTimeout = 30 * time.Second

// Runtime runs a Handler over a Source with exactly-once effects. Create one
// with New and start it with Run.
type Runtime struct {
	cfg Config
	// batchSize is cfg.BatchSize, capped to what the source's window
	// lets one lane collect (see Source's Configure).
	batchSize int
	// conflicts counts the transactions that ended in a deadlock or a
	// serialization failure; batch lanes shrink their groups when it moves
	// (see batchDispatcher.runLane).
	conflicts atomic.Int64
	handler   Handler
	hooks     hooks
	log       *slog.Logger
	running   atomic.Bool
	stats     stats
	// fatalErr holds the error that stops the current Run for good (a
	// dedup table that does not exist); it is read on every attempt, so
	// it is an atomic. stopRecv, guarded by fatalMu, ends the receive loop.
	fatalErr atomic.Pointer[error]
	fatalMu  sync.Mutex
	stopRecv context.CancelCauseFunc
	// dupAges counts the ages of the duplicates, for the janitor.
	dupAges dupAges
	// router is cfg.Store when it is a ShardedStore, with its shards;
	// shards is 1 otherwise.
	router ShardedStore
	shards int
}

// Stats are a Runtime's counters since it was created.
type Stats struct {
	// Received counts deliveries taken from the Source.
	Received int64
	// Applied counts messages whose effect committed.
	Applied int64
	// Duplicates counts messages skipped as already applied.
	Duplicates int64
	// Retries counts handler attempts that failed and were retried.
	Retries int64
	// DeadLettered counts messages whose dead-letter copy was accepted.
	DeadLettered int64
	// AckFailures counts acks that failed after a commit or dead-letter.
	AckFailures int64
	// Requeued counts messages given back to the broker unsettled, at
	// shutdown or when a fatal error stops Run.
	Requeued int64
	// DeadLetterErrors counts DeadLetter calls that failed and were
	// retried.
	DeadLetterErrors int64
	// DBErrors counts transactions that failed on the database (a lost
	// connection, a failed claim, an unknown commit outcome) and were
	// retried without counting against the message.
	DBErrors int64
	// InFlight is the number of deliveries received and not yet settled.
	InFlight int64
}

type stats struct {
	received, applied, duplicates, retries, deadLettered, ackFailures, requeued, dlqErrors, dbErrors, inFlight atomic.Int64
}

// New validates cfg, fills in its defaults and returns a Runtime.
func New(cfg Config) (*Runtime, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	h := cfg.Handler
	if bh := cfg.BatchHandler; bh != nil {
		// A message isolated from its batch runs alone.
		h = func(ctx context.Context, tx pgx.Tx, msg *Message) error { return bh(ctx, tx, []*Message{msg}) }
	}
	r := &Runtime{
		cfg:     cfg,
		handler: chain(h, cfg.Middleware...),
		hooks:   newHooks(cfg.Hooks),
		log:     cfg.Logger.With("consumer", cfg.Name),
		shards:  1,
	}
	if ss, ok := cfg.Store.(ShardedStore); ok {
		n := ss.Shards()
		if n < 1 {
			return nil, &ConfigError{Field: "Store", Reason: fmt.Sprintf("a ShardedStore with %d shards", n)}
		}
		r.router, r.shards = ss, n
	}
	r.checkPoolSize()
	r.batchSize = r.configureSource()
	if cfg.Retention > 0 {
		r.hooks.duplicate = append(r.hooks.duplicate, &r.dupAges) // the retention's evidence; see janitor.go
	}
	return r, nil
}

// configureSource tells a Source with a Configure method the window and logger, and
// returns the batch size to use: cfg.BatchSize, capped in batch mode to
// what the source's window lets one lane collect, since waiting BatchWait
// for deliveries the window will not let in only adds latency.
func (r *Runtime) configureSource() int {
	size := r.cfg.BatchSize
	cs, ok := r.cfg.Source.(configurable)
	if !ok {
		return size
	}
	lanes := r.cfg.Concurrency * r.shards
	w := cs.Configure(SourceSettings{Window: lanes * size, Logger: r.log})
	if size <= 1 || w <= 0 || w >= lanes*size {
		return size
	}
	capped := max(1, min(size, w/lanes))
	r.log.Warn("idemq: the source's window (prefetch) is too small for the batch size; batches are capped and throughput suffers",
		"window", w, "concurrency", r.cfg.Concurrency, "batch_size", size, "batch_size_used", capped,
		"hint", "leave the source's prefetch unset: the runtime sizes it to Concurrency×BatchSize")
	return capped
}

// checkPoolSize warns when the Store has fewer connections than the runtime
// holds at once: each of the Concurrency workers (or batch lanes) holds one
// for its transaction, and the janitor one more. A smaller pool is not
// unsafe, but workers queue for connections and throughput is capped at the
// pool's size, which is easy to miss: pgxpool defaults to max(4, GOMAXPROCS)
// connections, fewer than the default Concurrency of 8 on most machines.
func (r *Runtime) checkPoolSize() {
	have := r.cfg.Store.MaxConns()
	need := r.cfg.Concurrency
	if r.cfg.Retention > 0 {
		need++
	}
	if have > 0 && have < need {
		r.log.Warn("idemq: the store's pool has fewer connections than the runtime uses at once; workers will wait for connections and throughput is capped by the pool",
			"pool_max_conns", have, "needed", need, "concurrency", r.cfg.Concurrency, "hint", "use processed.Open, which sizes its pool, or raise the pool's MaxConns (pool_max_conns in the URL)")
	}
}

// Stats returns a snapshot of the runtime's counters.
func (r *Runtime) Stats() Stats {
	return Stats{
		Received:         r.stats.received.Load(),
		Applied:          r.stats.applied.Load(),
		Duplicates:       r.stats.duplicates.Load(),
		Retries:          r.stats.retries.Load(),
		DeadLettered:     r.stats.deadLettered.Load(),
		AckFailures:      r.stats.ackFailures.Load(),
		Requeued:         r.stats.requeued.Load(),
		DeadLetterErrors: r.stats.dlqErrors.Load(),
		DBErrors:         r.stats.dbErrors.Load(),
		InFlight:         r.stats.inFlight.Load(),
	}
}

// Run receives and handles messages until ctx is done or the Source fails
// for good. Then it stops receiving, waits up to ShutdownTimeout for
// in-flight messages (a soft stop), cancels the rest with cause ErrShutdown
// (a hard stop: their transactions roll back and they are requeued), closes
// the Source and returns.
//
// Run returns nil after a stop through ctx, an error wrapping
// ErrSourceClosed if the Source closed underneath it, and, after
// requeueing what it holds, an error wrapping ErrNotMigrated if the dedup
// table does not exist, or the *ConfigError of StatementCacheError if the
// database connections lose pgx's prepared statements (a transaction
// pooler such as PgBouncer without default_query_exec_mode=exec in the
// URL). A Runtime runs once at a time.
//
// When it starts, before it receives, Run reads the Store's Durability if
// the Store has that optional method (processed.Store has) and logs it: a
// warning if a standby streams asynchronously (a failover to it can lose
// acked messages), if COMMITs wait for synchronous standbys that are not
// connected, or if the database is a standby.
func (r *Runtime) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("idemq: Runtime.Run called while already running")
	}
	defer r.running.Store(false)

	workCtx, hardStop := context.WithCancelCause(context.WithoutCancel(ctx))
	defer hardStop(nil)
	// The receive loop and the janitor stop together: when ctx is done,
	// when the source closes, or when a fatal error stops the runtime.
	recvCtx, stopRecv := context.WithCancelCause(ctx)
	defer stopRecv(nil)
	r.fatalMu.Lock()
	r.fatalErr.Store(nil)
	r.stopRecv = stopRecv
	r.fatalMu.Unlock()
	r.checkDurability(recvCtx)

	var wg sync.WaitGroup
	if r.cfg.Retention > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.janitor(recvCtx)
		}()
	}

	var (
		slots    chan struct{}
		dispatch func(context.Context, Delivery) bool
		finish   func() // waits for the dispatched work to end
	)
	if r.cfg.BatchSize > 1 {
		// Each shard has lanes of its own, so that a group holds messages
		// of one shard; the receive loop's slots bound them all.
		slots = make(chan struct{}, r.shards*batchSlots(r))
		bds := make([]*batchDispatcher, r.shards)
		for i := range bds {
			bds[i] = newBatchDispatcher(r, workCtx, slots)
		}
		dispatch = bds[0].dispatch
		if r.shards > 1 {
			// An unroutable message has shard 0; its precheck
			// dead-letters it.
			dispatch = func(ctx context.Context, del Delivery) bool {
				return bds[del.Message().route.Shard].dispatch(ctx, del)
			}
		}
		finish = func() {
			for _, bd := range bds {
				bd.close()
			}
			for _, bd := range bds {
				bd.wg.Wait()
			}
		}
	} else {
		d := newDispatcher(r, workCtx)
		slots, dispatch, finish = d.slots, d.dispatch, d.close
	}
	runErr := r.receiveLoop(recvCtx, slots, dispatch)
	stopRecv(nil)
	drained := make(chan struct{})
	go func() {
		finish()
		close(drained)
	}()
	err := r.drain(runErr, drained, hardStop, &wg)
	if ferr := r.fatal(); ferr != nil {
		return ferr
	}
	return err
}

// stop ends the current Run for good with err, which Run returns: the
// receive loop stops, and deliveries not yet settled are requeued.
func (r *Runtime) stop(err error) {
	r.fatalMu.Lock()
	defer r.fatalMu.Unlock()
	if r.fatalErr.Load() != nil {
		return
	}
	ferr := fmt.Errorf("idemq: stopping: %w", err)
	r.fatalErr.Store(&ferr)
	r.log.Error("idemq: stopping the runtime", "error", err)
	if r.stopRecv != nil {
		r.stopRecv(ferr)
	}
}

// fatal returns the error that stopped the current Run, if any.
func (r *Runtime) fatal() error {
	if p := r.fatalErr.Load(); p != nil {
		return *p
	}
	return nil
}

// stopping reports whether work on ctx must stop and be requeued: a hard
// stop, or a fatal error.
func (r *Runtime) stopping(ctx context.Context) bool {
	return ctx.Err() != nil || r.fatal() != nil
}

// drain waits for in-flight work after the receive loop ended, hard-stops it
// after ShutdownTimeout, and closes the source.
func (r *Runtime) drain(runErr error, drained chan struct{}, hardStop context.CancelCauseFunc, wg *sync.WaitGroup) error {
	r.log.Debug("idemq: stopping; draining in-flight messages", "in_flight", r.stats.inFlight.Load())
	timer := time.NewTimer(r.cfg.ShutdownTimeout)
	select {
	case <-drained:
		timer.Stop()
	case <-timer.C:
		r.log.Warn("idemq: shutdown timeout; cancelling in-flight handlers", "in_flight", r.stats.inFlight.Load())
		hardStop(ErrShutdown)
		<-drained
	}
	wg.Wait()
	if err := r.cfg.Source.Close(); err != nil && !errors.Is(err, ErrSourceClosed) {
		r.log.Warn("idemq: closing source", "error", err)
	}
	return runErr
}

// receiveLoop takes deliveries until ctx is done or the source is closed.
func (r *Runtime) receiveLoop(ctx context.Context, slots chan struct{}, dispatch func(context.Context, Delivery) bool) error {
	var failures int
	for {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			return nil
		}
		del, err := r.cfg.Source.Receive(ctx)
		if err != nil {
			<-slots
			switch {
			case ctx.Err() != nil:
				return nil
			case errors.Is(err, ErrSourceClosed):
				return fmt.Errorf("idemq: receive: %w", err)
			}
			failures++
			wait := min(time.Duration(failures)*100*time.Millisecond, 5*time.Second)
			r.log.Error("idemq: receive failed; retrying", "error", err, "wait", wait)
			if !sleepCtx(ctx, wait) {
				return nil
			}
			continue
		}
		failures = 0
		if r.cfg.OrderingKey != nil {
			r.orderingKey(del.Message())
		}
		r.routeMessage(del.Message())
		r.stats.received.Add(1)
		r.stats.inFlight.Add(1)
		for _, h := range r.hooks.received {
			r.hook("OnReceived", func() { h.OnReceived(ctx, del.Message()) })
		}
		if !dispatch(ctx, del) {
			// Stopped while the lanes it goes to were full: it was never
			// handed to them.
			r.requeue(del, r.log)
			r.stats.inFlight.Add(-1)
			<-slots
			return nil
		}
	}
}

func (r *Runtime) newRetryBackOff() *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = r.cfg.Retry.InitialInterval
	b.MaxInterval = r.cfg.Retry.MaxInterval
	b.MaxElapsedTime = r.cfg.Retry.MaxElapsed
	b.Reset()
	return b
}

// newInfraBackOff paces retries of database failures. It never gives up:
// the message stays unacked until the database is back or the runtime stops.
func newInfraBackOff() *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 50 * time.Millisecond
	b.MaxInterval = 5 * time.Second
	b.MaxElapsedTime = 0
	b.Reset()
	return b
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
