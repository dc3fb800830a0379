package natsjs_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/brokers/brokertest"
	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	ok := natsjs.Config{Stream: "S", Subject: "s", Durable: "d"}
	tests := []struct {
		name  string
		edit  func(*natsjs.Config)
		field string
	}{
		{"no stream", func(c *natsjs.Config) { c.Stream = "" }, "Stream"},
		{"dotted stream", func(c *natsjs.Config) { c.Stream = "a.b" }, "Stream"},
		{"no durable", func(c *natsjs.Config) { c.Durable = "" }, "Durable"},
		{"durable with wildcard", func(c *natsjs.Config) { c.Durable = "d*" }, "Durable"},
		{"bad subject", func(c *natsjs.Config) { c.Subject = "a..b" }, "Subject"},
		{"misplaced >", func(c *natsjs.Config) { c.Subject = "a.>.b" }, "Subject"},
		{"wildcard subject without DLQ", func(c *natsjs.Config) { c.Subject = "orders.*" }, "DeadLetter.Subject"},
		{"no subject without DLQ", func(c *natsjs.Config) { c.Subject = "" }, "DeadLetter.Subject"},
		{"DLQ with wildcard", func(c *natsjs.Config) { c.DeadLetter.Subject = "x.*" }, "DeadLetter.Subject"},
		{"DLQ consumed again", func(c *natsjs.Config) { c.Subject = "orders.>"; c.DeadLetter.Subject = "orders.dlq" }, "DeadLetter.Subject"},
		{"DLQ in the work stream's subjects", func(c *natsjs.Config) {
			c.DeadLetter.Subject = "x.dlq"
			c.Topology = &natsjs.Topology{Subjects: []string{"s", "x.>"}}
		}, "Topology.Subjects"},
		{"topology without subjects", func(c *natsjs.Config) {
			c.Subject = ""
			c.DeadLetter.Subject = "x.dlq"
			c.Topology = &natsjs.Topology{}
		}, "Topology.Subjects"},
		{"DLQ stream is the stream", func(c *natsjs.Config) { c.Topology = &natsjs.Topology{DeadLetterStream: "S"} }, "Topology.DeadLetterStream"},
		{"replicas", func(c *natsjs.Config) { c.Topology = &natsjs.Topology{Replicas: 7} }, "Topology.Replicas"},
		{"short AckWait", func(c *natsjs.Config) { c.AckWait = 100 * time.Millisecond }, "AckWait"},
		{"negative MaxAckPending", func(c *natsjs.Config) { c.MaxAckPending = -1 }, "MaxAckPending"},
		{"MaxDeliver 1", func(c *natsjs.Config) { c.MaxDeliver = 1 }, "MaxDeliver"},
		{"MaxDeliver -2", func(c *natsjs.Config) { c.MaxDeliver = -2 }, "MaxDeliver"},
		{"negative NakDelay", func(c *natsjs.Config) { c.NakDelay = -time.Second }, "NakDelay"},
		{"bad URL", func(c *natsjs.Config) { c.URL = "nats://user:secret@127.0.0.1:bad" }, "URL"},
		{"empty URL in list", func(c *natsjs.Config) { c.URL = "nats://user:secret@127.0.0.1:4222,," }, "URL"},
		{"bad dead-letter options", func(c *natsjs.Config) { c.DeadLetter.Options.MaxErrorBytes = 3 }, "DeadLetter.Options.MaxErrorBytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			cfg.URL = serverURL()
			tc.edit(&cfg)
			_, err := natsjs.NewSource(testCtx(t, 10*time.Second), cfg)
			var ce *consumer.ConfigError
			if !errors.As(err, &ce) || !errors.Is(err, consumer.ErrInvalidConfig) {
				t.Fatalf("NewSource: %v, want a *consumer.ConfigError", err)
			}
			if ce.Field != tc.field {
				t.Errorf("field %q, want %q (%v)", ce.Field, tc.field, err)
			}
			if strings.Contains(err.Error(), "secret") {
				t.Errorf("error shows the password: %v", err)
			}
		})
	}
}

