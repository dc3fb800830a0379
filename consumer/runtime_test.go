package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testlog"
	"github.com/idemq/idemq/processed"
)

func TestDuplicateDeliveryAppliesOnce(t *testing.T) {
	t.Parallel()
	claimPaths(t, func(t *testing.T, b *bundle, storeOver func(*pgxpool.Pool) *processed.Store) {
		b.publish(msg("a", "pay 10"), msg("b", "pay 20"), msg("a", "pay 10"), msg("a", "pay 10"))
		r := start(t, b.config(b.insertEffect))
		waitFor(t, "all settled", func() bool { return r.rt.Stats().Applied+r.rt.Stats().Duplicates == 4 && b.settled() })

		if got := b.effectCounts(); got["a"] != 1 || got["b"] != 1 || len(got) != 2 {
			t.Fatalf("effects %v, want a=1 b=1", got)
		}
		if s := r.rt.Stats(); s.Applied != 2 || s.Duplicates != 2 || s.DeadLettered != 0 {
			t.Fatalf("stats %+v", s)
		}
	})
}

func TestConcurrentDuplicatesApplyOnce(t *testing.T) {
	t.Parallel()
	claimPaths(t, func(t *testing.T, b *bundle, storeOver func(*pgxpool.Pool) *processed.Store) {
		const copies, ids = 16, 5
		var all []*consumer.Message
		for c := 0; c < copies; c++ {
			for i := 0; i < ids; i++ {
				all = append(all, msg(fmt.Sprintf("id-%d", i), "same body"))
			}
		}
		b.publish(all...)
		// A pool of its own: copies blocked on a claim hold a connection
		// each, and on the package's shared pool other parallel tests
		// could leave this one a single connection, serialising it.
		pcfg, err := pgxpool.ParseConfig(testdb.URL())
		if err != nil {
			t.Fatal(err)
		}
		pcfg.MaxConns = 24
		pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		b.store = storeOver(pool)

		var concurrent, maxConcurrent atomic.Int64
		overlapped := make(chan struct{})
		var overlapOnce sync.Once
		cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			n := concurrent.Add(1)
			defer concurrent.Add(-1)
			for {
				old := maxConcurrent.Load()
				if n <= old || maxConcurrent.CompareAndSwap(old, n) {
					break
				}
			}
			if n >= 2 {
				overlapOnce.Do(func() { close(overlapped) })
			}
			// Hold the claim until a second handler runs (distinct ids
			// must not wait for each other), bounded so that a runtime
			// that serialises them fails below rather than hanging; the
			// other copies of this id block on the claim meanwhile.
			select {
			case <-overlapped:
			case <-time.After(3 * time.Second):
			}
			time.Sleep(10 * time.Millisecond)
			return b.insertEffect(ctx, tx, m)
		})
		cfg.Concurrency = 16
		cfg.BatchSize = 1 // copies of one id in concurrent transactions, not one group
		r := start(t, cfg)
		waitFor(t, "all settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 })

		got := b.effectCounts()
		for i := 0; i < ids; i++ {
			if n := got[fmt.Sprintf("id-%d", i)]; n != 1 {
				t.Errorf("id-%d applied %d times", i, n)
			}
		}
		s := r.rt.Stats()
		if s.Applied != ids || s.Duplicates != copies*ids-ids || s.DeadLettered != 0 || s.Retries != 0 {
			t.Fatalf("stats %+v", s)
		}
		if maxConcurrent.Load() < 2 {
			t.Fatalf("handlers never overlapped (max %d): the test did not exercise concurrency", maxConcurrent.Load())
		}
	})
}

