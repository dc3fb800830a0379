package rabbitmq

import (
	"maps"
	"math"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/wire"
)

// FuzzHeaderString renders every AMQP field-table value type, nested
// tables and arrays included: it never panics, and strings, byte slices and
// integers come out exactly.
func FuzzHeaderString(f *testing.F) {
	f.Add("id-1", []byte("raw"), int64(-42), 3.5, true, uint8(0))
	f.Add("\x00\xff\r\n", []byte(nil), int64(math.MinInt64), math.NaN(), false, uint8(7))
	f.Add("", []byte{0xff}, int64(math.MaxInt64), math.Inf(-1), true, uint8(13))
	f.Fuzz(func(t *testing.T, s string, b []byte, i int64, fl float64, bo bool, kind uint8) {
		values := []any{
			nil, s, b, bo, int8(i), int16(i), int32(i), i, int(i), uint8(i), uint16(i), uint32(i), uint64(i),
			float32(fl), fl, time.Unix(i%(1<<35), 0),
			amqp.Decimal{Scale: uint8(i), Value: int32(i)},
			amqp.Table{s: b, "n": amqp.Table{"deep": []any{s, i, nil}}},
			[]any{s, b, amqp.Table{s: s}},
		}
		v := values[int(kind)%len(values)]
		got := headerString(v)
		switch v := v.(type) {
		case string:
			if got != v {
				t.Fatalf("headerString(%q) = %q", v, got)
			}
		case []byte:
			if got != string(v) {
				t.Fatalf("headerString(%q) = %q", v, got)
			}
		case int64:
			if got != strconv.FormatInt(v, 10) {
				t.Fatalf("headerString(%d) = %q", v, got)
			}
		case nil:
			if got != "" {
				t.Fatalf("headerString(nil) = %q", got)
			}
		}
	})
}

// FuzzMessageRoundTrip: a message the Publisher sends is read back by the
// Source's mapping with the same id, key, body and headers. The id travels
// in the message_id property, and may travel in a header too (an id over
// 255 bytes, which the property cannot hold, only in a header, which the
// runtime's Config.MessageID reads). A header value the broker sends as
// another type is stringified.
func FuzzMessageRoundTrip(f *testing.F) {
	f.Add("id-1", "k", []byte("body"), "h", "v", "x-idemq-history", "[", false)
	f.Add("", "", []byte(nil), "Idempotency-Key", "from-header", "", "", true)
	f.Add("\x00\xff", "\r\n", []byte{0}, "\x1b", "\x00", "x-idemq-key", "other", true)
	f.Fuzz(func(t *testing.T, id, key string, body []byte, k1, v1, k2, v2 string, idInHeader bool) {
		const keyHeader, idHeader = wire.KeyHeader, "Idempotency-Key"
		in := &consumer.Message{ID: id, Key: key, Body: body, Headers: map[string]string{k1: v1, k2: v2}}
		if idInHeader {
			in.Headers[idHeader] = id
		}
		pub := publishing(in)
		if err := pub.Headers.Validate(); err != nil {
			t.Fatalf("the publisher made an invalid table: %v", err)
		}
		m := mapper{queue: "q"}
		d := amqp.Delivery{Headers: pub.Headers, MessageId: pub.MessageId, Body: pub.Body, DeliveryTag: 9}
		out := m.message(d)

		want := maps.Clone(in.Headers)
		if key != "" {
			want[keyHeader] = key
		}
		if !maps.Equal(out.Headers, want) {
			t.Fatalf("headers %q, want %q", out.Headers, want)
		}
		wantKey := want[keyHeader]
		wantID := id
		if len(id) > 255 {
			// Too long for the message_id property: published without
			// it (long ids belong in a header).
			wantID = ""
		}
		// An id also in a header stays there, for the runtime's
		// Config.MessageID to read.
		if got, _ := consumer.IDFromHeader(idHeader)(out); idInHeader && got != id {
			t.Fatalf("id header read back %q, want %q", got, id)
		}
		if out.ID != wantID || out.Key != wantKey || string(out.Body) != string(body) ||
			out.Source != "q" || out.Partition != -1 || out.Offset != -1 || out.Metadata[MetaDeliveryTag] != "9" {
			t.Fatalf("read back %+v from %+v", out, in)
		}
	})
}
