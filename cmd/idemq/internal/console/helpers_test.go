package console

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/httpidem"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}

// memQueue is a dead-letter queue in memory with a browser's semantics:
// a browse sees the messages present when it opened; Ack removes one.
type memQueue struct {
	mu        sync.Mutex
	msgs      []*consumer.Message
	published []published
	openErr   error
	pubErr    error
}

type published struct {
	dest string
	msg  *consumer.Message
}

func (q *memQueue) add(m ...*consumer.Message) {
	q.mu.Lock()
	q.msgs = append(q.msgs, m...)
	q.mu.Unlock()
}

func (q *memQueue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.msgs)
}

func (q *memQueue) sent() []published {
	q.mu.Lock()
	defer q.mu.Unlock()
	return slices.Clone(q.published)
}

func (q *memQueue) dlq(name string) DLQ {
	return DLQ{Broker: "memory", Name: name,
		Depth: func(context.Context) (int64, error) { return int64(q.len()), nil },
		Open: func(_ context.Context, publish bool) (*Conn, error) {
			if q.openErr != nil {
				return nil, q.openErr
			}
			q.mu.Lock()
			snap := slices.Clone(q.msgs)
			q.mu.Unlock()
			b := &memBrowser{q: q, snap: snap}
			c := &Conn{Browser: b, Close: func() { _ = b.Close() }}
			if publish {
				c.Publish = func(_ context.Context, dest string, m *consumer.Message) error {
					if q.pubErr != nil {
						return q.pubErr
					}
					q.mu.Lock()
					q.published = append(q.published, published{dest, m})
					q.mu.Unlock()
					return nil
				}
			}
			return c, nil
		}}
}

type memBrowser struct {
	q    *memQueue
	snap []*consumer.Message
	i    int
}

func (b *memBrowser) Next(ctx context.Context) (consumer.Delivery, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if b.i >= len(b.snap) {
		return nil, fmt.Errorf("memory: %w", io.EOF)
	}
	m := b.snap[b.i]
	b.i++
	return &memDelivery{q: b.q, m: m}, nil
}

func (b *memBrowser) Close() error { return nil }

type memDelivery struct {
	q *memQueue
	m *consumer.Message
}

func (d *memDelivery) Message() *consumer.Message { return d.m.Clone() }
func (d *memDelivery) Ack(context.Context) error {
	d.q.mu.Lock()
	defer d.q.mu.Unlock()
	d.q.msgs = slices.DeleteFunc(d.q.msgs, func(m *consumer.Message) bool { return m == d.m })
	return nil
}
func (d *memDelivery) Nack(context.Context, bool) error { return nil }

var (
	signingKey = []byte("0123456789abcdef0123456789abcdef")
	forgeryKey = []byte("not-the-key-not-the-key-not-the!")
)

// deadLetter makes a signed dead letter of consumer name from source.
func deadLetter(name, source, id string, class consumer.FailureClass, errText string, body []byte, headers map[string]string, key []byte) *consumer.Message {
	now := time.Now().UTC().Add(-time.Minute)
	m := &consumer.Message{ID: id, Key: "customer-" + id, Body: body, Headers: headers, Source: source, Partition: -1, Offset: -1}
	opts := dlq.Options{Host: "worker-1", SigningKey: key}
	// A first failure, then the message replayed and failing again: a
	// history of two.
	first := dlq.Envelope(m, consumer.Failure{Consumer: name, MessageID: id, Class: consumer.ClassRetryableExhausted,
		Err: errors.New("timeout talking to the bank"), Attempts: 3, FirstFailure: now.Add(-time.Hour), LastFailure: now.Add(-time.Hour + time.Second)}, opts)
	return dlq.Envelope(first, consumer.Failure{Consumer: name, MessageID: id, Class: class, Err: errors.New(errText),
		Attempts: 1, FirstFailure: now, LastFailure: now}, opts)
}

// bundle is a console under test with its collaborators.
type bundle struct {
	t      *testing.T
	srv    *Server
	ts     *httptest.Server
	pool   *pgxpool.Pool
	store  *processed.Store
	schema string
	q      *memQueue
}

type option func(*Config)

func readOnly(c *Config)           { c.ReadOnly = true }
func noTokens(c *Config)           { c.Tokens = nil }
func pageSize(n int) option        { return func(c *Config) { c.PageSize = n } }
func withQueue(q *memQueue) option { return func(c *Config) { c.DLQs = []DLQ{q.dlq("payments.dlq")} } }

