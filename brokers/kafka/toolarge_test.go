package kafka_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// TestDeadLetterTooLarge: a record the topic accepts, whose dead letter
// (the envelope's headers added) is refused for its size, by the DLQ
// topic's max.message.bytes or by the client's batch limit, is
// dead-lettered truncated, with its size, SHA-256 and coordinates.
func TestDeadLetterTooLarge(t *testing.T) {
	for _, tc := range []struct {
		name     string
		body     int
		dlqLimit string // the DLQ topic's max.message.bytes; "" for the default
	}{
		{"topic max.message.bytes", 20_000 - 150, "20000"},
		{"client batch limit", 1<<20 - 150, ""}, // kafka-go's Writer.BatchBytes
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t, 60*time.Second)
			e := newEnv(t, 1)
			dlqTopic := kafka.DLQName(e.topic)
			var cfg map[string]string
			if tc.dlqLimit != "" {
				cfg = map[string]string{"max.message.bytes": tc.dlqLimit}
			}
			e.c.CreateTopicConfig(t, dlqTopic, 1, cfg)
			big := &consumer.Message{ID: "big-1", Body: bytes.Repeat([]byte("x"), tc.body)}
			if err := e.pub.Publish(ctx, e.topic, big); err != nil {
				t.Fatalf("the topic refused the original: %v", err)
			}
			src := e.source(t)
			orig := big.Clone()
			orig.Source, orig.Partition, orig.Offset = e.topic, 0, 0
			if err := src.DeadLetterer().DeadLetter(ctx, orig, consumer.Failure{Consumer: "c", MessageID: "big-1",
				Class: consumer.ClassPermanent, Err: errors.New("cannot parse")}); err != nil {
				t.Fatalf("DeadLetter: %v", err)
			}
			m := readDeadLetters(ctx, t, e, dlqTopic, 1)["big-1"]
			if m == nil {
				t.Fatal("no dead letter")
			}
			r, err := dlq.Parse(m)
			if err != nil {
				t.Fatal(err)
			}
			sum := sha256.Sum256(big.Body)
			if r.Truncated != "body" || r.OriginalSize != int64(tc.body) || r.OriginalSHA256 != hex.EncodeToString(sum[:]) ||
				len(m.Body) != 1024 || r.Source != e.topic || r.Partition != 0 || r.Offset != 0 { // 1024: the default dlq.Options.PreviewBytes
				t.Fatalf("dead letter %+v with a %d-byte body: want it truncated, from %s/0/0", r, len(m.Body), e.topic)
			}
		})
	}
}

// TestTooLargeErrors: every form in which kafka-go reports a record too
// large is recognised, and nothing else is.
func TestTooLargeErrors(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{kafkago.MessageTooLargeError{Message: kafkago.Message{Value: []byte("x")}}, true},
		{kafkago.MessageSizeTooLarge, true},
		{fmt.Errorf("write: %w", kafkago.MessageSizeTooLarge), true},
		{kafkago.WriteErrors{nil, kafkago.MessageSizeTooLarge}, true},
		{kafkago.WriteErrors{nil, kafkago.LeaderNotAvailable}, false},
		{kafkago.LeaderNotAvailable, false},
		{errors.New("message size too large"), false},
	} {
		if got := kafka.TooLarge(tc.err); got != tc.want {
			t.Errorf("tooLarge(%#v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
