package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// BatchHandler applies the effects of a whole batch of new messages inside
// tx, the transaction that holds their dedup claims: for example with one
// multi-row INSERT or a COPY. It only receives messages whose claim is new,
// in delivery order. Returning an error rolls back the batch; the runtime
// then splits it to isolate the failing message, which is retried and
// dead-lettered on its own, so one bad message never sinks the others.
type BatchHandler func(ctx context.Context, tx pgx.Tx, msgs []*Message) error

// BatchAcker is implemented by sources that can settle many deliveries in
// fewer broker calls than one per delivery (RabbitMQ multiple acks, Kafka
// offset commits). Batch mode uses it when the Source implements it.
type BatchAcker interface {
	// AckBatch acks every delivery in ds, which this source delivered,
	// after their effects committed. It may send the acks later than the
	// call (RabbitMQ waits until no unsettled delivery lies below them, to
	// use one multiple ack), never earlier; the source must send whatever
	// still waits when it is closed.
	AckBatch(ctx context.Context, ds []Delivery) error
}

// HookBatch is called after each batch transaction commits, with the
// number of deliveries in the batch and how many of them were new.
type HookBatch interface {
	OnBatch(ctx context.Context, size, applied int, dur time.Duration)
}

// batchDispatcher runs batch mode: deliveries are spread over Concurrency
// lanes by key, so that messages with the same key stay in one lane, in
// order; each lane collects up to BatchSize deliveries, or waits at most
// BatchWait, and applies them in one transaction.
type batchDispatcher struct {
	r     *Runtime
	ctx   context.Context
	slots chan struct{}
	lanes []chan Delivery
	rr    atomic.Uint64
	wg    sync.WaitGroup
}

func newBatchDispatcher(r *Runtime, ctx context.Context) *batchDispatcher {
	// Room for two batches per lane: one filling while one commits.
	n := 2 * r.cfg.Concurrency * r.batchSize
	d := &batchDispatcher{r: r, ctx: ctx, slots: make(chan struct{}, n)}
	for i := 0; i < r.cfg.Concurrency; i++ {
		lane := make(chan Delivery, n)
		d.lanes = append(d.lanes, lane)
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			d.runLane(lane)
		}()
	}
	return d
}

func (d *batchDispatcher) dispatch(del Delivery) {
	var i uint64
	if key := del.Message().Key; key != "" {
		h := fnv.New64a()
		_, _ = h.Write([]byte(key))
		i = h.Sum64()
	} else {
		// Runs of BatchSize go to one lane, so a batch holds
		// consecutive deliveries, which a broker can ack in one call.
		i = d.rr.Add(1) / uint64(d.r.batchSize)
	}
	d.lanes[i%uint64(len(d.lanes))] <- del
}

// close ends the lanes once they have handled what they hold.
func (d *batchDispatcher) close() {
	for _, l := range d.lanes {
		close(l)
	}
}

