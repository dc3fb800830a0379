package dlq_test

// The issue-5 DLQ tests on Kafka (franz-go's kfake, over real TCP) and a
// real Postgres. Every helper here starts with "kaf" and every test with
// "TestKaf": the other files of this package belong to other tests.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

const kafConsumerName = "kaf-ledger"

var _ dlq.Browser = (*kafka.Browser)(nil)

// kafEnv is a consumer group on a Kafka topic with a dead-letter topic, a
// dedup store and an effects table without a unique constraint, so that a
// double apply shows as two rows.
type kafEnv struct {
	t        *testing.T
	ctx      context.Context
	c        *kafkatest.Cluster
	topic    string // the work topic, kafParts partitions
	dlqTopic string // the dead-letter topic, kafParts partitions
	group    string // the live consumer's group
	pool     *pgxpool.Pool
	store    *processed.Store
	sharded  *processed.Sharded // if set, the consumers' store instead of store
	// orderingKey is the consumers' Config.OrderingKey.
	orderingKey func(*consumer.Message) string
	effects     string
	pub         *kafka.Publisher
	dl          consumer.DeadLetterer
	host        string

	broken  atomic.Bool // the handler bug: every message fails
	mu      sync.Mutex
	failIDs map[string]bool     // ids that keep failing after the fix
	seen    map[string][2]int64 // id -> partition and offset the handler saw
}

const kafParts = 2

func kafNewEnv(t *testing.T) *kafEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	c := kafkatest.Start(t)
	e := &kafEnv{t: t, ctx: ctx, c: c, topic: kafkatest.Name(t, "orders"), group: kafkatest.Name(t, "g"),
		failIDs: map[string]bool{}, seen: map[string][2]int64{}}
	e.dlqTopic = e.topic + ".dlq"
	c.CreateTopic(t, e.topic, kafParts)
	c.CreateTopic(t, e.dlqTopic, kafParts)

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
	e.pub = e.publisher(kafka.PublisherConfig{})
	e.dl = e.deadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return e.pub.Publish(ctx, e.dlqTopic, m)
	})
	e.host, _ = os.Hostname()
	return e
}

func (e *kafEnv) publisher(cfg kafka.PublisherConfig) *kafka.Publisher {
	e.t.Helper()
	cfg.Brokers = e.c.Addrs()
	pub, err := kafka.NewPublisher(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		if err := pub.Close(); err != nil {
			e.t.Errorf("close publisher: %v", err)
		}
	})
	return pub
}

func (e *kafEnv) deadLetterer(publish func(context.Context, *consumer.Message) error) consumer.DeadLetterer {
	e.t.Helper()
	dl, err := dlq.NewDeadLetterer(publish, dlq.Options{})
	if err != nil {
		e.t.Fatal(err)
	}
	return dl
}

func (e *kafEnv) setFailing(ids ...string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, id := range ids {
		e.failIDs[id] = true
	}
}

func (e *kafEnv) handler(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	e.mu.Lock()
	fail := e.failIDs[m.ID]
	e.seen[m.ID] = [2]int64{int64(m.Partition), m.Offset}
	e.mu.Unlock()
	if e.broken.Load() || fail {
		return errors.New("handler bug: nil fee schedule")
	}
	_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (message_id, body) VALUES ($1, $2)", m.ID, string(m.Body))
	return err
}

