package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/dlq"
)

// streamFixture is a fresh NATS JetStream or Redis Streams work stream and
// its dead-letter queue, with the adapter Source's dead-letterer; both are
// removed at cleanup.
type streamFixture struct {
	broker string
	// work and dead are the work and dead-letter subjects (NATS) or
	// stream keys (Redis); deadStream is the NATS dead-letter stream.
	work, dead, deadStream string
	dl                     consumer.DeadLetterer
	// args select dead for `idemq dlq`.
	args []string
	// bodyField is the Redis Source's body field.
	bodyField string
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// natsJS connects a plain JetStream client for the test's own checks.
func natsJS(t *testing.T) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		t.Fatalf("NATS at %s: %v", nats.DefaultURL, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// newNATSFixture declares a work stream and its dead-letter stream through
// a natsjs Source's Topology.
func newNATSFixture(ctx context.Context, t *testing.T, opts dlq.Options) *streamFixture {
	t.Helper()
	r := randHex(5)
	stream := "IDEMQ_CLI_" + r
	f := &streamFixture{broker: "nats", work: "idemq-cli." + r, deadStream: stream + natsjs.DLQStreamSuffix}
	f.dead = natsjs.DLQSubject(f.work)
	js := natsJS(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, s := range []string{stream, f.deadStream} {
			if err := js.DeleteStream(ctx, s); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				t.Errorf("delete stream %s: %v", s, err)
			}
		}
	})
	src, err := natsjs.NewSource(ctx, natsjs.Config{Stream: stream, Subject: f.work, Durable: "idemq-cli-" + r,
		Topology: &natsjs.Topology{Storage: jetstream.MemoryStorage}, DeadLetter: natsjs.DeadLetterConfig{Options: opts}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	f.dl = src.DeadLetterer()
	f.args = []string{"--subject", f.dead}
	return f
}

// redisClient connects a plain client for the test's own checks.
func redisClient(t *testing.T) *redis.Client {
	t.Helper()
	opts, err := redis.ParseURL(redisstream.DefaultURL)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// newRedisFixture creates a work stream and its consumer group through a
// redisstream Source, whose dead-letterer writes to "<stream>.dlq".
func newRedisFixture(ctx context.Context, t *testing.T, opts dlq.Options) *streamFixture {
	t.Helper()
	return newRedisFixtureWith(ctx, t, redisstream.Config{DeadLetter: redisstream.DeadLetterConfig{Options: opts}})
}

// newRedisFixtureWith is newRedisFixture with a Source configured as cfg,
// but for its stream and group.
func newRedisFixtureWith(ctx context.Context, t *testing.T, cfg redisstream.Config) *streamFixture {
	t.Helper()
	f := &streamFixture{broker: "redis", work: "idemq-cli-test-" + randHex(5), bodyField: cfg.BodyField}
	f.dead = redisstream.DLQName(f.work)
	rdb := redisClient(t)
	t.Cleanup(func() { _ = rdb.Del(context.Background(), f.work, f.dead).Err() })
	cfg.Stream, cfg.Group = f.work, "billing"
	src, err := redisstream.NewSource(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	f.dl = src.DeadLetterer()
	f.args = []string{"--stream-key", f.dead}
	return f
}

func newStreamFixture(ctx context.Context, t *testing.T, broker string, opts dlq.Options) *streamFixture {
	if broker == "nats" {
		return newNATSFixture(ctx, t, opts)
	}
	return newRedisFixture(ctx, t, opts)
}

// read returns every message of a subject or stream key of the fixture's
// broker, without consuming them.
func (f *streamFixture) read(ctx context.Context, t *testing.T, name string) []*consumer.Message {
	t.Helper()
	var (
		b   dlq.Browser
		err error
	)
	if f.broker == "nats" {
		b, err = natsjs.NewBrowser(ctx, natsjs.BrowserConfig{Subject: name, Idle: 500 * time.Millisecond})
	} else {
		b, err = redisstream.NewBrowser(ctx, redisstream.BrowserConfig{Stream: name, BodyField: f.bodyField})
	}
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.(io.Closer).Close() }()
	var out []*consumer.Message
	for {
		d, err := b.Next(ctx)
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, d.Message())
	}
}

// deadLetter dead-letters one message of the work stream.
func (f *streamFixture) deadLetter(ctx context.Context, t *testing.T, id, body string, fl consumer.Failure) {
	t.Helper()
	fl.MessageID = id
	if fl.Consumer == "" {
		fl.Consumer = "billing"
	}
	if fl.Attempts == 0 {
		fl.Attempts = 1
	}
	if fl.FirstFailure.IsZero() {
		fl.FirstFailure, fl.LastFailure = time.Now(), time.Now()
	}
	if err := f.dl.DeadLetter(ctx, &consumer.Message{ID: id, Body: []byte(body), Source: f.work, Partition: -1, Offset: -1}, fl); err != nil {
		t.Fatal(err)
	}
}

// TestDLQInspectAndReplayStreams: dlq inspect groups a NATS JetStream and a
// Redis Streams DLQ by fingerprint, the dry run tells the already-applied
// dead letter from the others without consuming anything, and replay
// removes the applied one and republishes the rest to their source with
// the adapter's Publisher.
func TestDLQInspectAndReplayStreams(t *testing.T) {
	t.Parallel()
	for _, broker := range []string{"nats", "redis"} {
		t.Run(broker, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			store, dbArgs := migrated(t)
			f := newStreamFixture(ctx, t, broker, dlq.Options{})
			// Five dead letters: three permanent, one timeout, and one
			// whose id was in fact applied.
			bodies := map[string]string{}
			for i := range 5 {
				id := fmt.Sprintf("m-%d", i)
				fl := consumer.Failure{Class: consumer.ClassPermanent, Err: fmt.Errorf("unknown account %d for %s", 100+i, id)}
				if i == 3 {
					fl = consumer.Failure{Class: consumer.ClassTimeout, Err: errors.New("handler timed out")}
				}
				bodies[id] = fmt.Sprintf(`{"n":%d}`, i)
				f.deadLetter(ctx, t, id, bodies[id], fl)
			}
			fp := (&consumer.Message{Body: []byte(`{"n":4}`)}).Fingerprint()
			claim(t, store, dedup.Claim{Consumer: "billing", MessageID: "m-4", Fingerprint: fp, Partition: -1, Offset: -1})

			// The broker follows from --subject or --stream-key.
			r := idemq(t, append([]string{"dlq", "inspect"}, f.args...)...)
			want(t, r, 0, "5 dead-lettered messages in 2 groups", "")
			want(t, r, 0, "unknown account <n> for <id>", "")
			want(t, r, 0, f.work, "")
			r = idemq(t, append([]string{"dlq", "inspect", "--broker", broker, "--json", "--class", "timeout"}, f.args...)...)
			var rep dlq.Report
			if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || rep.Total != 1 || rep.Groups[0].Class != consumer.ClassTimeout ||
				!slices.Equal(rep.Groups[0].Sample, []string{"m-3"}) || !slices.Equal(rep.Groups[0].Sources, []string{f.work}) {
				t.Fatalf("inspect --json: %v %+v\n%s", err, rep, r.stdout)
			}
			if broker == "nats" {
				// The stream named, not looked up.
				r = idemq(t, "dlq", "inspect", "--subject", f.dead, "--stream", f.deadStream)
				want(t, r, 0, "5 dead-lettered messages in 2 groups", "")
			}

			r = idemq(t, append(append([]string{"dlq", "replay", "--dry-run", "--retention", "72h"}, f.args...), dbArgs...)...)
			want(t, r, 0, "4 will apply, 1 already applied, 0 fingerprint mismatch, 0 missing id", "")
			want(t, r, 0, "Nothing was consumed.", "")
			if n := len(f.read(ctx, t, f.work)); n != 0 {
				t.Fatalf("the dry run republished %d messages", n)
			}
			if n := len(f.read(ctx, t, f.dead)); n != 5 {
				t.Fatalf("inspect or the dry run consumed dead letters: %d left", n)
			}

			r = idemq(t, append(append([]string{"dlq", "replay", "--class", "permanent", "--retention", "72h"}, f.args...), dbArgs...)...)
			want(t, r, 0, "republished 3", "")
			want(t, r, 0, "skipped 1 already applied", "")
			var ids []string
			for _, m := range f.read(ctx, t, f.work) {
				ids = append(ids, m.ID)
				if string(m.Body) != bodies[m.ID] || m.Header("x-idemq-source") != f.work {
					t.Errorf("republished %q: body %q headers %v", m.ID, m.Body, m.Headers)
				}
			}
			slices.Sort(ids)
			if !slices.Equal(ids, []string{"m-0", "m-1", "m-2"}) {
				t.Fatalf("the work stream received %v, want m-0, m-1 and m-2 with their envelope ids", ids)
			}
			left := f.read(ctx, t, f.dead)
			if len(left) != 1 {
				t.Fatalf("the DLQ holds %d dead letters, want the timeout one", len(left))
			}
			if rec, err := dlq.Parse(left[0]); err != nil || rec.MessageID != "m-3" {
				t.Fatalf("left in the DLQ: %+v, %v", rec, err)
			}

			if broker == "nats" {
				// m-0 fails again and is dead-lettered again: republished
				// within the work stream's duplicate window, it would be
				// discarded, so it fails and stays in the DLQ.
				f.deadLetter(ctx, t, "m-0", bodies["m-0"], consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("unknown account")})
				r = idemq(t, append(append([]string{"dlq", "replay", "--id", "m-0", "--retention", "72h"}, f.args...), dbArgs...)...)
				want(t, r, 1, "republished 0", "discarded as a duplicate")
				if n := len(f.read(ctx, t, f.dead)); n != 2 {
					t.Fatalf("the duplicate left the DLQ: %d dead letters left, want 2", n)
				}
				if n := len(f.read(ctx, t, f.work)); n != 3 {
					t.Fatalf("the work stream holds %d messages, want 3", n)
				}
			}
		})
	}
}