func (d *batchDispatcher) runLane(lane chan Delivery) {
	size, wait := d.r.batchSize, d.r.cfg.BatchWait
	timer := time.NewTimer(wait)
	defer timer.Stop()
	batch := make([]Delivery, 0, size)
	for first := range lane {
		batch = append(batch[:0], first)
		timer.Reset(wait)
	collect:
		for len(batch) < size {
			select {
			case del, ok := <-lane:
				if !ok {
					break collect
				}
				batch = append(batch, del)
			case <-timer.C:
				break collect
			}
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		d.r.processBatch(d.ctx, batch)
		for range batch {
			<-d.slots
		}
	}
}

// processBatch settles a batch of deliveries.
func (r *Runtime) processBatch(ctx context.Context, dels []Delivery) {
	defer r.stats.inFlight.Add(-int64(len(dels)))
	items := make([]item, 0, len(dels))
	for _, del := range dels {
		if it, ok := r.precheck(ctx, del); ok {
			items = append(items, it)
		}
	}
	r.runBatch(ctx, items)
}

// batchResult is the result of one batch transaction.
type batchResult struct {
	out      outcome
	err      error
	failed   int  // index of the message whose handler failed; -1 if unknown
	conflict bool // the failure was a serialization failure or deadlock
	claims   []ClaimResult
	dur      time.Duration   // the whole transaction
	handler  []time.Duration // per item: its handler call (the batch handler's, with BatchHandler)
	commit   time.Duration
}

// runBatch applies items in one transaction if it can, and otherwise splits
// them so that each failing message is handled alone.
func (r *Runtime) runBatch(ctx context.Context, items []item) {
	switch len(items) {
	case 0:
		return
	case 1:
		r.runOne(ctx, items[0])
		return
	}
	infra := newInfraBackOff()
	retry := r.newRetryBackOff()
	conflicts := 0
	for {
		if ctx.Err() != nil {
			for _, it := range items {
				r.requeue(it.del, it.log)
			}
			return
		}
		res := r.batchAttempt(ctx, items)
		switch res.out {
		case outApplied:
			r.settleBatch(ctx, items, res)
			return
		case outInfraErr:
			if ctx.Err() == nil {
				r.stats.dbErrors.Add(1)
				wait := infra.NextBackOff()
				r.log.Warn("idemq: database error in batch; retrying", "error", res.err, "size", len(items), "wait", wait)
				sleepCtx(ctx, wait)
			}
			continue
		}
		if ctx.Err() != nil {
			continue
		}
		// Lock conflicts between concurrent batches are retried whole
		// before the batch is split.
		if res.conflict && conflicts+1 < r.cfg.Retry.MaxAttempts {
			conflicts++
			r.stats.retries.Add(1)
			sleepCtx(ctx, retry.NextBackOff())
			continue
		}
		r.log.Debug("idemq: batch failed; splitting it", "error", res.err, "size", len(items), "failed_index", res.failed)
		if i := res.failed; i >= 0 {
			r.runBatch(ctx, items[:i])
			r.runOne(ctx, items[i])
			r.runBatch(ctx, items[i+1:])
			return
		}
		mid := len(items) / 2
		r.runBatch(ctx, items[:mid])
		r.runBatch(ctx, items[mid:])
		return
	}
}

// batchAttempt runs one transaction over items: claim all, handle the new
// ones, commit.
func (r *Runtime) batchAttempt(ctx context.Context, items []item) batchResult {
	start := time.Now()
	tx, err := r.begin(ctx)
	if err != nil {
		return batchResult{out: outInfraErr, err: err}
	}
	defer r.rollback(ctx, tx)

	claims, err := r.claimBatch(ctx, tx, items)
	if err != nil {
		return batchResult{out: outInfraErr, err: err}
	}

	fail := func(i int, err error, hctx context.Context) batchResult {
		timedOut := errors.Is(hctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
		if !timedOut && connLost(tx) {
			return batchResult{out: outInfraErr, err: fmt.Errorf("handler: database connection lost: %w", err)}
		}
		var pgErr *pgconn.PgError
		conflict := errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
		return batchResult{out: outHandlerErr, err: err, failed: i, conflict: conflict}
	}
	handlerDur := make([]time.Duration, len(items))
	if r.cfg.BatchHandler != nil {
		var msgs []*Message
		for i, it := range items {
			if claims[i].Outcome == ClaimNew {
				it.msg.Attempt = 1
				msgs = append(msgs, it.msg)
			}
		}
		if len(msgs) > 0 {
			hctx, cancel := r.handlerContext(ctx)
			hstart := time.Now()
			err := r.callBatchHandler(hctx, tx, msgs)
			if err != nil {
				res := fail(-1, err, hctx)
				cancel()
				return res
			}
			cancel()
			for i := range handlerDur {
				handlerDur[i] = time.Since(hstart)
			}
		}
	} else {
		for i, it := range items {
			if claims[i].Outcome != ClaimNew {
				continue
			}
			it.msg.Attempt = 1
			hctx, cancel := r.handlerContext(ctx)
			hstart := time.Now()
			err := r.callHandler(hctx, tx, it.msg)
			handlerDur[i] = time.Since(hstart)
			if err != nil {
				res := fail(i, err, hctx)
				cancel()
				return res
			}
			cancel()
		}
	}

	cstart := time.Now()
	if err := tx.Commit(ctx); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			return batchResult{out: outHandlerErr, err: fmt.Errorf("commit: %w", err), failed: -1,
				conflict: pgErr.Code == "40001" || pgErr.Code == "40P01"}
		}
		return batchResult{out: outInfraErr, err: fmt.Errorf("commit outcome unknown: %w", err)}
	}
	return batchResult{out: outApplied, claims: claims, dur: time.Since(start), handler: handlerDur, commit: time.Since(cstart)}
}

