package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
)

// batchAckSource counts AckBatch calls and can lose acks, like a crash
// after COMMIT.
type batchAckSource struct {
	consumer.Source
	batches  atomic.Int32
	acked    atomic.Int32
	dropAcks atomic.Bool
}

func (s *batchAckSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	return s.Source.Receive(ctx)
}

func (s *batchAckSource) AckBatch(ctx context.Context, ds []consumer.Delivery) error {
	s.batches.Add(1)
	if s.dropAcks.Load() {
		return nil
	}
	var errs []error
	for _, d := range ds {
		errs = append(errs, d.Ack(ctx))
		s.acked.Add(1)
	}
	return errors.Join(errs...)
}

func batchConfig(b *bundle, h consumer.Handler) consumer.Config {
	cfg := b.config(h)
	cfg.BatchSize = 50
	cfg.BatchWait = 20 * time.Millisecond
	cfg.Concurrency = 4
	return cfg
}

func assertOnce(t *testing.T, b *bundle, want int) {
	t.Helper()
	got := b.effectCounts()
	for id, n := range got {
		if n != 1 {
			t.Errorf("%s applied %d times", id, n)
		}
	}
	if len(got) != want {
		t.Errorf("%d ids applied, want %d", len(got), want)
	}
}

func TestBatchDuplicatesWithinAndAcrossBatches(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	var all []*consumer.Message
	for i := 0; i < 300; i++ {
		m := msg(fmt.Sprintf("m-%d", i), fmt.Sprintf("body %d", i))
		all = append(all, m)
		if i%3 == 0 {
			all = append(all, m.Clone()) // adjacent: same batch
		}
	}
	for i := 0; i < 300; i += 7 {
		all = append(all, msg(fmt.Sprintf("m-%d", i), fmt.Sprintf("body %d", i))) // later batch
	}
	b.publish(all...)
	cfg := batchConfig(b, b.insertEffect)
	src := &batchAckSource{Source: cfg.Source}
	cfg.Source = src
	r := start(t, cfg)
	waitFor(t, "settled", func() bool {
		return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Received == int64(len(all))
	})
	assertOnce(t, b, 300)
	s := r.rt.Stats()
	if s.Applied != 300 || s.Duplicates != int64(len(all)-300) || s.DeadLettered != 0 {
		t.Fatalf("stats %+v", s)
	}
	if src.batches.Load() == 0 || src.batches.Load() > int32(len(all))/5 {
		t.Fatalf("%d batch acks for %d messages: batching did not happen", src.batches.Load(), len(all))
	}
}

func TestBatchConcurrentDuplicatesAcrossLanes(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	var all []*consumer.Message
	for c := 0; c < 8; c++ {
		for i := 0; i < 40; i++ {
			all = append(all, msg(fmt.Sprintf("id-%d", i), "same"))
		}
	}
	b.publish(all...)
	cfg := batchConfig(b, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		time.Sleep(time.Millisecond) // widen the window between claim and commit
		return b.insertEffect(ctx, tx, m)
	})
	cfg.BatchSize = 16
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 })
	assertOnce(t, b, 40)
	if s := r.rt.Stats(); s.Applied != 40 || s.Duplicates != int64(len(all)-40) || s.DeadLettered != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestBatchFailureIsolation(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 200)...)
	var calls sync.Map
	var transient atomic.Int32
	cfg := batchConfig(b, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		n, _ := calls.LoadOrStore(m.ID, new(atomic.Int32))
		n.(*atomic.Int32).Add(1)
		if err := b.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		switch {
		case strings.HasSuffix(m.ID, "7"): // m-7, m-17, ...: poison
			return consumer.Permanent(errors.New("poison"))
		case strings.HasSuffix(m.ID, "3") && transient.Add(1) <= 5:
			return errors.New("transient")
		}
		return nil
	})
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Received == 200 })
	s := r.rt.Stats()
	if s.DeadLettered != 20 || s.Applied != 180 {
		t.Fatalf("stats %+v", s)
	}
	assertOnce(t, b, 180)
	for _, e := range b.dlq.list() {
		if !strings.HasSuffix(e.f.MessageID, "7") || e.f.Class != consumer.ClassPermanent {
			t.Errorf("wrong message dead-lettered: %s %s", e.f.MessageID, e.f.Class)
		}
	}
}

