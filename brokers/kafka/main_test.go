package kafka_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkatest"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/internal/testdb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}

// env is one test's cluster, topic, group and publisher.
type env struct {
	c     *kafkatest.Cluster
	topic string
	group string
	parts int
	pub   *kafka.Publisher
}

func newEnv(t *testing.T, partitions int) *env {
	t.Helper()
	c := kafkatest.Start(t)
	return newEnvOn(t, c, partitions)
}

func newEnvOn(t *testing.T, c *kafkatest.Cluster, partitions int) *env {
	t.Helper()
	e := &env{c: c, topic: kafkatest.Name(t, "t"), group: kafkatest.Name(t, "g"), parts: partitions}
	c.CreateTopic(t, e.topic, partitions)
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: c.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	e.pub = pub
	return e
}

// config is a Source config tuned for fast tests.
func (e *env) config() kafka.Config {
	return kafka.Config{
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
	}
}

// testLogger logs to stderr when IDEMQ_TEST_LOG is set, else discards.
func testLogger() *slog.Logger {
	if os.Getenv("IDEMQ_TEST_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func (e *env) source(t *testing.T, mod ...func(*kafka.Config)) *kafka.Source {
	t.Helper()
	cfg := e.config()
	for _, f := range mod {
		f(&cfg)
	}
	s, err := kafka.NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// publish publishes n messages with ids "<prefix>-<i>", bodies "<prefix>-<i>"
// and keys "k<i mod keys>".
func (e *env) publish(t *testing.T, prefix string, n, keys int) []*consumer.Message {
	t.Helper()
	msgs := make([]*consumer.Message, n)
	for i := range msgs {
		msgs[i] = &consumer.Message{
			ID:        fmt.Sprintf("%s-%04d", prefix, i),
			RecordKey: fmt.Appendf(nil, "k%d", i%keys),
			Body:      fmt.Appendf(nil, "%s-%04d", prefix, i),
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := e.pub.Publish(ctx, e.topic, msgs...); err != nil {
		t.Fatal(err)
	}
	return msgs
}

// committed returns the group's committed offset per partition (-1 where
// none is committed).
func (e *env) committed(t testing.TB) map[int]int64 {
	t.Helper()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(e.c.Addrs()...), Transport: transport}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: e.group, Topics: map[string][]int{e.topic: e.partitions()}})
	if err != nil {
		t.Fatalf("offset fetch: %v", err)
	}
	if resp.Error != nil {
		t.Fatalf("offset fetch: %v", resp.Error)
	}
	out := map[int]int64{}
	for _, p := range resp.Topics[e.topic] {
		if p.Error != nil {
			t.Fatalf("offset fetch partition %d: %v", p.Partition, p.Error)
		}
		out[p.Partition] = p.CommittedOffset
	}
	return out
}

func (e *env) partitions() []int {
	ps := make([]int, e.parts)
	for i := range ps {
		ps[i] = i
	}
	return ps
}

// holds polls cond for d and fails t if it ever stops holding: for
// asserting that something does not happen.
func holds(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if !cond() {
			t.Fatalf("%s stopped holding", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// commitLog records, from the broker's side, every OffsetCommit request of
// a group and every generation's assignment (from the leader's SyncGroup).
type commitLog struct {
	mu       sync.Mutex
	assigned map[int32]map[string][]int32 // generation -> member -> partitions
	commits  []commitReq
	// fail, while set, makes the broker answer OffsetCommit requests with
	// an error, without committing.
	fail   atomic.Bool
	failed atomic.Int64
}

type commitReq struct {
	gen     int32
	member  string
	offsets map[int32]int64
	failed  bool // the broker was made to reject it
}

func (e *env) observeCommits(t *testing.T) *commitLog {
	t.Helper()
	l := &commitLog{assigned: map[int32]map[string][]int32{}}
	e.c.ControlKey(int16(kmsg.SyncGroup), func(r kmsg.Request) (kmsg.Response, error, bool) {
		req := r.(*kmsg.SyncGroupRequest)
		if req.Group != e.group || len(req.GroupAssignment) == 0 {
			return nil, nil, false
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		byMember := map[string][]int32{}
		for _, a := range req.GroupAssignment {
			var ma kmsg.ConsumerMemberAssignment
			if err := ma.ReadFrom(a.MemberAssignment); err != nil {
				t.Errorf("parse assignment: %v", err)
				continue
			}
			for _, tp := range ma.Topics {
				if tp.Topic == e.topic {
					byMember[a.MemberID] = append(byMember[a.MemberID], tp.Partitions...)
				}
			}
		}
		l.assigned[req.Generation] = byMember
		return nil, nil, false
	})
	e.c.ControlKey(int16(kmsg.OffsetCommit), func(r kmsg.Request) (kmsg.Response, error, bool) {
		req := r.(*kmsg.OffsetCommitRequest)
		if req.Group != e.group {
			return nil, nil, false
		}
		offs := map[int32]int64{}
		for _, tp := range req.Topics {
			for _, p := range tp.Partitions {
				offs[p.Partition] = p.Offset
			}
		}
		fail := l.fail.Load()
		l.mu.Lock()
		l.commits = append(l.commits, commitReq{gen: req.Generation, member: req.MemberID, offsets: offs, failed: fail})
		l.mu.Unlock()
		if !fail {
			return nil, nil, false
		}
		l.failed.Add(1)
		e.c.KeepControl()
		return kafkatest.OffsetCommitError(req, kerr.RequestTimedOut.Code), nil, true
	})
	return l
}

// check asserts that every commit was made by a member for a partition
// assigned to it in that generation, and that no partition's committed
// offset ever went backwards.
func (l *commitLog) check(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	last := map[int32]int64{}
	for _, c := range l.commits {
		owned := l.assigned[c.gen][c.member]
		for p, off := range c.offsets {
			if !slices.Contains(owned, p) {
				t.Errorf("member %s committed partition %d (offset %d) in generation %d, where it owned %v", c.member, p, off, c.gen, owned)
			}
			if c.failed {
				continue
			}
			if off < last[p] {
				t.Errorf("partition %d: committed offset went back from %d to %d", p, last[p], off)
			}
			last[p] = max(last[p], off)
		}
	}
}

// committedOffsets returns each commit request's offset for partition p, in
// order.
func (l *commitLog) committedOffsets(p int32) []int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []int64
	for _, c := range l.commits {
		if off, ok := c.offsets[p]; ok && !c.failed {
			out = append(out, off)
		}
	}
	return out
}

func (l *commitLog) generations() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.assigned)
}
