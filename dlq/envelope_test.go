package dlq_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

func failure(class consumer.FailureClass, msg string, at time.Time) consumer.Failure {
	return consumer.Failure{Consumer: "billing", MessageID: "m-1", Class: class, Err: errors.New(msg),
		Attempts: 3, FirstFailure: at.Add(-time.Second), LastFailure: at}
}

func TestEnvelopeRoundTrip(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 11, 1, 12, 0, 0, 5, time.UTC)
	msg := &consumer.Message{ID: "m-1", Key: "orders/3", Body: []byte("{}"), Source: "orders", Partition: 3, Offset: 42,
		Headers: map[string]string{"traceparent": "00-abc"}}
	env := dlq.Envelope(msg, failure(consumer.ClassRetryableExhausted, "deadlock", at), dlq.Options{Host: "worker-7"})
	if string(env.Body) != "{}" || env.Header("traceparent") != "00-abc" {
		t.Fatalf("body or headers changed: %+v", env)
	}
	if len(msg.Headers) != 1 {
		t.Fatal("Envelope mutated the original")
	}
	r, err := dlq.Parse(env)
	if err != nil {
		t.Fatal(err)
	}
	want := dlq.Entry{Consumer: "billing", MessageID: "m-1", Class: consumer.ClassRetryableExhausted, Error: "deadlock",
		Attempts: 3, FirstFailure: at.Add(-time.Second), LastFailure: at, Source: "orders", Partition: 3, Offset: 42, Host: "worker-7", Key: "orders/3"}
	if r.Entry != want || r.DeadLetters != 1 || len(r.History) != 0 {
		t.Fatalf("parsed %+v\nwant   %+v", r, want)
	}
}

func TestEnvelopeHistoryGrowsAndIsBounded(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC)
	msg := &consumer.Message{ID: "m-1", Key: "customer-7", Body: []byte("x"), Source: "orders", Partition: -1, Offset: -1}
	for i := 0; i < 5; i++ {
		// A replayed message arrives from the DLQ, with the DLQ as
		// source and, on Kafka, as ordering key.
		msg = dlq.Envelope(msg, failure(consumer.ClassPermanent, strings.Repeat("e", i+1), at.Add(time.Duration(i)*time.Hour)), dlq.Options{MaxHistory: 3})
		msg.Source, msg.Key = "orders.dlq", "orders.dlq/0"
	}
	r, err := dlq.Parse(msg)
	if err != nil {
		t.Fatal(err)
	}
	if r.DeadLetters != 5 || len(r.History) != 3 || r.Error != "eeeee" || r.History[0].Error != "ee" || r.History[2].Error != "eeee" {
		t.Fatalf("history %+v (dead letters %d, error %q)", r.History, r.DeadLetters, r.Error)
	}
	if r.Source != "orders" || r.Key != "customer-7" {
		t.Fatalf("original source or key lost across re-dead-lettering: %q, %q", r.Source, r.Key)
	}
	if _, ok := msg.Headers["x-idemq-partition"]; ok {
		t.Fatal("partition header written for a broker without partitions")
	}
}

func TestEnvelopeTruncatesError(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("é", 1000)
	env := dlq.Envelope(&consumer.Message{ID: "m"}, failure(consumer.ClassPanic, long, time.Now()), dlq.Options{MaxErrorBytes: 100})
	e := env.Header("x-idemq-error")
	if len(e) > 100 || !strings.HasSuffix(e, "[truncated]") || !strings.HasPrefix(e, "éé") {
		t.Fatalf("truncated error %q (%d bytes)", e, len(e))
	}
}

func TestParseErrors(t *testing.T) {
	t.Parallel()
	if _, err := dlq.Parse(&consumer.Message{}); !errors.Is(err, dlq.ErrNoEnvelope) {
		t.Fatalf("no envelope: %v", err)
	}
	bad := &consumer.Message{Headers: map[string]string{"x-idemq-error-class": "permanent", "x-idemq-attempts": "three"}}
	if _, err := dlq.Parse(bad); err == nil || !strings.Contains(err.Error(), "x-idemq-attempts") {
		t.Fatalf("malformed attempts: %v", err)
	}
}

