package redisstream_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	ok := redisstream.Config{Stream: "s", Group: "g"}
	for _, tc := range []struct {
		name  string
		edit  func(*redisstream.Config)
		field string
	}{
		{"no stream", func(c *redisstream.Config) { c.Stream = "" }, "Stream"},
		{"no group", func(c *redisstream.Config) { c.Group = "" }, "Group"},
		{"reserved consumer", func(c *redisstream.Config) { c.Consumer = redisstream.ReleasedConsumerForTest }, "Consumer"},
		{"bad start id", func(c *redisstream.Config) { c.StartID = "latest" }, "StartID"},
		{"min idle too short", func(c *redisstream.Config) { c.MinIdle = 10 * time.Millisecond }, "MinIdle"},
		{"keep-alive too slow", func(c *redisstream.Config) { c.MinIdle = 10 * time.Second; c.KeepAlive = 5 * time.Second }, "KeepAlive"},
		{"keep-alive negative", func(c *redisstream.Config) { c.KeepAlive = -2 }, "KeepAlive"},
		{"claim interval negative", func(c *redisstream.Config) { c.ClaimInterval = -time.Second }, "ClaimInterval"},
		{"block too short", func(c *redisstream.Config) { c.Block = time.Microsecond }, "Block"},
		{"dead letters to itself", func(c *redisstream.Config) { c.DeadLetter.Stream = "s" }, "DeadLetter.Stream"},
		{"dead-letter maxlen negative", func(c *redisstream.Config) { c.DeadLetter.MaxLen = -1 }, "DeadLetter.MaxLen"},
		{"body field is id field", func(c *redisstream.Config) { c.BodyField = "idempotency-key" }, "BodyField"},
		{"body field is the key field", func(c *redisstream.Config) { c.BodyField = "x-idemq-key" }, "BodyField"},
		{"dead-letter options", func(c *redisstream.Config) { c.DeadLetter.Options.MaxErrorBytes = 3 }, "DeadLetter.Options.MaxErrorBytes"},
		{"url scheme", func(c *redisstream.Config) { c.URL = "amqp://guest:guest@localhost/" }, "URL"},
		{"dial timeout", func(c *redisstream.Config) { c.DialTimeout = -1 }, "DialTimeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			tc.edit(&cfg)
			_, err := redisstream.NewSource(context.Background(), cfg)
			var ce *consumer.ConfigError
			if !errors.As(err, &ce) || !errors.Is(err, consumer.ErrInvalidConfig) {
				t.Fatalf("got %v, want a *consumer.ConfigError", err)
			}
			if ce.Field != tc.field {
				t.Errorf("field %q, want %q (%v)", ce.Field, tc.field, err)
			}
		})
	}
	// KeepAlive -1 disables the keep-alive; with it MinIdle may be short.
	cfg := ok
	cfg.URL, cfg.Stream, cfg.KeepAlive, cfg.MinIdle = testURL(), newStream(t, testURL()), -1, time.Second
	newSource(t, cfg)

	for _, tc := range []struct {
		name string
		cfg  redisstream.PublisherConfig
	}{
		{"maxlen", redisstream.PublisherConfig{MaxLen: -1}},
		{"fields", redisstream.PublisherConfig{BodyField: "idempotency-key"}},
	} {
		if _, err := redisstream.NewPublisher(context.Background(), tc.cfg); !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("publisher %s: got %v, want a config error", tc.name, err)
		}
	}
	if _, err := redisstream.NewBrowser(context.Background(), redisstream.BrowserConfig{}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("browser without stream: got %v, want a config error", err)
	}
}

