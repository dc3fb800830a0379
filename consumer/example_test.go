package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// Example runs a consumer over the memory broker: a redelivered message is
// skipped, and a permanent failure is dead-lettered with its reason.
func Example() {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	store, err := processed.Open(ctx, url, processed.Config{Schema: "idemq_example"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	pool := store.Pool() // for the program's own tables
	_, _ = pool.Exec(ctx, `DROP SCHEMA IF EXISTS idemq_example CASCADE`)
	defer pool.Exec(ctx, `DROP SCHEMA IF EXISTS idemq_example CASCADE`)
	if err := store.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	_, _ = pool.Exec(ctx, `CREATE TABLE idemq_example.greetings (name text)`)

	broker := memory.NewBroker()
	_ = broker.Publish(ctx, "greetings",
		&consumer.Message{ID: "m1", Body: []byte("Ada")},
		&consumer.Message{ID: "m2", Body: []byte("Grace")},
		&consumer.Message{ID: "m1", Body: []byte("Ada")}, // redelivered
		&consumer.Message{ID: "m3", Body: []byte("")},
	)
	sub, _ := broker.Subscribe("greetings", memory.SubscribeOptions{})

	rt, err := consumer.New(consumer.Config{
		Name:   "greeter",
		Source: sub,
		Store:  store,
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if len(msg.Body) == 0 {
				return consumer.Permanent(errors.New("empty name"))
			}
			_, err := tx.Exec(ctx, `INSERT INTO idemq_example.greetings VALUES ($1)`, string(msg.Body))
			return err
		},
		Concurrency: 1,
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- rt.Run(runCtx) }()
	_ = broker.WaitFor(ctx, "greetings", memory.Drained)
	for rt.Stats().InFlight > 0 {
		time.Sleep(time.Millisecond)
	}
	stop()
	<-done

	s := rt.Stats()
	fmt.Printf("applied=%d duplicates=%d dead-lettered=%d\n", s.Applied, s.Duplicates, s.DeadLettered)
	dl := broker.Messages("greetings.dlq")[0]
	r, err := dlq.Parse(dl) // the failure envelope
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(r.Class, r.Error)
	// Output:
	// applied=2 duplicates=1 dead-lettered=1
	// permanent permanent: empty name
}

// ExamplePermanent marks input that can never succeed, so it is
// dead-lettered without retries.
func ExamplePermanent() {
	err := consumer.Permanent(fmt.Errorf("unknown account %q", "acct-99"))
	fmt.Println(consumer.IsPermanent(err), err)
	fmt.Println(consumer.IsPermanent(errors.New("deadlock detected")))
	// Output:
	// true permanent: unknown account "acct-99"
	// false
}

// ExampleIDFromHeader dedupes on an id the producer put in a header.
func ExampleIDFromHeader() {
	idFunc := consumer.IDFromHeader("Idempotency-Key")
	id, _ := idFunc(&consumer.Message{Headers: map[string]string{"Idempotency-Key": "order-7/charge"}})
	fmt.Println(id)
	// Output: order-7/charge
}

// ExampleJSON decodes each body into a typed value; a body that does not
// decode is a permanent failure, dead-lettered with the reason.
func ExampleJSON() {
	type payment struct {
		Account string `json:"account"`
		Cents   int64  `json:"cents"`
	}
	h := consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, p payment) error {
		fmt.Printf("credit %s with %d cents\n", p.Account, p.Cents)
		return nil
	})
	_ = h(context.Background(), nil, &consumer.Message{ID: "m1", Body: []byte(`{"account":"acct-1","cents":250}`)})
	err := h(context.Background(), nil, &consumer.Message{ID: "m2", Body: []byte(`{"account":`)})
	fmt.Println(consumer.IsPermanent(err), err)
	// Output:
	// credit acct-1 with 250 cents
	// true permanent: decode JSON body into consumer_test.payment: unexpected end of JSON input
}

// ExampleExecLater writes each message's row with ExecLater: the handlers of
// a group queue their INSERTs, and the runtime sends them in one round trip
// before it commits the group.
func ExampleExecLater() {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	store, err := processed.Open(ctx, url, processed.Config{Schema: "idemq_example_later"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	pool := store.Pool()
	_, _ = pool.Exec(ctx, `DROP SCHEMA IF EXISTS idemq_example_later CASCADE`)
	defer pool.Exec(ctx, `DROP SCHEMA IF EXISTS idemq_example_later CASCADE`)
	if err := store.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	_, _ = pool.Exec(ctx, `CREATE TABLE idemq_example_later.credits (account text, cents bigint)`)

	broker := memory.NewBroker()
	for i := 1; i <= 100; i++ {
		_ = broker.Publish(ctx, "credits", &consumer.Message{ID: fmt.Sprintf("c%d", i), Body: []byte("acct-1")})
	}
	sub, _ := broker.Subscribe("credits", memory.SubscribeOptions{})
	rt, err := consumer.New(consumer.Config{
		Name:   "credits",
		Source: sub,
		Store:  store,
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			// No result needed: queue the write, and return.
			return consumer.ExecLater(ctx, tx,
				`INSERT INTO idemq_example_later.credits VALUES ($1, $2)`, string(msg.Body), 250)
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- rt.Run(runCtx) }()
	_ = broker.WaitFor(ctx, "credits", memory.Drained)
	for rt.Stats().InFlight > 0 {
		time.Sleep(time.Millisecond)
	}
	stop()
	<-done

	var n, cents int64
	_ = pool.QueryRow(ctx, `SELECT count(*), sum(cents) FROM idemq_example_later.credits`).Scan(&n, &cents)
	fmt.Printf("applied=%d rows=%d cents=%d\n", rt.Stats().Applied, n, cents)
	// Output:
	// applied=100 rows=100 cents=25000
}