func TestBatchHandlerBisectsPoison(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	all := msgs("m", 120)
	all[37].Body = []byte("poison")
	all[90].Body = []byte("poison")
	b.publish(all...)
	var batchSizes sync.Map
	cfg := b.config(nil)
	cfg.Handler = nil
	cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
		batchSizes.Store(len(ms), true)
		ids := make([]string, len(ms))
		bodies := make([]string, len(ms))
		for i, m := range ms {
			if string(m.Body) == "poison" {
				return consumer.Permanent(fmt.Errorf("%s is poison", m.ID))
			}
			ids[i], bodies[i] = m.ID, string(m.Body)
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+b.effects+" (message_id, body) SELECT * FROM unnest($1::text[], $2::text[])", ids, bodies)
		return err
	}
	cfg.BatchSize = 40
	cfg.BatchWait = 50 * time.Millisecond
	cfg.Concurrency = 2
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Received == 120 })
	assertOnce(t, b, 118)
	if s := r.rt.Stats(); s.DeadLettered != 2 || s.Applied != 118 {
		t.Fatalf("stats %+v", s)
	}
	big := false
	batchSizes.Range(func(k, _ any) bool { big = big || k.(int) >= 10; return true })
	if !big {
		t.Fatal("the batch handler never saw a real batch")
	}
}

func TestBatchMismatchInsideBatch(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("a", "one"), msg("a", "two"), msg("b", "x"))
	cfg := batchConfig(b, b.insertEffect)
	cfg.Concurrency = 1
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Received == 3 })
	if s := r.rt.Stats(); s.Applied != 2 || s.DeadLettered != 1 {
		t.Fatalf("stats %+v", s)
	}
	if d := b.dlq.list(); len(d) != 1 || d[0].f.Class != consumer.ClassFingerprintMismatch || string(d[0].msg.Body) != "two" {
		t.Fatalf("dead letters %+v", d)
	}
}

func TestBatchPerKeyOrder(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	const keys, per = 6, 40
	var all []*consumer.Message
	for i := 0; i < per; i++ {
		for k := 0; k < keys; k++ {
			all = append(all, &consumer.Message{ID: fmt.Sprintf("k%d-%03d", k, i), Key: fmt.Sprintf("k%d", k), Body: []byte("x")})
		}
	}
	b.publish(all...)
	var calls atomic.Int32
	cfg := batchConfig(b, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if calls.Add(1)%11 == 0 && m.Attempt == 1 {
			return errors.New("transient") // forces splits and single retries
		}
		return b.insertEffect(ctx, tx, m)
	})
	cfg.BatchSize = 17
	r := start(t, cfg)
	waitFor(t, "all applied", func() bool { return r.rt.Stats().Applied == keys*per })
	b.effectsByKey(t)
	assertOnce(t, b, keys*per)
}

func TestBatchCrashBetweenCommitAndAck(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 60)...)
	cfg := batchConfig(b, b.insertEffect)
	src := &batchAckSource{Source: cfg.Source}
	src.dropAcks.Store(true)
	cfg.Source = src
	first := start(t, cfg)
	// The memory subscription holds at most 64 unacked deliveries.
	waitFor(t, "applied", func() bool { return first.rt.Stats().Applied == 60 && first.rt.Stats().InFlight == 0 })
	first.stop(t) // unacked: requeued
	if b.broker.Ready(queue) != 60 {
		t.Fatalf("ready %d, want 60 redeliveries", b.broker.Ready(queue))
	}
	second := start(t, batchConfig(b, b.insertEffect))
	waitFor(t, "settled", func() bool { return b.settled() && second.rt.Stats().Duplicates == 60 })
	if second.rt.Stats().Applied != 0 {
		t.Fatalf("redelivered batch applied again: %+v", second.rt.Stats())
	}
	assertOnce(t, b, 60)
}

