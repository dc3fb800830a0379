package kafka_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkatest"
)

// signingKey signs the envelopes in these tests.
var signingKey = bytes.Repeat([]byte{7}, 32)

// poisonous fails for good on bodies starting with "poison", and applies
// the rest.
func (d *db) poisonous(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if strings.HasPrefix(string(m.Body), "poison") {
		return consumer.Permanent(errors.New("poison order"))
	}
	return d.apply(ctx, tx, m)
}

// readDeadLetters consumes n records of topic with a group of its own and
// returns them by message id.
func readDeadLetters(ctx context.Context, t *testing.T, e *env, topic string, n int) map[string]*consumer.Message {
	t.Helper()
	src := e.source(t, func(c *kafka.Config) { c.Topic = topic; c.GroupID = kafkatest.Name(t, "dlq") })
	out := map[string]*consumer.Message{}
	for len(out) < n {
		d, err := src.Receive(ctx)
		if err != nil {
			t.Fatalf("receive dead letter %d of %d: %v", len(out)+1, n, err)
		}
		out[d.Message().ID] = d.Message()
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// TestDeadLettererE2E: through the runtime, permanent failures land in the
// DLQ topic, <topic>.dlq by default, with signed envelopes and their record
// keys, in the partition the key hashes to; a produce whose connection the
// broker drops is retried and lands; the dead-letterer writes on the
// Source's transport; and the runtime's Close of the Source closes it.
func TestDeadLettererE2E(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 2)
	dlqTopic := kafka.DLQName(e.topic)
	e.c.CreateTopic(t, dlqTopic, 2) // as many partitions as the topic
	d := newDB(t)

	// produced counts the produce requests to the DLQ topic; the first
	// one loses its connection.
	// Produce v13 and later name topics by id.
	var produced atomic.Int64
	dlqID := e.c.TopicInfo(dlqTopic).TopicID
	toDLQ := func(r kmsg.Request) bool {
		for _, tp := range r.(*kmsg.ProduceRequest).Topics {
			if tp.Topic == dlqTopic || tp.TopicID == dlqID {
				return true
			}
		}
		return false
	}
	e.c.ControlKey(int16(kmsg.Produce), func(r kmsg.Request) (kmsg.Response, error, bool) {
		if toDLQ(r) {
			produced.Add(1)
		}
		return nil, nil, false // observed, not handled: it stays
	})
	e.c.ControlKey(int16(kmsg.Produce), func(r kmsg.Request) (kmsg.Response, error, bool) {
		if !toDLQ(r) {
			return nil, nil, false
		}
		return nil, errors.New("connection dropped by the test"), true // handled: dropped after this
	})

	src := e.source(t, func(c *kafka.Config) { c.DeadLetter.Options.SigningKey = signingKey })
	dl := src.DeadLetterer()
	if dl == nil || src.DeadLetterer() != dl {
		t.Fatalf("DeadLetterer: %p, then %p; want one non-nil dead-letterer", dl, src.DeadLetterer())
	}
	var msgs, bad []*consumer.Message
	for i := range 10 {
		m := &consumer.Message{ID: fmt.Sprintf("order-%d", i), RecordKey: fmt.Appendf(nil, "customer-%d", i), Body: fmt.Appendf(nil, "order-%d", i)}
		if i%3 == 0 {
			m.Body = append([]byte("poison-"), m.Body...)
			bad = append(bad, m)
		}
		msgs = append(msgs, m)
	}
	if err := e.pub.Publish(ctx, e.topic, msgs...); err != nil {
		t.Fatal(err)
	}
	r := d.start(t, src, d.poisonous, func(c *consumer.Config) { c.DeadLetterer = dl })
	waitFor(t, 30*time.Second, "every record settled", func() bool { return r.settled() == int64(len(msgs)) })
	r.stop(t) // closes src

	st := r.rt.Stats()
	if st.DeadLettered != int64(len(bad)) || st.Applied != int64(len(msgs)-len(bad)) {
		t.Errorf("stats %+v: want %d dead-lettered, %d applied", st, len(bad), len(msgs)-len(bad))
	}
	if n := produced.Load(); n < 2 {
		t.Errorf("%d produce requests to the DLQ topic, want at least 2: one dropped, one retried", n)
	}
	got := readDeadLetters(ctx, t, e, dlqTopic, len(bad))
	for _, want := range bad {
		m := got[want.ID]
		if m == nil {
			t.Errorf("dead letter %q missing; got %v", want.ID, got)
			continue
		}
		rec, err := dlq.Parse(m)
		if err != nil {
			t.Fatalf("dead letter %q: %v", want.ID, err)
		}
		if err := dlq.Verify(m, signingKey); err != nil {
			t.Errorf("dead letter %q: signature: %v", want.ID, err)
		}
		if rec.Class != consumer.ClassPermanent || rec.Source != e.topic || rec.MessageID != want.ID || rec.Offset < 0 || !strings.Contains(rec.Error, "poison order") {
			t.Errorf("dead letter %q: envelope %+v", want.ID, rec.Entry)
		}
		if !bytes.Equal(m.RecordKey, want.RecordKey) || !bytes.Equal(m.Body, want.Body) {
			t.Errorf("dead letter %q: record key %q, body %q; want %q, %q", want.ID, m.RecordKey, m.Body, want.RecordKey, want.Body)
		}
		if m.Partition != rec.Partition {
			t.Errorf("dead letter %q in partition %d, the original in %d: the key must hash alike", want.ID, m.Partition, rec.Partition)
		}
	}

	shares, closed := kafka.DeadLetterPublisher(src)
	if !shares || !closed {
		t.Errorf("dead-letter publisher: on the Source's transport %v, closed %v; want both true", shares, closed)
	}
	err := dl.DeadLetter(ctx, bad[0], consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("late")})
	if !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("DeadLetter after Close: %v, want an error wrapping consumer.ErrSourceClosed", err)
	}
	if src.DeadLetterer() != dl {
		t.Error("DeadLetterer after Close returned another dead-letterer")
	}
}

