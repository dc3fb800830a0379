package kafka_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// db is one end-to-end test's database: a fresh schema with the dedup table
// and an effects table without any uniqueness, so a double effect shows.
type db struct {
	pool    *pgxpool.Pool
	store   *processed.Store
	effects string

	mu           sync.Mutex
	deadLettered []consumer.Failure
}

func newDB(t *testing.T) *db {
	t.Helper()
	ctx := testCtx(t, 30*time.Second)
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (body text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return &db{pool: pool, store: store, effects: effects}
}

// apply is the handler: it records the message's body as an effect.
func (d *db) apply(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+d.effects+" (body) VALUES ($1)", string(m.Body))
	return err
}

func (d *db) DeadLetter(_ context.Context, _ *consumer.Message, f consumer.Failure) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.deadLettered = append(d.deadLettered, f)
	return nil
}

// counts returns the number of effect rows and of distinct bodies.
func (d *db) counts(t *testing.T) (rows, distinct int) {
	t.Helper()
	ctx := testCtx(t, 10*time.Second)
	if err := d.pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT body) FROM "+d.effects).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	return rows, distinct
}

// runtime is a running consumer.Runtime over a Source.
type runtime struct {
	rt     *consumer.Runtime
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

func (d *db) start(t *testing.T, src consumer.Source, handler consumer.Handler, mod ...func(*consumer.Config)) *runtime {
	t.Helper()
	cfg := consumer.Config{
		Name:            "e2e",
		Source:          src,
		Store:           d.store,
		Handler:         handler,
		DeadLetterer:    d,
		Concurrency:     4,
		ShutdownTimeout: 5 * time.Second,
	}
	for _, f := range mod {
		f(&cfg)
	}
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &runtime{rt: rt, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- rt.Run(ctx) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop cancels the runtime and waits for Run to return.
func (r *runtime) stop(t *testing.T) {
	t.Helper()
	r.once.Do(func() {
		r.cancel()
		select {
		case err := <-r.done:
			if err != nil {
				t.Errorf("run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("runtime did not stop within 30s")
		}
	})
}

func (r *runtime) settled() int64 {
	s := r.rt.Stats()
	return s.Applied + s.Duplicates + s.DeadLettered
}

// TestE2EDuplicates: the same idempotency-key published twice, as two
// records, has one effect.
func TestE2EDuplicates(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 3)
	d := newDB(t)
	const n = 50
	var msgs []*consumer.Message
	for i := range n {
		m := &consumer.Message{ID: fmt.Sprintf("order-%d", i), RecordKey: fmt.Append(nil, i), Body: fmt.Appendf(nil, "order-%d", i)}
		msgs = append(msgs, m, m.Clone()) // a producer retry: a second record
	}
	if err := e.pub.Publish(ctx, e.topic, msgs...); err != nil {
		t.Fatal(err)
	}
	r := d.start(t, e.source(t), d.apply)
	waitFor(t, 30*time.Second, "every record settled", func() bool { return r.settled() == 2*n })
	r.stop(t)
	st := r.rt.Stats()
	if st.Applied != n || st.Duplicates != n {
		t.Errorf("applied %d, duplicates %d; want %d each", st.Applied, st.Duplicates, n)
	}
	if rows, distinct := d.counts(t); rows != n || distinct != n {
		t.Errorf("%d effects (%d distinct), want %d", rows, distinct, n)
	}
	var committed int64
	for _, off := range e.committed(t) {
		committed += max(off, 0)
	}
	if committed != 2*n {
		t.Errorf("committed offsets sum to %d, want %d", committed, 2*n)
	}
}

// TestE2EMissingID: with the runtime reading the id header only (no
// fallback id), a record without it is dead-lettered as missing-id, then
// committed past.
func TestE2EMissingID(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 1)
	d := newDB(t)
	if err := e.pub.Publish(ctx, e.topic, &consumer.Message{Body: []byte("anonymous")}, &consumer.Message{ID: "x", Body: []byte("named")}); err != nil {
		t.Fatal(err)
	}
	r := d.start(t, e.source(t), d.apply, func(c *consumer.Config) { c.MessageID = consumer.IDFromHeader("idempotency-key") })
	waitFor(t, 30*time.Second, "both records settled", func() bool { return r.settled() == 2 })
	waitFor(t, 10*time.Second, "commit past both", func() bool { return e.committed(t)[0] == 2 })
	r.stop(t)
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.deadLettered) != 1 || d.deadLettered[0].Class != consumer.ClassMissingID {
		t.Errorf("dead-lettered %+v, want one missing-id", d.deadLettered)
	}
	if rows, _ := d.counts(t); rows != 1 {
		t.Errorf("%d effects, want 1", rows)
	}
}

// TestE2EKillBeforeCommit: a consumer stopped after fetching a record but
// before its transaction committed does not lose it: the next consumer
// applies it, once.
func TestE2EKillBeforeCommit(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 1)
	d := newDB(t)
	msgs := e.publish(t, "kill", 5, 1)

	started := make(chan struct{})
	var once sync.Once
	blocking := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := d.apply(ctx, tx, m); err != nil {
			return err
		}
		once.Do(func() { close(started) })
		<-ctx.Done() // hang until the hard stop: the transaction rolls back
		return context.Cause(ctx)
	}
	r1 := d.start(t, e.source(t), blocking, func(c *consumer.Config) { c.ShutdownTimeout = 100 * time.Millisecond })
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("handler never started")
	}
	r1.stop(t)
	if rows, _ := d.counts(t); rows != 0 {
		t.Fatalf("%d effects after the kill, want 0", rows)
	}
	if got := e.committed(t)[0]; got > 0 {
		t.Fatalf("committed offset %d for a record whose transaction never committed", got)
	}

	r2 := d.start(t, e.source(t), d.apply)
	waitFor(t, 30*time.Second, "every record applied", func() bool { return r2.rt.Stats().Applied == int64(len(msgs)) })
	r2.stop(t)
	if rows, distinct := d.counts(t); rows != len(msgs) || distinct != len(msgs) {
		t.Errorf("%d effects (%d distinct), want %d", rows, distinct, len(msgs))
	}
}

