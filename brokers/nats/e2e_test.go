package natsjs_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/brokers/brokertest"
	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// e2e is a runtime over a JetStream source, writing one row per applied
// message into a table with no unique constraint, so a double apply shows.
type e2e struct {
	store   *processed.Store
	effects string // quoted table name
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

// handler inserts the effect row, after before (if set) has run; before's
// error fails the attempt.
func (e *e2e) handler(before func(*consumer.Message) error) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if before != nil {
			if err := before(msg); err != nil {
				return err
			}
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (message_id, body) VALUES ($1, $2)", msg.ID, string(msg.Body))
		return err
	}
}

// run starts a runtime on src and returns a stop function that cancels it
// and returns Run's error.
func (e *e2e) run(t *testing.T, src consumer.Source, dl consumer.DeadLetterer, concurrency int, before func(*consumer.Message) error) (*consumer.Runtime, func() error) {
	t.Helper()
	if dl == nil {
		dl = consumer.DeadLettererFunc(func(_ context.Context, msg *consumer.Message, f consumer.Failure) error {
			t.Errorf("unexpected dead-letter of %q: %s: %v", msg.ID, f.Class, f.Err)
			return errors.New("test refuses dead-letters")
		})
	}
	rt, err := consumer.New(consumer.Config{
		Name:            "e2e",
		Source:          src,
		Store:           e.store,
		DeadLetterer:    dl,
		Concurrency:     concurrency,
		Handler:         e.handler(before),
		ShutdownTimeout: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop := func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(30 * time.Second):
				runErr = errors.New("Run did not return within 30s of cancel")
			}
		})
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return rt, stop
}

// counts returns the number of effect rows and of distinct ids among them.
func (e *e2e) counts(t *testing.T) (rows, distinct int) {
	t.Helper()
	ctx := testCtx(t, 10*time.Second)
	if err := e.store.Pool().QueryRow(ctx, "SELECT count(*), count(DISTINCT message_id) FROM "+e.effects).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	return rows, distinct
}

// consumerIdle reports that the durable consumer has nothing pending and
// nothing unacked.
func consumerIdle(t *testing.T, n names) bool {
	t.Helper()
	c, err := js(t).Consumer(testCtx(t, 10*time.Second), n.stream, n.durable)
	if err != nil {
		t.Fatal(err)
	}
	info := c.CachedInfo()
	return info.NumPending == 0 && info.NumAckPending == 0 && info.NumRedelivered == 0
}

