package redisstream_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// e2e is a dedup store in a fresh schema and an effects table with no unique
// constraint, so that a double apply shows.
type e2e struct {
	store   *processed.Store
	effects string
}

func newE2E(t *testing.T) *e2e {
	t.Helper()
	ctx := testCtx(t, 30*time.Second)
	schema := testdb.Schema(t)
	store, err := processed.Open(ctx, testdb.URL(), processed.Config{Schema: schema, MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := store.Pool().Exec(ctx, "CREATE TABLE "+effects+" (message_id text NOT NULL, body text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return &e2e{store: store, effects: effects}
}

// handler inserts one effect row, and fails permanently on a "poison" body
// unless healed.
func (e *e2e) handler(healed bool, before func(*consumer.Message)) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if before != nil {
			before(msg)
		}
		if string(msg.Body) == "poison" && !healed {
			return consumer.Permanent(errors.New("cannot parse payment: poison"))
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (message_id, body) VALUES ($1, $2)", msg.ID, string(msg.Body))
		return err
	}
}

func (e *e2e) config(src *redisstream.Source, h consumer.Handler) consumer.Config {
	return consumer.Config{
		Name: "ledger", Store: e.store, Source: src, DeadLetterer: src.DeadLetterer(), Handler: h,
		Concurrency: 4, ShutdownTimeout: 10 * time.Second,
	}
}

// start runs rt until the returned stop is called.
func start(t *testing.T, rt *consumer.Runtime) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				err = errors.New("Run did not return within 30s")
			}
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

func (e *e2e) counts(t *testing.T) (rows, distinct int) {
	t.Helper()
	if err := e.store.Pool().QueryRow(testCtx(t, 10*time.Second), "SELECT count(*), count(DISTINCT message_id) FROM "+e.effects).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	return rows, distinct
}

// TestE2E: through consumer.New and processed.Open, entries with the same
// id field are applied once, an entry without one is applied under its
// fallback id, and a poison message is dead-lettered with its reason,
// browsable, classified and replayed once healed.
func TestE2E(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 90*time.Second)
	e := newE2E(t)
	stream := newStream(t, testURL())
	pub := newPublisher(t, redisstream.PublisherConfig{})
	msgs := brokertest.NewMessages("e2e", 6, 0)
	poison := &consumer.Message{ID: "pay-poison", Body: []byte("poison")}
	all := append(append([]*consumer.Message{}, msgs...), msgs[0].Clone(), msgs[3].Clone(), poison, &consumer.Message{Body: []byte("no id")})
	if _, err := pub.Publish(ctx, stream, all...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, redisstream.Config{Stream: stream, Group: "ledger"})
	rt, err := consumer.New(e.config(src, e.handler(false, nil)))
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, rt)
	waitFor(t, 60*time.Second, "every entry settled", func() bool {
		s := rt.Stats()
		return s.Applied+s.Duplicates+s.DeadLettered == int64(len(all)) && s.InFlight == 0
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if s := rt.Stats(); s.Applied != 7 || s.Duplicates != 2 || s.DeadLettered != 1 {
		t.Errorf("stats %+v, want 7 applied (6 and the fallback id), 2 duplicates, 1 dead-lettered", s)
	}
	if rows, distinct := e.counts(t); rows != 7 || distinct != 7 {
		t.Errorf("effects: %d rows for %d ids, want 7 for 7", rows, distinct)
	}
	c := client(t, testURL())
	if p, _ := c.XPending(ctx, stream, "ledger").Result(); p.Count != 0 {
		t.Errorf("%d entries still pending", p.Count)
	}

	browse := func() dlq.Browser {
		b, err := redisstream.NewBrowser(ctx, redisstream.BrowserConfig{URL: testURL(), Stream: redisstream.DLQName(stream)})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	rep, err := dlq.Inspect(ctx, browse(), dlq.Filter{}, 0)
	if err != nil || rep.Total != 1 || len(rep.Groups) != 1 {
		t.Fatalf("inspect: %+v, %v", rep, err)
	}
	if g := rep.Groups[0]; g.Class != consumer.ClassPermanent || g.Sample[0] != "pay-poison" || g.Sources[0] != stream {
		t.Errorf("dead-letter group %+v", g)
	}
	cl, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: browse(), Store: e.store})
	if err != nil || cl.WillApply != 1 {
		t.Fatalf("classify: %+v, %v", cl, err)
	}
	if it := cl.Items[0]; it.Record.Error == "" || it.Record.Consumer != "ledger" {
		t.Errorf("dead letter without its reason: %+v", it.Record)
	}

	// Healed, the replay applies it once and removes it from the DLQ.
	replaySrc := newSource(t, redisstream.Config{Stream: stream, Group: "ledger"})
	res, err := dlq.Replay(ctx, dlq.ReplayConfig{Browser: browse(), Consumer: e.config(replaySrc, e.handler(true, nil))})
	if err != nil || res.Applied != 1 {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	if n, _ := c.XLen(ctx, redisstream.DLQName(stream)).Result(); n != 0 {
		t.Errorf("%d dead letters left after the replay", n)
	}
	if rows, distinct := e.counts(t); rows != 8 || distinct != 8 {
		t.Errorf("effects after the replay: %d rows for %d ids, want 8 for 8", rows, distinct)
	}
}

// lostAcks passes deliveries through but swallows the ack of every other
// one, as a process that crashed between its commit and its XACK would.
type lostAcks struct {
	consumer.Source
	n, lost atomic.Int64
}

func (s *lostAcks) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return &lostAck{Delivery: d, s: s, lose: s.n.Add(1)%2 == 0}, nil
}

