package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/idemq/idemq/consumer/dedup"
)

// This file is the one retry-and-settle loop both modes use: it runs
// attempts (attempt.go) until one can be settled, and settles it: ack,
// dead-letter, or requeue.

// apply brings items to settlement: one message in per-message mode, a
// group in batch mode. A group that fails because of one message is split
// so that the message is retried and dead-lettered on its own and never
// sinks the others; a group that fails without naming one is bisected.
// Items are settled in order, so a key's messages are never reordered.
func (r *Runtime) apply(ctx context.Context, items []item) { r.applyFrom(ctx, items, nil) }

// applyFrom is apply, for a lone item whose handler already failed once in
// a group when failed is not nil: that failure is its first attempt, so its
// retry budget and the Attempt its handler sees carry on from it, as in
// per-message mode.
func (r *Runtime) applyFrom(ctx context.Context, items []item, failed *attemptResult) {
	if len(items) == 0 {
		return
	}
	var (
		retry, infra               *backoff.ExponentialBackOff
		attempts, conflicts, drops int
		first, last                time.Time
	)
	nextRetry := func() time.Duration {
		if retry == nil {
			retry = r.newRetryBackOff()
		}
		return retry.NextBackOff()
	}
	for {
		if r.stopping(ctx) {
			for _, it := range items {
				r.requeue(it.del, it.log)
			}
			return
		}
		var res attemptResult
		if failed != nil {
			res, failed = *failed, nil
		} else {
			res = r.attempt(ctx, items, attempts+1)
		}
		switch res.out {
		case outApplied:
			r.settleApplied(ctx, items, res)
			return
		case outFatal:
			r.stop(res.err)
			continue // requeued at the top of the loop
		case outInfraErr, outConnLost:
			if r.stopping(ctx) {
				continue
			}
			r.stats.dbErrors.Add(1)
			if res.out == outConnLost && r.dbReachable(ctx, items[0].claim.Route.Shard) {
				// The connection died under this transaction while the
				// database answers others: maybe a message that costs
				// its connection.
				if len(items) > 1 {
					r.log.Debug("idemq: batch lost its connection; splitting it", "error", res.err, "size", len(items))
					r.split(ctx, items, -1)
					return
				}
				drops++
				exhausted := drops >= r.cfg.Retry.MaxConnLosses
				if exhausted && res.failed < 0 {
					// The last loss was at COMMIT: did it take?
					switch r.settleIfCommitted(ctx, items[0]) {
					case commitTook:
						return
					case commitUnknown:
						drops-- // not known to have cost its connection
						exhausted = false
					}
				}
				if exhausted {
					it := items[0]
					now := time.Now()
					if first.IsZero() {
						first = now
					}
					r.deadLetter(ctx, it.del, it.log, Failure{MessageID: it.claim.MessageID, Class: ClassRetryableExhausted,
						Attempts: attempts + drops, FirstFailure: first, LastFailure: now,
						Err: fmt.Errorf("its transaction lost the database connection %d times while the database stayed reachable "+
							"(a statement that kills its backend, idle_in_transaction_session_timeout under a slow handler, a proxy limit): %w", drops, res.err)})
					return
				}
			}
			if infra == nil {
				infra = newInfraBackOff()
			}
			wait := infra.NextBackOff()
			r.log.Warn("idemq: database error; retrying", "error", res.err, "size", len(items), "wait", wait)
			sleepCtx(ctx, wait)
			continue
		}

		// A handler error or a conflict: the transaction definitely
		// rolled back.
		if res.out == outConflict {
			r.conflicts.Add(1)
		}
		if r.stopping(ctx) {
			continue // shutdown, not the message's fault
		}
		if len(items) > 1 {
			// A lock conflict between concurrent groups is nobody's
			// fault: the group is retried whole once (the transaction it
			// collided with has usually committed by then), and if it
			// collides again its messages are applied one transaction
			// each, in order, without an attempt counted against any of
			// them: a group holds all its rows' locks at once, a single
			// message only its own.
			if res.out == outConflict {
				if conflicts < 1 {
					conflicts++
					r.stats.retries.Add(1)
					sleepCtx(ctx, nextRetry())
					continue
				}
				r.log.Debug("idemq: batch conflicted twice; applying its messages one by one", "error", res.err, "size", len(items))
				for i := range items {
					r.apply(ctx, items[i:i+1])
				}
				return
			}
			r.log.Debug("idemq: batch failed; splitting it", "error", res.err, "size", len(items), "failed_index", res.failed)
			if res.out == outHandlerErr && res.failed >= 0 && res.failed < len(items) {
				// The message's own failure: it counts for that message.
				i := res.failed
				r.apply(ctx, items[:i])
				res.failed = 0
				r.applyFrom(ctx, items[i:i+1], &res)
				r.apply(ctx, items[i+1:])
				return
			}
			r.split(ctx, items, res.failed)
			return
		}

		// One message's handler failed (a conflict counts as a failure).
		it := items[0]
		attempts++
		now := time.Now()
		if first.IsZero() {
			first = now
		}
		last = now
		fail := Failure{MessageID: it.claim.MessageID, Err: res.err, Attempts: attempts, FirstFailure: first, LastFailure: last}
		var pe *PanicError
		switch {
		case errors.As(res.err, &pe):
			it.log.Error("idemq: handler panicked", "panic", fmt.Sprint(pe.Value), "stack", string(pe.Stack))
			fail.Class = ClassPanic
		case IsPermanent(res.err):
			fail.Class = ClassPermanent
		default:
			wait := nextRetry()
			if attempts < r.cfg.Retry.MaxAttempts && wait != backoff.Stop {
				r.stats.retries.Add(1)
				it.log.Info("idemq: handler failed; retrying", "error", res.err, "attempt", attempts, "wait", wait)
				for _, h := range r.hooks.retry {
					r.hook("OnRetry", func() { h.OnRetry(ctx, it.msg, attempts, res.err, wait) })
				}
				sleepCtx(ctx, wait)
				continue
			}
			fail.Class = ClassRetryableExhausted
			if res.timedOut {
				fail.Class = ClassTimeout
			}
		}
		r.deadLetter(ctx, it.del, it.log, fail)
		return
	}
}