func TestHandlerErrorRollsBackThenRetries(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 10)...)
	var calls sync.Map
	r := start(t, b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := b.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		n, _ := calls.LoadOrStore(m.ID, new(atomic.Int32))
		if n.(*atomic.Int32).Add(1) < 3 {
			return errors.New("transient")
		}
		if m.Attempt != 3 {
			return consumer.Permanent(fmt.Errorf("attempt %d, want 3", m.Attempt))
		}
		return nil
	}))
	waitFor(t, "all applied", func() bool { return r.rt.Stats().Applied == 10 && b.settled() })
	for id, n := range b.effectCounts() {
		if n != 1 {
			t.Errorf("%s: %d effects; a failed attempt's effect was not rolled back", id, n)
		}
	}
	if s := r.rt.Stats(); s.Retries != 20 || s.DeadLettered != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestPermanentErrorDeadLetteredBeforeAck(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	var unackedAtDLQ atomic.Int64
	unackedAtDLQ.Store(-1)
	b.dlq.onCall = func(*consumer.Message) error {
		unackedAtDLQ.Store(int64(b.broker.Unacked(queue)))
		return nil
	}
	b.publish(msg("poison", "bad"))
	var calls atomic.Int32
	r := start(t, b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		calls.Add(1)
		if err := b.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		return consumer.Permanent(errors.New("unknown account"))
	}))
	waitFor(t, "dead-lettered", func() bool { return r.rt.Stats().DeadLettered == 1 && b.settled() })

	if unackedAtDLQ.Load() != 1 {
		t.Fatalf("message was not held unacked while being dead-lettered (unacked=%d)", unackedAtDLQ.Load())
	}
	got := b.dlq.list()
	if len(got) != 1 || got[0].f.Class != consumer.ClassPermanent || got[0].f.Attempts != 1 ||
		got[0].f.MessageID != "poison" || got[0].f.Consumer != "test-consumer" || !strings.Contains(got[0].f.Err.Error(), "unknown account") {
		t.Fatalf("dead letters %+v", got)
	}
	if string(got[0].msg.Body) != "bad" {
		t.Fatalf("dead-letter body changed: %q", got[0].msg.Body)
	}
	if calls.Load() != 1 {
		t.Fatalf("permanent error retried: %d calls", calls.Load())
	}
	if n := len(b.effectCounts()); n != 0 {
		t.Fatalf("failed message left %d effects", n)
	}
	if _, err := b.store.Lookup(context.Background(), "test-consumer", "poison"); err == nil {
		t.Fatal("failed message left a dedup row: a replay would be skipped")
	}
}

func TestDeadLetterFailureRetriesNeverAcks(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.dlq.failNext = 4
	b.publish(msg("poison", "bad"))
	r := start(t, b.config(func(context.Context, pgx.Tx, *consumer.Message) error {
		return consumer.Permanent(errors.New("no"))
	}))
	waitFor(t, "dead-lettered", func() bool { return r.rt.Stats().DeadLettered == 1 && b.settled() })
	if s := r.rt.Stats(); s.Requeued != 0 || s.Received != 1 || s.AckFailures != 0 || s.DeadLetterErrors != 4 {
		t.Fatalf("stats %+v: the dead letter is retried in place until stored (4 failures), then acked once", s)
	}
	if n := len(b.dlq.list()); n != 1 {
		t.Fatalf("%d dead letters, want 1", n)
	}
}

func TestDeadLetterFailureAtShutdownRequeues(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.dlq.failNext = 1 << 30
	b.publish(msg("poison", "bad"))
	cfg := b.config(func(context.Context, pgx.Tx, *consumer.Message) error {
		return consumer.Permanent(errors.New("no"))
	})
	cfg.ShutdownTimeout = 100 * time.Millisecond
	r := start(t, cfg)
	waitFor(t, "a few failed dead letters", func() bool {
		b.dlq.mu.Lock()
		defer b.dlq.mu.Unlock()
		return b.dlq.failNext < 1<<30-2
	})
	if b.broker.Unacked(queue) != 1 {
		t.Fatal("the message must stay unacked while its dead letter fails")
	}
	r.stop(t)
	if s := r.rt.Stats(); s.Requeued != 1 || s.DeadLettered != 0 || b.broker.Ready(queue) != 1 {
		t.Fatalf("stats %+v, %d ready: at shutdown the message is requeued, never acked", s, b.broker.Ready(queue))
	}
}

// dropAckSource loses the first ack of each listed id, as if the process
// crashed after COMMIT and before the ack reached the broker.
type dropAckSource struct {
	consumer.Source
	drop    sync.Map
	dropped atomic.Int32
}

type dropAckDelivery struct {
	consumer.Delivery
	src *dropAckSource
}

func (s *dropAckSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return dropAckDelivery{d, s}, nil
}

func (d dropAckDelivery) Ack(ctx context.Context) error {
	if _, ok := d.src.drop.LoadAndDelete(d.Message().ID); ok {
		d.src.dropped.Add(1)
		return nil // pretend; the broker still holds it unacked
	}
	return d.Delivery.Ack(ctx)
}