// TestNoPasswordInErrors: neither a URL that cannot be parsed nor a server
// that cannot be reached shows the password.
func TestNoPasswordInErrors(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-pa55"
	ctx := testCtx(t, 30*time.Second)
	for _, url := range []string{
		"redis://:" + secret + "@127.0.0.1:1/0",             // refused
		"redis://user:" + secret + "@127.0.0.1:1/0",         // refused, with a user
		"redis://:" + secret + "%zz@127.0.0.1:6379/0",       // unparseable
		"redis://:" + secret + "@127.0.0.1:6379/notanumber", // bad database
		"rediss://:" + secret + "@127.0.0.1:6379/0?dial_timeout=nonsense",
	} {
		_, err1 := redisstream.NewSource(ctx, redisstream.Config{URL: url, Stream: "s", Group: "g", DialTimeout: time.Second})
		_, err2 := redisstream.NewPublisher(ctx, redisstream.PublisherConfig{URL: url, DialTimeout: time.Second})
		_, err3 := redisstream.NewBrowser(ctx, redisstream.BrowserConfig{URL: url, Stream: "s", DialTimeout: time.Second})
		for i, err := range []error{err1, err2, err3} {
			if err == nil {
				t.Errorf("%d: no error for %s", i, strings.ReplaceAll(url, secret, "***"))
				continue
			}
			if strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), "pa55") {
				t.Errorf("%d: error shows the password: %v", i, err)
			}
		}
	}
	// A wrong password: the server's refusal does not echo it either.
	srv := startRedis(t, "--requirepass", "the-right-one")
	_, err := redisstream.NewSource(ctx, redisstream.Config{URL: "redis://:" + secret + "@" + strings.TrimPrefix(srv.URL(), "redis://"), Stream: "s", Group: "g"})
	if err == nil || strings.Contains(err.Error(), secret) {
		t.Errorf("wrong password: %v", err)
	}
}

func TestRequireAOF(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	// The shared server persists nothing.
	if ok, _ := persistsEverything(ctx, t, testURL()); !ok {
		_, err := redisstream.NewSource(ctx, redisstream.Config{URL: testURL(), Stream: newStream(t, testURL()), Group: "g", RequireAOF: true})
		if err == nil || !strings.Contains(err.Error(), "appendfsync") {
			t.Errorf("RequireAOF on a server without AOF: got %v, want an error naming appendfsync", err)
		}
	}
	srv := startRedis(t)
	newSource(t, redisstream.Config{URL: srv.URL(), Stream: "s", Group: "g", RequireAOF: true})
	everysec := startRedis(t, "--appendfsync", "everysec")
	if _, err := redisstream.NewSource(ctx, redisstream.Config{URL: everysec.URL(), Stream: "s", Group: "g", RequireAOF: true}); err == nil {
		t.Error("RequireAOF accepted appendfsync everysec")
	}
}

func persistsEverything(ctx context.Context, t *testing.T, url string) (bool, error) {
	vals, err := client(t, url).ConfigGet(ctx, "append*").Result()
	return err == nil && vals["appendonly"] == "yes" && vals["appendfsync"] == "always", err
}

