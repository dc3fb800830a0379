package rabbitmq_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// signingKey signs the envelopes in these tests.
var signingKey = bytes.Repeat([]byte{7}, 32)

// runWithDeadLetterer runs a runtime on src whose handler fails for good on
// bodies starting with "poison", dead-lettering with dl. It returns the
// runtime and a stop function returning Run's error.
func (e *e2e) runWithDeadLetterer(t *testing.T, src consumer.Source, dl consumer.DeadLetterer) (*consumer.Runtime, func() error) {
	t.Helper()
	rt, err := consumer.New(consumer.Config{
		Name:   "e2e",
		Source: src,
		Store:  e.store,
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if strings.HasPrefix(string(msg.Body), "poison") {
				return consumer.Permanent(errors.New("poison payment"))
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (message_id, body) VALUES ($1, $2)", msg.ID, string(msg.Body))
			return err
		},
		DeadLetterer:    dl,
		Concurrency:     2,
		ShutdownTimeout: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop := func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(30 * time.Second):
				runErr = errors.New("Run did not return within 30s of cancel")
			}
		})
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return rt, stop
}

// poison returns n messages with ids "<prefix>-<i>" whose handler fails for
// good.
func poison(prefix string, n int) []*consumer.Message {
	msgs := brokertest.NewMessages(prefix, n, 0)
	for _, m := range msgs {
		m.Body = append([]byte("poison-"), m.Body...)
	}
	return msgs
}

// checkDeadLetters receives want messages from the dead-letter queue and
// checks their signed envelopes name the work queue and a permanent
// failure.
func checkDeadLetters(ctx context.Context, t *testing.T, dlqSrc consumer.Source, queue string, want []*consumer.Message) {
	t.Helper()
	ids := map[string]bool{}
	for _, m := range want {
		ids[m.ID] = true
	}
	for len(ids) > 0 {
		d := brokertest.Receive(ctx, t, dlqSrc)
		m := d.Message()
		rec, err := dlq.Parse(m)
		if err != nil {
			t.Fatalf("dead letter %q: %v", m.ID, err)
		}
		if err := dlq.Verify(m, signingKey); err != nil {
			t.Errorf("dead letter %q: signature: %v", m.ID, err)
		}
		if rec.Class != consumer.ClassPermanent || rec.Source != queue || rec.Consumer != "e2e" || !strings.Contains(rec.Error, "poison payment") {
			t.Errorf("dead letter %q: envelope %+v", m.ID, rec.Entry)
		}
		if !ids[rec.MessageID] {
			t.Errorf("unexpected dead letter %q (want one of %v)", rec.MessageID, ids)
		}
		delete(ids, rec.MessageID)
		mustAck(ctx, t, d)
	}
}

// TestDeadLettererE2E: through the runtime, permanent failures land in the
// topology's dead-letter queue with their signed envelopes; after the
// Source's connection is cut, dead letters go out on the connection the
// Source reconnects with; the dead-letterer never opens a connection of its
// own; and once the runtime has closed the Source, DeadLetter fails with
// consumer.ErrSourceClosed.
func TestDeadLettererE2E(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 90*time.Second)
	e := newE2E(t)
	topo := rabbitmq.Topology{Queue: uniqueName(t)}
	deleteTopologyLater(t, topo)
	if err := rabbitmq.DeclareTopology(ctx, amqpURL(), topo); err != nil {
		t.Fatal(err)
	}
	px := newProxy(t)
	src := newSource(t, rabbitmq.Config{
		URL:        px.URL(t),
		Queue:      topo.Queue,
		DeadLetter: rabbitmq.DeadLetterConfig{Options: dlq.Options{SigningKey: signingKey}},
		Reconnect:  rabbitmq.ReconnectConfig{InitialInterval: 10 * time.Millisecond, MaxInterval: 200 * time.Millisecond},
	})
	dl := src.DeadLetterer()
	if dl != src.DeadLetterer() {
		t.Fatal("DeadLetterer returned another dead-letterer on the second call")
	}
	// The first dead letter of a "mid-cut" message cuts the connection
	// just before it is published.
	var cutOnce sync.Once
	rt, stop := e.runWithDeadLetterer(t, src, consumer.DeadLettererFunc(func(ctx context.Context, m *consumer.Message, f consumer.Failure) error {
		if strings.HasPrefix(m.ID, "mid-cut") {
			cutOnce.Do(func() { px.Cut() })
		}
		return dl.DeadLetter(ctx, m, f)
	}))
	pub := newPublisher(t, rabbitmq.PublisherConfig{})
	dlqSrc := dlqSource(t, rabbitmq.DLQName(topo.Queue))

	good := brokertest.NewMessages("good", 5, 0)
	bad := poison("bad", 3)
	if err := pub.Publish(ctx, "", topo.Queue, append(append([]*consumer.Message(nil), good...), bad...)...); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "3 dead letters and 5 applied", func() bool {
		st := rt.Stats()
		return st.DeadLettered == 3 && st.Applied == 5 && st.InFlight == 0
	})
	checkDeadLetters(ctx, t, dlqSrc, topo.Queue, bad)
	if n := px.Accepted(); n != 1 {
		t.Errorf("%d connections opened through the proxy, want 1: the dead-letterer must use the Source's", n)
	}

	// Cut the connection: the Source reconnects and dead letters follow
	// it onto the new connection.
	if c := px.Cut(); c == 0 {
		t.Fatal("proxy had no connection to cut")
	}
	waitFor(t, 10*time.Second, "the source to reconnect", func() bool { return src.Stats().Reconnects == 1 })
	after := poison("after-cut", 3)
	if err := pub.Publish(ctx, "", topo.Queue, after...); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "3 more dead letters", func() bool {
		st := rt.Stats()
		return st.DeadLettered == 6 && st.InFlight == 0
	})
	checkDeadLetters(ctx, t, dlqSrc, topo.Queue, after)
	if n := px.Accepted(); n != 2 {
		t.Errorf("%d connections opened through the proxy, want 2 (one reconnect)", n)
	}
	if d := queueDepth(t, topo.Queue); d != 0 {
		t.Errorf("%d messages left in the work queue", d)
	}

	// A cut under a dead letter: the publish fails, the runtime retries
	// it on the reconnected Source, and the copy lands (perhaps twice: the
	// original's ack was lost with the connection, so it comes back).
	mid := poison("mid-cut", 1)
	if err := pub.Publish(ctx, "", topo.Queue, mid...); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the mid-cut dead letter", func() bool {
		st := rt.Stats()
		return st.DeadLettered >= 7 && st.InFlight == 0 && queueDepth(t, topo.Queue) == 0
	})
	checkDeadLetters(ctx, t, dlqSrc, topo.Queue, mid)
	t.Logf("runtime %+v; source %+v", rt.Stats(), src.Stats())
	if n := px.Accepted(); n != 3 {
		t.Errorf("%d connections opened through the proxy, want 3 (two reconnects)", n)
	}

	// The runtime closes the Source at shutdown, and with it the
	// dead-letterer.
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	err := dl.DeadLetter(ctx, bad[0], consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("late")})
	if !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("DeadLetter after Close: %v, want an error wrapping consumer.ErrSourceClosed", err)
	}
}