func TestCrashBetweenCommitAndAck(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 20)...)
	cfg := b.config(b.insertEffect)
	src := &dropAckSource{Source: cfg.Source}
	for i := 0; i < 20; i += 4 {
		src.drop.Store(fmt.Sprintf("m-%d", i), true)
	}
	cfg.Source = src
	first := start(t, cfg)
	waitFor(t, "first run applied all", func() bool { return first.rt.Stats().Applied == 20 })
	if b.broker.Unacked(queue) != 5 {
		t.Fatalf("unacked %d, want the 5 lost acks", b.broker.Unacked(queue))
	}
	first.stop(t) // closing the source requeues the 5 unacked messages

	if b.broker.Ready(queue) != 5 {
		t.Fatalf("ready %d after restart, want 5 redeliveries", b.broker.Ready(queue))
	}
	second := start(t, b.config(b.insertEffect))
	waitFor(t, "redeliveries settled", func() bool { return b.settled() && second.rt.Stats().Duplicates == 5 })
	if s := second.rt.Stats(); s.Applied != 0 {
		t.Fatalf("redelivery applied again: %+v", s)
	}
	for id, n := range b.effectCounts() {
		if n != 1 {
			t.Errorf("%s applied %d times", id, n)
		}
	}
}

func TestBadInputDeadLettered(t *testing.T) {
	t.Parallel()
	claimPaths(t, func(t *testing.T, b *bundle, storeOver func(*pgxpool.Pool) *processed.Store) {
		b.publish(msg("x", "original"))
		var handled atomic.Int32
		cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			handled.Add(1)
			return b.insertEffect(ctx, tx, m)
		})
		cfg.MaxBodyBytes = 16
		r := start(t, cfg)
		waitFor(t, "original applied", func() bool { return r.rt.Stats().Applied == 1 })

		b.publish(msg("x", "tampered"), msg("", "no id"), msg("big", strings.Repeat("z", 17)), msg(strings.Repeat("i", 513), "long id"))
		waitFor(t, "bad input dead-lettered", func() bool { return r.rt.Stats().DeadLettered == 4 && b.settled() })
		if handled.Load() != 1 {
			t.Fatalf("handler ran %d times; bad input must never reach it", handled.Load())
		}
		classes := map[consumer.FailureClass]string{}
		for _, e := range b.dlq.list() {
			classes[e.f.Class] += e.f.Err.Error() + ";"
			if e.f.Attempts != 0 {
				t.Errorf("%s: attempts %d, want 0", e.f.Class, e.f.Attempts)
			}
		}
		for _, want := range []consumer.FailureClass{consumer.ClassFingerprintMismatch, consumer.ClassMissingID, consumer.ClassTooLarge} {
			if classes[want] == "" {
				t.Errorf("no dead letter of class %s (got %v)", want, classes)
			}
		}
		if !strings.Contains(classes[consumer.ClassMissingID], "over the 512-byte limit") {
			t.Errorf("long id reason unclear: %q", classes[consumer.ClassMissingID])
		}
		if !strings.Contains(classes[consumer.ClassFingerprintMismatch], "different payload") {
			t.Errorf("mismatch reason unclear: %q", classes[consumer.ClassFingerprintMismatch])
		}
	})
}

func TestPanicRecoveredAndDeadLettered(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("boom", "x"), msg("fine", "y"))
	r := start(t, b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "boom" {
			var nilMap map[string]int
			nilMap["crash"]++
		}
		return b.insertEffect(ctx, tx, m)
	}))
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 })
	got := b.dlq.list()
	var pe *consumer.PanicError
	if len(got) != 1 || got[0].f.Class != consumer.ClassPanic || !errors.As(got[0].f.Err, &pe) || len(pe.Stack) == 0 {
		t.Fatalf("dead letters %+v", got)
	}
	if e := b.effectCounts(); e["fine"] != 1 || e["boom"] != 0 {
		t.Fatalf("effects %v", e)
	}
}

func TestHandlerTimeout(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("slow", "x"))
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, "SELECT pg_sleep(5)")
		return err
	})
	cfg.HandlerTimeout = 50 * time.Millisecond
	cfg.Retry.MaxAttempts = 2
	r := start(t, cfg)
	waitFor(t, "dead-lettered", func() bool { return r.rt.Stats().DeadLettered == 1 && b.settled() })
	if got := b.dlq.list(); got[0].f.Class != consumer.ClassTimeout || got[0].f.Attempts != 2 {
		t.Fatalf("dead letter %+v", got[0].f)
	}
}

func TestPerKeyOrderUnderConcurrency(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	const keys, per = 8, 25
	var all []*consumer.Message
	for i := 0; i < per; i++ {
		for k := 0; k < keys; k++ {
			all = append(all, &consumer.Message{ID: fmt.Sprintf("k%d-%03d", k, i), Key: fmt.Sprintf("k%d", k), Body: []byte(fmt.Sprint(i))})
		}
	}
	b.publish(all...)
	var active sync.Map
	var overlap atomic.Bool
	var calls atomic.Int32
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if _, busy := active.LoadOrStore(m.Key, true); busy {
			overlap.Store(true)
		}
		defer active.Delete(m.Key)
		// Fail some first attempts: a retry must still come before the
		// key's next message.
		if calls.Add(1)%7 == 0 && m.Attempt == 1 {
			return errors.New("transient")
		}
		time.Sleep(time.Millisecond)
		return b.insertEffect(ctx, tx, m)
	})
	cfg.Concurrency = 16
	r := start(t, cfg)
	waitFor(t, "all applied", func() bool { return r.rt.Stats().Applied == keys*per })
	if overlap.Load() {
		t.Fatal("two messages with the same key ran at once")
	}
	b.effectsByKey(t)
}

