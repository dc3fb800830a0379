package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
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
	// lets one lane collect (see WindowedSource).
	batchSize int
	handler   Handler
	hooks     hooks
	log       *slog.Logger
	running   atomic.Bool
	stats     stats
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
	// Requeued counts messages given back to the broker unsettled (at
	// shutdown, or because dead-lettering failed).
	Requeued int64
	// DBErrors counts transactions that failed on the database (a lost
	// connection, a failed claim, an unknown commit outcome) and were
	// retried without counting against the message.
	DBErrors int64
	// InFlight is the number of deliveries received and not yet settled.
	InFlight int64
}

type stats struct {
	received, applied, duplicates, retries, deadLettered, ackFailures, requeued, dbErrors, inFlight atomic.Int64
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
		handler: Chain(h, cfg.Middleware...),
		hooks:   newHooks(cfg.Hooks),
		log:     cfg.Logger.With("consumer", cfg.Name),
	}
	r.checkPoolSize()
	r.batchSize = r.windowedBatchSize()
	return r, nil
}

// windowedBatchSize caps the batch size in batch mode to the source's window
// shared by the lanes: a lane cannot collect more than that, and waiting
// BatchWait for deliveries the window will not let in only adds latency.
func (r *Runtime) windowedBatchSize() int {
	size := r.cfg.BatchSize
	ws, ok := r.cfg.Source.(WindowedSource)
	if size <= 1 || !ok {
		return size
	}
	w := ws.Window()
	if w <= 0 || w >= r.cfg.Concurrency*size {
		return size
	}
	capped := max(1, min(size, w/r.cfg.Concurrency))
	r.log.Warn("idemq: the source's window (prefetch) is too small for the batch size; batches are capped and throughput suffers",
		"window", w, "concurrency", r.cfg.Concurrency, "batch_size", size, "batch_size_used", capped,
		"hint", "raise the source's prefetch to at least Concurrency×BatchSize (rabbitmq.Config.BatchSize sizes it)")
	return capped
}

// pooled is implemented by *pgxpool.Pool.
type pooled interface {
	Config() *pgxpool.Config
}

// checkPoolSize warns when DB is a pool with fewer connections than the
// runtime holds at once: each of the Concurrency workers (or batch lanes)
// holds one for its transaction, and the janitor one more. A smaller pool
// is not unsafe, but workers queue for connections and throughput is capped
// at the pool's size, which is easy to miss: pgxpool defaults to
// max(4, GOMAXPROCS) connections, fewer than the default Concurrency of 8 on
// most machines.
func (r *Runtime) checkPoolSize() {
	p, ok := r.cfg.DB.(pooled)
	if !ok {
		return
	}
	need := r.cfg.Concurrency
	if r.cfg.Retention > 0 {
		need++
	}
	if have := int(p.Config().MaxConns); have < need {
		r.log.Warn("idemq: the pgxpool has fewer connections than the runtime uses at once; workers will wait for connections and throughput is capped by the pool",
			"pool_max_conns", have, "needed", need, "concurrency", r.cfg.Concurrency, "hint", "set pgxpool.Config.MaxConns (or pool_max_conns in the URL) to at least the needed count")
	}
}

// Stats returns a snapshot of the runtime's counters.
func (r *Runtime) Stats() Stats {
	return Stats{
		Received:     r.stats.received.Load(),
		Applied:      r.stats.applied.Load(),
		Duplicates:   r.stats.duplicates.Load(),
		Retries:      r.stats.retries.Load(),
		DeadLettered: r.stats.deadLettered.Load(),
		AckFailures:  r.stats.ackFailures.Load(),
		Requeued:     r.stats.requeued.Load(),
		DBErrors:     r.stats.dbErrors.Load(),
		InFlight:     r.stats.inFlight.Load(),
	}
}

