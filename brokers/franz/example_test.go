package franz_test

import (
	"context"
	"log"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

// A consumer of a topic written by transactional producers (Kafka Streams,
// Flink, Spring with transactions): only committed records are applied, each
// once, and transaction markers never reach the handler.
func ExampleNewSource() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/app")
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
		Source: src, // the runtime closes it
		DB:     pool,
		Store:  store,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO ledger (id, body) VALUES ($1, $2)", m.ID, m.Body)
			return err
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := rt.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
