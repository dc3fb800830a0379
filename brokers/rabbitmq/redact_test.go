package rabbitmq_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testlog"
)

// secret is the password the hostile URLs carry. It must appear in no
// error and no log line.
const secret = "hunter2Secret"

// closedPort returns a loopback port nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return port
}

// TestURLPasswordNeverInErrorsOrLogs opens a Source, a Publisher, a Browser
// and a topology with URLs that carry a password: unreachable, unparseable,
// and refused by the real broker. Every call fails with an error that says
// what is wrong, and neither the error nor the logs hold the password.
func TestURLPasswordNeverInErrorsOrLogs(t *testing.T) {
	port := closedPort(t)
	cases := []struct {
		name, url string
		want      string // in the error
		isConfig  bool   // rejected by validation, wrapping ErrInvalidConfig
	}{
		{"unreachable", "amqp://app:" + secret + "@127.0.0.1:" + port + "/", "rabbitmq: dial amqp://app:xxxxx@127.0.0.1:" + port + "/", false},
		{"refused credentials", "amqp://guest:" + secret + "@127.0.0.1:5672/", "rabbitmq: dial amqp://guest:xxxxx@127.0.0.1:5672/", false},
		{"bad port", "amqp://app:" + secret + "@127.0.0.1:notaport/", "URL: cannot parse the URL", true},
		{"bad escape", "amqp://app:" + secret + "%zz@127.0.0.1/", "URL: cannot parse the URL", true},
		{"bad host", "amqp://app:" + secret + "@[::1/", "URL: cannot parse the URL", true},
		{"whitespace", "amqp://app:" + secret + " x@127.0.0.1/", "URL:", true},
		{"bad scheme", "http://app:" + secret + "@127.0.0.1/", "URL:", true},
		// A list is not one URL: amqp091 would read the rest as the vhost,
		// and the broker's "vhost ... not found" would echo its passwords.
		{"a list of URLs", "amqp://guest:guest@127.0.0.1:5672/,amqp://app:" + secret + "@127.0.0.1:5672/",
			"URL: holds 2 URLs; give one (a comma-separated list is not supported; other nodes of a cluster go in FailoverURLs)", true},
		{"a list with spaces", "amqp://guest:guest@127.0.0.1:5672/, amqps://app:" + secret + "@127.0.0.1:5671/",
			"URL: holds 2 URLs", true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx := testCtx(t, 20*time.Second)
			log, logs := testlog.New(slog.LevelDebug)
			check := func(what string, err error) {
				t.Helper()
				if err == nil {
					t.Fatalf("%s: no error", what)
				}
				if strings.Contains(err.Error(), secret) {
					t.Fatalf("%s: the password leaked into the error: %v", what, err)
				}
				if !strings.Contains(err.Error(), c.want) {
					t.Fatalf("%s: error %q does not contain %q", what, err, c.want)
				}
				if got := errors.Is(err, consumer.ErrInvalidConfig); got != c.isConfig {
					t.Fatalf("%s: errors.Is(err, ErrInvalidConfig) = %v, want %v (%v)", what, got, c.isConfig, err)
				}
			}
			_, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: c.url, Queue: "q"})
			check("NewSource", err)
			_, err = rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: c.url, Logger: log})
			check("NewPublisher", err)
			_, err = rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{URL: c.url, Queue: "q", Logger: log})
			check("NewBrowser", err)
			check("DeclareTopology", rabbitmq.DeclareTopology(ctx, c.url, rabbitmq.Topology{Queue: "q"}))
			if strings.Contains(logs.String(), secret) {
				t.Fatalf("the password leaked into the logs:\n%s", logs)
			}
		})
	}
}

// TestReconnectLogsHidePassword loses a live Source's and Publisher's
// connection and keeps the broker unreachable, so that they log failed
// reconnects: the logs and errors show the URL without its password. The
// test broker's password is "guest", the same as its user name, so the
// check is that "guest:guest" never appears.
func TestReconnectLogsHidePassword(t *testing.T) {
	q := newQueue(t)
	px := newProxy(t)
	url := px.URL(t)
	if !strings.Contains(url, ":guest@") {
		t.Fatalf("the test expects the broker URL to carry the password guest, got a URL without it")
	}
	const leaked = "guest:guest"
	log, logs := testlog.New(slog.LevelDebug)
	src := newSource(t, rabbitmq.Config{URL: url, Queue: q,
		Reconnect: rabbitmq.ReconnectConfig{InitialInterval: 10 * time.Millisecond, MaxInterval: 50 * time.Millisecond}})
	src.Configure(consumer.SourceSettings{Logger: log}) // the runtime's logger
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: url, Logger: log})

	// Make the broker unreachable, then cut the live connections.
	if err := px.ln.Close(); err != nil {
		t.Fatal(err)
	}
	px.Cut()
	waitFor(t, 10*time.Second, "the source to notice the lost connection", func() bool { return rabbitmq.SourceConnLost(src) })

	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	if _, err := src.Receive(ctx); err == nil {
		t.Fatal("Receive succeeded with the broker unreachable")
	} else if strings.Contains(err.Error(), leaked) {
		t.Fatalf("the password leaked into Receive's error: %v", err)
	}
	waitFor(t, 10*time.Second, "the publisher to notice the lost connection", func() bool { return rabbitmq.PublisherConnClosed(pub) })
	pctx, pcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer pcancel()
	err := pub.Publish(pctx, "", q, &consumer.Message{ID: "m", Body: []byte("x")})
	if err == nil {
		t.Fatal("Publish succeeded with the broker unreachable")
	}
	if strings.Contains(err.Error(), leaked) {
		t.Fatalf("the password leaked into Publish's error: %v", err)
	}
	out := logs.String()
	if !strings.Contains(out, "reconnect failed") {
		t.Fatalf("no failed reconnect was logged; logs:\n%s", out)
	}
	if strings.Contains(out, leaked) {
		t.Fatalf("the password leaked into the logs:\n%s", out)
	}
	if !strings.Contains(out+err.Error(), "guest:xxxxx@") {
		t.Fatalf("the redacted URL appears nowhere; logs:\n%s\nerror: %v", out, err)
	}
}

