package dlq_test

// The issue-5 DLQ tests on a real RabbitMQ broker and Postgres. Every helper
// here starts with "rmq": the other files of this package belong to other
// tests.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

const rmqConsumerName = "rmq-ledger"

var _ dlq.Browser = (*rabbitmq.Browser)(nil)

// rmqURL is the test broker: IDEMQ_TEST_AMQP_URL, or the local default.
func rmqURL() string {
	if u := os.Getenv("IDEMQ_TEST_AMQP_URL"); u != "" {
		return u
	}
	return rabbitmq.DefaultURL
}

// rmqEnv is a consumer on a RabbitMQ work queue with a dead-letter exchange
// and queue, a dedup store and an effects table without a unique
// constraint, so that a double apply shows as two rows.
type rmqEnv struct {
	t       *testing.T
	ctx     context.Context
	queue   string
	dlqName string
	dlx     string
	pool    *pgxpool.Pool
	store   *processed.Store
	effects string
	pub     *rabbitmq.Publisher
	dl      consumer.DeadLetterer
	host    string

	broken  atomic.Bool // the handler bug: every message fails
	mu      sync.Mutex
	failIDs map[string]bool // ids that keep failing after the fix
}

func rmqNewEnv(t *testing.T, opts ...func(*rabbitmq.Topology)) *rmqEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	var b [5]byte
	_, _ = rand.Read(b[:])
	queue := "idemq-dlqtest." + strings.ReplaceAll(t.Name(), "/", ".") + "." + hex.EncodeToString(b[:])
	topo := rabbitmq.Topology{Queue: queue}
	for _, o := range opts {
		o(&topo)
	}
	if err := rabbitmq.DeclareTopology(ctx, rmqURL(), topo); err != nil {
		t.Fatalf("declare topology: %v", err)
	}
	e := &rmqEnv{t: t, ctx: ctx, queue: queue, dlqName: queue + ".dlq", dlx: queue + ".dlx", failIDs: map[string]bool{}}
	t.Cleanup(func() {
		rmqAdmin(t, func(ch *amqp.Channel) error {
			for _, q := range []string{e.queue, e.dlqName} {
				if _, err := ch.QueueDelete(q, false, false, false); err != nil {
					return err
				}
			}
			return ch.ExchangeDelete(e.dlx, false, false)
		})
	})

	e.pool = testdb.Pool(t)
	schema := testdb.Schema(t)
	store, err := processed.New(e.pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	e.store = store
	e.effects = pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := e.pool.Exec(ctx, "CREATE TABLE "+e.effects+" (message_id text NOT NULL, body text NOT NULL)"); err != nil {
		t.Fatal(err)
	}

	e.pub, err = rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: rmqURL()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.pub.Close(); err != nil {
			t.Errorf("close publisher: %v", err)
		}
	})
	e.dl = e.deadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return e.pub.Publish(ctx, "", e.dlqName, m)
	})
	e.host, _ = os.Hostname()
	return e
}

// rmqAdmin runs f on a fresh channel of a fresh connection, failing t on
// error.
func rmqAdmin(t *testing.T, f func(ch *amqp.Channel) error) {
	t.Helper()
	conn, err := amqp.Dial(rmqURL())
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	if err := f(ch); err != nil {
		t.Fatalf("admin: %v", err)
	}
}

func (e *rmqEnv) deadLetterer(publish func(context.Context, *consumer.Message) error) consumer.DeadLetterer {
	e.t.Helper()
	dl, err := dlq.NewDeadLetterer(publish, dlq.Options{})
	if err != nil {
		e.t.Fatal(err)
	}
	return dl
}

func (e *rmqEnv) setFailing(ids ...string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, id := range ids {
		e.failIDs[id] = true
	}
}

func (e *rmqEnv) handler(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	e.mu.Lock()
	fail := e.failIDs[m.ID]
	e.mu.Unlock()
	if e.broken.Load() || fail {
		return errors.New("handler bug: nil fee schedule")
	}
	_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (message_id, body) VALUES ($1, $2)", m.ID, string(m.Body))
	return err
}