// Run receives and handles messages until ctx is done or the Source fails
// for good. Then it stops receiving, waits up to ShutdownTimeout for
// in-flight messages (a soft stop), cancels the rest with cause ErrShutdown
// (a hard stop: their transactions roll back and they are requeued), closes
// the Source and returns.
//
// Run returns nil after a stop through ctx, and an error wrapping
// ErrSourceClosed if the Source closed underneath it. A Runtime runs once at
// a time.
func (r *Runtime) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("idemq: Runtime.Run called while already running")
	}
	defer r.running.Store(false)

	workCtx, hardStop := context.WithCancelCause(context.WithoutCancel(ctx))
	defer hardStop(nil)

	var wg sync.WaitGroup
	if r.cfg.Retention > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.janitor(ctx)
		}()
	}

	var (
		slots    chan struct{}
		dispatch func(Delivery)
		finish   func() // waits for the dispatched work to end
	)
	if r.cfg.BatchSize > 1 {
		bd := newBatchDispatcher(r, workCtx)
		slots, dispatch = bd.slots, bd.dispatch
		finish = func() {
			bd.close()
			bd.wg.Wait()
		}
	} else {
		d := &dispatcher{r: r, ctx: workCtx, slots: make(chan struct{}, r.cfg.Concurrency), keys: map[string][]Delivery{}}
		slots, dispatch, finish = d.slots, d.dispatch, d.wg.Wait
	}
	runErr := r.receiveLoop(ctx, slots, dispatch)
	drained := make(chan struct{})
	go func() {
		finish()
		close(drained)
	}()
	return r.drain(runErr, drained, hardStop, &wg)
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
func (r *Runtime) receiveLoop(ctx context.Context, slots chan struct{}, dispatch func(Delivery)) error {
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
		r.stats.received.Add(1)
		r.stats.inFlight.Add(1)
		for _, h := range r.hooks.received {
			h.OnReceived(ctx, del.Message())
		}
		dispatch(del)
	}
}

// dispatcher runs deliveries concurrently, one at a time per key. Each
// delivery holds a slot from receipt to settlement, which bounds the number
// in memory to Concurrency.
type dispatcher struct {
	r     *Runtime
	ctx   context.Context
	slots chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	keys  map[string][]Delivery // busy keys and the deliveries waiting on them
}

func (d *dispatcher) dispatch(del Delivery) {
	key := del.Message().Key
	if key != "" {
		d.mu.Lock()
		if waiting, busy := d.keys[key]; busy {
			d.keys[key] = append(waiting, del)
			d.mu.Unlock()
			return
		}
		d.keys[key] = nil
		d.mu.Unlock()
	}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		for del != nil {
			d.r.process(d.ctx, del)
			<-d.slots
			del = d.next(key)
		}
	}()
}