// split applies items in parts, in order: around the failed item (run
// alone) if it is known, else in halves.
func (r *Runtime) split(ctx context.Context, items []item, failed int) {
	if i := failed; i >= 0 && i < len(items) {
		r.apply(ctx, items[:i])
		r.apply(ctx, items[i:i+1])
		r.apply(ctx, items[i+1:])
		return
	}
	mid := len(items) / 2
	r.apply(ctx, items[:mid])
	r.apply(ctx, items[mid:])
}

// dbReachable reports whether the database answers a fresh transaction:
// with a ShardedStore, the database of shard.
func (r *Runtime) dbReachable(ctx context.Context, shard int) bool {
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if r.router != nil {
		return r.router.PingShard(pctx, shard) == nil
	}
	return r.cfg.Store.Ping(pctx) == nil
}

// settleApplied settles a committed attempt: acks the applied and the
// duplicates, and dead-letters the mismatches.
func (r *Runtime) settleApplied(ctx context.Context, items []item, res attemptResult) {
	var (
		ack   []Delivery
		alone []item
	)
	applied := 0
	for i, it := range items {
		c := res.claims[i]
		switch c.Outcome {
		case claimAlone:
			alone = append(alone, it)
		case dedup.ClaimNew:
			applied++
			r.stats.applied.Add(1)
			for _, h := range r.hooks.applied {
				r.hook("OnApplied", func() { h.OnApplied(ctx, it.msg, res.handler[i], res.commit) })
			}
			ack = append(ack, it.del)
		case dedup.ClaimDuplicate:
			r.stats.duplicates.Add(1)
			it.log.Debug("idemq: duplicate skipped", "processed_at", c.ProcessedAt)
			for _, h := range r.hooks.duplicate {
				r.hook("OnDuplicate", func() { h.OnDuplicate(ctx, it.msg, c.ProcessedAt) })
			}
			ack = append(ack, it.del)
		case dedup.ClaimMismatch:
			at, when := c.ProcessedAt, "earlier in the same batch"
			if at.IsZero() {
				at = time.Now() // the original committed with this batch
			} else {
				when = "at " + at.Format(time.RFC3339Nano)
			}
			r.deadLetter(ctx, it.del, it.log, Failure{MessageID: it.claim.MessageID, Class: ClassFingerprintMismatch, ProcessedAt: at,
				Err: fmt.Errorf("message id %q was applied %s with a different payload", it.claim.MessageID, when)})
		}
	}
	if len(items) > 1 {
		for _, h := range r.hooks.batch {
			r.hook("OnBatch", func() { h.OnBatch(ctx, len(items), applied, res.dur) })
		}
	}
	r.ackAll(ack)
	for _, it := range alone {
		r.apply(ctx, []item{it})
	}
}

// commitOutcome is what settleIfCommitted learnt of a COMMIT whose outcome
// was unknown.
type commitOutcome int

