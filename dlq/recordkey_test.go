package dlq_test

// Issue 14, item 7: a Kafka record's key survives dead-lettering and
// requeueing. Every helper here starts with "rk" and every test with
// "TestEdgeKafkaRecordKey" or "TestRestore": the other files of this package
// belong to other tests.

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// TestRestoreKeepsRecordKey: Restore keeps the broker's record key byte for
// byte, a null key as nil and an empty one as empty.
func TestRestoreKeepsRecordKey(t *testing.T) {
	for _, key := range [][]byte{nil, {}, []byte("customer-42"), {0, 0xff, 0}} {
		in := &consumer.Message{ID: "dlq/0/7", Key: "orders.dlq/0", RecordKey: key, Body: []byte("x")}
		env := dlq.Envelope(in, consumer.Failure{Consumer: "c", MessageID: "m-1", Class: consumer.ClassPermanent}, dlq.Options{Host: "h"})
		rec, err := dlq.Parse(env)
		if err != nil {
			t.Fatal(err)
		}
		out := rec.Restore(env)
		if (out.RecordKey == nil) != (key == nil) || !bytes.Equal(out.RecordKey, key) {
			t.Errorf("record key %q (nil %v): restored as %q (nil %v)", key, key == nil, out.RecordKey, out.RecordKey == nil)
		}
		if out.ID != "m-1" {
			t.Errorf("id %q, want m-1", out.ID)
		}
		if key != nil && len(key) > 0 {
			out.RecordKey[0] ^= 1
			if bytes.Equal(out.RecordKey, env.RecordKey) {
				t.Errorf("Restore shares RecordKey's bytes with its input")
			}
		}
	}
}

