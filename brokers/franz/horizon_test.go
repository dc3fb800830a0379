package franz_test

import (
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
)

// TestRedeliveryHorizon: with nothing committed, the horizon is the oldest
// record's timestamp; once every record is acked and committed, it is zero.
func TestRedeliveryHorizon(t *testing.T) {
	ctx := testCtx(t, 40*time.Second)
	e := newEnv(t, 2)
	old := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
	if err := e.pub.Publish(ctx, e.topic,
		&consumer.Message{ID: "a", RecordKey: []byte("1"), Body: []byte("a"), Timestamp: old},
		&consumer.Message{ID: "b", RecordKey: []byte("2"), Body: []byte("b"), Timestamp: old.Add(time.Minute)},
		&consumer.Message{ID: "c", RecordKey: []byte("3"), Body: []byte("c"), Timestamp: old.Add(2 * time.Minute)},
	); err != nil {
		t.Fatal(err)
	}
	s := e.source(t)
	h, ok, err := s.RedeliveryHorizon(ctx)
	if err != nil || !ok || !h.Equal(old) {
		t.Fatalf("horizon %v, %v, %v; want %v", h, ok, err, old)
	}
	for range 3 {
		d, err := s.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 20*time.Second, "a zero horizon once committed", func() bool {
		h, ok, err := s.RedeliveryHorizon(ctx)
		return err == nil && ok && h.IsZero()
	})
}