// TestDLQReplayRedisFields: a consumer whose Source reads the body from a
// field of its own gets its dead letters back in that field, the id in
// idempotency-key,
// and the dry run and replay see their bodies: an applied one is recognised
// by its fingerprint.
func TestDLQReplayRedisFields(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store, dbArgs := migrated(t)
	f := newRedisFixtureWith(ctx, t, redisstream.Config{BodyField: "payload"})
	for i := range 3 {
		f.deadLetter(ctx, t, fmt.Sprint("o-", i), fmt.Sprint(`{"o":`, i, `}`), consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug")})
	}
	claim(t, store, dedup.Claim{Consumer: "billing", MessageID: "o-2", Fingerprint: (&consumer.Message{Body: []byte(`{"o":2}`)}).Fingerprint(), Partition: -1, Offset: -1})
	args := append([]string{"dlq", "replay", "--stream-key", f.dead, "--redis-body-field", "payload", "--retention", "72h"}, dbArgs...)
	want(t, idemq(t, append(args, "--dry-run")...), exitOK, "2 will apply, 1 already applied, 0 fingerprint mismatch", "")
	want(t, idemq(t, args...), exitOK, "republished 2 (the consumer applies them once); skipped 1 already applied", "")
	got := map[string]string{}
	for _, m := range f.read(ctx, t, f.work) {
		got[m.ID] = string(m.Body)
		for _, k := range []string{"body", "payload"} {
			if _, ok := m.Headers[k]; ok {
				t.Errorf("republished %s has a field %q besides its id and body: %v", m.ID, k, m.Headers)
			}
		}
		if m.Header("idempotency-key") != m.ID {
			t.Errorf("republished %s has idempotency-key %q", m.ID, m.Header("idempotency-key"))
		}
	}
	if len(got) != 2 || got["o-0"] != `{"o":0}` || got["o-1"] != `{"o":1}` {
		t.Fatalf("the work stream holds %v", got)
	}
}

func TestDLQStreamsUsage(t *testing.T) {
	t.Parallel()
	missing := "idemq-cli-missing-" + randHex(5)
	for _, tc := range []struct {
		args           []string
		code           int
		stdout, stderr string
	}{
		{[]string{"--broker", "nats"}, exitUsage, "", "--subject is required with --broker nats"},
		{[]string{"--subject", "orders.*"}, exitUsage, "", "no wildcards"},
		{[]string{"--subject", "orders.dlq", "--stream", "ORDERS.DLQ"}, exitUsage, "", "--stream"},
		{[]string{"--broker", "redis"}, exitUsage, "", "--stream-key is required with --broker redis"},
		{[]string{"--broker", "sqs", "--queue", "x"}, exitUsage, "", "want rabbitmq, kafka, nats or redis"},
		{[]string{"--subject", missing}, exitFail, "", "no stream captures it"},
		// A Redis stream is created by its first dead letter.
		{[]string{"--stream-key", missing}, exitOK, "0 dead-lettered messages in 0 groups", ""},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			want(t, idemq(t, append([]string{"dlq", "inspect"}, tc.args...)...), tc.code, tc.stdout, tc.stderr)
		})
	}
	r := idemq(t, "dlq", "replay", "--help")
	want(t, r, exitOK, "-nats-url string", "")
	want(t, r, exitOK, "-stream-key key", "")
}