type lostAck struct {
	consumer.Delivery
	s    *lostAcks
	lose bool
}

func (d *lostAck) Ack(ctx context.Context) error {
	if d.lose {
		d.s.lost.Add(1)
		return nil
	}
	return d.Delivery.Ack(ctx)
}

// TestE2ECloseRecovery: a consumer is stopped with entries unacked, half of
// them committed (their acks lost) and others never handled; a second
// consumer on a new Source takes them over (XAUTOCLAIM of what Close
// released) and dedup skips the committed ones: every id applied exactly
// once, nothing left pending.
func TestE2ECloseRecovery(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 90*time.Second)
	e := newE2E(t)
	stream := newStream(t, testURL())
	const n = 40
	if _, err := newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, brokertest.NewMessages("rec", n, 0)...); err != nil {
		t.Fatal(err)
	}
	src1 := newSource(t, redisstream.Config{Stream: stream, Group: "ledger"})
	wrapped := &lostAcks{Source: src1}
	cfg := e.config(src1, e.handler(false, func(*consumer.Message) { time.Sleep(20 * time.Millisecond) }))
	cfg.Source = wrapped
	rt1, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop1 := start(t, rt1)
	waitFor(t, 30*time.Second, "10 applied by the first consumer", func() bool { return rt1.Stats().Applied >= 10 })
	if err := stop1(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	applied1 := rt1.Stats().Applied
	if applied1 >= n {
		t.Fatalf("the first consumer applied everything (%d); nothing left to recover", applied1)
	}
	t.Logf("first consumer: %+v, %d acks lost; source %+v", rt1.Stats(), wrapped.lost.Load(), src1.Stats())

	src2 := newSource(t, redisstream.Config{Stream: stream, Group: "ledger"})
	rt2, err := consumer.New(e.config(src2, e.handler(false, nil)))
	if err != nil {
		t.Fatal(err)
	}
	stop2 := start(t, rt2)
	waitFor(t, 60*time.Second, "every id applied", func() bool {
		_, distinct := e.counts(t)
		return distinct == n && rt2.Stats().InFlight == 0
	})
	c := client(t, testURL())
	waitFor(t, 30*time.Second, "nothing pending", func() bool {
		p, err := c.XPending(ctx, stream, "ledger").Result()
		return err == nil && p.Count == 0
	})
	if err := stop2(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	rows, distinct := e.counts(t)
	if rows != n || distinct != n {
		t.Errorf("effects: %d rows for %d ids, want exactly one for each of %d", rows, distinct, n)
	}
	s2 := rt2.Stats()
	t.Logf("second consumer: %+v; source %+v", s2, src2.Stats())
	if s2.Duplicates < wrapped.lost.Load() || s2.Applied != n-applied1 {
		t.Errorf("second consumer applied %d and skipped %d; want %d applied and at least the %d lost acks skipped",
			s2.Applied, s2.Duplicates, n-applied1, wrapped.lost.Load())
	}
	if src2.Stats().Claimed < wrapped.lost.Load() {
		t.Errorf("second source claimed %d entries, fewer than the %d unacked", src2.Stats().Claimed, wrapped.lost.Load())
	}
}

// TestE2EBatch: in batch mode the runtime acks each committed batch with
// one XACK (AckBatch); duplicates by id field are applied once.
func TestE2EBatch(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 90*time.Second)
	e := newE2E(t)
	stream := newStream(t, testURL())
	msgs := brokertest.NewMessages("batch", 100, 0)
	all := append(append([]*consumer.Message{}, msgs...), msgs[:20]...)
	if _, err := newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, all...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, redisstream.Config{Stream: stream, Group: "ledger"})
	cfg := e.config(src, nil)
	cfg.Handler = nil
	cfg.BatchSize = 10
	cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
		for _, m := range ms {
			if _, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (message_id, body) VALUES ($1, $2)", m.ID, string(m.Body)); err != nil {
				return err
			}
		}
		return nil
	}
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, rt)
	waitFor(t, 60*time.Second, "every entry settled", func() bool {
		s := rt.Stats()
		return s.Applied+s.Duplicates == int64(len(all)) && s.InFlight == 0
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if rows, distinct := e.counts(t); rows != 100 || distinct != 100 {
		t.Errorf("effects: %d rows for %d ids, want 100 for 100", rows, distinct)
	}
	if p, _ := client(t, testURL()).XPending(ctx, stream, "ledger").Result(); p.Count != 0 {
		t.Errorf("%d entries still pending", p.Count)
	}
	if s := src.Stats(); s.Acked != int64(len(all)) {
		t.Errorf("source acked %d, want %d", s.Acked, len(all))
	}
}
