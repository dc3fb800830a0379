package idemqtest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

const (
	queueName = "idemqtest"
	dlqName   = "idemqtest.dlq"
)

// The faults the kit injects. Their texts are what the runtime logs and
// what a dead letter would carry.
var (
	errInjectedCommit    = errors.New("idemqtest: injected fault: the connection was lost during COMMIT, after the handler returned nil (the transaction rolled back)")
	errInjectedTransient = errors.New("idemqtest: injected transient error, returned after the handler's statements ran")
	errInjectedBug       = errors.New("idemqtest: injected handler bug (the handler is fixed before the replay)")
)

// faults selects the faults of one consumer run.
type faults struct {
	// failCommit makes the first COMMIT of each message id roll back
	// and fail with errInjectedCommit, after the handler ran.
	failCommit bool
	// failAfterHandler makes the first attempt of each message id
	// return errInjectedTransient after the handler returned nil.
	failAfterHandler bool
	// dropFirstAck turns the first ack of each message id into a
	// requeue: the broker redelivers a message whose transaction
	// committed, as after a crash between COMMIT and ack.
	dropFirstAck bool
	// bug makes the handler fail permanently without running it.
	bug bool
}

// consumerRun is one run of a Suite: its Env, broker and dedup store.
type consumerRun struct {
	s      *Suite
	env    *Env
	broker *memory.Broker
	store  *processed.Store
	h      consumer.Handler
	bh     consumer.BatchHandler

	mu       sync.Mutex
	failures []consumer.Failure
	stats    consumer.Stats
}

// newRun creates a run's Env, runs the Suite's Setup and migrations, and
// builds its handlers.
func (k *kit) newRun(ctx context.Context) (*consumerRun, func(), error) {
	s := &k.s
	env, cleanup, err := k.adm.newEnv(ctx, int32(s.Concurrency+4))
	if err != nil {
		return nil, nil, err
	}
	fail := func(err error) (*consumerRun, func(), error) {
		cleanup()
		return nil, nil, err
	}
	if s.Setup != nil {
		if err := s.Setup(ctx, env); err != nil {
			return fail(fmt.Errorf("idemqtest: Suite.Setup: %w", err))
		}
	}
	store, err := processed.New(env.Pool, processed.Config{Schema: env.Schema})
	if err != nil {
		return fail(err)
	}
	if err := store.Migrate(ctx); err != nil {
		return fail(fmt.Errorf("idemqtest: migrate the dedup table: %w", err))
	}
	r := &consumerRun{s: s, env: env, broker: memory.NewBroker(), store: store, h: s.Handler, bh: s.BatchHandler}
	if s.NewHandler != nil {
		r.h = s.NewHandler(env)
	}
	if s.NewBatchHandler != nil {
		r.bh = s.NewBatchHandler(env)
	}
	if r.h == nil {
		return fail(errors.New("idemqtest: Suite.NewHandler returned nil"))
	}
	return r, cleanup, nil
}

// id is the dedup id of m, as the runtime extracts it.
func (r *consumerRun) id(m *consumer.Message) string {
	id, _ := r.s.MessageID(m)
	return id
}

// deadLetterer stores dead letters on the run's broker and records their
// failures.
func (r *consumerRun) deadLetterer() consumer.DeadLetterer {
	// NewDeadLetterer fails only for a nil func or invalid options.
	dl, _ := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return r.broker.Publish(ctx, dlqName, m)
	}, dlq.Options{})
	return consumer.DeadLettererFunc(func(ctx context.Context, m *consumer.Message, f consumer.Failure) error {
		err := dl.DeadLetter(ctx, m, f)
		if err == nil {
			r.mu.Lock()
			r.failures = append(r.failures, f)
			r.mu.Unlock()
		}
		return err
	})
}

// config is the runtime configuration of the run, with f's faults.
func (r *consumerRun) config(src consumer.Source, f faults, batch bool, concurrency int) consumer.Config {
	cfg := consumer.Config{
		Name:         r.s.Name,
		Source:       src,
		Store:        r.store,
		DeadLetterer: r.deadLetterer(),
		MessageID:    r.s.MessageID,
		Concurrency:  concurrency,
		Retry: consumer.RetryConfig{MaxAttempts: 5, InitialInterval: time.Millisecond,
			MaxInterval: 5 * time.Millisecond, MaxElapsed: 10 * time.Second},
		ShutdownTimeout: 5 * time.Second,
		Logger:          r.s.Logger,
	}
	if f.failCommit {
		cfg.Store = &faultStore{Store: r.store, failed: map[string]bool{}}
	}
	if batch {
		cfg.BatchHandler = r.bh
		return cfg
	}
	h := r.h
	switch {
	case f.bug:
		h = func(context.Context, pgx.Tx, *consumer.Message) error { return consumer.Permanent(errInjectedBug) }
	case f.failAfterHandler:
		var mu sync.Mutex
		failed := map[string]bool{}
		inner := h
		h = func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if err := inner(ctx, tx, m); err != nil {
				return err
			}
			id := r.id(m)
			mu.Lock()
			defer mu.Unlock()
			if !failed[id] {
				failed[id] = true
				return errInjectedTransient
			}
			return nil
		}
	}
	cfg.Handler = h
	return cfg
}

