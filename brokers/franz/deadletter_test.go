package franz_test

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

	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// TestDeadLettererE2E: through the runtime, on Postgres, permanent failures
// land in the DLQ topic (<topic>.dlq by default) with signed envelopes,
// their record keys, and in the partition the key hashes to (the same one
// kafka.Publisher chose for the original); a produce whose connection the
// broker drops is retried and lands; and the runtime's Close of the Source
// closes the dead-letterer.
func TestDeadLettererE2E(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	const partitions = 3
	e := newEnv(t, partitions)
	dlqTopic := kafka.DLQName(e.topic)
	e.c.CreateTopic(t, dlqTopic, partitions)

	pool := testdb.Pool(t)
	store, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}

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

	var msgs, bad []*consumer.Message
	for i := range 12 {
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

	src := e.source(t, func(c *franz.Config) { c.DeadLetter.Options.SigningKey = bytes.Repeat([]byte{7}, 32) })
	dl := src.DeadLetterer()
	if dl == nil || src.DeadLetterer() != dl {
		t.Fatalf("DeadLetterer: %p, then %p; want one non-nil dead-letterer", dl, src.DeadLetterer())
	}
	rt, err := consumer.New(consumer.Config{
		Name:   "e2e",
		Source: src,
		Store:  store,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if strings.HasPrefix(string(m.Body), "poison") {
				return consumer.Permanent(errors.New("poison order"))
			}
			return nil
		},
		DeadLetterer:    dl,
		Concurrency:     4,
		ShutdownTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- rt.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	waitFor(t, 30*time.Second, "every record settled", func() bool {
		st := rt.Stats()
		return st.Applied+st.DeadLettered == int64(len(msgs)) && st.InFlight == 0
	})
	cancel()
	if err := <-done; err != nil { // Run closed src
		t.Fatalf("Run: %v", err)
	}
	done <- nil // for the cleanup

	if st := rt.Stats(); st.DeadLettered != int64(len(bad)) {
		t.Errorf("stats %+v: want %d dead-lettered", st, len(bad))
	}
	if n := produced.Load(); n < 2 {
		t.Errorf("%d produce requests to the DLQ topic, want at least 2: one dropped, one retried", n)
	}
	err = dl.DeadLetter(ctx, bad[0], consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("late")})
	if !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("DeadLetter after Close: %v, want an error wrapping consumer.ErrSourceClosed", err)
	}
	if src.DeadLetterer() != dl {
		t.Error("DeadLetterer after Close returned another dead-letterer")
	}

	reader := e.source(t, func(c *franz.Config) { c.Topic = dlqTopic; c.Group = kafkatest.Name(t, "dlq") })
	got := map[string]*consumer.Message{}
	for len(got) < len(bad) {
		d := receiveOne(ctx, t, reader)
		got[d.Message().ID] = d.Message()
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, want := range bad {
		m := got[want.ID]
		if m == nil {
			t.Errorf("dead letter %q missing", want.ID)
			continue
		}
		rec, err := dlq.Parse(m)
		if err != nil {
			t.Fatalf("dead letter %q: %v", want.ID, err)
		}
		if err := dlq.Verify(m, bytes.Repeat([]byte{7}, 32)); err != nil {
			t.Errorf("dead letter %q: signature: %v", want.ID, err)
		}
		if rec.Class != consumer.ClassPermanent || rec.Source != e.topic || rec.MessageID != want.ID {
			t.Errorf("dead letter %q: envelope %+v", want.ID, rec.Entry)
		}
		if !bytes.Equal(m.RecordKey, want.RecordKey) || !bytes.Equal(m.Body, want.Body) {
			t.Errorf("dead letter %q: record key %q, body %q; want %q, %q", want.ID, m.RecordKey, m.Body, want.RecordKey, want.Body)
		}
		if m.Partition != rec.Partition {
			t.Errorf("dead letter %q in partition %d, the original in %d: the key must hash alike", want.ID, m.Partition, rec.Partition)
		}
	}
}

// TestDeadLettererTopic: the accessor's dead-letterer produces to
// <topic>.dlq by default and to Config.DeadLetter.Topic when set, with the
// configured envelope options.
func TestDeadLettererTopic(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 1)
	key := bytes.Repeat([]byte{9}, 32)
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
			src := e.source(t, func(c *franz.Config) {
				c.DeadLetter = franz.DeadLetterConfig{Topic: tc.topic, Options: dlq.Options{SigningKey: key, Host: "host-" + tc.name}}
			})
			m := &consumer.Message{ID: "dl-" + tc.name, RecordKey: []byte("k"), Body: []byte("body-" + tc.name), Source: e.topic}
			if err := src.DeadLetterer().DeadLetter(ctx, m, consumer.Failure{MessageID: m.ID, Class: consumer.ClassPermanent, Err: errors.New("boom")}); err != nil {
				t.Fatal(err)
			}
			reader := e.source(t, func(c *franz.Config) { c.Topic = tc.want; c.Group = kafkatest.Name(t, "dlq") })
			d := receiveOne(ctx, t, reader)
			got := d.Message()
			rec, err := dlq.Parse(got)
			if err != nil {
				t.Fatal(err)
			}
			if err := dlq.Verify(got, key); err != nil {
				t.Errorf("signature: %v", err)
			}
			if got.ID != m.ID || rec.MessageID != m.ID || rec.Host != "host-"+tc.name || string(got.Body) != string(m.Body) {
				t.Errorf("dead letter in %s: id %q, %+v, body %q", tc.want, got.ID, rec.Entry, got.Body)
			}
			if err := src.Close(); err != nil {
				t.Fatal(err)
			}
			if err := src.DeadLetterer().DeadLetter(ctx, m, consumer.Failure{MessageID: m.ID, Class: consumer.ClassPermanent, Err: errors.New("late")}); !errors.Is(err, consumer.ErrSourceClosed) {
				t.Errorf("DeadLetter after Close: %v, want an error wrapping consumer.ErrSourceClosed", err)
			}
		})
	}
}

// TestDeadLettererConfig: NewSource rejects a dead-letter topic that is
// illegal or the Source's own, and invalid envelope options, with a
// *consumer.ConfigError naming the field.
func TestDeadLettererConfig(t *testing.T) {
	ok := franz.Config{Brokers: []string{"127.0.0.1:1"}, Topic: "orders", Group: "g"}
	for name, tc := range map[string]struct {
		dl    franz.DeadLetterConfig
		field string
	}{
		"own topic":         {franz.DeadLetterConfig{Topic: "orders"}, "franz.DeadLetter.Topic"},
		"illegal topic":     {franz.DeadLetterConfig{Topic: "no spaces"}, "franz.DeadLetter.Topic"},
		"short signing key": {franz.DeadLetterConfig{Options: dlq.Options{SigningKey: []byte("short")}}, "franz.DeadLetter.Options.SigningKey"},
		"max history":       {franz.DeadLetterConfig{Options: dlq.Options{MaxHistory: -1}}, "franz.DeadLetter.Options.MaxHistory"},
	} {
		cfg := ok
		cfg.DeadLetter = tc.dl
		src, err := franz.NewSource(cfg)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field {
			t.Errorf("%s: NewSource = %v, %v; want a *consumer.ConfigError on %s", name, src, err, tc.field)
		}
		if src != nil {
			_ = src.Close()
		}
	}
	src, err := franz.NewSource(ok)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = src.Close() }()
	if src.DeadLetterer() == nil {
		t.Error("DeadLetterer of the zero DeadLetterConfig: nil")
	}
}
