package rabbitmq_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// A payment consumer: each payment message is applied exactly once, however
// often RabbitMQ delivers it.
func ExampleNewSource() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	if err := rabbitmq.DeclareTopology(ctx, rabbitmq.DefaultURL, rabbitmq.Topology{Queue: "payments"}); err != nil {
		log.Fatal(err)
	}
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{Queue: "payments"})
	if err != nil {
		log.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/test")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := processed.New(pool, processed.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	// Failed payments go to payments.dlq, the topology's dead-letter
	// queue, on src's own connection; src owns the dead-letterer.
	deadLetterer, err := src.DeadLetterer(ctx, rabbitmq.DeadLetterConfig{})
	if err != nil {
		log.Fatal(err)
	}

	rt, err := consumer.New(consumer.Config{
		Name:   "payments",
		Source: src,
		Store:  store,
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + $1 WHERE id = $2",
				string(msg.Body), msg.Header("account"))
			return err
		},
		DeadLetterer: deadLetterer,
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := rt.Run(ctx); err != nil { // closes src, and with it deadLetterer, when it returns
		log.Fatal(err)
	}
}

// A dead-letterer with signed envelopes, to a dead-letter queue the
// topology named itself. It publishes on the Source's connection, with
// publisher confirms, and is closed with the Source.
func ExampleSource_DeadLetterer() {
	ctx := context.Background()
	topo := rabbitmq.Topology{Queue: "orders", DeadLetterQueue: "orders.failed"}
	if err := rabbitmq.DeclareTopology(ctx, rabbitmq.DefaultURL, topo); err != nil {
		log.Fatal(err)
	}
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{Queue: "orders"})
	if err != nil {
		log.Fatal(err)
	}
	defer src.Close() // the runtime closes it too: Close is idempotent
	key, err := dlq.ReadKeyFile("/etc/idemq/dlq.key")
	if err != nil {
		log.Fatal(err)
	}
	dl, err := src.DeadLetterer(ctx, rabbitmq.DeadLetterConfig{
		Queue:   topo.DeadLetterQueue, // empty: rabbitmq.DLQName("orders"), "orders.dlq"
		Options: dlq.Options{SigningKey: key},
	})
	if err != nil {
		log.Fatal(err)
	}
	_ = consumer.Config{Source: src, DeadLetterer: dl} // and the rest
}

func ExamplePublisher_Publish() {
	ctx := context.Background()
	pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	// Returns once the broker has persisted the message; an unroutable
	// message is an error wrapping rabbitmq.ErrUnroutable.
	err = pub.Publish(ctx, "", "payments", &consumer.Message{
		ID:      "payment-42",
		Body:    []byte("100"),
		Headers: map[string]string{"account": "acct-7"},
	})
	fmt.Println(err)
}

// A dry run of a dead-letter queue replay: the Browser reads the DLQ as it
// is now, and dlq.Classify says, for each message, whether a replay would
// apply it or skip it as already applied. Nothing is consumed: closing the
// browser gives every message back. dlq.Replay takes the same Browser.
func ExampleNewBrowser() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/test")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := processed.New(pool, processed.Config{}) // the live consumer's dedup store
	if err != nil {
		log.Fatal(err)
	}
	b, err := rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{Queue: "payments.dlq"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("dead letters:", b.Depth())
	c, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: b, Store: store}) // closes b
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("already applied:", c.AlreadyApplied, "will apply:", c.WillApply)
}