// TestE2EDuplicatesBeyondWindow: the same Nats-Msg-Id published again after
// the stream's duplicate window has passed is stored twice by JetStream and
// applied once by the runtime.
func TestE2EDuplicatesBeyondWindow(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	e := newE2E(t)
	n := newTopology(t, 100*time.Millisecond)
	pub := newPublisher(t, natsjs.PublisherConfig{RejectDuplicates: true})
	msgs := brokertest.NewMessages("dup", 5, 0)
	if err := pub.Publish(ctx, n.subject, msgs...); err != nil {
		t.Fatal(err)
	}
	// Inside the window the stream itself discards the copy.
	err := pub.Publish(ctx, n.subject, msgs[0].Clone())
	if !errors.Is(err, natsjs.ErrDuplicate) {
		t.Fatalf("republish inside the duplicate window: %v, want ErrDuplicate", err)
	}
	time.Sleep(1500 * time.Millisecond) // the server expires duplicates about every second
	if err := pub.Publish(ctx, n.subject, msgs[0].Clone(), msgs[3].Clone()); err != nil {
		t.Fatalf("republish beyond the duplicate window: %v", err)
	}
	if got := streamMsgs(t, n.stream); got != 7 {
		t.Fatalf("stream holds %d messages, want 7", got)
	}
	src := newSource(t, n.config())
	rt, stop := e.run(t, src, src.DeadLetterer(), 2, nil)
	waitFor(t, 30*time.Second, "7 messages settled", func() bool {
		st := rt.Stats()
		return st.Applied+st.Duplicates == 7 && st.InFlight == 0
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if st := rt.Stats(); st.Applied != 5 || st.Duplicates != 2 {
		t.Errorf("runtime stats %+v, want 5 applied and 2 duplicates", st)
	}
	if rows, distinct := e.counts(t); rows != 5 || distinct != 5 {
		t.Errorf("effects: %d rows for %d ids, want 5 for 5", rows, distinct)
	}
	if !consumerIdle(t, n) {
		t.Error("the consumer still has pending or unacked messages")
	}
}

// TestE2EPoisonDeadLettered: a message the handler rejects is dead-lettered
// with its reason to the DLQ stream, acked only after that, browsable, and
// classified and replayed by package dlq through the Browser.
func TestE2EPoisonDeadLettered(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	e := newE2E(t)
	n := newNames(t)
	cfg := n.config()
	cfg.Topology = &natsjs.Topology{}
	src := newSource(t, cfg) // declares both streams
	msgs := brokertest.NewMessages("poison", 4, 0)
	msgs[2].Body = []byte("poison")
	if err := newPublisher(t, natsjs.PublisherConfig{}).Publish(ctx, n.subject, msgs...); err != nil {
		t.Fatal(err)
	}
	rejecting := func(m *consumer.Message) error {
		if string(m.Body) == "poison" {
			return consumer.Permanent(fmt.Errorf("cannot parse %q", m.Body))
		}
		return nil
	}
	rt, stop := e.run(t, src, src.DeadLetterer(), 2, rejecting)
	waitFor(t, 30*time.Second, "4 messages settled", func() bool {
		st := rt.Stats()
		return st.Applied+st.DeadLettered == 4 && st.InFlight == 0
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if st := rt.Stats(); st.Applied != 3 || st.DeadLettered != 1 {
		t.Errorf("runtime stats %+v, want 3 applied and 1 dead-lettered", st)
	}
	if got := streamMsgs(t, n.dlqStream); got != 1 {
		t.Fatalf("DLQ stream %s holds %d messages, want 1", n.dlqStream, got)
	}
	if !consumerIdle(t, n) {
		t.Error("the consumer still has pending or unacked messages")
	}

	// Browse it: the envelope says why, and browsing consumes nothing.
	b := newBrowser(t, natsjs.BrowserConfig{Subject: n.dlqSubject})
	d, err := b.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r, err := dlq.Parse(d.Message())
	if err != nil {
		t.Fatal(err)
	}
	if r.MessageID != msgs[2].ID || r.Class != consumer.ClassPermanent || !strings.Contains(r.Error, "cannot parse") || r.Source != n.subject || r.Consumer != "e2e" {
		t.Errorf("dead letter record %+v", r)
	}
	if d.Message().Header(jetstream.MsgIDHeader) != "" {
		t.Errorf("dead letter carries Nats-Msg-Id %q", d.Message().Header(jetstream.MsgIDHeader))
	}
	if _, err := b.Next(ctx); !errors.Is(err, io.EOF) {
		t.Fatalf("second Next: %v, want io.EOF", err)
	}
	_ = b.Close()

	cl, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: newBrowser(t, natsjs.BrowserConfig{Subject: n.dlqSubject}), Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	if cl.Scanned != 1 || cl.WillApply != 1 {
		t.Errorf("classification %+v, want 1 scanned, 1 to apply", cl)
	}
	if got := streamMsgs(t, n.dlqStream); got != 1 {
		t.Fatalf("after Classify the DLQ holds %d messages, want 1", got)
	}

	// Replay it with a handler that now accepts it: applied once, and
	// gone from the DLQ.
	res, err := dlq.Replay(ctx, dlq.ReplayConfig{
		Browser: newBrowser(t, natsjs.BrowserConfig{Subject: n.dlqSubject}),
		Consumer: consumer.Config{
			Name: "e2e", Store: e.store, Handler: e.handler(nil), DeadLetterer: src.DeadLetterer(),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("replay: %+v", res)
	if rows, distinct := e.counts(t); rows != 4 || distinct != 4 {
		t.Errorf("effects after replay: %d rows for %d ids, want 4 for 4", rows, distinct)
	}
	if got := streamMsgs(t, n.dlqStream); got != 0 {
		t.Errorf("after Replay the DLQ holds %d messages, want 0", got)
	}
}

// TestE2EKeepAliveSlowHandler: a handler three times slower than AckWait
// runs once; the keep-alive stops JetStream from redelivering under it.
func TestE2EKeepAliveSlowHandler(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	e := newE2E(t)
	n := newTopology(t, 0)
	if err := newPublisher(t, natsjs.PublisherConfig{}).Publish(ctx, n.subject, brokertest.NewMessages("slow", 1, 0)...); err != nil {
		t.Fatal(err)
	}
	cfg := n.config()
	cfg.AckWait = time.Second
	src := newSource(t, cfg)
	var calls atomic.Int64
	rt, stop := e.run(t, src, nil, 2, func(*consumer.Message) error {
		calls.Add(1)
		time.Sleep(3 * time.Second)
		return nil
	})
	waitFor(t, 30*time.Second, "the message applied", func() bool {
		st := rt.Stats()
		return st.Applied == 1 && st.InFlight == 0
	})
	// Give a wrongful redelivery time to show.
	time.Sleep(1500 * time.Millisecond)
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	st, sst := rt.Stats(), src.Stats()
	t.Logf("runtime %+v; source %+v", st, sst)
	if calls.Load() != 1 || st.Received != 1 || sst.Received != 1 || st.Duplicates != 0 {
		t.Errorf("handler ran %d times over %d deliveries (%d duplicates), want exactly 1", calls.Load(), sst.Received, st.Duplicates)
	}
	if sst.KeepAlives < 2 {
		t.Errorf("%d keep-alives sent over a 3s handler with AckWait 1s, want at least 2", sst.KeepAlives)
	}
	if !consumerIdle(t, n) {
		t.Error("the consumer still has pending or unacked messages")
	}
}

// ackDropper forwards a source's deliveries but loses their acks, as a
// process that dies between the commit and the ack does.
type ackDropper struct{ consumer.Source }

func (a ackDropper) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := a.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return droppedAck{d}, nil
}

type droppedAck struct{ consumer.Delivery }

func (droppedAck) Ack(context.Context) error { return nil }

// TestE2ECrashRedeliveryDeduped: a consumer commits every message but dies
// before any ack reaches JetStream, its connection killed without a nak.
// After AckWait JetStream redelivers everything to the next consumer, which
// skips it all as duplicates: each id applied exactly once.
func TestE2ECrashRedeliveryDeduped(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 90*time.Second)
	e := newE2E(t)
	n := newTopology(t, 0)
	// Fewer than MaxAckPending (2×DefaultWindow: ackDropper hides
	// Configure), since the deliveries whose acks are lost stay held.
	const count = 12
	if err := newPublisher(t, natsjs.PublisherConfig{}).Publish(ctx, n.subject, brokertest.NewMessages("crash", count, 0)...); err != nil {
		t.Fatal(err)
	}
	cfg := n.config()
	cfg.AckWait = time.Second
	src1 := newSource(t, cfg)
	rt1, stop1 := e.run(t, ackDropper{src1}, nil, 4, nil)
	waitFor(t, 30*time.Second, "every message applied", func() bool {
		return rt1.Stats().Applied == count
	})
	natsjs.KillConn(src1) // the crash: no ack, no nak
	if err := stop1(); err != nil {
		t.Logf("first runtime: %v", err)
	}
	if src1.Stats().Acked != 0 {
		t.Fatalf("the first source acked %d messages", src1.Stats().Acked)
	}

	src2 := newSource(t, cfg)
	rt2, stop2 := e.run(t, src2, nil, 4, nil)
	waitFor(t, 30*time.Second, "every redelivery skipped", func() bool {
		st := rt2.Stats()
		return st.Duplicates == count && st.InFlight == 0
	})
	if err := stop2(); err != nil {
		t.Fatalf("second runtime: %v", err)
	}
	if st := rt2.Stats(); st.Applied != 0 {
		t.Errorf("second runtime applied %d messages, want 0", st.Applied)
	}
	if rows, distinct := e.counts(t); rows != count || distinct != count {
		t.Errorf("effects: %d rows for %d ids, want exactly one row for each of %d ids", rows, distinct, count)
	}
	if !consumerIdle(t, n) {
		t.Error("the consumer still has pending or unacked messages")
	}
}

// TestE2ECloseWithoutAckRedeliversAtOnce: a consumer closed with deliveries
// it never acked gives them back at once (a nak), long before AckWait.
func TestE2ECloseWithoutAckRedeliversAtOnce(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	e := newE2E(t)
	n := newTopology(t, 0)
	const count = 10
	if err := newPublisher(t, natsjs.PublisherConfig{}).Publish(ctx, n.subject, brokertest.NewMessages("close", count, 0)...); err != nil {
		t.Fatal(err)
	}
	cfg := n.config() // AckWait 30s: a redelivery in time can only come from the nak
	src1 := newSource(t, cfg)
	rt1, stop1 := e.run(t, ackDropper{src1}, nil, 4, nil)
	waitFor(t, 30*time.Second, "every message applied", func() bool { return rt1.Stats().Applied == count })
	if err := stop1(); err != nil {
		t.Fatalf("first runtime: %v", err)
	}
	if sst := src1.Stats(); sst.Released != count {
		t.Errorf("first source released %d deliveries at Close, want %d", sst.Released, count)
	}
	src2 := newSource(t, cfg)
	rt2, stop2 := e.run(t, src2, nil, 4, nil)
	waitFor(t, 10*time.Second, "every redelivery skipped", func() bool {
		st := rt2.Stats()
		return st.Duplicates == count && st.InFlight == 0
	})
	if err := stop2(); err != nil {
		t.Fatalf("second runtime: %v", err)
	}
	if rows, _ := e.counts(t); rows != count {
		t.Errorf("effects: %d rows, want %d", rows, count)
	}
}

// TestE2EConnectionCutExactlyOnce cuts the connection while handlers are
// mid-transaction: the client reconnects by itself, the pull resumes, and
// acks that could not get through let JetStream redeliver after AckWait.
// Every id is applied exactly once, and nothing is lost.
func TestE2EConnectionCutExactlyOnce(t *testing.T) {
	t.Parallel()
	e := newE2E(t)
	n := newTopology(t, 0)
	px := newProxy(t)
	const count, concurrency = 100, 4
	msgs := brokertest.NewMessages("cut", count, 0)
	if err := newPublisher(t, natsjs.PublisherConfig{}).Publish(testCtx(t, 30*time.Second), n.subject, msgs...); err != nil {
		t.Fatal(err)
	}
	var started, blocked atomic.Int64
	gate := make(chan struct{})
	var opened sync.Once
	open := func() { opened.Do(func() { close(gate) }) }
	cfg := n.config()
	cfg.URL = px.URL()
	cfg.AckWait = 2 * time.Second
	cfg.Options = []nats.Option{nats.ReconnectWait(50 * time.Millisecond)}
	src := newSource(t, cfg)
	rt, stop := e.run(t, src, nil, concurrency, func(*consumer.Message) error {
		if started.Add(1) > 30 {
			blocked.Add(1)
			<-gate
		}
		return nil
	})
	// Registered after e.run's, so it runs first: a failing test must not
	// leave handlers blocked, or stopping the runtime would wait forever.
	t.Cleanup(open)
	// Grouped by default: how many lanes are mid-transaction depends on
	// how the deliveries were grouped; one is enough.
	waitFor(t, 30*time.Second, "a handler blocked mid-stream", func() bool { return blocked.Load() >= 1 })
	if c := px.Cut(); c == 0 {
		t.Fatal("proxy had no connection to cut")
	}
	open()
	waitFor(t, 60*time.Second, fmt.Sprintf("all %d ids applied", count), func() bool {
		_, distinct := e.counts(t)
		return distinct == count
	})
	waitFor(t, 30*time.Second, "consumer drained", func() bool {
		return rt.Stats().InFlight == 0 && consumerIdle(t, n)
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("runtime %+v; source %+v", rt.Stats(), src.Stats())
	if rows, distinct := e.counts(t); rows != count || distinct != count {
		t.Errorf("effects: %d rows for %d ids, want exactly one row for each of %d ids", rows, distinct, count)
	}
	if st := rt.Stats(); st.Applied != count {
		t.Errorf("Applied = %d, want %d", st.Applied, count)
	}
}

// TestE2EBatchMode: batch mode sizes MaxAckPending from Concurrency ×
// BatchSize, and its acks (AckBatch) settle everything once.
func TestE2EBatchMode(t *testing.T) {
	t.Parallel()
	e := newE2E(t)
	n := newTopology(t, 0)
	const count = 95
	msgs := brokertest.NewMessages("batch", count, 0)
	pub := newPublisher(t, natsjs.PublisherConfig{})
	if err := pub.Publish(testCtx(t, 30*time.Second), n.subject, msgs...); err != nil {
		t.Fatal(err)
	}
	cfg := n.config()
	// Under a loaded CI machine an ack can miss its confirm; the message
	// then comes back after AckWait and is skipped as a duplicate. Keep
	// that within the wait below.
	cfg.AckWait = 2 * time.Second
	src := newSource(t, cfg)
	rt, err := consumer.New(consumer.Config{
		Name: "e2e-batch", Store: e.store, Source: src, DeadLetterer: src.DeadLetterer(),
		Concurrency: 2, BatchSize: 10, BatchWait: 50 * time.Millisecond,
		BatchHandler: func(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
			for _, m := range ms {
				if _, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (message_id, body) VALUES ($1, $2)", m.ID, string(m.Body)); err != nil {
					return err
				}
			}
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if w := src.Window(); w != 40 {
		t.Errorf("MaxAckPending %d, want 2×2×10", w)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	started := time.Now()
	go func() { done <- rt.Run(ctx) }()
	waitFor(t, 30*time.Second, "every message settled", func() bool {
		st := rt.Stats()
		if st.Applied == count && st.InFlight == 0 && consumerIdle(t, n) {
			return true
		}
		if time.Since(started) > 25*time.Second {
			t.Logf("still waiting: runtime %+v; source %+v", st, src.Stats())
		}
		return false
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if rows, distinct := e.counts(t); rows != count || distinct != count {
		t.Errorf("effects: %d rows for %d ids, want %d", rows, distinct, count)
	}
	t.Logf("runtime %+v; source %+v", rt.Stats(), src.Stats())
}

// TestE2EDeadLetterTooLargeForTheServer: a message that fits the server's
// max_payload, whose dead letter does not (the envelope's headers take it
// over), is dead-lettered truncated at once: the worker is not held on it,
// and the dead letter says what it lacks, the original's size and SHA-256,
// and its stream sequence.
func TestE2EDeadLetterTooLargeForTheServer(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	e := newE2E(t)
	n := newNames(t)
	cfg := n.config()
	cfg.Topology = &natsjs.Topology{}
	src := newSource(t, cfg)
	nc, err := nats.Connect(serverURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	// As large as the server takes with the publisher's own headers.
	big := &consumer.Message{ID: "big-1", Body: []byte(strings.Repeat("x", int(nc.MaxPayload())-256))}
	if err := newPublisher(t, natsjs.PublisherConfig{}).Publish(ctx, n.subject, big); err != nil {
		t.Fatalf("publish a message the server takes: %v", err)
	}
	rejecting := func(*consumer.Message) error { return consumer.Permanent(errors.New("cannot parse the order")) }
	rt, stop := e.run(t, src, src.DeadLetterer(), 1, rejecting)
	waitFor(t, 20*time.Second, "the message dead-lettered", func() bool {
		st := rt.Stats()
		return st.DeadLettered == 1 && st.InFlight == 0
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	d, err := newBrowser(t, natsjs.BrowserConfig{Subject: n.dlqSubject}).Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r, err := dlq.Parse(d.Message())
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(big.Body)
	if r.Truncated != "body" || r.OriginalSize != int64(len(big.Body)) || r.OriginalSHA256 != hex.EncodeToString(sum[:]) ||
		len(d.Message().Body) != 1024 { // the default dlq.Options.PreviewBytes
		t.Errorf("dead letter %+v with a %d-byte body: want it truncated to %d bytes, with the original's size and hash",
			r, len(d.Message().Body), 1024)
	}
	if r.MessageID != "big-1" || r.Source != n.subject || r.Offset != 1 || !strings.Contains(r.Error, "cannot parse the order") {
		t.Errorf("dead letter %+v: want id big-1 from %s at stream sequence 1, with its reason", r, n.subject)
	}
}

// TestDeadLetterTooLargeForTheStream: a dead-letter stream whose
// max_msg_size refuses the whole dead letter gets it truncated.
func TestDeadLetterTooLargeForTheStream(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	n := newNames(t)
	j := js(t)
	if _, err := j.CreateStream(ctx, jetstream.StreamConfig{Name: n.stream, Subjects: []string{n.subject}}); err != nil {
		t.Fatal(err)
	}
	if _, err := j.CreateStream(ctx, jetstream.StreamConfig{Name: n.dlqStream, Subjects: []string{n.dlqSubject}, MaxMsgSize: 8192}); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, n.config())
	m := &consumer.Message{ID: "big-2", Body: []byte(strings.Repeat("y", 8000)), Source: n.subject, Partition: -1, Offset: 7}
	if err := src.DeadLetterer().DeadLetter(ctx, m, consumer.Failure{Consumer: "c", MessageID: "big-2", Class: consumer.ClassPermanent, Err: errors.New("bad")}); err != nil {
		t.Fatalf("DeadLetter: %v", err)
	}
	d, err := newBrowser(t, natsjs.BrowserConfig{Subject: n.dlqSubject}).Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := dlq.Parse(d.Message()); err != nil || r.Truncated != "body" || r.OriginalSize != 8000 || r.Offset != 7 {
		t.Fatalf("dead letter %+v (%v): want it truncated, from sequence 7", r, err)
	}
}