// TestNoCredentialsInErrors: an unreachable server with credentials in its
// URL fails every constructor without showing the password.
func TestNoCredentialsInErrors(t *testing.T) {
	t.Parallel()
	const url = "nats://user:secret@127.0.0.1:1"
	ctx := testCtx(t, 20*time.Second)
	_, err1 := natsjs.NewSource(ctx, natsjs.Config{URL: url, Stream: "S", Subject: "s", Durable: "d"})
	_, err2 := natsjs.NewPublisher(ctx, natsjs.PublisherConfig{URL: url + ",nats://u2:secret2@127.0.0.1:2"})
	_, err3 := natsjs.NewBrowser(ctx, natsjs.BrowserConfig{URL: url, Subject: "s.dlq"})
	for i, err := range []error{err1, err2, err3} {
		if err == nil {
			t.Fatalf("constructor %d connected to %s", i, url)
		}
		if strings.Contains(err.Error(), "secret") {
			t.Errorf("constructor %d: error shows the password: %v", i, err)
		}
		if !strings.Contains(err.Error(), "127.0.0.1:1") {
			t.Errorf("constructor %d: error does not say which server: %v", i, err)
		}
		t.Logf("constructor %d: %v", i, err)
	}
}

func TestNewSourceChecksStreams(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 20*time.Second)
	n := newNames(t)
	if _, err := natsjs.NewSource(ctx, n.config()); err == nil || !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("NewSource without a stream: %v, want ErrStreamNotFound", err)
	}
	if _, err := js(t).CreateStream(ctx, jetstream.StreamConfig{Name: n.stream, Subjects: []string{n.subject}}); err != nil {
		t.Fatal(err)
	}
	_, err := natsjs.NewSource(ctx, n.config())
	if err == nil || !strings.Contains(err.Error(), "no stream captures the dead-letter subject") {
		t.Errorf("NewSource without a DLQ stream: %v", err)
	}
	// A Topology adds the missing DLQ stream and leaves the existing one.
	cfg := n.config()
	cfg.Topology = &natsjs.Topology{}
	newSource(t, cfg)
	if got := streamMsgs(t, n.dlqStream); got != 0 {
		t.Errorf("DLQ stream holds %d messages", got)
	}
	// A Topology whose subjects an existing stream lacks is refused.
	cfg.Topology = &natsjs.Topology{Subjects: []string{n.subject, n.subject + ".more"}}
	if _, err := natsjs.NewSource(ctx, cfg); err == nil || !strings.Contains(err.Error(), "is not modified") {
		t.Errorf("NewSource with a conflicting topology: %v", err)
	}
}

// TestConfigureSizesMaxAckPending: MaxAckPending is 2×the runtime's window,
// applied at the first Receive, unless Config fixes it.
func TestConfigureSizesMaxAckPending(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 20*time.Second)
	n := newTopology(t, 0)
	src := newSource(t, n.config())
	if w := src.Window(); w != 2*natsjs.DefaultWindow {
		t.Errorf("unconfigured window %d, want %d", w, 2*natsjs.DefaultWindow)
	}
	if w := src.Configure(consumer.SourceSettings{Window: 5}); w != 10 {
		t.Errorf("Configure(5) = %d, want 10", w)
	}
	if _, err := js(t).Consumer(ctx, n.stream, n.durable); !errors.Is(err, jetstream.ErrConsumerNotFound) {
		t.Errorf("consumer exists before the first Receive: %v", err)
	}
	rctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if _, err := src.Receive(rctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Receive on an empty stream: %v", err)
	}
	c, err := js(t).Consumer(ctx, n.stream, n.durable)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.CachedInfo().Config; got.MaxAckPending != 10 || got.AckWait != natsjs.DefaultAckWait || got.MaxDeliver != -1 || got.AckPolicy != jetstream.AckExplicitPolicy {
		t.Errorf("consumer config %+v", got)
	}
	if w := src.Configure(consumer.SourceSettings{Window: 50}); w != 10 {
		t.Errorf("Configure after the first Receive = %d, want 10", w)
	}

	cfg := n.config()
	cfg.Durable += "-fixed"
	cfg.MaxAckPending = 3
	if w := newSource(t, cfg).Configure(consumer.SourceSettings{Window: 5}); w != 3 {
		t.Errorf("Configure with MaxAckPending 3 = %d, want 3", w)
	}
}