// TestMapping: fields become the message's id, key, body and headers; the
// entry id is in the metadata and in HeaderEntryID; an entry without the id
// field gets the fallback id; the id field is a header too, so the runtime's
// MessageID can refuse the fallback.
func TestMapping(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	c := client(t, testURL())
	withID, err := c.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"idempotency-key", "pay-1", "x-idemq-key", "acct-1", "h1", "v1", "body", `{"a":1}`}}).Result()
	if err != nil {
		t.Fatal(err)
	}
	without, err := c.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"body", "no id"}}).Result()
	if err != nil {
		t.Fatal(err)
	}
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g"})
	m := brokertest.Receive(ctx, t, src).Message()
	if m.ID != "pay-1" || m.Key != "acct-1" || string(m.Body) != `{"a":1}` || m.Header("h1") != "v1" || m.Source != stream {
		t.Errorf("message %+v", m)
	}
	if m.Header("body") != "" || m.Header("idempotency-key") != "pay-1" || m.Header("x-idemq-key") != "acct-1" {
		t.Errorf("headers %v: want the id and key fields among them, not the body", m.Headers)
	}
	if m.Metadata[redisstream.MetaEntryID] != withID || m.Header(redisstream.HeaderEntryID) != withID || m.Metadata[redisstream.MetaDelivery] != "new" {
		t.Errorf("metadata %v, headers %v; want entry id %s", m.Metadata, m.Headers, withID)
	}
	if m.Redelivered || m.Partition != -1 || m.Offset != -1 || m.Timestamp.IsZero() {
		t.Errorf("redelivered %v, partition %d, offset %d, timestamp %v", m.Redelivered, m.Partition, m.Offset, m.Timestamp)
	}
	m2 := brokertest.Receive(ctx, t, src).Message()
	if want := stream + "/" + without; m2.ID != want {
		t.Errorf("fallback id %q, want %q", m2.ID, want)
	}
	if id, _ := consumer.IDFromHeader("idempotency-key")(m2); id != "" {
		t.Errorf("id header of an entry without one: %q", id)
	}

	// The Publisher writes what the Source reads, and refuses a header
	// that would overwrite the body.
	pub := newPublisher(t, redisstream.PublisherConfig{})
	ids, err := pub.Publish(ctx, stream, &consumer.Message{ID: "pay-2", Key: "acct-2", Body: []byte("b"), Headers: map[string]string{"x": "y"}})
	if err != nil || len(ids) != 1 || ids[0] == "" {
		t.Fatalf("publish: %v %v", ids, err)
	}
	m3 := brokertest.Receive(ctx, t, src).Message()
	if m3.ID != "pay-2" || m3.Key != "acct-2" || string(m3.Body) != "b" || m3.Header("x") != "y" || m3.Metadata[redisstream.MetaEntryID] != ids[0] {
		t.Errorf("published message came back as %+v", m3)
	}
	if _, err := pub.Publish(ctx, stream, &consumer.Message{ID: "x", Headers: map[string]string{"body": "evil"}}); !errors.Is(err, redisstream.ErrReservedField) {
		t.Errorf("header named body: got %v, want ErrReservedField", err)
	}
}

// TestNackRedelivers: a nacked entry comes again from the same Source,
// flagged redelivered, with its delivery count raised.
func TestNackRedelivers(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, brokertest.NewMessages("nack", 1, 0)...)
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g"})
	d := brokertest.Receive(ctx, t, src)
	if err := d.Nack(ctx, true); err != nil {
		t.Fatal(err)
	}
	if err := d.Nack(ctx, true); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("second nack: %v, want ErrDeliveryStale", err)
	}
	d2 := brokertest.Receive(ctx, t, src)
	if !d2.Message().Redelivered || d2.Message().Metadata[redisstream.MetaDelivery] != "nack" || d2.Message().ID != d.Message().ID {
		t.Errorf("after nack: %+v", d2.Message())
	}
	p, err := client(t, testURL()).XPendingExt(ctx, &redis.XPendingExtArgs{Stream: stream, Group: "g", Start: "-", End: "+", Count: 10}).Result()
	if err != nil || len(p) != 1 || p[0].RetryCount != 2 || p[0].Consumer != src.Consumer() {
		t.Errorf("pending %+v (%v), want one entry of %s delivered twice", p, err, src.Consumer())
	}
	if err := d2.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	if n, _ := client(t, testURL()).XPending(ctx, stream, "g").Result(); n.Count != 0 {
		t.Errorf("%d entries pending after the ack", n.Count)
	}
	if s := src.Stats(); s.Acked != 1 || s.Nacked != 1 || s.Received != 2 {
		t.Errorf("stats %+v", s)
	}
}

