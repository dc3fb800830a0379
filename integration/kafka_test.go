//go:build integration

package integration

import (
	"context"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkatest"
)

const kafkaPartitions = 3

// kafkaEnv is one test's topic and consumer group on the Kafka service.
type kafkaEnv struct {
	svc     *service
	brokers []string
	topic   string
	group   string
}

func newKafkaEnv(t testing.TB) *kafkaEnv {
	t.Helper()
	svc, brokers := kafkaService(t)
	e := &kafkaEnv{svc: svc, brokers: brokers, topic: uniqueName(t, "idemq"), group: uniqueName(t, "g")}
	err := poll(context.Background(), time.Minute, func(ctx context.Context) error {
		return kafkatest.CreateTopic(ctx, brokers[0], e.topic, kafkaPartitions)
	})
	if err != nil {
		t.Fatalf("create topic: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		transport := &kafkago.Transport{}
		defer transport.CloseIdleConnections()
		c := &kafkago.Client{Addr: kafkago.TCP(brokers[0]), Transport: transport}
		if _, err := c.DeleteTopics(ctx, &kafkago.DeleteTopicsRequest{Topics: []string{e.topic}}); err != nil {
			t.Logf("delete topic %s: %v", e.topic, err)
		}
	})
	return e
}

// publish publishes msgs in calls of at most chunk messages each, so that
// record batches, and hence fetches, stay small.
func (e *kafkaEnv) publish(t testing.TB, chunk int, msgs ...*consumer.Message) {
	t.Helper()
	p, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: e.brokers})
	if err != nil {
		t.Fatalf("publisher: %v", err)
	}
	defer p.Close()
	ctx := testCtx(t, 2*time.Minute)
	for len(msgs) > 0 {
		n := min(chunk, len(msgs))
		if err := p.Publish(ctx, e.topic, msgs[:n]...); err != nil {
			t.Fatalf("publish: %v", err)
		}
		msgs = msgs[n:]
	}
}

// source is a group member tuned for quick joins and commits. The session
// timeout stays above apache/kafka's 6s minimum.
func (e *kafkaEnv) source(t testing.TB, mod func(*kafka.Config)) *kafka.Source {
	t.Helper()
	cfg := kafka.Config{
		Brokers:           e.brokers,
		Topic:             e.topic,
		GroupID:           e.group,
		CommitInterval:    100 * time.Millisecond,
		SessionTimeout:    10 * time.Second,
		HeartbeatInterval: 500 * time.Millisecond,
		RebalanceTimeout:  10 * time.Second,
		DrainTimeout:      2 * time.Second,
		JoinGroupBackoff:  200 * time.Millisecond,
		FetchMaxWait:      200 * time.Millisecond,
	}
	if mod != nil {
		mod(&cfg)
	}
	src, err := kafka.NewSource(cfg)
	if err != nil {
		t.Fatalf("source: %v", err)
	}
	t.Cleanup(func() { _ = src.Close() })
	return src
}

// committedAll reports whether the group's committed offsets reached the
// end of every partition.
func (e *kafkaEnv) committedAll(ctx context.Context) (bool, error) {
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	c := &kafkago.Client{Addr: kafkago.TCP(e.brokers[0]), Transport: transport}
	var reqs []kafkago.OffsetRequest
	parts := make([]int, kafkaPartitions)
	for p := range kafkaPartitions {
		reqs = append(reqs, kafkago.LastOffsetOf(p))
		parts[p] = p
	}
	last, err := c.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{e.topic: reqs}})
	if err != nil {
		return false, err
	}
	committed, err := c.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: e.group, Topics: map[string][]int{e.topic: parts}})
	if err != nil {
		return false, err
	}
	if committed.Error != nil {
		return false, committed.Error
	}
	have := map[int]int64{}
	for _, p := range committed.Topics[e.topic] {
		if p.Error != nil {
			return false, p.Error
		}
		have[p.Partition] = p.CommittedOffset
	}
	for _, p := range last.Topics[e.topic] {
		if p.Error != nil {
			return false, p.Error
		}
		if have[p.Partition] < p.LastOffset {
			return false, nil
		}
	}
	return true, nil
}

// drained reports whether every id was applied, everything received was
// settled, and the group committed every partition to its end.
func (e *kafkaEnv) drained(rt *runtime, ids, published int) func() bool {
	return func() bool {
		st := rt.rt.Stats()
		if st.Applied < int64(ids) || st.Applied+st.Duplicates < int64(published) || st.InFlight != 0 {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ok, err := e.committedAll(ctx)
		return err == nil && ok
	}
}

// TestKafkaExactlyOnce publishes a workload in which some ids appear in two
// records (a producer retry, as far as the consumer can tell) to a Kafka
// container, and checks one effect per id.
func TestKafkaExactlyOnce(t *testing.T) {
	t.Parallel()
	d := newDB(t)
	e := newKafkaEnv(t)
	msgs, ids := workload("kafka", 300, 3)
	e.publish(t, 100, msgs...)
	rt := startRuntime(t, d, e.source(t, nil), nil)
	waitFor(t, 2*time.Minute, "every record applied or skipped and committed", rt, e.drained(rt, len(ids), len(msgs)))
	if err := rt.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	st := rt.rt.Stats()
	if st.Applied != int64(len(ids)) || st.Duplicates != int64(len(msgs)-len(ids)) {
		t.Errorf("stats %+v: want %d applied and %d duplicates", st, len(ids), len(msgs)-len(ids))
	}
	d.assertExactlyOnce(t, ids)
}

// TestFaultKafkaPause freezes the Kafka container mid-stream (docker pause:
// a network stall) for a few seconds, then resumes it. Fetches and commits
// stall and time out; nothing may be lost or applied twice, and the group
// must end up committed to the end of every partition.
func TestFaultKafkaPause(t *testing.T) {
	e := newKafkaEnv(t)
	e.svc.container(t)
	d := newDB(t)
	// Enough records in small batches, fetched a little at a time, that
	// the consumer cannot have everything buffered when the stall begins.
	msgs, ids := workload("kafkapause", 1200, 4)
	e.publish(t, 10, msgs...)
	src := e.source(t, func(c *kafka.Config) { c.FetchMaxBytes = 1024 })
	rt := startRuntime(t, d, src, func(c *consumer.Config) { c.Handler = slowHandler(d, 5*time.Millisecond) })
	waitFor(t, 2*time.Minute, "a quarter of the ids applied", rt, func() bool { return rt.rt.Stats().Applied >= int64(len(ids)/4) })

	before := rt.rt.Stats()
	e.svc.pause(t)
	paused := time.Now()
	waitFor(t, 30*time.Second, "the runtime to stall", rt, func() bool {
		return time.Since(paused) > 5*time.Second && rt.rt.Stats().InFlight == 0 ||
			time.Since(paused) > 8*time.Second
	})
	during := rt.rt.Stats()
	e.svc.unpause(t)
	t.Logf("paused Kafka for %s; stats before %+v, at unpause %+v", time.Since(paused), before, during)

	// Records published after the stall, some repeating earlier ids.
	second, ids2 := workload("kafkapause-b", 100, 0)
	second = append(second, msgs[:50]...)
	e.publish(t, 100, second...)
	all := append(ids, ids2...)

	waitFor(t, 3*time.Minute, "every record applied or skipped and committed after the pause", rt, e.drained(rt, len(all), len(msgs)+len(second)))
	if err := rt.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("final stats %+v", rt.rt.Stats())
	if during.Applied >= int64(len(ids)) {
		t.Errorf("every id was applied during the pause: the stall hit nothing")
	}
	d.assertExactlyOnce(t, all)
}
