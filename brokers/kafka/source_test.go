package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	kafkago "github.com/segmentio/kafka-go"
)

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func receive(ctx context.Context, t *testing.T, s consumer.Source) consumer.Delivery {
	t.Helper()
	d, err := s.Receive(ctx)
	if err != nil {
		t.Fatalf("receive: %v", err)
	}
	return d
}

// TestMessageFields: a published message arrives with its id, headers and
// record key, keyed for per-partition order, with Kafka coordinates.
func TestMessageFields(t *testing.T) {
	ctx := testCtx(t, 20*time.Second)
	e := newEnv(t, 1)
	ts := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
	in := &consumer.Message{ID: "order-1", RecordKey: []byte("customer-7"), Body: []byte("hello"), Headers: map[string]string{"a": "1", "idempotency-key": "overridden"}, Timestamp: ts}
	if err := e.pub.Publish(ctx, e.topic, in); err != nil {
		t.Fatal(err)
	}
	s := e.source(t)
	d := receive(ctx, t, s)
	m := d.Message()
	if m.ID != "order-1" || string(m.Body) != "hello" || m.Header("a") != "1" || m.Header("idempotency-key") != "order-1" {
		t.Errorf("got id %q body %q headers %v", m.ID, m.Body, m.Headers)
	}
	if want := e.topic + "/0"; m.Key != want {
		t.Errorf("key %q, want %q", m.Key, want)
	}
	if m.Source != e.topic || m.Partition != 0 || m.Offset != 0 || m.Redelivered {
		t.Errorf("coordinates: source %q partition %d offset %d redelivered %v", m.Source, m.Partition, m.Offset, m.Redelivered)
	}
	if !m.Timestamp.Equal(ts) {
		t.Errorf("timestamp %v, want %v", m.Timestamp, ts)
	}
	if m.Metadata["kafka.key"] != "customer-7" || m.Metadata["kafka.group"] != e.group {
		t.Errorf("metadata %v", m.Metadata)
	}
	if err := d.Ack(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestKeyRecord: every record of a partition has the ordering key
// "topic/partition", whatever its record key, which RecordKey keeps byte
// for byte (nil for a null key).
func TestKeyRecord(t *testing.T) {
	ctx := testCtx(t, 20*time.Second)
	e := newEnv(t, 1)
	if err := e.pub.Publish(ctx, e.topic, &consumer.Message{ID: "1", RecordKey: []byte("a"), Body: []byte("x")}, &consumer.Message{ID: "2", Body: []byte("y")}); err != nil {
		t.Fatal(err)
	}
	s := e.source(t)
	for _, want := range []string{"a", ""} {
		d := receive(ctx, t, s)
		if m := d.Message(); m.Key != e.topic+"/0" || string(m.RecordKey) != want || (want == "") != (m.RecordKey == nil) {
			t.Errorf("key %q, record key %q, want %q and %q", m.Key, m.RecordKey, e.topic+"/0", want)
		}
		_ = d.Ack(ctx)
	}
}

// TestFallbackID: a record without the id header gets topic/partition/offset;
// every header reaches Message.Headers, so the runtime's MessageID can read
// the id header without the fallback, or another header.
func TestFallbackID(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 1)
	if err := e.pub.Publish(ctx, e.topic,
		&consumer.Message{Body: []byte("no id")},
		&consumer.Message{Body: []byte("custom"), Headers: map[string]string{"x-id": "custom-1"}},
	); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name    string
		id      func(*consumer.Message) (string, error)
		wantIDs []string
	}{
		{"default", func(m *consumer.Message) (string, error) { return m.ID, nil }, []string{e.topic + "/0/0", e.topic + "/0/1"}},
		{"no fallback", consumer.IDFromHeader("idempotency-key"), []string{"", ""}},
		{"custom header", consumer.IDFromHeader("x-id"), []string{"", "custom-1"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := e.source(t, func(c *kafka.Config) { c.GroupID = e.group + "-" + fmt.Sprint(len(tc.name)) })
			for _, want := range tc.wantIDs {
				d := receive(ctx, t, s)
				if got, _ := tc.id(d.Message()); got != want {
					t.Errorf("offset %d: id %q, want %q", d.Message().Offset, got, want)
				}
			}
			_ = s.Close()
		})
	}
}