// TestDeadLettererConfig: NewSource refuses a missing dead-letter queue,
// naming it and saying how to declare it, and refuses the Source's own
// queue and invalid envelope options; DeadLetter.Queue names another queue;
// a queue deleted later makes DeadLetter fail with ErrUnroutable rather than
// drop the copy.
func TestDeadLettererConfig(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	bare := newBareQueue(t)
	_, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL(), Queue: bare})
	if err == nil || !strings.Contains(err.Error(), rabbitmq.DLQName(bare)) || !strings.Contains(err.Error(), "DeclareTopology") {
		t.Errorf("NewSource without the topology's DLQ: %v, want an error naming %q and how to declare it", err, rabbitmq.DLQName(bare))
	}
	t.Logf("as expected: %v", err)
	if m, c := queueState(t, bare); m != 0 || c != 0 {
		t.Errorf("the failed NewSource left %d messages and %d consumers", m, c)
	}

	q := newQueue(t)
	var ce *consumer.ConfigError
	if _, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL(), Queue: q, DeadLetter: rabbitmq.DeadLetterConfig{Queue: q}}); !errors.As(err, &ce) || ce.Field != "DeadLetter.Queue" {
		t.Errorf("dead-lettering to the Source's own queue: %v, want a *consumer.ConfigError for DeadLetter.Queue", err)
	}
	if _, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL(), Queue: q, DeadLetter: rabbitmq.DeadLetterConfig{Options: dlq.Options{SigningKey: []byte("short")}}}); !errors.As(err, &ce) || ce.Field != "DeadLetter.Options.SigningKey" {
		t.Errorf("a short signing key: %v, want a *consumer.ConfigError for DeadLetter.Options.SigningKey", err)
	}

	other := newBareQueue(t)
	src := newSource(t, rabbitmq.Config{Queue: q, DeadLetter: rabbitmq.DeadLetterConfig{Queue: other}})
	dl := src.DeadLetterer()
	msg := brokertest.NewMessages("cfg", 1, 0)[0]
	f := consumer.Failure{Consumer: "c", MessageID: msg.ID, Class: consumer.ClassPermanent, Err: errors.New("bad")}
	if err := dl.DeadLetter(ctx, msg, f); err != nil {
		t.Fatal(err)
	}
	if d := queueDepth(t, other); d != 1 {
		t.Errorf("%d messages in %s, want 1", d, other)
	}
	if err := admin(t, func(ch *amqp.Channel) error {
		_, err := ch.QueueDelete(other, false, false, false)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if err := dl.DeadLetter(ctx, msg, f); !errors.Is(err, rabbitmq.ErrUnroutable) {
		t.Errorf("DeadLetter to a deleted queue: %v, want ErrUnroutable", err)
	}
	// The Source is unharmed: it still consumes.
	if err := newPublisher(t, rabbitmq.PublisherConfig{}).Publish(ctx, "", q, msg); err != nil {
		t.Fatal(err)
	}
	mustAck(ctx, t, brokertest.Receive(ctx, t, src))
}

// TestDeadLetterReconnectsBeforeChannelsClose: as for the Publisher
// (TestPublisherReconnectsBeforeChannelsClose), a dead letter published in
// the moment amqp091 has marked the connection closed but not yet its
// channels goes out on a new connection, not on an idle channel of the
// dead one.
func TestDeadLetterReconnectsBeforeChannelsClose(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	q := newQueue(t)
	src := newSource(t, rabbitmq.Config{Queue: q})
	msgs := brokertest.NewMessages("dl", 2, 0)
	if err := rabbitmq.PublishDeadLetter(ctx, src, msgs[0]); err != nil {
		t.Fatal(err)
	}
	dead, live, err := rabbitmq.SourceOnClosedConn(src, amqpURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = live.Close() })
	if err := rabbitmq.PublishDeadLetter(ctx, src, msgs[1]); err != nil {
		t.Fatalf("dead letter: %v", err)
	}
	if c := rabbitmq.SourceConn(src); c == nil || c == dead || c.IsClosed() {
		t.Fatalf("the dead letter went out on an idle channel of the closed connection instead of a new one")
	}
	if d := queueDepth(t, rabbitmq.DLQName(q)); d != 2 {
		t.Fatalf("dead-letter queue holds %d messages, want 2", d)
	}
}
