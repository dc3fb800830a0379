package redisstream_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
)

// TestDurability kills its own redis-server with SIGKILL after acks and a
// dead letter, restarts it from the same directory, and checks that the
// acked entries stay acked, the unacked ones stay pending (and are claimed
// by the next consumer), and the dead letter is still there. With
// appendonly yes and appendfsync always everything survives; the same
// scenario on a server without AOF loses it, which shows the test can fail.
func TestDurability(t *testing.T) {
	t.Parallel()
	t.Run("AOF", func(t *testing.T) {
		t.Parallel()
		srv := startRedis(t)
		if err := crashScenario(t, srv, true); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("NoAOFLosesState", func(t *testing.T) {
		t.Parallel()
		srv := startRedis(t, "--appendonly", "no")
		if err := crashScenario(t, srv, false); err == nil {
			t.Fatal("without AOF the state survived a SIGKILL: the test would not catch a server that persists nothing")
		} else {
			t.Logf("without AOF, as expected: %v", err)
		}
	})
}

// crashScenario returns what did not survive the crash, or nil.
func crashScenario(t *testing.T, srv *redisServer, requireAOF bool) error {
	ctx := testCtx(t, 60*time.Second)
	const stream, group = "payments", "ledger"
	// No keep-alive: the first Source stands for a consumer that died
	// with the server, whose entries the next one claims after MinIdle.
	cfg := redisstream.Config{URL: srv.URL(), Stream: stream, Group: group, MinIdle: time.Second, KeepAlive: -1,
		ClaimInterval: 100 * time.Millisecond, RequireAOF: requireAOF}
	pub := newPublisher(t, redisstream.PublisherConfig{URL: srv.URL()})
	msgs := brokertest.NewMessages("crash", 10, 0)
	if _, err := pub.Publish(ctx, stream, msgs...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, cfg)
	ds := brokertest.ReceiveN(ctx, t, src, 10)
	brokertest.AckAll(ctx, t, ds[:4])
	if err := src.AckBatch(ctx, ds[4:5]); err != nil {
		t.Fatal(err)
	}
	if err := src.DeadLetterer().DeadLetter(ctx, ds[5].Message(), consumer.Failure{
		Consumer: group, MessageID: ds[5].Message().ID, Class: consumer.ClassPermanent, Attempts: 1, Err: fmt.Errorf("poison"),
	}); err != nil {
		t.Fatal(err)
	}
	if err := ds[5].Ack(ctx); err != nil {
		t.Fatal(err)
	}
	// Entries 6 to 9 are held, unacked, when the server dies.

	srv.restart()

	c := client(t, srv.URL())
	if n, err := c.XLen(ctx, stream).Result(); err != nil || n != 10 {
		return fmt.Errorf("stream has %d entries after the restart (%v), want 10", n, err)
	}
	p, err := c.XPending(ctx, stream, group).Result()
	if err != nil || p.Count != 4 || p.Consumers[src.Consumer()] != 4 {
		return fmt.Errorf("after the restart the group's pending entries are %+v (%v), want 4 of %s", p, err, src.Consumer())
	}
	if n, err := c.XLen(ctx, redisstream.DLQName(stream)).Result(); err != nil || n != 1 {
		return fmt.Errorf("dead-letter stream has %d entries after the restart (%v), want 1", n, err)
	}

	// The consumer "died" with the server: a new one claims its entries
	// after MinIdle, and only those.
	next := newSource(t, cfg)
	again := brokertest.ReceiveN(ctx, t, next, 4)
	want := map[string]bool{}
	for _, d := range ds[6:] {
		want[d.Message().ID] = true
	}
	for _, d := range again {
		if !want[d.Message().ID] || !d.Message().Redelivered {
			t.Errorf("after the crash got %q (redelivered %v), want one of the 4 unacked", d.Message().ID, d.Message().Redelivered)
		}
	}
	brokertest.AckAll(ctx, t, again)
	brokertest.ReceiveNone(ctx, t, next, 1500*time.Millisecond)
	return nil
}

// TestSurvivesServerRestart: a running Source rides out a server restart:
// Receive retries, and what it acks afterwards is acked.
func TestSurvivesServerRestart(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	srv := startRedis(t)
	pub := newPublisher(t, redisstream.PublisherConfig{URL: srv.URL()})
	src := newSource(t, redisstream.Config{URL: srv.URL(), Stream: "s", Group: "g", Block: 200 * time.Millisecond})
	brokertest.ReceiveNone(ctx, t, src, 300*time.Millisecond)
	srv.restart()
	if _, err := pub.Publish(ctx, "s", brokertest.NewMessages("after", 1, 0)...); err != nil {
		// The publisher's pooled connection died with the server: one
		// failure, then a fresh connection.
		if _, err := pub.Publish(ctx, "s", brokertest.NewMessages("after", 1, 0)...); err != nil {
			t.Fatal(err)
		}
	}
	d := brokertest.Receive(ctx, t, src)
	if err := d.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	if n, _ := client(t, srv.URL()).XPending(ctx, "s", "g").Result(); n.Count != 0 {
		t.Errorf("%d pending after the ack", n.Count)
	}
}