// claimBatch claims the ids of items, sorted so that concurrent batches take
// their locks in one order. A repeated id in the batch is a duplicate of its
// first occurrence (or a mismatch, if the payload differs).
func (r *Runtime) claimBatch(ctx context.Context, tx pgx.Tx, items []item) ([]ClaimResult, error) {
	firstOf := make(map[string]int, len(items))
	var unique []int
	for i, it := range items {
		if _, seen := firstOf[it.claim.MessageID]; !seen {
			firstOf[it.claim.MessageID] = i
			unique = append(unique, i)
		}
	}
	slices.SortFunc(unique, func(a, b int) int { return cmp.Compare(items[a].claim.MessageID, items[b].claim.MessageID) })
	claims := make([]Claim, len(unique))
	for j, i := range unique {
		claims[j] = items[i].claim
	}
	var got []ClaimResult
	if bs, ok := r.cfg.Store.(BatchStore); ok {
		var err error
		if got, err = bs.ClaimBatch(ctx, tx, claims); err != nil {
			return nil, fmt.Errorf("claim batch: %w", err)
		}
		if len(got) != len(claims) {
			return nil, fmt.Errorf("claim batch: %d results for %d claims", len(got), len(claims))
		}
	} else {
		got = make([]ClaimResult, len(claims))
		for j, c := range claims {
			res, err := r.cfg.Store.Claim(ctx, tx, c)
			if err != nil {
				return nil, fmt.Errorf("claim: %w", err)
			}
			got[j] = res
		}
	}
	out := make([]ClaimResult, len(items))
	for j, i := range unique {
		switch got[j].Outcome {
		case ClaimNew, ClaimDuplicate, ClaimMismatch:
		default:
			return nil, fmt.Errorf("claim: unknown outcome %d", got[j].Outcome)
		}
		out[i] = got[j]
	}
	for i, it := range items {
		f := firstOf[it.claim.MessageID]
		if f == i {
			continue
		}
		out[i] = ClaimResult{Outcome: ClaimDuplicate, ProcessedAt: out[f].ProcessedAt}
		if it.claim.Fingerprint != items[f].claim.Fingerprint || out[f].Outcome == ClaimMismatch {
			out[i].Outcome = ClaimMismatch
		}
	}
	return out, nil
}

// settleBatch acks a committed batch and dead-letters its mismatches.
func (r *Runtime) settleBatch(ctx context.Context, items []item, res batchResult) {
	var ack []Delivery
	applied := 0
	for i, it := range items {
		c := res.claims[i]
		switch c.Outcome {
		case ClaimNew:
			applied++
			r.stats.applied.Add(1)
			for _, h := range r.hooks.applied {
				h.OnApplied(ctx, it.msg, res.handler[i], res.commit)
			}
			ack = append(ack, it.del)
		case ClaimDuplicate:
			r.stats.duplicates.Add(1)
			for _, h := range r.hooks.duplicate {
				h.OnDuplicate(ctx, it.msg, c.ProcessedAt)
			}
			ack = append(ack, it.del)
		case ClaimMismatch:
			at := "earlier in the same batch"
			if !c.ProcessedAt.IsZero() {
				at = "at " + c.ProcessedAt.Format(time.RFC3339Nano)
			}
			r.deadLetter(ctx, it.del, it.log, Failure{MessageID: it.claim.MessageID, Class: ClassFingerprintMismatch,
				Err: fmt.Errorf("message id %q was applied %s with a different payload", it.claim.MessageID, at)})
		}
	}
	for _, h := range r.hooks.batch {
		h.OnBatch(ctx, len(items), applied, res.dur)
	}
	r.ackAll(ack)
}

// ackAll acks deliveries, in one call if the source supports it.
func (r *Runtime) ackAll(ds []Delivery) {
	if len(ds) == 0 {
		return
	}
	ba, ok := r.cfg.Source.(BatchAcker)
	if !ok || len(ds) == 1 {
		for _, d := range ds {
			r.ack(d, r.log)
		}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
	defer cancel()
	if err := ba.AckBatch(ctx, ds); err != nil {
		r.stats.ackFailures.Add(int64(len(ds)))
		r.log.Warn("idemq: batch ack failed after commit; redeliveries will be skipped as duplicates", "error", err, "size", len(ds))
		for _, h := range r.hooks.ackFailed {
			for _, d := range ds {
				h.OnAckFailed(ctx, d.Message(), err)
			}
		}
	}
}

func (r *Runtime) handlerContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if r.cfg.HandlerTimeout > 0 {
		return context.WithTimeout(ctx, r.cfg.HandlerTimeout)
	}
	return ctx, func() {}
}

// callBatchHandler runs the batch handler, turning a panic into a
// *PanicError.
func (r *Runtime) callBatchHandler(ctx context.Context, tx pgx.Tx, msgs []*Message) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: stack()}
		}
	}()
	return r.cfg.BatchHandler(ctx, tx, msgs)
}
