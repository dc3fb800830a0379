package consumer_test

import (
	"context"
	"fmt"
	"log"
	"net/url"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// Payment is the body of a payment message.
type Payment struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
}

// credit applies one payment. It runs in the transaction that claims the
// message id, so the credit and the claim commit together or not at all.
func credit(ctx context.Context, tx pgx.Tx, msg *consumer.Message, p Payment) error {
	_, err := tx.Exec(ctx, `INSERT INTO ledger (payment_id, account, cents) VALUES ($1, $2, $3)`, msg.ID, p.Account, p.Cents)
	return err
}

// A RabbitMQ consumer with its dead-letter queue in three constructor calls:
// the Postgres handle, the Source (which declares the queue, its dead-letter
// exchange and queue, and owns the dead-letterer), and the runtime, which
// alone says the concurrency and the logger. The payment sent twice is
// applied once; the one that is not JSON is dead-lettered with the reason.
func Example_rabbitMQ() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	databaseURL, amqpURL, queue, cleanup := exampleEnv(ctx) // a fresh schema and queue
	defer cleanup()

	store, err := processed.Open(ctx, databaseURL, processed.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL, Queue: queue, Topology: &rabbitmq.Topology{}})
	if err != nil {
		log.Fatal(err)
	}
	rt, err := consumer.New(consumer.Config{
		Name:    "ledger",
		Store:   store,
		Source:  src,
		Handler: consumer.JSON(credit),
	})
	if err != nil {
		log.Fatal(err)
	}

	publishExamplePayments(ctx, amqpURL, queue)
	runCtx, stop := context.WithCancel(ctx)
	go func() { // stop once the four deliveries are settled
		for s := rt.Stats(); s.Applied+s.Duplicates+s.DeadLettered < 4; s = rt.Stats() {
			time.Sleep(10 * time.Millisecond)
		}
		stop()
	}()
	if err := rt.Run(runCtx); err != nil {
		log.Fatal(err)
	}
	s := rt.Stats()
	fmt.Printf("applied %d, duplicates %d, dead-lettered %d\n", s.Applied, s.Duplicates, s.DeadLettered)
	var rows int
	if err := store.Pool().QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&rows); err != nil {
		log.Fatal(err)
	}
	fmt.Println("ledger rows:", rows)
	fmt.Println("dead-letter queue depth:", exampleDepth(ctx, amqpURL, rabbitmq.DLQName(queue)))
	// Output:
	// applied 2, duplicates 1, dead-lettered 1
	// ledger rows: 2
	// dead-letter queue depth: 1
}

// exampleEnv makes a fresh schema holding the ledger table and a fresh queue
// name, and returns a database URL whose search_path is that schema, and a
// func that drops both.
func exampleEnv(ctx context.Context) (databaseURL, amqpURL, queue string, cleanup func()) {
	schema := fmt.Sprintf("idemq_example_%d", time.Now().UnixNano())
	admin, err := processed.Open(ctx, testdb.URL(), processed.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := admin.Pool().Exec(ctx, `CREATE SCHEMA `+schema+`;
CREATE TABLE `+schema+`.ledger (payment_id text PRIMARY KEY, account text NOT NULL, cents bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	u, err := url.Parse(testdb.URL())
	if err != nil {
		log.Fatal(err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	amqpURL = os.Getenv("IDEMQ_TEST_AMQP_URL")
	if amqpURL == "" {
		amqpURL = rabbitmq.DefaultURL
	}
	queue = "idemq-example." + schema
	return u.String(), amqpURL, queue, func() {
		_, _ = admin.Pool().Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`)
		admin.Close()
		if conn, err := amqp.Dial(amqpURL); err == nil {
			if ch, err := conn.Channel(); err == nil {
				_, _ = ch.QueueDelete(queue, false, false, false)
				_, _ = ch.QueueDelete(rabbitmq.DLQName(queue), false, false, false)
				_ = ch.ExchangeDelete(queue+".dlx", false, false)
			}
			_ = conn.Close()
		}
	}
}

// publishExamplePayments publishes two payments, one of them twice, and a
// body that is not JSON.
func publishExamplePayments(ctx context.Context, amqpURL, queue string) {
	pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: amqpURL})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	err = pub.Publish(ctx, "", queue,
		&consumer.Message{ID: "pay-1", Body: []byte(`{"account":"acct-1","cents":1000}`)},
		&consumer.Message{ID: "pay-2", Body: []byte(`{"account":"acct-2","cents":250}`)},
		&consumer.Message{ID: "pay-1", Body: []byte(`{"account":"acct-1","cents":1000}`)},
		&consumer.Message{ID: "pay-3", Body: []byte(`not json`)},
	)
	if err != nil {
		log.Fatal(err)
	}
}

// exampleDepth returns the number of messages ready in queue.
func exampleDepth(ctx context.Context, amqpURL, queue string) int {
	b, err := rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{URL: amqpURL, Queue: queue})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	return b.Depth()
}