// TestClaimsFromDeadConsumer: entries read by a consumer that died are
// claimed with XAUTOCLAIM once idle for MinIdle, and not before.
func TestClaimsFromDeadConsumer(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	msgs := brokertest.NewMessages("dead", 3, 0)
	newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, msgs...)
	c := client(t, testURL())
	if err := c.XGroupCreateMkStream(ctx, stream, "g", "0").Err(); err != nil {
		t.Fatal(err)
	}
	// The dead consumer read everything and never acked.
	if err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "dead", Streams: []string{stream, ">"}, Count: 10}).Err(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g", MinIdle: 2 * time.Second, ClaimInterval: 100 * time.Millisecond})
	ds := brokertest.ReceiveN(ctx, t, src, 3)
	if e := time.Since(start); e < 1900*time.Millisecond {
		t.Errorf("claimed after %s, before MinIdle", e)
	}
	for _, d := range ds {
		m := d.Message()
		if !m.Redelivered || m.Metadata[redisstream.MetaDelivery] != "claimed" {
			t.Errorf("claimed %q: redelivered %v, delivery %q", m.ID, m.Redelivered, m.Metadata[redisstream.MetaDelivery])
		}
	}
	if err := src.AckBatch(ctx, ds); err != nil {
		t.Fatal(err)
	}
	if n, _ := c.XPending(ctx, stream, "g").Result(); n.Count != 0 {
		t.Errorf("%d entries pending after AckBatch", n.Count)
	}
	if s := src.Stats(); s.Claimed != 3 || s.Acked != 3 {
		t.Errorf("stats %+v", s)
	}
	if err := src.AckBatch(ctx, ds[:1]); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("AckBatch again: %v, want ErrDeliveryStale", err)
	}
}

// TestKeepAlive: an entry whose handler is still running is not claimed by
// another consumer, however long past MinIdle it is held; without the
// keep-alive it is.
func TestKeepAlive(t *testing.T) {
	t.Parallel()
	for _, keepAlive := range []time.Duration{300 * time.Millisecond, -1} {
		ctx := testCtx(t, 30*time.Second)
		stream := newStream(t, testURL())
		newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, brokertest.NewMessages("ka", 1, 0)...)
		cfg := redisstream.Config{Stream: stream, Group: "g", MinIdle: time.Second, KeepAlive: keepAlive, ClaimInterval: 100 * time.Millisecond}
		a := newSource(t, cfg)
		d := brokertest.Receive(ctx, t, a)
		b := newSource(t, cfg)
		wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		got, err := b.Receive(wctx)
		cancel()
		switch {
		case keepAlive > 0 && err == nil:
			t.Errorf("keep-alive on: entry claimed by another consumer while held: %v", got.Message().Metadata)
		case keepAlive > 0 && !errors.Is(err, context.DeadlineExceeded):
			t.Errorf("keep-alive on: %v", err)
		case keepAlive < 0 && err != nil:
			t.Errorf("keep-alive off: the held entry was not claimed after MinIdle: %v", err)
		case keepAlive < 0:
			// Both hold it now; whichever acks first settles it.
			if err := got.Ack(ctx); err != nil {
				t.Error(err)
			}
		}
		if err := d.Ack(ctx); err != nil {
			t.Errorf("ack of the first delivery: %v", err)
		}
	}
}

// TestRecoversOwnPending: a Source with a fixed consumer name takes back
// the entries a previous process of that name left pending at once, without
// waiting for MinIdle.
func TestRecoversOwnPending(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, brokertest.NewMessages("own", 2, 0)...)
	c := client(t, testURL())
	_ = c.XGroupCreateMkStream(ctx, stream, "g", "0").Err()
	if err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "worker-1", Streams: []string{stream, ">"}, Count: 1}).Err(); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g", Consumer: "worker-1", MinIdle: time.Hour, KeepAlive: -1})
	ds := brokertest.ReceiveN(testCtx(t, 5*time.Second), t, src, 2)
	if m := ds[0].Message(); !m.Redelivered || m.Metadata[redisstream.MetaDelivery] != "pending" {
		t.Errorf("first: %v", m.Metadata)
	}
	if m := ds[1].Message(); m.Redelivered {
		t.Errorf("second: %v", m.Metadata)
	}
	brokertest.AckAll(ctx, t, ds)
	if s := src.Stats(); s.Recovered != 1 {
		t.Errorf("stats %+v", s)
	}
}

