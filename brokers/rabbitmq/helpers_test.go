package rabbitmq_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
)

// keyHeader carries Message.Key, as the package documents.
const keyHeader = "x-idemq-key"

// amqpURL is the test broker: IDEMQ_TEST_AMQP_URL, or the local default.
func amqpURL() string {
	if u := os.Getenv("IDEMQ_TEST_AMQP_URL"); u != "" {
		return u
	}
	return rabbitmq.DefaultURL
}

func testCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func uniqueName(t *testing.T) string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	n := strings.NewReplacer("/", ".", " ", "_").Replace(t.Name())
	if len(n) > 80 {
		n = n[:80]
	}
	return "idemq-test." + n + "." + hex.EncodeToString(b[:])
}

// admin runs f on a fresh channel of a fresh connection.
func admin(t testing.TB, f func(ch *amqp.Channel) error) error {
	t.Helper()
	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		t.Fatalf("dial %s: %v", amqpURL(), err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	return f(ch)
}

// deleteLater deletes the queues at cleanup.
func deleteLater(t *testing.T, queues ...string) {
	t.Cleanup(func() {
		_ = admin(t, func(ch *amqp.Channel) error {
			for _, q := range queues {
				if _, err := ch.QueueDelete(q, false, false, false); err != nil {
					t.Errorf("delete queue %s: %v", q, err)
				}
			}
			return nil
		})
	})
}

// newQueue declares a fresh durable classic queue and its dead-letter
// queue, DLQName of it, which NewSource requires; both are deleted at
// cleanup.
func newQueue(t *testing.T) string {
	t.Helper()
	q := newBareQueue(t)
	declareQueue(t, rabbitmq.DLQName(q))
	return q
}

// newBareQueue declares a fresh durable classic queue without a dead-letter
// queue, deleted at cleanup.
func newBareQueue(t *testing.T) string {
	t.Helper()
	q := uniqueName(t)
	declareQueue(t, q)
	return q
}

// declareQueue declares the durable classic queue q, deleted at cleanup.
func declareQueue(t *testing.T, q string) {
	t.Helper()
	if err := admin(t, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		return err
	}); err != nil {
		t.Fatalf("declare queue %s: %v", q, err)
	}
	deleteLater(t, q)
}

// dlqSource returns a Source consuming the dead-letter queue dlqName, to
// read what was dead-lettered. A Source needs a dead-letter queue of its
// own: DLQName(dlqName) is declared for it, and deleted at cleanup.
func dlqSource(t *testing.T, dlqName string) *rabbitmq.Source {
	t.Helper()
	declareQueue(t, rabbitmq.DLQName(dlqName))
	return newSource(t, rabbitmq.Config{Queue: dlqName})
}

// queueState returns the ready messages and the consumers of q.
func queueState(t *testing.T, q string) (messages, consumers int) {
	t.Helper()
	if err := admin(t, func(ch *amqp.Channel) error {
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		messages, consumers = st.Messages, st.Consumers
		return err
	}); err != nil {
		t.Fatalf("inspect queue %s: %v", q, err)
	}
	return messages, consumers
}

// queueDepth returns the number of ready messages in q.
func queueDepth(t *testing.T, q string) int {
	t.Helper()
	var n int
	if err := admin(t, func(ch *amqp.Channel) error {
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		n = st.Messages
		return err
	}); err != nil {
		t.Fatalf("inspect queue %s: %v", q, err)
	}
	return n
}

func newPublisher(t *testing.T, cfg rabbitmq.PublisherConfig) *rabbitmq.Publisher {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = amqpURL()
	}
	p, err := rabbitmq.NewPublisher(testCtx(t, 30*time.Second), cfg)
	if err != nil {
		t.Fatalf("new publisher: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("close publisher: %v", err)
		}
	})
	return p
}

func newSource(t *testing.T, cfg rabbitmq.Config) *rabbitmq.Source {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = amqpURL()
	}
	s, err := rabbitmq.NewSource(testCtx(t, 30*time.Second), cfg)
	if err != nil {
		t.Fatalf("new source: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close source: %v", err)
		}
	})
	return s
}

// waitFor polls cond until it holds, failing t after d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond) // polling interval, not synchronisation
	}
}

// proxy is a TCP proxy to the broker whose connections a test can cut, to
// break AMQP connections mid-stream as a network failure would.
type proxy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu       sync.Mutex
	conns    map[net.Conn]struct{}
	cuts     int
	accepted int // client connections accepted
}

// proxyListener listens on a loopback port for a proxy to the test
// broker, whose address it returns.
func proxyListener(t *testing.T) (ln net.Listener, target string) {
	t.Helper()
	u, err := url.Parse(amqpURL())
	if err != nil {
		t.Fatal(err)
	}
	ln, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln, u.Host
}

func newProxy(t *testing.T) *proxy {
	t.Helper()
	ln, target := proxyListener(t)
	p := &proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		_ = ln.Close()
		p.Cut()
		p.wg.Wait()
	})
	return p
}

// URL is the broker URL through the proxy.
func (p *proxy) URL(t *testing.T) string {
	u, err := url.Parse(amqpURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Host = p.ln.Addr().String()
	return u.String()
}

func (p *proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.accepted++
		p.conns[c] = struct{}{}
		p.conns[up] = struct{}{}
		p.mu.Unlock()
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			_ = dst.Close()
			_ = src.Close()
			p.mu.Lock()
			delete(p.conns, dst)
			delete(p.conns, src)
			p.mu.Unlock()
		}
		p.wg.Go(func() { pipe(up, c) })
		p.wg.Go(func() { pipe(c, up) })
	}
}

// Accepted returns how many client connections the proxy has accepted and
// relayed: the AMQP connections opened through it.
func (p *proxy) Accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted
}

// Cut closes every proxied connection, both ways, and returns how many
// sockets it closed.
func (p *proxy) Cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for c := range p.conns {
		_ = c.Close()
		delete(p.conns, c)
		n++
	}
	p.cuts++
	return n
}

// mustAck acks d, failing t on error.
func mustAck(ctx context.Context, t *testing.T, d consumer.Delivery) {
	t.Helper()
	if err := d.Ack(ctx); err != nil {
		t.Fatalf("ack %q: %v", d.Message().Body, err)
	}
}

func isStale(err error) bool { return errors.Is(err, consumer.ErrDeliveryStale) }
