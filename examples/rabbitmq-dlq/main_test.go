package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// TestLeavesDeadLetters runs the example on its own schema and queue (never
// the tour's idemq_quickstart and payments): five payments are applied and
// seven dead letters stay in the queue's DLQ.
func TestLeavesDeadLetters(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	t.Setenv("DATABASE_URL", testdb.URL())
	if _, err := pool.Exec(ctx, `CREATE TABLE `+schema+`.accounts (id text PRIMARY KEY, balance_cents bigint NOT NULL DEFAULT 0);
		INSERT INTO `+schema+`.accounts SELECT 'acct-0' || i, 0 FROM generate_series(1, 5) i`); err != nil {
		t.Fatal(err)
	}
	// The quickstart applied pay-00010 and pay-00011 with other payloads.
	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	m := &consumer.Message{Body: []byte("the quickstart's payload")}
	var claims []dedup.Claim
	for _, id := range []string{"pay-00010", "pay-00011"} {
		claims = append(claims, dedup.Claim{Consumer: consumerName, MessageID: id, Fingerprint: m.Fingerprint(), Partition: -1, Offset: -1})
	}
	tx, _, err := store.BeginClaim(ctx, claims)
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		t.Fatal(err)
	}

	var b [4]byte
	_, _ = rand.Read(b[:])
	queue := "idemq-test.rabbitmq-dlq." + hex.EncodeToString(b[:])
	var out bytes.Buffer
	if err := run(ctx, []string{"-schema", schema, "-queue", queue}, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	defer func() { _ = run(ctx, []string{"-queue", queue, "-delete"}, &out) }()
	if !strings.Contains(out.String(), "applied 5, dead-lettered 7") {
		t.Fatalf("output:\n%s", out.String())
	}
	conn, err := amqp.Dial(rabbitmq.DefaultURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclarePassive(rabbitmq.DLQName(queue), true, false, false, false, nil)
	if err != nil || q.Messages != 7 {
		t.Fatalf("DLQ %s: %d messages, %v; want 7", rabbitmq.DLQName(queue), q.Messages, err)
	}
	var sum int64
	if err := pool.QueryRow(ctx, `SELECT sum(balance_cents) FROM `+schema+`.accounts`).Scan(&sum); err != nil || sum != 5000 {
		t.Fatalf("balances sum to %d (%v), want 5000: each good payment applied once", sum, err)
	}
}