// TestEdgeKafkaRecordKeyKeptThroughDLQAndRequeue: a record produced with
// the key "customer-42" (by a plain kafka-go writer, as an application
// would) is dead-lettered by the runtime through dlq.DeadLetterer and
// kafka.Publisher, then requeued with dlq.Requeue, kafka.Browser and
// kafka.Publisher. The dead-letter record and the requeued record both carry
// the key "customer-42", and the requeued record lands on the partition
// that key hashes to: the original one. Before the fix the dead-letter
// record was keyed "<topic>/<partition>" (the runtime's ordering key) and
// the requeued one "<dlq topic>/<partition>".
func TestEdgeKafkaRecordKeyKeptThroughDLQAndRequeue(t *testing.T) {
	const parts = 4
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	c := kafkatest.Start(t)
	topic := kafkatest.Name(t, "orders")
	dlqTopic := topic + ".dlq"
	c.CreateTopic(t, topic, parts)
	c.CreateTopic(t, dlqTopic, parts)

	keys := [][]byte{[]byte("customer-42"), []byte("customer-7"), nil}
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(c.Addrs()...), Balancer: &kafkago.Murmur2Balancer{}, RequiredAcks: kafkago.RequireAll, BatchTimeout: time.Millisecond, Transport: transport}
	defer func() { _ = w.Close() }()
	for i, k := range keys {
		err := w.WriteMessages(ctx, kafkago.Message{Topic: topic, Key: k, Value: []byte{'v', byte('0' + i)},
			Headers: []kafkago.Header{{Key: "idempotency-key", Value: []byte{'m', byte('0' + i)}}}})
		if err != nil {
			t.Fatal(err)
		}
	}
	original := rkRead(ctx, t, c.Addrs(), topic, parts, len(keys))

	// The live consumer: every message fails permanently, so each is
	// dead-lettered.
	pool := testdb.Pool(t)
	store, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: c.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = pub.Close() }()
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return pub.Publish(ctx, dlqTopic, m)
	}, dlq.Options{})
	if err != nil {
		t.Fatal(err)
	}
	src, err := kafka.NewSource(kafka.Config{
		Brokers: c.Addrs(), Topic: topic, GroupID: kafkatest.Name(t, "g"),
		CommitInterval: 50 * time.Millisecond, SessionTimeout: 3 * time.Second, HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout: 5 * time.Second, DrainTimeout: time.Second, JoinGroupBackoff: 100 * time.Millisecond,
		FetchMaxWait: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = src.Close() }()
	rt, err := consumer.New(consumer.Config{
		Name: "rk", Source: src, Store: store, DeadLetterer: dl, Concurrency: 2,
		Handler: func(context.Context, pgx.Tx, *consumer.Message) error {
			return consumer.Permanent(errors.New("rejected"))
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() { errc <- rt.Run(rctx) }()
	for rt.Stats().DeadLettered < int64(len(keys)) {
		if ctx.Err() != nil {
			t.Fatalf("dead-lettered %d of %d", rt.Stats().DeadLettered, len(keys))
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}
	stop()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}

	dead := rkRead(ctx, t, c.Addrs(), dlqTopic, parts, len(keys))
	for id, o := range original {
		d, ok := dead[id]
		switch {
		case !ok:
			t.Errorf("%s: not dead-lettered", id)
		case !rkSameKey(d.Key, o.Key):
			t.Errorf("%s: produced with key %q, dead-lettered with key %q", id, o.Key, d.Key)
		}
	}

	b, err := kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: c.Addrs(), Topic: dlqTopic, FetchMaxWait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	res, err := dlq.Requeue(ctx, dlq.RequeueConfig{
		Browser: b,
		Publish: func(ctx context.Context, dest string, m *consumer.Message) error { return pub.Publish(ctx, dest, m) },
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Republished != int64(len(keys)) {
		t.Fatalf("requeue: %+v", res)
	}
	all := rkReadAll(ctx, t, c.Addrs(), topic, parts, 2*len(keys))
	for id, o := range original {
		var again []kafkago.Message
		for _, m := range all[id] {
			if m.Offset != o.Offset || m.Partition != o.Partition {
				again = append(again, m)
			}
		}
		if len(again) != 1 {
			t.Errorf("%s: requeued %d times, want once", id, len(again))
			continue
		}
		r := again[0]
		if !rkSameKey(r.Key, o.Key) {
			t.Errorf("%s: produced with key %q, requeued with key %q", id, o.Key, r.Key)
		}
		if o.Key != nil && r.Partition != o.Partition {
			t.Errorf("%s (key %q): produced to partition %d, requeued to partition %d", id, o.Key, o.Partition, r.Partition)
		}
	}
}

// rkSameKey compares record keys, a null key differing from an empty one
// where the client tells them apart.
func rkSameKey(a, b []byte) bool {
	if len(a) == 0 && len(b) == 0 {
		return true
	}
	return bytes.Equal(a, b)
}

// rkRead reads n records of topic and returns them by their id header.
func rkRead(ctx context.Context, t *testing.T, brokers []string, topic string, parts, n int) map[string]kafkago.Message {
	t.Helper()
	out := map[string]kafkago.Message{}
	for id, ms := range rkReadAll(ctx, t, brokers, topic, parts, n) {
		out[id] = ms[0]
	}
	return out
}

// rkReadAll reads n records of topic, every partition from its start, and
// returns them by their id header (x-idemq-message-id for dead letters).
func rkReadAll(ctx context.Context, t *testing.T, brokers []string, topic string, parts, n int) map[string][]kafkago.Message {
	t.Helper()
	out := map[string][]kafkago.Message{}
	got := 0
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for p := range parts {
		r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: brokers, Topic: topic, Partition: p, MaxWait: 100 * time.Millisecond})
		for {
			lctx, lcancel := context.WithTimeout(rctx, time.Second)
			m, err := r.FetchMessage(lctx)
			lcancel()
			if err != nil {
				break // the partition is read
			}
			id := ""
			for _, h := range m.Headers {
				if h.Key == "idempotency-key" || h.Key == "x-idemq-message-id" {
					id = string(h.Value)
				}
			}
			out[id] = append(out[id], m)
			got++
		}
		_ = r.Close()
	}
	if got != n {
		t.Fatalf("read %d records of %s, want %d", got, topic, n)
	}
	return out
}