// TestContiguousCommit: with offsets acked out of order, the committed
// offset never passes an unacked one.
func TestContiguousCommit(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 1)
	log := e.observeCommits(t)
	e.publish(t, "c", 5, 1)
	s := e.source(t)
	ds := make([]consumer.Delivery, 5)
	for i := range ds {
		ds[i] = receive(ctx, t, s)
		if ds[i].Message().Offset != int64(i) {
			t.Fatalf("delivery %d has offset %d", i, ds[i].Message().Offset)
		}
	}
	ack := func(i int) {
		t.Helper()
		if err := ds[i].Ack(ctx); err != nil {
			t.Fatalf("ack %d: %v", i, err)
		}
	}
	// 2 and 3 first: nothing is committable.
	ack(2)
	ack(3)
	// 0: committable up to 1 only.
	ack(0)
	waitFor(t, 10*time.Second, "commit of offset 1", func() bool { return e.committed(t)[0] == 1 })
	// Let several commit intervals pass: the offset must stay at 1.
	commitsBefore := len(log.committedOffsets(0))
	holds(t, 10*e.config().CommitInterval, "committed offset 1 while offset 1 is unacked", func() bool { return e.committed(t)[0] == 1 })
	if n := len(log.committedOffsets(0)); n != commitsBefore {
		t.Errorf("%d commits while nothing new was committable", n-commitsBefore)
	}
	// 1: now 0-3 are contiguous: commit 4. 4 is still unacked.
	ack(1)
	waitFor(t, 10*time.Second, "commit of offset 4", func() bool { return e.committed(t)[0] == 4 })
	ack(4)
	waitFor(t, 10*time.Second, "commit of offset 5", func() bool { return e.committed(t)[0] == 5 })
	if got, want := log.committedOffsets(0), []int64{1, 4, 5}; !slices.Equal(got, want) {
		t.Errorf("commits for partition 0: %v, want %v", got, want)
	}
	log.check(t)
}

// TestNackRedelivers: Nack, with or without requeue, hands the record out
// again, flagged as redelivered, and keeps its offset uncommitted until it is
// acked.
func TestNackRedelivers(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 1)
	e.publish(t, "n", 2, 1)
	s := e.source(t)
	d := receive(ctx, t, s)
	if d.Message().Offset != 0 {
		t.Fatalf("offset %d", d.Message().Offset)
	}
	for _, requeue := range []bool{true, false} {
		if err := d.Nack(ctx, requeue); err != nil {
			t.Fatal(err)
		}
		if err := d.Nack(ctx, true); !errors.Is(err, consumer.ErrDeliveryStale) {
			t.Errorf("second nack: %v, want ErrDeliveryStale", err)
		}
		d = receive(ctx, t, s)
		if d.Message().Offset != 0 || !d.Message().Redelivered {
			t.Fatalf("after nack(%v): offset %d redelivered %v", requeue, d.Message().Offset, d.Message().Redelivered)
		}
	}
	d2 := receive(ctx, t, s)
	if err := d2.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	// Offset 1 is acked, 0 is not: nothing may be committed.
	holds(t, 10*e.config().CommitInterval, "no commit while offset 0 is unacked", func() bool { return e.committed(t)[0] == -1 })
	if err := d.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "commit of offset 2", func() bool { return e.committed(t)[0] == 2 })
}

// TestCloseCommits: Close commits what was acked, and a new member resumes
// after it, receiving again only what was not acked.
func TestCloseCommits(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 1)
	e.publish(t, "k", 6, 1)
	s := e.source(t, func(c *kafka.Config) { c.CommitInterval = time.Hour })
	for i := range 4 {
		d := receive(ctx, t, s)
		if i < 3 {
			_ = d.Ack(ctx)
		}
	}
	if ids, ok := s.Assigned(); !ok || !slices.Equal(ids, []int{0}) {
		t.Errorf("Assigned() = %v, %v; want [0], true", ids, ok)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if ids, ok := s.Assigned(); ok {
		t.Errorf("Assigned() after Close = %v, true", ids)
	}
	if got := e.committed(t)[0]; got != 3 {
		t.Fatalf("committed %d after Close, want 3", got)
	}
	s2 := e.source(t)
	for want := int64(3); want < 6; want++ {
		d := receive(ctx, t, s2)
		if d.Message().Offset != want {
			t.Fatalf("resumed at offset %d, want %d", d.Message().Offset, want)
		}
		_ = d.Ack(ctx)
	}
}

// TestOffsetCommitFailures: while the broker rejects offset commits the
// source keeps delivering; after a restart it resumes from the last offset
// that was committed, replaying the rest.
func TestOffsetCommitFailures(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 1)
	log := e.observeCommits(t)
	e.publish(t, "f", 20, 1)
	s := e.source(t)
	for range 10 {
		_ = receive(ctx, t, s).Ack(ctx)
	}
	waitFor(t, 10*time.Second, "commit of offset 10", func() bool { return e.committed(t)[0] == 10 })
	log.fail.Store(true)
	for range 10 {
		if err := receive(ctx, t, s).Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "failed commits", func() bool { return log.failed.Load() >= 3 })
	_ = s.Close()
	if got := e.committed(t)[0]; got != 10 {
		t.Fatalf("committed %d, want 10", got)
	}
	log.fail.Store(false)
	s2 := e.source(t)
	for want := int64(10); want < 20; want++ {
		d := receive(ctx, t, s2)
		if d.Message().Offset != want {
			t.Fatalf("restart delivered offset %d, want %d", d.Message().Offset, want)
		}
		_ = d.Ack(ctx)
	}
	waitFor(t, 10*time.Second, "commit of offset 20", func() bool { return e.committed(t)[0] == 20 })
}

