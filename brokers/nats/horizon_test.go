package natsjs_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/brokers/brokertest"
	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
)

// TestRedeliveryHorizon: the horizon is the stream time of the first
// message on the consumer's subject past its ack floor, delivered and
// unacked (pending or nak'ed) or not yet delivered; zero when there is
// none; the first message on the subject when the durable does not exist
// (the consumer Receive creates starts at the beginning of the stream).
func TestRedeliveryHorizon(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	n := newNames(t)
	other := n.subject + "x" // in the stream, not the consumer's
	j := js(t)
	stream, err := j.CreateStream(ctx, jetstream.StreamConfig{Name: n.stream, Subjects: []string{n.subject, other}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := j.CreateStream(ctx, jetstream.StreamConfig{Name: n.dlqStream, Subjects: []string{n.dlqSubject}}); err != nil {
		t.Fatal(err)
	}
	cfg := n.config()
	cfg.NakDelay = 100 * time.Millisecond
	cfg.AckWait = time.Second // the server's check of pending messages runs every AckWait
	src := newSource(t, cfg)
	pub := newPublisher(t, natsjs.PublisherConfig{})
	stored := func(seq uint64) time.Time {
		t.Helper()
		m, err := stream.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("stream message %d: %v", seq, err)
		}
		return m.Time
	}
	want := func(what string, seq uint64) {
		t.Helper()
		h, ok, err := src.RedeliveryHorizon(ctx)
		if err != nil || !ok {
			t.Fatalf("%s: horizon %v, %v, %v", what, h, ok, err)
		}
		switch {
		case seq == 0 && !h.IsZero():
			t.Fatalf("%s: horizon %v, want zero (nothing redeliverable)", what, h)
		case seq > 0 && !h.Equal(stored(seq)):
			t.Fatalf("%s: horizon %v, want %v, the time of stream message %d", what, h, stored(seq), seq)
		}
	}
	receive := func() consumer.Delivery {
		t.Helper()
		d, err := src.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	ack := func(d consumer.Delivery) {
		t.Helper()
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}

	want("an empty stream, no consumer yet", 0)
	if _, err := j.Publish(ctx, other, []byte("not ours")); err != nil { // seq 1
		t.Fatal(err)
	}
	want("a message on another subject only", 0)
	if err := pub.Publish(ctx, n.subject, brokertest.NewMessages("h", 3, 0)...); err != nil { // seq 2-4
		t.Fatal(err)
	}
	want("three messages, no consumer yet", 2)
	ds := []consumer.Delivery{receive(), receive(), receive()}
	want("three pending", 2)
	ack(ds[1])
	want("the second acked, the first pending", 2)
	ack(ds[0])
	want("the first two acked", 4)
	ack(ds[2])
	want("every message acked", 0)

	if err := pub.Publish(ctx, n.subject, brokertest.NewMessages("u", 1, 0)...); err != nil { // seq 5
		t.Fatal(err)
	}
	want("one message not yet delivered", 5)
	if err := receive().Nack(ctx, true); err != nil {
		t.Fatal(err)
	}
	want("the message nak'ed", 5)
	ack(receive())
	want("the nak'ed message redelivered and acked", 0)

	if err := pub.Publish(ctx, n.subject, brokertest.NewMessages("p", 1, 0)...); err != nil { // seq 6
		t.Fatal(err)
	}
	held := receive()
	want("one message pending", 6)
	if err := stream.Purge(ctx, jetstream.WithPurgeSequence(7)); err != nil {
		t.Fatal(err)
	}
	want("the pending message purged from the stream", 0)
	_ = held.Nack(ctx, true)

	if err := pub.Publish(ctx, n.subject, brokertest.NewMessages("d", 2, 0)...); err != nil { // seq 7-8
		t.Fatal(err)
	}
	ack(receive())
	ack(receive())
	// The server drops the purged message from the consumer's pending
	// set at its next AckWait check.
	waitFor(t, 10*time.Second, "a zero horizon once everything is acked again", func() bool {
		h, ok, err := src.RedeliveryHorizon(ctx)
		return err == nil && ok && h.IsZero()
	})
	if err := j.DeleteConsumer(ctx, n.stream, n.durable); err != nil {
		t.Fatal(err)
	}
	want("the durable deleted: Receive creates it again at the start", 7)

	_ = src.Close()
	if _, ok, err := src.RedeliveryHorizon(ctx); !errors.Is(err, consumer.ErrSourceClosed) || ok {
		t.Fatalf("after Close: %v, %v; want ErrSourceClosed", ok, err)
	}
}

// gatedSource holds Receive until gate returns true: the test's way to have
// the janitor's first purge run before any redelivery is claimed.
type gatedSource struct {
	*natsjs.Source
	gate func() bool
}

func (g gatedSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	for !g.gate() {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return g.Source.Receive(ctx)
}

// plainSource hides RedeliveryHorizon: the janitor then purges by the wall
// clock alone.
type plainSource struct{ consumer.Source }

// TestHorizonConsumerDownLongerThanRetention: a consumer applies messages
// and crashes before any ack reaches JetStream; it is down longer than the
// retention, and its messages are due again after AckWait; restarted, its
// janitor purges before the redeliveries are handled. With the horizon,
// the dedup rows of the messages JetStream hands out again stay, and
// nothing is applied twice; with a plain wall-clock purge, every message is
// applied a second time.
func TestHorizonConsumerDownLongerThanRetention(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		horizon bool
	}{{"horizon", true}, {"wall clock", false}} {
		t.Run(tc.name, func(t *testing.T) {
			// Fewer than MaxAckPending (2×DefaultWindow: ackDropper
			// hides Configure), since the deliveries whose acks are
			// lost stay held.
			const n = 12
			ctx := testCtx(t, 90*time.Second)
			e := newE2E(t)
			names := newTopology(t, 0)
			if err := newPublisher(t, natsjs.PublisherConfig{}).Publish(ctx, names.subject, brokertest.NewMessages("h", n, 0)...); err != nil {
				t.Fatal(err)
			}
			cfg := names.config()
			cfg.AckWait = time.Second // the crashed consumer's messages are due again by the restart
			src1 := newSource(t, cfg)
			rt1, stop1 := e.run(t, ackDropper{src1}, nil, 4, nil)
			waitFor(t, 30*time.Second, "every message applied", func() bool { return rt1.Stats().Applied == n })
			natsjs.KillConn(src1) // the crash: no ack, no nak
			if err := stop1(); err != nil {
				t.Logf("first runtime: %v", err)
			}
			if rows, _ := e.counts(t); rows != n {
				t.Fatalf("first run: %d effects for %d messages (%+v)", rows, n, rt1.Stats())
			}
			if st := src1.Stats(); st.Acked != 0 {
				t.Fatalf("the first source acked %d messages", st.Acked)
			}
			table := pgx.Identifier{e.store.Schema(), e.store.Table()}.Sanitize()
			var minAt, maxAt time.Time
			_ = e.store.Pool().QueryRow(ctx, `SELECT min(processed_at), max(processed_at) FROM `+table).Scan(&minAt, &maxAt)
			t.Logf("applied between %s and %s", minAt.UTC().Format(time.StampMicro), maxAt.UTC().Format(time.StampMicro))

			const retention = time.Second
			time.Sleep(2 * retention) // down longer than the retention

			src2 := newSource(t, cfg)
			if tc.horizon {
				h, ok, err := src2.RedeliveryHorizon(ctx)
				if err != nil || !ok || h.IsZero() || time.Since(h) < 2*retention {
					t.Fatalf("horizon %v, %v, %v: want the first message's time", h, ok, err)
				}
			}
			// Receive waits for the janitor's first round, so the purge
			// runs before any redelivery is claimed.
			retained := pgx.Identifier{e.store.Schema(), e.store.Table() + "_retention"}.Sanitize()
			reported := func() bool {
				var k int
				_ = e.store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM `+retained).Scan(&k)
				return k > 0
			}
			var s consumer.Source = gatedSource{src2, reported}
			if !tc.horizon {
				s = plainSource{s}
			}
			rt2, err := consumer.New(consumer.Config{
				Name: "e2e", Source: s, Store: e.store, DeadLetterer: src2.DeadLetterer(), Handler: e.handler(nil),
				Concurrency: 4, ShutdownTimeout: 10 * time.Second,
				// The margin covers the time between reading the horizon
				// and the purge's cutoff.
				Retention: retention, JanitorInterval: time.Hour, HorizonMargin: 500 * time.Millisecond,
			})
			if err != nil {
				t.Fatal(err)
			}
			run2, cancel2 := context.WithCancel(context.Background())
			done2 := make(chan error, 1)
			go func() { done2 <- rt2.Run(run2) }()
			stop2 := func() error {
				cancel2()
				select {
				case err := <-done2:
					return err
				case <-time.After(30 * time.Second):
					return errors.New("Run did not return within 30s of cancel")
				}
			}
			t.Cleanup(func() { cancel2() })
			// Every message acked, whether it was applied again or
			// skipped (a 2.9 server may hand one out twice, and keep
			// another until AckWait).
			waitFor(t, 30*time.Second, "every redelivery settled", func() bool {
				return rt2.Stats().InFlight == 0 && consumerIdle(t, names)
			})
			if tc.horizon {
				// Once everything is acked, nothing is redeliverable.
				if h, ok, err := src2.RedeliveryHorizon(ctx); err != nil || !ok || !h.IsZero() {
					t.Errorf("every message acked: horizon %v, %v, %v; want zero", h, ok, err)
				}
			}
			if err := stop2(); err != nil {
				t.Fatalf("second runtime: %v", err)
			}
			rows, distinct := e.counts(t)
			var rep string
			_ = e.store.Pool().QueryRow(ctx, `SELECT string_agg(format('%s purged=%s older=%s horizon=%s at=%s', horizon_state, purged, purged_older_than_ms, horizon, window_end), '; ') FROM `+retained).Scan(&rep)
			t.Logf("reports: %s", rep)
			if distinct != n {
				t.Fatalf("%d distinct effects, want %d", distinct, n)
			}
			switch {
			case tc.horizon && rows != n:
				t.Fatalf("%d effects for %d messages: applied twice despite the horizon", rows, n)
			case !tc.horizon && rows != 2*n:
				t.Fatalf("%d effects for %d messages with a wall-clock purge; the test expects the purge to cause %d", rows, n, 2*n)
			}
			t.Logf("%s: %d effects for %d messages (second run: %+v)", tc.name, rows, n, rt2.Stats())
		})
	}
}
