package outbox_test

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/keys"
	"github.com/idemq/idemq/outbox"
)

// Example enqueues an event in the same transaction as the business change,
// then relays it. The event id is derived from the order id, so a retried
// order produces the same event id and consumers downstream dedupe it.
func Example() {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	_, _ = pool.Exec(ctx, `DROP SCHEMA IF EXISTS idemq_outbox_example CASCADE`)
	defer pool.Exec(ctx, `DROP SCHEMA IF EXISTS idemq_outbox_example CASCADE`)

	ob, err := outbox.New(pool, outbox.Config{Schema: "idemq_outbox_example"})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := ob.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	_, _ = pool.Exec(ctx, `CREATE TABLE idemq_outbox_example.orders (id text PRIMARY KEY)`)

	orderID := "order-7"
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO idemq_outbox_example.orders VALUES ($1)`, orderID); err != nil {
			return err
		}
		return ob.Enqueue(ctx, tx, outbox.Message{
			Destination: "orders.placed",
			ID:          keys.ChildKey(orderID, "order-placed-event/v1"),
			Body:        []byte(`{"order":"order-7"}`),
		})
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	broker := memory.NewBroker() // or a RabbitMQ or Kafka publisher
	relay, err := outbox.NewRelay(ob, outbox.RelayConfig{
		Publish: func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
			return broker.Publish(ctx, dest, msgs...)
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	n, err := relay.RelayOnce(ctx) // Run(ctx) loops until ctx is done
	fmt.Println("relayed", n, err)
	m := broker.Messages("orders.placed")[0]
	fmt.Println(m.ID == keys.ChildKey("order-7", "order-placed-event/v1"), string(m.Body))
	st, _ := ob.Stats(ctx)
	fmt.Printf("pending=%d sent=%d\n", st.Pending, st.Sent)
	// Output:
	// relayed 1 <nil>
	// true {"order":"order-7"}
	// pending=0 sent=1
}