func TestSoftStopDrainsInFlight(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 8)...)
	started := make(chan struct{}, 8)
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		started <- struct{}{}
		time.Sleep(100 * time.Millisecond)
		return b.insertEffect(ctx, tx, m)
	})
	cfg.Concurrency = 8
	r := start(t, cfg)
	for i := 0; i < 8; i++ {
		<-started
	}
	r.stop(t)
	if s := r.rt.Stats(); s.Applied != 8 || s.Requeued != 0 {
		t.Fatalf("soft stop did not drain: %+v", s)
	}
	if !b.settled() || len(b.effectCounts()) != 8 {
		t.Fatalf("ready=%d unacked=%d effects=%d", b.broker.Ready(queue), b.broker.Unacked(queue), len(b.effectCounts()))
	}
}

func TestHardStopLosesNothingAcksNothingUncommitted(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	const total = 30
	b.publish(msgs("m", total)...)
	var calls atomic.Int32
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := b.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		if calls.Add(1) > 10 {
			// Stuck until the shutdown timeout cancels us.
			<-ctx.Done()
			if !errors.Is(context.Cause(ctx), consumer.ErrShutdown) {
				return fmt.Errorf("cause %v, want ErrShutdown", context.Cause(ctx))
			}
			return ctx.Err()
		}
		return nil
	})
	cfg.Concurrency = 4
	cfg.BatchSize = 1 // each message its own transaction (see TestGroupedHardStop)
	cfg.ShutdownTimeout = 100 * time.Millisecond
	r := start(t, cfg)
	waitFor(t, "handlers stuck", func() bool { return calls.Load() >= 14 })
	r.stop(t)

	s := r.rt.Stats()
	if s.DeadLettered != 0 || s.Applied != 10 {
		t.Fatalf("stats %+v", s)
	}
	// Every message is either applied (and acked) or back in the queue.
	if b.broker.Unacked(queue) != 0 || b.broker.Ready(queue) != total-10 || len(b.effectCounts()) != 10 {
		t.Fatalf("ready=%d unacked=%d effects=%d", b.broker.Ready(queue), b.broker.Unacked(queue), len(b.effectCounts()))
	}
	second := start(t, b.config(b.insertEffect))
	waitFor(t, "rest applied", func() bool { return b.settled() && second.rt.Stats().Applied == total-10 })
	for id, n := range b.effectCounts() {
		if n != 1 {
			t.Errorf("%s applied %d times", id, n)
		}
	}
}

// lyingStore commits the first transactions of each run but reports a
// network failure, as a connection reset during COMMIT would.
type lyingStore struct {
	dedup.Store
	lies atomic.Int32
}

type lyingTx struct {
	pgx.Tx
	db *lyingStore
}

func (d *lyingStore) BeginClaim(ctx context.Context, claims []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	tx, res, err := d.Store.BeginClaim(ctx, claims)
	if tx != nil {
		tx = lyingTx{tx, d}
	}
	return tx, res, err
}

func (t lyingTx) Commit(ctx context.Context) error {
	if err := t.Tx.Commit(ctx); err != nil {
		return err
	}
	if t.db.lies.Add(-1) >= 0 {
		return errors.New("read tcp 127.0.0.1:5432: connection reset by peer")
	}
	return nil
}

func TestAmbiguousCommitNotAckedThenSettledByDedup(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 5)...)
	cfg := b.config(b.insertEffect)
	db := &lyingStore{Store: b.store}
	db.lies.Store(3)
	cfg.Store = db
	cfg.BatchSize = 1 // three lies, three messages (see TestGroupedAmbiguousCommit)
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 })
	s := r.rt.Stats()
	if s.Applied != 2 || s.Duplicates != 3 || s.DeadLettered != 0 || s.Retries != 0 || s.DBErrors != 3 {
		t.Fatalf("stats %+v: 3 ambiguous commits should be re-claimed as duplicates", s)
	}
	for id, n := range b.effectCounts() {
		if n != 1 {
			t.Errorf("%s applied %d times", id, n)
		}
	}
}

