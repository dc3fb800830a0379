package franz_test

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkatest"
)

// TestDeadLetterTooLarge: a record the topic accepts, whose dead letter
// (the envelope's headers added) is refused for its size, by the DLQ
// topic's max.message.bytes or by the client's ProducerBatchMaxBytes, is
// dead-lettered truncated, with its size, SHA-256 and coordinates.
func TestDeadLetterTooLarge(t *testing.T) {
	for _, tc := range []struct {
		name     string
		body     int
		dlqLimit string // the DLQ topic's max.message.bytes; "" for the default
	}{
		{"topic max.message.bytes", 20_000 - 150, "20000"},
		{"client batch limit", 1_000_012 - 150, ""}, // franz-go's default ProducerBatchMaxBytes
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
			// Random, so that the batch franz-go compresses stays as large
			// as the body: the broker checks the compressed size.
			body := make([]byte, tc.body)
			if _, err := rand.Read(body); err != nil {
				t.Fatal(err)
			}
			big := &consumer.Message{ID: "big-1", Body: body}
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
			reader := e.source(t, func(c *franz.Config) { c.Topic = dlqTopic; c.Group = kafkatest.Name(t, "dlq") })
			m := receiveOne(ctx, t, reader).Message()
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