// TestCloseReleases: Close hands unacked entries to ReleasedConsumer, idle
// enough for the next XAUTOCLAIM, and removes its consumer from the group.
func TestCloseReleases(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, brokertest.NewMessages("rel", 4, 0)...)
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g"})
	ds := brokertest.ReceiveN(ctx, t, src, 4)
	if err := ds[0].Ack(ctx); err != nil {
		t.Fatal(err)
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ds[1].Ack(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("ack after close: %v, want ErrSourceClosed", err)
	}
	if err := src.DeadLetterer().DeadLetter(ctx, ds[2].Message(), consumer.Failure{Consumer: "c", MessageID: "x", Class: consumer.ClassPermanent, Err: errors.New("boom")}); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("dead letter after close: %v, want ErrSourceClosed", err)
	}
	if s := src.Stats(); s.Released != 3 {
		t.Errorf("released %d, want 3", s.Released)
	}
	cons, err := client(t, testURL()).XInfoConsumers(ctx, stream, "g").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cons {
		switch c.Name {
		case src.Consumer():
			t.Errorf("closed consumer %s still in the group", c.Name)
		case redisstream.ReleasedConsumerForTest:
			if c.Pending != 3 {
				t.Errorf("%s holds %d entries, want 3", c.Name, c.Pending)
			}
		}
	}
	// The next Source takes them at once, default MinIdle or not.
	next := newSource(t, redisstream.Config{Stream: stream, Group: "g"})
	again := brokertest.ReceiveN(testCtx(t, 5*time.Second), t, next, 3)
	brokertest.AckAll(ctx, t, again)
}

// TestDeletedPendingEntries: a pending entry whose data was deleted (a
// MAXLEN trim, say) is counted and logged when claimed, not delivered.
func TestDeletedPendingEntries(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	ids, _ := newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, brokertest.NewMessages("del", 2, 0)...)
	c := client(t, testURL())
	_ = c.XGroupCreateMkStream(ctx, stream, "g", "0").Err()
	if err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "dead", Streams: []string{stream, ">"}, Count: 10}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.XDel(ctx, stream, ids[0]).Err(); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g", MinIdle: time.Second, ClaimInterval: 100 * time.Millisecond})
	d := brokertest.Receive(ctx, t, src)
	if d.Message().Metadata[redisstream.MetaEntryID] != ids[1] {
		t.Errorf("got entry %s, want %s", d.Message().Metadata[redisstream.MetaEntryID], ids[1])
	}
	if s := src.Stats(); s.Deleted != 1 {
		t.Errorf("deleted %d, want 1", s.Deleted)
	}
	_ = d.Ack(ctx)
}

// TestGroupRecreated: a Source whose stream and group vanish (a restart
// without persistence) creates them again and goes on.
func TestGroupRecreated(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	pub := newPublisher(t, redisstream.PublisherConfig{})
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g", Block: 100 * time.Millisecond})
	brokertest.ReceiveNone(ctx, t, src, 300*time.Millisecond)
	if err := client(t, testURL()).Del(ctx, stream).Err(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the group to be recreated", func() bool {
		brokertest.ReceiveNone(ctx, t, src, 200*time.Millisecond)
		return src.Stats().GroupCreated == 1
	})
	if _, err := pub.Publish(ctx, stream, brokertest.NewMessages("again", 1, 0)...); err != nil {
		t.Fatal(err)
	}
	d := brokertest.Receive(ctx, t, src)
	_ = d.Ack(ctx)
}

