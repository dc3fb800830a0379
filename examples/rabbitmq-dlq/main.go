// Command rabbitmq-dlq leaves a RabbitMQ dead-letter queue behind for the
// README's tour of the idemq CLI (idemq status --dlq-queue, idemq dlq
// inspect and idemq dlq replay).
//
// Run it after the quickstart: it works in the quickstart's schema
// (idemq_quickstart) as the same consumer, ledger. It declares the work
// queue payments with its dead-letter exchange and queue, payments.dlq
// (deleting them first if they exist), publishes a few good payments and a
// few bad ones (unknown accounts, missing ids, two quickstart payment ids
// re-sent with other amounts), and consumes them with idemq on RabbitMQ. The
// good ones are applied; the bad ones are dead-lettered to payments.dlq,
// which it leaves in place. -delete removes the queues and the exchange.
//
//	go run ./examples/quickstart
//	go run ./examples/rabbitmq-dlq
//
// The broker comes from AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/)
// and Postgres from DATABASE_URL (default the local server). Its errors
// never show a password.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultQueue       = "payments"
	consumerName       = "ledger"
)

// Payment is the message body, as in the quickstart.
type Payment struct {
	PaymentID   string `json:"payment_id"`
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "rabbitmq-dlq:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	amqpURL := os.Getenv("AMQP_URL")
	if amqpURL == "" {
		amqpURL = rabbitmq.DefaultURL
	}
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultDatabaseURL
	}
	fs := flag.NewFlagSet("rabbitmq-dlq", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "Usage: go run ./examples/rabbitmq-dlq [flags]\n\nAfter the quickstart, publishes 12 payments to a RabbitMQ queue and consumes\nthem as the quickstart's consumer, leaving its dead letters in <queue>.dlq\nfor the CLI tour ($DATABASE_URL, $AMQP_URL).\n\nFlags:\n")
		fs.PrintDefaults()
	}
	schema := fs.String("schema", "idemq_quickstart", "Postgres `schema` of the quickstart's tables")
	queueFlag := fs.String("queue", defaultQueue, "the work `queue`; its dead letters go to <queue>.dlq")
	del := fs.Bool("delete", false, "delete the work queue, its DLQ and its dead-letter exchange, and exit")
	if err := fs.Parse(args); err != nil {
		return err
	}
	queue := *queueFlag

	if err := deleteTopology(amqpURL, queue); err != nil {
		return err
	}
	if *del {
		fmt.Fprintf(out, "deleted %s, %s and %s.dlx\n", queue, rabbitmq.DLQName(queue), queue)
		return nil
	}

	store, err := processed.Open(ctx, dbURL, processed.Config{Schema: *schema})
	switch {
	case errors.As(err, new(*pgconn.ParseConfigError)): // its text may quote the password
		return errors.New("invalid DATABASE_URL: check its syntax and parameters")
	case errors.As(err, new(*consumer.ConfigError)): // -schema
		return err
	case err != nil:
		return fmt.Errorf("cannot reach Postgres (start it, or set DATABASE_URL): %w", err)
	}
	defer store.Close()
	accounts := pgx.Identifier{*schema, "accounts"}.Sanitize()
	var n int
	if err := store.Pool().QueryRow(ctx, `SELECT count(*) FROM `+accounts).Scan(&n); err != nil {
		return fmt.Errorf("cannot read %s (run go run ./examples/quickstart first): %w", accounts, err)
	}

	// The Source declares the queue, its dead-letter exchange and its DLQ,
	// and consumes nothing before the runtime's first Receive: the
	// messages are published to the queue it declared.
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL, Queue: queue, Topology: &rabbitmq.Topology{}})
	if err != nil {
		return fmt.Errorf("cannot set up RabbitMQ (start it, or set AMQP_URL): %w", err)
	}
	defer func() { _ = src.Close() }() // the runtime closes it too; Close is idempotent
	pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: amqpURL})
	if err != nil {
		return err
	}
	defer pub.Close()

	var msgs []*consumer.Message
	add := func(id string, p Payment) {
		body, _ := json.Marshal(p)
		msgs = append(msgs, &consumer.Message{ID: id, Key: p.Account, Body: body, Timestamp: time.Now()})
	}
	for i := 1; i <= 5; i++ { // good payments: applied
		id := fmt.Sprintf("pay-%05d", 90000+i)
		add(id, Payment{PaymentID: id, Account: fmt.Sprintf("acct-%02d", i), AmountCents: 1000})
	}
	for i := 1; i <= 3; i++ { // an account that does not exist: permanent
		id := fmt.Sprintf("pay-%05d", 90100+i)
		add(id, Payment{PaymentID: id, Account: "acct-99", AmountCents: 500})
	}
	for i := 0; i < 2; i++ { // no id: missing-id
		add("", Payment{Account: "acct-01", AmountCents: 999})
	}
	for _, id := range []string{"pay-00010", "pay-00011"} { // applied by the quickstart with other amounts
		add(id, Payment{PaymentID: id, Account: "acct-01", AmountCents: 1})
	}
	if err := pub.Publish(ctx, "", queue, msgs...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}

	rt, err := consumer.New(consumer.Config{
		Name:        consumerName,
		Source:      src,
		Store:       store,
		Concurrency: 2,
		Handler: consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, p Payment) error {
			tag, err := tx.Exec(ctx, `UPDATE `+accounts+` SET balance_cents = balance_cents + $2 WHERE id = $1`, p.Account, p.AmountCents)
			if err != nil {
				return err
			}
			if tag.RowsAffected() == 0 {
				return consumer.Permanent(fmt.Errorf("unknown account %q", p.Account))
			}
			return nil
		}),
	})
	if err != nil {
		return err
	}
	runCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- rt.Run(runCtx) }()
	for s := rt.Stats(); s.Applied+s.Duplicates+s.DeadLettered < int64(len(msgs)) || s.InFlight > 0; s = rt.Stats() {
		select {
		case err := <-done:
			return fmt.Errorf("runtime stopped early: %v", err)
		case <-runCtx.Done():
			cancel()
			<-done
			return fmt.Errorf("not every message settled: %v", runCtx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	if err := <-done; err != nil {
		return err
	}
	s := rt.Stats()
	dups := ""
	if s.Duplicates > 0 { // a second run: the good payments are already applied
		dups = fmt.Sprintf(", skipped %d as duplicates", s.Duplicates)
	}
	fmt.Fprintf(out, "published %d messages to %s; consumer %s applied %d, dead-lettered %d%s\n",
		len(msgs), queue, consumerName, s.Applied, s.DeadLettered, dups)
	fmt.Fprintf(out, "left in RabbitMQ: %s with %d dead letters (go run ./examples/rabbitmq-dlq -delete removes it)\n",
		rabbitmq.DLQName(queue), s.DeadLettered)
	return nil
}

// deleteTopology deletes queue, its DLQ and its dead-letter exchange, if
// they exist. Its errors show rawURL without its password.
func deleteTopology(rawURL, queue string) error {
	u, err := url.Parse(rawURL)
	if err != nil { // its text quotes rawURL, password and all
		return errors.New("invalid AMQP_URL: percent-encode reserved characters in the user name and password")
	}
	conn, err := amqp.Dial(rawURL)
	if err != nil {
		return fmt.Errorf("cannot reach RabbitMQ at %s (start it, or set AMQP_URL): %w", u.Redacted(), err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	for _, q := range []string{queue, rabbitmq.DLQName(queue)} {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return fmt.Errorf("delete queue %s: %w", q, err)
		}
	}
	if err := ch.ExchangeDelete(queue+".dlx", false, false); err != nil {
		return fmt.Errorf("delete exchange %s.dlx: %w", queue, err)
	}
	return nil
}