// newBundle seeds a schema with a dedup table, an outbox, an HTTP key
// table and a dead-letter queue of four groups, and serves a console on
// them.
func newBundle(t *testing.T, opts ...option) *bundle {
	t.Helper()
	ctx := context.Background()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	q := &memQueue{}
	json := []byte(`{"amount":42,"currency":"EUR"}`)
	q.add(
		deadLetter("ledger", "payments", "pay-1", consumer.ClassPermanent, `charge "pay-1" failed: card 4242 declined`, json, map[string]string{"trace": "t1"}, signingKey),
		deadLetter("ledger", "payments", "pay-2", consumer.ClassPermanent, `charge "pay-2" failed: card 1111 declined`, []byte(`{"amount":7}`), nil, signingKey),
		deadLetter("ledger", "payments", "pay-3", consumer.ClassPermanent, `charge "pay-3" failed: card 9 declined`, []byte(`{"amount":3}`), nil, signingKey),
		deadLetter("ledger", "payments", "evil-1", consumer.ClassPanic, "panic: <b>boom</b>", []byte(`<script>alert("body")</script>`),
			map[string]string{"x-note": `<img src=x onerror=alert("header")>`}, signingKey),
		deadLetter("ledger", "payments", "bin-1", consumer.ClassTooLarge, "message too large: 70000 bytes", []byte{0x00, 0xff, 0x10, 'A', 0x80}, nil, signingKey),
		deadLetter("ledger", "refunds", "forged-1", consumer.ClassPermanent, "refund rejected", []byte(`{"refund":1}`), nil, forgeryKey),
	)
	// pay-1 was applied with its payload; pay-3 with another one.
	tbl := pgx.Identifier{schema, "processed_messages"}.Sanitize()
	for _, r := range []struct {
		id, body string
	}{{"pay-1", string(json)}, {"pay-3", `{"amount":333}`}, {"other-9", "x"}} {
		fp := (&consumer.Message{Body: []byte(r.body)}).Fingerprint()
		if _, err := pool.Exec(ctx, `INSERT INTO `+tbl+` (consumer, message_id, fingerprint, source, partition, "offset", processed_at) VALUES ('ledger', $1, $2, 'payments', 2, 1234, now() - interval '2 days')`, r.id, fp[:]); err != nil {
			t.Fatal(err)
		}
	}
	ob, err := outbox.New(pool, outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Enqueue(ctx, tx, outbox.Message{Destination: "events", ID: "e1", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	hm, err := httpidem.New(pool, httpidem.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := hm.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	fp := (&consumer.Message{}).Fingerprint()
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "idempotency_keys"}.Sanitize()+` (scope, key, fingerprint, method, path, state, status, completed_at) VALUES ('', 'key-1', $1, 'POST', '/orders', 'completed', 201, now())`, fp[:]); err != nil {
		t.Fatal(err)
	}

	cfg := Config{Store: store, DB: pool, Retention: 24 * time.Hour, DLQs: []DLQ{q.dlq("payments.dlq")},
		Tokens: []Token{{Name: "alice", Secret: "alice-secret-1"}}, VerifyKeys: [][]byte{signingKey}, Rate: 1000,
		Outbox: Table{Schema: schema, Name: "outbox"}, HTTPKeys: Table{Schema: schema, Name: "idempotency_keys"},
		Info:    [][2]string{{"Postgres", "postgres://app:xxxxx@db/prod"}},
		Secrets: []string{"amqp://guest:hunter2hunter2@rabbit:5672/"}}
	for _, o := range opts {
		o(&cfg)
	}
	srv, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(func() {
		ts.Close()
		srv.Close()
	})
	return &bundle{t: t, srv: srv, ts: ts, pool: pool, store: store, schema: schema, q: q}
}

// client is a browser: a cookie jar, and the CSRF token of the last page.
type client struct {
	b    *bundle
	http *http.Client
	csrf string
}

// client is a browser signed in as alice when the console has tokens
// (every page then needs a sign-in); anonymous, one that is not.
func (b *bundle) client() *client {
	c := b.anonymous()
	if len(b.srv.cfg.Tokens) > 0 {
		c.login("alice-secret-1")
	}
	return c
}

func (b *bundle) anonymous() *client {
	jar, _ := cookiejar.New(nil)
	return &client{b: b, http: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// get fetches path and returns the status and body.
func (c *client) get(path string) (int, string, http.Header) {
	c.b.t.Helper()
	resp, err := c.http.Get(c.b.ts.URL + path)
	if err != nil {
		c.b.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if m := csrfRE.FindSubmatch(body); m != nil {
		c.csrf = string(m[1])
	}
	return resp.StatusCode, string(body), resp.Header
}

func (c *client) mustGet(path string) string {
	c.b.t.Helper()
	code, body, _ := c.get(path)
	if code != http.StatusOK {
		c.b.t.Fatalf("GET %s: %d\n%s", path, code, body)
	}
	return body
}

// post sends a form, same-origin unless headers say otherwise.
func (c *client) post(path string, form url.Values, headers map[string]string) (int, string, http.Header) {
	c.b.t.Helper()
	req, _ := http.NewRequest(http.MethodPost, c.b.ts.URL+path, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", c.b.ts.URL)
	for k, v := range headers {
		if v == "" {
			req.Header.Del(k)
		} else {
			req.Header.Set(k, v)
		}
	}
	resp, err := c.http.Do(req)
	if err != nil {
		c.b.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), resp.Header
}

func (c *client) login(secret string) {
	c.b.t.Helper()
	c.mustGet("/login")
	code, body, _ := c.post("/login", url.Values{"csrf": {c.csrf}, "token": {secret}, "next": {"/"}}, nil)
	if code != http.StatusSeeOther {
		c.b.t.Fatalf("login: %d\n%s", code, body)
	}
}

// group returns the fingerprint of the group holding id.
func (b *bundle) fingerprint(id string) string {
	b.t.Helper()
	for _, m := range b.q.msgs {
		r, err := dlq.Parse(m)
		if err == nil && r.MessageID == id {
			return r.Entry.Fingerprint()
		}
	}
	b.t.Fatalf("no dead letter %q", id)
	return ""
}

func sel(fp string, ids ...string) string {
	v := url.Values{"dlq": {"memory:payments.dlq"}, "fp": {fp}}
	if len(ids) > 0 {
		v["id"] = ids
	}
	return v.Encode()
}

var confirmRE = regexp.MustCompile(`name="confirm" value="([^"]+)"`)

func must(t *testing.T, body string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(body, w) {
			t.Errorf("page lacks %q", w)
		}
	}
}

func mustNot(t *testing.T, body string, bad ...string) {
	t.Helper()
	for _, w := range bad {
		if strings.Contains(body, w) {
			t.Errorf("page holds %q", w)
		}
	}
}

// migratedStore is a dedup store of cfg on pool, migrated.
func migratedStore(t *testing.T, pool *pgxpool.Pool, cfg processed.Config) *processed.Store {
	t.Helper()
	store, err := processed.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return store
}
