package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkatest"
)

// statusBrokerDeadLetters makes RabbitMQ dead-letter n messages into dead
// itself: it publishes them to a fresh work queue whose dead-letter
// exchange routes to dead, and rejects each without requeue. They arrive
// raw, with the broker's x-death and x-first-death-* headers and no idemq
// envelope, as a quorum queue's delivery limit leaves them.
func statusBrokerDeadLetters(t *testing.T, dead string, n int) {
	t.Helper()
	work := dead + ".work"
	statusAMQP(t, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(work, true, false, false, false, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead})
		return err
	})
	t.Cleanup(func() {
		statusAMQP(t, func(ch *amqp.Channel) error {
			_, err := ch.QueueDelete(work, false, false, false)
			return err
		})
	})
	statusAMQP(t, func(ch *amqp.Channel) error {
		for i := range n {
			err := ch.PublishWithContext(context.Background(), "", work, false, false, amqp.Publishing{MessageId: fmt.Sprint("raw-", i), Body: []byte("x")})
			if err != nil {
				return err
			}
		}
		deadline := time.Now().Add(10 * time.Second)
		for rejected := 0; rejected < n; {
			d, ok, err := ch.Get(work, false)
			switch {
			case err != nil:
				return err
			case !ok && time.Now().After(deadline):
				return fmt.Errorf("rejected %d of %d messages of %s", rejected, n, work)
			case ok:
				if err := d.Reject(false); err != nil {
					return err
				}
				rejected++
			}
		}
		return nil
	})
}

