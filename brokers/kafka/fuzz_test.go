package kafka

import (
	"bytes"
	"errors"
	"maps"
	"strconv"
	"strings"
	"testing"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkamsg"
)

// FuzzRecordMapping maps arbitrary records, headers included (duplicate
// names, empty names and values, any bytes), to messages: it never panics,
// the id is the last non-empty id header or else the fallback id (or empty
// with the fallback disabled), and the coordinates are carried over.
func FuzzRecordMapping(f *testing.F) {
	f.Add("orders", 0, int64(0), []byte("k"), "idempotency-key", []byte("id-1"), "x", []byte("y"), "idempotency-key", []byte(""), false)
	f.Add("t", 3, int64(1<<40), []byte(nil), "", []byte(nil), "idempotency-key", []byte("\x00\xff"), "h\r\n", []byte("\x1b"), true)
	f.Add("a.b_c-d", -1, int64(-2), []byte("\xff"), "idempotency-key", []byte(""), "idempotency-key", []byte("second"), "", []byte(""), false)
	f.Fuzz(func(t *testing.T, topic string, partition int, offset int64, key []byte,
		k1 string, v1 []byte, k2 string, v2 []byte, k3 string, v3 []byte, disable bool) {
		mp := kafkamsg.Mapping{NoFallbackID: disable}
		rec := kafkago.Message{Topic: topic, Partition: partition, Offset: offset, Key: key, Value: v1,
			Headers: []kafkago.Header{{Key: k1, Value: v1}, {Key: k2, Value: v2}, {Key: k3, Value: v3}}}
		m := mp.Message(record(rec))

		want := map[string]string{}
		for _, h := range rec.Headers {
			want[h.Key] = string(h.Value) // the last one wins
		}
		if !maps.Equal(m.Headers, want) {
			t.Fatalf("headers %q, want %q", m.Headers, want)
		}
		wantID := want[kafkamsg.IDHeader]
		if wantID == "" && !disable {
			wantID = kafkamsg.FallbackID(topic, partition, offset)
		}
		if m.ID != wantID {
			t.Fatalf("id %q, want %q", m.ID, wantID)
		}
		wantKey := topic + "/" + strconv.Itoa(partition)
		if m.Key != wantKey || m.Source != topic || int(m.Partition) != int(int32(partition)) || m.Offset != offset ||
			string(m.Body) != string(v1) || m.Metadata["kafka.offset"] != strconv.FormatInt(offset, 10) {
			t.Fatalf("message %+v from record %+v", m, rec)
		}
		if (m.RecordKey == nil) != (key == nil) || !bytes.Equal(m.RecordKey, key) {
			t.Fatalf("record key %q (nil %v), want %q (nil %v)", m.RecordKey, m.RecordKey == nil, key, key == nil)
		}
	})
}

// FuzzPublishRoundTrip: what a Publisher writes, a Source reads back as the
// same message: id, headers, key and body.
func FuzzPublishRoundTrip(f *testing.F) {
	f.Add("orders", "id-1", "k", []byte("body"), "h", "v", "idempotency-key", "stale")
	f.Add("t", "", "", []byte(nil), "idempotency-key", "from-header", "", "")
	f.Add("t", "\x00\xff", "\xfe", []byte("\x00"), "\r\n", "\x1b", "x-idemq-history", "[")
	f.Fuzz(func(t *testing.T, topic, id, key string, body []byte, k1, v1, k2, v2 string) {
		if validTopic(topic) != nil {
			return
		}
		p, err := NewPublisher(PublisherConfig{Brokers: []string{"127.0.0.1:1"}})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = p.Close() }()
		in := &consumer.Message{ID: id, Key: "ordering/key", RecordKey: []byte(key), Body: body, Headers: map[string]string{k1: v1, k2: v2}}
		rec := p.record(topic, in)
		rec.Partition, rec.Offset = 1, 7
		out := kafkamsg.Mapping{}.Message(record(rec))

		want := maps.Clone(in.Headers)
		if id != "" {
			want[kafkamsg.IDHeader] = id
		}
		if !maps.Equal(out.Headers, want) {
			t.Fatalf("headers %q, want %q", out.Headers, want)
		}
		wantID := want[kafkamsg.IDHeader]
		if wantID == "" {
			wantID = kafkamsg.FallbackID(topic, 1, 7)
		}
		if out.ID != wantID || string(out.Body) != string(body) || out.Key != topic+"/1" {
			t.Fatalf("read back id %q key %q body %q from id %q key %q body %q", out.ID, out.Key, out.Body, id, key, body)
		}
		if string(rec.Key) != key || rec.Key == nil || !bytes.Equal(out.RecordKey, []byte(key)) {
			t.Fatalf("record key written %q, read back %q, from RecordKey %q (Key %q is the ordering key, never written)", rec.Key, out.RecordKey, key, in.Key)
		}
	})
}

// FuzzFallbackIDUnique: for legal topic names, different records never
// share a fallback id.
func FuzzFallbackIDUnique(f *testing.F) {
	f.Add("a", 1, int64(23), "a1", 2, int64(3))
	f.Add("a.1", 2, int64(3), "a", 12, int64(3))
	f.Fuzz(func(t *testing.T, t1 string, p1 int, o1 int64, t2 string, p2 int, o2 int64) {
		if validTopic(t1) != nil || validTopic(t2) != nil {
			return
		}
		same := t1 == t2 && p1 == p2 && o1 == o2
		if (kafkamsg.FallbackID(t1, p1, o1) == kafkamsg.FallbackID(t2, p2, o2)) != same {
			t.Fatalf("kafkamsg.FallbackID(%q, %d, %d) vs kafkamsg.FallbackID(%q, %d, %d)", t1, p1, o1, t2, p2, o2)
		}
	})
}

// TestTopicValidation: topic names Kafka would refuse are rejected with a
// clear error before any connection, by NewSource and by Publish.
func TestTopicValidation(t *testing.T) {
	bad := []string{"", ".", "..", "orders/dlq", "a b", "a\x00b", "a;b", "ördërs", "a\nb", strings.Repeat("t", 250), "../etc"}
	for _, topic := range bad {
		_, err := NewSource(Config{Brokers: []string{"127.0.0.1:1"}, Topic: topic, GroupID: "g"})
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != "kafka.Topic" {
			t.Errorf("NewSource(topic %q): %v, want a ConfigError on kafka.Topic", topic, err)
		}
	}
	p, err := NewPublisher(PublisherConfig{Brokers: []string{"127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = p.Close() }()
	for _, topic := range bad {
		if err := p.Publish(t.Context(), topic, &consumer.Message{ID: "x"}); err == nil || !strings.Contains(err.Error(), "kafka: publish: topic:") {
			t.Errorf("Publish(topic %q): %v", topic, err)
		}
	}
	for _, topic := range []string{"orders", "orders.dlq", "a_b-c.D9", strings.Repeat("t", 249), "..."} {
		if err := validTopic(topic); err != nil {
			t.Errorf("validTopic(%q): %v", topic, err)
		}
	}
}
