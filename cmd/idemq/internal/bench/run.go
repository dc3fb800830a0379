package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemq/idemq/consumer"
)

// runMode measures one mode: a fresh queue or topic and ledger, the
// consumer, the publisher (concurrently unless Preload), then the checks.
func (r *runner) runMode(ctx context.Context, m Mode, ph phase) (res Result) {
	cfg := r.cfg
	res = Result{
		Broker: cfg.Broker, Mode: m, Messages: cfg.Messages, Unique: r.work.unique,
		Concurrency: cfg.Concurrency, Shards: cfg.Shards, Phase: ph.name, Prefill: ph.prefill, PurgeDuring: ph.purge,
	}
	// A mode's runs in different phases need their own dedup scope and
	// ledger.
	key := string(m)
	if ph.name != "" && ph.name != phaseBase {
		key += "_" + ph.name
	}
	if m == ModeBatch || m == ModeBatchSet {
		res.BatchSize = cfg.BatchSize
	}
	fail := func(err error) Result {
		res.Verified = false
		res.Error = err.Error()
		res.err = err
		return res
	}
	db := m != ModeBrokerOnly
	if db {
		if err := r.createLedger(ctx, key); err != nil {
			return fail(err)
		}
		if err := r.topUpPrefill(ctx, ph.prefill); err != nil {
			return fail(err)
		}
	}
	tgt, err := r.broker.target(ctx, m)
	if err != nil {
		return fail(err)
	}
	defer tgt.cleanup()

	res.PeakRSSReset = resetPeakRSS()
	mctx, cancel := context.WithTimeout(ctx, cfg.ModeTimeout)
	defer cancel()
	tr := newTracker(cfg.Messages, r.work.unique, !db)
	name := "bench-" + r.runKey(key)
	ledger := r.ledgerTable(key)

	// The runtime's store, made before the clock starts: with Shards, a
	// processed.Sharded over the shard databases.
	var store dedupStore
	if db && m != ModeNaive && m != ModeNaive1 {
		if store, err = r.store(); err != nil {
			return fail(err)
		}
	}

	// The consumer.
	cctx, stopConsumer := context.WithCancel(mctx)
	defer stopConsumer()
	consumerDone := make(chan error, 1)
	var rt *consumer.Runtime
	startConsumer := func() error {
		switch m {
		case ModeBrokerOnly:
			go func() {
				consumerDone <- tgt.consume(cctx, m, cfg.Concurrency, func(_ context.Context, _ string, _ []byte, at string) error {
					tr.record(at, true)
					return nil
				})
			}()
		case ModeNaive, ModeNaive1:
			go func() {
				consumerDone <- tgt.consume(cctx, m, naiveConcurrency(cfg, m), func(ctx context.Context, id string, b []byte, at string) error {
					for {
						inserted, err := r.naiveApply(ctx, name, ledger, id, b)
						if err == nil {
							tr.record(at, inserted)
							return nil
						}
						if ctx.Err() != nil {
							return ctx.Err()
						}
						tr.errs.Add(1)
						r.log.Warn("bench: naive apply", "error", err)
						sleepCtx(ctx, 50*time.Millisecond)
					}
				})
			}()
		default:
			src, err := tgt.source(cctx, m)
			if err != nil {
				return err
			}
			rcfg := consumer.Config{
				Name:        name,
				Source:      src,
				Store:       store,
				Concurrency: cfg.Concurrency,
				DeadLetterer: consumer.DeadLettererFunc(func(_ context.Context, _ *consumer.Message, f consumer.Failure) error {
					tr.fail(fmt.Errorf("%w: message %s dead-lettered (%s): %v", ErrVerify, f.MessageID, f.Class, f.Err))
					return nil
				}),
				Hooks:  []consumer.Hook{trackerHook{t: tr}},
				Logger: r.log,
			}
			if cfg.Broker == BrokerNATS {
				rcfg.MessageID = consumer.IDFromHeader(natsIDHeader)
			}
			if cfg.Shards > 0 && cfg.Broker == BrokerKafka {
				// Kafka keys a message "topic/partition", which would
				// route each partition to one shard; the shard key the
				// publisher wrote as the record key, within its
				// partition, spreads them (the ordering the kafka
				// package documents for record keys).
				rcfg.OrderingKey = func(m *consumer.Message) string { return m.Key + "/" + string(m.RecordKey) }
			}
			switch m {
			case ModeIdemq:
				rcfg.Handler = r.handler(ledger)
				rcfg.BatchSize = 1
			case ModeDefault:
				rcfg.Handler = r.handler(ledger)
			case ModeDefaultLater:
				rcfg.Handler = r.laterHandler(ledger)
			case ModeBatch:
				rcfg.Handler = r.handler(ledger)
				rcfg.BatchSize, rcfg.BatchWait = cfg.BatchSize, cfg.BatchWait
			case ModeBatchSet:
				rcfg.BatchHandler = r.batchHandler(ledger)
				rcfg.BatchSize, rcfg.BatchWait = cfg.BatchSize, cfg.BatchWait
			}
			if rt, err = consumer.New(rcfg); err != nil {
				_ = src.Close()
				return err
			}
			go func() { consumerDone <- rt.Run(cctx) }()
		}
		return nil
	}

	// The purge loop.
	var purgeWG sync.WaitGroup
	var purged, purgeErrs atomic.Int64
	var firstPurgeErr atomic.Pointer[error]
	stopPurge := make(chan struct{})
	defer func() {
		select {
		case <-stopPurge:
		default:
			close(stopPurge)
		}
	}()
	if ph.purge {
		purgeWG.Add(1)
		go func() {
			defer purgeWG.Done()
			r.purgeLoop(mctx, stopPurge, &purged, &purgeErrs, &firstPurgeErr)
		}()
	}

	// The publisher.
	var published atomic.Int64
	pubDone := make(chan error, 1)
	var pubDur atomic.Int64
	publish := func() error {
		start := time.Now()
		var err error
		if cfg.Rate > 0 {
			tr.countFrom(start.Add(cfg.Warmup))
			err = r.work.publishPaced(mctx, tgt.publish, &published, cfg.Rate)
		} else {
			err = r.work.publish(mctx, tgt.publish, &published)
		}
		pubDur.Store(int64(time.Since(start)))
		return err
	}
	start := time.Now()
	if cfg.Preload {
		if err := publish(); err != nil {
			return fail(fmt.Errorf("publish: %w", err))
		}
		pubDone <- nil
	}
	// CPU is counted from here: after publishing with Preload, so that it
	// is the consumer's alone; with the publisher concurrent, both.
	cpu := cpuNow()
	// The consumer's goroutines carry the labels bench=consume and
	// mode=<mode>, so that a --cpuprofile can be narrowed to one mode's
	// consuming: go tool pprof -tagfocus=mode=idemq-default.
	var startErr error
	pprof.Do(cctx, pprof.Labels("bench", "consume", "mode", string(m)), func(context.Context) { startErr = startConsumer() })
	if err := startErr; err != nil {
		return fail(fmt.Errorf("start consumer: %w", err))
	}
	consumerRunning := true
	members := 1
	if m == ModeBrokerOnly || m == ModeNaive || m == ModeNaive1 {
		members = naiveConcurrency(cfg, m)
	}
	if err := tgt.ready(mctx, members); err != nil {
		stopConsumer()
		<-consumerDone
		return fail(err)
	}
	if !cfg.Preload {
		go func() { pubDone <- publish() }()
	}

	// Wait for the end.
	timedOut := func() error {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("timed out after %s with %d of %d deliveries settled and %d of %d ids applied",
			cfg.ModeTimeout, tr.settled.Load(), cfg.Messages, tr.applied.Load(), r.work.unique)
	}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	var runErr error
wait:
	for {
		select {
		case <-tr.done:
			break wait
		case err := <-tr.failed:
			runErr = err
			break wait
		case err := <-pubDone:
			if err != nil {
				runErr = fmt.Errorf("publish: %w", err)
				if mctx.Err() != nil {
					runErr = timedOut() // the publisher saw it first
				}
				break wait
			}
		case err := <-consumerDone:
			consumerRunning = false
			runErr = fmt.Errorf("consumer stopped early: %v", err)
			if mctx.Err() != nil {
				// It stopped because the mode's time ran out: the
				// select saw that first.
				runErr = timedOut()
			}
			break wait
		case <-mctx.Done():
			runErr = timedOut()
			break wait
		case <-tick.C:
			if cfg.Progress != nil {
				cfg.Progress(Progress{Mode: m, Phase: ph.name, Published: int(published.Load()), Settled: tr.settled.Load(),
					Messages: cfg.Messages, Elapsed: time.Since(start)})
			}
		}
	}
	stopConsumer()
	if consumerRunning {
		if err := <-consumerDone; err != nil && runErr == nil && !errors.Is(err, context.Canceled) {
			runErr = fmt.Errorf("consumer: %w", err)
		}
	}
	// The purge's pass in progress, if any, finishes: its rows count.
	close(stopPurge)
	purgeWG.Wait()
	cancel() // stops a publisher still running after a failure

	res.PeakRSSMiB = peakRSSMiB()
	res.CPUProcessUsPerMsg, res.CPUMachineUsPerMsg = cpu.perMessage(cfg.Messages)
	res.AllocBytesPerMsg, res.GCCycles = cpu.heapPerMessage(cfg.Messages)
	res.Seconds = tr.elapsed().Seconds()
	if res.Seconds > 0 {
		res.MsgsPerSec = float64(cfg.Messages) / res.Seconds
	}
	if d := time.Duration(pubDur.Load()); d > 0 {
		res.PublishPerSec = float64(published.Load()) / d.Seconds()
	}
	res.P50Ms = float64(tr.hist.quantile(0.50)) / float64(time.Millisecond)
	res.P90Ms = float64(tr.hist.quantile(0.90)) / float64(time.Millisecond)
	res.P99Ms = float64(tr.hist.quantile(0.99)) / float64(time.Millisecond)
	res.MaxMs = float64(tr.hist.maximum()) / float64(time.Millisecond)
	res.DuplicatesSkipped = tr.dups.Load()
	if !db {
		res.DuplicatesSkipped = 0
	}
	res.Errors = tr.errs.Load()
	res.PurgedRows, res.PurgeErrors = purged.Load(), purgeErrs.Load()
	if rt != nil {
		st := rt.Stats()
		res.DuplicatesSkipped = st.Duplicates
		res.Errors += st.Retries + st.DeadLettered + st.AckFailures
	}
	if runErr != nil {
		return fail(runErr)
	}
	if db {
		vctx, vcancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer vcancel()
		if err := r.verify(vctx, key, name, &res); err != nil {
			return fail(err)
		}
	}
	if res.PurgeErrors > 0 {
		first := errors.New("unknown")
		if e := firstPurgeErr.Load(); e != nil {
			first = *e
		}
		return fail(fmt.Errorf("%w: %d purge errors, the first: %w", ErrVerify, res.PurgeErrors, first))
	}
	res.Verified = true
	return res
}

// trackerHook feeds the runtime's events to a tracker.
type trackerHook struct {
	consumer.HookDefaults
	t *tracker
}

func (h trackerHook) OnApplied(_ context.Context, msg *consumer.Message, _, _ time.Duration) {
	h.t.record(msg.Header(HeaderPublishedAt), true)
}

func (h trackerHook) OnDuplicate(_ context.Context, msg *consumer.Message, _ time.Time) {
	h.t.record(msg.Header(HeaderPublishedAt), false)
}

// resetPeakRSS collects garbage, returns freed memory to the OS and resets
// the kernel's peak-RSS mark (Linux 4.0+). It reports whether the reset
// worked.
func resetPeakRSS() bool {
	runtime.GC()
	debug.FreeOSMemory()
	return os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) == nil
}

// peakRSSMiB reads VmHWM from /proc/self/status, or 0 where there is none.
func peakRSSMiB() float64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 64)
			if err != nil {
				return 0
			}
			return kb / 1024
		}
	}
	return 0
}

// naiveConcurrency is the number of hand-written consumers a mode runs.
func naiveConcurrency(cfg Config, m Mode) int {
	if m == ModeNaive1 {
		return 1
	}
	return cfg.Concurrency
}
