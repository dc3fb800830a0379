package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/redact"
)

// natsIDHeader carries the bench's message id on NATS instead of
// Nats-Msg-Id: JetStream discards a message whose Nats-Msg-Id it stored
// within its duplicate window (2 minutes), so the workload's duplicates
// would never reach the consumer, and dedup would not be measured. The
// Publisher sets no Nats-Msg-Id for a Message without ID; the runtime reads
// the id from this header (consumer.Config.MessageID).
const natsIDHeader = "bench-msg-id"

// natsAckWait is the AckWait of the raw consumers (the Source's default,
// 30s).
const natsAckWait = 30 * time.Second

// --- NATS JetStream ---

type natsEnv struct {
	cfg Config
	nc  *nats.Conn
	js  jetstream.JetStream
	pub *natsjs.Publisher
}

func newNATSEnv(ctx context.Context, cfg Config) (*natsEnv, error) {
	nc, err := dialNATS(cfg.NATSURL, "idemq-bench")
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	// Fail now, saying so, if JetStream is not enabled on the server.
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = js.AccountInfo(actx)
	cancel()
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("JetStream at %s (is the server started with -js?): %w", redact.URL(cfg.NATSURL), err)
	}
	pub, err := natsjs.NewPublisher(ctx, natsjs.PublisherConfig{URL: cfg.NATSURL})
	if err != nil {
		nc.Close()
		return nil, err
	}
	return &natsEnv{cfg: cfg, nc: nc, js: js, pub: pub}, nil
}

// dialNATS opens a raw nats.go connection. Its error names the URL without
// its password.
func dialNATS(url, name string) (*nats.Conn, error) {
	nc, err := nats.Connect(url, nats.Name(name), nats.Timeout(10*time.Second), nats.MaxReconnects(-1))
	if err != nil {
		return nil, redact.Error(fmt.Errorf("connect to NATS at %s (set --nats-url or NATS_URL): %w", redact.URL(url), err), url)
	}
	return nc, nil
}

func (e *natsEnv) target(ctx context.Context, m Mode) (target, error) {
	name := targetName(m)
	t := &natsTarget{e: e, stream: name, subject: "idemq.bench." + name}
	// The work stream and the stream of its dead letters, as a user
	// declares them (Topology's defaults: file storage, one replica).
	for _, sc := range []jetstream.StreamConfig{
		{Name: t.stream, Subjects: []string{t.subject}},
		{Name: t.stream + natsjs.DLQStreamSuffix, Subjects: []string{natsjs.DLQSubject(t.subject)}},
	} {
		if _, err := e.js.CreateStream(ctx, sc); err != nil {
			t.cleanup()
			return nil, fmt.Errorf("create stream %s: %w", sc.Name, err)
		}
	}
	return t, nil
}

func (e *natsEnv) close() {
	if e == nil {
		return
	}
	_ = e.pub.Close()
	e.nc.Close()
}

type natsTarget struct {
	e               *natsEnv
	stream, subject string
}

func (t *natsTarget) publish(ctx context.Context, msgs []*consumer.Message) error {
	out := make([]*consumer.Message, len(msgs))
	for i, m := range msgs {
		h := make(map[string]string, len(m.Headers)+1)
		for k, v := range m.Headers {
			h[k] = v
		}
		h[natsIDHeader] = m.ID
		out[i] = &consumer.Message{Key: m.Key, Body: m.Body, Headers: h}
	}
	return t.e.pub.Publish(ctx, t.subject, out...)
}

// source is the adapter's Source with its defaults: MaxAckPending twice the
// runtime's window, which consumer.New passes to Configure.
func (t *natsTarget) source(ctx context.Context, m Mode) (consumer.Source, error) {
	return natsjs.NewSource(ctx, natsjs.Config{
		URL:     t.e.cfg.NATSURL,
		Stream:  t.stream,
		Subject: t.subject,
		Durable: "bench-" + string(m),
	})
}

// consume is the plain nats.go jetstream recipe: one durable pull consumer
// with explicit acks and MaxAckPending at the prefetch, one Messages
// iterator, workers goroutines calling Next, and a plain (unconfirmed) Ack
// per message, as a hand-written consumer does: a lost ack only brings the
// message back, which the dedup table absorbs.
func (t *natsTarget) consume(ctx context.Context, m Mode, workers int, handle rawHandler) error {
	nc, err := dialNATS(t.e.cfg.NATSURL, "idemq-bench-"+string(m))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	pf := prefetch(t.e.cfg, m)
	cons, err := js.CreateOrUpdateConsumer(ctx, t.stream, jetstream.ConsumerConfig{
		Durable:       "bench-raw-" + string(m),
		FilterSubject: t.subject,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       natsAckWait,
		MaxDeliver:    -1,
		MaxAckPending: pf,
	})
	if err != nil {
		return fmt.Errorf("create consumer: %w", err)
	}
	// The pull expiry natsjs.Source uses, 2 s, and for its reason: a pull
	// that reaches nats-server 2.9 while MaxAckPending is reached may go
	// unanswered until it expires, 30 s by the client's default. naive-1
	// (MaxAckPending 2) met it under CI's load: 230 of 400 settled in 30 s.
	it, err := cons.Messages(jetstream.PullMaxMessages(pf), jetstream.PullExpiry(2*time.Second))
	if err != nil {
		return fmt.Errorf("pull: %w", err)
	}
	defer it.Stop()
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				msg, err := it.Next(jetstream.NextContext(ctx))
				if err != nil {
					if ctx.Err() != nil || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
						return
					}
					sleepCtx(ctx, 10*time.Millisecond)
					continue
				}
				h := msg.Headers()
				if err := handle(ctx, h.Get(natsIDHeader), msg.Data(), h.Get(HeaderPublishedAt)); err != nil {
					_ = msg.Nak()
					continue
				}
				_ = msg.Ack()
			}
		}()
	}
	wg.Wait()
	return nil
}

func (t *natsTarget) ready(context.Context, int) error { return nil }

func (t *natsTarget) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, s := range []string{t.stream, t.stream + natsjs.DLQStreamSuffix} {
		_ = t.e.js.DeleteStream(ctx, s)
	}
}
