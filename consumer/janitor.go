package consumer

import (
	"context"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemq/idemq/consumer/dedup"
)

// maintainer is a Store with upkeep of its own (see dedup.Store).
type maintainer interface {
	Maintain(ctx context.Context) error
}

// retentionRecorder is a Store that keeps the janitor's reports (see
// dedup.Store).
type retentionRecorder interface {
	RecordRetention(ctx context.Context, r dedup.RetentionReport) error
}

// ageBuckets is the number of a RetentionReport's duplicate-age buckets:
// one per dedup.AgeBounds, and one for older ones (a test checks it).
const ageBuckets = 18

// dupAges is the runtime's duplicate-age histogram: a HookDuplicate the
// runtime installs with a Retention.
type dupAges struct {
	HookDefaults
	buckets [ageBuckets]atomic.Int64
	maxAge  atomic.Int64
}

var _ HookDuplicate = (*dupAges)(nil)

// OnDuplicate counts the duplicate's age.
func (d *dupAges) OnDuplicate(_ context.Context, _ *Message, processedAt time.Time) {
	if processedAt.IsZero() {
		return
	}
	age := max(time.Since(processedAt), 0)
	d.buckets[dedup.AgeBucket(age)].Add(1)
	for {
		cur := d.maxAge.Load()
		if int64(age) <= cur || d.maxAge.CompareAndSwap(cur, int64(age)) {
			break
		}
	}
}

// take returns the counts since the last take and resets them.
func (d *dupAges) take() (buckets []int64, n int64, maxAge time.Duration) {
	buckets = make([]int64, len(d.buckets))
	for i := range d.buckets {
		buckets[i] = d.buckets[i].Swap(0)
		n += buckets[i]
	}
	return buckets, n, time.Duration(d.maxAge.Swap(0))
}

// horizonTimeout bounds a RedeliveryHorizon call.
const horizonTimeout = 30 * time.Second

// purgeAge returns the age the janitor may purge by now (0: no purge), the
// horizon and its state.
func (r *Runtime) purgeAge(ctx context.Context) (time.Duration, time.Time, string) {
	hs, ok := r.cfg.Source.(horizonSource)
	if !ok {
		return r.cfg.Retention, time.Time{}, "none"
	}
	hctx, cancel := context.WithTimeout(ctx, horizonTimeout)
	defer cancel()
	var (
		h     time.Time
		known bool
	)
	err := r.upkeep("Source.RedeliveryHorizon", func() (err error) {
		h, known, err = hs.RedeliveryHorizon(hctx)
		return err
	})
	switch {
	case err != nil:
		if ctx.Err() == nil {
			r.log.Warn("idemq: the source's redelivery horizon is unknown; not purging", "error", err)
		}
		return 0, time.Time{}, "error"
	case !known:
		r.log.Info("idemq: the source cannot tell its redelivery horizon yet (not joined, or its backlog not yet drained); not purging")
		return 0, time.Time{}, "unknown"
	case h.IsZero():
		return r.cfg.Retention, h, "clear"
	}
	need := time.Since(h) + max(r.cfg.HorizonMargin, 0)
	if need <= r.cfg.Retention {
		return r.cfg.Retention, h, "within"
	}
	r.log.Warn("idemq: the retention is shorter than the source's redelivery horizon: the broker can still redeliver messages older than the retention; purging only rows older than the horizon",
		"retention", r.cfg.Retention, "horizon", h, "horizon_age", time.Since(h).Round(time.Second), "purging_older_than", need.Round(time.Second))
	return need, h, "held"
}

// janitor purges every JanitorInterval, by purgeAge, and records a
// RetentionReport if the Store keeps them.
func (r *Runtime) janitor(ctx context.Context) {
	t := time.NewTicker(r.cfg.JanitorInterval)
	defer t.Stop()
	rec, _ := r.cfg.Store.(retentionRecorder)
	maint, _ := r.cfg.Store.(maintainer)
	var warnOnce sync.Once
	start := time.Now()
	for {
		if maint != nil {
			if err := r.upkeep("Store.Maintain", func() error { return maint.Maintain(ctx) }); err != nil && ctx.Err() == nil {
				r.log.Error("idemq: dedup store upkeep failed", "error", err)
			}
		}
		older, h, state := r.purgeAge(ctx)
		var n int64
		if older > 0 {
			var err error
			err = r.upkeep("Store.Purge", func() (err error) {
				n, err = r.cfg.Store.Purge(ctx, r.cfg.Name, older)
				return err
			})
			switch {
			case err != nil && ctx.Err() == nil:
				r.log.Error("idemq: purge failed", "error", err)
			case n > 0:
				r.log.Info("idemq: purged processed messages", "rows", n, "older_than", older)
			}
		}
		if rec != nil && ctx.Err() == nil {
			end := time.Now()
			buckets, dups, maxAge := r.dupAges.take()
			rep := dedup.RetentionReport{Consumer: r.cfg.Name, WindowStart: start, WindowEnd: end,
				Duplicates: dups, Buckets: buckets, MaxAge: maxAge, Retention: r.cfg.Retention,
				Horizon: h, HorizonState: state, PurgedOlderThan: older, Purged: n}
			if err := r.upkeep("Store.RecordRetention", func() error { return rec.RecordRetention(ctx, rep) }); err != nil && ctx.Err() == nil {
				warnOnce.Do(func() {
					r.log.Warn("idemq: cannot record the janitor's report (run idemq migrate; the role needs INSERT on the retention table)", "error", err)
				})
			}
			start = end
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// upkeep runs one of the janitor's calls into the Store or the Source,
// which the caller may implement, turning a panic into an error (logged
// with its stack): a failed upkeep is logged and retried at the next round,
// and must not crash the process. A statement-cache error (see
// StatementCacheError) stops the runtime instead: the claims meet it too.
func (r *Runtime) upkeep(what string, call func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("%s panicked: %v", what, v)
			r.log.Error("idemq: janitor call panicked", "call", what, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		}
	}()
	err = call()
	if cerr := StatementCacheError(err); cerr != nil {
		r.stop(fmt.Errorf("janitor: %s: %w", what, cerr))
	}
	return err
}
