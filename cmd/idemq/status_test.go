package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// statusFixture fills a fresh dedup table: billing has m-1 (applied 10 days
// ago), m-2 (an hour ago) and m-3 (just now, from Kafka partition 2 offset
// 7); shipping has x-1 (20 days ago).
func statusFixture(t *testing.T) (*processed.Store, []string) {
	t.Helper()
	s, args := migrated(t)
	fp := sha256.Sum256([]byte("x"))
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m-1", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m-2", Fingerprint: fp, Source: "payments", Partition: -1, Offset: -1})
	claim(t, s, dedup.Claim{Consumer: "shipping", MessageID: "x-1", Fingerprint: fp, Source: "orders", Partition: -1, Offset: -1})
	tbl := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	_, err := testdb.Pool(t).Exec(context.Background(), `
UPDATE `+tbl+` SET processed_at = now() - CASE message_id
	WHEN 'm-1' THEN interval '10 days' WHEN 'm-2' THEN interval '1 hour' ELSE interval '20 days' END`)
	if err != nil {
		t.Fatal(err)
	}
	claim(t, s, dedup.Claim{Consumer: "billing", MessageID: "m-3", Fingerprint: fp, Source: "payments", Partition: 2, Offset: 7})
	return s, args
}

func TestStatusText(t *testing.T) {
	t.Parallel()
	_, args := statusFixture(t)
	r := idemq(t, append([]string{"status", "--consumer", "billing", "--retention", "7d"}, args...)...)
	for _, line := range []string{
		"consumer:        billing\n",
		"dedup rows:      3 (4 in the table, all consumers)\n",
		"(10d0h ago)\n",
		"purge eligible:  1 rows older than 168h0m0s (2 in the table)\n",
		"last applied:    m-3 at ",
		", from payments [2] @7\n",
		// The shared test server has no standby.
		"durability:      a commit is on 1 node before the ack (this server; no standby streams from it)\n",
	} {
		want(t, r, exitOK, line, "")
	}
	if strings.Contains(r.stdout, "dlq") {
		t.Errorf("DLQ lines without a DLQ flag:\n%s", r.stdout)
	}

	// Without --retention, and for a consumer without rows.
	r = idemq(t, append([]string{"status", "--consumer", "nobody"}, args...)...)
	for _, line := range []string{"dedup rows:      0 (4 in the table", "oldest row:      -\n", "purge eligible:  - (give --retention)\n", "last applied:    none\n"} {
		want(t, r, exitOK, line, "")
	}
}

func TestStatusJSON(t *testing.T) {
	t.Parallel()
	_, args := statusFixture(t)
	r := idemq(t, append([]string{"status", "--json", "--consumer", "billing", "--retention", "5d"}, args...)...)
	want(t, r, exitOK, "", "")
	var got statusReport
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	if got.Consumer != "billing" || got.Rows != 3 || got.TableRows != 4 || !strings.HasSuffix(got.Table, ".processed_messages") {
		t.Errorf("report %+v", got)
	}
	if got.OldestAgeSeconds == nil || math.Abs(*got.OldestAgeSeconds-10*86400) > 60 {
		t.Errorf("oldest age %v, want about 10 days", got.OldestAgeSeconds)
	}
	if got.RetentionSeconds == nil || *got.RetentionSeconds != 5*86400 || got.PurgeEligible == nil || *got.PurgeEligible != 1 ||
		got.PurgeEligibleTable == nil || *got.PurgeEligibleTable != 2 {
		t.Errorf("purge: retention %v, eligible %v of %v; want 432000s, 1 of 2", got.RetentionSeconds, got.PurgeEligible, got.PurgeEligibleTable)
	}
	l := got.LastApplied
	if l == nil || l.MessageID != "m-3" || l.Source != "payments" || l.Partition == nil || *l.Partition != 2 ||
		l.Offset == nil || *l.Offset != 7 || l.AgeSeconds < 0 || l.AgeSeconds > 60 {
		t.Errorf("last applied %+v", l)
	}
	if got.DLQ == nil || len(got.DLQ) != 0 {
		t.Errorf("dlq %v, want []", got.DLQ)
	}

	// Nulls, not zeros, where there is nothing to report.
	r = idemq(t, append([]string{"status", "--json", "--consumer", "nobody"}, args...)...)
	for _, s := range []string{`"oldest_processed_at": null`, `"last_applied": null`, `"purge_eligible": null`, `"rows": 0`} {
		want(t, r, exitOK, s, "")
	}
}