// config is the live consumer's configuration: two attempts, then the DLQ.
func (e *rmqEnv) config(src consumer.Source) consumer.Config {
	return consumer.Config{
		Name: rmqConsumerName, Source: src, Store: e.store, Handler: e.handler,
		DeadLetterer: e.dl, Concurrency: 4, ShutdownTimeout: 10 * time.Second,
		Retry: consumer.RetryConfig{MaxAttempts: 2, InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
	}
}

// rmqMessages makes n messages with ids "<prefix>-<i>".
func rmqMessages(prefix string, n int) []*consumer.Message {
	msgs := make([]*consumer.Message, n)
	for i := range msgs {
		msgs[i] = &consumer.Message{
			ID:      fmt.Sprintf("%s-%03d", prefix, i),
			Body:    fmt.Appendf(nil, `{"payment":"%s-%03d","cents":%d}`, prefix, i, 100+i),
			Headers: map[string]string{"content-type": "application/json"},
		}
	}
	return msgs
}

func (e *rmqEnv) publish(queue string, msgs ...*consumer.Message) {
	e.t.Helper()
	if err := e.pub.Publish(e.ctx, "", queue, msgs...); err != nil {
		e.t.Fatalf("publish to %s: %v", queue, err)
	}
}

func (e *rmqEnv) depth(q string) int {
	e.t.Helper()
	var n int
	rmqAdmin(e.t, func(ch *amqp.Channel) error {
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		n = st.Messages
		return err
	})
	return n
}

// waitDepth polls until q holds want ready messages: requeues and acks are
// asynchronous in the broker.
func (e *rmqEnv) waitDepth(q string, want int) {
	e.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		got := e.depth(q)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("queue %s holds %d ready messages, want %d", q, got, want)
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}
}

// run runs a runtime with cfg until done(stats) holds, then stops it and
// returns its final stats.
func (e *rmqEnv) run(cfg consumer.Config, done func(consumer.Stats) bool) consumer.Stats {
	e.t.Helper()
	rt, err := consumer.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- rt.Run(ctx) }()
	deadline := time.Now().Add(30 * time.Second)
	for !done(rt.Stats()) {
		if time.Now().After(deadline) {
			cancel()
			<-errc
			e.t.Fatalf("runtime did not get there in time: %+v", rt.Stats())
		}
		time.Sleep(5 * time.Millisecond) // polling interval
	}
	cancel()
	if err := <-errc; err != nil {
		e.t.Fatalf("runtime: %v", err)
	}
	return rt.Stats()
}

func (e *rmqEnv) source(queue string) *rabbitmq.Source {
	e.t.Helper()
	src, err := rabbitmq.NewSource(e.ctx, rabbitmq.Config{URL: rmqURL(), Queue: queue})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = src.Close() }) // the runtime closes it first
	return src
}

// consume runs the live consumer until n deliveries settled and the work
// queue is empty.
func (e *rmqEnv) consume(n int) consumer.Stats {
	e.t.Helper()
	s := e.run(e.config(e.source(e.queue)), func(s consumer.Stats) bool {
		return s.Applied+s.Duplicates+s.DeadLettered >= int64(n) && s.InFlight == 0
	})
	e.waitDepth(e.queue, 0)
	return s
}

func (e *rmqEnv) browser() *rabbitmq.Browser {
	e.t.Helper()
	b, err := rabbitmq.NewBrowser(e.ctx, rabbitmq.BrowserConfig{URL: rmqURL(), Queue: e.dlqName})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = b.Close() }) // idempotent; the dlq functions close it
	return b
}

func (e *rmqEnv) replay(mod func(*dlq.ReplayConfig)) dlq.Result {
	e.t.Helper()
	cfg := dlq.ReplayConfig{Browser: e.browser(), Consumer: e.config(nil)}
	if mod != nil {
		mod(&cfg)
	}
	res, err := dlq.Replay(e.ctx, cfg)
	if err != nil {
		e.t.Fatalf("replay: %v", err)
	}
	if res.Unsettled != 0 || res.Malformed != 0 {
		e.t.Fatalf("replay left messages unsettled or found malformed ones: %+v", res)
	}
	return res
}