// TestDeadLettererTopic: the accessor's dead-letterer writes to
// <topic>.dlq by default and to Config.DeadLetter.Topic when set, with the
// configured envelope options, and is closed by the Source's Close even if
// it never wrote.
func TestDeadLettererTopic(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 1)
	for _, tc := range []struct {
		name  string
		topic string // Config.DeadLetter.Topic
		want  string // where the dead letter lands
	}{
		{name: "default", want: kafka.DLQName(e.topic)},
		{name: "configured", topic: e.topic + "-failed", want: e.topic + "-failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e.c.CreateTopic(t, tc.want, 1)
			src := e.source(t, func(c *kafka.Config) {
				c.DeadLetter = kafka.DeadLetterConfig{Topic: tc.topic, Options: dlq.Options{SigningKey: signingKey, Host: "host-" + tc.name}}
			})
			m := &consumer.Message{ID: "dl-" + tc.name, RecordKey: []byte("k"), Body: []byte("body-" + tc.name), Source: e.topic}
			if err := src.DeadLetterer().DeadLetter(ctx, m, consumer.Failure{MessageID: m.ID, Class: consumer.ClassPermanent, Err: errors.New("boom")}); err != nil {
				t.Fatal(err)
			}
			got := readDeadLetters(ctx, t, e, tc.want, 1)[m.ID]
			if got == nil {
				t.Fatalf("no dead letter %q in %s", m.ID, tc.want)
			}
			rec, err := dlq.Parse(got)
			if err != nil {
				t.Fatal(err)
			}
			if err := dlq.Verify(got, signingKey); err != nil {
				t.Errorf("signature: %v", err)
			}
			if rec.MessageID != m.ID || rec.Host != "host-"+tc.name || string(got.Body) != string(m.Body) {
				t.Errorf("dead letter in %s: %+v, body %q", tc.want, rec.Entry, got.Body)
			}
			if err := src.Close(); err != nil {
				t.Fatal(err)
			}
			if _, closed := kafka.DeadLetterPublisher(src); !closed {
				t.Error("the dead-letter publisher is open after the Source's Close")
			}
		})
	}
}

// TestDeadLettererConfig: the dead-letter topic defaults to <topic>.dlq,
// may be named, and must be a legal topic other than the Source's own; the
// envelope options are validated.
func TestDeadLettererConfig(t *testing.T) {
	const topic = "orders"
	for _, tc := range []struct {
		cfg     kafka.DeadLetterConfig
		want    string
		invalid bool
	}{
		{cfg: kafka.DeadLetterConfig{}, want: "orders.dlq"},
		{cfg: kafka.DeadLetterConfig{Topic: "failed-orders"}, want: "failed-orders"},
		{cfg: kafka.DeadLetterConfig{Topic: topic}, invalid: true},
		{cfg: kafka.DeadLetterConfig{Topic: "no spaces"}, invalid: true},
		{cfg: kafka.DeadLetterConfig{Topic: strings.Repeat("x", 250)}, invalid: true},
	} {
		got, err := tc.cfg.DeadLetterTopic(topic)
		var ce *consumer.ConfigError
		switch {
		case tc.invalid && !errors.As(err, &ce):
			t.Errorf("%+v: %q, %v; want a *consumer.ConfigError", tc.cfg, got, err)
		case !tc.invalid && (err != nil || got != tc.want):
			t.Errorf("%+v: %q, %v; want %q", tc.cfg, got, err, tc.want)
		}
	}
	ok := kafka.Config{Brokers: []string{"127.0.0.1:1"}, Topic: topic, GroupID: "g"}
	for name, tc := range map[string]struct {
		dl    kafka.DeadLetterConfig
		field string
	}{
		"own topic":         {kafka.DeadLetterConfig{Topic: topic}, "kafka.DeadLetter.Topic"},
		"illegal topic":     {kafka.DeadLetterConfig{Topic: "no spaces"}, "kafka.DeadLetter.Topic"},
		"short signing key": {kafka.DeadLetterConfig{Options: dlq.Options{SigningKey: []byte("short")}}, "kafka.DeadLetter.Options.SigningKey"},
		"max history":       {kafka.DeadLetterConfig{Options: dlq.Options{MaxHistory: -1}}, "kafka.DeadLetter.Options.MaxHistory"},
	} {
		cfg := ok
		cfg.DeadLetter = tc.dl
		src, err := kafka.NewSource(cfg)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field {
			t.Errorf("%s: NewSource = %v, %v; want a *consumer.ConfigError on %s", name, src, err, tc.field)
		}
		if src != nil {
			_ = src.Close()
		}
	}
	// The default topic of a topic too long for ".dlq" must be named.
	long := strings.Repeat("x", 247)
	cfg := ok
	cfg.Topic = long
	if _, err := kafka.NewSource(cfg); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("NewSource of a %d-byte topic with the default dead-letter topic: %v, want ErrInvalidConfig", len(long), err)
	}
	cfg.DeadLetter.Topic = "short.dlq"
	src, err := kafka.NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	_ = src.Close()
}