// TestBrowser: a Browser reads the stream as it was when opened, deletes
// only what is acked, and feeds dlq.Inspect.
func TestBrowser(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g"})
	dl := src.DeadLetterer()
	msgs := brokertest.NewMessages("dl", 3, 0)
	for i, m := range msgs {
		m.Metadata = map[string]string{}
		if err := dl.DeadLetter(ctx, m, consumer.Failure{Consumer: "c", MessageID: m.ID, Class: consumer.ClassPermanent, Attempts: 1,
			Err: errors.New("bad input " + string(rune('a'+i))), FirstFailure: time.Now(), LastFailure: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	open := func() *redisstream.Browser {
		b, err := redisstream.NewBrowser(ctx, redisstream.BrowserConfig{URL: testURL(), Stream: redisstream.DLQName(stream)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Close() })
		return b
	}
	b := open()
	if b.Depth() != 3 {
		t.Errorf("depth %d", b.Depth())
	}
	d, err := b.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if rec, err := dlq.Parse(d.Message()); err != nil || rec.MessageID != msgs[0].ID || rec.Source != "" && rec.Consumer != "c" {
		t.Errorf("record %+v, %v", rec, err)
	}
	if err := d.Ack(ctx); err != nil { // deletes it
		t.Fatal(err)
	}
	// Added after open: not in this pass.
	_ = dl.DeadLetter(ctx, msgs[0], consumer.Failure{Consumer: "c", MessageID: msgs[0].ID, Class: consumer.ClassPermanent, Err: errors.New("x")})
	for i := 0; i < 2; i++ {
		d, err := b.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_ = d.Nack(ctx, true)
	}
	if _, err := b.Next(ctx); !errors.Is(err, io.EOF) {
		t.Errorf("after the last: %v, want io.EOF", err)
	}
	_ = b.Close()
	if _, err := b.Next(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("after close: %v", err)
	}
	rep, err := dlq.Inspect(ctx, open(), dlq.Filter{}, 0)
	if err != nil || rep.Total != 3 {
		t.Errorf("inspect: %+v, %v; want 3 (two left, one added)", rep, err)
	}
	empty, err := redisstream.NewBrowser(ctx, redisstream.BrowserConfig{URL: testURL(), Stream: randomName("none")})
	if err != nil {
		t.Fatal(err)
	}
	defer empty.Close()
	if _, err := empty.Next(ctx); !errors.Is(err, io.EOF) {
		t.Errorf("empty stream: %v", err)
	}
}

// TestLostToAnotherConsumer: a held entry another consumer claimed (this
// process stalled past MinIdle) is noticed by the keep-alive; a Nack then
// leaves it to its new owner instead of claiming it back.
func TestLostToAnotherConsumer(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, brokertest.NewMessages("lost", 1, 0)...)
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g", MinIdle: time.Second, KeepAlive: 100 * time.Millisecond})
	d := brokertest.Receive(ctx, t, src)
	c := client(t, testURL())
	if err := c.XClaim(ctx, &redis.XClaimArgs{Stream: stream, Group: "g", Consumer: "thief", Messages: []string{d.Message().Metadata[redisstream.MetaEntryID]}}).Err(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the keep-alive to notice", func() bool { return src.Stats().Lost == 1 })
	if err := d.Nack(ctx, true); err != nil {
		t.Fatal(err)
	}
	brokertest.ReceiveNone(ctx, t, src, 300*time.Millisecond)
	p, err := c.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: stream, Group: "g", Start: "-", End: "+", Count: 10}).Result()
	if err != nil || len(p) != 1 || p[0].Consumer != "thief" {
		t.Errorf("pending %+v (%v), want the entry with thief", p, err)
	}
}

// TestWindow: Configure sizes the reads and the bound on held entries from
// the runtime's window; a Source at the bound reads nothing more until a
// delivery settles.
func TestWindow(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, brokertest.NewMessages("win", 10, 0)...)
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g"})
	if w := src.Configure(consumer.SourceSettings{Window: 2}); w != 4 {
		t.Fatalf("Configure(2) = %d, want 4", w)
	}
	ds := brokertest.ReceiveN(ctx, t, src, 4)
	brokertest.ReceiveNone(ctx, t, src, 300*time.Millisecond)
	if p, _ := client(t, testURL()).XPending(ctx, stream, "g").Result(); p.Count != 4 {
		t.Errorf("%d entries read, want 4", p.Count)
	}
	if err := ds[0].Ack(ctx); err != nil {
		t.Fatal(err)
	}
	_ = brokertest.Receive(ctx, t, src)
	if w := src.Configure(consumer.SourceSettings{Window: 100}); w != 4 {
		t.Errorf("Configure after the first Receive = %d, want 4 unchanged", w)
	}
}