// TestMessageMapping: id, key, headers, sequence and delivery count.
func TestMessageMapping(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 20*time.Second)
	n := newTopology(t, 0)
	pub := newPublisher(t, natsjs.PublisherConfig{})
	m := &consumer.Message{ID: "id-1", Key: "k-1", Body: []byte("b"), Headers: map[string]string{"Idem": "h-1", "x": "y"}}
	if err := pub.Publish(ctx, n.subject, m, m.Clone()); err != nil { // the second is discarded
		t.Fatal(err)
	}
	src := newSource(t, n.config())
	d := brokertest.Receive(ctx, t, src)
	got := d.Message()
	if got.ID != "id-1" || got.Header("Idem") != "h-1" || got.Key != "k-1" || got.Header("x-idemq-key") != "k-1" || got.Source != n.subject || got.Offset != 1 || got.Partition != -1 ||
		got.Redelivered || got.Header("x") != "y" || got.Header(jetstream.MsgIDHeader) != "id-1" || got.Timestamp.IsZero() ||
		got.Metadata[natsjs.MetaStreamSeq] != "1" || got.Metadata[natsjs.MetaNumDelivered] != "1" || got.Metadata[natsjs.MetaConsumer] != n.durable {
		t.Errorf("message %+v", got)
	}
	if err := d.Nack(ctx, false); err != nil { // a nak, never a term
		t.Fatal(err)
	}
	d = brokertest.Receive(ctx, t, src)
	if !d.Message().Redelivered || d.Message().Metadata[natsjs.MetaNumDelivered] != "2" {
		t.Errorf("after a nack: %+v", d.Message())
	}
	if err := d.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	if err := d.Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("second Ack: %v, want ErrDeliveryStale", err)
	}
}

func TestAckBatch(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 20*time.Second)
	n := newTopology(t, 0)
	msgs := brokertest.NewMessages("batch", 6, 0)
	if err := newPublisher(t, natsjs.PublisherConfig{}).Publish(ctx, n.subject, msgs...); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, n.config())
	ds := brokertest.ReceiveN(ctx, t, src, len(msgs))
	if err := src.AckBatch(ctx, ds); err != nil {
		t.Fatal(err)
	}
	if st := src.Stats(); st.Acked != int64(len(msgs)) {
		t.Errorf("stats %+v", st)
	}
	if !consumerIdle(t, n) {
		t.Error("messages left unacked")
	}
}

func TestPublisherErrors(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 20*time.Second)
	n := newTopology(t, 0)
	pub := newPublisher(t, natsjs.PublisherConfig{RejectDuplicates: true})
	msgs := brokertest.NewMessages("pe", 3, 0)
	err := pub.Publish(ctx, n.subject, msgs[0], msgs[1], msgs[0].Clone(), msgs[2])
	var pe *natsjs.PublishError
	if !errors.As(err, &pe) || pe.Index != 2 || pe.MessageIndex() != 2 || !errors.Is(err, natsjs.ErrDuplicate) {
		t.Errorf("duplicate in a batch: %v", err)
	}
	if got := streamMsgs(t, n.stream); got != 3 {
		t.Errorf("stream holds %d messages, want 3", got)
	}
	if err := pub.Publish(ctx, "idemq-test.nowhere."+randomHex(4), msgs[0]); !errors.Is(err, natsjs.ErrNoStream) {
		t.Errorf("publish to a subject no stream captures: %v, want ErrNoStream", err)
	}
	if err := pub.Publish(ctx, "a.*", msgs[0]); err == nil {
		t.Error("publish to a wildcard subject succeeded")
	}
	_ = pub.Close()
	if err := pub.Publish(ctx, n.subject, msgs[0]); !errors.Is(err, natsjs.ErrPublisherClosed) {
		t.Errorf("publish after Close: %v", err)
	}
}

func TestBrowserEmptyAndClosed(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 20*time.Second)
	n := newTopology(t, 0)
	b := newBrowser(t, natsjs.BrowserConfig{Subject: n.dlqSubject})
	if _, err := b.Next(ctx); !errors.Is(err, io.EOF) {
		t.Errorf("Next on an empty subject: %v, want io.EOF", err)
	}
	_ = b.Close()
	if _, err := b.Next(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("Next after Close: %v, want ErrSourceClosed", err)
	}
	if _, err := natsjs.NewBrowser(ctx, natsjs.BrowserConfig{URL: serverURL(), Subject: "idemq-test.none." + randomHex(4)}); err == nil {
		t.Error("NewBrowser on a subject no stream captures succeeded")
	}
}

// TestDeadLettererAfterClose: the dead-letterer is owned by the Source.
func TestDeadLettererAfterClose(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 20*time.Second)
	n := newTopology(t, 0)
	src := newSource(t, n.config())
	dl := src.DeadLetterer()
	if dl != src.DeadLetterer() {
		t.Error("DeadLetterer returns different values")
	}
	m := &consumer.Message{ID: "x", Body: []byte("b"), Headers: map[string]string{jetstream.MsgIDHeader: "x", "Nats-Rollup": "all"}, Partition: -1, Offset: 9}
	f := consumer.Failure{Consumer: "c", MessageID: "x", Class: consumer.ClassPermanent, Err: errors.New("bad"), Attempts: 1}
	for range 2 { // twice: the DLQ must not discard the second as a duplicate
		if err := dl.DeadLetter(ctx, m, f); err != nil {
			t.Fatal(err)
		}
	}
	if got := streamMsgs(t, n.dlqStream); got != 2 {
		t.Errorf("DLQ holds %d messages, want 2", got)
	}
	_ = src.Close()
	if err := dl.DeadLetter(ctx, m, f); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("DeadLetter after Close: %v, want ErrSourceClosed", err)
	}
}

