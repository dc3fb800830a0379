package natsjs_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/brokertest"
	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
)

// ackEater forwards NATS connections to the test server and, while
// dropping is set, discards the acks clients publish (PUB or HPUB to
// $JS.ACK.>): what a client sees while its durable consumer has no leader
// (the acks reach nobody, and no reply comes).
type ackEater struct {
	ln       net.Listener
	dropping atomic.Bool
	dropped  atomic.Int64
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

func newAckEater(t *testing.T) *ackEater {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &ackEater{ln: ln}
	target := strings.TrimPrefix(serverURL(), "nats://")
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			p.wg.Go(func() { p.filter(s, c); _ = s.Close() })
			p.wg.Go(func() { _, _ = io.Copy(c, s); _ = c.Close() })
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *ackEater) URL() string { return "nats://" + p.ln.Addr().String() }

// filter copies the client's protocol to the server, less the acks while
// dropping.
func (p *ackEater) filter(dst io.Writer, src io.Reader) {
	r := bufio.NewReader(src)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return
		}
		fields := bytes.Fields(line)
		var payload []byte
		if len(fields) >= 3 && (bytes.EqualFold(fields[0], []byte("PUB")) || bytes.EqualFold(fields[0], []byte("HPUB"))) {
			n, err := strconv.Atoi(string(fields[len(fields)-1])) // the total size
			if err != nil {
				return
			}
			payload = make([]byte, n+2) // and its CRLF
			if _, err := io.ReadFull(r, payload); err != nil {
				return
			}
			if p.dropping.Load() && bytes.HasPrefix(fields[1], []byte("$JS.ACK.")) {
				p.dropped.Add(1)
				continue
			}
		}
		if _, err := dst.Write(append(line, payload...)); err != nil {
			return
		}
	}
}

