package main

import (
	"context"
	"log/slog"
	"net/http"
	"testing"

	"github.com/idemq/idemq/httpidem"
	"github.com/idemq/idemq/idemqtest"
)

// TestPaymentsAPIIsIdempotent runs the example's own API, as newApp builds
// it, through idemqtest's HTTP cases.
func TestPaymentsAPIIsIdempotent(t *testing.T) {
	client := func(id string) http.Header {
		return http.Header{"X-Client-Id": {id}, "Content-Type": {"application/json"}}
	}
	idemqtest.Run(t, idemqtest.HTTPSuite{
		Handler: func(ctx context.Context, env *idemqtest.Env) (http.Handler, *httpidem.Middleware, error) {
			return newApp(ctx, env.Pool, env.Schema, slog.New(slog.DiscardHandler))
		},
		Requests: []idemqtest.Request{
			{Target: "/payments", Header: client("shop-1"), Body: `{"account": "acct-1", "amount_cents": 500, "client_time": "2026-12-01T10:00:00Z"}`},
			{Target: "/payments", Header: client("shop-1"), Body: `{"account": "acct-2", "amount_cents": 1200}`},
			{Target: "/payments", Header: client("shop-2"), Body: `{"account": "acct-1", "amount_cents": 75}`},
			// A 4xx is stored and replayed like any answer.
			{Target: "/payments", Header: client("shop-2"), Body: `{"account": "", "amount_cents": 1}`},
		},
		Effect: func(ctx context.Context, env *idemqtest.Env) (any, error) {
			accounts, err := idemqtest.Rows(`SELECT id, balance_cents FROM accounts`)(ctx, env)
			if err != nil {
				return nil, err
			}
			// created_at defaults to now(): left out.
			payments, err := idemqtest.Rows(`SELECT id, account, amount_cents FROM payments`)(ctx, env)
			return map[string]any{"accounts": accounts, "payments": payments}, err
		},
	})
}