// next pops the next delivery waiting on key, or marks key idle.
func (d *dispatcher) next(key string) Delivery {
	if key == "" {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	waiting := d.keys[key]
	if len(waiting) == 0 {
		delete(d.keys, key)
		return nil
	}
	d.keys[key] = waiting[1:]
	return waiting[0]
}

// outcome is the result of one attempt at a message.
type outcome int

const (
	outApplied outcome = iota
	outDuplicate
	outMismatch
	outHandlerErr // the handler (or a definite commit failure) failed
	outInfraErr   // the database failed or the commit is ambiguous: retry, do not count
)

type attemptResult struct {
	out         outcome
	err         error
	processedAt time.Time
	handlerDur  time.Duration
	commitDur   time.Duration
	timedOut    bool
}

// item is a delivery that passed the input checks.
type item struct {
	del   Delivery
	msg   *Message
	claim Claim
	log   *slog.Logger
}

// process settles one delivery: applied and acked, skipped and acked,
// dead-lettered and acked, or requeued.
func (r *Runtime) process(ctx context.Context, del Delivery) {
	defer r.stats.inFlight.Add(-1)
	if it, ok := r.precheck(ctx, del); ok {
		r.runOne(ctx, it)
	}
}

// precheck extracts the message id and checks the input. A message that
// cannot be handled is dead-lettered (or requeued at shutdown) and ok is
// false.
func (r *Runtime) precheck(ctx context.Context, del Delivery) (it item, ok bool) {
	msg := del.Message()
	// The runtime logs at Error and below: with those off (the default
	// discarding logger), skip building a per-message logger.
	logging := r.log.Enabled(ctx, slog.LevelError)
	log := r.log
	if logging {
		log = log.With("source", msg.Source)
	}
	if ctx.Err() != nil {
		r.requeue(del, log)
		return it, false
	}
	id, err := r.cfg.MessageID(msg)
	switch {
	case err != nil:
	case id == "":
		err = errors.New("message has no id")
	case len(id) > r.cfg.MaxIDBytes:
		err = fmt.Errorf("message id is %d bytes, over the %d-byte limit", len(id), r.cfg.MaxIDBytes)
		id = ""
	case !isText(id):
		// Postgres would refuse it on every claim, forever.
		err = fmt.Errorf("message id %q is not valid UTF-8 text (or holds a NUL byte), which Postgres cannot store", id)
		id = ""
	}
	if err != nil {
		r.deadLetter(ctx, del, log, Failure{Class: ClassMissingID, Err: fmt.Errorf("extract message id: %w", err)})
		return it, false
	}
	if logging {
		log = log.With("message_id", id)
	}
	if r.cfg.MaxBodyBytes >= 0 && len(msg.Body) > r.cfg.MaxBodyBytes {
		r.deadLetter(ctx, del, log, Failure{MessageID: id, Class: ClassTooLarge,
			Err: fmt.Errorf("body is %d bytes, over the %d-byte limit", len(msg.Body), r.cfg.MaxBodyBytes)})
		return it, false
	}
	claim := Claim{Consumer: r.cfg.Name, MessageID: id, Fingerprint: msg.Fingerprint(),
		Source: toText(msg.Source), Partition: msg.Partition, Offset: msg.Offset}
	return item{del: del, msg: msg, claim: claim, log: log}, true
}

// isText reports whether s can be stored in a Postgres text column: valid
// UTF-8 without NUL bytes.
func isText(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// toText makes s storable in a Postgres text column, replacing invalid
// UTF-8 and NUL bytes with U+FFFD. It is used for forensic fields only.
func toText(s string) string {
	if isText(s) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// runOne applies one message in its own transaction, with retries, and
// settles it.
func (r *Runtime) runOne(ctx context.Context, it item) {
	del, msg, claim, log, id := it.del, it.msg, it.claim, it.log, it.claim.MessageID
	retry := r.newRetryBackOff()
	infra := newInfraBackOff()
	var attempts int
	var first, last time.Time
	for {
		if ctx.Err() != nil {
			r.requeue(del, log)
			return
		}
		res := r.attempt(ctx, msg, claim, attempts+1)
		switch res.out {
		case outApplied:
			r.stats.applied.Add(1)
			for _, h := range r.hooks.applied {
				h.OnApplied(ctx, msg, res.handlerDur, res.commitDur)
			}
			r.ack(del, log)
			return
		case outDuplicate:
			r.stats.duplicates.Add(1)
			log.Debug("idemq: duplicate skipped", "processed_at", res.processedAt)
			for _, h := range r.hooks.duplicate {
				h.OnDuplicate(ctx, msg, res.processedAt)
			}
			r.ack(del, log)
			return
		case outMismatch:
			r.deadLetter(ctx, del, log, Failure{MessageID: id, Class: ClassFingerprintMismatch,
				Err: fmt.Errorf("message id %q was applied at %s with a different payload", id, res.processedAt.Format(time.RFC3339Nano))})
			return
		case outInfraErr:
			if ctx.Err() != nil {
				continue // requeued at the top of the loop
			}
			r.stats.dbErrors.Add(1)
			wait := infra.NextBackOff()
			log.Warn("idemq: database error; retrying", "error", res.err, "wait", wait)
			sleepCtx(ctx, wait)
			continue
		}

		// A handler error.
		attempts++
		now := time.Now()
		if first.IsZero() {
			first = now
		}
		last = now
		if ctx.Err() != nil {
			continue // shutdown, not the message's fault
		}
		fail := Failure{MessageID: id, Err: res.err, Attempts: attempts, FirstFailure: first, LastFailure: last}
		var pe *PanicError
		switch {
		case errors.As(res.err, &pe):
			log.Error("idemq: handler panicked", "panic", fmt.Sprint(pe.Value), "stack", string(pe.Stack))
			fail.Class = ClassPanic
		case IsPermanent(res.err):
			fail.Class = ClassPermanent
		default:
			wait := retry.NextBackOff()
			if attempts < r.cfg.Retry.MaxAttempts && wait != backoff.Stop {
				r.stats.retries.Add(1)
				log.Info("idemq: handler failed; retrying", "error", res.err, "attempt", attempts, "wait", wait)
				for _, h := range r.hooks.retry {
					h.OnRetry(ctx, msg, attempts, res.err, wait)
				}
				sleepCtx(ctx, wait)
				continue
			}
			fail.Class = ClassRetryableExhausted
			if res.timedOut {
				fail.Class = ClassTimeout
			}
		}
		r.deadLetter(ctx, del, log, fail)
		return
	}
}

// attempt runs one transaction: begin, claim, handler, commit.
func (r *Runtime) attempt(ctx context.Context, msg *Message, claim Claim, attempt int) attemptResult {
	tx, res, err := r.beginClaim(ctx, claim)
	if tx != nil {
		defer r.rollback(ctx, tx)
	}
	if err != nil {
		return attemptResult{out: outInfraErr, err: err}
	}
	switch res.Outcome {
	case ClaimDuplicate:
		return attemptResult{out: outDuplicate, processedAt: res.ProcessedAt}
	case ClaimMismatch:
		return attemptResult{out: outMismatch, processedAt: res.ProcessedAt}
	case ClaimNew:
	default:
		return attemptResult{out: outInfraErr, err: fmt.Errorf("claim: unknown outcome %d", res.Outcome)}
	}

	hctx := ctx
	if r.cfg.HandlerTimeout > 0 {
		var cancel context.CancelFunc
		hctx, cancel = context.WithTimeout(ctx, r.cfg.HandlerTimeout)
		defer cancel()
	}
	msg.Attempt = attempt
	start := time.Now()
	err = r.callHandler(hctx, tx, msg)
	handlerDur := time.Since(start)
	if err != nil {
		// pgx closes a connection whose query was cancelled, so check
		// for a timeout before blaming the database.
		timedOut := errors.Is(hctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
		if !timedOut && connLost(tx) {
			return attemptResult{out: outInfraErr, err: fmt.Errorf("handler: database connection lost: %w", err)}
		}
		return attemptResult{out: outHandlerErr, err: err, timedOut: timedOut}
	}

	start = time.Now()
	err = tx.Commit(ctx)
	commitDur := time.Since(start)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			// The server answered: the transaction definitely rolled
			// back (a deferred constraint, a serialization failure).
			return attemptResult{out: outHandlerErr, err: fmt.Errorf("commit: %w", err)}
		}
		// The outcome is unknown. Never ack on it: the next attempt's
		// claim finds out whether it committed.
		return attemptResult{out: outInfraErr, err: fmt.Errorf("commit outcome unknown: %w", err)}
	}
	return attemptResult{out: outApplied, handlerDur: handlerDur, commitDur: commitDur}
}

// beginTxer is implemented by *pgxpool.Pool and *pgx.Conn.
type beginTxer interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// syncBegin starts a transaction whose commit is synchronous whatever the
// server or role default: acks depend on the commit being durable. Sent as
// one simple-protocol query, it costs one round trip.
const syncBegin = "BEGIN ISOLATION LEVEL READ COMMITTED; " + setSyncCommit

// setSyncCommit makes the current transaction's commit synchronous.
const setSyncCommit = "SET LOCAL synchronous_commit = on"

// begin starts a dedup transaction.
func (r *Runtime) begin(ctx context.Context) (pgx.Tx, error) {
	if b, ok := r.cfg.DB.(beginTxer); ok {
		tx, err := b.BeginTx(ctx, pgx.TxOptions{BeginQuery: syncBegin})
		if err != nil {
			return nil, fmt.Errorf("begin: %w", err)
		}
		return tx, nil
	}
	tx, err := r.cfg.DB.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	if _, err := tx.Exec(ctx, setSyncCommit); err != nil {
		r.rollback(ctx, tx)
		return nil, fmt.Errorf("set synchronous_commit: %w", err)
	}
	return tx, nil
}

// batchBeginner is implemented by *pgxpool.Pool and *pgx.Conn: a batch sent
// on it can begin a transaction (pgx.Batch.BeginTx). pgx.Tx has no BeginTx,
// so a savepoint DB does not qualify.
type batchBeginner interface {
	beginTxer
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// beginClaim begins the message's transaction and claims the message in it.
// When the DB and the Store allow it, BEGIN, SET LOCAL and the claim go in
// one pipelined round trip. A non-nil tx must be rolled back by the caller,
// also when err is not nil.
func (r *Runtime) beginClaim(ctx context.Context, claim Claim) (pgx.Tx, ClaimResult, error) {
	if q, ok := r.cfg.Store.(ClaimQueuer); ok {
		if db, ok := r.cfg.DB.(batchBeginner); ok {
			b := &pgx.Batch{}
			b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
			b.Queue(setSyncCommit)
			finish := q.QueueClaim(b, claim)
			br := db.SendBatch(ctx, b)
			tx := br.Tx()
			sendErr := br.Close()
			if tx == nil {
				return nil, ClaimResult{}, fmt.Errorf("begin and claim: the batch began no transaction (%v)", sendErr)
			}
			res, err := finish(ctx, tx, sendErr)
			if err == nil && sendErr != nil {
				err = sendErr // a store that did not report it
			}
			if err != nil {
				return tx, ClaimResult{}, fmt.Errorf("begin and claim: %w", err)
			}
			return tx, res, nil
		}
	}
	tx, err := r.begin(ctx)
	if err != nil {
		return nil, ClaimResult{}, err
	}
	res, err := r.cfg.Store.Claim(ctx, tx, claim)
	if err != nil {
		return tx, ClaimResult{}, fmt.Errorf("claim: %w", err)
	}
	return tx, res, nil
}

// rollback ends tx on a context detached from shutdown; after Commit it is
// a no-op.
func (r *Runtime) rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// callHandler runs the handler, turning a panic into a *PanicError.
func (r *Runtime) callHandler(ctx context.Context, tx pgx.Tx, msg *Message) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: stack()}
		}
	}()
	return r.handler(ctx, tx, msg)
}