// consume runs one runtime over the run's queue: it publishes each phase in
// turn and waits for it to settle, then stops the runtime.
func (r *consumerRun) consume(ctx context.Context, f faults, batch bool, concurrency int, phases ...[]*consumer.Message) error {
	sub, err := r.broker.Subscribe(queueName, memory.SubscribeOptions{})
	if err != nil {
		return err
	}
	var src consumer.Source = sub
	if f.dropFirstAck {
		src = &dropAckSource{Subscription: sub, id: r.id, dropped: map[string]bool{}}
	}
	rt, err := consumer.New(r.config(src, f, batch, concurrency))
	if err != nil {
		_ = sub.Close()
		return fmt.Errorf("idemqtest: consumer.New: %w", err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- rt.Run(runCtx) }()
	published := 0
	for _, p := range phases {
		if err := r.broker.Publish(ctx, queueName, p...); err != nil {
			cancel()
			<-done
			return err
		}
		published += len(p)
		if err := r.settle(ctx, rt, published, done); err != nil {
			cancel()
			<-done
			return err
		}
	}
	cancel()
	err = <-done
	r.stats = rt.Stats()
	if err != nil {
		return fmt.Errorf("idemqtest: the runtime stopped: %w", err)
	}
	return nil
}

// settle waits until the runtime has received published deliveries and the
// queue is drained with nothing in flight.
func (r *consumerRun) settle(ctx context.Context, rt *consumer.Runtime, published int, done chan error) error {
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		s := rt.Stats()
		if s.Received >= int64(published) && s.InFlight == 0 && memory.Drained(r.broker.Stats(queueName)) {
			return nil
		}
		select {
		case err := <-done:
			done <- err
			return fmt.Errorf("idemqtest: the runtime stopped early: %v", err)
		case <-ctx.Done():
			return fmt.Errorf("idemqtest: the messages did not settle in time (%d of %d received, %d in flight; a handler that blocks or keeps failing?): %w",
				s.Received, published, s.InFlight, ctx.Err())
		case <-t.C:
		}
	}
}

// replay replays the run's dead-letter queue through dlq.Replay with the
// fixed handler.
func (r *consumerRun) replay(ctx context.Context) (dlq.Result, error) {
	n := r.broker.Ready(dlqName)
	sub, err := r.broker.Subscribe(dlqName, memory.SubscribeOptions{Prefetch: max(n, 1)})
	if err != nil {
		return dlq.Result{}, err
	}
	return dlq.Replay(ctx, dlq.ReplayConfig{
		Browser:  dlq.SourceBrowser(sub, n, 200*time.Millisecond),
		Consumer: r.config(nil, faults{}, false, 1),
	})
}

// state reads the run's effect: the Suite's Effect, without the ignored
// keys, and the Recorder's calls if there were any.
func (r *consumerRun) state(ctx context.Context) (any, error) {
	return readState(ctx, r.env, r.s.Effect, r.s.Ignore)
}

func readState(ctx context.Context, env *Env, effect EffectFunc, ignore []string) (any, error) {
	v, err := effect(ctx, env)
	if err != nil {
		return nil, fmt.Errorf("idemqtest: Effect: %w", err)
	}
	n, err := normalize(v)
	if err != nil {
		return nil, err
	}
	st := map[string]any{"effect": dropKeys(n, ignore)}
	if calls := env.Recorder.Calls(); len(calls) > 0 {
		c, err := normalize(calls)
		if err != nil {
			return nil, err
		}
		st["recorder_calls"] = c
	}
	return st, nil
}

func (r *consumerRun) deadLetters() []consumer.Failure {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]consumer.Failure(nil), r.failures...)
}

// faultStore makes the first COMMIT of each message id fail.
type faultStore struct {
	dedup.Store
	mu     sync.Mutex
	failed map[string]bool
}

func (s *faultStore) BeginClaim(ctx context.Context, claims []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	tx, res, err := s.Store.BeginClaim(ctx, claims)
	if err != nil || tx == nil {
		return tx, res, err
	}
	var ids []string
	for i, c := range claims {
		if i < len(res) && res[i].Outcome == dedup.ClaimNew {
			ids = append(ids, c.MessageID)
		}
	}
	return &failCommitTx{Tx: tx, s: s, ids: ids}, res, nil
}

// failCommitTx rolls back instead of committing, once per message id.
type failCommitTx struct {
	pgx.Tx
	s   *faultStore
	ids []string
}

func (t *failCommitTx) Commit(ctx context.Context) error {
	t.s.mu.Lock()
	fail := false
	for _, id := range t.ids {
		if !t.s.failed[id] {
			t.s.failed[id] = true
			fail = true
		}
	}
	t.s.mu.Unlock()
	if !fail {
		return t.Tx.Commit(ctx)
	}
	_ = t.Tx.Rollback(ctx)
	return errInjectedCommit
}

// dropAckSource turns the first ack of each message id into a requeue.
type dropAckSource struct {
	*memory.Subscription
	id      func(*consumer.Message) string
	mu      sync.Mutex
	dropped map[string]bool
}

func (s *dropAckSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Subscription.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return &dropAckDelivery{Delivery: d, s: s}, nil
}

type dropAckDelivery struct {
	consumer.Delivery
	s *dropAckSource
}

func (d *dropAckDelivery) Ack(ctx context.Context) error {
	id := d.s.id(d.Message())
	d.s.mu.Lock()
	drop := !d.s.dropped[id]
	d.s.dropped[id] = true
	d.s.mu.Unlock()
	if drop {
		return d.Delivery.Nack(ctx, true)
	}
	return d.Delivery.Ack(ctx)
}
