package dlq_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

const (
	memQueue = "orders"
	memDLQ   = "orders.dlq"
)

// memEnv is a consumer on the memory broker whose handler can be broken and
// fixed, with a dead-letter queue on the same broker.
type memEnv struct {
	t      *testing.T
	broker *memory.Broker
	pool   *pgxpool.Pool
	store  *processed.Store
	// sharded, if set, is the consumer's store in store's place.
	sharded *processed.Sharded
	effects string
	broken  atomic.Bool // the handler bug
	failIDs map[string]bool
	// dl, if set, replaces the broker's unsigned DeadLetterer.
	dl consumer.DeadLetterer
}

func newMemEnv(t *testing.T) *memEnv {
	t.Helper()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	e := &memEnv{t: t, broker: memory.NewBroker(), pool: pool, store: store,
		effects: pgx.Identifier{schema, "effects"}.Sanitize(), failIDs: map[string]bool{}}
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+e.effects+" (message_id text, body text)"); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *memEnv) handler(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if e.broken.Load() || e.failIDs[m.ID] {
		return consumer.Permanent(errors.New("handler bug: cannot parse order"))
	}
	_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" VALUES ($1, $2)", m.ID, string(m.Body))
	return err
}

func (e *memEnv) config(src consumer.Source) consumer.Config {
	dl := e.dl
	if dl == nil && src == nil {
		dl = e.deadLetterer()
	}
	var store dedup.Store = e.store
	if e.sharded != nil {
		store = e.sharded
	}
	return consumer.Config{
		Name: "billing", Source: src, Store: store, Handler: e.handler,
		DeadLetterer: dl,
		Retry:        consumer.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond},
	}
}

// consume runs the live consumer until the work queue is drained.
func (e *memEnv) consume() consumer.Stats {
	e.t.Helper()
	sub, err := e.broker.Subscribe(memQueue, memory.SubscribeOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	rt, err := consumer.New(e.config(sub))
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer wcancel()
	if err := e.broker.WaitFor(wctx, memQueue, memory.Drained); err != nil {
		e.t.Fatal(err)
	}
	for rt.Stats().InFlight > 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		e.t.Fatal(err)
	}
	return rt.Stats()
}

// browser opens a browser on the DLQ as it is now.
func (e *memEnv) browser() dlq.Browser {
	e.t.Helper()
	n := e.broker.Ready(memDLQ)
	sub, err := e.broker.Subscribe(memDLQ, memory.SubscribeOptions{Prefetch: max(n, 1)})
	if err != nil {
		e.t.Fatal(err)
	}
	return dlq.SourceBrowser(sub, n, 200*time.Millisecond)
}