func stack() []byte { return debug.Stack() }

// connLost reports whether tx's connection died, which makes a handler
// error the database's fault rather than the message's.
func connLost(tx pgx.Tx) bool {
	c := tx.Conn()
	return c != nil && c.IsClosed()
}

func (r *Runtime) ack(del Delivery, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
	defer cancel()
	if err := del.Ack(ctx); err != nil {
		// The effect is committed; the broker will redeliver and the
		// claim will find the duplicate.
		r.stats.ackFailures.Add(1)
		log.Warn("idemq: ack failed after commit; the redelivery will be skipped as a duplicate", "error", err)
		for _, h := range r.hooks.ackFailed {
			h.OnAckFailed(ctx, del.Message(), err)
		}
	}
}

func (r *Runtime) requeue(del Delivery, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
	defer cancel()
	r.stats.requeued.Add(1)
	if err := del.Nack(ctx, true); err != nil {
		// The broker redelivers unsettled messages anyway once the
		// source closes.
		log.Debug("idemq: requeue failed", "error", err)
	}
}

// deadLetter stores a failed message through the DeadLetterer, then acks it.
// If the dead-letter copy cannot be stored the message is requeued, never
// acked.
func (r *Runtime) deadLetter(ctx context.Context, del Delivery, log *slog.Logger, f Failure) {
	msg := del.Message()
	f.Consumer = r.cfg.Name
	if f.LastFailure.IsZero() {
		f.LastFailure = time.Now()
		f.FirstFailure = f.LastFailure
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	b := newInfraBackOff()
	var err error
	for try := 1; try <= 3; try++ {
		if err = r.cfg.DeadLetterer.DeadLetter(dctx, msg.Clone(), f); err == nil {
			break
		}
		if try < 3 && !sleepCtx(dctx, b.NextBackOff()) {
			break
		}
	}
	if err != nil {
		log.Error("idemq: dead-letter failed; requeueing", "class", f.Class, "reason", f.Err, "error", err)
		r.requeue(del, log)
		return
	}
	r.stats.deadLettered.Add(1)
	log.Warn("idemq: message dead-lettered", "class", f.Class, "reason", f.Err, "attempts", f.Attempts)
	for _, h := range r.hooks.deadLettered {
		h.OnDeadLettered(ctx, msg, f)
	}
	r.ack(del, log)
}

func (r *Runtime) janitor(ctx context.Context) {
	t := time.NewTicker(r.cfg.JanitorInterval)
	defer t.Stop()
	for {
		n, err := r.cfg.Purger.Purge(ctx, r.cfg.Retention)
		switch {
		case err != nil && ctx.Err() == nil:
			r.log.Error("idemq: purge failed", "error", err)
		case n > 0:
			r.log.Info("idemq: purged processed messages", "rows", n, "older_than", r.cfg.Retention)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
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