// config is the live consumer's configuration: two attempts, then the DLQ.
func (e *kafEnv) config(src consumer.Source) consumer.Config {
	cfg := consumer.Config{
		Name: kafConsumerName, Source: src, Store: e.store, Handler: e.handler,
		DeadLetterer: e.dl, Concurrency: 4, ShutdownTimeout: 10 * time.Second,
		Retry: consumer.RetryConfig{MaxAttempts: 2, InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
	}
	if e.sharded != nil {
		cfg.Store = e.sharded
	}
	cfg.OrderingKey = e.orderingKey
	return cfg
}

// kafMessages makes n messages with ids "<prefix>-<i>" over a few record
// keys, so that they spread over the partitions.
func kafMessages(prefix string, n int) []*consumer.Message {
	msgs := make([]*consumer.Message, n)
	for i := range msgs {
		msgs[i] = &consumer.Message{
			ID:      fmt.Sprintf("%s-%03d", prefix, i),
			Key:     fmt.Sprintf("customer-%d", i%5),
			Body:    fmt.Appendf(nil, `{"order":"%s-%03d","cents":%d}`, prefix, i, 100+i),
			Headers: map[string]string{"content-type": "application/json"},
		}
	}
	return msgs
}

func (e *kafEnv) publish(topic string, msgs ...*consumer.Message) {
	e.t.Helper()
	if err := e.pub.Publish(e.ctx, topic, msgs...); err != nil {
		e.t.Fatalf("publish to %s: %v", topic, err)
	}
}

// run runs a runtime with cfg until done(stats) holds, then stops it and
// returns its final stats.
func (e *kafEnv) run(cfg consumer.Config, done func(consumer.Stats) bool) consumer.Stats {
	e.t.Helper()
	rt, err := consumer.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- rt.Run(ctx) }()
	deadline := time.Now().Add(40 * time.Second)
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

// source is a live consumer of the work topic in e.group, tuned for fast
// tests.
func (e *kafEnv) source() *kafka.Source {
	e.t.Helper()
	src, err := kafka.NewSource(kafka.Config{
		Brokers:           e.c.Addrs(),
		Topic:             e.topic,
		GroupID:           e.group,
		CommitInterval:    50 * time.Millisecond,
		SessionTimeout:    3 * time.Second,
		HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout:  5 * time.Second,
		DrainTimeout:      time.Second,
		JoinGroupBackoff:  100 * time.Millisecond,
		FetchMaxWait:      100 * time.Millisecond,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = src.Close() }) // the runtime closes it first
	return src
}

// consume runs the live consumer until n deliveries settled, and checks
// that its group then committed every offset of the work topic.
func (e *kafEnv) consume(n int) consumer.Stats {
	e.t.Helper()
	s := e.run(e.config(e.source()), func(s consumer.Stats) bool {
		return s.Applied+s.Duplicates+s.DeadLettered >= int64(n) && s.InFlight == 0
	})
	if got, want := e.committed(e.group, e.topic), e.highWatermarks(e.topic); !kafCaughtUp(got, want) {
		e.t.Fatalf("live group committed %v, want the high watermarks %v", got, want)
	}
	return s
}

// kafCaughtUp reports whether committed offsets reach the high watermarks
// (a partition without records needs no commit).
func kafCaughtUp(committed, high map[int]int64) bool {
	if len(committed) != len(high) {
		return false
	}
	for p, hw := range high {
		if max(committed[p], 0) != hw {
			return false
		}
	}
	return true
}

func (e *kafEnv) client() (*kafkago.Client, func()) {
	transport := &kafkago.Transport{}
	return &kafkago.Client{Addr: kafkago.TCP(e.c.Addrs()...), Transport: transport}, transport.CloseIdleConnections
}

// committed returns group's committed offset of each partition of topic,
// -1 where it has none.
func (e *kafEnv) committed(group, topic string) map[int]int64 {
	e.t.Helper()
	client, done := e.client()
	defer done()
	parts := make([]int, kafParts)
	out := map[int]int64{}
	for i := range parts {
		parts[i] = i
		out[i] = -1
	}
	resp, err := client.OffsetFetch(e.ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: parts}})
	if err != nil {
		e.t.Fatalf("offset fetch: %v", err)
	}
	if errors.Is(resp.Error, kafkago.GroupIdNotFound) {
		return out // the group never committed
	}
	if resp.Error != nil {
		e.t.Fatalf("offset fetch: %v", resp.Error)
	}
	for _, p := range resp.Topics[topic] {
		if p.Error != nil {
			e.t.Fatalf("offset fetch partition %d: %v", p.Partition, p.Error)
		}
		out[p.Partition] = p.CommittedOffset
	}
	return out
}

// highWatermarks returns the next offset of each partition of topic.
func (e *kafEnv) highWatermarks(topic string) map[int]int64 {
	e.t.Helper()
	client, done := e.client()
	defer done()
	var reqs []kafkago.OffsetRequest
	for p := range kafParts {
		reqs = append(reqs, kafkago.LastOffsetOf(p))
	}
	resp, err := client.ListOffsets(e.ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: reqs}})
	if err != nil {
		e.t.Fatal(err)
	}
	out := map[int]int64{}
	for _, p := range resp.Topics[topic] {
		if p.Error != nil {
			e.t.Fatal(p.Error)
		}
		out[p.Partition] = p.LastOffset
	}
	return out
}