// TestE2EOffsetCommitFailures: offset commits fail while the runtime keeps
// applying messages; after a restart the consumer resumes from the last
// committed offset and every replay is deduplicated.
func TestE2EOffsetCommitFailures(t *testing.T) {
	e := newEnv(t, 1)
	d := newDB(t)
	log := e.observeCommits(t)
	const n = 20
	e.publish(t, "cf", n/2, 1)

	r1 := d.start(t, e.source(t), d.apply)
	waitFor(t, 30*time.Second, "first half applied", func() bool { return r1.rt.Stats().Applied == n/2 })
	waitFor(t, 10*time.Second, "first half committed", func() bool { return e.committed(t)[0] == n/2 })
	log.fail.Store(true)
	for i := n / 2; i < n; i++ {
		if err := e.pub.Publish(testCtx(t, 10*time.Second), e.topic, &consumer.Message{ID: fmt.Sprint("cf-", i), Body: fmt.Appendf(nil, "cf-%d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 30*time.Second, "second half applied", func() bool { return r1.rt.Stats().Applied == n })
	waitFor(t, 10*time.Second, "failed commits", func() bool { return log.failed.Load() >= 2 })
	r1.stop(t)
	if got := e.committed(t)[0]; got != n/2 {
		t.Fatalf("committed %d, want %d", got, n/2)
	}

	log.fail.Store(false)
	r2 := d.start(t, e.source(t), d.apply)
	waitFor(t, 30*time.Second, "replays settled", func() bool { return r2.settled() == n/2 })
	waitFor(t, 10*time.Second, "everything committed", func() bool { return e.committed(t)[0] == n })
	r2.stop(t)
	if st := r2.rt.Stats(); st.Applied != 0 || st.Duplicates != n/2 {
		t.Errorf("after restart: applied %d, duplicates %d; want 0 and %d", st.Applied, st.Duplicates, n/2)
	}
	if rows, distinct := d.counts(t); rows != n || distinct != n {
		t.Errorf("%d effects (%d distinct), want %d", rows, distinct, n)
	}
}

// TestE2ERebalance: a second consumer joins the group while messages flow,
// then the first stops. Every message is applied exactly once, no offset is
// skipped, and no member commits a partition it does not own. In the
// "abandon" variant handlers are slower than DrainTimeout, so the first
// member abandons in-flight messages at the rebalance: their acks are stale,
// the new owners re-read them, and dedup absorbs the replays.
func TestE2ERebalance(t *testing.T) {
	t.Run("drain", func(t *testing.T) { testE2ERebalance(t, 0, 0) })
	t.Run("abandon", func(t *testing.T) { testE2ERebalance(t, time.Millisecond, 20*time.Millisecond) })
}

func testE2ERebalance(t *testing.T, drain, work time.Duration) {
	ctx := testCtx(t, 90*time.Second)
	e := newEnv(t, 6)
	d := newDB(t)
	log := e.observeCommits(t)
	const n = 600

	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if work > 0 {
			time.Sleep(work) // slow work, still in flight at the rebalance
		}
		return d.apply(ctx, tx, m)
	}
	source := func() *kafka.Source {
		return e.source(t, func(c *kafka.Config) {
			if drain > 0 {
				c.DrainTimeout = drain
			}
		})
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; i < n; i += 10 {
			msgs := make([]*consumer.Message, 10)
			for j := range msgs {
				msgs[j] = &consumer.Message{ID: fmt.Sprint("rb-", i+j), RecordKey: fmt.Append(nil, i+j), Body: fmt.Appendf(nil, "rb-%04d", i+j)}
			}
			if err := e.pub.Publish(ctx, e.topic, msgs...); err != nil {
				t.Errorf("publish: %v", err)
				return
			}
			time.Sleep(5 * time.Millisecond) // a steady flow
		}
	})
	a := d.start(t, source(), handler, func(c *consumer.Config) { c.Concurrency = 6 })
	waitFor(t, 30*time.Second, "A to apply", func() bool { return a.rt.Stats().Applied >= 50 })
	b := d.start(t, source(), handler, func(c *consumer.Config) { c.Concurrency = 6 })
	waitFor(t, 30*time.Second, "B to apply", func() bool { return b.rt.Stats().Applied >= 1 })
	a.stop(t)
	wg.Wait()
	waitFor(t, 60*time.Second, "every message applied", func() bool {
		rows, _ := d.counts(t)
		return rows >= n
	})
	waitFor(t, 10*time.Second, "every offset committed", func() bool {
		var sum int64
		for _, off := range e.committed(t) {
			sum += max(off, 0)
		}
		return sum == n
	})
	b.stop(t)

	if rows, distinct := d.counts(t); rows != n || distinct != n {
		t.Errorf("%d effects (%d distinct), want %d, exactly once each", rows, distinct, n)
	}
	sa, sb := a.rt.Stats(), b.rt.Stats()
	t.Logf("A: %+v", sa)
	t.Logf("B: %+v", sb)
	if sa.Applied+sb.Applied != n {
		t.Errorf("applied %d+%d, want %d", sa.Applied, sb.Applied, n)
	}
	// Either member may be the one whose partitions are revoked with work
	// in flight (B loses some when A leaves and the group rebalances).
	if drain > 0 && sa.AckFailures+sb.AckFailures == 0 {
		t.Errorf("no stale acks on A or B: the abandon path was not exercised")
	}
	log.check(t)
}
