package kafka_test

import (
	"context"
	"log"
	"log/slog"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// A consumer that applies each order once, whatever Kafka redelivers. Failed
// messages go to a dead-letter topic before their offsets are committed.
func ExampleNewSource() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	// The store is the consumer's one Postgres handle; it owns its pool.
	store, err := processed.Open(ctx, "postgres://postgres@127.0.0.1:5432/app", processed.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}

	// Failed orders go to orders.dlq, through src's own transport; src
	// owns the dead-letterer. The logger and the in-flight window come
	// from the runtime's Config.
	src, err := kafka.NewSource(kafka.Config{
		Brokers: []string{"127.0.0.1:9092"},
		Topic:   "orders",
		GroupID: "order-service",
	})
	if err != nil {
		log.Fatal(err)
	}

	rt, err := consumer.New(consumer.Config{
		Name:   "order-service",
		Source: src,
		Store:  store,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO orders (id, body) VALUES ($1, $2)", m.ID, m.Body)
			return err
		},
		Logger: slog.Default(), // src logs here too, with its topic and group
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := rt.Run(ctx); err != nil { // closes src, and with it its dead-letterer, when it returns
		log.Fatal(err)
	}
}

// A dead-letterer with signed envelopes, to a dead-letter topic of another
// name than the default <topic>.dlq. It writes with acks=all on the
// Source's transport and is closed with the Source.
func ExampleSource_DeadLetterer() {
	key, err := dlq.ReadKeyFile("/etc/idemq/dlq.key")
	if err != nil {
		log.Fatal(err)
	}
	src, err := kafka.NewSource(kafka.Config{
		Brokers: []string{"127.0.0.1:9092"},
		Topic:   "orders",
		GroupID: "order-service",
		DeadLetter: kafka.DeadLetterConfig{
			Topic:   "orders.failed", // empty: kafka.DLQName("orders"), "orders.dlq"
			Options: dlq.Options{SigningKey: key},
		},
	})
	if err != nil {
		log.Fatal(err) // a *consumer.ConfigError for an illegal DeadLetter too
	}
	defer src.Close()                                                  // the runtime closes it too: Close is idempotent
	_ = consumer.Config{Source: src, DeadLetterer: src.DeadLetterer()} // and the rest
}

// Publishing with an idempotency key: the consumer applies the order once
// even if this publish is retried.
func ExamplePublisher_Publish() {
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: []string{"127.0.0.1:9092"}})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	err = pub.Publish(context.Background(), "orders", &consumer.Message{
		ID:        "order-1042",          // written to the "idempotency-key" header
		RecordKey: []byte("customer-17"), // orders of one customer stay in one partition
		Body:      []byte(`{"id":1042,"total":"9.90"}`),
	})
	if err != nil {
		log.Fatal(err)
	}
}
