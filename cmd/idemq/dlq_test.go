package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// rmqQueues declares a fresh work queue and DLQ, deleted at cleanup.
func rmqQueues(t *testing.T) (work, dead string) {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	work = "idemq-cli-test-" + hex.EncodeToString(b[:])
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

func rmqDepth(t *testing.T, q string) int {
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

// rmqDeadLetterer returns a dead-letterer publishing, confirmed, to the
// RabbitMQ queue dead; its publisher closes at cleanup.
func rmqDeadLetterer(ctx context.Context, t *testing.T, dead string, opts dlq.Options) *dlq.DeadLetterer {
	t.Helper()
	pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return pub.Publish(ctx, "", dead, m)
	}, opts)
	if err != nil {
		t.Fatal(err)
	}
	return dl
}

func TestDLQInspectAndReplayRabbitMQ(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store, dbArgs := migrated(t)
	work, dead := rmqQueues(t)

	dl := rmqDeadLetterer(ctx, t, dead, dlq.Options{})
	// Five dead letters: three permanent, one timeout, and one whose id
	// was in fact applied.
	for i := 0; i < 5; i++ {
		id := fmt.Sprintf("m-%d", i)
		class, reason := consumer.ClassPermanent, "unknown account"
		if i == 3 {
			class, reason = consumer.ClassTimeout, "handler timed out"
		}
		body := []byte(fmt.Sprintf(`{"n":%d}`, i))
		err := dl.DeadLetter(ctx, &consumer.Message{ID: id, Body: body, Source: work, Partition: -1, Offset: -1},
			consumer.Failure{Consumer: "billing", MessageID: id, Class: class, Err: errors.New(reason), Attempts: 1,
				FirstFailure: time.Now(), LastFailure: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
	}
	fp := (&consumer.Message{Body: []byte(`{"n":4}`)}).Fingerprint()
	claim(t, store, consumer.Claim{Consumer: "billing", MessageID: "m-4", Fingerprint: fp, Partition: -1, Offset: -1})

	r := idemq(t, "dlq", "inspect", "--queue", dead)
	want(t, r, 0, "5 dead-lettered messages in 2 groups", "")
	want(t, r, 0, "unknown account", "")
	r = idemq(t, "dlq", "inspect", "--queue", dead, "--json", "--class", "timeout")
	var rep dlq.Report
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || rep.Total != 1 || rep.Groups[0].Class != consumer.ClassTimeout {
		t.Fatalf("inspect --json: %v %+v\n%s", err, rep, r.stdout)
	}
	if n := rmqDepth(t, dead); n != 5 {
		t.Fatalf("inspect consumed messages: DLQ depth %d", n)
	}

	r = idemq(t, append([]string{"dlq", "replay", "--queue", dead, "--dry-run", "--retention", "72h"}, dbArgs...)...)
	want(t, r, 0, "4 will apply, 1 already applied, 0 fingerprint mismatch", "")
	if n := rmqDepth(t, dead); n != 5 {
		t.Fatalf("dry run consumed messages: DLQ depth %d", n)
	}

	r = idemq(t, append([]string{"dlq", "replay", "--queue", dead, "--class", "permanent", "--retention", "72h"}, dbArgs...)...)
	want(t, r, 0, "republished 3", "")
	want(t, r, 0, "skipped 1 already applied", "")
	if w, d := rmqDepth(t, work), rmqDepth(t, dead); w != 3 || d != 1 {
		t.Fatalf("after replay: work queue %d (want 3), DLQ %d (want the timeout one)", w, d)
	}

	want(t, idemq(t, "dlq", "replay", "--queue", dead, "--class", "bogus"), 2, "", "not an error class")
	want(t, idemq(t, "dlq", "inspect"), 2, "", "--queue is required")
	want(t, idemq(t, "dlq", "inspect", "--broker", "sqs", "--queue", "x"), 2, "", "want rabbitmq or kafka")
}

// TestDLQReplayVerifyKeyFile: with --verify-key-file, the CLI republishes
// only signed dead letters, and a forged one naming another queue stays in
// the DLQ.
func TestDLQReplayVerifyKeyFile(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, dbArgs := migrated(t)
	work, dead := rmqQueues(t)
	target, _ := rmqQueues(t) // what the forged envelope names as its source

	dir := t.TempDir()
	keyFile, oldFile, shortFile := dir+"/dlq.key", dir+"/old.key", dir+"/short.key"
	key := []byte("6f2d0c3e8a1b4f5d9e7c2a0b1d3f5e7a")
	for f, k := range map[string]string{keyFile: string(key) + "\n", oldFile: "an old key, rotated out, 32 byte", shortFile: "short"} {
		if err := os.WriteFile(f, []byte(k), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	signed, unsigned := rmqDeadLetterer(ctx, t, dead, dlq.Options{SigningKey: key}), rmqDeadLetterer(ctx, t, dead, dlq.Options{})
	deadLetter := func(id, source string, dl *dlq.DeadLetterer) {
		t.Helper()
		err := dl.DeadLetter(ctx, &consumer.Message{ID: id, Body: []byte(`{}`), Source: source, Partition: -1, Offset: -1},
			consumer.Failure{Consumer: "billing", MessageID: id, Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1,
				FirstFailure: time.Now(), LastFailure: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
	}
	deadLetter("signed-1", work, signed)
	deadLetter("signed-2", work, signed)
	deadLetter("forged", target, unsigned)

	r := idemq(t, "dlq", "inspect", "--queue", dead, "--verify-key-file", keyFile)
	want(t, r, 0, "3 dead-lettered messages in 1 groups; 1 unverified", "")
	base := append([]string{"dlq", "replay", "--queue", dead, "--retention", "72h"}, dbArgs...)
	want(t, idemq(t, append(base, "--verify-key-file", shortFile)...), 2, "", "at least 16")
	want(t, idemq(t, append(base, "--verify-key-file", dir+"/missing.key")...), 2, "", "read key file")
	r = idemq(t, append(base, "--dry-run", "--verify-key-file", keyFile)...)
	want(t, r, 0, "2 will apply", "")
	want(t, r, 0, "1 unverified", "")
	r = idemq(t, append(base, "--verify-key-file", oldFile+","+keyFile)...)
	want(t, r, 0, "republished 2", "")
	want(t, r, 0, "1 unverified", "")
	if w, tg, d := rmqDepth(t, work), rmqDepth(t, target), rmqDepth(t, dead); w != 2 || tg != 0 || d != 1 {
		t.Fatalf("after replay: work queue %d (want 2), forged target %d (want 0), DLQ %d (want the forged one)", w, tg, d)
	}
}