func TestRestore(t *testing.T) {
	t.Parallel()
	env := dlq.Envelope(&consumer.Message{ID: "broker-id", Key: "orders/1", Source: "orders", Partition: 1, Offset: 9, Body: []byte("b")},
		consumer.Failure{Consumer: "c", MessageID: "dedup-id", Class: consumer.ClassPermanent, Err: errors.New("x")}, dlq.Options{})
	env.Source, env.Partition, env.Offset, env.Key = "orders.dlq", 0, 77, "orders.dlq/0"
	r, _ := dlq.Parse(env)
	m := r.Restore(env)
	if m.ID != "dedup-id" || m.Key != "orders/1" || m.Source != "orders" || m.Partition != 1 || m.Offset != 9 || !m.Redelivered {
		t.Fatalf("restored %+v", m)
	}
	// An envelope from before the original key was kept: the dead
	// letter's own key stays.
	delete(env.Headers, "x-idemq-original-key")
	r, _ = dlq.Parse(env)
	if m := r.Restore(env); m.Key != "orders.dlq/0" {
		t.Fatalf("restored key %q without x-idemq-original-key, want the dead letter's", m.Key)
	}
}

func TestNewDeadLettererValidation(t *testing.T) {
	t.Parallel()
	if _, err := dlq.NewDeadLetterer(nil, dlq.Options{}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Fatalf("nil publish: %v", err)
	}
	if _, err := dlq.NewDeadLetterer(func(_ context.Context, _ *consumer.Message) error { return nil }, dlq.Options{MaxErrorBytes: 3}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Fatalf("tiny MaxErrorBytes: %v", err)
	}
}

// An envelope written before the original's key was kept, dead-lettered
// again from the dead-letter queue, records no key: the message's own is
// the dead-letter queue's, not the original's.
func TestEnvelopeOfAnEnvelopeWithoutKey(t *testing.T) {
	t.Parallel()
	env := dlq.Envelope(&consumer.Message{ID: "m-1", Key: "orders/1", Body: []byte("b")},
		consumer.Failure{Consumer: "c", MessageID: "m-1", Class: consumer.ClassPermanent, Err: errors.New("x")}, dlq.Options{})
	delete(env.Headers, "x-idemq-original-key") // as an earlier version wrote it
	env.Key = "orders.dlq/0"
	again := dlq.Envelope(env, consumer.Failure{Consumer: "c", MessageID: "m-1", Class: consumer.ClassPermanent, Err: errors.New("y")}, dlq.Options{})
	r, err := dlq.Parse(again)
	if err != nil {
		t.Fatal(err)
	}
	if r.Key != "" || again.Header("x-idemq-original-key") != "" {
		t.Fatalf("recorded key %q, header %q: want none, the dead-letter queue's key is not the original's", r.Key, again.Header("x-idemq-original-key"))
	}
}

// An earlier envelope of another consumer (a requeued message that reached
// another queue, or headers a producer wrote) gives neither the source nor
// the key: the envelope records msg's, the ones this consumer saw.
func TestEnvelopeOfAnotherConsumersEnvelope(t *testing.T) {
	t.Parallel()
	msg := &consumer.Message{ID: "o-1", Key: "tenant-a", Source: "billing-q", Partition: -1, Offset: -1, Body: []byte("b"),
		Headers: map[string]string{"x-idemq-error-class": "permanent", "x-idemq-consumer": "other",
			"x-idemq-original-key": "tenant-zzz", "x-idemq-source": "elsewhere"}}
	env := dlq.Envelope(msg, consumer.Failure{Consumer: "billing", MessageID: "o-1", Class: consumer.ClassPermanent, Err: errors.New("x")},
		dlq.Options{SigningKey: []byte("0123456789abcdef0123456789abcdef")})
	r, err := dlq.Parse(env)
	if err != nil {
		t.Fatal(err)
	}
	if r.Key != "tenant-a" || r.Source != "billing-q" || r.DeadLetters != 2 {
		t.Fatalf("recorded key %q, source %q, dead letters %d: want billing's own tenant-a and billing-q, the other's envelope in the history", r.Key, r.Source, r.DeadLetters)
	}
}