const (
	commitUnknown commitOutcome = iota // the store did not answer, or the runtime is stopping
	commitTook                         // it took: the item is settled
	commitDidNot                       // it did not: the item is unsettled
)

// settleIfCommitted asks the store, by claiming it again in a transaction
// it rolls back, whether its last COMMIT took, its outcome unknown (the
// connection lost before the answer). If a row for it is there, it is
// settled as the claim finds it: a duplicate of that commit, acked (or a
// mismatch, dead-lettered as one).
func (r *Runtime) settleIfCommitted(ctx context.Context, it item) commitOutcome {
	if r.stopping(ctx) {
		return commitUnknown
	}
	tx, res, err := r.cfg.Store.BeginClaim(ctx, []dedup.Claim{it.claim})
	if tx != nil {
		r.rollback(ctx, tx)
	}
	switch {
	case err != nil || len(res) != 1 || r.stopping(ctx):
		return commitUnknown
	case res[0].Outcome == dedup.ClaimNew:
		return commitDidNot
	}
	r.settleApplied(ctx, []item{it}, attemptResult{out: outApplied, claims: res})
	return commitTook
}

// ackAll acks deliveries after their commit, through AckBatch when the
// source has it, also for a single delivery: a source may hold an ack back
// to send it with its neighbours', as RabbitMQ does with one multiple ack
// for the deliveries that concurrent workers committed out of order, which
// one Ack per delivery cannot.
func (r *Runtime) ackAll(ds []Delivery) {
	if len(ds) == 0 {
		return
	}
	ba, ok := r.cfg.Source.(batchAcker)
	if !ok {
		for _, d := range ds {
			r.ack(d, r.log)
		}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
	defer cancel()
	if err := ba.AckBatch(ctx, ds); err != nil {
		r.stats.ackFailures.Add(int64(len(ds)))
		r.log.Warn("idemq: ack failed after commit; redeliveries will be skipped as duplicates", "error", err, "deliveries", len(ds))
		for _, h := range r.hooks.ackFailed {
			for _, d := range ds {
				r.hook("OnAckFailed", func() { h.OnAckFailed(ctx, d.Message(), err) })
			}
		}
	}
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
			r.hook("OnAckFailed", func() { h.OnAckFailed(ctx, del.Message(), err) })
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
// Until the dead-letter copy is stored the message is never acked, and it is
// not requeued either: requeueing would let the key's next message run
// first. The copy is retried with backoff, holding the message (and its
// key), until it is stored or the runtime stops; then it is requeued.
func (r *Runtime) deadLetter(ctx context.Context, del Delivery, log *slog.Logger, f Failure) {
	msg := del.Message()
	f.Consumer = r.cfg.Name
	if f.LastFailure.IsZero() {
		f.LastFailure = time.Now()
		f.FirstFailure = f.LastFailure
	}
	var b *backoff.ExponentialBackOff
	for try := 1; ; try++ {
		err := r.callDeadLetterer(ctx, msg.Clone(), f)
		if err == nil {
			break
		}
		if r.stopping(ctx) {
			log.Error("idemq: dead-letter failed at shutdown; requeueing", "class", f.Class, "reason", f.Err, "error", err)
			r.requeue(del, log)
			return
		}
		r.stats.dlqErrors.Add(1)
		if b == nil {
			b = newInfraBackOff()
		}
		wait := b.NextBackOff()
		log.Error("idemq: dead-letter failed; retrying (the message stays unacked and its key waits)",
			"class", f.Class, "reason", f.Err, "error", err, "try", try, "wait", wait)
		sleepCtx(ctx, wait)
	}
	r.stats.deadLettered.Add(1)
	log.Warn("idemq: message dead-lettered", "class", f.Class, "reason", f.Err, "attempts", f.Attempts)
	for _, h := range r.hooks.deadLettered {
		r.hook("OnDeadLettered", func() { h.OnDeadLettered(ctx, msg, f) })
	}
	r.ack(del, log)
}

// callDeadLetterer calls the DeadLetterer on a context detached from
// shutdown, turning a panic into an error.
func (r *Runtime) callDeadLetterer(ctx context.Context, msg *Message, f Failure) (err error) {
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("DeadLetterer panicked: %v", v)
			r.log.Error("idemq: DeadLetterer panicked", "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		}
	}()
	return r.cfg.DeadLetterer.DeadLetter(dctx, msg, f)
}

// hook calls a hook, recovering a panic: a hook's failure must not crash
// the process or change what happens to the message.
func (r *Runtime) hook(name string, call func()) {
	defer func() {
		if v := recover(); v != nil {
			r.log.Error("idemq: hook panicked; ignored", "hook", name, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		}
	}()
	call()
}