func kafSum(m map[int]int64) int64 {
	var n int64
	for _, v := range m {
		n += max(v, 0)
	}
	return n
}

// browser opens a Browser on the DLQ topic; group may be "".
func (e *kafEnv) browser(group string, mod ...func(*kafka.BrowserConfig)) *kafka.Browser {
	e.t.Helper()
	cfg := kafka.BrowserConfig{Brokers: e.c.Addrs(), Topic: e.dlqTopic, GroupID: group, FetchMaxWait: 100 * time.Millisecond}
	for _, f := range mod {
		f(&cfg)
	}
	b, err := kafka.NewBrowser(e.ctx, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = b.Close() }) // idempotent; the dlq functions close it
	return b
}

// replay replays the DLQ through the live consumer's configuration, with a
// browser in group (or none for "").
func (e *kafEnv) replay(group string, mod func(*dlq.ReplayConfig)) dlq.Result {
	e.t.Helper()
	cfg := dlq.ReplayConfig{Browser: e.browser(group), Consumer: e.config(nil)}
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

// dlqContents reads the whole DLQ topic, without a group, and returns its
// records in partition and offset order.
func (e *kafEnv) dlqContents() []*consumer.Message {
	e.t.Helper()
	b := e.browser("")
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
	return out
}

// effectCounts returns how many effect rows each message id has.
func (e *kafEnv) effectCounts() map[string]int {
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
func (e *kafEnv) expectEffects(ids ...string) {
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
// the DLQ topic, all to one partition in order, as if the consumer had
// dead-lettered it with f from partition 0 of the work topic at offsets
// 100, 101 and so on.
func (e *kafEnv) putInDLQ(f consumer.Failure, msgs ...*consumer.Message) {
	e.t.Helper()
	for i, m := range msgs {
		m = m.Clone()
		m.Source, m.Partition, m.Offset, m.RecordKey = e.topic, 0, int64(100+i), []byte("same-partition")
		fl := f
		fl.Consumer, fl.MessageID = kafConsumerName, m.ID
		e.publish(e.dlqTopic, dlq.Envelope(m, fl, dlq.Options{}))
	}
}

func kafIDs(msgs []*consumer.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.ID
	}
	return out
}

func kafSorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// TestKafDeadLetterAndReplay: a handler bug sends N messages to the DLQ
// topic with complete envelopes (the original partition and offset
// included) while the live group commits past them; Inspect groups them
// without consuming; after the fix a replay in a replay group applies each
// exactly once and commits its progress; replaying again, in the same
// group, in a fresh one or with none, applies nothing.
func TestKafDeadLetterAndReplay(t *testing.T) {
	t.Parallel()
	e := kafNewEnv(t)
	const n = 12
	msgs := kafMessages("ord", n)
	e.broken.Store(true)
	start := time.Now()
	e.publish(e.topic, msgs...)
	s := e.consume(n)
	if s.DeadLettered != n || s.Applied != 0 {
		t.Fatalf("with the bug: %+v, want %d dead-lettered", s, n)
	}
	if got := e.effectCounts(); len(got) != 0 {
		t.Fatalf("effects despite the bug: %v", got)
	}

	// Complete metadata on every dead letter; body and headers kept.
	dead := e.dlqContents()
	if got := kafSorted(kafIDs(dead)); !slices.Equal(got, kafIDs(msgs)) {
		t.Fatalf("DLQ holds %v, want %v", got, kafIDs(msgs))
	}
	bodies := map[string]string{}
	for _, m := range msgs {
		bodies[m.ID] = string(m.Body)
	}
	partitions := map[int32]bool{}
	for _, m := range dead {
		r, err := dlq.Parse(m)
		if err != nil {
			t.Fatalf("%s: %v", m.ID, err)
		}
		e.mu.Lock()
		at := e.seen[m.ID]
		e.mu.Unlock()
		partitions[r.Partition] = true
		switch {
		case r.Consumer != kafConsumerName, r.MessageID != m.ID, r.Class != consumer.ClassRetryableExhausted,
			!strings.Contains(r.Error, "handler bug: nil fee schedule"), r.Attempts != 2,
			r.FirstFailure.Before(start.Add(-time.Second)), r.LastFailure.Before(r.FirstFailure), r.LastFailure.After(time.Now()),
			r.Source != e.topic, int64(r.Partition) != at[0], r.Offset != at[1], r.Partition < 0, r.Offset < 0,
			r.Host == "" || r.Host != e.host, r.DeadLetters != 1, len(r.History) != 0:
			t.Errorf("incomplete envelope on %s (seen at %v): %+v", m.ID, at, r)
		}
		if string(m.Body) != bodies[m.ID] || m.Header("content-type") != "application/json" {
			t.Errorf("%s: body or headers changed: %q %v", m.ID, m.Body, m.Headers)
		}
	}
	if len(partitions) != kafParts {
		t.Errorf("dead letters came from partitions %v, want all %d", partitions, kafParts)
	}

	rep, err := dlq.Inspect(e.ctx, e.browser("inspect-group"), dlq.Filter{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Total != n || len(rep.Groups) != 1 || rep.Groups[0].Count != n || rep.Groups[0].Class != consumer.ClassRetryableExhausted ||
		!slices.Equal(rep.Groups[0].Sources, []string{e.topic}) {
		t.Fatalf("inspect: %+v", rep)
	}
	if got := e.committed("inspect-group", e.dlqTopic); kafSum(got) != 0 {
		t.Fatalf("inspect committed %v", got)
	}

	// Fix the handler and replay in a replay group: progress is
	// committed up to the end of the DLQ.
	e.broken.Store(false)
	replayGroup := e.dlqTopic + ".replay"
	res := e.replay(replayGroup, nil)
	if res.Scanned != n || res.Applied != n || res.Skipped != 0 || res.FailedAgain != 0 {
		t.Fatalf("replay: %+v, want %d applied", res, n)
	}
	e.expectEffects(kafIDs(msgs)...)
	if got, want := e.committed(replayGroup, e.dlqTopic), e.highWatermarks(e.dlqTopic); !kafCaughtUp(got, want) {
		t.Fatalf("replay group committed %v, want %v", got, want)
	}

	// The same group has nothing left to read.
	if res := e.replay(replayGroup, nil); res.Scanned != 0 || res.Applied != 0 {
		t.Fatalf("second replay in the same group: %+v", res)
	}
	// The records are still in the log: a fresh group, or none, reads
	// them all again and skips every one as already applied.
	for _, group := range []string{replayGroup + "-fresh", ""} {
		res = e.replay(group, nil)
		if res.Scanned != n || res.Skipped != n || res.Applied != 0 || res.FailedAgain != 0 {
			t.Fatalf("replay again (group %q): %+v, want %d skipped", group, res, n)
		}
	}
	e.expectEffects(kafIDs(msgs)...)
	if got := len(e.dlqContents()); got != n {
		t.Fatalf("DLQ topic holds %d records, want %d: replays of applied messages add nothing", got, n)
	}
}

// TestKafReplaySkipsAppliedCopy: a DLQ copy of a message that was in fact
// applied (it failed after its commit) is skipped on replay, while the
// genuinely failed message next to it applies once.
func TestKafReplaySkipsAppliedCopy(t *testing.T) {
	t.Parallel()
	e := kafNewEnv(t)
	applied := kafMessages("done", 1)[0]
	e.publish(e.topic, applied)
	if s := e.consume(1); s.Applied != 1 {
		t.Fatalf("consume: %+v", s)
	}
	now := time.Now()
	failure := consumer.Failure{Class: consumer.ClassTimeout, Err: errors.New("ack lost after commit"), Attempts: 1, FirstFailure: now, LastFailure: now}
	pending := kafMessages("todo", 1)[0]
	e.putInDLQ(failure, applied, pending)

	res := e.replay("replay", nil)
	if res.Scanned != 2 || res.Skipped != 1 || res.Applied != 1 {
		t.Fatalf("replay: %+v, want 1 skipped and 1 applied", res)
	}
	e.expectEffects(applied.ID, pending.ID)
}

// TestKafFallbackIDReplay: records produced without an idempotency-key get
// the fallback id topic/partition/offset. Their dead-letter copies live at
// other coordinates of another topic, and here are even written without the
// id header, so the DLQ browser gives them no id at all: the replay
// still dedupes on the original id, carried by the envelope's
// x-idemq-message-id. An applied one is skipped, a failed one applies once
// under its original id, and a second replay applies nothing.
func TestKafFallbackIDReplay(t *testing.T) {
	t.Parallel()
	e := kafNewEnv(t)
	// The DLQ publisher drops the id: the DLQ records have no
	// idempotency-key.
	dlqPub := e.publisher(kafka.PublisherConfig{})
	e.dl = e.deadLetterer(func(ctx context.Context, m *consumer.Message) error {
		m = m.Clone()
		m.ID = ""
		return dlqPub.Publish(ctx, e.dlqTopic, m)
	})
	noID := func(body string) *consumer.Message {
		return &consumer.Message{Key: "k", Body: []byte(body)} // no ID: no header
	}
	e.publish(e.topic, noID(`{"order":"a"}`))
	if s := e.consume(1); s.Applied != 1 {
		t.Fatalf("consume: %+v", s)
	}
	ids := slices.Collect(maps.Keys(e.effectCounts()))
	if len(ids) != 1 || !strings.HasPrefix(ids[0], e.topic+"/") {
		t.Fatalf("applied ids %v, want one fallback id", ids)
	}
	appliedID := ids[0]

	e.broken.Store(true)
	e.publish(e.topic, noID(`{"order":"b"}`))
	if s := e.consume(1); s.DeadLettered != 1 {
		t.Fatalf("consume with the bug: %+v", s)
	}
	e.broken.Store(false)
	// A copy of the applied one too, as if it had failed after its commit.
	var part int
	var off int64
	if _, err := fmt.Sscanf(strings.TrimPrefix(appliedID, e.topic+"/"), "%d/%d", &part, &off); err != nil {
		t.Fatal(err)
	}
	copyMsg := noID(`{"order":"a"}`)
	copyMsg.ID, copyMsg.Source, copyMsg.Partition, copyMsg.Offset = appliedID, e.topic, int32(part), off
	now := time.Now()
	if err := e.dl.DeadLetter(e.ctx, copyMsg, consumer.Failure{Consumer: kafConsumerName, MessageID: appliedID,
		Class: consumer.ClassTimeout, Err: errors.New("ack lost"), Attempts: 1, FirstFailure: now, LastFailure: now}); err != nil {
		t.Fatal(err)
	}

	dead := e.dlqContents()
	if len(dead) != 2 {
		t.Fatalf("DLQ holds %d records", len(dead))
	}
	var failedID string
	for _, m := range dead {
		r, err := dlq.Parse(m)
		if err != nil {
			t.Fatal(err)
		}
		if m.ID != "" || m.Header("idempotency-key") != "" {
			t.Fatalf("DLQ record id %q: want none (the Browser gives no fallback id)", m.ID)
		}
		if want := fmt.Sprintf("%s/%d/%d", e.topic, r.Partition, r.Offset); r.MessageID != want {
			t.Fatalf("envelope id %q, want the original fallback id %q", r.MessageID, want)
		}
		if r.MessageID != appliedID {
			failedID = r.MessageID
		}
	}

	res := e.replay("", nil)
	if res.Scanned != 2 || res.Skipped != 1 || res.Applied != 1 {
		t.Fatalf("replay: %+v, want 1 skipped and 1 applied", res)
	}
	e.expectEffects(appliedID, failedID)
	if _, err := e.store.Lookup(e.ctx, kafConsumerName, failedID); err != nil {
		t.Fatalf("dedup row of %s: %v", failedID, err)
	}
	res = e.replay("", nil)
	if res.Scanned != 2 || res.Skipped != 2 || res.Applied != 0 {
		t.Fatalf("second replay: %+v, want 2 skipped", res)
	}
	e.expectEffects(appliedID, failedID)
}

// TestKafStillFailingReturnsWithHistory: a message that still fails goes
// back to the DLQ topic with its history grown and its dead-letter count
// incremented, keeping its original source, partition and offset; it is
// not read again in the same pass, and the replay group's next pass reads
// only it.
func TestKafStillFailingReturnsWithHistory(t *testing.T) {
	t.Parallel()
	e := kafNewEnv(t)
	msgs := kafMessages("hist", 4)
	poison := msgs[2].ID
	e.broken.Store(true)
	e.publish(e.topic, msgs...)
	e.consume(len(msgs))
	e.mu.Lock()
	origin := e.seen[poison]
	e.mu.Unlock()

	e.broken.Store(false)
	e.setFailing(poison)
	group := "replay"
	for round := 2; round <= 3; round++ {
		res := e.replay(group, nil)
		wantScanned, wantApplied := int64(len(msgs)), int64(len(msgs)-1)
		if round == 3 {
			wantScanned, wantApplied = 1, 0
		}
		if res.Scanned != wantScanned || res.FailedAgain != 1 || res.Applied != wantApplied {
			t.Fatalf("replay %d: %+v", round, res)
		}
		// The log keeps every copy; the newest has the longest history.
		var copies []dlq.Record
		for _, m := range e.dlqContents() {
			if m.ID == poison {
				r, err := dlq.Parse(m)
				if err != nil {
					t.Fatal(err)
				}
				copies = append(copies, r)
			}
		}
		if len(copies) != round {
			t.Fatalf("replay %d: %d copies of %s in the DLQ topic, want %d", round, len(copies), poison, round)
		}
		r := slices.MaxFunc(copies, func(a, b dlq.Record) int { return a.DeadLetters - b.DeadLetters })
		if r.DeadLetters != round || len(r.History) != round-1 {
			t.Fatalf("replay %d: dead letters %d, history %d entries, want %d and %d", round, r.DeadLetters, len(r.History), round, round-1)
		}
		for _, h := range append(r.History, r.Entry) {
			if h.Source != e.topic || int64(h.Partition) != origin[0] || h.Offset != origin[1] || h.MessageID != poison ||
				h.Consumer != kafConsumerName || h.Class != consumer.ClassRetryableExhausted {
				t.Errorf("replay %d: entry %+v, want source %s at %v", round, h, e.topic, origin)
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

// TestKafClassifyDryRun: the dry run classifies already-applied,
// will-apply, fingerprint-mismatch and missing-id records, and consumes
// nothing: its group commits no offset, the DLQ topic is unchanged, and no
// effect or dedup row appears.
func TestKafClassifyDryRun(t *testing.T) {
	t.Parallel()
	e := kafNewEnv(t)
	applied := kafMessages("app", 2)
	e.publish(e.topic, applied...)
	e.consume(len(applied))

	now := time.Now()
	f := consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1, FirstFailure: now, LastFailure: now}
	willApply := kafMessages("new", 3)
	mismatch := applied[1].Clone()
	mismatch.Body = []byte(`{"order":"app-001","cents":999999}`)
	noID := &consumer.Message{Body: []byte(`{"cents":1}`)}
	e.putInDLQ(f, applied[0])
	e.putInDLQ(f, willApply...)
	e.putInDLQ(f, mismatch)
	e.putInDLQ(consumer.Failure{Class: consumer.ClassMissingID, Err: errors.New("message has no id"), FirstFailure: now, LastFailure: now}, noID)
	before := kafIDs(e.dlqContents())
	const total = 6

	// The envelope carries the dedup id; the Browser gives no fallback
	// id, so a record whose envelope has none (class missing-id) stays
	// without one, as it was for the live consumer.
	noFallback := func(*kafka.BrowserConfig) {}
	group := "dry-run"
	c, err := dlq.Classify(e.ctx, dlq.ClassifyConfig{Browser: e.browser(group, noFallback), Store: e.store})
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
		if w := want[it.Record.MessageID]; it.Verdict != w {
			t.Errorf("%q: verdict %s, want %s", it.Record.MessageID, it.Verdict, w)
		}
		if (it.Verdict == dlq.VerdictAlreadyApplied || it.Verdict == dlq.VerdictMismatch) && it.AppliedAt.IsZero() {
			t.Errorf("%q: no applied-at time", it.Record.MessageID)
		}
	}
	if got := e.committed(group, e.dlqTopic); kafSum(got) != 0 {
		t.Fatalf("the dry run committed %v", got)
	}
	if after := kafIDs(e.dlqContents()); !slices.Equal(after, before) {
		t.Fatalf("the dry run changed the DLQ: %v, was %v", after, before)
	}
	e.expectEffects(kafIDs(applied)...)
	st, err := e.store.Stats(e.ctx, kafConsumerName)
	if err != nil {
		t.Fatal(err)
	}
	if st.Rows != int64(len(applied)) {
		t.Fatalf("dedup rows %d after a dry run, want %d", st.Rows, len(applied))
	}
	// The same group then reads everything: the dry run moved nothing.
	if res := e.replay(group, func(c *dlq.ReplayConfig) { c.Filter.Classes = []consumer.FailureClass{consumer.ClassPermanent} }); res.Scanned != total || res.Applied != 3 || res.Skipped != 1 || res.Mismatched != 1 {
		t.Fatalf("replay after the dry run: %+v", res)
	}
}

// TestKafHorizonGuard: dead letters older than the dedup retention window
// are refused without Force and stay unacked, so the replay group commits
// nothing past them; with Force they replay.
func TestKafHorizonGuard(t *testing.T) {
	t.Parallel()
	e := kafNewEnv(t)
	old := time.Now().Add(-72 * time.Hour)
	msgs := kafMessages("old", 3)
	e.putInDLQ(consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1, FirstFailure: old, LastFailure: old.Add(time.Minute)}, msgs...)
	recent := kafMessages("recent", 1)
	e.putInDLQ(consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1, FirstFailure: time.Now(), LastFailure: time.Now()}, recent...)

	c, err := dlq.Classify(e.ctx, dlq.ClassifyConfig{Browser: e.browser(""), Store: e.store, Retention: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if c.BeyondHorizon != len(msgs) || c.WillApply != len(msgs)+1 {
		t.Fatalf("classify: %+v", c)
	}

	group := "replay"
	res := e.replay(group, func(c *dlq.ReplayConfig) { c.Retention = 24 * time.Hour })
	if res.BeyondHorizon != int64(len(msgs)) || res.Matched != 1 || res.Applied != 1 {
		t.Fatalf("replay without Force: %+v", res)
	}
	e.expectEffects(recent[0].ID)
	// The refused records come first in their partition: nothing is
	// committed past them.
	if got := e.committed(group, e.dlqTopic); kafSum(got) != 0 {
		t.Fatalf("committed %v past refused records", got)
	}

	res = e.replay(group, func(c *dlq.ReplayConfig) { c.Retention = 24 * time.Hour; c.Force = true })
	if res.BeyondHorizon != 0 || res.Applied != int64(len(msgs)) || res.Skipped != 1 {
		t.Fatalf("replay with Force: %+v", res)
	}
	e.expectEffects(append(kafIDs(msgs), recent[0].ID)...)
	if got := e.committed(group, e.dlqTopic); kafSum(got) != int64(len(msgs)+1) {
		t.Fatalf("committed %v after the forced replay", got)
	}
}

// TestKafRequeueToOriginalTopic: the replay-to-original-topic mode
// republishes dead letters to their source topic, with their original id;
// with Store set, already-applied ones are not republished. The live group
// then applies each exactly once.
func TestKafRequeueToOriginalTopic(t *testing.T) {
	t.Parallel()
	for _, withStore := range []bool{true, false} {
		t.Run(fmt.Sprintf("store=%v", withStore), func(t *testing.T) {
			t.Parallel()
			e := kafNewEnv(t)
			applied := kafMessages("app", 2)
			e.publish(e.topic, applied...)
			e.consume(len(applied))
			failed := kafMessages("fail", 3)
			e.broken.Store(true)
			e.publish(e.topic, failed...)
			e.consume(len(failed))
			e.broken.Store(false)
			now := time.Now()
			e.putInDLQ(consumer.Failure{Class: consumer.ClassTimeout, Err: errors.New("ack lost"), Attempts: 1, FirstFailure: now, LastFailure: now}, applied...)
			before := kafSum(e.highWatermarks(e.topic))

			group := "requeue"
			cfg := dlq.RequeueConfig{
				Browser: e.browser(group),
				Publish: func(ctx context.Context, dest string, m *consumer.Message) error {
					return e.pub.Publish(ctx, dest, m)
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
			if got := kafSum(e.highWatermarks(e.topic)) - before; got != int64(wantRepub) {
				t.Fatalf("%d records republished to %s, want %d", got, e.topic, wantRepub)
			}
			if got := kafSum(e.committed(group, e.dlqTopic)); got != int64(len(failed)+len(applied)) {
				t.Fatalf("requeue group committed %d offsets, want all %d", got, len(failed)+len(applied))
			}

			s := e.consume(wantRepub)
			if s.Applied != int64(len(failed)) || s.Duplicates != int64(wantRepub-len(failed)) || s.DeadLettered != 0 {
				t.Fatalf("consumer after requeue: %+v", s)
			}
			e.expectEffects(append(kafIDs(applied), kafIDs(failed)...)...)
		})
	}
}

// TestKafDeadLetterPublishFailure: when the broker rejects the writes to
// the DLQ topic, the originals are never acked: the runtime retries the
// copies in place, the live group commits nothing past them, and after a
// restart the group reads them again; once the DLQ topic accepts writes
// every one of them gets there. No dead letter is lost.
func TestKafDeadLetterPublishFailure(t *testing.T) {
	t.Parallel()
	e := kafNewEnv(t)
	msgs := kafMessages("lost", 3)
	e.broken.Store(true)
	e.publish(e.topic, msgs...)

	var reject atomic.Bool
	var rejected atomic.Int64
	reject.Store(true)
	e.c.ControlKey(int16(kmsg.Produce), func(r kmsg.Request) (kmsg.Response, error, bool) {
		req := r.(*kmsg.ProduceRequest)
		if !reject.Load() || !slices.ContainsFunc(req.Topics, func(t kmsg.ProduceRequestTopic) bool { return t.Topic == e.dlqTopic }) {
			return nil, nil, false
		}
		e.c.KeepControl()
		rejected.Add(1)
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, tp := range req.Topics {
			rt := kmsg.NewProduceResponseTopic()
			rt.Topic = tp.Topic
			for _, p := range tp.Partitions {
				rp := kmsg.NewProduceResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.TopicAuthorizationFailed.Code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})

	cfg := e.config(e.source())
	var mu sync.Mutex
	failedTries := map[string]int{} // failed dead-letter writes per id
	cfg.DeadLetterer = consumer.DeadLettererFunc(func(ctx context.Context, m *consumer.Message, f consumer.Failure) error {
		err := e.dl.DeadLetter(ctx, m, f)
		if err != nil {
			mu.Lock()
			failedTries[f.MessageID]++
			mu.Unlock()
		}
		return err
	})
	// A message held in place holds its partition, so the ones behind it
	// may never be tried: wait until one copy was retried, then stop.
	cfg.ShutdownTimeout = time.Second
	s := e.run(cfg, func(consumer.Stats) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, n := range failedTries {
			if n >= 3 {
				return true
			}
		}
		return false
	})
	if s.DeadLettered != 0 || s.Applied != 0 || rejected.Load() == 0 {
		t.Fatalf("stats %+v, %d rejected DLQ writes", s, rejected.Load())
	}
	// Nothing committed past the originals, nothing in the DLQ topic.
	if got := e.committed(e.group, e.topic); kafSum(got) != 0 {
		t.Fatalf("the live group committed %v although no dead letter was stored", got)
	}
	if got := kafSum(e.highWatermarks(e.dlqTopic)); got != 0 {
		t.Fatalf("DLQ topic holds %d records after rejected writes", got)
	}

	// With the DLQ topic writable again, a restarted consumer reads the
	// originals again and every one gets there.
	reject.Store(false)
	s = e.consume(len(msgs))
	if s.DeadLettered != int64(len(msgs)) {
		t.Fatalf("after the DLQ recovered: %+v", s)
	}
	if got := kafSorted(kafIDs(e.dlqContents())); !slices.Equal(got, kafIDs(msgs)) {
		t.Fatalf("DLQ holds %v, want %v", got, kafIDs(msgs))
	}
	if c := e.effectCounts(); len(c) != 0 {
		t.Fatalf("effects: %v", c)
	}
}

// TestKafSignedEnvelopesSurviveTheBroker: signatures made by the dead-letterer
// still verify after the Kafka round trip (record headers), and a replay with
// VerifyKeys applies every signed message.
func TestKafSignedEnvelopesSurviveTheBroker(t *testing.T) {
	t.Parallel()
	e := kafNewEnv(t)
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return e.pub.Publish(ctx, e.dlqTopic, m)
	}, dlq.Options{SigningKey: signKey})
	if err != nil {
		t.Fatal(err)
	}
	e.dl = dl
	const n = 6
	msgs := kafMessages("sig", n)
	e.broken.Store(true)
	e.publish(e.topic, msgs...)
	e.consume(n)
	dead := e.dlqContents()
	if len(dead) != n {
		t.Fatalf("DLQ holds %d, want %d", len(dead), n)
	}
	for _, m := range dead {
		if err := dlq.Verify(m, signKey); err != nil {
			t.Fatalf("%s after the broker: %v (headers %v)", m.ID, err, m.Headers)
		}
	}
	e.broken.Store(false)
	res := e.replay("replay-signed", func(c *dlq.ReplayConfig) { c.VerifyKeys = [][]byte{signKey} })
	if res.Applied != n || res.Unverified != 0 {
		t.Fatalf("replay: %+v", res)
	}
	e.expectEffects(kafIDs(msgs)...)
}