// TestSignedDeadLetterVerifies: a signed envelope survives the trip through
// the dead-letter stream (the Nats-* headers dropped are not signed).
func TestSignedDeadLetterVerifies(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 20*time.Second)
	n := newTopology(t, 0)
	key := []byte("0123456789abcdef0123456789abcdef")
	cfg := n.config()
	cfg.DeadLetter.Options = dlq.Options{SigningKey: key}
	src := newSource(t, cfg)
	m := &consumer.Message{ID: "x", Body: []byte("b"), Headers: map[string]string{jetstream.MsgIDHeader: "x"}, Partition: -1, Offset: 3}
	if err := src.DeadLetterer().DeadLetter(ctx, m, consumer.Failure{Consumer: "c", MessageID: "x", Class: consumer.ClassPermanent, Err: errors.New("bad")}); err != nil {
		t.Fatal(err)
	}
	d, err := newBrowser(t, natsjs.BrowserConfig{Subject: n.dlqSubject}).Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := dlq.Verify(d.Message(), key); err != nil {
		t.Errorf("browsed dead letter does not verify: %v", err)
	}
}

// TestRecoversDeletedConsumer: Receive recreates a durable consumer deleted
// under it and goes on delivering.
func TestRecoversDeletedConsumer(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	n := newTopology(t, 0)
	pub := newPublisher(t, natsjs.PublisherConfig{})
	msgs := brokertest.NewMessages("del", 2, 0)
	if err := pub.Publish(ctx, n.subject, msgs[0]); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, n.config())
	d := brokertest.Receive(ctx, t, src)
	if err := d.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	if err := js(t).DeleteConsumer(ctx, n.stream, n.durable); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(ctx, n.subject, msgs[1]); err != nil {
		t.Fatal(err)
	}
	// The recreated consumer starts at the beginning of the stream: the
	// first message comes again (dedup would skip it), then the second.
	seen := map[string]bool{}
	for len(seen) < 2 {
		d := brokertest.Receive(ctx, t, src)
		seen[string(d.Message().Body)] = true
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if st := src.Stats(); st.Restarts < 1 {
		t.Errorf("stats %+v, want a restart", st)
	}
}

// TestReceiveResumesSoonAfterALongOutage: while JetStream cannot create
// the consumer (here its stream is gone; in a cluster, the metadata
// leader is being elected, and creating it is refused with 503), Receive
// tries again with a backoff capped at 1 s, so that it resumes within
// about a second of the outage's end, however long the outage was. (With
// the cap at 5 s, a worker in long-nats-cluster resumed up to 7 s after
// the others.)
func TestReceiveResumesSoonAfterALongOutage(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	n := newTopology(t, 0)
	pub := newPublisher(t, natsjs.PublisherConfig{})
	msgs := brokertest.NewMessages("outage", 2, 0)
	if err := pub.Publish(ctx, n.subject, msgs[0]); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, n.config())
	if err := brokertest.Receive(ctx, t, src).Ack(ctx); err != nil {
		t.Fatal(err)
	}
	j := js(t)
	if err := j.DeleteStream(ctx, n.stream); err != nil {
		t.Fatal(err)
	}
	got := make(chan time.Time, 1)
	go func() {
		d, err := src.Receive(ctx)
		if err != nil {
			t.Errorf("Receive: %v", err)
			close(got)
			return
		}
		got <- time.Now()
		_ = d.Ack(ctx)
	}()
	time.Sleep(13 * time.Second) // the backoff reaches its cap
	if _, err := j.CreateStream(ctx, jetstream.StreamConfig{Name: n.stream, Subjects: []string{n.subject}}); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	if err := pub.Publish(ctx, n.subject, msgs[1]); err != nil {
		t.Fatal(err)
	}
	at, ok := <-got
	if !ok {
		return
	}
	if late := at.Sub(back); late > 2500*time.Millisecond {
		t.Fatalf("received %s after the stream came back, want within 2.5 s", late.Round(time.Millisecond))
	}
	if st := src.Stats(); st.Restarts < 5 {
		t.Fatalf("stats %+v: want a retry at least every second of the outage", st)
	}
}