// TestStreamURLPasswordNeverPrinted runs the dlq and status commands with
// NATS and Redis URLs that carry a password: a port nothing listens on,
// unparseable URLs, and the real Redis refusing the credentials.
func TestStreamURLPasswordNeverPrinted(t *testing.T) {
	_, dbArgs := migrated(t)
	port := deadPort(t)
	cases := []struct {
		name, flag, url, sel, stderr string
	}{
		{"nats unreachable", "--nats-url", "nats://app:" + secret + "@127.0.0.1:" + port, "subject", "nats://app:xxxxx@127.0.0.1:" + port},
		{"nats token", "--nats-url", "nats://" + secret + "@127.0.0.1:" + port, "subject", "nats://xxxxx@127.0.0.1:" + port},
		{"nats list", "--nats-url", "nats://127.0.0.1:" + port + ",nats://app:" + secret + "@127.0.0.1:" + port, "subject", "nats://app:xxxxx@127.0.0.1:" + port},
		{"nats bad port", "--nats-url", "nats://app:" + secret + "@127.0.0.1:notaport", "subject", "URL"},
		{"nats bad escape", "--nats-url", "nats://app:" + secret + "%zz@127.0.0.1:" + port, "subject", "URL"},
		{"redis unreachable", "--redis-url", "redis://app:" + secret + "@127.0.0.1:" + port + "/0", "stream-key", "redis://app:xxxxx@127.0.0.1:" + port},
		{"redis bad port", "--redis-url", "redis://app:" + secret + "@127.0.0.1:notaport/0", "stream-key", "URL"},
		{"redis bad escape", "--redis-url", "redis://app:" + secret + "%zz@127.0.0.1:" + port + "/0", "stream-key", "URL"},
		{"redis wrong password", "--redis-url", "redis://app:" + secret + "@127.0.0.1:6379/0", "stream-key", "redis://app:xxxxx@127.0.0.1:6379/0"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for _, args := range [][]string{
				{"dlq", "inspect", "--" + c.sel, "some.dlq", c.flag, c.url},
				append([]string{"dlq", "replay", "--" + c.sel, "some.dlq", "--dry-run", c.flag, c.url}, dbArgs...),
				append([]string{"dlq", "replay", "--" + c.sel, "some.dlq", c.flag, c.url}, dbArgs...),
				append([]string{"status", "--consumer", "billing", "--dlq-" + c.sel, "some.dlq", c.flag, c.url}, dbArgs...),
			} {
				r := idemq(t, args...)
				noSecret(t, r)
				want(t, r, exitFail, "", c.stderr)
			}
		})
	}
	t.Run("from NATS_URL and REDIS_URL", func(t *testing.T) {
		t.Setenv("NATS_URL", "nats://app:"+secret+"@127.0.0.1:"+port)
		t.Setenv("REDIS_URL", "redis://app:"+secret+"@127.0.0.1:"+port+"/0")
		r := idemq(t, "dlq", "inspect", "--subject", "some.dlq")
		noSecret(t, r)
		want(t, r, exitFail, "", "nats://app:xxxxx@")
		r = idemq(t, "dlq", "inspect", "--stream-key", "some.dlq")
		noSecret(t, r)
		want(t, r, exitFail, "", "redis://app:xxxxx@")
		r = idemq(t, append([]string{"status", "--consumer", "billing", "--dlq-subject", "a.dlq", "--dlq-stream-key", "b.dlq"}, dbArgs...)...)
		noSecret(t, r)
		want(t, r, exitFail, "dlq redis:", "nats://app:xxxxx@")
	})
}
