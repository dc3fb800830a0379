package main

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/idemqtest"
)

// ledgerHandler is the handler run builds for the ledger consumer, copied
// here because run declares it inline: moving it to a function of main.go
// (credit(accounts string) consumer.Handler) would let this test run the
// example's own code.
func ledgerHandler(accounts string) consumer.Handler {
	return consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, p Payment) error {
		tag, err := tx.Exec(ctx, `UPDATE `+accounts+` SET balance_cents = balance_cents + $2 WHERE id = $1`, p.Account, p.AmountCents)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return consumer.Permanent(fmt.Errorf("unknown account %q", p.Account))
		}
		return nil
	})
}

// TestLedgerHandlerIsIdempotent runs the ledger consumer's handler through
// idemqtest's cases on the memory broker: no RabbitMQ needed.
func TestLedgerHandlerIsIdempotent(t *testing.T) {
	var msgs []*consumer.Message
	for i := 1; i <= 4; i++ {
		id := fmt.Sprintf("pay-%05d", 90000+i)
		body, _ := json.Marshal(Payment{PaymentID: id, Account: fmt.Sprintf("acct-0%d", 1+i%2), AmountCents: int64(1000 * i)})
		msgs = append(msgs, &consumer.Message{ID: id, Body: body})
	}
	idemqtest.Run(t, idemqtest.Suite{
		Name: consumerName,
		Setup: func(ctx context.Context, env *idemqtest.Env) error {
			_, err := env.Pool.Exec(ctx, `CREATE TABLE accounts (id text PRIMARY KEY, balance_cents bigint NOT NULL DEFAULT 0);
INSERT INTO accounts (id) VALUES ('acct-01'), ('acct-02')`)
			return err
		},
		NewHandler: func(env *idemqtest.Env) consumer.Handler {
			return ledgerHandler(pgx.Identifier{env.Schema, "accounts"}.Sanitize())
		},
		Messages: msgs,
		Effect:   idemqtest.Rows(`SELECT id, balance_cents FROM accounts`),
	})
}
