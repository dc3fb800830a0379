package natsjs_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// A payment consumer on JetStream: each payment is applied exactly once,
// however often JetStream delivers it, and a payment that fails for good
// goes to the dead-letter stream. Three constructors: the dedup store, the
// Source (which declares the streams and owns the dead-letterer) and the
// runtime, which alone says the concurrency and the logger.
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
	// Declares the stream PAYMENTS on "payments" and PAYMENTS_DLQ on
	// "payments.dlq" if they are missing. The durable consumer "ledger"
	// is created at the runtime's first Receive, with a MaxAckPending
	// sized from its Concurrency.
	src, err := natsjs.NewSource(ctx, natsjs.Config{
		Stream:   "PAYMENTS",
		Subject:  "payments",
		Durable:  "ledger",
		Topology: &natsjs.Topology{},
	})
	if err != nil {
		log.Fatal(err)
	}

	rt, err := consumer.New(consumer.Config{
		Name:        "ledger",
		Source:      src,
		Store:       store,
		Concurrency: 16, // MaxAckPending becomes 32
		Logger:      slog.Default(),
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + $1 WHERE id = $2",
				string(msg.Body), msg.Header("account"))
			return err
		},
		// Failed payments go to payments.dlq on src's own connection.
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := rt.Run(ctx); err != nil { // closes src when it returns
		log.Fatal(err)
	}
}

// Publishing: Message.ID becomes Nats-Msg-Id, and Publish returns once the
// stream stored every message.
func ExamplePublisher_Publish() {
	ctx := context.Background()
	pub, err := natsjs.NewPublisher(ctx, natsjs.PublisherConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	err = pub.Publish(ctx, "payments", &consumer.Message{
		ID:      "pay-1",
		Body:    []byte("100"),
		Headers: map[string]string{"account": "acct-1"},
	})
	if err != nil {
		log.Fatal(err)
	}
}

// Reading the dead letters without consuming them.
func ExampleNewBrowser() {
	ctx := context.Background()
	b, err := natsjs.NewBrowser(ctx, natsjs.BrowserConfig{Subject: "payments.dlq"})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	for {
		d, err := b.Next(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			log.Fatal(err)
		}
		r, err := dlq.Parse(d.Message())
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(r.MessageID, r.Class, r.Error)
	}
}