// TestHostileQueueNames: names AMQP cannot carry are rejected by validation
// with a clear error, before any connection; a 255-byte name, the longest
// legal one, gets a legal default consumer tag and works end to end.
func TestHostileQueueNames(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	long := strings.Repeat("q", 256)
	for _, c := range []struct {
		name, queue, field string
	}{
		{"empty", "", "Queue"},
		{"over 255 bytes", long, "Queue"},
		{"multibyte over 255 bytes", strings.Repeat("é", 128), "Queue"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var ce *consumer.ConfigError
			_, err := rabbitmq.NewSource(ctx, rabbitmq.Config{Queue: c.queue})
			if !errors.As(err, &ce) || ce.Field != c.field {
				t.Fatalf("NewSource: %v, want a ConfigError on %s", err, c.field)
			}
			_, err = rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{Queue: c.queue})
			if !errors.As(err, &ce) || ce.Field != c.field {
				t.Fatalf("NewBrowser: %v, want a ConfigError on %s", err, c.field)
			}
			err = rabbitmq.DeclareTopology(ctx, "", rabbitmq.Topology{Queue: c.queue})
			if !errors.As(err, &ce) || ce.Field != c.field {
				t.Fatalf("DeclareTopology: %v, want a ConfigError on %s", err, c.field)
			}
		})
	}
	t.Run("derived dead-letter names over 255 bytes", func(t *testing.T) {
		var ce *consumer.ConfigError
		err := rabbitmq.DeclareTopology(ctx, "", rabbitmq.Topology{Queue: strings.Repeat("q", 253)})
		if !errors.As(err, &ce) || ce.Field != "DeadLetterExchange" {
			t.Fatalf("DeclareTopology: %v, want a ConfigError on DeadLetterExchange", err)
		}
	})
	t.Run("consumer tag over 255 bytes", func(t *testing.T) {
		var ce *consumer.ConfigError
		_, err := rabbitmq.NewSource(ctx, rabbitmq.Config{Queue: "q", ConsumerTag: long})
		if !errors.As(err, &ce) || ce.Field != "ConsumerTag" {
			t.Fatalf("NewSource: %v, want a ConfigError on ConsumerTag", err)
		}
	})
	t.Run("hostile bytes pass through intact", func(t *testing.T) {
		// AMQP names are byte strings: quotes, semicolons and spaces are
		// data, never syntax. The longest legal name still gets a legal
		// default consumer tag.
		name := uniqueName(t) + `.'; DROP TABLE x; -- "`
		name += strings.Repeat("z", 255-len(name))
		if err := admin(t, func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclare(name, true, false, false, false, nil)
			return err
		}); err != nil {
			t.Fatalf("declare %q: %v", name, err)
		}
		deleteLater(t, name)
		pub := newPublisher(t, rabbitmq.PublisherConfig{})
		if err := pub.Publish(ctx, "", name, &consumer.Message{ID: "m-1", Body: []byte("x")}); err != nil {
			t.Fatalf("Publish: %v", err)
		}
		// DLQName(name) would be over 255 bytes: name the dead-letter
		// queue.
		var ce *consumer.ConfigError
		if _, err := rabbitmq.NewSource(ctx, rabbitmq.Config{Queue: name}); !errors.As(err, &ce) || ce.Field != "DeadLetter.Queue" {
			t.Fatalf("NewSource with a derived dead-letter queue name over 255 bytes: %v, want a ConfigError on DeadLetter.Queue", err)
		}
		dlqName := uniqueName(t) + ".dlq"
		declareQueue(t, dlqName)
		src := newSource(t, rabbitmq.Config{Queue: name, DeadLetter: rabbitmq.DeadLetterConfig{Queue: dlqName}})
		d, err := src.Receive(ctx)
		if err != nil {
			t.Fatalf("Receive: %v", err)
		}
		if d.Message().ID != "m-1" || d.Message().Source != name {
			t.Fatalf("got id %q from %q", d.Message().ID, d.Message().Source)
		}
		mustAck(ctx, t, d)
	})
}
