package rabbitmq_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
)

func TestAckBatchNeverCoversDeliveriesInFlight(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q, src, ds := receiveN(ctx, t, 10, 20)
	// m-4 and m-5 are still in flight; m-0..m-3 can go in one multiple ack,
	// m-6 and m-7 wait for m-4 and m-5 (deferred), and Close acks them one
	// by one since m-4 and m-5 never settle.
	batch := append(append([]consumer.Delivery{}, ds[6:8]...), ds[0:4]...)
	if err := src.AckBatch(ctx, batch); err != nil {
		t.Fatal(err)
	}
	if st := src.Stats(); st.MultipleAcks != 1 || st.Acked != 4 {
		t.Fatalf("stats %+v, want 1 multiple ack covering 4, and m-6, m-7 deferred", st)
	}
	if err := src.AckBatch(ctx, ds[0:1]); err == nil {
		t.Fatal("acking a settled delivery again succeeded")
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	if st := src.Stats(); st.MultipleAcks != 1 || st.Acked != 6 {
		t.Fatalf("stats after Close %+v, want the 2 deferred acked", st)
	}
	// Only m-4, m-5, m-8 and m-9 come back.
	again := newSource(t, rabbitmq.Config{Queue: q})
	if ids := receiveAckIDs(ctx, t, again, 4); ids != "[m-4 m-5 m-8 m-9]" {
		t.Fatalf("requeued %v: a multiple ack covered a delivery that was in flight", ids)
	}
	waitFor(t, 5*time.Second, "queue empty", func() bool { return queueDepth(t, q) == 0 })
}

// receiveN publishes n messages m-0.. to a fresh queue and receives them on
// a source with the given prefetch.
func receiveN(ctx context.Context, t *testing.T, n, prefetch int) (string, *rabbitmq.Source, []consumer.Delivery) {
	t.Helper()
	q := newQueue(t)
	pub := newPublisher(t, rabbitmq.PublisherConfig{})
	var msgs []*consumer.Message
	for i := 0; i < n; i++ {
		msgs = append(msgs, &consumer.Message{ID: fmt.Sprintf("m-%d", i), Body: []byte("x")})
	}
	if err := pub.Publish(ctx, "", q, msgs...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, rabbitmq.Config{Queue: q, Prefetch: prefetch})
	return q, src, brokertest.ReceiveN(ctx, t, src, n)
}

// receiveAckIDs receives n deliveries from src, acks them, and returns their
// ids, sorted, as one string.
func receiveAckIDs(ctx context.Context, t *testing.T, src consumer.Source, n int) string {
	t.Helper()
	ds := brokertest.ReceiveN(ctx, t, src, n)
	brokertest.AckAll(ctx, t, ds)
	ids := make([]string, len(ds))
	for i, d := range ds {
		ids[i] = d.Message().ID
	}
	slices.Sort(ids)
	return fmt.Sprint(ids)
}

// TestAckBatchDefersUntilLowerTagsSettle: a committed batch above a delivery
// still in flight waits, and goes in one multiple ack once that settles.
func TestAckBatchDefersUntilLowerTagsSettle(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q, src, ds := receiveN(ctx, t, 10, 20)
	if err := src.AckBatch(ctx, ds[4:8]); err != nil {
		t.Fatal(err)
	}
	if st := src.Stats(); st.Acked != 0 {
		t.Fatalf("stats %+v: acked above m-0..m-3, which are in flight", st)
	}
	for _, d := range ds[0:3] {
		mustAck(ctx, t, d)
	}
	if st := src.Stats(); st.Acked != 3 || st.MultipleAcks != 0 {
		t.Fatalf("stats %+v: m-3 is still in flight", st)
	}
	mustAck(ctx, t, ds[3]) // the last one below: m-4..m-7 go together
	if st := src.Stats(); st.Acked != 8 || st.MultipleAcks != 1 {
		t.Fatalf("stats %+v, want m-4..m-7 in one multiple ack", st)
	}
	if err := src.AckBatch(ctx, ds[8:10]); err != nil { // nothing below: at once
		t.Fatal(err)
	}
	if st := src.Stats(); st.Acked != 10 || st.MultipleAcks != 2 {
		t.Fatalf("stats %+v", st)
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "queue empty", func() bool { return queueDepth(t, q) == 0 })
}

// TestAckBatchDeferralBounded: at most half the prefetch waits; past that
// the lowest waiting deliveries are acked one by one, so a slow delivery
// never holds the window. A nack settles the slow one and frees the rest.
func TestAckBatchDeferralBounded(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q, src, ds := receiveN(ctx, t, 8, 8) // at most 4 deferred
	if err := src.AckBatch(ctx, ds[1:8]); err != nil {
		t.Fatal(err)
	}
	if st := src.Stats(); st.Acked != 3 || st.MultipleAcks != 0 {
		t.Fatalf("stats %+v, want m-1..m-3 acked one by one and 4 deferred", st)
	}
	if err := ds[0].Nack(ctx, true); err != nil {
		t.Fatal(err)
	}
	if st := src.Stats(); st.Acked != 7 || st.MultipleAcks != 1 || st.Nacked != 1 {
		t.Fatalf("stats %+v, want m-4..m-7 in one multiple ack after the nack", st)
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	again := newSource(t, rabbitmq.Config{Queue: q})
	d, err := again.Receive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if d.Message().ID != "m-0" {
		t.Fatalf("redelivered %s, want only m-0", d.Message().ID)
	}
	mustAck(ctx, t, d)
	waitFor(t, 5*time.Second, "queue empty", func() bool { return queueDepth(t, q) == 0 })
}

// TestAckBatchDeferredLostWithChannel: deliveries whose ack was deferred
// when their channel dies are never acked on the new one: they are counted
// as abandoned and redelivered, with everything else unacked.
func TestAckBatchDeferredLostWithChannel(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	_, src, ds := receiveN(ctx, t, 6, 20)
	if err := src.AckBatch(ctx, ds[2:6]); err != nil { // m-0, m-1 in flight: deferred
		t.Fatal(err)
	}
	if err := rabbitmq.BreakChannel(src); err != nil {
		t.Fatal(err)
	}
	// Receive reconnects.
	if ids := receiveAckIDs(ctx, t, src, 6); ids != "[m-0 m-1 m-2 m-3 m-4 m-5]" {
		t.Fatalf("redelivered %v, want all six", ids)
	}
	if err := ds[0].Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Fatalf("ack from the lost channel: %v, want ErrDeliveryStale", err)
	}
	if st := src.Stats(); st.Abandoned < 5 || st.Acked != 6 {
		t.Fatalf("stats %+v, want the 4 deferred and m-0 abandoned, and the 6 redeliveries acked", st)
	}
}

// TestE2EMultipleAcks: the runtime's acks go out as multiple acks in batch
// mode and in strict mode (one message per transaction, whose workers
// commit out of order), and none waits once every delivery has settled.
func TestE2EMultipleAcks(t *testing.T) {
	t.Parallel()
	for _, mode := range []struct {
		name                   string
		batchSize, concurrency int
	}{{"batch", 50, 4}, {"strict", 1, 8}} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			e := newE2E(t)
			ctx := testCtx(t, 60*time.Second)
			q := newQueue(t)
			pub := newPublisher(t, rabbitmq.PublisherConfig{})
			var msgs []*consumer.Message
			for i := 0; i < 400; i++ {
				msgs = append(msgs, &consumer.Message{ID: fmt.Sprintf("m-%d", i), Body: []byte(fmt.Sprint(i))})
				if i%4 == 0 {
					msgs = append(msgs, &consumer.Message{ID: fmt.Sprintf("m-%d", i), Body: []byte(fmt.Sprint(i))})
				}
			}
			if err := pub.Publish(ctx, "", q, msgs...); err != nil {
				t.Fatal(err)
			}
			cfg := rabbitmq.Config{Queue: q}
			if mode.batchSize > 1 {
				cfg.Prefetch = 400
			}
			src := newSource(t, cfg)
			rt, err := consumer.New(consumer.Config{
				Name: "acks", Source: src, Store: e.store,
				Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
					_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (message_id, body) VALUES ($1, $2)", msg.ID, string(msg.Body))
					return err
				},
				DeadLetterer: consumer.DeadLettererFunc(func(_ context.Context, msg *consumer.Message, f consumer.Failure) error {
					t.Errorf("unexpected dead-letter of %q: %s: %v", msg.ID, f.Class, f.Err)
					return errors.New("test refuses dead-letters")
				}),
				BatchSize: mode.batchSize, Concurrency: mode.concurrency,
			})
			if err != nil {
				t.Fatal(err)
			}
			runCtx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- rt.Run(runCtx) }()
			waitFor(t, 30*time.Second, "all settled", func() bool {
				s := rt.Stats()
				return s.Applied+s.Duplicates == int64(len(msgs)) && s.InFlight == 0
			})
			// Acked while running: no committed delivery waits for a
			// multiple ack once nothing is in flight below it.
			waitFor(t, 5*time.Second, "all acked before shutdown", func() bool { return src.Stats().Acked == int64(len(msgs)) })
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if rows, distinct := e.counts(t); rows != 400 || distinct != 400 {
				t.Fatalf("effects %d rows, %d distinct; want 400/400", rows, distinct)
			}
			if st := src.Stats(); st.MultipleAcks == 0 {
				t.Fatalf("no multiple acks: %+v", st)
			}
			waitFor(t, 5*time.Second, "queue empty", func() bool { return queueDepth(t, q) == 0 })
		})
	}
}
