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

	src := e.source(t)
	dl, err := src.DeadLetterer(kafka.DeadLetterConfig{Options: dlq.Options{SigningKey: bytes.Repeat([]byte{7}, 32)}})
	if err != nil {
		t.Fatal(err)
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
	if _, err := src.DeadLetterer(kafka.DeadLetterConfig{}); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("DeadLetterer after Close: %v, want an error wrapping consumer.ErrSourceClosed", err)
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

// TestDeadLettererConfig: the dead-letter topic must differ from the
// Source's; the envelope options are validated.
func TestDeadLettererConfig(t *testing.T) {
	src, err := franz.NewSource(franz.Config{Brokers: []string{"127.0.0.1:1"}, Topic: "orders", Group: "g"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = src.Close() }()
	var ce *consumer.ConfigError
	if _, err := src.DeadLetterer(kafka.DeadLetterConfig{Topic: "orders"}); !errors.As(err, &ce) {
		t.Errorf("DeadLetterer to the Source's own topic: %v, want a *consumer.ConfigError", err)
	}
	if _, err := src.DeadLetterer(kafka.DeadLetterConfig{Options: dlq.Options{SigningKey: []byte("short")}}); err == nil {
		t.Error("DeadLetterer with a short signing key: nil error")
	}
	if _, err := src.DeadLetterer(kafka.DeadLetterConfig{}); err != nil {
		t.Errorf("DeadLetterer: %v", err)
	}
}