func TestBatchHardStopAcksNothingUncommitted(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 200)...)
	var calls atomic.Int32
	cfg := batchConfig(b, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := b.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		if calls.Add(1) > 60 {
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	})
	cfg.ShutdownTimeout = 100 * time.Millisecond
	r := start(t, cfg)
	// Handlers past the 60th call are stuck until the hard stop.
	waitFor(t, "stuck", func() bool { return calls.Load() > 60 })
	r.stop(t)
	applied := len(b.effectCounts())
	if s := r.rt.Stats(); int(s.Applied) != applied || s.DeadLettered != 0 {
		t.Fatalf("stats %+v, %d effects", s, applied)
	}
	if b.broker.Unacked(queue) != 0 || b.broker.Ready(queue) != 200-applied {
		t.Fatalf("ready=%d unacked=%d applied=%d", b.broker.Ready(queue), b.broker.Unacked(queue), applied)
	}
	second := start(t, batchConfig(b, b.insertEffect))
	waitFor(t, "rest", func() bool { return b.settled() && second.rt.Stats().InFlight == 0 && len(b.effectCounts()) == 200 })
	assertOnce(t, b, 200)
}

type batchSizes struct {
	consumer.HookDefaults
	mu    sync.Mutex
	sizes []int
}

func (h *batchSizes) OnBatch(_ context.Context, size, _ int, _ time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.sizes = append(h.sizes, size)
}

// TestBatchCappedToSourceWindow: with a prefetch too small to fill the
// batches of every lane, batches are capped to the lane's share of the
// window and go at once, instead of each waiting BatchWait for deliveries
// the window will not let in.
func TestBatchCappedToSourceWindow(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("w", 64)...)
	cfg := b.config(b.insertEffect)
	sub, err := b.broker.Subscribe(queue, memory.SubscribeOptions{Prefetch: 16})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Source = sub
	cfg.Concurrency, cfg.BatchSize = 8, 100
	cfg.BatchWait = 10 * time.Second // an uncapped lane would sit on its 16 deliveries this long
	sizes := &batchSizes{}
	cfg.Hooks = []consumer.Hook{sizes}
	r := start(t, cfg)
	deadline := time.Now().Add(5 * time.Second)
	for r.rt.Stats().Applied < 64 {
		if time.Now().After(deadline) {
			t.Fatalf("applied %d of 64 in 5s: batches waited for a window that could not fill them", r.rt.Stats().Applied)
		}
		time.Sleep(5 * time.Millisecond)
	}
	assertOnce(t, b, 64)
	sizes.mu.Lock()
	defer sizes.mu.Unlock()
	for _, n := range sizes.sizes {
		if n > 2 { // 16 deliveries over 8 lanes
			t.Fatalf("batch sizes %v, want at most 2", sizes.sizes)
		}
	}
}

// TestBatchPartlyFilledBatchDoesNotHoldTheNext: in batch mode, a batch
// that closed on BatchWait while partly filled goes to its transaction,
// and the deliveries after it form the next batch on another lane at once,
// not behind it in the same lane.
func TestBatchPartlyFilledBatchDoesNotHoldTheNext(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	release := make(chan struct{})
	started := make(chan []string, 4)
	cfg := b.config(nil)
	cfg.Handler = nil
	cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
		var ids []string
		for _, m := range ms {
			ids = append(ids, m.ID)
		}
		started <- ids
		if ms[0].ID == "first" {
			select { // the first batch's transaction stays open
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		for _, m := range ms {
			if err := b.insertEffect(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	}
	cfg.BatchSize = 50
	cfg.BatchWait = 10 * time.Millisecond
	cfg.Concurrency = 4
	r := start(t, cfg)
	b.publish(msg("first", "1"))
	select {
	case ids := <-started:
		if len(ids) != 1 || ids[0] != "first" {
			t.Fatalf("first batch %v", ids)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the first batch never started")
	}
	b.publish(msg("second", "2"))
	select {
	case ids := <-started:
		if len(ids) != 1 || ids[0] != "second" {
			t.Fatalf("second batch %v", ids)
		}
	case <-time.After(3 * time.Second):
		close(release)
		t.Fatal("the second delivery waited behind the first batch's open transaction")
	}
	close(release)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Applied == 2 })
	assertOnce(t, b, 2)
}