// ackEaterDelivery publishes one message to a fresh stream and returns the
// delivery of it to a Source with AckWait ackWait whose connection goes
// through an ackEater.
func ackEaterDelivery(ctx context.Context, t *testing.T, ackWait time.Duration) (names, *ackEater, *natsjs.Source, consumer.Delivery) {
	t.Helper()
	n := newTopology(t, 0)
	px := newAckEater(t)
	cfg := n.config()
	cfg.URL = px.URL()
	cfg.AckWait = ackWait
	src := newSource(t, cfg)
	pub := newPublisher(t, natsjs.PublisherConfig{})
	if err := pub.Publish(ctx, n.subject, &consumer.Message{ID: "m-1", Body: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	d := brokertest.Receive(ctx, t, src)
	return n, px, src, d
}

// TestAckRetriedUntilAckWait: an ack that gets no answer (the durable's
// leader is gone, say) is sent again until the server answers, within
// AckWait: Ack then succeeds, the message is not handed out again, and
// the consumer's ack-pending count drops at once rather than after
// AckWait.
func TestAckRetriedUntilAckWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	n, px, src, d := ackEaterDelivery(ctx, t, 20*time.Second)

	px.dropping.Store(true)
	time.AfterFunc(2*time.Second, func() { px.dropping.Store(false) })
	start := time.Now()
	if err := d.Ack(ctx); err != nil {
		t.Fatalf("Ack after 2s of lost acks: %v", err)
	}
	t.Logf("acked after %s, %d acks lost", time.Since(start).Round(time.Millisecond), px.dropped.Load())
	if px.dropped.Load() == 0 {
		t.Fatal("no ack was dropped: the test did not test anything")
	}
	if pending, floor := ackState(ctx, t, n); pending != 0 || floor != 1 {
		t.Fatalf("ack pending %d, ack floor %d: want the message acked", pending, floor)
	}
	if st := src.Stats(); st.Acked != 1 || st.AckFailures != 0 || st.AckRetries == 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestAckGivesUpAtAckWait: acks that get no answer are sent again only
// until the message's AckWait runs out, when JetStream hands it out again
// anyway: Ack then fails with consumer.ErrDeliveryStale, rather than hold
// its caller for the whole of ctx.
func TestAckGivesUpAtAckWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	_, px, src, d := ackEaterDelivery(ctx, t, 3*time.Second)
	px.dropping.Store(true)
	err := d.Ack(ctx)
	if !errors.Is(err, consumer.ErrDeliveryStale) || ctx.Err() != nil {
		t.Fatalf("Ack with every ack lost: %v (ctx %v), want ErrDeliveryStale before ctx ends", err, ctx.Err())
	}
	if st := src.Stats(); st.AckFailures != 1 || st.AckRetries == 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestAckBatchRetriedUntilAnswered: a batch's acks that get no answer
// are sent again, each, until the server answers; AckBatch then succeeds
// and every message of the batch is acked on the server.
func TestAckBatchRetriedUntilAnswered(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	n := newTopology(t, 0)
	px := newAckEater(t)
	cfg := n.config()
	cfg.URL = px.URL()
	cfg.AckWait = 20 * time.Second
	src := newSource(t, cfg)
	src.Configure(consumer.SourceSettings{Window: 32})
	pub := newPublisher(t, natsjs.PublisherConfig{})
	const count = 20
	for i := range count {
		if err := pub.Publish(ctx, n.subject, &consumer.Message{ID: "m-" + strconv.Itoa(i), Body: []byte("x")}); err != nil {
			t.Fatal(err)
		}
	}
	ds := make([]consumer.Delivery, count)
	for i := range ds {
		ds[i] = brokertest.Receive(ctx, t, src)
	}

	px.dropping.Store(true)
	time.AfterFunc(time.Second, func() { px.dropping.Store(false) })
	if err := src.AckBatch(ctx, ds); err != nil {
		t.Fatalf("AckBatch after 1s of lost acks: %v", err)
	}
	if px.dropped.Load() < count {
		t.Fatalf("%d acks dropped: the test did not test anything", px.dropped.Load())
	}
	if pending, floor := ackState(ctx, t, n); pending != 0 || floor != count {
		t.Fatalf("ack pending %d, ack floor %d: want all %d acked", pending, floor, count)
	}
	if st := src.Stats(); st.Acked != count || st.AckFailures != 0 || st.AckRetries < count {
		t.Fatalf("stats %+v: want %d acked, each sent again at least once", st, count)
	}
	for _, d := range ds {
		if err := d.Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
			t.Fatalf("a second ack: %v, want ErrDeliveryStale", err)
		}
	}
}

// TestAckWithNoRespondersRetriesAtBackoff: an ack nobody takes (here the
// durable is gone; in a cluster, while it has no leader) is answered by
// the server with a no-responders status. That answer acks nothing, and
// the ack is sent again after the backoff (50 ms, doubling), not at the
// end of a 2 s attempt, until AckWait runs out.
func TestAckWithNoRespondersRetriesAtBackoff(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	n := newTopology(t, 0)
	cfg := n.config()
	cfg.AckWait = 3 * time.Second
	src := newSource(t, cfg)
	pub := newPublisher(t, natsjs.PublisherConfig{})
	if err := pub.Publish(ctx, n.subject, &consumer.Message{ID: "m-1", Body: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	d := brokertest.Receive(ctx, t, src)
	if err := js(t).DeleteConsumer(ctx, n.stream, n.durable); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err := d.Ack(ctx)
	if !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Fatalf("Ack with nobody to take it: %v, want ErrDeliveryStale", err)
	}
	took := time.Since(start)
	// 50+100+200+400+800+1000 ms of backoff fit in AckWait's 3 s: six
	// retries, where waiting out 2 s attempts sends one.
	if st := src.Stats(); st.AckRetries < 4 || st.AckFailures != 1 || st.Acked != 0 {
		t.Fatalf("stats %+v after %s: want 4 or more retries", st, took)
	}
	if took > cfg.AckWait+time.Second {
		t.Fatalf("Ack gave up after %s, AckWait is %s", took, cfg.AckWait)
	}
}

// TestAckBatchOfAnotherSourcesDeliveries: AckBatch given deliveries of
// another Source (on another durable) acks each through that Source, and
// its own as a batch; both durables then hold nothing unacked.
func TestAckBatchOfAnotherSourcesDeliveries(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	pub := newPublisher(t, natsjs.PublisherConfig{})
	var (
		tops []names
		srcs []*natsjs.Source
		ds   []consumer.Delivery
	)
	for i := range 2 {
		n := newTopology(t, 0)
		src := newSource(t, n.config())
		for j := range 2 {
			if err := pub.Publish(ctx, n.subject, &consumer.Message{ID: fmt.Sprintf("m-%d-%d", i, j), Body: []byte("x")}); err != nil {
				t.Fatal(err)
			}
			ds = append(ds, brokertest.Receive(ctx, t, src))
		}
		tops, srcs = append(tops, n), append(srcs, src)
	}
	if err := srcs[0].AckBatch(ctx, ds); err != nil {
		t.Fatalf("AckBatch of both Sources' deliveries: %v", err)
	}
	for i, n := range tops {
		if pending, floor := ackState(ctx, t, n); pending != 0 || floor != 2 {
			t.Fatalf("source %d: ack pending %d, ack floor %d: want both acked", i, pending, floor)
		}
		if st := srcs[i].Stats(); st.Acked != 2 {
			t.Fatalf("source %d: stats %+v, want 2 acked", i, st)
		}
	}
}

// ackState returns n's durable's count of unacked deliveries and its ack
// floor (a stream sequence).
func ackState(ctx context.Context, t *testing.T, n names) (pending int, floor uint64) {
	t.Helper()
	c, err := js(t).Consumer(ctx, n.stream, n.durable)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return info.NumAckPending, info.AckFloor.Stream
}