func (e *memEnv) replay(mod func(*dlq.ReplayConfig)) dlq.Result {
	e.t.Helper()
	cfg := dlq.ReplayConfig{Browser: e.browser(), Consumer: e.config(nil)}
	if mod != nil {
		mod(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := dlq.Replay(ctx, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return res
}

func (e *memEnv) effectCount() (rows, distinct int) {
	e.t.Helper()
	if err := e.pool.QueryRow(context.Background(), "SELECT count(*), count(DISTINCT message_id) FROM "+e.effects).Scan(&rows, &distinct); err != nil {
		e.t.Fatal(err)
	}
	return rows, distinct
}

func (e *memEnv) publish(n int) {
	e.t.Helper()
	var msgs []*consumer.Message
	for i := 0; i < n; i++ {
		msgs = append(msgs, &consumer.Message{ID: fmt.Sprintf("o-%03d", i), Body: []byte(fmt.Sprintf(`{"order":%d}`, i))})
	}
	if err := e.broker.Publish(context.Background(), memQueue, msgs...); err != nil {
		e.t.Fatal(err)
	}
}

func TestReplayAppliesFixedMessagesExactlyOnce(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	e.broken.Store(true)
	e.publish(20)
	if s := e.consume(); s.DeadLettered != 20 || s.Applied != 0 {
		t.Fatalf("bug run: %+v", s)
	}
	// Complete metadata on every dead letter.
	for _, m := range e.broker.Messages(memDLQ) {
		r, err := dlq.Parse(m)
		if err != nil {
			t.Fatal(err)
		}
		if r.Consumer != "billing" || r.MessageID != m.ID || r.Class != consumer.ClassPermanent || r.Attempts != 1 ||
			r.Source != memQueue || r.Host == "" || r.FirstFailure.IsZero() || r.LastFailure.IsZero() || r.Error == "" {
			t.Fatalf("incomplete envelope: %+v", r)
		}
	}

	// Keep copies of the DLQ to simulate a replay that crashed before
	// acking its DLQ copies.
	copies := e.broker.Messages(memDLQ)

	e.broken.Store(false)
	res := e.replay(nil)
	if res.Applied != 20 || res.Skipped != 0 || res.FailedAgain != 0 || res.Scanned != 20 || res.Unsettled != 0 {
		t.Fatalf("replay: %+v", res)
	}
	if rows, distinct := e.effectCount(); rows != 20 || distinct != 20 {
		t.Fatalf("effects rows=%d distinct=%d, want 20/20", rows, distinct)
	}
	if !memory.Drained(e.broker.Stats(memDLQ)) {
		t.Fatalf("DLQ not drained: %+v", e.broker.Stats(memDLQ))
	}

	// Replay again: everything is already applied.
	if err := e.broker.Publish(context.Background(), memDLQ, copies...); err != nil {
		t.Fatal(err)
	}
	res = e.replay(nil)
	if res.Applied != 0 || res.Skipped != 20 {
		t.Fatalf("second replay: %+v", res)
	}
	if rows, _ := e.effectCount(); rows != 20 {
		t.Fatalf("second replay added effects: %d rows", rows)
	}
}

func TestReplayStillFailingReturnsWithHistory(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	e.broken.Store(true)
	e.publish(3)
	e.consume()
	res := e.replay(nil) // still broken
	if res.FailedAgain != 3 || res.Applied != 0 {
		t.Fatalf("replay: %+v", res)
	}
	dl := e.broker.Messages(memDLQ)
	if len(dl) != 3 {
		t.Fatalf("DLQ holds %d, want 3", len(dl))
	}
	for _, m := range dl {
		r, err := dlq.Parse(m)
		if err != nil {
			t.Fatal(err)
		}
		if r.DeadLetters != 2 || len(r.History) != 1 || r.History[0].Class != consumer.ClassPermanent || r.Source != memQueue {
			t.Fatalf("history not grown: %+v", r)
		}
	}
}

func TestReplayFilterLimitAndScope(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	e.broken.Store(true)
	e.publish(10)
	e.consume()
	// A dead letter of another consumer sharing the DLQ.
	other := dlq.Envelope(&consumer.Message{ID: "x-1", Body: []byte("x"), Source: "x"},
		consumer.Failure{Consumer: "shipping", MessageID: "x-1", Class: consumer.ClassPermanent, Err: errors.New("no")}, dlq.Options{})
	if err := e.broker.Publish(context.Background(), memDLQ, other); err != nil {
		t.Fatal(err)
	}
	e.broken.Store(false)

	res := e.replay(func(c *dlq.ReplayConfig) { c.Filter.MessageIDs = []string{"o-001", "o-002", "o-003"} })
	if res.Applied != 3 || res.Matched != 3 || res.Scanned != 11 {
		t.Fatalf("id filter: %+v", res)
	}
	res = e.replay(func(c *dlq.ReplayConfig) { c.Limit = 2 })
	if res.Applied != 2 {
		t.Fatalf("limit: %+v", res)
	}
	res = e.replay(func(c *dlq.ReplayConfig) { c.Filter.Classes = []consumer.FailureClass{consumer.ClassTimeout} })
	if res.Matched != 0 {
		t.Fatalf("class filter matched %+v", res)
	}
	res = e.replay(nil)
	if res.Applied != 5 {
		t.Fatalf("rest: %+v", res)
	}
	// Only the other consumer's message is left.
	left := e.broker.Messages(memDLQ)
	if len(left) != 1 || left[0].Header("x-idemq-consumer") != "shipping" {
		t.Fatalf("left in DLQ: %d messages", len(left))
	}
	if rows, distinct := e.effectCount(); rows != 10 || distinct != 10 {
		t.Fatalf("effects %d/%d", rows, distinct)
	}
}

func TestReplayRateLimit(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	e.broken.Store(true)
	e.publish(6)
	e.consume()
	e.broken.Store(false)
	start := time.Now()
	res := e.replay(func(c *dlq.ReplayConfig) { c.Rate = 20 })
	if res.Applied != 6 {
		t.Fatalf("replay: %+v", res)
	}
	// 6 messages at 20/s: the last waits 5 intervals of 50ms.
	if el := time.Since(start); el < 250*time.Millisecond {
		t.Fatalf("6 messages at 20/s took %s", el)
	}
}

func TestReplayHorizonGuard(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	old := time.Now().Add(-100 * time.Hour)
	var msgs []*consumer.Message
	for i := 0; i < 3; i++ {
		msgs = append(msgs, dlq.Envelope(&consumer.Message{ID: fmt.Sprintf("old-%d", i), Body: []byte("b"), Source: memQueue},
			consumer.Failure{Consumer: "billing", MessageID: fmt.Sprintf("old-%d", i), Class: consumer.ClassPermanent,
				Err: errors.New("x"), FirstFailure: old, LastFailure: old}, dlq.Options{}))
	}
	if err := e.broker.Publish(context.Background(), memDLQ, msgs...); err != nil {
		t.Fatal(err)
	}
	res := e.replay(func(c *dlq.ReplayConfig) { c.Retention = 72 * time.Hour })
	if res.BeyondHorizon != 3 || res.Applied != 0 || e.broker.Ready(memDLQ) != 3 {
		t.Fatalf("guard let messages through: %+v, DLQ %d", res, e.broker.Ready(memDLQ))
	}
	res = e.replay(func(c *dlq.ReplayConfig) { c.Retention = 72 * time.Hour; c.Force = true })
	if res.Applied != 3 || e.broker.Ready(memDLQ) != 0 {
		t.Fatalf("forced replay: %+v", res)
	}
}

func TestClassifyDryRun(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	ctx := context.Background()
	e.failIDs = map[string]bool{"o-000": true, "o-001": true, "o-002": true}
	e.publish(5) // o-003 and o-004 apply
	e.consume()
	// A DLQ copy of a message that was in fact applied (say it failed after
	// commit), one whose id was applied with another payload, and one with
	// no id.
	applied := dlq.Envelope(&consumer.Message{ID: "o-003", Body: []byte(`{"order":3}`), Source: memQueue},
		consumer.Failure{Consumer: "billing", MessageID: "o-003", Class: consumer.ClassTimeout, Err: errors.New("t")}, dlq.Options{})
	mismatch := dlq.Envelope(&consumer.Message{ID: "o-004", Body: []byte(`{"order":"forged"}`), Source: memQueue},
		consumer.Failure{Consumer: "billing", MessageID: "o-004", Class: consumer.ClassTimeout, Err: errors.New("t")}, dlq.Options{})
	noID := dlq.Envelope(&consumer.Message{Body: []byte(`{}`), Source: memQueue},
		consumer.Failure{Consumer: "billing", Class: consumer.ClassMissingID, Err: errors.New("no id")}, dlq.Options{})
	if err := e.broker.Publish(ctx, memDLQ, applied, mismatch, noID); err != nil {
		t.Fatal(err)
	}
	before := e.broker.Messages(memDLQ)

	c, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	if c.WillApply != 3 || c.AlreadyApplied != 1 || c.Mismatch != 1 || c.MissingID != 1 || c.Scanned != 6 {
		t.Fatalf("classification %+v", c)
	}
	after := e.broker.Messages(memDLQ)
	if len(after) != len(before) || e.broker.Unacked(memDLQ) != 0 {
		t.Fatalf("dry run consumed: %d before, %d after", len(before), len(after))
	}
	for i := range before {
		if after[i].ID != before[i].ID {
			t.Fatalf("dry run reordered the DLQ at %d", i)
		}
	}

	// Now the real replay agrees with the dry run.
	e.failIDs = nil
	res := e.replay(nil)
	if res.Applied != 3 || res.Skipped != 1 || res.Mismatched != 1 || res.FailedAgain != 1 {
		t.Fatalf("replay %+v disagrees with dry run %+v", res, c)
	}
	if rows, distinct := e.effectCount(); rows != 5 || distinct != 5 {
		t.Fatalf("effects %d/%d", rows, distinct)
	}
}

func TestInspectGroups(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	e.failIDs = map[string]bool{"o-000": true, "o-001": true, "o-002": true}
	e.publish(4)
	e.consume()
	extra := dlq.Envelope(&consumer.Message{ID: "t-1", Body: []byte("x"), Source: "payments"},
		consumer.Failure{Consumer: "billing", MessageID: "t-1", Class: consumer.ClassTimeout, Err: errors.New("slow")}, dlq.Options{})
	if err := e.broker.Publish(context.Background(), memDLQ, extra); err != nil {
		t.Fatal(err)
	}
	rep, err := dlq.Inspect(context.Background(), e.browser(), dlq.Filter{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Total != 4 || len(rep.Groups) != 2 || rep.Groups[0].Count != 3 || rep.Groups[0].Class != consumer.ClassPermanent ||
		rep.Groups[1].Class != consumer.ClassTimeout || len(rep.Groups[0].Sample) != 3 {
		t.Fatalf("report %+v", rep)
	}
	if e.broker.Ready(memDLQ) != 4 {
		t.Fatalf("inspect consumed messages: %d left", e.broker.Ready(memDLQ))
	}
}

func TestRequeueToOriginalQueue(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	ctx := context.Background()
	e.broken.Store(true)
	e.publish(4)
	e.consume()
	// One of them was applied meanwhile by other means (a DLQ copy of an
	// applied message).
	e.broken.Store(false)
	if err := e.broker.Publish(ctx, memQueue, &consumer.Message{ID: "o-000", Body: []byte(`{"order":0}`)}); err != nil {
		t.Fatal(err)
	}
	e.consume()

	res, err := dlq.Requeue(ctx, dlq.RequeueConfig{
		Browser: e.browser(),
		Store:   e.store,
		Publish: func(ctx context.Context, dest string, m *consumer.Message) error {
			return e.broker.Publish(ctx, dest, m)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Republished != 3 || res.Skipped != 1 || e.broker.Ready(memDLQ) != 0 || e.broker.Ready(memQueue) != 3 {
		t.Fatalf("requeue %+v; dlq=%d queue=%d", res, e.broker.Ready(memDLQ), e.broker.Ready(memQueue))
	}
	if s := e.consume(); s.Applied != 3 {
		t.Fatalf("consumer after requeue: %+v", s)
	}
	if rows, distinct := e.effectCount(); rows != 4 || distinct != 4 {
		t.Fatalf("effects %d/%d", rows, distinct)
	}
}

func TestRequeueKeepsMessageWhenPublishFails(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	e.broken.Store(true)
	e.publish(2)
	e.consume()
	_, err := dlq.Requeue(context.Background(), dlq.RequeueConfig{
		Browser: e.browser(),
		Publish: func(context.Context, string, *consumer.Message) error { return errors.New("broker down") },
	})
	if err == nil {
		t.Fatal("Requeue hid a publish failure")
	}
	if e.broker.Ready(memDLQ) != 2 {
		t.Fatalf("a dead letter was lost: %d left", e.broker.Ready(memDLQ))
	}
}

// TestDeadLetterPublishFailureKeepsOriginalUntilStored: while the
// dead-letter publish fails, the original is held unacked and the copy is
// retried in place (the runtime no longer requeues it behind its key's next
// message); once a publish succeeds the original is acked.
func TestDeadLetterPublishFailureKeepsOriginalUntilStored(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	var fails atomic.Int32
	fails.Store(5)
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		if fails.Add(-1) >= 0 {
			return errors.New("dlq broker unavailable")
		}
		return e.broker.Publish(ctx, memDLQ, m)
	}, dlq.Options{})
	if err != nil {
		t.Fatal(err)
	}
	e.broken.Store(true)
	e.publish(1)
	sub, _ := e.broker.Subscribe(memQueue, memory.SubscribeOptions{})
	cfg := e.config(sub)
	cfg.DeadLetterer = dl
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	deadline := time.Now().Add(20 * time.Second)
	for rt.Stats().DeadLettered == 0 {
		if time.Now().After(deadline) {
			t.Fatal("never dead-lettered")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-done
	s := rt.Stats()
	if s.Requeued != 0 || s.Received != 1 || fails.Load() != -1 || e.broker.Ready(memDLQ) != 1 || !memory.Drained(e.broker.Stats(memQueue)) {
		t.Fatalf("stats %+v, dlq %d, %d publishes after the 5 failures", s, e.broker.Ready(memDLQ), -fails.Load())
	}
}

// A missing-id dead letter keeps having no id through every path, even when
// the broker hands it an id of its own (Kafka's topic/partition/offset
// fallback): it must never be applied under an id no producer gave it.
func TestMissingIDDeadLetterNeverTakesABrokerID(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	ctx := context.Background()
	noID := dlq.Envelope(&consumer.Message{Body: []byte(`{"order":"?"}`), Source: memQueue},
		consumer.Failure{Consumer: "billing", Class: consumer.ClassMissingID, Err: errors.New("message has no id")}, dlq.Options{})
	noID.ID = "orders.dlq/0/17" // what a broker-made fallback id looks like
	if err := e.broker.Publish(ctx, memDLQ, noID); err != nil {
		t.Fatal(err)
	}

	c, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	if c.MissingID != 1 || c.WillApply != 0 {
		t.Fatalf("dry run: %+v, want one missing-id", c)
	}

	res, err := dlq.Requeue(ctx, dlq.RequeueConfig{Browser: e.browser(), Store: e.store,
		Publish: func(ctx context.Context, dest string, m *consumer.Message) error {
			return e.broker.Publish(ctx, dest, m)
		}})
	if err != nil {
		t.Fatal(err)
	}
	if res.MissingID != 1 || res.Republished != 0 || e.broker.Ready(memDLQ) != 1 || e.broker.Ready(memQueue) != 0 {
		t.Fatalf("requeue %+v; dlq=%d queue=%d", res, e.broker.Ready(memDLQ), e.broker.Ready(memQueue))
	}

	r := e.replay(nil)
	if r.Applied != 0 || r.FailedAgain != 1 {
		t.Fatalf("replay %+v: a missing-id dead letter was applied", r)
	}
	if rows, _ := e.effectCount(); rows != 0 {
		t.Fatalf("%d effects from a message without an id", rows)
	}
	back := e.broker.Messages(memDLQ)
	if len(back) != 1 || back[0].Header("x-idemq-error-class") != string(consumer.ClassMissingID) {
		t.Fatalf("dead letter after replay: %+v", back)
	}
}

// dlSource is a live Source with a dead-letterer of its own, as every
// broker's Source has: a consumer.Config that leaves DeadLetterer nil
// dead-letters through it.
type dlSource struct {
	consumer.Source
	dl consumer.DeadLetterer
}

func (s dlSource) DeadLetterer() consumer.DeadLetterer { return s.dl }

// TestReplayDeadLettersThroughTheLiveSources: a replay given the live
// consumer's Config, whose DeadLetterer is left to default to its
// Source's, dead-letters what fails again through that dead-letterer,
// although the replay reads from the browser instead of the Source.
func TestReplayDeadLettersThroughTheLiveSources(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	e.broken.Store(true)
	e.publish(3)
	e.consume()
	res := e.replay(func(c *dlq.ReplayConfig) {
		c.Consumer.Source = dlSource{dl: e.deadLetterer()}
		c.Consumer.DeadLetterer = nil
	})
	if res.FailedAgain != 3 || res.Applied != 0 {
		t.Fatalf("replay: %+v", res)
	}
	if n := len(e.broker.Messages(memDLQ)); n != 3 {
		t.Fatalf("DLQ holds %d, want 3", n)
	}
}

// deadLetterer is the dead-letterer of a subscription to the work queue,
// which writes to memDLQ.
func (e *memEnv) deadLetterer() consumer.DeadLetterer {
	sub, err := e.broker.Subscribe(memQueue, memory.SubscribeOptions{DeadLetter: memDLQ})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = sub.Close() })
	return sub.DeadLetterer()
}
