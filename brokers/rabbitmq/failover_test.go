package rabbitmq_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
)

// kill stops p as a node that died: it refuses new connections and its
// connections are cut.
func (p *proxy) kill() {
	_ = p.ln.Close()
	p.Cut()
}

// TestFailoverToAnotherNode: a Source and a Publisher whose node dies (a
// proxy stands for each node of a cluster) reconnect to the next node of
// FailoverURLs at once, rather than wait for their node to come back; the
// Source then consumes on it.
func TestFailoverToAnotherNode(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	topo := rabbitmq.Topology{Queue: uniqueName(t)}
	deleteTopologyLater(t, topo)
	if err := rabbitmq.DeclareTopology(ctx, amqpURL(), topo); err != nil {
		t.Fatal(err)
	}
	q := topo.Queue
	a, b := newProxy(t), newProxy(t)
	src := newSource(t, rabbitmq.Config{URL: a.URL(t), FailoverURLs: []string{b.URL(t)}, Queue: q,
		Reconnect: rabbitmq.ReconnectConfig{InitialInterval: 10 * time.Millisecond, MaxInterval: 200 * time.Millisecond}})
	pa, pb := newProxy(t), newProxy(t)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: pa.URL(t), FailoverURLs: []string{pb.URL(t)}})

	if err := pub.Publish(ctx, "", q, &consumer.Message{ID: "before", Body: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	mustAck(ctx, t, brokertest.Receive(ctx, t, src))
	if a.Accepted() == 0 || b.Accepted() != 0 || pa.Accepted() != 1 || pb.Accepted() != 0 {
		t.Fatalf("connections: source %d to the first node, %d to the second; publisher %d, %d: want the first node only",
			a.Accepted(), b.Accepted(), pa.Accepted(), pb.Accepted())
	}

	// The first node dies for good.
	a.kill()
	pa.kill()
	killed := time.Now()
	// The publish in flight when the node died fails as unconfirmed (the
	// Publisher learns of the loss from it); the retry goes to the next
	// node.
	err := pub.Publish(ctx, "", q, &consumer.Message{ID: "after", Body: []byte("2")})
	if errors.Is(err, rabbitmq.ErrUnconfirmed) {
		err = pub.Publish(ctx, "", q, &consumer.Message{ID: "after", Body: []byte("2")})
	}
	if err != nil {
		t.Fatalf("publish after the first node died: %v", err)
	}
	// "before" may come again: its ack may have died with the node.
	for {
		d := brokertest.Receive(ctx, t, src)
		mustAck(ctx, t, d)
		if d.Message().ID == "after" {
			break
		}
	}
	t.Logf("consuming on the second node %s after the first died", time.Since(killed).Round(time.Millisecond))
	if b.Accepted() == 0 || pb.Accepted() != 1 {
		t.Fatalf("connections to the second node: source %d, publisher %d", b.Accepted(), pb.Accepted())
	}
	if n := src.Stats().Reconnects; n != 1 {
		t.Errorf("%d reconnects, want 1", n)
	}
}

// TestFailoverURLsChecked: each failover URL is checked as URL is, named
// by its index, without its password.
func TestFailoverURLsChecked(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 10*time.Second)
	for _, tc := range []struct {
		urls []string
		want string
	}{
		{[]string{"amqp://u:hunter2secret@h1/,amqp://u:hunter2secret@h2/"}, "FailoverURLs[0]"},
		{[]string{amqpURL(), "amqp://u:hunter2secret@h%zz/"}, "FailoverURLs[1]"},
	} {
		_, err := rabbitmq.NewSource(ctx, rabbitmq.Config{Queue: "q", FailoverURLs: tc.urls})
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "hunter2secret") {
			t.Errorf("NewSource with %d failover URLs: %v, want a config error naming %s without the password", len(tc.urls), err, tc.want)
		}
		_, err = rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{FailoverURLs: tc.urls})
		if !errors.As(err, &ce) || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "hunter2secret") {
			t.Errorf("NewPublisher with %d failover URLs: %v, want a config error naming %s without the password", len(tc.urls), err, tc.want)
		}
	}
}
