package consumer

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Handler applies one message's effect inside tx, the transaction that also
// holds the message's dedup claim. It must make its changes through tx only
// and must not commit or roll it back: the runtime does. Any side effect
// outside tx (an HTTP call, a publish) is not covered by the exactly-once
// guarantee; use an outbox for those.
//
// Returning nil commits. An error rolls back the effect and the claim
// together; the message is retried unless the error was made by Permanent.
type Handler func(ctx context.Context, tx pgx.Tx, msg *Message) error

// Middleware wraps a Handler, for cross-cutting concerns such as tracing or
// logging. Middleware runs inside the transaction, after the claim: it only
// sees messages that are new.
type Middleware func(Handler) Handler

// Chain applies middleware to h so that the first middleware is the
// outermost.
func Chain(h Handler, mw ...Middleware) Handler {
	for i := len(mw) - 1; i >= 0; i-- {
		h = mw[i](h)
	}
	return h
}
