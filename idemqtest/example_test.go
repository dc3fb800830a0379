package idemqtest_test

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/idemqtest"
)

// Payment is a message body.
type Payment struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
}

// credit applies a payment to its account, through the transaction only.
var credit = consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, p Payment) error {
	_, err := tx.Exec(ctx, `UPDATE accounts SET balance_cents = balance_cents + $2 WHERE id = $1`, p.Account, p.Cents)
	return err
})

func payment(id, account string, cents int64) *consumer.Message {
	body, _ := json.Marshal(Payment{account, cents})
	return &consumer.Message{ID: id, Key: account, Body: body}
}

// In a test, call idemqtest.Run(t, suite): each case is a subtest. Check
// runs the same cases and returns their results, as here.
func Example() {
	suite := idemqtest.Suite{
		Setup: func(ctx context.Context, env *idemqtest.Env) error {
			// env.Pool's search_path is the run's fresh schema.
			_, err := env.Pool.Exec(ctx, `CREATE TABLE accounts (id text PRIMARY KEY, balance_cents bigint NOT NULL);
INSERT INTO accounts VALUES ('alice', 0), ('bob', 0)`)
			return err
		},
		Handler:  credit,
		Messages: []*consumer.Message{payment("pay-1", "alice", 500), payment("pay-2", "bob", 120), payment("pay-3", "alice", 80)},
		Effect:   idemqtest.Rows(`SELECT id, balance_cents FROM accounts`),
	}
	results, err := idemqtest.Check(context.Background(), suite)
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range results {
		fmt.Println(r)
	}
	// Output:
	// determinism: ok
	// duplicates-sequential: ok
	// duplicates-concurrent: ok
	// crash-after-commit: ok
	// commit-fails: ok
	// handler-error-retried: ok
	// fingerprint-mismatch: ok
	// dlq-replay: ok
	// batch: SKIP: Suite.BatchHandler is not set
	// rolled-back: ok
}
