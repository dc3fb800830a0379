// Package e2e drives the web console of `idemq console` in a real browser:
// Playwright (playwright-core, installed here with npm ci) steering Debian's
// chromium, against a console served in-process on seeded data in Postgres,
// a RabbitMQ dead-letter queue and a Kafka dead-letter topic on kfake.
//
// It runs only with IDEMQ_BROWSER_TEST=1 (CI runs it explicitly). It needs
// /usr/bin/chromium (apt-get install -y chromium), node, and `npm ci` run
// in this directory. Screenshots go to $IDEMQ_BROWSER_ARTIFACTS, or a new
// temporary directory; with IDEMQ_BROWSER_DOCS=1 the dead-letters, dry-run and
// overview-with-charts screenshots are also copied to docs/ in the
// repository.
package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/cmd/idemq/internal/console"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/httpidem"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

const token = "e2e:e2e-browser-secret"

var (
	signingKey = []byte("e2e-signing-key-0123456789abcdef")
	forgeryKey = []byte("someone-else-s-key-0123456789abc")
)

func TestConsoleInBrowser(t *testing.T) {
	if os.Getenv("IDEMQ_BROWSER_TEST") != "1" {
		t.Skip("browser test: set IDEMQ_BROWSER_TEST=1 to run it (needs /usr/bin/chromium, node and `npm ci` in cmd/idemq/internal/console/e2e; CI runs it explicitly)")
	}
	for _, need := range []string{"/usr/bin/chromium", "node_modules/playwright-core"} {
		if _, err := os.Stat(need); err != nil {
			t.Fatalf("%s is missing: apt-get install -y chromium; (cd cmd/idemq/internal/console/e2e && npm ci)", need)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	work, dead := rabbitQueues(t)

	// Postgres: a dedup table with pay-1 applied, and an outbox.
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(pool, outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	hm, err := httpidem.New(pool, httpidem.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := hm.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	zero := (&consumer.Message{}).Fingerprint()
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "idempotency_keys"}.Sanitize()+
		` (scope, key, fingerprint, method, path, state, status, completed_at) VALUES ('', 'order-7f3a', $1, 'POST', '/orders', 'completed', 201, now())`, zero[:]); err != nil {
		t.Fatal(err)
	}
	payBody := func(id string) []byte {
		return []byte(fmt.Sprintf(`{"payment":%q,"amount":4200,"currency":"EUR"}`, id))
	}
	fp := (&consumer.Message{Body: payBody("pay-1")}).Fingerprint()
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "processed_messages"}.Sanitize()+
		` (consumer, message_id, fingerprint, source, processed_at) VALUES ('ledger', 'pay-1', $1, $2, now() - interval '3 hours')`, fp[:], work); err != nil {
		t.Fatal(err)
	}

	// A day of activity for the charts: ledger's rows denser towards now,
	// shipping's in the last six hours; a janitor report every ten
	// minutes; unsent outbox rows due over the day, two leased.
	dd := pgx.Identifier{schema, "processed_messages"}.Sanitize()
	for _, q := range []struct {
		sql  string
		args []any
	}{
		{`INSERT INTO ` + dd + ` (consumer, message_id, fingerprint, source, processed_at)
SELECT 'ledger', 'bulk-' || i, $1, $2, now() - (random() ^ 2) * interval '24 hours' FROM generate_series(1, 12000) AS i`, []any{fp[:], work}},
		{`INSERT INTO ` + dd + ` (consumer, message_id, fingerprint, source, processed_at)
SELECT 'shipping', 'ship-' || i, $1, $2, now() - random() * interval '6 hours' FROM generate_series(1, 3000) AS i`, []any{fp[:], "orders"}},
		{`INSERT INTO ` + pgx.Identifier{schema, "processed_messages_retention"}.Sanitize() + ` (consumer, window_start, window_end, duplicates, max_ms, buckets, bucket_bounds_ms, retention_ms)
SELECT 'ledger', now() - (i + 1) * interval '10 minutes', now() - i * interval '10 minutes', d, 900 + 400 * d,
       ARRAY[d / 2, d - d / 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]::bigint[],
       '{1000,10000,60000,300000,900000,1800000,3600000,7200000,14400000,28800000,43200000,86400000,172800000,259200000,604800000,1209600000,2592000000}', 604800000
FROM generate_series(0, 143) AS i, LATERAL (SELECT (20 + 15 * sin(i / 9.0))::bigint AS d) AS x`, nil},
		{`INSERT INTO ` + pgx.Identifier{schema, "outbox"}.Sanitize() + ` (destination, message_id, body, next_attempt_at)
SELECT 'events', 'evt-' || i, '\x00', CASE WHEN i <= 2 THEN now() + interval '30 seconds' ELSE now() - (random() ^ 3) * interval '24 hours' END
FROM generate_series(1, 60) AS i`, nil},
	} {
		if _, err := pool.Exec(ctx, q.sql, q.args...); err != nil {
			t.Fatal(err)
		}
	}

	// RabbitMQ: the DLQ of the work queue, with four failure groups.
	rpub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer rpub.Close()
	now := time.Now().UTC()
	letter := func(name, source, id string, class consumer.FailureClass, errText string, body []byte, headers map[string]string, key []byte) *consumer.Message {
		m := &consumer.Message{ID: id, Body: body, Headers: headers, Source: source, Partition: -1, Offset: -1}
		first := dlq.Envelope(m, consumer.Failure{Consumer: name, MessageID: id, Class: consumer.ClassRetryableExhausted,
			Err: errors.New("dial tcp 10.0.0.7:5432: i/o timeout"), Attempts: 5, FirstFailure: now.Add(-26 * time.Hour), LastFailure: now.Add(-25 * time.Hour)},
			dlq.Options{Host: "worker-2", SigningKey: key})
		return dlq.Envelope(first, consumer.Failure{Consumer: name, MessageID: id, Class: class, Err: errors.New(errText),
			Attempts: 1, FirstFailure: now.Add(-time.Hour), LastFailure: now.Add(-time.Hour)}, dlq.Options{Host: "worker-1", SigningKey: key})
	}
	for _, m := range []*consumer.Message{
		letter("ledger", work, "pay-1", consumer.ClassPermanent, `charge "pay-1" failed: card 4242 declined`, payBody("pay-1"), map[string]string{"trace-id": "7f3a"}, signingKey),
		letter("ledger", work, "pay-2", consumer.ClassPermanent, `charge "pay-2" failed: card 1881 declined`, payBody("pay-2"), map[string]string{"trace-id": "7f3b"}, signingKey),
		letter("ledger", work, "pay-3", consumer.ClassPermanent, `charge "pay-3" failed: card 5100 declined`, payBody("pay-3"), map[string]string{"trace-id": "7f3c"}, signingKey),
		letter("ledger", work, "note-1", consumer.ClassPanic, `panic: template: <script>alert("err")</script>`, []byte(`<script>alert("body")</script><img src=x onerror=alert("img")>`),
			map[string]string{"x-note": `<script>alert("header")</script>`}, signingKey),
		letter("ledger", work, "blob-1", consumer.ClassTooLarge, "message of 70000 bytes exceeds 65536", []byte{0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0xff, 0xfe}, nil, signingKey),
		// A forged envelope: signed, but not with the consumer's key.
		letter("ledger", work, "forged-1", consumer.ClassPermanent, "refund of 9999 EUR rejected", []byte(`{"refund":9999}`), nil, forgeryKey),
	} {
		if err := rpub.Publish(ctx, "", dead, m); err != nil {
			t.Fatal(err)
		}
	}

	// Kafka on kfake: a DLQ topic with one group of two.
	kc := kafkatest.Start(t)
	topic := kafkatest.Name(t, "orders")
	kc.CreateTopic(t, topic, 1)
	kc.CreateTopic(t, topic+".dlq", 1)
	kpub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: kc.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	defer kpub.Close()
	for i, id := range []string{"ord-17", "ord-18"} {
		m := &consumer.Message{ID: id, Body: []byte(fmt.Sprintf(`{"order":%q}`, id)), Source: topic, Partition: 0, Offset: int64(100 + i)}
		env := dlq.Envelope(m, consumer.Failure{Consumer: "shipping", MessageID: id, Class: consumer.ClassTimeout,
			Err: fmt.Errorf("handler timed out after %ds", 30+i), Attempts: 3, FirstFailure: now.Add(-2 * time.Hour), LastFailure: now.Add(-90 * time.Minute)},
			dlq.Options{Host: "worker-3", SigningKey: signingKey})
		if err := kpub.Publish(ctx, topic+".dlq", env); err != nil {
			t.Fatal(err)
		}
	}

	// The console, in-process, on a free loopback port.
	tok, err := console.ParseToken(token)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := console.New(console.Config{Store: store, DB: pool, Retention: 7 * 24 * time.Hour,
		DLQs:   []console.DLQ{rabbitDLQ(dead), kafkaDLQ(kc.Addrs(), topic+".dlq")},
		Tokens: []console.Token{tok}, VerifyKeys: [][]byte{signingKey}, Rate: 100,
		Outbox: console.Table{Schema: schema, Name: "outbox"}, HTTPKeys: console.Table{Schema: schema, Name: "idempotency_keys"},
		// `idemq console` reads this with `idemq status`'s code; here, the
		// same two facts from the seeded table.
		Status: func(ctx context.Context, _ console.Shard, name string) (console.ConsumerStatus, error) {
			st, err := store.Stats(ctx, name)
			if err != nil {
				return console.ConsumerStatus{}, err
			}
			eligible := int64(0)
			cs := console.ConsumerStatus{Consumer: name, Rows: st.Rows, Oldest: st.Oldest, PurgeEligible: &eligible}
			switch last, err := store.Lookup(ctx, name, "pay-1"); {
			case err == nil:
				cs.LastApplied = &last
			case !errors.Is(err, processed.ErrNotFound): // shipping applied no pay-1
				return console.ConsumerStatus{}, err
			}
			return cs, nil
		},
		Info: [][2]string{{"RabbitMQ", "amqp://guest:xxxxx@127.0.0.1:5672/"}, {"Kafka", strings.Join(kc.Addrs(), ",")}}})
	if err != nil {
		t.Fatal(err)
	}
	sctx, stop := context.WithCancel(ctx)
	addrc := make(chan net.Addr, 1)
	served := make(chan error, 1)
	go func() { served <- console.ListenAndServe(sctx, "127.0.0.1:0", srv, func(a net.Addr) { addrc <- a }) }()
	defer func() {
		stop()
		if err := <-served; err != nil {
			t.Errorf("console: %v", err)
		}
	}()
	var base string
	select {
	case a := <-addrc:
		base = "http://" + a.String()
	case err := <-served:
		t.Fatalf("console: %v", err)
	}

	out := os.Getenv("IDEMQ_BROWSER_ARTIFACTS")
	if out == "" {
		if out, err = os.MkdirTemp("", "idemq-console-e2e-"); err != nil {
			t.Fatal(err)
		}
	} else if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshots in %s", out)
	cmd := exec.CommandContext(ctx, "node", "run.mjs", base, token, out)
	cmd.Env = append(os.Environ(), "E2E_KAFKA_TOPIC="+topic+".dlq", "E2E_RABBIT_QUEUE="+dead)
	b, err := cmd.CombinedOutput()
	t.Logf("node run.mjs:\n%s", b)
	if err != nil {
		t.Fatalf("the browser test failed: %v", err)
	}

	// What the browser did, seen from the brokers and the database: the
	// replay republished pay-2 and pay-3, removed pay-1 (applied), and
	// left the other groups, the forged envelope among them.
	if n := rabbitDepth(t, work); n != 2 {
		t.Errorf("work queue holds %d messages, want the 2 replayed", n)
	}
	if n := rabbitDepth(t, dead); n != 3 {
		t.Errorf("DLQ holds %d messages, want 3 (injection, binary, forged)", n)
	}
	var who, outcome string
	if err := pool.QueryRow(ctx, `SELECT who, outcome FROM `+pgx.Identifier{schema, console.AuditTable}.Sanitize()).Scan(&who, &outcome); err != nil {
		t.Fatal(err)
	}
	if who != "e2e" || outcome != "done" {
		t.Errorf("audit row: who %q, outcome %q", who, outcome)
	}
	for _, png := range []string{"overview", "overview-charts", "consumer", "dead-letters", "group", "group-injection", "dry-run", "dry-run-forged", "replay", "audit", "audit-json", "lookup"} {
		if st, err := os.Stat(filepath.Join(out, png+".png")); err != nil || st.Size() < 1000 {
			t.Errorf("screenshot %s.png: %v", png, err)
		}
	}
	if os.Getenv("IDEMQ_BROWSER_DOCS") == "1" {
		for png, dest := range map[string]string{"dead-letters": "console-dead-letters.png", "dry-run": "console-dry-run.png",
			"overview-charts": filepath.Join("img", "console-overview.png")} {
			b, err := os.ReadFile(filepath.Join(out, png+".png"))
			if err != nil {
				t.Fatal(err)
			}
			if len(b) > 300<<10 {
				t.Errorf("%s.png is %d KB: too big for the docs", png, len(b)>>10)
			}
			dest = filepath.Join("..", "..", "..", "..", "..", "docs", dest)
			if err := os.MkdirAll(filepath.Dir(dest), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(dest, b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// rabbitDLQ and kafkaDLQ open a dead-letter queue as `idemq console` does
// (cmd/idemq: brokerFlags.open).
func rabbitDLQ(queue string) console.DLQ {
	return console.DLQ{Broker: "rabbitmq", Name: queue,
		Depth: func(ctx context.Context) (int64, error) {
			b, err := rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{Queue: queue})
			if err != nil {
				return 0, err
			}
			defer b.Close()
			return int64(b.Depth()), nil
		},
		Open: func(ctx context.Context, publish bool) (*console.Conn, error) {
			br, err := rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{Queue: queue})
			if err != nil {
				return nil, err
			}
			c := &console.Conn{Browser: br, Close: func() { _ = br.Close() }}
			if publish {
				pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{})
				if err != nil {
					_ = br.Close()
					return nil, err
				}
				c.Publish = func(ctx context.Context, dest string, m *consumer.Message) error {
					return pub.Publish(ctx, "", dest, m)
				}
				c.Close = func() { _ = br.Close(); _ = pub.Close() }
			}
			return c, nil
		}}
}

func kafkaDLQ(brokers []string, topic string) console.DLQ {
	open := func(ctx context.Context) (*kafka.Browser, error) {
		return kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: brokers, Topic: topic, FetchMaxWait: 100 * time.Millisecond})
	}
	return console.DLQ{Broker: "kafka", Name: topic,
		// `idemq console` reads the watermarks, as `idemq status` does;
		// here, a count of the records.
		Depth: func(ctx context.Context) (int64, error) {
			br, err := open(ctx)
			if err != nil {
				return 0, err
			}
			defer br.Close()
			var n int64
			for {
				if _, err := br.Next(ctx); errors.Is(err, io.EOF) {
					return n, nil
				} else if err != nil {
					return n, err
				}
				n++
			}
		},
		Open: func(ctx context.Context, publish bool) (*console.Conn, error) {
			br, err := open(ctx)
			if err != nil {
				return nil, err
			}
			c := &console.Conn{Browser: br, Close: func() { _ = br.Close() }}
			if publish {
				pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers})
				if err != nil {
					_ = br.Close()
					return nil, err
				}
				c.Publish = func(ctx context.Context, dest string, m *consumer.Message) error { return pub.Publish(ctx, dest, m) }
				c.Close = func() { _ = br.Close(); _ = pub.Close() }
			}
			return c, nil
		}}
}

func rabbitQueues(t *testing.T) (work, dead string) {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	work = "idemq-e2e-payments-" + hex.EncodeToString(b[:])
	dead = work + ".dlq"
	conn, err := amqp.Dial(rabbitmq.DefaultURL)
	if err != nil {
		t.Fatalf("RabbitMQ at %s: %v", rabbitmq.DefaultURL, err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{work, dead} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, q := range []string{work, dead} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		_ = conn.Close()
	})
	return work, dead
}

func rabbitDepth(t *testing.T, q string) int {
	t.Helper()
	conn, err := amqp.Dial(rabbitmq.DefaultURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st.Messages
}