// dlqContents browses the DLQ without consuming it and returns its messages
// in queue order.
func (e *rmqEnv) dlqContents() []*consumer.Message {
	e.t.Helper()
	b := e.browser()
	var out []*consumer.Message
	for {
		d, err := b.Next(e.ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			e.t.Fatal(err)
		}
		out = append(out, d.Message().Clone())
	}
	if err := b.Close(); err != nil {
		e.t.Fatal(err)
	}
	e.waitDepth(e.dlqName, len(out))
	return out
}

// effectCounts returns how many effect rows each message id has.
func (e *rmqEnv) effectCounts() map[string]int {
	e.t.Helper()
	rows, err := e.pool.Query(e.ctx, "SELECT message_id, count(*) FROM "+e.effects+" GROUP BY message_id")
	if err != nil {
		e.t.Fatal(err)
	}
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			e.t.Fatal(err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		e.t.Fatal(err)
	}
	return out
}

// expectEffects fails unless exactly the ids have effects, once each.
func (e *rmqEnv) expectEffects(ids ...string) {
	e.t.Helper()
	got := e.effectCounts()
	for _, id := range ids {
		if got[id] != 1 {
			e.t.Errorf("message %s applied %d times, want exactly once", id, got[id])
		}
	}
	if len(got) != len(ids) {
		e.t.Errorf("effects for %d ids, want %d: %v", len(got), len(ids), got)
	}
}

// putInDLQ publishes the dead-letter envelope of each message straight to
// the DLQ, as if the consumer had dead-lettered it with f.
func (e *rmqEnv) putInDLQ(f consumer.Failure, msgs ...*consumer.Message) {
	e.t.Helper()
	for _, m := range msgs {
		m = m.Clone()
		m.Source, m.Partition, m.Offset = e.queue, -1, -1
		fl := f
		fl.Consumer, fl.MessageID = rmqConsumerName, m.ID
		e.publish(e.dlqName, dlq.Envelope(m, fl, dlq.Options{}))
	}
}

func rmqIDs(msgs []*consumer.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.ID
	}
	return out
}

