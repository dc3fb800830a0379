package redisstream_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// A consumer that applies each payment once, whatever the stream redelivers.
// Failed payments go to payments.dlq before their entries are acked.
func ExampleNewSource() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	store, err := processed.Open(ctx, "postgres://postgres@127.0.0.1:5432/app", processed.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}

	// The server must run with appendonly yes and appendfsync always;
	// RequireAOF refuses one that does not. The window and the logger
	// come from the runtime's Config.
	src, err := redisstream.NewSource(ctx, redisstream.Config{
		URL:        "redis://127.0.0.1:6379/0",
		Stream:     "payments",
		Group:      "ledger",
		RequireAOF: true,
	})
	if err != nil {
		log.Fatal(err)
	}

	rt, err := consumer.New(consumer.Config{
		Name:   "ledger",
		Source: src,
		Store:  store,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO payments (id, body) VALUES ($1, $2)", m.ID, m.Body)
			return err
		},
		Logger: slog.Default(),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := rt.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

// Inspecting a dead-letter stream without consuming it.
func ExampleNewBrowser() {
	ctx := context.Background()
	b, err := redisstream.NewBrowser(ctx, redisstream.BrowserConfig{Stream: redisstream.DLQName("payments")})
	if err != nil {
		log.Fatal(err)
	}
	rep, err := dlq.Inspect(ctx, b, dlq.Filter{Consumer: "ledger"}, 0)
	if err != nil {
		log.Fatal(err)
	}
	for _, g := range rep.Groups {
		fmt.Printf("%d × %s: %s\n", g.Count, g.Class, g.Error)
	}
}

// Publishing with an idempotency key, so that a producer's retry is
// deduplicated too.
func ExamplePublisher_Publish() {
	ctx := context.Background()
	pub, err := redisstream.NewPublisher(ctx, redisstream.PublisherConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	ids, err := pub.Publish(ctx, "payments", &consumer.Message{ID: "pay-1", Body: []byte(`{"amount_cents":100}`)})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("entry", ids[0])
}