// TestRebalance: a second member joins while messages flow, then the first
// leaves. Every message is received, and no member ever commits a partition
// it does not own in that generation.
func TestRebalance(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 6)
	log := e.observeCommits(t)
	const n = 600

	var (
		mu    sync.Mutex
		seen  = map[string]int{}
		per   [2]int
		stale atomic.Int64
	)
	consume := func(i int, s *kafka.Source) func() {
		return func() {
			for {
				d, err := s.Receive(ctx)
				if err != nil {
					if !errors.Is(err, consumer.ErrSourceClosed) {
						t.Errorf("member %d: receive: %v", i, err)
					}
					return
				}
				time.Sleep(time.Millisecond) // keep messages in flight
				if err := d.Ack(ctx); err != nil {
					if !errors.Is(err, consumer.ErrDeliveryStale) && !errors.Is(err, consumer.ErrSourceClosed) {
						t.Errorf("member %d: ack: %v", i, err)
					}
					stale.Add(1)
				}
				mu.Lock()
				seen[string(d.Message().Body)]++
				per[i]++
				mu.Unlock()
			}
		}
	}
	received := func() (distinct, a, b int) {
		mu.Lock()
		defer mu.Unlock()
		return len(seen), per[0], per[1]
	}

	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; i < n; i += 10 {
			msgs := make([]*consumer.Message, 10)
			for j := range msgs {
				msgs[j] = &consumer.Message{ID: fmt.Sprint(i + j), RecordKey: fmt.Append(nil, i+j), Body: fmt.Appendf(nil, "r-%04d", i+j)}
			}
			if err := e.pub.Publish(ctx, e.topic, msgs...); err != nil {
				t.Errorf("publish: %v", err)
				return
			}
			time.Sleep(5 * time.Millisecond) // a steady flow
		}
	})
	a := e.source(t)
	wg.Go(consume(0, a))
	waitFor(t, 20*time.Second, "member A to consume", func() bool { _, x, _ := received(); return x >= 100 })
	b := e.source(t)
	wg.Go(consume(1, b))
	waitFor(t, 20*time.Second, "member B to consume", func() bool { _, _, y := received(); return y >= 1 })
	_ = a.Close()
	waitFor(t, 30*time.Second, "every message", func() bool { d, _, _ := received(); return d == n })
	waitFor(t, 10*time.Second, "B to commit everything", func() bool {
		var sum int64
		for _, off := range e.committed(t) {
			sum += max(off, 0)
		}
		return sum == n
	})
	_ = b.Close()
	wg.Wait()

	_, x, y := received()
	var dups int
	for _, c := range seen {
		dups += c - 1
	}
	t.Logf("A received %d, B %d; %d redelivered; %d stale acks; %d generations", x, y, dups, stale.Load(), log.generations())
	if log.generations() < 3 {
		t.Errorf("saw %d generations, want at least 3 (A, A+B, B)", log.generations())
	}
	log.check(t)
}

// TestAckBatch: AckBatch acks every delivery, and rejects foreign ones.
func TestAckBatch(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 1)
	e.publish(t, "b", 3, 1)
	s := e.source(t)
	ds := []consumer.Delivery{receive(ctx, t, s), receive(ctx, t, s)}
	if err := s.AckBatch(ctx, ds); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "commit of offset 2", func() bool { return e.committed(t)[0] == 2 })
	if err := s.AckBatch(ctx, ds); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("second AckBatch: %v, want ErrDeliveryStale", err)
	}
}

// TestSourceConfig: invalid configs are rejected with ConfigErrors.
func TestSourceConfig(t *testing.T) {
	ok := kafka.Config{Brokers: []string{"127.0.0.1:1"}, Topic: "t", GroupID: "g"}
	cases := map[string]func(*kafka.Config){
		"no brokers":      func(c *kafka.Config) { c.Brokers = nil },
		"empty broker":    func(c *kafka.Config) { c.Brokers = []string{""} },
		"no topic":        func(c *kafka.Config) { c.Topic = "" },
		"no group":        func(c *kafka.Config) { c.GroupID = "" },
		"max in flight":   func(c *kafka.Config) { c.MaxInFlight = -1 },
		"start offset":    func(c *kafka.Config) { c.StartOffset = 5 },
		"heartbeat":       func(c *kafka.Config) { c.HeartbeatInterval = time.Minute },
		"drain":           func(c *kafka.Config) { c.DrainTimeout = time.Hour },
		"commit interval": func(c *kafka.Config) { c.CommitInterval = -time.Second },
	}
	for name, mod := range cases {
		cfg := ok
		mod(&cfg)
		if _, err := kafka.NewSource(cfg); !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("%s: got %v, want ErrInvalidConfig", name, err)
		}
	}
	cfg := ok
	cfg.StartOffset = kafkago.LastOffset
	s, err := kafka.NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	if _, err := kafka.NewPublisher(kafka.PublisherConfig{}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("publisher without brokers: %v", err)
	}
}

// TestPublisherClose: Close is idempotent and Publish after it fails.
func TestPublisherClose(t *testing.T) {
	e := newEnv(t, 1)
	if err := e.pub.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.pub.Close(); err != nil {
		t.Fatal(err)
	}
	err := e.pub.Publish(context.Background(), e.topic, &consumer.Message{Body: []byte("x")})
	if !errors.Is(err, kafka.ErrPublisherClosed) {
		t.Fatalf("publish after close: %v", err)
	}
}
