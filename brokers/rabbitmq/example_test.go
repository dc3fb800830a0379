package rabbitmq_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// A payment consumer: each payment message is applied exactly once, however
// often RabbitMQ delivers it, and a payment that fails for good goes to the
// dead-letter queue. Three constructors: the dedup store, the Source (which
// declares the topology and owns the dead-letterer) and the runtime, which
// alone says the concurrency and the logger.
func ExampleNewSource() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	store, err := processed.Open(ctx, "postgres://postgres@127.0.0.1:5432/test", processed.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	// Declares payments, payments.dlx and payments.dlq, and checks them.
	// Nothing is consumed until the runtime's first Receive, with a
	// prefetch sized from its Concurrency.
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{
		Queue:    "payments",
		Topology: &rabbitmq.Topology{},
	})
	if err != nil {
		log.Fatal(err)
	}

	rt, err := consumer.New(consumer.Config{
		Name:        "payments",
		Source:      src,
		Store:       store,
		Concurrency: 16, // the Source's prefetch becomes 32
		Logger:      slog.Default(),
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + $1 WHERE id = $2",
				string(msg.Body), msg.Header("account"))
			return err
		},
		// Failed payments go to payments.dlq on src's own connection;
		// src owns the dead-letterer.
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := rt.Run(ctx); err != nil { // closes src, and with it its dead-letterer, when it returns
		log.Fatal(err)
	}
}

// A dead-letterer with signed envelopes, to a dead-letter queue the
// topology names itself: the Source dead-letters to it without its being
// restated. It publishes on the Source's connection, with publisher
// confirms, and is closed with the Source.
func ExampleSource_DeadLetterer() {
	ctx := context.Background()
	key, err := dlq.ReadKeyFile("/etc/idemq/dlq.key")
	if err != nil {
		log.Fatal(err)
	}
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{
		Queue:      "orders",
		Topology:   &rabbitmq.Topology{DeadLetterQueue: "orders.failed"},
		DeadLetter: rabbitmq.DeadLetterConfig{Options: dlq.Options{SigningKey: key}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer src.Close()                                                  // the runtime closes it too: Close is idempotent
	_ = consumer.Config{Source: src, DeadLetterer: src.DeadLetterer()} // and the rest
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
	store, err := processed.Open(ctx, "postgres://postgres@127.0.0.1:5432/test", processed.Config{}) // the live consumer's dedup store
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
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
