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

// TestHandleIsIdempotent runs the quickstart's own handler, workload.handle,
// through idemqtest's cases, on the quickstart's own tables (setupSchema).
// One payment fails transiently on its first attempt, as in the workload.
func TestHandleIsIdempotent(t *testing.T) {
	var msgs []*consumer.Message
	for i, p := range []Payment{
		{PaymentID: "pay-00001", Account: "acct-01", AmountCents: 1250},
		{PaymentID: "pay-00002", Account: "acct-02", AmountCents: 990},
		{PaymentID: "pay-00003", Account: "acct-01", AmountCents: 40, Memo: "refill"},
		{PaymentID: "pay-00004", Account: "acct-50", AmountCents: 100_000},
	} {
		body, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, &consumer.Message{ID: p.PaymentID, Key: p.Account, Body: body,
			Headers: map[string]string{"content-type": "application/json", "n": fmt.Sprint(i)}})
	}
	idemqtest.Run(t, idemqtest.Suite{
		Setup: func(ctx context.Context, env *idemqtest.Env) error {
			return createBusinessTables(ctx, env.Pool, env.Schema)
		},
		NewHandler: func(env *idemqtest.Env) consumer.Handler {
			w := &workload{
				accounts: pgx.Identifier{env.Schema, "accounts"}.Sanitize(),
				ledger:   pgx.Identifier{env.Schema, "ledger"}.Sanitize(),
			}
			w.failOnce.Store("pay-00002", true)
			return w.handle
		},
		Messages: msgs,
		Effect: func(ctx context.Context, env *idemqtest.Env) (any, error) {
			balances, err := idemqtest.Rows(`SELECT id, balance_cents FROM accounts WHERE balance_cents <> 0`)(ctx, env)
			if err != nil {
				return nil, err
			}
			// applied_at defaults to now(): left out.
			ledger, err := idemqtest.Rows(`SELECT payment_id, account, amount_cents FROM ledger`)(ctx, env)
			return map[string]any{"balances": balances, "ledger": ledger}, err
		},
	})
}