func TestDatabaseConnectionLossIsRetriedNotDeadLettered(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 6)...)
	var kills atomic.Int32
	r := start(t, b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := b.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		if kills.Add(1) <= 3 {
			// The server kills our session mid-transaction.
			_, err := tx.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
			return err
		}
		return nil
	}))
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().Applied == 6 })
	if s := r.rt.Stats(); s.DeadLettered != 0 || s.Retries != 0 || s.DBErrors < 3 {
		t.Fatalf("connection loss counted against the message: %+v", s)
	}
	for id, n := range b.effectCounts() {
		if n != 1 {
			t.Errorf("%s applied %d times", id, n)
		}
	}
}

func TestJanitorPurgesOldRows(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 3)...)
	cfg := b.config(b.insertEffect)
	r := start(t, cfg)
	waitFor(t, "applied", func() bool { return r.rt.Stats().Applied == 3 })
	r.stop(t)
	tbl := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	if _, err := b.pool.Exec(context.Background(), "UPDATE "+tbl+" SET processed_at = now() - interval '2 hours' WHERE message_id = 'm-0'"); err != nil {
		t.Fatal(err)
	}
	cfg = b.config(b.insertEffect)
	cfg.Retention = time.Hour
	cfg.JanitorInterval = 10 * time.Millisecond
	start(t, cfg)
	waitFor(t, "old row purged", func() bool {
		var n int
		_ = b.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+tbl).Scan(&n)
		return n == 2
	})
}

func TestRunTwiceConcurrentlyRejected(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("a", "x"))
	r := start(t, b.config(b.insertEffect))
	waitFor(t, "running", func() bool { return r.rt.Stats().Applied == 1 })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := r.rt.Run(ctx); err == nil {
		t.Fatal("a second concurrent Run was accepted")
	}
}

// TestLogsNameTheMessage: with logging on, a message's log records carry its
// id and source (the runtime skips building them when logging is off).
func TestLogsNameTheMessage(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("bad-1", "x"))
	cfg := b.config(func(context.Context, pgx.Tx, *consumer.Message) error {
		return consumer.Permanent(errors.New("unknown account"))
	})
	log, logs := testlog.New(slog.LevelDebug)
	cfg.Logger = log
	r := start(t, cfg)
	waitFor(t, "dead-lettered", func() bool { return r.rt.Stats().DeadLettered == 1 && b.settled() })
	out := logs.String()
	for _, want := range []string{"message dead-lettered", "consumer=test-consumer", "source=" + queue, "message_id=bad-1", "unknown account"} {
		if !strings.Contains(out, want) {
			t.Errorf("logs lack %q:\n%s", want, out)
		}
	}
}

func TestJSONHandlerDeadLettersUndecodableBodies(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("good", `{"n": 7}`), msg("bad", `{"n": "seven"}`))
	type body struct{ N int }
	r := start(t, b.config(consumer.JSON(func(ctx context.Context, tx pgx.Tx, m *consumer.Message, v body) error {
		if v.N != 7 {
			return fmt.Errorf("decoded %d", v.N)
		}
		return b.insertEffect(ctx, tx, m)
	})))
	waitFor(t, "settled", func() bool { return r.rt.Stats().Applied == 1 && r.rt.Stats().DeadLettered == 1 && b.settled() })
	dl := b.dlq.list()
	if dl[0].msg.ID != "bad" || dl[0].f.Class != consumer.ClassPermanent || dl[0].f.Attempts != 1 || !strings.Contains(dl[0].f.Err.Error(), "decode JSON body") {
		t.Fatalf("dead letter %s: %s after %d attempts: %v", dl[0].msg.ID, dl[0].f.Class, dl[0].f.Attempts, dl[0].f.Err)
	}
}

// TestDefaultRetryRidesOutABlip: with the default retry policy, a handler
// whose downstream fails for three seconds is retried until it recovers;
// the old default (5 attempts, about 0.6s of back-off) dead-lettered it.
func TestDefaultRetryRidesOutABlip(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msg("m", "x"))
	recovered := time.Now().Add(3 * time.Second)
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if time.Now().Before(recovered) {
			return errors.New("downstream unavailable")
		}
		return b.insertEffect(ctx, tx, m)
	})
	cfg.Retry = consumer.RetryConfig{} // the defaults
	r := start(t, cfg)
	waitFor(t, "applied after the blip", func() bool { return r.rt.Stats().Applied == 1 || r.rt.Stats().DeadLettered > 0 })
	if s := r.rt.Stats(); s.Applied != 1 || s.DeadLettered != 0 || s.Retries < 5 {
		t.Fatalf("stats %+v: a 3s blip must be ridden out by the default retries", s)
	}
}