// TestRmqDeadLetterAndReplay: a handler bug sends N messages to the DLQ with
// complete envelopes; Inspect groups them without consuming; after the fix
// a replay applies each exactly once and empties the DLQ; replaying copies
// of the same dead letters again applies nothing.
func TestRmqDeadLetterAndReplay(t *testing.T) {
	t.Parallel()
	e := rmqNewEnv(t)
	const n = 12
	msgs := rmqMessages("pay", n)
	e.broken.Store(true)
	start := time.Now()
	e.publish(e.queue, msgs...)
	s := e.consume(n)
	if s.DeadLettered != n || s.Applied != 0 {
		t.Fatalf("with the bug: %+v, want %d dead-lettered", s, n)
	}
	e.waitDepth(e.dlqName, n)
	if got := e.effectCounts(); len(got) != 0 {
		t.Fatalf("effects despite the bug: %v", got)
	}

	// Complete metadata on every dead letter; body and headers kept.
	dead := e.dlqContents()
	if got := rmqIDs(dead); !slices.Equal(slices.Sorted(slices.Values(got)), rmqIDs(msgs)) {
		t.Fatalf("DLQ holds %v, want %v", got, rmqIDs(msgs))
	}
	bodies := map[string]string{}
	for _, m := range msgs {
		bodies[m.ID] = string(m.Body)
	}
	for _, m := range dead {
		r, err := dlq.Parse(m)
		if err != nil {
			t.Fatalf("%s: %v", m.ID, err)
		}
		switch {
		case r.Consumer != rmqConsumerName, r.MessageID != m.ID, r.Class != consumer.ClassRetryableExhausted,
			!strings.Contains(r.Error, "handler bug: nil fee schedule"), r.Attempts != 2,
			r.FirstFailure.Before(start.Add(-time.Second)), r.LastFailure.Before(r.FirstFailure), r.LastFailure.After(time.Now()),
			r.Source != e.queue, r.Partition != -1, r.Offset != -1, r.Host == "" || r.Host != e.host,
			r.DeadLetters != 1, len(r.History) != 0:
			t.Errorf("incomplete envelope on %s: %+v", m.ID, r)
		}
		if string(m.Body) != bodies[m.ID] || m.Header("content-type") != "application/json" {
			t.Errorf("%s: body or headers changed: %q %v", m.ID, m.Body, m.Headers)
		}
	}

	rep, err := dlq.Inspect(e.ctx, e.browser(), dlq.Filter{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Total != n || len(rep.Groups) != 1 || rep.Groups[0].Count != n || rep.Groups[0].Class != consumer.ClassRetryableExhausted ||
		!slices.Equal(rep.Groups[0].Sources, []string{e.queue}) {
		t.Fatalf("inspect: %+v", rep)
	}
	e.waitDepth(e.dlqName, n)

	// Fix the handler and replay.
	e.broken.Store(false)
	res := e.replay(nil)
	if res.Scanned != n || res.Applied != n || res.Skipped != 0 || res.FailedAgain != 0 {
		t.Fatalf("replay: %+v, want %d applied", res, n)
	}
	e.waitDepth(e.dlqName, 0)
	e.expectEffects(rmqIDs(msgs)...)

	// Replaying an empty DLQ does nothing.
	if res := e.replay(nil); res.Scanned != 0 || res.Applied != 0 {
		t.Fatalf("second replay: %+v", res)
	}
	// Replaying the same dead letters again (copies of them) skips every
	// one as already applied, and removes them.
	e.publish(e.dlqName, dead...)
	res = e.replay(nil)
	if res.Scanned != n || res.Skipped != n || res.Applied != 0 {
		t.Fatalf("replay of copies: %+v, want %d skipped", res, n)
	}
	e.waitDepth(e.dlqName, 0)
	e.expectEffects(rmqIDs(msgs)...)
}

// TestRmqReplaySkipsAppliedCopy: a DLQ copy of a message that was in fact
// applied (it failed after its commit) is skipped on replay, while the
// genuinely failed message next to it applies once.
func TestRmqReplaySkipsAppliedCopy(t *testing.T) {
	t.Parallel()
	e := rmqNewEnv(t)
	applied := rmqMessages("done", 1)[0]
	e.publish(e.queue, applied)
	if s := e.consume(1); s.Applied != 1 {
		t.Fatalf("consume: %+v", s)
	}
	now := time.Now()
	failure := consumer.Failure{Class: consumer.ClassTimeout, Err: errors.New("ack lost after commit"), Attempts: 1, FirstFailure: now, LastFailure: now}
	pending := rmqMessages("todo", 1)[0]
	e.putInDLQ(failure, applied, pending)

	res := e.replay(nil)
	if res.Scanned != 2 || res.Skipped != 1 || res.Applied != 1 {
		t.Fatalf("replay: %+v, want 1 skipped and 1 applied", res)
	}
	e.waitDepth(e.dlqName, 0)
	e.expectEffects(applied.ID, pending.ID)
}

// TestRmqStillFailingReturnsWithHistory: a message that still fails goes
// back to the DLQ with its history grown and its dead-letter count
// incremented, keeping its original source; the others apply.
func TestRmqStillFailingReturnsWithHistory(t *testing.T) {
	t.Parallel()
	e := rmqNewEnv(t)
	msgs := rmqMessages("hist", 4)
	poison := msgs[2].ID
	e.broken.Store(true)
	e.publish(e.queue, msgs...)
	e.consume(len(msgs))
	e.waitDepth(e.dlqName, len(msgs))

	e.broken.Store(false)
	e.setFailing(poison)
	for round := 2; round <= 3; round++ {
		res := e.replay(nil)
		wantApplied := int64(len(msgs) - 1)
		if round == 3 {
			wantApplied = 0
		}
		if res.FailedAgain != 1 || res.Applied != wantApplied {
			t.Fatalf("replay %d: %+v", round, res)
		}
		dead := e.dlqContents()
		if len(dead) != 1 || dead[0].ID != poison {
			t.Fatalf("replay %d: DLQ holds %v, want only %s", round, rmqIDs(dead), poison)
		}
		r, err := dlq.Parse(dead[0])
		if err != nil {
			t.Fatal(err)
		}
		if r.DeadLetters != round || len(r.History) != round-1 {
			t.Fatalf("replay %d: dead letters %d, history %d entries, want %d and %d", round, r.DeadLetters, len(r.History), round, round-1)
		}
		for _, h := range append(r.History, r.Entry) {
			if h.Source != e.queue || h.MessageID != poison || h.Consumer != rmqConsumerName || h.Class != consumer.ClassRetryableExhausted {
				t.Errorf("replay %d: entry %+v", round, h)
			}
		}
		if !r.History[len(r.History)-1].LastFailure.Before(r.LastFailure) {
			t.Errorf("replay %d: latest failure %s not after the previous %s", round, r.LastFailure, r.History[len(r.History)-1].LastFailure)
		}
	}
	var want []string
	for _, m := range msgs {
		if m.ID != poison {
			want = append(want, m.ID)
		}
	}
	e.expectEffects(want...)
}

// TestRmqClassifyDryRun: the dry run classifies already-applied, will-apply,
// fingerprint-mismatch and missing-id messages, and consumes nothing: the
// DLQ keeps its depth, ids and order, and no effect or dedup row appears.
func TestRmqClassifyDryRun(t *testing.T) {
	t.Parallel()
	e := rmqNewEnv(t)
	applied := rmqMessages("app", 2)
	e.publish(e.queue, applied...)
	e.consume(len(applied))

	now := time.Now()
	f := consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1, FirstFailure: now, LastFailure: now}
	willApply := rmqMessages("new", 3)
	mismatch := applied[1].Clone()
	mismatch.Body = []byte(`{"payment":"app-001","cents":999999}`)
	noID := &consumer.Message{Body: []byte(`{"cents":1}`)}
	e.putInDLQ(f, applied[0])
	e.putInDLQ(f, willApply...)
	e.putInDLQ(f, mismatch)
	e.putInDLQ(consumer.Failure{Class: consumer.ClassMissingID, Err: errors.New("message has no id"), FirstFailure: now, LastFailure: now}, noID)
	before := rmqIDs(e.dlqContents())
	const total = 6

	c, err := dlq.Classify(e.ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	if c.Scanned != total || c.AlreadyApplied != 1 || c.WillApply != 3 || c.Mismatch != 1 || c.MissingID != 1 || c.Malformed != 0 {
		t.Fatalf("classify: %+v", c)
	}
	want := map[string]dlq.Verdict{applied[0].ID: dlq.VerdictAlreadyApplied, applied[1].ID: dlq.VerdictMismatch, "": dlq.VerdictMissingID}
	for _, m := range willApply {
		want[m.ID] = dlq.VerdictWillApply
	}
	for _, it := range c.Items {
		if it.Verdict != want[it.Record.MessageID] {
			t.Errorf("%q: verdict %s, want %s", it.Record.MessageID, it.Verdict, want[it.Record.MessageID])
		}
		if (it.Verdict == dlq.VerdictAlreadyApplied || it.Verdict == dlq.VerdictMismatch) && it.AppliedAt.IsZero() {
			t.Errorf("%q: no applied-at time", it.Record.MessageID)
		}
	}
	e.waitDepth(e.dlqName, total)
	if after := rmqIDs(e.dlqContents()); !slices.Equal(after, before) {
		t.Fatalf("the dry run changed the DLQ: %v, was %v", after, before)
	}
	e.expectEffects(rmqIDs(applied)...)
	st, err := e.store.Stats(e.ctx, rmqConsumerName)
	if err != nil {
		t.Fatal(err)
	}
	if st.Rows != int64(len(applied)) {
		t.Fatalf("dedup rows %d after a dry run, want %d", st.Rows, len(applied))
	}
}

// TestRmqHorizonGuard: dead letters older than the dedup retention window
// are refused without Force and stay in the DLQ; with Force they replay.
func TestRmqHorizonGuard(t *testing.T) {
	t.Parallel()
	e := rmqNewEnv(t)
	old := time.Now().Add(-72 * time.Hour)
	msgs := rmqMessages("old", 3)
	e.putInDLQ(consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1, FirstFailure: old, LastFailure: old.Add(time.Minute)}, msgs...)
	recent := rmqMessages("recent", 1)
	e.putInDLQ(consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1, FirstFailure: time.Now(), LastFailure: time.Now()}, recent...)

	c, err := dlq.Classify(e.ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store, Retention: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if c.BeyondHorizon != len(msgs) || c.WillApply != len(msgs)+1 {
		t.Fatalf("classify: %+v", c)
	}

	res := e.replay(func(c *dlq.ReplayConfig) { c.Retention = 24 * time.Hour })
	if res.BeyondHorizon != int64(len(msgs)) || res.Matched != 1 || res.Applied != 1 {
		t.Fatalf("replay without Force: %+v", res)
	}
	e.waitDepth(e.dlqName, len(msgs))
	if got := rmqIDs(e.dlqContents()); !slices.Equal(got, rmqIDs(msgs)) {
		t.Fatalf("DLQ holds %v, want the old ones %v", got, rmqIDs(msgs))
	}
	e.expectEffects(recent[0].ID)

	res = e.replay(func(c *dlq.ReplayConfig) { c.Retention = 24 * time.Hour; c.Force = true })
	if res.BeyondHorizon != 0 || res.Applied != int64(len(msgs)) {
		t.Fatalf("replay with Force: %+v", res)
	}
	e.waitDepth(e.dlqName, 0)
	e.expectEffects(append(rmqIDs(msgs), recent[0].ID)...)
}

// TestRmqRequeueToOriginalQueue: the replay-to-original-queue mode
// republishes dead letters to their source queue and removes them from the
// DLQ; with Store set, already-applied ones are removed without being
// republished. The live consumer then applies each exactly once.
func TestRmqRequeueToOriginalQueue(t *testing.T) {
	t.Parallel()
	for _, withStore := range []bool{true, false} {
		t.Run(fmt.Sprintf("store=%v", withStore), func(t *testing.T) {
			t.Parallel()
			e := rmqNewEnv(t)
			applied := rmqMessages("app", 2)
			e.publish(e.queue, applied...)
			e.consume(len(applied))
			failed := rmqMessages("fail", 3)
			e.broken.Store(true)
			e.publish(e.queue, failed...)
			e.consume(len(failed))
			e.broken.Store(false)
			now := time.Now()
			e.putInDLQ(consumer.Failure{Class: consumer.ClassTimeout, Err: errors.New("ack lost"), Attempts: 1, FirstFailure: now, LastFailure: now}, applied...)
			e.waitDepth(e.dlqName, len(applied)+len(failed))

			cfg := dlq.RequeueConfig{
				Browser: e.browser(),
				Publish: func(ctx context.Context, dest string, m *consumer.Message) error {
					return e.pub.Publish(ctx, "", dest, m)
				},
			}
			if withStore {
				cfg.Store = e.store
			}
			res, err := dlq.Requeue(e.ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			wantRepub, wantSkipped := len(failed), len(applied)
			if !withStore {
				wantRepub, wantSkipped = len(failed)+len(applied), 0
			}
			if res.Republished != int64(wantRepub) || res.Skipped != int64(wantSkipped) {
				t.Fatalf("requeue: %+v, want %d republished, %d skipped", res, wantRepub, wantSkipped)
			}
			e.waitDepth(e.dlqName, 0)
			e.waitDepth(e.queue, wantRepub)

			s := e.consume(wantRepub)
			if s.Applied != int64(len(failed)) || s.Duplicates != int64(wantRepub-len(failed)) || s.DeadLettered != 0 {
				t.Fatalf("consumer after requeue: %+v", s)
			}
			e.expectEffects(append(rmqIDs(applied), rmqIDs(failed)...)...)
		})
	}
}

// TestRmqDeadLetterPublishFailure: when the DLQ publish fails (here it
// targets an exchange that does not exist) the original is never acked: the
// runtime retries the copy in place, and when it stops it requeues the
// original, which stays in the work queue; once the DLQ works again it
// arrives there. No dead letter is lost.
func TestRmqDeadLetterPublishFailure(t *testing.T) {
	t.Parallel()
	e := rmqNewEnv(t)
	msgs := rmqMessages("lost", 3)
	e.broken.Store(true)
	e.publish(e.queue, msgs...)

	var publishErrs atomic.Int64
	missing := e.queue + ".no-such-exchange"
	cfg := e.config(e.source(e.queue))
	var mu sync.Mutex
	failedTries := map[string]int{} // failed dead-letter publishes per id
	cfg.DeadLetterer = e.deadLetterer(func(ctx context.Context, m *consumer.Message) error {
		err := e.pub.Publish(ctx, missing, "", m)
		if err != nil {
			publishErrs.Add(1)
			mu.Lock()
			failedTries[m.ID]++
			mu.Unlock()
		}
		return err
	})
	cfg.ShutdownTimeout = time.Second // the copies are retried until the hard stop
	s := e.run(cfg, func(consumer.Stats) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, m := range msgs {
			if failedTries[m.ID] < 2 {
				return false
			}
		}
		return true
	})
	// Stopped while retrying: every original was requeued, none acked.
	if s.DeadLettered != 0 || s.Applied != 0 || s.Requeued != int64(len(msgs)) || publishErrs.Load() == 0 {
		t.Fatalf("stats %+v, %d publish errors", s, publishErrs.Load())
	}
	// Every original is still in the work queue, none in the DLQ.
	e.waitDepth(e.queue, len(msgs))
	if d := e.depth(e.dlqName); d != 0 {
		t.Fatalf("DLQ holds %d messages after failed publishes", d)
	}

	// With the DLQ reachable again, every message gets there.
	s = e.consume(len(msgs))
	if s.DeadLettered != int64(len(msgs)) {
		t.Fatalf("after the DLQ recovered: %+v", s)
	}
	e.waitDepth(e.dlqName, len(msgs))
	got := rmqIDs(e.dlqContents())
	slices.Sort(got)
	if !slices.Equal(got, rmqIDs(msgs)) {
		t.Fatalf("DLQ holds %v, want %v", got, rmqIDs(msgs))
	}
	if c := e.effectCounts(); len(c) != 0 {
		t.Fatalf("effects: %v", c)
	}
}

// TestRmqSignedEnvelopesSurviveTheBroker: signatures made by the dead-letterer
// still verify after the AMQP round trip (header tables, properties), and a
// replay with VerifyKeys applies every signed message.
func TestRmqSignedEnvelopesSurviveTheBroker(t *testing.T) {
	t.Parallel()
	e := rmqNewEnv(t)
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return e.pub.Publish(ctx, "", e.dlqName, m)
	}, dlq.Options{SigningKey: signKey})
	if err != nil {
		t.Fatal(err)
	}
	e.dl = dl
	const n = 6
	msgs := rmqMessages("sig", n)
	msgs[0].Headers = map[string]string{"x-idemq-source": "forged by the producer", "tenant": "a"}
	e.broken.Store(true)
	e.publish(e.queue, msgs...)
	e.consume(n)
	e.waitDepth(e.dlqName, n)
	for _, m := range e.dlqContents() {
		if err := dlq.Verify(m, signKey); err != nil {
			t.Fatalf("%s after the broker: %v (headers %v)", m.ID, err, m.Headers)
		}
	}
	e.broken.Store(false)
	res := e.replay(func(c *dlq.ReplayConfig) { c.VerifyKeys = [][]byte{signKey} })
	if res.Applied != n || res.Unverified != 0 {
		t.Fatalf("replay: %+v", res)
	}
	e.expectEffects(rmqIDs(msgs)...)
}
