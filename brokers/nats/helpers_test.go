package natsjs_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natsjs "github.com/idemq/idemq/brokers/nats"
)

// serverURL is the test server: $IDEMQ_TEST_NATS_URL, else the local one.
func serverURL() string {
	if u := os.Getenv("IDEMQ_TEST_NATS_URL"); u != "" {
		return u
	}
	return nats.DefaultURL
}

func testCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// js connects a plain JetStream client for the test's own checks.
func js(t *testing.T) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(serverURL())
	if err != nil {
		t.Fatalf("NATS at %s: %v (set IDEMQ_TEST_NATS_URL)", serverURL(), err)
	}
	t.Cleanup(nc.Close)
	j, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return j
}

// names is one test's stream, subject and durable.
type names struct {
	stream, subject, dlqStream, dlqSubject, durable string
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newNames picks fresh names and deletes whatever streams they name at
// cleanup.
func newNames(t *testing.T) names {
	t.Helper()
	r := randomHex(5)
	n := names{
		stream:     "IDEMQ_TEST_" + r,
		subject:    "idemq-test." + r,
		dlqStream:  "IDEMQ_TEST_" + r + natsjs.DLQStreamSuffix,
		dlqSubject: "idemq-test." + r + ".dlq",
		durable:    "idemq-test-" + r,
	}
	j := js(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, s := range []string{n.stream, n.dlqStream} {
			if err := j.DeleteStream(ctx, s); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				t.Errorf("delete stream %s: %v", s, err)
			}
		}
	})
	return n
}

// newTopology declares the test's streams, with the given duplicate window
// (0: the server's).
func newTopology(t *testing.T, dup time.Duration) names {
	t.Helper()
	n := newNames(t)
	ctx := testCtx(t, 10*time.Second)
	j := js(t)
	if _, err := j.CreateStream(ctx, jetstream.StreamConfig{Name: n.stream, Subjects: []string{n.subject}, Duplicates: dup}); err != nil {
		t.Fatal(err)
	}
	if _, err := j.CreateStream(ctx, jetstream.StreamConfig{Name: n.dlqStream, Subjects: []string{n.dlqSubject}}); err != nil {
		t.Fatal(err)
	}
	return n
}

func (n names) config() natsjs.Config {
	return natsjs.Config{URL: serverURL(), Stream: n.stream, Subject: n.subject, Durable: n.durable}
}

func newSource(t *testing.T, cfg natsjs.Config) *natsjs.Source {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = serverURL()
	}
	src, err := natsjs.NewSource(testCtx(t, 10*time.Second), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	return src
}

func newPublisher(t *testing.T, cfg natsjs.PublisherConfig) *natsjs.Publisher {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = serverURL()
	}
	p, err := natsjs.NewPublisher(testCtx(t, 10*time.Second), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// streamMsgs returns the number of messages stored in stream.
func streamMsgs(t *testing.T, stream string) uint64 {
	t.Helper()
	s, err := js(t).Stream(testCtx(t, 10*time.Second), stream)
	if err != nil {
		t.Fatal(err)
	}
	return s.CachedInfo().State.Msgs
}

// waitFor polls cond until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func newBrowser(t *testing.T, cfg natsjs.BrowserConfig) *natsjs.Browser {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = serverURL()
	}
	b, err := natsjs.NewBrowser(testCtx(t, 10*time.Second), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}