// statusWaitDepth waits until queue q holds n ready messages.
func statusWaitDepth(t *testing.T, q string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for statusDepth(t, q) != n {
		if time.Now().After(deadline) {
			t.Fatalf("queue %s holds %d messages, want %d", q, statusDepth(t, q), n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// statusDLQOf runs status with args and --json, and returns its one DLQ.
func statusDLQOf(t *testing.T, args ...string) statusDLQ {
	t.Helper()
	r := idemq(t, append(args, "--json")...)
	want(t, r, exitOK, "", "")
	var got statusReport
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	if len(got.DLQ) != 1 {
		t.Fatalf("dlq %+v, want one", got.DLQ)
	}
	return got.DLQ[0]
}

// checkClasses checks a DLQ's counts by class and what they were read of.
func checkClasses(t *testing.T, d statusDLQ, classes map[string]int, counted, limit int, truncated bool) {
	t.Helper()
	if !maps.Equal(d.Classes, classes) || d.Classes == nil || d.Counted != counted || d.CountLimit != limit ||
		d.CountTruncated != truncated || d.CountError != "" {
		t.Errorf("dlq %s: classes %v, counted %d of at most %d, truncated %v, error %q; want %v, %d of at most %d, %v",
			d.Name, d.Classes, d.Counted, d.CountLimit, d.CountTruncated, d.CountError, classes, counted, limit, truncated)
	}
}

// TestStatusClassCountsRabbitMQ: status counts a RabbitMQ DLQ's dead letters
// by class, reading them as dlq inspect does and consuming none: those
// idemq dead-lettered by their envelope's class, and those RabbitMQ
// dead-lettered itself (x-death, no envelope) apart, named plainly, in the
// text and the JSON form. --dlq-count-limit bounds the count, and the
// output says when it cut it short; 0 reads none.
func TestStatusClassCountsRabbitMQ(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, args := migrated(t)
	dead := statusQueue(t)
	dl := rmqDeadLetterer(ctx, t, dead, dlq.Options{})
	for i, class := range []consumer.FailureClass{consumer.ClassPermanent, consumer.ClassPermanent, consumer.ClassTimeout} {
		id := fmt.Sprint("m-", i)
		err := dl.DeadLetter(ctx, &consumer.Message{ID: id, Body: []byte("x"), Source: dead + ".work", Partition: -1, Offset: -1},
			consumer.Failure{Consumer: "billing", MessageID: id, Class: class, Err: errors.New("bug"), Attempts: 1,
				FirstFailure: time.Now(), LastFailure: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
	}
	statusWaitDepth(t, dead, 3)
	statusBrokerDeadLetters(t, dead, 2)
	statusWaitDepth(t, dead, 5)

	base := append([]string{"status", "--consumer", "billing", "--amqp-url", rabbitmq.DefaultURL, "--dlq-queue", dead}, args...)
	r := idemq(t, base...)
	want(t, r, exitOK, "dlq rabbitmq:    "+dead+": 5 ready messages; by class: broker-dead-lettered (no idemq envelope): 2, permanent: 2, timeout: 1\n", "")
	checkClasses(t, statusDLQOf(t, base...), map[string]int{"broker": 2, "permanent": 2, "timeout": 1}, 5, 1000, false)

	// The first three are idemq's, in the order they were dead-lettered.
	r = idemq(t, append(base, "--dlq-count-limit", "3")...)
	want(t, r, exitOK, "dlq rabbitmq:    "+dead+": 5 ready messages; counted 3 of 5 (--dlq-count-limit), by class: permanent: 2, timeout: 1\n", "")
	checkClasses(t, statusDLQOf(t, append(base, "--dlq-count-limit", "3")...), map[string]int{"permanent": 2, "timeout": 1}, 3, 3, true)

	r = idemq(t, append(base, "--dlq-count-limit", "0")...)
	want(t, r, exitOK, "dlq rabbitmq:    "+dead+": 5 ready messages\n", "")
	r = idemq(t, append(base, "--dlq-count-limit", "0", "--json")...)
	want(t, r, exitOK, `"classes": null`, "")
	want(t, idemq(t, append(base, "--dlq-count-limit", "-1")...), exitUsage, "", "--dlq-count-limit")

	if n := statusDepth(t, dead); n != 5 {
		t.Errorf("depth after status: %d, want 5: counting consumed dead letters", n)
	}
	help := idemq(t, "status", "--help")
	want(t, help, exitOK, `"broker-dead-lettered (no idemq envelope)"`, "")
	want(t, help, exitOK, "--dlq-count-limit", "")

	// An empty queue is counted without reading it.
	empty := statusQueue(t)
	checkClasses(t, statusDLQOf(t, append(base, "--dlq-queue", empty)...), map[string]int{}, 0, 1000, false)
}

// TestStatusClassCountsQuorumWarning: the dead letters of a RabbitMQ quorum
// queue carry x-delivery-count, and every read counts a delivery toward its
// delivery limit (before RabbitMQ 4.3): status counts them all the same
// and says so on the line, and in the JSON form.
func TestStatusClassCountsQuorumWarning(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, args := migrated(t)
	dead := "idemq-status-test-quorum-" + randHex(4)
	statusAMQP(t, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(dead, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum})
		return err
	})
	t.Cleanup(func() {
		statusAMQP(t, func(ch *amqp.Channel) error {
			_, err := ch.QueueDelete(dead, false, false, false)
			return err
		})
	})
	dl := rmqDeadLetterer(ctx, t, dead, dlq.Options{})
	err := dl.DeadLetter(ctx, &consumer.Message{ID: "q-1", Body: []byte("x"), Source: "work", Partition: -1, Offset: -1},
		consumer.Failure{Consumer: "billing", MessageID: "q-1", Class: consumer.ClassPanic, Err: errors.New("boom"), Attempts: 1,
			FirstFailure: time.Now(), LastFailure: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	statusWaitDepth(t, dead, 1)
	base := append([]string{"status", "--consumer", "billing", "--dlq-queue", dead}, args...)
	// The first read counts a delivery: from then on, the dead letter
	// carries x-delivery-count whatever the version.
	want(t, idemq(t, base...), exitOK, dead+": 1 ready messages; by class: panic: 1", "")
	statusWaitDepth(t, dead, 1)
	r := idemq(t, base...)
	want(t, r, exitOK, dead+": 1 ready messages; by class: panic: 1; warning: they carry x-delivery-count", "")
	want(t, r, exitOK, "--dlq-count-limit 0", "")
	d := statusDLQOf(t, base...)
	checkClasses(t, d, map[string]int{"panic": 1}, 1, 1000, false)
	if !d.XDeliveryCount {
		t.Errorf("x_delivery_count false for a quorum queue: %+v", d)
	}
}

// TestStatusClassCountsStreamsAndKafka: status counts a NATS JetStream, a
// Redis Streams and a Kafka DLQ by class too, consuming nothing (and on
// Kafka making no consumer group); a dead letter with no envelope counts
// as "none", and --dlq-count-limit bounds each count.
func TestStatusClassCountsStreamsAndKafka(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		broker string
		// fill writes the dead letters of a fresh DLQ, and returns the
		// flags that select it and a function that says how many it holds.
		fill    func(ctx context.Context, t *testing.T) (flags []string, held func() int)
		text    string
		classes map[string]int
	}{
		{"nats", statusFillNATS, "; by class: permanent: 2, timeout: 1\n", map[string]int{"permanent": 2, "timeout": 1}},
		{"redis", statusFillRedis, "; by class: panic: 2, no envelope: 1\n", map[string]int{"panic": 2, "none": 1}},
		{"kafka", statusFillKafka, " records in 2 partitions; by class: permanent: 2, no envelope: 1\n", map[string]int{"permanent": 2, "none": 1}},
	} {
		t.Run(tc.broker, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			_, args := migrated(t)
			flags, held := tc.fill(ctx, t)
			base := append(append([]string{"status", "--consumer", "billing"}, flags...), args...)
			want(t, idemq(t, base...), exitOK, tc.text, "")
			checkClasses(t, statusDLQOf(t, base...), tc.classes, 3, statusCountLimit, false)
			want(t, idemq(t, append(base, "--dlq-count-limit", "1")...), exitOK, "; counted 1 of 3 (--dlq-count-limit), by class: ", "")
			if d := statusDLQOf(t, append(base, "--dlq-count-limit", "1")...); d.Counted != 1 || !d.CountTruncated || len(d.Classes) != 1 {
				t.Errorf("bounded to 1: %+v", d)
			}
			if n := held(); n != 3 {
				t.Errorf("after status: %d dead letters, want 3", n)
			}
		})
	}
}

// statusFillNATS dead-letters three messages to a NATS dead-letter subject.
func statusFillNATS(ctx context.Context, t *testing.T) ([]string, func() int) {
	f := newNATSFixture(ctx, t, dlq.Options{})
	for i, class := range []consumer.FailureClass{consumer.ClassPermanent, consumer.ClassTimeout, consumer.ClassPermanent} {
		f.deadLetter(ctx, t, fmt.Sprint("n-", i), "x", consumer.Failure{Class: class, Err: errors.New("bug")})
	}
	return []string{"--dlq-subject", f.dead}, func() int { return len(f.read(ctx, t, f.dead)) }
}

// statusFillRedis dead-letters two messages to a Redis dead-letter stream,
// and adds an entry with no envelope.
func statusFillRedis(ctx context.Context, t *testing.T) ([]string, func() int) {
	f := newRedisFixture(ctx, t, dlq.Options{})
	for i := range 2 {
		f.deadLetter(ctx, t, fmt.Sprint("r-", i), "x", consumer.Failure{Class: consumer.ClassPanic, Err: errors.New("boom")})
	}
	if err := redisClient(t).XAdd(ctx, &redis.XAddArgs{Stream: f.dead, Values: []string{"body", "raw"}}).Err(); err != nil {
		t.Fatal(err)
	}
	return []string{"--dlq-stream-key", f.dead}, func() int { return len(f.read(ctx, t, f.dead)) }
}

// statusFillKafka dead-letters two records to a Kafka dead-letter topic of
// two partitions, and adds one with no envelope; held also fails the test
// if the cluster has a consumer group.
func statusFillKafka(ctx context.Context, t *testing.T) ([]string, func() int) {
	c := kafkatest.Start(t)
	dead := kafkatest.Name(t, "dlq")
	c.CreateTopic(t, dead, 2)
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: c.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		m = m.Clone()
		m.ID = "" // no idempotency-key: the id lives in the envelope only
		return pub.Publish(ctx, dead, m)
	}, dlq.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		id := fmt.Sprint("k-", i)
		err := dl.DeadLetter(ctx, &consumer.Message{ID: id, Key: id, Body: []byte("x"), Source: "payments", Partition: 0, Offset: int64(i)},
			consumer.Failure{Consumer: "billing", MessageID: id, Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1,
				FirstFailure: time.Now(), LastFailure: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := pub.Publish(ctx, dead, &consumer.Message{ID: "raw", Key: "raw", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	return []string{"--kafka-brokers", strings.Join(c.Addrs(), ","), "--dlq-topic", dead}, func() int {
		if g := kafkaGroups(ctx, t, c.Addrs()); len(g) != 0 {
			t.Errorf("status made consumer groups %v", g)
		}
		return len(kafkaRecords(ctx, t, c.Addrs(), dead))
	}
}

// TestStatusClassCountError: when the dead letters cannot be read, the
// DLQ keeps its depth and says why it was not counted, with no password;
// the JSON form has no classes then.
func TestStatusClassCountError(t *testing.T) {
	t.Parallel()
	const password = "count-s3cret-pw"
	depth := int64(5)
	d := statusDLQ{Broker: "rabbitmq", Name: "payments.dlq", Depth: &depth}
	bf := &brokerFlags{broker: "rabbitmq", amqpURL: "amqp://guest:" + password + "@127.0.0.1:1/", queue: "payments.dlq"}
	statusCountClasses(context.Background(), bf, &d, 1000)
	if d.CountError == "" || d.Classes != nil || d.Counted != 0 || d.Depth == nil || *d.Depth != 5 {
		t.Fatalf("dlq %+v: want its depth, no classes and the error", d)
	}
	var out strings.Builder
	if err := (&statusReport{DLQ: []statusDLQ{d}}).print(&out); err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{out.String(), string(js)} {
		if strings.Contains(s, password) {
			t.Errorf("the password was printed: %s", s)
		}
	}
	if !strings.Contains(out.String(), "payments.dlq: 5 ready messages; not counted by class: ") {
		t.Errorf("text form:\n%s", out.String())
	}
	if !strings.Contains(string(js), `"classes":null`) || !strings.Contains(string(js), `"count_error":"`) {
		t.Errorf("JSON form: %s", js)
	}
}
