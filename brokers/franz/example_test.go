package franz_test

import (
	"context"
	"log"
	"log/slog"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// A consumer of a topic written by transactional producers (Kafka Streams,
// Flink, Spring with transactions): only committed records are applied, each
// once, and transaction markers never reach the handler.
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

	// Failed payments go to payments.dlq, produced on src's own client;
	// src owns the dead-letterer. The logger and the in-flight window come
	// from the runtime's Config.
	src, err := franz.NewSource(franz.Config{
		Brokers: []string{"127.0.0.1:9092"},
		Topic:   "payments",
		Group:   "ledger",
	})
	if err != nil {
		log.Fatal(err)
	}
	rt, err := consumer.New(consumer.Config{
		Name:   "ledger",
		Source: src,
		Store:  store,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO ledger (id, body) VALUES ($1, $2)", m.ID, m.Body)
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
// name than the default <topic>.dlq. It produces with acks=all on the
// Source's franz-go client and is closed with the Source.
func ExampleSource_DeadLetterer() {
	key, err := dlq.ReadKeyFile("/etc/idemq/dlq.key")
	if err != nil {
		log.Fatal(err)
	}
	src, err := franz.NewSource(franz.Config{
		Brokers: []string{"127.0.0.1:9092"},
		Topic:   "payments",
		Group:   "ledger",
		DeadLetter: franz.DeadLetterConfig{
			Topic:   "payments.failed", // empty: "payments.dlq"
			Options: dlq.Options{SigningKey: key},
		},
	})
	if err != nil {
		log.Fatal(err) // a *consumer.ConfigError for an illegal DeadLetter too
	}
	defer src.Close()                // the runtime closes it too: Close is idempotent
	_ = consumer.Config{Source: src} // and the rest: the runtime dead-letters through src.DeadLetterer()
}
