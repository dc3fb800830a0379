package kafka_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
)

// rawWrite writes records straight through a kafka-go Writer, as an
// application producing to the topic would, partitioned by the Java client's
// murmur2 hash of the record key.
func rawWrite(ctx context.Context, t *testing.T, e *env, topic string, recs ...kafkago.Message) {
	t.Helper()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(e.c.Addrs()...), Balancer: &kafkago.Murmur2Balancer{}, RequiredAcks: kafkago.RequireAll,
		BatchTimeout: time.Millisecond, Transport: transport}
	defer func() { _ = w.Close() }()
	for i := range recs {
		recs[i].Topic = topic
	}
	if err := w.WriteMessages(ctx, recs...); err != nil {
		t.Fatal(err)
	}
}

// rawReadAll reads every record of topic (parts partitions) with plain
// partition readers, until each partition has been quiet for a second.
func rawReadAll(ctx context.Context, t *testing.T, e *env, topic string, parts int) []kafkago.Message {
	t.Helper()
	var out []kafkago.Message
	for p := range parts {
		r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: e.c.Addrs(), Topic: topic, Partition: p, MaxWait: 100 * time.Millisecond})
		for {
			lctx, cancel := context.WithTimeout(ctx, time.Second)
			m, err := r.FetchMessage(lctx)
			cancel()
			if err != nil {
				break
			}
			out = append(out, m)
		}
		_ = r.Close()
	}
	return out
}

func partitionOf(key []byte, parts int) int {
	ps := make([]int, parts)
	for i := range ps {
		ps[i] = i
	}
	return (&kafkago.Murmur2Balancer{}).Balance(kafkago.Message{Key: key}, ps...)
}

// TestEdgeKafkaRecordKeyKeptOnRepublish: a consumed record, republished
// as it was consumed (which is what the Kafka dead-letterer does, through a
// Publisher), keeps its record key and so goes to the partition the key
// hashes to; so does a record read by the Browser (which dlq.Requeue
// republishes). Before the fix the republished record's key was the
// ordering key "topic/partition" (and "dlq-topic/partition" after a second
// hop), which hashes to an arbitrary partition.
func TestEdgeKafkaRecordKeyKeptOnRepublish(t *testing.T) {
	const parts = 4
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, parts)
	dlqTopic := e.topic + ".dlq"
	back := e.topic + ".back"
	e.c.CreateTopic(t, dlqTopic, parts)
	e.c.CreateTopic(t, back, parts)
	keys := []string{"customer-42", "customer-7", "customer-1001"}
	var recs []kafkago.Message
	for _, k := range keys {
		recs = append(recs, kafkago.Message{Key: []byte(k), Value: []byte("order of " + k)})
	}
	rawWrite(ctx, t, e, e.topic, recs...)

	// Hop 1: consume with the Source and republish as consumed.
	s := e.source(t)
	for range keys {
		d := receive(ctx, t, s)
		if err := e.pub.Publish(ctx, dlqTopic, d.Message()); err != nil {
			t.Fatal(err)
		}
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// Hop 2: browse the copy and republish it as browsed.
	b, err := kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: e.c.Addrs(), Topic: dlqTopic, FetchMaxWait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.Close() }()
	for range keys {
		d, err := b.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.pub.Publish(ctx, back, d.Message()); err != nil {
			t.Fatal(err)
		}
	}

	for _, topic := range []string{dlqTopic, back} {
		got := rawReadAll(ctx, t, e, topic, parts)
		if len(got) != len(keys) {
			t.Fatalf("%s: %d records, want %d", topic, len(got), len(keys))
		}
		for _, m := range got {
			want := "order of " + string(m.Key)
			if string(m.Value) != want {
				t.Errorf("%s: record %q republished with key %q, want the key it was produced with", topic, m.Value, m.Key)
				continue
			}
			if p := partitionOf(m.Key, parts); m.Partition != p {
				t.Errorf("%s: key %q on partition %d, want %d (its hash)", topic, m.Key, m.Partition, p)
			}
		}
	}
}

// TestMessageRecordKey: the Source and the Browser fill RecordKey with the
// record key (nil for a null key) and keep Key the ordering key; the
// Publisher writes RecordKey, never Key, as the record key.
func TestMessageRecordKey(t *testing.T) {
	ctx := testCtx(t, 40*time.Second)
	e := newEnv(t, 1)
	rawWrite(ctx, t, e, e.topic,
		kafkago.Message{Key: []byte("customer-42"), Value: []byte("keyed")},
		kafkago.Message{Key: nil, Value: []byte("null key")},
	)
	if err := e.pub.Publish(ctx, e.topic,
		&consumer.Message{ID: "p-1", Key: "some/ordering-key", RecordKey: []byte("customer-9"), Body: []byte("published keyed")},
		&consumer.Message{ID: "p-2", Key: "some/ordering-key", Body: []byte("published without record key")},
	); err != nil {
		t.Fatal(err)
	}
	want := map[string][]byte{
		"keyed":                        []byte("customer-42"),
		"null key":                     nil,
		"published keyed":              []byte("customer-9"),
		"published without record key": nil,
	}
	check := func(what string, m *consumer.Message) {
		t.Helper()
		w, ok := want[string(m.Body)]
		if !ok {
			t.Fatalf("%s: unexpected record %q", what, m.Body)
		}
		if !bytes.Equal(m.RecordKey, w) || (w == nil) != (m.RecordKey == nil) {
			t.Errorf("%s: %q: RecordKey %q (nil %v), want %q (nil %v)", what, m.Body, m.RecordKey, m.RecordKey == nil, w, w == nil)
		}
		if m.Key != e.topic+"/0" {
			t.Errorf("%s: %q: Key %q, want the ordering key %q", what, m.Body, m.Key, e.topic+"/0")
		}
	}
	s := e.source(t)
	for range want {
		d := receive(ctx, t, s)
		check("source", d.Message())
		_ = d.Ack(ctx)
	}
	b, err := kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: e.c.Addrs(), Topic: e.topic, FetchMaxWait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.Close() }()
	for range want {
		d, err := b.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		check("browser", d.Message())
	}
}