func TestStatusRabbitMQDepth(t *testing.T) {
	t.Parallel()
	_, args := migrated(t)
	dead := statusQueue(t)
	pub, err := rabbitmq.NewPublisher(context.Background(), rabbitmq.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	for i := range 3 {
		if err := pub.Publish(context.Background(), "", dead, &consumer.Message{ID: fmt.Sprint(i), Body: []byte("x")}); err != nil {
			t.Fatal(err)
		}
	}
	base := append([]string{"status", "--consumer", "billing", "--amqp-url", rabbitmq.DefaultURL}, args...)
	r := idemq(t, append(base, "--dlq-queue", dead)...)
	want(t, r, exitOK, "dlq rabbitmq:    "+dead+": 3 ready messages; by class: no envelope: 3\n", "")
	// Reading the depth consumed nothing.
	if n := statusDepth(t, dead); n != 3 {
		t.Errorf("depth after status: %d, want 3", n)
	}

	r = idemq(t, append(base, "--dlq-queue", dead, "--json")...)
	var got statusReport
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	if len(got.DLQ) != 1 || got.DLQ[0].Broker != "rabbitmq" || got.DLQ[0].Name != dead || got.DLQ[0].Depth == nil || *got.DLQ[0].Depth != 3 {
		t.Errorf("dlq %+v", got.DLQ)
	}

	// A missing queue: the rest is printed, and the command fails.
	r = idemq(t, append(base, "--dlq-queue", dead+".missing")...)
	want(t, r, exitFail, "dedup rows:", "cannot read the dead-letter queue depth")
	want(t, r, exitFail, "dlq rabbitmq:    "+dead+".missing: error: ", "NOT_FOUND")
}

func TestStatusRabbitMQPasswordNeverPrinted(t *testing.T) {
	t.Parallel()
	_, args := migrated(t)
	const password = "status-s3cret-pw"
	url := "amqp://guest:" + password + "@127.0.0.1:5672/"
	r := idemq(t, append([]string{"status", "--consumer", "billing", "--dlq-queue", "q", "--amqp-url", url}, args...)...)
	if strings.Contains(r.stdout+r.stderr, password) {
		t.Errorf("the password was printed:\nstdout: %s\nstderr: %s", r.stdout, r.stderr)
	}
	want(t, r, exitFail, "dlq rabbitmq:", "amqp://guest:xxxxx@127.0.0.1:5672/")
}

func TestStatusKafkaDepth(t *testing.T) {
	t.Parallel()
	_, args := migrated(t)
	c := kafkatest.Start(t)
	topic := kafkatest.Name(t, "dlq")
	c.CreateTopic(t, topic, 3)
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: c.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	var msgs []*consumer.Message
	for i := range 7 {
		msgs = append(msgs, &consumer.Message{ID: fmt.Sprint(i), Key: fmt.Sprintf("k%d", i), Body: []byte("x")})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := pub.Publish(ctx, topic, msgs...); err != nil {
		t.Fatal(err)
	}
	base := append([]string{"status", "--consumer", "billing", "--kafka-brokers", strings.Join(c.Addrs(), ",")}, args...)
	r := idemq(t, append(base, "--dlq-topic", topic)...)
	want(t, r, exitOK, "dlq kafka:       "+topic+": 7 records in 3 partitions; by class: no envelope: 7\n", "")

	r = idemq(t, append(base, "--dlq-topic", topic, "--json")...)
	var got statusReport
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	if len(got.DLQ) != 1 || got.DLQ[0].Broker != "kafka" || got.DLQ[0].Depth == nil || *got.DLQ[0].Depth != 7 || got.DLQ[0].Partitions != 3 {
		t.Errorf("dlq %+v", got.DLQ)
	}

	r = idemq(t, append(base, "--dlq-topic", topic+"-missing")...)
	want(t, r, exitFail, "dlq kafka:       "+topic+"-missing: error: ", "cannot read the dead-letter queue depth")
}

func TestStatusUsage(t *testing.T) {
	t.Parallel()
	_, args := dbArgs(t)
	want(t, idemq(t, append([]string{"status"}, args...)...), exitUsage, "", "--consumer is required")
	want(t, idemq(t, append([]string{"status", "--consumer", "c", "--retention", "-1h"}, args...)...), exitUsage, "", "--retention must be positive")
	r := runEnv(context.Background(), append([]string{"status", "--consumer", "c", "--dlq-topic", "t"}, args...),
		&env{stdout: &strings.Builder{}, stderr: &strings.Builder{}, getenv: func(string) string { return "" }})
	if r != exitUsage {
		t.Errorf("--dlq-topic without brokers: exit %d, want %d", r, exitUsage)
	}
	want(t, idemq(t, "status", "--help"), exitOK, "idemq status --consumer <name>", "")
	// Not migrated: the hint names the fix.
	want(t, idemq(t, append([]string{"status", "--consumer", "c"}, args...)...), exitFail, "", "idemq migrate")
}

// statusQueue declares a fresh durable queue, deleted at cleanup.
func statusQueue(t *testing.T) string {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	q := "idemq-status-test-" + hex.EncodeToString(b[:])
	statusAMQP(t, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		return err
	})
	t.Cleanup(func() {
		statusAMQP(t, func(ch *amqp.Channel) error {
			_, err := ch.QueueDelete(q, false, false, false)
			return err
		})
	})
	return q
}

// statusDepth reads a queue's ready messages with a passive declare.
func statusDepth(t *testing.T, q string) (n int) {
	t.Helper()
	statusAMQP(t, func(ch *amqp.Channel) error {
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		n = st.Messages
		return err
	})
	return n
}

func statusAMQP(t *testing.T, f func(*amqp.Channel) error) {
	t.Helper()
	conn, err := amqp.Dial(rabbitmq.DefaultURL)
	if err != nil {
		t.Fatalf("RabbitMQ at %s: %v", rabbitmq.DefaultURL, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := f(ch); err != nil {
		t.Fatal(err)
	}
}

// TestStatusGenerations: on the partitioned layout, status lists the three
// generations, current first, with when each began and ended and the
// planner's estimate of its rows, and the consumers that hold the oldest;
// the JSON form has them too. On a plain table it says so, and the JSON
// form has no generations.
func TestStatusGenerations(t *testing.T) {
	t.Parallel()
	s, args := statusFixture(t)
	r := idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...)
	want(t, r, exitOK, "layout:          plain table (a purge deletes each consumer's old rows in batches)\n", "")
	if strings.Contains(r.stdout, "generation") {
		t.Errorf("generations on a plain table:\n%s", r.stdout)
	}
	r = idemq(t, append([]string{"status", "--consumer", "billing", "--json"}, args...)...)
	want(t, r, exitOK, `"partitioned": false`, "")
	if strings.Contains(r.stdout, `"generations"`) {
		t.Errorf("generations in the JSON of a plain table:\n%s", r.stdout)
	}

	// Convert: the four rows become g1. billing's purge makes a fresh
	// generation current and the plain table's rows the oldest, which
	// shipping (no horizon) holds.
	want(t, idemq(t, append([]string{"migrate", "--partitioned"}, args...)...), exitOK, "converted to the partitioned layout", "")
	r = idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...)
	for _, line := range []string{
		"generation 0:    processed_messages_g0: current since ",
		"generation 1:    processed_messages_g1: from before the layout began to ",
		"generation 2:    processed_messages_g2: ended before the layout began, ",
	} {
		want(t, r, exitOK, line, "")
	}
	time.Sleep(20 * time.Millisecond)
	want(t, idemq(t, append([]string{"processed", "purge", "--consumer", "billing", "--older-than", "1ms"}, args...)...), exitOK, `is held by "shipping"`, "")
	oldest := pgx.Identifier{s.Schema(), s.Table() + "_g2"}.Sanitize()
	if _, err := testdb.Pool(t).Exec(context.Background(), "ANALYZE "+oldest); err != nil {
		t.Fatal(err)
	}

	r = idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...)
	for _, line := range []string{
		"layout:          partitioned: 3 generations, current first; the oldest is retired once every consumer with rows in it has purged past its end\n",
		"generation 0:    processed_messages_g0: current since ",
		"generation 1:    processed_messages_g1: from ",
		"generation 2:    processed_messages_g2: from before the layout began to ",
		" ago), about 4 rows\n",
		"held by:         \"shipping\" (their purge horizons are not past its end)\n",
		// The view still answers the queries status runs on the table.
		"dedup rows:      3 (4 in the table, all consumers)\n",
		"last applied:    m-3 at ",
	} {
		want(t, r, exitOK, line, "")
	}
	if strings.Contains(r.stdout, "plain table") {
		t.Errorf("a partitioned table reported as plain:\n%s", r.stdout)
	}

	r = idemq(t, append([]string{"status", "--consumer", "billing", "--json"}, args...)...)
	var got statusReport
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	g := got.Generations
	if !got.Partitioned || len(g) != 3 {
		t.Fatalf("partitioned %v, %d generations; want true, 3:\n%s", got.Partitioned, len(g), r.stdout)
	}
	for i, name := range []string{"processed_messages_g0", "processed_messages_g1", "processed_messages_g2"} {
		if g[i].Table != name {
			t.Errorf("generation %d is %s, want %s", i, g[i].Table, name)
		}
	}
	switch {
	case !g[0].Current || g[1].Current || g[2].Current:
		t.Errorf("current: %v, %v, %v; want only the first", g[0].Current, g[1].Current, g[2].Current)
	case g[0].BeganAt == nil || g[0].EndedAt != nil:
		t.Errorf("current generation began %v, ended %v; want a time and null", g[0].BeganAt, g[0].EndedAt)
	case g[1].BeganAt == nil || g[1].EndedAt == nil || !g[1].EndedAt.Equal(*g[0].BeganAt):
		t.Errorf("generation 1 began %v, ended %v; want times, the end when generation 0 began (%v)", g[1].BeganAt, g[1].EndedAt, g[0].BeganAt)
	case g[2].BeganAt != nil || g[2].EndedAt == nil || !g[2].EndedAt.Equal(*g[1].BeganAt):
		t.Errorf("oldest generation began %v, ended %v; want null (before the layout) and when generation 1 began", g[2].BeganAt, g[2].EndedAt)
	case g[2].EstimatedRows == nil || *g[2].EstimatedRows != 4:
		t.Errorf("oldest generation's estimated rows %v, want 4", g[2].EstimatedRows)
	case len(g[2].HeldBy) != 1 || g[2].HeldBy[0] != "shipping" || g[0].HeldBy != nil:
		t.Errorf("held by %v (oldest), %v (current); want [shipping] and none", g[2].HeldBy, g[0].HeldBy)
	}
	for _, s := range []string{`"began_at": null`, `"ended_at": null`, `"estimated_rows": 4`, `"held_by": [`} {
		want(t, r, exitOK, s, "")
	}

	// Once shipping purges too, the oldest is retired and nobody holds it.
	time.Sleep(20 * time.Millisecond)
	want(t, idemq(t, append([]string{"processed", "purge", "--consumer", "shipping", "--older-than", "1ms"}, args...)...), exitOK, "retired about 4 records", "")
	r = idemq(t, append([]string{"status", "--consumer", "billing"}, args...)...)
	want(t, r, exitOK, "dedup rows:      0 (0 in the table, all consumers)\n", "")
	if strings.Contains(r.stdout, "held by") {
		t.Errorf("held after every consumer purged:\n%s", r.stdout)
	}
}
